"""Faults in the data, injected on the CPU: prepared shards whose bytes changed
or that hold ids outside the vocabulary, unreadable corpus files, options
that contradict a prepared dataset, an unfinished prepare, and a prepare
stopped by SIGTERM or kill -9 or failing while its workers tokenize. Each must
end in one line on stderr with its exit status (cli.main), or, for the signals
and the failure, with no process (or pool thread) left behind."""

import gzip
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import SMALL, WORDS, overrides, write_corpus
from poetx_jax.pretrain import cli, loading
from poetx_jax.pretrain.data import windows as data, prepare, shards
from poetx_jax.pretrain.config import TrainConfig

TINY_ARGS = ['--model-overrides', overrides(SMALL),
             '--seq-len', '32', '--batch-size', '4', '--steps', '2', '--warmup', '1',
             '--merge-every', '3', '--block-size', '8', '--eval-every', '2',
             '--eval-batches', '1', '--log-every', '1', '--checkpoint-every', '2',
             '--dtype', 'float32']


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
  """A prepared dataset of 40 small text files: vocabulary 300, shards of 700 tokens."""
  root = tmp_path_factory.mktemp('prepared')
  (root / 'src').mkdir()
  prepare.prepare([write_corpus(root / 'src')], root / 'ds', vocab_size=300,
                  shard_tokens=700, workers=1, progress=False)
  return root / 'ds'


def _copy(prepared, tmp_path):
  ds = tmp_path / 'ds'
  shutil.copytree(prepared, ds)
  return ds, json.loads((ds / 'manifest.json').read_text())


def _rewrite_manifest(ds, manifest):
  (ds / 'manifest.json').write_text(json.dumps(manifest, indent=1))


def _train(tmp_path, data_args, *extra):
  return cli.main(['train', '--data', *data_args, *TINY_ARGS, *extra,
                   '--out-dir', str(tmp_path / 'run'), '--cache-dir', str(tmp_path / 'cache')])


def _one_line_error(capsys, command):
  """The error line of a failed command: one, and no traceback."""
  err = capsys.readouterr().err
  lines = [l for l in err.splitlines() if l.startswith('poetx ')]
  assert 'Traceback' not in err and len(lines) == 1, err
  assert lines[0].startswith(f'poetx {command}: error: '), err
  return lines[0]


# ------------------------------------------------------------- shards that changed


def test_a_shard_whose_bytes_changed_is_refused_before_its_windows_are_used(
    prepared, tmp_path, capsys):
  ds, m = _copy(prepared, tmp_path)
  name = m['shards'][1]['file']  # in the training split
  raw = bytearray((ds / name).read_bytes())
  raw[10] ^= 1  # an id one away: still in the vocabulary, the size kept
  (ds / name).write_bytes(bytes(raw))

  # Reading any window of that shard is refused, naming it.
  stream = shards.TokenShards(ds)
  start = int(stream.offsets[1])
  with pytest.raises(ValueError, match=rf'{name}.*sha256'):
    stream.read(start, start + 20)
  with pytest.raises(ValueError, match=rf'{name}.*sha256'):  # and then any other read
    stream.read(0, 20)

  # poetx train refuses it before its first step (the validation split's shard:
  # read before any step; a training shard's failure stops the next read).
  last = m['shards'][-1]['file']
  raw = bytearray((ds / last).read_bytes())
  raw[10] ^= 1
  (ds / last).write_bytes(bytes(raw))
  assert _train(tmp_path, [str(ds)]) == 2
  line = _one_line_error(capsys, 'train')
  assert last in line and 'sha256' in line and 'prepare the dataset again' in line
  assert not list((tmp_path / 'run').glob('checkpoints/*'))


