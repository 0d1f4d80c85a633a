"""The report of the paper-baseline study, generated from its records.

The study asks whether POET-X beats AdamW as the published POET-X measures
it (AdamW in pure bf16, weight decay 0), with the reference's recipe, and
with Muon's orthogonalised updates on the generators (``--optimizer
poetx-muon``). Its folder (``docs/results/paper-baseline``) holds
``calls.json`` (what ran, and the predictions stated before each call) and
one record per call of ``compare_quality.py``'s runs, collected from their
run folders even where the runs did not finish (``--collect``: each run's
options, the evaluations it reached and the merges it warned about), and
``bench_train.py --json`` step records (``step-*.json``), and
``bench_memory.py --state-only`` optimizer state at Llama-8B
(``state-8b.json``). This writes the folder's ``README.md``: the answer size
by size (one table: per size, the best finished configuration of POET-X, its
reference recipe, POET-X Muon, AdamW as the paper trains it, the tuned AdamW
and Muon, with their finals, the ratio of each mean to the tuned AdamW's,
prose perplexity, tokens per second marked where runs shared the GPU, and
optimizer state at Llama-8B), each run's validation perplexity at equal
tokens, the ratios that answer the study's questions, and the steps' times::

    python3 -m experiments.paper_report --collect runs/q19 docs/results/paper-baseline/partial-19m.json
    python3 -m experiments.paper_report docs/results/paper-baseline
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import shlex
import statistics
import sys

from experiments.chunk_report import step_rows
from experiments.study_page import call_lines, header, load
from experiments import harness, study_page

THREE_SIZES = pathlib.Path(__file__).resolve().parents[1] / 'docs' / 'results' / 'three-sizes'

OPTIONS = ('optimizer', 'lr', 'poet_lr', 'weight_decay', 'param_dtype', 'min_lr_ratio', 'clip',
           'clip_ramp', 'poet_eps', 'poet_eps_placement', 'seed', 'steps', 'block_size',
           'merge_every', 'permutation', 'chunk_size')
WARNING = 'far from orthogonal'


def collect(study: pathlib.Path) -> dict:
  """Every run of a compare_quality study folder, finished or not: its name,
  its options as run (``run.json``: the plan's values where the plan
  resolved them), the evaluations of ``metrics.jsonl`` (step, tokens,
  validation and prose perplexity), the last step it logged, how many of
  its merges warned that the factors were far from orthogonal (its log), and
  a finished run's steady tokens per second (``summary.json``); the header
  keeps the study's ``jobs`` (runs trained at once)."""
  header = json.loads((study / 'study.json').read_text())['header']
  runs = []
  for folder in sorted((study / 'runs').iterdir()):
    meta = json.loads((folder / 'run.json').read_text())
    plan = meta.get('plan', {})
    options = {k: plan.get(k, meta.get(k)) for k in OPTIONS}
    lines = [json.loads(l) for l in (folder / 'metrics.jsonl').read_text().splitlines() if l]
    prose = {r['step']: r['other_val/prose/ppl'] for r in lines if 'other_val/prose/ppl' in r}
    evals = [{'step': r['step'], 'tokens': r['step'] * header['tokens_per_step'],
              'val_ppl': r['val_ppl'], 'prose': prose.get(r['step'])}
             for r in lines if 'val_ppl' in r]
    log = study / 'logs' / f'{folder.name}.log'
    warned = log.read_text().count(WARNING) if log.exists() else None
    summary = folder / 'summary.json'
    runs.append({'name': folder.name, 'options': options, 'evals': evals,
                 'last_step': max((r['step'] for r in lines if 'step' in r), default=0),
                 'finished': summary.exists(), 'merge_warnings': warned,
                 'tokens_per_s': (json.loads(summary.read_text()).get('steady_tokens_per_s')
                                  if summary.exists() else None)})
  keep = ('model', 'model_overrides', 'seq_len', 'batch_size', 'steps', 'warmup', 'device',
          'dense_params', 'tokens_per_step', 'val_tokens', 'date', 'jobs')
  return {'header': {k: header[k] for k in keep if k in header}, 'runs': runs}


