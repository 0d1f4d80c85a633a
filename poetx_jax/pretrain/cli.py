"""The ``poetx`` command: train, eval, export and plot Llama runs; prepare corpora.

    poetx train                       # tiny Llama, POET-X Muon, built-in corpus
    poetx train --optimizer adamw --out-dir runs/tiny-adamw
    poetx train --resume --out-dir runs/tiny-poetx-muon
    poetx train --config runs/tiny-poetx-muon/run.json --out-dir runs/again   # or a .yaml
    poetx eval runs/tiny-poetx-muon
    poetx export runs/tiny-poetx-muon --out exported/
    poetx plot runs/tiny-poetx-muon runs/tiny-adamw --out loss.png
    poetx prepare corpus/ --out data/corpus   # then: poetx train --data data/corpus
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import signal
import sys
import threading

from poetx_jax.pretrain.disk_full import DiskFull, full_disk, full_disk_remedy, full_disk_text
from poetx_jax.pretrain import signals


def _train_parser(sub, *, defaults: bool = True):
  from poetx_jax.pretrain.config import add_options
  p = sub.add_parser('train', help='train a Llama with POET-X (or AdamW)',
                     description='Train a Llama with POET-X (or AdamW). Every option '
                                 'but --config, --resume, --step, --distributed and --plot '
                                 'is a field of TrainConfig, saved in OUT_DIR/run.json. Exit '
                                 'status: 0 finished, 2 bad option, data or checkpoint, '
                                 '3 non-finite loss, 4 OUT_DIR in use by another '
                                 'training, 5 a process of a --distributed run missing, '
                                 '6 a write refused for want of space (the checkpoints '
                                 'before it kept: continue with --resume), '
                                 '130 / 143 stopped by SIGINT / SIGTERM (a '
                                 'checkpoint saved: continue with --resume).')
  add_options(p, defaults=defaults)
  p.add_argument('--config', default=None, metavar='FILE',
                 help='read the options from a JSON or YAML file (.json, .yaml, .yml) of '
                      'TrainConfig fields by name, e.g. a run\'s run.json; the options given '
                      'on the command line override it (not with --resume, which reads the '
                      'run\'s own run.json)')
  p.add_argument('--resume', action='store_true', help='continue the run in --out-dir '
                 'from its newest intact checkpoint; the options not given are read from '
                 'its run.json, those given must agree with it (but --steps may be raised '
                 'to extend the run, --data, --val-data, --cache-dir may move, and '
                 '--tracking, --profile-steps, --strategy, --fsdp, --memory-slop may '
                 'change: a saved '
                 '--fsdp that does not divide the devices present is lowered to the '
                 'largest that does)')
  p.add_argument('--step', type=int, default=None, metavar='N',
                 help='with --resume: continue from checkpoint step N instead (the newer '
                      'checkpoints are moved to a new folder of '
                      'OUT_DIR/abandoned-checkpoints)')
  p.add_argument('--distributed', action='store_true',
                 help='multi-process: call jax.distributed.initialize() first (it reads '
                      'the coordinator and process ids from the cluster environment, '
                      'or from the three options below). Every process runs the same '
                      'command; they share OUT_DIR (a shared file system), the first '
                      'writes the run files and metrics, each reads only its own rows '
                      'of every batch')
  p.add_argument('--coordinator', default=None, metavar='HOST:PORT',
                 help='with --distributed: the address of process 0\'s coordinator '
                      '(where no cluster environment names it)')
  p.add_argument('--num-processes', type=int, default=None, metavar='N',
                 help='with --distributed: the number of processes')
  p.add_argument('--process-id', type=int, default=None, metavar='I',
                 help='with --distributed: this process\'s index, 0 .. N-1')
  p.add_argument('--peer-timeout', type=float, default=120.0, metavar='S',
                 help='with --distributed: seconds to wait for every process to join, '
                      'and for a process that sends no heartbeat (killed, crashed, cut '
                      'off); then the others stop with one line naming it, exit status 5 '
                      '(default: %(default)g)')
  p.add_argument('--plot', default=None, metavar='PNG',
                 help="write the loss curves here when done; '' draws none (default: "
                      "OUT_DIR/loss.png)")
  return p


def cmd_train(a) -> int:
  import jax
  if a.step is not None and not a.resume:
    raise ValueError(f'--step {a.step} needs --resume: it picks the checkpoint to resume from')
  if a.step is not None and a.step < 0:
    raise ValueError(f'--step must be a checkpoint step >= 0, got {a.step}')
  cluster = {'coordinator_address': a.coordinator, 'num_processes': a.num_processes,
             'process_id': a.process_id}
  flags = {'coordinator_address': '--coordinator', 'num_processes': '--num-processes',
           'process_id': '--process-id'}
  given = [flags[k] for k, v in cluster.items() if v is not None]
  if given and not a.distributed:
    raise ValueError(f'--coordinator, --num-processes and --process-id need --distributed '
                     f'(given: {", ".join(given)})')
  if a.coordinator is not None:
    _check_address(a.coordinator)
  if a.num_processes is not None and a.num_processes < 1:
    raise ValueError(f'--num-processes must be >= 1, got {a.num_processes}')
  if a.process_id is not None and not 0 <= a.process_id < (a.num_processes or 1 << 30):
    raise ValueError(f'--process-id must be in [0, --num-processes), got {a.process_id}')
  if a.distributed:
    from poetx_jax.pretrain import processes
    processes.initialize(**cluster, timeout=a.peer_timeout, prefix='poetx train: error: ')
  from poetx_jax.pretrain.config import TrainConfig, config_from_args
  from poetx_jax.pretrain.options import command_options
  from poetx_jax.pretrain.train import train
  signals.check()  # a signal that came while jax was imported
  cfg = config_from_args(a)
  if getattr(a, 'argv', None) is not None:  # the options on the command line
    given = vars(_train_parser(argparse.ArgumentParser().add_subparsers(),
                               defaults=False).parse_args(a.argv[1:]))
  else:
    given = {k for k, v in vars(cfg).items() if v != getattr(TrainConfig(), k)}
  cfg = command_options(cfg, given, config_file=a.config, resume=a.resume,
                        device_count=jax.device_count())
  summary = train(cfg, resume=a.resume, step=a.step)
  if jax.process_index() == 0:  # of several processes, the first reports
    _report(summary, a.plot)
  if summary['stopped'] in ('SIGINT', 'SIGTERM'):  # 130, 143: the shells' convention
    return 128 + signal.Signals[summary['stopped']].value
  return 0


def _check_address(address: str) -> None:
  """ValueError unless ``address`` is HOST:PORT (a host, a port in 1..65535)."""
  host, colon, port = address.rpartition(':')
  if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
    raise ValueError(f'--coordinator {address!r} is not HOST:PORT (a host name or address, '
                     f'a colon and a port in 1..65535, e.g. 10.0.0.1:8476)')


def _report(summary: dict, plot: str | None) -> None:
  """Prints a finished run's summary and draws its loss curves (at ``plot``,
  by default OUT_DIR/loss.png; none for '')."""
  vals = [f"{v['ppl']:.2f} at step {v['step']}" for v in
          (summary.get('val_before'), summary.get('val_after')) if v]
  if vals:
    print(f"validation perplexity: {' -> '.join(vals)}")
  print(f"{summary['tokens_per_s']:,.0f} tokens/s over {summary['elapsed_s']:.1f} s "
        f"({summary['steady_tokens_per_s']:,.0f} tokens/s less compilation, evaluation "
        f"and checkpoints)" + (f"; peak device memory {summary['peak_gib']:.2f} GiB"
                               if 'peak_gib' in summary else ''))
  if plot == '':
    return
  from poetx_jax.pretrain.metrics import plot_runs
  png = plot or str(pathlib.Path(summary['out_dir']) / 'loss.png')
  try:
    print(f"loss curves: {plot_runs([summary['out_dir']], png, option='--plot')}")
  except ImportError:
    print('no loss plot: matplotlib is not installed (metrics.jsonl has the curves)')
  except (ValueError, OSError) as e:
    print(f'no loss plot: {e}')


def cmd_prepare(a) -> int:
  from poetx_jax.pretrain.data import prepare
  extra = {k: v for k, v in (('shard_tokens', a.shard_tokens),
                             ('sample_chars', a.sample_chars)) if v is not None}
  hf = {k: v for k, v in (('hf_config', a.hf_config), ('hf_data_files', a.hf_data_files),
                          ('split', a.split)) if v is not None}
  if hf and a.hf_dataset is None:
    raise ValueError(f'--{"/--".join(k.replace("_", "-") for k in hf)} need --hf-dataset')
  if not a.inputs and a.hf_dataset is None:
    raise ValueError('prepare needs corpus files or directories, or --hf-dataset NAME')
  a.kept = lambda: _prepare_kept(pathlib.Path(a.out))
  m = prepare.prepare(a.inputs, a.out, tokenizer=a.tokenizer, vocab_size=a.vocab_size,
                      text_field=a.text_field, workers=a.workers, hf_dataset=a.hf_dataset,
                      **hf, **extra)
  skipped = [s['path'] for s in m['sources'] if s.get('skipped')]
  print(f'{a.out}: {m["tokens"]:,} tokens ({m["dtype"]}) of {m["documents"]:,} documents '
        f'from {len(m["sources"])} sources in {len(m["shards"])} shards; tokenizer '
        f'{m["tokenizer"]} (vocab {m["vocab_size"]})'
        + (f'; skipped {len(skipped)} text files that are unreadable, not UTF-8 or binary '
           f'({", ".join(skipped[:3])}{", ..." if len(skipped) > 3 else ""}; the manifest '
           f'names them all)' if skipped else ''))
  return 0


def _prepare_kept(out: pathlib.Path) -> str:
  """What a stopped ``poetx prepare`` kept in ``out``, for its message."""
  parts = len(list((out / 'parts').glob('0*.json'))) if (out / 'parts').is_dir() else 0
  if (out / 'manifest.json').is_file():
    return f': {out} was prepared already'
  if not out.exists():
    return ': nothing was written'
  return (f'; {out} keeps {parts} tokenized part(s)' if parts else f'; {out} keeps no '
          f'tokenized part yet') + ': the same command resumes from there'


def _eval_batches(text: str) -> int | str | None:
  """--eval-batches: a count, 'run' (the run's own) or None ('all': every window)."""
  if text in ('run', 'all'):
    return None if text == 'all' else text
  if not text.isdigit() or int(text) < 1:
    raise ValueError(f"--eval-batches must be a count >= 1, 'run' or 'all', got {text!r}")
  return int(text)


def cmd_eval(a) -> int:
  from poetx_jax.pretrain.data import windows as data_lib
  from poetx_jax.pretrain.evaluation import evaluate
  from poetx_jax.pretrain.loading import load_run
  count = _eval_batches(a.eval_batches)
  plan, data, model, step = load_run(a.run, step=a.step, data=a.data, val_data=a.val_data,
                                     cache_dir=a.cache_dir)
  cfg = plan.options
  count = cfg.eval_batches if count == 'run' else count
  windows = data.val_windows[:None if count is None else count * cfg.batch_size]
  result = evaluate(model, data_lib.eval_batches(windows, batch_size=cfg.batch_size))
  print(json.dumps({'run': a.run, 'step': step, 'val_loss': result.loss,
                    'val_ppl': result.ppl, 'val_windows': len(windows),
                    'val_windows_total': len(data.val_windows),
                    'val_tokens': int(windows.size), **result.aux}))
  if not math.isfinite(result.loss):
    from poetx_jax.pretrain.train import NonFiniteLoss
    raise NonFiniteLoss(f'the validation loss of checkpoint step {step} is {result.loss}: '
                        f'its model holds a diverged state (an earlier step may not: '
                        f'--step N)')
  return 0


def cmd_export(a) -> int:
  from poetx_jax.pretrain.export import export_run
  paths = export_run(a.run, a.out, step=a.step, force=a.force, dtype=a.dtype,
                     max_shard_size=a.max_shard_size)
  print(f'wrote {a.out}: {", ".join(p.name for p in paths)}')
  return 0


def cmd_plot(a) -> int:
  from poetx_jax.pretrain.metrics import plot_runs
  if not a.out:
    raise ValueError('--out \'\': an empty path; name the image file to write')
  print(f'wrote {plot_runs(a.runs, a.out)}')
  return 0


def _prepare_parser(sub) -> None:
  """The ``poetx prepare`` subcommand."""
  p = sub.add_parser('prepare', help='tokenize corpus files into a dataset directory '
                                     'that poetx train --data streams from',
                     description='Tokenize corpus files of any size (.txt .md .rst .py '
                                 '.jsonl(.gz/.zst) .json.gz/.zst .parquet; directories '
                                 'recursively, skipping their text files that are '
                                 'unreadable, not UTF-8 or binary), then a Hugging Face '
                                 'dataset (--hf-dataset), into token shards with a manifest '
                                 'and the tokenizer, in worker processes and memory bounded '
                                 'by the shard size. Running it again on unchanged inputs '
                                 'does nothing; an interrupted prepare resumes (one that '
                                 'ran out of space exits 6, its finished parts kept). '
                                 'Train on the result with poetx train --data DIR.')
  p.add_argument('inputs', nargs='*', metavar='input',
                 help='corpus files or directories (none with --hf-dataset alone)')
  p.add_argument('--out', required=True, metavar='DIR', help='the dataset directory (required)')
  p.add_argument('--tokenizer', default=None, metavar='JSON',
                 help='a tokenizers JSON file to use (default: train a byte-level BPE '
                      'on a sample of the corpus)')
  p.add_argument('--vocab-size', type=int, default=4096,
                 help='vocabulary of the BPE trained without --tokenizer (default: '
                      '%(default)s); OUT keeps the one it was prepared with, another is '
                      'refused')
  p.add_argument('--text-field', default='text',
                 help='the text field of jsonl / parquet records and the text column of '
                      '--hf-dataset (default: %(default)s)')
  p.add_argument('--hf-dataset', default=None, metavar='NAME_OR_PATH',
                 help='a Hugging Face dataset, read with the datasets package (pip install '
                      "'poetx_jax[hf]'): a hub name, streamed; a local folder of data "
                      'files, or json / parquet with --hf-data-files; or a directory '
                      'written by save_to_disk')
  p.add_argument('--hf-config', default=None, metavar='NAME',
                 help='with --hf-dataset: its configuration (subset)')
  p.add_argument('--split', default=None,
                 help='with --hf-dataset: the split to read (default: train)')
  p.add_argument('--hf-data-files', nargs='+', default=None, metavar='PATTERN',
                 help='with --hf-dataset: the data files to read (paths or glob patterns, '
                      'in the dataset\'s repository on the hub)')
  p.add_argument('--workers', type=int, default=None,
                 help='worker processes (default: the CPUs, at most one per file)')
  p.add_argument('--shard-tokens', type=int, default=None,
                 help='tokens per shard at most (default: 2^24)')
  p.add_argument('--sample-chars', type=int, default=None,
                 help='characters of the BPE\'s training sample at most (default: 100 M)')
  p.set_defaults(func=cmd_prepare)


def _export_parser(sub):
  """The ``poetx export`` parser."""
  p = sub.add_parser('export', help='a Hugging Face Llama directory (merged weights, '
                                    'config, tokenizer)',
                     description='Write a directory that Hugging Face clients load as it '
                                 'is (LlamaForCausalLM, AutoTokenizer, pipeline): merged '
                                 'dense weights (model.safetensors, or shards with their '
                                 'index), config.json and generation_config.json with the '
                                 'special-token ids, and the run\'s stored tokenizer '
                                 '(tokenizer.json, or tokenizer.model) with '
                                 'tokenizer_config.json and special_tokens_map.json. The '
                                 'corpus is not read; the files are moved into DIR once '
                                 'all are written (out of space: exit 6, DIR as it was). '
                                 'poetx train --init-from-hf DIR starts a run from it.')
  p.add_argument('run', help='the run directory (the --out-dir of poetx train)')
  p.add_argument('--out', required=True, metavar='DIR',
                 help='the export directory, created if missing (required); one that '
                      'already holds an export is refused unless --force')
  p.add_argument('--step', type=int, default=None,
                 help='the checkpoint step to export (default: the newest)')
  p.add_argument('--force', action='store_true',
                 help='replace an export already in DIR, removing its files that this '
                      'export does not write (default: refuse)')
  p.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'),
                 help='the dtype of the exported weights, written as config.json\'s '
                      'torch_dtype (default: %(default)s)')
  p.add_argument('--max-shard-size', default='5GB', metavar='SIZE',
                 help='the largest weight file, e.g. 5GB (10^9 bytes) or 2GiB; larger '
                      'weights are split into model-0000i-of-0000n.safetensors shards '
                      'listed by model.safetensors.index.json, as save_pretrained '
                      'writes them (default: %(default)s)')
  return p


