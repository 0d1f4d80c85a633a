"""Multi-process training: each process reads its own rows of every batch,
and a run of two processes (``jax.distributed`` on localhost, CPU) trains on
the windows of a one-process run with its losses; a process that never
starts, or is killed, stops the other with one line naming it (exit 5)."""

import itertools
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import SQUARE, host_devices, overrides
from poetx_jax.pretrain.data import windows as data_lib
from poetx_jax.pretrain.checkpoint import Checkpointer


class _Recorded:
  """Windows read on demand (as ``shards.TokenWindows``), recording the rows read."""
  read_on_demand = True

  def __init__(self, windows):
    self.windows, self.read = windows, set()
    self.shape, self.ndim = windows.shape, windows.ndim

  def __len__(self):
    return len(self.windows)

  def __getitem__(self, idx):
    self.read.update(np.asarray(idx).ravel().tolist())
    return self.windows[idx]


def _windows(n=40, width=9):
  return np.arange(n * width, dtype=np.int32).reshape(n, width)


def test_the_shares_of_each_batch_stacked_are_the_one_process_batch():
  windows = _windows()
  one = iter(data_lib.train_dataset(windows, batch_size=8, seed=3))
  parts = [iter(data_lib.train_dataset(windows, batch_size=8, seed=3, shard_index=i,
                                       shard_count=2)) for i in range(2)]
  for _ in range(12):  # 5 batches an epoch: across epochs
    want = next(one)
    got = [next(p) for p in parts]
    for k in ('inputs', 'targets'):
      np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), want[k])
      assert got[0][k].shape == (4, 8)


