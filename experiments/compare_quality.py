"""Training quality: POET-X against AdamW, Muon and SkewAdam on the same tokens in the same order.

Every run is ``poetx_jax.pretrain.train.train`` with one ``TrainConfig``: the
options are ``poetx train``'s (here by default model 60m, seq 256, batch 64,
400 updates, warmup 20, validation every 50, a merge every 200, clip 1.0),
and each run is ``K=V`` overrides of them. ``--runs`` takes specs whose
values may list ``|`` alternatives; a spec stands for every combination of
them (the cartesian product). The same seed gives the same initial dense
model (POET-X poetizes it, so both start from the same function and the same
singular values) and the same order of training batches; ``seed=0|1|2`` gives
each configuration several seeds, and the report then gives the mean and the
sample standard deviation over them. ``lr=best`` (for POET-X: the AdamW rate
of its non-POET parameters, embeddings, norms, LM head) is the learning rate
of the best AdamW configuration, by mean final validation perplexity; those
runs come after the others.

It reports, in OUT/quality.md (also printed), OUT/results.json, OUT/quality.png
(quality_report.py), from what the study leaves on disk as it goes: OUT/study.json
(the header and the plan, written before the first run) and each finished
run's OUT/runs/NAME/summary.json. ``quality_report.py --out DIR OUT`` writes
the same report anywhere from those files alone (no corpus needed), e.g. of a
study stopped before its last run:

* validation perplexity at equal tokens: at every evaluation and at the end;
* validation perplexity at equal wall-clock time. Each run's clock is its
  steady-state training time, ``train_s - compile_s`` of its metrics.jsonl:
  the wall time of the training loop less evaluation, probes and checkpoints
  (each timed after waiting for the queued steps) and less the time spent
  tracing and compiling programs (jax.monitoring spans: the first step's
  update program, the merge programs of the first POET-X merge). It includes
  data loading, host dispatch and, for POET-X, every merge and the per-step
  read-back of the merge flag. The budget is the shortest run's total; each
  run's perplexity at that time is interpolated linearly in log-perplexity
  between its evaluations;
* both per run and per configuration (the runs that differ only in seed);
* loss spikes: logged steps whose training loss exceeds 1.5 x the median of
  the previous ``SPIKE_WINDOW`` logged losses (at least 3 of them).

Spectrum and stability (OUT/spectrum.png; numbers in results.json), recorded
by a train ``Hook`` at step 0 and every ``--probe-every`` steps for the first
and last decoder layer's attention q projection and MLP down projection
(those that are single matrices: a mixture-of-experts model's expert
projections are stacks of kernels, so there only the q projections): the
singular values of the effective weight (POET-X:
``poetx_jax.effective_kernel``, i.e. ``R W0 P``; AdamW: the ``nnx.Linear``
kernel), computed in float64 from the float32 kernel; their top and bottom
``TOP_K``; ``||s - s_0|| / ||s_0||`` against step 0; the SVD entropy
``-sum_i p_i log p_i`` with ``p_i = s_i / sum_j s_j`` (natural log; the
effective-rank entropy of Roy and Vetterli, 2007 — the POET paper's own
definition was not available to check against); and for POET-X the
orthogonality error of its Cayley–Neumann factors,
``POETLinear.orthogonality_error()`` (the largest ``||G^T G - I||_F / sqrt(B)``
over the blocks of both sides; what ``poetx train`` logs at each merge).
A probe at a multiple of ``merge_every`` sees freshly merged weights (Q = 0,
so that error is exactly 0); the default probe points fall mid-cycle too.
Expected: within a merge cycle POET-X's singular values stay those at the
cycle's start up to the series' orthogonality error; a merge folds the factors,
orthogonal up to that error, into W0, so the drift from step 0 grows by about
that much per cycle; AdamW's move by orders of magnitude more.

CPU smoke test (tiny model, built-in corpus; about 25 s on 2 cores once the
corpus is tokenized and cached)::

    python3 -m experiments.compare_quality --model tiny --seq-len 64 --batch-size 8 \\
        --steps 60 --warmup 3 --eval-every 20 --probe-every 10 --merge-every 40 \\
        --block-size 16 --dtype float32 --out runs/quality-smoke \\
        --runs optimizer=adamw,lr=3e-3 'optimizer=poetx,poet_lr=2.5e-3|5e-3,lr=best'

On one H200 (bf16 compute), Llama-60M (vocab 4096: 29.5 M parameters), seq 256,
batch 64: each run sees 400 x 64 x 256 = 6,553,600 tokens (0.28 passes over the
built-in corpus's 23.7 M training tokens, under CPython 3.12 without Debian's
Python documentation); 2 AdamW + 2 POET-X runs::

    python3 -m experiments.compare_quality --probe-every 50 --merge-every 100 \\
        --block-size 256 --out runs/quality \\
        --runs 'optimizer=adamw,lr=1e-3|3e-3' 'optimizer=poetx,poet_lr=5e-4|1e-3,lr=best'

Three seeds of each, and POET-X's merge interval as a third axis::

    python3 -m experiments.compare_quality --block-size 256 --out runs/quality-seeds \\
        --runs 'optimizer=adamw,lr=1e-3|3e-3,seed=0|1|2' \\
               'optimizer=poetx,poet_lr=5e-4|1e-3,merge_every=50|200,lr=best,seed=0|1|2'

Llama-130M, B = 128 and 256, on two GPUs side by side (BENCHMARKS.md; each
command about 7.5 minutes on an H200)::

    Q="--model 130m --probe-every 50 --merge-every 100"
    python3 -m experiments.compare_quality $Q --out runs/q130-b256 \\
        --runs 'optimizer=adamw,lr=1e-3|3e-3' 'optimizer=poetx,block_size=256,poet_lr=1e-3,lr=3e-3'
    python3 -m experiments.compare_quality $Q --out runs/q130-b128 \\
        --runs optimizer=adamw,lr=6e-4 'optimizer=poetx,block_size=128,poet_lr=1e-3|2e-3,lr=3e-3'

``--jobs N`` trains N runs at once, each in a process of its own on the same
GPU (a 130M model leaves most of an H200 idle). Each run's losses are those
it has alone (tested on the CPU); its steady tokens/s are lower and depend on
what shares the GPU with it, so with ``--jobs`` above 1 the equal-time table
is not a comparison of speeds. A run that fails (with ``--jobs``, its
process exits non-zero: out of memory, killed; one at a time, it raises, and
its traceback goes to OUT/logs/NAME.log) does not stop the others; the report
covers the runs that finished and names the failed ones, each with how far
it got (the last update it logged and its last evaluation), and the script
then exits non-zero. A study stopped before it ended (SIGINT, SIGTERM: a time
limit) continues with the flags it started with and ``--resume``: its
finished runs are kept, each started run continues from its newest
checkpoint (resumed runs train the tokens, in the order, they would have
trained), a started run that holds none (killed before its first) starts
over, and a run's steady tokens/s adds the clocks of its processes
(quality_report.steady_clock). With ``--jobs``, the signal stops the study,
not its children: each child runs in a session of its own, so a Ctrl-C or a
time limit's signal to the study's process group reaches the study alone,
which passes it on once to every running child and waits while each saves a
checkpoint at its next update (a second signal passes on too: the children
then stop at once, unsaved); a child whose study is killed outright stops
itself the same way.

Short runs are dominated by compilation (each run's learning rates are
constants of its update program, so every run compiles its own); the measured
costs and a first H200 comparison are in BENCHMARKS.md. The POET-X
step-size grid stays at or under 1e-3 for B = 256: at 5e-3 the generators
leave the Cayley–Neumann series' region of convergence (BENCHMARKS.md, where
the rates recorded before the learning rate became the step size are twice
the step).

Mixture-of-experts models (``--model moe-tiny`` / ``moe-60m``) take SkewAdam
runs (``optimizer=skewadam``) and POET-X runs whose non-POET parameters take
SkewAdam's tiers instead of AdamW (``optimizer=poetx,skew_tiers=true``). Their
report adds the routing of each run's last validation: the share of token
slots of the most and least loaded expert (summed over layers) and the slots
dropped over capacity. On one H200::

    python3 -m experiments.compare_quality --model moe-60m --merge-every 100 \\
        --block-size 128 --data data/builtin --out runs/moe-quality \\
        --runs 'optimizer=adamw|skewadam,lr=1e-3|3e-3' \\
               'optimizer=poetx,skew_tiers=true,poet_lr=1e-3|2e-3,lr=3e-3'

``--other-val NAME=PATH`` also scores every run, at each evaluation, on
other text (a folder of files, tokenized with the run's tokenizer, or a
prepared directory): validation on another kind of text than the training
data, e.g. ``site_corpus.py``'s OUT/prose (the standard library's help
topics) beside its mostly-code training side. The report then has a
"Validation on other text" table, and each run's results its curves.

The default corpus is the built-in one of ``poetx train`` (the README says
what it holds: 25.0 M tokens with vocab 4096 under CPython 3.12, without
Debian's Python documentation); ``--data`` trains on other text or on a
dataset directory made by ``poetx prepare``. The corpus line is printed and
written into the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback

from experiments import harness, quality_report as R
from experiments.bench_train import progress

QUALITY_DEFAULTS = dict(model='60m', seq_len=256, batch_size=64, steps=400, warmup=20,
                        eval_every=50, merge_every=200, clip=1.0,
                        checkpoint_every=1_000_000, keep=1)  # the final checkpoint only
DEFAULT_RUNS = ('optimizer=adamw,lr=1e-3|3e-3',
                'optimizer=poetx,block_size=128|256,poet_lr=5e-4|1e-3,lr=best')
TOP_K = 4            # singular values kept at each end of the spectrum


# ------------------------------------------------------------------------ runs
def _text(pairs) -> str:
  from poetx_jax.pretrain.kv import format_overrides
  return format_overrides(pairs)


def plan_runs(base, specs: list[str]) -> list[dict]:
  """Every run of ``specs``, those with ``lr=best`` after the others: its
  ``name`` (its label, by default its overrides: :func:`experiments.harness.expand`;
  its directory under OUT/runs), ``config`` (the name
  without its seed: its configuration), ``pairs`` and ``best_lr``. Raises
  ValueError for a run given twice or one that cannot be configured."""
  runs = []
  for spec in specs:
    for run in harness.expand(spec):
      pairs = list(run.pairs)
      name = re.sub(r'[^A-Za-z0-9.,=+_-]', '_', run.label)
      key = _text([(k, v) for k, v in pairs if k != 'seed']) or 'base'
      best = ('lr', 'best') in pairs
      runs.append({'name': name, 'config': key, 'pairs': pairs, 'best_lr': best})
  names = [r['name'] for r in runs]
  for n in names:
    if names.count(n) > 1:
      raise ValueError(f'run {n!r} is given twice by --runs {specs}')
  seeds = [(r['config'], dict(r['pairs']).get('seed', str(base.seed))) for r in runs]
  for key in seeds:
    if seeds.count(key) > 1:
      raise ValueError(f'configuration {key[0]!r} is given twice with seed {key[1]} by --runs '
                       f'{specs} (runs of one configuration must differ in seed)')
  runs.sort(key=lambda r: r['best_lr'])
  for r in runs:
    check(run_config(base, r, pathlib.Path('.'), best_lr=base.lr))
  if any(r['best_lr'] for r in runs) and not any(
      run_config(base, r, pathlib.Path('.')).optimizer == 'adamw'
      for r in runs if not r['best_lr']):
    raise ValueError('lr=best takes the best AdamW run\'s learning rate: --runs has no '
                     'AdamW run (optimizer=adamw)')
  return runs


def run_config(base, run: dict, out: pathlib.Path, best_lr: float | None = None):
  """The ``TrainConfig`` of a run (``lr=best`` as ``best_lr``), in OUT/runs/NAME;
  a run whose optimizer does not poetize leaves out the POET options it shares
  with ``base``."""
  from poetx_jax.pretrain import config
  cfg = harness.apply(base, _text(p for p in run['pairs'] if p != ('lr', 'best')))
  cfg = config.drop_shared_poet_options(cfg, base)
  if run['best_lr'] and best_lr is not None:
    cfg = dataclasses.replace(cfg, lr=best_lr)
  return dataclasses.replace(cfg, out_dir=str(out / 'runs' / run['name']))


def check(cfg) -> None:
  """Raises ValueError unless ``cfg`` can run here: ``poetx train``'s own rules,
  the block size against the model's dimensions, evaluations at logged steps."""
  from poetx_jax.pretrain.plan import make_plan
  cfg.validate()
  if cfg.eval_every % cfg.log_every:
    raise ValueError(f'log_every={cfg.log_every} must divide eval_every={cfg.eval_every} (the '
                     f'wall-clock time of an evaluation is read from the log record at its step)')
  if cfg.warmup >= cfg.steps:
    raise ValueError(f'warmup={cfg.warmup} must be less than steps={cfg.steps}')
  make_plan(cfg)  # the block size against the model's dimensions


