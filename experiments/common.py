"""What the experiments share: progress lines, child processes that report
one JSON result, device-synchronised timing, and the tables they print.

    progress('compiling')                       # [12:00:01] compiling, on stderr
    result, error = run_child(cmd, 'poetx')     # the child's last stdout line, parsed
    ms, spread = timeit(fn, x)                  # median of synchronised calls
    print_table(results, [Column('run', 24, str, key=True), ...])
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
import typing as tp

import jax
import jax.numpy as jnp


def progress(msg: str) -> None:
  """A progress line on stderr, stamped with the time (a parent running this
  process as a child shows it live, prefixed: :func:`run_child`)."""
  print(f'[{time.strftime("%H:%M:%S")}] {msg}', file=sys.stderr, flush=True)


def run_child(cmd: list[str], label: str, env=None) -> tuple[dict | None, str | None]:
  """Runs one benchmark process whose last stdout line is its JSON result.

  Its progress lines (stderr, :func:`progress`) are echoed as they come,
  prefixed with ``label`` (library warnings are not). Returns ``(result,
  None)``, or ``(None, error)`` with the last lines of its output when it failed.
  """
  with tempfile.TemporaryFile(mode='w+') as stdout:
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True,
                            env=env)
    tail = []
    for line in proc.stderr:
      line = line.rstrip('\n')
      tail = (tail + [line])[-20:]
      if line.startswith('['):
        print(f'  {label}: {line}', file=sys.stderr, flush=True)
    rc = proc.wait()
    stdout.seek(0)
    out = stdout.read().strip()
  if rc:
    lines = ('\n'.join(tail) or out).strip().splitlines()
    return None, ' | '.join(lines[-3:])[-300:]
  return json.loads(out.splitlines()[-1]), None


def timeit(fn, *args, warmup=3, iters=20):
  """(median, spread) wall time in ms of ``fn(*args)``, synchronised on every call."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times), statistics.pstdev(times)


def rel_err(a, b) -> float:
  """||a - b|| / ||b|| in float32."""
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def print_rows(rows, base, baseline, width=38):
  """One line per timed row ``name: (ms, spread)``: median, spread and the
  ratio to ``base`` ms (named ``baseline``)."""
  for name, (ms, sd) in rows.items():
    print(f'  {name:{width}s} {ms:8.3f} ms  ±{sd:6.3f}  {ms / base:5.2f}x {baseline}')


def dump_json(path, results, module: str, argv) -> None:
  """Writes the record of ``results`` (:func:`experiments.harness.write_record`:
  the command ``python3 -m experiments.MODULE ARGV``, commit, device) where
  ``--json`` asked (nothing when it is None)."""
  if path:
    from experiments import harness
    harness.write_record(path, results, module=module,
                         argv=sys.argv[1:] if argv is None else argv)


@dataclasses.dataclass(frozen=True)
class Column:
  """A column of :func:`print_table`: its header, width, the text of a
  result's cell, and whether it names the result (then shown for a failed
  one too; left-aligned)."""
  header: str
  width: int
  cell: tp.Callable[[dict], str]
  key: bool = False


def print_table(results: list[dict], columns: list[Column], *, title: str | None = None,
                error_chars: int = 80) -> None:
  """The results as a table on stdout: one line each, a result holding
  ``'error'`` as its key columns and ``failed: ...`` (the error's last
  ``error_chars``)."""
  if title:
    print(f'\n{title}')
  align = lambda c, text: f'{text:{"<" if c.key else ">"}{c.width}s}'  # noqa: E731
  print(' '.join(align(c, c.header) for c in columns).rstrip())
  for r in results:
    if 'error' in r:
      keys = ' '.join(align(c, c.cell(r)) for c in columns if c.key)
      print(f'{keys} failed: {r["error"][-error_chars:]}')
    else:
      print(' '.join(align(c, c.cell(r)) for c in columns).rstrip())
