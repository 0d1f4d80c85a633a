r"""Factored second moments: the building blocks shared by the lean optimizers.

Dimensions: R, C the last two axes of a leaf (the rows and columns of each
trailing matrix). A leaf is *factored* when it has two or more axes and
``R, C >= min_dim_size_to_factor`` (:func:`is_factored`). Its second moment
is then stored as the moving averages of the row and column means of the
squared gradient ``g^2``, ``R + C`` numbers per trailing matrix instead of
``R C`` (Adafactor's factoring):

.. math::

  r_t = \beta_2 r_{t-1} + (1 - \beta_2)\,\mathrm{mean}_C(g^2), \qquad
  c_t = \beta_2 c_{t-1} + (1 - \beta_2)\,\mathrm{mean}_R(g^2), \qquad
  v_t \approx \frac{r_t c_t^\top}{\mathrm{mean}_R(r_t)},

which is exact whenever ``g^2`` has rank one. Any other leaf keeps Adam's
exact ``v_t = \beta_2 v_{t-1} + (1 - \beta_2) g^2``. Every moment is float32.

A state holds three trees in the parameters' structure, ``(v_row, v_col,
v_full)`` (:func:`factored_moments_like`): ``v_row`` (..., R) and ``v_col``
(..., C) for factored leaves, ``v_full`` for the others, and a one-element
placeholder wherever a tree has no moment for a leaf.
:func:`update_factored_moment` advances one leaf's three entries and returns
its bias-corrected estimate ``v_hat``. :func:`poetx_jax.scale_by_lean_adam`
(with a first moment) and :func:`scale_by_factored_rms` (without) are built
from them.

References:
  Shazeer & Stern, Adafactor: Adaptive Learning Rates with Sublinear Memory
  Cost, ICML 2018.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
import optax

from poetx_jax.hyperparams import check_hyperparameters

Array = jax.Array


def is_factored(shape: tp.Sequence[int], min_dim_size_to_factor: int) -> bool:
  """Whether a leaf of ``shape`` gets factored second moments: it has two or
  more axes and both of its last two are at least ``min_dim_size_to_factor``."""
  return len(shape) >= 2 and min(shape[-2:]) >= min_dim_size_to_factor


def _placeholder():
  """Placeholder for an unused moment: one element (orbax saves no empty
  arrays), a buffer of its own each time (jit may donate every state leaf)."""
  return jnp.zeros((1,), jnp.float32)


def factored_moments_like(params, *, min_dim_size_to_factor: int
                          ) -> tuple[optax.Updates, optax.Updates, optax.Updates]:
  """Zero second moments for ``params``: ``(v_row, v_col, v_full)``.

  Args:
    params: a pytree of arrays (or anything with ``shape``).
    min_dim_size_to_factor: see :func:`is_factored`.

  Returns:
    Three float32 trees in the structure of ``params``: for a factored leaf
    (..., R, C), ``v_row`` (..., R) and ``v_col`` (..., C); for any other
    leaf, ``v_full`` of its shape; a (1,) placeholder in the remaining slots.
  """
  fac = lambda p: is_factored(p.shape, min_dim_size_to_factor)
  f32 = lambda shape: jnp.zeros(shape, jnp.float32)
  return (jax.tree.map(lambda p: f32(p.shape[:-1]) if fac(p) else _placeholder(), params),
          jax.tree.map(lambda p: f32(p.shape[:-2] + p.shape[-1:]) if fac(p) else _placeholder(),
                       params),
          jax.tree.map(lambda p: _placeholder() if fac(p) else f32(p.shape), params))


def update_factored_moment(g2: Array, v_row: Array, v_col: Array, v_full: Array, *,
                           b2, bias_correction, factored: bool
                           ) -> tuple[Array, Array, Array, Array]:
  r"""One update of a leaf's second moments from its squared gradient ``g2``.

  Factored (``v_row`` (..., R), ``v_col`` (..., C)), with ``d`` the
  bias correction ``1 - b2^t``:

  .. math::

    r \leftarrow b_2 r + (1 - b_2)\,\mathrm{mean}_C(g^2), \quad
    c \leftarrow b_2 c + (1 - b_2)\,\mathrm{mean}_R(g^2), \quad
    \hat v = \frac{r c^\top}{\max(\mathrm{mean}_R(r), 10^{-30})\, d}.

  Otherwise ``v <- b2 v + (1 - b2) g^2`` and ``v_hat = v / d``. The moments
  not used by the leaf pass through unchanged.

  Args:
    g2: the squared gradient of the leaf, float32.
    v_row, v_col, v_full: the leaf's entries of :func:`factored_moments_like`.
    b2: the decay rate (traceable).
    bias_correction: ``1 - b2^t`` for update ``t`` (traceable).
    factored: :func:`is_factored` of the leaf (static).

  Returns:
    ``(v_hat, v_row, v_col, v_full)``: the bias-corrected estimate of
    ``g2``'s shape and the new moments.
  """
  if factored:
    row = b2 * v_row + (1 - b2) * jnp.mean(g2, axis=-1)
    col = b2 * v_col + (1 - b2) * jnp.mean(g2, axis=-2)
    norm = jnp.maximum(jnp.mean(row, axis=-1, keepdims=True)[..., None], 1e-30)
    return row[..., :, None] * col[..., None, :] / norm / bias_correction, row, col, v_full
  full = b2 * v_full + (1 - b2) * g2
  return full / bias_correction, v_row, v_col, full


class FactoredRMSState(tp.NamedTuple):
  """State of :func:`scale_by_factored_rms`: the update count and the
  second moments of :func:`factored_moments_like`."""
  count: Array
  v_row: optax.Updates
  v_col: optax.Updates
  v_full: optax.Updates


def scale_by_factored_rms(b2: float = 0.999, eps: float = 1e-8, *,
                          min_dim_size_to_factor: int = 128) -> optax.GradientTransformation:
  r"""RMS scaling by factored second moments, with no first moment.

  With ``t`` the update count and ``v_hat`` the bias-corrected second moment
  of :func:`update_factored_moment` (factored per trailing R x C matrix of a
  leaf whose last two sides are both at least ``min_dim_size_to_factor``,
  exact float32 otherwise):

  .. math::

    u = \frac{g}{\sqrt{\hat v} + \epsilon}

  An (L, E, I, O) leaf holds L E (I + O) numbers.

  Example::

    >>> import jax.numpy as jnp, poetx_jax
    >>> tx = poetx_jax.scale_by_factored_rms(min_dim_size_to_factor=2)
    >>> state = tx.init({'w': jnp.ones((4, 3))})
    >>> state.v_row['w'].shape, state.v_col['w'].shape
    ((4,), (3,))

  Args:
    b2, eps: the second moment's decay rate and the denominator offset
      (traceable).
    min_dim_size_to_factor: see :func:`is_factored` (structural).

  Returns:
    A transformation with :class:`FactoredRMSState`.

  References:
    Shazeer & Stern, Adafactor, ICML 2018.
  """
  check_hyperparameters(b2=b2, eps=eps, min_dim_size_to_factor=min_dim_size_to_factor)
  fac = lambda p: is_factored(p.shape, min_dim_size_to_factor)

  def init_fn(params):
    return FactoredRMSState(jnp.zeros([], jnp.int32), *factored_moments_like(
        params, min_dim_size_to_factor=min_dim_size_to_factor))

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    c2 = 1 - b2 ** count.astype(jnp.float32)

    def leaf(g, row, col, full):
      g32 = g.astype(jnp.float32)
      v_hat, row, col, full = update_factored_moment(
          jnp.square(g32), row, col, full, b2=b2, bias_correction=c2, factored=fac(g))
      return (g32 / (jnp.sqrt(v_hat) + eps)).astype(g.dtype), row, col, full

    treedef = jax.tree.structure(updates)
    out = treedef.flatten_up_to(jax.tree.map(
        leaf, updates, state.v_row, state.v_col, state.v_full))
    if not out:
      return updates, state._replace(count=count)
    u, row, col, full = (treedef.unflatten(x) for x in zip(*out))
    return u, FactoredRMSState(count, row, col, full)

  return optax.GradientTransformation(init_fn, update_fn)
