"""What a run reports beyond ``metrics.jsonl``: the trackers people already
use, the training statistics of each log step, and a profile.

``--tracking tensorboard`` writes TensorBoard event files under
``RUN/tensorboard/`` (with tensorboardX: no TensorFlow), ``--tracking wandb``
logs to Weights & Biases (the ``wandb`` package, imported only then; its
project from ``WANDB_PROJECT``, default ``poetx_jax``, and ``WANDB_MODE`` et
al. as wandb reads them). Both get every record of ``metrics.jsonl`` at its
step, each number under its ``metrics.jsonl`` key and a list's items as
``KEY/0``, ``KEY/1``, ... (a mixture-of-experts validation's
``expert_tokens``): the training loss, the statistics below, the
validations, each merge's orthogonality error, a probe's records.

Every ``log_every`` steps :class:`Tracking.step_stats` adds to ``metrics.jsonl``:

* ``lr`` (and ``poet_lr`` for POET-X): the learning rates of the last update,
  read from the run's schedules (:meth:`~poetx_jax.pretrain.plan.Plan.schedule`);
* ``grad_norm``: the global norm of the update's gradients before clipping
  (under gradient accumulation, of its micro-batches' mean), computed inside the update
  program (``make_train_step(grad_norm=True)``) and read only here;
* ``train_tokens_per_s``: since the last log step, evaluation, checkpoints
  and compilation left out;
* ``mfu``: model FLOPs utilisation, ``train_tokens_per_s`` x
  :func:`flops_per_token` / (the devices' peak, :func:`peak_flops`); absent
  where the peak is unknown (the CPU).

``--profile-steps A:B`` writes a ``jax.profiler`` trace of micro-steps A to B
to ``RUN/profile/`` (TensorBoard's profile plugin or xprof read it). It starts
before the update that trains micro-step A (once step A - 1 is done, without
accumulation), before what the loop does then (a validation or checkpoint due
there is in the trace: choose A - 1 away from them), and stops once an update
has reached B.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import pathlib
import secrets
import time

import jax

from poetx_jax.pretrain.config import TrainConfig, profile_window

# Dense bf16 peak FLOP/s of one device, from the vendors' datasheets (no
# sparsity), by a substring of ``device.device_kind``; the first match counts.
PEAK_FLOPS = (
  ('H100 PCIe', 756e12), ('H100 NVL', 835e12), ('H100', 989e12), ('H200', 989e12),
  ('B200', 2250e12), ('A100', 312e12), ('L40S', 362e12),
  ('TPU v4', 275e12), ('TPU v5 lite', 197e12), ('TPU v5p', 459e12),
  ('TPU v6 lite', 918e12),
)


def peak_flops(device: jax.Device) -> float | None:
  """The dense bf16 peak FLOP/s of ``device`` (:data:`PEAK_FLOPS`), None on
  a CPU or a kind the table does not know."""
  if device.platform == 'cpu':
    return None
  kind = device.device_kind
  return next((peak for name, peak in PEAK_FLOPS if name in kind), None)


def flops_per_token(mc, seq_len: int) -> float:
  """Training FLOPs per token of model config ``mc`` on ``seq_len``-token
  sequences: ``6 N + 6 L T H``.

  ``N`` is the active parameters (:meth:`active_params`: a mixture of
  experts' routed ones only) less the input embedding, a lookup (a tied
  embedding counts once, as the head); 6 is 2 FLOPs a multiply-add times
  forward and backward (x 3). ``6 L T H`` is causal attention: per layer and
  token, ``Q K^T`` and ``A V`` are ``2 T H`` FLOPs each forward (``H`` =
  heads x head_dim) over all ``T`` keys, half of them masked, times 3. The
  model's FLOPs, as in PaLM's MFU: POET-X's block products and
  rematerialisation are not counted.
  """
  embedding = 0 if mc.tie_embeddings else mc.vocab_size * mc.hidden
  attention = 6.0 * mc.layers * seq_len * mc.heads * mc.head_dim
  return 6.0 * (mc.active_params() - embedding) + attention


def scalars(record: dict) -> dict[str, float]:
  """The numbers of a metrics record by tag: its keys, list items as
  ``KEY/i``; ``step``, text, None and booleans left out."""
  out = {}

  def add(tag, v):
    if isinstance(v, (list, tuple)):
      for i, x in enumerate(v):
        add(f'{tag}/{i}', x)
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
      out[tag] = float(v)

  for k, v in record.items():
    if k != 'step':
      add(k, v)
  return out


class TensorBoard:
  """Scalars to TensorBoard event files in ``directory`` (tensorboardX).

  Resuming from ``resume_step``, the events after it that an earlier
  process wrote (before a crash) are purged from TensorBoard's view."""

  def __init__(self, directory: pathlib.Path, *, resume_step: int = 0):
    SummaryWriter = tracker_module('tensorboard').SummaryWriter
    self.writer = SummaryWriter(str(directory),
                                purge_step=resume_step + 1 if resume_step else None)

  def write(self, step: int, values: dict[str, float]) -> None:
    for tag, v in values.items():
      self.writer.add_scalar(tag, v, step)
    self.writer.flush()  # a crash loses nothing written

  def close(self) -> None:
    self.writer.close()


