"""``K=V,K=V`` text: the form of ``--model-overrides``, of an experiment's run
specs and of :func:`poetx_jax.pretrain.config_text.apply_overrides`.

Plain text parsing, with no knowledge of the options: config.py gives the
values their fields' types.
"""

from __future__ import annotations

import json
import math
import typing as tp


def parse_overrides(text: str) -> dict:
  """The ``--model-overrides`` text as a dict, values read as JSON where they
  parse, else kept as strings; a key given twice, and ``NaN`` or
  ``Infinity``, are ValueErrors.

    >>> parse_overrides('layers=4,hidden=128,name=x')
    {'layers': 4, 'hidden': 128, 'name': 'x'}
  """
  pairs = []
  for item in filter(None, text.split(',')):
    if '=' not in item:
      raise ValueError(f'--model-overrides wants K=V pairs, got {item!r}')
    k, v = item.split('=', 1)
    try:
      value = json.loads(v, parse_constant=_finite_only)
    except json.JSONDecodeError:
      value = v
    if isinstance(value, float) and not math.isfinite(value):  # 1e999
      _finite_only(v)
    pairs.append((k.strip(), value))
  return unique_keys(pairs, ' in --model-overrides')


def unique_keys(pairs: tp.Iterable[tuple[tp.Any, tp.Any]], where: str = '') -> dict:
  """``(key, value)`` pairs as a dict; ValueError naming a key given twice
  (``where`` it was: a silent last-one-wins would hide the first)."""
  out = {}
  for k, v in pairs:
    if k in out:
      raise ValueError(f'{k} is given twice{where} ({out[k]!r}, then {v!r})')
    out[k] = v
  return out


def _finite_only(name: str):
  raise ValueError(f'--model-overrides: {name} is not a finite number')



def format_overrides(pairs: tp.Mapping[str, tp.Any] | tp.Iterable[tuple[str, tp.Any]]) -> str:
  """``K=V,K=V`` text of a mapping or of ``(key, value)`` pairs, in their
  order: what :func:`parse_overrides` reads back.

    >>> format_overrides({'layers': 1, 'hidden': 32})
    'layers=1,hidden=32'
    >>> parse_overrides(format_overrides({'layers': 1, 'name': 'x'}))
    {'layers': 1, 'name': 'x'}
  """
  items = pairs.items() if isinstance(pairs, tp.Mapping) else pairs
  return ','.join(f'{k}={v}' for k, v in items)


_OPEN, _CLOSE = '[{(', ']})'


def split_top(text: str, sep: str) -> list[str]:
  """``text`` split at each ``sep`` outside brackets (``[]``, ``{}``, ``()``).

    >>> split_top('a=1,b={x=1,y=2},c=[p,q]', ',')
    ['a=1', 'b={x=1,y=2}', 'c=[p,q]']
  """
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    depth += (ch in _OPEN) - (ch in _CLOSE)
    if ch == sep and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  return parts + [text[start:]]


def split_assignments(text: str) -> list[tuple[str, str]]:
  """The ``(key, value text)`` pairs of ``K=V,K=V`` text (commas inside
  brackets belong to their value; a ``-`` in a key reads ``_``); raises
  ValueError for an item that is not ``K=V`` or a key given twice."""
  pairs = []
  for item in filter(str.strip, split_top(text, ',')):
    if '=' not in item:
      raise ValueError(f'{item.strip()!r} in {text!r} is not K=V')
    k, v = item.split('=', 1)
    pairs.append((k.strip().replace('-', '_'), v.strip()))
  unique_keys(pairs, f' in {text!r}')
  return pairs
