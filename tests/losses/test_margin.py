"""L06 margin softmax losses (ArcFace + sub-centres, CosFace/AM, normalised softmax) against a
float64 numpy reference that goes through arccos, and against optax."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft as js
from tests.helpers import check_raises, normal, numeric_grad, value_and_vjp

B, D, C = 5, 4, 6
# jitted, so a test compiles a few programs instead of dispatching op by op
_STATIC = ("margin", "easy_margin", "ignore_index")
arc = jax.jit(js.losses.arcface_loss, static_argnames=_STATIC)
cosface = jax.jit(js.losses.cosface_loss, static_argnames=("margin", "ignore_index"))


def _reference(x, w, labels, kind, scale, margin=0.0, easy=False):
  """float64 numpy: per-example loss; the target angle is taken with arccos."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  xh = x / np.linalg.norm(x, axis=-1, keepdims=True)
  wh = w / np.linalg.norm(w, axis=0, keepdims=True)
  cos = np.einsum("bd,dc...->bc...", xh, wh)
  if cos.ndim == 3:
    cos = cos.max(-1)
  cos = np.clip(cos, -1, 1)
  rows = np.arange(len(labels))
  c = cos[rows, labels]
  if kind == "arc":
    theta = np.arccos(c)
    phi = np.cos(theta + margin)
    if easy:
      phi = np.where(c > 0, phi, c)
    else:
      phi = np.where(theta + margin <= np.pi, phi, c - margin * np.sin(margin))
  elif kind == "cos":
    phi = c - margin
  else:
    phi = c
  logits = scale * cos
  logits[rows, labels] = scale * phi
  m = logits.max(-1, keepdims=True)
  lse = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
  return lse - scale * phi


def _inputs(seed, k=None):
  x = normal(seed, (B, D))
  w = normal(seed + 1, (D, C) if k is None else (D, C, k))
  labels = jax.random.randint(jax.random.key(seed + 2), (B,), 0, C)
  return x, w, labels


def _ours(kind, labels, scale, margin=0.0, easy=False, **kw):
  if kind == "arc":
    return lambda x, w: js.losses.arcface_loss(x, w, labels, scale=scale, margin=margin,
                                               easy_margin=easy, **kw)
  if kind == "cos":
    return lambda x, w: js.losses.cosface_loss(x, w, labels, scale=scale, margin=margin, **kw)
  return lambda x, w: js.losses.normalized_softmax_loss(x, w, labels, temperature=1 / scale, **kw)