def parse_args(argv=None):
  from poetx_jax.pretrain import config
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  config.add_options(p, overrides=QUALITY_DEFAULTS, exclude=('out_dir',))
  p.add_argument('--runs', nargs='+', default=list(DEFAULT_RUNS), metavar='K=V|V,...',
                 help='run specs: overrides of the options above, a value with |-separated '
                      'alternatives standing for one run each (all combinations); lr=best: '
                      'the best AdamW configuration\'s rate (default: %(default)s)')
  p.add_argument('--probe-every', type=int, default=None,
                 help='steps between spectrum probes (default: --eval-every)')
  p.add_argument('--out', default='runs/quality', help='where the runs and the report go')
  p.add_argument('--overwrite', action='store_true',
                 help='replace run directories left in OUT by an earlier invocation')
  p.add_argument('--resume', action='store_true',
                 help='continue the study in OUT, stopped before it ended, with the flags it '
                      'started with: its finished runs are kept, a started run continues from '
                      'its newest checkpoint (poetx train --resume), the others start')
  p.add_argument('--other-val', action='append', default=[], metavar='NAME=PATH',
                 help='also score every run on this text (files or a folder, tokenized with '
                      "the run's tokenizer) or prepared dataset directory (tokenized with it), "
                      'at each evaluation: validation on another kind of text than the '
                      'training data; repeatable')
  p.add_argument('--jobs', type=int, default=1,
                 help='runs trained at once, each in a process of its own on the same '
                      'devices (a small model leaves a GPU idle between its kernels; the '
                      'processes time-share it, so a model that keeps it busy gains '
                      'nothing); default: one at a time, in this process')
  harness.add_child_option(p)  # a --jobs child: {'run': NAME, 'best_lr': lr or None}
  a = p.parse_args(argv)
  if a.jobs < 1:
    p.error(f'--jobs must be >= 1, got {a.jobs}')
  if a.resume and a.overwrite:
    p.error('--resume keeps the run directories in OUT that --overwrite would replace; '
            'pass one of them')
  try:
    a.base = config.config_from_args(a)
    a.plan = plan_runs(a.base, a.runs)
  except (ValueError, TypeError) as e:
    p.error(str(e))
  a.only = harness.child_payload(a)
  if a.only is not None and a.only['run'] not in [r['name'] for r in a.plan]:
    p.error(f"--child: {a.only['run']!r} is not a run of --runs")
  try:
    a.other_val = other_val_sets(a.other_val)
  except ValueError as e:
    p.error(str(e))
  a.probe_every = a.probe_every or a.base.eval_every
  if a.probe_every < 1:
    p.error(f'--probe-every must be >= 1, got {a.probe_every}')
  return a


