"""Loss and validation-perplexity curves of one or more runs, to a PNG."""

from __future__ import annotations

import json
import pathlib


def read_metrics(run: str | pathlib.Path) -> list[dict]:
  path = pathlib.Path(run) / 'metrics.jsonl'
  if not path.exists():
    raise FileNotFoundError(f'no metrics.jsonl in {run}')
  return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def plot_runs(runs, out: str | pathlib.Path) -> None:
  """Training loss (left) and validation perplexity (right) against step."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, (ax_l, ax_p) = plt.subplots(1, 2, figsize=(11, 4))
  for run in runs:
    recs = read_metrics(run)
    name = pathlib.Path(run).name
    tr = [(r['step'], r['loss']) for r in recs if 'loss' in r]
    va = [(r['step'], r['val_ppl']) for r in recs if 'val_ppl' in r]
    if tr:
      ax_l.plot(*zip(*tr), label=name)
    if va:
      ax_p.plot(*zip(*va), marker='o', label=name)
  ax_l.set(xlabel='step', ylabel='training loss', title='training loss')
  ax_p.set(xlabel='step', ylabel='perplexity', title='validation perplexity', yscale='log')
  for ax in (ax_l, ax_p):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)
