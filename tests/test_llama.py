"""The Llama model: shapes, causality, attention / RMSNorm against references,
configs, jitted init, poetize and HF export (tiny config, float32, CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
import poetx_jax
from poetx_jax.models import llama
from poetx_jax.models.llama import Llama, get_config

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


def test_tied_embeddings(keys):
  cfg = get_config('tiny', tie_embeddings=True)
  m = Llama(cfg, rngs=nnx.Rngs(1))
  assert not hasattr(m, 'lm_head')
  tokens = _tokens(keys(), 2, 8)
  h = m.embed_tokens(tokens)
  for layer in m.layers:
    h = layer(h)
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
  with pytest.raises(ValueError, match="unknown Llama config 'huge'.*'tiny'"):
    get_config('huge')
  with pytest.raises(ValueError, match="'hiden'.*'hidden'"):
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


def test_init_model_is_seeded_and_on_the_device(model):
  built = llama.init_model(TINY, seed=0)
  leaves = jax.tree.leaves(nnx.state(built, nnx.Param))
  assert all(x.devices() == {jax.devices()[0]} for x in leaves)
  # the draws of the module built with that seed (1 ulp where an initialiser
  # was compiled in another context first)
  for x, y in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), leaves):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-9)
  other = llama.init_model(TINY, seed=1)
  assert not np.allclose(other.lm_head.kernel[...], built.lm_head.kernel[...])
  half = llama.init_model(TINY, seed=0, param_dtype=jnp.bfloat16)
  assert {x.dtype for x in jax.tree.leaves(nnx.state(half, nnx.Param))} == {
      jnp.dtype(jnp.bfloat16)}


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
    llama.hf_state_dict(poet)
  sd = llama.hf_state_dict(poetx_jax.unpoetize(poet))
  np.testing.assert_allclose(sd['model.layers.0.self_attn.q_proj.weight'],
                             np.asarray(model.layers[0].self_attn.q_proj.kernel[...]).T,
                             atol=1e-6)


def test_hf_state_dict(model):
  sd = llama.hf_state_dict(model)
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

  cfg = llama.hf_config(TINY)
  assert cfg['architectures'] == ['LlamaForCausalLM'] and cfg['model_type'] == 'llama'
  assert (cfg['hidden_size'], cfg['intermediate_size'], cfg['num_hidden_layers'],
          cfg['num_attention_heads'], cfg['num_key_value_heads']) == (64, 176, 2, 4, 2)
  assert cfg['vocab_size'] == v and cfg['tie_word_embeddings'] is False
  tied = llama.hf_state_dict(Llama(get_config('tiny', tie_embeddings=True),
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


def test_remat_policies_save_only_named_residuals():
  import poetx_jax
  cfg = get_config('tiny', layers=2, vocab_size=97)
  tokens = jnp.arange(2 * 12, dtype=jnp.int32).reshape(2, 12) % 97
  inside = lambda lines: [l for l in lines if any(
      k in l for k in ('Attention.__call__', 'MLP.__call__', 'poetx_jax/ops.py'))]
  saved = {}
  for remat in ('none', 'block', 'attn'):
    model = poetx_jax.poetize(Llama(cfg, remat=remat, rngs=nnx.Rngs(0)), block_size=16,
                              rngs=nnx.Rngs(1))
    saved[remat] = _saved(model, tokens)
  # No remat keeps the attention and MLP internals and the POET block products.
  assert any('MLP.__call__' in l for l in inside(saved['none']))
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
