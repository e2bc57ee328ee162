"""Feature A35, CCQ, the curvature-conditioned query (:func:`jaxsoft.linear.ccq`): against
the reconstructed [R] read as a float64 loop, the forms against each other with every
gradient, decoding steps against the full call, the curvature being the Hessian of the
log-partition, and strength 0 being the backbone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import linear
from jaxsoft.linear import _ccq, _dispatch
from tests.linear import cases, reference

B, T, N, K, V = 2, 11, 3, 4, 3


def _inputs(T=T, seed=0):
  ks = jax.random.split(jax.random.key(seed), 10)
  a = cases.gated_delta_inputs(ks, B, T, N, K, V)
  return a


def _call(a, **kw):
  return linear.ccq(a["q"], a["k"], a["v"], a["g"], a["beta"], strength=0.8,
                    output_final_state=True, **kw)


def test_matches_float64_reference():
  """T = 11, chunks of 4, segments; Gated DeltaNet backbone."""
  cases.assert_matches_reference(
      _call, _inputs(), lambda a, seg: reference.ccq(
          a["q"], a["k"], a["v"], g=a["g"], beta=a["beta"], strength=0.8, segment_ids=seg),
      segment_ids=cases.segments(B, T))


@pytest.mark.parametrize("with_parallel", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_forms_agree_with_gradients(with_parallel):
  """Outputs, final states (S, M) and the gradients of q, k, v, g and beta agree between the
  recurrent and the chunked form (and the parallel one under ``-m slow``)."""
  forms = ("recurrent", "chunked") + (("parallel",) if with_parallel else ())
  cases.assert_forms_agree(_call, _inputs(seed=1), forms,
                           segment_ids=cases.segments(B, T, seed=2), key=jax.random.key(3))


def test_step_matches_full_call():
  """``ccq_step`` token by token from zeros equals the chunked call (T = 5)."""
  a = _inputs(T=5, seed=21)
  step = jax.jit(lambda x, state: linear.ccq_step(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                  state, strength=0.8))
  cases.assert_steps_match(lambda x, state: step({n: x[n] for n in a}, state), a, None,
                           *cases.chunked(_call, a, chunk_size=2))


def test_ccq_curvature_is_the_hessian_of_the_log_partition():
  """Without decay, C_t q_t is the Hessian of ``x -> log Σ_{j<=t} exp(x·k_j)`` at x = 0
  applied to q_t (and that Hessian is the key covariance): jax.hessian as the oracle."""
  a = _inputs(T=6, seed=7)
  q, k = a["q"][:1, :, :1], 2.0 * a["k"][:1, :, :1]

  @jax.jit
  def both(q, k):
    call = _dispatch.prepare("ccq", q, k, q, scale=None, segment_ids=None,
                             implementation="chunked", chunk_size=4)
    cq = _ccq.curvature_query(call, call.q, call.k, None, None)[0][0, :, 0]
    keys = k[0, :, 0]

    def hessian(t):
      f = lambda x: jax.nn.logsumexp(jnp.where(jnp.arange(6) <= t, keys @ x, -jnp.inf))
      return jax.hessian(f)(jnp.zeros(K))

    return cq, jnp.einsum("tij,tj->ti", jax.vmap(hessian)(jnp.arange(6)), q[0, :, 0])

  cq, want = both(q, k)
  np.testing.assert_allclose(cq, want, rtol=1e-5, atol=1e-5)


def test_ccq_strength_zero_is_the_backbone_and_contracts():
  """λ = 0: Gated DeltaNet exactly; λ = 1 with unit keys: ``‖q~‖ <= ‖q‖``, shrinking most
  along the keys' dominant direction."""
  a = _inputs(seed=8)
  q, k, v, g, beta = a["q"], a["k"], a["v"], a["g"], a["beta"]

  @jax.jit
  def outputs(q, k, v, g, beta):
    call = _dispatch.prepare("ccq", q, k, v, scale=None, segment_ids=None,
                             implementation="chunked", chunk_size=4)
    cq = _ccq.curvature_query(call, call.q, call.k, g, None)[0]
    return (linear.ccq(q, k, v, g, beta, strength=0.0), linear.gated_delta_rule(q, k, v, g, beta),
            cq)

  o, want, cq = outputs(q, k, v, g, beta)
  np.testing.assert_allclose(o, want, rtol=1e-6, atol=1e-6)
  norm = lambda x: jnp.linalg.norm(x, axis=-1)
  assert bool(jnp.all(norm(q - cq) <= norm(q) + 1e-5))
  assert not np.allclose(cq, 0.0, atol=1e-3)


_q = np.ones((1, 4, 2, 3), np.float32)
_v = np.ones((1, 4, 2, 2), np.float32)
_g = np.zeros((1, 4, 2), np.float32)


@pytest.mark.parametrize("bad", [
    ("`g`", lambda: linear.ccq(_q, _q, _v, _g + 0.5)),
    ("`initial_state`", lambda: linear.ccq(_q, _q, _v, initial_state=np.zeros((1, 2, 3, 2)))),
    ("`strength`", lambda: linear.ccq(_q, _q, _v, strength="big")),
])
def test_bad_input_names_the_argument(bad):
  name, fn = bad
  with pytest.raises(ValueError, match=name):
    fn()
