"""Several corpora in one run: a weighted mixture of training sources
(``--data A:0.7 B:0.3``) and a validation set of its own (``--val-data PATH...``).

Each source of a mixture is a path as ``--data`` takes one alone (files, a
folder, or a prepared dataset directory). Training draws from the sources in
the proportion of their weights, in a fixed order (:class:`Selection`), each
source's windows shuffled and reshuffled every one of its own epochs (a
small source is repeated more often than a large one), through grain
(``MapDataset.select_from_datasets``): the pipeline is deterministic, and its
iterator's ``get_state`` / ``set_state`` resume it exactly, as for one source.
How many windows of each source training has drawn after ``k`` windows is
:meth:`Selection.counts`.

Without ``--val-data`` each source keeps its last ``val_fraction`` for
validation, and the validation windows are those of all sources interleaved
in the proportion of the weights (:func:`interleave`), so the first
``eval_batches`` of them are a weighted sample of every source. With
``--val-data`` the sources train whole, and validation reads the given paths.
"""

from __future__ import annotations

import fractions
import hashlib
import json
import math
import sys
import typing as tp

import numpy as np

if tp.TYPE_CHECKING:
  import grain


def parse_data(entries: tp.Sequence[str]) -> list[tuple[str, float | None]]:
  """``--data`` entries as ``(path, weight)``: ``PATH:W`` gives a weight
  (W a number > 0), a path alone None; an entry that exists as a path is a
  path, colon or not.

    >>> parse_data(['corpus/:0.7', 'web:0.3'])
    [('corpus/', 0.7), ('web', 0.3)]

  Raises:
    ValueError: a weight that is not a finite number > 0 (also one that is
      no number, after a path that exists), or some entries weighted and
      others not (naming them).
  """
  import os  # pylint: disable=g-import-not-at-top
  out = []
  for entry in entries:
    path, colon, weight = entry.rpartition(':')
    if not colon or not path or os.path.exists(entry):
      out.append((entry, None))
      continue
    try:
      w = float(weight)
    except ValueError:
      w = None
    if w is None and not os.path.exists(path):
      out.append((entry, None))  # a colon in a path
      continue
    if w is None or not (math.isfinite(w) and w > 0):  # PATH exists: W is its weight
      raise ValueError(f'--data {entry}: the weight of {path} must be a number > 0, got '
                       f'{weight!r}')
    out.append((path, w))
  weighted = [p for p, w in out if w is not None]
  if weighted and len(weighted) != len(out):
    plain = [p for p, w in out if w is None]
    raise ValueError(f'--data: give every path a weight (PATH:W) to mix them, or none to '
                     f'read them as one corpus; {", ".join(plain)} has none, '
                     f'{", ".join(weighted)} has one')
  return out


class Selection:
  """Element ``k`` of a mixed stream -> ``(source, index in that source)``,
  for sources weighted ``weights``: every prefix of the stream holds each
  source in the proportion of its weight, to within one element (grain's
  rule for ``MapDataset.mix``, with the weights made exact integers). A
  grain ``DatasetSelectionMap``, endless."""

  def __init__(self, weights: tp.Sequence[float]):
    fr = [fractions.Fraction(str(w)).limit_denominator(10 ** 6) for w in weights]
    den = math.lcm(*(f.denominator for f in fr))
    ints = [int(f * den) for f in fr]
    g = math.gcd(*ints)
    self.proportions = tuple(p // g for p in ints)

  def __len__(self) -> int:
    return sys.maxsize

  def counts(self, k: int) -> list[int]:
    """How many of the first ``k`` elements come from each source."""
    out, remaining = [], sum(self.proportions)
    for p in self.proportions:
      rest = (k * (remaining - p)) // remaining
      out.append(k - rest)
      k, remaining = rest, remaining - p
    return out

  def __getitem__(self, k: int) -> tuple[int, int]:
    before, after = self.counts(k), self.counts(k + 1)
    i = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
    return i, before[i]


def interleave(lengths: tp.Sequence[int], weights: tp.Sequence[float]) -> np.ndarray:
  """``(N, 2)`` int64 ``(source, index)`` of all ``sum(lengths)`` windows of
  the sources in the order of their times ``(index + 0.5) / weight`` (ties
  by source): in the weights' proportion while each source lasts, then what
  is left of the others."""
  src = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)]).astype(np.int64)
  idx = np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)
  times = (idx + 0.5) / np.asarray(weights, np.float64)[src]
  order = np.lexsort((src, times))
  return np.stack([src[order], idx[order]], axis=1)


