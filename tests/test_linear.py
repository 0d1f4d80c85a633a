"""POETLinear against nnx.Linear and the naive R W0 P formula."""

import contextlib
import io

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from conftest import dense_rotation, gathered, randomize_generators, rel_err
import poetx_jax
from poetx_jax import POETLinear, POETParam, ops

# Each form with each mode; the input form's 'fast' case, the slowest, is
# left to the full suite.
FORMS_AND_MODES = [pytest.param('input', 'fast', marks=pytest.mark.slow), ('input', 'mem'),
                   ('weight', 'fast'), ('weight', 'mem')]


def _as_function(layer):
  """(x, q_in, q_out) -> layer(x) with those generators, a pure function."""
  graphdef, state = nnx.split(layer)

  def f(x, q_in, q_out):
    m = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))  # fresh Variables
    m.q_in[...], m.q_out[...] = q_in, q_out
    return m(x)

  return f


def _naive(layer, x, q_in, q_out):
  """x @ (R W0 P)^T + b with R and P materialised as dense matrices."""
  i, o, b = layer.in_features, layer.out_features, layer.block_size
  p = dense_rotation(q_in, layer.perm_in[...], i, block_size=b)
  r = dense_rotation(q_out, layer.perm_out[...], o, block_size=b)
  w0 = ops.permute_kernel(layer.kernel[...].astype(jnp.float32),
                          ops.invert_permutation(layer.perm_in[...]),
                          ops.invert_permutation(layer.perm_out[...])).T
  y = x.astype(jnp.float32) @ (r @ w0 @ p).T
  return y + layer.bias[...] if layer.bias is not None else y


