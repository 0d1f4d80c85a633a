"""make_train_step: merges decided on the host, optimizers without POET-X,
state kept in the model and optimizer objects."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import poetx_jax

from conftest import SMALL, randomize_generators


def _model(seed=0):
  mlp = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(seed)), nnx.relu,
                       nnx.Linear(32, 8, rngs=nnx.Rngs(seed + 1)))
  return poetx_jax.poetize(mlp, block_size=8, rngs=nnx.Rngs(seed + 2))


def _optimizer(model, merge_every, accum=1):
  tx = poetx_jax.poetx_partition(model, poetx_jax.poetx(1e-2, merge_every=merge_every),
                                 optax.adam(1e-2))
  if accum > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=accum)
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def _loss(model, batch):
  return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def _batches(n):
  keys = jax.random.split(jax.random.key(3), n)
  return [(jax.random.normal(k, (4, 16)), jnp.sin(jax.random.normal(k, (4, 8))))
          for k in keys]


def _train(merge_every_host, merge_every=3, accum=1, calls=10):
  model = _model()
  opt = _optimizer(model, merge_every, accum)
  merges = []
  step = poetx_jax.make_train_step(_loss, merge_every=merge_every_host,
                                   on_merge=lambda s, e: merges.append(s))
  losses = [float(step(model, opt, b)) for b in _batches(calls)]
  return model, losses, merges


@pytest.mark.slow
@pytest.mark.parametrize('accum', [1, 2])
def test_host_clock_merges_where_the_optimizer_says(accum):
  """Counting calls on the host gives the merges, losses and parameters of
  reading the optimizer's verdict back after every call."""
  host_model, host_losses, host_merges = _train(3 * accum, accum=accum)
  flag_model, flag_losses, flag_merges = _train(None, accum=accum)
  assert host_merges == flag_merges == [3 * accum * i for i in (1, 2, 3) if 3 * accum * i <= 10]
  assert host_losses == flag_losses
  chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(host_model)),
                              nnx.to_pure_dict(nnx.state(flag_model)))


def test_a_wrong_cycle_length_is_caught():
  with pytest.raises(RuntimeError, match='merge_every=2.*disagree.*call 2'):
    _train(2, merge_every=3)


@pytest.mark.slow
def test_clock_resyncs_when_the_optimizer_counter_is_restored():
  """After the optimizer's counter is set by something else (a checkpoint
  restore), the host clock reads it again instead of counting on."""
  model = _model()
  opt = _optimizer(model, 4)
  merges = []
  step = poetx_jax.make_train_step(_loss, merge_every=4, on_merge=lambda s, e: merges.append(s))
  batches = _batches(8)
  for b in batches[:3]:
    step(model, opt, b)
  saved = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(opt)))  # donated later: copy
  for b in batches[3:6]:
    step(model, opt, b)
  assert merges == [4]
  state = nnx.state(opt)
  nnx.replace_by_pure_dict(state, saved)  # back to 3 calls done
  nnx.update(opt, state)
  step(model, opt, batches[6])  # call 4 again: a merge is due
  assert merges == [4, 4]


def test_optimizer_without_poetx_is_a_plain_step():
  """AdamW on a plain model: the same update as nnx's own, never a merge."""
  def plain():
    return nnx.Sequential(nnx.Linear(16, 8, rngs=nnx.Rngs(0)))

  a, b = plain(), plain()
  opt_a = nnx.Optimizer(a, optax.adamw(1e-2), wrt=nnx.Param)
  opt_b = nnx.Optimizer(b, optax.adamw(1e-2), wrt=nnx.Param)
  step = poetx_jax.make_train_step(_loss)

  @nnx.jit
  def reference(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(_loss)(model, batch)
    optimizer.update(model, grads)
    return loss

  for batch in _batches(4):
    np.testing.assert_allclose(float(step(a, opt_a, batch)), float(reference(b, opt_b, batch)),
                               rtol=1e-6)
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(a)), nnx.to_pure_dict(nnx.state(b)),
                              rtol=1e-5, atol=1e-7)
  assert int(opt_a.step[...]) == 4


