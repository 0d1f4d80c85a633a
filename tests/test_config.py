"""The run options: TrainConfig's checks, the flags generated from it, and
experiments' parsers built on it."""

import dataclasses
import typing as tp

import pytest

from poetx_jax.pretrain import cli, config
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.config_text import apply_overrides, parse_fields


@pytest.mark.parametrize('options, match', [
    (dict(optimizer='adamw', skew_tiers=True), "skew_tiers=True: option of the POET layers"),
    (dict(optimizer='skewadam', lean_state=True), 'lean_state and SkewAdam'),
    (dict(optimizer='poetx', skew_tiers=True, lean_state=True), 'lean_state and SkewAdam'),
])
def test_skewadam_option_conflicts_are_named(options, match):
  with pytest.raises(ValueError, match=match):
    TrainConfig(**options).validate()


# min_lr_ratio's range names what None gives (a regex).
MIN_LR_NONE = (r'\(or None: 0.01 for poetx and poetx-muon on a model of hidden size >= 256, '
               r'0.1 below and for the others\)')


@pytest.mark.parametrize('field,value,message', [
    ('eval_batches', 0, r'eval_batches must be an int in \[1, 2147483647\], got 0'),
    ('warmup', -1, r'warmup must be an int in \[0, 2147483647\], got -1'),
    ('min_lr_ratio', 1.5, rf'min_lr_ratio must be in \[0, 1\] {MIN_LR_NONE}, got 1.5'),
    ('min_lr_ratio', -0.1, rf'min_lr_ratio must be in \[0, 1\] {MIN_LR_NONE}, got -0.1'),
    ('block_size', 0, r'block_size must be an int in \[2, 2147483647\] .*, got 0'),
    ('block_size', 1, r'block_size must be an int in \[2, 2147483647\] .*, got 1'),
    ('val_fraction', 0.0, r'val_fraction must be in \(0, 1\), got 0.0'),
    ('val_fraction', 1, r'val_fraction must be in \(0, 1\), got 1'),
    ('lr', -1e-3,
     r'lr must be >= 0 \(or None: 0.003; .*AdamW 0.0006 and Muon 0.004, .*\), got -0.001'),
    ('weight_decay', -0.1,
     r'weight_decay must be >= 0 \(or None: 0.1 for AdamW and Muon.*got -0.1'),
    ('lr', float('nan'), r'lr must be a finite number >= 0 \(or None.*got nan'),
    ('poet_lr', float('inf'), r'poet_lr must be a finite number > 0 \(or None.*got inf'),
    ('min_lr_ratio', 1e30, rf'min_lr_ratio must be in \[0, 1\] {MIN_LR_NONE}, got 1e\+30'),
    ('clip', -1.0, 'clip must be >= 0, got -1.0'),
    ('group_size', 0, r'group_size must be an int in \[1, 2147483647\], got 0'),
    ('vocab_size', 100, r'vocab_size must be an int in \[257, 16777216\], got 100'),
    ('fsdp', 0, r'fsdp must be an int in \[1, 2147483647\], got 0'),
    ('mode', 'slow', r"mode must be one of \('fast', 'mem'\), got 'slow'"),
    ('quantize', 'fp8', r"quantize must be None or one of \('int8', 'int4'\), got 'fp8'"),
    ('steps', True, r'steps must be an int in \[1, 2147483647\], got True'),
    # jax.random.key takes an int64 and the permutations use seed + 1
    ('seed', 2 ** 63, r'seed must be an int in \[0, 9223372036854775806\], got 9223372036854775808'),
    ('seed', -1, r'seed must be an int in \[0, 9223372036854775806\], got -1'),
    ('tracking', ['mlflow'], r"tracking must be a list of \('tensorboard', 'wandb'\)"),
    ('tracking', 'wandb', r"tracking must be a list of .*, got 'wandb'"),
    ('tracking', ['tensorboard', 'tensorboard'], 'tracking names tensorboard twice'),
    ('profile_steps', '5', "profile_steps must be A:B, .* got '5'"),
    ('profile_steps', '3:2', "profile_steps must be A:B, .*1 <= A <= B.* got '3:2'"),
    ('profile_steps', '0:2', "profile_steps must be A:B, .* got '0:2'"),
    ('profile_steps', '500:601', "profile_steps='500:601' ends after the run's last "
                                 "micro-step, 600"),
    ('out_dir', '', 'out_dir: an empty path'),
    ('cache_dir', '', 'cache_dir: an empty path'),
    ('data', ['corpus', ''], 'data: an empty path'),
    ('init_from_hf', '', 'init_from_hf: an empty path'),
])
def test_options_that_cannot_be_honoured_are_errors(field, value, message):
  with pytest.raises(ValueError, match=message):
    TrainConfig(**{field: value}).validate()


