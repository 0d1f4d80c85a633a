"""Run by tests/test_sharding.py in processes of CPU devices: ``eight`` (8
devices: ``main``, ``merges`` and ``accumulate`` in one process, so that they
start jax and compile the model's build and merge programs once), ``four``
(4: ``restore``, ``meshes`` and ``layouts``) and ``optimizers`` (4)."""

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import poetx_jax
from poetx_jax import perms as perms_module
from poetx_jax import sharding
from poetx_jax.pretrain import evaluation, factories
from poetx_jax.pretrain import loss as loss_lib
from poetx_jax.pretrain.checkpoint import Checkpointer
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.plan import make_plan
from poetx_jax.pretrain.recipes import RECIPES

# One layer of 32 x 32 projections: one merge program per run. The stacked
# runs are wider, so that half their MLP stack outweighs the embedding, which
# FSDP gathers whole.
SHAPE = dict(layers=1, hidden=32, mlp=32, heads=2, kv_heads=2)
STACKED = dict(layers=2, hidden=64, mlp=128, heads=4, kv_heads=2)
VOCAB = 128


def train_config(scan=False, strategy='dp') -> TrainConfig:
  """The run: POET-X (Adam on the generators) on the tiny POET Llama of ``SHAPE`` (``scan``: of ``STACKED``, its
  two layers stacked) at B = 16, merging every 2 updates, at constant rates
  (no warmup, no decay, no clipping)."""
  cfg = TrainConfig(model='tiny', model_overrides=STACKED if scan else SHAPE, optimizer='poetx',
                    scan_layers=scan, block_size=16, poet_lr=2e-2, lr=3e-3, warmup=0,
                    min_lr_ratio=1.0, clip=0.0, merge_every=2, batch_size=8, seq_len=16,
                    dtype='float32', strategy=strategy)
  cfg.validate()
  return cfg


def build(scan=False, mesh=None, strategy='dp'):
  """The POET Llama and its optimizer as ``poetx train`` builds them
  (``factories.build_state``), placed on ``mesh`` by ``strategy``."""
  cfg = train_config(scan, strategy)
  return factories.build_state(make_plan(cfg, VOCAB), mesh)


def built_shards(mesh) -> int:
  """Shards of the stacked MLP kernel as ``factories.build_model`` allocates
  it under FSDP on ``mesh`` (each layer written into them as it is built)."""
  cfg = train_config(scan=True, strategy='fsdp')
  model = factories.build_model(make_plan(cfg, VOCAB), mesh)
  return len({s.index for s in model.layers.layer.mlp.up_proj.kernel[...].addressable_shards})


def loss_fn(m, b):
  """The mean over unmasked (>= 0) targets, as ``poetx train`` computes it."""
  total, count, _ = loss_lib.token_loss(m, b)
  return total / count


