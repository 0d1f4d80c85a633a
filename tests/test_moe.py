"""The mixture-of-experts Llama: routing and capacity, auxiliary losses against
float64 references, grouped expert products and POET experts against dense
per-expert loops, merges, scanned against unrolled models (moe-tiny, CPU)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import assert_trees_rel_close, rel_err, skew_params
import poetx_jax
from poetx_jax import ops
from poetx_jax.linear import POETLinear, POETParam
from poetx_jax.models import moe
from poetx_jax.models import get_config
from poetx_jax.models.moe import MoELlama, MoEMLP, route
from poetx_jax.perms import is_chunk_permutation

TINY = get_config('moe-tiny')
HIGH = jax.lax.Precision.HIGHEST


# ------------------------------------------------------------------- config
def test_configs_and_validation():
  big = get_config('moe-7b')
  assert 6.5e9 <= big.num_params() <= 7.5e9
  assert big.active_params() < big.num_params() / 4
  shapes = nnx.eval_shape(lambda: MoELlama(TINY, rngs=nnx.Rngs(0)))
  count = sum(x.size for x in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
  assert count == TINY.num_params()
  h, m, e, k = TINY.hidden, TINY.expert_inner, TINY.experts, TINY.top_k
  assert TINY.num_params() - TINY.active_params() == TINY.layers * (e - k) * 3 * h * m
  assert TINY.expert_inner == TINY.mlp
  cfg = get_config('moe-tiny', expert_mlp=40, top_k=1)
  assert cfg.expert_inner == 40 and isinstance(cfg, poetx_jax.models.llama.LlamaConfig)
  assert MoEMLP(cfg, rngs=nnx.Rngs(0)).experts.down_proj.kernel.shape == (e, 40, h)
  for bad, msg in [(dict(top_k=5), 'top_k must be an int between 1 and experts=4, got 5'),
                   (dict(experts=0), 'experts must be a positive int, got 0'),
                   (dict(capacity_factor=0.0), 'capacity_factor must be None .* got 0.0'),
                   (dict(expert_mlp=0), 'expert_mlp must be None or a positive int'),
                   (dict(z_loss_coef=-1.0), 'z_loss_coef must be a number >= 0'),
                   (dict(heads=5), 'hidden must be divisible by heads')]:
    with pytest.raises(ValueError, match=msg):
      get_config('moe-tiny', **bad)
  with pytest.raises(ValueError, match="unknown model config 'moe-huge'; valid names"):
    get_config('moe-huge')
  with pytest.raises(ValueError, match=r"unknown MoEConfig field\(s\) \['expert'\]"):
    get_config('moe-tiny', expert=3)
  with pytest.raises(ValueError, match='a MoELlama needs a MoEConfig; a LlamaConfig describes '
                                       'a Llama: build it with config.build'):
    MoELlama(get_config('tiny'), rngs=nnx.Rngs(0))
  assert type(TINY.build(rngs=nnx.Rngs(0))) is MoELlama


# ------------------------------------------------------------------ routing
def _np_route(logits, k, capacity):
  """Routing by loops in float64: chosen experts, weights and kept flags per slot."""
  logits = np.asarray(logits, np.float64)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  n, e = p.shape
  chosen = np.argsort(-p, axis=-1, kind='stable')[:, :k]
  top = np.take_along_axis(p, chosen, -1)
  seen = np.zeros(e, int)
  kept = np.zeros((n, k), bool)
  for i in range(n):            # earlier tokens first
    for j in range(k):
      ex = chosen[i, j]
      kept[i, j] = capacity is None or seen[ex] < capacity
      seen[ex] += 1
  return p, chosen, top / top.sum(-1, keepdims=True), kept


@pytest.mark.parametrize('capacity_factor', [None, 1.0, 0.5])
def test_route_top_k_and_capacity(keys, capacity_factor):
  n, e, k = 40, 6, 3
  logits = 2.0 * jax.random.normal(keys(), (n, e))
  logits = logits.at[:, 1].add(1.5)  # an overloaded expert
  r = jax.jit(route, static_argnums=(1, 2))(logits, k, capacity_factor)
  cap = moe.expert_capacity(n, e, k, capacity_factor)
  p, chosen, w, kept = _np_route(logits, k, cap)
  np.testing.assert_array_equal(np.asarray(r.expert_S).reshape(n, k), chosen)
  np.testing.assert_array_equal(np.asarray(r.kept_S).reshape(n, k), kept)
  np.testing.assert_allclose(np.asarray(r.weight_S).reshape(n, k), np.where(kept, w, 0),
                             rtol=1e-6, atol=1e-7)
  counts = np.bincount(chosen.ravel(), minlength=e)
  np.testing.assert_array_equal(r.stats['tokens_per_expert'], counts)
  assert int(r.stats['dropped']) == (~kept).sum() == (
      0 if cap is None else np.maximum(counts - cap, 0).sum())
  if capacity_factor == 0.5:
    assert int(r.stats['dropped']) > 0
  # order: kept slots grouped by expert, in token order, dropped slots last
  sizes = np.asarray(r.group_sizes_E)
  np.testing.assert_array_equal(sizes, counts if cap is None else np.minimum(counts, cap))
  order = np.asarray(r.order_S)
  assert sorted(order) == list(range(n * k))
  ex = np.asarray(r.expert_S)[order]
  for g, start in enumerate(np.cumsum(sizes) - sizes):
    block = order[start:start + sizes[g]]
    assert (ex[start:start + sizes[g]] == g).all() and (np.diff(block) > 0).all()
  assert not np.asarray(r.kept_S)[order[sizes.sum():]].any()


def test_aux_losses_against_float64(keys):
  n, e, k = 64, 8, 2
  logits = 3.0 * jax.random.normal(keys(), (n, e))
  stats = jax.jit(lambda x: route(x, k).stats)(logits)
  p, chosen, _, _ = _np_route(logits, k, None)
  f = np.bincount(chosen.ravel(), minlength=e) / (n * k)
  lb = e * np.sum(f * p.mean(0))
  x = np.asarray(logits, np.float64)
  lse = np.log(np.exp(x).sum(-1))
  np.testing.assert_allclose(stats['load_balance'], lb, rtol=1e-5)
  np.testing.assert_allclose(stats['z_loss'], np.mean(lse ** 2), rtol=1e-5)
  # d(load balance)/d logits_n = E/N p_n * (f - <p_n, f>); d z/d logits_n = 2 lse_n p_n / N
  both = lambda x: jnp.stack([route(x, k).stats['load_balance'], route(x, k).stats['z_loss']])
  g_lb, g_z = jax.jit(jax.jacrev(both))(logits)
  want_lb = e / n * p * (f - (p * f).sum(-1, keepdims=True))
  np.testing.assert_allclose(g_lb, want_lb, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(g_z, 2 * lse[:, None] * p / n, rtol=1e-4, atol=1e-7)
  uniform = jax.jit(lambda x: route(x, 1).stats['load_balance'])(
      jnp.tile(jnp.eye(e) * 5, (4, 1)))
  assert float(uniform) == pytest.approx(1.0, rel=1e-5)  # balanced routing gives 1


# ------------------------------------------------------- experts vs dense loop
def _dense_moe(x, router_kernel, kernels, k, kept=None):
  """For each token, the sum over its chosen experts of weight * SwiGLU_e(x):
  every expert applied to every token (float32, full precision)."""
  wg, wu, wd = kernels
  x = x.astype(jnp.float32)
  p = jax.nn.softmax(jnp.dot(x, router_kernel, precision=HIGH), axis=-1)
  top_p, top_e = jax.lax.top_k(p, k)
  w = top_p / top_p.sum(-1, keepdims=True)
  if kept is not None:
    w = jnp.where(kept, w, 0.0)
  dense_w = jnp.zeros_like(p).at[jnp.arange(x.shape[0])[:, None], top_e].add(w)  # (N, E)
  mm = lambda a, b: jnp.einsum('ni,eio->eno', a, b.astype(jnp.float32), precision=HIGH)
  h = jax.nn.silu(mm(x, wg)) * mm(x, wu)
  y = jnp.einsum('enh,eho->eno', h, wd.astype(jnp.float32), precision=HIGH)
  return jnp.einsum('ne,eno->no', dense_w, y, precision=HIGH)


def _kernels(mlp):
  ex = mlp.experts
  return tuple(getattr(ex, n).kernel[...] for n in ('gate_proj', 'up_proj', 'down_proj'))


@pytest.mark.parametrize('dtype,tol', [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_grouped_experts_match_dense_loop(keys, dtype, tol):
  mlp = MoEMLP(TINY, dtype=dtype, rngs=nnx.Rngs(0))
  x = jax.random.normal(keys(), (3, 16, TINY.hidden)).astype(dtype)
  c = jax.random.normal(keys(), x.shape)

  @nnx.jit
  def run(mlp, x):
    def loss(mlp, x):
      y, _ = mlp(x)
      return jnp.sum(y.astype(jnp.float32) * c), y
    (_, y), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(mlp, x)
    return y, grads

  y, (g_mlp, g_x) = run(mlp, x)
  assert y.dtype == dtype

  def ref_loss(router, kernels, x):
    y = _dense_moe(x.reshape(-1, TINY.hidden), router, kernels, TINY.top_k)
    return jnp.sum(y.reshape(x.shape) * c), y.reshape(x.shape)

  router, kernels = mlp.router.kernel[...], _kernels(mlp)
  (_, y_ref), g_ref = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2), has_aux=True))(
      router, kernels, x.astype(jnp.float32))
  assert rel_err(y, y_ref) < tol
  assert rel_err(g_x, g_ref[2]) < tol
  assert rel_err(g_mlp.router.kernel[...], g_ref[0]) < 5 * tol
  for got, want in zip(_kernels(g_mlp), g_ref[1]):
    assert rel_err(got, want) < tol


def test_capacity_drops_reach_the_output(keys):
  cfg = get_config('moe-tiny', capacity_factor=0.5)
  mlp = MoEMLP(cfg, rngs=nnx.Rngs(1))
  x = jax.random.normal(keys(), (32, cfg.hidden))
  y, stats = nnx.jit(lambda m, x: m(x))(mlp, x)
  logits = jnp.dot(x, mlp.router.kernel[...], precision=HIGH)
  cap = moe.expert_capacity(32, cfg.experts, cfg.top_k, 0.5)
  _, _, _, kept = _np_route(logits, cfg.top_k, cap)
  assert int(stats['dropped']) == (~kept).sum() > 0
  want = _dense_moe(x, mlp.router.kernel[...], _kernels(mlp), cfg.top_k, kept)
  assert rel_err(y, want) < 2e-6
  gone = np.flatnonzero(~kept.any(-1))
  assert gone.size and float(jnp.abs(y[gone]).max()) == 0.0  # the residual carries them


# ------------------------------------------------------------------ POET experts
def _randomize(model, key, scale=0.1):
  """Generators of every POET layer (stacks too) with blocks of spectral norm ``scale``."""
  for _, layer in poetx_jax.poet_layers(model):
    for name in ('q_in', 'q_out'):
      key, sub = jax.random.split(key)
      v = getattr(layer, name)
      v[...] = skew_params(sub, int(np.prod(v.shape[:-1])), layer.block_size,
                           scale).reshape(v.shape)


def _poet_mlp(key, **kw):
  mlp = poetx_jax.poetize(MoEMLP(TINY, rngs=nnx.Rngs(0)), block_size=TINY.block_size,
                          rngs=nnx.Rngs(1), **kw)
  _randomize(mlp, key)
  return mlp


@pytest.mark.slow
@pytest.mark.parametrize('mode,dtype,tol', [('fast', jnp.float32, 2e-6),
                                            ('mem', jnp.float32, 2e-6),
                                            ('fast', jnp.bfloat16, 2e-2)])
def test_poet_experts_match_effective_kernels(keys, mode, dtype, tol):
  mlp = _poet_mlp(keys(), mode=mode, dtype=dtype)
  assert type(mlp.router) is moe.Router  # poetize leaves the router dense
  layers = [layer for _, layer in poetx_jax.poet_layers(mlp)]
  assert len(layers) == 3 and all(layer.stack_shape == (TINY.experts,) for layer in layers)
  x = jax.random.normal(keys(), (24, TINY.hidden)).astype(dtype)
  c = jax.random.normal(keys(), x.shape)

  @nnx.jit
  def run(mlp):
    def loss(mlp):
      y, _ = mlp(x)
      return jnp.sum(y.astype(jnp.float32) * c), y
    out = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, POETParam), has_aux=True)(mlp)
    return out, poetx_jax.linear_operands(mlp.experts.up_proj, x)[1]

  ((_, y), grads), formed = run(mlp)
  ex = mlp.experts
  qs = {n: (getattr(ex, n).q_in[...], getattr(ex, n).q_out[...])
        for n in ('gate_proj', 'up_proj', 'down_proj')}

  def ref_loss(qs):
    kernels = []
    for n in ('gate_proj', 'up_proj', 'down_proj'):
      p = getattr(ex, n)
      kernels.append(jax.vmap(lambda *a: ops.poet_kernel(
          *a, block_size=p.block_size, terms=p.terms))(
              p.kernel[...], *qs[n], p.perm_in[...], p.perm_out[...]))
    y = _dense_moe(x, mlp.router.kernel[...], kernels, TINY.top_k)
    return jnp.sum(y * c), (y, kernels[1])

  (_, (y_ref, eff)), g_ref = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))(qs)
  assert rel_err(y, y_ref) < tol
  for n in qs:
    g = getattr(grads.experts, n)
    assert rel_err(g.q_in[...], g_ref[n][0]) < 2 * tol
    assert rel_err(g.q_out[...], g_ref[n][1]) < 2 * tol
  # the kernels the layer forms are the effective kernels, rounded to dtype
  assert formed.dtype == dtype and rel_err(formed, eff) < tol


@pytest.mark.slow
@pytest.mark.parametrize('permutation', ['element', 'chunk'])
def test_merge_keeps_each_experts_function(keys, permutation):
  """A merge keeps each expert's function and draws each expert its own
  permutations (with ``'chunk'``: each a permutation of runs of 4)."""
  chunk = dict(permutation='chunk', chunk_size=4) if permutation == 'chunk' else {}
  mlp = _poet_mlp(keys(), **chunk)
  x = jax.random.normal(keys(), (40, TINY.hidden))
  fwd = nnx.jit(lambda m, x: m(x)[0])
  before = fwd(mlp, x)
  kernels = poetx_jax.effective_kernel(mlp.experts.down_proj)
  perms = np.asarray(mlp.experts.down_proj.perm_in[...])
  err = poetx_jax.merge(mlp, rngs=nnx.Rngs(5))
  assert 0 < float(err) < 1e-4
  after = fwd(mlp, x)
  assert rel_err(after, before) < 2e-6
  assert rel_err(poetx_jax.effective_kernel(mlp.experts.down_proj), kernels) < 2e-6
  new = np.asarray(mlp.experts.down_proj.perm_in[...])
  assert all(not np.array_equal(a, b) for a, b in zip(new, perms))  # each redrawn
  assert len({tuple(p) for p in new}) == TINY.experts                 # each its own
  for _, layer in poetx_jax.poet_layers(mlp):
    assert float(jnp.abs(layer.q_in[...]).max()) == 0.0
    if chunk:
      assert all(is_chunk_permutation(p, 4) for p in (layer.perm_in[...], layer.perm_out[...]))


def test_poetize_a_stacked_linear():
  """A Linear with a (2, 3) stack of kernels becomes a POETLinear stack:
  the same kernels at Q = 0, each entry its own permutations, the stack's
  layer_axis tag kept, and back to a stacked Linear."""
  init = lambda key, shape, dtype: jax.random.normal(key, (2, 3) + shape, dtype)
  lin = nnx.Linear(32, 24, kernel_init=init, bias_init=init, rngs=nnx.Rngs(0))
  lin.kernel.set_metadata(layer_axis=0)
  poet = poetx_jax.poetize(lin, block_size=8, rngs=nnx.Rngs(1))
  assert isinstance(poet, POETLinear) and poet.stack_shape == (2, 3)
  assert poet.q_in.shape == (2, 3, 4, ops.skew_size(8))
  assert all(v.get_metadata().get('layer_axis') == 0
             for v in (poet.kernel, poet.q_in, poet.perm_out, poet.bias))
  np.testing.assert_allclose(poetx_jax.effective_kernel(poet), lin.kernel[...], rtol=1e-6)
  np.testing.assert_array_equal(poet.bias[...], lin.bias[...])
  assert len({tuple(p) for p in np.asarray(poet.perm_in[...]).reshape(6, -1)}) == 6
  back = poetx_jax.unpoetize(poet)
  assert type(back) is nnx.Linear
  np.testing.assert_allclose(back.kernel[...], lin.kernel[...], rtol=1e-6)


def test_poetize_refuses_a_bias_shared_by_a_stack():
  """A stacked kernel (E, I, O) with one bias (O,) is refused naming the
  layer and the shapes (it once gave layer e the scalar bias[e] as its bias);
  a bias per layer, broadcast, converts."""
  lin = nnx.Linear(32, 24, rngs=nnx.Rngs(0))
  lin.kernel.set_value(jax.random.normal(jax.random.key(0), (3, 32, 24)))
  lin.bias.set_value(jnp.arange(24, dtype=jnp.float32))
  model = nnx.Dict(experts=lin)
  with pytest.raises(ValueError, match=r"cannot poetize layer 'experts'.*needs a bias per "
                     r"layer, shape \(3, 24\); got \(24,\) \(one bias shared"):
    poetx_jax.poetize(model, block_size=8, rngs=nnx.Rngs(1))
  lin.bias.set_value(jnp.broadcast_to(lin.bias[...], (3, 24)))
  poet = poetx_jax.poetize(model, block_size=8, rngs=nnx.Rngs(1))['experts']
  np.testing.assert_array_equal(poet.bias[...], np.broadcast_to(np.arange(24.0), (3, 24)))


# ------------------------------------------------------------------- the model
def _tokens(key, b=2, t=16):
  return jax.random.randint(key, (b, t), 0, TINY.vocab_size, jnp.int32)


@nnx.jit
def _loss_and_grads(model, tokens):
  def loss(model):
    logits, aux = model.forward(tokens)
    lm = -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
    return lm + aux['aux_loss'], (logits, aux)
  (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(model)
  return out, grads


@nnx.jit
def _router_logits(model, tokens):
  """Each unrolled layer's router logits, running the layers by hand."""
  h = model.embed_tokens(tokens)
  pos = jnp.arange(tokens.shape[1])[None]
  out = []
  for layer in model.layers:
    h = h + layer.self_attn(layer.input_layernorm(h), pos)
    x = layer.post_attention_layernorm(h)
    out.append(jnp.dot(x.reshape(-1, TINY.hidden), layer.mlp.router.kernel[...],
                       precision=HIGH))
    h = h + layer.mlp(x)[0]
  return out


