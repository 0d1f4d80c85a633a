"""experiments/compare_quality.py end to end on the tiny Llama (CPU)."""

import json
import math
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
from experiments import compare_quality
from experiments import quality_report as R
from conftest import write_corpus


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  return write_corpus(tmp_path_factory.mktemp('corpus'), words=200)


# The default study: AdamW at two seeds and one POET-X run (sweeps of other
# options expand as seeds do: test_run_specs_expand_into_runs_and_configurations).
ADAMW, POET = 'optimizer=adamw,lr=3e-3', 'optimizer=poetx,poet_lr=2.5e-3,lr=best'


def _args(tmp, corpus, *runs):
  return ['--model', 'tiny', '--model-overrides', 'mlp=64',
          '--seq-len', '64', '--batch-size', '8', '--steps', '30',
          '--warmup', '1', '--eval-every', '10', '--eval-batches', '4', '--log-every', '2',
          '--merge-every', '20', '--block-size', '16', '--vocab-size', '512',
          '--dtype', 'float32', '--data', str(corpus), '--cache-dir', str(tmp / 'cache'),
          '--out', str(tmp / 'out'), '--runs', *(runs or (ADAMW + ',seed=0|1', POET))]


def _assert_spectrum(res, runs):
  """Same initial weights; POET-X keeps their spectrum, AdamW moves it."""
  paths = res['header']['probed_layers']
  assert paths == ['layers.0.self_attn.q_proj', 'layers.0.mlp.down_proj',
                   'layers.1.self_attn.q_proj', 'layers.1.mlp.down_proj']
  probes = {n: {p['step']: p for p in r['probes']} for n, r in runs.items()}
  adamw = probes['optimizer=adamw,lr=3e-3,seed=0']
  assert sorted(adamw) == [0, 10, 20, 30]
  poet = probes['optimizer=poetx,poet_lr=2.5e-3,lr=best']
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


@pytest.fixture(scope='module')
def serial(tmp_path_factory, corpus):
  """The default study, one run at a time: (its result, what it printed, its tmp dir)."""
  import contextlib
  import io
  tmp = tmp_path_factory.mktemp('serial')
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    res = compare_quality.main(_args(tmp, corpus))
  return res, printed.getvalue(), tmp


@pytest.mark.slow
def test_compare_quality_end_to_end(serial, corpus):
  res, printed, tmp_path = serial
  out = tmp_path / 'out'
  assert json.loads((out / 'results.json').read_text())['best'] == res['best']
  assert printed.startswith('data: 40 documents')
  assert '| optimizer=poetx,poet_lr=2.5e-3,lr=best |' in printed
  assert (out / 'quality.md').read_text() in printed
  for png in ('quality.png', 'spectrum.png'):
    assert (out / png).stat().st_size > 10_000

  runs = {r['name']: r for r in res['runs']}
  assert list(runs) == ['optimizer=adamw,lr=3e-3,seed=0', 'optimizer=adamw,lr=3e-3,seed=1',
                        'optimizer=poetx,poet_lr=2.5e-3,lr=best']
  assert all((out / 'runs' / name / 'metrics.jsonl').is_file() for name in runs)
  # What a report rebuilt from the directory reads (quality_report.from_study).
  study = json.loads((out / 'study.json').read_text())
  assert study['plan'] == list(runs) and res['header']['failed_runs'] == []
  assert all((out / 'runs' / name / 'summary.json').is_file() for name in runs)
  assert all(r['lr'] == 3e-3 for r in runs.values())  # POET-X's other lr: AdamW's best
  assert [r['seed'] for r in runs.values()] == [0, 1, 0]
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

  # Seeds: another initial model, one configuration with mean and spread.
  seed0, seed1 = runs['optimizer=adamw,lr=3e-3,seed=0'], runs['optimizer=adamw,lr=3e-3,seed=1']
  assert seed0['val_ppl_start'] != seed1['val_ppl_start']
  configs = {c['config']: c for c in res['configurations']}
  assert list(configs) == ['optimizer=adamw,lr=3e-3', 'optimizer=poetx,poet_lr=2.5e-3,lr=best']
  adamw = configs['optimizer=adamw,lr=3e-3']
  finals = [seed0['val_ppl_final'], seed1['val_ppl_final']]
  assert adamw['seeds'] == [0, 1] and adamw['val_ppl_final']['n'] == 2
  assert adamw['val_ppl_final']['mean'] == pytest.approx(np.mean(finals))
  assert adamw['val_ppl_final']['sd'] == pytest.approx(np.std(finals, ddof=1))
  assert [e['val_ppl']['mean'] for e in adamw['evals']] == pytest.approx(
      [(a['val_ppl'] + b['val_ppl']) / 2 for a, b in zip(seed0['evals'], seed1['evals'])])
  assert configs['optimizer=poetx,poet_lr=2.5e-3,lr=best']['val_ppl_final']['sd'] is None
  md = (out / 'quality.md').read_text()
  mean, sd = adamw['val_ppl_final']['mean'], adamw['val_ppl_final']['sd']
  assert f'| optimizer=adamw,lr=3e-3 **(best)** | 0, 1 | 0.003 | — | {mean:.2f} ± {sd:.2f} |' in md
  assert set(res['best']) == {'AdamW', 'POET-X B=16'}

  _assert_spectrum(res, runs)

  # A second invocation does not clobber the runs without --overwrite.
  with pytest.raises(SystemExit, match='--overwrite'):
    compare_quality.main(_args(tmp_path, corpus))


