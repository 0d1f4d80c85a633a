"""One contract for every optax transformation of poetx_jax.

Each optimizer below runs through the same checks (after optax's
``optax/contrib/_common_test.py``): jit of init and update, a state whose
structure, shapes and dtypes do not change across updates under jit, float32
and bfloat16 parameters that keep their dtype, ``optax.inject_hyperparams``
(every numeric hyperparameter traced; a learning-rate schedule), gradient
accumulation with ``optax.MultiSteps``, composition with ``optax.chain`` and
``optax.partition``, descent on a quadratic and finite updates. Maths against
hand-written references lives in test_optim.py, test_lean.py, test_factored.py
and test_skewadam.py.
"""

import dataclasses
import typing as tp

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import assert_trees_rel_close
import poetx_jax

LR = 3e-2


def clipped_poetx(learning_rate, *, merge_every=3, max_norm=1.0):
  """poetx inside clip_by_global_norm_after_merge (a ramp of 2 updates)."""
  return poetx_jax.clip_by_global_norm_after_merge(
      poetx_jax.poetx(learning_rate, merge_every=merge_every), max_norm, ramp_steps=2)


# A SkewAdam tier for each leaf of the parameters of _params (or a subtree).
SKEW_TIERS = {'w': 'experts', 'b': 'router', 's': 'backbone'}
POETX_SKEW_TIERS = {'w': 'poetx', 'b': 'router', 's': 'experts'}


def skew_tiers(params):
  """SkewAdam labels by leaf name (:data:`SKEW_TIERS`): each tier's
  transformation once (the embeddings' is the experts')."""
  return {k: SKEW_TIERS[k] for k in params}


def poetx_with_skewadam(learning_rate, *, merge_every=3, b1=0.9, b2=0.999, eps=1e-8,
                        weight_decay=0.0, min_dim_size_to_factor=None):
  """poetx_skewadam: poetx on 'w', SkewAdam's router and expert tiers on 'b' and 's'."""
  return poetx_jax.poetx_skewadam(
      lambda params: {k: POETX_SKEW_TIERS[k] for k in params},
      poetx_jax.poetx(learning_rate, merge_every=merge_every), learning_rate, b1=b1, b2=b2,
      eps=eps, weight_decay=weight_decay, min_dim_size_to_factor=min_dim_size_to_factor)


def poetx_muon_beside_adam(learning_rate, *, merge_every=3, beta=0.95, rms=0.2):
  """poetx_muon on 'w' (eight packed 4 x 4 skew blocks), Adam on the rest."""
  labels = lambda params: {k: 'gen' if k == 'w' else 'rest' for k in params}
  return optax.partition(
      {'gen': poetx_jax.poetx_muon(learning_rate, merge_every=merge_every, beta=beta, rms=rms),
       'rest': optax.adam(learning_rate)}, labels)


@dataclasses.dataclass(frozen=True)
class Spec:
  """An optimizer under test: ``factory(learning_rate=LR, **hyper, **static)``.

  ``hyper``: numeric hyperparameters (traced under inject_hyperparams);
  ``static``: structural options; ``has_lr``: False for a ``scale_by_*``
  (a direction only: the descent check chains a learning rate on);
  ``rtol``: between two computations of the same updates (a bfloat16 first
  moment rounds where XLA fuses differently: about 2**-8).
  """
  name: str
  factory: tp.Callable[..., optax.GradientTransformation]
  hyper: dict
  static: dict = dataclasses.field(default_factory=dict)
  has_lr: bool = True
  rtol: float = 1e-5

  def make(self, learning_rate=LR):
    lr = dict(learning_rate=learning_rate) if self.has_lr else {}
    return self.factory(**lr, **self.hyper, **self.static)

  def descent(self):
    """A transformation whose updates are steps (a learning rate applied)."""
    tx = self.make()
    return tx if self.has_lr else optax.chain(tx, optax.scale_by_learning_rate(LR))


