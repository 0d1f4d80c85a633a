"""Weighted mixtures of training sources (--data A:W B:W) and a validation set of
its own (--val-data): the pipeline, resume, identity checks and per-source counts."""

import json
import pathlib

import grain
import numpy as np
import pytest

from conftest import SMALL, write_corpus
from poetx_jax.pretrain import cli, loading
from poetx_jax.pretrain.data import mixture, prepare
from poetx_jax.pretrain.checkpoint import CheckpointError
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.train import train

QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope='module')
def corpora(tmp_path_factory):
  """Two text corpora of other words, a validation corpus, and both prepared
  with one tokenizer."""
  root = tmp_path_factory.mktemp('mix')
  write_corpus((root / 'a').mkdir() or root / 'a', docs=30)
  (root / 'b').mkdir()
  for i in range(12):
    (root / 'b' / f'{i}.md').write_text('# notes\n' + 'a second corpus of other words. ' * 25)
  (root / 'val').mkdir()
  (root / 'val' / 'v.txt').write_text('held out text for validation only. ' * 60)
  kw = dict(vocab_size=300, shard_tokens=500, workers=1, progress=False)
  prepare.prepare([root / 'a', root / 'b'], root / 'tok', **kw)  # one tokenizer for both
  tok = root / 'tok' / 'tokenizer.json'
  prepare.prepare([root / 'a'], root / 'pa', tokenizer=tok, **kw)
  prepare.prepare([root / 'b'], root / 'pb', tokenizer=tok, **kw)
  prepare.prepare([root / 'b'], root / 'pc', **{**kw, 'vocab_size': 280})  # its own BPE
  return root


def _cfg(tmp, data, **kw):
  return TrainConfig(**{**dict(
      model='tiny', model_overrides=SMALL,
      data=data, vocab_size=300, seq_len=32, batch_size=4, steps=6, warmup=1,
      merge_every=3, block_size=8, eval_every=3, eval_batches=2, log_every=1,
      checkpoint_every=100, dtype='float32', out_dir=str(tmp / 'run'),
      cache_dir=str(tmp / 'cache')), **kw})


def _records(run):
  return [json.loads(l) for l in (pathlib.Path(run) / 'metrics.jsonl').read_text().splitlines()]


def _losses(run):
  return [(r['step'], r['loss']) for r in _records(run) if 'loss' in r]


def test_selection_is_grains_mixing_and_counts_its_prefixes(tmp_path_factory):
  sel = mixture.Selection([0.7, 0.3])
  assert sel.proportions == (7, 3)
  picks = [sel[k] for k in range(200)]
  # grain's MapDataset.mix picks by the same rule (with 7:3 scaled to 233:100).
  tagged = [grain.MapDataset.range(10 ** 6).map(lambda j, i=i: (i, j)) for i in range(2)]
  ds = grain.MapDataset.mix(tagged, [7, 3])
  ref = mixture.Selection([233, 100])
  assert [ds[k] for k in range(300)] == [ref[k] for k in range(300)]
  for k in (0, 1, 9, 10, 123, 200):
    counts = sel.counts(k)
    assert counts == [sum(1 for s, _ in picks[:k] if s == i) for i in range(2)]
    assert sum(counts) == k and abs(counts[0] - 0.7 * k) <= 1
  assert [j for s, j in picks if s == 1][:5] == [0, 1, 2, 3, 4]  # each source in order
  assert mixture.parse_data(['a:0.7', 'b:3']) == [('a', 0.7), ('b', 3.0)]
  with pytest.raises(ValueError, match=r'b has none, a has one'):
    mixture.parse_data(['a:1', 'b'])
  with pytest.raises(ValueError, match=r"weight of a must be a number > 0, got '-1'"):
    mixture.parse_data(['a:-1', 'b:1'])
  tmp = tmp_path_factory.mktemp('weights')
  (tmp / 'a.txt').write_text('a')
  with pytest.raises(ValueError, match=r"weight of .*a.txt must be a number > 0, got 'x'"):
    mixture.parse_data([f'{tmp}/a.txt:x', 'b:1'])  # a path that exists: x is its weight
  assert mixture.parse_data(['no/such:x']) == [('no/such:x', None)]  # a colon in a path
  order = mixture.interleave([4, 2], [1, 1])
  assert order.tolist() == [[0, 0], [1, 0], [0, 1], [1, 1], [0, 2], [0, 3]]


