"""Orthogonalised updates for the POET generators: Muon on skew-symmetric blocks.

:func:`poetx_muon` replaces Adam on the packed generators (:func:`poetx_jax.poetx`)
by Muon's update. For each B x B block the momentum of its generator is
unpacked to the skew-symmetric matrix ``M`` (``M^T = -M``), scaled to unit
Frobenius norm and passed through Newton–Schulz's quintic iteration

.. math::

  X \\leftarrow a X + (b A + c A^2) X, \\qquad A = X X^T,

which approximates the orthogonal polar factor of ``M``. The iteration is an
odd polynomial in ``X`` (``X X^T = -X^2`` for skew ``X``), so a skew input
stays skew: the update needs no projection back onto the generators, and its
strict upper triangle is the packed update. Each block's update has singular
values near 1, so its spectral norm, and with it the growth of ``||Q||``
that the Cayley–Neumann series must stay ahead of, is bounded by the step
size times the scale, whatever the gradients do.

Like :func:`poetx_jax.scale_by_poetx`, the momentum restarts at every merge
point: its state is a :class:`poetx_jax.ScaleByPoetxState` (``nu`` is None),
so :func:`poetx_jax.make_train_step`, :func:`poetx_jax.merge_due` and
:func:`poetx_jax.clip_by_global_norm_after_merge` read its cycle as theirs.
"""

from __future__ import annotations

import math
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
import optax

from poetx_jax.hyperparams import check_hyperparameters, check_mu_dtype
from poetx_jax.optim import ScaleByPoetxState, _cycle_after
from poetx_jax.skew import pack_skew, unpack_skew

Array = jax.Array

# optax.contrib.muon's default quintic coefficients (Jordan et al.): the
# slope at 0 is maximised, so five steps bring singular values into ~[0.7, 1.2].
NS_COEFFS = (3.4445, -4.7750, 2.0315)
# Entries of an orthogonal B x B block have RMS 1 / sqrt(B); the update is
# scaled by DEFAULT_RMS * sqrt(B) so that its entries have RMS ~DEFAULT_RMS,
# the RMS of a typical Adam update (Moonlight's matching of Muon to AdamW).
DEFAULT_RMS = 0.2


def default_poet_muon_lr(block_size: int) -> float:
  """The step size of :func:`poetx_muon` for block size B:
  ``min(5e-3, 0.25 / min(B, 256))``, POET-X's step (``default_poet_lr``) up to
  B = 256 and 0.25 / 256 (2^-10) above.

  Its update's entries have a fixed RMS, so a block's update has spectral
  norm about ``step * 0.2 * sqrt(B)`` (not Adam's up to ``B`` times the step),
  and the step that keeps the generators in the Cayley–Neumann series' region
  over a merge cycle shrinks more slowly with B than POET-X's. Measured at
  100 M tokens with merges every 200 updates (docs/results/paper-baseline):
  2^-10 at B = 256 (5M parameters) ended below POET-X and ahead of 2^-9 when
  that run stopped, and at B = 512 (19M, 130M) below POET-X by more than the
  seed spread, where POET-X's 0.25 / 512 has not run for it; below B = 256
  the step is POET-X's, not tuned for this update.
  """
  check_hyperparameters(block_size=block_size)
  return min(5e-3, 0.25 / min(block_size, 256))


def block_size_of(packed: int) -> int:
  """B with B(B-1)/2 = ``packed``; raises ValueError when there is none."""
  b = (1 + math.isqrt(1 + 8 * packed)) // 2
  if packed < 1 or b * (b - 1) // 2 != packed:
    raise ValueError(f'a generator array\'s last axis holds B(B-1)/2 packed entries of a '
                     f'B x B skew block; {packed} is not B(B-1)/2 for any B >= 2')
  return b


