"""Block sizes and skew-symmetric generators: the packed form of a POET block.

Notation: N features of one side, B block size, K = ceil(N / B) blocks,
P = B(B-1)/2 packed parameters per block.

Each block's generator ``Q`` (``Q^T = -Q``) is stored as its strict upper
triangle in row-major order, (K, P) float32. A dimension that is not a
multiple of B has a smaller last block of r = N - (K-1) B features: its
generator is confined to the top-left r x r corner (:func:`ragged_mask`).
:mod:`poetx_jax.ops` re-exports everything here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def num_blocks(n: int, block_size: int) -> int:
  """K = ceil(n / B): the number of B x B blocks that cover n features."""
  return -(-n // block_size)


def skew_size(block_size: int) -> int:
  """P = B(B-1)/2: packed parameters per skew-symmetric B x B block."""
  return block_size * (block_size - 1) // 2


def check_block_size(block_size, *dims: int, what: str = 'block_size') -> None:
  """Raises ValueError unless 1 < block_size <= every dimension in ``dims``."""
  if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
    raise TypeError(f'{what} must be an int > 1, got {block_size!r}')
  if block_size <= 1:
    raise ValueError(f'{what} must be > 1, got {block_size}')
  for d in dims:
    if block_size > d:
      raise ValueError(
          f'{what}={block_size} is larger than the dimension {d}; '
          f'valid block sizes are 2..{min(dims)}')


# ---------------------------------------------------------------- skew packing
def _triu(block_size: int):
  return np.triu_indices(block_size, k=1)


@functools.lru_cache(maxsize=None)
def _skew_index(block_size: int):
  """(B, B) index into [0, q...] and the sign that builds Q from packed q."""
  rows, cols = _triu(block_size)
  idx = np.zeros((block_size, block_size), np.int32)
  idx[rows, cols] = idx[cols, rows] = np.arange(1, rows.size + 1)
  sign = np.zeros((block_size, block_size), np.float32)
  sign[rows, cols], sign[cols, rows] = 1.0, -1.0
  return idx, sign


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _unpack(q_KxP, block_size):
  idx, sign = _skew_index(block_size)
  flat = jnp.concatenate([jnp.zeros(q_KxP.shape[:-1] + (1,), q_KxP.dtype), q_KxP], -1)
  return jnp.take(flat, idx, axis=-1) * sign.astype(q_KxP.dtype)


def _unpack_fwd(q_KxP, block_size):
  return _unpack(q_KxP, block_size), None


def _unpack_bwd(block_size, _, g_KxBxB):
  # Q = U - U^T, so dq = upper triangle of (dQ - dQ^T): a gather, not a scatter.
  return (pack_skew(g_KxBxB - jnp.swapaxes(g_KxBxB, -1, -2)),)


_unpack.defvjp(_unpack_fwd, _unpack_bwd)


def unpack_skew(q_KxP: Array, block_size: int) -> Array:
  """Packed strict upper triangles (K, P) -> skew-symmetric blocks (K, B, B)."""
  if q_KxP.shape[-1] != skew_size(block_size):
    raise ValueError(
        f'packed skew parameters have last dim {q_KxP.shape[-1]}, expected '
        f'B(B-1)/2 = {skew_size(block_size)} for block_size={block_size}')
  return _unpack(q_KxP, block_size)


def pack_skew(q_KxBxB: Array) -> Array:
  """Skew-symmetric blocks (K, B, B) -> their strict upper triangles (K, P)."""
  rows, cols = _triu(q_KxBxB.shape[-1])
  return q_KxBxB[..., rows, cols]


def ragged_mask(n: int, block_size: int) -> np.ndarray | None:
  """(K, P) float mask that confines the last block to its r x r corner.

  Returns None when ``block_size`` divides ``n`` (nothing to mask).
  """
  k = num_blocks(n, block_size)
  r = n - (k - 1) * block_size
  if r == block_size:
    return None
  rows, cols = _triu(block_size)
  mask = np.ones((k, rows.size), np.float32)
  mask[-1] = (cols < r).astype(np.float32)  # cols > rows, so this covers both
  return mask



def generator_bound_sq(q_KxBxB: Array) -> Array:
  """(K,) squared upper bounds on each block's spectral norm: ``||Q^T Q||_inf``,
  the largest absolute row sum of ``Q^T Q`` (= ``-Q^2``), which is
  ``>= ||Q^T Q||_2 = ||Q||_2^2``. Exact for the rotation in the plane of two
  orthogonal sign vectors (the pattern of a sign-like Adam step); for a
  block of independent entries its square root is about ``B^(1/4) / 2``
  times the spectral norm (1.2 to 1.8 times, measured on Llama-130M's
  generators at B = 256)."""
  q = q_KxBxB.astype(jnp.float32)
  qtq = jnp.matmul(jnp.swapaxes(q, -1, -2), q, precision=jax.lax.Precision.HIGHEST)
  return jnp.max(jnp.sum(jnp.abs(qtq), axis=-1), axis=-1)


def cap_generators(q_KxBxB: Array, max_norm: float) -> Array:
  """Each block ``Q`` scaled by ``min(1, max_norm / b)``, b the bound of
  :func:`generator_bound_sq` (its square root), so that ``||Q||_2 <= max_norm``.

  The truncated Cayley–Neumann series converges only for ``||Q||_2 < 1`` and
  its orthogonality error grows like ``||Q||^(k+2)``; a cap below 1 keeps every
  rotation the series forms close to orthogonal, however large a step the
  optimizer takes. Blocks under the cap are unchanged (scale exactly 1).
  Differentiable, also at ``Q = 0``.
  """
  bound_sq = generator_bound_sq(q_KxBxB)
  over = bound_sq > max_norm ** 2
  scale = jnp.where(over, max_norm * jax.lax.rsqrt(jnp.where(over, bound_sq, 1.0)), 1.0)
  return q_KxBxB * scale[..., None, None].astype(q_KxBxB.dtype)
