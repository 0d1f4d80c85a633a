"""POET layers used together: the SwiGLU join, a block's batched series, and
the operands of grouped products.
"""

from __future__ import annotations

import contextlib
import typing as tp

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from jax.ad_checkpoint import checkpoint_name

from poetx_jax import ops
from poetx_jax.linear import (POETLinear, fuses_gather, given_inverses, implementation_for,
                              using_blocks)
from poetx_jax.ties import tied

Array = jax.Array


@contextlib.contextmanager
def batched_series(module: nnx.Module, x: Array):
  """While the block runs, the single POET layers of ``module`` (mode
  ``'fast'``; not stacks) use rotation blocks computed for all of them at
  once: one Cayley–Neumann series per group of equal block size, terms,
  cap and implementation (:func:`poetx_jax.ops.rotation_blocks_batched`), a
  few kernels in place of a few per layer, and the inverses of all their
  permutations by one scatter (:func:`poetx_jax.ops.invert_permutations`)
  in place of one (and its buffer's copy) per permutation. Same values as
  each layer's own series and inverses, gradients included.

  ``x`` is the module's input: the series is tied to it (so the compiler
  computes it where the module runs, not for every module ahead), and each
  layer's compute dtype for inputs of x's dtype sets the series' precision; a
  layer called on inputs of another dtype computes its own. Layers in mode
  ``'mem'`` keep their own series (recomputed in their backward, not kept).

  Example::

    def __call__(self, x):  # a decoder block
      with poetx_jax.batched_series(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))
  """
  layers = [m for _, m in nnx.iter_graph(module)
            if isinstance(m, POETLinear) and not m.stack_shape and m.mode == 'fast']
  if not layers:
    yield
    return
  groups: dict[tuple, list[POETLinear]] = {}
  for layer in layers:
    precision = ops.series_precision(layer.compute_dtype(x.dtype))
    key = (layer.block_size, layer.terms, layer.max_generator_norm, layer.implementation,
           precision)
    groups.setdefault(key, []).append(layer)
  _, perms = jax.lax.optimization_barrier(
      (x, [p for m in layers for p in (m.perm_in[...], m.perm_out[...])]))
  inverses = ops.invert_permutations(perms)
  inverses = {id(m): tuple(inverses[2 * j:2 * j + 2]) for j, m in enumerate(layers)}
  blocks = {}
  for (block_size, terms, max_norm, implementation, precision), members in groups.items():
    _, qs = jax.lax.optimization_barrier(
        (x, [(m.q_in[...], m.q_out[...]) for m in members]))
    impl = implementation_for(implementation, block_size)
    sides = [(q, n) for m, (q_in, q_out) in zip(members, qs)
             for q, n in ((q_in, m.in_features), (q_out, m.out_features))]
    g = ops.rotation_blocks_batched(sides, block_size, terms, precision,
                                    impl.series if impl is not None else None, max_norm)
    for j, m in enumerate(members):
      blocks[id(m)] = (g[2 * j], g[2 * j + 1], precision, inverses[id(m)])
  with using_blocks(blocks):
    yield


def linear_operands(layer: nnx.Linear | POETLinear, x: Array) -> tuple[Array, Array]:
  """``(x, kernel)`` in the compute dtype, such that ``x @ kernel`` is what
  a bias-free ``layer`` computes: for an ``nnx.Linear`` its kernel (leading
  axes and all) promoted with ``x`` as the layer promotes them; for a
  POETLinear (or a stack of them) :meth:`POETLinear.compute_kernel`. For
  products a layer's own call cannot express, e.g. grouped products
  (``jax.lax.ragged_dot``) over a stack of expert kernels."""
  if not isinstance(layer, POETLinear):
    x, kernel = dtypes.promote_dtype((x, layer.kernel[...]), dtype=layer.dtype)
    return x, kernel
  dtype = layer.compute_dtype(x.dtype)
  return x.astype(dtype), layer.compute_kernel(dtype)


