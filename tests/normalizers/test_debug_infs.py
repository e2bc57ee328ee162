"""Every registered normalizer under ``jax.debug_infs`` and ``jax.debug_nans`` (issue 37, defect 3).

On finite scores (with masked entries and a fully masked row) no normalizer may trip the
flags, forward or backward, as ``jax.nn.softmax`` does not: the sentinels of the input
rules (a masked max of ``-inf``, a NaN constant) stay inside one jitted computation
(``common.jit_under_debug_checks``), and the values are those of the unchecked call.
The default run takes one normalizer of each kind of solve (class E through the softmax
custom derivative, T, P, R); ``-m slow`` runs every normalizer. The reference is the same
call without the flags, jitted: the checked call is jitted too, so the two agree to a few
float32 ulps (XLA may fuse them differently), not bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import normalizers as N
from tests.helpers import sampled

DEFAULT = ("softmax", "sparsemax", "sigmoid", "standardized_softmax")


def _call(name, x, where):
  spec = N.get(name)
  hp = {"k": 2} if name == "top_k_softmax" else {}
  if spec.needs_key:
    return spec.fn(jax.random.key(0), x, -1, where, **hp)
  return spec.fn(x, -1, where, **hp)


def _rows():
  x = jax.random.normal(jax.random.key(0), (3, 7), jnp.float32) * 2.0
  where = np.ones((3, 7), bool)
  where[0] = False  # a fully masked row: zeros, zero gradient
  where[1, ::2] = False
  ct = jax.random.normal(jax.random.key(1), (3, 7), jnp.float32)
  return x, jnp.asarray(where), ct


def _value_and_grad(name, x, where, ct):
  out, vjp = jax.vjp(lambda v: _call(name, v, where), x)
  return out, vjp(ct.astype(out.dtype))[0]


@pytest.mark.parametrize("name", sampled(N.names(), DEFAULT))
def test_debug_infs_and_nans_pass_on_finite_scores(name):
  x, where, ct = _rows()
  for wh in (where, None):
    want = jax.jit(_value_and_grad, static_argnums=0)(name, x, wh, ct)
    with jax.debug_infs(True), jax.debug_nans(True):
      got = _value_and_grad(name, x, wh, ct)
    for a, b in zip(got, want, strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7,
                                 err_msg=name)
    if wh is not None:  # the fully masked row: exact zeros and a zero gradient
      assert not np.asarray(got[0])[0].any() and not np.asarray(got[1])[0].any()


def test_debug_checks_keep_array_hyperparameters_and_their_checks():
  x, where, ct = _rows()
  alpha = jnp.array([[1.3], [1.7], [2.5]])  # a per-row (traced under the check) alpha
  f = lambda v: N.entmax(v, where=where, alpha=alpha)  # noqa: E731
  want = jax.jit(lambda v: jax.vjp(f, v)[1](ct)[0])(x)
  with jax.debug_infs(True), jax.debug_nans(True):
    out, vjp = jax.vjp(f, x)
    got = vjp(ct)[0]
    # a concrete out-of-range array is still refused by name, not run as a tracer
    with pytest.raises(ValueError, match="alpha"):
      N.entmax(x, alpha=jnp.array([[1.3], [0.5], [2.0]]))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(out).sum(-1), [0.0, 1.0, 1.0], atol=1e-6)
