"""Whole models and stacks of layers: poetize, unpoetize, effective kernels.

* :func:`poetize` turns every ``nnx.Linear`` of a model into a
  :class:`~poetx_jax.POETLinear`, :func:`unpoetize` turns them back into plain
  ``nnx.Linear`` layers holding ``R W0 P``.
* :func:`effective_kernel`, :func:`orthogonality_error` and :func:`to_linear`
  work on one POET layer or on a stack of them (a ``POETLinear`` whose
  variables carry a leading layer axis, as in a scanned model):
  :func:`for_each_layer` runs a per-layer function over a stack one layer at
  a time, so the scratch memory is one layer's.

The merge cycle (:func:`poetx_jax.merge`) is in :mod:`poetx_jax.cycle`.
"""

from __future__ import annotations

import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx.nn import initializers

from poetx_jax import ops
from poetx_jax.linear import POETLinear, carry_sharding, check_linear_products

Array = jax.Array


def path_str(path) -> str:
  """A graph path as the '/'-joined string ``poetize`` and ``poet_layers`` use."""
  return '/'.join(str(p) for p in path)


def poetize(model, *, block_size: int, rngs: nnx.Rngs,
            exclude: tp.Sequence[str] = ('lm_head',), normalize_rows: bool = False,
            consume: bool = False, **layer_kwargs):
  """Returns a copy of ``model`` with every ``nnx.Linear`` made a ``POETLinear``.

  Each replacement keeps the state path of the layer it replaces and starts
  equal to it (Q = 0), with its kernel as W0 and its bias. Only layers of type
  exactly ``nnx.Linear`` are converted: subclasses (such as the router of
  :mod:`poetx_jax.models.moe`) stay as they are. A Linear whose kernel has
  leading axes, ``(..., in, out)`` (a stack of layers, such as the experts of
  :mod:`poetx_jax.models.moe`), becomes a POETLinear stack with those leading
  axes (:func:`stack_from_linear`): each entry its own W0, permutations and
  generators (and bias: one shared by the stack, ``(O,)``, is refused).

  Args:
    model: any Flax NNX model.
    block_size: B for every converted layer; layers with a dimension smaller
      than B raise (exclude them).
    rngs: draws the initial permutations.
    exclude: a layer whose path ('/'-joined) contains any of these strings
      stays an ``nnx.Linear``. Default: ``('lm_head',)``.
    normalize_rows: scale each output row of each W0 to unit norm (the
      published POET-X default on conversion).
    consume: free each converted layer's kernel (``jax.Array.delete``) as soon
      as its POETLinear holds the permuted copy, so converting needs one
      layer's memory beyond the model instead of a second model. The input
      model is unusable afterwards. Default False.
    **layer_kwargs: passed to :class:`POETLinear` (``terms``, ``mode``, ...).

  Returns:
    The converted model. Unless ``consume``, it shares no Variable or array
    with the input (the layers not converted are copies), so the input stays
    usable, and unchanged, while the result trains.

  Example::

    >>> from flax import nnx
    >>> import poetx_jax
    >>> mlp = nnx.Sequential(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), nnx.relu,
    ...                      nnx.Linear(64, 8, rngs=nnx.Rngs(1)))
    >>> poet = poetx_jax.poetize(mlp, block_size=8, rngs=nnx.Rngs(2))
    >>> [path for path, _ in poetx_jax.poet_layers(poet)]
    ['layers/0', 'layers/2']
  """
  if isinstance(exclude, str):
    exclude = (exclude,)

  def convert(path, node):
    if type(node) is not nnx.Linear:
      return node
    name = path_str(path)
    if any(e in name for e in exclude):
      return node
    from_linear = stack_from_linear if node.kernel.ndim > 2 else POETLinear.from_linear
    try:
      layer = from_linear(node, block_size=block_size, rngs=rngs,
                          normalize_rows=normalize_rows, **layer_kwargs)
    except ValueError as e:
      raise ValueError(f'cannot poetize layer {name!r} '
                       f'(kernel {node.kernel.shape}): {e}') from e
    if consume:
      old = node.kernel[...]
      if (not isinstance(old, jax.core.Tracer)  # traced: nothing to free
          and all(old is not x for x in jax.tree.leaves(nnx.state(layer)))):
        old.delete()
    return layer

  converted = nnx.recursive_map(convert, model)
  return converted if consume else _detached(converted, model)


