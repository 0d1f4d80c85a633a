"""RESULTS.md is generated from the study records by experiments/results_page.py."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
from experiments import results_page


def test_results_md_is_generated_from_the_records():
  """A record changed without the page, or the page edited by hand, fails here:
  rerun ``python3 -m experiments.results_page``."""
  assert (ROOT / 'RESULTS.md').read_text() == results_page.report()


def test_every_row_links_a_study_page_and_its_record_that_exist():
  text = (ROOT / 'RESULTS.md').read_text()
  links = re.findall(r'\]\((docs/results/[\w-]+/README\.md)\) \(`([\w.-]+)`\)', text)
  assert len(links) == len(results_page.rows())
  for page, record in links:
    assert (ROOT / page).exists() and (ROOT / page).with_name(record).exists(), (page, record)
