"""Chunk permutations (poetx_jax.perms): permutations of aligned runs of
``chunk`` features, a ragged last run kept last.

Their draws are uniform over the run orders; every gather told ``chunk``
moves exactly what the element gather moves (values and gradients, bit for
bit); a layer that draws them trains as one with an element permutation of
the same block partition (float64, several updates and a merge); merges,
ties, ``check_permutations`` and the fused kernels keep the structure.

Widths: 64 (whole runs) and 70 (a ragged last run of 70 % c features, and at
B = 16 a ragged last block of 6); 40 = 16 + 16 + 8.
"""

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from scipy import stats

from conftest import dense_rotation, randomize_generators, rel_err
import poetx_jax
from poetx_jax import POETLinear, ops


def _is_identity(p):
  return bool(np.array_equal(np.asarray(p), np.arange(np.asarray(p).shape[-1])))


def _moving(key, n, c):
  """A chunk permutation of runs of c drawn from key that is not the
  identity (with few runs a draw may be: the next key's is then taken)."""
  for j in range(100):
    p = ops.random_permutation(jax.random.fold_in(key, j), n, c)
    if not _is_identity(p):
      return p
  raise AssertionError('100 identity draws')


def _inverse(p):
  return np.argsort(np.asarray(p)).astype(np.int32)


# ---------------------------------------------------------------------- draws
@pytest.mark.parametrize('chunk', [1, 4, 16])
def test_draws_are_chunk_permutations_with_the_ragged_run_last(keys, chunk):
  sizes = (64, 70, 16, 19)
  key = keys()
  drawn = ops.random_permutations(key, sizes, chunk)
  assert len(drawn) == len(sizes)
  for p, n in zip(drawn, sizes):
    p = np.asarray(p)
    assert p.shape == (n,) and p.dtype == np.int32
    assert ops.is_chunk_permutation(p, chunk), (n, p)
    full = n // chunk * chunk
    np.testing.assert_array_equal(p[full:], np.arange(full, n))  # ragged run stays last
    if n // chunk >= 8:
      assert not _is_identity(p)  # it did move runs (all but surely)
    if chunk > 1:
      # a run of c moves whole: consecutive positions, aligned start
      runs = p[:full].reshape(-1, chunk)
      np.testing.assert_array_equal(runs, runs[:, :1] + np.arange(chunk))
      assert (runs[:, 0] % chunk == 0).all()
  # the single draw is the first of a one-size draw
  np.testing.assert_array_equal(ops.random_permutation(key, 70, chunk),
                                ops.random_permutations(key, (70,), chunk)[0])


def _element_draw_reference(key, sizes):
  """The element draw as documented: 64-bit random keys (two uint32 words
  from one ``jax.random.bits`` call), each size's range ordered by them."""
  total = sum(sizes)
  hi, lo = np.asarray(jax.random.bits(key, (2, total), jnp.uint32))
  out, start = [], 0
  for n in sizes:
    order = np.lexsort((lo[start:start + n], hi[start:start + n]))  # last key primary
    out.append(order.astype(np.int32))
    start += n
  return out


def test_chunk_one_is_the_element_draw_bit_for_bit(keys):
  for sizes in [(64, 70), (70,), (5, 64, 33)]:
    key = keys()
    default = ops.random_permutations(key, sizes)
    one = ops.random_permutations(key, sizes, 1)
    want = _element_draw_reference(key, sizes)
    for d, o, w in zip(default, one, want, strict=True):
      np.testing.assert_array_equal(d, o)
      np.testing.assert_array_equal(d, w)


