"""``poetx prepare``: corpus files of any size, or a Hugging Face dataset ->
a tokenized dataset directory.

The directory holds the token stream of the corpus (every document's tokens
followed by the tokenizer's eos, documents in the order of
:func:`poetx_jax.pretrain.data.documents.read_documents`, then those of the
dataset) cut into shards of at most ``shard_tokens`` tokens, each a raw
little-endian ``uint16`` array (``uint32`` when the vocabulary does not fit),
read back with positioned reads; the tokenizer (``tokenizer.json``); and
``manifest.json``::

    {"format": "poetx-tokens-1", "dtype": "uint16", "vocab_size": 4096,
     "eos_id": 4095, "tokenizer_sha256": ..., "text_field": "text",
     "bpe": {"vocab_size": 4096, "sample_chars": 100000000},
     "shard_tokens": 16777216,
     "sources": [{"path": ..., "bytes": ..., "mtime_ns": ..., "lenient": false,
                  "documents": ..., "sha256": ...}, ...,
                 {"hf_dataset": ..., "config": ..., "split": ..., "data_files": ...,
                  "version": ..., "documents": ..., "sha256": ...}],
     "shards": [{"file": "shard-00000-00000.bin", "tokens": ..., "sha256": ...,
                 "max_id": ...}, ...],
     "documents": ..., "tokens": ...}

A text file found in a folder (not named itself) that cannot be read, is not
UTF-8 or holds a NUL byte is skipped: its source has ``"skipped": WHY`` and
no documents (:func:`poetx_jax.pretrain.data.documents.iter_file_documents`).

The sources are tokenized in tasks, each by a worker process of its own:
runs of consecutive files of up to ``shard_tokens`` bytes in all, and the
dataset alone (streamed, :mod:`poetx_jax.pretrain.data.hfdata`); each streams its
documents (jsonl line by line, parquet and datasets by record batch), so
memory is bounded by the shard size, not by the corpus. A task whose shards
are written is recorded in ``parts/``; an interrupted prepare resumes from
there (one stopped by a write refused for want of space, DiskFull, removes
the shards of the tasks it had not finished first), and running it again on
unchanged inputs (same paths, sizes and modification times, the same dataset
version, same tokenizer) does nothing;
other inputs, another tokenizer, or (without ``tokenizer``) another
``vocab_size`` or ``sample_chars`` for the trained BPE are refused, finished
or not. Training reads the directory with
:class:`poetx_jax.pretrain.data.shards.PreparedData` (``poetx train --data DIR``).

Without ``tokenizer`` a byte-level BPE of ``vocab_size`` is trained on a
sample: from each source its first documents, up to ``sample_chars /
number of sources`` characters each (100 M characters in all by default); the
two are recorded as ``"bpe"`` in the manifest (``null`` with a given
tokenizer), and in ``parts/bpe.json`` until the manifest is written.
"""

from __future__ import annotations

import json
import os
import shutil
import typing as tp
from pathlib import Path

import numpy as np

from poetx_jax.pretrain.data import documents, shards
from poetx_jax.pretrain.data.prepare_tasks import run_tasks, source_documents
from poetx_jax.pretrain.atomic import atomic_write
from poetx_jax.pretrain.disk_full import DiskFull, full_disk_remedy, full_disk_text, when_full
from poetx_jax.pretrain.footprint import first_missing
from poetx_jax.pretrain.json_records import read_json
from poetx_jax.pretrain.unwritable import check_writable
from poetx_jax.pretrain.data.tokenizer import Tokenizer, check_bpe_vocab, file_hash

FORMAT = shards.FORMAT
MANIFEST = shards.MANIFEST
DEFAULT_SHARD_TOKENS = 1 << 24
DEFAULT_SAMPLE_CHARS = 100_000_000

PathLike = tp.Union[str, os.PathLike]


def token_dtype(vocab_size: int) -> np.dtype:
  """uint16 where every id fits, else uint32."""
  return np.dtype('<u2') if vocab_size <= 1 << 16 else np.dtype('<u4')


def _file_record(path: Path, found: bool) -> dict:
  st = path.stat()
  return {'path': str(path.resolve()), 'bytes': st.st_size, 'mtime_ns': st.st_mtime_ns,
          'lenient': found}


# What identifies a source without reading it: a file's, a dataset's.
_FILE_KEYS, _HF_KEYS = ('path', 'bytes', 'mtime_ns'), ('hf_dataset', 'config', 'split',
                                                       'data_files', 'version')


def _same_source(a: dict, b: dict) -> bool:
  keys = _HF_KEYS if 'hf_dataset' in b else _FILE_KEYS
  return all(a.get(k) == b[k] for k in keys)


def _same_sources(a: tp.Sequence[dict], b: tp.Sequence[dict]) -> bool:
  return len(a) == len(b) and all(map(_same_source, a, b))


