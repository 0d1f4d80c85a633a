"""The run options of ``poetx train``: one schema for the code, the checks and the CLI.

:class:`TrainConfig` holds everything a run needs and is saved as ``run.json``
in the run directory. Each field carries, in its ``dataclasses.field``
metadata, its help text (``'help'``), its valid values (``'choices'``), its
bounds (``'min'``/``'max'`` inclusive, ``'gt'``/``'lt'`` exclusive) and, for an
optional field, what None means (``'none'``). :meth:`TrainConfig.validate`
checks every field against that metadata (plus a few rules across fields),
and :func:`add_options` generates the ``poetx train`` flags from it::

    parser = argparse.ArgumentParser()
    add_options(parser)
    cfg = config_from_args(parser.parse_args(['--steps', '10']))
    cfg.validate()

The options marked ``poet`` mean something only to an optimizer whose recipe
poetizes the model (:mod:`~poetx_jax.pretrain.recipes`): set with another,
they are refused. An experiment builds its parser the same way, with defaults
of its own (``add_options(parser, overrides={'model': '60m'})``), and
describes each run by ``K=V`` overrides of the same fields
(:func:`poetx_jax.pretrain.config_text.apply_overrides`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import typing as tp

from poetx_jax import linear, models, ops, optim, sharding
from poetx_jax.models import llama
from poetx_jax.pretrain.kv import parse_overrides
from poetx_jax.pretrain.data.tokenizer import MAX_BPE_VOCAB, MIN_BPE_VOCAB
from poetx_jax.pretrain.recipes import (ADAMW_WIDE_LR, CHUNK_MAX_KEPT, DEFAULT_LR,
                                        DEFAULT_MERGE_EVERY, DEFAULT_MIN_LR_RATIO,
                                        DENSE_WEIGHT_DECAY, MUON_WIDE_LR, POETX_LOW_MIN_LR_HIDDEN,
                                        POETX_MIN_LR_RATIO, RECIPES, WIDE_HIDDEN,
                                        WIDE_MERGE_EVERY)

OPTIMIZERS = tuple(RECIPES)
DTYPES = ('float32', 'bfloat16')
TRACKERS = ('tensorboard', 'wandb')
# clip_ramp applies during these first updates, as the published POET-X's does.
CLIP_RAMP_UNTIL = 2000
# The key of run.json that records the run's resolved plan beside its options.
PLAN_KEY = 'plan'
# The largest value of a count or interval option: the optimizers count their
# updates in int32 on the device, optax's schedules compare the update count
# with the warmup as int32, and the POET-X merge cycle is an int32 counter.
INT32_MAX = 2 ** 31 - 1


def _option(default: tp.Any, help: str, **metadata) -> tp.Any:  # pylint: disable=redefined-builtin
  """A config field: its default (a list or dict is copied per instance) and metadata."""
  metadata['help'] = help
  if isinstance(default, (list, dict)):
    return dataclasses.field(default_factory=lambda: type(default)(default),
                             metadata=metadata)
  return dataclasses.field(default=default, metadata=metadata)


def _count(default: int, help: str, **metadata) -> tp.Any:  # pylint: disable=redefined-builtin
  """An int option in [1, INT32_MAX] (other bounds given in ``metadata``)."""
  return _option(default, help, **{'min': 1, 'max': INT32_MAX, **metadata})


def _poet(default: tp.Any, help: str, **metadata) -> tp.Any:  # pylint: disable=redefined-builtin
  """An option of the POET layers or their optimizer: refused, when set to
  anything but its default, with an optimizer whose recipe does not poetize."""
  return _option(default, help, poet=True, **metadata)


@dataclasses.dataclass
class TrainConfig:
  """Everything a run needs; saved as ``run.json`` in the run directory."""
  model: str = _option('tiny', 'named Llama or mixture-of-experts Llama config',
                       choices=tuple(models.CONFIGS),
                       cli_choices=False)
  model_overrides: dict = _option(
      {}, 'override config fields, e.g. layers=4,hidden=128', metavar='K=V,...',
      parse=parse_overrides)
  init_from_hf: str | None = _option(
      None, 'start from a Hugging Face LlamaForCausalLM directory (config.json and '
      'safetensors): the model is its config.json (--model and --model-overrides, where '
      'given, must agree; block_size may be set), the step-0 weights its own (poetized '
      'for POET-X); without --tokenizer the run uses its tokenizer',
      none='random weights', metavar='DIR')
  data: list[str] | None = _option(
      None, 'text files or folders (.txt .md .rst .py .jsonl .jsonl.gz .json.gz .jsonl.zst '
      '.parquet) read as one corpus, or a prepared dataset directory; PATH:W for each: a '
      'mixture, drawn in the proportion of the weights W', none='the built-in corpus',
      metavar='PATH')
  val_data: list[str] | None = _option(
      None, 'validation text files or folders, or a prepared dataset directory: the data '
      'then trains whole (val_fraction unused)', none='the last val_fraction of each --data '
      'source', metavar='PATH')
  tokenizer: str | None = _option(
      None, 'tokenizer file (HF tokenizers JSON or sentencepiece .model)',
      none='a BPE trained on the corpus')
  vocab_size: int = _option(4096, 'vocabulary of the trained BPE', min=MIN_BPE_VOCAB,
                            max=MAX_BPE_VOCAB)
  seq_len: int = _count(128, 'tokens per sequence')
  batch_size: int = _count(16, 'sequences per micro-batch')
  grad_accum: int = _count(1, 'micro-batches per optimizer update, their gradients summed '
                           'in one compiled update (under --strategy dp, averaged across '
                           'devices once an update); the cadences counted in micro-steps '
                           'act after the update that reaches them')
  steps: int = _count(600, 'optimizer updates')
  optimizer: str = _option('poetx-muon',
                           '; '.join(f'{r.name}: {r.help}' for r in RECIPES.values()),
                           choices=OPTIMIZERS)
  lr: float | None = _option(
      None, 'peak learning rate of AdamW, Muon, SkewAdam (and of the non-POET parameters)',
      min=0,
      none=f'{DEFAULT_LR:g}; on a model of hidden size >= {WIDE_HIDDEN}, AdamW '
           f'{ADAMW_WIDE_LR:g} and Muon {MUON_WIDE_LR:g}, the bests of the sweeps in '
           'docs/quality.md')
  poet_lr: float | None = _poet(None, 'peak POET-X step size', gt=0,
                                  none='poetx-muon: min(5e-3, 0.25 / min(block size, 256)); '
                                       'poetx: min(5e-3, 0.25 / block size), in the 130m '
                                       'sweep (docs/quality.md) twice it trained better '
                                       'short-term but broke the series (merge errors up to 3.9)')
  warmup: int = _option(30, 'warmup updates', min=0, max=INT32_MAX)
  min_lr_ratio: float | None = _option(
      None, 'final/peak learning rate', min=0, max=1,
      none=f'{POETX_MIN_LR_RATIO:g} for poetx and poetx-muon on a model of hidden size >= '
           f'{POETX_LOW_MIN_LR_HIDDEN}, {DEFAULT_MIN_LR_RATIO:g} below and for the others')
  weight_decay: float | None = _option(
      None, 'decoupled weight decay of AdamW, Muon, SkewAdam (and of the non-POET parameters)',
      min=0, none=f'{DENSE_WEIGHT_DECAY:g} for AdamW and Muon on a model of hidden size >= '
                  f'{WIDE_HIDDEN} (better than 0 at every rate compared in docs/quality.md), '
                  '0 below and for POET-X and SkewAdam')
  clip: float = _option(1.0, 'global-norm clip (0: off)', min=0)
  clip_ramp: int = _poet(
      0, 'POET-X: after each merge, clip to 0.1 x --clip and ramp the bound back over N '
      f'updates, during the first {CLIP_RAMP_UNTIL} updates (the published POET-X\'s '
      'merge-aware clip; 0: plain clipping)', min=0, max=INT32_MAX)
  poet_eps: float = _poet(1e-8, 'POET-X Adam denominator offset (the published POET-X: 1e-6)',
                          gt=0)
  poet_eps_placement: str = _poet(
      'corrected', "where POET-X adds --poet-eps: to the bias-corrected root of the second "
      "moment (optax's Adam) or to the raw root, before the bias correction (the published "
      'POET-X)', choices=optim.EPS_PLACEMENTS)
  merge_every: int | None = _poet(
      None, 'POET-X merge interval in updates', min=1, max=INT32_MAX,
      none=f'{DEFAULT_MERGE_EVERY}; {WIDE_MERGE_EVERY} on a model of hidden size >= '
           f'{WIDE_HIDDEN}, better than {DEFAULT_MERGE_EVERY} in the 130m sweep in '
           'docs/quality.md')
  block_size: int | None = _poet(None, 'POET block size', min=2, max=INT32_MAX,
                                 none="the model config's")
  max_generator_norm: float | None = _poet(
      None, "POET-X: cap each block generator's spectral norm (an upper bound of it) so "
      'the Cayley–Neumann series stays in its region of convergence whatever the step',
      gt=0, lt=1, none='no cap')
  normalize_rows: bool | None = _poet(
      None, 'POET-X: scale each output row of every converted weight to unit norm at '
      'conversion (the published POET-X does; the spectrum POET-X then keeps)',
      none=f'on for a fresh model of hidden size >= {WIDE_HIDDEN} (60m and '
           'up; it decided POET-X\'s quality in the 130m study, docs/quality.md), off for '
           'smaller ones and with --init-from-hf')
  tie_permutations: bool = _poet(
      False, "POET-X: one permutation for a decoder layer's q/k/v inputs, one for its "
      'gate/up inputs and one for the gate/up outputs and down input (a mixture-of-experts '
      'layer: the q/k/v inputs only); fewer activation gathers, and not the published '
      'POET-X, which draws each independently')
  permutation: str | None = _poet(
      None, 'how the POET permutations are drawn, at the start and at every merge: element '
      '(a uniformly random permutation of the features, the published POET-X) or chunk (a '
      'uniformly random permutation of aligned runs of --chunk-size features, each block '
      'made of whole runs: the same training, since only which features share a block '
      'matters, with gathers that move whole runs)', choices=ops.PERMUTATIONS,
      none=f'chunk on a GPU where --chunk-size divides the block size and the widths and '
      f'every block keeps at most {CHUNK_MAX_KEPT:.0%} of a feature\'s block-mates across '
      f'merges ((chunk - 1) / (block - 1): 2.9% at 16 and 512), element elsewhere')
  chunk_size: int = _poet(16, 'features per run of --permutation chunk; must divide the '
                          'block size (16 bf16 features fill one 32-byte memory sector)',
                          min=1, max=INT32_MAX)
  mode: str = _poet('fast', 'POET-X fast (keeps activations) or mem (recomputes)',
                      choices=linear.MODES)
  form: str | None = _poet(
      None, 'POET layer product order: rotate the activations (input) or the frozen weight '
      '(weight), or per layer the one of fewer FLOPs (auto: weight for narrow layers); '
      'same function', choices=ops.FORMS,
      none=f'auto on a model of hidden size >= {WIDE_HIDDEN} (at 130m the weight form\'s '
           'step is 18% shorter, BENCHMARKS.md), input below')
  implementation: str = _poet(
      'auto', "POET layers' gathers and block products: auto (on GPUs each side's gather "
      'fused into its block products by the Pallas kernels where they measured faster, '
      'XLA elsewhere; XLA off GPUs), xla, or pallas (the block products on the Mosaic GPU '
      'kernels: Hopper, 16-bit activations, block size a multiple of 64, <= 512), or fused '
      '(the fused kernels on every 16-bit side; block size a power of two, 16 to 512)',
      choices=linear.IMPLEMENTATIONS)
  norm_gathers: bool = _poet(
      False, 'the RMSNorms before the q/k/v and gate/up projections write their outputs in '
      'those POET layers\' input orders (their input gathers moved into the norms: one '
      'pass over the activations fewer; the same values, gradients summed in another '
      'order)')
  remat: str = _option('none', 'rematerialise each decoder layer: keep only its input '
                       '(block), its input in pinned host memory (offload), or its input '
                       'and attention output (attn)',
                       choices=tuple(llama.REMAT_POLICIES))
  loss_chunk: int = _option(0, 'the head and loss of a train step this many sequence '
                            'positions at a time, each piece\'s backward with it: the '
                            '(batch, seq, vocab) float32 logits are never held, the same loss '
                            'and gradients; 0: the whole micro-batch at once; at most '
                            '--seq-len', min=0, max=INT32_MAX)
  memory_slop: int | None = _option(
      None, "XLA's memory target for the train step on a GPU, in percent of 80% of the "
      "device's memory less the step's inputs and outputs "
      '(xla_gpu_memory_limit_slop_factor); under a target the step can meet, XLA '
      'schedules and rematerialises for memory: e.g. 6 for Llama-8B on one H200 allocates '
      'zero-filled gradient buffers only when their backward starts', min=1, max=100,
      none="XLA's default, 95")
  attention: str = _option('auto', "attention kernel: cuDNN's fused attention or XLA's; "
                           'auto: cuDNN on GPUs for 16-bit compute', choices=llama.ATTENTION)
  scan_layers: bool = _option(False, 'store the decoder layers stacked and run them with '
                              'lax.scan: compile time independent of depth (for large models)')
  quantize: str | None = _poet(None, 'POET-XQ: store the frozen base weights in int8 or '
                                 'int4', choices=tuple(ops.QUANT_BITS),
                                 none='full-precision bases')
  group_size: int = _poet(128, 'POET-XQ rows per quantisation group', min=1, max=INT32_MAX)
  generator_dtype: str = _poet('float32', 'dtype of the POET generators, so of their '
                               'gradients and Adam moments: bfloat16 halves all three (the '
                               "published POET-X's precision; the rotations are computed in "
                               'float32 either way)', choices=linear.GENERATOR_DTYPES)
  lean_state: bool = _option(False, 'bf16 momenta; factored second moments for the non-POET '
                             'parameters (embeddings, head, norms; all of them for AdamW) and '
                             'one second moment per block for the POET generators')
  skew_tiers: bool = _poet(False, 'POET-X: SkewAdam tiers for the parameters it does '
                             'not rotate (routers Adam; norms a float32 momentum; '
                             'embeddings and head factored second moments only)')
  strategy: str = _option('dp', 'on several devices: replicate the state (dp) or shard it '
                          '(fsdp)', choices=sharding.STRATEGIES)
  fsdp: int = _count(1, 'size of the mesh axis that shards state (strategy fsdp); must '
                     'divide the device count (--resume: may change, like --strategy)')
  dtype: str = _option('auto', 'compute dtype; auto: bfloat16 on GPU, float32 elsewhere',
                       choices=('auto',) + DTYPES)
  param_dtype: str = _option('float32', 'dtype of the weights (the POET generators\': '
                             'generator_dtype)', choices=DTYPES)
  # jax.random.key takes an int64; the permutations use seed + 1.
  seed: int = _option(0, 'seed of model, permutations and data order', min=0,
                      max=2 ** 63 - 2)
  val_fraction: float = _option(0.05, 'share of tokens held out for validation', gt=0, lt=1)
  eval_every: int = _count(100, 'validate every N micro-steps')
  eval_batches: int = _count(20, 'validation batches per evaluation')
  log_every: int = _count(10, 'log every N micro-steps')
  checkpoint_every: int = _count(100, 'checkpoint every N micro-steps')
  tracking: list[str] = _option([], 'also send the metrics to TensorBoard (event files in '
                                'OUT_DIR/tensorboard) and/or Weights & Biases (needs wandb)',
                                choices=TRACKERS)
  profile_steps: str | None = _option(None, 'write a jax.profiler trace of micro-steps A to B '
                                      '(from 1, inclusive) to OUT_DIR/profile', metavar='A:B',
                                      none='no trace')
  keep: int = _count(3, 'checkpoints kept')
  out_dir: str | None = _option(None, 'run directory', none='runs/MODEL-OPTIMIZER')
  cache_dir: str = _option('~/.cache/poetx_jax', 'tokenizer and token cache')
  compile_cache: str = _option(
      '~/.cache/poetx_jax/xla', 'persistent XLA compilation cache: a resumed or repeated '
      'run loads its compiled programs instead of compiling them again; "" turns it off '
      '(a cache the process already set, e.g. by JAX_COMPILATION_CACHE_DIR, is kept)')

  def validate(self, *, device_count: int | None = None) -> None:
    """Raises ValueError naming the first option that cannot be honoured.

    Args:
      device_count: the devices the run will use; when given, ``fsdp`` must
        divide it.
    """
    check_fields({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
    twice = sorted({t for t in self.tracking if self.tracking.count(t) > 1})
    if twice:
      raise ValueError(f'tracking names {", ".join(twice)} twice (each tracker once)')
    for name in ('out_dir', 'cache_dir', 'tokenizer', 'init_from_hf', 'data', 'val_data'):
      value = getattr(self, name)
      if value == '' or (isinstance(value, list) and '' in value):
        raise ValueError(f'{name}: an empty path (""); name a file or directory, or leave '
                         f'the option out')
    if 'block_size' in self.model_overrides:
      raise ValueError(f"model_overrides sets block_size={self.model_overrides['block_size']!r}: "
                       f'the POET block size is its own option, block_size (--block-size N)')
    if 'vocab_size' in self.model_overrides:
      raise ValueError(f"model_overrides sets vocab_size={self.model_overrides['vocab_size']!r}: "
                       f'the vocabulary is the tokenizer\'s (vocab_size, --vocab-size N, '
                       f'sizes the BPE a run trains)')
    # A POET option given with an optimizer that does not poetize is refused
    # unless it says what the dense run does anyway: its default, or a POET
    # switch turned off (--no-normalize-rows as --no-tie-permutations).
    poet = [f'{f.name}={getattr(self, f.name)!r}' for f in dataclasses.fields(self)
            if f.metadata.get('poet') and getattr(self, f.name) != f.default
            and not (getattr(self, f.name) is False and f.default in (None, False))]
    if poet and not RECIPES[self.optimizer].poetizes:
      which = ' or '.join(r.name for r in RECIPES.values() if r.poetizes)
      raise ValueError(f'{", ".join(poet)}: option{"s" if len(poet) > 1 else ""} of the POET '
                       f'layers, and optimizer {self.optimizer!r} does not poetize the model '
                       f'(it trains the dense weights): leave {"them" if len(poet) > 1 else "it"}'
                       f' out, or use optimizer {which}')
    unused = [f'{n}={getattr(self, n)!r}' for n in RECIPES[self.optimizer].unused
              if getattr(self, n) != self.__dataclass_fields__[n].default]
    if unused:
      raise ValueError(f'{", ".join(unused)}: optimizer {self.optimizer!r} does not use '
                       f'{"them" if len(unused) > 1 else "it"} (it keeps no Adam second moment '
                       f'for the generators): leave {"them" if len(unused) > 1 else "it"} out')
    if self.loss_chunk > self.seq_len:
      raise ValueError(f'loss_chunk={self.loss_chunk} is more than the seq_len={self.seq_len} '
                       f'positions of a sequence: give at most {self.seq_len}, or 0 for the '
                       f'whole micro-batch at once')
    if self.clip_ramp and not self.clip:
      raise ValueError(f'clip_ramp={self.clip_ramp} needs clip > 0 (got clip={self.clip})')
    if self.lean_state and (self.skew_tiers or self.optimizer == 'skewadam'):
      raise ValueError('lean_state and SkewAdam (optimizer skewadam, skew_tiers) both choose '
                       'the optimizer state of the same parameters: pick one')
    if self.profile_steps is not None:
      _, last = profile_window(self.profile_steps)
      if last > self.steps * self.grad_accum:
        raise ValueError(f'profile_steps={self.profile_steps!r} ends after the run\'s last '
                         f'micro-step, {self.steps * self.grad_accum}')
    if device_count is not None and device_count % self.fsdp:
      valid = [n for n in range(1, device_count + 1) if device_count % n == 0]
      raise ValueError(f'fsdp={self.fsdp} must divide the {device_count} device(s); '
                       f'valid: {valid}')


def drop_shared_poet_options(cfg: TrainConfig, base: TrainConfig) -> TrainConfig:
  """``cfg``, a run of a study whose other options come from ``base``, with the
  POET-only options it shares with ``base`` back at their defaults when its
  optimizer does not poetize (a study's POET options are for its POET runs;
  its baselines keep the ones they set themselves, which ``validate`` refuses)."""
  if cfg.optimizer not in RECIPES or RECIPES[cfg.optimizer].poetizes:
    return cfg  # (an unknown optimizer: validate names it)
  shared = {f.name: f.default for f in dataclasses.fields(TrainConfig)
            if f.metadata.get('poet') and getattr(cfg, f.name) == getattr(base, f.name)}
  return dataclasses.replace(cfg, **shared)


def profile_window(text: str) -> tuple[int, int]:
  """``--profile-steps`` ``'A:B'`` as ``(A, B)``, ``1 <= A <= B``; ValueError else.

    >>> profile_window('20:25')
    (20, 25)
  """
  a, colon, b = str(text).partition(':')
  if colon and a.strip().isdigit() and b.strip().isdigit() and 1 <= int(a) <= int(b):
    return int(a), int(b)
  raise ValueError(f'profile_steps must be A:B, the first and last micro-step to trace with '
                   f'1 <= A <= B (e.g. 20:25), got {text!r}')


def _base_type(hint) -> tuple[type, bool]:
  """(the type of a field without None, whether None is allowed)."""
  args = tp.get_args(hint)
  if type(None) in args:
    (hint,) = [a for a in args if a is not type(None)]
    return tp.get_origin(hint) or hint, True
  return tp.get_origin(hint) or hint, False


def _bounds(md: tp.Mapping) -> str:
  """The bounds of a field as text: '>= 1', 'in (0, 1)', 'in [0, 1]'."""
  lo = ('[', md['min']) if 'min' in md else ('(', md['gt']) if 'gt' in md else None
  hi = (']', md['max']) if 'max' in md else (')', md['lt']) if 'lt' in md else None
  if lo and hi:
    return f'in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}'
  if lo:
    return f'{">=" if lo[0] == "[" else ">"} {lo[1]}'
  return f'{"<=" if hi[0] == "]" else "<"} {hi[1]}' if hi else ''


def check_fields(values: tp.Mapping[str, tp.Any]) -> None:
  """Raises ValueError for the first of ``values`` (TrainConfig fields by
  name) that its field cannot take alone: its type, choices and bounds (how
  the fields go together: :meth:`TrainConfig.validate`)."""
  hints = tp.get_type_hints(TrainConfig)
  metadata = {f.name: f.metadata for f in dataclasses.fields(TrainConfig)}
  for name, value in values.items():
    _check(name, value, hints[name], metadata[name])


def _check(name: str, value: tp.Any, hint, md: tp.Mapping) -> None:
  """Raises ValueError unless ``value`` is of the field's type, choices and bounds."""
  typ, optional = _base_type(hint)
  if optional and value is None:
    return
  or_none = f' (or None: {md["none"]})' if optional else ''
  if typ is list and 'choices' in md:  # some of the choices
    if not (isinstance(value, list) and all(v in md['choices'] for v in value)):
      raise ValueError(f'{name} must be a list of {md["choices"]} (or []), got {value!r}')
    return
  if 'choices' in md:
    if value not in md['choices']:
      either = 'None or ' if optional else ''
      raise ValueError(f'{name} must be {either}one of {md["choices"]}, got {value!r}')
    return
  numeric = typ in (int, float) and not isinstance(value, bool)
  if typ is int and not (numeric and isinstance(value, int)):
    raise ValueError(f'{name} must be an int {_bounds(md)}{or_none}, got {value!r}')
  if typ is float and not (numeric and isinstance(value, (int, float))):
    raise ValueError(f'{name} must be a number {_bounds(md)}{or_none}, got {value!r}')
  if typ in (bool, str, dict, list) and not isinstance(value, typ):
    raise ValueError(f'{name} must be a {typ.__name__}{or_none}, got {value!r}')
  if typ is list and not all(isinstance(v, str) for v in value):
    raise ValueError(f'{name} must be a list of paths (str){or_none}, got {value!r}')
  if typ is list and not value:  # `--data` with nothing after it
    raise ValueError(f'{name} must name at least one path{or_none}, got [] '
                     f'(--{name.replace("_", "-")} with no path after it)')
  if numeric and not math.isfinite(value):
    raise ValueError(f'{name} must be a finite number {_bounds(md)}{or_none}, got {value!r}')
  if numeric and not (('min' not in md or value >= md['min'])
                      and ('gt' not in md or value > md['gt'])
                      and ('max' not in md or value <= md['max'])
                      and ('lt' not in md or value < md['lt'])):
    kind = 'an int ' if typ is int else ''
    raise ValueError(f'{name} must be {kind}{_bounds(md)}{or_none}, got {value!r}')


