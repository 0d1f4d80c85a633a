"""Train a small MLP with POET-X on CPU and print its loss falling.

The task is a teacher-student regression the method can solve exactly: the
teacher is the student's own starting network with every weight rotated by
random orthogonal matrices on both sides (same spectra), so only rotations
need to be learned. AdamW on the same network (all weights trained) is the
baseline.

    python3 -m experiments.train_tiny            # POET-X, then AdamW
    python3 -m experiments.train_tiny --toy-steps 200 --toy-block-size 16

Its flags are named ``--toy-*``: they set this toy's training, not the
``poetx train`` options of the same names (``TrainConfig``), which the
other experiments take.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import poetx_jax

WIDTH, HIDDEN = 64, 128


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(WIDTH, HIDDEN, use_bias=False, rngs=rngs)
    self.down = nnx.Linear(HIDDEN, WIDTH, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.down(jnp.tanh(self.up(x) * 2.0))


def _random_orthogonal(key, n):
  q, r = jnp.linalg.qr(jax.random.normal(key, (n, n)))
  return q * jnp.sign(jnp.diagonal(r))


def make_task(seed: int):
  """(student, teacher): the teacher's kernels are O1 K O2 of the student's."""
  student = MLP(nnx.Rngs(seed))
  teacher = nnx.clone(student)
  key = jax.random.key(seed + 1)
  for i, layer in enumerate((teacher.up, teacher.down)):
    k1, k2 = jax.random.split(jax.random.fold_in(key, i))
    kernel = layer.kernel[...]
    layer.kernel[...] = (_random_orthogonal(k1, kernel.shape[0]) @ kernel
                         @ _random_orthogonal(k2, kernel.shape[1]))
  return student, teacher


def train(*, optimizer: str = 'poetx', steps: int = 300, batch: int = 256,
          block_size: int = 16, merge_every: int = 50, lr: float = 2e-2,
          seed: int = 0, log_every: int = 0) -> list[float]:
  """Trains the student; returns the loss of every step."""
  model, teacher = make_task(seed)
  if optimizer == 'poetx':
    model = poetx_jax.poetize(model, block_size=block_size, rngs=nnx.Rngs(seed + 2))
    tx = poetx_jax.poetx(lr, merge_every=merge_every)
  elif optimizer == 'adamw':
    tx = optax.adamw(lr / 10, weight_decay=0.0)
  else:
    raise ValueError(f"optimizer must be 'poetx' or 'adamw', got {optimizer!r}")
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

  def loss_fn(m, xy):
    x, y = xy
    return jnp.mean((m(x) - y) ** 2)

  step = (poetx_jax.make_train_step(loss_fn, seed=seed) if optimizer == 'poetx'
          else nnx.jit(_plain_step(loss_fn), donate_argnums=(0, 1)))
  data_key = jax.random.key(seed + 3)
  losses, t0 = [], time.perf_counter()
  for i in range(steps):
    x = jax.random.normal(jax.random.fold_in(data_key, i), (batch, WIDTH))
    losses.append(float(step(model, opt, (x, teacher(x)))))
    if log_every and (i % log_every == 0 or i == steps - 1):
      print(f'{optimizer:6s} step {i:4d}  loss {losses[-1]:.5f}  '
            f'({time.perf_counter() - t0:.1f}s)', flush=True)
  return losses


def _plain_step(loss_fn):
  def step(model, opt, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    opt.update(model, grads)
    return loss
  return step


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--toy-steps', type=int, default=1000, help='updates of each optimizer')
  p.add_argument('--toy-block-size', type=int, default=16, help='POET block size')
  p.add_argument('--toy-merge-every', type=int, default=50, help='POET-X merge interval')
  p.add_argument('--toy-lr', type=float, default=2e-2, help='POET-X learning rate; '
                 'AdamW uses a tenth of it')
  p.add_argument('--toy-seed', type=int, default=0, help='seed of the task and the data')
  a = p.parse_args(argv)
  for opt in ('poetx', 'adamw'):
    losses = train(optimizer=opt, steps=a.toy_steps, block_size=a.toy_block_size,
                   merge_every=a.toy_merge_every, lr=a.toy_lr, seed=a.toy_seed,
                   log_every=max(1, a.toy_steps // 10))
    print(f'{opt}: loss {losses[0]:.5f} -> {losses[-1]:.5f}\n')


if __name__ == '__main__':
  main()
