"""Random stops of one tiny training run, each followed by ``--resume``: the
run must end bit for bit as the same run uninterrupted.

    python3 -m experiments.fault_injection --stops 20 --stop-seed 0 --out /tmp/faults
    python3 -m experiments.fault_injection --stops 40 --kill-share 0.5 --corpus corpus/

Each stop takes the next of ``--stops`` distinct micro-steps drawn at random
(increasing, so that every stop falls after the step the run resumes from)
and a signal drawn at random:

* SIGTERM or SIGINT, sent to this process by a hook right after the step is
  dispatched: the loop checkpoints the step and returns (a job scheduler's
  stop, Ctrl-C);
* SIGKILL (``kill -9``), in a child process, right after the step is
  dispatched (a checkpoint save may still be in flight) or right after a
  checkpoint's save starts (``--kill-share`` of the stops): nothing is saved
  and the next resume takes over the dead process's lock and continues from
  the newest whole checkpoint.

Each stop is followed by ``train(cfg, resume=True)`` to the next stop, and
the last by a resume to the end. The result is compared with the
uninterrupted run: every logged loss, and every array of the final model and
optimizer state. Reports the stops survived (the end identical), the
micro-steps trained again (the work each kill lost), and the bytes of the
final state that differ (0 when it is identical); exit 1 if any differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import typing as tp

import numpy as np
from flax import nnx

from experiments import harness
from poetx_jax.pretrain import rundir
from poetx_jax.pretrain.checkpoint import Checkpointer, saved_steps
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.factories import build_model, build_optimizer
from poetx_jax.pretrain.hooks import Hook
from poetx_jax.pretrain.plan import make_plan
from poetx_jax.pretrain.train import train

# A tiny POET-X run: merges every 3 updates, checkpoints every 4 steps.
TINY = dict(model='tiny', model_overrides={'layers': 1, 'hidden': 32, 'mlp': 32,
                                           'heads': 2, 'kv_heads': 1},
            vocab_size=300, seq_len=32, batch_size=4, warmup=2, merge_every=3,
            block_size=8, eval_every=6, eval_batches=1, log_every=1, checkpoint_every=4,
            dtype='float32')

def killed_child(payload: dict) -> None:
  """The child of a SIGKILL stop: the run of ``payload['config']`` resumed
  (or started) in this process, killed by itself right after step
  ``payload['at']`` is dispatched or its save starts (``payload['on']``)."""
  at = payload['at']

  def kill(run):
    if run.step == at:
      os.kill(os.getpid(), signal.SIGKILL)

  train(TrainConfig(**payload['config']), resume=payload['resume'], log=lambda *_: None,
        hooks=[Hook(kill, wait=False, on=payload['on'])])


@dataclasses.dataclass
class Stop:
  """One stop: the micro-step, the signal, where a kill struck, and the step
  the following resume continued from."""
  step: int
  signal: str
  on: str = 'step'
  resumed_from: int | None = None


def plan_stops(total: int, count: int, seed: int, kill_share: float,
               checkpoint_every: int) -> list[Stop]:
  """``count`` stops at distinct random micro-steps in [1, total - 1],
  increasing; about ``kill_share`` of them SIGKILLs (those at a checkpoint
  step struck half the time as its save starts), the rest SIGTERM or SIGINT."""
  if not 1 <= count <= total - 1:
    raise ValueError(f'--stops must be in [1, {total - 1}] for a run of {total} steps, '
                     f'got {count}')
  rng = random.Random(seed)
  stops = []
  for step in sorted(rng.sample(range(1, total), count)):
    if rng.random() < kill_share:
      on = 'save' if step % checkpoint_every == 0 and rng.random() < 0.5 else 'step'
      stops.append(Stop(step, 'SIGKILL', on))
    else:
      stops.append(Stop(step, rng.choice(['SIGTERM', 'SIGINT'])))
  return stops


def _signal_self(at: int, name: str) -> Hook:
  def send(run):
    if run.step == at:
      os.kill(os.getpid(), signal.Signals[name])
  return Hook(send, wait=False)


def _killed(cfg: TrainConfig, stop: Stop, resume: bool, env: tp.Mapping[str, str]) -> None:
  payload = {'config': dataclasses.asdict(cfg), 'on': stop.on, 'at': stop.step,
             'resume': resume}
  proc = subprocess.run(harness.child_command('fault_injection', [], payload),
                        capture_output=True, text=True, env=env, timeout=600)
  if proc.returncode != -signal.SIGKILL:
    raise RuntimeError(f'the child to be killed at step {stop.step} exited '
                       f'{proc.returncode}: {proc.stderr[-2000:]}')


def _newest_step(cfg: TrainConfig) -> int:
  return max(saved_steps(pathlib.Path(cfg.out_dir) / 'checkpoints'), default=0)


def losses(run: str | os.PathLike) -> list[tuple[int, float]]:
  """The (step, loss) records of a run's metrics.jsonl."""
  lines = (pathlib.Path(run) / 'metrics.jsonl').read_text().splitlines()
  return [(r['step'], r['loss']) for r in map(json.loads, lines) if 'loss' in r]


def final_state(cfg: TrainConfig) -> tuple[int, list[np.ndarray]]:
  """(step, every model and optimizer array) of the run's newest checkpoint."""
  plan = make_plan(cfg, rundir.read_data_record(cfg.out_dir)['vocab_size'])
  model = build_model(plan)
  opt = build_optimizer(plan, model)
  step, _, _ = Checkpointer(pathlib.Path(cfg.out_dir) / 'checkpoints').restore(model, opt)
  import jax  # pylint: disable=g-import-not-at-top
  return step, [np.asarray(x) for x in jax.tree.leaves(
      (nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(opt))))]


