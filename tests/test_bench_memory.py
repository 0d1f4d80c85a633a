"""bench_memory.py --breakdown on the tiny model (abstract state, CPU) and
poet_torch_memory.py's accounting (no torch needed)."""

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
from experiments import bench_memory, bench_train, harness
from experiments import poet_torch_memory as ptm

GIB = 2 ** 30


def _cfg(run, *argv):
  p = argparse.ArgumentParser()
  bench_train.add_run_args(p)
  a = p.parse_args(['--model', 'tiny', '--model-overrides', 'layers=1', '--seq-len', '32',
                    '--batch-size', '2', '--vocab-size', '512', '--dtype', 'float32', *argv])
  return bench_train.run_config(a, run)


def _state(cfg):
  from poetx_jax.pretrain import factories as F
  from poetx_jax.pretrain.plan import make_plan
  return F.abstract_state(make_plan(cfg))


def _param_bytes(model, keep):
  """Bytes of the model's Params that ``keep`` accepts (size x numpy item size)."""
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))
  return sum(int(np.prod(v.get_value().shape)) * np.dtype(v.get_value().dtype).itemsize
             for v in leaves if keep(v))


@pytest.mark.slow
def test_breakdown_of_poetx_sums_to_the_state_and_to_xla_buffers():
  """POET-X with bf16 bases: the categories add up to resident_state's sizes
  byte for byte; gradients are each Param's at its own dtype (generators
  float32, the rest bf16); the compiled figures are XLA's own."""
  cfg = _cfg('optimizer=poetx,param_dtype=bfloat16')
  r = bench_train.memory_breakdown(cfg, 'poetx', compiled=True, peak_ops=6)
  b, s = r['bytes'], bench_train.resident_state(cfg, 'poetx')
  # XLA's list of what is live at its peak: the largest first, named by the
  # JAX operation that made each (or values[i], an argument), together no
  # more than the program's arguments and temporaries.
  ops = r['peak_ops']
  assert len(ops) == 6 and [n for _, n in ops] == sorted((n for _, n in ops), reverse=True)
  assert all(name.startswith(('jit(', 'values[')) or '{' in name for name, _ in ops), ops
  assert 0 < sum(n for _, n in ops) <= b['arguments'] + b['temporaries']
  model_bytes = b['bases'] + b['generators'] + b['other_params'] + b['buffers']
  opt_bytes = b['generator_moments'] + b['other_moments'] + b['optimizer_other']
  assert model_bytes == s['model_gib'] * GIB and opt_bytes == s['optimizer_gib'] * GIB
  assert b['generators'] + b['other_params'] == s['trainable_gib'] * GIB
  assert min(b['bases'], b['generators'], b['buffers'], b['generator_moments']) > 0
  model, _ = _state(cfg)
  import poetx_jax
  gens = _param_bytes(model, lambda v: isinstance(v, poetx_jax.POETParam))
  others = _param_bytes(model, lambda v: not isinstance(v, poetx_jax.POETParam))
  assert b['generators'] == gens and b['other_params'] == others
  assert b['gradients'] == gens + others  # a float32 generator's grad is float32, a bf16 norm's bf16
  # Adam keeps two moments per generator, in its dtype.
  assert b['generator_moments'] == 2 * gens
  # XLA's buffers: the donated state is aliased; arguments are state + the batch.
  assert b['aliases'] == b['state'] == model_bytes + opt_bytes
  assert b['arguments'] == b['state'] + 2 * 2 * 32 * 4
  assert b['temporaries'] == b['gradients'] + b['saved_residuals'] + b['other_temporaries']
  assert b['sum'] == b['state'] + b['temporaries']
  assert b['compiled_peak'] == b['arguments'] + b['outputs'] - b['aliases'] + b['temporaries']
  assert r['gib']['bases'] == b['bases'] / GIB and r['backend'] == jax.default_backend()


@pytest.mark.slow
def test_breakdown_matches_memory_analysis_of_the_step():
  """The compiled figures are those of the step's own program, compiled here."""
  from poetx_jax.pretrain import factories as F
  from poetx_jax.pretrain.plan import make_plan
  cfg = _cfg('optimizer=adamw')
  plan = make_plan(cfg)
  model, opt = F.abstract_state(plan)
  tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
  m = F.make_step(plan).lower(model, opt, {'inputs': tokens, 'targets': tokens}
                              ).compile().memory_analysis()
  b = bench_train.memory_breakdown(cfg, 'adamw', compiled=True)['bytes']
  assert (b['arguments'], b['outputs'], b['aliases'], b['temporaries']) == (
      m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
      m.temp_size_in_bytes)


