"""A Llama decoder in Flax NNX, built only from ``nnx.Linear``, ``nnx.Embed`` and RMSNorm.

Notation: B batch, T sequence length, V vocabulary, H hidden size, M MLP size,
N query heads, K key/value heads (grouped-query attention, N % K == 0),
D = H / N head dimension.

Attribute names follow Hugging Face ``LlamaForCausalLM`` (``embed_tokens``,
``layers/i/self_attn/q_proj``, ..., ``norm``, ``lm_head``), so
``models.hf.hf_state_dict`` maps paths one to one. Every projection is a plain
``nnx.Linear`` (kernel (in, out), no bias): ``poetx_jax.poetize(model, ...)``
turns them into POET layers, ``poetx_jax.unpoetize`` turns them back for export.
Rotary embeddings use the HF "rotate_half" convention (the head dimension split
into a first and a second half), so exported weights need no permutation.
"""

from __future__ import annotations

import dataclasses
import functools
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import initializers
from jax.ad_checkpoint import checkpoint_name

from poetx_jax.groups import batched_series, normed, project, swiglu
from poetx_jax.models.rope import apply_rope, rope_tables
from poetx_jax.models.stack import StackedLayers

Array = jax.Array

ATTENTION = ('auto', 'xla', 'cudnn')


def attention_implementation(name: str, dtype, head_dim: int) -> str:
  """The ``implementation`` of ``jax.nn.dot_product_attention`` for an
  attention option: ``'auto'`` is cuDNN's fused (flash) attention on GPUs for
  16-bit activations and head dimensions it takes (multiples of 8 up to 128),
  XLA's otherwise; ``'xla'`` and ``'cudnn'`` as named."""
  if name not in ATTENTION:
    raise ValueError(f'attention must be one of {ATTENTION}, got {name!r}')
  if name != 'auto':
    return name
  fused = (jax.default_backend() == 'gpu' and jnp.dtype(dtype).itemsize == 2
           and head_dim % 8 == 0 and head_dim <= 128)
  return 'cudnn' if fused else 'xla'