def _value(words: list[str], flag: str) -> str | None:
  """The value a command's words give ``flag`` (``--flag V`` or ``--flag=V``)."""
  for i, w in enumerate(words):
    if w == flag and i + 1 < len(words):
      return words[i + 1]
    if w.startswith(flag + '='):
      return w.split('=', 1)[1]
  return None


def jobs_of(command: str) -> int | None:
  """The ``--jobs`` of a compare_quality command (1, its default, where it
  names none); None for any other command."""
  words = shlex.split(harness.todays_form(command), comments=True)
  if 'experiments.compare_quality' not in words:
    return None
  return int(_value(words, '--jobs') or 1)


def record_commands(meta: dict, name: str) -> list[str]:
  """The commands of ``calls.json`` that made record ``name``, in their call's
  order: the call's corpus builds, the command whose ``--out`` is the study
  folder that the call's ``--collect`` command into ``name`` reads, and that
  command; none where no call writes the record. A call that built no
  corpus read the one of the latest call before it that did (on the same
  machine, its note says): that build comes first."""
  corpus: list[str] = []
  for call in meta['calls']:
    words = [shlex.split(harness.todays_form(c), comments=True) for c in call['commands']]
    built = [c for c, w in zip(call['commands'], words) if 'experiments.site_corpus' in w]
    if name not in call['records']:
      corpus = built or corpus
      continue
    collect = [i for i, w in enumerate(words)
               if _value(w, '--collect') and pathlib.PurePath(w[-1]).name == name]
    if not collect:
      return []
    study = pathlib.PurePath(_value(words[collect[0]], '--collect'))
    keep = [i for i, w in enumerate(words)
            if i in collect or 'experiments.site_corpus' in w
            or (_value(w, '--out') and pathlib.PurePath(_value(w, '--out')) == study)]
    return ([] if built else corpus) + [call['commands'][i] for i in keep]
  return []


def record_jobs(meta: dict, name: str, record: dict) -> int:
  """How many runs of its study trained at once when record ``name`` was
  made: its header's ``jobs``, else the ``--jobs`` of its compare_quality
  command (:func:`record_commands`); 1 (one run at a time) where neither
  says."""
  if 'jobs' in record.get('header', {}):
    return record['header']['jobs']
  jobs = [j for j in map(jobs_of, record_commands(meta, name)) if j is not None]
  return jobs[0] if jobs else 1


def schedule_differences(o: dict) -> list[str]:
  """A run's options that differ from the app's defaults the way the
  published POET-X's recipe does: the final/peak rate ratio, the clip ramp
  after merges and Adam's offset on the generators."""
  from poetx_jax.pretrain.config import TrainConfig
  default = lambda k: TrainConfig.__dataclass_fields__[k].default
  return [d for d in (
      f"min-lr {o['min_lr_ratio']:g}" if o['min_lr_ratio'] != default('min_lr_ratio') else '',
      f"clip {o['clip']:g}, ramp {o['clip_ramp']}" if o['clip_ramp'] else '',
      f"eps {o['poet_eps']:g} {o['poet_eps_placement']}"
      if o['poet_eps'] != default('poet_eps') else '') if d]


def label(o: dict) -> str:
  """A run's short name: its family, rates and the options that set it apart."""
  if o['optimizer'] == 'adamw':
    name = 'AdamW ' + ('bf16' if o['param_dtype'] == 'bfloat16' else 'fp32')
    name += f", lr {o['lr']:g}, wd {o['weight_decay']:g}"
  else:
    name = {'poetx': 'POET-X', 'poetx-muon': 'POET-X Muon'}[o['optimizer']]
    name += f", step {o['poet_lr']:.3g}, lr {o['lr']:g}"
  return ', '.join([name, *schedule_differences(o)]) + f", seed {o['seed']}"


def warned(run: dict) -> str:
  """A run's merges that warned: '—' for AdamW (none to warn), 'no log'
  where its study kept none (a ``--jobs 1`` study prints to its own output)."""
  if run['options']['optimizer'] == 'adamw':
    return '—'
  return 'no log' if run['merge_warnings'] is None else str(run['merge_warnings'])


