"""Sharded training on 8 CPU devices equals one device; checkpoints move between
device counts. The cases run tests/sharded_check.py in processes of their own
(XLA's device count is fixed when jax starts)."""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import SQUARE, host_devices, overrides
from poetx_jax import sharding

HERE = pathlib.Path(__file__).resolve().parent


def _run(devices, *args):
  # PYTHONPATH: the check imports the poetx_jax of this checkout, installed or not.
  env = dict(os.environ, XLA_FLAGS=host_devices(devices),
             JAX_PLATFORMS='cpu', PYTHONPATH=str(HERE.parent))
  proc = subprocess.run([sys.executable, str(HERE / 'sharded_check.py'), *map(str, args)],
                        capture_output=True, text=True, env=env, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope='module')
def eight(tmp_path_factory):
  """sharded_check's checks on 8 devices, in one process (which starts jax
  and compiles the model's build and merge programs once for them): the
  training and placement checks (``main``), the merge programs'
  collectives and the accumulated updates; and the directory of the fsdp
  run's checkpoint."""
  ckpt = tmp_path_factory.mktemp('ck') / 'ckpt'
  return _run(8, 'eight', ckpt), ckpt


@pytest.mark.slow
@pytest.mark.parametrize('strategy', ['dp', 'dp_per_device', 'fsdp'])
def test_sharded_steps_equal_single_device(eight, strategy):
  r = eight[0]['main'][strategy]
  # Five updates with merges after the 2nd and 4th: the same losses, the same
  # permutations, and parameters that agree. Adam divides by sqrt(v): where a
  # gradient is ~0 its sign can flip with the reduction order, so a handful of
  # elements may move by up to a step; every array is >= 99% within 1e-4.
  assert r['loss_diff'] < 1e-5, r
  assert r['perm_equal'], r
  assert r['min_close_fraction'] > 0.99, r
  assert r['kernel_shards'] == (4 if strategy == 'fsdp' else 1), r
  if strategy == 'fsdp':  # on 4-way shards each moment is split as its parameter
    assert r['follows'] > 0 and r['split_otherwise'] == 0, r


@pytest.mark.slow
def test_stacked_layers_built_into_shards_train_as_on_one_device(eight):
  """scan_layers + FSDP: the stacked layers are allocated sharded and each
  layer written into its shards as built; five updates with two merges equal
  the same model on one device, and no collective gathers more than one
  layer's kernel (here half the stack: two layers)."""
  r = eight[0]['main']['fsdp_scan']
  assert r['loss_diff'] < 1e-5 and r['perm_equal'] and r['min_close_fraction'] > 0.99, r
  assert r['built_shards'] == r['kernel_shards'] == 4, r
  assert 0 < r['largest_gather_bytes'] <= r['stack_bytes'] // 2, r
  # A stacked model placed after building: the layer axis whole, its moments alike.
  assert r['placed_specs'] == [[None, 'fsdp', None], [None, 'fsdp'], [None, 'fsdp']], r


@pytest.mark.slow
def test_per_device_gradients_all_reduce_only_the_trainable_arrays(eight):
  """make_train_step(data_parallel=mesh) all-reduces the gradients as they
  are, plus the loss and the sum of the devices' loss weights (two float32
  scalars); left to the compiler, data parallelism reduces the POET
  generators' gradients as full B x B blocks."""
  per_device, auto = eight[0]['main']['dp_per_device'], eight[0]['main']['dp']
  assert per_device['all_reduce_bytes'] == per_device['trainable_bytes'] + 8, per_device
  assert auto['all_reduce_bytes'] > 1.2 * auto['trainable_bytes'], auto


@pytest.fixture(scope='module')
def four(eight):
  """sharded_check's checks on 4 devices, in one process: the 8-device
  checkpoint restored onto one of them (fsdp 1) and onto all four (fsdp 4),
  by fsdp; the fsdp meshes of 4 devices; the layouts on 2 of them. (A
  process of one device resumes an 8-device checkpoint in
  test_an_fsdp_run_resumes_on_other_device_counts.)"""
  return _run(4, 'four', eight[1], 1, 4)


