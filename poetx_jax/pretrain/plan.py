"""A run's plan: every default its options left open resolved, in one place.

The options (:class:`~poetx_jax.pretrain.config.TrainConfig`), finished by
:mod:`~poetx_jax.pretrain.options`, leave some values open (None):
:func:`make_plan` resolves them for the model the run trains, into a frozen
:class:`Plan`: the model config, whether it is poetized, the learning rates
and their schedules, the POET block size, step, merge interval (in updates
and micro-steps), layer form, row normalisation and permutation draw, the
compute dtype. Everything downstream (the model and optimizer factories, the
loop and its hooks, tracking, evaluation, export, the experiments) reads the
plan and resolves nothing again; ``run.json`` records it beside the options
(:meth:`Plan.record`), and a resumed run (or ``poetx eval``, ``poetx
export``) keeps the values it recorded (:func:`recorded_plan`)::

    cfg = options.finish_options(TrainConfig(model='130m'), resume=False)
    plan = make_plan(cfg, vocab_size=32000)
    plan.lr, plan.poet_lr, plan.merge_every, plan.block_size, plan.form
"""
from __future__ import annotations

import dataclasses
import pathlib
import typing as tp

import jax
import optax

from poetx_jax import models, ops
from poetx_jax.models.llama import LlamaConfig
from poetx_jax.pretrain import hf_init, rundir
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.recipes import (CHUNK_MAX_KEPT, DEFAULT_LR, DEFAULT_MERGE_EVERY, RECIPES,
                                        WIDE_HIDDEN, WIDE_MERGE_EVERY, Recipe)

# What a plan resolves that a resumed run keeps as recorded (Plan.record):
# the training defaults, not the compute dtype, which follows the machine.
PINNED = ('lr', 'weight_decay', 'min_lr_ratio', 'poet_lr', 'merge_every', 'block_size',
          'form', 'normalize_rows', 'permutation')


@dataclasses.dataclass(frozen=True)
class Plan:
  """A run with every default resolved (see the module docstring).

  Attributes:
    options: the finished options.
    model: the model config: the named one (or the checkpoint's) with its
      overrides, the run's vocabulary and, when poetized, its block size.
    recipe: the optimizer family (:mod:`~poetx_jax.pretrain.recipes`).
    poetize: whether the model's linear layers train as POET layers.
    lr: peak learning rate of AdamW (SkewAdam, Muon), or of POET-X's non-POET
      parameters.
    weight_decay: their decoupled weight decay.
    min_lr_ratio: the final/peak ratio of every learning-rate schedule.
    poet_lr: peak POET-X step size (None without POET).
    block_size, merge_every, form, normalize_rows: the POET layers' block
      size, the merge interval in updates, their product order and whether
      conversion scales W0's rows to unit norm (None / False without POET).
    permutation: how the POET layers draw their permutations, ``'element'``
      or ``'chunk'`` (of ``options.chunk_size`` features a run); None
      without POET.
    merge_period: the merge interval in micro-steps (``merge_every *
      grad_accum``; None without POET).
    dtype: the compute dtype's name (``'auto'`` resolved for this backend).
    updates, micro_steps: the optimizer updates and micro-batches of the run.
  """
  options: TrainConfig
  model: LlamaConfig
  recipe: Recipe
  poetize: bool
  lr: float
  weight_decay: float
  min_lr_ratio: float
  poet_lr: float | None
  block_size: int | None
  merge_every: int | None
  merge_period: int | None
  form: str | None
  normalize_rows: bool
  permutation: str | None
  dtype: str
  updates: int
  micro_steps: int

  def schedule(self, peak: float) -> optax.Schedule:
    """Linear warmup to ``peak``, cosine decay to ``min_lr_ratio * peak`` by the last update."""
    o = self.options
    total = max(o.steps, o.warmup + 1)
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup_steps=o.warmup,
                                              decay_steps=total,
                                              end_value=peak * self.min_lr_ratio)

  @property
  def lr_schedule(self) -> optax.Schedule:
    return self.schedule(self.lr)

  @property
  def poet_lr_schedule(self) -> optax.Schedule | None:
    return None if self.poet_lr is None else self.schedule(self.poet_lr)

  def record(self) -> dict:
    """The resolved values as JSON (``run.json``'s ``plan``)."""
    return {'poetize': self.poetize, 'lr': self.lr, 'weight_decay': self.weight_decay,
            'min_lr_ratio': self.min_lr_ratio, 'poet_lr': self.poet_lr,
            'block_size': self.block_size, 'merge_every': self.merge_every,
            'merge_period': self.merge_period, 'form': self.form,
            'normalize_rows': self.normalize_rows, 'permutation': self.permutation,
            'dtype': self.dtype,
            'updates': self.updates, 'micro_steps': self.micro_steps,
            'model': dataclasses.asdict(self.model)}


