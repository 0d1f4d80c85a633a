"""``poetx train --config FILE``: a run's options from a JSON or YAML file.

The file is a mapping of :class:`~poetx_jax.pretrain.config.TrainConfig`
fields by name, the same schema as the flags, checked by the same
:meth:`~poetx_jax.pretrain.config.TrainConfig.validate`. A run's own
``run.json`` is such a file (its ``plan``, what the run resolved, is not read), so ``poetx train --config RUN/run.json --out-dir
NEW`` trains that run again; options given on the command line override the
file's::

    # run.yaml
    model: tiny
    model_overrides: {layers: 4, hidden: 128}
    data: [corpus/]
    lr: 1e-3          # YAML reads this as text: it is read as the field's type

    poetx train --config run.yaml --steps 100
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import typing as tp

from poetx_jax.pretrain.config import PLAN_KEY, TrainConfig, field_value

SUFFIXES = ('.json', '.yaml', '.yml')


def read_config_file(path: str | pathlib.Path) -> dict[str, tp.Any]:
  """The TrainConfig fields a ``.json``, ``.yaml`` or ``.yml`` file sets.

  A value written as text where the field is not text (YAML reads ``1e-3``
  as a string; ``none``) is read as :func:`~poetx_jax.pretrain.config.field_value`
  reads a ``K=V`` override. Raises ValueError naming the file and what is
  wrong with it: another suffix, text that does not parse, not a mapping, a
  key that is no option (and the valid ones); FileNotFoundError if it is
  missing.
  """
  path = pathlib.Path(path)
  suffix = path.suffix.lower()
  if suffix not in SUFFIXES:
    raise ValueError(f'--config {path}: the file must be JSON (.json) or YAML (.yaml, '
                     f'.yml), got the suffix {suffix!r}')
  text = path.read_text()
  if suffix == '.json':
    try:
      values = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f'--config {path}: not valid JSON: {e}') from None
  else:
    import yaml  # the pretrain extra's; only for a YAML file
    try:
      values = yaml.safe_load(text)
    except yaml.YAMLError as e:
      raise ValueError(f'--config {path}: not valid YAML: {" ".join(str(e).split())}') from None
  if not isinstance(values, dict):
    raise ValueError(f'--config {path}: must hold a mapping of options to values, got '
                     f'{type(values).__name__}')
  fields = [f.name for f in dataclasses.fields(TrainConfig)]
  values.pop(PLAN_KEY, None)  # a run.json's record of what it resolved, not an option
  unknown = [k for k in values if k not in fields]
  if unknown:
    raise ValueError(f'--config {path}: {", ".join(map(repr, unknown))} '
                     f'{"is not an option" if len(unknown) == 1 else "are not options"}; '
                     f'valid: {", ".join(fields)}')
  try:
    return {k: field_value(k, v) if isinstance(v, str) else v for k, v in values.items()}
  except ValueError as e:
    raise ValueError(f'--config {path}: {e}') from None


def config_with_file(path: str | pathlib.Path,
                     given: tp.Mapping[str, tp.Any] | None = None) -> TrainConfig:
  """The :class:`TrainConfig` of a config file (:func:`read_config_file`)
  with the fields in ``given`` (the options on the command line) set over
  it, the rest TrainConfig's defaults; checked by ``validate()``."""
  cfg = TrainConfig(**{**read_config_file(path), **(given or {})})
  cfg.validate()
  return cfg
