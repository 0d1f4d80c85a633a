"""JSON records read back from files: a JSON-lines file whose last line a
crash may have cut short (that line dropped with a warning), and a file
holding one JSON object; a damaged record raises an error naming the file
and what is wrong.

    records = read_jsonl(out / 'metrics.jsonl', warn=print, required=('step',))
    record = read_json(out / 'data.json', required=('tokenizer',))  # damage named
"""

from __future__ import annotations

import json
import os
import typing as tp
from pathlib import Path


def read_jsonl(path: str | os.PathLike, *, warn: tp.Callable[[str], object],
               required: tuple[str, ...] = ()) -> list[dict]:
  """The records of a JSON-lines file: one JSON object a line, each with the
  keys ``required``; blank lines are skipped.

  A damaged last line (what a crash in the middle of appending leaves) is
  dropped, with ``warn(message)`` naming the file and line. A damaged line
  before the last raises ValueError naming the file and line.
  """
  lines = Path(path).read_bytes().split(b'\n')
  last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
  records = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      record = json.loads(line.decode())
      if not isinstance(record, dict):
        raise ValueError(f'a JSON {type(record).__name__}, not an object')
      missing = [k for k in required if k not in record]
      if missing:
        raise ValueError(f'no {", ".join(map(repr, missing))}')
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
      if i == last:
        warn(f'WARNING: {path} line {i + 1} is cut short (a write interrupted by a crash?): '
             f'dropped')
        continue
      raise ValueError(f'{path} line {i + 1} is not a JSON record ({e}); repair or delete '
                       f'that line') from None
    records.append(record)
  return records


def read_json(path: str | os.PathLike, *, required: tuple[str, ...] = (),
              error: type[Exception] = ValueError) -> dict:
  """The JSON object of the file ``path``, with the keys ``required``.

  Raises:
    error: naming the file and what is wrong: unreadable, not JSON, not an
      object, or missing a required key (FileNotFoundError when absent).
  """
  try:
    record = json.loads(Path(path).read_bytes().decode())
    if not isinstance(record, dict):
      raise ValueError(f'a JSON {type(record).__name__}, not an object')
    missing = [k for k in required if k not in record]
    if missing:
      raise ValueError(f'no {", ".join(map(repr, missing))}')
  except FileNotFoundError:
    raise
  except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    raise error(f'{path} is damaged ({e}); it cannot be read as the record it should be') from None
  return record
