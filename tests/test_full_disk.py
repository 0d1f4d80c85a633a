"""A full disk, injected on the CPU: a checkpoint save, a metrics line, a
``poetx prepare`` shard and a ``poetx export`` refused for want of space
(RLIMIT_FSIZE in a subprocess: EFBIG, the errors of TensorStore's and numpy's
own writes; or a patched writer raising ENOSPC). Each leaves what was whole
before as it was, says so in one line on stderr (exit 6), and once there is
space again ``--resume`` or the same command ends as an uninterrupted run,
bit for bit."""

import dataclasses
import errno
import json
import pathlib
import subprocess
import sys

import pytest

from conftest import write_corpus
from poetx_jax.pretrain import checkpoint, checkpoint_faults, cli
from poetx_jax.pretrain import train as train_lib
from poetx_jax.pretrain.checkpoint import Checkpointer
from poetx_jax.pretrain.digests import check_digests
from test_faults import _assert_same_run, _cfg, _one_line_error
from test_faults_runs import _tree

# `poetx train --config CFG` in a subprocess whose files may grow to LIMIT
# bytes from step AT on (the checkpoints before it written, and copied to
# KEPT first).
LIMITED_TRAIN = '''
import resource, shutil, sys
from poetx_jax.pretrain import cli
from poetx_jax.pretrain import train as train_lib
config, at, kept, limit = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
real = train_lib.train

def full(run):
  if run.step == at:
    run.ckpt.wait()
    shutil.copytree(run.ckpt.directory, kept)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

train_lib.train = lambda *a, **k: real(*a, hooks=[train_lib.Hook(full)], **k)
code = cli.main(['train', '--config', config])
import threading  # none of orbax's threads outlives the command (one would print at exit)
alive = [t.name for t in threading.enumerate() if type(t).__module__.startswith('orbax.')]
assert not alive, alive
sys.exit(code)
'''

# `poetx prepare` (one worker) in a subprocess whose files may grow to LIMIT
# bytes once it starts task AT.
LIMITED_PREPARE = '''
import resource, sys
from poetx_jax.pretrain import cli
from poetx_jax.pretrain.data import prepare_tasks
at, limit, args = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
real = prepare_tasks.tokenize_task

def task(t):
  if t['index'] == at:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
  return real(t)

prepare_tasks.tokenize_task = task
sys.exit(cli.main(['prepare', *args]))
'''


def _error_line(err: str, command: str) -> str:
  """The one error line of a subprocess's stderr (no traceback, no logged errors)."""
  lines = [l for l in err.splitlines() if l.startswith('poetx ')]
  assert 'Traceback' not in err and 'ERROR' not in err and len(lines) == 1, err
  assert lines[0].startswith(f'poetx {command}: error: '), err
  return lines[0]


