"""Faults while training, injected into tiny runs on the CPU: kill -9 at chosen
points, damaged checkpoints, a non-finite state, a second writer, unusable
run directories. Each must end in a run that resumes exactly as if nothing
had happened, or in one line on stderr with its exit status (cli.main)."""

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import chex
import jax
import pytest
from flax import nnx

from conftest import SMALL, overrides
from poetx_jax.pretrain import cli, loading, run_lock, rundir
from poetx_jax.pretrain import train as train_lib
from poetx_jax.pretrain.checkpoint import Checkpointer, DamagedCheckpoint
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.factories import build_model, build_optimizer
from poetx_jax.pretrain.plan import make_plan

# Merges after updates 3, 6, 9, 12; checkpoints at 4, 8, 12.
TINY = dict(model='tiny', model_overrides=SMALL,
            vocab_size=300, seq_len=32, batch_size=4, steps=12, warmup=2, merge_every=3,
            block_size=8, eval_every=6, eval_batches=2, log_every=1, checkpoint_every=4,
            dtype='float32')

# A training in a subprocess that kills itself (SIGKILL, as kill -9) in a
# hook right after the given step is dispatched, or after its save starts.
KILLED = '''
import json, os, signal, sys
import jax
from flax import nnx
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.train import Hook, train
cfg, event, at, resume = json.loads(sys.argv[1])

def kill(run):
  if run.step != at:
    return
  if event in ('step', 'merged'):  # the checkpoints before are written
    run.ckpt.wait()
  if event == 'merged':  # and the merge that the step dispatched is done
    jax.block_until_ready(nnx.state(run.model))
  os.kill(os.getpid(), signal.SIGKILL)

on = 'save' if event == 'save' else 'step'
train(TrainConfig(**cfg), resume=resume, hooks=[Hook(kill, wait=False, on=on)])
'''


def _cfg(tmp, corpus, **kw):
  return TrainConfig(**{**TINY, 'data': [str(corpus)], 'out_dir': str(tmp / 'run'),
                        'cache_dir': str(tmp.parent / 'cache'), **kw})


def reference_run(tmp, corpus):
  """An uninterrupted run of TINY in ``tmp``: (cfg, losses, final parameters).
  The ``reference`` fixture (conftest.py: one a session, shared by the modules
  that only read or copy it)."""
  cfg = _cfg(tmp, corpus)
  train_lib.train(cfg, log=lambda *_: None)
  return cfg, _losses(cfg.out_dir), _params(cfg)


def _losses(run):
  lines = (pathlib.Path(run) / 'metrics.jsonl').read_text().splitlines()
  return [(r['step'], r['loss']) for r in map(json.loads, lines) if 'loss' in r]


def _params(cfg):
  """(step, every model and optimizer array) of the newest checkpoint."""
  plan = make_plan(cfg, rundir.read_data_record(cfg.out_dir)['vocab_size'])
  model = build_model(plan)
  opt = build_optimizer(plan, model)
  step, _, _ = Checkpointer(pathlib.Path(cfg.out_dir) / 'checkpoints').restore(model, opt)
  return step, nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(opt))


def _assert_same_run(cfg, reference):
  _, losses, (step, model, opt) = reference
  assert _losses(cfg.out_dir) == losses
  got_step, got_model, got_opt = _params(cfg)
  assert got_step == step
  chex.assert_trees_all_equal(got_model, model)
  chex.assert_trees_all_equal(got_opt, opt)


def _copy(reference, tmp):
  """A copy of the reference run directory elsewhere; its cfg."""
  shutil.copytree(reference[0].out_dir, tmp / 'run')
  return dataclasses.replace(reference[0], out_dir=str(tmp / 'run'))


def _one_line_error(capsys, command='train'):
  """The error line of a failed command; there is one and no traceback (other
  lines on stderr are the progress bar's)."""
  err = capsys.readouterr().err
  lines = [l for l in err.splitlines() if l.startswith('poetx ')]
  assert 'Traceback' not in err and len(lines) == 1, err
  assert lines[0].startswith(f'poetx {command}: error: '), err
  return lines[0]