def test_chunk_draw_permutes_runs_as_the_element_draw_of_the_runs(keys):
  """The run order of a chunk draw is the element draw of N // c items from
  the same key (the docstring's construction), expanded by chunk_permutation."""
  key, sizes = keys(), (64, 70)
  for c in (4, 16):
    runs = ops.random_permutations(key, [n // c for n in sizes])
    for p, r, n in zip(ops.random_permutations(key, sizes, c), runs, sizes):
      np.testing.assert_array_equal(ops.run_index(p, c), r)
      np.testing.assert_array_equal(ops.chunk_permutation(r, n, c), p)


@pytest.mark.parametrize('chunk, extra', [(4, 0), (16, 5)])
def test_run_order_is_uniform(chunk, extra):
  """Over 3000 keys, each of the 3! orders of N = 3 runs (plus a ragged run
  of ``extra`` features) comes up as often as the others: a chi-square test
  at p = 1e-6, and each count within 5 sigma of 500."""
  draws = 3000  # a fixed key: the statistics of one sample, not of the test's seed
  n = 3 * chunk + extra
  draw = jax.jit(jax.vmap(lambda k: ops.random_permutations(k, (n,), chunk)[0]))
  perms = np.asarray(draw(jax.random.split(jax.random.key(1234), draws)))
  assert ops.is_chunk_permutation(perms, chunk)  # every row
  orders = [tuple(row) for row in perms[:, :3 * chunk:chunk] // chunk]
  counts = np.array([orders.count(o) for o in itertools.permutations(range(3))])
  assert counts.sum() == draws  # every draw is one of the six orders
  expected = draws / 6
  sigma = np.sqrt(draws * (1 / 6) * (5 / 6))
  assert (np.abs(counts - expected) < 5 * sigma).all(), counts
  chi2 = float(((counts - expected) ** 2 / expected).sum())
  assert chi2 < stats.chi2.ppf(1 - 1e-6, df=5), (chi2, counts)
  np.testing.assert_array_equal(perms[:, 3 * chunk:], np.arange(3 * chunk, n)[None].repeat(
      draws, 0))


def test_is_chunk_permutation_accepts_and_rejects():
  n, c = 70, 16
  p = np.asarray(ops.chunk_permutation(jnp.array([2, 0, 3, 1]), n, c))
  assert ops.is_chunk_permutation(p, c)
  assert ops.is_chunk_permutation(p, 4) and ops.is_chunk_permutation(p, 8)  # divisors of c
  assert ops.is_chunk_permutation(p, 1)
  assert ops.is_chunk_permutation(np.arange(n), c)
  assert ops.is_chunk_permutation(np.stack([p, np.arange(n)]), c)  # leading axes
  # an element permutation that is not chunked: two features swapped inside a run
  q = p.copy()
  q[[1, 2]] = q[[2, 1]]
  assert ops.is_chunk_permutation(q, 1) and not ops.is_chunk_permutation(q, c)
  assert not ops.is_chunk_permutation(np.stack([p, q]), c)
  # contiguous runs that are not aligned (rotations: by 2, the first run
  # wrapping; by -6, runs 6..21, ..., 54..69 whole and the tail in front)
  assert not ops.is_chunk_permutation(np.roll(np.arange(64), 2), c)
  assert not ops.is_chunk_permutation(np.roll(np.arange(n), -6), c)
  # a non-permutation: a repeated index, and one out of range
  bad = p.copy()
  bad[5] = bad[6]
  assert not ops.is_chunk_permutation(bad, 1) and not ops.is_chunk_permutation(bad, c)
  assert not ops.is_chunk_permutation(np.arange(1, n + 1), 1)
  # a chunked permutation whose ragged tail moved: swapped inside the tail ...
  tail = p.copy()
  tail[[64, 65]] = tail[[65, 64]]
  assert ops.is_chunk_permutation(tail, 1) and not ops.is_chunk_permutation(tail, c)
  # ... or to the front (the runs all whole and aligned to c, shifted by 6)
  front = np.concatenate([np.arange(64, 70), p[:64]])
  assert ops.is_chunk_permutation(front, 1) and not ops.is_chunk_permutation(front, c)
  # a run of 16 is not a run of 32
  assert not ops.is_chunk_permutation(np.asarray(ops.chunk_permutation(
      jnp.array([1, 0, 2, 3]), 64, 16)), 32)


def test_chunk_sizes_are_checked():
  with pytest.raises(ValueError, match='chunk must be an int >= 1.*got 0'):
    ops.random_permutations(jax.random.key(0), (64,), 0)
  with pytest.raises(ValueError, match='need 4 run indices, got 3'):
    ops.chunk_permutation(jnp.arange(3), 64, 16)


# -------------------------------------------------------------------- gathers
# whole and ragged last runs, in both dtypes and both leading shapes
GATHER_CASES = [(64, 16, jnp.float32, (5,)), (64, 4, jnp.bfloat16, (2, 3)),
                (70, 4, jnp.float32, (2, 3)), (70, 16, jnp.bfloat16, (5,))]


def _gathers(chunk):
  """name -> (f(x, p, inv) with ``chunk``, the indexing it must equal)."""
  return {
      'permute': (lambda x, p, inv: ops.permute(x, p, chunk=chunk),
                  lambda x, p: x[..., p]),
      'permute_inv': (lambda x, p, inv: ops.permute(x, p, inv, chunk=chunk),
                      lambda x, p: x[..., p]),
      'unpermute': (lambda x, p, inv: ops.unpermute(x, p, chunk=chunk),
                    lambda x, p: x[..., _inverse(p)]),
      'unpermute_inv': (lambda x, p, inv: ops.unpermute(x, p, inv, chunk=chunk),
                        lambda x, p: x[..., _inverse(p)]),
      'permute_rows': (lambda x, p, inv: ops.permute_rows(x, p, chunk),
                       lambda x, p: x[p]),
      'unpermute_rows': (lambda x, p, inv: ops.unpermute_rows(x, p, chunk=chunk),
                         lambda x, p: x[_inverse(p)]),
      'unpermute_rows_inv': (lambda x, p, inv: ops.unpermute_rows(x, p, inv, chunk=chunk),
                             lambda x, p: x[_inverse(p)]),
  }


def _operand(key, name, lead, n, dtype):
  """x with the permuted axis last (column gathers) or first (row gathers)."""
  shape = (n,) + lead if 'rows' in name else lead + (n,)
  return jax.random.normal(key, shape).astype(dtype)


@pytest.mark.parametrize('n, c, dtype, lead', GATHER_CASES)
def test_gathers_with_chunk_equal_indexing_values_and_gradients(keys, n, c, dtype, lead):
  """Each gather told ``chunk`` gives exactly x indexed by the permutation,
  eagerly and under jit; its gradient is exactly the element gather's
  (chunk = 1) and the true transpose (the cotangent gathered back)."""
  p = _moving(keys(), n, c)
  inv = ops.invert_permutation(p)
  for name, (f, want) in _gathers(c).items():
    f_elem = _gathers(1)[name][0]
    x = _operand(keys(), name, lead, n, dtype)
    y = f(x, p, inv)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(y, want(np.asarray(x), np.asarray(p)), err_msg=name)
    np.testing.assert_array_equal(jax.jit(f)(x, p, inv), y, err_msg=name)
    ct = jax.random.normal(keys(), x.shape).astype(dtype)
    _, pull = jax.vjp(lambda x: f(x, p, inv), x)
    _, pull_elem = jax.vjp(lambda x: f_elem(x, p, inv), x)
    (dx,), (dx_elem,) = pull(ct), pull_elem(ct)
    assert dx.dtype == x.dtype
    np.testing.assert_array_equal(dx, dx_elem, err_msg=name)
    # the transpose of x -> want(x): the cotangent scattered back, by indexing
    back = np.zeros(x.shape, np.float32)
    idx = np.asarray(p) if name.startswith('permute') else _inverse(p)
    if 'rows' in name:
      back[idx] = np.asarray(ct, np.float32)
    else:
      back[..., idx] = np.asarray(ct, np.float32)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), back, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.int8])  # float32: by the gathers above
