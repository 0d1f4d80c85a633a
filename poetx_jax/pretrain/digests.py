"""The content digests of a checkpoint step: the size and sha256 of every
file of its items, written to ``digests.json`` as the save commits and
checked before the step is read.

    write_digests(step_dir, ('model', 'opt', 'data', 'meta'))  # step_dir/digests.json
    why = check_digests(step_dir, ('model', 'data', 'meta'))   # None: as saved

A checkpoint file cut short or deleted is found by orbax too; one whose bytes
changed in place, its size kept, reads without an error (a flipped float stays
a float) and only its digest tells. A step saved without digests (by an older
version) is not checked. Hashing reads the files back, from the page cache when
they were just written, at sha256's speed (about 1.5 GB/s a core with the CPU's
SHA instructions) on a few threads.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
from pathlib import Path

from poetx_jax.pretrain.atomic import atomic_write

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
