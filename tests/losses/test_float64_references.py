"""Losses under ``JAX_ENABLE_X64`` against independent float64 references at 1e-10 (issue 37,
guard "float64 stays float64").

``test_float64_walk`` shows that every public function of ``jaxsoft.losses`` computes in
float64 (no input rounded to float32); this file checks the float64 *values* where an
independent float64 reference exists: optax's own losses run in float64 (the softmax
cross-entropy family, the sigmoid and hinge ones), and NumPy float64 written from each
docstring's formula for a sample of the others (the cross-entropy family, stablemax, the
log²Z regulariser, the Fenchel-Young losses of sparsemax and 1.5-entmax with the
normalizers' float64 references of ``tests/reference_f64``, InfoNCE, the cut cross-entropy
against a plain log-softmax of ``h @ w``, the OOD scores, the calibration map, the proposal
and density helpers, ⊥Grad, AdaCos). The gradients of the differentiable ones are checked
by ``jax.test_util.check_grads`` (order 1, reverse mode) in float64.

Tolerances. A float64 computation of these O(1)-sized values over rows of at most 6 terms
is off its float64 reference by a few float64 ulps per operation (~1e-15 relative); 1e-10
(relative, with a 1e-12 absolute floor for values near 0) leaves five orders of margin and
sits three orders below float32's resolution (6e-8), so any float32 step inside fails.
``check_grads`` compares the reverse-mode derivative with central differences of step
1e-6: truncation ~1e-12, float64 cancellation ~1e-16 / 1e-6 = 1e-10; atol = rtol = 1e-7
leaves margin for both while a float32 forward pass (cancellation ~6e-8 / 1e-6 = 6e-2)
fails. Three functions by default, all of them with ``-m slow``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

import jaxsoft.losses as L
from tests import reference_f64
from tests.helpers import sampled
from tests.losses.references import np_ce, np_softmax

B, C, D = 4, 6, 5
TOL = dict(rtol=1e-10, atol=1e-12)
GRAD_TOL = dict(atol=1e-7, rtol=1e-7, eps=1e-6)
DEFAULT = ("fenchel_young_loss-sparsemax", "linear_cross_entropy",
           "softmax_cross_entropy_with_integer_labels")


def _normal(seed, *shape, scale=1.0):
  return scale * np.random.default_rng(seed).normal(size=shape)


def _uniform(seed, lo, hi, *shape):
  return np.random.default_rng(seed).uniform(lo, hi, size=shape)


LABELS = np.array([0, 2, 5, 3])
ONE_HOT = np.eye(C)[LABELS]


def _lse(z, axis=-1):
  m = z.max(axis, keepdims=True)
  return (m + np.log(np.exp(z - m).sum(axis, keepdims=True))).squeeze(axis)


def _log_softmax(z):
  return z - _lse(z)[..., None]


def _gather(z, labels):
  return np.take_along_axis(z, np.asarray(labels)[..., None], -1)[..., 0]


def _fenchel_young(z, alpha, normalizer):
  """Omega(y) - Omega(p) + <z, p - y> for one-hot y (Omega(y) = 0 on a vertex)."""
  p = reference_f64.normalizer(normalizer, z)
  omega_p = (np.sum(p ** alpha, -1) - 1.0) / (alpha * (alpha - 1.0))
  return -omega_p + np.sum(z * (p - ONE_HOT), -1)


def _stablemax_ce(z, labels):
  s = np.where(z >= 0, z + 1.0, 1.0 / (1.0 - z))
  return np.log(s.sum(-1)) - np.log(_gather(s, labels))


def _info_nce(s, tau):
  z = s / tau
  return _lse(z) - np.diag(z)


def _linear_ce(h, w, eps, lam, cap):
  z = cap * np.tanh(h @ w / cap)
  lse = _lse(z)
  return ((1 - eps) * (lse - _gather(z, LABELS)) + eps * (lse - z.mean(-1))
          + lam * lse ** 2)


def _top_k_ce(z, labels, k):
  keep = np.zeros(z.shape, bool)
  np.put_along_axis(keep, np.argsort(-z, -1)[:, :k], True, -1)
  np.put_along_axis(keep, labels[:, None], True, -1)
  return _lse(np.where(keep, z, -np.inf)) - _gather(z, labels)


def _spherical_z(o, labels):
  z = (o - o.mean(-1, keepdims=True)) / o.std(-1, keepdims=True)
  return np.log1p(np.exp(-_gather(z, labels)))


def _pointer_sentinel(u, ptr, sentinel, ids):
  a = np_softmax(np.concatenate([ptr, sentinel[:, None]], -1))
  p = a[:, -1:] * np_softmax(u)
  for i in range(ids.shape[1]):
    p[np.arange(len(ids)), ids[:, i]] += a[:, i]
  return np.log(p)


def _orthogonal(g, p):
  perp = g - (g @ p) / (p @ p) * p
  return perp * np.linalg.norm(g) / np.linalg.norm(perp)


def _adacos(x, w, labels, s):
  xn = x / np.linalg.norm(x, axis=-1, keepdims=True)
  wn = w / np.linalg.norm(w, axis=0, keepdims=True)
  cos = xn @ wn
  b_avg = np.mean(np.sum(np.where(np.eye(w.shape[1])[labels] > 0, 0.0, np.exp(s * cos)), -1))
  theta_med = np.median(np.arccos(_gather(cos, labels)))
  return np.log(b_avg) / np.cos(min(np.pi / 4, theta_med))


def _soft_info_nce_weights(s, t, alpha=1.0, beta=1.0, floor=0.1):
  n = s.shape[1] - 1  # negatives per row
  z = np.where(np.eye(*s.shape) > 0, -np.inf, s / t)
  q = np.exp(z - _lse(z)[:, None])
  w = np.maximum(floor, (beta - alpha * q) / (beta - alpha / n))
  return np.where(np.eye(*s.shape) > 0, 1.0, w)


CTX = np.array([[1, 2], [3, 0], [5, 5], [0, 4]])
VQ_ASSIGNMENT = np.array([0, 1, 1, 0, 2, 1])

# id -> (call(*floats), floats, reference(*floats), differentiable)
CASES = {
    # optax's float64 losses
    "softmax_cross_entropy": (
        lambda x, t: L.softmax_cross_entropy(x, jax.nn.softmax(t)),
        (_normal(0, B, C, scale=2.0), _normal(1, B, C)),
        lambda x, t: np.asarray(optax.losses.softmax_cross_entropy(
            jnp.asarray(x), jax.nn.softmax(jnp.asarray(t)))), True),
    "softmax_cross_entropy_with_integer_labels": (
        lambda x: L.softmax_cross_entropy_with_integer_labels(x, LABELS),
        (_normal(2, B, C, scale=2.0),),
        lambda x: np.asarray(optax.losses.softmax_cross_entropy_with_integer_labels(
            jnp.asarray(x), LABELS)), True),
    "ovr_bce_loss": (
        lambda x: L.ovr_bce_loss(x, LABELS), (_normal(3, B, C, scale=2.0),),
        lambda x: np.asarray(optax.losses.sigmoid_binary_cross_entropy(
            jnp.asarray(x), ONE_HOT).sum(-1)), True),
    "l2_svm_loss": (
        lambda x: L.l2_svm_loss(x, LABELS), (_normal(4, B, C, scale=2.0),),
        lambda x: np.asarray((optax.losses.hinge_loss(jnp.asarray(x), 2 * ONE_HOT - 1) ** 2)
                             .sum(-1)), True),
    # NumPy float64 from the docstrings' formulas
    "softmax_cross_entropy_with_integer_labels-numpy": (
        lambda x: L.softmax_cross_entropy_with_integer_labels(x, LABELS),
        (_normal(5, B, C, scale=3.0),), lambda x: np_ce(x, LABELS), True),
    "stablemax_cross_entropy": (
        lambda x: L.stablemax_cross_entropy(x, LABELS), (_normal(6, B, C, scale=3.0),),
        lambda x: _stablemax_ce(x, LABELS), True),
    "z_loss": (L.z_loss, (_normal(7, B, C, scale=2.0),), lambda x: _lse(x) ** 2, True),
    "fenchel_young_loss-sparsemax": (
        lambda x: L.fenchel_young_loss(x, LABELS, "sparsemax"), (_normal(8, B, C),),
        lambda x: _fenchel_young(x, 2.0, "sparsemax"), True),
    "fenchel_young_loss-entmax15": (
        lambda x: L.fenchel_young_loss(x, LABELS, "entmax15"), (_normal(9, B, C),),
        lambda x: _fenchel_young(x, 1.5, "entmax15"), True),
    "info_nce": (
        lambda s: L.info_nce(s, temperature=0.5), (_normal(10, B, B),),
        lambda s: _info_nce(s, 0.5), True),
    "info_nce-symmetric": (
        lambda s: L.info_nce(s, temperature=0.5, symmetric=True), (_normal(11, B, B),),
        lambda s: 0.5 * (_info_nce(s, 0.5) + _info_nce(s.T, 0.5)), True),
    "linear_cross_entropy": (
        lambda h, w: L.linear_cross_entropy(h, w, LABELS), (_normal(12, B, D), _normal(13, D, C)),
        lambda h, w: -_gather(_log_softmax(h @ w), LABELS), True),
    # the chunked online log-sum-exp (chunks that do not divide the axes), label smoothing,
    # the log²Z term and the softcap: the docstring's formula on z = c tanh(h w / c)
    "linear_cross_entropy-chunked": (
        lambda h, w: L.linear_cross_entropy(h, w, LABELS, label_smoothing=0.1, z_loss=1e-2,
                                            softcap=3.0, token_chunk_size=3,
                                            vocab_chunk_size=4),
        (_normal(39, B, D), _normal(40, D, C)), lambda h, w: _linear_ce(h, w, 0.1, 1e-2, 3.0),
        True),
    "top_k_cross_entropy": (
        lambda x: L.top_k_cross_entropy(x, LABELS, 2), (_normal(14, B, C, scale=2.0),),
        lambda x: _top_k_ce(x, LABELS, 2), True),
    "spherical_z_loss": (
        lambda x: L.spherical_z_loss(x, LABELS), (_normal(15, B, C, scale=2.0),),
        lambda x: _spherical_z(x, LABELS), True),
    "energy_score": (L.energy_score, (_normal(16, B, C, scale=2.0),), _lse, True),
    "marginalized_energy": (L.marginalized_energy, (_normal(17, B, C, scale=2.0),),
                            lambda x: -_lse(x), True),
    "msp": (L.msp, (_normal(18, B, C, scale=2.0),), lambda x: np_softmax(x).max(-1), True),
    "spilled_energy": (
        lambda x: L.spilled_energy(x, LABELS), (_normal(19, B, C, scale=2.0),),
        lambda x: _lse(x[1:]) - _gather(x[:-1], LABELS[:-1]), True),
    "acol_probabilities": (
        L.acol_probabilities, (_normal(20, B, C, 2),),
        lambda z: np_softmax(z.reshape(B, -1)).reshape(B, C, 2).sum(-1), True),
    "dirichlet_calibrate": (
        L.dirichlet_calibrate, (_normal(21, B, C), _normal(22, C, C), _normal(23, C)),
        lambda z, w, b: _log_softmax(z) @ w.T + b, True),
    "pointer_sentinel_log_probs": (
        lambda u, p, s: L.pointer_sentinel_log_probs(u, p, s, CTX),
        (_normal(24, B, C), _normal(25, B, 2), _normal(26, B)),
        lambda u, p, s: _pointer_sentinel(u, p, s, CTX), True),
    "vq_logits": (
        lambda h, cb, b: L.vq_logits(h, cb, VQ_ASSIGNMENT, bias=b),
        (_normal(27, B, D), _normal(28, D, 3), _normal(29, C)),
        lambda h, cb, b: h @ cb[:, VQ_ASSIGNMENT] + b, True),
    "unigram_proposal": (
        L.unigram_proposal, (_uniform(30, 0.5, 20.0, C),),
        lambda c: c ** 0.75 / np.sum(c ** 0.75), True),
    "wrapped_cauchy_log_density": (
        L.wrapped_cauchy_log_density,
        (_normal(31, B), _uniform(32, 0.1, 0.9, B), _normal(33, B)),
        lambda t, r, mu: np.log((1 - r ** 2) / (2 * np.pi * (1 + r ** 2
                                                            - 2 * r * np.cos(t - mu)))), True),
    "orthogonal_gradient": (
        lambda g, p: L.orthogonal_gradient().update({"w": g}, (), {"w": p})[0]["w"],
        (_normal(34, D), _normal(35, D)), _orthogonal, True),
    # no gradient flows through these (stop_gradient by definition): values only
    "adacos_scale": (
        lambda x, w, s: L.adacos_scale(x, w, LABELS, previous_scale=s),
        (_normal(36, B, D), _normal(37, D, C), np.float64(10.0 / 3.0)),
        lambda x, w, s: _adacos(x, w, LABELS, s), False),
    "soft_info_nce_weights": (
        lambda s: L.soft_info_nce_weights(s, temperature=0.5), (_normal(38, B, C),),
        lambda s: _soft_info_nce_weights(s, 0.5), False),
}


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


@pytest.mark.parametrize("case", sampled(sorted(CASES), DEFAULT))
def test_float64_value_matches_float64_reference(x64, case):
  call, floats, reference, differentiable = CASES[case]
  args = tuple(jnp.asarray(x, jnp.float64) for x in floats)
  got = jax.jit(call)(*args)
  assert got.dtype == jnp.float64, (case, got.dtype)
  want = reference(*(np.asarray(x, np.float64) for x in floats))
  assert np.all(np.isfinite(want)), case
  np.testing.assert_allclose(np.asarray(got), want, **TOL, err_msg=case)
  if differentiable:
    check_grads(jax.jit(call), args, order=1, modes=("rev",), **GRAD_TOL)
