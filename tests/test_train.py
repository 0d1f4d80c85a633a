"""The training loop, checkpoints, resume and the poetx command (tiny, CPU)."""

import dataclasses
import json
import pathlib
import shutil

import chex
import jax
import numpy as np
import pytest
from flax import nnx

from poetx_jax.pretrain import cli
from poetx_jax.pretrain import loss as loss_lib
from poetx_jax.pretrain.checkpoint import CheckpointError, Checkpointer, DamagedCheckpoint
from poetx_jax.pretrain.config import TrainConfig, drop_shared_poet_options
from poetx_jax.pretrain.loading import load_run
from poetx_jax.pretrain.train import Hook, train
from conftest import SMALL, SQUARE, overrides, write_corpus


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return write_corpus(tmp_path_factory.mktemp('corpus'))


def _cfg(tmp, corpus, **kw):
  # SQUARE: every POET layer 32 x 32, one merge program and few build
  # programs a run. (Layers of two shapes, k and v 32 x 16, train and resume
  # in the command-line and scanned-layer tests here and in test_faults.)
  base = dict(model='tiny', model_overrides=SQUARE, optimizer='poetx',
              data=[str(corpus)], vocab_size=300, seq_len=32, batch_size=4,
              steps=12, warmup=2, merge_every=4, block_size=8, eval_every=6,
              eval_batches=2, log_every=1, checkpoint_every=100, dtype='float32',
              out_dir=str(tmp / 'run'), cache_dir=str(tmp / 'cache'))
  study = TrainConfig(**base)
  base.update(kw)  # the POET options above are for POET-X runs only
  return drop_shared_poet_options(TrainConfig(**base), study)


@pytest.fixture(scope='module')
def trained(tmp_path_factory, corpus):
  """``trained(**options)``: the run of ``_cfg(..., **options)``, trained once for
  the module: ``(cfg, summary, logged lines)``. The tests that ask for the same
  options share it (a compile and a run less); they only read it."""
  runs = {}

  def run(**options):
    key = json.dumps(options, sort_keys=True)
    if key not in runs:
      cfg = _cfg(tmp_path_factory.mktemp('trained'), corpus, **options)
      logged = []
      runs[key] = cfg, train(cfg, log=logged.append), logged
    return runs[key]

  return run


def _losses(run):
  recs = [json.loads(l) for l in (pathlib.Path(run) / 'metrics.jsonl').read_text().splitlines()]
  return [(r['step'], r['loss']) for r in recs if 'loss' in r]


def _params(run):
  _, _, model, step = load_run(run)
  return step, nnx.to_pure_dict(nnx.state(model))


# The reference's POET-X recipe: clipped, the bound dipping after each merge.
REFERENCE_RECIPE = dict(optimizer='poetx', min_lr_ratio=0.01, clip=0.1, clip_ramp=3,
                        poet_eps=1e-6, poet_eps_placement='raw')


@pytest.mark.slow
@pytest.mark.parametrize('options', [dict(optimizer='poetx'), dict(optimizer='adamw'),
                                     dict(optimizer='skewadam'), dict(optimizer='muon'),
                                     dict(optimizer='poetx', skew_tiers=True),
                                     dict(optimizer='poetx', permutation='chunk', chunk_size=4,
                                          tie_permutations=True),
                                     dict(optimizer='poetx-muon'),
                                     dict(optimizer='adamw', param_dtype='bfloat16',
                                          weight_decay=0.0),
                                     REFERENCE_RECIPE],
                         ids=['poetx', 'adamw', 'skewadam', 'muon', 'poetx-skew-tiers',
                              'poetx-chunk-tied', 'poetx-muon', 'adamw-as-the-paper',
                              'poetx-reference-recipe'])
def test_resume_is_bit_exact_across_merges(tmp_path, corpus, trained, options, monkeypatch):
  """A resumed run continues exactly as the uninterrupted one; it restores
  into the state's shapes (no random model is built first)."""
  straight, s1, _ = trained(**options)
  assert s1['step'] == 12 and s1['val_after']['loss'] < s1['val_before']['loss']

  split = _cfg(tmp_path / 'b', corpus, **options)
  s2 = train(split, log=lambda *_: None, stop_after=6)  # stops mid merge cycle (4)
  assert s2['stopped'] == 'stop_after' and s2['step'] == 6

  def no_random_model(*_, **__):
    raise AssertionError('a resumed run built a random model to overwrite')

  monkeypatch.setattr('poetx_jax.pretrain.train.build_state', no_random_model)
  train(split, resume=True, log=lambda *_: None)
  assert _losses(straight.out_dir) == _losses(split.out_dir)
  step_a, pa = _params(straight.out_dir)
  step_b, pb = _params(split.out_dir)
  assert step_a == step_b == 12
  chex.assert_trees_all_equal(pa, pb)