# merge_every=3: every run of 4+ updates crosses a merge point (moments reset).
OPTIMIZERS = [
    Spec('poetx', poetx_jax.poetx, dict(merge_every=3)),
    Spec('poetx_mu_bf16', poetx_jax.poetx, dict(merge_every=3),
         dict(mu_dtype=jnp.bfloat16), rtol=1e-2),
    Spec('poetx_block', poetx_jax.poetx, dict(merge_every=3),
         dict(second_moment='block')),
    Spec('poetx_block_mu_bf16', poetx_jax.poetx, dict(merge_every=3),
         dict(second_moment='block', mu_dtype=jnp.bfloat16), rtol=1e-2),
    # Factors the (8, 6) and (3, 4, 5) leaves. mu_dtype is named so that
    # inject_hyperparams keeps it static (its bf16 default is not a number).
    Spec('lean_adamw', poetx_jax.lean_adamw, dict(b2=0.99, weight_decay=1e-2),
         dict(mu_dtype=jnp.bfloat16, min_dim_size_to_factor=4), rtol=1e-2),
    Spec('scale_by_lean_adam', poetx_jax.scale_by_lean_adam, dict(b1=0.8, b2=0.99),
         dict(mu_dtype=jnp.bfloat16, min_dim_size_to_factor=4), has_lr=False, rtol=1e-2),
    Spec('clip_after_merge', clipped_poetx, dict(merge_every=3, max_norm=1.0)),
    Spec('scale_by_factored_rms', poetx_jax.scale_by_factored_rms, dict(b2=0.99, eps=1e-8),
         dict(min_dim_size_to_factor=4), has_lr=False),
    # A label function and min_dim_size_to_factor are structural: static under
    # inject_hyperparams.
    Spec('scale_by_skewadam', poetx_jax.scale_by_skewadam, dict(b1=0.8, b2=0.99),
         dict(labels=skew_tiers, min_dim_size_to_factor=4), has_lr=False),
    Spec('skewadam', poetx_jax.skewadam, dict(b1=0.8, b2=0.99, weight_decay=1e-2),
         dict(labels=skew_tiers, min_dim_size_to_factor=4)),
    # Default labels (all 'backbone' by path) and min_dim_size_to_factor: the
    # defaults alone need no static_args.
    Spec('skewadam_defaults', poetx_jax.skewadam, dict(weight_decay=1e-2)),
    # Newton–Schulz runs in bf16, and XLA may fuse it differently under jit.
    Spec('poetx_muon', poetx_muon_beside_adam, dict(merge_every=3, beta=0.9, rms=0.3), rtol=2e-2),
    Spec('poetx_skewadam', poetx_with_skewadam,
         dict(merge_every=3, b1=0.8, b2=0.99, weight_decay=1e-2),
         dict(min_dim_size_to_factor=4)),
]
WITH_LR = [s for s in OPTIMIZERS if s.has_lr]


def _ids(specs):
  return [s.name for s in specs]


every_optimizer = pytest.mark.parametrize('spec', OPTIMIZERS, ids=_ids(OPTIMIZERS))


def _params(key, dtype=jnp.float32):
  """A matrix, a vector and a 3-D leaf."""
  k1, k2, k3 = jax.random.split(key, 3)
  return {'w': jax.random.normal(k1, (8, 6)).astype(dtype),
          'b': jax.random.normal(k2, (6,)).astype(dtype),
          's': jax.random.normal(k3, (3, 4, 5)).astype(dtype)}


def _grads(key, n, dtype=jnp.float32):
  return [_params(k, dtype) for k in jax.random.split(key, n)]


def _run(tx, params, grads, *, jit=True):
  """The updates of ``tx`` for ``grads`` (params fixed) and its final state."""
  init, update = (jax.jit(tx.init), jax.jit(tx.update)) if jit else (tx.init, tx.update)
  state, outs = init(params), []
  for g in grads:
    u, state = update(g, state, params)
    outs.append(u)
  return outs, state


