"""Shared helpers: fresh random inputs and relative errors."""

import contextlib
import os
import zlib
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from poetx_jax.pretrain.kv import format_overrides

# The suite compiles thousands of tiny programs and runs each a few times: on
# CPUs, LLVM's optimisations cost more than they save (about a third of a
# compile). Set before jax starts a backend; subprocesses inherit it (with
# host_devices for those that need a device count).
if not os.path.exists('/dev/nvidiactl') and (
    'xla_backend_optimization_level' not in os.environ.get('XLA_FLAGS', '')):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '')
                             + ' --xla_backend_optimization_level=0').strip()


# The modules of the longest tests, to run first (in this order; each
# module's tests in their own order). pytest-xdist's worksteal hands each
# worker a contiguous share of the list and the idle one takes the end of the
# other's queue: a minute-long test collected late could start last and set
# the suite's wall time; first, the short tests fill in behind it. The
# modules whose module-scoped fixtures are costly come first, so that their
# tests run on one worker before any are taken away (a fixture computed on
# both workers costs twice).
SLOW_MODULES = ('test_sharding.py', 'test_compare_quality.py', 'test_faults.py',
                'test_fault_injection.py', 'test_multiprocess.py', 'test_experiments.py',
                'test_quant.py', 'test_train.py')


def pytest_collection_modifyitems(items):
  rank = {f'tests/{m}': i for i, m in enumerate(SLOW_MODULES)}
  items.sort(key=lambda item: rank.get(item.nodeid.split('::')[0], len(rank)))  # stable


def host_devices(n: int) -> str:
  """XLA_FLAGS for a subprocess with ``n`` CPU devices (and the suite's own)."""
  kept = [f for f in os.environ.get('XLA_FLAGS', '').split()
          if not f.startswith('--xla_force_host_platform_device_count')]
  return ' '.join([*kept, f'--xla_force_host_platform_device_count={n}'])


# The tests compare float32 results to the last few digits. On GPUs XLA's
# default float32 matmul precision is TF32 (~1e-3 relative); ask for full
# float32 there, as the CPU always gives. (Kernels choose their own precision;
# their tests state it.)
if jax.default_backend() == 'gpu':
  jax.config.update('jax_default_matmul_precision', 'highest')


@pytest.fixture
def keys(request):
  """A key stream of its own for each test, reproducible from the test's id.

  Set POETX_TEST_SEED to draw other inputs for every test.
  """
  seed = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get('POETX_TEST_SEED', 0))
  key = jax.random.key(seed % (2 ** 31))

  def gen():
    nonlocal key
    key, sub = jax.random.split(key)
    return sub

  return gen


