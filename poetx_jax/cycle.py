"""The POET-X merge cycle.

Every ``merge_every`` optimizer updates, each POET layer folds its rotations
into its frozen base and starts over,

    W0 <- R W0 P,    Phi_I, Phi_O <- new random permutations,    Q <- 0,

so the layer computes the same function and its rotations restart at the
identity, and the Adam moments of the generators restart with them. Three
parts keep in step:

1. **The optimizer counts.** :func:`poetx_jax.poetx` keeps ``count`` and
   ``cycle`` (updates since the last merge point) in its state and forgets its
   moments on the first update of a cycle: a counter under jit, no Python
   ``if``. :func:`merge_due` reads from two of its states whether the update
   between them completed a cycle.
2. **The train step decides.** :func:`poetx_jax.make_train_step` merges right
   after the update that completes a cycle. Given the cycle length in calls
   it counts on the host (:class:`MergeClock`: no device read per step) and
   checks :func:`merge_due`'s verdict once it is computed, without stalling
   the device; otherwise it reads that verdict after every update.
3. **The layers merge.** :func:`merge` merges every layer of a model: outside
   jit, one compiled program per layer shape (cached here), a stack of
   layers in one program that updates it in place. :func:`merge_layer` is the
   merge of one layer (or stack). The permutation key of the merge after
   update ``n`` is ``fold_in(key(seed), n)``, so a resumed run draws what an
   uninterrupted one would.
"""

from __future__ import annotations

import contextvars
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from poetx_jax import ops, perms, sharding
from poetx_jax.convert import for_each_layer, poet_layers
from poetx_jax.layout import on_gpu
from poetx_jax.linear import POETLinear
from poetx_jax.optim import the_poetx_state
from poetx_jax.ties import tie_of, tied_sides

Array = jax.Array


def draw_permutations(layer: POETLinear, key: Array) -> tuple[Array, Array]:
  """The ``(perm_in, perm_out)`` that :func:`merge_layer` draws from ``key``
  (:meth:`POETLinear.draw_permutations`: element or chunk permutations, as
  the layer draws them; for a stack, stacked: layer ``j`` from
  ``jax.random.split(key, stack)[j]``)."""
  if layer.stack_shape:
    keys = jax.random.split(key, layer.stack_shape)
    draw = layer.draw_permutations
    for _ in layer.stack_shape:
      draw = jax.vmap(draw)
    return draw(keys)
  return layer.draw_permutations(key)


def merge_layer(layer: POETLinear, key: Array, perm_in: Array | None = None,
                perm_out: Array | None = None) -> Array:
  """Merge-then-reinitialise one POET layer (or each layer of a stack, with
  its own key split from ``key``) in place.

  ``perm_in`` / ``perm_out``: the new permutations of that side (stacked
  for a stack), given in place of the ones drawn from ``key``. A tied side
  (:mod:`poetx_jax.ties`) must be given its group's: :func:`merge` gives them.

  Returns the merged factors' largest :meth:`POETLinear.orthogonality_error`:
  what the merge folds into W0 beyond a rotation.

  Raises:
    ValueError: a tied side is not given its permutation.
  """
  for side, given in (('in', perm_in), ('out', perm_out)):
    if given is None and tie_of(layer, side) is not None:
      raise ValueError(f"this layer's {side!r} permutation is tied to other layers' "
                       f'({tie_of(layer, side)}): merge the module that holds the whole '
                       f'group with poetx_jax.merge, which draws one permutation for it')
  if layer.stack_shape:
    keys = jax.random.split(key, layer.stack_shape)
    return jnp.max(for_each_layer(layer, merge_layer, keys, perm_in, perm_out, update=True))
  where = _BASE_SHARDING.get()
  if where is not None:
    # The generators whole on each device before their blocks are formed:
    # the packed parameters cross (a gather), not the dense blocks the
    # compiler would otherwise all-reduce (twice the bytes, twice the traffic).
    whole = jax.sharding.NamedSharding(where[0], jax.sharding.PartitionSpec())
    for q in (layer.q_in, layer.q_out):
      q[...] = jax.lax.with_sharding_constraint(q[...], whole)
  blocks = layer.rotation_blocks()  # one series for the error and the merged kernel
  error = layer.orthogonality_error(blocks)
  drawn_in, drawn_out = layer.draw_permutations(key)
  # A given permutation is copied: each layer's state holds a buffer of its own.
  perm_in = drawn_in if perm_in is None else jnp.copy(perm_in)
  perm_out = drawn_out if perm_out is None else jnp.copy(perm_out)
  if where is not None and _merges_on_shards(layer, *where):
    base, scale = _merged_on_shards(layer, blocks, perm_in, perm_out, *where), None
  else:
    merged = layer.effective_kernel(blocks)
    base, scale = layer.encode_base(ops.permute_kernel(merged, perm_in, perm_out, layer.chunk))
  layer.kernel[...] = base
  if scale is not None:
    layer.kernel_scale[...] = scale
  layer.perm_in[...] = perm_in
  layer.perm_out[...] = perm_out
  layer.q_in[...] = jnp.zeros_like(layer.q_in[...])
  layer.q_out[...] = jnp.zeros_like(layer.q_out[...])
  return error


