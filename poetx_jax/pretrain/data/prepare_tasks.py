"""The work of ``poetx prepare`` (:mod:`poetx_jax.pretrain.data.prepare`): a task
is a run of consecutive sources tokenized into shards of their own
(:func:`tokenize_task`), in worker processes (:func:`run_tasks`).

A source is a record: a corpus file (``path``, ``bytes``, ``mtime_ns``, and
``lenient`` where found in a folder, see
:func:`~poetx_jax.pretrain.data.documents.iter_file_documents`) or a Hugging Face
dataset (``hf_dataset``, ..., :mod:`poetx_jax.pretrain.data.hfdata`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import multiprocessing
import os
import signal
import sys
import threading
import typing as tp
from pathlib import Path

import numpy as np

from poetx_jax.pretrain.data import documents
from poetx_jax.pretrain.atomic import atomic_write, write_array
from poetx_jax.pretrain.disk_full import writing
from poetx_jax.pretrain.data.tokenizer import Tokenizer, file_hash

_TOKENIZERS: dict[str, Tokenizer] = {}


def source_documents(source: dict, text_field: str,
                     on_skip: tp.Callable[[str], None] | None = None) -> tp.Iterator[str]:
  """The non-empty documents of a source record, streamed."""
  if 'hf_dataset' in source:
    from poetx_jax.pretrain.data import hfdata  # pylint: disable=g-import-not-at-top
    return hfdata.hf_documents(source, text_field)
  return documents.iter_file_documents(source['path'], text_field,
                                       lenient=source.get('lenient', False), on_skip=on_skip)


class _ShardWriter:
  """Token ids in, shards ``shard-{index:05d}-{k:05d}.bin`` of at most
  ``limit`` tokens out (a document may span shards), each written whole and
  recorded with its size, sha256 and largest id (DiskFull naming the shard
  if there is no space for it)."""

  def __init__(self, out: Path, index: int, dtype: np.dtype, limit: int):
    self.out, self.index, self.dtype, self.limit = out, index, dtype, limit
    self.shards, self._pending, self._n = [], [], 0

  def add(self, ids: np.ndarray) -> None:
    while ids.size:
      room = self.limit - self._n
      self._pending.append(ids[:room])
      self._n += min(room, ids.size)
      ids = ids[room:]
      if self._n >= self.limit:
        self.flush()

  def flush(self) -> None:
    if not self._n:
      return
    arr = np.concatenate(self._pending)
    name = f'shard-{self.index:05d}-{len(self.shards):05d}.bin'
    with writing(self.out / name):
      atomic_write(self.out / name, lambda tmp: write_array(tmp, arr))
    self.shards.append({'file': name, 'tokens': int(arr.size),
                        'sha256': hashlib.sha256(arr.tobytes()).hexdigest(),
                        'max_id': int(arr.max())})
    self._pending, self._n = [], 0


def tokenize_task(task: dict) -> dict:
  """Worker: the sources of ``task`` -> their shards in ``task['out']``;
  returns the task's part record: its sources (each with its ``documents``
  and ``sha256``, of the file, or of a dataset's documents as
  :func:`~poetx_jax.pretrain.data.tokenizer.corpus_hash`; a file read leniently
  and skipped has ``skipped``, why), shards and documents."""
  tok = _TOKENIZERS.get(task['tokenizer'])
  if tok is None:
    tok = _TOKENIZERS[task['tokenizer']] = Tokenizer.load(task['tokenizer'])
  writer = _ShardWriter(Path(task['out']), task['index'], np.dtype(task['dtype']),
                        task['shard_tokens'])
  records = [_tokenize_source(source, tok, writer, task['text_field'])
             for source in task['sources']]
  writer.flush()
  return {'sources': records, 'shards': writer.shards,
          'documents': sum(r['documents'] for r in records)}


def _tokenize_source(source: dict, tok: Tokenizer, writer: _ShardWriter,
                     text_field: str) -> dict:
  """Adds the documents of ``source`` (eos after each) to ``writer``; its record."""
  record, digest = {**source, 'documents': 0}, hashlib.sha256()
  eos = np.asarray([tok.eos_id], writer.dtype)

  def encode(batch):
    for ids in tok.encode_batch(batch):
      writer.add(np.concatenate([np.asarray(ids, writer.dtype), eos]))
    for doc in batch:
      b = doc.encode('utf-8', 'surrogatepass')
      digest.update(len(b).to_bytes(8, 'little') + b)
    record['documents'] += len(batch)

  batch = []
  for doc in source_documents(source, text_field,
                              on_skip=lambda why: record.__setitem__('skipped', why)):
    batch.append(doc)
    if len(batch) == 64:
      encode(batch)
      batch = []
  if batch:
    encode(batch)
  record['sha256'] = (digest.hexdigest() if 'hf_dataset' in source
                      else file_hash(source['path']))
  return record


def run_tasks(todo: list[dict], done: tp.Callable[[dict, dict], None], *,
               workers: int | None, progress: bool, files: int) -> None:
  """Runs :func:`tokenize_task` on each task of ``todo`` (in ``workers``
  processes where there are several) and ``done(task, part)`` as each ends,
  in order, with a progress bar over their sources' bytes (a dataset's are
  not known) if ``progress``."""
  bar = None
  if progress:
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=sum(map(_bytes, todo)), unit='B', unit_scale=True,
               desc=f'tokenizing {len(todo)} of {files} parts')
  n_workers = min(workers or os.cpu_count() or 1, max(len(todo), 1))

  def finish(task, part):
    done(task, part)
    if bar is not None:
      bar.update(_bytes(task))

  try:
    if n_workers <= 1:
      for task in todo:
        finish(task, tokenize_task(task))
    else:
      ctx = multiprocessing.get_context('spawn')  # the caller may hold threads (jax)
      pool = concurrent.futures.ProcessPoolExecutor(
          n_workers, mp_context=ctx, initializer=_worker_init, initargs=(os.getpid(),))
      try:
        with _terminate_on_sigterm(pool):
          for task, part in zip(todo, pool.map(tokenize_task, todo)):
            finish(task, part)
      except BaseException:  # an error, Ctrl-C, SIGTERM: the other files' work is not awaited
        _terminate(pool)
        # The pool's manager thread ends as it sees its workers gone; waiting
        # for it leaves nothing of the pool running at exit (where CPython
        # before 3.12.8 races its exit hook against that thread: EBADF).
        pool.shutdown(wait=True, cancel_futures=True)
        raise
      pool.shutdown()
  finally:
    if bar is not None:
      bar.close()


def _bytes(task: dict) -> int:
  return sum(s.get('bytes', 0) for s in task['sources'])


def _worker_init(parent: int) -> None:
  """A worker's start: on Linux it is killed when the prepare that started
  it dies, however it dies (``kill -9`` too: prctl PR_SET_PDEATHSIG); it
  leaves Ctrl-C to that process, which stops it."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  if sys.platform.startswith('linux'):
    import ctypes  # pylint: disable=g-import-not-at-top
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
  if os.getppid() != parent:  # it died before the line above
    os._exit(1)


