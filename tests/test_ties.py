"""Tied permutations (poetx_jax.ties): one permutation per declared group of a
Llama decoder layer, fewer gathers, the same function, kept by merges."""


import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from conftest import assert_trees_rel_close, gathered, rel_err
import poetx_jax
from poetx_jax.models import get_config
from poetx_jax.pretrain import config

TINY = get_config('tiny')


def _model(tied, *, form='input', scan=False, dtype=jnp.float32, seed=0):
  def convert(layer):
    layer = poetx_jax.poetize(layer, block_size=16, rngs=nnx.Rngs(seed + 1), form=form)
    return poetx_jax.tie_permutations(layer) if tied else layer
  return TINY.build(rngs=nnx.Rngs(seed), dtype=dtype, convert_layer=convert, scan_layers=scan)


def _randomize(model, key, scale=0.05):
  for i, (_, layer) in enumerate(poetx_jax.poet_layers(model)):
    k_in, k_out = jax.random.split(jax.random.fold_in(key, i))
    layer.q_in[...] = scale * jax.random.normal(k_in, layer.q_in.shape)
    layer.q_out[...] = scale * jax.random.normal(k_out, layer.q_out.shape)


def _decoder(model):
  return model.layers.layer if hasattr(model.layers, 'layer') else model.layers[0]


def _groups(model):
  layer = _decoder(model)
  a, m = layer.self_attn, layer.mlp
  return [(a.q_proj.perm_in, a.k_proj.perm_in, a.v_proj.perm_in),
          (m.gate_proj.perm_in, m.up_proj.perm_in),
          (m.gate_proj.perm_out, m.up_proj.perm_out, m.down_proj.perm_in)]


def _assert_tied(model):
  for group in _groups(model):
    for p in group[1:]:
      chex.assert_trees_all_equal(p[...], group[0][...])


def _forget_ties(model):
  """Clears every side's tie record: the layers then gather on their own."""
  for _, layer in poetx_jax.poet_layers(model):
    layer.tie_in = layer.tie_out = None


def _assert_own_buffers(model):
  """No two arrays of the model's state share a buffer (a donated state
  holding one twice fails)."""
  leaves = jax.tree.leaves(nnx.state(model))
  assert len({x.unsafe_buffer_pointer() for x in leaves}) == len(leaves)


def _tokens(key, b=2, t=16):
  return jax.random.randint(key, (b, t), 0, TINY.vocab_size, jnp.int32)


@pytest.mark.slow
def test_tie_permutations_ties_each_group_and_keeps_the_function(keys):
  """Each declared group takes its first member's permutation, the bases
  re-folded: the logits stay those of the untied model; other sides keep
  their own draws."""
  untied, tied = _model(False), _model(True)
  tokens = _tokens(keys())
  assert rel_err(tied(tokens), untied(tokens)) < 1e-6
  _assert_tied(tied)
  a_tied, a_untied = _decoder(tied).self_attn, _decoder(untied).self_attn
  chex.assert_trees_all_equal(a_tied.q_proj.perm_in[...], a_untied.q_proj.perm_in[...])
  chex.assert_trees_all_equal(a_tied.k_proj.perm_out[...], a_untied.k_proj.perm_out[...])
  assert not bool(jnp.all(a_untied.k_proj.perm_in[...] == a_untied.q_proj.perm_in[...]))
  _assert_own_buffers(tied)
  m_tied = _decoder(tied).mlp
  assert a_tied.q_proj.tie_in == a_tied.v_proj.tie_in == 'Attention.0'
  assert m_tied.gate_proj.tie_out == m_tied.down_proj.tie_in == 'MLP.1'
  assert a_tied.q_proj.tie_out is None and a_untied.q_proj.tie_in is None


