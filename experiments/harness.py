"""The experiments' harness: one run-spec grammar, one child-process protocol
and one result record, used by every script in this package.

Run specs. A run is ``poetx train``'s options as ``K=V`` overrides of the
script's own option values, optionally labelled: ``[LABEL:]K=V,K=V,...``. A
value with ``|``-separated alternatives stands for one run each, every
combination of them (a sweep)::

    >>> [r.label for r in expand('optimizer=adamw,lr=1e-3|2e-3')]
    ['optimizer=adamw,lr=1e-3', 'optimizer=adamw,lr=2e-3']
    >>> [(r.label, r.overrides) for r in expand('chunk:permutation=chunk,seed=0|1')]
    [('chunk seed=0', 'permutation=chunk,seed=0'), ('chunk seed=1', 'permutation=chunk,seed=1')]

Children. A script that runs each run in a process of its own starts
``python -m experiments.NAME ARGV --child JSON`` (:func:`child_command`): the
same options, and the one run's description as a JSON object (its payload);
the child reads it back with :func:`child_payload` and, where it reports a
result, prints it as JSON on its last stdout line (:func:`report`), which
:func:`run_child` parses.

Records. :func:`header` describes where and how a record was made (the
command, the commit, the device, the software, the date); a script's JSON
record is that header beside its figures (:func:`write_record`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import typing as tp

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- run specs
@dataclasses.dataclass(frozen=True)
class Run:
  """One run of a spec: its ``label`` and its ``(key, value)`` override pairs."""
  label: str
  pairs: tuple[tuple[str, str], ...]

  @property
  def overrides(self) -> str:
    """The ``K=V,...`` text of the run's overrides."""
    from poetx_jax.pretrain.kv import format_overrides
    return format_overrides(self.pairs)


def expand(spec: str) -> list[Run]:
  """The runs of one spec ``[LABEL:]K=V[|V...],...``: one per combination of
  the ``|`` alternatives. An unlabelled run is labelled by its overrides
  (``base`` when it has none); a labelled spec with alternatives labels each
  run ``LABEL k=v,...`` by the values it chose. Raises ValueError for an item
  that is no ``K=V`` or a key given twice."""
  from poetx_jax.pretrain.kv import format_overrides, split_assignments, split_top, unique_keys
  label, text = split_label(spec)
  pairs = split_assignments(text)
  unique_keys(pairs, f' in run spec {spec!r}')
  choices = [[(k, v.strip()) for v in split_top(value, '|')] for k, value in pairs]
  swept = [i for i, c in enumerate(choices) if len(c) > 1]
  runs = []
  for combo in itertools.product(*choices):
    if label is None:
      name = format_overrides(combo) or 'base'
    elif swept:
      name = f'{label} ' + format_overrides([combo[i] for i in swept])
    else:
      name = label
    runs.append(Run(name, tuple(combo)))
  return runs


def expand_all(specs: tp.Iterable[str]) -> list[Run]:
  """The runs of every spec, in order; ValueError for a label given twice."""
  specs = list(specs)
  runs = [r for spec in specs for r in expand(spec)]
  labels = [r.label for r in runs]
  for label in labels:
    if labels.count(label) > 1:
      raise ValueError(f'run {label!r} is given twice by the run specs {specs}')
  return runs


def split_label(spec: str) -> tuple[str | None, str]:
  """(label or None, overrides text) of a spec: a label is text before the
  first ``:`` that holds no ``=``."""
  head, sep, rest = spec.partition(':')
  if sep and head.strip() and '=' not in head:
    return head.strip(), rest
  return None, spec


def apply(cfg, run: Run | str):
  """``cfg`` (a TrainConfig) with the run's overrides set, unvalidated (the
  caller validates the finished config): the fields' types read as
  ``poetx train`` reads ``K=V`` text."""
  from poetx_jax.pretrain import config_text
  text = run.overrides if isinstance(run, Run) else run
  return config_text.apply_overrides(cfg, text, validate=False)


# ----------------------------------------------------------------------- children
def add_child_option(p: argparse.ArgumentParser) -> None:
  """The hidden ``--child JSON`` option by which a parent hands a child its run."""
  p.add_argument('--child', default=None, help=argparse.SUPPRESS)


def child_payload(a: argparse.Namespace) -> dict | None:
  """The payload a parent passed with ``--child`` (None in the parent)."""
  return json.loads(a.child) if getattr(a, 'child', None) else None


