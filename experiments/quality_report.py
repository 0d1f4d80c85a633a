"""What compare_quality.py reports: each run's results read from its
``metrics.jsonl``, its configuration's mean and spread over seeds, the
markdown report and the plots.

A run is one ``train`` call; a configuration is the runs whose overrides
differ only in ``seed``; a family is the optimizer (POET-X: and its block
size, and whether SkewAdam's tiers train its other parameters), whose best
configuration (lowest mean final validation perplexity) the report and plots
single out.
"""

from __future__ import annotations

import math
import pathlib
import statistics

SPIKE_FACTOR = 1.5   # a logged loss above this times the running median is a spike
SPIKE_WINDOW = 10    # logged losses in that running median


# ------------------------------------------------------------------- one run
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


def _routing(recs: list[dict]) -> dict:
  """A mixture-of-experts model's routing at its last validation (else {})."""
  loads = [r for r in recs if 'expert_tokens' in r]
  if not loads:
    return {}
  t = loads[-1]['expert_tokens']
  return {'expert_share_max': max(t) / sum(t), 'expert_share_min': min(t) / sum(t),
          'dropped_share': loads[-1]['dropped'] / sum(t),
          'load_balance': loads[-1]['load_balance'], 'expert_tokens': t}


def steady_clock(logs: dict[int, dict]) -> tuple[dict[int, float], int, float]:
  """Steady (compile-free) training seconds from the logged steps' records
  (``train_s``, ``compile_s``): up to each logged step (step 0 at 0), and the
  steps and seconds the clock timed. A resumed run's process starts its clock
  again, so a record of another process than the one before it opens a
  segment (its ``start_step``, the step its process started from, differs;
  in records written before they named it, its ``train_s`` falls below the
  one before it): the steady seconds at a step are the earlier segments'
  last plus its own ``train_s - compile_s``. The first segment times its steps
  from step 0; a later one from its first logged step, since the interval
  before that holds the steps resumed from the checkpoint together with their
  compile, which the record does not separate (nor are the steps a stopped
  process trained after its last record timed)."""
  steady, offset, timed_steps, timed_s = {0: 0.0}, 0.0, 0, 0.0
  start, prev = (0, 0.0), None
  for step in sorted(logs):
    r = logs[step]
    t = r['train_s'] - r['compile_s']
    if prev is not None and (r['start_step'] != prev['start_step']
                             if 'start_step' in r and 'start_step' in prev
                             else r['train_s'] < prev['train_s']):
      done = steady[prev['step']] - offset
      timed_steps, timed_s = timed_steps + prev['step'] - start[0], timed_s + done - start[1]
      offset, start = offset + done, (step, t)
    steady[step] = offset + t
    prev = r
  if prev is not None:
    timed_steps += prev['step'] - start[0]
    timed_s += steady[prev['step']] - offset - start[1]
  return steady, timed_steps, timed_s


def summarise(spec: dict, out_dir: pathlib.Path, tokens_per_step: int) -> dict:
  """One run's results from its metrics.jsonl, after the fields of ``spec``. A
  run whose spec has ``diverged`` (the message of its non-finite loss) has an
  infinite final and best perplexity: it is never a family's best."""
  from poetx_jax.pretrain.metrics import read_metrics
  recs = read_metrics(out_dir)
  logs = {r['step']: r for r in recs if 'loss' in r}
  steady, timed_steps, timed_s = steady_clock(logs)
  evals = [{'step': r['step'], 'tokens': r['step'] * tokens_per_step,
            'steady_s': steady[r['step']], 'val_loss': r['val_loss'], 'val_ppl': r['val_ppl']}
           for r in recs if 'val_ppl' in r]
  probes = [r for r in recs if any(k.endswith('/sv_top') for k in r)]
  losses = sorted((s, r['loss']) for s, r in logs.items())
  last, end = logs[max(logs)], max(logs)

  def worst(suffix):
    vals = [v for p in probes for k, v in p.items() if k.endswith(suffix)]
    return max(vals) if vals else None

  diverged = spec.get('diverged')
  final = math.inf if diverged else evals[-1]['val_ppl']
  other = {}  # compare_quality --other-val: name -> its evaluations
  for r in recs:
    for k, v in r.items():
      if k.startswith('other_val/') and k.endswith('/ppl'):
        other.setdefault(k.split('/')[1], []).append(
            {'step': r['step'], 'tokens': r['step'] * tokens_per_step, 'val_ppl': v})
  return {**spec, 'out_dir': str(out_dir), 'steps': end, 'tokens': end * tokens_per_step,
          'evals': evals, 'val_ppl_start': evals[0]['val_ppl'],
          'val_ppl_final': final,
          'val_ppl_best': math.inf if diverged else min(e['val_ppl'] for e in evals),
          'elapsed_s': last['elapsed_s'], 'train_s': last['train_s'],
          'compile_s': last['compile_s'], 'steady_s': steady[end],
          'steady_tokens_per_s': timed_steps * tokens_per_step / max(timed_s, 1e-9),
          'losses': losses, 'loss_spikes': loss_spikes(losses), 'probes': probes,
          'max_sv_rel_change': worst('/sv_rel_change'), 'max_orth_err': worst('/orth_err'),
          'other_val': other,
          'other_val_final': {n: math.inf if diverged else e[-1]['val_ppl']
                              for n, e in other.items()},
          **_routing(recs)}