# ------------------------------------------------------------------------ probe
def _module_at(model, path: str):
  node = model
  for part in path.split('.'):
    node = node[int(part)] if part.isdigit() else getattr(node, part)
  return node


def _is_matrix(layer) -> bool:
  """Whether a layer's (effective) kernel is one 2-D matrix."""
  from flax import nnx
  import poetx_jax
  if isinstance(layer, poetx_jax.POETLinear):
    return not layer.stack_shape
  return isinstance(layer, nnx.Linear) and layer.kernel.ndim == 2


def probed_layers(model) -> list[str]:
  """Paths of the probed projections: the first and last decoder layer's
  attention q and MLP down projections, those that are single matrices."""
  out = []
  for i in dict.fromkeys((0, model.config.layers - 1)):
    for name in ('self_attn.q_proj', 'mlp.down_proj'):
      try:
        layer = _module_at(model, f'layers.{i}.{name}')
      except AttributeError:
        continue
      if _is_matrix(layer):
        out.append(f'layers.{i}.{name}')
  return out


def svd_entropy(s) -> float:
  """-sum p log p of p = s / sum(s) (natural log)."""
  import numpy as np
  p = np.asarray(s, np.float64)
  p = p[p > 0] / p.sum()
  return float(-(p * np.log(p)).sum())