@pytest.mark.parametrize('use_bias', [True, False])
def test_identity_at_zero_q_equals_linear(keys, use_bias):
  seed = int(jax.random.randint(keys(), (), 0, 2 ** 30))
  lin = nnx.Linear(24, 40, use_bias=use_bias, rngs=nnx.Rngs(seed),
                   bias_init=nnx.initializers.normal(1.0))
  layer = POETLinear.from_linear(lin, block_size=8, rngs=nnx.Rngs(seed + 1))
  x = jax.random.normal(keys(), (3, 5, 24))
  assert rel_err(layer(x), lin(x)) < 1e-6
  np.testing.assert_allclose(layer.effective_kernel(), lin.kernel[...], atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize('i,o,b', [(64, 96, 32), (60, 90, 16)])  # the second: ragged blocks
def test_spectrum_preserved(keys, i, o, b):
  """The singular values of R W0 P are those of W0 up to the factors'
  departure from orthogonality: with e = max over blocks of ||G^T G - I||_2
  for each side, each moves by a factor within [sqrt((1-e_in)(1-e_out)),
  sqrt((1+e_in)(1+e_out))]; the kernel itself moves by much more."""
  w0 = np.asarray(jax.random.normal(keys(), (i, o)), np.float64)
  lin = nnx.Linear(i, o, rngs=nnx.Rngs(0), kernel_init=lambda *_: jnp.asarray(w0, jnp.float32))
  layer = POETLinear.from_linear(lin, block_size=b, rngs=nnx.Rngs(1))  # stored permuted
  randomize_generators(layer, keys(), 0.2)  # a truncation error well above rounding
  eff = np.asarray(layer.effective_kernel(), np.float64)
  assert np.linalg.norm(eff - w0) > 0.1 * np.linalg.norm(w0)  # it did rotate
  e_in, e_out = (max(np.linalg.norm(g.T @ g - np.eye(b), ord=2) for g in np.asarray(
      blocks, np.float64)) for blocks in layer.rotation_blocks())
  assert 0 < max(e_in, e_out) < 1e-3, (e_in, e_out)
  bound = 1 - np.sqrt((1 - e_in) * (1 - e_out)) + 1e-5  # + float32 rounding
  sv0 = np.linalg.svd(w0, compute_uv=False)
  sv = np.linalg.svd(eff, compute_uv=False)
  np.testing.assert_array_less(np.abs(sv / sv0 - 1), bound)


@pytest.mark.parametrize('form,mode', FORMS_AND_MODES)
@pytest.mark.parametrize('i,o,b', [(32, 48, 16), (30, 20, 8)])
def test_gradients_match_naive_float32(keys, mode, form, i, o, b):
  layer = POETLinear(i, o, block_size=b, mode=mode, form=form, rngs=nnx.Rngs(1),
                     bias_init=nnx.initializers.normal(1.0))
  layer.kernel[...] = jax.random.normal(keys(), (i, o)) / np.sqrt(i)
  randomize_generators(layer, keys())
  x = jax.random.normal(keys(), (2, 7, i))
  ct = jax.random.normal(keys(), (2, 7, o))

  apply = _as_function(layer)

  def loss(x, q_in, q_out):
    return (apply(x, q_in, q_out) * ct).sum()

  def loss_ref(x, q_in, q_out):
    return (_naive(layer, x, q_in, q_out) * ct).sum()

  args = (x, layer.q_in[...], layer.q_out[...])
  v, g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
  v_ref, g_ref = jax.jit(jax.value_and_grad(loss_ref, argnums=(0, 1, 2)))(*args)
  assert rel_err(v, v_ref) < 1e-5
  for a, r in zip(g, g_ref):
    assert rel_err(a, r) < 1e-5


@pytest.mark.parametrize('form,mode', FORMS_AND_MODES)
def test_gradients_match_naive_bf16(keys, mode, form):
  i, o, b = 64, 40, 16  # 40 = 16 + 16 + 8: a ragged block on the output side
  layer = POETLinear(i, o, block_size=b, mode=mode, form=form, dtype=jnp.bfloat16,
                     param_dtype=jnp.bfloat16, rngs=nnx.Rngs(2))
  layer.kernel[...] = (jax.random.normal(keys(), (i, o)) / 8).astype(jnp.bfloat16)
  randomize_generators(layer, keys())
  x = jax.random.normal(keys(), (64, i)).astype(jnp.bfloat16)
  ct = jax.random.normal(keys(), (64, o))

  @nnx.jit
  def run(m, x):  # compiled: one program, not some hundred op by op
    loss = lambda m, x: (m(x).astype(jnp.float32) * ct).sum()
    return m(x), nnx.grad(loss, argnums=(0, 1))(m, x)

  y, grads = run(layer, x)
  assert y.dtype == jnp.bfloat16

  def loss_ref(x, q_in, q_out):
    y = _naive(layer, x, q_in, q_out)
    return (y * ct).sum(), y

  (_, y_ref), g_ref = jax.jit(jax.value_and_grad(loss_ref, argnums=(0, 1, 2), has_aux=True))(
      x.astype(jnp.float32), layer.q_in[...], layer.q_out[...])
  assert rel_err(y, y_ref) < 2e-2
  assert rel_err(grads[1], g_ref[0]) < 2e-2
  assert rel_err(grads[0]['q_in'][...], g_ref[1]) < 2e-2
  assert rel_err(grads[0]['q_out'][...], g_ref[2]) < 2e-2


def _activation_residuals(layer, x):
  """Saved residuals of the layer's backward with a token-sized leading dim."""
  apply = _as_function(layer)

  def f(x, q_in, q_out):
    return apply(x, q_in, q_out).sum()

  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    print_saved_residuals(f, x, layer.q_in[...], layer.q_out[...])
  lines = [l for l in buf.getvalue().splitlines() if 'from the argument' not in l]
  return [l for l in lines if l.split('[')[1].startswith(f'{x.shape[0]},')]


@pytest.mark.slow
def test_reverse_mode_jacobian_and_forward_mode_refused(keys):
  """jax.jacrev through a POET layer is the dense formula's Jacobian; forward
  mode (jax.jacfwd) is refused by JAX's custom_vjp rule, as the docstring
  says, rather than giving a wrong answer."""
  layer = POETLinear(16, 8, block_size=8, rngs=nnx.Rngs(0))
  randomize_generators(layer, keys())
  x = jax.random.normal(keys(), (2, 16))
  jac = jax.jit(jax.jacrev(lambda x: layer(x)))(x)  # compiled: one program, not op by op
  dense = layer.effective_kernel()
  want = jnp.einsum('ab,io->aobi', jnp.eye(2), dense)  # d y[a, o] / d x[b, i]
  assert rel_err(jac, want) < 1e-5
  with pytest.raises(TypeError, match='forward-mode autodiff'):
    jax.jacfwd(lambda x: layer(x))(x)


def test_mem_mode_saves_fewer_residuals(keys):
  x = jax.random.normal(keys(), (37, 48))
  fast = POETLinear(48, 32, block_size=16, mode='fast', rngs=nnx.Rngs(3))
  mem = POETLinear(48, 32, block_size=16, mode='mem', rngs=nnx.Rngs(3))
  randomize_generators(fast, jax.random.key(0))
  randomize_generators(mem, jax.random.key(0))
  res_fast = _activation_residuals(fast, x)
  res_mem = _activation_residuals(mem, x)
  assert len(res_fast) == 2, res_fast  # the rotated input and the GEMM output
  assert res_mem == [], res_mem        # only x itself, an argument
  g = [nnx.jit(nnx.grad(lambda m: m(x).sum()))(m) for m in (fast, mem)]
  for name in ('q_in', 'q_out'):
    np.testing.assert_allclose(g[0][name][...], g[1][name][...], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_mem_mode_recomputes_the_series(keys):
  """POET-Xmem saves only its arguments: no rotation blocks or series powers
  (which 'fast' keeps: the check can see them)."""
  x = jax.random.normal(keys(), (37, 48))
  blocks = {}
  for mode in ('fast', 'mem'):
    layer = POETLinear(48, 32, block_size=16, mode=mode, rngs=nnx.Rngs(3))
    randomize_generators(layer, jax.random.key(0))
    apply = _as_function(layer)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
      print_saved_residuals(lambda x, a, b: apply(x, a, b).sum(), x, layer.q_in[...],
                            layer.q_out[...])
    saved = [l for l in buf.getvalue().splitlines() if l and 'from the argument' not in l]
    blocks[mode] = [l for l in saved if ',16,16]' in l]  # (K, B, B) blocks
  assert blocks['fast'], 'fast mode saves no blocks: the check cannot see them'
  assert blocks['mem'] == [], blocks['mem']


def test_weight_form_saves_no_activations(keys):
  x = jax.random.normal(keys(), (37, 48))
  layer = POETLinear(48, 32, block_size=16, form='weight', rngs=nnx.Rngs(3))
  randomize_generators(layer, jax.random.key(0))
  assert _activation_residuals(layer, x) == []  # x (an argument) and weight-sized arrays


@pytest.mark.slow
def test_base_weight_gets_no_gradient_and_no_optimizer_state():
  import optax
  layer = POETLinear(32, 16, block_size=8, rngs=nnx.Rngs(0))
  grads = nnx.jit(nnx.grad(lambda m: m(jnp.ones((2, 32))).sum()))(layer)
  assert set(grads.keys()) == {'q_in', 'q_out', 'bias'}
  opt = nnx.Optimizer(layer, optax.adam(1e-3), wrt=POETParam)
  n_poet = layer.q_in[...].size + layer.q_out[...].size
  n_state = sum(x.size for x in jax.tree.leaves(nnx.as_pure(opt.opt_state)))
  assert n_state == 2 * n_poet + 1  # two moments and a step counter


def test_bad_input_errors():
  rngs = nnx.Rngs(0)
  with pytest.raises(ValueError, match='block_size must be > 1, got 1'):
    POETLinear(8, 8, block_size=1, rngs=rngs)
  with pytest.raises(ValueError, match='block_size=16 is larger than the dimension 8'):
    POETLinear(32, 8, block_size=16, rngs=rngs)
  with pytest.raises(ValueError, match="mode must be one of \\('fast', 'mem'\\), got 'slow'"):
    POETLinear(8, 8, block_size=4, mode='slow', rngs=rngs)
  with pytest.raises(ValueError, match="form must be one of \\('input', 'weight', 'auto'\\), "
                                       "got 'w'"):
    POETLinear(8, 8, block_size=4, form='w', rngs=rngs)
  with pytest.raises(ValueError, match='terms must be an int >= 1'):
    POETLinear(8, 8, block_size=4, terms=0, rngs=rngs)
  conv = nnx.Linear(8, 8, rngs=rngs)
  conv.kernel = nnx.Param(jnp.ones((3, 8, 8)))
  with pytest.raises(ValueError, match='2-D kernel'):
    POETLinear.from_linear(conv, block_size=4, rngs=rngs)


def test_implementation_choice():
  """'xla' computes every piece in jnp; 'pallas' replaces the block products
  only (the kernel path itself is compared with XLA in
  test_pallas_block_rotate); 'auto', the default, is XLA off GPUs (the fused
  kernels' layers: test_fused_layers)."""
  from poetx_jax.linear import implementation_for
  assert implementation_for('xla', 64) is None and implementation_for('auto', 64) is None
  assert POETLinear(64, 64, block_size=32, rngs=nnx.Rngs(0)).implementation == 'auto'
  impl = implementation_for('pallas', 64)
  assert impl.rotate is not None and impl.series is None and impl.permute is None
  assert impl.permute_rotate is None and impl.fuse is None
  with pytest.raises(ValueError, match='multiple of 64, at most 512, got 32'):
    POETLinear(64, 64, block_size=32, implementation='pallas', rngs=nnx.Rngs(0))
  fused = implementation_for('fused', 64)  # the fused kernels on every 16-bit side
  assert fused.permute_rotate is not None and fused.rotate is None and fused.permute is None
  assert fused.fuse(jnp.zeros((2, 128), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16))
  assert not fused.fuse(jnp.zeros((2, 128), jnp.float32), jnp.zeros((2, 64, 64), jnp.float32))
  with pytest.raises(ValueError, match="'fused' takes a block size that is a power of two "
                     'from 16 to 512, got 24'):
    POETLinear(48, 48, block_size=24, implementation='fused', rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="implementation must be one of .*got 'triton'"):
    POETLinear(64, 64, block_size=32, implementation='triton', rngs=nnx.Rngs(0))


@pytest.mark.parametrize('implementation', ['xla', 'pallas'])
@pytest.mark.parametrize('quantize', [None, 'int8'])
@pytest.mark.parametrize('mode,form', [('fast', 'input'), ('mem', 'input'),
                                       ('fast', 'weight'), ('mem', 'weight')])
def test_wrong_input_width_is_a_clear_error(keys, implementation, quantize, mode, form):
  """Wider inputs are not truncated, narrower ones not read past their end,
  off-by-one ones not broadcast: each names both sizes."""
  if implementation == 'pallas' and mode == 'mem':
    pytest.skip('the CPU interpreter cannot be rematerialised (its own test)')
  i, b = (128, 64) if implementation == 'pallas' else (12, 4)
  layer = POETLinear(i, 8 * b // 4, block_size=b, mode=mode, form=form, quantize=quantize,
                     implementation=implementation, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  # The right width is accepted (traced, not run: the values are other tests')
  want = jax.ShapeDtypeStruct((3, 8 * b // 4), jnp.bfloat16)
  assert jax.eval_shape(lambda x: layer(x), jax.ShapeDtypeStruct((3, i), jnp.float32)) == want
  for width in (i + 4, i - 4, i - 1, i + 1):
    x = jax.random.normal(keys(), (3, width))
    with pytest.raises(ValueError, match=f"shape \\(3, {width}\\): their last axis must "
                                         f"hold the layer's {i} input features, it holds {width}"):
      layer(x)
    with pytest.raises(ValueError, match=f'{i} input features'):
      jax.jit(lambda x: layer(x))(x)  # at trace time


@pytest.mark.parametrize('form,mode', FORMS_AND_MODES)
def test_skipped_permutations_are_the_callers_gathers(keys, mode, form):
  """permute_input=False takes x[..., perm_in]; permute_output=False returns
  y[..., perm_out]: values and gradients those of the whole layer (exactly in
  the input form, where only a gather moves)."""
  i, o = 24, 40
  layer = POETLinear(i, o, block_size=8, mode=mode, form=form, rngs=nnx.Rngs(3),
                     bias_init=nnx.initializers.normal(1.0))
  randomize_generators(layer, keys())
  x = jax.random.normal(keys(), (3, 5, i))
  ct = jax.random.normal(keys(), (3, 5, o))
  p_in, p_out = layer.perm_in[...], layer.perm_out[...]
  graphdef, state, rest = nnx.split(layer, nnx.Param, ...)

  def loss(state, x, skip):
    m = nnx.merge(graphdef, state, rest)
    if skip:
      y = m(x[..., p_in], permute_input=False, permute_output=False)
      return (y * ct[..., p_out]).sum(), y
    y = m(x)
    return (y * ct).sum(), y[..., p_out]

  grad = jax.grad(loss, argnums=(0, 1), has_aux=True)
  (g_state, g_x), y = grad(state, x, False)
  (g_state_s, g_x_s), y_s = grad(state, x, True)
  assert not np.array_equal(p_in, np.arange(i)) and not np.array_equal(p_out, np.arange(o))
  if form == 'input':
    np.testing.assert_array_equal(y_s, y)
    np.testing.assert_array_equal(g_x_s, g_x)
  tol = 0 if form == 'input' else 1e-6
  assert rel_err(y_s, y) <= tol and rel_err(g_x_s, g_x) <= tol
  for name in ('q_in', 'q_out', 'bias'):
    assert rel_err(g_state_s[name][...], g_state[name][...]) <= max(tol, 1e-7), name


def _swiglu_loss(mlp, weights):
  """``(loss(state, x, joined), state)``: the sum of ``weights`` times the
  SwiGLU of ``mlp``'s gate, up and down projections, through
  ``poetx_jax.swiglu`` (joined) or the three layers one by one, as a function
  of ``mlp``'s Params."""
  graphdef, state, rest = nnx.split(mlp, nnx.Param, ...)

  def loss(state, x, joined):
    m = nnx.merge(graphdef, state, rest)
    if joined:
      y = poetx_jax.swiglu(m['gate_proj'], m['up_proj'], m['down_proj'], x)
    else:
      y = m['down_proj'](jax.nn.silu(m['gate_proj'](x)) * m['up_proj'](x))
    return (y.astype(jnp.float32) * weights).sum()

  return loss, state


@pytest.mark.slow
@pytest.mark.parametrize('mode', ['fast', 'mem'])
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_swiglu_joins_poet_gathers_exactly(keys, mode, dtype):
  """poetx_jax.swiglu of POET layers gathers the gate and up outputs straight
  into the down projection's order (ops.gather_between): loss and gradients
  equal the three layers applied one by one, bit for bit."""
  hidden, inner = 64, 176
  lin = lambda i, o, s: poetx_jax.POETLinear.from_linear(
      nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=nnx.Rngs(s)), block_size=16,
      mode=mode, rngs=nnx.Rngs(s + 10))
  mlp = nnx.Dict(gate_proj=lin(hidden, inner, 0), up_proj=lin(hidden, inner, 1),
                 down_proj=lin(inner, hidden, 2))
  poet = [mlp[n] for n in ('gate_proj', 'up_proj', 'down_proj')]
  for lin in poet:
    lin.q_in[...] = 0.05 * jax.random.normal(keys(), lin.q_in.shape)
    lin.q_out[...] = 0.05 * jax.random.normal(keys(), lin.q_out.shape)
  x = jax.random.normal(keys(), (2, 8, hidden), dtype)
  ct = jax.random.normal(keys(), (2, 8, hidden), dtype)
  loss, state = _swiglu_loss(mlp, ct)

  value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
  got, want = value_and_grad(state, x, True), value_and_grad(state, x, False)
  chex.assert_trees_all_equal(got, want)
  assert float(jnp.abs(want[1][1]).max()) > 0

  gathers = lambda joined: len(gathered(lambda s, x: loss(s, x, joined), state, x))
  assert (gathers(True), gathers(False)) == (5, 6)  # activation gathers in the forward


@pytest.mark.slow
def test_swiglu_join_under_batched_series_gathers_by_given_inverses(keys):
  """Under batched_series the SwiGLU join of input-form layers takes its
  index and that index's inverse from the block's inverses (gathers, no
  scatter of its own): loss and gradients bit for bit those of the join
  outside it, with one scatter in the whole program."""
  hidden, inner = 64, 176
  lin = lambda i, o, s: poetx_jax.POETLinear.from_linear(
      nnx.Linear(i, o, use_bias=False, rngs=nnx.Rngs(s)), block_size=16, rngs=nnx.Rngs(s + 10))
  mlp = nnx.Dict(gate_proj=lin(hidden, inner, 0), up_proj=lin(hidden, inner, 1),
                 down_proj=lin(inner, hidden, 2))
  for layer in mlp.values():
    randomize_generators(layer, keys())
  x = jax.random.normal(keys(), (2, 8, hidden))
  ct = jax.random.normal(keys(), (2, 8, hidden))
  graphdef, state, rest = nnx.split(mlp, nnx.Param, ...)

  def loss(state, x, batched):
    m = nnx.merge(graphdef, state, rest)
    with poetx_jax.batched_series(m, x) if batched else contextlib.nullcontext():
      y = poetx_jax.swiglu(m['gate_proj'], m['up_proj'], m['down_proj'], x)
    return (y * ct).sum()

  got, want = (jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(state, x, b)
               for b in (True, False))
  chex.assert_trees_all_equal(got, want)
  scatters = lambda b: str(jax.make_jaxpr(jax.grad(loss), static_argnums=2)(
      state, x, b)).count(' scatter[')
  # outside: per join an inverse of perm_out and one of its index; down's output
  assert (scatters(True), scatters(False)) == (1, 5)


@pytest.mark.slow
def test_a_capped_layer_merges_the_rotation_it_applied(keys):
  """With max_generator_norm the layer applies, forms and merges the rotation
  of its capped generators: the merged base keeps the function."""
  layer = POETLinear(48, 32, block_size=16, max_generator_norm=0.4, use_bias=False,
                     rngs=nnx.Rngs(0))
  layer.q_in[...] = jax.random.normal(keys(), layer.q_in.shape)   # far over the cap
  layer.q_out[...] = jax.random.normal(keys(), layer.q_out.shape)
  x = jax.random.normal(keys(), (5, 48))
  y = layer(x)
  assert rel_err(y, x @ layer.effective_kernel()) < 1e-5
  assert float(layer.orthogonality_error()) < 0.05
  poetx_jax.merge(layer, rngs=nnx.Rngs(1))
  assert rel_err(layer(x), y) < 1e-4
  with pytest.raises(ValueError, match=r'max_generator_norm must be None or a number in '
                                       r'\(0, 1\)'):
    POETLinear(48, 32, block_size=16, max_generator_norm=1.5, rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_auto_form_takes_the_form_of_fewer_flops_per_call(keys):
  """form='auto' resolves per call from the token count (ops.choose_form:
  I O (T + 6B) < 3 T B (I + O) picks the weight form) and then computes
  exactly what that explicit form computes, values and gradients."""
  assert ops.choose_form(16384, 768, 768, 256) == 'weight'     # a 130M Llama's layers
  assert ops.choose_form(16384, 2048, 768, 256) == 'weight'
  assert ops.choose_form(8192, 4096, 14336, 256) == 'input'    # an 8B Llama's
  assert ops.choose_form(8192, 2048, 2048, 256) == 'input'     # a 1B Llama's
  # the boundary: I = O = 3B at large T flips at T = 6B I / (I - 3B) ... here
  # I = O = 64, B = 16: 64*64*(T + 96) < 3*T*16*128 <=> T > 192
  assert ops.choose_form(192, 64, 64, 16) == 'input' and ops.choose_form(193, 64, 64, 16) == 'weight'
  layer = POETLinear(64, 64, block_size=16, form='auto', rngs=nnx.Rngs(3))
  randomize_generators(layer, keys())
  for tokens, want in ((8, 'input'), (512, 'weight')):
    x = jax.random.normal(keys(), (tokens, 64))
    assert layer.form_for(x.shape) == want
    explicit = POETLinear(64, 64, block_size=16, form=want, rngs=nnx.Rngs(3))
    nnx.update(explicit, nnx.state(layer))
    grad = nnx.jit(nnx.value_and_grad(lambda m, x: (m(x) ** 2).sum(), argnums=(0, 1)))
    chex.assert_trees_all_equal(grad(layer, x), grad(explicit, x))
  with pytest.raises(ValueError, match="form must be one of .*got 'fast'"):
    ops.resolve_form('fast', (4, 64), 64, 64, 16)


@pytest.mark.slow
@pytest.mark.parametrize('form', ['weight', 'auto'])
def test_swiglu_of_weight_form_layers_gathers_no_activations(keys, form):
  """A down projection in the weight form takes its input permutation in its
  weight: swiglu is then the plain formula (values and gradients bit for
  bit), and with gate and up in the weight form too no activation is gathered."""
  hidden, inner, tokens = 64, 176, 512  # auto: the weight form for all three at B = 32
  lin = lambda i, o, s: poetx_jax.POETLinear.from_linear(
      nnx.Linear(i, o, use_bias=False, rngs=nnx.Rngs(s)), block_size=32, form=form,
      rngs=nnx.Rngs(s + 10))
  mlp = nnx.Dict(gate_proj=lin(hidden, inner, 0), up_proj=lin(hidden, inner, 1),
                 down_proj=lin(inner, hidden, 2))
  for layer in mlp.values():
    randomize_generators(layer, keys())
    assert layer.form_for((tokens, layer.in_features)) == 'weight'
  x = jax.random.normal(keys(), (tokens, hidden))
  loss, state = _swiglu_loss(mlp, x)

  value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
  chex.assert_trees_all_equal(value_and_grad(state, x, True), value_and_grad(state, x, False))
  shapes = gathered(lambda s, x: loss(s, x, True), state, x)
  assert shapes and all(tokens not in shape for shape in shapes)  # weights only


def _series_block(dtype=jnp.float32):
  """POET layers of two block sizes (one side ragged), one in mode 'mem', and a
  plain Linear, as in a decoder block."""
  rngs = nnx.Rngs(0)
  kw = dict(dtype=dtype, rngs=rngs)
  return nnx.Dict(
      a=POETLinear(64, 48, block_size=16, **kw), b=POETLinear(48, 64, block_size=16, **kw),
      c=POETLinear(64, 40, block_size=16, form='weight', **kw),  # 40: a ragged block
      d=POETLinear(64, 64, block_size=32, **kw),
      e=POETLinear(64, 64, block_size=16, mode='mem', **kw),
      f=nnx.Linear(64, 64, **kw))


def _series_forward(m, x, batched):
  def body():
    h = m['b'](jax.nn.silu(m['a'](x)))
    return (h + m['d'](x) + m['e'](x) + m['f'](x)).sum() + m['c'](x).sum()
  if batched:
    with poetx_jax.batched_series(m, x):
      return body()
  return body()


@pytest.mark.slow
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_batched_series_gives_each_layers_own_values_and_gradients(keys, dtype):
  """Under batched_series the layers of a block use blocks computed in one
  series per block size: the loss and every gradient are those of each layer
  computing its own series, bit for bit."""
  m = _series_block(dtype)
  for layer in m.values():
    if isinstance(layer, POETLinear):
      randomize_generators(layer, keys())
  x = jax.random.normal(keys(), (4, 8, 64), dtype)
  grads = [nnx.jit(nnx.value_and_grad(_series_forward, argnums=(0, 1)),
                   static_argnums=2)(m, x, batched) for batched in (True, False)]
  chex.assert_trees_all_equal(*grads)
  assert float(jnp.abs(grads[0][1][0]['a']['q_in'][...]).max()) > 0


@pytest.mark.slow
def test_batched_series_inverts_the_blocks_permutations_at_once(keys):
  """Under batched_series the eight permutations of the four 'fast' layers
  are inverted by one scatter: of the forward's six inversions (the output
  permutations of a, b, d; both of c, in the weight form; e's output) five
  become one, and the backward's (a, b, d: their input permutations) none."""
  m = _series_block()
  x = jax.random.normal(keys(), (4, 8, 64))

  def scatters(batched, grad):
    f = lambda x: _series_forward(m, x, batched)
    return str(jax.make_jaxpr(jax.grad(f) if grad else f)(x)).count(' scatter[')

  assert (scatters(False, False), scatters(True, False)) == (6, 2)
  assert (scatters(False, True), scatters(True, True)) == (10, 3)  # e: 2 of its own


def test_batched_series_runs_one_series_per_block_size(keys):
  """The block's four 'fast' POET layers take two series (B = 16 and 32), not
  one each: fewer products in the traced program; the 'mem' layer and a
  layer called on inputs of another dtype than the block's input compute their
  own."""
  m = _series_block()
  x = jax.random.normal(keys(), (4, 8, 64))
  terms = m['a'].terms

  def dots(batched):
    jaxpr = jax.make_jaxpr(lambda x: _series_forward(m, x, batched))(x)
    return sum(str(e.primitive) == 'dot_general' for e in jaxpr.jaxpr.eqns)

  # each series is terms - 1 products: 5 series (a, b, c, d, e) become 3 (B 16, B 32, e)
  assert dots(False) - dots(True) == 2 * (terms - 1)
  # A layer whose compute dtype follows its inputs (dtype None, bf16 base):
  # the block's float32 input sets HIGHEST precision for its series; a call
  # on bf16 inputs (DEFAULT precision) computes a series of its own.
  layer = POETLinear(64, 64, block_size=16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1))

  def call_dots(dtype):
    def f(x):
      with poetx_jax.batched_series(layer, x):
        return layer(x.astype(dtype))
    jaxpr = jax.make_jaxpr(f)(x)
    return sum(str(e.primitive) == 'dot_general' for e in jaxpr.jaxpr.eqns)

  assert call_dots(jnp.bfloat16) - call_dots(jnp.float32) == terms - 1


def test_using_blocks_gives_layers_their_rotation_blocks_while_the_block_runs(keys):
  """Under using_blocks a layer computes with the blocks and inverses given
  for it: identity blocks make it the layer at zero generators; blocks of
  another series precision than its input's are not used (its own series
  then), its inverses are; an inner using_blocks overrides the outer one for
  the layers it names, which applies again once it ends, and after both the
  layer computes its own series."""
  layer = POETLinear(32, 32, block_size=16, rngs=nnx.Rngs(0))
  randomize_generators(layer, keys())
  at_zero = nnx.clone(layer)
  at_zero.q_in[...] = jnp.zeros_like(at_zero.q_in[...])
  at_zero.q_out[...] = jnp.zeros_like(at_zero.q_out[...])
  x = jax.random.normal(keys(), (4, 32))
  own, identity = layer(x), at_zero(x)
  assert rel_err(own, identity) > 1e-3
  eye = jnp.broadcast_to(jnp.eye(16), (2, 16, 16))
  inverses = (ops.invert_permutation(layer.perm_in[...]),
              ops.invert_permutation(layer.perm_out[...]))
  given = lambda precision: {id(layer): (eye, eye, precision, inverses)}
  with poetx_jax.linear.using_blocks(given(ops.series_precision(x.dtype))):
    assert poetx_jax.linear.given_inverses(layer) is inverses
    assert rel_err(layer(x), identity) < 1e-6
    with poetx_jax.linear.using_blocks({id(layer): (*layer.rotation_blocks(),
                                                    ops.series_precision(x.dtype), inverses)}):
      assert rel_err(layer(x), own) < 1e-6
    assert rel_err(layer(x), identity) < 1e-6
    with poetx_jax.linear.using_blocks(given(jax.lax.Precision.DEFAULT)):
      assert rel_err(layer(x), own) < 1e-6
  assert poetx_jax.linear.given_inverses(layer) is None
  assert rel_err(layer(x), own) == 0


def test_pinned_activations_constrain_a_layers_input_and_output_only_inside_the_block():
  """Under linear.pinned_activations every POET layer called pins its input
  and its output (two sharding constraints in the traced program, the
  output's last); outside the block, none; the values are unchanged."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from poetx_jax.linear import pinned_activations
  layer = POETLinear(16, 8, block_size=4, rngs=nnx.Rngs(0))
  randomize_generators(layer, jax.random.key(1))
  x = jax.random.normal(jax.random.key(2), (3, 16))
  where = NamedSharding(poetx_jax.sharding.make_mesh(), P())

  def constraints(jaxpr):
    eqns = jaxpr.jaxpr.eqns
    return [i for i, e in enumerate(eqns) if e.primitive.name == 'sharding_constraint'], len(eqns)

  assert constraints(jax.make_jaxpr(lambda a: layer(a))(x))[0] == []
  with pinned_activations(where):
    pinned = jax.make_jaxpr(lambda a: layer(a))(x)
    y = jax.jit(lambda a: layer(a))(x)
  found, n = constraints(pinned)
  assert len(found) == 2 and found[-1] == n - 1, pinned
  np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(lambda a: layer(a))(x)))