CASES = {
    "arcface": ("arc", 8.0, 0.5, False, None),
    "arcface_easy": ("arc", 8.0, 0.5, True, None),
    "arcface_subcenters": ("arc", 8.0, 0.3, False, 3),
    "cosface": ("cos", 8.0, 0.35, False, None),
    "normalized": ("norm", 4.0, 0.0, False, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference_value_and_gradients(case):
  kind, scale, margin, easy, k = CASES[case]
  x, w, labels = _inputs(0, k)
  out, (dx, dw), _ = value_and_vjp(_ours(kind, labels, scale, margin, easy), x, w, seed=None)
  ref = lambda a, b: _reference(a, b, labels, kind, scale, margin, easy)
  np.testing.assert_allclose(out, ref(x, w), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, numeric_grad(lambda a: ref(a, w).sum(), x), rtol=1e-3, atol=1e-4)
  np.testing.assert_allclose(dw, numeric_grad(lambda b: ref(x, b).sum(), w), rtol=1e-3, atol=1e-4)


def test_zero_margin_is_normalized_softmax_and_optax_on_scaled_cosines():
  x, w, labels = _inputs(1)
  s = 10.0
  cos = lambda a, b: (a / jnp.linalg.norm(a, axis=-1, keepdims=True)) @ (
      b / jnp.linalg.norm(b, axis=0, keepdims=True))
  fns = (_ours("arc", labels, s, 0.0), _ours("cos", labels, s, 0.0), _ours("norm", labels, s),
         lambda a, b: optax.losses.softmax_cross_entropy_with_integer_labels(s * cos(a, b), labels))
  results = jax.jit(lambda a, b: [jax.vjp(f, a, b)[1](jnp.arange(1.0, B + 1)) + (f(a, b),)
                                  for f in fns])(x, w)
  # float32 gradients whose entries reach about 20: the absolute tolerance is about 1e-6 of
  # that scale (the paths differ in rounding only; 5e-6 was seen on a 0.26 entry).
  for other in results[1:]:
    chex.assert_trees_all_close(other, results[0], rtol=1e-5, atol=2e-5)
  # K = 1 sub-centre is the plain loss
  chex.assert_trees_all_close(arc(x, w[..., None], labels), arc(x, w, labels), rtol=1e-6)


def test_theta_near_zero_and_pi_is_finite_and_the_threshold_rule_applies():
  _, w, _ = _inputs(2)
  labels = jnp.array([0, 1, 2, 3])
  wn = w / jnp.linalg.norm(w, axis=0, keepdims=True)
  x = jnp.stack([3.0 * w[:, 0],             # theta = 0
                 -w[:, 1],                  # theta = pi
                 w[:, 2] + 1e-4 * w[:, 0],  # theta ~ 0
                 -w[:, 3] + 1e-4 * w[:, 1]])  # theta ~ pi
  f = jax.jit(jax.value_and_grad(
      lambda a, b: _ours("arc", labels, 16.0, 0.5)(a, b).sum()
      + _ours("arc", labels, 16.0, 0.5, True)(a, b).sum(), argnums=(0, 1)))
  out, grads = f(x, w)
  assert np.isfinite(out) and all(np.all(np.isfinite(g)) for g in grads)
  # at theta = pi the target cosine is cos(theta) - m sin(m) = -1 - 0.5 sin(0.5)
  cos = jnp.clip(wn.T @ (x[1] / jnp.linalg.norm(x[1])), -1, 1)
  logits = 16.0 * cos.at[1].set(-1.0 - 0.5 * np.sin(0.5))
  want = jax.nn.logsumexp(logits) - logits[1]
  np.testing.assert_allclose(arc(x[1:2], w, labels[1:2], scale=16.0),
                             want[None], rtol=1e-5)
  # the target logit decreases in theta over [0, pi], through the threshold at pi - m
  t = np.linspace(0.0, np.pi, 181)
  xs = jnp.asarray(np.stack([np.cos(t), np.sin(t), 0 * t], -1), jnp.float32)
  ws = jnp.array([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])   # the other class: cosine 0 throughout
  grid = arc(xs, ws, jnp.zeros((181,), jnp.int32), scale=1.0, margin=0.5)
  assert np.all(np.diff(np.asarray(grid)) >= -1e-6)


def test_loss_grows_with_the_margin_and_ignores_the_scale_of_inputs():
  x, w, labels = _inputs(3)
  losses = [arc(x, w, labels, scale=8.0, margin=m) for m in (0.0, 0.2, 0.4)]
  assert np.all(np.diff(np.stack(losses), axis=0) > 0)
  cos_losses = [cosface(x, w, labels, scale=8.0, margin=m) for m in (0.0, 0.3)]
  assert np.all(cos_losses[1] > cos_losses[0])
  base = arc(x, w, labels)
  for factor in (1e-30, 1e30):
    chex.assert_trees_all_close(arc(factor * x, 7.0 * w, labels), base,
                                rtol=1e-5)
  zero = arc(jnp.zeros((1, D)), w, labels[:1])   # cos = 0 everywhere
  assert np.isfinite(zero[0])


def test_masks_and_ignore_index():
  x, w, labels = _inputs(4)
  labels = labels.at[1].set(-100).at[2].set(C - 1)
  example = jnp.array([True, True, True, False, True])
  classes = jnp.ones((1, C), bool).at[0, C - 1].set(False)
  f = lambda a, b: arc(a, b, labels, where=example, ignore_index=-100)
  out, (dx, _), _ = value_and_vjp(f, x, w)
  assert out[1] == 0.0 and out[3] == 0.0 and np.all(dx[1] == 0) and np.all(dx[3] == 0)
  ref = _reference(x, w, jnp.maximum(labels, 0), "arc", 64.0, 0.5)
  np.testing.assert_allclose(out[np.array([0, 2, 4])], ref[np.array([0, 2, 4])], rtol=1e-5)
  # a masked class is deleted: equal to the loss without that column
  keep_labels = jnp.array([0, 1, 2, 3, 4])
  masked = cosface(x, w, keep_labels, where=classes)
  np.testing.assert_allclose(masked, cosface(x, w[:, :-1], keep_labels), rtol=1e-6)
  assert cosface(x, w, labels.at[1].set(0), where=classes)[2] == jnp.inf


def test_bfloat16_is_computed_in_float32():
  x, w, labels = _inputs(5)
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  out, (dx, dw), _ = value_and_vjp(_ours("arc", labels, 16.0, 0.5), xb, wb)
  assert out.dtype == dx.dtype == dw.dtype == jnp.bfloat16
  ref = _reference(xb.astype(jnp.float32), wb.astype(jnp.float32), labels, "arc", 16.0, 0.5)
  np.testing.assert_allclose(out.astype(np.float32), ref, rtol=1e-2, atol=1e-2)


def test_adacos_scale_matches_float64_reference():
  x, w, labels = _inputs(7)
  np.testing.assert_allclose(js.losses.adacos_scale(x, w, labels), np.sqrt(2) * np.log(C - 1),
                             rtol=1e-6)
  where = jnp.array([True, True, False, True, True])
  got = jax.jit(lambda a, b, s: js.losses.adacos_scale(a, b, labels, previous_scale=s,
                                                       where=where))(x, w, 5.0)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  cos = (x64 / np.linalg.norm(x64, axis=1, keepdims=True)) @ (w64 / np.linalg.norm(w64, axis=0))
  keep = np.asarray(where)
  rows = np.arange(B)[keep]
  y = np.asarray(labels)[keep]
  e = np.exp(5.0 * cos[rows])
  b_avg = np.mean(e.sum(-1) - e[np.arange(len(rows)), y])
  theta_med = np.median(np.arccos(cos[rows, y]))
  np.testing.assert_allclose(got, np.log(b_avg) / np.cos(min(np.pi / 4, theta_med)), rtol=1e-5)


def test_bad_input_names_the_argument():
  x, w, labels = _inputs(6)
  arc = js.losses.arcface_loss
  check_raises(
      ("`class_weights`", lambda: arc(x, w.T, labels)),
      ("`class_weights`", lambda: arc(x, w[None], labels)),
      ("`embeddings`", lambda: arc(x.astype(jnp.complex64), w, labels)),
      ("`labels`", lambda: arc(x, w, labels[:2])),
      ("`labels`", lambda: arc(x, w, labels.astype(jnp.float32))),
      ("`margin`", lambda: arc(x, w, labels, margin=-0.1)),
      ("`margin`", lambda: arc(x, w, labels, margin=4.0)),
      ("`scale`", lambda: arc(x, w, labels, scale=0.0)),
      ("`temperature`", lambda: js.losses.normalized_softmax_loss(x, w, labels, temperature=-1)),
      ("`where`", lambda: js.losses.cosface_loss(x, w, labels, where=jnp.ones((2, 3), bool))),
      ("`ignore_index`", lambda: js.losses.cosface_loss(x, w, labels, ignore_index=1.5)),
      ("`class_weights`", lambda: js.losses.adacos_scale(x, w[:, :1], labels)),
      ("`labels`", lambda: js.losses.adacos_scale(x, w, labels[:2], previous_scale=3.0)),
  )
