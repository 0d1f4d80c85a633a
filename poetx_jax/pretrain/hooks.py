"""Hooks of the training loop: what it does every N micro-steps.

``train(cfg, hooks=[Hook(fn, every=N)])`` calls ``fn(run)`` with the
:class:`poetx_jax.pretrain.train.Run` being trained; the loop's own work (the
log line, validation, the merge report, checkpoints) is hooks too.
"""

from __future__ import annotations

import dataclasses
import typing as tp


@dataclasses.dataclass(frozen=True)
class Hook:
  """Something the training loop does every ``every`` micro-steps, and after
  the last: ``fn(run)`` with the :class:`Run`; a dict it returns is written to
  ``metrics.jsonl`` as ``{'step': run.step, **result}``.

  Attributes:
    fn: ``fn(run) -> dict | None``; it must not change the model unless it
      means to (a fault injected by a test).
    every: micro-steps between calls: called after each update that reaches a
      multiple of it (one micro-step an update without accumulation; the last
      step always calls it).
    at_start: also call it at step 0 of a fresh run (after its validation).
    wait: call it with the training clock paused, once the dispatched steps
      are done (evaluations, probes, checkpoints); False: at once, the step
      just dispatched (its time counts as training).
    on: ``'step'``, after a step; ``'save'``, after each checkpoint save
      starts (``every`` then counts micro-steps as well).

  The loop's own work is hooks too (:func:`loop_hooks`): the log line, the
  validation, the merge report, the checkpoint.
  """
  fn: tp.Callable[[tp.Any], dict | None]
  every: int = 1
  at_start: bool = False
  wait: bool = True
  on: str = 'step'

  def __post_init__(self):
    if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
      raise ValueError(f'Hook every must be an int >= 1, got {self.every!r}')
    if self.on not in ('step', 'save'):
      raise ValueError(f"Hook on must be 'step' or 'save', got {self.on!r}")

  def due(self, step: int, last: bool, stride: int = 1) -> bool:
    """Whether the loop, having just reached micro-step ``step`` by
    ``stride`` micro-steps (one update of ``grad_accum`` micro-batches),
    passed a multiple of ``every``."""
    return last or crossed(step, self.every, stride)


def crossed(step: int, every: int, stride: int = 1) -> bool:
  """Whether a multiple of ``every`` lies in ``(step - stride, step]``."""
  return step // every > (step - stride) // every
