"""The delta rules' chunked backward from the kept UT transform (issue 12): the forward pass
keeps ``(I + A)^{-1}``, the WY factors ``W, U_tilde`` and the written values ``U``; the
backward differentiates the UT transform by hand and the Gram matrix ``K K^T`` by its own
rule. Checked against independent references: a float64 linear solve for the kept factors,
the einsum's autodiff for the Gram rule, and the token-by-token recurrent form's autodiff
(no UT transform at all) for every gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.linear import chunk as _chunk
from jaxsoft.linear import recurrence
from tests import helpers
from tests.linear import cases


def test_kept_wy_factors_solve_the_ut_system():
  """The residuals of the chunked forward pass: ``(I + A) W = β e^G K`` and
  ``(I + A) U_tilde = β V`` per chunk (float64 solve), ``(I + A)^{-1}`` the inverse, and
  ``U = U_tilde - W S`` with the kept chunk-start states ``S`` (runs change inside chunks)."""
  a = cases.inputs("gated_delta_rule", B=1, T=48, N=2, K=4, V=3, seed=21)
  bn = lambda x: jnp.moveaxis(x, 1, 2)
  C = 16
  run = _chunk.run_ids(cases.segments(1, 48, seed=22), 1, 48)
  xs = tuple(_chunk.to_chunks(bn(a[n]), 2, C) for n in ("q", "k", "v", "g", "beta"))
  rc = _chunk.to_chunks(run, 1, C)
  run_prev = jnp.concatenate([rc[:, :1, 0], rc[:, :-1, -1]], axis=1)
  _, res = jax.jit(recurrence._chunked_recompute_fwd)(xs, rc, run_prev, a["initial_state"])
  starts, (T_inv, U_tilde, W, U) = res[3], res[4]
  _, _, _, _, Kb, Vb, A = (np.asarray(x, np.float64)
                           for x in jax.jit(recurrence._chunk_parts)(*xs, rc, run_prev))
  M = np.eye(C) + A
  assert np.all(np.triu(A) == 0)
  np.testing.assert_allclose(W, np.linalg.solve(M, Kb), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(U_tilde, np.linalg.solve(M, Vb), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(T_inv, np.linalg.inv(M), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
      U, np.asarray(U_tilde) - np.asarray(W) @ np.asarray(starts), rtol=1e-5, atol=1e-5)


def test_gram_rule_equals_einsum_autodiff():
  """``_gram``'s backward ``(D + D^T) x`` equals autodiff of ``einsum(x, x)``."""
  x = helpers.standard_normal(0, (3, 7, 5))
  D = helpers.standard_normal(1, (3, 7, 7))
  got = jax.vjp(recurrence._gram, x)[1](D)[0]
  want = jax.vjp(lambda x: jnp.einsum("...ik,...jk->...ij", x, x), x)[1](D)[0]
  np.testing.assert_allclose(recurrence._gram(x), jnp.einsum("...ik,...jk->...ij", x, x),
                             rtol=1e-6)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["gated_delta_rule",
                                     pytest.param("delta_rule", marks=pytest.mark.slow)])
def test_chunked_gradients_equal_the_recurrent_form(variant):
  """T = 37 in chunks of 16 (the last chunk short), two batch rows with segments, an
  initial state and ``beta`` up to 1.95 (negative eigenvalues): the value and every gradient
  (q, k, v, g, beta, the initial state) of the chunked form equal autodiff through the
  recurrent form to 1e-5 relative to the gradient's largest entry."""
  args = cases.inputs(variant, B=2, T=37, N=2, K=4, V=3, seed=31)
  seg = cases.segments(2, 37, seed=32)
  w = jax.random.normal(jax.random.key(33), args["v"].shape)
  ws = jax.random.normal(jax.random.key(34), args["initial_state"].shape)

  def loss(form, a):
    o, S = cases._call(variant, a, implementation=form, chunk_size=16, segment_ids=seg)
    return jnp.sum(o * w) + jnp.sum(S * ws)

  got, want = (jax.jit(jax.value_and_grad(functools.partial(loss, f)))(args)
               for f in ("chunked", "recurrent"))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert set(got[1]) == set(args)
  for name in args:
    assert np.all(np.isfinite(got[1][name])), name
    scale = float(jnp.max(jnp.abs(want[1][name])))
    np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-5, atol=1e-5 * scale,
                               err_msg=name)
