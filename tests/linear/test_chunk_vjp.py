"""Feature K07: the chunked forms' custom VJP keeps only the inputs, the chunk-start states
and (delta rules) the UT transform for the backward pass and rebuilds each chunk's scores
there (no T x T buffer, no per-chunk scores stored), with gradients equal to the parallel
form's autodiff ones."""

import contextlib
import functools
import io
import math
import re

import jax
import jax.ad_checkpoint
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.linear import recurrence
from tests.linear import cases

T, C, K, V = 100, 16, 4, 3
N_CHUNKS = math.ceil(T / C)


def _residual_shapes(fn, *args):
  """The shapes of the arrays autodiff keeps for ``fn``'s backward pass (parsed from
  ``jax.ad_checkpoint.print_saved_residuals``)."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
  shapes = []
  for line in out.getvalue().splitlines():
    m = re.match(r"\s*\w+\[([\d,]*)\]", line)
    if m:
      shapes.append(tuple(int(d) for d in m.group(1).split(",") if d))
  assert shapes, out.getvalue()
  return shapes


def _internal_args(variant, seed=0):
  """``[B, N, T, ...]`` inputs of :func:`recurrence.chunked` for ``variant``."""
  a = cases.inputs(variant, B=1, T=T, N=1, K=K, V=V, seed=seed, state=False)
  bn = lambda x: None if x is None else jnp.moveaxis(x, 1, 2)
  return (bn(a["q"]), bn(a["k"]), bn(a["v"]), bn(a.get("g")), bn(a.get("beta")),
          jnp.zeros((1, T), jnp.int32), jnp.zeros((1, 1, K, V)))


@pytest.mark.parametrize("variant", ["simple_gla", "gated_delta_rule",
                                     pytest.param("delta_rule", marks=pytest.mark.slow),
                                     pytest.param("gla", marks=pytest.mark.slow)])
def test_backward_keeps_only_inputs_and_chunk_states(variant):
  """The residuals of the chunked form are the (padded) inputs plus the chunk-start states
  ``[B, N, T/C, K, V]`` and, for the delta rules, the UT transform: ``(I + A)^{-1}``
  ``[B, N, T/C, C, C]`` (the only ``[C, C]`` array kept), the WY factors ``W, U_tilde`` and
  the written values ``U``. No scores: at most ``T·(2K + V + 3) + (T/C)·K·V`` numbers in
  all (plus ``T·(K + 2V + C)`` for the delta rules), plus the loss's own (the per-channel
  decay of gla adds T·K).
  Autodiff of the same chunked computation (``recompute=False``) keeps the ``[C, C]``
  scores of every chunk: the check can fail."""
  q, k, v, g, beta, run, S0 = _internal_args(variant)

  def loss(recompute, q, k, v, g, beta, S0):
    o, S_T = recurrence.chunked(q, k, v, g, beta, run, S0, C, recompute=recompute)
    return jnp.sum(jnp.sin(o)) + jnp.sum(S_T)

  padded = N_CHUNKS * C
  delta = beta is not None
  # the inputs (q, k, v, g, beta, run ids) + the chunk states + cos(o) for the loss's sin
  budget = (padded * (2 * K + V + 3 + (K if variant == "gla" else 0)) + N_CHUNKS * K * V
            + T * V + 16)
  if delta:   # (I + A)^{-1}, W, U_tilde and U
    budget += padded * (K + 2 * V + C)
  for recompute in (True, False):
    shapes = _residual_shapes(functools.partial(loss, recompute), q, k, v, g, beta, S0)
    square = [s for s in shapes if len(s) >= 2 and s[-2:] == (C, C)]
    total = sum(math.prod(s) for s in shapes)
    if recompute:
      assert square == ([(1, 1, N_CHUNKS, C, C)] if delta else []), shapes
      assert total <= budget, (total, budget, shapes)
      assert (1, 1, N_CHUNKS, K, V) in shapes, shapes   # the chunk-start states
    else:
      assert len(square) > (1 if delta else 0) and total > budget, shapes


def _max_t_axes(jaxpr, size):
  worst = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      worst = max(worst, sum(d >= size for d in getattr(var.aval, "shape", ())))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      worst = max(worst, _max_t_axes(sub, size))
  return worst


def _reverse_scans(jaxpr):
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == "scan" and bool(eqn.params.get("reverse"))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      n += _reverse_scans(sub)
  return n


@pytest.mark.parametrize("variant", ["simple_gla", "gated_delta_rule"])
def test_value_and_grad_jaxpr_has_no_t_by_t_array(variant):
  """jax.make_jaxpr of the value_and_grad through the public function: no intermediate has
  two axes of length >= T, and the backward pass is a reverse scan over the chunks (the
  recomputation), which the parallel form (autodiff, one chunk) does not have."""
  args = cases.inputs(variant, B=1, T=T, N=1, K=K, V=V)

  def loss(form, a):
    o, S = cases._call(variant, a, implementation=form, chunk_size=C)
    return jnp.sum(jnp.sin(o)) + jnp.sum(S)

  chunked = jax.make_jaxpr(jax.value_and_grad(functools.partial(loss, "chunked")))(args).jaxpr
  parallel = jax.make_jaxpr(jax.value_and_grad(functools.partial(loss, "parallel")))(args).jaxpr
  assert _max_t_axes(chunked, T) == 1 and _max_t_axes(parallel, T) == 2
  assert _reverse_scans(chunked) >= 1


def _lightning(a, **kw):
  from jaxsoft import linear
  return linear.lightning_attention(a["q"], a["k"], a["v"], a["g"], output_final_state=True,
                                    initial_state=a["initial_state"], **kw)


@pytest.mark.parametrize("variant", ["lightning", "gated_delta_rule",
                                     pytest.param("simple_gla", marks=pytest.mark.slow),
                                     pytest.param("delta_rule", marks=pytest.mark.slow)])
def test_gradients_equal_the_parallel_form(variant):
  """T = 29 in chunks of 8 (4 chunks, the last one short), segments, an initial state: the
  custom VJP's gradients of q, k, v, g, beta and the initial state equal autodiff through
  the parallel form to 1e-5 relative (to the gradient's largest entry)."""
  if variant == "lightning":
    args = cases.inputs("simple_gla", T=29, seed=3)
    args["g"] = -jnp.array([0.05, 0.5])
    fn = _lightning
  else:
    args = cases.inputs(variant, T=29, seed=3)
    fn = functools.partial(cases._call, variant)
  seg = cases.segments(2, 29, seed=4)
  w = jax.random.normal(jax.random.key(5), args["v"].shape)
  ws = jax.random.normal(jax.random.key(6), args["initial_state"].shape)

  def loss(form, a):
    o, S = fn(a, implementation=form, chunk_size=8, segment_ids=seg)
    return jnp.sum(o * w) + jnp.sum(S * ws)

  got = jax.jit(jax.value_and_grad(functools.partial(loss, "chunked")))(args)
  want = jax.jit(jax.value_and_grad(functools.partial(loss, "parallel")))(args)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert set(got[1]) == set(args)
  for name in args:
    scale = float(jnp.max(jnp.abs(want[1][name])))
    np.testing.assert_allclose(got[1][name], want[1][name], rtol=1e-5, atol=1e-5 * scale,
                               err_msg=name)