@pytest.mark.slow
def test_kill_9_anywhere_then_resume_equals_the_uninterrupted_run(tmp_path, corpus, reference):
  """SIGKILL during a checkpoint write and right after a merge; each time
  --resume continues (taking over the dead process's lock) and the end is the
  uninterrupted run bit for bit: losses, model and optimizer. (Kills after a
  step: tests/test_fault_injection.py.)"""
  cfg = _cfg(tmp_path, corpus)
  for event, at, resume in (('save', 8, False), ('merged', 9, True)):
    proc = subprocess.run([sys.executable, '-c', KILLED,
                           json.dumps([dataclasses.asdict(cfg), event, at, resume])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (pathlib.Path(cfg.out_dir) / 'train.lock').exists()  # nobody removed it
    if resume:
      assert 'taking over the stale lock' in proc.stdout
    if event == 'merged':  # resumed after the kill that struck the save of step 8
      assert ('resumed from step 4, its newest whole checkpoint: the run had reached step 8, '
              'so steps 5-8 are trained again; the save of step 8 had not finished'
              in proc.stdout), proc.stdout
  messages = []
  train_lib.train(cfg, resume=True, log=messages.append)
  assert any('taking over the stale lock' in m and 'is not running' in m for m in messages)
  assert 'resumed from step 8' in messages  # step 9 was killed before its loss was logged
  assert not (pathlib.Path(cfg.out_dir) / 'train.lock').exists()
  _assert_same_run(cfg, reference)


@pytest.mark.slow
@pytest.mark.parametrize('damage', ['truncated array file', 'missing manifest',
                                    'empty data item', 'missing model item'])
def test_damage_is_told_apart_from_a_configuration_mismatch(tmp_path, reference, damage):
  cfg = _copy(reference, tmp_path)
  step_dir = pathlib.Path(cfg.out_dir) / 'checkpoints' / '12'
  if damage == 'truncated array file':
    f = max((step_dir / 'model').rglob('d/*'), key=lambda f: f.stat().st_size)
    f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])
  elif damage == 'missing manifest':
    (step_dir / 'model' / 'manifest.ocdbt').unlink()
  elif damage == 'empty data item':
    (step_dir / 'data' / 'metadata').write_text('')
  else:
    shutil.rmtree(step_dir / 'model')
  plan = make_plan(cfg, 300)
  model = build_model(plan)
  with pytest.raises(DamagedCheckpoint, match=r'step 12 .* is damaged: .*steps \[4, 8\]') as e:
    Checkpointer(step_dir.parent).restore(model, build_optimizer(plan, model))
  assert e.value.step == 12 and len(str(e.value)) < 700  # no TensorStore dump
  wider = dataclasses.replace(cfg, model_overrides={**cfg.model_overrides, 'hidden': 48})
  model = build_model(make_plan(wider, 300))
  with pytest.raises(Exception, match=r'step 8 .* does not fit this model: its model item '
                                      r'differs \(embed_tokens/embedding saved \(300, 32\), '
                                      r'model \(300, 48\)') as e:
    Checkpointer(step_dir.parent).restore(model, step=8)
  assert not isinstance(e.value, DamagedCheckpoint)


@pytest.mark.slow
def test_load_model_builds_from_the_checkpoint_what_restore_fills_in(reference):
  """load_model restores into the model's shapes (nnx.eval_shape, nothing drawn):
  the model build_model would give, restored in place."""
  cfg, _, (step, model, _) = reference
  _, loaded, got = loading.load_model(cfg.out_dir)
  assert got == step
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(nnx.state(loaded)))
  chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(loaded)), model)
  assert loading.load_model(cfg.out_dir, step=8)[2] == 8


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_resumes_from_the_previous_one(tmp_path, reference,
                                                                   capsys):
  """A copied run, its step 12 truncated: eval names it and the way out;
  --resume (no other option: they come from run.json) says so loudly, sets
  it aside and trains 8 -> 12 again to the same state; --step 4 does it from 4."""
  cfg = _copy(reference, tmp_path)
  run = pathlib.Path(cfg.out_dir)
  f = max((run / 'checkpoints' / '12' / 'model').rglob('d/*'), key=lambda f: f.stat().st_size)
  f.write_bytes(f.read_bytes()[:100])
  assert cli.main(['eval', str(run)]) == 2
  err = _one_line_error(capsys, 'eval')
  assert 'checkpoint step 12' in err and 'damaged' in err and '--step' in err
  assert cli.main(['train', '--resume', '--out-dir', str(run)]) == 0
  out = capsys.readouterr().out
  assert 'WARNING: checkpoint step 12' in out and 'is damaged' in out
  assert 'WARNING: resuming from step 8, the newest intact checkpoint, not 12' in out
  (damaged,) = (run / 'damaged-checkpoints').iterdir()
  assert (damaged / '12' / 'model').is_dir()
  _assert_same_run(cfg, reference)

  assert cli.main(['train', '--resume', '--step', '4', '--out-dir', str(run)]) == 0
  (abandoned,) = (run / 'abandoned-checkpoints').iterdir()
  assert abandoned.name.endswith('-resumed-from-4')
  assert sorted(p.name for p in abandoned.iterdir()) == ['12', '8']
  _assert_same_run(cfg, reference)