# ----------------------------------------------------------- configurations
FAMILIES = {'adamw': 'AdamW', 'muon': 'Muon', 'skewadam': 'SkewAdam'}


POET_FAMILIES = {'poetx': 'POET-X', 'poetx-muon': 'POET-X Muon'}


def family(r: dict) -> str:
  """The optimizer family of a run: AdamW, Muon, SkewAdam (each with ``bf16``
  when its weights were bfloat16), POET-X or POET-X Muon B=.. (+ tiers).

    >>> family({'optimizer': 'muon'}), family({'optimizer': 'poetx', 'block_size': 256})
    ('Muon', 'POET-X B=256')
    >>> family({'optimizer': 'adamw', 'param_dtype': 'bfloat16'})
    'AdamW bf16'
  """
  if r['optimizer'] not in POET_FAMILIES:
    return FAMILIES[r['optimizer']] + (' bf16' if r.get('param_dtype') == 'bfloat16' else '')
  return (f'{POET_FAMILIES[r["optimizer"]]} B={r["block_size"]}'
          + (' + tiers' if r.get('tiers') else ''))


def stat(values: list[float | None]) -> dict:
  """Mean, sample standard deviation (None for one value, or where a value
  is not finite: a diverged run's inf or nan), min, max and n; all None when
  a value is missing."""
  if any(v is None for v in values):
    return {'mean': None, 'sd': None, 'min': None, 'max': None, 'n': len(values)}
  finite = all(math.isfinite(v) for v in values)
  return {'mean': statistics.fmean(values),
          'sd': statistics.stdev(values) if len(values) > 1 and finite else None,
          'min': min(values), 'max': max(values), 'n': len(values)}


def _curve(runs: list[dict]) -> list[dict]:
  """A configuration's evaluations: at each step all its runs evaluated,
  the perplexity's and the steady time's statistics over them."""
  steps = sorted(set.intersection(*[{e['step'] for e in r['evals']} for r in runs]))
  by = [{e['step']: e for e in r['evals']} for r in runs]
  return [{'step': s, 'tokens': by[0][s]['tokens'],
           'val_ppl': stat([b[s]['val_ppl'] for b in by]),
           'steady_s': stat([b[s]['steady_s'] for b in by])['mean']} for s in steps]


def configurations(runs: list[dict]) -> list[dict]:
  """The runs grouped by configuration (in order of first appearance), each
  with the statistics over its seeds."""
  groups: dict[str, list[dict]] = {}
  for r in runs:
    groups.setdefault(r['config'], []).append(r)
  out = []
  for key, rs in groups.items():
    out.append({'config': key, 'family': family(rs[0]), 'runs': [r['name'] for r in rs],
                'seeds': [r['seed'] for r in rs], 'lr': rs[0]['lr'],
                'poet_lr': rs[0]['poet_lr'], 'evals': _curve(rs),
                **{k: stat([r.get(k) for r in rs]) for k in (
                    'val_ppl_final', 'val_ppl_best', 'val_ppl_at_equal_time', 'steady_s',
                    'steady_tokens_per_s')},
                'other_val_final': {n: stat([r.get('other_val_final', {}).get(n) for r in rs])
                                    for n in rs[0].get('other_val_final', {})}})
  return out


