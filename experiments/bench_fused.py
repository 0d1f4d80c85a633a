"""The fused gather + block-product kernels against the XLA ops they replace.

For bf16 activations of T tokens by N features, block size B and
permutations of each run length c of ``--chunks`` (1: element permutations;
c > 1: chunk permutations of aligned runs of c features, poetx_jax.perms)
(pallas_kernels.fused_rotate):

  copy                    x + 1: one read and one write of x, the memory floor
  gather xla              ops.permute (a column gather; of whole runs for c > 1)
  gather xla, words of W  c > 1: the run gather moving each run as W-byte words
  gather xla fwd+bwd      the gather and its backward (the inverse gather):
                          measured against twice the copy
  rotate xla              ops.rotate_features (the block products)
  gather+rotate xla       ops.rotate_features(ops.permute(x, p), g): what
                          gather_rotate replaces
  gather_rotate ...       the fused kernel (Pallas Triton), per Config
  gather_rotate mosaic    c > 1: pallas_kernels.run_rotate's kernel (Mosaic GPU)
  rotate+unpermute xla    ops.unpermute(ops.rotate_features(w, g), p) (the
                          inverse given, as a layer can have it formed once)
  rotate_scatter          the fused kernel
  rotate_scatter mosaic   c > 1: run_rotate's
  gram xla                dG = einsum of dy and x[:, p] (float32 out)
  block_gram              the fused kernel, x read through p
  permute_rotate fwd+bwd  value, dx and dg (jax.vjp), against the ops composition
                          (xla, fused, and for c > 1 mosaic: run_rotate)
  rotate_unpermute fwd+bwd

Every fused kernel is first checked against its XLA composition on fresh
random data; a kernel that fails to run or disagrees is reported and not
timed. Each time is the median of device-synchronised runs of one program
applying the op ``--chain`` times (``bench_kernels.chained``), divided by
``--chain``. "MB" counts each input read once and each output written once (G
in bf16, dG in float32), and TB/s is that over the time; for the fwd+bwd rows
the inputs are x, g, p and the cotangent, the outputs v, dx and dg, and each
chained step also adds v to dx (one elementwise pass, counted in neither).

    python3 -m experiments.bench_fused                    # element and c = 16, one GPU
    python3 -m experiments.bench_fused --chunks 1,16,64 --widths 4096 --json out.json
    python3 -m experiments.bench_fused --smoke            # tiny, interpreted (CPU)
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench_kernels import chained
from experiments.bench_layer import dump_json, rel_err, timeit
from pallas_kernels import fused_reference as fref
from pallas_kernels import fused_rotate as fr
from pallas_kernels import run_rotate as rr
from poetx_jax import ops

WIDTHS = '768,2048,5632,4096,14336'   # the 130M, 1B and 8B layer sides
GATHER_ROTATE_CONFIGS = {
    'default': fr.Config(),
    'C 256 warps 8': fr.Config(tile_c=256, num_warps=8),
    'M 128 warps 8': fr.Config(tile_m=128, num_warps=8),
    'M 32 C 256': fr.Config(tile_m=32, tile_c=256),
    'K 128 stages 3': fr.Config(tile_k=128, num_stages=3),
}
RUN_WORDS = (2, 4)  # bytes of the words a run gather moves (ops.run_gather)
TOL = 2e-2  # bf16 results (one rounding each) against XLA's bf16 composition


def chained_grad(f, n):
  """jit of ``n`` forward+backward steps of ``v = f(x, g, p)``: each step's
  carry is ``(v + dx, g + 1e-30 dg)`` (so nothing is loop-invariant), the
  cotangent a constant."""
  def run(x, g, p, ct):
    def step(_, carry):
      x, g = carry
      v, pull = jax.vjp(lambda x, g: f(x, g, p), x, g)
      dx, dg = pull(ct)
      return v + dx, g + (1e-30 * dg).astype(g.dtype)
    return jax.lax.fori_loop(0, n, step, (x, g))
  return jax.jit(run)


def bench(t, n, b, iters, chain, key, interpret, chunk=1, configs=None, fused=True):
  k = -(-n // b)
  ks = jax.random.split(key, 5)
  x = jax.random.normal(ks[0], (t, n), jnp.bfloat16)
  dy = jax.random.normal(ks[1], (t, n), jnp.bfloat16)
  g = (jnp.eye(b) + 0.1 * jax.random.normal(ks[2], (k, b, b)) / np.sqrt(b)).astype(jnp.bfloat16)
  p = ops.random_permutation(ks[3], n, chunk)
  inv = ops.invert_permutation(p)
  c = chunk
  act, blocks, idx = t * n * 2, k * b * b * 2, n * 4   # bytes of x, G, an index
  rows, moved, errs = {}, {}, {}

  def run(name, op, args, nbytes, ref=None, reduce=False, timer=None):
    """Checks op(*args) against ref, then times ``chain`` chained applications."""
    try:
      out = jax.block_until_ready(jax.jit(op)(*args))
    except Exception as e:  # pylint: disable=broad-except
      print(f'  {name}: failed to run: {type(e).__name__}: {str(e).splitlines()[0][:200]}',
            flush=True)
      return None
    if ref is not None:
      err = max(rel_err(o, r) for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)))
      errs[name] = err
      if not err < TOL:
        print(f'  {name}: wrong result (error {err:.2e}); not timed', flush=True)
        return out
    ms, sd = timeit(timer or chained(op, chain, reduce), *args, iters=iters)
    rows[name], moved[name] = (ms / chain, sd / chain), nbytes
    return out

  kw = {'interpret': interpret, 'chunk': c}
  mkw = {'interpret': interpret}
  run('copy', lambda x: x + 1, (x,), 2 * act)
  want = x[:, p]
  gathered = run('gather xla', lambda x, p: ops.permute(x, p, inv, chunk=c), (x, p),
                 2 * act + idx)
  if gathered is not None and not bool((gathered == want).all()):
    print('  gather xla: wrong result', flush=True)
  if c > 1:
    runs = ops.run_index(p, c)
    for w in RUN_WORDS:
      run(f'gather xla, words of {w}', lambda x, r, w=w: ops.run_gather(x, r, c, word_bytes=w),
          (x, runs), 2 * act + idx, want)

  def gather_grad(x, p, ct):
    y, pull = jax.vjp(lambda x: ops.permute(x, p, inv, chunk=c), x)
    return y + pull(ct)[0]

  run('gather xla fwd+bwd', gather_grad, (x, p, dy), 4 * act + 2 * idx,
      timer=jax.jit(lambda x, p, ct: jax.lax.fori_loop(
          0, chain, lambda _, x: gather_grad(x, p, ct), x)))
  if not fused:
    return rows, moved, errs
  run('rotate xla', ops.rotate_features, (x, g), 2 * act + blocks)
  ref_gr = ref = run('gather+rotate xla',
            lambda x, p, g: ops.rotate_features(ops.permute(x, p, inv, chunk=c), g),
            (x, p, g), 2 * act + blocks + idx)
  for name, cfg in GATHER_ROTATE_CONFIGS.items():
    if configs is not None and name not in configs:
      continue
    try:
      cfg.resolve(b)
    except ValueError as e:
      print(f'  gather_rotate {name}: skipped at B={b}: {e}')
      continue
    run(f'gather_rotate {name}', lambda x, p, g, cfg=cfg: fr.gather_rotate(
        x, p, g, config=cfg, **kw), (x, p, g), 2 * act + blocks + idx, ref)
  ref_rs = ref = run('rotate+unpermute xla',
            lambda w, g, p: ops.unpermute(ops.rotate_features(w, g), p, inv, chunk=c),
            (x, g, p), 2 * act + blocks + idx)
  run('rotate_scatter', lambda w, g, p: fr.rotate_scatter(w, g, p, **kw), (x, g, p),
      2 * act + blocks + idx, ref)
  gram_bytes = 2 * act + idx + 2 * blocks
  ref = run('gram xla', lambda dy, x, p: fref.block_gram_reference(dy, x, b, b_src=p, chunk=c),
            (dy, x, p), gram_bytes, reduce=True)
  run('block_gram', lambda dy, x, p: fr.block_gram(dy, x, block_size=b, b_src=p, **kw),
      (dy, x, p), gram_bytes, ref, reduce=True)
  step_bytes = 4 * act + 2 * blocks + idx
  mosaic = c > 1 and rr.supports(n, b, c, x.dtype)
  if mosaic:  # the Mosaic GPU run kernels (chunk permutations only)
    runs = rr.run_table(p, c)
    run('gather_rotate mosaic', lambda x, r, g: rr.gather_rotate(x, r, g, chunk=c, **mkw),
        (x, runs, g), 2 * act + blocks + idx, ref_gr)
    run('rotate_scatter mosaic', lambda w, g, r: rr.rotate_scatter(w, g, r, chunk=c, **mkw),
        (x, g, runs), 2 * act + blocks + idx, ref_rs)
  sides = [
      ('permute_rotate', lambda x, g, p: fr.permute_rotate(x, p, g, **kw),
       lambda x, g, p: ops.rotate_features(ops.permute(x, p, inv, chunk=c), g),
       lambda x, g, p: rr.permute_rotate(x, p, g, chunk=c, **mkw)),
      ('rotate_unpermute', lambda x, g, p: fr.rotate_unpermute(x, g, p, **kw),
       lambda x, g, p: ops.unpermute(ops.rotate_features(x, g), p, inv, chunk=c),
       lambda x, g, p: rr.rotate_unpermute(x, g, p, chunk=c, **mkw))]
  for what, fused, xla, mosaic_side in sides:
    def once(f):
      def vjp(x, g, p, ct):
        v, pull = jax.vjp(lambda x, g: f(x, g, p), x, g)
        return (v, *pull(ct))
      return vjp
    ref = run(f'{what} fwd+bwd xla', once(xla), (x, g, p, dy), step_bytes,
              timer=chained_grad(xla, chain))
    run(f'{what} fwd+bwd fused', once(fused), (x, g, p, dy), step_bytes, ref,
        timer=chained_grad(fused, chain))
    if mosaic:
      run(f'{what} fwd+bwd mosaic', once(mosaic_side), (x, g, p, dy), step_bytes, ref,
          timer=chained_grad(mosaic_side, chain))
  return rows, moved, errs


def print_table(rows, moved, base):
  """bench_layer.print_rows with the bytes moved and the bandwidth they imply."""
  for name, (ms, sd) in rows.items():
    mb = moved[name] / 1e6
    print(f'  {name:30s} {ms:8.3f} ms  ±{sd:6.3f}  {ms / base:5.2f}x copy  {mb:8.1f} MB  '
          f'{moved[name] / (ms * 1e-3) / 1e12:5.2f} TB/s')


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--widths', default=WIDTHS)
  p.add_argument('--block', type=int, default=256)
  p.add_argument('--tokens', type=int, default=8192)
  p.add_argument('--iters', type=int, default=10)
  p.add_argument('--chain', type=int, default=10, help='applications per timed program')
  p.add_argument('--smoke', action='store_true',
                 help='tiny shapes (T=40, N=128, B=64), chain 2, one iteration, interpreted')
  p.add_argument('--chunks', default='1,16',
                 help='run lengths of the permutations (1: element permutations)')
  p.add_argument('--configs', default=None,
                 help='gather_rotate tile variants to time, comma-separated names of '
                      f'{", ".join(GATHER_ROTATE_CONFIGS)} (default: all)')
  p.add_argument('--fused-widths', default=None,
                 help='the widths at which the fused kernels and the XLA compositions they '
                      'replace are timed (default: every width; elsewhere only the copy and '
                      'the gathers)')
  p.add_argument('--json', default=None)
  a = p.parse_args(argv)
  interpret = jax.default_backend() != 'gpu'
  if a.smoke:
    a.widths, a.block, a.tokens, a.iters, a.chain = '128', 64, 40, 1, 2
  elif interpret:
    p.error('the kernels run interpreted off GPUs: use --smoke there')
  chunks = [int(c) for c in a.chunks.split(',')]
  configs = None if a.configs is None else a.configs.split(',')
  for c in chunks:
    ops.check_chunk_size(c, a.block, what='--chunks')
  for name in configs or ():
    if name not in GATHER_ROTATE_CONFIGS:
      p.error(f'--configs: unknown variant {name!r}; known: {", ".join(GATHER_ROTATE_CONFIGS)}')
  print(f'device: {jax.devices()[0].device_kind}, jax {jax.__version__}, T={a.tokens}, '
        f'B={a.block}, bf16', flush=True)
  results = []
  fused_widths = (None if a.fused_widths is None else
                  {int(w) for w in a.fused_widths.split(',') if w})
  for n in map(int, a.widths.split(',')):
    for c in chunks:
      rows, moved, errs = bench(a.tokens, n, a.block, a.iters, a.chain,
                                jax.random.key(n), interpret, c, configs,
                                fused=fused_widths is None or n in fused_widths)
      print(f'\nT={a.tokens} N={n} B={a.block} chunk={c}')
      print_table(rows, moved, rows.get('copy', (float('nan'),))[0])
      results.append({'width': n, 'block': a.block, 'tokens': a.tokens, 'chunk': c,
                      'ms': rows, 'bytes': moved, 'errors': errs})
      sys.stdout.flush()
  dump_json(a.json, results, 'bench_fused', argv)


if __name__ == '__main__':
  main()