@pytest.mark.slow
def test_non_finite_state_keeps_the_last_good_checkpoint_newest(tmp_path, corpus, capsys,
                                                                monkeypatch):
  """The state goes NaN after step 6; with no loss logged before the
  checkpoint of step 8, that save is refused: exit 3, one line, step 4 newest."""
  def poison(run):
    if run.step == 6:
      emb = run.model.embed_tokens.embedding
      emb[...] = emb[...] * float('nan')

  monkeypatch.setattr(train_lib, 'train', lambda *a, **k: _train(
      *a, hooks=[train_lib.Hook(poison, wait=False)], **k))
  run = tmp_path / 'run'
  code = cli.main(['train', '--model-overrides', overrides(SMALL),
                   '--data', str(corpus), '--vocab-size', '300', '--seq-len', '32',
                   '--batch-size', '4', '--steps', '12', '--block-size', '8',
                   '--dtype', 'float32', '--log-every', '6', '--checkpoint-every', '4',
                   '--cache-dir', str(tmp_path.parent / 'cache'), '--out-dir', str(run)])
  assert code == 3
  err = _one_line_error(capsys)
  assert 'training diverged: the model state is not finite at step 8' in err
  assert 'the newest checkpoint, step 4' in err
  assert Checkpointer(run / 'checkpoints').all_steps() == [4]
  assert not (run / 'train.lock').exists()


_train = train_lib.train


def test_a_refused_second_writer_removes_nothing_the_owner_writes_meanwhile(
    tmp_path, corpus, capsys, monkeypatch):
  """A second ``poetx train`` on a run directory another training holds is
  refused before it writes there, so it takes nothing back: files the owner
  adds while it is being refused stay (they once went with it, the owner's
  run.json among them, and the owner's own set-up then failed)."""
  run = tmp_path / 'run'
  run.mkdir()
  take = run_lock.RunLock._take

  def owner_writes_meanwhile(lock):  # between the refused command's start and its refusal
    (run / 'data.json').write_text('{}')
    (run / 'checkpoints').mkdir()
    return take(lock)
  args = ['train', '--model-overrides', overrides(SMALL), '--data', str(corpus),
          '--vocab-size', '300', '--seq-len', '32', '--batch-size', '4', '--steps', '4',
          '--block-size', '8', '--dtype', 'float32', '--cache-dir', str(tmp_path / 'cache'),
          '--out-dir', str(run)]
  with run_lock.RunLock(run):  # the owner, this process (alive, so the lock is not stale)
    monkeypatch.setattr(run_lock.RunLock, '_take', owner_writes_meanwhile)
    assert cli.main(args) == 4
    assert 'is in use by another training' in _one_line_error(capsys)
    assert (run / 'data.json').is_file() and (run / 'checkpoints').is_dir()
    assert (run / 'train.lock').is_file()
  # Refused where it made the directory: the empty directory goes, as before.
  fresh = tmp_path / 'a' / 'b'
  monkeypatch.setattr(run_lock.RunLock, '_take', lambda lock: (_ for _ in ()).throw(
      run_lock.RunLocked('held')))
  assert cli.main(args[:-1] + [str(fresh)]) == 4
  capsys.readouterr()
  assert not (tmp_path / 'a').exists()


