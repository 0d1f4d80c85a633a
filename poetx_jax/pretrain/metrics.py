"""What a run reports while it trains: metrics.jsonl, the progress bar, the
clock that separates training from evaluation and compilation, merge health,
and the flag a SIGTERM or Ctrl-C raises.

``metrics.jsonl`` holds one JSON record per line, each with its ``'step'``:

* every ``log_every`` steps ``loss``, ``tokens_per_s``, ``elapsed_s`` (wall
  seconds since the loop started, compilation, evaluation and checkpoints
  included), ``train_s`` (the same less the time spent in evaluation, probes
  and checkpoints) and ``compile_s`` (the part of ``train_s`` spent tracing and
  compiling programs), so ``train_s - compile_s`` is steady-state training,
  and ``start_step``, the step this process started from (0, or the step a
  resumed run continued from: those clocks start with the process);
* at step 0 and every ``eval_every`` steps ``val_loss`` and ``val_ppl``;
* at every POET-X merge ``merge_orthogonality_error`` (what
  :func:`poetx_jax.merge` returns);
* every ``log_every`` steps the learning rates, gradient norm, training
  throughput and model FLOPs utilisation (tracking.py);
* the records of a probe, if the run has one.

The run's trackers (``--tracking``: TensorBoard, Weights & Biases) get every
record too (tracking.py). :func:`read_metrics` reads the records back and
:func:`plot_runs` draws the curves of runs (``poetx plot``)::

    plot_runs(['runs/a', 'runs/b'], 'curves')      # writes and returns curves.png
    plot_runs(['runs/a'], 'curves.svg')            # the format follows the suffix
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import signal
import sys
import time
import typing as tp

import jax
import tqdm

from poetx_jax.pretrain import signals
from poetx_jax.pretrain.atomic import atomic_write
from poetx_jax.pretrain.disk_full import writing
from poetx_jax.pretrain.json_records import read_jsonl
from poetx_jax.pretrain.unwritable import check_writable, refused_unless_writable

# A merge whose factors are further than this from orthogonal is reported:
# healthy runs stay at a few 1e-2 or less (docs/quality.md); the series
# diverges past about 1.
ORTHOGONALITY_WARNING = 0.1


class Metrics:
  """metrics.jsonl, and the ``sinks`` that get each record too (the run's
  trackers: :class:`~poetx_jax.pretrain.tracking.Tracking`).

  On resume (``resume_step > 0``) the file is rewritten with the ``records``
  read from it before (:func:`~poetx_jax.pretrain.metrics.read_metrics`) up to
  ``resume_step`` (written whole, so that a full disk keeps the old file).
  ``write=False`` (the other processes of a multi-process run) writes
  nothing. ``close()`` closes the sinks.
  """

  def __init__(self, out_dir: pathlib.Path, resume_step: int, *, write: bool = True,
               records: tp.Sequence[dict] = (), sinks: tp.Sequence[tp.Any] = ()):
    self.path = out_dir / 'metrics.jsonl'
    self._write = write
    self.sinks = list(sinks)
    if not write:  # another process of the run writes them
      return
    kept = [r for r in records if r['step'] <= resume_step] if resume_step else []
    text = ''.join(json.dumps(r) + '\n' for r in kept)
    with writing(self.path):  # whole: a full disk keeps the records there
      atomic_write(self.path, lambda tmp: pathlib.Path(tmp).write_text(text))

  def write(self, record: dict) -> None:
    """Appends ``record`` (DiskFull naming the file if there is no space)."""
    if not self._write:
      return
    with writing(self.path), self.path.open('a') as f:
      f.write(json.dumps(record) + '\n')
    for sink in self.sinks:
      sink.write(record)

  def close(self):
    for sink in self.sinks:
      sink.close()


def merge_reporter(metrics: Metrics, log: tp.Callable[[str], None], *, poet_lr: float,
                   merge_every: int, max_generator_norm: float | None
                   ) -> tp.Callable[[int, tp.Any], None]:
  """``on_merge(step, error)`` for the train step: records each merge's
  orthogonality error and logs a warning naming the remedies past
  ``ORTHOGONALITY_WARNING`` (the generator cap too, where the run has none)."""
  cap = ('' if max_generator_norm is not None else
         ', or cap the generators (--max-generator-norm 0.5: it kept 4x the default '
         'step valid on Llama-130M, docs/quality.md)')

  def report(merge_step, error):
    error = float(error)
    metrics.write({'step': merge_step, 'merge_orthogonality_error': error})
    if not error <= ORTHOGONALITY_WARNING:
      log(f'warning: at the merge of step {merge_step} the POET factors were far from '
          f'orthogonal (error {error:.3g} > {ORTHOGONALITY_WARNING}): the '
          f'Cayley–Neumann series has left its region of convergence, which '
          f'the weights now carry. Lower --poet-lr (this run: {poet_lr:g}) '
          f'or merge more often (--merge-every {merge_every}){cap}.')

  return report


class _Lines:
  """A stream for tqdm off a terminal: each redraw becomes one line, repeats dropped."""

  def __init__(self, stream):
    self.stream, self._last = stream, None

  def write(self, text: str) -> None:
    line = text.replace('\r', '').rstrip()
    if line and line != self._last:
      self.stream.write(line + '\n')
      self._last = line

  def flush(self) -> None:
    self.stream.flush()


class Progress:
  """The tqdm progress bar of the loop: step/total, ETA, loss and tokens/s.

  Drawn at every :meth:`update` (the loop calls it every ``log_every``
  steps): in place on a terminal, one line per update elsewhere (a log file).
  """

  def __init__(self, total: int, *, initial: int = 0, stream=None, disable: bool = False):
    stream = sys.stderr if stream is None else stream
    tty = stream.isatty()
    # Off a terminal: no line before the first update, none repeated at close.
    self._bar = tqdm.tqdm(total=total, initial=initial, unit='step',
                          file=stream if tty else _Lines(stream), dynamic_ncols=tty,
                          ncols=None if tty else 100, mininterval=0, miniters=1,
                          delay=0 if tty else 1e-9, leave=tty, disable=disable)

  def update(self, step: int, loss: float, tok_s: float) -> None:
    self._bar.set_postfix_str(f'loss {loss:.4f}, {tok_s:,.0f} tok/s', refresh=False)
    self._bar.update(step - self._bar.n)

  def close(self) -> None:
    self._bar.close()


# jax.monitoring time spans of tracing, lowering and XLA compilation.
_COMPILE_EVENTS = frozenset((
    '/jax/core/compile/jaxpr_trace_duration',
    '/jax/core/compile/jaxpr_to_mlir_module_duration',
    '/jax/core/compile/backend_compile_duration',
))


class TrainClock:
  """What of the training loop's wall time is not training, and what is compiling.

  ``paused_s`` sums the time spent inside ``paused()`` (evaluation, probes,
  checkpoints). ``compile_s()`` is the time spent tracing, lowering and
  compiling programs outside ``paused()``: the union of the jax.monitoring time
  spans of those events (nested spans, e.g. an inner jit traced inside an
  outer one, count once). Wall time less ``paused_s`` less ``compile_s()`` is
  steady-state training time.
  """

  def __init__(self):
    self.paused_s = 0.0
    self._paused = False
    self._spans = []

  def _on_span(self, event, start, end, **_):
    if event in _COMPILE_EVENTS and not self._paused:
      self._spans.append((start, end))

  def __enter__(self):
    jax.monitoring.register_event_time_span_listener(self._on_span)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_time_span_listener(self._on_span)

  @contextlib.contextmanager
  def paused(self, pending=None):
    """Time inside does not count; ``pending`` (e.g. the last loss) is waited
    for first, so queued training steps are not counted as paused time."""
    jax.block_until_ready(pending)
    t, self._paused = time.perf_counter(), True
    try:
      yield
    finally:
      self._paused = False
      self.paused_s += time.perf_counter() - t

  def compile_s(self) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(self._spans):
      if b > end:
        total += b - max(a, end)
        end = b
    return total


class StopFlag:
  """Turns SIGTERM / Ctrl-C into a flag checked between steps; set from the
  start to the signal that came before it, if one did (its exit dropped:
  :mod:`~poetx_jax.pretrain.signals`), which the loop then acts on."""

  def __init__(self):
    self.signal = None
    self._old = {}

  def __enter__(self):
    for s in (signal.SIGINT, signal.SIGTERM):
      self._old[s] = signal.signal(s, self._handle)
    self.signal = signals.take()
    return self

  def _handle(self, signum, frame):
    if self.signal is not None:  # a second signal: stop at once
      raise KeyboardInterrupt
    self.signal = signal.Signals(signum).name

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


# ------------------------------------------------ metrics.jsonl read back, plotted


class NothingToPlot(ValueError):
  """A run has no training-loss records: no metrics.jsonl, or none in it."""


def _stderr(message: str) -> None:
  print(message, file=sys.stderr)


def read_metrics(run: str | pathlib.Path, *, warn=_stderr) -> list[dict]:
  """The records of a run's ``metrics.jsonl``, in order; a last line cut short
  by a crash is dropped with ``warn(message)``, another damaged line raises
  ValueError (:func:`~poetx_jax.pretrain.json_records.read_jsonl`)."""
  path = pathlib.Path(run) / 'metrics.jsonl'
  if not path.exists():
    raise FileNotFoundError(f'no metrics.jsonl in {run}')
  return read_jsonl(path, warn=warn, required=('step',))


def image_path(out: str | pathlib.Path, formats) -> pathlib.Path:
  """``out`` if its suffix is one of ``formats`` (without the dot), else
  ``out`` with ``.png`` appended."""
  out = pathlib.Path(out)
  if out.suffix[1:].lower() in formats:
    return out
  return out.with_name(out.name + '.png')


def run_labels(runs: tp.Sequence[str | os.PathLike]) -> list[str]:
  """Names that tell the runs apart: the shortest tail of their paths (the
  folder's name where that is unique), a run given twice numbered.

    >>> run_labels(['a/poetx', 'b/poetx', 'b/adamw'])
    ['a/poetx', 'b/poetx', 'adamw']
    >>> run_labels(['r', 'r'])
    ['r', 'r (2)']
  """
  parts = [pathlib.Path(os.path.abspath(r)).parts for r in runs]
  distinct, labels = set(parts), []
  for p in parts:
    for k in range(1, len(p) + 1):
      tail = p[-k:]
      if sum(q[-k:] == tail for q in distinct) == 1 or k == len(p):
        labels.append(str(pathlib.PurePath(*tail)))
        break
  seen: dict[str, int] = {}
  for i, label in enumerate(labels):
    seen[label] = seen.get(label, 0) + 1
    if seen[label] > 1:
      labels[i] = f'{label} ({seen[label]})'
  return labels


def plot_runs(runs, out: str | pathlib.Path, *, option: str = '--out') -> pathlib.Path:
  """Training loss (left) and validation perplexity (right) against step.

  Args:
    runs: run directories, each with a ``metrics.jsonl`` holding loss records.
    out: the image to write: its suffix picks the format (``.png``, ``.pdf``,
      ``.svg``, ... any matplotlib writes); any other name gets ``.png`` appended.
    option: the flag that gave ``out``, for the message of a directory that
      cannot be written in.

  Returns:
    The path written.

  Raises:
    NothingToPlot: a run has no metrics.jsonl or no training-loss record in it
      (nothing is written).
    ValueError: the directory of ``out`` cannot be written in (nothing is drawn).
  """
  where = pathlib.Path(out).parent
  check_writable(where, f'{option} {out}: the directory')
  curves = []
  for run in runs:
    try:
      recs = read_metrics(run)
    except FileNotFoundError as e:
      raise NothingToPlot(f'nothing to plot for run {run}: it has no metrics.jsonl') from e
    tr = [(r['step'], r['loss']) for r in recs if 'loss' in r]
    va = [(r['step'], r['val_ppl']) for r in recs if 'val_ppl' in r]
    if not tr:
      raise NothingToPlot(f'nothing to plot for run {run}: its metrics.jsonl has no '
                          f'training-loss record ({len(recs)} records)')
    curves.append((run, tr, va))
  curves = [(label, tr, va) for label, (_, tr, va) in zip(run_labels(runs), curves)]

  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (ax_l, ax_p) = plt.subplots(1, 2, figsize=(11, 4))
  path = image_path(out, fig.canvas.get_supported_filetypes())
  for name, tr, va in curves:
    ax_l.plot(*zip(*tr), label=name)
    if va:
      ax_p.plot(*zip(*va), marker='o', label=name)
  ax_l.set(xlabel='step', ylabel='training loss', title='training loss')
  ax_p.set(xlabel='step', ylabel='perplexity', title='validation perplexity', yscale='log')
  for ax in (ax_l, ax_p):
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend()
  fig.tight_layout()
  try:
    with refused_unless_writable(where, f'{option} {out}: the directory'):
      path.parent.mkdir(parents=True, exist_ok=True)
      fig.savefig(path, dpi=110)
  finally:
    plt.close(fig)
  return path
