"""Training-step throughput and peak memory: POET-X against optax AdamW.

For each run a fresh process builds the Llama, checks the setup (the POET-X
model equals the dense one it exports to; the first loss is near log(vocab)),
compiles the train step of ``poetx train``, runs ``--warmup-steps`` steps,
then times ``--timed-steps`` device-synchronised steps on random tokens and
reads the device's peak memory. One table at the end; ``--json`` keeps it all.
The same program can differ by 15% between two processes on one GPU, so
``--rounds 2`` (or more) runs the list again in reverse order and reports
each run's median round beside every round's step.

The options are ``poetx train``'s (one ``TrainConfig``; here by default model
1b, seq 1024, vocab 32000, batch 8, a merge every 200 updates and a schedule
of 1000 updates). A run (``--run``, repeatable) is ``K=V`` overrides of them,
labelled by its text or by a ``LABEL:`` before it, a value with ``|``
alternatives standing for one run each (:mod:`experiments.harness`); the
default runs are ``optimizer=poetx`` and ``optimizer=adamw``::

    python3 -m experiments.bench_train --model 1b --seq-len 1024 --batch-size 8
    python3 -m experiments.bench_train --model 8b --seq-len 1024 --batch-size 1 --lean-state \\
        --run optimizer=poetx,mode=mem,remat=block --run optimizer=adamw
    python3 -m experiments.bench_train --run optimizer=poetx,form=weight,implementation=pallas \\
        --run tiers:optimizer=poetx,skew_tiers=true --run xq:optimizer=poetx,quantize=int8
    python3 -m experiments.bench_train --rounds 2 --run optimizer=poetx --run optimizer=adamw  # A B, B A
    python3 -m experiments.bench_train --model tiny --seq-len 64 --timed-steps 3   # CPU smoke test

The run trains on the devices the process sees, as ``poetx train`` would
(``CUDA_VISIBLE_DEVICES`` chooses them; bench_scaling.py varies their number);
``strategy=fsdp`` without ``fsdp=N`` shards over all of them. The data,
evaluation, checkpoint and run-directory options of ``poetx train`` play no
part here (the tokens are random) and are left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import re
import statistics
import sys
import tempfile
import time
import typing as tp

from experiments import harness
from experiments.common import Column, print_table as table, progress

BENCH_DEFAULTS = dict(model='1b', seq_len=1024, vocab_size=32000, batch_size=8,
                      merge_every=200, steps=1000)
UNUSED = ('data', 'tokenizer', 'val_fraction', 'eval_every', 'eval_batches', 'log_every',
          'checkpoint_every', 'keep', 'out_dir', 'cache_dir')
DEFAULT_RUNS = ('optimizer=poetx', 'optimizer=adamw')
GIB = 2 ** 30  # bytes in a GiB, the unit of every figure here


def run_config(a, *overrides):
  """The TrainConfig of a run: the options of ``a`` with each run
  (:class:`experiments.harness.Run`) or ``K=V`` overrides text applied in
  turn (a run whose optimizer does not poetize leaves out the POET options
  it shares with them). Strategy fsdp with
  ``fsdp=1`` shards over every device."""
  from poetx_jax.pretrain import config
  base = cfg = config.config_from_args(a)
  for run in overrides:
    cfg = harness.apply(cfg, run)
  cfg = config.drop_shared_poet_options(cfg, base)
  if cfg.strategy == 'fsdp' and cfg.fsdp == 1:
    import jax
    cfg = dataclasses.replace(cfg, fsdp=jax.device_count())
  cfg.validate()
  return cfg


def resident_state(cfg, label: str) -> dict:
  """GiB the run holds between steps, from abstract shapes (nothing allocated).

  ``model``: every model variable (frozen bases, generators, permutations,
  scales); ``trainable``: the ``nnx.Param``s (one gradient each during a
  step); ``optimizer``: the optimizer state. ``model + grads + optimizer`` is
  a floor for the peak: activations and temporaries come on top. Sizes count
  each element's dtype at its numpy item size (``poetx_jax.state_bytes``).
  """
  from flax import nnx
  import poetx_jax
  from poetx_jax.pretrain import factories as F
  from poetx_jax.pretrain.plan import make_plan
  plan = make_plan(cfg)
  mc = plan.model
  model, opt = F.abstract_state(plan)
  gib = lambda tree: poetx_jax.state_bytes(tree) / GIB
  r = {'run': label, 'model': cfg.model, 'dense_params': mc.num_params(),
       'model_gib': gib(nnx.state(model)), 'trainable_gib': gib(nnx.state(model, nnx.Param)),
       'optimizer_gib': gib(nnx.state(opt))}
  r['floor_gib'] = r['model_gib'] + r['trainable_gib'] + r['optimizer_gib']
  return r


def peak_usage(live_range_text: str) -> list[tuple[str, int]]:
  """XLA's own account of the buffers live at its program's peak, from the
  ``*-live-range.txt`` its dump writes: ``(JAX operation, bytes)`` for each
  operation whose outputs are live there (the nodes of its "Stack trace
  breakdown for peak usage" that hold bytes themselves, inside loops too:
  e.g. ``jit(pure)/transpose(jvp())/while/body/.../dot_general``, or
  ``values[3]`` for an argument), largest first."""
  at = live_range_text.find('Stack trace breakdown for peak usage')
  if at < 0:
    return []
  out = []
  for line in live_range_text[at:].splitlines()[1:]:
    m = re.match(r'^[\s│]*[├└]── (.*) \([\d.]+%, total: [\d ]+ bytes, current: ([\d ]+) bytes',
                 line)
    if m is None:
      if not line.startswith('    '):
        break  # the end of the breakdown
      continue  # its root
    if int(m.group(2).replace(' ', '')):
      out.append((m.group(1), int(m.group(2).replace(' ', ''))))
  return sorted(out, key=lambda x: -x[1])


def compiled_memory(cfg, label: str, peak_ops: int = 0) -> dict:
  """GiB of the compiled update program for this backend, from abstract state.

  Lowers and compiles the jitted gradient-and-update program of the run on
  abstract state (``factories.abstract_state``, nothing allocated) and reads XLA's buffer
  assignment: ``arguments`` (model, optimizer state and batch), ``outputs``
  (the new state, the loss and the merge flag and key), ``aliases`` (the
  outputs written into donated arguments: the state) and ``temporaries``
  (everything else live during the step, gradients and saved activations
  included); ``*_bytes`` the same in bytes. Merges run in their own small
  programs. With ``peak_ops`` the program is compiled with XLA's dump on,
  and ``peak_ops`` holds the ``peak_ops`` largest entries of :func:`peak_usage`
  (what is live at the peak, by the operation that made it).
  """
  import jax
  import jax.numpy as jnp
  from poetx_jax.pretrain import factories as F
  from poetx_jax.pretrain.plan import make_plan
  plan = make_plan(cfg)
  model, opt = F.abstract_state(plan)
  tokens = jax.ShapeDtypeStruct(F.update_batch_shape(cfg), jnp.int32)
  step = F.make_step(plan)
  t0 = time.perf_counter()
  lowered = step.lower(model, opt, {'inputs': tokens, 'targets': tokens})
  ops = []
  if peak_ops:
    with tempfile.TemporaryDirectory() as dump:
      compiled = lowered.compile({'xla_dump_to': dump})
      for path in sorted(pathlib.Path(dump).glob('*-live-range.txt')):
        ops = peak_usage(path.read_text())  # one module: the step's
  else:
    compiled = lowered.compile()
  m = compiled.memory_analysis()
  sizes = {'arguments': m.argument_size_in_bytes, 'outputs': m.output_size_in_bytes,
           'aliases': m.alias_size_in_bytes, 'temporaries': m.temp_size_in_bytes}
  return {'run': label, 'model': cfg.model, 'seq_len': cfg.seq_len, 'batch': cfg.batch_size,
          'backend': jax.default_backend(), 'compile_s': time.perf_counter() - t0,
          **{f'{k}_gib': v / GIB for k, v in sizes.items()},
          **{f'{k}_bytes': v for k, v in sizes.items()},
          **({'peak_ops': ops[:peak_ops]} if peak_ops else {})}


# The categories of memory_breakdown, in the order its table shows them.
STATE_CATEGORIES = ('bases', 'generators', 'other_params', 'buffers',
                    'generator_moments', 'other_moments', 'optimizer_other')
STEP_CATEGORIES = ('gradients', 'saved_residuals', 'other_temporaries')


def _names(path) -> tuple:
  """A pytree path as a tuple of its keys' plain values (dict keys, indices,
  attribute names)."""
  return tuple(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k))) for k in path)


def state_breakdown(model, optimizer) -> dict[str, int]:
  """Bytes of a model's and its optimizer's state by category (concrete or
  abstract state; ``poetx_jax.state_bytes`` sizes).

  Model variables: ``bases`` (``FrozenKernel``: the frozen W0 of POET
  layers, quantised or not, and their scales), ``generators``
  (``POETParam``), ``other_params`` (every other ``nnx.Param``: embeddings,
  norms, head, biases; AdamW's and Muon's dense kernels), ``buffers`` (every
  other variable: permutations). Optimizer variables go by the parameter
  whose path ends theirs (optax keeps per-parameter state in trees shaped
  like the parameters, under ``mu``, ``nu``, ...): ``generator_moments`` and
  ``other_moments``; what belongs to no parameter (step counts, the merge
  cycle, schedule and clipping state) is ``optimizer_other``. The model's
  categories sum to ``state_bytes(nnx.state(model))``, the optimizer's to
  ``state_bytes(nnx.state(optimizer))``.
  """
  import jax
  from flax import nnx
  import poetx_jax
  is_var = lambda x: isinstance(x, nnx.Variable)
  out = dict.fromkeys(STATE_CATEGORIES, 0)
  kinds = {}  # parameter path -> 'generator' or 'other'
  for path, v in jax.tree.leaves_with_path(nnx.state(model), is_leaf=is_var):
    if isinstance(v, poetx_jax.POETParam):
      kind = 'generators'
      kinds[_names(path)] = 'generator'
    elif isinstance(v, nnx.Param):
      kind = 'other_params'
      kinds[_names(path)] = 'other'
    elif isinstance(v, poetx_jax.FrozenKernel):
      kind = 'bases'
    else:
      kind = 'buffers'
    out[kind] += poetx_jax.state_bytes(v)
  for path, v in jax.tree.leaves_with_path(nnx.state(optimizer), is_leaf=is_var):
    names = _names(path)
    owner = next((kinds[names[i:]] for i in range(len(names)) if names[i:] in kinds), None)
    out[f'{owner}_moments' if owner else 'optimizer_other'] += poetx_jax.state_bytes(v)
  return out


# Primitives whose outputs XLA keeps in their operands' buffers (a reshape is
# a bitcast; the others are identities): a residual that is one is its operand.
VIEWS = ('stop_gradient', 'reshape', 'squeeze', 'expand_dims', 'reduce_precision', 'name',
         'optimization_barrier')


def step_residuals(plan, model, batch) -> tuple[dict[str, int], list[tuple]]:
  """What the backward of the run's loss keeps, and its gradients, from
  abstract shapes (traced, not compiled).

  The loss is the train step's (``loss.training_loss``) as a function
  of the model's ``nnx.Param``s, the other variables entering through
  ``stop_gradient`` (the step differentiates only the Params). Its residuals
  are what ``jax.ad_checkpoint.print_saved_residuals`` lists, read the same
  way (the outputs of ``jax.vjp``'s function in its jaxpr), after
  rematerialisation (``remat``) and stacked over the layers under
  ``scan_layers``; each is followed back through :data:`VIEWS` to the value
  it views and every value counts once. Returns ``({'gradients',
  'saved_residuals', 'residual_arguments'}: bytes, residuals)``:
  ``gradients`` the Params' gradients at the dtypes the step computes them in
  (their own: a bf16 parameter's is bf16, a generator's float32);
  ``saved_residuals`` the values the forward computes and keeps (layer
  inputs, normed activations, attention probabilities, the logits' softmax,
  rotation blocks); ``residual_arguments`` residuals that are the step's
  arguments (parameters, frozen bases, permutations, the batch) or constants
  of the program: the state already counts them; ``host_residuals`` those
  kept in host memory (remat 'offload'), in no device figure. ``residuals``:
  one ``(shape, dtype, bytes, where)`` per value, ``where`` 'argument',
  'constant', 'host' or the primitive that computed it, largest first.
  """
  import jax
  from flax import nnx
  from jax.extend.core import Literal
  import poetx_jax
  from poetx_jax.pretrain.loss import training_loss
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, rest, batch):
    return training_loss(nnx.merge(graphdef, params, jax.lax.stop_gradient(rest)), batch,
                         plan.options.loss_chunk)

  grads = jax.eval_shape(jax.grad(loss), params, rest, batch)
  leaves, tree = jax.tree.flatten((params, rest, batch))
  flat_loss = lambda *leaves: loss(*jax.tree.unflatten(tree, leaves))
  closed, shapes = jax.make_jaxpr(lambda *a: jax.vjp(flat_loss, *a),
                                  return_shape=True)(*leaves)
  jaxpr = closed.jaxpr
  n_res = len(jax.tree.leaves(shapes[1]))
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  arguments, constants = set(jaxpr.invars), set(jaxpr.constvars)
  seen, residuals = set(), []
  for v in jaxpr.outvars[len(jaxpr.outvars) - n_res:]:
    if isinstance(v, Literal):
      where = 'constant'
    else:
      while v in producer and producer[v].primitive.name in VIEWS:
        eqn = producer[v]  # an optimization barrier's i-th output is its i-th operand
        v = eqn.invars[eqn.outvars.index(v) if len(eqn.invars) > 1 else 0]
      if v in seen:
        continue
      seen.add(v)
      where = ('argument' if v in arguments else 'constant' if v in constants
               else producer[v].primitive.name)
    aval = v.aval
    if getattr(aval, 'memory_space', None) == jax.memory.Space.Host:
      where = 'host'  # offloaded (remat 'offload'): in host memory, not the device's
    nbytes = poetx_jax.state_bytes(jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    residuals.append((tuple(aval.shape), str(aval.dtype), nbytes, where))
  residuals.sort(key=lambda r: -r[2])
  out = {'gradients': poetx_jax.state_bytes(grads), 'saved_residuals': 0,
         'residual_arguments': 0, 'host_residuals': 0}
  for _, _, nbytes, where in residuals:
    out['residual_arguments' if where in ('argument', 'constant') else
        'host_residuals' if where == 'host' else 'saved_residuals'] += nbytes
  return out, residuals


def memory_breakdown(cfg, label: str, compiled: bool = False, peak_ops: int = 0) -> dict:
  """The run's memory at its peak by category, from abstract state (nothing
  allocated; any backend).

  ``bytes`` and ``gib``: the state (:func:`state_breakdown`: bases,
  generators, other_params, buffers, generator_moments, other_moments,
  optimizer_other), the step's ``gradients`` and ``saved_residuals``
  (:func:`step_residuals`; ``residual_arguments``, residuals the state
  already holds, and ``host_residuals``, those in host memory, beside them,
  in no sum), ``sum`` (state + gradients + saved
  residuals: a floor for the peak). With ``compiled`` (:func:`compiled_memory`,
  for this backend: XLA:CPU's temporaries are not XLA:GPU's) also XLA's
  ``arguments``, ``outputs``, ``aliases`` and ``temporaries``, and
  ``other_temporaries = temporaries - gradients - saved_residuals`` (what
  XLA holds beyond them: the logits and their gradient, one layer's
  recomputed activations, copies, workspace). It is reported as it comes and
  can be negative: XLA may fuse a residual away, keep a gradient in an
  argument's buffer or reuse one buffer for two of them. ``sum`` then adds
  it (state + temporaries), and ``compiled_peak`` is XLA's arguments +
  outputs - aliases + temporaries (the batch and the undonated outputs
  beside), and with ``peak_ops`` XLA's list of what is live at the peak
  (:func:`compiled_memory`). The state counts int4 bases at one byte an element
  (``state_bytes``), XLA at half a byte: with ``quantize=int4`` its
  arguments are the smaller.
  """
  import jax
  import jax.numpy as jnp
  from poetx_jax.pretrain import factories as F
  from poetx_jax.pretrain.plan import make_plan
  plan = make_plan(cfg)
  model, opt = F.abstract_state(plan)
  tokens = jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32)  # one micro-batch's
  sizes = state_breakdown(model, opt)
  step, residuals = step_residuals(plan, model, {'inputs': tokens, 'targets': tokens})
  sizes.update(step)
  sizes['state'] = sum(sizes[k] for k in STATE_CATEGORIES)
  sizes['sum'] = sizes['state'] + sizes['gradients'] + sizes['saved_residuals']
  r = {'run': label, 'model': cfg.model, 'seq_len': cfg.seq_len, 'batch': cfg.batch_size,
       'residuals': len(residuals)}
  if compiled:
    c = compiled_memory(cfg, label, peak_ops=peak_ops)
    r.update(backend=c['backend'], compile_s=c['compile_s'])
    if peak_ops:
      r['peak_ops'] = c['peak_ops']
    for k in ('arguments', 'outputs', 'aliases', 'temporaries'):
      sizes[k] = c[f'{k}_bytes']
    sizes['other_temporaries'] = (sizes['temporaries'] - sizes['gradients']
                                  - sizes['saved_residuals'])
    sizes['sum'] += sizes['other_temporaries']
    sizes['compiled_peak'] = (sizes['arguments'] + sizes['outputs'] - sizes['aliases']
                              + sizes['temporaries'])
  r.update(bytes=sizes, gib={k: v / GIB for k, v in sizes.items()})
  return r


def setup_run(cfg, label: str) -> dict:
  """Builds the run's model and optimizer (``factories.build_state``), its
  step and two random batches, on the devices this process sees as ``poetx
  train`` places them, compiles the step on a first update and checks the
  setup (the first loss is near log(vocab)). Returns them in a dict with the
  mesh (None on one device), ``checks`` and ``compile_s``."""
  import jax.numpy as jnp
  import numpy as np

  from poetx_jax import sharding
  from poetx_jax.pretrain import factories as F

  from poetx_jax.pretrain.plan import make_plan
  plan = make_plan(cfg)
  mc = plan.model
  t_setup = time.perf_counter()
  progress(f'{label}: building {cfg.model} ({mc.num_params() / 1e6:,.0f}M dense parameters)')
  mesh = F.make_training_mesh(plan)
  model, opt = F.build_state(plan, mesh)  # fsdp + scan: built into its shards
  rng = np.random.default_rng(0)
  shape, vocab = F.update_batch_shape(cfg), cfg.vocab_size
  batches = [{'inputs': jnp.asarray(rng.integers(0, vocab, shape), jnp.int32),
              'targets': jnp.asarray(rng.integers(0, vocab, shape), jnp.int32)}
             for _ in range(2)]
  if mesh is not None:
    batches = [sharding.shard_batch(b, mesh, axis=len(shape) - 2) for b in batches]
  step = F.make_step(plan, mesh=mesh)
  progress(f'{label}: set up in {time.perf_counter() - t_setup:.0f} s; compiling the step')
  t0 = time.perf_counter()
  loss0 = float(step(model, opt, batches[0]))
  compile_s = time.perf_counter() - t0
  progress(f'{label}: first step (compilation) {compile_s:.0f} s, loss {loss0:.3f}')
  checks = {'first_loss': loss0, 'log_vocab': math.log(vocab)}
  # Random logits of variance s^2 give about log V + s^2 / 2: wide models start
  # above log V (70B-class shapes at init_std 0.02: +1.6), a broken setup far off.
  if not abs(loss0 - math.log(vocab)) < 0.25 * math.log(vocab):
    raise SystemExit(f'{label}: setup check failed: {checks}')
  return dict(cfg=cfg, plan=plan, mc=mc, model=model, opt=opt, step=step, batches=batches, mesh=mesh,
              checks=checks, compile_s=compile_s)


def one_run(cfg, label: str, *, warmup_steps: int = 3, timed_steps: int = 10) -> dict:
  """Sets the run up (:func:`setup_run`), times ``timed_steps`` steps after
  ``warmup_steps``, reads the peak memory, then checks the POET-X model
  against its export (:func:`export_check`)."""
  import jax
  from flax import nnx

  from poetx_jax import sharding

  s = setup_run(cfg, label)
  plan, mc, model, opt, step = s['plan'], s['mc'], s['model'], s['opt'], s['step']
  batches, mesh, checks = s['batches'], s['mesh'], s['checks']
  collectives = (sharding.collective_bytes(step.lower(
      model, opt, batches[1]).compile().as_text())
                 if mesh is not None else {})
  for i in range(warmup_steps):
    jax.block_until_ready(step(model, opt, batches[i % 2]))
  times = []
  for i in range(timed_steps):
    t = time.perf_counter()
    jax.block_until_ready(step(model, opt, batches[i % 2]))
    times.append(time.perf_counter() - t)
  med = statistics.median(times)
  progress(f'{label}: {timed_steps} timed steps, median {1e3 * med:.1f} ms')
  stats = jax.local_devices()[0].memory_stats() or {}
  if plan.poetize:  # after the peak is read (the dense copy would count)
    inputs = batches[0]['inputs']
    checks.update(export_check(plan, model, inputs[0] if inputs.ndim == 3 else inputs, label))
  n_train = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  opt_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(opt)))
  tokens = cfg.grad_accum * cfg.batch_size * cfg.seq_len  # a step is one update
  return {'run': label, 'model': cfg.model, 'seq_len': cfg.seq_len, 'batch': cfg.batch_size,
          'grad_accum': cfg.grad_accum, 'block_size': plan.block_size, 'permutation': plan.permutation,
          'device': jax.devices()[0].device_kind, 'step_s': med,
          'tokens_per_s': tokens / med, 'compile_s': s['compile_s'],
          'peak_gib': stats.get('peak_bytes_in_use', float('nan')) / GIB,
          'trainable': n_train, 'dense_params': mc.num_params(),
          'optimizer_state_gib': opt_bytes / GIB, 'checks': checks,
          'devices': jax.device_count(), 'strategy': cfg.strategy if mesh is not None else None,
          'collective_bytes': collectives}


EXPORT_CHECK_MAX_PARAMS = 20e9  # larger models check one exported layer


def export_check(plan, model, tokens, label: str) -> dict:
  """The POET model, its generators trained and merged a few times, against
  the model it exports (``poet_vs_dense``: relative output error). Past
  EXPORT_CHECK_MAX_PARAMS a dense copy may not fit beside the model, and a
  model without a Hugging Face form (``hf.check_exportable``: a
  mixture-of-experts model, whose dense copy is formed expert by expert) is
  not exported: then one POET layer is checked against its exported kernel
  (``export_check: 'one layer'``)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  import poetx_jax
  from poetx_jax.models import hf
  cfg, mc = plan.options, plan.model
  checks = {}
  try:
    hf.check_exportable(mc)
    exportable = mc.num_params() <= EXPORT_CHECK_MAX_PARAMS
  except ValueError:
    exportable = False
  if exportable:
    probe = tokens[:1, :min(cfg.seq_len, 128)]
    # One program for both (eagerly, op by op, a small model's check took
    # longer than its run on the CPU).
    y, y_ref = nnx.jit(lambda m, p: (m(p), poetx_jax.unpoetize(m)(p)))(model, probe)
  else:
    layer = next(l for _, l in poetx_jax.poet_layers(model.layers[0])  # a copy when
                 if not l.stack_shape)  # stacked; not an expert stack
    x = jax.random.normal(jax.random.key(1), (8, layer.in_features),
                          layer.dtype or jnp.float32)
    y, y_ref = nnx.jit(lambda l, x: (
        l(x).astype(jnp.float32),
        x.astype(jnp.float32) @ poetx_jax.effective_kernel(l).astype(jnp.float32)))(layer, x)
    checks['export_check'] = 'one layer'
  checks['poet_vs_dense'] = float(jnp.linalg.norm(y - y_ref) / jnp.linalg.norm(y_ref))
  # bf16 rounding (of the compute or of the bases) compounds with depth: 0.04
  # for Llama-8B (32 layers) after three merges; a wrong rotation, permutation
  # or layer order gives O(1).
  exact = (jnp.dtype(plan.dtype) == jnp.float32
           and jnp.dtype(plan.options.param_dtype) == jnp.float32)
  if not checks['poet_vs_dense'] < (1e-4 if exact else 0.1):
    raise SystemExit(f'{label}: POET model and its export disagree: {checks}')
  return checks


