"""Block-rotation (Mosaic GPU) and permutation (Pallas Triton) kernels against
poetx_jax.ops, and the layer on them against the XLA path.

On a CPU host the kernels run in their interpreters; on a GPU they are compiled
(the same tests, no interpretation).

T tokens, N = K*B features, K blocks of size B.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import randomize_generators, rel_err, skew_params
from poetx_jax import POETLinear, ops

br = pytest.importorskip(
    'pallas_kernels.block_rotate',
    reason='jax.experimental.pallas.mosaic_gpu is not importable here')
pm = pytest.importorskip('pallas_kernels.permute')

INTERPRET = jax.default_backend() != 'gpu'
# One bf16 rounding of y (or of the cotangents) against a float32 product.
BF16_TOL = 1e-2


def _blocks(key, k, b, dtype):
  """Near-identity blocks (a rotation after a few steps), in dtype."""
  return (jnp.eye(b) + 0.1 * jax.random.normal(key, (k, b, b)) / np.sqrt(b)).astype(dtype)


def _f32(a):
  return jnp.asarray(a, jnp.float32)


@pytest.mark.parametrize('t, k, b, dtype', [
    (128, 2, 64, jnp.bfloat16),
    (100, 1, 128, jnp.bfloat16),     # ragged token count
    (64, 2, 256, jnp.bfloat16),
    (70, 1, 512, jnp.bfloat16),      # column-tiled G
    (64, 3, 64, jnp.float16),
    (64, 1, 192, jnp.bfloat16),      # a block size that is not a power of two
])
def test_rotate_matches_reference(keys, t, k, b, dtype):
  x = jax.random.normal(keys(), (t, k * b)).astype(dtype)
  g = _blocks(keys(), k, b, dtype)
  y = br.rotate_kernel(x, g, interpret=INTERPRET)
  assert y.shape == x.shape and y.dtype == x.dtype
  assert rel_err(y, ops.block_rotate(_f32(x), _f32(g))) < BF16_TOL


@pytest.mark.parametrize('t, k, b', [(128, 2, 64), (200, 1, 128), (64, 1, 256), (64, 1, 512)])
def test_gram_matches_reference(keys, t, k, b):
  x = jax.random.normal(keys(), (t, k * b)).astype(jnp.bfloat16)
  dy = jax.random.normal(keys(), (t, k * b)).astype(jnp.bfloat16)
  dg = br.block_gram(dy, x, b, interpret=INTERPRET)
  want = jnp.einsum('tki,tkj->kij', _f32(dy).reshape(t, k, b), _f32(x).reshape(t, k, b))
  assert dg.shape == (k, b, b) and dg.dtype == jnp.float32
  assert rel_err(dg, want) < 1e-5  # bf16 inputs, products exact in float32


@pytest.mark.parametrize('lead, k, b', [((3, 40), 2, 64), ((96,), 1, 128)])
def test_rotate_gradients_match_reference(keys, lead, k, b):
  x = jax.random.normal(keys(), lead + (k * b,)).astype(jnp.bfloat16)
  g = _blocks(keys(), k, b, jnp.bfloat16)
  ct = jax.random.normal(keys(), x.shape)

  def loss(fn, x, g):
    return jnp.sum(_f32(fn(x, g)) * ct)

  got = jax.grad(functools.partial(
      loss, functools.partial(br.block_rotate, interpret=INTERPRET)), (0, 1))(x, g)
  want = jax.grad(functools.partial(loss, ops.block_rotate), (0, 1))(_f32(x), _f32(g))
  for a, w in zip(got, want):
    assert a.dtype == jnp.bfloat16
    assert rel_err(a, w) < BF16_TOL


@pytest.mark.parametrize('t, n, dtype', [
    (37, 128, jnp.bfloat16), (64, 4096, jnp.bfloat16), (5, 192, jnp.float32),
    (9, 320, jnp.float16)])
def test_permute_is_exact(keys, t, n, dtype):
  x = jax.random.normal(keys(), (t, n)).astype(dtype)
  p = ops.random_permutation(keys(), n)
  y = pm.permute(x, p, interpret=INTERPRET)
  np.testing.assert_array_equal(np.asarray(_f32(y)), np.asarray(_f32(x[:, p])))
  ct = jax.random.normal(keys(), x.shape).astype(dtype)
  _, pull = jax.vjp(lambda x: pm.permute(x, p, interpret=INTERPRET), x)
  _, pull_ref = jax.vjp(lambda x: ops.permute(x, p), x)
  np.testing.assert_array_equal(np.asarray(_f32(pull(ct)[0])),
                                np.asarray(_f32(pull_ref(ct)[0])))


@pytest.mark.parametrize('x_shape, g_shape, dtype, match', [
    ((64, 128), (2, 64, 64), jnp.float32, 'bfloat16 or float16'),
    ((64, 100), (2, 64, 64), jnp.bfloat16, r'\(T, K\*B\) = \(T, 128\)'),
    ((64, 96), (2, 48, 48), jnp.bfloat16, 'B=48 is not supported.*multiple of 64'),
    ((64, 128), (2, 64, 32), jnp.bfloat16, r'\(K, B, B\)'),
])
def test_bad_arguments(x_shape, g_shape, dtype, match):
  with pytest.raises(ValueError, match=match):
    br.block_rotate(jnp.zeros(x_shape, dtype), jnp.zeros(g_shape, dtype),
                    interpret=INTERPRET)


def test_bad_permute_arguments():
  with pytest.raises(ValueError, match=r'idx must have shape \(8,\)'):
    pm.gather_kernel(jnp.zeros((4, 8)), jnp.arange(6), interpret=INTERPRET)


# float32 activations fall back to XLA's own product: the two paths are equal.
@pytest.mark.slow
@pytest.mark.parametrize('dtype, tol', [(jnp.bfloat16, 2e-2), (jnp.float32, 1e-6)])
def test_layer_on_kernels_matches_xla(keys, dtype, tol):
  """implementation='pallas' against 'xla': ragged widths (160 = 2.5 blocks),
  leading batch dims, values and all gradients, in bf16 (on the kernels) and
  float32 (the fallback)."""
  x = jax.random.normal(keys(), (2, 33, 160))
  ct = jax.random.normal(keys(), (2, 33, 96))
  out = {}
  for impl in ('xla', 'pallas'):
    layer = POETLinear(160, 96, block_size=64, implementation=impl, dtype=dtype,
                       rngs=nnx.Rngs(4))
    randomize_generators(layer, jax.random.key(1))
    out[impl] = nnx.value_and_grad(
        lambda m, x: (_f32(m(x)) * ct).sum(), argnums=(0, 1))(layer, x)
  (v_x, (gm_x, gx_x)), (v_p, (gm_p, gx_p)) = out['xla'], out['pallas']
  assert abs(float(v_p) - float(v_x)) < tol * abs(float(v_x)) + 1e-3
  assert rel_err(gx_p, gx_x) < tol
  for name in ('q_in', 'q_out'):
    assert rel_err(gm_p[name][...], gm_x[name][...]) < tol


@pytest.mark.slow
def test_layer_on_every_kernel_matches_reference(keys):
  """poet_linear with all kernels (series, block products, gathers), bf16,
  against the float32 XLA layer: value and the gradients of x and both sides'
  generators."""
  import pallas_kernels
  i, o, b = 192, 128, 64
  x = jax.random.normal(keys(), (40, i))
  w = jax.random.normal(keys(), (i, o)) / np.sqrt(i)
  q_in = skew_params(keys(), i // b, b, 0.1)
  q_out = skew_params(keys(), o // b, b, 0.1)
  p_in, p_out = ops.random_permutation(keys(), i), ops.random_permutation(keys(), o)
  ct = jax.random.normal(keys(), (40, o))

  def loss(x, qi, qo, dtype, impl):
    y = ops.poet_linear(x.astype(dtype), w.astype(dtype), qi, qo, p_in, p_out,
                        block_size=b, implementation=impl)
    return jnp.sum(_f32(y) * ct)

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
  v, g = grad(x, q_in, q_out, jnp.bfloat16,
              ops.Implementation(**pallas_kernels.layer_kernels(b, every_kernel=True)))
  v_ref, g_ref = grad(x, q_in, q_out, jnp.float32, None)
  assert abs(float(v) - float(v_ref)) < 2e-2 * abs(float(v_ref)) + 1e-2
  for a, r in zip(g, g_ref):
    assert rel_err(a, r) < 2e-2


@pytest.mark.skipif(not INTERPRET, reason='on a GPU the kernels compile and mem mode works')
def test_mem_mode_on_the_interpreter_is_refused_clearly():
  with pytest.raises(ValueError, match="mode='mem' needs a GPU"):
    POETLinear(128, 128, block_size=64, implementation='pallas', mode='mem',
               dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  # float32 layers do not run the kernels (they fall back to XLA's product)
  POETLinear(128, 128, block_size=64, implementation='pallas', mode='mem', rngs=nnx.Rngs(0))
