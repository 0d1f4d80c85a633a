"""Llama pretraining with POET-X (or AdamW as the baseline): the training loop.

``train(TrainConfig(...))`` builds the data, the model and the optimizer, runs
the loop with validation, metrics, progress and checkpoints, and returns a
summary. ``poetx train`` (cli.py) is a thin shell over it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import signal
import sys
import time
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import poetx_jax
from poetx_jax.pretrain import data as data_lib
from poetx_jax.pretrain.checkpoint import CheckpointError, Checkpointer
from poetx_jax.lean import lean_adamw
from poetx_jax import sharding
from poetx_jax.models import llama

OPTIMIZERS = ('poetx', 'adamw')


@dataclasses.dataclass
class TrainConfig:
  """Everything a run needs; saved as ``run.json`` in the run directory."""
  model: str = 'tiny'
  model_overrides: dict = dataclasses.field(default_factory=dict)
  data: list[str] | None = None        # None: the built-in corpus
  tokenizer: str | None = None         # None: train a BPE on the corpus
  vocab_size: int = 4096
  seq_len: int = 128
  batch_size: int = 16
  grad_accum: int = 1
  steps: int = 600
  optimizer: str = 'poetx'
  lr: float = 3e-3                     # AdamW, and the non-POET parameters
  poet_lr: float | None = None         # POET generators' step size; None: poetx_jax.default_poet_lr(B)
  warmup: int = 30
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.0
  clip: float = 1.0                    # global-norm bound; 0 disables
  merge_every: int = 50
  block_size: int | None = None        # None: the model config's
  mode: str = 'fast'
  form: str = 'input'                  # POET layer product order: input or weight
  implementation: str = 'xla'          # POET block products: xla or pallas
  remat: str = 'none'                  # per decoder layer: none, block, attn
  scan_layers: bool = False            # decoder layers stacked and run by lax.scan
  quantize: str | None = None          # POET-XQ base weights: 'int8' or 'int4'
  group_size: int = 128
  lean_state: bool = False             # bf16 momenta; factored (non-POET) / per-block (POET) 2nd moments
  strategy: str = 'dp'                 # over all devices: dp (replicated) or fsdp
  fsdp: int = 1                        # size of the mesh's fsdp axis
  dtype: str = 'auto'                  # compute dtype: auto = bf16 on GPU, f32 on CPU
  param_dtype: str = 'float32'         # weights (POET bases included); generators stay f32
  seed: int = 0
  val_fraction: float = 0.05
  eval_every: int = 100
  eval_batches: int = 20
  log_every: int = 10
  checkpoint_every: int = 100
  keep: int = 3
  out_dir: str | None = None           # None: runs/{model}-{optimizer}
  cache_dir: str = '~/.cache/poetx_jax'

  def validate(self) -> None:
    if self.optimizer not in OPTIMIZERS:
      raise ValueError(f'optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}')
    if self.mode not in poetx_jax.linear.MODES:
      raise ValueError(f'mode must be one of {poetx_jax.linear.MODES}, got {self.mode!r}')
    if self.form not in poetx_jax.ops.FORMS:
      raise ValueError(f'form must be one of {poetx_jax.ops.FORMS}, got {self.form!r}')
    if self.implementation not in poetx_jax.linear.IMPLEMENTATIONS:
      raise ValueError(f'implementation must be one of {poetx_jax.linear.IMPLEMENTATIONS}, '
                       f'got {self.implementation!r}')
    if self.quantize is not None and self.optimizer != 'poetx':
      raise ValueError(f'quantize={self.quantize!r} needs optimizer poetx (the AdamW '
                       f'baseline trains its weights in full precision)')
    if self.remat not in llama.REMAT_POLICIES:
      raise ValueError(f'remat must be one of {tuple(llama.REMAT_POLICIES)}, '
                       f'got {self.remat!r}')
    if not isinstance(self.scan_layers, bool):
      raise ValueError(f'scan_layers must be a bool, got {self.scan_layers!r}')
    if self.strategy not in sharding.STRATEGIES:
      raise ValueError(f'strategy must be one of {sharding.STRATEGIES}, '
                       f'got {self.strategy!r}')
    if self.param_dtype not in ('float32', 'bfloat16'):
      raise ValueError(f"param_dtype must be 'float32' or 'bfloat16', got "
                       f"{self.param_dtype!r}")
    if self.dtype not in ('auto', 'float32', 'bfloat16'):
      raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
    for name in ('seq_len', 'batch_size', 'grad_accum', 'steps', 'merge_every',
                 'eval_every', 'log_every', 'checkpoint_every', 'keep'):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f'{name} must be an int >= 1, got {v!r}')
    if self.poet_lr is not None and not self.poet_lr > 0:
      raise ValueError(f'poet_lr must be > 0 (or None for the block-size default), '
                       f'got {self.poet_lr!r}')
    for name in ('lr', 'weight_decay', 'clip'):
      if getattr(self, name) < 0:
        raise ValueError(f'{name} must be >= 0, got {getattr(self, name)!r}')
    if not 0 < self.val_fraction < 1:
      raise ValueError(f'val_fraction must be in (0, 1), got {self.val_fraction!r}')


def poet_lr(cfg: TrainConfig, block_size: int) -> float:
  """The run's peak POET-X learning rate: ``cfg.poet_lr``, else the default."""
  return poetx_jax.default_poet_lr(block_size) if cfg.poet_lr is None else cfg.poet_lr