# (mesh, PartitionSpec of one layer's base) while a merge program traces a
# layer whose base is split over the mesh's 'fsdp' axis: the layer then
# merges on its shards (_merged_on_shards).
_BASE_SHARDING: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    'poetx_base_sharding', default=None)


def _merges_on_shards(layer: POETLinear, mesh, spec) -> bool:
  """Whether the layer's base can merge on its shards: split along one axis
  over 'fsdp', its other axis divisible by the axis's size too, not
  quantised."""
  d = sharding.fsdp_axis(spec)
  if d is None or layer.quantize is not None:
    return False
  other = (layer.out_features, layer.in_features)[d]
  return other % mesh.shape['fsdp'] == 0


def _merged_on_shards(layer: POETLinear, blocks, perm_in, perm_out, mesh, spec) -> Array:
  """The new stored base ``permute_kernel(effective_kernel, perm_in,
  perm_out)`` computed on the base's shards, in the base's dtype, no device
  holding the whole layer. Rotations and permutations of the two axes
  commute, so each axis is done where a device holds it whole: first the
  axis the shards hold whole (its blocks' products, then the merge's
  permutation of it), then one all-to-all over ``fsdp`` re-splits the shard
  along that axis, making the split axis whole; its rotation and
  permutation follow, the result is rounded to the base's dtype once, and a
  second all-to-all restores the base's layout. A device sends about twice
  its shard (float32 in the first trip, the base's dtype in the second),
  whatever the block size or the number of devices. The same values as the
  whole-layer merge up to float32 rounding: the rotations are the same
  block products (:func:`poetx_jax.ops.rotate_rows`,
  :func:`poetx_jax.ops.rotate_features`), and the rest is permutation."""
  c_in, c_out = ops._chunk_pair(layer.chunk)  # pylint: disable=protected-access
  i, o = layer.in_features, layer.out_features
  # Where each row / column of the new base comes from in the rotated,
  # still-permuted base: the merge's permutations applied to indices.
  rows = perms._take_rows(ops.unpermute_rows(jnp.arange(i)[:, None], layer.perm_in[...],  # pylint: disable=protected-access
                                             chunk=c_in), perm_in, c_in)[:, 0]
  cols = perms._gather(ops.unpermute(jnp.arange(o)[None, :], layer.perm_out[...],  # pylint: disable=protected-access
                                     chunk=c_out), perm_out, c_out)[0]
  g_in, g_out = blocks
  d = sharding.fsdp_axis(spec)
  exact = jax.lax.Precision.HIGHEST

  def rows_done(a):  # the input axis (0) whole on this device
    return jnp.take(ops.rotate_rows(a, g_in, precision=exact), rows, axis=0)

  def cols_done(a):  # the output axis (1) whole on this device
    return jnp.take(ops.rotate_features(a, g_out, precision=exact), cols, axis=1)

  whole_first, split_after = (cols_done, rows_done) if d == 0 else (rows_done, cols_done)

  def local(k):
    a = whole_first(k.astype(jnp.float32))
    a = jax.lax.all_to_all(a, 'fsdp', split_axis=1 - d, concat_axis=d, tiled=True)
    a = split_after(a).astype(layer.param_dtype)  # rounded once, as the whole-layer merge
    return jax.lax.all_to_all(a, 'fsdp', split_axis=d, concat_axis=1 - d, tiled=True)

  return jax.shard_map(local, mesh=mesh, in_specs=(spec,), out_specs=spec,
                       check_vma=False)(layer.frozen_kernel())


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
  model. The layers of a stack merge one after another inside one program
  that updates the stack in place: its old buffers are donated, so arrays
  read from a stacked layer before the merge are invalid after it. A base
  split over a mesh's ``fsdp`` axis into shards of whole rotation blocks
  (not quantised) merges on its shards, no device holding the whole layer
  (:func:`_merged_on_shards`); other layouts are
  partitioned by the compiler. Under jit (the model's state traced, whether
  or not the key is) it traces inline, with the compiler's partitioning.

  Args:
    model: a model containing POETLinear layers.
    rngs: an ``nnx.Rngs`` (its ``params`` stream is used) or a PRNG key.

  Returns:
    The largest orthogonality error of the merged factors (a float32 scalar
    array; reading it waits for the merge). A few 1e-2 or less while training
    is healthy (largest per run: 9e-3 to 3.5e-2 in the Llama-130M runs of
    docs/quality.md; ``poetx train`` warns above 0.1); near or above 1 the
    generators have left the Cayley–Neumann series' region of convergence (a
    learning rate too large for the block size).
  """
  key = rngs.params() if isinstance(rngs, nnx.Rngs) else rngs
  layers = poet_layers(model)
  # under jit the key may still be concrete (closed over): the layers tell
  traced = any(isinstance(x, jax.core.Tracer)
               for x in jax.tree.leaves((key, [nnx.state(layer) for _, layer in layers])))
  index = {id(layer): i for i, (_, layer) in enumerate(layers)}
  (ties, partial), drawn = tied_sides(model), {}
  if partial:
    raise ValueError(f'{len(partial)} tied permutation(s) of this model belong to groups '
                     f'whose other layers are outside it (poetx_jax.ties): merge the module '
                     f'that holds every layer of each group')

  def given(layer, side):  # a tied side takes its group leader's new permutation
    lead = ties.get((id(layer), side))
    if lead is None:
      return None
    leader, lead_side = lead
    if id(leader) not in drawn:
      drawn[id(leader)] = draw_permutations(leader, jax.random.fold_in(key, index[id(leader)]))
    return drawn[id(leader)][0 if lead_side == 'in' else 1]

  errors = []
  for i, (_, layer) in enumerate(layers):
    k = jax.random.fold_in(key, i)
    perms = (given(layer, 'in'), given(layer, 'out'))
    errors.append(merge_layer(layer, k, *perms) if traced else _merge_compiled(layer, k, perms))
  return jnp.max(jnp.stack(errors)) if errors else jnp.zeros((), jnp.float32)


def _merge_compiled(layer: POETLinear, key: Array, perms) -> Array:
  state, fn = _layer_program(layer)
  state, error = fn(state, key, perms)
  nnx.update(layer, state)
  return error


def _layer_program(layer: POETLinear):
  """The layer's state and its (cached) merge program."""
  graphdef, state = nnx.split(layer)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  leaves, treedef = jax.tree.flatten(shardings)
  value = layer.kernel.get_value()  # an array, or its shape (abstract state)
  base = getattr(value, 'sharding', None)
  where = None
  if isinstance(base, jax.sharding.NamedSharding):  # one layer's spec, the stack axes dropped
    spec = tuple(base.spec) + (None,) * (len(value.shape) - len(base.spec))
    where = (base.mesh, jax.sharding.PartitionSpec(*spec[len(layer.stack_shape):]))
  return state, _merge_program(graphdef, treedef, tuple(leaves), bool(layer.stack_shape), where)