def _reference_aux(model, tokens):
  """Load balance and z-loss, means over layers, in float64 from the router logits."""
  lbs, zs = [], []
  for logits in _router_logits(model, tokens):
    logits = np.asarray(logits, np.float64)
    p, chosen, _, _ = _np_route(logits, TINY.top_k, None)
    f = np.bincount(chosen.ravel(), minlength=TINY.experts) / chosen.size
    lbs.append(TINY.experts * np.sum(f * p.mean(0)))
    zs.append(np.mean(np.log(np.exp(logits).sum(-1)) ** 2))
  return np.mean(lbs), np.mean(zs)


@pytest.mark.slow
def test_model_forward_backward_scanned_and_aux(keys):
  tokens = _tokens(keys())
  flat = MoELlama(TINY, rngs=nnx.Rngs(0), remat='attn')
  scanned = MoELlama(TINY, rngs=nnx.Rngs(0), scan_layers=True, remat='block')
  (logits, aux), grads = _loss_and_grads(flat, tokens)
  assert logits.shape == (2, 16, TINY.vocab_size) and logits.dtype == jnp.float32
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(nnx.state(grads)))
  assert float(jnp.abs(grads.layers[1].mlp.router.kernel[...]).max()) > 0
  lb, z = _reference_aux(flat, tokens)
  np.testing.assert_allclose(aux['load_balance'], lb, rtol=1e-5)
  np.testing.assert_allclose(aux['router_z_loss'], z, rtol=1e-5)
  assert float(aux['aux_loss']) == pytest.approx(TINY.aux_loss_coef * lb
                                                 + TINY.z_loss_coef * z, rel=1e-5)
  assert float(aux['aux_loss']) > 0 and int(aux['dropped']) == 0
  assert int(aux['expert_tokens'].sum()) == TINY.layers * 2 * 16 * TINY.top_k

  (logits_s, aux_s), grads_s = _loss_and_grads(scanned, tokens)
  assert rel_err(logits_s, logits) < 1e-5
  chex.assert_trees_all_close(aux_s, aux, rtol=1e-5)
  stacked = nnx.to_pure_dict(nnx.state(grads_s.layers.layer))
  for i in range(TINY.layers):
    assert_trees_rel_close(jax.tree.map(lambda g: g[i], stacked),
                           nnx.to_pure_dict(nnx.state(grads.layers[i])), 1e-4)