@pytest.mark.slow
def test_a_mixture_trains_resumes_bit_exactly_and_reports_each_source(corpora, tmp_path,
                                                                     capsys):
  """Files and a prepared directory mixed 0.7 : 0.3, validated on a set of its own."""
  data, val = [f'{corpora / "a"}:0.7', f'{corpora / "pb"}:0.3'], [str(corpora / 'val')]
  straight = _cfg(tmp_path / 's', data, val_data=val)
  s = train(straight, **QUIET)
  split = _cfg(tmp_path / 'r', data, val_data=val)
  train(split, stop_after=3, **QUIET)
  train(split, resume=True, **QUIET)
  assert _losses(straight.out_dir) == _losses(split.out_dir) and len(_losses(split.out_dir)) == 6

  names = [str(corpora / 'a'), str(corpora / 'pb')]
  assert s['windows_drawn'] == dict(zip(names, mixture.Selection([0.7, 0.3]).counts(24)))
  assert _records(split.out_dir)[-1]['windows_drawn'] == s['windows_drawn']
  record = json.loads((pathlib.Path(straight.out_dir) / 'data.json').read_text())
  assert [(x['data'], x['weight']) for x in record['sources']] == list(zip(names, [0.7, 0.3]))
  assert all(x['train_windows'] > 0 and x['val_windows'] == 0 for x in record['sources'])
  assert record['train_tokens'] == sum(x['train_tokens'] for x in record['sources'])
  d = loading.load_data(straight)
  assert record['val_data']['windows'] == len(d.val_windows) > 0
  assert any('val_loss' in r for r in _records(straight.out_dir))
  capsys.readouterr()
  assert cli.main(['eval', straight.out_dir, '--eval-batches', 'all']) == 0
  assert json.loads(capsys.readouterr().out.splitlines()[-1])['val_windows_total'] == len(
      d.val_windows)

  # Other weights, another validation set: another corpus, which --resume refuses.
  with pytest.raises(CheckpointError, match='--resume: the corpus no longer matches'):
    train(_cfg(tmp_path / 's', [f'{corpora / "a"}:0.5', f'{corpora / "pb"}:0.5'],
               val_data=val, steps=7), resume=True, **QUIET)
  (tmp_path / 'val2').mkdir()
  (tmp_path / 'val2' / 'v.txt').write_text('other held out text. ' * 60)
  with pytest.raises(CheckpointError, match='validation split'):
    train(_cfg(tmp_path / 's', data, val_data=[str(tmp_path / 'val2')], steps=7),
          resume=True, **QUIET)


def test_every_source_is_used_or_refused_by_name(corpora, tmp_path):
  def refused(data, match, **kw):
    with pytest.raises(ValueError, match=match):
      loading.load_data(_cfg(tmp_path, data, **kw))

  pa, pb, a = str(corpora / 'pa'), str(corpora / 'pb'), str(corpora / 'a')
  refused([pa, a], f'{pa} is a prepared dataset directory.*--data {pa}:1 {a}:1')
  refused([pa, pb], f'{pa} is a prepared dataset directory.*weight')
  refused([a], f'--val-data {a}/doc00.txt is also trained on', val_data=[f'{a}/doc00.txt'])
  refused([a], 'takes paths, not weights', val_data=[f'{pb}:1'])
  refused([f'{pa}:1', f'{corpora / "pc"}:1'], f'{pa} and {corpora / "pc"} were prepared '
          f'with different tokenizers')
  both = loading.load_data(_cfg(tmp_path, [f'{pa}:1', f'{pb}:1']))  # two prepared: mixed
  assert len(both.parts) == 2 and all(len(p.train_windows) for p in both.parts)
  assert len(both.train_windows) == sum(len(p.train_windows) for p in both.parts)
  val = np.asarray(both.val_windows)
  assert val.shape == (sum(len(p.val_windows) for p in both.parts), 33)
  np.testing.assert_array_equal(val[:2], np.stack([both.parts[0].val_windows[0],
                                                   both.parts[1].val_windows[0]]))