def test_each_shard_is_hashed_once_per_process(prepared, tmp_path, monkeypatch):
  ds, m = _copy(prepared, tmp_path)
  seen = []
  real = shards._shard_digest
  monkeypatch.setattr(shards, '_shard_digest', lambda *a: seen.append(a[0].name) or real(*a))
  first = shards.PreparedData(ds, seq_len=16)
  np.asarray(first.train_windows)
  np.asarray(first.val_windows)
  first.shards.wait_verified()
  hashed = len(seen)
  assert sorted(seen) == sorted(s['file'] for s in m['shards'])
  again = shards.PreparedData(ds, seq_len=16)  # the same files: not hashed again
  np.asarray(again.train_windows)
  again.shards.wait_verified()
  assert len(seen) == hashed


def _with_id(ds, manifest, shard, token_id, *, max_id: bool):
  """Writes ``token_id`` into a shard; the manifest's sha256 (and max_id, or
  none, as an older prepare wrote) then match it, as another writer's would."""
  f = ds / manifest['shards'][shard]['file']
  ids = np.fromfile(f, '<u2')
  ids[3::5] = token_id
  ids.tofile(f)
  entry = manifest['shards'][shard]
  entry['sha256'] = hashlib.sha256(ids.tobytes()).hexdigest()
  if max_id:
    entry['max_id'] = int(ids.max())
  else:
    entry.pop('max_id', None)
  _rewrite_manifest(ds, manifest)
  return entry['file']


def test_prepare_records_the_largest_id_of_each_shard(prepared):
  m = json.loads((prepared / 'manifest.json').read_text())
  for s in m['shards']:
    assert s['max_id'] == int(np.fromfile(prepared / s['file'], '<u2').max()) < 300


def test_ids_outside_the_vocabulary_are_refused_by_shard_before_training(
    prepared, tmp_path, capsys):
  ds, m = _copy(prepared, tmp_path)
  name = _with_id(ds, m, 2, 65535, max_id=True)
  with pytest.raises(ValueError, match=rf'{name}.*65535.*vocabulary of 300'):
    shards.PreparedData(ds, seq_len=16)
  assert _train(tmp_path, [str(ds)]) == 2
  line = _one_line_error(capsys, 'train')
  assert name in line and '65535' in line

  # A manifest without max_id (an older prepare): found while hashing, before use.
  ds2, m2 = _copy(prepared, tmp_path / 'old')
  name = _with_id(ds2, m2, 2, 65535, max_id=False)
  stream = shards.PreparedData(ds2, seq_len=16).shards
  with pytest.raises(ValueError, match=rf'{name}.*65535.*vocabulary of 300'):
    stream.read(int(stream.offsets[2]), int(stream.offsets[2]) + 20)


# ------------------------------------------------------------- unreadable corpus files


def test_unreadable_files_are_one_line_errors_naming_them(tmp_path, capsys):
  src = tmp_path / 'src'
  src.mkdir()
  (src / 'a.jsonl.gz').write_bytes(b'{"text": "not gzip"}\n')
  with pytest.raises(ValueError, match=r'a\.jsonl\.gz is not a gzip file'):
    data.read_documents([src])
  assert cli.main(['prepare', str(src), '--out', str(tmp_path / 'ds'), '--vocab-size',
                   '300']) == 2
  assert 'a.jsonl.gz' in _one_line_error(capsys, 'prepare')
  assert _train(tmp_path, [str(src)]) == 2
  assert 'a.jsonl.gz' in _one_line_error(capsys, 'train')

  # A gzip file cut short.
  with gzip.open(src / 'a.jsonl.gz', 'wb') as f:
    f.write(b''.join(json.dumps({'text': ' '.join(WORDS) * 20}).encode() + b'\n'
                     for _ in range(50)))
  (src / 'a.jsonl.gz').write_bytes((src / 'a.jsonl.gz').read_bytes()[:300])
  with pytest.raises(ValueError, match=r'a\.jsonl\.gz'):
    data.read_documents([src])

  pytest.importorskip('pyarrow')
  (src / 'a.jsonl.gz').unlink()
  (src / 'b.parquet').write_bytes(b'garbage, not parquet')
  with pytest.raises(ValueError, match=r'b\.parquet is not a parquet file'):
    data.read_documents([src])
  assert cli.main(['prepare', str(src), '--out', str(tmp_path / 'ds2'), '--vocab-size',
                   '300']) == 2
  assert 'b.parquet' in _one_line_error(capsys, 'prepare')