@pytest.mark.slow
def test_grad_accumulation_is_one_batch_of_all_its_rows_and_resumes_exactly(
    tmp_path, corpus, monkeypatch):
  """--grad-accum 2 at batch 4 trains as batch 8 does (the same windows in
  the same order, one update each; no merge, whose permutations are drawn by
  micro-batch count) to float rounding, and a run stopped after 3 updates
  resumes bit-exactly, across merges."""
  accum = train(_cfg(tmp_path / 'a', corpus, grad_accum=2, steps=6, merge_every=8),
                log=lambda *_: None)
  whole = train(_cfg(tmp_path / 'w', corpus, batch_size=8, steps=6, merge_every=8),
                log=lambda *_: None)
  assert accum['step'] == 12 and whole['step'] == 6
  # (their validation sets differ: eval_batches batches of batch_size rows)
  a_losses, w_losses = _losses(tmp_path / 'a' / 'run'), _losses(tmp_path / 'w' / 'run')
  assert [s for s, _ in a_losses] == list(range(2, 13, 2))  # logged after every update
  np.testing.assert_allclose([l for _, l in a_losses], [l for _, l in w_losses], atol=1e-5)
  _, pa = _params(tmp_path / 'a' / 'run')
  _, pw = _params(tmp_path / 'w' / 'run')
  chex.assert_trees_all_close(pa, pw, atol=1e-5, rtol=1e-5)

  straight = _cfg(tmp_path / 'c', corpus, grad_accum=2, steps=6, merge_every=2)
  train(straight, log=lambda *_: None)
  records = [json.loads(l) for l in
             (tmp_path / 'c' / 'run' / 'metrics.jsonl').read_text().splitlines()]
  merges = [r['step'] for r in records if 'merge_orthogonality_error' in r]
  assert merges == [4, 8, 12]  # after updates 2, 4, 6: recorded at their micro-steps
  split = _cfg(tmp_path / 'b', corpus, grad_accum=2, steps=6, merge_every=2)
  s = train(split, log=lambda *_: None, stop_after=6)  # mid merge cycle
  assert s['stopped'] == 'stop_after' and s['step'] == 6
  train(split, resume=True, log=lambda *_: None)
  assert _losses(tmp_path / 'c' / 'run') == _losses(tmp_path / 'b' / 'run')
  chex.assert_trees_all_equal(_params(tmp_path / 'c' / 'run'), _params(tmp_path / 'b' / 'run'))


@pytest.mark.slow
def test_grad_accumulation_and_lean_state_run(tmp_path, corpus):
  s = train(_cfg(tmp_path, corpus, grad_accum=2, steps=4, lean_state=True, remat='attn',
                 mode='mem'),
            log=lambda *_: None)
  assert s['step'] == 8
  load_run(tmp_path / 'run')  # the lean state restores from its checkpoint
  assert s['val_after']['loss'] < s['val_before']['loss']


def test_clear_errors(tmp_path, corpus):
  with pytest.raises(FileNotFoundError, match='nope'):
    train(_cfg(tmp_path, corpus, data=[str(tmp_path / 'nope')]))
  empty = tmp_path / 'empty'
  empty.mkdir()
  (empty / 'a.txt').write_text('')
  with pytest.raises(ValueError, match='corpus is empty'):
    train(_cfg(tmp_path, corpus, data=[str(empty)]))
  with pytest.raises(ValueError, match="model must be one of.*got 'huge'"):
    train(_cfg(tmp_path, corpus, model='huge'))
  with pytest.raises(ValueError, match='seq_len=512 is longer.*max_seq_len=256'):
    train(_cfg(tmp_path, corpus, seq_len=512))
  with pytest.raises(ValueError, match='larger than the dimension'):
    train(_cfg(tmp_path, corpus, block_size=64))
  with pytest.raises(ValueError, match="optimizer must be one of"):
    train(_cfg(tmp_path, corpus, optimizer='sgd'))
  with pytest.raises(ValueError, match='poet_lr must be > 0.*got 0'):
    train(_cfg(tmp_path, corpus, poet_lr=0.0))


@pytest.mark.slow
def test_the_device_counts_train_at_the_largest_values_their_options_take(tmp_path, corpus):
  """warmup, merge_every and clip_ramp reach the device as int32 counts
  (optax's schedule boundary, the merge cycle, the clip's ramp): at their
  largest value, INT32_MAX, a run trains (one past it: refused,
  test_config), saying that it is all warmup."""
  from poetx_jax.pretrain.config import INT32_MAX
  logged = []
  s = train(_cfg(tmp_path, corpus, steps=2, warmup=INT32_MAX, merge_every=INT32_MAX,
                 clip_ramp=INT32_MAX, eval_every=INT32_MAX, log_every=INT32_MAX,
                 checkpoint_every=INT32_MAX, keep=INT32_MAX), log=logged.append)
  assert s['step'] == 2 and s['stopped'] is None
  assert (f'warning: --warmup {INT32_MAX} is not below --steps 2: every update is in the '
          f'warmup, and the learning rate never reaches its peak') in logged


