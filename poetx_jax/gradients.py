"""The gradients of a train step (:func:`poetx_jax.make_train_step`): of one
batch, of micro-batches accumulated in one program, and per device with one
mean over devices."""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx

from poetx_jax import sharding
from poetx_jax.convert import path_str
from poetx_jax.linear import pinned_activations


def value_and_grad(loss_fn: tp.Callable, has_aux: bool,
                    data_parallel: jax.sharding.Mesh | None,
                    loss_weight: tp.Callable | None, accumulate: int = 1,
                    fully_sharded: jax.sharding.Mesh | None = None) -> tp.Callable:
  """``value_and_grad(model, batch)`` of ``loss_fn``: ``nnx.value_and_grad``,
  or with ``data_parallel`` per device and averaged (:func:`_per_device_grads`),
  or with ``fully_sharded`` per device and reduced to the parameters'
  shards (:func:`_per_device_sharded`); with ``accumulate`` > 1 over the
  batch's micro-batches (:func:`_accumulated`)."""
  if data_parallel is not None and fully_sharded is not None:
    raise ValueError('data_parallel and fully_sharded exclude each other: the training '
                     'state is either replicated over the mesh or sharded over it')
  if fully_sharded is not None:
    if has_aux:
      raise ValueError('fully_sharded does not take has_aux=True (auxiliary outputs '
                       'cannot be averaged over devices in general)')
    return _per_device_sharded(loss_fn, fully_sharded, loss_weight, accumulate)
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
    _check_micro_batches(batches, accumulate)
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


def _check_micro_batches(batches, accumulate: int) -> None:
  """Raises unless every array of ``batches`` has a leading axis of
  ``accumulate`` micro-batches."""
  lengths = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(batches)}
  if lengths != {accumulate}:
    raise ValueError(f'make_train_step(accumulate={accumulate}) takes a batch whose every '
                     f'array has a leading axis of {accumulate} micro-batches; got leading '
                     f'lengths {sorted(lengths, key=str)}')


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


