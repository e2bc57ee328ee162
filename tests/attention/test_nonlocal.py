"""A27 nonlocal_block (jaxsoft/attention/_nonlocal.py).

Oracles: numpy float64 in the quadratic (Theta Phi^T) G order the block re-associates, the
softmax (embedded Gaussian) block, and float64 finite differences.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft.attention import nonlocal_block
from tests.helpers import check_raises, normal

B = 2


def _nl_params(seed, C=5, D=4, Dv=6):
  return [normal(seed + i, s, 0.5) for i, s in enumerate([(C, D), (C, D), (C, Dv), (Dv, C)])]


def test_nonlocal_block_reassociation_equals_quadratic_order():
  x = normal(0, (B, 7, 5))
  wt, wp, wg, wo = _nl_params(1)
  xn, wt_, wp_, wg_, wo_ = (np.asarray(a, np.float64) for a in (x, wt, wp, wg, wo))
  for heads, use_softmax in ((1, False), (2, False), (2, True)):
    f = jax.jit(functools.partial(nonlocal_block, num_heads=heads, use_softmax=use_softmax))
    out = f(x, wt, wp, wg, wo)
    th, ph, g = (np.einsum("btc,cd->btd", xn, w).reshape(B, 7, heads, -1) for w in (wt_, wp_, wg_))
    a = np.einsum("binh,bjnh->bnij", th, ph)  # the T x T map the block never builds
    if use_softmax:
      a = np.exp(a - a.max(-1, keepdims=True))
      a = a / a.sum(-1, keepdims=True)
    else:
      a = a / 7
    y = np.einsum("bnij,bjnh->binh", a, g).reshape(B, 7, -1)
    np.testing.assert_allclose(np.asarray(out), xn + y @ wo_, atol=1e-5, rtol=1e-5)
  with jax.enable_x64(True):
    args = [a.astype(jnp.float64) for a in (x, wt, wp, wg, wo)]
    jax.test_util.check_grads(jax.jit(functools.partial(nonlocal_block, num_heads=2)), args,
                              order=1, modes=("rev",))
  lo = jax.jit(nonlocal_block)(x.astype(jnp.bfloat16), wt, wp, wg, wo)
  assert lo.dtype == jnp.bfloat16


def test_errors_name_the_argument():
  w = jnp.zeros((3, 2))
  x = jnp.zeros((1, 4, 3))
  check_raises(
      ("`w_theta`", lambda: nonlocal_block(x, w[:2], w, w, w.T)),
      ("`w_out`", lambda: nonlocal_block(x, w, w, w, w)),
      ("`num_heads`", lambda: nonlocal_block(x, w, w, w, w.T, num_heads=3)),
  )
