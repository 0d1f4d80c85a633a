"""The optimizer families of ``poetx train --optimizer``: what each trains, how,
and its defaults per model size.

A :class:`Recipe` says whether its runs poetize the model (the linear weights
train as ``R W0 P``: POET-X) and builds its optax transformation from the
run's :class:`~poetx_jax.pretrain.plan.Plan`; the options it reads
(``lean_state``, ``skew_tiers``) are read here and nowhere else; the weight
decay is the plan's (the option, or the recipe's default). Clipping and
gradient accumulation are the same for every family
(:func:`poetx_jax.pretrain.factories.build_optimizer` adds them). Options
marked ``poet`` in the schema (:mod:`~poetx_jax.pretrain.config`) mean
something only to a recipe that poetizes, and are refused with the others.

    tx = RECIPES[plan.options.optimizer].build(plan, model)

Adding a family is its library transformation and one entry of ``RECIPES``.
"""

from __future__ import annotations

import dataclasses
import typing as tp

import jax
import jax.numpy as jnp
import optax
import optax.contrib

import poetx_jax
from poetx_jax.lean import lean_adamw

if tp.TYPE_CHECKING:
  from poetx_jax.pretrain.plan import Plan

# Per-size defaults (docs/quality.md: measured at 130m, where AdamW's best rate
# of 3e-4..2e-3 was 6e-4, normalize_rows helped POET-X, and merges every 200
# updates beat merges every 50; the tiny default trains better with the first
# two off and keeps its merges every 50): from this hidden size, a recipe's
# ``wide_lr`` replaces DEFAULT_LR, normalize_rows is on and merges come every
# WIDE_MERGE_EVERY updates; the POET layers' form is 'auto' there (at 130m the
# weight form's step measured 44.1 ms against the input form's 53.5), 'input'
# below. :func:`poetx_jax.pretrain.plan.make_plan` resolves them.
WIDE_HIDDEN = 512
DEFAULT_LR = 3e-3
ADAMW_WIDE_LR = 6e-4
DEFAULT_MERGE_EVERY = 50
WIDE_MERGE_EVERY = 200
# Muon's best rate at hidden 256 and 512, 2e-3..8e-3 swept at weight decay 0.1
# (docs/quality.md: 5M and 19M at 100 M tokens).
MUON_WIDE_LR = 4e-3
# AdamW's and Muon's default decoupled weight decay on models of hidden size
# >= WIDE_HIDDEN: 0.1 beat 0 for both at every rate compared at hidden 256
# (docs/quality.md, 5M); the tiny default trained worse with it (AdamW 122.82
# against 120.25) and keeps 0, as do POET-X and SkewAdam.
DENSE_WEIGHT_DECAY = 0.1
# The final/peak learning-rate ratio of the cosine schedule where
# --min-lr-ratio leaves it open: for POET-X and POET-X Muon on models of
# hidden size >= POETX_LOW_MIN_LR_HIDDEN 0.01, the reference recipe's. POET-X
# ended below its 0.1 runs with it at 5M, 19M and 130M parameters (hidden 256,
# 512, 768) at 100 M tokens, POET-X Muon at 5M and 19M (not run at 130M), each
# by more than the seed spread (three seeds at 130M, two at 5M and 19M:
# docs/results/paper-baseline). 0.1 below, where the tiny default (hidden 64,
# 600 updates) ended worse with 0.01 (docs/training.md), and for the others,
# whose rates were swept at 0.1.
DEFAULT_MIN_LR_RATIO = 0.1
POETX_MIN_LR_RATIO = 0.01
POETX_LOW_MIN_LR_HIDDEN = 256


def poetx_min_lr_ratio(hidden: int) -> float:
  """POET-X's and POET-X Muon's default final/peak rate ratio on a model of
  ``hidden`` features."""
  return POETX_MIN_LR_RATIO if hidden >= POETX_LOW_MIN_LR_HIDDEN else DEFAULT_MIN_LR_RATIO


# --permutation left open draws chunk permutations on a GPU when a feature
# keeps at most this share of its block-mates across merges, (c - 1) / (B - 1)
# for runs of c features in blocks of B: runs of 16 in blocks of 512 (2.9%)
# trained within the seed spread of the element draw where measured (19M, two
# seeds; 130M, three seeds on a quarter budget), runs of 8 in blocks of 32
# (22.6%) worse on every seed of a CPU study, runs of 4 there (9.7%) within
# its noise (docs/results/chunk-permutations). plan.default_permutation
# resolves it.
CHUNK_MAX_KEPT = 0.1


@dataclasses.dataclass(frozen=True)
class Recipe:
  """An optimizer family.

  Attributes:
    name: the ``--optimizer`` value.
    poetizes: its runs convert the model's linear layers to POET layers.
    build: ``build(plan, model) -> optax.GradientTransformation`` over the
      model's ``nnx.Param`` s, before clipping and accumulation.
    help: one line for ``--help``.
    wide_lr: the default peak learning rate on models of hidden size >=
      WIDE_HIDDEN (None: DEFAULT_LR at every size).
    wide_weight_decay: the default decoupled weight decay (``--weight-decay``)
      on models of hidden size >= WIDE_HIDDEN (0 below).
    unused: options of the POET layers this family does not read; given
      other than their defaults, they are refused.
    poet_lr: the default POET step size for a block size (a recipe that
      poetizes; ``poetx_jax.default_poet_lr`` unless it names its own).
    min_lr_ratio: the default final/peak learning-rate ratio of its schedules
      on a model of a hidden size.
  """
  name: str
  poetizes: bool
  build: tp.Callable[['Plan', tp.Any], optax.GradientTransformation]
  help: str
  wide_lr: float | None = None
  wide_weight_decay: float = 0.0
  unused: tuple[str, ...] = ()
  poet_lr: tp.Callable[[int], float] = poetx_jax.default_poet_lr
  min_lr_ratio: tp.Callable[[int], float] = lambda hidden: DEFAULT_MIN_LR_RATIO  # noqa: E731


