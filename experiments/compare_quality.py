"""Training quality: POET-X against AdamW (and SkewAdam) on the same tokens in the same order.

Every run is ``poetx_jax.pretrain.train.train`` with one ``TrainConfig`` that differs
only in the optimizer and its learning rates: the same ``--seed`` gives the same
initial dense model (POET-X poetizes it, so both start from the same function
and the same singular values) and the same order of training batches. The grid
is ``--adamw-lrs`` for AdamW and ``--poet-lrs`` x ``--block-sizes`` for POET-X,
whose non-POET parameters (embeddings, norms, LM head) take AdamW at
``--poet-other-lr`` (default: the best AdamW learning rate of the grid).

It reports, in OUT/quality.md (also printed), OUT/results.json, OUT/quality.png:

* validation perplexity at equal tokens: at every evaluation and at the end;
* validation perplexity at equal wall-clock time. Each run's clock is its
  steady-state training time, ``train_s - compile_s`` of its metrics.jsonl:
  the wall time of the training loop less evaluation, probes and checkpoints
  (each timed after waiting for the queued steps) and less the time spent
  tracing and compiling programs (jax.monitoring spans: the first step's
  update program, the merge programs of the first POET-X merge). It includes
  data loading, host dispatch and, for POET-X, every merge and the per-step
  read-back of the merge flag. The budget is the shortest run's total; each
  run's perplexity at that time is interpolated linearly in log-perplexity
  between its evaluations;
* loss spikes: logged steps whose training loss exceeds 1.5 x the median of
  the previous ``SPIKE_WINDOW`` logged losses (at least 3 of them).

Spectrum and stability (OUT/spectrum.png; numbers in results.json), recorded
by a ``train(probe=...)`` hook at step 0 and every ``--probe-every`` steps for
the first and last decoder layer's attention q projection and MLP down
projection: the singular values of the effective weight (POET-X:
``poetx_jax.effective_kernel``, i.e. ``R W0 P``; AdamW: the ``nnx.Linear``
kernel), computed in float64 from the float32 kernel; their top and bottom
``TOP_K``; ``||s - s_0|| / ||s_0||`` against step 0; the SVD entropy
``-sum_i p_i log p_i`` with ``p_i = s_i / sum_j s_j`` (natural log; the
effective-rank entropy of Roy and Vetterli, 2007 — the POET paper's own
definition was not available to check against); and for POET-X the
orthogonality error of its Cayley–Neumann factors,
``POETLinear.orthogonality_error()`` (the largest ``||G^T G - I||_F / sqrt(B)``
over the blocks of both sides; what ``poetx train`` logs at each merge).
A probe at a multiple of ``--merge-every`` sees freshly merged weights (Q = 0,
so that error is exactly 0); the default probe points fall mid-cycle too.
Expected: within a merge cycle POET-X's singular values stay those at the
cycle's start up to the series' orthogonality error; a merge folds the factors,
orthogonal up to that error, into W0, so the drift from step 0 grows by about
that much per cycle; AdamW's move by orders of magnitude more.

CPU smoke test (tiny model, built-in corpus; 22 s on 2 cores once the corpus
is tokenized and cached)::

    python3 experiments/compare_quality.py --model tiny --seq-len 64 --batch-size 8 \\
        --steps 60 --eval-every 20 --probe-every 10 --merge-every 40 --block-sizes 16 \\
        --adamw-lrs 3e-3 --poet-lrs 2.5e-3,5e-3 --dtype float32 --out runs/quality-smoke

On one H200 (bf16 compute), Llama-60M (vocab 4096: 29.5 M parameters), seq 256,
batch 64: each run sees 400 x 64 x 256 = 6,553,600 tokens (0.28 passes over the
built-in corpus's 23.7 M training tokens, under CPython 3.12 without Debian's
Python documentation); 2 AdamW + 2 POET-X runs::

    python3 experiments/compare_quality.py --model 60m --seq-len 256 --batch-size 64 \\
        --steps 400 --eval-every 50 --probe-every 50 --merge-every 100 \\
        --block-sizes 256 --adamw-lrs 1e-3,3e-3 --poet-lrs 5e-4,1e-3 --out runs/quality

Llama-130M, B = 128 and 256, on two GPUs side by side (BENCHMARKS.md; each
command about 7.5 minutes on an H200)::

    Q="--model 130m --seq-len 256 --batch-size 64 --steps 400 --eval-every 50 \\
       --probe-every 50 --merge-every 100 --poet-other-lr 3e-3"
    python3 experiments/compare_quality.py $Q --adamw-lrs 1e-3,3e-3 --block-sizes 256 \\
        --poet-lrs 1e-3 --out runs/q130-b256
    python3 experiments/compare_quality.py $Q --adamw-lrs 6e-4 --block-sizes 128 \\
        --poet-lrs 1e-3,2e-3 --out runs/q130-b128

Short runs are dominated by compilation (each run's learning rates are
constants of its update program, so every run compiles its own); the measured
costs and a first H200 comparison are in BENCHMARKS.md. The POET-X
step-size grid stays at or under 1e-3 for B = 256: at 5e-3 the generators
leave the Cayley–Neumann series' region of convergence (BENCHMARKS.md, where
the rates recorded before the learning rate became the step size are twice
the step).

Mixture-of-experts models (``--model moe-tiny`` / ``moe-60m``) add SkewAdam runs
(``--skewadam-lrs``) and, with ``--tiers``, POET-X runs whose non-POET
parameters take SkewAdam's tiers instead of AdamW. Their report adds the
routing of each run's last validation: the share of token slots of the most
and least loaded expert (summed over layers) and the slots dropped over
capacity. The spectrum probes then cover the attention q projections only
(an expert projection is a stack of kernels). On one H200::

    python3 experiments/compare_quality.py --model moe-60m --seq-len 256 --batch-size 64 \\
        --steps 400 --eval-every 50 --merge-every 100 --block-sizes 128 \\
        --adamw-lrs 1e-3,3e-3 --skewadam-lrs 1e-3,3e-3 --poet-lrs 1e-3,2e-3 --tiers \\
        --poet-other-lr 3e-3 --data data/builtin --out runs/moe-quality

The default corpus is the built-in one of ``poetx train`` (the README says
what it holds: 25.0 M tokens with vocab 4096 under CPython 3.12, without
Debian's Python documentation); ``--data`` trains on other text. The corpus line is printed and
written into the report.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_train import progress  # noqa: E402

MODELS = ('tiny', '60m', '130m', 'moe-tiny', 'moe-60m')
TOP_K = 4            # singular values kept at each end of the spectrum
SPIKE_FACTOR = 1.5   # a logged loss above this times the running median is a spike
SPIKE_WINDOW = 10    # logged losses in that running median


# --------------------------------------------------------------------- arguments
def _numbers(p, flag: str, text: str, kind):
  try:
    vals = [kind(x) for x in text.split(',') if x.strip()]
  except ValueError:
    p.error(f'{flag} wants comma-separated {kind.__name__}s, got {text!r}')
  if not vals:
    p.error(f'{flag} is empty; give at least one value')
  if any(not v > 0 for v in vals):
    p.error(f'{flag} values must be > 0, got {text!r}')
  if len(set(vals)) != len(vals):
    p.error(f'{flag} repeats a value: {text!r}')
  return vals


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--model', default='60m', help=f'one of {", ".join(MODELS)}')
  p.add_argument('--model-overrides', default='', metavar='K=V,...',
                 help='override config fields, e.g. layers=4 (as poetx train)')
  p.add_argument('--seq-len', type=int, default=256)
  p.add_argument('--batch-size', type=int, default=64)
  p.add_argument('--steps', type=int, default=400, help='optimizer updates per run')
  p.add_argument('--warmup', type=int, default=None,
                 help='warmup updates (default: 5%% of --steps)')
  p.add_argument('--eval-every', type=int, default=50)
  p.add_argument('--eval-batches', type=int, default=20)
  p.add_argument('--log-every', type=int, default=10,
                 help='steps between logged losses (must divide --eval-every)')
  p.add_argument('--probe-every', type=int, default=None,
                 help='steps between spectrum probes (default: --eval-every)')
  p.add_argument('--merge-every', type=int, default=200)
  p.add_argument('--block-sizes', default='128,256')
  p.add_argument('--adamw-lrs', default='1e-3,3e-3')
  p.add_argument('--skewadam-lrs', default='',
                 help='SkewAdam learning rates (MoE models; empty: no SkewAdam runs)')
  p.add_argument('--tiers', action='store_true',
                 help="POET-X runs: SkewAdam's tiers for the non-POET parameters")
  p.add_argument('--poet-lrs', default='5e-4,1e-3',
                 help='POET generator step sizes')
  p.add_argument('--poet-other-lr', default='best',
                 help="AdamW learning rate of POET-X's non-POET parameters: a number, "
                      "or 'best' (the best AdamW run's)")
  p.add_argument('--clip', type=float, default=1.0)
  p.add_argument('--vocab-size', type=int, default=4096)
  p.add_argument('--data', nargs='*', default=None, metavar='PATH',
                 help='text files or folders (as poetx train); default: the built-in corpus')
  p.add_argument('--tokenizer', default=None)
  p.add_argument('--dtype', default='auto', help='auto, float32 or bfloat16')
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--cache-dir', default='~/.cache/poetx_jax')
  p.add_argument('--out', default='runs/quality')
  p.add_argument('--overwrite', action='store_true',
                 help='replace run directories left in OUT by an earlier invocation')
  a = p.parse_args(argv)

  if a.model not in MODELS:
    p.error(f'--model {a.model!r} is not one of {", ".join(MODELS)}')
  from poetx_jax.pretrain.config import parse_overrides
  try:
    a.overrides = parse_overrides(a.model_overrides)
  except ValueError as e:
    p.error(str(e))
  for flag in ('eval_batches', 'vocab_size', 'log_every', 'eval_every'):  # the rest: below
    if getattr(a, flag) < 1:
      p.error(f'--{flag.replace("_", "-")} must be >= 1, got {getattr(a, flag)}')
  if a.eval_every % a.log_every:
    p.error(f'--log-every {a.log_every} must divide --eval-every {a.eval_every} (the '
            f'wall-clock time of an evaluation point is read from the log record at its step)')
  a.probe_every = a.probe_every or a.eval_every
  if a.probe_every < 1:
    p.error(f'--probe-every must be >= 1, got {a.probe_every}')
  if a.warmup is None:
    a.warmup = max(1, a.steps // 20)
  if not 0 <= a.warmup < a.steps:
    p.error(f'--warmup must be in [0, --steps), got {a.warmup}')
  a.block_sizes = _numbers(p, '--block-sizes', a.block_sizes, int)
  a.adamw_lrs = _numbers(p, '--adamw-lrs', a.adamw_lrs, float)
  a.skewadam_lrs = (_numbers(p, '--skewadam-lrs', a.skewadam_lrs, float)
                    if a.skewadam_lrs.strip() else [])
  a.poet_lrs = _numbers(p, '--poet-lrs', a.poet_lrs, float)
  if a.poet_other_lr != 'best':
    try:
      a.poet_other_lr = float(a.poet_other_lr)
    except ValueError:
      p.error(f"--poet-other-lr wants a number or 'best', got {a.poet_other_lr!r}")
    if not a.poet_other_lr > 0:
      p.error(f'--poet-other-lr must be > 0, got {a.poet_other_lr}')
  # Every run's configuration, checked by poetx train's own rules before the
  # first run starts (the POET-X runs come after the AdamW ones).
  from poetx_jax import ops
  from poetx_jax.pretrain import factories
  try:
    for spec in run_specs(a):
      if spec['lr'] == 'best':  # an AdamW run's rate, known later: any valid one here
        spec = dict(spec, lr=a.adamw_lrs[0] if a.adamw_lrs else 1e-3)
      cfg = run_config(a, spec)
      cfg.validate()
    mc = factories.model_config(cfg, a.vocab_size)
    for b in a.block_sizes:
      ops.check_block_size(b, mc.hidden, mc.mlp, mc.kv_heads * mc.head_dim,
                           what='--block-sizes')
  except (ValueError, TypeError) as e:
    p.error(str(e))
  return a


# ------------------------------------------------------------------------ probe
def probed_layers(num_layers: int, moe: bool = False) -> list[str]:
  """Paths of the probed projections: first and last layer, q and (dense
  models) down."""
  out = []
  for i in dict.fromkeys((0, num_layers - 1)):
    out += [f'layers.{i}.self_attn.q_proj'] + ([] if moe else [f'layers.{i}.mlp.down_proj'])
  return out


def _module_at(model, path: str):
  node = model
  for part in path.split('.'):
    node = node[int(part)] if part.isdigit() else getattr(node, part)
  return node


def svd_entropy(s) -> float:
  """-sum p log p of p = s / sum(s) (natural log)."""
  import numpy as np
  p = np.asarray(s, np.float64)
  p = p[p > 0] / p.sum()
  return float(-(p * np.log(p)).sum())


def make_probe(paths: list[str]):
  """``probe(step, model)`` for ``train``: spectrum of each path's effective
  weight against the first call's, and the POET factors' orthogonality error."""
  import numpy as np
  from flax import nnx
  import poetx_jax

  orth_err = nnx.jit(lambda layer: layer.orthogonality_error())
  kernel_of = nnx.jit(poetx_jax.effective_kernel)
  first = {}

  def probe(step, model):
    rec = {}
    for path in paths:
      layer = _module_at(model, path)
      if isinstance(layer, poetx_jax.POETLinear):
        w = kernel_of(layer)
        rec[f'{path}/orth_err'] = float(orth_err(layer))
      else:
        w = layer.kernel[...]
      s = np.linalg.svd(np.asarray(w, np.float64), compute_uv=False)
      s0 = first.setdefault(path, s)
      rec[f'{path}/sv_top'] = s[:TOP_K].tolist()
      rec[f'{path}/sv_bottom'] = s[-TOP_K:].tolist()
      rec[f'{path}/sv_rel_change'] = float(np.linalg.norm(s - s0) / np.linalg.norm(s0))
      rec[f'{path}/svd_entropy'] = svd_entropy(s)
    return rec

  return probe


# ------------------------------------------------------------------- analysis
def loss_spikes(losses: list[tuple[int, float]]) -> list[int]:
  """Steps whose logged loss exceeds SPIKE_FACTOR x the median of the previous
  SPIKE_WINDOW logged losses (needs at least 3 previous)."""
  out = []
  for j, (step, loss) in enumerate(losses):
    prev = [l for _, l in losses[max(0, j - SPIKE_WINDOW):j]]
    if len(prev) >= 3 and loss > SPIKE_FACTOR * statistics.median(prev):
      out.append(step)
  return out


def ppl_at_time(points: list[dict], t: float) -> float | None:
  """Validation perplexity at steady time ``t``, linear in log-perplexity between
  evaluations; None past the run's last evaluation."""
  for a, b in zip(points, points[1:]):
    if a['steady_s'] <= t <= b['steady_s']:
      span = b['steady_s'] - a['steady_s']
      w = (t - a['steady_s']) / span if span > 0 else 1.0
      return math.exp((1 - w) * math.log(a['val_ppl']) + w * math.log(b['val_ppl']))
  return None


