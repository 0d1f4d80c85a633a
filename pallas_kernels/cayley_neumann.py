"""Cayley–Neumann series as a Pallas Mosaic GPU (Hopper WGMMA) kernel.

Notation (used in shape suffixes): K blocks, B block size, P = B(B-1)/2 packed
skew parameters per block; M the row tile, T the inner (contraction) tile.

Maps K skew-symmetric float32 blocks Q to

    G = I + 2 * sum_{i=1..terms} Q^i

exactly as ``poetx_jax.ops.cayley_neumann`` does (the tests check it against
that), by Horner's rule written with
the accumulator on the left (the powers of Q commute):

    A_1 = Q,    A_{j+1} = Q + A_j Q,    G = I + 2 A_terms.

Tiling. Row tile r of A_{j+1} needs only row tile r of A_j and all of Q, so one
program (k, r) runs the whole recursion for rows r of block k: its (M, B) slice
of A stays in shared memory between steps and Q streams through in (B, T)
column panels. Nothing is ever resident at B x B, so B = 256 in float32 fits
(M = 64, T = 32: 32 + 64 + 64 + 64 KiB of shared memory with a float32 output)
without dropping the operands to bf16. Shared memory (at most ~227 KiB per
block on H100/H200) is checked before launch.

Precision. Operands stay float32 and WGMMA accumulates in float32. On Hopper a
float32 WGMMA multiplies in TF32; the recursion keeps that error small because
only the correction ``A_j Q`` (of size ||Q||^2) goes through the tensor core
and the leading ``Q`` term is added exactly in float32: on the H200 the
relative error in G measured about 2e-5 at the tests' scales. TF32 wants both operands K-major, so the
kernel computes ``A_j Q = -(A_j Q^T)`` and feeds Q's column panel as the
transposed (K-major) right operand. The interpreter (``interpret=True``, CPU)
multiplies in full float32.

Gradients: ``cayley_neumann`` is a ``jax.custom_vjp`` whose backward is
autodiff of :func:`reference`, the plain jnp series. Not among the kernels
``implementation='pallas'`` runs (see :func:`pallas_kernels.layer_kernels`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mosaic import SMEM_LIMIT_BYTES, interpret_params, static_interpret, swizzle

Array = jax.Array

DEFAULT_TERMS = 4


def reference(q_KxBxB: Array, terms: int = DEFAULT_TERMS) -> Array:
  """The series in plain jnp at full float32 precision (the kernel's backward)."""
  eye = jnp.eye(q_KxBxB.shape[-1], dtype=q_KxBxB.dtype)
  acc = q_KxBxB
  for _ in range(terms - 1):
    acc = jnp.matmul(q_KxBxB, eye + acc, precision=jax.lax.Precision.HIGHEST)
  return eye + 2 * acc
OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class Config:
  """Tile choices.

  Attrs:
    tile_m: rows of G per program (a multiple of 64, the WGMMA row count);
      None picks min(B, 64).
    tile_k: contraction tile of the streamed Q panels (a multiple of 8;
      32 float32 = one 128-byte swizzle row).
  """
  tile_m: int | None = None
  tile_k: int = 32

  def resolve(self, block_size: int) -> tuple[int, int]:
    """(M, T) for block size B, with clear errors for tiles that do not fit."""
    tm = min(block_size, 64) if self.tile_m is None else self.tile_m
    tk = self.tile_k
    if tm <= 0 or tm % 64 or block_size % tm:
      raise ValueError(
          f'Config.tile_m={tm} must be a positive multiple of 64 that divides '
          f'B={block_size}')
    if tk <= 0 or tk % 8 or block_size % tk or tk > 32:
      raise ValueError(
          f'Config.tile_k={tk} must be a multiple of 8, at most 32, that '
          f'divides B={block_size}')
    return tm, tk


def _smem_bytes(block_size, tm, tk, out_dtype) -> int:
  f32 = 4
  return (block_size * tk * f32           # Q column panel
          + 2 * tm * block_size * f32     # A rows and Q rows
          + tm * block_size * jnp.dtype(out_dtype).itemsize)


def _check(q_KxBxB, terms, out_dtype, config):
  """Validates the arguments; returns (K, B, M, T, out dtype)."""
  shape = getattr(q_KxBxB, 'shape', None)
  if shape is None or len(shape) != 3 or shape[1] != shape[2]:
    raise ValueError(
        f'q_KxBxB must have shape (K, B, B) with square blocks, got {shape}')
  k, b, _ = shape
  if k < 1:
    raise ValueError(f'q_KxBxB must hold at least one block, got K={k}')
  if jnp.dtype(q_KxBxB.dtype) != jnp.float32:
    raise ValueError(f'q_KxBxB must be float32, got {q_KxBxB.dtype}')
  if b % 64:
    raise ValueError(
        f'block size B={b} is not supported: the kernel needs a multiple of 64 '
        f'(64, 128, 256, ...)')
  if isinstance(terms, bool) or not isinstance(terms, (int, np.integer)) or terms < 1:
    raise ValueError(f'terms must be an int >= 1, got {terms!r}')
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype not in OUT_DTYPES:
    raise ValueError(f'out_dtype must be float32 or bfloat16, got {out_dtype}')
  if config is None:
    config = Config()
  if not isinstance(config, Config):
    raise TypeError(f'config must be a Config or None, got {config!r}')
  tm, tk = config.resolve(b)
  need = _smem_bytes(b, tm, tk, out_dtype)
  if need > SMEM_LIMIT_BYTES:
    raise ValueError(
        f'tiles M={tm}, T={tk} at B={b} need {need} bytes of shared memory, '
        f'more than {SMEM_LIMIT_BYTES}; use a smaller Config.tile_m')
  return k, b, tm, tk, out_dtype


def _kernel_body(q_gmem, out_gmem, panel, a_rows, q_rows, out_smem, bar,
                 *, b, tm, tk, terms, out_dtype):
  """Program (k, r): rows r*M .. r*M+M of G_k."""
  k = jax.lax.axis_index('k')
  r = jax.lax.axis_index('r')
  nk = b // tk
  rows = pl.ds(r * tm, tm)

  def load(src, dst):
    plgpu.copy_gmem_to_smem(src, dst, bar.at[0])
    plgpu.barrier_wait(bar.at[0])

  # A_1 = Q: rows r of Q, once plain (the exact "+ Q" term) and once in the
  # swizzled (nk, M, T) layout that feeds WGMMA as the left operand.
  load(q_gmem.at[k, rows, :], q_rows)
  for kk in range(nk):
    load(q_gmem.at[k, rows, pl.ds(kk * tk, tk)], a_rows.at[kk])
  a = q_rows[...]

  for _ in range(terms - 1):
    def step(acc_ref):
      for kk in range(nk):
        load(q_gmem.at[k, :, pl.ds(kk * tk, tk)], panel)  # Q[:, kk] (B, T)
        # acc += A_j[:, kk] @ Q[:, kk]^T: both operands K-major.
        plgpu.wgmma(acc_ref, a_rows.at[kk], panel.T)
        plgpu.wgmma_wait(0)
      return acc_ref[...]

    prod = pl.run_scoped(step, plgpu.ACC((tm, b), jnp.float32))
    a = q_rows[...] - prod  # A_{j+1} = Q + A_j Q = Q - A_j Q^T
    for kk in range(nk):
      a_rows[kk] = a[:, kk * tk:(kk + 1) * tk]

  row = jax.lax.broadcasted_iota(jnp.int32, (tm, b), 0) + r * tm
  col = jax.lax.broadcasted_iota(jnp.int32, (tm, b), 1)
  g = 2.0 * a + jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)
  out_smem[...] = g.astype(out_dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[k, rows, :])
  plgpu.wait_smem_to_gmem(0)


