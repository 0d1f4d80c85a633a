"""A ready train step: gradients and optimizer update in one jit, then a merge when due."""

from __future__ import annotations

import typing as tp
import weakref

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from poetx_jax import gradients
from poetx_jax.cycle import MergeClock, merge, merge_due
from poetx_jax.optim import poetx_states


def make_train_step(loss_fn: tp.Callable, *, merge_every: int | None = None,
                    seed: int = 0, has_aux: bool = False, donate: bool = True,
                    on_merge: tp.Callable[[int, jax.Array], None] | None = None,
                    data_parallel: jax.sharding.Mesh | None = None,
                    loss_weight: tp.Callable | None = None, grad_norm: bool = False,
                    compiler_options: dict[str, tp.Any] | None = None,
                    accumulate: int = 1,
                    fully_sharded: jax.sharding.Mesh | None = None) -> tp.Callable:
  """Builds ``step(model, optimizer, batch) -> loss`` (state donated).

  One call computes ``nnx.value_and_grad(loss_fn)(model, batch)`` (all
  ``nnx.Param``s, POET generators included; the frozen base weights get no
  gradient) and applies ``optimizer.update`` in one jitted program; when that
  update completed a merge cycle of the :func:`poetx_jax.poetx` optimizer it
  then merges every POET layer (:func:`poetx_jax.merge`, in programs of its
  own: unrolled into the update program the merge multiplied its compile
  time). :mod:`poetx_jax.cycle` describes the cycle. With an optimizer that
  holds no ``poetx`` (AdamW, say) it is a plain train step.

  Example::

    step = make_train_step(lambda m, b: ((m(b['x']) - b['y']) ** 2).mean(),
                           merge_every=200)
    for batch in batches:
      loss = step(model, optimizer, batch)

  Args:
    loss_fn: ``loss_fn(model, batch)`` returning a scalar loss, or
      ``(loss, aux)`` with ``has_aux=True``.
    merge_every: calls of the step per merge cycle: the ``merge_every`` of
      ``poetx`` (times the micro-steps of an ``optax.MultiSteps`` gradient
      accumulation; with ``accumulate`` a call is one update). Given, the step
      decides merges on the host with no device read per call, and checks the
      optimizer's own verdict
      (:func:`poetx_jax.merge_due`) once it is computed (at most two calls
      later), raising if they disagree. None reads that verdict back after every call, which makes
      the host wait for each update before dispatching the next.
    seed: seeds the merge permutations: the merge after micro-batch ``n``
      (update ``n``, without accumulation) draws from ``fold_in(key(seed), n)``.
    has_aux: whether ``loss_fn`` returns auxiliary outputs (returned as well).
    donate: donate model and optimizer buffers to the update.
    compiler_options: XLA options for the update program alone (``jax.jit``'s
      ``compiler_options``), e.g. ``{'xla_gpu_memory_limit_slop_factor': 6}``.
    on_merge: called after each merge as ``on_merge(micro_batches,
      orthogonality_error)`` (the micro-batches trained so far: the optimizer's
      step times ``accumulate``) with what :func:`poetx_jax.merge` returns (the
      merged factors' largest orthogonality error), e.g. to log it or to warn
      when the POET learning rate is too large for the block size.
    data_parallel: the mesh when the training state is replicated over it and
      each batch split over all its axes. Each device then computes the
      gradients of its own rows and one all-reduce of exactly the trainable
      arrays averages them. The loss must be a mean (over rows, or over what
      ``loss_weight`` counts) and the rows split evenly. Not with ``has_aux``,
      nor with a loss that writes variables other than ``nnx.Param`` s
      (BatchNorm statistics, Dropout's RNG counters): refused when traced.
    fully_sharded: the mesh (:func:`poetx_jax.sharding.make_mesh`) when the
      training state is sharded over it as :func:`poetx_jax.sharding.shard_state`
      places it under ``'fsdp'`` and each batch split over all its axes. Each
      device computes the gradients of its own rows, the compiler gathering
      the frozen weights where they are used, and the trainable arrays cross
      devices twice an update, each at its own size (the POET generators
      packed): gathered whole once before the micro-batches, and their
      gradients summed on each device over the micro-batches, then
      reduce-scattered once to each array's shards. The cost is memory:
      every device holds the trainable arrays whole and a full-size gradient
      of them during the update (for POET-X the generators and the
      embeddings, a small part of the model; for AdamW the whole model, so
      leave it unset there and the compiler partitions the step as usual).
      The loss and the refusals are as for ``data_parallel``, with which it
      cannot be combined.
    loss_weight: with ``data_parallel`` or ``fully_sharded``:
      ``loss_weight(batch)`` is how many items a device's loss averages over
      on its rows (e.g. its unmasked tokens). The devices' losses and
      gradients are then averaged with these weights, which is the global
      mean however unevenly the items fall. None weighs the devices equally
      (a mean over rows).
    grad_norm: return ``(out, grad_norm)``: also the gradients' global norm before
      clipping (of the call's micro-batch, or its ``accumulate`` micro-batches'
      mean), as a device array (``_update_fn``).
    accumulate: micro-batches per update. Above 1, every array of ``batch``
      has a leading axis of this length, and one call (one compiled program)
      computes the gradients of each micro-batch in turn (``jax.lax.scan``),
      sums them, and applies their mean (weighted by ``loss_weight`` where
      given: the mean over all the update's items) with one
      ``optimizer.update``; the loss returned is the same mean. With
      ``data_parallel`` or ``fully_sharded`` each device sums its own
      micro-batches' gradients and the devices average once per update, not
      once per micro-batch (batch arrays then split over the mesh on their
      second axis). The sum is kept
      in the gradients' dtype, as ``optax.MultiSteps`` keeps it (each
      weighted term computed in float32).

  Returns:
    The step function; it returns the loss (and aux) before the update. It
    finds the variables of the model and optimizer it is given once (again
    when given other objects), so change a model's structure in place (not
    its values: merges and checkpoint restores are fine) only between steps
    made by different step functions. ``step.lower(model, optimizer, batch)``
    lowers the gradient-and-update program, which returns ``(out, merge_due,
    merge_key, grad_norm)`` (abstract model and optimizer states work).
  """
  if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
    raise ValueError(f'accumulate must be an int >= 1 (micro-batches per update), '
                     f'got {accumulate!r}')
  if accumulate > 1 and has_aux:
    raise ValueError('accumulate > 1 does not take has_aux=True (auxiliary outputs of '
                     'several micro-batches cannot be combined in general)')
  base_key = jax.random.key(seed)
  verdicts = _MergeVerdicts(merge_every)
  value_and_grad = gradients.value_and_grad(loss_fn, has_aux, data_parallel, loss_weight,
                                            accumulate, fully_sharded)
  programs = _Programs(_update_fn(value_and_grad, base_key, grad_norm, accumulate), donate,
                       compiler_options)

  def step(model, optimizer: nnx.Optimizer, batch):
    if cycle := programs.has_cycle(optimizer):
      verdicts.before_call(optimizer)
    out, flag, key, norm = programs.run(model, optimizer, batch)
    if cycle and verdicts.after_call(optimizer, flag):
      error = merge(model, rngs=key)
      if on_merge is not None:
        on_merge(int(optimizer.step[...]) * accumulate, error)
    return (out, norm) if grad_norm else out

  step.lower = programs.lower
  return step


