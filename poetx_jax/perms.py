"""Permutations of POET-X: drawing and inverting them, and the gathers that
apply them (:mod:`poetx_jax.ops` re-exports each), with backward passes that
gather by the inverse instead of scattering.

On GPUs every gather of activations or weights is a kernel of its own with
row-major operands (:mod:`poetx_jax.layout` says why). Inverting a
permutation is a scatter (and a copy of its buffer): cheap in bytes, but a
kernel launch each, so the gathers here take an inverse already formed
where there is one (:func:`invert_permutations` forms many with one scatter).
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp

from poetx_jax.layout import materialized, row_major

Array = jax.Array


def random_permutation(key: Array, n: int) -> Array:
  """A uniformly random permutation of range(n), int32 (the one
  :func:`random_permutations` draws for ``(n,)``)."""
  return random_permutations(key, (n,))[0]


def random_permutations(key: Array, sizes: tp.Sequence[int]) -> tuple[Array, ...]:
  """Independent uniformly random permutations of ``range(n)`` for each ``n``
  in ``sizes`` (int32), from one draw of random bits and one sort.

  Each position gets a 64-bit random sort key (two uint32 words); sorting
  the positions by (size's index, key) orders each range by its keys, so a
  range's order is a uniform permutation unless two of its keys are equal
  (probability below ``n**2 / 2**65``: 2e-11 for n = 28,672). One
  threefry call and one sort compile in about half the time of
  ``jax.random.permutation``'s split, draw and sort per size (each merge
  program draws two permutations).
  """
  sizes = tuple(int(n) for n in sizes)
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


def permute(x_TxN: Array, perm_N: Array, inverse_N: Array | None = None) -> Array:
  """x[..., perm]: a column gather whose backward is the inverse gather (by
  ``inverse_N``, perm's inverse, when given; else formed in the backward).

  Left to autodiff, a gather's transpose is a scatter-add, ~25x slower on GPUs
  for activation-sized arrays; a permutation's transpose is just its inverse.
  """
  if inverse_N is None:
    return _permute(x_TxN, perm_N)
  return _gather_pair(x_TxN, perm_N, inverse_N)


@jax.custom_vjp
def _permute(x_TxN: Array, perm_N: Array) -> Array:
  return _gather(x_TxN, perm_N)


def _gather(x_TxN, idx_N):
  # On GPUs: row-major operands and results, each gather a kernel of its own
  # (poetx_jax.layout says why), reading an index computed beforehand (a
  # computed index fused into it, as gather_between's, costs each element a
  # dependent load: twice the time).
  x_TxN = materialized(row_major(jnp.asarray(x_TxN)))
  idx_N = materialized(jnp.asarray(idx_N))
  return materialized(row_major(_index(x_TxN, idx_N, x_TxN.ndim - 1)))


@jax.custom_vjp
def permute_rows(x_NxT: Array, perm_N: Array) -> Array:
  """x[perm]: a row gather whose backward is the inverse gather (see :func:`permute`)."""
  return _take_rows(x_NxT, perm_N)


def _take_rows(x_NxT, idx_N):
  return _index(jnp.asarray(x_NxT), jnp.asarray(idx_N), 0)


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


def _permute_rows_fwd(x_NxT, perm_N):
  return permute_rows(x_NxT, perm_N), perm_N


def _permute_rows_bwd(perm_N, g_NxT):
  return permute_rows(g_NxT, invert_permutation(perm_N)), None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


def _permute_fwd(x_TxN, perm_N):
  return _permute(x_TxN, perm_N), perm_N


def _permute_bwd(perm_N, g_TxN):
  return _gather(g_TxN, invert_permutation(perm_N)), None


_permute.defvjp(_permute_fwd, _permute_bwd)


def invert_permutations(perms: tp.Sequence[Array]) -> list[Array]:
  """The inverses of several permutations (1-D), formed by one scatter."""
  if len(perms) <= 1:
    return [invert_permutation(p) for p in perms]
  sizes = [p.shape[-1] for p in perms]
  offsets = [sum(sizes[:j]) for j in range(len(perms))]
  inv = invert_permutation(jnp.concatenate([p + o for p, o in zip(perms, offsets)]))
  return [inv[o:o + n] - o for o, n in zip(offsets, sizes)]


@jax.custom_vjp
def _gather_pair(x_TxN, idx_N, back_N):
  """``x[..., idx]`` whose backward gathers by ``back``, idx's inverse."""
  return _gather(x_TxN, idx_N)


@jax.custom_vjp
def _take_rows_pair(x_NxT, idx_N, back_N):
  """``x[idx]`` whose backward gathers rows by ``back``, idx's inverse."""
  return _take_rows(x_NxT, idx_N)


_gather_pair.defvjp(lambda x, idx, back: (_gather(x, idx), back),
                    lambda back, g: (_gather(g, back), None, None))
_take_rows_pair.defvjp(lambda x, idx, back: (_take_rows(x, idx), back),
                       lambda back, g: (_take_rows(g, back), None, None))


def unpermute(x_TxN: Array, perm_N: Array, inverse_N: Array | None = None) -> Array:
  """``x[..., inverse(perm)]``, undoing :func:`permute` by ``perm``: the
  inverse formed once, in the forward (or given: ``inverse_N``); the backward
  gathers by ``perm`` itself (``permute`` by the inverse would invert it again)."""
  inverse_N = invert_permutation(perm_N) if inverse_N is None else inverse_N
  return _gather_pair(x_TxN, inverse_N, perm_N)


def unpermute_rows(x_NxT: Array, perm_N: Array, inverse_N: Array | None = None) -> Array:
  """``x[inverse(perm)]``: :func:`unpermute` along the first axis."""
  inverse_N = invert_permutation(perm_N) if inverse_N is None else inverse_N
  return _take_rows_pair(x_NxT, inverse_N, perm_N)


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
  """
  inverse_out_N = invert_permutation(perm_out_N) if inverse_out_N is None else inverse_out_N
  return jnp.take(inverse_out_N, perm_in_N)
