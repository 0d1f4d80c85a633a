"""POET layers on the fused gather kernels (``implementation='auto'`` on GPUs)
against the XLA path: the layer, its sides alone, a SwiGLU join placed by
``output_dst``, tied permutations, values and gradients; CPU runs stay XLA's.

The kernels run in the Pallas interpreter here (``fused_kernels(always=True)``
forces them at these small shapes), compiled on a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import randomize_generators, rel_err
import poetx_jax
from poetx_jax import linear, ops

pk = pytest.importorskip('pallas_kernels')
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _fused(b):
  return ops.Implementation(**pk.fused_kernels(b, always=True))


def _layer(keys, i, o, b):
  layer = poetx_jax.POETLinear(i, o, block_size=b, use_bias=False, rngs=nnx.Rngs(int(
      jax.random.randint(keys(), (), 0, 1000))))
  randomize_generators(layer, keys())
  return layer


@pytest.mark.parametrize('i, o, b', [(48, 32, 16), (64, 48, 32)])
@pytest.mark.parametrize('sides', [pytest.param((True, True), marks=pytest.mark.slow),
                                   (False, True), (True, False)])  # both sides: slow
def test_layer_on_fused_kernels_matches_xla(keys, i, o, b, sides):
  """poet_linear with the fused kernels against the XLA path in bf16 (ragged
  last blocks at 48 / 32): outputs, input and generator gradients; with
  either side's permutation left out."""
  layer = _layer(keys, i, o, b)
  x = jax.random.normal(keys(), (2, 5, i)).astype(jnp.bfloat16)
  ct = jax.random.normal(keys(), (2, 5, o)).astype(jnp.bfloat16)

  def run(impl):
    def f(x, q_in, q_out):
      y = ops.poet_linear(x, layer.kernel[...].astype(x.dtype), q_in, q_out,
                          layer.perm_in[...], layer.perm_out[...], block_size=b,
                          implementation=impl, permute_input=sides[0],
                          permute_output=sides[1])
      return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), y
    (_, y), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(
        x, layer.q_in[...], layer.q_out[...])
    return y, grads

  y_x, g_x = run(None)
  y_f, g_f = run(_fused(b))
  assert rel_err(y_f, y_x) < TOL[jnp.bfloat16]
  for a, w in zip(g_f, g_x):
    assert rel_err(a, w) < TOL[jnp.bfloat16]


def test_the_fused_path_runs_no_xla_gather(keys):
  """With the fused kernels a layer's input and output gathers are inside
  them: ops' gathers are not called (forward or backward), and no inverse
  permutation is formed."""
  from conftest import gathered
  layer = _layer(keys, 48, 32, 16)
  x = jax.random.normal(keys(), (4, 48)).astype(jnp.bfloat16)

  def f(x):
    return jnp.sum(ops.poet_linear(x, layer.kernel[...].astype(x.dtype), layer.q_in[...],
                                   layer.q_out[...], layer.perm_in[...], layer.perm_out[...],
                                   block_size=16, implementation=_fused(16)))
  assert gathered(jax.grad(f), x) == []
  assert gathered(jax.grad(lambda x: jnp.sum(ops.poet_linear(
      x, layer.kernel[...].astype(x.dtype), layer.q_in[...], layer.q_out[...],
      layer.perm_in[...], layer.perm_out[...], block_size=16))), x) != []


@pytest.mark.parametrize('form', ['input', 'weight'])
def test_output_dst_places_the_output(keys, form):
  """output_dst puts y where a permutation says (out[dst[c]] = y[perm_out[c]])
  on the XLA path and the kernels alike, with a bias too."""
  lin = nnx.Linear(48, 32, rngs=nnx.Rngs(0))
  layer = poetx_jax.POETLinear.from_linear(lin, block_size=16, form=form, rngs=nnx.Rngs(1))
  randomize_generators(layer, keys())
  x = jax.random.normal(keys(), (3, 48))
  dst = ops.random_permutation(keys(), 32)
  y = layer(x)
  want = jnp.zeros_like(y).at[:, dst].set(jnp.take(y, layer.perm_out[...], axis=-1))
  np.testing.assert_allclose(layer(x, output_dst=dst), want, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match='output_dst places the permuted output'):
    layer(x, permute_output=False, output_dst=dst)


@pytest.mark.slow
@pytest.mark.parametrize('tie', [False, True])
def test_swiglu_with_fused_kernels_matches_xla(keys, monkeypatch, tie):
  """A SwiGLU of POET layers whose implementation fuses its gathers (the gate
  and up outputs written straight into the down projection's input order by
  their output kernels) gives the XLA path's values and gradients, tied or
  not; on the CPU 'auto' is the XLA path itself."""
  mlp = nnx.Dict(gate=nnx.Linear(48, 64, use_bias=False, rngs=nnx.Rngs(0)),
                 up=nnx.Linear(48, 64, use_bias=False, rngs=nnx.Rngs(1)),
                 down=nnx.Linear(64, 48, use_bias=False, rngs=nnx.Rngs(2)))
  poet = poetx_jax.poetize(mlp, block_size=16, rngs=nnx.Rngs(3), dtype=jnp.bfloat16)
  if tie:
    poet['gate'].tie_out = poet['up'].tie_out = poet['down'].tie_in = 'h'
    poet['down'].perm_in[...] = poet['gate'].perm_out[...]
    poet['up'].perm_out[...] = poet['gate'].perm_out[...]
  for name in ('gate', 'up', 'down'):
    randomize_generators(poet[name], keys())
  x = jax.random.normal(keys(), (2, 4, 48)).astype(jnp.bfloat16)
  assert linear.implementation_for('auto', 16) is None  # the CPU: XLA

  def loss(m, x):
    y = poetx_jax.swiglu(m['gate'], m['up'], m['down'], x)
    return jnp.sum(jnp.sin(y.astype(jnp.float32)))

  def run():
    return nnx.value_and_grad(loss, argnums=(0, 1))(poet, x)

  (v_x, (gm_x, gx_x)) = run()
  fused = _fused(16)
  monkeypatch.setattr(linear, 'implementation_for',
                      lambda name, b: fused if name == 'auto' else None)
  (v_f, (gm_f, gx_f)) = run()
  from conftest import gathered
  graph, state = nnx.split(poet)
  pure = lambda state, x: jax.grad(lambda x: loss(nnx.merge(graph, state), x))(x)  # noqa: E731
  assert gathered(pure, state, x) == []  # every gather inside the kernels
  assert abs(float(v_f) - float(v_x)) < 2e-2 * abs(float(v_x))
  assert rel_err(gx_f, gx_x) < TOL[jnp.bfloat16]
  for a, w in zip(jax.tree.leaves(nnx.state(gm_f, poetx_jax.POETParam)),
                  jax.tree.leaves(nnx.state(gm_x, poetx_jax.POETParam))):
    assert rel_err(a, w) < TOL[jnp.bfloat16]