@pytest.mark.slow
def test_merges_record_orthogonality_and_warn_when_it_is_lost(tmp_path, corpus, trained):
  """Every merge writes its factors' orthogonality error to metrics.jsonl; a
  POET learning rate far too large for the block size gets a warning naming
  the remedy."""
  def merge_errors(cfg):
    lines = (pathlib.Path(cfg.out_dir) / 'metrics.jsonl').read_text().splitlines()
    return {r['step']: r['merge_orthogonality_error'] for r in map(json.loads, lines)
            if 'merge_orthogonality_error' in r}

  ok, _, messages = trained()  # merge every 4 of 12 steps
  errors = merge_errors(ok)
  assert sorted(errors) == [4, 8, 12] and all(0 < e < 1e-2 for e in errors.values())
  assert not [m for m in messages if 'warning' in m]

  messages = []
  bad = _cfg(tmp_path / 'bad', corpus, poet_lr=0.5, steps=4)
  train(bad, log=messages.append)
  assert merge_errors(bad)[4] > 1.0
  warning, = [m for m in messages if m.startswith('warning')]
  assert 'merge of step 4' in warning and '--poet-lr (this run: 0.5)' in warning
  assert '--max-generator-norm 0.5' in warning  # this run has no cap


@pytest.mark.slow
def test_incompatible_and_corrupt_checkpoints(tmp_path, corpus, trained):
  done, _, _ = trained()  # a copy of the module's 12-step run, to damage
  shutil.copytree(done.out_dir, tmp_path / 'run')
  cfg = dataclasses.replace(done, out_dir=str(tmp_path / 'run'),
                            cache_dir=str(tmp_path / 'cache'))
  with pytest.raises(CheckpointError, match=r"configuration differs.*'lr': \(None, 0.1\)"):
    train(dataclasses.replace(cfg, lr=0.1), resume=True)
  with pytest.raises(CheckpointError, match="steps=1 is below the run's 12"):
    train(dataclasses.replace(cfg, steps=1), resume=True)
  with pytest.raises(CheckpointError, match='already holds checkpoints.*--resume'):
    train(cfg)  # a new run would clobber the old one
  # A checkpoint restored into a model of another shape says so.
  other = dataclasses.replace(cfg, model_overrides={**cfg.model_overrides, 'hidden': 48},
                              out_dir=str(tmp_path / 'other'))
  pathlib.Path(other.out_dir).mkdir()
  pathlib.Path(other.out_dir, 'run.json').write_text(json.dumps(dataclasses.asdict(other)))
  shutil.copytree(pathlib.Path(cfg.out_dir) / 'checkpoints',
                  pathlib.Path(other.out_dir) / 'checkpoints')
  for name in ('data.json', 'tokenizer.json'):
    shutil.copy(pathlib.Path(cfg.out_dir) / name, pathlib.Path(other.out_dir) / name)
  with pytest.raises(CheckpointError, match='does not fit this model') as e:
    load_run(other.out_dir)
  assert not isinstance(e.value, DamagedCheckpoint)
  # Corrupt: remove the array data of the newest step.
  step_dir = pathlib.Path(cfg.out_dir) / 'checkpoints' / '12'
  for f in (step_dir / 'model').rglob('*'):
    if f.is_file():
      f.write_bytes(b'garbage')
  with pytest.raises(DamagedCheckpoint, match='step 12 .* is damaged'):
    load_run(cfg.out_dir)
  with pytest.raises(CheckpointError, match='no checkpoint'):
    Checkpointer(tmp_path / 'void').restore(None, None)


@pytest.mark.slow
def test_cli_train_eval_export_plot(tmp_path, corpus, capsys):
  run = str(tmp_path / 'cli')
  common = ['--model', 'tiny', '--model-overrides', overrides(SMALL),
            '--data', str(corpus), '--vocab-size', '300', '--seq-len', '32',
            '--batch-size', '4', '--steps', '4', '--block-size', '8', '--dtype', 'float32',
            '--cache-dir', str(tmp_path / 'cache'), '--out-dir', run]
  assert cli.main(['train', *common]) == 0
  out = capsys.readouterr().out
  assert 'validation perplexity:' in out and (pathlib.Path(run) / 'loss.png').stat().st_size > 0
  assert cli.main(['eval', run]) == 0
  rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert rec['step'] == 4 and rec['val_ppl'] > 1
  assert cli.main(['export', run, '--out', str(tmp_path / 'exp')]) == 0
  from safetensors.numpy import load_file
  w = load_file(str(tmp_path / 'exp' / 'model.safetensors'))
  _, _, model, _ = load_run(run)
  eff = model.layers[0].self_attn.q_proj.effective_kernel()
  np.testing.assert_allclose(w['model.layers.0.self_attn.q_proj.weight'], np.asarray(eff).T,
                             rtol=1e-6, atol=1e-7)
  cfg = json.loads((tmp_path / 'exp' / 'config.json').read_text())
  assert cfg['architectures'] == ['LlamaForCausalLM'] and cfg['hidden_size'] == 32
  assert cli.main(['plot', run, '--out', str(tmp_path / 'p.png')]) == 0
  # --plot '': the run's summary printed, no loss curves drawn.
  (pathlib.Path(run) / 'loss.png').unlink()
  capsys.readouterr()
  summary = {'tokens_per_s': 1.0, 'elapsed_s': 1.0, 'steady_tokens_per_s': 1.0, 'out_dir': run}
  cli._report(summary, '')  # pylint: disable=protected-access
  out = capsys.readouterr().out
  assert 'tokens/s over' in out and 'loss curves' not in out
  assert not (pathlib.Path(run) / 'loss.png').exists()
  assert cli.main(['train', *common[:-1], str(tmp_path / 'x'), '--model', 'nosuch']) == 2
  assert 'nosuch' in capsys.readouterr().err