def _detached(new, old):
  """``new`` with none of ``old``'s Variables or JAX arrays: each array the
  two share is copied (once, however many of ``new``'s Variables hold it), so
  training ``new`` (whose step may donate its buffers) leaves ``old`` usable
  and unchanged. Values that are not JAX arrays are kept as they are."""
  old_arrays = [x for x in jax.tree.leaves(nnx.state(old)) if isinstance(x, jax.Array)]
  copies = {id(x): None for x in old_arrays}  # old_arrays holds them: their ids stay theirs

  def own(x):
    if not isinstance(x, jax.Array) or id(x) not in copies:
      return x
    if copies[id(x)] is None:
      copies[id(x)] = jnp.copy(x)
    return copies[id(x)]

  graphdef, state = nnx.split(new)
  return nnx.merge(graphdef, jax.tree.map(own, state))


def stack_from_linear(linear: nnx.Linear, *, block_size: int, rngs: nnx.Rngs,
                      **kwargs) -> POETLinear:
  """A POETLinear stack from an ``nnx.Linear`` whose kernel has leading axes.

  ``linear.kernel`` (..., I, O) (and its bias (..., O)) holds one layer per
  index of the leading axes; entry ``idx`` of the result is
  ``POETLinear.from_linear`` of layer ``idx`` (layers in row-major order, each
  drawing its permutations from ``rngs`` in turn), so its ``stack_shape`` is
  the leading axes. The kernel's ``layer_axis`` metadata (a scanned stack's)
  is copied to every variable of the result, and the kernel's and bias's
  sharding annotations to the stack's kernel and bias; product options are
  refused as by ``from_linear``. ``kwargs``: as for ``from_linear``.

  A bias shared by the whole stack (shape ``(O,)`` beside a ``(..., I, O)``
  kernel) is refused, as is any bias not shaped ``(..., O)``: every variable
  of a POET stack is per layer, so a shared bias could only become one copy
  per layer, each then trained on its own, a different model from the one
  converted (and no longer one parameter when converted back). Give the
  Linear a bias per layer (``jnp.broadcast_to(bias, lead + bias.shape)``) if
  that is what you want, or exclude it from :func:`poetize`.
  """
  kernel = linear.kernel[...]
  if kernel.ndim < 3:
    raise ValueError(f'a stack needs a kernel with leading axes (..., in, out), '
                     f'got shape {kernel.shape}')
  check_linear_products(linear)
  lead = kernel.shape[:-2]
  bias = linear.bias[...] if linear.bias is not None else None
  if bias is not None and bias.shape != lead + kernel.shape[-1:]:
    shared = ' (one bias shared by every layer)' if bias.shape == kernel.shape[-1:] else ''
    raise ValueError(
        f'a stack of kernels {kernel.shape} needs a bias per layer, shape '
        f'{lead + kernel.shape[-1:]}; got {bias.shape}{shared}. A POET stack trains '
        f'every variable per layer: broadcast the bias to {lead + kernel.shape[-1:]} '
        f'for a bias per layer, or exclude the layer from poetize')
  graphdef, states = None, []
  for idx in np.ndindex(*lead):
    one = nnx.Linear(kernel.shape[-2], kernel.shape[-1], use_bias=bias is not None,
                     dtype=linear.dtype, param_dtype=kernel.dtype,
                     precision=linear.precision, kernel_init=lambda *_: kernel[idx],
                     bias_init=lambda *_: bias[idx], rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(POETLinear.from_linear(one, block_size=block_size,
                                                       rngs=rngs, **kwargs))
    states.append(state)
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs).reshape(lead + xs[0].shape), *states)
  layer = nnx.merge(graphdef, stacked)
  meta = {k: v for k, v in linear.kernel.get_metadata().items() if k == 'layer_axis'}
  if meta:
    for _, v in nnx.iter_graph(layer):
      if isinstance(v, nnx.Variable):
        v.set_metadata(**meta)
  carry_sharding(linear, layer)
  return layer


def poet_layers(model) -> list[tuple[str, POETLinear]]:
  """All POETLinear layers of ``model`` as (path, layer), in graph order."""
  return [(path_str(p), n) for p, n in nnx.iter_graph(model)
          if isinstance(n, POETLinear)]


