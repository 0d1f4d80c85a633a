"""experiments/paper_report.py: a study's runs are collected whether or not they
finished, and their rows and ratios (its page: test_study_pages.py)."""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
from experiments import paper_answer, paper_report


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
    clock = lambda s: {'train_s': 5.0 + 2 * s, 'compile_s': 5.0}  # 20,000 tokens in 2 s
    lines = [{'step': 0, 'val_ppl': 100.0}, {'step': 5, 'loss': 3.0, **clock(5)},
             {'step': 5, 'val_ppl': 20.0 if optimizer == 'adamw' else 25.0},
             {'step': 5, 'other_val/prose/ppl': 40.0}, {'step': last, 'loss': 2.0, **clock(last)}]
    (run / 'metrics.jsonl').write_text('\n'.join(json.dumps(l) for l in lines) + '\n')
    if optimizer == 'adamw':
      (run / 'summary.json').write_text('{}')
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
  assert (a['tokens_per_s'], p['tokens_per_s']) == (10_000, None)  # a finished run's only


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


def test_collect_keeps_the_studys_jobs(tmp_path):
  study = _study(tmp_path)
  meta = json.loads((study / 'study.json').read_text())
  assert 'jobs' not in paper_report.collect(study)['header']  # a study that kept none
  meta['header']['jobs'] = 3
  (study / 'study.json').write_text(json.dumps(meta))
  assert paper_report.collect(study)['header']['jobs'] == 3


def _finished(seed, final, prose=None, tokens_per_s=None, **options):
  """A finished run of a record: its options those of the app's POET-X at
  19M (the three-sizes study's lr 1.2e-2) with ``options`` changed."""
  o = {'optimizer': 'poetx', 'param_dtype': 'float32', 'lr': 1.2e-2, 'weight_decay': 0.0,
       'poet_lr': 5e-4, 'min_lr_ratio': 0.1, 'clip': 1.0, 'clip_ramp': 0, 'poet_eps': 1e-8,
       'poet_eps_placement': 'corrected', 'seed': seed, 'steps': 10, **options}
  return {'name': f'r{seed}{final}', 'options': o, 'finished': True, 'last_step': 10,
          'merge_warnings': 0, 'tokens_per_s': tokens_per_s,
          'evals': [{'step': 5, 'tokens': 100, 'val_ppl': final + 1, 'prose': None},
                    {'step': 10, 'tokens': 200, 'val_ppl': final, 'prose': prose}]}


