"""poetize / merge / unpoetize on whole models."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import randomize_generators, rel_err
import poetx_jax


class Tiny(nnx.Module):
  """Two blocks of MLP plus an lm_head: paths like 'blocks/0/up'."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(50, 32, rngs=rngs)
    self.blocks = nnx.List([
        nnx.Dict(up=nnx.Linear(32, 44, rngs=rngs), down=nnx.Linear(44, 32, rngs=rngs))
        for _ in range(2)])
    self.lm_head = nnx.Linear(32, 50, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    h = self.embed(tokens)
    for blk in self.blocks:
      h = h + blk['down'](jax.nn.gelu(blk['up'](h)))
    return self.lm_head(h)


def _randomize_all(model, key, scale=0.1):
  for i, (_, layer) in enumerate(poetx_jax.poet_layers(model)):
    randomize_generators(layer, jax.random.fold_in(key, i), scale)


@pytest.mark.slow
def test_poetize_replaces_intended_layers(keys):
  base = Tiny(nnx.Rngs(0))
  model = poetx_jax.poetize(base, block_size=8, rngs=nnx.Rngs(1))
  paths = [p for p, _ in poetx_jax.poet_layers(model)]
  assert paths == ['blocks/0/down', 'blocks/0/up', 'blocks/1/down', 'blocks/1/up']
  assert type(model.lm_head) is nnx.Linear and type(model.embed) is nnx.Embed
  assert all(type(b['up']) is nnx.Linear for b in base.blocks)  # input untouched
  tokens = jax.random.randint(keys(), (2, 7), 0, 50)
  assert rel_err(model(tokens), base(tokens)) < 1e-6
  # Same state paths as the model it replaced (plus the POET variables).
  base_paths = {p for p, _ in nnx.to_flat_state(nnx.state(base, nnx.Param))}
  new_paths = {p for p, _ in nnx.to_flat_state(nnx.state(model))}
  assert base_paths <= new_paths


@pytest.mark.slow
def test_the_input_and_an_unpoetized_copy_survive_training_with_donation(keys):
  """Unless consume, poetize's result and unpoetize's share no array with
  their input: a donating train step of the POET model leaves both usable and
  unchanged (the embedding, head and biases were shared before)."""
  base = Tiny(nnx.Rngs(0))
  base.blocks[0]['up'].bias[...] = jax.random.normal(keys(), (44,))
  tokens = jax.random.randint(keys(), (2, 7), 0, 50)
  want = base(tokens)
  model = poetx_jax.poetize(base, block_size=8, rngs=nnx.Rngs(1))
  optimizer = nnx.Optimizer(model, poetx_jax.poetx_partition(
      model, poetx_jax.poetx(1e-2), optax.sgd(1e-1)), wrt=nnx.Param)
  step = poetx_jax.make_train_step(
      lambda m, t: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(m(t), t)))
  step(model, optimizer, tokens)
  dense = poetx_jax.unpoetize(model)
  snapshot = dense(tokens)
  step(model, optimizer, tokens)
  np.testing.assert_array_equal(base(tokens), want)
  np.testing.assert_array_equal(dense(tokens), snapshot)
  assert rel_err(model(tokens), snapshot) > 1e-4  # the POET model trained on


def test_poetize_keeps_values_that_are_not_arrays_as_they_are():
  """Only JAX arrays are copied away from the input: a Variable's text, int
  or numpy value stays what it was."""
  base = Tiny(nnx.Rngs(0))
  base.note = nnx.Variable('gelu')
  base.count = nnx.Variable(3)
  base.table = nnx.Variable(np.arange(4))
  model = poetx_jax.poetize(base, block_size=8, rngs=nnx.Rngs(1))
  assert model.note.get_value() == 'gelu' and type(model.count.get_value()) is int
  assert type(model.table.get_value()) is np.ndarray


