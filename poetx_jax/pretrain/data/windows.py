"""Text data for LLM pretraining: packed windows and grain batches of documents
(read by :mod:`poetx_jax.pretrain.data.documents`, re-exported here).

Everything is local (no network). The path from text to batches (the
tokenizer in tokenizer.py)::

  docs = read_documents(['corpus/'])             # or corpus.default_corpus()[0]
  tok = load_or_train_tokenizer(docs, vocab_size=4096, cache_dir='cache')
  tokens = tokenize_corpus(docs, tok, cache_dir='cache')   # int32, eos after each doc
  train, val = split(tokens, val_fraction=0.05, seq_len=512)
  ds = train_dataset(pack(train, 512), batch_size=32, seed=0)
  batches = eval_batches(pack(val, 512), batch_size=32)

or all at once with :class:`TextData`; a directory written by ``poetx prepare``
(:mod:`poetx_jax.pretrain.data.prepare`) is read by
:class:`poetx_jax.pretrain.data.shards.PreparedData`, window by window. A window holds ``seq_len + 1`` tokens;
a batch is ``{'inputs': window[:-1], 'targets': window[1:]}`` with ``-1`` marking
masked targets (padding).
"""

from __future__ import annotations

import hashlib
import math
import os
import typing as tp

import numpy as np

from poetx_jax.pretrain.data import corpus
from poetx_jax.pretrain.data.documents import (SUPPORTED_EXTENSIONS, TEXT_EXTENSIONS,  # noqa: F401
                                          corpus_files, corpus_sources, iter_file_documents,
                                          read_documents)
from poetx_jax.pretrain.data.tokenizer import load_or_train_tokenizer, tokenize_corpus

if tp.TYPE_CHECKING:
  import grain

PathLike = tp.Union[str, os.PathLike]


# ----------------------------------------------------------------------------- windows


def pack(tokens: np.ndarray, seq_len: int) -> np.ndarray:
  """Cuts a token stream into windows of ``seq_len + 1``, (N, seq_len + 1) int32.

  Window i is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``: consecutive
  windows overlap by one token, so every token after the first is a target
  exactly once. The last window is padded with -1 (a masked target).

    >>> pack(np.arange(8), 3)
    array([[ 0,  1,  2,  3],
           [ 3,  4,  5,  6],
           [ 6,  7, -1, -1]], dtype=int32)
  """
  if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
    raise ValueError(f'seq_len must be a positive int, got {seq_len!r}')
  tokens = np.asarray(tokens)
  if tokens.ndim != 1:
    raise ValueError(f'tokens must be 1-D, got shape {tokens.shape}')
  n = tokens.shape[0]
  if n == 0:
    return np.zeros((0, seq_len + 1), np.int32)
  num = max(1, math.ceil((n - 1) / seq_len))
  padded = np.full(num * seq_len + 1, -1, np.int32)
  padded[:n] = tokens
  # Every seq_len-th window of width seq_len + 1, copied out of a strided view.
  return np.lib.stride_tricks.sliding_window_view(padded, seq_len + 1)[::seq_len].copy()


def split(tokens: np.ndarray, *, val_fraction: float,
          seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """Splits a token stream into ``(train, val)``: val is its last
  ``val_fraction``, at least one window (``seq_len + 1`` tokens). Nothing is
  shuffled here; :func:`train_dataset` shuffles the training windows.
  """
  tokens = np.asarray(tokens)
  cut = split_point(tokens.shape[0], val_fraction=val_fraction, seq_len=seq_len)
  return tokens[:cut], tokens[cut:]


def split_point(n: int, *, val_fraction: float, seq_len: int) -> int:
  """Where :func:`split` cuts a stream of ``n`` tokens: val is the last
  ``max(ceil(val_fraction * n), seq_len + 1)`` tokens.

  Raises:
    ValueError: a bad fraction or length, or too few tokens for a window in
      each split (naming how many are needed).
  """
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f'val_fraction must be in (0, 1), got {val_fraction!r}')
  if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
    raise ValueError(f'seq_len must be a positive int, got {seq_len!r}')
  w = seq_len + 1

  def n_val(total):
    return max(math.ceil(val_fraction * total), w)

  if n - n_val(n) < w:
    need = max(2 * w, math.floor(w / (1.0 - val_fraction)))
    while need - n_val(need) < w:
      need += 1
    raise ValueError(f'corpus too small for a train and a validation split: it has '
                     f'{n} tokens, and needs at least {need} (a window of {w} tokens '
                     f'in each, val_fraction={val_fraction})')
  return n - n_val(n)


