"""experiments/harness.py: the run-spec grammar, the child protocol and the
record; and every experiments command written in the docs parses today."""

import argparse
import importlib
import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from experiments import harness
from poetx_jax.pretrain.config import TrainConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_spec_expands_into_every_combination_of_its_alternatives():
  runs = harness.expand('optimizer=poetx,lr=1e-3|2e-3,seed=0|1')
  assert [r.overrides for r in runs] == [
      'optimizer=poetx,lr=1e-3,seed=0', 'optimizer=poetx,lr=1e-3,seed=1',
      'optimizer=poetx,lr=2e-3,seed=0', 'optimizer=poetx,lr=2e-3,seed=1']
  assert [r.label for r in runs] == [r.overrides for r in runs]  # unlabelled: by overrides


def test_labels_name_the_values_a_sweep_chose():
  (one,) = harness.expand('xq:optimizer=poetx,quantize=int8')
  assert (one.label, one.overrides) == ('xq', 'optimizer=poetx,quantize=int8')
  swept = harness.expand('xq:optimizer=poetx,quantize=int8|int4,model_overrides={layers=1,mlp=64}')
  assert [(r.label, r.overrides) for r in swept] == [
      ('xq quantize=int8', 'optimizer=poetx,quantize=int8,model_overrides={layers=1,mlp=64}'),
      ('xq quantize=int4', 'optimizer=poetx,quantize=int4,model_overrides={layers=1,mlp=64}')]
  # a colon inside a value is no label; an empty spec is the base run
  (url,) = harness.expand('data=hf:owner/name')
  assert url.label == 'data=hf:owner/name' and url.pairs == (('data', 'hf:owner/name'),)
  assert harness.expand('') == [harness.Run('base', ())]


def test_bad_specs_are_refused_naming_what_is_wrong():
  with pytest.raises(ValueError, match='lr is given twice'):
    harness.expand('lr=1e-3,lr=2e-3')
  with pytest.raises(ValueError, match="run 'a' is given twice"):
    harness.expand_all(['a:lr=1e-3', 'a:lr=2e-3'])
  with pytest.raises(ValueError, match="'poet_rate' .* is not an option"):
    harness.apply(TrainConfig(), 'poet_rate=1')


def test_apply_reads_values_as_poetx_train_does():
  (run,) = harness.expand('optimizer=adamw,lr=3e-4,model_overrides={layers=2},lean_state=true')
  cfg = harness.apply(TrainConfig(), run)
  assert (cfg.optimizer, cfg.lr, cfg.model_overrides, cfg.lean_state) == (
      'adamw', 3e-4, {'layers': 2}, True)


def test_a_child_gets_its_run_back_and_its_module_resolves_from_anywhere(tmp_path):
  """The parent's command runs the module with its options and --child JSON:
  bench_train's child reads back the very Run (tuples, not JSON's lists);
  the command resolves the module from another directory through child_env
  and its last stdout line is its result."""
  from experiments import bench_train
  (run,) = harness.expand('xq:optimizer=poetx,model_overrides={layers=1,mlp=64}')
  cmd = harness.child_command('bench_train', ['--model', 'tiny'],
                              {'label': run.label, 'pairs': run.pairs})
  assert cmd[:3] == [sys.executable, '-m', 'experiments.bench_train']
  p = argparse.ArgumentParser()
  bench_train.add_run_args(p)
  a = p.parse_args(cmd[3:])
  assert a.model == 'tiny' and bench_train.child_run(a) == run
  assert bench_train.child_run(p.parse_args([])) is None
  proc = subprocess.run([sys.executable, '-m', 'experiments.results_page', '--help'], cwd=tmp_path,
                        capture_output=True, text=True,
                        env=harness.child_env({'PATH': '/usr/bin:/bin'}))
  assert proc.returncode == 0 and 'RESULTS.md' in proc.stdout, proc.stderr


def test_a_record_holds_its_header_and_reads_back_its_results(tmp_path):
  path = tmp_path / 'r.json'
  rec = harness.write_record(path, [{'run': 'a', 'step_s': 0.5}], module='bench_train',
                             argv=['--run', 'a:optimizer=adamw', '--model', '1b'])
  back = json.loads(path.read_text())
  assert back['results'] == rec['results'] == [{'run': 'a', 'step_s': 0.5}]
  h = back['header']
  assert h['command'] == "python3 -m experiments.bench_train --run a:optimizer=adamw --model 1b"
  assert re.fullmatch(r'[0-9a-f]{7,40}(-dirty)?|unknown', h['commit'])
  assert re.fullmatch(r'\d+ x .+', h['device']) and 'jax ' in h['software']
  given = harness.write_record(path, [], module='m', argv=[], device='2 x GPU')
  assert given['header']['device'] == '2 x GPU'
  assert harness.children_device([{'run': 'a', 'error': 'x'},
                                  {'device': 'H100', 'devices': 2}]) == '2 x H100'
  assert re.fullmatch(r'\d{4}-\d\d-\d\d', h['date'])
  assert harness.results_of(back) == [{'run': 'a', 'step_s': 0.5}]
  assert harness.results_of([{'run': 'old'}]) == [{'run': 'old'}]  # a bare older record
  assert not list(tmp_path.glob('*.tmp'))


