"""Files written whole (a reader sees the old file or the new one, never a
part), and JSON-lines files read back though a crash may have cut their last
line short.

    atomic_write(out / 'run.json', lambda tmp: Path(tmp).write_text(text))
    atomic_write(out / 'tokens.npy', lambda tmp: np.save(tmp, tokens))
    records = read_jsonl(out / 'metrics.jsonl', warn=print, required=('step',))
"""

from __future__ import annotations

import json
import os
import tempfile
import typing as tp
from pathlib import Path


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


def read_jsonl(path: str | os.PathLike, *, warn: tp.Callable[[str], object],
               required: tuple[str, ...] = ()) -> list[dict]:
  """The records of a JSON-lines file: one JSON object a line, each with the
  keys ``required``; blank lines are skipped.

  A damaged last line (what a crash in the middle of appending leaves) is
  dropped, with ``warn(message)`` naming the file and line. A damaged line
  before the last raises ValueError naming the file and line.
  """
  lines = Path(path).read_bytes().split(b'\n')
  last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
  records = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      record = json.loads(line.decode())
      if not isinstance(record, dict):
        raise ValueError(f'a JSON {type(record).__name__}, not an object')
      missing = [k for k in required if k not in record]
      if missing:
        raise ValueError(f'no {", ".join(map(repr, missing))}')
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
      if i == last:
        warn(f'WARNING: {path} line {i + 1} is cut short (a write interrupted by a crash?): '
             f'dropped')
        continue
      raise ValueError(f'{path} line {i + 1} is not a JSON record ({e}); repair or delete '
                       f'that line') from None
    records.append(record)
  return records
