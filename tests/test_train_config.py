"""``poetx train --config FILE``: a run's options from JSON or YAML, the
command line over them; a run's own run.json trains the same run again."""

import argparse
import dataclasses
import json
import pathlib

import pytest

from poetx_jax.pretrain import cli, rundir
from poetx_jax.pretrain.config import TrainConfig, add_options, config_from_args
from poetx_jax.pretrain.config_text import config_with_file, read_config_file
from conftest import write_corpus

# test_train.py's tiny run (the same programs: compiled once in the suite),
# with the learning rate as YAML writes it: text, which the field reads as a number.
YAML = """\
model: tiny
model_overrides: {{layers: 1, hidden: 32, mlp: 32, heads: 2, kv_heads: 1}}
data: {corpus}
vocab_size: 300
seq_len: 32
batch_size: 4
steps: 600
warmup: 2
lr: 3e-3
merge_every: 4
block_size: 8
eval_every: 6
eval_batches: 2
log_every: 1
checkpoint_every: 100
dtype: float32
cache_dir: {cache}
"""


def _losses(run):
  recs = [json.loads(l) for l in (pathlib.Path(run) / 'metrics.jsonl').read_text().splitlines()]
  return [(r['step'], r['loss']) for r in recs if 'loss' in r]


@pytest.mark.slow
def test_run_json_trains_the_same_run_and_the_command_line_wins(tmp_path, capsys):
  (tmp_path / 'corpus').mkdir()
  write_corpus(tmp_path / 'corpus')
  config = tmp_path / 'run.yaml'
  config.write_text(YAML.format(corpus=tmp_path / 'corpus', cache=tmp_path / 'cache'))
  first, again = tmp_path / 'first', tmp_path / 'again'
  assert cli.main(['train', '--config', str(config), '--steps', '12', '--out-dir', str(first),
                   '--plot', str(tmp_path / 'a.png')]) == 0
  cfg = rundir.read_config(first)
  assert cfg.steps == 12 and cfg.lr == 3e-3 and cfg.data == [str(tmp_path / 'corpus')]
  assert cfg.model_overrides == {'layers': 1, 'hidden': 32, 'mlp': 32, 'heads': 2, 'kv_heads': 1}
  # run.json read back is the run's TrainConfig; trained again, the same losses
  assert config_with_file(first / 'run.json') == cfg
  assert cli.main(['train', '--config', str(first / 'run.json'), '--out-dir', str(again),
                   '--plot', str(tmp_path / 'b.png')]) == 0
  assert rundir.read_config(again) == dataclasses.replace(cfg, out_dir=str(again))
  assert _losses(again) == _losses(first) and len(_losses(first)) == 12
  capsys.readouterr()