def spectrum_hook(every: int):
  """A train ``Hook`` (at step 0 and every ``every``) recording the spectrum
  of each probed projection's effective weight against its first call's and
  the POET factors' orthogonality error; ``hook.fn.paths``: the probed paths."""
  import numpy as np
  from flax import nnx
  import poetx_jax
  from poetx_jax.pretrain.train import Hook

  orth_err = nnx.jit(lambda layer: layer.orthogonality_error())
  kernel_of = nnx.jit(poetx_jax.effective_kernel)
  first = {}

  def probe(run):
    if probe.paths is None:
      probe.paths = probed_layers(run.model)
    rec = {}
    for path in probe.paths:
      layer = _module_at(run.model, path)
      if isinstance(layer, poetx_jax.POETLinear):
        w = kernel_of(layer)
        rec[f'{path}/orth_err'] = float(orth_err(layer))
      else:
        w = layer.kernel[...]
      s = np.linalg.svd(np.asarray(w, np.float64), compute_uv=False)
      s0 = first.setdefault(path, s)
      rec[f'{path}/sv_top'] = s[:TOP_K].tolist()
      rec[f'{path}/sv_bottom'] = s[-TOP_K:].tolist()
      rec[f'{path}/sv_rel_change'] = float(np.linalg.norm(s - s0) / np.linalg.norm(s0))
      rec[f'{path}/svd_entropy'] = svd_entropy(s)
    return rec

  probe.paths = None
  return Hook(probe, every=every, at_start=True)


# ------------------------------------------------------ other validation text
def other_val_sets(specs: list[str]) -> list[tuple[str, pathlib.Path]]:
  """``--other-val NAME=PATH`` values as (name, path, a leading ``~`` expanded);
  ValueError naming a bad one."""
  out = []
  for spec in specs:
    name, sep, path = spec.partition('=')
    if not sep or not re.fullmatch(r'[A-Za-z0-9_.-]+', name) or not path:
      raise ValueError(f'--other-val wants NAME=PATH with NAME of letters, digits, _ . -, '
                       f'got {spec!r}')
    if name in [n for n, _ in out]:
      raise ValueError(f'--other-val names {name!r} twice')
    where = pathlib.Path(path).expanduser()
    if not where.exists():
      raise ValueError(f'--other-val {spec}: {where} does not exist')
    out.append((name, where))
  return out


