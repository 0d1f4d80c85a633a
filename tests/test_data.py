"""Text data: reading corpora, the BPE tokenizer, packing, splitting, grain batches."""

import gzip
import json
import os
import sys
import sysconfig
import zipfile
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from poetx_jax.pretrain.data import corpus as corpus_lib
from poetx_jax.pretrain.data import windows as data, tokenizer

DOCS = [
    'The quick brown fox jumps over the lazy dog.\n',
    '  Leading spaces, trailing spaces  \n\nand blank lines.',
    'Unicode: naïve café, 東京, emoji 🙂, Ελληνικά.',
    'def f(x):\n\treturn x ** 2  # tabs and code\n',
]


def _write_jsonl(path, records, compress=False):
  text = ''.join(json.dumps(r) + '\n' for r in records)
  if compress:
    with gzip.open(path, 'wt', encoding='utf-8') as f:
      f.write(text)
  else:
    path.write_text(text, encoding='utf-8')


# ----------------------------------------------------------------------------- documents


def test_read_documents_formats(tmp_path):
  pa = pytest.importorskip('pyarrow')
  pq = pytest.importorskip('pyarrow.parquet')
  (tmp_path / 'a.txt').write_text(DOCS[0], encoding='utf-8')
  (tmp_path / 'b.md').write_text(DOCS[1], encoding='utf-8')
  (tmp_path / 'empty.rst').write_text('  \n', encoding='utf-8')  # dropped
  _write_jsonl(tmp_path / 'c.jsonl', [{'text': DOCS[2], 'url': 'x'}, {'text': ''}])
  _write_jsonl(tmp_path / 'd.jsonl.gz', [{'text': DOCS[3]}], compress=True)
  sub = tmp_path / 'sub'
  sub.mkdir()
  _write_jsonl(sub / 'e.json.gz', [{'text': 'c4 style'}, {'text': 'second'}], compress=True)
  pq.write_table(pa.table({'text': ['pq one', None, 'pq two']}), sub / 'f.parquet')
  (sub / 'notes.csv').write_text('ignored in a directory')

  assert data.read_documents(tmp_path / 'a.txt') == [DOCS[0]]
  assert data.read_documents([tmp_path / 'b.md']) == [DOCS[1]]
  assert data.read_documents([str(tmp_path / 'c.jsonl')]) == [DOCS[2]]
  assert data.read_documents([tmp_path / 'd.jsonl.gz']) == [DOCS[3]]
  assert data.read_documents([sub / 'e.json.gz']) == ['c4 style', 'second']
  assert data.read_documents([sub / 'f.parquet']) == ['pq one', 'pq two']
  # A directory: recursive, sorted by path, unsupported files skipped.
  assert data.read_documents([tmp_path]) == DOCS + ['c4 style', 'second', 'pq one', 'pq two']
  _write_jsonl(tmp_path / 'g.jsonl', [{'body': 'another field'}])
  assert data.read_documents([tmp_path / 'g.jsonl'], text_field='body') == ['another field']
  # Several paths concatenate in order.
  assert data.read_documents([tmp_path / 'd.jsonl.gz', tmp_path / 'a.txt']) == [DOCS[3], DOCS[0]]


def test_read_documents_directory_skips_other_formats(tmp_path):
  (tmp_path / 'a.txt').write_text('alpha', encoding='utf-8')
  (tmp_path / 'z').mkdir()
  (tmp_path / 'z' / 'b.rst').write_text('beta', encoding='utf-8')
  (tmp_path / 'z' / 'c.json').write_text('{"text": "not a supported extension"}')
  assert data.read_documents(tmp_path) == ['alpha', 'beta']


