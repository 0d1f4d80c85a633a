"""config.json both ways: the Hugging Face ``LlamaConfig`` dict of a
:class:`~poetx_jax.models.llama.LlamaConfig` (:func:`hf_config`, with
generation_config.json's :func:`hf_generation_config`) and back
(:func:`llama_config`, which reads or refuses every field by name).
:mod:`poetx_jax.models.hf` gives these with the weights.
"""

from __future__ import annotations

import numbers

import dataclasses
import typing as tp

from poetx_jax.models.llama import Llama, LlamaConfig

# The dtypes weights are written in (config.json's torch_dtype).
DTYPES = ('float32', 'bfloat16')


def check_exportable(config: LlamaConfig, *, doing: str = 'export') -> None:
  """Raises ValueError unless ``config`` describes a model with a Hugging Face
  ``LlamaForCausalLM`` form: a dense :class:`Llama` (a mixture-of-experts
  model has none yet). ``doing``: ``'export'``, or ``'import'`` for the
  message of a model to be read from one."""
  if not isinstance(config, LlamaConfig) or config.model_class is not Llama:
    what = getattr(config, 'model_class', type(config)).__name__
    if doing == 'import':
      raise ValueError(f'import reads the Hugging Face Llama layout into a dense Llama (its '
                       f'LlamaConfig from from_hf); a {what} ({type(config).__name__}) has '
                       f'no such form yet')
    raise ValueError(f'export writes the Hugging Face Llama layout: a {what} '
                     f'({type(config).__name__}) has no export yet')


def hf_config(config: LlamaConfig, *, bos_token_id: int | None = None,
              eos_token_id: int | None = None, pad_token_id: int | None = None,
              torch_dtype: str = 'float32') -> dict:
  """The Hugging Face ``LlamaConfig`` (config.json) dict for ``config``.

  Args:
    config: the model's configuration.
    bos_token_id, eos_token_id, pad_token_id: the tokenizer's special-token ids.
      Give them: where config.json lacks one, transformers falls back to the
      Llama defaults (BOS 1, EOS 2), which are ordinary tokens of another
      tokenizer. Each given id must be in ``[0, config.vocab_size)``.
    torch_dtype: the dtype of the weights written beside it (:data:`DTYPES`).

  Returns:
    The config.json dict (``LlamaForCausalLM``); :func:`llama_config` reads it back.

  Raises:
    ValueError: the config has no such form (:func:`check_exportable`), or
      an id is outside the vocabulary.
  """
  check_exportable(config)
  if torch_dtype not in DTYPES:
    raise ValueError(f'torch_dtype must be one of {DTYPES}, got {torch_dtype!r}')
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
      'torch_dtype': torch_dtype,
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
  """The given ids (Python or numpy ints), each checked to be a token of the
  model's vocabulary, as Python ints."""
  for name, i in ids.items():
    if i is not None and not (isinstance(i, numbers.Integral) and not isinstance(i, bool)
                              and 0 <= i < config.vocab_size):
      raise ValueError(f'{name}={i!r} is not a token id of a vocabulary of '
                       f'{config.vocab_size}: expected an int in [0, {config.vocab_size})')
  return {name: int(i) for name, i in ids.items() if i is not None}  # numpy ints: JSON's




# ------------------------------------------------------------------------ import

# config.json fields read into a LlamaConfig: those it must have, and the
# others with Hugging Face's defaults (num_key_value_heads: num_attention_heads).
_REQUIRED = ('vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
             'num_attention_heads')
_DEFAULTS = {'num_key_value_heads': None, 'max_position_embeddings': 2048,
             'rms_norm_eps': 1e-6, 'rope_theta': 10000.0, 'tie_word_embeddings': False,
             'initializer_range': 0.02}
# Fields that must hold the value this Llama computes with (or be absent).
_FIXED = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'hidden_act': 'silu',
          'attention_bias': False, 'mlp_bias': False, 'attention_dropout': 0.0}
# Fields checked below: head_dim (hidden / heads), rope_scaling and
# rope_parameters (none, or the 'default' type).
_CHECKED = ('head_dim', 'rope_scaling', 'rope_parameters')
# Fields that do not change the function: token ids, dtype, versions, caching,
# the tensor-parallel split of the original training (the same products),
# output flags and generation settings of older configs.
_IGNORED = frozenset({
    'bos_token_id', 'eos_token_id', 'pad_token_id', 'torch_dtype', 'dtype',
    'transformers_version', '_name_or_path', 'use_cache', 'pretraining_tp',
    'output_attentions', 'output_hidden_states', 'return_dict', 'tokenizer_class',
    'max_length', 'min_length', 'do_sample', 'num_beams', 'temperature', 'top_k', 'top_p',
    'repetition_penalty', 'length_penalty', 'num_return_sequences', 'early_stopping'})


