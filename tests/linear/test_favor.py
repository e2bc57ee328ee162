"""Performer's FAVOR+ random features (:func:`jaxsoft.linear.favor_feature_map`, feature A30):
orthogonal Gaussian rows and positive features, an unbiased estimate of the softmax kernel,
linear attention on them approaching softmax attention, and the forms of linear attention
agreeing on them with gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import linear
from jaxsoft.linear import _features
from tests import helpers
from tests.linear import cases

B, T, N, K, V = 2, 11, 2, 3, 2


def _qkv(T=T, seed=0):
  return cases.random_qkv(jax.random.split(jax.random.key(seed), 6), B, T, N, K, V)


def test_favor_rows_are_orthogonal_gaussians_and_features_positive():
  """Rows in one block are orthogonal; the map is fixed by the key; features are > 0."""
  W = _features._orthogonal_gaussian(jax.random.key(1), 6, 3)
  for block in (W[:3], W[3:]):
    gram = block @ block.T
    np.testing.assert_allclose(gram - jnp.diag(jnp.diag(gram)), 0.0, atol=1e-5)
  x = helpers.standard_normal(2, (5, 3))
  phi = linear.favor_feature_map(jax.random.key(3), 3, 8)
  np.testing.assert_array_equal(phi(x), linear.favor_feature_map(jax.random.key(3), 3, 8)(x))
  assert not np.allclose(phi(x), linear.favor_feature_map(jax.random.key(4), 3, 8)(x))
  assert bool(jnp.all(phi(x) > 0))


def test_favor_kernel_is_unbiased():
  """The mean of φ(q)·φ(k) over 64 independent draws of 64 features is exp(scale q·k)
  within 4 standard errors (the estimator's own spread across the draws)."""
  q, k = 0.5 * helpers.standard_normal(5, (2, 4))
  def draw(key):
    phi = linear.favor_feature_map(key, 4, 64)
    return phi(q) @ phi(k)
  draws = jax.jit(jax.vmap(draw))(jax.random.split(jax.random.key(6), 64))
  want = float(jnp.exp(q @ k / 2.0))
  assert abs(float(draws.mean()) - want) < 4 * float(draws.std()) / 8 + 1e-6


def test_favor_attention_approaches_softmax_attention():
  """linear_attention with FAVOR+ features estimates causal softmax attention: the error,
  averaged over 3 draws, falls as the number of features grows (16 -> 256 -> 4096)."""
  args = _qkv(T=8)
  q, k, v = 0.7 * args["q"], 0.7 * args["k"], args["v"]
  logits = jnp.einsum("btnk,bsnk->bnts", q, k) * K ** -0.5
  logits = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), logits, -jnp.inf)
  soft = jnp.einsum("bnts,bsnv->btnv", jax.nn.softmax(logits, axis=-1), v)

  @functools.partial(jax.jit, static_argnums=1)
  def error(key, m):
    o = linear.linear_attention(q, k, v, feature_map=linear.favor_feature_map(key, K, m))
    return jnp.mean(jnp.abs(o - soft))

  keys = jax.random.split(jax.random.key(8), 3)
  errors = [float(np.mean([error(key, m) for key in keys])) for m in (16, 256, 4096)]
  assert errors[0] > errors[1] > errors[2], errors
  assert errors[2] < 0.03, errors


def test_favor_forms_agree_with_gradients():
  """FAVOR+ features through the three forms of linear_attention: values and gradients."""
  args = _qkv()
  phi = linear.favor_feature_map(jax.random.key(9), K, 8)
  seg = cases.segments(B, T, seed=2)

  def loss(form, a):
    return jnp.sum(jnp.sin(linear.linear_attention(
        a["q"], a["k"], a["v"], feature_map=phi, implementation=form, chunk_size=4,
        segment_ids=seg)))

  results = {f: jax.jit(jax.value_and_grad(functools.partial(loss, f)))(args)
             for f in cases.FORMS}
  for form in ("parallel", "chunked"):
    np.testing.assert_allclose(results[form][0], results["recurrent"][0], rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=2e-5, atol=2e-5 * float(jnp.max(jnp.abs(b)))),
        results[form][1], results["recurrent"][1])


@pytest.mark.parametrize("bad", [
    ("`key`", lambda: linear.favor_feature_map(0, 4)),
    ("`head_dim`", lambda: linear.favor_feature_map(jax.random.key(0), 0)),
    ("`num_features`", lambda: linear.favor_feature_map(jax.random.key(0), 4, 2.0)),
    ("`scale`", lambda: linear.favor_feature_map(jax.random.key(0), 4, scale=-1.0)),
])
def test_favor_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