def compute_dtype(name: str) -> str:
  """The compute dtype of ``TrainConfig.dtype``: 'auto' is bfloat16 on GPU, float32 elsewhere."""
  if name == 'auto':
    return 'bfloat16' if jax.default_backend() == 'gpu' else 'float32'
  return name


def poet_widths(mc: LlamaConfig) -> tuple[int, ...]:
  """The feature widths of a model's POET layers' sides: hidden, attention
  (query heads), key/value heads and the MLP's (an expert's) inner width."""
  return (mc.hidden, mc.heads * mc.head_dim, mc.kv_heads * mc.head_dim,
          getattr(mc, 'expert_inner', mc.mlp))


def default_permutation(chunk_size: int, block_size: int, widths: tp.Iterable[int] = ()) -> str:
  """How a run draws its POET permutations when ``--permutation`` leaves it
  open: ``'chunk'`` on a GPU where ``chunk_size`` (above 1) divides
  ``block_size`` and each of the POET layers' ``widths``, and a feature keeps
  at most :data:`CHUNK_MAX_KEPT` of its block-mates across merges
  (``(chunk_size - 1) / (B - 1)`` for blocks of B: 2.9% at runs of 16 in
  blocks of 512, 5.9% in blocks of 256), the last, ragged block of a width
  included; ``'element'`` elsewhere, the published POET-X's draw. On GPUs
  runs of 16 in blocks of 512 trained within the seed spread of the element
  draw where it was measured (19M, two seeds; 130M, three seeds on a quarter
  budget: docs/results/chunk-permutations) and shortened the step at 1B and
  8B; on CPUs neither was measured."""
  if jax.default_backend() != 'gpu' or chunk_size < 2:
    return 'element'
  blocks = {block_size, *(w % block_size or block_size for w in widths)}
  if block_size % chunk_size or any(w % chunk_size for w in widths):
    return 'element'
  return ('chunk' if all(chunk_size - 1 <= CHUNK_MAX_KEPT * (b - 1) for b in blocks)
          else 'element')


def model_config(cfg: TrainConfig, vocab_size: int,
                 source: LlamaConfig | None = None) -> LlamaConfig:
  """The named config (dense or mixture-of-experts) with overrides, its
  vocabulary the tokenizer's; with ``cfg.init_from_hf``, ``source``, the
  checkpoint's config, which they must agree with (:func:`hf_init.model_config`)."""
  if cfg.init_from_hf is not None:
    mc = hf_init.model_config(cfg, source, vocab_size)
  else:
    mc = dataclasses.replace(models.get_config(cfg.model, **cfg.model_overrides),
                             vocab_size=vocab_size)
  if cfg.seq_len > mc.max_seq_len:
    raise ValueError(f'seq_len={cfg.seq_len} is longer than model {cfg.model!r} '
                     f'supports (max_seq_len={mc.max_seq_len})')
  return mc


def block_size(cfg: TrainConfig, mc: LlamaConfig) -> int:
  """The POET block size of options ``cfg`` on a model of config ``mc``: the
  option, else the model's (before a resumed run's recorded value, which
  :func:`make_plan` keeps)."""
  return cfg.block_size if cfg.block_size is not None else mc.block_size


