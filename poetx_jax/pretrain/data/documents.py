"""Corpus files and their documents: which files a corpus path holds and the
documents each gives, streamed.

Formats, by extension: ``.txt .md .rst .py`` (a file is one document);
``.jsonl``, ``.jsonl.gz``, ``.json.gz``, ``.jsonl.zst``, ``.json.zst`` (one
JSON object a line; zstd needs the zstandard package); ``.parquet`` (needs
pyarrow). :func:`read_documents` reads them all;
:func:`iter_file_documents` streams one file (what ``poetx prepare`` does).
"""

from __future__ import annotations

import gzip
import json
import os
import typing as tp
import zlib
from pathlib import Path

PathLike = tp.Union[str, os.PathLike]

# Longest first, so that '.jsonl.gz' wins over a shorter suffix.
SUPPORTED_EXTENSIONS = ('.jsonl.zst', '.jsonl.gz', '.json.zst', '.json.gz', '.parquet',
                        '.jsonl', '.txt', '.md', '.rst', '.py')
# A file of these is one document.
TEXT_EXTENSIONS = ('.txt', '.md', '.rst', '.py')
_JSON_EXTENSIONS = ('.jsonl.zst', '.jsonl.gz', '.json.zst', '.json.gz', '.jsonl')


def _extension(path: Path) -> str | None:
  """The supported extension ``path`` ends with, or None."""
  name = path.name.lower()
  return next((e for e in SUPPORTED_EXTENSIONS if name.endswith(e)), None)


def _import_zstandard(path: Path):
  try:
    import zstandard  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f'reading {path} needs zstandard: pip install zstandard '
                      f"(or 'poetx_jax[zstd]')") from e
  return zstandard


def _zstd_bytes(path: Path, ext: str) -> tp.Iterator[bytes]:
  """The decompressed bytes of the zstd file ``path``, frame after frame.

  A frame that ends before its end mark (a file cut short, at a block
  boundary or inside a block) is a ValueError naming the file: a stream
  reader would stop there silently and yield part of the documents.
  """
  zstandard = _import_zstandard(path)
  refuse = (f'a {ext} file must be zstd-compressed JSON lines, every frame '
            f'complete')
  frame, frames = None, 0
  try:
    with open(path, 'rb') as f:
      while chunk := f.read(1 << 20):
        while chunk:
          if frame is None:
            frame, frames = zstandard.ZstdDecompressor().decompressobj(), frames + 1
          if out := frame.decompress(chunk):
            yield out
          chunk, frame = (frame.unused_data, None) if frame.eof else (b'', frame)
  except zstandard.ZstdError as e:
    raise ValueError(f'{path} is not a zstd file, or is damaged ({e}); {refuse}') from None
  if frame is not None or not frames:
    where = f'its frame {frames} has no end' if frames else 'it is empty'
    raise ValueError(f'{path} is cut short ({where}); {refuse}')


def _zstd_lines(path: Path, ext: str) -> tp.Iterator[str]:
  """The text lines of the zstd file ``path`` (UTF-8)."""
  rest = b''
  for data in _zstd_bytes(path, ext):
    *lines, rest = (rest + data).split(b'\n')
    yield from (_utf8(path, line) for line in lines)
  if rest:
    yield _utf8(path, rest)


def _utf8(path: Path, line: bytes) -> str:
  try:
    return line.decode('utf-8')
  except UnicodeDecodeError as e:
    raise ValueError(f'{path} is not UTF-8 text ({e})') from None


def _iter_json_lines(path: Path, ext: str, text_field: str) -> tp.Iterator[str]:
  if ext.endswith('.zst'):
    yield from _json_records(path, _zstd_lines(path, ext), text_field)
    return
  with (gzip.open if ext.endswith('.gz') else open)(path, 'rt', encoding='utf-8') as f:
    yield from _json_records(path, f, text_field)


def _json_records(path: Path, f: tp.Iterable[str], text_field: str) -> tp.Iterator[str]:
  """The ``text_field`` strings of the JSON lines of ``f`` (of ``path``)."""
  for lineno, line in enumerate(f, start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f'{path}, line {lineno}: invalid JSON ({e})') from None
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
      keys = sorted(record) if isinstance(record, dict) else type(record).__name__
      raise ValueError(f'{path}, line {lineno}: no string field {text_field!r} '
                       f'(found {keys})')
    yield text


def _iter_parquet(path: Path, text_field: str) -> tp.Iterator[str]:
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(f'reading {path} needs pyarrow (pip install pyarrow)') from e
  try:
    table = pq.ParquetFile(path)
  except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid is a ValueError
    raise ValueError(f'{path} is not a parquet file pyarrow can read ({e})') from None
  names = table.schema_arrow.names
  if text_field not in names:
    raise ValueError(f'{path}: no column {text_field!r} (columns: {names})')
  row, batches = 0, table.iter_batches(columns=[text_field], batch_size=4096)
  while True:
    try:
      batch = next(batches, None)
    except (ValueError, OSError) as e:  # a damaged row group
      raise ValueError(f'{path}: cannot read the parquet rows after row {row} ({e})') from None
    if batch is None:
      return
    for v in batch.column(0).to_pylist():
      if v is not None and not isinstance(v, str):
        raise ValueError(f'{path}, row {row}: column {text_field!r} holds '
                         f'{type(v).__name__}, expected str')
      row += 1
      if v is not None:
        yield v


