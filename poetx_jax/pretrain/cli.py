"""The ``poetx`` command: train, eval, export and plot Llama runs.

    poetx train                       # tiny Llama, POET-X, built-in corpus
    poetx train --optimizer adamw --out-dir runs/tiny-adamw
    poetx train --resume --out-dir runs/tiny-poetx
    poetx eval runs/tiny-poetx
    poetx export runs/tiny-poetx --out exported/
    poetx plot runs/tiny-poetx runs/tiny-adamw --out loss.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

from poetx_jax.pretrain.checkpoint import CheckpointError


def _train_parser(sub):
  from poetx_jax.pretrain.train import TrainConfig
  d = TrainConfig()
  p = sub.add_parser('train', help='train a Llama with POET-X (or AdamW)')
  p.add_argument('--model', default=d.model,
                 help="named config: tiny, 60m, 130m, 350m, 1b, 3b, 8b, 13b")
  p.add_argument('--model-overrides', default='', metavar='K=V,...',
                 help='override config fields, e.g. layers=4,hidden=128')
  p.add_argument('--data', nargs='*', default=None, metavar='PATH',
                 help='text files or folders (.txt .md .rst .jsonl .jsonl.gz .json.gz '
                      '.parquet); default: the built-in corpus')
  p.add_argument('--tokenizer', default=None, help='tokenizer file (HF tokenizers '
                 'JSON or sentencepiece .model); default: a BPE trained on the corpus')
  for name, typ, hlp in (
      ('vocab-size', int, 'vocabulary of the trained BPE'),
      ('seq-len', int, 'tokens per sequence'), ('batch-size', int, 'sequences per micro-batch'),
      ('grad-accum', int, 'micro-batches per optimizer update'),
      ('steps', int, 'optimizer updates'), ('lr', float, 'peak learning rate of AdamW '
                                            '(and of the non-POET parameters)'),
      ('poet-lr', float, 'peak POET-X step size; default min(5e-3, 0.25 / block size)'),
      ('warmup', int, 'warmup updates'), ('min-lr-ratio', float, 'final/peak learning rate'),
      ('weight-decay', float, 'AdamW weight decay'), ('clip', float, 'global-norm clip (0: off)'),
      ('merge-every', int, 'POET-X merge interval in updates'),
      ('block-size', int, 'POET block size (default: the model config\'s)'),
      ('group-size', int, 'POET-XQ rows per quantisation group'),
      ('seed', int, 'seed of model, permutations and data order'),
      ('val-fraction', float, 'share of tokens held out for validation'),
      ('eval-every', int, 'validate every N micro-steps'),
      ('eval-batches', int, 'validation batches per evaluation'),
      ('log-every', int, 'log every N micro-steps'),
      ('checkpoint-every', int, 'checkpoint every N micro-steps'),
      ('keep', int, 'checkpoints kept'),
      ('fsdp', int, 'size of the mesh axis that shards state (strategy fsdp)'),
      ('out-dir', str, 'run directory (default: runs/MODEL-OPTIMIZER)'),
      ('cache-dir', str, 'tokenizer and token cache')):
    attr = name.replace('-', '_')
    default = getattr(d, attr)
    p.add_argument(f'--{name}', type=typ, default=default,
                   help=hlp if default is None else f'{hlp} (default: {default})')
  p.add_argument('--optimizer', choices=('poetx', 'adamw'), default=d.optimizer)
  p.add_argument('--mode', choices=('fast', 'mem'), default=d.mode,
                 help='POET-X fast (keeps activations) or mem (recomputes)')
  p.add_argument('--form', choices=('input', 'weight'), default=d.form,
                 help='POET layer product order: rotate the activations (input) or '
                      'the frozen weight (weight); same function')
  p.add_argument('--implementation', choices=('xla', 'pallas'),
                 default=d.implementation,
                 help="POET layers' block products: XLA, or the Pallas Mosaic GPU "
                      'kernels (Hopper, 16-bit activations; block size a multiple of 64, <= 512)')
  p.add_argument('--remat', choices=('none', 'block', 'attn'), default=d.remat,
                 help='rematerialise each decoder layer: keep only its input (block), '
                      'or its input and attention output (attn)')
  p.add_argument('--scan-layers', action='store_true',
                 help='store the decoder layers stacked and run them with lax.scan: '
                      'compile time independent of depth (for large models)')
  p.add_argument('--strategy', choices=('dp', 'fsdp'), default=d.strategy,
                 help='on several devices: replicate the state (dp) or shard it (fsdp)')
  p.add_argument('--distributed', action='store_true',
                 help='multi-host: call jax.distributed.initialize() first (it reads '
                      'the coordinator and process ids from the cluster environment)')
  p.add_argument('--lean-state', action='store_true',
                 help='bf16 momenta; factored second moments for the non-POET '
                      'parameters (embeddings, head, norms; all of them for AdamW) and '
                      'one second moment per block for the POET generators')
  p.add_argument('--quantize', choices=('int8', 'int4'), default=None,
                 help='POET-XQ: store the frozen base weights in int8 or int4')
  p.add_argument('--dtype', choices=('auto', 'float32', 'bfloat16'), default=d.dtype,
                 help='compute dtype; auto: bfloat16 on GPU, float32 elsewhere')
  p.add_argument('--param-dtype', choices=('float32', 'bfloat16'), default=d.param_dtype,
                 help='dtype of the weights (POET generators are always float32)')
  p.add_argument('--resume', action='store_true', help='continue from the newest '
                 'checkpoint in --out-dir')
  p.add_argument('--plot', default=None, metavar='PNG',
                 help='write the loss curves here when done (default: OUT_DIR/loss.png)')
  return p


def _parse_overrides(text: str) -> dict:
  out = {}
  for item in filter(None, text.split(',')):
    if '=' not in item:
      raise ValueError(f'--model-overrides wants K=V pairs, got {item!r}')
    k, v = item.split('=', 1)
    try:
      out[k.strip()] = json.loads(v)
    except json.JSONDecodeError:
      out[k.strip()] = v
  return out


def cmd_train(a) -> int:
  if a.distributed:
    import jax
    jax.distributed.initialize()
  from poetx_jax.pretrain.train import TrainConfig, train
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  cfg = TrainConfig(**{k: v for k, v in vars(a).items() if k in fields and k != 'model_overrides'},
                    model_overrides=_parse_overrides(a.model_overrides))
  summary = train(cfg, resume=a.resume)
  if 'val_before' in summary and 'val_after' in summary:
    print(f"validation perplexity: {summary['val_before']['ppl']:.2f} -> "
          f"{summary['val_after']['ppl']:.2f}")
  print(f"{summary['tokens_per_s']:,.0f} tokens/s over {summary['elapsed_s']:.1f} s "
        f"({summary['steady_tokens_per_s']:,.0f} tokens/s less compilation, evaluation "
        f"and checkpoints)" + (f"; peak device memory {summary['peak_gib']:.2f} GiB"
                               if 'peak_gib' in summary else ''))
  from poetx_jax.pretrain.plot import plot_runs
  png = a.plot or str(pathlib.Path(summary['out_dir']) / 'loss.png')
  try:
    plot_runs([summary['out_dir']], png)
    print(f'loss curves: {png}')
  except ImportError:
    print('no loss plot: matplotlib is not installed (metrics.jsonl has the curves)')
  return 0


def cmd_eval(a) -> int:
  from poetx_jax.pretrain import data as data_lib
  from poetx_jax.pretrain.train import evaluate, load_run
  cfg, data, model, step = load_run(a.run, step=a.step)
  batches = data_lib.eval_batches(data.val_windows, batch_size=cfg.batch_size)
  loss, ppl = evaluate(model, batches)
  print(json.dumps({'run': a.run, 'step': step, 'val_loss': loss, 'val_ppl': ppl,
                    'val_tokens': int(data.val_windows.size)}))
  return 0


def cmd_export(a) -> int:
  from poetx_jax.pretrain.export import export_run
  path = export_run(a.run, a.out, step=a.step)
  print(f'wrote {path}')
  return 0


def cmd_plot(a) -> int:
  from poetx_jax.pretrain.plot import plot_runs
  plot_runs(a.runs, a.out)
  print(f'wrote {a.out}')
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='poetx', description=__doc__.split('\n\n')[0])
  sub = parser.add_subparsers(dest='command', required=True)
  _train_parser(sub).set_defaults(func=cmd_train)
  p = sub.add_parser('eval', help='validation loss and perplexity of a run')
  p.add_argument('run')
  p.add_argument('--step', type=int, default=None)
  p.set_defaults(func=cmd_eval)
  p = sub.add_parser('export', help='merged dense weights (safetensors, HF Llama layout)')
  p.add_argument('run')
  p.add_argument('--out', required=True)
  p.add_argument('--step', type=int, default=None)
  p.set_defaults(func=cmd_export)
  p = sub.add_parser('plot', help='loss / perplexity curves of runs to a PNG')
  p.add_argument('runs', nargs='+')
  p.add_argument('--out', default='loss.png')
  p.set_defaults(func=cmd_plot)
  a = parser.parse_args(argv)
  try:
    return a.func(a)
  except (ValueError, FileNotFoundError, CheckpointError, ImportError) as e:
    print(f'poetx {a.command}: error: {e}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
