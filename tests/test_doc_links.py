"""Every relative link of the project's Markdown pages names a file that exists."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_relative_links_resolve():
  pages = [*ROOT.glob('*.md'), *(ROOT / 'docs').rglob('*.md')]
  assert len(pages) > 10
  broken = []
  for page in pages:
    for link in re.findall(r'\]\(([^)\s]+)\)', page.read_text()):
      if re.match(r'[a-z]+:', link) or link.startswith('#'):
        continue
      if not (page.parent / link.split('#')[0]).exists():
        broken.append(f'{page.relative_to(ROOT)}: {link}')
  assert not broken, broken