def _read_text(path: Path, on_skip: tp.Callable[[str], None] | None) -> tp.Iterator[str]:
  """A text file as one document; with ``on_skip``, none where it cannot be
  read, is not UTF-8 or holds a NUL byte (binary): ``on_skip(why)`` instead."""
  try:
    text = path.read_text(encoding='utf-8')
  except (OSError, UnicodeDecodeError) as e:
    if on_skip is None:
      raise
    on_skip('not UTF-8' if isinstance(e, UnicodeDecodeError) else
            f'unreadable ({e.strerror or e})')
    return
  if '\x00' in text:
    if on_skip is None:
      raise ValueError(f'{path} holds a NUL byte at character {text.index(chr(0))}: a '
                       f'binary file, not text')
    on_skip('binary (a NUL byte)')
    return
  yield text


def iter_file_documents(path: PathLike, text_field: str = 'text', *, lenient: bool = False,
                        on_skip: tp.Callable[[str], None] | None = None
                        ) -> tp.Iterator[str]:
  """The non-empty documents of one corpus file, streamed (formats as
  :func:`read_documents`): a jsonl file line by line, a parquet file by record
  batch, so memory stays bounded by a document, not by the file.

  With ``lenient`` (a text file found in a folder: :func:`corpus_sources`), a
  text file (``.txt .md .rst .py``) that cannot be read, is not UTF-8 or
  holds a NUL byte gives no document instead of an error, and calls
  ``on_skip(why)`` if given.

  Raises:
    ValueError: an unsupported extension, a record without the text field,
      a file that is not UTF-8 (or, for a text file, holds a NUL byte), a
      ``.gz`` / ``.zst`` file that is not gzip / zstd (or is cut short), or a
      ``.parquet`` file pyarrow cannot read (each naming the file).
  """
  path = Path(path)
  ext = _extension(path)
  if ext is None:
    raise ValueError(f'unsupported file {path}: supported extensions are '
                     f'{", ".join(SUPPORTED_EXTENSIONS)}')
  try:
    if ext in TEXT_EXTENSIONS:
      docs = _read_text(path, (on_skip or (lambda why: None)) if lenient else None)
    elif ext in _JSON_EXTENSIONS:
      docs = _iter_json_lines(path, ext, text_field)
    else:
      docs = _iter_parquet(path, text_field)
    for doc in docs:
      if doc.strip():
        yield doc
  except UnicodeDecodeError as e:
    raise ValueError(f'{path} is not UTF-8 text ({e.reason} at byte {e.start})') from None
  except (gzip.BadGzipFile, EOFError, zlib.error) as e:
    raise ValueError(f'{path} is not a gzip file, or is cut short ({e}); a {ext} file '
                     f'must be gzip-compressed JSON lines') from None


def corpus_sources(paths: PathLike | tp.Sequence[PathLike]) -> list[tuple[Path, bool]]:
  """The corpus files of files and directories in reading order, each with
  whether it was found in a directory (a directory's supported files
  recursively, sorted by path): such a text file is read leniently
  (:func:`iter_file_documents`).

  Raises:
    FileNotFoundError: a path does not exist.
  """
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  files = []
  for p in map(Path, paths):
    if not p.exists():
      raise FileNotFoundError(f'no such file or directory: {p}')
    if p.is_dir():
      files += [(f, True) for f in sorted(p.rglob('*')) if f.is_file() and _extension(f)]
    else:
      files.append((p, False))
  return files


def corpus_files(paths: PathLike | tp.Sequence[PathLike]) -> list[Path]:
  """The corpus files of files and directories, in reading order
  (:func:`corpus_sources` without where each was found)."""
  return [f for f, _ in corpus_sources(paths)]


def read_documents(paths: PathLike | tp.Sequence[PathLike], *,
                   text_field: str = 'text') -> list[str]:
  """Reads the documents of files and directories, in order.

  Formats, by extension: ``.txt`` / ``.md`` / ``.rst`` / ``.py`` (a file is one
  document); ``.jsonl``, ``.jsonl.gz``, ``.json.gz``, ``.jsonl.zst``,
  ``.json.zst`` (one JSON object a line, its ``text_field`` string is a
  document: C4's layout; zstd needs the zstandard package); ``.parquet`` (the
  ``text_field`` column; needs pyarrow). A directory is read recursively, its
  files in sorted order, skipping files of other extensions and text files
  that cannot be read, are not UTF-8 or hold a NUL byte (binary); a file
  named itself is read strictly. Empty and whitespace-only documents are
  dropped.

  Raises:
    FileNotFoundError: a path does not exist.
    ValueError: unsupported extension, a JSON line or table without the field,
      or no non-empty document at all.
  """
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  docs = []
  for f, found in corpus_sources(paths):
    docs.extend(iter_file_documents(f, text_field, lenient=found))
  if not docs:
    raise ValueError('corpus is empty: no non-empty documents in '
                     + ', '.join(str(p) for p in paths))
  return docs
