"""Llama pretraining with POET-X (or AdamW as the baseline): the training loop.

``train(TrainConfig(...))`` sets up the run (its directory, data, model,
optimizer and train step), runs the loop with validation, metrics, progress
and checkpoints, and returns a summary. ``poetx train`` (cli.py) is a thin
shell over it. The pieces live beside it: the options in config.py, their
defaults resolved into the run's plan in plan.py, what the plan builds in
factories.py (the optimizer families in recipes.py), the loss in loss.py,
validation in evaluation.py, the metrics, progress bar and clock in
metrics.py, the hooks in hooks.py, the run directory in rundir.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import time
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from poetx_jax.pretrain.data import windows as data_lib
from poetx_jax.pretrain import compile_cache, hf_init, loading, processes, rundir, signals
from poetx_jax.pretrain.options import finish_options
from poetx_jax.pretrain.plan import Plan, make_plan, recorded_plan
from poetx_jax.pretrain.checkpoint import Checkpointer, full_disk_stop, resumed_message
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.evaluation import evaluate, place_batch
from poetx_jax.pretrain.disk_full import when_full
from poetx_jax.pretrain.factories import (abstract_state, build_state, make_step,
                                          make_training_mesh, state_sizes)
from poetx_jax.pretrain.hooks import Hook, crossed
from poetx_jax.pretrain.metrics import (Metrics, Progress, StopFlag, TrainClock,
                                        merge_reporter, read_metrics)
from poetx_jax.pretrain.tracking import Tracking, tracker_module


class NonFiniteLoss(FloatingPointError):
  """The loss or the model state became NaN or infinite (``poetx train`` and
  ``poetx eval`` exit 3).

  Training saves nothing once it has seen the state go bad. Its message says
  what is known: the steps in which the state went bad (after the last one
  found to give a finite loss; the training loss is fetched only every
  ``log_every`` steps), and which checkpoints are from before them; one
  saved within them may hold the bad state."""
  exit_code = 3


@jax.jit
def _finite(leaves):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def all_finite(tree) -> bool:
  """Whether every floating-point array of ``tree`` is free of NaN and infinity."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return bool(_finite(leaves)) if leaves else True


class Validation(tp.NamedTuple):
  """A validation of a run's state: its step, the mean loss per target token
  and its perplexity."""
  step: int
  loss: float
  ppl: float


