"""A run's options finished: what a ``poetx train`` command sets (its flags
over a config file's options, or over a resumed run's ``run.json``), checked,
its paths made absolute, its run directory named, and the tokenizer and
vocabulary it uses (a prepared dataset's, a tokenizer file's or that of a
checkpoint it starts from, ``--init-from-hf``) recorded, before
:func:`poetx_jax.pretrain.plan.make_plan` resolves the defaults::

    cfg = command_options(cfg, given, config_file=path, resume=False)
    cfg = finish_options(cfg, resume=False, device_count=jax.device_count())
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import typing as tp

from poetx_jax import models, ops
from poetx_jax.pretrain import hf_init, plan, processes, rundir
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.data import mixture, shards
from poetx_jax.pretrain.recipes import RECIPES


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
      ops.check_chunk_size(cfg.chunk_size, plan.block_size(cfg, mc), what='chunk_size')
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