def token_hash(tokens: np.ndarray) -> str:
  """The sha256 hex digest of a token stream (its int32 little-endian bytes)."""
  return hashlib.sha256(np.ascontiguousarray(tokens, '<i4').tobytes()).hexdigest()


class _WindowsToBatch:
  """Maps the window indices of a global batch to a batch dict of the rows
  ``rows`` of it (picklable); only those windows are read."""

  def __init__(self, windows: np.ndarray, rows: slice = slice(None)):
    self.windows = windows
    self.rows = rows

  def __call__(self, idx: np.ndarray) -> dict[str, np.ndarray]:
    return to_batch(self.windows[np.asarray(idx)[self.rows]])


def to_batch(w: np.ndarray) -> dict[str, np.ndarray]:
  """(B, L + 1) windows -> ``{'inputs': (B, L), 'targets': (B, L)}`` int32."""
  return {'inputs': np.ascontiguousarray(np.maximum(w[:, :-1], 0), dtype=np.int32),
          'targets': np.ascontiguousarray(w[:, 1:], dtype=np.int32)}


def _check_windows(windows: np.ndarray, batch_size: int) -> np.ndarray:
  if not getattr(windows, 'read_on_demand', False):  # shards.TokenWindows are not loaded
    windows = np.asarray(windows)
  if windows.ndim != 2 or windows.shape[1] < 2:
    raise ValueError(f'windows must be (N, seq_len + 1) with seq_len >= 1, '
                     f'got shape {windows.shape}')
  if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
    raise ValueError(f'batch_size must be a positive int, got {batch_size!r}')
  if getattr(windows, 'read_on_demand', False):
    return windows
  return windows.astype(np.int32, copy=False)


def _import_grain():
  """grain, imported on first use (evaluation and tokenisation do not need it)."""
  try:
    import grain
  except ImportError as e:
    raise ImportError('training batches need grain: pip install grain==0.2.18') from e
  return grain


def train_dataset(windows: np.ndarray, *, batch_size: int, seed: int,
                  shard_index: int = 0, shard_count: int = 1,
                  read_options: grain.ReadOptions | None = None) -> grain.IterDataset:
  """An endless grain pipeline of shuffled training batches.

  Windows are shuffled with ``seed``, reshuffled differently every epoch, and
  batched per epoch (the remainder dropped, other windows each epoch) into
  ``{'inputs': (B, L) int32, 'targets': (B, L) int32}``, inputs ``window[:-1]``
  (padding -1 read as 0) and targets ``window[1:]`` (-1 = masked).

  With ``shard_count`` > 1 (the processes of a multi-host run, each with its
  ``shard_index``) the pipeline yields rows ``shard_index * B / shard_count``
  up to the next share of each global batch of B, and reads only those
  windows: the shares of one step, stacked in shard order, are the batch a
  single process gets, so a run sees the same windows whatever its number of
  processes.

  Windows of a mixture (:class:`poetx_jax.pretrain.data.mixture.MixedWindows`)
  give its batches, drawn from its sources in the proportion of their weights.

  ``iter()`` of the result is a ``grain.DatasetIterator``; its ``get_state()``
  is a JSON-serialisable dict, and ``set_state`` on a fresh iterator of the same
  pipeline resumes with exactly the batches of an uninterrupted run.

  Args:
    windows: (N, L + 1) from :func:`pack`, N >= batch_size.
    batch_size: B, the global batch.
    seed: a non-negative int.
    shard_index, shard_count: this process's share of each batch;
      ``shard_count`` must divide B.
    read_options: grain's threading and prefetch (default 2 threads, 8 batches).
  """
  windows = _check_windows(windows, batch_size)
  if windows.shape[0] < batch_size:
    raise ValueError(f'{windows.shape[0]} training windows are fewer than '
                     f'batch_size={batch_size}')
  if not isinstance(seed, (int, np.integer)) or seed < 0:
    raise ValueError(f'seed must be a non-negative int, got {seed!r}')
  if (not isinstance(shard_count, (int, np.integer)) or shard_count < 1
      or batch_size % shard_count):
    raise ValueError(f'shard_count must be a positive int dividing batch_size={batch_size}'
                     f', got {shard_count!r}')
  if not isinstance(shard_index, (int, np.integer)) or not 0 <= shard_index < shard_count:
    raise ValueError(f'shard_index must be an int in [0, {shard_count}), got {shard_index!r}')
  share = batch_size // shard_count
  rows = slice(shard_index * share, (shard_index + 1) * share)
  # grain seeds epoch e with seed + e; mixing keeps nearby seeds' epochs apart.
  shuffle_seed = int(np.random.SeedSequence(int(seed)).generate_state(1)[0])
  grain = _import_grain()
  if hasattr(windows, 'grain_dataset'):  # a mixture's
    ds = windows.grain_dataset(batch_size=batch_size, seed=shuffle_seed, rows=rows)
  else:
    ds = (grain.MapDataset.range(windows.shape[0])
          .shuffle(seed=shuffle_seed)
          .batch(batch_size, drop_remainder=True)
          .repeat()
          .map(_WindowsToBatch(windows, rows)))
  if read_options is None:
    read_options = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)
  return ds.to_iter_dataset(read_options)


