"""What a run's :class:`~poetx_jax.pretrain.plan.Plan` builds: the model, the
optimizer, the train step and the device mesh.

    plan = make_plan(cfg, vocab_size)
    mesh = make_training_mesh(plan)
    model, optimizer = build_state(plan, mesh)   # placed on the mesh
    step = make_step(plan, mesh=mesh)
    loss = step(model, optimizer, batch)
"""

from __future__ import annotations

import functools
import typing as tp

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import poetx_jax
from poetx_jax import sharding
from poetx_jax.models import hf
from poetx_jax.pretrain.config import CLIP_RAMP_UNTIL
from poetx_jax.pretrain.loss import target_count, training_loss

if tp.TYPE_CHECKING:
  from poetx_jax.pretrain.plan import Plan


def build_model(plan: 'Plan', mesh=None, weights=None):
  """The model ``plan.model`` describes (poetized for POET-X: a mixture-of-experts
  model's experts too, not its routers) as it is at step 0 of the run:
  random, or holding ``weights`` (Hugging Face names: ``hf.from_hf``), with
  no random weights drawn (``hf.build_from_hf``).

  For POET-X each decoder layer is converted as soon as it is built (its dense
  kernels freed), so the dense weights of only one layer are resident at a
  time. The result is that of ``poetize(init_model(...), rngs=nnx.Rngs(seed +
  1), ...)``. Built op by op, not in one jitted program: a whole-model program
  compiles its initialisers and permutation draws once per layer (minutes on a
  GPU for Llama-1B), op by op they compile once per shape.

  With ``mesh``, strategy ``'fsdp'`` and ``scan_layers``, the
  stacked decoder layers are allocated sharded and each layer is written into
  its shards as it is built: a model whose weights do not fit on one device
  is never gathered on one (the rest, embeddings and head, start on the
  default device; :func:`build_state` places them).
  """
  cfg = plan.options
  place = None
  if mesh is not None and cfg.strategy == 'fsdp' and cfg.scan_layers:
    place = sharding.placement(mesh, cfg.strategy)
  convert = _layer_converter(plan) if plan.poetize else None
  options = dict(dtype=jnp.dtype(plan.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
                 remat=cfg.remat, attention=cfg.attention, convert_layer=convert,
                 norm_gathers=cfg.norm_gathers,
                 scan_layers=cfg.scan_layers, place=place)
  if weights is not None:
    return hf.build_from_hf(plan.model, weights, **options)
  return plan.model.build(rngs=nnx.Rngs(jax.random.key(cfg.seed)), **options)


def build_state(plan: 'Plan', mesh=None, weights=None) -> tuple[nnx.Module, nnx.Optimizer]:
  """``(model, optimizer)`` of the run at step 0 (:func:`build_model`, from
  ``weights`` if given; :func:`build_optimizer`), placed on ``mesh`` by the
  run's strategy (None: committed to the default device, as a checkpoint
  restores them, so that a resumed run's programs are the fresh run's and
  come from the compilation cache)."""
  cfg = plan.options
  model = build_model(plan, mesh, weights)
  optimizer = build_optimizer(plan, model)
  if mesh is None:
    device = jax.local_devices()[0]
    for node in (model, optimizer):
      nnx.update(node, jax.device_put(nnx.state(node), device))
  else:
    if cfg.batch_size % mesh.size:
      raise ValueError(f'batch_size={cfg.batch_size} must be divisible by the '
                       f'{mesh.size} devices')
    sharding.shard_state(model, mesh, cfg.strategy)
    sharding.shard_state(optimizer, mesh, cfg.strategy)
  return model, optimizer


def _layer_converter(plan: 'Plan'):
  """``convert(layer)``: a decoder layer poetized as the plan says, its
  dense kernels consumed; permutations drawn from ``seed + 1``, layer after
  layer (and tied, with ``tie_permutations``)."""
  cfg = plan.options
  poet_rngs = nnx.Rngs(jax.random.key(cfg.seed + 1))

  def convert(layer):
    layer = poetx_jax.poetize(layer, rngs=poet_rngs, consume=True,
                              normalize_rows=plan.normalize_rows,
                              max_generator_norm=cfg.max_generator_norm,
                              block_size=plan.block_size, mode=cfg.mode,
                              form=plan.form, implementation=cfg.implementation,
                              quantize=cfg.quantize, group_size=cfg.group_size,
                              generator_dtype=cfg.generator_dtype,
                              permutation=plan.permutation, chunk_size=cfg.chunk_size)
    return poetx_jax.tie_permutations(layer) if cfg.tie_permutations else layer

  return convert


def size_text(tree) -> str:
  """:func:`poetx_jax.state_bytes` as text ('1.23 GiB' or '456.7 MiB')."""
  n = poetx_jax.state_bytes(tree)
  return f'{n / 2 ** 30:.2f} GiB' if n >= 2 ** 30 else f'{n / 2 ** 20:.1f} MiB'


def state_sizes(plan: 'Plan', model, optimizer) -> list[str]:
  """Two lines for the log: the model's parameters, the sizes of the state."""
  cfg, mc = plan.options, plan.model
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  active = (f', {mc.active_params():,} active per token'
            if mc.active_params() != mc.num_params() else '')
  return [f'model: {cfg.model} ({n_params:,} trainable parameters, '
          f'{mc.num_params():,} in the dense model{active}), optimizer {cfg.optimizer}'
          f'{" with SkewAdam tiers" if cfg.skew_tiers else ""}, dtype {plan.dtype}',
          f'state: model {size_text(nnx.state(model))}, optimizer '
          f'{size_text(nnx.state(optimizer))}; gradients '
          f'{size_text(nnx.state(model, nnx.Param))} during a step']


def abstract_state(plan: 'Plan'):
  """``(model, optimizer)`` of the run as shapes only (``nnx.eval_shape``):
  for sizing and compiling without allocating anything."""

  def build():
    model = build_model(plan)
    return model, build_optimizer(plan, model)

  return nnx.eval_shape(build)


def build_optimizer(plan: 'Plan', model) -> nnx.Optimizer:
  """The run's optimizer over the model's Params: its recipe's transformation
  (:mod:`~poetx_jax.pretrain.recipes`), clipped (to a bound that dips after
  each merge with ``clip_ramp``). Gradients of ``grad_accum`` micro-batches
  are summed by the train step (:func:`make_step`), not by the optimizer."""
  cfg = plan.options
  tx = plan.recipe.build(plan, model)
  if cfg.clip > 0 and cfg.clip_ramp:
    tx = poetx_jax.clip_by_global_norm_after_merge(tx, cfg.clip, ramp_steps=cfg.clip_ramp,
                                                   until=CLIP_RAMP_UNTIL)
  elif cfg.clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip), tx)
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def make_step(plan: 'Plan', on_merge=None, mesh=None, grad_norm: bool = False):
  """The run's train step ``step(model, optimizer, batch) -> loss``; ``on_merge``:
  called as ``on_merge(step, orthogonality_error)`` at each POET-X merge;
  ``mesh``: the training mesh, if any; ``grad_norm``: return ``(loss,
  grad_norm)`` (:func:`poetx_jax.make_train_step`). With ``grad_accum`` > 1
  one call is one update: the micro-batches come stacked on a leading axis
  and their gradients are summed in the one compiled update (under ``dp``,
  and under ``fsdp`` for POET-X, on each device, then averaged across
  devices once)."""
  cfg = plan.options
  loss = functools.partial(training_loss, loss_chunk=cfg.loss_chunk)
  options = ({'xla_gpu_memory_limit_slop_factor': cfg.memory_slop}
             if cfg.memory_slop is not None else None)
  # Per-device programs (dp: one all-reduce of exactly the trained arrays an
  # update; fsdp: one gather and one reduce-scatter of them) only where each
  # row is computed on its own (a routed model's capacity and aux losses are
  # per global batch), and under fsdp only for POET-X: a dense optimizer's
  # trained arrays are the whole model, which fully_sharded holds whole on
  # every device.
  per_device = mesh is not None and plan.model.rows_independent
  common = dict(data_parallel=mesh if per_device and cfg.strategy == 'dp' else None,
                fully_sharded=(mesh if per_device and cfg.strategy == 'fsdp' and plan.poetize
                               else None),
                loss_weight=target_count, grad_norm=grad_norm,
                compiler_options=options, accumulate=cfg.grad_accum)
  if plan.poetize:
    return poetx_jax.make_train_step(loss, merge_every=plan.merge_every, seed=cfg.seed,
                                     on_merge=on_merge, **common)
  return poetx_jax.make_train_step(loss, **common)  # AdamW and the like: never merge


def update_batch_shape(cfg) -> tuple[int, ...]:
  """The token arrays' shape one call of :func:`make_step`'s step takes:
  ``(grad_accum, batch_size, seq_len)``, or ``(batch_size, seq_len)``
  without accumulation; the rows are its second-last axis."""
  rows = (cfg.batch_size, cfg.seq_len)
  return (cfg.grad_accum, *rows) if cfg.grad_accum > 1 else rows


def make_training_mesh(plan: 'Plan'):
  """The (data, fsdp) mesh over all devices, or None on a single device."""
  if jax.device_count() == 1:
    return None
  return sharding.make_mesh(fsdp=plan.options.fsdp)
