"""poetx_jax: POET-X orthogonal-equivalence training in JAX / Flax NNX.

Every linear weight trains as ``R W0 P`` with W0 frozen and R, P learned
block-diagonal orthogonal matrices (Cayley–Neumann parameterised, randomly
permuted, periodically merged into W0).

The library, what a Flax training loop imports (needs jax, flax and optax):
``ops`` (the maths), ``POETLinear``, ``poetize`` / ``unpoetize``, the merge
cycle (``merge``), the optax transformations (``poetx``, ``lean_adamw``), the
train step and ``sharding``. The Llama pretraining app built on it lives in
``poetx_jax.pretrain`` (the ``pretrain`` extra) and ``poetx_jax.models``.

The names below load their module on first use (PEP 562): importing the
package, or a module of it that needs none of them, does not import jax, so
the ``poetx`` command can take its signals before the seconds that takes.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__version__ = '0.1.0'

# The module of poetx_jax that defines each public name.
_MODULES = {
    'convert': 'check_permutations effective_kernel for_each_layer orthogonality_error '
               'poet_layers poetize to_linear unpoetize',
    'cycle': 'MergeClock merge merge_due merge_layer',
    'factored': 'FactoredRMSState factored_moments_like is_factored scale_by_factored_rms '
                'update_factored_moment',
    'hyperparams': 'check_hyperparameters',
    'lean': 'lean_adamw scale_by_lean_adam',
    'muon': 'default_poet_muon_lr orthogonalize_skew poetx_muon scale_by_poetx_muon',
    'groups': 'batched_series linear_operands swiglu',
    'linear': 'FrozenKernel Permutation POETLinear POETParam',
    'optim': 'ScaleByPoetxState clip_by_global_norm_after_merge default_poet_lr '
             'merge_clip_bound poetx poetx_labels poetx_partition scale_by_poetx',
    'skewadam': 'poetx_skewadam scale_by_skewadam skewadam skewadam_labels state_bytes',
    'step': 'make_train_step',
    'ties': 'tie_permutations',
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names.split()}

__all__ = ['ops', *sorted(_WHERE)]


def __getattr__(name: str):
  """A public name (its module imported now), or a submodule of poetx_jax."""
  if name in _WHERE:
    value = getattr(importlib.import_module(f'{__name__}.{_WHERE[name]}'), name)
  elif not name.startswith('_') and importlib.util.find_spec(f'{__name__}.{name}'):
    value = importlib.import_module(f'{__name__}.{name}')
  else:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
  """The package's module type: the import system, loading a submodule named
  like a public name (``skewadam``, module and function), does not bind the
  module over the name, which stays the function (as an eager
  ``from poetx_jax.skewadam import skewadam`` here would leave it)."""

  def __setattr__(self, name, value):
    if not (name in _WHERE and isinstance(value, types.ModuleType)):
      super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
