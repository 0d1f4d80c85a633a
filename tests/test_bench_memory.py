"""poet_torch_memory.py's accounting and options (no torch needed)."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'experiments'))
import poet_torch_memory as ptm  # noqa: E402

GIB = 2 ** 30


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
