"""The gradients of a train step (:func:`poetx_jax.make_train_step`): of one
batch, of micro-batches accumulated in one program, and per device with one
mean over devices."""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx

from poetx_jax.convert import path_str


def value_and_grad(loss_fn: tp.Callable, has_aux: bool,
                    data_parallel: jax.sharding.Mesh | None,
                    loss_weight: tp.Callable | None, accumulate: int = 1) -> tp.Callable:
  """``value_and_grad(model, batch)`` of ``loss_fn``: ``nnx.value_and_grad``,
  or with ``data_parallel`` per device and averaged (:func:`_per_device_grads`);
  with ``accumulate`` > 1 over the batch's micro-batches (:func:`_accumulated`)."""
  if data_parallel is None:
    if accumulate > 1:
      return _accumulated(loss_fn, loss_weight, accumulate, mutable=True)
    return nnx.value_and_grad(loss_fn, has_aux=has_aux)
  if has_aux:
    raise ValueError('data_parallel does not take has_aux=True (auxiliary outputs '
                     'cannot be averaged over devices in general)')
  return _per_device_grads(loss_fn, data_parallel, loss_weight, accumulate)


def _accumulated(loss_fn: tp.Callable, loss_weight: tp.Callable | None, accumulate: int,
                 mutable: bool) -> tp.Callable:
  """``value_and_grad(model, batches) -> ((loss, grads), weight)`` over the
  micro-batches stacked on the leading axis of ``batches``, one at a time
  (``jax.lax.scan``): the weighted sums of each micro-batch's loss and
  gradients (weights ``loss_weight(micro_batch)``, or 1 each) and the sum of
  the weights, nothing divided yet (each product in float32, the sums in the
  gradients' dtype). ``batches``' leading axis must be ``accumulate`` long.
  ``mutable``: variables other than ``nnx.Param`` the loss writes (RNG
  counters, say) carry from one micro-batch to the next and are written
  back; otherwise such a write is refused (:func:`_refuse_state_changes`)."""

  def value_and_grad(model, batches):
    lengths = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(batches)}
    if lengths != {accumulate}:
      raise ValueError(f'make_train_step(accumulate={accumulate}) takes a batch whose every '
                       f'array has a leading axis of {accumulate} micro-batches; got leading '
                       f'lengths {sorted(lengths, key=str)}')
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def pure_loss(params, rest, batch):
      # Variables of this trace: the loss may write those of ``rest``.
      m = nnx.merge(graphdef, params, jax.tree.map(lambda a: a, rest))
      before = None if mutable else _raw_values(m)
      loss = loss_fn(m, batch)
      if not mutable:
        _refuse_state_changes(before, _raw_values(m))
      return loss, (nnx.split(m, nnx.Param, ...)[2] if mutable else rest)

    def micro(carry, batch):
      loss_sum, grad_sum, weight_sum, rest = carry
      (loss, rest), grads = jax.value_and_grad(pure_loss, has_aux=True)(params, rest, batch)
      w = (jnp.ones((), jnp.float32) if loss_weight is None
           else jnp.asarray(loss_weight(batch), jnp.float32))
      grad_sum = jax.tree.map(lambda s, g: s + (w * g.astype(jnp.float32)).astype(s.dtype),
                              grad_sum, grads)
      return (loss_sum + w * loss.astype(jnp.float32), grad_sum, weight_sum + w, rest), None

    zero = jnp.zeros((), jnp.float32)
    grad_zero = jax.tree.map(jnp.zeros_like, params)
    (loss, grads, weight, rest), _ = jax.lax.scan(micro, (zero, grad_zero, zero, rest),
                                                  batches)
    if mutable:
      nnx.update(model, rest)
    return (loss, grads), weight

  if mutable:  # one device, or the compiler's partitioning: the mean here
    def mean(model, batches):
      (loss, grads), weight = value_and_grad(model, batches)
      return _divided((loss, grads), weight)
    return mean
  return value_and_grad


def _divided(out, weight):
  """``(loss, grads)`` sums over their ``weight``: the mean, each array in its
  dtype (divided in float32)."""
  weight = jnp.maximum(weight, 1e-30)
  return jax.tree.map(lambda a: (a.astype(jnp.float32) / weight).astype(a.dtype), out)


def _per_device_grads(loss_fn: tp.Callable, mesh: jax.sharding.Mesh,
                      loss_weight: tp.Callable | None, accumulate: int = 1) -> tp.Callable:
  """``value_and_grad(loss_fn)`` with each device on its rows, then one mean
  over devices (weighted by ``loss_weight`` of their rows, if given) of
  exactly the trainable arrays: the compiler's own partitioning would reduce
  the POET generators' gradients as full B x B blocks, twice their size.
  With ``accumulate`` > 1 each device first sums its micro-batches
  (:func:`_accumulated`), and the devices average once."""
  from jax.sharding import PartitionSpec as P
  axes = tuple(mesh.axis_names)
  summed = (_accumulated(loss_fn, loss_weight, accumulate, mutable=False) if accumulate > 1
            else None)

  def value_and_grad(model, batch):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def local(params, rest, batch):
      local_model = nnx.merge(graphdef, params, rest)
      if summed is not None:  # one crossing: the sums, then the mean
        out, weight = jax.lax.psum(summed(local_model, batch), axes)
        return _divided(out, weight)
      before = _raw_values(local_model)
      out = nnx.value_and_grad(loss_fn)(local_model, batch)
      _refuse_state_changes(before, _raw_values(local_model))
      if loss_weight is None:
        return jax.lax.pmean(out, axes)
      w = jnp.asarray(loss_weight(batch), jnp.float32)
      share = w / jnp.maximum(jax.lax.psum(w, axes), 1e-30)  # this device's share
      return jax.lax.psum(jax.tree.map(lambda a: a * share.astype(a.dtype), out), axes)

    rows = P(None, axes) if summed is not None else P(axes)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), rows), out_specs=P(),
                         check_vma=False)(params, rest, batch)

  return value_and_grad


def _raw_values(model) -> dict:
  """Each non-``nnx.Param`` variable's array, by path (as read, not copied)."""
  return {path: v.get_raw_value() if isinstance(v, nnx.Variable) else v
          for path, v in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Param)))}


def _refuse_state_changes(before: dict, after: dict) -> None:
  """Raises if the loss wrote any variable that is not an ``nnx.Param``
  (``data_parallel`` returns only the loss and the gradients, so the write
  would be lost on every device, silently)."""
  changed = [path_str(path) for path, a in after.items()
             if path not in before or a is not before[path]]
  if changed:
    raise ValueError(
        f'make_train_step(data_parallel=...): the loss changes state that is not an '
        f'nnx.Param, which the data-parallel gradients would drop on every device: '
        f'{", ".join(changed[:8])}{" ..." if len(changed) > 8 else ""} (batch statistics '
        f'or RNG counters, e.g. of BatchNorm or Dropout); leave data_parallel unset '
        f'(the compiler then partitions the step) or make those layers deterministic')
