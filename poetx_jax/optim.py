"""optax transformations for POET-X.

* :func:`scale_by_poetx` — Adam moments on the POET parameters, reset in step
  with each merge (on its own counter: no Python ``if`` under jit).
* :func:`poetx` — the POET-X optimizer: ``scale_by_poetx`` then the POET
  learning rate (``learning_rate * poet_scale``).
* :func:`clip_by_global_norm_after_merge` — the published POET-X clipping bound,
  which drops to ``min_ratio * max_norm`` right after each merge and ramps back.
* :func:`poetx_partition` — POET-X for the POET parameters, any other optax
  transformation (AdamW, say) for the rest, via ``optax.partition``.
* :func:`merge_due` — whether an update just completed a merge cycle.
"""

from __future__ import annotations

import numbers
import typing as tp

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from poetx_jax.linear import POETParam

Array = jax.Array
ScalarOrSchedule = float | Array | optax.Schedule


def _is_number(x) -> bool:
  return isinstance(x, numbers.Number) and not isinstance(x, bool)


def _check_merge_every(merge_every):
  if merge_every is None:
    return
  if _is_number(merge_every) and (merge_every < 1 or int(merge_every) != merge_every):
    raise ValueError(f'merge_every must be an int >= 1 (or None: never merge), '
                     f'got {merge_every!r}')


def _check_nonnegative(name, value):
  if _is_number(value) and value < 0:
    raise ValueError(f'{name} must be >= 0, got {value!r}')


class ScaleByPoetxState(tp.NamedTuple):
  """State of :func:`scale_by_poetx`.

  Attributes:
    count: updates applied so far (int32).
    cycle: updates since the last merge point, ``count % merge_every`` (int32);
      0 right after the update that completes a cycle.
    mu: first moments.
    nu: second moments.
  """
  count: Array
  cycle: Array
  mu: optax.Updates
  nu: optax.Updates


SECOND_MOMENTS = ('full', 'block')


def scale_by_poetx(*, merge_every: int | None = 200, b1: float = 0.9,
                   b2: float = 0.999, eps: float = 1e-8, mu_dtype: tp.Any = None,
                   second_moment: str = 'full') -> optax.GradientTransformation:
  """Adam scaling whose moments restart at every merge of the POET layers.

  After a merge the rotations restart at the identity, so moments of the old
  generators describe a different parameterisation. Updates number
  ``c * merge_every + 1`` (c >= 1) start from zero moments and a fresh bias
  correction, exactly as the first update does.

  Args:
    merge_every: updates per merge cycle; ``None`` never resets.
    b1, b2, eps: Adam's decay rates and denominator offset.
    mu_dtype: dtype of the first moment (default: the parameters').
    second_moment: ``'full'`` (Adam: one per parameter) or ``'block'``: one
      per row of each parameter array of two or more dimensions, the mean of
      the squared gradient over its last axis (Adam-mini's idea). A POET
      layer's generators are ``(K, B(B-1)/2)``, one row per B x B block, so
      this keeps one second moment per block: the state shrinks from two
      parameter-sized arrays to one (plus K numbers). A ragged last block's
      padding entries (always zero gradient) count in its mean.

  Returns:
    An ``optax.GradientTransformation`` with :class:`ScaleByPoetxState`.
  """
  _check_merge_every(merge_every)
  if second_moment not in SECOND_MOMENTS:
    raise ValueError(f'second_moment must be one of {SECOND_MOMENTS}, '
                     f'got {second_moment!r}')
  blockwise = second_moment == 'block'

  def nu_like(p):
    if blockwise and p.ndim >= 2:
      return jnp.zeros(p.shape[:-1] + (1,), p.dtype)
    return jnp.zeros_like(p)

  def square(g):
    g2 = jnp.square(g)
    if blockwise and g.ndim >= 2:
      return jnp.mean(g2, axis=-1, keepdims=True)
    return g2

  for name, v in (('b1', b1), ('b2', b2)):
    if _is_number(v) and not 0 <= v < 1:
      raise ValueError(f'{name} must be in [0, 1), got {v!r}')
  _check_nonnegative('eps', eps)

  def init_fn(params):
    mu = optax.tree.zeros_like(params, dtype=mu_dtype)
    nu = jax.tree.map(nu_like, params)
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
    nu_hat = optax.tree.bias_correction(nu, b2, t)
    new = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
    count = optax.safe_increment(state.count)
    if merge_every is None:
      cycle = optax.safe_increment(state.cycle)
    else:
      cycle = t % jnp.asarray(merge_every, jnp.int32)
    mu = optax.tree.cast(mu, mu_dtype)
    return new, ScaleByPoetxState(count=count, cycle=cycle, mu=mu, nu=nu)

  return optax.GradientTransformation(init_fn, update_fn)


def poetx(learning_rate: ScalarOrSchedule, *, merge_every: int | None = 200,
          poet_scale: float = 0.5, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, mu_dtype: tp.Any = None,
          second_moment: str = 'full') -> optax.GradientTransformation:
  r"""The POET-X optimizer for the skew generators of POET layers.

  Adam on the packed skew-symmetric parameters with step
  ``learning_rate * poet_scale`` and no weight decay; both moments and the bias
  correction restart after every ``merge_every`` updates, in step with
  :func:`poetx_jax.merge` (which :func:`poetx_jax.make_train_step` calls when
  :func:`merge_due` says so).

  Example::

    >>> import optax, poetx_jax
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0),
    ...                  poetx_jax.poetx(1e-3, merge_every=200))

  Args:
    learning_rate: base POET learning rate, a float or an optax schedule.
    merge_every: updates per merge cycle (the reference uses 200); ``None``
      never resets.
    poet_scale: multiplies the learning rate (0.5 in the reference).
    b1, b2, eps, mu_dtype, second_moment: see :func:`scale_by_poetx`.

  Returns:
    An ``optax.GradientTransformation``; works with ``optax.chain``,
    ``inject_hyperparams``, ``MultiSteps`` and ``optax.partition``.

  References:
    Qiu et al., POET-X, arXiv:2603.05500 (ICML 2026).
  """
  _check_nonnegative('learning_rate', learning_rate)
  _check_nonnegative('poet_scale', poet_scale)
  if callable(learning_rate):
    lr = lambda count: poet_scale * learning_rate(count)
  else:
    lr = poet_scale * learning_rate
  return optax.chain(
      scale_by_poetx(merge_every=merge_every, b1=b1, b2=b2, eps=eps,
                     mu_dtype=mu_dtype, second_moment=second_moment),
      optax.scale_by_learning_rate(lr))


