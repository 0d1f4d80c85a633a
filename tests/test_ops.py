"""poetx_jax.ops: the maths, checked against dense formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from conftest import dense_rotation, rel_err, skew_params
from poetx_jax import ops


def test_unpack_gradient_is_that_of_u_minus_u_transpose(keys):
  b = 6
  q = jax.random.normal(keys(), (2, ops.skew_size(b)))
  ct = jax.random.normal(keys(), (2, b, b))
  rows, cols = np.triu_indices(b, 1)

  def naive(q):
    u = jnp.zeros((2, b, b)).at[:, rows, cols].set(q)
    return u - jnp.swapaxes(u, -1, -2)

  np.testing.assert_array_equal(ops.unpack_skew(q, b), naive(q))
  g = jax.grad(lambda q: (ops.unpack_skew(q, b) * ct).sum())(q)
  np.testing.assert_allclose(g, jax.grad(lambda q: (naive(q) * ct).sum())(q), rtol=1e-6)


def test_pack_unpack_roundtrip(keys):
  b = 7
  q = jax.random.normal(keys(), (3, ops.skew_size(b)))
  blocks = ops.unpack_skew(q, b)
  np.testing.assert_array_equal(blocks, -jnp.swapaxes(blocks, -1, -2))
  np.testing.assert_array_equal(jnp.diagonal(blocks, axis1=-2, axis2=-1), 0)
  np.testing.assert_array_equal(ops.pack_skew(blocks), q)
  # Row-major strict upper triangle: element 0 is (0, 1), element 1 is (0, 2).
  np.testing.assert_array_equal(blocks[:, 0, 1], q[:, 0])
  np.testing.assert_array_equal(blocks[:, 0, 2], q[:, 1])
  with pytest.raises(ValueError, match='B\\(B-1\\)/2'):
    ops.unpack_skew(q, 6)


def test_series_definition_and_convergence(keys):
  b = 16
  q = ops.unpack_skew(skew_params(keys(), 4, b, 0.3), b)
  eye = jnp.eye(b)
  q2 = q @ q
  want = eye + 2 * (q + q2 + q2 @ q + q2 @ q2)  # I + 2(Q + Q^2 + Q^3 + Q^4)
  np.testing.assert_allclose(ops.cayley_neumann(q, 4), want, atol=1e-6)
  cayley = jnp.linalg.solve((eye - q).mT, (eye + q).mT).mT  # (I+Q)(I-Q)^-1
  errs = [float(ops.orthogonality_error(ops.cayley_neumann(q, k))) for k in range(1, 9)]
  dists = [rel_err(ops.cayley_neumann(q, k), cayley) for k in range(1, 9)]
  # Odd k leaves -4 Q^(k+1) in G^T G - I, even k only +4 Q^(k+2): the error
  # falls with every second term, and an even k is never worse than k + 1.
  assert all(e1 > 5 * e2 for e1, e2 in zip(errs, errs[2:])), errs
  assert all(errs[k] < 1.2 * errs[k + 1] for k in range(1, 7, 2)), errs
  assert all(d1 > d2 for d1, d2 in zip(dists, dists[1:])), dists
  with pytest.raises(ValueError, match='terms'):
    ops.cayley_neumann(q, 0)


@pytest.mark.parametrize('b', [16, 64])
def test_orthogonality_at_default_terms(keys, b):
  g = ops.cayley_neumann(ops.unpack_skew(skew_params(keys(), 3, b, 0.1), b))
  err = float(ops.orthogonality_error(g))
  assert err < 1e-4, err
  assert err > 0  # truncated: not exactly orthogonal, and the check can see it


def test_ragged_last_block_is_orthogonal_and_isolated(keys):
  n, b = 11, 4  # blocks of 4, 4, 3
  q = skew_params(keys(), 3, b, 0.1)
  last = ops.rotation_blocks(q, n, b)[-1]
  np.testing.assert_array_equal(last[3], jnp.eye(b)[3])  # padding maps to itself
  np.testing.assert_array_equal(last[:, 3], jnp.eye(b)[:, 3])
  full = dense_rotation(q, jnp.arange(n), n, block_size=b)
  assert float(ops.orthogonality_error(full[None])) < 1e-4


def test_random_permutations_are_uniform_and_independent():
  """Over 6,000 keys, each of the 6 orders of 3 and each of the 36 pairs of
  two sizes' orders comes up within 5 standard deviations of its share; a
  size of 1 gives [0]; one size alone is random_permutation's draw."""
  keys = jax.random.split(jax.random.key(0), 6000)
  a, one, b = map(np.asarray, jax.jit(jax.vmap(
      lambda k: ops.random_permutations(k, (3, 1, 3))))(keys))
  assert a.dtype == b.dtype == np.int32 and not one.any()
  assert (np.sort(a, axis=1) == np.arange(3)).all() and (np.sort(b, axis=1) == np.arange(3)).all()
  rank = lambda p: p[:, 0] * 2 + (p[:, 1] > p[:, 2])  # noqa: E731  # 0..5, one per order
  for counts, share in ((np.bincount(rank(a), minlength=6), 1 / 6),
                        (np.bincount(rank(b), minlength=6), 1 / 6),
                        (np.bincount(6 * rank(a) + rank(b), minlength=36), 1 / 36)):
    sd = np.sqrt(len(keys) * share * (1 - share))
    assert np.abs(counts - len(keys) * share).max() < 5 * sd, counts
  k = jax.random.key(7)
  np.testing.assert_array_equal(ops.random_permutation(k, 10), ops.random_permutations(k, (10,))[0])
  assert sorted(np.asarray(ops.random_permutation(k, 10)).tolist()) == list(range(10))


