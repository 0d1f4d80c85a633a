"""Peak GPU memory and tokens/s of POET-X variants against AdamW, and the
largest Llama each trains on one GPU.

A thin driver over bench_train.py (one fresh process per run, so every peak is
its own): a grid of models x sequence lengths x runs, optionally
under a memory cap (``--cap-gib 80`` sets XLA_PYTHON_CLIENT_MEM_FRACTION to
compare with 80 GB H100 figures), then with ``--largest`` the biggest model of
``--ladder`` that completes forward, backward, update and a merge for each run.
Results go to a JSON file and a plot of peak memory against model size.

The options and runs are bench_train.py's (``poetx train``'s options, a run
``K=V`` overrides of them) but for the model and sequence length, which
``--models`` / ``--ladder`` and ``--seqs`` give; here the defaults are batch 1,
bf16 weights and compute, and a merge every 2 updates (so that one runs)::

    python3 -m experiments.bench_memory --models 3b,8b,13b --seqs 512,1024,2048
    python3 -m experiments.bench_memory --models 8b --seqs 1024 --cap-gib 80
    python3 -m experiments.bench_memory --largest --run optimizer=adamw \\
        --run optimizer=poetx,mode=mem,remat=block,quantize=int4
    python3 -m experiments.bench_memory --models tiny --seqs 64 --vocab-size 512 --timed-steps 2   # CPU smoke
    python3 -m experiments.bench_memory --models 8b --state-only --lean-state   # no GPU: state sizes
    python3 -m experiments.bench_memory --models 8b --state-only --compiled \\
        --run optimizer=poetx,mode=mem,remat=block  # + XLA's buffers
    python3 -m experiments.bench_memory --largest --scan-layers --lean-state   # deep models compile fast

``--breakdown`` names what the memory at the peak holds, by category
(``bench_train.memory_breakdown``): the frozen bases, the generators, the
other parameters (embeddings, norms, head), permutations and other buffers,
the optimizer's moments of the generators and of the other parameters (and
its counters), the gradients, the residuals the backward keeps (activations
saved by the forward; those that are arguments, the parameters and bases
themselves, are not counted again) and XLA's other temporaries (its
temporaries less the gradients and saved residuals: the logits, one layer's
recomputed activations, copies; negative where XLA fuses residuals away or
reuses their buffers). With ``--state-only --compiled`` from abstract state
on this machine's backend (no GPU needed; XLA:CPU's temporaries are not
XLA:GPU's, the state and residuals are the same); without ``--state-only``
each run also trains on the GPU, and its measured peak stands beside XLA's.
poet_torch_memory.py gives the published PyTorch POET-X's figures by the same
categories::

    python3 -m experiments.bench_memory --models 8b --seqs 1024 --batch-size 8 \\
        --breakdown --state-only --compiled --scan-layers \\
        --run poetx:optimizer=poetx,mode=fast,remat=block --run adamw:optimizer=adamw,remat=block
    python3 -m experiments.bench_memory --models 8b --seqs 1024 --batch-size 8 --breakdown \\
        --scan-layers --run poetx:optimizer=poetx,mode=fast,remat=block   # on the GPU
    ... --breakdown --peak-ops 20   # + what is live at XLA's peak, by the operation that made it
    PYTHONPATH=DIR_HOLDING_poet_torch python3 -m experiments.poet_torch_memory \\
        --variant poetx-fast --size 8b --seq 1024 --batch 8   # the same GPU, side by side
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from experiments import bench_train, harness
from experiments.common import Column, print_table as table, progress
from poetx_jax.pretrain.kv import format_overrides

# Larger shapes than the named configs, for the size record (vocab 32000).
LADDER = {
    '13b': {},
    '20b': {'hidden': 6144, 'mlp': 16384, 'layers': 44, 'heads': 48, 'kv_heads': 8},
    '30b': {'hidden': 6656, 'mlp': 17920, 'layers': 60, 'heads': 52, 'kv_heads': 4},
    '70b': {'hidden': 8192, 'mlp': 28672, 'layers': 80, 'heads': 64, 'kv_heads': 8},
}
KNOWN = ('tiny', '60m', '130m', '350m', '1b', '3b', '8b', '13b')
DEFAULT_RUNS = ('optimizer=adamw', 'optimizer=poetx', 'optimizer=poetx,mode=mem,remat=block',
                'optimizer=poetx,mode=mem,remat=block,quantize=int8',
                'optimizer=poetx,mode=mem,remat=block,quantize=int4')
MEMORY_DEFAULTS = dict(batch_size=1, param_dtype='bfloat16', dtype='bfloat16', merge_every=2)


def point(name: str, seq: int, ladder: bool) -> str:
  """The ``K=V`` text of a grid point: a named model, or a ``--ladder`` size
  (Llama-13B with larger shapes), at sequence length ``seq``."""
  overrides = LADDER.get(name, {}) if ladder else {}
  base = name if name in KNOWN else '13b'
  kv = format_overrides(overrides)
  return f'model={base},model_overrides={{{kv}}},seq_len={seq}'


def run_one(a, argv, name: str, seq: int, run: harness.Run, ladder: bool = False) -> dict:
  """The result of ``run`` at a grid point, in a fresh process (a child whose
  payload is the run and the point)."""
  env = dict(os.environ)
  if a.cap_gib:
    env['XLA_PYTHON_CLIENT_MEM_FRACTION'] = f'{a.cap_gib / a.device_gib:.4f}'
  payload = {'label': run.label, 'pairs': run.pairs, 'point': point(name, seq, ladder)}
  r, error = harness.run_child('bench_memory', list(argv), payload,
                               f'{name} seq {seq} {run.label}', env=env)
  if error is not None:
    return {'run': run.label, 'model': name, 'seq_len': seq, 'cap_gib': a.cap_gib,
            'error': error}
  r.update(model=name, cap_gib=a.cap_gib)
  return r


def plot(results, path, device_gib=None):
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for run in sorted({r['run'] for r in results}):
    pts = sorted((r['dense_params'] / 1e9, r['peak_gib']) for r in results
                 if r['run'] == run and 'error' not in r)
    if pts:
      ax.plot(*zip(*pts), marker='o', label=run)
  if device_gib:
    ax.axhline(device_gib, color='k', linestyle='--', linewidth=1,
               label=f'device memory ({device_gib:.0f} GiB)')
  ax.set(xlabel='model parameters (billions)', ylabel='peak memory (GiB)',
         title='peak memory vs model size (batch 1)')
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def state_table(a):
  """The resident state (and with ``--compiled`` XLA's buffers) of every
  model and run, from abstract shapes; with ``--breakdown`` their
  :func:`breakdown_table`."""
  if a.breakdown:
    return breakdown_table(a)
  names = a.ladder.split(',') if a.largest else a.models.split(',')
  seq = int(a.seqs.split(',')[0])
  runs = bench_train.runs_of(a)
  width = max([24] + [len(r.label) for r in runs])
  print(f'{"model":6s} {"run":{width}s} {"model GiB":>9s} {"trainable":>9s} '
        f'{"optimizer":>9s} {"model+grads+opt":>15s}' +
        (f' {"compiled args":>13s} {"temporaries":>11s}' if a.compiled else ''))
  rows = []
  for name in names:
    for run in runs:
      label = run.label
      cfg = bench_train.run_config(a, point(name, seq, a.largest), run)
      r = bench_train.resident_state(cfg, label)
      extra = ''
      if a.compiled:
        c = bench_train.compiled_memory(cfg, label)
        r.update(compiled=c)
        extra = f' {c["arguments_gib"]:13.2f} {c["temporaries_gib"]:11.2f}'
      r['model'] = name
      rows.append(r)
      print(f'{name:6s} {label:{width}s} {r["model_gib"]:9.2f} {r["trainable_gib"]:9.2f} '
            f'{r["optimizer_gib"]:9.2f} {r["floor_gib"]:15.2f}{extra}', flush=True)
  harness.write_record(a.json, rows, module='bench_memory', argv=a.argv)


def breakdown_table(a):
  """``bench_train.memory_breakdown`` of every model and run (``--compiled``:
  with XLA's buffers for this backend), from abstract shapes: a table and
  ``--json``."""
  names = a.ladder.split(',') if a.largest else a.models.split(',')
  rows = []
  for name in names:
    for seq in map(int, a.seqs.split(',')):
      for run in bench_train.runs_of(a):
        label = run.label
        cfg = bench_train.run_config(a, point(name, seq, a.largest), run)
        progress(f'{name} seq {seq} {label}: breakdown')
        r = bench_train.memory_breakdown(cfg, label, compiled=a.compiled,
                                         peak_ops=a.peak_ops if a.compiled else 0)
        r['model'] = name
        rows.append(r)
  print_breakdown(rows)
  print_peak_ops(rows)
  harness.write_record(a.json, rows, module='bench_memory', argv=a.argv)
  return rows


def print_peak_ops(results: list[dict]) -> None:
  """Each breakdown's ``peak_ops`` (XLA's list of what is live at the peak),
  in GiB, under its model and run."""
  for r in results:
    ops = r.get('breakdown', r).get('peak_ops')
    if ops:
      print(f"\nlive at XLA's peak, {r['model']} seq {r['seq_len']} {r['run']} (GiB, by operation):")
      for name, size in ops:
        print(f'  {size / 2 ** 30:8.3f}  {name[:110]}')


# (header, key of memory_breakdown's 'gib'), in the table's order
BREAKDOWN_COLUMNS = (('bases', 'bases'), ('gens', 'generators'), ('other', 'other_params'),
                     ('buffers', 'buffers'), ('gen mom', 'generator_moments'),
                     ('oth mom', 'other_moments'), ('opt etc', 'optimizer_other'),
                     ('grads', 'gradients'), ('residuals', 'saved_residuals'),
                     ('host res', 'host_residuals'), ('other tmp', 'other_temporaries'),
                     ('sum', 'sum'), ('XLA peak', 'compiled_peak'))


def print_breakdown(results: list[dict]) -> None:
  """Memory breakdowns (``memory_breakdown`` results, or runs holding one
  under ``'breakdown'`` beside their measured ``peak_gib``) as a table, in
  GiB (MiB where every sum is under 1 GiB)."""
  width = max([12] + [len(r['run']) for r in results])
  gib = lambda r: r.get('breakdown', r).get('gib', {})
  small = all(gib(r).get('sum', 0) < 1 for r in results)
  unit, scale = ('MiB', 1024) if small else ('GiB', 1)
  cell = lambda key: lambda r: f'{scale * gib(r)[key]:.2f}' if key in gib(r) else '—'
  measured = any('peak_gib' in r for r in results)
  table(results, [Column('model', 6, lambda r: r['model'], key=True),
                  Column('seq', 5, lambda r: str(r['seq_len']), key=True),
                  Column('run', width, lambda r: r['run'], key=True),
                  *[Column(h, max(9, len(h)), cell(k)) for h, k in BREAKDOWN_COLUMNS],
                  *[Column(f'peak {unit}', 9,
                           lambda r: f"{scale * r['peak_gib']:.2f}")] * measured],
        title=f'{unit} at the peak by category (sum: state + gradients + residuals + other '
              'temporaries; host res: residuals in host memory, in no sum)', error_chars=60)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  bench_train.add_run_args(p, runs=DEFAULT_RUNS, warmup_steps=2, timed_steps=3,
                           json_path='bench_memory.json',
                           exclude=('model', 'model_overrides', 'seq_len'), **MEMORY_DEFAULTS)
  p.add_argument('--models', default='3b,8b,13b', help='named models, comma-separated')
  p.add_argument('--seqs', default='1024', help='sequence lengths, comma-separated')
  p.add_argument('--cap-gib', type=float, default=None)
  p.add_argument('--device-gib', type=float, default=139.8, help='memory of the GPU')
  p.add_argument('--largest', action='store_true', help='climb --ladder at seq 1024')
  p.add_argument('--state-only', action='store_true',
                 help='no GPU needed: the resident state (model, gradients, optimizer) '
                      'of each model and run, from abstract shapes')
  p.add_argument('--compiled', action='store_true',
                 help='with --state-only: also compile each update program for this '
                      "backend and report XLA's arguments and temporaries (slow)")
  p.add_argument('--breakdown', action='store_true',
                 help='the memory at the peak by category (bases, generators, other '
                      'parameters, buffers, optimizer moments, gradients, saved residuals, '
                      'other temporaries); with --state-only from abstract shapes, else '
                      'beside each run\'s measured peak')
  p.add_argument('--peak-ops', type=int, default=0, metavar='N',
                 help='with --breakdown: also XLA\'s list of what is live at the peak, the N '
                      'largest by the operation that made it (the program compiled with '
                      'XLA\'s dump on)')
  p.add_argument('--ladder', default=','.join(LADDER))
  p.add_argument('--plot', default='bench_memory.png')
  return p.parse_args(argv)


def main(argv=None):
  a = parse_args(argv)
  a.argv = list(argv if argv is not None else sys.argv[1:])
  run = bench_train.child_run(a)
  if run:  # child process: one run at one grid point, JSON on the last line
    label = run.label
    cfg = bench_train.run_config(a, harness.child_payload(a)['point'], run)
    r = bench_train.one_run(cfg, label, warmup_steps=a.warmup_steps,
                            timed_steps=a.timed_steps)
    if a.breakdown:  # compiled after the peak is read (autotuning allocates)
      r['breakdown'] = bench_train.memory_breakdown(cfg, label, compiled=True,
                                                    peak_ops=a.peak_ops)
    harness.report(r)
    return
  if a.state_only:
    state_table(a)
    return
  results = []
  if a.largest:
    for run in bench_train.runs_of(a):
      for name in a.ladder.split(','):
        results.append(run_one(a, a.argv, name, 1024, run, ladder=True))
        print(json.dumps(results[-1]), flush=True)
        if 'error' in results[-1]:
          break
  else:
    for model in a.models.split(','):
      for seq in map(int, a.seqs.split(',')):
        for run in bench_train.runs_of(a):
          results.append(run_one(a, a.argv, model, seq, run))
          print(json.dumps(results[-1]), flush=True)
  print_table(results)
  if a.breakdown:
    print_breakdown(results)
    print_peak_ops(results)
  harness.write_record(a.json, results, module='bench_memory', argv=a.argv,
                       device=harness.children_device(results))
  try:
    plot(results, a.plot, a.device_gib)
  except ImportError:
    print('no plot: matplotlib is not installed')


def print_table(results: list[dict]) -> None:
  """The results as a table on stdout."""
  width = max([26] + [len(r['run']) for r in results])
  table(results, [Column('model', 6, lambda r: r['model'], key=True),
                  Column('seq', 5, lambda r: str(r['seq_len']), key=True),
                  Column('run', width, lambda r: r['run'], key=True),
                  Column('peak GiB', 9, lambda r: f"{r['peak_gib']:.2f}"),
                  Column('tokens/s', 9, lambda r: f"{r['tokens_per_s']:,.0f}")],
        title='', error_chars=60)


if __name__ == '__main__':
  main()
