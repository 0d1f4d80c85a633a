"""Plain-jnp statements of the fused kernels of :mod:`pallas_kernels.fused_rotate`
(poetx_jax.ops' gathers and block products), what the tests and
experiments/bench_fused.py compare them with."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from poetx_jax import ops


def permute_rotate_reference(x_TxN, perm_N, g_KxBxB, precision=None, chunk=1):
  """:func:`~pallas_kernels.fused_rotate.permute_rotate` in plain jnp (ops' gather and block products)."""
  return ops.rotate_features(ops.permute(x_TxN, perm_N, chunk=chunk), g_KxBxB,
                             precision=precision)


def rotate_unpermute_reference(w_TxN, g_KxBxB, dst_N, precision=None, chunk=1):
  """:func:`~pallas_kernels.fused_rotate.rotate_unpermute` in plain jnp."""
  return ops.unpermute(ops.rotate_features(w_TxN, g_KxBxB, precision=precision), dst_N,
                       chunk=chunk)


def block_gram_reference(a_TxN, b_TxN, block_size, a_src=None, b_src=None, chunk=1):
  """:func:`~pallas_kernels.fused_rotate.block_gram` as an einsum on the
  gathered (by ops' gathers, of runs of ``chunk``), zero-padded operands."""
  n = a_TxN.shape[-1]
  k = -(-n // block_size)

  def blocks(v, src):
    v = v if src is None else ops.permute(v, src, chunk=chunk)
    return ops.pad_features(v, k * block_size).reshape(-1, k, block_size)
  return jnp.einsum('tki,tkj->kij', blocks(a_TxN, a_src), blocks(b_TxN, b_src),
                    preferred_element_type=jnp.float32,
                    precision=jax.lax.Precision.HIGHEST)
