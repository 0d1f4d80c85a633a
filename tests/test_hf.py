"""Hugging Face Llama checkpoints in: config.json read or refused by name, the
weights checked by name and shape, and export -> import giving the same
function, plain, scanned and poetized (tiny config, float32, CPU)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from conftest import rel_err
import poetx_jax
from poetx_jax.models import get_config, hf, hf_files

CFG = get_config('tiny', layers=2, vocab_size=97, hidden=32, mlp=64, heads=2, kv_heads=1)


@pytest.fixture(scope='module')
def model():
  return CFG.build(rngs=nnx.Rngs(0))


@nnx.jit
def _forward(m, tokens):
  return m(tokens)


def _tokens(key):
  return jax.random.randint(key, (2, 12), 0, CFG.vocab_size, jnp.int32)


def _write(path, config, sd, shards=None):
  """A checkpoint directory: config.json and the weights, in ``shards`` files."""
  path.mkdir()
  (path / 'config.json').write_text(json.dumps(config))
  if shards is None:
    save_file(sd, str(path / 'model.safetensors'))
    return path
  files, index = hf_files.plan_shards({k: x.nbytes for k, x in sd.items()},
                                      sum(x.nbytes for x in sd.values()) // shards + 1)
  for name, keys in files.items():
    save_file({k: sd[k] for k in keys}, str(path / name))
  (path / hf_files.INDEX).write_text(json.dumps(index))
  return path


def test_config_json_round_trips_and_unsupported_fields_are_refused_by_name():
  for config in (CFG, dataclasses.replace(CFG, tie_embeddings=True, rope_theta=5e5)):
    back = hf.llama_config(hf.hf_config(config, bos_token_id=1, eos_token_id=2))
    assert back == dataclasses.replace(config, block_size=16)  # min(256, kv heads * 16)
  assert hf.llama_config(hf.hf_config(CFG), block_size=8).block_size == 8
  ids = hf.hf_config(CFG, bos_token_id=np.int64(1), eos_token_id=np.int32(2))  # numpy ids
  assert json.loads(json.dumps(ids))['eos_token_id'] == 2 and type(ids['bos_token_id']) is int
  base = hf.hf_config(CFG)
  # Hugging Face's defaults, transformers 5's rope_parameters, metadata ignored.
  lean = {k: v for k, v in base.items() if k not in ('num_key_value_heads', 'rope_theta')}
  lean.update(rope_parameters={'rope_type': 'default', 'rope_theta': 500000},
              eos_token_id=[1, 2], transformers_version='5.0', use_cache=True)
  got = hf.llama_config(lean)
  assert (got.kv_heads, got.rope_theta) == (CFG.heads, 500000.0)
  refused = {
      'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0}, 'attention_bias': True,
      'mlp_bias': True, 'hidden_act': 'gelu', 'head_dim': 32, 'model_type': 'mistral',
      'architectures': ['MistralForCausalLM'], 'attention_dropout': 0.1,
      'quantization_config': {'bits': 4}, 'sliding_window': 4096}
  for key, value in refused.items():
    with pytest.raises(ValueError, match=f"{key}") as e:
      hf.llama_config({**base, key: value})
    assert 'not supported' in str(e.value)
  with pytest.raises(ValueError, match=r"lacks \['hidden_size'\]"):
    hf.llama_config({k: v for k, v in base.items() if k != 'hidden_size'})
  with pytest.raises(ValueError, match='heads must be divisible by kv_heads'):
    hf.llama_config({**base, 'num_key_value_heads': 3})
  with pytest.raises(ValueError, match='kv_heads must be a positive int, got 0'):
    hf.llama_config({**base, 'num_key_value_heads': 0})  # not taken for "absent"
  assert hf.llama_config({**base, 'rope_parameters': 'default'}).rope_theta == CFG.rope_theta
  with pytest.raises(ValueError, match=r'^llama_config\(block_size=1\): block_size must be'):
    hf.llama_config(base, block_size=1)
  with pytest.raises(ValueError, match='torch_dtype must be one of'):
    hf.hf_config(CFG, torch_dtype='float16')
  with pytest.raises(ValueError, match='import reads the Hugging Face Llama layout into a dense '
                                       'Llama.*a MoELlama'):
    hf.build_from_hf(get_config('moe-tiny'), {})
  with pytest.raises(ValueError, match=r'a model directory or a \(config.json dict, state dict\) '
                                       'pair, got dict'):
    hf.from_hf(base)


def test_weights_are_checked_by_name_and_shape(model):
  sd = hf.hf_state_dict(model)
  config = hf.hf_config(CFG)
  with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\]"):
    hf.from_hf((config, {k: x for k, x in sd.items() if 'layers.1.mlp.up' not in k}))
  with pytest.raises(ValueError, match=r"unexpected \['model.layers.2.mlp.up_proj.weight'\]"):
    hf.from_hf((config, {**sd, 'model.layers.2.mlp.up_proj.weight': sd['lm_head.weight']}))
  q = 'model.layers.0.self_attn.q_proj.weight'
  with pytest.raises(ValueError, match=rf'{q} has shape \(32, 16\).* gives \(32, 32\)'):
    hf.from_hf((config, {**sd, q: sd[q][:, :16]}))
  # Rotary tables and a tied head's copy are held by some checkpoints: unused.
  extra = {**sd, 'model.layers.0.self_attn.rotary_emb.inv_freq': np.ones(8, np.float32)}
  assert hf.from_hf((config, extra))[0].layers == 2
  assert hf.from_hf(({**config, 'tie_word_embeddings': True}, sd))[0].tie_embeddings


@pytest.mark.parametrize('scan', [False, True])
def test_export_then_import_gives_the_same_model(model, tmp_path, keys, scan):
  """A directory written from hf_state_dict / hf_config reads back (one file,
  or three shards with an index) as the same weights: built without a random
  draw, or loaded into a built or an abstract model, the same logits."""
  sd = hf.hf_state_dict(model)
  path = _write(tmp_path / 'hf', hf.hf_config(CFG), sd, shards=3 if scan else None)
  config, weights = hf.from_hf(path)
  assert config == dataclasses.replace(CFG, block_size=16)
  assert isinstance(weights, hf_files.Weights) and len(weights) == len(sd)
  tokens = _tokens(keys())
  want = _forward(model, tokens)
  built = hf.build_from_hf(config, weights, scan_layers=scan)
  assert nnx.graphdef(built) == nnx.graphdef(nnx.eval_shape(
      lambda: config.build(rngs=nnx.Rngs(1), scan_layers=scan)))
  assert rel_err(_forward(built, tokens), want) < 1e-6
  for target in (config.build(rngs=nnx.Rngs(1), scan_layers=scan),
                 nnx.eval_shape(lambda: config.build(rngs=nnx.Rngs(1), scan_layers=scan))):
    assert rel_err(_forward(hf.load_hf_weights(target, weights), tokens), want) < 1e-6
  np.testing.assert_array_equal(hf.hf_state_dict(built)[
      'model.layers.1.mlp.down_proj.weight'], sd['model.layers.1.mlp.down_proj.weight'])


def test_built_from_hf_and_poetized_layer_by_layer(model, keys):
  """convert_layer poetizes each filled layer (its dense kernels consumed): the
  structure of config.build with that conversion, the function of the weights
  (scanned here; the app's test imports into unrolled POET layers)."""

  def convert(seed):
    rngs = nnx.Rngs(seed)
    return lambda layer: poetx_jax.poetize(layer, block_size=8, rngs=rngs, consume=True)

  poet = hf.build_from_hf(CFG, hf.hf_state_dict(model), convert_layer=convert(1),
                          scan_layers=True)
  fresh = nnx.eval_shape(lambda: CFG.build(rngs=nnx.Rngs(5), convert_layer=convert(1),
                                           scan_layers=True))
  assert nnx.graphdef(poet) == nnx.graphdef(fresh)
  assert len(poetx_jax.poet_layers(poet)) == 7  # each a stack of the 2 layers
  tokens = _tokens(keys())
  assert rel_err(_forward(poet, tokens), _forward(model, tokens)) < 1e-5
  with pytest.raises(ValueError, match='draws no weights'):
    hf.build_from_hf(CFG, hf.hf_state_dict(model), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match='unpoetize'):
    hf.load_hf_weights(poet, hf.hf_state_dict(model))


def test_weight_files_sharded_or_not_are_read_or_refused_by_name(model, tmp_path):
  assert (hf_files.parse_size('5GB'), hf_files.parse_size('1.5 MiB'),
          hf_files.parse_size(7)) == (5 * 10 ** 9, 3 * 2 ** 19, 7)
  for bad in ('5 parsecs', '0', -1, ''):
    with pytest.raises(ValueError, match='size'):
      hf_files.parse_size(bad)
  files, index = hf_files.plan_shards({'a': 4, 'b': 4, 'c': 9, 'd': 1}, 8)
  assert list(files.values()) == [['a', 'b'], ['c'], ['d']]
  assert list(files) == [f'model-0000{i}-of-00003.safetensors' for i in (1, 2, 3)]
  assert index == {'metadata': {'total_size': 18}, 'weight_map': {
      'a': list(files)[0], 'b': list(files)[0], 'c': list(files)[1], 'd': list(files)[2]}}
  assert hf_files.plan_shards({'a': 4}, 8) == ({'model.safetensors': ['a']}, None)

  sd = hf.hf_state_dict(model, dtype='bfloat16')
  path = _write(tmp_path / 'bf16', hf.hf_config(CFG, torch_dtype='bfloat16'), sd, shards=2)
  config, weights = hf.from_hf(path)
  assert set(weights.dtypes.values()) == {'BF16'}
  np.testing.assert_array_equal(weights['model.norm.weight'], sd['model.norm.weight'])
  last = sorted(path.glob('model-*.safetensors'))[-1]
  last.unlink()
  with pytest.raises(ValueError, match=f'names the shard {last.name}, which is missing'):
    hf.from_hf(path)
  index = path / hf_files.INDEX
  for damaged in (b'{"weight_map": ', b'[]', b'\xff{}', b'{"weight_map": {"a": 1}}'):
    index.write_bytes(damaged)
    with pytest.raises(ValueError, match=f'{index}'):  # named, whatever is wrong with it
      hf.from_hf(path)
  (tmp_path / 'bin').mkdir()
  (tmp_path / 'bin' / 'config.json').write_text(json.dumps(hf.hf_config(CFG)))
  (tmp_path / 'bin' / 'pytorch_model.bin').write_bytes(b'')
  with pytest.raises(ValueError, match='only pytorch_model.bin: convert'):
    hf.from_hf(tmp_path / 'bin')
  with pytest.raises(ValueError, match='has no config.json'):
    hf.from_hf(tmp_path)
