"""The GPU benchmark scripts run end to end on tiny shapes (CPU smoke tests)."""

import argparse
import json
import pathlib
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
from experiments import bench_layer, bench_train, harness
from conftest import SQUARE, overrides

# The tiny model with every projection 32 x 32 (one layer shape: few merge and
# build programs to compile), as --model-overrides text.
SQUARE_1 = overrides(SQUARE)
SQUARE_2 = overrides({**SQUARE, 'layers': 2})


@pytest.mark.slow
def test_bench_layer_checks_and_times(tmp_path):
  out = tmp_path / 'layer.json'
  bench_layer.main(['--shapes', '64x96', '--blocks', '32', '--tokens', '64',
                    '--iters', '1', '--json', str(out)])
  (row,) = harness.results_of(json.loads(out.read_text()))
  assert row['checks']['poetx xla fast']['dq_in'] < 3e-2
  assert row['ms']['dense (W trained)'][0] > 0


def _bench_args(*argv):
  p = argparse.ArgumentParser()
  bench_train.add_run_args(p)
  return p.parse_args(['--model', 'tiny', '--model-overrides', 'layers=1,mlp=64',
                       '--seq-len', '32', '--batch-size', '2', '--vocab-size', '512',
                       '--dtype', 'float32', *argv])


def test_bench_train_runs_are_overrides_of_the_train_options():
  a = _bench_args('--lean-state')
  assert [r.label for r in bench_train.runs_of(a)] == ['optimizer=poetx', 'optimizer=adamw']
  b = _bench_args('--run', 'xq:optimizer=poetx,quantize=int8|int4')
  assert [(r.label, r.overrides) for r in bench_train.runs_of(b)] == [
      ('xq quantize=int8', 'optimizer=poetx,quantize=int8'),
      ('xq quantize=int4', 'optimizer=poetx,quantize=int4')]
  cfg = bench_train.run_config(a, 'optimizer=poetx,mode=mem,remat=block,quantize=int8')
  assert (cfg.model, cfg.model_overrides, cfg.seq_len, cfg.batch_size, cfg.vocab_size) == (
      'tiny', {'layers': 1, 'mlp': 64}, 32, 2, 512)
  assert (cfg.optimizer, cfg.mode, cfg.remat, cfg.quantize, cfg.lean_state) == (
      'poetx', 'mem', 'block', 'int8', True)
  assert (cfg.merge_every, cfg.steps) == (200, 1000)  # bench_train's own defaults
  assert bench_train.run_config(a, 'optimizer=poetx,skew_tiers=true,lean_state=false').skew_tiers
  assert bench_train.run_config(a, 'strategy=fsdp').fsdp == jax.device_count()
  with pytest.raises(ValueError, match="'remat_policy' .* is not an option; valid: model, "):
    bench_train.run_config(a, 'remat_policy=block')
  with pytest.raises(ValueError, match="quantize='int8': option of the POET layers"):
    bench_train.run_config(a, 'optimizer=adamw,quantize=int8')


@pytest.mark.slow
def test_bench_train_one_run(monkeypatch):
  a = _bench_args('--lean-state', '--model-overrides', SQUARE_1)
  cfg = bench_train.run_config(a, 'optimizer=poetx,mode=mem,remat=block,quantize=int8')
  r = bench_train.one_run(cfg, 'xq', warmup_steps=1, timed_steps=2)
  assert r['run'] == 'xq' and r['model'] == 'tiny' and r['batch'] == 2 and r['seq_len'] == 32
  assert r['block_size'] == 16  # the tiny config's, reported with each run
  assert r['permutation'] == 'element'  # the draw the run's plan resolved
  assert r['checks']['poet_vs_dense'] < 1e-4 and r['tokens_per_s'] > 0
  assert r['trainable'] < r['dense_params']
  # merges during the timed steps; the weight form; scanned layers, checked
  # as models too large for a dense copy are: one stacked layer exported.
  a = _bench_args('--lean-state', '--merge-every', '2', '--scan-layers', '--model-overrides',
                  SQUARE_2)
  monkeypatch.setattr(bench_train, 'EXPORT_CHECK_MAX_PARAMS', 0)
  r = bench_train.one_run(bench_train.run_config(a, 'form=weight'), 'weight', warmup_steps=1,
                          timed_steps=2)
  assert r['checks']['export_check'] == 'one layer' and r['checks']['poet_vs_dense'] < 1e-4