def _dense_adamw(plan: 'Plan') -> optax.GradientTransformation:
  """AdamW at the run's learning rate, lean (bf16 first moment, factored
  second moments) with ``lean_state``."""
  if plan.options.lean_state:
    return lean_adamw(plan.lr_schedule, weight_decay=plan.weight_decay)
  return optax.adamw(plan.lr_schedule, b1=0.9, b2=0.999, weight_decay=plan.weight_decay)


def _poetx(plan: 'Plan', model) -> optax.GradientTransformation:
  """POET-X for the generators (a bf16 first moment and one second moment
  per block with ``lean_state``); AdamW, or SkewAdam's tiers with
  ``skew_tiers``, for the other parameters."""
  o = plan.options
  lean = dict(mu_dtype=jnp.bfloat16, second_moment='block') if o.lean_state else {}
  poet = poetx_jax.poetx(plan.poet_lr_schedule, merge_every=plan.merge_every,
                         eps=o.poet_eps, eps_placement=o.poet_eps_placement, **lean)
  if o.skew_tiers:
    return poetx_jax.poetx_skewadam(model, poet, plan.lr_schedule,
                                    weight_decay=plan.weight_decay)
  return poetx_jax.poetx_partition(model, poet, _dense_adamw(plan))


def _poetx_muon(plan: 'Plan', model) -> optax.GradientTransformation:
  """POET-X with Muon's orthogonalised updates on the generators (a bf16
  momentum with ``lean_state``); AdamW, or SkewAdam's tiers, for the rest."""
  o = plan.options
  poet = poetx_jax.poetx_muon(plan.poet_lr_schedule, merge_every=plan.merge_every,
                              mu_dtype=jnp.bfloat16 if o.lean_state else None)
  if o.skew_tiers:
    return poetx_jax.poetx_skewadam(model, poet, plan.lr_schedule,
                                    weight_decay=plan.weight_decay)
  return poetx_jax.poetx_partition(model, poet, _dense_adamw(plan))


def _adamw(plan: 'Plan', model) -> optax.GradientTransformation:
  del model
  return _dense_adamw(plan)


def _skewadam(plan: 'Plan', model) -> optax.GradientTransformation:
  return poetx_jax.skewadam(plan.lr_schedule, poetx_jax.skewadam_labels(model, poet=False),
                            weight_decay=plan.weight_decay)


# Muon's updates rescaled to AdamW's RMS (0.2 * sqrt(max(fan_in, fan_out)),
# as Moonlight does): one learning rate serves the matrices and the rest.
MUON_CONSISTENT_RMS = 0.2


def _muon_dimensions(params):
  """Muon's dimension numbers for ``params``: the decoder layers' linear
  kernels (``(in, out)``, or ``(layers, in, out)`` stacked: the layer axis a
  batch axis) are orthogonalised; the embeddings, norms and head (None) go
  to AdamW, as optax.contrib.muon intends."""
  def dims(path, x):
    keys = [str(getattr(k, 'key', getattr(k, 'name', k))) for k in path]
    if 'layers' not in keys or keys[-1] not in ('kernel', 'value') or x.ndim < 2:
      return None
    if keys[-1] == 'value' and (len(keys) < 2 or keys[-2] != 'kernel'):
      return None
    return optax.contrib.MuonDimensionNumbers(reduction_axis=x.ndim - 2,
                                              output_axis=x.ndim - 1)
  return jax.tree_util.tree_map_with_path(dims, params)


def _muon(plan: 'Plan', model) -> optax.GradientTransformation:
  """optax.contrib.muon on the decoder layers' matrices (Nesterov momentum,
  bf16 with ``lean_state``), AdamW on the rest; both at the run's rate."""
  del model
  wd = plan.weight_decay
  return optax.contrib.muon(
      plan.lr_schedule, weight_decay=wd, adam_weight_decay=wd,
      mu_dtype=jnp.bfloat16 if plan.options.lean_state else None,
      consistent_rms=MUON_CONSISTENT_RMS,
      muon_weight_dimension_numbers=_muon_dimensions)


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe('poetx', True, _poetx, 'POET-X: the linear weights train as R W0 P',
           min_lr_ratio=poetx_min_lr_ratio),
    Recipe('poetx-muon', True, _poetx_muon, 'POET-X with Muon\'s orthogonalised updates on '
           'the skew generators (Newton-Schulz on each block\'s momentum)',
           unused=('poet_eps', 'poet_eps_placement'), poet_lr=poetx_jax.default_poet_muon_lr,
           min_lr_ratio=poetx_min_lr_ratio),
    Recipe('adamw', False, _adamw, 'AdamW, the dense-weight baseline',
           wide_lr=ADAMW_WIDE_LR, wide_weight_decay=DENSE_WEIGHT_DECAY),
    Recipe('muon', False, _muon, 'Muon (optax.contrib.muon) on the decoder layers\' matrices, '
           'AdamW on the embeddings, norms and head', wide_lr=MUON_WIDE_LR,
           wide_weight_decay=DENSE_WEIGHT_DECAY),
    Recipe('skewadam', False, _skewadam,
           'SkewAdam: per-population state for mixture-of-experts models'),
)}