@pytest.mark.slow
@pytest.mark.parametrize('devices,fsdp', [(1, 1), (4, 4)])
def test_checkpoint_from_8_devices_restores_on_fewer(four, devices, fsdp):
  r = four['restore'][str(fsdp)]
  assert r == {'step': 5, 'exact': True, 'devices': devices}, r


@pytest.mark.slow
def test_every_sharding_fsdp_mesh_of_4_devices_trains_as_one_device(four):
  """POET-X under FSDP on (data, fsdp) = (2, 2) and (1, 4), merges and
  gradient accumulation included, gives one device's losses and
  permutations."""
  r = four['meshes']
  assert sorted(r) == ['2', '4'], r
  for fsdp, got in r.items():
    assert got['loss_diff'] < 1e-5 and got['perm_equal'], (fsdp, got)


# The families in two processes, so that the suite's workers share them.
FAMILY_PARTS = (('poetx', 'poetx-muon'), ('adamw', 'muon', 'skewadam'))


def test_the_family_parts_cover_every_optimizer_once():
  from poetx_jax.pretrain.recipes import RECIPES
  assert sorted(f for part in FAMILY_PARTS for f in part) == sorted(RECIPES)


@pytest.mark.slow
@pytest.mark.parametrize('families', FAMILY_PARTS, ids='-'.join)
def test_every_optimizer_family_trains_and_resumes_on_2_devices(tmp_path, families):
  """Each optimizer of ``poetx train --optimizer`` (Muon's state holds optax
  MaskedNodes, placeholders with no array) under dp and fsdp on 2 devices,
  and resumed from 1 device onto 2 (fsdp) and from 2 onto 1 (POET-X drawing
  chunk permutations in each, POET-X Muon element ones), gives one device's
  losses and state to float32 rounding; under fsdp every optimizer moment
  is split as the parameter it follows, and some are split. (On 4 and 8
  devices: the eight-device checks and the meshes of 4.)"""
  r = _run(4, 'optimizers', tmp_path, ','.join(families))
  cases = [f'{f} {c}' for f in families for c in ('dp 2', 'fsdp 2', 'resume 2->1')]
  cases += [f'{f} resume 1->2' for f in families if f != 'poetx-muon']
  cases += ['muon scan lean fsdp 2'] * ('muon' in families)
  assert sorted(r) == sorted(cases), sorted(r)
  for case, got in r.items():
    assert got['loss_diff'] < 1e-5 and got['min_close_fraction'] > 0.99, (case, got)
    assert got['follows'] > 0 and got['split_otherwise'] == 0, (case, got)
    sharded = 'fsdp' in case or '1->2' in case
    assert (got['split'] > 0) == sharded, (case, got)
    family = case.split()[0]
    assert got.get('chunk_drawn', False) == (family == 'poetx'), (case, got)
    assert ('chunk_drawn' in got) == (family in ('poetx', 'poetx-muon')), (case, got)


