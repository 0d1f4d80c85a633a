"""The Llama model: shapes, causality, attention / RMSNorm against references,
configs, jitted init, poetize and HF export (tiny config, float32, CPU)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import assert_trees_rel_close, rel_err
import poetx_jax
from poetx_jax.models import hf, llama
from poetx_jax.models import get_config, init_model
from poetx_jax.models.llama import Llama

TINY = get_config('tiny')


@pytest.fixture(scope='module')
def model():
  return Llama(TINY, rngs=nnx.Rngs(0))


@nnx.jit
def _forward(m, tokens):
  return m(tokens)


def _tokens(key, b=2, t=16, vocab=TINY.vocab_size):
  return jax.random.randint(key, (b, t), 0, vocab, jnp.int32)


def test_logits_shape_and_dtype(model, keys):
  logits = _forward(model, _tokens(keys(), 3, 12))
  assert logits.shape == (3, 12, TINY.vocab_size)
  assert logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))


def test_causal(model, keys):
  tokens = _tokens(keys(), 2, 16)
  changed = tokens.at[:, 9].set((tokens[:, 9] + 1) % TINY.vocab_size)
  a, b = _forward(model, tokens), _forward(model, changed)
  np.testing.assert_allclose(a[:, :9], b[:, :9], atol=1e-6, rtol=0)
  assert float(jnp.min(jnp.max(jnp.abs(a[:, 9:] - b[:, 9:]), axis=-1))) > 1e-4


def _reference_attention(attn, x, cfg):
  """Explicit softmax attention in float64: causal mask, GQA by repeating kv
  heads, rotate_half RoPE."""
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  n, k, d = cfg.heads, cfg.kv_heads, cfg.head_dim
  w = {name: np.asarray(getattr(attn, name).kernel[...], np.float64)
       for name in ('q_proj', 'k_proj', 'v_proj', 'o_proj')}
  q = (x @ w['q_proj']).reshape(b, t, n, d)
  kk = (x @ w['k_proj']).reshape(b, t, k, d)
  v = (x @ w['v_proj']).reshape(b, t, k, d)
  inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
  ang = np.arange(t)[:, None] * inv_freq[None, :]
  ang = np.concatenate([ang, ang], -1)[None, :, None, :]
  cos, sin = np.cos(ang), np.sin(ang)

  def rot(z):
    return np.concatenate([-z[..., d // 2:], z[..., :d // 2]], -1)

  q = q * cos + rot(q) * sin
  kk = kk * cos + rot(kk) * sin
  kk = np.repeat(kk, n // k, axis=2)
  v = np.repeat(v, n // k, axis=2)
  scores = np.einsum('btnd,bsnd->bnts', q, kk) / np.sqrt(d)
  scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
  scores = scores - scores.max(-1, keepdims=True)
  p = np.exp(scores)
  p = p / p.sum(-1, keepdims=True)
  out = np.einsum('bnts,bsnd->btnd', p, v).reshape(b, t, n * d)
  return out @ w['o_proj']


def test_attention_matches_reference(model, keys):
  attn = model.layers[0].self_attn
  x = jax.random.normal(keys(), (2, 24, TINY.hidden))
  # Larger weights so that the attention is far from uniform.
  for name in ('q_proj', 'k_proj'):
    lin = getattr(attn, name)
    lin.kernel[...] = lin.kernel[...] * 20
  try:
    got = attn(x)
    want = _reference_attention(attn, x, TINY)
  finally:
    for name in ('q_proj', 'k_proj'):
      lin = getattr(attn, name)
      lin.kernel[...] = lin.kernel[...] / 20
  assert rel_err(got, want) < 1e-5


def test_rmsnorm_matches_formula(keys):
  norm = llama.RMSNorm(32, eps=1e-5, rngs=nnx.Rngs(0))
  norm.weight[...] = jax.random.normal(keys(), (32,))
  x = jax.random.normal(keys(), (3, 5, 32)) * 3
  xn, w = np.asarray(x, np.float64), np.asarray(norm.weight[...], np.float64)
  want = xn / np.sqrt(np.mean(xn ** 2, -1, keepdims=True) + 1e-5) * w
  assert rel_err(norm(x), want) < 1e-6
  y = norm(x.astype(jnp.bfloat16))
  assert y.dtype == jnp.bfloat16
  assert rel_err(y, want) < 1e-2


@pytest.mark.slow
def test_tied_embeddings(keys):
  cfg = get_config('tiny', tie_embeddings=True)
  m = Llama(cfg, rngs=nnx.Rngs(1))
  assert not hasattr(m, 'lm_head')
  tokens = _tokens(keys(), 2, 8)
  h = m.embed_tokens(tokens)
  for layer in m.layers:
    h, stats = layer(h)
    assert stats == {}
  want = m.norm(h) @ m.embed_tokens.embedding[...].T
  assert rel_err(_forward(m, tokens), want) < 1e-6
  n = sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  assert n == cfg.num_params() == TINY.num_params() - TINY.hidden * TINY.vocab_size


def test_num_params(model):
  n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert n == TINY.num_params()


def test_configs_and_errors():
  assert set(llama.CONFIGS) == {'tiny', '60m', '130m', '350m', '1b', '3b', '8b', '13b'}
  assert llama.CONFIGS['8b'].kv_heads == 8 and llama.CONFIGS['8b'].head_dim == 128
  assert 7.0e9 < llama.CONFIGS['8b'].num_params() < 7.5e9
  assert get_config('60m', max_seq_len=256).max_seq_len == 256
  assert get_config('moe-tiny').model_class is poetx_jax.models.MoELlama  # one registry
  with pytest.raises(ValueError, match="unknown model config 'huge'.*'moe-tiny'.*'tiny'"):
    get_config('huge')
  with pytest.raises(ValueError, match="LlamaConfig field.*'hiden'.*'hidden'"):
    get_config('tiny', hiden=32)
  with pytest.raises(ValueError, match='heads=4, kv_heads=3'):
    get_config('tiny', kv_heads=3)
  with pytest.raises(ValueError, match='layers must be a positive int, got 0'):
    get_config('tiny', layers=0)
  with pytest.raises(ValueError, match='hidden=66, heads=4'):
    get_config('tiny', hidden=66)


def test_input_errors(model):
  with pytest.raises(ValueError, match='257.*256'):
    model(jnp.zeros((1, 257), jnp.int32))
  with pytest.raises(ValueError, match='2-D integer'):
    model(jnp.zeros((4,), jnp.int32))
  with pytest.raises(ValueError, match='2-D integer'):
    model(jnp.zeros((1, 4), jnp.float32))


def _params(m):
  return nnx.to_pure_dict(nnx.state(m, nnx.Param))


def _is_norm(path):
  return 'norm' in jax.tree_util.keystr(path)


@pytest.mark.slow
def test_init_model_is_seeded():
  """init_model(seed): the same seed gives identical parameters, another seed
  other draws in every random leaf; layers draw independently; the draw does
  not depend on the compute dtype, the remat policy or the scanned layout; the
  weights follow N(0, init_std) (norms start at one) in either param dtype."""
  built = init_model(TINY, seed=0)
  params = _params(built)
  chex.assert_trees_all_equal(_params(init_model(TINY, seed=0)), params)
  other = _params(init_model(TINY, seed=1))
  chex.assert_trees_all_equal_shapes_and_dtypes(other, params)

  def differs_unless_norm(path, x, y):
    same = np.array_equal(x, y)
    assert _is_norm(path) == same, f'{jax.tree_util.keystr(path)}: seeds 0 and 1 ' + (
        'draw the same values' if same else 'differ')

  jax.tree_util.tree_map_with_path(differs_unless_norm, params, other)
  q = [np.asarray(l.self_attn.q_proj.kernel[...]) for l in built.layers]
  assert not np.allclose(q[0], q[1])  # each layer its own draw
  chex.assert_trees_all_equal(_params(init_model(TINY, seed=0, dtype=jnp.bfloat16)),
                              params)
  chex.assert_trees_all_equal(_params(init_model(TINY, seed=0, remat='block')),
                              params)
  scanned = init_model(TINY, seed=0, scan_layers=True)
  assert isinstance(scanned.layers, llama.StackedLayers)
  chex.assert_trees_all_equal(hf.hf_state_dict(scanned), hf.hf_state_dict(built))
  half = init_model(TINY, seed=0, param_dtype=jnp.bfloat16)
  for tree, dtype in ((params, jnp.float32), (_params(half), jnp.bfloat16)):
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
      assert x.dtype == dtype, jax.tree_util.keystr(path)
      x = np.asarray(x, np.float64)
      if _is_norm(path):
        np.testing.assert_array_equal(x, 1.0)
      else:  # >= 2048 draws: the std to within 10%, the mean within 0.1 std
        assert abs(x.std() / TINY.init_std - 1) < 0.1, jax.tree_util.keystr(path)
        assert abs(x.mean()) < 0.1 * TINY.init_std, jax.tree_util.keystr(path)
  for bad in (True, 1.5, '0'):
    with pytest.raises(ValueError, match=f'seed must be an int, got {bad!r}'):
      init_model(TINY, seed=bad)


@pytest.mark.slow
def test_poetize_replaces_projections(model, keys):
  poet = poetx_jax.poetize(model, block_size=16, rngs=nnx.Rngs(0))
  want = {f'layers/{i}/{part}' for i in range(TINY.layers)
          for part in ('self_attn/q_proj', 'self_attn/k_proj', 'self_attn/v_proj',
                       'self_attn/o_proj', 'mlp/gate_proj', 'mlp/up_proj',
                       'mlp/down_proj')}
  paths = [p for p, _ in poetx_jax.poet_layers(poet)]
  assert len(paths) == len(want) and set(paths) == want
  assert type(poet.lm_head) is nnx.Linear
  assert type(poet.embed_tokens) is nnx.Embed
  tokens = _tokens(keys(), 2, 16)
  assert rel_err(_forward(poet, tokens), _forward(model, tokens)) < 1e-5

  with pytest.raises(ValueError, match='unpoetize'):
    hf.hf_state_dict(poet)
  sd = hf.hf_state_dict(poetx_jax.unpoetize(poet))
  np.testing.assert_allclose(sd['model.layers.0.self_attn.q_proj.weight'],
                             np.asarray(model.layers[0].self_attn.q_proj.kernel[...]).T,
                             atol=1e-6)


def test_hf_state_dict(model):
  sd = hf.hf_state_dict(model)
  h, m, v, kv = TINY.hidden, TINY.mlp, TINY.vocab_size, TINY.kv_heads * TINY.head_dim
  want = {'model.embed_tokens.weight': (v, h), 'model.norm.weight': (h,),
          'lm_head.weight': (v, h)}
  for i in range(TINY.layers):
    p = f'model.layers.{i}'
    want.update({
        f'{p}.self_attn.q_proj.weight': (h, h), f'{p}.self_attn.k_proj.weight': (kv, h),
        f'{p}.self_attn.v_proj.weight': (kv, h), f'{p}.self_attn.o_proj.weight': (h, h),
        f'{p}.mlp.gate_proj.weight': (m, h), f'{p}.mlp.up_proj.weight': (m, h),
        f'{p}.mlp.down_proj.weight': (h, m), f'{p}.input_layernorm.weight': (h,),
        f'{p}.post_attention_layernorm.weight': (h,)})
  assert {k: x.shape for k, x in sd.items()} == want
  assert all(isinstance(x, np.ndarray) and x.dtype == np.float32 for x in sd.values())
  assert sum(x.size for x in sd.values()) == TINY.num_params()
  np.testing.assert_array_equal(sd['model.layers.1.mlp.down_proj.weight'],
                                np.asarray(model.layers[1].mlp.down_proj.kernel[...]).T)
  np.testing.assert_array_equal(sd['model.embed_tokens.weight'],
                                np.asarray(model.embed_tokens.embedding[...]))

  cfg = hf.hf_config(TINY)
  assert cfg['architectures'] == ['LlamaForCausalLM'] and cfg['model_type'] == 'llama'
  assert (cfg['hidden_size'], cfg['intermediate_size'], cfg['num_hidden_layers'],
          cfg['num_attention_heads'], cfg['num_key_value_heads']) == (64, 176, 2, 4, 2)
  assert cfg['vocab_size'] == v and cfg['tie_word_embeddings'] is False
  tied = hf.hf_state_dict(Llama(get_config('tiny', tie_embeddings=True),
                                   rngs=nnx.Rngs(0)))
  assert 'lm_head.weight' not in tied


def _saved(model, tokens):
  """Saved residuals (text lines) of d loss / d params, arguments excluded."""
  import contextlib
  import io
  from jax.ad_checkpoint import print_saved_residuals
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    fresh = jax.tree.map(lambda a: a, rest)  # Variables of this trace
    return nnx.merge(graphdef, p, fresh)(tokens).sum()

  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    print_saved_residuals(loss, params)
  return [l for l in buf.getvalue().splitlines() if 'from the argument' not in l]


@pytest.mark.slow
def test_remat_policies_save_only_named_residuals():
  import poetx_jax
  cfg = get_config('tiny', layers=2, vocab_size=97)
  tokens = jnp.arange(2 * 12, dtype=jnp.int32).reshape(2, 12) % 97
  inside = lambda lines: [l for l in lines if any(
      k in l for k in ('Attention.__call__', 'swiglu', 'poetx_jax/ops.py'))]
  saved = {}
  for remat in ('none', 'block', 'attn'):
    model = poetx_jax.poetize(Llama(cfg, remat=remat, rngs=nnx.Rngs(0)), block_size=16,
                              rngs=nnx.Rngs(1))
    saved[remat] = _saved(model, tokens)
  # No remat keeps the attention and MLP internals and the POET block products.
  assert any('swiglu' in l for l in inside(saved['none']))
  assert any('poetx_jax/ops.py' in l for l in inside(saved['none']))
  # 'block' keeps nothing from inside a layer; 'attn' only the named outputs.
  assert inside(saved['block']) == [], saved['block']
  named = inside(saved['attn'])
  assert len(named) == cfg.layers and all("named 'attn_out'" in l for l in named), named
  # The layer boundaries (each layer's output) are kept in both.
  for remat in ('block', 'attn'):
    assert sum('DecoderLayer.__call__' in l for l in saved[remat]) == cfg.layers
  with pytest.raises(ValueError, match='remat must be one of'):
    Llama(cfg, remat='some', rngs=nnx.Rngs(0))


@pytest.mark.slow
@pytest.mark.parametrize('scan', [False, True])
def test_remat_offload_keeps_the_layer_inputs_in_host_memory(keys, scan):
  """remat='offload': the loss and gradients of remat='block', and the
  backward's residuals hold each layer's input (B, T, H) in host memory
  (stacked over the layers when scanned) and no other host array."""
  import poetx_jax
  cfg = get_config('tiny', layers=2, vocab_size=97)
  tokens = _tokens(keys(), 2, 12, cfg.vocab_size)

  def split(remat):
    model = poetx_jax.poetize(Llama(cfg, remat=remat, rngs=nnx.Rngs(0), scan_layers=scan),
                              block_size=16, rngs=nnx.Rngs(1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return (lambda p, r: (nnx.merge(graphdef, p, r)(tokens) ** 2).mean()), params, rest

  f, params, rest = split('offload')
  g, params_b, rest_b = split('block')
  @functools.partial(jax.jit, static_argnums=0)
  def value_and_grad(f, params, rest):  # vjp: rest's integer arrays get no cotangent
    loss, pull = jax.vjp(f, params, rest)
    return loss, pull(jnp.ones_like(loss))[0]

  loss, grads = value_and_grad(f, params, rest)
  loss_b, grads_b = value_and_grad(g, params_b, rest_b)
  assert rel_err(loss, loss_b) < 1e-6
  assert_trees_rel_close(grads, grads_b, 1e-6)
  closed, shapes = jax.make_jaxpr(lambda p, r: jax.vjp(f, p, r), return_shape=True)(params, rest)
  residuals = closed.jaxpr.outvars[len(closed.jaxpr.outvars) - len(jax.tree.leaves(shapes[1])):]
  on_host = [v.aval.shape for v in residuals
             if getattr(v.aval, 'memory_space', None) == jax.memory.Space.Host]
  layer_input = (2, 12, cfg.hidden)
  assert on_host == ([(cfg.layers, *layer_input)] if scan else [layer_input] * cfg.layers)


@pytest.mark.slow
@pytest.mark.parametrize('remat', ['none', 'block'])
def test_scanned_layers_are_the_same_model(keys, remat):
  """scan_layers=True stores the same weights (drawn in the same order) with a
  leading layer axis and computes the same logits and gradients."""
  cfg = get_config('tiny', layers=2)
  unrolled = Llama(cfg, remat=remat, rngs=nnx.Rngs(0))
  scanned = Llama(cfg, remat=remat, rngs=nnx.Rngs(0), scan_layers=True)
  assert isinstance(scanned.layers, llama.StackedLayers) and len(scanned.layers) == 2
  assert scanned.layers.layer.mlp.up_proj.kernel.shape == (2, cfg.hidden, cfg.mlp)
  chex.assert_trees_all_equal(hf.hf_state_dict(scanned), hf.hf_state_dict(unrolled))
  tokens = _tokens(keys(), 2, 16, cfg.vocab_size)
  # Compiled: each model's forward and gradient one program (run eagerly, op
  # by op, the same computation compiled some hundred small programs).
  forward = nnx.jit(_forward)
  assert rel_err(forward(scanned, tokens), forward(unrolled, tokens)) < 1e-6
  grad = nnx.jit(nnx.grad(lambda m: (m(tokens) ** 2).mean()))
  ga, gb = grad(unrolled), grad(scanned)
  stacked = nnx.to_pure_dict(gb['layers']['layer'])
  for i in range(2):  # slice i of the stacked gradients is layer i's
    assert_trees_rel_close(jax.tree.map(lambda y: y[i], stacked),
                           nnx.to_pure_dict(ga['layers'][i]), 1e-5)
  assert rel_err(gb['lm_head']['kernel'][...], ga['lm_head']['kernel'][...]) < 1e-5
  # Indexing gives copies of single layers.
  np.testing.assert_array_equal(scanned.layers[-1].mlp.down_proj.kernel[...],
                                unrolled.layers[1].mlp.down_proj.kernel[...])
  with pytest.raises(IndexError, match='out of range for 2 layers'):
    scanned.layers[2]


class _Wrapped(nnx.Module):
  """A decoder layer inside a module of another class, its branch doubled."""

  def __init__(self, inner):
    self.inner = inner

  def __call__(self, h, positions=None):
    out, stats = self.inner(h, positions)
    return h + 2 * (out - h), stats


@pytest.mark.slow
@pytest.mark.parametrize('remat', ['none', 'block'])
def test_the_layers_convert_layer_returns_run_scanned_or_not(keys, remat):
  """Each decoder layer runs its own __call__, whatever class convert_layer
  made it: unrolled and scanned compute the same, and not the plain model."""
  cfg = get_config('tiny', layers=2)
  tokens = _tokens(keys(), 2, 16, cfg.vocab_size)
  out = {scan: Llama(cfg, remat=remat, rngs=nnx.Rngs(0), scan_layers=scan,
                     convert_layer=_Wrapped)(tokens) for scan in (False, True)}
  assert rel_err(out[True], out[False]) < 1e-6
  assert rel_err(out[False], Llama(cfg, remat=remat, rngs=nnx.Rngs(0))(tokens)) > 1e-3


def test_scanned_remat_block_saves_only_layer_inputs():
  cfg = get_config('tiny', layers=2, vocab_size=97)
  tokens = jnp.arange(2 * 12, dtype=jnp.int32).reshape(2, 12) % 97
  saved = {r: _saved(Llama(cfg, remat=r, rngs=nnx.Rngs(0), scan_layers=True), tokens)
           for r in ('none', 'block')}
  inside = lambda lines: [l for l in lines if any(
      k in l for k in ('Attention.__call__', 'swiglu'))]
  assert inside(saved['none']) and not inside(saved['block']), saved['block']


def test_stacked_layers_errors():
  cfg = get_config('tiny')
  shapes = iter([cfg, get_config('tiny', mlp=64)])
  with pytest.raises(ValueError, match='layer 1 differs'):
    llama.StackedLayers(lambda i: llama.DecoderLayer(next(shapes), rngs=nnx.Rngs(i)), 2)
  with pytest.raises(ValueError, match='length must be a positive int'):
    llama.StackedLayers(lambda i: llama.DecoderLayer(cfg, rngs=nnx.Rngs(i)), 0)
  with pytest.raises(ValueError, match='place needs scan_layers=True'):
    Llama(cfg, rngs=nnx.Rngs(0), place=lambda shape: None)


@pytest.mark.slow
@pytest.mark.parametrize('quantize', [None, 'int4'])
def test_scanned_poet_model_merges_and_exports(keys, quantize):
  """POET layers converted as built and stacked: the same function as the
  unrolled POET model; a merge keeps the function, gives every layer its own
  permutations, resets the generators and reports the largest error; export
  (unpoetize, hf_state_dict) equals the unrolled model's."""
  cfg = get_config('tiny', layers=2)
  opts = dict(block_size=16, quantize=quantize, group_size=16)

  def build(scan):
    rngs = nnx.Rngs(7)
    return Llama(cfg, rngs=nnx.Rngs(0), scan_layers=scan, convert_layer=lambda l:
                 poetx_jax.poetize(l, rngs=rngs, consume=True, **opts))

  unrolled, scanned = build(False), build(True)
  tokens = _tokens(keys(), 2, 16, cfg.vocab_size)
  forward = nnx.jit(_forward)  # one program per model, not op by op
  by_path = dict(poetx_jax.poet_layers(unrolled))
  for path, layer in poetx_jax.poet_layers(scanned):  # the same rotations in both
    per_layer = [by_path[path.replace('layers/layer/', f'layers/{i}/')] for i in range(2)]
    for one in per_layer:
      one.q_out[...] = 3e-2 * jax.random.normal(keys(), one.q_out.shape)
    layer.q_out[...] = jnp.stack([one.q_out[...] for one in per_layer])
  stacked = scanned.layers.layer.mlp.down_proj
  assert stacked.stack_shape == (2,)
  before = forward(scanned, tokens)
  assert rel_err(before, forward(unrolled, tokens)) < 1e-6
  sd_a = hf.hf_state_dict(poetx_jax.unpoetize(unrolled))
  exported = poetx_jax.unpoetize(scanned)
  assert exported.layers.layer.mlp.down_proj.kernel.get_metadata()['layer_axis'] == 0
  chex.assert_trees_all_close(hf.hf_state_dict(exported), sd_a, rtol=1e-7, atol=1e-6)
  errors = [float(scanned.layers[i].mlp.down_proj.orthogonality_error()) for i in range(2)]
  assert float(poetx_jax.orthogonality_error(stacked)) == pytest.approx(max(errors), rel=1e-4)
  assert max(errors) > 0
  with pytest.raises(ValueError, match='holds a stack of'):
    stacked(jnp.ones((1, cfg.mlp)))

  perms = np.asarray(stacked.perm_in[...])
  error = poetx_jax.merge(scanned, rngs=nnx.Rngs(1))
  assert float(error) >= max(errors) * (1 - 1e-4)  # the largest over every POET layer
  tol = 1e-5 if quantize is None else 0.2  # int4 re-quantises the merged W0
  assert rel_err(forward(scanned, tokens), before) < tol
  new = np.asarray(stacked.perm_in[...])
  assert not np.array_equal(new, perms) and not np.array_equal(new[0], new[1])
  assert all(np.array_equal(np.sort(p), np.arange(cfg.mlp)) for p in new)
  assert float(jnp.abs(stacked.q_out[...]).max()) == 0.0


