"""The report of a chunk-permutation study, generated from its records.

A study folder (``docs/results/chunk-permutations``) holds ``calls.json``
(what ran: date, commit, device, and per call its records and the commands
that wrote them, a call's own commit, date and device where they differ;
``references``: figures of other studies compared with, and their pages),
the kernel records of ``bench_fused.py --json``, the step records of
``bench_train.py --json`` (``step-*.json``; a run named ``poet_torch ...``
holds poet_torch_step.py's figures of the same call), the traces of
``profile_step.py --json`` (``profile-*.json``) and the quality studies'
``results.json`` of ``quality_report.py`` (``quality-*.json``). This writes
the folder's ``README.md`` from them: the gathers against the copy floor, the
fused kernels against XLA's compositions, each training step against AdamW
(or poet_torch) of the same call, where a profiled step's time goes, and
each draw's validation perplexity per seed, so that every figure on the page
comes from a record::

    python3 -m experiments.chunk_report docs/results/chunk-permutations
"""

from __future__ import annotations

import pathlib
import statistics

from experiments.study_page import call_lines, header, load
from experiments import study_page


def gather_rows(kernels: list[dict]) -> list[str]:
  """Per width and run length: copy, gather and gather fwd+bwd, each gather
  as a share of the copy rate (the copy's time over the gather's; fwd+bwd
  against two copies)."""
  out = ['| width | run length | copy (`x + 1`) | gather | share of the copy rate | '
         'gather fwd+bwd | share of two copies |', '|---|---|---|---|---|---|---|']
  for r in kernels:
    ms = r['ms']
    copy, g, gb = ms['copy'][0], ms['gather xla'][0], ms['gather xla fwd+bwd'][0]
    out.append(f"| {r['width']} | {r['chunk']} | {1e3 * copy:.0f} µs | {1e3 * g:.0f} µs | "
               f"{100 * copy / g:.0f}% | {1e3 * gb:.0f} µs | {200 * copy / gb:.0f}% |")
  return out


FUSED = ('gather+rotate xla', 'gather_rotate C 256 warps 8', 'gather_rotate mosaic',
         'rotate+unpermute xla', 'rotate_scatter', 'rotate_scatter mosaic', 'gram xla',
         'block_gram', 'permute_rotate fwd+bwd xla', 'permute_rotate fwd+bwd fused',
         'permute_rotate fwd+bwd mosaic', 'rotate_unpermute fwd+bwd xla',
         'rotate_unpermute fwd+bwd fused', 'rotate_unpermute fwd+bwd mosaic')


def fused_rows(kernels: list[dict]) -> list[str]:
  """The fused kernels (Triton ``fused``, Mosaic ``mosaic``) beside the XLA
  compositions they replace, at the widths where they were timed."""
  timed = [r for r in kernels if 'gather+rotate xla' in r['ms']]
  head = ' | '.join(f"N {r['width']}, run {r['chunk']}" for r in timed)
  out = [f'| op (µs) | {head} |', '|---|' + '---|' * len(timed)]
  for name in FUSED:
    if any(name in r['ms'] for r in timed):
      cells = [f"{1e3 * r['ms'][name][0]:.0f}" if name in r['ms'] else '—' for r in timed]
      out.append(f"| {name} | {' | '.join(cells)} |")
  return out


def step_rows(records: list[dict], baseline: str) -> list[str]:
  """Per run: the median of its rounds' steps, tokens/s and peak, and the
  ratio of tokens/s to ``baseline``'s (same call)."""
  runs: dict[str, list[dict]] = {}
  for r in records:
    runs.setdefault(r['run'], []).append(r)
  base = statistics.median(r['step_s'] for r in runs[baseline])
  out = ['| run | rounds | step (median of rounds) | tokens/s | peak GiB | against ' + baseline
         + ' |', '|---|---|---|---|---|---|']
  for name, rs in runs.items():
    step = statistics.median(r['step_s'] for r in rs)
    tokens = rs[0]['batch'] * rs[0]['seq_len'] / step
    out.append(f"| {name} | {', '.join(f'{1e3 * r['step_s']:.1f}' for r in rs)} ms | "
               f"{1e3 * step:.1f} ms | {tokens:,.0f} | {rs[0]['peak_gib']:.2f} | {base / step:.3f}× |")
  return out