def best_of_families(configs: list[dict]) -> dict[str, str]:
  """family -> its configuration of the lowest mean final perplexity."""
  best = {}
  for c in configs:
    if (c['family'] not in best
        or c['val_ppl_final']['mean'] < best[c['family']]['val_ppl_final']['mean']):
      best[c['family']] = c
  return {f: c['config'] for f, c in best.items()}


def best_adamw_lr(runs: list[dict]) -> float:
  """The learning rate of the best AdamW configuration among ``runs``."""
  configs = [c for c in configurations(runs) if c['family'] == 'AdamW']
  if not configs:
    raise ValueError('lr=best needs an AdamW run before it')
  return min(configs, key=lambda c: c['val_ppl_final']['mean'])['lr']


def analyse(runs: list[dict]) -> dict:
  """The equal-time budget (the shortest steady time of the runs that did not
  diverge), each run's perplexity at it, the configurations and each family's
  best."""
  finished = [r for r in runs if not r.get('diverged')] or runs
  budget = min(r['steady_s'] for r in finished)
  for r in runs:
    r['val_ppl_at_equal_time'] = ppl_at_time(r['evals'], budget)
  configs = configurations(runs)
  best = best_of_families(configs)
  for c in configs:
    c['best'] = best[c['family']] == c['config']
  for r in runs:
    r['best'] = best[family(r)] == r['config']
  return {'equal_time_s': budget, 'best': best, 'configurations': configs, 'runs': runs}


# ----------------------------------------------------------------------- plots
def _colors(plt, keys) -> dict:
  return dict(zip(keys, plt.rcParams['axes.prop_cycle'].by_key()['color'] * 4))


def plot_quality(res: dict, path: pathlib.Path) -> None:
  """Validation perplexity against tokens and against steady time, one line
  per configuration (its mean over seeds, the band their range); each
  family's best drawn bold."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  configs = res['configurations']
  colors = _colors(plt, sorted({c['family'] for c in configs}))
  fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
  for c in configs:
    n = len(c['runs'])
    kw = dict(color=colors[c['family']], lw=2.2 if c['best'] else 0.9,
              alpha=1.0 if c['best'] else 0.45, marker='o' if c['best'] else None, ms=3,
              label=c['config'] + (f' ({n} seeds)' if n > 1 else '')
              + (' (best)' if c['best'] else ''))
    ev = c['evals']
    ppl = [e['val_ppl']['mean'] for e in ev]
    for ax, x in ((ax_t, [e['tokens'] / 1e6 for e in ev]), (ax_s, [e['steady_s'] for e in ev])):
      ax.plot(x, ppl, **kw)
      if n > 1:
        ax.fill_between(x, [e['val_ppl']['min'] for e in ev], [e['val_ppl']['max'] for e in ev],
                        color=kw['color'], alpha=0.12, lw=0)
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


def spectrum_runs(res: dict) -> list[dict]:
  """The run of each family's best configuration whose spectrum is shown:
  its first seed's."""
  chosen = []
  for key in res['best'].values():
    chosen.append(next(r for r in res['runs'] if r['config'] == key))
  return chosen


def _positive(steps, vals):
  """The points of a log axis (exact zeros, e.g. right after a merge, left off)."""
  pts = [(s, v) for s, v in zip(steps, vals) if v > 0]
  return tuple(zip(*pts)) if pts else ([], [])


