"""POETLinear: a drop-in ``nnx.Linear`` trained as ``R W0 P`` (Flax NNX).

Notation: I in-features, O out-features, B block size, K blocks, P = B(B-1)/2.
The maths lives in :mod:`poetx_jax.ops`; this module holds the state. Code
that works on whole models (conversion, stacks of layers) is in
:mod:`poetx_jax.convert`; the merge cycle in :mod:`poetx_jax.cycle`.
"""

from __future__ import annotations

import contextlib
import contextvars
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes, initializers

from poetx_jax import ops

# nnx.Linear's product options and their defaults (POETLinear.from_linear
# refuses a layer that changes any), and the variable metadata that says how
# an array is sharded (carried over to the POET layer's kernel and bias).
_LINEAR_PRODUCTS = (('dot_general', jax.lax.dot_general),
                    ('promote_dtype', dtypes.promote_dtype),
                    ('preferred_element_type', None))
_SHARDING_METADATA = ('out_sharding', 'mesh')


def check_linear_products(linear: nnx.Linear) -> None:
  """ValueError naming the product options (``dot_general``,
  ``promote_dtype``, ``preferred_element_type``) ``linear`` sets: a POET
  layer computes with its own, so it cannot honour them."""
  custom = [name for name, default in _LINEAR_PRODUCTS
            if getattr(linear, name, default) is not default]
  if custom:
    raise ValueError(f'nnx.Linear option(s) {", ".join(custom)} set: a POET layer computes '
                     f'with its own products; leave them at their defaults, or exclude '
                     f'the layer')


def carry_sharding(linear: nnx.Linear, layer: 'POETLinear') -> None:
  """Gives ``layer``'s kernel and bias the sharding annotations of
  ``linear``'s (same axes: ``(..., I, O)`` and ``(..., O)``)."""
  for old_var, new_var in ((linear.kernel, layer.kernel), (linear.bias, layer.bias)):
    if old_var is not None and new_var is not None:
      meta = old_var.get_metadata()
      carried = {k: meta[k] for k in _SHARDING_METADATA if k in meta}
      if carried:
        new_var.set_metadata(**carried)

Array = jax.Array
MODES = ('fast', 'mem')
IMPLEMENTATIONS = ('auto', 'xla', 'pallas', 'fused')


# id(POETLinear) -> (G_P, G_R, series precision, (inverse of perm_in, of
# perm_out)): the rotation blocks and inverse permutations given to layers
# while a using_blocks block runs.
_BLOCKS: contextvars.ContextVar[dict | None] = contextvars.ContextVar('poetx_blocks',
                                                                      default=None)


@contextlib.contextmanager
def using_blocks(blocks: dict[int, tuple]) -> tp.Iterator[None]:
  """While the block runs, the POET layers named in ``blocks`` use the
  rotation blocks and inverse permutations given there in place of their own.

  ``blocks`` maps ``id(layer)`` to ``(G_P, G_R, precision, (inverse of
  perm_in, inverse of perm_out))``: the blocks of the layer's input and
  output rotations, computed by the Cayley–Neumann series at ``precision``
  (:func:`poetx_jax.ops.series_precision`), and its inverse permutations. A
  layer called on inputs whose series precision differs computes its own
  blocks and still uses the inverses (:func:`given_inverses`). Blocks given
  in an enclosing ``using_blocks`` stay given unless ``blocks`` names the
  same layer; they alone apply again once the block ends. It is how
  :func:`poetx_jax.groups.batched_series` hands the series it batched over a
  module's layers to them.
  """
  token = _BLOCKS.set({**(_BLOCKS.get() or {}), **blocks})
  try:
    yield
  finally:
    _BLOCKS.reset(token)


# The sharding every POET layer pins its inputs and outputs to while a
# pinned_activations block runs (None: no constraint).
_PINNED: contextvars.ContextVar[jax.sharding.Sharding | None] = contextvars.ContextVar(
    'poetx_pinned', default=None)


