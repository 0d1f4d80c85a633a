"""experiments/compare_quality.py end to end on the tiny Llama (CPU)."""

import json
import math
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'experiments'))
import compare_quality  # noqa: E402
from conftest import write_corpus


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return write_corpus(tmp_path_factory.mktemp('corpus'), words=200)


def _args(tmp, corpus, *extra):
  return ['--model', 'tiny', '--seq-len', '64', '--batch-size', '8', '--steps', '30',
          '--eval-every', '10', '--eval-batches', '4', '--log-every', '2',
          '--merge-every', '20', '--block-sizes', '16', '--adamw-lrs', '3e-3',
          '--poet-lrs', '2.5e-3,5e-3', '--vocab-size', '512', '--dtype', 'float32',
          '--data', str(corpus), '--cache-dir', str(tmp / 'cache'), '--out', str(tmp / 'out'),
          *extra]


def test_compare_quality_end_to_end(tmp_path, corpus, capsys):
  res = compare_quality.main(_args(tmp_path, corpus))
  out = tmp_path / 'out'
  assert json.loads((out / 'results.json').read_text())['best'] == res['best']
  printed = capsys.readouterr().out
  assert printed.startswith('data: 40 documents') and '| poetx-b16-lr0.005' in printed
  assert (out / 'quality.md').read_text() in printed
  for png in ('quality.png', 'spectrum.png'):
    assert (out / png).stat().st_size > 10_000

  runs = {r['name']: r for r in res['runs']}
  assert sorted(runs) == ['adamw-lr0.003', 'poetx-b16-lr0.0025', 'poetx-b16-lr0.005']
  assert {r['optimizer'] for r in runs.values()} == {'adamw', 'poetx'}
  assert all(r['lr'] == 3e-3 for r in runs.values())  # POET-X's other lr: AdamW's best
  for r in runs.values():
    ppl = [e['val_ppl'] for e in r['evals']]
    assert [e['step'] for e in r['evals']] == [0, 10, 20, 30]
    assert all(map(math.isfinite, ppl)) and max(ppl[1:]) < ppl[0]
    assert r['val_ppl_final'] < 0.2 * r['val_ppl_start']
    # timing: compilation and evaluation are outside the steady-state time
    assert 0 < r['steady_s'] < r['train_s'] <= r['elapsed_s'] and r['compile_s'] > 0
    assert [e['steady_s'] for e in r['evals']] == sorted(e['steady_s'] for e in r['evals'])
    assert r['loss_spikes'] == []
  # the shortest run's perplexity at equal time is its final one
  shortest = min(runs.values(), key=lambda r: r['steady_s'])
  assert shortest['val_ppl_at_equal_time'] == pytest.approx(shortest['val_ppl_final'])
  assert all(r['val_ppl_at_equal_time'] is not None for r in runs.values())

  # Spectrum: same initial weights; POET-X keeps them, AdamW moves them.
  paths = res['header']['probed_layers']
  assert paths == ['layers.0.self_attn.q_proj', 'layers.0.mlp.down_proj',
                   'layers.1.self_attn.q_proj', 'layers.1.mlp.down_proj']
  probes = {n: {p['step']: p for p in r['probes']} for n, r in runs.items()}
  adamw = probes['adamw-lr0.003']
  assert sorted(adamw) == [0, 10, 20, 30]
  for name in ('poetx-b16-lr0.0025', 'poetx-b16-lr0.005'):
    poet = probes[name]
    for p in paths:
      np.testing.assert_allclose(poet[0][f'{p}/sv_top'], adamw[0][f'{p}/sv_top'], rtol=1e-6)
      np.testing.assert_allclose(poet[0][f'{p}/sv_bottom'], adamw[0][f'{p}/sv_bottom'],
                                 rtol=1e-6)
      # Step 0 and a merge (step 20) leave identity factors behind.
      assert poet[0][f'{p}/orth_err'] == poet[20][f'{p}/orth_err'] == 0.0
      # Mid first cycle: the spectrum is step 0's up to the series' error.
      drift, err = poet[10][f'{p}/sv_rel_change'], poet[10][f'{p}/orth_err']
      assert 0 < err < 1e-3 and drift < 1e-4 and drift <= err
      np.testing.assert_allclose(poet[10][f'{p}/sv_top'], poet[0][f'{p}/sv_top'], rtol=1e-4)
      # Mid second cycle: constant since the merge at step 20.
      np.testing.assert_allclose(poet[30][f'{p}/sv_top'], poet[20][f'{p}/sv_top'], rtol=1e-5)
      assert poet[30][f'{p}/svd_entropy'] == pytest.approx(poet[0][f'{p}/svd_entropy'],
                                                           rel=1e-4)
      assert adamw[10][f'{p}/sv_rel_change'] > 100 * drift
  assert all(adamw[s][f'{p}/sv_rel_change'] > 1e-2 for s in (10, 20, 30) for p in paths)
  assert all(r['max_orth_err'] < 1e-3 for r in runs.values() if r['optimizer'] == 'poetx')

  # A second invocation does not clobber the runs without --overwrite.
  with pytest.raises(SystemExit, match='--overwrite'):
    compare_quality.main(_args(tmp_path, corpus))


def test_bad_flags_are_named(capsys):
  for argv, msg in ((['--model', '1b'], "--model '1b' is not one of tiny, 60m, 130m"),
                    (['--block-sizes', '128,x'], '--block-sizes wants comma-separated ints'),
                    (['--model', 'tiny', '--block-sizes', '128'],
                     '--block-sizes=128 is larger than the dimension 64; valid block '
                     'sizes are 2..32'),
                    (['--model', 'tiny', '--seq-len', '4096'], 'is longer than model'),
                    (['--batch-size', '0'], 'batch_size must be an int >= 1'),
                    (['--eval-every', '25', '--log-every', '10'], 'must divide --eval-every'),
                    (['--poet-other-lr', 'fast'], "a number or 'best', got 'fast'"),
                    (['--adamw-lrs', '1e-3,-1'], 'values must be > 0')):
    with pytest.raises(SystemExit):
      compare_quality.parse_args(argv)
    assert msg in capsys.readouterr().err, argv


def test_spike_rule_and_time_interpolation():
  losses = [(s, 4.0 - 0.01 * s) for s in range(0, 100, 10)] + [(100, 7.0), (110, 3.0)]
  assert compare_quality.loss_spikes(losses) == [100]
  assert compare_quality.loss_spikes(losses[:3] + [(30, 9.0)]) == [30]
  assert compare_quality.loss_spikes([(0, 1.0), (1, 9.0)]) == []  # too few before it
  pts = [{'steady_s': 0.0, 'val_ppl': 100.0}, {'steady_s': 2.0, 'val_ppl': 25.0}]
  assert compare_quality.ppl_at_time(pts, 1.0) == pytest.approx(50.0)
  assert compare_quality.ppl_at_time(pts, 3.0) is None
