"""Two layers: the library imports nothing of the pretraining app and needs
none of the app's third-party packages."""

import subprocess
import sys
import textwrap

import pytest

# What only the app (poetx_jax.pretrain, the `pretrain` extra) may import.
APP_PACKAGES = ('grain', 'orbax', 'tokenizers', 'pyarrow', 'safetensors', 'matplotlib',
                'tqdm', 'tensorboardX', 'wandb', 'sentencepiece')

# Prepended to a script: makes the app's packages unimportable.
BLOCK_APP_PACKAGES = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name.split('.')[0] in {APP_PACKAGES!r}:
      raise ImportError(f'blocked: {{name}}')
sys.meta_path.insert(0, Block())
"""

LIBRARY = ('poetx_jax', 'poetx_jax.ops', 'poetx_jax.quant', 'poetx_jax.layout', 'poetx_jax.linear',
           'poetx_jax.convert', 'poetx_jax.cycle', 'poetx_jax.optim', 'poetx_jax.step',
           'poetx_jax.lean', 'poetx_jax.sharding', 'pallas_kernels')


@pytest.mark.slow
def test_library_imports_without_the_app_or_its_packages():
  """With the app's packages made unimportable, every library module imports
  and the README's example trains; no app module gets loaded on the way."""
  script = BLOCK_APP_PACKAGES + textwrap.dedent(f'''
      import importlib
      for m in {LIBRARY!r}:
        importlib.import_module(m)
      import jax, jax.numpy as jnp, optax
      from flax import nnx
      import poetx_jax
      model = nnx.Sequential(nnx.Linear(64, 128, rngs=nnx.Rngs(0)), nnx.gelu,
                             nnx.Linear(128, 64, rngs=nnx.Rngs(1)))
      model = poetx_jax.poetize(model, block_size=32, rngs=nnx.Rngs(2))
      tx = poetx_jax.poetx_partition(model, poetx_jax.poetx(1e-2, merge_every=100),
                                     optax.adamw(1e-3))
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      step = poetx_jax.make_train_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2))
      x = jax.random.normal(jax.random.key(0), (16, 64))
      losses = [float(step(model, optimizer, (x, jnp.sin(x)))) for _ in range(30)]
      assert losses[-1] < losses[0], losses
      loaded = sorted(m for m in sys.modules
                      if m.startswith(('poetx_jax.pretrain', 'poetx_jax.models')))
      assert not loaded, loaded
      print('ok')
  ''')
  out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0 and out.stdout.strip().endswith('ok'), out.stderr[-3000:]


def test_the_app_cannot_be_imported_without_its_packages_saying_which():
  """The check above can fail: the app does need what is blocked."""
  script = BLOCK_APP_PACKAGES + 'import poetx_jax.pretrain.train\n'
  out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True,
                       timeout=600)
  assert out.returncode != 0 and 'blocked' in out.stderr
