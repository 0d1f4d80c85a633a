"""experiments/parity.py: the windows written are those our runs train on, in
order; the reference's command carries the run's configuration (CPU)."""


import numpy as np
import pytest

from conftest import write_corpus
from poetx_jax.pretrain.data import windows as data_lib
from poetx_jax.pretrain import loading
from poetx_jax.pretrain.config import TrainConfig

from experiments import harness, parity


@pytest.fixture(scope='module')
def cfg(tmp_path_factory):
  corpus = write_corpus(tmp_path_factory.mktemp('corpus'))
  return TrainConfig(model='tiny', data=[str(corpus)], vocab_size=300, seq_len=16,
                     batch_size=4, steps=5, eval_batches=2,
                     cache_dir=str(tmp_path_factory.mktemp('cache')))


def test_windows_are_the_batches_of_each_seed_in_order(cfg, tmp_path):
  meta = parity.write_windows(cfg, [0, 3], tmp_path)
  data = loading.load_data(cfg)
  assert meta['vocab_size'] == 300 and meta['val_windows'] == 8
  np.testing.assert_array_equal(np.load(tmp_path / 'val.npy'), data.val_windows[:8])
  for seed in (0, 3):
    windows = np.load(tmp_path / f'train-s{seed}.npy')
    assert windows.shape == (cfg.steps * cfg.batch_size, cfg.seq_len + 1)
    it = iter(data_lib.train_dataset(data.train_windows, batch_size=4, seed=seed))
    for step in range(cfg.steps):
      batch, rows = next(it), windows[step * 4:(step + 1) * 4]
      np.testing.assert_array_equal(rows[:, :-1], batch['inputs'])
      np.testing.assert_array_equal(rows[:, 1:], batch['targets'])
  assert not np.array_equal(np.load(tmp_path / 'train-s0.npy'),
                            np.load(tmp_path / 'train-s3.npy'))


def test_the_anchor_command_carries_the_configuration(cfg, tmp_path):
  run = harness.apply(cfg, 'optimizer=poetx,poet_lr=2.5e-4,lr=1e-3,merge_every=200,'
                          'warmup=100,block_size=16,clip=0.5')
  cmd = parity.anchor_command(run, 1, tmp_path, 300, tmp_path / 'm.jsonl', tmp_path)
  flags = dict(zip(cmd[2::2], cmd[3::2]))
  assert flags['--train'] == str(tmp_path / 'train-s1.npy')
  assert {k: flags[k] for k in ('--poet-lr', '--poet-scale', '--lr', '--merge-every',
                                '--block-size', '--warmup', '--clip', '--seed', '--vocab',
                                '--steps', '--batch')} == {
      '--poet-lr': '0.00025', '--poet-scale': '1.0', '--lr': '0.001', '--merge-every': '200',
      '--block-size': '16', '--warmup': '100', '--clip': '0.5', '--seed': '1',
      '--vocab': '300', '--steps': '5', '--batch': '4'}
  with pytest.raises(ValueError, match=r"'poet_rate' in 'poet_rate=1' is not an option"):
    harness.apply(cfg, 'poet_rate=1')


def test_every_poet_variant_draws_element_permutations_unless_it_sets_chunk(cfg):
  """The reference draws element permutations: a POET-X variant that leaves
  the draw open gets element ones on any device; ours may draw chunk ones, an
  anchor may not; AdamW variants are left as they are."""
  poet = harness.apply(cfg, 'optimizer=poetx')
  assert parity.with_element_draws(poet, 'ours').permutation == 'element'
  assert parity.with_element_draws(poet, 'anchor').permutation == 'element'
  chunk = harness.apply(cfg, 'optimizer=poetx,permutation=chunk')
  assert parity.with_element_draws(chunk, 'ours').permutation == 'chunk'
  with pytest.raises(ValueError, match=r"permutation='chunk': poet_torch_train.py draws element"):
    parity.with_element_draws(chunk, 'anchor')
  adamw = harness.apply(cfg, 'optimizer=adamw')
  assert parity.with_element_draws(adamw, 'ours').permutation is None


def test_every_variant_trains_without_weight_decay_unless_it_sets_one(cfg):
  """The reference has no weight decay: a variant that leaves it to the recipe
  (AdamW's default is 0.1) gets 0; ours may set one, an anchor may not."""
  adamw = harness.apply(cfg, 'optimizer=adamw')
  assert parity.without_default_decay(adamw, 'ours').weight_decay == 0.0
  assert parity.without_default_decay(adamw, 'anchor').weight_decay == 0.0
  decayed = harness.apply(cfg, 'optimizer=adamw,weight_decay=0.1')
  assert parity.without_default_decay(decayed, 'ours').weight_decay == 0.1
  with pytest.raises(ValueError, match=r'weight_decay=0.1: poet_torch_train.py trains without'):
    parity.without_default_decay(decayed, 'anchor')
  with pytest.raises(SystemExit):
    parity.parse_args(['--variants', 'anchor:optimizer=adamw,weight_decay=0.1'])
  a = parity.parse_args(['--variants', 'ours:optimizer=adamw', 'anchor:optimizer=adamw'])
  assert [s['cfg'].weight_decay for s in a.specs] == [0.0, 0.0]


def test_a_failed_run_gives_no_figures():
  runs = [{'name': 'a', 'seed': 0, 'val': {0: 5.0, 10: 3.0}, 'returncode': 0, 'wall_s': 1},
          {'name': 'a', 'seed': 1, 'val': {0: 5.0}, 'returncode': 1, 'wall_s': 1}]
  (row,) = parity.summarise(runs)
  assert row['finals'] == {0: 3.0} and row['failed'] == [1] and row['spread'] == 0.0
