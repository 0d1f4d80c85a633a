"""Rotary position embeddings in the Hugging Face "rotate_half" convention
(the head dimension split into a first and a second half), as the Llama
decoder (:mod:`poetx_jax.models.llama`) applies them to queries and keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def rope_tables(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
  """cos, sin of shape ``positions.shape + (D,)``, float32 (HF rotate_half layout)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def rotate_half(x: Array) -> Array:
  """(x1, x2) -> (-x2, x1) over the halves of the last axis."""
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  """Rotates x (B, T, heads, D) by cos, sin (B or 1, T, D) in float32."""
  x32 = x.astype(jnp.float32)
  cos, sin = cos[..., None, :], sin[..., None, :]
  return (x32 * cos + rotate_half(x32) * sin).astype(x.dtype)
