"""Faults in a run's files and in what it reports, injected into tiny runs on
the CPU: checkpoint bytes changed in place, a diverged state checkpointed
before its loss was seen, a refused resume, repeated abandonments, a cut
metrics line, a stop between validations, and eval against training's
validation. Each ends in a run that goes on from a good state, or in one line
on stderr with its exit status (cli.main), and never loses data."""

import dataclasses
import json
import os
import re
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest

from poetx_jax.pretrain import cli, loading
from poetx_jax.pretrain import train as train_lib
from poetx_jax.pretrain.checkpoint import Checkpointer
from test_faults import _assert_same_run, _cfg, _copy, _one_line_error

# Each test trains, resumes or reads a whole run (most the session's reference run).
pytestmark = pytest.mark.slow


def _tree(run):
  """{path: bytes} of every file of a run directory."""
  run = pathlib.Path(run)
  return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob('*'))
          if p.is_file()}


def _set_aside(run, folder):
  """{folder name: [steps]} of a run's damaged- or abandoned-checkpoints."""
  root = pathlib.Path(run) / folder
  return {d.name: sorted(int(s.name) for s in d.iterdir()) for d in sorted(root.iterdir())}


def test_changed_bytes_of_a_checkpoint_are_found_by_its_digests(tmp_path, reference, capsys):
  """400 bytes flipped in the newest step's largest model file, its size kept:
  eval and export refuse it naming the file; --resume names it, sets it aside
  and trains 8 -> 12 again to the same state."""
  cfg = _copy(reference, tmp_path)
  run = pathlib.Path(cfg.out_dir)
  f = max((run / 'checkpoints' / '12' / 'model').rglob('d/*'), key=lambda f: f.stat().st_size)
  data = bytearray(f.read_bytes())
  middle = len(data) // 2
  data[middle:middle + 400] = bytes(b ^ 0xFF for b in data[middle:middle + 400])
  f.write_bytes(bytes(data))
  name = str(f.relative_to(run / 'checkpoints' / '12'))

  assert cli.main(['eval', str(run)]) == 2
  err = _one_line_error(capsys, 'eval')
  assert 'checkpoint step 12' in err and f'its file {name} changed' in err and '--step' in err
  assert all((run / 'checkpoints' / str(s) / 'digests.json').is_file() for s in (4, 8, 12))
  assert cli.main(['export', str(run), '--out', str(tmp_path / 'hf')]) == 2
  assert f'its file {name} changed' in _one_line_error(capsys, 'export')
  assert cli.main(['train', '--resume', '--out-dir', str(run)]) == 0
  out = capsys.readouterr().out
  assert (f'WARNING: checkpoint step 12 in {run / "checkpoints"} is damaged: its file {name} '
          f'changed') in out
  assert 'WARNING: resuming from step 8, the newest intact checkpoint, not 12' in out
  (found,) = _set_aside(run, 'damaged-checkpoints').values()
  assert found == [12]
  _assert_same_run(cfg, reference)


def test_a_diverged_state_checkpointed_before_its_loss_is_named_as_suspect(
    tmp_path, corpus, capsys, monkeypatch):
  """The state of step 4 is finite but overflows (the final norm's weight at
  3e38) and is checkpointed; the loss, fetched every 6 steps, is seen to be
  NaN at step 6. The message says the state went bad in steps 1 to 5 and
  that checkpoint 4 may hold it; eval of it exits 3."""
  def overflow(run):  # before the checkpoint of step 4
    if run.step == 4:
      run.model.norm.weight[...] = jnp.full_like(run.model.norm.weight[...], 3e38)

  cfg = _cfg(tmp_path, corpus, log_every=6, eval_every=12)
  with pytest.raises(train_lib.NonFiniteLoss) as e:
    train_lib.train(cfg, log=lambda *_: None, hooks=[train_lib.Hook(overflow)])
  msg = str(e.value)
  assert 'the loss became nan at step 6, computed from the state of step 5' in msg
  assert 'fetched every 6 steps' in msg
  assert 'the state went bad in one of the steps 1 to 5' in msg
  assert 'checkpoint step 4' in msg and 'may hold the bad state' in msg
  assert 'no checkpoint is from before' in msg
  assert Checkpointer(pathlib.Path(cfg.out_dir) / 'checkpoints').all_steps() == [4]
  assert cli.main(['eval', cfg.out_dir]) == 3
  err = _one_line_error(capsys, 'eval')
  assert re.search(r'the validation loss of checkpoint step 4 is (nan|inf)', err)


