"""The Cayley–Neumann series of POET's rotation blocks (the maths is stated in
:mod:`poetx_jax.ops`, which re-exports everything here).

Notation: K blocks of B x B, P = B(B-1)/2 packed skew parameters per block, N
the dimension of the side a set of blocks rotates.
"""

from __future__ import annotations

import functools
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np

from poetx_jax.skew import cap_generators, ragged_mask, unpack_skew

Array = jax.Array

DEFAULT_TERMS = 4


def cayley_neumann(q_KxBxB: Array, terms: int = DEFAULT_TERMS,
                   precision=jax.lax.Precision.HIGHEST) -> Array:
  """G = I + 2 * sum_{i=1..terms} Q^i, the truncated Cayley transform, by Horner.

  Args:
    q_KxBxB: skew-symmetric blocks, shape (..., B, B).
    terms: number of powers of Q kept (k >= 1); ``terms - 1`` products.
    precision: matmul precision (HIGHEST keeps float32 exact on GPUs).

  Returns:
    The blocks of ``G`` in the dtype of ``q_KxBxB``.
  """
  if not isinstance(terms, (int, np.integer)) or terms < 1:
    raise ValueError(f'terms must be an int >= 1, got {terms!r}')
  mm = functools.partial(jnp.matmul, precision=precision)
  eye = jnp.eye(q_KxBxB.shape[-1], dtype=q_KxBxB.dtype)
  # Q (I + Q (I + ... (I + Q))) with ``terms`` factors of Q in all.
  acc = q_KxBxB
  for _ in range(terms - 1):
    acc = mm(q_KxBxB, eye + acc)
  return eye + 2 * acc


def rotation_blocks(q_KxP: Array, n: int, block_size: int,
                    terms: int = DEFAULT_TERMS,
                    precision=jax.lax.Precision.HIGHEST,
                    max_norm: float | None = None) -> Array:
  """Packed parameters of one side -> its (K, B, B) rotation blocks G (float32).

  Applies the ragged-block mask when ``block_size`` does not divide ``n``,
  and :func:`cap_generators` when ``max_norm`` is given.
  """
  q = unpack_skew(_masked(q_KxP, n, block_size), block_size)
  return cayley_neumann(q if max_norm is None else cap_generators(q, max_norm), terms,
                        precision)


def _masked(q_KxP: Array, n: int, block_size: int) -> Array:
  """float32 generators of one side, the ragged last block confined to its corner."""
  mask = ragged_mask(n, block_size)
  q = q_KxP.astype(jnp.float32)
  return q if mask is None else q * mask


def rotation_blocks_pair(q_in_KxP: Array, q_out_KxP: Array, i: int, o: int,
                         block_size: int, terms: int = DEFAULT_TERMS,
                         precision=jax.lax.Precision.HIGHEST,
                         series: tp.Callable | None = None,
                         max_norm: float | None = None) -> tuple[Array, Array]:
  """rotation_blocks for both sides of a layer as one batched series.

  Same values as two ``rotation_blocks`` calls, in half the (small) kernels.
  ``series(q_KxBxB, terms)``, if given, replaces :func:`cayley_neumann` (a
  kernel implementation of the same map; ``precision`` is then unused).
  ``max_norm``: :func:`cap_generators` first (None: no cap).
  """
  g_in, g_out = rotation_blocks_batched([(q_in_KxP, i), (q_out_KxP, o)], block_size, terms,
                                        precision, series, max_norm)
  return g_in, g_out


def rotation_blocks_batched(sides: tp.Sequence[tuple[Array, int]], block_size: int,
                            terms: int = DEFAULT_TERMS, precision=jax.lax.Precision.HIGHEST,
                            series: tp.Callable | None = None,
                            max_norm: float | None = None) -> list[Array]:
  """rotation_blocks of several sides (``(q_KxP, n)`` each: packed generators
  and the side's dimension), all of block size B, as one batched series:
  unpacked, capped and raised to their powers together, then split back. The
  values are those of one ``rotation_blocks`` call per side (each block's
  series is computed on its own); the series of a whole decoder layer's
  projections then takes the few kernels of one side's. Other arguments as
  for :func:`rotation_blocks_pair`."""
  q = jnp.concatenate([_masked(q_KxP, n, block_size) for q_KxP, n in sides])
  q = unpack_skew(q, block_size)
  if max_norm is not None:
    q = cap_generators(q, max_norm)
  g = cayley_neumann(q, terms, precision) if series is None else series(q, terms)
  ends = np.cumsum([q_KxP.shape[0] for q_KxP, _ in sides])
  return [g[a:b] for a, b in zip([0, *ends[:-1]], ends)]


def series_precision(dtype) -> jax.lax.Precision:
  """The Cayley–Neumann products' precision for activations of ``dtype``:
  HIGHEST for 32-bit ones, DEFAULT for 16-bit ones (whose block products
  round the blocks to 16 bits anyway)."""
  return (jax.lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize >= 4
          else jax.lax.Precision.DEFAULT)


def orthogonality_error(g_KxBxB: Array) -> Array:
  """max over blocks of ||G^T G - I||_F / sqrt(B)."""
  b = g_KxBxB.shape[-1]
  g = g_KxBxB.astype(jnp.float32)
  gtg = jnp.matmul(jnp.swapaxes(g, -1, -2), g, precision=jax.lax.Precision.HIGHEST)
  err = jnp.linalg.norm(gtg - jnp.eye(b), axis=(-2, -1)) / np.sqrt(b)
  return jnp.max(err)