@dataclasses.dataclass
class Run:
  """A run being trained: its plan (and options, ``cfg``), directory, state,
  data, writers and hooks, the step it is at, and its validations so far."""
  plan: Plan
  out: pathlib.Path
  mesh: tp.Any
  model: tp.Any
  optimizer: tp.Any
  step_fn: tp.Callable
  batches: tp.Any  # the training batches: a grain iterator
  val: list  # the validation batches
  ckpt: Checkpointer
  metrics: Metrics
  step: int
  tracking: Tracking
  hooks: list[Hook] = dataclasses.field(default_factory=list)
  val_windows: tuple[int, int] = (0, 0)  # in the validation batches, in the split
  first_val: Validation | None = None  # at step 0
  last_val: Validation | None = None  # the newest of this call
  stopped: str | None = None
  good: int | None = None  # the newest step whose state gave a finite loss
  merges: list = dataclasses.field(default_factory=list)  # (step, error) to report
  # windows -> {source: windows of it among them}: a mixture's (MixtureData.drawn)
  drawn: tp.Callable[[int], dict] | None = None
  # The loop's state: the last step's loss and gradient norm (device arrays
  # until logged), the clock, the progress bar and where this call started.
  loss: tp.Any = None
  grad_norm: tp.Any = None
  clock: TrainClock | None = None
  progress: Progress | None = None
  t0: float = 0.0
  start: int = 0
  saved_at: int | None = None

  @property
  def cfg(self) -> TrainConfig:
    """The run's options."""
    return self.plan.options

  def save(self, reason: str) -> None:
    """Starts an asynchronous checkpoint of the state and the data position,
    once the model state is checked finite (else :meth:`diverged`)."""
    if not all_finite(nnx.to_pure_dict(nnx.state(self.model))):
      self.diverged(f'the model state is not finite at step {self.step}', bad=self.step)
    meta = {'step': self.step, 'config': dataclasses.asdict(self.cfg), 'reason': reason}
    self.ckpt.save(self.step, self.model, self.optimizer,
                   data_state=self.batches.get_state(), meta=meta)
    self.saved_at = self.step
    for hook in self.hooks:
      if hook.on == 'save' and hook.due(self.step, False, self.cfg.grad_accum):
        _call(self, hook)

  def diverged(self, what: str, *, bad: int) -> tp.NoReturn:
    """Raises NonFiniteLoss once the earlier checkpoints are written: ``what``
    happened and the state of step ``bad`` is bad. The message says since
    which step it may have been, and which checkpoints are from before."""
    self.ckpt.close()
    where, steps = self.ckpt.directory, self.ckpt.all_steps()
    lo = self.start if self.good is None else self.good + 1
    known = (f'the state of step {self.good} was the last found to give a finite loss'
             if self.good is not None else
             f'no loss was found finite since this run started at step {self.start}')
    went = (f'in one of the steps {lo} to {bad}' if lo < bad else f'at step {bad}')
    text = (f'training diverged: {what}; {known}, so the state went bad {went} (the '
            f'training loss is fetched every {self.cfg.log_every} steps)')
    suspect = [c for c in steps if c >= lo]
    before = [c for c in steps if c < lo]
    if suspect:
      listed = (f'checkpoint step {suspect[0]} in {where} is' if len(suspect) == 1 else
                f'checkpoint steps {", ".join(map(str, suspect))} in {where} are')
      text += (f'; {listed} from those steps and may hold the bad state (poetx eval '
               f'{self.out} --step N exits 3 if its loss is not finite)')
      text += (f'; the newest from before is step {before[-1]} (--resume --step '
               f'{before[-1]})' if before else '; no checkpoint is from before')
    elif before:
      text += (f'; nothing was saved from it: the newest checkpoint, step {before[-1]} in '
               f'{where}, is from before')
    else:
      text += '; no checkpoint was written before'
    raise NonFiniteLoss(text)

  def validate(self) -> Validation:
    """The :class:`Validation` of the state now, also written to metrics.jsonl with
    the model's auxiliary outputs on the first validation batch (a
    mixture-of-experts model's routing; :func:`~poetx_jax.pretrain.evaluation.evaluate`)."""
    result = evaluate(self.model, self.val, self.mesh)
    self.metrics.write({'step': self.step, 'val_loss': result.loss, 'val_ppl': result.ppl,
                        **result.aux})
    if not math.isfinite(result.loss):
      self.diverged(f'the validation loss became {result.loss} at step {self.step}',
                    bad=self.step)
    self.good = self.step
    return Validation(self.step, result.loss, result.ppl)


def _call(run: Run, hook: Hook) -> None:
  out = hook.fn(run)
  if out:
    run.metrics.write({'step': run.step, **out})