def _answer_folder(tmp_path):
  """A study folder with two 19M records and nothing at 5M or 130M: the
  reference recipe run three ways (eps lowest) beside a POET-X run of the
  app's recipe, AdamW as the paper trains it at two rates, and no POET-X
  Muon; ``finals-19m.json`` collected from a call of two runs at once,
  ``finals-19m-more.json`` from one that ran them one at a time."""
  folder = tmp_path / 'paper'
  folder.mkdir()
  cq = 'python3 -m experiments.compare_quality --steps 10'
  collect = 'python3 -m experiments.paper_report --collect'
  (folder / 'calls.json').write_text(json.dumps({
      'study': 's', 'date': 'd', 'commit': 'c', 'device': 'x',
      'calls': [{'records': ['finals-19m.json'], 'note': 'side by side',
                 'commands': [f'{cq} --jobs 2 --out runs/a --runs x',
                              f'{collect} runs/a finals-19m.json']},
                {'records': ['finals-19m-more.json'],
                 'commands': [f'{cq} --out runs/b --runs y',
                              f'{collect} runs/b finals-19m-more.json'],
                 'predictions': ['it ends below 10'], 'outcomes': ['it ended at 10.0']},
                {'records': ['step-1b.json'], 'commands': [], 'outcomes': ['muon 0.9x']}]}))
  header = {'model': 'tiny', 'seq_len': 8, 'batch_size': 2, 'steps': 10, 'warmup': 1,
            'device': '1 x GPU', 'dense_params': 100, 'val_tokens': 32, 'tokens_per_step': 20}
  records = {
      'finals-19m.json': [
          _finished(0, 10.5, prose=30.0, tokens_per_s=1000.0, min_lr_ratio=0.01),
          _finished(0, 9.0, prose=20.0),  # the app's recipe: no difference, not the reference's
          _finished(0, 10.0, prose=22.0, tokens_per_s=300.0, optimizer='adamw',
                    param_dtype='bfloat16', lr=1e-3),
          _finished(1, 11.0, prose=26.0, tokens_per_s=500.0, optimizer='adamw',
                    param_dtype='bfloat16', lr=1e-3),
          _finished(0, 12.0, optimizer='adamw', param_dtype='bfloat16', lr=5e-4),
          _finished(0, 8.0, optimizer='adamw', param_dtype='float32', lr=1e-3,
                    weight_decay=0.1)],  # not as the paper trains it
      'finals-19m-more.json': [
          _finished(0, 10.0, prose=24.0, tokens_per_s=900.0, poet_eps=1e-6,
                    poet_eps_placement='raw'),
          _finished(0, 10.3, lr=2e-3)]}
  for name, runs in records.items():
    (folder / name).write_text(json.dumps({'header': header, 'runs': runs}))
  (folder / 'state-8b.json').write_text(json.dumps({
      'header': {'command': 'python3 -m experiments.bench_memory --state-only', 'commit': 'c',
                 'device': 'cpu', 'date': 'd'},
      'results': [{'run': run, 'model': '8b', 'model_gib': 1.0, 'trainable_gib': 0.5,
                   'optimizer_gib': gib}
                  for run, gib in (('poetx', 4.0), ('poetx-muon', 3.0), ('adamw-bf16', 27.0),
                                   ('adamw', 54.0), ('muon', 28.0))]}))
  return folder


def _answer_table(page):
  """The answer's table rows, as lists of cells."""
  section = page.split('## The answer, size by size')[1]
  table = section[section.index('\n| size |'):].split('\n\n')[0].splitlines()[3:]
  return [[c.strip() for c in l.strip('|').split('|')] for l in table]


def test_the_answer_has_a_row_per_size_and_family_in_order(tmp_path):
  page = paper_report.report(_answer_folder(tmp_path))
  assert page.index('## The answer, size by size') < page.index('## Final validation perplexity')
  rows = _answer_table(page)
  families = ['POET-X', 'POET-X, reference recipe', 'POET-X Muon',
              'AdamW as the paper trains it', 'tuned AdamW', 'Muon']
  assert [(r[0], r[1]) for r in rows] == [(s, f) for s in ('5M', '19M', '130M') for f in families]
  # A family without a finished run keeps its row, every figure "not run";
  # the optimizer state, known without a run, is the family's.
  by = {(r[0], r[1]): r for r in rows}
  assert by['19M', 'POET-X Muon'] == ['19M', 'POET-X Muon', *['not run'] * 5, '3.00']
  for f in families[1:4]:
    assert by['5M', f][2:7] == ['not run'] * 5 and by['130M', f][2:7] == ['not run'] * 5