def test_read_documents_errors(tmp_path, monkeypatch):
  missing = tmp_path / 'nope.jsonl'
  with pytest.raises(FileNotFoundError, match='nope.jsonl'):
    data.read_documents([missing])

  bad = tmp_path / 'data.csv'
  bad.write_text('a,b\n')
  with pytest.raises(ValueError, match=r'data\.csv.*\.jsonl\.gz.*\.parquet.*\.txt'):
    data.read_documents([bad])

  no_field = tmp_path / 'no_field.jsonl'
  _write_jsonl(no_field, [{'text': 'ok'}, {'text': 'ok'}, {'content': 'no text'}])
  with pytest.raises(ValueError, match=r"no_field\.jsonl, line 3: no string field 'text'"):
    data.read_documents([no_field])

  not_json = tmp_path / 'broken.jsonl.gz'
  with gzip.open(not_json, 'wt') as f:
    f.write('{"text": "ok"}\n{broken\n')
  with pytest.raises(ValueError, match=r'broken\.jsonl\.gz, line 2: invalid JSON'):
    data.read_documents([not_json])

  pa = pytest.importorskip('pyarrow')
  pq = pytest.importorskip('pyarrow.parquet')
  table = tmp_path / 't.parquet'
  pq.write_table(pa.table({'content': ['x']}), table)
  with pytest.raises(ValueError, match=r"t\.parquet: no column 'text'"):
    data.read_documents([table])
  monkeypatch.setitem(sys.modules, 'pyarrow.parquet', None)
  with pytest.raises(ImportError, match='pyarrow'):
    data.read_documents([table], text_field='content')
  monkeypatch.undo()

  blank = tmp_path / 'blank.txt'
  blank.write_text(' \n\t\n')
  empty_dir = tmp_path / 'empty_dir'
  empty_dir.mkdir()
  with pytest.raises(ValueError, match=r'corpus is empty: .*blank\.txt.*empty_dir'):
    data.read_documents([blank, empty_dir])


@pytest.mark.slow
def test_default_corpus():
  docs, desc = corpus_lib.default_corpus(doc_root='/nonexistent')
  sources = corpus_lib.stdlib_sources()
  packages, found = corpus_lib.package_sources()
  assert len(sources) > 500 and sum(map(len, sources)) > 10_000_000
  assert docs[:len(sources)] == sources
  stdlib = Path(sysconfig.get_paths()['stdlib'])
  assert (stdlib / 'os.py').read_text(encoding='utf-8') in sources
  assert docs[len(sources):len(sources) + len(packages)] == packages
  assert f'jax {jax.__version__}' in found and sum(map(len, packages)) > 10_000_000
  topics = docs[len(sources) + len(packages):]
  assert len(topics) >= 50 and all(isinstance(d, str) and d.strip() for d in topics)
  assert ' '.join(topics[:20]).count(' the ') > 100  # English prose, last: the validation split
  assert desc.startswith(f'default corpus: {len(docs)} documents, {sum(map(len, docs)):,} characters')
  assert (f'{len(sources)} standard library sources + {len(packages)} sources of '
          f'{", ".join(found)} + ') in desc and '\n' not in desc


def test_stdlib_sources_skip_installed_packages_and_bad_files(tmp_path):
  (tmp_path / 'pkg').mkdir()
  (tmp_path / 'pkg' / 'b.py').write_text('import os\n')
  (tmp_path / 'a.py').write_text('x = 1\n')
  (tmp_path / 'empty.py').write_text('  \n')
  (tmp_path / 'latin1.py').write_bytes(b'# \xe9\n')
  (tmp_path / 'notes.txt').write_text('not a source')
  for skipped in ('site-packages', 'pydoc_data'):
    (tmp_path / skipped).mkdir()
    (tmp_path / skipped / 'c.py').write_text('y = 2\n')
  assert corpus_lib.stdlib_sources(tmp_path) == ['x = 1\n', 'import os\n']
  bundled = tmp_path / 'ensurepip' / '_bundled'
  bundled.mkdir(parents=True)
  with zipfile.ZipFile(bundled / 'pip-1.0-py3-none-any.whl', 'w') as z:
    z.writestr('pip/z.py', 'z = 3\n')
    z.writestr('pip/__init__.py', 'w = 4\n')
    z.writestr('pip/README.txt', 'not a source')
  assert corpus_lib.stdlib_sources(tmp_path) == ['x = 1\n', 'import os\n', 'w = 4\n', 'z = 3\n']


