"""Hedgehog (feature A30; :func:`jaxsoft.linear.hedgehog_feature_map` and its helpers):
linear attention with the learned features applies the attention map the functions compute,
the distillation loss is the cross-entropy written in numpy, and a few Adam steps of
distillation bring the map close to spiky softmax attention."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsoft import linear
from tests.linear import cases

B, N, K, V = 2, 3, 4, 3


def _qkv(T, seed):
  return cases.random_qkv(jax.random.split(jax.random.key(seed), 10), B, T, N, K, V,
                          unit_keys=True)


def test_hedgehog_features_give_the_attention_map_of_linear_attention():
  """linear_attention with Hedgehog features applies hedgehog_attention_weights (rows sum to
  1, positive on j <= i), and the loss is the cross-entropy written in numpy."""
  a = _qkv(T=7, seed=10)
  params = linear.hedgehog_init(N, K, 5, key=jax.random.key(1), noise=0.3)

  @jax.jit
  def outputs(params, q, k, v):
    phi = linear.hedgehog_feature_map(params)
    return (linear.linear_attention(q, k, v, feature_map=phi),
            linear.hedgehog_attention_weights(params, q, k),
            linear.hedgehog_distillation_loss(params, q, k))

  o, weights, loss = outputs(params, a["q"], a["k"], a["v"])
  np.testing.assert_allclose(o, jnp.einsum("bnts,bsnv->btnv", weights, a["v"]),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jnp.sum(weights, -1), 1.0, rtol=1e-5)
  tril = np.tril(np.ones((7, 7), bool))
  assert bool(jnp.all(jnp.where(tril, weights > 0, weights == 0)))
  s = np.einsum("btnk,bsnk->bnts", a["q"], a["k"]) * K ** -0.5
  s = np.where(tril, s, -np.inf)
  teacher = np.exp(s - s.max(-1, keepdims=True))
  teacher /= teacher.sum(-1, keepdims=True)
  ce = -np.sum(np.where(tril, teacher * np.log(np.where(tril, weights, 1.0)), 0.0), -1).mean()
  np.testing.assert_allclose(loss, ce, rtol=1e-5)


def test_hedgehog_distillation_lowers_the_attention_kl():
  """40 Adam steps of attention distillation on a fixed batch of spiky softmax attention
  (scores scaled by 3) lower the mean KL(softmax ‖ Hedgehog) by more than half, and the
  distilled map is closer than elu+1 linear attention's."""
  a = _qkv(T=16, seed=11)
  q, k = 3.0 * a["q"], 3.0 * a["k"]
  tril = jnp.tril(jnp.ones((16, 16), bool))

  @jax.jit  # the teacher's entropy and elu+1's KL in one compilation, not one per op
  def teacher_terms(q, k):
    s = jnp.where(tril, jnp.einsum("btnk,bsnk->bnts", q, k) * K ** -0.5, -jnp.inf)
    teacher = jax.nn.softmax(s, -1)
    entropy = -jnp.mean(jnp.sum(jnp.where(tril, teacher * jnp.log(teacher), 0.0), -1))
    fq, fk = jax.nn.elu(q) + 1, jax.nn.elu(k) + 1
    elu = jnp.where(tril, jnp.einsum("btnk,bsnk->bnts", fq, fk), 0.0)
    elu = elu / jnp.sum(elu, -1, keepdims=True)
    kl_elu = jnp.mean(jnp.sum(jnp.where(
        tril, teacher * (jnp.log(teacher) - jnp.log(jnp.where(tril, elu, 1.0))), 0.0), -1))
    return entropy, kl_elu

  entropy, kl_elu = teacher_terms(q, k)
  kl_elu = float(kl_elu)
  kl = jax.jit(lambda p: linear.hedgehog_distillation_loss(p, q, k) - entropy)

  params = linear.hedgehog_init(N, K, 8)
  opt = optax.adam(0.05)

  @jax.jit
  def step(p, state):
    grads = jax.grad(linear.hedgehog_distillation_loss)(p, q, k)
    updates, state = opt.update(grads, state, p)
    return optax.apply_updates(p, updates), state

  before = float(kl(params))
  state = jax.jit(opt.init)(params)
  for _ in range(40):
    params, state = step(params, state)
  after = float(kl(params))
  assert after < 0.5 * before, (before, after)
  assert after < kl_elu, (after, kl_elu)


@pytest.mark.parametrize("bad", [("`feature_dim`", lambda: linear.hedgehog_init(2, 3, 0))])
def test_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