def add_run_args(p: argparse.ArgumentParser, *, runs=DEFAULT_RUNS, warmup_steps: int = 3,
                 timed_steps: int = 10, json_path: str | None = None,
                 exclude=(), rounds: bool = False, **defaults) -> None:
  """The options of a run, shared with bench_scaling, bench_memory and
  profile_step: ``poetx train``'s (``config.add_options``; BENCH_DEFAULTS,
  then ``defaults``, as their defaults; UNUSED and ``exclude`` left out), the
  runs (``--run``: :func:`runs_of`), the timing and the output; with
  ``rounds`` (scripts that run them through :func:`run_each`) ``--rounds``."""
  from poetx_jax.pretrain import config
  config.add_options(p, overrides={**BENCH_DEFAULTS, **defaults},
                     exclude=UNUSED + tuple(exclude))
  p.add_argument('--run', action='append', default=None, metavar='[LABEL:]K=V|V,...',
                 help='runs: overrides of the options above, e.g. '
                      'optimizer=poetx,mode=mem,remat=block; a value with |-separated '
                      'alternatives stands for one run each; repeatable (default: '
                      + ' and '.join(runs) + ')')
  p.set_defaults(default_runs=list(runs))
  p.add_argument('--warmup-steps', type=int, default=warmup_steps,
                 help='untimed steps after the first (compiling) one')
  p.add_argument('--timed-steps', type=int, default=timed_steps, help='timed steps')
  p.set_defaults(rounds=1)
  if rounds:
    p.add_argument('--rounds', type=int, default=1,
                   help='run the list this many times, every other time in reverse order '
                        '(A B, B A, ...), each run a fresh process each time: a run\'s '
                        'spread between processes and its position in the list show')
  p.add_argument('--json', default=json_path,
                 help='write the record (the command, commit, device and every result) here')
  harness.add_child_option(p)