def run_with_stops(cfg: TrainConfig, stops: list[Stop], *, env=None,
                   log=lambda *_: None) -> dict:
  """Trains ``cfg`` from scratch, stopped at each of ``stops`` and resumed
  after each; returns ``{'steps_trained': ..., 'stops': [...]}`` (the
  micro-steps computed in all, and each stop with the step resumed from)."""
  env = harness.child_env(env)
  trained, at = 0, 0  # micro-steps computed; the step the run stands at
  for i, stop in enumerate(stops):
    resume = i > 0
    if stop.signal == 'SIGKILL':
      _killed(cfg, stop, resume, env)
    else:
      summary = train(cfg, resume=resume, log=lambda *_: None,
                      hooks=[_signal_self(stop.step, stop.signal)])
      if summary.get('stopped') != stop.signal:
        raise RuntimeError(f'the run was to stop by {stop.signal} at step {stop.step}: '
                           f'{summary}')
    trained += stop.step - at
    at = stop.resumed_from = _newest_step(cfg)
    log(f'stop {i + 1}/{len(stops)}: {stop.signal} at step {stop.step}'
        + (' (as its save started)' if stop.on == 'save' else '')
        + f'; resuming from step {at}')
  train(cfg, resume=bool(stops), log=lambda *_: None)
  trained += cfg.steps * cfg.grad_accum - at
  return {'steps_trained': trained, 'stops': [dataclasses.asdict(s) for s in stops]}


def compare(cfg: TrainConfig, reference: TrainConfig) -> dict:
  """How far the run of ``cfg`` is from ``reference``'s: the loss records
  that differ and the bytes of the final state that differ."""
  got, want = losses(cfg.out_dir), losses(reference.out_dir)
  (step, arrays), (ref_step, ref_arrays) = final_state(cfg), final_state(reference)
  as_bytes = lambda x: np.ascontiguousarray(x).reshape(-1).view(np.uint8)
  differ = sum(int(np.sum(as_bytes(a) != as_bytes(b)))
               for a, b in zip(arrays, ref_arrays)) if step == ref_step else None
  return {'losses_differ': sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want)),
          'state_bytes': sum(a.nbytes for a in ref_arrays),
          'state_bytes_differ': differ, 'final_step': step}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--stops', type=int, default=20, help='stops (default: %(default)s)')
  p.add_argument('--run-steps', type=int, default=None,
                 help='the run\'s micro-steps (default: 2 x stops + 8)')
  p.add_argument('--stop-seed', type=int, default=0, help='draws the stops (default: 0)')
  p.add_argument('--kill-share', type=float, default=0.2,
                 help='the share of SIGKILL stops (default: %(default)s)')
  p.add_argument('--corpus', nargs='+', default=None,
                 help='the run\'s --data (default: the built-in corpus)')
  p.add_argument('--out', default='runs/fault-injection',
                 help='where the two runs go (replaced; default: %(default)s)')
  harness.add_child_option(p)
  a = p.parse_args(argv)
  payload = harness.child_payload(a)
  if payload:
    killed_child(payload)
    return 1  # not reached: the child kills itself
  if not 0.0 <= a.kill_share <= 1.0:
    p.error(f'--kill-share must be in [0, 1], got {a.kill_share}')
  steps = a.run_steps or 2 * a.stops + 8
  out = pathlib.Path(a.out)
  shutil.rmtree(out, ignore_errors=True)
  base = TrainConfig(**TINY, steps=steps, data=a.corpus, cache_dir=str(out / 'cache'))
  reference = dataclasses.replace(base, out_dir=str(out / 'uninterrupted'))
  stopped = dataclasses.replace(base, out_dir=str(out / 'stopped'))
  try:
    stops = plan_stops(steps, a.stops, a.stop_seed, a.kill_share, base.checkpoint_every)
  except ValueError as e:
    p.error(str(e))
  # One compilation cache for the runs and the children: the same programs.
  import jax  # pylint: disable=g-import-not-at-top
  cache = {'jax_compilation_cache_dir': str(out / 'jit-cache'),
           'jax_persistent_cache_min_compile_time_secs': 0}
  for k, v in cache.items():
    jax.config.update(k, v)
    os.environ[k.upper()] = str(v)
  train(reference, log=lambda *_: None)
  result = run_with_stops(stopped, stops, log=lambda m: print(m, file=sys.stderr))
  result.update(compare(stopped, reference))
  kinds = {k: sum(s['signal'] == k for s in result['stops'])
           for k in ('SIGTERM', 'SIGINT', 'SIGKILL')}
  same = result['losses_differ'] == 0 and result['state_bytes_differ'] == 0
  print(f'{len(stops)} stops ({", ".join(f"{n} {k}" for k, n in kinds.items())}) of a '
        f'{steps}-step run: {"survived, the end bit-identical" if same else "DIFFERENT"}; '
        f'{result["steps_trained"] - steps} micro-steps trained again; '
        f'{result["state_bytes_differ"]} of {result["state_bytes"]:,} state bytes differ')
  print(json.dumps(result))
  return 0 if same else 1


if __name__ == '__main__':
  sys.exit(main())