def train(cfg: TrainConfig, *, resume: bool = False, step: int | None = None, log=print,
          stop_after: int | None = None, hooks: tp.Sequence[Hook] = ()) -> dict:
  """Runs (or resumes) a training run; returns a summary dict.

  Writes the run directory (rundir.py), locked while it trains, its
  checkpoints and ``metrics.jsonl`` (its records: metrics.py).

  Args:
    cfg: the run's configuration.
    resume: continue from the newest intact checkpoint in ``cfg.out_dir`` (its
      ``run.json`` must match ``cfg`` but for locations and a raised
      ``steps``, its corpus the stored data identity).
    step: with ``resume``, the checkpoint to continue from (the newer ones are
      set aside).
    log: where progress messages go.
    stop_after: stop (and checkpoint) after this many steps of this call, as a
      SIGTERM would (used by tests and for time-limited jobs).
    hooks: :class:`Hook` s run beside the loop's own (probes that record the
      spectrum, faults injected by tests): those with ``wait=False`` right
      after each step is dispatched, the others after its validation and
      before its checkpoint.

  A SIGTERM or SIGINT before the loop (its exception raised where it landed,
  or, dropped there, at the next safe point: :mod:`~poetx_jax.pretrain.signals`)
  stops the run unsaved, a fresh run's directory removed: nothing is
  written. In the loop it stops the run after its step, with a checkpoint
  (one with the last step leaves the run complete).

  Raises NonFiniteLoss (nothing saved from a diverged state) and
  run_lock.RunLocked (another training holds ``cfg.out_dir``).
  """
  _checked(resume, step, hooks)
  try:
    cfg = finish_options(cfg, resume=resume, device_count=jax.device_count())
    signals.check()
  except (SystemExit, KeyboardInterrupt) as e:  # a signal while the devices start
    _stopped_starting(e, log, 'before the run directory was opened: nothing was written')
    raise
  primary = processes.is_primary()  # of several processes, the first reports
  log = log if primary else (lambda *_: None)
  if cfg.warmup >= cfg.steps:
    log(f'warning: --warmup {cfg.warmup} is not below --steps {cfg.steps}: every update is '
        f'in the warmup, and the learning rate never reaches its peak')
  compile_cache.use(cfg.compile_cache, log)
  with rundir.open_run(cfg, resume=resume, log=log) as (out, accepted), \
       contextlib.ExitStack() as loop_signals:
    try:
      run = set_up(cfg, out, resume=resume, step=step, log=log)
      signals.check()
      # With the plan; resumed, only now: a refused --resume leaves run.json as it was.
      rundir.write_config(out, cfg, run.plan)
      run.hooks = loop_hooks(run, hooks, log)
      if run.step == 0:
        with _stops_when_full(run):
          _start(run, log)
      # From here a signal only sets the flag, read after each step; one that
      # came before (its exception dropped) stops the run here, unsaved.
      stop = loop_signals.enter_context(StopFlag())
      if stop.signal:
        raise signals.exit_of(stop.signal)
      accepted()  # from here a failure keeps what the run wrote
    except (SystemExit, KeyboardInterrupt) as e:  # a signal before the loop: no save
      _stopped_starting(e, log, 'before training: resume again with --resume' if resume else
                        'before any checkpoint: nothing was written; run the command again '
                        'to start afresh')
      raise
    with _stops_when_full(run):  # a write refused for want of space: one line
      total = run.plan.micro_steps  # one iteration = one update of grad_accum micro-batches
      run.progress = Progress(total, initial=run.step, disable=not primary)
      run.t0, run.start = time.perf_counter(), run.step
      with TrainClock() as run.clock:
        while run.step < total:
          run.loss, run.grad_norm = run.step_fn(run.model, run.optimizer, _next_update(run))
          run.step += cfg.grad_accum
          _after_step(run, last=run.step == total)
          signal = _agreed(stop.signal, at_log=crossed(run.step, cfg.log_every, cfg.grad_accum))
          signal = signal if run.step < total else None  # too late to stop anything
          if signal or (stop_after is not None and run.step - run.start >= stop_after):
            run.stopped = signal or 'stop_after'
            if run.saved_at != run.step:
              with run.clock.paused(run.loss):
                run.save(run.stopped)
            break
      loop_signals.close()  # the command's handlers back: a signal exits at once
      if stop.signal and run.stopped is None:
        log(f'{stop.signal} came with the last step: the run is complete')
      run.progress.close()
      return _finish(run, log)


def _stopped_starting(e: BaseException, log, what: str) -> None:
  """Logs that a signal stopped the run while it started (``e``: its exit), and ``what``."""
  name = signals.name_of(e)
  if name:
    log(f'stopped by {name} while starting, {what}')


def _stops_when_full(run: Run) -> tp.ContextManager[None]:
  """A write of the run refused for want of space stops it with
  :func:`~poetx_jax.pretrain.checkpoint.full_disk_stop`'s DiskFull (what
  failed, the checkpoint to resume from), once the checkpoint writes ended."""
  def stop(e, code):
    with contextlib.suppress(Exception):  # the same save's error, again
      run.ckpt.close()
    if run.progress is not None:  # the line below on a line of its own
      run.progress.close()
    return full_disk_stop(e, code, run.out, run.ckpt.committed_steps())
  return when_full(stop)


def loop_hooks(run: Run, hooks: tp.Sequence[Hook], log) -> list[Hook]:
  """The hooks of a run in the order they run after a step: the report of
  the merges the step made (POET-X); the given ones that do not wait; the
  log line (every ``log_every``: the loss fetched and checked finite, the
  progress bar, a metrics record) and the step statistics (tracking.py); a
  profile's start and stop; the validation (every ``eval_every``); the given ones that
  wait; the checkpoint (every ``checkpoint_every``)."""
  cfg, hooks = run.cfg, list(hooks)
  report = (merge_reporter(run.metrics, log, poet_lr=run.plan.poet_lr,
                           merge_every=run.plan.merge_every,
                           max_generator_norm=cfg.max_generator_norm)
            if run.plan.poetize else None)

  def report_merges(run):
    while run.merges:
      report(*run.merges.pop(0))

  def validate(run):
    run.last_val = run.validate()

  def save(run):
    run.save('final' if run.step == run.plan.micro_steps else 'periodic')

  return (([Hook(report_merges, wait=False)] if report else [])
          + [h for h in hooks if not h.wait]
          + [Hook(_log_step, every=cfg.log_every, wait=False),
             Hook(run.tracking.step_stats, every=cfg.log_every, wait=False)]
          + ([Hook(run.tracking.profile, at_start=True, wait=False)]
             if cfg.profile_steps else [])
          + [Hook(validate, every=cfg.eval_every)]
          + [h for h in hooks if h.wait]
          + [Hook(save, every=cfg.checkpoint_every)])


