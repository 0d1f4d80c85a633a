"""The factored second-moment building blocks against their definitions
(float64 numpy); the transformations built on them: test_lean.py,
test_skewadam.py and test_optax_contract.py."""

import jax.numpy as jnp
import numpy as np
import pytest

from poetx_jax.factored import factored_moments_like, is_factored, update_factored_moment


@pytest.mark.parametrize('shape, min_dim, want', [
    ((4, 3), 3, True), ((4, 3), 4, False), ((2, 5, 6), 5, True), ((9,), 1, False),
    ((3, 1), 1, True)])
def test_is_factored_needs_two_axes_both_long_enough(shape, min_dim, want):
  assert is_factored(shape, min_dim) is want


def test_moments_like_puts_placeholders_where_a_leaf_has_no_moment():
  params = {'m': jnp.zeros((2, 5, 6)), 'v': jnp.zeros((6,)), 'small': jnp.zeros((5, 2))}
  row, col, full = factored_moments_like(params, min_dim_size_to_factor=3)
  shapes = lambda t: {k: x.shape for k, x in t.items()}
  assert shapes(row) == {'m': (2, 5), 'v': (1,), 'small': (1,)}
  assert shapes(col) == {'m': (2, 6), 'v': (1,), 'small': (1,)}
  assert shapes(full) == {'m': (1,), 'v': (6,), 'small': (5, 2)}
  assert all(x.dtype == jnp.float32 and not x.any() for t in (row, col, full)
             for x in t.values())


def test_update_matches_its_definition():
  rng = np.random.default_rng(0)
  b2, d = 0.9, 1 - 0.9 ** 2
  g2 = rng.random((2, 5, 6)) + 0.1
  r0, c0 = rng.random((2, 5)), rng.random((2, 6))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  unused = jnp.zeros((1,), jnp.float32)
  v_hat, row, col, full = update_factored_moment(f32(g2), f32(r0), f32(c0), unused,
                                                 b2=b2, bias_correction=d, factored=True)
  r = b2 * r0 + (1 - b2) * g2.mean(-1)
  c = b2 * c0 + (1 - b2) * g2.mean(-2)
  np.testing.assert_allclose(row, r, rtol=1e-6)
  np.testing.assert_allclose(col, c, rtol=1e-6)
  np.testing.assert_allclose(v_hat, r[..., :, None] * c[..., None, :]
                             / r.mean(-1)[:, None, None] / d, rtol=1e-5)
  assert full is unused
  v0 = rng.random((2, 5, 6))
  v_hat, row, col, full = update_factored_moment(f32(g2), unused, unused, f32(v0),
                                                 b2=b2, bias_correction=d, factored=False)
  np.testing.assert_allclose(full, b2 * v0 + (1 - b2) * g2, rtol=1e-6)
  np.testing.assert_allclose(v_hat, (b2 * v0 + (1 - b2) * g2) / d, rtol=1e-6)
  assert row is unused and col is unused


def test_rank_one_squares_are_estimated_exactly():
  a, b = np.arange(1.0, 6.0), np.arange(1.0, 4.0)
  g2 = jnp.asarray(np.outer(a, b) ** 2, jnp.float32)
  v_hat, *_ = update_factored_moment(g2, jnp.zeros(5), jnp.zeros(3), jnp.zeros((1,)),
                                     b2=0.5, bias_correction=0.5, factored=True)
  np.testing.assert_allclose(v_hat, g2, rtol=1e-6)