def other_windows(path: pathlib.Path, cfg, tokenizer: pathlib.Path):
  """The first ``cfg.eval_batches`` batches' worth of windows of ``path`` in the
  run's tokenization: a prepared dataset directory (refused unless tokenized
  with ``tokenizer``) whole, or text files read as documents and tokenized."""
  from poetx_jax.pretrain.data import documents, shards, windows
  if shards.is_prepared(path):
    w = shards.PreparedData(path, seq_len=cfg.seq_len, val_fraction=None,
                            tokenizer_path=tokenizer).train_windows
  else:
    w = windows.TextData(documents.read_documents([path]), seq_len=cfg.seq_len,
                         cache_dir=cfg.cache_dir, tokenizer_path=tokenizer,
                         val_fraction=None).train_windows
  if not len(w):
    raise ValueError(f'--other-val {path} holds no window of {cfg.seq_len + 1} tokens')
  return w[:cfg.eval_batches * cfg.batch_size]


def other_val_hook(sets: list[tuple[str, pathlib.Path]], every: int):
  """A train ``Hook`` (at step 0 and every ``every``) scoring the model on each
  (name, path) of ``sets``: ``other_val/NAME/loss`` and ``.../ppl`` records.
  The batches are read once, at the first call, with the run's stored tokenizer."""
  from poetx_jax.pretrain.data import windows
  from poetx_jax.pretrain.evaluation import evaluate
  from poetx_jax.pretrain.train import Hook
  batches = {}

  def score(run):
    if not batches:
      cfg = run.plan.options
      tok = next(run.out / n for n in ('tokenizer.json', 'tokenizer.model')
                 if (run.out / n).exists())
      for name, path in sets:
        batches[name] = windows.eval_batches(other_windows(path, cfg, tok),
                                             batch_size=cfg.batch_size)
    rec = {}
    for name, b in batches.items():
      e = evaluate(run.model, b, run.mesh)
      rec[f'other_val/{name}/loss'], rec[f'other_val/{name}/ppl'] = e.loss, e.ppl
    return rec

  return Hook(score, every=every, at_start=True)


# ------------------------------------------------------------------------ main
def train_run(a, run: dict, done: list[dict], out: pathlib.Path,
              best_lr: float | None = None) -> dict:
  """Trains one run with the spectrum hook; its summary (quality_report.summarise),
  also written to its directory's summary.json.
  ``lr=best`` is ``best_lr`` if given, else the best AdamW rate among ``done``.
  A run whose loss turns non-finite is summarised as diverged (up to its last
  logged step), not raised: a sweep goes on past its unstable corners. One
  stopped before its last update (SIGTERM, SIGINT) has no summary: SystemExit
  naming the step it reached; the study's ``--resume`` continues it from its
  checkpoint, as ``poetx train --resume`` does (with ``a.resume``, a run
  whose directory holds a run.json and a checkpoint; one with a run.json and
  no checkpoint, killed before its first, starts over)."""
  from poetx_jax.pretrain import train as train_lib
  from poetx_jax.pretrain.plan import make_plan
  if run['best_lr'] and best_lr is None:
    best_lr = R.best_adamw_lr(done)
  cfg = run_config(a.base, run, out, best_lr if run['best_lr'] else None)
  plan = make_plan(cfg)
  lr = plan.lr
  spec = {'name': run['name'], 'config': run['config'], 'optimizer': cfg.optimizer,
          'lr': lr, 'poet_lr': plan.poet_lr, 'seed': cfg.seed, 'block_size': plan.block_size,
          'tiers': cfg.skew_tiers, 'merge_every': plan.merge_every,
          'param_dtype': cfg.param_dtype, 'permutation': plan.permutation,
          'chunk_size': cfg.chunk_size if plan.permutation == 'chunk' else None}
  started = (pathlib.Path(cfg.out_dir) / 'run.json').exists()
  resume = a.resume and started and has_checkpoint(pathlib.Path(cfg.out_dir))
  progress(f'run {len(done) + 1}/{len(a.plan)}: {run["name"]} (lr {lr:g})'
           + (', resumed' if resume else
              ', started over (it holds no checkpoint)' if a.resume and started else ''))
  hook = spectrum_hook(a.probe_every)
  try:
    hooks = [hook] + ([other_val_hook(a.other_val, cfg.eval_every)] if a.other_val else [])
    trained = train_lib.train(cfg, resume=resume, hooks=hooks,
                              log=lambda m, n=run['name']: progress(f'{n}: {m}'))
    if trained['stopped']:
      raise SystemExit(f'{run["name"]}: stopped at step {trained["step"]} of {cfg.steps} '
                       f'({trained["stopped"]}); not a result of the study')
  except train_lib.NonFiniteLoss as e:
    spec['diverged'] = str(e)
    progress(f'{run["name"]}: diverged: {e}')
  r = R.summarise(spec, pathlib.Path(cfg.out_dir), cfg.batch_size * cfg.seq_len)
  r['probed_layers'] = hook.fn.paths or []
  (pathlib.Path(cfg.out_dir) / 'summary.json').write_text(json.dumps(r))
  progress(f'{run["name"]}: val ppl {r["val_ppl_start"]:.2f} -> {r["val_ppl_final"]:.2f}, '
           f'{r["steady_s"]:.1f} s steady + {r["compile_s"]:.1f} s compiling')
  return r