def test_bad_config_files_are_refused_by_name(tmp_path, capsys):
  bad = tmp_path / 'bad.yaml'
  bad.write_text('steps: 10\nstepz: 3\nlr_max: 1\n')
  with pytest.raises(ValueError, match=r"bad.yaml: 'stepz', 'lr_max' are not options; valid: "
                                       r"model, model_overrides"):
    read_config_file(bad)
  assert cli.main(['train', '--config', str(bad)]) == 2
  assert "'stepz', 'lr_max' are not options" in capsys.readouterr().err
  for name, text, match in [
      ('a.json', '[1, 2]', 'must hold a mapping of options to values, got list'),
      ('b.json', '{"steps": 1,}', 'not valid JSON'),
      ('c.yaml', 'steps: [1', 'not valid YAML'),
      ('d.toml', 'steps = 1', r"JSON \(.json\) or YAML \(.yaml, .yml\), got the suffix '.toml'"),
      ('e.yaml', 'lr: fast', "lr must be a number or none, got 'fast'"),
      ('g.yaml', 'steps: 4\nsteps: 2\n', r"steps is given twice \(4, then 2\)"),
      ('h.json', '{"steps": 4, "steps": 8}', r"steps is given twice \(4, then 8\)"),
      ('i.yaml', b'steps: 4 # \xff\n', 'not UTF-8 text'),
      ('j.yaml/', '', r'cannot be read \(Is a directory\)'),
      ('m.yaml', '? [1, 2]\n: 3\n', 'a mapping key that is not a plain value')]:
    if name.endswith('/'):  # a directory of a config file's name
      (tmp_path / name).mkdir()
    elif isinstance(text, bytes):
      (tmp_path / name).write_bytes(text)
    else:
      (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=match):
      read_config_file(tmp_path / name)
  # YAML 1.2's core schema: no base-60 numbers, octal 010 or yes/no bools.
  (tmp_path / 'k.yaml').write_text('profile_steps: 2:3\nseed: 010\nwarmup: 0o7\nlr: 1e-3\n')
  assert read_config_file(tmp_path / 'k.yaml') == dict(profile_steps='2:3', seed=10, warmup=7,
                                                       lr=1e-3)
  # A merge (<<) is overridden by the mapping's own keys, not a key given twice.
  from poetx_jax.pretrain.config_text import _read_yaml
  assert _read_yaml('a: &a {x: 1, y: 2}\nb: {<<: *a, y: 3}\nd: 2024-01-01\n') == {
      'a': {'x': 1, 'y': 2}, 'b': {'x': 1, 'y': 3}, 'd': '2024-01-01'}
  (tmp_path / 'l.yaml').write_text('cache_dir: ~\n')  # YAML's null, named with the file
  with pytest.raises(ValueError, match='l.yaml: cache_dir must be a str, got None'):
    config_with_file(tmp_path / 'l.yaml')
  (tmp_path / 'f.json').write_text('{"steps": 0}')
  with pytest.raises(ValueError, match=r'f.json: steps must be an int in \[1, 2147483647\], got 0'):
    config_with_file(tmp_path / 'f.json')
  assert config_with_file(tmp_path / 'f.json', {'steps': 5}) == TrainConfig(steps=5)
  assert cli.main(['train', '--config', str(tmp_path / 'f.json'), '--resume']) == 2
  assert '--config does not go with --resume' in capsys.readouterr().err


def test_paths_under_home_in_a_config_file_are_the_home_directory(tmp_path, monkeypatch):
  """A config file's "~/..." (no shell expands it) and ``--out-dir=~/...``
  name the home directory: the run's data and run directory are there, and
  --resume finds the run there; the cache keeps its "~" (run.json stays
  portable); nothing names a directory '~'."""
  from poetx_jax.pretrain.options import command_options, finish_options
  home = tmp_path / 'home'
  (home / 'corpus').mkdir(parents=True)
  write_corpus(home / 'corpus')
  monkeypatch.setenv('HOME', str(home))
  monkeypatch.chdir(tmp_path)
  config = tmp_path / 'run.yaml'
  config.write_text(YAML.format(corpus='~/corpus', cache='~/cache') + 'out_dir: ~/runs/one\n')
  cfg = finish_options(command_options(TrainConfig(), (), config_file=str(config)),
                       resume=False)
  assert cfg.data == [str(home / 'corpus')] and cfg.out_dir == str(home / 'runs' / 'one')
  assert cfg.cache_dir == '~/cache'
  (home / 'runs' / 'one').mkdir(parents=True)
  rundir.write_config(home / 'runs' / 'one', cfg)
  resumed = command_options(TrainConfig(out_dir='~/runs/one', steps=700), {'out_dir', 'steps'},
                            resume=True)
  assert resumed == dataclasses.replace(cfg, steps=700)
  assert not (tmp_path / '~').exists()


def test_a_config_files_true_bool_is_turned_off_on_the_command_line(tmp_path):
  """Every bool has a --no- flag, so a config file's (or a run.json's) true
  can be undone: the command line overrides the file."""
  from poetx_jax.pretrain.options import command_options
  config = tmp_path / 'run.yaml'
  config.write_text('scan_layers: true\ntie_permutations: true\n')
  argv = ['--no-scan-layers']
  full, bare = argparse.ArgumentParser(), argparse.ArgumentParser()
  add_options(full)
  add_options(bare, defaults=False)  # holds only the options given
  cfg = command_options(config_from_args(full.parse_args(argv)), vars(bare.parse_args(argv)),
                        config_file=str(config))
  assert (cfg.scan_layers, cfg.tie_permutations) == (False, True)