@pytest.mark.slow
def test_jobs_train_runs_side_by_side_with_the_same_results(serial, tmp_path, corpus,
                                                            monkeypatch):
  """--jobs 2: each run in a process of its own gives the perplexities of the
  one-at-a-time study; lr=best waits for the AdamW runs (one of which
  diverges, is reported so and is never the best). A run whose process fails
  stops none of the others: the report covers them and names it, then the
  script exits non-zero."""
  ref = {r['name']: r for r in serial[0]['runs']}
  popen, lost = compare_quality.subprocess.Popen, 'optimizer=adamw,lr=2e-3'

  def failing(cmd, **kw):  # the lost run's process dies at once, as a killed one does
    killed = '--child' in cmd and json.loads(cmd[cmd.index('--child') + 1])['run'] == lost
    return popen([sys.executable, '-c', 'raise SystemExit(3)'] if killed else cmd, **kw)
  monkeypatch.setattr(compare_quality.subprocess, 'Popen', failing)
  with pytest.raises(SystemExit, match=r"runs \['optimizer=adamw,lr=2e-3'\] failed .*"
                                       r"the report covers the other 3"):
    compare_quality.main(_args(tmp_path, corpus, ADAMW + ',seed=0', lost, 'optimizer=adamw,lr=1e30',
                               'optimizer=poetx,poet_lr=2.5e-3,lr=best') + ['--jobs', '2'])
  header = json.loads((tmp_path / 'out' / 'results.json').read_text())['header']
  assert header['failed_runs'] == [lost] and header['jobs'] == 2
  # The report as a study stopped before its end leaves it: rebuilt elsewhere
  # from its study.json and the runs' summaries, without the corpus.
  for f in ('results.json', 'quality.md'):
    (tmp_path / 'out' / f).unlink()
  res = R.main(['--out', str(tmp_path / 'rebuilt'), str(tmp_path / 'out')])
  assert res['header']['failed_runs'] == [lost]
  runs = {r['name']: r for r in res['runs']}
  assert list(runs) == ['optimizer=adamw,lr=3e-3,seed=0', 'optimizer=adamw,lr=1e30',
                        'optimizer=poetx,poet_lr=2.5e-3,lr=best']
  for name in ('optimizer=adamw,lr=3e-3,seed=0', 'optimizer=poetx,poet_lr=2.5e-3,lr=best'):
    assert [e['val_loss'] for e in runs[name]['evals']] == pytest.approx(
        [e['val_loss'] for e in ref[name]['evals']], rel=1e-6)
    assert not runs[name].get('diverged')
  bad = runs['optimizer=adamw,lr=1e30']
  assert 'diverged' in bad and bad['val_ppl_final'] == math.inf
  assert runs['optimizer=poetx,poet_lr=2.5e-3,lr=best']['lr'] == 3e-3
  assert res['best']['AdamW'] == 'optimizer=adamw,lr=3e-3'
  assert res['equal_time_s'] == min(runs[n]['steady_s'] for n in runs if n != bad['name'])
  logs = tmp_path / 'out' / 'logs'
  assert sorted(p.name for p in logs.iterdir()) == sorted(f'{n}.log' for n in [*runs, lost])
  md = (tmp_path / 'rebuilt' / 'quality.md').read_text()
  assert '| optimizer=adamw,lr=1e30 (diverged; last logged step' in md
  assert f"Failed, no result (their logs are in the study's logs/): `{lost}`" in md
  assert f'| {lost}' not in md


