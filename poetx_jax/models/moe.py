"""A mixture-of-experts Llama: Llama's attention, a routed SwiGLU expert MLP.

Notation: B batch, T sequence length, H hidden size, V vocabulary, E experts,
k experts per token (``top_k``), M inner size of one expert, N = B T tokens,
S = N k token slots (one per token and choice), C slots an expert keeps.

Routing (:func:`route`): router logits in float32, a softmax over the E
experts, each token's k largest probabilities renormalised to sum to 1 over
the k chosen (for k = 1 every weight is 1: the router then learns from the
auxiliary losses alone). Slots are sorted by expert, stably: each expert sees
its tokens in order. With a ``capacity_factor`` each expert keeps its first
C = ceil(capacity_factor N k / E) slots (earlier tokens first); a dropped slot
contributes zero and the residual stream carries its token. None: dropless.

Experts (:class:`Experts`): ``gate_proj``, ``up_proj``, ``down_proj`` each one
``nnx.Linear`` holding the E kernels along a leading axis, (E, H, M) or
(E, M, H), run as grouped products over the sorted slots
(``jax.lax.ragged_dot``). ``poetx_jax.poetize`` makes each a POETLinear stack
(``stack_shape`` (E,); (L, E) in a scanned model): each expert's projections
train as ``R W0 P`` with rotations of their own and merge like every other
POET layer; the forward forms each expert's effective kernel from block
products (``poetx_jax.linear_operands``) for the same grouped products. The
:class:`Router` stays a dense, trainable ``nnx.Linear``.

Auxiliary losses, per layer: load balance ``E sum_e f_e p_e`` (Switch /
GShard; f_e the fraction of slots routed to expert e before capacity, p_e its
mean router probability; 1 under uniform routing) and router z-loss
``mean_n logsumexp(logits_n)^2``. The model reports their means over layers
and ``aux_loss = aux_loss_coef * load_balance + z_loss_coef * z_loss``, to add
to the language-model loss, in the ``aux`` of ``MoELlama.forward``.
"""

from __future__ import annotations

import dataclasses
import math
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import initializers
from jax.ad_checkpoint import checkpoint_name

from poetx_jax import ops
from poetx_jax.groups import linear_operands
from poetx_jax.models.llama import DecoderLayer, Llama, LlamaConfig

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(LlamaConfig):
  """Shape of a mixture-of-experts Llama: a :class:`LlamaConfig` (its ``mlp``
  is each expert's inner size unless ``expert_mlp`` is set) plus the experts.

  Attributes:
    experts: E.
    top_k: k, experts per token, 1 <= k <= E.
    expert_mlp: M, the SwiGLU inner size of each expert; None: ``mlp``.
    capacity_factor: each expert keeps at most ceil(capacity_factor N k / E)
      of a batch's N tokens; None: dropless.
    aux_loss_coef: weight of the load-balancing loss in ``aux_loss``.
    z_loss_coef: weight of the router z-loss in ``aux_loss``.
  """

  experts: int = 8
  top_k: int = 2
  expert_mlp: int | None = None
  capacity_factor: float | None = None
  aux_loss_coef: float = 0.01
  z_loss_coef: float = 1e-3

  def __post_init__(self):
    super().__post_init__()
    is_int = lambda v: isinstance(v, (int, np.integer))
    is_num = lambda v: isinstance(v, (int, float, np.integer, np.floating))
    for name, ok, valid in [
        ('experts', lambda v: is_int(v) and v >= 1, 'a positive int'),
        ('top_k', lambda v: is_int(v) and 1 <= v <= self.experts,
         f'an int between 1 and experts={self.experts}'),
        ('expert_mlp', lambda v: v is None or is_int(v) and v >= 1, 'None or a positive int'),
        ('capacity_factor', lambda v: v is None or is_num(v) and v > 0,
         'None (dropless) or a number > 0'),
        ('aux_loss_coef', lambda v: is_num(v) and v >= 0, 'a number >= 0'),
        ('z_loss_coef', lambda v: is_num(v) and v >= 0, 'a number >= 0')]:
      v = getattr(self, name)
      if isinstance(v, bool) or not ok(v):
        raise ValueError(f'{name} must be {valid}, got {v!r}')

  @property
  def expert_inner(self) -> int:
    """M: ``expert_mlp``, or ``mlp`` when that is None."""
    return self.mlp if self.expert_mlp is None else self.expert_mlp

  def _params(self, experts: int) -> int:
    h = self.hidden  # the router, and ``experts`` SwiGLU experts
    return self.count_params(h * self.experts + experts * 3 * h * self.expert_inner)

  def num_params(self) -> int:
    """Number of parameters, every expert counted (embedding once when tied)."""
    return self._params(self.experts)

  def active_params(self) -> int:
    """Parameters one token passes through: ``num_params`` with k experts per layer."""
    return self._params(self.top_k)

  @property
  def model_class(self) -> type[MoELlama]:
    """The model this config describes: :class:`MoELlama`."""
    return MoELlama

  @property
  def rows_independent(self) -> bool:
    """False: routing couples the rows of a batch (capacity, auxiliary losses)."""
    return False


