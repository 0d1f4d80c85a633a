"""Training-step throughput and peak memory: POET-X against optax AdamW.

For each optimizer a fresh process builds the Llama (``--model``), checks the
setup (the POET-X model equals the dense one at step 0; the first loss is near
log(vocab)), compiles the train step of ``poetx train``, runs ``--warmup``
steps, then times ``--steps`` device-synchronised steps on random tokens and
reads the device's peak memory. One table at the end; ``--json`` keeps it all.

    python3 experiments/bench_train.py --model 1b --seq-len 1024 --batch-size 8
    python3 experiments/bench_train.py --model 8b --seq-len 1024 --batch-size 1 \\
        --runs poetx:mem:block,adamw --lean-state
    python3 experiments/bench_train.py --model tiny --seq-len 64 --steps 3   # CPU smoke test

A run is ``optimizer[:mode[:remat[:quantize[:form[:implementation[:param_dtype]]]]]]``,
e.g. ``poetx:mem:block:int8``, ``poetx:fast:none::weight``, ``poetx:::::pallas`` or
``poetx:fast:block::::bfloat16`` (an empty field keeps its default, the last
``--param-dtype``); the optimizer is ``poetx``, ``adamw``,
``skewadam`` or ``poetx+tiers`` (POET-X with SkewAdam's tiers for the other
parameters, ``--skew-tiers``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time


def progress(msg: str) -> None:
  """A progress line on stderr (the parent shows it live, prefixed)."""
  print(f'[{time.strftime("%H:%M:%S")}] {msg}', file=sys.stderr, flush=True)


def run_child(cmd: list[str], label: str, env=None) -> tuple[dict | None, str | None]:
  """Runs one benchmark process whose last stdout line is its JSON result.

  Its progress lines (stderr) are echoed as they come, prefixed with
  ``label`` (library warnings are not). Returns ``(result, None)``, or
  ``(None, error)`` with the last lines of its output when it failed.
  """
  with tempfile.TemporaryFile(mode='w+') as stdout:
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True,
                            env=env)
    tail = []
    for line in proc.stderr:
      line = line.rstrip('\n')
      tail = (tail + [line])[-20:]
      if line.startswith('['):
        print(f'  {label}: {line}', file=sys.stderr, flush=True)
    rc = proc.wait()
    stdout.seek(0)
    out = stdout.read().strip()
  if rc:
    lines = ('\n'.join(tail) or out).strip().splitlines()
    return None, ' | '.join(lines[-3:])[-300:]
  return json.loads(out.splitlines()[-1]), None


def run_config(a, run: str):
  """The TrainConfig of run ``optimizer[:mode[:remat[:quantize[:form]]]]``."""
  from poetx_jax.pretrain.config import TrainConfig
  parts = run.split(':') + [None] * 6
  optimizer, mode, remat = parts[0], parts[1] or 'fast', parts[2] or 'none'
  tiers = optimizer == 'poetx+tiers'
  optimizer = 'poetx' if tiers else optimizer
  quant, form, impl = parts[3] or None, parts[4] or 'input', parts[5] or 'xla'
  overrides = json.loads(a.model_overrides) if a.model_overrides else {}
  cfg = TrainConfig(model=a.model, model_overrides=overrides, seq_len=a.seq_len,
                    batch_size=a.batch_size, steps=1000, optimizer=optimizer,
                    mode=mode, form=form, implementation=impl, remat=remat,
                    quantize=quant, skew_tiers=tiers,
                    lean_state=a.lean_state, dtype=a.dtype, block_size=a.block_size,
                    merge_every=a.merge_every,
                    param_dtype=parts[6] or getattr(a, 'param_dtype', 'float32'),
                    scan_layers=getattr(a, 'scan_layers', False),
                    strategy=getattr(a, 'strategy', None) or 'dp',
                    attention=getattr(a, 'attention', 'auto'))
  if cfg.strategy == 'fsdp':  # FSDP over every device
    import jax
    cfg = dataclasses.replace(cfg, fsdp=jax.device_count())
  cfg.validate()
  return cfg


def resident_state(a, run: str) -> dict:
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
  cfg = run_config(a, run)
  mc = F.model_config(cfg, a.vocab_size)
  model, opt = F.abstract_state(cfg, mc)
  gib = lambda tree: poetx_jax.state_bytes(tree) / 2 ** 30
  r = {'run': run, 'model': a.model, 'dense_params': mc.num_params(),
       'model_gib': gib(nnx.state(model)), 'trainable_gib': gib(nnx.state(model, nnx.Param)),
       'optimizer_gib': gib(nnx.state(opt))}
  r['floor_gib'] = r['model_gib'] + r['trainable_gib'] + r['optimizer_gib']
  return r


def compiled_memory(a, run: str) -> dict:
  """GiB of the compiled update program for this backend, from abstract state.

  Lowers and compiles the jitted gradient-and-update program of the run on
  abstract state (``factories.abstract_state``, nothing allocated) and reads XLA's buffer
  assignment: ``arguments`` (model, optimizer state and batch) and
  ``temporaries`` (everything else live during the step, gradients and saved
  activations included). Merges run in their own small programs.
  """
  import jax
  import jax.numpy as jnp
  from poetx_jax.pretrain import factories as F
  cfg = run_config(a, run)
  mc = F.model_config(cfg, a.vocab_size)
  model, opt = F.abstract_state(cfg, mc)
  tokens = jax.ShapeDtypeStruct((a.batch_size, a.seq_len), jnp.int32)
  step = F.make_step(cfg, mc)
  t0 = time.perf_counter()
  compiled = step.lower(
      model, opt, {'inputs': tokens, 'targets': tokens}).compile()
  m = compiled.memory_analysis()
  return {'run': run, 'model': a.model, 'seq_len': a.seq_len, 'batch': a.batch_size,
          'backend': jax.default_backend(), 'compile_s': time.perf_counter() - t0,
          'arguments_gib': m.argument_size_in_bytes / 2 ** 30,
          'temporaries_gib': m.temp_size_in_bytes / 2 ** 30}


def setup_run(a, run: str) -> dict:
  """Builds the run's model, optimizer, step and two random batches, compiles
  the step on a first update and checks the setup (the first loss is near
  log(vocab)). Returns them in a dict with the mesh (or None), ``checks`` and
  ``compile_s``."""
  import jax.numpy as jnp
  import numpy as np

  from poetx_jax import sharding
  from poetx_jax.pretrain import factories as F

  cfg = run_config(a, run)
  mc = F.model_config(cfg, a.vocab_size)
  t_setup = time.perf_counter()
  progress(f'{run}: building {a.model} ({mc.num_params() / 1e6:,.0f}M dense parameters)')
  # A mesh only where a strategy was asked for (bench_scaling), over every device.
  mesh = F.make_training_mesh(cfg) if getattr(a, 'strategy', None) else None
  model = F.build_model(cfg, mc, mesh)  # fsdp + scan: built into its shards
  rng = np.random.default_rng(0)
  batches = [{'inputs': jnp.asarray(rng.integers(0, a.vocab_size, (a.batch_size, a.seq_len)),
                                    jnp.int32),
              'targets': jnp.asarray(rng.integers(0, a.vocab_size, (a.batch_size, a.seq_len)),
                                     jnp.int32)} for _ in range(2)]
  checks = {}
  opt = F.build_optimizer(cfg, model)
  if mesh is not None:
    sharding.shard_state(model, mesh, cfg.strategy)
    sharding.shard_state(opt, mesh, cfg.strategy)
    batches = [sharding.shard_batch(b, mesh) for b in batches]
  step = F.make_step(cfg, mc, mesh=mesh)
  progress(f'{run}: set up in {time.perf_counter() - t_setup:.0f} s; compiling the step')
  t0 = time.perf_counter()
  loss0 = float(step(model, opt, batches[0]))
  compile_s = time.perf_counter() - t0
  progress(f'{run}: first step (compilation) {compile_s:.0f} s, loss {loss0:.3f}')
  checks['first_loss'] = loss0
  checks['log_vocab'] = math.log(a.vocab_size)
  # Random logits of variance s^2 give about log V + s^2 / 2: wide models start
  # above log V (70B-class shapes at init_std 0.02: +1.6), a broken setup far off.
  if not abs(loss0 - math.log(a.vocab_size)) < 0.25 * math.log(a.vocab_size):
    raise SystemExit(f'{run}: setup check failed: {checks}')
  return dict(cfg=cfg, mc=mc, model=model, opt=opt, step=step, batches=batches, mesh=mesh,
              checks=checks, compile_s=compile_s)


def one_run(a, run: str) -> dict:
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import poetx_jax
  from poetx_jax import sharding
  from poetx_jax.models import moe

  s = setup_run(a, run)
  cfg, mc, model, opt, step = s['cfg'], s['mc'], s['model'], s['opt'], s['step']
  batches, mesh, checks, compile_s = s['batches'], s['mesh'], s['checks'], s['compile_s']
  optimizer = cfg.optimizer
  collectives = (sharding.collective_bytes(step.lower(
      model, opt, batches[1]).compile().as_text())
                 if mesh is not None else {})
  for i in range(a.warmup):
    jax.block_until_ready(step(model, opt, batches[i % 2]))
  times = []
  for i in range(a.steps):
    t = time.perf_counter()
    jax.block_until_ready(step(model, opt, batches[i % 2]))
    times.append(time.perf_counter() - t)
  med = statistics.median(times)
  progress(f'{run}: {a.steps} timed steps, median {1e3 * med:.1f} ms')
  stats = jax.local_devices()[0].memory_stats() or {}
  if optimizer == 'poetx':
    # After the peak is read (the dense copy would count): the POET model, its
    # generators trained and merged a few times, computes its exported model.
    # Past EXPORT_CHECK_MAX_PARAMS a dense copy may not fit beside the model
    # (and an MoE model's would be slow to form, expert by expert): then one
    # POET layer is checked against its exported kernel.
    if mc.num_params() <= EXPORT_CHECK_MAX_PARAMS and not isinstance(mc, moe.MoEConfig):
      probe = batches[0]['inputs'][:1, :min(a.seq_len, 128)]
      y_ref = poetx_jax.unpoetize(model)(probe)
      y = model(probe)
    else:
      layer = next(l for _, l in poetx_jax.poet_layers(model.layers[0])  # a copy when
                   if not l.stack_shape)  # stacked; not an expert stack
      x = jax.random.normal(jax.random.key(1), (8, layer.in_features),
                            layer.dtype or jnp.float32)
      y = layer(x).astype(jnp.float32)
      y_ref = x.astype(jnp.float32) @ poetx_jax.effective_kernel(layer).astype(jnp.float32)
      checks['export_check'] = 'one layer'
    checks['poet_vs_dense'] = float(jnp.linalg.norm(y - y_ref) / jnp.linalg.norm(y_ref))
    # bf16 rounding compounds with depth: 0.04 for Llama-8B (32 layers) after
    # three merges; a wrong rotation, permutation or layer order gives O(1).
    if not checks['poet_vs_dense'] < (0.1 if a.dtype != 'float32' else 1e-4):
      raise SystemExit(f'{run}: POET model and its export disagree: {checks}')
  n_train = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  opt_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(opt)))
  return {'run': run, 'model': a.model, 'seq_len': a.seq_len, 'batch': a.batch_size,
          'device': jax.devices()[0].device_kind, 'step_s': med,
          'tokens_per_s': a.batch_size * a.seq_len / med, 'compile_s': compile_s,
          'peak_gib': stats.get('peak_bytes_in_use', float('nan')) / 2 ** 30,
          'trainable': n_train, 'dense_params': mc.num_params(),
          'optimizer_state_gib': opt_bytes / 2 ** 30, 'checks': checks,
          'devices': jax.device_count(), 'strategy': cfg.strategy if mesh is not None else None,
          'collective_bytes': collectives}


EXPORT_CHECK_MAX_PARAMS = 20e9  # larger models check one exported layer


def add_run_args(p: argparse.ArgumentParser) -> None:
  """Arguments shared with bench_scaling.py: the model and how a run trains."""
  p.add_argument('--model', default='1b')
  p.add_argument('--model-overrides', default='', help='JSON dict of config fields')
  p.add_argument('--seq-len', type=int, default=1024)
  p.add_argument('--vocab-size', type=int, default=32000)
  p.add_argument('--block-size', type=int, default=None)
  p.add_argument('--merge-every', type=int, default=200)
  p.add_argument('--dtype', default='auto')
  p.add_argument('--param-dtype', default='float32', choices=('float32', 'bfloat16'))
  p.add_argument('--lean-state', action='store_true')
  p.add_argument('--attention', default='auto', choices=('auto', 'xla', 'cudnn'),
                 help="attention kernel (auto: cuDNN's fused attention on GPUs)")
  p.add_argument('--scan-layers', action='store_true',
                 help='decoder layers stacked and run by lax.scan (compile time '
                      'independent of depth)')
  p.add_argument('--warmup', type=int, default=3)
  p.add_argument('--steps', type=int, default=10)
  p.add_argument('--json', default=None)
  p.add_argument('--single', default=None, help=argparse.SUPPRESS)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_run_args(p)
  p.add_argument('--runs', default='poetx,adamw')
  p.add_argument('--batch-size', type=int, default=8)
  a = p.parse_args(argv)
  if a.single:  # child process: one run, JSON on the last line
    print(json.dumps(one_run(a, a.single)))
    return
  results = []
  base = [sys.executable, __file__] + [x for x in (argv or sys.argv[1:])]
  for run in a.runs.split(','):
    r, error = run_child(base + ['--single', run], run)
    results.append(r if error is None else {'run': run, 'error': error})
    print(json.dumps(results[-1]), flush=True)
  print(f'\n{a.model}, seq {a.seq_len}, batch {a.batch_size}'
        f'{", lean state" if a.lean_state else ""}')
  print(f'{"run":28s} {"tokens/s":>10s} {"step ms":>9s} {"peak GiB":>9s} '
        f'{"opt state GiB":>14s}')
  for r in results:
    if 'error' in r:
      print(f'{r["run"]:28s} failed: {r["error"][-90:]}')
    else:
      print(f'{r["run"]:28s} {r["tokens_per_s"]:10,.0f} {1e3 * r["step_s"]:9.1f} '
            f'{r["peak_gib"]:9.2f} {r["optimizer_state_gib"]:14.3f}')
  if a.json:
    with open(a.json, 'w') as f:
      json.dump(results, f, indent=1)


if __name__ == '__main__':
  main()
