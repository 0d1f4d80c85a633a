"""POETLinear: a drop-in ``nnx.Linear`` trained as ``R W0 P`` (Flax NNX).

Notation: I in-features, O out-features, B block size, K blocks, P = B(B-1)/2.
The maths lives in :mod:`poetx_jax.ops`; this module holds the state.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers

from poetx_jax import ops

Array = jax.Array
MODES = ('fast', 'mem')
IMPLEMENTATIONS = ('auto', 'xla', 'pallas')


def _interpret() -> bool:
  """Kernels compile on GPUs and run in their interpreters elsewhere (tests)."""
  return jax.default_backend() != 'gpu'


def _pallas_series(q_KxBxB, terms):
  """The Cayley–Neumann step on the Mosaic GPU kernel."""
  from pallas_kernels import cayley_neumann as cn
  return cn.cayley_neumann(q_KxBxB, terms=terms, interpret=_interpret())


def _pallas_rotate(x, g_KxBxB, precision=None):
  """Block products on the Mosaic GPU kernels for 16-bit activations (which
  accumulate in float32 whatever ``precision`` says); the jnp product at
  ``precision`` otherwise (the kernels multiply 16-bit operands only)."""
  from pallas_kernels import block_rotate as br
  if jnp.dtype(x.dtype) not in br.DTYPES:
    return ops.block_rotate(x, g_KxBxB, precision=precision)
  return br.block_rotate(x, g_KxBxB, interpret=_interpret())


def _pallas_permute(x, perm_N):
  """The column gather on the Pallas kernel."""
  from pallas_kernels import permute as pm
  return pm.permute(x, perm_N, interpret=_interpret())


def kernels_for(implementation: str, block_size: int) -> ops.Kernels | None:
  """The ``kernels`` argument of :func:`poetx_jax.ops.poet_linear` for an
  implementation: None (XLA) or the Pallas set.

  ``'pallas'`` runs the activations' block products, forward and backward, on
  the Mosaic GPU kernels of ``pallas_kernels.block_rotate`` (16-bit
  activations; float32 ones keep XLA's product). The Cayley–Neumann kernel
  and the gather kernel are not part of it: on the H200 both measured slower
  than XLA (BENCHMARKS.md); pass them through ``ops.Kernels`` to experiment.
  ``'auto'`` is XLA everywhere (see BENCHMARKS.md for why). Off GPUs the
  kernels run in their interpreters (for tests), which ``jax.checkpoint``
  cannot recompute: there, ``mode='mem'`` and rematerialised models need
  ``'xla'``.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f'implementation must be one of {IMPLEMENTATIONS}, '
                     f'got {implementation!r}')
  if implementation != 'pallas':
    return None
  if block_size % 64 or block_size > 512:
    raise ValueError(f"implementation='pallas' needs a block size that is a multiple "
                     f"of 64, at most 512, got {block_size}")
  try:
    from pallas_kernels import block_rotate  # noqa: F401  (availability check)
  except ImportError as e:
    raise ValueError(f"implementation='pallas' is unavailable here: {e}") from e
  return ops.Kernels(rotate=_pallas_rotate)


def all_kernels() -> ops.Kernels:
  """Every Pallas kernel of the layer, the slower ones included: the
  Cayley–Neumann series, the block products and the gathers (for benchmarks
  and tests; B a multiple of 64, at most 512)."""
  return ops.Kernels(series=_pallas_series, rotate=_pallas_rotate, permute=_pallas_permute)


def _orthogonality_error(g_in: Array, g_out: Array) -> Array:
  return jnp.maximum(ops.orthogonality_error(g_in), ops.orthogonality_error(g_out))


class POETParam(nnx.Param):
  """Packed skew-symmetric generators of a POET rotation, (K, B(B-1)/2) float32."""


class BaseKernel(nnx.Variable):
  """The frozen base weight W0 (permutations folded in). Not a Param: no gradient,
  no optimizer state."""


class Permutation(nnx.Variable):
  """An int32 permutation of the features of one side of a POET layer."""


