"""The loss of a batch, and validation over batches.

A batch is ``{'inputs': (B, L) int32, 'targets': (B, L) int32}``; targets
``-1`` are masked (padding) and count nowhere.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from poetx_jax import sharding


def _cross_entropy(logits, targets):
  """(sum of token cross-entropies, number of target tokens); -1 targets masked."""
  mask = targets >= 0
  losses = optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), jnp.where(mask, targets, 0))
  return jnp.sum(losses * mask), jnp.sum(mask)


def token_loss(model, batch):
  """(sum of token cross-entropies, number of target tokens); -1 targets masked."""
  return _cross_entropy(model(batch['inputs']), batch['targets'])


def target_count(batch):
  """The unmasked targets of a batch: what :func:`mean_loss` averages over."""
  return jnp.sum(batch['targets'] >= 0)


def mean_loss(model, batch):
  """The mean cross-entropy over the unmasked targets (the training loss)."""
  total, count = token_loss(model, batch)
  return total / jnp.maximum(count, 1)


def training_loss(model, batch):
  """What the train step minimises: :func:`mean_loss`, plus the weighted
  auxiliary losses of a mixture-of-experts model (load balance, router
  z-loss: its ``forward_with_aux``)."""
  if not hasattr(model, 'forward_with_aux'):
    return mean_loss(model, batch)
  logits, aux = model.forward_with_aux(batch['inputs'])
  total, count = _cross_entropy(logits, batch['targets'])
  return total / jnp.maximum(count, 1) + aux['aux_loss']


@nnx.jit
def _routing(model, batch) -> dict:
  _, aux = model.forward_with_aux(batch['inputs'])
  return {k: aux[k] for k in ('tokens_per_expert', 'dropped', 'load_balance', 'z_loss')}


def expert_load(model, batch, mesh=None) -> dict:
  """A mixture-of-experts model's routing on the global host ``batch``:
  ``expert_tokens`` (token slots routed to each expert, summed over layers),
  ``dropped`` (slots over capacity, summed over layers), ``load_balance`` and
  ``router_z_loss`` (means over layers); plain numbers."""
  b = batch if mesh is None else sharding.local_rows(batch)
  r = jax.device_get(_routing(model, place_batch(b, mesh)))
  return {'expert_tokens': [int(x) for x in r['tokens_per_expert']],
          'dropped': int(r['dropped']), 'load_balance': float(r['load_balance']),
          'router_z_loss': float(r['z_loss'])}


def place_batch(batch, mesh):
  """This process's batch -> device arrays (the global batch over the mesh)."""
  if mesh is None:
    return jax.tree.map(jnp.asarray, batch)
  return sharding.shard_batch(batch, mesh)


_eval_sum = nnx.jit(token_loss)


def evaluate(model, batches, mesh=None) -> tuple[float, float]:
  """(mean validation loss per token, perplexity) over global host ``batches``."""
  total, count = 0.0, 0
  for b in batches:
    b = b if mesh is None else sharding.local_rows(b)
    t, c = _eval_sum(model, place_batch(b, mesh))
    total, count = total + float(t), count + int(c)
  loss = total / max(count, 1)
  return loss, math.exp(min(loss, 50.0))