def make_plan(cfg: TrainConfig, vocab_size: int | None = None,
              source: LlamaConfig | None = None, *,
              recorded: tp.Mapping | None = None) -> Plan:
  """The :class:`Plan` of the finished options ``cfg`` for a tokenizer of
  ``vocab_size`` (None: ``cfg.vocab_size``, for runs with no data) and, with
  ``--init-from-hf``, the checkpoint's model config ``source``.

  ``recorded``: the plan the run recorded when it started (``run.json``'s
  ``plan``); its values of :data:`PINNED` are kept where the options leave
  them open, so a run continues as it started whatever the defaults are now.

  Raises ValueError naming the option that does not fit the model (a block
  size larger than a projection, a sequence longer than the model takes, a
  checkpoint that disagrees with ``--model``).
  """
  recipe = RECIPES[cfg.optimizer]
  mc = model_config(cfg, cfg.vocab_size if vocab_size is None else vocab_size, source)
  wide = mc.hidden >= WIDE_HIDDEN
  lr = cfg.lr if cfg.lr is not None else (
      recipe.wide_lr if wide and recipe.wide_lr is not None else DEFAULT_LR)
  poet = dict(poet_lr=None, block_size=None, merge_every=None, form=None,
              normalize_rows=False, permutation=None)
  if recipe.poetizes:
    block = block_size(cfg, mc)
    poet = dict(
        block_size=block,
        poet_lr=cfg.poet_lr if cfg.poet_lr is not None else recipe.poet_lr(block),
        merge_every=(cfg.merge_every if cfg.merge_every is not None else
                     WIDE_MERGE_EVERY if wide else DEFAULT_MERGE_EVERY),
        form=cfg.form if cfg.form is not None else 'auto' if wide else 'input',
        # Never for a run started from a checkpoint, whose function it would change.
        normalize_rows=(cfg.normalize_rows if cfg.normalize_rows is not None else
                        cfg.init_from_hf is None and wide),
        permutation=(cfg.permutation if cfg.permutation is not None else
                     default_permutation(cfg.chunk_size, block, poet_widths(mc))))
  wd = cfg.weight_decay if cfg.weight_decay is not None else (
      recipe.wide_weight_decay if wide else 0.0)
  values = {'lr': lr, 'weight_decay': wd,
            'min_lr_ratio': (cfg.min_lr_ratio if cfg.min_lr_ratio is not None else
                             recipe.min_lr_ratio(mc.hidden)), **poet}
  for k in PINNED if recorded else ():
    if getattr(cfg, k) is None and k in recorded:
      values[k] = recorded[k]
  if recorded is not None and recipe.poetizes and 'permutation' not in recorded:
    values['permutation'] = 'element'  # recorded before the option: element draws
  if recipe.poetizes:
    block = values['block_size']
    ops.check_block_size(block, mc.hidden, getattr(mc, 'expert_inner', mc.mlp),
                         mc.kv_heads * mc.head_dim, what='block_size')
    if values['permutation'] == 'chunk':
      ops.check_chunk_size(cfg.chunk_size, block, what='chunk_size')
    mc = dataclasses.replace(mc, block_size=block)
  every = values['merge_every']
  return Plan(options=cfg, model=mc, recipe=recipe, poetize=recipe.poetizes,
              merge_period=None if every is None else every * cfg.grad_accum,
              dtype=compute_dtype(cfg.dtype), updates=cfg.steps,
              micro_steps=cfg.steps * cfg.grad_accum, **values)


def recorded_plan(out: str | pathlib.Path) -> dict | None:
  """The plan a run directory's ``run.json`` recorded: ``{}`` for a run from
  before plans were recorded (its defaults are the fallbacks of
  :func:`make_plan`), None without ``run.json`` (a run that stopped while
  starting)."""
  path = pathlib.Path(out) / rundir.RUN_FILE
  return rundir.read_run_record(path).get('plan') or {} if path.is_file() else None
