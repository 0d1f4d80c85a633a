"""Files written whole (a reader sees the old file or the new one, never a
part), JSON-lines files read back though a crash may have cut their last line
short, the content digests of a checkpoint step, writes refused for want of
space, and directories that cannot be written in.

    atomic_write(out / 'run.json', lambda tmp: Path(tmp).write_text(text))
    atomic_write(out / 'tokens.npy', lambda tmp: write_array(tmp, tokens, npy=True))
    records = read_jsonl(out / 'metrics.jsonl', warn=print, required=('step',))
    record = read_json(out / 'data.json', required=('tokenizer',))  # damage named
    write_digests(step_dir, ('model', 'opt', 'data', 'meta'))  # step_dir/digests.json
    why = check_digests(step_dir, ('model', 'data', 'meta'))   # None: as saved
    with writing(out / 'metrics.jsonl'): ...                   # a full disk: DiskFull
    with writing_in(cache, cache / 'tokens.npy', '--cache-dir'): ...  # unwritable: one line

A checkpoint file cut short or deleted is found by orbax too; one whose bytes
changed in place, its size kept, reads without an error (a flipped float stays
a float) and only its digest tells. A step saved without digests (by an older
version) is not checked. Hashing reads the files back, from the page cache when
they were just written, at sha256's speed (about 1.5 GB/s a core with the CPU's
SHA instructions) on a few threads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
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


def read_json(path: str | os.PathLike, *, required: tuple[str, ...] = (),
              error: type[Exception] = ValueError) -> dict:
  """The JSON object of the file ``path``, with the keys ``required``.

  Raises:
    error: naming the file and what is wrong: unreadable, not JSON, not an
      object, or missing a required key (FileNotFoundError when absent).
  """
  try:
    record = json.loads(Path(path).read_bytes().decode())
    if not isinstance(record, dict):
      raise ValueError(f'a JSON {type(record).__name__}, not an object')
    missing = [k for k in required if k not in record]
    if missing:
      raise ValueError(f'no {", ".join(map(repr, missing))}')
  except FileNotFoundError:
    raise
  except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    raise error(f'{path} is damaged ({e}); it cannot be read as the record it should be') from None
  return record


DIGESTS = 'digests.json'
_HASH_THREADS = min(4, os.cpu_count() or 1)


def _sha256(path: Path) -> str:
  with open(path, 'rb') as f:
    return hashlib.file_digest(f, 'sha256').hexdigest()


def _hashes(root: Path, names: list[str]) -> dict[str, str]:
  """{name: sha256} of the files ``root/name``, hashed on a few threads
  (hashlib releases the GIL)."""
  if len(names) < 2:
    return {n: _sha256(root / n) for n in names}
  with concurrent.futures.ThreadPoolExecutor(_HASH_THREADS) as pool:
    return dict(zip(names, pool.map(lambda n: _sha256(root / n), names)))


def write_digests(step_dir: str | os.PathLike, items: tuple[str, ...]) -> dict:
  """Writes ``step_dir/digests.json``: the size and sha256 of every file under
  the ``items`` folders of the step (the step's own metadata files, which
  orbax rewrites as it commits, are left out); returns the record."""
  root = Path(step_dir)
  names = sorted(str(p.relative_to(root)) for item in items
                 for p in (root / item).rglob('*') if p.is_file())
  hashes = _hashes(root, names)
  record = {'algorithm': 'sha256',
            'files': {n: [(root / n).stat().st_size, hashes[n]] for n in names}}
  text = json.dumps(record, indent=0)
  atomic_write(root / DIGESTS, lambda tmp: Path(tmp).write_text(text))
  return record


def check_digests(step_dir: str | os.PathLike, items: tuple[str, ...]) -> str | None:
  """Why the ``items`` of the step in ``step_dir`` are not as saved (an item
  or file missing, a size or a digest changed), or None if they are, or if
  the step has no digests to check against."""
  root = Path(step_dir)
  if not (root / DIGESTS).exists():
    return None
  try:
    files = json.loads((root / DIGESTS).read_text())['files']
    files = {n: (int(size), str(digest)) for n, (size, digest) in files.items()}
  except (OSError, ValueError, KeyError, TypeError) as e:
    return f'its {DIGESTS} cannot be read ({type(e).__name__}: {e})'
  names = [n for n in files if n.split('/')[0] in items]
  for item in items:
    if not (root / item).is_dir():
      return f'its {item} item is missing'
  for n in names:
    if not (root / n).is_file():
      return f'its file {n} is missing'
    size = (root / n).stat().st_size
    if size != files[n][0]:
      return f'its file {n} is {size} bytes, {files[n][0]} when saved'
  for n, now in _hashes(root, names).items():
    if now != files[n][1]:
      return (f'its file {n} changed since it was saved (its size kept, sha256 '
              f'{now[:12]}..., saved as {files[n][1][:12]}...)')
  return None


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