def test_permute_and_its_gradient(keys):
  n = 13
  perm = ops.random_permutation(keys(), n)
  inv = ops.invert_permutation(perm)
  np.testing.assert_array_equal(perm[inv], jnp.arange(n))
  x = jax.random.normal(keys(), (5, n))
  ct = jax.random.normal(keys(), (5, n))
  np.testing.assert_array_equal(ops.permute(x, perm), x[:, perm])
  g = jax.grad(lambda x: (ops.permute(x, perm) * ct).sum())(x)
  g_ref = jax.grad(lambda x: (x[:, perm] * ct).sum())(x)
  np.testing.assert_array_equal(g, g_ref)
  check_grads(lambda x: ops.permute(x, perm), (x,), order=2, modes=['rev'])


def test_gathers_carry_their_gpu_constraints_only_for_gpus(keys, monkeypatch):
  """A permutation's gather and its backward hold no per-platform branches:
  compiled for GPUs each gather is fenced by optimization barriers (its
  operand pinned row-major), elsewhere it is a bare gather."""
  n = 16
  perm = ops.random_permutation(keys(), n)
  x = jax.random.normal(keys(), (4, n))
  inv = ops.invert_permutation(perm)

  def primitives(f, *args):
    text = str(jax.make_jaxpr(jax.grad(lambda x: (f(x, *args) ** 2).sum()))(x))
    return {name: text.count(name) for name in ('cond', 'platform_index', 'optimization_barrier',
                                                'gather')}

  for args in ((perm,), (perm, inv)):
    here = primitives(ops.permute, *args)
    assert here['cond'] == here['platform_index'] == here['optimization_barrier'] == 0
    assert here['gather'] == 2  # the forward's and the backward's
    monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
    gpu = primitives(ops.permute, *args)
    monkeypatch.undo()
    assert gpu['cond'] == gpu['platform_index'] == 0
    assert gpu['optimization_barrier'] == 6 and gpu['gather'] == 2  # operand, index, result