def merge_collectives(model) -> list[tuple[str, list[dict]]]:
  """What a :func:`merge` of ``model`` sends between devices, read from the
  compiled merge programs (compiled here, not run: nothing changes):
  ``(layer path, sharding.collective_sites(program))`` per POET layer, its
  untied permutations drawn as :func:`merge` draws them. Under data
  parallelism (the state replicated) every device draws the same
  permutations from the same key and merges on its own: no collective."""
  out = []
  for i, (path, layer) in enumerate(poet_layers(model)):
    state, fn = _layer_program(layer)
    text = fn.lower(state, jax.random.fold_in(jax.random.key(0), i),
                    (None, None)).compile().as_text()
    out.append((path, sharding.collective_sites(text)))
  return out


# The merge programs run once a cycle: on GPUs they are compiled without XLA's
# autotuning, trading a possibly slower algorithm for a product, once a cycle,
# for compile time (BENCHMARKS.md, "Step speed after batched_series").
MERGE_GPU_COMPILER_OPTIONS = {'xla_gpu_autotune_level': 0}


@functools.lru_cache(maxsize=64)
def _merge_program(graphdef, treedef, sharding_leaves, donate, base_sharding=None):
  def run(state, key, perms):
    layer = nnx.merge(graphdef, state)
    token = _BASE_SHARDING.set(base_sharding)
    try:
      error = merge_layer(layer, key, *perms)
    finally:
      _BASE_SHARDING.reset(token)
    return nnx.state(layer), error

  if all(isinstance(s, jax.sharding.SingleDeviceSharding) for s in sharding_leaves):
    out = None  # as the update step leaves them: a pinned sharding would retrace it
  else:
    shardings = jax.tree.unflatten(treedef, list(sharding_leaves))
    mesh = next(s.mesh for s in sharding_leaves if isinstance(s, jax.sharding.NamedSharding))
    out = (shardings, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  # A stack of layers is donated and updated in place, one layer's scratch at
  # a time (not donated, it would need a second copy of its base weights).
  options = MERGE_GPU_COMPILER_OPTIONS if on_gpu() else None
  return jax.jit(run, out_shardings=out, donate_argnums=0 if donate else (),
                 compiler_options=options)


def merge_due(old_state, new_state) -> Array:
  """True iff the update from ``old_state`` to ``new_state`` completed a cycle.

  Looks for the ``ScaleByPoetxState`` inside any optax state (chains,
  partitions, ``inject_hyperparams``, ``MultiSteps``: a MultiSteps mini-step
  leaves the count unchanged, so no merge is due). Raises if there is none or
  more than one.
  """
  old, new = the_poetx_state(old_state), the_poetx_state(new_state)
  return (new.count != old.count) & (new.cycle == 0)


class MergeClock:
  """Says on the host, without reading the device, which train-step calls
  complete a merge cycle.

  ``every`` is the cycle length in calls of the step (the optimizer's
  ``merge_every`` times the micro-steps per update of any gradient
  accumulation). The clock counts calls from ``nnx.Optimizer.step``, which it
  reads once, and again only when that counter was changed by something other
  than the step (a checkpoint restored into the optimizer, say).
  """

  def __init__(self, every: int):
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
      raise ValueError(f'merge_every must be an int >= 1 (calls per merge), got {every!r}')
    self.every = every
    self._calls = None       # calls done, as last seen
    self._counter = None     # the array the step left in optimizer.step

  def before_call(self, optimizer: nnx.Optimizer) -> None:
    """Syncs with the optimizer's call counter if someone else changed it."""
    if self._counter is None or optimizer.step.get_value() is not self._counter:
      self._calls = int(optimizer.step[...])

  def after_call(self, optimizer: nnx.Optimizer) -> bool:
    """Counts the call just made; True iff it completed a cycle."""
    self._calls += 1
    self._counter = optimizer.step.get_value()
    return self._calls % self.every == 0

  @property
  def calls(self) -> int | None:
    """Calls done (None before the first)."""
    return self._calls