class Wandb:
  """Scalars to a Weights & Biases run named after the run directory, its
  config the run's; ``RUN/wandb.json`` keeps its id, so a resumed run
  continues the same W&B run."""

  def __init__(self, out: pathlib.Path, cfg: TrainConfig, *, resume_step: int = 0):
    wandb = tracker_module('wandb')
    ids = out / 'wandb.json'
    if resume_step and ids.is_file():
      run_id = json.loads(ids.read_text())['id']
    else:
      run_id = secrets.token_hex(4)
      ids.write_text(json.dumps({'id': run_id}))
    self.run = wandb.init(project=os.environ.get('WANDB_PROJECT', 'poetx_jax'),
                          name=out.resolve().name, id=run_id, resume='allow',
                          dir=str(out), config=dataclasses.asdict(cfg))

  def write(self, step: int, values: dict[str, float]) -> None:
    self.run.log(values, step=step)

  def close(self) -> None:
    self.run.finish()


# The package of each tracker, and what installs it.
_PACKAGES = {'tensorboard': ('tensorboardX', 'tensorboardX (the pretrain extra installs it: '
                                             'pip install tensorboardX)'),
             'wandb': ('wandb', 'the wandb package (pip install wandb)')}


def tracker_module(name: str):
  """The package tracker ``name`` writes with, imported (ImportError saying
  what to install). A run calls it for each of its trackers before it
  changes anything, so that a missing one refuses the run untouched."""
  module, what = _PACKAGES[name]
  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ImportError(f'--tracking {name} needs {what}') from e


def open_tracker(name: str, out: pathlib.Path, cfg: TrainConfig, *, resume_step: int = 0):
  """The tracker ``name`` of ``config.TRACKERS`` for the run in ``out``."""
  if name == 'tensorboard':
    return TensorBoard(out / 'tensorboard', resume_step=resume_step)
  if name == 'wandb':
    return Wandb(out, cfg, resume_step=resume_step)
  raise ValueError(f'tracking: {name!r} is not a tracker; valid: tensorboard, wandb')


class Tracking:
  """A run's trackers (``cfg.tracking``), its step statistics and its profile.

  ``write(record)`` / ``close()`` make it a sink of
  :class:`~poetx_jax.pretrain.metrics.Metrics`; the loop calls
  :meth:`step_stats` every ``log_every`` steps and :meth:`profile` after
  every step (both hooks, ``train.loop_hooks``).

  Args:
    plan: the run's plan (its options, schedules and model's FLOPs per token).
    out: the run directory.
    resume_step: the step the run continues from (0: a fresh run).
    write: open the trackers (False: another process of the run reports).
    log: where a resumed run past the profile window's start says what of
      the window it traces.
  """

  def __init__(self, plan, out: pathlib.Path, *,
               resume_step: int = 0, write: bool = True, log=print):
    cfg = plan.options
    self.trackers = [open_tracker(name, out, cfg, resume_step=resume_step)
                     for name in (cfg.tracking if write else ())]
    self.schedules = {'lr': plan.lr_schedule}
    if plan.poet_lr is not None:
      self.schedules['poet_lr'] = plan.poet_lr_schedule
    self.flops = flops_per_token(plan.model, cfg.seq_len)
    peak = peak_flops(jax.devices()[0])
    self.peak = None if peak is None else peak * jax.device_count()
    self._last = None  # (step, training seconds) at the last step_stats
    self.window = profile_window(cfg.profile_steps) if cfg.profile_steps else None
    self.profile_dir, self.tracing = out / 'profile', False
    if self.window and resume_step and resume_step >= self.window[0] - 1:
      a, b = self.window
      if resume_step < b:
        self._start_trace()
      if resume_step >= a and write:
        log(f'--profile-steps {a}:{b}: the run resumes after micro-step {resume_step}, '
            + (f'inside the window: the trace holds steps {resume_step + 1} to {b} only'
               if resume_step < b else
               f'past the window: no trace is written (give a window after '
               f'{resume_step})'))

  def write(self, record: dict) -> None:
    values = scalars(record) if self.trackers else None
    if values:
      for tracker in self.trackers:
        tracker.write(record['step'], values)

  def close(self) -> None:
    """Stops a trace still running (the run stopped inside its window)
    and closes the trackers."""
    if self.tracing:
      self._stop_trace()
    for tracker in self.trackers:
      tracker.close()

  def step_stats(self, run) -> dict:
    """The statistics of a log step (module docstring); after the log
    line's hook, which has waited for the step."""
    cfg = run.cfg
    updates = run.step // cfg.grad_accum  # optax reads a schedule at the updates before
    stats = {k: float(s(max(updates - 1, 0))) for k, s in self.schedules.items()}
    if run.grad_norm is not None:
      stats['grad_norm'] = float(run.grad_norm)
    now = time.perf_counter() - run.t0 - run.clock.paused_s - run.clock.compile_s()
    step0, t0 = self._last or (run.start, 0.0)
    self._last = (run.step, now)
    if now > t0 and run.step > step0:
      tok_s = (run.step - step0) * cfg.batch_size * cfg.seq_len / (now - t0)
      stats['train_tokens_per_s'] = tok_s
      if self.peak is not None:
        stats['mfu'] = tok_s * self.flops / self.peak
    return stats

  def profile(self, run) -> None:
    """Starts the trace before the update that trains micro-step A, stops it
    once an update has reached B (with the training clock paused: writing the
    trace is not training)."""
    a, b = self.window
    paused = (contextlib.nullcontext() if run.clock is None  # step 0, before the loop
              else run.clock.paused(run.loss))
    if run.step < a <= run.step + run.cfg.grad_accum and not self.tracing:
      with paused:
        self._start_trace()
    if run.step >= b and self.tracing:
      with paused:
        self._stop_trace()

  def _start_trace(self) -> None:
    jax.profiler.start_trace(str(self.profile_dir))
    self.tracing = True

  def _stop_trace(self) -> None:
    jax.profiler.stop_trace()
    self.tracing = False
