"""The Cayley–Neumann step alone: the Mosaic GPU kernel against the XLA series.

For one Llama-8B layer's worth of blocks (both sides of a 4096 x 14336 layer:
K = 4096/B + 14336/B blocks of B x B) and each block size B:

  xla default       ops.cayley_neumann at the default float32 matmul precision
                    (TF32 on Hopper; what POETLinear runs for bf16 inputs)
  xla highest       the same at full float32
  pallas            pallas_kernels.cayley_neumann (float32 in, float32 out)
  pallas bf16-out   the kernel writing bf16 blocks (what the layer consumes)

forward alone, and forward+backward (the kernel's backward is autodiff of the
XLA series). Each variant is checked against a full-float32 reference first.
Times are medians of device-synchronised runs.

    python3 -m experiments.bench_cayley                      # on a Hopper GPU
    python3 -m experiments.bench_cayley --blocks 64 --hidden 128 --mlp 128 --interpret  # CPU smoke
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_layer import dump_json, rel_err, timeit
from pallas_kernels import cayley_neumann as cn
from poetx_jax import ops


def bench_block(b, k, terms, iters, interpret, key):
  k1, k2 = jax.random.split(key)
  p = 0.05 / np.sqrt(b) * jax.random.normal(k1, (k, ops.skew_size(b)))
  q = ops.unpack_skew(p, b)
  ct = jax.random.normal(k2, (k, b, b))
  hi, df = jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT
  variants = {
      'xla default': lambda q: ops.cayley_neumann(q, terms, precision=df),
      'xla highest': lambda q: ops.cayley_neumann(q, terms, precision=hi),
      'pallas': lambda q: cn.cayley_neumann(q, terms=terms, interpret=interpret),
      'pallas bf16-out': lambda q: cn.cayley_neumann(
          q, terms=terms, out_dtype=jnp.bfloat16, interpret=interpret),
  }
  want = ops.cayley_neumann(q, terms, precision=hi)
  rows, checks = {}, {}
  for name, f in variants.items():
    fwd = jax.jit(f)
    out_dtype = jax.eval_shape(f, q).dtype
    both = jax.jit(lambda q, ct, f=f, dt=out_dtype: jax.vjp(f, q)[1](ct.astype(dt))[0])
    err = rel_err(fwd(q), want)
    checks[name] = err
    if not err < (1e-2 if 'bf16' in name else 1e-3):
      raise SystemExit(f'{name} B={b}: relative error {err:.2e} against float32')
    rows[name] = {'fwd': timeit(fwd, q, iters=iters), 'fwd+bwd': timeit(both, q, ct, iters=iters)}
  return rows, checks


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--blocks', default='64,128,256')
  p.add_argument('--hidden', type=int, default=4096)
  p.add_argument('--mlp', type=int, default=14336)
  p.add_argument('--terms', type=int, default=ops.DEFAULT_TERMS)
  p.add_argument('--iters', type=int, default=20)
  p.add_argument('--interpret', action='store_true', help='Mosaic GPU interpreter (CPU)')
  p.add_argument('--json', default=None)
  a = p.parse_args(argv)
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}, '
        f'layer {a.hidden}x{a.mlp}, terms={a.terms}', flush=True)
  results = []
  for b in map(int, a.blocks.split(',')):
    k = ops.num_blocks(a.hidden, b) + ops.num_blocks(a.mlp, b)
    rows, checks = bench_block(b, k, a.terms, a.iters, a.interpret, jax.random.key(b))
    print(f'\nB={b}  K={k}  (relative errors: ' +
          ', '.join(f'{n} {e:.1e}' for n, e in checks.items()) + ')')
    for name, r in rows.items():
      print(f'  {name:18s} fwd {r["fwd"][0]:8.3f} ms   fwd+bwd {r["fwd+bwd"][0]:8.3f} ms')
    results.append({'block': b, 'k': k, 'ms': rows, 'checks': checks})
    sys.stdout.flush()
  dump_json(a.json, results, 'bench_cayley', argv)


if __name__ == '__main__':
  main()
