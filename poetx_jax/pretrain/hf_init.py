"""Runs that start from a Hugging Face Llama (``poetx train --init-from-hf DIR``).

DIR holds a ``LlamaForCausalLM`` checkpoint: config.json and safetensors
weights (one file or shards), as ``poetx export`` writes or the Hub serves.
The run's model is the one config.json describes, its step-0 weights DIR's
(poetized for POET-X, each layer as it is filled):

* the model config comes from config.json (:func:`poetx_jax.models.hf.llama_config`);
  ``--model``, unless left at its default, and ``--model-overrides`` must
  agree with it, field by field (POET's block size, which config.json does
  not hold, is ``--block-size``; by default the one config.json's shape
  suggests);
* the vocabulary must be the run's tokenizer's; without ``--tokenizer`` (and
  no prepared dataset) the run uses DIR's own ``tokenizer.json`` (or
  ``tokenizer.model``, :data:`TOKENIZERS`; the run's plan,
  :func:`poetx_jax.pretrain.options.finish_options`, chooses it);
* the source is recorded in the run's ``data.json`` under ``init_from_hf``:
  its path, the sha256 of config.json and of each weight file, and the model
  config read, so that ``--resume``, ``poetx eval`` and ``poetx export`` know
  the model without DIR (which they never read again).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import typing as tp

from poetx_jax import models
from poetx_jax.models import hf
from poetx_jax.models.llama import LlamaConfig
from poetx_jax.pretrain import processes
from poetx_jax.pretrain.checkpoint import CheckpointError
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.atomic import atomic_write
from poetx_jax.pretrain.json_records import read_json
from poetx_jax.pretrain.data.tokenizer import file_hash

RECORD = 'init_from_hf'  # the key of data.json
TOKENIZERS = ('tokenizer.json', 'tokenizer.model')


class Source(tp.NamedTuple):
  """A run's Hugging Face starting point: the model config of its config.json
  and its weights (None when resuming: the checkpoint holds the state)."""
  config: LlamaConfig
  weights: tp.Mapping | None


def model_config(cfg: TrainConfig, source: LlamaConfig | None, vocab_size: int
                 ) -> LlamaConfig:
  """The model of a run that starts from a checkpoint: its config.json's
  ``source`` (the run's plan sets the POET block size, ``--block-size``).

  Raises:
    ValueError: no ``source``; ``--model`` (other than the default) or
      ``--model-overrides`` disagree with it, or the tokenizer's vocabulary
      (``vocab_size``) is not the checkpoint's; each named.
  """
  where = cfg.init_from_hf
  if source is None:
    raise ValueError(f'the run starts from {where}: its model config is needed (read '
                     f'from {where}/config.json, or the run\'s data.json)')
  given = dict(cfg.model_overrides)
  if cfg.model != TrainConfig.model:
    named = models.get_config(cfg.model)
    if type(named) is not LlamaConfig:
      raise ValueError(f'--model {cfg.model} is a {type(named).__name__}; {where} holds '
                       f'a dense Llama: leave --model out with --init-from-hf')
    fixed = [f.name for f in dataclasses.fields(LlamaConfig)
             if f.name not in ('vocab_size', 'block_size', 'init_std')]
    given = {**{k: getattr(named, k) for k in fixed}, **given}
  fields = [f.name for f in dataclasses.fields(LlamaConfig)]
  for k, v in given.items():
    if k not in fields or getattr(source, k) != v:
      have = f'{where}/config.json gives {getattr(source, k)!r}' if k in fields else (
          f'not a field of a dense Llama ({sorted(fields)})')
      origin = ('--model-overrides' if k in cfg.model_overrides else f'--model {cfg.model}')
      raise ValueError(f'{origin} sets {k}={v!r}, {have}: with --init-from-hf the model '
                       f'is the checkpoint\'s; leave --model and --model-overrides out '
                       f'(--block-size N sets the POET block size)')
  if source.vocab_size != vocab_size:
    raise ValueError(f'{where} has a vocabulary of {source.vocab_size} (config.json '
                     f'vocab_size), the run\'s tokenizer {vocab_size} tokens: they must '
                     f'be equal; train with the checkpoint\'s tokenizer (--tokenizer '
                     f'{where}/tokenizer.json, the default where it has one) or data '
                     f'prepared with it')
  return source


def recorded_config(record: tp.Mapping) -> LlamaConfig | None:
  """The checkpoint's model config recorded in a run's ``data.json`` (None
  when the run did not start from one)."""
  entry = record.get(RECORD)
  return LlamaConfig(**entry['model']) if entry else None


def run_source(cfg: TrainConfig, out: pathlib.Path, *, resume: bool, log=print
               ) -> Source | None:
  """The starting point of the run of ``cfg`` in ``out`` (None without
  ``init_from_hf``): resuming, the model config recorded in ``data.json``;
  afresh, the checkpoint read (its weights looked up lazily) and recorded."""
  if cfg.init_from_hf is None:
    return None
  data_file = out / 'data.json'
  if resume:
    config = recorded_config(read_json(data_file, error=CheckpointError))
    if config is None:
      raise CheckpointError(f'{data_file} does not record the checkpoint the run started '
                            f'from ({cfg.init_from_hf}): it was rewritten since')
    return Source(config, None)
  config, weights = hf.from_hf(cfg.init_from_hf)
  root = pathlib.Path(cfg.init_from_hf).resolve()

  def record():
    files = sorted({p.name for p in getattr(weights, 'files', {}).values()})
    entry = {'path': str(root), 'config_sha256': file_hash(root / 'config.json'),
             'weights_sha256': {name: file_hash(root / name) for name in files},
             'model': dataclasses.asdict(config)}
    saved = {**read_json(data_file, error=CheckpointError), RECORD: entry}
    text = json.dumps(saved, indent=1)
    atomic_write(data_file, lambda tmp: pathlib.Path(tmp).write_text(text))
    return entry

  entry = processes.on_primary('recording the checkpoint the run starts from', record)
  log(f'init: {root} ({config.num_params():,} parameters' + (
      f', weights sha256 {next(iter(entry["weights_sha256"].values()))[:16]}...)'
      if entry and len(entry['weights_sha256']) == 1 else
      f' in {len(entry["weights_sha256"])} files)' if entry else ')'))
  return Source(config, weights)