def _refuse_unsupported(hf: tp.Mapping[str, tp.Any]) -> None:
  """Raises ValueError naming the first config.json field this Llama cannot honour."""
  read = {*_REQUIRED, *_DEFAULTS, *_FIXED, *_CHECKED}
  unknown = sorted(set(hf) - read - _IGNORED)
  if unknown:
    raise ValueError(f'config.json field(s) {unknown} are not supported (a Llama with '
                     f'them computes something this model does not); supported: '
                     f'{sorted(read)}')
  for key, want in _FIXED.items():
    if key in hf and hf[key] != want:
      raise ValueError(f'config.json {key}={hf[key]!r} is not supported: this Llama has '
                       f'{key}={want!r}')
  for key in ('rope_scaling', 'rope_parameters'):
    rope = hf.get(key)
    kind = (rope.get('rope_type', rope.get('type')) if isinstance(rope, dict) else rope)
    if rope is not None and kind != 'default':
      raise ValueError(f'config.json {key}={rope!r} is not supported: this Llama has '
                       f'plain rotary embeddings (rope type "default")')
  heads = hf.get('num_attention_heads')
  hidden = hf.get('hidden_size')
  if hf.get('head_dim') is not None and isinstance(heads, int) and heads > 0 and (
      hf['head_dim'] * heads != hidden):
    raise ValueError(f'config.json head_dim={hf["head_dim"]!r} is not supported: this Llama '
                     f'has head_dim = hidden_size / num_attention_heads = '
                     f'{hidden} / {heads}')


def llama_config(hf: tp.Mapping[str, tp.Any], *, block_size: int | None = None
                 ) -> LlamaConfig:
  """The :class:`LlamaConfig` of a Hugging Face ``LlamaForCausalLM`` config.json
  dict (the inverse of :func:`hf_config`).

  Every field is read or refused by name: the shapes, ``max_position_embeddings``,
  ``rms_norm_eps``, ``rope_theta`` (or ``rope_parameters`` of the default
  type), ``tie_word_embeddings`` and ``initializer_range`` are read; token ids,
  dtypes, versions and other settings that do not change the function are
  ignored; rope scaling, attention or MLP biases, an activation other than
  SiLU, attention dropout, ``head_dim`` other than hidden / heads, another
  architecture and any field not known here are refused.

  Args:
    hf: the config.json dict.
    block_size: the POET block size to suggest (``LlamaConfig.block_size``);
      default the smallest projection dimension, at most 256.

  Raises:
    ValueError: naming the field that is unsupported, missing or invalid.
  """
  if not isinstance(hf, tp.Mapping):
    raise ValueError(f'a config.json dict is needed, got {type(hf).__name__}')
  missing = [k for k in _REQUIRED if hf.get(k) is None]
  if missing:
    raise ValueError(f'config.json lacks {missing}: not a LlamaForCausalLM config')
  _refuse_unsupported(hf)

  def get(key):  # a field absent or null takes Hugging Face's default
    return hf[key] if hf.get(key) is not None else _DEFAULTS[key]

  rope = hf.get('rope_parameters')
  rope = rope if isinstance(rope, tp.Mapping) else {}  # None or 'default' (checked above)
  kv_heads = get('num_key_value_heads')  # 0 is refused below, not taken for "absent"
  kw = dict(vocab_size=get('vocab_size'), hidden=get('hidden_size'),
            mlp=get('intermediate_size'), layers=get('num_hidden_layers'),
            heads=get('num_attention_heads'),
            kv_heads=kv_heads if kv_heads is not None else get('num_attention_heads'),
            max_seq_len=get('max_position_embeddings'), norm_eps=get('rms_norm_eps'),
            rope_theta=rope.get('rope_theta', get('rope_theta')),
            tie_embeddings=get('tie_word_embeddings'), init_std=get('initializer_range'))
  kw = {k: float(v) if k in ('norm_eps', 'rope_theta', 'init_std')
        and isinstance(v, int) and not isinstance(v, bool) else v for k, v in kw.items()}
  try:
    config = LlamaConfig(**kw)
  except ValueError as e:
    raise ValueError(f'config.json does not describe a valid Llama: {e}') from None
  if block_size is None:
    dims = (config.hidden, config.mlp, config.kv_heads * config.head_dim)
    block_size = min(256, *dims)
  try:
    return dataclasses.replace(config, block_size=block_size)
  except ValueError as e:  # the argument's, not config.json's
    raise ValueError(f'llama_config(block_size={block_size!r}): {e}') from None