@pytest.mark.slow
def test_sigterm_saves_and_resume_continues(tmp_path, corpus):
  import signal
  import subprocess
  import sys
  import time
  run = tmp_path / 'sig'
  args = [sys.executable, '-m', 'poetx_jax.pretrain.cli', 'train', '--model', 'tiny',
          '--model-overrides', overrides(SMALL),
          '--data', str(corpus), '--vocab-size', '300', '--seq-len', '32',
          '--batch-size', '4', '--steps', '100000', '--block-size', '8',
          '--dtype', 'float32', '--log-every', '1', '--checkpoint-every', '100000',
          '--cache-dir', str(tmp_path / 'cache'), '--out-dir', str(run)]
  proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  metrics = run / 'metrics.jsonl'
  deadline = time.time() + 120
  while time.time() < deadline:  # wait until it is training
    if metrics.exists() and len(metrics.read_text().splitlines()) > 3:
      break
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 143, err  # 128 + SIGTERM: stopped, not finished
  assert 'stopped at step' in out + err and 'SIGTERM' in out + err
  assert not (run / 'train.lock').exists()
  ckpt = Checkpointer(run / 'checkpoints')
  step, meta = ckpt.read_meta()
  assert meta['reason'] == 'SIGTERM' and step > 0
  last_logged = max(json.loads(l)['step'] for l in metrics.read_text().splitlines())
  assert step == last_logged  # nothing trained after the save


@pytest.mark.parametrize('name', ['SIGTERM', 'SIGINT'])
@pytest.mark.parametrize('phase', ['devices', 'data', 'first validation'])
def test_a_signal_whose_exception_was_dropped_while_starting_stops_with_nothing_written(
    tmp_path, corpus, monkeypatch, capsys, name, phase):
  """poetx train given a SIGTERM or SIGINT whose exception Python dropped
  (raised inside a ``__del__`` or a garbage-collection callback, as JAX's)
  while the devices start, the data is read or the initial model is
  validated: the run stops before its loop (exit 143 or 130), the run
  directory gone, the handlers put back."""
  import os
  import signal
  from poetx_jax.pretrain import loading
  from poetx_jax.pretrain import train as train_lib

  class Dropping:  # its __del__ is where the handler runs and its exception is dropped
    def __del__(self):
      os.kill(os.getpid(), getattr(signal, name))

  def dropping(fn):
    def wrapped(*a, **k):
      out = fn(*a, **k)
      Dropping()  # collected at once
      return out
    return wrapped

  module, fn = {'devices': (train_lib, 'finish_options'), 'data': (loading, 'run_data'),
                'first validation': (train_lib, '_start')}[phase]
  monkeypatch.setattr(module, fn, dropping(getattr(module, fn)))
  cfg = _cfg(tmp_path, corpus, steps=50, log_every=1)
  config = tmp_path / 'run.json'
  config.write_text(json.dumps(dataclasses.asdict(cfg)))
  before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
  if name == 'SIGTERM':
    with pytest.raises(SystemExit) as e:
      cli.main(['train', '--config', str(config), '--plot', ''])
    assert e.value.code == 143
  else:
    assert cli.main(['train', '--config', str(config), '--plot', '']) == 130
  said = capsys.readouterr()
  assert f'stopped by {name} while starting' in said.out, said.out
  assert said.err.strip().splitlines()[-1] == ('poetx train: stopped by SIGTERM' if name == 'SIGTERM'
                                               else 'poetx train: interrupted'), said.err
  assert not pathlib.Path(cfg.out_dir).exists()
  assert {s: signal.getsignal(s) for s in before} == before  # the handlers put back


@pytest.mark.slow
def test_a_sigterm_with_the_last_step_leaves_the_run_complete(tmp_path, corpus):
  """A SIGTERM that comes with the run's last step stops nothing: the run
  ends complete (its final checkpoint the last step's), saying so, not
  asking for a resume."""
  import os
  import signal

  def sigterm(run):
    if run.step == 12:
      os.kill(os.getpid(), signal.SIGTERM)
  logged = []
  # (steps=12: the programs of the module's other 12-step runs)
  s = train(_cfg(tmp_path, corpus, checkpoint_every=12), log=logged.append,
            hooks=[Hook(sigterm, wait=False)])
  assert s['step'] == 12 and s['stopped'] is None
  assert 'SIGTERM came with the last step: the run is complete' in logged
  assert not any('--resume' in l for l in logged), logged
  step, meta = Checkpointer(tmp_path / 'run' / 'checkpoints').read_meta()
  assert step == 12 and meta['reason'] == 'final'


@pytest.mark.slow
def test_xq_int4_run_checkpoints_and_resumes(tmp_path, corpus):
  cfg = _cfg(tmp_path, corpus, quantize='int4', group_size=16, steps=4)
  s = train(cfg, log=lambda *_: None, stop_after=2)
  assert s['step'] == 2
  train(cfg, resume=True, log=lambda *_: None)
  _, _, model, step = load_run(cfg.out_dir)
  layer = model.layers[0].mlp.up_proj
  assert step == 4 and layer.kernel.dtype == jax.numpy.int4
  with pytest.raises(ValueError, match="quantize='int8': option of the POET layers"):
    train(_cfg(tmp_path, corpus, quantize='int8', optimizer='adamw'))


