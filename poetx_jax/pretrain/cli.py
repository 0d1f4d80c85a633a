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
import json
import pathlib
import sys

from poetx_jax.pretrain.checkpoint import CheckpointError


def _train_parser(sub):
  from poetx_jax.pretrain.config import add_options
  p = sub.add_parser('train', help='train a Llama with POET-X (or AdamW)',
                     description='Train a Llama with POET-X (or AdamW). Every option '
                                 'but --resume, --distributed and --plot is a field '
                                 'of TrainConfig, saved in OUT_DIR/run.json.')
  add_options(p)
  p.add_argument('--resume', action='store_true', help='continue from the newest '
                 'checkpoint in --out-dir')
  p.add_argument('--distributed', action='store_true',
                 help='multi-host: call jax.distributed.initialize() first (it reads '
                      'the coordinator and process ids from the cluster environment)')
  p.add_argument('--plot', default=None, metavar='PNG',
                 help='write the loss curves here when done (default: OUT_DIR/loss.png)')
  return p


def cmd_train(a) -> int:
  if a.distributed:
    import jax
    jax.distributed.initialize()
  from poetx_jax.pretrain.config import config_from_args
  from poetx_jax.pretrain.train import train
  summary = train(config_from_args(a), resume=a.resume)
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
  from poetx_jax.pretrain.evaluation import evaluate
  from poetx_jax.pretrain.rundir import load_run
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


def build_parser() -> argparse.ArgumentParser:
  """The ``poetx`` parser: its train, eval, export and plot subcommands."""
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
  return parser


def main(argv=None) -> int:
  a = build_parser().parse_args(argv)
  try:
    return a.func(a)
  except (ValueError, FileNotFoundError, CheckpointError, ImportError) as e:
    print(f'poetx {a.command}: error: {e}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
