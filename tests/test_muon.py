"""poetx_muon: Muon's orthogonalised updates on the packed skew generators,
against a float64 reference written out here."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import poetx_jax
from poetx_jax import muon
from poetx_jax.skew import pack_skew, ragged_mask, unpack_skew

A, B_, C = muon.NS_COEFFS


def _skew64(q, b):
  """Packed (…, K, P) -> (…, K, B, B) skew blocks in float64 (numpy)."""
  rows, cols = np.triu_indices(b, k=1)
  q = np.asarray(q, np.float64)
  m = np.zeros(q.shape[:-1] + (b, b))
  m[..., rows, cols] = q
  return m - np.swapaxes(m, -1, -2)


def _ns64(m, steps=5):
  """Newton–Schulz on each block in float64, the iteration as documented."""
  x = m / np.linalg.norm(m, axis=(-2, -1), keepdims=True)
  for _ in range(steps):
    g = x @ np.swapaxes(x, -1, -2)
    x = A * x + (B_ * g + C * g @ g) @ x
  return x


def _reference(grads, b, *, lr, beta=0.95, rms=0.2, merge_every=None, nesterov=True):
  """poetx_muon's updates for a list of gradients, in float64."""
  mu, out = None, []
  for t, g in enumerate(grads):
    g = np.asarray(g, np.float64)
    if mu is None or (merge_every and t % merge_every == 0):
      mu = np.zeros_like(g)
    mu = beta * mu + (1 - beta) * g
    look = beta * mu + (1 - beta) * g if nesterov else mu
    o = _ns64(_skew64(look, b))
    rows, cols = np.triu_indices(b, k=1)
    out.append(-lr * rms * np.sqrt(b) * o[..., rows, cols])
  return out


def _run(tx, params, grads):
  state, outs = jax.jit(tx.init)(params), []
  update = jax.jit(tx.update)
  for g in grads:
    u, state = update(g, state, params)
    outs.append(u)
  return outs, state


@pytest.mark.parametrize('nesterov', [True, False])
def test_updates_match_the_float64_reference_across_merges(keys, nesterov):
  """Seven updates with merges every 3: momentum, Nesterov, Newton–Schulz,
  the scale and the restarts, to float32 rounding with the iteration in
  float32; the default bf16 iteration within its rounding of that."""
  b, shape = 8, (2, 5, 28)  # a stack of two layers of five 8 x 8 blocks
  grads = [jax.random.normal(k, shape) for k in jax.random.split(keys(), 7)]
  want = _reference(grads, b, lr=1e-2, merge_every=3, nesterov=nesterov)
  exact, _ = _run(poetx_jax.poetx_muon(1e-2, merge_every=3, nesterov=nesterov,
                                       ns_dtype=jnp.float32), jnp.zeros(shape), grads)
  bf16, _ = _run(poetx_jax.poetx_muon(1e-2, merge_every=3, nesterov=nesterov),
                 jnp.zeros(shape), grads)
  for e, h, w in zip(exact, bf16, want, strict=True):
    assert e.dtype == h.dtype == jnp.float32
    np.testing.assert_allclose(e, w, rtol=0, atol=1e-5 * np.abs(w).max())
    err = np.linalg.norm(np.asarray(h, np.float64) - w) / np.linalg.norm(w)
    assert 0 < err < 0.1, err  # bf16's 8 bits through five iterations


def test_orthogonalize_skew_in_float32_matches_float64(keys):
  m = unpack_skew(jax.random.normal(keys(), (6, 45)), 10)
  got = muon.orthogonalize_skew(m, dtype=jnp.float32)
  np.testing.assert_allclose(got, _ns64(np.asarray(m, np.float64)), rtol=0, atol=2e-5)


