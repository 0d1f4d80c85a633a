"""Permutations of POET-X: drawing and inverting them, and the gathers that
apply them (:mod:`poetx_jax.ops` re-exports each), with backward passes that
gather by the inverse instead of scattering.

**Element and chunk permutations.** Only the block *partition* of a POET side
matters to training, not the order of the features inside a block (a
relabelling inside a block maps each generator ``Q`` to ``s Q s^T``, and the
series, Adam, clipping and the merge all commute with it). So besides the
published draw, a uniformly random permutation of the N features (``chunk
= 1``), a side may draw a *chunk permutation*: the features are cut into
aligned runs of ``chunk`` contiguous features, a uniformly random
permutation of the ``N // chunk`` whole runs is drawn, and a ragged last run
(``N % chunk`` features) stays last. Every permutation is stored the same
way, as an int32 index over the N features; a gather told ``chunk`` moves
whole runs (``x.reshape(..., N // chunk, chunk)[..., runs, :]``), which
reads memory in whole sectors where an element gather reads one element
per sector. A gather given ``chunk > 1`` takes on trust that its index is
a permutation of that structure (:func:`is_chunk_permutation` checks a
concrete one); every permutation a layer draws, inverts or composes with
another of its chunk size has it.

On GPUs every gather of activations or weights is a kernel of its own with
row-major operands (:mod:`poetx_jax.layout` says why). Inverting a
permutation is a scatter (and a copy of its buffer): cheap in bytes, but a
kernel launch each, so the gathers here take an inverse already formed
where there is one (:func:`invert_permutations` forms many with one scatter).
"""

from __future__ import annotations

import functools
import math
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np

from poetx_jax.layout import materialized, row_major

Array = jax.Array


PERMUTATIONS = ('element', 'chunk')


def check_chunk_size(chunk: int, block_size: int | None = None, what: str = 'chunk_size') -> int:
  """``chunk`` if it is a valid run length (an int >= 1 dividing
  ``block_size``, so that every block takes whole runs); else ValueError
  naming the value and what is valid."""
  if isinstance(chunk, (bool, np.bool_)) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
    raise ValueError(f'{what} must be an int >= 1 (features per run), got {chunk!r}')
  chunk = int(chunk)
  if block_size is not None and block_size % chunk:
    valid = [d for d in range(1, block_size + 1) if block_size % d == 0]
    raise ValueError(f'{what}={chunk} must divide the block size {block_size}, so that '
                     f'each block takes whole runs: one of {valid}')
  return chunk


def random_permutation(key: Array, n: int, chunk: int = 1) -> Array:
  """A uniformly random permutation of range(n), int32 (the one
  :func:`random_permutations` draws for ``(n,)``); with ``chunk > 1`` a
  chunk permutation (the module docstring)."""
  return random_permutations(key, (n,), chunk)[0]


def chunk_permutation(runs: Array, n: int, chunk: int) -> Array:
  """The permutation of range(n) that moves whole runs: position ``j`` of
  the result takes feature ``runs[j // chunk] * chunk + j % chunk`` for the
  ``n // chunk`` full runs (``runs`` a permutation of them), and the ragged
  last run, ``n % chunk`` features, stays last. int32."""
  full = n // chunk
  if runs.shape[-1] != full:
    raise ValueError(f'{n} features in runs of {chunk} need {full} run indices, '
                     f'got {runs.shape[-1]}')
  perm = (runs.astype(jnp.int32)[..., :, None] * chunk
          + jnp.arange(chunk, dtype=jnp.int32)).reshape(runs.shape[:-1] + (full * chunk,))
  if full * chunk == n:
    return perm
  tail = jnp.broadcast_to(jnp.arange(full * chunk, n, dtype=jnp.int32),
                          runs.shape[:-1] + (n - full * chunk,))
  return jnp.concatenate([perm, tail], axis=-1)