def eval_batches(windows: np.ndarray, *, batch_size: int) -> list[dict[str, np.ndarray]]:
  """All windows in order as batches like :func:`train_dataset`'s; the last
  batch padded with fully masked rows (inputs 0, targets -1)."""
  windows = _check_windows(windows, batch_size)
  n, width = windows.shape
  rows = math.ceil(n / batch_size) * batch_size
  padded = np.full((rows, width), -1, np.int32)
  padded[:n] = windows
  return [to_batch(padded[i:i + batch_size]) for i in range(0, rows, batch_size)]


# ----------------------------------------------------------------------------- all of it


class TextData:
  """A corpus tokenized, split and packed into windows.

  ``docs`` (None: :func:`~poetx_jax.pretrain.data.corpus.default_corpus`) are tokenized with ``tokenizer_path``
  if given, else with a byte-level BPE of ``vocab_size`` trained on the whole
  corpus; both the tokenizer and the token stream are cached in ``cache_dir``.
  The last ``val_fraction`` of the tokens is the validation split (None:
  there is none, every token trains).

  Attributes:
    tokenizer: the :class:`~poetx_jax.pretrain.data.tokenizer.Tokenizer`.
    train_windows, val_windows: (N, seq_len + 1) int32, from :func:`pack`.
    num_tokens: tokens in the whole corpus, eos included.
    seq_len: as given.
    fingerprint: the identity of the splits, ``{'train_tokens': n,
      'train_sha256': ..., 'val_tokens': m, 'val_sha256': ...}`` (each a
      :func:`token_hash` of the split's token stream).
    description: a line on the corpus, tokenizer and sizes.

  Batches come from :func:`train_dataset` and :func:`eval_batches` of the windows.
  """

  def __init__(self, docs: tp.Sequence[str] | None = None, *, seq_len: int,
               cache_dir: PathLike, tokenizer_path: PathLike | None = None,
               vocab_size: int = 4096, val_fraction: float | None = 0.05):
    if docs is None:
      docs, desc = corpus.default_corpus()
    else:
      docs = list(docs)
      desc = f'{len(docs)} documents, {sum(map(len, docs)):,} characters'
    self.tokenizer = load_or_train_tokenizer(docs, path=tokenizer_path,
                                             vocab_size=vocab_size, cache_dir=cache_dir)
    tokens = tokenize_corpus(docs, self.tokenizer, cache_dir=cache_dir)
    train, val = ((tokens, tokens[:0]) if val_fraction is None else
                  split(tokens, val_fraction=val_fraction, seq_len=seq_len))
    self.train_windows, self.val_windows = pack(train, seq_len), pack(val, seq_len)
    self.num_tokens = int(len(tokens))
    self.seq_len = seq_len
    self.fingerprint = {'train_tokens': int(len(train)), 'train_sha256': token_hash(train),
                        'val_tokens': int(len(val)), 'val_sha256': token_hash(val)}
    self.description = (
        f'{desc}; tokenizer {self.tokenizer.path.name} (vocab {self.tokenizer.vocab_size});'
        f' {self.num_tokens:,} tokens -> {len(self.train_windows)} train +'
        f' {len(self.val_windows)} val windows of {seq_len + 1}')

  def __repr__(self) -> str:
    return f'TextData({self.description})'