def test_run_gather_equals_indexing(keys, dtype):
  """Runs moved as words of 2 or 4 bytes (where the run's bytes divide into
  them: int8 runs of 2 and 4 as uint16 / uint32, bf16 runs as uint32) or
  element by element (runs of 3 or 6 int8 or bf16 features, whose bytes
  4-byte words do not divide): x[:, p] either way, a ragged last run
  included."""
  for n, c, word_bytes in [(70, 4, 2), (70, 4, 4), (66, 2, 4), (70, 16, 4), (70, 6, 4),
                           (50, 3, 2)]:
    p = _moving(keys(), n, c)
    if jnp.issubdtype(dtype, jnp.integer):
      x = jax.random.randint(keys(), (5, n), -128, 128).astype(dtype)
    else:
      x = jax.random.normal(keys(), (5, n)).astype(dtype)
    runs = ops.run_index(p, c)
    assert runs.shape == (n // c,)
    y = ops.run_gather(x, runs, c, word_bytes=word_bytes)
    assert y.dtype == x.dtype
    want = np.asarray(x)[:, np.asarray(p)]
    np.testing.assert_array_equal(y, want, err_msg=f'{n} {c} {word_bytes}')
  np.testing.assert_array_equal(ops.run_gather(x[0], runs, c, word_bytes=word_bytes),
                                want[0])  # no leading axes


@pytest.mark.parametrize('n', [64, 70])
def test_gather_between_chunk_permutations_has_the_joint_chunk(keys, n):
  c_out, c_in = 16, 4
  assert ops.joint_chunk(c_out, c_in) == 4 and ops.joint_chunk(16, 8, 12) == 4
  assert ops.joint_chunk(16, 1) == 1
  perm_out, perm_in = _moving(keys(), n, c_out), _moving(keys(), n, c_in)
  c = ops.gather_between(perm_out, perm_in)
  joint = ops.joint_chunk(c_out, c_in)
  assert ops.is_chunk_permutation(c, joint)
  assert not ops.is_chunk_permutation(c, 8)  # finer than the coarser draw
  np.testing.assert_array_equal(c, ops.gather_between(perm_out, perm_in,
                                                      ops.invert_permutation(perm_out)))
  z = jax.random.normal(keys(), (3, 5, n))
  y = ops.unpermute(z, perm_out, chunk=c_out)  # the layer's output
  got = ops.permute(z, c, chunk=joint)
  np.testing.assert_array_equal(got, np.asarray(z)[..., np.asarray(c)])
  np.testing.assert_array_equal(got, np.asarray(y)[..., np.asarray(perm_in)])
  np.testing.assert_array_equal(got, ops.permute(z, c))  # the element gather
  # its inverse, inverse(perm_in)[perm_out], is one too
  back = jnp.take(ops.invert_permutation(perm_in), perm_out)
  assert ops.is_chunk_permutation(back, joint)
  np.testing.assert_array_equal(ops.permute(got, back, chunk=joint), z)


# ------------------------------------------------------- float64 equivalence
I64, O64, B64, T64 = 70, 40, 16, 32


def _blocks64(q, n, b):
  """A side's rotation blocks in q's dtype (float64 here): the ragged mask
  and the series of ops, without rotation_blocks' float32 cast."""
  mask = ops.ragged_mask(n, b)
  return ops.cayley_neumann(ops.unpack_skew(q if mask is None else q * mask, b))


def _relabelling(key, n, b):
  """A random permutation of positions inside each block of b (the ragged
  last block's real positions among themselves): ``perm[sigma]`` has
  the block partition of ``perm``."""
  parts = [s + np.asarray(jax.random.permutation(jax.random.fold_in(key, k), min(b, n - s)))
           for k, s in enumerate(range(0, n, b))]
  return np.concatenate(parts).astype(np.int32)


def _relabel_generators(q, sigma, n, b):
  """The skew blocks of q relabelled, ``Q'_k = S_k Q_k S_k^T`` (entry
  (a, c) of block k from entry (sigma(a), sigma(c))), unpacked."""
  blocks = ops.unpack_skew(q, b)
  k = blocks.shape[0]
  local = np.tile(np.arange(b), (k, 1))
  for j, s in enumerate(range(0, n, b)):
    w = min(b, n - s)
    local[j, :w] = sigma[s:s + w] - s
  return jnp.stack([blocks[j][np.ix_(local[j], local[j])] for j in range(k)])


@pytest.mark.slow
def test_chunk_training_equals_element_training_of_the_same_partition_float64(keys):
  """The issue's claim, end to end in float64: a layer with chunk
  permutations, trained by poetx (Adam) for 5 updates, merged (new chunk
  permutations, W0 <- R W0 P, Q <- 0, the moments restarted) and trained 5
  more, computes what a layer with element permutations of the same block
  partitions (the chunk permutations relabelled inside each block, the base
  folded to match) computes under the same run: effective kernels, outputs
  and generators (relabelled) agree to float64 rounding."""
  i, o, b, t = I64, O64, B64, T64
  chunk = 4  # the ragged last block (features 64..69) holds a whole run and the ragged run
  k_in, k_out = ops.num_blocks(i, b), ops.num_blocks(o, b)
  with jax.enable_x64(True):
    w0 = jax.random.normal(keys(), (i, o), jnp.float64) / np.sqrt(i)
    x = jax.random.normal(keys(), (t, i), jnp.float64)
    target = jax.random.normal(keys(), (t, o), jnp.float64)

    def blocks(q):
      return _blocks64(q['in'], i, b), _blocks64(q['out'], o, b)

    def forward(q, kernel, perm_in, perm_out, c, x):
      return ops.poet_linear(x, kernel, q['in'], q['out'], perm_in, perm_out, block_size=b,
                             blocks=blocks(q), chunk=c)

    def effective(q, kernel, perm_in, perm_out, c):
      return ops.rotate_weight(kernel, *blocks(q), perm_in, perm_out, chunks=(c, c))

    tx = poetx_jax.poetx(5e-3, merge_every=5)  # the moments restart after the 5th update

    @functools.partial(jax.jit, static_argnums=5)
    def step(q, state, kernel, perm_in, perm_out, c):
      loss = lambda q: jnp.mean((forward(q, kernel, perm_in, perm_out, c, x) - target) ** 2)
      updates, state = tx.update(jax.grad(loss)(q), state, q)
      return optax.apply_updates(q, updates), state

    zeros = {'in': jnp.zeros((k_in, ops.skew_size(b)), jnp.float64),
             'out': jnp.zeros((k_out, ops.skew_size(b)), jnp.float64)}
    perms_a = ops.random_permutations(keys(), (i, o), chunk)
    sig = [_relabelling(keys(), i, b), _relabelling(keys(), o, b)]
    perms_b = (perms_a[0][sig[0]], perms_a[1][sig[1]])
    assert not ops.is_chunk_permutation(perms_b[0], chunk)
    assert not ops.is_chunk_permutation(perms_b[1], chunk)
    # name -> [run length, frozen kernel, permutations, generators, optimizer state]
    runs = {'a': [chunk, ops.permute_kernel(w0, *perms_a, chunk), perms_a, zeros,
                  tx.init(zeros)],
            'b': [1, ops.permute_kernel(w0, *perms_b), perms_b, zeros, tx.init(zeros)]}
    for c, kernel, perms, q, _ in runs.values():
      np.testing.assert_allclose(effective(q, kernel, *perms, c), w0, rtol=0, atol=1e-15)

    def train(name, updates):
      c, kernel, perms, q, state = runs[name]
      for _ in range(updates):
        q, state = step(q, state, kernel, *perms, c)
      runs[name][3:] = [q, state]

    def check(stage):
      ea = effective(runs['a'][3], runs['a'][1], *runs['a'][2], chunk)
      eb = effective(runs['b'][3], runs['b'][1], *runs['b'][2], 1)
      assert ea.dtype == jnp.float64
      assert rel_err(ea, w0) > 1e-2, stage  # training moved the kernel
      assert float(jnp.linalg.norm(ea - eb) / jnp.linalg.norm(ea)) < 1e-12, stage
      ya = forward(runs['a'][3], runs['a'][1], *runs['a'][2], chunk, x)
      yb = forward(runs['b'][3], runs['b'][1], *runs['b'][2], 1, x)
      assert float(jnp.linalg.norm(ya - yb) / jnp.linalg.norm(ya)) < 1e-12, stage
      assert float(jnp.linalg.norm(ya - x @ ea) / jnp.linalg.norm(ya)) < 1e-12, stage
      for side, n, s in (('in', i, sig[0]), ('out', o, sig[1])):
        got = ops.unpack_skew(runs['b'][3][side], b)
        want = _relabel_generators(runs['a'][3][side], s, n, b)
        assert float(jnp.abs(got).max()) > 1e-3
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-12, (stage, side)
      return ea

    train('a', 5)
    train('b', 5)
    merged = check('before the merge')
    # The merge: A draws new chunk permutations, B takes them relabelled
    # inside its blocks (by new relabellings).
    new_a = ops.random_permutations(keys(), (i, o), chunk)
    sig[:] = [_relabelling(keys(), i, b), _relabelling(keys(), o, b)]
    new_b = (new_a[0][sig[0]], new_a[1][sig[1]])
    for name, perms in (('a', new_a), ('b', new_b)):
      c, kernel, old, q, state = runs[name]
      eff = effective(q, kernel, *old, c)
      runs[name][1:4] = [ops.permute_kernel(eff, *perms, c), perms, zeros]
      # the merged layer computes the merged function
      np.testing.assert_allclose(effective(zeros, runs[name][1], *perms, c), eff,
                                 rtol=0, atol=1e-14)
    train('a', 5)
    train('b', 5)
    after = check('after the merge')
    assert rel_err(after, merged) > 1e-3  # the second cycle trained too


# --------------------------------------------------------------------- layers
def _naive(layer, x):
  """x @ (R W0 P)^T + b from dense matrices: the permutations as dense
  permutation matrices (no gathers of runs), the base unfolded by element
  gathers."""
  i, o, b = layer.in_features, layer.out_features, layer.block_size
  p = dense_rotation(layer.q_in[...], layer.perm_in[...], i, block_size=b)
  r = dense_rotation(layer.q_out[...], layer.perm_out[...], o, block_size=b)
  w0 = ops.permute_kernel(layer.kernel[...].astype(jnp.float32),
                          ops.invert_permutation(layer.perm_in[...]),
                          ops.invert_permutation(layer.perm_out[...])).T
  y = x.astype(jnp.float32) @ (r @ w0 @ p).T
  return y + layer.bias[...] if layer.bias is not None else y


def _chunk_layer(keys, i, o, b, c, *, dtype=None, **kw):
  layer = POETLinear(i, o, block_size=b, permutation='chunk', chunk_size=c, dtype=dtype,
                     rngs=nnx.Rngs(int(jax.random.randint(keys(), (), 0, 2 ** 30))),
                     bias_init=nnx.initializers.normal(1.0), **kw)
  randomize_generators(layer, keys())
  return layer


def _as_element(layer):
  """A copy of ``layer`` that gathers element by element: the same
  permutations, base and generators, ``permutation='element'``."""
  other = nnx.clone(layer)
  other.permutation = 'element'
  assert other.chunk == 1 and layer.chunk > 1
  return other


@pytest.mark.slow
@pytest.mark.parametrize('c, form, mode', [(4, 'input', 'fast'), (4, 'weight', 'mem'),
                                           (8, 'input', 'mem'), (8, 'weight', 'fast')])
def test_chunk_layer_is_the_dense_formula_and_the_element_path(keys, c, form, mode):
  """in = 70 (a ragged last block of 6 and last run of 70 % c), out = 40
  (a ragged block of 8), B = 16: the forward is x @ effective_kernel + b and
  the dense formula, and bit for bit that of the same layer gathering
  element by element; value and gradients (generators, bias, x) equal
  that layer's to float32 rounding (whose gradients test_linear checks
  against the dense formula's)."""
  i, o, b = 70, 40, 16
  layer = _chunk_layer(keys, i, o, b, c, mode=mode, form=form)
  assert layer.chunk == c and layer.permutation == 'chunk'
  assert all(ops.is_chunk_permutation(p, c) for p in (layer.perm_in[...], layer.perm_out[...]))
  assert not _is_identity(layer.perm_in[...])  # 70 // c >= 8 runs: all but surely
  x = jax.random.normal(keys(), (3, 7, i))
  y = layer(x)
  assert rel_err(y, x @ layer.effective_kernel() + layer.bias[...]) < 1e-5
  assert rel_err(y, _naive(layer, x)) < 1e-5
  ct = jax.random.normal(keys(), y.shape)

  def loss(m, x):
    return jnp.sum(m(x) * ct)

  elem = _as_element(layer)
  np.testing.assert_array_equal(elem(x), y)  # the gathers move the same values
  # compiled, the two programs may sum in other orders: float32 rounding
  grad = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))
  got, want = grad(layer, x), grad(elem, x)
  assert rel_err(got[0], want[0]) < 1e-5  # a sum of cancelling terms
  for name in ('q_in', 'q_out', 'bias'):
    assert float(jnp.abs(got[1][0][name][...]).max()) > 0
    assert rel_err(got[1][0][name][...], want[1][0][name][...]) < 1e-5, name
  assert rel_err(got[1][1], want[1][1]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize('c, form', [(4, 'input'), (8, 'weight')])
def test_chunk_layer_bf16(keys, c, form):
  i, o, b = 70, 40, 16
  layer = _chunk_layer(keys, i, o, b, c, form=form, dtype=jnp.bfloat16,
                       param_dtype=jnp.bfloat16)
  x = jax.random.normal(keys(), (24, i)).astype(jnp.bfloat16)
  y = layer(x)
  assert y.dtype == jnp.bfloat16
  eff = layer.effective_kernel()
  assert rel_err(y, x.astype(jnp.float32) @ eff + layer.bias[...].astype(jnp.float32)) < 2e-2
  ct = jax.random.normal(keys(), y.shape)
  loss = lambda m: jnp.sum(m(x).astype(jnp.float32) * ct)
  np.testing.assert_array_equal(_as_element(layer)(x), y)
  grad = nnx.jit(nnx.grad(loss))  # compiled: the two programs may sum in other orders
  got, want = grad(layer), grad(_as_element(layer))
  for name in ('q_in', 'q_out'):
    assert rel_err(got[name][...], want[name][...]) < 1e-3, name


@pytest.mark.slow
def test_chunk_layer_from_linear_starts_at_its_base_and_draws_chunks(keys):
  lin = nnx.Linear(70, 40, rngs=nnx.Rngs(0), bias_init=nnx.initializers.normal(1.0))
  layer = POETLinear.from_linear(lin, block_size=16, rngs=nnx.Rngs(1), permutation='chunk',
                                 chunk_size=8)
  x = jax.random.normal(keys(), (4, 70))
  assert rel_err(layer(x), lin(x)) < 1e-6
  np.testing.assert_array_equal(layer.effective_kernel(), lin.kernel[...])
  drawn = layer.draw_permutations(keys())
  assert all(ops.is_chunk_permutation(p, 8) for p in drawn)
  assert [p.shape for p in drawn] == [(70,), (40,)]
  # the element layer draws element permutations (from the same rngs: other ones)
  elem = POETLinear.from_linear(lin, block_size=16, rngs=nnx.Rngs(1), chunk_size=8)
  assert elem.chunk == 1 and not ops.is_chunk_permutation(elem.perm_in[...], 8)


def test_chunk_layer_arguments_are_checked():
  rngs = nnx.Rngs(0)
  with pytest.raises(ValueError, match=r'chunk_size=6 must divide the block size 16.*'
                                       r'\[1, 2, 4, 8, 16\]'):
    POETLinear(32, 32, block_size=16, permutation='chunk', chunk_size=6, rngs=rngs)
  with pytest.raises(ValueError, match=r'chunk_size=32 must divide the block size 16'):
    POETLinear(32, 32, block_size=16, permutation='chunk', chunk_size=32, rngs=rngs)
  with pytest.raises(ValueError, match=r"permutation must be one of \('element', 'chunk'\), "
                                       r"got 'bogus'"):
    POETLinear(32, 32, block_size=16, permutation='bogus', rngs=rngs)
  for bad in (0, -4, 2.0, True):
    with pytest.raises(ValueError, match=f'chunk_size must be an int >= 1.*got {bad!r}'):
      POETLinear(32, 32, block_size=16, permutation='chunk', chunk_size=bad, rngs=rngs)
  # an element layer does not use chunk_size: any is accepted
  assert POETLinear(32, 32, block_size=16, chunk_size=6, rngs=rngs).chunk == 1
  with pytest.raises(ValueError, match='chunk must be an int or a pair'):
    ops.poet_linear(jnp.ones((2, 32)), jnp.ones((32, 32)), jnp.zeros((2, 120)),
                    jnp.zeros((2, 120)), jnp.arange(32), jnp.arange(32), block_size=16,
                    chunk=(4, 4, 4))


def test_chunk_pair_per_side(keys):
  """poet_linear's chunk as a pair (input side, output side): each side's
  gathers take their own run length."""
  i, o, b = 70, 48, 16
  kernel = jax.random.normal(keys(), (i, o))
  q_in = 0.05 * jax.random.normal(keys(), (ops.num_blocks(i, b), ops.skew_size(b)))
  q_out = 0.05 * jax.random.normal(keys(), (ops.num_blocks(o, b), ops.skew_size(b)))
  p_in, p_out = _moving(keys(), i, 4), _moving(keys(), o, 16)
  x = jax.random.normal(keys(), (5, i))
  args = (x, kernel, q_in, q_out, p_in, p_out)
  for form in ('input', 'weight'):
    want = ops.poet_linear(*args, block_size=b, form=form)
    np.testing.assert_array_equal(ops.poet_linear(*args, block_size=b, form=form,
                                                  chunk=(4, 16)), want)
  np.testing.assert_array_equal(
      ops.poet_kernel(kernel, q_in, q_out, p_in, p_out, block_size=b, chunk=(4, 16)),
      ops.poet_kernel(kernel, q_in, q_out, p_in, p_out, block_size=b))
  np.testing.assert_array_equal(ops.permute_kernel(kernel, p_in, p_out, (4, 16)),
                                np.asarray(kernel)[np.asarray(p_in)][:, np.asarray(p_out)])


@pytest.mark.slow
def test_chunk_layer_trains_as_its_relabelled_element_layer_across_merge_layer(keys):
  """The layers themselves (float32): a chunk layer and an element layer
  holding its permutations relabelled inside each block (the base folded to
  match), 4 poetx updates, merge_layer with given permutations (new chunk
  ones, and those relabelled), 4 more: the same effective kernel to float32
  rounding."""
  i, o, b, c = 70, 40, 16, 8  # the ragged last block (6) is the ragged last run
  a = POETLinear(i, o, block_size=b, permutation='chunk', chunk_size=c, use_bias=False,
                 rngs=nnx.Rngs(int(jax.random.randint(keys(), (), 0, 2 ** 30))))
  w0 = a.effective_kernel()
  sig = (_relabelling(keys(), i, b), _relabelling(keys(), o, b))
  el = POETLinear(i, o, block_size=b, permutation='element', use_bias=False,
                  rngs=nnx.Rngs(0))
  el.perm_in[...], el.perm_out[...] = a.perm_in[...][sig[0]], a.perm_out[...][sig[1]]
  el.kernel[...] = a.kernel[...][sig[0]][:, sig[1]]
  assert not ops.is_chunk_permutation(el.perm_in[...], c)
  np.testing.assert_array_equal(el.effective_kernel(), w0)
  x = jax.random.normal(keys(), (32, i))
  target = jax.random.normal(keys(), (32, o))
  tx = poetx_jax.poetx(5e-3, merge_every=4)
  opts = {id(m): nnx.Optimizer(m, tx, wrt=poetx_jax.POETParam) for m in (a, el)}

  @nnx.jit
  def step(m, opt):
    grads = nnx.grad(lambda m: jnp.mean((m(x) - target) ** 2))(m)
    opt.update(m, grads)

  def train(updates):
    for m in (a, el):
      for _ in range(updates):
        step(m, opts[id(m)])

  train(4)
  before = a.effective_kernel()
  assert rel_err(before, w0) > 1e-2
  assert rel_err(el.effective_kernel(), before) < 1e-5
  new_in, new_out = a.draw_permutations(keys())
  sig = (_relabelling(keys(), i, b), _relabelling(keys(), o, b))
  poetx_jax.merge_layer(a, keys(), new_in, new_out)
  poetx_jax.merge_layer(el, keys(), new_in[sig[0]], new_out[sig[1]])
  np.testing.assert_array_equal(a.perm_in[...], new_in)
  assert ops.is_chunk_permutation(a.perm_in[...], c)
  assert not bool(jnp.any(a.q_in[...]))
  assert rel_err(a.effective_kernel(), before) < 1e-6
  train(4)
  after = a.effective_kernel()
  assert rel_err(after, before) > 1e-2
  assert rel_err(el.effective_kernel(), after) < 1e-5
  y = a(x)
  assert rel_err(el(x), y) < 1e-5 and rel_err(y, x @ after) < 1e-5


# --------------------------------------------------------------- merge, ties
class _Tied(nnx.Module):
  """Three POET layers; a and b read the same input (a tied group)."""

  def __init__(self, make):
    self.a, self.b, self.c = make(0, 70, 48), make(1, 70, 48), make(2, 48, 40)

  def __call__(self, x):
    return self.c(jax.nn.gelu(self.a(x) * self.b(x)))

  def permutation_ties(self):
    return [[(self.a, 'in'), (self.b, 'in')], [(self.a, 'out'), (self.b, 'out')]]


def _layer_maker(permutation=('chunk', 'chunk', 'chunk'), chunk_size=(8, 8, 8), b=16):
  def make(j, i, o):
    return POETLinear(i, o, block_size=b, permutation=permutation[j], chunk_size=chunk_size[j],
                      rngs=nnx.Rngs(10 + j), bias_init=nnx.initializers.normal(0.5))
  return make


def _randomize_all(model, key):
  for j, (_, layer) in enumerate(poetx_jax.poet_layers(model)):
    randomize_generators(layer, jax.random.fold_in(key, j), 0.05)


@pytest.mark.slow
def test_merge_keeps_chunk_permutations_and_the_function(keys):
  """poetx_jax.merge of chunk layers (single layers and a stack): new chunk
  permutations of each layer's run length, the same function, Q = 0."""
  mlp = nnx.Sequential(nnx.Linear(70, 48, rngs=nnx.Rngs(0)), jax.nn.gelu,
                       nnx.Linear(48, 40, rngs=nnx.Rngs(1)))
  stack = nnx.Linear(48, 40, rngs=nnx.Rngs(2))
  stack.kernel = nnx.Param(jax.random.normal(keys(), (3, 48, 40)) / 7)
  stack.bias = nnx.Param(jnp.zeros((3, 40)))
  model = poetx_jax.poetize(nnx.Dict(mlp=mlp, stack=stack), block_size=16,
                            rngs=nnx.Rngs(3), permutation='chunk', chunk_size=8)
  layers = poetx_jax.poet_layers(model)
  assert len(layers) == 3 and model['stack'].stack_shape == (3,)
  for _, layer in layers:
    assert layer.chunk == 8
    assert ops.is_chunk_permutation(layer.perm_in[...], 8)
    assert ops.is_chunk_permutation(layer.perm_out[...], 8)
  for j, (_, layer) in enumerate(layers):
    k1, k2 = jax.random.split(jax.random.fold_in(keys(), j))
    layer.q_in[...] = 0.05 * jax.random.normal(k1, layer.q_in.shape)
    layer.q_out[...] = 0.05 * jax.random.normal(k2, layer.q_out.shape)
  x = jax.random.normal(keys(), (6, 70))
  y = model['mlp'](x)
  stack_before = np.asarray(poetx_jax.effective_kernel(model['stack']))
  old = [(np.asarray(l.perm_in[...]), np.asarray(l.perm_out[...])) for _, l in layers]
  error = poetx_jax.merge(model, rngs=keys())
  assert float(error) < 0.05
  assert rel_err(model['mlp'](x), y) < 1e-5
  assert rel_err(poetx_jax.effective_kernel(model['stack']), stack_before) < 1e-5
  changed = 0
  for (_, layer), (p_in, p_out) in zip(layers, old):
    assert ops.is_chunk_permutation(layer.perm_in[...], 8)
    assert ops.is_chunk_permutation(layer.perm_out[...], 8)
    changed += (not np.array_equal(layer.perm_in[...], p_in)) + (
        not np.array_equal(layer.perm_out[...], p_out))
    assert not bool(jnp.any(layer.q_in[...])) and not bool(jnp.any(layer.q_out[...]))
  assert changed >= 4  # new draws (a side of 5 or 6 runs may draw its old order again)
  # the stack's layers drew their own permutations
  s = np.asarray(model['stack'].perm_in[...])
  assert not (np.array_equal(s[0], s[1]) and np.array_equal(s[1], s[2]))
  poetx_jax.check_permutations(model)


@pytest.mark.slow
def test_tie_permutations_refuses_mixed_draws(keys):
  """A group mixing element and chunk layers, or chunk layers of two run
  lengths, is refused before anything changes."""
  for permutation, chunk_size, lengths in [(('element', 'chunk', 'chunk'), (8, 8, 8), r'1, 8'),
                                           (('chunk', 'chunk', 'chunk'), (8, 4, 8), r'4, 8')]:
    m = _Tied(_layer_maker(permutation, chunk_size))
    before = nnx.to_pure_dict(nnx.state(m))
    with pytest.raises(ValueError, match=f'draw their permutations alike.*run lengths '
                                         f'\\[{lengths}\\]'):
      poetx_jax.tie_permutations(m)
    chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(m)), before)
    assert m.a.tie_in is None and m.b.tie_in is None