def rel_err(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_trees_rel_close(got, want, tol):
  """The same tree structure and dtypes, each leaf within relative
  (Frobenius) error ``tol`` of ``want``'s (:func:`rel_err`)."""
  chex.assert_trees_all_equal_comparator(
      lambda a, b: a.dtype == b.dtype and rel_err(a, b) <= tol,
      lambda a, b: f'{a.dtype} vs {b.dtype}, relative error {rel_err(a, b):.1e} > {tol:.0e}',
      got, want)


def skew_params(key, k, block_size, spectral_norm):
  """Packed skew parameters whose blocks have the given spectral norm."""
  from poetx_jax import ops
  q = jax.random.normal(key, (k, ops.skew_size(block_size)))
  blocks = ops.unpack_skew(q, block_size)
  norms = jnp.linalg.norm(blocks, ord=2, axis=(-2, -1))
  return q * (spectral_norm / norms)[:, None]


def randomize_generators(layer, key, scale=0.1):
  """Gives a POETLinear generators with blocks of spectral norm ``scale``."""
  k1, k2 = jax.random.split(key)
  b = layer.block_size
  layer.q_in[...] = skew_params(k1, layer.q_in.shape[0], b, scale)
  layer.q_out[...] = skew_params(k2, layer.q_out.shape[0], b, scale)


# The model of the app-level test runs: one layer whose projections are 32
# wide (k and v 16: kv_heads 1 of 2), an MLP as wide as the hidden state, so
# that a run has two layer shapes and compiles few merge and build programs;
# SQUARE: every projection 32 x 32 (one shape). ``overrides`` gives either as
# a --model-overrides value.
SMALL = {'layers': 1, 'hidden': 32, 'mlp': 32, 'heads': 2, 'kv_heads': 1}
SQUARE = {**SMALL, 'kv_heads': 2}
overrides = format_overrides


WORDS = ('the orthogonal factors rotate every weight while its singular values stay '
         'fixed and a merge folds them into the frozen base then new permutations '
         'are drawn').split()


def gathered(fn, *args) -> list[tuple[int, ...]]:
  """The shapes of the arrays ``fn(*args)`` permutes (ops' gathers), when traced."""
  from poetx_jax import ops
  shapes = []

  def counted(gather):
    def run(a, *perms, **kw):
      shapes.append(a.shape)
      return gather(a, *perms, **kw)
    return run

  with contextlib.ExitStack() as stack:
    for name in ('permute', 'unpermute', 'permute_rows', 'unpermute_rows'):
      stack.enter_context(mock.patch.object(ops, name, counted(getattr(ops, name))))
    jax.make_jaxpr(fn)(*args)
  return shapes


def app_steps(cfg, vocab_size, batch, steps):
  """``steps`` updates of the app's train step (``poetx train``'s model,
  optimizer and ``make_step`` for the options ``cfg``) on ``batch``, on this
  process's device: ``(losses, model, optimizer)``."""
  from poetx_jax.pretrain import factories
  from poetx_jax.pretrain.plan import make_plan
  plan = make_plan(cfg, vocab_size)
  model = factories.build_model(plan)
  opt = factories.build_optimizer(plan, model)
  step = factories.make_step(plan)
  return [float(step(model, opt, batch)) for _ in range(steps)], model, opt


def write_corpus(directory, *, docs=40, words=120):
  """``docs`` text files of ``words`` random WORDS each (seed 0) in ``directory``."""
  rng = np.random.default_rng(0)
  for i in range(docs):
    (directory / f'doc{i:02d}.txt').write_text(' '.join(rng.choice(WORDS, size=words)) + '.\n')
  return directory


@pytest.fixture(scope='session')
def corpus(tmp_path_factory):
  """:func:`write_corpus`'s 40 documents, one directory for the session (a
  module may define a corpus of its own)."""
  return write_corpus(tmp_path_factory.mktemp('corpus'))


@pytest.fixture(scope='session')
def reference(tmp_path_factory, corpus):
  """The uninterrupted run of test_faults' TINY options: (cfg, losses, final
  parameters). One a session (a worker's): test_faults, test_faults_runs and
  test_full_disk read it or copy it, none writes in it."""
  from test_faults import reference_run  # pylint: disable=g-import-not-at-top
  return reference_run(tmp_path_factory.mktemp('reference'), corpus)


def dense_rotation(q_KxP, perm_N, n, *, block_size, terms=4, max_norm=None):
  """The dense n x n matrix ``Phi G Phi^T`` of one side of a POET layer."""
  from poetx_jax import ops
  g = ops.rotation_blocks(q_KxP, n, block_size, terms, max_norm=max_norm)
  bd = jax.scipy.linalg.block_diag(*[g[j] for j in range(g.shape[0])])[:n, :n]
  phi = jnp.zeros((n, n), jnp.float32).at[perm_N, jnp.arange(n)].set(1.0)
  return phi @ bd @ phi.T


@pytest.fixture(scope='session', autouse=True)
def _compilation_cache(tmp_path_factory):
  """One persistent compilation cache for the whole suite, in this process and
  in the subprocesses tests start: every run builds its own jitted step, so
  without it the same programs compile again in each test (same programs,
  same numbers)."""
  # Under pytest-xdist the workers' base directories share a parent: one
  # cache for all of them (entries are written whole; same key, same program).
  shared = tmp_path_factory.getbasetemp()
  shared = shared.parent if os.environ.get('PYTEST_XDIST_WORKER') else shared
  (shared / 'jit-cache').mkdir(exist_ok=True)
  options = {'jax_compilation_cache_dir': str(shared / 'jit-cache'),
             'jax_persistent_cache_min_compile_time_secs': 0,
             'jax_persistent_cache_min_entry_size_bytes': 0}
  saved = {k: getattr(jax.config, k) for k in options}
  env = {k.upper(): os.environ.get(k.upper()) for k in options}
  for k, v in options.items():
    jax.config.update(k, v)
    os.environ[k.upper()] = str(v)
  yield
  for k, v in saved.items():
    jax.config.update(k, v)
  for k, v in env.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v
