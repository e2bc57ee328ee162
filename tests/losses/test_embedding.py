"""orthogonal_projection_loss and nbc_softmax_loss (feature L17) against float64
references: gradients, masks, extreme and bf16 inputs and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft as js
from tests.helpers import check_raises, rows
from tests.losses.references import grads64, jitted_losses, np_ce

L = jitted_losses({
    "orthogonal_projection_loss": ("gamma",),
    "nbc_softmax_loss": ("weight", "block_size"),
})


def _np_opl(f, y, gamma):
  f = np.asarray(f, np.float64)
  fh = f / np.linalg.norm(f, axis=-1, keepdims=True)
  cos = fh @ fh.T
  n = len(y)
  same = [cos[i, j] for i in range(n) for j in range(n) if i != j and y[i] == y[j]]
  diff = [cos[i, j] for i in range(n) for j in range(n) if y[i] != y[j]]
  return (1 - np.mean(same)) + gamma * abs(np.mean(diff))


def test_orthogonal_projection_loss():
  f = np.asarray(rows(10, (6, 4)), np.float64)
  y = np.array([0, 1, 0, 2, 1, 1])
  np.testing.assert_allclose(L.orthogonal_projection_loss(jnp.asarray(f, jnp.float32), y),
                             _np_opl(f, y, 0.5), rtol=1e-5)
  scaled = f * np.array([1.0, 3.0, 0.1, 7.0, 2.0, 1e3])[:, None]
  np.testing.assert_allclose(L.orthogonal_projection_loss(scaled, y),
                             L.orthogonal_projection_loss(f, y), rtol=1e-5)
  keep = np.array([True, True, True, False, True, False])
  np.testing.assert_allclose(L.orthogonal_projection_loss(f, y, gamma=0.7, where=keep),
                             _np_opl(f[keep], y[keep], 0.7), rtol=1e-5)
  onehot = np.eye(4)[y] * 2.5
  assert abs(float(L.orthogonal_projection_loss(onehot, y))) < 1e-6
  grads64(lambda a: L.orthogonal_projection_loss(a, y), f)
  check_raises(("features", lambda: js.losses.orthogonal_projection_loss(jnp.ones(3), y)),
               ("labels", lambda: js.losses.orthogonal_projection_loss(f, y[:3])),
               ("gamma", lambda: js.losses.orthogonal_projection_loss(f, y, gamma=-1.0)),
               ("where", lambda: js.losses.orthogonal_projection_loss(f, y, where=jnp.ones(2, bool))))


# ----------------------------------------------------------------------------- NBC-softmax


def _np_nbc(x, w, y, lam, block, tau):
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  ce = np_ce(x @ w, y)
  xh = x / np.linalg.norm(x, axis=-1, keepdims=True)
  wh = w / np.linalg.norm(w, axis=0, keepdims=True)
  n = len(y)
  out = []
  for i in range(n):
    terms = [xh[i] @ wh[:, y[i]] / tau]
    for b in range(0, n, block):
      js_ = [j for j in range(b, min(b + block, n)) if y[j] != y[i]]
      if js_:
        terms.append(xh[i] @ xh[js_].mean(0) / tau)
    t = np.array(terms)
    out.append(ce[i] + lam * (np.log(np.exp(t - t.max()).sum()) + t.max() - t[0]))
  return np.array(out)


@pytest.mark.parametrize("block", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_nbc_softmax_against_reference(block):
  x = np.asarray(rows(11, (7, 3)), np.float64)
  w = np.asarray(rows(12, (3, 4)), np.float64)
  y = np.array([0, 1, 1, 3, 2, 0, 1])
  got = L.nbc_softmax_loss(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), y,
                           weight=0.5, block_size=block, temperature=0.5)
  np.testing.assert_allclose(got, _np_nbc(x, w, y, 0.5, block, 0.5), rtol=1e-5)
  grads64(lambda a, b: L.nbc_softmax_loss(a, b, y, weight=0.5, block_size=block,
                                           temperature=0.5), x, w)


def test_nbc_softmax_edges():
  x, w = rows(13, (5, 3)), rows(14, (3, 4))
  y = jnp.array([0, 1, 2, 3, 0])
  np.testing.assert_allclose(L.nbc_softmax_loss(x, w, y, weight=0.0),
                             optax.softmax_cross_entropy_with_integer_labels(x @ w, y), rtol=1e-6)
  assert np.all(np.asarray(L.nbc_softmax_loss(x, w, y)) >= np.asarray(
      L.nbc_softmax_loss(x, w, y, weight=0.0)))
  keep = jnp.array([True, True, False, True, True])
  out = L.nbc_softmax_loss(x, w, y, where=keep, block_size=2)
  assert float(out[2]) == 0.0
  g = jax.grad(lambda a: L.nbc_softmax_loss(a, w, y, where=keep).sum())(x)
  assert not np.any(np.asarray(g)[2]), "a masked example neither trains nor serves as negative"
  bf = L.nbc_softmax_loss(x.astype(jnp.bfloat16), w, y)
  assert bf.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(bf, np.float32)))
  v = L.nbc_softmax_loss(x * 1e3, w, y, temperature=1e-3)
  assert np.all(np.isfinite(v))
  check_raises(("block_size", lambda: js.losses.nbc_softmax_loss(x, w, y, block_size=0)),
               ("weight", lambda: js.losses.nbc_softmax_loss(x, w, y, weight=-1.0)),
               ("class_weights", lambda: js.losses.nbc_softmax_loss(x, w.T, y)),
               ("temperature", lambda: js.losses.nbc_softmax_loss(x, w, y, temperature=0.0)))