def runs_of(a) -> list[harness.Run]:
  """The runs of parsed :func:`add_run_args` options' ``--run`` specs."""
  return harness.expand_all(a.run or a.default_runs)


def child_run(a) -> harness.Run | None:
  """In a child of :func:`run_each`, its run (None in the parent)."""
  payload = harness.child_payload(a)
  return payload and harness.Run(payload['label'], tuple(map(tuple, payload['pairs'])))


def run_each(a, module: str, argv: list[str], show: tp.Callable[[dict], str]) -> list[dict]:
  """Runs every ``--run`` of ``a`` in a process of its own (a child of
  ``experiments.MODULE`` with ``argv``: :func:`experiments.harness.run_child`;
  :func:`child_run` is its run), ``--rounds`` times (every other round in
  reverse order; each result then records its ``round``), prints
  ``show(result)`` as each ends (a failed run's result is ``{'run',
  'error'}``) and writes the record of them all to ``a.json`` if set
  (:func:`experiments.harness.write_record`); the results, in the order they
  ran."""
  if a.rounds < 1:
    raise SystemExit(f'--rounds {a.rounds}: must be >= 1')
  results = []
  runs = runs_of(a)
  for i in range(a.rounds):
    for run in (runs if i % 2 == 0 else runs[::-1]):
      r, error = harness.run_child(module, argv, {'label': run.label, 'pairs': run.pairs},
                                   run.label)
      results.append(r if error is None else {'run': run.label, 'error': error})
      if a.rounds > 1:
        results[-1]['round'] = i
      print(show(results[-1]), flush=True)
      if a.json:  # as each ends: a call cut short keeps the runs done
        harness.write_record(a.json, results, module=module, argv=argv,
                             device=harness.children_device(results))
  return results


