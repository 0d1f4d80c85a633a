"""The loss of a batch, and validation over batches.

A batch is ``{'inputs': (B, L) int32, 'targets': (B, L) int32}``; targets
``-1`` are masked (padding) and count nowhere.
"""

from __future__ import annotations

import math
import typing as tp

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
  """(sum of token cross-entropies, number of target tokens, the model's
  ``aux``); -1 targets masked."""
  logits, aux = model.forward(batch['inputs'])
  return (*_cross_entropy(logits, batch['targets']), aux)


def target_count(batch):
  """The unmasked targets of a batch: what :func:`training_loss` averages over."""
  return jnp.sum(batch['targets'] >= 0)


def training_loss(model, batch):
  """What the train step minimises: the mean cross-entropy over the unmasked
  targets, plus the model's ``aux_loss`` where its ``aux`` has one (a
  mixture-of-experts model's weighted load-balance and router z-losses)."""
  total, count, aux = token_loss(model, batch)
  loss = total / jnp.maximum(count, 1)
  return loss + aux['aux_loss'] if 'aux_loss' in aux else loss


def place_batch(batch, mesh):
  """This process's batch -> device arrays (the global batch over the mesh)."""
  if mesh is None:
    return jax.tree.map(jnp.asarray, batch)
  return sharding.shard_batch(batch, mesh)


_eval_batch = nnx.jit(token_loss)


class Evaluation(tp.NamedTuple):
  """What :func:`evaluate` measures: the mean loss per target token, its
  perplexity and the model's auxiliary outputs on the first batch as plain
  numbers (``{}`` for a dense Llama; a routed model's expert loads), all but
  ``aux_loss``."""
  loss: float
  ppl: float
  aux: dict


def _plain(x):
  x = jax.device_get(x)
  return x.tolist() if getattr(x, 'ndim', 0) else x.item()


def evaluate(model, batches, mesh=None) -> Evaluation:
  """The :class:`Evaluation` of ``model`` over global host ``batches``."""
  total, count, first = 0.0, 0, {}
  for i, b in enumerate(batches):
    b = b if mesh is None else sharding.local_rows(b)
    t, c, aux = _eval_batch(model, place_batch(b, mesh))
    total, count = total + float(t), count + int(c)
    if i == 0:
      first = {k: _plain(v) for k, v in aux.items() if k != 'aux_loss'}
  loss = total / max(count, 1)
  return Evaluation(loss, math.exp(min(loss, 50.0)), first)