@pytest.mark.slow
def test_scanned_poet_model_nested_stacks(keys):
  tokens = _tokens(keys())
  dense = MoELlama(TINY, rngs=nnx.Rngs(0), scan_layers=True)
  convert = lambda layer: poetx_jax.poetize(layer, block_size=TINY.block_size, rngs=poet_rngs,
                                            exclude=('lm_head', 'self_attn'))
  poet_rngs = nnx.Rngs(1)
  model = MoELlama(TINY, rngs=nnx.Rngs(0), scan_layers=True, convert_layer=convert)
  up = model.layers.layer.mlp.experts.up_proj
  assert isinstance(up, POETLinear) and up.stack_shape == (TINY.layers, TINY.experts)
  assert type(model.layers.layer.mlp.router) is moe.Router
  fwd = nnx.jit(lambda m, t: m.forward(t))
  assert rel_err(fwd(model, tokens)[0], fwd(dense, tokens)[0]) < 1e-5  # Q = 0
  key = keys()
  for _, layer in poetx_jax.poet_layers(model):
    for name in ('q_in', 'q_out'):
      key, sub = jax.random.split(key)
      v = getattr(layer, name)
      v[...] = 0.02 * jax.random.normal(sub, v.shape)
  eff = poetx_jax.effective_kernel(up)
  assert eff.shape == (TINY.layers, TINY.experts, TINY.hidden, TINY.expert_inner)
  one = model.layers[1].mlp.experts.up_proj
  assert one.stack_shape == (TINY.experts,)
  assert rel_err(poetx_jax.effective_kernel(one), eff[1]) < 1e-6
  assert 0 < float(poetx_jax.orthogonality_error(up)) < 1e-3
  before, aux = fwd(model, tokens)
  poetx_jax.merge(model, rngs=nnx.Rngs(2))
  after, aux_after = fwd(model, tokens)
  assert rel_err(after, before) < 1e-5
  np.testing.assert_array_equal(aux_after['expert_tokens'], aux['expert_tokens'])
  up = model.layers.layer.mlp.experts.up_proj
  assert float(jnp.abs(up.q_in[...]).max()) == 0.0
  assert rel_err(poetx_jax.effective_kernel(up), eff) < 1e-5


