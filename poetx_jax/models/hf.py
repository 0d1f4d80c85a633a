"""The Hugging Face ``LlamaForCausalLM`` form of a Llama: config.json,
generation_config.json and weights, out and in.

The model's attribute paths follow ``LlamaForCausalLM`` (``embed_tokens``,
``layers/i/self_attn/q_proj``, ..., ``norm``, ``lm_head``), so the weights map
one to one; linear weights are (out, in) = kernel.T. Rotary embeddings use
the same "rotate_half" convention, so no permutation is needed.

Out: :func:`hf_config` and :func:`hf_state_dict`. In: :func:`from_hf` reads a
checkpoint (a directory, or a config dict and a state dict) as a
:class:`LlamaConfig` and its weights, :func:`build_from_hf` builds the model
holding them without drawing random weights first (each decoder layer filled,
then converted, e.g. poetized, as it is built), :func:`load_hf_weights` fills
a model already built. config.json is read and written by
:mod:`poetx_jax.models.hf_json` (:func:`llama_config`, :func:`hf_config`,
both given here)::

    config, weights = hf.from_hf('exported/')
    model = hf.build_from_hf(config, weights, scan_layers=True)
    logits = model(tokens)
"""

from __future__ import annotations

import functools
import os
import typing as tp

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from poetx_jax.models import hf_files
from poetx_jax.models.hf_json import (check_exportable, hf_config, hf_generation_config,
                                      llama_config)
from poetx_jax.models.llama import Llama, LlamaConfig, RMSNorm
from poetx_jax.models.stack import StackedLayers

Array = jax.Array

# The dtypes weights are written in: config.json's torch_dtype -> numpy dtype.
DTYPES = {'float32': np.dtype(np.float32), 'bfloat16': np.dtype(ml_dtypes.bfloat16)}
# Each decoder layer's weights, in the order of LlamaForCausalLM's state dict:
# ``model.layers.{i}.{part}.weight`` is the kernel (transposed) of that
# nnx.Linear of layer i, or the weight of that RMSNorm.
LAYER_PARTS = ('input_layernorm', 'self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj',
               'self_attn.o_proj', 'post_attention_layernorm', 'mlp.gate_proj',
               'mlp.up_proj', 'mlp.down_proj')

__all__ = ['DTYPES', 'LAYER_PARTS', 'build_from_hf', 'check_exportable', 'check_weights',
           'from_hf', 'hf_config', 'hf_generation_config', 'hf_shapes', 'hf_state_dict',
           'llama_config', 'load_hf_weights']


def _dtype(name: str) -> np.dtype:
  """The numpy dtype of a name of :data:`DTYPES`."""
  if name not in DTYPES:
    raise ValueError(f'dtype must be one of {tuple(DTYPES)}, got {name!r}')
  return DTYPES[name]


def hf_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """{HF name: shape} of the weights of ``config``'s ``LlamaForCausalLM``, in
  its state dict's order."""
  h, m, v = config.hidden, config.mlp, config.vocab_size
  q, kv = config.heads * config.head_dim, config.kv_heads * config.head_dim
  part = {'input_layernorm': (h,), 'self_attn.q_proj': (q, h), 'self_attn.k_proj': (kv, h),
          'self_attn.v_proj': (kv, h), 'self_attn.o_proj': (h, q),
          'post_attention_layernorm': (h,), 'mlp.gate_proj': (m, h), 'mlp.up_proj': (m, h),
          'mlp.down_proj': (h, m)}
  shapes = {'model.embed_tokens.weight': (v, h)}
  for i in range(config.layers):
    shapes.update({f'model.layers.{i}.{p}.weight': part[p] for p in LAYER_PARTS})
  shapes['model.norm.weight'] = (h,)
  if not config.tie_embeddings:
    shapes['lm_head.weight'] = (v, h)
  return shapes


def _variable(module, dotted: str, where: str = '') -> tuple[nnx.Variable, bool]:
  """(the weight variable of the layer at ``dotted``, whether HF stores it
  transposed): a plain nnx.Linear's kernel, an RMSNorm's or nnx.Embed's weight."""
  layer = functools.reduce(getattr, dotted.split('.'), module)
  if type(layer) is nnx.Linear and layer.bias is None:
    return layer.kernel, True
  if isinstance(layer, RMSNorm):
    return layer.weight, False
  if type(layer) is nnx.Embed:
    return layer.embedding, False
  raise ValueError(f'{where}{dotted} is a {type(layer).__name__}, not a bias-free '
                   f'nnx.Linear, nnx.Embed or RMSNorm; call poetx_jax.unpoetize(model) '
                   f'first to merge POET layers')


