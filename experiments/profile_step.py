"""Where a training step's time goes: a ``jax.profiler`` trace of real steps.

For each run (``bench_train.py``'s options and ``--run K=V,...`` syntax) a
fresh process builds the model, optimizer and train step exactly as
``bench_train`` does (which checks the setup), compiles and runs
``--warmup-steps``, then traces ``--timed-steps`` steps dispatched back to
back as a training loop does (no sync between them) and prints per step:

* wall time, and the time the device was busy (the union of its kernels'
  intervals; ``busy`` is that over the wall time: the rest the device waited
  for the host);
* the share of each kernel category: GEMM, attention, gather,
  transpose/copy, reduction, other fusions;
* the top kernels with the HLO op they came from (its result shape and the
  JAX operation named in its metadata, read from the compiled program).

    python3 -m experiments.profile_step --model 8b --scan-layers --param-dtype bfloat16 \\
        --batch-size 8 --run optimizer=poetx,remat=block --run optimizer=adamw,remat=block
    python3 -m experiments.profile_step --model tiny --seq-len 64 --timed-steps 2 --dtype float32  # CPU

On a CPU the "kernels" are XLA:CPU's thunks on the host threads. ``--json``
keeps everything; ``--trace-dir`` keeps the traces (Perfetto JSON).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import importlib
import json
import os
import re
import sys
import tempfile
import time


CATEGORIES = ('gemm', 'attention', 'gather', 'transpose/copy', 'reduction', 'other')


def category(hlo_op: str, kernel: str, source: str = '') -> str:
  """The kind of work a kernel does, from its HLO op and kernel names and the
  JAX operation it came from (``source``, the op_name of its metadata)."""
  op, k = hlo_op.lower(), kernel.lower()
  if (any(s in k for s in ('cudnn', 'fmha', 'flash', 'attention', 'sdpa')) or 'cudnn' in op
      or any(s in source for s in ('dot_product_attention', 'BTNH', 'BNTS'))):
    return 'attention'
  if any(s in op for s in ('gemm', 'dot', 'cublas', 'matmul', 'convolution')) or any(
      s in k for s in ('gemm', 'xmma', 'cutlass', 'nvjet', 'matmul')) or (
          source.endswith('dot_general') and 'fusion' in op and 'loop' not in op):
    return 'gemm'
  if 'gather' in op or 'scatter' in op:
    return 'gather'
  if any(s in op for s in ('transpose', 'copy', 'dynamic-slice', 'dynamic_slice',
                           'dynamic-update-slice', 'dynamic_update_slice')) or 'memcpy' in k:
    return 'transpose/copy'
  if 'reduce' in op or source.split('/')[-1].startswith('reduce'):
    return 'reduction'
  return 'other'


def read_trace(trace_dir: str) -> list[dict]:
  """The op events of a ``jax.profiler`` trace: ``{name, op, module, start,
  dur}`` (microseconds) for every kernel on a device, or, when the trace has
  no device (a CPU run), every XLA op executed on the host."""
  paths = glob.glob(os.path.join(trace_dir, '**', '*perfetto_trace.json.gz'), recursive=True)
  if not paths:
    raise FileNotFoundError(f'no perfetto_trace.json.gz under {trace_dir}')
  with gzip.open(sorted(paths)[-1]) as f:
    data = json.load(f)
  events = data['traceEvents'] if isinstance(data, dict) else data
  procs = {e['pid']: e.get('args', {}).get('name', '') for e in events
           if e.get('ph') == 'M' and e.get('name') == 'process_name'}
  devices = {pid for pid, name in procs.items() if name.startswith('/device:')}
  out = []
  for e in events:
    if e.get('ph') != 'X':
      continue
    args = e.get('args') or {}
    on_device = e['pid'] in devices
    if devices and not on_device:
      continue
    if not devices and 'hlo_op' not in args:
      continue
    op = args.get('hlo_op', '')
    if not op or op.startswith('command_buffer'):  # a CUDA graph: its kernels are named
      op = e.get('name', '')                      # after their fusions
    out.append({'name': e.get('name', ''), 'op': op,
                'module': args.get('hlo_module', ''), 'start': float(e['ts']),
                'dur': float(e.get('dur', 0.0))})
  return out


def busy_time(events: list[dict]) -> float:
  """The union of the events' intervals (overlapping kernels count once)."""
  total, end = 0.0, float('-inf')
  for e in sorted(events, key=lambda e: e['start']):
    a, b = e['start'], e['start'] + e['dur']
    if b > end:
      total += b - max(a, end)
      end = b
  return total