def test_auto_takes_the_kernels_only_for_measured_16_bit_sides(monkeypatch):
  """fused_kernels: nothing where no side of the block size was measured
  faster, or the block size is not one the kernels take; ``fuse`` says yes
  for 16-bit activations of a measured (width, block size, run length) only."""
  from pallas_kernels import fused_rotate
  assert pk.fused_kernels(48) == {} and pk.fused_kernels(1024, always=True) == {}
  monkeypatch.setattr(fused_rotate, 'FASTER', frozenset({(2048, 256, 16)}))
  assert pk.fused_kernels(128) == {}
  fuse = pk.fused_kernels(256)['fuse']
  sds = jax.ShapeDtypeStruct
  g = sds((8, 256, 256), jnp.bfloat16)
  assert fuse(sds((4, 2048), jnp.bfloat16), g, 16)
  assert not fuse(sds((4, 2048), jnp.bfloat16), g, 1)  # an element permutation: not measured
  assert not fuse(sds((4, 2048), jnp.float32), g, 16)
  assert not fuse(sds((4, 4096), jnp.bfloat16), g, 16)


@pytest.mark.slow
@pytest.mark.parametrize('hidden, inner, tie', [(128, 192, False), (128, 192, True),
                                                 (96, 160, False)],
                         ids=['run-kernels', 'run-kernels-tied', 'ragged-triton'])
def test_chunk_swiglu_on_the_kernels_matches_xla(keys, monkeypatch, hidden, inner, tie):
  """A SwiGLU of chunk-permutation layers (runs of 16, B = 64) on the
  kernels against the XLA path, tied and untied: sides whose width is a
  multiple of B take the Mosaic run kernels (pallas_kernels.run_rotate),
  ragged ones the Triton kernels reading one index per run; the values and
  gradients are the XLA path's, and no XLA gather runs."""
  from pallas_kernels import fused_rotate, run_rotate
  calls = []
  for mod in (run_rotate, fused_rotate):
    for name in ('permute_rotate', 'rotate_unpermute'):
      monkeypatch.setattr(mod, name, (lambda f, tag: lambda *a, **k: (
          calls.append(tag), f(*a, **k))[1])(getattr(mod, name), mod.__name__))
  mlp = nnx.Dict(gate=nnx.Linear(hidden, inner, use_bias=False, rngs=nnx.Rngs(0)),
                 up=nnx.Linear(hidden, inner, use_bias=False, rngs=nnx.Rngs(1)),
                 down=nnx.Linear(inner, hidden, use_bias=False, rngs=nnx.Rngs(2)))
  poet = poetx_jax.poetize(mlp, block_size=64, rngs=nnx.Rngs(3), dtype=jnp.bfloat16,
                           permutation='chunk', chunk_size=16)
  if tie:
    poet['gate'].tie_out = poet['up'].tie_out = poet['down'].tie_in = 'h'
    poet['down'].perm_in[...] = poet['gate'].perm_out[...]
    poet['up'].perm_out[...] = poet['gate'].perm_out[...]
  for name in ('gate', 'up', 'down'):
    assert ops.is_chunk_permutation(poet[name].perm_in[...], 16)
    randomize_generators(poet[name], keys())
  x = jax.random.normal(keys(), (2, 20, hidden)).astype(jnp.bfloat16)

  def loss(m, x):
    y = poetx_jax.swiglu(m['gate'], m['up'], m['down'], x)
    return jnp.sum(jnp.sin(y.astype(jnp.float32)))

  def run():
    return nnx.value_and_grad(loss, argnums=(0, 1))(poet, x)

  (v_x, (gm_x, gx_x)) = run()
  assert calls == []
  fused = _fused(64)
  monkeypatch.setattr(linear, 'implementation_for',
                      lambda name, b: fused if name == 'auto' else None)
  (v_f, (gm_f, gx_f)) = run()
  expect = 'pallas_kernels.run_rotate' if hidden % 64 == 0 else 'pallas_kernels.fused_rotate'
  assert calls and set(calls) == {expect}, set(calls)
  assert abs(float(v_f) - float(v_x)) < 2e-2 * abs(float(v_x))
  assert rel_err(gx_f, gx_x) < TOL[jnp.bfloat16]
  for a, w in zip(jax.tree.leaves(nnx.state(gm_f, poetx_jax.POETParam)),
                  jax.tree.leaves(nnx.state(gm_x, poetx_jax.POETParam))):
    assert rel_err(a, w) < TOL[jnp.bfloat16]
