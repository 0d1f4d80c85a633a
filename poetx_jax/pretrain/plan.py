"""A run's plan: its options finished and every default resolved, in one place.

The options (:class:`~poetx_jax.pretrain.config.TrainConfig`) come from the
command line, a config file, a resumed run's ``run.json``, a checkpoint to
start from (``--init-from-hf``: its tokenizer) and a prepared dataset (its
vocabulary); :func:`command_options` and :func:`finish_options` finish them.
:func:`make_plan` then resolves what an option left open (None) for the model
the run trains, into a frozen :class:`Plan`: the model config, whether it is
poetized, the learning rates and their schedules, the POET block size, step,
merge interval (in updates and micro-steps), layer form, row normalisation
and permutation draw, the compute dtype. Everything downstream (the model and
optimizer factories, the loop and its hooks, tracking, evaluation, export,
the experiments) reads the plan and resolves nothing again; ``run.json``
records it beside the options (:meth:`Plan.record`), and a resumed run (or
``poetx eval``, ``poetx export``) keeps the values it recorded::

    cfg = finish_options(TrainConfig(model='130m'), resume=False)
    plan = make_plan(cfg, vocab_size=32000)
    plan.lr, plan.poet_lr, plan.merge_every, plan.block_size, plan.form
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import typing as tp

import jax
import optax

import poetx_jax
from poetx_jax import models, ops
from poetx_jax.models.llama import LlamaConfig
from poetx_jax.pretrain import hf_init, processes, rundir
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.data import mixture, shards
from poetx_jax.pretrain.recipes import (CHUNK_MAX_KEPT, DEFAULT_LR, DEFAULT_MERGE_EVERY, RECIPES,
                                        WIDE_HIDDEN, WIDE_MERGE_EVERY, Recipe)

# What a plan resolves that a resumed run keeps as recorded (Plan.record):
# the training defaults, not the compute dtype, which follows the machine.
PINNED = ('lr', 'weight_decay', 'poet_lr', 'merge_every', 'block_size', 'form',
          'normalize_rows', 'permutation')


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
                                              end_value=peak * o.min_lr_ratio)

  @property
  def lr_schedule(self) -> optax.Schedule:
    return self.schedule(self.lr)

  @property
  def poet_lr_schedule(self) -> optax.Schedule | None:
    return None if self.poet_lr is None else self.schedule(self.poet_lr)

  def record(self) -> dict:
    """The resolved values as JSON (``run.json``'s ``plan``)."""
    return {'poetize': self.poetize, 'lr': self.lr, 'weight_decay': self.weight_decay,
            'poet_lr': self.poet_lr,
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
    block = cfg.block_size if cfg.block_size is not None else mc.block_size
    poet = dict(
        block_size=block,
        poet_lr=cfg.poet_lr if cfg.poet_lr is not None else poetx_jax.default_poet_lr(block),
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
  values = {'lr': lr, 'weight_decay': wd, **poet}
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


# ----------------------------------------------------------------- finishing the options


def default_out_dir(cfg: TrainConfig) -> str:
  """``cfg.out_dir`` (a leading ``~`` expanded), or ``runs/MODEL-OPTIMIZER``
  when it is None (MODEL: the name of the ``init_from_hf`` directory where
  the run starts from one)."""
  model = ((pathlib.Path(cfg.init_from_hf).resolve().name or 'hf') if cfg.init_from_hf
           else cfg.model)
  return os.path.expanduser(cfg.out_dir) if cfg.out_dir else f'runs/{model}-{cfg.optimizer}'


def prepared_vocab_size(cfg: TrainConfig) -> int | None:
  """The vocabulary of the prepared dataset whose tokenizer the run uses (the
  first prepared directory ``cfg.data``, then ``cfg.val_data``, names: its
  manifest's), or None."""
  prepared = _first_prepared(cfg)
  return None if prepared is None else prepared[1]


def _first_prepared(cfg: TrainConfig) -> tuple[str, int] | None:
  """(path, vocabulary) of the first prepared dataset directory of
  ``cfg.data`` and then ``cfg.val_data``, or None where they name none (or its
  manifest is unreadable, or the weights are bad: reading the data says why)."""
  try:
    paths = [p for p, _ in mixture.parse_data([*(cfg.data or ()), *(cfg.val_data or ())])]
  except ValueError:
    return None
  prepared = [p for p in paths if shards.is_prepared(p)]
  if not prepared:
    return None
  try:
    return prepared[0], int(json.loads((pathlib.Path(prepared[0]) / shards.MANIFEST)
                                       .read_text())['vocab_size'])
  except (OSError, ValueError, KeyError, TypeError):
    return None


def resolve_paths(cfg: TrainConfig) -> TrainConfig:
  """``cfg`` with its data, validation data, tokenizer and starting checkpoint
  made absolute paths, a leading ``~`` expanded to the home directory (as a
  shell does for a flag's own word but not for ``--flag=~/...`` or a config
  file's value), so that ``run.json`` names them wherever the run is later
  evaluated or resumed from (the run directory's ``~``:
  :func:`default_out_dir`). The caches keep their ``~`` (portable in
  ``run.json``) and expand it where they are opened."""
  def one(path):
    return None if path is None else rundir.absolute_path(path)
  return dataclasses.replace(
      cfg, tokenizer=one(cfg.tokenizer), init_from_hf=one(cfg.init_from_hf),
      data=None if cfg.data is None else [one(d) for d in cfg.data],
      val_data=None if cfg.val_data is None else [one(d) for d in cfg.val_data])


def finish_options(cfg: TrainConfig, *, resume: bool,
                   device_count: int | None = None) -> TrainConfig:
  """``cfg`` checked (``validate``, with ``device_count``) and finished: its
  paths made absolute (:func:`resolve_paths`), its run directory named; for a
  fresh run the vocabulary of the prepared dataset it trains on, or else the
  tokenizer file it uses (:func:`given_tokenizer`) and its vocabulary, so
  that ``run.json`` records the tokenizer and vocabulary used."""
  cfg = resolve_paths(cfg)
  cfg.validate(device_count=device_count)
  cfg = dataclasses.replace(cfg, out_dir=default_out_dir(cfg))
  if resume:
    return cfg
  # What can be checked before the corpus is read (its tokenizer may take minutes):
  if cfg.init_from_hf is None:
    mc = models.get_config(cfg.model, **cfg.model_overrides)
    if RECIPES[cfg.optimizer].poetizes and cfg.permutation == 'chunk':
      ops.check_chunk_size(cfg.chunk_size, cfg.block_size or mc.block_size, what='chunk_size')
  elif not (pathlib.Path(cfg.init_from_hf) / 'config.json').is_file():
    raise ValueError(f'{cfg.init_from_hf} is not a Hugging Face model directory: it has no '
                     f'config.json')
  vocab = prepared_vocab_size(cfg)
  if vocab is not None:
    return dataclasses.replace(cfg, vocab_size=vocab)
  tokenizer = given_tokenizer(cfg)
  if tokenizer is None:
    return cfg
  return dataclasses.replace(cfg, tokenizer=tokenizer, vocab_size=tokenizer_vocab(tokenizer))


def given_tokenizer(cfg: TrainConfig) -> str | None:
  """The tokenizer file a fresh run of ``cfg`` uses instead of training a
  BPE: ``cfg.tokenizer``, else that of the checkpoint it starts from (the
  first of ``hf_init.TOKENIZERS`` there), else None."""
  if cfg.tokenizer is not None:
    return rundir.absolute_path(cfg.tokenizer)
  if cfg.init_from_hf is not None:
    for name in hf_init.TOKENIZERS:
      path = pathlib.Path(rundir.absolute_path(cfg.init_from_hf)) / name
      if path.is_file():
        return str(path)
  return None


def tokenizer_vocab(path: str) -> int:
  """The vocabulary of the tokenizer file ``path``."""
  from poetx_jax.pretrain.data.tokenizer import Tokenizer
  return Tokenizer.load(path).vocab_size


def command_options(cfg: TrainConfig, given: tp.Iterable[str], *,
                    config_file: str | None = None, resume: bool = False,
                    device_count: int | None = None, log=print) -> TrainConfig:
  """The options of a ``poetx train`` command: ``cfg`` (its flags with
  TrainConfig's defaults), of which ``given`` were on the command line, set
  over a ``config_file``'s options, or with ``resume`` over the run's
  ``run.json`` (:func:`resumed_options`). Raises ValueError for a config file
  with ``resume``, and for a ``--vocab-size`` that the prepared dataset or
  the tokenizer file the run uses contradicts."""
  given = set(given)
  if config_file is not None:
    if resume:
      raise ValueError('--config does not go with --resume: a resumed run reads its own '
                       'run.json (options given with --resume must agree with it)')
    from poetx_jax.pretrain.config_text import config_with_file, read_config_file
    fields = {f.name for f in dataclasses.fields(TrainConfig)} & given
    cfg = config_with_file(config_file, {k: getattr(cfg, k) for k in fields})
    given |= set(read_config_file(config_file))
  if resume:
    return resumed_options(cfg, given, device_count=device_count, log=log)
  if 'vocab_size' not in given:
    return cfg
  path, vocab = _first_prepared(cfg) or (None, None)
  if vocab is not None and vocab != cfg.vocab_size:
    raise ValueError(f'--vocab-size {cfg.vocab_size} disagrees with the prepared dataset '
                     f'{path}, whose tokenizer has a vocabulary of {vocab} (the run '
                     f'tokenizes all its data with it): leave --vocab-size out (the run '
                     f'records {vocab}), or prepare the corpus again with --vocab-size '
                     f'{cfg.vocab_size}')
  tokenizer = given_tokenizer(cfg) if vocab is None else None
  if tokenizer is not None and pathlib.Path(tokenizer).is_file():
    vocab = tokenizer_vocab(tokenizer)
    if vocab != cfg.vocab_size:
      raise ValueError(f'--vocab-size {cfg.vocab_size} disagrees with the tokenizer '
                       f'{tokenizer}, whose vocabulary is {vocab} (the run tokenizes its '
                       f'data with it): leave --vocab-size out (the run records {vocab})')
  return cfg


def resumed_options(cfg: TrainConfig, given: tp.Iterable[str], *,
                    device_count: int | None = None, log=print) -> TrainConfig:
  """What ``poetx train --resume`` continues: the run's ``run.json`` with the
  options ``given`` on the command line taken from ``cfg`` (the run
  directory then checks they agree with it) and the run directory where it
  is now.

  With ``device_count``, a saved ``fsdp`` (not given again) that does not
  divide it becomes the largest that does and is not above it, with a log
  line saying so (a run sharded over 2 devices resumes on 1, on 3 ...);
  ``--fsdp`` given chooses instead."""
  out = pathlib.Path(default_out_dir(cfg))
  rundir.saved_run(out)  # refuses a directory that holds no run
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  given = set(given) & fields
  resumed = dataclasses.replace(rundir.read_config(out), out_dir=str(out),
                                **{k: getattr(cfg, k) for k in given - {'out_dir'}})
  n, saved = device_count, resumed.fsdp
  if n is None or 'fsdp' in given or n % saved == 0:
    return resumed
  fsdp = max(d for d in range(1, min(saved, n) + 1) if n % d == 0)
  if processes.is_primary():
    log(f'--resume: the run\'s fsdp={saved} does not divide the {n} device(s) present: '
        f'continuing with fsdp={fsdp} (the layout may change on resume; --fsdp N '
        f'chooses another)')
  return dataclasses.replace(resumed, fsdp=fsdp)


def recorded_plan(out: str | pathlib.Path) -> dict | None:
  """The plan a run directory's ``run.json`` recorded: ``{}`` for a run from
  before plans were recorded (its defaults are the fallbacks of
  :func:`make_plan`), None without ``run.json`` (a run that stopped while
  starting)."""
  path = pathlib.Path(out) / rundir.RUN_FILE
  return rundir.read_run_record(path).get('plan') or {} if path.is_file() else None