def _spectrum_probe(calls):
  """A probe recording the singular values of layer 0's down projection."""
  import poetx_jax

  def probe(run):
    calls.append(run.step)
    layer = run.model.layers[0].mlp.down_proj
    w = (poetx_jax.effective_kernel(layer) if isinstance(layer, poetx_jax.POETLinear)
         else layer.kernel[...])
    return {'sv': np.linalg.svd(np.asarray(w, np.float64), compute_uv=False).tolist()}

  return probe


@pytest.mark.slow
def test_probe_hook_records_without_changing_training(tmp_path, corpus, trained):
  """A Hook with at_start calls the probe at step 0 and every ``every``
  steps, writes its records to metrics.jsonl and leaves the run unchanged.
  POET-X keeps the initial weights' singular values across its merges (step
  12 is right after the third); AdamW's move."""
  calls = []
  probed = _cfg(tmp_path / 'a', corpus)  # poetx: merge every 4, evaluate every 6
  train(probed, log=lambda *_: None, hooks=[Hook(_spectrum_probe(calls), every=6,
                                                 at_start=True)])
  assert calls == [0, 6, 12]
  plain, _, _ = trained()  # the same run, no hook
  assert _losses(probed.out_dir) == _losses(plain.out_dir)
  chex.assert_trees_all_equal(_params(probed.out_dir), _params(plain.out_dir))

  def records(run):
    lines = (pathlib.Path(run) / 'metrics.jsonl').read_text().splitlines()
    return [json.loads(l) for l in lines]

  recs = records(probed.out_dir)
  sv = {r['step']: np.array(r['sv']) for r in recs if 'sv' in r}
  assert sorted(sv) == [0, 6, 12]
  for step in (6, 12):
    np.testing.assert_allclose(sv[step], sv[0], rtol=1e-4, err_msg=f'step {step}')
  logs = [r for r in recs if 'loss' in r]
  assert all(0 < r['compile_s'] < r['train_s'] <= r['elapsed_s'] for r in logs)

  calls = []
  adamw = _cfg(tmp_path / 'c', corpus, optimizer='adamw')
  train(adamw, log=lambda *_: None, hooks=[Hook(_spectrum_probe(calls), every=4,
                                                at_start=True)])
  assert calls == [0, 4, 8, 12]
  sv_adamw = {r['step']: np.array(r['sv']) for r in records(adamw.out_dir) if 'sv' in r}
  np.testing.assert_allclose(sv_adamw[0], sv[0], rtol=1e-6)  # the same initial weights
  assert np.linalg.norm(sv_adamw[12] - sv[0]) > 1e-2 * np.linalg.norm(sv[0])


@pytest.mark.slow
def test_scanned_layers_train_as_unrolled_and_resume_exactly(tmp_path, corpus):
  """scan_layers=True: the losses of the unrolled run up to the first merge
  (4; later merges draw other permutations), and a resume equal to an
  uninterrupted run, merges included."""
  two = {**SMALL, 'layers': 2}
  unrolled = _cfg(tmp_path / 'u', corpus, model_overrides=two, steps=8)
  straight = _cfg(tmp_path / 'a', corpus, model_overrides=two, steps=8, scan_layers=True)
  train(unrolled, log=lambda *_: None)
  train(straight, log=lambda *_: None)
  lu, ls = _losses(unrolled.out_dir), _losses(straight.out_dir)
  assert [s for s, _ in lu] == [s for s, _ in ls]
  np.testing.assert_allclose([l for _, l in ls[:4]], [l for _, l in lu[:4]], rtol=1e-5)
  split = _cfg(tmp_path / 'b', corpus, model_overrides=two, steps=8, scan_layers=True)
  train(split, log=lambda *_: None, stop_after=6)
  train(split, resume=True, log=lambda *_: None)
  assert _losses(straight.out_dir) == _losses(split.out_dir)
  (step_a, pa), (step_b, pb) = _params(straight.out_dir), _params(split.out_dir)
  assert step_a == step_b == 8
  chex.assert_trees_all_equal(pa, pb)
  # The export of a stacked run holds each layer's own merged kernel.
  assert cli.main(['export', straight.out_dir, '--out', str(tmp_path / 'exp')]) == 0
  from safetensors.numpy import load_file
  w = load_file(str(tmp_path / 'exp' / 'model.safetensors'))
  _, _, model, _ = load_run(straight.out_dir)
  for i in range(2):
    eff = model.layers[i].self_attn.q_proj.effective_kernel()
    np.testing.assert_allclose(w[f'model.layers.{i}.self_attn.q_proj.weight'],
                               np.asarray(eff).T, rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match='scan_layers must be a bool'):
    train(_cfg(tmp_path / 'c', corpus, scan_layers='yes'))


