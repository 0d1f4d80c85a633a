"""What a training update sends between devices, read from its compiled program, and a projected data-parallel scaling.

For each run (``K=V`` overrides of ``poetx train``'s options, as in
bench_train.py) and each device count, the run's state is built as shapes
only and placed on a ``(data, fsdp)`` mesh of that many simulated CPU devices
as ``poetx train`` places it (``sharding.abstract_placed``); one update (its
``--grad-accum`` micro-batches included) and each POET layer's merge are
compiled, not run, and every collective is listed with its kind, its result
bytes and how many times one update runs it (``sharding.collective_sites``:
a collective inside the accumulation loop runs once per micro-batch, one
inside a scanned layer stack once per layer). The CPU compiler carries a
bfloat16 all-reduce in float32, so those bytes are twice a GPU's; a
data-parallel update that all-reduces exactly its trained arrays (so
promoted) is recorded with the bytes a GPU sends, ``gpu_allreduce_bytes``.
Nothing is allocated, so an 8B-class update compiles in seconds on a CPU::

    python3 -m experiments.comm_model --model 1b --devices 2,8 \\
        --step-record docs/results/chunk-permutations/step-1b-tied.json \\
        --json docs/results/scaling/comm-1b.json

The projection (every figure of it labelled projected) covers the
data-parallel runs, whose update sends one all-reduce of S bytes
(``gpu_allreduce_bytes``), and POET-X's fsdp runs, whose update gathers
its trained arrays once and reduce-scatters their gradients once (together
the bytes of one all-reduce of them) and gathers the frozen bases F bytes a
micro-batch (``frozen_gather_bytes_per_microbatch``; half an all-reduce's
traffic each). For an all-reduce of S bytes, on N GPUs
in nodes of ``--gpus-per-node`` G, a hierarchical ring moves
``2 (g-1)/g S`` bytes per GPU over NVLink (g = min(N, G)) and
``2 (m-1)/m S/g`` over the network (m = N / G nodes), at ``--nvlink-gbs`` and
``--net-gbs`` GB/s per GPU. An update's compute is ``grad_accum`` times the
one-GPU step of one micro-batch from ``--step-record`` (bench_train records,
matched by run label; weak scaling: the same micro-batch per GPU). The
efficiency is given twice: compute / (compute + communication), nothing
overlapped (a lower bound), and compute / max(compute, communication), all
overlapped (an upper bound); and the tokens per GPU and update below which
the communication outlasts the compute (with no accumulation, those of a
micro-batch). An fsdp run projects from the one-GPU step of its label
without ``-fsdp`` (one GPU runs one program whatever the strategy), a run
with its optimizer state split from that without ``-zero1``. Merges
of data-parallel POET-X send nothing (each device draws the same
permutations), so they add no term; an fsdp merge's collectives are
counted as the others (an all-reduce whole, an all-to-all as each GPU
sending its share to every other, those outside its node over the
network, the rest as half an all-reduce), spread over the
``merge_every`` updates of a cycle. Runs whose
update the model does not describe (AdamW under fsdp: the compiler's
partitioning, gradients reduced every micro-batch) are listed, not
projected.

A run key of this script alone, ``optimizer_state=sharded``, places a
data-parallel run's optimizer state split over every device as fsdp splits
it, and its model whole on each (ZeRO stage 1): the update all-reduces the
gradients, each device updates its own part of the parameters, and one
all-gather of the trained arrays follows, which the projection counts as
half an all-reduce (``param_gather_bytes``).

``--check RECORD`` predicts a measured scaling record (per run: one-GPU and
N-GPU step times and the bytes its program all-reduced) with the same model
and prints the error.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

from experiments import bench_train, harness
from experiments.common import Column, print_table, progress

DEFAULT_RUNS = ('chunk:optimizer=poetx,permutation=chunk', 'adamw:optimizer=adamw',
                'adamw-zero1:optimizer=adamw,optimizer_state=sharded',
                'chunk-fsdp:optimizer=poetx,permutation=chunk,strategy=fsdp',
                'adamw-fsdp:optimizer=adamw,strategy=fsdp')
# A run key of this script alone (not a ``poetx train`` option): ``sharded``
# places a dp run's optimizer state split over all devices, as fsdp splits
# it, and its model whole on each (ZeRO stage 1).
OPTIMIZER_STATE = ('replicated', 'sharded')


def simulate_devices(n: int) -> None:
  """Asks XLA for ``n`` CPU devices; before jax's backend starts, or it must
  already have that many."""
  flag = f'--xla_force_host_platform_device_count={n}'
  os.environ['XLA_FLAGS'] = ' '.join(
      [f for f in os.environ.get('XLA_FLAGS', '').split()
       if not f.startswith('--xla_force_host_platform_device_count')] + [flag])
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  import jax
  if jax.device_count() < n:
    raise SystemExit(f'{jax.device_count()} devices, {n} needed: run this in a fresh process')


def state_option(run):
  """``(run without its optimizer_state pair, whether that says sharded)``;
  ValueError for a value not in OPTIMIZER_STATE."""
  values = [v for k, v in run.pairs if k == 'optimizer_state']
  bad = [v for v in values if v not in OPTIMIZER_STATE]
  if bad:
    raise ValueError(f'--run {run.label}: optimizer_state={bad[0]!r}; valid: '
                     + ', '.join(OPTIMIZER_STATE))
  sharded = bool(values) and values[-1] == 'sharded'
  return (type(run)(run.label, tuple(kv for kv in run.pairs if kv[0] != 'optimizer_state')),
          sharded)


def update_collectives(cfg, label: str, n: int, state_sharded: bool = False) -> dict:
  """The record of one run on ``n`` simulated devices: per update, the bytes
  of each kind of collective (result bytes times the times an update runs
  it), and per merge the same (POET-X). ``state_sharded``: a dp run's
  optimizer state split over the devices (``optimizer_state=sharded``)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P

  from poetx_jax import cycle, sharding
  from poetx_jax.pretrain import factories as F
  from poetx_jax.pretrain.plan import make_plan
  plan = make_plan(cfg)
  mesh = sharding.make_mesh(fsdp=n if state_sharded else cfg.fsdp if cfg.strategy == 'fsdp'
                            else 1, devices=jax.devices()[:n])
  model, opt = F.abstract_state(plan)
  sharding.abstract_placed(model, mesh, cfg.strategy)
  sharding.abstract_placed(opt, mesh, cfg.strategy)
  if state_sharded:
    sharding.abstract_placed(opt.opt_state, mesh, 'fsdp')
  shape = F.update_batch_shape(cfg)
  rows = NamedSharding(mesh, P(*[None] * (len(shape) - 2), sharding.AXES))
  tokens = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows)
  text = F.make_step(plan, mesh=mesh).lower(
      model, opt, {'inputs': tokens, 'targets': tokens}).compile().as_text()
  update = collections.Counter()
  merges = cycle.merge_collectives(model) if plan.poetize else []
  sites = sharding.collective_sites(text)
  if any(s['trips'] is None for s in sites + [s for _, ss in merges for s in ss]):
    raise SystemExit(f'{label}: a collective runs in a loop of unknown trip count: '
                     'its bytes per update are not known')
  for s in sites:
    update[s['kind']] += s['bytes'] * s['trips']
  merge = collections.Counter()
  for _, layer_sites in merges:
    for s in layer_sites:
      merge[s['kind']] += s['bytes'] * s['trips']
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  trainable = sum(x.size * x.dtype.itemsize for x in params)
  # The CPU compiler carries a bfloat16 all-reduce in float32 (twice a GPU's
  # bytes); a data-parallel update that all-reduces exactly the trained
  # arrays so promoted, plus the loss and weight sums, sends on a GPU the
  # trained arrays at their own size.
  promoted = sum(x.size * max(x.dtype.itemsize, 4) for x in params)
  # With the optimizer state split, each device updates its own part of the
  # parameters and gathers the rest: after the all-reduce, one all-gather
  # of exactly the trained arrays (bfloat16 ones carried in float32 here
  # too).
  kinds = {'all-reduce', 'all-gather'} if state_sharded else {'all-reduce'}
  exact = (cfg.strategy == 'dp' and set(update) == kinds
           and update['all-reduce'] == promoted + 8
           and (not state_sharded or update['all-gather'] in (trainable, promoted)))
  # A POET-X fsdp update (make_train_step's fully_sharded): the trained
  # arrays gathered once and reduce-scattered once (each device keeps
  # 1/n of the sum), the frozen bases gathered where each micro-batch uses
  # them, and scalars: the loss and weight sums, each array's share of the
  # gradients' global norm (an all-reduce of a few bytes an array).
  gathered = update.get('all-gather', 0)
  fsdp_exact = (cfg.strategy == 'fsdp' and set(update) <= {'all-gather', 'reduce-scatter',
                                                            'all-reduce'}
                and update.get('reduce-scatter', 0) * n in (trainable, promoted)
                and gathered >= trainable and update.get('all-reduce', 0) <= 4 * (len(params) + 8))
  return {'run': label, 'model': cfg.model, 'devices': n, 'strategy': cfg.strategy,
          'optimizer_state': 'sharded' if state_sharded else 'replicated',
          'optimizer': cfg.optimizer, 'grad_accum': cfg.grad_accum,
          'per_device_batch': cfg.batch_size // n, 'seq_len': cfg.seq_len,
          'trainable_bytes': trainable, 'collectives': len(sites),
          'update_bytes': dict(update), 'merge_bytes': dict(merge),
          'gpu_allreduce_bytes': trainable + 8 if exact else None,
          'param_gather_bytes': trainable if exact and state_sharded else 0,
          'frozen_gather_bytes_per_microbatch': ((gathered - trainable) / cfg.grad_accum
                                                 if fsdp_exact else None),
          'merge_every': plan.merge_every}