def test_the_answer_picks_the_lowest_mean_and_gives_its_ratio_to_the_tuned_adamw(tmp_path):
  from experiments import three_sizes_report as T
  page = paper_report.report(_answer_folder(tmp_path))
  rows = {(r[0], r[1]): r for r in _answer_table(page)}
  tuned = sum([9.60, 9.70, 9.62]) / 3  # the three-sizes record's AdamW at 19M
  # The reference recipe: of min-lr (10.5), eps (10.0) and the other rate
  # (10.3), eps, the app's own recipe (9.0) not among them.
  ref = rows['19M', 'POET-X, reference recipe']
  assert ref[2] == ('POET-X, step 0.0005, lr 0.012, eps 1e-06 raw '
                    '(eps 1e-06 raw only; the lowest of 3)')
  assert ref[3:8] == ['10.00; 10.00 (1)', f'{10.0 / tuned:.3f}', '24.00', '900', '4.00']
  # AdamW as the paper trains it: bf16, wd 0, its rate of lowest mean (1e-3,
  # seeds 10 and 11, over 5e-4's 12); its two runs shared the GPU.
  paper = rows['19M', 'AdamW as the paper trains it']
  # No higher rate finished, so the sweep does not bracket it: the row says so.
  assert paper[2] == 'AdamW bf16, lr 0.001, wd 0 (the lowest of 2 rates; no higher rate finished)'
  assert paper[3:8] == ['10.00 / 11.00; 10.50 ± 0.71 (2)', f'{10.5 / tuned:.3f}', '24.00',
                        '300 (shared GPU) / 500 (shared GPU)', '27.00']
  # The three-sizes families: their finals, no prose or speed here.
  size = next(s for s in paper_report.load(paper_report.THREE_SIZES, 'finals.json')['sizes']
              if s['size'] == '19M')
  poetx = sum(T.finals(size['families']['POET-X B 512'])) / 3
  assert rows['19M', 'POET-X'][2].startswith('POET-X B 512: ')
  assert rows['19M', 'POET-X'][4:7] == [f'{poetx / tuned:.3f}', '—', '—']
  assert rows['19M', 'tuned AdamW'][4] == '1.000'
  assert (f"At 19M, POET-X ends {poetx / tuned:.3f}× the tuned AdamW's perplexity and "
          f'{poetx / 10.5:.3f}× that of AdamW as the paper trains it; POET-X Muon: not run.'
          in page)
  assert '| poetx-muon | 1.00 | 0.50 | 3.00 |' in page


def test_a_rows_speeds_mark_each_run_that_shared_the_gpu():
  """A configuration whose seeds ran alone and beside other runs marks only
  the shared ones."""
  from experiments import paper_answer
  h100 = ['1 x NVIDIA H100 80GB HBM3'] * 2
  row = {'tokens_per_s': [844296.2, 257167.7], 'shared_runs': [False, True], 'devices': h100}
  assert paper_answer.speeds(row) == '844,296 / 257,168 (shared GPU)'
  row = {'tokens_per_s': [257167.7, 844296.2], 'shared_runs': [True, False], 'devices': h100}
  assert paper_answer.speeds(row) == '257,168 (shared GPU) / 844,296'
  assert paper_answer.speeds({'tokens_per_s': [], 'shared_runs': [], 'devices': []}) == '—'


def test_a_rows_speeds_name_the_card_of_each_run_only_where_the_cards_differ():
  from experiments import paper_answer
  h100, h200 = '1 x NVIDIA H100 80GB HBM3', '1 x NVIDIA H200'
  row = {'tokens_per_s': [233426.1, 291996.4, 300000.0], 'shared_runs': [False, False, True],
         'devices': [h100, h200, h100]}
  assert paper_answer.speeds(row) == '233,426 (H100) / 291,996 (H200) / 300,000 (H100, shared GPU)'
  row['devices'] = [h200] * 3
  assert paper_answer.speeds(row) == '233,426 / 291,996 / 300,000 (shared GPU)'


def test_a_record_shares_the_gpu_by_its_calls_jobs_or_its_header():
  meta = {'calls': [{'records': ['finals-5m.json', 'finals-19m.json'], 'commands': [
      'python3 experiments/compare_quality.py --jobs 4 --out runs/q5 --runs a',
      'python3 -m experiments.compare_quality --out runs/q19 --runs b',
      'python3 experiments/paper_report.py --collect runs/q5 finals-5m.json',
      'python3 -m experiments.paper_report --collect runs/q19/ docs/x/finals-19m.json']}]}
  assert paper_report.record_jobs(meta, 'finals-5m.json', {'header': {}}) == 4
  assert paper_report.record_jobs(meta, 'finals-19m.json', {'header': {}}) == 1
  assert paper_report.record_jobs(meta, 'finals-19m.json', {'header': {'jobs': 2}}) == 2
  assert paper_report.record_jobs(meta, 'finals-130m.json', {'header': {}}) == 1  # in no call


