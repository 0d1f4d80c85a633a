"""SIGTERM outside the training loop: an exception that unwinds the command,
and a record of it for the loop.

Python runs a signal handler between two bytecodes of the main thread,
wherever they are, also inside a garbage-collection callback or a
``__del__``, where an exception is printed and dropped ("Exception ignored
in ..."). A SIGTERM whose ``SystemExit`` was dropped there would be lost, and
a training that starts after it would run to its last step. So
:func:`exit_143` also records the signal, and the training loop's stop flag
(metrics.StopFlag), which takes SIGTERM over from it, stops after its first
step, with a checkpoint, when one is recorded (:func:`take`).
"""

from __future__ import annotations

import signal

EXIT_CODE = 128 + signal.SIGTERM  # 143, the shells' convention

_received = False


def exit_143(signum, frame) -> None:
  """SIGTERM's handler while a command runs outside the loop: records the
  signal and raises ``SystemExit(143)``."""
  del signum, frame
  global _received
  _received = True
  raise SystemExit(EXIT_CODE)


def install():
  """Makes :func:`exit_143` SIGTERM's handler and returns the handler it
  replaces. Installed afresh (not over itself), it forgets a SIGTERM
  recorded by an earlier command of this process."""
  global _received
  old = signal.signal(signal.SIGTERM, exit_143)
  if old is not exit_143:
    _received = False
  return old


def take() -> bool:
  """Whether :func:`exit_143` ran since it was installed, its exception
  perhaps dropped; forgets it."""
  global _received
  received, _received = _received, False
  return received