def profile_rows(records: list[dict], top: int = 8) -> list[str]:
  """Per profiled run: wall and busy time per step and each kernel
  category's; then its ``top`` kernels (per step, summed over launches)."""
  cats = list(records[0]['categories'])
  out = ['| run | wall | device busy | ' + ' | '.join(cats) + ' |',
         '|---|---|---|' + '---|' * len(cats)]
  for r in records:
    out.append(f"| {r['run']} | {r['wall_ms']:.1f} ms | {100 * r['busy_share']:.0f}% | "
               + ' | '.join(f"{r['categories'][c]['ms']:.1f} ms ({100 * r['categories'][c]['share']:.0f}%)"
                            for c in cats) + ' |')
  for r in records:
    out += ['', f"The {top} largest kernels of `{r['run']}` (ms a step, summed over a step's launches):", '',
            '| kernel | category | ms | share | launches a step |', '|---|---|---|---|---|']
    for k in r['top'][:top]:
      out.append(f"| `{k['op']}` | {k['category']} | {k['ms']:.1f} | {100 * k['share']:.1f}% | "
                 f"{k['launches']} |")
  return out


def _draw(config: str, run: dict | None = None) -> str:
  """A quality run's permutation draw: the one its record says it ran
  (compare_quality records the plan's), else the one its configuration's
  overrides give (records written before that, and runs that did not
  finish); 'default draw' where neither says (it depends on the device)."""
  from poetx_jax.pretrain.config import TrainConfig
  from poetx_jax.pretrain.kv import parse_overrides
  if run is not None and run.get('permutation') is not None:
    permutation, chunk = run['permutation'], run.get('chunk_size')
  else:
    pairs = parse_overrides(config)
    permutation, chunk = pairs.get('permutation'), pairs.get('chunk_size', TrainConfig.chunk_size)
  if permutation is None:
    return 'default draw'
  return f'chunk, runs of {chunk}' if permutation == 'chunk' else 'element'


def quality_rows(res: dict) -> list[str]:
  """Per configuration (labelled by its draw): the final validation
  perplexity of each seed (a run stopped early: its last evaluation and
  where it was), mean ± sd of the finished seeds, and the paired difference
  from the element draw's run of the same seed (same initial weights and the
  same batches in the same order)."""
  header = res['header']
  seeds = sorted({r['seed'] for r in res['runs']} |
                 {int(n.rsplit('seed=', 1)[1]) for n in header.get('failed_runs', [])})
  configs: dict[str, dict[int, dict]] = {}
  labels: dict[str, str] = {}
  for r in res['runs']:
    configs.setdefault(r['config'], {})[r['seed']] = r
    labels[r['config']] = _draw(r['config'], r)
  stopped: dict[str, dict[int, dict | None]] = {}
  for name in header.get('failed_runs', []):
    config, seed = name.rsplit(',seed=', 1)
    stopped.setdefault(config, {})[int(seed)] = header.get('last_evals', {}).get(name)
    configs.setdefault(config, {})
    labels.setdefault(config, _draw(config))
  element = next((configs[c] for c, label in labels.items() if label == 'element'), {})
  cols = ' | '.join(f'seed {s}' for s in seeds)
  out = [f'| draw | {cols} | mean ± sd | prose, mean | against element, same seed |',
         '|---|' + '---|' * (len(seeds) + 3)]
  for config, runs in configs.items():
    cells = []
    for s in seeds:
      if s in runs:
        cells.append(f"{runs[s]['val_ppl_final']:.2f}")
      elif stopped.get(config, {}).get(s):
        e = stopped[config][s]
        cells.append(f"stopped at {e['reached']:,} ({e['val_ppl']:.2f} at {e['tokens'] / 1e6:.1f} M)")
      else:
        cells.append('not run')
    finals = [r['val_ppl_final'] for r in runs.values()]
    mean = (f'{statistics.mean(finals):.2f} ± {statistics.stdev(finals):.2f}'
            if len(finals) > 1 else f'{finals[0]:.2f}' if finals else '—')
    prose = [r['other_val_final']['prose'] for r in runs.values()
             if (r.get('other_val_final') or {}).get('prose') is not None]
    diffs = [f"{runs[s]['val_ppl_final'] - element[s]['val_ppl_final']:+.2f}"
             for s in seeds if s in runs and s in element] if runs is not element else []
    out.append(f"| {labels[config]} | {' | '.join(cells)} | {mean} | "
               f"{f'{statistics.mean(prose):.2f}' if prose else '—'} | {', '.join(diffs) or '—'} |")
  return out