@pytest.mark.slow
def test_a_second_writer_is_refused_and_signals_release_the_lock(tmp_path, corpus, capsys):
  run = tmp_path / 'run'
  args = ['train', '--model-overrides', overrides(SMALL),
          '--data', str(corpus), '--vocab-size', '300', '--seq-len', '32', '--batch-size',
          '4', '--steps', '100000', '--block-size', '8', '--dtype', 'float32',
          '--cache-dir', str(tmp_path.parent / 'cache'), '--out-dir', str(run)]
  proc = subprocess.Popen([sys.executable, '-m', 'poetx_jax.pretrain.cli', *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 120
    while not (run / 'run.json').exists() and time.time() < deadline:
      time.sleep(0.05)
    owner = json.loads((run / 'train.lock').read_text())
    assert owner['pid'] == proc.pid and owner['host'] == socket.gethostname()
    for again in (args, ['train', '--resume', '--out-dir', str(run)]):
      assert cli.main(again) == 4
      err = _one_line_error(capsys)
      assert f'is in use by another training: pid {proc.pid} on {owner["host"]}' in err
  finally:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
  assert proc.returncode == 143, err
  assert not (run / 'train.lock').exists()


def test_stale_foreign_and_copied_locks(tmp_path):
  out = tmp_path / 'run'
  out.mkdir()
  dead = subprocess.Popen([sys.executable, '-c', '']).pid
  os.waitpid(dead, 0)
  st = out.stat()
  record = {'pid': dead, 'host': socket.gethostname(), 'dir_id': [st.st_dev, st.st_ino],
            'since': 'then'}
  (out / 'train.lock').write_text(json.dumps(record))
  messages = []
  with run_lock.RunLock(out, log=messages.append):
    assert json.loads((out / 'train.lock').read_text())['pid'] == os.getpid()
    with pytest.raises(run_lock.RunLocked, match=f'pid {os.getpid()}'):
      run_lock.RunLock(out).__enter__()  # this very process holds it
  assert f'stale lock {out / "train.lock"} of pid {dead}' in messages[0]
  assert not (out / 'train.lock').exists()

  (out / 'train.lock').write_text(json.dumps({**record, 'host': 'elsewhere'}))
  with pytest.raises(run_lock.RunLocked, match=r'pid \d+ on elsewhere since then .*delete'):
    run_lock.RunLock(out).__enter__()
  mine = run_lock.RunLock(tmp_path).record  # a live lock, but of another directory
  (out / 'train.lock').write_text(json.dumps({**mine, 'since': 'then'}))
  messages = []
  with run_lock.RunLock(out, log=messages.append):
    pass
  assert 'this directory is a copy' in messages[0]


@pytest.mark.slow
def test_resume_reads_the_run_options_and_run_directory_errors(tmp_path, reference, capsys,
                                                               monkeypatch):
  """--resume takes the options from run.json: given again they must agree
  (--steps may only rise, and extends a finished run); a missing directory
  is not created; an out-dir that is a file, under a file or read-only is
  one line, exit 2."""
  cfg = _copy(reference, tmp_path)
  for flags, message in ((['--lr', '1.0'], r"configuration differs .*'lr': \(None, 1.0\)"),
                         (['--steps', '10'], r"steps=10 is below the run's 12 .*may only be "
                                             r'raised')):
    assert cli.main(['train', '--resume', '--out-dir', cfg.out_dir, *flags]) == 2
    assert __import__('re').search(message, _one_line_error(capsys))
  assert cli.main(['train', '--resume', '--out-dir', cfg.out_dir, '--steps', '13',
                   '--clip', str(cfg.clip)]) == 0  # given again, equal: accepted
  assert json.loads((pathlib.Path(cfg.out_dir) / 'run.json').read_text())['steps'] == 13
  assert _losses(cfg.out_dir)[-1][0] == 13 and 'resumed from step 12' in capsys.readouterr().out

  missing = tmp_path / 'missing'
  assert cli.main(['train', '--resume', '--out-dir', str(missing)]) == 2
  assert 'holds no run' in _one_line_error(capsys) and not missing.exists()

  afile = tmp_path / 'afile'
  afile.write_text('')
  readonly = tmp_path / 'readonly'
  readonly.mkdir()
  readonly.chmod(0o555)
  if os.access(readonly, os.W_OK):  # root writes anyway: refuse the lock as a
    real_open = os.open            # read-only file system would

    def ro_open(path, flags, *a):
      if str(path).startswith(str(readonly)) and flags & os.O_CREAT:
        raise PermissionError(13, 'Permission denied', str(path))
      return real_open(path, flags, *a)

    monkeypatch.setattr(os, 'open', ro_open)
  for out, message in ((afile, f'--out-dir {afile} is a file, not a directory'),
                       (afile / 'sub', f'cannot create the run directory --out-dir '
                                       f'{afile / "sub"}: Not a directory'),
                       (readonly, f'cannot write in the run directory {readonly}: '
                                  f'Permission denied')):
    assert cli.main(['train', '--out-dir', str(out)]) == 2
    assert message in _one_line_error(capsys)
