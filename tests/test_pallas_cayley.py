"""Mosaic GPU Cayley–Neumann kernel against ops.cayley_neumann.

On a CPU host the kernel runs in the Mosaic GPU interpreter; on a GPU it is
compiled (the same tests, no interpretation).

K blocks, B block size, P = B(B-1)/2 packed skew parameters per block.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from poetx_jax import ops

cn = pytest.importorskip(
    'pallas_kernels.cayley_neumann',
    reason='jax.experimental.pallas.mosaic_gpu is not importable here')


INTERPRET = jax.default_backend() == 'cpu'
# The interpreter multiplies in float32; compiled on Hopper, a float32 WGMMA
# multiplies in TF32 (measured on the H200: ~2e-5 relative error in G).
F32_TOL = 1e-5 if INTERPRET else 1e-4


@functools.lru_cache(maxsize=None)
def _interpreter_problem():
  """None if the kernel runs on this host (interpreted on CPU), else why not."""
  try:
    q = ops.unpack_skew(jnp.zeros((1, ops.skew_size(64))), 64)
    g = cn.cayley_neumann(q, terms=2, interpret=INTERPRET)
    if not np.allclose(np.asarray(g), np.eye(64)[None]):
      return 'Mosaic GPU interpreter ran but returned wrong values for Q = 0'
  except Exception as e:  # pylint: disable=broad-except
    return f'Mosaic GPU interpret mode cannot run the kernel: {type(e).__name__}: {e}'
  return None


@pytest.fixture
def interpreter():
  """Skips the test, with the reason, where the interpreter cannot run the kernel."""
  problem = _interpreter_problem()
  if problem:
    pytest.skip(problem)


needs_interpreter = pytest.mark.usefixtures('interpreter')


def _skew_blocks(key, k, b):
  p_KxP = 0.1 / np.sqrt(b) * jax.random.normal(key, (k, ops.skew_size(b)))
  return ops.unpack_skew(p_KxP, b)


@needs_interpreter
@pytest.mark.parametrize('b, terms', [(64, 1), (64, 4), (128, 1), (128, 4)])
def test_matches_reference_float32(keys, b, terms):
  q = _skew_blocks(keys(), 3, b)
  g = cn.cayley_neumann(q, terms=terms, interpret=INTERPRET)
  assert g.shape == (3, b, b) and g.dtype == jnp.float32
  assert rel_err(g, ops.cayley_neumann(q, terms)) < F32_TOL


@needs_interpreter
@pytest.mark.parametrize('b, terms', [(64, 4), (128, 1)])
def test_matches_reference_bfloat16_out(keys, b, terms):
  q = _skew_blocks(keys(), 2, b)
  g = cn.cayley_neumann(q, terms=terms, out_dtype=jnp.bfloat16, interpret=INTERPRET)
  assert g.dtype == jnp.bfloat16
  assert rel_err(g, ops.cayley_neumann(q, terms)) < 1e-2


@needs_interpreter
def test_block_256_tiled(keys):
  """B = 256 in float32: row tiles of 64 and streamed Q panels."""
  q = _skew_blocks(keys(), 1, 256)
  g = cn.cayley_neumann(q, terms=4, interpret=INTERPRET)
  assert rel_err(g, ops.cayley_neumann(q, 4)) < F32_TOL


@needs_interpreter
def test_config_tiles(keys):
  q = _skew_blocks(keys(), 2, 128)
  g = cn.cayley_neumann(q, terms=3, interpret=INTERPRET,
                        config=cn.Config(tile_m=128, tile_k=16))
  assert rel_err(g, ops.cayley_neumann(q, 3)) < F32_TOL


@needs_interpreter
def test_gradient_matches_reference(keys):
  b = 64
  p_KxP = 0.1 / np.sqrt(b) * jax.random.normal(keys(), (2, ops.skew_size(b)))
  w = jax.random.normal(keys(), (2, b, b))

  def loss(fn, p):
    return jnp.sum(w * fn(ops.unpack_skew(p, b)))

  got = jax.grad(functools.partial(
      loss, lambda q: cn.cayley_neumann(q, terms=4, interpret=INTERPRET)))(p_KxP)
  want = jax.grad(functools.partial(
      loss, lambda q: ops.cayley_neumann(q, 4)))(p_KxP)
  assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize('shape, kwargs, match', [
    ((2, 64), {}, 'shape'),
    ((2, 64, 32), {}, 'square'),
    ((2, 48, 48), {}, 'multiple of 64'),
    ((2, 64, 64), {'terms': 0}, 'terms'),
    ((2, 64, 64), {'out_dtype': jnp.float16}, 'out_dtype'),
    ((2, 64, 64), {'config': cn.Config(tile_m=96)}, 'tile_m'),
    ((2, 64, 64), {'config': cn.Config(tile_k=12)}, 'tile_k'),
    ((2, 256, 256), {'config': cn.Config(tile_m=256)}, 'shared memory'),
])
def test_bad_arguments(shape, kwargs, match):
  with pytest.raises(ValueError, match=match):
    cn.cayley_neumann(jnp.zeros(shape, jnp.float32), interpret=INTERPRET, **kwargs)