def _next_update(run: Run):
  """The next update's batch on the devices: one micro-batch, or
  ``grad_accum`` of them stacked on a leading axis."""
  k = run.cfg.grad_accum
  if k == 1:
    return place_batch(next(run.batches), run.mesh)
  micro = [next(run.batches) for _ in range(k)]
  return place_batch({name: np.stack([b[name] for b in micro]) for name in micro[0]},
                     run.mesh, axis=1)


def _after_step(run: Run, last: bool) -> None:
  """Runs the step hooks that are due: those that do not wait at once, the
  others with the clock paused (and the step waited for) only then."""
  due = [h for h in run.hooks if h.on == 'step' and h.due(run.step, last, run.cfg.grad_accum)]
  for hook in due:
    if not hook.wait:
      _call(run, hook)
  waiting = [h for h in due if h.wait]
  if waiting:
    with run.clock.paused(run.loss):
      for hook in waiting:
        _call(run, hook)


_SIGNALS = (None, 'SIGINT', 'SIGTERM')


def _agreed(signal: str | None, *, at_log: bool) -> str | None:
  """The stop signal every process acts on: with one process its own at once;
  with several, the one any process caught, agreed at logging steps only (a
  collective each time), so that all leave the loop after the same step."""
  if jax.process_count() == 1:
    return signal
  return _SIGNALS[processes.agree_max(_SIGNALS.index(signal))] if at_log else None


def _checked(resume: bool, step: int | None, hooks) -> None:
  """Raises ValueError unless ``step`` names a checkpoint to resume from and
  ``hooks`` are Hooks."""
  for h in hooks:
    if not isinstance(h, Hook):
      raise ValueError(f'hooks must be train.Hook instances, got {h!r}')
  if step is not None and not resume:
    raise ValueError(f'step={step!r} needs resume: it picks the checkpoint to resume from')
  if step is not None and not (isinstance(step, int) and step >= 0):
    raise ValueError(f'step must be a checkpoint step >= 0, got {step!r}')


def set_up(cfg: TrainConfig, out: pathlib.Path, *, resume: bool, step: int | None = None,
           log=print) -> Run:
  """The run of the finished options ``cfg`` ready for its first (or, resuming,
  next) step in its (open) run directory ``out``: the data read, the plan
  made (resuming, with the values the run recorded), the model, optimizer and
  train step built and placed on the devices, the state restored when
  resuming (from ``step``, else the newest intact checkpoint; on one device
  into the state's shapes, no random model drawn first)."""
  # The process that reports opens the trackers: a missing package refuses the
  # run there before anything moves.
  processes.on_primary('importing the trackers',
                       lambda: [tracker_module(name) for name in cfg.tracking])
  data = loading.run_data(out, cfg, resume=resume)
  log(f'data: {data.description}')
  source = hf_init.run_source(cfg, out, resume=resume, log=log)  # --init-from-hf
  plan = make_plan(cfg, data.tokenizer.vocab_size, source and source.config,
                   recorded=recorded_plan(out) if resume else None)
  mesh = make_training_mesh(plan)
  if resume and mesh is None:  # shapes only: the checkpoint's arrays fill them
    model, optimizer = abstract_state(plan)
  else:
    model, optimizer = build_state(plan, mesh, source and source.weights)
  if mesh is not None:
    log(f'mesh: {dict(mesh.shape)}, strategy {cfg.strategy}')
  for line in state_sizes(plan, model, optimizer):
    log(line)
  # Each process reads and feeds only its own rows of every global batch.
  pc, pi = jax.process_count(), jax.process_index()
  if cfg.batch_size % pc:
    raise ValueError(f'batch_size={cfg.batch_size} must be divisible by the {pc} processes')
  batches = iter(data_lib.train_dataset(data.train_windows, batch_size=cfg.batch_size,
                                        seed=cfg.seed, shard_index=pi, shard_count=pc))
  windows = data.val_windows[:cfg.eval_batches * cfg.batch_size]  # poetx eval's default
  val = data_lib.eval_batches(windows, batch_size=cfg.batch_size)
  ckpt = Checkpointer(out / 'checkpoints', max_to_keep=cfg.keep)
  records = ()
  if resume:  # metrics.jsonl read (and refused if damaged) before anything moves
    records = processes.on_primary('reading metrics.jsonl', lambda: (
        read_metrics(out, warn=log) if (out / 'metrics.jsonl').exists() else ()))
    chosen = step is not None
    step, data_state = ckpt.resume(model, optimizer, step=step, run=out, log=log)
    batches.set_state(data_state)
    reached = max((r['step'] for r in records or () if 'loss' in r), default=step)
    log(resumed_message(step, plan.micro_steps, reached, ckpt.unfinished_steps(),
                        chosen=chosen))
  tracking = Tracking(plan, out, resume_step=step or 0, write=processes.is_primary(), log=log)
  metrics = Metrics(out, step or 0, write=processes.is_primary(), records=records or (),
                    sinks=[tracking])
  merges = []  # the step function's merges, reported by a hook (loop_hooks)
  step_fn = make_step(plan, on_merge=lambda *merge: merges.append(merge), mesh=mesh,
                      grad_norm=True)
  return Run(plan, out, mesh, model, optimizer, step_fn, batches, val, ckpt, metrics,
             step or 0, tracking, merges=merges,
             val_windows=(len(windows), len(data.val_windows)),
             drawn=getattr(data, 'drawn', None))


