"""How long ``poetx train`` keeps a user waiting: launch to the first update,
cold and with a warm compilation cache, fresh and resumed.

For each run (``[NAME:]K=V,...``, ``poetx train``'s options as overrides:
:mod:`experiments.harness`) in a fresh temporary folder:

* **cold**: a new run with an empty ``--compile-cache``, ``--steps S`` (``--first-steps``)
  (checkpointing at step S);
* **warm**: the same run again in a new out-dir, its programs now in the cache;
* **resumed**: the first run resumed to step S + 2 (``--resume``), warm cache.

Each is timed from the process's launch to the first record of a new update
in its ``metrics.jsonl`` (``--log-every 1``; the step-0 validation, data
reading, set-up, restore and compilation included), and to its exit; the
times its log reports the data read, the state built, the checkpoint
restored and the step-0 validation (:data:`MARKS`) show where the wait goes.

    python3 -m experiments.resume_time --run poetx:model=130m,seq_len=256,batch_size=64 \\
        --run adamw:model=130m,seq_len=256,batch_size=64,optimizer=adamw
    python3 -m experiments.resume_time --first-steps 2 --run tiny:model=tiny  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from experiments import harness

# The lines of poetx train's log that mark its stages, by the key they are
# reported under: the data read, the state built (the model, or its shapes to
# restore into), the checkpoint restored, the step-0 validation.
MARKS = (('data', 'data:'), ('state', 'state:'), ('restored', 'resumed from'),
         ('validated', 'step 0:'))


def first_update(cmd: list[str], metrics: Path, after: int, env=None) -> dict:
  """Runs ``cmd``; seconds from launch to the first metrics record of a step
  above ``after``, to the process's exit, and to each of its log lines of
  :data:`MARKS` seen (``marks``)."""
  def updated() -> bool:
    for line in metrics.read_text().splitlines() if metrics.exists() else ():
      try:
        rec = json.loads(line)
      except ValueError:
        continue  # a line being written
      if 'loss' in rec and rec.get('step', 0) > after:
        return True
    return False

  t0, seen, marks, lines = time.perf_counter(), None, {}, []

  def read(stream):  # the log as it comes, a line (or a progress bar's redraw) at a time
    for line in iter(stream.readline, ''):
      for part in line.split('\r'):
        lines.append(part.rstrip('\n'))
        for key, start in MARKS:
          if key not in marks and part.startswith(start):
            marks[key] = time.perf_counter() - t0

  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env)
  reader = threading.Thread(target=read, args=(proc.stdout,), daemon=True)
  reader.start()
  while proc.poll() is None:
    if seen is None and updated():
      seen = time.perf_counter() - t0
    time.sleep(0.02)
  total = time.perf_counter() - t0
  reader.join(timeout=10)
  if proc.returncode:
    raise RuntimeError(' | '.join(l for l in lines[-3:])[-300:])
  if seen is None and updated():  # written in the last poll interval
    seen = total
  return {'first_update_s': seen, 'exit_s': total, 'marks': marks}


def config_file(run: harness.Run, root: Path) -> Path:
  """ROOT/run.json: the options ``run`` sets, as a ``poetx train --config``
  file (checked as ``poetx train`` checks them; ValueError if one is bad)."""
  from poetx_jax.pretrain.config import TrainConfig
  cfg = harness.apply(TrainConfig(), run)
  cfg.validate()
  path = root / 'run.json'
  path.write_text(json.dumps({k: getattr(cfg, k) for k, _ in run.pairs}))
  return path


def time_run(run: harness.Run, steps: int, root: Path) -> dict:
  """The cold, warm and resumed figures of one run."""
  base = [sys.executable, '-m', 'poetx_jax.pretrain.cli', 'train',
          '--config', str(config_file(run, root)), '--log-every', '1',
          '--checkpoint-every', str(steps), '--compile-cache', str(root / 'cache')]
  out = {}
  for key, out_dir, args, after in (
      ('cold', 'a', ['--steps', str(steps)], 0),
      ('warm', 'b', ['--steps', str(steps)], 0),
      ('resumed', 'a', ['--steps', str(steps + 2), '--resume'], steps)):
    cmd = base + ['--out-dir', str(root / out_dir), *args]
    out[key] = first_update(cmd, root / out_dir / 'metrics.jsonl', after)
    marks = ', '.join(f'{k} {v:.1f}' for k, v in out[key]['marks'].items())
    print(f'  {key}: first update {out[key]["first_update_s"]:.1f} s, '
          f'exit {out[key]["exit_s"]:.1f} s (log lines at: {marks} s)', file=sys.stderr,
          flush=True)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--run', action='append', required=True, metavar='[NAME:]K=V|V,...',
                 help='runs: the options of poetx train as overrides, e.g. '
                      'adamw:model=130m,optimizer=adamw; a value with |-separated '
                      'alternatives stands for one run each; repeatable')
  p.add_argument('--first-steps', type=int, default=4, help='updates of the first run (>= 1)')
  p.add_argument('--json', help='write the record (command, commit, device, results) here')
  a = p.parse_args(argv)
  if a.first_steps < 1:
    p.error(f'--first-steps {a.first_steps}: must be >= 1')
  try:
    runs = harness.expand_all(a.run)
    with tempfile.TemporaryDirectory() as root:
      for run in runs:
        config_file(run, Path(root))  # refused here, before any run starts
  except ValueError as e:
    p.error(f'--run: {e}')
  results = []
  for run in runs:
    print(f'{run.label}: {run.overrides}', file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as root:
      try:
        results.append({'run': run.label, **time_run(run, a.first_steps, Path(root))})
      except RuntimeError as e:
        results.append({'run': run.label, 'error': str(e)})
  print(f'{"run":12s} {"cold":>8s} {"warm":>8s} {"resumed":>8s}   (launch to first update, s)')
  for r in results:
    if 'error' in r:
      print(f'{r["run"]:12s} failed: {r["error"]}')
    else:
      print(f'{r["run"]:12s} ' + ' '.join(
          f'{r[k]["first_update_s"]:8.1f}' for k in ('cold', 'warm', 'resumed')))
  if a.json:
    harness.write_record(a.json, results, module='resume_time',
                         argv=sys.argv[1:] if argv is None else argv)
  return results


if __name__ == '__main__':
  main()