@pytest.mark.slow
def test_state_stays_in_the_objects_and_other_objects_rebind():
  """The model and optimizer objects hold the state after each call (what
  a checkpoint or an evaluation reads); a second model trains on its own."""
  one, two = _model(0), _model(10)
  randomize_generators(one.layers[0], jax.random.key(1))
  opt_one, opt_two = _optimizer(one, 100), _optimizer(two, 100)
  step = poetx_jax.make_train_step(_loss, merge_every=100)
  batch = _batches(1)[0]
  before = np.asarray(one.layers[0].q_in[...])
  step(one, opt_one, batch)
  assert int(opt_one.step[...]) == 1 and not np.array_equal(one.layers[0].q_in[...], before)
  q_two = np.asarray(two.layers[0].q_in[...])
  step(two, opt_two, batch)
  assert int(opt_two.step[...]) == 1 and int(opt_one.step[...]) == 1
  assert not np.array_equal(two.layers[0].q_in[...], q_two)
  np.testing.assert_allclose(float(_loss(one, batch)), float(nnx.jit(_loss)(one, batch)))


@pytest.mark.slow
@pytest.mark.parametrize('merge_every', [3, None], ids=['poetx', 'adam'])
def test_grad_norm_is_returned_without_changing_the_training(merge_every):
  """grad_norm=True returns the gradients' global norm beside each loss; the
  losses and the trained state are bitwise those of the plain step."""
  def train(grad_norm):
    model = _model()
    opt = (_optimizer(model, merge_every) if merge_every else
           nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
    step = poetx_jax.make_train_step(_loss, merge_every=merge_every, grad_norm=grad_norm)
    out, norms = [], []
    for b in _batches(7):
      if grad_norm:
        grads = jax.tree.leaves(nnx.grad(_loss)(model, b))  # before the step updates it
        want = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in grads))
        loss, norm = step(model, opt, b)
        norms.append((float(norm), float(want)))
      else:
        loss = step(model, opt, b)
      out.append(float(loss))
    return out, norms, nnx.to_pure_dict(nnx.state(model))

  plain_losses, _, plain_state = train(False)
  losses, norms, state = train(True)
  assert losses == plain_losses
  chex.assert_trees_all_equal(state, plain_state)
  for got, want in norms:
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.slow
def test_compiler_options_reach_the_update_program(tmp_path):
  """``compiler_options`` are XLA's options of the update program: an unknown
  one is refused by XLA by name, a known one is in the compiled program's
  options; the app's --memory-slop sets XLA's scheduling memory limit there."""
  import glob
  from poetx_jax.pretrain import factories
  from poetx_jax.pretrain.config import TrainConfig
  from poetx_jax.pretrain.plan import make_plan
  model = nnx.Sequential(nnx.Linear(16, 8, rngs=nnx.Rngs(0)))
  opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  bogus = poetx_jax.make_train_step(_loss, compiler_options={'xla_no_such_option': 1})
  with pytest.raises(Exception, match='xla_no_such_option'):
    bogus(model, opt, _batches(1)[0])

  cfg = TrainConfig(model='tiny', model_overrides=SMALL,
                    vocab_size=300, seq_len=16, batch_size=2, memory_slop=6, dtype='float32')
  plan = make_plan(cfg, 300)
  model, opt = factories.abstract_state(plan)
  tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  factories.make_step(plan).lower(model, opt, {'inputs': tokens, 'targets': tokens}).compile(
      {'xla_dump_to': str(tmp_path)})
  options, = glob.glob(str(tmp_path / '*.debug_options'))
  assert 'xla_gpu_memory_limit_slop_factor: 6' in open(options).read()


def _accumulated_and_multisteps(dtype, updates=4, k=3):
  """The same micro-batches through make_train_step(accumulate=k) (one call
  an update) and through optax.MultiSteps (one call a micro-batch): the
  final state of each and the merges' optimizer steps."""
  batches = [jax.tree.map(lambda a: a.astype(dtype), b) for b in _batches(updates * k)]
  out = []
  for accumulate in (k, 1):
    model = _model()
    model = jax.tree.map(lambda a: a.astype(dtype) if a.dtype == jnp.float32 else a, model)
    opt = _optimizer(model, merge_every=2, accum=1 if accumulate > 1 else k)
    merges = []
    step = poetx_jax.make_train_step(_loss, merge_every=2 if accumulate > 1 else 2 * k,
                                     accumulate=accumulate, on_merge=lambda s, e: merges.append(s))
    if accumulate > 1:
      for u in range(updates):
        step(model, opt, jax.tree.map(lambda *a: jnp.stack(a), *batches[u * k:(u + 1) * k]))
    else:
      for b in batches:
        step(model, opt, b)
    out.append((nnx.to_pure_dict(nnx.state(model)), len(merges)))
  return out