def test_recorded_commands_are_shown_in_todays_form():
  assert harness.todays_form('python3 experiments/bench_train.py --model 1b > x.json') == (
      'python3 -m experiments.bench_train --model 1b > x.json')
  assert harness.todays_form('python experiments/site_corpus.py') == (
      'python3 -m experiments.site_corpus')
  assert harness.todays_form('python3 -m experiments.x --y') == 'python3 -m experiments.x --y'


def test_no_script_edits_sys_path():
  for path in [*ROOT.glob('experiments/*.py'), *ROOT.glob('tests/*.py')]:
    assert 'sys.path.insert' not in path.read_text() or path.name == 'test_harness.py', path


# ---------------------------------------------------- the commands of the docs
DOCS = ['README.md', 'RESULTS.md', *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob('docs/*.md')),
        *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob('docs/results/*/README.md'))]
COMMAND = re.compile(r'python3? -m experiments\.(\w+)')
OLD_FORM = re.compile(r'python3? experiments/\w+\.py')
SHELL_END = {'>', '>>', '|', '&&', '||', ';', '2>&1', '&'}


def doc_commands(text: str) -> list[tuple[str, list[str]]]:
  """Every ``python3 -m experiments.NAME ...`` command of a markdown text:
  its module and arguments (backslash continuations joined; an inline code
  span read to its closing backtick; ``$NAME`` replaced by the text's
  ``NAME="..."`` assignment before it; shell redirections, pipes and
  comments cut)."""
  text = re.sub(r'\\\n\s*', ' ', text)
  out = []
  for m in COMMAND.finditer(text):
    line_start = text.rfind('\n', 0, m.start()) + 1
    if text[line_start:m.start()].count('`') % 2:  # inside an inline code span
      rest = text[m.end():text.index('`', m.end())].replace('\n', ' ')
    else:
      end = text.find('\n', m.end())
      rest = text[m.end():end if end >= 0 else len(text)]
    shell = dict(re.findall(r'^\s*(\w+)="([^"]*)"', text[:m.start()], flags=re.M))
    rest = re.sub(r'\$\{?(\w+)\}?', lambda v: shell.get(v.group(1), v.group(0)), rest)
    args = []
    for tok in shlex.split(rest, comments=True):
      if tok in SHELL_END or tok.startswith(('>', '2>')):
        break
      args.append(tok)
    out.append((m.group(1), args))
  return out


class _Parsed(BaseException):  # past any `except Exception` of a script
  pass


def parses(module: str, argv: list[str], monkeypatch) -> None:
  """Runs ``experiments.MODULE.main(argv)`` until its parser has read
  ``argv`` (a bad option exits 2 here, as it would for the user), then reads
  its run specs (``--run``, ``--runs``, ``--variants``) as the harness does:
  each a spec whose keys are options and whose values they take."""
  known = argparse.ArgumentParser.parse_known_args
  specs = []

  def parsed(ns):
    for name in ('run', 'runs', 'variants'):
      value = getattr(ns, name, None)
      specs.extend([value] if isinstance(value, str) else value or [])
    raise _Parsed

  def parse_only(self, args=None, namespace=None):
    ns, extras = known(self, args, namespace)
    if extras:
      self.error(f'unrecognized arguments: {" ".join(extras)}')
    parsed(ns)

  def parse_known_only(self, args=None, namespace=None):
    parsed(known(self, args, namespace)[0])

  monkeypatch.setattr(argparse.ArgumentParser, 'parse_args', parse_only)
  monkeypatch.setattr(argparse.ArgumentParser, 'parse_known_args', parse_known_only)
  try:
    importlib.import_module(f'experiments.{module}').main(argv)
  except SystemExit as e:  # --help exits 0
    if e.code:
      raise
    return
  except _Parsed:
    for run in (r for spec in specs for r in harness.expand(spec)):
      harness.apply(TrainConfig(), harness.Run(run.label, tuple(
          (k, v) for k, v in run.pairs if (k, v) != ('lr', 'best'))))  # compare_quality's
    return
  pytest.fail(f'experiments.{module}.main returned without parsing its options')


@pytest.mark.parametrize('doc', DOCS)
def test_every_experiments_command_in_the_docs_parses(doc, monkeypatch):
  """Each command a page shows is run as a module and is accepted by its
  script's parser today; none is written in the old script-path form."""
  text = (ROOT / doc).read_text()
  for line in text.splitlines():  # a command of an older commit says so on its line
    old = OLD_FORM.search(line)
    assert not old or 'not runnable today' in line, f'{doc}: {old.group()}'
  for module, argv in doc_commands(text):
    assert (ROOT / 'experiments' / f'{module}.py').is_file(), f'{doc}: no experiments.{module}'
    try:
      parses(module, argv, monkeypatch)
    except (SystemExit, ValueError) as e:
      pytest.fail(f'{doc}: python3 -m experiments.{module} {shlex.join(argv)}: {e!r}')


def test_doc_commands_are_read_whole():
  text = ('Run `python3 -m experiments.a --x 1` then `python3 -m experiments.a\n--w 2`\n\n'
          '    P="--q 5 --r 6"\n'
          '    python3 -m experiments.b $P --y "2 3" \\\n        --z 4 > out.log 2>&1  # note\n')
  assert doc_commands(text) == [('a', ['--x', '1']), ('a', ['--w', '2']),
                                ('b', ['--q', '5', '--r', '6', '--y', '2 3', '--z', '4'])]