def curve_rows(res: dict) -> list[str]:
  """Each run's validation perplexity at every evaluation (equal tokens),
  where it stopped, its last prose perplexity and its warned merges."""
  steps = sorted({e['step'] for r in res['runs'] for e in r['evals'] if e['step']})
  per = res['header']['tokens_per_step']
  out = ['| run | reached | ' + ' | '.join(f'{s * per / 1e6:.1f} M' for s in steps)
         + ' | prose (last) | merges far from orthogonal |',
         '|---|---|' + '---|' * (len(steps) + 2)]
  for r in res['runs']:
    at = {e['step']: e for e in r['evals']}
    last = max((e for e in r['evals'] if e['prose'] is not None), key=lambda e: e['step'],
               default=None)
    reached = 'finished' if r['finished'] else f"step {r['last_step']:,} of {r['options']['steps']:,}"
    out.append(f"| {label(r['options'])} | {reached} | "
               + ' | '.join(f"{at[s]['val_ppl']:.2f}" if s in at else '—' for s in steps)
               + f" | {f'{last['prose']:.2f} at {last['step']:,}' if last else '—'} | "
               f"{warned(r)} |")
  return out


def ratio_rows(res: dict, pairs: list[dict]) -> list[str]:
  """``calls.json``'s comparisons: per pair of runs (named by their labels),
  the ratio of their validation perplexities at every evaluation both reached."""
  by_label = {label(r['options']): r for r in res['runs']}
  per = res['header']['tokens_per_step']
  out = []
  for p in pairs:
    a, b = by_label[p['run']], by_label[p['against']]
    vb = {e['step']: e['val_ppl'] for e in b['evals']}
    common = [(e['step'], e['val_ppl'] / vb[e['step']]) for e in a['evals']
              if e['step'] and e['step'] in vb]
    out += [f"{p['run']} against {p['against']}:", '',
            '| tokens | ' + ' | '.join(f'{s * per / 1e6:.1f} M' for s, _ in common) + ' |',
            '|---|' + '---|' * len(common),
            '| ratio | ' + ' | '.join(f'{q:.3f}' for _, q in common) + ' |', '']
  return out


def last_eval(run: dict) -> dict:
  """A run's last evaluation."""
  return max(run['evals'], key=lambda e: e['step'])


def configuration(o: dict) -> str:
  """A run's label without its seed: the configuration its seeds share."""
  return label(o).rsplit(', seed ', 1)[0]


def finals(res: dict) -> dict[str, list[float]]:
  """The final validation perplexities of a record's finished runs, by
  configuration, in seed order."""
  out: dict[str, list[tuple[int, float]]] = {}
  for r in res['runs']:
    if r['finished']:
      out.setdefault(configuration(r['options']), []).append(
          (r['options']['seed'], last_eval(r)['val_ppl']))
  return {k: [v for _, v in sorted(vs)] for k, vs in out.items()}


def baselines(size: str) -> dict[str, list[float]]:
  """The three-sizes study's finals at ``size`` (same corpus, tokens and
  validation set), by family: the tuned AdamW, Muon and the POET-X bests."""
  from experiments import three_sizes_report as T
  rec = load(THREE_SIZES, 'finals.json')
  (entry,) = [s for s in rec['sizes'] if s['size'] == size]
  return {f"{name} ({f['config']}; three-sizes study)": T.finals(f)
          for name, f in entry['families'].items()}


def finals_rows(res: dict, size: str) -> list[str]:
  """Each configuration's finals (mean ± sd over its seeds) beside the
  three-sizes study's at the same size, with the ratios of their means to
  the tuned AdamW's and to that study's best POET-X's (the block size of
  the lowest mean: 512 at 19M and 130M, 256 at 5M, where only 256 ran)."""
  base = baselines(size)
  rows = {**finals(res), **base}
  mean = lambda v: statistics.mean(v)
  adamw = mean(next(v for k, v in base.items() if k.startswith('AdamW')))
  best, poetx = min(((k.split(' (')[0], mean(v)) for k, v in base.items()
                     if k.startswith('POET-X')), key=lambda kv: kv[1])
  out = [f'| configuration | finals by seed | mean ± sd | / tuned AdamW | / {best} |',
         '|---|---|---|---|---|']
  for name, v in sorted(rows.items(), key=lambda kv: mean(kv[1])):
    sd = f' ± {statistics.stdev(v):.2f}' if len(v) > 1 else ''
    out.append(f"| {name} | {' / '.join(f'{x:.2f}' for x in v)} | {mean(v):.2f}{sd} | "
               f'{mean(v) / adamw:.3f} | {mean(v) / poetx:.3f} |')
  return out