def orthogonalize_skew(m: Array, *, steps: int = 5, eps: float = 1e-7,
                       dtype: tp.Any = jnp.bfloat16) -> Array:
  """Newton–Schulz's approximate polar factor of each skew block of ``m``.

  Args:
    m: skew-symmetric blocks, shape (..., B, B).
    steps: Newton–Schulz iterations.
    eps: added to each block's Frobenius norm before dividing by it (an
      all-zero block stays zero).
    dtype: the iteration's dtype (bf16, as Muon runs it).

  Returns:
    Blocks of ``m``'s shape and dtype, each skew up to the rounding of
    ``dtype``, with singular values near 1 where ``m``'s are not 0.
  """
  a, b, c = NS_COEFFS
  norm = jnp.sqrt(jnp.sum(jnp.square(m.astype(jnp.float32)), axis=(-2, -1), keepdims=True))
  x = (m / (norm + eps)).astype(dtype)
  for _ in range(steps):
    gram = x @ jnp.swapaxes(x, -1, -2)
    x = a * x + (b * gram + c * (gram @ gram)) @ x
  return x.astype(m.dtype)


# Blocks per batched Newton–Schulz iteration: up to this many elements of
# B x B blocks (128 MiB in float32), so that a batch fills the device while
# the update's temporaries stay a small part of a large model's memory.
BATCH_ELEMENTS = 1 << 25


def batches(shapes: list[tuple[int, ...]]) -> list[tuple[int, list[int]]]:
  """The leaves (by index) whose blocks run through one Newton–Schulz
  iteration together, with their packed size: leaves of one block size in
  order, a batch closed before it would pass :data:`BATCH_ELEMENTS` (a leaf
  larger than that is a batch of its own). A leaf holds a layer's few
  blocks; an iteration per leaf would run hundreds of small matmuls, each on
  a fraction of the device."""
  out: list[tuple[int, list[int]]] = []
  open_: dict[int, tuple[list[int], int]] = {}
  for i, shape in enumerate(shapes):
    packed = shape[-1]
    b = block_size_of(packed)
    n = math.prod(shape[:-1]) * b * b
    members, total = open_.get(packed, ([], 0))
    if members and total + n > BATCH_ELEMENTS:
      out.append((packed, members))
      members, total = [], 0
    open_[packed] = (members + [i], total + n)
  return out + [(packed, members) for packed, (members, _) in open_.items()]


