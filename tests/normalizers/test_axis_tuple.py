"""A tuple `axis` makes one row of the named axes, as in jax.nn (issue 37, defect 5), and
complex scores are refused with a message instead of losing their imaginary part (defect 15).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests import helpers

X = helpers.standard_normal(0, (2, 3, 4, 5))
MASK = jax.random.bernoulli(jax.random.key(1), 0.7, X.shape)


def _by_rows(fn, x, axes, **kw):
  """Reference: move the axes last, flatten them, normalise over the last axis, restore."""
  x = np.asarray(x)
  rest = [d for d in range(x.ndim) if d not in axes]
  moved = np.transpose(x, rest + list(axes))
  flat = moved.reshape(moved.shape[:len(rest)] + (-1,))
  out = np.asarray(fn(jnp.asarray(flat), axis=-1, **kw)).reshape(moved.shape)
  return np.transpose(out, np.argsort(rest + list(axes)))


def test_softmax_log_softmax_logsumexp_match_jax_nn():
  cases = [(axes, masked) for axes in [(1, 3), (0, 2), (3, 1), (-1, -3), (0, 1, 2, 3)]
           for masked in (False, True)]

  @jax.jit  # one program for the 80 calls rather than op by op
  def pairs(x, mask):
    out = []
    for axes, masked in cases:
      where = mask if masked else None
      out.append((js.normalizers.softmax(x, axis=axes, where=where),
                  jax.nn.softmax(x, axis=axes, where=where)))
      out.append((js.normalizers.log_softmax(x, axis=axes, where=where),
                  jax.nn.log_softmax(x, axis=axes, where=where)))
      for keepdims in (False, True):
        out.append((js.normalizers.logsumexp(x, axis=axes, where=where, keepdims=keepdims),
                    jax.nn.logsumexp(x, axis=axes, where=where, keepdims=keepdims)))
    return out

  got = pairs(X, MASK)
  for i, (axes, masked) in enumerate(cases):
    # softmax, log_softmax, logsumexp, logsumexp(keepdims=True)
    for (ours, want), atol in zip(got[4 * i:4 * i + 4], (1e-6, 1e-5, 1e-5, 1e-5), strict=True):
      assert ours.shape == want.shape, (axes, masked)
      chex.assert_trees_all_close(ours, want, atol=atol, custom_message=f"{axes} {masked}")


@pytest.mark.parametrize("name", helpers.registry_sample(js.normalizers.REGISTRY))
def test_every_normalizer_takes_a_tuple_axis_as_one_row(name):
  spec = js.normalizers.get(name)
  if spec.needs_key:
    key = jax.random.key(2)
    out = spec.fn(key, X, axis=(1, 3))
    # the same key draws the same noise for the same row layout
    want = _by_rows(lambda x, axis: spec.fn(key, x, axis=axis), X, (1, 3))
  else:
    out = spec.fn(X, axis=(1, 3))
    want = _by_rows(spec.fn, X, (1, 3))
  assert out.shape == X.shape
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_row_hyperparameter_arrays_follow_the_rows():
  t = jnp.array([0.5, 1.0, 2.0]).reshape(1, 3, 1, 1)  # one temperature per index of axis 1
  out = js.normalizers.softmax(X, axis=(0, 2), temperature=t)
  want = jax.nn.softmax(X / t, axis=(0, 2))
  chex.assert_trees_all_close(out, want, atol=1e-6)
  with pytest.raises(ValueError, match="softmax: `temperature` must have size 1"):
    js.normalizers.softmax(X, axis=(1, 3), temperature=t)


def test_gradients_match_jax_nn():
  cot = helpers.random_cotangent(X.shape)
  g = jax.grad(lambda x: jnp.sum(js.normalizers.softmax(x, axis=(1, 3)) * cot))(X)
  want = jax.grad(lambda x: jnp.sum(jax.nn.softmax(x, axis=(1, 3)) * cot))(X)
  chex.assert_trees_all_close(g, want, atol=1e-6)


@pytest.mark.parametrize("axis, match", [((), "at least one axis"), ((1, 1), "twice"),
                                         ((0, 4), "out of range")])
def test_bad_tuple_axis_names_the_argument(axis, match):
  with pytest.raises(ValueError, match=match):
    js.normalizers.softmax(X, axis=axis)


@pytest.mark.parametrize("fn", [js.normalizers.softmax, js.normalizers.sparsemax,
                                js.normalizers.log_softmax, js.normalizers.logsumexp])
def test_complex_scores_are_refused(fn):
  with pytest.raises(ValueError, match="`x` must be real, got complex64"):
    fn(jnp.array([1.0 + 2.0j, 0.5 - 1.0j]))


def test_tuple_axis_fully_masked_row_is_zeros_with_zero_gradient():
  where = jnp.ones(X.shape, bool).at[0].set(False)  # batch 0: every entry of its rows masked
  for fn in (js.normalizers.softmax, js.normalizers.sparsemax):
    out = fn(X, axis=(1, 3), where=where)
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.isfinite(np.asarray(out)))
    g = jax.jit(jax.grad(lambda x, fn=fn: jnp.sum(fn(x, axis=(1, 3), where=where) ** 2)))(X)
    assert np.all(np.asarray(g[0]) == 0) and np.all(np.isfinite(np.asarray(g)))
