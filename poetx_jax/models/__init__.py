"""Model definitions built from plain Flax NNX layers (POET enters by ``poetize``).

One contract for every model: a config (:class:`~poetx_jax.models.llama.LlamaConfig`
or a subclass) names its model class and builds it (``config.build(rngs=...)``);
the model's ``forward(tokens)`` gives ``(logits, aux)``, ``aux`` the auxiliary
outputs it reports (``{}`` for a dense Llama; the routing and ``aux_loss`` of a
mixture-of-experts Llama), and calling it gives the logits.

    >>> from flax import nnx
    >>> from poetx_jax.models import get_config
    >>> sorted(CONFIGS)[:3]
    ['130m', '13b', '1b']
    >>> type(get_config('moe-tiny', layers=1).build(rngs=nnx.Rngs(0))).__name__
    'MoELlama'
"""

from __future__ import annotations

import dataclasses
import typing as tp

import jax
import numpy as np
from flax import nnx

from poetx_jax.models.llama import CONFIGS as DENSE_CONFIGS
from poetx_jax.models.llama import Llama, LlamaConfig
from poetx_jax.models.moe import MOE_CONFIGS, MoEConfig, MoELlama

# Every named config, dense and mixture-of-experts.
CONFIGS: dict[str, LlamaConfig] = {**DENSE_CONFIGS, **MOE_CONFIGS}

__all__ = ['CONFIGS', 'Llama', 'LlamaConfig', 'MoEConfig', 'MoELlama', 'get_config',
           'init_model']


def get_config(name: str, **overrides) -> LlamaConfig:
  """The named config of :data:`CONFIGS`, with fields replaced by ``overrides``."""
  if name not in CONFIGS:
    raise ValueError(f'unknown model config {name!r}; valid names: {sorted(CONFIGS)}')
  config = CONFIGS[name]
  fields = [f.name for f in dataclasses.fields(config)]
  bad = sorted(set(overrides) - set(fields))
  if bad:
    raise ValueError(f'unknown {type(config).__name__} field(s) {bad}; valid fields: {fields}')
  return dataclasses.replace(config, **overrides)


def init_model(config: LlamaConfig, *, seed: int = 0, **kwargs: tp.Any) -> Llama:
  """``config.build(rngs=nnx.Rngs(seed), **kwargs)``: the model the config
  describes (``kwargs``: the options of :class:`Llama`), its parameters drawn
  on the device.

  Built op by op rather than in one jitted program: each initialiser is one
  small compiled program per parameter shape, reused by every layer, where a
  whole-model program compiles a copy of it per layer (for Llama-1B on an
  H200, about a minute against seconds).
  """
  if not isinstance(config, LlamaConfig):
    raise ValueError(f'config must be a LlamaConfig or a subclass, got '
                     f'{type(config).__name__}')
  if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
    raise ValueError(f'seed must be an int, got {seed!r}')
  return config.build(rngs=nnx.Rngs(jax.random.key(int(seed))), **kwargs)