def _update_fn(value_and_grad: tp.Callable, base_key: jax.Array,
               grad_norm: bool = False, accumulate: int = 1) -> tp.Callable:
  """The step's device program: ``update(model, optimizer, batch) -> (out,
  merge_due, merge_key, grad_norm)``. It applies the gradients with
  ``optimizer.update``; ``merge_due`` says whether that completed a POET-X
  merge cycle (always False without a ``poetx`` state), ``merge_key`` is
  ``fold_in(base_key, step * accumulate)`` (the micro-batches trained so
  far, so that the merges draw what an ``optax.MultiSteps`` accumulation's
  would) and ``grad_norm`` the gradients' global norm
  (None unless ``grad_norm``): an extra output of the same program, which the
  caller reads only when it wants it (a log step), so the host does not wait
  for it; the losses and updates are bitwise those without it."""

  def update(model, optimizer: nnx.Optimizer, batch):
    out, grads = value_and_grad(model, batch)
    norm = optax.tree.norm(grads) if grad_norm else None
    old_state = nnx.as_pure(optimizer.opt_state)
    optimizer.update(model, grads)
    if poetx_states(old_state):
      due = merge_due(old_state, nnx.as_pure(optimizer.opt_state))
    else:  # no POET-X in this optimizer: nothing ever merges
      due = jnp.zeros((), bool)
    return out, due, jax.random.fold_in(base_key, optimizer.step[...] * accumulate), norm

  return update