def test_bounds_hold_for_values_far_from_them():
  # A value so large that adding 1 does not change it is still within ">= 0".
  TrainConfig(lr=1e30, clip=1e300, steps=2**31 - 1).validate()


def _int_options() -> list[str]:
  hints = tp.get_type_hints(TrainConfig)
  return [f.name for f in dataclasses.fields(TrainConfig)
          if config._base_type(hints[f.name])[0] is int]  # pylint: disable=protected-access


def _past(bound: int, md, name: str) -> str:
  return (rf'{name} must be an int in \[{md["min"]}, {md["max"]}\]'
          rf'( \(or None: .*\))?, got {bound}$')


@pytest.mark.parametrize('name', _int_options())
def test_every_int_option_states_both_bounds_and_takes_them(name):
  """Each int option has a lowest and a highest value in the schema: both
  are valid (with what they need of other options), one past either is
  refused naming the value and the range."""
  md = {f.name: f.metadata for f in dataclasses.fields(TrainConfig)}[name]
  assert 'min' in md and 'max' in md, (name, dict(md))
  for value in (md['min'], md['max']):
    needs = {'seq_len': value} if name == 'loss_chunk' and value else {}  # <= seq_len
    TrainConfig(**{name: value, **needs}).validate()
  for value in (md['min'] - 1, md['max'] + 1):
    with pytest.raises(ValueError, match=_past(value, md, name)):
      TrainConfig(**{name: value}).validate()


@pytest.mark.parametrize('name', _int_options())
def test_poetx_train_refuses_an_int_option_past_its_bound_and_writes_nothing(
    name, tmp_path, capsys):
  md = {f.name: f.metadata for f in dataclasses.fields(TrainConfig)}[name]
  value = md['max'] + 1
  code = cli.main(['train', f'--{name.replace("_", "-")}', str(value),
                   '--out-dir', str(tmp_path / 'run'), '--cache-dir', str(tmp_path / 'cache'),
                   '--compile-cache', str(tmp_path / 'xla')])
  err = capsys.readouterr().err
  assert code == 2 and err.count('\n') == 1, err
  assert f'{name} must be an int in [{md["min"]}, {md["max"]}]' in err and str(value) in err
  assert list(tmp_path.iterdir()) == []


def test_a_loss_chunk_longer_than_the_sequence_is_refused():
  with pytest.raises(ValueError, match=r'loss_chunk=65 is more than the seq_len=64 positions '
                                       r'of a sequence: give at most 64, or 0'):
    TrainConfig(seq_len=64, loss_chunk=65).validate()
  TrainConfig(seq_len=64, loss_chunk=64).validate()


def test_the_train_flags_are_generated_from_the_config(capsys):
  """One flag per TrainConfig field, with help and default; the defaults give
  TrainConfig(); the special forms parse as before."""
  parser = cli.build_parser()
  train_parser = parser._subparsers._group_actions[0].choices['train']  # pylint: disable=protected-access
  actions = {a.dest: a for a in train_parser._actions}  # pylint: disable=protected-access
  for f in dataclasses.fields(TrainConfig):
    action = actions[f.name]
    flag = '--' + f.name.replace('_', '-')
    assert action.option_strings in ([flag], [flag, '--no-' + flag[2:]])
    assert action.help and f.metadata['help'] in action.help.replace('%%', '%')
  assert {'resume', 'distributed', 'plot'} <= set(actions)
  from poetx_jax.pretrain.config import config_from_args
  assert config_from_args(parser.parse_args(['train'])) == TrainConfig()
  cfg = config_from_args(parser.parse_args(
      ['train', '--model-overrides', 'layers=4,hidden=128', '--data', 'A', 'B',
       '--scan-layers', '--lean-state', '--quantize', 'int8', '--poet-lr', '1e-3',
       '--block-size', '32', '--mode', 'mem']))
  assert cfg == TrainConfig(model_overrides={'layers': 4, 'hidden': 128}, data=['A', 'B'],
                            scan_layers=True, lean_state=True, quantize='int8',
                            poet_lr=1e-3, block_size=32, mode='mem')
  with pytest.raises(SystemExit):
    parser.parse_args(['train', '--mode', 'slow'])
  with pytest.raises(SystemExit):
    parser.parse_args(['train', '--help'])
  text = capsys.readouterr().out
  for f in dataclasses.fields(TrainConfig):
    assert '--' + f.name.replace('_', '-') in text
  flat = ' '.join(text.split())  # argparse wraps the help
  assert ('(default: 0.01 for poetx and poetx-muon on a model of hidden size >= 256, 0.1 below '
          'and for the others)') in flat
  assert 'one of tiny, 60m' in flat and 'moe-7b' in flat
  assert cli.main(['train', '--model-overrides', 'layers']) == 2
  assert '--model-overrides wants K=V pairs' in capsys.readouterr().err