@pytest.mark.slow
def test_tied_chunk_layers_share_one_chunk_permutation_across_merges(keys):
  m = _Tied(_layer_maker())
  x = jax.random.normal(keys(), (6, 70))
  y = m(x)
  poetx_jax.tie_permutations(m)
  assert rel_err(m(x), y) < 1e-6
  for side in ('perm_in', 'perm_out'):
    np.testing.assert_array_equal(getattr(m.a, side)[...], getattr(m.b, side)[...])
  _randomize_all(m, keys())
  y = m(x)
  for _ in range(2):
    old = np.asarray(m.a.perm_in[...])
    poetx_jax.merge(m, rngs=keys())
    assert rel_err(m(x), y) < 1e-5
    for side in ('perm_in', 'perm_out'):
      pa, pb = getattr(m.a, side)[...], getattr(m.b, side)[...]
      np.testing.assert_array_equal(pa, pb)
      assert ops.is_chunk_permutation(pa, 8)
    assert not np.array_equal(m.a.perm_in[...], old)  # 8 runs: a new draw, all but surely
    _randomize_all(m, keys())
    y = m(x)
  poetx_jax.check_permutations(m)


@pytest.mark.slow
@pytest.mark.parametrize('chunks', [(16, 16, 4), (8, 8, 16)])
def test_swiglu_join_of_chunk_layers(keys, chunks):
  """The SwiGLU join gathers the gate and up outputs straight into down's
  input order by gather_between, with joint_chunk runs: the plain formula."""
  lin = lambda i, o, s: nnx.Linear(i, o, use_bias=False, rngs=nnx.Rngs(s))
  mlp = {'gate': lin(64, 96, 0), 'up': lin(64, 96, 1), 'down': lin(96, 64, 2)}
  poet = {}
  for name, c in zip(('gate', 'up', 'down'), chunks):
    kw = {'permutation': 'chunk', 'chunk_size': c} if c > 1 else {}
    poet[name] = POETLinear.from_linear(mlp[name], block_size=16, rngs=nnx.Rngs(5), **kw)
    randomize_generators(poet[name], keys(), 0.05)
  x = jax.random.normal(keys(), (2, 5, 64))
  want = nnx.jit(lambda g, u, d: d(jax.nn.silu(g(x)) * u(x)))(
      poet['gate'], poet['up'], poet['down'])
  got = nnx.jit(lambda g, u, d: poetx_jax.swiglu(g, u, d, x))(
      poet['gate'], poet['up'], poet['down'])
  assert rel_err(got, want) < 1e-6


