"""Forward mode of a ``jax.jit``-compiled call: ``jax.jvp(jax.jit(f))`` (the jit inside).

The paths whose gradient is a custom VJP (the chunked linear forms, ``linear_cross_entropy``,
blockwise and Pallas attention) route forward mode to a plain differentiable form, or raise
``UnsupportedDifferentiation``, when they see the JVP tracer. Under ``jax.jvp(jax.jit(f))``
they cannot: ``jax.jit`` traces ``f`` with abstract values first, and the custom VJP is only
met when JAX differentiates the traced program, where JAX has no forward rule for it (JAX
0.10 to 0.12 offer no custom transposition that would give one: ``linear_call`` has no
batching rule and asserts on a partly zero tangent). The outcome must then be JAX's
``TypeError`` ("can't apply forward-mode autodiff (jvp) to a custom_vjp function"), never a
number; ``jax.jit(jax.jvp(f))`` (the jvp inside) and the unjitted ``jax.jvp`` take the
forward-mode form, equal to the dense / recurrent path. Paths whose derivative is a custom
JVP (``fenchel_young_loss``, the delta rules' parallel form, the decode step:
tests/nn/test_decode_forward_mode.py) take ``jax.jvp(jax.jit(f))`` as well.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from jaxsoft.attention import UnsupportedDifferentiation
from kernels_pallas import _api as kernels_api

# JAX's refusal of a custom VJP under forward mode (the same text on JAX 0.10.2 and 0.12.1)
CUSTOM_VJP = r"forward-mode autodiff \(jvp\) to a custom_vjp function"


def _rand(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _linear():
  q, k, v = _rand(0, (1, 8, 2, 4)), _rand(1, (1, 8, 2, 4)), _rand(2, (1, 8, 2, 4))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  g, beta = -0.3 * jnp.abs(_rand(3, (1, 8, 2))), jax.nn.sigmoid(_rand(4, (1, 8, 2)))
  return q, k, v, g, beta


def _lce_dense(h, w, labels):
  """linear_cross_entropy's loss on the whole logits: logsumexp(h w) - (h w)_y."""
  z = h @ w
  return jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, labels[:, None], -1)[:, 0]


# name: (the custom-VJP call f(x), x: the argument differentiated, the reference form
# whose tangent forward mode must give, or None where the jitted jvp refuses by name)
def _cases():
  q, k, v, g, beta = _linear()
  h, w, labels = _rand(5, (6, 4)), _rand(6, (4, 5)), jnp.array([0, 1, 2, 3, 4, 0])
  qa = _rand(9, (1, 16, 2, 4))
  gla = lambda impl: lambda x: js.linear.simple_gla(x, k, v, g, implementation=impl,
                                                     chunk_size=4)
  dr = lambda impl: lambda x: js.linear.delta_rule(q, x, v, beta, implementation=impl,
                                                    chunk_size=4)
  gdr = lambda impl: lambda x: js.linear.gated_delta_rule(x, k, v, g, beta,
                                                           implementation=impl, chunk_size=4)
  return {
      "simple_gla": (gla("chunked"), q, gla("recurrent")),
      "delta_rule_in_k": (dr("chunked"), k, dr("recurrent")),
      "gated_delta_rule": (gdr("chunked"), q, gdr("recurrent")),
      "linear_cross_entropy": (lambda x: js.losses.linear_cross_entropy(
          x, w, labels, token_chunk_size=4, vocab_chunk_size=2), h,
          lambda x: _lce_dense(x, w, labels)),
      "attention_softmax": (lambda x: js.attention.dot_product_attention(
          x, x, x, implementation="xla_chunked"), qa, None),
      "attention_sparsemax": (lambda x: js.attention.dot_product_attention(
          x, x, x, normalizer="sparsemax", implementation="xla_chunked"), qa, None),
  }


