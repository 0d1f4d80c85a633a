"""A run directory's lock, ``RUN/train.lock``: one training process writes a
run directory at a time, and a lock left by a process that died is taken
over (:class:`RunLock`); :mod:`~poetx_jax.pretrain.rundir` takes it when it
opens a run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import secrets
import socket
import time

from poetx_jax.pretrain import signals


class RunLocked(RuntimeError):
  """The run directory is held by another training process (exit code 4)."""
  exit_code = 4


def _process_start(pid: int) -> str | None:
  """When process ``pid`` started (Linux clock ticks since boot), or None where
  /proc does not tell: with the pid it names one process, even after reuse."""
  try:
    return pathlib.Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[19]
  except (OSError, IndexError):
    return None


class RunLock:
  """``RUN/train.lock``: one training process at a time in a run directory.

  Created atomically (``O_EXCL``), it holds the owner's pid, host and process
  start, the directory's identity and the time. Another process is refused
  (:class:`RunLocked`, naming the owner) while the owner lives; a stale lock
  (its pid not running on this host, or now another process; or copied with
  the directory) is taken over with a warning. A lock from another host is
  never taken over: that host may still train. Leaving the context, however
  (SIGTERM becomes ``SystemExit(143)``), removes the lock.
  """

  def __init__(self, out: pathlib.Path, *, log=print):
    self.path, self.log = pathlib.Path(out) / 'train.lock', log
    st, pid = self.path.parent.stat(), os.getpid()
    self.record = {'pid': pid, 'host': socket.gethostname(), 'pid_start': _process_start(pid),
                   'dir': str(self.path.parent.resolve()), 'dir_id': [st.st_dev, st.st_ino],
                   'token': secrets.token_hex(8), 'since': time.strftime('%Y-%m-%d %H:%M:%S %Z')}
    self._signals = {}

  def __enter__(self) -> 'RunLock':
    try:
      fd = os.open(self.path.parent, os.O_RDONLY)
    except OSError as e:
      raise ValueError(f'cannot open the run directory {self.path.parent}: {e.strerror}') from e
    try:
      with contextlib.suppress(OSError):  # serialises takers; best effort (NFS)
        fcntl.flock(fd, fcntl.LOCK_EX)
      self._take()
    finally:
      os.close(fd)  # releases the flock
    self._signals = signals.install()  # outside the loop (which saves first): exit 143, 130
    return self

  def _take(self) -> None:
    for _ in range(3):
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        owner = self._owner()
        why = self._stale(owner)
        if why is None:
          raise RunLocked(
              f'{self.path.parent} is in use by another training: pid {owner["pid"]} on '
              f'{owner["host"]} since {owner.get("since")} ({self.path}); wait for it to end, '
              f'or delete {self.path} if that process is gone') from None
        self.log(f'warning: taking over the stale lock {self.path} of pid '
                 f'{owner.get("pid")} on {owner.get("host")}: {why}')
        with contextlib.suppress(FileNotFoundError):
          self.path.unlink()
        continue
      except OSError as e:
        raise ValueError(f'cannot write in the run directory {self.path.parent}: '
                         f'{e.strerror}') from e
      with os.fdopen(fd, 'w') as f:
        json.dump(self.record, f)
      return
    raise RunLocked(f'could not take {self.path}: other processes keep taking it')

  def _owner(self) -> dict:
    try:
      owner = json.loads(self.path.read_text())
      return owner if isinstance(owner, dict) and 'pid' in owner else {}
    except (OSError, ValueError):
      return {}

  def _stale(self, owner: dict) -> str | None:
    """Why the lock of ``owner`` is stale, or None if its owner may be alive."""
    if not owner:
      return 'it is empty or unreadable'
    if owner.get('host') != self.record['host']:
      return None  # no way to tell from here
    if owner.get('dir_id') != self.record['dir_id']:
      return f'it was taken in {owner.get("dir")}; this directory is a copy'
    pid = owner['pid']
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return f'pid {pid} is not running'
    except PermissionError:
      pass  # alive, another user's
    if owner.get('pid_start') != _process_start(pid):
      return f'pid {pid} is now another process'
    return None

  def __exit__(self, *exc) -> None:
    signals.restore(self._signals)
    if self._owner().get('token') == self.record['token']:
      with contextlib.suppress(FileNotFoundError):
        self.path.unlink()
