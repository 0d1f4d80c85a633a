"""What the processes of a multi-process run agree on, and how they start.

:func:`initialize` starts ``jax.distributed`` with a time limit on the
processes joining and a watchdog on their heartbeats: a process that does
not join, or that falls silent (killed, crashed, cut off), stops the others
with one line naming it and exit status :data:`PEER_MISSING` instead of
leaving them waiting in a collective (until XLA aborts them, minutes later).

With one process every other function here is immediate and collective-free.
With several, each call is a collective: every process must make the same
calls in the same order.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import typing as tp

import jax
import numpy as np

T = tp.TypeVar('T')

PEER_MISSING = 5  # the exit status of a process whose peer is missing
_KEY = 'poetx/heartbeat/'  # + process index: its heartbeat count, in the coordinator


def _stop(message: str) -> tp.NoReturn:
  """Writes ``message`` as one line and ends the process (exit PEER_MISSING) at
  once, from any thread: the main one may be blocked in a collective. The line
  is the last of stderr: what the other threads write from then on (the main
  one's traceback of the collective the missing peer broke, say) is dropped."""
  sys.stderr.flush()
  err = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)  # the other threads' output from now on
  os.write(err, (message.replace('\n', ' ') + '\n').encode())
  os._exit(PEER_MISSING)  # pylint: disable=protected-access


def _absent(me: int | None, n: int | None, coordinator: str | None) -> str:
  """Who this process still waits for when the processes do not all join."""
  at = f' at {coordinator}' if coordinator else ''
  if me is None or n is None:
    return f'a process of the run (or the coordinator{at})'
  if me != 0:
    return (f'process 0 (the coordinator{at})' if n == 2 else
            f'process 0 (the coordinator{at}) or another of the {n} processes')
  return 'process 1' if n == 2 else f'one or more of processes 1 to {n - 1}'


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, timeout: float = 120.0,
               prefix: str = 'error: ') -> None:
  """``jax.distributed.initialize`` with time limits on the other processes.

  If the processes have not all joined within ``timeout`` seconds, or once
  one of them has sent no heartbeat for ``timeout`` seconds (checked by a
  daemon thread through the coordinator's key-value store, whatever the main
  thread is waiting for), this process writes one line starting with
  ``prefix`` that names the missing process and exits with
  :data:`PEER_MISSING`. XLA's own limits are set beyond ours, so that its
  abort (exit 134 and a C++ stack) does not come first. A heartbeat comes from
  a thread of its own, so a long step, compilation or checkpoint of a live
  process is no silence. ``coordinator_address``, ``num_processes``,
  ``process_id``: as for ``jax.distributed.initialize`` (None: from the
  cluster environment).
  """
  if not timeout > 0:
    raise ValueError(f'the peer timeout must be > 0 seconds, got {timeout}')
  absent = _absent(process_id, num_processes, coordinator_address)
  me = '' if process_id is None else f'process {process_id}: '
  timer = threading.Timer(timeout, lambda: _stop(
      f'{prefix}{me}{absent} did not join the run within {timeout:g} s (not started, or '
      f'unable to reach the coordinator); stopping'))
  timer.daemon = True
  timer.start()
  try:
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               initialization_timeout=math.ceil(timeout) + 30,
                               heartbeat_timeout_seconds=math.ceil(2 * timeout) + 30)
  finally:
    timer.cancel()
  threading.Thread(target=_watch, args=(timeout, prefix), daemon=True,
                   name='poetx-heartbeat').start()


def _watch(timeout: float, prefix: str) -> None:
  """Beats this process's heartbeat and stops it once another's is silent for
  ``timeout`` seconds; ends when ``jax.distributed`` shuts down."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  me, n = jax.process_index(), jax.process_count()
  period = min(timeout / 4, 10.0)
  heard = {j: time.monotonic() for j in range(n) if j != me}  # when each last beat
  seen: dict[int, str] = {}
  beat = 0
  while True:
    time.sleep(period)
    client = distributed.global_state.client
    if client is None:  # shut down: the run is over
      return
    beat += 1
    try:
      client.key_value_set(f'{_KEY}{me}', str(beat), allow_overwrite=True)
      beats = dict(client.key_value_dir_get(_KEY))
      unreachable = None
    except Exception as e:  # pylint: disable=broad-except
      beats, unreachable = {}, str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    now = time.monotonic()
    for j in heard:
      value = beats.get(f'{_KEY}{j}')
      if value is not None and value != seen.get(j):
        seen[j], heard[j] = value, now
    silent = [j for j, t in heard.items() if now - t > timeout]
    if not silent or distributed.global_state.client is None:
      continue
    if unreachable is not None and me != 0:
      _stop(f'{prefix}process {me}: the coordinator, process 0 of {n}, has not answered for '
            f'{timeout:g} s (killed, crashed or cut off: {unreachable}); stopping')
    names = ', '.join(map(str, silent))
    _stop(f'{prefix}process {me}: process{"es" if len(silent) > 1 else ""} {names} of {n} '
          f'sent no heartbeat for {timeout:g} s (killed, crashed or cut off; its output '
          f'may say why); stopping')


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