class POETLinear(nnx.Module):
  """A linear layer whose weight is ``W = R W0 P`` with W0 frozen.

  ``R`` (O x O) and ``P`` (I x I) are block-stochastic orthogonal matrices
  ``Phi G Phi^T``: ``G`` block-diagonal with B x B blocks from the truncated
  Cayley–Neumann series of skew-symmetric generators (``q_in`` for P, ``q_out``
  for R; zeros at start, so the layer starts equal to its base), ``Phi`` a random
  permutation redrawn at every :meth:`merge`. By default the forward is
  input-centric (permute, rotate blocks, frozen GEMM, rotate blocks, permute)
  and ``R W0 P`` is never formed; ``form='weight'`` forms it from block
  products instead. The singular values of the effective weight are those of W0, up
  to the series' orthogonality error.

  It is a drop-in for ``nnx.Linear``: same positional sizes, keyword options and
  (in, out) kernel layout; ``kernel`` holds ``W0'^T = Phi_I^T W0^T Phi_O``.
  Dimensions need not be multiples of ``block_size``: the last block is smaller.

  Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from poetx_jax import POETLinear
    >>> layer = POETLinear(96, 64, block_size=32, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((4, 96))).shape
    (4, 64)

  Args:
    in_features: I.
    out_features: O.
    block_size: B, 1 < B <= min(I, O).
    terms: number of Cayley–Neumann powers (default 4).
    mode: ``'fast'`` keeps the activations the backward needs; ``'mem'``
      (POET-Xmem) keeps only the layer input and recomputes the rest.
    form: the order of the product (same function): ``'input'`` rotates and
      permutes the activations (no weight-gradient GEMM in the backward);
      ``'weight'`` rotates and permutes the frozen kernel and runs one dense
      GEMM (a dense layer's backward, but no activation-sized rotations or
      gathers). See :func:`poetx_jax.ops.poet_linear`.
    implementation: ``'xla'``, ``'pallas'`` (the block products on the Mosaic
      GPU kernels of ``pallas_kernels``, Hopper GPUs; interpreted on other
      backends, for tests; B a multiple of 64, at most 512) or ``'auto'`` (XLA, see
      :func:`kernels_for`). Results agree with ``poetx_jax.ops`` either way.
    quantize: POET-XQ: store W0 as ``'int8'`` or ``'int4'`` with one float32
      scale per ``group_size`` input rows of each output column (symmetric),
      dequantised on the fly and re-quantised at every merge. None keeps W0
      in ``param_dtype``.
    group_size: rows per quantisation group.
    use_bias, dtype, param_dtype, precision, kernel_init, bias_init, rngs: as
      for ``nnx.Linear``; ``param_dtype`` applies to the base kernel and bias,
      the POET parameters are always float32.

  References:
    Qiu et al., Reparameterized LLM Training via Orthogonal Equivalence
    Transformation (POET), NeurIPS 2025; POET-X, arXiv:2603.05500.
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      block_size: int = 256,
      terms: int = ops.DEFAULT_TERMS,
      mode: str = 'fast',
      form: str = 'input',
      implementation: str = 'auto',
      quantize: str | None = None,
      group_size: int = 128,
      use_bias: bool = True,
      dtype: tp.Any = None,
      param_dtype: tp.Any = jnp.float32,
      precision: tp.Any = None,
      kernel_init: tp.Callable = initializers.lecun_normal(),
      bias_init: tp.Callable = initializers.zeros_init(),
      rngs: nnx.Rngs,
  ):
    for name, d in (('in_features', in_features), ('out_features', out_features)):
      if not isinstance(d, int) or d < 1:
        raise ValueError(f'{name} must be a positive int, got {d!r}')
    ops.check_block_size(block_size, in_features, out_features)
    if mode not in MODES:
      raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
    if form not in ops.FORMS:
      raise ValueError(f'form must be one of {ops.FORMS}, got {form!r}')
    kernels_for(implementation, block_size)  # validates
    if (implementation == 'pallas' and mode == 'mem' and _interpret() and dtype is not None
        and jnp.dtype(dtype).itemsize == 2):  # 16-bit: the kernels run (float32 falls back)
      raise ValueError(
          f"implementation='pallas' with mode='mem' needs a GPU: on the "
          f"{jax.default_backend()!r} backend the kernels run in an interpreter whose "
          f"callbacks jax.checkpoint cannot recompute; use mode='fast' or "
          f"implementation='xla' here")
    if not isinstance(terms, int) or terms < 1:
      raise ValueError(f'terms must be an int >= 1, got {terms!r}')
    if quantize is not None and quantize not in ops.QUANT_BITS:
      raise ValueError(f'quantize must be None or one of {tuple(ops.QUANT_BITS)}, '
                       f'got {quantize!r}')

    kernel = kernel_init(rngs.params(), (in_features, out_features), param_dtype)
    if kernel.shape != (in_features, out_features):
      raise ValueError(f'kernel_init gave shape {kernel.shape}, expected '
                       f'{(in_features, out_features)}')
    perm_in = ops.random_permutation(rngs.params(), in_features)
    perm_out = ops.random_permutation(rngs.params(), out_features)
    self.quantize = quantize
    self.group_size = group_size
    self.param_dtype = param_dtype
    base, scale = self._encode_base(ops.permute_kernel(kernel, perm_in, perm_out))
    self.kernel = BaseKernel(base)
    self.kernel_scale = BaseKernel(scale) if scale is not None else nnx.data(None)
    self.bias = (nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
                 if use_bias else nnx.data(None))
    p = ops.skew_size(block_size)
    self.q_in = POETParam(jnp.zeros((ops.num_blocks(in_features, block_size), p), jnp.float32))
    self.q_out = POETParam(jnp.zeros((ops.num_blocks(out_features, block_size), p), jnp.float32))
    self.perm_in = Permutation(perm_in)
    self.perm_out = Permutation(perm_out)

    self.in_features = in_features
    self.out_features = out_features
    self.block_size = block_size
    self.terms = terms
    self.mode = mode
    self.form = form
    self.implementation = implementation
    self.use_bias = use_bias
    self.dtype = dtype
    self.precision = precision

  @classmethod
  def from_linear(cls, linear: nnx.Linear, *, block_size: int, rngs: nnx.Rngs,
                  normalize_rows: bool = False, **kwargs) -> 'POETLinear':
    """A POETLinear whose base is ``linear``'s kernel (and bias).

    Args:
      linear: the layer to replace; its kernel must be 2-D (in, out).
      block_size: B.
      rngs: draws the initial permutations.
      normalize_rows: scale each output row of W (a kernel column) to unit
        L2 norm, as the published POET-X does on conversion.
      **kwargs: other POETLinear options (terms, mode, ...).
    """
    kernel = linear.kernel[...]
    if kernel.ndim != 2:
      raise ValueError(f'POET needs a 2-D kernel (in, out), got shape {kernel.shape}')
    if normalize_rows:
      norm = jnp.linalg.norm(kernel.astype(jnp.float32), axis=0, keepdims=True)
      kernel = (kernel / jnp.maximum(norm, 1e-12)).astype(kernel.dtype)
    opts = dict(use_bias=linear.bias is not None, dtype=linear.dtype,
                param_dtype=kernel.dtype, precision=linear.precision)
    opts.update(kwargs)
    if opts['use_bias']:
      bias = linear.bias[...]
      opts['bias_init'] = lambda *_: bias
    return cls(kernel.shape[0], kernel.shape[1], block_size=block_size,
               kernel_init=lambda *_: kernel, rngs=rngs, **opts)

  def _encode_base(self, kernel_IxO: Array) -> tuple[Array, Array | None]:
    """The stored form of a permuted base: (kernel, None), or (q, scales) for POET-XQ."""
    if self.quantize is None:
      return kernel_IxO.astype(self.param_dtype), None
    return ops.quantize_kernel(kernel_IxO, bits=self.quantize, group_size=self.group_size)

  def base_kernel(self) -> Array:
    """The permuted base ``W0'^T`` (I, O), dequantised for POET-XQ."""
    if self.quantize is None:
      return self.kernel[...]
    return ops.dequantize_kernel(self.kernel[...], self.kernel_scale[...],
                                 self.in_features)

  @property
  def stack_shape(self) -> tuple[int, ...]:
    """The leading axes when this module holds a stack of layers (inside a
    ``StackedLayers``, each variable has a leading layer axis); () for one layer."""
    return tuple(self.q_in.shape[:-2])

  def _each(self, fn: tp.Callable, *args, update: bool = False):
    """``fn(layer, *args)`` on each layer of a stack in turn, or on self.

    One layer at a time (a loop, not vmap), so the scratch memory is one
    layer's. ``args`` are stacked like the layers. With ``update``, fn may
    change the layer and self takes the new state, written into the stack in
    place (when the caller's buffers are donated). Returns fn's outputs,
    stacked.
    """
    if not self.stack_shape:
      return fn(self, *args)
    if len(self.stack_shape) != 1:
      raise ValueError(f'one stacked layer axis is supported, got {self.stack_shape}')
    graphdef, state = nnx.split(self)

    def one(layer_state, a):
      layer = nnx.merge(graphdef, layer_state)
      out = fn(layer, *a)
      return nnx.state(layer), out

    if not update:
      return jax.lax.map(lambda xs: one(*xs)[1], (state, args))

    def body(state, xs):  # the stack is the carry: each layer written back in place
      i, a = xs
      new, out = one(jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(
          x, i, 0, keepdims=False), state), a)
      return jax.tree.map(lambda s, v: jax.lax.dynamic_update_index_in_dim(s, v, i, 0),
                          state, new), out

    state, outs = jax.lax.scan(body, state, (jnp.arange(self.stack_shape[0]), args))
    nnx.update(self, state)
    return outs

  def __call__(self, inputs: Array) -> Array:
    """y = inputs @ effective_kernel (+ bias)."""
    if self.stack_shape:
      raise ValueError(f'this POETLinear holds a stack of {self.stack_shape} layers '
                       f'(StackedLayers runs them one at a time); call one layer')
    bias = self.bias[...] if self.bias is not None else None
    if self.quantize is None:
      x, kernel, bias = dtypes.promote_dtype((inputs, self.kernel[...], bias),
                                             dtype=self.dtype)
      scale = None
    else:  # dequantised inside the layer (recomputed under mode='mem')
      dtype = self.dtype or jnp.result_type(inputs, jnp.float32)
      x, bias = dtypes.promote_dtype((inputs, bias), dtype=dtype)
      kernel, scale = self.kernel[...], self.kernel_scale[...]
    y = ops.poet_linear(x, kernel, self.q_in[...], self.q_out[...],
                        self.perm_in[...], self.perm_out[...],
                        block_size=self.block_size, terms=self.terms,
                        remat=self.mode == 'mem', form=self.form,
                        precision=self.precision,
                        kernels=kernels_for(self.implementation, self.block_size),
                        kernel_scale=scale)
    if bias is not None:
      y = y + bias
    return y

  def effective_kernel(self) -> Array:
    """(R W0 P)^T in (in, out) layout, float32 (with :attr:`stack_shape`
    leading). For merges, export and tests."""
    return self._each(lambda layer: layer._kernel_from(*layer._blocks()))

  def _kernel_from(self, g_in: Array, g_out: Array) -> Array:
    return ops.kernel_from_blocks(self.base_kernel(), g_in, g_out, self.perm_in[...],
                                  self.perm_out[...])

  def orthogonality_error(self) -> Array:
    """How far the factors are from orthogonal: the larger over R and P of
    :func:`ops.orthogonality_error` (max over blocks of ``||G^T G - I||_F /
    sqrt(B)``), float32. 0 at Q = 0; the truncated series' error otherwise,
    which grows quickly once a block's ``||Q||`` nears 1. The largest over a
    stack of layers."""
    return jnp.max(self._each(lambda layer: _orthogonality_error(*layer._blocks())))

  def _blocks(self) -> tuple[Array, Array]:
    """The float32 Cayley–Neumann blocks of P and R (full precision)."""
    return ops.rotation_blocks_pair(self.q_in[...], self.q_out[...], self.in_features,
                                    self.out_features, self.block_size, self.terms)

  def merge(self, key: Array) -> Array:
    """Merge-then-reinitialise: W0 <- R W0 P, fresh permutations, Q <- 0.

    Returns the merged factors' :meth:`orthogonality_error` (what the merge
    folds into W0 beyond a rotation). A stack of layers merges each layer
    with its own key, split from ``key``.
    """
    if self.stack_shape:
      keys = jax.random.split(key, self.stack_shape)
      return jnp.max(self._each(lambda layer, k: layer.merge(k), keys, update=True))
    g_in, g_out = self._blocks()  # one series for the error and the merged kernel
    error = _orthogonality_error(g_in, g_out)
    k_in, k_out = jax.random.split(key)
    merged = self._kernel_from(g_in, g_out)
    perm_in = ops.random_permutation(k_in, self.in_features)
    perm_out = ops.random_permutation(k_out, self.out_features)
    base, scale = self._encode_base(ops.permute_kernel(merged, perm_in, perm_out))
    self.kernel[...] = base
    if scale is not None:
      self.kernel_scale[...] = scale
    self.perm_in[...] = perm_in
    self.perm_out[...] = perm_out
    self.q_in[...] = jnp.zeros_like(self.q_in[...])
    self.q_out[...] = jnp.zeros_like(self.q_out[...])
    return error

  def to_linear(self, *, rngs: nnx.Rngs | None = None) -> nnx.Linear:
    """A plain ``nnx.Linear`` holding the effective kernel (in the base's dtype);
    a stack of layers gives a stacked Linear (kernel with the same leading axes)."""
    kernel = self.effective_kernel().astype(self.param_dtype)
    bias = self.bias[...] if self.bias is not None else None
    linear = nnx.Linear(
        self.in_features, self.out_features, use_bias=bias is not None,
        dtype=self.dtype, param_dtype=kernel.dtype, precision=self.precision,
        kernel_init=lambda *_: kernel,
        bias_init=(lambda *_: bias) if bias is not None else initializers.zeros_init(),
        rngs=rngs if rngs is not None else nnx.Rngs(0))
    if self.stack_shape:  # keep the stack's tag (read by poetx_jax.sharding)
      for v in (linear.kernel, linear.bias):
        if v is not None:
          v.set_metadata(layer_axis=self.kernel.get_metadata().get('layer_axis', 0))
    return linear
