"""SkewAdam: labels, state sizes per tier, state_bytes, the maths of each
tier against a float64 numpy reference, and POET-X through one partition on a
poetized MoE-shaped model. (jit, inject_hyperparams, schedules, MultiSteps,
dtypes: test_optax_contract.py; hyperparameter ranges: test_hyperparams.py.)"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import assert_trees_rel_close
import poetx_jax
from poetx_jax import POETParam, poetx_skewadam, scale_by_skewadam, skewadam, skewadam_labels


def _n(tree):
  """Elements in the arrays of a tree."""
  return sum(x.size for x in jax.tree.leaves(tree))


def test_labels_by_path_and_poet_type():
  tree = {'embed_tokens': {'embedding': jnp.zeros((10, 4))},
          'layers': {'0': {'attn': {'q_proj': {'kernel': jnp.zeros((4, 4)),
                                               'q_in': POETParam(jnp.zeros((1, 6)))},
                                    'norm': {'scale': jnp.zeros(4)}},
                           'moe': {'router': {'kernel': jnp.zeros((4, 2))},
                                   'experts': {'up': jnp.zeros((2, 4, 8)),
                                               'router_bias': jnp.zeros((2,))}}}},
          'lm_head': {'kernel': jnp.zeros((4, 10))}}
  want = {'embed_tokens': {'embedding': 'embeddings'},
          'layers': {'0': {'attn': {'q_proj': {'kernel': 'backbone', 'q_in': 'poetx'},
                                    'norm': {'scale': 'backbone'}},
                           'moe': {'router': {'kernel': 'router'},
                                   # 'experts' takes precedence over 'router'
                                   'experts': {'up': 'experts', 'router_bias': 'experts'}}}},
          'lm_head': {'kernel': 'embeddings'}}
  assert skewadam_labels(tree) == want
  want['layers']['0']['attn']['q_proj']['q_in'] = 'backbone'
  assert skewadam_labels(tree, poet=False) == want


def test_unknown_labels_are_named():
  params = {'w': jnp.zeros((3,)), 'v': jnp.zeros((3,))}
  with pytest.raises(ValueError, match=r"\['expert'\]; valid labels: \['backbone', "
                                       r"'experts', 'router', 'embeddings'\]"):
    scale_by_skewadam({'w': 'expert', 'v': 'router'})
  tx = skewadam(1e-3, labels=lambda p: {'w': 'poetx', 'v': 'router'})
  with pytest.raises(ValueError, match=r"\['poetx'\].*use poetx_skewadam"):
    tx.init(params)  # a label function is checked when it is called


def test_state_per_tier_has_the_documented_sizes():
  e3, e4 = (4, 256, 128), (2, 4, 256, 128)
  params = {'moe': {'experts': {'w3': jnp.zeros(e3), 'w4': jnp.zeros(e4)},
                    'router': {'kernel': jnp.zeros((256, 8))}},
            'attn': {'kernel': jnp.zeros((256, 128)), 'norm': jnp.zeros((128,))}}
  state = scale_by_skewadam(skewadam_labels).init(params).inner_states
  ex, bb, rt = (state[k].inner_state for k in ('experts', 'backbone', 'router'))
  # Experts: no first moment, one row and one column mean per (256, 128) matrix.
  assert isinstance(ex, poetx_jax.FactoredRMSState) and not hasattr(ex, 'mu')
  chex.assert_trees_all_equal_shapes_and_dtypes(
      (ex.v_row['moe']['experts'], ex.v_col['moe']['experts']),
      ({'w3': jnp.zeros((4, 256)), 'w4': jnp.zeros((2, 4, 256))},
       {'w3': jnp.zeros((4, 128)), 'w4': jnp.zeros((2, 4, 128))}))
  assert _n(ex) == 1 + (4 * 384 + 1) + (8 * 384 + 1)  # count, v per leaf (+ placeholder)
  # Backbone: float32 mu of every leaf; v factored for the matrix, exact for the norm.
  assert jax.tree.leaves(bb.mu)[0].dtype == jnp.float32
  assert bb.v_row['attn']['kernel'].shape == (256,) and bb.v_full['attn']['norm'].shape == (128,)
  assert _n(bb) == 1 + (256 * 128 + 128) + (256 + 1) + (128 + 1) + (1 + 128)
  # Router: Adam, exact float32 v and mu (never factored, though both sides >= 8).
  assert rt.v_full['moe']['router']['kernel'].shape == (256, 8)
  assert rt.mu['moe']['router']['kernel'].dtype == jnp.float32
  assert _n(rt) == 1 + 2 * 256 * 8 + 2


def test_expert_stack_state_is_a_small_fraction_of_adams():
  params = {'experts': jnp.zeros((2, 4, 256, 128))}
  tx = skewadam(1e-3)
  ours, adam = tx.init(params), optax.adam(1e-3).init(params)
  # Four tier counts, L E (I + O) factored moments and a placeholder; Adam 1 + 2 L E I O.
  assert _n(ours) == 4 + 2 * 4 * (256 + 128) + 1 == 3077
  assert _n(adam) == 1 + 2 * 2 * 4 * 256 * 128 == 524289
  assert poetx_jax.state_bytes(ours) == 4 * 3077  # float32 and int32 words
  assert poetx_jax.state_bytes(ours, by_tier=True) == {
      'backbone': 4, 'experts': 4 * 3074, 'router': 4, 'embeddings': 4}
  assert poetx_jax.state_bytes(ours) / poetx_jax.state_bytes(adam) == 3077 / 524289 < 0.006



def test_state_bytes_counts_any_tree_concrete_or_abstract():
  """Every array leaf at its numpy item size; an abstract state (nnx.eval_shape)
  counts what the concrete one holds."""
  def build():
    model = poetx_jax.poetize(nnx.Linear(16, 8, rngs=nnx.Rngs(0)), block_size=8,
                              rngs=nnx.Rngs(1))
    tx = poetx_skewadam(model, poetx_jax.poetx(1e-3), 1e-3, min_dim_size_to_factor=8)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)
  model, opt = build()
  abstract_model, abstract_opt = nnx.eval_shape(build)
  assert isinstance(jax.tree.leaves(nnx.state(abstract_opt))[0], jax.ShapeDtypeStruct)
  for concrete, abstract in ((model, abstract_model), (opt, abstract_opt)):
    want = sum(x.nbytes for x in jax.tree.leaves(nnx.state(concrete)))
    assert poetx_jax.state_bytes(nnx.state(abstract)) == want > 0
  tree = {'int4': jnp.zeros((3, 5), jnp.int4), 'bf16': jnp.zeros((7,), jnp.bfloat16),
          'keys': jax.random.split(jax.random.key(0), 2), 'python': 1.0}
  assert poetx_jax.state_bytes(tree) == 15 + 14 + 2 * 8
  with pytest.raises(ValueError, match='by_tier=True needs an optax.partition state'):
    poetx_jax.state_bytes(tree, by_tier=True)

B1, B2, EPS, LR, WD = 0.8, 0.95, 1e-8, 0.1, 0.01
SHAPES = {'attn': {'kernel': (8, 6), 'scale': (6,)}, 'embed_tokens': (10, 6),
          'router': (6, 5), 'experts': {'up': (3, 8, 6), 'stack': (2, 3, 8, 6), 'b': (3, 2)}}


def _tree(rng):
  """Normal float32 leaves of SHAPES (numpy: jax.random compiles per shape)."""
  return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32), SHAPES,
                      is_leaf=lambda x: isinstance(x, tuple))


def _reference(params, grads, min_dim=4):
  """skewadam(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD) in float64 numpy."""
  labels = skewadam_labels(params)
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  state = jax.tree.map(lambda x: dict(m=0.0, v=0.0, r=0.0, c=0.0), p)
  outs = []
  for t, g in enumerate(grads, start=1):
    def leaf(label, x, g, s):
      g = np.asarray(g, np.float64)
      factored = label != 'router' and g.ndim >= 2 and min(g.shape[-2:]) >= min_dim
      if factored:
        s['r'] = B2 * s['r'] + (1 - B2) * (g ** 2).mean(-1)
        s['c'] = B2 * s['c'] + (1 - B2) * (g ** 2).mean(-2)
        v = s['r'][..., :, None] * s['c'][..., None, :] / s['r'].mean(-1)[..., None, None]
      else:
        s['v'] = v = B2 * s['v'] + (1 - B2) * g ** 2
      v_hat = v / (1 - B2 ** t)
      if label in ('experts', 'embeddings'):
        num = g
      else:
        s['m'] = B1 * s['m'] + (1 - B1) * g
        num = s['m'] / (1 - B1 ** t)
      return jnp.asarray(-LR * (num / (np.sqrt(v_hat) + EPS) + WD * x), jnp.float32)
    outs.append(jax.tree.map(leaf, labels, p, g, state, is_leaf=lambda x: isinstance(x, str)))
  return outs


def _run(tx, params, grads):
  """The updates of ``tx`` (jitted) on ``grads`` in turn, and its last state."""
  state, outs, update = tx.init(params), [], jax.jit(tx.update)
  for g in grads:
    u, state = update(g, state, params)
    outs.append(u)
  return outs, state


def test_every_tier_matches_a_float64_reference():
  rng = np.random.default_rng(0)
  params, grads = _tree(rng), [_tree(rng) for _ in range(3)]
  tx = skewadam(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, min_dim_size_to_factor=4)
  got, _ = _run(tx, params, grads)
  for g, w in zip(got, _reference(params, grads)):
    assert_trees_rel_close(g, w, 1e-5)


class TinyMoE(nnx.Module):
  def __init__(self, rngs):
    self.embed_tokens = nnx.Embed(11, 16, rngs=rngs)
    self.attn = nnx.Linear(16, 16, rngs=rngs)
    self.router = nnx.Linear(16, 4, use_bias=False, rngs=rngs)
    self.experts = nnx.Param(jax.random.normal(rngs.params(), (4, 16, 16)) / 4)
    self.lm_head = nnx.Linear(16, 11, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.attn(self.embed_tokens(tokens))
    gate = jax.nn.softmax(self.router(x), axis=-1)
    x = x + jnp.einsum('te,tei->ti', gate, jnp.einsum('ti,eio->teo', x, self.experts[...]))
    return self.lm_head(x)


@pytest.mark.slow
def test_composes_with_poetx_under_nnx_optimizer(keys):
  model = poetx_jax.poetize(TinyMoE(nnx.Rngs(0)), block_size=8, rngs=nnx.Rngs(1),
                            exclude=('lm_head', 'router'))
  labels = skewadam_labels(model)
  assert labels['attn'] == {'bias': 'backbone', 'q_in': 'poetx', 'q_out': 'poetx'}
  assert (labels['router']['kernel'], labels['experts'], labels['lm_head']['kernel'],
          labels['embed_tokens']['embedding']) == ('router', 'experts', 'embeddings',
                                                   'embeddings')
  poet_lr, other_lr = 1e-2, 1e-3  # apart, so each update shows its optimizer
  tx = poetx_skewadam(model, poetx_jax.poetx(poet_lr), other_lr, min_dim_size_to_factor=8)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  tokens = jax.random.randint(keys(), (12,), 0, 11)
  loss = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(tokens), tokens).mean()

  @nnx.jit
  def step(model, optimizer):
    grads = nnx.grad(loss)(model)
    optimizer.update(model, grads)
    return grads

  before = jax.tree.map(np.asarray, nnx.as_pure(nnx.state(model, nnx.Param)))
  grads = nnx.as_pure(step(model, optimizer))
  after = nnx.as_pure(nnx.state(model, nnx.Param))
  delta = jax.tree.map(lambda a, b: np.asarray(a) - b, after, before)
  assert all(np.abs(d).max() > 0 for d in jax.tree.leaves(delta))
  # POET generators: poetx's first Adam step at its own rate, -lr g / (|g| + eps).
  for side in ('q_in', 'q_out'):
    g = np.asarray(grads['attn'][side])
    np.testing.assert_allclose(delta['attn'][side], -poet_lr * g / (np.abs(g) + 1e-8),
                               rtol=1e-5, atol=1e-9)
  assert np.abs(delta['router']['kernel']).max() == pytest.approx(other_lr, rel=1e-4)
  assert poetx_jax.optim.the_poetx_state(optimizer.opt_state).count == 1
  assert set(poetx_jax.state_bytes(optimizer.opt_state, by_tier=True)) == {
      'poetx', 'backbone', 'experts', 'router', 'embeddings'}
  with pytest.raises(ValueError, match='use poetx_skewadam'):
    skewadam(1e-3, labels=model)
