"""Every derivative of a one-token decode step through the split-K kernel is the dense step's.

``MultiHeadAttention(implementation="pallas")`` runs a one-token cached step through the
forward-only decoding kernel (Pallas interpreter on CPU); its derivative is a custom JVP
through the step's XLA form. The oracle is an identical layer with
``implementation="xla"`` (no kernel, every derivative by JAX): forward mode (``jax.jvp``,
also of a ``jax.jit``-compiled step, and ``jax.jacfwd``), reverse mode and a second order
in the inputs and the parameters (the projections and the learned per-head sink) equal
its. A spy on ``decode_attention`` shows that the kernel ran.
"""

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxsoft.nn import MultiHeadAttention
from kernels_pallas import _api as kernels_api
from kernels_pallas import decode
from tests.helpers import BWD, FWD, normal, random_cotangent

D, N, B, T = 8, 2, 2, 3


@pytest.fixture
def spy(monkeypatch):
  """Interpret mode on CPU and a count of decode_attention calls (traced)."""
  monkeypatch.setenv(kernels_api.INTERPRET_ENV, "1")
  calls = []
  real = decode.decode_attention

  def wrapper(*args, **kwargs):
    calls.append(kwargs["normalizer"])
    return real(*args, **kwargs)

  monkeypatch.setattr(decode, "decode_attention", wrapper)
  return calls


def _step_functions(x):
  """``f(token, params)``: the one-token step after a prefill of three (a window-2 ring
  buffer wrapped, GQA, a learned per-head sink), for the Pallas and XLA layers."""
  out = {}
  for impl in ("pallas", "xla"):
    layer = MultiHeadAttention(N, D, implementation=impl, sink=True, num_kv_heads=1,
                               rngs=nnx.Rngs(0))
    for z in layer.normalizer_free.values():
      z[...] = z[...] + jnp.linspace(-0.8, 0.8, N)
    layer.init_cache(B, T + 1, local_window_size=2)
    nnx.jit(lambda m, x: m(x, decode=True))(layer, x[:, :T])  # a prefill (dense path)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def f(xt, params, graphdef=graphdef, rest=rest):
      return nnx.merge(graphdef, params, rest, copy=True)(xt, decode=True)

    out[impl] = (f, params)
  return out


def _inputs():
  x = normal(3, (B, T + 1, D), 1.5)
  fns = _step_functions(x)
  params = fns["xla"][1]  # the same values in both layers
  dparams = jax.tree.map(lambda p: normal(5, p.shape), params)
  return fns, x[:, T:], normal(4, (B, 1, D)), params, dparams


def test_decode_step_forward_mode_equals_the_dense_step(spy):
  """jax.jvp of the step (jitted around it and inside it) in the token and every
  parameter: the tangent of the dense step (the old custom VJP raised JAX's TypeError)."""
  fns, xt, dxt, params, dparams = _inputs()
  spy.clear()
  jvp = {impl: jax.jit(lambda a, p, da, dp, f=f: jax.jvp(f, (a, p), (da, dp)))(
      xt, params, dxt, dparams) for impl, (f, _) in fns.items()}
  jvp_of_jit = jax.jvp(jax.jit(fns["pallas"][0]), (xt, params), (dxt, dparams))
  assert spy and set(spy) == {"softmax_sink"}  # the Pallas layer's steps ran the kernel
  chex.assert_trees_all_close(jvp["pallas"], jvp["xla"], **FWD)
  chex.assert_trees_all_close(jvp_of_jit, jvp["xla"], **FWD)
  assert float(jnp.abs(jvp["xla"][1]).max()) > 1e-2  # not trivially zero


@pytest.mark.slow
def test_decode_step_reverse_second_order_and_sink_tangent_equal_the_dense_step(spy):
  """Reverse mode in the token and the parameters, forward over reverse in the token
  (a Hessian-vector product: the rule's primal is the kernel step again, never a
  differentiated kernel) and the tangent in the learned sink alone."""
  fns, xt, dxt, params, dparams = _inputs()
  ct = random_cotangent((B, 1, D))
  spy.clear()
  res = {}
  for impl, (f, _) in fns.items():
    res[impl] = dict(
        grad=jax.grad(lambda a, p, f=f: jnp.sum(ct * f(a, p)), (0, 1))(xt, params),
        hvp=jax.jvp(jax.grad(lambda a, f=f: jnp.sum(ct * f(a, params))), (xt,), (dxt,))[1])
  assert spy and set(spy) == {"softmax_sink"}
  chex.assert_trees_all_close(res["pallas"]["grad"], res["xla"]["grad"], **BWD)
  chex.assert_trees_all_close(res["pallas"]["hvp"], res["xla"]["hvp"], **BWD)
  assert float(jnp.abs(res["xla"]["hvp"]).max()) > 1e-3
  sink_only = jax.tree.map(jnp.zeros_like, dparams)
  sink_only["normalizer_free"]["sink_logit"] = dparams["normalizer_free"]["sink_logit"]
  d_sink = {impl: jax.jvp(lambda p, f=f: f(xt, p), (params,), (sink_only,))[1]
            for impl, (f, _) in fns.items()}
  chex.assert_trees_all_close(d_sink["pallas"], d_sink["xla"], **FWD)
  assert float(jnp.abs(d_sink["xla"]).max()) > 1e-3