def compute_dtype(name: str):
  if name == 'auto':
    return jnp.bfloat16 if jax.default_backend() == 'gpu' else jnp.float32
  return jnp.dtype(name)


def model_config(cfg: TrainConfig, vocab_size: int) -> llama.LlamaConfig:
  """The named config with overrides, its vocabulary set to the tokenizer's."""
  mc = llama.get_config(cfg.model, **cfg.model_overrides)
  mc = dataclasses.replace(mc, vocab_size=vocab_size)
  if cfg.seq_len > mc.max_seq_len:
    raise ValueError(f'seq_len={cfg.seq_len} is longer than model {cfg.model!r} '
                     f'supports (max_seq_len={mc.max_seq_len})')
  return mc


def build_model(cfg: TrainConfig, mc: llama.LlamaConfig, mesh=None):
  """The Llama (poetized for POET-X) as it is at step 0 of the run.

  For POET-X each decoder layer is converted as soon as it is built (its dense
  kernels freed), so the dense weights of only one layer are resident at a
  time. The result is that of ``poetize(init_model(...), rngs=nnx.Rngs(seed +
  1), ...)``. Built op by op, not in one jitted program: a whole-model program
  compiles its initialisers and permutation draws once per layer (minutes on a
  GPU for Llama-1B), op by op they compile once per shape.

  With ``mesh``, ``cfg.strategy == 'fsdp'`` and ``cfg.scan_layers``, the
  stacked decoder layers are allocated sharded and each layer is written into
  its shards as it is built: a model whose weights do not fit on one device
  is never gathered on one (the rest, embeddings and head, start on the
  default device; :func:`poetx_jax.sharding.shard_state` places them).
  """
  dtype, param_dtype = compute_dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
  place = None
  if mesh is not None and cfg.strategy == 'fsdp' and cfg.scan_layers:
    place = sharding.placement(mesh, cfg.strategy)
  convert = None
  if cfg.optimizer == 'poetx':
    poet_rngs = nnx.Rngs(jax.random.key(cfg.seed + 1))

    def convert(layer):
      return poetx_jax.poetize(layer, rngs=poet_rngs, consume=True,
                               block_size=cfg.block_size or mc.block_size, mode=cfg.mode,
                               form=cfg.form, implementation=cfg.implementation,
                               quantize=cfg.quantize, group_size=cfg.group_size)

  return llama.Llama(mc, dtype=dtype, param_dtype=param_dtype, remat=cfg.remat,
                     rngs=nnx.Rngs(jax.random.key(cfg.seed)), convert_layer=convert,
                     scan_layers=cfg.scan_layers, place=place)


