"""poetx_jax: POET-X orthogonal-equivalence training in JAX / Flax NNX.

Every linear weight trains as ``R W0 P`` with W0 frozen and R, P learned
block-diagonal orthogonal matrices (Cayley–Neumann parameterised, randomly
permuted, periodically merged into W0).

The library, what a Flax training loop imports (needs jax, flax and optax):
``ops`` (the maths), ``POETLinear``, ``poetize`` / ``unpoetize``, the merge
cycle (``merge``), the optax transformations (``poetx``, ``lean_adamw``), the
train step and ``sharding``. The Llama pretraining app built on it lives in
``poetx_jax.pretrain`` (the ``pretrain`` extra) and ``poetx_jax.models``.
"""

from poetx_jax import ops
from poetx_jax.convert import (
    effective_kernel,
    for_each_layer,
    orthogonality_error,
    poet_layers,
    poetize,
    to_linear,
    unpoetize,
)
from poetx_jax.cycle import MergeClock, merge, merge_due, merge_layer
from poetx_jax.factored import (
    FactoredRMSState,
    factored_moments_like,
    is_factored,
    scale_by_factored_rms,
    update_factored_moment,
)
from poetx_jax.hyperparams import check_hyperparameters
from poetx_jax.lean import lean_adamw, scale_by_lean_adam
from poetx_jax.groups import batched_series, linear_operands, swiglu
from poetx_jax.linear import FrozenKernel, Permutation, POETLinear, POETParam
from poetx_jax.optim import (
    ScaleByPoetxState,
    clip_by_global_norm_after_merge,
    default_poet_lr,
    merge_clip_bound,
    poetx,
    poetx_labels,
    poetx_partition,
    scale_by_poetx,
)
from poetx_jax.skewadam import (
    poetx_skewadam,
    scale_by_skewadam,
    skewadam,
    skewadam_labels,
    state_bytes,
)
from poetx_jax.step import make_train_step
from poetx_jax.ties import tie_permutations

__version__ = '0.1.0'

__all__ = [
    'FrozenKernel', 'MergeClock', 'POETLinear', 'POETParam', 'Permutation',
    'ScaleByPoetxState', 'batched_series', 'clip_by_global_norm_after_merge',
    'default_poet_lr',
    'effective_kernel', 'for_each_layer', 'lean_adamw', 'make_train_step', 'merge',
    'merge_clip_bound', 'merge_due', 'merge_layer', 'ops', 'orthogonality_error',
    'linear_operands', 'poet_layers', 'poetize', 'poetx', 'poetx_labels', 'poetx_partition',
    'scale_by_lean_adam', 'scale_by_poetx', 'swiglu', 'to_linear', 'unpoetize',
    'FactoredRMSState', 'poetx_skewadam', 'scale_by_factored_rms', 'scale_by_skewadam',
    'skewadam', 'skewadam_labels', 'state_bytes', 'check_hyperparameters', 'tie_permutations',
    'factored_moments_like', 'is_factored', 'update_factored_moment',
]
