"""experiments/three_sizes_report.py: restoring kept pairs and choosing the best POET-X
(its page: test_study_pages.py)."""

import math
import pathlib
import statistics

ROOT = pathlib.Path(__file__).resolve().parents[1]
from experiments import three_sizes_report as T


def test_a_kept_pair_is_restored_to_two_values_of_its_mean_and_sd():
  f = {'finals': [10.0], 'pair': {'mean': 11.0, 'sd': 0.5}}
  v = T.finals(f)
  assert len(v) == 3 and v[0] == 10.0
  assert math.isclose(statistics.mean(v[1:]), 11.0) and math.isclose(statistics.stdev(v[1:]), 0.5)


def test_ratios_take_the_best_poetx_of_the_size():
  size = {'families': {'AdamW': {'finals': [10.0, 10.0]}, 'Muon': {'finals': [8.0, 8.0]},
                       'POET-X B 256': {'finals': [12.0, 12.0]},
                       'POET-X B 512': {'finals': [11.0, 11.0]}}}
  assert T.best_poetx(size) == 'POET-X B 512'
  assert T.ratios(size) == {'AdamW': 1.1, 'Muon': 11.0 / 8.0}