def test_the_answer_says_where_the_best_rate_is_not_bracketed(tmp_path):
  folder = _answer_folder(tmp_path)
  rec = json.loads((folder / 'finals-19m-more.json').read_text())
  paper = dict(optimizer='adamw', param_dtype='bfloat16')
  def row(*runs):
    (folder / 'finals-19m-more.json').write_text(
        json.dumps({**rec, 'runs': rec['runs'] + list(runs)}))
    rows = {(r[0], r[1]): r for r in _answer_table(paper_report.report(folder))}
    return rows['19M', 'AdamW as the paper trains it'][2]
  # 2e-3 (worse than 1e-3, better than 5e-4) brackets 1e-3 from above.
  assert row(_finished(0, 11.0, lr=2e-3, **paper)) == (
      'AdamW bf16, lr 0.001, wd 0 (the lowest of 3 rates)')
  # A lower rate that wins is at the sweep's other edge.
  assert row(_finished(0, 9.0, lr=2.5e-4, **paper)) == (
      'AdamW bf16, lr 0.00025, wd 0 (the lowest of 3 rates; no lower rate finished)')
  # An unfinished run is not part of the sweep.
  assert row({**_finished(0, 11.0, lr=2e-3, **paper), 'finished': False}) == (
      'AdamW bf16, lr 0.001, wd 0 (the lowest of 2 rates; no higher rate finished)')


def test_a_records_commands_are_its_study_its_collect_and_the_corpus_it_read():
  corpus = 'python3 -m experiments.site_corpus --out data/site'
  meta = {'calls': [
      {'records': ['finals-5m.json'], 'commands': [
          corpus,
          'python3 -m experiments.compare_quality --out runs/a --runs x',
          'python3 -m experiments.compare_quality --out runs/b --runs y',
          'python3 -m experiments.paper_report --collect runs/b finals-5m.json']},
      {'records': ['step.json'], 'commands': [
          "python3 -m experiments.bench_train --json step.json  # in a copy of c's tree"]},
      {'records': ['finals-19m.json'], 'commands': [  # on the machine of the first call
          'python3 -m experiments.compare_quality --jobs 3 --out runs/c --runs z',
          'python3 -m experiments.paper_report --collect runs/c/ finals-19m.json']}]}
  assert paper_report.record_commands(meta, 'finals-5m.json') == [
      corpus, *meta['calls'][0]['commands'][2:]]
  # A call that built no corpus read the latest one built before it.
  assert paper_report.record_commands(meta, 'finals-19m.json') == [
      corpus, *meta['calls'][2]['commands']]
  assert paper_report.record_jobs(meta, 'finals-19m.json', {'header': {}}) == 3
  assert paper_report.record_commands(meta, 'finals-130m.json') == []


def test_standing_is_ahead_or_behind_only_beyond_the_larger_seed_sd():
  assert paper_answer.standing([9.0, 9.2], [9.5, 9.5]) == 'ahead'  # 0.4 apart, sd 0.14
  assert paper_answer.standing([9.0, 9.2], [9.2, 9.2]) == 'level'  # 0.1 apart
  assert paper_answer.standing([9.5], [9.0, 9.2]) == 'behind'
  assert paper_answer.standing([9.5], [9.4]) == 'behind'  # single seeds: no spread


def test_the_answer_says_which_claim_holds_under_which_baseline(tmp_path):
  page = paper_report.report(_answer_folder(tmp_path))
  # At 19M the three-sizes POET-X B 512 (10.11 / 10.27 / 10.19) against the
  # folder's AdamW bf16 (10.0 / 11.0: sd 0.71, level) and the tuned AdamW
  # (9.60 / 9.70 / 9.62: behind); at 5M and 130M nothing as the paper.
  assert ("The paper's claim, POET-X ahead of AdamW, against AdamW as the paper trains it "
          'is level at 19M; against the tuned AdamW fails at 5M, 19M and 130M' in page)


