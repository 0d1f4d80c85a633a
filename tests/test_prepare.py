"""poetx prepare: corpus files -> token shards, and training that streams from them."""

import concurrent.futures
import gzip
import json
import pickle

import numpy as np
import pytest

from conftest import SMALL, write_corpus
from poetx_jax.pretrain import cli
from poetx_jax.pretrain.data import windows as data, prepare, shards
from poetx_jax.pretrain.config import TrainConfig
from poetx_jax.pretrain.data.tokenizer import Tokenizer, file_hash, tokenize_corpus
from poetx_jax.pretrain.train import train


@pytest.fixture(scope='module')
def sources(tmp_path_factory):
  """A corpus in every format: text files, jsonl, jsonl.gz and parquet."""
  root = tmp_path_factory.mktemp('sources')
  docs = data.read_documents(write_corpus(tmp_path_factory.mktemp('words'), docs=60))
  write = root / 'src'
  (write / 'texts').mkdir(parents=True)
  for i, d in enumerate(docs[:10]):
    (write / 'texts' / f'{i:02d}.txt').write_text(d)
  (write / 'b.jsonl').write_text(''.join(json.dumps({'text': d}) + '\n' for d in docs[10:30]))
  with gzip.open(write / 'c.jsonl.gz', 'wt') as f:
    f.writelines(json.dumps({'text': d, 'id': i}) + '\n' for i, d in enumerate(docs[30:50]))
  pa, pq = pytest.importorskip('pyarrow'), pytest.importorskip('pyarrow.parquet')
  pq.write_table(pa.table({'text': docs[50:]}), write / 'd.parquet', row_group_size=3)
  return write


def _prepare(sources, out, **kw):
  return prepare.prepare([sources], out, **{'vocab_size': 300, 'shard_tokens': 700,
                                            'workers': 1, 'progress': False, **kw})


def test_prepared_stream_is_the_tokenized_corpus(sources, tmp_path):
  m = _prepare(sources, tmp_path / 'ds', workers=2)
  docs = data.read_documents([sources])
  tok = Tokenizer.load(tmp_path / 'ds' / 'tokenizer.json')
  want = tokenize_corpus(docs, tok)
  stream = shards.TokenShards(tmp_path / 'ds')
  np.testing.assert_array_equal(stream.read(0, len(stream)), want)
  np.testing.assert_array_equal(stream.read(695, 1410), want[695:1410])  # across shards
  assert m['tokens'] == len(want) and m['documents'] == len(docs)
  assert m['dtype'] == 'uint16' and all(s['tokens'] <= 700 for s in m['shards'])
  assert len(m['shards']) > len(m['sources'])  # files span several shards
  for s in m['sources']:
    assert s['sha256'] == file_hash(s['path'])
  for s in m['shards']:
    raw = (tmp_path / 'ds' / s['file']).read_bytes()
    assert len(raw) == 2 * s['tokens']

  # The windows are those of TextData on the same documents and tokenizer.
  prepared = shards.PreparedData(tmp_path / 'ds', seq_len=32, val_fraction=0.1)
  text = data.TextData(docs, seq_len=32, val_fraction=0.1, cache_dir=tmp_path / 'cache',
                       tokenizer_path=tmp_path / 'ds' / 'tokenizer.json')
  np.testing.assert_array_equal(np.asarray(prepared.train_windows), text.train_windows)
  np.testing.assert_array_equal(np.asarray(prepared.val_windows), text.val_windows)
  idx = np.array([7, 0, 3])
  np.testing.assert_array_equal(prepared.train_windows[1::2][idx], text.train_windows[1::2][idx])
  assert prepared.train_windows[1::2].shape == text.train_windows[1::2].shape
  assert prepared.fingerprint['val_tokens'] == text.fingerprint['val_tokens']


