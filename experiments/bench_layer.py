"""Forward+backward time of one POET-X layer against a dense layer, on one GPU.

For each shape (I x O) and block size B, bf16 activations of T tokens:

  dense (W trained)   y = x W, grads for x and W: the baseline
  dense (W frozen)    grads for x only
  poetx xla fast      POETLinear's XLA path (poetx_jax.ops.poet_linear)
  poetx xla mem       the same with remat (POET-Xmem)
  poetx weight fast   form='weight': rotate and permute the frozen kernel, then
                      one GEMM (a dense layer's backward, weight-sized rotations)
  poetx weight mem    the same with remat
  poetx pallas fast   POETLinear(implementation='pallas'): the block products,
                      forward and backward, on the Mosaic GPU kernels
  poetx pallas mem    the same with remat
  poetx all-kernels   every kernel: also the Cayley–Neumann step (Mosaic GPU)
                      and the gathers (Pallas Triton)
  poetx pallas-cn     the XLA path with only its Cayley–Neumann step on the
                      kernel; pallas-perm: only the gathers on the kernel
  poetx no-perm       the same without the two permutation gathers (a different
                      function: its output is not checked, it prices the gathers)
  poetx f32-acc       block products emitting float32, cast back to bf16
  poetx grouped-conv  block products as a 1x1 convolution with K feature groups
  cayley-neumann      the Cayley–Neumann step alone for both sides, at the
                      backend's default float32 matmul precision (what the
                      layer uses for bf16 inputs) and at full float32, and
                      both sides as one batch (what the layer runs)

Every variant is checked against the dense reference (the effective kernel,
float32) before it is timed. Times are medians of device-synchronised runs.

    python3 -m experiments.bench_layer                    # 3 Llama-8B shapes, B in 128/256/512
    python3 -m experiments.bench_layer --shapes 4096x4096 --blocks 256
    python3 -m experiments.bench_layer --blocks 256 --only 'xla fast,weight'
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from poetx_jax import ops
import pallas_kernels
from experiments.common import dump_json, print_rows, rel_err, timeit  # noqa: F401 (bench_kernels, bench_cayley)


def _f32_rotate(x, g):
  """blockdiag(G) x with the block products emitting float32."""
  n = x.shape[-1]
  k, b, _ = g.shape
  xp = ops.pad_features(x, k * b).reshape(x.shape[:-1] + (k, b))
  y = jnp.einsum('...kj,kij->...ki', xp, g, preferred_element_type=jnp.float32)
  return y.astype(x.dtype).reshape(x.shape[:-1] + (k * b,))[..., :n]


def _conv_rotate(x, g):
  """blockdiag(G) x as a grouped 1x1 convolution (K groups of B channels)."""
  n = x.shape[-1]
  k, b, _ = g.shape
  rhs = jnp.transpose(g, (2, 0, 1)).reshape(1, b, k * b)  # [0, j, kB+i] = G[k, i, j]
  y = jax.lax.conv_general_dilated(
      ops.pad_features(x, k * b)[:, None, :], rhs, (1,), 'VALID',
      dimension_numbers=('NWC', 'WIO', 'NWC'), feature_group_count=k)
  return y[:, 0, :n]


def poet_variant(x, kernel, q_in, q_out, perm_in, perm_out, *, b, perm=True,
                 rot='einsum'):
  """The layer with optional pieces switched off, for the ablation rows."""
  i, o = kernel.shape
  d_in = ops.rotation_blocks(q_in, i, b).astype(x.dtype)
  d_out = ops.rotation_blocks(q_out, o, b).astype(x.dtype)
  rot = {'einsum': ops.rotate_features, 'f32': _f32_rotate, 'conv': _conv_rotate}[rot]
  u = ops.permute(x, perm_in) if perm else x
  w = jnp.matmul(rot(u, d_in), jax.lax.stop_gradient(kernel))
  z = rot(w, d_out)
  return ops.unpermute(z, perm_out) if perm else z


def fwd_bwd(f, n_diff):
  """jit of (args, consts) -> (y, grads of the first n_diff args) for the
  cotangent ct, ``consts = (ct, w, p_in, p_out)``. Every array is a jit
  argument: closed-over constants would be folded at compile time (the
  cotangent products included) and time nothing."""
  def run(*args):
    diff, (ct, w, p_in, p_out) = args[:n_diff], args[n_diff:]
    y, pull = jax.vjp(lambda *a: f(*a, w, p_in, p_out), *diff)
    return y, pull(ct.astype(y.dtype))
  return jax.jit(run)


def layer_variants(x, w, q_in, q_out, b, only=()) -> dict:
  """name -> (jitted forward and backward, its differentiated arguments): the
  rows of the module docstring (the Pallas ones where B allows), those of
  ``only`` if given (and the dense ones)."""
  dense_tr = fwd_bwd(lambda x, w2, w, p_in, p_out: x @ w2, 2)
  dense_fr = fwd_bwd(lambda x, w, p_in, p_out: x @ w, 1)

  def layer(remat, form='input', impl=None, **kw):
    def f(x, qi, qo, w, p_in, p_out):
      if kw:
        return poet_variant(x, w, qi, qo, p_in, p_out, b=b, **kw)
      return ops.poet_linear(x, w, qi, qo, p_in, p_out, block_size=b, remat=remat,
                             form=form, implementation=impl)
    return fwd_bwd(f, 3), (x, q_in, q_out)

  variants = {
      'dense (W trained)': (dense_tr, (x, w)),
      'dense (W frozen)': (dense_fr, (x,)),
      'poetx xla fast': layer(False),
      'poetx xla mem': layer(True),
      'poetx weight fast': layer(False, 'weight'),
      'poetx weight mem': layer(True, 'weight'),
      'poetx no-perm': layer(False, perm=False),
      'poetx f32-acc': layer(False, rot='f32'),
      'poetx grouped-conv': layer(False, rot='conv'),
  }
  try:  # B in 64..512
    ks_pallas = ops.Implementation(**pallas_kernels.layer_kernels(b))
  except ValueError as e:
    print(f'  (no pallas rows: {e})')
  else:
    variants['poetx pallas fast'] = layer(False, impl=ks_pallas)
    if jax.default_backend() == 'gpu':  # the CPU interpreter's callbacks cannot be rematerialised
      variants['poetx pallas mem'] = layer(True, impl=ks_pallas)
    ks_all = ops.Implementation(**pallas_kernels.layer_kernels(b, every_kernel=True))
    variants['poetx all-kernels'] = layer(False, impl=ks_all)
    for name, field in (('cn', 'series'), ('perm', 'permute')):
      one = ops.Implementation(**{field: getattr(ks_all, field)})
      variants[f'poetx pallas-{name}'] = layer(False, impl=one)
  if only:
    variants = {k: v for k, v in variants.items()
                if k.startswith('dense') or any(s in k for s in only)}
  return variants


def check_variants(variants: dict, x, q_in, q_out, consts, b, what: str) -> dict:
  """Correctness first: each POET variant's output against x @ effective_kernel
  (float32), and its POET gradients against a float32 run; raises SystemExit
  on a mismatch. A variant that fails to run here is dropped from
  ``variants``. Returns the relative errors by variant."""
  _, w, p_in, p_out = consts
  eff = ops.poet_kernel(w, q_in, q_out, p_in, p_out, block_size=b)
  y_ref = x.astype(jnp.float32) @ eff
  f32 = fwd_bwd(lambda x, qi, qo, w, p_in, p_out: ops.poet_linear(
      x, w.astype(jnp.float32), qi, qo, p_in, p_out, block_size=b), 3)
  _, g_ref = f32(x.astype(jnp.float32), q_in, q_out, *consts)
  checks, failed = {}, []
  for name, (fn, args) in variants.items():
    if not name.startswith('poetx'):
      continue
    try:
      y, g = fn(*args, *consts)
    except Exception as e:  # pylint: disable=broad-except  (a kernel that does not build here)
      print(f'  {name}: dropped, it failed to run: {type(e).__name__}: '
            f'{str(e).splitlines()[0][:300] if str(e) else ""}', flush=True)
      failed.append(name)
      continue
    checks[name] = {'y': rel_err(y, y_ref)}
    if 'no-perm' not in name:
      checks[name].update({f'd{n}': rel_err(a, r) for n, a, r in
                           zip(('x', 'q_in', 'q_out'), g, g_ref)})
    bad = {k: v for k, v in checks[name].items() if not v < 3e-2}
    if 'no-perm' not in name and bad:
      raise SystemExit(f'{name} {what}: check failed {bad}')
  for name in failed:
    del variants[name]
  return checks


def cayley_rows(q_in, q_out, ct_g, i, o, b, iters) -> dict:
  """The Cayley–Neumann step alone (forward and backward, both sides): at
  default and full float32 precision, both sides as one batch, and that batch
  on the Pallas kernel where B allows."""
  dt = jnp.bfloat16

  def cn_step(precision):  # the series as poet_linear runs it for bf16 inputs
    return jax.jit(lambda qi, qo, ct_g: jax.vjp(
        lambda a, c: (ops.rotation_blocks(a, i, b, precision=precision).astype(dt),
                      ops.rotation_blocks(c, o, b, precision=precision).astype(dt)),
        qi, qo)[1](ct_g))

  rows = {}
  for name, prec in (('default', jax.lax.Precision.DEFAULT),
                     ('highest', jax.lax.Precision.HIGHEST)):
    rows[f'cayley-neumann, {name} (both sides)'] = timeit(
        cn_step(prec), q_in, q_out, ct_g, iters=iters)
  pair = jax.jit(lambda qi, qo, ct_g: jax.vjp(
      lambda a, c: tuple(g.astype(dt) for g in ops.rotation_blocks_pair(
          a, c, i, o, b, precision=jax.lax.Precision.DEFAULT)), qi, qo)[1](ct_g))
  rows['cayley-neumann, default, one batch'] = timeit(pair, q_in, q_out, ct_g,
                                                      iters=iters)
  if not pallas_kernels.supports_block_size(b):
    return rows
  series = pallas_kernels.layer_kernels(b, every_kernel=True)['series']
  pair_k = jax.jit(lambda qi, qo, ct_g: jax.vjp(
      lambda a, c: tuple(g.astype(dt) for g in ops.rotation_blocks_pair(
          a, c, i, o, b, series=series)), qi, qo)[1](ct_g))
  rows['cayley-neumann, pallas kernel, one batch'] = timeit(pair_k, q_in, q_out, ct_g,
                                                            iters=iters)
  return rows


def bench_shape(i, o, b, t, iters, key, only=()):
  """Checks, then times, every variant of one I x O layer at block size B on
  T tokens; ``(rows, checks)``: (median, spread) ms and relative errors by name."""
  ks = jax.random.split(key, 7)
  dt = jnp.bfloat16
  x = jax.random.normal(ks[0], (t, i), dt)
  ct = jax.random.normal(ks[1], (t, o), dt)
  w = (jax.random.normal(ks[2], (i, o), jnp.float32) / np.sqrt(i)).astype(dt)
  scale = 0.05
  q_in = scale * jax.random.normal(ks[3], (ops.num_blocks(i, b), ops.skew_size(b))) / np.sqrt(b)
  q_out = scale * jax.random.normal(ks[4], (ops.num_blocks(o, b), ops.skew_size(b))) / np.sqrt(b)
  p_in = ops.random_permutation(ks[5], i)
  p_out = ops.random_permutation(ks[6], o)
  consts = (ct, w, p_in, p_out)
  variants = layer_variants(x, w, q_in, q_out, b, only)
  checks = check_variants(variants, x, q_in, q_out, consts, b, f'{i}x{o} B={b}')
  rows = {name: timeit(fn, *args, *consts, iters=iters) for name, (fn, args) in variants.items()}
  if only and not any('cayley' in s for s in only):
    return rows, checks
  ct_g = (jax.random.normal(ks[1], (ops.num_blocks(i, b), b, b), dt),
          jax.random.normal(ks[2], (ops.num_blocks(o, b), b, b), dt))
  rows.update(cayley_rows(q_in, q_out, ct_g, i, o, b, iters))
  return rows, checks


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--shapes', default='4096x4096,4096x14336,14336x4096')
  p.add_argument('--blocks', default='128,256,512')
  p.add_argument('--tokens', type=int, default=8 * 2048)
  p.add_argument('--iters', type=int, default=20)
  p.add_argument('--json', default=None, help='write all figures here')
  p.add_argument('--only', default='',
                 help='comma-separated name parts: time only the POET rows that '
                      'contain one (the dense rows always run), e.g. "xla fast,weight"')
  a = p.parse_args(argv)
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}, '
        f'T={a.tokens}, bf16', flush=True)
  results = []
  for shape in a.shapes.split(','):
    i, o = map(int, shape.split('x'))
    for b in map(int, a.blocks.split(',')):
      rows, checks = bench_shape(i, o, b, a.tokens, a.iters, jax.random.key(i + o + b),
                                 tuple(filter(None, a.only.split(','))))
      base = rows['dense (W trained)'][0]
      print(f'\n{i}x{o}  B={b}   (relative errors: ' +
            ', '.join(f"{k}: y {v['y']:.1e}" for k, v in checks.items()) + ')')
      print_rows(rows, base, 'dense')
      results.append({'shape': shape, 'block': b, 'ms': rows, 'checks': checks})
      sys.stdout.flush()
  dump_json(a.json, results, 'bench_layer', argv)


if __name__ == '__main__':
  main()