MOE_CONFIGS: dict[str, MoEConfig] = {
    'moe-tiny': MoEConfig(vocab_size=4096, hidden=64, mlp=96, layers=2, heads=4,
                          kv_heads=2, max_seq_len=256, block_size=16, experts=4,
                          top_k=2),
    # 92 M parameters, 54 M active: Llama-60M's shape with 8 experts of M = 512.
    'moe-60m': MoEConfig(vocab_size=32000, hidden=512, mlp=512, layers=8, heads=8,
                         kv_heads=8, experts=8, top_k=2),
    # 7.08 B parameters, 1.26 B active: 16 experts of half Llama-1B's MLP each.
    'moe-7b': MoEConfig(vocab_size=32000, hidden=2048, mlp=2816, layers=24, heads=16,
                        kv_heads=8, experts=16, top_k=2),
}


def expert_capacity(tokens: int, experts: int, top_k: int,
                    capacity_factor: float | None) -> int | None:
  """C = ceil(capacity_factor * tokens * top_k / experts); None when dropless."""
  if capacity_factor is None:
    return None
  return max(1, math.ceil(capacity_factor * tokens * top_k / experts))


# ------------------------------------------------------------------- routing
class Routing(tp.NamedTuple):
  """Where each token slot goes (slot ``s = n k + j``: token n's j-th choice):
  its expert (int32), weight (float32, 0 when dropped) and whether it is kept;
  ``order_S`` sorts the slots by expert (kept slots in token order, dropped
  ones last) into groups of ``group_sizes_E`` (kept slots per expert).
  ``stats``: ``load_balance``, ``z_loss`` (float32), ``tokens_per_expert``
  ((E,) int32, slots routed to each before capacity), ``dropped`` (int32)."""
  expert_S: Array
  weight_S: Array
  kept_S: Array
  order_S: Array
  group_sizes_E: Array
  stats: dict


def route(logits_NxE: Array, top_k: int, capacity_factor: float | None = None) -> Routing:
  """Top-k routing of N tokens to E experts from router logits (see the module
  docstring); the losses are differentiable in the logits."""
  n, e = logits_NxE.shape
  logits = logits_NxE.astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  top_p, top_e = jax.lax.top_k(probs, top_k)                     # (N, k)
  weight = (top_p / jnp.sum(top_p, axis=-1, keepdims=True)).reshape(-1)
  expert = top_e.reshape(-1).astype(jnp.int32)
  counts = jnp.bincount(expert, length=e).astype(jnp.int32)
  order = jnp.argsort(expert, stable=True).astype(jnp.int32)
  capacity = expert_capacity(n, e, top_k, capacity_factor)
  if capacity is None:
    kept, sizes = jnp.ones_like(expert, bool), counts
  else:  # rank of each slot within its expert, in token order
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(n * top_k, dtype=jnp.int32) - starts[expert[order]]
    kept = jnp.take(rank_sorted, ops.invert_permutation(order)) < capacity
    order = jnp.argsort(jnp.where(kept, expert, e), stable=True).astype(jnp.int32)
    sizes = jnp.minimum(counts, capacity)
  stats = {
      'load_balance': e * jnp.sum(counts / (n * top_k) * jnp.mean(probs, axis=0)),
      'z_loss': jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
      'tokens_per_expert': counts,
      'dropped': (n * top_k - jnp.sum(sizes)).astype(jnp.int32),
  }
  return Routing(expert, jnp.where(kept, weight, 0.0), kept, order, sizes, stats)


# ------------------------------------------------------------------- experts
class Router(nnx.Linear):
  """The router, an ``nnx.Linear`` (H -> E, float32 compute, full precision).
  A subclass only so that ``poetx_jax.poetize``, which converts layers of type
  exactly ``nnx.Linear``, keeps it a plain trainable layer."""


def grouped_linear(proj: nnx.Linear, x_SxI: Array, group_sizes_E: Array) -> Array:
  """Each row of ``x`` (sorted by expert, group e of size ``group_sizes_E[e]``)
  times its expert's kernel; rows past the groups give zeros. ``proj`` is a
  bias-free stack of E kernels (E, I, O): an ``nnx.Linear`` or what
  ``poetize`` makes of it (its kernels then formed from block products)."""
  if proj.use_bias:
    raise ValueError('expert projections must be bias-free')
  x, kernels = linear_operands(proj, x_SxI)
  if kernels.ndim != 3:
    raise ValueError(f'expert projections must stack their kernels along one leading '
                     f'expert axis, got kernels of shape {kernels.shape}')
  return jax.lax.ragged_dot(x, kernels, group_sizes_E, precision=proj.precision)