def state_bytes(tree) -> int:
  """Bytes of a state's arrays (concrete or abstract), each element at its
  numpy item size (int4 counts one byte)."""
  return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _gib(tree) -> str:
  """:func:`state_bytes` as text ('1.23 GiB' or '456.7 MiB')."""
  n = state_bytes(tree)
  return f'{n / 2 ** 30:.2f} GiB' if n >= 2 ** 30 else f'{n / 2 ** 20:.1f} MiB'


def abstract_state(cfg: TrainConfig, mc: llama.LlamaConfig):
  """``(model, optimizer)`` of the run as shapes only (``nnx.eval_shape``):
  for sizing and compiling without allocating anything."""

  def build():
    model = build_model(cfg, mc)
    return model, build_optimizer(cfg, model)

  return nnx.eval_shape(build)


def schedule(peak: float, cfg: TrainConfig) -> optax.Schedule:
  """Linear warmup to ``peak``, cosine decay to ``min_lr_ratio * peak``."""
  total = max(cfg.steps, cfg.warmup + 1)
  return optax.warmup_cosine_decay_schedule(
      0.0, peak, warmup_steps=cfg.warmup, decay_steps=total,
      end_value=peak * cfg.min_lr_ratio)


def model_poet_lr(cfg: TrainConfig, model) -> float:
  """The peak POET learning rate of a converted model (its block size's default
  unless ``cfg.poet_lr`` is set)."""
  return poet_lr(cfg, poetx_jax.poet_layers(model)[0][1].block_size)


def build_optimizer(cfg: TrainConfig, model) -> nnx.Optimizer:
  if cfg.lean_state:
    adamw = lean_adamw(schedule(cfg.lr, cfg), weight_decay=cfg.weight_decay)
  else:
    adamw = optax.adamw(schedule(cfg.lr, cfg), b1=0.9, b2=0.999,
                        weight_decay=cfg.weight_decay)
  if cfg.optimizer == 'poetx':
    lean = dict(mu_dtype=jnp.bfloat16, second_moment='block') if cfg.lean_state else {}
    peak = model_poet_lr(cfg, model)
    tx = poetx_jax.poetx_partition(
        model, poetx_jax.poetx(schedule(peak, cfg), merge_every=cfg.merge_every,
                               **lean),
        adamw)
  else:
    tx = adamw
  if cfg.clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip), tx)
  if cfg.grad_accum > 1:
    tx = optax.MultiSteps(tx, every_k_schedule=cfg.grad_accum)
  return nnx.Optimizer(model, tx, wrt=nnx.Param)


def token_loss(model, batch):
  """(sum of token cross-entropies, number of target tokens); -1 targets masked."""
  logits = model(batch['inputs']).astype(jnp.float32)
  targets = batch['targets']
  mask = targets >= 0
  losses = optax.softmax_cross_entropy_with_integer_labels(
      logits, jnp.where(mask, targets, 0))
  return jnp.sum(losses * mask), jnp.sum(mask)


def target_count(batch):
  """The unmasked targets of a batch: what :func:`mean_loss` averages over."""
  return jnp.sum(batch['targets'] >= 0)


def mean_loss(model, batch):
  total, count = token_loss(model, batch)
  return total / jnp.maximum(count, 1)


# A merge whose factors are further than this from orthogonal is reported:
# healthy runs stay at a few 1e-2 or less (docs/quality.md); the series
# diverges past about 1.
ORTHOGONALITY_WARNING = 0.1


def make_step(cfg: TrainConfig, on_merge=None, mesh=None):
  """The run's train step; ``mesh``: the training mesh, if any."""
  if cfg.optimizer == 'poetx':
    dp = mesh if mesh is not None and cfg.strategy == 'dp' else None
    return poetx_jax.make_train_step(mean_loss, merge_every=cfg.merge_every * cfg.grad_accum,
                                     seed=cfg.seed, on_merge=on_merge,
                                     data_parallel=dp, loss_weight=target_count)

  def step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(mean_loss)(model, batch)
    optimizer.update(model, grads)
    return loss

  return nnx.jit(step, donate_argnums=(0, 1))


