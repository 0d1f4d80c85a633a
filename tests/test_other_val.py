"""compare_quality.py --other-val: runs scored on text other than their own
validation set, and site_corpus.py's prose set for it (CPU, tiny Llama)."""

import contextlib
import io
import math
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
from experiments import compare_quality
from experiments import site_corpus
from conftest import write_corpus


def _args(tmp, train, val, *other):
  return ['--model', 'tiny', '--model-overrides', 'layers=1,mlp=64', '--seq-len', '32',
          '--batch-size', '4', '--steps', '8',
          '--warmup', '1', '--eval-every', '4', '--eval-batches', '3', '--log-every', '2',
          '--merge-every', '6', '--block-size', '16', '--vocab-size', '300',
          '--dtype', 'float32', '--data', str(train), '--val-data', str(val),
          '--cache-dir', str(tmp / 'cache'), '--out', str(tmp / 'out'),
          *[x for o in other for x in ('--other-val', o)],
          '--runs', 'optimizer=adamw,lr=3e-3']


@pytest.mark.slow
def test_other_val_scores_each_evaluation_and_agrees_with_the_own_validation(tmp_path):
  """Given the run's own validation folder as an --other-val text, the score
  is the run's validation perplexity at every evaluation (same windows, same
  tokenizer, same model); a text of other words scores otherwise; the report
  has the table."""
  (tmp_path / 'train').mkdir()
  train = write_corpus(tmp_path / 'train', docs=30, words=150)
  val = tmp_path / 'val'
  val.mkdir()
  for i in range(6):  # the training words, other documents
    (val / f'v{i}.txt').write_text((train / f'doc{i:02d}.txt').read_text()[::-1])
  prose = tmp_path / 'prose'
  prose.mkdir()
  for i in range(6):
    (prose / f'p{i}.txt').write_text(' '.join(f'zq{j * 7 % 23}x' for j in range(400)) + '\n')
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    res = compare_quality.main(_args(tmp_path, train, val, f'same={val}', f'prose={prose}'))
  (run,) = res['runs']
  own = {e['step']: e['val_ppl'] for e in run['evals']}
  assert sorted(own) == [0, 4, 8]
  same = {e['step']: e['val_ppl'] for e in run['other_val']['same']}
  assert same.keys() == own.keys()
  for step in own:
    assert same[step] == pytest.approx(own[step], rel=1e-5)
  other = {e['step']: e['val_ppl'] for e in run['other_val']['prose']}
  assert other.keys() == own.keys() and all(math.isfinite(v) for v in other.values())
  assert abs(math.log(other[8]) - math.log(own[8])) > 0.1
  assert run['other_val_final'] == {'same': same[8], 'prose': other[8]}
  (config,) = res['configurations']
  assert config['other_val_final']['prose']['mean'] == other[8]
  md = (tmp_path / 'out' / 'quality.md').read_text()
  assert '## Validation on other text' in md and '| same | prose |' in md


@pytest.mark.parametrize('flag, message', [
    ('noequals', 'NAME=PATH'), ('a/b=x', 'NAME=PATH'), ('a=/no/such/dir', 'does not exist')])
def test_bad_other_val_is_named(tmp_path, capsys, flag, message):
  """A malformed or missing --other-val stops before anything trains, naming it."""
  with pytest.raises(SystemExit):
    compare_quality.parse_args(['--other-val', flag, '--out', str(tmp_path / 'o')])
  err = capsys.readouterr().err
  assert flag in err and message in err
  assert not (tmp_path / 'o').exists()


def test_other_val_names_one_set_once(tmp_path, capsys):
  with pytest.raises(SystemExit):
    compare_quality.parse_args(['--other-val', f'x={tmp_path}', '--other-val', f'x={tmp_path}'])
  assert "names 'x' twice" in capsys.readouterr().err


def test_site_corpus_prose_is_the_standard_librarys_help_topics(tmp_path):
  """OUT/prose holds every pydoc help topic, one file each, text unchanged."""
  from pydoc_data.topics import topics
  (tmp_path / 'prose').mkdir()
  (tmp_path / 'prose' / 'stale.txt').write_text('left from before')
  chars = site_corpus.write_prose(tmp_path / 'prose')
  files = sorted((tmp_path / 'prose').iterdir())
  assert sorted(f.stem for f in files) == sorted(topics)
  assert chars == sum(map(len, topics.values())) > 100_000
  assert (tmp_path / 'prose' / 'if.txt').read_text(encoding='utf-8') == topics['if']


def test_other_val_under_home_is_the_home_directory(tmp_path, monkeypatch):
  """NAME=~/PATH (no shell expands a tilde after '=') names the home directory."""
  (tmp_path / 'prose').mkdir()
  monkeypatch.setenv('HOME', str(tmp_path))
  assert compare_quality.other_val_sets(['p=~/prose']) == [('p', tmp_path / 'prose')]