class _Tag:
  """A window index of source ``i`` -> ``[i, index]`` (picklable)."""

  def __init__(self, i: int):
    self.i = i

  def __call__(self, index) -> np.ndarray:
    return np.array([self.i, index], np.int64)


class _PairsToBatch:
  """``(B, 2)`` ``(source, index)`` pairs of a global batch -> the batch dict of
  its rows ``rows``; only those windows are read."""

  def __init__(self, parts: tp.Sequence, rows: slice = slice(None)):
    self.parts, self.rows = parts, rows

  def __call__(self, pairs: np.ndarray) -> dict[str, np.ndarray]:
    from poetx_jax.pretrain.data import windows as data  # pylint: disable=g-import-not-at-top
    return data.to_batch(_read(self.parts, np.asarray(pairs)[self.rows]))


def _read(parts: tp.Sequence, pairs: np.ndarray) -> np.ndarray:
  """The windows ``(source, index)`` of ``pairs``, in order, read per source."""
  width = parts[0].shape[1]
  out = np.empty((len(pairs), width), np.int32)
  for i, part in enumerate(parts):
    rows = np.flatnonzero(pairs[:, 0] == i)
    if rows.size:
      out[rows] = np.asarray(part[pairs[rows, 1]])
  return out


class PairWindows:
  """The windows ``pairs`` (``(source, index)`` rows) of the sources'
  windows ``parts``, read on demand and indexed like an ``(N, L + 1)`` array
  (an int, a slice, an int array), as :class:`~poetx_jax.pretrain.data.shards.TokenWindows`."""

  ndim = 2
  dtype = np.dtype(np.int32)
  read_on_demand = True

  def __init__(self, parts: tp.Sequence, pairs: np.ndarray):
    self.parts, self.pairs = list(parts), np.asarray(pairs, np.int64).reshape(-1, 2)

  @property
  def shape(self) -> tuple[int, int]:
    return (len(self.pairs), self.parts[0].shape[1])

  @property
  def size(self) -> int:
    return self.shape[0] * self.shape[1]

  def __len__(self) -> int:
    return len(self.pairs)

  def __getitem__(self, key):
    if isinstance(key, slice):
      return PairWindows(self.parts, self.pairs[key])
    if isinstance(key, (int, np.integer)):
      return _read(self.parts, self.pairs[[key]])[0]
    return _read(self.parts, self.pairs[np.asarray(key)])

  def __array__(self, dtype=None, copy=None):
    del copy
    out = _read(self.parts, self.pairs)
    return out if dtype is None else out.astype(dtype)


class MixedWindows:
  """The training windows of a mixture: the sources' windows ``parts`` and
  their ``weights``. ``len`` is all their windows; :func:`~poetx_jax.pretrain.data.windows.train_dataset`
  builds its batches with :meth:`grain_dataset`."""

  ndim = 2
  dtype = np.dtype(np.int32)
  read_on_demand = True

  def __init__(self, parts: tp.Sequence, weights: tp.Sequence[float]):
    self.parts, self.weights = list(parts), list(weights)
    self.selection = Selection(weights)

  @property
  def shape(self) -> tuple[int, int]:
    return (sum(len(p) for p in self.parts), self.parts[0].shape[1])

  def __len__(self) -> int:
    return self.shape[0]

  def grain_dataset(self, *, batch_size: int, seed: int, rows: slice) -> grain.MapDataset:
    """Endless batches of the mixture (rows ``rows`` of each global batch of
    ``batch_size``); each source shuffled with a seed of its own from ``seed``."""
    import grain  # pylint: disable=g-import-not-at-top
    parts = []
    for i, part in enumerate(self.parts):
      part_seed = int(np.random.SeedSequence([int(seed), i]).generate_state(1)[0])
      parts.append(grain.MapDataset.range(len(part)).shuffle(seed=part_seed).repeat()
                   .map(_Tag(i)))
    return (grain.MapDataset.select_from_datasets(parts, self.selection)
            .batch(batch_size, drop_remainder=True)
            .map(_PairsToBatch(self.parts, rows)))

  def drawn(self, windows: int) -> list[int]:
    """The windows of each source among the first ``windows`` of training."""
    return self.selection.counts(windows)


