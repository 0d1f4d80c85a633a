"""The gathers of a POET layer fused into its block products (Pallas Triton).

Notation (used in shape suffixes): T tokens, N features, B block size,
K = ceil(N / B) blocks (the last may be ragged: r = N - (K-1) B real columns),
M token rows per program (``Config.tile_m``), C output columns of a block per
program (``tile_c``), Q input columns per step of the reduction (``tile_k``),
S token splits of a reduction.

A POET layer gathers its input by ``perm_in`` and then rotates it, and rotates
its output and then scatters it back by ``perm_out``; on XLA each gather is a
kernel of its own that writes a permuted copy of a T x N activation. Here the
index is applied inside the block product, through the pointer-tensor loads
and stores of the Pallas Triton lowering (Mosaic GPU has no per-lane indexed
global load on Hopper, :mod:`pallas_kernels.permute` says why):

* :func:`gather_rotate` ``v = rotate_features(x[:, src], g)``: program (token
  tile, block k, column tile c) loads its (M, Q) slices of x through the index
  (``x[rows, src[cols]]``), multiplies each by rows c of ``G_k`` and writes its
  (M, C) tile of v once. No permuted copy of x is written.
* :func:`rotate_scatter` ``y[:, dst[c]] = rotate_features(w, g)[:, c]``: w's
  block columns are loaded contiguously; each output column c is stored to
  column ``dst[c]`` (a scattered store).
* :func:`block_gram` ``dG_k = A_k^T B_k`` (float32), the generators' gradient,
  either operand optionally read through an index: program (split s, block k,
  row tile i, column tile j) sums a (C, Q) tile over its split's token
  tiles; XLA sums the S partials (as :mod:`pallas_kernels.block_rotate`).

Every tail is masked: rows >= T are neither read (loads give 0) nor written,
and columns >= N of the ragged last block read as 0 (the zero padding of
``poetx_jax.ops.rotate_features``) and are not written. The output columns of
a block are tiled in the grid (B / C programs per block and token tile; the
x tile is then re-read, from L2: the programs of one token tile are adjacent
in the one-dimensional launch grid, so they run together). G is cast to x's
dtype and the products accumulate in float32 (``pltriton.dot``); results are
rounded to x's dtype once. float32 inputs multiply at HIGHEST precision
(XLA stays the float32 path).

Measured on the H200 (BENCHMARKS.md) they are 2.4-5x slower than XLA's
gather and block product at every layer width of the 130M-8B models: each
gathered bf16 element costs its own 32-byte sector from L2 (a sector's 16
columns fall in different blocks, whose programs run on different SMs, so
L1 cannot reuse it), while XLA's gather reads a row within one thread block
and reuses its sectors from L1. A gather at the copy rate needs the row
panel in shared memory, gathered per lane, which neither Pallas lowering
expresses. So ``FASTER`` is empty: ``'auto'`` runs XLA, ``'fused'`` these.

With a chunk permutation (``chunk``: runs of that many contiguous features,
:mod:`poetx_jax.perms`) the kernels read one index per run and every sector
they load is a whole run's: on one H100 that made them 2-7x faster than on
element permutations, but still slower than XLA's composition, which fuses
a gather of runs into the block product's operand at no extra cost
(docs/results/chunk-permutations). ``FASTER`` stays empty for them too.

The differentiable entry points mirror ``poetx_jax.ops`` exactly:
:func:`permute_rotate` is ``rotate_features(permute(x, perm), g)`` (a layer's
input side) and :func:`rotate_unpermute` is ``y[:, dst] = rotate_features(w,
g)``, i.e. ``unpermute(rotate_features(w, g), dst)`` (its output side; any
permutation ``dst``). Each one's backward is the other kernel with the blocks
transposed plus a gram reading one operand through the same index: no
inverse permutation is formed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from poetx_jax import perms


Array = jax.Array
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
MIN_B, MAX_B = 16, 512
TARGET_PROGRAMS = 264  # block_gram's splits: about two waves of an H200's 132 SMs
# (N, B, chunk) of the layer sides where experiments/bench_fused.py measured
# the fused kernels faster than XLA's gather and block products on a Hopper
# GPU, forward and backward together (chunk: the run length of the side's
# permutation, 1 for an element permutation): where implementation='auto'
# runs them (pallas_kernels.fused_kernels). Measured: none (BENCHMARKS.md).
FASTER: frozenset[tuple[int, int, int]] = frozenset()


def _pow2(v) -> bool:
  return isinstance(v, int) and v > 0 and v & (v - 1) == 0


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiles of the fused kernels (all powers of two, at least 16: ``tl.dot``'s
  smallest operand dimension).

  The defaults keep one float32 accumulator of 32 KiB per program, 64
  registers a thread at 4 warps: (M, C) = (64, 128) in the products, (C, Q)
  = (128, 64) in block_gram; at B = 256 each token tile's gathered rows are
  read by two programs. A gathered operand costs a 64-bit address per
  element in registers: compiled for sm_90 by Triton 3.6 at B = 256 the
  defaults take 165 (products) and 217 (block_gram) registers a thread
  without spills, where a (128, 128) gram tile at 4 warps spilled. M >= 64
  lets Triton use Hopper's wgmma (M = 32 fell back to mma). On the H200
  C = 256 at 8 warps is the fastest product variant swept (1.5x these).

  Attrs:
    tile_m: M, token rows per program (gather_rotate, rotate_scatter) and
      tokens per reduction step (block_gram).
    tile_c: C, output columns of a block per program, dividing B; None:
      min(B, 128).
    tile_k: Q, the block's input columns per step of the inner dot loop,
      capped at B. block_gram's programs compute (C, Q) tiles of dG_k.
    num_warps, num_stages: Triton's launch and software-pipelining depth.
  """
  tile_m: int = 64
  tile_c: int | None = None
  tile_k: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ('tile_m', 'tile_k'):
      v = getattr(self, name)
      if not _pow2(v) or v < 16:
        raise ValueError(f'Config.{name}={v!r} must be a power of two, at least 16')
    if self.tile_c is not None and (not _pow2(self.tile_c) or self.tile_c < 16):
      raise ValueError(f'Config.tile_c={self.tile_c!r} must be None or a power of two, '
                       f'at least 16')
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f'Config.num_warps={self.num_warps!r} must be 1, 2, 4, 8 or 16')
    if not isinstance(self.num_stages, int) or self.num_stages < 1:
      raise ValueError(f'Config.num_stages={self.num_stages!r} must be an int >= 1')

  def resolve(self, b: int) -> tuple[int, int, int]:
    """(M, C, Q) for block size B."""
    c = min(b, 128) if self.tile_c is None else self.tile_c
    if b % c:
      raise ValueError(f'Config.tile_c={c} must divide the block size B={b}')
    return self.tile_m, c, min(self.tile_k, b)

  def params(self):
    return pltriton.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