def batches():
  """Random tokens; rows 0 and 1 have most of their targets masked, so the
  devices' rows hold unequal numbers of targets."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(5):
    b = {k: rng.integers(0, 128, (8, 16)).astype(np.int32) for k in ('inputs', 'targets')}
    b['targets'][:2, 3:] = -1
    out.append(b)
  return out


def run(mesh=None, strategy=None, scan=False):
  """5 updates (merges after the 2nd and 4th); strategy 'dp_per_device' is
  'dp' with make_train_step(data_parallel=mesh). Also returns the bytes the
  update program all-reduces and the trainable bytes. With ``scan`` and
  'fsdp' the stacked layers are built into their shards."""
  if scan and strategy == 'fsdp':
    run.built_shards = built_shards(mesh)
  model, opt = build(scan, mesh, 'fsdp' if strategy == 'fsdp' else 'dp')
  per_device = strategy == 'dp_per_device'
  step = poetx_jax.make_train_step(loss_fn, seed=0, data_parallel=mesh if per_device else None,
                                   loss_weight=loss_lib.target_count if per_device else None)
  losses = []
  for b in batches():
    b = sharding.shard_batch(b, mesh) if mesh is not None else jax.tree.map(jnp.asarray, b)
    losses.append(float(step(model, opt, b)))
  reduced = None
  if mesh is not None:
    hlo = step.lower(model, opt, b).compile().as_text()
    reduced = sharding.collective_bytes(hlo).get('all-reduce', 0)
    run.largest_gather = max([sharding.collective_bytes(l).get('all-gather', 0)
                              for l in hlo.splitlines() if 'all-gather' in l] + [0])
  trainable = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return model, opt, losses, reduced, trainable


def flat(node):
  return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(node)))]


def main(ckpt_dir):
  out = {}
  ref_model, _, ref_losses, _, _ = run()
  ref = flat(ref_model)
  for strategy, (d, f) in (('dp', (8, 1)), ('dp_per_device', (4, 2)), ('fsdp', (2, 4))):
    mesh = sharding.make_mesh(d, f)
    model, opt, losses, reduced, trainable = run(mesh, strategy)
    kernel = model.layers[0].mlp.up_proj.kernel[...]
    out[strategy] = {
        'loss_diff': max(abs(a - b) for a, b in zip(losses, ref_losses)),
        'param_diff': max(float(np.max(np.abs(a.astype(np.float64) - b)))
                          for a, b in zip(flat(model), ref)),
        'kernel_shards': len({s.index for s in kernel.addressable_shards}),
        'all_reduce_bytes': reduced, 'trainable_bytes': trainable,
        'perm_equal': bool(all(np.array_equal(a, b) for a, b in zip(
            [x for x in flat(model) if x.dtype == np.int32],
            [x for x in ref if x.dtype == np.int32]))),
    }
    close = [np.mean(np.abs(a.astype(np.float64) - b) <= 1e-4) for a, b in zip(flat(model), ref)
             if a.dtype.kind == 'f']
    out[strategy]['min_close_fraction'] = float(min(close))
    if strategy == 'fsdp':
      # Adam's moments on 4-way shards: each split as the parameter it follows.
      out[strategy]['follows'], out[strategy]['split_otherwise'] = _follows(model, opt)
      with Checkpointer(ckpt_dir) as ck:
        ck.save(5, model, opt, data_state={}, meta={})
      np.savez(f'{ckpt_dir}.npz', *flat(model), *flat(opt))
  # Stacked layers built straight into 4 shards, trained with FSDP: the same
  # as the stacked model on one device, never gathering the whole stack.
  ref_model, _, ref_losses, _, _ = run(scan=True)
  ref = flat(ref_model)
  model, _, losses, _, _ = run(sharding.make_mesh(2, 4), 'fsdp', scan=True)
  stack = model.layers.layer.mlp.up_proj.kernel[...]
  close = [np.mean(np.abs(a.astype(np.float64) - b) <= 1e-4) for a, b in zip(flat(model), ref)
           if a.dtype.kind == 'f']
  out['fsdp_scan'] = {
      'loss_diff': max(abs(a - b) for a, b in zip(losses, ref_losses)),
      'min_close_fraction': float(min(close)),
      'perm_equal': bool(all(np.array_equal(a, b) for a, b in zip(
          [x for x in flat(model) if x.dtype == np.int32],
          [x for x in ref if x.dtype == np.int32]))),
      'built_shards': run.built_shards,
      'kernel_shards': len({s.index for s in stack.addressable_shards}),
      'largest_gather_bytes': run.largest_gather, 'stack_bytes': stack.nbytes,
  }
  # Built unsharded, then placed: stacked arrays and their optimizer moments
  # split like a build with placement (the layer axis whole).
  mesh = sharding.make_mesh(2, 4)
  model, opt = build(scan=True)
  sharding.shard_state(model, mesh, 'fsdp')
  sharding.shard_state(opt, mesh, 'fsdp')
  norm = model.layers.layer.input_layernorm.weight
  mu = dict(nnx.iter_graph(opt))[('opt_state', 'inner_states', 'other', 'inner_state', 0, 'mu',
                                  'layers', 'layer', 'input_layernorm', 'weight')]
  out['fsdp_scan']['placed_specs'] = [
      list(x.sharding.spec) for x in (model.layers.layer.mlp.up_proj.kernel[...], norm[...],
                                      mu[...])]
  return out


def restore(ckpt_dir, fsdp):
  """Restores the 8-device checkpoint onto this process's devices (fsdp 1:
  onto one of them); exact?"""
  mesh = sharding.make_mesh(len(jax.devices()) // fsdp, fsdp) if fsdp > 1 else None
  model, opt = build(mesh=mesh, strategy='fsdp')
  step, _, _ = Checkpointer(ckpt_dir).restore(model, opt)
  saved = np.load(f'{ckpt_dir}.npz')
  got = flat(model) + flat(opt)
  exact = all(np.array_equal(saved[f'arr_{i}'], g) for i, g in enumerate(got))
  kernel = model.layers[0].mlp.up_proj.kernel[...]
  return {'step': step, 'exact': bool(exact), 'devices': len(kernel.sharding.device_set)}


def meshes():
  """The (data, fsdp) meshes of this process's devices that shard the state
  (fsdp > 1) under FSDP, against one device: the model of ``SHAPE`` at its
  block size 16, two updates of two micro-batches each (one call of the
  step each, the micro-batches stacked), each update a merge. Each mesh's
  losses' largest distance from one device's, and whether the permutations
  match."""
  cfg = TrainConfig(model='tiny', model_overrides=SHAPE, optimizer='poetx', batch_size=8,
                    seq_len=16, grad_accum=2, merge_every=1, warmup=0, dtype='float32', strategy='fsdp')
  batches = [{k: np.random.default_rng(i).integers(0, VOCAB, (8, 16)).astype(np.int32)
              for k in ('inputs', 'targets')} for i in range(4)]

  def train(fsdp):
    c = dataclasses.replace(cfg, fsdp=fsdp)
    plan = make_plan(c, VOCAB)
    mesh = sharding.make_mesh(fsdp=fsdp) if fsdp else None
    model, opt = factories.build_state(plan, mesh)
    merges = []
    step = factories.make_step(plan, on_merge=lambda *m: merges.append(m[0]), mesh=mesh)
    updates = [{k: np.stack([a[k] for a in batches[u:u + 2]]) for k in batches[0]}
               for u in (0, 2)]
    losses = [float(step(model, opt, evaluation.place_batch(b, mesh, axis=1))) for b in updates]
    assert merges == [2, 4], merges  # reported at the micro-batches trained
    return losses, [x for x in flat(model) if x.dtype == np.int32]

  ref, ref_perms = train(None)
  out = {}
  for fsdp in (2, 4):  # fsdp 1 replicates the state as dp does (the 8-device checks)
    if len(jax.devices()) % fsdp == 0:
      losses, perms = train(fsdp)
      out[fsdp] = {'loss_diff': max(abs(a - b) for a, b in zip(losses, ref)),
                   'perm_equal': all(np.array_equal(a, b) for a, b in zip(perms, ref_perms))}
  return out


def _spec(x) -> tuple:
  """The partition spec of an array (one device's: ())."""
  return tuple(getattr(x.sharding, 'spec', ()))


def _specs(node) -> dict[tuple, tuple]:
  """The partition spec of every array of ``node`` by its state path."""
  return {path: _spec(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(node))
          if sharding.is_array(v.get_value())}


def _follows(model, opt) -> tuple[int, int]:
  """(optimizer arrays shaped like the parameter whose path ends theirs, those
  of them split otherwise than it): a moment is placed as its parameter."""
  params = {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  values = {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(opt))}
  specs = _specs(opt)
  pairs = [(p, o) for o in specs for p in params
           if o[-len(p):] == p and values[o].shape == params[p].shape]
  return len(pairs), sum(specs[o] != _spec(params[p]) for p, o in pairs)


# Every family runs dp and fsdp on 2 devices (on 4 the state is split by the
# same rule: every dimension the rule picks here is divisible by 2 and 4 alike;
# POET-X on 4 and 8 devices: the meshes and eight-device checks, whose fsdp
# (2, 4) case checks the moments follow their parameters on 4-way shards).
# poetx-muon's state is poetx's (a moment shaped like each generator, the
# cycle) with no second moment: the resume onto 2 devices adds nothing for it
# that poetx's does not check, so it is resumed from fsdp 2 onto one device only.
NOT_RESUMED_ONTO_TWO = ('poetx-muon',)
# POET-X draws chunk permutations (runs of 4 in blocks of 16) in each of its
# cases; poetx-muon draws element permutations (the default), as the
# eight-device, meshes and command-line checks do.
FAMILY_OPTIONS = {'poetx': dict(permutation='chunk', chunk_size=4)}


def optimizers(ckpt_dir, families):
  """The optimizer families ``families`` of ``poetx train`` (recipes.RECIPES,
  with ``FAMILY_OPTIONS``: POET-X drawing chunk permutations) on 2 of this
  process's devices, by dp and by fsdp (fsdp 2), and resumed across device
  counts (a checkpoint of step 2 of one device restored onto fsdp 2, one of
  fsdp 2 onto one device), against the same run on one device: 4 updates
  (POET-X merging after the 2nd and 4th); and Muon with scan_layers and
  lean_state under fsdp on 2 devices (with muon). For each: the largest
  distance of the losses from one device's, the smallest fraction of each
  array's elements within 1e-4 of one device's, the optimizer arrays shaped
  like their parameter (``_follows``) and how many of them are split
  otherwise, and for the POET families whether every permutation is a chunk
  permutation (``chunk_drawn``)."""
  batches = [{k: np.random.default_rng(i).integers(0, VOCAB, (8, 16)).astype(np.int32)
              for k in ('inputs', 'targets')} for i in range(4)]
  devices = jax.devices()
  # A resumed run's programs are those of a fresh run on its devices: loaded.
  jax.config.update('jax_compilation_cache_dir', f'{ckpt_dir}/xla')
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)

  def config(family, strategy='dp', fsdp=1, **extra):
    poet = dict(block_size=16, merge_every=2) if RECIPES[family].poetizes else {}
    cfg = TrainConfig(model='tiny', model_overrides=SHAPE, optimizer=family, batch_size=8,
                      seq_len=16, warmup=0, dtype='float32', strategy=strategy, fsdp=fsdp,
                      **poet, **FAMILY_OPTIONS.get(family, {}), **extra)
    cfg.validate()
    return make_plan(cfg, VOCAB)

  step_fns = {}  # by (options, devices): a resumed run's step is its fresh run's

  def train(plan, n, steps=range(4), restore=None, save=None):
    """Trains ``steps`` on the first ``n`` devices (restored from ``restore``
    first; saved to ``save`` after the 2nd update)."""
    mesh = (sharding.make_mesh(fsdp=plan.options.fsdp, devices=devices[:n])
            if n > 1 else None)
    if restore is not None and mesh is None:  # as poetx train resumes on one device
      model, opt = factories.abstract_state(plan)
    else:
      model, opt = factories.build_state(plan, mesh)
    if restore is not None:
      Checkpointer(restore).restore(model, opt)
    key = (repr(plan.options), n)
    if key not in step_fns:
      step_fns[key] = factories.make_step(plan, mesh=mesh)
    step = step_fns[key]
    losses = []
    for i in steps:
      losses.append(float(step(model, opt, evaluation.place_batch(batches[i], mesh))))
      if save is not None and i == 1:
        with Checkpointer(save) as ck:
          ck.save(2, model, opt, data_state={}, meta={})
    return model, opt, losses

  def reference(plan):
    model, opt, losses = train(plan, 1, save=f'{ckpt_dir}/{plan.options.optimizer}-1')
    return losses, flat(model) + flat(opt)

  def compare(got, ref):
    model, opt, losses = got
    close = [float(np.mean(np.abs(a.astype(np.float64) - b) <= 1e-4))
             for a, b in zip(flat(model) + flat(opt), ref[1]) if a.dtype.kind == 'f']
    follows, split_otherwise = _follows(model, opt)
    got = {'loss_diff': max(abs(a - b) for a, b in zip(losses, ref[0][-len(losses):])),
           'min_close_fraction': min(close), 'follows': follows,
           'split_otherwise': split_otherwise,
           'split': sum('fsdp' in s for s in _specs(opt).values())}
    perms = [np.asarray(getattr(layer, side)[...]) for _, layer in poetx_jax.poet_layers(model)
             for side in ('perm_in', 'perm_out')]
    if perms:  # (an element draw of 32 features moves runs of 4 whole with odds below 1e-30)
      got['chunk_drawn'] = all(perms_module.is_chunk_permutation(q, 4) for q in perms)
    return got

  out = {}
  for family in families:
    ref = reference(config(family))
    two = f'{ckpt_dir}/{family}-2'
    for strategy in ('dp', 'fsdp'):
      plan = config(family, strategy, 2 if strategy == 'fsdp' else 1)
      out[f'{family} {strategy} 2'] = compare(
          train(plan, 2, save=two if strategy == 'fsdp' else None), ref)
    if family not in NOT_RESUMED_ONTO_TWO:
      out[f'{family} resume 1->2'] = compare(
          train(config(family, 'fsdp', 2), 2, range(2, 4), restore=f'{ckpt_dir}/{family}-1'),
          ref)
    out[f'{family} resume 2->1'] = compare(
        train(config(family), 1, range(2, 4), restore=two), ref)
  if 'muon' in families:  # Muon's stacked layers (scan_layers) with bf16 momenta under fsdp
    lean = dict(scan_layers=True, lean_state=True)
    ref = train(config('muon', **lean), 1)
    ref = (ref[2], flat(ref[0]) + flat(ref[1]))
    out['muon scan lean fsdp 2'] = compare(train(config('muon', 'fsdp', 2, **lean), 2), ref)
  json.dump(out, sys.stdout)