@pytest.mark.slow
def test_bench_train_runs_each_run_in_a_process_of_its_own(tmp_path, monkeypatch, capsys):
  """The CPU smoke test: one child per --run, labelled by its name or its text;
  a run that cannot be configured is refused before any starts."""
  monkeypatch.setenv('PYTHONPATH', str(ROOT))  # the children import this checkout
  # The lean run has the options of test_bench_train_one_run's first run: where
  # that test ran first, its programs are read back from the suite's
  # compilation cache instead of compiled again in the child.
  xq = 'optimizer=poetx,mode=mem,remat=block,quantize=int8,lean_state=true'
  out = tmp_path / 'r.json'
  argv = ['--model', 'tiny', '--model-overrides', 'layers=1,mlp=64', '--seq-len', '32',
          '--batch-size', '2', '--vocab-size', '512', '--dtype', 'float32',
          '--warmup-steps', '1', '--timed-steps', '2', '--json', str(out)]
  bench_train.main(argv + ['--run', 'optimizer=adamw',
                           '--run', f'lean:{xq},model_overrides={{{SQUARE_1}}}'])
  adamw, lean = harness.results_of(json.loads(out.read_text()))
  assert adamw['run'] == 'optimizer=adamw' and lean['run'] == 'lean'
  assert adamw['block_size'] is None and lean['block_size'] == 16
  assert adamw['permutation'] is None and lean['permutation'] == 'element'
  assert 'export_check' not in lean['checks'] and lean['checks']['poet_vs_dense'] < 1e-4
  assert lean['dense_params'] < adamw['dense_params']  # hidden 32 instead of 64
  assert lean['trainable'] < adamw['trainable'] and lean['tokens_per_s'] > 0
  table = capsys.readouterr().out
  assert 'tiny, seq 32, batch 2' in table and '\nlean ' in table
  with pytest.raises(SystemExit):
    bench_train.main(argv + ['--run', 'optimizer=adamw,mode=slow'])
  assert "--run 'optimizer=adamw,mode=slow': mode must be one of" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_cayley_interpreted():
  pytest.importorskip('pallas_kernels.cayley_neumann')
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.bench_cayley', '--blocks', '64',
       '--hidden', '64', '--mlp', '128', '--iters', '1', '--interpret'],
      capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'pallas bf16-out' in out.stdout and 'K=3' in out.stdout


@pytest.mark.slow
def test_bench_kernels_checks_every_kernel(tmp_path):
  """Every kernel variant runs (interpreted) and matches its XLA row before timing."""
  pytest.importorskip('pallas_kernels.block_rotate')
  from experiments import bench_kernels
  out = tmp_path / 'kernels.json'
  bench_kernels.main(['--widths', '128', '--blocks', '64', '--tokens', '64', '--iters', '1',
                      '--chain', '2', '--json', str(out)])
  (r,) = harness.results_of(json.loads(out.read_text()))
  want = ({f'rotate kernel {n}' for n, c in bench_kernels.ROTATE_CONFIGS.items()
           if c.tile_c in (None, 64)} | {'gram kernel'}
          | {f'gather kernel {n}' for n in bench_kernels.GATHER_VARIANTS})
  # timed (bench_kernels times only a kernel that ran and matched its XLA row)
  assert {name for name in r['ms'] if 'kernel' in name} == want


