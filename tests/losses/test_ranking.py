"""L14 ranking losses (PSL, SL@K and its threshold) against float64 numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft as js
from tests.helpers import check_raises, numeric_grad, rows, sampled
from tests.losses.jitted import Jitted

L = Jitted(js.losses)  # every call under jax.jit (see tests/losses/jitted.py)
E = js.losses          # eager: checks that need concrete values
ce_int = jax.jit(optax.losses.softmax_cross_entropy_with_integer_labels)

SURROGATES = {
    "tanh": lambda d: np.tanh(d) + 1.0,
    "relu": lambda d: np.maximum(d + 1.0, 0.0),
    "atan": lambda d: np.maximum(np.arctan(d) + 1.0, 0.0),
    "exp": np.exp,
}


def _psl_ref(s, y, act, tau):
  s = np.asarray(s, np.float64)
  d = s - s[np.arange(len(y)), np.asarray(y)][:, None]
  return np.log((SURROGATES[act](d) ** (1.0 / tau)).sum(-1))


@pytest.mark.parametrize("act", sampled(["tanh", "relu", "atan", "exp"], default=["tanh", "relu"]))
def test_psl_matches_reference_forward_and_backward(act):
  s = jnp.tanh(rows(0, (3, 6)))                    # cosines: gaps in [-2, 2]
  y = jnp.array([0, 3, 5])
  f = jax.jit(lambda a: L.pairwise_softmax_loss(a, y, activation=act, temperature=0.5))
  np.testing.assert_allclose(f(s), _psl_ref(s, y, act, 0.5), rtol=1e-5)
  ct = np.asarray(rows(1, (3,)), np.float64)
  _, vjp = jax.vjp(f, s)
  np.testing.assert_allclose(vjp(jnp.asarray(ct, jnp.float32))[0],
                             numeric_grad(lambda a: _psl_ref(a, y, act, 0.5) @ ct, s),
                             rtol=1e-4, atol=1e-5)


def test_psl_properties():
  s = jnp.tanh(rows(0, (4, 8)))
  y = jnp.array([0, 3, 5, 7])
  np.testing.assert_allclose(L.pairwise_softmax_loss(s, y, activation="exp", temperature=0.3),
                             ce_int(s / 0.3, y), rtol=1e-5)
  d = np.linspace(-1.0, 1.0, 201)
  acts = ("tanh", "relu", "atan")
  # the library's surrogate on a grid of gaps (a positive at 0, one candidate at d)
  grid = jnp.stack([jnp.zeros(201), jnp.linspace(-1.0, 1.0, 201)], -1)
  out = jax.jit(lambda a, g: [(E.pairwise_softmax_loss(a, y, activation=act),
                                jax.grad(lambda b, act=act: E.pairwise_softmax_loss(
                                    b, y, activation=act).sum())(a),
                                E.pairwise_softmax_loss(g, jnp.zeros(201, jnp.int32),
                                                        activation=act)) for act in acts])(s, grid)
  rank = (np.asarray(s) >= np.asarray(s)[np.arange(4), np.asarray(y)][:, None]).sum(-1)
  neg = ~np.eye(8, dtype=bool)[np.asarray(y)]
  for act, (loss, g, on_grid) in zip(acts, out, strict=True):
    sur = np.expm1(np.asarray(on_grid, np.float64))          # log(1 + s(d)) -> s(d)
    np.testing.assert_allclose(sur, SURROGATES[act](d), rtol=1e-5, atol=1e-6)
    assert np.all((d >= 0) <= sur + 1e-6) and np.all(sur <= np.exp(d) + 1e-6)
    assert np.all(np.asarray(loss) >= np.log(rank) - 1e-6)
    assert np.all(np.asarray(g)[neg] >= 0)            # monotone increasing in every gap


def test_psl_masks_extremes_and_bf16():
  s = jnp.tanh(rows(0, (3, 6)))
  y = jnp.array([0, 3, 1])
  cand = jnp.array([True, True, False, True, True, True])
  keep = np.array([0, 1, 3, 4, 5])
  np.testing.assert_allclose(L.pairwise_softmax_loss(s, y, where=cand[None]),
                             _psl_ref(np.asarray(s)[:, keep], np.array([0, 2, 1]), "tanh", 1.0),
                             rtol=1e-5)
  out, g = jax.value_and_grad(lambda a: L.pairwise_softmax_loss(
      a, y, where=jnp.array([True, False, True])).sum())(s)
  assert np.all(np.asarray(g)[1] == 0.0) and np.isfinite(out)
  grads = jax.jit(lambda a: [jax.grad(lambda b, act=act: E.pairwise_softmax_loss(
      b, y, activation=act).sum())(a) for act in ("tanh", "relu", "atan")])(1e4 * s)
  assert all(np.isfinite(g).all() for g in grads)
  lo = L.pairwise_softmax_loss(s.astype(jnp.bfloat16), y)
  assert lo.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(lo, np.float32),
                             _psl_ref(np.asarray(s.astype(jnp.bfloat16)), y, "tanh", 1.0),
                             rtol=2e-2)


def _slk_ref(s, y, k, tau, tau_b):
  s = np.asarray(s, np.float64)
  rows = np.arange(len(y))
  beta = -np.sort(-s, -1)[:, k - 1]
  f_y = s[rows, np.asarray(y)]
  w = 1.0 / (1.0 + np.exp(-(f_y - beta) / tau_b))
  z = s / tau
  m = z.max(-1)
  return w * (m + np.log(np.exp(z - m[:, None]).sum(-1)) - f_y / tau), w


def test_softmax_loss_at_k_reference_gradient_and_threshold():
  s = rows(0, (4, 7))
  y = jnp.array([0, 3, 6, 2])
  f = jax.jit(lambda a: L.softmax_loss_at_k(a, y, k=3, temperature=0.5, weight_temperature=0.2))
  want, w = _slk_ref(s, y, 3, 0.5, 0.2)
  np.testing.assert_allclose(f(s), want, rtol=1e-5)
  # the weight carries no gradient: the gradient is w times the softmax loss's
  g = jax.grad(lambda a: f(a).sum())(s)
  g_ce = jax.grad(lambda a: ce_int(a / 0.5, y).sum())(s)
  np.testing.assert_allclose(g, w[:, None] * np.asarray(g_ce), rtol=1e-5, atol=1e-6)
  # a very low threshold: weight 1, the softmax loss
  np.testing.assert_allclose(L.softmax_loss_at_k(s, y, threshold=-1e3, temperature=0.5),
                             ce_int(s / 0.5, y), rtol=1e-5)
  # the weight is monotone in f_y - β
  lo = L.softmax_loss_at_k(s, y, threshold=0.5) / ce_int(s, y)
  hi = L.softmax_loss_at_k(s, y, threshold=-0.5) / ce_int(s, y)
  assert np.all(np.asarray(hi) > np.asarray(lo))
  out = L.softmax_loss_at_k(s, y, k=2, where=jnp.array([True, False, True, True]))
  assert out[1] == 0.0
  assert np.isfinite(jax.grad(lambda a: L.softmax_loss_at_k(a, y, k=2).sum())(1e4 * s)).all()
  assert L.softmax_loss_at_k(s.astype(jnp.bfloat16), y, k=2).dtype == jnp.bfloat16


def test_top_k_threshold_loss_minimiser_is_the_top_k_quantile():
  s = rows(0, (2, 50))
  k = 5
  betas = jnp.linspace(-3.0, 3.0, 2001)
  loss = jax.jit(jax.vmap(lambda b: L.top_k_threshold_loss(s, jnp.full((2,), b), k)))(betas)
  best = np.asarray(betas)[np.argmin(np.asarray(loss), axis=0)]
  above = (np.asarray(s) > best[:, None]).sum(-1)
  np.testing.assert_array_equal(above, k)
  # reference value and the gradient in the threshold
  b = jnp.array([0.3, -0.2])
  t = 1 - k / 50
  u = np.asarray(s, np.float64) - np.asarray(b)[:, None]
  np.testing.assert_allclose(L.top_k_threshold_loss(s, b, k),
                             np.maximum(t * u, (t - 1) * u).mean(-1), rtol=1e-5)
  g = jax.grad(lambda bb: L.top_k_threshold_loss(s, bb, k).sum())(b)
  np.testing.assert_allclose(g, ((u < 0).sum(-1) - t * 50) / 50, atol=1e-6)


def test_bad_inputs_name_the_argument():
  s = rows(0, (3, 6))
  y = jnp.array([0, 1, 2])
  check_raises(
      ("`activation`", lambda: E.pairwise_softmax_loss(s, y, activation="sigmoid")),
      ("`temperature`", lambda: E.pairwise_softmax_loss(s, y, temperature=0.0)),
      ("`labels`", lambda: E.pairwise_softmax_loss(s, y[:2])),
      ("`k`", lambda: E.softmax_loss_at_k(s, y)),
      ("`k`", lambda: E.softmax_loss_at_k(s, y, k=7)),
      ("`weight_temperature`", lambda: E.softmax_loss_at_k(s, y, k=2, weight_temperature=-1.0)),
      ("`threshold`", lambda: E.top_k_threshold_loss(s, jnp.zeros(2), 2)),
      ("`k`", lambda: E.top_k_threshold_loss(s, jnp.zeros(3), 0)),
  )
