"""docs/results/memory/results.json was recovered from BENCHMARKS.md: every
entry's figures, commit and command are written in the section it names."""

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / 'docs' / 'results' / 'memory' / 'results.json').read_text())


def _sections() -> dict[str, str]:
  """BENCHMARKS.md's sections by heading, each with its subsections, its
  commands' continued lines joined and its whitespace collapsed."""
  text = (ROOT / 'BENCHMARKS.md').read_text()
  out = {}
  for part in re.split(r'\n(?=## )', text)[1:]:
    head, _, body = part.partition('\n')
    out[head[3:]] = ' '.join(body.replace('\\\n', ' ').split())
  return out


SECTIONS = _sections()


@pytest.mark.parametrize('entry', RECORD['entries'], ids=lambda e: e['id'])
def test_the_entry_is_written_in_its_section(entry):
  assert entry['section'] in SECTIONS, entry['section']
  assert f"({entry['date']})" in entry['section'] or f", {entry['date']})" in entry['section']
  text = SECTIONS[entry['section']]
  assert f"`{entry['commit']}`" in text
  assert entry['command'] in text
  if entry['peak_gib'] is None:
    assert entry.get('out_of_memory') and 'out of memory' in text
  else:
    assert f"{entry['peak_gib']:.2f}" in text
  if 'reserved_gib' in entry:
    assert f"{entry['reserved_gib']:.2f}" in text
  if 'tokens_per_s' in entry:
    assert f"{entry['tokens_per_s']:,}" in text
  if 'step_ms' in entry:
    v = entry['step_ms']
    assert any(s in text for s in (f'{v:g}', f'{v:.1f}', f'{v / 1000:.2f} s'))


def test_entries_are_unique_and_newest_first():
  ids = [e['id'] for e in RECORD['entries']]
  assert len(set(ids)) == len(ids)
  dates = [e['date'] for e in RECORD['entries']]
  assert dates == sorted(dates, reverse=True)