@pytest.mark.slow
def test_bench_fused_checks_and_times(tmp_path):
  """--smoke, chunk permutations of 16: every fused kernel runs interpreted,
  matches its XLA composition and is timed beside it, with the bytes it
  moves; the run gathers too, and (the width a multiple of B) the Mosaic run
  kernels. (Element permutations, chunk 1, check the fused kernels only.)"""
  pytest.importorskip('pallas_kernels.fused_rotate')
  from experiments import bench_fused
  out = tmp_path / 'fused.json'
  bench_fused.main(['--smoke', '--chunks', '16', '--json', str(out)])
  results = {(r['width'], r['chunk']): r for r in harness.results_of(json.loads(out.read_text()))}
  assert set(results) == {(128, 16)}
  fused = ({f'gather_rotate {n}' for n, c in bench_fused.GATHER_ROTATE_CONFIGS.items()
            if c.tile_c in (None, 64)}
           | {'rotate_scatter', 'block_gram', 'permute_rotate fwd+bwd fused',
              'rotate_unpermute fwd+bwd fused'})
  runs = {f'gather xla, words of {w}' for w in bench_fused.RUN_WORDS}
  mosaic = {'gather_rotate mosaic', 'rotate_scatter mosaic', 'permute_rotate fwd+bwd mosaic',
            'rotate_unpermute fwd+bwd mosaic'}
  for (n, c), r in results.items():
    checked = fused | (runs if c > 1 else set()) | (mosaic if c > 1 else set())
    assert set(r['errors']) == checked, (n, c)
    assert max(r['errors'].values()) < bench_fused.TOL
    assert checked < set(r['ms']) and {'copy', 'gather xla', 'gather xla fwd+bwd',
                                       'gather+rotate xla', 'gram xla'} < set(r['ms'])
    assert set(r['bytes']) == set(r['ms']) and r['bytes']['copy'] == 2 * 40 * n * 2


@pytest.mark.slow
def test_bench_memory_state_only(tmp_path):
  """Resident state from abstract shapes matches the real arrays' bytes; the
  compiled program's arguments hold exactly that state plus the batch."""
  from experiments import bench_memory
  out = tmp_path / 'state.json'
  bench_memory.main(['--models', 'tiny', '--seqs', '32', '--vocab-size', '512',
                     '--state-only', '--compiled', '--lean-state',
                     '--run', 'xq:optimizer=poetx,mode=mem,remat=block,quantize=int8,'
                     f'model_overrides={{{SQUARE_1}}}', '--json', str(out)])
  (r,) = harness.results_of(json.loads(out.read_text()))
  assert r['run'] == 'xq' and r['model'] == 'tiny'
  from flax import nnx
  from poetx_jax.pretrain import factories as F
  from poetx_jax.pretrain.config import TrainConfig
  # bench_memory's defaults: batch 1, bf16 weights and compute, merges every 2
  cfg = TrainConfig(model='tiny', model_overrides=SQUARE, optimizer='poetx', seq_len=32,
                    batch_size=1, vocab_size=512, merge_every=2,
                    dtype='bfloat16', param_dtype='bfloat16', lean_state=True, mode='mem',
                    remat='block', quantize='int8', steps=1000)
  from poetx_jax.pretrain.plan import make_plan
  model, opt = F.build_state(make_plan(cfg, 512))
  real = lambda t: sum(x.nbytes for x in jax.tree.leaves(t)) / 2 ** 30
  assert abs(r['model_gib'] - real(nnx.state(model))) < 1e-9
  assert abs(r['optimizer_gib'] - real(nnx.state(opt))) < 1e-9
  batch = 2 * 32 * 4 / 2 ** 30
  assert abs(r['compiled']['arguments_gib'] - (r['model_gib'] + r['optimizer_gib'] + batch)) < 1e-6
  assert r['compiled']['temporaries_gib'] > 0
  # A ladder size: Llama-13B with other shapes, through the same K=V overrides.
  assert bench_memory.point('20b', 1024, ladder=True) == (
      'model=13b,model_overrides={hidden=6144,mlp=16384,layers=44,heads=48,kv_heads=8},'
      'seq_len=1024')
  from poetx_jax.pretrain.config_text import apply_overrides
  big = apply_overrides(TrainConfig(), bench_memory.point('20b', 1024, ladder=True))
  assert big.model_overrides['layers'] == 44 and big.seq_len == 1024


