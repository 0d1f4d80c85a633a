"""Llama pretraining with POET-X (or AdamW as the baseline): the training loop.

``train(TrainConfig(...))`` sets up the run (its directory, data, model,
optimizer and train step), runs the loop with validation, metrics, progress
and checkpoints, and returns a summary. ``poetx train`` (cli.py) is a thin
shell over it. The pieces live beside it: the options in config.py, what they
build in factories.py, the loss and validation in evaluation.py, the metrics,
progress bar and clock in metrics.py, the run directory in rundir.py.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx

from poetx_jax import sharding
from poetx_jax.pretrain import data as data_lib
from poetx_jax.pretrain import loading, processes, rundir
from poetx_jax.pretrain.checkpoint import Checkpointer
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.evaluation import evaluate, expert_load, place_batch
from poetx_jax.pretrain.factories import (build_model, build_optimizer, compute_dtype,
                                          make_step, make_training_mesh, model_config,
                                          model_poet_lr, size_text)
from poetx_jax.pretrain.metrics import (Metrics, Progress, StopFlag, TrainClock,
                                        merge_reporter)


class NonFiniteLoss(FloatingPointError):
  """The loss or the model state became NaN or infinite (``poetx train`` exits 3).

  Nothing is saved from the diverged state: the newest checkpoint stays the
  last one written before, which the message names."""
  exit_code = 3


@jax.jit
def _finite(leaves):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def all_finite(tree) -> bool:
  """Whether every floating-point array of ``tree`` is free of NaN and infinity."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return bool(_finite(leaves)) if leaves else True


@dataclasses.dataclass
class Run:
  """A run being trained: its configuration, directory, state, data and writers,
  the step it is at, and its validations so far."""
  cfg: TrainConfig
  out: pathlib.Path
  mesh: tp.Any
  model: tp.Any
  optimizer: tp.Any
  step_fn: tp.Callable
  batches: tp.Any  # the training batches: a grain iterator
  val: list
  ckpt: Checkpointer
  metrics: Metrics
  step: int
  first_val: tuple[float, float] | None = None
  last_val: tuple[float, float] | None = None
  stopped: str | None = None
  hook: tp.Callable[[str, 'Run'], None] | None = None

  def save(self, reason: str) -> None:
    """Starts an asynchronous checkpoint of the state and the data position,
    once the model state is checked finite (else :meth:`diverged`)."""
    if not all_finite(nnx.to_pure_dict(nnx.state(self.model))):
      self.diverged(f'the model state is not finite at step {self.step}')
    meta = {'step': self.step, 'config': dataclasses.asdict(self.cfg), 'reason': reason}
    self.ckpt.save(self.step, self.model, self.optimizer,
                   data_state=self.batches.get_state(), meta=meta)
    if self.hook is not None:
      self.hook('save', self)

  def diverged(self, what: str) -> tp.NoReturn:
    """Raises NonFiniteLoss once the earlier checkpoints are written, naming the
    newest: the last good state."""
    self.ckpt.close()
    newest = self.ckpt.latest_step()
    kept = (f'the newest checkpoint, step {newest} in {self.ckpt.directory}, is from '
            f'before' if newest is not None else 'no checkpoint was written before')
    raise NonFiniteLoss(f'training diverged: {what}; nothing was saved from it, {kept}')

  def validate(self) -> tuple[float, float]:
    """(validation loss, perplexity) now, also written to metrics.jsonl (for a
    mixture-of-experts model with its routing on the first validation batch:
    :func:`~poetx_jax.pretrain.evaluation.expert_load`)."""
    loss, ppl = evaluate(self.model, self.val, self.mesh)
    record = {'step': self.step, 'val_loss': loss, 'val_ppl': ppl}
    if hasattr(self.model, 'forward_with_aux'):
      record.update(expert_load(self.model, self.val[0], self.mesh))
    self.metrics.write(record)
    return loss, ppl


