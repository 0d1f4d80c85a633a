"""Hugging Face ``datasets`` as a corpus source of ``poetx prepare``.

A source is named as ``datasets`` names one: a hub name or a local folder of
data files (``load_dataset(NAME, CONFIG, data_files=...)``, streamed: nothing
is downloaded or converted first), a packaged builder with its files
(``NAME='json'`` or ``'parquet'`` with ``data_files``), or a directory written
by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
(``load_from_disk``, memory-mapped). One code path serves them all:
:func:`hf_source` resolves the name to a JSON record once, and
:func:`hf_documents` streams the text of its ``split`` from that record (in
``prepare``'s worker).

    rec = hf_source('allenai/c4', config='en', split='validation')
    docs = hf_documents(rec, text_field='text')

``datasets`` is an optional dependency (``pip install 'poetx_jax[hf]'``),
imported only here and only when a source is used.
"""

from __future__ import annotations

import contextlib
import typing as tp
from pathlib import Path

_BATCH = 1024


def _import_datasets():
  """``datasets``, or ImportError saying how to install it."""
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("--hf-dataset needs the datasets package: pip install "
                      "'poetx_jax[hf]' (or pip install datasets)") from e
  return datasets


def _saved_to_disk(name: str) -> bool:
  """Whether ``name`` is a directory written by ``save_to_disk``."""
  path = Path(name)
  return path.is_dir() and ((path / 'state.json').is_file()
                            or (path / 'dataset_dict.json').is_file())


def describe(rec: dict) -> str:
  """A record as the command line names it (for messages)."""
  config = f' --hf-config {rec["config"]}' if rec.get('config') else ''
  return f'--hf-dataset {rec["hf_dataset"]}{config} --split {rec["split"]}'


def hf_source(name: str, *, config: str | None = None, split: str = 'train',
              data_files: tp.Sequence[str] | None = None) -> dict:
  """The record of a ``datasets`` source: its name, config, split and data
  files, and ``version``, what identifies its content without reading it (a
  saved dataset's arrow files: path, size, modification time; else the
  builder's config id and hash, which cover its data files' modification
  times, or on the hub their revision). ``poetx prepare`` compares records
  to know a source unchanged.

  Raises:
    ImportError: ``datasets`` is not installed.
    FileNotFoundError: ``name`` is a local path (it starts with ``.``, ``/``
      or ``~``) that does not exist.
    ValueError: the source cannot be resolved (no such dataset, config or
      split; no network for a hub name), naming it.
  """
  if str(name).startswith(('.', '/', '~')) and not Path(name).expanduser().exists():
    raise FileNotFoundError(f'--hf-dataset {name}: no such directory (a local dataset path; '
                            f'a hub name has the form OWNER/NAME)')
  rec = {'hf_dataset': str(name), 'config': config, 'split': split,
         'data_files': list(data_files) if data_files else None}
  if _saved_to_disk(name) and (config is not None or data_files):
    raise ValueError(f'--hf-dataset {name} is a dataset saved with save_to_disk: it '
                     f'takes no --hf-config or --hf-data-files')
  with _named(rec):
    if _saved_to_disk(name):
      ds = _open(rec)
      files = [Path(f['filename']) for f in ds.cache_files]
      rec['version'] = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]
                        for f in files]
    else:
      builder = _import_datasets().load_dataset_builder(name, config,
                                                        data_files=rec['data_files'])
      rec['version'] = f'{builder.config_id}/{builder.hash}'
      splits = builder.info.splits  # None where unknown before reading
      if splits and split not in splits:
        raise _NoSplit(list(splits))
  return rec


class _NoSplit(Exception):
  """The dataset has no split of that name (its splits attached)."""


@contextlib.contextmanager
def _named(rec: dict) -> tp.Iterator[None]:
  """Turns what ``datasets`` raises (its own errors, OSErrors, ValueErrors)
  into a ValueError of one line naming the source; ImportError passes."""
  try:
    yield
  except ImportError:
    raise
  except _NoSplit as e:
    raise ValueError(f'{describe(rec)}: no such split; it has '
                     f'{", ".join(map(str, e.args[0]))}') from None
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(f'{describe(rec)}: {type(e).__name__}: '
                     f'{" ".join(str(e).split())}') from None


def _split_of(ds, rec: dict):
  """The split ``rec['split']`` of a saved ``Dataset`` or ``DatasetDict``."""
  if not hasattr(ds, 'keys'):  # a Dataset: one split, whatever its name
    return ds
  if rec['split'] not in ds:
    raise _NoSplit(list(ds.keys()))
  return ds[rec['split']]


def _open(rec: dict):
  """The dataset of a record: the saved split, or the builder's stream."""
  datasets = _import_datasets()
  if _saved_to_disk(rec['hf_dataset']):
    return _split_of(datasets.load_from_disk(rec['hf_dataset']), rec)
  builder = datasets.load_dataset_builder(rec['hf_dataset'], rec['config'],
                                          data_files=rec['data_files'])
  return builder.as_streaming_dataset(split=rec['split'])


def hf_documents(rec: dict, text_field: str = 'text') -> tp.Iterator[str]:
  """The non-empty texts of the ``text_field`` column of a :func:`hf_source`
  record, in the dataset's order, streamed in batches (null values skipped).

  Raises:
    ValueError: no such column, a value that is not a string (its row), or
      the dataset failing while read, naming the source.
  """
  with _named(rec):
    ds = _open(rec)
  columns = ds.column_names
  if columns is not None and text_field not in columns:
    raise ValueError(f'{describe(rec)}: no column {text_field!r} (columns: '
                     f'{columns}); choose one with --text-field')
  row = 0
  batches = ds.select_columns([text_field]).iter(batch_size=_BATCH)
  while True:
    with _named(rec):
      batch = next(batches, None)
    if batch is None:
      return
    for v in batch[text_field]:
      if v is not None and not isinstance(v, str):
        raise ValueError(f'{describe(rec)}, row {row}: column '
                         f'{text_field!r} holds {type(v).__name__}, expected str')
      row += 1
      if v is not None and v.strip():
        yield v