@pytest.mark.slow
def test_profile_step_reports_a_real_step(tmp_path, monkeypatch):
  """profile_step on the CPU: XLA's thunks stand in for kernels; every
  category share adds up, the top kernels name their HLO ops."""
  from experiments import profile_step
  monkeypatch.setenv('PYTHONPATH', str(ROOT))  # the child imports this checkout
  out = tmp_path / 'prof.json'
  profile_step.main(['--model', 'tiny', '--model-overrides', SQUARE_1, '--seq-len', '32',
                     '--batch-size', '2', '--vocab-size', '512', '--dtype', 'float32',
                     '--timed-steps', '2', '--warmup-steps', '1', '--run', 'optimizer=poetx',
                     '--json', str(out)])
  (r,) = harness.results_of(json.loads(out.read_text()))
  assert r['run'] == 'optimizer=poetx' and r['steps'] == 2
  # busy: the union of the kernels' intervals, at most their sum (up to rounding)
  assert r['wall_ms'] > 0 and 0 < r['busy_ms'] <= r['kernel_ms'] * (1 + 1e-12)
  assert sum(c['share'] for c in r['categories'].values()) == pytest.approx(1.0)
  assert r['categories']['gather']['ms'] > 0  # the POET permutations
  assert r['top'] and all(t['op'] and t['hlo'] for t in r['top'][:5])
  assert r['kernels'] > 0 and r['launch_gaps_ms'] >= 0 and r['host_waits_ms'] >= 0


@pytest.mark.slow
def test_compile_time_reports_each_program(tmp_path):
  """compile_time.py on the tiny model: trace+lower and XLA compile timed, the
  programs' sizes counted, POET-X's first merge (its programs compiled) slower
  than a second one, the compiler's costliest events read off a traced
  compilation (the backend's compile among them, no JAX Python frames)."""
  from experiments import compile_time
  out = tmp_path / 'c.json'
  compile_time.main(['--model', 'tiny', '--model-overrides', SQUARE_1, '--seq-len', '32',
                     '--batch-size', '2', '--vocab-size', '512', '--timed-steps', '1',
                     '--passes', '4', '--run', 'optimizer=poetx',
                     '--run', 'optimizer=adamw', '--json', str(out)])
  poet, adamw = harness.results_of(json.loads(out.read_text()))
  for r in (poet, adamw):
    assert r['trace_lower_s'] > 0 and r['trace_lower_cpu_s'] > 0 and r['compile_s'] > 0
    events = r['compiler_events']
    assert len(events) == 4 and all(s > 0 and n >= 1 for _, s, n in events)
    assert [s for _, s, _ in events] == sorted((s for _, s, _ in events), reverse=True)
    assert any('Compile' in name for name, _, _ in events)
    assert not any(name.startswith('$') for name, _, _ in events)
    assert events[0][1] <= 1.5 * r['compile_s']  # one compilation's worth
  assert poet['stablehlo_lines'] > adamw['stablehlo_lines'] > 0
  assert poet['entry_instructions'] > adamw['entry_instructions'] > 0
  assert poet['merge_first_s'] > poet['merge_again_s'] > 0 and 'merge_first_s' not in adamw


def test_profile_step_busy_time_and_categories():
  from experiments import profile_step
  events = [{'start': 0.0, 'dur': 10.0}, {'start': 5.0, 'dur': 10.0},
            {'start': 20.0, 'dur': 5.0}, {'start': 21.0, 'dur': 1.0}]
  assert profile_step.busy_time(events) == 20.0  # overlaps count once
  # idle: 15..20 (5 us, a launch gap), then 25..60 (35 us, a wait)
  events.append({'start': 60.0, 'dur': 2.0})
  assert profile_step.idle_gaps(events, short_us=20.0) == (5.0, 35.0, 35.0)
  cat = profile_step.category
  assert cat('gemm_fusion_dot.3', 'gemm_fusion_dot_3') == 'gemm'
  assert cat('custom-call.7', 'nvjet_sm90_tst_128x160') == 'gemm'
  assert cat('fusion.2', 'cudnn_generated_fort_native_sdpa') == 'attention'
  assert cat('loop_gather_fusion.2', 'loop_gather_fusion_2') == 'gather'
  assert cat('copy.5', 'memcpy128') == 'transpose/copy'
  assert cat('input_reduce_fusion', 'input_reduce_fusion') == 'reduction'
  assert cat('loop_multiply_fusion', 'loop_multiply_fusion') == 'other'


