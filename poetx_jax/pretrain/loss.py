"""The training loss of a batch: the mean cross-entropy over its unmasked
targets (plus a mixture-of-experts model's ``aux_loss``), whole or with the
head and loss a chunk of sequence positions at a time.

A batch is ``{'inputs': (B, L) int32, 'targets': (B, L) int32}``; targets
``-1`` are masked (padding) and count nowhere.

    loss = training_loss(model, batch, loss_chunk=0)  # what the train step minimises
    total, count, aux = token_loss(model, batch)      # sums, for validation
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from poetx_jax.models import llama


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


def head_loss(head, h, targets, chunk: int):
  """:func:`_cross_entropy` of ``Llama.head_logits(head, h)`` computed
  ``chunk`` sequence positions at a time, each piece's gradient with it.

  ``head``: a model's :meth:`~poetx_jax.models.llama.Llama.head` (final
  norm, output projection); ``h`` (B, T, H) the last decoder layer's output;
  ``targets`` (B, T) int, -1 masked. Returns ``(sum of token
  cross-entropies, number of target tokens)``, the same values as the whole
  batch at once. The (B, T, V) float32 logits and their softmax are never
  held, only one (B, chunk, V) piece: the forward pass runs each piece's
  backward as it goes (``jax.vjp``, a ``lax.scan`` over the pieces) and keeps
  the gradients for the head's parameters (summed in float32, kept in their
  dtypes) and for ``h`` (its dtype), which the backward scales by the loss's
  cotangent. No logit
  is computed twice. T need not divide by ``chunk`` (the last piece is
  padded with masked targets).
  """
  graphdef, params, rest = nnx.split(head, nnx.Param, ...)
  dtypes = jax.tree.map(lambda p: p.dtype, params)
  b, t, width = h.shape
  pieces = -(-t // chunk)
  pad = pieces * chunk - t

  def split(x, fill):
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.swapaxes(x.reshape(b, pieces, chunk, *x.shape[2:]), 0, 1)

  def piece_loss(params, h_piece, t_piece):
    total, count = _cross_entropy(
        llama.Llama.head_logits(nnx.merge(graphdef, params, rest), h_piece), t_piece)
    return total, count

  def forward(params, h, targets):
    def body(grads, x):
      h_piece, t_piece = x
      total, pull, count = jax.vjp(lambda p, hp: piece_loss(p, hp, t_piece),
                                   params, h_piece, has_aux=True)
      g_params, g_h = pull(jnp.ones_like(total))
      grads = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads, g_params)
      return grads, (total, count, g_h)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    grads, (totals, counts, g_h) = jax.lax.scan(
        body, zeros, (split(h, 0), split(targets, -1)))
    g_h = jnp.swapaxes(g_h, 0, 1).reshape(b, pieces * chunk, width)[:, :t]
    grads = jax.tree.map(lambda g, d: g.astype(d), grads, dtypes)
    return (jnp.sum(totals), jnp.sum(counts)), (grads, g_h)

  @jax.custom_vjp
  def loss(params, h, targets):
    return forward(params, h, targets)[0]

  def backward(res, cotangents):
    grads, g_h = res
    scale = cotangents[0]
    return (jax.tree.map(lambda g: (scale * g.astype(jnp.float32)).astype(g.dtype), grads),
            (scale * g_h.astype(jnp.float32)).astype(g_h.dtype), None)

  loss.defvjp(forward, backward)
  return loss(params, h, targets)


def chunked_token_loss(model, batch, chunk: int):
  """:func:`token_loss` with the head and loss in pieces of ``chunk``
  sequence positions (:func:`head_loss`); ``chunk`` 0: :func:`token_loss`."""
  if not chunk:
    return token_loss(model, batch)
  h, aux = model.features(batch['inputs'])
  return (*head_loss(model.head(), h, batch['targets'], chunk), aux)


def target_count(batch):
  """The unmasked targets of a batch: what :func:`training_loss` averages over."""
  return jnp.sum(batch['targets'] >= 0)


def training_loss(model, batch, loss_chunk: int = 0):
  """What the train step minimises: the mean cross-entropy over the unmasked
  targets, plus the model's ``aux_loss`` where its ``aux`` has one (a
  mixture-of-experts model's weighted load-balance and router z-losses);
  ``loss_chunk`` > 0: the head and loss that many sequence positions at a
  time (:func:`head_loss`), the same loss and gradients."""
  total, count, aux = chunked_token_loss(model, batch, loss_chunk)
  loss = total / jnp.maximum(count, 1)
  return loss + aux['aux_loss'] if 'aux_loss' in aux else loss