def plot_spectrum(res: dict, paths: list[str], path: pathlib.Path) -> None:
  """Drift, entropy and orthogonality error of the best configuration of
  each family (its first seed)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  from matplotlib.lines import Line2D
  chosen = [r for r in spectrum_runs(res) if r['probes']]
  colors = _colors(plt, [family(r) for r in chosen])
  styles = dict(zip(paths, ('-', '--', ':', '-.')))
  markers = dict(zip(paths, ('o', 's', '^', 'v')))
  fig, (ax_d, ax_e, ax_o) = plt.subplots(1, 3, figsize=(16, 4.5))
  for r in chosen:
    steps = [x['step'] for x in r['probes']]
    for p in paths:
      kw = dict(color=colors[family(r)], ls=styles[p], marker='.', lw=1.2)
      ax_d.plot(*_positive(steps, [x[f'{p}/sv_rel_change'] for x in r['probes']]), **kw)
      ax_e.plot(steps, [x[f'{p}/svd_entropy'] for x in r['probes']], **kw)
      if f'{p}/orth_err' in r['probes'][0]:  # points only: merges reset it
        ax_o.plot(*_positive(steps, [x[f'{p}/orth_err'] for x in r['probes']]),
                  **{**kw, 'ls': 'none', 'marker': markers[p]})
  last = max((x['step'] for r in chosen for x in r['probes']), default=0)
  for every in {r['merge_every'] for r in chosen if r['optimizer'] in POET_FAMILIES}:
    for ax in (ax_d, ax_e, ax_o):
      for m in range(every, last + 1, every):
        ax.axvline(m, color='0.6', lw=0.8, ls=':')
  logs = {k: any(x.get(f'{p}/{k}', 0) > 0 for r in chosen for x in r['probes'] for p in paths)
          for k in ('sv_rel_change', 'orth_err')}
  ax_d.set(xlabel='step', ylabel='||s - s0|| / ||s0||', title='singular-value drift from step 0',
           yscale='log' if logs['sv_rel_change'] else 'linear')
  ax_e.set(xlabel='step', ylabel='entropy of s / sum(s) (nats)', title='SVD entropy')
  ax_o.set(xlabel='step (dotted: POET-X merges)', ylabel='max ||G^T G - I||_F / sqrt(B)',
           yscale='log' if logs['orth_err'] else 'linear',
           title='POET-X orthogonality error (exactly 0 after a merge)')
  handles = ([Line2D([], [], color=colors[family(r)], label=f'{family(r)} ({r["name"]})')
              for r in chosen]
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


def _pm(s: dict, spec='.2f') -> str:
  """``mean ± sd`` of a :func:`stat` (the mean alone for one value)."""
  if s['sd'] is None:
    return _fmt(s['mean'], spec)
  return f"{format(s['mean'], spec)} ± {format(s['sd'], spec)}"


def _diverged(r: dict) -> str:
  return f" (diverged; last logged step {r['steps']})" if r.get('diverged') else ''


def _tokens(n: int) -> str:
  return f'{n / 1e6:.2f}M' if n >= 1e6 else f'{n / 1e3:.1f}k'


def _intro(res: dict) -> list[str]:
  from poetx_jax.pretrain.config import TrainConfig
  h = res['header']
  others = sorted({family(r) for r in res['runs'] if r['optimizer'] != 'poetx'})
  return [
      '# Training quality: POET-X against ' + (' and '.join(others) or 'itself'), '',
      f"Model {h['model']} ({h['dense_params']:,} parameters, vocab {h['vocab_size']}), "
      f"seq {h['seq_len']}, batch {h['batch_size']}, {h['steps']} updates = "
      f"{h['tokens_per_run']:,} tokens per run ({h['epochs']:.2f} epochs of "
      f"{h['train_tokens']:,} training tokens), warmup {h['warmup']} then cosine to "
      + (f"{h['min_lr_ratio']:g} of the peak" if h['min_lr_ratio'] is not None else
         'the default share of the peak ('
         + TrainConfig.__dataclass_fields__['min_lr_ratio'].metadata['none'] + ')')
      + f", clip {h['clip']}, seed {h['seed']}"
      + (f"; POET-X merges every {h['merge_every']} updates unless a run sets merge_every"
         if h['merge_every'] is not None else '')
      + f". Validation: {h['val_tokens']:,} tokens "
      f"every {h['eval_every']} updates. Device {h['device']}, compute dtype {h['dtype']}; "
      f"{h['date']}.", '',
      'Runs (overrides of the above; `|` alternatives, each combination a run): '
      + '; '.join(f'`{s}`' for s in h['runs']), '',
      f"data: {h['data']}", '',
      *(["Failed, no result (their logs are in the study's logs/): "
         + '; '.join(f'`{n}`' + _last_eval(h, n) for n in h['failed_runs']), '']
        if h.get('failed_runs') else [])]


def _last_eval(h: dict, name: str) -> str:
  """How far a run without a result got: its last evaluation, if any."""
  e = h.get('last_evals', {}).get(name)
  if not e:
    return ''
  return (f" (reached update {e['reached']:,} of {h['steps']:,}; last evaluation at "
          f"{e['step']:,}, {_tokens(e['tokens'])} tokens: perplexity {e['val_ppl']:.2f})")


def _config_table(res: dict) -> list[str]:
  lines = [
      '## Validation perplexity at equal tokens and at equal time', '',
      f"Per configuration (runs that differ only in seed): mean ± sample standard "
      f"deviation over its seeds. Equal time = {res['equal_time_s']:.1f} s of steady-state "
      'training (the shortest run); steady-state time = training-loop wall time less '
      'evaluation, probes, checkpoints and tracing/compilation (see compare_quality.py). '
      'lr: of every weight for AdamW and SkewAdam, of the non-POET parameters (embeddings, '
      "norms, LM head, routers) for POET-X (with AdamW, or SkewAdam's tiers: skew_tiers).", '',
      '| configuration | seeds | lr | POET lr | final ppl | best ppl | ppl at equal time '
      '| tokens/s |', '|---|---|---|---|---|---|---|---|']
  for c in res['configurations']:
    mark = ' **(best)**' if c['best'] else ''
    lines.append(
        f"| {c['config']}{mark} | {', '.join(map(str, c['seeds']))} | {c['lr']:g} "
        f"| {_fmt(c['poet_lr'], 'g')} | {_pm(c['val_ppl_final'])} | {_pm(c['val_ppl_best'])} "
        f"| {_pm(c['val_ppl_at_equal_time'])} | {_pm(c['steady_tokens_per_s'], ',.0f')} |")
  return lines + ['']


def _run_table(res: dict) -> list[str]:
  lines = ['## Runs', '', f"Loss spikes: {res['header']['spike_rule']}.", '',
           '| run | final ppl | best ppl | ppl at equal time | steady s | tokens/s '
           '| compile s | loss spikes | max sv drift | max orth err |',
           '|---|---|---|---|---|---|---|---|---|---|']
  for r in res['runs']:
    lines.append(
        f"| {r['name']}{_diverged(r)} | {r['val_ppl_final']:.2f} | {r['val_ppl_best']:.2f} "
        f"| {_fmt(r['val_ppl_at_equal_time'])} | {r['steady_s']:.1f} "
        f"| {r['steady_tokens_per_s']:,.0f} | {r['compile_s']:.1f} | {len(r['loss_spikes'])} "
        f"| {_fmt(r['max_sv_rel_change'], '.2e')} | {_fmt(r['max_orth_err'], '.1e')} |")
  routed = [r for r in res['runs'] if 'expert_tokens' in r]
  if routed:
    lines += ['', '## Routing at the last validation', '',
              'Token slots routed to each expert, summed over layers, on the first '
              "validation batch: the most and least loaded expert's share (uniform: "
              f"1/{len(routed[0]['expert_tokens'])}), the share dropped over capacity, and "
              'the load-balance loss (1 when uniform).', '',
              '| run | max share | min share | dropped | load balance |', '|---|---|---|---|---|']
    lines += [f"| {r['name']} | {r['expert_share_max']:.3f} | {r['expert_share_min']:.3f}"
              f" | {r['dropped_share']:.3f} | {r['load_balance']:.3f} |" for r in routed]
  return lines + ['']


def _eval_table(res: dict) -> list[str]:
  configs = res['configurations']
  steps = sorted({e['step'] for c in configs for e in c['evals']})
  tokens = {e['step']: e['tokens'] for c in configs for e in c['evals']}
  lines = ['## Validation perplexity at every evaluation (step: tokens seen)', '',
           'Mean ± standard deviation over the seeds of each configuration.', '',
           '| configuration | ' + ' | '.join(f'{s}: {_tokens(tokens[s])}' for s in steps)
           + ' |', '|---|' + '---|' * len(steps)]
  for c in configs:
    by_step = {e['step']: _pm(e['val_ppl']) for e in c['evals']}
    lines.append(f"| {c['config']} | " + ' | '.join(by_step.get(s, '—') for s in steps) + ' |')
  return lines + ['']


def _spectrum_text(res: dict) -> list[str]:
  h = res['header']
  lines = ['## Spectrum', '',
           f"Probed: {', '.join(h['probed_layers'])}, at steps {h['probe_steps']}. "
           'max sv drift = max over probes and layers of ||s - s0|| / ||s0|| (s the '
           "effective weight's singular values, s0 at step 0); max orth err = max over "
           'probes, layers and blocks of ||G^T G - I||_F / sqrt(B) of the Cayley–Neumann '
           'factors. SVD entropy (p = s / sum s, nats) of the best configuration of each '
           'family (its first seed), first and last probe:', '']
  for r in spectrum_runs(res):
    if r['probes']:
      a, b = r['probes'][0], r['probes'][-1]
      lines.append(f"* {r['name']}: " + ', '.join(
          f"{p} {a[p + '/svd_entropy']:.4f} -> {b[p + '/svd_entropy']:.4f}"
          for p in h['probed_layers']))
  return lines + ['']


def report(res: dict) -> str:
  """The markdown report of an analysed study (:func:`analyse` and its header)."""
  return '\n'.join(_intro(res) + _config_table(res) + _other_val_table(res) + _run_table(res)
                   + _eval_table(res) + _spectrum_text(res))


def _other_val_table(res: dict) -> list[str]:
  """Each configuration's final perplexity on the ``--other-val`` texts beside
  its own validation set's (none: no lines)."""
  names = list(dict.fromkeys(n for c in res['configurations'] for n in c.get('other_val_final', {})))
  if not names:
    return []
  lines = ['## Validation on other text', '',
           'Final perplexity on each --other-val text (another kind than the training '
           'data), beside the run\'s own validation set; mean ± sd over seeds.', '',
           '| configuration | own validation | ' + ' | '.join(names) + ' |',
           '|---' * (len(names) + 2) + '|']
  for c in res['configurations']:
    other = c.get('other_val_final', {})
    lines.append(f"| {c['config']}{' **(best)**' if c['best'] else ''} | "
                 f"{_pm(c['val_ppl_final'])} | "
                 + ' | '.join(_pm(other[n]) if n in other else '—' for n in names) + ' |')
  return lines + ['']