def build_parser() -> argparse.ArgumentParser:
  """The ``poetx`` parser: its train, eval, export, plot and prepare subcommands."""
  parser = argparse.ArgumentParser(prog='poetx', description=__doc__.split('\n\n')[0])
  sub = parser.add_subparsers(dest='command', required=True)
  _train_parser(sub).set_defaults(func=cmd_train)
  p = sub.add_parser('eval', help='validation loss and perplexity of a run',
                     description='Validation loss and perplexity of a run at a checkpoint, '
                                 'printed as one JSON line. The corpus is read again with '
                                 'the run\'s stored tokenizer; its validation split must '
                                 'be the one the run was validated on. Exit status: 0 '
                                 'done, 2 bad option, data or checkpoint, 3 the loss is '
                                 'not finite (NaN or infinite).')
  p.add_argument('run', help='the run directory (the --out-dir of poetx train)')
  p.add_argument('--step', type=int, default=None,
                 help='the checkpoint step to evaluate (default: the newest)')
  p.add_argument('--data', nargs='+', default=None, metavar='PATH',
                 help='where the run\'s --data is now, if it moved (the same text: its '
                      'splits are checked against the run\'s)')
  p.add_argument('--val-data', nargs='+', default=None, metavar='PATH',
                 help='where the run\'s --val-data is now, if it moved')
  p.add_argument('--cache-dir', default=None, metavar='DIR',
                 help='the token cache to use (default: the run\'s)')
  p.add_argument('--eval-batches', default='run', metavar='N',
                 help='score the first N batches of the run\'s --batch-size validation '
                      'windows, or every window ("all"); default "run": the run\'s own '
                      '--eval-batches, so the loss is the one training logged at that '
                      'step. The output gives val_windows scored of val_windows_total')
  p.set_defaults(func=cmd_eval)
  _export_parser(sub).set_defaults(func=cmd_export)
  p = sub.add_parser('plot', help='loss / perplexity curves of runs to an image',
                     description='Training loss and validation perplexity against step '
                                 'of one or more runs, from their metrics.jsonl; a run '
                                 'without training-loss records is an error (exit 2).')
  p.add_argument('runs', nargs='+', metavar='run',
                 help='run directories (the --out-dir of poetx train)')
  p.add_argument('--out', default='loss.png', metavar='IMAGE',
                 help='the image to write (default: %(default)s); its suffix picks the '
                      'format (.png, .pdf, .svg, ...); a name without an image suffix '
                      'gets .png appended. The path written is printed.')
  p.set_defaults(func=cmd_plot)
  _prepare_parser(sub)
  return parser


