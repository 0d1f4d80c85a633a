"""POET-XQ: the frozen base weight stored as int8 or int4 with group scales.

A quantised base is re-quantised at every merge and dequantised inside the
layer (:func:`poetx_jax.ops.poet_linear`'s ``kernel_scale``), so under
``mode='mem'`` only the quantised array is kept for the backward.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

Array = jax.Array

QUANT_BITS = {'int8': (jnp.int8, 127), 'int4': (jnp.int4, 7)}


def quantize_kernel(kernel_IxO: Array, *, bits: str = 'int8',
                    group_size: int = 128) -> tuple[Array, Array]:
  """Symmetric group-wise quantisation of a kernel along its input axis.

  Each group of ``group_size`` consecutive input rows of one output column
  shares a float32 scale ``absmax / qmax`` (qmax 127 for int8, 7 for int4).
  Rows are zero-padded to a multiple of the group size.

  Returns:
    (q of shape (I_padded, O) in int8 / int4, scales of shape (I_padded/G, O)).
  """
  if bits not in QUANT_BITS:
    raise ValueError(f'bits must be one of {tuple(QUANT_BITS)}, got {bits!r}')
  if (not isinstance(group_size, numbers.Integral) or isinstance(group_size, bool)
      or group_size < 1):
    raise ValueError(f'group_size must be an int >= 1, got {group_size!r}')
  dtype, qmax = QUANT_BITS[bits]
  i, o = kernel_IxO.shape
  ip = -(-i // group_size) * group_size
  w = jnp.pad(kernel_IxO.astype(jnp.float32), ((0, ip - i), (0, 0)))
  w = w.reshape(ip // group_size, group_size, o)
  scale = jnp.max(jnp.abs(w), axis=1) / qmax
  safe = jnp.where(scale > 0, scale, 1.0)
  q = jnp.clip(jnp.round(w / safe[:, None, :]), -qmax, qmax).astype(dtype)
  return q.reshape(ip, o), scale


def dequantize_kernel(q_IxO: Array, scale_GxO: Array, in_features: int,
                      dtype=jnp.float32) -> Array:
  """Inverse of :func:`quantize_kernel`: (in_features, O) in ``dtype``."""
  ip, o = q_IxO.shape
  g = scale_GxO.shape[0]
  w = q_IxO.astype(jnp.float32).reshape(g, ip // g, o) * scale_GxO[:, None, :]
  return w.reshape(ip, o)[:in_features].astype(dtype)
