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
    lr: 1e-3          # YAML 1.2's core schema: a float, as 010 is 10 and 2:3 text

    poetx train --config run.yaml --steps 100
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import typing as tp

from poetx_jax.pretrain.config import PLAN_KEY, TrainConfig, _base_type, _field_names, check_fields
from poetx_jax.pretrain.kv import parse_overrides, split_assignments, split_top, unique_keys

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

  YAML is read by the YAML 1.2 core schema (:func:`_read_yaml`). A value
  written as text where the field is not text (``none``, ``'1e-3'``) is read
  as :func:`field_value` reads a ``K=V`` override. Raises ValueError naming
  the file and what is wrong with it: another suffix, a file that cannot be
  read as UTF-8 text, text that does not parse, a key given twice, not a
  mapping, a key that is no option (and the valid ones); FileNotFoundError
  if it is missing.
  """
  path = pathlib.Path(path)
  suffix = path.suffix.lower()
  if suffix not in SUFFIXES:
    raise ValueError(f'--config {path}: the file must be JSON (.json) or YAML (.yaml, '
                     f'.yml), got the suffix {suffix!r}')
  try:
    text = path.read_text(encoding='utf-8')
  except FileNotFoundError:
    raise FileNotFoundError(f'--config {path}: no such file') from None
  except UnicodeDecodeError as e:
    raise ValueError(f'--config {path}: not UTF-8 text ({e})') from None
  except OSError as e:
    raise ValueError(f'--config {path}: cannot be read ({e.strerror or e})') from None
  try:
    if suffix == '.json':
      try:
        values = json.loads(text, object_pairs_hook=unique_keys)
      except json.JSONDecodeError as e:
        raise ValueError(f'not valid JSON: {e}') from None
    else:
      values = _read_yaml(text)
  except ValueError as e:
    raise ValueError(f'--config {path}: {e}') from None
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


def _read_yaml(text: str):
  """YAML text read by the YAML 1.2 core schema: ``2:3`` and ``010`` are the
  text ``'2:3'`` and the int 10, ``yes`` / ``on`` and ``2024-01-01`` text, not
  YAML 1.1's base-60 number 123, octal 8, True and a date; a mapping's key
  given twice is a ValueError (a merged ``<<`` key is overridden, as YAML
  merges do)."""
  import yaml  # the pretrain extra's; only for a YAML file
  try:
    return yaml.load(text, Loader=_yaml_loader(yaml))  # noqa: S506 (a SafeLoader)
  except yaml.YAMLError as e:
    raise ValueError(f'not valid YAML: {" ".join(str(e).split())}') from None


def _yaml_loader(yaml):
  """A ``yaml.SafeLoader`` with YAML 1.2's core schema for bools, ints and
  floats, and mappings that refuse a key given twice."""
  import re  # pylint: disable=g-import-not-at-top
  core = {'bool': (r'^(?:true|True|TRUE|false|False|FALSE)$', 'tTfF'),
          'int': (r'^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$', '-+0123456789'),
          'float': (r'^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?'
                    r'|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$', '-+0123456789.')}
  tags = {f'tag:yaml.org,2002:{name}' for name in (*core, 'timestamp')}  # no dates either

  class Loader(yaml.SafeLoader):  # pylint: disable=too-many-ancestors
    def construct_mapping(self, node, deep=False):
      own = sum(k.tag != 'tag:yaml.org,2002:merge' for k, _ in node.value)
      self.flatten_mapping(node)  # merged (<<) pairs first, the mapping's own last
      pairs = [(self.construct_object(k, deep=deep), self.construct_object(v, deep=deep))
               for k, v in node.value]
      cut = len(pairs) - own
      try:  # the mapping's own keys override merged ones; twice among its own: refused
        return {**dict(pairs[:cut]), **unique_keys(pairs[cut:])}
      except TypeError as e:  # a key that is a list or mapping
        raise ValueError(f'a mapping key that is not a plain value ({e})') from None

  def construct_int(loader, node):
    text = loader.construct_scalar(node)
    return int(text[2:], 8) if text.startswith('0o') else int(text, 16 if text.startswith('0x')
                                                              else 10)

  Loader.yaml_implicit_resolvers = {
      first: [(tag, regexp) for tag, regexp in resolvers if tag not in tags]
      for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
  for name, (regexp, first) in core.items():
    Loader.add_implicit_resolver(f'tag:yaml.org,2002:{name}', re.compile(regexp), list(first))
  Loader.add_constructor('tag:yaml.org,2002:int', construct_int)
  Loader.add_constructor('tag:yaml.org,2002:bool',
                         lambda loader, node: loader.construct_scalar(node).lower() == 'true')
  return Loader


def config_with_file(path: str | pathlib.Path,
                     given: tp.Mapping[str, tp.Any] | None = None) -> TrainConfig:
  """The :class:`TrainConfig` of a config file (:func:`read_config_file`)
  with the fields in ``given`` (the options on the command line) set over
  it, the rest TrainConfig's defaults; checked by ``validate()``, after each
  of the file's values that ``given`` leaves is checked alone, so that an
  error in the file names it."""
  given = dict(given or {})
  values = read_config_file(path)
  try:
    check_fields({k: v for k, v in values.items() if k not in given})
  except ValueError as e:
    raise ValueError(f'--config {path}: {e}') from None
  cfg = TrainConfig(**{**values, **given})
  cfg.validate()
  return cfg
