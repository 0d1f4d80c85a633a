"""The gathers of a POET layer fused into its block products, for chunk
permutations: Pallas Mosaic GPU kernels (Hopper TMA and WGMMA).

Notation (used in shape suffixes): T tokens, N = K*B features, K blocks of B
features, c features per run (``chunk``), R = B / c runs per block, M token
rows per tile, C output columns of a block per program, S token splits.

A chunk permutation (:mod:`poetx_jax.perms`) moves aligned runs of c
contiguous features whole, so its gather is a copy of runs: each run of a
token tile is one TMA box of (M, c), which lands in shared memory as a
(M, c) tile of the WGMMA layout (c * itemsize bytes wide: 32, 64 or 128, the
swizzle of that width). A block's product then runs as R WGMMAs of depth c,
one per run, so no permuted copy of the activations is ever written:

* :func:`gather_rotate` ``v = rotate_features(x[:, p], g)``: program (block
  k, column tile C, token split s) holds rows C of ``G_k`` (as R pieces of
  (C, c)) and streams its token tiles, each the R runs of block k's input
  read straight from x at the run offsets the run table gives (read once per
  program), through a TMA pipeline; one (M, C) tile of v is stored per step.
* :func:`rotate_scatter` ``y[:, p] = rotate_features(w, g)``: w's block
  columns stream in contiguously; each output run of the tile (C / c of
  them) is its own WGMMA of width c, stored by TMA to the run's place in y.
* :func:`run_gram` ``dG[k] = a_k^T x[:, runs of block k]`` (float32), the
  generators' gradient with its right operand read through the run table;
  the left operand's transposed tile and the R runs stream through one
  pipeline, each run accumulating into its own (64, c) accumulator. Only
  for runs of 128 bytes (c = 64 at 16 bits): a run of fewer bytes as a
  WGMMA right operand in that orientation (N = c, N-major) is one Mosaic
  GPU's layout inference finds no layout for (jax 0.11.2), so below 128
  bytes the gram is XLA's einsum of the run-gathered operand
  (:func:`gram`).

Where a layer needs the gram with the left operand gathered (the output
side's ``dz^T w``), :func:`rotate_unpermute` computes ``(w^T dz)^T``
instead, so the gathered operand is always the right one.

The differentiable entry points mirror ``poetx_jax.ops`` and
:mod:`pallas_kernels.fused_rotate`: :func:`permute_rotate` is
``rotate_features(permute(x, p, chunk=c), g)`` and :func:`rotate_unpermute`
``unpermute(rotate_features(w, g), p, chunk=c)``; each one's backward is the
other kernel with the blocks transposed plus a gram. They take 16-bit
activations (bf16 or fp16), widths that are a multiple of B (no ragged last
block, hence no ragged last run), B a multiple of 64 up to 512, and runs of
32, 64 or 128 bytes (c = 16, 32 or 64 for 16-bit features): the shapes of
the model's layers. Other calls belong to :mod:`pallas_kernels.fused_rotate`
(Pallas Triton: any width, float32, element permutations), which
``fused_kernels`` falls back to.

Measured on one H100 (docs/results/chunk-permutations) they compute the
right values but are slower than XLA's composition of a gather of runs and
the block products, which XLA fuses into one pass (at N 14336, B 256, c 16,
fwd+bwd: 1.47 ms against 1.16 ms; not profiled: a token tile of a block
is B / c boxes of 2 KiB at c = 16, and the tiles were not tuned). They are what
``implementation='fused'`` runs for the shapes they take; ``'auto'`` runs
XLA.

Why Mosaic GPU here and Triton there: TMA copies boxes whose position is
given at run time, so a run of c features is one box at the offset the run
table names, read into the WGMMA layout with no per-element addressing; an
element permutation has no such boxes (Hopper's TMA cannot gather single
columns), which is why the element kernels load through Triton's pointer
tensors instead. Token counts that are not a multiple of M are padded with
zero rows (which add nothing to a gram) and the results sliced back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._mosaic import interpret_params, static_interpret, swizzle
from pallas_kernels.block_rotate import DTYPES, Config, _flat, _pad_tokens, _splits

Array = jax.Array
RUN_BYTES = (32, 64, 128)  # the TMA box widths the kernels take: the WGMMA swizzles
GRAM_TILE_T = 64           # tokens per step of the gram's reduction
GRAM_ROWS = 64             # rows of dG_k per gram program (one WGMMA M)


def supports(width: int, block_size: int, chunk: int, dtype) -> bool:
  """Whether the kernels take a side of ``width`` features in ``dtype``,
  blocks of ``block_size`` and runs of ``chunk`` features."""
  dtype = jnp.dtype(dtype)
  return (dtype in DTYPES and block_size % 64 == 0 and 0 < block_size <= 512
          and width % block_size == 0 and block_size % chunk == 0
          and chunk * dtype.itemsize in RUN_BYTES)


def _check(x_TxN, g_KxBxB, runs, chunk, what):
  """Validates a call; returns (T, K, B, R). Errors name the value and what is valid."""
  shape = getattr(x_TxN, 'shape', None)
  gshape = getattr(g_KxBxB, 'shape', None)
  if shape is None or len(shape) != 2:
    raise ValueError(f'{what} must be 2-D (T, N), got shape {shape}')
  if gshape is None or len(gshape) != 3 or gshape[1] != gshape[2]:
    raise ValueError(f'g_KxBxB must have shape (K, B, B), got {gshape}')
  t, n = shape
  k, b, _ = gshape
  if not isinstance(chunk, int) or isinstance(chunk, bool) or not supports(
      n, b, chunk, x_TxN.dtype) or k * b != n:
    raise ValueError(
        f'the run kernels take 16-bit {what} of width K*B, B a multiple of 64 up to 512 '
        f'and runs of {RUN_BYTES} bytes that divide B; got {what} {shape} '
        f'{jnp.dtype(x_TxN.dtype)}, {k} blocks of {b}, chunk {chunk!r}')
  if jnp.dtype(g_KxBxB.dtype) != jnp.dtype(x_TxN.dtype):
    raise ValueError(f'g_KxBxB must have {what}\'s dtype {x_TxN.dtype}, got {g_KxBxB.dtype}')
  if getattr(runs, 'shape', None) != (n // chunk,):
    raise ValueError(f'the run table must have shape ({n // chunk},) for width {n} in runs '
                     f'of {chunk}, got {getattr(runs, "shape", None)}')
  return t, k, b, b // chunk


def _read_runs(runs_gmem, first, count):
  """``count`` scalars of the run table from ``first`` on."""
  return [runs_gmem[first + j] for j in range(count)]


def gather_rotate(x_TxN: Array, runs_R: Array, g_KxBxB: Array, *, chunk: int,
                  config: Config | None = None, interpret=False) -> Array:
  """``v[:, kB:(k+1)B] = u[:, kB:(k+1)B] @ G_k^T`` with ``u = x[:, p]``, p the
  chunk permutation whose run table is ``runs_R`` (``u``'s run j is x's run
  ``runs[j]``); no custom VJP. x 16-bit, G in its dtype."""
  t, k, b, r = _check(x_TxN, g_KxBxB, runs_R, chunk, 'x')
  config = Config() if config is None else config
  dtype = jnp.dtype(x_TxN.dtype)
  c, stages = config.resolve(b, dtype.itemsize)
  tm, nbuf = config.tile_m, config.out_buffers
  x_TxN = _pad_tokens(x_TxN, tm)
  tp = x_TxN.shape[0]
  tiles = tp // tm
  s = _splits(tiles, k * (b // c))
  per_split = tiles // s
  run_t = swizzle(chunk, dtype.itemsize)
  out_t = swizzle(c, dtype.itemsize)

  def body(x_gmem, runs_gmem, m_gmem, y_gmem, m_smem, y_smem, bar):
    kk = jax.lax.axis_index('k')
    cc = jax.lax.axis_index('c')
    ss = jax.lax.axis_index('s')
    for j in range(r):  # rows C of G_k, as R pieces of (C, c)
      plgpu.copy_gmem_to_smem(m_gmem.at[kk, pl.ds(cc * c, c), pl.ds(j * chunk, chunk)],
                              m_smem.at[j], bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    first = ss * per_split
    src = _read_runs(runs_gmem, kk * r, r)

    def step(idx, *x_runs):
      (i,) = idx
      slot = jax.lax.rem(i, nbuf)

      def mm(acc):
        for j in range(r):
          plgpu.wgmma(acc, x_runs[j], m_smem.at[j].T)   # (M, c) @ (c, C)
        plgpu.wgmma_wait(0)
        return acc[...]
      y = pl.run_scoped(mm, plgpu.ACC((tm, c), jnp.float32)).astype(dtype)
      plgpu.wait_smem_to_gmem(nbuf - 1, wait_read_only=True)
      y_smem[slot] = y
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(
          y_smem.at[slot], y_gmem.at[pl.ds((first + i) * tm, tm), pl.ds(kk * b + cc * c, c)])

    rows = x_gmem.at[pl.ds(first * tm, per_split * tm)]
    plgpu.emit_pipeline(
        step,
        grid=(per_split,),
        in_specs=[plgpu.BlockSpec((tm, chunk), lambda i, q=q: (i, q), transforms=run_t)
                  for q in src],
        max_concurrent_steps=stages,
    )(*([rows] * r))
    plgpu.wait_smem_to_gmem(0)

  run = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((tp, k * b), dtype),
      scratch_types=(plgpu.SMEM((r, c, chunk), dtype, transforms=run_t),
                     plgpu.SMEM((nbuf, tm, c), dtype, transforms=out_t),
                     plgpu.Barrier(num_arrivals=r, num_barriers=1)),
      grid=(k, b // c, s),
      grid_names=('k', 'c', 's'),
      interpret=interpret_params(interpret),
  )
  return run(x_TxN, runs_R.astype(jnp.int32), g_KxBxB)[:t]


def rotate_scatter(w_TxN: Array, g_KxBxB: Array, runs_R: Array, *, chunk: int,
                   config: Config | None = None, interpret=False) -> Array:
  """``y[:, p] = z`` with ``z[:, kB:(k+1)B] = w[:, kB:(k+1)B] @ G_k^T``, p the
  chunk permutation whose run table is ``runs_R`` (z's run j is stored to
  y's run ``runs[j]``); no custom VJP. w 16-bit, G in its dtype."""
  t, k, b, r = _check(w_TxN, g_KxBxB, runs_R, chunk, 'w')
  config = Config() if config is None else config
  dtype = jnp.dtype(w_TxN.dtype)
  c, stages = config.resolve(b, dtype.itemsize)
  tm, nbuf = config.tile_m, config.out_buffers
  per_c = c // chunk                       # output runs per column tile
  w_TxN = _pad_tokens(w_TxN, tm)
  tp = w_TxN.shape[0]
  tiles = tp // tm
  s = _splits(tiles, k * (b // c))
  per_split = tiles // s
  in_t = swizzle(b, dtype.itemsize)
  run_t = swizzle(chunk, dtype.itemsize)

  def body(w_gmem, runs_gmem, m_gmem, y_gmem, m_smem, y_smem, bar):
    kk = jax.lax.axis_index('k')
    cc = jax.lax.axis_index('c')
    ss = jax.lax.axis_index('s')
    plgpu.copy_gmem_to_smem(m_gmem.at[kk, pl.ds(cc * c, c), :], m_smem, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    first = ss * per_split
    dst = _read_runs(runs_gmem, (kk * b + cc * c) // chunk, per_c)

    def step(idx, w_smem):
      (i,) = idx
      slot = jax.lax.rem(i, nbuf)

      def mm(*accs):
        for j, acc in enumerate(accs):   # output run j: (M, B) @ (B, c)
          plgpu.wgmma(acc, w_smem, m_smem.at[pl.ds(j * chunk, chunk), :].T)
        plgpu.wgmma_wait(0)
        return [acc[...] for acc in accs]
      ys = pl.run_scoped(mm, *[plgpu.ACC((tm, chunk), jnp.float32)] * per_c)
      plgpu.wait_smem_to_gmem(nbuf - 1, wait_read_only=True)
      for j, y in enumerate(ys):
        y_smem[slot, j] = y.astype(dtype)
      plgpu.commit_smem()
      for j in range(per_c):
        plgpu.copy_smem_to_gmem(
            y_smem.at[slot, j],
            y_gmem.at[pl.ds((first + i) * tm, tm), pl.ds(dst[j] * chunk, chunk)])

    rows = pl.ds(first * tm, per_split * tm)
    plgpu.emit_pipeline(
        step,
        grid=(per_split,),
        in_specs=[plgpu.BlockSpec((tm, b), lambda i: (i, 0), transforms=in_t)],
        max_concurrent_steps=stages,
    )(w_gmem.at[rows, pl.ds(kk * b, b)])
    plgpu.wait_smem_to_gmem(0)

  run = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((tp, k * b), dtype),
      scratch_types=(plgpu.SMEM((c, b), dtype, transforms=in_t),
                     plgpu.SMEM((nbuf, per_c, tm, chunk), dtype, transforms=run_t),
                     plgpu.Barrier(num_arrivals=1, num_barriers=1)),
      grid=(k, b // c, s),
      grid_names=('k', 'c', 's'),
      interpret=interpret_params(interpret),
  )
  return run(w_TxN, runs_R.astype(jnp.int32), g_KxBxB)[:t]


GRAM_RUN_BYTES = 128  # the run width run_gram takes (see the module docstring)


def gram(a_TxN: Array, x_TxN: Array, runs_R: Array, *, block_size: int, chunk: int,
         interpret=False) -> Array:
  """:func:`run_gram` where it takes the runs (128 bytes); else XLA's einsum
  of ``a`` and ``x`` gathered by whole runs (the same values: float32
  accumulation of 16-bit products)."""
  if chunk * jnp.dtype(x_TxN.dtype).itemsize == GRAM_RUN_BYTES:
    return run_gram(a_TxN, x_TxN, runs_R, block_size=block_size, chunk=chunk,
                    interpret=interpret)
  t, n = x_TxN.shape
  k, b = n // block_size, block_size
  u = x_TxN.reshape(t, n // chunk, chunk)[:, runs_R].reshape(t, k, b)
  a = a_TxN.reshape(t, k, b)
  if jax.default_backend() != 'gpu':  # XLA:CPU has no 16-bit dot into float32 in loops;
    a, u = a.astype(jnp.float32), u.astype(jnp.float32)  # 16-bit products are exact in it
  return jnp.einsum('tki,tkj->kij', a, u, preferred_element_type=jnp.float32)


def run_gram(a_TxN: Array, x_TxN: Array, runs_R: Array, *, block_size: int, chunk: int,
             interpret=False) -> Array:
  """``dG[k] = a[:, kB:(k+1)B]^T u[:, kB:(k+1)B]`` in float32, (K, B, B), with
  ``u = x[:, p]`` for the chunk permutation whose run table is ``runs_R``.
  Program (k, row tile, split) accumulates rows of dG_k over its split's
  token tiles, one (64, c) accumulator per run; XLA sums the S partials."""
  b = block_size
  n = x_TxN.shape[-1] if getattr(x_TxN, 'ndim', 0) == 2 else None
  if n is None or getattr(a_TxN, 'shape', None) != x_TxN.shape or a_TxN.dtype != x_TxN.dtype:
    raise ValueError(f'a {getattr(a_TxN, "shape", None)} and x '
                     f'{getattr(x_TxN, "shape", None)} must be 2-D of one shape and dtype')
  k = n // b
  t, _, _, r = _check(x_TxN, jax.ShapeDtypeStruct((k, b, b), x_TxN.dtype), runs_R, chunk, 'x')
  dtype = jnp.dtype(x_TxN.dtype)
  a_TxN = _pad_tokens(a_TxN, GRAM_TILE_T)
  x_TxN = _pad_tokens(x_TxN, GRAM_TILE_T)
  tiles = x_TxN.shape[0] // GRAM_TILE_T
  ri = GRAM_ROWS
  s = _splits(tiles, k * (b // ri))
  per_split = tiles // s
  lhs_t = swizzle(ri, dtype.itemsize)
  run_t = swizzle(chunk, dtype.itemsize)

  def body(a_gmem, runs_gmem, x_gmem, out_gmem):
    kk = jax.lax.axis_index('k')
    ii = jax.lax.axis_index('i')
    ss = jax.lax.axis_index('s')
    src = _read_runs(runs_gmem, kk * r, r)

    def scope(*accs):
      def step(_, a_smem, *x_runs):
        for j, acc in enumerate(accs):
          plgpu.wgmma(acc, a_smem.T, x_runs[j])   # (ri, Tt) @ (Tt, c)
        plgpu.wgmma_wait(0)

      rows = pl.ds(ss * per_split * GRAM_TILE_T, per_split * GRAM_TILE_T)
      plgpu.emit_pipeline(
          step,
          grid=(per_split,),
          in_specs=[plgpu.BlockSpec((GRAM_TILE_T, ri), lambda i: (i, 0), transforms=lhs_t),
                    *[plgpu.BlockSpec((GRAM_TILE_T, chunk), lambda i, q=q: (i, q),
                                      transforms=run_t) for q in src]],
          max_concurrent_steps=2,
      )(a_gmem.at[rows, pl.ds(kk * b + ii * ri, ri)], *([x_gmem.at[rows]] * r))
      return [acc[...] for acc in accs]

    parts = pl.run_scoped(scope, *[plgpu.ACC((ri, chunk), jnp.float32)] * r)
    for j, part in enumerate(parts):
      out_gmem[ss, kk, pl.ds(ii * ri, ri), pl.ds(j * chunk, chunk)] = part

  run = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((s, k, b, b), jnp.float32),
      grid=(k, b // ri, s),
      grid_names=('k', 'i', 's'),
      interpret=interpret_params(interpret),
  )
  return run(a_TxN, runs_R.astype(jnp.int32), x_TxN).sum(0)


# ------------------------------------------------------ differentiable ops
def run_table(perm_N: Array, chunk: int) -> Array:
  """The run table of a chunk permutation of a width divisible by ``chunk``:
  ``perm[::chunk] // chunk`` (int32), run j of the permuted order is run
  ``table[j]`` of the original."""
  return jax.lax.div(perm_N[::chunk].astype(jnp.int32), jnp.int32(chunk))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _permute_rotate(x_TxN, runs_R, g_KxBxB, chunk, config, interpret):
  return gather_rotate(x_TxN, runs_R, g_KxBxB, chunk=chunk, config=config,
                       interpret=interpret)


def _permute_rotate_fwd(x_TxN, runs_R, g_KxBxB, chunk, config, interpret):
  return (_permute_rotate(x_TxN, runs_R, g_KxBxB, chunk, config, interpret),
          (x_TxN, runs_R, g_KxBxB))


def _permute_rotate_bwd(chunk, config, interpret, res, dv_TxN):
  # v = u G^T blockwise, u = x[:, p]: du = dv G, dx[:, p] = du (a scatter of
  # runs), dG_k = dv_k^T u_k (the gram through the run table).
  x_TxN, runs_R, g_KxBxB = res
  dx = rotate_scatter(dv_TxN, jnp.swapaxes(g_KxBxB, 1, 2), runs_R, chunk=chunk, config=config,
                      interpret=interpret)
  dg = gram(dv_TxN, x_TxN, runs_R, block_size=g_KxBxB.shape[-1], chunk=chunk,
            interpret=interpret)
  return dx, None, dg.astype(g_KxBxB.dtype)


_permute_rotate.defvjp(_permute_rotate_fwd, _permute_rotate_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _rotate_unpermute(w_TxN, g_KxBxB, runs_R, chunk, config, interpret):
  return rotate_scatter(w_TxN, g_KxBxB, runs_R, chunk=chunk, config=config,
                        interpret=interpret)


def _rotate_unpermute_fwd(w_TxN, g_KxBxB, runs_R, chunk, config, interpret):
  return (_rotate_unpermute(w_TxN, g_KxBxB, runs_R, chunk, config, interpret),
          (w_TxN, g_KxBxB, runs_R))


def _rotate_unpermute_bwd(chunk, config, interpret, res, dy_TxN):
  # y[:, p] = z, z = w G^T blockwise: dz = dy[:, p] (a gather of runs),
  # dw = dz G, dG_k = dz_k^T w_k = (w_k^T dz_k)^T (the gathered operand on the right).
  w_TxN, g_KxBxB, runs_R = res
  dw = gather_rotate(dy_TxN, runs_R, jnp.swapaxes(g_KxBxB, 1, 2), chunk=chunk, config=config,
                     interpret=interpret)
  dg_t = gram(w_TxN, dy_TxN, runs_R, block_size=g_KxBxB.shape[-1], chunk=chunk,
              interpret=interpret)
  return dw, jnp.swapaxes(dg_t, 1, 2).astype(g_KxBxB.dtype), None


_rotate_unpermute.defvjp(_rotate_unpermute_fwd, _rotate_unpermute_bwd)


def _runs(perm_N, n, chunk):
  if getattr(perm_N, 'shape', None) != (n,):
    raise ValueError(f'the permutation must have shape ({n},) for width {n}, got '
                     f'{getattr(perm_N, "shape", None)}')
  return run_table(jnp.asarray(perm_N), chunk)


def permute_rotate(x_TxN: Array, perm_N: Array, g_KxBxB: Array, *, chunk: int,
                   config: Config | None = None, interpret=False) -> Array:
  """``ops.rotate_features(ops.permute(x, perm, chunk=chunk), g)``, a POET
  layer's input side, on the run kernels; differentiable in x and g.

  Args:
    x_TxN: activations (..., N), bf16 or fp16, N a multiple of B.
    perm_N: a chunk permutation of runs of ``chunk`` features.
    g_KxBxB: the blocks (cast to x's dtype), B a multiple of 64 up to 512.
    chunk: the run length: 32, 64 or 128 bytes of x's dtype, dividing B.
    config: tiles (``pallas_kernels.block_rotate.Config``), static.
    interpret: run in the Mosaic GPU interpreter (CPU tests), static.
  """
  n = x_TxN.shape[-1]
  v = _permute_rotate(_flat(x_TxN), _runs(perm_N, n, chunk), g_KxBxB.astype(x_TxN.dtype),
                      chunk, config, static_interpret(interpret))
  return v.reshape(x_TxN.shape)


def rotate_unpermute(w_TxN: Array, g_KxBxB: Array, dst_N: Array, *, chunk: int,
                     config: Config | None = None, interpret=False) -> Array:
  """``ops.unpermute(ops.rotate_features(w, g), dst, chunk=chunk)`` (``y[...,
  dst[c]] = z[..., c]``), a POET layer's output side, on the run kernels;
  differentiable in w and g. Arguments as for :func:`permute_rotate`
  (``dst``: any chunk permutation of runs of ``chunk``)."""
  n = w_TxN.shape[-1]
  y = _rotate_unpermute(_flat(w_TxN), g_KxBxB.astype(w_TxN.dtype), _runs(dst_N, n, chunk),
                        chunk, config, static_interpret(interpret))
  return y.reshape(w_TxN.shape)

