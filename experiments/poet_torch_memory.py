"""The memory of a training step of the published PyTorch POET-X
(``poet_torch``) or torch AdamW, by the categories of ``bench_memory.py
--breakdown``, so the two implementations' peaks can be set side by side.

It builds the Llama of the step anchor (Hugging Face ``LlamaForCausalLM`` of
our named shapes, vocab 32000, bf16 weights, gradient checkpointing on every
decoder layer; POET-X through ``poet_torch``'s ``POETModel`` and
``get_poet_optimizer`` with block size 256, ``mem_efficient_mode`` for
``poetx-mem``), runs ``--warmup-steps`` steps so the optimizer holds its
state, then one step whose peak it reads (``torch.cuda.memory_stats``:
allocated, active, reserved) and one step phase by phase (the peak
statistics reset between forward, backward and optimizer step). It reports,
in GiB:

* ``bases``: frozen parameters (``requires_grad=False``); ``generators``:
  trainable parameters of the POET layers; ``other_params``: trainable
  embeddings, norms and head (with AdamW every parameter); ``buffers``;
  per leaf name (``params_by_name``) too, so nothing hides in a category;
* ``generator_moments``, ``other_moments``: the optimizer's tensors
  (``opt.state``) by the parameter they belong to; ``optimizer_other``:
  its scalar tensors (steps) of no size class of their own;
* ``gradients``: the ``.grad`` tensors after the backward;
* ``peak``: ``allocated_bytes.all.peak``; ``activations_and_temporaries``:
  the peak less the resident state (parameters, buffers, optimizer state),
  gradients included; ``beyond_gradients``: less the gradients as well;
* per phase (``phases``): the memory allocated when the phase starts and
  ends and its peak; ``saved_by_forward`` (allocated after the forward less
  before it: what the forward keeps for the backward, the logits and loss
  included) is what ``bench_memory.py``'s ``saved_residuals`` counts.

Run on a GPU machine with torch and transformers and ``poet_torch`` on
``PYTHONPATH`` (imported only for the POET-X variants); ``--device cpu`` runs
the AdamW variant (or POET-X, if poet_torch runs there) without the CUDA
statistics::

    PYTHONPATH=DIR_HOLDING_poet_torch python3 -m experiments.poet_torch_memory \\
        --variant poetx-fast --size 8b --seq 1024 --batch 8
    python3 -m experiments.bench_memory --models 8b --seqs 1024 --batch-size 8 --breakdown \\
        --scan-layers --run poetx:optimizer=poetx,mode=fast,remat=block   # ours, same GPU
    python3 -m experiments.poet_torch_memory --variant adamw --size tiny --seq 32 --batch 2 \\
        --device cpu   # a CPU check of the setup and the accounting

The script imports without torch: its accounting works on any objects with
``numel()``, ``element_size()``, ``requires_grad`` and ``grad``.
"""

from __future__ import annotations

import argparse
import json
import sys

GIB = 2 ** 30
MODES = ('poetx-fast', 'poetx-mem', 'adamw')
# Hugging Face LlamaConfig fields of our named shapes (poetx_jax.models.llama).
SHAPES = {
    'tiny': dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    '130m': dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12),
    '1b': dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
               num_attention_heads=32),
    '3b': dict(hidden_size=2560, intermediate_size=7168, num_hidden_layers=32,
               num_attention_heads=32),
    '8b': dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8),
}
# Trainable parameters whose names hold one of these are not a POET layer's.
NON_POET = ('embed', 'norm', 'lm_head')
CATEGORIES = ('bases', 'generators', 'other_params', 'buffers', 'generator_moments',
              'other_moments', 'optimizer_other', 'gradients')


def tensor_bytes(t) -> int:
  """Bytes of a tensor (its elements times their size); 0 for anything else."""
  if hasattr(t, 'numel') and hasattr(t, 'element_size'):
    return int(t.numel()) * int(t.element_size())
  return 0