def check_permutations(model) -> None:
  """Raises ValueError naming the first POET layer of ``model`` whose
  permutations are not what it draws: index arrays of a permutation of its
  features, and for ``permutation='chunk'`` chunk permutations of its chunk
  size (:func:`poetx_jax.ops.is_chunk_permutation`), which its gathers take
  on trust. Reads the values (e.g. after a checkpoint is restored); arrays
  not all on this process are skipped."""
  for path, layer in poet_layers(model):
    for side, var in (('perm_in', layer.perm_in), ('perm_out', layer.perm_out)):
      perm = var[...]
      if isinstance(perm, jax.core.Tracer) or (
          isinstance(perm, jax.Array) and not perm.is_fully_addressable):
        continue
      if not ops.is_chunk_permutation(np.asarray(perm), layer.chunk):
        what = ('a permutation of its features' if layer.chunk == 1 else
                f'a chunk permutation of runs of {layer.chunk} features')
        raise ValueError(f'POET layer {path!r}: its {side} is not {what} (permutation='
                         f'{layer.permutation!r}, chunk_size={layer.chunk_size}); was the '
                         f'state written by a model that draws its permutations otherwise?')


def for_each_layer(layer: POETLinear, fn: tp.Callable, *args, update: bool = False):
  """``fn(one_layer, *args)`` on each layer of a stack in turn, or on ``layer``.

  One layer at a time (a loop, not vmap), so the scratch memory is one
  layer's; a stack with several leading axes (layers of experts, (L, E))
  loops over each in turn. ``args`` are stacked like the layers. With ``update``, fn may
  change its layer and the stack takes the new state, written back in place
  (when the caller's buffers are donated). Returns fn's outputs, stacked.
  """
  stack = layer.stack_shape
  if not stack:
    return fn(layer, *args)
  graphdef, state = nnx.split(layer)

  def one(layer_state, a):  # nested stacks ((L, E) ...): one leading axis per level
    one_layer = nnx.merge(graphdef, layer_state)
    out = for_each_layer(one_layer, fn, *a, update=update)
    return nnx.state(one_layer), out

  if not update:
    return jax.lax.map(lambda xs: one(*xs)[1], (state, args))

  def body(state, xs):  # the stack is the carry: each layer written back in place
    i, a = xs
    new, out = one(jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(
        x, i, 0, keepdims=False), state), a)
    return jax.tree.map(lambda s, v: jax.lax.dynamic_update_index_in_dim(s, v, i, 0),
                        state, new), out

  state, outs = jax.lax.scan(body, state, (jnp.arange(stack[0]), args))
  nnx.update(layer, state)
  return outs


def effective_kernel(layer: POETLinear) -> Array:
  """``(R W0 P)^T`` of a POET layer, (in, out) float32; a stack of layers
  gives the stacked kernels (its leading axes first)."""
  return for_each_layer(layer, lambda one: one.effective_kernel())


def orthogonality_error(layer: POETLinear) -> Array:
  """:meth:`POETLinear.orthogonality_error`, the largest over a stack."""
  return jnp.max(for_each_layer(layer, lambda one: one.orthogonality_error()))


def to_linear(layer: POETLinear, *, rngs: nnx.Rngs | None = None) -> nnx.Linear:
  """A plain ``nnx.Linear`` holding the effective kernel (in the base's dtype);
  a stack of layers gives a stacked Linear (kernel with the same leading axes,
  keeping the stack's ``layer_axis`` tag)."""
  kernel = effective_kernel(layer).astype(layer.param_dtype)
  bias = layer.bias[...] if layer.bias is not None else None
  linear = nnx.Linear(
      layer.in_features, layer.out_features, use_bias=bias is not None,
      dtype=layer.dtype, param_dtype=kernel.dtype, precision=layer.precision,
      kernel_init=lambda *_: kernel,
      bias_init=(lambda *_: bias) if bias is not None else initializers.zeros_init(),
      rngs=rngs if rngs is not None else nnx.Rngs(0))
  if layer.stack_shape:  # keep the stack's tag (read by poetx_jax.sharding)
    for v in (linear.kernel, linear.bias):
      if v is not None:
        v.set_metadata(layer_axis=layer.kernel.get_metadata().get('layer_axis', 0))
  return linear


def unpoetize(model, *, detach: bool = True):
  """Returns a copy of ``model`` with each POETLinear replaced by an
  ``nnx.Linear`` holding its effective kernel ``(R W0 P)^T``: zero POET
  overhead for inference and export. The copy shares no Variable or array
  with ``model``, which may go on training; ``detach=False`` lets the layers
  not converted (embeddings, norms, head) share them, for a copy made only
  to be read once (an export), without their memory twice."""

  def convert(path, node):
    return to_linear(node) if isinstance(node, POETLinear) else node

  converted = nnx.recursive_map(convert, model)
  return _detached(converted, model) if detach else converted