@contextlib.contextmanager
def pinned_activations(where: jax.sharding.Sharding) -> tp.Iterator[None]:
  """While the block runs (a trace), every POET layer called constrains its
  inputs and outputs to ``where`` (``jax.lax.with_sharding_constraint``).
  :func:`poetx_jax.gradients` uses it to keep each device's rows whole on
  that device under ``fully_sharded``: left free, XLA's partitioner may
  split a layer's rotation blocks over the devices and move the activations
  between them to match."""
  token = _PINNED.set(where)
  try:
    yield
  finally:
    _PINNED.reset(token)


def given_inverses(layer: 'POETLinear') -> tuple[jax.Array, jax.Array] | None:
  """The inverses of ``layer``'s (perm_in, perm_out) given to it by the
  :func:`using_blocks` block running, or None."""
  given = (_BLOCKS.get() or {}).get(id(layer))
  return None if given is None else given[3]


def fuses_gather(layer: 'POETLinear', width: int, dtype, chunk: int | None = None) -> bool:
  """Whether ``layer``'s implementation runs a side of ``width`` features
  in ``dtype`` with its gather fused into the block products (then a gather
  joining it to another layer is best fused too: ``output_dst``);
  ``chunk``: the run length of that gather (default: the layer's)."""
  impl = implementation_for(layer.implementation, layer.block_size)
  if impl is None or impl.fuse is None:
    return False
  b = layer.block_size
  return bool(impl.fuse(jax.ShapeDtypeStruct((1, width), jnp.dtype(dtype)),
                        jax.ShapeDtypeStruct((1, b, b), jnp.dtype(dtype)),
                        layer.chunk if chunk is None else chunk))


GENERATOR_DTYPES = ('float32', 'bfloat16')


class POETParam(nnx.Param):
  """Packed skew-symmetric generators of a POET rotation, (K, B(B-1)/2),
  float32 or bfloat16 (``POETLinear(generator_dtype=...)``)."""


class FrozenKernel(nnx.Variable):
  """The frozen base weight of a POET layer (permuted, possibly quantised).
  Not a Param: no gradient, no optimizer state."""


class Permutation(nnx.Variable):
  """An int32 permutation of the features of one side of a POET layer (an
  element or a chunk permutation, :mod:`poetx_jax.perms`, as the layer's
  ``permutation`` says)."""


def implementation_for(name: str, block_size: int) -> ops.Implementation | None:
  """The ``implementation`` argument of :func:`poetx_jax.ops.poet_linear` for
  an implementation name: None for ``'xla'``; for ``'pallas'``, the kernels
  ``pallas_kernels.layer_kernels`` chooses (the block products on the Mosaic
  GPU kernels); for ``'auto'``, on GPUs the gathers fused into the block
  products where ``pallas_kernels.fused_kernels`` measured them faster (per
  side's width and block size, 16-bit activations), XLA elsewhere and on
  every other backend (None: CPU runs are XLA's, bit for bit); for
  ``'fused'``, the fused kernels on every side of 16-bit activations
  (interpreted off GPUs)."""
  if name not in IMPLEMENTATIONS:
    raise ValueError(f'implementation must be one of {IMPLEMENTATIONS}, got {name!r}')
  if name == 'xla' or (name == 'auto' and jax.default_backend() != 'gpu'):
    return None
  try:
    import pallas_kernels
  except ImportError as e:
    if name == 'auto':
      return None
    raise ValueError(f'implementation={name!r} is unavailable here: {e}') from e
  if name in ('auto', 'fused'):
    kernels = pallas_kernels.fused_kernels(block_size, always=name == 'fused')
    if not kernels and name == 'fused':
      raise ValueError(f"implementation='fused' takes a block size that is a power of two "
                       f'from 16 to 512, got {block_size}')
    return ops.Implementation(**kernels) if kernels else None
  return ops.Implementation(**pallas_kernels.layer_kernels(block_size))