def test_rerun_is_a_no_op_and_an_interrupted_prepare_resumes(sources, tmp_path):
  out = tmp_path / 'ds'
  m = _prepare(sources, out)
  stamps = {f.name: f.stat().st_mtime_ns for f in out.iterdir() if f.is_file()}
  assert _prepare(sources, out) == m
  assert {f.name: f.stat().st_mtime_ns for f in out.iterdir() if f.is_file()} == stamps

  # Interrupted after two files: no manifest, the other parts and their shards gone.
  (out / 'manifest.json').unlink()
  for part in sorted((out / 'parts').iterdir())[2:]:
    part.unlink()
  for shard in m['shards']:
    if int(shard['file'].split('-')[1]) >= 2:
      (out / shard['file']).unlink()
  again = _prepare(sources, out)
  assert again == m
  assert (out / m['shards'][0]['file']).stat().st_mtime_ns == stamps[m['shards'][0]['file']]

  # Other inputs into the same directory are refused.
  with pytest.raises(ValueError, match='other inputs'):
    prepare.prepare([sources / 'b.jsonl'], out, vocab_size=300, progress=False)
  # So is another shard size (it would leave the shards as they are, silently).
  stamps = {f.name: f.stat().st_mtime_ns for f in out.iterdir() if f.is_file()}
  with pytest.raises(ValueError, match=f'shards of at most {m["shard_tokens"]} tokens, '
                                       f'not --shard-tokens 77'):
    _prepare(sources, out, shard_tokens=77)
  assert {f.name: f.stat().st_mtime_ns for f in out.iterdir() if f.is_file()} == stamps
  # A damaged manifest is named.
  (out / 'manifest.json').write_text('{}')
  with pytest.raises(ValueError, match=f"{out / 'manifest.json'} is damaged \\(no 'sources'"):
    _prepare(sources, out)


def test_damaged_dataset_and_bad_inputs_are_clear_errors(sources, tmp_path):
  m = _prepare(sources, tmp_path / 'ds')
  shard = tmp_path / 'ds' / m['shards'][3]['file']
  shard.write_bytes(shard.read_bytes()[:-2])
  with pytest.raises(ValueError, match=f'shard {m["shards"][3]["file"]} does not match'):
    shards.PreparedData(tmp_path / 'ds', seq_len=16)
  shard.unlink()
  with pytest.raises(ValueError, match='missing'):
    shards.TokenShards(tmp_path / 'ds')
  with pytest.raises(ValueError, match='not a prepared dataset'):
    shards.TokenShards(tmp_path)

  bad = tmp_path / 'bad'
  bad.mkdir()
  (bad / 'latin1.txt').write_bytes(b'caf\xe9 au lait\n')
  with pytest.raises(ValueError, match=r'latin1\.txt is not UTF-8'):  # named: strict
    prepare.prepare([bad / 'latin1.txt'], tmp_path / 'b', vocab_size=300, progress=False)
  (bad / 'latin1.txt').unlink()
  (bad / 'rec.jsonl').write_text('{"body": "x"}\n')
  with pytest.raises(ValueError, match=r"rec\.jsonl, line 1: no string field 'text'"):
    prepare.prepare([bad], tmp_path / 'b2', vocab_size=300, progress=False)
  with pytest.raises(FileNotFoundError, match='nope'):
    prepare.prepare([tmp_path / 'nope'], tmp_path / 'b3', progress=False)
  with pytest.raises(ValueError, match='shard_tokens must be a positive int'):
    prepare.prepare([sources], tmp_path / 'b4', shard_tokens=0)
  # A vocabulary too small for a BPE is refused before anything is written.
  with pytest.raises(ValueError, match=r'vocab_size must be an int in \[257, 16777216\] .* got 100$'):
    prepare.prepare([sources], tmp_path / 'b5', vocab_size=100, progress=False)
  assert not (tmp_path / 'b5').exists()
  assert prepare.token_dtype(65536) == np.uint16 and prepare.token_dtype(65537) == np.uint32