def test_a_refused_resume_writes_nothing(tmp_path, reference, capsys):
  """--resume --data OTHER (another corpus) is refused and leaves every file
  of the run as it was: eval of the run still works."""
  cfg = _copy(reference, tmp_path)
  other = tmp_path / 'other'
  other.mkdir()
  (other / 'a.txt').write_text('another corpus altogether, ' * 400)
  before = _tree(cfg.out_dir)
  assert cli.main(['train', '--resume', '--out-dir', cfg.out_dir, '--data', str(other)]) == 2
  err = _one_line_error(capsys)
  assert 'the corpus no longer matches the run' in err and str(other) in err
  assert _tree(cfg.out_dir) == before
  assert cli.main(['eval', cfg.out_dir]) == 0


def test_a_resume_refused_for_a_missing_tracker_moves_no_checkpoint(
    tmp_path, reference, capsys, monkeypatch):
  """--resume --step 8 --tracking wandb without wandb: refused before the
  newer checkpoint is set aside."""
  monkeypatch.setitem(sys.modules, 'wandb', None)  # import wandb raises ImportError
  cfg = _copy(reference, tmp_path)
  before = _tree(cfg.out_dir)
  assert cli.main(['train', '--resume', '--step', '8', '--out-dir', cfg.out_dir,
                   '--tracking', 'wandb']) == 2
  assert '--tracking wandb needs the wandb package' in _one_line_error(capsys)
  assert _tree(cfg.out_dir) == before


def test_a_run_json_of_relative_paths_resumes(tmp_path, reference, monkeypatch):
  """A run.json from before paths were recorded absolute (data and tokenizer
  relative to the directory training ran in) resumes from there as it was."""
  cfg = _copy(reference, tmp_path)
  run = pathlib.Path(cfg.out_dir)
  saved = json.loads((run / 'run.json').read_text())
  monkeypatch.chdir(tmp_path)
  saved.update(data=[os.path.relpath(d, tmp_path) for d in saved['data']],
               tokenizer='run/tokenizer.json')
  assert not any(os.path.isabs(d) for d in saved['data'])
  (run / 'run.json').write_text(json.dumps(saved))
  assert cli.main(['train', '--resume', '--step', '8', '--out-dir', 'run']) == 0
  _assert_same_run(cfg, reference)


def test_each_abandonment_keeps_its_checkpoints(tmp_path, reference, capsys):
  """--resume --step 8 sets 12 aside and writes a new 12; --resume --step 4
  then sets 8 and the new 12 aside in a folder of their own: nothing lost."""
  cfg = _copy(reference, tmp_path)
  run = pathlib.Path(cfg.out_dir)
  assert cli.main(['train', '--resume', '--step', '8', '--out-dir', str(run)]) == 0
  assert cli.main(['train', '--resume', '--step', '4', '--out-dir', str(run)]) == 0
  out = capsys.readouterr().out
  assert len(list((run / 'abandoned-checkpoints').rglob('*/model'))) == 3  # 12, 8, 12
  folders = {name.rsplit('-resumed-from-', 1)[1]: steps
             for name, steps in _set_aside(run, 'abandoned-checkpoints').items()}
  assert folders == {'8': [12], '4': [8, 12]}, folders
  (second,) = (n for n in os.listdir(run / 'abandoned-checkpoints') if n.endswith('-from-4'))
  assert (f'moved the newer checkpoint steps [8, 12] to '
          f'{run / "abandoned-checkpoints" / second}') in out
  assert ('resumed from step 8, as --step chose: the run had reached step 12, so steps 9-12 '
          'are trained again') in out
  assert 'resumed from step 4, as --step chose' in out and 'a kill or crash' not in out
  _assert_same_run(cfg, reference)


