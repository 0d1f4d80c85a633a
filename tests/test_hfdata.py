"""poetx prepare from Hugging Face datasets (local only: the hub path is the same
code) and from .jsonl.zst files: the same shards as the same text in files."""

import json
import os

import pytest

from poetx_jax.pretrain import cli
from poetx_jax.pretrain.data import windows as data, prepare, shards
from poetx_jax.pretrain.data.tokenizer import corpus_hash

os.environ.setdefault('HF_HUB_OFFLINE', '1')  # read by datasets when imported
datasets = pytest.importorskip('datasets')

DOCS = [f'document {i}: ' + ' '.join(['orthogonal', 'rotation', 'merge', 'block'][j % 4]
                                      for j in range(i % 23)) + '.' for i in range(120)]
KW = dict(vocab_size=300, shard_tokens=400, workers=1, progress=False)


def _files(directory):
  return {f.name: f.read_bytes() for f in directory.iterdir() if f.is_file()
          and f.name != 'manifest.json'}


def _counts(m):
  return m['tokens'], m['documents'], [(s['file'], s['tokens'], s['sha256']) for s in m['shards']]


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """DOCS as a jsonl file, a saved dataset, a jsonl folder and a parquet folder."""
  root = tmp_path_factory.mktemp('hf')
  (root / 'jsonl').mkdir()
  lines = [json.dumps({'text': d, 'id': i}) + '\n' for i, d in enumerate(DOCS)]
  (root / 'jsonl' / 'a.jsonl').write_text(''.join(lines[:50]))
  (root / 'jsonl' / 'b.jsonl').write_text(''.join(lines[50:]))
  (root / 'all.jsonl').write_text(''.join(lines))
  ds = datasets.Dataset.from_dict({'text': DOCS, 'id': list(range(len(DOCS)))})
  ds.save_to_disk(str(root / 'saved'))
  datasets.DatasetDict({'train': ds, 'validation': ds.select(range(5))}).save_to_disk(
      str(root / 'saved_dict'))
  (root / 'parquet').mkdir()
  ds.to_parquet(str(root / 'parquet' / 'train-00000.parquet'))
  return root


def test_a_dataset_prepares_to_the_shards_of_the_same_text_in_files(corpus, tmp_path):
  want = prepare.prepare([corpus / 'all.jsonl'], tmp_path / 'file', **KW)
  for name, kw in [('saved', dict(hf_dataset=str(corpus / 'saved'))),
                   ('dict', dict(hf_dataset=str(corpus / 'saved_dict'), split='train')),
                   ('json', dict(hf_dataset='json',
                                 hf_data_files=[str(corpus / 'jsonl' / '*.jsonl')])),
                   ('folder', dict(hf_dataset=str(corpus / 'parquet')))]:
    got = prepare.prepare([], tmp_path / name, **kw, **KW)
    assert _counts(got) == _counts(want), name
    assert _files(tmp_path / name) == _files(tmp_path / 'file'), name  # shards, tokenizer
    assert got['sources'][0]['sha256'] == corpus_hash(DOCS)  # of its documents
  # The text files of DOCS give the same token stream (in shards of their own).
  (tmp_path / 'txt').mkdir()
  for i, d in enumerate(DOCS):
    (tmp_path / 'txt' / f'{i:03d}.txt').write_text(d)
  txt = prepare.prepare([tmp_path / 'txt'], tmp_path / 'from-txt', tokenizer=(
      tmp_path / 'file' / 'tokenizer.json'), **KW)
  a, b = shards.TokenShards(tmp_path / 'from-txt'), shards.TokenShards(tmp_path / 'saved')
  assert (a.read(0, len(a)) == b.read(0, len(b))).all() and txt['tokens'] == want['tokens']