def test_the_update_is_skew_and_near_orthogonal(keys):
  """Each block's result is skew (up to bf16 rounding) with singular values
  in Newton–Schulz's band around 1, and entries of RMS about 1/sqrt(B)."""
  b = 64
  m = unpack_skew(jax.random.normal(keys(), (4, b * (b - 1) // 2)), b)
  o = np.asarray(muon.orthogonalize_skew(m), np.float64)
  np.testing.assert_array_less(np.abs(o + np.swapaxes(o, -1, -2)), 0.05)
  s = np.linalg.svd(o, compute_uv=False)
  assert s.min() > 0.5 and s.max() < 1.3, (s.min(), s.max())
  rms = np.sqrt(np.mean(o ** 2))
  assert abs(rms * np.sqrt(b) - 1) < 0.2, rms


def test_update_rms_and_scale_invariance(keys):
  """Entries have RMS about ``lr * rms``; a gradient 1e6 times larger gives
  the same update (Newton–Schulz normalises its input)."""
  b, g = 32, jax.random.normal(keys(), (3, 496))
  tx = poetx_jax.poetx_muon(1e-3, rms=0.5)
  (u,), _ = _run(tx, jnp.zeros_like(g), [g])
  (v,), _ = _run(tx, jnp.zeros_like(g), [1e6 * g])
  assert abs(float(jnp.sqrt(jnp.mean(u ** 2))) / 5e-4 - 1) < 0.2
  np.testing.assert_allclose(u, v, rtol=0, atol=1e-3 * float(jnp.abs(u).max()))
  assert b * (b - 1) // 2 == g.shape[-1]


def test_a_ragged_last_block_keeps_its_padding_at_zero(keys):
  """The last block of a side of 20 features at B 8 has 4 features: its
  padding entries get zero gradient, so zero update."""
  mask = ragged_mask(20, 8)
  g = jax.random.normal(keys(), mask.shape) * mask
  (u,), _ = _run(poetx_jax.poetx_muon(1e-2), jnp.zeros_like(g), [g])
  np.testing.assert_array_equal(np.asarray(u)[mask == 0], 0.0)
  assert np.all(np.asarray(u)[-1][mask[-1] == 1] != 0)


def test_state_is_a_poetx_state_whose_cycle_drives_merges(keys):
  tx = poetx_jax.poetx_muon(1e-2, merge_every=2, mu_dtype=jnp.bfloat16)
  params = jnp.zeros((3, 6))
  state = tx.init(params)
  s = poetx_jax.optim.the_poetx_state(state)
  assert s.nu is None and s.mu.dtype == jnp.bfloat16
  due = []
  for k in jax.random.split(keys(), 4):
    new_u, new = tx.update(jax.random.normal(k, (3, 6)), state, params)
    due.append(bool(poetx_jax.merge_due(state, new)))
    state = new
  assert due == [False, True, False, True]
  assert new_u.dtype == jnp.float32


def test_in_a_partition_beside_another_transformation(keys):
  """In optax.partition beside another transformation, poetx_muon updates
  its leaves exactly as it does alone."""
  model_grads = {'gen': jax.random.normal(keys(), (2, 6)), 'dense': jax.random.normal(keys(), (5,))}
  tx = optax.partition({'poetx': poetx_jax.poetx_muon(1e-2), 'other': optax.sgd(0.1)},
                       {'gen': 'poetx', 'dense': 'other'})
  (u,), _ = _run(tx, optax.tree.zeros_like(model_grads), [model_grads])
  np.testing.assert_allclose(u['dense'], -0.1 * model_grads['dense'], rtol=1e-6)
  (alone,), _ = _run(poetx_jax.poetx_muon(1e-2), jnp.zeros((2, 6)), [model_grads['gen']])
  np.testing.assert_array_equal(u['gen'], alone)


def test_batches_group_leaves_by_block_size_up_to_the_limit(monkeypatch):
  """Leaves of one packed size share a batch in order until the next would
  pass BATCH_ELEMENTS; a leaf over it is a batch alone; every leaf is in
  exactly one batch."""
  monkeypatch.setattr(muon, 'BATCH_ELEMENTS', 100)  # B 4: 16 elements a block
  shapes = [(1, 6), (2, 6), (1, 15), (3, 6), (1, 6), (10, 6)]
  assert muon.batches(shapes) == [(6, [0, 1, 3]), (6, [4]), (6, [5]), (15, [2])]
  monkeypatch.setattr(muon, 'BATCH_ELEMENTS', 1 << 25)
  assert muon.batches(shapes) == [(6, [0, 1, 3, 4, 5]), (15, [2])]


@pytest.mark.parametrize('limit', [1 << 25, 40])
def test_leaves_of_several_shapes_and_block_sizes_update_as_each_alone(keys, monkeypatch, limit):
  """The blocks of the leaves of one block size are orthogonalised in
  batches (all together, or several batches under a small limit): each
  leaf's update is the one it gets alone (leaves of B = 4 and B = 6, with
  and without a layer axis), and matches the float64 reference."""
  monkeypatch.setattr(muon, 'BATCH_ELEMENTS', limit)
  grads = [{'a': jax.random.normal(keys(), (2, 6)), 'b': jax.random.normal(keys(), (3, 2, 6)),
            'c': jax.random.normal(keys(), (1, 15)), 'd': jax.random.normal(keys(), (2, 2, 15))}
           for _ in range(3)]
  tx = lambda: poetx_jax.poetx_muon(1e-2, ns_dtype=jnp.float32, merge_every=2)
  together, _ = _run(tx(), optax.tree.zeros_like(grads[0]), grads)
  for name, b in [('a', 4), ('b', 4), ('c', 6), ('d', 6)]:
    alone, _ = _run(tx(), jnp.zeros_like(grads[0][name]), [g[name] for g in grads])
    ref = _reference([g[name] for g in grads], b, lr=1e-2, merge_every=2)
    for t in range(3):
      assert together[t][name].shape == grads[0][name].shape
      np.testing.assert_allclose(together[t][name], alone[t], rtol=1e-5, atol=1e-7)
      np.testing.assert_allclose(together[t][name], ref[t], rtol=2e-4, atol=1e-6)


@pytest.mark.parametrize('kwargs, message', [
    (dict(beta=1.0), 'beta'),
    (dict(rms=0.0), 'rms'),
    (dict(ns_steps=0), 'ns_steps'),
    (dict(merge_every=0), 'merge_every'),
])
def test_bad_hyperparameters_are_named(kwargs, message):
  with pytest.raises(ValueError, match=message):
    poetx_jax.poetx_muon(1e-3, **kwargs)


@pytest.mark.parametrize('shape, message', [((6,), 'shape'), ((4, 7), '7 is not B')])
def test_arrays_that_are_not_packed_generators_are_refused(shape, message):
  with pytest.raises(ValueError, match=message):
    poetx_jax.poetx_muon(1e-3).init(jnp.zeros(shape))


def test_pack_of_the_skew_result_is_its_upper_triangle(keys):
  """pack_skew after the iteration reads the upper triangle; the lower one
  is its negation to rounding, so nothing is lost by packing."""
  m = unpack_skew(jax.random.normal(keys(), (2, 15)), 6)
  o = muon.orthogonalize_skew(m, dtype=jnp.float32)
  np.testing.assert_allclose(unpack_skew(pack_skew(o), 6), o, atol=1e-5)


def test_the_app_refuses_adam_options_poetx_muon_does_not_read():
  """--poet-eps and --poet-eps-placement set Adam's offset of POET-X; with
  poetx-muon, which keeps no second moment, they are refused, naming them."""
  from poetx_jax.pretrain.config import TrainConfig
  TrainConfig(optimizer='poetx-muon').validate()
  with pytest.raises(ValueError, match=r"poet_eps=1e-06, poet_eps_placement='raw': optimizer "
                                       r"'poetx-muon' does not use them"):
    TrainConfig(optimizer='poetx-muon', poet_eps=1e-6, poet_eps_placement='raw').validate()
  TrainConfig(optimizer='poetx', poet_eps=1e-6, poet_eps_placement='raw').validate()


def test_the_default_step_is_poetxs_up_to_blocks_of_256_then_two_to_the_minus_ten():
  import poetx_jax
  assert poetx_jax.default_poet_muon_lr(16) == poetx_jax.default_poet_lr(16) == 5e-3
  assert poetx_jax.default_poet_muon_lr(128) == poetx_jax.default_poet_lr(128)
  assert {poetx_jax.default_poet_muon_lr(b) for b in (256, 512, 1024)} == {2.0 ** -10}
  assert poetx_jax.default_poet_muon_lr(512) == 2 * poetx_jax.default_poet_lr(512)
  with pytest.raises(ValueError, match='block_size must be an int >= 2, got 1'):
    poetx_jax.default_poet_muon_lr(1)