class _MergeVerdicts:
  """Whether each call of the step completed a merge cycle.

  With ``merge_every`` the host's :class:`poetx_jax.cycle.MergeClock` says so
  with no device read, and each of its verdicts is checked against the
  optimizer's once that is computed: at once if it is ready, else when it is
  two calls old, so the device always has work queued. Without it the
  optimizer's verdict is read back after every call.
  """

  def __init__(self, merge_every: int | None):
    self.merge_every = merge_every
    self.clock = MergeClock(merge_every) if merge_every is not None else None
    self.unchecked = []  # (the device's verdict, the host's, the call)

  def before_call(self, optimizer: nnx.Optimizer) -> None:
    if self.clock is not None:
      self.clock.before_call(optimizer)

  def after_call(self, optimizer: nnx.Optimizer, flag: jax.Array) -> bool:
    """The verdict on the call just made; ``flag`` is the optimizer's."""
    if self.clock is None:
      return bool(flag)
    due = self.clock.after_call(optimizer)
    self.unchecked.append((flag, due, self.clock.calls))
    while self.unchecked and (self.unchecked[0][0].is_ready() or len(self.unchecked) > 2):
      self._check(*self.unchecked.pop(0))
    return due

  def _check(self, flag, host_due: bool, call: int) -> None:
    if bool(flag) != host_due:
      raise RuntimeError(
          f'make_train_step(merge_every={self.merge_every}) and the optimizer disagree on '
          f'whether call {call} completed a merge cycle (optimizer: {bool(flag)}): '
          f'merge_every must be the optimizer\'s merge_every (times the micro-steps '
          f'of an optax.MultiSteps accumulation; with accumulate, a call is an update)')


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


class _Programs:
  """``fn(model, optimizer, batch)`` as one jitted function of their arrays.

  The variables of (model, optimizer) are found once per pair of objects (by
  identity) and their arrays passed in a fixed order, with no traversal of
  the module graph per call; the new arrays are set back into the same
  Variable objects, so the objects stay the state. An array placed on a mesh
  (a ``NamedSharding``) comes back with the sharding it went in with, so the
  state keeps the caller's layout whatever the compiler would choose (e.g.
  parameters whole beside split optimizer moments stay whole); the
  placements are read from the arrays each call (about 0.1 ms for 300).
  """

  def __init__(self, fn: tp.Callable, donate: bool,
               compiler_options: dict[str, tp.Any] | None = None):
    self.fn, self.donate, self.compiler_options = fn, donate, compiler_options
    self.bound = self.variables = self.pure = None
    self.jitted = {}  # by the state's mesh placements
    self._cycle = None  # (optimizer ref, whether it holds a poetx state)

  def _bind(self, model, optimizer):
    if self.bound is not None and self.bound[0]() is model and self.bound[1]() is optimizer:
      return
    graphdef, state = nnx.split((model, optimizer))
    treedef = jax.tree.structure(state)
    fn = self.fn

    def pure(values, batch):
      model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, values))
      out = fn(model, optimizer, batch)
      return out, jax.tree.leaves(nnx.state((model, optimizer)))

    # A Variable holding an empty node (optax's MaskedNode, where a masked
    # transformation keeps no state) has no array: nothing to pass.
    self.variables = [v for v in jax.tree.leaves(state, is_leaf=_is_variable)
                      if not _is_variable(v) or jax.tree.leaves(v)]
    self.plain = [_plain(v) for v in self.variables]
    self.pure, self.jitted = pure, {}
    self.bound = (weakref.ref(model), weakref.ref(optimizer))

  def _jitted(self, values):
    """The program for ``values``: its new state arrays placed as these are
    where they are on a mesh (others, and the outputs, as the compiler
    places them)."""
    placed = tuple(s if isinstance(s := getattr(x, 'sharding', None),
                                   jax.sharding.NamedSharding) else None for x in values)
    jitted = self.jitted.get(placed)
    if jitted is None:
      jitted = self.jitted[placed] = jax.jit(
          self.pure, donate_argnums=0 if self.donate else (),
          out_shardings=(None, list(placed)) if any(placed) else None,
          compiler_options=self.compiler_options)
    return jitted

  def has_cycle(self, optimizer) -> bool:
    """Whether ``optimizer`` holds a POET-X state (read once per optimizer)."""
    if self._cycle is None or self._cycle[0]() is not optimizer:
      self._cycle = (weakref.ref(optimizer),
                     bool(poetx_states(nnx.as_pure(optimizer.opt_state))))
    return self._cycle[1]

  def _values(self):
    return [v.get_raw_value() if plain else v.get_value()
            for v, plain in zip(self.variables, self.plain)]

  def run(self, model, optimizer, batch):
    self._bind(model, optimizer)
    values = self._values()
    out, values = self._jitted(values)(values, batch)
    for v, plain, x in zip(self.variables, self.plain, values):
      if plain:
        v.set_raw_value(x)
      else:
        v.set_value(x)
    return out

  def lower(self, model, optimizer, batch):
    self._bind(model, optimizer)
    values = self._values()
    return self._jitted(values).lower(values, batch)


def _plain(variable: nnx.Variable) -> bool:
  """Whether the variable holds one array with no get/set hooks: its value is
  then its raw value, read and written without get_value/set_value's per-call
  copies and checks (host time that, over hundreds of arrays, a small
  model's step would otherwise spend with the device waiting)."""
  metadata = variable.get_metadata()
  raw = variable.get_raw_value()
  return (isinstance(raw, jax.Array) and not nnx.variablelib.is_array_ref(raw)
          and 'on_get_value' not in metadata and 'on_set_value' not in metadata
          and not metadata.get('hijax', False))
