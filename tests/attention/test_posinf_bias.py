"""A ``+inf`` bias on the blockwise paths follows each normalizer's ``+inf`` rule (issue 37).

The dense path gives a row with k visible ``+inf`` logits ``1/k`` on them (softmax and every
normalizer with the default rule; a normalizer's own limit for the others) and a zero
logit cotangent; ``xla_chunked`` and the Pallas kernels gave NaN there (value and
gradient). Checked against a float64 numpy reference written from the rule (softmax,
sparsemax), and against the dense path for one normalizer of every kernel class (slow).

The rows of the test bias (causal, T = S = 6): 0: a ``+inf`` the causal mask hides (an
ordinary row); 1: one visible ``+inf``; 2: two; 3: ``+inf`` on every visible key (and a
hidden one); 4: fully masked (``-inf``); 5: finite.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import _chunked
from jaxsoft.attention import dot_product_attention as dpa
from kernels_pallas.backends import INTERPRET_ENV

T = S = 6
N, K, H = 2, 1, 4
INF = np.inf


def _bias():
  rng = np.random.default_rng(0)
  b = rng.normal(size=(1, 1, T, S))
  b[0, 0, 0, 3] = INF  # hidden by the causal mask
  b[0, 0, 1, 1] = INF
  b[0, 0, 2, [0, 2]] = INF
  b[0, 0, 3, :] = INF  # keys 0..3 visible, 4 and 5 hidden
  b[0, 0, 4, :] = -INF
  return b


def _inputs():
  rng = np.random.default_rng(1)
  q = rng.normal(size=(1, T, N, H))
  k = rng.normal(size=(1, S, K, H))
  v = rng.normal(size=(1, S, K, H))
  cot = rng.normal(size=(1, T, N, H))  # the loss is sum(out * cot)
  return q, k, v, _bias(), cot


def _reference(q, k, v, bias, cot, limit):
  """Float64 numpy: out and the gradients (q, k, v, bias) of sum(out * cot) for a
  normalizer whose rows without ``+inf`` are ``limit(logits, visible)`` -> weights and
  whose ``+inf`` rows share 1/k (zero logit cotangent)."""
  scale = 1.0 / np.sqrt(H)
  out = np.zeros((1, T, N, H))
  dq, dk, dv, dbias = (np.zeros_like(q), np.zeros_like(k), np.zeros_like(v),
                       np.zeros_like(bias))
  causal = np.tril(np.ones((T, S), bool))
  for n in range(N):
    logits = scale * q[0, :, n] @ k[0, :, 0].T + bias[0, 0]
    visible = causal & (bias[0, 0] != -INF)
    hit = visible & (bias[0, 0] == INF)
    w = np.zeros((T, S))
    for i in range(T):
      if hit[i].any():
        w[i] = hit[i] / hit[i].sum()
      elif visible[i].any():
        w[i] = limit(logits[i], visible[i])
    out[0, :, n] = w @ v[0, :, 0]
    dv[0, :, 0] += w.T @ cot[0, :, n]
    dw = cot[0, :, n] @ v[0, :, 0].T
    ds = np.zeros((T, S))
    for i in range(T):
      if visible[i].any() and not hit[i].any():
        ds[i] = limit.vjp(logits[i], visible[i], dw[i])
    dq[0, :, n] = scale * ds @ k[0, :, 0]
    dk[0, :, 0] += scale * ds.T @ q[0, :, n]
    dbias[0, 0] += ds
  return out, (dq, dk, dv, dbias)


class _Softmax:
  def __call__(self, x, vis):
    e = np.where(vis, np.exp(x - x[vis].max()), 0.0)
    return e / e.sum()

  def vjp(self, x, vis, dw):
    w = self(x, vis)
    return w * (dw - np.sum(w * dw))


class _Sparsemax:
  def __call__(self, x, vis):
    z = np.sort(x[vis])[::-1]
    cs = np.cumsum(z) - 1.0
    r = np.arange(1, len(z) + 1)
    support = z - cs / r > 0
    tau = cs[support][-1] / r[support][-1]
    return np.where(vis, np.maximum(x - tau, 0.0), 0.0)

  def vjp(self, x, vis, dw):
    s = self(x, vis) > 0
    return np.where(s, dw - dw[s].mean(), 0.0)


def _run(impl, normalizer, q, k, v, bias, cot, params=None):
  """Jitted out and the gradients of sum(out * cot) w.r.t. q, k, v and the bias."""
  def loss(q, k, v, bias):
    out = dpa(q, k, v, bias=bias, is_causal=True, normalizer=normalizer,
              normalizer_params=params, implementation=impl)
    return jnp.sum(out * cot), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
      *(jnp.asarray(a, jnp.float32) for a in (q, k, v, bias)))
  return out, grads


def _check(impl, normalizer, limit):
  q, k, v, bias, cot = _inputs()
  out, grads = _run(impl, normalizer, q, k, v, bias, cot)
  ref_out, ref_grads = _reference(q, k, v, bias, cot, limit)
  # float32 against float64 on O(1) values summed over <= 6 terms: errors ~1e-6; 2e-5
  # leaves a 10x margin and is far below the O(0.1) differences of a wrong rule.
  np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5)
  for g, r in zip(grads, ref_grads, strict=True):
    assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_allclose(np.asarray(g), r, atol=2e-5)


@pytest.fixture
def small_blocks(monkeypatch):
  """Blocks of 4 x 4: T = S = 6 spans two query and two key blocks (with padding)."""
  monkeypatch.setattr(_chunked, "BLOCK_Q", 4)
  monkeypatch.setattr(_chunked, "BLOCK_K", 4)


@pytest.fixture
def interpret_env(monkeypatch):
  monkeypatch.setenv(INTERPRET_ENV, "1")


def test_chunked_softmax_posinf_rows(small_blocks):
  _check("xla_chunked", "softmax", _Softmax())


@pytest.mark.slow
def test_chunked_sparsemax_posinf_rows(small_blocks):
  _check("xla_chunked", "sparsemax", _Sparsemax())


@pytest.mark.slow
def test_pallas_softmax_posinf_rows(interpret_env):
  _check("pallas", "softmax", _Softmax())


def test_pallas_softmax_posinf_values(interpret_env):
  """The forward only (the interpreted backward passes are slow; the gradients are in the
  slow test above)."""
  q, k, v, bias, cot = _inputs()
  f = jax.jit(functools.partial(dpa, is_causal=True, implementation="pallas"))
  out = f(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), bias=jnp.asarray(bias))
  ref_out, _ = _reference(q, k, v, bias, cot, _Softmax())
  np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5)  # as in _check


@pytest.mark.slow
def test_residual_of_posinf_rows_is_inf(small_blocks):
  q, k, v, bias, _ = _inputs()
  f = jax.jit(functools.partial(dpa, is_causal=True, implementation="xla_chunked",
                                return_residual=True))
  _, res = f(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), bias=jnp.asarray(bias))
  res = np.asarray(res)[0]  # [T, N]
  assert np.all(res[1:4] == INF)
  assert np.all(res[4] == -INF)  # fully masked: log 0
  assert np.all(np.isfinite(res[[0, 5]]))


# One normalizer (or several) per kernel class, with hyperparameters that make a custom
# +inf limit differ from 1/k (clipped, affine, standardized softmax).
SWEEP = [
    ("softmax", {}), ("softmax_n", {}), ("ssmax", {}), ("softmax_sink", {}),  # E
    ("stablemax", {}), ("softplus_l1", {}),  # S
    ("sigmoid", {}),  # P (relu's limit is a +inf weight: inf or NaN outputs on both paths)
    ("sparsemax", {}), ("entmax15", {}), ("top_k_softmax", {"k": 2}),  # T
    ("standardized_softmax", {}), ("adaptive_temperature_softmax", {}),  # R
    ("clipped_softmax", {"zeta": 1.2, "gamma": -0.1}), ("affine_softmax", {"alpha": 0.7}),
    ("nap", {}), ("sa_softmax_normalized", {}),
]


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla_chunked", "pallas"])
@pytest.mark.parametrize("normalizer,params", SWEEP, ids=[s[0] for s in SWEEP])
def test_blockwise_matches_dense_posinf_rule(impl, normalizer, params, small_blocks,
                                             interpret_env):
  q, k, v, bias, cot = _inputs()
  ref_out, ref_grads = _run("xla", normalizer, q, k, v, bias, cot, params)
  out, grads = _run(impl, normalizer, q, k, v, bias, cot, params)
  # float32 paths that differ in summation order and blocking: 1e-5 relative to O(1)
  # values and gradients; a wrong +inf rule differs by O(0.1), NaN fails outright.
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-4, atol=1e-5)
  for g, r in zip(grads, ref_grads, strict=True):
    assert np.all(np.isfinite(np.asarray(g)))
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)