@pytest.mark.slow
def test_the_tokenizer_and_data_identity_are_part_of_the_run(tmp_path, corpus, capsys):
  """The run keeps its tokenizer and the hashes of its splits: after the corpus
  changes, eval and resume refuse it (exit 2, naming the run), export ships the
  stored tokenizer byte for byte; after the corpus is gone, export still works."""
  import shutil
  docs = tmp_path / 'docs'
  shutil.copytree(corpus, docs)
  cfg = _cfg(tmp_path, corpus, data=[str(docs)])
  train(cfg, log=lambda *_: None, stop_after=2)
  run = pathlib.Path(cfg.out_dir)
  stored = (run / 'tokenizer.json').read_bytes()
  record = json.loads((run / 'data.json').read_text())
  assert record['vocab_size'] == 300 and record['val_tokens'] > 0
  assert stored == next((tmp_path / 'cache').glob('bpe-*.json')).read_bytes()

  (docs / 'doc39.txt').write_text('a different ending of the corpus. ' * 40)
  capsys.readouterr()  # the progress bar of training
  assert cli.main(['eval', str(run)]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and err.startswith('poetx eval: error: ')
  assert f'corpus no longer matches the run {run}' in err and 'validation split' in err
  with pytest.raises(CheckpointError, match='--resume: the corpus no longer matches'):
    train(cfg, resume=True, log=lambda *_: None)
  assert cli.main(['export', str(run), '--out', str(tmp_path / 'changed')]) == 0
  assert (tmp_path / 'changed' / 'tokenizer.json').read_bytes() == stored

  shutil.rmtree(docs)
  shutil.rmtree(tmp_path / 'cache')
  assert cli.main(['export', str(run), '--out', str(tmp_path / 'gone')]) == 0
  assert (tmp_path / 'gone' / 'tokenizer.json').read_bytes() == stored
  assert (tmp_path / 'gone' / 'model.safetensors').stat().st_size > 0


def test_fsdp_must_divide_the_devices(tmp_path, corpus, capsys):
  with pytest.raises(ValueError, match=r'fsdp=3 must divide the 8 device\(s\); valid: '
                                       r'\[1, 2, 4, 8\]'):
    TrainConfig(strategy='fsdp', fsdp=3).validate(device_count=8)
  TrainConfig(strategy='fsdp', fsdp=4).validate(device_count=8)
  assert jax.device_count() == 1
  with pytest.raises(ValueError, match=r'fsdp=2 must divide the 1 device'):
    train(_cfg(tmp_path, corpus, strategy='fsdp', fsdp=2))
  assert not (tmp_path / 'run').exists()  # refused before anything was written
  for flags, message in ((['--eval-batches', '0'],
                          'eval_batches must be an int in [1, 2147483647], got 0'),
                         (['--block-size', '0'], 'block_size must be an int in [2, '),
                         (['--strategy', 'fsdp', '--fsdp', '2'], 'fsdp=2 must divide')):
    assert cli.main(['train', '--out-dir', str(tmp_path / 'cli'), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith('poetx train: error: ') and message in err
    assert len(err.splitlines()) == 1


MOE = dict(model='moe-tiny', model_overrides={'layers': 1, 'hidden': 32, 'mlp': 32, 'heads': 2,
                                              'kv_heads': 1, 'experts': 4, 'top_k': 2,
                                              'capacity_factor': 1.0})


@pytest.mark.slow
@pytest.mark.parametrize('options', [dict(optimizer='poetx', skew_tiers=True),
                                     dict(optimizer='skewadam')],
                         ids=['poetx-skew-tiers', 'skewadam'])
def test_moe_run_resumes_bit_exactly_and_records_expert_load(tmp_path, corpus, options):
  straight = _cfg(tmp_path / 'a', corpus, steps=8, eval_every=4, **MOE, **options)
  s1 = train(straight, log=lambda *_: None)
  assert s1['val_after']['loss'] < s1['val_before']['loss']
  split = _cfg(tmp_path / 'b', corpus, steps=8, eval_every=4, **MOE, **options)
  train(split, log=lambda *_: None, stop_after=3)  # mid merge cycle (4)
  train(split, resume=True, log=lambda *_: None)
  assert _losses(straight.out_dir) == _losses(split.out_dir)
  chex.assert_trees_all_equal(_params(straight.out_dir), _params(split.out_dir))
  recs = [json.loads(l) for l in
          (pathlib.Path(straight.out_dir) / 'metrics.jsonl').read_text().splitlines()]
  loads = [r for r in recs if 'expert_tokens' in r]
  assert [r['step'] for r in loads] == [0, 4, 8]
  for r in loads:  # one layer, top-2 of 4 experts over a batch of 4 x 32 tokens: each
    # expert keeps ceil(1.0 * 128 * 2 / 4) = 64 slots, the rest are dropped
    assert len(r['expert_tokens']) == 4 and sum(r['expert_tokens']) == 2 * 4 * 32
    assert r['dropped'] == sum(max(0, t - 64) for t in r['expert_tokens'])
    assert r['load_balance'] > 0 and r['router_z_loss'] > 0
  if options['optimizer'] == 'poetx':
    _, _, model, _ = load_run(straight.out_dir)
    assert type(model.layers[0].mlp.router).__name__ == 'Router'  # dense, trained
    assert model.layers[0].mlp.experts.up_proj.stack_shape == (4,)
  with pytest.raises(ValueError, match="trained model 'moe-tiny': export writes the Hugging "
                                       'Face Llama layout: a MoELlama .MoEConfig. has no '
                                       'export yet'):
    cli_export(straight.out_dir, tmp_path / 'hf')


def cli_export(run, out):
  from poetx_jax.pretrain.export import export_run
  return export_run(run, out)


@pytest.mark.slow
def test_the_training_loss_of_an_moe_model_adds_its_weighted_aux_losses():
  from poetx_jax.models import get_config, init_model
  model = init_model(get_config('moe-tiny', vocab_size=64))
  rng = np.random.default_rng(0)
  batch = {'inputs': rng.integers(0, 64, (2, 16)).astype(np.int32),
           'targets': rng.integers(-1, 64, (2, 16)).astype(np.int32)}

  @nnx.jit  # one program (op by op, the model's ops compile one by one)
  def losses(model, batch):
    return (model.forward(batch['inputs']), loss_lib.training_loss(model, batch),
            loss_lib.token_loss(model, batch))

  (logits, aux), training_loss, (total, count, _) = losses(model, batch)
  mask = batch['targets'] >= 0
  logp = jax.nn.log_softmax(np.asarray(logits, np.float64), axis=-1)
  ce = -np.sum(np.take_along_axis(logp, np.maximum(batch['targets'], 0)[..., None],
                                  -1)[..., 0] * mask) / mask.sum()
  want = ce + 0.01 * float(aux['load_balance']) + 1e-3 * float(aux['router_z_loss'])
  assert float(aux['aux_loss']) > 0
  np.testing.assert_allclose(float(training_loss), want, rtol=1e-5)
  np.testing.assert_allclose(float(total / count), ce, rtol=1e-5)


@pytest.mark.slow
def test_a_generator_cap_trains_a_step_that_diverges_without_it(tmp_path, corpus):
  """At 40 times its default step (block 8: 5e-3) POET-X's series leaves its
  region of convergence at the first merge and the model collapses to a
  uniform prediction; with max_generator_norm it trains. (Under the cap a
  block is unchanged exactly: tests/test_ops.py.)"""
  def run(name, **kw):
    cfg = _cfg(tmp_path / name, corpus, model_overrides=SMALL, batch_size=8, steps=30,
               merge_every=10, eval_every=30, log_every=5, **kw)
    summary = train(cfg, log=lambda *_: None)
    recs = [json.loads(l) for l in (pathlib.Path(cfg.out_dir) / 'metrics.jsonl').open()]
    errors = [r['merge_orthogonality_error'] for r in recs if 'merge_orthogonality_error' in r]
    return summary['val_before']['loss'], summary['val_after']['loss'], max(errors)

  before, after, error = run('free', poet_lr=0.2)
  assert error > 1 and after > before - 0.1                     # collapsed
  before, after, error = run('capped', poet_lr=0.2, max_generator_norm=0.5)
  assert error < 0.1 and after < before - 1.0                   # trains


@pytest.mark.slow
def test_the_merge_aware_clip_changes_only_the_updates_after_a_merge(tmp_path, corpus,
                                                                     trained):
  """--clip-ramp: the updates before the first merge are those of plain
  clipping, bit for bit; after it the bound dips (0.1 x clip) and the run
  departs from the plain one. (The ramped run: the reference recipe's, clip
  0.1 and a ramp of 3, merging every 4 of 12 updates, logging each.)"""
  def losses(cfg):
    recs = [json.loads(l) for l in (pathlib.Path(cfg.out_dir) / 'metrics.jsonl').open()]
    return [r['loss'] for r in recs if 'loss' in r]

  plain = _cfg(tmp_path / 'plain', corpus, **{**REFERENCE_RECIPE, 'clip_ramp': 0})
  train(plain, log=lambda *_: None)
  plain, ramped = losses(plain), losses(trained(**REFERENCE_RECIPE)[0])
  assert len(plain) == len(ramped) == 12
  # the loss of step k is of the parameters after k - 1 updates: merge at update 4
  assert ramped[:5] == plain[:5] and ramped[5:] != plain[5:]
  with pytest.raises(ValueError, match='clip_ramp=3 needs clip > 0'):
    TrainConfig(clip_ramp=3, clip=0.0).validate()


def test_hooks_are_checked_before_anything_is_written(tmp_path, corpus):
  with pytest.raises(ValueError, match='Hook every must be an int >= 1, got 0'):
    Hook(lambda run: None, every=0)
  with pytest.raises(ValueError, match="Hook on must be 'step' or 'save', got 'merge'"):
    Hook(lambda run: None, on='merge')
  with pytest.raises(ValueError, match='hooks must be train.Hook instances'):
    train(_cfg(tmp_path, corpus), hooks=[lambda run: None])
  assert not (tmp_path / 'run').exists()


def test_compile_cache_off_or_already_set_is_left_alone(tmp_path):
  """--compile-cache '' sets no cache, a file (or a path under one) is
  refused, and a cache the process set already is kept; otherwise the
  directory is set, every program cached."""
  from poetx_jax.pretrain.compile_cache import use as _use_compile_cache
  names = ('jax_compilation_cache_dir', 'jax_persistent_cache_min_compile_time_secs')
  saved = {n: getattr(jax.config, n) for n in names}
  try:
    jax.config.update(names[0], None)
    jax.config.update(names[1], 1.0)
    _use_compile_cache('')
    assert jax.config.jax_compilation_cache_dir is None
    (tmp_path / 'afile').write_text('')
    for given in ('afile', 'afile/xla'):  # a file, or under one: refused, nothing set
      with pytest.raises(ValueError, match=f'--compile-cache {tmp_path / given} cannot be a '
                                           f'compilation cache: {tmp_path / "afile"} is a file'):
        _use_compile_cache(str(tmp_path / given))
      assert jax.config.jax_compilation_cache_dir is None
    _use_compile_cache(str(tmp_path / 'xla'))
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / 'xla')
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    _use_compile_cache(str(tmp_path / 'other'))
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / 'xla')
  finally:
    for n, v in saved.items():
      jax.config.update(n, v)


def test_a_compile_cache_loses_its_empty_entries_and_a_full_one_is_left_unused(
    tmp_path, monkeypatch):
  """Entries cut short on a full device (empty files) are removed, with their
  access times, in one line; written entries stay. A cache whose device has
  less than compile_cache.MIN_FREE free is not set, said in one line."""
  from poetx_jax.pretrain import compile_cache
  names = ('jax_compilation_cache_dir', 'jax_persistent_cache_min_compile_time_secs')
  saved = {n: getattr(jax.config, n) for n in names}
  cache = tmp_path / 'xla'
  cache.mkdir()
  for name, data in (('a-cache', b''), ('a-atime', b'12345678'), ('b-cache', b'x' * 10),
                     ('b-atime', b'12345678'), ('c-cache', b'')):
    (cache / name).write_bytes(data)
  lines = []
  try:
    jax.config.update(names[0], None)
    compile_cache.use(str(cache), lines.append)
    assert sorted(p.name for p in cache.iterdir()) == ['b-atime', 'b-cache']
    assert lines == [f'compile cache {cache}: removed 2 empty entries, cut short when its '
                     f'device was full']
    assert jax.config.jax_compilation_cache_dir == str(cache)
    jax.config.update(names[0], None)
    lines.clear()
    real = shutil.disk_usage
    monkeypatch.setattr(compile_cache.shutil, 'disk_usage',
                        lambda p: real(p)._replace(free=10 * 2**20))
    compile_cache.use(str(tmp_path / 'new' / 'xla'), lines.append)
    assert jax.config.jax_compilation_cache_dir is None
    assert len(lines) == 1 and lines[0].startswith(
        f'warning: compile cache {tmp_path / "new" / "xla"}: 10 MiB free, under 256 MiB: '
        f'this run compiles without it'), lines
  finally:
    for n, v in saved.items():
      jax.config.update(n, v)


@pytest.mark.slow
def test_poetx_train_keeps_its_programs_in_the_compile_cache(tmp_path, corpus):
  """--compile-cache (on by default): a process's programs land in the
  persistent cache, and the same run repeated in another process reads them
  back instead of compiling, and so does a resumed run. (The suite's own cache is
  taken away.)"""
  import os
  import subprocess
  import sys
  env = {k: v for k, v in os.environ.items() if not k.startswith('JAX_')}
  env['JAX_PLATFORMS'] = 'cpu'
  cache = tmp_path / 'xla'
  args = [sys.executable, '-m', 'poetx_jax.pretrain.cli', 'train', '--data', str(corpus),
          '--model-overrides', overrides(SQUARE),  # one layer shape: fewer programs
          '--vocab-size', '300', '--seq-len', '32', '--batch-size', '4', '--block-size', '8',
          '--eval-batches', '1', '--dtype', 'float32', '--cache-dir', str(tmp_path / 'c'),
          '--plot', '']

  def train(*extra):
    proc = subprocess.run([*args, *extra], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]

  train('--steps', '2', '--out-dir', str(tmp_path / 'run'), '--compile-cache', str(cache))
  entries = {p.name for p in cache.iterdir()}
  assert entries  # the step, the evaluation and the merge programs, at least
  train('--steps', '2', '--out-dir', str(tmp_path / 'again'), '--compile-cache', str(cache))
  new = {p.name for p in cache.iterdir()} - entries
  assert not new, new  # no program compiled again: each read from the cache
  train('--steps', '4', '--out-dir', str(tmp_path / 'run'), '--compile-cache', str(cache),
        '--resume')
  new = {p.name for p in cache.iterdir()} - entries
  assert not new, new  # resumed, the restored state makes the same programs


def test_a_multisteps_checkpoint_is_refused_with_its_reason(tmp_path):
  """A checkpoint whose optimizer state is optax.MultiSteps' (written with
  --grad-accum when the optimizer accumulated) does not restore into the
  train step's accumulation, and the error says why."""
  import optax
  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  old = nnx.Optimizer(model, optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2),
                      wrt=nnx.Param)
  with Checkpointer(tmp_path / 'ck') as ck:
    ck.save(2, model, old, data_state={}, meta={})
  new = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  with Checkpointer(tmp_path / 'ck') as ck:
    with pytest.raises(CheckpointError, match='holds an optax.MultiSteps state'):
      ck.restore(model, new, step=2)
