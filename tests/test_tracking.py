"""Tracking: TensorBoard event files and Weights & Biases (a stand-in module:
wandb is not installed for the tests) get metrics.jsonl's records; the step
statistics; a profile of chosen steps; the FLOPs and peaks behind the MFU."""

import contextlib
import dataclasses
import json
import pathlib
import struct
import sys
import types

import numpy as np
import pytest

from poetx_jax import models
from poetx_jax.pretrain import tracking
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.train import train
from poetx_jax.pretrain.plan import make_plan
from conftest import SMALL, write_corpus

TINY = dict(model='tiny', model_overrides=SMALL)


def read_events(directory: pathlib.Path) -> list[tuple[int, str, float]]:
  """``(step, tag, value)`` of every scalar in the TensorBoard event files of
  ``directory``: TFRecords (length, its CRC, an ``Event`` proto, its CRC)."""
  from tensorboardX.proto import event_pb2
  out = []
  for path in sorted(directory.glob('events.out.tfevents.*')):
    data, i = path.read_bytes(), 0
    while i < len(data):
      (n,) = struct.unpack('<Q', data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
      i += 12 + n + 4
  return out


class FakeWandb(types.ModuleType):
  """The part of wandb's API tracking.Wandb uses, recording the calls."""

  def __init__(self):
    super().__init__('wandb')
    self.inits, self.logs, self.finished = [], [], 0

  def init(self, **kw):
    self.inits.append(kw)
    module = self

    class Run:
      def log(self, values, step):
        module.logs.append((step, dict(values)))

      def finish(self):
        module.finished += 1

    return Run()


def _records(run):
  return [json.loads(l) for l in (pathlib.Path(run) / 'metrics.jsonl').read_text().splitlines()]


@pytest.mark.slow
def test_trackers_get_every_record_and_the_steps_are_profiled(tmp_path, monkeypatch):
  """A run stopped and resumed with both trackers and a profile window:
  TensorBoard's events and W&B's logs hold each number of metrics.jsonl at its
  step; the step statistics are there; one W&B run continues; the trace is
  written. (The gradient norm leaves the losses bitwise as they were:
  test_step.py.)"""
  wandb = FakeWandb()
  monkeypatch.setitem(sys.modules, 'wandb', wandb)
  (tmp_path / 'corpus').mkdir()
  # test_train.py's run (the same programs: compiled once in the suite)
  cfg = TrainConfig(**TINY, data=[str(write_corpus(tmp_path / 'corpus'))], vocab_size=300,
                    seq_len=32, batch_size=4, steps=12, warmup=2, merge_every=4, block_size=8,
                    eval_every=6, eval_batches=2, log_every=3, checkpoint_every=100,
                    dtype='float32', out_dir=str(tmp_path / 'run'),
                    cache_dir=str(tmp_path / 'cache'), tracking=['tensorboard', 'wandb'],
                    profile_steps='2:3')
  assert train(cfg, log=lambda *_: None, stop_after=6)['step'] == 6
  train(cfg, resume=True, log=lambda *_: None)

  records = _records(cfg.out_dir)
  want = {(r['step'], tag): v for r in records for tag, v in tracking.scalars(r).items()}
  events = read_events(pathlib.Path(cfg.out_dir) / 'tensorboard')
  assert {(s, t) for s, t, _ in events} == set(want)
  for step, tag, value in events:
    np.testing.assert_allclose(value, want[step, tag], rtol=1e-6)  # float32 in the events
  logged = {(s, t): v for s, values in wandb.logs for t, v in values.items()}
  assert logged == want
  tags = {t for _, t in want}
  assert {'loss', 'lr', 'poet_lr', 'grad_norm', 'train_tokens_per_s', 'val_loss', 'val_ppl',
          'merge_orthogonality_error'} <= tags
  assert 'mfu' not in tags  # the CPU's peak is unknown
  stats = [r for r in records if 'grad_norm' in r]
  assert [r['step'] for r in stats] == [3, 6, 9, 12]
  assert all(r['grad_norm'] > 0 and r['lr'] > 0 and r['poet_lr'] > 0 for r in stats)
  assert [i['id'] for i in wandb.inits] == [wandb.inits[0]['id']] * 2 and wandb.finished == 2
  assert wandb.inits[0]['config'] == dataclasses.asdict(cfg)
  assert list((pathlib.Path(cfg.out_dir) / 'profile').rglob('*.xplane.pb'))


def test_the_learning_rates_are_the_schedules_of_the_last_update(tmp_path):
  """``lr`` at a log step is the schedule's value for the update just made
  (optax counts from 0): warmup 0 -> peak over 2 updates, then cosine."""
  cfg = TrainConfig(lr=1e-3, poet_lr=2e-3, steps=10, warmup=2)
  t = tracking.Tracking(make_plan(cfg), tmp_path)
  run = types.SimpleNamespace(cfg=cfg, step=3, grad_norm=None, start=0, t0=0.0,
                              clock=types.SimpleNamespace(paused_s=0.0, compile_s=lambda: 0.0))
  stats = t.step_stats(run)
  np.testing.assert_allclose([stats['lr'], stats['poet_lr']], [1e-3, 2e-3], rtol=1e-6)
  run.step = 1
  assert t.step_stats(run)['lr'] == 0.0  # the first update's: warmup from 0


def test_flops_per_token_and_device_peaks():
  mc = models.get_config('tiny')
  n = mc.num_params() - mc.vocab_size * mc.hidden  # the input embedding is a lookup
  assert tracking.flops_per_token(mc, 128) == 6 * n + 6 * mc.layers * 128 * mc.hidden
  moe = models.get_config('moe-tiny')
  assert tracking.flops_per_token(moe, 128) < 6 * moe.num_params()  # top-k experts only

  def device(kind, platform='gpu'):
    return types.SimpleNamespace(device_kind=kind, platform=platform)

  assert tracking.peak_flops(device('NVIDIA H200')) == 989e12
  assert tracking.peak_flops(device('NVIDIA H100 80GB HBM3')) == 989e12
  assert tracking.peak_flops(device('NVIDIA H100 PCIe')) == 756e12
  assert tracking.peak_flops(device('NVIDIA GeForce RTX 4090')) is None
  assert tracking.peak_flops(device('cpu', 'cpu')) is None
  # A mixture of experts' validation record: its routing as KEY/i.
  record = {'step': 4, 'val_loss': 5.5, 'expert_tokens': [70, 58, 64, 64], 'dropped': 6,
            'note': 'x', 'missing': None, 'flag': True}
  assert tracking.scalars(record) == {'val_loss': 5.5, 'expert_tokens/0': 70.0,
                                      'expert_tokens/1': 58.0, 'expert_tokens/2': 64.0,
                                      'expert_tokens/3': 64.0, 'dropped': 6.0}


def test_a_missing_tracker_package_is_named(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'wandb', None)  # import wandb raises ImportError
  with pytest.raises(ImportError, match='--tracking wandb needs the wandb package'):
    tracking.open_tracker('wandb', tmp_path, TrainConfig())


def test_a_resume_past_the_profile_windows_start_says_what_it_traces(tmp_path):
  cfg = TrainConfig(steps=10, profile_steps='3:5')
  said = []
  t = tracking.Tracking(make_plan(cfg), tmp_path / 'past', resume_step=6, log=said.append)
  assert not t.tracing and len(said) == 1
  assert 'resumes after micro-step 6, past the window: no trace is written' in said[0]
  t.close()
  said.clear()
  t = tracking.Tracking(make_plan(cfg), tmp_path / 'inside', resume_step=4, log=said.append)
  assert t.tracing and 'the trace holds steps 5 to 5 only' in said[0]
  t.close()
  assert list((tmp_path / 'inside' / 'profile').rglob('*.xplane.pb'))
  said.clear()
  t = tracking.Tracking(make_plan(cfg), tmp_path / 'before', resume_step=2, log=said.append)
  assert t.tracing and not said  # the whole window ahead: traced, nothing to say
  t.close()


@pytest.mark.parametrize('window,accum,start,stop', [('6:7', 4, 4, 8), ('2:4', 4, 0, 4),
                                                      ('3:5', 1, 2, 5)])
def test_the_profile_window_holds_the_updates_that_train_its_steps(
    tmp_path, monkeypatch, window, accum, start, stop):
  """The trace starts before the update that trains micro-step A and stops
  once an update has reached B, with and without gradient accumulation."""
  cfg = TrainConfig(steps=10, grad_accum=accum, profile_steps=window)
  t = tracking.Tracking(make_plan(cfg), tmp_path)
  events = []
  monkeypatch.setattr(t, '_start_trace', lambda: (events.append(('start', run.step)),
                                                  setattr(t, 'tracing', True)))
  monkeypatch.setattr(t, '_stop_trace', lambda: (events.append(('stop', run.step)),
                                                 setattr(t, 'tracing', False)))
  run = types.SimpleNamespace(cfg=cfg, step=0, loss=None, clock=None)  # at_start, step 0
  t.profile(run)
  run.clock = types.SimpleNamespace(paused=lambda loss: contextlib.nullcontext())
  for step in range(accum, 10 * accum + 1, accum):
    run.step = step
    t.profile(run)
  assert events == [('start', start), ('stop', stop)]