def test_a_dense_llama_refuses_an_moe_config():
  from poetx_jax.models.llama import Llama
  with pytest.raises(ValueError, match='a Llama needs a LlamaConfig; a MoEConfig describes '
                                       'a MoELlama: build it with config.build'):
    Llama(get_config('moe-tiny'), rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_the_moe_decoder_layer_batches_its_attention_series(keys, monkeypatch):
  """The MoE decoder layer is the dense one's call: its four POET attention
  projections take their rotation blocks from one batched series, so only
  the three expert stacks form their own (rotation_blocks_pair), and the
  layer's output is that of each projection computing its own series."""
  model = poetx_jax.poetize(get_config('moe-tiny').build(rngs=nnx.Rngs(0)), block_size=16,
                            rngs=nnx.Rngs(1))
  layer = model.layers[0]
  _randomize(layer, keys())
  x = jax.random.normal(keys(), (2, 8, 64))
  calls = []
  pair = ops.rotation_blocks_pair
  monkeypatch.setattr(ops, 'rotation_blocks_pair', lambda *a, **k: calls.append(1) or pair(*a, **k))
  # compiled (the calls counted as it traces): one program each, not op by op
  y, _ = nnx.jit(lambda layer, x: layer(x))(layer, x)
  assert len(calls) == 3

  @nnx.jit
  def apart(layer, x):  # outside the layer: each projection its own series
    h = x + layer.self_attn(layer.input_layernorm(x))
    return h + layer.mlp(layer.post_attention_layernorm(h))[0]

  np.testing.assert_allclose(np.asarray(y), np.asarray(apart(layer, x)), rtol=1e-6, atol=1e-6)
