"""What a :class:`~poetx_jax.pretrain.config.TrainConfig` builds: the model,
the optimizer, the train step and the device mesh.

    mc = model_config(cfg, vocab_size)
    mesh = make_training_mesh(cfg)
    model, optimizer = build_state(cfg, mc, mesh)   # placed on the mesh
    step = make_step(cfg, mc, mesh=mesh)
    loss = step(model, optimizer, batch)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import poetx_jax
from poetx_jax import models, sharding
from poetx_jax.models import hf
from poetx_jax.lean import lean_adamw
from poetx_jax.models.llama import LlamaConfig
from poetx_jax.pretrain import hf_init
from poetx_jax.pretrain.config import (ADAMW_WIDE_LR, CLIP_RAMP_UNTIL, DEFAULT_LR,
                                        DEFAULT_MERGE_EVERY, WIDE_HIDDEN, WIDE_MERGE_EVERY,
                                        TrainConfig)
from poetx_jax.pretrain.evaluation import target_count, training_loss


def compute_dtype(name: str):
  """The compute dtype of ``TrainConfig.dtype``: 'auto' is bf16 on GPU, f32 elsewhere."""
  if name == 'auto':
    return jnp.bfloat16 if jax.default_backend() == 'gpu' else jnp.float32
  return jnp.dtype(name)


def model_config(cfg: TrainConfig, vocab_size: int,
                 source: LlamaConfig | None = None) -> LlamaConfig:
  """The named config (dense or mixture-of-experts) with overrides, its
  vocabulary set to the tokenizer's; with ``cfg.init_from_hf``, ``source``,
  the checkpoint's config, which they must agree with (:func:`hf_init.model_config`)."""
  if cfg.init_from_hf is not None:
    mc = hf_init.model_config(cfg, source, vocab_size)
  else:
    mc = dataclasses.replace(models.get_config(cfg.model, **cfg.model_overrides),
                             vocab_size=vocab_size)
  if cfg.seq_len > mc.max_seq_len:
    raise ValueError(f'seq_len={cfg.seq_len} is longer than model {cfg.model!r} '
                     f'supports (max_seq_len={mc.max_seq_len})')
  return mc


def build_model(cfg: TrainConfig, mc: LlamaConfig, mesh=None, weights=None):
  """The model ``mc`` describes (poetized for POET-X: a mixture-of-experts
  model's experts too, not its routers) as it is at step 0 of the run:
  random, or holding ``weights`` (Hugging Face names: ``hf.from_hf``), with
  no random weights drawn (``hf.build_from_hf``).

  For POET-X each decoder layer is converted as soon as it is built (its dense
  kernels freed), so the dense weights of only one layer are resident at a
  time. The result is that of ``poetize(init_model(...), rngs=nnx.Rngs(seed +
  1), ...)``. Built op by op, not in one jitted program: a whole-model program
  compiles its initialisers and permutation draws once per layer (minutes on a
  GPU for Llama-1B), op by op they compile once per shape.

  With ``mesh``, ``cfg.strategy == 'fsdp'`` and ``cfg.scan_layers``, the
  stacked decoder layers are allocated sharded and each layer is written into
  its shards as it is built: a model whose weights do not fit on one device
  is never gathered on one (the rest, embeddings and head, start on the
  default device; :func:`build_state` places them).
  """
  dtype, param_dtype = compute_dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
  place = None
  if mesh is not None and cfg.strategy == 'fsdp' and cfg.scan_layers:
    place = sharding.placement(mesh, cfg.strategy)
  convert = _layer_converter(cfg, mc) if cfg.optimizer == 'poetx' else None
  options = dict(dtype=dtype, param_dtype=param_dtype, remat=cfg.remat,
                 attention=cfg.attention, convert_layer=convert,
                 scan_layers=cfg.scan_layers, place=place)
  if weights is not None:
    return hf.build_from_hf(mc, weights, **options)
  return mc.build(rngs=nnx.Rngs(jax.random.key(cfg.seed)), **options)