def child_command(module: str, argv: tp.Sequence[str], payload: dict) -> list[str]:
  """The command of a child of ``experiments.MODULE``: its parent's options
  ``argv`` and ``--child`` with ``payload`` as JSON."""
  return [sys.executable, '-m', f'experiments.{module}', *argv, '--child', json.dumps(payload)]


def child_env(env: tp.Mapping[str, str] | None = None) -> dict[str, str]:
  """``env`` (default: this process's) with the repository root first on
  PYTHONPATH, so that ``-m experiments.NAME`` resolves from any directory."""
  env = dict(os.environ if env is None else env)
  env['PYTHONPATH'] = os.pathsep.join(filter(None, [str(ROOT), env.get('PYTHONPATH')]))
  return env


def run_child(module: str, argv: tp.Sequence[str], payload: dict, label: str,
              env=None) -> tuple[dict | None, str | None]:
  """Runs one child (:func:`child_command`) to its end; its last stdout line
  is its JSON result. Its progress lines (stderr, ``common.progress``) are
  echoed as they come, prefixed with ``label``. Returns ``(result, None)``,
  or ``(None, error)`` with the last lines of its output when it failed."""
  from experiments.common import run_child as run
  return run(child_command(module, argv, payload), label, env=child_env(env))


def report(result: dict) -> None:
  """A child's result: JSON on its last stdout line."""
  print(json.dumps(result), flush=True)


# ------------------------------------------------------------------------ records
def header(module: str, argv: tp.Sequence[str], device: str | None = None) -> dict:
  """Where and how a record is made: the command that reruns it (from the
  repository root), the commit (``-dirty`` when tracked files differ from
  it), the devices (``device``, else this process's JAX devices: a parent
  whose children ran on the accelerator passes theirs, so that it never
  opens the accelerator itself), the software and the date."""
  if device is None:
    import jax
    devices = jax.devices()
    device = f'{len(devices)} x {", ".join(sorted({d.device_kind for d in devices}))}'
  return {'command': shlex.join(['python3', '-m', f'experiments.{module}', *argv]),
          'commit': commit(),
          'device': device,
          'software': software(),
          'date': datetime.date.today().isoformat()}


def commit() -> str:
  """The repository's commit (short), ``-dirty`` when tracked files differ
  from it; ``unknown`` outside a git checkout."""
  def git(*args):
    return subprocess.run(['git', *args], cwd=ROOT, capture_output=True, text=True)
  head = git('rev-parse', '--short', 'HEAD')
  if head.returncode:
    return 'unknown'
  dirty = git('status', '--porcelain', '--untracked-files=no').stdout.strip()
  return head.stdout.strip() + ('-dirty' if dirty else '')


def software() -> str:
  """The versions of jax, flax and optax (and jax's CUDA plugin, if any)."""
  from importlib import metadata
  out = []
  for name in ('jax', 'flax', 'optax'):
    try:
      out.append(f'{name} {metadata.version(name)}')
    except metadata.PackageNotFoundError:
      pass
  plugins = [d.metadata['Name'] for d in metadata.distributions()
             if (d.metadata['Name'] or '').startswith('jax-cuda') and 'plugin' in d.metadata['Name']]
  return ', '.join(out + sorted(set(plugins)))


def write_record(path: str | os.PathLike, figures, *, module: str, argv: tp.Sequence[str],
                 device: str | None = None, **fields) -> dict:
  """Writes the JSON record ``{'header': header(module, argv, device),
  **fields, 'results': figures}`` to ``path`` (whole: a reader never sees
  half of it); returns it."""
  record = {'header': header(module, argv, device), **fields, 'results': figures}
  path = pathlib.Path(path)
  tmp = path.with_name(path.name + '.tmp')
  tmp.write_text(json.dumps(record, indent=1, default=str) + '\n')
  tmp.replace(path)
  return record


def children_device(results: tp.Iterable[dict]) -> str:
  """The devices the children's results name (their ``devices`` count and
  ``device`` kind), for a parent's record header; ``unknown`` if none does."""
  for r in results:
    if 'device' in r:
      return f"{r.get('devices') or 1} x {r['device']}"
  return 'unknown'


def results_of(data):
  """The results of a JSON record read back: a :func:`write_record` record's
  ``results``; anything else (an older record written as a bare list, a
  study's other files) as it is."""
  if isinstance(data, dict) and 'header' in data and 'results' in data:
    return data['results']
  return data


def todays_form(command: str) -> str:
  """A recorded command as it is run today: a script run by its path
  (``python3 experiments/NAME.py``) run as a module of this package, its
  options unchanged."""
  return re.sub(r'\bpython3? experiments/(\w+)\.py\b', r'python3 -m experiments.\1', command)
