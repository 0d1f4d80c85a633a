"""orbax checkpoints of a whole training state: model, optimizer, data, metadata.

One checkpoint step holds four items: ``model`` (every variable of the model,
POET base weights and permutations included), ``opt`` (the ``nnx.Optimizer``
state and step), ``data`` (the data iterator's state, JSON) and ``meta`` (JSON:
the run's configuration and anything else the caller wants back).
"""

from __future__ import annotations

import pathlib
import typing as tp

import jax
import orbax.checkpoint as ocp
from flax import nnx


class CheckpointError(RuntimeError):
  """A checkpoint is missing, corrupt, or does not fit the model it restores into."""


def _pure(node):
  return nnx.to_pure_dict(nnx.state(node))


def _abstract(tree):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
  """Saves and restores training state with an ``orbax`` ``CheckpointManager``.

  Saves are asynchronous (training continues while the arrays are written);
  ``max_to_keep`` keeps the newest N steps.

  Args:
    directory: where the step folders go (created if absent).
    max_to_keep: number of checkpoints kept.
    async_save: write in a background thread.
  """

  def __init__(self, directory: str | pathlib.Path, *, max_to_keep: int = 3,
               async_save: bool = True):
    if max_to_keep < 1:
      raise ValueError(f'max_to_keep must be >= 1, got {max_to_keep}')
    self.directory = pathlib.Path(directory).absolute()
    self._mgr = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
            create=True))

  def latest_step(self) -> int | None:
    return self._mgr.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._mgr.all_steps())

  def save(self, step: int, model, optimizer, *, data_state: dict,
           meta: dict) -> None:
    """Starts saving; returns once the arrays are copied off the devices."""
    self._mgr.save(step, args=ocp.args.Composite(
        model=ocp.args.StandardSave(_pure(model)),
        opt=ocp.args.StandardSave(_pure(optimizer)),
        data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta)), force=True)

  def read_meta(self, step: int | None = None) -> tuple[int, dict]:
    """(step, meta) of a checkpoint without touching any array."""
    step = self._resolve(step)
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
    """
    step = self._resolve(step)
    nodes = {'model': model} if optimizer is None else {'model': model, 'opt': optimizer}
    targets = {k: _pure(v) for k, v in nodes.items()}
    try:
      out = self._mgr.restore(step, args=ocp.args.Composite(
          data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore(),
          **{k: ocp.args.StandardRestore(_abstract(t)) for k, t in targets.items()}))
    except Exception as e:
      sizes = ', '.join(f'{len(jax.tree.leaves(t))} {k} arrays' for k, t in targets.items())
      raise CheckpointError(
          f'checkpoint step {step} in {self.directory} does not fit this model '
          f'(expected {sizes} with the shapes of the current configuration): {e}') from e
    for k, node in nodes.items():
      state = nnx.state(node)
      nnx.replace_by_pure_dict(state, out[k])
      nnx.update(node, state)
    return step, out['data'], out['meta']

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
    """Blocks until pending asynchronous saves are on disk."""
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()

  def __enter__(self) -> 'Checkpointer':
    return self

  def __exit__(self, *exc: tp.Any) -> None:
    self.close()