def idle_gaps(events: list[dict], short_us: float = 20.0) -> tuple[float, float, float]:
  """The device's idle time between kernels, in microseconds: ``(short,
  long, longest)``, the gaps under ``short_us`` summed (kernel launch
  latency inside a program: more kernels, more of it), the longer ones summed
  (the device waiting for the host), and the longest gap."""
  short = long = longest = 0.0
  end = None
  for e in sorted(events, key=lambda e: e['start']):
    if end is not None and e['start'] > end:
      gap = e['start'] - end
      longest = max(longest, gap)
      if gap < short_us:
        short += gap
      else:
        long += gap
    end = e['start'] + e['dur'] if end is None else max(end, e['start'] + e['dur'])
  return short, long, longest


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
  """HLO instruction name -> (result shape, the JAX op_name of its metadata)
  from compiled HLO text."""
  out = {}
  for line in hlo_text.splitlines():
    m = re.match(r'\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ', line)
    if not m:
      continue
    meta = re.search(r'op_name="([^"]*)"', line)
    shape = m.group(2) if len(m.group(2)) < 70 else m.group(2)[:67] + '...'
    out[m.group(1)] = (shape, meta.group(1) if meta else '')
    # a GPU kernel is named after its fusion, '.' written '_'
    out.setdefault(m.group(1).replace('.', '_'), out[m.group(1)])
  return out


def summarize(events: list[dict], steps: int, wall_s: float, ops: dict[str, tuple[str, str]],
              top: int = 15) -> dict:
  """Per-step figures of a traced window of ``steps`` steps."""
  busy = busy_time(events) / 1e6
  kernel = sum(e['dur'] for e in events) / 1e6
  by_cat = collections.Counter()
  by_op = collections.defaultdict(lambda: [0.0, 0, ''])
  for e in events:
    shape, source = ops.get(e['op'], ('', ''))
    c = category(e['op'], e['name'], source)
    by_cat[c] += e['dur']
    row = by_op[(e['module'], e['op'], c)]
    row[0] += e['dur']
    row[1] += 1
    row[2] = row[2] or e['name']
  total = sum(by_cat.values()) or 1.0
  short, long, longest = idle_gaps(events)
  tops = sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]
  return {
      'steps': steps, 'wall_ms': 1e3 * wall_s / steps, 'busy_ms': 1e3 * busy / steps,
      'kernel_ms': 1e3 * kernel / steps, 'busy_share': busy / wall_s if wall_s else 0.0,
      'kernels': len(events) // steps, 'launch_gaps_ms': short / 1e3 / steps,
      'host_waits_ms': long / 1e3 / steps, 'longest_gap_ms': longest / 1e3,
      'categories': {c: {'ms': by_cat[c] / 1e3 / steps, 'share': by_cat[c] / total}
                     for c in CATEGORIES},
      'top': [{'op': op, 'module': module, 'category': c, 'ms': t / 1e3 / steps,
               'share': t / total, 'launches': n // steps, 'kernel': name[:60],
               'hlo': ' '.join(ops.get(op, ('', '')))}
              for (module, op, c), (t, n, name) in tops],
  }