def test_package_sources(tmp_path, monkeypatch):
  pkg = tmp_path / 'corpus_pkg'
  (pkg / 'sub').mkdir(parents=True)
  (pkg / '__init__.py').write_text('"""A package."""\n')
  (pkg / 'sub' / 'mod.py').write_text('def f():\n  return 1\n')
  (pkg / 'latin1.py').write_bytes(b'# \xe9\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  docs, found = corpus_lib.package_sources(['no_such_package_here', 'corpus_pkg', 'optax'])
  assert docs[:2] == ['"""A package."""\n', 'def f():\n  return 1\n']
  assert found == ['corpus_pkg', f'optax {optax.__version__}']
  assert len(docs) > 50 and 'def adamw(' in ''.join(docs[2:])


def test_default_corpus_doc_sources(tmp_path):
  topics_only, desc = corpus_lib.default_corpus(doc_root=tmp_path / 'missing', stdlib_root=False,
                                               packages=())
  assert 'documentation sources' not in desc and 'standard library' not in desc
  assert desc.endswith(f'({len(topics_only)} pydoc_data.topics entries)')
  for minor in (9, 12):
    src = tmp_path / f'python3.{minor}' / 'html' / '_sources' / 'library'
    src.mkdir(parents=True)
    (src / 'os.rst.txt').write_text(f'The os module of 3.{minor}.')
    (src / 'skip.html').write_text('not a source')
  os.symlink(tmp_path / 'python3.12', tmp_path / 'python3.12-doc')  # an alias
  docs, desc = corpus_lib.default_corpus(doc_root=tmp_path, stdlib_root=False, packages=())
  assert docs == topics_only + ['The os module of 3.12.']
  assert '1 Python 3.12 documentation sources' in desc


# ----------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope='module')
def corpus():
  docs, _ = corpus_lib.default_corpus(doc_root='/nonexistent', stdlib_root=False,
                                packages=())  # quick to train on
  return docs[:25] + DOCS


@pytest.fixture(scope='module')
def tok(corpus, tmp_path_factory):
  return tokenizer.train_bpe(corpus, vocab_size=512, path=tmp_path_factory.mktemp('tok') / 'bpe.json')


ROUND_TRIP = [
    '',
    ' ',
    '   leading spaces and trailing   ',
    '\n\nnewlines\r\nand\ttabs\n',
    'Never seen: zyxwvut qqqq Pneumonoultramicroscopicsilicovolcanoconiosis',
    'naïve café — “quotes” 東京タワー 🙂🚀 Ελληνικά עברית \u200b zero-width',
    'text with a literal <|endoftext|> inside',
    'def f(x):\n    return {"a": [1, 2.5e-3]}\n',
]


@pytest.mark.parametrize('text', ROUND_TRIP)
def test_bpe_round_trip(tok, text):
  ids = tok.encode(text)
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == text
  assert tok.decode(np.asarray(ids, np.int32)) == text


def test_bpe_tokenizer(tok, corpus):
  assert tok.vocab_size == 512
  assert tok.encode('<|endoftext|>') == [tok.eos_id]
  assert tok.decode([tok.eos_id]) == '<|endoftext|>'
  assert tok.encode_batch(ROUND_TRIP) == [tok.encode(t) for t in ROUND_TRIP]
  assert len(tok.encode(corpus[0])) < len(corpus[0].encode()) / 2  # it learned merges
  again = tokenizer.Tokenizer.load(tok.path)
  assert again.encode(ROUND_TRIP[5]) == tok.encode(ROUND_TRIP[5])
  assert (again.eos_id, again.vocab_size) == (tok.eos_id, tok.vocab_size)


def test_tokenizer_errors(tmp_path, corpus):
  with pytest.raises(FileNotFoundError, match='missing.json'):
    tokenizer.Tokenizer.load(tmp_path / 'missing.json')
  with pytest.raises(FileNotFoundError, match='missing.json'):
    tokenizer.load_or_train_tokenizer(corpus, path=tmp_path / 'missing.json', cache_dir=tmp_path)
  with pytest.raises(ValueError, match=r'vocab_size must be an int in \[257, 16777216\]'):
    tokenizer.train_bpe(corpus, vocab_size=100, path=tmp_path / 'x.json')
  (tmp_path / 'garbage.json').write_text('{"not": "a tokenizer"}')
  with pytest.raises(ValueError, match='not a tokenizers JSON file'):
    tokenizer.Tokenizer.load(tmp_path / 'garbage.json')
  try:
    import sentencepiece  # noqa: F401 pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    (tmp_path / 'sp.model').write_bytes(b'\0')
    with pytest.raises(ImportError, match='sentencepiece'):
      tokenizer.Tokenizer.load(tmp_path / 'sp.model')


def test_tokenizer_cache_reused(tmp_path, corpus, monkeypatch):
  docs = corpus[:10]
  first = tokenizer.load_or_train_tokenizer(docs, vocab_size=300, cache_dir=tmp_path)
  assert first.path.parent == tmp_path and first.path.is_file()
  mtime = first.path.stat().st_mtime_ns

  def no_training(*args, **kwargs):
    raise AssertionError('retrained a cached tokenizer')

  monkeypatch.setattr(tokenizer.Tokenizer, 'train_bpe', no_training)
  second = tokenizer.load_or_train_tokenizer(docs, vocab_size=300, cache_dir=tmp_path)
  assert second.path == first.path and second.path.stat().st_mtime_ns == mtime
  assert second.encode(DOCS[2]) == first.encode(DOCS[2])
  with pytest.raises(AssertionError, match='retrained'):  # other corpus: other key
    tokenizer.load_or_train_tokenizer(docs[:9], vocab_size=300, cache_dir=tmp_path)
  with pytest.raises(AssertionError, match='retrained'):  # other vocab size: other key
    tokenizer.load_or_train_tokenizer(docs, vocab_size=301, cache_dir=tmp_path)


def test_tokenize_corpus(tok, tmp_path):
  docs = DOCS + ['short', 'x']
  tokens = tokenizer.tokenize_corpus(docs, tok)
  assert tokens.dtype == np.int32 and tokens.ndim == 1
  assert (tokens == tok.eos_id).sum() == len(docs)
  assert tokens[-1] == tok.eos_id
  ends = np.flatnonzero(tokens == tok.eos_id)
  pieces = np.split(tokens, ends + 1)[:-1]  # each document's ids and its eos
  assert [p[:-1].tolist() for p in pieces] == [tok.encode(d) for d in docs]
  assert tok.decode(tokens) == '<|endoftext|>'.join(docs) + '<|endoftext|>'

  cached = tokenizer.tokenize_corpus(docs, tok, cache_dir=tmp_path)
  files = list(tmp_path.glob('tokens-*.npy'))
  assert len(files) == 1 and np.array_equal(cached, tokens)
  np.save(files[0], tokens[:3])  # a cache hit reads the file, it does not re-encode
  assert np.array_equal(tokenizer.tokenize_corpus(docs, tok, cache_dir=tmp_path), tokens[:3])


def test_a_cache_dir_under_home_is_expanded(tok, corpus, tmp_path, monkeypatch):
  """cache_dir '~/...' (the app's default) caches under the home directory,
  not in a directory named '~' below the working directory."""
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))
  monkeypatch.chdir(tmp_path)
  trained = tokenizer.load_or_train_tokenizer(corpus[:10], vocab_size=300, cache_dir='~/c')
  tokenizer.tokenize_corpus(DOCS, tok, cache_dir='~/c')
  assert trained.path.parent == tmp_path / 'home' / 'c'
  assert len(list((tmp_path / 'home' / 'c').glob('tokens-*.npy'))) == 1
  assert not (tmp_path / '~').exists()