# default: one chunked linear form and blockwise attention; the rest under -m slow
_NAMES = [pytest.param(n, marks=() if n in ("simple_gla", "attention_softmax")
                       else pytest.mark.slow)
          for n in ("simple_gla", "delta_rule_in_k", "gated_delta_rule", "linear_cross_entropy",
                    "attention_softmax", "attention_sparsemax")]


@pytest.mark.parametrize("name", _NAMES)
def test_jvp_of_jit_raises_and_jit_of_jvp_equals_the_reference(name):
  """jax.jvp(jax.jit(f)) and jax.jacfwd(jax.jit(f)) of a custom-VJP path are JAX's
  TypeError, not a number; the same call as jax.jit(jax.jvp(f)) equals the tangent of the
  reference form (recurrent scan, dense formula), or refuses with UnsupportedDifferentiation
  where the unjitted call does (blockwise attention asked for by name)."""
  f, x, reference = _cases()[name]
  t = _rand(11, x.shape)
  with pytest.raises(TypeError, match=CUSTOM_VJP):
    jax.jvp(jax.jit(f), (x,), (t,))
  with pytest.raises(TypeError, match=CUSTOM_VJP):
    jax.jacfwd(jax.jit(f))(x)
  jit_of_jvp = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,)))
  if reference is None:
    with pytest.raises(UnsupportedDifferentiation, match="xla_chunked"):
      jit_of_jvp(x, t)
    return
  got, want = jit_of_jvp(x, t), jax.jvp(reference, (x,), (t,))
  # float32, a few dozen terms per entry summed in another order: ~1e-6 relative
  np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(got[1], want[1], rtol=2e-5, atol=2e-5)
  assert float(jnp.abs(want[1]).max()) > 1e-2


def test_default_attention_jvp_of_jit_at_the_chunked_length_raises():
  """implementation=None picks xla_chunked on CPU once T·S >= 1024²: unjitted (and under
  jax.jit(jax.jvp)) it sees the JVP tracer and takes the dense path (tested in
  tests/attention/test_higher_order.py), but inside a jit under jax.jvp it cannot: the
  outcome is JAX's TypeError (implementation="xla", with no custom VJP, takes it)."""
  q = _rand(12, (1, 1024, 1, 4))
  f = lambda impl: lambda q: js.attention.dot_product_attention(q, q, q, implementation=impl)
  with pytest.raises(TypeError, match=CUSTOM_VJP):
    jax.jvp(jax.jit(f(None)), (q,), (q,))


@pytest.mark.slow
def test_pallas_attention_jvp_of_jit_raises(monkeypatch):
  """The Pallas kernels (interpreter on CPU) under jax.jvp(jax.jit(f)): JAX's TypeError."""
  monkeypatch.setenv(kernels_api.INTERPRET_ENV, "1")
  q = _rand(13, (1, 16, 2, 16))
  f = lambda q: js.attention.dot_product_attention(q, q, q, implementation="pallas")
  with pytest.raises(TypeError, match=CUSTOM_VJP):
    jax.jvp(jax.jit(f), (q,), (q,))


@pytest.mark.parametrize("name", ["fenchel_young_loss",
                                  pytest.param("delta_rule_parallel", marks=pytest.mark.slow)])
def test_custom_jvp_paths_take_jvp_of_jit(name):
  """fenchel_young_loss (its Danskin rule is a custom JVP) and the delta rule's parallel
  form (a custom JVP on its Gram matrix) under jax.jvp(jax.jit(f)) equal jax.jit(jax.jvp(f)),
  itself checked against independent references in tests/test_forward_mode.py."""
  if name == "fenchel_young_loss":
    x, labels = _rand(7, (3, 5)), jnp.array([0, 2, 4])
    f = lambda z: js.losses.fenchel_young_loss(z, labels, "sparsemax")
  else:
    q, x, v, _, beta = _linear()
    f = lambda k: js.linear.delta_rule(q, k, v, beta, implementation="parallel")
  t = jnp.cos(x)
  got = jax.jvp(jax.jit(f), (x,), (t,))
  want = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,)))(x, t)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)
  assert float(jnp.abs(want[1]).max()) > 1e-2
