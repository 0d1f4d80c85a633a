"""Same-token parity: our runs against the published PyTorch POET-X (poet_torch)
and torch AdamW, trained on the very windows our runs train on, in their order.

For every seed, the training windows a ``poetx train`` run of the base
configuration draws (``train_dataset`` with that seed: ``steps x batch``
windows of ``seq + 1`` tokens, in update order) and its validation windows
are written as ``.npy`` files; then every variant runs once per seed, all at
once on the one device:

* ``ours:K=V,...``: ``poetx_jax.pretrain.train.train`` with the base
  configuration changed by the ``K=V`` overrides (``TrainConfig`` fields);
* ``anchor:K=V,...``: ``poet_torch_train.py`` (an HF ``LlamaForCausalLM``
  trained by poet_torch's POET-X or by torch AdamW, pure bf16, on the written
  windows) with the same configuration translated: POET step ``poet_lr``
  (poet_torch's rate with its ``poet_scale`` set to 1), ``lr`` for the other
  parameters, ``merge_every``, ``block_size``, warmup then cosine to
  ``min_lr_ratio``, global-norm ``clip``, ``eval_every``, ``eval_batches``.

The reference trains without weight decay, so every variant here does too
unless it sets ``weight_decay`` (the app's AdamW and Muon default to 0.1 on
models of hidden size 512 and up);
an anchor variant that sets one is refused.

Both report the mean cross-entropy per target token over the same
validation windows. The report (OUT/parity.md, results.json, parity.png)
gives each variant's validation loss at every evaluation and at the end, per
seed, with the mean and the spread (max - min) over seeds.

    python3 -m experiments.parity --anchor-dir .anchors --out-dir runs/parity \\
        --model 130m --seq-len 256 --batch-size 64 --steps 1200 --eval-every 200 \\
        --lr 1e-3 --poet-lr 2.5e-4 --merge-every 200 --warmup 100 --seeds 0,1 \\
        --variants ours:optimizer=poetx anchor:optimizer=poetx \\
                   ours:optimizer=adamw,lr=6e-4 anchor:optimizer=adamw,lr=6e-4

``--anchor-dir`` holds ``poet_torch_train.py`` and poet_torch's ``poet_torch/``
package (github Sphere-AI-Lab/poet; kept out of this repository). CPU smoke
test of our side alone (the anchor needs a GPU)::

    python3 -m experiments.parity --model tiny --seq-len 32 --batch-size 4 --steps 6 \\
        --eval-every 3 --eval-batches 2 --dtype float32 --seeds 0 \\
        --variants ours:optimizer=poetx --out-dir runs/parity-smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

from experiments import harness
from experiments.common import progress

SIDES = ('ours', 'anchor')


def parse_args(argv=None):
  from poetx_jax.pretrain import config
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  config.add_options(p)
  p.add_argument('--variants', nargs='+', metavar='SIDE:K=V|V,...',
                 help=f'runs to compare, labelled by their side, one of {SIDES}; a value '
                      'with |-separated alternatives stands for one run each')
  p.add_argument('--seeds', default='0', help='comma-separated seeds (data order and init)')
  p.add_argument('--anchor-dir', default='.anchors',
                 help='folder with poet_torch_train.py and the poet_torch package')
  p.add_argument('--jax-mem-fraction', type=float, default=0.0,
                 help="share of the device's memory each of our runs preallocates (0: "
                      'none, each allocates what it needs)')
  p.add_argument('--probe-every', type=int, default=0,
                 help='our POET-X runs: record the generators\' norms every N updates '
                      '(0: never)')
  harness.add_child_option(p)  # one of our runs: {'config': PATH}
  a = p.parse_args(argv)
  if a.child:
    return a
  if not a.variants:
    p.error('give at least one --variants entry')
  base = config.config_from_args(a)
  a.seeds = [int(s) for s in a.seeds.split(',') if s.strip()]
  a.specs = []
  for text in a.variants:
    try:
      runs = harness.expand(text)
    except ValueError as e:
      p.error(f'variant {text!r}: {e}')
    side = harness.split_label(text)[0]
    for run in runs:
      if side not in SIDES:
        p.error(f'variant {text!r}: side must be one of {SIDES}')
      try:
        cfg = config.drop_shared_poet_options(harness.apply(base, run), base)
        cfg = with_element_draws(without_default_decay(cfg, side), side)
        cfg.validate()
      except ValueError as e:
        p.error(f'variant {text!r}: {e}')
      a.specs.append({'name': f'{side}:{run.overrides}', 'side': side, 'cfg': cfg})
  if not a.seeds:
    p.error('--seeds is empty')
  a.out = pathlib.Path(a.out_dir or 'runs/parity')
  return a


# -------------------------------------------------------------------------- data
def write_windows(cfg, seeds: list[int], out: pathlib.Path) -> dict:
  """Writes OUT/train-s{seed}.npy (the windows of each update, in order) and
  OUT/val.npy; returns the vocabulary and the corpus line."""
  import numpy as np
  from poetx_jax.pretrain.data import windows as data_lib
  from poetx_jax.pretrain import loading
  data = loading.load_data(cfg)
  out.mkdir(parents=True, exist_ok=True)
  val = data.val_windows[:cfg.eval_batches * cfg.batch_size]
  np.save(out / 'val.npy', np.asarray(val, np.int16))
  for seed in seeds:
    it = iter(data_lib.train_dataset(data.train_windows, batch_size=cfg.batch_size,
                                     seed=seed))
    rows = []
    for _ in range(cfg.steps):
      b = next(it)
      rows.append(np.concatenate([b['inputs'][:, :1], b['targets']], axis=1))
    np.save(out / f'train-s{seed}.npy', np.concatenate(rows).astype(np.int16))
  return {'vocab_size': data.tokenizer.vocab_size, 'data': data.description,
          'val_windows': int(len(val))}


def without_default_decay(cfg, side: str):
  """``cfg`` with weight decay 0 where it leaves it to the recipe (the reference
  trains without it); ValueError for an anchor run given any other."""
  if cfg.weight_decay is None:
    return dataclasses.replace(cfg, weight_decay=0.0)
  if side == 'anchor' and cfg.weight_decay != 0:
    raise ValueError(f'weight_decay={cfg.weight_decay}: poet_torch_train.py trains without '
                     'weight decay (0 is the only value an anchor run takes)')
  return cfg


def with_element_draws(cfg, side: str):
  """``cfg`` drawing element permutations where it leaves the draw open (the
  reference draws only those; left open, a POET-X run on a GPU would draw
  chunk permutations); ValueError for an anchor run given chunk ones."""
  from poetx_jax.pretrain.recipes import RECIPES
  if not RECIPES[cfg.optimizer].poetizes:
    return cfg
  if cfg.permutation is None:
    return dataclasses.replace(cfg, permutation='element')
  if side == 'anchor' and cfg.permutation != 'element':
    raise ValueError(f'permutation={cfg.permutation!r}: poet_torch_train.py draws element '
                     'permutations (the only value an anchor run takes)')
  return cfg


# -------------------------------------------------------------------------- runs
def anchor_command(cfg, seed: int, windows: pathlib.Path, vocab: int, metrics: pathlib.Path,
                   anchor_dir: pathlib.Path) -> list[str]:
  """poet_torch_train.py's command for ``cfg``: the values of its plan (an
  AdamW run passes no POET options)."""
  from poetx_jax.pretrain.plan import make_plan
  plan = make_plan(cfg, vocab)
  poet = (['--poet-lr', str(plan.poet_lr), '--poet-scale', '1.0', '--merge-every',
           str(plan.merge_every), '--block-size', str(plan.block_size)] if plan.poetize else [])
  return [sys.executable, str(anchor_dir / 'poet_torch_train.py'), '--size', cfg.model,
          '--train', str(windows / f'train-s{seed}.npy'), '--val', str(windows / 'val.npy'),
          '--optimizer', cfg.optimizer, '--out', str(metrics), '--vocab', str(vocab),
          '--steps', str(cfg.steps), '--batch', str(cfg.batch_size),
          '--lr', str(plan.lr), *poet, '--warmup', str(cfg.warmup),
          '--min-lr-ratio', str(plan.min_lr_ratio), '--clip', str(cfg.clip),
          '--eval-every', str(cfg.eval_every), '--eval-batches', str(cfg.eval_batches),
          '--seed', str(seed), '--dtype', 'bfloat16']


def launch(a, spec: dict, seed: int, windows: pathlib.Path, vocab: int):
  """Starts one run in a process of its own; returns (process, metrics path, log path)."""
  name = f'{spec["name"].replace(":", "-").replace(",", "-").replace("=", "")}-s{seed}'
  run_dir = a.out / 'runs' / name
  run_dir.mkdir(parents=True, exist_ok=True)
  cfg = dataclasses.replace(spec['cfg'], seed=seed, out_dir=str(run_dir / 'run'))
  log = open(run_dir / 'log.txt', 'w')
  env = dict(os.environ)
  if spec['side'] == 'ours':
    (run_dir / 'config.json').write_text(json.dumps(dataclasses.asdict(cfg)))
    if a.jax_mem_fraction:
      env['XLA_PYTHON_CLIENT_MEM_FRACTION'] = str(a.jax_mem_fraction)
    else:
      env['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'
    cmd = harness.child_command('parity', ['--probe-every', str(a.probe_every)],
                                {'config': str(run_dir / 'config.json')})
    env = harness.child_env(env)
    metrics = run_dir / 'run' / 'metrics.jsonl'
  else:
    metrics = run_dir / 'anchor.jsonl'
    cmd = anchor_command(cfg, seed, windows, vocab, metrics, pathlib.Path(a.anchor_dir))
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [str(pathlib.Path(a.anchor_dir)),
                                                      env.get('PYTHONPATH')]))
  proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
  return {'name': spec['name'], 'side': spec['side'], 'seed': seed, 'proc': proc,
          'metrics': metrics, 'log': run_dir / 'log.txt', 'start': time.perf_counter()}


def val_losses(run: dict) -> dict[int, float]:
  """{step: validation loss} of a finished (or partial) run."""
  if not run['metrics'].exists():
    return {}
  out = {}
  for line in run['metrics'].read_text().splitlines():
    try:
      r = json.loads(line)
    except json.JSONDecodeError:
      continue
    if 'val_loss' in r:
      out[int(r['step'])] = float(r['val_loss'])
  return out


def generator_norms(model) -> dict:
  """The largest norms over every block of every POET layer's generators Q:
  spectral ``||Q||_2`` (exact, from the eigenvalues of Q^T Q), Frobenius, and
  the bound ``sqrt(||Q^2||_inf) >= ||Q||_2``."""
  import jax
  import jax.numpy as jnp
  import poetx_jax
  from poetx_jax import ops

  @jax.jit
  def norms(q_in, q_out, i, o, b):
    del i, o
    out = []
    for q in (q_in, q_out):
      q = ops.unpack_skew(q.astype(jnp.float32).reshape(-1, q.shape[-1]), b)
      qtq = jnp.swapaxes(q, -1, -2) @ q
      spec = jnp.sqrt(jnp.maximum(jnp.linalg.eigvalsh(qtq)[..., -1], 0))
      frob = jnp.linalg.norm(q, axis=(-2, -1))
      bound = jnp.sqrt(jnp.max(jnp.sum(jnp.abs(qtq), -1), -1))
      out.append(jnp.stack([spec.max(), frob.max(), bound.max()]))
    return jnp.max(jnp.stack(out), 0)

  norms = jax.jit(norms.__wrapped__, static_argnums=(2, 3, 4))
  best = None
  for _, layer in poetx_jax.poet_layers(model):
    n = norms(layer.q_in[...], layer.q_out[...], layer.in_features, layer.out_features,
              layer.block_size)
    best = n if best is None else jnp.maximum(best, n)
  spec, frob, bound = (float(x) for x in best)
  return {'q_spectral': spec, 'q_frobenius': frob, 'q_bound': bound}


# ------------------------------------------------------------------------ report
def summarise(runs: list[dict]) -> list[dict]:
  """One row per variant: final loss per seed, mean and spread, and the
  per-evaluation means."""
  rows = []
  for name in dict.fromkeys(r['name'] for r in runs):
    mine = [r for r in runs if r['name'] == name]
    done = [r for r in mine if r['val'] and not r['returncode']]  # failed runs: no figures
    finals = {r['seed']: r['val'][max(r['val'])] for r in done}
    steps = sorted(set.intersection(*[set(r['val']) for r in done])) if done else []
    curve = {s: statistics.mean(r['val'][s] for r in done) for s in steps}
    rows.append({'name': name, 'finals': finals, 'curve': curve,
                 'final_steps': {r['seed']: max(r['val']) if r['val'] else None for r in mine},
                 'mean': statistics.mean(finals.values()) if finals else None,
                 'spread': max(finals.values()) - min(finals.values()) if finals else None,
                 'failed': [r['seed'] for r in mine if r['returncode']],
                 'wall_s': {r['seed']: round(r['wall_s'], 1) for r in mine}})
  return rows


def report(rows: list[dict], header: dict) -> str:
  lines = ['# Same-token parity', '', f"{header['config']}", '',
           f"data: {header['data']}; validation: {header['val_windows']} windows; "
           f"device {header['device']}; {header['date']}.", '',
           '| variant | final val loss per seed | mean | spread (max - min) | ppl of mean '
           '| failed seeds |', '|---|---|---|---|---|---|']
  import math
  for r in rows:
    per = ', '.join(f's{s} {v:.4f} (step {r["final_steps"][s]})'
                    for s, v in sorted(r['finals'].items())) or '—'
    mean = '—' if r['mean'] is None else f"{r['mean']:.4f}"
    spread = '—' if r['spread'] is None else f"{r['spread']:.4f}"
    ppl = '—' if r['mean'] is None else f"{math.exp(r['mean']):.2f}"
    lines.append(f"| {r['name']} | {per} | {mean} | {spread} | {ppl} | "
                 f"{r['failed'] or ''} |")
  steps = sorted({s for r in rows for s in r['curve']})
  lines += ['', '## Mean validation loss at every evaluation', '',
            '| variant | ' + ' | '.join(str(s) for s in steps) + ' |',
            '|---|' + '---|' * len(steps)]
  for r in rows:
    lines.append(f"| {r['name']} | " + ' | '.join(
        f"{r['curve'][s]:.4f}" if s in r['curve'] else '—' for s in steps) + ' |')
  return '\n'.join(lines) + '\n'


def plot(runs: list[dict], path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(8, 5))
  names = list(dict.fromkeys(r['name'] for r in runs))
  colors = dict(zip(names, plt.rcParams['axes.prop_cycle'].by_key()['color'] * 3))
  for r in runs:
    if r['val']:
      steps = sorted(r['val'])
      ax.plot(steps, [r['val'][s] for s in steps], color=colors[r['name']],
              ls='-' if r['side'] == 'ours' else '--', marker='.',
              label=f"{r['name']} s{r['seed']}")
  ax.set(xlabel='update', ylabel='validation loss (nats per token)', yscale='log',
         title='same tokens, same order')
  ax.grid(alpha=0.3, which='both')
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  a = parse_args(argv)
  if a.child:  # one of our runs, in a process of its own
    from poetx_jax.pretrain.config import TrainConfig
    from poetx_jax.pretrain.recipes import RECIPES
    from poetx_jax.pretrain.train import Hook, train
    path = harness.child_payload(a)['config']
    cfg = TrainConfig(**json.loads(pathlib.Path(path).read_text()))
    n = a.probe_every
    # At the step before each multiple of N: with N = merge_every, just before a merge.
    probe = lambda run: generator_norms(run.model) if (run.step + 1) % n == 0 else None
    hooks = [Hook(probe, wait=False)] if n and RECIPES[cfg.optimizer].poetizes else []
    train(cfg, log=lambda m: print(m, flush=True), hooks=hooks)
    return None
  import jax
  base = a.specs[0]['cfg']
  progress(f'writing the windows of seeds {a.seeds}')
  meta = write_windows(base, a.seeds, a.out / 'windows')
  progress(f"data: {meta['data']}")
  runs = [launch(a, spec, seed, a.out / 'windows', meta['vocab_size'])
          for spec in a.specs for seed in a.seeds]
  progress(f'{len(runs)} runs started')
  for r in runs:
    r['returncode'] = r['proc'].wait()
    r['wall_s'] = time.perf_counter() - r['start']
    r['val'] = val_losses(r)
    progress(f"{r['name']} s{r['seed']}: exit {r['returncode']}, {r['wall_s']:.0f} s, "
             f"final val {r['val'].get(max(r['val'])) if r['val'] else None}")
  rows = summarise(runs)
  header = {'config': ', '.join(f'{k}={v}' for k, v in dataclasses.asdict(base).items()
                                if k not in ('out_dir', 'cache_dir')),
            'device': jax.devices()[0].device_kind, 'date': time.strftime('%Y-%m-%d'),
            **meta}
  md = report(rows, header)
  (a.out / 'parity.md').write_text(md)
  (a.out / 'results.json').write_text(json.dumps(
      {'header': header, 'rows': rows,
       'runs': [{k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in r.items()
                 if k != 'proc'} for r in runs]}, indent=1, default=str))
  plot(runs, a.out / 'parity.png')
  print(md)
  return rows


if __name__ == '__main__':
  main()
