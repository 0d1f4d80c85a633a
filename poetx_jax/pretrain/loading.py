"""A run's data and model: the corpus read for a run (its tokenizer stored in
the run, or the stored one used and the splits checked) and the model
restored from the run's checkpoints.

    data = run_data(out, cfg, resume=False)               # train: tokenizer stored
    plan, model, step = load_model('runs/tiny-poetx-muon')      # export: no corpus read
    plan, data, model, step = load_run('runs/tiny-poetx-muon')  # eval: corpus checked

The run directory's own files (``run.json``, ``data.json``, the stored
tokenizer) are read and written by :mod:`poetx_jax.pretrain.rundir`.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
from flax import nnx

from poetx_jax.pretrain.data import corpus
from poetx_jax.pretrain.data import windows as data_lib
from poetx_jax.pretrain import hf_init, processes
from poetx_jax.pretrain.data import mixture, shards
from poetx_jax.pretrain.data import tokenizer as tokenizer_lib
from poetx_jax.pretrain.checkpoint import Checkpointer
from poetx_jax.pretrain.config import TrainConfig, check_fields
from poetx_jax.pretrain.rundir import (check_data, read_config, read_data_record, store_data,
                                       stored_tokenizer)


def _data_paths(cfg: TrainConfig) -> list[str]:
  """The paths of ``cfg.data``, weights (``PATH:W``) left out."""
  return [p for p, _ in mixture.parse_data(cfg.data or ())]


def load_data(cfg: TrainConfig, tokenizer: str | pathlib.Path | None = None
              ) -> data_lib.TextData | shards.PreparedData | mixture.MixtureData:
  """The corpus of ``cfg`` tokenized (with ``tokenizer``, else ``cfg.tokenizer``,
  else a BPE trained on it), split and packed; a prepared dataset directory
  (``poetx prepare``) is read from its shards. Weighted ``--data`` entries
  (``PATH:W``) or ``--val-data`` give a :class:`~poetx_jax.pretrain.data.mixture.MixtureData`.

  Raises:
    ValueError: unreadable data, a directory ``poetx prepare`` has not
      finished (named, with how to finish it), a prepared one among other
      unweighted paths (its shards would be skipped as files of no corpus
      format), bad weights, or a ``--val-data`` path that is also trained on.
  """
  entries = mixture.parse_data(cfg.data or ())
  paths, weighted = [p for p, _ in entries], any(w is not None for _, w in entries)
  val_paths = [p for p, _ in mixture.parse_data(cfg.val_data or ())]
  if val_paths != list(cfg.val_data or ()):
    raise ValueError(f'--val-data takes paths, not weights: {" ".join(cfg.val_data)}')
  for path in paths + val_paths:
    if shards.is_unfinished(path):
      raise ValueError(f'{path} is an unfinished poetx prepare directory (no '
                       f'{shards.MANIFEST}): run the same `poetx prepare INPUT... --out '
                       f'{path}` again to finish it (it resumes where it stopped), then '
                       f'train with --data {path}')
  for group, flag in ((() if weighted else paths, '--data'), (val_paths, '--val-data')):
    for path in group:
      if shards.is_prepared(path) and len(group) > 1:
        use = 'train on' if flag == '--data' else 'validate on'
        raise ValueError(
            f'{path} is a prepared dataset directory: {use} it alone ({flag} {path})'
            + (f', give every path a weight to mix them (--data {path}:1 '
               f'{" ".join(p + ":1" for p in group if p != path)}),' if flag == '--data'
               else '') + f' or prepare all {len(group)} paths into one')
  _check_apart(paths, val_paths)
  tokenizer = tokenizer or cfg.tokenizer
  if weighted or val_paths:
    groups = [([p], w) for p, w in entries] if weighted else [(paths, 1.0)]
    return _load_mixture(cfg, groups, val_paths, tokenizer)
  if cfg.data and len(cfg.data) == 1 and shards.is_prepared(cfg.data[0]):
    return shards.PreparedData(cfg.data[0], seq_len=cfg.seq_len,
                               val_fraction=cfg.val_fraction, tokenizer_path=tokenizer)
  docs = data_lib.read_documents(cfg.data) if cfg.data else None
  return data_lib.TextData(docs, tokenizer_path=tokenizer,
                           vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                           val_fraction=cfg.val_fraction,
                           cache_dir=cfg.cache_dir)


def _check_apart(paths: list[str], val_paths: list[str]) -> None:
  """ValueError if a path is named twice in ``--data`` (or in ``--val-data``),
  or a ``--val-data`` path is (or is inside) a ``--data`` one, or one of its
  corpus files has the content of a training file (a copy)."""
  for group, flag in ((paths, '--data'), (val_paths, '--val-data')):
    seen = {}
    for p in group:
      first = seen.setdefault(pathlib.Path(p).resolve(), p)
      if first is not p:
        raise ValueError(f'{flag} names {p} twice ({first}): name each path once (a '
                         f'weight PATH:W sets how much of it a mixture draws)')
  train = [pathlib.Path(p).resolve() for p in paths]
  for v in val_paths:
    rv = pathlib.Path(v).resolve()
    for p, rp in zip(paths, train):
      if rv == rp or rp in rv.parents:
        raise ValueError(f'--val-data {v} is also trained on (--data {p}): validate on '
                         f'text the run does not train on')
  _check_no_copies(paths, val_paths)


def _check_no_copies(paths: list[str], val_paths: list[str]) -> None:
  """ValueError if a corpus file of ``val_paths`` has the bytes of one of
  ``paths`` (files of equal size hashed, so a large corpus is not read)."""
  text = lambda group: [p for p in group if p and not shards.is_prepared(p)]
  val_files = data_lib.corpus_files(text(val_paths)) if text(val_paths) else []
  sizes = {}
  for f in val_files:
    sizes.setdefault(f.stat().st_size, []).append(f)
  if not sizes:
    return
  digest = functools.cache(tokenizer_lib.file_hash)
  for t in data_lib.corpus_files(text(paths)) if text(paths) else []:
    for v in sizes.get(t.stat().st_size, ()):
      if digest(v) == digest(t):
        raise ValueError(f'--val-data file {v} holds the same bytes as the training file '
                         f'{t} (--data): validate on text the run does not train on')


def _load_mixture(cfg: TrainConfig, groups: list[tuple[list[str], float]],
                  val_paths: list[str], tokenizer) -> mixture.MixtureData:
  """The :class:`~poetx_jax.pretrain.data.mixture.MixtureData` of the sources
  ``groups`` (paths and weight each; no paths: the built-in corpus) and the
  validation set ``val_paths``, tokenized alike: with ``tokenizer``, else
  that of the first prepared directory, else a BPE trained on the sources'
  documents together."""
  every = [g for g, _ in groups] + ([val_paths] if val_paths else [])
  prepared = [g[0] for g in every if len(g) == 1 and shards.is_prepared(g[0])]
  docs = {}
  for i, paths in enumerate(every):
    if not (len(paths) == 1 and shards.is_prepared(paths[0])):
      docs[i] = data_lib.read_documents(paths) if paths else corpus.default_corpus()[0]
  cache = cfg.cache_dir  # the tokenizer's caches expand its ~
  manifests = [shards.TokenShards(p).manifest for p in prepared]
  for p, m in zip(prepared[1:], manifests[1:]):
    if m['tokenizer_sha256'] != manifests[0]['tokenizer_sha256']:
      raise ValueError(f'{prepared[0]} and {p} were prepared with different tokenizers; '
                       f'the sources of a run share one: prepare {p} again with --tokenizer '
                       f'{pathlib.Path(prepared[0]) / manifests[0]["tokenizer"]}')
  if tokenizer is None and prepared:
    tokenizer = pathlib.Path(prepared[0]) / manifests[0]['tokenizer']
  if tokenizer is None:
    train_docs = [d for i in range(len(groups)) for d in docs.get(i, ())]
    tokenizer = tokenizer_lib.load_or_train_tokenizer(
        train_docs, vocab_size=cfg.vocab_size, cache_dir=cache).path

  def source(i, paths, val_fraction):
    if i not in docs:
      return shards.PreparedData(paths[0], seq_len=cfg.seq_len, val_fraction=val_fraction,
                                 tokenizer_path=tokenizer)
    return data_lib.TextData(docs[i], tokenizer_path=tokenizer, seq_len=cfg.seq_len,
                             val_fraction=val_fraction, cache_dir=cache)

  fraction = None if val_paths else cfg.val_fraction
  parts = [source(i, g, fraction) for i, (g, _) in enumerate(groups)]
  val = source(len(groups), val_paths, None) if val_paths else None
  names = [' '.join(g) or 'the built-in corpus' for g, _ in groups]
  return mixture.MixtureData(parts, [w for _, w in groups], names, val, ' '.join(val_paths))


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


def load_model(out_dir: str | pathlib.Path, *, step: int | None = None):
  """(plan, model, step) of a run at its newest (or given) checkpoint, without
  the corpus: the plan of its ``run.json`` (with the values it recorded) for
  the stored tokenizer's vocabulary. Only the model is restored, into its
  shapes: no random weights are drawn first, and no optimizer state is built
  or read."""
  from poetx_jax.pretrain.factories import build_model
  from poetx_jax.pretrain.plan import make_plan, recorded_plan
  out = pathlib.Path(out_dir)
  record = read_data_record(out)
  plan = make_plan(read_config(out), record['vocab_size'], hf_init.recorded_config(record),
                   recorded=recorded_plan(out))
  shapes = nnx.eval_shape(lambda: build_model(plan))
  model, step = Checkpointer(out / 'checkpoints', create=False).restore_model(
      shapes, step=step)
  return plan, model, step


def load_run(out_dir: str | pathlib.Path, *, step: int | None = None,
             data: list[str] | None = None, val_data: list[str] | None = None,
             cache_dir: str | None = None):
  """(plan, data, model, step) of a run directory, at its newest (or given) checkpoint.

  The corpus is read again with the run's stored tokenizer; its validation
  split must be the one the run was validated on (CheckpointError if not).
  ``data``, ``val_data`` and ``cache_dir``, where given, say where the run's
  ``--data``, ``--val-data`` and token cache are now (moved since it
  trained); a corpus that is not where the run says names the way to say it.
  """
  cfg = read_config(out_dir)
  moved = {k: v for k, v in (('data', data), ('val_data', val_data), ('cache_dir', cache_dir))
           if v is not None}
  check_fields(moved)
  cfg = dataclasses.replace(cfg, **moved)
  try:
    data = load_data(cfg, stored_tokenizer(out_dir))
  except FileNotFoundError as e:
    if 'data' in moved:
      raise
    raise FileNotFoundError(f'{e}; if the run\'s corpus moved, say where it is now: poetx eval '
                            f'{out_dir} --data PATH... (and --val-data PATH...)') from None
  check_data(pathlib.Path(out_dir), data, ('val',))
  plan, model, step = load_model(out_dir, step=step)
  return plan, data, model, step