# Rematerialisation of each decoder layer (``Llama(..., remat=...)``):
#   'none'  keep every activation the backward needs;
#   'block' keep only each layer's input, recompute the whole layer;
#   'attn'  keep each layer's input and its attention output ('attn_out'),
#           recompute the projections and the MLP but not the attention;
#   'offload' as 'block', each layer's input ('layer_input') kept in pinned
#           host memory instead of the accelerator's and copied back for the
#           layer's backward.
# Residuals are chosen by name (save_only_these_names), which also covers
# POET's block products and custom kernels that dot-based policies miss.
REMAT_POLICIES = {
    'none': None,
    'block': jax.checkpoint_policies.nothing_saveable,
    'attn': jax.checkpoint_policies.save_only_these_names('attn_out'),
    'offload': jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=['layer_input'],
        offload_src='device', offload_dst='pinned_host'),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shape and initialisation of a Llama model.

  Attributes:
    vocab_size: V.
    hidden: H.
    mlp: M, the SwiGLU inner size.
    layers: number of decoder layers.
    heads: N, query heads; must divide ``hidden``.
    kv_heads: K, key/value heads; must divide ``heads``.
    max_seq_len: the longest sequence the model accepts.
    rope_theta: rotary base frequency.
    norm_eps: RMSNorm epsilon.
    tie_embeddings: logits from the embedding matrix (no ``lm_head``).
    init_std: standard deviation of every Linear / Embed weight at init.
    block_size: the POET block size suggested for this shape.
  """

  vocab_size: int
  hidden: int
  mlp: int
  layers: int
  heads: int
  kv_heads: int
  max_seq_len: int = 2048
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = False
  init_std: float = 0.02
  block_size: int = 256

  def __post_init__(self):
    for name in ('vocab_size', 'hidden', 'mlp', 'layers', 'heads', 'kv_heads',
                 'max_seq_len', 'block_size'):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f'{name} must be a positive int, got {v!r}')
    if self.block_size < 2:
      raise ValueError(f'block_size must be >= 2, got {self.block_size!r}')
    for name in ('rope_theta', 'norm_eps', 'init_std'):
      v = getattr(self, name)
      if (not isinstance(v, (int, float, np.floating)) or isinstance(v, bool) or not v > 0
          or not np.isfinite(v)):
        raise ValueError(f'{name} must be a finite positive number, got {v!r}')
    if not isinstance(self.tie_embeddings, (bool, np.bool_)):
      raise ValueError(f'tie_embeddings must be a bool, got {self.tie_embeddings!r}')
    if self.hidden % self.heads:
      raise ValueError(f'hidden must be divisible by heads, got hidden={self.hidden}, '
                       f'heads={self.heads}')
    if self.heads % self.kv_heads:
      raise ValueError(f'heads must be divisible by kv_heads, got heads={self.heads}, '
                       f'kv_heads={self.kv_heads}')
    if self.head_dim % 2:
      raise ValueError(f'head_dim = hidden / heads must be even for rotary embeddings, '
                       f'got {self.head_dim} (hidden={self.hidden}, heads={self.heads})')

  @property
  def head_dim(self) -> int:
    """D = hidden / heads."""
    return self.hidden // self.heads

  def count_params(self, mlp_params: int) -> int:
    """Parameters with ``mlp_params`` of MLP a layer: embedding (once when
    tied), attention, two norms a layer, the final norm, the head."""
    h, kv = self.hidden, self.kv_heads * self.head_dim
    per_layer = 2 * h * h + 2 * h * kv + 2 * h + mlp_params
    head = 0 if self.tie_embeddings else h * self.vocab_size
    return self.vocab_size * h + self.layers * per_layer + h + head

  def num_params(self) -> int:
    """Number of parameters (embedding counted once when tied)."""
    return self.count_params(3 * self.hidden * self.mlp)

  def active_params(self) -> int:
    """Parameters one token passes through: all of them in a dense model."""
    return self.num_params()

  @property
  def model_class(self) -> type[Llama]:
    """The model this config describes (:meth:`build` makes one)."""
    return Llama

  @property
  def rows_independent(self) -> bool:
    """Whether each row of a batch is computed on its own, so that a batch may
    be split across devices (a routed model's capacity and losses couple them)."""
    return True

  def build(self, **kwargs) -> Llama:
    """``model_class(self, **kwargs)``: the model, with the options of :class:`Llama`."""
    return self.model_class(self, **kwargs)


# Block sizes: 512 for 60m and 130m, where it trained to a lower perplexity than
# 256 (docs/quality.md: "Seeds 1 and 2 of the bests", "Block size 512 at 130M");
# 256 from 350m up, where 512 is not measured and would double the POET state
# and the block products' work.
CONFIGS: dict[str, LlamaConfig] = {
    'tiny': LlamaConfig(vocab_size=4096, hidden=64, mlp=176, layers=2, heads=4,
                        kv_heads=2, max_seq_len=256, block_size=16),
    '60m': LlamaConfig(vocab_size=32000, hidden=512, mlp=1376, layers=8, heads=8,
                       kv_heads=8, block_size=512),
    '130m': LlamaConfig(vocab_size=32000, hidden=768, mlp=2048, layers=12, heads=12,
                        kv_heads=12, block_size=512),
    '350m': LlamaConfig(vocab_size=32000, hidden=1024, mlp=2736, layers=24, heads=16,
                        kv_heads=16),
    '1b': LlamaConfig(vocab_size=32000, hidden=2048, mlp=5632, layers=24, heads=32,
                      kv_heads=32),
    '3b': LlamaConfig(vocab_size=32000, hidden=2560, mlp=7168, layers=32, heads=32,
                      kv_heads=32),
    '8b': LlamaConfig(vocab_size=32000, hidden=4096, mlp=14336, layers=32, heads=32,
                      kv_heads=8),
    '13b': LlamaConfig(vocab_size=32000, hidden=5120, mlp=13824, layers=40, heads=40,
                       kv_heads=40),
}


class RMSNorm(nnx.Module):
  """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32, cast back to x's dtype."""

  def __init__(self, dim: int, *, eps: float = 1e-6, param_dtype: tp.Any = jnp.float32,
               rngs: nnx.Rngs | None = None):
    del rngs  # the weight starts at ones
    self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x: Array) -> Array:
    y = x.astype(jnp.float32) * self.row_scale(x)
    return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)

  def row_scale(self, x: Array) -> Array:
    """``1 / sqrt(mean(x^2) + eps)`` over the last axis, float32 (..., 1)."""
    x32 = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)


def _linear(i, o, config, dtype, param_dtype, rngs):
  return nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                    kernel_init=initializers.normal(config.init_std), rngs=rngs)


