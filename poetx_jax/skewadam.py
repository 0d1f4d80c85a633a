"""SkewAdam: optimizer state sized per parameter population of an MoE model.

Dimensions: L layers, E experts, I / O in / out features, R / C the last two
axes of a leaf. A label per leaf (:func:`skewadam_labels`) picks its state
through ``optax.partition``: ``'backbone'`` a float32 momentum and factored
second moments (:func:`poetx_jax.scale_by_lean_adam`); ``'experts'`` (stacked
(E, I, O) or (L, E, I, O) weights) and ``'embeddings'`` factored second
moments only, I + O numbers per matrix (:func:`poetx_jax.scale_by_factored_rms`);
``'router'`` Adam; ``'poetx'`` (:func:`poetx_skewadam`) POET-X. Only the shared
backbone (attention, norms) keeps a momentum.

Reference: "SkewAdam", arXiv 2026 (cs.LG).
"""

from __future__ import annotations

import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

# FactoredRMSState stays importable from here, beside the tiers built on it.
from poetx_jax.factored import FactoredRMSState, scale_by_factored_rms  # noqa: F401
from poetx_jax.hyperparams import check_hyperparameters
from poetx_jax.lean import scale_by_lean_adam
from poetx_jax.linear import POETParam

TIERS = ('backbone', 'experts', 'router', 'embeddings')
EMBEDDING_NAMES = ('embed_tokens', 'lm_head')
DEFAULT_MIN_DIM = 128


def _label(path, leaf, poet: bool) -> str:
  if poet and isinstance(leaf, POETParam):
    return 'poetx'
  name = jax.tree_util.keystr(path, simple=True, separator='/')
  if 'experts' in name:
    return 'experts'
  if 'router' in name:
    return 'router'
  if any(e in name for e in EMBEDDING_NAMES):
    return 'embeddings'
  return 'backbone'


def skewadam_labels(params_or_state, *, poet: bool = True, wrt=nnx.Param):
  """The SkewAdam label of every leaf, from its '/'-joined path.

  A path containing ``'experts'`` is ``'experts'``; else ``'router'`` is
  ``'router'``; else ``'embed_tokens'`` or ``'lm_head'`` is ``'embeddings'``;
  else ``'backbone'`` (substrings: ``shared_experts`` is ``'experts'``; pass
  your own tree otherwise). With ``poet`` a :class:`poetx_jax.POETParam` is
  ``'poetx'`` whatever its path; that needs its type, so label a model or its
  ``nnx.state`` (not ``nnx.as_pure`` arrays) and pass the label tree on.

  Args:
    params_or_state: a pytree of arrays, an ``nnx.State`` of variables, or a
      model (then ``nnx.state(model, wrt)``).
    poet: label POET generators ``'poetx'``.
    wrt: with a model, the variables the optimizer updates.

  Returns:
    A pytree of label strings in the structure of the parameters.
  """
  if isinstance(params_or_state, nnx.Module):
    params_or_state = nnx.state(params_or_state, wrt)
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: _label(path, leaf, poet), params_or_state,
      is_leaf=lambda x: isinstance(x, nnx.Variable))


def _resolve_labels(labels, valid: tuple[str, ...], wrt):
  """A label tree or function whose labels are checked against ``valid``."""
  def check(tree):
    bad = sorted(set(jax.tree.leaves(tree)) - set(valid), key=repr)
    if bad:
      hint = (" (POET generators: use poetx_skewadam, or skewadam_labels(..., poet=False))"
              if 'poetx' in bad else '')
      raise ValueError(f'unknown SkewAdam label(s) {bad}; valid labels: {list(valid)}{hint}')
    return tree
  if labels is None:
    labels = skewadam_labels
  if isinstance(labels, nnx.Module):
    return check(skewadam_labels(labels, wrt=wrt or nnx.Param))
  if callable(labels):
    return lambda params: check(labels(params))
  return check(labels)


def _tiers(b1, b2, eps, min_dim_size_to_factor) -> dict[str, optax.GradientTransformation]:
  if min_dim_size_to_factor is None:
    min_dim_size_to_factor = DEFAULT_MIN_DIM
  lean = lambda min_dim: scale_by_lean_adam(b1, b2, eps, mu_dtype=jnp.float32,
                                            min_dim_size_to_factor=min_dim)
  return {'backbone': lean(min_dim_size_to_factor),
          'experts': scale_by_factored_rms(b2, eps,
                                           min_dim_size_to_factor=min_dim_size_to_factor),
          'router': lean(sys.maxsize),  # never factored: Adam, float32 state
          'embeddings': scale_by_factored_rms(b2, eps,
                                              min_dim_size_to_factor=min_dim_size_to_factor)}


