"""docs/cli.md is what poetx_jax.pretrain.cli_reference writes from the parsers now."""

import dataclasses
import pathlib

from poetx_jax.pretrain import cli, cli_reference
from poetx_jax.pretrain.config import TrainConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_cli_md_is_generated_from_the_parsers():
  """An option added, removed or reworded without the page, or the page
  edited by hand, fails here: run ``python3 -m poetx_jax.pretrain.cli_reference``."""
  assert (ROOT / 'docs' / 'cli.md').read_text() == cli_reference.report(), (
      'docs/cli.md is stale: run python3 -m poetx_jax.pretrain.cli_reference')


def test_every_command_and_option_is_on_the_page():
  text = cli_reference.report()
  commands = cli_reference._subparsers(cli.build_parser())
  assert {'train', 'eval', 'export', 'plot', 'prepare'} <= set(commands)
  for name, parser in commands.items():
    assert f'## `poetx {name}`' in text
    for action in parser._actions:
      for flag in action.option_strings:
        if flag not in ('-h', '--help'):
          assert f'`{flag}' in text or f', {flag}' in text, (name, flag)
  for field in dataclasses.fields(TrainConfig):
    assert f'(`{field.name}`' in text, field.name


def test_the_text_does_not_depend_on_the_terminal(monkeypatch):
  wide = cli_reference.report()
  monkeypatch.setenv('COLUMNS', '30')
  assert cli_reference.report() == wide


def test_check_exits_1_on_a_stale_page(tmp_path, capsys):
  page = tmp_path / 'cli.md'
  assert cli_reference.main(['--out', str(page)]) == 0
  assert cli_reference.main(['--out', str(page), '--check']) == 0
  page.write_text(page.read_text().replace('--steps', '--stepz'))
  assert cli_reference.main(['--out', str(page), '--check']) == 1
  assert 'stale' in capsys.readouterr().err
