"""Column permutation of activations, ``y = x[:, perm]``, as a Pallas kernel.

Notation: T tokens, N features; R rows and C output columns per program.

The one kernel here that is not Mosaic GPU: an arbitrary column gather needs a
per-element address, which TMA (the only bulk copy Mosaic GPU exposes on Hopper)
cannot express, and Mosaic GPU has no per-lane indexed load from global memory.
It therefore uses the Pallas Triton lowering (deprecated in jax 0.11, still
supported; it warns once per kernel), where a load from a pointer tensor is the
natural gather. Each program copies an (R, C) output tile whose source rows
are R whole rows of x; rows are read once from DRAM and the scattered reads are
served by the caches.

``permute`` is a ``jax.custom_vjp`` whose backward gathers the cotangent by the
inverse permutation (a gather's autodiff transpose would be a scatter-add),
exactly like ``poetx_jax.ops.permute`` (the tests check it against that). Not
among the kernels ``implementation='pallas'`` runs (see
:func:`pallas_kernels.layer_kernels`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Array = jax.Array

TILE_ELEMENTS = 8192  # R * C per program


def _tiles(t: int, n: int, cols: int | None) -> tuple[int, int]:
  """(R, C): C the largest power of two dividing N, at most ``cols`` (2048);
  R = 8192 / C."""
  cap = 2048 if cols is None else cols
  c = 1
  while n % (2 * c) == 0 and 2 * c <= cap:
    c *= 2
  r = max(1, TILE_ELEMENTS // c)
  while r > 1 and r > t:
    r //= 2
  return r, c


def gather_kernel(x_TxN: Array, idx_N: Array, *, interpret=False,
                  cols: int | None = None, whole_rows: bool = False) -> Array:
  """y[:, c] = x[:, idx[c]] for a 2-D x (no custom VJP); idx must be in range.

  Args:
    cols: the largest output column tile C (a power of two; default 2048).
    whole_rows: one program per R rows that walks all N / C column tiles in a
      loop (so a row's scattered reads hit the caches of one SM), instead of
      one program per (R, C) tile.
  """
  if x_TxN.ndim != 2:
    raise ValueError(f'x must be 2-D (T, N), got shape {x_TxN.shape}')
  t, n = x_TxN.shape
  if idx_N.shape != (n,):
    raise ValueError(f'idx must have shape ({n},) for x of width {n}, got {idx_N.shape}')
  r, c = _tiles(t, n, cols)
  tp = -(-t // r) * r
  xp = x_TxN if tp == t else jnp.pad(x_TxN, ((0, tp - t), (0, 0)))
  idx_N = idx_N.astype(jnp.int32)

  def tile(i, idx_C, x_ref):
    rows = i * r + jax.lax.broadcasted_iota(jnp.int32, (r, c), 0)
    return x_ref[rows, jnp.broadcast_to(idx_C[None, :], (r, c))]

  if not whole_rows:
    def body(idx_ref, x_ref, y_ref):
      y_ref[...] = tile(pl.program_id(0), idx_ref[...], x_ref)

    grid = (tp // r, n // c)
    in_specs = [pl.BlockSpec((c,), lambda i, j: (j,)), pl.BlockSpec(memory_space=pl.ANY)]
    out_specs = pl.BlockSpec((r, c), lambda i, j: (i, j))
  else:
    def body(idx_ref, x_ref, y_ref):
      i = pl.program_id(0)

      def step(j, carry):
        cs = pl.ds(pl.multiple_of(j * c, c), c)
        y_ref[pl.ds(i * r, r), cs] = tile(i, idx_ref[cs], x_ref)
        return carry
      jax.lax.fori_loop(0, n // c, step, 0)

    grid = (tp // r,)
    in_specs = [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    out_specs = pl.BlockSpec(memory_space=pl.ANY)

  y = pl.pallas_call(
      body,
      out_shape=jax.ShapeDtypeStruct((tp, n), x_TxN.dtype),
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      interpret=interpret,
      name='poetx_permute',
  )(idx_N, xp)
  return y[:t]


def _inverse(perm_N: Array) -> Array:
  """inv with inv[perm[i]] = i."""
  n = perm_N.shape[-1]
  return jnp.zeros_like(perm_N).at[perm_N].set(jnp.arange(n, dtype=perm_N.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _permute(x_TxN, perm_N, interpret):
  return gather_kernel(x_TxN, perm_N, interpret=interpret)


def _permute_fwd(x_TxN, perm_N, interpret):
  return _permute(x_TxN, perm_N, interpret), perm_N


def _permute_bwd(interpret, perm_N, g_TxN):
  return gather_kernel(g_TxN, _inverse(perm_N), interpret=interpret), None


_permute.defvjp(_permute_fwd, _permute_bwd)


def permute(x_TxN: Array, perm_N: Array, *, interpret=False) -> Array:
  """``x[..., perm]`` on the kernel; backward is the inverse-permutation gather."""
  y = _permute(x_TxN.reshape(-1, x_TxN.shape[-1]), perm_N, bool(interpret))
  return y.reshape(x_TxN.shape)