def cayley_neumann_fwd_kernel(q_KxBxB: Array, *, terms: int = DEFAULT_TERMS,
                              out_dtype=jnp.float32, interpret=False,
                              config: Config | None = None) -> Array:
  """The forward kernel alone (no custom VJP): (K, B, B) float32 -> G blocks."""
  k, b, tm, tk, out_dtype = _check(q_KxBxB, terms, out_dtype, config)
  body = functools.partial(_kernel_body, b=b, tm=tm, tk=tk, terms=terms,
                           out_dtype=out_dtype)
  swz = swizzle(tk, 4)
  run = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((k, b, b), out_dtype),
      scratch_types=(
          plgpu.SMEM((b, tk), jnp.float32, transforms=swz),
          plgpu.SMEM((b // tk, tm, tk), jnp.float32, transforms=swz),
          plgpu.SMEM((tm, b), jnp.float32),
          plgpu.SMEM((tm, b), out_dtype),
          plgpu.Barrier(num_barriers=1),
      ),
      grid=(k, b // tm),
      grid_names=('k', 'r'),
      interpret=interpret_params(interpret),
  )
  return run(q_KxBxB)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _cn(q_KxBxB, terms, out_dtype, interpret, config):
  return cayley_neumann_fwd_kernel(q_KxBxB, terms=terms, out_dtype=out_dtype,
                                   interpret=interpret, config=config)


def _cn_fwd(q_KxBxB, terms, out_dtype, interpret, config):
  return _cn(q_KxBxB, terms, out_dtype, interpret, config), q_KxBxB


def _cn_bwd(terms, out_dtype, interpret, config, q_KxBxB, g_KxBxB):
  del out_dtype, interpret, config
  _, vjp = jax.vjp(lambda q: reference(q, terms), q_KxBxB)
  return vjp(g_KxBxB.astype(jnp.float32))


_cn.defvjp(_cn_fwd, _cn_bwd)


def cayley_neumann(q_KxBxB: Array, *, terms: int = DEFAULT_TERMS,
                   out_dtype=jnp.float32, interpret=False,
                   config: Config | None = None) -> Array:
  """G = I + 2 * sum_{i=1..terms} Q^i for K skew blocks, on the GPU kernel.

  Args:
    q_KxBxB: skew-symmetric float32 blocks, shape (K, B, B), B a multiple of 64.
    terms: number of powers of Q kept (>= 1); ``terms - 1`` products.
    out_dtype: float32 or bfloat16 (products always accumulate in float32).
    interpret: True (or a ``plgpu.InterpretGPUParams``) runs the kernel in the
      Mosaic GPU interpreter on CPU.
    config: tile choices (``Config``); None picks defaults.

  Returns:
    (K, B, B) blocks of G in ``out_dtype``. Differentiable: the backward pass is
    autodiff of :func:`reference`.
  """
  _check(q_KxBxB, terms, out_dtype, config)
  return _cn(q_KxBxB, int(terms), jnp.dtype(out_dtype), static_interpret(interpret), config)