_eval_sum = nnx.jit(token_loss)


def evaluate(model, batches, mesh=None) -> tuple[float, float]:
  """(mean validation loss per token, perplexity) over global host ``batches``."""
  total, count = 0.0, 0
  for b in batches:
    b = b if mesh is None else sharding.local_rows(b)
    t, c = _eval_sum(model, place_batch(b, mesh))
    total, count = total + float(t), count + int(c)
  loss = total / max(count, 1)
  return loss, math.exp(min(loss, 50.0))


def make_training_mesh(cfg: TrainConfig):
  """The (data, fsdp) mesh over all devices, or None on a single device."""
  if jax.device_count() == 1:
    return None
  return sharding.make_mesh(fsdp=cfg.fsdp)


def place_batch(batch, mesh):
  """This process's batch -> device arrays (the global batch over the mesh)."""
  if mesh is None:
    return jax.tree.map(jnp.asarray, batch)
  return sharding.shard_batch(batch, mesh)


class _Progress:
  """One status line: step, loss, tokens/s and ETA (redrawn on a terminal)."""

  def __init__(self, total: int, every: int, stream=sys.stderr):
    self.total, self.every, self.stream = total, every, stream
    self.tty = stream.isatty()

  def update(self, step: int, loss: float, tok_s: float, eta_s: float) -> None:
    if not self.tty and step % self.every and step != self.total:
      return
    eta = time.strftime('%H:%M:%S', time.gmtime(max(eta_s, 0)))
    width = 24
    done = int(width * step / self.total)
    line = (f'[{"#" * done}{"." * (width - done)}] {step}/{self.total} '
            f'loss {loss:.4f}  {tok_s:,.0f} tok/s  eta {eta}')
    self.stream.write(('\r' + line) if self.tty else line + '\n')
    self.stream.flush()

  def close(self):
    if self.tty:
      self.stream.write('\n')


class _Metrics:
  """metrics.jsonl (and TensorBoard when tensorboardX is installed)."""

  def __init__(self, out_dir: pathlib.Path, resume_step: int):
    self.path = out_dir / 'metrics.jsonl'
    kept = []
    if resume_step and self.path.exists():  # drop records past the checkpoint
      kept = [l for l in self.path.read_text().splitlines()
              if l.strip() and json.loads(l)['step'] <= resume_step]
    self.path.write_text(''.join(l + '\n' for l in kept))
    self._tb = None
    try:
      from tensorboardX import SummaryWriter  # optional
      self._tb = SummaryWriter(str(out_dir / 'tb'))
    except ImportError:
      pass

  def write(self, record: dict) -> None:
    with self.path.open('a') as f:
      f.write(json.dumps(record) + '\n')
    if self._tb is not None:
      for k, v in record.items():
        if k != 'step' and isinstance(v, (int, float)):
          self._tb.add_scalar(k, v, record['step'])

  def close(self):
    if self._tb is not None:
      self._tb.close()


# jax.monitoring time spans of tracing, lowering and XLA compilation.
_COMPILE_EVENTS = frozenset((
    '/jax/core/compile/jaxpr_trace_duration',
    '/jax/core/compile/jaxpr_to_mlir_module_duration',
    '/jax/core/compile/backend_compile_duration',
))


class _TrainClock:
  """What of the training loop's wall time is not training, and what is compiling.

  ``paused_s`` sums the time spent inside ``paused()`` (evaluation, probes,
  checkpoints). ``compile_s()`` is the time spent tracing, lowering and
  compiling programs outside ``paused()``: the union of the jax.monitoring time
  spans of those events (nested spans, e.g. an inner jit traced inside an
  outer one, count once). Wall time less ``paused_s`` less ``compile_s()`` is
  steady-state training time.
  """

  def __init__(self):
    self.paused_s = 0.0
    self._paused = False
    self._spans = []

  def _on_span(self, event, start, end, **_):
    if event in _COMPILE_EVENTS and not self._paused:
      self._spans.append((start, end))

  def __enter__(self):
    jax.monitoring.register_event_time_span_listener(self._on_span)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_time_span_listener(self._on_span)

  @contextlib.contextmanager
  def paused(self, pending=None):
    """Time inside does not count; ``pending`` (e.g. the last loss) is waited
    for first, so queued training steps are not counted as paused time."""
    jax.block_until_ready(pending)
    t, self._paused = time.perf_counter(), True
    try:
      yield
    finally:
      self._paused = False
      self.paused_s += time.perf_counter() - t

  def compile_s(self) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(self._spans):
      if b > end:
        total += b - max(a, end)
        end = b
    return total