def _per_device_sharded(loss_fn: tp.Callable, mesh: jax.sharding.Mesh,
                        loss_weight: tp.Callable | None, accumulate: int = 1) -> tp.Callable:
  """``value_and_grad(loss_fn)`` of a model whose arrays are sharded over
  ``mesh`` (fsdp), each batch's rows split over all its axes: each device
  computes the gradients of its own rows, sums them over the update's
  micro-batches in a full-size accumulator of its own, and after the last
  one a single reduction per trainable array (to its own sharding: a
  reduce-scatter where it is sharded) gives the mean. The compiler still
  partitions the model: it gathers each weight where a device needs it.

  Per device means a ``jax.vmap`` over a leading device axis of the rows,
  sharded over the mesh, with the parameters shared (``in_axes=None``): each
  device's gradient is a slice of a ``(devices, *param.shape)`` array that
  the compiler has no reason to reduce until the sum over that axis at the
  end. What crosses is therefore the trainable arrays at their own size
  (the POET-X generators packed, never as dense ``B x B`` blocks), once an
  update, where the compiler's own partitioning of a summed gradient
  reduces every micro-batch's. The trainable arrays are gathered whole once
  before the micro-batches (inside them each would gather them again), and
  every POET layer pins its activations to the device's rows
  (:func:`poetx_jax.linear.pinned_activations`), so that inside the loop
  only the frozen bases cross. The cost is memory: each device holds the
  trainable arrays whole and one full-size gradient of them (for POET-X the
  generators and the embeddings, a small part of the model). Per-device
  weights ``loss_weight`` (or 1 each) weigh the mean, as
  :func:`_per_device_grads` does. A loss that writes variables other than
  ``nnx.Param`` is refused."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  axes = tuple(mesh.axis_names)
  devices = mesh.size
  if axes != sharding.AXES:
    raise ValueError(f'fully_sharded takes a mesh of axes {sharding.AXES} '
                     f'(poetx_jax.sharding.make_mesh), got {axes}')

  def value_and_grad(model, batch):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batches = batch if accumulate > 1 else jax.tree.map(lambda x: x[None], batch)
    _check_micro_batches(batches, accumulate)
    rows = {x.shape[1] for x in jax.tree.leaves(batches)}
    if any(r % devices for r in rows):
      raise ValueError(f'fully_sharded: the rows of a micro-batch ({sorted(rows)}) must split '
                       f'evenly over the mesh\'s {devices} devices')
    split = NamedSharding(mesh, P(None, axes))
    batches = jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(
            x.reshape(x.shape[0], devices, x.shape[1] // devices, *x.shape[2:]), split),
        batches)

    def one(params, rest, rows):  # one device's rows of one micro-batch
      m = nnx.merge(graphdef, params, rest)
      for _, sub in nnx.iter_graph(m):  # a device's rows are its own: not split again
        if getattr(sub, 'carry_sharding', None) is not None:
          sub.carry_sharding = NamedSharding(mesh, P())
      before = _raw_values(m)
      with pinned_activations(NamedSharding(mesh, P())):  # the rows stay on their device
        loss = loss_fn(m, rows)
      _refuse_state_changes(before, _raw_values(m))
      w = (jnp.ones((), jnp.float32) if loss_weight is None
           else jnp.asarray(loss_weight(rows), jnp.float32))
      return w * loss.astype(jnp.float32), w

    # The trainable arrays whole on every device, gathered once an update:
    # gathered inside the loop, each micro-batch would gather them again (the
    # generators as dense blocks, the embedding as partial lookups summed).
    params = jax.tree.map(
        lambda p: jax.lax.with_sharding_constraint(p, NamedSharding(mesh, P())), params)
    each = jax.vmap(jax.value_and_grad(one, has_aux=True), in_axes=(None, None, 0),
                    spmd_axis_name=axes)
    per_device = lambda x: jax.lax.with_sharding_constraint(  # noqa: E731
        x, NamedSharding(mesh, P(axes)))

    def micro(carry, rows):
      loss_sum, grad_sum, weight_sum = carry
      (loss, w), grads = each(params, rest, rows)  # the weighted loss's gradients
      grad_sum = jax.tree.map(lambda s, g: per_device(s + g.astype(s.dtype)), grad_sum, grads)
      return (loss_sum + loss, grad_sum, weight_sum + w), None

    zero = jnp.zeros((devices,), jnp.float32)
    grad_zero = jax.tree.map(
        lambda p: per_device(jnp.zeros((devices, *p.shape), p.dtype)), params)
    (loss, grads, weight), _ = jax.lax.scan(micro, (zero, grad_zero, zero), batches)
    weight = jnp.maximum(weight.sum(), 1e-30)
    specs = [sharding.variable_sharding(v, mesh, 'fsdp').spec for v in jax.tree.leaves(
        nnx.state(model, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable))]
    leaves, tree = jax.tree.flatten(grads)
    sums = _reduced_to_shards(leaves, specs, mesh)
    means = [(g.astype(jnp.float32) / weight).astype(g.dtype) for g in sums]
    return loss.sum() / weight, jax.tree.unflatten(tree, means)

  return value_and_grad


def _reduced_to_shards(per_device: list, specs: list, mesh: jax.sharding.Mesh) -> list:
  """The sums over devices of ``per_device`` arrays (``(devices, *shape)``,
  each device holding its own slice), each left in its ``specs``' sharding,
  in one program: where an array is split over ``fsdp`` a reduce-scatter
  over that axis along its split dimension (then, on the shard, a sum over
  ``data``), elsewhere a sum over both axes. Summed in each array's dtype."""
  from jax.sharding import PartitionSpec as P

  def reduce(*xs):
    out = []
    for x, spec in zip(xs, specs, strict=True):
      x = x[0]  # this device's own sum
      dim = sharding.fsdp_axis(spec)
      if dim is None:
        out.append(jax.lax.psum(x, sharding.AXES))
      else:
        x = jax.lax.psum_scatter(x, 'fsdp', scatter_dimension=dim, tiled=True)
        out.append(jax.lax.psum(x, 'data') if mesh.shape['data'] > 1 else x)
    return tuple(out)

  return list(jax.shard_map(reduce, mesh=mesh, in_specs=tuple(P(sharding.AXES) for _ in specs),
                            out_specs=tuple(specs), check_vma=False)(*per_device))


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
