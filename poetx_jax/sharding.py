"""Sharding POET-X training over devices with JAX's own SPMD runtime.

A mesh has two named axes, ``data`` and ``fsdp``. The batch is split over both.
Two strategies place the training state:

* ``'dp'`` — data parallel: every array replicated. Only gradients cross
  devices, and under POET-X those are the small generators (plus embeddings,
  head and norms), which is why POET-X scales where AdamW's all-reduce of every
  weight's gradient does not.
* ``'fsdp'`` — fully sharded: every array whose largest dimension the
  ``fsdp`` axis size divides (frozen bases, generators, embeddings, optimizer
  moments) is split along it; the rest is replicated. For models whose W0 does
  not fit on one device: with ``scan_layers`` the stacked layers are built
  straight into their shards (:func:`placement`; :func:`array_spec` with
  ``stacked``: the layer axis whole, the most major divisible dimension split).
  The POET permutations stay replicated under both (:func:`shard_state`).

With ``'dp'``, ``make_train_step(data_parallel=mesh)`` has each device compute
its rows' gradients and averages them with one all-reduce of the trainable
arrays, once per update however many micro-batches it accumulates
(``accumulate``). Merges run in their own compiled programs, one per layer shape, that
keep each array's sharding: the permutation keys are replicated, so every
device draws the same permutations, and XLA moves only the shards a gather
needs. :func:`collective_bytes` reads what a compiled program sends between
devices, :func:`collective_sites` each collective and whether it runs inside
a loop.
"""

from __future__ import annotations

import re

import numpy as np

import jax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from poetx_jax.linear import Permutation

STRATEGIES = ('dp', 'fsdp')
AXES = ('data', 'fsdp')