def summarise(spec: dict, out_dir: pathlib.Path, tokens_per_step: int) -> dict:
  """One run's results from its metrics.jsonl."""
  from poetx_jax.pretrain.plot import read_metrics
  recs = read_metrics(out_dir)
  logs = {r['step']: r for r in recs if 'loss' in r}
  steady = {s: r['train_s'] - r['compile_s'] for s, r in logs.items()}
  steady[0] = 0.0
  evals = [{'step': r['step'], 'tokens': r['step'] * tokens_per_step,
            'steady_s': steady[r['step']], 'val_loss': r['val_loss'], 'val_ppl': r['val_ppl']}
           for r in recs if 'val_ppl' in r]
  probes = [r for r in recs if any(k.endswith('/sv_top') for k in r)]
  losses = sorted((s, r['loss']) for s, r in logs.items())
  last = logs[max(logs)]
  spikes = loss_spikes(losses)
  routing = {}
  loads = [r for r in recs if 'expert_tokens' in r]
  if loads:  # a mixture-of-experts model: its last validation's routing
    t = loads[-1]['expert_tokens']
    routing = {'expert_share_max': max(t) / sum(t), 'expert_share_min': min(t) / sum(t),
               'dropped_share': loads[-1]['dropped'] / sum(t),
               'load_balance': loads[-1]['load_balance'], 'expert_tokens': t}

  def worst(suffix):
    vals = [v for p in probes for k, v in p.items() if k.endswith(suffix)]
    return max(vals) if vals else None

  return {**spec, 'out_dir': str(out_dir), 'steps': max(logs),
          'tokens': max(logs) * tokens_per_step, 'evals': evals,
          'val_ppl_start': evals[0]['val_ppl'], 'val_ppl_final': evals[-1]['val_ppl'],
          'val_ppl_best': min(e['val_ppl'] for e in evals),
          'elapsed_s': last['elapsed_s'], 'train_s': last['train_s'],
          'compile_s': last['compile_s'], 'steady_s': steady[max(logs)],
          'steady_tokens_per_s': max(logs) * tokens_per_step / max(steady[max(logs)], 1e-9),
          'losses': losses, 'loss_spikes': spikes, 'probes': probes,
          'max_sv_rel_change': worst('/sv_rel_change'), 'max_orth_err': worst('/orth_err'),
          **routing}


