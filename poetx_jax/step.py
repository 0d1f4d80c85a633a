"""A ready train step: gradients, optimizer update and merge-when-due in one jit."""

from __future__ import annotations

import typing as tp

import jax
from flax import nnx

from poetx_jax.convert import merge
from poetx_jax.optim import merge_due


def make_train_step(loss_fn: tp.Callable, *, seed: int = 0, has_aux: bool = False,
                    donate: bool = True) -> tp.Callable:
  """Builds ``step(model, optimizer, batch) -> loss`` (jitted, state donated).

  One call computes ``nnx.value_and_grad(loss_fn)(model, batch)`` (all
  ``nnx.Param``s, POET generators included; the frozen base weights get no
  gradient), applies ``optimizer.update``, and — when that update completed a
  merge cycle of the :func:`poetx_jax.poetx` optimizer inside it (see
  :func:`poetx_jax.merge_due`) — merges every POET layer under ``lax.cond``.
  The permutation key of each merge is ``fold_in(key(seed), optimizer.step)``,
  so a resumed run draws the permutations an uninterrupted one would.

  Example::

    step = make_train_step(lambda m, b: ((m(b['x']) - b['y']) ** 2).mean())
    for batch in batches:
      loss = step(model, optimizer, batch)

  Args:
    loss_fn: ``loss_fn(model, batch)`` returning a scalar loss, or
      ``(loss, aux)`` with ``has_aux=True``.
    seed: seeds the merge permutations.
    has_aux: whether ``loss_fn`` returns auxiliary outputs (returned as well).
    donate: donate model and optimizer buffers to the step.

  Returns:
    The step function; it returns the loss (and aux) before the update.
  """
  base_key = jax.random.key(seed)

  def step(model, optimizer: nnx.Optimizer, batch):
    out, grads = nnx.value_and_grad(loss_fn, has_aux=has_aux)(model, batch)
    old_state = nnx.as_pure(optimizer.opt_state)
    optimizer.update(model, grads)
    due = merge_due(old_state, nnx.as_pure(optimizer.opt_state))
    key = jax.random.fold_in(base_key, optimizer.step[...])

    def do_merge(m, k):
      merge(m, rngs=k)

    nnx.cond(due, do_merge, lambda m, k: None, model, key)
    return out

  return nnx.jit(step, donate_argnums=(0, 1) if donate else ())
