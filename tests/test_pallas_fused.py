"""The fused gather + block-product kernels (Pallas Triton) against poetx_jax.ops.

On a CPU host the kernels run in the Pallas interpreter, which fills outputs
with NaN before the kernel runs: an element no program writes fails every
comparison below (all inputs are fresh random numbers, never zeros or NaN).
On a GPU the same tests compile the kernels.

T tokens, N features, K = ceil(N / B) blocks of size B (N = 48 at B = 32 has
a ragged last block of 16 columns; T = 40 is no multiple of the token tile).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from poetx_jax import ops

fr = pytest.importorskip('pallas_kernels.fused_rotate')
fref = pytest.importorskip('pallas_kernels.fused_reference')

INTERPRET = jax.default_backend() != 'gpu'
HIGHEST = jax.lax.Precision.HIGHEST
# float32 at HIGHEST against XLA's float32 product; one bf16 rounding of the
# result (or of a cotangent) against a float32 product.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
SMALL = fr.Config(tile_m=16, tile_c=16, tile_k=16)  # several tiles of every kind

# (T, N, B, dtype, config): ragged blocks, ragged token tiles, small and default tiles.
CASES = [
    (40, 48, 32, jnp.float32, None),
    (40, 48, 32, jnp.float32, SMALL),
    (64, 96, 16, jnp.float32, fr.Config(tile_m=32)),
    (40, 64, 32, jnp.bfloat16, None),
    (64, 48, 32, jnp.bfloat16, SMALL),
]


def _f32(a):
  return jnp.asarray(a, jnp.float32)


def _inputs(keys, t, n, b, dtype):
  x = jax.random.normal(keys(), (t, n)).astype(dtype)
  g = jnp.eye(b) + jax.random.normal(keys(), (-(-n // b), b, b)) / np.sqrt(b)
  return x, g, ops.random_permutation(keys(), n)


def _close(got, want, dtype):
  assert got.shape == want.shape and np.isfinite(np.asarray(_f32(got))).all()
  assert rel_err(got, want) < TOL[dtype], rel_err(got, want)


@pytest.mark.parametrize('t, n, b, dtype, config', CASES)
def test_gather_rotate_matches_reference(keys, t, n, b, dtype, config):
  x, g, p = _inputs(keys, t, n, b, dtype)
  v = fr.gather_rotate(x, p, g, config=config, interpret=INTERPRET)
  assert v.dtype == x.dtype
  _close(v, ops.rotate_features(_f32(x)[:, p], g, precision=HIGHEST), dtype)
  # any index, repeats included
  src = jax.random.randint(keys(), (n,), 0, n)
  v = fr.gather_rotate(x, src, g, config=config, interpret=INTERPRET)
  _close(v, ops.rotate_features(_f32(x)[:, src], g, precision=HIGHEST), dtype)


@pytest.mark.parametrize('t, n, b, dtype, config', CASES)
def test_rotate_scatter_matches_reference(keys, t, n, b, dtype, config):
  w, g, p = _inputs(keys, t, n, b, dtype)
  y = fr.rotate_scatter(w, g, p, config=config, interpret=INTERPRET)
  z = ops.rotate_features(_f32(w), g, precision=HIGHEST)
  assert y.dtype == w.dtype
  _close(y, ops.unpermute(z, p), dtype)
  _close(y[:, p], z, dtype)  # y[:, dst[c]] = z[:, c]


@pytest.mark.parametrize('t, n, b, dtype, config', CASES[1:4] + [
    (40, 48, 32, jnp.bfloat16, fr.Config(tile_m=32, tile_c=16))])   # (C, Q) = (16, 32)
@pytest.mark.parametrize('which', ['none', 'a', 'b', 'both'])
def test_block_gram_matches_reference(keys, t, n, b, dtype, config, which):
  a, _, p = _inputs(keys, t, n, b, dtype)
  bb = jax.random.normal(keys(), (t, n)).astype(dtype)
  q = ops.random_permutation(keys(), n)
  a_src = p if which in ('a', 'both') else None
  b_src = q if which in ('b', 'both') else None
  dg = fr.block_gram(a, bb, block_size=b, a_src=a_src, b_src=b_src, config=config,
                     interpret=INTERPRET)
  want = fref.block_gram_reference(_f32(a), _f32(bb), b, a_src, b_src)
  assert dg.shape == (-(-n // b), b, b) and dg.dtype == jnp.float32
  _close(dg, want, jnp.float32)  # 16-bit products are exact in float32
  r = n - (n // b) * b
  if r:  # rows and columns past N are zero
    assert not np.asarray(dg[-1, r:]).any() and not np.asarray(dg[-1, :, r:]).any()


def _grads(f, x, g, ct):
  return jax.value_and_grad(lambda x, g: jnp.sum(_f32(f(x, g)) * ct), (0, 1))(x, g)


def _check_values_and_grads(got_fn, want_fn, x, g, dtype):
  """got_fn(x, g) on the kernels against want_fn (ops, float32): value, dx, dg."""
  ct = jax.random.normal(jax.random.key(7), x.shape)
  y = got_fn(x.astype(dtype), g)
  assert y.shape == x.shape and y.dtype == dtype
  _close(y, want_fn(x, g), dtype)
  (_, (dx, dg)) = _grads(got_fn, x.astype(dtype), g, ct)
  (_, (dx_ref, dg_ref)) = _grads(want_fn, x, g, ct)
  assert dx.dtype == dtype and dg.dtype == g.dtype
  _close(dx, dx_ref, dtype)
  _close(dg, dg_ref, dtype)


@pytest.mark.parametrize('lead, n, b, dtype, config', [
    ((40,), 48, 32, jnp.float32, SMALL),
    ((2, 20), 64, 16, jnp.float32, None),
    ((40,), 48, 32, jnp.bfloat16, None),
])
def test_permute_rotate_values_and_gradients(keys, lead, n, b, dtype, config):
  x, g, p = _inputs(keys, int(np.prod(lead)), n, b, jnp.float32)
  x = x.reshape(lead + (n,))
  _check_values_and_grads(
      lambda x, g: fr.permute_rotate(x, p, g, config=config, interpret=INTERPRET),
      lambda x, g: ops.rotate_features(ops.permute(x, p), g, precision=HIGHEST),
      x, g, dtype)


@pytest.mark.parametrize('lead, n, b, dtype, config, other_dst', [
    ((40,), 48, 32, jnp.float32, SMALL, False),
    ((40,), 48, 32, jnp.float32, None, True),
    ((2, 32), 96, 32, jnp.bfloat16, None, False),
    ((40,), 64, 16, jnp.bfloat16, SMALL, True),
])
def test_rotate_unpermute_values_and_gradients(keys, lead, n, b, dtype, config, other_dst):
  w, g, perm_out = _inputs(keys, int(np.prod(lead)), n, b, jnp.float32)
  w = w.reshape(lead + (n,))
  # another permutation, e.g. a SwiGLU join's gather_between(perm_out, perm_in)
  dst = ops.gather_between(perm_out, ops.random_permutation(keys(), n)) if other_dst \
      else perm_out
  _check_values_and_grads(
      lambda w, g: fr.rotate_unpermute(w, g, dst, config=config, interpret=INTERPRET),
      lambda w, g: ops.unpermute(ops.rotate_features(w, g, precision=HIGHEST), dst),
      w, g, dtype)


def test_entry_points_jit_and_match_the_references(keys):
  """Under jit, with G in float32 and x bf16 (the layer's case): equal to the
  module's jnp references run in bf16 (the same roundings)."""
  x, g, p = _inputs(keys, 40, 48, 32, jnp.bfloat16)
  f = jax.jit(functools.partial(fr.permute_rotate, interpret=INTERPRET))
  _close(f(x, p, g), fref.permute_rotate_reference(x, p, g), jnp.bfloat16)
  f = jax.jit(functools.partial(fr.rotate_unpermute, interpret=INTERPRET))
  _close(f(x, g, p), fref.rotate_unpermute_reference(x, g, p), jnp.bfloat16)


@pytest.mark.parametrize('kwargs, match', [
    ({'tile_m': 48}, r'Config.tile_m=48 must be a power of two'),
    ({'tile_m': 8}, r'Config.tile_m=8 must be a power of two, at least 16'),
    ({'tile_c': 24}, r'Config.tile_c=24 must be None or a power of two'),
    ({'tile_k': 0}, r'Config.tile_k=0'),
    ({'num_warps': 3}, r'Config.num_warps=3 must be 1, 2, 4, 8 or 16'),
    ({'num_stages': 0}, r'Config.num_stages=0'),
])
def test_config_errors_name_the_value(kwargs, match):
  with pytest.raises(ValueError, match=match):
    fr.Config(**kwargs)


@pytest.mark.parametrize('x_shape, g_shape, idx_n, config, match', [
    ((8, 96), (2, 48, 48), 96, None, r'B=48 is not supported.*power of two from 16 to 512'),
    ((8, 96), (2, 1024, 1024), 96, None, r'B=1024 is not supported'),
    ((8, 100), (3, 32, 32), 100, None, r'3 blocks of 32 do not cover width N=100.*= 4'),
    ((8, 64), (2, 32, 16), 64, None, r'\(K, B, B\)'),
    ((8, 64), (2, 32, 32), 60, None, r'src must have shape \(64,\)'),
    ((8, 64), (4, 16, 16), 64, fr.Config(tile_c=32), r'tile_c=32 must divide .* B=16'),
    ((64,), (2, 32, 32), 64, None, r'x must be 2-D \(T, N\)'),
])
def test_bad_arguments(x_shape, g_shape, idx_n, config, match):
  with pytest.raises(ValueError, match=match):
    fr.gather_rotate(jnp.ones(x_shape), jnp.arange(idx_n), jnp.ones(g_shape),
                     config=config, interpret=INTERPRET)


def test_bad_dtypes_and_gram_operands():
  with pytest.raises(ValueError, match='bfloat16, float16 or float32, got int32'):
    fr.rotate_scatter(jnp.ones((8, 32), jnp.int32), jnp.ones((1, 32, 32)), jnp.arange(32))
  with pytest.raises(ValueError, match=r"b must have a's shape \(8, 32\)"):
    fr.block_gram(jnp.ones((8, 32)), jnp.ones((8, 16)), block_size=32)
  with pytest.raises(ValueError, match=r'a_src must have shape \(32,\)'):
    fr.block_gram(jnp.ones((8, 32)), jnp.ones((8, 32)), block_size=32, a_src=jnp.arange(3))


def _cuda_mesh():
  dev = jax.sharding.AbstractDevice(device_kind='NVIDIA H200', num_cores=132, platform='cuda')
  return jax.sharding.AbstractMesh((1,), ('x',), abstract_device=dev)


@pytest.mark.parametrize('n', [2048, 5632])
def test_kernels_lower_to_triton_for_an_h200(n):
  """Each kernel, and both entry points' forward and backward, lower to
  Triton IR for CUDA at a layer's size (T = 8192, B = 256, bf16) on this
  host: the Pallas -> Triton lowering accepts every op and shape. (Triton's
  own compilation to PTX runs only in XLA on a GPU.)"""
  t, b = 8192, 256
  x = jax.ShapeDtypeStruct((t, n), jnp.bfloat16)
  g = jax.ShapeDtypeStruct((n // b, b, b), jnp.float32)
  p = jax.ShapeDtypeStruct((n,), jnp.int32)

  def fwd_bwd(f):
    def run(x, g, p):
      y, pull = jax.vjp(lambda x, g: f(x, g, p), x, g)
      return y, pull(y)
    return run

  programs = {
      'gather_rotate': (lambda x, g, p: fr.gather_rotate(x, p, g), 1),
      'rotate_scatter': (lambda x, g, p: fr.rotate_scatter(x, g, p), 1),
      'block_gram': (lambda x, g, p: fr.block_gram(x, x, block_size=b, a_src=p, b_src=p), 1),
      'permute_rotate': (fwd_bwd(lambda x, g, p: fr.permute_rotate(x, p, g)), 3),
      'rotate_unpermute': (fwd_bwd(fr.rotate_unpermute), 3),
  }
  for name, (f, calls) in programs.items():
    with jax.sharding.use_abstract_mesh(_cuda_mesh()):
      text = jax.jit(f).trace(x, g, p).lower(lowering_platforms=('cuda',)).as_text()
    assert text.count('__gpu$xla.gpu.triton') == calls, name


def test_kernels_compile_for_sm90_without_spills(monkeypatch, tmp_path):
  """Where the ``triton`` package is installed (not a dependency; the H200
  image has it): the Triton IR of each kernel at its default tiles, as the
  entry points run them (T = 8192, N = 14336, B = 256, bf16), compiles for
  sm_90 with wgmma, fits shared memory and does not spill registers (ptxas).
  XLA compiles the IR with its own Triton, so this is evidence, not proof."""
  triton = pytest.importorskip('triton')
  import re
  import subprocess
  from triton.backends.compiler import GPUTarget
  from jax._src.pallas.triton import pallas_call_registration as registration

  modules = []
  lower = registration.lowering.lower_jaxpr_to_triton_module

  def capture(*args, **kwargs):
    result = lower(*args, **kwargs)
    modules.append(result.module.operation.get_asm(enable_debug_info=False))
    return result
  monkeypatch.setattr(registration.lowering, 'lower_jaxpr_to_triton_module', capture)

  t, n, b = 8192, 14336, 256
  x = jax.ShapeDtypeStruct((t, n), jnp.bfloat16)
  g = jax.ShapeDtypeStruct((n // b, b, b), jnp.bfloat16)
  p = jax.ShapeDtypeStruct((n,), jnp.int32)
  kernels = {
      'gather_rotate': lambda x, g, p: fr.gather_rotate(x, p, g),
      'rotate_scatter': lambda x, g, p: fr.rotate_scatter(x, g, p),
      'block_gram_a_src': lambda x, g, p: fr.block_gram(x, x, block_size=b, a_src=p),
      'block_gram_b_src': lambda x, g, p: fr.block_gram(x, x, block_size=b, b_src=p),
  }
  cfg = fr.Config()
  for name, f in kernels.items():
    modules.clear()
    with jax.sharding.use_abstract_mesh(_cuda_mesh()):
      jax.jit(f).trace(x, g, p).lower(lowering_platforms=('cuda',))
    (module,) = modules
    path = tmp_path / f'{name}.ttir'
    path.write_text(module)
    kernel = triton.compile(str(path), target=GPUTarget('cuda', 90, 32),
                            options={'num_warps': cfg.num_warps, 'num_stages': cfg.num_stages})
    assert 'wgmma' in kernel.asm['ptx'], name
    assert kernel.metadata.shared <= 227 * 1024, (name, kernel.metadata.shared)
    (tmp_path / f'{name}.ptx').write_text(kernel.asm['ptx'])
    info = subprocess.run([triton.knobs.nvidia.ptxas.path, '-arch=sm_90a', '-v',
                           str(tmp_path / f'{name}.ptx'), '-o', str(tmp_path / 'k.cubin')],
                          capture_output=True, text=True, check=True).stderr
    spills = [int(v) for v in re.findall(r'(\d+) bytes spill (?:stores|loads)', info)]
    assert spills and not any(spills), (name, info)