@pytest.mark.slow
def test_bench_prepare_measures_prepare_and_first_step(tmp_path):
  """bench_prepare on two small corpora: each prepared, its tokens counted,
  its throughput and the peak memory of the process tree measured."""
  from experiments import bench_prepare
  out = tmp_path / 'r.json'
  rows = bench_prepare.main(['--sizes-mb', '0.25,0.5', '--work', str(tmp_path / 'w'),
                             '--no-train', '--json', str(out)])
  assert harness.results_of(json.loads(out.read_text())) == rows and len(rows) == 2
  small, large = rows
  assert 0.25 < small['corpus_mb'] < large['corpus_mb'] < 0.6
  assert 0 < small['tokens'] < large['tokens']
  assert all(r['prepare_mb_per_s'] > 0 and 0.05 < r['prepare_peak_rss_gib'] < 4 for r in rows)
  # The second prepare used the first one's tokenizer.
  first, second = (json.loads((tmp_path / 'w' / f'ds-{n}' / 'manifest.json').read_text())
                   for n in (262144, 524288))
  assert first['tokenizer_sha256'] == second['tokenizer_sha256']


def test_no_experiment_declares_a_train_option():
  """The experiments take poetx train's options from config.add_options (and
  describe runs by K=V overrides of them): none declares a flag of its own
  named like a TrainConfig field."""
  import ast
  import dataclasses
  from poetx_jax.pretrain.config import TrainConfig
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  declared = {}
  for path in sorted((ROOT / 'experiments').glob('*.py')):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Call) and getattr(node.func, 'attr', '') == 'add_argument':
        declared.setdefault(path.name, set()).update(
            a.value[2:].replace('-', '_') for a in node.args
            if isinstance(a, ast.Constant) and str(a.value).startswith('--'))
  assert {'bench_train.py', 'compare_quality.py', 'train_tiny.py'} <= set(declared)
  assert {'run', 'warmup_steps', 'timed_steps'} <= declared['bench_train.py']
  assert {name: flags & fields for name, flags in declared.items() if flags & fields} == {}


@pytest.mark.slow
def test_train_tiny_flags(capsys):
  from experiments import train_tiny
  train_tiny.main(['--toy-steps', '3', '--toy-block-size', '8', '--toy-seed', '1'])
  out = capsys.readouterr().out
  assert 'poetx: loss' in out and 'adamw: loss' in out and 'step    2' in out


@pytest.mark.slow
def test_site_corpus_splits_packages_by_name_and_prepares_both(tmp_path, monkeypatch):
  """site_corpus: every package on one side only, split by its name alone;
  validation prepared with the training side's tokenizer."""
  from experiments import site_corpus
  sp = tmp_path / 'site-packages'
  words = ' '.join(f'w{i % 97}' for i in range(3000))
  for i in range(12):
    (sp / f'pkg{i}').mkdir(parents=True)
    (sp / f'pkg{i}' / 'mod.py').write_text(f'# package {i}\n"""{words}"""\n')
  (sp / 'pkg1' / 'tests').mkdir()
  (sp / 'pkg1' / 'tests' / 'table.jsonl').write_text('{"price": 1}\n')  # data, not text
  (sp / 'pkg0-1.0.dist-info').mkdir()
  (sp / 'pkg0-1.0.dist-info' / 'METADATA.txt').write_text(words)
  monkeypatch.setattr(site_corpus, 'site_dirs', lambda: [sp])
  got = site_corpus.main(['--out', str(tmp_path / 'out'), '--val-every', '4',
                          '--vocab-size', '300', '--workers', '1'])
  names = lambda es: {e.name for e in es}  # noqa: E731
  assert names(got['train']) | names(got['val']) == {f'pkg{i}' for i in range(12)}
  assert not names(got['train']) & names(got['val']) and got['val']
  assert site_corpus.split(got['train'] + got['val'], 4)[1] == got['val']
  train, val = (json.loads((tmp_path / 'out' / s / 'manifest.json').read_text())
                for s in ('train', 'val'))
  assert train['tokenizer_sha256'] == val['tokenizer_sha256']
  files = lambda m: {pathlib.Path(f['path']).parent.name for f in m['sources']}  # noqa: E731
  assert files(val) == names(got['val']) and files(train) == names(got['train'])