class _StopFlag:
  """Turns SIGTERM / Ctrl-C into a flag checked between steps."""

  def __init__(self):
    self.signal = None
    self._old = {}

  def __enter__(self):
    for s in (signal.SIGINT, signal.SIGTERM):
      self._old[s] = signal.signal(s, self._handle)
    return self

  def _handle(self, signum, frame):
    if self.signal is not None:  # a second signal: stop at once
      raise KeyboardInterrupt
    self.signal = signal.Signals(signum).name

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


def load_data(cfg: TrainConfig) -> data_lib.TextData:
  docs = data_lib.read_documents(cfg.data) if cfg.data else None
  return data_lib.TextData(docs, tokenizer_path=cfg.tokenizer, vocab_size=cfg.vocab_size,
                           seq_len=cfg.seq_len, val_fraction=cfg.val_fraction,
                           cache_dir=pathlib.Path(cfg.cache_dir).expanduser())


def train(cfg: TrainConfig, *, resume: bool = False, log=print,
          stop_after: int | None = None,
          probe: tp.Callable[[int, tp.Any], dict] | None = None,
          probe_every: int | None = None) -> dict:
  """Runs (or resumes) a training run; returns a summary dict.

  ``metrics.jsonl`` gets one JSON record per line, each with its ``'step'``:
  at every ``log_every`` steps ``loss``, ``tokens_per_s`` and ``elapsed_s``
  (wall seconds since the loop started, compilation, evaluation and
  checkpoints included), ``train_s`` (the same less the time spent in
  evaluation, probes and checkpoints) and ``compile_s`` (the part of
  ``train_s`` spent tracing and compiling programs: the first step's, the
  first merge's), so ``train_s - compile_s`` is steady-state training time;
  at step 0 and every ``eval_every`` steps ``val_loss`` and ``val_ppl``; at
  every POET-X merge ``merge_orthogonality_error`` (what
  :func:`poetx_jax.merge` returns; above ``ORTHOGONALITY_WARNING`` a warning
  is logged too); and the probe's records.

  Args:
    cfg: the run's configuration.
    resume: continue from the newest checkpoint in ``cfg.out_dir`` (its
      ``run.json`` must match ``cfg``).
    log: where progress messages go.
    stop_after: stop (and checkpoint) after this many steps of this call, as a
      SIGTERM would (used by tests and for time-limited jobs).
    probe: ``probe(step, model) -> dict`` of numbers or lists, called at step
      0 (after its evaluation) and after the training step at every
      ``probe_every`` steps and at the last; each result is written to
      ``metrics.jsonl`` as ``{'step': step, **result}``. It must not change
      the model; its time is in ``elapsed_s`` but not in ``train_s``.
    probe_every: steps between probes (default: ``cfg.eval_every``, the probe
      then following each evaluation).
  """
  cfg.validate()
  if probe_every is not None and (not isinstance(probe_every, int) or probe_every < 1):
    raise ValueError(f'probe_every must be an int >= 1, got {probe_every!r}')
  probe_every = probe_every or cfg.eval_every
  if cfg.out_dir is None:
    cfg = dataclasses.replace(cfg, out_dir=f'runs/{cfg.model}-{cfg.optimizer}')
  out = pathlib.Path(cfg.out_dir)
  out.mkdir(parents=True, exist_ok=True)
  run_file = out / 'run.json'
  if resume:
    if not run_file.exists():
      raise CheckpointError(f'--resume: no run.json in {out}; nothing to resume')
    saved = json.loads(run_file.read_text())
    if saved != dataclasses.asdict(cfg):
      diff = {k: (saved.get(k), v) for k, v in dataclasses.asdict(cfg).items()
              if saved.get(k) != v}
      raise CheckpointError(f'--resume: the configuration differs from the one in '
                            f'{run_file} (saved, given): {diff}')
  elif Checkpointer(out / 'checkpoints').all_steps():
    raise CheckpointError(f'{out} already holds checkpoints of a run; continue it with '
                          f'--resume, or choose another --out-dir')
  run_file.write_text(json.dumps(dataclasses.asdict(cfg), indent=1))

  data = load_data(cfg)
  log(f'data: {data.description}')
  mc = model_config(cfg, data.tokenizer.vocab_size)
  mesh = make_training_mesh(cfg)
  model = build_model(cfg, mc, mesh)
  optimizer = build_optimizer(cfg, model)
  if mesh is not None:
    if cfg.batch_size % mesh.size:
      raise ValueError(f'batch_size={cfg.batch_size} must be divisible by the '
                       f'{mesh.size} devices')
    sharding.shard_state(model, mesh, cfg.strategy)
    sharding.shard_state(optimizer, mesh, cfg.strategy)
    log(f'mesh: {dict(mesh.shape)}, strategy {cfg.strategy}')
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  log(f'model: {cfg.model} ({n_params:,} trainable parameters, '
      f'{mc.num_params():,} in the dense model), optimizer {cfg.optimizer}, '
      f'dtype {jnp.dtype(compute_dtype(cfg.dtype)).name}')
  log(f'state: model {_gib(nnx.state(model))}, optimizer {_gib(nnx.state(optimizer))}; '
      f'gradients {_gib(nnx.state(model, nnx.Param))} during a step')

  # Each process reads its own share of the windows and feeds its own rows.
  pc, pi = jax.process_count(), jax.process_index()
  if cfg.batch_size % pc:
    raise ValueError(f'batch_size={cfg.batch_size} must be divisible by the {pc} processes')
  train_ds = data_lib.train_dataset(data.train_windows[pi::pc],
                                    batch_size=cfg.batch_size // pc, seed=cfg.seed)
  it = iter(train_ds)
  val = data_lib.eval_batches(data.val_windows, batch_size=cfg.batch_size)[:cfg.eval_batches]
  ckpt = Checkpointer(out / 'checkpoints', max_to_keep=cfg.keep)
  step = 0
  if resume:
    step, data_state, _ = ckpt.restore(model, optimizer)
    it.set_state(data_state)
    log(f'resumed from step {step}')
  metrics = _Metrics(out, step)

  def report_merge(merge_step, error):
    error = float(error)
    metrics.write({'step': merge_step, 'merge_orthogonality_error': error})
    if not error <= ORTHOGONALITY_WARNING:
      log(f'warning: at the merge of step {merge_step} the POET factors were far from '
          f'orthogonal (error {error:.3g} > {ORTHOGONALITY_WARNING}): the '
          f'Cayley–Neumann series has left its region of convergence, which '
          f'the weights now carry. Lower --poet-lr (this run: '
          f'{model_poet_lr(cfg, model):g}) '
          f'or merge more often (--merge-every {cfg.merge_every}).')

  step_fn = make_step(cfg, on_merge=report_merge, mesh=mesh)
  tokens_per_step = cfg.batch_size * cfg.seq_len
  total_updates = cfg.steps * cfg.grad_accum  # one iteration = one micro-batch

  first_val = None
  if step == 0:
    first_val = evaluate(model, val, mesh)
    log(f'step 0: validation loss {first_val[0]:.4f}, perplexity {first_val[1]:.2f}')
    metrics.write({'step': 0, 'val_loss': first_val[0], 'val_ppl': first_val[1]})
    if probe is not None:
      metrics.write({'step': 0, **probe(0, model)})

  def save(reason):
    meta = {'step': step, 'config': dataclasses.asdict(cfg), 'reason': reason}
    ckpt.save(step, model, optimizer, data_state=it.get_state(), meta=meta)

  progress = _Progress(total_updates, cfg.log_every)
  start_step, t0, last_val = step, time.perf_counter(), None
  stopped = None
  with _StopFlag() as stop, _TrainClock() as clock:
    while step < total_updates:
      batch = place_batch(next(it), mesh)
      loss = step_fn(model, optimizer, batch)
      step += 1
      if step % cfg.log_every == 0 or step == total_updates:
        loss = float(loss)
        if not math.isfinite(loss):
          save('non-finite loss')
          ckpt.close()
          raise FloatingPointError(f'loss became {loss} at step {step}; state saved '
                                   f'to {ckpt.directory}')
        elapsed = time.perf_counter() - t0
        tok_s = (step - start_step) * tokens_per_step / elapsed
        progress.update(step, loss, tok_s,
                        (total_updates - step) * elapsed / (step - start_step))
        metrics.write({'step': step, 'loss': loss, 'tokens_per_s': tok_s,
                       'elapsed_s': elapsed, 'train_s': elapsed - clock.paused_s,
                       'compile_s': clock.compile_s()})
      last = step == total_updates
      if step % cfg.eval_every == 0 or last:
        with clock.paused(loss):
          last_val = evaluate(model, val, mesh)
          metrics.write({'step': step, 'val_loss': last_val[0], 'val_ppl': last_val[1]})
      if probe is not None and (step % probe_every == 0 or last):
        with clock.paused(loss):
          metrics.write({'step': step, **probe(step, model)})
      if step % cfg.checkpoint_every == 0 or last:
        with clock.paused(loss):
          save('periodic' if step < total_updates else 'final')
      if stop.signal or (stop_after is not None and step - start_step >= stop_after):
        stopped = stop.signal or 'stop_after'
        if step % cfg.checkpoint_every:
          with clock.paused(loss):
            save(stopped)
        break
  progress.close()
  closing = time.perf_counter()
  ckpt.close()  # waits for the asynchronous checkpoint writes
  closing = time.perf_counter() - closing
  metrics.close()
  elapsed = time.perf_counter() - t0
  tokens = (step - start_step) * tokens_per_step
  steady_s = elapsed - clock.paused_s - clock.compile_s() - closing
  summary = {'step': step, 'stopped': stopped, 'elapsed_s': elapsed, 'out_dir': str(out),
             'tokens_per_s': tokens / max(elapsed, 1e-9),
             'steady_tokens_per_s': tokens / max(steady_s, 1e-9)}
  stats = jax.local_devices()[0].memory_stats() or {}
  if 'peak_bytes_in_use' in stats:  # GPUs report it; the CPU does not
    summary['peak_gib'] = stats['peak_bytes_in_use'] / 2 ** 30
  if first_val:
    summary['val_before'] = {'loss': first_val[0], 'ppl': first_val[1]}
  if last_val:
    summary['val_after'] = {'loss': last_val[0], 'ppl': last_val[1]}
    log(f'step {step}: validation loss {last_val[0]:.4f}, perplexity {last_val[1]:.2f}')
  if stopped:
    log(f'stopped at step {step} ({stopped}); resume with --resume')
  return summary


def load_run(out_dir: str | pathlib.Path, *, step: int | None = None):
  """(cfg, data, model, step) of a run directory, at its newest (or given) checkpoint.

  Only the model is restored: no optimizer state is built or read.
  """
  out = pathlib.Path(out_dir)
  run_file = out / 'run.json'
  if not run_file.exists():
    raise CheckpointError(f'{out} is not a run directory (no run.json)')
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  saved = json.loads(run_file.read_text())
  unknown = sorted(set(saved) - fields)
  if unknown:
    raise CheckpointError(f'{run_file} has fields this version does not know: {unknown}')
  cfg = TrainConfig(**saved)
  data = load_data(cfg)
  model = build_model(cfg, model_config(cfg, data.tokenizer.vocab_size))
  step, _, _ = Checkpointer(out / 'checkpoints').restore(model, step=step)
  return cfg, data, model, step