def test_an_experiment_parser_has_its_own_defaults_and_runs_are_k_v_overrides(capsys):
  """add_options(overrides=, exclude=) and apply_overrides: the schema as
  experiments use it."""
  import argparse
  from poetx_jax.pretrain.config import add_options, config_from_args
  p = argparse.ArgumentParser()
  add_options(p, overrides={'model': '60m', 'steps': 400, 'lean_state': True,
                            'model_overrides': {'layers': 2}}, exclude=['out_dir'])
  cfg = config_from_args(p.parse_args([]))
  assert cfg == TrainConfig(model='60m', steps=400, lean_state=True,
                            model_overrides={'layers': 2})
  assert not config_from_args(p.parse_args(['--no-lean-state'])).lean_state
  assert config_from_args(p.parse_args(['--steps', '7'])).steps == 7
  with pytest.raises(SystemExit):
    p.parse_args(['--help'])
  flat = ' '.join(capsys.readouterr().out.split())
  assert '(default: 60m)' in flat and '(default: 400)' in flat and '(default: layers=2)' in flat
  assert '--no-lean-state' in flat and '--out-dir' not in flat
  with pytest.raises(ValueError, match="add_options: 'stepz' is not an option; valid: model, "):
    add_options(argparse.ArgumentParser(), overrides={'stepz': 1})

  # Each value read by its field's type, then the whole config validated.
  got = apply_overrides(cfg, 'optimizer=adamw,lr=1e-3,poet_lr=none,scan-layers=true,'
                             'model_overrides={layers=4,hidden=128},data=[a.txt,dir],'
                             'quantize=None,seed=3,remat=block')
  assert got == dataclasses.replace(cfg, optimizer='adamw', lr=1e-3, scan_layers=True,
                                    model_overrides={'layers': 4, 'hidden': 128},
                                    data=['a.txt', 'dir'], seed=3, remat='block')
  assert parse_fields('model_overrides={"layers": 1},data=d,lean_state=no') == {
      'model_overrides': {'layers': 1}, 'data': ['d'], 'lean_state': False}
  assert parse_fields('model_overrides=layers=1') == {'model_overrides': {'layers': 1}}
  assert apply_overrides(cfg, '') == cfg
  for text, message in (
      ('lrr=1', r"'lrr' in 'lrr=1' is not an option; valid: model, model_overrides, .*cache_dir"),
      ('lr=fast', "lr must be a number or none, got 'fast'"),
      ('steps=1.5', "steps must be an int, got '1.5'"),
      ('block_size=x', "block_size must be an int or none, got 'x'"),
      ('scan_layers=maybe', "scan_layers must be true or false, got 'maybe'"),
      ('model_overrides={layers}', 'model_overrides must be .*wants K=V pairs'),
      ('lr=1,lr=2', "lr is given twice in 'lr=1,lr=2'"),
      ('optimizer', "'optimizer' in 'optimizer' is not K=V"),
      ('mode=slow', r"mode must be one of \('fast', 'mem'\), got 'slow'"),
      ('steps=0', r'steps must be an int in \[1, 2147483647\], got 0'),
      ('optimizer=adamw,quantize=int8', "quantize='int8': option of the POET layers")):
    with pytest.raises(ValueError, match=message):
      apply_overrides(cfg, text)


def test_model_overrides_refuse_a_key_twice_and_numbers_that_are_not_finite():
  from poetx_jax.models import get_config
  from poetx_jax.pretrain.kv import parse_overrides
  assert parse_overrides('layers=1,hidden=32,name=x') == {'layers': 1, 'hidden': 32, 'name': 'x'}
  with pytest.raises(ValueError, match=r'layers is given twice in --model-overrides \(1, then 2\)'):
    parse_overrides('layers=1,hidden=32,layers=2')
  for bad in ('rope_theta=Infinity', 'init_std=NaN', 'norm_eps=-Infinity', 'rope_theta=1e999'):
    with pytest.raises(ValueError, match='is not a finite number'):
      parse_overrides(bad)
  with pytest.raises(ValueError, match='rope_theta must be a finite positive number, got inf'):
    get_config('tiny', rope_theta=float('inf'))  # 1e999 in JSON