def test_a_cut_last_metrics_line_is_dropped_and_others_named(tmp_path, reference, capsys):
  """A metrics.jsonl whose last line was cut by a crash mid-write: --resume and
  plot warn naming file and line and drop it; a damaged line before the last
  is an error naming file and line."""
  cfg = _copy(reference, tmp_path)
  path = pathlib.Path(cfg.out_dir) / 'metrics.jsonl'
  lines = path.read_text().splitlines()
  n = len(lines) + 1
  path.write_text(''.join(l + '\n' for l in lines) + '{"step": 12, "lo')
  assert cli.main(['train', '--resume', '--out-dir', cfg.out_dir]) == 0
  out = capsys.readouterr().out
  assert f'WARNING: {path} line {n} is cut short' in out and 'dropped' in out
  assert path.read_text().splitlines() == lines

  path.write_text(''.join(l + '\n' for l in lines) + '{"step": 12, "lo')
  assert cli.main(['plot', cfg.out_dir, '--out', str(tmp_path / 'loss.png')]) == 0
  assert f'WARNING: {path} line {n} is cut short' in capsys.readouterr().err

  lines[3] = lines[3][:10]
  path.write_text(''.join(l + '\n' for l in lines))
  for command in (['train', '--resume', '--out-dir', cfg.out_dir],
                  ['plot', cfg.out_dir, '--out', str(tmp_path / 'loss.png')]):
    assert cli.main(command) == 2
    err = _one_line_error(capsys, command[0])
    assert f'{path} line 4 is not a JSON record' in err


def test_validation_figures_name_their_step(tmp_path, reference, capsys):
  """A resumed run stopped at step 19 last validated at step 18: its summary
  says so, and how many validation windows it used."""
  cfg = _copy(reference, tmp_path)
  messages = []
  summary = train_lib.train(dataclasses.replace(cfg, steps=20), resume=True, stop_after=7,
                            log=messages.append)
  assert summary['step'] == 19 and summary['val_after']['step'] == 18
  val = [json.loads(l) for l in (pathlib.Path(cfg.out_dir) / 'metrics.jsonl').read_text()
         .splitlines()]
  assert summary['val_after']['loss'] == next(r['val_loss'] for r in val
                                              if r['step'] == 18 and 'val_loss' in r)
  assert any(m.startswith('step 18: validation loss') for m in messages), messages
  assert not any(m.startswith('step 19: validation') for m in messages)
  assert any(m.startswith('step 18: validation') and '(8 of 25 validation windows)' in m
             for m in messages), messages
  cli._report(summary, str(tmp_path / 'loss.png'))  # pylint: disable=protected-access
  assert 'validation perplexity: ' in (report := capsys.readouterr().out)
  assert 'at step 18' in report


def test_eval_scores_the_runs_validation_windows(tmp_path, reference, capsys):
  """eval scores the windows training validated on (the run's --eval-batches):
  the same loss; --eval-batches N or all scores others, saying how many."""
  cfg = _copy(reference, tmp_path)
  val = [json.loads(l) for l in (pathlib.Path(cfg.out_dir) / 'metrics.jsonl').read_text()
         .splitlines()]
  assert cli.main(['eval', cfg.out_dir]) == 0
  ours = json.loads(capsys.readouterr().out)
  assert ours['step'] == 12 and ours['val_windows'] == 8 and ours['val_windows_total'] == 25
  assert ours['val_loss'] == pytest.approx(
      next(r['val_loss'] for r in val if r['step'] == 12 and 'val_loss' in r), rel=1e-6)
  for flag, windows in (('all', 25), ('1', 4), ('run', 8)):
    assert cli.main(['eval', cfg.out_dir, '--eval-batches', flag]) == 0
    assert json.loads(capsys.readouterr().out)['val_windows'] == windows
  assert cli.main(['eval', cfg.out_dir, '--eval-batches', '0']) == 2
  assert ("--eval-batches must be a count >= 1, 'run' or 'all', got '0'"
          in _one_line_error(capsys, 'eval'))