def hf_state_dict(model: Llama, *, dtype: str = 'float32') -> dict[str, np.ndarray]:
  """Numpy weights under Hugging Face ``LlamaForCausalLM`` names, in its order.

  Linear weights are (out, in) = kernel.T. Every projection must be a plain
  ``nnx.Linear``; a POET model raises ValueError (unpoetize it first).

  Args:
    model: a dense Llama (unrolled or scanned layers).
    dtype: ``'float32'`` or ``'bfloat16'`` (``ml_dtypes.bfloat16`` arrays).
  """
  if not isinstance(model, Llama):
    raise ValueError(f'model must be a dense Llama, got {type(model).__name__}')
  check_exportable(model.config)
  np_dtype = _dtype(dtype)

  def weight(module, dotted, where=''):
    var, transpose = _variable(module, dotted, where)
    x = jnp.asarray(var[...], jnp.float32).astype(np_dtype)
    return np.ascontiguousarray(np.asarray(jax.device_get(x.T if transpose else x)))

  sd = {'model.embed_tokens.weight': weight(model, 'embed_tokens')}
  for i, layer in enumerate(model.layers):
    for part in LAYER_PARTS:
      sd[f'model.layers.{i}.{part}.weight'] = weight(layer, part, f'model.layers.{i}.')
  sd['model.norm.weight'] = weight(model, 'norm')
  if not model.config.tie_embeddings:
    sd['lm_head.weight'] = weight(model, 'lm_head')
  return sd


# Tensors some checkpoints hold that are no weights: rotary tables, which
# this Llama computes from rope_theta.
_BUFFERS = ('.rotary_emb.inv_freq',)


def _shapes(weights: tp.Mapping[str, tp.Any]) -> dict[str, tuple[int, ...]]:
  shapes = getattr(weights, 'shapes', None)  # hf_files.Weights: from the headers
  return dict(shapes) if shapes is not None else {k: np.shape(x) for k, x in weights.items()}


def check_weights(config: LlamaConfig, weights: tp.Mapping[str, tp.Any]) -> None:
  """Raises ValueError unless ``weights`` holds exactly the tensors of
  ``config``'s ``LlamaForCausalLM``, each of its shape, naming the first that
  is missing, unexpected or of another shape. Rotary tables (``inv_freq``)
  and, with tied embeddings, an ``lm_head.weight`` are allowed and unused."""
  want, have = hf_shapes(config), _shapes(weights)
  extra = sorted(k for k in set(have) - set(want) if not k.endswith(_BUFFERS)
                 and not (config.tie_embeddings and k == 'lm_head.weight'))
  missing = [k for k in want if k not in have]
  if missing or extra:
    raise ValueError(
        f'the weights are not those of the config\'s LlamaForCausalLM ({config.layers} '
        f'layers, tie_word_embeddings={config.tie_embeddings}): '
        + '; '.join(f'{what} {names[:3]}{" ..." if len(names) > 3 else ""}'
                    for what, names in (('missing', missing), ('unexpected', extra)) if names))
  for name, shape in want.items():
    if tuple(have[name]) != shape:
      raise ValueError(f'{name} has shape {tuple(have[name])}; config.json (hidden_size='
                       f'{config.hidden}, intermediate_size={config.mlp}, vocab_size='
                       f'{config.vocab_size}, heads {config.heads}/{config.kv_heads}) '
                       f'gives {shape}')


def from_hf(source: str | os.PathLike | tuple[tp.Mapping, tp.Mapping], *,
            block_size: int | None = None) -> tuple[LlamaConfig, tp.Mapping[str, np.ndarray]]:
  """A Hugging Face ``LlamaForCausalLM`` checkpoint as ``(config, weights)``:
  the inverse of (:func:`hf_config`, :func:`hf_state_dict`).

  Args:
    source: a model directory (``config.json`` and ``model.safetensors``, or
      shards with ``model.safetensors.index.json``; read with the safetensors
      package), or ``(config.json dict, state dict)`` of numpy arrays.
    block_size: the POET block size to suggest (:func:`llama_config`).

  Returns:
    The :class:`LlamaConfig` and the weights by HF name; a directory's are
    read one at a time as they are looked up (:class:`hf_files.Weights`).
    Give them to :func:`build_from_hf` or :func:`load_hf_weights`.

  Raises:
    ValueError: an unsupported config field, a missing file, or weights that
      are not those of the config (:func:`check_weights`), named.
  """
  if isinstance(source, (str, os.PathLike)):
    root = os.fspath(source)
    path = os.path.join(root, 'config.json')
    if not os.path.isfile(path):
      raise ValueError(f'{root} is not a Hugging Face model directory: it has no '
                       f'config.json')
    hf = hf_files.read_json_object(path, ': not a Hugging Face config')
    weights = hf_files.read_weights(root)
  elif isinstance(source, tp.Sequence) and len(source) == 2:
    hf, weights = source
  else:
    raise ValueError(f'from_hf takes a model directory or a (config.json dict, state dict) '
                     f'pair, got {type(source).__name__}')
  config = llama_config(hf, block_size=block_size)
  check_weights(config, weights)
  return config, weights