def test_the_sweep_note_counts_rates_not_configurations(tmp_path):
  folder = _answer_folder(tmp_path)
  rec = json.loads((folder / 'finals-19m-more.json').read_text())
  # a second configuration at lr 1e-3 (min-lr 0.01), worse than the best
  extra = _finished(0, 12.5, lr=1e-3, min_lr_ratio=0.01, optimizer='adamw',
                    param_dtype='bfloat16')
  (folder / 'finals-19m-more.json').write_text(json.dumps({**rec, 'runs': rec['runs'] + [extra]}))
  rows = {(r[0], r[1]): r for r in _answer_table(paper_report.report(folder))}
  assert rows['19M', 'AdamW as the paper trains it'][2] == (
      'AdamW bf16, lr 0.001, wd 0 (the lowest of 2 rates; no higher rate finished)')


def test_the_claim_sentence_names_each_standing_and_a_baseline_not_run():
  def row(size, family, finals):
    return {'size': size, 'family': family, 'config': 'c' if finals else None,
            'finals': finals}
  rows = [row('5M', 'POET-X', [10.0, 10.1]), row('5M', 'AdamW as the paper trains it', [11.0]),
          row('5M', 'tuned AdamW', [10.05, 10.0]),
          row('19M', 'POET-X', [9.0]), row('19M', 'AdamW as the paper trains it', [9.5]),
          row('19M', 'tuned AdamW', [8.0])]
  assert paper_answer.claim_sentence(rows) == (
      "The paper's claim, POET-X ahead of AdamW, against AdamW as the paper trains it holds at "
      '5M and 19M; against the tuned AdamW is level at 5M; fails at 19M (ahead or behind: the '
      'means differ by more than the larger seed sd of the two; level: by less).')
  assert 'trains it has not run;' in paper_answer.claim_sentence(
      [r for r in rows if r['family'] != 'AdamW as the paper trains it'])


def test_a_call_whose_studies_trained_together_shares_the_gpu():
  cq = 'python3 -m experiments.compare_quality'
  call = {'records': ['finals-130m.json', 'finals-5m.json'], 'commands': [
      f'{cq} --out runs/a --runs x',
      f'{cq} --jobs 3 --out runs/b --runs y z w',
      'python3 -m experiments.paper_report --collect runs/a finals-130m.json',
      'python3 -m experiments.paper_report --collect runs/b finals-5m.json']}
  one, three = {'header': {}, 'runs': [{}]}, {'header': {'jobs': 3}, 'runs': [{}, {}, {}]}
  # One after the other: the lone 130M run had the GPU to itself.
  assert paper_report.record_jobs({'calls': [call]}, 'finals-130m.json', one) == 1
  assert not paper_report.shares_gpu({'calls': [call]}, 'finals-130m.json', one)
  assert paper_report.shares_gpu({'calls': [call]}, 'finals-5m.json', three)
  # Together: four runs at once, the lone run among them.
  meta = {'calls': [{**call, 'together': True}]}
  assert paper_report.record_jobs(meta, 'finals-130m.json', one) == 4
  assert paper_report.shares_gpu(meta, 'finals-130m.json', one)
  assert paper_report.shares_gpu(meta, 'finals-5m.json', three)
  # A lone run of a --jobs study shared the GPU with nothing.
  assert not paper_report.shares_gpu({'calls': [call]}, 'finals-5m.json',
                                     {'header': {'jobs': 3}, 'runs': [{}]})


def test_outcomes_say_which_call_when_no_prediction_came_before_them(tmp_path):
  page = paper_report.report(_answer_folder(tmp_path))
  assert ('Predictions stated before the call writing finals-19m-more.json:\n\n'
          '* it ends below 10\n\nOutcomes:\n\n* it ended at 10.0\n') in page
  assert ('Outcomes of the call writing step-1b.json (no prediction stated before it):\n\n'
          '* muon 0.9x\n') in page