# ------------------------------------------------------------ joined studies
def last_evaluation(run_dir: pathlib.Path, tokens_per_step: int) -> dict | None:
  """The last validation evaluation of a run that has no result (failed or
  stopped before its last update), from what its metrics.jsonl holds:
  ``{'step', 'tokens', 'val_ppl', 'reached'}`` (``reached`` the last update
  it logged), or None when it has no metrics or no evaluation. A last line
  cut short by the stop is dropped."""
  from poetx_jax.pretrain.metrics import read_metrics
  try:
    recs = read_metrics(run_dir, warn=lambda message: None)
  except (OSError, ValueError):
    return None
  evals = [r for r in recs if 'val_ppl' in r]
  if not evals:
    return None
  e = evals[-1]
  return {'step': e['step'], 'tokens': e['step'] * tokens_per_step, 'val_ppl': e['val_ppl'],
          'reached': max(r['step'] for r in recs)}


def from_study(out: pathlib.Path) -> dict:
  """The analysed study of a compare_quality OUT directory, from what its runs
  left there: OUT/study.json (the header written before training, the plan's
  run names) and OUT/runs/NAME/summary.json of each run that finished. The
  plan's runs without a summary (failed, stopped or not yet done) are the
  header's ``failed_runs``; its ``last_evals`` says how far each of them
  that evaluated got (:func:`last_evaluation`). Raises ValueError when no
  run has finished."""
  import json
  out = pathlib.Path(out)
  study = json.loads((out / 'study.json').read_text())
  runs, failed, last = [], [], {}
  tokens_per_step = study['header']['batch_size'] * study['header']['seq_len']
  for name in study['plan']:
    summary = out / 'runs' / name / 'summary.json'
    if summary.is_file():
      runs.append(json.loads(summary.read_text()))
    else:
      failed.append(name)
      if (e := last_evaluation(out / 'runs' / name, tokens_per_step)):
        last[name] = e
  if not runs:
    raise ValueError(f'{out}: none of the study\'s {len(failed)} runs has finished '
                     f'(no runs/NAME/summary.json)')
  header = {**study['header'], 'probed_layers': runs[0]['probed_layers'],
            'probe_steps': [p['step'] for p in runs[0]['probes']], 'failed_runs': failed,
            'last_evals': last}
  return {'header': header, 'args': study['args'], **analyse(runs)}