@pytest.mark.slow
def test_train_streams_from_a_prepared_directory(sources, tmp_path, capsys):
  assert cli.main(['prepare', str(sources), '--out', str(tmp_path / 'ds'), '--vocab-size',
                   '300', '--workers', '1']) == 0
  assert 'tokens (uint16)' in capsys.readouterr().out
  cfg = TrainConfig(model='tiny', model_overrides=SMALL,
                    data=[str(tmp_path / 'ds')], seq_len=32, batch_size=4, steps=6,
                    warmup=1, merge_every=3, block_size=8, eval_every=3, eval_batches=2,
                    log_every=1, checkpoint_every=3, dtype='float32',
                    out_dir=str(tmp_path / 'run'), cache_dir=str(tmp_path / 'cache'))
  train(cfg)
  recs = [json.loads(l) for l in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  losses = [r['loss'] for r in recs if 'loss' in r]
  assert len(losses) == 6 and all(np.isfinite(losses))
  record = json.loads((tmp_path / 'run' / 'data.json').read_text())
  assert record['tokenizer_sha256'] == file_hash(tmp_path / 'ds' / 'tokenizer.json')
  assert cli.main(['eval', str(tmp_path / 'run')]) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])['val_ppl'] > 1

  # Resumed from its step-3 checkpoint, the run repeats steps 4-6 exactly.
  assert cli.main(['train', '--resume', '--step', '3', '--out-dir',
                   str(tmp_path / 'run')]) == 0
  recs = [json.loads(l) for l in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
  assert [r['loss'] for r in recs if 'loss' in r][-3:] == losses[3:]


def test_prepared_windows_index_like_arrays(tmp_path):
  (tmp_path / 'src').mkdir()
  (tmp_path / 'src' / 'a.txt').write_text('one two three four five six seven eight ' * 40)
  prepare.prepare([tmp_path / 'src'], tmp_path / 'ds', vocab_size=280, shard_tokens=50,
                  workers=1, progress=False)
  stream = shards.TokenShards(tmp_path / 'ds')
  tokens = stream.read(0, len(stream))
  windows = shards.TokenWindows(stream, 0, len(tokens), 7)
  want = data.pack(tokens, 7)
  assert windows.shape == want.shape and len(windows) == len(want)
  for key in (0, -1, len(want) - 1):
    np.testing.assert_array_equal(windows[key], want[key])
  np.testing.assert_array_equal(windows[2:9:3][np.array([2, 0])], want[2:9:3][[2, 0]])
  np.testing.assert_array_equal(np.asarray(windows[::5]), want[::5])
  with pytest.raises(IndexError):
    windows[np.array([[0]])]

  # Read from several threads at once (grain's readers), and after pickling.
  fresh = shards.TokenWindows(shards.TokenShards(tmp_path / 'ds'), 0, len(tokens), 7)
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    got = list(pool.map(lambda i: fresh[int(i)], np.arange(len(want)).repeat(4)))
  np.testing.assert_array_equal(np.stack(got), want.repeat(4, axis=0))
  np.testing.assert_array_equal(pickle.loads(pickle.dumps(fresh))[3:6][np.arange(3)], want[3:6])


def test_a_folder_of_python_sources_skips_what_is_not_text(tmp_path, capsys):
  """.py files are documents; in a folder, text files that are not UTF-8, are
  binary or unreadable are skipped and named in the manifest (named on the
  command line they are errors)."""
  src = tmp_path / 'site-packages' / 'pkg'
  src.mkdir(parents=True)
  for i in range(6):
    (src / f'm{i}.py').write_text(f'def f{i}(x):\n  return x * {i}  # the {i}th\n' * 20)
  (src / 'latin1.py').write_bytes(b'# caf\xe9\nx = 1\n')
  (src / 'nul.txt').write_bytes(b'text\x00with a NUL\n')
  (src / 'data.bin').write_bytes(b'\xff\xfe')  # no corpus extension: never read
  assert cli.main(['prepare', str(src.parent), '--out', str(tmp_path / 'ds'), '--vocab-size',
                   '300', '--workers', '1']) == 0
  out = capsys.readouterr().out
  assert 'of 6 documents from 8 sources' in out and 'skipped 2 text files' in out
  m = json.loads((tmp_path / 'ds' / 'manifest.json').read_text())
  assert {s['path'].rsplit('/', 1)[1]: s.get('skipped') for s in m['sources']
          if s.get('skipped')} == {'latin1.py': 'not UTF-8', 'nul.txt': 'binary (a NUL byte)'}
  assert len(m['shards']) == 1  # small files share a task and its shards
  docs = data.read_documents([src.parent])  # training from the folder skips the same
  tok = Tokenizer.load(tmp_path / 'ds' / 'tokenizer.json')
  stream = shards.TokenShards(tmp_path / 'ds')
  np.testing.assert_array_equal(stream.read(0, len(stream)), tokenize_corpus(docs, tok))
  with pytest.raises(ValueError, match=r'nul\.txt holds a NUL byte'):
    data.read_documents([src / 'nul.txt'])
