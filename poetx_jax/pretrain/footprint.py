"""What a command adds to its output directories, noted before it starts so
that a command refused before it is accepted leaves them as they were.

    footprint = Footprint([out, cache])
    ...                      # the command fails before it is accepted
    footprint.undo()         # out and cache as they were
    created = first_missing(out)  # the outermost directory a command creates
"""

from __future__ import annotations

import os
import shutil
import typing as tp
from pathlib import Path


def first_missing(path: str | os.PathLike) -> Path | None:
  """The outermost of ``path`` and its parents that does not exist, or None."""
  missing = None
  for p in (Path(path).absolute(), *Path(path).absolute().parents):
    if p.exists():
      break
    missing = p
  return missing


class Footprint:
  """What a command may add to the directories ``paths``, noted before it
  starts so that :meth:`undo` can take it back: the directories it creates,
  or the entries it adds to one that exists.

    footprint = Footprint([out, cache])
    ...                      # the command fails before it is accepted
    footprint.undo()         # out and cache as they were
  """

  def __init__(self, paths: tp.Iterable[str | os.PathLike]):
    self._marks = []
    for path in dict.fromkeys(Path(p).absolute() for p in paths):
      created = first_missing(path)
      before = {e.name for e in path.iterdir()} if created is None and path.is_dir() else set()
      self._marks.append((path, created, before))

  def undo_empty_dirs(self) -> None:
    """Removes the directories created since that are still empty (a
    command refused before it wrote anything), leaving whatever another
    process put there."""
    for path, created, _ in self._marks:
      if created is None:
        continue
      for p in (path, *path.parents):
        try:
          p.rmdir()
        except OSError:  # not empty, or gone
          break
        if p == created:
          break

  def undo(self) -> None:
    """Removes the directories created since, and the entries added to those
    that existed (a file replaced in place is not restored)."""
    for path, created, before in self._marks:
      if created is not None:
        shutil.rmtree(created, ignore_errors=True)
        continue
      for entry in path.iterdir() if path.is_dir() else ():
        if entry.name not in before:
          if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
          else:
            entry.unlink(missing_ok=True)
