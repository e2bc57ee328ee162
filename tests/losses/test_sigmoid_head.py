"""sigmoid_head_loss and sigmoid_head_negatives (the Sigmoid Head's filtered negative
sampling, feature N33) against a float64 NumPy reference: the filter's guarantees, uniform
draws, determinism, the loss and its gradient, masks, bf16 and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests.helpers import check_raises, rows
from tests.losses.references import grads64

negs = jax.jit(js.losses.sigmoid_head_negatives,
               static_argnames=("num_negatives", "num_filtered", "axis"))
loss = jax.jit(js.losses.sigmoid_head_loss,
               static_argnames=("num_negatives", "num_filtered", "axis"))


def _np_loss(o, y, neg):
  """-log sigma(o_y) - sum_{n >= 0} log sigma(-o_n), float64."""
  o = np.asarray(o, np.float64)
  out = []
  for orow, yr, nr in zip(o, y, neg, strict=True):
    v = np.log1p(np.exp(-orow[yr]))
    v += sum(np.log1p(np.exp(orow[n])) for n in nr if n >= 0)
    out.append(v)
  return np.array(out)


def test_negatives_filter_are_distinct_deterministic_and_uniform():
  lm = np.asarray(rows(0, (5, 8), 2.0))
  y = np.array([0, 7, 3, 3, 1])
  cls = np.ones((5, 8), bool)
  cls[2, :5] = False  # row 2: only 5, 6, 7 visible, the label 3 hidden
  many = jnp.asarray(np.tile([[0.0, 0, 0, 0, 0, 9.0]], (4000, 1)))

  @jax.jit
  def run():
    f = js.losses.sigmoid_head_negatives
    return (f(jax.random.key(0), lm, y, 4, num_filtered=2, where=cls),
            f(jax.random.key(0), lm, y, 4, num_filtered=2, where=cls),
            f(jax.random.key(1), lm, y, 4, num_filtered=2, where=cls),
            f(jax.random.key(2), many, jnp.zeros(4000, int), 1, num_filtered=1))

  n, again, other, draws = map(np.asarray, run())
  np.testing.assert_array_equal(n, again)
  assert not np.array_equal(n, other)
  for r in range(5):
    lm_vis = np.where(cls[r], lm[r], -np.inf)
    top2 = set(np.argsort(-lm_vis, kind="stable")[:2])
    eligible = {c for c in range(8) if cls[r, c] and c != y[r] and c not in top2}
    drawn = [c for c in n[r] if c >= 0]
    assert len(set(drawn)) == len(drawn) and set(drawn) <= eligible
    assert len(drawn) == min(4, len(eligible))  # -1 fills the rest
  # uniform over the eligible classes: 4 of 6 (label 0, filtered top token 5)
  freq = np.bincount(draws[:, 0], minlength=6) / 4000
  assert freq[0] == 0 and freq[5] == 0
  np.testing.assert_allclose(freq[1:5], 0.25, atol=0.03)  # sd 0.0068: 4.4 sd


def _case():
  o = np.asarray(rows(1, (4, 7), 2.0), np.float64)
  lm = np.asarray(rows(2, (4, 7), 2.0))
  y = np.array([1, 0, 6, 2])
  given = np.array([[2, -1, 3], [1, 1, 5], [0, 1, 2], [6, 5, -1]])
  return o, lm, y, given


def test_loss_against_reference_and_gradient():
  o, lm, y, given = _case()
  key = jax.random.key(3)

  @jax.jit
  def run(o):
    drawn = js.losses.sigmoid_head_negatives(key, lm, y, 3, num_filtered=2)
    f = lambda a: js.losses.sigmoid_head_loss(None, a, y, None, 3, negatives=given)
    return (drawn, js.losses.sigmoid_head_loss(key, o, y, lm, 3, num_filtered=2),
            *jax.value_and_grad(lambda a: jnp.sum(f(a)))(o))

  drawn, got, total, g = run(jnp.asarray(o, jnp.float32))
  np.testing.assert_allclose(got, _np_loss(o, y, np.asarray(drawn)), rtol=1e-5)  # f32 softplus
  np.testing.assert_allclose(total, _np_loss(o, y, given).sum(), rtol=1e-6)
  sig = 1 / (1 + np.exp(-o))
  want = np.zeros_like(o)
  want[np.arange(4), y] -= 1 - sig[np.arange(4), y]
  for r in range(4):
    for c in given[r]:
      if c >= 0:
        want[r, c] += sig[r, c]
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_gradients_float64_and_masks():
  o, _, y, given = _case()
  f = functools.partial(loss, None, labels=y, lm_logits=None, num_negatives=3, negatives=given)
  grads64(lambda a: f(a), o)
  # class mask: a masked negative is skipped, a masked label gives +inf; example mask gives 0
  cls = np.ones((4, 7), bool)
  cls[0, 2] = False
  cls[1, 0] = False
  out = np.asarray(f(o, where=cls))
  np.testing.assert_allclose(out[0], _np_loss(o[:1], y[:1], [[3]])[0], rtol=1e-6)
  assert np.isinf(out[1]) and np.isfinite(out[2:]).all()
  assert float(f(o, where=np.array([True, False, True, True]))[1]) == 0.0


@pytest.mark.slow
def test_bf16_and_errors():
  o = jnp.asarray(rows(3, (2, 5), 3.0))
  y = jnp.array([1, 2])
  key = jax.random.key(4)
  out = loss(key, o.astype(jnp.bfloat16), y, o, 2, num_filtered=1)
  want = loss(key, o.astype(jnp.bfloat16).astype(jnp.float32), y, o, 2, num_filtered=1)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=1e-2)  # bf16 output
  f = js.losses.sigmoid_head_loss
  check_raises(
      ("lm_logits", lambda: f(key, o, y, None, 2)),
      ("lm_logits", lambda: f(key, o, y, o[:, :3], 2)),
      ("negatives", lambda: f(None, o, y, None, 2, negatives=jnp.ones((2,), int))),
      ("num_negatives", lambda: js.losses.sigmoid_head_negatives(key, o, y, 0)),
      ("num_filtered", lambda: js.losses.sigmoid_head_negatives(key, o, y, 1, num_filtered=-1)),
      ("labels", lambda: f(key, o, jnp.ones(2), o, 2)))