def has_checkpoint(run_dir: pathlib.Path) -> bool:
  """Whether the run directory holds a saved checkpoint (a run killed
  before its first holds a run.json and none)."""
  from poetx_jax.pretrain.checkpoint import saved_steps
  return bool(saved_steps(run_dir / 'checkpoints'))


def run_log(out: pathlib.Path, name: str) -> pathlib.Path:
  """OUT/logs/NAME.log: a --jobs run's output, or a failed run's traceback."""
  return out / 'logs' / f'{name}.log'


def run_serial(a, out: pathlib.Path) -> None:
  """Trains the plan's runs one after another in this process. A run that
  raises (out of memory, say; a diverged run is a result, not an error) stops
  none of the others: its traceback goes to OUT/logs/NAME.log, as a --jobs
  child's output would, and it has no summary. A stop (SystemExit: SIGTERM,
  SIGINT) or KeyboardInterrupt ends the study."""
  done = []
  for run in a.plan:
    if (kept := finished(a, out, run)) is not None:
      done.append(kept)
      continue
    try:
      done.append(train_run(a, run, done, out))
    except Exception as e:  # noqa: BLE001 - reported, then the next run
      log = run_log(out, run['name'])
      log.parent.mkdir(parents=True, exist_ok=True)
      log.write_text(traceback.format_exc())
      first = (str(e).splitlines() or [''])[0]  # XLA's errors run to many lines
      progress(f'{run["name"]} failed ({type(e).__name__}: {first}); traceback in {log}')


def finished(a, out: pathlib.Path, run: dict) -> dict | None:
  """With ``--resume``, the summary of a run of the study in OUT that already
  finished (its summary.json); None for one to train."""
  summary = out / 'runs' / run['name'] / 'summary.json'
  if not (a.resume and summary.is_file()):
    return None
  progress(f'{run["name"]}: finished before, kept')
  return json.loads(summary.read_text())


# ------------------------------------------------------- runs side by side
def run_jobs(a, argv: list[str], out: pathlib.Path) -> None:
  """Trains the plan's runs ``a.jobs`` at a time, each in a process of its own
  (a child of this script whose payload names the run) on the same devices, its output in
  OUT/logs/NAME.log; the ``lr=best`` runs start once every other run is done.
  The children inherit this process's environment, where :func:`main` turned
  XLA's preallocation off: each takes the accelerator's memory as it needs it,
  up to 0.9 / jobs of it (XLA_PYTHON_CLIENT_MEM_FRACTION, unless the
  environment sets either). A run that fails (its process exits non-zero)
  stops none of the others; the ``lr=best`` runs fail unstarted when no AdamW
  run finished. What finished is what OUT/runs/NAME/summary.json holds
  (quality_report.from_study).

  SIGINT and SIGTERM stop the study. Each child runs in a session of its own,
  so the signal of a Ctrl-C or of a time limit to this process's group
  reaches this process alone; here it is only recorded (:class:`Stops`), and
  the loop, between two children's starts, passes it on to every running
  child and waits while each saves a checkpoint at its next update
  (:func:`stop_children`), then exits with the shells' code of the signal
  (130, 143), naming ``--resume``. Left any other way (an error here), the
  study stops its running children the same way (SIGTERM) before it raises;
  a child whose study dies unannounced (SIGKILL) stops itself
  (:func:`watch_parent`)."""
  live: dict[str, subprocess.Popen] = {}
  with Stops() as stops:
    try:
      _run_jobs(a, argv, out, live, stops)
    except BaseException:
      stop_children(live, 'SIGTERM', out, stops)
      raise
    if stops.received:
      name = stops.received[0]
      held = stop_children(live, name, out, stops)
      progress(f'{name}: the study stopped'
               + (f'; {", ".join(held)} hold a checkpoint to continue from' if held else '')
               + '; continue it with the flags it started with and --resume')
      raise SystemExit(128 + signal.Signals[name].value)


class Stops:
  """SIGINT and SIGTERM, while :func:`run_jobs` runs, recorded in order
  (``received``, by name) and raising nothing, so that no signal can land
  between a child's start and its entry in the study's table of children."""

  def __init__(self):
    self.received: list[str] = []
    self._old = {}

  def __enter__(self) -> 'Stops':
    for s in (signal.SIGINT, signal.SIGTERM):
      self._old[s] = signal.signal(s, self._record)
    return self

  def _record(self, signum, frame):
    self.received.append(signal.Signals(signum).name)

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


