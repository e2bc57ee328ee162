"""A24 tensor_attention (jaxsoft/attention/_tensor.py).

Oracles: numpy float64 from the paper's formula (explicit loops over key pairs), standard
attention for the reduction (``key2 = value2 = 1``), and float64 finite differences. The
polynomial (bounded-entry) implementation: the same pair loops with the stated error bound
``2 eps / (1 - eps) max|v1 v2|``, ``eps = e^B B^(g+1) / (g+1)!`` (B the largest |logit|,
measured in numpy), and jaxsoft.linear.taylor_linear_attention (another package's Taylor
features) for the reduction ``key2 = value2 = 1``.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import dot_product_attention, tensor_attention
from jaxsoft.linear import taylor_linear_attention
from tests.helpers import check_raises, normal

B, T, N, H = 2, 6, 2, 4


def _np_tensor(q, k1, k2, v1, v2, causal):
  q, k1, k2, v1, v2 = (np.asarray(a, np.float64) for a in (q, k1, k2, v1, v2))
  H = q.shape[-1]
  S = k1.shape[1]
  out = np.zeros(q.shape[:3] + (v1.shape[-1],))
  for b, i, n in np.ndindex(*q.shape[:3]):
    logits, vals = [], []
    for j in range(S):
      for k in range(S):
        if causal and (j > i or k > i):
          continue
        logits.append(np.sum(q[b, i, n] * k1[b, j, n] * k2[b, k, n]) / np.sqrt(H))
        vals.append(v1[b, j, n] * v2[b, k, n])
    w = np.exp(np.array(logits) - max(logits))
    out[b, i, n] = (w / w.sum()) @ np.array(vals)
  return out


def test_tensor_attention_matches_pair_loops_and_reduces_to_attention():
  args = [normal(i, (B, T, N, H)) for i in range(5)]
  for causal in (False, True):
    out = jax.jit(functools.partial(tensor_attention, is_causal=causal))(*args)
    np.testing.assert_allclose(np.asarray(out, np.float64), _np_tensor(*args, causal),
                               atol=1e-5, rtol=1e-5)
  q, k1, _, v1, _ = args
  ones = jnp.ones_like(k1)
  out = jax.jit(functools.partial(tensor_attention, is_causal=True))(q, k1, ones, v1, ones)
  chex.assert_trees_all_close(out, jax.jit(functools.partial(
      dot_product_attention, is_causal=True))(q, k1, v1), atol=1e-5, rtol=1e-5)
  lo = jax.jit(tensor_attention)(*(a.astype(jnp.bfloat16) for a in args))
  assert lo.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(lo, np.float64), _np_tensor(
      *(a.astype(jnp.bfloat16).astype(jnp.float32) for a in args), False), atol=3e-2, rtol=3e-2)


def test_tensor_attention_gradients_finite_differences():
  with jax.enable_x64(True):
    args = [normal(i, (1, 3, 1, 2)).astype(jnp.float64) for i in range(5)]
    jax.test_util.check_grads(jax.jit(functools.partial(tensor_attention, is_causal=True)),
                              args, order=1, modes=("rev",))


def test_errors_name_the_argument():
  q = jnp.zeros((1, 4, 1, 2))
  poly = functools.partial(tensor_attention, implementation="polynomial")
  check_raises(
      ("`key2`", lambda: tensor_attention(q, q, q[:, :3], q, q)),
      ("`value2`", lambda: tensor_attention(q, q, q, q, q[..., :1])),
      ("`query`", lambda: tensor_attention(q[0], q, q, q, q)),
      ("`implementation`", lambda: tensor_attention(q, q, q, q, q, implementation="fast")),
      ("`degree`", lambda: poly(q, q, q, q, q)),
      ("`degree`", lambda: poly(q, q, q, q, q, degree=-1)),
      ("`degree`", lambda: poly(q, q, q, q, q, degree=2.0)),
      ("`degree`", lambda: poly(q, q, q, q, q, degree=True)),
      ("`degree`", lambda: tensor_attention(q, q, q, q, q, degree=2)),
      ("`key2`", lambda: poly(q, q, q[:, :3], q, q, degree=2)),
  )


def _bounded(seed, shape, b):
  """Entries uniform in [-b, b] (float64)."""
  return jax.random.uniform(jax.random.key(seed), shape, jnp.float64, -b, b)


def _logit_bound(q, k1, k2):
  """B = max |l_i,(j,k)| over all triples, in numpy float64."""
  q, k1, k2 = (np.asarray(a, np.float64) for a in (q, k1, k2))
  return np.max(np.abs(np.einsum("binh,bjnh,bknh->bnijk", q, k1, k2))) / np.sqrt(q.shape[-1])


def _bound(B, g, v1, v2):
  """The docstring's bound 2 eps / (1 - eps) max|v1_jh v2_kh|, eps = e^B B^(g+1) / (g+1)!."""
  eps = math.exp(B) * B ** (g + 1) / math.factorial(g + 1)
  assert eps < 1
  vmax = np.max(np.abs(np.asarray(v1))) * np.max(np.abs(np.asarray(v2)))
  return 2 * eps / (1 - eps) * vmax