def accumulate():
  """make_train_step(accumulate=4) on 8 devices (data_parallel; the one
  all-reduce is the same on any device count) and on fsdp meshes of 2 and
  2 x 4 devices (fully_sharded) against one device: 5 updates of 4
  micro-batches of 8 rows (merges after the 2nd and 4th); where the update
  program's collectives are; and, as a control, a psum inside a scan."""
  k = 4
  rng = np.random.default_rng(1)
  micro = []
  for _ in range(5 * k):
    b = {n: rng.integers(0, VOCAB, (8, 16)).astype(np.int32) for n in ('inputs', 'targets')}
    b['targets'][:2, 3:] = -1  # unequal target counts per micro-batch and device
    micro.append(b)
  groups = [micro[u * k:(u + 1) * k] for u in range(5)]

  def go(mesh=None, acc=1, strategy='dp'):
    model, opt = build(mesh=mesh, strategy=strategy)
    fsdp = strategy == 'fsdp'
    step = poetx_jax.make_train_step(loss_fn, seed=0, data_parallel=None if fsdp else mesh,
                                     fully_sharded=mesh if fsdp else None, accumulate=acc,
                                     loss_weight=loss_lib.target_count)
    losses = []
    for g in groups:
      b = {n: (np.stack if acc > 1 else np.concatenate)([m[n] for m in g]) for n in g[0]}
      b = (sharding.shard_batch(b, mesh, axis=1 if acc > 1 else 0) if mesh is not None
           else jax.tree.map(jnp.asarray, b))
      losses.append(float(step(model, opt, b)))
    sites = (sharding.collective_sites(step.lower(model, opt, b).compile().as_text())
             if mesh is not None else [])
    sharded = [np.array_equal(x.sharding.shard_shape(x.shape), x.shape)
               for x in jax.tree.leaves(nnx.state(model, nnx.Param))] if fsdp else []
    return flat(model), losses, sites, sharded

  ref, ref_losses, _, _ = go(acc=k)
  model, _ = build()
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  out = {'trainable_bytes': sum(x.nbytes for x in params),
         'trainable_arrays': len(params)}
  for name, (d, f), strategy in (('8', (8, 1), 'dp'), ('fsdp 2', (1, 2), 'fsdp'),
                                 ('fsdp 2x4', (2, 4), 'fsdp')):
    mesh = sharding.make_mesh(d, f, devices=jax.devices()[:d * f])
    got, losses, sites, whole = go(mesh, k, strategy)
    out[name] = {'loss_diff': max(abs(a - b) for a, b in zip(losses, ref_losses)),
                 'min_close_fraction': min(
                     float(np.mean(np.abs(a.astype(np.float64) - b) <= 1e-4))
                     for a, b in zip(got, ref) if a.dtype.kind == 'f'),
                 'perm_equal': all(np.array_equal(a, b) for a, b in zip(got, ref)
                                   if a.dtype.kind == 'i'),
                 'sites': [[s['kind'], s['bytes'], s['in_loop'], s['trips']] for s in sites],
                 'replicated_arrays': sum(whole)}
  from jax.sharding import PartitionSpec as P
  mesh = sharding.make_mesh(2, 1, devices=jax.devices()[:2])

  def looped(x):
    return jax.lax.scan(lambda c, r: (c + jax.lax.psum(r, sharding.AXES), None),
                        jnp.zeros(x.shape[1:]), x)[0]

  f = jax.jit(jax.shard_map(looped, mesh=mesh, in_specs=P(None, sharding.AXES), out_specs=P()))
  text = f.lower(jnp.ones((3, 4, 5))).compile().as_text()
  out['control'] = [[s['kind'], s['bytes'], s['in_loop'], s['trips']]
                    for s in sharding.collective_sites(text)]
  return out


