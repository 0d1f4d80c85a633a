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
by size (:mod:`experiments.paper_answer`: one table of the best finished
configuration of each family per size, with their finals, the ratio of each
mean to the tuned AdamW's, prose perplexity, tokens per second marked where
runs shared the GPU, and optimizer state at Llama-8B), each run's
validation perplexity at equal tokens, the ratios that answer the study's
questions, and the steps' times::

    python3 -m experiments.paper_report --collect runs/q19 docs/results/paper-baseline/partial-19m.json
    python3 -m experiments.paper_report docs/results/paper-baseline
"""

from __future__ import annotations

import argparse
import json
import pathlib
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
  a finished run's (one with a ``summary.json``) steady tokens per second,
  timed by :func:`experiments.quality_report.steady_clock` over every process
  of a resumed run; the header keeps the study's ``jobs`` (runs trained at
  once)."""
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
                 'tokens_per_s': _tokens_per_s(lines, header['tokens_per_step'])
                                 if summary.exists() else None})
  keep = ('model', 'model_overrides', 'seq_len', 'batch_size', 'steps', 'warmup', 'device',
          'dense_params', 'tokens_per_step', 'val_tokens', 'date', 'jobs')
  return {'header': {k: header[k] for k in keep if k in header}, 'runs': runs}


def _tokens_per_s(lines: list[dict], tokens_per_step: int) -> float:
  from experiments.quality_report import steady_clock
  _, steps, seconds = steady_clock({r['step']: r for r in lines if 'loss' in r})
  return steps * tokens_per_step / seconds


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
  """How many runs trained at once on the GPU when record ``name`` was made:
  its header's ``jobs``, else the ``--jobs`` of its compare_quality command
  (:func:`record_commands`); 1 (one run at a time) where neither says. A
  call marked ``"together": true`` ran its compare_quality commands at the
  same time: their ``--jobs`` add up."""
  call = study_page.call_of(meta, name)
  if call.get('together'):
    return sum(j for j in map(jobs_of, call['commands']) if j is not None)
  if 'jobs' in record.get('header', {}):
    return record['header']['jobs']
  jobs = [j for j in map(jobs_of, record_commands(meta, name)) if j is not None]
  return jobs[0] if jobs else 1


def shares_gpu(meta: dict, name: str, record: dict) -> bool:
  """Whether record ``name``'s runs trained side by side with other runs on
  the GPU (their tokens per second then compare nothing): more than one at
  once (:func:`record_jobs`), and either the record holds several runs or
  its call ran other studies beside it."""
  call = study_page.call_of(meta, name)
  return record_jobs(meta, name, record) > 1 and (len(record['runs']) > 1
                                                   or bool(call.get('together')))


def schedule_differences(o: dict) -> list[str]:
  """A run's options that differ from the three-sizes study's schedule the
  way the published POET-X's recipe does: the final/peak rate ratio (the
  study's 0.1, the app's default but for POET-X), the clip ramp after merges
  and Adam's offset on the generators (the app's defaults)."""
  from poetx_jax.pretrain.config import TrainConfig
  from poetx_jax.pretrain.recipes import DEFAULT_MIN_LR_RATIO
  default = lambda k: TrainConfig.__dataclass_fields__[k].default
  return [d for d in (
      f"min-lr {o['min_lr_ratio']:g}" if o['min_lr_ratio'] != DEFAULT_MIN_LR_RATIO else '',
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


def mean_sd(v: list[float]) -> str:
  """Finals' mean, with their sample sd where there are several: ``10.33 ± 0.12``."""
  sd = f' ± {statistics.stdev(v):.2f}' if len(v) > 1 else ''
  return f'{statistics.mean(v):.2f}{sd}'


def by_configuration(runs: list[dict]) -> dict[str, list[dict]]:
  """The finished ones of ``runs`` by configuration, each in seed order."""
  out: dict[str, list[dict]] = {}
  for r in runs:
    if r['finished']:
      out.setdefault(configuration(r['options']), []).append(r)
  return {k: sorted(rs, key=lambda r: r['options']['seed']) for k, rs in out.items()}


def finals(res: dict) -> dict[str, list[float]]:
  """The final validation perplexities of a record's finished runs, by
  configuration, in seed order."""
  return {k: [last_eval(r)['val_ppl'] for r in rs]
          for k, rs in by_configuration(res['runs']).items()}


def three_sizes(size: str) -> dict:
  """The three-sizes study's entry for ``size`` (same corpus, tokens and
  validation set): its families' configurations and finals."""
  (entry,) = [s for s in load(THREE_SIZES, 'finals.json')['sizes'] if s['size'] == size]
  return entry


def baselines(size: str) -> dict[str, list[float]]:
  """The three-sizes study's finals at ``size`` by family: the tuned AdamW,
  Muon and the POET-X bests."""
  from experiments import three_sizes_report as T
  return {f"{name} ({f['config']}; three-sizes study)": T.finals(f)
          for name, f in three_sizes(size)['families'].items()}


def finals_rows(res: dict, size: str) -> list[str]:
  """Each configuration's finals (mean ± sd over its seeds) beside the
  three-sizes study's at the same size, with the ratios of their means to
  the tuned AdamW's and to that study's best POET-X's (the block size of
  the lowest mean: 512 at 19M and 130M, 256 at 5M, where only 256 ran)."""
  from experiments import three_sizes_report as T
  entry = three_sizes(size)
  rows = {**finals(res), **baselines(size)}
  mean = lambda v: statistics.mean(v)
  adamw = mean(T.finals(entry['families']['AdamW']))
  best = T.best_poetx(entry)
  poetx = mean(T.finals(entry['families'][best]))
  out = [f'| configuration | finals by seed | mean ± sd | / tuned AdamW | / {best} |',
         '|---|---|---|---|---|']
  for name, v in sorted(rows.items(), key=lambda kv: mean(kv[1])):
    out.append(f"| {name} | {' / '.join(f'{x:.2f}' for x in v)} | {mean_sd(v)} | "
               f'{mean(v) / adamw:.3f} | {mean(v) / poetx:.3f} |')
  return out


def records_by_size(folder: pathlib.Path) -> dict[str, list[str]]:
  """The folder's ``finals-SIZE[-WHAT].json`` records by size (``19M``), in name order."""
  by_size: dict[str, list[str]] = {}
  for name in sorted(p.name for p in folder.glob('finals-*.json')):
    by_size.setdefault(name.removesuffix('.json').split('-')[1].upper(), []).append(name)
  return by_size


def report(folder: pathlib.Path) -> str:
  meta = load(folder, 'calls.json')
  lines = [*header(meta, 'paper_report', folder), *call_lines(meta)]
  for call in meta['calls']:
    if call.get('predictions'):
      lines += [f"Predictions stated before the call writing {', '.join(call['records'])}:", '',
                *[f'* {p}' for p in call['predictions']], '']
    if call.get('outcomes'):
      lines += ['Outcomes:' if call.get('predictions') else
                f"Outcomes of the call writing {', '.join(call['records'])} (no prediction "
                'stated before it):', '', *[f'* {o}' for o in call['outcomes']], '']
  from experiments.paper_answer import answer_lines  # it reads this module's records
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
