"""Pallas GPU kernels for the POET-X layer, one op per module, each checked
against its ``poetx_jax.ops`` counterpart by the tests:

* ``block_rotate`` — the block products ``x_k G_k^T`` and their gradient
  (Mosaic GPU, Hopper WGMMA);
* ``cayley_neumann`` — the truncated Cayley–Neumann series (Mosaic GPU);
* ``permute`` — a column gather (Pallas Triton: Mosaic GPU has no per-lane
  indexed load on Hopper).
* ``fused_rotate`` — the layer's gathers fused into its block products
  (``permute_rotate``, ``rotate_unpermute`` and their gradients; Pallas
  Triton, through pointer-tensor loads and stores: any permutation);
* ``run_rotate`` — the same for chunk permutations, whose gathers move whole
  runs of features (Mosaic GPU: a TMA box per run, one WGMMA per run).

Off GPUs every kernel runs in its interpreter. :func:`layer_kernels` is the
choice of kernels that ``POETLinear(implementation='pallas')`` runs.
"""

from __future__ import annotations

import typing as tp

import jax

# The pieces of poetx_jax.ops.poet_linear a kernel can replace.
PIECES = ('series', 'rotate', 'permute', 'permute_rotate', 'rotate_unpermute')


def supports_block_size(block_size: int) -> bool:
  """Whether the Mosaic kernels take blocks of this size: a multiple of 64, at most 512."""
  return block_size % 64 == 0 and 0 < block_size <= 512


def default_interpret() -> bool:
  """Kernels compile on GPUs and run in their interpreters elsewhere (tests)."""
  return jax.default_backend() != 'gpu'


def layer_kernels(block_size: int, *, every_kernel: bool = False,
                  interpret: bool | None = None) -> dict[str, tp.Callable]:
  """The kernels of a POET layer, keyed by the piece of
  ``poetx_jax.ops.poet_linear`` each replaces (``PIECES``), each with the
  signature of the ``poetx_jax.ops`` function it stands for.

  By default only the block products (``'rotate'``: forward and backward on
  the Mosaic kernels for 16-bit activations, XLA's einsum for float32): the
  series and gather kernels measured slower than XLA on the H200
  (BENCHMARKS.md), so they are included only with ``every_kernel`` (for
  benchmarks and tests).

  Args:
    block_size: B; a multiple of 64, at most 512.
    every_kernel: also the Cayley–Neumann and gather kernels.
    interpret: run in the interpreters (default: off GPUs). The interpreter's
      callbacks cannot be recomputed by ``jax.checkpoint``, so there the
      layer needs ``mode='fast'`` and no rematerialisation around it.

  Raises:
    ValueError: the block size is not supported.
  """
  if not supports_block_size(block_size):
    raise ValueError(f'the Pallas kernels need a block size that is a multiple of 64, '
                     f'at most 512, got {block_size}')
  from pallas_kernels import block_rotate
  interpret = default_interpret() if interpret is None else interpret
  kernels = {'rotate': lambda x, g, precision=None: block_rotate.rotate(
      x, g, precision, interpret=interpret)}
  if every_kernel:
    from pallas_kernels import cayley_neumann, permute
    kernels['series'] = lambda q, terms: cayley_neumann.cayley_neumann(
        q, terms=terms, interpret=interpret)
    kernels['permute'] = lambda x, perm: permute.permute(x, perm, interpret=interpret)
  return kernels


def fused_kernels(block_size: int, *, always: bool = False,
                  interpret: bool | None = None) -> dict[str, tp.Callable]:
  """The fused gather + block-product kernels of a POET layer as
  ``poetx_jax.ops.Implementation`` fields: ``permute_rotate``,
  ``rotate_unpermute`` and ``fuse(x, g, chunk)``, which says whether they
  take a call: 16-bit activations and, unless ``always``, a side whose
  (width, block size, run length of its permutation) is in
  ``fused_rotate.FASTER`` (measured faster than XLA's gathers and block
  products on a Hopper GPU, experiments/bench_fused.py). A side with a chunk
  permutation whose shape :func:`run_rotate.supports` runs on the Mosaic GPU
  run kernels (:mod:`pallas_kernels.run_rotate`), any other on the Pallas
  Triton ones (:mod:`pallas_kernels.fused_rotate`). ``{}`` where the block
  size is not one the kernels take (a power of two from 16 to 512) or,
  unless ``always``, no side of this block size was measured faster: XLA
  then runs every piece. What ``POETLinear(implementation='auto')`` runs on
  GPUs.

  Args:
    block_size: B.
    always: every 16-bit call on the kernels (tests and benchmarks).
    interpret: run in the interpreters (default: off GPUs).
  """
  from pallas_kernels import fused_rotate, run_rotate
  b = block_size
  if not fused_rotate.MIN_B <= b <= fused_rotate.MAX_B or b & (b - 1):
    return {}
  if not always and not any(fb == b for _, fb, _ in fused_rotate.FASTER):
    return {}
  interpret = default_interpret() if interpret is None else interpret

  def fuse(x, g, chunk=1) -> bool:
    width, blocks = x.shape[-1], g.shape[-1]
    return (x.dtype.itemsize == 2 and blocks == b
            and (always or (width, blocks, chunk) in fused_rotate.FASTER))

  def permute_rotate(x, perm, g, chunk=1):
    if chunk > 1 and run_rotate.supports(x.shape[-1], b, chunk, x.dtype):
      return run_rotate.permute_rotate(x, perm, g, chunk=chunk, interpret=interpret)
    return fused_rotate.permute_rotate(x, perm, g, interpret=interpret, chunk=chunk)

  def rotate_unpermute(w, g, dst, chunk=1):
    if chunk > 1 and run_rotate.supports(w.shape[-1], b, chunk, w.dtype):
      return run_rotate.rotate_unpermute(w, g, dst, chunk=chunk, interpret=interpret)
    return fused_rotate.rotate_unpermute(w, g, dst, interpret=interpret, chunk=chunk)

  return {'fuse': fuse, 'permute_rotate': permute_rotate, 'rotate_unpermute': rotate_unpermute}