def _fill(var: nnx.Variable, x: np.ndarray | list, transpose: bool) -> None:
  """Sets ``var`` (concrete or abstract) to ``x`` (or the stack of the list's
  arrays), transposed to (in, out) where ``transpose``, in ``var``'s dtype and
  on its devices."""
  old = var.get_value()
  if isinstance(x, list):
    x = np.stack([np.asarray(a).T if transpose else np.asarray(a) for a in x])
  else:
    x = np.asarray(x).T if transpose else np.asarray(x)
  value = jnp.asarray(x.astype(np.dtype(old.dtype), copy=False))
  if getattr(old, 'sharding', None) is not None:  # an array's, or an abstract one's
    value = jax.device_put(value, old.sharding)
  var.set_value(value)


def _fill_layer(layer, weights: tp.Mapping, i: int | range) -> None:
  """Fills decoder layer ``i`` (a range: a stacked layer) from ``weights``."""
  for part in LAYER_PARTS:
    var, transpose = _variable(layer, part)
    if isinstance(i, range):
      _fill(var, [weights[f'model.layers.{j}.{part}.weight'] for j in i], transpose)
    else:
      _fill(var, weights[f'model.layers.{i}.{part}.weight'], transpose)


def _fill_top(model: Llama, weights: tp.Mapping) -> None:
  for name, attr in (('model.embed_tokens.weight', 'embed_tokens'),
                     ('model.norm.weight', 'norm'), ('lm_head.weight', 'lm_head')):
    if attr != 'lm_head' or not model.config.tie_embeddings:
      var, transpose = _variable(model, attr)
      _fill(var, weights[name], transpose)


def load_hf_weights(model: Llama, weights: tp.Mapping[str, tp.Any]) -> Llama:
  """Sets every weight of a dense ``model`` to ``weights`` (HF names), in place.

  The model may be built (its values replaced, each on the devices and in the
  dtype it had) or abstract (``nnx.eval_shape``: its values become arrays on
  the default device, and no random weights were ever drawn); its layers
  unrolled or scanned (:class:`StackedLayers`: each variable filled with the
  stack of the layers' tensors). Its projections must be plain
  ``nnx.Linear`` (load before poetizing, or use :func:`build_from_hf`).

  Returns:
    ``model``.

  Raises:
    ValueError: the weights are not those of ``model.config``
      (:func:`check_weights`) or a layer is not plain.
  """
  if not isinstance(model, Llama):
    raise ValueError(f'model must be a dense Llama, got {type(model).__name__}')
  check_exportable(model.config, doing='import')
  check_weights(model.config, weights)
  if isinstance(model.layers, StackedLayers):
    _fill_layer(model.layers.layer, weights, range(model.config.layers))
  else:
    for i, layer in enumerate(model.layers):
      _fill_layer(layer, weights, i)
  _fill_top(model, weights)
  return model


def build_from_hf(config: LlamaConfig, weights: tp.Mapping[str, tp.Any], *,
                  convert_layer: tp.Callable[[nnx.Module], nnx.Module] | None = None,
                  scan_layers: bool = False,
                  place: tp.Callable[[tuple], jax.sharding.Sharding] | None = None,
                  **kwargs: tp.Any) -> Llama:
  """``config.build(...)`` holding ``weights``, with no random weights drawn.

  The model is built abstractly (``nnx.eval_shape``) and filled: each decoder
  layer with its tensors and then given to ``convert_layer`` before the next
  is filled, so a conversion that consumes the dense kernels (``poetize(...,
  consume=True)``) keeps one layer's dense weights beside the model; the
  embedding, norm and head last. The result is the model ``config.build``
  makes with the same options (the same structure, shapes and dtypes).

  Args:
    config: the model's configuration (:func:`from_hf`).
    weights: its tensors by HF name (:func:`from_hf`), checked first
      (:func:`check_weights`).
    convert_layer, scan_layers, place: as :class:`Llama` takes them.
    **kwargs: the other options of :class:`Llama` (dtype, param_dtype, remat,
      attention); not ``rngs``.

  Example::

    >>> import jax.numpy as jnp
    >>> from poetx_jax.models import get_config, hf
    >>> config = get_config('tiny', layers=1)
    >>> model = config.build(rngs=nnx.Rngs(0))
    >>> copy = hf.build_from_hf(config, hf.hf_state_dict(model), scan_layers=True)
    >>> tokens = jnp.zeros((1, 4), jnp.int32)
    >>> bool(jnp.allclose(copy(tokens), model(tokens), atol=1e-5))
    True
  """
  check_exportable(config, doing='import')
  if 'rngs' in kwargs:
    raise ValueError('build_from_hf draws no weights: give no rngs')
  if place is not None and not scan_layers:
    raise ValueError('place needs scan_layers=True (it shards the stacked layers)')
  check_weights(config, weights)
  model = nnx.eval_shape(lambda: config.build(rngs=nnx.Rngs(0), **kwargs))
  dense = list(model.layers)  # abstract: no memory
  convert = convert_layer or (lambda layer: layer)

  def make_layer(i):
    layer, dense[i] = dense[i], None
    _fill_layer(layer, weights, i)
    return convert(layer)

  if scan_layers:
    model.layers = StackedLayers(make_layer, config.layers, place=place)
  else:
    model.layers = nnx.List([make_layer(i) for i in range(config.layers)])
  _fill_top(model, weights)
  return model