# the families of the answer, in its order, and the run of ``state-8b.json``
# holding each one's optimizer state
FAMILIES = {'POET-X': 'poetx', 'POET-X, reference recipe': 'poetx', 'POET-X Muon': 'poetx-muon',
            'AdamW as the paper trains it': 'adamw-bf16', 'tuned AdamW': 'adamw', 'Muon': 'muon'}


def records_by_size(folder: pathlib.Path) -> dict[str, list[str]]:
  """The folder's ``finals-SIZE[-WHAT].json`` records by size (``19M``), in name order."""
  by_size: dict[str, list[str]] = {}
  for name in sorted(p.name for p in folder.glob('finals-*.json')):
    by_size.setdefault(name.removesuffix('.json').split('-')[1].upper(), []).append(name)
  return by_size


def finished_runs(folder: pathlib.Path, meta: dict, names: list[str]) -> list[dict]:
  """The finished runs of records ``names``, each with its ``record``
  (the name), the record's ``device`` and ``shared``: whether it trained side by side with other runs
  of its study on the GPU (more than one run in the record, and its study
  trained more than one at once: :func:`record_jobs`)."""
  out = []
  for name in names:
    rec = load(folder, name)
    shared = len(rec['runs']) > 1 and record_jobs(meta, name, rec) > 1
    out += [{**r, 'shared': shared, 'device': rec['header'].get('device'), 'record': name}
            for r in rec['runs'] if r['finished']]
  return out


def lowest(runs: list[dict], keep) -> tuple[str, list[dict], int] | None:
  """Of the configurations whose options ``keep`` accepts, the one of lowest
  mean final validation perplexity: its name, its runs in seed order and how
  many configurations were kept; None where none was."""
  by: dict[str, list[dict]] = {}
  for r in runs:
    if keep(r['options']):
      by.setdefault(configuration(r['options']), []).append(r)
  if not by:
    return None
  name, rs = min(by.items(),
                 key=lambda kv: statistics.mean(last_eval(r)['val_ppl'] for r in kv[1]))
  return name, sorted(rs, key=lambda r: r['options']['seed']), len(by)


def recipe_differences(o: dict, lr: float) -> list[str]:
  """A POET-X run's differences from the app's default recipe that the
  published POET-X's recipe makes: :func:`schedule_differences` and the
  other parameters' rate (``lr``: the three-sizes study's at the size)."""
  return schedule_differences(o) + ([f"other parameters' lr {o['lr']:g}"]
                                    if not math.isclose(o['lr'], lr) else [])


