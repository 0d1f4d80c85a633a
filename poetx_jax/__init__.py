"""poetx_jax: POET-X orthogonal-equivalence training in JAX / Flax NNX.

Every linear weight trains as ``R W0 P`` with W0 frozen and R, P learned
block-diagonal orthogonal matrices (Cayley–Neumann parameterised, randomly
permuted, periodically merged into W0).
"""

from poetx_jax import ops
from poetx_jax.convert import effective_kernel, merge, poet_layers, poetize, unpoetize
from poetx_jax.lean import lean_adamw, scale_by_lean_adam
from poetx_jax.linear import BaseKernel, Permutation, POETLinear, POETParam
from poetx_jax.optim import (
    ClipAfterMergeState,
    ScaleByPoetxState,
    clip_by_global_norm_after_merge,
    merge_clip_bound,
    merge_due,
    poetx,
    poetx_labels,
    poetx_partition,
    scale_by_poetx,
)
from poetx_jax.step import make_train_step

__version__ = '0.1.0'

__all__ = [
    'BaseKernel', 'ClipAfterMergeState', 'POETLinear', 'POETParam', 'Permutation',
    'ScaleByPoetxState', 'clip_by_global_norm_after_merge', 'effective_kernel',
    'lean_adamw', 'scale_by_lean_adam',
    'make_train_step', 'merge', 'merge_clip_bound', 'merge_due', 'ops',
    'poet_layers', 'poetize', 'poetx', 'poetx_labels', 'poetx_partition',
    'scale_by_poetx', 'unpoetize',
]
