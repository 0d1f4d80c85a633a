"""The weight files of a Hugging Face model directory: safetensors, one file
or sharded.

    OUT/model.safetensors                      one file, or
    OUT/model-00001-of-00002.safetensors       shards, each holding whole tensors,
    OUT/model-00002-of-00002.safetensors
    OUT/model.safetensors.index.json           {"metadata": {"total_size": bytes},
                                                "weight_map": {tensor: shard file}}

:func:`read_weights` opens either form as a mapping whose tensors are read
one at a time, when looked up (shapes and dtypes come from the files' headers),
so that loading a model holds one tensor on the host beside it.
:func:`plan_shards` splits tensors into shards the way ``save_pretrained``
does. Reading needs the ``safetensors`` package (the ``pretrain`` extra);
bfloat16 tensors are read as ``ml_dtypes.bfloat16`` numpy arrays.
"""

from __future__ import annotations

import collections.abc
import json
import os
import pathlib
import re
import typing as tp

import numpy as np

SINGLE = 'model.safetensors'
INDEX = 'model.safetensors.index.json'
SHARD = re.compile(r'model-\d{5}-of-\d{5}\.safetensors')
_UNITS = {'': 1, 'B': 1, 'KB': 10 ** 3, 'MB': 10 ** 6, 'GB': 10 ** 9, 'TB': 10 ** 12,
          'KIB': 2 ** 10, 'MIB': 2 ** 20, 'GIB': 2 ** 30, 'TIB': 2 ** 40}


def parse_size(size: int | str) -> int:
  """Bytes of a size such as ``5GB`` (10^9, as ``save_pretrained`` reads it),
  ``500MiB`` (2^20) or an int.

    >>> parse_size('5GB'), parse_size('2KiB'), parse_size(100)
    (5000000000, 2048, 100)
  """
  if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
    n = int(size)
  else:
    m = re.fullmatch(r'\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*', str(size), re.IGNORECASE)
    if not m:
      raise ValueError(f'size {size!r} is not a number of bytes with an optional unit '
                       f'(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 5GB')
    n = int(float(m[1]) * _UNITS[(m[2] or '').upper()])
  if n < 1:
    raise ValueError(f'size must be at least one byte, got {size!r}')
  return n


def plan_shards(sizes: tp.Mapping[str, int], max_bytes: int
                ) -> tuple[dict[str, list[str]], dict | None]:
  """The files of tensors of ``sizes`` (name: bytes, in writing order) in
  shards of at most ``max_bytes`` each (a tensor larger than that alone in
  its own): ``({file name: tensor names}, index dict)``, the index None when
  one file, ``model.safetensors``, holds them all."""
  shards: list[list[str]] = [[]]
  held = 0
  for name, n in sizes.items():
    if shards[-1] and held + n > max_bytes:
      shards.append([])
      held = 0
    shards[-1].append(name)
    held += n
  if len(shards) == 1:
    return {SINGLE: shards[0]}, None
  files = {f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors': names
           for i, names in enumerate(shards)}
  index = {'metadata': {'total_size': int(sum(sizes.values()))},
           'weight_map': {name: f for f, names in files.items() for name in names}}
  return files, index


class Weights(collections.abc.Mapping):
  """Tensors of safetensors files by name, each read when looked up.

  Attributes:
    files: {tensor name: the file holding it}.
    shapes: {tensor name: shape}, from the files' headers.
    dtypes: {tensor name: safetensors dtype ('F32', 'BF16', ...)}.
  """

  def __init__(self, files: dict[str, pathlib.Path]):
    self.files, self.shapes, self.dtypes = files, {}, {}
    for path in sorted(set(files.values())):
      with _open(path) as f:
        for name in f.keys():
          if files.get(name) == path:
            view = f.get_slice(name)
            self.shapes[name] = tuple(view.get_shape())
            self.dtypes[name] = view.get_dtype()
    missing = sorted(set(files) - set(self.shapes))
    if missing:
      raise ValueError(f'{INDEX} maps tensor(s) {missing[:3]} to files that do not hold '
                       f'them ({files[missing[0]].name})')

  def __getitem__(self, name: str) -> np.ndarray:
    with _open(self.files[name]) as f:
      return _read(self.files[name], lambda: f.get_tensor(name))

  def __iter__(self):
    return iter(self.files)

  def __len__(self) -> int:
    return len(self.files)


def read_json_object(path: str | os.PathLike, what: str = '') -> dict:
  """The JSON object of the file ``path``; ValueError naming the file (and
  ``what`` it should be) if it is not UTF-8 JSON or not an object."""
  try:
    value = json.loads(pathlib.Path(path).read_bytes().decode())
  except ValueError as e:  # not JSON, or not UTF-8
    raise ValueError(f'{path} is damaged ({e}){what}') from None
  if not isinstance(value, dict):
    raise ValueError(f'{path} is damaged (a JSON {type(value).__name__}, not an object){what}')
  return value


def read_weights(directory: str | os.PathLike) -> Weights:
  """The weights of a Hugging Face model directory: ``model.safetensors`` or
  the shards its ``model.safetensors.index.json`` names.

  Raises:
    ValueError: the directory holds neither, an index names a missing shard
      or a tensor its shard lacks, or a file's header is damaged or the file
      is cut short (named).
    ImportError: safetensors is not installed.
  """
  root = pathlib.Path(directory)
  if (root / INDEX).is_file():
    weight_map = read_json_object(root / INDEX).get('weight_map')
    if (not isinstance(weight_map, dict) or not weight_map
        or not all(isinstance(f, str) for f in weight_map.values())):
      raise ValueError(f'{root / INDEX} has no "weight_map" of tensor names to files')
    for shard in sorted(set(weight_map.values())):
      if not (root / shard).is_file():
        raise ValueError(f'{root / INDEX} names the shard {shard}, which is missing')
    return Weights({name: root / shard for name, shard in weight_map.items()})
  if (root / SINGLE).is_file():
    return Weights(_names(root / SINGLE))
  other = [p.name for p in sorted(root.glob('*.bin'))] if root.is_dir() else []
  raise ValueError(f'{root} holds no {SINGLE} or {INDEX}' + (
      f' (only {", ".join(other)}: convert the PyTorch weights to safetensors first)'
      if other else ''))


def _names(path: pathlib.Path) -> dict[str, pathlib.Path]:
  with _open(path) as f:
    return {name: path for name in f.keys()}


def _read(path: pathlib.Path, read: tp.Callable[[], tp.Any]) -> tp.Any:
  """``read()``, a damaged file's error (a bad header, a file cut short) a
  ValueError naming ``path``."""
  from safetensors import SafetensorError  # pylint: disable=g-import-not-at-top
  try:
    return read()
  except (SafetensorError, OSError) as e:
    raise ValueError(f'{path} is not a readable safetensors file ({e}); it must be whole, '
                     f'as save_pretrained or poetx export writes it') from None


def _open(path: pathlib.Path):
  """The safetensors file ``path`` opened for numpy (a context manager)."""
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  return _read(path, lambda: safe_open(os.fspath(path), framework='numpy'))