@pytest.mark.slow
def test_a_run_stopped_before_its_last_update_is_not_a_result(tmp_path, corpus, monkeypatch):
  """A --jobs child whose training a SIGTERM stopped early (here stop_after,
  the same path) writes no summary and exits non-zero, so the parent counts
  it failed instead of reporting its early perplexity as final."""
  import functools
  from poetx_jax.pretrain import train as train_lib
  monkeypatch.setattr(train_lib, 'train', functools.partial(train_lib.train, stop_after=4))
  name = 'optimizer=adamw,lr=3e-3'
  with pytest.raises(SystemExit, match=f'{name}: stopped at step 4 of 30'):
    compare_quality.main(_args(tmp_path, corpus, name)
                         + ['--jobs', '2', '--child', json.dumps({'run': name, 'best_lr': None})])
  run_dir = tmp_path / 'out' / 'runs' / name
  assert (run_dir / 'metrics.jsonl').is_file() and not (run_dir / 'summary.json').exists()


@pytest.mark.slow
def test_a_stopped_study_resumes_to_the_uninterrupted_studys_results(serial, tmp_path, corpus,
                                                                      monkeypatch):
  """A study stopped in its second run (a stop ends the study) continues with
  --resume: the finished run is kept, not trained again; the stopped one
  continues from its checkpoint to the finals of the same runs trained
  without a stop (the serial study); other flags than the study started with
  are refused, as is a second start over it without --resume."""
  import re
  from poetx_jax.pretrain import train as train_lib
  real, calls = train_lib.train, []
  first, second = ADAMW + ',seed=0', ADAMW + ',seed=1'
  args = _args(tmp_path, corpus, ADAMW + ',seed=0|1')

  def train(cfg, **kw):
    calls.append((cfg.seed, kw.get('resume')))
    return real(cfg, **kw, **({'stop_after': 12} if cfg.seed == 1 and not calls[1:-1] else {}))
  monkeypatch.setattr(train_lib, 'train', train)
  with pytest.raises(SystemExit, match=f'{re.escape(second)}: stopped at step 12 of 30'):
    compare_quality.main(args)
  with pytest.raises(SystemExit, match='already holds run directories'):
    compare_quality.main(args)
  longer = [*args]
  longer[longer.index('--steps') + 1] = '40'
  with pytest.raises(SystemExit, match=r'started with other steps \(30 there\)'):
    compare_quality.main(longer + ['--resume'])
  with pytest.raises(SystemExit, match='--resume: .* holds no study'):
    compare_quality.main(_args(tmp_path / 'other', corpus, ADAMW) + ['--resume'])
  res = compare_quality.main(args + ['--resume'])
  assert calls == [(0, False), (1, False), (1, True)]
  want = {r['name']: r['val_ppl_final'] for r in serial[0]['runs']}
  assert {r['name']: r['val_ppl_final'] for r in res['runs']} == {n: want[n] for n in (first, second)}
  resumed = next(r for r in res['runs'] if r['name'] == second)
  # Its steady time holds the first process's too, beyond the resumed one's own clock.
  assert resumed['steady_s'] > resumed['train_s'] - resumed['compile_s'] > 0
  logged = [json.loads(line) for line in (tmp_path / 'out' / 'runs' / second / 'metrics.jsonl')
            .open() if '"loss"' in line]
  assert {(r['step'] <= 12, r['start_step']) for r in logged} == {(True, 0), (False, 12)}