@pytest.mark.slow
def test_stacked_merge_updates_in_place_one_layer_at_a_time():
  """The merge program of a stack of 8 layers aliases every input buffer to
  its output (donated, in place) and its scratch is a few layers' worth, not
  a copy of the stack."""
  from poetx_jax import cycle
  cfg = get_config('tiny', layers=8, hidden=128, mlp=256)
  rngs = nnx.Rngs(1)
  model = Llama(cfg, rngs=nnx.Rngs(0), scan_layers=True, convert_layer=lambda l:
                poetx_jax.poetize(l, rngs=rngs, block_size=32))
  layer = model.layers.layer.mlp.up_proj
  graphdef, state = nnx.split(layer)
  leaves, treedef = jax.tree.flatten(jax.tree.map(lambda x: x.sharding, state))
  program = cycle._merge_program(graphdef, treedef, tuple(leaves), True)
  mem = program.lower(state, jax.random.key(0), (None, None)).compile().memory_analysis()
  stack = sum(x.nbytes for x in jax.tree.leaves(state))
  assert mem.alias_size_in_bytes >= stack - 64
  assert mem.temp_size_in_bytes < 0.5 * stack


@pytest.mark.slow
@pytest.mark.parametrize('tie,dtype,tol', [(False, jnp.float32, 1e-5),
                                            (True, jnp.bfloat16, 2e-2)])
