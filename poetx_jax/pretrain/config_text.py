"""A run's options written as text: ``K=V`` overrides and config files.

``K=V,K=V`` text (an experiment's run specs, :func:`apply_overrides`) sets
:class:`~poetx_jax.pretrain.config.TrainConfig` fields by name, each value
read as its field's type (:func:`field_value`)::

    apply_overrides(cfg, 'optimizer=adamw,lr=1e-3,model_overrides={layers=4,hidden=128}')

``poetx train --config FILE`` reads the options from a JSON or YAML file: a
mapping of the same fields, checked by the same
:meth:`~poetx_jax.pretrain.config.TrainConfig.validate`. A run's own
``run.json`` is such a file (its ``plan``, what the run resolved, is not
read), so ``poetx train --config RUN/run.json --out-dir NEW`` trains that run
again; options given on the command line override the file's::

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

from poetx_jax.pretrain.config import PLAN_KEY, TrainConfig, _base_type, _field_names
from poetx_jax.pretrain.kv import parse_overrides, split_assignments, split_top

# ------------------------------------------------------------------- K=V overrides

_TRUE, _FALSE = ('true', 'yes', 'on', '1'), ('false', 'no', 'off', '0')


def field_value(name: str, text: str) -> tp.Any:
  """The value of field ``name`` written as ``text`` (type and form only;
  :meth:`TrainConfig.validate` checks choices and bounds): ``none`` for an
  optional field's None; ``true``/``false`` for a bool; a list as ``[A,B]``
  (or one item); a dict as ``{K=V,...}``, JSON or ``K=V``
  (:func:`parse_overrides`)."""
  _field_names([name], 'field_value')
  typ, optional = _base_type(tp.get_type_hints(TrainConfig)[name])
  if optional and text.lower() in ('none', 'null'):
    return None
  try:
    if typ is bool:
      if text.lower() not in _TRUE + _FALSE:
        raise ValueError
      return text.lower() in _TRUE
    if typ in (int, float):
      return typ(text)
    if typ is list:
      inner = text[1:-1] if text[:1] + text[-1:] == '[]' else None
      return [text] if inner is None else [x.strip() for x in split_top(inner, ',') if x.strip()]
    if typ is dict:
      if text[:1] + text[-1:] == '{}':
        try:
          value = json.loads(text)
        except json.JSONDecodeError:
          value = parse_overrides(text[1:-1])
        if not isinstance(value, dict):
          raise ValueError
        return value
      return parse_overrides(text)
  except ValueError as e:
    kind = {bool: 'true or false', int: 'an int', float: 'a number', list: '[A,B,...]',
            dict: '{K=V,...}'}[typ]
    detail = f' ({e})' if typ is dict and str(e) else ''
    raise ValueError(f'{name} must be {kind}{" or none" if optional else ""}, '
                     f'got {text!r}{detail}') from None
  return text


def parse_fields(text: str) -> dict[str, tp.Any]:
  """``K=V,K=V`` text as a dict of TrainConfig fields and their values
  (:func:`field_value`); raises ValueError naming a key that is no field."""
  pairs = split_assignments(text)
  fields = [f.name for f in dataclasses.fields(TrainConfig)]
  for k, _ in pairs:
    if k not in fields:
      raise ValueError(f'{k!r} in {text!r} is not an option; valid: {", ".join(fields)}')
  return {k: field_value(k, v) for k, v in pairs}


def apply_overrides(cfg: TrainConfig, text: str, *, validate: bool = True) -> TrainConfig:
  """``cfg`` with the fields that ``K=V,K=V`` ``text`` names set, checked by
  :meth:`TrainConfig.validate` (unless ``validate=False``).

    >>> apply_overrides(TrainConfig(), 'optimizer=adamw,lr=1e-3,poet_lr=none').lr
    0.001

  Raises ValueError naming the key that is no field (and the valid ones), or
  the field whose value cannot be honoured.
  """
  cfg = dataclasses.replace(cfg, **parse_fields(text))
  if validate:
    cfg.validate()
  return cfg


# ------------------------------------------------------------------- config files

SUFFIXES = ('.json', '.yaml', '.yml')


def read_config_file(path: str | pathlib.Path) -> dict[str, tp.Any]:
  """The TrainConfig fields a ``.json``, ``.yaml`` or ``.yml`` file sets.

  A value written as text where the field is not text (YAML reads ``1e-3``
  as a string; ``none``) is read as :func:`field_value`
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