def param_category(name: str, requires_grad: bool, poet: bool) -> str:
  """``'bases'`` for a frozen parameter; of the trainable ones ``'other_params'``
  for embeddings, norms and head (:data:`NON_POET`) and every parameter of a
  model without POET, else ``'generators'``."""
  if not requires_grad:
    return 'bases'
  if not poet or any(k in name for k in NON_POET):
    return 'other_params'
  return 'generators'


def state_breakdown(named_params, named_buffers, opt_state, poet: bool) -> dict:
  """Bytes of the resident state by category, from ``(name, parameter)``
  pairs, ``(name, buffer)`` pairs and an optimizer's ``state`` (a mapping of
  parameter to a dict of its tensors). Returns ``{'bytes': {category: n},
  'params_by_name': {'trainable:LEAF' or 'frozen:LEAF': n}}`` with
  ``gradients`` zero (:func:`gradient_bytes` gives them)."""
  out = dict.fromkeys(CATEGORIES, 0)
  by_name, kind_of = {}, {}
  for name, p in named_params:
    kind = param_category(name, p.requires_grad, poet)
    kind_of[id(p)] = kind
    n = tensor_bytes(p)
    out[kind] += n
    key = f'{"trainable" if p.requires_grad else "frozen"}:{name.rsplit(".", 1)[-1]}'
    by_name[key] = by_name.get(key, 0) + n
  for _, b in named_buffers:
    out['buffers'] += tensor_bytes(b)
  for p, state in (opt_state or {}).items():
    owner = {'generators': 'generator_moments'}.get(kind_of.get(id(p)), 'other_moments')
    for v in (state or {}).values():
      n = tensor_bytes(v)
      # a scalar (a step count) is no moment, whatever parameter it counts for
      out['optimizer_other' if n and int(v.numel()) == 1 else owner] += n
  return {'bytes': out, 'params_by_name': by_name}


def gradient_bytes(named_params, poet: bool) -> dict[str, int]:
  """Bytes of the parameters' ``.grad`` tensors by the category of their
  parameter (:func:`param_category`)."""
  out = {}
  for name, p in named_params:
    if getattr(p, 'grad', None) is not None:
      kind = param_category(name, p.requires_grad, poet)
      out[kind] = out.get(kind, 0) + tensor_bytes(p.grad)
  return out


def summarize(state: dict, grads: dict, stats: dict | None, phases: dict) -> dict:
  """The report: ``bytes`` and ``gib`` by category (gradients the sum of
  ``grads``), the resident state, and from the CUDA statistics of the
  measured step (``stats``, None off CUDA) the peak and what lies above the
  state; ``phases`` as given, with ``saved_by_forward``."""
  sizes = dict(state['bytes'])
  sizes['gradients'] = sum(grads.values())
  sizes['state'] = sum(v for k, v in sizes.items() if k not in ('gradients', 'state'))
  if stats:
    sizes['peak'] = stats['allocated_bytes.all.peak']
    sizes['active_peak'] = stats.get('active_bytes.all.peak', 0)
    sizes['reserved_peak'] = stats.get('reserved_bytes.all.peak', 0)
    sizes['activations_and_temporaries'] = sizes['peak'] - sizes['state']
    sizes['beyond_gradients'] = sizes['activations_and_temporaries'] - sizes['gradients']
  fwd = phases.get('forward')
  if fwd:
    sizes['saved_by_forward'] = fwd['end'] - fwd['start']
  return {'bytes': sizes, 'gib': {k: v / GIB for k, v in sizes.items()},
          'params_by_name': state['params_by_name'], 'gradients_by_category': grads,
          'phases': phases}


