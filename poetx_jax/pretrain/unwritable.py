"""Directories this process cannot write in (a part of the path a file,
permission denied, a read-only file system): found before a command writes
or computes anything, or told from the error met writing there, and refused
with one line naming the option that gave the directory.

    check_writable(out, '--out')                                       # ValueError: why
    with writing_in(cache, cache / 'tokens.npy', '--cache-dir'): ...  # unwritable: one line
"""

from __future__ import annotations

import contextlib
import errno
import os
import typing as tp
from pathlib import Path

from poetx_jax.pretrain.disk_full import full_disk, writing

# Errors that say a directory cannot be written in, as its error message says them.
_UNWRITABLE = {errno.EACCES: 'permission denied (a read-only directory?)',
               errno.EPERM: 'permission denied (a read-only directory?)',
               errno.EROFS: 'it is on a read-only file system'}


def nearest_existing(path: str | os.PathLike) -> Path:
  """The nearest of ``path`` (made absolute) and its parents that exists."""
  absolute = Path(path).absolute()
  return next((p for p in (absolute, *absolute.parents) if p.exists()), Path(absolute.anchor))


def not_a_directory(directory: str | os.PathLike) -> str | None:
  """Why ``directory`` can be no directory: the nearest of it and its parents
  that exists is a file (said so); None if that one is a directory."""
  p = nearest_existing(directory)
  return None if p.is_dir() else f'{p} is a file, not a directory'


def _why_unwritable(directory: str | os.PathLike) -> str | None:
  """Why this process cannot create files in ``directory``, or create it:
  the nearest of it and its parents that exists is a file, or a directory
  it may not write in (its mode, or a read-only file system); None if it can."""
  why = not_a_directory(directory)
  if why is not None:
    return why
  p = nearest_existing(directory)
  if os.access(p, os.W_OK | os.X_OK):
    return None
  try:
    read_only = bool(os.statvfs(p).f_flag & os.ST_RDONLY)
  except OSError:
    read_only = False
  return ('it is on a read-only file system' if read_only else
          f'permission denied: this process may not write in {p}')


def check_writable(directory: str | os.PathLike, option: str) -> None:
  """Raises ValueError ``'<option> <directory> cannot be written: <why>'``
  unless this process can create files in the directory ``directory``, or
  create it: for a command to refuse its output location before it writes
  or computes anything."""
  why = _why_unwritable(directory)
  if why is not None:
    raise ValueError(_unwritable_text(option, directory, why))


def _unwritable_text(option: str, directory, why: str) -> str:
  return (f'{option} {directory} cannot be written: {why}; give a directory this process '
          f'can write in')


def unwritable(e: BaseException, directory: str | os.PathLike) -> str | None:
  """Why the directory ``directory`` cannot be written in, where ``e``, an
  error met creating or writing there, says it cannot: a part of its path is
  a file, permission denied, a read-only file system; None for another error
  (a full disk among them)."""
  if not isinstance(e, OSError) or full_disk(e) is not None:
    return None
  why = _why_unwritable(directory)
  if why is None and e.errno in _UNWRITABLE:
    return _UNWRITABLE[e.errno]
  return why


@contextlib.contextmanager
def refused_unless_writable(directory: str | os.PathLike, option: str) -> tp.Iterator[None]:
  """Where the block fails for want of the right to write in ``directory``
  (:func:`unwritable`), raises ValueError as :func:`check_writable` does;
  any other error passes as it is."""
  try:
    yield
  except OSError as e:
    why = unwritable(e, directory)
    if why is None:
      raise
    raise ValueError(_unwritable_text(option, directory, why)) from None


@contextlib.contextmanager
def writing_in(directory: str | os.PathLike, path: str | os.PathLike,
               option: str) -> tp.Iterator[None]:
  """Creates the directory ``directory`` (and its parents) if missing for a
  block that writes the file ``path`` in it. Where the directory cannot be
  written in, before the block or in it, raises ValueError ``'<option>
  <directory> cannot be written: <why>'`` (:func:`check_writable`); where
  the disk is full, :class:`DiskFull` naming ``path`` (:func:`writing`); any
  other error passes as it is."""
  check_writable(directory, option)
  with refused_unless_writable(directory, option), writing(path):
    Path(directory).mkdir(parents=True, exist_ok=True)
    yield