def test_poetize_consume_frees_converted_kernels(keys):
  tokens = jax.random.randint(keys(), (2, 7), 0, 50)
  want = poetx_jax.poetize(Tiny(nnx.Rngs(0)), block_size=8, rngs=nnx.Rngs(1))(tokens)
  base = Tiny(nnx.Rngs(0))
  model = poetx_jax.poetize(base, block_size=8, rngs=nnx.Rngs(1), consume=True)
  assert all(b[n].kernel[...].is_deleted() for b in base.blocks for n in ('up', 'down'))
  assert not base.lm_head.kernel[...].is_deleted()  # excluded: shared, kept
  np.testing.assert_array_equal(model(tokens), want)


def test_poetize_options_and_errors():
  base = Tiny(nnx.Rngs(0))
  model = poetx_jax.poetize(base, block_size=8, rngs=nnx.Rngs(1), exclude=('up', 'lm_head'),
                            normalize_rows=True, mode='mem')
  assert [p for p, _ in poetx_jax.poet_layers(model)] == ['blocks/0/down', 'blocks/1/down']
  layer = model.blocks[0]['down']
  assert layer.mode == 'mem'
  np.testing.assert_allclose(jnp.linalg.norm(layer.kernel[...], axis=0), 1.0, rtol=1e-5)
  with pytest.raises(ValueError, match="cannot poetize layer 'blocks/0/down'.*larger than"):
    poetx_jax.poetize(base, block_size=40, rngs=nnx.Rngs(1))


def test_poetize_keeps_sharding_annotations_and_refuses_custom_products():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('model',))
  dense = nnx.Linear(32, 16, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(
      nnx.initializers.lecun_normal(), (None, 'model'), mesh=mesh),
      bias_init=nnx.with_partitioning(nnx.initializers.zeros, ('model',), mesh=mesh))
  layer = poetx_jax.poetize(nnx.Sequential(dense), block_size=8, rngs=nnx.Rngs(1)).layers[0]
  assert layer.kernel.get_metadata()['out_sharding'] == (None, 'model')
  assert layer.bias.get_metadata()['out_sharding'] == ('model',)
  assert layer.kernel.get_metadata()['mesh'] is mesh
  # A stack of layers (a kernel with a leading axis) alike.
  stack = nnx.Linear(32, 16, rngs=nnx.Rngs(0))
  stack.kernel = nnx.Param(jnp.stack([stack.kernel[...]] * 3), out_sharding=(None, None, 'model'),
                           mesh=mesh)
  stack.bias = nnx.Param(jnp.zeros((3, 16)), out_sharding=(None, 'model'), mesh=mesh)
  layer = poetx_jax.poetize(nnx.Sequential(stack), block_size=8, rngs=nnx.Rngs(1)).layers[0]
  assert layer.stack_shape == (3,)
  assert layer.kernel.get_metadata()['out_sharding'] == (None, None, 'model')
  assert layer.bias.get_metadata()['out_sharding'] == (None, 'model')
  for option in (dict(preferred_element_type=jnp.float32),
                 dict(dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k))):
    for stacked in (False, True):
      custom = nnx.Linear(32, 16, rngs=nnx.Rngs(0), **option)
      if stacked:
        custom.kernel = nnx.Param(jnp.stack([custom.kernel[...]] * 3))
        custom.bias = nnx.Param(jnp.zeros((3, 16)))
      with pytest.raises(ValueError, match=f"layer 'layers/0'.*option\\(s\\) {next(iter(option))} set"):
        poetx_jax.poetize(nnx.Sequential(custom), block_size=8, rngs=nnx.Rngs(1))