def by_run(results: list[dict]) -> list[dict]:
  """One result per run label (in the order first run): with several rounds,
  its median round by step time (of an even number, the faster middle one;
  a failed round counts only if all failed), with ``rounds_ms``, every
  round's step in ms in the order they ran."""
  groups = {}
  for r in results:
    groups.setdefault(r['run'], []).append(r)
  out = []
  for label, rs in groups.items():
    ok = sorted((r for r in rs if 'error' not in r), key=lambda r: r['step_s'])
    if len(rs) == 1 or not ok:
      out.append(rs[0])
      continue
    out.append({**ok[(len(ok) - 1) // 2],
                'rounds_ms': [1e3 * r['step_s'] if 'error' not in r else None for r in rs]})
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_run_args(p, rounds=True)
  a = p.parse_args(argv)
  run = child_run(a)
  if run:  # child process: one run, JSON on the last line
    harness.report(one_run(run_config(a, run), run.label, warmup_steps=a.warmup_steps,
                           timed_steps=a.timed_steps))
    return
  check_runs(p, a)
  print_table(a, run_each(a, 'bench_train', argv or sys.argv[1:], json.dumps))


def check_runs(p: argparse.ArgumentParser, a) -> list[harness.Run]:
  """The runs of ``a``, each configured once here so that a bad one is
  refused (``p.error``) before any process starts."""
  try:
    runs = runs_of(a)
  except ValueError as e:
    p.error(f'--run: {e}')
  for run in runs:
    try:
      run_config(a, run)
    except ValueError as e:
      p.error(f'--run {run.label!r}: {e}')
  return runs


def print_table(a, results: list[dict]) -> None:
  """The results as a table on stdout, one row per run (:func:`by_run`: the
  median round, and each round's step with several)."""
  results = by_run(results)
  width = max([28] + [len(r['run']) for r in results])
  rounds = [Column('rounds ms', 8 * a.rounds, lambda r: ' '.join(
      '—' if ms is None else f'{ms:.1f}' for ms in r.get('rounds_ms', ())))] * (a.rounds > 1)
  table(results, [
      Column('run', width, lambda r: r['run'], key=True),
      Column('block', 6, lambda r: '—' if r.get('block_size') is None else str(r['block_size'])),
      Column('tokens/s', 10, lambda r: f"{r['tokens_per_s']:,.0f}"),
      Column('step ms', 9, lambda r: f"{1e3 * r['step_s']:.1f}"),
      Column('peak GiB', 9, lambda r: f"{r['peak_gib']:.2f}"),
      Column('opt state GiB', 14, lambda r: f"{r['optimizer_state_gib']:.3f}"), *rounds],
      title=f'{a.model}, seq {a.seq_len}, batch {a.batch_size}'
            f'{", lean state" if a.lean_state else ""}', error_chars=90)


if __name__ == '__main__':
  main()