def _terminate(pool: concurrent.futures.ProcessPoolExecutor) -> None:
  """Sends SIGTERM to the pool's workers (their files are tokenized again by
  the next prepare); takes no lock, so a signal handler may call it."""
  try:
    workers = list((getattr(pool, '_processes', None) or {}).values())
  except RuntimeError:  # changed while copied: the pool is starting or ending
    workers = []
  for w in workers:
    with contextlib.suppress(OSError, ValueError, AttributeError):
      w.terminate()


@contextlib.contextmanager
def _terminate_on_sigterm(pool: concurrent.futures.ProcessPoolExecutor) -> tp.Iterator[None]:
  """While the pool works, SIGTERM terminates its workers and raises
  ``SystemExit(143)`` (where SIGTERM has its default action and this is the
  main thread; ``poetx`` installs a handler that raises it, and the workers
  are terminated as the exit unwinds :func:`run_tasks`; elsewhere the
  workers' PR_SET_PDEATHSIG ends them)."""
  if (threading.current_thread() is not threading.main_thread()
      or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
    yield
    return

  def on_sigterm(signum, frame):
    del frame
    _terminate(pool)
    signal.signal(signum, signal.SIG_DFL)
    raise SystemExit(128 + signum)

  signal.signal(signal.SIGTERM, on_sigterm)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
