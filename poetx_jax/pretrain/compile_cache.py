"""``poetx train``'s persistent compilation cache (``--compile-cache``): jax's
cache set to a directory, its entries cut short on a full device removed, and
left unused where its device is nearly full."""

from __future__ import annotations

import pathlib
import shutil

import jax

from poetx_jax.pretrain.unwritable import nearest_existing, not_a_directory

# A run leaves its compile cache unused when the cache's device has less free
# than this: jax writes an entry in place, so on a full device it warns for
# every program and leaves empty entries that every later run warns about.
MIN_FREE = 256 * 2**20


def use(directory: str, log=lambda *_: None) -> None:
  """Sets jax's persistent compilation cache to ``directory`` (every program,
  however quick to compile: the many small ones of building the model add up,
  and a threshold in seconds would make what is cached depend on the
  machine's load), unless it is "" or the process set a cache already.
  Empty entries (cut short when the cache's device was full) are removed
  first, and a cache whose device has less than
  :data:`MIN_FREE` free is left unused; each said in one line
  to ``log``. ValueError if ``directory`` is a file or under one."""
  if not directory or jax.config.jax_compilation_cache_dir:
    return
  path = pathlib.Path(directory).expanduser()
  why = not_a_directory(path)
  if why is not None:
    raise ValueError(f'--compile-cache {directory} cannot be a compilation cache: {why}; '
                     f'give a directory, or "" for none')
  empty = []
  for entry in path.glob('*-cache') if path.is_dir() else ():
    try:  # another run sharing the cache may remove it first; a read-only cache keeps it
      if entry.stat().st_size == 0:
        entry.unlink()
        entry.with_name(entry.name.removesuffix('-cache') + '-atime').unlink(missing_ok=True)
        empty.append(entry)
    except OSError:
      pass
  if empty:
    log(f'compile cache {path}: removed {len(empty)} empty '
        f'entr{"y" if len(empty) == 1 else "ies"}, cut short when its device was full')
  free = shutil.disk_usage(nearest_existing(path)).free
  if free < MIN_FREE:
    log(f'warning: compile cache {path}: {free / 2**20:.0f} MiB free, under '
        f'{MIN_FREE / 2**20:.0f} MiB: this run compiles without it '
        f'(free space there, or give --compile-cache "" to say so)')
    return
  jax.config.update('jax_compilation_cache_dir', str(path))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
