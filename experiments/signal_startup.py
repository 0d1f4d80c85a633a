"""SIGINT and SIGTERM sent to ``poetx train`` at many instants of its start-up:
each must end in a stop that wrote nothing (before the training loop) or in
a run that ``--resume`` ends exactly as the uninterrupted one (after).

    python3 -m experiments.signal_startup --instants 50 --out /tmp/signals   # the full sweep
    python3 -m experiments.signal_startup --instants 5 --draw-seed 1         # a quick sample

A tiny run of a few steps is first trained uninterrupted, in a process of its
own as every run here, and its start-up timed, from launch to the start of
its training loop (``S``; about 2.5 s on a 2-core CPU with the compilation
cache warm). Then, for each signal, a run is launched ``--instants`` times
and sent the signal once, at an instant drawn in each of ``--instants``
equal slices of ``[0, 1.1 S]`` (or ``[0, --span]``; the uninterrupted run
is then trained only where an outcome needs it): the interpreter's start,
the imports and the start of the devices, the data, the model and the
first validation, and the loop's first steps. Each outcome is one of:

* ``nothing written``: the run directory does not exist and the process
  exited 143 / 130 (or died by the signal itself, before ``poetx`` set its
  handlers);
* ``resumed exactly``: the run was stopped in its loop (exit 143 / 130, a
  checkpoint saved); ``poetx train --resume`` ends it with the uninterrupted
  run's losses and final state, bit for bit;
* ``complete``: the signal came with the last step (exit 0, the run saying
  so), once the command had printed its last line (exit 0), after the
  process ended, or once ``poetx`` had returned and put the default handlers
  back (the process died by it); the run is the uninterrupted one.

Anything else (a traceback, a run directory without a checkpoint, a state
that differs, an ``Exception ignored`` report on stderr) is a failure: a
signal whose exception Python drops (raised inside JAX's garbage-collection
callback, say) must still end as above, without that report. Exit 1 if any
instant failed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import time

from experiments import fault_injection, harness
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.kv import format_overrides

SIGNALS = ('SIGINT', 'SIGTERM')
STEPS = 3


def _args(run: pathlib.Path, corpus: str, root: pathlib.Path) -> list[str]:
  """``poetx train`` of fault_injection's tiny run for STEPS steps, checkpointed
  at its end, into ``run``; the token and compilation caches under ``root``."""
  t = fault_injection.TINY
  return [sys.executable, '-m', 'poetx_jax.pretrain.cli', 'train', '--data', corpus,
          '--model', t['model'], '--model-overrides', format_overrides(t['model_overrides']),
          *[x for k in ('vocab_size', 'seq_len', 'batch_size', 'warmup', 'merge_every',
                        'block_size', 'eval_batches', 'log_every', 'dtype')
            for x in (f'--{k.replace("_", "-")}', str(t[k]))],
          '--steps', str(STEPS), '--eval-every', str(STEPS), '--checkpoint-every', '2',
          '--cache-dir', str(root / 'cache'), '--compile-cache', str(root / 'xla'),
          '--out-dir', str(run), '--plot', '']


def _env() -> dict:
  return harness.child_env()


def _config(run: pathlib.Path, corpus: str, root: pathlib.Path) -> TrainConfig:
  return TrainConfig(**{**fault_injection.TINY, 'steps': STEPS, 'eval_every': STEPS,
                        'checkpoint_every': 2, 'data': [corpus],
                        'cache_dir': str(root / 'cache'), 'out_dir': str(run)})


def _same(run: pathlib.Path, corpus: str, root: pathlib.Path) -> bool:
  """Whether the run ends as the uninterrupted one (``root/reference``,
  trained first if missing): every loss and every state byte."""
  reference = root / 'reference'
  if not (reference / 'checkpoints').is_dir():
    reference_run(corpus, root, warm=False)
  got = fault_injection.compare(_config(run, corpus, root), _config(reference, corpus, root))
  return (got['losses_differ'] == 0 and got['state_bytes_differ'] == 0
          and got['final_step'] == STEPS)


def reference_run(corpus: str, root: pathlib.Path, warm: bool = True) -> float:
  """Trains the uninterrupted run into ``root/reference`` (with ``warm``
  twice: the first fills the caches, the second is timed); the seconds from
  its launch to the start of its training loop (its first metrics record,
  the initial validation, written: the loop starts right after)."""
  for _ in range(1 + warm):
    run = root / 'reference'
    shutil.rmtree(run, ignore_errors=True)
    t0, started = time.perf_counter(), None
    proc = subprocess.Popen(_args(run, corpus, root), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    while proc.poll() is None and started is None:
      if (run / 'metrics.jsonl').exists():
        started = time.perf_counter() - t0
      time.sleep(0.01)
    _, err = proc.communicate(timeout=600)
    if proc.returncode:
      raise RuntimeError(f'the uninterrupted run failed: {err[-3000:]}')
  return started if started is not None else time.perf_counter() - t0


def one(name: str, at: float, corpus: str, root: pathlib.Path) -> dict:
  """Launches the run, sends it ``name`` ``at`` seconds after the launch, and
  says how it ended (the module docstring's outcomes)."""
  run = root / 'stopped'
  shutil.rmtree(run, ignore_errors=True)
  proc = subprocess.Popen(_args(run, corpus, root), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=_env())
  time.sleep(at)
  sent = proc.poll() is None
  if sent:
    proc.send_signal(signal.Signals[name])
  out, err = proc.communicate(timeout=600)
  code = 128 + signal.Signals[name]
  result = {'signal': name, 'at': round(at, 3), 'exit': proc.returncode, 'sent': sent,
            'ok': False}
  if not run.exists():
    result['outcome'] = 'nothing written'
    # Killed by the signal itself: it came before poetx set its handlers (the
    # interpreter's start, Python's own KeyboardInterrupt traceback for SIGINT).
    result['ok'] = proc.returncode == -signal.Signals[name] or (
        proc.returncode == code and 'Traceback' not in err)
  elif proc.returncode == 0 or proc.returncode == -signal.Signals[name]:
    # Exit 0: the signal came with the last step (the run says so), or once
    # the command had ended (its last line, the speed, printed: poetx's
    # handlers act on any signal before it) or the process had; killed by
    # it: it came once poetx had returned and put the default handlers back.
    result['outcome'] = 'complete'
    told = f'{name} came with the last step' in out or 'tokens/s over' in out
    result['ok'] = (proc.returncode != 0 or not sent or told) and _same(run, corpus, root)
  elif proc.returncode == code and any((run / 'checkpoints').glob('[0-9]*')):
    result['outcome'] = 'resumed exactly'
    resumed = subprocess.run(_args(run, corpus, root) + ['--resume'], capture_output=True,
                             text=True, env=_env(), timeout=600)
    result['ok'] = resumed.returncode == 0 and _same(run, corpus, root)
    err += resumed.stderr
  else:
    result['outcome'] = 'other'
  if 'Exception ignored' in err:  # a dropped exception reported (poetx leaves its own out)
    result['ok'] = False
  if not result['ok']:
    result['stderr'] = err[-2000:]
    result['stdout'] = out[-1000:]
  return result


def sweep(corpus: str, root: pathlib.Path, instants: int, seed: int = 0,
          signals=SIGNALS, span: float | None = None, log=lambda *_: None) -> list[dict]:
  """Every signal of ``signals`` at ``instants`` instants, one drawn in each
  equal slice of [0, ``span``] seconds after the launch (default: 1.1 S,
  ``S`` the uninterrupted run's start-up, launch to loop, its caches warm);
  each instant's :func:`one`."""
  root.mkdir(parents=True, exist_ok=True)
  if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # a background job's: inherited
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the runs start with SIG_DFL
  if span is None:
    span = 1.1 * reference_run(corpus, root)
  rng = random.Random(seed)
  results = []
  for name in signals:
    for i in range(instants):
      at = (i + rng.random()) * span / instants
      results.append(one(name, at, corpus, root))
      log(json.dumps({k: v for k, v in results[-1].items() if k not in ('stderr', 'stdout')}))
  return results


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--instants', type=int, default=50,
                 help='instants for each signal (default: %(default)s)')
  p.add_argument('--draw-seed', type=int, default=0, help='draws the instants (default: 0)')
  p.add_argument('--span', type=float, default=None,
                 help='draw the instants in [0, SPAN] seconds after the launch (default: '
                      '1.1 x the uninterrupted run\'s start-up, launch to loop)')
  p.add_argument('--corpus', default=None,
                 help='the runs\' --data (default: 40 generated text files)')
  p.add_argument('--out', default='runs/signal-startup',
                 help='where the runs and caches go (replaced; default: %(default)s)')
  a = p.parse_args(argv)
  if a.instants < 1:
    p.error(f'--instants must be >= 1, got {a.instants}')
  root = pathlib.Path(a.out)
  shutil.rmtree(root, ignore_errors=True)
  corpus = a.corpus
  if corpus is None:
    from tests.conftest import write_corpus  # pylint: disable=g-import-not-at-top
    (root / 'corpus').mkdir(parents=True)
    corpus = str(write_corpus(root / 'corpus'))
  results = sweep(corpus, root, a.instants, a.draw_seed, span=a.span,
                  log=lambda m: print(m, file=sys.stderr))
  failed = [r for r in results if not r['ok']]
  for name in SIGNALS:
    mine = [r for r in results if r['signal'] == name]
    kinds = {k: sum(r['outcome'] == k for r in mine)
             for k in ('nothing written', 'resumed exactly', 'complete', 'other')}
    print(f'{name}: {len(mine)} instants: ' + ', '.join(f'{n} {k}' for k, n in kinds.items())
          + f'; {sum(not r["ok"] for r in mine)} failed')
  print(json.dumps(failed))
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
