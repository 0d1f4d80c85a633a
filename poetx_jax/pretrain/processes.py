"""What the processes of a multi-process run agree on.

With one process every function here is immediate and collective-free. With
several (``jax.distributed``), each call is a collective: every process must
make the same calls in the same order.
"""

from __future__ import annotations

import typing as tp

import jax
import numpy as np

T = tp.TypeVar('T')


def is_primary() -> bool:
  """Whether this is the first process: the one that writes the run's files."""
  return jax.process_index() == 0


def agree_max(value: int) -> int:
  """The largest of every process's ``value``."""
  if jax.process_count() == 1:
    return int(value)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def on_primary(what: str, fn: tp.Callable[[], T]) -> T | None:
  """``fn()`` on the first process, the others waiting for it; its result there,
  None elsewhere. If it raises, the first process raises its error and the
  others a RuntimeError saying that ``what`` failed there (none is left
  waiting)."""
  result, error = None, None
  if is_primary():
    try:
      result = fn()
    except BaseException as e:  # pylint: disable=broad-except
      error = e
  if agree_max(error is not None) and not is_primary():
    raise RuntimeError(f'{what} failed on process 0 (its output says why)')
  if error is not None:
    raise error
  return result