def is_chunk_permutation(perm, chunk: int) -> bool:
  """Whether the concrete index ``perm`` (any leading axes) is, along its
  last axis, a permutation of range(N) that moves aligned runs of ``chunk``
  features whole and keeps a ragged last run last (what
  :func:`random_permutations` draws for ``chunk``). Reads the values: not
  for use under ``jax.jit``."""
  p = np.asarray(perm)
  n = p.shape[-1]
  if not np.array_equal(np.sort(p, axis=-1), np.broadcast_to(np.arange(n), p.shape)):
    return False
  full = n // chunk * chunk
  runs = p[..., :full].reshape(p.shape[:-1] + (n // chunk, chunk))
  aligned = (runs[..., :1] % chunk == 0).all()
  whole = (runs == runs[..., :1] + np.arange(chunk)).all()
  return bool(aligned and whole and (p[..., full:] == np.arange(full, n)).all())


def random_permutations(key: Array, sizes: tp.Sequence[int],
                        chunk: int = 1) -> tuple[Array, ...]:
  """Independent uniformly random permutations of ``range(n)`` for each ``n``
  in ``sizes`` (int32), from one draw of random bits and one sort; with
  ``chunk > 1``, chunk permutations: a uniformly random permutation of each
  size's ``n // chunk`` whole runs (drawn as here), expanded by
  :func:`chunk_permutation`.

  Each position gets a 64-bit random sort key (two uint32 words); sorting
  the positions by (size's index, key) orders each range by its keys, so a
  range's order is a uniform permutation unless two of its keys are equal
  (probability below ``n**2 / 2**65``: 2e-11 for n = 28,672). One
  threefry call and one sort compile in about half the time of
  ``jax.random.permutation``'s split, draw and sort per size (each merge
  program draws two permutations).
  """
  sizes = tuple(int(n) for n in sizes)
  check_chunk_size(chunk, what='chunk')
  if chunk > 1:
    runs = random_permutations(key, [n // chunk for n in sizes])
    return tuple(chunk_permutation(r, n, chunk) for r, n in zip(runs, sizes))
  total = sum(sizes)
  hi, lo = jax.random.bits(key, (2, total), jnp.uint32)
  position = jnp.arange(total, dtype=jnp.int32)
  starts = [sum(sizes[:j]) for j in range(len(sizes))]
  segment = sum((position >= s).astype(jnp.int32) for s in starts[1:])  # size's index
  keys = (segment, hi, lo) if len(sizes) > 1 else (hi, lo)
  order = jax.lax.sort((*keys, position), num_keys=len(keys))[-1]
  return tuple(order[s:s + n] - s for s, n in zip(starts, sizes))


def invert_permutation(perm_N: Array) -> Array:
  """inv such that inv[perm[i]] = i (an O(N) scatter, no sort)."""
  n = perm_N.shape[-1]
  return jnp.zeros_like(perm_N).at[perm_N].set(jnp.arange(n, dtype=perm_N.dtype),
                                               unique_indices=True, mode='promise_in_bounds')


def permute(x_TxN: Array, perm_N: Array, inverse_N: Array | None = None, *,
            chunk: int = 1) -> Array:
  """x[..., perm]: a column gather whose backward is the inverse gather (by
  ``inverse_N``, perm's inverse, when given; else formed in the backward).
  ``chunk``: perm is a chunk permutation of runs of that many features
  (the module docstring): the gather moves whole runs.

  Left to autodiff, a gather's transpose is a scatter-add, ~25x slower on GPUs
  for activation-sized arrays; a permutation's transpose is just its inverse.
  """
  if inverse_N is None:
    return _permute(x_TxN, perm_N, chunk)
  return _gather_pair(x_TxN, perm_N, inverse_N, chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _permute(x_TxN: Array, perm_N: Array, chunk: int) -> Array:
  return _gather(x_TxN, perm_N, chunk)


def _gather(x_TxN, idx_N, chunk=1):
  # On GPUs: row-major operands and results, each gather a kernel of its own
  # (poetx_jax.layout says why), reading an index computed beforehand (a
  # computed index fused into it, as gather_between's, costs each element a
  # dependent load: twice the time).
  x_TxN = materialized(row_major(jnp.asarray(x_TxN)))
  idx_N = jnp.asarray(idx_N)
  axis = x_TxN.ndim - 1
  if _runs_apply(x_TxN.shape[axis], chunk):
    y = run_gather(x_TxN, materialized(run_index(idx_N, chunk)), chunk)
  else:
    y = _index(x_TxN, materialized(idx_N), axis)
  return materialized(row_major(y))


def _runs_apply(n: int, chunk: int) -> bool:
  return chunk > 1 and n >= chunk


def run_index(perm_N: Array, chunk: int) -> Array:
  """The run permutation of a chunk permutation: ``perm[::chunk] // chunk``
  over its ``N // chunk`` full runs (the ragged last run, which stays last,
  is not in it)."""
  full = perm_N.shape[-1] // chunk
  starts = perm_N[..., :full * chunk:chunk]
  return jax.lax.div(starts, jnp.asarray(chunk, starts.dtype))  # non-negative: no floor fix-up


# Bytes of the unsigned word a run of a column gather is moved in (at most
# the run's own bytes; 4 is the widest without 64-bit types enabled): wider
# words mean fewer gathered elements.
RUN_WORD_BYTES = 4


def run_gather(x_TxN: Array, runs: Array, chunk: int, *,
               word_bytes: int | None = None) -> Array:
  """``x[..., p]`` for the chunk permutation ``p`` whose full runs are
  ``runs`` (:func:`run_index`): the ``N // chunk`` runs of ``chunk``
  features are gathered whole (one gather of runs, each run moved as
  unsigned words of up to ``word_bytes`` bytes, default
  ``RUN_WORD_BYTES``, where the run's bytes divide into them); a ragged last
  run stays last. No custom VJP (:func:`permute` has one)."""
  n = x_TxN.shape[-1]
  full = n // chunk * chunk
  lead = x_TxN.shape[:-1]
  head = x_TxN if full == n else x_TxN[..., :full]
  runs_x = head.reshape(lead + (full // chunk, chunk))
  itemsize = jnp.dtype(x_TxN.dtype).itemsize
  word = min(RUN_WORD_BYTES if word_bytes is None else word_bytes, chunk * itemsize)
  packed = word > itemsize and (chunk * itemsize) % word == 0 and word in _WORDS
  if packed:
    per = word // itemsize
    runs_x = jax.lax.bitcast_convert_type(
        runs_x.reshape(lead + (full // chunk, chunk // per, per)), _WORDS[word])
  y = _index(runs_x, runs, len(lead))
  if packed:
    y = jax.lax.bitcast_convert_type(y, x_TxN.dtype)
  y = y.reshape(lead + (full,))
  return y if full == n else jnp.concatenate([y, x_TxN[..., full:]], axis=-1)


_WORDS = {2: jnp.uint16, 4: jnp.uint32}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def permute_rows(x_NxT: Array, perm_N: Array, chunk: int = 1) -> Array:
  """x[perm]: a row gather whose backward is the inverse gather (see
  :func:`permute`; ``chunk`` as there)."""
  return _take_rows(x_NxT, perm_N, chunk)


def _take_rows(x_NxT, idx_N, chunk=1):
  x_NxT, idx_N = jnp.asarray(x_NxT), jnp.asarray(idx_N)
  n = x_NxT.shape[0]
  if not _runs_apply(n, chunk):
    return _index(x_NxT, idx_N, 0)
  full = n // chunk * chunk
  head = x_NxT if full == n else x_NxT[:full]
  rows = _index(head.reshape((full // chunk, chunk) + x_NxT.shape[1:]), run_index(idx_N, chunk),
                0).reshape((full,) + x_NxT.shape[1:])
  return rows if full == n else jnp.concatenate([rows, x_NxT[full:]], axis=0)


def _index(x: Array, idx_N: Array, axis: int) -> Array:
  """``x`` indexed along ``axis`` by ``idx_N``, a permutation: one gather
  primitive, with no negative-index wrapping in front of it (which indexing
  through ``x.at[...]`` adds: three more operations per gather to trace,
  lower and compile)."""
  slices = list(x.shape)
  slices[axis] = 1
  dims = jax.lax.GatherDimensionNumbers(
      offset_dims=tuple(d for d in range(x.ndim) if d != axis), collapsed_slice_dims=(axis,),
      start_index_map=(axis,))
  return jax.lax.gather(x, idx_N[:, None], dims, tuple(slices), unique_indices=True,
                        mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _permute_rows_fwd(x_NxT, perm_N, chunk):
  return permute_rows(x_NxT, perm_N, chunk), perm_N


def _permute_rows_bwd(chunk, perm_N, g_NxT):
  return permute_rows(g_NxT, invert_permutation(perm_N), chunk), None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def _permute_fwd(x_TxN, perm_N, chunk):
  return _permute(x_TxN, perm_N, chunk), perm_N


def _permute_bwd(chunk, perm_N, g_TxN):
  return _gather(g_TxN, invert_permutation(perm_N), chunk), None


_permute.defvjp(_permute_fwd, _permute_bwd)


def invert_permutations(perms: tp.Sequence[Array]) -> list[Array]:
  """The inverses of several permutations (1-D), formed by one scatter."""
  if len(perms) <= 1:
    return [invert_permutation(p) for p in perms]
  sizes = [p.shape[-1] for p in perms]
  offsets = [sum(sizes[:j]) for j in range(len(perms))]
  inv = invert_permutation(jnp.concatenate([p + o for p, o in zip(perms, offsets)]))
  return [inv[o:o + n] - o for o, n in zip(offsets, sizes)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_pair(x_TxN, idx_N, back_N, chunk):
  """``x[..., idx]`` whose backward gathers by ``back``, idx's inverse."""
  return _gather(x_TxN, idx_N, chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _take_rows_pair(x_NxT, idx_N, back_N, chunk):
  """``x[idx]`` whose backward gathers rows by ``back``, idx's inverse."""
  return _take_rows(x_NxT, idx_N, chunk)


_gather_pair.defvjp(lambda x, idx, back, chunk: (_gather(x, idx, chunk), back),
                    lambda chunk, back, g: (_gather(g, back, chunk), None, None))
_take_rows_pair.defvjp(lambda x, idx, back, chunk: (_take_rows(x, idx, chunk), back),
                       lambda chunk, back, g: (_take_rows(g, back, chunk), None, None))


def unpermute(x_TxN: Array, perm_N: Array, inverse_N: Array | None = None, *,
              chunk: int = 1) -> Array:
  """``x[..., inverse(perm)]``, undoing :func:`permute` by ``perm``: the
  inverse formed once, in the forward (or given: ``inverse_N``); the backward
  gathers by ``perm`` itself (``permute`` by the inverse would invert it
  again). ``chunk`` as for :func:`permute`."""
  inverse_N = invert_permutation(perm_N) if inverse_N is None else inverse_N
  return _gather_pair(x_TxN, inverse_N, perm_N, chunk)


def unpermute_rows(x_NxT: Array, perm_N: Array, inverse_N: Array | None = None, *,
                   chunk: int = 1) -> Array:
  """``x[inverse(perm)]``: :func:`unpermute` along the first axis."""
  inverse_N = invert_permutation(perm_N) if inverse_N is None else inverse_N
  return _take_rows_pair(x_NxT, inverse_N, perm_N, chunk)


def gather_between(perm_out_N: Array, perm_in_N: Array,
                   inverse_out_N: Array | None = None) -> Array:
  """The one gather from a layer's unpermuted output to the next layer's
  permuted input: ``c`` with ``y[..., perm_in] == z[..., c]`` when
  ``y = z[..., inverse(perm_out)]`` (``c = inverse(perm_out)[perm_in]``;
  ``inverse_out_N``: perm_out's inverse, when already formed). Its inverse
  is ``inverse(perm_in)[perm_out]``.

  Between layers joined by elementwise ops only (SwiGLU's gate and up
  projections and the down projection), the output permutation of one and
  the input permutation of the next then cost one gather instead of two:
  ``poet_linear(..., permute_output=False)``, :func:`permute` by ``c``, the
  elementwise ops, ``poet_linear(..., permute_input=False)``.

  Of chunk permutations with runs of ``c_out`` and ``c_in`` features, ``c``
  is a chunk permutation with runs of ``gcd(c_out, c_in)``
  (:func:`joint_chunk`): a chunk permutation of runs of c is one of runs of
  any divisor of c, and inverses and compositions keep the structure.
  """
  inverse_out_N = invert_permutation(perm_out_N) if inverse_out_N is None else inverse_out_N
  return jnp.take(inverse_out_N, perm_in_N)


def joint_chunk(*chunks: int) -> int:
  """The run length of a composition (or inverse) of chunk permutations of
  these run lengths: their gcd (1 for any element permutation)."""
  return math.gcd(*chunks)
