"""A run's plan: every default resolved once (plan.py), the optimizer recipes
(recipes.py) and the one rule for POET-only options."""

import dataclasses
import json
import pathlib
import re

import numpy as np
import pytest

from poetx_jax.pretrain import cli, recipes
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.config_text import apply_overrides
from poetx_jax.pretrain.plan import make_plan

PACKAGE = pathlib.Path(__file__).resolve().parents[1]


def _plan(**kw):
  return make_plan(TrainConfig(**kw), 4096)


def test_adamw_learning_rate_default_is_per_size():
  """lr None: 3e-3, but 6e-4 for AdamW on a model of hidden >= 512 (the best of
  the 130m sweep); POET-X's other parameters keep 3e-3; a given lr is kept."""
  assert _plan(model='tiny', optimizer='adamw').lr == 3e-3
  assert _plan(model='130m', optimizer='adamw').lr == 6e-4
  assert _plan(model='130m').lr == 3e-3 and _plan(model='130m', optimizer='skewadam').lr == 3e-3
  assert _plan(model='130m', optimizer='adamw', lr=1e-3).lr == 1e-3
  assert _plan(model='tiny', optimizer='muon').lr == 3e-3
  assert _plan(model='60m', optimizer='muon').lr == 4e-3


@pytest.mark.slow
def test_weight_decay_default_is_per_recipe_and_reaches_the_optimizer():
  """weight_decay None: 0.1 for AdamW and Muon on a model of hidden >= 512, 0
  below and for POET-X and SkewAdam; a given value is kept; a resumed run
  keeps the value it recorded; the built optimizer decays by it (a zero
  gradient moves every weight by -lr * wd * w at AdamW's first update,
  nothing at weight decay 0)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from poetx_jax.pretrain.factories import build_model, build_optimizer
  wide = {'model': '60m'}
  assert _plan(optimizer='adamw', **wide).weight_decay == 0.1
  assert _plan(optimizer='muon', **wide).weight_decay == 0.1
  assert _plan(optimizer='adamw').weight_decay == 0.0  # the tiny default
  assert _plan(**wide).weight_decay == 0.0
  assert _plan(optimizer='skewadam', **wide).weight_decay == 0.0
  assert _plan(optimizer='adamw', weight_decay=0.0, **wide).weight_decay == 0.0
  assert _plan(weight_decay=0.05).weight_decay == 0.05
  assert make_plan(TrainConfig(optimizer='adamw', **wide), 4096,
                   recorded={'weight_decay': 0.0}).weight_decay == 0.0
  assert _plan(optimizer='adamw', **wide).record()['weight_decay'] == 0.1
  small_wide = {'hidden': 512, 'mlp': 64, 'layers': 1, 'heads': 4, 'kv_heads': 4}
  for wd in (None, 0.0):
    plan = make_plan(TrainConfig(optimizer='adamw', warmup=0, weight_decay=wd,
                                 model_overrides=small_wide), 512)
    model = build_model(plan)
    opt = build_optimizer(plan, model)
    params = nnx.state(model, nnx.Param)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = opt.tx.update(zeros, opt.tx.init(params), params)
    assert plan.weight_decay == (0.1 if wd is None else 0.0)
    want = jax.tree.map(lambda w: -plan.lr * plan.weight_decay * w, params)
    jax.tree.map(lambda u, w: np.testing.assert_allclose(u, w, rtol=1e-6, atol=0), updates, want)


def test_min_lr_ratio_default_is_per_recipe_and_size_and_ends_the_schedules(tmp_path):
  """min_lr_ratio None: 0.01 for POET-X and POET-X Muon on models of hidden
  size >= 256 (5M's 256 included), 0.1 below (the tiny default) and for the
  others; a given ratio is kept; a resumed run keeps the ratio it
  recorded (a run.json written before the recipes had their own holds 0.1
  among its options); both schedules end at the ratio times their peak."""
  five_m = {'hidden': 256, 'mlp': 768, 'layers': 6, 'heads': 4, 'kv_heads': 4}
  assert _plan(optimizer='poetx', model='130m').min_lr_ratio == 0.01
  assert _plan(optimizer='poetx', model='60m', model_overrides=five_m,
               block_size=256).min_lr_ratio == 0.01
  assert _plan(optimizer='poetx', model='60m', model_overrides={**five_m, 'hidden': 128},
               block_size=128).min_lr_ratio == 0.1
  assert _plan(optimizer='poetx').min_lr_ratio == 0.1  # tiny
  assert _plan(optimizer='poetx-muon', model='130m').min_lr_ratio == 0.01
  assert _plan(optimizer='poetx-muon', model='60m', model_overrides=five_m,
               block_size=256).min_lr_ratio == 0.01
  assert _plan(optimizer='poetx-muon').min_lr_ratio == 0.1  # tiny
  for optimizer in ('adamw', 'muon', 'skewadam'):
    assert _plan(optimizer=optimizer, model='130m').min_lr_ratio == 0.1, optimizer
  assert _plan(optimizer='poetx', model='130m', min_lr_ratio=0.1).min_lr_ratio == 0.1
  assert _plan(optimizer='adamw', min_lr_ratio=0.0).min_lr_ratio == 0.0
  cfg = TrainConfig(optimizer='poetx', model='130m', steps=100, warmup=10)
  assert make_plan(cfg, 4096, recorded={'min_lr_ratio': 0.05}).min_lr_ratio == 0.05
  # A POET-X run.json written before: 0.1 among its options, none in its plan.
  from poetx_jax.pretrain import rundir
  from poetx_jax.pretrain.plan import recorded_plan
  run = tmp_path / 'run'
  run.mkdir()
  rundir.write_config(run, cfg, make_plan(cfg, 4096))
  saved = json.loads((run / 'run.json').read_text())
  saved['min_lr_ratio'] = 0.1
  del saved['plan']['min_lr_ratio']
  (run / 'run.json').write_text(json.dumps(saved))
  old = make_plan(rundir.read_config(run), 4096, recorded=recorded_plan(run))
  assert old.min_lr_ratio == 0.1
  plan = make_plan(cfg, 4096)
  assert plan.record()['min_lr_ratio'] == 0.01
  assert float(plan.lr_schedule(100)) == pytest.approx(0.01 * plan.lr, rel=1e-6)
  assert float(plan.poet_lr_schedule(100)) == pytest.approx(0.01 * plan.poet_lr, rel=1e-6)
  assert float(plan.lr_schedule(10)) == pytest.approx(plan.lr, rel=1e-6)


def test_merge_interval_default_is_per_size():
  """merge_every None: every 50 updates, but every 200 on a model of hidden >=
  512 (the 130m sweep's better interval); a given interval is kept; the
  merge period counts micro-steps; an optimizer that does not poetize has none."""
  assert _plan(model='tiny').merge_every == 50 and _plan(model='60m').merge_every == 200
  assert _plan(model='tiny', model_overrides={'hidden': 512, 'mlp': 1024}).merge_every == 200
  assert _plan(model='130m', merge_every=50).merge_every == 50
  assert _plan(model='tiny', merge_every=7, grad_accum=3).merge_period == 21
  assert _plan(optimizer='adamw').merge_every is None
  assert _plan(optimizer='adamw').merge_period is None
  with pytest.raises(ValueError, match='merge_every'):
    TrainConfig(merge_every=0).validate()
  assert apply_overrides(TrainConfig(), 'merge_every=none').merge_every is None


def test_layer_form_default_is_per_size():
  """form None: 'auto' (per layer, the form of fewer FLOPs) on a model of
  hidden >= 512, 'input' on smaller ones (the default CPU run's); a given
  form is kept, and the model the app builds carries it."""
  from poetx_jax.pretrain.factories import build_state
  assert _plan(model='tiny').form == 'input' and _plan(model='60m').form == 'auto'
  assert _plan(model='130m', form='input').form == 'input'
  assert _plan(model='tiny', form='weight').form == 'weight'
  model, _ = build_state(make_plan(apply_overrides(TrainConfig(), 'form=auto,vocab_size=512')))
  q = model.layers[0].self_attn.q_proj
  assert q.form == 'auto' and q.form_for((2048, q.in_features)) == 'weight'


def test_normalize_rows_default_is_per_size():
  """None: on for a fresh POET-X model of hidden >= 512 (as poet_torch), off for
  the tiny default, for AdamW and for a run started from a checkpoint; set, it
  is honoured; --normalize-rows / --no-normalize-rows set it either way."""
  from poetx_jax import models
  assert not _plan(model='tiny').normalize_rows and _plan(model='60m').normalize_rows
  assert not _plan(model='tiny', model_overrides={'hidden': 256, 'mlp': 512}).normalize_rows
  assert _plan(model='tiny', model_overrides={'hidden': 512, 'mlp': 1024}).normalize_rows
  assert _plan(model='tiny', normalize_rows=True).normalize_rows
  assert not _plan(model='130m', normalize_rows=False).normalize_rows
  assert not _plan(model='130m', optimizer='adamw').normalize_rows
  source = dataclasses.replace(models.get_config('130m'), vocab_size=4096)
  assert not make_plan(TrainConfig(init_from_hf='d'), 4096, source).normalize_rows
  parser = cli.build_parser()
  from poetx_jax.pretrain.config import config_from_args
  got = [config_from_args(parser.parse_args(['train', *a])).normalize_rows
         for a in ([], ['--normalize-rows'], ['--no-normalize-rows'])]
  assert got == [None, True, False]


def test_permutation_default_is_chunk_on_gpus_where_few_block_mates_stay(monkeypatch):
  """None: chunk permutations on a GPU where --chunk-size divides the block
  and every POET width and a feature keeps at most CHUNK_MAX_KEPT of its
  block-mates across merges ((c - 1) / (B - 1), a width's ragged last block
  included); element on a CPU, for small blocks, run lengths of 1 and run
  lengths that do not divide the block or a width; a given --permutation is
  kept, a resume keeps the recorded draw, and a run recorded before the
  option (or before plans were recorded: {}) reads as element."""
  from poetx_jax.pretrain import plan as plan_module
  assert recipes.CHUNK_MAX_KEPT == 0.1
  monkeypatch.setattr(plan_module.jax, 'default_backend', lambda: 'cpu')
  assert _plan(model='60m').permutation == 'element'
  monkeypatch.setattr(plan_module.jax, 'default_backend', lambda: 'gpu')
  assert _plan(model='60m').model.block_size == 512
  assert _plan(model='60m').permutation == 'chunk'  # 15 / 511: 2.9%; MLP 1376: last block 352
  assert _plan(model='60m', block_size=256,
               model_overrides={'mlp': 1536}).permutation == 'chunk'  # 5.9%
  assert _plan(model='60m', block_size=256).permutation == 'element'  # MLP's last block 96: 15.8%
  assert _plan(model='60m', block_size=128).permutation == 'element'  # 11.8%
  assert _plan(model='60m', block_size=128, chunk_size=8).permutation == 'chunk'  # 5.5%
  assert _plan(model='60m', chunk_size=24).permutation == 'element'  # 512 % 24
  assert _plan(model='60m', chunk_size=1).permutation == 'element'
  assert _plan(model='60m', model_overrides={'mlp': 544}).permutation == 'element'  # 15 / 31
  assert _plan(model='60m', model_overrides={'mlp': 1368}).permutation == 'element'  # 1368 % 16
  assert _plan(model='tiny').permutation == 'element'  # block 16: one run a block
  assert _plan(model='moe-60m').permutation == 'chunk'
  assert _plan(model='60m', permutation='element').permutation == 'element'
  assert _plan(model='60m', optimizer='adamw').permutation is None
  cfg = TrainConfig(model='60m')
  for recorded in ({'permutation': 'element'}, {'lr': 3e-3}, {}):
    assert make_plan(cfg, 4096, recorded=recorded).permutation == 'element', recorded
  monkeypatch.setattr(plan_module.jax, 'default_backend', lambda: 'cpu')
  assert make_plan(cfg, 4096, recorded={'permutation': 'chunk'}).permutation == 'chunk'


def test_a_run_from_before_plans_were_recorded_reads_an_empty_plan(tmp_path):
  """recorded_plan: {} for a run.json without a plan (so make_plan falls back
  to what such runs did: element draws), None without run.json."""
  from poetx_jax.pretrain import rundir
  from poetx_jax.pretrain.plan import recorded_plan
  assert recorded_plan(tmp_path) is None
  cfg = TrainConfig(out_dir=str(tmp_path))
  rundir.write_config(tmp_path, cfg, make_plan(cfg))
  record = json.loads((tmp_path / 'run.json').read_text())
  assert recorded_plan(tmp_path) == record['plan'] and record['plan']
  del record['plan']
  (tmp_path / 'run.json').write_text(json.dumps(record))
  assert recorded_plan(tmp_path) == {}


def test_block_size_and_poet_lr_are_resolved_once_into_the_model():
  """--block-size, else the model config's (512 for 60m and 130m, the better
  block in docs/quality.md; 256 from 350m up); the POET step size follows it;
  the plan's model carries the block size; a run that recorded another block
  keeps it; one too large for a projection is refused when the plan is made,
  naming it; block_size in --model-overrides is refused in favour of the one
  option."""
  import poetx_jax
  p = _plan(model='tiny')
  assert (p.block_size, p.model.block_size) == (16, 16)
  assert p.poet_lr == poetx_jax.default_poet_lr(16)
  sizes = {m: (_plan(model=m, optimizer='poetx').block_size,
               _plan(model=m, optimizer='poetx').poet_lr)
           for m in ('60m', '130m', '350m', '8b')}
  assert sizes == {'60m': (512, 0.25 / 512), '130m': (512, 0.25 / 512),
                   '350m': (256, 0.25 / 256), '8b': (256, 0.25 / 256)}
  # POET-X Muon's own step (the app's default optimizer): POET-X's up to B 256, 2^-10 above.
  assert [_plan(model=m).poet_lr for m in ('tiny', '350m', '130m')] == [
      poetx_jax.default_poet_lr(16), 0.25 / 256, 0.25 / 256]
  assert _plan(model='130m').options.optimizer == 'poetx-muon'
  resumed = make_plan(TrainConfig(model='130m'), 4096,
                      recorded={'block_size': 256, 'poet_lr': 0.25 / 256})
  assert (resumed.block_size, resumed.model.block_size, resumed.poet_lr) == (
      256, 256, 0.25 / 256)
  p = _plan(model='tiny', block_size=32)
  assert (p.block_size, p.model.block_size, p.poet_lr) == (32, 32, poetx_jax.default_poet_lr(32))
  assert _plan(model='tiny', optimizer='adamw').block_size is None
  with pytest.raises(ValueError, match='block_size=128 is larger than the dimension 64'):
    _plan(model='tiny', block_size=128)
  with pytest.raises(ValueError, match='the POET block size is its own option'):
    TrainConfig(model_overrides={'block_size': 32}).validate()
  with pytest.raises(ValueError, match="model_overrides sets vocab_size=10: the vocabulary is "
                                       "the tokenizer's"):
    TrainConfig(model_overrides={'vocab_size': 10}).validate()


def test_a_given_tokenizer_sets_the_vocabulary_and_a_contradicting_one_is_refused(tmp_path):
  """With --tokenizer FILE the run records FILE's vocabulary; a --vocab-size
  that contradicts it is refused (as one a prepared dataset contradicts)."""
  from poetx_jax.pretrain.data.tokenizer import Tokenizer
  from poetx_jax.pretrain.options import command_options, finish_options
  path = tmp_path / 'tok.json'
  Tokenizer.train_bpe(['def f(x):\n  return x + 1\n'] * 50, vocab_size=300, path=path)
  vocab = Tokenizer.load(path).vocab_size
  cfg = TrainConfig(tokenizer=str(path), out_dir=str(tmp_path / 'run'))
  assert finish_options(command_options(cfg, ['tokenizer']), resume=False).vocab_size == vocab
  same = dataclasses.replace(cfg, vocab_size=vocab)
  assert command_options(same, ['tokenizer', 'vocab_size']) == same
  with pytest.raises(ValueError, match=f'--vocab-size 4096 disagrees with the tokenizer {path}, '
                                       f'whose vocabulary is {vocab}'):
    command_options(cfg, ['tokenizer', 'vocab_size'])


def test_each_poet_only_option_with_adamw_is_refused_naming_it(capsys):
  """All 19 options marked POET-only, each set with --optimizer adamw (and
  skewadam): exit 2, one line naming the option; none is silently ignored."""
  flags = {'poet_lr': ['1e-3'], 'clip_ramp': ['10'], 'merge_every': ['7'],
           'block_size': ['32'], 'max_generator_norm': ['0.5'],
           'normalize_rows': [], 'tie_permutations': [], 'mode': ['mem'],
           'form': ['weight'], 'implementation': ['pallas'], 'quantize': ['int8'],
           'group_size': ['64'], 'generator_dtype': ['bfloat16'], 'skew_tiers': [],
           'norm_gathers': [], 'permutation': ['chunk'], 'chunk_size': ['8'],
           'poet_eps': ['1e-6'], 'poet_eps_placement': ['raw']}
  marked = [f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get('poet')]
  assert sorted(marked) == sorted(flags) and len(marked) == 19
  for optimizer in ('adamw', 'skewadam'):
    for name, values in flags.items():
      flag = '--' + name.replace('_', '-')
      assert cli.main(['train', '--optimizer', optimizer, flag, *values,
                       '--out-dir', '/nonexistent/never-written']) == 2
      err = capsys.readouterr().err
      assert re.search(rf'error: {name}=\S+: option of the POET layers', err), err
      assert f"optimizer {optimizer!r} does not poetize" in err
  assert not pathlib.Path('/nonexistent/never-written').exists()


def test_a_poet_switch_turned_off_is_accepted_with_every_optimizer():
  """--no-normalize-rows, like --no-tie-permutations and the other POET
  switches turned off, says what a dense run does anyway: accepted with
  AdamW, Muon and SkewAdam (and resolved off), as a restated default is."""
  from poetx_jax.pretrain.config import config_from_args
  parser = cli.build_parser()
  switches = [f.name for f in dataclasses.fields(TrainConfig)
              if f.metadata.get('poet') and f.default in (None, False) and f.type in (
                  'bool', 'bool | None')]
  assert sorted(switches) == ['norm_gathers', 'normalize_rows', 'skew_tiers',
                              'tie_permutations'], switches
  for optimizer in ('adamw', 'muon', 'skewadam'):
    for name in switches:
      cfg = config_from_args(parser.parse_args(
          ['train', '--optimizer', optimizer, '--no-' + name.replace('_', '-')]))
      cfg.validate()
      assert getattr(cfg, name) is False
      on = dataclasses.replace(cfg, **{name: True})  # the switch turned on: refused
      with pytest.raises(ValueError, match=f'{name}=True: option of the POET layers'):
        on.validate()
    cfg = config_from_args(parser.parse_args(['train', '--optimizer', optimizer, '--mode',
                                              'fast', '--chunk-size', '16']))
    cfg.validate()  # restated defaults


def test_recipes_say_whether_they_poetize():
  """The optimizer choices are the recipes; only the POET-X families poetize;
  a plan carries its recipe."""
  assert TrainConfig.__dataclass_fields__['optimizer'].metadata['choices'] == tuple(
      recipes.RECIPES)
  assert [r.name for r in recipes.RECIPES.values() if r.poetizes] == ['poetx', 'poetx-muon']
  assert _plan(optimizer='adamw').recipe is recipes.RECIPES['adamw']
  assert _plan().poetize and not _plan(optimizer='skewadam').poetize


def test_no_other_module_resolves_a_default_the_plan_owns():
  """The fallbacks plan.py replaced appear nowhere else in the package or the
  experiments: the per-size constants are used only by plan.py (recipes.py
  defines them, config.py shows them in --help), nothing asks
  ``optimizer == 'poetx'``, nothing falls back to a model's block size or
  the default POET step."""
  patterns = [r'\bblock_size or\b', r"optimizer [!=]= 'poetx'", r'default_poet_lr\(',
              r'\b(DEFAULT_LR|ADAMW_WIDE_LR|MUON_WIDE_LR|WIDE_HIDDEN|DEFAULT_MERGE_EVERY|'
              r'WIDE_MERGE_EVERY|DENSE_WEIGHT_DECAY)\b',
              r'\.(lr|poet_lr|merge_every|form|normalize_rows|block_size|weight_decay) is None',
              r"\bdtype == 'auto'"]
  allowed = {'poetx_jax/pretrain/plan.py', 'poetx_jax/pretrain/recipes.py',
             'poetx_jax/pretrain/config.py',
             'experiments/train_tiny.py',  # the library alone, with two optimizers of its own
             'experiments/parity.py'}  # weight decay 0 where left open: the reference's
  found = []
  for path in [*(PACKAGE / 'poetx_jax' / 'pretrain').rglob('*.py'),
               *(PACKAGE / 'experiments').glob('*.py')]:
    rel = path.relative_to(PACKAGE).as_posix()
    if rel in allowed:
      continue
    for i, line in enumerate(path.read_text().splitlines(), 1):
      found += [f'{rel}:{i}: {line.strip()}' for p in patterns if re.search(p, line)]
  assert not found, '\n'.join(found)


def test_run_json_records_the_plan_and_a_resume_keeps_it(tmp_path):
  """run.json holds the resolved plan beside the options; a run.json used as
  --config reads the options only; resuming (and eval, export) keeps the
  values the run recorded where the options leave them open, so a default
  changed since does not change the run."""
  from poetx_jax.pretrain import config_text, rundir
  from poetx_jax.pretrain.plan import recorded_plan
  cfg = TrainConfig(out_dir=str(tmp_path / 'run'))
  plan = make_plan(cfg)
  (tmp_path / 'run').mkdir()
  rundir.write_config(tmp_path / 'run', cfg, plan)
  saved = json.loads((tmp_path / 'run' / 'run.json').read_text())
  assert saved['plan']['lr'] == 3e-3 and saved['plan']['merge_every'] == 50
  assert saved['plan']['model']['block_size'] == 16
  assert rundir.read_config(tmp_path / 'run') == cfg
  assert config_text.config_with_file(tmp_path / 'run' / 'run.json') == cfg
  recorded = {**recorded_plan(tmp_path / 'run'), 'lr': 1e-3, 'merge_every': 10}
  kept = make_plan(cfg, recorded=recorded)
  assert (kept.lr, kept.merge_every, kept.merge_period) == (1e-3, 10, 10)
  explicit = make_plan(dataclasses.replace(cfg, lr=2e-3), recorded=recorded)
  assert explicit.lr == 2e-3  # an option given is the run's own (resume checks it agrees)


def test_an_old_run_json_with_block_size_in_model_overrides_reads_as_the_option(tmp_path):
  """A run.json of an earlier version that set the POET block size through
  model_overrides reads with block_size set instead (so it resumes)."""
  from poetx_jax.pretrain import rundir
  old = {**dataclasses.asdict(TrainConfig()), 'model_overrides': {'layers': 1, 'block_size': 8}}
  (tmp_path / 'run.json').write_text(json.dumps(old))
  cfg = rundir.read_config(tmp_path)
  assert cfg.model_overrides == {'layers': 1} and cfg.block_size == 8
  cfg.validate()


@pytest.mark.parametrize('scan', [False, True])
def test_muon_orthogonalises_the_decoder_matrices_only(scan):
  """--optimizer muon: optax.contrib.muon's dimension numbers for the decoder
  layers' kernels (the layer axis of a stack a batch axis), None (AdamW) for
  the embedding, the norms and the head; it poetizes nothing and its rate is
  AdamW's."""
  import jax
  import optax
  from flax import nnx
  from poetx_jax.pretrain import factories, recipes
  cfg = TrainConfig(optimizer='muon', scan_layers=scan, dtype='float32', model_overrides={
      'layers': 2, 'hidden': 32, 'mlp': 64, 'heads': 2, 'kv_heads': 1})
  plan = make_plan(cfg, 300)
  assert not plan.poetize and plan.lr == make_plan(dataclasses.replace(
      cfg, optimizer='adamw'), 300).lr
  model, _ = factories.build_state(plan)
  dims = recipes._muon_dimensions(nnx.state(model, nnx.Param))
  is_dims = lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers)
  got = {jax.tree_util.keystr(p): d for p, d in
         jax.tree_util.tree_leaves_with_path(dims, is_leaf=is_dims)}
  kernels = {k: d for k, d in got.items() if d is not None}
  assert len(kernels) == 7 * (1 if scan else 2) and all('_proj' in k for k in kernels)
  axes = (1, 2) if scan else (0, 1)
  assert {(d.reduction_axis, d.output_axis) for d in kernels.values()} == {axes}
  assert all(got[k] is None for k in got if 'embed' in k or 'norm' in k or 'lm_head' in k)


def test_the_paths_a_run_records_are_absolute(tmp_path, monkeypatch):
  """run.json names the data, tokenizer and checkpoint as absolute paths, so
  that eval and --resume find them from any directory; a weight stays."""
  from poetx_jax.pretrain.options import resolve_paths
  monkeypatch.chdir(tmp_path)
  cfg = resolve_paths(TrainConfig(data=['corpus:0.7', 'web:0.3'], val_data=['held'],
                                tokenizer='tok.json', init_from_hf='~/hf'))
  assert cfg.data == [f'{tmp_path}/corpus:0.7', f'{tmp_path}/web:0.3']
  assert cfg.val_data == [f'{tmp_path}/held'] and cfg.tokenizer == f'{tmp_path}/tok.json'
  assert cfg.init_from_hf == str(pathlib.Path('~/hf').expanduser())
