"""orbax checkpoints of a whole training state: model, optimizer, data, metadata.

One checkpoint step holds four items: ``model`` (every variable of the model,
POET base weights and permutations included), ``opt`` (the ``nnx.Optimizer``
state and step), ``data`` (the data iterator's state, JSON) and ``meta`` (JSON:
the run's configuration and anything else the caller wants back).

Each step also holds ``digests.json``, the sha256 of every file of its items
(digests.py), written as the save commits and checked before the step is
read. A restore that fails is diagnosed: a step with an item missing or
unreadable (a missing manifest, an empty JSON item, a truncated array file)
or a file whose bytes changed since it was saved raises
:class:`DamagedCheckpoint`; one that reads but holds other arrays or shapes
than the model (a configuration mismatch) raises :class:`CheckpointError`
saying it does not fit, naming the first differences.

A save refused for want of space (disk_full.py's :class:`DiskFull`: the device
full, a quota or the file size limit reached), in orbax's background threads
or not, raises DiskFull naming the step from the call that meets it (the
next save, :meth:`Checkpointer.wait` or :meth:`Checkpointer.close`), once
those threads have ended. The step stays orbax's temporary folder, never a
step that restores (and named as unfinished on ``--resume``); the steps
before it stay as they were: orbax removes the old steps only once a save
commits. The failed save's abandoned writes that finish afterwards print
nothing (checkpoint_faults.py's ``drop_late_results``, installed by every
:class:`Checkpointer`).
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import shutil
import time
import typing as tp

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

import poetx_jax
from poetx_jax.pretrain import processes
from poetx_jax.pretrain.checkpoint_faults import (NO_FULL_DISK_ERRORS, drop_late_results,
                                                  first_line, flat_shapes,
                                                  join_operation_threads, quiet, tree_diff)
from poetx_jax.pretrain.digests import check_digests, write_digests
from poetx_jax.pretrain.disk_full import DiskFull, full_disk_remedy, full_disk_text, when_full

JSON_ITEMS = ('meta', 'data')
ITEMS = ('model', 'opt', *JSON_ITEMS)


class CheckpointError(RuntimeError):
  """A checkpoint is missing, corrupt, or does not fit the model it restores into."""


class DamagedCheckpoint(CheckpointError):
  """A checkpoint step that cannot be read, or not as it was saved: an item
  missing, empty or truncated, or a file's bytes changed.

  Attributes:
    step: the damaged step.
  """

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


def _pure(node):
  return nnx.to_pure_dict(nnx.state(node))


def _abstract(tree):
  """``tree`` as ShapeDtypeStructs to restore into: arrays keep their shardings,
  shapes given without one (an ``nnx.eval_shape`` model) get the default device."""
  device = jax.config.jax_default_device  # None, a device or a platform name
  if not isinstance(device, jax.Device):
    device = jax.local_devices(backend=device)[0]
  default = jax.sharding.SingleDeviceSharding(device)

  def target(leaf):
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=default)
    return ocp.utils.to_shape_dtype_struct(leaf)

  return jax.tree.map(target, tree)


class Checkpointer:
  """Saves and restores training state with an ``orbax`` ``CheckpointManager``.

  Saves are asynchronous (training continues while the arrays are written and
  then hashed into the step's ``digests.json``, before orbax commits it);
  ``max_to_keep`` keeps the newest N steps.

  Args:
    directory: where the step folders go (created if absent, unless ``create``
      is off).
    max_to_keep: number of checkpoints kept.
    async_save: write in a background thread.
    create: create ``directory`` if absent; off (to read checkpoints only),
      an absent one is a ``CheckpointError`` and nothing is written.
  """

  def __init__(self, directory: str | pathlib.Path, *, max_to_keep: int = 3,
               async_save: bool = True, create: bool = True):
    if max_to_keep < 1:
      raise ValueError(f'max_to_keep must be >= 1, got {max_to_keep}')
    self.directory = pathlib.Path(directory).absolute()
    if not create and not self.directory.is_dir():
      raise CheckpointError(f'no checkpoint in {self.directory} (no such directory)')
    self._async = async_save
    self._saving = None  # the step whose save is under way
    logger = logging.getLogger('absl')  # orbax logs there
    if NO_FULL_DISK_ERRORS not in logger.filters:
      logger.addFilter(NO_FULL_DISK_ERRORS)
    drop_late_results()
    self._mgr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
            create=create,
            async_options=ocp.AsyncOptions(
                post_finalization_callback=self._write_digests) if async_save else None))

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mgr.all_steps())

  def unfinished_steps(self) -> list[int]:
    """The steps whose save began and never committed (orbax's temporary
    folders: a kill or crash struck while they were written)."""
    found = {p.name.split('.', 1)[0] for p in self.directory.glob('*.orbax-checkpoint-tmp*')}
    return sorted(int(s) for s in found if s.isdigit())

  def committed_steps(self) -> list[int]:
    """The steps whose save committed, as the directory holds them now (after
    a failed save, orbax's own list may leave out steps that are there)."""
    return sorted(int(p.name) for p in self.directory.iterdir()
                  if p.name.isdigit() and p.is_dir())

  def save(self, step: int, model, optimizer, *, data_state: dict,
           meta: dict) -> None:
    """Starts saving; returns once the arrays are copied off the devices.

    Raises:
      DiskFull: this save, or the previous one, was refused for want of space.
    """
    with self._full_disk():
      self._mgr.wait_until_finished()  # the previous save's digests are written
    self._saving = step
    with self._full_disk():
      self._mgr.save(step, args=ocp.args.Composite(
          model=ocp.args.StandardSave(_pure(model)),
          opt=ocp.args.StandardSave(_pure(optimizer)),
          data=ocp.args.JsonSave(data_state),
          meta=ocp.args.JsonSave(meta)), force=True)
      if not self._async:  # committed already: digests beside it
        processes.on_primary('writing the checkpoint digests',
                             lambda: write_digests(self.directory / str(step), ITEMS))

  def _full_disk(self) -> tp.ContextManager[None]:
    """Raises DiskFull naming the step being saved where the block fails for
    want of space, once orbax's threads for it have ended."""
    def stop(e, code):
      del e
      with contextlib.suppress(Exception):  # the failed save's other threads
        self._mgr.wait_until_finished()
      join_operation_threads()
      return DiskFull(f'{full_disk_text(code)} writing the checkpoint of step {self._saving} '
                      f'under {self.directory} (its unfinished folder is never restored)', code)
    return when_full(stop)

  def _write_digests(self) -> None:
    """Hashes the step being saved, once written and before orbax commits it
    (renames its temporary folder): orbax calls this on the first process
    only, in its background thread."""
    step = self._saving
    pending = list(self.directory.glob(f'{step}.orbax-checkpoint-tmp*'))
    where = pending[0] if len(pending) == 1 else self.directory / str(step)
    if not where.is_dir():
      raise CheckpointError(f'cannot find the folder of checkpoint step {step} being saved '
                            f'in {self.directory} to hash it (found {pending})')
    write_digests(where, ITEMS)

  def read_meta(self, step: int | None = None) -> tuple[int, dict]:
    """(step, meta) of a checkpoint without touching any array."""
    step = self._resolve(step)
    self._check_digests(step, ('meta',))
    try:
      out = self._mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises several types for unreadable files
      raise CheckpointError(f'cannot read the metadata of checkpoint step {step} in '
                            f'{self.directory}: {e}') from e
    return step, out['meta']

  def restore(self, model, optimizer=None,
              step: int | None = None) -> tuple[int, dict, dict]:
    """Restores ``model`` (and ``optimizer``, unless None) in place.

    They must have the structure of the saved ones (build them from the same
    configuration first); arrays land with their shardings. Without an
    optimizer its state is not read at all (evaluation, export). Returns
    ``(step, data_state, meta)``.

    Raises:
      DamagedCheckpoint: the step cannot be read (nothing is restored).
      CheckpointError: no such step, or it does not fit the model.
    """
    step = self._resolve(step)
    nodes = {'model': model} if optimizer is None else {'model': model, 'opt': optimizer}
    out = self._read(step, {k: _pure(v) for k, v in nodes.items()})
    for k, node in nodes.items():
      state = nnx.state(node)
      nnx.replace_by_pure_dict(state, out[k])
      nnx.update(node, state)
    self._check_permutations(step, model)
    return step, out['data'], out['meta']

  def _check_permutations(self, step: int, model) -> None:
    try:
      poetx_jax.check_permutations(model)
    except ValueError as e:
      raise CheckpointError(f'checkpoint step {step} in {self.directory} does not fit this '
                            f'model: {e}') from None

  def restore_model(self, abstract_model, step: int | None = None) -> tuple[tp.Any, int]:
    """The model of checkpoint ``step`` (the newest if None), built from its arrays.

    ``abstract_model`` gives the structure: the model as shapes only, e.g.
    ``nnx.eval_shape(lambda: build_model(cfg, mc))``, so no weights are drawn
    or allocated before the saved ones are read. Arrays land on the default
    device unless the shapes carry shardings. No optimizer state is read.
    Returns ``(model, step)``; raises as :meth:`restore`.
    """
    step = self._resolve(step)
    graphdef, state = nnx.split(abstract_model)
    out = self._read(step, {'model': nnx.to_pure_dict(state)})
    nnx.replace_by_pure_dict(state, out['model'])
    model = nnx.merge(graphdef, state)
    self._check_permutations(step, model)
    return model, step

  def _read(self, step: int, targets: dict) -> dict:
    """The items of checkpoint ``step``: ``data``, ``meta`` and one per
    ``targets`` entry (a pure dict of arrays or shapes), restored to them,
    once their files are checked against the step's digests."""
    self._check_digests(step, (*JSON_ITEMS, *targets))
    try:
      with quiet():
        out = self._mgr.restore(step, args=ocp.args.Composite(
            data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore(),
            **{k: ocp.args.StandardRestore(_abstract(t)) for k, t in targets.items()}))
      if any(out[k] is None for k in JSON_ITEMS):
        raise ValueError('an empty JSON item')
    except Exception as e:  # orbax raises several types for unreadable files
      raise self._diagnose(step, targets, e) from e
    return out

  def resume(self, model, optimizer, *, step: int | None, run: pathlib.Path,
             log=print) -> tuple[int, dict]:
    """Restores the newest intact checkpoint (or ``step``) for ``--resume`` of the
    run directory ``run``; returns ``(step, data_state)``.

    Without ``step``, each damaged checkpoint is named, the newest intact one
    used (loudly) and the damaged ones moved to a new folder
    ``run/damaged-checkpoints/TIME`` (only once one has restored). With
    ``step``, the newer checkpoints are moved to a new folder
    ``run/abandoned-checkpoints/TIME-resumed-from-STEP``: the run continues from
    ``step``. Each setting aside has its folder: none replaces another.
    """
    steps = sorted(self.all_steps(), reverse=True)
    if not steps:
      raise CheckpointError(f'--resume: no checkpoint in {self.directory} to resume from; '
                            f'start the run afresh (without --resume)')
    now = time.strftime('%Y-%m-%dT%H-%M-%S')
    if step is not None:
      restored, data_state, _ = self.restore(model, optimizer, step=step)
      newer = sorted(s for s in steps if s > step)
      if newer:
        dest = self.set_aside(newer, run / 'abandoned-checkpoints' / f'{now}-resumed-from-{step}')
        log(f'--step {step}: moved the newer checkpoint steps {newer} to {dest}')
      return restored, data_state
    damaged = []
    for s in steps:
      try:
        restored, data_state, _ = self.restore(model, optimizer, step=s)
      except DamagedCheckpoint as e:
        log(f'WARNING: {e}')
        damaged.append(s)
        continue
      if damaged:
        dest = self.set_aside(damaged, run / 'damaged-checkpoints' / now)
        log(f'WARNING: resuming from step {restored}, the newest intact checkpoint, not '
            f'{steps[0]}: the damaged steps {damaged} are moved to {dest}')
      return restored, data_state
    raise CheckpointError(f'--resume: every checkpoint in {self.directory} is damaged '
                          f'(steps {steps}); nothing to resume from')

  def _check_digests(self, step: int, items: tuple[str, ...]) -> None:
    """Raises DamagedCheckpoint unless the files of ``items`` of ``step`` are
    those saved (the first process reads and hashes them, for all)."""
    why = check_digests(self.directory / str(step), items) if processes.is_primary() else None
    if processes.agree_max(why is not None):
      raise self._damaged(step, why or 'its files differ from those saved (the first '
                                       'process says which)')

  def _damaged(self, step: int, why: str) -> DamagedCheckpoint:
    others = sorted(s for s in self.all_steps() if s != step)
    hint = (f'; the other checkpoints are steps {others} (pick one with --step)'
            if others else '')
    return DamagedCheckpoint(f'checkpoint step {step} in {self.directory} is damaged: '
                             f'{why}{hint}', step)

  def _diagnose(self, step: int, targets: dict, error: Exception) -> CheckpointError:
    """Why restoring ``step`` into ``targets`` failed: a DamagedCheckpoint when an
    item is missing or unreadable, a CheckpointError when the arrays read but
    do not fit."""
    where = self.directory / str(step)

    def damaged(why):
      return self._damaged(step, why)

    for name in (*JSON_ITEMS, *targets):
      if not (where / name).is_dir():
        return damaged(f'its {name} item is missing')
    for name in JSON_ITEMS:
      try:
        with quiet():
          item = self._mgr.restore(step, args=ocp.args.Composite(
              **{name: ocp.args.JsonRestore()}))[name]
      except Exception:  # pylint: disable=broad-except
        item = None
      if item is None:
        return damaged(f'its {name} item is empty or not JSON')
    for name, target in targets.items():
      try:
        with quiet():
          saved = ocp.StandardCheckpointHandler().metadata(epath.Path(where / name))
      except Exception as e:  # pylint: disable=broad-except
        return damaged(f'the metadata of its {name} item cannot be read ({first_line(e)})')
      shapes = flat_shapes(saved)
      diff = tree_diff(shapes, flat_shapes(target))
      if diff and any(k.startswith('opt_state/acc_grads/') for k in shapes):
        return CheckpointError(
            f'checkpoint step {step} in {self.directory} holds an optax.MultiSteps '
            f'state: it was written with --grad-accum by a poetx_jax that accumulated '
            f'gradients in the optimizer; the train step sums them now, and that state '
            f'does not restore into it. Resume it with the version that wrote it, or start '
            f'the run afresh')
      if diff:
        return CheckpointError(
            f'checkpoint step {step} in {self.directory} does not fit this model: its '
            f'{name} item differs ({diff}); the run\'s configuration is not the one that '
            f'wrote it')
    return damaged(f'its arrays cannot be read ({first_line(error)})')

  def set_aside(self, steps: list[int], folder: str | pathlib.Path) -> pathlib.Path:
    """Moves checkpoint ``steps`` out of this directory into the new folder
    ``folder`` (``folder-2``, ``-3``, ... if that exists), where neither
    restores nor saves see them; returns the folder."""
    folder = pathlib.Path(folder)

    def move():  # once, by the first of several processes
      dest, n = folder, 1
      while dest.exists():
        n += 1
        dest = folder.with_name(f'{folder.name}-{n}')
      dest.mkdir(parents=True)
      for step in steps:
        shutil.move(self.directory / str(step), dest / str(step))
      return dest

    dest = processes.on_primary(f'setting checkpoint steps {steps} aside', move)
    self._mgr.reload()
    return dest or folder

  def _resolve(self, step):
    steps = self.all_steps()
    if not steps:
      raise CheckpointError(f'no checkpoint in {self.directory}')
    if step is None:
      return max(steps)
    if step not in steps:
      raise CheckpointError(f'no checkpoint step {step} in {self.directory}; '
                            f'available: {sorted(steps)}')
    return step

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk (DiskFull as :meth:`save`)."""
    with self._full_disk():
      self._mgr.wait_until_finished()

  def close(self) -> None:
    """Waits for the pending saves (DiskFull as :meth:`save`) and closes."""
    self.wait()
    self._mgr.close()

  def __enter__(self) -> 'Checkpointer':
    return self

  def __exit__(self, *exc: tp.Any) -> None:
    self.close()


def saved_steps(directory: str | pathlib.Path) -> list[int]:
  """The steps saved in a checkpoint ``directory``, oldest first (none where
  it does not exist); reads only, creates nothing."""
  if not pathlib.Path(directory).is_dir():
    return []
  ckpt = Checkpointer(directory, create=False)
  try:
    return sorted(ckpt.all_steps())
  finally:
    ckpt.close()


def resumed_message(step: int, total: int, reached: int, unfinished: list[int], *,
                    chosen: bool = False) -> str:
  """What a resume from checkpoint ``step`` of a ``total``-step run continues
  from, and what it trains again: the steps up to ``reached`` (the last the
  run logged) and why they were not saved (a save ``unfinished``, or none
  begun), or, where ``step`` was ``chosen`` (``--resume --step``), that.

    >>> resumed_message(8, 20, 14, [12])[:60]
    'resumed from step 8, its newest whole checkpoint: the run ha'
  """
  if step >= total:
    return f'resumed from step {step}: the run is complete ({total} steps); raise --steps ' \
           f'to extend it'
  if reached <= step:
    return f'resumed from step {step}'
  again = (f'step {reached} is' if reached == step + 1 else
           f'steps {step + 1}-{reached} are')
  if chosen:
    return (f'resumed from step {step}, as --step chose: the run had reached step {reached}, '
            f'so {again} trained again')
  struck = [s for s in unfinished if step < s <= reached]
  why = (f'the save of step {struck[-1]} had not finished when the run stopped (a kill, a '
         f'crash or a full disk struck while it was written)' if struck else
         'the run stopped before its next checkpoint (a kill or crash: a SIGTERM or Ctrl-C '
         'saves first)')
  return (f'resumed from step {step}, its newest whole checkpoint: the run had reached step '
          f'{reached}, so {again} trained again; {why}')


def full_disk_stop(error: BaseException, code: int, run: pathlib.Path,
                   steps: list[int]) -> DiskFull:
  """The DiskFull that stops the training in the run directory ``run`` whose
  write ``error`` was refused for want of space (error code ``code``): what
  was being written, the newest of the whole checkpoints ``steps`` and what
  to do.

    >>> str(full_disk_stop(OSError(28, 'No space', 'm.jsonl'), 28, pathlib.Path('r'), [4]))[:65]
    'no space left on device writing m.jsonl; the checkpoint of step 4'
  """
  what = (str(error) if isinstance(error, DiskFull) else
          f'{full_disk_text(code)} writing {getattr(error, "filename", None) or f"in {run}"}')
  remedy = full_disk_remedy(code)
  then = (f'the checkpoint of step {steps[-1]} is intact: {remedy} and run again with --resume'
          if steps else f'no checkpoint is written yet: {remedy} and run the command again '
                        f'(without --resume) to start afresh')
  return DiskFull(f'{what}; {then}', code)