@pytest.mark.slow
def test_a_signal_to_a_jobs_study_leaves_each_run_a_checkpoint_to_resume(tmp_path, corpus):
  """--jobs 2 under SIGINT to its whole process group (a Ctrl-C, a time
  limit's signal): the study alone receives it, passes it on once, and exits
  130 naming --resume only once each child saved a checkpoint at its next
  update and exited (the caller may tear the machine down then). --resume
  continues the runs to their last update; a started run that holds no
  checkpoint (a child killed before its first: its checkpoints removed here)
  starts over."""
  import os
  import shutil
  import signal
  import subprocess
  import time
  names = [ADAMW + ',seed=0', ADAMW + ',seed=1']
  args = _args(tmp_path, corpus, ADAMW + ',seed=0|1') + ['--jobs', '2']
  args[args.index('--steps') + 1] = '60'
  args[args.index('--eval-every') + 1] = '30'
  runs = tmp_path / 'out' / 'runs'
  cmd = [sys.executable, '-m', 'experiments.compare_quality', *args]
  study = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)

  def training(name):
    metrics = runs / name / 'metrics.jsonl'
    return metrics.is_file() and '"loss"' in metrics.read_text()
  while not all(map(training, names)):
    assert study.poll() is None, study.communicate()[0]
    time.sleep(0.05)
  os.killpg(study.pid, signal.SIGINT)
  out = study.communicate(timeout=120)[0]
  assert study.returncode == 130, out
  assert 'stopping at once' not in out
  assert f'{names[0]}, {names[1]} hold a checkpoint' in out and '--resume' in out
  stopped = {}
  for name in names:  # saved and exited by the time the study did
    log = (tmp_path / 'out' / 'logs' / f'{name}.log').read_text()
    assert 'KeyboardInterrupt' not in log  # one signal reached it: a second stops it unsaved
    stopped[name] = int(log.split(f'{name}: stopped at step ')[1].split()[0])
    assert 0 < stopped[name] < 60
    assert [p.name for p in (runs / name / 'checkpoints').iterdir()] == [str(stopped[name])]
  shutil.rmtree(runs / names[1] / 'checkpoints')
  res = compare_quality.main(args + ['--resume'])
  assert sorted(r['name'] for r in res['runs']) == names
  logs = {n: (tmp_path / 'out' / 'logs' / f'{n}.log').read_text() for n in names}
  assert f'{names[0]} (lr 0.003), resumed' in logs[names[0]]
  assert f'{names[1]} (lr 0.003), started over (it holds no checkpoint)' in logs[names[1]]
  for name in names:  # every update logged once, to the last
    steps = [json.loads(line)['step'] for line in (runs / name / 'metrics.jsonl').open()
             if '"loss"' in line]
    assert steps == list(range(2, 61, 2))