class Attention(nnx.Module):
  """Causal grouped-query self-attention with rotary embeddings;
  ``attention`` picks the kernel (:func:`attention_implementation`).
  POET projections may tie the q, k and v input permutations
  (:func:`poetx_jax.tie_permutations`)."""

  def __init__(self, config: LlamaConfig, *, dtype: tp.Any = jnp.float32,
               param_dtype: tp.Any = jnp.float32, attention: str = 'auto',
               rngs: nnx.Rngs):
    h, d = config.hidden, config.head_dim
    lin = functools.partial(_linear, config=config, dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs)
    self.q_proj = lin(h, config.heads * d)
    self.k_proj = lin(h, config.kv_heads * d)
    self.v_proj = lin(h, config.kv_heads * d)
    self.o_proj = lin(config.heads * d, h)
    self.heads = config.heads
    self.kv_heads = config.kv_heads
    self.head_dim = d
    self.rope_theta = config.rope_theta
    attention_implementation(attention, jnp.float32, d)  # validates
    self.attention = attention

  def __call__(self, x: Array | None, positions: Array | None = None, *,
               inputs: tp.Sequence[Array] | None = None) -> Array:
    """x (B, T, H), positions (B or 1, T) int (default 0..T-1) -> (B, T, H);
    ``inputs`` instead of ``x``: q's, k's and v's, each in its input order."""
    b, t, _ = (x if inputs is None else inputs[0]).shape
    if positions is None:
      positions = jnp.arange(t)[None]
    q, k, v = project((self.q_proj, self.k_proj, self.v_proj), x, inputs=inputs)
    q = q.reshape(b, t, self.heads, self.head_dim)
    k = k.reshape(b, t, self.kv_heads, self.head_dim)
    v = v.reshape(b, t, self.kv_heads, self.head_dim)
    cos, sin = rope_tables(positions, self.head_dim, self.rope_theta)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    impl = attention_implementation(self.attention, q.dtype, self.head_dim)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    out = checkpoint_name(out.reshape(b, t, self.heads * self.head_dim), 'attn_out')
    return self.o_proj(out)

  def permutation_ties(self) -> list[list]:
    """The q, k and v projections share their input (:mod:`poetx_jax.ties`)."""
    return [[(self.q_proj, 'in'), (self.k_proj, 'in'), (self.v_proj, 'in')]]


