"""The paper-baseline study's answer, size by size: per size, the best
finished configuration of each family (POET-X, its reference recipe, POET-X
Muon, AdamW as the paper trains it, the tuned AdamW and Muon) in one table,
its ratio to the tuned AdamW, and one sentence on which claim of the paper
holds under which baseline. :mod:`experiments.paper_report` writes it into
the study's page; :mod:`experiments.results_page` reads its rows.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import statistics

from experiments import harness
from poetx_jax.pretrain.recipes import DEFAULT_MIN_LR_RATIO
from experiments.paper_report import (THREE_SIZES, by_configuration, last_eval, load, mean_sd,
                                      records_by_size, schedule_differences, shares_gpu)


# the families of the answer, in its order, and the run of ``state-8b.json``
# holding each one's optimizer state
FAMILIES = {'POET-X': 'poetx', 'POET-X, reference recipe': 'poetx', 'POET-X Muon': 'poetx-muon',
            'AdamW as the paper trains it': 'adamw-bf16', 'tuned AdamW': 'adamw', 'Muon': 'muon'}


def finished_runs(folder: pathlib.Path, meta: dict, names: list[str]) -> list[dict]:
  """The finished runs of records ``names``, each with its ``record`` (the
  name), the record's ``device`` and ``shared``: whether it trained side by
  side with other runs on the GPU (:func:`shares_gpu`)."""
  out = []
  for name in names:
    rec = load(folder, name)
    shared = shares_gpu(meta, name, rec)
    out += [{**r, 'shared': shared, 'device': rec['header'].get('device'), 'record': name}
            for r in rec['runs'] if r['finished']]
  return out


def lowest(runs: list[dict], keep) -> tuple[str, list[dict], int] | None:
  """Of the configurations whose options ``keep`` accepts, the one of lowest
  mean final validation perplexity: its name, its runs in seed order and how
  many configurations were kept; None where none was."""
  by = by_configuration([r for r in runs if keep(r['options'])])
  if not by:
    return None
  name, rs = min(by.items(),
                 key=lambda kv: statistics.mean(last_eval(r)['val_ppl'] for r in kv[1]))
  return name, rs, len(by)


def recipe_differences(o: dict, lr: float) -> list[str]:
  """A POET-X run's differences from the three-sizes study's POET-X that the
  published POET-X's recipe makes: :func:`schedule_differences` and the
  other parameters' rate (``lr``: the three-sizes study's at the size)."""
  return schedule_differences(o) + ([f"other parameters' lr {o['lr']:g}"]
                                    if not math.isclose(o['lr'], lr) else [])


def answer_rows(folder: pathlib.Path, meta: dict) -> list[dict]:
  """The rows of the answer, sizes in the three-sizes study's order of
  parameters, families in :data:`FAMILIES`' order: each its ``size``,
  ``family``, ``config`` (None: not run), ``finals`` (by seed), ``prose``
  (the prose perplexities at the last step of the runs that keep one; None
  for the three-sizes study's), ``tokens_per_s`` (of the runs that have it,
  in seed order), ``shared_runs`` (whether each of those shared the GPU),
  ``devices`` (the device of each of those), ``records`` (the names of the
  records holding its runs, in seed order; none for the three-sizes
  study's), ``min_lr_ratio`` (its schedule's final/peak ratio) and ``state``
  (optimizer GiB at Llama-8B; None without ``state-8b.json``)."""
  from experiments import three_sizes_report as T
  state = ({r['run']: r['optimizer_gib'] for r in load(folder, 'state-8b.json')}
           if (folder / 'state-8b.json').exists() else {})
  by_size = records_by_size(folder)
  rows = []
  for s in sorted(load(THREE_SIZES, 'finals.json')['sizes'],
                  key=lambda s: s['non_embedding_params']):
    fam = s['families']
    best = T.best_poetx(s)
    lr = float(re.search(r'\blr ([^,\s]+)', fam[best]['config'])[1])
    runs = finished_runs(folder, meta, by_size.get(s['size'], []))
    def three(name):
      if name not in fam:
        return None
      return {'config': f"{name}: {fam[name]['config']} (three-sizes study)",
              'finals': T.finals(fam[name]), 'prose': None, 'tokens_per_s': [], 'shared_runs': [],
              'devices': [], 'records': [], 'min_lr_ratio': DEFAULT_MIN_LR_RATIO}
    def mine(keep, note):
      got = lowest(runs, keep)
      if got is None:
        return None
      name, rs, n = got
      return {'config': name + note(rs, n), 'finals': [last_eval(r)['val_ppl'] for r in rs],
              'prose': [p for p in (last_eval(r)['prose'] for r in rs) if p is not None],
              'tokens_per_s': [r['tokens_per_s'] for r in rs if r.get('tokens_per_s')],
              'shared_runs': [r['shared'] for r in rs if r.get('tokens_per_s')],
              'devices': [r['device'] for r in rs if r.get('tokens_per_s')],
              'records': list(dict.fromkeys(r['record'] for r in rs)),
              'min_lr_ratio': rs[0]['options']['min_lr_ratio']}
    of = lambda n, what: f' (the lowest of {n} {what})' if n > 1 else ''
    def rates(keep):
      # the lowest of several rates, and whether the sweep brackets it
      def note(rs, n):
        tried = {r['options']['lr'] for r in runs if keep(r['options'])}
        if len(tried) < 2:
          return of(n, 'configurations')
        chosen = rs[0]['options']['lr']
        edge = ('; no higher rate finished' if chosen == max(tried) else
                '; no lower rate finished' if chosen == min(tried) else '')
        return f' (the lowest of {len(tried)} rates{edge})'
      return note
    paper = lambda o: (o['optimizer'] == 'adamw' and o['param_dtype'] == 'bfloat16'
                       and o['weight_decay'] == 0)
    recipe = lambda o: o['optimizer'] == 'poetx' and bool(recipe_differences(o, lr))
    got = {
        'POET-X': three(best),
        'POET-X, reference recipe': mine(recipe, lambda rs, n: (
            f" ({' and '.join(recipe_differences(rs[0]['options'], lr))} only"
            + (f'; the lowest of {n})' if n > 1 else ')'))),
        'POET-X Muon': mine(lambda o: o['optimizer'] == 'poetx-muon',
                            lambda rs, n: of(n, 'configurations')),
        'AdamW as the paper trains it': mine(paper, rates(paper)),
        'tuned AdamW': three('AdamW'),
        'Muon': three('Muon')}
    rows += [{'size': s['size'], 'family': f, 'state': state.get(FAMILIES[f]),
              **(got[f] or {'config': None})} for f in FAMILIES]
  return rows


def card(device: str | None) -> str:
  """A record header's device in a word: its NVIDIA model ('1 x NVIDIA H100
  80GB HBM3' -> 'H100'), else the device as it stands."""
  got = re.search(r'NVIDIA (\S+)', device or '')
  return got[1] if got else (device or 'unknown device')


