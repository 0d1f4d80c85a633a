"""experiments/paper_report.py: a study's runs are collected whether or not they
finished, and their rows and ratios (its page: test_study_pages.py)."""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
from experiments import paper_report


def _study(tmp_path):
  """A study folder of two runs: AdamW finished, POET-X stopped at step 7
  after a warned merge."""
  study = tmp_path / 'study'
  (study / 'logs').mkdir(parents=True)
  (study / 'study.json').write_text(json.dumps({'header': {
      'model': 'tiny', 'model_overrides': {}, 'seq_len': 8, 'batch_size': 2, 'steps': 10,
      'warmup': 1, 'device': 'cpu', 'dense_params': 100, 'tokens_per_step': 20_000,
      'val_tokens': 32}}))
  for name, optimizer, last in (('a', 'adamw', 10), ('p', 'poetx', 7)):
    run = study / 'runs' / name
    run.mkdir(parents=True)
    plan = {'lr': 1e-3, 'weight_decay': 0.0, 'poet_lr': 5e-4 if optimizer == 'poetx' else None}
    (run / 'run.json').write_text(json.dumps({
        'optimizer': optimizer, 'lr': None, 'poet_lr': None, 'weight_decay': None,
        'param_dtype': 'float32', 'min_lr_ratio': 0.1, 'clip': 1.0, 'clip_ramp': 0,
        'poet_eps': 1e-8, 'poet_eps_placement': 'corrected', 'seed': 0, 'steps': 10,
        'plan': plan}))
    lines = [{'step': 0, 'val_ppl': 100.0}, {'step': 5, 'loss': 3.0},
             {'step': 5, 'val_ppl': 20.0 if optimizer == 'adamw' else 25.0},
             {'step': 5, 'other_val/prose/ppl': 40.0}, {'step': last, 'loss': 2.0}]
    (run / 'metrics.jsonl').write_text('\n'.join(json.dumps(l) for l in lines) + '\n')
    if optimizer == 'adamw':
      (run / 'summary.json').write_text('{"steady_tokens_per_s": 1234.5}')
    (study / 'logs' / f'{name}.log').write_text(
        'warning: at the merge of step 4 the POET factors were far from orthogonal\n'
        if optimizer == 'poetx' else '')
  return study


def test_collect_keeps_unfinished_runs_with_their_evaluations(tmp_path):
  res = paper_report.collect(_study(tmp_path))
  a, p = res['runs']
  assert a['finished'] and not p['finished'] and p['last_step'] == 7
  assert p['options']['lr'] == 1e-3 and p['options']['poet_lr'] == 5e-4  # the plan's values
  assert p['evals'][1] == {'step': 5, 'tokens': 100_000, 'val_ppl': 25.0, 'prose': 40.0}
  assert (a['merge_warnings'], p['merge_warnings']) == (0, 1)
  assert (a['tokens_per_s'], p['tokens_per_s']) == (1234.5, None)  # a finished run's only


def test_rows_and_ratios(tmp_path):
  res = paper_report.collect(_study(tmp_path))
  rows = paper_report.curve_rows(res)
  assert rows[0] == '| run | reached | 0.1 M | prose (last) | merges far from orthogonal |'
  assert rows[2] == '| AdamW fp32, lr 0.001, wd 0, seed 0 | finished | 20.00 | 40.00 at 5 | — |'
  assert rows[3] == ('| POET-X, step 0.0005, lr 0.001, seed 0 | step 7 of 10 | 25.00 | '
                     '40.00 at 5 | 1 |')
  ratios = paper_report.ratio_rows(res, [{'run': 'POET-X, step 0.0005, lr 0.001, seed 0',
                                          'against': 'AdamW fp32, lr 0.001, wd 0, seed 0'}])
  assert ratios[-2] == '| ratio | 1.250 |'


