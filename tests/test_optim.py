"""The optax side: poetx, moment resets, the clipping ramp, partitioning.

What every optimizer must do (jit, dtypes, inject_hyperparams, MultiSteps,
chain, partition, descent) is checked once for all in test_optax_contract.py;
here the maths against hand-written references.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import poetx_jax
from poetx_jax import merge_due, poetx


def _params(key):
  k1, k2 = jax.random.split(key)
  return {'a': jax.random.normal(k1, (4, 6)), 'b': jax.random.normal(k2, (3,))}


def _grads(key, n):
  return [_params(k) for k in jax.random.split(key, n)]


def _run(tx, params, grads):
  state = tx.init(params)
  outs, states = [], [state]
  for g in grads:
    u, state = tx.update(g, state, params)
    outs.append(u)
    states.append(state)
  return outs, states


def test_first_cycle_is_adam_with_the_step_size_as_given(keys):
  params, grads = _params(keys()), _grads(keys(), 5)
  got, _ = _run(poetx(5e-3, merge_every=10), params, grads)
  want, _ = _run(optax.adam(5e-3, eps=1e-8), params, grads)
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-9)


def _reference_adamw_steps(grads, lr, merge_every, b1=0.9, b2=0.999, eps=1e-6):
  """The published POET-X AdamW's parameter steps, written out in float64:
  moments and step counter reset every ``merge_every`` updates, ``eps``
  added to the raw root, then ``lr * sqrt(1 - b2^t) / (1 - b1^t)``."""
  m = v = None
  out = []
  for n, g in enumerate(grads):
    g = np.asarray(g, np.float64)
    if m is None or n % merge_every == 0:
      m, v, t = np.zeros_like(g), np.zeros_like(g), 0
    t += 1
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    out.append(-lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m / (np.sqrt(v) + eps))
  return out


def test_raw_eps_placement_is_the_published_adamw_in_float64(keys):
  """eps_placement='raw' with eps 1e-6: the reference's update, step by
  step across two merges, to float64 rounding; gradients small enough
  (1e-5) that the placement matters."""
  with jax.enable_x64(True):
    grads = [1e-5 * jax.random.normal(k, (4, 6), jnp.float64)
             for k in jax.random.split(keys(), 7)]
    tx = poetx(3e-3, merge_every=3, eps=1e-6, eps_placement='raw')
    got, _ = _run(tx, jnp.zeros((4, 6), jnp.float64), grads)
    want = _reference_adamw_steps(grads, 3e-3, 3)
    for u, w in zip(got, want):
      assert u.dtype == jnp.float64
      np.testing.assert_allclose(np.asarray(u), w, rtol=1e-12, atol=0)
    corrected, _ = _run(poetx(3e-3, merge_every=3, eps=1e-6), jnp.zeros((4, 6), jnp.float64),
                        grads)
    assert not np.allclose(np.asarray(corrected[0]), want[0], rtol=1e-3)
  with pytest.raises(ValueError, match="eps_placement must be one of.*got 'late'"):
    poetx(1e-3, eps_placement='late')


def test_blockwise_second_moment_matches_its_definition(keys):
  """second_moment='block': Adam with one second moment per row (per POET block)."""
  params, grads = _params(keys()), _grads(keys(), 4)
  b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-2
  tx = poetx(lr, merge_every=None, second_moment='block',
             mu_dtype=jnp.bfloat16)
  got, states = _run(tx, params, grads)
  assert states[-1][0].nu['a'].shape == (4, 1) and states[-1][0].nu['b'].shape == (3,)
  assert states[-1][0].mu['a'].dtype == jnp.bfloat16
  m = {k: np.zeros_like(v) for k, v in params.items()}
  v = {'a': np.zeros((4, 1)), 'b': np.zeros(3)}
  for t, g in enumerate(grads, start=1):
    for k in params:
      gk = np.asarray(g[k], np.float64)
      b1m = np.asarray(b1 * jnp.asarray(m[k], jnp.bfloat16), np.float64)  # a bf16 product
      mt = b1m + (1 - b1) * gk  # used unrounded, stored as bf16
      m[k] = np.asarray(jnp.asarray(mt, jnp.bfloat16), np.float64)
      sq = (gk ** 2).mean(-1, keepdims=True) if gk.ndim == 2 else gk ** 2
      v[k] = b2 * v[k] + (1 - b2) * sq
      want = -lr * (mt / (1 - b1 ** t)) / (np.sqrt(v[k] / (1 - b2 ** t)) + eps)
      np.testing.assert_allclose(got[t - 1][k], want, rtol=1e-4, atol=1e-7)
  with pytest.raises(ValueError, match="second_moment must be one of .*got 'row'"):
    poetx(1e-3, second_moment='row')


def test_moments_reset_exactly_at_merge_steps(keys):
  params, grads = _params(keys()), _grads(keys(), 8)
  k = 3
  got, states = _run(poetx(1e-2, merge_every=k), params, grads)
  fresh = poetx(1e-2, merge_every=k)
  for start in range(0, 8, k):  # updates 0..2, 3..5, 6..7 are separate cycles
    want, _ = _run(fresh, params, grads[start:start + k])
    chex.assert_trees_all_close(got[start:start + k], want, rtol=1e-6, atol=1e-9)
  due = [bool(merge_due(s0, s1)) for s0, s1 in zip(states, states[1:])]
  assert due == [False, False, True, False, False, True, False, False]
  # Without resets the 4th update would differ: the check above can fail.
  plain, _ = _run(poetx(1e-2, merge_every=None), params, grads)
  assert not np.allclose(plain[3]['a'], got[3]['a'])


def test_multisteps_merges_only_on_real_updates(keys):
  params, grads = _params(keys()), _grads(keys(), 8)
  tx = optax.MultiSteps(poetx(1e-2, merge_every=2), every_k_schedule=2)
  _, states = _run(tx, params, grads)
  due = [bool(merge_due(s0, s1)) for s0, s1 in zip(states, states[1:])]
  assert due == [False, False, False, True, False, False, False, True]


def test_partition_with_adamw(keys):
  model = poetx_jax.poetize(nnx.Sequential(nnx.Linear(16, 16, rngs=nnx.Rngs(0))),
                            block_size=4, rngs=nnx.Rngs(1))
  tx = poetx_jax.poetx_partition(model, poetx(1e-2), optax.adamw(1e-3, weight_decay=0.1))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  labels = poetx_jax.poetx_labels(model)
  assert labels['layers'][0]['q_in'] == 'poetx' and labels['layers'][0]['bias'] == 'other'
  before = nnx.clone(model)
  grads = nnx.grad(lambda m: (m(jnp.ones((2, 16))) ** 2).sum())(model)
  opt.update(model, grads)
  step_q = jnp.abs(model.layers[0].q_in[...] - before.layers[0].q_in[...])
  step_b = jnp.abs(model.layers[0].bias[...] - before.layers[0].bias[...])
  # Adam's first step moves every entry by its learning rate (the bias starts
  # at zero: no decay). Every entry: a masked check would pass on no movement.
  np.testing.assert_allclose(step_q, 1e-2, rtol=1e-3)
  np.testing.assert_allclose(step_b, 1e-3, rtol=1e-3)
  np.testing.assert_array_equal(model.layers[0].kernel[...], before.layers[0].kernel[...])


def test_partition_refuses_another_models_labels():
  """Labels made for another model: init names the parameters without a
  label and the labels without a parameter."""
  one = poetx_jax.poetize(nnx.Sequential(nnx.Linear(16, 16, rngs=nnx.Rngs(0))),
                          block_size=4, rngs=nnx.Rngs(1))
  two = poetx_jax.poetize(nnx.Sequential(nnx.Linear(16, 16, rngs=nnx.Rngs(0)),
                                         nnx.Linear(16, 16, rngs=nnx.Rngs(0))),
                          block_size=4, rngs=nnx.Rngs(1))
  tx = poetx_jax.poetx_partition(poetx_jax.poetx_labels(one), poetx(1e-2), optax.adamw(1e-3))
  with pytest.raises(ValueError, match=r"labels are of other parameters than those given "
                                       r"\(another model's\?\): 3 parameter\(s\) without a label "
                                       r"\(first: \['layers'\]\[1\]\['bias'\].*0 label\(s\) without"):
    nnx.Optimizer(two, tx, wrt=nnx.Param)
  nnx.Optimizer(one, tx, wrt=nnx.Param)


def test_clip_bound_ramp():
  """The bound from the POET-X cycle: (updates done, updates since the merge point)."""
  bound = lambda n, c, **kw: float(poetx_jax.merge_clip_bound(
      jnp.int32(n), jnp.int32(c), 2.0, ramp_steps=10, min_ratio=0.1, **kw))
  assert bound(0, 0) == bound(5, 5) == bound(99, 99) == 2.0  # no merge yet
  assert np.isclose(bound(100, 0), 0.2) and np.isclose(bound(105, 5), 2.0 * 0.55)
  assert bound(110, 10) == 2.0 and np.isclose(bound(300, 0), 0.2)
  assert bound(300, 0, until=200) == 2.0


def test_clip_after_merge_is_optax_clipping_until_a_merge(keys):
  """Until the first merge the wrapper's updates are those of
  optax.clip_by_global_norm before the same optimizer, bit for bit, compiled,
  whether the gradients are clipped (norms ~1e3) or not (~1e-3)."""
  inner = optax.partition({'poetx': poetx(1e-3, merge_every=5), 'other': optax.sgd(1.0)},
                          {'q': 'poetx', 'w': 'other'})
  params = {'q': jnp.zeros((6,)), 'w': jnp.zeros((7,))}
  grads = [{k: scale * jax.random.normal(keys(), v.shape) for k, v in params.items()}
           for scale in (1e3, 1e-3, 1e3, 1e3)]

  def run(tx):
    update, state, outs = jax.jit(tx.update), tx.init(params), []
    for g in grads:
      u, state = update(g, state, params)
      outs.append(u)
    return outs

  got = run(poetx_jax.clip_by_global_norm_after_merge(inner, 0.7))
  chex.assert_trees_all_equal(got, run(optax.chain(optax.clip_by_global_norm(0.7), inner)))
  assert float(jnp.linalg.norm(got[0]['w'])) < 0.7  # sgd's update: the clipped gradient


def test_clip_after_merge_reads_the_poetx_cycle(keys):
  """The wrapper clips every gradient by the bound of the wrapped optimizer's
  cycle: full until the first merge (every 2 updates), a tenth right after."""
  labels = {'q': 'poetx', 'w': 'other'}
  inner = optax.partition({'poetx': poetx(1e-3, merge_every=2), 'other': optax.sgd(1.0)},
                          labels)
  tx = poetx_jax.clip_by_global_norm_after_merge(inner, 1.0, ramp_steps=2)
  params = {'q': jnp.zeros((3,)), 'w': jnp.zeros((4,))}
  g = {'q': jnp.zeros((3,)), 'w': jnp.full((4,), 10.0)}  # norm 20
  outs, states = _run(tx, params, [g] * 4)
  norms = [float(optax.tree.norm(u['w'])) for u in outs]  # sgd: the clipped gradient
  np.testing.assert_allclose(norms, [1.0, 1.0, 0.1, 0.55], rtol=1e-5)
  chex.assert_trees_all_equal_structs(states[-1], inner.init(params))  # no state of its own
  small = {'q': jnp.zeros((3,)), 'w': jnp.full((4,), 0.01)}
  out, _ = _run(tx, params, [small])
  np.testing.assert_array_equal(out[0]['w'], -small['w'])
  with pytest.raises(ValueError, match='no scale_by_poetx state'):
    poetx_jax.clip_by_global_norm_after_merge(optax.sgd(1.0), 1.0).init(params)


def test_bad_hyperparameters():
  with pytest.raises(ValueError, match='learning_rate must be >= 0, got -0.1'):
    poetx(-0.1)
  with pytest.raises(ValueError, match=r'merge_every must be an int in \[1, 2147483647\].*got 0'):
    poetx(1e-3, merge_every=0)
  with pytest.raises(ValueError, match='b2 must be in \\[0, 1\\)'):
    poetx(1e-3, b2=1.0)
  with pytest.raises(ValueError, match='max_norm must be > 0'):
    poetx_jax.clip_by_global_norm_after_merge(poetx(1e-3), 0.0)
  with pytest.raises(ValueError, match='no scale_by_poetx state'):
    merge_due(optax.adam(1e-3).init({'a': jnp.ones(2)}), optax.adam(1e-3).init({'a': jnp.ones(2)}))
