"""Peak GPU memory and tokens/s of POET-X variants against AdamW, and the
largest Llama each trains on one GPU.

A thin driver over bench_train.py (one fresh process per run, so every peak is
its own): a grid of models x sequence lengths x runs at batch 1, optionally
under a memory cap (``--cap-gib 80`` sets XLA_PYTHON_CLIENT_MEM_FRACTION to
compare with 80 GB H100 figures), then with ``--largest`` the biggest model of
``--ladder`` that completes forward, backward, update and a merge for each run.
Results go to a JSON file and a plot of peak memory against model size.

    python3 experiments/bench_memory.py --models 3b,8b,13b --seqs 512,1024,2048
    python3 experiments/bench_memory.py --models 8b --seqs 1024 --cap-gib 80
    python3 experiments/bench_memory.py --largest --runs adamw,poetx:mem:block:int4
    python3 experiments/bench_memory.py --models tiny --seqs 64 --vocab-size 512 --steps 2   # CPU smoke
    python3 experiments/bench_memory.py --models 8b --state-only --lean-state   # no GPU: state sizes
    python3 experiments/bench_memory.py --models 8b --state-only --compiled --runs poetx:mem:block  # + XLA's buffers
    python3 experiments/bench_memory.py --largest --scan-layers --lean-state   # deep models compile fast

Runs are bench_train.py's ``optimizer[:mode[:remat[:quantize]]]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402

# Larger shapes than the named configs, for the size record (vocab 32000).
LADDER = {
    '13b': {},
    '20b': {'hidden': 6144, 'mlp': 16384, 'layers': 44, 'heads': 48, 'kv_heads': 8},
    '30b': {'hidden': 6656, 'mlp': 17920, 'layers': 60, 'heads': 52, 'kv_heads': 4},
    '70b': {'hidden': 8192, 'mlp': 28672, 'layers': 80, 'heads': 64, 'kv_heads': 8},
}
KNOWN = ('tiny', '60m', '130m', '350m', '1b', '3b', '8b', '13b')
DEFAULT_RUNS = ('adamw,poetx,poetx:mem:block,poetx:mem:block:int8,'
                'poetx:mem:block:int4')


def run_one(a, model, overrides, seq, run, cap_gib):
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ)
  if cap_gib:
    env['XLA_PYTHON_CLIENT_MEM_FRACTION'] = f'{cap_gib / a.device_gib:.4f}'
  base = model if model in KNOWN else '13b'
  cmd = [sys.executable, os.path.join(here, 'bench_train.py'), '--model', base,
         '--model-overrides', json.dumps(overrides), '--seq-len', str(seq),
         '--batch-size', '1', '--vocab-size', str(a.vocab_size), '--steps', str(a.steps),
         '--warmup', str(a.warmup), '--merge-every', str(a.merge_every),
         '--param-dtype', a.param_dtype, '--single', run]
  if a.lean_state:
    cmd.append('--lean-state')
  if a.scan_layers:
    cmd.append('--scan-layers')
  r, error = bench_train.run_child(cmd, f'{model} seq {seq} {run}', env=env)
  if error is not None:
    return {'run': run, 'model': model, 'seq_len': seq, 'cap_gib': cap_gib,
            'error': error}
  r.update(model=model, cap_gib=cap_gib)
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
  names = a.ladder.split(',') if a.largest else a.models.split(',')
  print(f'{"model":6s} {"run":24s} {"model GiB":>9s} {"trainable":>9s} '
        f'{"optimizer":>9s} {"model+grads+opt":>15s}' +
        (f' {"compiled args":>13s} {"temporaries":>11s}' if a.compiled else ''))
  rows = []
  for name in names:
    overrides = LADDER.get(name, {}) if a.largest else {}
    base = name if name in KNOWN else '13b'
    for run in a.runs.split(','):
      args = argparse.Namespace(
          model=base, model_overrides=json.dumps(overrides), seq_len=int(a.seqs.split(',')[0]), batch_size=1,
          vocab_size=a.vocab_size, block_size=None, merge_every=a.merge_every,
          dtype='bfloat16', param_dtype=a.param_dtype, lean_state=a.lean_state,
          scan_layers=a.scan_layers)
      r = bench_train.resident_state(args, run)
      extra = ''
      if a.compiled:
        c = bench_train.compiled_memory(args, run)
        r.update(compiled=c)
        extra = f' {c["arguments_gib"]:13.2f} {c["temporaries_gib"]:11.2f}'
      r['model'] = name
      rows.append(r)
      print(f'{name:6s} {run:24s} {r["model_gib"]:9.2f} {r["trainable_gib"]:9.2f} '
            f'{r["optimizer_gib"]:9.2f} {r["floor_gib"]:15.2f}{extra}', flush=True)
  with open(a.json, 'w') as f:
    json.dump(rows, f, indent=1)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--models', default='3b,8b,13b')
  p.add_argument('--seqs', default='1024')
  p.add_argument('--runs', default=DEFAULT_RUNS)
  p.add_argument('--cap-gib', type=float, default=None)
  p.add_argument('--device-gib', type=float, default=139.8, help='memory of the GPU')
  p.add_argument('--largest', action='store_true', help='climb --ladder at seq 1024')
  p.add_argument('--state-only', action='store_true',
                 help='no GPU needed: the resident state (model, gradients, optimizer) '
                      'of each model and run, from abstract shapes')
  p.add_argument('--compiled', action='store_true',
                 help='with --state-only: also compile each update program for this '
                      "backend and report XLA's arguments and temporaries (slow)")
  p.add_argument('--ladder', default=','.join(LADDER))
  p.add_argument('--vocab-size', type=int, default=32000)
  p.add_argument('--param-dtype', default='bfloat16', choices=('float32', 'bfloat16'))
  p.add_argument('--lean-state', action='store_true')
  p.add_argument('--scan-layers', action='store_true',
                 help='decoder layers stacked and run by lax.scan: the compile time of '
                      'one layer, whatever the depth (needed on GPU past about 8B)')
  p.add_argument('--merge-every', type=int, default=2, help='small, so a merge runs')
  p.add_argument('--warmup', type=int, default=2)
  p.add_argument('--steps', type=int, default=3)
  p.add_argument('--json', default='bench_memory.json')
  p.add_argument('--plot', default='bench_memory.png')
  a = p.parse_args(argv)
  results = []
  if a.state_only:
    state_table(a)
    return
  if a.largest:
    for run in a.runs.split(','):
      for name in a.ladder.split(','):
        r = run_one(a, name, LADDER.get(name, {}), 1024, run, a.cap_gib)
        results.append(r)
        print(json.dumps(r), flush=True)
        if 'error' in r:
          break
  else:
    for model in a.models.split(','):
      for seq in map(int, a.seqs.split(',')):
        for run in a.runs.split(','):
          r = run_one(a, model, {}, seq, run, a.cap_gib)
          results.append(r)
          print(json.dumps(r), flush=True)
  print(f'\n{"model":6s} {"seq":>5s} {"run":26s} {"peak GiB":>9s} {"tokens/s":>9s}')
  for r in results:
    if 'error' in r:
      print(f'{r["model"]:6s} {r["seq_len"]:5d} {r["run"]:26s} failed: {r["error"][-60:]}')
    else:
      print(f'{r["model"]:6s} {r["seq_len"]:5d} {r["run"]:26s} {r["peak_gib"]:9.2f} '
            f'{r["tokens_per_s"]:9,.0f}')
  with open(a.json, 'w') as f:
    json.dump(results, f, indent=1)
  try:
    plot(results, a.plot, a.device_gib)
  except ImportError:
    print('no plot: matplotlib is not installed')


if __name__ == '__main__':
  main()