def test_polynomial_within_the_bound_and_error_falls_with_degree():
  # float64, so rounding (~1e-15) is far below the smallest bound used (degree 6: ~1e-6)
  degrees = (0, 2, 4, 6)

  @jax.jit
  def all_degrees(*args):  # one program: every degree, non-causal and causal
    return [[tensor_attention(*args, is_causal=c, implementation="polynomial", degree=g)
             for g in degrees] for c in (False, True)]

  with jax.enable_x64(True):
    shape = (1, 5, 2, 3)
    q, k1, k2 = (_bounded(i, shape, 0.9) for i in range(3))
    v1, v2 = (_bounded(i, shape, 1.0) for i in (3, 4))
    B_ = _logit_bound(q, k1, k2)
    assert 0.3 < B_ < 1.0  # bounded entries: |l| <= s H b^3 = 3^0.5 * 0.729 = 1.26
    outs = all_degrees(q, k1, k2, v1, v2)
    for causal, per_degree in zip((False, True), outs, strict=True):
      want = _np_tensor(q, k1, k2, v1, v2, causal)
      errs = []
      for g, out in zip(degrees, per_degree, strict=True):
        assert out.dtype == jnp.float64
        errs.append(float(np.max(np.abs(np.asarray(out) - want))))
        assert errs[-1] <= _bound(B_, g, v1, v2), (causal, g, errs[-1])
      # strictly falling: each 2 degrees gain a factor B^2 / ((g+1)(g+2)) < 0.1 in the bound
      assert all(a > b for a, b in zip(errs, errs[1:], strict=False)), errs
      assert errs[-1] < 1e-5


# By default test_polynomial_within_the_bound_and_error_falls_with_degree covers this:
# tests/conftest.py runs tests/attention under numpy_rank_promotion("raise") (it failed there on
# the old code); this explicit check holds without the guard.
@pytest.mark.slow
def test_polynomial_needs_no_implicit_rank_promotion():
  """Issue 37: the monomial weights [m] met the features [B, T, N, m] by implicit rank
  promotion, a ValueError under jax.numpy_rank_promotion("raise")."""
  q, k1, k2, v1, v2 = (normal(i, (1, 4, 1, 2)) for i in range(5))
  run = functools.partial(tensor_attention, implementation="polynomial", degree=2)
  want = run(q, k1, k2, v1, v2)
  with jax.numpy_rank_promotion("raise"):
    got = run(q, k1, k2, v1, v2)
  np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # ~2 s of CPU (compiles): out of the default run's budget
def test_polynomial_bf16_and_the_standard_attention_reduction():
  q, k1, k2, v1, v2 = (0.7 * normal(i, (B, T, N, H)) for i in range(5))
  ones = jnp.ones_like(k1)
  fn = jax.jit(functools.partial(tensor_attention, implementation="polynomial", degree=8,
                                 is_causal=True))
  # key2 = value2 = 1: attention with the Taylor polynomial of exp (another package's features)
  np.testing.assert_allclose(
      fn(q, k1, ones, v1, ones),
      jax.jit(functools.partial(taylor_linear_attention, order=8))(q, k1, v1),
      atol=2e-5, rtol=2e-5)  # two float32 summation orders over r = C(4+8, 8) = 495 features
  lo = fn(*(a.astype(jnp.bfloat16) for a in (q, k1, k2, v1, v2)))
  assert lo.dtype == jnp.bfloat16
  # bf16 inputs rounded first, float32 inside (degree 8 on |l| < 2: within ~1e-4 of exp),
  # the output rounded once (2^-8 relative)
  np.testing.assert_allclose(np.asarray(lo, np.float64), _np_tensor(
      *(a.astype(jnp.bfloat16).astype(jnp.float32) for a in (q, k1, k2, v1, v2)), True),
      atol=3e-2, rtol=3e-2)


@pytest.mark.slow  # ~2 s of CPU (compiles): out of the default run's budget
def test_polynomial_gradients_finite_differences():
  @jax.jit
  def both(*args):  # one program checks the non-causal and the causal (prefix-sum) paths
    poly = functools.partial(tensor_attention, implementation="polynomial", degree=2)
    return poly(*args) + 2.0 * poly(*args, is_causal=True)

  with jax.enable_x64(True):
    args = [normal(i, (1, 3, 1, 2)).astype(jnp.float64) for i in range(5)]
    jax.test_util.check_grads(both, args, order=1, modes=("rev",))


@pytest.mark.slow
@pytest.mark.parametrize("b", [0.5, 1.0, 1.3])
@pytest.mark.parametrize("H_", [2, 4])
def test_polynomial_bound_sweep(b, H_):
  with jax.enable_x64(True):
    shape = (2, 7, 2, H_)
    q, k1, k2 = (_bounded(10 + i, shape, b) for i in range(3))
    v1, v2 = (_bounded(20 + i, shape, 2.0) for i in range(2))
    B_ = _logit_bound(q, k1, k2)
    for causal in (False, True):
      want = _np_tensor(q, k1, k2, v1, v2, causal)
      prev = np.inf
      for g in range(2, 11, 2):
        eps = math.exp(B_) * B_ ** (g + 1) / math.factorial(g + 1)
        if eps >= 1:
          continue
        out = jax.jit(functools.partial(tensor_attention, is_causal=causal,
                                        implementation="polynomial", degree=g))(
            q, k1, k2, v1, v2)
        err = float(np.max(np.abs(np.asarray(out) - want)))
        assert err <= _bound(B_, g, v1, v2) + 1e-12, (g, err)
        assert err < prev or err < 1e-12
        prev = err
