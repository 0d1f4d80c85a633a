"""Block-diagonal rotation of activations as Pallas Mosaic GPU (Hopper WGMMA) kernels.

Notation (used in shape suffixes): T tokens, N = K*B features, K blocks of size
B; M the token tile, C the column (output-feature) tile of a block, S the number
of token splits that run in parallel.

Computes exactly what ``poetx_jax.ops.block_rotate`` does,

    y[:, kB:(k+1)B] = x[:, kB:(k+1)B] @ G_k^T          (y_i = sum_j G_ij x_j),

reading x and writing y in their natural (T, N) layout: a block's columns are a
(M, B) box that TMA copies directly, so there is none of the layout copies XLA
places around a batched einsum. Two kernels:

* ``rotate_kernel``: one program per (block k, column tile c, token split s)
  loads rows c of G_k into shared memory once and streams its share of the
  token tiles through a TMA pipeline (up to ``Config.stages`` tiles in
  flight); one WGMMA per tile. The
  backward's input cotangent is the same kernel with the blocks transposed.
* ``block_gram``: the blocks' gradient ``dG_k = dy_k^T x_k``, a reduction over
  tokens. Program (k, row tile i, split s) accumulates rows i of its split's
  partial sum in registers across a pipeline over token tiles; the S partials
  are summed by XLA (S * K * B * B float32 numbers).

Operands are 16-bit (bf16 or fp16) and WGMMA accumulates in float32; y is
rounded to x's dtype once, dG stays float32. ``block_rotate`` is the
differentiable entry point (a ``jax.custom_vjp`` built from the two kernels;
for B > GRAM_KERNEL_MAX_B its dG is XLA's einsum, which measured faster).

Token counts that are not a multiple of the tile M are padded with zero rows
(which add nothing to dG) and the result sliced back. :func:`rotate` is the
piece ``implementation='pallas'`` runs: the kernels for 16-bit activations,
:func:`reference` (XLA) otherwise.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mosaic import SMEM_LIMIT_BYTES, interpret_params, static_interpret, swizzle

Array = jax.Array

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
GRAM_TILE_T = 64     # tokens per step of the dG reduction
TARGET_PROGRAMS = 264  # two waves of an H100/H200's 132 SMs
# block_rotate's backward reduces dG on the kernel up to this block size and
# with XLA's einsum above it, the faster of the two on the H200 (BENCHMARKS.md).
GRAM_KERNEL_MAX_B = 128


def _check(x_TxN, g_KxBxB, what='x'):
  """Validates shapes and dtypes; returns (T, K, B)."""
  gshape = getattr(g_KxBxB, 'shape', None)
  if gshape is None or len(gshape) != 3 or gshape[1] != gshape[2]:
    raise ValueError(f'g_KxBxB must have shape (K, B, B), got {gshape}')
  k, b, _ = gshape
  xshape = getattr(x_TxN, 'shape', None)
  if xshape is None or len(xshape) != 2 or xshape[1] != k * b:
    raise ValueError(f'{what} must have shape (T, K*B) = (T, {k * b}) for {k} '
                     f'blocks of {b}, got {xshape}')
  if b % 64 or b > 512:
    raise ValueError(f'block size B={b} is not supported by the kernels: it must be '
                     f'a multiple of 64, at most 512')
  dtype = jnp.dtype(x_TxN.dtype)
  if dtype not in DTYPES:
    raise ValueError(f'{what} must be bfloat16 or float16, got {dtype}')
  if jnp.dtype(g_KxBxB.dtype) != dtype:
    raise ValueError(f'g_KxBxB must have {what}\'s dtype {dtype}, got {g_KxBxB.dtype}')
  return xshape[0], k, b


def _splits(tiles: int, programs: int) -> int:
  """Token splits S (a divisor of ``tiles``) giving about TARGET_PROGRAMS programs."""
  want = max(1, TARGET_PROGRAMS // max(programs, 1))
  best = 1
  for s in range(1, min(want, tiles) + 1):
    if tiles % s == 0:
      best = s
  return best


def _pad_tokens(x_TxN: Array, tile: int) -> Array:
  t = x_TxN.shape[0]
  tp = -(-t // tile) * tile
  return x_TxN if tp == t else jnp.pad(x_TxN, ((0, tp - t), (0, 0)))


@dataclasses.dataclass(frozen=True)
class Config:
  """Tile choices of ``rotate_kernel``.

  The defaults pick the largest column tile that fits with up to four token
  tiles in flight (C = 128 at B = 256, C = 64 at B = 512): the fastest
  measured on the H200 at B = 256, within 20% of the fastest elsewhere
  (BENCHMARKS.md, experiments/bench_kernels.py).

  Attrs:
    tile_m: token rows per step (64 or 128: one warpgroup's WGMMA M).
    tile_c: rows of G_k (output columns) per program, a multiple of 64 that
      divides B, at most 256; None picks the largest whose buffers fit.
    stages: the most token tiles in flight (TMA pipeline depth, >= 2); fewer
      are used where shared memory runs out.
    out_buffers: y tiles being stored while the next is computed (1 or 2).
  """
  tile_m: int = 64
  tile_c: int | None = None
  stages: int = 4
  out_buffers: int = 2

  def smem_bytes(self, b: int, c: int, stages: int, itemsize: int) -> int:
    return itemsize * (c * b + stages * self.tile_m * b + self.out_buffers * self.tile_m * c)

  def resolve(self, b: int, itemsize: int) -> tuple[int, int]:
    """(C, stages) for block size B, with clear errors for tiles that do not fit."""
    if self.tile_m not in (64, 128):
      raise ValueError(f'Config.tile_m={self.tile_m} must be 64 or 128')
    if self.stages < 2 or self.out_buffers not in (1, 2):
      raise ValueError(f'Config.stages={self.stages} must be >= 2 and '
                       f'Config.out_buffers={self.out_buffers} 1 or 2')
    if self.tile_c is not None and (self.tile_c % 64 or b % self.tile_c or self.tile_c > 256):
      raise ValueError(f'Config.tile_c={self.tile_c} must be a multiple of 64, at most 256, '
                       f'that divides B={b}')
    choices = (256, 128, 64) if self.tile_c is None else (self.tile_c,)
    for c in choices:
      if b % c:
        continue
      for stages in range(self.stages, 1, -1):
        if self.smem_bytes(b, c, stages, itemsize) <= SMEM_LIMIT_BYTES:
          return c, stages
    raise ValueError(f'{self} does not fit B={b} in {SMEM_LIMIT_BYTES} bytes of shared '
                     f'memory; use a smaller tile_m or tile_c')


def rotate_kernel(x_TxN: Array, m_KxBxB: Array, *, interpret=False,
                  config: Config | None = None) -> Array:
  """y[:, kB:(k+1)B] = x[:, kB:(k+1)B] @ M_k^T, no custom VJP (x 16-bit, M its dtype)."""
  t, k, b = _check(x_TxN, m_KxBxB)
  config = Config() if config is None else config
  dtype = jnp.dtype(x_TxN.dtype)
  c, stages = config.resolve(b, dtype.itemsize)
  tm, nbuf = config.tile_m, config.out_buffers
  x_TxN = _pad_tokens(x_TxN, tm)
  tp = x_TxN.shape[0]
  tiles = tp // tm
  s = _splits(tiles, k * (b // c))
  per_split = tiles // s
  in_t = swizzle(b, dtype.itemsize)
  out_t = swizzle(c, dtype.itemsize)

  def body(x_gmem, m_gmem, y_gmem, m_smem, y_smem, bar):
    kk = jax.lax.axis_index('k')
    cc = jax.lax.axis_index('c')
    ss = jax.lax.axis_index('s')
    plgpu.copy_gmem_to_smem(m_gmem.at[kk, pl.ds(cc * c, c), :], m_smem, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    first = ss * per_split

    # The inputs stream through emit_pipeline; the outputs are stored by hand
    # from ``nbuf`` alternating buffers (at most nbuf - 1 stores in flight
    # while the next tile is computed).
    def step(idx, x_smem):
      (i,) = idx
      slot = jax.lax.rem(i, nbuf)

      def mm(acc):
        plgpu.wgmma(acc, x_smem, m_smem.T)  # (M, B) @ (B, C)
        plgpu.wgmma_wait(0)
        return acc[...]
      y = pl.run_scoped(mm, plgpu.ACC((tm, c), jnp.float32)).astype(dtype)
      plgpu.wait_smem_to_gmem(nbuf - 1, wait_read_only=True)
      y_smem[slot] = y
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          y_smem.at[slot],
          y_gmem.at[pl.ds((first + i) * tm, tm), pl.ds(kk * b + cc * c, c)])

    rows = pl.ds(first * tm, per_split * tm)
    plgpu.emit_pipeline(
        step,
        grid=(per_split,),
        in_specs=[plgpu.BlockSpec((tm, b), lambda i: (i, 0), transforms=in_t)],
        max_concurrent_steps=stages,
    )(x_gmem.at[rows, pl.ds(kk * b, b)])
    plgpu.wait_smem_to_gmem(0)

  run = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((tp, k * b), dtype),
      scratch_types=(plgpu.SMEM((c, b), dtype, transforms=in_t),
                     plgpu.SMEM((nbuf, tm, c), dtype, transforms=out_t),
                     plgpu.Barrier(num_barriers=1)),
      grid=(k, b // c, s),
      grid_names=('k', 'c', 's'),
      interpret=interpret_params(interpret),
  )
  return run(x_TxN, m_KxBxB)[:t]


def block_gram(dy_TxN: Array, x_TxN: Array, block_size: int, *,
               interpret=False) -> Array:
  """dG_k = dy[:, kB:(k+1)B]^T @ x[:, kB:(k+1)B], float32, shape (K, B, B)."""
  b = block_size
  n = x_TxN.shape[-1]
  if dy_TxN.shape != x_TxN.shape or n % b:
    raise ValueError(f'dy {dy_TxN.shape} and x {x_TxN.shape} must have one shape '
                     f'whose width is a multiple of B={b}')
  k = n // b
  _check(x_TxN, jax.ShapeDtypeStruct((k, b, b), x_TxN.dtype))
  if dy_TxN.dtype != x_TxN.dtype:
    raise ValueError(f'dy ({dy_TxN.dtype}) and x ({x_TxN.dtype}) must share a dtype')
  dtype = jnp.dtype(x_TxN.dtype)
  dy_TxN = _pad_tokens(dy_TxN, GRAM_TILE_T)
  x_TxN = _pad_tokens(x_TxN, GRAM_TILE_T)
  tiles = x_TxN.shape[0] // GRAM_TILE_T
  ri = 64                                  # rows of dG_k per program
  cn = min(b, 256)                         # WGMMA N at most 256
  s = _splits(tiles, k * (b // ri) * (b // cn))
  per_split = tiles // s
  lhs_t = swizzle(ri, dtype.itemsize)
  rhs_t = swizzle(cn, dtype.itemsize)

  def body(dy_gmem, x_gmem, out_gmem, out_smem):
    kk = jax.lax.axis_index('k')
    ii = jax.lax.axis_index('i')
    jj = jax.lax.axis_index('j')
    ss = jax.lax.axis_index('s')

    def scope(acc):
      def step(_, dy_smem, x_smem):
        plgpu.wgmma(acc, dy_smem.T, x_smem)  # (ri, Tt) @ (Tt, cn)
        plgpu.wgmma_wait(0)

      rows = pl.ds(ss * per_split * GRAM_TILE_T, per_split * GRAM_TILE_T)
      plgpu.emit_pipeline(
          step,
          grid=(per_split,),
          in_specs=[
              plgpu.BlockSpec((GRAM_TILE_T, ri), lambda i: (i, 0), transforms=lhs_t),
              plgpu.BlockSpec((GRAM_TILE_T, cn), lambda i: (i, 0), transforms=rhs_t),
          ],
          max_concurrent_steps=2,
      )(dy_gmem.at[rows, pl.ds(kk * b + ii * ri, ri)],
        x_gmem.at[rows, pl.ds(kk * b + jj * cn, cn)])
      return acc[...]

    out_smem[...] = pl.run_scoped(scope, plgpu.ACC((ri, cn), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
        out_smem, out_gmem.at[ss, kk, pl.ds(ii * ri, ri), pl.ds(jj * cn, cn)])
    plgpu.wait_smem_to_gmem(0)

  run = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((s, k, b, b), jnp.float32),
      scratch_types=(plgpu.SMEM((ri, cn), jnp.float32),),
      grid=(k, b // ri, b // cn, s),
      grid_names=('k', 'i', 'j', 's'),
      interpret=interpret_params(interpret),
  )
  return run(dy_TxN, x_TxN).sum(0)


def _flat(x):
  return x.reshape(-1, x.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rotate(x_TxN, g_KxBxB, interpret):
  return rotate_kernel(x_TxN, g_KxBxB, interpret=interpret)


def _rotate_fwd(x_TxN, g_KxBxB, interpret):
  return _rotate(x_TxN, g_KxBxB, interpret), (x_TxN, g_KxBxB)


def _rotate_bwd(interpret, res, dy_TxN):
  x_TxN, g_KxBxB = res
  dx = rotate_kernel(dy_TxN, jnp.swapaxes(g_KxBxB, 1, 2), interpret=interpret)
  k, b, _ = g_KxBxB.shape
  if b <= GRAM_KERNEL_MAX_B:
    dg = block_gram(dy_TxN, x_TxN, b, interpret=interpret)
  else:
    dg = jnp.einsum('tki,tkj->kij', dy_TxN.reshape(-1, k, b), x_TxN.reshape(-1, k, b),
                    preferred_element_type=jnp.float32)
  return dx, dg.astype(g_KxBxB.dtype)


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


def block_rotate(x_TxN: Array, g_KxBxB: Array, *, interpret=False) -> Array:
  """``poetx_jax.ops.block_rotate`` on the kernels: blockdiag(G) applied to x's
  last axis (K*B wide), differentiable in x and G.

  Args:
    x_TxN: activations (..., K*B), bfloat16 or float16.
    g_KxBxB: the blocks, in x's dtype.
    interpret: True (or a ``plgpu.InterpretGPUParams``) runs the kernels in the
      Mosaic GPU interpreter on CPU.

  Returns:
    y with x's shape and dtype. Backward: dx by the same kernel with the blocks
    transposed, dG by the token reduction (float32 partial sums, rounded to G's
    dtype once).
  """
  _check(_flat(x_TxN), g_KxBxB)
  y = _rotate(_flat(x_TxN), g_KxBxB, static_interpret(interpret))
  return y.reshape(x_TxN.shape)


def reference(x_TxN: Array, g_KxBxB: Array, precision=None) -> Array:
  """The block products as one XLA einsum, in x's dtype (G cast to it)."""
  k, b, _ = g_KxBxB.shape
  x = x_TxN.reshape(x_TxN.shape[:-1] + (k, b))
  y = jnp.einsum('...kj,kij->...ki', x, g_KxBxB.astype(x_TxN.dtype), precision=precision)
  return y.reshape(x_TxN.shape)


def rotate(x_TxN: Array, g_KxBxB: Array, precision=None, *, interpret=False) -> Array:
  """:func:`block_rotate` for 16-bit activations (which accumulate in float32
  whatever ``precision`` says); :func:`reference` at ``precision`` for others
  (the kernels multiply 16-bit operands only)."""
  if jnp.dtype(x_TxN.dtype) not in DTYPES:
    return reference(x_TxN, g_KxBxB, precision)
  return block_rotate(x_TxN, g_KxBxB.astype(x_TxN.dtype), interpret=interpret)
