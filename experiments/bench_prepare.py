"""``poetx prepare`` at growing corpus sizes, and training that streams from it.

For each size, builds a jsonl corpus of that many bytes from real installed
text (the standard library's Python sources, repeated as needed, in files of
64 MiB), prepares it with ``poetx prepare`` (one tokenizer for all sizes,
trained by the first, smallest prepare) and then runs ``poetx train --data
DIR --steps 1``. Each command runs in a process of its own while the summed
resident memory of it and its children is sampled every 0.2 s. Prints and
(``--json``) saves per size: prepare wall time and MB/s, prepare peak RSS,
train wall time (start-up to the end of the first step, two evaluations
included) and train peak RSS.

    python3 -m experiments.bench_prepare --sizes-mb 10,256,512,1024 --work /tmp/bench_prepare
    python3 -m experiments.bench_prepare --sizes-mb 10,1024 --work /tmp/bench_prepare \\
        --train-repeats 3   # first step: the median of 3 runs per size
    python3 -m experiments.bench_prepare --sizes-mb 1,2 --work /tmp/bp --no-train   # quick
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import time


def build_corpus(directory: pathlib.Path, size: int, file_bytes: int = 64 << 20) -> int:
  """Writes ``size`` bytes (at least) of jsonl documents into ``directory``."""
  from poetx_jax.pretrain.data import corpus
  lines = [(json.dumps({'text': d}) + '\n').encode() for d in corpus.stdlib_sources()]
  directory.mkdir(parents=True, exist_ok=True)
  written = i = k = 0
  while written < size:
    with open(directory / f'part-{k:03d}.jsonl', 'wb') as f:
      in_file = 0
      while written < size and in_file < file_bytes:
        line = lines[i % len(lines)]
        f.write(line)
        i, written, in_file = i + 1, written + len(line), in_file + len(line)
    k += 1
  return written


def _tree_rss_kib(pid: int) -> int:
  """The summed VmRSS of ``pid`` and its descendants (from /proc)."""
  children: dict[int, list[int]] = {}
  for p in pathlib.Path('/proc').iterdir():
    if p.name.isdigit():
      try:
        ppid = int((p / 'stat').read_text().rsplit(')', 1)[1].split()[1])
      except (OSError, IndexError, ValueError):
        continue
      children.setdefault(ppid, []).append(int(p.name))
  total, todo = 0, [pid]
  while todo:
    q = todo.pop()
    try:
      status = pathlib.Path(f'/proc/{q}/status').read_text()
      total += int(status.split('VmRSS:')[1].split()[0]) if 'VmRSS:' in status else 0
    except (OSError, IndexError, ValueError):
      pass
    todo += children.get(q, [])
  return total


def run_sampled(cmd: list[str]) -> dict:
  """Runs ``cmd``; its wall time and the peak summed RSS of its process tree."""
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  peak = 0
  while proc.poll() is None:
    peak = max(peak, _tree_rss_kib(proc.pid))
    time.sleep(0.2)
  out, err = proc.communicate()
  if proc.returncode:
    raise SystemExit(f'{" ".join(cmd)} failed ({proc.returncode}):\n{err[-2000:]}')
  return {'wall_s': time.perf_counter() - t0, 'peak_rss_gib': peak / 2**20, 'stdout': out}


def main(argv=None) -> list[dict]:
  ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  ap.add_argument('--sizes-mb', default='10,256,512,1024',
                  help='corpus sizes in MiB, comma-separated, smallest first')
  ap.add_argument('--work', required=True, help='a directory for the corpora and datasets')
  ap.add_argument('--no-train', action='store_true', help='prepare only')
  ap.add_argument('--train-repeats', type=int, default=1,
                  help='train runs per size (fresh run directories); their medians are '
                       'reported')
  ap.add_argument('--json', default=None, help='write the results here')
  a = ap.parse_args(argv)
  sizes = [int(float(s) * 2**20) for s in a.sizes_mb.split(',')]
  work = pathlib.Path(a.work)
  poetx = [sys.executable, '-m', 'poetx_jax.pretrain.cli']
  results, tokenizer = [], None
  for size in sizes:
    corpus, ds = work / f'corpus-{size}', work / f'ds-{size}'
    nbytes = build_corpus(corpus, size) if not corpus.exists() else sum(
        f.stat().st_size for f in corpus.iterdir())
    cmd = poetx + ['prepare', str(corpus), '--out', str(ds)]
    if tokenizer is not None:
      cmd += ['--tokenizer', str(tokenizer)]
    prep = run_sampled(cmd)
    tokenizer = tokenizer or ds / 'tokenizer.json'
    manifest = json.loads((ds / 'manifest.json').read_text())
    row = {'corpus_mb': nbytes / 1e6, 'tokens': manifest['tokens'],
           'prepare_s': prep['wall_s'], 'prepare_mb_per_s': nbytes / 1e6 / prep['wall_s'],
           'prepare_peak_rss_gib': prep['peak_rss_gib']}
    if not a.no_train:
      runs = []
      for k in range(a.train_repeats):
        out = work / f'run-{size}-{k}'
        shutil.rmtree(out, ignore_errors=True)
        runs.append(run_sampled(poetx + ['train', '--data', str(ds), '--steps', '1',
                                         '--out-dir', str(out)]))
      row.update(train_first_step_s=statistics.median(r['wall_s'] for r in runs),
                 train_peak_rss_gib=statistics.median(r['peak_rss_gib'] for r in runs),
                 train_first_step_each_s=[round(r['wall_s'], 2) for r in runs])
    results.append(row)
    print(' '.join(f'{k} {v:,.3f}' if isinstance(v, float) else
                   f'{k} {v:,}' if isinstance(v, int) else f'{k} {v}'
                   for k, v in row.items()), flush=True)
  if a.json:
    from experiments import harness
    harness.write_record(a.json, results, module='bench_prepare',
                         argv=sys.argv[1:] if argv is None else argv)
  return results


if __name__ == '__main__':
  main()
