"""The linear family under ``jax.export`` with a symbolic batch dimension (issue 37,
defect 14): no shape arithmetic may need a concrete batch. Exported once with ``B``
symbolic, the outputs, final states and gradients must equal the jitted ones at two batch
sizes. Every form and the decoding step, under ``-m slow`` (the default suite's budget).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxsoft import linear

T, N, K, V = 7, 2, 4, 3


def _inputs(batch, step=False):
  ks = jax.random.split(jax.random.key(batch), 5)
  lead = (batch, N) if step else (batch, T, N)
  q, k, v = (jax.random.normal(kk, lead + (d,)) for kk, d in zip(ks[:3], (K, K, V), strict=True))
  g = -jax.random.uniform(ks[3], lead)
  beta = jax.random.uniform(ks[4], lead, minval=0.1, maxval=1.9)
  return q, linear.l2_normalize(k), v, g, beta


def _grads(fn):
  def f(*args):
    def total(q, k, v):
      return sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(fn(q, k, v, *args[3:])))
    return fn(*args), jax.grad(total, argnums=(0, 1, 2))(*args[:3])
  return f


CALLS = {
    "gated_delta_rule": lambda form: _grads(lambda q, k, v, g, b: linear.gated_delta_rule(
        q, k, v, g, b, implementation=form, chunk_size=3, output_final_state=True)),
    "gla": lambda form: _grads(lambda q, k, v, g, b: linear.gla(
        q, k, v, jnp.broadcast_to(g[..., None], q.shape), implementation=form, chunk_size=3,
        output_final_state=True)),
    "linear_attention": lambda form: _grads(lambda q, k, v, g, b: linear.linear_attention(
        q, k, v, implementation=form, chunk_size=3, output_final_state=True)),
    "ttt_linear": lambda form: _grads(lambda q, k, v, g, b: linear.ttt_linear(
        q, k, v, 0.1 * b, mini_batch_size=3, implementation=form, output_final_state=True)),
    "native_hybrid_attention": lambda form: _grads(
        lambda q, k, v, g, b: linear.native_hybrid_attention(
            q, k, v, jnp.stack([g, 0.5 * g], -1), window=2, implementation=form, chunk_size=3,
            output_final_state=True)),
}
CASES = [(name, form) for name in CALLS for form in ("parallel", "recurrent", "chunked")
         if not (name == "ttt_linear" and form == "parallel")]


def _round_trip(f, step=False):
  b, = export.symbolic_shape("b")
  specs = [jax.ShapeDtypeStruct((b,) + a.shape[1:], a.dtype) for a in _inputs(3, step)]
  exported = export.export(jax.jit(f))(*specs)
  for batch in (3, 5):
    args = _inputs(batch, step)
    got, want = exported.call(*args), jax.jit(f)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      assert g.shape == w.shape and g.shape[0] == batch
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_recurrent_simple_gla_exports_with_a_symbolic_batch():
  """A guard (the forms exported before too), under -m slow to keep the default suite's
  budget; with gradients, every form below."""
  _round_trip(lambda q, k, v, g, b: linear.simple_gla(
      q, k, v, g, implementation="recurrent", output_final_state=True))


@pytest.mark.slow
@pytest.mark.parametrize("name,form", CASES)
def test_every_form_exports_with_a_symbolic_batch(name, form):
  _round_trip(CALLS[name](form))


@pytest.mark.slow
def test_decoding_step_exports_with_a_symbolic_batch():
  _round_trip(lambda q, k, v, g, b: linear.gated_delta_rule_step(q, k, v, g, b), step=True)