# ------------------------------------------------------------------ checks
def _check_blocks(g_KxBxB, n: int) -> tuple[int, int]:
  """(K, B) of the blocks, validated against width N; errors name the value."""
  shape = getattr(g_KxBxB, 'shape', None)
  if shape is None or len(shape) != 3 or shape[1] != shape[2]:
    raise ValueError(f'g_KxBxB must have shape (K, B, B), got {shape}')
  k, b, _ = shape
  if not _pow2(b) or not MIN_B <= b <= MAX_B:
    raise ValueError(f'block size B={b} is not supported by the fused kernels: it must be '
                     f'a power of two from {MIN_B} to {MAX_B}')
  if k != -(-n // b):
    raise ValueError(f'{k} blocks of {b} do not cover width N={n}: it needs '
                     f'K = ceil(N / B) = {-(-n // b)}')
  return k, b


def _check_x(x_TxN, what: str) -> tuple[int, int]:
  shape = getattr(x_TxN, 'shape', None)
  if shape is None or len(shape) != 2 or shape[0] < 1:
    raise ValueError(f'{what} must be 2-D (T, N) with T >= 1, got shape {shape}')
  if jnp.dtype(x_TxN.dtype) not in DTYPES:
    raise ValueError(f'{what} must be bfloat16, float16 or float32, got {x_TxN.dtype}')
  return shape


def _check_index(idx_N, n: int, what: str) -> Array:
  if getattr(idx_N, 'shape', None) != (n,):
    raise ValueError(f'{what} must have shape ({n},) for width {n}, got '
                     f'{getattr(idx_N, "shape", None)}')
  return jnp.asarray(idx_N).astype(jnp.int32)


def _precision(dtype):
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _split(pid, *sizes):
  """pid as mixed-radix digits of radices ``sizes``, the first slowest."""
  digits = []
  for s in reversed(sizes[1:]):
    digits.append(jax.lax.rem(pid, s))
    pid = jax.lax.div(pid, s)
  return (pid, *reversed(digits))


def _columns(idx_ref, cols, n, chunk, other):
  """The columns ``cols`` map to through an index: ``idx[cols]`` for an
  element index (``chunk`` 1); for a run table (``chunk`` > 1, one entry
  per run, :func:`run_table`) ``idx[cols // chunk] * chunk + cols %
  chunk``: one index load per run, and columns contiguous within it.
  Columns >= N give ``other``."""
  if chunk == 1:
    return pltriton.load(idx_ref.at[cols], mask=cols < n, other=other)
  run = pltriton.load(idx_ref.at[jax.lax.div(cols, chunk)], mask=cols < n, other=0)
  return jnp.where(cols < n, run * chunk + jax.lax.rem(cols, chunk), other)


def _load_tile(ref, src_ref, row0, col0, tm, width, t, n, chunk=1):
  """ref[row0:row0+M, col0:col0+width] (through ``src_ref``'s index when given,
  :func:`_columns`), rows >= T and columns >= N read as 0."""
  rows = row0 + _iota((tm, width), 0)
  cols = col0 + _iota((width,), 0)
  mask = (rows < t) & (cols < n)[None, :]
  if src_ref is None:
    view = ref.at[pl.ds(row0, tm), pl.ds(col0, width)]
  else:
    src = _columns(src_ref, cols, n, chunk, 0)
    view = ref.at[rows, jnp.broadcast_to(src[None, :], (tm, width))]
  return pltriton.load(view, mask=mask, other=0)


def run_table(perm_N: Array, chunk: int) -> Array:
  """The index the kernels read for a chunk permutation of runs of
  ``chunk`` (> 1) features: one entry per run, ``ceil(N / chunk)``, the
  run each position's run takes (``perm[::chunk] // chunk`` over the full
  runs, then the ragged last run, which stays last)."""
  n = perm_N.shape[-1]
  full = n // chunk
  runs = jax.lax.div(perm_N[:full * chunk:chunk].astype(jnp.int32), jnp.int32(chunk))
  if n % chunk:
    runs = jnp.concatenate([runs, jnp.full((1,), n // chunk, jnp.int32)])
  return runs


def _kernel_index(idx_N: Array, n: int, chunk: int, what: str) -> Array:
  """The index a kernel reads: the permutation itself (``chunk`` 1) or its
  run table."""
  idx_N = _check_index(idx_N, n, what)
  chunk = perms.check_chunk_size(chunk, what=f'chunk (the run length of {what})')
  return idx_N if chunk == 1 else run_table(idx_N, chunk)


# ----------------------------------------------------------------- kernels
def _rotate_call(x_TxN, g_KxBxB, src_N, dst_N, config, interpret, name, chunk=1):
  """The shared body of gather_rotate (src) and rotate_scatter (dst), each
  an index :func:`_kernel_index` made for ``chunk``."""
  t, n = x_TxN.shape
  k, b = _check_blocks(g_KxBxB, n)
  tm, tc, tk = (config or Config()).resolve(b)
  nc, nk, tiles = b // tc, b // tk, -(-t // tm)
  dtype = x_TxN.dtype
  prec = _precision(dtype)
  g_KxBxB = g_KxBxB.astype(dtype)

  def body(*refs):
    x_ref, g_ref = refs[0], refs[1]
    src_ref = refs[2] if src_N is not None else None
    dst_ref = refs[2] if dst_N is not None else None
    y_ref = refs[-1]
    i, kk, cc = _split(pl.program_id(0), tiles, k, nc)
    row0 = i * tm

    def step(q, acc):
      u = _load_tile(x_ref, src_ref, row0, kk * b + q * tk, tm, tk, t, n, chunk)
      g = g_ref[kk, pl.ds(cc * tc, tc), pl.ds(q * tk, tk)]     # rows C of G_k, cols Q
      return acc + pltriton.dot(u, g, trans_b=True, precision=prec)  # (M, Q) @ (Q, C)

    acc = jax.lax.fori_loop(0, nk, step, jnp.zeros((tm, tc), jnp.float32))
    rows = row0 + _iota((tm, tc), 0)
    cols = kk * b + cc * tc + _iota((tc,), 0)
    mask = (rows < t) & (cols < n)[None, :]
    if dst_ref is None:
      view = y_ref.at[pl.ds(row0, tm), pl.ds(kk * b + cc * tc, tc)]
    else:
      # Masked lanes get column N (past the end) so that they never alias a
      # real column (the interpreter drops their writes; Triton masks them).
      dst = _columns(dst_ref, cols, n, chunk, n)
      view = y_ref.at[rows, jnp.broadcast_to(dst[None, :], (tm, tc))]
    pltriton.store(view, acc.astype(dtype), mask=mask)

  index = src_N if src_N is not None else dst_N
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  return pl.pallas_call(
      body,
      out_shape=jax.ShapeDtypeStruct((t, n), dtype),
      grid=(tiles * k * nc,),
      in_specs=[any_spec] * 3,
      out_specs=any_spec,
      compiler_params=(config or Config()).params(),
      interpret=interpret,
      name=name,
  )(x_TxN, g_KxBxB, index)


def gather_rotate(x_TxN: Array, src_N: Array, g_KxBxB: Array, *,
                  config: Config | None = None, interpret: bool = False,
                  chunk: int = 1) -> Array:
  """``rotate_features(x[:, src], g)`` in one kernel (no custom VJP).

  Args:
    x_TxN: (T, N) activations, bf16, fp16 or float32.
    src_N: the gather index (int, each in [0, N); a permutation for the
      layers, though any index works with ``chunk`` 1).
    chunk: ``src`` is a chunk permutation of runs of this many features
      (:mod:`poetx_jax.perms`): the kernel reads one index per run.
    g_KxBxB: K = ceil(N / B) blocks, B a power of two from 16 to 512; cast to
      x's dtype.
    config: tiles (:class:`Config`).
    interpret: run in the Pallas interpreter (CPU tests).

  Returns:
    v (T, N) in x's dtype, ``v[:, kB+i] = sum_j G[k,i,j] x[:, src[kB+j]]``.
  """
  t, n = _check_x(x_TxN, 'x')
  src_N = _kernel_index(src_N, n, chunk, 'src')
  return _rotate_call(x_TxN, g_KxBxB, src_N, None, config, interpret, 'poetx_gather_rotate',
                      chunk)


def rotate_scatter(w_TxN: Array, g_KxBxB: Array, dst_N: Array, *,
                   config: Config | None = None, interpret: bool = False,
                   chunk: int = 1) -> Array:
  """``y[:, dst[c]] = rotate_features(w, g)[:, c]`` in one kernel (no custom VJP).

  ``dst`` must be a permutation of range(N) (every column of y is written
  exactly once); y is then ``z[:, inverse(dst)]``. Arguments as for
  :func:`gather_rotate`.
  """
  t, n = _check_x(w_TxN, 'w')
  dst_N = _kernel_index(dst_N, n, chunk, 'dst')
  return _rotate_call(w_TxN, g_KxBxB, None, dst_N, config, interpret, 'poetx_rotate_scatter',
                      chunk)


def _splits(tiles: int, programs: int) -> tuple[int, int]:
  """(S, token tiles per split) for about TARGET_PROGRAMS programs."""
  s = max(1, min(tiles, -(-TARGET_PROGRAMS // programs)))
  per = -(-tiles // s)
  return -(-tiles // per), per


def block_gram(a_TxN: Array, b_TxN: Array, *, block_size: int, a_src: Array | None = None,
               b_src: Array | None = None, config: Config | None = None,
               interpret: bool = False, chunk: int = 1) -> Array:
  """``dG[k,i,j] = sum_t A[t,kB+i] B[t,kB+j]`` in float32, (K, B, B).

  ``A = a[:, a_src]`` when ``a_src`` is given, else a (likewise B); columns
  past N count as zero; ``chunk``: the indices are chunk permutations of
  runs of this many features (as for :func:`gather_rotate`). Program (s, k, i, j) accumulates a (C, Q) tile of
  dG_k over its split's token tiles (M tokens a step); the S float32
  partials are summed by XLA.
  """
  t, n = _check_x(a_TxN, 'a')
  if getattr(b_TxN, 'shape', None) != (t, n) or b_TxN.dtype != a_TxN.dtype:
    raise ValueError(f'b must have a\'s shape {(t, n)} and dtype {a_TxN.dtype}, got '
                     f'{getattr(b_TxN, "shape", None)} {getattr(b_TxN, "dtype", None)}')
  k, b = _check_blocks(jax.ShapeDtypeStruct((-(-n // block_size), block_size, block_size),
                                            jnp.float32), n)
  config = config or Config()
  tm, tc, tk = config.resolve(b)
  nc, nk = b // tc, b // tk
  s, per = _splits(-(-t // tm), k * nc * nk)
  prec = _precision(a_TxN.dtype)
  srcs = [_kernel_index(i, n, chunk, name) for i, name in ((a_src, 'a_src'), (b_src, 'b_src'))
          if i is not None]

  def body(*refs):
    a_ref, b_ref, out_ref = refs[0], refs[1], refs[-1]
    rest = iter(refs[2:-1])
    a_src_ref = next(rest) if a_src is not None else None
    b_src_ref = next(rest) if b_src is not None else None
    ss, kk, ii, jj = _split(pl.program_id(0), s, k, nc, nk)

    def step(step_j, acc):
      row0 = (ss * per + step_j) * tm
      at = _load_tile(a_ref, a_src_ref, row0, kk * b + ii * tc, tm, tc, t, n, chunk)
      bt = _load_tile(b_ref, b_src_ref, row0, kk * b + jj * tk, tm, tk, t, n, chunk)
      return acc + pltriton.dot(at, bt, trans_a=True, precision=prec)  # (C, M) @ (M, Q)

    acc = jax.lax.fori_loop(0, per, step, jnp.zeros((tc, tk), jnp.float32))
    out_ref[ss, kk, pl.ds(ii * tc, tc), pl.ds(jj * tk, tk)] = acc

  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  partials = pl.pallas_call(
      body,
      out_shape=jax.ShapeDtypeStruct((s, k, b, b), jnp.float32),
      grid=(s * k * nc * nk,),
      in_specs=[any_spec] * (2 + len(srcs)),
      out_specs=any_spec,
      compiler_params=config.params(),
      interpret=interpret,
      name='poetx_block_gram',
  )(a_TxN, b_TxN, *srcs)
  return partials.sum(0)


# ------------------------------------------------------ differentiable ops
def _flat(x):
  return x.reshape(-1, x.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _permute_rotate(x_TxN, perm_N, g_KxBxB, config, interpret, chunk):
  return gather_rotate(x_TxN, perm_N, g_KxBxB, config=config, interpret=interpret, chunk=chunk)


def _permute_rotate_fwd(x_TxN, perm_N, g_KxBxB, config, interpret, chunk):
  return (_permute_rotate(x_TxN, perm_N, g_KxBxB, config, interpret, chunk),
          (x_TxN, perm_N, g_KxBxB))


def _permute_rotate_bwd(config, interpret, chunk, res, dv_TxN):
  # v = u G^T blockwise with u = x[:, perm]: du = dv G (the blocks transposed),
  # dx[:, perm[c]] = du[:, c] (a scatter by perm), dG_k = dv_k^T u_k.
  x_TxN, perm_N, g_KxBxB = res
  dx = rotate_scatter(dv_TxN, jnp.swapaxes(g_KxBxB, 1, 2), perm_N, config=config,
                      interpret=interpret, chunk=chunk)
  dg = block_gram(dv_TxN, x_TxN, block_size=g_KxBxB.shape[-1], b_src=perm_N, config=config,
                  interpret=interpret, chunk=chunk)
  return dx, None, dg.astype(g_KxBxB.dtype)


_permute_rotate.defvjp(_permute_rotate_fwd, _permute_rotate_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _rotate_unpermute(w_TxN, g_KxBxB, dst_N, config, interpret, chunk):
  return rotate_scatter(w_TxN, g_KxBxB, dst_N, config=config, interpret=interpret, chunk=chunk)


def _rotate_unpermute_fwd(w_TxN, g_KxBxB, dst_N, config, interpret, chunk):
  return (_rotate_unpermute(w_TxN, g_KxBxB, dst_N, config, interpret, chunk),
          (w_TxN, g_KxBxB, dst_N))


def _rotate_unpermute_bwd(config, interpret, chunk, res, dy_TxN):
  # y[:, dst[c]] = z[:, c] with z = w G^T blockwise: dz = dy[:, dst] (a gather
  # by dst), dw = dz G, dG_k = dz_k^T w_k.
  w_TxN, g_KxBxB, dst_N = res
  dw = gather_rotate(dy_TxN, dst_N, jnp.swapaxes(g_KxBxB, 1, 2), config=config,
                     interpret=interpret, chunk=chunk)
  dg = block_gram(dy_TxN, w_TxN, block_size=g_KxBxB.shape[-1], a_src=dst_N, config=config,
                  interpret=interpret, chunk=chunk)
  return dw, dg.astype(g_KxBxB.dtype), None


_rotate_unpermute.defvjp(_rotate_unpermute_fwd, _rotate_unpermute_bwd)


def permute_rotate(x_TxN: Array, perm_N: Array, g_KxBxB: Array, *,
                   config: Config | None = None, interpret: bool = False,
                   chunk: int = 1) -> Array:
  """``ops.rotate_features(ops.permute(x, perm), g)``, a POET layer's input
  side, on the fused kernels; differentiable in x and g.

  Args:
    x_TxN: activations (..., N), bf16, fp16 or float32.
    perm_N: the permutation Phi_I as an index array.
    g_KxBxB: the rotation blocks (any float dtype; cast to x's for the
      products), K = ceil(N / B), B a power of two from 16 to 512.
    config: tiles (:class:`Config`), static.
    interpret: run in the Pallas interpreter (CPU tests), static.
    chunk: ``perm`` is a chunk permutation of runs of this many features
      (:mod:`poetx_jax.perms`; 1: any permutation), static: the kernels
      read whole runs.

  Returns:
    v with x's shape and dtype. Backward: ``dx`` by :func:`rotate_scatter`
    of the cotangent with the blocks transposed and ``dst = perm``; ``dg`` by
    :func:`block_gram` with x read through ``perm`` (float32, cast to g's
    dtype once). No inverse permutation is formed.

  Example (interpreted on the CPU)::

    >>> from poetx_jax import ops
    >>> x = jax.random.normal(jax.random.key(0), (8, 48))
    >>> g = jnp.eye(32)[None].repeat(2, 0)      # 2 identity blocks (ragged)
    >>> p = ops.random_permutation(jax.random.key(1), 48)
    >>> bool((permute_rotate(x, p, g, interpret=True) == x[:, p]).all())
    True
  """
  n = x_TxN.shape[-1]
  v = _permute_rotate(_flat(x_TxN), _check_index(perm_N, n, 'perm'), g_KxBxB,
                      config, bool(interpret), chunk)
  return v.reshape(x_TxN.shape)


def rotate_unpermute(w_TxN: Array, g_KxBxB: Array, dst_N: Array, *,
                     config: Config | None = None, interpret: bool = False,
                     chunk: int = 1) -> Array:
  """``y[..., dst[c]] = ops.rotate_features(w, g)[..., c]``: with ``dst =
  perm_out`` this is ``ops.unpermute(ops.rotate_features(w, g), perm_out)``,
  a POET layer's output side; ``dst`` may be any permutation of range(N)
  (e.g. a SwiGLU join's). Differentiable in w and g.

  Returns:
    y with w's shape and dtype. Backward: ``dw`` by :func:`gather_rotate` of
    the cotangent with ``src = dst`` and the blocks transposed; ``dg`` by
    :func:`block_gram` with the cotangent read through ``dst``. Arguments as
    for :func:`permute_rotate`.
  """
  n = w_TxN.shape[-1]
  y = _rotate_unpermute(_flat(w_TxN), g_KxBxB, _check_index(dst_N, n, 'dst'),
                        config, bool(interpret), chunk)
  return y.reshape(w_TxN.shape)
