"""bfloat16 POET generators (``generator_dtype``): stored, differentiated and
moved by the optimizer in bfloat16, the rotations still computed in float32."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import poetx_jax
from poetx_jax.pretrain.config import TrainConfig
from conftest import app_steps, rel_err


def _layers(keys, dtype):
  """The same layer with float32 and with bfloat16 generators, the float32
  ones holding the bfloat16 values (so both compute the same rotations)."""
  kernel = jax.random.normal(keys(), (48, 40), jnp.float32) / 7
  make = lambda gen: poetx_jax.POETLinear(48, 40, block_size=16, use_bias=False, dtype=dtype,
                                          generator_dtype=gen,
                                          kernel_init=lambda *_: kernel, rngs=nnx.Rngs(3))
  low, full = make(jnp.bfloat16), make(jnp.float32)
  for side in ('q_in', 'q_out'):
    q = getattr(low, side)
    q[...] = (0.1 * jax.random.normal(keys(), q.shape)).astype(jnp.bfloat16)
    getattr(full, side)[...] = q[...].astype(jnp.float32)
  return low, full


@pytest.mark.slow
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_the_layer_computes_as_float32_generators_of_the_same_values(keys, dtype):
  """Outputs equal bit for bit; each generator gradient is the float32
  layer's rounded to bfloat16 (nothing else in the backward changes)."""
  low, full = _layers(keys, dtype)
  assert low.q_in.dtype == low.q_out.dtype == jnp.bfloat16
  x = jax.random.normal(keys(), (2, 5, 48), dtype)

  def run(layer):
    def loss(model):
      return jnp.sum(jnp.sin(model(x).astype(jnp.float32)))
    return nnx.value_and_grad(loss)(layer)

  (y_low, g_low), (y_full, g_full) = run(low), run(full)
  assert float(y_low) == float(y_full)
  for side in ('q_in', 'q_out'):
    got, want = getattr(g_low, side)[...], getattr(g_full, side)[...]
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(want.astype(jnp.bfloat16), np.float32))
    assert float(jnp.max(jnp.abs(want))) > 0


@pytest.mark.parametrize('bad', ['float16', 'int8', 'half-precision'])
def test_an_unsupported_generator_dtype_is_refused_by_name(bad):
  with pytest.raises(ValueError, match=f"generator_dtype must be one of .*got '{bad}'"):
    poetx_jax.POETLinear(16, 16, block_size=8, generator_dtype=bad, rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_a_run_with_bfloat16_generators_trains_as_the_float32_one(keys):
  """The app's train step through a merge: the generators and their moments
  are bfloat16 (half the generators' bytes); losses and the merged bases
  stay within bfloat16 rounding of the float32-generator run."""
  cfg = TrainConfig(model='tiny', model_overrides={'layers': 1, 'mlp': 64}, optimizer='poetx',
                    block_size=32, warmup=1, dtype='float32', merge_every=3)
  tokens = jax.random.randint(keys(), (2, 13), 0, 300)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}

  def train(generator_dtype):
    losses, model, opt = app_steps(dataclasses.replace(cfg, generator_dtype=generator_dtype),
                                   300, batch, 5)
    gens = nnx.state(model, poetx_jax.POETParam)
    moments = [x for path, x in jax.tree.leaves_with_path(nnx.state(opt, nnx.OptState))
               if any(getattr(k, 'key', None) in ('q_in', 'q_out') for k in path)]
    return losses, gens, moments, nnx.state(model, poetx_jax.linear.FrozenKernel)

  losses, gens, moments, bases = train('bfloat16')
  want_losses, want_gens, want_moments, want_bases = train('float32')
  assert {x.dtype for x in jax.tree.leaves(gens)} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(want_gens)} == {jnp.dtype(jnp.float32)}
  assert len(moments) == 2 * len(jax.tree.leaves(gens))  # Adam's two per generator array
  assert {x.dtype for x in moments} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in want_moments} == {jnp.dtype(jnp.float32)}
  nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  assert nbytes(gens) * 2 == nbytes(want_gens)
  assert losses[-1] < losses[0]
  np.testing.assert_allclose(losses, want_losses, rtol=2e-3)
  # After five updates (one merge at 3): the generators of the second cycle
  # (two Adam steps, nearly the sign of the gradient, so an entry whose
  # gradient rounds across zero moves the other way) within 6%, and the
  # merged bases within a few bfloat16 roundings.
  assert rel_err(jax.tree.leaves(gens)[0].astype(jnp.float32),
                 jax.tree.leaves(want_gens)[0]) < 6e-2
  for got, want in zip(jax.tree.leaves(bases), jax.tree.leaves(want_bases)):
    assert rel_err(got, want) < 1e-3