def train(cfg: TrainConfig, *, resume: bool = False, step: int | None = None, log=print,
          stop_after: int | None = None,
          probe: tp.Callable[[int, tp.Any], dict] | None = None,
          probe_every: int | None = None,
          hook: tp.Callable[[str, Run], None] | None = None) -> dict:
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
    probe: ``probe(step, model) -> dict`` of numbers or lists, called at step
      0 (after its evaluation) and after the training step at every
      ``probe_every`` steps and at the last; each result is written to
      ``metrics.jsonl`` as ``{'step': step, **result}``. It must not change
      the model; its time is in ``elapsed_s`` but not in ``train_s``.
    probe_every: steps between probes (default: ``cfg.eval_every``, the probe
      then following each evaluation).
    hook: ``hook(event, run)`` after each step is dispatched (``'step'``) and
      each checkpoint save starts (``'save'``): where tests inject faults.

  Raises NonFiniteLoss (nothing saved from a diverged state) and
  rundir.RunLocked (another training holds ``cfg.out_dir``).
  """
  cfg, probe_every = _checked(cfg, probe_every, resume, step)
  primary = processes.is_primary()  # of several processes, the first reports
  log = log if primary else (lambda *_: None)
  with rundir.open_run(cfg, resume=resume, log=log) as out:
    run = set_up(cfg, out, resume=resume, step=step, log=log, hook=hook)
    if run.step == 0:
      _start(run, probe, log)
    total = cfg.steps * cfg.grad_accum  # one iteration = one micro-batch
    progress = Progress(total, initial=run.step, disable=not primary)
    t0, start = time.perf_counter(), run.step
    with StopFlag() as stop, TrainClock() as clock:
      while run.step < total:
        loss = run.step_fn(run.model, run.optimizer, place_batch(next(run.batches), run.mesh))
        run.step += 1
        if hook is not None:
          hook('step', run)
        last = run.step == total
        if run.step % cfg.log_every == 0 or last:
          loss = _log_step(run, loss, progress, clock, t0, start)
        _periodic(run, loss, clock, last, probe, probe_every)
        signal = _agreed(stop.signal, at_log=run.step % cfg.log_every == 0)
        if signal or (stop_after is not None and run.step - start >= stop_after):
          run.stopped = signal or 'stop_after'
          if run.step % cfg.checkpoint_every:
            with clock.paused(loss):
              run.save(run.stopped)
          break
    progress.close()
    return _finish(run, clock, t0, start, log)


_SIGNALS = (None, 'SIGINT', 'SIGTERM')


def _agreed(signal: str | None, *, at_log: bool) -> str | None:
  """The stop signal every process acts on: with one process its own at once;
  with several, the one any process caught, agreed at logging steps only (a
  collective each time), so that all leave the loop after the same step."""
  if jax.process_count() == 1:
    return signal
  return _SIGNALS[processes.agree_max(_SIGNALS.index(signal))] if at_log else None


def _periodic(run: Run, loss, clock: TrainClock, last: bool, probe,
              probe_every: int) -> None:
  """Validates, probes and checkpoints after the step when each is due, the
  clock paused (and the step waited for) only then."""
  s, cfg = run.step, run.cfg
  validate = s % cfg.eval_every == 0 or last
  probing = probe is not None and (s % probe_every == 0 or last)
  save = s % cfg.checkpoint_every == 0 or last
  if validate or probing or save:
    with clock.paused(loss):
      if validate:
        run.last_val = run.validate()
      if probing:
        run.metrics.write({'step': s, **probe(s, run.model)})
      if save:
        run.save('final' if last else 'periodic')


def _checked(cfg: TrainConfig, probe_every: int | None, resume: bool,
             step: int | None) -> tuple[TrainConfig, int]:
  """``cfg`` validated for this machine's devices, its ``out_dir`` filled in; the
  probe interval."""
  cfg.validate(device_count=jax.device_count())
  if probe_every is not None and (not isinstance(probe_every, int) or probe_every < 1):
    raise ValueError(f'probe_every must be an int >= 1, got {probe_every!r}')
  if step is not None and not (resume and isinstance(step, int) and step >= 0):
    raise ValueError(f'step={step!r}: choosing a checkpoint needs resume and a step >= 0')
  cfg = dataclasses.replace(cfg, out_dir=rundir.default_out_dir(cfg))
  return cfg, probe_every or cfg.eval_every


def set_up(cfg: TrainConfig, out: pathlib.Path, *, resume: bool, step: int | None = None,
           log=print, hook=None) -> Run:
  """The run of ``cfg`` ready for its first (or, resuming, next) step in its
  (open) run directory ``out``: the data read, the model, optimizer and train
  step built and placed on the devices, the state restored when resuming
  (from ``step``, else the newest intact checkpoint)."""
  data = loading.run_data(out, cfg, resume=resume)
  log(f'data: {data.description}')
  mc = model_config(cfg, data.tokenizer.vocab_size)
  mesh = make_training_mesh(cfg)
  model = build_model(cfg, mc, mesh)
  optimizer = build_optimizer(cfg, model)
  poet_lr = model_poet_lr(cfg, model) if cfg.optimizer == 'poetx' else None
  if mesh is not None:
    if cfg.batch_size % mesh.size:
      raise ValueError(f'batch_size={cfg.batch_size} must be divisible by the '
                       f'{mesh.size} devices')
    sharding.shard_state(model, mesh, cfg.strategy)
    sharding.shard_state(optimizer, mesh, cfg.strategy)
    log(f'mesh: {dict(mesh.shape)}, strategy {cfg.strategy}')
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  active = (f', {mc.active_params():,} active per token'
            if hasattr(mc, 'active_params') else '')
  log(f'model: {cfg.model} ({n_params:,} trainable parameters, '
      f'{mc.num_params():,} in the dense model{active}), optimizer {cfg.optimizer}'
      f'{" with SkewAdam tiers" if cfg.skew_tiers else ""}, '
      f'dtype {jnp.dtype(compute_dtype(cfg.dtype)).name}')
  log(f'state: model {size_text(nnx.state(model))}, optimizer '
      f'{size_text(nnx.state(optimizer))}; gradients '
      f'{size_text(nnx.state(model, nnx.Param))} during a step')
  # Each process reads and feeds only its own rows of every global batch.
  pc, pi = jax.process_count(), jax.process_index()
  if cfg.batch_size % pc:
    raise ValueError(f'batch_size={cfg.batch_size} must be divisible by the {pc} processes')
  batches = iter(data_lib.train_dataset(data.train_windows, batch_size=cfg.batch_size,
                                        seed=cfg.seed, shard_index=pi, shard_count=pc))
  val = data_lib.eval_batches(data.val_windows[:cfg.eval_batches * cfg.batch_size],
                               batch_size=cfg.batch_size)
  ckpt = Checkpointer(out / 'checkpoints', max_to_keep=cfg.keep)
  if resume:
    step, data_state = ckpt.resume(model, optimizer, step=step, run=out, log=log)
    batches.set_state(data_state)
    total = cfg.steps * cfg.grad_accum
    log(f'resumed from step {step}' + (f': the run is complete ({total} steps); raise '
                                       f'--steps to extend it' if step >= total else ''))
  metrics = Metrics(out, step or 0, write=processes.is_primary())
  on_merge = (merge_reporter(metrics, log, poet_lr=poet_lr, merge_every=cfg.merge_every)
              if poet_lr is not None else None)
  return Run(cfg, out, mesh, model, optimizer, make_step(cfg, on_merge=on_merge, mesh=mesh),
             batches, val, ckpt, metrics, step or 0, hook=hook)


def _start(run: Run, probe, log) -> None:
  """Step 0: validates (and probes) the initial model."""
  run.first_val = run.validate()
  log(f'step 0: validation loss {run.first_val[0]:.4f}, perplexity {run.first_val[1]:.2f}')
  if probe is not None:
    run.metrics.write({'step': 0, **probe(0, run.model)})


def _log_step(run: Run, loss, progress: Progress, clock: TrainClock, t0: float,
              start: int) -> float:
  """Fetches the loss (stopping on a non-finite one), updates the progress bar
  and writes the step's record; returns the loss."""
  loss = float(loss)
  if not math.isfinite(loss):
    run.diverged(f'the loss became {loss} at step {run.step}')
  elapsed = time.perf_counter() - t0
  tok_s = (run.step - start) * (run.cfg.batch_size * run.cfg.seq_len) / elapsed
  progress.update(run.step, loss, tok_s)
  run.metrics.write({'step': run.step, 'loss': loss, 'tokens_per_s': tok_s,
                     'elapsed_s': elapsed, 'train_s': elapsed - clock.paused_s,
                     'compile_s': clock.compile_s()})
  return loss


