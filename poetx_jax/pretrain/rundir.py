"""The run directory: what a run is, beside its checkpoints.

    RUN/run.json          the TrainConfig (compared on --resume) and, under
                          'plan', its defaults resolved (plan.py)
    RUN/tokenizer.json    the run's tokenizer (tokenizer.model for sentencepiece)
    RUN/data.json         the tokenizer's sha256 and vocabulary, and the identity of
                          the splits: tokens and sha256 of each token stream
    RUN/checkpoints/      orbax steps (checkpoint.py)
    RUN/metrics.jsonl     the curves (metrics.py)
    RUN/train.lock        while a training runs: its pid, host and start (run_lock.py)
    RUN/damaged-checkpoints/TIME/, RUN/abandoned-checkpoints/TIME-resumed-from-N/
                          steps set aside by a --resume, a folder each: damaged
                          ones, and those newer than the one chosen with --step N
                          (Checkpointer.resume)

The tokenizer is stored with the run, so eval, export and resume never
retrain it: export needs only the weights and the stored tokenizer (no
corpus), while eval and resume re-read the corpus with the stored tokenizer
and refuse one whose splits no longer hash to those of ``data.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import typing as tp

from poetx_jax.pretrain.data import windows as data_lib
from poetx_jax.pretrain import processes
from poetx_jax.pretrain.checkpoint import CheckpointError, Checkpointer
from poetx_jax.pretrain.config import PLAN_KEY, TrainConfig
from poetx_jax.pretrain.atomic import atomic_write
from poetx_jax.pretrain.disk_full import writing
from poetx_jax.pretrain.footprint import Footprint
from poetx_jax.pretrain.json_records import read_json
from poetx_jax.pretrain.run_lock import RunLock
from poetx_jax.pretrain.data.tokenizer import file_hash

RUN_FILE, DATA_FILE = 'run.json', 'data.json'
# Options that say where things are, not what the run is: --resume may change
# them (the corpus is checked against data.json's hashes instead).
LOCATIONS = ('out_dir', 'cache_dir', 'compile_cache', 'data', 'val_data')
# Options that say how the state is laid out on the devices and the step
# scheduled there, not what is trained: --resume may change them (checkpoints
# restore onto any mesh), and options.resumed_options fits a saved fsdp to the
# devices present.
LAYOUT = ('strategy', 'fsdp', 'memory_slop')
# Options that name a file or directory that is not a location (the run
# trains with what they hold): compared on --resume as absolute paths.
PATHS = ('tokenizer', 'init_from_hf')
# Options that say where the metrics also go and what is profiled: --resume
# may change them.
REPORTING = ('tracking', 'profile_steps')


def saved_run(out: pathlib.Path) -> dict:
  """The options of the run ``--resume`` continues in ``out`` (its ``run.json``)."""
  if not (out / RUN_FILE).is_file():
    raise CheckpointError(f'--resume: {out} holds no run ({out / RUN_FILE} does not exist); '
                          f'nothing to resume')
  return _options(read_run_record(out / RUN_FILE))


def read_run_record(path: pathlib.Path) -> dict:
  """A run's ``run.json`` (CheckpointError naming it if damaged)."""
  return read_json(path, error=CheckpointError)


def _options(saved: dict) -> dict:
  """The options of a ``run.json`` (its ``plan`` left out). A run.json of an
  older version that set the POET block size in ``model_overrides`` gives it
  as ``block_size``, where the option is now."""
  saved = {k: v for k, v in saved.items() if k != PLAN_KEY}
  overrides = dict(saved.get('model_overrides') or {})
  if 'block_size' in overrides:
    block = overrides.pop('block_size')
    saved = {**saved, 'model_overrides': overrides,
             'block_size': saved.get('block_size') or block}
  return saved


def _check_resumable(run_file: pathlib.Path, cfg: TrainConfig) -> None:
  """Raises CheckpointError unless ``cfg`` may continue the run of ``run_file``:
  equal but for LOCATIONS, LAYOUT and REPORTING, with ``steps`` at least the
  saved ones."""
  # A field newer than the run (absent from its run.json) holds its default.
  saved = {**dataclasses.asdict(TrainConfig()), **saved_run(run_file.parent)}
  for key in PATHS:  # a run.json older than absolute paths holds them as given
    if isinstance(saved.get(key), str):
      saved[key] = absolute_path(saved[key])
  now = dataclasses.asdict(cfg)
  diff = {k: (saved.get(k), v) for k, v in now.items()
          if k not in LOCATIONS + LAYOUT + REPORTING + ('steps',) and saved.get(k) != v}
  if diff:
    raise CheckpointError(f'--resume: the configuration differs from the one in {run_file} '
                          f'(saved, given): {diff}; leave these options out to use the '
                          f'saved ones')
  if cfg.steps < saved.get('steps', 0):
    raise CheckpointError(f'--resume: steps={cfg.steps} is below the run\'s {saved["steps"]} '
                          f'({run_file}); --steps may only be raised, to extend the run')