def stop_children(live: dict[str, subprocess.Popen], name: str, out: pathlib.Path,
                  stops: Stops) -> list[str]:
  """Sends the signal ``name`` to each running child of :func:`run_jobs`
  (``live``, by run) and waits for them to exit; each signal recorded in
  ``stops`` meanwhile is passed on too (a second one: the children stop at
  once, unsaved). Returns the runs whose directory then holds a checkpoint
  (each saved one as it stopped: ``poetx train``'s stop)."""
  runs = dict(live)
  if runs:
    progress(f'{name}: stopping the running runs at their next update ({", ".join(runs)}); '
             f'each saves a checkpoint')
  seen = len(stops.received)
  for proc in runs.values():
    if proc.poll() is None:
      proc.send_signal(signal.Signals[name])
  while live:
    for run, proc in list(live.items()):
      if proc.poll() is not None:
        del live[run]
    for again in stops.received[seen:]:
      progress(f'{again}: stopping {", ".join(live)} at once, unsaved')
      for proc in live.values():
        if proc.poll() is None:
          proc.send_signal(signal.Signals[again])
    seen = len(stops.received)
    time.sleep(0.1)
  return [run for run in runs if has_checkpoint(out / 'runs' / run)]


def watch_parent(study_pid: int) -> None:
  """In a child of :func:`run_jobs`: sends this process SIGTERM (its
  training stops at the next update and saves a checkpoint) once the study
  that started it, process ``study_pid``, is no longer its parent (it died),
  checked every second from a thread of its own."""
  import threading

  def watch():
    while os.getppid() == study_pid:
      time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)
  threading.Thread(target=watch, name='watch-parent', daemon=True).start()


def _run_jobs(a, argv: list[str], out: pathlib.Path, live: dict, stops: Stops) -> None:
  """:func:`run_jobs`' loop, until its runs ended or a signal is recorded in
  ``stops``; ``live`` holds the running children by run."""
  env = dict(os.environ)
  env.setdefault('XLA_PYTHON_CLIENT_MEM_FRACTION', f'{0.9 / a.jobs:.3f}')
  (out / 'logs').mkdir(parents=True, exist_ok=True)
  done: dict[str, dict] = {}
  failed = []
  for phase in (False, True):  # the lr=best runs after the others
    queue = [r for r in a.plan if r['best_lr'] == phase]
    for run in list(queue):
      if (kept := finished(a, out, run)) is not None:
        done[run['name']] = kept
        queue.remove(run)
    best = None
    if phase and queue:
      try:
        best = R.best_adamw_lr(list(done.values()))
      except ValueError as e:  # no AdamW run finished: these cannot start
        for run in queue:
          failed.append(run['name'])
          run_log(out, run['name']).write_text(f'not started: {e}\n')
          progress(f'{run["name"]} failed ({e})')
        queue = []
    while queue or live:
      while queue and len(live) < a.jobs and not stops.received:
        run = queue.pop(0)
        with open(run_log(out, run['name']), 'w') as log:
          cmd = harness.child_command('compare_quality', argv, {
              'run': run['name'], 'best_lr': best, 'study_pid': os.getpid()})
          live[run['name']] = subprocess.Popen(
              cmd, env=harness.child_env(env), stdout=log, stderr=log, start_new_session=True)
        progress(f'started {run["name"]} ({len(done) + len(failed) + len(live)}'
                 f'/{len(a.plan)}), log {run_log(out, run["name"])}')
      if stops.received:
        return
      time.sleep(0.5)
      for name, proc in list(live.items()):
        if proc.poll() is None:
          continue
        del live[name]
        summary = out / 'runs' / name / 'summary.json'
        if proc.returncode == 0 and summary.is_file():
          done[name] = json.loads(summary.read_text())
          progress(f'{name}: val ppl {done[name]["val_ppl_final"]:.2f}')
        else:
          failed.append(name)
          progress(f'{name} failed (exit {proc.returncode}); see its log')


def header(a, data, out: pathlib.Path) -> dict:
  """What the report says about the study, known before it trains: the base
  options and the data (beside :func:`experiments.harness.header`'s command,
  commit, device, software and date; quality_report.from_study adds the
  probes and the runs that failed). The model, dtype and merge interval are
  the runs' own plans' (the first run's; the merge interval of the first run
  that merges), never the base options' alone, whose POET options a study of
  a narrow model may override in every run."""
  from poetx_jax.pretrain.plan import make_plan
  cfg = a.base
  plans = [make_plan(run_config(cfg, r, out), data.tokenizer.vocab_size) for r in a.plan]
  plan = plans[0]
  mc = plan.model
  tokens_per_step = cfg.batch_size * cfg.seq_len
  train_tokens = int(data.train_windows.shape[0]) * cfg.seq_len
  val_windows = min(len(data.val_windows), cfg.eval_batches * cfg.batch_size)
  return {
      **{k: getattr(cfg, k) for k in ('model', 'model_overrides', 'seq_len', 'batch_size',
                                      'steps', 'warmup', 'min_lr_ratio', 'clip', 'seed',
                                      'eval_every')},
      'merge_every': next((p.merge_every for p in plans if p.poetize), None),
      'runs': a.runs, 'jobs': a.jobs, 'dense_params': mc.num_params(),
      'vocab_size': data.tokenizer.vocab_size, 'tokens_per_step': tokens_per_step,
      'tokens_per_run': cfg.steps * tokens_per_step, 'train_tokens': train_tokens,
      'epochs': cfg.steps * tokens_per_step / train_tokens,
      'val_tokens': val_windows * cfg.seq_len, 'data': data.description,
      'dtype': plan.dtype,
      'spike_rule': f'loss > {R.SPIKE_FACTOR} x median of the previous {R.SPIKE_WINDOW} logged',
  }