@contextlib.contextmanager
def _signals_exit():
  """SIGTERM and SIGINT, while a command runs in the main thread, raise
  ``SystemExit(143)`` and ``KeyboardInterrupt`` and are recorded
  (:mod:`~poetx_jax.pretrain.signals`): the command unwinds (a fresh run's
  directory removed, locks released) instead of dying where it stands, and
  one whose exception Python dropped stops it at its next safe point; the
  training loop puts handlers of its own over them."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  old = signals.install()
  try:
    yield
  finally:
    signals.restore(old)


def main(argv=None) -> int:
  """Runs a ``poetx`` command; its exit status. A failure the user can act on
  is one line on stderr: exit 2 (bad option, data, run directory or
  checkpoint), or the error's own ``exit_code`` (3: non-finite loss, 4: the
  run directory is in use, 6: a write refused for want of space, any error
  caused by one); 130 when interrupted. SIGTERM exits 143 with a line from
  the start, before jax is imported (this module imports none of it)."""
  args = sys.argv[1:] if argv is None else list(argv)
  command = next((x for x in args if not x.startswith('-')), '')
  a = None
  try:
    with _signals_exit():
      a = build_parser().parse_args(args)
      a.argv = args
      a.kept = lambda: ''  # what a command stopped by SIGTERM kept, for its message
      code = a.func(a)
      signals.check()  # a signal recorded and not yet acted on (one inside an import)
      return code
  except KeyboardInterrupt:
    print(f'poetx {command}: interrupted', file=sys.stderr)
    return 130
  except SystemExit as e:
    if e.code == signals.EXIT_CODE:
      print(f'poetx {command}: stopped by SIGTERM' + (
          a.kept() if a is not None else ' while starting: nothing was written'),
          file=sys.stderr)
    raise
  except Exception as e:  # pylint: disable=broad-except
    full = full_disk(e)
    if full is not None and not isinstance(e, DiskFull):  # none said what was written
      e = DiskFull(f'{full_disk_text(full)} writing {getattr(e, "filename", None) or "a file"}',
                   full)
    if full is not None and full_disk_remedy(full) not in str(e):  # nor what to do
      e = DiskFull(f'{e}: {full_disk_remedy(full)} and run the command again', full)
    from poetx_jax.pretrain.checkpoint import CheckpointError
    known = (ValueError, FileNotFoundError, CheckpointError, ImportError)
    code = getattr(e, 'exit_code', 2 if isinstance(e, known) else None)
    if code is None:
      raise
    print(f'poetx {command}: error: {e}', file=sys.stderr)
    return code


if __name__ == '__main__':
  sys.exit(main())