@pytest.mark.slow
def test_a_checkpoint_over_the_file_size_limit_keeps_the_previous_one(
    tmp_path, corpus, reference, capsys):
  """From step 8 no file may grow past 20 kB: the save of step 8 fails in
  orbax's background threads (TensorStore's writes, EFBIG), seen as the save
  of step 12 starts. One line names it and the intact step 4 (keep=1: never
  deleted for the failed save), whose bytes are those saved; --resume with
  the limit gone trains 5 -> 12 again to the uninterrupted run."""
  cfg = _cfg(tmp_path, corpus, keep=1)
  config = tmp_path / 'config.json'
  config.write_text(json.dumps(dataclasses.asdict(cfg)))
  kept = tmp_path / 'kept'
  proc = subprocess.run([sys.executable, '-c', LIMITED_TRAIN, str(config), '8', str(kept),
                         '20000'], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 6, proc.stderr
  line = _error_line(proc.stderr, 'train')
  ckpts = pathlib.Path(cfg.out_dir) / 'checkpoints'
  assert f'writing the checkpoint of step 8 under {ckpts}' in line, line
  assert 'file size limit' in line and 'the checkpoint of step 4 is intact' in line, line
  assert line.endswith('and run again with --resume'), line
  assert Checkpointer(ckpts).all_steps() == [4]
  assert _tree(ckpts / '4') == _tree(kept / '4')
  assert check_digests(ckpts / '4', checkpoint.ITEMS) is None

  assert cli.main(['train', '--resume', '--out-dir', cfg.out_dir]) == 0
  out = capsys.readouterr().out
  assert ('resumed from step 4, its newest whole checkpoint: the run had reached step 12, '
          'so steps 5-12 are trained again; the save of step 8 had not finished') in out
  _assert_same_run(cfg, reference)


def test_a_failed_saves_threads_are_joined_without_raising_its_error_again():
  """orbax's save threads raise their error again from ``join``. Joining
  them once a save failed (before its DiskFull is raised) passes over that
  error; raised there, it would replace the message naming the step with a
  generic one whenever a thread is still to be joined."""
  from orbax.checkpoint._src.futures import future  # pylint: disable=g-import-not-at-top

  async def refused():
    raise OSError(errno.EFBIG, 'File too large')

  commit = future.CommitFuture(refused())
  checkpoint_faults.join_operation_threads()
  with pytest.raises(OSError, match='File too large'):
    commit.result()


# A TensorStore future awaited on an asyncio loop that closes before it is
# done (a failed save's abandoned write), completed afterwards; then an
# unraisable error of another kind, which must still be printed.
LATE_RESULT = '''
import asyncio, gc, sys
import tensorstore as ts
from poetx_jax.pretrain.checkpoint import Checkpointer
Checkpointer(sys.argv[1])
promise, future = ts.Promise.new()

async def wait():
  return await future

loop = asyncio.new_event_loop()
task = loop.create_task(wait())
loop.run_until_complete(asyncio.sleep(0.01))
loop.close()
promise.set_result(1)
print('delivered', flush=True)

class Closing:
  def __del__(self):
    raise RuntimeError('Event loop is closed')

Closing()
gc.collect()
'''


@pytest.mark.slow
def test_a_result_delivered_to_a_closed_loop_prints_nothing(tmp_path):
  """Once a Checkpointer exists, TensorStore's result for an await whose loop
  has closed prints no traceback; the same error raised by Python code still does."""
  proc = subprocess.run([sys.executable, '-c', LATE_RESULT, str(tmp_path / 'c')],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0 and proc.stdout == 'delivered\n', proc.stderr
  assert 'call_soon_threadsafe' not in proc.stderr, proc.stderr
  assert proc.stderr.count('Traceback') == 1 and '__del__' in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize('where', ['final checkpoint', 'metrics line'])
def test_no_space_for_a_write_while_training_stops_in_one_line(
    tmp_path, corpus, reference, capsys, monkeypatch, where):
  """ENOSPC for the final checkpoint (its digests, written in orbax's
  background thread and seen as the run closes) or for the metrics line of
  step 10 (half of it written): exit 6, one line naming what and the intact
  checkpoint; --resume once there is space ends as the uninterrupted run."""
  full = {'on': False}
  run_dir = tmp_path / 'run'
  if where == 'final checkpoint':
    real_digests = checkpoint.write_digests

    def write_digests(step_dir, items):
      if pathlib.Path(step_dir).name.startswith('12.') and full['on']:
        raise OSError(errno.ENOSPC, 'No space left on device')
      return real_digests(step_dir, items)

    monkeypatch.setattr(checkpoint, 'write_digests', write_digests)
    full['on'] = True
  else:
    real_open = pathlib.Path.open

    class HalfWritten:
      def __init__(self, f):
        self.f = f

      def __enter__(self):
        return self

      def __exit__(self, *exc):
        self.f.close()

      def write(self, text):
        self.f.write(text[:len(text) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, 'No space left on device')

    def path_open(self, mode='r', *a, **k):
      f = real_open(self, mode, *a, **k)
      return HalfWritten(f) if self.name == 'metrics.jsonl' and full['on'] else f

    def fill(run):
      full['on'] = full['on'] or run.step == 10

    monkeypatch.setattr(pathlib.Path, 'open', path_open)
    monkeypatch.setattr(train_lib, 'train', lambda *a, **k: _train(
        *a, hooks=[train_lib.Hook(fill, wait=False)], **k))
  cfg = _cfg(tmp_path, corpus)
  config = tmp_path / 'config.json'
  config.write_text(json.dumps(dataclasses.asdict(cfg)))
  assert cli.main(['train', '--config', str(config)]) == 6
  line = _one_line_error(capsys)
  ckpts = run_dir / 'checkpoints'
  what, intact = ((f'writing the checkpoint of step 12 under {ckpts}', 8)
                  if where == 'final checkpoint' else (f'writing {run_dir / "metrics.jsonl"}', 8))
  assert f'no space left on device {what}' in line, line
  assert line.endswith(f'the checkpoint of step {intact} is intact: free space and run again '
                       f'with --resume'), line
  assert max(Checkpointer(ckpts).all_steps()) == intact
  assert check_digests(ckpts / str(intact), checkpoint.ITEMS) is None
  assert not (run_dir / 'train.lock').exists()

  full['on'] = False
  monkeypatch.setattr(train_lib, 'train', _train)
  assert cli.main(['train', '--resume', '--out-dir', str(run_dir)]) == 0
  out = capsys.readouterr().out
  assert f'resumed from step {intact}' in out
  _assert_same_run(cfg, reference)


_train = train_lib.train


@pytest.mark.slow
def test_a_prepare_over_the_file_size_limit_keeps_its_finished_parts(tmp_path, capsys):
  """A prepare whose third part meets a 1000-byte file size limit (numpy
  would cut its 1400-byte shard short without a word): one line names the
  shard and the two parts kept, the partial shard is gone, the finished ones
  are as an uninterrupted prepare wrote them; the same command without the
  limit then writes the directory that prepare writes."""
  (tmp_path / 'src').mkdir()
  src = write_corpus(tmp_path / 'src', docs=6, words=400)
  args = [str(src), '--vocab-size', '300', '--shard-tokens', '700', '--workers', '1']
  assert cli.main(['prepare', *args, '--out', str(tmp_path / 'uninterrupted')]) == 0
  want = _tree(tmp_path / 'uninterrupted')
  capsys.readouterr()

  ds = tmp_path / 'ds'
  proc = subprocess.run([sys.executable, '-c', LIMITED_PREPARE, '2', '1000', *args,
                         '--out', str(ds)], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 6, proc.stderr
  line = _error_line(proc.stderr, 'prepare')
  assert f'writing {ds / "shard-00002-00000.bin"}' in line, line
  assert f'{ds} keeps 2 of 6 tokenized parts' in line and 'run the same command again' in line
  got = _tree(ds)
  assert not (ds / 'manifest.json').exists()
  assert sorted(n for n in got if n.startswith('parts/0')) == ['parts/00000.json',
                                                               'parts/00001.json']
  assert all(n.startswith(('shard-00000-', 'shard-00001-', 'parts/', 'tokenizer.json'))
             for n in got), sorted(got)
  assert all(got[n] == want[n] for n in got), [n for n in got if got[n] != want[n]]

  assert cli.main(['prepare', *args, '--out', str(ds)]) == 0
  assert _tree(ds) == want


@pytest.mark.slow
def test_an_export_without_space_leaves_no_partial_export(tmp_path, reference, capsys,
                                                          monkeypatch):
  """ENOSPC half-way through tokenizer_config.json (the weights and config
  written): a new export directory is left without any export file, a
  forced one keeps the export it held byte for byte; with space again the
  same commands write what an uninterrupted export writes."""
  run = reference[0].out_dir
  assert cli.main(['export', run, '--out', str(tmp_path / 'want')]) == 0
  assert cli.main(['export', run, '--out', str(tmp_path / 'old'), '--step', '8']) == 0
  want, old = _tree(tmp_path / 'want'), _tree(tmp_path / 'old')
  capsys.readouterr()
  real_write_text = pathlib.Path.write_text
  full = {'on': True}

  def write_text(self, data, *a, **k):
    if 'tokenizer_config' in self.name and full['on']:
      real_write_text(self, data[:len(data) // 2], *a, **k)
      raise OSError(errno.ENOSPC, 'No space left on device')
    return real_write_text(self, data, *a, **k)

  monkeypatch.setattr(pathlib.Path, 'write_text', write_text)
  for out, flags, before in ((tmp_path / 'new', [], {}), (tmp_path / 'old', ['--force'], old)):
    assert cli.main(['export', run, '--out', str(out), *flags]) == 6
    line = _one_line_error(capsys, 'export')
    assert f'no space left on device writing {out / "tokenizer_config.json"}' in line, line
    assert line.endswith('free space and run the command again'), line
    assert (_tree(out) if out.exists() else {}) == before

  full['on'] = False
  for out, flags in ((tmp_path / 'new', []), (tmp_path / 'old', ['--force'])):
    assert cli.main(['export', run, '--out', str(out), *flags]) == 0
    assert _tree(out) == want


def test_a_fresh_run_without_space_for_its_files_leaves_nothing(tmp_path, corpus, capsys,
                                                                monkeypatch):
  """ENOSPC writing run.json, then data.json (the data read): one line names
  the file, exit 6, and the run directory the run created is gone."""
  real_write_text = pathlib.Path.write_text
  for name in ('run.json', 'data.json'):

    def write_text(self, data, *a, name=name, **k):
      if self.name.startswith(f'.{name}.'):
        raise OSError(errno.ENOSPC, 'No space left on device')
      return real_write_text(self, data, *a, **k)

    monkeypatch.setattr(pathlib.Path, 'write_text', write_text)
    config = tmp_path / 'config.json'
    real_write_text(config, json.dumps(dataclasses.asdict(_cfg(tmp_path, corpus))))
    assert cli.main(['train', '--config', str(config)]) == 6
    line = _one_line_error(capsys)
    assert line.endswith(f'no space left on device writing {tmp_path / "run" / name}: free '
                         f'space and run the command again'), line
    assert not (tmp_path / 'run').exists()