def speeds(row: dict) -> str:
  """A row's tokens per second in seed order, each of a run that trained side
  by side with other runs marked "(shared GPU)"; where its runs ran on more
  than one kind of card (``devices``), each figure names its card; — where
  it has none."""
  ts, shared = row['tokens_per_s'], row['shared_runs']
  if not ts:
    return '—'
  devices = row['devices']
  cards = [card(d) for d in devices] if len(set(devices)) > 1 else [None] * len(ts)
  def marks(s: bool, c: str | None) -> str:
    got = [c] * (c is not None) + ['shared GPU'] * s
    return f" ({', '.join(got)})" if got else ''
  return ' / '.join(f'{t:,.0f}' + marks(s, c) for t, s, c in zip(ts, shared, cards))


def standing(a: list[float], b: list[float]) -> str:
  """Where finals ``a`` stand against finals ``b`` (perplexities, lower
  better): 'ahead' or 'behind' where their means differ by more than the
  larger of their seed sds (the study's rule; a single seed has none),
  'level' where they do not."""
  sd = max([statistics.stdev(v) for v in (a, b) if len(v) > 1], default=0.0)
  d = statistics.mean(a) - statistics.mean(b)
  return 'level' if abs(d) <= sd else 'ahead' if d < 0 else 'behind'


def claim_sentence(rows: list[dict]) -> str:
  """One sentence on which claim of the paper holds under which baseline:
  POET-X's :func:`standing` against AdamW as the paper trains it and
  against the tuned AdamW, at the sizes where both ran."""
  by = {(r['size'], r['family']): r['finals'] for r in rows if r['config']}
  sizes = list(dict.fromkeys(r['size'] for r in rows))
  def where(baseline: str) -> str:
    got: dict[str, list[str]] = {}
    for size in sizes:
      if (size, 'POET-X') in by and (size, baseline) in by:
        got.setdefault(standing(by[size, 'POET-X'], by[size, baseline]), []).append(size)
    if not got:
      return 'has not run'
    words = {'ahead': 'holds', 'level': 'is level', 'behind': 'fails'}
    listed = lambda v: ', '.join(v[:-1]) + ' and ' + v[-1] if len(v) > 1 else v[0]
    return '; '.join(f'{words[k]} at {listed(v)}' for k, v in got.items())
  return ("The paper's claim, POET-X ahead of AdamW, against AdamW as the paper trains it "
          f"{where('AdamW as the paper trains it')}; against the tuned AdamW "
          f"{where('tuned AdamW')} (ahead or behind: the means differ by more than the larger "
          'seed sd of the two; level: by less).')