def _check_arguments(in_features, out_features, block_size, mode, form, implementation, dtype,
                     terms, max_generator_norm, quantize, generator_dtype, permutation,
                     chunk_size):
  """POETLinear's argument checks: each error names the value and what is
  valid. Returns ``chunk_size`` as a Python int."""
  for name, d in (('in_features', in_features), ('out_features', out_features)):
    if not isinstance(d, int) or d < 1:
      raise ValueError(f'{name} must be a positive int, got {d!r}')
  ops.check_block_size(block_size, in_features, out_features)
  if permutation not in ops.PERMUTATIONS:
    raise ValueError(f'permutation must be one of {ops.PERMUTATIONS}, got {permutation!r}')
  chunk_size = ops.check_chunk_size(chunk_size, block_size if permutation == 'chunk' else None)
  if mode not in MODES:
    raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
  if form not in ops.FORMS:
    raise ValueError(f'form must be one of {ops.FORMS}, got {form!r}')
  implementation_for(implementation, block_size)  # validates
  if (implementation == 'pallas' and mode == 'mem' and jax.default_backend() != 'gpu'
      and dtype is not None and jnp.dtype(dtype).itemsize == 2):
    raise ValueError(  # 16-bit: the kernels run (float32 falls back to XLA)
        f"implementation='pallas' with mode='mem' needs a GPU: on the "
        f"{jax.default_backend()!r} backend the kernels run in an interpreter whose "
        f"callbacks jax.checkpoint cannot recompute; use mode='fast' or "
        f"implementation='xla' here")
  if not isinstance(terms, int) or terms < 1:
    raise ValueError(f'terms must be an int >= 1, got {terms!r}')
  if max_generator_norm is not None and not (
      isinstance(max_generator_norm, (int, float)) and not isinstance(max_generator_norm, bool)
      and 0 < max_generator_norm < 1):
    raise ValueError(f'max_generator_norm must be None or a number in (0, 1) (the series '
                     f'converges for norms below 1), got {max_generator_norm!r}')
  if quantize is not None and quantize not in ops.QUANT_BITS:
    raise ValueError(f'quantize must be None or one of {tuple(ops.QUANT_BITS)}, '
                     f'got {quantize!r}')
  try:
    name = jnp.dtype(generator_dtype).name
  except TypeError:
    name = None
  if name not in GENERATOR_DTYPES:
    raise ValueError(f'generator_dtype must be one of {GENERATOR_DTYPES}, '
                     f'got {generator_dtype!r}')
  return chunk_size