@pytest.mark.slow
def test_the_runs_of_a_killed_jobs_study_stop_themselves_with_a_checkpoint(tmp_path, corpus):
  """A --jobs study killed outright (SIGKILL: nothing of it runs to pass a
  signal on) leaves no run training: each child, in a session of its own,
  sees its study gone, stops at its next update and saves a checkpoint."""
  import os
  import signal
  import subprocess
  import time
  names = [ADAMW + ',seed=0', ADAMW + ',seed=1']
  args = _args(tmp_path, corpus, ADAMW + ',seed=0|1') + ['--jobs', '2']
  args[args.index('--steps') + 1] = '2000'
  runs, logs = tmp_path / 'out' / 'runs', tmp_path / 'out' / 'logs'
  study = subprocess.Popen([sys.executable, '-m', 'experiments.compare_quality', *args],
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  def training(name):
    metrics = runs / name / 'metrics.jsonl'
    return metrics.is_file() and '"loss"' in metrics.read_text()
  while not all(map(training, names)):
    assert study.poll() is None
    time.sleep(0.05)
  os.kill(study.pid, signal.SIGKILL)
  study.wait()
  deadline = time.monotonic() + 120
  for name in names:
    while 'stopped at step' not in (logs / f'{name}.log').read_text():
      assert time.monotonic() < deadline, (logs / f'{name}.log').read_text()[-2000:]
      time.sleep(0.2)
    log = (logs / f'{name}.log').read_text()
    step = int(log.split(f'{name}: stopped at step ')[1].split()[0])
    assert 0 < step < 2000 and '(SIGTERM)' in log
    while not (runs / name / 'checkpoints' / str(step)).is_dir():  # its save, finishing
      assert time.monotonic() < deadline
      time.sleep(0.2)


@pytest.mark.slow
def test_a_run_that_raises_stops_none_of_the_others_one_at_a_time(tmp_path, corpus,
                                                                    monkeypatch):
  """Without --jobs, a run whose training raises is logged with its
  traceback and has no result; the next run trains and the report names the
  failed one, then the script exits non-zero."""
  from poetx_jax.pretrain import train as train_lib
  real, lost = train_lib.train, 'optimizer=adamw,lr=2e-3'

  def train(cfg, **kw):
    if cfg.lr == 2e-3:
      raise RuntimeError('RESOURCE_EXHAUSTED: out of memory (injected)')
    return real(cfg, **kw)
  monkeypatch.setattr(train_lib, 'train', train)
  with pytest.raises(SystemExit, match=rf"runs \['{lost}'\] failed .*the report covers the other 1"):
    compare_quality.main(_args(tmp_path, corpus, lost, ADAMW))
  out = tmp_path / 'out'
  res = json.loads((out / 'results.json').read_text())
  assert res['header']['failed_runs'] == [lost]
  assert [r['name'] for r in res['runs']] == [ADAMW]
  assert res['runs'][0]['val_ppl_final'] < 0.2 * res['runs'][0]['val_ppl_start']
  log = (out / 'logs' / f'{lost}.log').read_text()
  assert log.startswith('Traceback') and 'RESOURCE_EXHAUSTED: out of memory (injected)' in log
  assert not (out / 'runs' / lost / 'summary.json').exists()


def test_lr_best_runs_fail_unstarted_when_no_adamw_run_finished(tmp_path, corpus, monkeypatch):
  """--jobs: when every AdamW run failed, the lr=best runs have no rate to
  take; they are reported failed without a process of their own (once, the
  parent died of the ValueError and wrote nothing), and no run finished."""
  popen, started = compare_quality.subprocess.Popen, []

  def killed(cmd, **kw):  # every child dies at once (git, asked for the commit, runs)
    if '--child' not in cmd:
      return popen(cmd, **kw)
    started.append(json.loads(cmd[cmd.index('--child') + 1])['run'])
    return popen([sys.executable, '-c', 'raise SystemExit(3)'], **kw)
  monkeypatch.setattr(compare_quality.subprocess, 'Popen', killed)
  best = 'optimizer=poetx,poet_lr=2.5e-3,lr=best'
  with pytest.raises(SystemExit, match="none of the study's 2 runs has finished"):
    compare_quality.main(_args(tmp_path, corpus, ADAMW, best) + ['--jobs', '2'])
  assert started == [ADAMW]
  assert (compare_quality.run_log(tmp_path / 'out', best).read_text()
          == 'not started: lr=best needs an AdamW run before it\n')


def test_run_specs_expand_into_runs_and_configurations():
  from poetx_jax.pretrain.config import TrainConfig
  base = TrainConfig(model='tiny', steps=40, warmup=2, eval_every=10)
  plan = compare_quality.plan_runs(base, [
      'optimizer=poetx,poet_lr=1e-3|2e-3,merge_every=5|10,lr=best',
      'optimizer=adamw,lr=1e-3|3e-3,seed=0|1',
      'optimizer=poetx,model_overrides={layers=1,hidden=32},block_size=8'])
  assert [r['name'] for r in plan] == [
      'optimizer=adamw,lr=1e-3,seed=0', 'optimizer=adamw,lr=1e-3,seed=1',
      'optimizer=adamw,lr=3e-3,seed=0', 'optimizer=adamw,lr=3e-3,seed=1',
      'optimizer=poetx,model_overrides=_layers=1,hidden=32_,block_size=8',
      'optimizer=poetx,poet_lr=1e-3,merge_every=5,lr=best',
      'optimizer=poetx,poet_lr=1e-3,merge_every=10,lr=best',
      'optimizer=poetx,poet_lr=2e-3,merge_every=5,lr=best',
      'optimizer=poetx,poet_lr=2e-3,merge_every=10,lr=best']  # lr=best after the others
  assert [r['config'] for r in plan[:4]] == ['optimizer=adamw,lr=1e-3'] * 2 + [
      'optimizer=adamw,lr=3e-3'] * 2
  cfg = compare_quality.run_config(base, plan[-1], pathlib.Path('o'), best_lr=3e-3)
  assert (cfg.optimizer, cfg.poet_lr, cfg.merge_every, cfg.lr, cfg.out_dir) == (
      'poetx', 2e-3, 10, 3e-3, 'o/runs/optimizer=poetx,poet_lr=2e-3,merge_every=10,lr=best')
  cfg = compare_quality.run_config(base, plan[4], pathlib.Path('o'))
  assert cfg.model_overrides == {'layers': 1, 'hidden': 32} and cfg.block_size == 8


@pytest.mark.slow
def test_probes_cover_the_single_matrices_only():
  """Dense models: q and down projections; mixture-of-experts models: the
  expert projections are stacks of kernels, so the q projections only."""
  import poetx_jax
  from flax import nnx
  from poetx_jax.models import get_config, init_model
  dense = init_model(get_config('tiny', vocab_size=64))
  assert compare_quality.probed_layers(dense) == [
      'layers.0.self_attn.q_proj', 'layers.0.mlp.down_proj',
      'layers.1.self_attn.q_proj', 'layers.1.mlp.down_proj']
  moe = poetx_jax.poetize(init_model(get_config('moe-tiny', vocab_size=64)), block_size=8,
                          rngs=nnx.Rngs(1))
  assert compare_quality.probed_layers(moe) == ['layers.0.self_attn.q_proj',
                                                'layers.1.self_attn.q_proj']


def test_bad_flags_are_named(capsys):
  for argv, msg in ((['--model', 'xl'], 'model must be one of'),
                    (['--runs', 'optimizer=adamw,lrr=1'],
                     "'lrr' in 'optimizer=adamw,lrr=1' is not an option; valid: model, "),
                    (['--runs', 'lr=fast'], "lr must be a number or none, got 'fast'"),
                    (['--runs', 'optimizer=adamw,lr=1e-3|-1'],
                     'lr must be >= 0 (or None: 0.003; on a model of hidden size >= 512, '
                     'AdamW 0.0006 and Muon 0.004, the bests of the sweeps in '
                     'docs/quality.md), got -1.0'),
                    (['--runs', 'optimizer=adamw,lr=1e-3|1e-3'],
                     "run 'optimizer=adamw,lr=1e-3' is given twice"),
                    (['--runs', 'a:optimizer=adamw', 'b:optimizer=adamw'],
                     "configuration 'optimizer=adamw' is given twice with seed 0"),
                    (['--runs', 'optimizer=poetx,lr=best'], 'has no AdamW run'),
                    (['--model', 'tiny', '--block-size', '128'],
                     'block_size=128 is larger than the dimension 64; valid block '
                     'sizes are 2..32'),
                    (['--model', 'tiny', '--runs', 'optimizer=poetx,block_size=128'],
                     'block_size=128 is larger than the dimension 64'),
                    (['--model', 'tiny', '--seq-len', '4096'], 'is longer than model'),
                    (['--batch-size', '0'], 'batch_size must be an int in [1, '),
                    (['--eval-every', '25', '--log-every', '10'], 'must divide eval_every'),
                    (['--steps', '10'], 'warmup=20 must be less than steps=10')):
    with pytest.raises(SystemExit):
      compare_quality.parse_args(argv)
    assert msg in capsys.readouterr().err, argv


def test_spike_rule_and_time_interpolation():
  losses = [(s, 4.0 - 0.01 * s) for s in range(0, 100, 10)] + [(100, 7.0), (110, 3.0)]
  assert R.loss_spikes(losses) == [100]
  assert R.loss_spikes(losses[:3] + [(30, 9.0)]) == [30]
  assert R.loss_spikes([(0, 1.0), (1, 9.0)]) == []  # too few before it
  pts = [{'steady_s': 0.0, 'val_ppl': 100.0}, {'steady_s': 2.0, 'val_ppl': 25.0}]
  assert R.ppl_at_time(pts, 1.0) == pytest.approx(50.0)
  assert R.ppl_at_time(pts, 3.0) is None


def test_a_resumed_runs_clock_adds_its_processes_steady_time():
  """A run stopped after step 60 (its last record at 50) and resumed: the
  second process's clock starts again. Its steady seconds carry on from the
  first's; its speed counts the steps each clock timed (0-50, then 70-90:
  the interval to its first record holds the resume's compile)."""
  def rec(step, train_s, compile_s):
    return {'step': step, 'loss': 1.0, 'train_s': train_s, 'compile_s': compile_s}
  one = {s: rec(s, 5.0 + 0.1 * s, 5.0) for s in range(10, 60, 10)}
  steady, steps, seconds = R.steady_clock(one)
  assert steady[0] == 0.0 and steady[50] == pytest.approx(5.0)
  assert (steps, seconds) == (50, pytest.approx(5.0))  # as end / (train_s - compile_s)
  two = {**one, **{s: rec(s, 3.0 + 0.2 * (s - 70) + 0.5, 3.0) for s in (70, 80, 90)}}
  steady, steps, seconds = R.steady_clock(two)
  assert steady[70] == pytest.approx(5.5) and steady[90] == pytest.approx(9.5)
  assert steps == 50 + 20 and seconds == pytest.approx(5.0 + 4.0)
  # Records that name their process's start step: the second process is told
  # apart by it even where its clock, a long compile in it, passed the first's.
  def named(r, start):
    return {**r, 'start_step': start}
  slow = {**{s: named(r, 0) for s, r in one.items()},
          **{s: named(rec(s, 12.0 + 0.2 * (s - 70) + 0.5, 12.0), 60) for s in (70, 80, 90)}}
  steady, steps, seconds = R.steady_clock(slow)
  assert slow[70]['train_s'] > slow[50]['train_s']
  assert steady[70] == pytest.approx(5.5) and steady[90] == pytest.approx(9.5)
  assert steps == 50 + 20 and seconds == pytest.approx(5.0 + 4.0)


@pytest.mark.slow
def test_join_reports_studies_of_other_seeds_as_one(serial, tmp_path):
  """quality_report.py joins results.json files: a configuration written with
  its K=V pairs in another order in a later study (a second seed, say) is the
  same configuration, with statistics over both; a run in two studies is refused."""
  first = json.loads(json.dumps(serial[0]))
  second = json.loads(json.dumps(first))
  for r in second['runs']:
    r['config'] = ','.join(reversed(r['config'].split(',')))
    r['seed'] += 10
    r['name'] = f"{r['config']},seed={r['seed']}"
    r['val_ppl_final'] += 1.0
  for f, study in (('a.json', first), ('b.json', second)):
    (tmp_path / f).write_text(json.dumps(study))
  res = R.main(['--out', str(tmp_path / 'joined'), str(tmp_path / 'a.json'),
                str(tmp_path / 'b.json')])
  assert len(res['runs']) == 2 * len(first['runs'])
  assert [c['config'] for c in res['configurations']] == [
      c['config'] for c in first['configurations']]
  for c, c1 in zip(res['configurations'], first['configurations']):
    assert c['seeds'] == c1['seeds'] + [s + 10 for s in c1['seeds']]
    assert c['val_ppl_final']['mean'] == pytest.approx(c1['val_ppl_final']['mean'] + 0.5)
  assert (tmp_path / 'joined' / 'quality.md').is_file()
  assert res['header']['failed_runs'] == []
  # A run that failed in one study and has a result in another is not reported
  # failed; a spec that both studies ran (the failed run's, again) is listed once.
  first['header']['failed_runs'] = [second['runs'][0]['name'], 'optimizer=sgd']
  (tmp_path / 'a.json').write_text(json.dumps(first))
  second['header']['runs'] = [*first['header']['runs'], 'optimizer=adamw,lr=7e-4']
  (tmp_path / 'b.json').write_text(json.dumps(second))
  res = R.main(['--out', str(tmp_path / 'joined'), str(tmp_path / 'a.json'),
                str(tmp_path / 'b.json')])
  assert res['header']['failed_runs'] == ['optimizer=sgd']
  assert res['header']['runs'] == [*first['header']['runs'], 'optimizer=adamw,lr=7e-4']
  with pytest.raises(SystemExit):
    R.main(['--out', str(tmp_path / 'twice'), str(tmp_path / 'a.json'), str(tmp_path / 'a.json')])
  # The same configuration and seed again (its pairs reordered) is refused, as
  # are studies of another setup; a diverged seed leaves the mean inf, no sd.
  again = json.loads(json.dumps(second))
  for r, r1 in zip(again['runs'], first['runs']):
    r['seed'], r['name'] = r1['seed'], f"{r['config']},again"
  with pytest.raises(ValueError, match='repeats a configuration and seed of another run'):
    R.join([first, again])
  other = json.loads(json.dumps(second))
  other['header']['batch_size'] *= 2
  with pytest.raises(ValueError, match=r"differ in their setup .*'batch_size'"):
    R.join([first, other])
  second['runs'][0]['val_ppl_final'] = second['runs'][0]['val_ppl_best'] = float('inf')
  c = R.join([first, second])['configurations'][0]
  assert c['val_ppl_final']['mean'] == float('inf') and c['val_ppl_final']['sd'] is None
  # A study directory none of whose runs finished has nothing to report.
  (tmp_path / 'empty').mkdir()
  (tmp_path / 'empty' / 'study.json').write_bytes((serial[2] / 'out' / 'study.json').read_bytes())
  with pytest.raises(ValueError, match='none of the study\'s 3 runs has finished'):
    R.from_study(tmp_path / 'empty')


@pytest.mark.slow
def test_a_run_without_a_result_is_reported_with_how_far_it_got(serial, tmp_path):
  """A run stopped partway (metrics but no summary) is failed, and the
  report says how far it got: the last update it logged and its last
  evaluation (the line the stop cut short dropped). A join keeps that for
  a run that has no result in any of its studies, and drops it where one has."""
  import shutil
  out, name = tmp_path / 'study', 'optimizer=adamw,lr=3e-3,seed=1'
  shutil.copytree(serial[2] / 'out', out, ignore=shutil.ignore_patterns('checkpoints'))
  run = out / 'runs' / name
  (run / 'summary.json').unlink()
  recs = [json.loads(line) for line in (run / 'metrics.jsonl').read_text().splitlines()]
  (run / 'metrics.jsonl').write_text(
      ''.join(json.dumps(r) + '\n' for r in recs if r['step'] <= 24) + '{"step": 26, "lo')
  finished = next(r for r in serial[0]['runs'] if r['name'] == name)
  ppl = next(e['val_ppl'] for e in finished['evals'] if e['step'] == 20)
  res = R.main(['--out', str(tmp_path / 'report'), str(out)])
  assert res['header']['failed_runs'] == [name]
  assert res['header']['last_evals'] == {
      name: {'step': 20, 'tokens': 20 * 8 * 64, 'val_ppl': ppl, 'reached': 24}}
  assert name not in [r['name'] for r in res['runs']]
  md = (tmp_path / 'report' / 'quality.md').read_text()
  assert (f"`{name}` (reached update 24 of 30; last evaluation at 20, 10.2k tokens: "
          f"perplexity {ppl:.2f})") in md
  # Joined with a study where it finished, it is neither failed nor stopped.
  done = {**serial[0], 'runs': [finished]}
  joined = R.join([R.from_study(out), done])
  assert joined['header']['failed_runs'] == [] and joined['header']['last_evals'] == {}
  # A run that never evaluated (its metrics gone) is failed with nothing more.
  (run / 'metrics.jsonl').unlink()
  assert R.from_study(out)['header']['last_evals'] == {}


def test_family_names_every_optimizer_of_the_app():
  """Every optimizer ``poetx train`` offers has a family in the reports (a
  Muon run once stopped the report with a KeyError after its training)."""
  from poetx_jax.pretrain.recipes import RECIPES
  for name in RECIPES:
    r = {'optimizer': name, 'block_size': 64}
    want = (f'{R.POET_FAMILIES[name]} B=64' if RECIPES[name].poetizes else R.FAMILIES[name])
    assert R.family(r) == want
  assert R.family({'optimizer': 'muon'}) == 'Muon'
  assert R.family({'optimizer': 'poetx-muon', 'block_size': 512}) == 'POET-X Muon B=512'
  # bf16 weights are a family of their own; records written before the field, fp32
  assert R.family({'optimizer': 'adamw', 'param_dtype': 'bfloat16'}) == 'AdamW bf16'
  assert R.family({'optimizer': 'adamw', 'param_dtype': 'float32'}) == 'AdamW'


def test_the_header_of_a_narrow_model_takes_the_runs_block_size(tmp_path):
  """The 60m model at width 256 is narrower than the default block (512): a
  study whose every run sets a block that fits is valid, and its header reads
  the runs' plans, not the base options' (whose default block does not fit).
  The merge interval is the first merging run's; a study of AdamW runs alone
  has none."""
  import types
  narrow = ['--model', '60m', '--model-overrides', 'hidden=256,mlp=768,layers=1,heads=4,kv_heads=4',
            '--data', str(tmp_path), '--out', str(tmp_path / 'out'), '--runs']
  data = types.SimpleNamespace(tokenizer=types.SimpleNamespace(vocab_size=4096),
                               train_windows=np.zeros((100, 257)), val_windows=np.zeros((10, 257)),
                               description='synthetic')
  a = compare_quality.parse_args(narrow + ['optimizer=adamw,lr=1e-3',
                                           'optimizer=poetx,block_size=256,merge_every=50'])
  h = compare_quality.header(a, data, tmp_path / 'out')
  assert h['merge_every'] == 50 and h['dense_params'] > 0
  assert compare_quality.header(compare_quality.parse_args(narrow + ['optimizer=adamw']), data,
                                tmp_path / 'out')['merge_every'] is None
  with pytest.raises(SystemExit):  # a run whose block does not fit is refused before any run
    compare_quality.parse_args(narrow + ['optimizer=poetx'])


def test_the_report_names_a_merge_interval_only_where_a_run_merges():
  h = {'model': '60m', 'dense_params': 1000, 'vocab_size': 4096, 'seq_len': 256,
       'batch_size': 64, 'steps': 10, 'tokens_per_run': 163840, 'epochs': 0.5,
       'train_tokens': 327680, 'warmup': 1, 'min_lr_ratio': 0.1, 'clip': 1.0, 'seed': 0,
       'val_tokens': 2560, 'eval_every': 5, 'device': 'cpu', 'dtype': 'float32',
       'date': 'today', 'runs': ['optimizer=adamw'], 'data': 'synthetic', 'merge_every': None}
  run = {'optimizer': 'adamw'}
  intro = '\n'.join(R._intro({'header': h, 'runs': [run]}))
  assert 'seed 0. Validation: 2,560 tokens every 5 updates' in intro and 'merges' not in intro
  intro = '\n'.join(R._intro({'header': {**h, 'merge_every': 50}, 'runs': [run]}))
  assert 'seed 0; POET-X merges every 50 updates unless a run sets merge_every. Valid' in intro
