"""Model-level conversion: poetize, merge, unpoetize, effective_kernel."""

from __future__ import annotations

import functools
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx

from poetx_jax.linear import POETLinear

Array = jax.Array


def _path_str(path) -> str:
  return '/'.join(str(p) for p in path)


def poetize(model, *, block_size: int, rngs: nnx.Rngs,
            exclude: tp.Sequence[str] = ('lm_head',), normalize_rows: bool = False,
            consume: bool = False, **layer_kwargs):
  """Returns a copy of ``model`` with every ``nnx.Linear`` made a ``POETLinear``.

  Each replacement keeps the state path of the layer it replaces and starts
  equal to it (Q = 0), with its kernel as W0 and its bias.

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
    The converted model (the input is left unchanged unless ``consume``).

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
    name = _path_str(path)
    if any(e in name for e in exclude):
      return node
    try:
      layer = POETLinear.from_linear(node, block_size=block_size, rngs=rngs,
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

  return nnx.recursive_map(convert, model)


def poet_layers(model) -> list[tuple[str, POETLinear]]:
  """All POETLinear layers of ``model`` as (path, layer), in graph order."""
  return [(_path_str(p), n) for p, n in nnx.iter_graph(model)
          if isinstance(n, POETLinear)]


def merge(model, *, rngs: nnx.Rngs | Array) -> Array:
  """Merge-then-reinitialise every POET layer of ``model`` in place.

  ``W0 <- R W0 P``, new random permutations, ``Q <- 0``: the model computes the
  same function before and after (up to rounding into W0's dtype), and the
  rotations restart at the identity. Reset the POET optimizer moments at the
  same step (``poetx`` does this on its own counter).

  Called outside jit, each layer merges in its own compiled program, shared by
  all layers of the same shape and options (a Llama compiles a handful, however
  deep), keeping the layer's shardings; a layer's old buffers are released as
  it is updated, so the merge needs one layer's scratch memory, not a second
  model. The layers of a ``StackedLayers`` merge one after another inside one
  program that updates the stack in place: its old buffers are donated, so
  arrays read from a stacked layer before the merge are invalid after it.
  Under jit it traces inline.

  Args:
    model: a model containing POETLinear layers.
    rngs: an ``nnx.Rngs`` (its ``params`` stream is used) or a PRNG key.

  Returns:
    The largest :meth:`POETLinear.orthogonality_error` of the merged factors
    (a float32 scalar array; reading it waits for the merge). A few 1e-2 or
    less while training is healthy (largest per run: 9e-3 to 3.5e-2 in the
    Llama-130M runs of docs/quality.md; ``poetx train`` warns above 0.1);
    near or above 1 the generators have left the Cayley–Neumann series'
    region of convergence (a learning rate too large for the block size).
  """
  key = rngs.params() if isinstance(rngs, nnx.Rngs) else rngs
  traced = isinstance(key, jax.core.Tracer)
  errors = []
  for i, (_, layer) in enumerate(poet_layers(model)):
    k = jax.random.fold_in(key, i)
    errors.append(layer.merge(k) if traced else _merge_compiled(layer, k))
  return jnp.max(jnp.stack(errors)) if errors else jnp.zeros((), jnp.float32)


def _merge_compiled(layer: POETLinear, key: Array) -> Array:
  graphdef, state = nnx.split(layer)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  leaves, treedef = jax.tree.flatten(shardings)
  fn = _merge_program(graphdef, treedef, tuple(leaves), bool(layer.stack_shape))
  state, error = fn(state, key)
  nnx.update(layer, state)
  return error


@functools.lru_cache(maxsize=64)
def _merge_program(graphdef, treedef, sharding_leaves, donate):
  def run(state, key):
    layer = nnx.merge(graphdef, state)
    error = layer.merge(key)
    return nnx.state(layer), error

  if all(isinstance(s, jax.sharding.SingleDeviceSharding) for s in sharding_leaves):
    out = None  # as the update step leaves them: a pinned sharding would retrace it
  else:
    shardings = jax.tree.unflatten(treedef, list(sharding_leaves))
    mesh = next(s.mesh for s in sharding_leaves if isinstance(s, jax.sharding.NamedSharding))
    out = (shardings, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  # A stack of layers is donated and updated in place, one layer's scratch at
  # a time (not donated, it would need a second copy of its base weights).
  return jax.jit(run, out_shardings=out, donate_argnums=0 if donate else ())


def unpoetize(model):
  """Returns a copy of ``model`` with each POETLinear replaced by an
  ``nnx.Linear`` holding its effective kernel ``(R W0 P)^T``: zero POET
  overhead for inference and export."""

  def convert(path, node):
    return node.to_linear() if isinstance(node, POETLinear) else node

  return nnx.recursive_map(convert, model)


def effective_kernel(layer: POETLinear) -> Array:
  """``(R W0 P)^T`` of one POET layer, (in, out) float32."""
  return layer.effective_kernel()