def build_state(cfg: TrainConfig, mc: LlamaConfig, mesh=None,
                weights=None) -> tuple[nnx.Module, nnx.Optimizer]:
  """``(model, optimizer)`` of the run at step 0 (:func:`build_model`, from
  ``weights`` if given; :func:`build_optimizer`), placed on ``mesh`` by
  ``cfg.strategy`` (None: the default device)."""
  model = build_model(cfg, mc, mesh, weights)
  optimizer = build_optimizer(cfg, model)
  if mesh is not None:
    if cfg.batch_size % mesh.size:
      raise ValueError(f'batch_size={cfg.batch_size} must be divisible by the '
                       f'{mesh.size} devices')
    sharding.shard_state(model, mesh, cfg.strategy)
    sharding.shard_state(optimizer, mesh, cfg.strategy)
  return model, optimizer


def normalize_rows(cfg: TrainConfig, mc: LlamaConfig) -> bool:
  """Whether POET-X conversion scales W0's rows to unit norm: ``cfg.normalize_rows``,
  or by default for a fresh model of hidden size >= WIDE_HIDDEN (never for one
  started from a checkpoint, whose function it would change)."""
  if cfg.normalize_rows is not None:
    return cfg.normalize_rows
  return cfg.optimizer == 'poetx' and cfg.init_from_hf is None and mc.hidden >= WIDE_HIDDEN


def peak_lr(cfg: TrainConfig, mc: LlamaConfig) -> float:
  """The run's peak learning rate of AdamW (or SkewAdam), or of POET-X's
  non-POET parameters: ``cfg.lr``, else DEFAULT_LR, or ADAMW_WIDE_LR for AdamW
  on a model of hidden size >= WIDE_HIDDEN."""
  if cfg.lr is not None:
    return cfg.lr
  return ADAMW_WIDE_LR if cfg.optimizer == 'adamw' and mc.hidden >= WIDE_HIDDEN else DEFAULT_LR


def merge_interval(cfg: TrainConfig, mc: LlamaConfig) -> int:
  """POET-X's merge interval in updates: ``cfg.merge_every``, else
  DEFAULT_MERGE_EVERY, or WIDE_MERGE_EVERY on a model of hidden size >=
  WIDE_HIDDEN."""
  if cfg.merge_every is not None:
    return cfg.merge_every
  return WIDE_MERGE_EVERY if mc.hidden >= WIDE_HIDDEN else DEFAULT_MERGE_EVERY


def layer_form(cfg: TrainConfig, mc: LlamaConfig) -> str:
  """The POET layers' ``form``: ``cfg.form``, else ``'auto'`` on a model of
  hidden size >= WIDE_HIDDEN and ``'input'`` below."""
  if cfg.form is not None:
    return cfg.form
  return 'auto' if mc.hidden >= WIDE_HIDDEN else 'input'


def _layer_converter(cfg: TrainConfig, mc: LlamaConfig):
  """``convert(layer)``: a decoder layer poetized as the run configures, its
  dense kernels consumed; permutations drawn from ``seed + 1``, layer after
  layer (and tied, with ``cfg.tie_permutations``)."""
  poet_rngs = nnx.Rngs(jax.random.key(cfg.seed + 1))

  def convert(layer):
    layer = poetx_jax.poetize(layer, rngs=poet_rngs, consume=True,
                              normalize_rows=normalize_rows(cfg, mc),
                              max_generator_norm=cfg.max_generator_norm,
                              block_size=cfg.block_size or mc.block_size, mode=cfg.mode,
                              form=layer_form(cfg, mc), implementation=cfg.implementation,
                              quantize=cfg.quantize, group_size=cfg.group_size)
    return poetx_jax.tie_permutations(layer) if cfg.tie_permutations else layer

  return convert


def size_text(tree) -> str:
  """:func:`poetx_jax.state_bytes` as text ('1.23 GiB' or '456.7 MiB')."""
  n = poetx_jax.state_bytes(tree)
  return f'{n / 2 ** 30:.2f} GiB' if n >= 2 ** 30 else f'{n / 2 ** 20:.1f} MiB'


def abstract_state(cfg: TrainConfig, mc: LlamaConfig):
  """``(model, optimizer)`` of the run as shapes only (``nnx.eval_shape``):
  for sizing and compiling without allocating anything."""

  def build():
    model = build_model(cfg, mc)
    return model, build_optimizer(cfg, model)

  return nnx.eval_shape(build)


def schedule(peak: float, cfg: TrainConfig) -> optax.Schedule:
  """Linear warmup to ``peak``, cosine decay to ``min_lr_ratio * peak``."""
  total = max(cfg.steps, cfg.warmup + 1)
  return optax.warmup_cosine_decay_schedule(
      0.0, peak, warmup_steps=cfg.warmup, decay_steps=total,
      end_value=peak * cfg.min_lr_ratio)