@pytest.mark.slow
def test_merge_preserves_function_and_resets(keys):
  model = poetx_jax.poetize(Tiny(nnx.Rngs(0)), block_size=8, rngs=nnx.Rngs(1))
  _randomize_all(model, keys())
  tokens = jax.random.randint(keys(), (3, 9), 0, 50)
  before = model(tokens)
  layers = [l for _, l in poetx_jax.poet_layers(model)]
  perms = [(l.perm_in[...], l.perm_out[...]) for l in layers]
  kernels = [l.effective_kernel() for l in layers]
  poetx_jax.merge(model, rngs=nnx.Rngs(7))
  assert rel_err(model(tokens), before) < 1e-5
  for l, (p_in, p_out), k in zip(layers, perms, kernels):
    assert not l.q_in[...].any() and not l.q_out[...].any()
    assert (l.perm_in[...] != p_in).any() and (l.perm_out[...] != p_out).any()
    assert rel_err(l.effective_kernel(), k) < 1e-6


@pytest.mark.slow
def test_merge_reports_the_factors_orthogonality_error(keys):
  """merge returns the largest ||G^T G - I||_F / sqrt(B) of the factors it
  merged, over every block of every layer: 0 at Q = 0, the series' small
  truncation error for small Q, large once ||Q|| nears 1; also under jit."""
  model = poetx_jax.poetize(Tiny(nnx.Rngs(0)), block_size=8, rngs=nnx.Rngs(1))
  layers = [l for _, l in poetx_jax.poet_layers(model)]
  assert float(poetx_jax.merge(model, rngs=jax.random.key(0))) == 0.0
  _randomize_all(model, keys(), scale=0.3)  # truncation error well above rounding
  want = max(float(l.orthogonality_error()) for l in layers)
  g_in, g_out = (np.asarray(g, np.float64) for g in poetx_jax.ops.rotation_blocks_pair(
      layers[2].q_in[...], layers[2].q_out[...], layers[2].in_features,
      layers[2].out_features, 8, layers[2].terms))
  direct = max(np.linalg.norm(g.swapaxes(-1, -2) @ g - np.eye(8), axis=(-2, -1)).max()
               for g in (g_in, g_out)) / np.sqrt(8)
  np.testing.assert_allclose(float(layers[2].orthogonality_error()), direct, rtol=1e-2)
  twin = nnx.clone(model)
  got = float(poetx_jax.merge(model, rngs=jax.random.key(1)))
  assert 1e-4 < got < 1e-1 and got == pytest.approx(want, rel=1e-3)
  assert float(nnx.jit(lambda m: poetx_jax.merge(m, rngs=jax.random.key(1)))(twin)) == (
      pytest.approx(want, rel=1e-3))
  for l in layers:  # generators far outside the series' convergence region
    l.q_in[...] = 5 * jnp.ones_like(l.q_in[...])
  assert float(poetx_jax.merge(model, rngs=jax.random.key(2))) > 1.0


@pytest.mark.parametrize('key_traced', [True, False], ids=['key-argument', 'key-closed-over'])
def test_merge_under_jit_matches_eager(keys, key_traced):
  model = poetx_jax.poetize(Tiny(nnx.Rngs(0)), block_size=8, rngs=nnx.Rngs(1))
  _randomize_all(model, keys())
  twin = nnx.clone(model)
  key = jax.random.key(3)
  poetx_jax.merge(model, rngs=key)
  if key_traced:
    nnx.jit(lambda m, k: poetx_jax.merge(m, rngs=k))(twin, key)
  else:  # a concrete key under jit: the traced model decides that it traces inline
    nnx.jit(lambda m: poetx_jax.merge(m, rngs=key))(twin)
  assert not any(l.q_in[...].any() for _, l in poetx_jax.poet_layers(twin))  # it merged
  chex.assert_trees_all_close(nnx.to_pure_dict(nnx.state(twin)),
                              nnx.to_pure_dict(nnx.state(model)), rtol=1e-6, atol=1e-7)


def test_merge_compiles_one_program_per_layer_shape(keys):
  from poetx_jax import cycle
  model = poetx_jax.poetize(Tiny(nnx.Rngs(0)), block_size=8, rngs=nnx.Rngs(1))
  _randomize_all(model, keys())
  cycle._merge_program.cache_clear()
  poetx_jax.merge(model, rngs=jax.random.key(0))
  poetx_jax.merge(model, rngs=jax.random.key(1))
  info = cycle._merge_program.cache_info()
  assert (info.misses, info.hits) == (2, 6)  # 'up' and 'down' shapes; 4 layers x 2 merges


