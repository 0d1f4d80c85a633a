"""What a run's plan builds: the model (converted layer by layer) and the
optimizer's POET-X step size."""

import dataclasses

import chex
import numpy as np
import pytest
from flax import nnx

from poetx_jax.pretrain import factories
from poetx_jax.pretrain import loss as loss_lib
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.plan import make_plan


@pytest.mark.slow
def test_default_poet_lr_shrinks_with_the_block_size():
  """poet_lr=None trains with min(5e-3, 0.25 / B): what an explicit step of
  that value gives, not what 5e-3 gives."""
  import jax.numpy as jnp
  import poetx_jax
  assert poetx_jax.default_poet_lr(16) == 5e-3 and poetx_jax.default_poet_lr(256) == 0.25 / 256
  cfg = TrainConfig(model='tiny', model_overrides={'layers': 1, 'kv_heads': 4}, block_size=64,
                    warmup=1,
                    dtype='float32')
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 300, (2, 16)), jnp.int32)
  batch = {'inputs': tokens, 'targets': tokens}

  def q_after_two_updates(poet_lr):
    plan = make_plan(dataclasses.replace(cfg, poet_lr=poet_lr), 300)
    model = factories.build_model(plan)
    opt = factories.build_optimizer(plan, model)
    # One jitted update (eagerly, op by op, this test took 16 s on a CPU).
    update = nnx.jit(lambda m, o, b: o.update(m, nnx.grad(loss_lib.training_loss)(m, b)))
    for _ in range(2):  # the first update is at learning rate 0 (warmup)
      update(model, opt, batch)
    return np.asarray(model.layers[0].mlp.up_proj.q_in[...])

  q = q_after_two_updates(None)
  assert np.abs(q).max() > 0
  np.testing.assert_array_equal(q, q_after_two_updates(0.25 / 64))
  assert not np.allclose(q, q_after_two_updates(5e-3))


@pytest.mark.parametrize('quantize', [None, 'int8'])
def test_poet_model_is_built_layer_by_layer_with_the_whole_model_result(quantize):
  """build_model converts each decoder layer as it is built (no dense copy
  resident) and gives exactly poetize(init_model(...)) with the run's seeds."""
  import jax.numpy as jnp
  import poetx_jax
  from poetx_jax.models import init_model
  cfg = TrainConfig(model='tiny', optimizer='poetx', quantize=quantize, seed=3,
                    model_overrides={'layers': 2})
  plan = make_plan(cfg, 512)
  mc = plan.model
  built = nnx.to_flat_state(nnx.state(factories.build_model(plan)))
  eager = poetx_jax.poetize(
      init_model(mc, seed=3, dtype=jnp.dtype(plan.dtype), param_dtype=jnp.float32),
      block_size=mc.block_size, rngs=nnx.Rngs(4), quantize=quantize)
  eager = nnx.to_flat_state(nnx.state(eager))
  assert [p for p, _ in built] == [p for p, _ in eager]
  chex.assert_trees_all_equal({str(p): np.asarray(v[...]) for p, v in built},
                              {str(p): np.asarray(v[...]) for p, v in eager})


def test_the_poet_eps_options_reach_the_poetx_transform(monkeypatch):
  """--poet-eps and --poet-eps-placement are the poetx transform's eps and
  eps_placement; left unset, its defaults (1e-8 on the corrected root)."""
  import poetx_jax
  seen = []
  real = poetx_jax.poetx

  def spy(*args, **kwargs):
    seen.append(kwargs)
    return real(*args, **kwargs)

  monkeypatch.setattr(poetx_jax, 'poetx', spy)
  for options, want in ((dict(), (1e-8, 'corrected')),
                        (dict(poet_eps=1e-6, poet_eps_placement='raw'), (1e-6, 'raw'))):
    cfg = TrainConfig(model='tiny', optimizer='poetx', dtype='float32', **options)
    factories.abstract_state(make_plan(cfg, 512))
    assert (seen[-1]['eps'], seen[-1]['eps_placement']) == want


@pytest.mark.slow
def test_adamw_in_bfloat16_keeps_weights_and_moments_in_bfloat16():
  """--optimizer adamw --param-dtype bfloat16 is AdamW as the published
  POET-X's scripts train it: every weight and both Adam moments in bfloat16,
  each update rounded to the nearest bfloat16 (a step below half a unit of a
  weight is lost)."""
  import jax
  import jax.numpy as jnp
  cfg = TrainConfig(model='tiny', optimizer='adamw', param_dtype='bfloat16', weight_decay=0.0,
                    lr=1e-3, warmup=0, clip=0.0)
  model, opt = factories.build_state(make_plan(cfg, 512))
  floats = [x for x in jax.tree.leaves(nnx.state((model, opt))) if jnp.issubdtype(x.dtype,
                                                                                jnp.floating)]
  assert floats and all(x.dtype == jnp.bfloat16 for x in floats)
  before = model.embed_tokens.embedding[...]
  grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
  opt.update(model, grads)  # Adam's first step: lr * sign(g) on every weight
  after = model.embed_tokens.embedding[...]
  assert after.dtype == jnp.bfloat16
  step = jnp.asarray(-1e-3, jnp.bfloat16).astype(jnp.float32)  # the step, in bfloat16
  want = (before.astype(jnp.float32) + step).astype(jnp.bfloat16)  # the sum rounded to nearest
  np.testing.assert_array_equal(np.asarray(after, np.float32), np.asarray(want, np.float32))
  assert not bool(jnp.any(after == before))  # steps above half a unit move the weight
  assert bool(jnp.all(model.norm.weight[...] == 1))  # 1 - 1e-3 rounds back to 1: step lost
