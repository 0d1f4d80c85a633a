"""The run kernels (Pallas Mosaic GPU, chunk permutations) against poetx_jax.ops.

On a CPU host the kernels run in the Mosaic GPU interpreter; on a GPU the
same tests compile them. Every input is fresh random data (never zeros), so
an output element no program writes fails the comparisons. T = 72 and 40
are no multiple of the token tile (64): the padded rows must not leak into
the results or the grams.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from poetx_jax import ops

rr = pytest.importorskip('pallas_kernels.run_rotate')
fref = pytest.importorskip('pallas_kernels.fused_reference')

INTERPRET = jax.default_backend() != 'gpu'
TOL = 1e-2  # one 16-bit rounding of a result (or of a cotangent) against float32

# (T, N, B, chunk, dtype): runs of 32, 64 and 128 bytes, one and several blocks.
CASES = [
    (72, 128, 64, 16, jnp.bfloat16),
    (40, 256, 128, 32, jnp.bfloat16),
    (64, 128, 64, 64, jnp.float16),
]


def _inputs(keys, t, n, b, chunk, dtype):
  x = jax.random.normal(keys(), (t, n), jnp.float32)
  g = jnp.eye(b) + jax.random.normal(keys(), (n // b, b, b)) / np.sqrt(b)
  return x, g, ops.random_permutation(keys(), n, chunk)


def _close(got, want):
  got = np.asarray(jnp.asarray(got, jnp.float32))
  assert got.shape == want.shape and np.isfinite(got).all()
  assert rel_err(got, want) < TOL, rel_err(got, want)


@pytest.mark.parametrize('t, n, b, chunk, dtype', CASES)
def test_gather_rotate_and_rotate_scatter_match_ops(keys, t, n, b, chunk, dtype):
  x, g, p = _inputs(keys, t, n, b, chunk, dtype)
  runs = rr.run_table(p, chunk)
  np.testing.assert_array_equal(ops.chunk_permutation(runs, n, chunk), p)
  v = rr.gather_rotate(x.astype(dtype), runs, g.astype(dtype), chunk=chunk,
                       interpret=INTERPRET)
  assert v.dtype == dtype
  _close(v, ops.rotate_features(x[:, p], g))
  y = rr.rotate_scatter(x.astype(dtype), g.astype(dtype), runs, chunk=chunk,
                        interpret=INTERPRET)
  z = ops.rotate_features(x, g)
  _close(y, ops.unpermute(z, p))
  _close(y[:, p], z)  # y[:, p[c]] = z[:, c]


@pytest.mark.parametrize('t, n, b, chunk, dtype', CASES)
def test_gram_matches_the_einsum_of_the_gathered_operand(keys, t, n, b, chunk, dtype):
  """``gram`` (the Mosaic reduction for 128-byte runs, XLA's einsum below)
  and ``run_gram`` where it applies: float32 sums of exact 16-bit products."""
  a, _, p = _inputs(keys, t, n, b, chunk, dtype)
  x = jax.random.normal(keys(), (t, n)).astype(dtype)
  a = a.astype(dtype)
  want = fref.block_gram_reference(a.astype(jnp.float32), x.astype(jnp.float32), b,
                                   b_src=p, chunk=chunk)
  runs = rr.run_table(p, chunk)
  got = rr.gram(a, x, runs, block_size=b, chunk=chunk, interpret=INTERPRET)
  assert got.shape == (n // b, b, b) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  if chunk * jnp.dtype(dtype).itemsize == rr.GRAM_RUN_BYTES:
    np.testing.assert_allclose(rr.run_gram(a, x, runs, block_size=b, chunk=chunk,
                                           interpret=INTERPRET), want, rtol=1e-5, atol=1e-4)


def _vjp_check(kernel_fn, ops_fn, x, g, dtype):
  ct = jax.random.normal(jax.random.key(11), x.shape)
  y, pull = jax.vjp(kernel_fn, x.astype(dtype), g)
  want, pull_ref = jax.vjp(ops_fn, x, g)
  _close(y, want)
  dx, dg = pull(ct.astype(dtype))
  dx_ref, dg_ref = pull_ref(ct)
  assert dx.dtype == dtype and dg.dtype == g.dtype
  _close(dx, dx_ref)
  _close(dg, dg_ref)


@pytest.mark.parametrize('t, n, b, chunk, dtype', CASES)
def test_layer_sides_values_and_gradients(keys, t, n, b, chunk, dtype):
  """permute_rotate and rotate_unpermute against ops' gathers of runs and
  block products: values, dx and dg (float32 generators' blocks)."""
  x, g, p = _inputs(keys, t, n, b, chunk, dtype)
  _vjp_check(lambda x, g: rr.permute_rotate(x, p, g, chunk=chunk, interpret=INTERPRET),
             lambda x, g: ops.rotate_features(ops.permute(x, p, chunk=chunk), g), x, g, dtype)
  _vjp_check(lambda x, g: rr.rotate_unpermute(x, g, p, chunk=chunk, interpret=INTERPRET),
             lambda x, g: ops.unpermute(ops.rotate_features(x, g), p, chunk=chunk), x, g,
             dtype)


def test_leading_axes_and_the_calls_it_refuses(keys):
  x, g, p = _inputs(keys, 24, 128, 64, 16, jnp.bfloat16)
  x3 = x.reshape(2, 12, 128).astype(jnp.bfloat16)
  v = rr.permute_rotate(x3, p, g, chunk=16, interpret=INTERPRET)
  assert v.shape == x3.shape
  _close(v.reshape(24, 128), ops.rotate_features(x[:, p], g))
  assert rr.supports(128, 64, 16, jnp.bfloat16) and rr.supports(4096, 256, 64, jnp.float16)
  assert not rr.supports(128, 64, 16, jnp.float32)       # 16-bit only
  assert not rr.supports(96, 64, 16, jnp.bfloat16)       # a ragged last block
  assert not rr.supports(128, 64, 8, jnp.bfloat16)       # 16-byte runs
  assert not rr.supports(256, 32, 16, jnp.bfloat16)      # B not a multiple of 64
  with pytest.raises(ValueError, match='16-bit x of width K\\*B.*float32'):
    rr.permute_rotate(x, p, g, chunk=16, interpret=INTERPRET)
  with pytest.raises(ValueError, match=r'the permutation must have shape \(128,\)'):
    rr.permute_rotate(x.astype(jnp.bfloat16), p[:64], g, chunk=16, interpret=INTERPRET)
