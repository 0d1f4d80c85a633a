"""The fault-injection driver (experiments/fault_injection.py): four random
stops of one tiny run by SIGTERM, SIGINT and SIGKILL (one of each kind, the
kills one at a step and one at a save), each resumed, end as the
uninterrupted run, bit for bit."""

import collections
import dataclasses

import pytest

from conftest import write_corpus
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.train import train

from experiments import fault_injection

STEPS, STOPS = 20, 4

pytestmark = pytest.mark.slow  # a run of 20 steps, four stops and their resumes


def test_four_random_stops_end_as_the_uninterrupted_run(tmp_path):
  # Seed 217: a SIGTERM stop after step 6 (beside a merge), a kill -9 as the
  # periodic save of step 8 starts (after the SIGTERM stop's save of step 6),
  # a kill -9 right after step 9 (beside a merge; after step 8's periodic
  # save, made again after the resume from 6), then a SIGINT stop after
  # step 10.
  stops = fault_injection.plan_stops(STEPS, STOPS, seed=217, kill_share=0.5,
                                     checkpoint_every=fault_injection.TINY['checkpoint_every'])
  assert [(s.step, s.signal, s.on) for s in stops] == [
      (6, 'SIGTERM', 'step'), (8, 'SIGKILL', 'save'), (9, 'SIGKILL', 'step'),
      (10, 'SIGINT', 'step')]
  kinds = collections.Counter((s.signal, s.on) for s in stops)
  assert kinds[('SIGKILL', 'save')] == kinds[('SIGKILL', 'step')] == 1, kinds
  assert kinds[('SIGTERM', 'step')] and kinds[('SIGINT', 'step')], kinds
  assert [s.step for s in stops] == sorted({s.step for s in stops})  # distinct, increasing

  (tmp_path / 'corpus').mkdir()
  corpus = write_corpus(tmp_path / 'corpus')
  base = TrainConfig(**fault_injection.TINY, steps=STEPS, data=[str(corpus)],
                     cache_dir=str(tmp_path / 'cache'))
  reference = dataclasses.replace(base, out_dir=str(tmp_path / 'uninterrupted'))
  stopped = dataclasses.replace(base, out_dir=str(tmp_path / 'stopped'))
  train(reference, log=lambda *_: None)
  result = fault_injection.run_with_stops(stopped, stops)
  got = fault_injection.compare(stopped, reference)
  assert got['losses_differ'] == 0 and got['state_bytes_differ'] == 0, got
  assert got['final_step'] == STEPS and got['state_bytes'] > 0
  # A SIGTERM or SIGINT stop saves its step; a kill loses the steps since the
  # newest whole checkpoint (a periodic one, or a stop's; the one whose save
  # it struck unless that save finished first), trained again after the resume.
  saved = {0}
  for s in result['stops']:
    if s['signal'] == 'SIGKILL':
      assert s['resumed_from'] <= s['step'], s
      assert s['resumed_from'] % 4 == 0 or s['resumed_from'] in saved, s
    else:
      assert s['resumed_from'] == s['step'], s
    saved.add(s['resumed_from'])
  lost = sum(s['step'] - s['resumed_from'] for s in result['stops'])
  assert result['steps_trained'] == STEPS + lost