class Experts(nnx.Module):
  """E SwiGLU experts, ``down(silu(gate(x)) * up(x))``; each projection one
  ``nnx.Linear`` with a leading expert axis (kernel (E, in, out)) or, after
  ``poetize``, one POETLinear stack of E layers."""

  def __init__(self, experts: int, hidden: int, inner: int, *, init_std: float = 0.02,
               dtype: tp.Any = jnp.float32, param_dtype: tp.Any = jnp.float32,
               rngs: nnx.Rngs):
    init = initializers.normal(init_std)

    def stack(i, o):
      return nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                        kernel_init=lambda key, shape, dt: init(key, (experts,) + shape, dt),
                        rngs=rngs)

    self.gate_proj = stack(hidden, inner)
    self.up_proj = stack(hidden, inner)
    self.down_proj = stack(inner, hidden)
    self.experts = experts

  def __call__(self, x_SxH: Array, group_sizes_E: Array) -> Array:
    """x (S, H) sorted by expert, group sizes (E,) -> (S, H) (zero past the groups)."""
    gate = grouped_linear(self.gate_proj, x_SxH, group_sizes_E)
    up = grouped_linear(self.up_proj, x_SxH, group_sizes_E)
    hidden = checkpoint_name(jax.nn.silu(gate) * up, 'mlp_hidden')
    return grouped_linear(self.down_proj, hidden, group_sizes_E)


class MoEMLP(nnx.Module):
  """The routed expert MLP: ``y_n = sum_j w_nj expert_{e_nj}(x_n)`` over the k
  experts each token is routed to (see the module docstring).

  ``router`` is a :class:`Router` (H -> E), ``experts`` the :class:`Experts`.
  """

  def __init__(self, config: MoEConfig, *, dtype: tp.Any = jnp.float32,
               param_dtype: tp.Any = jnp.float32, rngs: nnx.Rngs):
    self.router = Router(config.hidden, config.experts, use_bias=False, dtype=jnp.float32,
                         param_dtype=param_dtype, precision=jax.lax.Precision.HIGHEST,
                         kernel_init=initializers.normal(config.init_std), rngs=rngs)
    self.experts = Experts(config.experts, config.hidden, config.expert_inner,
                           init_std=config.init_std, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs)
    self.top_k = config.top_k
    self.capacity_factor = config.capacity_factor

  def forward(self, x: Array) -> tuple[Array, dict]:
    """``self(x)``: what a decoder layer calls."""
    return self(x)

  def __call__(self, x: Array) -> tuple[Array, dict]:
    """x (..., H) -> (y (..., H) in x's dtype, :class:`Routing` ``stats``)."""
    shape, k = x.shape, self.top_k
    x_NxH = x.reshape(-1, shape[-1])
    r = route(self.router(x_NxH), k, self.capacity_factor)
    x_SxH = ops.permute_rows(jnp.repeat(x_NxH, k, axis=0), r.order_S)
    y_SxH = self.experts(x_SxH, r.group_sizes_E)
    y_SxH = ops.permute_rows(y_SxH, ops.invert_permutation(r.order_S))   # slot order
    y_SxH = jnp.where(r.kept_S[:, None], y_SxH.astype(jnp.float32) * r.weight_S[:, None], 0.0)
    y = jnp.sum(y_SxH.reshape(-1, k, shape[-1]), axis=1)
    return y.astype(x.dtype).reshape(shape), r.stats


# --------------------------------------------------------------------- model
class MoEDecoderLayer(DecoderLayer):
  """Llama's decoder layer with the routed MLP; its stats are the routing's
  (:class:`Routing`)."""

  mlp_class = MoEMLP


class MoELlama(Llama):
  """Mixture-of-experts Llama: tokens (B, T) int -> logits (B, T, V) float32.

  Embedding, decoder layers (:class:`MoEDecoderLayer`), final norm, lm_head,
  with the state paths of ``llama.Llama`` (the MLP's ``mlp/router`` and
  ``mlp/experts/{gate,up,down}_proj``). Arguments as for ``llama.Llama``.
  :meth:`forward`'s ``aux`` holds the routing and the auxiliary loss.

  Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from poetx_jax.models import get_config
    >>> model = get_config('moe-tiny').build(rngs=nnx.Rngs(0))
    >>> logits, aux = model.forward(jnp.zeros((2, 8), jnp.int32))
    >>> logits.shape, aux['expert_tokens'].shape
    ((2, 8, 4096), (4,))
  """

  decoder_layer = MoEDecoderLayer
  config_class = MoEConfig

  def aux_init(self) -> dict:
    zero = jnp.zeros((), jnp.float32)
    return {'load_balance': zero, 'z_loss': zero, 'dropped': jnp.zeros((), jnp.int32),
            'tokens_per_expert': jnp.zeros((self.config.experts,), jnp.int32)}

  def aux_summary(self, totals: dict) -> dict:
    """``aux``: ``aux_loss`` (the weighted sum to add to the training loss),
    ``load_balance`` and ``router_z_loss`` (means over layers, unweighted),
    ``expert_tokens`` (E,) int32 (slots routed to each expert) and
    ``dropped`` (int32 slots over capacity), both summed over layers."""
    c = self.config
    aux = {'expert_tokens': totals['tokens_per_expert'], 'dropped': totals['dropped'],
           'load_balance': totals['load_balance'] / c.layers,
           'router_z_loss': totals['z_loss'] / c.layers}
    aux['aux_loss'] = (c.aux_loss_coef * aux['load_balance']
                       + c.z_loss_coef * aux['router_z_loss'])
    return aux
