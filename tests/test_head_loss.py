"""The head and loss in pieces (loss.head_loss, --loss-chunk): the
loss and gradients of the whole batch at once, without its logits held."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import app_steps, assert_trees_rel_close
from poetx_jax.linear import POETParam
from poetx_jax.models import get_config
from poetx_jax.pretrain import loss as loss_lib
from poetx_jax.pretrain.config import TrainConfig


def _batch(keys, b, t, vocab):
  inputs = jax.random.randint(keys(), (b, t), 0, vocab)
  targets = jax.random.randint(keys(), (b, t), -1, vocab)  # about 1/vocab masked ...
  targets = targets.at[0, :3].set(-1)  # ... and a few surely
  return {'inputs': inputs, 'targets': targets}


def _value_and_grad(model, batch, chunk):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  f = lambda p: loss_lib.training_loss(nnx.merge(graphdef, p, rest), batch, chunk)
  return jax.jit(jax.value_and_grad(f))(params)


# Each piece length (3: pieces padded; 10: one piece; 16: one longer than T)
# in both dtypes, each dtype tied and untied.
@pytest.mark.slow
@pytest.mark.parametrize('chunk,dtype,tol,tie', [
    (3, jnp.float32, 2e-6, False), (3, jnp.bfloat16, 1e-2, True),
    (10, jnp.float32, 2e-6, True), (10, jnp.bfloat16, 1e-2, False),
    (16, jnp.float32, 2e-6, False), (16, jnp.bfloat16, 1e-2, True)])
def test_pieces_give_the_loss_and_gradients_of_the_whole_batch(keys, tie, dtype, tol, chunk):
  cfg = dataclasses.replace(get_config('tiny'), tie_embeddings=tie, layers=1)
  model = cfg.build(dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(int(jax.random.bits(keys()))))
  batch = _batch(keys, 2, 10, cfg.vocab_size)
  loss, grads = _value_and_grad(model, batch, chunk)
  want_loss, want_grads = _value_and_grad(model, batch, 0)
  np.testing.assert_allclose(float(loss), float(want_loss),
                             rtol=1e-6 if dtype == jnp.float32 else 1e-4)
  assert_trees_rel_close(grads, want_grads, tol)


@pytest.mark.slow
def test_a_poetx_run_with_loss_chunk_trains_as_the_whole_batch_does(keys):
  """The app's train step (make_step) with --loss-chunk: the same losses and
  the same model after updates that include a merge, within float32 error.
  The generators' first update after the merge is Adam's first (its moments
  reset), ``g / |g|``: where a gradient is ~0 rounding can flip its sign, so
  a handful of a generator's elements may move by up to a step (as in
  test_sharding); each generator is >= 99% within 1e-4 of its largest."""
  cfg = TrainConfig(model='tiny', model_overrides={'layers': 1, 'mlp': 64}, optimizer='poetx',
                    block_size=32, warmup=1, dtype='float32', merge_every=2)
  batch = _batch(keys, 2, 12, 300)

  def train(loss_chunk):
    losses, model, _ = app_steps(dataclasses.replace(cfg, loss_chunk=loss_chunk), 300, batch, 3)
    return (losses, nnx.state(model, POETParam),
            nnx.state(model, nnx.All(nnx.Param, nnx.Not(POETParam))))

  losses, generators, params = train(5)
  want_losses, want_generators, want_params = train(0)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  assert losses[-1] < losses[0]
  assert_trees_rel_close(params, want_params, 1e-5)
  chex.assert_trees_all_equal_comparator(
      lambda a, b: np.mean(np.abs(a - b) <= 1e-4 * np.abs(b).max()) >= 0.99,
      lambda a, b: f'{np.mean(np.abs(a - b) > 1e-4 * np.abs(b).max()):.1%} of the elements off',
      generators, want_generators)
  assert len(jax.tree.leaves(generators)) == 14  # the 7 projections' q_in and q_out


@pytest.mark.slow
def test_pieces_do_not_hold_the_logits_of_the_whole_batch(keys):
  """The compiled gradient's temporaries shrink by most of the (B, T, V)
  float32 logits and their softmax when the loss goes 8 positions at a time."""
  cfg = dataclasses.replace(get_config('tiny'), layers=1)
  model = cfg.build(rngs=nnx.Rngs(0))
  batch = _batch(keys, 4, 64, cfg.vocab_size)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def temp_bytes(chunk):
    f = lambda p: loss_lib.training_loss(nnx.merge(graphdef, p, rest), batch, chunk)
    return jax.jit(jax.grad(f)).lower(params).compile().memory_analysis().temp_size_in_bytes

  logits = 4 * 64 * cfg.vocab_size * 4
  whole, pieces = temp_bytes(0), temp_bytes(8)
  assert whole >= 2 * logits, (whole, logits)  # the logits and their softmax, at least
  assert pieces <= whole - 1.5 * logits, (pieces, whole, logits)