def curve_rows(res: dict) -> list[str]:
  """Every run's validation perplexity at each evaluation (equal tokens), the
  stopped runs' evaluations included where their metrics reach."""
  runs = sorted(res['runs'], key=lambda r: (r['seed'], r['config']))
  steps = sorted({e['step'] for r in runs for e in r['evals'] if e['step']})
  tokens = {e['step']: e['tokens'] for r in runs for e in r['evals']}
  out = ['| run | ' + ' | '.join(f'{tokens[s] / 1e6:.1f} M' for s in steps) + ' |',
         '|---|' + '---|' * len(steps)]
  for r in runs:
    at = {e['step']: e['val_ppl'] for e in r['evals']}
    out.append(f"| {_draw(r['config'], r)}, seed {r['seed']} | "
               + ' | '.join(f'{at[s]:.2f}' if s in at else '—' for s in steps) + ' |')
  return out


def reference_line(res: dict, ref: dict) -> str:
  """A reference study's figures (``calls.json``'s ``references``) beside
  this study's runs of the same seeds."""
  mine = {str(r['seed']): r['val_ppl_final'] for r in res['runs']}
  cells = ', '.join(f'seed {s}: {v:.2f}' + (f' (this study {mine[s] - v:+.2f})' if s in mine else '')
                    for s, v in ref['final_ppl'].items())
  return (f"Compared with {ref['what']} ([page]({ref['source']})): {cells}; prose "
          f"{ref['prose_mean']:.2f} ± {ref['prose_sd']:.2f}.")


def quality_section(folder: pathlib.Path, name: str, references: list[dict]) -> list[str]:
  res = load(folder, name)
  h = res['header']
  model = h['model'] + (f" ({', '.join(f'{k}={v}' for k, v in h['model_overrides'].items())})"
                        if h['model_overrides'] else '')
  refs = [reference_line(res, ref) for ref in references if ref.get('record') == name]
  return [f"`{name}` ([plot]({name.replace('.json', '.png')})): {model}, "
          f"{h['dense_params']:,} parameters, seq {h['seq_len']}, batch {h['batch_size']}, "
          f"{h['steps']:,} updates ({h['tokens_per_run'] / 1e6:.1f} M tokens), warmup "
          f"{h['warmup']}, {h['dtype']}, {h['device']}; validation {h['val_tokens']:,} tokens.",
          '', *quality_rows(res), '', *[line for r in refs for line in (r, '')],
          *curve_rows(res), '']


def report(folder: pathlib.Path) -> str:
  meta = load(folder, 'calls.json')
  lines = header(meta, 'chunk_report', folder)
  lines += call_lines(meta)
  kernels = load(folder, 'kernels.json')
  lines += ['## The gathers against the copy floor (T = 8192 tokens, bf16)', '',
            *gather_rows(kernels), '',
            '## The fused kernels against the XLA compositions (B = 256)', '',
            *fused_rows(kernels), '', '## The training step', '']
  for name in sorted(p.name for p in folder.glob('step-*.json')):
    recs = load(folder, name)
    first = recs[0]
    names = [r['run'] for r in recs]
    base = ('adamw' if 'adamw' in names else
            next((n for n in names if n.startswith('poet_torch')), names[0]))
    lines += [f"`{name}`: {first['model']}, seq {first['seq_len']}, batch {first['batch']}, "
              f"{first['device']}", '', *step_rows(recs, base), '']
  for name in sorted(p.name for p in folder.glob('profile-*.json')):
    recs = load(folder, name)
    first = recs[0]
    lines += [f"### Where the time goes: `{name}`", '',
              f"{first['model']}, seq {first['seq_len']}, batch {first['batch']}, {first['device']}; "
              f"{first['steps']} traced steps dispatched back to back.", '', *profile_rows(recs), '']
  quality = sorted(p.name for p in folder.glob('quality-*.json'))
  if quality:
    lines += ['## Quality: validation perplexity of each draw on the same tokens', '']
    for name in quality:
      lines += quality_section(folder, name, meta.get('references', []))
  return '\n'.join(lines)


def main(argv=None):
  study_page.main(__doc__, report, argv)


if __name__ == '__main__':
  main()
