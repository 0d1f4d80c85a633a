"""A run's data and model: the corpus read for a run (its tokenizer stored in
the run, or the stored one used and the splits checked) and the model
restored from the run's checkpoints.

    data = run_data(out, cfg, resume=False)               # train: tokenizer stored
    cfg, mc, model, step = load_model('runs/tiny-poetx')  # export: no corpus read
    cfg, data, model, step = load_run('runs/tiny-poetx')  # eval: corpus checked

The run directory's own files (``run.json``, ``data.json``, the stored
tokenizer) are read and written by :mod:`poetx_jax.pretrain.rundir`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
from flax import nnx

from poetx_jax.models import llama
from poetx_jax.pretrain import data as data_lib
from poetx_jax.pretrain import processes
from poetx_jax.pretrain import shards
from poetx_jax.pretrain.checkpoint import Checkpointer
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.factories import build_model, model_config
from poetx_jax.pretrain.rundir import (check_data, read_config, read_data_record, store_data,
                                       stored_tokenizer)


def prepared_vocab_size(cfg: TrainConfig) -> int | None:
  """The vocabulary of the prepared dataset directory ``cfg.data`` names (its
  manifest's), or None where it names none (or its manifest is unreadable:
  :func:`load_data` says why)."""
  if not (cfg.data and len(cfg.data) == 1 and shards.is_prepared(cfg.data[0])):
    return None
  try:
    return int(json.loads((pathlib.Path(cfg.data[0]) / shards.MANIFEST).read_text())
               ['vocab_size'])
  except (OSError, ValueError, KeyError, TypeError):
    return None


def with_prepared_vocab(cfg: TrainConfig) -> TrainConfig:
  """``cfg`` with ``vocab_size`` that of the prepared dataset it trains on (a
  prepared dataset brings its tokenizer: no BPE is trained, so run.json
  records the vocabulary used); ``cfg`` itself for any other data."""
  vocab = prepared_vocab_size(cfg)
  return cfg if vocab is None else dataclasses.replace(cfg, vocab_size=vocab)


def load_data(cfg: TrainConfig, tokenizer: str | pathlib.Path | None = None
              ) -> data_lib.TextData | shards.PreparedData:
  """The corpus of ``cfg`` tokenized (with ``tokenizer``, else ``cfg.tokenizer``,
  else a BPE trained on it), split and packed; a prepared dataset directory
  (``poetx prepare``) is read from its shards.

  Raises:
    ValueError: unreadable data, a directory ``poetx prepare`` has not
      finished (named, with how to finish it), or a prepared one among other
      paths (its shards would be skipped as files of no corpus format).
  """
  for path in cfg.data or ():
    if shards.is_prepared(path) and len(cfg.data) > 1:
      raise ValueError(f'{path} is a prepared dataset directory: train on it alone '
                       f'(--data {path}), or prepare all {len(cfg.data)} paths into one')
    if shards.is_unfinished(path):
      raise ValueError(f'{path} is an unfinished poetx prepare directory (no '
                       f'{shards.MANIFEST}): run the same `poetx prepare INPUT... --out '
                       f'{path}` again to finish it (it resumes where it stopped), then '
                       f'train with --data {path}')
  if cfg.data and len(cfg.data) == 1 and shards.is_prepared(cfg.data[0]):
    return shards.PreparedData(cfg.data[0], seq_len=cfg.seq_len,
                               val_fraction=cfg.val_fraction,
                               tokenizer_path=tokenizer or cfg.tokenizer)
  docs = data_lib.read_documents(cfg.data) if cfg.data else None
  return data_lib.TextData(docs, tokenizer_path=tokenizer or cfg.tokenizer,
                           vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                           val_fraction=cfg.val_fraction,
                           cache_dir=pathlib.Path(cfg.cache_dir).expanduser())


def run_data(out: pathlib.Path, cfg: TrainConfig, *, resume: bool) -> data_lib.TextData:
  """The data of a run: afresh, the corpus tokenized and the tokenizer stored in
  the run; resuming, the corpus tokenized with the stored tokenizer and
  checked to give the same splits as when the run started."""
  # Of several processes, the first trains and caches the tokenizer and token
  # stream and stores them in the run; the others then read them with that
  # tokenizer and check they have the same splits.
  data = processes.on_primary('reading the data',
                              lambda: _run_data(out, cfg, resume=resume))
  if data is None:
    data = load_data(cfg, stored_tokenizer(out))
    check_data(out, data, ('train', 'val'), f'process {jax.process_index()}: ',
               sources=cfg.data or [])
  return data


def _run_data(out: pathlib.Path, cfg: TrainConfig, *, resume: bool) -> data_lib.TextData:
  if not resume:
    data = load_data(cfg)
    store_data(out, data)
    return data
  data = load_data(cfg, stored_tokenizer(out))
  check_data(out, data, ('train', 'val'), '--resume: ', sources=cfg.data or [])
  return data


def load_model(out_dir: str | pathlib.Path, *, step: int | None = None
               ) -> tuple[TrainConfig, llama.LlamaConfig, object, int]:
  """(cfg, model config, model, step) of a run at its newest (or given)
  checkpoint, without the corpus: the vocabulary is the stored tokenizer's.
  Only the model is restored, into its shapes: no random weights are drawn
  first, and no optimizer state is built or read."""
  out = pathlib.Path(out_dir)
  cfg = read_config(out)
  mc = model_config(cfg, read_data_record(out)['vocab_size'])
  shapes = nnx.eval_shape(lambda: build_model(cfg, mc))
  model, step = Checkpointer(out / 'checkpoints').restore_model(shapes, step=step)
  return cfg, mc, model, step


def load_run(out_dir: str | pathlib.Path, *, step: int | None = None):
  """(cfg, data, model, step) of a run directory, at its newest (or given) checkpoint.

  The corpus is read again with the run's stored tokenizer; its validation
  split must be the one the run was validated on (CheckpointError if not).
  """
  cfg = read_config(out_dir)
  data = load_data(cfg, stored_tokenizer(out_dir))
  check_data(pathlib.Path(out_dir), data, ('val',))
  cfg, _, model, step = load_model(out_dir, step=step)
  return cfg, data, model, step
