"""RESULTS.md, and the results rows of README.md, are generated from the study
records by experiments/results_page.py."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
from experiments import results_page


def test_results_md_is_generated_from_the_records():
  """A record changed without the page, or the page edited by hand, fails here:
  rerun ``python3 -m experiments.results_page``."""
  assert (ROOT / 'RESULTS.md').read_text() == results_page.report()


def test_every_row_links_a_study_page_and_its_record_that_exist():
  text = (ROOT / 'RESULTS.md').read_text()
  links = re.findall(r'\]\((docs/results/[\w-]+/README\.md)\) \(((?:`[\w.-]+`(?:, )?)+)\) \|$',
                     text, flags=re.M)
  assert len(links) == len(results_page.rows())
  for page, records in links:
    for record in re.findall(r'`([\w.-]+)`', records):
      assert (ROOT / page).exists() and (ROOT / page).with_name(record).exists(), (page, record)


def test_readme_results_rows_are_generated_from_the_records():
  """The README's block between its results markers is what results_page
  writes now: a record changed, or the block edited by hand, fails here
  (rerun ``python3 -m experiments.results_page``)."""
  readme = (ROOT / 'README.md').read_text()
  assert results_page.readme_block() in readme, (
      'README.md\'s results block is stale: run python3 -m experiments.results_page')
  assert readme.count(results_page.README_BEGIN) == readme.count(results_page.README_END) == 1


def test_readme_block_shows_each_chosen_row_as_results_md_does():
  block = results_page.readme_block()
  results = (ROOT / 'RESULTS.md').read_text()
  rows = {r['claim']: r for r in results_page.rows()}
  for claim in results_page.README_CLAIMS:
    figure = rows[claim]['figure']
    assert f'| {claim} | {figure} |' in block and f'| {claim} | {figure} |' in results, claim


def test_with_readme_block_rewrites_only_between_the_markers():
  stale = (f'# title\n\nbefore\n{results_page.README_BEGIN}\n| 1 | old figure |\n'
           f'{results_page.README_END}\nafter\n')
  new = results_page.with_readme_block(stale)
  assert new == f'# title\n\nbefore\n{results_page.readme_block()}\nafter\n'
  assert results_page.with_readme_block(new) == new
  with pytest.raises(ValueError, match='results:begin'):
    results_page.with_readme_block('# no markers\n')


# RESULTS.md's headline figures as its rows write them: a number of three
# digits or more followed by its unit ('0.878×', '787.7 ms', '1162 µs',
# '25.93 GiB'), and a bare number with three decimals (the efficiencies,
# '0.984'). Typed by hand into README.md or a page of docs/, such a figure
# goes stale when its record changes; those pages link RESULTS.md instead
# (or show it in a block that results_page writes).
FIGURE = re.compile(r'(?<![\d.,])(?:\d[\d,.]*\d ?(?:×|ms|µs|GiB|MiB)|\d+\.\d{3}(?![\d.]))')


def headline_figures() -> set[str]:
  figures = set()
  for row in results_page.rows():
    for m in FIGURE.finditer(row['figure']):
      if len(re.sub(r'\D', '', m.group())) >= 3:
        figures.add(m.group())
  return figures


def test_headline_figures_are_what_the_rule_finds():
  figures = headline_figures()
  rows = {r['claim']: r['figure'] for r in results_page.rows()}
  assert '0.984' in figures and '25.93 GiB' in figures
  assert any(f.endswith('×') and f in rows['POET-X step against AdamW, 8B'] for f in figures)
  assert not any(f.endswith('%') for f in figures)


def test_no_headline_figure_is_typed_by_hand_in_readme_or_docs():
  """README.md and docs/*.md (not docs/results/, whose study pages are
  generated with the records, and not BENCHMARKS.md, the dated log) hold
  none of RESULTS.md's headline figures outside the README's generated
  block: they link RESULTS.md."""
  figures = headline_figures()
  assert len(figures) > 10
  found = []
  for page in [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]:
    text = page.read_text()
    if results_page.README_BEGIN in text:
      begin, end = text.index(results_page.README_BEGIN), text.index(results_page.README_END)
      text = text[:begin] + '\n' * text[begin:end].count('\n') + text[end:]  # lines kept
    for n, line in enumerate(text.splitlines(), 1):
      for figure in figures:
        if re.search(r'(?<![\d.,])' + re.escape(figure) + r'(?![\d]|\.\d)', line):
          found.append(f'{page.relative_to(ROOT)}:{n}: {figure}')
  assert not found, ('RESULTS.md figures typed by hand (link RESULTS.md instead): '
                     + '; '.join(found))


def test_a_row_of_several_records_lists_each_calls_commit_and_date_in_one_order():
  r = results_page._row('c', 'f', 'paper-baseline', 'finals-130m.json',
                        'finals-130m-muon-seed1.json')
  assert r['records'] == ['finals-130m.json', 'finals-130m-muon-seed1.json']
  assert (r['commit'], r['date']) == ('59ea6a1, f35ef06', '2026-12-06, 2026-12-07')
  assert r['device'] == 'one NVIDIA H100 80GB HBM3'  # the same for both calls: once
  assert any('finals-130m-muon-seed1.json' in c for c in r['commands'])
  assert any('--collect runs/q130 finals-130m.json' in c for c in r['commands'])


def test_a_poetx_muon_row_names_its_schedules_end_only_where_it_is_not_the_studys():
  """The paper-baseline rows of POET-X Muon: the configuration of lowest mean
  at 19M ends its schedule at 0.01 (the claim says so), at 130M at the
  three-sizes study's 0.1 (the claim says nothing)."""
  claims = [r['claim'] for r in results_page.paper_rows() if r['claim'].startswith('POET-X Muon')]
  by_size = {c.rsplit(', ', 2)[-2]: c for c in claims}
  assert 'its schedule ending at 0.01 of the peak rate' in by_size['19M']
  assert 'schedule' not in by_size['130M']