def _run(seed, finals, finished=True, optimizer='adamw'):
  o = {'optimizer': optimizer, 'param_dtype': 'bfloat16', 'lr': 1e-3, 'weight_decay': 0.0,
       'poet_lr': None, 'min_lr_ratio': 0.1, 'clip': 1.0, 'clip_ramp': 0, 'poet_eps': 1e-8,
       'poet_eps_placement': 'corrected', 'seed': seed}
  return {'options': o, 'finished': finished,
          'evals': [{'step': 9, 'val_ppl': finals + 1}, {'step': 10, 'val_ppl': finals}]}


def test_finals_group_the_finished_seeds_of_a_configuration_and_compare_them():
  """The last evaluation of each finished run, by configuration in seed
  order (an unfinished run left out), beside the three-sizes finals at the
  size, with the ratios of the means to the tuned AdamW and the best POET-X
  there (B 512 at 19M, B 256 at 5M)."""
  res = {'runs': [_run(1, 11.0), _run(0, 10.0), _run(2, 5.0, finished=False)]}
  assert paper_report.finals(res) == {'AdamW bf16, lr 0.001, wd 0': [10.0, 11.0]}
  rows = paper_report.finals_rows(res, '19M')
  (mine,) = [r for r in rows if r.startswith('| AdamW bf16')]
  adamw = sum([9.60, 9.70, 9.62]) / 3  # the three-sizes record's 19M finals
  poetx = sum([10.11, 10.27, 10.19]) / 3
  assert mine == (f'| AdamW bf16, lr 0.001, wd 0 | 10.00 / 11.00 | 10.50 ± 0.71 | '
                  f'{10.5 / adamw:.3f} | {10.5 / poetx:.3f} |')
  assert any(r.startswith('| POET-X B 512 (') and r.endswith('| 1.000 |') for r in rows)
  assert rows[0].endswith('| / tuned AdamW | / POET-X B 512 |')
  # At 5M the three-sizes study ran B 256 alone: the ratio is to it.
  rows = paper_report.finals_rows(res, '5M')
  assert rows[0].endswith('| / tuned AdamW | / POET-X B 256 |')
  (mine,) = [r for r in rows if r.startswith('| AdamW bf16')]
  assert mine.endswith(f'| {10.5 / 11.63:.3f} |')  # 11.63: the 5M record's B 256 mean


def test_the_page_has_one_finals_table_a_size_over_its_records(tmp_path):
  """finals-19m.json and finals-19m-more.json make one table at 19M that
  holds the runs of both."""
  folder = tmp_path / 'study'
  folder.mkdir()
  (folder / 'calls.json').write_text(json.dumps({
      'study': 's', 'date': 'd', 'commit': 'c', 'device': 'x', 'software': 'y',
      'calls': [{'records': ['finals-19m.json', 'finals-19m-more.json'], 'note': 'n',
                 'commands': []}]}))
  header = {'model': 'tiny', 'seq_len': 8, 'batch_size': 2, 'steps': 10, 'warmup': 1,
            'device': 'cpu', 'dense_params': 100, 'val_tokens': 32, 'tokens_per_step': 20}
  for name, runs in (('finals-19m.json', [_run(0, 10.0)]),
                     ('finals-19m-more.json', [_run(0, 12.0, optimizer='poetx')])):
    for r in runs:
      r.update(name=name, last_step=10, merge_warnings=0)
      r['options'].update(steps=10, poet_lr=5e-4 if r['options']['optimizer'] == 'poetx'
                          else None)
      for e in r['evals']:
        e.update(tokens=e['step'] * 20, prose=None)
    (folder / name).write_text(json.dumps({'header': header, 'runs': runs}))
  page = paper_report.report(folder)
  assert page.count('## Final validation perplexity at 19M') == 1, page
  table = page.split('## Final validation perplexity at 19M')[1].split('\n## ')[0]
  assert '| AdamW bf16, lr 0.001, wd 0 | 10.00 |' in table, table
  assert '| POET-X, step 0.0005, lr 0.001 | 12.00 |' in table, table
