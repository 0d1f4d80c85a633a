"""docs/layout.md names every Python module of the library, the app, the GPU
kernels and the experiments, and no module that does not exist.

The page has one section per folder, headed ``## `FOLDER/` ``, whose table
names the folder's modules in its first column (`` | `NAME.py` | ... ``).
A module added, moved or removed fails here until its row is added, moved
or removed (a new folder gets a section of its own).
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ('poetx_jax', 'pallas_kernels', 'experiments')


def modules_on_disk() -> set[str]:
  """Every .py file under PACKAGES, as a path from the repository root."""
  found = set()
  for top in PACKAGES:
    for path in (ROOT / top).rglob('*.py'):
      rel = path.relative_to(ROOT)
      if not any(part.startswith(('.', '__pycache__')) for part in rel.parts):
        found.add(rel.as_posix())
  return found


def modules_on_page(text: str) -> set[str]:
  """The modules the page's tables name, as paths from the repository root."""
  named, folder = set(), None
  for line in text.splitlines():
    heading = re.fullmatch(r'## `([\w/.-]+/)`', line.strip())
    if heading:
      folder = heading.group(1)
    elif line.startswith('## '):
      folder = None
    row = re.match(r'\| `([\w.-]+\.py)` \|', line)
    if row:
      assert folder is not None, f'docs/layout.md: a module row outside a folder section: {line}'
      named.add(folder + row.group(1))
  return named


def test_the_parser_reads_sections_and_rows():
  page = '## `a/`\n\n| module | x |\n|---|---|\n| `m.py` | y |\n\n## `a/b/`\n\n| `n.py` | z |\n'
  assert modules_on_page(page) == {'a/m.py', 'a/b/n.py'}


def test_layout_doc_names_every_module_and_only_those():
  on_page = modules_on_page((ROOT / 'docs' / 'layout.md').read_text())
  on_disk = modules_on_disk()
  assert len(on_disk) > 50
  missing, extra = sorted(on_disk - on_page), sorted(on_page - on_disk)
  assert not missing and not extra, (
      'docs/layout.md is out of date: '
      + (f'modules with no row there: {", ".join(missing)}' if missing else '')
      + ('; ' if missing and extra else '')
      + (f'rows naming no module: {", ".join(extra)}' if extra else ''))
