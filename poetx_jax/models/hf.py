"""The Hugging Face ``LlamaForCausalLM`` form of a Llama: config.json,
generation_config.json and weights.

The model's attribute paths follow ``LlamaForCausalLM`` (``embed_tokens``,
``layers/i/self_attn/q_proj``, ..., ``norm``, ``lm_head``), so the weights map
one to one; linear weights are (out, in) = kernel.T. Rotary embeddings use
the same "rotate_half" convention, so no permutation is needed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from poetx_jax.models.llama import Llama, LlamaConfig

Array = jax.Array


def check_exportable(config: LlamaConfig) -> None:
  """Raises ValueError unless ``config`` describes a model with a Hugging Face
  ``LlamaForCausalLM`` form: a dense :class:`Llama` (a mixture-of-experts
  model has no export yet)."""
  if not isinstance(config, LlamaConfig) or config.model_class is not Llama:
    what = getattr(config, 'model_class', type(config)).__name__
    raise ValueError(f'export writes the Hugging Face Llama layout: a {what} '
                     f'({type(config).__name__}) has no export yet')


def hf_config(config: LlamaConfig, *, bos_token_id: int | None = None,
              eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict:
  """The Hugging Face ``LlamaConfig`` (config.json) dict for ``config``.

  Args:
    config: the model's configuration.
    bos_token_id, eos_token_id, pad_token_id: the tokenizer's special-token ids.
      Give them: where config.json lacks one, transformers falls back to the
      Llama defaults (BOS 1, EOS 2), which are ordinary tokens of another
      tokenizer. Each given id must be in ``[0, config.vocab_size)``.

  Returns:
    The config.json dict (``LlamaForCausalLM``, float32 weights).

  Raises:
    ValueError: the config has no such form (:func:`check_exportable`), or
      an id is outside the vocabulary.
  """
  check_exportable(config)
  ids = _token_ids(config, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                   pad_token_id=pad_token_id)
  return {
      'architectures': ['LlamaForCausalLM'],
      'model_type': 'llama',
      'hidden_size': config.hidden,
      'intermediate_size': config.mlp,
      'num_hidden_layers': config.layers,
      'num_attention_heads': config.heads,
      'num_key_value_heads': config.kv_heads,
      'head_dim': config.head_dim,
      'max_position_embeddings': config.max_seq_len,
      'rms_norm_eps': config.norm_eps,
      'rope_theta': config.rope_theta,
      'vocab_size': config.vocab_size,
      'tie_word_embeddings': config.tie_embeddings,
      'hidden_act': 'silu',
      'attention_bias': False,
      'mlp_bias': False,
      'initializer_range': config.init_std,
      'torch_dtype': 'float32',
      **ids,
  }


def hf_generation_config(config: LlamaConfig, *, bos_token_id: int, eos_token_id: int,
                         pad_token_id: int) -> dict:
  """The generation_config.json dict: ``generate()`` and text-generation
  pipelines stop at ``eos_token_id`` and pad with ``pad_token_id``; every
  other setting is transformers' default (greedy decoding)."""
  return _token_ids(config, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                    pad_token_id=pad_token_id)


def _token_ids(config: LlamaConfig, **ids: int | None) -> dict[str, int]:
  """The given ids, each checked to be a token of the model's vocabulary."""
  for name, i in ids.items():
    if i is not None and not (isinstance(i, int) and not isinstance(i, bool)
                              and 0 <= i < config.vocab_size):
      raise ValueError(f'{name}={i!r} is not a token id of a vocabulary of '
                       f'{config.vocab_size}: expected an int in [0, {config.vocab_size})')
  return {name: i for name, i in ids.items() if i is not None}


def _np32(x: Array) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(jax.device_get(jnp.asarray(x, jnp.float32))))


def _linear_weight(layer, name: str) -> np.ndarray:
  if type(layer) is not nnx.Linear:
    raise ValueError(f'{name} is a {type(layer).__name__}, not an nnx.Linear; call '
                     f'poetx_jax.unpoetize(model) first to merge POET layers')
  return _np32(layer.kernel[...].T)


def hf_state_dict(model: Llama) -> dict[str, np.ndarray]:
  """Float32 numpy weights under Hugging Face ``LlamaForCausalLM`` names.

  Linear weights are (out, in) = kernel.T. Every projection must be a plain
  ``nnx.Linear``; a POET model raises ValueError (unpoetize it first).
  """
  if not isinstance(model, Llama):
    raise ValueError(f'model must be a dense Llama, got {type(model).__name__}')
  check_exportable(model.config)
  if type(model.embed_tokens) is not nnx.Embed:
    raise ValueError(f'embed_tokens is a {type(model.embed_tokens).__name__}, not an '
                     f'nnx.Embed')
  sd = {'model.embed_tokens.weight': _np32(model.embed_tokens.embedding[...])}
  for i, layer in enumerate(model.layers):
    p = f'model.layers.{i}'
    sd[f'{p}.input_layernorm.weight'] = _np32(layer.input_layernorm.weight[...])
    for n in ('q_proj', 'k_proj', 'v_proj', 'o_proj'):
      sd[f'{p}.self_attn.{n}.weight'] = _linear_weight(
          getattr(layer.self_attn, n), f'{p}.self_attn.{n}')
    sd[f'{p}.post_attention_layernorm.weight'] = _np32(
        layer.post_attention_layernorm.weight[...])
    for n in ('gate_proj', 'up_proj', 'down_proj'):
      sd[f'{p}.mlp.{n}.weight'] = _linear_weight(getattr(layer.mlp, n), f'{p}.mlp.{n}')
  sd['model.norm.weight'] = _np32(model.norm.weight[...])
  if not model.config.tie_embeddings:
    sd['lm_head.weight'] = _linear_weight(model.lm_head, 'lm_head')
  return sd