@pytest.mark.parametrize('address', ['nocolon', 'host:', ':8476', 'host:port', 'host:70000'])
def test_a_bad_coordinator_address_is_a_one_line_error(address, capsys):
  assert cli.main(['train', '--distributed', '--coordinator', address, '--num-processes',
                   '1', '--process-id', '0']) == 2
  line = _one_line_error(capsys, 'train')
  assert repr(address) in line and 'HOST:PORT' in line


def test_cluster_options_without_distributed_name_the_flags(capsys):
  assert cli.main(['train', '--coordinator', 'h:1', '--process-id', '0']) == 2
  assert _one_line_error(capsys, 'train').endswith(
      'need --distributed (given: --coordinator, --process-id)')


def test_data_with_no_paths_is_refused(tmp_path, capsys, monkeypatch):
  with pytest.raises(ValueError, match=r'data must name at least one path.*got \[\]'):
    TrainConfig(data=[]).validate()

  def no_data(*a, **k):
    raise AssertionError('read the built-in corpus')

  monkeypatch.setattr(loading, 'run_data', no_data)
  assert cli.main(['train', '--data', '--steps', '1', '--out-dir', str(tmp_path / 'r')]) == 2
  assert 'data must name at least one path' in _one_line_error(capsys, 'train')


# ------------------------------------------------------------- options against a dataset


def test_prepare_refuses_another_vocab_size_on_the_same_inputs(prepared, tmp_path):
  src = prepared.parent / 'src'
  ds = tmp_path / 'ds'
  kw = dict(shard_tokens=700, workers=1, progress=False)
  m = prepare.prepare([src], ds, vocab_size=300, **kw)
  assert prepare.prepare([src], ds, vocab_size=300, **kw) == m  # unchanged: a no-op
  with pytest.raises(ValueError, match=r'vocab_size=300.*--vocab-size 320'):
    prepare.prepare([src], ds, vocab_size=320, **kw)
  # Unfinished (no manifest, its tokenizer trained): the same.
  (ds / 'manifest.json').unlink()
  with pytest.raises(ValueError, match=r'vocab_size=300.*--vocab-size 320'):
    prepare.prepare([src], ds, vocab_size=320, **kw)
  assert prepare.prepare([src], ds, vocab_size=300, **kw) == m


def test_train_on_a_prepared_dataset_records_its_vocabulary(prepared, tmp_path, capsys,
                                                            monkeypatch):
  assert _train(tmp_path, [str(prepared)], '--vocab-size', '4096') == 2
  line = _one_line_error(capsys, 'train')
  assert '--vocab-size 4096' in line and '300' in line

  seen = {}

  def stop(*a, **k):  # run.json is written by now (and removed with the refusal)
    seen.update(json.loads((tmp_path / 'run' / 'run.json').read_text()))
    raise ValueError('stopped before reading the data')

  # The prepared dataset as --val-data: its tokenizer reads the text --data too.
  text = str(prepared.parent / 'src')
  assert _train(tmp_path, [text], '--val-data', str(prepared), '--vocab-size', '512') == 2
  line = _one_line_error(capsys, 'train')
  assert f'--vocab-size 512 disagrees with the prepared dataset {prepared}' in line
  assert not (tmp_path / 'run').exists()

  monkeypatch.setattr(loading, 'run_data', stop)
  assert _train(tmp_path, [str(prepared)]) == 2  # vocab_size left at its default, 4096
  assert seen['vocab_size'] == 300 and not (tmp_path / 'run').exists()
  seen.clear()
  assert _train(tmp_path, [text], '--val-data', str(prepared)) == 2
  assert seen['vocab_size'] == 300 and not (tmp_path / 'run').exists()


