"""RESULTS.md: where POET-X stands, one row per claim, generated from the
study records under ``docs/results/``.

Each row reads its figure from a record (a study folder's JSON, written by
the script its ``calls.json`` names), or from several where its figure joins
runs of several calls, and gives the device, commit and date of the calls
that wrote them, the commands, and a link to the study's page, where
every figure of the study is shown. The memory rows' record was recovered
from BENCHMARKS.md, whose sections give their commands. It also writes a few of
the rows into README.md, between the markers ``README_BEGIN`` and
``README_END``. A test fails when either differs from what this writes::

    python3 -m experiments.results_page
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics

from experiments import harness, study_page
from poetx_jax.pretrain.recipes import DEFAULT_MIN_LR_RATIO


ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / 'docs' / 'results'


def _load(study: str, name: str):
  return study_page.load(RESULTS / study, name)


def _call(study: str, record: str) -> dict:
  """The call of ``study`` that wrote ``record``: its commands and the
  commit, date and device it ran at (the study's where the call names none)."""
  meta = _load(study, 'calls.json')
  call = study_page.call_of(meta, record)
  if not call:
    raise ValueError(f'{study}: no call of its calls.json wrote {record}')
  return {k: call.get(k, meta[k]) for k in ('commit', 'date', 'device')} | {
      'commands': call['commands']}


def _step_ms(records: list[dict], run: str) -> float:
  return 1e3 * statistics.median(r['step_s'] for r in records if r['run'] == run)


def _row(claim: str, figure: str, study: str, record: str, *more: str,
         also: tuple[str, ...] = (), commands: list[str] | None = None) -> dict:
  """A row read from ``record`` and the records ``more`` (where its figure
  joins several calls' runs); its commands (unless given) are those of each
  record's call that name the record or one of ``also`` (the steps before
  it: a corpus, another program). Its commit, date and device are the
  call's; where the calls differ in any, each field lists every distinct
  call's, in the same order across the three."""
  calls = [_call(study, r) for r in (record, *more)]
  if commands is None:
    commands = list(dict.fromkeys(c for call, r in zip(calls, (record, *more))
                                  for c in call['commands'] if any(k in c for k in (r,) + also)))
  keys = ('commit', 'date', 'device')
  where = list(dict.fromkeys(tuple(call[k] for k in keys) for call in calls))
  return {'claim': claim, 'figure': figure, 'study': study, 'records': [record, *more],
          'commands': commands,
          **{k: ', '.join(w[i] for w in where) if len({w[i] for w in where}) > 1 else where[0][i]
             for i, k in enumerate(keys)}}


def step_rows() -> list[dict]:
  """The training step against AdamW (same call) at 130M, 1B and 8B, and
  against poet_torch at 8B; where the 8B step's time goes."""
  study, out = 'chunk-permutations', []
  for record, model, tied in (('step-130m.json', '130M', None), ('step-1b-tied.json', '1B', 'chunk-tied'),
                              ('step-8b.json', '8B', 'chunk-tied')):
    recs = _load(study, record)
    adamw, chunk = _step_ms(recs, 'adamw'), _step_ms(recs, 'chunk')
    figure = f'{adamw / chunk:.3f}× AdamW ({chunk:.1f} against {adamw:.1f} ms)'
    if tied:
      t = _step_ms(recs, tied)
      figure += f'; tied permutations {adamw / t:.3f}× ({t:.1f} ms)'
    out.append(_row(f'POET-X step against AdamW, {model}', figure, study, record))
  recs = _load(study, 'step-8b-torch.json')
  torch = next(r['run'] for r in recs if r['run'].startswith('poet_torch'))
  ours, theirs = _step_ms(recs, 'chunk'), _step_ms(recs, torch)
  out.append(_row('POET-X step against poet_torch (the published PyTorch POET-X), 8B',
                  f'{theirs / ours:.3f}× ({ours:.1f} against {theirs:.1f} ms)', study,
                  'step-8b-torch.json', also=('poet_torch_step',)))
  peak = next(r['peak_gib'] for r in recs if r['run'] == 'chunk')
  adamw = next(r for r in _load(study, 'step-8b.json') if r['run'] == 'adamw')
  out.append(_row('Peak GPU memory of the 8B step (default mode, batch 8 x 1024)',
                  f"POET-X {peak:.2f} GiB against poet_torch's {next(r['peak_gib'] for r in recs if r['run'] == torch):.2f} "
                  f"(same call) and AdamW's {adamw['peak_gib']:.2f} (step-8b.json)", study,
                  'step-8b-torch.json', also=('poet_torch_step',)))
  prof = _load(study, 'profile-8b.json')[0]
  cats = prof['categories']
  out.append(_row('Where the 8B POET-X step\'s time goes',
                  f"GEMMs {100 * cats['gemm']['share']:.0f}%, permutation gathers "
                  f"{100 * cats['gather']['share']:.0f}% ({cats['gather']['ms']:.1f} ms) of "
                  f"{prof['wall_ms']:.1f} ms", study, 'profile-8b.json'))
  return out


# bench_fused's names of the kernel families
KERNELS = {'fused': 'Pallas Triton', 'mosaic': 'Pallas Mosaic GPU'}


def kernel_rows() -> list[dict]:
  """The fused Pallas kernels against XLA's composition, widest shape timed."""
  study, record = 'chunk-permutations', 'kernels.json'
  widest = max((r for r in _load(study, record) if 'permute_rotate fwd+bwd xla' in r['ms']
                and r['chunk'] > 1), key=lambda r: r['width'])
  ms = widest['ms']
  xla = 1e3 * ms['permute_rotate fwd+bwd xla'][0]
  fused = min((1e3 * ms[k][0], k) for k in ms if k.startswith('permute_rotate fwd+bwd')
              and not k.endswith('xla'))
  return [_row('Fused Pallas kernels against XLA (gather + block rotation, fwd+bwd)',
               f"XLA faster at every shape timed; N {widest['width']}, runs of {widest['chunk']}: "
               f"XLA {xla:.0f} µs, best kernel ({KERNELS[fused[1].rsplit(' ', 1)[-1]]}) "
               f"{fused[0]:.0f} µs",
               study, record)]


def scaling_rows() -> list[dict]:
  """Data-parallel bytes per update at 1B, the model's check against two
  GPUs, and the projection at 64 GPUs; POET-X under fsdp at 8B."""
  study, record = 'scaling', 'comm-1b.json'
  rec = _load(study, record)
  dp = {r['optimizer']: r for r in rec['records'] if r['strategy'] == 'dp' and r['devices'] == 2
        and r['grad_accum'] == 1 and r.get('optimizer_state', 'replicated') == 'replicated'}
  mib = {k: v['gpu_allreduce_bytes'] / 2**20 for k, v in dp.items()}
  check = {c['run']: c for c in rec['check']}
  p64 = [p for p in rec['projection'] if p['gpus'] == 64 and p['grad_accum'] == 1]
  poet, adamw, zero1 = (next(p for p in p64 if p['run'] == run)
                        for run in ('chunk', 'adamw', 'adamw-zero1'))
  span = lambda p: f"{p['efficiency_no_overlap']:.3f}–{p['efficiency_overlap']:.3f}"  # noqa: E731
  return [
      _row('Data-parallel all-reduce per update, 1B (from the compiled program)',
           f"POET-X {mib['poetx']:,.1f} MiB against AdamW {mib['adamw']:,.1f} MiB", study, record),
      _row('The communication model against two H200s (measured efficiency)',
           f"POET-X {check['poetx']['predicted_no_overlap']:.3f} predicted, "
           f"{check['poetx']['measured']:.3f} measured; AdamW "
           f"{check['adamw']['predicted_no_overlap']:.3f}, {check['adamw']['measured']:.3f}",
           study, record),
      _row('Data-parallel efficiency at 64 GPUs, 1B (projected)',
           f"POET-X {span(poet)}, AdamW {span(adamw)}, AdamW with its optimizer state split "
           f"(ZeRO stage 1) {span(zero1)} (no overlap – full overlap); projected, not measured",
           study, record),
      *fsdp_rows()]


def fsdp_rows() -> list[dict]:
  """POET-X under fsdp at 8B: what its update sends, and its projected
  efficiency at 64 GPUs with one micro-batch an update."""
  study, record = 'scaling', 'comm-8b.json'
  rec = _load(study, record)
  (r,) = [r for r in rec['records'] if r['run'] == 'chunk-fsdp' and r['devices'] == 8]
  (p,) = [p for p in rec['projection'] if p['run'] == 'chunk-fsdp' and p['gpus'] == 64
          and p['grad_accum'] == 1]
  gib = 2 ** 30
  return [_row('POET-X under FSDP, 8B: an update on 8 devices (from the compiled program), and '
               'its efficiency at 64 GPUs (projected)',
               f"trained arrays {r['trainable_bytes'] / gib:.2f} GiB gathered once and "
               f"reduce-scattered once; frozen bases gathered "
               f"{r['frozen_gather_bytes_per_microbatch'] / gib:.1f} GiB a micro-batch; "
               f"64 GPUs {p['efficiency_no_overlap']:.3f}–{p['efficiency_overlap']:.3f} "
               '(no overlap – full overlap), projected, not measured', study, record)]


def paper_rows() -> list[dict]:
  """Per size, AdamW as the POET-X paper trains it, POET-X at the reference
  recipe's min-lr ratio (where the reference recipe's best is it) and POET-X Muon, each the
  best configuration of its family in the paper-baseline study's answer
  (:func:`experiments.paper_answer.answer_rows`, whose seeds may come from
  several records), against our tuned fp32 AdamW, POET-X and Muon (the
  three-sizes study's finals: same corpus, tokens and validation)."""
  from experiments import paper_answer, paper_report as P, three_sizes_report as T
  study = 'paper-baseline'
  meta = _load(study, 'calls.json')
  answer = paper_answer.answer_rows(RESULTS / study, meta)
  mean = statistics.mean
  def stats(r):
    v = r['finals']
    return f"{P.mean_sd(v)} ({len(v)} seed{'s' if len(v) > 1 else ''})"
  def made(r):
    # the commands that made the configuration's records
    return list(dict.fromkeys(c for n in r['records'] for c in P.record_commands(meta, n)))
  def same_call_ratio(r):
    # its tokens/s over POET-X's where its runs and POET-X runs come from one
    # call that ran them one at a time (the same library code, the GPU unshared)
    if len(r['records']) != 1 or any(r['shared_runs']) or not r['tokens_per_s']:
      return None
    rec = _load(study, r['records'][0])
    speeds = [x['tokens_per_s'] for x in rec['runs']
              if x['finished'] and x['options']['optimizer'] == 'poetx' and x.get('tokens_per_s')]
    if not speeds or P.record_jobs(meta, r['records'][0], rec) != 1:
      return None
    return mean(r['tokens_per_s']) / mean(speeds)
  out = []
  for size in dict.fromkeys(r['size'] for r in answer):
    got = {r['family']: r for r in answer if r['size'] == size and r['config']}
    m = {f: mean(r['finals']) for f, r in got.items()}
    best = T.best_poetx(P.three_sizes(size)).removeprefix('POET-X ')
    paper = got.get('AdamW as the paper trains it')
    if paper:
      a = m['AdamW as the paper trains it']
      muon = f", POET-X Muon {m['POET-X Muon'] / a:.3f}×" if 'POET-X Muon' in m else ''
      out.append(_row(f'AdamW as the POET-X paper trains it (pure bf16, weight decay 0), {size}, '
                      '100 M tokens',
                      f"{stats(paper)}: {a / m['tuned AdamW']:.3f}× our tuned fp32 AdamW's "
                      f"perplexity; POET-X ({best}) ends {m['POET-X'] / a:.3f}× its perplexity"
                      + muon, study, *paper['records'], commands=made(paper)))
    ref = got.get('POET-X, reference recipe')
    if ref and 'min-lr' in ref['config']:
      out.append(_row(f'POET-X ending its schedule at 0.01 of the peak rate (the reference '
                      f'recipe\'s min-lr ratio, `--optimizer poetx`\'s default), {size}, '
                      '100 M tokens',
                      f"{stats(ref)}: {m['POET-X, reference recipe'] / m['POET-X']:.3f}× POET-X's "
                      f"perplexity at 0.1 ({best}), "
                      f"{m['POET-X, reference recipe'] / m['tuned AdamW']:.3f}× our tuned fp32 "
                      "AdamW's", study, *ref['records'], commands=made(ref)))
    muon = got.get('POET-X Muon')
    if muon:
      speed = f'; {paper_answer.speeds(muon)} tokens/s' if muon['tokens_per_s'] else ''
      if (ratio := same_call_ratio(muon)) is not None:
        speed += f", {ratio:.2f}× the POET-X runs' of its call"
      end = (f", its schedule ending at {muon['min_lr_ratio']:g} of the peak rate"
             if muon['min_lr_ratio'] != DEFAULT_MIN_LR_RATIO else '')
      out.append(_row(f"POET-X Muon (Muon's orthogonalised updates on the generators){end}, "
                      f'{size}, 100 M tokens',
                      f"{stats(muon)}: {m['POET-X Muon'] / m['tuned AdamW']:.3f}× our tuned fp32 "
                      f"AdamW's perplexity, {m['POET-X Muon'] / m['POET-X']:.3f}× POET-X's "
                      f"({best}), {m['POET-X Muon'] / m['Muon']:.3f}× Muon's{speed}",
                      study, *muon['records'], commands=made(muon)))
  return out


def muon_step_rows() -> list[dict]:
  """POET-X Muon's step against POET-X's at 130M (same call), its
  Newton–Schulz batched over the leaves and, from the earlier library, one
  iteration per leaf."""
  study, record = 'paper-baseline', 'step-130m.json'
  recs = _load(study, record)
  poetx, muon, leaf = (_step_ms(recs, r) for r in ('poetx', 'muon', 'muon-per-leaf'))
  return [_row("POET-X Muon step against POET-X's, 130M (seq 256, batch 64)",
               f'{poetx / muon:.3f}× POET-X ({muon:.1f} against {poetx:.1f} ms); with one '
               f'Newton–Schulz iteration per layer\'s leaf {poetx / leaf:.3f}× ({leaf:.1f} ms)',
               study, record, also=('bench_train',))]


def three_size_rows() -> list[dict]:
  """The best POET-X against a tuned AdamW and Muon at each size."""
  from experiments import three_sizes_report as T
  study, record = 'three-sizes', 'finals.json'
  out = []
  for size in _load(study, record)['sizes']:
    q = T.ratios(size)
    n = sorted({len(T.finals(f)) for f in size['families'].values()})
    seeds = f'{n[0]} seeds each' if len(n) == 1 else f'{n[0]} to {n[-1]} seeds'
    out.append(_row(f"POET-X against a tuned AdamW and Muon, {size['size']} parameters, 100 M tokens",
                    f"{q['AdamW']:.3f}× AdamW's perplexity, {q['Muon']:.3f}× Muon's "
                    f"({T.best_poetx(size)}; {seeds})", study, record,
                    also=('three_sizes_report',)))
  return out


def _memory_row(claim: str, figure, ids: tuple[str, ...]) -> dict:
  """A row of the memory record's entries ``ids``, all of one commit, date and
  device; ``figure`` writes the row's figure from them (a dict by id). Its
  commands are the entries' as BENCHMARKS.md writes them, their notes after."""
  study, record = 'memory', 'results.json'
  by_id = {e['id']: e for e in _load(study, record)['entries']}
  entries = [by_id[i] for i in ids]
  where = {k: {e[k] for e in entries} for k in ('commit', 'date', 'device')}
  assert all(len(v) == 1 for v in where.values()), (claim, where)
  commands = list(dict.fromkeys(e['command'] for e in entries))
  notes = list(dict.fromkeys(e['command_note'] for e in entries if 'command_note' in e))
  commands += [f"# {n.replace('`', '')}" for n in notes]
  return {'claim': claim, 'figure': figure(by_id), 'study': study, 'records': [record],
          'commands': commands, **{k: v.pop() for k, v in where.items()}}


def memory_rows() -> list[dict]:
  """Peak GPU memory in the memory modes at 8B (beside poet_torch in one call,
  and at batch 1 with quantised bases), at 13B, and of a 70B-class Llama on
  one H200 and under FSDP on two."""
  fast, mem, torch = '8b-b8-fast-L-S6-2f65fce', '8b-b8-mem-L-O-S6-2f65fce', '8b-b8-torch-fast-2f65fce'
  b1 = ('8b-b1-mem-lean', '8b-b1-mem-lean-int8', '8b-b1-mem-lean-int4', '8b-b1-adamw-bf16', '8b-b1-adamw-f32')
  big, fsdp = '13b-b1-mem-L-S6-2f65fce', '70b-fsdp2-mem-lean'
  x4, x8 = '70b-b1-mem-lean-int4', '70b-b1-mem-lean-int8'
  gib = lambda e: f"{e['peak_gib']:.2f} GiB"
  return [
      _memory_row('Peak GPU memory of the 8B step in the memory modes (batch 8 x 1024), beside poet_torch',
                  lambda m: f"fast, lean state, bf16 generators, XLA memory limit 6%: {gib(m[fast])} "
                            f"({m[fast]['step_ms']:g} ms a step); mem, the same, layer inputs offloaded: "
                            f"{gib(m[mem])} ({m[mem]['step_ms']:g} ms); poet_torch fast {gib(m[torch])} "
                            '(same call)', (fast, mem, torch)),
      _memory_row('Peak GPU memory at 8B, batch 1 x 1024: mem mode, lean state; bf16, int8 and int4 bases',
                  lambda m: f"bf16 {gib(m[b1[0]])}, int8 {gib(m[b1[1]])}, int4 {gib(m[b1[2]])}; AdamW "
                            f"with bf16 weights and moments {gib(m[b1[3]])}, with float32 weights out of "
                            'memory', b1),
      _memory_row('Peak GPU memory at 13B (mem mode, lean state, bf16 generators, batch 1 x 1024)',
                  lambda m: f"{gib(m[big])} ({m[big]['tokens_per_s']:,} tokens/s)", (big,)),
      _memory_row('Peak GPU memory of a 70B-class Llama on one H200 (mem mode, lean state, batch 1 x 1024)',
                  lambda m: f'int4 bases {gib(m[x4])}, int8 bases {gib(m[x8])}', (x4, x8)),
      _memory_row('Peak GPU memory of a 70B-class Llama with bf16 bases under FSDP on two H200s '
                  '(mem mode, lean state, 1 x 1024 per GPU)',
                  lambda m: f'{gib(m[fsdp])} per GPU', (fsdp,)),
  ]


def rows() -> list[dict]:
  """Every row of the page, in its order."""
  return (step_rows() + memory_rows() + kernel_rows() + scaling_rows() + three_size_rows()
          + paper_rows() + muon_step_rows())


# The rows the README shows, by claim: step time against AdamW and against
# poet_torch at 8B, the 8B step's peak memory, quality at 130M (POET-X against the
# tuned AdamW and Muon, AdamW as the paper trains it, POET-X at min-lr 0.01, POET-X Muon).
README_CLAIMS = (
    'POET-X step against AdamW, 8B',
    'POET-X step against poet_torch (the published PyTorch POET-X), 8B',
    'Peak GPU memory of the 8B step (default mode, batch 8 x 1024)',
    'POET-X against a tuned AdamW and Muon, 130M parameters, 100 M tokens',
    'AdamW as the POET-X paper trains it (pure bf16, weight decay 0), 130M, 100 M tokens',
    "POET-X ending its schedule at 0.01 of the peak rate (the reference recipe's min-lr "
    "ratio, `--optimizer poetx`'s default), 130M, 100 M tokens",
    "POET-X Muon (Muon's orthogonalised updates on the generators), 130M, 100 M tokens",
)
README_BEGIN = '<!-- results:begin: written by python3 -m experiments.results_page; do not edit -->'
README_END = '<!-- results:end -->'


def readme_block() -> str:
  """The README's results rows, with their markers: the figures of
  ``README_CLAIMS`` as RESULTS.md gives them, each with its row number there."""
  numbered = {r['claim']: (i, r) for i, r in enumerate(rows(), 1)}
  lines = [README_BEGIN, '| # | claim | figure | device | study |', '|---|---|---|---|---|']
  for claim in README_CLAIMS:
    i, r = numbered[claim]
    lines.append(f"| {i} | {claim} | {r['figure']} | {r['device']} | "
                 f"[{r['study']}](docs/results/{r['study']}/README.md) |")
  return '\n'.join(lines + [README_END])


def with_readme_block(readme: str) -> str:
  """``readme`` with the text between its markers (markers included)
  replaced by :func:`readme_block`; ValueError if it lacks them."""
  begin, end = readme.find(README_BEGIN), readme.find(README_END)
  if begin < 0 or end < begin:
    raise ValueError(f'README.md has no {README_BEGIN!r} ... {README_END!r} block')
  return readme[:begin] + readme_block() + readme[end + len(README_END):]


def report() -> str:
  rows_ = rows()
  lines = ['# Where POET-X stands', '',
           'POET-X trains each linear weight as `R·W0·P`: `W0` frozen, `R` and `P` learned',
           'block-diagonal orthogonal matrices (Cayley–Neumann parameterised, permuted,',
           'merged into `W0` every few hundred updates). Every figure below is read from a',
           'record in `docs/results/` by `python3 -m experiments.results_page`; the study pages',
           'linked hold every figure of their studies, the runs\' notes and the',
           'predictions made before them. Step times are medians of device-synchronised',
           'steps; ratios of tokens per second compare runs of one call on one machine.', '',
           '| # | claim | figure | device | commit | date | study |',
           '|---|---|---|---|---|---|---|']
  for i, r in enumerate(rows_, 1):
    commit = ', '.join(f'`{c}`' if re.fullmatch(r'[0-9a-f]{7,40}', c) else c
                       for c in r['commit'].split(', '))
    records = ', '.join(f'`{n}`' for n in r['records'])
    lines.append(f"| {i} | {r['claim']} | {r['figure']} | {r['device']} | {commit} | "
                 f"{r['date']} | [{r['study']}](docs/results/{r['study']}/README.md) ({records}) |")
  lines += ['', '## The commands', '',
            'Run from the repository root; each wrote the records of its row (the study '
            'pages say where a record joins more than one call), at the commits of its row, '
            'written here as it is run today; except the memory rows\', whose record was '
            'recovered from BENCHMARKS.md: their commands are as written there at the commit '
            'given (docs/results/memory/README.md says what their abbreviations stand for).', '']
  for i, r in enumerate(rows_, 1):
    if r['study'] == 'memory':
      commands = [f'{c}  # as written at `{r["commit"]}`; not runnable today' for c in r['commands']]
    else:
      commands = [harness.todays_form(c) for c in r['commands']]
    lines += [f'{i}. {r["claim"]}:', '', *[f'       {c}' for c in commands], '']
  return '\n'.join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('out', type=pathlib.Path, nargs='?', default=ROOT / 'RESULTS.md')
  p.add_argument('--readme', type=pathlib.Path, default=ROOT / 'README.md',
                 help='the README whose results block to rewrite (default: %(default)s)')
  a = p.parse_args(argv)
  a.out.write_text(report())
  a.readme.write_text(with_readme_block(a.readme.read_text()))
  print(report())


if __name__ == '__main__':
  main()
