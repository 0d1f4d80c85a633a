"""Lean optimizer state for the parameters POET-X does not rotate.

Embeddings, the LM head and norms keep ordinary AdamW in POET-X, and at scale
they hold most of the remaining optimizer memory (a 128k x 8192 embedding has
a billion entries). :func:`scale_by_lean_adam` is Adam with

* the first moment stored in a low-precision dtype (bf16 by default), and
* the second moment of every matrix factored Adafactor-style into its row and
  column means: ``v ~ outer(r, c) / mean(r)``, R + C numbers instead of R * C
  (the building blocks of :mod:`poetx_jax.factored`).

Vectors (and matrices with a side shorter than ``min_dim_size_to_factor``)
keep an exact float32 second moment. Select it per parameter group with
``optax.partition``; ``poetx train --lean-state`` uses it for all non-POET
parameters.

References:
  Shazeer & Stern, Adafactor: Adaptive Learning Rates with Sublinear Memory
  Cost, ICML 2018.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
import optax

from poetx_jax.factored import factored_moments_like, is_factored, update_factored_moment
from poetx_jax.hyperparams import check_hyperparameters, check_mu_dtype

Array = jax.Array


class LeanAdamState(tp.NamedTuple):
  """State of :func:`scale_by_lean_adam`.

  ``v_row`` / ``v_col`` hold the factored second moments of matrix leaves and
  ``v_full`` the exact ones of the others (:func:`poetx_jax.factored_moments_like`);
  unused entries are one-element placeholders, so each field has the
  parameters' tree structure.
  """
  count: Array
  mu: optax.Updates
  v_row: optax.Updates
  v_col: optax.Updates
  v_full: optax.Updates


def scale_by_lean_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *,
                       mu_dtype: tp.Any = jnp.bfloat16,
                       min_dim_size_to_factor: int = 128) -> optax.GradientTransformation:
  """Adam scaling with a low-precision first moment and factored second moments.

  For a matrix leaf (..., R, C) the state holds ``r`` (..., R) and ``c``
  (..., C), exponential moving averages of the row and column means of ``g**2``;
  the second-moment estimate is ``r[:, None] * c[None, :] / mean(r)`` (exact
  whenever ``g**2`` has rank one; :func:`poetx_jax.update_factored_moment`).
  Other leaves keep Adam's ``v``.

  Args:
    b1, b2, eps: Adam's decay rates and denominator offset.
    mu_dtype: dtype of the first moment (None: the parameters').
    min_dim_size_to_factor: factor only matrices whose last two dims are both
      at least this long.
  """
  check_hyperparameters(b1=b1, b2=b2, eps=eps, min_dim_size_to_factor=min_dim_size_to_factor)
  mu_dtype = check_mu_dtype(mu_dtype)
  fac = lambda p: is_factored(p.shape, min_dim_size_to_factor)

  def init_fn(params):
    return LeanAdamState(jnp.zeros([], jnp.int32),
                         optax.tree.zeros_like(params, dtype=mu_dtype),
                         *factored_moments_like(
                             params, min_dim_size_to_factor=min_dim_size_to_factor))

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    c1 = 1 - b1 ** count.astype(jnp.float32)
    c2 = 1 - b2 ** count.astype(jnp.float32)

    def leaf(g, m, row, col, full):
      g32 = g.astype(jnp.float32)
      m = b1 * m.astype(jnp.float32) + (1 - b1) * g32
      v_hat, row, col, full = update_factored_moment(
          jnp.square(g32), row, col, full, b2=b2, bias_correction=c2, factored=fac(g))
      u = (m / c1) / (jnp.sqrt(v_hat) + eps)
      return u.astype(g.dtype), m.astype(mu_dtype or g.dtype), row, col, full

    treedef = jax.tree.structure(updates)
    out = treedef.flatten_up_to(jax.tree.map(
        leaf, updates, state.mu, state.v_row, state.v_col, state.v_full))
    if not out:
      return updates, state._replace(count=count)
    u, mu, row, col, full = (treedef.unflatten(x) for x in zip(*out))
    return u, LeanAdamState(count, mu, row, col, full)

  return optax.GradientTransformation(init_fn, update_fn)


def lean_adamw(learning_rate, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
               weight_decay: float = 0.0, mu_dtype: tp.Any = jnp.bfloat16,
               min_dim_size_to_factor: int = 128) -> optax.GradientTransformation:
  """AdamW with :func:`scale_by_lean_adam`'s lean state (decoupled weight decay)."""
  check_hyperparameters(learning_rate=learning_rate, weight_decay=weight_decay)
  return optax.chain(
      scale_by_lean_adam(b1, b2, eps, mu_dtype=mu_dtype,
                         min_dim_size_to_factor=min_dim_size_to_factor),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate))