def test_an_unfinished_prepare_is_named_with_how_to_finish_it(prepared, tmp_path, capsys):
  ds, _ = _copy(prepared, tmp_path)
  (ds / 'manifest.json').unlink()
  assert _train(tmp_path, [str(ds)]) == 2
  line = _one_line_error(capsys, 'train')
  assert f'{ds} is an unfinished poetx prepare directory' in line
  assert f'poetx prepare INPUT... --out {ds}' in line

  # A finished one among other paths: its shards are no corpus files.
  assert _train(tmp_path, [str(prepared), str(prepared.parent / 'src')]) == 2
  assert f'{prepared} is a prepared dataset directory: train on it alone' in _one_line_error(
      capsys, 'train')


def test_prepare_writes_files_readable_by_all_under_umask_022(prepared, tmp_path):
  old = os.umask(0o022)
  try:
    prepare.prepare([prepared.parent / 'src'], tmp_path / 'ds', vocab_size=300,
                    shard_tokens=700, workers=2, progress=False)
  finally:
    os.umask(old)
  files = [p for p in (tmp_path / 'ds').rglob('*')]
  assert files and not [p for p in files if p.name.startswith('.')]  # no temporaries left
  modes = {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777) for p in files}
  assert all(m == oct(0o755 if (tmp_path / p).is_dir() else 0o644)
             for p, m in modes.items()), modes


# ------------------------------------------------------------- a prepare stopped


@pytest.fixture(scope='module')
def big_sources(tmp_path_factory):
  """Two jsonl files of 12 MB: seconds of work for each of two workers."""
  root = tmp_path_factory.mktemp('big')
  rng = np.random.default_rng(0)
  lines = [json.dumps({'text': ' '.join(rng.choice(WORDS, 200))}) + '\n' for _ in range(200)]
  block = ''.join(lines)
  for name in ('a.jsonl', 'b.jsonl'):
    (root / name).write_text(block * (12_000_000 // len(block)))
  return root


def _running(psutil, p):
  """Whether ``p`` still runs (a zombie is dead, only not yet reaped by init)."""
  try:
    return p.status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


@pytest.mark.slow
@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_prepare_leaves_no_process_behind(prepared, big_sources, tmp_path, sig):
  psutil = pytest.importorskip('psutil')
  cmd = [sys.executable, '-m', 'poetx_jax.pretrain.cli', 'prepare', str(big_sources),
         '--out', str(tmp_path / 'ds'), '--tokenizer', str(prepared / 'tokenizer.json'),
         '--workers', '2', '--shard-tokens', '100000']
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          start_new_session=True, cwd=os.getcwd())
  children = []
  try:
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the two workers and the resource tracker
      children = parent.children(recursive=True)
      if len(children) >= 3 and sum(p.cpu_times().user for p in children) > 0.5:
        break
      assert proc.poll() is None, proc.stderr.read().decode()
      time.sleep(0.2)
    else:
      pytest.fail(f'prepare started {len(children)} processes: {children}')
    os.kill(proc.pid, sig)
    proc.wait(timeout=10)
    err = proc.stderr.read().decode()
    assert proc.returncode == (128 + sig if sig == signal.SIGTERM else -sig), err
    if sig == signal.SIGTERM:  # says what stopped and what was kept, and nothing else
      line = err.strip().splitlines()[-1]
      assert line.startswith('poetx prepare: stopped by SIGTERM; ') and (
          'the same command resumes from there' in line), err
      assert 'leaked' not in err and 'Traceback' not in err, err
    deadline = time.monotonic() + 5
    while (alive := [p for p in children if _running(psutil, p)]) and (
        time.monotonic() < deadline):
      time.sleep(0.1)
    assert not alive, [(p.pid, p.cmdline()[:4]) for p in alive]
  finally:
    for p in children:  # those this test started, if they outlived it
      try:
        p.kill()
      except psutil.NoSuchProcess:
        pass
    if proc.poll() is None:
      proc.kill()
    proc.wait()
    proc.stderr.close()


# Refusals of a fresh run, each found after the run directory is opened (the
# data read, the model built, tracking started): the arguments and a piece of
# the one-line error. SRC is a small corpus, TOK its prepared tokenizer.
REFUSALS = {
    'missing data': (['--data', '{tmp}/missing.txt'], 'missing.txt'),
    'val-data trained on': (['--data', '{src}', '--val-data', '{src}/doc01.txt'],
                            'is also trained on'),
    'val-data a copy': (['--data', '{src}', '--val-data', '{tmp}/copy.txt'],
                        'holds the same bytes as the training file'),
    'a path twice': (['--data', '{src}/doc01.txt:1', '{src}/doc02.txt:1', '{src}/doc01.txt:2'],
                     'names {src}/doc01.txt twice'),
    'bad mixture weight': (['--data', '{src}:0', '{src}/doc01.txt:1'], 'weight'),
    'seq-len too long': (['--data', '{src}', '--seq-len', '60000'], 'a window of 60001'),
    'corpus too small': (['--data', '{tmp}/small.txt'], 'corpus too small'),
    'unknown model field': (['--data', '{src}', '--model-overrides', 'colour=3'], 'colour'),
    'not a HF checkpoint': (['--data', '{src}', '--init-from-hf', '{tmp}'],
                            'is not a Hugging Face model directory'),
    'wandb missing': (['--data', '{src}', '--tracking', 'wandb'], 'wandb'),
}


@pytest.mark.parametrize('existing', [False, True])
@pytest.mark.parametrize('kind', sorted(REFUSALS))
def test_a_refused_fresh_run_writes_nothing(prepared, tmp_path, capsys, monkeypatch, kind,
                                           existing):
  """A fresh run refused leaves the file system as it found it: no run
  directory, or the given one as it was (the content-keyed token cache,
  outside the tree compared, may keep what it gained)."""
  monkeypatch.setitem(sys.modules, 'wandb', None)  # import wandb fails
  args, says = REFUSALS[kind]
  src = prepared.parent / 'src'
  args = [a.format(tmp=tmp_path, src=src) for a in args]
  (tmp_path / 'small.txt').write_text('a corpus of nine words, too few to split.')
  shutil.copyfile(src / 'doc03.txt', tmp_path / 'copy.txt')
  out = tmp_path / 'runs' / 'r'
  if existing:
    out.mkdir(parents=True)
    (out / 'notes.txt').write_text('mine')
  tree = lambda: sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob('*'))
  before = tree()
  assert cli.main(['train', *TINY_ARGS, *args, '--tokenizer', str(prepared / 'tokenizer.json'),
                   '--out-dir', str(out), '--cache-dir', str(tmp_path.parent / 'cache')]) == 2
  assert says.format(src=src) in _one_line_error(capsys, 'train')
  assert tree() == before