def _layer_inputs(keys, i, o, b, t=9, scale=0.1):
  kernel = jax.random.normal(keys(), (i, o)) / np.sqrt(i)
  q_in = skew_params(keys(), ops.num_blocks(i, b), b, scale)
  q_out = skew_params(keys(), ops.num_blocks(o, b), b, scale)
  p_in = ops.random_permutation(keys(), i)
  p_out = ops.random_permutation(keys(), o)
  x = jax.random.normal(keys(), (t, i))
  return x, kernel, q_in, q_out, p_in, p_out


def _dense_weight(kernel, q_in, q_out, p_in, p_out, b):
  """W = R W0 P with everything materialised (W0 = kernel^T, unpermuted)."""
  i, o = kernel.shape
  p = dense_rotation(q_in, p_in, i, block_size=b)
  r = dense_rotation(q_out, p_out, o, block_size=b)
  return r @ kernel.T @ p


# Every shape with every form; remat on and off for each shape and each form
# (the values do not depend on their combination: remat recomputes the same).
_SHAPES = [(16, 24, 8), (21, 10, 4), (12, 30, 8)]


@pytest.mark.slow
@pytest.mark.parametrize('i,o,b,remat,form', [
    (*shape, (k + j) % 2 == 1, form) for k, shape in enumerate(_SHAPES)
    for j, form in enumerate(ops.FORMS)])