def layouts():
  """AdamW on 2 devices with its parameters whole on each and its moments
  split over 'fsdp' (ZeRO stage 1), trained 3 updates with the app's step:
  the shardings its state has after them (by kind), and its losses and
  parameters against the same run with everything replicated."""
  def trained(split_moments):
    cfg = dataclasses.replace(train_config(), optimizer='adamw', weight_decay=0.1)
    mesh = sharding.make_mesh(1, 2, devices=jax.devices()[:2])
    model, opt = factories.build_state(make_plan(cfg, VOCAB), mesh)
    if split_moments:
      sharding.shard_state(opt.opt_state, mesh, 'fsdp')
    step = factories.make_step(make_plan(cfg, VOCAB), mesh=mesh)
    losses = [float(step(model, opt, sharding.shard_batch(b, mesh))) for b in batches()[:3]]
    return model, opt, losses
  model, opt, losses = trained(True)
  ref_model, _, ref_losses = trained(False)
  split = lambda node: sorted({str(_spec(x)) for x in jax.tree.leaves(nnx.state(node))  # noqa: E731
                               if sharding.is_array(x) and x.ndim == 2})
  return {'param_specs': split(nnx.state(model, nnx.Param)),
          'moment_specs': split(opt.opt_state),
          'loss_diff': max(abs(a - b) for a, b in zip(losses, ref_losses)),
          'param_diff': max(float(np.max(np.abs(a - b)))
                            for a, b in zip(flat(nnx.state(model, nnx.Param)),
                                            flat(nnx.state(ref_model, nnx.Param))))}


