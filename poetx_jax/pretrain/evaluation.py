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


def token_loss(model, batch):
  """(sum of token cross-entropies, number of target tokens); -1 targets masked."""
  logits = model(batch['inputs']).astype(jnp.float32)
  targets = batch['targets']
  mask = targets >= 0
  losses = optax.softmax_cross_entropy_with_integer_labels(
      logits, jnp.where(mask, targets, 0))
  return jnp.sum(losses * mask), jnp.sum(mask)


def target_count(batch):
  """The unmasked targets of a batch: what :func:`mean_loss` averages over."""
  return jnp.sum(batch['targets'] >= 0)


def mean_loss(model, batch):
  """The mean cross-entropy over the unmasked targets (the training loss)."""
  total, count = token_loss(model, batch)
  return total / jnp.maximum(count, 1)


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
