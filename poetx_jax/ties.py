"""Tied permutations: POET layers that share one permutation of a side.

The published POET-X draws every layer's two permutations independently. A
module may instead declare groups of (layer, side) pairs whose features are
the same activations, e.g. the inputs of a block's q, k and v projections,
and :func:`tie_permutations` gives each group one permutation: each layer
still has its own rotation blocks, but the groups' blocks cover the same
features. Each tied side records its group (``POETLinear.tie_in`` /
``tie_out``), and code that sees a group tied (:func:`tied`) can gather
once where the independent draws gather once per layer (in the input form:
one gather of the q/k/v input instead of three; :func:`poetx_jax.groups.project`),
and between layers joined by elementwise ops not at all (SwiGLU's gate and
up outputs are already in the down projection's input order;
:func:`poetx_jax.swiglu`). :func:`poetx_jax.merge` keeps the ties: a group's
members take the permutation its first member draws, and a merge that holds
only part of a group is refused.

A module declares its groups with a method ``permutation_ties()`` returning
a list of groups, each a list of ``(POETLinear, 'in' | 'out')``.
``poetx_jax.models``' Llama attention and SwiGLU MLP do.
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


def _declared(module) -> list[tuple[str, Group]]:
  """``(name, group)`` for every group of POET layers that a sub-module of
  ``module`` declares; ``name`` (the module's class and the group's index)
  is what a tied side records."""
  out = []
  for _, m in nnx.iter_graph(module):
    ties = getattr(m, 'permutation_ties', None)
    if isinstance(m, nnx.Module) and callable(ties):
      for j, g in enumerate(ties()):
        if len(g) > 1 and all(isinstance(layer, POETLinear) for layer, _ in g):
          out.append((f'{type(m).__name__}.{j}', list(g)))
  return out


def tie_of(layer, side: str) -> str | None:
  """The tied group ``layer``'s ``side`` belongs to, or None (not tied, or not a POET layer)."""
  if not isinstance(layer, POETLinear):
    return None
  return layer.tie_in if side == 'in' else layer.tie_out


def tied(pairs: tp.Sequence[tuple[tp.Any, str]]) -> bool:
  """Whether the ``(layer, side)`` pairs, sides of one declaring module's
  layers, are POET layer sides of one tied group, so that they hold one
  permutation (the record names the group within its module: its class and
  index, alike in every layer of a stack)."""
  names = {tie_of(layer, side) for layer, side in pairs}
  return len(names) == 1 and None not in names


def _perm(layer: POETLinear, side: str) -> nnx.Variable:
  if side not in SIDES:
    raise ValueError(f'a tied side must be one of {SIDES}, got {side!r}')
  return layer.perm_in if side == 'in' else layer.perm_out


def _check_groups(groups: tp.Sequence[Group]) -> None:
  seen = set()  # over every module's groups: a side in two groups would chain them
  for group in groups:
    sizes = {_perm(layer, side).shape for layer, side in group}
    if len(sizes) > 1:
      raise ValueError(f'the sides of a tied group must have the same shape; got '
                       f'{sorted(sizes)}')
    chunks = {layer.chunk for layer, _ in group}
    if len(chunks) > 1:
      raise ValueError(f'the layers of a tied group must draw their permutations alike; '
                       f'got run lengths {sorted(chunks)} (permutation and chunk_size)')
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
  again); every side records its group. Call it on layers just converted
  (or just merged): their generators must be zero (checked on concrete
  values only: under a transformation such as ``jax.jit`` it is the
  caller's to ensure). A stack of layers (a scanned model) is tied layer by
  layer; tie a stack of POET-XQ layers before stacking it.

  Not the published POET-X (its permutations are independent draws): the
  groups' rotation blocks cover the same features in every merge cycle. A
  group's layers must draw alike (one ``permutation`` and chunk size): a
  group of chunk layers shares one chunk permutation.

  Returns:
    ``module``.

  Raises:
    ValueError: a layer's generators are not zero, the sides of a group
      differ in size or in how they draw (element or chunk permutations of
      another run length), one side is in two groups, or a stack of POET-XQ
      layers would need re-folding. Nothing is changed then.
  """
  declared = _declared(module)
  _check_groups([group for _, group in declared])  # all checked before anything changes
  for layer in {id(layer): layer for _, group in declared for layer, _ in group}.values():
    for q in (layer.q_in[...], layer.q_out[...]):
      if not isinstance(q, jax.core.Tracer) and bool(jnp.any(q != 0)):
        raise ValueError('tie_permutations needs POET layers whose generators are zero '
                         '(just converted or just merged): re-folding a base under a '
                         'rotation would change the function')
    if layer.stack_shape and layer.quantize is not None:
      raise ValueError('tie_permutations cannot re-fold a stack of quantised bases; tie '
                       'the layers before stacking them')
  for name, ((lead, lead_side), *rest) in declared:
    perm = _perm(lead, lead_side)[...]
    for layer, side in rest:
      _refold(layer, side, perm)
    for layer, side in ((lead, lead_side), *rest):
      setattr(layer, 'tie_in' if side == 'in' else 'tie_out', name)
  return module


def tied_sides(model) -> tuple[dict[tuple[int, str], tuple[POETLinear, str]], set]:
  """The tied groups of ``model`` (declared by its modules, every side
  recording the group): ``({(id(layer), side): (leader, leader_side)}, ...)``
  for every tied side, the group's first member its own leader, and the set
  of ``(id(layer), side)`` of sides whose group's declaring module is not in
  ``model`` (a merge of only part of a group)."""
  out = {}
  for _, group in _declared(model):
    if tied(group):
      for layer, side in group:
        out[(id(layer), side)] = group[0]
  partial = {(id(layer), side) for _, layer in nnx.iter_graph(model)
             if isinstance(layer, POETLinear) for side in SIDES
             if tie_of(layer, side) is not None and (id(layer), side) not in out}
  return out, partial
