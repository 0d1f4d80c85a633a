"""Loss and validation-perplexity curves of one or more runs, to an image.

    plot_runs(['runs/a', 'runs/b'], 'curves')      # writes and returns curves.png
    plot_runs(['runs/a'], 'curves.svg')            # the format follows the suffix
"""

from __future__ import annotations

import pathlib
import sys

from poetx_jax.pretrain.files import read_jsonl


class NothingToPlot(ValueError):
  """A run has no training-loss records: no metrics.jsonl, or none in it."""


def _stderr(message: str) -> None:
  print(message, file=sys.stderr)


def read_metrics(run: str | pathlib.Path, *, warn=_stderr) -> list[dict]:
  """The records of a run's ``metrics.jsonl``, in order; a last line cut short
  by a crash is dropped with ``warn(message)``, another damaged line raises
  ValueError (:func:`~poetx_jax.pretrain.files.read_jsonl`)."""
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


def plot_runs(runs, out: str | pathlib.Path) -> pathlib.Path:
  """Training loss (left) and validation perplexity (right) against step.

  Args:
    runs: run directories, each with a ``metrics.jsonl`` holding loss records.
    out: the image to write: its suffix picks the format (``.png``, ``.pdf``,
      ``.svg``, ... any matplotlib writes); any other name gets ``.png`` appended.

  Returns:
    The path written.

  Raises:
    NothingToPlot: a run has no metrics.jsonl or no training-loss record in it
      (nothing is written).
  """
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
    curves.append((pathlib.Path(run).name, tr, va))

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
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