def make_mesh(data: int | None = None, fsdp: int = 1, devices=None) -> jax.sharding.Mesh:
  """A (data, fsdp) mesh over ``devices`` (default: all); ``data=None`` uses
  every device left after ``fsdp``."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if fsdp < 1 or n % fsdp:
    raise ValueError(f'fsdp={fsdp} must be >= 1 and divide the {n} devices')
  data = n // fsdp if data is None else data
  if data * fsdp != n:
    raise ValueError(f'data={data} x fsdp={fsdp} != {n} devices')
  return jax.sharding.Mesh(np.array(devices).reshape(data, fsdp), AXES,
                           axis_types=(AxisType.Auto, AxisType.Auto))


def array_spec(shape, strategy: str, fsdp_size: int, *, stacked: bool = False) -> P:
  """The PartitionSpec of one state array under ``strategy``.

  Under ``'fsdp'`` one dimension that the ``fsdp`` axis size divides is
  split; an array no rule can split is replicated.

  * Plain arrays: the largest dimension (the first of equals), and only that
    one: a vocabulary that the axis does not divide keeps its embedding
    replicated rather than split along the features, which XLA's partitioner
    (0.11) fails to compile.
  * ``stacked`` arrays (a leading layer axis, as in a scanned layer stack): the
    layer axis whole, the first other dimension the axis divides. The most
    major one: each layer's all-gather inside the scan then needs no
    transpose, which XLA on GPU would otherwise hoist out of the loop as a
    transposed copy of the whole stack (17.5 GiB per array for a 70B-class
    model on two GPUs).
  """
  if strategy not in STRATEGIES:
    raise ValueError(f'strategy must be one of {STRATEGIES}, got {strategy!r}')
  if strategy == 'dp' or fsdp_size == 1 or len(shape) < 1 + stacked:
    return P()
  if stacked:
    d = next((d for d in range(1, len(shape)) if shape[d] % fsdp_size == 0), None)
  else:
    d = max(range(len(shape)), key=lambda i: (shape[i], -i))
    d = None if shape[d] % fsdp_size else d
  if d is None:
    return P()
  return P(*[('fsdp' if i == d else None) for i in range(len(shape))])


def placement(mesh: jax.sharding.Mesh, strategy: str):
  """``place(shape) -> NamedSharding`` of a stacked array under ``strategy``
  (:func:`array_spec` with ``stacked``), for ``Llama(scan_layers=True,
  place=...)``."""
  fsdp = mesh.shape['fsdp']
  return lambda shape: NamedSharding(mesh, array_spec(shape, strategy, fsdp, stacked=True))


def shard_state(node, mesh: jax.sharding.Mesh, strategy: str) -> None:
  """Places every array of an NNX object (model or optimizer) on ``mesh``.

  Every array follows :func:`array_spec`, ``stacked`` for those of stacked
  layers (variables with ``layer_axis`` metadata 0, as a model's scanned layer
  stack sets them; optimizer moments copy it), but for the POET permutations
  (:class:`~poetx_jax.linear.Permutation`, I + O int32 per layer), which are
  replicated: they index the activation gathers, and split over ``fsdp``
  they lead the partitioner to split a gather's output features over
  ``fsdp`` while its rows keep only ``data``, which XLA (0.11) aborts on
  (a check failure in the SPMD partitioner) once both mesh axes exceed 1,
  e.g. ``fsdp=2`` on 4 devices. Under ``'fsdp'`` every
  submodule with a ``carry_sharding`` attribute (a stack of layers run by
  ``lax.scan``, e.g. ``models.llama.StackedLayers``) gets the batch sharding
  there, to pin the activations it carries between layers.
  """
  _place(node, mesh, strategy, is_array, jax.device_put)


def abstract_placed(node, mesh: jax.sharding.Mesh, strategy: str) -> None:
  """:func:`shard_state` for an object of shapes only (``nnx.eval_shape``):
  each ``jax.ShapeDtypeStruct`` gets the sharding its array would have, so
  that a step lowered with it compiles as the placed run's (its collectives
  readable with no array allocated)."""
  _place(node, mesh, strategy, lambda x: isinstance(x, jax.ShapeDtypeStruct),
         lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s))


def _place(node, mesh: jax.sharding.Mesh, strategy: str, placeable, put_one) -> None:
  """Sets every placeable value of ``node`` to ``put_one(value, sharding)``
  by the rules of :func:`shard_state`."""
  if strategy == 'fsdp':
    for _, sub in nnx.iter_graph(node):
      if hasattr(sub, 'carry_sharding'):
        sub.carry_sharding = batch_sharding(mesh)

  def put(v: nnx.Variable):
    x = v.get_value()
    if not placeable(x):
      return x
    return put_one(x, variable_sharding(v, mesh, strategy))

  nnx.update(node, jax.tree.map(put, nnx.state(node),
                                is_leaf=lambda v: isinstance(v, nnx.Variable)))


def fsdp_axis(spec: P) -> int | None:
  """The one dimension ``spec`` (an :func:`array_spec`) splits over
  ``fsdp``, or None where it splits none."""
  axes = [d for d, name in enumerate(spec) if name is not None]
  return axes[0] if len(axes) == 1 and spec[axes[0]] == 'fsdp' else None


def variable_sharding(v: nnx.Variable, mesh: jax.sharding.Mesh,
                      strategy: str) -> NamedSharding:
  """Where :func:`shard_state` places the array of variable ``v``."""
  if isinstance(v, Permutation):
    return NamedSharding(mesh, P())
  shape = v.get_value().shape
  return NamedSharding(mesh, array_spec(shape, strategy, mesh.shape['fsdp'],
                                        stacked=v.get_metadata().get('layer_axis') == 0))


def is_array(x) -> bool:
  """Whether ``x`` is an array that can be placed on devices (a jax or numpy
  array or scalar), not a placeholder of an optimizer state (``MaskedNode``,
  an empty tuple, None)."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Batches are split on their first axis over both mesh axes."""
  return NamedSharding(mesh, P(AXES))


def shard_batch(local_batch, mesh: jax.sharding.Mesh, axis: int = 0):
  """Assembles the global batch from each process's rows (dict of arrays).

  On one host ``local_batch`` is the whole batch; on several, each process
  passes its own rows (``local_rows`` of a global batch, or its own data
  shard) and the global array spans them. ``axis``: the rows' axis (1 for
  micro-batches stacked on a leading axis, as ``make_train_step(accumulate=...)``
  takes them).
  """
  n = mesh.size // jax.process_count()  # devices of this process
  sharding = (batch_sharding(mesh) if axis == 0
              else NamedSharding(mesh, P(*[None] * axis, AXES)))

  def put(x):
    if x.shape[axis] % n:
      raise ValueError(f'a per-process batch of {x.shape[axis]} rows is not divisible by '
                       f'the {n} devices of this process')
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))

  return jax.tree.map(put, local_batch)