class ClipAfterMergeState(tp.NamedTuple):
  """State of :func:`clip_by_global_norm_after_merge`: updates seen so far."""
  count: Array


def merge_clip_bound(count, max_norm, *, merge_every: int, ramp_steps: int = 10,
                     min_ratio: float = 0.1, until: int | None = None):
  """The clipping bound before update number ``count + 1`` (count updates done).

  ``max_norm * (min_ratio + (1 - min_ratio) * pos / ramp_steps)`` for
  ``pos = count % merge_every < ramp_steps`` once a merge has happened
  (``count >= merge_every``) and, if ``until`` is set, ``count <= until``;
  ``max_norm`` otherwise.
  """
  pos = count % merge_every
  ramping = (count >= merge_every) & (pos < ramp_steps)
  if until is not None:
    ramping = ramping & (count <= until)
  ratio = min_ratio + (1.0 - min_ratio) * pos / ramp_steps
  return jnp.where(ramping, ratio * max_norm, max_norm)


def clip_by_global_norm_after_merge(
    max_norm: float, *, merge_every: int = 200, ramp_steps: int = 10,
    min_ratio: float = 0.1, until: int | None = None) -> optax.GradientTransformation:
  """Clips the global gradient norm to a bound that dips after each merge.

  The published POET-X clips all gradients to ``min_ratio * max_norm`` on the
  first update after a merge and ramps the bound linearly back to ``max_norm``
  over ``ramp_steps`` updates (:func:`merge_clip_bound`). The reference applies
  the ramp only during its first 2000 steps (``until=2000``); the default here
  ramps after every merge.

  Args:
    max_norm: the bound outside the ramp (> 0).
    merge_every: updates per merge cycle, as given to :func:`poetx`.
    ramp_steps: length of the ramp in updates (>= 1).
    min_ratio: fraction of ``max_norm`` right after a merge, in (0, 1].
    until: last update count at which the ramp applies (None: always).
  """
  _check_merge_every(merge_every)
  if merge_every is None:
    raise ValueError('merge_every must be an int >= 1, got None')
  if _is_number(max_norm) and max_norm <= 0:
    raise ValueError(f'max_norm must be > 0, got {max_norm!r}')
  if not isinstance(ramp_steps, int) or ramp_steps < 1:
    raise ValueError(f'ramp_steps must be an int >= 1, got {ramp_steps!r}')
  if _is_number(min_ratio) and not 0 < min_ratio <= 1:
    raise ValueError(f'min_ratio must be in (0, 1], got {min_ratio!r}')

  def init_fn(params):
    del params
    return ClipAfterMergeState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None):
    del params
    bound = merge_clip_bound(state.count, max_norm, merge_every=merge_every,
                             ramp_steps=ramp_steps, min_ratio=min_ratio, until=until)
    norm = optax.tree.norm(updates)
    scale = jnp.minimum(1.0, bound / jnp.maximum(norm, 1e-30))
    updates = jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates)
    return updates, ClipAfterMergeState(count=optax.safe_increment(state.count))

  return optax.GradientTransformation(init_fn, update_fn)


def poetx_labels(model, wrt=nnx.Param):
  """'poetx' for each POETParam, 'other' for every other ``wrt`` variable,
  in the structure of ``nnx.state(model, wrt)``."""
  state = nnx.state(model, wrt)
  return jax.tree.map(lambda v: 'poetx' if isinstance(v, POETParam) else 'other',
                      state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def poetx_partition(model, poet_tx: optax.GradientTransformation,
                    other_tx: optax.GradientTransformation,
                    wrt=nnx.Param) -> optax.GradientTransformation:
  """``optax.partition``: ``poet_tx`` on POET parameters, ``other_tx`` on the rest.

  Example::

    tx = poetx_partition(model, poetx(1e-3), optax.adamw(1e-3))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  """
  return optax.partition({'poetx': poet_tx, 'other': other_tx},
                         poetx_labels(model, wrt))


def _poetx_states(state) -> list[ScaleByPoetxState]:
  leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ScaleByPoetxState))
  return [s for s in leaves if isinstance(s, ScaleByPoetxState)]


def merge_due(old_state, new_state) -> Array:
  """True iff the update from ``old_state`` to ``new_state`` completed a cycle.

  Looks for the :class:`ScaleByPoetxState` inside any optax state (chains,
  partitions, ``inject_hyperparams``, ``MultiSteps``: a MultiSteps mini-step
  leaves the count unchanged, so no merge is due). Raises if there is none.
  """
  olds, news = _poetx_states(old_state), _poetx_states(new_state)
  if not news:
    raise ValueError('the optimizer state holds no scale_by_poetx state; build '
                     'the optimizer with poetx_jax.poetx(...)')
  if len(news) > 1:
    raise ValueError(f'the optimizer state holds {len(news)} scale_by_poetx '
                     'states; expected exactly one')
  old, new = olds[0], news[0]
  return (new.count != old.count) & (new.cycle == 0)
