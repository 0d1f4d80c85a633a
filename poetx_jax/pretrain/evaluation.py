"""Validation: a model's mean loss per target token and perplexity over
batches (:func:`evaluate`), and batches placed on the devices
(:func:`place_batch`).

A batch is ``{'inputs': (B, L) int32, 'targets': (B, L) int32}``; targets
``-1`` are masked (padding) and count nowhere; the loss is
:func:`~poetx_jax.pretrain.loss.token_loss`.
"""

from __future__ import annotations

import math
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx

from poetx_jax import sharding
from poetx_jax.pretrain.loss import token_loss


def place_batch(batch, mesh, axis: int = 0):
  """This process's batch -> device arrays (the global batch over the mesh,
  split on ``axis``: 1 for micro-batches stacked on a leading axis)."""
  if mesh is None:
    return jax.tree.map(jnp.asarray, batch)
  return sharding.shard_batch(batch, mesh, axis=axis)


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