def test_merge_programs_gpu_options_are_xla_options(keys, monkeypatch):
  """The GPU merge programs' compiler options are options XLA knows (a wrong
  name fails the compile); they leave the merge's result as it is on the CPU."""
  from poetx_jax import cycle
  model = poetx_jax.poetize(Tiny(nnx.Rngs(0)), block_size=8, rngs=nnx.Rngs(1))
  _randomize_all(model, keys())
  twin = nnx.clone(model)
  poetx_jax.merge(model, rngs=jax.random.key(0))
  cycle._merge_program.cache_clear()
  monkeypatch.setattr(cycle, 'on_gpu', lambda: True)  # its merge programs' options only
  try:
    poetx_jax.merge(twin, rngs=jax.random.key(0))
  finally:
    cycle._merge_program.cache_clear()
  chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(twin)),
                              nnx.to_pure_dict(nnx.state(model)))
  monkeypatch.setitem(cycle.MERGE_GPU_COMPILER_OPTIONS, 'xla_gpu_no_such_option', 0)
  with pytest.raises(Exception, match='no_such_option'):
    cycle._merge_program.cache_clear()
    poetx_jax.merge(twin, rngs=jax.random.key(1))
  cycle._merge_program.cache_clear()


def _by_path(model):
  return {poetx_jax.convert.path_str(p): n for p, n in nnx.iter_graph(model)}


@pytest.mark.slow
def test_unpoetize_gives_plain_linears_computing_the_same_function(keys):
  """unpoetize gives plain nnx.Linear layers only (no POET variables, the
  base model's state structure) that compute what the POET layers compute,
  layer by layer on random inputs and end to end: with random generators,
  right after a merge (new W0 and permutations, Q = 0) and with random
  generators again."""
  base = Tiny(nnx.Rngs(0))
  for blk in base.blocks:  # biases that matter (they start at zero)
    for lin in (blk['up'], blk['down']):
      lin.bias[...] = jax.random.normal(keys(), lin.bias.shape)
  model = poetx_jax.poetize(base, block_size=8, rngs=nnx.Rngs(1))
  tokens = jax.random.randint(keys(), (3, 9), 0, 50)
  base_state = nnx.to_pure_dict(nnx.state(base))
  for stage in ('rotated', 'merged', 'rotated again'):
    if stage == 'merged':
      poetx_jax.merge(model, rngs=nnx.Rngs(7))
    else:
      _randomize_all(model, keys(), scale=0.2)
    assert rel_err(model(tokens), base(tokens)) > 1e-2, stage  # not the base function
    plain = poetx_jax.unpoetize(model)
    assert len(poetx_jax.poet_layers(model)) == 4  # the POET model is left as it was
    modules = _by_path(plain)
    assert not any(isinstance(m, poetx_jax.POETLinear) for m in modules.values())
    assert sorted(p for p, m in modules.items() if type(m) is nnx.Linear) == [
        'blocks/0/down', 'blocks/0/up', 'blocks/1/down', 'blocks/1/up', 'lm_head']
    assert {type(v) for v in jax.tree.leaves(nnx.state(plain), is_leaf=lambda x:
                                             isinstance(x, nnx.Variable))} == {nnx.Param}
    chex.assert_trees_all_equal_shapes_and_dtypes(nnx.to_pure_dict(nnx.state(plain)),
                                                  base_state)
    for path, layer in poetx_jax.poet_layers(model):
      x = jax.random.normal(keys(), (5, layer.in_features))
      assert rel_err(modules[path](x), layer(x)) < 1e-5, (stage, path)
    assert rel_err(plain(tokens), model(tokens)) < 1e-5, stage
