"""The run directory: what a run is, beside its checkpoints.

    RUN/run.json          the TrainConfig (compared on --resume)
    RUN/tokenizer.json    the run's tokenizer (tokenizer.model for sentencepiece)
    RUN/data.json         the tokenizer's sha256 and vocabulary, and the identity of
                          the splits: tokens and sha256 of each token stream
    RUN/checkpoints/      orbax steps (checkpoint.py)
    RUN/metrics.jsonl     the curves (metrics.py)

The tokenizer is stored with the run, so eval, export and resume never
retrain it: export needs only the weights and the stored tokenizer (no
corpus), while eval and resume re-read the corpus with the stored tokenizer
and refuse one whose splits no longer hash to those of ``data.json``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

from poetx_jax.models import llama
from poetx_jax.pretrain import data as data_lib
from poetx_jax.pretrain.checkpoint import CheckpointError, Checkpointer
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.factories import build_model, model_config
from poetx_jax.pretrain.tokenizer import file_hash

RUN_FILE, DATA_FILE = 'run.json', 'data.json'


def open_run(cfg: TrainConfig, *, resume: bool) -> pathlib.Path:
  """Creates (or, resuming, checks) the run directory ``cfg.out_dir`` and writes
  its ``run.json``.

  Raises:
    CheckpointError: resuming without a ``run.json``, or with a configuration
      other than the saved one; or starting afresh where checkpoints exist.
  """
  out = pathlib.Path(cfg.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  run_file = out / RUN_FILE
  if resume:
    if not run_file.exists():
      raise CheckpointError(f'--resume: no run.json in {out}; nothing to resume')
    saved = json.loads(run_file.read_text())
    if saved != dataclasses.asdict(cfg):
      diff = {k: (saved.get(k), v) for k, v in dataclasses.asdict(cfg).items()
              if saved.get(k) != v}
      raise CheckpointError(f'--resume: the configuration differs from the one in '
                            f'{run_file} (saved, given): {diff}')
  elif Checkpointer(out / 'checkpoints').all_steps():
    raise CheckpointError(f'{out} already holds checkpoints of a run; continue it with '
                          f'--resume, or choose another --out-dir')
  run_file.write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
  return out


def load_data(cfg: TrainConfig, tokenizer: str | pathlib.Path | None = None
              ) -> data_lib.TextData:
  """The corpus of ``cfg`` tokenized (with ``tokenizer``, else ``cfg.tokenizer``,
  else a BPE trained on it), split and packed."""
  docs = data_lib.read_documents(cfg.data) if cfg.data else None
  return data_lib.TextData(docs, tokenizer_path=tokenizer or cfg.tokenizer,
                           vocab_size=cfg.vocab_size, seq_len=cfg.seq_len,
                           val_fraction=cfg.val_fraction,
                           cache_dir=pathlib.Path(cfg.cache_dir).expanduser())


def store_data(out: pathlib.Path, data: data_lib.TextData) -> None:
  """Copies the tokenizer of ``data`` into the run and writes ``data.json``."""
  src = data.tokenizer.path
  name = 'tokenizer.model' if src.suffix == '.model' else 'tokenizer.json'
  if src.resolve() != (out / name).resolve():
    shutil.copyfile(src, out / name)
  record = {'tokenizer': name, 'tokenizer_sha256': file_hash(out / name),
            'vocab_size': data.tokenizer.vocab_size, **data.fingerprint}
  (out / DATA_FILE).write_text(json.dumps(record, indent=1))


def read_data_record(out: pathlib.Path) -> dict:
  """``data.json`` of a run, its stored tokenizer checked against its hash."""
  path = pathlib.Path(out) / DATA_FILE
  if not path.exists():
    raise CheckpointError(f'{out} has no {DATA_FILE}: the run directory does not hold '
                          f'its tokenizer and data identity, so it cannot be evaluated, '
                          f'exported or resumed reliably')
  record = json.loads(path.read_text())
  tok = path.parent / record['tokenizer']
  if not tok.is_file():
    raise CheckpointError(f'{out}: the run\'s tokenizer {tok.name} is missing')
  if file_hash(tok) != record['tokenizer_sha256']:
    raise CheckpointError(f'{out}: {tok.name} was modified after training (sha256 '
                          f'{file_hash(tok)[:16]}..., {DATA_FILE} records '
                          f'{record["tokenizer_sha256"][:16]}...)')
  return record


def stored_tokenizer(out: str | pathlib.Path) -> pathlib.Path:
  """The path of the tokenizer stored in run directory ``out``."""
  return pathlib.Path(out) / read_data_record(pathlib.Path(out))['tokenizer']


def check_data(out: pathlib.Path, data: data_lib.TextData, splits: tuple[str, ...],
               prefix: str = '') -> None:
  """Raises CheckpointError (its message starting with ``prefix``) unless the
  ``splits`` ('train', 'val') of ``data`` are those the run was trained with."""
  record = read_data_record(out)
  for split in splits:
    now = (data.fingerprint[f'{split}_tokens'], data.fingerprint[f'{split}_sha256'])
    then = (record[f'{split}_tokens'], record[f'{split}_sha256'])
    if now != then:
      name = 'validation' if split == 'val' else 'training'
      raise CheckpointError(
          f'{prefix}the corpus no longer matches the run {out}: its {name} split is now '
          f'{now[0]:,} tokens (sha256 {now[1][:16]}...), at the start of the run it was '
          f'{then[0]:,} tokens (sha256 {then[1][:16]}..., {out / DATA_FILE}): '
          f'{", ".join(data_sources(out))} changed since')


def data_sources(out: pathlib.Path) -> list[str]:
  """The corpus paths of a run, as recorded in its ``run.json``."""
  saved = json.loads((pathlib.Path(out) / RUN_FILE).read_text())
  return saved.get('data') or ['the built-in corpus']


def run_data(out: pathlib.Path, cfg: TrainConfig, *, resume: bool) -> data_lib.TextData:
  """The data of a run: afresh, the corpus tokenized and the tokenizer stored in
  the run; resuming, the corpus tokenized with the stored tokenizer and
  checked to give the same splits as when the run started."""
  if not resume:
    data = load_data(cfg)
    store_data(out, data)
    return data
  data = load_data(cfg, stored_tokenizer(out))
  check_data(out, data, ('train', 'val'), '--resume: ')
  return data


def read_config(out: str | pathlib.Path) -> TrainConfig:
  """The :class:`TrainConfig` of a run directory (its ``run.json``)."""
  run_file = pathlib.Path(out) / RUN_FILE
  if not run_file.exists():
    raise CheckpointError(f'{out} is not a run directory (no run.json)')
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  saved = json.loads(run_file.read_text())
  unknown = sorted(set(saved) - fields)
  if unknown:
    raise CheckpointError(f'{run_file} has fields this version does not know: {unknown}')
  return TrainConfig(**saved)


def load_model(out_dir: str | pathlib.Path, *, step: int | None = None
               ) -> tuple[TrainConfig, llama.LlamaConfig, object, int]:
  """(cfg, model config, model, step) of a run at its newest (or given)
  checkpoint, without the corpus: the vocabulary is the stored tokenizer's.
  Only the model is restored: no optimizer state is built or read."""
  out = pathlib.Path(out_dir)
  cfg = read_config(out)
  mc = model_config(cfg, read_data_record(out)['vocab_size'])
  model = build_model(cfg, mc)
  step, _, _ = Checkpointer(out / 'checkpoints').restore(model, step=step)
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