def _resumed_out(a) -> pathlib.Path:
  """OUT of the study ``--resume`` continues, whose study.json holds the runs,
  probe interval and base options given now (the flags it started with)."""
  out = pathlib.Path(a.out)
  if not (out / 'study.json').is_file():
    raise SystemExit(f'--resume: {out} holds no study ({out / "study.json"} does not '
                     f'exist); nothing to resume')
  before = json.loads((out / 'study.json').read_text())['args']
  now = json.loads(json.dumps(study_args(a)))
  changed = sorted(k for k in now['base'] if now['base'][k] != before['base'].get(k))
  changed += [k for k in ('runs', 'probe_every') if now[k] != before[k]]
  if changed:
    was = lambda k: before['base'].get(k) if k in now['base'] else before[k]
    raise SystemExit(f'--resume: the study in {out} started with other '
                     + ', '.join(f'{k} ({was(k)!r} there)' for k in changed)
                     + ' (its study.json); resume it with the flags it started with')
  return out


def study_args(a) -> dict:
  """The flags that make a study what it is (study.json's ``args``)."""
  return {'runs': a.runs, 'probe_every': a.probe_every, 'base': dataclasses.asdict(a.base)}


def _fresh_out(a) -> pathlib.Path:
  """OUT, made, with no run directory of this study left in it (unless --overwrite)."""
  out = pathlib.Path(a.out)
  left = [r['name'] for r in a.plan if (out / 'runs' / r['name']).exists()]
  if left and not a.overwrite:
    raise SystemExit(f'{out / "runs"} already holds run directories {left}; pass '
                     f'--overwrite to replace them, or choose another --out')
  for name in left:
    shutil.rmtree(out / 'runs' / name)
  out.mkdir(parents=True, exist_ok=True)
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  a = parse_args(argv)
  if a.only is not None:  # one run of a --jobs study, in a process of its own
    if 'study_pid' in a.only:  # started by run_jobs (not a test calling main)
      watch_parent(a.only['study_pid'])
    out = pathlib.Path(a.out)
    run = next(r for r in a.plan if r['name'] == a.only['run'])
    return train_run(a, run, [], out, best_lr=a.only['best_lr'])
  if a.jobs > 1:  # the children take the accelerator's memory, not this process
    os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  import jax
  from poetx_jax.pretrain import loading
  out = _resumed_out(a) if a.resume else _fresh_out(a)
  data = loading.load_data(run_config(a.base, a.plan[0], out))  # tokenized once, cached
  print(f'data: {data.description}', flush=True)
  if not a.resume:  # a resumed study keeps the header of its start
    (out / 'study.json').write_text(json.dumps(
        {'header': {**harness.header('compare_quality', argv), **header(a, data, out)},
         'plan': [r['name'] for r in a.plan], 'args': study_args(a)}, indent=1))
  progress(f'{len(a.plan)} runs of {a.base.model}, {a.base.steps} updates x '
           f'{a.base.batch_size * a.base.seq_len:,} tokens, {a.jobs} at a time, on '
           f'{jax.devices()[0].device_kind}')
  if a.jobs > 1:
    run_jobs(a, argv, out)
  else:
    run_serial(a, out)
  try:
    res = R.from_study(out)
  except ValueError as e:  # no run finished
    raise SystemExit(f'{e}; their logs: {out / "logs"}') from None
  (out / 'results.json').write_text(json.dumps(res, indent=1))
  md = R.report(res)
  (out / 'quality.md').write_text(md)
  R.plot_quality(res, out / 'quality.png')
  R.plot_spectrum(res, res['header']['probed_layers'], out / 'spectrum.png')
  print(md)
  progress(f'wrote {out / "quality.md"}, results.json, quality.png, spectrum.png')
  failed = res['header']['failed_runs']
  if failed:
    raise SystemExit(f'runs {failed} failed (their logs: {out / "logs"}); the report '
                     f'covers the other {len(res["runs"])}')
  return res


if __name__ == '__main__':
  main()