def one_gpu_steps(step_records: list[dict]) -> dict[str, dict]:
  """bench_train records by run label, ``step_s`` the median over rounds."""
  import statistics
  out = {}
  for r in step_records:
    if 'error' not in r:
      out.setdefault(r['run'], []).append(r)
  return {run: {**rs[0], 'step_s': statistics.median(r['step_s'] for r in rs)}
          for run, rs in out.items()}


def allreduce_s(nbytes: float, gpus: int, *, gpus_per_node: int, nvlink_gbs: float,
                net_gbs: float) -> float:
  """Seconds of a hierarchical ring all-reduce of ``nbytes`` over ``gpus``."""
  g = min(gpus, gpus_per_node)
  m = max(gpus // gpus_per_node, 1)
  return (2 * (g - 1) / g * nbytes / (nvlink_gbs * 1e9)
          + 2 * (m - 1) / m * nbytes / g / (net_gbs * 1e9))


def alltoall_s(nbytes: float, gpus: int, *, gpus_per_node: int, nvlink_gbs: float,
               net_gbs: float) -> float:
  """Seconds of an all-to-all whose result is ``nbytes`` on each of
  ``gpus``: each GPU sends 1/gpus of it to every other, those of its node
  over NVLink, the rest over the network (nothing there to reduce, unlike
  an all-reduce's hierarchical ring)."""
  g = min(gpus, gpus_per_node)
  return ((g - 1) / gpus * nbytes / (nvlink_gbs * 1e9)
          + (gpus - g) / gpus * nbytes / (net_gbs * 1e9))


def efficiency(compute_s: float, comm_s: float) -> tuple[float, float]:
  """(nothing overlapped, all overlapped) efficiency of a step."""
  return compute_s / (compute_s + comm_s), compute_s / max(compute_s, comm_s)


def projectable(record: dict) -> bool:
  """Whether the model describes ``record``'s update: a dp update that
  all-reduces exactly its trained arrays, or a POET-X fsdp update that
  gathers and reduce-scatters them once and gathers only frozen bases in
  between."""
  return bool(record['gpu_allreduce_bytes']
              or record.get('frozen_gather_bytes_per_microbatch') is not None)


def project(record: dict, step: dict, gpus: list[int], links: dict) -> list[dict]:
  """The projected scaling of ``record`` (a :func:`projectable` update at
  the accumulation ``record['grad_accum']``) with the one-GPU ``step`` (a
  bench_train record of one micro-batch). Under fsdp the trained arrays'
  gather and reduce-scatter cost one all-reduce of their bytes, and each
  micro-batch's gathers of the frozen bases half an all-reduce of theirs
  (an all-gather is the second half of a ring all-reduce)."""
  fsdp = record['strategy'] == 'fsdp'
  nbytes = record['trainable_bytes'] if fsdp else record['gpu_allreduce_bytes']
  frozen = (record['grad_accum'] * record['frozen_gather_bytes_per_microbatch'] if fsdp
            else 0)
  # dp with the optimizer state split: the updated parameters gathered once
  gathered = record.get('param_gather_bytes', 0)
  merge = record['merge_bytes']  # once every merge_every updates
  reduced, exchanged = merge.get('all-reduce', 0), merge.get('all-to-all', 0)
  moved = sum(v for k, v in merge.items() if k not in ('all-reduce', 'all-to-all'))
  compute = record['grad_accum'] * step['step_s']
  tokens = step['batch'] * step['seq_len']  # of one micro-batch on one GPU
  out = []
  for n in gpus:
    merges = ((allreduce_s(reduced, n, **links) + allreduce_s(moved, n, **links) / 2
               + alltoall_s(exchanged, n, **links)) / record['merge_every'] if merge else 0.0)
    comm = (allreduce_s(nbytes, n, **links) + allreduce_s(frozen + gathered, n, **links) / 2
            + merges)
    low, high = efficiency(compute, comm)
    out.append({'run': record['run'], 'model': record['model'], 'gpus': n,
                'strategy': record['strategy'],
                'grad_accum': record['grad_accum'], 'allreduce_mib': nbytes / 2 ** 20,
                'frozen_gather_mib': frozen / 2 ** 20, 'param_gather_mib': gathered / 2 ** 20,
                'merge_ms_per_update': 1e3 * merges,
                'compute_ms': 1e3 * compute, 'comm_ms': 1e3 * comm,
                'efficiency_no_overlap': low, 'efficiency_overlap': high,
                'compute_bound_tokens': comm / (step['step_s'] / tokens),
                'projected': True})
  return out


def check(path: str, links: dict) -> list[dict]:
  """Predicts the runs of a measured scaling record: each run's
  ``efficiency`` from its one-GPU step, its bytes and its GPU count."""
  rec = json.load(open(path))
  out = []
  for r in rec['runs']:
    comm = allreduce_s(r['allreduce_mib'] * 2 ** 20, r['gpus'], **links)
    step = r['step_ms'][0] / 1e3
    low, high = efficiency(step, comm)
    out.append({'run': r['run'], 'gpus': r['gpus'], 'measured': r['efficiency'],
                'predicted_no_overlap': low, 'predicted_overlap': high,
                'error_no_overlap': low - r['efficiency'], 'comm_ms': 1e3 * comm})
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  bench_train.add_run_args(p, runs=DEFAULT_RUNS, exclude=('batch_size',), grad_accum=1)
  p.add_argument('--devices', default='2,8', help='simulated device counts, comma-separated')
  p.add_argument('--per-device-batch', type=int, default=8,
                 help='sequences per device per micro-batch')
  p.add_argument('--step-record', default=None,
                 help="bench_train --json records: one-GPU step times by run label")
  p.add_argument('--gpus', default='8,64,512', help='GPU counts to project to')
  p.add_argument('--gpus-per-node', type=int, default=8)
  p.add_argument('--nvlink-gbs', type=float, default=450.0,
                 help='NVLink GB/s per GPU and direction (H100/H200 NVLink 4: 450)')
  p.add_argument('--net-gbs', type=float, default=50.0,
                 help='network GB/s per GPU between nodes (400 Gb/s: 50)')
  p.add_argument('--accum', default='1,8',
                 help='micro-batches per update to project with, comma-separated')
  p.add_argument('--check', default=None, help='a measured scaling record to predict')
  a = p.parse_args(argv)
  links = dict(gpus_per_node=a.gpus_per_node, nvlink_gbs=a.nvlink_gbs, net_gbs=a.net_gbs)
  devices = [int(x) for x in a.devices.split(',')]
  simulate_devices(max(devices))
  import dataclasses
  try:
    runs = [state_option(run) for run in bench_train.runs_of(a)]
  except ValueError as e:
    p.error(str(e))
  for run, state_sharded in runs:  # every run checked before any compiles
    strategy = bench_train.run_config(a, run).strategy
    if state_sharded and strategy != 'dp':
      p.error(f'--run {run.label}: optimizer_state=sharded is a data-parallel placement; '
              f'strategy={strategy} places the optimizer state itself')
  records = []
  for run, state_sharded in runs:
    label = run.label
    for n in devices:
      cfg = bench_train.run_config(a, run)
      cfg = dataclasses.replace(cfg, batch_size=a.per_device_batch * n,
                                fsdp=n if cfg.strategy == 'fsdp' else 1)
      progress(f'{label}: {cfg.model} on {n} devices, compiling an update and the merges')
      records.append(update_collectives(cfg, label, n, state_sharded))
  mib = lambda d: ', '.join(f'{k} {v / 2 ** 20:,.1f}' for k, v in sorted(d.items())) or '—'
  print_table(records, [Column('run', 22, lambda r: r['run'], key=True),
                        Column('devices', 8, lambda r: str(r['devices'])),
                        Column('per update (MiB)', 60, lambda r: mib(r['update_bytes'])),
                        Column('per merge (MiB)', 40, lambda r: mib(r['merge_bytes'])),
                        Column('trained MiB', 12,
                               lambda r: f"{r['trainable_bytes'] / 2 ** 20:,.1f}")])
  out = {'records': records, 'links': links}
  if a.step_record:
    steps = one_gpu_steps(harness.results_of(json.load(open(a.step_record))))
    projection = []
    for r in records:
      # one GPU runs one program whatever the placement: an fsdp run's step
      # is that of its label without '-fsdp', a sharded state's without '-zero1'
      step = steps.get(r['run'], steps.get(r['run'].removesuffix('-fsdp').removesuffix('-zero1')))
      if projectable(r) and step is not None and r['devices'] == devices[0]:
        for k in (int(x) for x in a.accum.split(',')):
          projection += project({**r, 'grad_accum': k}, step,
                                [int(x) for x in a.gpus.split(',')], links)
    print_table(projection, title='projected:', columns=[
        Column('run', 10, lambda r: r['run'], key=True),
        Column('gpus', 5, lambda r: str(r['gpus'])),
        Column('accum', 6, lambda r: str(r['grad_accum'])),
        Column('frozen gathered MiB', 20, lambda r: f"{r['frozen_gather_mib']:,.1f}"),
        Column('comm ms', 9, lambda r: f"{r['comm_ms']:.1f}"),
        Column('compute ms', 11, lambda r: f"{r['compute_ms']:.1f}"),
        Column('eff. no overlap', 16, lambda r: f"{r['efficiency_no_overlap']:.3f}"),
        Column('eff. overlap', 13, lambda r: f"{r['efficiency_overlap']:.3f}"),
        Column('bound below tok/GPU', 20, lambda r: f"{r['compute_bound_tokens']:,.0f}")])
    out['projection'] = projection
  if a.check:
    out['check'] = check(a.check, links)
    print_table(out['check'], title=f'check against {a.check}:', columns=[
        Column('run', 10, lambda r: r['run'], key=True),
        Column('gpus', 5, lambda r: str(r['gpus'])),
        Column('measured', 9, lambda r: f"{r['measured']:.3f}"),
        Column('no overlap', 11, lambda r: f"{r['predicted_no_overlap']:.3f}"),
        Column('overlap', 8, lambda r: f"{r['predicted_overlap']:.3f}"),
        Column('error', 7, lambda r: f"{r['error_no_overlap']:+.3f}")])
  if a.json:
    harness.write_record(a.json, out, module='comm_model',
                         argv=argv if argv is not None else sys.argv[1:])
  return out


if __name__ == '__main__':
  main()