def format_report(r: dict) -> str:
  """A profile summary as text."""
  lines = [f"{r['run']}: {r['wall_ms']:.1f} ms/step wall, device busy {r['busy_ms']:.1f} ms "
           f"({100 * r['busy_share']:.0f}%), kernels {r['kernel_ms']:.1f} ms"]
  if 'kernels' in r:
    lines.append(f"  {r['kernels']} kernels/step; idle between kernels: gaps < 20 us "
                 f"{r['launch_gaps_ms']:.1f} ms/step, longer {r['host_waits_ms']:.1f} ms/step "
                 f"(longest {r['longest_gap_ms']:.2f} ms)")
  lines.append('  ' + '  '.join(f"{c} {v['ms']:.1f} ms ({100 * v['share']:.0f}%)"
                                for c, v in r['categories'].items() if v['ms'] > 0))
  for t in r['top']:
    shape, _, source = t['hlo'].partition(' ')
    source = '/'.join(source.split('/')[-2:])
    lines.append(f"  {t['ms']:8.2f} ms {100 * t['share']:5.1f}% x{t['launches']:<3d} "
                 f"{t['category']:14s} {t['op'][:30]:30s} {shape[:44]:44s} {source[:60]}")
  return '\n'.join(lines)


def file_name(label: str) -> str:
  """A run label as a file name (characters other than letters, digits and
  ``.=+-`` written ``_``)."""
  return re.sub(r'[^A-Za-z0-9.=+-]', '_', label)


def profile_run(a, run) -> dict:
  """Builds ``run`` (a :class:`experiments.harness.Run`) as bench_train does, then traces
  ``a.timed_steps`` steps."""
  import jax
  from experiments import bench_train
  # The compiled program's text comes from a second compilation: the cache
  # makes it a lookup.
  jax.config.update('jax_compilation_cache_dir', tempfile.mkdtemp(prefix='jaxcache'))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  for name in filter(None, (a.variant or '').split(',')):
    importlib.import_module(name)  # e.g. a module that swaps in another version of an op
  label = run.label
  cfg = bench_train.run_config(a, run)
  setup = bench_train.setup_run(cfg, label)
  model, opt, step, batches = setup['model'], setup['opt'], setup['step'], setup['batches']
  bench_train.progress(f'{label}: compiling and warming up')
  for i in range(max(a.warmup_steps, 1)):
    jax.block_until_ready(step(model, opt, batches[i % 2]))
  hlo = step.lower(model, opt, batches[0]).compile().as_text()
  ops = hlo_ops(hlo)
  if a.trace_dir:
    os.makedirs(a.trace_dir, exist_ok=True)
    with gzip.open(os.path.join(a.trace_dir, file_name(label) + '.hlo.txt.gz'), 'wt') as f:
      f.write(hlo)
  trace_dir = a.trace_dir and os.path.join(a.trace_dir, file_name(label))
  with tempfile.TemporaryDirectory() as tmp:
    trace_dir = trace_dir or tmp
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      t0 = time.perf_counter()
      out = None
      for i in range(a.timed_steps):
        out = step(model, opt, batches[i % 2])
      jax.block_until_ready(out)
      wall = time.perf_counter() - t0
    events = read_trace(trace_dir)
  bench_train.progress(f'{label}: traced {a.timed_steps} steps, {len(events)} kernels')
  r = summarize(events, a.timed_steps, wall, ops, top=a.top)
  r.update(run=label, model=cfg.model, seq_len=cfg.seq_len, batch=cfg.batch_size,
           device=jax.devices()[0].device_kind, checks=setup['checks'])
  return r


def main(argv=None):
  from experiments import bench_train, harness
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  bench_train.add_run_args(p, warmup_steps=2, timed_steps=5, rounds=True)
  p.add_argument('--top', type=int, default=15, help='kernels listed per run')
  p.add_argument('--variant', default=None, metavar='MODULE[,MODULE]',
                 help='modules to import before building (on PYTHONPATH), to profile a '
                      'variant of the code they patch')
  p.add_argument('--trace-dir', default=None,
                 help='keep the traces and the compiled programs (HLO text) here')
  a = p.parse_args(argv)
  run = bench_train.child_run(a)
  if run:  # child process: one run, JSON on the last line
    harness.report(profile_run(a, run))
    return
  bench_train.check_runs(p, a)
  bench_train.run_each(a, 'profile_step', argv or sys.argv[1:],
                       lambda r: f"{r['run']}: failed: {r['error']}" if 'error' in r
                       else format_report(r))


if __name__ == '__main__':
  main()
