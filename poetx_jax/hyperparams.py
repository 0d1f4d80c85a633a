"""The ranges of the optimizers' hyperparameters, checked in one place.

Every transformation of :mod:`poetx_jax` checks its hyperparameters with
:func:`check_hyperparameters`. A *numeric* hyperparameter (``b1``, ``eps``,
``learning_rate``, ...) is used only in arithmetic, so ``optax.inject_hyperparams``
and schedules may pass it as an array or a tracer: it is checked only when it
is a concrete Python or numpy number. A *structural* one
(``min_dim_size_to_factor``, ``ramp_steps``, ``block_size``) decides shapes or
Python control flow, so it must be a concrete int and is always checked.
"""

from __future__ import annotations

import numbers
import typing as tp


class Rule(tp.NamedTuple):
  """The valid values of one hyperparameter.

  Attributes:
    ok: whether a concrete value is valid.
    valid: what is valid, as the error message says it.
    structural: an int that must always be concrete (checked even when it
      is not a number); otherwise only concrete numbers are checked.
  """
  ok: tp.Callable[[tp.Any], bool]
  valid: str
  structural: bool = False


_INT32_MAX = 2**31 - 1
_UNIT = Rule(lambda v: 0 <= v < 1, 'in [0, 1)')
_NONNEGATIVE = Rule(lambda v: v >= 0, '>= 0')

RULES: dict[str, Rule] = {
    'learning_rate': _NONNEGATIVE,
    'b1': _UNIT,
    'b2': _UNIT,
    'beta': _UNIT,
    'eps': _NONNEGATIVE,
    'weight_decay': _NONNEGATIVE,
    # the cycle counter is an int32 on the device
    'merge_every': Rule(lambda v: _is_int(v) and 1 <= v <= _INT32_MAX,
                        f'an int in [1, {_INT32_MAX}] (or None: never merge)'),
    'max_norm': Rule(lambda v: v > 0, '> 0'),
    'rms': Rule(lambda v: v > 0, '> 0'),
    'min_ratio': Rule(lambda v: 0 < v <= 1, 'in (0, 1]'),
    'min_dim_size_to_factor': Rule(lambda v: v >= 1, 'an int >= 1', structural=True),
    'ramp_steps': Rule(lambda v: v >= 1, 'an int >= 1', structural=True),
    'block_size': Rule(lambda v: v >= 2, 'an int >= 2', structural=True),
}
"""The rule of each hyperparameter name :func:`check_hyperparameters` knows."""


def _is_int(v) -> bool:
  return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def check_hyperparameters(**values) -> None:
  """Raises ``ValueError`` for the first hyperparameter out of its range.

  Each keyword names a hyperparameter of :data:`RULES`. A numeric value is
  checked only when it is a concrete Python or numpy number, so arrays and
  tracers (``optax.inject_hyperparams``), callables (schedules) and ``None``
  (an option left unset, e.g. ``merge_every=None``: never merge) pass, and
  anything else (a string, say) is refused; a structural one must be a
  concrete int.

  Example::

    >>> from poetx_jax.hyperparams import check_hyperparameters
    >>> check_hyperparameters(b1=0.9, eps=1e-8, min_dim_size_to_factor=128)
    >>> check_hyperparameters(b2=1.0)
    Traceback (most recent call last):
    ...
    ValueError: b2 must be in [0, 1), got 1.0

  Raises:
    ValueError: naming the value and what would be valid.
    TypeError: for a name that has no rule.
  """
  for name, value in values.items():
    if name not in RULES:
      raise TypeError(f'no rule for hyperparameter {name!r}; known: {sorted(RULES)}')
    rule = RULES[name]
    if rule.structural:
      if not (_is_int(value) and rule.ok(value)):
        hint = (' (structural: under optax.inject_hyperparams name it in static_args)'
                if hasattr(value, 'shape') else '')
        raise ValueError(f'{name} must be {rule.valid}, got {value!r}{hint}')
    elif isinstance(value, numbers.Real) and not rule.ok(value):
      raise ValueError(f'{name} must be {rule.valid}, got {value!r}')
    elif not (value is None or isinstance(value, numbers.Real) or hasattr(value, 'dtype')
              or callable(value)):
      raise ValueError(f'{name} must be a number {rule.valid}, an array or a schedule, got '
                       f'{value!r} (a {type(value).__name__})')


def check_mu_dtype(mu_dtype) -> tp.Any:
  """``mu_dtype`` as a jax dtype (None stays None); ValueError unless it is a
  floating-point dtype."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  if mu_dtype is None:
    return None
  try:
    dtype = jax.dtypes.canonicalize_dtype(mu_dtype)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f'mu_dtype must be a floating-point dtype (e.g. jnp.bfloat16) or None, '
                     f'got {mu_dtype!r}')
  return dtype
