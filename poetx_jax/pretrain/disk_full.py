"""Writes refused for want of space (a full device, a disk quota reached, a
file over the size limit): told apart from other errors, wherever they are
raised (an OSError, TensorStore's and Rust's messages), and raised again as
:class:`DiskFull`, which names what was being written and makes ``poetx``
exit 6.

    code = full_disk(error)                           # ENOSPC, EDQUOT, EFBIG or None
    with writing(out / 'metrics.jsonl'): ...          # a full disk: DiskFull
    with when_full(lambda e, code: Stop(...)): ...    # a full disk: the caller's error
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import typing as tp


# What a write refused for want of space is, and what the user can do.
_FULL = {errno.ENOSPC: ('no space left on device', 'free space'),
         errno.EDQUOT: ('disk quota exceeded', 'free space or raise the quota'),
         errno.EFBIG: ('file size limit reached (ulimit -f, or the file system\'s '
                       'largest file)', 'raise the file size limit')}
# The error code in the messages of TensorStore (orbax's array files), Rust
# (tokenizers) and of an OSError's text passed on.
_CODE = re.compile(r"os_error_code='(\d+)'|\(os error (\d+)\)|\[Errno (\d+)\]")


class DiskFull(OSError):
  """A write refused for want of space: the device is full (ENOSPC), the disk
  quota reached (EDQUOT) or a file over the size limit (EFBIG, ``errno``). Its
  message says what was being written and what is kept; ``poetx`` exits 6.

  Attributes:
    errno: the error code.
    remedy: what makes the write possible again, e.g. ``'free space'``.
  """
  exit_code = 6

  def __init__(self, message: str, code: int):
    super().__init__(message)
    self.errno = code

  def __reduce__(self):  # raised in a worker process, read in its parent
    return type(self), (str(self), self.errno)

  @property
  def remedy(self) -> str:
    return full_disk_remedy(self.errno)


def full_disk(e: BaseException) -> int | None:
  """The error code (ENOSPC, EDQUOT or EFBIG) of a full disk that caused
  ``e``: an OSError's ``errno``, or the code in the message of a TensorStore
  or Rust error, in ``e`` or its causes and contexts; None if none did."""
  seen, todo = set(), [e]
  while todo:
    e = todo.pop()
    if e is None or id(e) in seen:
      continue
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in _FULL:
      return e.errno
    for m in _CODE.finditer(str(e)[:100_000]):
      code = int(next(g for g in m.groups() if g))
      if code in _FULL:
        return code
    todo += [e.__cause__, e.__context__]
  return None


def full_disk_text(code: int) -> str:
  """What the full disk of error code ``code`` is: 'no space left on device', ..."""
  return _FULL[code][0]


def full_disk_remedy(code: int) -> str:
  """What makes room for the write refused with ``code``: 'free space', ..."""
  return _FULL[code][1]


@contextlib.contextmanager
def when_full(stop: tp.Callable[[BaseException, int], BaseException]) -> tp.Iterator[None]:
  """Where the block fails for want of space (:func:`full_disk`), raises
  ``stop(error, code)`` from the error (``stop`` may clean up first, and may
  return the error itself to pass it on); any other error passes as it is."""
  try:
    yield
  except Exception as e:  # pylint: disable=broad-except
    code = full_disk(e)
    if code is None:
      raise
    new = stop(e, code)
    if new is e:
      raise
    raise new from e


def writing(what: str | os.PathLike) -> tp.ContextManager[None]:
  """Raises :class:`DiskFull` ``'<why> writing <what>'`` where the block fails
  for want of space (a DiskFull, and any other error, passes as it is)."""
  return when_full(lambda e, code: e if isinstance(e, DiskFull) else DiskFull(
      f'{full_disk_text(code)} writing {what}', code))