def _source_name(source: dict) -> str:
  if 'hf_dataset' in source:
    from poetx_jax.pretrain.data import hfdata  # pylint: disable=g-import-not-at-top
    return hfdata.describe(source)
  return source['path']


def _sample(sources: list[dict], text_field: str, sample_chars: int) -> tp.Iterator[str]:
  budget = max(1, sample_chars // max(len(sources), 1))
  for source in sources:
    taken = 0
    for doc in source_documents(source, text_field):
      yield doc
      taken += len(doc)
      if taken >= budget:
        break


def prepare(inputs: PathLike | tp.Sequence[PathLike], out: PathLike, *,
            tokenizer: PathLike | None = None, vocab_size: int = 4096,
            text_field: str = 'text', workers: int | None = None,
            shard_tokens: int = DEFAULT_SHARD_TOKENS,
            sample_chars: int = DEFAULT_SAMPLE_CHARS,
            hf_dataset: str | None = None, hf_config: str | None = None,
            split: str = 'train', hf_data_files: tp.Sequence[str] | None = None,
            progress: bool = True) -> dict:
  """Tokenizes the corpus files ``inputs`` (then the Hugging Face dataset
  ``hf_dataset``, if given) into the dataset directory ``out`` (the module
  docstring has its layout). Returns the manifest.

  Args:
    inputs: files and directories, as
      :func:`~poetx_jax.pretrain.data.documents.read_documents`; may be empty with
      ``hf_dataset``.
    out: the dataset directory (created; if this call created it and fails
      before writing any file, it is removed again).
    tokenizer: a tokenizer file to use; None trains a BPE on a sample.
    vocab_size: the BPE's vocabulary when training one.
    text_field: the field holding the text in jsonl and parquet files.
    workers: worker processes (default: the CPUs, at most one per file).
    shard_tokens: tokens per shard at most.
    sample_chars: characters of the BPE's training sample at most.
    hf_dataset, hf_config, split, hf_data_files: a ``datasets`` source, its
      config, split and data files (:func:`~poetx_jax.pretrain.data.hfdata.hf_source`;
      its ``text_field`` column is read).
    progress: show a progress bar over the source files' bytes.

  Raises:
    FileNotFoundError: an input does not exist.
    ValueError: a bad argument, an unsupported or unreadable file (named), a
      dataset that cannot be read (named), no documents at all, or ``out``
      holding a dataset (finished or not) of other inputs, another tokenizer
      or another BPE request, or one this process cannot write in.
    ImportError: ``hf_dataset`` without the datasets package.
    DiskFull: a write refused for want of space (named); the finished parts
      are kept, the shards of the others removed, and the same call resumes.
  """
  _check_arguments(vocab_size=vocab_size, shard_tokens=shard_tokens,
                   sample_chars=sample_chars, workers=workers, bpe=tokenizer is None)
  check_writable(out, '--out')
  hf = None
  if hf_dataset is not None:
    from poetx_jax.pretrain.data import hfdata  # pylint: disable=g-import-not-at-top
    hf = hfdata.hf_source(hf_dataset, config=hf_config, split=split,
                          data_files=hf_data_files)
  plan = _plan(inputs, out, text_field, hf)
  bpe = None if tokenizer is not None else {'vocab_size': vocab_size,
                                            'sample_chars': sample_chars}
  prepared = _prepared_manifest(plan, tokenizer, bpe, shard_tokens)
  if prepared is not None:
    return prepared
  created = first_missing(plan.out)
  plan.out.mkdir(parents=True, exist_ok=True)
  try:
    with _resumable_when_full(plan, shard_tokens):
      tok_path = _store_tokenizer(plan, tokenizer, bpe)
      tok, tok_hash = Tokenizer.load(tok_path), file_hash(tok_path)
      dtype = token_dtype(tok.vocab_size)
      parts = _tokenize_sources(plan, tok_path, tok_hash, dtype, shard_tokens=shard_tokens,
                                workers=workers, progress=progress)
      return _write_manifest(plan, parts, tok, tok_path, tok_hash, dtype, bpe,
                             shard_tokens)
  except BaseException:
    if created is not None and not any(p.is_file() for p in created.rglob('*')):
      shutil.rmtree(created, ignore_errors=True)  # nothing done to resume from
    raise


class _Plan(tp.NamedTuple):
  """What a prepare works on: the dataset directory, the records of its
  sources (in the order of their documents) and the text field."""
  out: Path
  sources: list[dict]
  text_field: str


def _resumable_when_full(plan: _Plan, shard_tokens: int) -> tp.ContextManager[None]:
  """A write refused for want of space: the shards of the parts not finished
  (no record in ``parts/``) removed, temporary ones too, then DiskFull naming
  the file, the parts kept and that the same command resumes."""
  def stop(e, code):
    done = {p.stem for p in (plan.out / 'parts').glob('0*.json')}
    for f in [*plan.out.glob('shard-*'), *plan.out.glob('.shard-*')]:
      if f.name.lstrip('.').split('-')[1] not in done:
        f.unlink(missing_ok=True)
    what = (str(e) if isinstance(e, DiskFull) else f'{full_disk_text(code)} writing '
            f'{getattr(e, "filename", None) or f"in {plan.out}"}')
    return DiskFull(f'{what}; {plan.out} keeps {len(done)} of '
                    f'{len(_tasks(plan.sources, shard_tokens))} tokenized parts: '
                    f'{full_disk_remedy(code)} and run the same command again to resume',
                    code)
  return when_full(stop)


def _check_arguments(*, vocab_size, shard_tokens, sample_chars, workers, bpe: bool) -> None:
  """ValueError naming the first of the arguments that is not a positive int
  (``vocab_size``, when a BPE is to be trained, one it can be:
  ``check_bpe_vocab``), before anything is written."""
  for name, value in (('vocab_size', vocab_size), ('shard_tokens', shard_tokens),
                      ('sample_chars', sample_chars)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f'{name} must be a positive int, got {value!r}')
  if bpe:
    check_bpe_vocab(vocab_size)
  if workers is not None and (not isinstance(workers, int) or workers < 1):
    raise ValueError(f'workers must be a positive int, got {workers!r}')


def _plan(inputs: PathLike | tp.Sequence[PathLike], out: PathLike, text_field: str,
          hf: dict | None) -> _Plan:
  """The sources of ``inputs`` (and the dataset record ``hf``) and the
  dataset directory ``out`` (not a file)."""
  sources = [_file_record(f, found) for f, found in documents.corpus_sources(inputs)]
  if hf is not None:
    sources.append(hf)
  if not sources:
    raise ValueError('prepare needs corpus files or directories, or --hf-dataset')
  out = Path(out)
  if out.exists() and not out.is_dir():
    raise ValueError(f'--out {out} is a file, not a directory')
  return _Plan(out, sources, text_field)


def _prepared_manifest(plan: _Plan, tokenizer: PathLike | None,
                       bpe: dict | None, shard_tokens: int) -> dict | None:
  """The manifest of ``plan.out`` if it is already prepared from these inputs
  (and ``tokenizer``, if given, or the ``bpe`` request) in shards of at most
  ``shard_tokens``; None if it holds no manifest.

  Raises:
    ValueError: ``plan.out`` holds a dataset of other inputs, tokenizer,
      BPE request or shard size (a manifest that does not record its shard
      size, of an older prepare, passes).
  """
  manifest_path = plan.out / MANIFEST
  if not manifest_path.is_file():
    return None
  old = read_json(manifest_path, required=('sources', 'tokenizer_sha256'))
  same_inputs = _same_sources(old['sources'], plan.sources)
  same_tokenizer = tokenizer is None or file_hash(tokenizer) == old['tokenizer_sha256']
  if same_inputs and same_tokenizer and old.get('text_field') == plan.text_field:
    _check_bpe(plan.out, old.get('bpe'), bpe)
    if old.get('shard_tokens', shard_tokens) != shard_tokens:
      raise ValueError(f'{plan.out} holds shards of at most {old["shard_tokens"]} tokens, '
                       f'not --shard-tokens {shard_tokens}; give another --out, or remove '
                       f'{plan.out} first to prepare it again')
    return old
  raise ValueError(f'{plan.out} holds a prepared dataset of other inputs or another '
                   f'tokenizer; give a new --out, or remove {plan.out} first')


def _check_bpe(out: Path, old: dict | None, new: dict | None) -> None:
  """ValueError if ``out`` holds a BPE trained on another request than ``new``
  (a directory without a record, of an older prepare or a given tokenizer,
  passes)."""
  if old is None or new is None or old == new:
    return
  keys = [k for k in new if old.get(k) != new[k]]
  was = ', '.join(f'{k}={old.get(k)}' for k in keys)
  now = ', '.join(f'--{k.replace("_", "-")} {new[k]}' for k in keys)
  raise ValueError(f'{out} holds a tokenizer trained with {was}, not {now}; give another '
                   f'--out, or remove {out} first to prepare it again')


def _store_tokenizer(plan: _Plan, tokenizer: PathLike | None, bpe: dict | None) -> Path:
  """``out/tokenizer.json``: a copy of ``tokenizer``, else (unless there already,
  trained on the same ``bpe`` request) a BPE of ``bpe['vocab_size']`` trained
  on a sample of the sources, its request kept in ``out/parts/bpe.json``."""
  tok_path, record = plan.out / 'tokenizer.json', plan.out / 'parts' / 'bpe.json'
  if tokenizer is not None:
    record.unlink(missing_ok=True)  # the tokenizer there is no longer a trained one
    src = Path(tokenizer)
    if src.suffix != '.json':
      raise ValueError(f'prepare takes a tokenizers JSON file, got {src}')
    Tokenizer.load(src)  # readable
    if not tok_path.is_file() or file_hash(tok_path) != file_hash(src):
      atomic_write(tok_path, lambda tmp: shutil.copyfile(src, tmp))
    return tok_path
  if tok_path.is_file():
    _check_bpe(plan.out, json.loads(record.read_text()) if record.is_file() else None, bpe)
    return tok_path
  sample = list(_sample(plan.sources, plan.text_field, bpe['sample_chars']))
  if not sample:
    raise ValueError('corpus is empty: no non-empty documents in '
                     + ', '.join(map(_source_name, plan.sources)))
  record.parent.mkdir(exist_ok=True)
  atomic_write(record, lambda tmp: Path(tmp).write_text(json.dumps(bpe)))
  Tokenizer.train_bpe(sample, vocab_size=bpe['vocab_size'], path=tok_path)
  return tok_path


def _tasks(sources: list[dict], shard_tokens: int) -> list[list[int]]:
  """The sources of each task, by index: runs of consecutive files of
  ``shard_tokens`` bytes in all at most (or one larger file), and each
  dataset alone (a folder of many small files makes a few shards, not one
  each)."""
  tasks, size = [], 0
  for i, source in enumerate(sources):
    n = source.get('bytes', 0)
    if (not tasks or 'hf_dataset' in source or 'hf_dataset' in sources[tasks[-1][-1]]
        or size + n > shard_tokens):
      tasks.append([])
      size = 0
    tasks[-1].append(i)
    size += n
  return tasks


def _tokenize_sources(plan: _Plan, tok_path: Path, tok_hash: str, dtype: np.dtype, *,
                      shard_tokens: int, workers: int | None, progress: bool) -> list[dict]:
  """The part record of every task (:func:`_tasks`), in order: the one in
  ``out/parts`` where it is of the same sources, tokenizer and text field,
  else that of the task run now
  (:func:`~poetx_jax.pretrain.data.prepare_tasks.tokenize_task`), recorded there."""
  parts_dir = plan.out / 'parts'
  parts_dir.mkdir(exist_ok=True)
  tasks = _tasks(plan.sources, shard_tokens)
  parts, todo = {}, []
  for i, members in enumerate(tasks):
    sources = [plan.sources[j] for j in members]
    part_file = parts_dir / f'{i:05d}.json'
    if part_file.is_file():
      part = json.loads(part_file.read_text())
      if (_same_sources(part.get('sources', ()), sources) and part.get('tokenizer') == tok_hash
          and part.get('text_field') == plan.text_field):
        parts[i] = part
        continue
    todo.append({'index': i, 'out': str(plan.out), 'sources': sources,
                 'tokenizer': str(tok_path), 'dtype': dtype.str,
                 'shard_tokens': shard_tokens, 'text_field': plan.text_field})

  def done(task, part):
    part['tokenizer'], part['text_field'] = tok_hash, plan.text_field
    atomic_write(parts_dir / f'{task["index"]:05d}.json',
                 lambda tmp: Path(tmp).write_text(json.dumps(part)))
    parts[task['index']] = part

  run_tasks(todo, done, workers=workers, progress=progress, files=len(tasks))
  return [parts[i] for i in range(len(tasks))]


def _write_manifest(plan: _Plan, parts: list[dict], tok: Tokenizer, tok_path: Path,
                    tok_hash: str, dtype: np.dtype, bpe: dict | None,
                    shard_tokens: int) -> dict:
  """Writes ``out/manifest.json`` of the source files' ``parts`` and returns it.

  Raises:
    ValueError: the sources hold no tokens at all.
  """
  all_shards = [s for p in parts for s in p['shards']]
  if not all_shards:
    raise ValueError('corpus is empty: no non-empty documents in '
                     + ', '.join(map(_source_name, plan.sources)))
  manifest = {'format': FORMAT, 'dtype': dtype.name, 'vocab_size': tok.vocab_size,
              'eos_id': tok.eos_id, 'tokenizer': tok_path.name,
              'tokenizer_sha256': tok_hash, 'text_field': plan.text_field, 'bpe': bpe,
              'shard_tokens': shard_tokens, 'sources': [s for p in parts for s in p['sources']], 'shards': all_shards,
              'documents': sum(p['documents'] for p in parts),
              'tokens': sum(s['tokens'] for s in all_shards)}
  text = json.dumps(manifest, indent=1)
  atomic_write(plan.out / MANIFEST, lambda tmp: Path(tmp).write_text(text))
  return manifest
