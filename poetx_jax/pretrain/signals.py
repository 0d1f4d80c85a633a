"""SIGTERM and SIGINT outside the training loop: an exception that unwinds the
command at once, and a record of the signal acted on at the next safe point.

Python runs a signal handler between two bytecodes of the main thread,
wherever they are, also inside a garbage-collection callback (JAX's
``_xla_gc_callback``) or a ``__del__``, where an exception is printed and
dropped ("Exception ignored in ..."), or inside an import, where it leaves a
module half-initialised (jaxlib's, imported again as the process exits,
aborts it). A stop must not depend on where its exception surfaces, so
:func:`stop` records the signal, and raises (``SystemExit(143)`` for
SIGTERM, ``KeyboardInterrupt`` for SIGINT: the command unwinds at once)
unless it runs inside an import or a garbage-collection callback. The
command's safe points call :func:`check`, which raises the exit of a
recorded signal, so a signal not raised, or whose exception was dropped,
still stops the command there (and Python's "Exception ignored" report of
it is left out); the training loop's stop flag (``metrics.StopFlag``),
which takes the signals over from :func:`stop` for the loop, takes a
recorded one (:func:`take`) before the loop starts, so that a run stopped
while starting writes nothing::

    old = signals.install()      # SIGTERM and SIGINT: stop()
    ...                          # start-up: a signal raises here, or is recorded
    signals.check()              # a safe point: a recorded signal raises here
    signals.restore(old)
"""

from __future__ import annotations

import gc
import signal
import sys

EXIT_CODE = 128 + signal.SIGTERM  # 143, the shells' convention
SIGNALS = (signal.SIGTERM, signal.SIGINT)

_received: str | None = None
_raised: BaseException | None = None  # the exception stop() raised last


def exit_of(name: str) -> BaseException:
  """The exception that stops a command for the signal ``name``:
  ``SystemExit(143)`` for SIGTERM, ``KeyboardInterrupt`` for SIGINT."""
  return SystemExit(EXIT_CODE) if name == 'SIGTERM' else KeyboardInterrupt()


def name_of(e: BaseException) -> str | None:
  """The signal whose :func:`exit_of` ``e`` is, or None."""
  if isinstance(e, KeyboardInterrupt):
    return 'SIGINT'
  return 'SIGTERM' if isinstance(e, SystemExit) and e.code == EXIT_CODE else None


def _inside_import_or_gc(frame) -> bool:
  """Whether ``frame`` (the one a signal interrupted) runs inside an import
  or a garbage-collection callback, its callers included."""
  callbacks = {getattr(cb, '__code__', None) for cb in gc.callbacks}
  while frame is not None:
    code = frame.f_code
    if code.co_filename.startswith('<frozen importlib') or code in callbacks:
      return True
    frame = frame.f_back
  return False


def stop(signum, frame) -> None:
  """The handler of SIGTERM and SIGINT while a command runs outside the
  training loop: records the signal and raises its :func:`exit_of`, but
  inside an import or a garbage-collection callback (there the next safe
  point, :func:`check`, raises it)."""
  global _received, _raised
  _received = signal.Signals(signum).name
  if _inside_import_or_gc(frame):
    return
  _raised = exit_of(_received)
  raise _raised


def _unraisable(previous):
  """``sys.unraisablehook`` that leaves out the exception of :func:`stop`
  (dropped where it was raised, and recorded: acted on at the next safe
  point) and passes every other to ``previous``."""
  def hook(unraisable):
    if _raised is None or unraisable.exc_value is not _raised:
      previous(unraisable)
  return hook


def install() -> dict:
  """Makes :func:`stop` the handler of SIGTERM and SIGINT (and has
  ``sys.unraisablehook`` leave out its dropped exceptions); returns the
  handlers it replaces (:func:`restore` puts them back). Installed afresh
  (not over itself), it forgets a signal recorded by an earlier command of
  this process."""
  global _received
  old = {s: signal.signal(s, stop) for s in SIGNALS}
  old['unraisablehook'] = sys.unraisablehook
  if old[signal.SIGTERM] is not stop:
    _received = None
    sys.unraisablehook = _unraisable(sys.unraisablehook)
  return old


def restore(old: dict) -> None:
  """Puts back the handlers :func:`install` returned."""
  for s, handler in old.items():
    if s == 'unraisablehook':
      sys.unraisablehook = handler
    else:
      signal.signal(s, handler)


def take() -> str | None:
  """The signal :func:`stop` recorded since it was installed ('SIGTERM' or
  'SIGINT', the last of them), its exception perhaps dropped, or None;
  forgets it."""
  global _received
  received, _received = _received, None
  return received


def check() -> None:
  """A safe point of a command: raises the :func:`exit_of` of a signal
  :func:`stop` recorded, whose exception was dropped where it was raised
  (forgotten once raised here)."""
  received = take()
  if received is not None:
    raise exit_of(received)
