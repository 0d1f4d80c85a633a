"""experiments/comm_model.py reads a run's collectives from its compiled
programs on simulated devices (the scaling page: test_study_pages.py)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
from experiments import comm_model


TINY = ['--model', 'tiny', '--model-overrides', 'layers=1,mlp=64', '--seq-len', '32',
        '--vocab-size', '512', '--dtype', 'float32', '--devices', '2', '--per-device-batch', '1']


def _comm_model(*args, timeout=900):
  """experiments.comm_model run with ``args`` in a fresh process (it asks XLA
  for its simulated devices before jax starts)."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)
  return subprocess.run([sys.executable, '-m', 'experiments.comm_model', *map(str, args)],
                        capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def test_allreduce_time_and_efficiencies():
  links = dict(gpus_per_node=8, nvlink_gbs=400.0, net_gbs=50.0)
  # 2 GPUs of one node: each sends and receives S once, over NVLink
  assert comm_model.allreduce_s(4e9, 2, **links) == pytest.approx(4e9 / 400e9)
  # 64 GPUs in 8 nodes: 2 * 7/8 S over NVLink, 2 * 7/8 S / 8 over the network
  assert comm_model.allreduce_s(4e9, 64, **links) == pytest.approx(
      2 * 7 / 8 * 4e9 / 400e9 + 2 * 7 / 8 * 0.5e9 / 50e9)
  # an all-to-all of R bytes a GPU on 64: 7/64 R to its node, 56/64 R out of it
  assert comm_model.alltoall_s(4e9, 64, **links) == pytest.approx(
      7 / 64 * 4e9 / 400e9 + 56 / 64 * 4e9 / 50e9)
  assert comm_model.alltoall_s(4e9, 2, **links) == pytest.approx(4e9 / 2 / 400e9)
  assert comm_model.efficiency(0.1, 0.02) == pytest.approx((0.1 / 0.12, 1.0))
  assert comm_model.efficiency(0.1, 0.2) == pytest.approx((0.1 / 0.3, 0.5))


@pytest.fixture(scope='module')
def comm(tmp_path_factory):
  """One comm_model run (one process; the runs' records are independent) on
  2 simulated devices, with one-GPU step records to project from: tiny
  POET-X with 3 micro-batches an update under dp and fsdp, merging every 2
  updates; AdamW with 2, its state replicated and its moments split (ZeRO
  stage 1). Its record's results."""
  tmp_path = tmp_path_factory.mktemp('comm')
  steps = tmp_path / 'steps.json'
  steps.write_text(json.dumps([{'run': 'poet', 'step_s': 0.01, 'batch': 2, 'seq_len': 32,
                                'round': 0},
                               {'run': 'poet', 'step_s': 0.03, 'batch': 2, 'seq_len': 32,
                                'round': 1},
                               {'run': 'adamw', 'step_s': 0.01, 'batch': 2, 'seq_len': 32,
                                'round': 0}]))  # adamw-zero1 takes adamw's one-GPU step
  out = tmp_path / 'comm.json'
  proc = _comm_model(*TINY, '--grad-accum', '3', '--merge-every', '2',
                     '--run', 'poet:optimizer=poetx', '--run', 'poet-fsdp:optimizer=poetx,strategy=fsdp',
                     '--run', 'adamw:optimizer=adamw,grad_accum=2',
                     '--run', 'adamw-zero1:optimizer=adamw,optimizer_state=sharded,grad_accum=2',
                     '--step-record', steps, '--gpus', '8,64', '--accum', '3', '--json', out)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rec = json.loads(out.read_text())
  assert rec['header']['command'].startswith('python3 -m experiments.comm_model --model tiny')
  return rec['results']


@pytest.mark.slow
def test_a_data_parallel_update_sends_its_trained_arrays_once(comm):
  """A tiny POET-X run with 3 micro-batches an update on 2 simulated
  devices: dp all-reduces the trained arrays (and two scalars) once per
  update and its merges send nothing; fsdp gathers and reduce-scatters the
  trained arrays once an update and gathers the frozen bases each
  micro-batch; the projection uses the step record of its run label (under
  fsdp, of the label without '-fsdp')."""
  rec = comm
  dp = [r for r in rec['records'] if r['run'] == 'poet']
  assert [r['devices'] for r in dp] == [2]
  for r in dp:
    assert r['grad_accum'] == 3 and r['merge_bytes'] == {}
    assert r['update_bytes'] == {'all-reduce': r['trainable_bytes'] + 8}, r  # float32
    assert r['gpu_allreduce_bytes'] == r['trainable_bytes'] + 8
  (fsdp,) = [r for r in rec['records'] if r['run'] == 'poet-fsdp']
  got = fsdp['update_bytes']
  assert set(got) == {'all-gather', 'reduce-scatter', 'all-reduce'} and fsdp['merge_bytes'], got
  assert got['reduce-scatter'] * 2 == fsdp['trainable_bytes'], got  # each device keeps half
  frozen = fsdp['frozen_gather_bytes_per_microbatch']
  assert frozen > 0 and got['all-gather'] == fsdp['trainable_bytes'] + 3 * frozen, fsdp
  proj = [p for p in rec['projection'] if p['run'].startswith('poet')]
  assert [(p['run'], p['gpus'], p['grad_accum']) for p in proj] == [
      ('poet', 8, 3), ('poet', 64, 3), ('poet-fsdp', 8, 3), ('poet-fsdp', 64, 3)]
  assert all(p['projected'] for p in proj)
  assert proj[0]['compute_ms'] == proj[2]['compute_ms'] == pytest.approx(3 * 20.0)  # medians
  assert proj[0]['frozen_gather_mib'] == 0 and proj[0]['merge_ms_per_update'] == 0
  assert proj[2]['frozen_gather_mib'] == pytest.approx(3 * frozen / 2 ** 20)
  assert proj[3]['comm_ms'] > proj[2]['comm_ms'] > 0 and proj[2]['merge_ms_per_update'] > 0


def test_optimizer_state_key_is_read_and_checked():
  from experiments import harness
  (run,) = harness.expand_all(['z:optimizer=adamw,optimizer_state=sharded,lr=1e-3'])
  bare, sharded = comm_model.state_option(run)
  assert sharded and bare.pairs == (('optimizer', 'adamw'), ('lr', '1e-3'))
  (run,) = harness.expand_all(['r:optimizer=adamw,optimizer_state=replicated'])
  assert comm_model.state_option(run)[1] is False
  (run,) = harness.expand_all(['b:optimizer=adamw,optimizer_state=split'])
  with pytest.raises(ValueError, match="optimizer_state='split'; valid: replicated, sharded"):
    comm_model.state_option(run)
  # sharded beside fsdp (here the base options' strategy) is refused before any compile
  proc = _comm_model(*TINY, '--strategy', 'fsdp', '--run', 'plain:optimizer=adamw',
                     '--run', 'f:optimizer=adamw,optimizer_state=sharded', timeout=300)
  assert proc.returncode == 2 and 'compiling' not in proc.stderr, proc.stderr[-2000:]
  assert ('--run f: optimizer_state=sharded is a data-parallel placement; strategy=fsdp'
          in proc.stderr), proc.stderr[-2000:]


@pytest.mark.slow
def test_a_sharded_optimizer_state_adds_one_gather_of_the_parameters(comm):
  """AdamW on 2 simulated devices with its moments split (ZeRO stage 1):
  the update all-reduces the gradients once and all-gathers exactly the
  trained arrays once, and the parameters stay whole on each device (the
  step keeps the state's placement); the projection adds the gather to the
  replicated run's all-reduce."""
  rec = comm
  plain, zero1 = [r for r in rec['records'] if r['run'].startswith('adamw')]
  assert plain['grad_accum'] == zero1['grad_accum'] == 2
  assert plain['optimizer_state'] == 'replicated' and zero1['optimizer_state'] == 'sharded'
  trained = zero1['trainable_bytes']
  assert plain['trainable_bytes'] == trained
  assert plain['update_bytes'] == {'all-reduce': trained + 8} and plain['param_gather_bytes'] == 0
  assert zero1['update_bytes'] == {'all-reduce': trained + 8, 'all-gather': trained}, zero1
  assert zero1['param_gather_bytes'] == trained and zero1['gpu_allreduce_bytes'] == trained + 8
  p_plain, p_zero1 = [p for p in rec['projection'] if p['run'].startswith('adamw')
                      and p['gpus'] == 8]
  assert p_zero1['param_gather_mib'] == pytest.approx(trained / 2 ** 20)
  gather_s = comm_model.allreduce_s(trained, 8, **rec['links']) / 2
  assert 1e-3 * (p_zero1['comm_ms'] - p_plain['comm_ms']) == pytest.approx(gather_s)