def _finish(run: Run, clock: TrainClock, t0: float, start: int, log) -> dict:
  """Waits for the checkpoint writes, closes the writers; the run's summary."""
  closing = time.perf_counter()
  run.ckpt.close()  # waits for the asynchronous checkpoint writes
  closing = time.perf_counter() - closing
  run.metrics.close()
  elapsed = time.perf_counter() - t0
  tokens = (run.step - start) * (run.cfg.batch_size * run.cfg.seq_len)
  steady_s = elapsed - clock.paused_s - clock.compile_s() - closing
  summary = {'step': run.step, 'stopped': run.stopped, 'elapsed_s': elapsed,
             'out_dir': str(run.out), 'tokens_per_s': tokens / max(elapsed, 1e-9),
             'steady_tokens_per_s': tokens / max(steady_s, 1e-9)}
  stats = jax.local_devices()[0].memory_stats() or {}
  if 'peak_bytes_in_use' in stats:  # GPUs report it; the CPU does not
    summary['peak_gib'] = stats['peak_bytes_in_use'] / 2 ** 30
  if run.first_val:
    summary['val_before'] = {'loss': run.first_val[0], 'ppl': run.first_val[1]}
  if run.last_val:
    summary['val_after'] = {'loss': run.last_val[0], 'ppl': run.last_val[1]}
    log(f'step {run.step}: validation loss {run.last_val[0]:.4f}, '
        f'perplexity {run.last_val[1]:.2f}')
  if run.stopped:
    log(f'stopped at step {run.step} ({run.stopped}); resume with --resume')
  return summary
