"""Lean optimizer state: bf16 momentum and factored second moments."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from poetx_jax.lean import lean_adamw, scale_by_lean_adam


def _params(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {'emb': jax.random.normal(k1, (256, 128)), 'norm': jax.random.normal(k2, (128,)),
          'small': jax.random.normal(k3, (4, 200))}


@pytest.mark.slow
def test_factored_moment_is_row_and_column_means(keys):
  params = _params(keys())
  g = _params(keys())
  tx = scale_by_lean_adam(b2=0.9, min_dim_size_to_factor=64)
  state = tx.init(params)
  assert state.v_row['emb'].shape == (256,) and state.v_col['emb'].shape == (128,)
  assert state.v_full['emb'].size == 1  # placeholder
  assert state.v_full['small'].shape == (4, 200)  # a side < 64: exact moment
  assert state.mu['emb'].dtype == jnp.bfloat16
  u, state = tx.update(g, state, params)
  g2 = np.asarray(g['emb'], np.float64) ** 2
  np.testing.assert_allclose(state.v_row['emb'], 0.1 * g2.mean(1), rtol=1e-5)
  np.testing.assert_allclose(state.v_col['emb'], 0.1 * g2.mean(0), rtol=1e-5)
  np.testing.assert_allclose(state.v_full['norm'], 0.1 * np.asarray(g['norm']) ** 2, rtol=1e-5)
  # First step: v_hat = outer(r, c) / mean(r) with bias-corrected means.
  r, c = g2.mean(1), g2.mean(0)
  v_hat = np.outer(r, c) / r.mean()
  want = np.asarray(g['emb']) / (np.sqrt(v_hat) + 1e-8)
  np.testing.assert_allclose(u['emb'], want, rtol=1e-4)


def test_rank_one_gradients_match_adam(keys):
  a, b = jax.random.normal(keys(), (256,)), jax.random.normal(keys(), (128,))
  params = {'w': jnp.zeros((256, 128))}
  tx = scale_by_lean_adam(mu_dtype=jnp.float32, min_dim_size_to_factor=2)
  ref = optax.scale_by_adam()
  s, s_ref = tx.init(params), ref.init(params)
  for t in range(3):
    g = {'w': jnp.outer(a, b) * (1.0 + t)}  # g**2 is rank one: factoring is exact
    u, s = tx.update(g, s, params)
    u_ref, s_ref = ref.update(g, s_ref, params)
    np.testing.assert_allclose(u['w'], u_ref['w'], rtol=2e-4, atol=1e-6)


def test_state_is_small(keys):
  """A bf16 first moment and R + C second moments: under 45% of AdamW's bytes.
  (Training, jit and dtypes: test_optax_contract.py.)"""
  params = _params(keys())
  lean_bytes = sum(x.nbytes for x in jax.tree.leaves(lean_adamw(1e-2).init(params)))
  adam_bytes = sum(x.nbytes for x in jax.tree.leaves(optax.adamw(1e-2).init(params)))
  assert lean_bytes < 0.45 * adam_bytes, (lean_bytes, adam_bytes)