def test_a_failed_pooled_prepare_leaves_no_pool_thread_or_worker(prepared, tmp_path):
  """An error while the workers tokenize ends them and the pool's manager
  thread before it propagates: nothing of the pool outlives the call."""
  import concurrent.futures.process as cfp  # pylint: disable=g-import-not-at-top
  import multiprocessing  # pylint: disable=g-import-not-at-top
  from poetx_jax.pretrain.data import prepare_tasks  # pylint: disable=g-import-not-at-top
  files = sorted((prepared.parent / 'src').iterdir())
  todo = [{'index': i, 'out': str(tmp_path), 'tokenizer': str(prepared / 'tokenizer.json'),
           'sources': [{'path': str(f), 'bytes': f.stat().st_size}], 'dtype': '<u2',
           'shard_tokens': 700, 'text_field': 'text'} for i, f in enumerate(files)]
  finished = []

  def done(task, part):
    finished.append(task['index'])
    raise RuntimeError('the first part fails')

  before = set(multiprocessing.active_children())
  with pytest.raises(RuntimeError, match='the first part fails'):
    prepare_tasks.run_tasks(todo, done, workers=2, progress=False, files=len(todo))
  assert finished == [0]
  manager = cfp._ExecutorManagerThread  # pylint: disable=protected-access
  assert not [t for t in threading.enumerate() if isinstance(t, manager) and t.is_alive()]
  assert not [p for p in multiprocessing.active_children() if p not in before]