def answer_rows(folder: pathlib.Path, meta: dict) -> list[dict]:
  """The rows of the answer, sizes in the three-sizes study's order of
  parameters, families in :data:`FAMILIES`' order: each its ``size``,
  ``family``, ``config`` (None: not run), ``finals`` (by seed), ``prose``
  (the prose perplexities at the last step; None where the record keeps
  none), ``tokens_per_s`` (of the runs that have it, in seed order), ``shared``,
  ``records`` (the names of the records holding its runs, in seed order;
  none for the three-sizes study's) and ``state`` (optimizer GiB at Llama-8B; None
  without ``state-8b.json``)."""
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
              'finals': T.finals(fam[name]), 'prose': None, 'tokens_per_s': [], 'shared': False,
              'records': []}
    def mine(keep, note):
      got = lowest(runs, keep)
      if got is None:
        return None
      name, rs, n = got
      return {'config': name + note(rs, n), 'finals': [last_eval(r)['val_ppl'] for r in rs],
              'prose': [p for p in (last_eval(r)['prose'] for r in rs) if p is not None],
              'tokens_per_s': [r['tokens_per_s'] for r in rs if r.get('tokens_per_s')],
              'shared': any(r['shared'] for r in rs if r.get('tokens_per_s')),
              'records': list(dict.fromkeys(r['record'] for r in rs))}
    of = lambda n, what: f' (the lowest of {n} {what})' if n > 1 else ''
    def rates(keep):
      # the lowest of several rates, and whether the sweep brackets it
      def note(rs, n):
        if n < 2:
          return ''
        tried = {r['options']['lr'] for r in runs if keep(r['options'])}
        best = rs[0]['options']['lr']
        edge = ('; no higher rate finished' if best == max(tried) else
                '; no lower rate finished' if best == min(tried) else '')
        return f' (the lowest of {n} rates{edge})'
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
         'schedule: POET-X is the three-sizes study\'s best block size (the app\'s default '
         'recipe); the reference recipe is this study\'s POET-X runs with differences the '
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
    sd = f' ± {statistics.stdev(v):.2f}' if len(v) > 1 else ''
    ratio = f"{m / tuned[r['size']]:.3f}" if tuned.get(r['size']) else '—'
    prose = f"{statistics.mean(r['prose']):.2f}" if r['prose'] else '—'
    speed = (' / '.join(f'{t:,.0f}' for t in r['tokens_per_s'])
             + (' (shared GPU)' if r['shared'] else '') if r['tokens_per_s'] else '—')
    out.append(f"| {r['size']} | {r['family']} | {r['config']} | "
               f"{' / '.join(f'{x:.2f}' for x in v)}; {m:.2f}{sd} ({len(v)}) | {ratio} | "
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
          f"each on {' or '.join(devices) or 'its device'} (the records' headers); "
          '"shared GPU" marks runs that trained side by side with other runs of their study on '
          'the GPU (its `--jobs` above 1), whose figure is not a speed comparison. A — marks a '
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


def report(folder: pathlib.Path) -> str:
  meta = load(folder, 'calls.json')
  lines = [*header(meta, 'paper_report', folder), *call_lines(meta)]
  for call in meta['calls']:
    if call.get('predictions'):
      lines += [f"Predictions stated before the call writing {', '.join(call['records'])}:", '',
                *[f'* {p}' for p in call['predictions']], '']
    if call.get('outcomes'):
      lines += ['Outcomes:', '', *[f'* {o}' for o in call['outcomes']], '']
  lines += answer_lines(folder, meta)
  for size, names in records_by_size(folder).items():
    res = {'runs': [r for name in names for r in load(folder, name)['runs']]}
    lines += [f'## Final validation perplexity at {size}', '',
              f"The finished runs of {', '.join(f'`{n}`' for n in names)} beside the "
              'three-sizes study\'s finals at the same size (the same corpus, tokens in the '
              'same order, validation set and schedule); sorted by mean:', '',
              *finals_rows(res, size), '']
  for name in sorted(p.name for p in folder.glob('*.json')
                     if p.name.startswith(('partial-', 'finals-'))):
    res = load(folder, name)
    h = res['header']
    model = h['model'] + (f" ({', '.join(f'{k}={v}' for k, v in h['model_overrides'].items())})"
                          if h.get('model_overrides') else '')
    lines += [f'## `{name}`', '',
              f"{model}, {h['dense_params']:,} parameters, seq {h['seq_len']}, batch "
              f"{h['batch_size']}, {h['steps']:,} updates planned, warmup {h['warmup']}, "
              f"{h['device']}; validation {h['val_tokens']:,} tokens. Perplexity on the "
              'validation set at equal tokens:', '', *curve_rows(res), '',
              *ratio_rows(res, [c for c in meta.get('comparisons', []) if c['record'] == name])]
  for name in sorted(p.name for p in folder.glob('step-*.json')):
    recs = load(folder, name)
    first = recs[0]
    lines += [f"## `{name}`: the training step", '',
              f"{first['model']}, seq {first['seq_len']}, batch {first['batch']}, {first['device']}",
              '', *step_rows(recs, recs[0]['run']), '']
  return '\n'.join(lines)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] == '--collect':
    p = argparse.ArgumentParser(description='collect a study\'s runs into a record')
    p.add_argument('--collect', type=pathlib.Path, required=True, metavar='STUDY')
    p.add_argument('out', type=pathlib.Path)
    a = p.parse_args(argv)
    a.out.write_text(json.dumps(collect(a.collect), indent=1) + '\n')
    return
  study_page.main(__doc__, report, argv)


if __name__ == '__main__':
  main()