def scale_by_poetx_muon(*, merge_every: int | None = 200, beta: float = 0.95,
                        nesterov: bool = True, ns_steps: int = 5, rms: float = DEFAULT_RMS,
                        mu_dtype: tp.Any = None,
                        ns_dtype: tp.Any = jnp.bfloat16) -> optax.GradientTransformation:
  r"""Muon's direction for packed POET generators, restarted at merge points.

  With ``c`` the updates since the last merge point and ``g`` the gradient
  (each leaf ``(..., K, B(B-1)/2)``: K blocks' strict upper triangles):

  .. math::

    m_c = \beta m_{c-1} + (1 - \beta) g, \qquad
    u = \mathrm{pack}\bigl(\rho \sqrt{B}\;
        \mathrm{NS}(\mathrm{unpack}(\beta m_c + (1 - \beta) g))\bigr)

  (without ``nesterov``, ``m_c`` in place of the Nesterov combination), with
  ``m_0 = 0`` at the start of every cycle, NS the Newton–Schulz iteration of
  :func:`orthogonalize_skew` on each block, and ``rho = rms``: the entries of
  an orthogonal B x B block have RMS ``1/sqrt(B)``, so ``u``'s have RMS about
  ``rms``. NS is invariant to its input's scale, so no bias correction is
  needed. A ragged last block's padding entries have zero gradient, and the
  iteration keeps zero rows and columns zero, so they stay zero. The blocks
  of the leaves of one block size run through batched iterations of up to
  :data:`BATCH_ELEMENTS` elements (each block's result is its own).

  Args:
    merge_every: updates per merge cycle; ``None`` never restarts.
    beta: the momentum's decay rate.
    nesterov: use the Nesterov combination (optax.contrib.muon's default).
    ns_steps: Newton–Schulz iterations.
    rms: the RMS of the update's entries for an orthogonal block, > 0.
    mu_dtype: dtype of the momentum (default: the parameters').
    ns_dtype: dtype of the Newton–Schulz iteration (bf16, as Muon runs it).

  Returns:
    An ``optax.GradientTransformation`` whose state is a
    :class:`poetx_jax.ScaleByPoetxState` with ``nu=None``.

  References:
    Jordan et al., Muon: An optimizer for hidden layers in neural networks (2024).
    Liu et al., Muon is Scalable for LLM Training, arXiv:2502.16982 (2025).
  """
  check_hyperparameters(merge_every=merge_every, beta=beta, rms=rms)
  if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
    raise ValueError(f'ns_steps must be an int >= 1, got {ns_steps!r}')
  mu_dtype = check_mu_dtype(mu_dtype)

  def init_fn(params):
    for p in jax.tree.leaves(params):
      if p.ndim < 2:
        raise ValueError(f'poetx_muon takes packed generators of shape (..., K, B(B-1)/2); '
                         f'got an array of shape {p.shape}')
      block_size_of(p.shape[-1])
    return ScaleByPoetxState(count=jnp.zeros([], jnp.int32), cycle=jnp.zeros([], jnp.int32),
                             mu=optax.tree.zeros_like(params, dtype=mu_dtype), nu=None)

  def direction(m: Array) -> Array:
    b = block_size_of(m.shape[-1])
    o = orthogonalize_skew(unpack_skew(m.astype(jnp.float32), b), steps=ns_steps,
                           dtype=ns_dtype)
    return pack_skew(o) * (rms * math.sqrt(b))

  def directions(look, updates):
    leaves, treedef = jax.tree.flatten(look)
    out = [None] * len(leaves)
    for packed, members in batches([m.shape for m in leaves]):
      sizes = [leaves[i].size // packed for i in members]
      d = direction(jnp.concatenate([leaves[i].reshape(-1, packed) for i in members]))
      for i, part in zip(members, jnp.split(d, np.cumsum(sizes)[:-1])):
        out[i] = part.reshape(leaves[i].shape)
    return jax.tree.map(lambda d, g: d.astype(g.dtype), treedef.unflatten(out), updates)

  def update_fn(updates, state, params=None):
    del params
    fresh = state.cycle == 0  # first update of a cycle: forget the old momentum
    mu = jax.tree.map(lambda m: jnp.where(fresh, jnp.zeros_like(m), m), state.mu)
    mu = optax.tree.update_moment(updates, mu, beta, 1)
    if nesterov:
      look = optax.tree.update_moment(updates, mu, beta, 1)
    else:
      look = mu
    new = directions(look, updates)
    return new, ScaleByPoetxState(count=optax.safe_increment(state.count),
                                  cycle=_cycle_after(state.cycle, merge_every),
                                  mu=optax.tree.cast(mu, mu_dtype), nu=None)

  return optax.GradientTransformation(init_fn, update_fn)


def poetx_muon(learning_rate, *, merge_every: int | None = 200, beta: float = 0.95,
               nesterov: bool = True, ns_steps: int = 5, rms: float = DEFAULT_RMS,
               mu_dtype: tp.Any = None,
               ns_dtype: tp.Any = jnp.bfloat16) -> optax.GradientTransformation:
  r"""POET-X with Muon's orthogonalised updates on the skew generators.

  ``q <- q - eta_t u_t``, ``u`` from :func:`scale_by_poetx_muon`. A block's
  update has spectral norm about ``eta * rms * sqrt(B)``, so a cycle of M
  updates keeps ``||Q|| <= M * eta * rms * sqrt(B)``. Use it where
  :func:`poetx_jax.poetx` goes (``poetx_partition`` for the rest of the
  model; merge every ``merge_every`` updates).

  Example::

    >>> import optax, poetx_jax
    >>> tx = poetx_jax.poetx_muon(5e-4, merge_every=200)

  Args:
    learning_rate: the step size, a float or an optax schedule.
    merge_every, beta, nesterov, ns_steps, rms, mu_dtype, ns_dtype: see
      :func:`scale_by_poetx_muon`.

  Returns:
    An ``optax.GradientTransformation``.
  """
  check_hyperparameters(learning_rate=learning_rate)
  return optax.chain(
      scale_by_poetx_muon(merge_every=merge_every, beta=beta, nesterov=nesterov,
                          ns_steps=ns_steps, rms=rms, mu_dtype=mu_dtype, ns_dtype=ns_dtype),
      optax.scale_by_learning_rate(learning_rate))