def input_orders(layers: tp.Sequence[nnx.Linear | POETLinear], x: Array
                 ) -> list[tuple[Array, Array | None, int]] | None:
  """Where the POET layers ``layers`` all read ``x`` through their input
  gathers apart from their block products (the input form, no fused
  gather): each layer's ``(perm_in, its inverse or None, its run length)``,
  the same triple for all when their input permutations are tied; else None."""
  if not all(isinstance(m, POETLinear) for m in layers) or any(
      m.form_for((*x.shape[:-1], m.in_features)) != 'input'
      or fuses_gather(m, m.in_features, m.compute_dtype(x.dtype)) for m in layers):
    return None
  order = lambda m: (m.perm_in[...], (given_inverses(m) or (None,))[0], m.chunk)
  if tied([(m, 'in') for m in layers]):
    return [order(layers[0])] * len(layers)
  return [order(m) for m in layers]


def rms_norm_in_orders(norm: nnx.Module, x: Array,
                       orders: tp.Sequence[tuple[Array, Array | None, int]]) -> list[Array]:
  """``[permute(norm(x), perm, chunk=c) for perm, _, c in orders]`` with
  each gather moved into the norm: the row scale (the same in every order)
  from ``x``, then ``x``, gathered, times it and the gathered weight, in one
  pass that writes each output once. Elementwise the same operations as the
  norm's, so the values are exactly those of the norm's output gathered; a
  triple repeated (tied permutations) is computed once. ``norm`` is an
  RMSNorm (its ``weight`` and ``row_scale``)."""
  scale = norm.row_scale(x)
  weight, out = norm.weight[...].astype(jnp.float32), {}
  for perm, inverse, chunk in orders:
    if id(perm) not in out:
      xp = ops.permute(x, perm, inverse, chunk=chunk).astype(jnp.float32)
      out[id(perm)] = (xp * scale * jnp.take(weight, perm)).astype(x.dtype)
  return [out[id(perm)] for perm, _, _ in orders]


def normed(norm: nnx.Module, x: Array, layers: tp.Sequence, *, in_orders: bool
           ) -> tuple[Array | None, list[Array] | None]:
  """``(norm(x), None)``; with ``in_orders``, where ``layers`` read ``x``
  through their input gathers (:func:`input_orders`), ``(None, their inputs)``
  from :func:`rms_norm_in_orders` (for :func:`project` and :func:`swiglu`)."""
  orders = input_orders(layers, x) if in_orders and layers else None
  return (norm(x), None) if orders is None else (None, rms_norm_in_orders(norm, x, orders))


def project(layers: tp.Sequence[nnx.Linear | POETLinear], x: Array | None, *,
            permute_output: bool = True, inputs: tp.Sequence[Array] | None = None
            ) -> list[Array]:
  """``[layer(x) for layer in layers]``. When they are POET layers whose
  input permutations are tied (:func:`poetx_jax.tie_permutations`) and all
  run the input form, ``x`` is gathered once for all of them.
  ``permute_output=False`` (POET layers only): each output in its layer's
  output order. ``inputs`` (instead of ``x``): each layer's input already in
  its input order (:func:`rms_norm_in_orders`)."""
  kw = {} if permute_output else {'permute_output': False}
  if inputs is not None:
    return [m(xi, permute_input=False, **kw) for m, xi in zip(layers, inputs)]
  if not (tied([(m, 'in') for m in layers]) and all(
      m.form_for((*x.shape[:-1], m.in_features)) == 'input' for m in layers)):
    return [m(x, **kw) for m in layers]
  inverses = given_inverses(layers[0])
  xp = ops.permute(x, layers[0].perm_in[...], None if inverses is None else inverses[0],
                   chunk=layers[0].chunk)
  return [m(xp, permute_input=False, **kw) for m in layers]


