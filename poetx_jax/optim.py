"""optax transformations for POET-X.

* :func:`scale_by_poetx` — Adam moments on the POET generators, restarted at
  every merge point of the cycle (a counter in its state; no Python ``if``
  under jit).
* :func:`poetx` — the POET-X optimizer: ``scale_by_poetx`` then the learning
  rate, which is the step size (no hidden factor).
* :func:`default_poet_lr` — the step size to use for a block size.
* :func:`clip_by_global_norm_after_merge` — wraps an optimizer that contains
  ``poetx`` and clips gradients to a bound that dips after each merge, read off
  that optimizer's cycle.
* :func:`poetx_partition` — POET-X for the POET generators, any other optax
  transformation (AdamW, say) for the rest, via ``optax.partition``.

The merge itself, and when it happens, is described in :mod:`poetx_jax.cycle`.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from poetx_jax.hyperparams import check_hyperparameters, check_mu_dtype
from poetx_jax.linear import POETParam

Array = jax.Array
ScalarOrSchedule = float | Array | optax.Schedule


def default_poet_lr(block_size: int) -> float:
  """The POET-X step size for block size B: ``min(5e-3, 0.25 / B)``.

  Adam moves every generator entry by about the step size per update, and
  moves them coherently, so the spectral norm of a block's ``Q`` can grow
  like ``B`` times that within a merge cycle; the Cayley–Neumann series
  converges (and the factors are orthogonal) only while it stays below 1.
  A step that suits small blocks therefore diverges for large ones:
  5e-3 trains well at B = 16 and leaves the series' region of convergence at
  B = 256, where 1e-3 trains well (BENCHMARKS.md).
  """
  check_hyperparameters(block_size=block_size)
  return min(5e-3, 0.25 / block_size)


class ScaleByPoetxState(tp.NamedTuple):
  """State of :func:`scale_by_poetx`.

  Attributes:
    count: updates applied so far (int32).
    cycle: updates since the last merge point, ``count % merge_every``
      (int32); 0 right after the update that completes a cycle.
    mu: first moments.
    nu: second moments (one per generator, or one per block).
  """
  count: Array
  cycle: Array
  mu: optax.Updates
  nu: optax.Updates


SECOND_MOMENTS = ('full', 'block')
EPS_PLACEMENTS = ('corrected', 'raw')


def scale_by_poetx(*, merge_every: int | None = 200, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8, mu_dtype: tp.Any = None,
                   second_moment: str = 'full',
                   eps_placement: str = 'corrected') -> optax.GradientTransformation:
  r"""Adam scaling whose moments restart at every merge point.

  With ``c`` the updates since the last merge point (``cycle``, counted from
  1 on the update after it) and ``g`` the gradient:

  .. math::

    m_c = \beta_1 m_{c-1} + (1 - \beta_1) g, \qquad
    v_c = \beta_2 v_{c-1} + (1 - \beta_2) s(g), \qquad
    u = \frac{m_c / (1 - \beta_1^c)}{\sqrt{v_c / (1 - \beta_2^c)} + \epsilon},

  with ``m_0 = v_0 = 0`` at the start of every cycle: after a merge the
  rotations restart at the identity, so moments of the old generators
  describe another parameterisation (the POET-X reset). ``s(g) = g^2``
  (``second_moment='full'``), or, for arrays of two or more dimensions,
  the mean of ``g^2`` over the last axis (``'block'``, Adam-mini's one
  second moment per block: a POET layer's generators are
  ``(K, B(B-1)/2)``, a row per B x B block).

  ``eps_placement='raw'`` adds ``eps`` before the bias correction, as the
  published POET-X's AdamW (and PyTorch-style ``correct_bias`` AdamWs) do:
  ``u = sqrt(1 - b2^c) / (1 - b1^c) * m_c / (sqrt(v_c) + eps)``, which is the
  formula above with ``eps / sqrt(1 - b2^c)`` in place of ``eps``: a larger
  offset in the first updates of every cycle.

  Args:
    merge_every: updates per merge cycle; ``None`` never restarts.
    b1, b2, eps: Adam's decay rates and denominator offset.
    mu_dtype: dtype of the first moment (default: the parameters').
    second_moment: ``'full'`` or ``'block'`` (above). With ``'block'`` the
      state is one parameter-sized array (the first moment) plus K numbers
      per layer side; a ragged last block's padding entries (always zero
      gradient) count in its mean.
    eps_placement: ``'corrected'`` (``eps`` added to the bias-corrected
      ``sqrt(v)``, optax's Adam) or ``'raw'`` (before the correction, the
      published POET-X's).

  Returns:
    An ``optax.GradientTransformation`` with :class:`ScaleByPoetxState`.

  References:
    Kingma & Ba, Adam: A Method for Stochastic Optimization, ICLR 2015.
    Zhang et al., Adam-mini: Use Fewer Learning Rates To Gain More,
    arXiv:2406.16793 (2024).
    Qiu et al., POET-X, arXiv:2603.05500 (ICML 2026): the reset at merges.
  """
  check_hyperparameters(merge_every=merge_every, b1=b1, b2=b2, eps=eps)
  if second_moment not in SECOND_MOMENTS:
    raise ValueError(f'second_moment must be one of {SECOND_MOMENTS}, '
                     f'got {second_moment!r}')
  if eps_placement not in EPS_PLACEMENTS:
    raise ValueError(f'eps_placement must be one of {EPS_PLACEMENTS}, '
                     f'got {eps_placement!r}')
  mu_dtype = check_mu_dtype(mu_dtype)
  blockwise = second_moment == 'block'
  square = lambda g: _squared(g, blockwise)

  def init_fn(params):
    mu = optax.tree.zeros_like(params, dtype=mu_dtype)
    nu = jax.tree.map(lambda p: _zero_second_moment(p, blockwise), params)
    return ScaleByPoetxState(count=jnp.zeros([], jnp.int32),
                             cycle=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

  def update_fn(updates, state, params=None):
    del params
    fresh = state.cycle == 0  # first update of a cycle: forget old moments
    keep = lambda t: jax.tree.map(lambda m: jnp.where(fresh, jnp.zeros_like(m), m), t)
    mu = optax.tree.update_moment(updates, keep(state.mu), b1, 1)
    nu = jax.tree.map(lambda g, v: None if g is None else (1 - b2) * square(g) + b2 * v,
                      updates, keep(state.nu), is_leaf=lambda x: x is None)
    t = state.cycle + 1
    mu_hat = optax.tree.bias_correction(mu, b1, t)
    if eps_placement == 'raw':  # sqrt(1 - b2^t) * m_hat / (sqrt(v) + eps)
      root = lambda m: jnp.sqrt(1 - jnp.asarray(b2, m.dtype) ** t.astype(m.dtype))
      new = jax.tree.map(lambda m, v: root(m) * m / (jnp.sqrt(v) + eps), mu_hat, nu)
    else:
      nu_hat = optax.tree.bias_correction(nu, b2, t)
      new = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
    count = optax.safe_increment(state.count)
    mu = optax.tree.cast(mu, mu_dtype)
    return new, ScaleByPoetxState(count=count, cycle=_cycle_after(state.cycle, merge_every),
                                  mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def _zero_second_moment(p: Array, blockwise: bool) -> Array:
  """Zero ``v`` for generators ``p``: one per row of its last axis for
  ``blockwise`` and two or more dims, else one per entry."""
  if blockwise and p.ndim >= 2:
    return jnp.zeros(p.shape[:-1] + (1,), p.dtype)
  return jnp.zeros_like(p)


def _squared(g: Array, blockwise: bool) -> Array:
  """``s(g)`` of :func:`scale_by_poetx`: ``g**2``, or its mean over the last
  axis for ``blockwise`` and two or more dims."""
  g2 = jnp.square(g)
  if blockwise and g.ndim >= 2:
    return jnp.mean(g2, axis=-1, keepdims=True)
  return g2


def _cycle_after(cycle: Array, merge_every) -> Array:
  """The cycle position after an update from position ``cycle``: back to 0
  every ``merge_every`` updates (never with None)."""
  if merge_every is None:
    return optax.safe_increment(cycle)
  return (cycle + 1) % jnp.asarray(merge_every, jnp.int32)


def poetx(learning_rate: ScalarOrSchedule, *, merge_every: int | None = 200,
          b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          mu_dtype: tp.Any = None, second_moment: str = 'full',
          eps_placement: str = 'corrected') -> optax.GradientTransformation:
  r"""The POET-X optimizer for the skew generators of POET layers.

  Adam on the packed skew-symmetric generators, restarted at every merge
  point, with no weight decay (:func:`scale_by_poetx` gives ``u``):

  .. math::

    q \leftarrow q - \eta_t \, u_t

  where ``eta_t = learning_rate`` (or ``learning_rate(t)``) is the step
  size as given. (The published code multiplies its POET learning rate by a
  ``poet_scale`` of 0.5; its default 5e-4 is a step of 2.5e-4 here.)
  :func:`default_poet_lr` gives a step size that suits the block size. Merge
  the layers with :func:`poetx_jax.merge` every ``merge_every`` updates, in
  step with the restarts (:func:`poetx_jax.make_train_step` does).

  Example::

    >>> import optax, poetx_jax
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0),
    ...                  poetx_jax.poetx(1e-3, merge_every=200))

  Args:
    learning_rate: the step size, a float or an optax schedule.
    merge_every: updates per merge cycle (the reference uses 200); ``None``
      never restarts.
    b1, b2, eps, mu_dtype, second_moment, eps_placement: see
      :func:`scale_by_poetx` (the published POET-X: ``eps=1e-6,
      eps_placement='raw'``).

  Returns:
    An ``optax.GradientTransformation``; works with ``optax.chain``,
    ``inject_hyperparams``, ``MultiSteps`` and ``optax.partition``.

  References:
    Qiu et al., Reparameterized LLM Training via Orthogonal Equivalence
    Transformation (POET), NeurIPS 2025; POET-X, arXiv:2603.05500 (ICML 2026).
  """
  check_hyperparameters(learning_rate=learning_rate)
  return optax.chain(
      scale_by_poetx(merge_every=merge_every, b1=b1, b2=b2, eps=eps,
                     mu_dtype=mu_dtype, second_moment=second_moment,
                     eps_placement=eps_placement),
      optax.scale_by_learning_rate(learning_rate))


def poetx_states(state) -> list[ScaleByPoetxState]:
  """Every :class:`ScaleByPoetxState` inside an optax state (chains,
  partitions, ``inject_hyperparams``, ``MultiSteps``, wrappers)."""
  leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ScaleByPoetxState))
  return [s for s in leaves if isinstance(s, ScaleByPoetxState)]


def the_poetx_state(state) -> ScaleByPoetxState:
  """The one :class:`ScaleByPoetxState` inside an optax state; raises if
  there is none or more than one."""
  found = poetx_states(state)
  if not found:
    raise ValueError('the optimizer state holds no scale_by_poetx state; build '
                     'the optimizer with poetx_jax.poetx(...)')
  if len(found) > 1:
    raise ValueError(f'the optimizer state holds {len(found)} scale_by_poetx '
                     'states; expected exactly one')
  return found[0]


def merge_clip_bound(count, cycle, max_norm, *, ramp_steps: int = 10,
                     min_ratio: float = 0.1, until: int | None = None):
  """The clipping bound before the next update, from the POET-X cycle.

  ``count`` updates are done, ``cycle`` of them since the last merge point.
  Once a merge has happened (``count > cycle``) and, if ``until`` is set,
  ``count <= until``, the bound is ``max_norm * (min_ratio + (1 - min_ratio)
  * cycle / ramp_steps)`` while ``cycle < ramp_steps``; ``max_norm`` otherwise.
  """
  ramping = (count > cycle) & (cycle < ramp_steps)
  if until is not None:
    ramping = ramping & (count <= until)
  ratio = min_ratio + (1.0 - min_ratio) * cycle / ramp_steps
  return jnp.where(ramping, ratio * max_norm, max_norm)


def clip_by_global_norm_after_merge(
    tx: optax.GradientTransformation, max_norm: float, *, ramp_steps: int = 10,
    min_ratio: float = 0.1,
    until: int | None = None) -> optax.GradientTransformationExtraArgs:
  r"""``tx`` with its gradients clipped to a global-norm bound that dips after merges.

  The published POET-X clips all gradients to ``min_ratio * max_norm`` on the
  first update after a merge and ramps the bound linearly back to
  ``max_norm`` over ``ramp_steps`` updates (:func:`merge_clip_bound`):

  .. math::

    g \leftarrow g \cdot \min\left(1, \frac{b(n, c)}{\lVert g \rVert_2}\right)

  with ``n`` and ``c`` the update count and cycle position of the
  ``poetx`` inside ``tx`` (no counter of its own), in the arithmetic of
  ``optax.clip_by_global_norm``: outside the ramp its updates, bit for bit.
  The reference applies the ramp only during its first 2000 updates
  (``until=2000``); the default ramps after every merge. Under
  ``optax.MultiSteps`` wrap this inside it, so the accumulated gradient is
  clipped.

  Example::

    >>> import optax, poetx_jax
    >>> tx = poetx_jax.clip_by_global_norm_after_merge(
    ...     poetx_jax.poetx(1e-3, merge_every=200), max_norm=1.0)

  Args:
    tx: an optimizer holding exactly one :func:`scale_by_poetx`.
    max_norm: the bound outside the ramp (> 0).
    ramp_steps: length of the ramp in updates (>= 1).
    min_ratio: fraction of ``max_norm`` right after a merge, in (0, 1].
    until: last update count at which the ramp applies (None: always).

  Returns:
    A transformation with ``tx``'s state.
  """
  check_hyperparameters(max_norm=max_norm, ramp_steps=ramp_steps, min_ratio=min_ratio)
  tx = optax.with_extra_args_support(tx)

  def init_fn(params):
    state = tx.init(params)
    the_poetx_state(state)  # raises without one
    return state

  def update_fn(updates, state, params=None, **extra_args):
    cycle = the_poetx_state(state)
    bound = merge_clip_bound(cycle.count, cycle.cycle, max_norm, ramp_steps=ramp_steps,
                             min_ratio=min_ratio, until=until)
    norm = optax.tree.norm(updates)
    # optax.clip_by_global_norm's arithmetic: with the bound at max_norm its
    # updates, bit for bit.
    updates = jax.tree.map(lambda g: jax.lax.select(
        norm < bound, g, (g / norm.astype(g.dtype)) * bound.astype(g.dtype)), updates)
    return tx.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def poetx_labels(model, wrt=nnx.Param):
  """``'poetx'`` for each ``POETParam``, ``'other'`` for every other ``wrt``
  variable, in the structure of ``nnx.state(model, wrt)``."""
  state = nnx.state(model, wrt)
  return jax.tree.map(lambda v: 'poetx' if isinstance(v, POETParam) else 'other',
                      state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def poetx_partition(labels, poet_tx: optax.GradientTransformation,
                    other_tx: optax.GradientTransformation,
                    wrt=nnx.Param) -> optax.GradientTransformation:
  """``optax.partition``: ``poet_tx`` on POET generators, ``other_tx`` on the rest.

  Example::

    >>> import optax, poetx_jax
    >>> from flax import nnx
    >>> model = poetx_jax.poetize(nnx.Linear(32, 32, rngs=nnx.Rngs(0)),
    ...                           block_size=8, rngs=nnx.Rngs(1))
    >>> tx = poetx_jax.poetx_partition(model, poetx_jax.poetx(1e-3),
    ...                                optax.adamw(1e-3))
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  Args:
    labels: a model (its labels are :func:`poetx_labels` of it), or what
      ``optax.partition`` takes: a pytree of ``'poetx'`` / ``'other'``
      labels, or a function of the parameters that returns one.
    poet_tx: the POET-X optimizer (:func:`poetx`).
    other_tx: the optimizer of every other parameter.
    wrt: with a model, the variables the optimizer updates.

  Its ``init`` raises ValueError, naming the first parameters that differ,
  when the labels are a pytree of other parameters than those it is given
  (another model's).
  """
  if isinstance(labels, nnx.Module):
    labels = poetx_labels(labels, wrt)
  tx = optax.partition({'poetx': poet_tx, 'other': other_tx}, labels)
  if callable(labels):
    return tx

  def init(params):
    paths = lambda tree: [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]]
    got, want = paths(params), paths(labels)
    if got != want:
      extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
      raise ValueError(
          'poetx_partition: the labels are of other parameters than those given (another '
          f'model\'s?): {len(extra)} parameter(s) without a label (first: '
          f'{", ".join(extra[:3]) or "none"}), {len(missing)} label(s) without a parameter '
          f'(first: {", ".join(missing[:3]) or "none"}): label the model the optimizer '
          'updates (poetx_partition(model, ...))')
    return tx.init(params)

  return optax.GradientTransformation(init, tx.update)