# ----------------------------------------------------------------------- plots
def _group(r: dict) -> str:
  if r['optimizer'] != 'poetx':
    return {'adamw': 'AdamW', 'skewadam': 'SkewAdam'}[r['optimizer']]
  return f'POET-X B={r["block_size"]}' + (' + tiers' if r.get('tiers') else '')


def plot_quality(runs: list[dict], best: dict[str, str], path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  groups = sorted({_group(r) for r in runs})
  colors = dict(zip(groups, plt.rcParams['axes.prop_cycle'].by_key()['color']))
  fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
  for r in runs:
    is_best = best[_group(r)] == r['name']
    kw = dict(color=colors[_group(r)], lw=2.2 if is_best else 0.9,
              alpha=1.0 if is_best else 0.45, marker='o' if is_best else None, ms=3,
              label=r['name'] + (' (best)' if is_best else ''))
    ev = r['evals']
    ax_t.plot([e['tokens'] / 1e6 for e in ev], [e['val_ppl'] for e in ev], **kw)
    ax_s.plot([e['steady_s'] for e in ev], [e['val_ppl'] for e in ev], **kw)
  ax_t.set(xlabel='training tokens (millions)', ylabel='validation perplexity',
           title='equal tokens', yscale='log')
  ax_s.set(xlabel='steady-state training seconds (compilation, evaluation excluded)',
           ylabel='validation perplexity', title='equal wall-clock', yscale='log')
  for ax in (ax_t, ax_s):
    ax.grid(alpha=0.3, which='both')
  ax_s.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _any_positive(runs: list[dict], paths: list[str], key: str) -> bool:
  """Whether a log axis of ``key`` has a point (every probe at a merge: none)."""
  return any(x.get(f'{p}/{key}', 0) > 0 for r in runs for x in r['probes'] for p in paths)


def plot_spectrum(runs: list[dict], best: dict[str, str], paths: list[str],
                  merge_every: int, path: pathlib.Path) -> None:
  """Drift, entropy and orthogonality error of the best run of each group
  (exact zeros, e.g. right after a merge, are left off the log axes)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  chosen = [r for r in runs if best[_group(r)] == r['name']]
  colors = dict(zip([_group(r) for r in chosen],
                    plt.rcParams['axes.prop_cycle'].by_key()['color']))
  styles = dict(zip(paths, ('-', '--', ':', '-.')))
  markers = dict(zip(paths, ('o', 's', '^', 'v')))
  fig, (ax_d, ax_e, ax_o) = plt.subplots(1, 3, figsize=(16, 4.5))

  def positive(steps, vals):
    return zip(*[(s, v) for s, v in zip(steps, vals) if v > 0]) if any(
        v > 0 for v in vals) else ([], [])

  for r in chosen:
    for p in paths:
      steps = [x['step'] for x in r['probes']]
      kw = dict(color=colors[_group(r)], ls=styles[p], marker='.', lw=1.2)
      ax_d.plot(*positive(steps, [x[f'{p}/sv_rel_change'] for x in r['probes']]), **kw)
      ax_e.plot(steps, [x[f'{p}/svd_entropy'] for x in r['probes']], **kw)
      if f'{p}/orth_err' in r['probes'][0]:  # points only: merges reset it
        ax_o.plot(*positive(steps, [x[f'{p}/orth_err'] for x in r['probes']]),
                  **{**kw, 'ls': 'none', 'marker': markers[p]})
  last = max(x['step'] for r in chosen for x in r['probes'])
  for ax in (ax_d, ax_e, ax_o):
    for m in range(merge_every, last + 1, merge_every):
      ax.axvline(m, color='0.6', lw=0.8, ls=':')
  ax_d.set(xlabel='step', ylabel='||s - s0|| / ||s0||',
           yscale='log' if _any_positive(chosen, paths, 'sv_rel_change') else 'linear',
           title='singular-value drift from step 0')
  ax_e.set(xlabel='step', ylabel='entropy of s / sum(s) (nats)', title='SVD entropy')
  ax_o.set(xlabel='step (dotted: POET-X merges)', ylabel='max ||G^T G - I||_F / sqrt(B)',
           yscale='log' if _any_positive(chosen, paths, 'orth_err') else 'linear',
           title='POET-X orthogonality error (exactly 0 after a merge)')
  from matplotlib.lines import Line2D
  handles = ([Line2D([], [], color=c, label=f'{g} ({best[g]})') for g, c in colors.items()]
             + [Line2D([], [], color='k', ls=styles[p], marker=markers[p], label=p)
                for p in paths])
  ax_d.legend(handles=handles, fontsize=7)
  for ax in (ax_d, ax_e, ax_o):
    ax.grid(alpha=0.3, which='both')
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---------------------------------------------------------------------- report
def _fmt(x, spec='.2f'):
  return '—' if x is None else format(x, spec)


def _tokens(n: int) -> str:
  return f'{n / 1e6:.2f}M' if n >= 1e6 else f'{n / 1e3:.1f}k'


def report(res: dict) -> str:
  h, runs = res['header'], res['runs']
  budget = res['equal_time_s']
  lines = [
      '# Training quality: POET-X against ' + ' and '.join(
          sorted({_group(r) for r in runs if r['optimizer'] != 'poetx'})),
      '',
      f"Model {h['model']} ({h['dense_params']:,} parameters, vocab {h['vocab_size']}), "
      f"seq {h['seq_len']}, batch {h['batch_size']}, {h['steps']} updates = "
      f"{h['tokens_per_run']:,} tokens per run ({h['epochs']:.2f} epochs of "
      f"{h['train_tokens']:,} training tokens), warmup {h['warmup']} then cosine to 10%, "
      f"clip {h['clip']}, seed {h['seed']}; POET-X merges every {h['merge_every']} updates. "
      f"Validation: {h['val_tokens']:,} tokens every {h['eval_every']} updates. "
      f"Device {h['device']}, compute dtype {h['dtype']}; {h['date']}.",
      '',
      f"data: {h['data']}",
      '',
      '## Validation perplexity at equal tokens and at equal time',
      '',
      f'Equal time = {budget:.1f} s of steady-state training (the shortest run); '
      'steady-state time = training-loop wall time less evaluation, probes, checkpoints '
      'and tracing/compilation (see the script docstring). lr: of every weight for '
      'AdamW and SkewAdam, of the non-POET parameters (embeddings, norms, LM head, routers) '
      'for POET-X (with AdamW, or SkewAdam\'s tiers: + tiers). '
      f"Loss spikes: {h['spike_rule']}.",
      '',
      '| run | lr | POET lr | final ppl | best ppl | ppl at equal time | steady s '
      '| tokens/s | compile s | loss spikes | max sv drift | max orth err |',
      '|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for r in runs:
    mark = ' **(best)**' if r['best'] else ''
    lines.append(
        f"| {r['name']}{mark} | {r['lr']:g} | {_fmt(r['poet_lr'], 'g')} "
        f"| {r['val_ppl_final']:.2f} | {r['val_ppl_best']:.2f} "
        f"| {_fmt(r['val_ppl_at_equal_time'])} | {r['steady_s']:.1f} "
        f"| {r['steady_tokens_per_s']:,.0f} | {r['compile_s']:.1f} | {len(r['loss_spikes'])} "
        f"| {_fmt(r['max_sv_rel_change'], '.2e')} | {_fmt(r['max_orth_err'], '.1e')} |")
  if any('expert_tokens' in r for r in runs):
    lines += ['', '## Routing at the last validation', '',
              'Token slots routed to each expert, summed over layers, on the first '
              'validation batch: the most and least loaded expert\'s share (uniform: '
              f"1/{len(runs[0]['expert_tokens'])}), the share dropped over capacity, and "
              'the load-balance loss (1 when uniform).', '',
              '| run | max share | min share | dropped | load balance |', '|---|---|---|---|---|']
    for r in runs:
      lines.append(f"| {r['name']} | {r['expert_share_max']:.3f} | {r['expert_share_min']:.3f}"
                   f" | {r['dropped_share']:.3f} | {r['load_balance']:.3f} |")
  steps = [e['step'] for e in runs[0]['evals']]
  lines += ['', '## Validation perplexity at every evaluation (step: tokens seen)', '',
            '| run | ' + ' | '.join(f"{s}: {_tokens(s * h['tokens_per_step'])}" for s in steps)
            + ' |', '|---|' + '---|' * len(steps)]
  for r in runs:
    by_step = {e['step']: e['val_ppl'] for e in r['evals']}
    lines.append(f"| {r['name']} | " + ' | '.join(_fmt(by_step.get(s)) for s in steps) + ' |')
  lines += ['', '## Spectrum', '',
            f"Probed: {', '.join(h['probed_layers'])}, at steps {h['probe_steps']}. "
            'max sv drift = max over probes and layers of ||s - s0|| / ||s0|| (s the '
            "effective weight's singular values, s0 at step 0); max orth err = max over "
            'probes, layers and blocks of ||G^T G - I||_F / sqrt(B) of the Cayley–Neumann '
            'factors. SVD '
            'entropy (p = s / sum s, nats) of the best run of each group, first and last probe:',
            '']
  for r in runs:
    if not r['best'] or not r['probes']:
      continue
    a, b = r['probes'][0], r['probes'][-1]
    ent = ', '.join(f"{p} {a[p + '/svd_entropy']:.4f} -> {b[p + '/svd_entropy']:.4f}"
                    for p in h['probed_layers'])
    lines.append(f"* {r['name']}: {ent}")
  lines.append('')
  return '\n'.join(lines)


# ------------------------------------------------------------------------ main
def run_specs(a) -> list[dict]:
  """AdamW runs first (POET-X may take the best AdamW learning rate)."""
  specs = [{'name': f'adamw-lr{lr:g}', 'optimizer': 'adamw', 'block_size': None,
            'lr': lr, 'poet_lr': None} for lr in a.adamw_lrs]
  specs += [{'name': f'skewadam-lr{lr:g}', 'optimizer': 'skewadam', 'block_size': None,
             'lr': lr, 'poet_lr': None} for lr in a.skewadam_lrs]
  specs += [{'name': f'poetx-b{b}-lr{plr:g}' + ('-tiers' if a.tiers else ''),
             'optimizer': 'poetx', 'block_size': b, 'lr': a.poet_other_lr, 'poet_lr': plr,
             'tiers': a.tiers}
            for b in a.block_sizes for plr in a.poet_lrs]
  return specs


def run_config(a, spec: dict):
  """The ``poetx train`` configuration of one run."""
  from poetx_jax.pretrain.config import TrainConfig
  return TrainConfig(
      model=a.model, model_overrides=a.overrides, data=a.data, tokenizer=a.tokenizer,
      vocab_size=a.vocab_size, seq_len=a.seq_len, batch_size=a.batch_size,
      steps=a.steps, optimizer=spec['optimizer'], lr=spec['lr'], poet_lr=spec['poet_lr'],
      skew_tiers=spec.get('tiers', False),
      warmup=a.warmup, clip=a.clip, merge_every=a.merge_every,
      block_size=spec['block_size'], dtype=a.dtype, seed=a.seed, eval_every=a.eval_every,
      eval_batches=a.eval_batches, log_every=a.log_every, checkpoint_every=a.steps, keep=1,
      out_dir=str(pathlib.Path(a.out) / 'runs' / spec['name']), cache_dir=a.cache_dir)


def main(argv=None):
  a = parse_args(argv)
  import jax
  from poetx_jax.models import moe
  from poetx_jax.pretrain import factories, loading
  from poetx_jax.pretrain import train as train_lib

  out = pathlib.Path(a.out)
  runs_dir = out / 'runs'
  specs = run_specs(a)
  left = [s['name'] for s in specs if (runs_dir / s['name']).exists()]
  if left and not a.overwrite:
    raise SystemExit(f'{runs_dir} already holds run directories {left}; pass --overwrite '
                     f'to replace them, or choose another --out')
  for name in left:
    shutil.rmtree(runs_dir / name)
  out.mkdir(parents=True, exist_ok=True)

  data = loading.load_data(run_config(a, specs[0]))
  print(f'data: {data.description}', flush=True)
  mc = factories.model_config(run_config(a, specs[0]), data.tokenizer.vocab_size)
  paths = probed_layers(mc.layers, moe=isinstance(mc, moe.MoEConfig))
  tokens_per_step = a.batch_size * a.seq_len
  val_windows = min(len(data.val_windows), a.eval_batches * a.batch_size)
  train_tokens = int(data.train_windows.shape[0]) * a.seq_len
  progress(f'model {a.model}: {mc.num_params():,} parameters; {len(specs)} runs of '
           f'{a.steps} updates x {tokens_per_step:,} tokens on '
           f'{jax.devices()[0].device_kind}')

  results = []
  for k, spec in enumerate(specs):
    if spec['optimizer'] == 'poetx' and spec['lr'] == 'best':
      adamw = [r for r in results if r['optimizer'] == 'adamw']
      spec['lr'] = min(adamw, key=lambda r: r['val_ppl_final'])['lr']
    progress(f'run {k + 1}/{len(specs)}: {spec["name"]} (lr {spec["lr"]:g}'
             + (f', POET lr {spec["poet_lr"]:g}' if spec['poet_lr'] else '') + ')')
    cfg = run_config(a, spec)
    probe = make_probe(paths)
    hook = train_lib.Hook(lambda run, probe=probe: probe(run.step, run.model),
                          every=a.probe_every, at_start=True)
    summary = train_lib.train(cfg, log=lambda m, n=spec['name']: progress(f'{n}: {m}'),
                              hooks=[hook])
    r = summarise(spec, pathlib.Path(summary['out_dir']), tokens_per_step)
    progress(f'{spec["name"]}: val ppl {r["val_ppl_start"]:.2f} -> {r["val_ppl_final"]:.2f}, '
             f'{r["steady_s"]:.1f} s steady + {r["compile_s"]:.1f} s compiling')
    results.append(r)

  best = {}
  for r in results:
    g = _group(r)
    if g not in best or r['val_ppl_final'] < best[g]['val_ppl_final']:
      best[g] = r
  best = {g: r['name'] for g, r in best.items()}
  budget = min(r['steady_s'] for r in results)
  for r in results:
    r['best'] = best[_group(r)] == r['name']
    r['val_ppl_at_equal_time'] = ppl_at_time(r['evals'], budget)

  header = {
      'model': a.model, 'model_overrides': a.overrides, 'dense_params': mc.num_params(),
      'vocab_size': data.tokenizer.vocab_size, 'seq_len': a.seq_len,
      'batch_size': a.batch_size, 'steps': a.steps, 'warmup': a.warmup, 'clip': a.clip,
      'seed': a.seed, 'merge_every': a.merge_every, 'eval_every': a.eval_every,
      'tokens_per_step': tokens_per_step, 'tokens_per_run': a.steps * tokens_per_step,
      'train_tokens': train_tokens, 'epochs': a.steps * tokens_per_step / train_tokens,
      'val_tokens': val_windows * a.seq_len, 'data': data.description,
      'device': f'{jax.device_count()} x {jax.devices()[0].device_kind}',
      'dtype': jax.numpy.dtype(factories.compute_dtype(a.dtype)).name,
      'date': time.strftime('%Y-%m-%d'), 'probed_layers': paths,
      'probe_steps': [p['step'] for p in results[0]['probes']],
      'spike_rule': f'loss > {SPIKE_FACTOR} x median of the previous {SPIKE_WINDOW} logged',
  }
  res = {'header': header, 'args': vars(a),
         'equal_time_s': budget, 'best': best, 'runs': results}
  (out / 'results.json').write_text(json.dumps(res, indent=1))
  md = report(res)
  (out / 'quality.md').write_text(md)
  plot_quality(results, best, out / 'quality.png')
  plot_spectrum(results, best, paths, a.merge_every, out / 'spectrum.png')
  print(md)
  progress(f'wrote {out / "quality.md"}, results.json, quality.png, spectrum.png')
  return res


if __name__ == '__main__':
  main()