@pytest.mark.slow
def test_accumulated_update_is_the_multisteps_update_in_float64():
  """accumulate=k applies the mean of k micro-batches' gradients in one
  update, as optax.MultiSteps does over k calls: equal to float64 rounding
  (one update), and over four updates with two merges (which draw the same
  permutations, and round their products in float32) to float32 rounding."""
  with jax.enable_x64(True):
    (acc, _), (multi, _) = _accumulated_and_multisteps(jnp.float64, updates=1)
    assert any(x.dtype == jnp.float64 for x in jax.tree.leaves(acc))
    chex.assert_trees_all_close(acc, multi, rtol=1e-12, atol=1e-12)
  (acc, acc_merges), (multi, multi_merges) = _accumulated_and_multisteps(jnp.float32)
  assert acc_merges == multi_merges == 2
  chex.assert_trees_all_close(acc, multi, rtol=1e-5, atol=1e-5)


def test_accumulate_refuses_bad_counts_and_aux():
  with pytest.raises(ValueError, match=r'accumulate must be an int >= 1.*got 0'):
    poetx_jax.make_train_step(_loss, accumulate=0)
  with pytest.raises(ValueError, match='has_aux'):
    poetx_jax.make_train_step(lambda m, b: (_loss(m, b), {}), has_aux=True, accumulate=2)


class _Counted(nnx.Module):
  """A linear map whose loss counts the micro-batches it has seen."""

  def __init__(self):
    self.linear = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    self.seen = nnx.BatchStat(jnp.zeros((), jnp.int32))


def test_accumulated_micro_batches_carry_the_state_the_loss_writes():
  """On one device the loss may write variables other than Params (RNG
  counters, say): each micro-batch sees the previous one's, and the update
  keeps the last."""
  model = _Counted()
  opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  def loss(m, b):
    m.seen[...] = m.seen[...] + 1
    return jnp.mean((m.linear(b) * m.seen[...]) ** 2)

  step = poetx_jax.make_train_step(loss, accumulate=3)
  step(model, opt, jnp.ones((3, 5, 4)))
  assert int(model.seen[...]) == 3
  step(model, opt, jnp.ones((3, 5, 4)))
  assert int(model.seen[...]) == 6


def test_accumulate_refuses_a_batch_of_another_length():
  model = _model()
  opt = _optimizer(model, merge_every=2)
  step = poetx_jax.make_train_step(_loss, accumulate=3)
  x, y = _batches(1)[0]
  with pytest.raises(ValueError, match=r'accumulate=3.*leading axis of 3.*got leading lengths \[4\]'):
    step(model, opt, (x, y))  # one micro-batch of 4 rows, not 3 stacked


def test_fully_sharded_refusals():
  mesh = poetx_jax.sharding.make_mesh()
  with pytest.raises(ValueError, match='exclude each other'):
    poetx_jax.make_train_step(_loss, data_parallel=mesh, fully_sharded=mesh)
  with pytest.raises(ValueError, match='fully_sharded does not take has_aux'):
    poetx_jax.make_train_step(lambda m, b: (_loss(m, b), {}), has_aux=True,
                              fully_sharded=mesh)
  other = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('x',))
  with pytest.raises(ValueError, match=r"fully_sharded takes a mesh of axes \('data', 'fsdp'\)"):
    poetx_jax.make_train_step(_loss, fully_sharded=other)


@pytest.mark.parametrize('accumulate', [1, 3])
def test_fully_sharded_on_one_device_is_the_plain_step(accumulate):
  """The per-device gradients of fully_sharded (a vmap over a device axis
  of length 1, the sums reduced to each parameter's sharding) give the
  plain step's losses and parameters, merges included, to float32
  rounding."""
  batches = _batches(4 * accumulate)
  if accumulate > 1:  # micro-batches stacked on a leading axis
    batches = [jax.tree.map(lambda *xs: jnp.stack(xs), *batches[i:i + accumulate])
               for i in range(0, len(batches), accumulate)]

  def train(**kw):
    model = _model()
    opt = _optimizer(model, merge_every=2)
    step = poetx_jax.make_train_step(_loss, merge_every=2, accumulate=accumulate, **kw)
    losses = [float(step(model, opt, b)) for b in batches]
    return losses, jax.tree.leaves(nnx.state(model, nnx.Param))

  ref_losses, ref = train()
  losses, got = train(fully_sharded=poetx_jax.sharding.make_mesh())
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  for a, b in zip(got, ref, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
