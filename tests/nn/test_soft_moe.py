"""A21 SoftMoE / soft_moe / soft_moe_weights (jaxsoft/nn/_soft_moe.py).

Oracles: numpy float64 dispatch/combine and experts written from the paper's formulas.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsoft.nn import SoftMoE, soft_moe, soft_moe_weights
from tests.helpers import check_raises, normal

B, M, D, E, P = 2, 7, 6, 3, 2


def _np_softmax(z, axis):
  e = np.exp(z - z.max(axis, keepdims=True))
  return e / e.sum(axis, keepdims=True)


def test_weights_and_layer_match_numpy_formula():
  x, phi = normal(0, (B, M, D)), normal(1, (D, E * P))
  w = normal(2, (E, D, D), 0.3)
  experts = lambda s: jnp.tanh(jnp.einsum("bnpd,nde->bnpe", s, w))
  out = jax.jit(lambda x, phi: soft_moe(x, phi, experts, num_experts=E))(x, phi)
  xn, pn, wn = (np.asarray(a, np.float64) for a in (x, phi, w))
  logits = xn @ pn  # [B, M, S]
  disp, comb = _np_softmax(logits, 1), _np_softmax(logits, 2)
  slots = np.einsum("bms,bmd->bsd", disp, xn).reshape(B, E, P, D)
  y = np.tanh(np.einsum("bnpd,nde->bnpe", slots, wn)).reshape(B, E * P, D)
  np.testing.assert_allclose(np.asarray(out), np.einsum("bms,bsd->bmd", comb, y), atol=1e-5)
  d, c = jax.jit(soft_moe_weights)(x, phi)
  np.testing.assert_allclose(np.asarray(d).sum(1), 1, rtol=1e-6)  # slots: convex mixtures
  np.testing.assert_allclose(np.asarray(c).sum(2), 1, rtol=1e-6)  # outputs: convex mixtures
  # normalised logits: scale · l2norm(x) · l2norm(phi)
  d2, _ = jax.jit(soft_moe_weights)(x, phi, scale=2.5)
  xh = xn / np.linalg.norm(xn, axis=-1, keepdims=True)
  ph = pn / np.linalg.norm(pn, axis=0, keepdims=True)
  np.testing.assert_allclose(np.asarray(d2), _np_softmax(2.5 * xh @ ph, 1), atol=1e-6)


def test_module_permutation_equivariance_mask_and_grads():
  layer = SoftMoE(D, E, P, hidden_features=8, normalize=True, rngs=nnx.Rngs(0))
  x = normal(3, (B, M, D))
  f = nnx.jit(lambda m, x: m(x))
  y = f(layer, x)
  perm = np.random.default_rng(0).permutation(M)
  chex.assert_trees_all_close(f(layer, x[:, perm]), y[:, perm], atol=1e-5, rtol=1e-5)
  # a padding token changes nothing for the others and gets a zero output
  mask = jnp.ones((B, M + 1), bool).at[:, -1].set(False)
  xp = jnp.concatenate([x, 100 * jnp.ones((B, 1, D))], axis=1)
  yp = nnx.jit(lambda m, x, mask: m(x, mask))(layer, xp, mask)
  chex.assert_trees_all_close(yp[:, :M], y, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(yp[:, -1]) == 0)
  grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) ** 2)))(layer, x)
  leaves = jax.tree.leaves(grads)
  assert len(leaves) == 6 and all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
  assert all(float(jnp.abs(g).max()) > 0 for g in leaves)
  lo = f(layer, x.astype(jnp.bfloat16))
  assert lo.dtype == jnp.bfloat16


def test_one_identity_expert_one_slot_is_the_same_pooled_token_everywhere():
  x, phi = normal(4, (B, M, D)), normal(5, (D, 1))
  out = jax.jit(lambda x, phi: soft_moe(x, phi, lambda s: s, num_experts=1))(x, phi)
  pooled = np.einsum("bm,bmd->bd", _np_softmax(np.asarray(x @ phi, np.float64)[..., 0], 1),
                     np.asarray(x, np.float64))
  np.testing.assert_allclose(np.asarray(out), np.broadcast_to(pooled[:, None], out.shape), atol=1e-5)


def test_errors_name_the_argument():
  check_raises(
      ("`num_experts`", lambda: SoftMoE(4, 0, rngs=nnx.Rngs(0))),
      ("`hidden_features`", lambda: SoftMoE(4, 2, hidden_features=0, rngs=nnx.Rngs(0))),
      ("`phi`", lambda: soft_moe(jnp.ones((1, 3, 4)), jnp.ones((4, 3)), lambda s: s, num_experts=2)),
      ("`x`", lambda: soft_moe(jnp.ones((3, 4)), jnp.ones((4, 2)), lambda s: s, num_experts=2)),
  )