@pytest.mark.parametrize('run', ['optimizer=adamw', 'optimizer=muon'])
def test_breakdown_of_dense_optimizers_has_no_poet_parts(run):
  """AdamW and Muon: no bases, generators, permutations or their moments;
  every Param is an other parameter with its gradient; AdamW's moments are
  two per parameter, Muon's one per matrix (momentum) and two per other."""
  cfg = _cfg(run)
  b = bench_train.memory_breakdown(cfg, run)['bytes']
  s = bench_train.resident_state(cfg, run)
  assert b['bases'] == b['generators'] == b['buffers'] == b['generator_moments'] == 0
  assert b['other_params'] == b['gradients'] == s['trainable_gib'] * GIB
  assert b['other_moments'] + b['optimizer_other'] == s['optimizer_gib'] * GIB
  assert 0 < b['optimizer_other'] < 1024  # step counts, Newton-Schulz coefficients
  if run == 'optimizer=adamw':
    assert b['other_moments'] == 2 * b['other_params']
  else:
    assert b['other_params'] < b['other_moments'] < 2 * b['other_params']
  assert 'temporaries' not in b and b['sum'] == b['state'] + b['gradients'] + b['saved_residuals']


@pytest.mark.slow
def test_saved_residuals_shrink_with_remat_and_leave_the_arguments_out():
  """Without remat the backward keeps every layer's activations; with
  ``remat=block`` each layer's input (and the loss's softmax) only. What it
  keeps of the parameters and frozen bases counts as arguments, not twice."""
  full = bench_train.memory_breakdown(_cfg('optimizer=poetx'), 'none')['bytes']
  block = bench_train.memory_breakdown(_cfg('optimizer=poetx,remat=block'), 'block')['bytes']
  scanned = bench_train.memory_breakdown(
      _cfg('optimizer=poetx,remat=block,scan_layers=true'), 'scan')['bytes']
  layer_input = 2 * 32 * 64 * 4  # batch x seq x hidden, float32
  softmax = 2 * 32 * 512 * 4  # of the logits
  assert full['saved_residuals'] > 3 * block['saved_residuals']
  assert block['saved_residuals'] >= layer_input + softmax
  assert scanned['saved_residuals'] == block['saved_residuals']  # stacked, the same values
  # The backward needs the bases (and the head) in every case; they are arguments.
  assert block['residual_arguments'] >= block['bases']
  assert block['residual_arguments'] <= block['state'] + 2 * 2 * 32 * 4 + 4096
  assert block['host_residuals'] == 0


@pytest.mark.slow
def test_offloaded_layer_inputs_count_in_host_memory_and_the_loss_pieces_drop_the_softmax():
  """``remat=offload`` moves each layer's input from the device's residuals
  to ``host_residuals``; ``loss_chunk`` replaces the (B, T, V) softmax by
  the gradient of the last layer's output (B, T, H) and the head's."""
  block = bench_train.memory_breakdown(_cfg('optimizer=poetx,remat=block'), 'block')['bytes']
  off = bench_train.memory_breakdown(_cfg('optimizer=poetx,remat=offload'), 'off')['bytes']
  pieces = bench_train.memory_breakdown(
      _cfg('optimizer=poetx,remat=block,loss_chunk=8'), 'pieces')['bytes']
  layer_input = 2 * 32 * 64 * 4  # batch x seq x hidden, float32 (one layer)
  softmax = 2 * 32 * 512 * 4
  assert off['host_residuals'] == layer_input
  assert off['saved_residuals'] == block['saved_residuals'] - layer_input
  assert pieces['saved_residuals'] <= block['saved_residuals'] - softmax + layer_input + 512 * 64 * 4