def test_a_dataset_prepare_is_resumable_and_its_changes_are_refused(corpus, tmp_path):
  src = tmp_path / 'jsonl'
  src.mkdir()
  (src / 'a.jsonl').write_bytes((corpus / 'jsonl' / 'a.jsonl').read_bytes())
  kw = dict(hf_dataset='json', hf_data_files=[str(src / '*.jsonl')], **KW)
  m = prepare.prepare([corpus / 'jsonl' / 'b.jsonl'], tmp_path / 'ds', **kw)
  assert m['sources'][1]['documents'] == 50 and m['documents'] == len(DOCS)
  assert prepare.prepare([corpus / 'jsonl' / 'b.jsonl'], tmp_path / 'ds', **kw) == m
  os.utime(src / 'a.jsonl', ns=(1, 1))  # the dataset's version changes with its files
  with pytest.raises(ValueError, match='other inputs'):
    prepare.prepare([corpus / 'jsonl' / 'b.jsonl'], tmp_path / 'ds', **kw)


def test_dataset_errors_are_one_line_and_name_the_source(corpus, tmp_path, capsys,
                                                         monkeypatch):
  def error(*argv):
    assert cli.main(['prepare', *argv, '--out', str(tmp_path / 'o'), '--vocab-size', '300',
                     '--workers', '1']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith('poetx prepare: error: '), err
    return err

  err = error('--hf-dataset', str(corpus / 'saved'), '--text-field', 'body')
  assert "no column 'body' (columns: ['text', 'id'])" in err
  err = error('--hf-dataset', str(corpus / 'saved_dict'), '--split', 'test')
  assert 'no such split; it has train, validation' in err
  assert 'saved_dict' in error('--hf-dataset', str(corpus / 'saved_dict'), '--hf-config', 'x')
  assert error('--hf-dataset', str(tmp_path / 'nowhere')).endswith(
      f'--hf-dataset {tmp_path / "nowhere"}: no such directory (a local dataset path; a hub '
      f'name has the form OWNER/NAME)')
  monkeypatch.chdir(tmp_path)  # a relative local path
  assert '--hf-dataset ./gone: no such directory' in error('--hf-dataset', './gone')
  assert '--split need --hf-dataset' in error(str(corpus / 'all.jsonl'), '--split', 'x')
  assert 'needs corpus files' in error()


def test_jsonl_zst_files_read_as_jsonl(tmp_path):
  zstandard = pytest.importorskip('zstandard')
  lines = ''.join(json.dumps({'text': d}) + '\n' for d in DOCS).encode()
  (tmp_path / 'a.jsonl.zst').write_bytes(zstandard.ZstdCompressor().compress(lines))
  assert data.read_documents([tmp_path]) == DOCS
  (tmp_path / 'b.json.zst').write_bytes(lines)  # not compressed
  with pytest.raises(ValueError, match=r'b\.json\.zst is not a zstd file'):
    data.read_documents([tmp_path / 'b.json.zst'])


def test_a_cut_short_zst_file_is_refused_by_name(tmp_path, capsys):
  zstandard = pytest.importorskip('zstandard')
  lines = [(json.dumps({'text': d}) + '\n').encode() for d in DOCS]
  buf = __import__('io').BytesIO()
  writer = zstandard.ZstdCompressor().stream_writer(buf, closefd=False)
  writer.write(b''.join(lines[:60]))
  writer.flush(zstandard.FLUSH_BLOCK)
  boundary = len(buf.getvalue())  # the first blocks, whole: 60 documents
  writer.write(b''.join(lines[60:]))
  writer.close()
  whole = buf.getvalue()
  (tmp_path / 'whole.jsonl.zst').write_bytes(whole)
  (tmp_path / 'two.jsonl.zst').write_bytes(whole + whole)  # two frames read in turn
  assert data.read_documents([tmp_path / 'whole.jsonl.zst']) == DOCS
  assert data.read_documents([tmp_path / 'two.jsonl.zst']) == DOCS + DOCS
  one_block = zstandard.ZstdCompressor().compress(b''.join(lines))
  for name, content in [('at_block.jsonl.zst', whole[:boundary]),
                        ('in_block.jsonl.zst', one_block[:len(one_block) // 2]),
                        ('second.jsonl.zst', whole + whole[:boundary]),
                        ('empty.jsonl.zst', b'')]:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=rf'{name.replace(".", r"\.")} is cut short'):
      data.read_documents([tmp_path / name])
    out = tmp_path / f'o_{name}'
    assert cli.main(['prepare', str(tmp_path / name), '--out', str(out), '--vocab-size', '300',
                     '--workers', '1']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'is cut short' in err and name in err, err
    assert not out.exists()