def local_rows(batch):
  """This process's contiguous share of the rows of a global host batch."""
  pc, pi = jax.process_count(), jax.process_index()

  def take(x):
    if x.shape[0] % pc:
      raise ValueError(f'batch of {x.shape[0]} rows is not divisible by {pc} processes')
    n = x.shape[0] // pc
    return x[pi * n:(pi + 1) * n]

  return jax.tree.map(take, batch)


def _array_bytes(dtype: str, dims: str) -> int:
  """Bytes of an HLO array type such as ``bf16[8,128]`` (``pred`` one byte,
  sub-byte types packed, ``token`` none)."""
  n = 1
  for d in filter(None, dims.split(',')):
    n *= int(d)
  digits = re.search(r'\d+', dtype)
  bits = 8 if dtype == 'pred' else int(digits.group()) if digits else 0  # token: 0
  return -(-n * bits // 8)


_COLLECTIVE = re.compile(r'=\s*(.*?)\s(all-reduce|all-gather|reduce-scatter|all-to-all|'
                         r'collective-permute)(-start|-done)?\(')
_CALLED = re.compile(r'(?:body|condition|calls|to_apply|branch_computations|'
                     r'true_computation|false_computation)=\{?([^,}\s]+(?:,\s*%[^,}\s]+)*)')


def collective_sites(hlo_text: str) -> list[dict]:
  """Every cross-device collective of compiled HLO text, in program order:
  ``{'kind', 'bytes', 'computation', 'in_loop', 'trips'}``, ``bytes`` its
  result's (as :func:`collective_bytes` counts them, an asynchronous one at
  its ``-done``), ``in_loop`` whether it runs inside a ``while`` loop's body
  or condition (directly or through the computations they call) and
  ``trips`` how many times one call of the program runs it: the product of
  the enclosing loops' trip counts (a scanned layer stack's layers times an
  accumulation's micro-batches), None where a loop's count is not known."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    head = re.match(r'(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$', line)
    if head and not line.startswith(' '):
      current = head.group(2)
      computations[current] = []
      entry = current if head.group(1) else entry
    elif current is not None:
      computations[current].append(line)
  # callee -> (caller, factor): a while's body and condition run its trip count
  edges = {}
  for name, lines in computations.items():
    for line in lines:
      loop = ' while(' in line
      trip = re.search(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', line)
      for m in _CALLED.finditer(line):
        for callee in re.split(r',\s*', m.group(1)):
          factor = (int(trip.group(1)) if trip else None) if loop else 1
          edges.setdefault(callee.lstrip('%'), []).append((name, factor, loop))
  memo = {}

  def reach(name, seen=()):
    """(trips, in_loop) of a computation: the most over its callers (None
    where any caller's count is unknown)."""
    if name == entry or name not in edges or name in seen:
      return 1, False
    if name not in memo:
      counts, in_loop = [], False
      for caller, factor, loop in edges[name]:
        trips, looped = reach(caller, (*seen, name))
        counts.append(None if trips is None or factor is None else trips * factor)
        in_loop = in_loop or looped or loop
      memo[name] = (None if None in counts else max(counts), in_loop)
    return memo[name]

  sites = []
  for name, lines in computations.items():
    for line in lines:
      m = _COLLECTIVE.search(line)
      if not m or m.group(3) == '-start':
        continue
      total = sum(_array_bytes(dt, dims)
                  for dt, dims in re.findall(r'([a-z]\w*)\[([\d,]*)\]', m.group(1)))
      trips, looped = reach(name)
      sites.append({'kind': m.group(2), 'bytes': total, 'computation': name,
                    'in_loop': looped, 'trips': trips})
  return sites


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Result bytes of each kind of cross-device collective in compiled HLO text
  (``jit(f).lower(...).compile().as_text()``), by kind: what one call sends
  between devices, as the program states it. An asynchronous collective is
  counted at its ``-done``, whose result is the output alone (a ``-start``'s
  tuple also holds the operands). Each instruction counts once: a collective
  inside a loop body (the layers of a scanned stack) is counted for
  one iteration, not times the trip count."""
  out = {}
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.search(line)
    if not m or m.group(3) == '-start':
      continue
    total = sum(_array_bytes(dt, dims)
                for dt, dims in re.findall(r'([a-z]\w*)\[([\d,]*)\]', m.group(1)))
    out[m.group(2)] = out.get(m.group(2), 0) + total
  return out