def _make_dir(out: pathlib.Path) -> None:
  """Creates the run directory; ValueError with one line if it cannot be."""
  if out.exists() and not out.is_dir():
    raise ValueError(f'--out-dir {out} is a file, not a directory')
  try:
    out.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ValueError(f'cannot create the run directory --out-dir {out}: '
                     f'{e.strerror or e}') from e


@contextlib.contextmanager
def open_run(cfg: TrainConfig, *, resume: bool,
             log=print) -> tp.Iterator[tuple[pathlib.Path, tp.Callable[[], None]]]:
  """The run directory ``cfg.out_dir``, created (or, resuming, checked) and
  locked for this process (``train.lock``); unlocked on leaving, however that
  happens. Gives ``(out, set_up)``: a new run's ``run.json`` is written
  here, and until the caller calls ``set_up()`` (the run's data, model and
  state accepted) a failure removes everything the run wrote there, so that
  a refused run leaves its run directory as it found it; one refused before
  it held the lock wrote nothing there and removes nothing that another
  training, holding it, writes meanwhile (the token and
  tokenizer cache of ``--cache-dir``, keyed by content and shared by runs,
  keeps what it gained). A resumed run's
  ``run.json`` is rewritten by :func:`write_config` only once it is set up
  (its corpus and checkpoint accepted), so that a refused ``--resume``
  leaves the run as it was.

  Raises:
    CheckpointError: resuming without a ``run.json`` (nothing is created) or
      a checkpoint, or with a configuration the run cannot continue with; or
      starting afresh where checkpoints exist, or in a Hugging Face export
      (``config.json`` without ``run.json``: nothing is created).
    run_lock.RunLocked: another training process holds the directory.
    ValueError: the directory cannot be created or written.
  """
  out = pathlib.Path(cfg.out_dir)
  run_file = out / RUN_FILE
  if resume:
    _check_resumable(run_file, cfg)
  elif (out / 'config.json').is_file() and not run_file.is_file():
    raise CheckpointError(f'{out} holds a Hugging Face export (config.json), not a run: a '
                          f'run there would replace its tokenizer; choose another --out-dir '
                          f'(start from the export with --init-from-hf {out})')
  footprint = Footprint([out])
  state = {'set_up': resume, 'locked': False}
  try:
    with _locked_run(out, cfg, resume, log, state) as opened:
      yield opened, lambda: state.update(set_up=True)
  except BaseException:
    if not state['set_up'] and processes.is_primary():
      if state['locked']:
        footprint.undo()
      else:  # refused before owning it: what appeared there is another run's
        footprint.undo_empty_dirs()
    raise


@contextlib.contextmanager
def _locked_run(out: pathlib.Path, cfg: TrainConfig, resume: bool,
                log, state: dict) -> tp.Iterator[pathlib.Path]:
  # One lock per run: the first process takes it and writes for all (the
  # processes of a multi-process run share the directory).
  with contextlib.ExitStack() as held:

    def lock():
      _make_dir(out)
      held.enter_context(RunLock(out, log=log))
      state['locked'] = True

    processes.on_primary('opening the run directory', lock)
    # Every process: orbax's checkpoint manager is collective.
    saved = Checkpointer(out / 'checkpoints').all_steps()
    if resume and not saved:
      raise CheckpointError(f'--resume: {out} holds no checkpoint (its training stopped '
                            f'before the first was saved): nothing to resume; start the '
                            f'run afresh (without --resume)')
    if not resume and saved:
      raise CheckpointError(f'{out} already holds checkpoints of a run; continue it with '
                            f'--resume, or choose another --out-dir')
    if not resume:
      write_config(out, cfg)
    yield out