def swiglu(gate: nnx.Linear | POETLinear, up: nnx.Linear | POETLinear,
           down: nnx.Linear | POETLinear, x: Array | None, *,
           activation: tp.Callable[[Array], Array] = jax.nn.silu,
           hidden_name: str | None = None, inputs: tp.Sequence[Array] | None = None
           ) -> Array:
  """``down(activation(gate(x)) * up(x))``, the gated MLP of Llama, for plain
  or POET layers.

  When all three are POET layers and the down projection runs the input form
  (:meth:`POETLinear.form_for`), the gate and up outputs are gathered
  straight into its input order (:func:`poetx_jax.ops.gather_between`; by
  their output kernels where those fuse their gathers, ``output_dst``): two
  activation gathers instead of three. Gathers are exact, so the values are
  those of the plain formula. When it runs the weight form, its input
  permutation is folded into its weight and the plain formula runs (weight
  forms of gate and up then gather no activations at all).
  When the gate and up output permutations and down's input permutation
  are tied (:func:`poetx_jax.tie_permutations`), the hidden activation stays
  in that one order: no gather between the layers at all.

  Args:
    gate, up, down: the three projections (``nnx.Linear`` or POETLinear).
    x: the input (..., hidden).
    activation: applied to the gate's output.
    hidden_name: a ``jax.ad_checkpoint.checkpoint_name`` for the hidden
      activation (for rematerialisation policies), or None.
    inputs: instead of ``x``, the gate's and the up projection's inputs,
      each already in its input order (:func:`rms_norm_in_orders`).

  Example::

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import poetx_jax
    >>> lin = lambda i, o, s: nnx.Linear(i, o, use_bias=False, rngs=nnx.Rngs(s))
    >>> mlp = nnx.Dict(gate=lin(32, 64, 0), up=lin(32, 64, 1), down=lin(64, 32, 2))
    >>> poet = poetx_jax.poetize(mlp, block_size=16, rngs=nnx.Rngs(3))
    >>> x = jnp.ones((2, 32))
    >>> y = poetx_jax.swiglu(poet['gate'], poet['up'], poet['down'], x)
    >>> want = poet['down'](jax.nn.silu(poet['gate'](x)) * poet['up'](x))
    >>> bool(jnp.allclose(y, want, atol=1e-6))
    True
  """
  name = (lambda h: checkpoint_name(h, hidden_name)) if hidden_name else (lambda h: h)
  given = {} if inputs is None else {id(gate): inputs[0], id(up): inputs[1]}
  call = lambda lin, **kw: (lin(given[id(lin)], permute_input=False, **kw) if given
                            else lin(x, **kw))
  if not all(isinstance(lin, POETLinear) for lin in (gate, up, down)):
    return down(name(activation(call(gate)) * call(up)))
  if tied([(gate, 'out'), (up, 'out'), (down, 'in')]):  # one permutation: no gather
    g, u = project((gate, up), x, permute_output=False, inputs=inputs)
    return down(name(activation(g) * u), permute_input=False)
  rows = (inputs[0] if inputs else x).shape[:-1]
  if down.form_for((*rows, down.in_features)) == 'weight':
    return down(name(activation(call(gate)) * call(up)))
  perm = down.perm_in[...]
  inverse = given_inverses(down)

  def joined(lin):  # lin's output in down's input order, one gather
    dtype = (inputs[0] if inputs else x).dtype
    chunk = ops.joint_chunk(lin.chunk, down.chunk)  # the composed index's run length
    if lin.chunk == chunk and fuses_gather(lin, lin.out_features, lin.compute_dtype(dtype)):
      # the gather in lin's output kernel: placed straight in down's order
      inverse_in = ops.invert_permutation(perm) if inverse is None else inverse[0]
      return call(lin, output_dst=jnp.take(inverse_in, lin.perm_out[...]))
    h, inverses = call(lin, permute_output=False), given_inverses(lin)
    if inverses is None or inverse is None:
      return ops.permute(h, ops.gather_between(lin.perm_out[...], perm), chunk=chunk)
    return ops.permute(h, ops.gather_between(lin.perm_out[...], perm, inverses[1]),
                       jnp.take(inverse[0], lin.perm_out[...]), chunk=chunk)

  return down(name(activation(joined(gate)) * joined(up)), permute_input=False)