def merges():
  """What each POET layer's merge program sends between 8 devices: under dp
  (state replicated), under fsdp (2, 4) and fsdp with the layers stacked;
  per layer the collectives' total bytes, the largest one's, their kinds,
  the sizes of its all-to-alls, and the bytes of the layer's frozen base. Then
  the merged state under fsdp (2, 4), unstacked and stacked, against one
  device's, from the same random generators and key."""
  from poetx_jax import cycle
  out = {}
  for name, (d, f), strategy, scan in (('dp', (8, 1), 'dp', False),
                                       ('fsdp', (2, 4), 'fsdp', False),
                                       ('fsdp scan', (2, 4), 'fsdp', True)):
    model, _ = build(scan, sharding.make_mesh(d, f), strategy)
    layers = dict(cycle.poet_layers(model))
    out[name] = [{'layer': path, 'collectives': len(sites),
                  'bytes': sum(s['bytes'] for s in sites),
                  'largest': max([s['bytes'] for s in sites] + [0]),
                  'kinds': sorted({s['kind'] for s in sites}),
                  'all_to_all': sorted({s['bytes'] for s in sites if s['kind'] == 'all-to-all'}),
                  'base_bytes': layers[path].kernel[...].nbytes}
                 for path, sites in cycle.merge_collectives(model)]

  def merged(scan, mesh):  # random generators, then one merge
    model, _ = build(scan, mesh, 'fsdp' if mesh is not None else 'dp')
    for i, (_, layer) in enumerate(cycle.poet_layers(model)):
      for j, q in enumerate((layer.q_in, layer.q_out)):
        q[...] = 0.05 * jax.random.normal(jax.random.key(100 * i + j), q[...].shape,
                                          q[...].dtype)
    error = float(cycle.merge(model, rngs=jax.random.key(5)))
    return flat(model), error

  for scan in (False, True):  # the sharded merge against one device's
    ref, ref_error = merged(scan, None)
    got, error = merged(scan, sharding.make_mesh(2, 4))
    out[f'values scan={scan}'] = {
        'error_diff': abs(error - ref_error),
        'largest_diff': max(float(np.max(np.abs(a.astype(np.float64) - b)))
                            for a, b in zip(got, ref) if a.dtype.kind == 'f'),
        'ints_equal': all(np.array_equal(a, b) for a, b in zip(got, ref) if a.dtype.kind == 'i')}
  return out


if __name__ == '__main__':
  if sys.argv[1] == 'eight':  # eight CKPT (8 devices)
    json.dump({'main': main(sys.argv[2]), 'merges': merges(), 'accumulate': accumulate()},
              sys.stdout)
  elif sys.argv[1] == 'four':  # four CKPT FSDP... (4 devices): one restore for each FSDP
    json.dump({'restore': {f: restore(sys.argv[2], int(f)) for f in sys.argv[3:]},
               'meshes': meshes(), 'layouts': layouts()}, sys.stdout)
  elif sys.argv[1] == 'optimizers':
    optimizers(sys.argv[2], sys.argv[3].split(','))  # optimizers CKPT FAMILY,...
  else:
    raise SystemExit(f'unknown mode {sys.argv[1]!r}')
