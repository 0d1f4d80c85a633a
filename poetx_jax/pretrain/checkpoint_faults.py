"""How a checkpoint's failures are told: the first line of orbax's errors, the
arrays of a checkpoint that does not fit a model, and orbax's logs of errors
that :mod:`poetx_jax.pretrain.checkpoint` raises itself (a restore's
TensorStore dumps, a save refused for want of space) kept quiet, as are the
late results of a failed save's abandoned writes; and the failed save's
threads joined before it is reported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import traceback

import jax

from poetx_jax.pretrain.disk_full import full_disk


def first_line(e: BaseException, limit: int = 300) -> str:
  """The start of an exception's message, from its innermost cause (orbax wraps
  TensorStore's errors in messages holding kilobytes of spec)."""
  while e.__cause__ is not None:
    e = e.__cause__
  text = (str(e).strip().splitlines() or [type(e).__name__])[0]
  for cut in (' See full TensorStore', ' [tensorstore_spec'):
    text = text.split(cut)[0]
  return text if len(text) <= limit else text[:limit] + '...'


@contextlib.contextmanager
def quiet():
  """Silences the asyncio and absl loggers, which print TensorStore dumps of a
  failed read next to the exception that reports it."""
  loggers = [logging.getLogger(n) for n in ('asyncio', 'absl')]
  levels = [lg.level for lg in loggers]
  for lg in loggers:
    lg.setLevel(logging.CRITICAL + 1)
  try:
    yield
  finally:
    for lg, level in zip(loggers, levels):
      lg.setLevel(level)


class _NoFullDiskErrors(logging.Filter):
  """Drops orbax's log records of a write refused for want of space (each
  with its traceback): the
  :class:`~poetx_jax.pretrain.checkpoint.Checkpointer` raises it as one DiskFull."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return full_disk(error or ValueError(record.getMessage())) is None


NO_FULL_DISK_ERRORS = _NoFullDiskErrors()  # on the absl logger, where orbax logs


def is_late_result(unraisable) -> bool:
  """Whether an unraisable error (``sys.unraisablehook``'s argument) is a
  TensorStore result delivered after its asyncio loop closed.

  A save that fails for want of space ends its event loop at the first
  refused write; the save's other writes, abandoned, finish later, and
  TensorStore hands each result to the closed loop from C++
  (``call_soon_threadsafe``: ``RuntimeError: Event loop is closed``), which
  Python prints as a traceback. Nothing waits for those results: the failed
  save is reported on its own. Only that error, raised in asyncio's
  ``base_events`` with no Python caller above it, is one."""
  if unraisable.object is not None or type(unraisable.exc_value) is not RuntimeError:
    return False
  frames = traceback.extract_tb(unraisable.exc_traceback)
  where = os.path.join('asyncio', 'base_events.py')
  return (str(unraisable.exc_value) == 'Event loop is closed' and bool(frames)
          and frames[0].name == 'call_soon_threadsafe'
          and all(f.filename.endswith(where) for f in frames))


class _DropLateResults:
  """``sys.unraisablehook`` that passes every unraisable error but the late
  results of :func:`is_late_result` on to the hook it replaced."""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, unraisable) -> None:
    if not is_late_result(unraisable):
      self.previous(unraisable)


def drop_late_results() -> None:
  """Installs :class:`_DropLateResults` as ``sys.unraisablehook`` (once)."""
  if not isinstance(sys.unraisablehook, _DropLateResults):
    sys.unraisablehook = _DropLateResults(sys.unraisablehook)


def join_operation_threads(timeout_s: float = 30.0) -> None:
  """Waits (each at most ``timeout_s``) for orbax's per-operation threads.
  After a failed save ``wait_until_finished`` returns on the first error
  while another of the save's threads (the one that writes the metadata
  after the commits) may still run; one still running as the interpreter
  exits prints a traceback after the command's one error line. orbax's
  threads raise their own error again from ``join``: that is the failed
  save's, already being reported, so it is not raised here."""
  me = threading.current_thread()
  for thread in threading.enumerate():
    if thread is not me and type(thread).__module__.startswith('orbax.'):
      with contextlib.suppress(Exception):
        thread.join(timeout_s)


def flat_shapes(tree) -> dict[str, tuple]:
  """{'a/b/0': shape} of a tree of arrays or of orbax array metadata."""
  return {'/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path):
          tuple(getattr(leaf, 'shape', ()) or ())
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def tree_diff(saved: dict, wanted: dict, limit: int = 3) -> str:
  """The first differences of two {path: shape} maps as text ('' if none)."""
  missing = [p for p in wanted if p not in saved]
  extra = [p for p in saved if p not in wanted]
  shapes = [f'{p} saved {saved[p]}, model {wanted[p]}' for p in wanted
            if p in saved and saved[p] != wanted[p]]
  parts = [f'{len(saved)} arrays saved, {len(wanted)} in the model'] if missing or extra else []
  if missing:
    parts.append(f'not in the checkpoint: {", ".join(missing[:limit])}'
                 + (' ...' if len(missing) > limit else ''))
  if extra:
    parts.append(f'not in the model: {", ".join(extra[:limit])}'
                 + (' ...' if len(extra) > limit else ''))
  if shapes:
    parts.append('; '.join(shapes[:limit]) + (' ...' if len(shapes) > limit else ''))
  return '; '.join(parts)