def _assert_close(got, want, spec, rtol=0.0):
  """Same updates or states computed two ways: the same structure and dtypes,
  each leaf within the spec's relative (Frobenius) error."""
  assert_trees_rel_close(got, want, max(rtol, spec.rtol))


def _assert_finite(tree):
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    assert bool(jnp.isfinite(x.astype(jnp.float32)).all()), jax.tree_util.keystr(path)


@every_optimizer
def test_jit_matches_eager(spec, keys):
  params, grads = _params(keys()), _grads(keys(), 5)
  tx = spec.make()
  chex.assert_trees_all_equal(jax.jit(tx.init)(params), tx.init(params))
  got, state = _run(tx, params, grads, jit=True)
  want, want_state = _run(tx, params, grads, jit=False)
  _assert_close(got, want, spec)
  _assert_close(state, want_state, spec)


@every_optimizer
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16], ids=['f32', 'bf16'])
def test_state_and_dtypes_are_stable_under_jit(spec, keys, dtype):
  """Several updates (across merge points) under one compiled update: the
  state keeps its structure, shapes and dtypes (no retrace), the updates and
  parameters keep the parameters' dtype, and everything stays finite."""
  params0 = params = _params(keys(), dtype)
  tx = spec.make()
  state0 = state = tx.init(params)
  update = jax.jit(tx.update)
  for g in _grads(keys(), 7, dtype):
    u, state = update(g, state, params)
    chex.assert_trees_all_equal_dtypes(u, params0)
    params = optax.apply_updates(params, u)
    _assert_finite((u, state))
  chex.assert_trees_all_equal_dtypes(params, params0)
  chex.assert_trees_all_equal_structs(state, state0)
  chex.assert_trees_all_equal_shapes_and_dtypes(state, state0)
  assert update._cache_size() == 1  # also no weak-type drift in the state


@every_optimizer
def test_inject_hyperparams_traces_every_numeric_hyperparameter(spec, keys):
  """Numeric hyperparameters given as traced arrays change nothing."""
  params, grads = _params(keys()), _grads(keys(), 5)
  lr = dict(learning_rate=LR) if spec.has_lr else {}
  injected = optax.inject_hyperparams(spec.factory, static_args=tuple(spec.static))(
      **lr, **spec.hyper, **spec.static)
  got, state = _run(injected, params, grads)
  want, want_state = _run(spec.make(), params, grads)
  assert set(lr) | set(spec.hyper) <= set(state.hyperparams)  # with numeric defaults
  # b2 as a float32 array: 1 - b2**t rounds a little differently.
  _assert_close(got, want, spec, rtol=1e-4)
  _assert_close(state.inner_state, want_state, spec, rtol=1e-4)


@pytest.mark.parametrize('spec', WITH_LR, ids=_ids(WITH_LR))
def test_learning_rate_is_an_injectable_hyperparameter(spec, keys):
  """The learning rate as a schedule under inject_hyperparams matches the
  schedule given directly; as a constant it scales the update linearly."""
  params, grads = _params(keys()), _grads(keys(), 5)
  sched = optax.linear_schedule(LR, LR / 10, transition_steps=4)
  inject = optax.inject_hyperparams(spec.factory, static_args=tuple(spec.static))
  got, state = _run(inject(learning_rate=sched, **spec.hyper, **spec.static),
                    params, grads)
  want, _ = _run(spec.make(learning_rate=sched), params, grads)
  _assert_close(got, want, spec, rtol=1e-4)
  assert float(state.hyperparams['learning_rate']) == pytest.approx(float(sched(4)))
  assert float(state.hyperparams['learning_rate']) < LR / 5  # it did move

  tx = inject(learning_rate=LR, **spec.hyper, **spec.static)
  update = jax.jit(tx.update)
  state = tx.init(params)
  u1, _ = update(grads[0], state, params)
  state.hyperparams['learning_rate'] = jnp.asarray(2 * LR)
  u2, _ = update(grads[0], state, params)
  state.hyperparams['learning_rate'] = jnp.asarray(0.0)
  u0, _ = update(grads[0], state, params)
  assert float(optax.tree.norm(u1)) > 0
  chex.assert_trees_all_close(u2, jax.tree.map(lambda u: 2 * u, u1), rtol=1e-6)
  chex.assert_trees_all_equal(u0, optax.tree.zeros_like(u1))


