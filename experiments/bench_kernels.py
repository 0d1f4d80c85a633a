"""Each Pallas kernel alone against the XLA op it replaces, with tile variants.

For activations of T tokens by N features (bf16) and block size B:

  copy                x + 1: one read and one write of x, the memory floor of
                      every row below except gram (which writes K B x B)
  rotate xla          poetx_jax.ops.block_rotate (a batched einsum)
  rotate kernel ...   pallas_kernels.block_rotate.rotate_kernel, per Config
  gram xla            the blocks' gradient dy_k^T x_k as an einsum (float32 out)
  gram kernel         pallas_kernels.block_rotate.block_gram
  gather xla          poetx_jax.ops.permute (a column gather)
  gather kernel ...   pallas_kernels.permute.gather_kernel, per tiling

Every kernel's output is compared with its XLA row before timing (exact for
the gathers). Forward only. Each time is the median over device-synchronised
runs of one program that applies the op ``--chain`` times in a row (each
application consuming the last one's output), divided by ``--chain``: a
single op of ~0.1 ms timed from the host would mostly measure the launch and
the synchronisation.

    python3 -m experiments.bench_kernels                       # N in 4096/14336, B = 256
    python3 -m experiments.bench_kernels --widths 4096 --blocks 128,256
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_layer import dump_json, print_rows, rel_err, timeit
from pallas_kernels import block_rotate as br
from pallas_kernels import permute as pm
from poetx_jax import ops


def chained(op, n, reduce=False):
  """jit of ``n`` applications of op in one program. Each application consumes
  the last one's output (``y = op(y, *rest)``); for a reduction (``reduce``:
  op's output is not its first input's shape) the sums of its outputs are
  accumulated and an optimization barrier ties the input to that sum, so that
  the compiler cannot hoist the loop-invariant op out of the loop."""
  def run(first, *rest):
    if not reduce:
      return jax.lax.fori_loop(0, n, lambda _, y: op(y, *rest), first)

    def body(_, acc):
      y, acc = jax.lax.optimization_barrier((first, acc))
      return acc + jnp.sum(op(y, *rest))
    return jax.lax.fori_loop(0, n, body, jnp.zeros((), jnp.float32))
  return jax.jit(run)


INTERPRET = jax.default_backend() != 'gpu'  # the kernels' interpreters off-GPU (smoke tests)
ROTATE_CONFIGS = {
    'default': br.Config(),
    'stages 2': br.Config(stages=2),
    'C 128 stages 2': br.Config(tile_c=128, stages=2),
    'C 256 one out buffer': br.Config(tile_c=256, out_buffers=1),
    'M 128 C 64': br.Config(tile_m=128, tile_c=64),
    'M 128 C 64 stages 3': br.Config(tile_m=128, tile_c=64, stages=3),
}
GATHER_VARIANTS = {
    'tiles C 2048': {},
    'tiles C 512': {'cols': 512},
    'whole rows C 2048': {'whole_rows': True},
    'whole rows C 1024': {'whole_rows': True, 'cols': 1024},
    'whole rows C 512': {'whole_rows': True, 'cols': 512},
}


def bench(t, n, b, iters, chain, key):
  k = n // b
  ks = jax.random.split(key, 4)
  x = jax.random.normal(ks[0], (t, n), jnp.bfloat16)
  dy = jax.random.normal(ks[1], (t, n), jnp.bfloat16)
  g = (jnp.eye(b) + 0.1 * jax.random.normal(ks[2], (k, b, b)) / np.sqrt(b)).astype(jnp.bfloat16)
  perm = ops.random_permutation(ks[3], n)
  rows, errs = {}, {}

  def run(name, op, args, ref=None, exact=False, reduce=False):
    """Checks op(*args) against ref, then times ``chain`` chained applications."""
    try:
      out = jax.block_until_ready(jax.jit(op)(*args))
    except Exception as e:  # pylint: disable=broad-except
      print(f'  {name}: failed to run: {type(e).__name__}: {str(e).splitlines()[0][:200]}',
            flush=True)
      return None
    if ref is not None:
      err = float(np.max(np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32)))) \
          if exact else rel_err(out, ref)
      errs[name] = err
      if (exact and err != 0) or (not exact and not err < 1e-2):
        print(f'  {name}: wrong result (error {err:.2e}); not timed', flush=True)
        return out
    ms, sd = timeit(chained(op, chain, reduce), *args, iters=iters)
    rows[name] = (ms / chain, sd / chain)
    return out

  run('copy', lambda x: x + 1, (x,))
  y_ref = run('rotate xla', ops.block_rotate, (x, g))
  for name, cfg in ROTATE_CONFIGS.items():
    try:
      cfg.resolve(b, 2)
    except ValueError as e:
      print(f'  rotate kernel {name}: skipped at B={b}: {e}')
      continue
    run(f'rotate kernel {name}', lambda x, g, cfg=cfg: br.rotate_kernel(
        x, g, config=cfg, interpret=INTERPRET), (x, g), y_ref)
  gram_xla = lambda dy, x: jnp.einsum(  # noqa: E731
      'tki,tkj->kij', dy.reshape(t, k, b), x.reshape(t, k, b),
      preferred_element_type=jnp.float32)
  gram_ref = run('gram xla', gram_xla, (dy, x), reduce=True)
  run('gram kernel', lambda dy, x: br.block_gram(dy, x, b, interpret=INTERPRET), (dy, x),
      gram_ref, reduce=True)
  p_ref = run('gather xla', ops.permute, (x, perm))
  for name, kw in GATHER_VARIANTS.items():
    run(f'gather kernel {name}', lambda x, p, kw=kw: pm.gather_kernel(
        x, p, interpret=INTERPRET, **kw), (x, perm), p_ref, exact=True)
  return rows, errs


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--widths', default='4096,14336')
  p.add_argument('--blocks', default='256')
  p.add_argument('--tokens', type=int, default=8 * 2048)
  p.add_argument('--iters', type=int, default=20)
  p.add_argument('--chain', type=int, default=10, help='applications per timed program')
  p.add_argument('--json', default=None)
  a = p.parse_args(argv)
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}, T={a.tokens}, bf16',
        flush=True)
  results = []
  for n in map(int, a.widths.split(',')):
    for b in map(int, a.blocks.split(',')):
      rows, errs = bench(a.tokens, n, b, a.iters, a.chain, jax.random.key(n + b))
      base = rows.get('copy', (float('nan'),))[0]
      print(f'\nT={a.tokens} N={n} B={b}')
      print_rows(rows, base, 'copy', width=34)
      results.append({'width': n, 'block': b, 'ms': rows, 'errors': errs})
      sys.stdout.flush()
  dump_json(a.json, results, 'bench_kernels', argv)


if __name__ == '__main__':
  main()
