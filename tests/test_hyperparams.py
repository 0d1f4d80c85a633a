"""One hyperparameter check for every transformation: the errors name the
value and what is valid; arrays and tracers of numeric hyperparameters pass
(inject_hyperparams itself: test_optax_contract.py)."""

import jax
import jax.numpy as jnp
import pytest

import poetx_jax
from poetx_jax.hyperparams import check_hyperparameters

BAD = [
    (lambda: poetx_jax.poetx(1e-3, b1=1.0), r'b1 must be in \[0, 1\), got 1.0'),
    (lambda: poetx_jax.scale_by_poetx(eps=-1e-8), 'eps must be >= 0, got -1e-08'),
    (lambda: poetx_jax.poetx(1e-3, merge_every=2.5),
     r'merge_every must be an int in \[1, 2147483647\] \(or None: never merge\), got 2.5'),
    (lambda: poetx_jax.poetx(1e-3, merge_every=200.0),
     r'merge_every must be an int in \[1, 2147483647\] \(or None: never merge\), got 200.0'),
    (lambda: poetx_jax.poetx(1e-3, merge_every=float('inf')),
     r'merge_every must be an int in \[1, 2147483647\] \(or None: never merge\), got inf'),
    (lambda: poetx_jax.poetx(1e-3, merge_every=True),
     r'merge_every must be an int in \[1, 2147483647\] \(or None: never merge\), got True'),
    (lambda: poetx_jax.poetx(1e-3, merge_every=2**31),
     r'merge_every must be an int in \[1, 2147483647\] \(or None: never merge\), got 2147483648'),
    (lambda: poetx_jax.default_poet_lr(1), 'block_size must be an int >= 2, got 1'),
    (lambda: poetx_jax.clip_by_global_norm_after_merge(poetx_jax.poetx(1e-3), 1.0,
                                                       min_ratio=0.0),
     r'min_ratio must be in \(0, 1\], got 0.0'),
    (lambda: poetx_jax.clip_by_global_norm_after_merge(poetx_jax.poetx(1e-3), 1.0,
                                                       ramp_steps=2.0),
     'ramp_steps must be an int >= 1, got 2.0'),
    (lambda: poetx_jax.lean_adamw(1e-3, b2=-0.5), r'b2 must be in \[0, 1\), got -0.5'),
    (lambda: poetx_jax.lean_adamw(-1e-3), 'learning_rate must be >= 0, got -0.001'),
    (lambda: poetx_jax.lean_adamw(1e-3, weight_decay=-0.1), 'weight_decay must be >= 0, got -0.1'),
    (lambda: poetx_jax.skewadam(-1e-3), 'learning_rate must be >= 0, got -0.001'),
    (lambda: poetx_jax.skewadam(1e-3, weight_decay=-1.0), 'weight_decay must be >= 0, got -1.0'),
    (lambda: poetx_jax.poetx_skewadam({}, poetx_jax.poetx(1e-3), -1e-3),
     'learning_rate must be >= 0, got -0.001'),
    (lambda: poetx_jax.scale_by_lean_adam(eps=-1.0), 'eps must be >= 0, got -1.0'),
    (lambda: poetx_jax.scale_by_lean_adam(min_dim_size_to_factor=0),
     'min_dim_size_to_factor must be an int >= 1, got 0'),
    (lambda: poetx_jax.scale_by_factored_rms(b2=1.5), r'b2 must be in \[0, 1\), got 1.5'),
    (lambda: poetx_jax.skewadam(1e-3, b1=True), r'b1 must be in \[0, 1\), got True'),
    (lambda: poetx_jax.skewadam(1e-3, min_dim_size_to_factor=0),
     'min_dim_size_to_factor must be an int >= 1, got 0'),
    (lambda: poetx_jax.poetx_skewadam({}, poetx_jax.poetx(1e-3), 1e-3, eps=-1.0),
     'eps must be >= 0, got -1.0'),
    (lambda: poetx_jax.poetx('0.01'),
     r"learning_rate must be a number >= 0, an array or a schedule, got '0.01' \(a str\)"),
    (lambda: poetx_jax.lean_adamw([1e-3]),
     r'learning_rate must be a number >= 0, an array or a schedule, got \[0.001\] \(a list\)'),
    (lambda: poetx_jax.poetx(1e-3, mu_dtype='int8'),
     r"mu_dtype must be a floating-point dtype \(e.g. jnp.bfloat16\) or None, got 'int8'"),
    (lambda: poetx_jax.poetx(1e-3, mu_dtype='nonsense'),
     r"mu_dtype must be a floating-point dtype \(e.g. jnp.bfloat16\) or None, got 'nonsense'"),
    (lambda: poetx_jax.scale_by_lean_adam(mu_dtype=jnp.int32),
     r"mu_dtype must be a floating-point dtype \(e.g. jnp.bfloat16\) or None, got .*int32.*"),
]


@pytest.mark.parametrize('make, message', BAD, ids=[m.split(' ')[0] + str(i)
                                                    for i, (_, m) in enumerate(BAD)])
def test_every_transformation_names_the_bad_value(make, message):
  with pytest.raises(ValueError, match=f'^{message}$'):
    make()


def test_structural_values_must_be_concrete_ints():
  with pytest.raises(ValueError, match='name it in static_args'):
    poetx_jax.scale_by_lean_adam(min_dim_size_to_factor=jnp.asarray(4))
  with pytest.raises(ValueError, match='min_dim_size_to_factor must be an int >= 1, got None$'):
    check_hyperparameters(min_dim_size_to_factor=None)


def test_arrays_and_tracers_of_numeric_hyperparameters_pass():
  check_hyperparameters(b1=jnp.asarray(2.0), eps=jnp.asarray(-1.0), merge_every=None,
                        learning_rate=lambda count: -1.0)  # a schedule is not checked
  jax.jit(lambda b2: poetx_jax.skewadam(1e-3, b2=b2) and b2)(5.0)
  with pytest.raises(TypeError, match="no rule for hyperparameter 'b3'"):
    check_hyperparameters(b3=0.5)