def test_eval_of_a_run_whose_corpus_moved_is_told_where_it_is(tmp_path, reference, capsys):
  """A run's corpus moved: poetx eval names the missing path and how to say
  where it went; with --data (its splits checked against the run's) it
  scores the run as before."""
  cfg = _copy(reference, tmp_path)
  run = pathlib.Path(cfg.out_dir)
  shutil.copytree(cfg.data[0], tmp_path / 'corpus')
  config = json.loads((run / 'run.json').read_text())
  config['data'] = [str(tmp_path / 'corpus')]
  (run / 'run.json').write_text(json.dumps(config))
  assert cli.main(['eval', str(run)]) == 0
  before = json.loads(capsys.readouterr().out)
  (tmp_path / 'corpus').rename(tmp_path / 'moved')
  assert cli.main(['eval', str(run)]) == 2
  err = _one_line_error(capsys, 'eval')
  assert str(tmp_path / 'corpus') in err and f'poetx eval {run} --data PATH...' in err, err
  assert cli.main(['eval', str(run), '--data', str(tmp_path / 'moved')]) == 0
  assert json.loads(capsys.readouterr().out)['val_loss'] == before['val_loss']
  (tmp_path / 'other').mkdir()  # another text: refused, its splits not the run's
  (tmp_path / 'other' / 'a.txt').write_text(' '.join(f'word{i % 50}' for i in range(20000)))
  assert cli.main(['eval', str(run), '--data', str(tmp_path / 'other')]) == 2
  assert 'poetx eval: error: ' in _one_line_error(capsys, 'eval')


def test_sigterm_before_the_options_are_read(tmp_path, capsys, monkeypatch):
  """A SIGTERM while the command's options are still being read (jax being
  imported, the first seconds of every command) exits 143 with its line,
  nothing written; and the poetx command module imports no jax itself, so
  that window starts almost at launch."""
  def terminated(*a, **k):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler raises first
    raise AssertionError('no SIGTERM')

  monkeypatch.setattr(cli, 'build_parser', terminated)
  with pytest.raises(SystemExit) as e:
    cli.main(['train', '--out-dir', str(tmp_path / 'run')])
  assert e.value.code == 143 and not (tmp_path / 'run').exists()
  assert capsys.readouterr().err.strip() == (
      'poetx train: stopped by SIGTERM while starting: nothing was written')
  imported = subprocess.run(
      [sys.executable, '-c', 'import sys, poetx_jax.pretrain.cli; '
       'print(sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "flax", "optax")))'],
      capture_output=True, text=True, check=True)
  assert imported.stdout.strip() == '[]'


def test_step_errors_and_sigterm_during_start_up(tmp_path, corpus, capsys, monkeypatch):
  """--step -1 and --step without --resume each name their fault; a SIGTERM
  while the data is read stops with a line saying nothing was saved, and
  --resume then says there is nothing to resume, to start afresh."""
  run = tmp_path / 'run'
  assert cli.main(['train', '--resume', '--step', '-1', '--out-dir', str(run)]) == 2
  assert '--step must be a checkpoint step >= 0, got -1' in _one_line_error(capsys)
  assert cli.main(['train', '--step', '4', '--out-dir', str(run)]) == 2
  assert '--step 4 needs --resume' in _one_line_error(capsys)

  def terminated(*a, **k):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler raises first
    raise AssertionError('no SIGTERM')

  monkeypatch.setattr(loading, 'load_data', terminated)
  args = ['--data', str(corpus), '--out-dir', str(run), '--cache-dir', str(tmp_path / 'c')]
  with pytest.raises(SystemExit) as e:
    cli.main(['train', *args])
  assert e.value.code == 143
  said = capsys.readouterr()
  assert 'stopped by SIGTERM while starting, before any checkpoint' in said.out
  assert said.err.strip() == 'poetx train: stopped by SIGTERM'
  monkeypatch.undo()
  monkeypatch.setattr(train_lib, 'finish_options', terminated)  # while the devices start
  with pytest.raises(SystemExit) as e:
    cli.main(['train', *args])
  assert e.value.code == 143 and not run.exists()
  said = capsys.readouterr()
  assert 'before the run directory was opened: nothing was written' in said.out
  assert said.err.strip() == 'poetx train: stopped by SIGTERM'
  monkeypatch.undo()
  assert cli.main(['train', '--resume', *args]) == 2
  err = _one_line_error(capsys)
  assert 'nothing to resume' in err and not run.exists()  # the refused start wrote nothing
