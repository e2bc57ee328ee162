"""Rules with e^{-m} terms (softpick, softmax_1) stay finite when a whole key block is below -88.

TileRule.m_floor = 0 floors the running max; without it e^{-m} overflows on the first key
block and the later rescaling turns inf * 0 into NaN.
"""

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxsoft as js
import kernels_pallas as kp
from tests import helpers

H = 64


def _inputs():
  q = jnp.zeros((1, 16, 1, H)).at[..., 0].set(1.0)
  # first key block: every logit -300; second block: logits near 1.
  k = jnp.zeros((1, 128, 1, H)).at[:, :64, :, 0].set(-300.0).at[:, 64:, :, 0].set(1.0)
  k = k.at[:, 64:, :, 1].set(helpers.standard_normal(0, (1, 64, 1)))
  v = helpers.standard_normal(2, (1, 128, 1, H))
  return q, k, v


@pytest.mark.parametrize("normalizer", ["softpick", "softmax_1"])
def test_floor_keeps_extreme_blocks_finite(normalizer):
  q, k, v = _inputs()
  assert js.normalizers.get(normalizer).tile.m_floor == 0.0
  ct = jax.random.normal(jax.random.key(3), q.shape)

  def run(fn):  # jitted: one compilation per path, not one per op
    @jax.jit
    def f(q, k, v, ct):
      out, vjp = jax.vjp(fn, q, k, v)
      return out, vjp(ct)
    return f(q, k, v, ct)

  ref = run(lambda q, k, v: js.attention.dot_product_attention(
      q, k, v, normalizer=normalizer, scale=1.0, implementation="xla"))
  got = run(lambda q, k, v: kp.attention(
      q, k, v, normalizer=normalizer, scale=1.0, interpret=True, backend="triton",
      block_sizes={"block_q": 16, "block_k": 64}))
  for tree in got:
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(tree))
  chex.assert_trees_all_close(got, ref, atol=1e-5, rtol=1e-5)
