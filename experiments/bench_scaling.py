"""Data-parallel scaling of POET-X against optax AdamW on one host.

Each (run, device count) is a fresh process that sees the first N devices
(of ``CUDA_VISIBLE_DEVICES`` where it is set),
splits a global batch of ``N * --per-device-batch`` sequences over them (weak
scaling; ``batch_size`` is set so), checks the setup as bench_train.py does, and times the step. It also
reads the compiled step's cross-device collectives (result bytes of every
all-reduce / all-gather / reduce-scatter per step). Scaling efficiency is
``tokens/s(N) / (N * tokens/s(1))``.

The options and the runs are bench_train.py's (``poetx train``'s options; a
run is ``K=V`` overrides of them, here ``strategy=dp`` or ``strategy=fsdp``,
the latter over every device unless ``fsdp=N``)::

    python3 -m experiments.bench_scaling --model 1b --devices 1,2
    python3 -m experiments.bench_scaling --model 8b --run optimizer=poetx \\
        --run optimizer=poetx,strategy=fsdp --run optimizer=adamw,strategy=fsdp
    python3 -m experiments.bench_scaling --model tiny --seq-len 64 --cpu-devices --devices 1,8

With ``--scan-layers`` and fsdp the stacked layers are built straight into
their shards, so a model too large for one GPU trains on several::

    python3 -m experiments.bench_scaling --model 13b --model-overrides \\
        hidden=8192,mlp=28672,layers=80,heads=64,kv_heads=8 \\
        --devices 2 --per-device-batch 1 --scan-layers --lean-state --param-dtype bfloat16 \\
        --merge-every 2 --run optimizer=poetx,strategy=fsdp,mode=mem,remat=block \\
        --warmup-steps 2 --timed-steps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from experiments import bench_train, harness
from experiments.common import Column, print_table as table


def child(a, run: harness.Run) -> dict:
  """One run on the devices this process sees, the batch ``per_device_batch`` each."""
  import jax
  cfg = bench_train.run_config(a, run)
  cfg = dataclasses.replace(cfg, batch_size=a.per_device_batch * jax.device_count())
  return bench_train.one_run(cfg, run.label, warmup_steps=a.warmup_steps,
                             timed_steps=a.timed_steps)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  bench_train.add_run_args(p, exclude=('batch_size',))
  p.add_argument('--devices', default='1,2', help='device counts, comma-separated')
  p.add_argument('--per-device-batch', type=int, default=4,
                 help='sequences per device (the batch of N devices: N times this)')
  p.add_argument('--cpu-devices', action='store_true',
                 help='fake N CPU devices (a smoke test of the script)')
  a = p.parse_args(argv)
  run = bench_train.child_run(a)
  if run:
    harness.report(child(a, run))
    return
  argv = list(argv if argv is not None else sys.argv[1:])
  results = []
  try:  # configured in the children: a parent that asked for the devices would hold them
    runs = bench_train.runs_of(a)
  except ValueError as e:
    p.error(f'--run: {e}')
  for run in runs:
    for n in map(int, a.devices.split(',')):
      r = run_on(a, argv, run, n)
      results.append(r)
      print(json.dumps(r), flush=True)
  print_table(a, results)
  if a.json:
    harness.write_record(a.json, results, module='bench_scaling', argv=argv,
                         device=harness.children_device(results))


def run_on(a, argv, run: harness.Run, n: int) -> dict:
  """The result of ``run`` in a fresh process that sees ``n`` devices."""
  env = dict(os.environ)
  if a.cpu_devices:
    env.update(XLA_FLAGS=f'--xla_force_host_platform_device_count={n}',
               JAX_PLATFORMS='cpu')
  else:  # the first n GPUs this process may use
    visible = os.environ.get('CUDA_VISIBLE_DEVICES')
    ids = visible.split(',') if visible else list(map(str, range(n)))
    if len(ids) < n:
      raise SystemExit(f'--devices asks for {n} GPUs but CUDA_VISIBLE_DEVICES={visible!r} '
                       f'lists {len(ids)}')
    env['CUDA_VISIBLE_DEVICES'] = ','.join(ids[:n])
  r, error = harness.run_child('bench_scaling', argv, {'label': run.label, 'pairs': run.pairs},
                               f'{run.label} x{n}', env=env)
  if error is not None:
    return {'run': run.label, 'devices': n, 'error': error}
  return r


def print_table(a, results: list[dict]) -> None:
  """The results as a table on stdout, each run's efficiency against its
  one-device throughput."""
  base = {r['run']: r['tokens_per_s'] for r in results
          if 'error' not in r and r['devices'] == 1}
  for r in results:
    if 'error' not in r:
      r['efficiency'] = (r['tokens_per_s'] / (r['devices'] * base[r['run']])
                         if r['run'] in base else float('nan'))
  width = max([14] + [len(r['run']) for r in results])
  table(results, [Column('run', width, lambda r: r['run'], key=True),
                  Column('devices', 7, lambda r: str(r['devices']), key=True),
                  Column('tokens/s', 10, lambda r: f"{r['tokens_per_s']:,.0f}"),
                  Column('efficiency', 10, lambda r: f"{r['efficiency']:.3f}"),
                  Column('peak GiB', 9, lambda r: f"{r['peak_gib']:.2f}"),
                  Column('collective MiB/step', 20,
                         lambda r: f"{sum(r['collective_bytes'].values()) / 2 ** 20:.2f}")],
        title=f'{a.model}, seq {a.seq_len}, {a.per_device_batch} sequences per device')


if __name__ == '__main__':
  main()