def test_poet_linear_matches_dense_formula(keys, i, o, b, remat, form):
  x, kernel, q_in, q_out, p_in, p_out = _layer_inputs(keys, i, o, b)
  stored = ops.permute_kernel(kernel, p_in, p_out)

  @jax.jit
  def fast(x, q_in, q_out):
    return ops.poet_linear(x, stored, q_in, q_out, p_in, p_out, block_size=b,
                           remat=remat, form=form)

  @jax.jit
  def naive(x, q_in, q_out):
    return x @ _dense_weight(kernel, q_in, q_out, p_in, p_out, b).T

  assert rel_err(fast(x, q_in, q_out), naive(x, q_in, q_out)) < 1e-5
  ct = jax.random.normal(keys(), (x.shape[0], o))
  g = jax.grad(lambda *a: (fast(*a) * ct).sum(), argnums=(0, 1, 2))(x, q_in, q_out)
  g_ref = jax.grad(lambda *a: (naive(*a) * ct).sum(), argnums=(0, 1, 2))(x, q_in, q_out)
  for a, r in zip(g, g_ref):
    assert rel_err(a, r) < 1e-5
  check_grads(fast, (x, q_in, q_out), order=1, modes=['rev'], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize('form', [pytest.param(f, marks=pytest.mark.slow) if f == 'input' else f
                                  for f in ops.FORMS])  # the input form's case is slow
def test_poet_linear_bf16(keys, form):
  i, o, b = 64, 48, 16
  x, kernel, q_in, q_out, p_in, p_out = _layer_inputs(keys, i, o, b, t=32)
  stored = ops.permute_kernel(kernel, p_in, p_out)
  ct = jax.random.normal(keys(), (32, o))

  def run(x, q_in, q_out, dtype):
    def f(x, q_in, q_out):
      y = ops.poet_linear(x.astype(dtype), stored.astype(dtype), q_in, q_out, p_in,
                          p_out, block_size=b, form=form)
      assert y.dtype == dtype
      return y.astype(jnp.float32)
    y, pull = jax.vjp(f, x, q_in, q_out)
    return y, pull(ct)

  y32, g32 = run(x, q_in, q_out, jnp.float32)
  y16, g16 = run(x, q_in, q_out, jnp.bfloat16)
  assert rel_err(y16, y32) < 2e-2
  for a, r in zip(g16, g32):
    assert rel_err(a, r) < 2e-2


@pytest.mark.slow
def test_poet_kernel_matches_dense(keys):
  """poet_kernel is (R W0 P)^T: in float32 to float32 rounding (the same from
  precomputed blocks), in bf16 to bf16 rounding; the layer multiplies by it."""
  x, kernel, q_in, q_out, p_in, p_out = _layer_inputs(keys, 20, 12, 8)
  stored = ops.permute_kernel(kernel, p_in, p_out)
  eff = ops.poet_kernel(stored, q_in, q_out, p_in, p_out, block_size=8)
  want = _dense_weight(kernel, q_in, q_out, p_in, p_out, 8).T
  assert eff.dtype == jnp.float32 and rel_err(eff, want) < 1e-6
  blocks = ops.rotation_blocks_pair(q_in, q_out, 20, 12, 8)
  np.testing.assert_array_equal(
      ops.poet_kernel(stored, None, None, p_in, p_out, block_size=8, blocks=blocks), eff)
  half = ops.poet_kernel(stored, q_in, q_out, p_in, p_out, block_size=8, dtype=jnp.bfloat16)
  assert half.dtype == jnp.bfloat16 and rel_err(half, want) < 1e-2
  y = ops.poet_linear(x, stored, q_in, q_out, p_in, p_out, block_size=8)
  assert rel_err(x @ eff, y) < 1e-5


@pytest.mark.slow
def test_rotate_weight_rounds_before_its_gathers_with_the_same_values(keys):
  """rotate_weight(dtype=bf16) gathers bf16 (half the bytes) and equals the
  float32 result rounded after its gathers, values and generator gradients."""
  _, kernel, q_in, q_out, p_in, p_out = _layer_inputs(keys, 20, 12, 8)
  ct = jax.random.normal(keys(), (20, 12))

  def f(q_in, q_out, dtype, late):
    g_in, g_out = ops.rotation_blocks_pair(q_in, q_out, 20, 12, 8)
    w = ops.rotate_weight(kernel, g_in, g_out, p_in, p_out, dtype=None if late else dtype)
    return w.astype(dtype) if late else w

  early = f(q_in, q_out, jnp.bfloat16, False)
  assert early.dtype == jnp.bfloat16
  np.testing.assert_array_equal(early, f(q_in, q_out, jnp.bfloat16, True))
  loss = lambda late: lambda a, b: (f(a, b, jnp.bfloat16, late).astype(jnp.float32) * ct).sum()
  for g_early, g_late in zip(jax.grad(loss(False), (0, 1))(q_in, q_out),
                             jax.grad(loss(True), (0, 1))(q_in, q_out)):
    np.testing.assert_array_equal(g_early, g_late)


@pytest.mark.parametrize('rows', [False, True])
def test_unpermute_undoes_permute_and_inverts_once(keys, rows):
  """unpermute(x, p) is x[..., inverse(p)] (rows: x[inverse(p)]), values and
  gradients (to second order) as autodiff of plain indexing gives them, with
  one inversion (a scatter) in the forward and none in the backward; none at
  all given the inverse."""
  perm = ops.random_permutation(keys(), 24)
  inv = jnp.argsort(perm)
  x = jax.random.normal(keys(), (24, 24))
  ct = jax.random.normal(keys(), (24, 24))
  fn, there, ref = ((ops.unpermute_rows, ops.permute_rows, lambda x: x[inv]) if rows else
                    (ops.unpermute, ops.permute, lambda x: x[:, inv]))
  np.testing.assert_array_equal(fn(x, perm), ref(x))
  np.testing.assert_array_equal(fn(there(x, perm), perm), x)
  np.testing.assert_array_equal(jax.vjp(lambda x: fn(x, perm), x)[1](ct)[0],
                                jax.vjp(ref, x)[1](ct)[0])
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: (fn(x, perm) * ct).sum()))(x))
  assert jaxpr.count(' scatter[') == 1
  check_grads(lambda x: fn(x, perm), (x,), order=2, modes=['rev'])
  # the inverse given: no scatter at all, the same values and gradients
  np.testing.assert_array_equal(fn(x, perm, inv), ref(x))
  jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: (fn(x, perm, inv) * ct).sum()))(x))
  assert jaxpr.count(' scatter[') == 0
  check_grads(lambda x: ops.permute(x, perm, inv), (x,), order=2, modes=['rev'])