@pytest.mark.slow
@pytest.mark.parametrize('form', ['input', 'weight'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_tied_path_gives_the_untied_paths_loss_and_gradients(keys, form, dtype):
  """With the ties in place, the attention's one gather of the q/k/v input
  and the MLP without a join gather compute what each layer's own gathers
  do: loss and gradients (generators and the hidden state's) agree."""
  model = _model(True, form=form, dtype=dtype)
  _randomize(model, keys())
  tokens = _tokens(keys())

  def loss(m):
    return m(tokens).astype(jnp.float32).std()

  got = nnx.value_and_grad(loss)(model)
  _forget_ties(model)
  want = nnx.value_and_grad(loss)(model)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  assert rel_err(got[0], want[0]) <= tol
  assert_trees_rel_close(nnx.to_pure_dict(got[1]), nnx.to_pure_dict(want[1]), tol)
  assert float(jnp.abs(want[1]['layers'][0]['mlp']['down_proj']['q_in'][...]).max()) > 0


def _gathers(model, tokens) -> int:
  graphdef, state = nnx.split(model)
  return len(gathered(lambda s: nnx.merge(graphdef, s)(tokens), state))


def test_tied_llama_gathers_fewer_activations(keys):
  """Input form, per decoder layer: 13 activation gathers untied (q, k, v in
  and out; o in and out; gate and up in; the SwiGLU join's two; down out), 8
  tied (one q/k/v input gather, one gate/up input gather, no join)."""
  tokens = _tokens(keys())
  assert _gathers(_model(False), tokens) == 13 * TINY.layers
  assert _gathers(_model(True), tokens) == 8 * TINY.layers


@pytest.mark.slow
@pytest.mark.parametrize('scan', [False, True])
def test_merge_keeps_the_ties_and_the_function(keys, scan):
  """A merge draws each group's permutation once, from its first member's
  key (what that layer draws untied), and gives it to the others: the ties
  hold after it, and the model computes the same function."""
  model, untied = _model(True, scan=scan), _model(False, scan=scan)
  for m in (model, untied):
    _randomize(m, jax.random.key(3))
  tokens = _tokens(keys())
  before = model(tokens)
  key = keys()
  error = poetx_jax.merge(model, rngs=key)
  poetx_jax.merge(untied, rngs=key)
  assert float(error) < 0.05  # the series at these generators: healthy
  assert rel_err(model(tokens), before) < 1e-5
  _assert_tied(model)
  _assert_own_buffers(model)
  a, a_untied = _decoder(model).self_attn, _decoder(untied).self_attn
  chex.assert_trees_all_equal(a.q_proj.perm_in[...], a_untied.q_proj.perm_in[...])
  chex.assert_trees_all_equal(a.k_proj.perm_out[...], a_untied.k_proj.perm_out[...])
  assert not bool(jnp.all(a.q_proj.perm_in[...] == _decoder(model).mlp.gate_proj.perm_in[...]))


@pytest.mark.slow
def test_merge_under_jit_draws_what_the_compiled_merge_draws(keys):
  """The traced merge (inside jit) gives the ties the same permutations as
  the merge of one compiled program per layer."""
  a, b = _model(True), _model(True)
  for m in (a, b):
    _randomize(m, jax.random.key(4))
  key = keys()
  poetx_jax.merge(a, rngs=key)
  nnx.jit(lambda m, k: poetx_jax.merge(m, rngs=k))(b, key)
  _assert_tied(b)
  for (_, la), (_, lb) in zip(poetx_jax.poet_layers(a), poetx_jax.poet_layers(b)):
    chex.assert_trees_all_equal((la.perm_in[...], la.perm_out[...]),
                                (lb.perm_in[...], lb.perm_out[...]))


def test_tie_permutations_refuses_nonzero_generators_and_changes_nothing(keys):
  """Re-folding a base under a rotation would change the function: refused,
  with every permutation and base as it was."""
  model = _model(False)
  _randomize(model, keys())
  before = nnx.to_pure_dict(nnx.state(model))
  with pytest.raises(ValueError, match='generators are zero'):
    poetx_jax.tie_permutations(model)
  chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(model)), before)
  assert all(layer.tie_in is None for _, layer in poetx_jax.poet_layers(model))


def test_the_option_needs_poetx():
  with pytest.raises(ValueError, match='tie_permutations=True: option of the POET layers'):
    config.TrainConfig(optimizer='adamw', tie_permutations=True).validate()


def test_a_merge_of_part_of_a_group_is_refused_and_changes_nothing(keys):
  """Redrawing one member's permutation would break its group's tie: merging
  a tied layer alone (or merge_layer without the group's permutation) is
  refused, with nothing changed."""
  model = _model(True)
  _randomize(model, keys())
  before = nnx.to_pure_dict(nnx.state(model))
  k_proj = _decoder(model).self_attn.k_proj
  with pytest.raises(ValueError, match='outside it'):
    poetx_jax.merge(k_proj, rngs=keys())
  with pytest.raises(ValueError, match='tied to other layers'):
    poetx_jax.merge_layer(k_proj, keys())
  chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(model)), before)


@pytest.mark.slow
def test_reconverted_layers_forget_their_ties(keys):
  """unpoetize then poetize draws new, independent permutations: the layers
  hold no tie record, so the model gathers for each (the same function as
  the dense model)."""
  model = _model(True)
  dense = poetx_jax.unpoetize(model)
  again = poetx_jax.poetize(dense, block_size=16, rngs=nnx.Rngs(7), form='input')
  tokens = _tokens(keys())
  assert rel_err(again(tokens), dense(tokens)) < 1e-6
  assert all(l.tie_in is None and l.tie_out is None for _, l in poetx_jax.poet_layers(again))
  assert _gathers(again, tokens) == 13 * TINY.layers


def test_a_side_in_two_groups_is_refused():
  """Groups that share a side would chain: refused before anything changes."""
  lin = lambda s: poetx_jax.POETLinear(32, 32, block_size=16, use_bias=False,
                                       rngs=nnx.Rngs(s))

  class Chained(nnx.Module):
    def __init__(self):
      self.a, self.b, self.c = lin(0), lin(1), lin(2)

    def permutation_ties(self):
      return [[(self.a, 'in'), (self.b, 'in')], [(self.b, 'in'), (self.c, 'in')]]

  m = Chained()
  before = nnx.to_pure_dict(nnx.state(m))
  with pytest.raises(ValueError, match='more than one tied group'):
    poetx_jax.tie_permutations(m)
  chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(m)), before)