# The header fields that make runs comparable: a join refuses studies that differ in any.
SETUP = ('model', 'model_overrides', 'seq_len', 'batch_size', 'steps', 'warmup',
         'min_lr_ratio', 'clip', 'eval_every', 'vocab_size')


def join(studies: list[dict]) -> dict:
  """One analysed study of the runs of several (their ``results.json``), e.g.
  a second seed trained later on the same data with the same base options:
  runs whose overrides are the same set of ``K=V`` pairs but for ``seed`` are
  one configuration whatever the order they were written in (``lr=best`` by
  the rate it resolved to); a configuration and seed twice, or studies whose
  :data:`SETUP` differs, are refused. The header is the first study's, its ``runs`` all the studies' specs (each once), its
  ``failed_runs`` those that failed in one study and have no result in any,
  with their ``last_evals``."""
  from poetx_jax.pretrain.kv import split_top
  if not studies:
    raise ValueError('join needs at least one study')
  first = studies[0]['header']
  for study in studies[1:]:
    differ = {k: (first.get(k), study['header'].get(k)) for k in SETUP
              if first.get(k) != study['header'].get(k)}
    if differ:
      raise ValueError(f'the studies differ in their setup (first, other): {differ}; only '
                       f'studies of the same model, batch and schedule join')
  names, seen, runs, keyed = set(), {}, [], set()
  for study in studies:
    for r in study['runs']:
      if r['name'] in names:
        raise ValueError(f'run {r["name"]!r} is in more than one study')
      names.add(r['name'])
      pairs = split_top(r['config'], ',') if r['config'] else []
      # lr=best is the rate it resolved to: runs of other rates are other configurations
      key = frozenset(f'lr={r["lr"]!r}' if p == 'lr=best' else p for p in pairs)
      if (key, r['seed']) in keyed:
        raise ValueError(f'run {r["name"]!r} repeats a configuration and seed of another '
                         f'run (its K=V pairs in another order?)')
      keyed.add((key, r['seed']))
      runs.append({**r, 'config': seen.setdefault(key, r['config'])})
  failed = [n for st in studies for n in st['header'].get('failed_runs', []) if n not in names]
  last = {n: e for st in studies for n, e in st['header'].get('last_evals', {}).items()
          if n in failed}
  specs = [s for st in studies for s in st['header']['runs']]
  header = {**studies[0]['header'], 'runs': list(dict.fromkeys(specs)),
            'failed_runs': list(dict.fromkeys(failed)), 'last_evals': last}
  return {'header': header, **analyse(runs)}


def main(argv=None) -> dict:
  """``quality_report.py --out DIR A/results.json B/ ...``: the report,
  results and plots of the joined studies (:func:`join`) in DIR; a directory
  stands for the compare_quality study in it, read by :func:`from_study`."""
  import argparse
  import json
  p = argparse.ArgumentParser(description='Report several compare_quality studies as one.')
  p.add_argument('results', nargs='+',
                 help="compare_quality's results.json files or its --out directories")
  p.add_argument('--out', required=True, help='writes quality.md, results.json and plots here')
  a = p.parse_args(argv)

  def study(path):
    path = pathlib.Path(path)
    return from_study(path) if path.is_dir() else json.loads(path.read_text())
  try:
    res = join([study(f) for f in a.results])
  except (OSError, ValueError, KeyError) as e:
    p.error(str(e))
  out = pathlib.Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / 'results.json').write_text(json.dumps(res, indent=1))
  md = report(res)
  (out / 'quality.md').write_text(md)
  plot_quality(res, out / 'quality.png')
  plot_spectrum(res, res['header']['probed_layers'], out / 'spectrum.png')
  print(md)
  return res


if __name__ == '__main__':
  main()