def scale_by_skewadam(labels=None, *, b1: float = 0.9, b2: float = 0.999,
                      eps: float = 1e-8, min_dim_size_to_factor: int | None = None
                      ) -> optax.GradientTransformation:
  r"""SkewAdam's direction: a different state for each parameter tier.

  With ``t`` the update count, ``g`` the gradient and bias-corrected
  moments ``m_hat = m_t / (1 - b1^t)``, ``v_hat = v_t / (1 - b2^t)``:

  * backbone: ``m_t = b1 m_{t-1} + (1 - b1) g`` in float32,
    ``v`` factored into row / column means for matrices (last two sides
    >= ``min_dim_size_to_factor``), exact otherwise; ``u = m_hat / (sqrt(v_hat) + eps)``.
  * experts, embeddings: no ``m``; ``v`` factored per trailing matrix;
    ``u = g / (sqrt(v_hat) + eps)`` (:func:`poetx_jax.scale_by_factored_rms`). The
    method sets the experts' state; giving the embeddings and LM head the
    same is this implementation's choice (momentum only in the shared
    backbone: for ``moe-7b`` theirs would be 0.49 GiB, a third more state).
  * router: Adam, ``v_t = b2 v_{t-1} + (1 - b2) g^2`` exact in float32,
    ``u = m_hat / (sqrt(v_hat) + eps)``. The method asks for exact second
    moments for the router; the float32 momentum is this implementation's
    choice (the router is small; it then moves like the backbone).

  Args:
    labels: a pytree of labels in :data:`TIERS`, a function of the
      parameters returning one, or a model (its ``nnx.Param`` labelled);
      None: :func:`skewadam_labels`.
    b1, b2, eps: decay rates and denominator offset (traceable).
    min_dim_size_to_factor: factor only matrices whose last two sides are
      both at least this long (None: 128). Structural: under
      ``optax.inject_hyperparams`` name it (and a label function or model)
      in ``static_args``.

  Returns:
    An ``optax.partition`` over the four tiers.
  """
  return optax.partition(_tiers(b1, b2, eps, min_dim_size_to_factor),
                         _resolve_labels(labels, TIERS, None))


def skewadam(learning_rate, labels=None, *, b1: float = 0.9, b2: float = 0.999,
             eps: float = 1e-8, weight_decay: float = 0.0, mask=None,
             min_dim_size_to_factor: int | None = None) -> optax.GradientTransformation:
  """SkewAdam: :func:`scale_by_skewadam`, decoupled weight decay, learning rate.

  ``p <- p - lr_t * (u + weight_decay * p)`` (decay where ``mask`` is true).

  Example::

    >>> import jax, jax.numpy as jnp, poetx_jax
    >>> params = {'attn': {'kernel': jnp.ones((128, 128))},
    ...           'moe': {'router': {'kernel': jnp.ones((128, 4))},
    ...                   'experts': {'up': jnp.ones((4, 128, 256))}}}
    >>> poetx_jax.skewadam_labels(params)['moe']
    {'experts': {'up': 'experts'}, 'router': {'kernel': 'router'}}
    >>> tx = poetx_jax.skewadam(1e-3, weight_decay=0.1)
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    >>> poetx_jax.state_bytes(state, by_tier=True)['experts']  # 4 (128 + 256) + 2 words
    6152

  Args:
    learning_rate: a float or an optax schedule.
    labels, b1, b2, eps, min_dim_size_to_factor: see :func:`scale_by_skewadam`.
    weight_decay: decoupled weight decay rate.
    mask: where to decay, as ``optax.add_decayed_weights`` takes it.

  References:
    "SkewAdam", arXiv 2026 (cs.LG). Shazeer & Stern, Adafactor, ICML 2018.
  """
  check_hyperparameters(learning_rate=learning_rate, weight_decay=weight_decay)
  return optax.chain(
      scale_by_skewadam(labels, b1=b1, b2=b2, eps=eps,
                        min_dim_size_to_factor=min_dim_size_to_factor),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate))