# ------------------------------------------------------------ check_permutations
def test_check_permutations_names_the_layer_with_an_element_permutation(keys):
  model = poetx_jax.poetize(
      nnx.Sequential(nnx.Linear(70, 48, rngs=nnx.Rngs(0)), nnx.Linear(48, 40, rngs=nnx.Rngs(1))),
      block_size=16, rngs=nnx.Rngs(2), permutation='chunk', chunk_size=8)
  poetx_jax.check_permutations(model)
  layer = model.layers[1]
  elem = ops.random_permutation(keys(), 48)
  assert not ops.is_chunk_permutation(elem, 8)
  saved = layer.perm_in[...]
  layer.perm_in[...] = elem
  with pytest.raises(ValueError, match=r"POET layer 'layers/1': its perm_in is not a chunk "
                                       r"permutation of runs of 8 features.*"
                                       r"permutation='chunk', chunk_size=8"):
    poetx_jax.check_permutations(model)
  layer.perm_in[...] = saved
  poetx_jax.check_permutations(model)
  # a chunk permutation of a finer run length is not this layer's draw either
  layer.perm_out[...] = ops.chunk_permutation(jnp.arange(10)[::-1], 40, 4)
  with pytest.raises(ValueError, match=r"'layers/1': its perm_out is not a chunk permutation"):
    poetx_jax.check_permutations(model)
  # element layers: any permutation passes, a non-permutation does not
  elem_model = poetx_jax.poetize(nnx.Sequential(nnx.Linear(70, 48, rngs=nnx.Rngs(0))),
                                 block_size=16, rngs=nnx.Rngs(2))
  elem_model.layers[0].perm_in[...] = ops.random_permutation(keys(), 70)
  poetx_jax.check_permutations(elem_model)
  elem_model.layers[0].perm_in[...] = jnp.zeros(70, jnp.int32)
  with pytest.raises(ValueError, match=r"'layers/0': its perm_in is not a permutation of its "
                                       r"features"):
    poetx_jax.check_permutations(elem_model)


