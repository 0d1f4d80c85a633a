"""Files written whole: a reader sees the old file or the new one, never a
part, and a write cut short by a full disk raises rather than leaving a
short file without a word.

    atomic_write(out / 'run.json', lambda tmp: Path(tmp).write_text(text))
    atomic_write(out / 'tokens.npy', lambda tmp: write_array(tmp, tokens, npy=True))
"""

from __future__ import annotations

import os
import tempfile
import typing as tp
from pathlib import Path

import numpy as np


def _umask() -> int:
  """The process's umask: read from /proc where Linux shows it (setting it to
  read it, the fallback, would briefly change it for every thread)."""
  try:
    with open('/proc/self/status', encoding='ascii') as f:
      for line in f:
        if line.startswith('Umask:'):
          return int(line.split()[1], 8)
  except (OSError, ValueError):
    pass
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def atomic_write(path: str | os.PathLike, write: tp.Callable[[str], object]) -> Path:
  """Writes the file ``path`` whole or not at all.

  ``write(tmp)`` writes the content to ``tmp``, the name of a new temporary
  file beside ``path`` (hidden, ending in ``path``'s suffix, so ``np.save``
  adds none). That file is flushed to disk, given the mode of any new file
  (0666 less the umask) and renamed over ``path``, which is replaced in one
  step. If anything fails the temporary file is removed, ``path`` is left as
  it was and the error propagates. The directory must exist.

  Args:
    path: the file to write.
    write: called with the temporary file's name; its return value is ignored.

  Returns:
    ``path``, as a :class:`~pathlib.Path`.
  """
  path = Path(path)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f'.{path.name}.', suffix=path.suffix)
  os.close(fd)
  try:
    write(tmp)
    fd = os.open(tmp, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


def write_array(path: str | os.PathLike, array: np.ndarray, *, npy: bool = False) -> None:
  """Writes the bytes of the C-contiguous ``array`` to the file ``path``
  (``npy``: as ``np.save`` writes it) through Python's file object, which
  raises on a short write: numpy's ``tofile`` and ``save`` lose the error of
  a write they buffer, leaving the file cut short without a word on a full
  disk."""
  with open(path, 'wb') as f:
    if npy:
      np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(array))
    f.write(memoryview(array).cast('B'))