def test_each_share_reads_only_its_own_windows():
  windows = _windows(400)  # 50 batches an epoch: the reads stay in the first
  rows = [[], []]  # the windows of each share's rows, batch by batch
  for b in itertools.islice(data_lib.train_dataset(windows, batch_size=8, seed=3), 40):
    for i in range(2):
      rows[i].append(set((b['inputs'][4 * i:4 * i + 4, 0] // 9).tolist()))
  for i in range(2):
    share = _Recorded(windows)
    it = iter(data_lib.train_dataset(share, batch_size=8, seed=3, shard_index=i,
                                     shard_count=2))
    for _ in range(10):
      next(it)
    # The 10 batches taken and, at most, those read ahead.
    assert set().union(*rows[i][:10]) <= share.read <= set().union(*rows[i])
    assert not share.read & set().union(*rows[1 - i])


def test_a_share_resumes_from_its_state():
  windows = _windows()
  ds = data_lib.train_dataset(windows, batch_size=8, seed=1, shard_index=1, shard_count=4)
  it = iter(ds)
  for _ in range(3):
    next(it)
  again = iter(ds)
  again.set_state(it.get_state())
  for _ in range(7):
    np.testing.assert_array_equal(next(again)['inputs'], next(it)['inputs'])


@pytest.mark.parametrize('kw, match', [
    (dict(shard_count=3), 'shard_count must be a positive int dividing batch_size=8, got 3'),
    (dict(shard_count=0), 'shard_count must be'),
    (dict(shard_index=2, shard_count=2), r'shard_index must be an int in \[0, 2\), got 2'),
    (dict(shard_index=-1, shard_count=2), 'shard_index must be'),
])
def test_bad_shares_are_refused(kw, match):
  with pytest.raises(ValueError, match=match):
    data_lib.train_dataset(_windows(), batch_size=8, seed=0, **kw)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


# The model of the runs: every POET layer 32 x 32, so that a process compiles
# one merge program and few programs to build the model. Most of these
# processes compile all their programs: those started together, and process 1
# of two in each of its runs (jax writes the compilation cache from process 0
# only, and process 1's programs are keyed apart from it).
MODEL = overrides(SQUARE)


def _poetx(args, devices, extra=()):
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1',
         'XLA_FLAGS': host_devices(devices)}
  return subprocess.Popen([sys.executable, '-m', 'poetx_jax.pretrain.cli', 'train', *args,
                           *extra, '--plot', ''],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _losses(run):
  records = [json.loads(l) for l in (run / 'metrics.jsonl').read_text().splitlines()]
  return ({r['step']: r['loss'] for r in records if 'loss' in r},
          {r['step']: r['val_loss'] for r in records if 'val_loss' in r})


@pytest.mark.slow
def test_two_processes_train_on_the_windows_of_one_with_its_losses(tmp_path):
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  rng = np.random.default_rng(0)
  words = ['orthogonal', 'rotation', 'block', 'merge', 'weight', 'spectrum', 'train',
           'the', 'a', 'of', 'and', 'layer', 'matrix', 'frozen', 'learned']
  for i in range(12):
    (corpus / f'doc{i:02d}.txt').write_text(' '.join(rng.choice(words, 400)) + '.\n')

  def args(name):
    return ['--model-overrides', MODEL,
            '--data', str(corpus), '--vocab-size', '300', '--seq-len', '32',
            '--batch-size', '8', '--steps', '6', '--block-size', '8', '--dtype', 'float32',
            '--merge-every', '2', '--log-every', '1', '--eval-every', '3',
            '--eval-batches', '2', '--checkpoint-every', '3',
            '--cache-dir', str(tmp_path / f'cache-{name}'), '--out-dir', str(tmp_path / name)]

  def run(one_args, two_args):
    one = [_poetx(one_args, devices=4)] if one_args else []
    port = _free_port()
    two = [_poetx(two_args, devices=2,
                  extra=['--distributed', '--coordinator', f'localhost:{port}',
                         '--num-processes', '2', '--process-id', str(i)]) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in (*one, *two)]
    for p, (out, err) in zip((*one, *two), outs):
      assert p.returncode == 0, err[-3000:]
    return outs

  outs = run(args('one'), args('two'))
  assert "mesh: {'data': 4, 'fsdp': 1}, strategy dp" in outs[0][0]
  assert "mesh: {'data': 4, 'fsdp': 1}, strategy dp" in outs[1][0]  # over both processes
  assert 'validation perplexity' in outs[1][0]  # process 0 reports, process 1 does not
  assert 'validation perplexity' not in outs[2][0] and 'tokens/s' not in outs[2][0]

  (loss1, val1), (loss2, val2) = _losses(tmp_path / 'one'), _losses(tmp_path / 'two')
  assert sorted(loss1) == sorted(loss2) == list(range(1, 7))
  assert sorted(val1) == sorted(val2) == [0, 3, 6]
  # The same windows and programs over the same four devices; the collectives
  # of two processes may add in another order.
  np.testing.assert_allclose([loss2[s] for s in loss1], list(loss1.values()), rtol=1e-5)
  np.testing.assert_allclose([val2[s] for s in val1], list(val1.values()), rtol=1e-5)
  assert loss1[6] != loss1[1]  # it trained
  for name in ('one', 'two'):  # both processes' checkpoints
    assert Checkpointer(tmp_path / name / 'checkpoints').all_steps() == [3, 6]
  assert json.loads((tmp_path / 'one' / 'data.json').read_text()) == json.loads(
      (tmp_path / 'two' / 'data.json').read_text())

  # The two processes resume from step 3: each restores the checkpoint and its
  # data position, and steps 4-6 come out as the one process's uninterrupted run.
  outs = run(None, ['--resume', '--step', '3', '--out-dir', str(tmp_path / 'two')])
  assert 'resumed from step 3' in outs[0][0], outs[0][0][-2000:]
  assert Checkpointer(tmp_path / 'two' / 'checkpoints').all_steps() == [3, 6]  # 6 trained again
  loss2, val2 = _losses(tmp_path / 'two')
  assert sorted(loss2) == list(range(1, 7)) and sorted(val2) == [0, 3, 6]
  np.testing.assert_allclose([loss2[s] for s in loss1], list(loss1.values()), rtol=1e-5)
  np.testing.assert_allclose([val2[s] for s in val1], list(val1.values()), rtol=1e-5)


def _corpus(tmp_path):
  corpus = tmp_path / 'corpus.txt'
  corpus.write_text(' '.join(f'word{i % 37} and more text' for i in range(3000)))
  return corpus


def _distributed(i, port, timeout):
  return ['--distributed', '--coordinator', f'localhost:{port}', '--num-processes', '2',
          '--process-id', str(i), '--peer-timeout', str(timeout)]


@pytest.mark.slow
def test_a_process_whose_peer_never_starts_stops_naming_it(tmp_path):
  """Process 0 of 2 alone: it stops once the peer timeout has passed, with
  one line naming process 1 and exit status 5 (it used to wait 300 s, then
  abort with a C++ stack)."""
  t0 = time.monotonic()
  p = _poetx(['--out-dir', str(tmp_path / 'run')], devices=1,
             extra=_distributed(0, _free_port(), 3))
  out, err = p.communicate(timeout=120)
  assert p.returncode == 5, err[-3000:]
  assert err.strip().splitlines()[-1] == (
      'poetx train: error: process 0: process 1 did not join the run within 3 s (not '
      'started, or unable to reach the coordinator); stopping')
  assert time.monotonic() - t0 < 3 + 30  # the timeout, and jax's start
  assert not (tmp_path / 'run').exists()


@pytest.mark.slow
def test_a_killed_peer_stops_the_other_naming_it(tmp_path):
  """Process 1 of 2 killed while they train: process 0, waiting for it in a
  collective, stops within the peer timeout of its last heartbeat, naming it
  (exit 5; it used to abort with a C++ stack after XLA's heartbeat timeout)."""
  corpus, port, timeout = _corpus(tmp_path), _free_port(), 4
  args = ['--model-overrides', MODEL,
          '--data', str(corpus), '--vocab-size', '300', '--seq-len', '32', '--batch-size', '8',
          '--steps', '100000', '--block-size', '8', '--dtype', 'float32',
          '--cache-dir', str(tmp_path / 'cache'), '--out-dir', str(tmp_path / 'run')]
  procs = [_poetx(args, devices=1, extra=_distributed(i, port, timeout)) for i in range(2)]
  try:
    for line in procs[0].stdout:  # training: the first validation is done
      if line.startswith('step 0: validation loss'):
        break
    procs[1].kill()
    t0 = time.monotonic()
    out, err = procs[0].communicate(timeout=120)
    waited = time.monotonic() - t0
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.communicate()
  assert procs[0].returncode == 5, err[-3000:]
  assert err.strip().splitlines()[-1] == (
      f'poetx train: error: process 0: process 1 of 2 sent no heartbeat for {timeout} s '
      f'(killed, crashed or cut off; its output may say why); stopping'), err[-3000:]
  assert waited < timeout + 15, waited


@pytest.mark.slow
def test_two_processes_merge_drawing_the_same_permutations_with_no_collective():
  """A POET model replicated over the devices of two processes (dp) merges
  with no collective, and each process draws the same new permutations from
  the shared key."""
  port = _free_port()
  here = os.path.dirname(os.path.abspath(__file__))
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': host_devices(2),
         'PYTHONPATH': os.pathsep.join([here, os.path.dirname(here)])}
  procs = [subprocess.Popen([sys.executable, os.path.join(here, 'multiprocess_merge.py'),
                             str(port), str(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env) for i in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  assert got[0]['digest'] == got[1]['digest'], got
  assert got[0]['changed'] and got[0]['permutations'] == 14, got
  assert got[0]['collectives'] == got[1]['collectives'] == 0, got
  assert (got[0]['devices'], got[0]['processes']) == (4, 2), got