class MLP(nnx.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``. POET projections may tie
  permutations (:func:`poetx_jax.tie_permutations`): the gate and up
  inputs', and the gate and up outputs' with the down input's."""

  def __init__(self, config: LlamaConfig, *, dtype: tp.Any = jnp.float32,
               param_dtype: tp.Any = jnp.float32, rngs: nnx.Rngs):
    lin = functools.partial(_linear, config=config, dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs)
    self.gate_proj = lin(config.hidden, config.mlp)
    self.up_proj = lin(config.hidden, config.mlp)
    self.down_proj = lin(config.mlp, config.hidden)

  def __call__(self, x: Array | None, inputs: tp.Sequence[Array] | None = None) -> Array:
    return swiglu(self.gate_proj, self.up_proj, self.down_proj, x, hidden_name='mlp_hidden',
                  inputs=inputs)

  def forward(self, x: Array | None, **kw) -> tuple[Array, dict]:
    """``(self(x), stats)``: what a decoder layer calls (a dense MLP has no stats: ``{}``)."""
    return self(x, **kw), {}

  def permutation_ties(self) -> list[list]:
    """gate and up share their input; down's input is their product (:mod:`poetx_jax.ties`)."""
    return [[(self.gate_proj, 'in'), (self.up_proj, 'in')],
            [(self.gate_proj, 'out'), (self.up_proj, 'out'), (self.down_proj, 'in')]]


class DecoderLayer(nnx.Module):
  """Pre-norm residual block: attention, then MLP (an ``mlp_class``, whose
  ``forward(x)`` gives ``(y, stats)``); ``layer(x, positions) -> (x, stats)``,
  stats its part of the model's auxiliary outputs. Its POET projections share
  one batched Cayley–Neumann series (:func:`poetx_jax.batched_series`)."""

  mlp_class: tp.ClassVar[type] = MLP

  def __init__(self, config: LlamaConfig, *, dtype: tp.Any = jnp.float32,
               param_dtype: tp.Any = jnp.float32, attention: str = 'auto',
               norm_gathers: bool = False, rngs: nnx.Rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.norm_gathers = norm_gathers  # the POET input gathers in the norms (Llama)
    self.input_layernorm = RMSNorm(config.hidden, eps=config.norm_eps,
                                   param_dtype=param_dtype, rngs=rngs)
    self.self_attn = Attention(config, attention=attention, **kw)
    self.post_attention_layernorm = RMSNorm(config.hidden, eps=config.norm_eps,
                                            param_dtype=param_dtype, rngs=rngs)
    self.mlp = self.mlp_class(config, **kw)

  def __call__(self, x: Array, positions: Array | None = None) -> tuple[Array, dict]:
    x = checkpoint_name(x, 'layer_input')  # what remat 'offload' moves to the host
    with batched_series(self, x):  # the POET projections' series in one batch
      a = self.self_attn
      h, ins = normed(self.input_layernorm, x, (a.q_proj, a.k_proj, a.v_proj),
                      in_orders=self.norm_gathers)
      x = x + a(h, positions, inputs=ins)
      m = self.mlp if isinstance(self.mlp, MLP) else None  # a routed MLP: its own gathers
      h, ins = normed(self.post_attention_layernorm, x, m and (m.gate_proj, m.up_proj),
                      in_orders=self.norm_gathers)
      y, stats = self.mlp.forward(h, **({'inputs': ins} if ins else {}))
      return x + y, stats


class Llama(nnx.Module):
  """Llama causal language model: tokens (B, T) int -> logits (B, T, V) float32.

  :meth:`forward` gives ``(logits, aux)``, the auxiliary outputs every model
  reports through one channel (a dense Llama: none, ``{}``; a routed model's
  in :mod:`poetx_jax.models.moe`); calling the model gives the logits.

  Args:
    config: the model shape.
    dtype: compute dtype of every Linear / Embed (activations).
    param_dtype: dtype of the parameters.
    remat: rematerialisation per decoder layer, a key of :data:`REMAT_POLICIES`.
    attention: the attention kernel, one of :data:`ATTENTION`
      (:func:`attention_implementation`; ``'auto'``: cuDNN's fused attention
      on GPUs for 16-bit activations, XLA's otherwise).
    norm_gathers: the RMSNorms before POET q/k/v and gate/up projections
      write their output in the projections' input orders, the input gathers
      moved into them (:func:`poetx_jax.groups.normed`).
    rngs: draws the initial weights (``params`` stream).
    convert_layer: applied to each decoder layer as soon as it is built, its
      result kept in its place (e.g. a POET conversion: then the dense
      weights of only one layer exist at a time). The weights drawn are those
      of the unconverted model.
    scan_layers: store the decoder layers as one :class:`StackedLayers`
      (each variable with a leading layer axis) and run them with
      ``jax.lax.scan``: the same function and weights, a compile time that
      does not grow with depth. ``model.layers[i]`` is then a copy of layer i.
    place: with ``scan_layers``, the sharding of each stacked array by shape
      (see :class:`StackedLayers`); the other arrays start on the default
      device. Train such a model after ``poetx_jax.sharding.shard_state``:
      it places the other arrays and, under FSDP, pins the activations
      between the stacked layers (``StackedLayers.carry_sharding``), without
      which XLA's partitioner fails on the scanned POET backward.

  Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from poetx_jax.models import get_config
    >>> model = get_config('tiny').build(rngs=nnx.Rngs(0))
    >>> logits, aux = model.forward(jnp.zeros((2, 8), jnp.int32))
    >>> logits.shape, aux
    ((2, 8, 4096), {})
  """

  decoder_layer: tp.ClassVar[type] = DecoderLayer  # what each of ``layers`` is
  config_class: tp.ClassVar[type] = LlamaConfig

  def __init__(self, config: LlamaConfig, *, dtype: tp.Any = jnp.float32,
               param_dtype: tp.Any = jnp.float32, remat: str = 'none',
               attention: str = 'auto', norm_gathers: bool = False, rngs: nnx.Rngs,
               convert_layer: tp.Callable[[nnx.Module], nnx.Module] | None = None,
               scan_layers: bool = False,
               place: tp.Callable[[tuple], jax.sharding.Sharding] | None = None):
    if not isinstance(config, self.config_class) or not isinstance(self, config.model_class):
      raise ValueError(f'a {type(self).__name__} needs a {self.config_class.__name__}; '
                       f'a {type(config).__name__} describes a '
                       f'{getattr(config, "model_class", type(None)).__name__}: '
                       f'build it with config.build(...)')
    if remat not in REMAT_POLICIES:
      raise ValueError(f'remat must be one of {tuple(REMAT_POLICIES)}, got {remat!r}')
    if place is not None and not scan_layers:
      raise ValueError('place needs scan_layers=True (it shards the stacked layers)')
    self.config = config
    self.remat = remat
    self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden, dtype=dtype,
                                  param_dtype=param_dtype,
                                  embedding_init=initializers.normal(config.init_std),
                                  rngs=rngs)
    convert_layer = convert_layer or (lambda layer: layer)

    def make_layer(i):
      del i
      return convert_layer(self.decoder_layer(config, dtype=dtype, param_dtype=param_dtype,
                                              attention=attention, norm_gathers=norm_gathers,
                                              rngs=rngs))

    if scan_layers:
      self.layers = StackedLayers(make_layer, config.layers, place=place)
    else:
      self.layers = nnx.List([make_layer(i) for i in range(config.layers)])
    self.norm = RMSNorm(config.hidden, eps=config.norm_eps, param_dtype=param_dtype,
                        rngs=rngs)
    if not config.tie_embeddings:
      self.lm_head = _linear(config.hidden, config.vocab_size, config, dtype,
                             param_dtype, rngs)

  def __call__(self, tokens: Array) -> Array:
    """tokens (B, T) int, T <= max_seq_len -> logits (B, T, V) float32."""
    return self.forward(tokens)[0]

  def forward(self, tokens: Array) -> tuple[Array, dict]:
    """tokens (B, T) int -> (logits (B, T, V) float32, aux): the layers'
    stats summed from :meth:`aux_init` and finished by :meth:`aux_summary`."""
    h, aux = self.features(tokens)
    return self.logits(h), aux

  def features(self, tokens: Array) -> tuple[Array, dict]:
    """tokens (B, T) int -> (the last decoder layer's output (B, T, H), aux):
    :meth:`forward` before the head (:meth:`logits`)."""
    h, positions = self.embed(tokens)
    h, totals = self.run_layers(h, positions, self.aux_init())
    return h, self.aux_summary(totals)

  def aux_init(self) -> dict:
    """The zero of the per-layer stats the decoder layers add up (none here)."""
    return {}

  def aux_summary(self, totals: dict) -> dict:
    """The ``aux`` of :meth:`forward` from the layers' summed stats (none here)."""
    return totals

  def run_layers(self, h: Array, positions: Array, totals: dict) -> tuple[Array, dict]:
    """The decoder layers on ``h`` (scanned or one by one, rematerialised as
    ``remat`` says): ``(h, totals + the layers' stats)``."""
    policy = REMAT_POLICIES[self.remat]
    if isinstance(self.layers, StackedLayers):
      return self.layers(h, positions, policy=policy, totals=totals)
    calls = {}  # each layer's own __call__ (convert_layer may give another class)
    for layer in self.layers:
      call = calls.get(type(layer))
      if call is None:
        call = type(layer).__call__
        calls[type(layer)] = call = (nnx.remat(call, policy=policy) if policy is not None
                                     else call)
      h, stats = call(layer, h, positions)
      totals = jax.tree.map(jnp.add, totals, stats)
    return h, totals

  def embed(self, tokens: Array) -> tuple[Array, Array]:
    """tokens (B, T) int, T <= max_seq_len -> (embeddings (B, T, H), positions (1, T))."""
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f'tokens must be a 2-D integer array (B, T), got shape '
                       f'{tokens.shape} dtype {tokens.dtype}')
    t = tokens.shape[1]
    if t > self.config.max_seq_len:
      raise ValueError(f'sequence length {t} exceeds max_seq_len '
                       f'{self.config.max_seq_len}')
    return self.embed_tokens(tokens), jnp.arange(t)[None]

  def logits(self, h: Array) -> Array:
    """The last layer's output (B, T, H) -> logits (B, T, V) float32 (final norm, head)."""
    return self.head_logits(self.head(), h)

  def head(self) -> tuple[nnx.Module, nnx.Module]:
    """The modules :meth:`logits` uses: (final norm, output projection: the
    ``lm_head``, or the embedding under ``tie_embeddings``)."""
    return self.norm, self.embed_tokens if self.config.tie_embeddings else self.lm_head

  @staticmethod
  def head_logits(head: tuple[nnx.Module, nnx.Module], h: Array) -> Array:
    """:meth:`logits` through the modules of :meth:`head`: (..., H) -> (..., V) float32."""
    norm, out = head
    h = norm(h)
    logits = out.attend(h) if isinstance(out, nnx.Embed) else out(h)
    return logits.astype(jnp.float32)