def test_state_leaves_that_are_not_arrays_stay_as_they_are():
  """shard_state places the arrays of an optimizer whose state holds optax's
  MaskedNode (a masked transformation's placeholder) and keeps the
  placeholders."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
  tx = optax.masked(optax.adam(1e-3), lambda p: jax.tree.map(lambda x: x.ndim == 2, p))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  mesh = sharding.make_mesh()
  sharding.shard_state(opt, mesh, 'fsdp')
  values = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(opt))]
  assert any(isinstance(x, optax.MaskedNode) for x in values)
  arrays = [x for x in values if sharding.is_array(x)]
  assert arrays and all(x.sharding.mesh == mesh for x in arrays)
  assert not sharding.is_array(optax.MaskedNode()) and sharding.is_array(jnp.ones(2))


def test_per_device_gradients_refuse_aux():
  import poetx_jax
  with pytest.raises(ValueError, match='data_parallel does not take has_aux'):
    poetx_jax.make_train_step(lambda m, b: (0.0, {}), has_aux=True,
                              data_parallel=sharding.make_mesh())


def test_per_device_gradients_refuse_a_loss_that_writes_other_state():
  """The data-parallel step returns only the loss and the gradients, so a
  loss that writes batch statistics or RNG counters is refused by name, at
  trace time, with the model left as it was."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  import poetx_jax

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(16, 32, rngs=rngs)
      self.bn = nnx.BatchNorm(32, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.drop(self.bn(self.lin(x)))

  model = poetx_jax.poetize(Net(nnx.Rngs(0)), block_size=4, rngs=nnx.Rngs(1))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  step = poetx_jax.make_train_step(lambda m, x: jnp.mean(m(x) ** 2),
                                   data_parallel=sharding.make_mesh())
  def values(m):  # numpy copies; keys as their data
    return jax.tree.map(lambda a: np.array(jax.random.key_data(a) if jax.dtypes.issubdtype(
        a.dtype, jax.dtypes.prng_key) else a), nnx.to_pure_dict(nnx.state(m)))

  before = values(model)
  with pytest.raises(ValueError, match=r'not an nnx.Param.*: bn/mean, bn/var, drop/rngs/count \('):
    step(model, optimizer, jnp.ones((8, 16)))
  jax.tree.map(np.testing.assert_array_equal, values(model), before)


def test_mesh_and_spec_rules():
  assert sharding.array_spec((64, 128), 'fsdp', 4) == sharding.P(None, 'fsdp')
  assert sharding.array_spec((6,), 'fsdp', 4) == sharding.P()
  assert sharding.array_spec((298, 32), 'fsdp', 4) == sharding.P()  # odd vocabulary
  assert sharding.array_spec((64, 128), 'dp', 4) == sharding.P()
  with pytest.raises(ValueError, match='strategy must be one of'):
    sharding.array_spec((4,), 'tp', 2)
  # Stacked arrays: the layer axis whole, the most major divisible dimension split.
  spec = lambda shape, strategy='fsdp': sharding.array_spec(shape, strategy, 4, stacked=True)
  assert spec((80, 8192, 28672)) == sharding.P(None, 'fsdp', None)  # not the largest
  assert spec((8, 6, 128)) == sharding.P(None, None, 'fsdp')
  assert spec((8, 6)) == spec((8,)) == spec((8, 64), 'dp') == sharding.P()
  with pytest.raises(ValueError, match='strategy must be one of'):
    spec((4, 4), 'tp')
  with pytest.raises(ValueError, match='fsdp=3 must be >= 1 and divide'):
    sharding.make_mesh(fsdp=3)


def _train(devices, args):
  """``poetx train ARGS`` in a process with ``devices`` CPU devices (not waited for)."""
  env = dict(os.environ, XLA_FLAGS=host_devices(devices),
             JAX_PLATFORMS='cpu')
  return subprocess.Popen([sys.executable, '-m', 'poetx_jax.pretrain.cli', 'train', *args,
                           '--plot', ''],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _records(run):
  recs = [json.loads(l) for l in (run / 'metrics.jsonl').read_text().splitlines()]
  return {(r['step'], k): r[k] for r in recs for k in ('loss', 'val_loss') if k in r}


@pytest.mark.slow
def test_an_fsdp_run_resumes_on_other_device_counts(tmp_path):
  """``poetx train`` on 8 devices, a (data, fsdp) = (2, 4) mesh, resumes on
  1 device (its fsdp lowered to 1, saying so) and on 4 (a (1, 4) mesh), from
  its step 3, across merges, with the losses of the uninterrupted run: the
  records up to the checkpoint as they were, those after it within float32
  rounding (not bit for bit: the meshes split the reductions otherwise;
  ~1e-6 here). (dp over several devices: test_multiprocess.)"""
  corpus = tmp_path / 'c.txt'
  corpus.write_text(' '.join(f'word{i % 37} and more text' for i in range(3000)))
  run = tmp_path / 'run'
  # Every POET layer 32 x 32: one merge program per mesh and few programs to
  # build the model, in each of the three processes.
  proc = _train(8, ['--model-overrides', overrides(SQUARE),
                    '--data', str(corpus), '--vocab-size', '300', '--seq-len', '32',
                    '--batch-size', '8', '--steps', '6', '--block-size', '8',
                    '--dtype', 'float32', '--merge-every', '2', '--log-every', '1',
                    '--eval-every', '3', '--eval-batches', '2', '--checkpoint-every', '3',
                    '--strategy', 'fsdp', '--fsdp', '4', '--cache-dir', str(tmp_path / 'cache'),
                    '--out-dir', str(run)])
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]
  assert "mesh: {'data': 2, 'fsdp': 4}, strategy fsdp" in out
  assert 'validation perplexity:' in out
  want = _records(run)
  assert len(want) == 6 + 3  # losses 1..6, validations 0, 3, 6
  procs = {}
  for devices in (1, 4):
    shutil.copytree(run, tmp_path / f'on{devices}')
    procs[devices] = _train(devices, ['--resume', '--step', '3',
                                      '--out-dir', str(tmp_path / f'on{devices}')])
  outs = {d: p.communicate(timeout=600) for d, p in procs.items()}
  for d, p in procs.items():
    assert p.returncode == 0, outs[d][1][-3000:]
  assert ("--resume: the run's fsdp=4 does not divide the 1 device(s) present: "
          'continuing with fsdp=1' in outs[1][0])
  assert "mesh: {'data': 1, 'fsdp': 4}, strategy fsdp" in outs[4][0]
  for d in (1, 4):
    got = _records(tmp_path / f'on{d}')
    assert sorted(got) == sorted(want), d
    assert json.loads((tmp_path / f'on{d}' / 'run.json').read_text())['fsdp'] == d
    # Up to the checkpoint, the records kept; after it, float32 rounding.
    assert all(got[k] == want[k] for k in want if k[0] <= 3), d
    np.testing.assert_allclose([got[k] for k in sorted(want)],
                               [want[k] for k in sorted(want)], rtol=1e-5, err_msg=str(d))


def test_resume_may_change_the_layout(tmp_path):
  """strategy and fsdp say how the state is laid out, not what is trained:
  --resume takes them given, and fits a saved fsdp to the devices present."""
  from poetx_jax.pretrain import options, rundir
  from poetx_jax.pretrain.config import TrainConfig
  run = tmp_path / 'run'
  run.mkdir()
  saved = TrainConfig(strategy='fsdp', fsdp=4, out_dir=str(run))
  (run / 'run.json').write_text(json.dumps(dataclasses.asdict(saved)))
  logged = []
  now = options.resumed_options(TrainConfig(out_dir=str(run)), {'out_dir'}, device_count=8,
                             log=logged.append)
  assert (now.strategy, now.fsdp, logged) == ('fsdp', 4, [])  # fits: kept
  now = options.resumed_options(TrainConfig(out_dir=str(run)), {'out_dir'}, device_count=6,
                             log=logged.append)
  assert now.fsdp == 3 and logged == [
      "--resume: the run's fsdp=4 does not divide the 6 device(s) present: continuing "
      'with fsdp=3 (the layout may change on resume; --fsdp N chooses another)']
  given = TrainConfig(strategy='dp', fsdp=2, out_dir=str(run))
  now = options.resumed_options(given, {'strategy', 'fsdp'}, device_count=6)
  assert (now.strategy, now.fsdp) == ('dp', 2)
  rundir._check_resumable(run / 'run.json', now)  # pylint: disable=protected-access
  with pytest.raises(rundir.CheckpointError, match='differs'):
    rundir._check_resumable(run / 'run.json',  # pylint: disable=protected-access
                            dataclasses.replace(now, seed=1))


def test_collective_bytes_counts_outputs_once():
  """An asynchronous collective counts at its -done (the -start tuple holds the
  operand too); sizes follow the element width, sub-byte types packed."""
  hlo = '''
  %ags = (f32[1,8]{1,0}, f32[8,8]{1,0}) all-gather-start(f32[1,8]{1,0} %p), dimensions={0}
  %agd = f32[8,8]{1,0} all-gather-done((f32[1,8]{1,0}, f32[8,8]{1,0}) %ags)
  %ar = bf16[16]{0} all-reduce(bf16[16]{0} %x), to_apply=%add
  %cps = (s4[64]{0}, s4[64]{0}, u32[], u32[]) collective-permute-start(s4[64]{0} %y)
  %cpd = s4[64]{0} collective-permute-done((s4[64]{0}, s4[64]{0}, u32[], u32[]) %cps)
  %rs = pred[10]{0} reduce-scatter(pred[80]{0} %z), dimensions={0}
  %add.1 = f32[8]{0} add(f32[8]{0} %a, f32[8]{0} %b)'''
  assert sharding.collective_bytes(hlo) == {
      'all-gather': 8 * 8 * 4, 'all-reduce': 16 * 2, 'collective-permute': 64 // 2,
      'reduce-scatter': 10}


@pytest.mark.slow
def test_accumulated_updates_cross_devices_once(eight):
  """make_train_step(accumulate=4) under data_parallel on 8 devices
  and fully_sharded on fsdp meshes of 2 and 2 x 4: 5 updates of 4
  micro-batches (unequal target counts, merges included) give one device's
  updates to float32 rounding. Under dp the update program holds one
  all-reduce, outside any loop, of the trainable arrays plus two float32
  scalars (the loss and weight sums), not one per micro-batch. Under fsdp
  (every trainable array sharded) the trainable arrays cross twice an
  update, outside the loop, each at its own size: one all-gather each
  before the micro-batches, one reduce-scatter each after them (on the
  2 x 4 mesh then one all-reduce of the shards over ``data``); inside the
  loop only the frozen bases are gathered, once per micro-batch.
  collective_sites finds a psum inside a scan, run once per iteration."""
  r = eight[0]['accumulate']
  size, arrays = r['trainable_bytes'], r['trainable_arrays']
  for n in ('8', 'fsdp 2', 'fsdp 2x4'):
    got = r[n]
    assert (got['loss_diff'] < 1e-5 and got['min_close_fraction'] > 0.99
            and got['perm_equal']), (n, got)
  assert r['8']['sites'] == [['all-reduce', size + 8, False, 1]], r['8']
  for n, data, fsdp in (('fsdp 2', 1, 2), ('fsdp 2x4', 2, 4)):
    sites = r[n]['sites']
    assert r[n]['replicated_arrays'] == 0, r[n]  # each trainable array is split
    once = lambda kind: [b for k, b, loop, trips in sites  # noqa: E731
                         if k == kind and not loop and trips == 1]
    assert len(once('all-gather')) == arrays and sum(once('all-gather')) == size, sites
    assert (len(once('reduce-scatter')) == arrays
            and sum(once('reduce-scatter')) * fsdp == size), sites
    assert sum(once('all-reduce')) == 8 + (size // fsdp if data > 1 else 0), sites
    looped = [s for s in sites if s[2]]
    assert looped and all(k == 'all-gather' and trips == 4 for k, _, _, trips in looped), sites
    assert len(sites) == len(looped) + 2 * arrays + len(once('all-reduce')), sites
  assert r['control'] == [['all-reduce', 2 * 5 * 4, True, 3]], r['control']  # 3 iterations


@pytest.mark.slow
def test_merges_under_dp_send_nothing_and_a_stack_merges_a_layer_at_a_time(eight):
  """cycle.merge_collectives reads the merge programs: with the state
  replicated (dp) every device draws the same permutations from the same key
  and merges on its own, no collective; under fsdp each layer merges on its
  shards (the unstacked layers' shards of 8 rows are narrower than a block
  of 16): its two packed generators are gathered, and two all-to-alls of
  one shard re-split the base and restore it, nothing else crossing (a
  stack's layers one at a time), giving one device's merged state."""
  r = eight[0]['merges']
  assert len(r['dp']) == 7 and all(x['collectives'] == 0 for x in r['dp']), r['dp']
  # a shard: a quarter of a layer's base (an eighth of the stack of two)
  for name, shard in (('fsdp', 4), ('fsdp scan', 8)):
    for x in r[name]:
      assert x['kinds'] == ['all-gather', 'all-to-all'] and x['collectives'] == 4, x
      assert x['all_to_all'] == [x['base_bytes'] // shard] == [x['largest']], x
  for scan in ('False', 'True'):  # the same merge as one device's
    v = r[f'values scan={scan}']
    assert v['ints_equal'] and v['largest_diff'] < 1e-6 and v['error_diff'] < 1e-6, v


@pytest.mark.slow
def test_the_step_keeps_the_state_where_it_was_placed(four):
  """AdamW with its parameters whole on each of 2 devices and its moments
  split (ZeRO stage 1): after three updates the parameters are still whole
  and the moments still split (left to the compiler, the parameters came
  back split like the moments), and the run equals the fully replicated one."""
  r = four['layouts']
  assert r['param_specs'] == ['()'], r
  assert r['moment_specs'] == ["('fsdp', None)", "(None, 'fsdp')"], r
  assert r['loss_diff'] < 1e-6 and r['param_diff'] < 1e-6, r