def write_config(out: pathlib.Path, cfg: TrainConfig, plan=None) -> None:
  """Writes the run's ``run.json`` (whole, for whoever reads it meanwhile): the
  options the run in ``out`` trains with and, once made, its plan with every
  default resolved (:meth:`~poetx_jax.pretrain.plan.Plan.record`, under
  ``plan``)."""
  record = dataclasses.asdict(cfg)
  if plan is not None:
    record[PLAN_KEY] = plan.record()
  text = json.dumps(record, indent=1)

  def write():
    with writing(out / RUN_FILE):
      atomic_write(out / RUN_FILE, lambda tmp: pathlib.Path(tmp).write_text(text))

  processes.on_primary('writing run.json', write)


def store_data(out: pathlib.Path, data: data_lib.TextData) -> None:
  """Copies the tokenizer of ``data`` into the run and writes ``data.json``,
  each whole (DiskFull naming the file if there is no space)."""
  src = data.tokenizer.path
  name = 'tokenizer.model' if src.suffix == '.model' else 'tokenizer.json'
  if src.resolve() != (out / name).resolve():
    with writing(out / name):
      atomic_write(out / name, lambda tmp: shutil.copyfile(src, tmp))
  record = {'tokenizer': name, 'tokenizer_sha256': file_hash(out / name),
            'vocab_size': data.tokenizer.vocab_size, **data.fingerprint}
  text = json.dumps(record, indent=1)
  with writing(out / DATA_FILE):
    atomic_write(out / DATA_FILE, lambda tmp: pathlib.Path(tmp).write_text(text))


def read_data_record(out: pathlib.Path) -> dict:
  """``data.json`` of a run, its stored tokenizer checked against its hash."""
  path = pathlib.Path(out) / DATA_FILE
  if not path.exists():
    raise CheckpointError(f'{out} has no {DATA_FILE}: the run directory does not hold '
                          f'its tokenizer and data identity, so it cannot be evaluated, '
                          f'exported or resumed reliably')
  record = read_json(path, required=('tokenizer', 'tokenizer_sha256', 'vocab_size'),
                     error=CheckpointError)
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
               prefix: str = '', sources: list[str] | None = None) -> None:
  """Raises CheckpointError (its message starting with ``prefix``) unless the
  ``splits`` ('train', 'val') of ``data``, read from ``sources`` (the
  ``--data`` paths, ``[]`` for the built-in corpus; None: the run's own), are
  those the run was trained with."""
  record = read_data_record(out)
  recorded = data_sources(out)
  given = (recorded if sources is None else
           [absolute_path(d) for d in sources] or ['the built-in corpus'])
  which = (f'{", ".join(recorded)} changed since' if given == recorded else
           f'the corpus read, {", ".join(given)}, is not the one the run was trained '
           f'on ({", ".join(recorded)}) or that one changed since')
  for split in splits:
    now = (data.fingerprint[f'{split}_tokens'], data.fingerprint[f'{split}_sha256'])
    then = (record[f'{split}_tokens'], record[f'{split}_sha256'])
    if now != then:
      name = 'validation' if split == 'val' else 'training'
      raise CheckpointError(
          f'{prefix}the corpus no longer matches the run {out}: its {name} split is now '
          f'{now[0]:,} tokens (sha256 {now[1][:16]}...), at the start of the run it was '
          f'{then[0]:,} tokens (sha256 {then[1][:16]}..., {out / DATA_FILE}): {which}')


def data_sources(out: pathlib.Path) -> list[str]:
  """The corpus paths of a run's ``run.json``, absolute (:func:`absolute_path`)."""
  saved = read_run_record(pathlib.Path(out) / RUN_FILE)
  return [absolute_path(d) for d in saved.get('data') or ()] or ['the built-in corpus']


def absolute_path(path: str) -> str:
  """``path`` as ``run.json`` records it (:func:`options.resolve_paths`):
  absolute, a leading ``~`` expanded (a relative one, of an older run or of
  an option, read from the working directory)."""
  return os.path.abspath(os.path.expanduser(path))


def read_config(out: str | pathlib.Path) -> TrainConfig:
  """The :class:`TrainConfig` of a run directory (its ``run.json``)."""
  run_file = pathlib.Path(out) / RUN_FILE
  if not run_file.is_file():
    raise CheckpointError(f'{out} is not a run directory (no run.json)')
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  saved = _options(read_run_record(run_file))
  unknown = sorted(set(saved) - fields)
  if unknown:
    raise CheckpointError(f'{run_file} has fields this version does not know: {unknown}')
  return TrainConfig(**saved)
