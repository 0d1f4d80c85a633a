"""Reading a dataset directory written by ``poetx prepare``
(:mod:`poetx_jax.pretrain.data.prepare`): its token stream, the windows of each
split read on demand, and :class:`PreparedData`, what ``poetx train --data
DIR`` trains on.

Every shard is checked against the manifest before any of its tokens is
used: its size when the directory is opened; its sha256 and its largest id
(below the vocabulary) once per process, the first time it is read, or
before that by a background thread that :class:`PreparedData` starts, so
that hashing overlaps the rest of start-up instead of adding to it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import typing as tp
from pathlib import Path

import numpy as np

from poetx_jax.pretrain.data import windows as data
from poetx_jax.pretrain.data.tokenizer import Tokenizer, file_hash

PathLike = tp.Union[str, os.PathLike]

FORMAT = 'poetx-tokens-1'
MANIFEST = 'manifest.json'


def is_prepared(path: PathLike) -> bool:
  """Whether ``path`` is a dataset directory (it holds a manifest)."""
  return (Path(path) / MANIFEST).is_file()


def is_unfinished(path: PathLike) -> bool:
  """Whether ``path`` is a dataset directory that ``poetx prepare`` has begun
  and not finished (its ``parts/``, no manifest yet)."""
  path = Path(path)
  return path.is_dir() and (path / 'parts').is_dir() and not is_prepared(path)


# The shards checked in this process: (path, inode, size, mtime, sha256, vocabulary).
_VERIFIED: set[tuple] = set()
_CHUNK = 8 << 20


def _shard_digest(path: Path, dtype: np.dtype) -> tuple[str, int]:
  """(sha256 hex digest, largest id) of a shard file, read in chunks."""
  h, top = hashlib.sha256(), -1
  buf = bytearray(_CHUNK)
  with open(path, 'rb', buffering=0) as f:
    while n := f.readinto(buf):
      view = memoryview(buf)[:n]
      h.update(view)
      top = max(top, int(np.frombuffer(view, dtype).max()))
  return h.hexdigest(), top


class TokenShards:
  """The token stream of a prepared dataset directory (:mod:`poetx_jax.pretrain.data.prepare`):
  ``read(start, stop)`` reads int32 ids from the shard files with positioned
  reads (no memory map: mapped pages of randomly read windows would stay in
  the process's resident memory and grow with the corpus over a run).

  A shard is read only once it is verified: its bytes hash to the manifest's
  sha256 and its largest id is below the manifest's ``vocab_size``, checked
  once per process (by the first read of it, or by
  :meth:`verify_in_background`). Once a shard fails, every read raises.

  Raises:
    ValueError: the manifest is missing, unreadable or of another format, a
      shard is missing or not the size its manifest says, or the manifest
      records a shard's largest id (``max_id``) outside the vocabulary; from
      ``read``, a shard that fails its check (named).
  """

  def __init__(self, directory: PathLike):
    self.directory = Path(directory)
    path = self.directory / MANIFEST
    try:
      self.manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
      raise ValueError(f'{self.directory} is not a prepared dataset: cannot read '
                       f'{path} ({e})') from None
    if self.manifest.get('format') != FORMAT:
      raise ValueError(f'{path}: unknown format {self.manifest.get("format")!r} '
                       f'(expected {FORMAT})')
    self.dtype = np.dtype(self.manifest['dtype']).newbyteorder('<')
    for shard in self.manifest['shards']:
      f = self.directory / shard['file']
      want = shard['tokens'] * self.dtype.itemsize
      got = f.stat().st_size if f.is_file() else None
      if got != want:
        raise ValueError(f'{self.directory}: shard {shard["file"]} does not match the '
                         f'manifest ({"missing" if got is None else f"{got} bytes"}, '
                         f'expected {want} bytes); prepare the dataset again')
      if shard.get('max_id', -1) >= self.manifest['vocab_size']:
        raise self._outside(shard['file'], shard['max_id'])
    sizes = [s['tokens'] for s in self.manifest['shards']]
    self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    self._init_process_state()

  def _init_process_state(self) -> None:
    """The per-process state: open files, verified shards and their locks."""
    n = len(self.manifest['shards'])
    self._files, self._lock = {}, threading.Lock()
    self._verified, self._verifying = [False] * n, [threading.Lock() for _ in range(n)]
    self._failed, self._thread = None, None

  def __len__(self) -> int:
    return int(self.offsets[-1])

  _PER_PROCESS = ('_files', '_lock', '_verified', '_verifying', '_failed', '_thread')

  def __getstate__(self):  # files reopened and shards verified again where unpickled
    return {k: v for k, v in self.__dict__.items() if k not in self._PER_PROCESS}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_process_state()

  def _outside(self, name: str, top: int) -> ValueError:
    return ValueError(f'{self.directory}: shard {name} holds id {top}, outside the '
                      f'vocabulary of {self.manifest["vocab_size"]} of its tokenizer; '
                      f'prepare the dataset again')

  def _verify(self, i: int) -> None:
    """Raises ValueError (and fails every later read) unless shard ``i`` is
    verified; verifies it first if no one has (once per process)."""
    if self._failed is None and self._verified[i]:
      return
    with self._verifying[i]:
      if self._failed is None and not self._verified[i]:
        try:
          self._check_shard(self.manifest['shards'][i])
        except (OSError, ValueError) as e:
          self._failed = str(e) if isinstance(e, ValueError) else (
              f'{self.directory}: cannot read shard {self.manifest["shards"][i]["file"]} '
              f'({e})')
        else:
          self._verified[i] = True
    if self._failed is not None:
      raise ValueError(self._failed)

  def _check_shard(self, shard: dict) -> None:
    path = self.directory / shard['file']
    st = path.stat()
    vocab = self.manifest['vocab_size']
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, shard['sha256'], vocab)
    if key in _VERIFIED:
      return
    digest, top = _shard_digest(path, self.dtype)
    if digest != shard['sha256']:
      raise ValueError(f'{self.directory}: shard {shard["file"]} does not match its sha256 '
                       f'in the manifest (its bytes changed after it was written: '
                       f'{digest[:16]}..., expected {shard["sha256"][:16]}...); prepare '
                       f'the dataset again')
    if top >= vocab:
      raise self._outside(shard['file'], top)
    _VERIFIED.add(key)

  def verify_in_background(self) -> None:
    """Starts verifying every shard in a daemon thread, the last first (the
    validation split, read first by training); reads wait only for the
    shards they need. Idempotent."""
    if self._thread is None:
      self._thread = threading.Thread(target=self._verify_all, name='poetx-verify-shards',
                                      daemon=True)
      self._thread.start()

  def _verify_all(self) -> None:
    try:
      for i in reversed(range(len(self.manifest['shards']))):
        self._verify(i)
    except ValueError:
      pass  # raised again by the reads

  def wait_verified(self) -> None:
    """Verifies every shard now (those not yet done); ValueError naming the
    first that fails."""
    for i in range(len(self.manifest['shards'])):
      self._verify(i)

  def _read_shard(self, i: int, lo: int, hi: int) -> np.ndarray:
    self._verify(i)
    with self._lock:  # grain's reader threads share the open files
      f = self._files.get(i)
      if f is None:  # unbuffered; closed with this object
        f = self._files[i] = open(self.directory / self.manifest['shards'][i]['file'], 'rb',
                                  buffering=0)
    size = self.dtype.itemsize
    return np.frombuffer(os.pread(f.fileno(), (hi - lo) * size, lo * size), self.dtype)

  def read(self, start: int, stop: int) -> np.ndarray:
    """Tokens ``[start, stop)`` as int32 (clipped to the stream)."""
    start, stop = max(0, start), min(stop, len(self))
    if stop <= start:
      return np.zeros((0,), np.int32)
    first = int(np.searchsorted(self.offsets, start, side='right')) - 1
    parts = []
    i = first
    while start < stop:
      lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
      parts.append(self._read_shard(i, start - lo, min(stop, hi) - lo))
      start = min(stop, hi)
      i += 1
    return np.concatenate(parts).astype(np.int32)


class TokenWindows:
  """The windows :func:`~poetx_jax.pretrain.data.windows.pack` would cut from tokens ``[begin, end)`` of a
  :class:`TokenShards`, read on demand: indexing by an int, a slice or an int
  array gives what indexing ``pack(tokens[begin:end], seq_len)`` gives, without
  holding the stream in memory."""

  def __init__(self, shards: TokenShards, begin: int, end: int, seq_len: int,
               index: range | None = None):
    self.shards, self.begin, self.end, self.seq_len = shards, begin, end, seq_len
    n = end - begin
    self.index = index if index is not None else range(max(1, math.ceil((n - 1) / seq_len)))

  @property
  def shape(self) -> tuple[int, int]:
    return (len(self.index), self.seq_len + 1)

  ndim = 2
  dtype = np.dtype(np.int32)
  read_on_demand = True  # data.train_dataset / eval_batches index it, not load it

  @property
  def size(self) -> int:
    return self.shape[0] * self.shape[1]

  def __len__(self) -> int:
    return len(self.index)

  def _window(self, i: int) -> np.ndarray:
    start = self.begin + i * self.seq_len
    w = self.shards.read(start, min(start + self.seq_len + 1, self.end))
    if w.shape[0] < self.seq_len + 1:
      w = np.concatenate([w, np.full(self.seq_len + 1 - w.shape[0], -1, np.int32)])
    return w

  def __getitem__(self, key):
    if isinstance(key, slice):
      return TokenWindows(self.shards, self.begin, self.end, self.seq_len, self.index[key])
    if isinstance(key, (int, np.integer)):
      return self._window(self.index[key])
    key = np.asarray(key)
    if key.ndim != 1 or not np.issubdtype(key.dtype, np.integer):
      raise IndexError(f'TokenWindows takes an int, a slice or a 1-D int array, got {key!r}')
    rows = [self._window(self.index[int(k)]) for k in key]
    return np.stack(rows) if rows else np.zeros((0, self.seq_len + 1), np.int32)

  def __array__(self, dtype=None, copy=None):
    del copy
    out = self[np.arange(len(self))]
    return out if dtype is None else out.astype(dtype)


class PreparedData:
  """A prepared dataset directory split and cut into windows, as
  :class:`~poetx_jax.pretrain.data.windows.TextData`
  (same attributes), read from its shards on demand: start-up time and host
  memory do not grow with the corpus.

  The split is :func:`~poetx_jax.pretrain.data.windows.split`'s (the last
  ``val_fraction`` of the stream; None: no split, all of it trains); the
  windows are :class:`TokenWindows`. ``fingerprint`` holds each split's token
  count and, for its sha256, the digest of the manifest's shard hashes and the
  split's token range (computed when the dataset was prepared; each shard is
  checked against its hash before it is read, see :class:`TokenShards`,
  starting in the background here).
  """

  def __init__(self, directory: PathLike, *, seq_len: int, val_fraction: float | None = 0.05,
               tokenizer_path: PathLike | None = None):
    self.shards = TokenShards(directory)
    m = self.shards.manifest
    tok = Path(directory) / m['tokenizer']
    if tokenizer_path is not None and file_hash(tokenizer_path) != m['tokenizer_sha256']:
      raise ValueError(f'{directory} was tokenized with another tokenizer than '
                       f'{tokenizer_path}; prepare it again with --tokenizer '
                       f'{tokenizer_path}, or leave --tokenizer out')
    if file_hash(tok) != m['tokenizer_sha256']:
      raise ValueError(f'{tok} does not match the manifest of {directory}')
    self.tokenizer = Tokenizer.load(tok)
    if self.tokenizer.vocab_size != m['vocab_size']:
      raise ValueError(f'{tok} has a vocabulary of {self.tokenizer.vocab_size}, the manifest '
                       f'of {directory} says {m["vocab_size"]}; prepare the dataset again')
    self.shards.verify_in_background()
    n = len(self.shards)
    cut = n if val_fraction is None else data.split_point(n, val_fraction=val_fraction,
                                                          seq_len=seq_len)
    self.train_windows = TokenWindows(self.shards, 0, cut, seq_len)
    self.val_windows = TokenWindows(self.shards, cut, n, seq_len,
                                    index=range(0) if cut == n else None)
    self.num_tokens, self.seq_len = n, seq_len
    digest = hashlib.sha256(''.join(s['sha256'] for s in m['shards']).encode()).hexdigest()

    def range_hash(a, b):
      return hashlib.sha256(f'{digest}:{a}:{b}'.encode()).hexdigest()

    self.fingerprint = {'train_tokens': cut, 'train_sha256': range_hash(0, cut),
                        'val_tokens': n - cut, 'val_sha256': range_hash(cut, n)}
    self.description = (
        f'prepared dataset {directory}: {m["documents"]} documents from '
        f'{len(m["sources"])} files in {len(m["shards"])} shards; tokenizer '
        f'{m["tokenizer"]} (vocab {self.tokenizer.vocab_size}); {n:,} tokens -> '
        f'{len(self.train_windows)} train + {len(self.val_windows)} val windows of '
        f'{seq_len + 1}')

  def __repr__(self) -> str:
    return f'PreparedData({self.description})'