def test_resume_time_times_launch_to_the_first_new_update(tmp_path):
  """resume_time.first_update: seconds from launch to the first metrics record
  of a step above ``after`` (not to an earlier one, nor to the exit), the
  times its log's stage lines appear (a progress bar's redraws split), and a
  failed command raised with its last lines."""
  from experiments import resume_time
  metrics = tmp_path / 'metrics.jsonl'
  script = (
      'import json, sys, time\n'
      f'f = open({str(metrics)!r}, "a")\n'
      'print("data: text", flush=True)\n'
      'f.write(json.dumps({"step": 3, "loss": 1.0}) + "\\n"); f.flush()\n'
      'time.sleep(0.6)\n'
      'print("state: 1 MiB", file=sys.stderr, flush=True)\n'
      'f.write(json.dumps({"step": 4, "val_loss": 1.0}) + "\\n"); f.flush()\n'
      'time.sleep(0.6)\n'
      'print("  0%| bar\\rresumed from step 3", flush=True)\n'
      'f.write(json.dumps({"step": 4, "loss": 1.0}) + "\\n"); f.flush()\n'
      'time.sleep(0.6)\n')
  r = resume_time.first_update([sys.executable, '-c', script], metrics, after=3)
  assert 1.1 < r['first_update_s'] < r['exit_s'] - 0.4
  marks = r['marks']
  assert list(marks) == ['data', 'state', 'restored']  # no step-0 validation line
  assert marks['data'] < 0.55 < marks['state'] < 1.15 < marks['restored'] < r['exit_s']
  with pytest.raises(RuntimeError, match='boom'):
    resume_time.first_update([sys.executable, '-c', 'raise SystemExit("boom")'],
                             tmp_path / 'none.jsonl', after=0)


def test_bench_train_rounds_alternate_the_order_and_report_the_median(tmp_path, monkeypatch,
                                                                     capsys):
  """--rounds 3: the runs go A B, B A, A B, each in a fresh process, every
  result written as it ends; the table's row of each run is its median round,
  with every round's step in the order they ran."""
  ran, steps = [], {'a': iter([0.30, 0.10, 0.20]), 'b': iter([0.5, 0.7, 0.6])}

  def child(module, argv, payload, label, env=None):
    assert (module, payload['label']) == ('bench_train', label)
    ran.append(label)
    return {'run': label, 'step_s': next(steps[label]), 'tokens_per_s': 1.0,
            'peak_gib': 1.0, 'optimizer_state_gib': 0.5}, None

  monkeypatch.setattr(harness, 'run_child', child)
  p = argparse.ArgumentParser()
  bench_train.add_run_args(p, rounds=True)
  out = tmp_path / 'r.json'
  a = p.parse_args(['--model', 'tiny', '--rounds', '3', '--run', 'a:optimizer=adamw',
                    '--run', 'b:optimizer=poetx', '--json', str(out)])
  results = bench_train.run_each(a, 'bench_train', [], lambda r: '')
  assert ran == ['a', 'b', 'b', 'a', 'a', 'b']
  record = json.loads(out.read_text())
  assert record['header']['command'].startswith('python3 -m experiments.bench_train')
  assert [r['round'] for r in record['results']] == [0, 0, 1, 1, 2, 2]
  a_row, b_row = bench_train.by_run(results)
  assert a_row['step_s'] == 0.20 and a_row['rounds_ms'] == pytest.approx([300, 100, 200])
  assert b_row['step_s'] == 0.6 and b_row['rounds_ms'] == pytest.approx([500, 700, 600])
  bench_train.print_table(a, results)
  assert '200.0' in capsys.readouterr().out