def test_gathers_moved_into_the_norms_give_the_same_model(keys, tie, dtype, tol):
  """norm_gathers: each RMSNorm writes its output in the input orders of the
  POET projections after it (one per layer, or one for a tied group), their
  input gathers skipped. The logits are exactly those of the gathers apart
  (the same elementwise operations, reordered); the gradients those within
  rounding (the norm's backward sums the features in another order). A
  ragged MLP width (88 of blocks of 16), generators away from zero."""
  from unittest import mock
  from conftest import randomize_generators
  from poetx_jax import groups
  cfg = llama.LlamaConfig(vocab_size=64, hidden=48, mlp=88, layers=2, heads=4, kv_heads=2,
                          max_seq_len=32, block_size=16)
  poet = poetx_jax.poetize(Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0)), block_size=16,
                           rngs=nnx.Rngs(1))
  if tie:
    poetx_jax.tie_permutations(poet)
  for i, (_, layer) in enumerate(nnx.iter_graph(poet)):
    if isinstance(layer, poetx_jax.POETLinear):
      randomize_generators(layer, jax.random.fold_in(keys(), i))
  moved = nnx.clone(poet)
  for layer in moved.layers:
    layer.norm_gathers = True
  tokens = _tokens(keys(), t=12, vocab=cfg.vocab_size)

  def run(m):  # the logits of the loss's own forward
    def loss(m):
      logits = m(tokens)
      return jnp.mean(logits ** 2), logits
    (loss, logits), grads = nnx.value_and_grad(loss, has_aux=True)(m)
    return (loss, grads), logits

  # float32 compiled; bfloat16 op by op: compiled, XLA:CPU's fusions keep
  # bfloat16 intermediates in float32, differently in the two programs.
  run = nnx.jit(run) if dtype == jnp.float32 else run

  with mock.patch.object(groups, 'rms_norm_in_orders', wraps=groups.rms_norm_in_orders) as spy:
    (loss_b, grads_b), logits_b = run(moved)
  assert spy.call_count >= 4  # both norms of both layers took the orders
  orders = [len({id(p) for p, *_ in c.args[2]}) for c in spy.call_args_list]
  assert set(orders) == ({1} if tie else {2, 3})  # a tied group gathers once
  (loss_a, grads_a), logits_a = run(poet)
  np.testing.assert_array_equal(np.asarray(logits_a), np.asarray(logits_b))
  assert float(loss_a) == float(loss_b)
  assert_trees_rel_close(nnx.to_pure_dict(grads_b), nnx.to_pure_dict(grads_a), tol)