def poet_lr(cfg: TrainConfig, block_size: int) -> float:
  """The run's peak POET-X learning rate: ``cfg.poet_lr``, else the default."""
  return poetx_jax.default_poet_lr(block_size) if cfg.poet_lr is None else cfg.poet_lr


def model_poet_lr(cfg: TrainConfig, model) -> float:
  """The peak POET learning rate of a converted model (its block size's default
  unless ``cfg.poet_lr`` is set)."""
  return poet_lr(cfg, poetx_jax.poet_layers(model)[0][1].block_size)


def build_optimizer(cfg: TrainConfig, model) -> nnx.Optimizer:
  """The run's optimizer: POET-X for the generators and AdamW (or SkewAdam's
  tiers) for the rest, or AdamW or SkewAdam for everything, clipped and
  accumulated as configured."""
  lr = schedule(peak_lr(cfg, model.config), cfg)
  if cfg.optimizer == 'skewadam' or cfg.skew_tiers:
    if cfg.optimizer == 'skewadam':
      tx = poetx_jax.skewadam(lr, poetx_jax.skewadam_labels(model, poet=False),
                              weight_decay=cfg.weight_decay)
    else:
      poet = poetx_jax.poetx(schedule(model_poet_lr(cfg, model), cfg),
                             merge_every=merge_interval(cfg, model.config))
      tx = poetx_jax.poetx_skewadam(model, poet, lr, weight_decay=cfg.weight_decay)
    return _finish_optimizer(cfg, model, tx)
  if cfg.lean_state:
    adamw = lean_adamw(lr, weight_decay=cfg.weight_decay)
  else:
    adamw = optax.adamw(lr, b1=0.9, b2=0.999,
                        weight_decay=cfg.weight_decay)
  if cfg.optimizer == 'poetx':
    lean = dict(mu_dtype=jnp.bfloat16, second_moment='block') if cfg.lean_state else {}
    peak = model_poet_lr(cfg, model)
    tx = poetx_jax.poetx_partition(
        model, poetx_jax.poetx(schedule(peak, cfg),
                               merge_every=merge_interval(cfg, model.config), **lean),
        adamw)
  else:
    tx = adamw
  return _finish_optimizer(cfg, model, tx)


def _finish_optimizer(cfg: TrainConfig, model, tx) -> nnx.Optimizer:
  """``tx`` clipped (to a bound that dips after each merge with ``clip_ramp``) and
  accumulated as configured, over the model's Params."""
  if cfg.clip > 0 and cfg.clip_ramp:
    tx = poetx_jax.clip_by_global_norm_after_merge(tx, cfg.clip, ramp_steps=cfg.clip_ramp,
                                                   until=CLIP_RAMP_UNTIL)
  elif cfg.clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip), tx)
  if cfg.grad_accum > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=cfg.grad_accum)
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def make_step(cfg: TrainConfig, mc: LlamaConfig, on_merge=None, mesh=None,
              grad_norm: bool = False):
  """The run's train step ``step(model, optimizer, batch) -> loss``; ``on_merge``:
  called as ``on_merge(step, orthogonality_error)`` at each POET-X merge;
  ``mesh``: the training mesh, if any; ``grad_norm``: return ``(loss,
  grad_norm)`` (:func:`poetx_jax.make_train_step`)."""
  if cfg.optimizer == 'poetx':
    # Per-device programs only where each row is computed on its own (a
    # routed model's capacity and aux losses are per global batch).
    dp = (mesh if mesh is not None and cfg.strategy == 'dp' and mc.rows_independent
          else None)
    every = merge_interval(cfg, mc) * cfg.grad_accum
    return poetx_jax.make_train_step(training_loss, merge_every=every,
                                     seed=cfg.seed, on_merge=on_merge,
                                     data_parallel=dp, loss_weight=target_count,
                                     grad_norm=grad_norm)
  return poetx_jax.make_train_step(training_loss, grad_norm=grad_norm)  # AdamW: never merge


def make_training_mesh(cfg: TrainConfig):
  """The (data, fsdp) mesh over all devices, or None on a single device."""
  if jax.device_count() == 1:
    return None
  return sharding.make_mesh(fsdp=cfg.fsdp)