def _start(run: Run, log) -> None:
  """Step 0: validates the initial model, then runs the hooks ``at_start``."""
  run.first_val = run.validate()
  log(_validation_line(run.first_val, run.val_windows))
  for hook in run.hooks:
    if hook.at_start and hook.on == 'step':
      _call(run, hook)


def _validation_line(v: Validation, windows: tuple[int, int]) -> str:
  return (f'step {v.step}: validation loss {v.loss:.4f}, perplexity {v.ppl:.2f} '
          f'({windows[0]} of {windows[1]} validation windows)')


def _log_step(run: Run) -> None:
  """Fetches the loss (stopping on a non-finite one), updates the progress bar
  and writes the step's record."""
  run.loss = loss = float(run.loss)
  if not math.isfinite(loss):  # the step's loss is that of the state before it
    before = run.step - run.cfg.grad_accum  # the update's loss: of the state before it
    run.diverged(f'the loss became {loss} at step {run.step}, computed from the state of '
                 f'step {before}', bad=before)
  run.good = run.step - run.cfg.grad_accum
  elapsed = time.perf_counter() - run.t0
  tok_s = (run.step - run.start) * (run.cfg.batch_size * run.cfg.seq_len) / elapsed
  run.progress.update(run.step, loss, tok_s)
  run.metrics.write({'step': run.step, 'loss': loss, 'tokens_per_s': tok_s,
                     'elapsed_s': elapsed, 'train_s': elapsed - run.clock.paused_s,
                     'compile_s': run.clock.compile_s(), 'start_step': run.start})


def _finish(run: Run, log) -> dict:
  """Waits for the checkpoint writes, closes the writers; the run's summary."""
  closing = time.perf_counter()
  run.ckpt.close()  # waits for the asynchronous checkpoint writes
  closing = time.perf_counter() - closing
  drawn = run.drawn(run.step * run.cfg.batch_size) if run.drawn else None
  if drawn:  # the training windows of each source so far (the run's, resumed or not)
    run.metrics.write({'step': run.step, 'windows_drawn': drawn})
    log('training windows drawn by step ' + f'{run.step}: '
        + ', '.join(f'{k}: {v:,}' for k, v in drawn.items()))
  run.metrics.close()
  elapsed = time.perf_counter() - run.t0
  tokens = (run.step - run.start) * (run.cfg.batch_size * run.cfg.seq_len)
  steady_s = elapsed - run.clock.paused_s - run.clock.compile_s() - closing
  summary = {'step': run.step, 'stopped': run.stopped, 'elapsed_s': elapsed,
             'out_dir': str(run.out), 'tokens_per_s': tokens / max(elapsed, 1e-9),
             'steady_tokens_per_s': tokens / max(steady_s, 1e-9)}
  stats = jax.local_devices()[0].memory_stats() or {}
  if 'peak_bytes_in_use' in stats:  # GPUs report it; the CPU does not
    summary['peak_gib'] = stats['peak_bytes_in_use'] / 2 ** 30
  if drawn:
    summary['windows_drawn'] = drawn
  if run.first_val:
    summary['val_before'] = run.first_val._asdict()
  if run.last_val:  # of its own step, which may be before the last
    summary['val_after'] = run.last_val._asdict()
    log(_validation_line(run.last_val, run.val_windows))
  if run.stopped:
    log(f'stopped at step {run.step} ({run.stopped}); resume with --resume')
  return summary