# ----------------------------------------------------------------------------- windows


def _unpack(windows):
  """The token stream back from overlapping windows (padding kept)."""
  return np.concatenate([windows[0], windows[1:, 1:].ravel()])


@pytest.mark.parametrize('n,seq_len', [(1, 4), (2, 4), (5, 4), (9, 4), (10, 4), (100, 7), (64, 1)])
def test_pack(n, seq_len):
  tokens = np.random.default_rng(n).integers(0, 1000, n).astype(np.int32)
  w = data.pack(tokens, seq_len)
  assert w.dtype == np.int32 and w.shape[1] == seq_len + 1
  assert w.flags.c_contiguous and w.flags.writeable  # an array of its own, not a view
  assert w.shape[0] == max(1, -(-(n - 1) // seq_len))  # as few windows as can hold it
  np.testing.assert_array_equal(w[:-1, -1], w[1:, 0])  # overlap by one token
  stream = _unpack(w)
  np.testing.assert_array_equal(stream[:n], tokens)  # no token lost
  assert (stream[n:] == -1).all() and (stream[:n] >= 0).all()  # padding only at the end
  assert n == 1 or len(stream) - n < seq_len  # less than a window of padding
  targets = w[:, 1:].ravel()
  np.testing.assert_array_equal(targets[targets >= 0], tokens[1:])  # each a target once


def test_pack_edge_cases():
  assert data.pack(np.zeros(0, np.int32), 8).shape == (0, 9)
  with pytest.raises(ValueError, match='seq_len must be a positive int, got 0'):
    data.pack(np.arange(5), 0)
  with pytest.raises(ValueError, match=r'tokens must be 1-D, got shape \(2, 3\)'):
    data.pack(np.zeros((2, 3)), 2)


def test_split():
  tokens = np.arange(1000, dtype=np.int32)
  train, val = data.split(tokens, val_fraction=0.1, seq_len=16)
  assert len(val) == 100 and np.array_equal(np.concatenate([train, val]), tokens)
  assert np.array_equal(val, tokens[-100:])
  train, val = data.split(tokens, val_fraction=0.001, seq_len=16)
  assert len(val) == 17  # at least one window
  data.split(np.arange(34), val_fraction=0.05, seq_len=16)  # 17 + 17: just enough
  with pytest.raises(ValueError, match='it has 33 tokens, and needs at least 34'):
    data.split(np.arange(33), val_fraction=0.05, seq_len=16)
  with pytest.raises(ValueError, match='it has 60 tokens, and needs at least 85'):
    data.split(np.arange(60), val_fraction=0.8, seq_len=16)
  data.split(np.arange(85), val_fraction=0.8, seq_len=16)
  with pytest.raises(ValueError, match='val_fraction must be in'):
    data.split(tokens, val_fraction=0.0, seq_len=16)


# ----------------------------------------------------------------------------- batches

NUM_WINDOWS, SEQ, BATCH = 23, 5, 4  # 5 batches an epoch, 3 windows dropped


@pytest.fixture(scope='module')
def windows():
  # Window i starts with token 5 i: its id. The last one is padded.
  return data.pack(np.arange(NUM_WINDOWS * SEQ - 2, dtype=np.int32), SEQ)


def _ids(batch):
  return tuple((batch['inputs'][:, 0] // SEQ).tolist())


def _take(it, n):
  return [next(it) for _ in range(n)]


def test_train_batches(windows):
  assert windows.shape == (NUM_WINDOWS, SEQ + 1) and windows[-1, -1] == -1
  it = iter(data.train_dataset(windows, batch_size=BATCH, seed=0))
  assert hasattr(it, 'get_state') and hasattr(it, 'set_state')
  seen_pad = False
  for b in _take(it, 12):
    assert set(b) == {'inputs', 'targets'}
    for v in b.values():
      assert v.dtype == np.int32 and v.shape == (BATCH, SEQ)
    ids = np.asarray(_ids(b))
    np.testing.assert_array_equal(b['targets'], windows[ids, 1:])
    np.testing.assert_array_equal(b['inputs'], np.maximum(windows[ids, :-1], 0))
    seen_pad |= bool((b['targets'] == -1).any())
  assert seen_pad  # the padded last window shows up, masked


def test_train_epochs_and_seeds(windows):
  def batches(seed, n=15):
    return [_ids(b) for b in _take(iter(data.train_dataset(windows, batch_size=BATCH, seed=seed)), n)]

  run = batches(0)
  assert run == batches(0)  # same seed, same batches
  assert run != batches(1)  # other seed, other order
  epochs = [sum(run[5 * e:5 * e + 5], ()) for e in range(3)]
  for e in epochs:
    assert len(set(e)) == 20 and set(e) <= set(range(NUM_WINDOWS))  # each window once at most
  assert len({epochs[0], epochs[1], epochs[2]}) == 3  # reshuffled every epoch
  assert epochs[0] != tuple(range(20))
  # Over three epochs, the windows dropped differ: all of them are used.
  assert set(sum(epochs, ())) == set(range(NUM_WINDOWS))


@pytest.mark.parametrize('steps', [0, 3, 5, 7])  # 5: at the epoch boundary
def test_train_resume(windows, steps):
  ref = [_ids(b) for b in _take(iter(data.train_dataset(windows, batch_size=BATCH, seed=7)), 14)]
  it = iter(data.train_dataset(windows, batch_size=BATCH, seed=7))
  assert [_ids(b) for b in _take(it, steps)] == ref[:steps]
  state = json.loads(json.dumps(it.get_state()))
  resumed = iter(data.train_dataset(windows, batch_size=BATCH, seed=7))
  resumed.set_state(state)
  assert [_ids(b) for b in _take(resumed, 14 - steps)] == ref[steps:]
  assert [_ids(b) for b in _take(it, 14 - steps)] == ref[steps:]  # the original goes on


def test_train_dataset_errors(windows):
  with pytest.raises(ValueError, match='23 training windows are fewer than batch_size=24'):
    data.train_dataset(windows, batch_size=24, seed=0)
  with pytest.raises(ValueError, match='seed must be a non-negative int'):
    data.train_dataset(windows, batch_size=2, seed=-1)
  with pytest.raises(ValueError, match='batch_size must be a positive int'):
    data.train_dataset(windows, batch_size=0, seed=0)


@pytest.mark.parametrize('batch_size', [1, 4, 23, 30])
def test_eval_batches(windows, batch_size):
  batches = data.eval_batches(windows, batch_size=batch_size)
  assert len(batches) == -(-NUM_WINDOWS // batch_size)
  for a, b in zip(batches, data.eval_batches(windows, batch_size=batch_size)):
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
  inputs = np.concatenate([b['inputs'] for b in batches])
  targets = np.concatenate([b['targets'] for b in batches])
  assert inputs.dtype == targets.dtype == np.int32
  assert inputs.shape == targets.shape == (len(batches) * batch_size, SEQ)
  np.testing.assert_array_equal(targets[:NUM_WINDOWS], windows[:, 1:])  # all, in order
  np.testing.assert_array_equal(inputs[:NUM_WINDOWS], np.maximum(windows[:, :-1], 0))
  assert (targets[NUM_WINDOWS:] == -1).all() and (inputs[NUM_WINDOWS:] == 0).all()


# ----------------------------------------------------------------------------- all of it


def test_text_data(tmp_path, corpus, monkeypatch):
  docs = corpus[:12]
  d = data.TextData(docs, seq_len=32, vocab_size=400, val_fraction=0.1,
                    cache_dir=tmp_path)
  assert d.tokenizer.vocab_size == 400
  assert d.train_windows.shape[1] == d.val_windows.shape[1] == 33
  n_train = d.num_tokens - max(-(-d.num_tokens // 10), 33)
  assert d.train_windows.shape[0] == -(-(n_train - 1) // 32)
  stream = np.concatenate([_unpack(d.train_windows), _unpack(d.val_windows)])
  np.testing.assert_array_equal(stream[stream >= 0],
                                tokenizer.tokenize_corpus(docs, d.tokenizer))
  assert f'{d.num_tokens:,} tokens' in d.description and '12 documents' in d.description
  batch = next(iter(data.train_dataset(d.train_windows, batch_size=8, seed=3)))
  assert batch['inputs'].shape == (8, 32)
  assert data.eval_batches(d.val_windows, batch_size=8)[0]['targets'].shape == (8, 32)

  monkeypatch.setattr(tokenizer.Tokenizer, 'train_bpe', None)  # second build: all cached
  again = data.TextData(docs, seq_len=32, vocab_size=400, val_fraction=0.1,
                        cache_dir=tmp_path)
  np.testing.assert_array_equal(again.train_windows, d.train_windows)
  assert again.fingerprint == d.fingerprint
  val_stream = _unpack(d.val_windows)[:d.fingerprint['val_tokens']]
  assert d.fingerprint['val_sha256'] == data.token_hash(val_stream)
  with_path = data.TextData(docs, seq_len=32, tokenizer_path=d.tokenizer.path,
                            cache_dir=tmp_path)
  assert with_path.num_tokens == d.num_tokens