# ------------------------------------------------------------- fused kernels
INTERPRET = jax.default_backend() != 'gpu'
HIGHEST = jax.lax.Precision.HIGHEST
FUSED_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}  # as tests/test_pallas_fused.py
# (N, chunk) at B = 32: whole runs and a ragged last run (88 % 16 = 8, 84 % 8 = 4),
# a ragged last block (88 and 84: 24 and 20 of 32 columns)
FUSED_CASES = [(96, 16, jnp.float32), (88, 16, jnp.bfloat16), (84, 8, jnp.float32)]


def _fused():
  return (pytest.importorskip('pallas_kernels.fused_rotate'),
          pytest.importorskip('pallas_kernels.fused_reference'))


def _fused_inputs(keys, t, n, b, c):
  x = jax.random.normal(keys(), (t, n))
  g = jnp.eye(b) + jax.random.normal(keys(), (-(-n // b), b, b)) / np.sqrt(b)
  return x, g, _moving(keys(), n, c)


def _fused_close(got, want, dtype):
  got = jnp.asarray(got, jnp.float32)
  assert got.shape == want.shape and np.isfinite(np.asarray(got)).all()
  assert rel_err(got, want) < FUSED_TOL[dtype], rel_err(got, want)


def _values_and_grads(f, x, g, ct):
  """f(x, g) and the gradients of sum(f * ct) in x and g."""
  y, pull = jax.vjp(f, x, g)
  return y, pull(ct.astype(y.dtype))


@pytest.mark.slow
@pytest.mark.parametrize('n, c, dtype', FUSED_CASES)
def test_fused_kernels_with_chunk_match_the_references(keys, n, c, dtype):
  """permute_rotate and rotate_unpermute told ``chunk`` (the kernels read one
  index per run): values and gradients (x and g) match the jnp references
  with that chunk and plain indexing; the values equal the same kernel's
  reading the element index (chunk 1) bit for bit. T = 24 (part of one
  token tile)."""
  fr, fref = _fused()
  t, b = 24, 32
  x, g, p = _fused_inputs(keys, t, n, b, c)
  ct = jax.random.normal(keys(), (t, n))
  xd = x.astype(dtype)
  sides = {
      'permute_rotate': (
          lambda c_: lambda x, g: fr.permute_rotate(x, p, g, interpret=INTERPRET, chunk=c_),
          lambda x, g: fref.permute_rotate_reference(x, p, g, HIGHEST, chunk=c),
          lambda x, g: ops.rotate_features(x[:, p], g, precision=HIGHEST)),
      'rotate_unpermute': (
          lambda c_: lambda w, g: fr.rotate_unpermute(w, g, p, interpret=INTERPRET, chunk=c_),
          lambda w, g: fref.rotate_unpermute_reference(w, g, p, HIGHEST, chunk=c),
          lambda w, g: ops.rotate_features(w, g, precision=HIGHEST)[:, _inverse(p)]),
  }
  for name, (kernel, reference, plain) in sides.items():
    y, (dx, dg) = _values_and_grads(kernel(c), xd, g, ct)
    assert y.dtype == dtype and dx.dtype == dtype and dg.dtype == g.dtype, name
    for want_fn in (reference, plain):
      y_ref, (dx_ref, dg_ref) = _values_and_grads(want_fn, x, g, ct)
      _fused_close(y, y_ref, dtype)
      _fused_close(dx, dx_ref, dtype)
      _fused_close(dg, dg_ref, dtype)
    np.testing.assert_array_equal(y, kernel(1)(xd, g), err_msg=name)


@pytest.mark.parametrize('n, c, which', [(88, 16, 'a'), (96, 8, 'b'), (84, 8, 'both')])
def test_fused_block_gram_with_chunk_matches_the_reference(keys, n, c, which):
  fr, fref = _fused()
  t, b = 40, 32
  a, _, p = _fused_inputs(keys, t, n, b, c)
  bb = jax.random.normal(keys(), (t, n)).astype(jnp.bfloat16)
  a = a.astype(jnp.bfloat16)
  q = _moving(keys(), n, c)
  a_src = p if which in ('a', 'both') else None
  b_src = q if which in ('b', 'both') else None
  dg = fr.block_gram(a, bb, block_size=b, a_src=a_src, b_src=b_src, interpret=INTERPRET,
                     chunk=c)
  assert dg.shape == (-(-n // b), b, b) and dg.dtype == jnp.float32
  a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(bb, jnp.float32)
  _fused_close(dg, fref.block_gram_reference(a32, b32, b, a_src, b_src, chunk=c), jnp.float32)
  plain = fref.block_gram_reference(a32 if a_src is None else a32[:, a_src],
                                    b32 if b_src is None else b32[:, b_src], b)
  _fused_close(dg, plain, jnp.float32)
  np.testing.assert_array_equal(dg, fr.block_gram(a, bb, block_size=b, a_src=a_src,
                                                  b_src=b_src, interpret=INTERPRET))


@pytest.mark.parametrize('n, c', [(88, 16), (84, 8)])
def test_run_table(n, c):
  fr, _ = _fused()
  p = ops.chunk_permutation(jnp.arange(n // c)[::-1], n, c)
  table = np.asarray(fr.run_table(p, c))
  assert table.shape == (-(-n // c),)
  np.testing.assert_array_equal(table[:n // c], np.arange(n // c)[::-1])
  assert table[-1] == n // c  # the ragged run stays last
  cols = np.arange(n)
  np.testing.assert_array_equal(table[cols // c] * c + cols % c, p)


@pytest.mark.slow
def test_fused_chunk_layer_matches_xla(keys, monkeypatch):
  """POETLinear(implementation='fused') with chunk permutations (bf16, the
  kernels interpreted on CPUs) computes what the XLA path computes: outputs
  and generator gradients; both sides ran on the kernels, told the chunk."""
  fr, _ = _fused()
  calls = []
  for name in ('permute_rotate', 'rotate_unpermute'):
    def counted(*args, _f=getattr(fr, name), _name=name, **kw):
      calls.append((_name, kw.get('chunk')))
      return _f(*args, **kw)
    monkeypatch.setattr(fr, name, counted)
  i, o, b = 88, 64, 32
  layer = POETLinear(i, o, block_size=b, permutation='chunk', chunk_size=8,
                     implementation='fused', dtype=jnp.bfloat16, use_bias=False,
                     rngs=nnx.Rngs(4))
  randomize_generators(layer, keys(), 0.1)
  xla = nnx.clone(layer)
  xla.implementation = 'xla'
  x = jax.random.normal(keys(), (24, i)).astype(jnp.bfloat16)
  ct = jax.random.normal(keys(), (24, o))
  def loss(m):
    y = m(x)
    return jnp.sum(y.astype(jnp.float32) * ct), y
  (_, y), got = nnx.value_and_grad(loss, has_aux=True)(layer)
  (_, y_xla), want = nnx.value_and_grad(loss, has_aux=True)(xla)
  assert rel_err(y, y_xla) < 1e-2
  for name in ('q_in', 'q_out'):
    assert rel_err(got[name][...], want[name][...]) < 2e-2, name
  assert {('permute_rotate', 8), ('rotate_unpermute', 8)} <= set(calls), calls
