"""Where a run's compile time goes: tracing and lowering, XLA's compilation, the merge programs.

For each run (``bench_train.py``'s options and ``--run K=V,...`` syntax) a
fresh process builds the model, optimizer and train step as ``poetx train``
does and, ``--timed-steps`` times with JAX's caches cleared in between,
times ``step.lower(...)`` (tracing the Python and lowering to StableHLO) and
``.compile()`` (XLA), reporting the medians (trace+lower also in the process's
CPU time, which other work on a shared machine barely moves: it is one
thread's), the StableHLO's size in lines and
the compiled entry computation's instruction count (each roughly a kernel on
a GPU). For POET-X runs it then times the first merge of the model (its
per-shape merge programs compiled, then run) against a second one (run
only): the difference is the merge programs' compile time.

``--passes N`` traces the first compilation of the step
(``jax.profiler.trace``) and reports the N costliest of the compiler's own
events (its passes, autotuning, code generation; each event's time summed
over its occurrences, nested events counted within their parents): where
XLA spends the compile time on the device at hand. Only the first is cold:
XLA keeps its autotuning results for the rest of the process.

    python3 -m experiments.compile_time --model 130m --seq-len 256 --batch-size 64 \\
        --run optimizer=poetx --run optimizer=poetx,form=input --run optimizer=adamw
    python3 -m experiments.compile_time --model tiny --seq-len 64 --timed-steps 1  # CPU smoke
    python3 -m experiments.compile_time --model 130m --seq-len 256 --batch-size 64 --passes 25 \\
        --run optimizer=poetx --run optimizer=adamw
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time


def entry_instructions(hlo_text: str) -> int:
  """Instructions of a compiled program's entry computation (parameters,
  tuples and bitcasts left out)."""
  entry = hlo_text[hlo_text.index('\nENTRY '):]
  entry = entry[:entry.index('\n}')]
  ops = re.findall(r'^\s*(?:ROOT )?%?[\w.\-]+ = \S+ ([\w\-]+)\(', entry, re.M)
  ops += re.findall(r'^\s*(?:ROOT )?%?[\w.\-]+ = \(.*?\) ([\w\-]+)\(', entry, re.M)
  return sum(op not in ('parameter', 'tuple', 'get-tuple-element', 'bitcast') for op in ops)


def compiler_events(trace_file: str, top: int) -> list[tuple[str, float, int]]:
  """The ``top`` costliest events of a perfetto trace written by
  ``jax.profiler.trace``, JAX's own Python frames (names starting with '$')
  left out: ``(name, seconds summed over its occurrences, occurrences)``."""
  with gzip.open(trace_file) as f:
    trace = json.load(f)
  events = trace['traceEvents'] if isinstance(trace, dict) else trace
  total, count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get('ph') == 'X' and not e['name'].startswith('$'):
      total[e['name']] += e.get('dur', 0) / 1e6
      count[e['name']] += 1
  return [(name, s, count[name]) for name, s in total.most_common(top)]


def traced_compile(lowered, top: int):
  """``(compiled, events)``: ``lowered`` compiled under ``jax.profiler.trace``
  and the :func:`compiler_events` of that compilation."""
  import jax
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      compiled = lowered.compile()
    trace, = glob.glob(os.path.join(d, '**', '*perfetto_trace.json.gz'), recursive=True)
    return compiled, compiler_events(trace, top)


def time_run(cfg, label: str, repeats: int, passes: int = 0) -> dict:
  """The compile times of one run (the module docstring)."""
  import jax
  import jax.numpy as jnp
  import poetx_jax
  from poetx_jax.pretrain import factories as F
  from poetx_jax.pretrain.plan import make_plan
  # Times of compiling: a program read back from a persistent compilation
  # cache (JAX_COMPILATION_CACHE_DIR set, say) would time the cache's read.
  jax.config.update('jax_enable_compilation_cache', False)
  plan = make_plan(cfg)
  model, opt = F.build_state(plan)
  shape = F.update_batch_shape(cfg)
  batch = {'inputs': jnp.zeros(shape, jnp.int32), 'targets': jnp.zeros(shape, jnp.int32)}
  step = F.make_step(plan)
  lower_s, lower_cpu_s, compile_s, events = [], [], [], None
  for i in range(max(repeats, 1)):
    jax.clear_caches()
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = step.lower(model, opt, batch)
    t1 = time.perf_counter()
    lower_cpu_s.append(time.process_time() - c0)
    if i == 0 and passes:  # the first: no autotuning results in the process yet
      compiled, events = traced_compile(lowered, passes)
    else:
      compiled = lowered.compile()
    compile_s.append(time.perf_counter() - t1)
    lower_s.append(t1 - t0)
  r = {'run': label, 'model': cfg.model, 'trace_lower_s': statistics.median(lower_s),
       'trace_lower_cpu_s': statistics.median(lower_cpu_s),
       'compile_s': statistics.median(compile_s), 'compile_first_s': compile_s[0],
       'stablehlo_lines': lowered.as_text().count('\n'),
       'entry_instructions': entry_instructions(compiled.as_text()),
       'device': jax.devices()[0].device_kind}
  if events is not None:
    r['compiler_events'] = events
  if plan.poetize:
    times = []
    for i in range(2):
      t0 = time.perf_counter()
      jax.block_until_ready(poetx_jax.merge(model, rngs=jax.random.key(i)))
      times.append(time.perf_counter() - t0)
    r['merge_first_s'], r['merge_again_s'] = times
  return r


def format_row(r: dict) -> str:
  """One result as a line of text."""
  if 'error' in r:
    return f"{r['run']}: failed: {r['error'][-200:]}"
  merge = (f", first merge {r['merge_first_s']:.1f} s (again {r['merge_again_s']:.2f} s)"
           if 'merge_first_s' in r else '')
  events = ''.join(f"\n    {s:8.2f} s {n:6d}x  {name[:90]}"
                   for name, s, n in r.get('compiler_events', ()))
  return (f"{r['run']}: trace+lower {r['trace_lower_s']:.1f} s "
          f"({r['trace_lower_cpu_s']:.1f} CPU-s), XLA compile "
          f"{r['compile_s']:.1f} s (first {r['compile_first_s']:.1f} s); StableHLO "
          f"{r['stablehlo_lines']:,} lines, {r['entry_instructions']:,} compiled entry "
          f"instructions{merge}{events}")


def main(argv=None):
  from experiments import bench_train, harness
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  bench_train.add_run_args(p, timed_steps=2, rounds=True)
  p.add_argument('--passes', type=int, default=0, metavar='N',
                 help='also compile once under the profiler and report the N costliest '
                      'compiler events (default 0: none)')
  a = p.parse_args(argv)
  if a.passes < 0:
    p.error(f'--passes {a.passes}: must be >= 0')
  run = bench_train.child_run(a)
  if run:  # child process: one run, JSON on the last line
    harness.report(time_run(bench_train.run_config(a, run), run.label, a.timed_steps, a.passes))
    return []
  bench_train.check_runs(p, a)
  return bench_train.run_each(a, 'compile_time', argv or sys.argv[1:], format_row)

if __name__ == '__main__':
  main()
