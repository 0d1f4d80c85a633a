"""A stack of identical layers stored as one module and run with ``lax.scan``."""

from __future__ import annotations

import functools
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Array = jax.Array


@functools.partial(jax.jit, donate_argnums=0)
def _write_layer(stacked: list, leaves: list, i) -> list:
  """``stacked[j][i] = leaves[j]`` for every j, in place (donated)."""
  return [jax.lax.dynamic_update_index_in_dim(s, x, i, 0)
          for s, x in zip(stacked, leaves)]


class StackedLayers(nnx.Module):
  """Identical decoder layers stored as one module and run with ``jax.lax.scan``.

  Every variable of :attr:`layer` carries a leading axis of ``length``: entry
  i is layer i. The forward scans over that axis, so a compiled program holds
  one layer however deep the model (an unrolled Llama's compile time grows
  with its depth: minutes on an H200 for 8B). Indexing and iterating give each
  layer as its own module (a copy), e.g. for export.

  Args:
    make_layer: ``make_layer(i)`` builds layer i; called once per layer, in
      order. Each layer is copied into the stack and its arrays freed before
      the next is built, so building needs one layer's memory beyond the stack.
      Every layer must have the same structure, shapes and dtypes.
    length: number of layers.
    place: ``place(shape)`` gives the sharding of a stacked array of that
      shape, allocated there from the start (a model too large for one device
      is built one layer at a time straight into its shards). None: the
      default device.
  """

  def __init__(self, make_layer: tp.Callable[[int], nnx.Module], length: int, *,
               place: tp.Callable[[tuple], jax.sharding.Sharding] | None = None):
    if not isinstance(length, (int, np.integer)) or length < 1:
      raise ValueError(f'length must be a positive int, got {length!r}')
    graphdef = treedef = stacked = None
    for i in range(length):
      g, state = nnx.split(make_layer(i))
      leaves, t = jax.tree.flatten(state)
      if graphdef is None:
        graphdef, treedef = g, t
        stacked = [jnp.zeros((length,) + x.shape, x.dtype,
                             device=place((length,) + x.shape) if place else None)
                   for x in leaves]
      elif g != graphdef or t != treedef or any(
          x.shape != s.shape[1:] or x.dtype != s.dtype for x, s in zip(leaves, stacked)):
        raise ValueError(f'layer {i} differs in structure, shape or dtype from layer 0; '
                         f'StackedLayers needs identical layers')
      stacked = _write_layer(stacked, leaves, i)
      for x in leaves:
        if not isinstance(x, jax.core.Tracer) and not x.is_deleted():
          x.delete()
    self.layer = nnx.merge(graphdef, jax.tree.unflatten(treedef, stacked))
    for _, v in nnx.iter_graph(self.layer):
      if isinstance(v, nnx.Variable):
        v.set_metadata(layer_axis=0)  # read by poetx_jax.sharding (copied to opt. moments)
    self.length = int(length)
    # The sharding of the activations between layers, pinned in the scan
    # when set (poetx_jax.sharding.shard_state sets it for FSDP: without it
    # XLA 0.11's partitioner fails on the POET layers' backward in the loop).
    self.carry_sharding = None

  def __len__(self) -> int:
    return self.length

  def __getitem__(self, i: int) -> nnx.Module:
    if not -self.length <= i < self.length:
      raise IndexError(f'layer {i} out of range for {self.length} layers')
    graphdef, state = nnx.split(self.layer)
    layer = nnx.merge(graphdef, jax.tree.map(lambda x: x[i], state))
    for _, v in nnx.iter_graph(layer):
      if isinstance(v, nnx.Variable) and v.has_metadata('layer_axis'):
        v.del_metadata('layer_axis')
    return layer

  def __iter__(self):
    return (self[i] for i in range(self.length))

  def __call__(self, h: Array, *args, policy=None, totals=None):
    """``h = layer_i(h, *args)`` for i = 0 .. length-1; ``policy``: a
    ``jax.checkpoint`` policy per layer (None: no rematerialisation).

    With ``totals`` (a pytree), each layer returns ``(h, stats)``, stats like
    ``totals``, and the call returns ``(h, totals + the layers' stats)``."""
    graphdef, state = nnx.split(self.layer)

    pin = ((lambda x: jax.lax.with_sharding_constraint(x, self.carry_sharding))
           if self.carry_sharding is not None else (lambda x: x))

    def body(carry, layer_state):
      h, totals = carry
      out = nnx.merge(graphdef, layer_state)(pin(h), *args)
      if totals is None:
        return (pin(out), None), None
      h, stats = out
      return (pin(h), jax.tree.map(jnp.add, totals, stats)), None

    if policy is not None:
      body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    (h, totals_out), _ = jax.lax.scan(body, (h, totals), state)
    return h if totals is None else (h, totals_out)