def answer_lines(folder: pathlib.Path, meta: dict) -> list[str]:
  """The answer, size by size: :func:`answer_rows` as one table, a sentence
  per size with POET-X's and POET-X Muon's ratios to the tuned AdamW and to
  AdamW as the paper trains it, :func:`claim_sentence`, what the tokens per
  second are, and ``state-8b.json``'s optimizer state per run."""
  rows = answer_rows(folder, meta)
  mean = lambda r: statistics.mean(r['finals']) if r['config'] else None
  tuned = {r['size']: mean(r) for r in rows if r['family'] == 'tuned AdamW'}
  path = folder / 'state-8b.json'
  mem = json.loads(path.read_text()) if path.exists() else None
  model = f"Llama-{mem['results'][0]['model'].upper()}" if mem else 'Llama-8B'
  out = ['## The answer, size by size', '',
         'Per size, the finished configuration of lowest mean final validation perplexity of '
         'each family, on the same corpus, tokens in the same order, validation set and '
         'schedule: POET-X is the three-sizes study\'s best block size (its schedule ends at '
         '0.1 of the peak rate; `--optimizer poetx` now ends at 0.01 on these models, the '
         'reference recipe\'s min-lr row); POET-X Muon is the app\'s default optimizer (`poetx '
         'train` with no `--optimizer`), whose schedule now ends at 0.01 on these models too '
         '(its best configuration below says where a run ended at 0.01); the reference recipe is this study\'s POET-X runs with differences the '
         'published POET-X\'s recipe makes (min-lr, the clip ramp after merges, eps, the other '
         'parameters\' rate); AdamW as the paper trains it is AdamW in bf16 with weight decay '
         '0; the tuned AdamW and Muon are the three-sizes study\'s. The ratio is the mean over '
         'the tuned AdamW\'s at the size; prose is the perplexity on the prose set at the last '
         'step, mean over the seeds (— where the record keeps none); the optimizer state is '
         f'`state-8b.json`\'s (below) for the family\'s optimizer at {model}.', '',
         '| size | family | configuration | validation perplexity: finals by seed; mean ± sd (n) '
         f'| / tuned AdamW | prose at the end | tokens/s | optimizer state at {model}, GiB |',
         '|---|---|---|---|---|---|---|---|']
  for r in rows:
    state = '—' if r['state'] is None else f"{r['state']:.2f}"
    if r['config'] is None:
      out.append(f"| {r['size']} | {r['family']} | not run | not run | not run | not run | "
                 f'not run | {state} |')
      continue
    v, m = r['finals'], mean(r)
    ratio = f"{m / tuned[r['size']]:.3f}" if tuned.get(r['size']) else '—'
    prose = f"{statistics.mean(r['prose']):.2f}" if r['prose'] else '—'
    speed = speeds(r)
    out.append(f"| {r['size']} | {r['family']} | {r['config']} | "
               f"{' / '.join(f'{x:.2f}' for x in v)}; {mean_sd(v)} ({len(v)}) | {ratio} | "
               f'{prose} | {speed} | {state} |')
  out.append('')
  for size in tuned:
    means = {r['family']: mean(r) for r in rows if r['size'] == size}
    paper, base = means['AdamW as the paper trains it'], tuned[size]
    if not base:
      continue
    def q(family: str, long: bool) -> str:
      m = means[family]
      if m is None:
        return f'{family}: not run'
      if long:
        return (f"{family} ends {m / base:.3f}× the tuned AdamW's perplexity"
                + (f' and {m / paper:.3f}× that of AdamW as the paper trains it' if paper else
                   ' (AdamW as the paper trains it: not run at this size)'))
      return f'{family} {m / base:.3f}×' + (f' and {m / paper:.3f}×' if paper else '')
    out.append(f"At {size}, {q('POET-X', True)}; {q('POET-X Muon', False)}.")
  out += ['', claim_sentence(rows)]
  headers = [load(folder, name)['header'] for names in records_by_size(folder).values()
             for name in names]
  devices = sorted({h['device'] for h in headers if h.get('device')})
  out += ['', 'Tokens/s: the steady tokens per second of each of the configuration\'s '
          'finished runs, in seed order, at the commit of the call that ran it (above; a '
          'configuration\'s seeds may come from calls of different library code), '
          f"each on {' or '.join(devices) or 'its device'} (the records' headers; a "
          'configuration whose runs ran on different cards names the card of each figure, '
          'and figures of different cards do not compare); '
          '"shared GPU" marks runs that trained side by side with other runs on the GPU (their '
          'study\'s `--jobs` above 1, or another study of their call training at the same time), '
          'whose figure is not a speed comparison. A — marks a '
          'figure the records here do not keep (the three-sizes study\'s keep neither prose nor '
          'speed).',
          '']
  if mem:
    h = mem['header']
    out += [f"Optimizer state at {model} (`state-8b.json`; commit `{h['commit']}`, {h['device']}, "
            f"{h['date']}), computed from the state's abstract shapes:", '',
            f"    {harness.todays_form(h['command'])}", '',
            '| run | model GiB | trainable GiB | optimizer GiB |', '|---|---|---|---|',
            *[f"| {r['run']} | {r['model_gib']:.2f} | {r['trainable_gib']:.2f} | "
              f"{r['optimizer_gib']:.2f} |" for r in mem['results']], '']
  return out