class POETLinear(nnx.Module):
  """A linear layer whose weight is ``W = R W0 P`` with W0 frozen.

  ``R`` (O x O) and ``P`` (I x I) are block-stochastic orthogonal matrices
  ``Phi G Phi^T``: ``G`` block-diagonal with B x B blocks from the truncated
  Cayley–Neumann series of skew-symmetric generators (``q_in`` for P, ``q_out``
  for R; zeros at start, so the layer starts equal to its base), ``Phi`` a random
  permutation (``perm_in``, ``perm_out``) redrawn at every merge
  (:func:`poetx_jax.merge`). By default the forward is input-centric (permute,
  rotate blocks, frozen GEMM, rotate blocks, permute) and ``R W0 P`` is never
  formed; ``form='weight'`` forms it from block products instead. The
  singular values of the effective weight are those of W0, up to the series'
  orthogonality error. ``permutation='chunk'`` draws every permutation as a
  permutation of aligned runs of ``chunk_size`` features (the same training,
  :mod:`poetx_jax.perms` says why, with gathers that move whole runs).
  It differentiates in reverse mode (``jax.grad``, ``jax.vjp``,
  ``jax.jacrev``) only: its gathers and generator packing carry custom
  VJPs, through which JAX refuses forward mode (``jax.jvp``, ``jax.jacfwd``:
  "can't apply forward-mode autodiff (jvp) to a custom_vjp function").

  It is a drop-in for ``nnx.Linear``: same positional sizes, state path and
  the options of its parameters (``use_bias``, ``dtype``, ``param_dtype``,
  ``precision``, the initialisers; not Linear's product options, see
  :meth:`from_linear`). ``kernel`` (a :class:`FrozenKernel`, (I, O)) holds the
  frozen base with the permutations folded in, ``Phi_I^T W0^T Phi_O`` (int8 /
  int4 with per-group scales in ``kernel_scale`` under POET-XQ), not the
  weight the layer applies: that is :meth:`effective_kernel`. Dimensions
  need not be multiples of ``block_size``: the last block is smaller.

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
    max_generator_norm: cap each block's generator at this spectral norm
      (:func:`poetx_jax.ops.cap_generators`: the series then stays inside its
      region of convergence whatever step the optimizer takes); None: no cap.
    mode: ``'fast'`` keeps the activations the backward needs; ``'mem'``
      (POET-Xmem) keeps only the layer input and recomputes the rest.
    form: the order of the product (same function): ``'input'`` rotates and
      permutes the activations (no weight-gradient GEMM in the backward);
      ``'weight'`` rotates and permutes the frozen kernel and runs one dense
      GEMM (a dense layer's backward, but no activation-sized rotations or
      gathers); ``'auto'`` the one of fewer FLOPs for each call's token count
      (:func:`poetx_jax.ops.choose_form`: the weight form for narrow layers).
      See :func:`poetx_jax.ops.poet_linear`.
    implementation: ``'auto'`` (on GPUs, each side's gather fused into its
      block products by the Pallas kernels where they measured faster, XLA
      elsewhere; XLA on other backends), ``'xla'`` (every piece in XLA) or
      ``'pallas'`` (the block products on the Mosaic GPU kernels of
      ``pallas_kernels``, Hopper GPUs; interpreted on other backends, for
      tests; B a multiple of 64, at most 512) or ``'fused'`` (the fused
      kernels on every 16-bit side; B a power of two, 16 to 512). Results agree with
      ``poetx_jax.ops`` either way (:func:`implementation_for`).
    permutation: how ``perm_in`` and ``perm_out`` are drawn (at
      initialisation and at every merge): ``'element'``, a uniformly random
      permutation of the features (the published POET-X); ``'chunk'``, a
      uniformly random permutation of aligned runs of ``chunk_size``
      features, a block taking ``block_size / chunk_size`` whole runs (a
      ragged last run of a width not divisible by it stays last). Only the
      partition of the features into blocks matters to training, and the
      gathers of whole runs read memory in whole sectors:
      :mod:`poetx_jax.perms`.
    chunk_size: features per run of ``permutation='chunk'``; must divide
      ``block_size`` (16 bf16 features are one 32-byte sector). Unused by
      ``'element'``.
    quantize: POET-XQ: store W0 as ``'int8'`` or ``'int4'`` with one float32
      scale per ``group_size`` input rows of each output column (symmetric),
      dequantised on the fly and re-quantised at every merge. None keeps W0
      in ``param_dtype``.
    group_size: rows per quantisation group.
    generator_dtype: dtype of the generators ``q_in``, ``q_out`` (so of their
      gradients, and of their optimizer moments by default): ``float32``, or
      ``bfloat16`` (half their memory, the published POET-X's precision; the
      rotations are computed from them in float32 either way).
    use_bias, dtype, param_dtype, precision, kernel_init, bias_init, rngs: as
      for ``nnx.Linear``; ``param_dtype`` applies to the base kernel and bias,
      ``generator_dtype`` to the POET parameters.

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
      max_generator_norm: float | None = None,
      mode: str = 'fast',
      form: str = 'input',
      implementation: str = 'auto',
      permutation: str = 'element',
      chunk_size: int = 16,
      quantize: str | None = None,
      group_size: int = 128,
      generator_dtype: tp.Any = jnp.float32,
      use_bias: bool = True,
      dtype: tp.Any = None,
      param_dtype: tp.Any = jnp.float32,
      precision: tp.Any = None,
      kernel_init: tp.Callable = initializers.lecun_normal(),
      bias_init: tp.Callable = initializers.zeros_init(),
      rngs: nnx.Rngs,
  ):
    chunk_size = _check_arguments(in_features, out_features, block_size, mode, form,
                                  implementation, dtype, terms, max_generator_norm, quantize,
                                  generator_dtype, permutation, chunk_size)
    self.permutation = permutation
    self.chunk_size = chunk_size  # a Python int: static, hashable
    kernel = kernel_init(rngs.params(), (in_features, out_features), param_dtype)
    if kernel.shape != (in_features, out_features):
      raise ValueError(f'kernel_init gave shape {kernel.shape}, expected '
                       f'{(in_features, out_features)}')
    perm_in = ops.random_permutation(rngs.params(), in_features, self.chunk)
    perm_out = ops.random_permutation(rngs.params(), out_features, self.chunk)
    self.quantize = quantize
    self.group_size = group_size
    self.param_dtype = param_dtype
    base, scale = self.encode_base(ops.permute_kernel(kernel, perm_in, perm_out, self.chunk))
    self.kernel = FrozenKernel(base)
    self.kernel_scale = FrozenKernel(scale) if scale is not None else nnx.data(None)
    self.bias = (nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
                 if use_bias else nnx.data(None))
    p = ops.skew_size(block_size)
    gen = jnp.dtype(generator_dtype)
    self.q_in = POETParam(jnp.zeros((ops.num_blocks(in_features, block_size), p), gen))
    self.q_out = POETParam(jnp.zeros((ops.num_blocks(out_features, block_size), p), gen))
    self.perm_in = Permutation(perm_in)
    self.perm_out = Permutation(perm_out)

    self.in_features = in_features
    self.out_features = out_features
    # The tied group each side's permutation belongs to (poetx_jax.ties), or None.
    self.tie_in: str | None = None
    self.tie_out: str | None = None
    self.block_size = block_size
    self.terms = terms
    self.max_generator_norm = max_generator_norm
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

    The kernel's and bias's sharding annotations (``out_sharding``, ``mesh``:
    ``nnx.with_partitioning``) carry over to the new ones, which have the same
    axes. ``linear``'s own products (``dot_general``, ``promote_dtype``,
    ``preferred_element_type``) cannot: a POET layer computes with its own, so
    a layer that sets any of them is refused, naming them.
    """
    kernel = linear.kernel[...]
    if kernel.ndim != 2:
      raise ValueError(f'POET needs a 2-D kernel (in, out), got shape {kernel.shape}')
    check_linear_products(linear)
    if normalize_rows:
      norm = jnp.linalg.norm(kernel.astype(jnp.float32), axis=0, keepdims=True)
      kernel = (kernel / jnp.maximum(norm, 1e-12)).astype(kernel.dtype)
    opts = dict(use_bias=linear.bias is not None, dtype=linear.dtype,
                param_dtype=kernel.dtype, precision=linear.precision)
    opts.update(kwargs)
    if opts['use_bias']:
      bias = linear.bias[...]
      opts['bias_init'] = lambda *_: bias
    layer = cls(kernel.shape[0], kernel.shape[1], block_size=block_size,
                kernel_init=lambda *_: kernel, rngs=rngs, **opts)
    carry_sharding(linear, layer)
    return layer

  @property
  def chunk(self) -> int:
    """The run length of this layer's permutations: ``chunk_size`` for
    ``permutation='chunk'``, 1 (single features) for ``'element'``."""
    return self.chunk_size if self.permutation == 'chunk' else 1

  def draw_permutations(self, key: Array) -> tuple[Array, Array]:
    """``(perm_in, perm_out)`` drawn from ``key`` as this layer draws them
    (of its ``permutation`` and chunk size; one layer's, not a stack's)."""
    return ops.random_permutations(key, (self.in_features, self.out_features), self.chunk)

  def encode_base(self, kernel_IxO: Array) -> tuple[Array, Array | None]:
    """The stored form of a permuted base: (kernel, None), or (q, scales) for POET-XQ."""
    if self.quantize is None:
      return kernel_IxO.astype(self.param_dtype), None
    return ops.quantize_kernel(kernel_IxO, bits=self.quantize, group_size=self.group_size)

  def frozen_kernel(self) -> Array:
    """The permuted base ``Phi_I^T W0^T Phi_O`` (I, O), dequantised for POET-XQ."""
    if self.quantize is None:
      return self.kernel[...]
    return ops.dequantize_kernel(self.kernel[...], self.kernel_scale[...],
                                 self.in_features)

  @property
  def stack_shape(self) -> tuple[int, ...]:
    """The leading axes when this module holds a stack of layers (each
    variable with a leading layer axis, as in a scanned stack); () for one
    layer. :mod:`poetx_jax.convert` and :mod:`poetx_jax.cycle` run their
    per-layer functions over a stack one layer at a time."""
    return tuple(self.q_in.shape[:-2])

  def _one_layer(self, what: str, remedy: str) -> None:
    if self.stack_shape:
      raise ValueError(f'this POETLinear holds a stack of {self.stack_shape} layers; '
                       f'{what} works on one layer ({remedy})')

  def __call__(self, inputs: Array, *, permute_input: bool = True,
               permute_output: bool = True, output_dst: Array | None = None) -> Array:
    """y = inputs @ effective_kernel (+ bias); inputs (..., I).

    ``permute_input=False``: ``inputs`` are given permuted,
    ``x[..., perm_in]``; ``permute_output=False``: returns ``y[..., perm_out]``;
    ``output_dst``: returns y placed by that permutation instead (see
    :func:`poetx_jax.ops.poet_linear`; :func:`poetx_jax.ops.gather_between`
    joins two layers with one gather).
    """
    self._one_layer('calling it', 'the stack runs them one at a time')
    bias = self.bias[...] if self.bias is not None else None
    if bias is not None and not permute_output:
      bias = jnp.take(bias, self.perm_out[...], axis=-1)
    if bias is not None and output_dst is not None:
      bias = ops.unpermute(jnp.take(bias, self.perm_out[...], axis=-1), output_dst)
    if self.quantize is None:
      x, kernel, bias = dtypes.promote_dtype((inputs, self.kernel[...], bias),
                                             dtype=self.dtype)
      scale = None
    else:  # dequantised inside the layer (recomputed under mode='mem')
      x, bias = dtypes.promote_dtype((inputs, bias), dtype=self.compute_dtype(inputs.dtype))
      kernel, scale = self.kernel[...], self.kernel_scale[...]
    pinned = _PINNED.get()
    pin = ((lambda a: jax.lax.with_sharding_constraint(a, pinned)) if pinned is not None
           else (lambda a: a))
    x = pin(x)
    given = (_BLOCKS.get() or {}).get(id(self))
    blocks = (given[:2] if given is not None and given[2] == ops.series_precision(x.dtype)
              else None)
    inverses = given[3] if given is not None else None
    y = ops.poet_linear(x, kernel, self.q_in[...], self.q_out[...],
                        self.perm_in[...], self.perm_out[...],
                        block_size=self.block_size, terms=self.terms,
                        max_norm=self.max_generator_norm,
                        remat=self.mode == 'mem', form=self.form,
                        precision=self.precision,
                        implementation=implementation_for(self.implementation,
                                                          self.block_size),
                        kernel_scale=scale, permute_input=permute_input,
                        permute_output=permute_output, blocks=blocks, inverses=inverses,
                        output_dst=output_dst, chunk=self.chunk)
    if bias is not None:
      y = y + bias
    return pin(y)

  def compute_dtype(self, input_dtype) -> tp.Any:
    """The dtype a call on inputs of ``input_dtype`` computes in: ``dtype``,
    or the inputs' promoted with the base's (float32 for a quantised base)."""
    if self.dtype is not None:
      return self.dtype
    return jnp.result_type(input_dtype,
                           self.kernel[...] if self.quantize is None else jnp.float32)

  def form_for(self, input_shape: tp.Sequence[int]) -> str:
    """The form (``'input'`` or ``'weight'``) a call on inputs of
    ``input_shape`` runs: ``form``, with ``'auto'`` resolved for their token
    count (all axes but the last)."""
    return ops.resolve_form(self.form, input_shape, self.in_features, self.out_features,
                            self.block_size)

  def rotation_blocks(self) -> tuple[Array, Array]:
    """The float32 Cayley–Neumann blocks of P and R (full precision)."""
    return ops.rotation_blocks_pair(self.q_in[...], self.q_out[...], self.in_features,
                                    self.out_features, self.block_size, self.terms,
                                    max_norm=self.max_generator_norm)

  def effective_kernel(self, blocks: tuple[Array, Array] | None = None) -> Array:
    """``(R W0 P)^T`` in (in, out) layout, float32: the weight the layer
    applies. ``blocks``: :meth:`rotation_blocks`, if already computed."""
    self._one_layer('effective_kernel', 'poetx_jax.effective_kernel(layer) takes a stack')
    return ops.poet_kernel(self.frozen_kernel(), self.q_in[...], self.q_out[...],
                           self.perm_in[...], self.perm_out[...], block_size=self.block_size,
                           terms=self.terms, blocks=blocks, max_norm=self.max_generator_norm,
                           chunk=self.chunk)

  def compute_kernel(self, dtype) -> Array:
    """The kernel the layer multiplies activations of ``dtype`` by in the
    weight form (:func:`poetx_jax.ops.poet_kernel`), (..., I, O): for a stack
    each layer's, along its leading axes (e.g. for grouped products over
    experts). Differentiable in the generators; under ``mode='mem'`` it is
    recomputed in the backward instead of kept."""
    if self.use_bias:
      raise ValueError('compute_kernel forms the kernel alone: this layer has a bias')

    def form(kernel, scale, q_in, q_out, perm_in, perm_out):
      return ops.poet_kernel(kernel, q_in, q_out, perm_in, perm_out, dtype=dtype,
                             block_size=self.block_size, terms=self.terms,
                             kernel_scale=scale, max_norm=self.max_generator_norm,
                             chunk=self.chunk)

    if self.mode == 'mem':
      form = jax.checkpoint(form, policy=jax.checkpoint_policies.nothing_saveable)
    scale = self.kernel_scale[...] if self.quantize is not None else None
    for _ in self.stack_shape:
      form = jax.vmap(form, in_axes=(0, None if scale is None else 0, 0, 0, 0, 0))
    return form(self.kernel[...], scale, self.q_in[...], self.q_out[...], self.perm_in[...],
                self.perm_out[...])

  def orthogonality_error(self, blocks: tuple[Array, Array] | None = None) -> Array:
    """How far the factors are from orthogonal: the larger over R and P of
    :func:`ops.orthogonality_error` (max over blocks of ``||G^T G - I||_F /
    sqrt(B)``), float32. 0 at Q = 0; the truncated series' error otherwise,
    which grows quickly once a block's ``||Q||`` nears 1."""
    self._one_layer('orthogonality_error', 'poetx_jax.orthogonality_error(layer) takes a stack')
    g_in, g_out = self.rotation_blocks() if blocks is None else blocks
    return jnp.maximum(ops.orthogonality_error(g_in), ops.orthogonality_error(g_out))