def poetx_skewadam(labels, poet_tx: optax.GradientTransformation, learning_rate, *,
                   b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 0.0, mask=None,
                   min_dim_size_to_factor: int | None = None,
                   wrt=None) -> optax.GradientTransformation:
  """``optax.partition``: ``poet_tx`` on POET generators, SkewAdam's tiers on the rest.

  Like :func:`poetx_jax.poetx_partition` with :func:`skewadam` as the other
  optimizer, flattened into one partition over ``'poetx'`` and :data:`TIERS`.

  Example::

    >>> import optax, poetx_jax
    >>> from flax import nnx
    >>> model = poetx_jax.poetize(nnx.Linear(32, 32, rngs=nnx.Rngs(0)),
    ...                           block_size=8, rngs=nnx.Rngs(1))
    >>> tx = poetx_jax.poetx_skewadam(model, poetx_jax.poetx(1e-3), 1e-3)
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  Args:
    labels: a model (labelled by :func:`skewadam_labels`), or a label tree
      (or function: it sees plain arrays in ``nnx.Optimizer.update``, where
      POET generators cannot be told by type) over ``'poetx'`` and :data:`TIERS`.
    poet_tx: the POET-X optimizer (:func:`poetx_jax.poetx`).
    learning_rate, weight_decay, mask, b1, b2, eps, min_dim_size_to_factor:
      as in :func:`skewadam`, for the tiers.
    wrt: with a model, the variables the optimizer updates (None: ``nnx.Param``).
  """
  check_hyperparameters(learning_rate=learning_rate, weight_decay=weight_decay)
  tail = (optax.add_decayed_weights(weight_decay, mask),
          optax.scale_by_learning_rate(learning_rate))
  tiers = {k: optax.chain(tx, *tail)
           for k, tx in _tiers(b1, b2, eps, min_dim_size_to_factor).items()}
  return optax.partition({'poetx': poet_tx, **tiers},
                         _resolve_labels(labels, ('poetx',) + TIERS, wrt))


def _nbytes(x) -> int:
  """Bytes of an array leaf, concrete or abstract: its size times its
  dtype's item size (numpy's, so int4 counts one byte); 0 for a non-array."""
  if not (hasattr(x, 'shape') and hasattr(x, 'dtype')):
    return 0
  dtype = x.dtype
  extended = jax.dtypes.issubdtype(dtype, jax.dtypes.extended)  # PRNG keys
  return math.prod(x.shape) * (dtype.itemsize if extended else np.dtype(dtype).itemsize)


def state_bytes(tree, *, by_tier: bool = False) -> int | dict[str, int]:
  """Bytes of the arrays in a pytree: an optimizer state, a model's ``nnx.State``, ...

  Every array leaf counts its number of elements times its dtype's numpy
  item size (int4 one byte, bfloat16 two, a PRNG key its key data); abstract
  leaves (``jax.ShapeDtypeStruct``, e.g. from ``nnx.eval_shape``) count like
  the arrays they describe, so a state can be sized without allocating it.
  Leaves that are not arrays (Python numbers) count nothing.

  Example::

    >>> import jax, jax.numpy as jnp, poetx_jax
    >>> poetx_jax.state_bytes({'w': jnp.zeros((4, 8), jnp.bfloat16),
    ...                        'q': jax.ShapeDtypeStruct((3,), jnp.float32)})
    76

  Args:
    tree: any pytree.
    by_tier: break the count down by the groups of the first
      ``optax.partition`` state in ``tree`` (from :func:`skewadam`,
      :func:`scale_by_skewadam`, :func:`poetx_skewadam` or any partition).

  Returns:
    The bytes, or with ``by_tier`` a dict ``{label: bytes}``.
  """
  size = lambda tree: sum(_nbytes(x) for x in jax.tree.leaves(tree))
  if not by_tier:
    return size(tree)
  parts = [s for s in jax.tree.leaves(
      tree, is_leaf=lambda x: isinstance(x, optax.PartitionState))
           if isinstance(s, optax.PartitionState)]
  if not parts:
    raise ValueError('by_tier=True needs an optax.partition state (from skewadam, '
                     f'scale_by_skewadam or poetx_skewadam); got {type(tree).__name__}')
  return {k: size(v) for k, v in parts[0].inner_states.items()}