# ----------------------------------------------------------------------------- the CLI


def _help(md: tp.Mapping, default: tp.Any, choices: tp.Sequence | None) -> str:
  """The --help line of a field: its help, its valid values and its default."""
  text = md['help']
  if choices is not None and not md.get('cli_choices', True):
    text += f'; one of {", ".join(choices)}'
  bounds = _bounds(md)
  if bounds and 'choices' not in md:
    text += f'; {bounds}'
  if default is None:
    text += f' (default: {md["none"]})'
  elif isinstance(default, dict) and default:
    text += f' (default: {",".join(f"{k}={json.dumps(v)}" for k, v in default.items())})'
  elif not (default is False or default == {} or default == []):
    text += f' (default: {default})'
  return text.replace('%', '%%')


def _field_names(names: tp.Iterable[str], what: str) -> None:
  """Raises ValueError unless every name is a TrainConfig field."""
  fields = [f.name for f in dataclasses.fields(TrainConfig)]
  for name in names:
    if name not in fields:
      raise ValueError(f'{what}: {name!r} is not an option; valid: {", ".join(fields)}')


def add_options(parser: argparse.ArgumentParser, *, defaults: bool = True,
                overrides: tp.Mapping[str, tp.Any] | None = None,
                exclude: tp.Iterable[str] = ()) -> None:
  """Adds one ``--flag`` per :class:`TrainConfig` field (``model_overrides`` ->
  ``--model-overrides``): bools are switches, lists take several values, a
  field with a ``parse`` function takes its text form.

  Args:
    parser: where the flags go.
    defaults: False leaves an option not given out of the parsed namespace,
      which then holds exactly the options given (what ``--resume`` checks
      against ``run.json``).
    overrides: defaults of this parser instead of TrainConfig's (an
      experiment's own), by field name; shown in ``--help``. Every bool gets
      a ``--no-`` flag too.
    exclude: fields that get no flag (an experiment that sets them itself);
      :func:`config_from_args` gives them TrainConfig's default.
  """
  overrides = dict(overrides or {})
  exclude = set(exclude)
  _field_names([*overrides, *exclude], 'add_options')
  hints = tp.get_type_hints(TrainConfig)
  for f in dataclasses.fields(TrainConfig):
    if f.name in exclude:
      continue
    md, flag = f.metadata, '--' + f.name.replace('_', '-')
    typ, _ = _base_type(hints[f.name])
    value = (overrides[f.name] if f.name in overrides
             else f.default_factory() if f.default is dataclasses.MISSING else f.default)
    choices = md.get('choices')
    kw = dict(help=_help(md, value, choices), metavar=md.get('metavar'))
    default = value if defaults else argparse.SUPPRESS
    if typ is bool:  # --flag / --no-flag (the latter to undo a config file's true)
      parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                          help=kw['help'])
    elif typ is list:
      parser.add_argument(flag, nargs='*', default=default, choices=choices, **kw)
    elif 'parse' in md:  # read from text by config_from_args
      parser.add_argument(flag, type=str, default=default, **kw)
    else:
      cli_choices = choices if md.get('cli_choices', True) else None
      parser.add_argument(flag, type=typ, default=default, choices=cli_choices, **kw)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
  """The :class:`TrainConfig` of parsed :func:`add_options` flags (other
  attributes of ``args`` are ignored; a field without one, left out by
  ``exclude``, takes its default)."""
  values = {}
  for f in dataclasses.fields(TrainConfig):
    if not hasattr(args, f.name):
      continue
    v = getattr(args, f.name)
    values[f.name] = f.metadata['parse'](v) if 'parse' in f.metadata and isinstance(v, str) else v
  return TrainConfig(**values)
