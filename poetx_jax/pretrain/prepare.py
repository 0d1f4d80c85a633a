"""``poetx prepare``: corpus files of any size -> a tokenized dataset directory.

The directory holds the token stream of the corpus (every document's tokens
followed by the tokenizer's eos, documents in the order of
:func:`poetx_jax.pretrain.data.read_documents`) cut into shards of at most
``shard_tokens`` tokens, each a raw little-endian ``uint16`` array (``uint32``
when the vocabulary does not fit), read back with positioned reads; the tokenizer
(``tokenizer.json``); and ``manifest.json``::

    {"format": "poetx-tokens-1", "dtype": "uint16", "vocab_size": 4096,
     "eos_id": 4095, "tokenizer_sha256": ..., "text_field": "text",
     "bpe": {"vocab_size": 4096, "sample_chars": 100000000},
     "sources": [{"path": ..., "bytes": ..., "mtime_ns": ..., "sha256": ...}, ...],
     "shards": [{"file": "shard-00000-00000.bin", "tokens": ..., "sha256": ...,
                 "max_id": ...}, ...],
     "documents": ..., "tokens": ...}

Each source file is tokenized by a worker process of its own, streaming its
documents (jsonl line by line, parquet by record batch), so memory is bounded
by the shard size, not by the corpus. A source whose shards are written is
recorded in ``parts/``; an interrupted prepare resumes from there, and
running it again on unchanged inputs (same paths, sizes and modification
times, same tokenizer) does nothing; other inputs, another tokenizer, or
(without ``tokenizer``) another ``vocab_size`` or ``sample_chars`` for the
trained BPE are refused, finished or not. Training reads the directory with
:class:`poetx_jax.pretrain.shards.PreparedData` (``poetx train --data DIR``).

Without ``tokenizer`` a byte-level BPE of ``vocab_size`` is trained on a
sample: from each source file its first documents, up to ``sample_chars /
number of files`` characters each (100 M characters in all by default); the
two are recorded as ``"bpe"`` in the manifest (``null`` with a given
tokenizer), and in ``parts/bpe.json`` until the manifest is written.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import typing as tp
from pathlib import Path

import numpy as np

from poetx_jax.pretrain import data as data_lib
from poetx_jax.pretrain import shards
from poetx_jax.pretrain.files import atomic_write
from poetx_jax.pretrain.tokenizer import Tokenizer, file_hash

FORMAT = shards.FORMAT
MANIFEST = shards.MANIFEST
DEFAULT_SHARD_TOKENS = 1 << 24
DEFAULT_SAMPLE_CHARS = 100_000_000

PathLike = tp.Union[str, os.PathLike]


def token_dtype(vocab_size: int) -> np.dtype:
  """uint16 where every id fits, else uint32."""
  return np.dtype('<u2') if vocab_size <= 1 << 16 else np.dtype('<u4')


def _source_record(path: Path) -> dict:
  st = path.stat()
  return {'path': str(path.resolve()), 'bytes': st.st_size, 'mtime_ns': st.st_mtime_ns}


def _same_source(a: dict, b: dict) -> bool:
  return all(a[k] == b[k] for k in ('path', 'bytes', 'mtime_ns'))


def _sample(files: list[Path], text_field: str, sample_chars: int) -> tp.Iterator[str]:
  budget = max(1, sample_chars // max(len(files), 1))
  for f in files:
    taken = 0
    for doc in data_lib.iter_file_documents(f, text_field):
      yield doc
      taken += len(doc)
      if taken >= budget:
        break


_TOKENIZERS: dict[str, Tokenizer] = {}


def _tokenize_source(task: dict) -> dict:
  """Worker: one source file -> its shards in ``task['out']``; returns its part record."""
  path, out, index = Path(task['path']), Path(task['out']), task['index']
  tok = _TOKENIZERS.get(task['tokenizer'])
  if tok is None:
    tok = _TOKENIZERS[task['tokenizer']] = Tokenizer.load(task['tokenizer'])
  dtype, limit, eos = np.dtype(task['dtype']), task['shard_tokens'], tok.eos_id
  shards, pending, n_pending, documents = [], [], 0, 0

  def flush():
    nonlocal pending, n_pending
    if not n_pending:
      return
    arr = np.concatenate(pending)
    name = f'shard-{index:05d}-{len(shards):05d}.bin'
    atomic_write(out / name, arr.tofile)
    shards.append({'file': name, 'tokens': int(arr.size),
                   'sha256': hashlib.sha256(arr.tobytes()).hexdigest(),
                   'max_id': int(arr.max())})
    pending, n_pending = [], 0

  batch = []

  def encode(batch):
    nonlocal n_pending, documents
    for ids in tok.encode_batch(batch):
      ids = np.append(np.asarray(ids, dtype), np.asarray(eos, dtype))
      documents += 1
      while ids.size:  # a document may span shards
        room = limit - n_pending
        pending.append(ids[:room])
        n_pending += min(room, ids.size)
        ids = ids[room:]
        if n_pending >= limit:
          flush()

  for doc in data_lib.iter_file_documents(path, task['text_field']):
    batch.append(doc)
    if len(batch) == 64:
      encode(batch)
      batch = []
  if batch:
    encode(batch)
  flush()
  return {'source': {**task['source'], 'sha256': file_hash(path)},
          'shards': shards, 'documents': documents}


def prepare(inputs: PathLike | tp.Sequence[PathLike], out: PathLike, *,
            tokenizer: PathLike | None = None, vocab_size: int = 4096,
            text_field: str = 'text', workers: int | None = None,
            shard_tokens: int = DEFAULT_SHARD_TOKENS,
            sample_chars: int = DEFAULT_SAMPLE_CHARS,
            progress: bool = True) -> dict:
  """Tokenizes the corpus files ``inputs`` into the dataset directory ``out``
  (the module docstring has its layout). Returns the manifest.

  Args:
    inputs: files and directories, as :func:`~poetx_jax.pretrain.data.read_documents`.
    out: the dataset directory (created).
    tokenizer: a tokenizer file to use; None trains a BPE on a sample.
    vocab_size: the BPE's vocabulary when training one.
    text_field: the field holding the text in jsonl and parquet files.
    workers: worker processes (default: the CPUs, at most one per file).
    shard_tokens: tokens per shard at most.
    sample_chars: characters of the BPE's training sample at most.
    progress: show a progress bar over the source files' bytes.

  Raises:
    FileNotFoundError: an input does not exist.
    ValueError: a bad argument, an unsupported or unreadable file (named), no
      documents at all, or ``out`` holding a dataset (finished or not) of
      other inputs, another tokenizer or another BPE request.
  """
  _check_arguments(vocab_size=vocab_size, shard_tokens=shard_tokens,
                   sample_chars=sample_chars, workers=workers)
  plan = _plan(inputs, out, text_field)
  bpe = None if tokenizer is not None else {'vocab_size': vocab_size,
                                            'sample_chars': sample_chars}
  prepared = _prepared_manifest(plan, tokenizer, bpe)
  if prepared is not None:
    return prepared
  plan.out.mkdir(parents=True, exist_ok=True)
  tok_path = _store_tokenizer(plan, tokenizer, bpe)
  tok, tok_hash = Tokenizer.load(tok_path), file_hash(tok_path)
  dtype = token_dtype(tok.vocab_size)
  parts = _tokenize_sources(plan, tok_path, tok_hash, dtype, shard_tokens=shard_tokens,
                            workers=workers, progress=progress)
  return _write_manifest(plan, parts, tok, tok_path, tok_hash, dtype, bpe)


class _Plan(tp.NamedTuple):
  """What a prepare works on: the dataset directory, the source files (in the
  order of their documents), their records and the text field."""
  out: Path
  files: list[Path]
  sources: list[dict]
  text_field: str


def _check_arguments(*, vocab_size, shard_tokens, sample_chars, workers) -> None:
  """ValueError naming the first of the arguments that is not a positive int."""
  for name, value in (('vocab_size', vocab_size), ('shard_tokens', shard_tokens),
                      ('sample_chars', sample_chars)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'{name} must be a positive int, got {value!r}')
  if workers is not None and (not isinstance(workers, int) or workers < 1):
    raise ValueError(f'workers must be a positive int, got {workers!r}')


def _plan(inputs: PathLike | tp.Sequence[PathLike], out: PathLike, text_field: str) -> _Plan:
  """The source files of ``inputs`` and the dataset directory ``out`` (not a file)."""
  files = data_lib.corpus_files(inputs)
  out = Path(out)
  if out.exists() and not out.is_dir():
    raise ValueError(f'--out {out} is a file, not a directory')
  return _Plan(out, files, [_source_record(f) for f in files], text_field)


def _prepared_manifest(plan: _Plan, tokenizer: PathLike | None,
                       bpe: dict | None) -> dict | None:
  """The manifest of ``plan.out`` if it is already prepared from these inputs
  (and ``tokenizer``, if given, or the ``bpe`` request); None if it holds no
  manifest.

  Raises:
    ValueError: ``plan.out`` holds a dataset of other inputs, tokenizer or
      BPE request.
  """
  manifest_path = plan.out / MANIFEST
  if not manifest_path.is_file():
    return None
  old = json.loads(manifest_path.read_text())
  same_inputs = (len(old['sources']) == len(plan.sources)
                 and all(map(_same_source, old['sources'], plan.sources)))
  same_tokenizer = tokenizer is None or file_hash(tokenizer) == old['tokenizer_sha256']
  if same_inputs and same_tokenizer and old.get('text_field') == plan.text_field:
    _check_bpe(plan.out, old.get('bpe'), bpe)
    return old
  raise ValueError(f'{plan.out} holds a prepared dataset of other inputs or another '
                   f'tokenizer; give a new --out, or remove {plan.out} first')


def _check_bpe(out: Path, old: dict | None, new: dict | None) -> None:
  """ValueError if ``out`` holds a BPE trained on another request than ``new``
  (a directory without a record, of an older prepare or a given tokenizer,
  passes)."""
  if old is None or new is None or old == new:
    return
  keys = [k for k in new if old.get(k) != new[k]]
  was = ', '.join(f'{k}={old.get(k)}' for k in keys)
  now = ', '.join(f'--{k.replace("_", "-")} {new[k]}' for k in keys)
  raise ValueError(f'{out} holds a tokenizer trained with {was}, not {now}; give another '
                   f'--out, or remove {out} first to prepare it again')


def _store_tokenizer(plan: _Plan, tokenizer: PathLike | None, bpe: dict | None) -> Path:
  """``out/tokenizer.json``: a copy of ``tokenizer``, else (unless there already,
  trained on the same ``bpe`` request) a BPE of ``bpe['vocab_size']`` trained
  on a sample of the sources, its request kept in ``out/parts/bpe.json``."""
  tok_path, record = plan.out / 'tokenizer.json', plan.out / 'parts' / 'bpe.json'
  if tokenizer is not None:
    record.unlink(missing_ok=True)  # the tokenizer there is no longer a trained one
    src = Path(tokenizer)
    if src.suffix != '.json':
      raise ValueError(f'prepare takes a tokenizers JSON file, got {src}')
    Tokenizer.load(src)  # readable
    if not tok_path.is_file() or file_hash(tok_path) != file_hash(src):
      atomic_write(tok_path, lambda tmp: shutil.copyfile(src, tmp))
    return tok_path
  if tok_path.is_file():
    _check_bpe(plan.out, json.loads(record.read_text()) if record.is_file() else None, bpe)
    return tok_path
  sample = [d for d in _sample(plan.files, plan.text_field, bpe['sample_chars']) if d.strip()]
  if not sample:
    raise ValueError('corpus is empty: no non-empty documents in '
                     + ', '.join(map(str, plan.files)))
  record.parent.mkdir(exist_ok=True)
  atomic_write(record, lambda tmp: Path(tmp).write_text(json.dumps(bpe)))
  Tokenizer.train_bpe(sample, vocab_size=bpe['vocab_size'], path=tok_path)
  return tok_path


def _tokenize_sources(plan: _Plan, tok_path: Path, tok_hash: str, dtype: np.dtype, *,
                      shard_tokens: int, workers: int | None, progress: bool) -> list[dict]:
  """The part record of every source file, in order: the one in ``out/parts``
  where it is of the same source, tokenizer and text field, else that of
  the file tokenized now (:func:`_tokenize_source`), recorded there."""
  parts_dir = plan.out / 'parts'
  parts_dir.mkdir(exist_ok=True)
  parts, todo = {}, []
  for i, (f, rec) in enumerate(zip(plan.files, plan.sources)):
    part_file = parts_dir / f'{i:05d}.json'
    if part_file.is_file():
      part = json.loads(part_file.read_text())
      if (_same_source(part['source'], rec) and part.get('tokenizer') == tok_hash
          and part.get('text_field') == plan.text_field):
        parts[i] = part
        continue
    todo.append({'index': i, 'path': str(f), 'out': str(plan.out), 'source': rec,
                 'tokenizer': str(tok_path), 'dtype': dtype.str,
                 'shard_tokens': shard_tokens, 'text_field': plan.text_field})

  def done(task, part):
    part['tokenizer'], part['text_field'] = tok_hash, plan.text_field
    atomic_write(parts_dir / f'{task["index"]:05d}.json',
                 lambda tmp: Path(tmp).write_text(json.dumps(part)))
    parts[task['index']] = part

  _run_tasks(todo, done, workers=workers, progress=progress, files=len(plan.files))
  return [parts[i] for i in range(len(plan.files))]


def _run_tasks(todo: list[dict], done: tp.Callable[[dict, dict], None], *,
               workers: int | None, progress: bool, files: int) -> None:
  """Runs :func:`_tokenize_source` on each task of ``todo`` (in ``workers``
  processes where there are several) and ``done(task, part)`` as each ends,
  in order, with a progress bar over their bytes if ``progress``."""
  bar = None
  if progress:
    from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=sum(t['source']['bytes'] for t in todo), unit='B', unit_scale=True,
               desc=f'tokenizing {len(todo)} of {files} files')
  n_workers = min(workers or os.cpu_count() or 1, max(len(todo), 1))

  def finish(task, part):
    done(task, part)
    if bar is not None:
      bar.update(task['source']['bytes'])

  try:
    if n_workers <= 1:
      for task in todo:
        finish(task, _tokenize_source(task))
    else:
      ctx = multiprocessing.get_context('spawn')  # the caller may hold threads (jax)
      pool = concurrent.futures.ProcessPoolExecutor(
          n_workers, mp_context=ctx, initializer=_worker_init, initargs=(os.getpid(),))
      try:
        with _terminate_on_sigterm(pool):
          for task, part in zip(todo, pool.map(_tokenize_source, todo)):
            finish(task, part)
      except BaseException:  # an error, Ctrl-C: the other files' work is not awaited
        _terminate(pool)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
      pool.shutdown()
  finally:
    if bar is not None:
      bar.close()


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
  """While the pool works, SIGTERM first terminates its workers, then this
  process as SIGTERM does by default (where SIGTERM has its default action
  and this is the main thread; elsewhere the workers' PR_SET_PDEATHSIG does)."""
  if (threading.current_thread() is not threading.main_thread()
      or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
    yield
    return

  def on_sigterm(signum, frame):
    del frame
    _terminate(pool)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)

  signal.signal(signal.SIGTERM, on_sigterm)
  try:
    yield
  finally:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _write_manifest(plan: _Plan, parts: list[dict], tok: Tokenizer, tok_path: Path,
                    tok_hash: str, dtype: np.dtype, bpe: dict | None) -> dict:
  """Writes ``out/manifest.json`` of the source files' ``parts`` and returns it.

  Raises:
    ValueError: the sources hold no tokens at all.
  """
  all_shards = [s for p in parts for s in p['shards']]
  if not all_shards:
    raise ValueError('corpus is empty: no non-empty documents in '
                     + ', '.join(map(str, plan.files)))
  manifest = {'format': FORMAT, 'dtype': dtype.name, 'vocab_size': tok.vocab_size,
              'eos_id': tok.eos_id, 'tokenizer': tok_path.name,
              'tokenizer_sha256': tok_hash, 'text_field': plan.text_field, 'bpe': bpe,
              'sources': [p['source'] for p in parts], 'shards': all_shards,
              'documents': sum(p['documents'] for p in parts),
              'tokens': sum(s['tokens'] for s in all_shards)}
  text = json.dumps(manifest, indent=1)
  atomic_write(plan.out / MANIFEST, lambda tmp: Path(tmp).write_text(text))
  return manifest