@pytest.mark.slow
def test_bench_memory_breakdown_table(tmp_path, capsys):
  """``--breakdown --state-only``: a table with every category and the JSON."""
  out = tmp_path / 'bd.json'
  bench_memory.main(['--models', 'tiny', '--seqs', '32', '--vocab-size', '512',
                     '--breakdown', '--state-only', '--run', 'x:optimizer=poetx,remat=block',
                     '--run', 'optimizer=adamw', '--json', str(out)])
  rows = harness.results_of(json.loads(out.read_text()))
  assert [r['run'] for r in rows] == ['x', 'optimizer=adamw']
  assert rows[0]['gib']['bases'] > 0 and rows[1]['gib']['bases'] == 0
  text = capsys.readouterr().out
  assert 'MiB at the peak by category' in text
  line = next(l for l in text.splitlines() if l.startswith('tiny   32    x'))
  cells = line.split()[3:]
  assert len(cells) == len(bench_memory.BREAKDOWN_COLUMNS) and cells[-3:] != ['—'] * 3
  assert cells[-1] == '—' and cells[-3] == '—'  # not compiled: no XLA figures
  assert float(cells[-2]) == pytest.approx(1024 * rows[0]['gib']['sum'], abs=0.01)


class FakeTensor:
  """What poet_torch_memory's accounting reads of a torch tensor."""

  def __init__(self, n, size, requires_grad=False, grad=None):
    self.n, self.size, self.requires_grad, self.grad = n, size, requires_grad, grad

  def numel(self):
    return self.n

  def element_size(self):
    return self.size


def test_poet_torch_memory_accounting_without_torch():
  """Parameters split by requires_grad and name, optimizer state by owner,
  gradients by category, the peak less the state."""
  emb = FakeTensor(100, 2, True, grad=FakeTensor(100, 2))
  gen = FakeTensor(10, 4, True, grad=FakeTensor(10, 4))
  base = FakeTensor(1000, 2)
  norm = FakeTensor(8, 2, True)  # no grad yet
  params = [('model.embed_tokens.weight', emb), ('model.layers.0.mlp.up_proj.oft_R', gen),
            ('model.layers.0.mlp.up_proj.weight', base),
            ('model.layers.0.input_layernorm.weight', norm)]
  buffers = [('model.layers.0.mlp.up_proj.perm', FakeTensor(16, 8))]
  opt_state = {gen: {'step': FakeTensor(1, 4), 'exp_avg': FakeTensor(10, 4),
                     'exp_avg_sq': FakeTensor(10, 4)},
               emb: {'step': 3.0, 'exp_avg': FakeTensor(100, 2), 'exp_avg_sq': FakeTensor(100, 2)}}
  s = ptm.state_breakdown(params, buffers, opt_state, poet=True)
  assert s['bytes'] == {'bases': 2000, 'generators': 40, 'other_params': 216, 'buffers': 128,
                        'generator_moments': 80, 'other_moments': 400, 'optimizer_other': 4,
                        'gradients': 0}
  assert s['params_by_name'] == {'trainable:weight': 216, 'trainable:oft_R': 40,
                                 'frozen:weight': 2000}
  grads = ptm.gradient_bytes(params, poet=True)
  assert grads == {'other_params': 200, 'generators': 40}
  # Without POET every trainable parameter is an other parameter.
  assert ptm.state_breakdown(params, [], {}, poet=False)['bytes']['other_params'] == 256
  stats = {'allocated_bytes.all.peak': 5000, 'active_bytes.all.peak': 5100,
           'reserved_bytes.all.peak': 6000}
  r = ptm.summarize(s, grads, stats, {'forward': {'start': 2868, 'end': 3868, 'peak': 4000}})
  b = r['bytes']
  assert b['state'] == 2000 + 40 + 216 + 128 + 80 + 400 + 4 and b['gradients'] == 240
  assert b['activations_and_temporaries'] == 5000 - b['state']
  assert b['beyond_gradients'] == 5000 - b['state'] - 240
  assert b['saved_by_forward'] == 1000 and r['gib']['peak'] == 5000 / GIB
  assert 'peak' not in ptm.summarize(s, grads, None, {})['bytes']  # off CUDA


def test_poet_torch_memory_arguments():
  a = ptm.parse_args(['--variant', 'adamw', '--size', 'tiny', '--seq', '32', '--batch', '2',
                      '--device', 'cpu'])
  assert (a.variant, a.size, a.seq, a.batch, a.device, a.block, a.torch_dtype) == (
      'adamw', 'tiny', 32, 2, 'cpu', 256, 'bfloat16')
  d = ptm.parse_args([])
  assert (d.variant, d.size, d.seq, d.batch, d.warmup_steps) == ('poetx-fast', '8b', 1024, 8, 2)
  assert ptm.SHAPES['8b']['num_key_value_heads'] == 8
  for bad in (['--variant', 'sgd'], ['--seq', '0'], ['--warmup-steps', '0']):
    with pytest.raises(SystemExit):
      ptm.parse_args(bad)