def test_invert_permutations_at_once(keys):
  perms = [ops.random_permutation(keys(), n) for n in (5, 1, 12, 7)]
  got = ops.invert_permutations(perms)
  for p, inv in zip(perms, got):
    np.testing.assert_array_equal(inv, ops.invert_permutation(p))
  jaxpr = str(jax.make_jaxpr(ops.invert_permutations)(perms))
  assert jaxpr.count(' scatter[') == 1
  assert ops.invert_permutations([]) == []


def test_forms_agree_and_bad_form(keys):
  x, kernel, q_in, q_out, p_in, p_out = _layer_inputs(keys, 40, 24, 8)
  stored = ops.permute_kernel(kernel, p_in, p_out)
  ys = [ops.poet_linear(x, stored, q_in, q_out, p_in, p_out, block_size=8, form=f)
        for f in ops.FORMS]
  assert rel_err(ys[0], ys[1]) < 1e-5
  with pytest.raises(ValueError, match="form must be one of .*'input'.*got 'rows'"):
    ops.poet_linear(x, stored, q_in, q_out, p_in, p_out, block_size=8, form='rows')


def test_check_block_size_errors():
  with pytest.raises(ValueError, match='must be > 1'):
    ops.check_block_size(1, 8, 8)
  with pytest.raises(ValueError, match='larger than the dimension 6'):
    ops.check_block_size(8, 16, 6)
  with pytest.raises(TypeError, match='int'):
    ops.check_block_size(2.0, 8, 8)


@pytest.mark.slow
def test_generator_cap_bounds_the_spectral_norm(keys):
  """generator_bound_sq bounds ||Q||_2^2 from above (exactly for the plane of
  two orthogonal sign vectors, the pattern of a sign-like Adam step);
  cap_generators scales only the blocks over the cap, to at most the cap, and
  keeps the truncated series orthogonal whatever the generators' size."""
  b = 16
  q = 3.0 * unpack_random_skew(keys(), 4, b)
  u, v = jnp.ones(b), jnp.tile(jnp.array([1.0, -1.0]), b // 2)
  q = q.at[0].set(0.01 * (jnp.outer(u, v) - jnp.outer(v, u)))        # one plane
  q = q.at[1].multiply(1e-3)                                          # under the cap
  spectral = np.linalg.norm(np.asarray(q, np.float64), ord=2, axis=(-2, -1))
  bound = np.sqrt(np.asarray(ops.generator_bound_sq(q), np.float64))
  assert np.all(bound >= spectral * (1 - 1e-5))
  assert bound[0] == pytest.approx(spectral[0], rel=1e-4)
  capped = ops.cap_generators(q, 0.5)
  np.testing.assert_array_equal(capped[1], q[1])
  assert np.all(np.linalg.norm(np.asarray(capped, np.float64), ord=2, axis=(-2, -1))
                <= 0.5 * (1 + 1e-5))
  g = ops.cayley_neumann(capped)
  assert float(ops.orthogonality_error(g)) < 0.1 < float(ops.orthogonality_error(
      ops.cayley_neumann(q)))
  # Differentiable everywhere, also at Q = 0 (every block's state after a merge).
  grad = jax.grad(lambda q: jnp.sum(ops.cayley_neumann(ops.cap_generators(q, 0.5)) ** 2))
  for at in (q, jnp.zeros_like(q)):
    assert bool(jnp.all(jnp.isfinite(grad(at))))
  p = ops.skew_size(b)
  q_packed = jax.random.normal(keys(), (3, p))
  np.testing.assert_allclose(  # rotation_blocks caps before the series
      ops.rotation_blocks(q_packed, 40, b, max_norm=0.3),
      ops.cayley_neumann(ops.cap_generators(ops.unpack_skew(
          q_packed * ops.ragged_mask(40, b), b), 0.3)), rtol=1e-6)


def unpack_random_skew(key, k, b):
  return ops.unpack_skew(jax.random.normal(key, (k, ops.skew_size(b))), b)