@every_optimizer
def test_multisteps_applies_the_mean_gradient(spec, keys):
  """MultiSteps(k=3): no update for two micro-steps, then the update of the
  mean gradient; the inner state advances once per k micro-steps."""
  params, grads = _params(keys()), _grads(keys(), 6)
  tx = spec.make()
  got, state = _run(optax.MultiSteps(tx, every_k_schedule=3), params, grads)
  mean = lambda gs: jax.tree.map(lambda *x: sum(x) / len(x), *gs)
  want, want_state = _run(tx, params, [mean(grads[:3]), mean(grads[3:])])
  zeros = optax.tree.zeros_like(params)
  for i in (0, 1, 3, 4):
    chex.assert_trees_all_equal(got[i], zeros)
  _assert_close([got[2], got[5]], want, spec, rtol=1e-4)
  _assert_close(state.inner_opt_state, want_state, spec, rtol=1e-4)


@every_optimizer
def test_chain_runs_it_after_another_transformation(spec, keys):
  """chain(clip(0.5), tx) is tx on the clipped gradients."""
  params = _params(keys())
  grads = [jax.tree.map(lambda g: 2 * g, g) for g in _grads(keys(), 4)]  # many clip
  tx = spec.make()
  got, _ = _run(optax.chain(optax.clip(0.5), tx), params, grads)
  clipped = [jax.tree.map(lambda x: jnp.clip(x, -0.5, 0.5), g) for g in grads]
  want, _ = _run(tx, params, clipped)
  _assert_close(got, want, spec)
  plain, _ = _run(tx, params, grads)  # the clip did change the updates
  assert not np.allclose(plain[1]['w'], got[1]['w'])


@every_optimizer
def test_partition_gives_it_only_its_leaves(spec, keys):
  """optax.partition: tx on 'w' and 's' equals tx on that subtree alone;
  'b' gets SGD."""
  params, grads = _params(keys()), _grads(keys(), 4)
  labels = {'w': 'tx', 'b': 'sgd', 's': 'tx'}
  tx = spec.make()
  part = optax.partition({'tx': tx, 'sgd': optax.sgd(0.1)}, labels)
  got, _ = _run(part, params, grads)
  sub = lambda t: {k: t[k] for k in ('w', 's')}
  want, _ = _run(tx, sub(params), [sub(g) for g in grads])
  _assert_close([sub(u) for u in got], want, spec)
  for u, g in zip(got, grads, strict=True):
    np.testing.assert_allclose(u['b'], -0.1 * g['b'], rtol=1e-6)


@every_optimizer
def test_descends_on_a_quadratic(spec, keys):
  params, target = _params(keys()), _params(keys())
  loss = lambda p: sum(jnp.sum((p[k] - target[k]) ** 2) for k in p)
  tx = spec.descent()
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    u, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, u), state, u

  l0 = float(loss(params))
  for _ in range(40):
    params, state, u = step(params, state)
    _assert_finite(u)
  assert float(loss(params)) < 0.5 * l0, (float(loss(params)), l0)


@every_optimizer
def test_updates_are_finite_for_zero_and_huge_gradients(spec, keys):
  params = _params(keys())
  zeros = optax.tree.zeros_like(params)
  huge = jax.tree.map(lambda g: 1e15 * g, _params(keys()))
  outs, state = _run(spec.make(), params, [zeros, huge, zeros, huge])
  _assert_finite((outs, state))
