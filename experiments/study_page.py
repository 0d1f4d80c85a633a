"""What the generated study pages share (chunk_report.py, scaling_report.py):
reading a folder's records, the list of calls with their commands, and the
command line that writes ``FOLDER/README.md``."""

from __future__ import annotations

import argparse
import json
import pathlib
import typing as tp


def load(folder: pathlib.Path, name: str):
  """The JSON record ``folder/name``."""
  return json.loads((folder / name).read_text())


def call_lines(meta: dict) -> list[str]:
  """``calls.json``'s calls: per call its records, the commit, date and device
  where they differ from the study's, its note, and its commands indented."""
  lines = []
  for i, call in enumerate(meta['calls'], 1):
    where = ', '.join(f'{k} {call[k]}' for k in ('commit', 'date', 'device') if k in call)
    lines.append(f"Call {i} ({', '.join(call['records'])}{'; ' + where if where else ''})"
                 + (f": {call['note']}" if call.get('note') else '') + ':')
    lines += ['', *[f'    {c}' for c in call['commands']], '']
  return lines


def main(doc: str, report: tp.Callable[[pathlib.Path], str], argv=None) -> None:
  """``SCRIPT FOLDER``: writes ``report(FOLDER)`` to ``FOLDER/README.md`` and prints it."""
  p = argparse.ArgumentParser(description=doc.splitlines()[0])
  p.add_argument('folder', type=pathlib.Path)
  a = p.parse_args(argv)
  text = report(a.folder)
  (a.folder / 'README.md').write_text(text)
  print(text)
