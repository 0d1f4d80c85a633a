"""experiments/chunk_report.py: the quality rows of the chunk-permutation page
(the page itself: test_study_pages.py)."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
from experiments import chunk_report


def _run(config, seed, final, prose=None):
  return {'config': config, 'seed': seed, 'val_ppl_final': final,
          'other_val_final': {'prose': prose} if prose is not None else {},
          'evals': [{'step': 0, 'tokens': 0, 'val_ppl': 100.0},
                    {'step': 10, 'tokens': 640, 'val_ppl': final}]}


def test_quality_rows_pair_each_draw_with_the_element_run_of_its_seed():
  """Per draw: each seed's final perplexity, a stopped run's last evaluation,
  a seed that never ran, mean ± sd of the finished ones, and the difference
  from the element run of the same seed only."""
  el, ch = 'optimizer=poetx,permutation=element', 'optimizer=poetx,permutation=chunk,chunk_size=8'
  res = {'header': {'failed_runs': [f'{el},seed=2', f'{ch},seed=2'],
                    'last_evals': {f'{el},seed=2': {'step': 5, 'tokens': 2_000_000,
                                                    'val_ppl': 20.0, 'reached': 7}}},
         'runs': [_run(el, 0, 10.0, 30.0), _run(el, 1, 12.0, 34.0),
                  _run(ch, 0, 10.5, 31.0), _run(ch, 1, 11.0)]}
  rows = chunk_report.quality_rows(res)
  assert rows[0].startswith('| draw | seed 0 | seed 1 | seed 2 |')
  element = next(r for r in rows if r.startswith('| element'))
  chunk = next(r for r in rows if r.startswith('| chunk, runs of 8'))
  assert '| 10.00 | 12.00 | stopped at 7 (20.00 at 2.0 M) | 11.00 ± 1.41 | 32.00 | — |' in element
  assert '| 10.50 | 11.00 | not run | 10.75 ± 0.35 | 31.00 | +0.50, -1.00 |' in chunk


def test_a_reference_is_set_beside_the_runs_of_the_same_seeds():
  res = {'runs': [_run('optimizer=poetx,permutation=chunk', 0, 10.13)]}
  ref = {'what': 'the element draw', 'source': 'x.md', 'final_ppl': {'0': 10.11, '1': 10.27},
         'prose_mean': 23.11, 'prose_sd': 0.3}
  line = chunk_report.reference_line(res, ref)
  assert 'seed 0: 10.11 (this study +0.02), seed 1: 10.27;' in line
  assert line.endswith('prose 23.11 ± 0.30.')


def test_configurations_of_one_draw_keep_rows_of_their_own():
  """Two configurations with the same draw (another rate) are two rows: a
  run of one does not stand in for the other's."""
  a, b = 'optimizer=poetx,permutation=element,lr=1e-3', 'optimizer=poetx,permutation=element,lr=2e-3'
  rows = chunk_report.quality_rows({'header': {}, 'runs': [_run(a, 0, 10.0), _run(b, 0, 12.0)]})
  assert [r.split(' | ')[1] for r in rows[2:]] == ['10.00', '12.00']


def test_a_run_is_labelled_by_the_draw_its_record_says_it_ran():
  """compare_quality records the plan's draw: a run whose overrides leave it
  open (a GPU run draws chunk permutations then) is labelled by the record."""
  run = {**_run('optimizer=poetx', 0, 10.0), 'permutation': 'chunk', 'chunk_size': 16}
  assert chunk_report._draw('optimizer=poetx', run) == 'chunk, runs of 16'
  assert chunk_report._draw('optimizer=poetx') == 'default draw'  # neither says: the device's
  assert chunk_report._draw('optimizer=poetx,permutation=element') == 'element'
  assert chunk_report._draw('optimizer=poetx,permutation=chunk,chunk_size=8') == 'chunk, runs of 8'