def build(a):
  """``(model, optimizer, poet)`` of the anchor's setup on ``a.device``."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM
  cfg = LlamaConfig(vocab_size=a.vocab, max_position_embeddings=max(2048, a.seq),
                    rms_norm_eps=1e-6, **SHAPES[a.size])
  torch.manual_seed(0)
  with torch.device(a.device):
    model = LlamaForCausalLM._from_config(cfg, torch_dtype=getattr(torch, a.torch_dtype))
  model.gradient_checkpointing_enable()
  model.config.use_cache = False
  poet = a.variant.startswith('poetx')
  if poet:
    from poet_torch import POETConfig, POETModel, get_poet_optimizer
    pc = POETConfig(block_size=a.block, merge_interval=a.merge_interval,
                    mem_efficient_mode=a.variant == 'poetx-mem')
    model = POETModel(model, pc)
    opt = get_poet_optimizer(model, pc)
  else:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=a.adamw_lr)
  return model, opt, poet


def measure(a) -> dict:
  """Builds the run (:func:`build`), runs its warm-up steps, one measured step
  and one step phase by phase; the :func:`summarize` report."""
  import torch
  model, opt, poet = build(a)
  cuda = torch.device(a.device).type == 'cuda'
  ids = torch.randint(0, a.vocab, (a.batch, a.seq), device=a.device)
  sync = torch.cuda.synchronize if cuda else (lambda: None)
  allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)

  def step(phases=None):
    def phase(name, fn):
      sync()
      if cuda and phases is not None:
        torch.cuda.reset_peak_memory_stats()
      start = allocated()
      out = fn()
      sync()
      if phases is not None:
        phases[name] = {'start': start, 'end': allocated(),
                        'peak': torch.cuda.max_memory_allocated() if cuda else 0}
      return out

    loss = phase('forward', lambda: model(input_ids=ids, labels=ids).loss)
    phase('backward', loss.backward)
    grads = gradient_bytes(model.named_parameters(), poet)
    phase('optimizer', opt.step)
    opt.zero_grad(set_to_none=True)
    return grads

  for _ in range(a.warmup_steps):
    step()
  if cuda:
    sync()
    torch.cuda.reset_peak_memory_stats()
  grads = step()
  stats = torch.cuda.memory_stats() if cuda else None
  phases = {}
  step(phases)
  state = state_breakdown(model.named_parameters(), model.named_buffers(),
                          getattr(opt, 'state', {}), poet)
  r = summarize(state, grads, stats, phases)
  r.update(variant=a.variant, size=a.size, seq=a.seq, batch=a.batch, device=a.device,
           dtype=a.torch_dtype, block_size=a.block if poet else None,
           torch=torch.__version__)
  return r


def print_report(r: dict) -> None:
  """The categories (GiB) as lines on stdout."""
  g = r['gib']
  print(f"{r['variant']} {r['size']} seq {r['seq']} batch {r['batch']} ({r['device']})")
  for k in CATEGORIES + ('state', 'peak', 'activations_and_temporaries',
                         'beyond_gradients', 'saved_by_forward'):
    if k in g:
      print(f'  {k:28s} {g[k]:9.3f} GiB')
  for name, p in r['phases'].items():
    print(f"  phase {name:22s} start {p['start'] / GIB:8.3f}  end {p['end'] / GIB:8.3f}  "
          f"peak {p['peak'] / GIB:8.3f} GiB")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--variant', choices=MODES, default='poetx-fast')
  p.add_argument('--size', choices=tuple(SHAPES), default='8b')
  p.add_argument('--seq', type=int, default=1024)
  p.add_argument('--batch', type=int, default=8)
  p.add_argument('--vocab', type=int, default=32000)
  p.add_argument('--block', type=int, default=256, help='POET block size')
  p.add_argument('--merge-interval', type=int, default=200,
                 help='POET merge interval (past the steps run: no merge)')
  p.add_argument('--adamw-lr', type=float, default=1e-4, help='AdamW learning rate')
  p.add_argument('--torch-dtype', choices=('bfloat16', 'float32'), default='bfloat16')
  p.add_argument('--device', default='cuda', help='cuda (the statistics) or cpu')
  p.add_argument('--warmup-steps', type=int, default=2,
                 help='steps before the measured one (the optimizer state is made in the first)')
  p.add_argument('--json', default=None, help='write the report here')
  a = p.parse_args(argv)
  if a.seq < 1 or a.batch < 1 or a.warmup_steps < 1:
    p.error('--seq, --batch and --warmup-steps must be >= 1')
  return a


def main(argv=None):
  a = parse_args(argv)
  r = measure(a)
  print_report(r)
  if a.json:
    with open(a.json, 'w') as f:
      json.dump(r, f, indent=1)
  print(json.dumps(r))


if __name__ == '__main__':
  sys.exit(main())