def combined_hash(entries: tp.Sequence[tuple]) -> str:
  """The sha256 of a JSON list: a mixture's identity from its sources'."""
  return hashlib.sha256(json.dumps([list(e) for e in entries]).encode()).hexdigest()


class MixtureData:
  """The data of a run of weighted sources, or of sources with a validation
  set of their own: what :class:`~poetx_jax.pretrain.data.windows.TextData` is for one
  corpus (same attributes).

  Args:
    parts: each source's data (a ``TextData`` or ``PreparedData``, split by
      ``val_fraction`` unless ``val`` is given, one tokenizer for all).
    weights: the sources' weights (one source: its weight is unused).
    names: the sources as ``--data`` names them.
    val: the data of ``--val-data`` (unsplit; its windows validate), or None.
    val_name: its paths, for the description.

  Attributes, beyond ``TextData``'s: ``fingerprint['sources']``, each
  source's ``data``, ``weight`` and its tokens and windows in each split
  (``fingerprint['val_data']`` for the validation set), stored in the run's
  ``data.json``; :meth:`drawn`.
  """

  def __init__(self, parts: tp.Sequence, weights: tp.Sequence[float], names: tp.Sequence[str],
               val=None, val_name: str = ''):
    self.parts, self.weights, self.names = list(parts), list(weights), list(names)
    self.tokenizer, self.seq_len = parts[0].tokenizer, parts[0].seq_len
    fps = [p.fingerprint for p in parts]
    if len(parts) == 1:
      self.train_windows = parts[0].train_windows
      train = (fps[0]['train_tokens'], fps[0]['train_sha256'])
    else:
      self.train_windows = MixedWindows([p.train_windows for p in parts], weights)
      train = (sum(f['train_tokens'] for f in fps),
               combined_hash([(w, f['train_tokens'], f['train_sha256'])
                              for w, f in zip(weights, fps)]))
    if val is not None:
      self.val_windows = val.train_windows
      vfp = val.fingerprint
      valid = (vfp['train_tokens'], vfp['train_sha256'])
    else:
      lengths = [len(p.val_windows) for p in parts]
      self.val_windows = PairWindows([p.val_windows for p in parts],
                                     interleave(lengths, weights))
      valid = (sum(f['val_tokens'] for f in fps),
               combined_hash([(w, f['val_tokens'], f['val_sha256'])
                              for w, f in zip(weights, fps)]))
    self.num_tokens = sum(p.num_tokens for p in parts) + (val.num_tokens if val else 0)
    self.fingerprint = {
        'train_tokens': train[0], 'train_sha256': train[1],
        'val_tokens': valid[0], 'val_sha256': valid[1],
        'sources': [{'data': n, 'weight': w, 'train_tokens': f['train_tokens'],
                     'train_windows': len(p.train_windows), 'val_tokens': f['val_tokens'],
                     'val_windows': len(p.val_windows)}
                    for n, w, f, p in zip(names, weights, fps, parts)]}
    if val is not None:
      self.fingerprint['val_data'] = {'data': val_name, 'tokens': valid[0],
                                      'windows': len(self.val_windows)}
    each = '; '.join(
        f'{n}' + (f' (weight {w:g})' if len(parts) > 1 else '') + f': {p.description}'
        for n, w, p in zip(names, weights, parts))
    self.description = (
        f'{"mixture of " + str(len(parts)) + " sources" if len(parts) > 1 else "1 source"}'
        f' -> {len(self.train_windows)} train windows; {each}'
        + (f'; validation set {val_name}: {len(self.val_windows)} windows' if val is not None
           else f'; validation: the sources\' last windows, {len(self.val_windows)} in all'))

  def drawn(self, windows: int) -> dict[str, int]:
    """How many windows of each source the first ``windows`` training windows hold."""
    if len(self.parts) == 1:
      return {self.names[0]: windows}
    return dict(zip(self.names, self.train_windows.drawn(windows)))

  def __repr__(self) -> str:
    return f'MixtureData({self.description})'
