"""Tied permutations: POET layers that share one permutation of a side.

The published POET-X draws every layer's two permutations independently. A
module may instead declare groups of (layer, side) pairs whose features are
the same activations, e.g. the inputs of a block's q, k and v projections,
and :func:`tie_permutations` gives each group one permutation: each layer
still has its own rotation blocks, but the groups' blocks cover the same
features. The module can then gather once where the independent draws
gather once per layer (in the input form: one gather of the q/k/v input
instead of three), and between layers joined by elementwise ops not at all
(SwiGLU's gate and up outputs are already in the down projection's input
order). :func:`poetx_jax.merge` keeps the ties: a group's members take the
permutations its first member draws.

A module declares its groups with a method ``permutation_ties()`` returning
a list of groups, each a list of ``(POETLinear, 'in' | 'out')``, and reads
its attribute ``shares_permutations`` (set by :func:`tie_permutations`) to
use them. ``poetx_jax.models``' Llama attention and SwiGLU MLP do.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx

from poetx_jax.linear import POETLinear

Array = jax.Array
SIDES = ('in', 'out')
Group = tp.Sequence[tuple[POETLinear, str]]


def _declared(module) -> list[tuple[nnx.Module, list[Group]]]:
  """``(module, its groups of POET layers)`` for every sub-module that declares ties."""
  out = []
  for _, m in nnx.iter_graph(module):
    ties = getattr(m, 'permutation_ties', None)
    if isinstance(m, nnx.Module) and callable(ties):
      groups = [list(g) for g in ties()
                if len(g) > 1 and all(isinstance(layer, POETLinear) for layer, _ in g)]
      if groups:
        out.append((m, groups))
  return out


def _perm(layer: POETLinear, side: str) -> nnx.Variable:
  if side not in SIDES:
    raise ValueError(f'a tied side must be one of {SIDES}, got {side!r}')
  return layer.perm_in if side == 'in' else layer.perm_out


def _check_groups(groups: tp.Sequence[Group]) -> None:
  seen = set()
  for group in groups:
    sizes = {_perm(layer, side).shape for layer, side in group}
    if len(sizes) > 1:
      raise ValueError(f'the sides of a tied group must have the same shape; got '
                       f'{sorted(sizes)}')
    for layer, side in group:
      if (id(layer), side) in seen:
        raise ValueError(f"a layer's {side!r} side is in more than one tied group")
      seen.add((id(layer), side))


def _refold(layer: POETLinear, side: str, perm: Array) -> None:
  """Gives ``layer``'s ``side`` the permutation ``perm``, re-folding its base
  so that the layer computes the same function (its generators are zero)."""
  old = _perm(layer, side)[...]
  back = jnp.take_along_axis(jnp.argsort(old, axis=-1).astype(old.dtype), perm, axis=-1)
  kernel = layer.frozen_kernel()
  axis = -2 if side == 'in' else -1
  kernel = jnp.take_along_axis(kernel, jnp.expand_dims(back, -1 if side == 'in' else -2),
                               axis=axis)
  base, scale = layer.encode_base(kernel)
  layer.kernel[...] = base
  if scale is not None:
    layer.kernel_scale[...] = scale
  _perm(layer, side)[...] = jnp.copy(perm)  # a buffer of its own: the state may be donated


def tie_permutations(module):
  """Ties the permutations that ``module``'s sub-modules declare (in place).

  In every group the first member keeps its permutation and the others take
  it, their frozen bases re-folded so that every layer computes the same
  function as before (a POET-XQ base is re-quantised, which rounds it
  again). Then each declaring module's ``shares_permutations``
  is set, so that it runs with fewer gathers. Call it on layers just
  converted (or just merged): their generators must be zero. Stacks of
  layers (a scanned model) are tied layer by layer.

  Not the published POET-X (its permutations are independent draws): the
  groups' rotation blocks cover the same features in every merge cycle.

  Returns:
    ``module``.

  Raises:
    ValueError: a layer's generators are not zero, the sides of a group
      differ in size, or one side is in two groups.
  """
  declared = _declared(module)
  for _, groups in declared:  # all checked before anything changes
    _check_groups(groups)
    for layer in {id(layer): layer for group in groups for layer, _ in group}.values():
      for q in (layer.q_in[...], layer.q_out[...]):
        if not isinstance(q, jax.core.Tracer) and bool(jnp.any(q != 0)):
          raise ValueError('tie_permutations needs POET layers whose generators are zero '
                           '(just converted or just merged): re-folding a base under a '
                           'rotation would change the function')
      if layer.stack_shape and layer.quantize is not None:
        raise ValueError('tie_permutations cannot re-fold a stack of quantised bases; tie '
                         'the layers before stacking them')
  for m, groups in declared:
    for (lead, lead_side), *rest in groups:
      perm = _perm(lead, lead_side)[...]
      for layer, side in rest:
        _refold(layer, side, perm)
    m.shares_permutations = True
  return module


def tied_sides(model) -> dict[tuple[int, str], tuple[POETLinear, str]]:
  """``{(id(layer), side): (leader, leader_side)}`` for every tied side of
  ``model`` but the first of its group: the side whose permutation it takes.
  Only modules whose ``shares_permutations`` is set count."""
  out = {}
  for m, groups in _declared(model):
    if not getattr(m, 'shares_permutations', False):
      continue
    for (lead, lead_side), *rest in groups:
      for layer, side in rest:
        out[(id(layer), side)] = (lead, lead_side)
  return out
