"""Higher-order and forward-mode AD through the blockwise attention paths (issue 37, items 10
and 11).

The xla_chunked and Pallas paths define first-order reverse mode only (a recomputing custom
VJP). A second derivative (jax.hessian, grad of grad, jvp of grad) or a forward-mode one
(jax.jvp, jax.jacfwd) must never give a number that differs from the dense path: asked of
an explicit ``implementation``, it raises an error naming that implementation and
``implementation='xla'``; with ``implementation=None`` it runs on the dense path, so a
Hessian-vector product keeps its meaning once T·S reaches the chunked threshold. The
references are the dense ``implementation="xla"`` path in float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas
from jaxsoft.attention import dot_product_attention
from jaxsoft.attention._api import CHUNKED_MIN_SCORES

NORMALIZERS = ["softmax", "sparsemax", "sigmoid"]
ARGS = {"q": 0, "k": 1, "v": 2}
# an explicit implementation's refusal: the dispatcher's NotImplementedError naming it, or
# (caught past the dispatcher, in the backward pass) the TypeError subclass itself
REFUSAL = (TypeError, NotImplementedError)


def _qkv(t, s, dtype, h=4, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (1, t, 1, h), dtype), jax.random.normal(kk, (1, s, 1, h), dtype),
          jax.random.normal(kv, (1, s, 1, h), dtype))


def _loss(impl, normalizer, which, qkv, **kw):
  """A scalar, non-linear in the output, of attention as a function of one of q, k, v."""

  def f(x):
    args = list(qkv)
    args[ARGS[which]] = x
    out = dot_product_attention(*args, normalizer=normalizer, implementation=impl, **kw)
    return jnp.sum(jnp.sin(out))

  return f


def _assert_refusal(excinfo, impl):
  msg = str(excinfo.value)
  assert f"implementation='{impl}'" in msg, msg
  assert "implementation='xla'" in msg, msg


@pytest.mark.parametrize("normalizer", NORMALIZERS)
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_chunked_hessian_raises_instead_of_a_wrong_hessian(normalizer, which):
  """The key Hessian of xla_chunked was ~0 (the backward pass read k^T as a constant) and
  sparsemax's query Hessian dropped tau's dependence; it now refuses."""
  with jax.enable_x64(True):
    qkv = _qkv(8, 8, jnp.float64)
    f = _loss("xla_chunked", normalizer, which, qkv)
    with pytest.raises(REFUSAL) as excinfo:
      jax.hessian(f)(qkv[ARGS[which]])
    _assert_refusal(excinfo, "xla_chunked")


@pytest.mark.parametrize("normalizer", [
    "softmax", pytest.param("sparsemax", marks=pytest.mark.slow)])
def test_chunked_reverse_over_reverse_and_hvp_raise(normalizer):
  """jacrev(grad) raised JAX's while_loop error; grad of grad and jvp of grad gave numbers
  from a backward pass that drops terms."""
  with jax.enable_x64(True):
    qkv = _qkv(8, 8, jnp.float64)
    f = _loss("xla_chunked", normalizer, "k", qkv)
    k = qkv[1]
    for second in (lambda: jax.jacrev(jax.grad(f))(k),
                   lambda: jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2))(k),
                   lambda: jax.jvp(jax.grad(f), (k,), (jnp.ones_like(k),)),
                   lambda: jax.hessian(jax.jit(f))(k)):  # caught in the backward pass
      with pytest.raises(REFUSAL) as excinfo:
        second()
      _assert_refusal(excinfo, "xla_chunked")


def test_chunked_forward_mode_raises_a_clear_error():
  with jax.enable_x64(True):
    qkv = _qkv(8, 8, jnp.float64)
    f = _loss("xla_chunked", "softmax", "q", qkv)
    q = qkv[0]
    for fwd in (lambda: jax.jvp(f, (q,), (q,)), lambda: jax.jacfwd(f)(q),
                lambda: jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(q),
                lambda: jax.jvp(jax.vmap(f), (q[None],), (q[None],))):
      with pytest.raises(REFUSAL) as excinfo:
        fwd()
      _assert_refusal(excinfo, "xla_chunked")
      assert "forward-mode" in str(excinfo.value)


def test_refusal_is_a_type_error_and_not_implemented_error():
  """NotImplementedError lets implementation=None move on to the dense path."""
  from jaxsoft.attention.differentiation import UnsupportedDifferentiation

  assert issubclass(UnsupportedDifferentiation, TypeError)
  assert issubclass(UnsupportedDifferentiation, NotImplementedError)


@pytest.fixture(scope="module")
def long_inputs():
  """T·S at the automatic choice's chunked threshold (the default picks xla_chunked)."""
  t = 1024
  assert t * t >= CHUNKED_MIN_SCORES
  with jax.enable_x64(True):
    return tuple(np.asarray(a) for a in _qkv(t, t, jnp.float64, h=2, seed=1))


def test_default_hvp_at_the_chunked_length_equals_the_dense_path(long_inputs):
  """A Hessian-vector product of the default implementation keeps its meaning with length
  (in the keys it was ~0 once T·S >= 1024²)."""
  with jax.enable_x64(True):
    q, k, v = (jnp.asarray(a) for a in long_inputs)

    @jax.jit
    def both(q, k, v):
      def hvp(impl):
        loss = lambda k: jnp.sum(jnp.sin(dot_product_attention(q, k, v, implementation=impl)))
        return jax.jvp(jax.grad(loss), (k,), (jnp.cos(3.0 * k),))[1]

      return hvp(None), hvp("xla")

    got, want = both(q, k, v)
    scale = float(jnp.max(jnp.abs(want)))
    assert scale > 1e-3
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10 * scale)


def test_default_jvp_at_the_chunked_length_equals_the_dense_path(long_inputs):
  """jax.jvp of default attention worked at T = 512 and raised at 1024."""
  with jax.enable_x64(True):
    q, k, v = (jnp.asarray(a) for a in long_inputs)

    def f(impl):
      return lambda q: dot_product_attention(q, k, v, implementation=impl)

    got, want = jax.jit(lambda q: tuple(jax.jvp(f(impl), (q,), (jnp.cos(q),))
                                        for impl in (None, "xla")))(q)
    for a, b in zip(got, want, strict=True):
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("normalizer", [
    "softmax", pytest.param("sparsemax", marks=pytest.mark.slow),
    pytest.param("standardized_softmax", marks=pytest.mark.slow)])
def test_pallas_second_order_and_forward_mode_raise(normalizer):
  """The Pallas path raised a bare AssertionError for a Hessian and JAX's custom_vjp message
  for jvp (its first order is tested in tests/kernels_pallas)."""
  q, k, v = _qkv(16, 16, jnp.float32, h=16)

  def f(x):
    out = kernels_pallas.attention(q, x, v, normalizer=normalizer, backend="triton",
                                   interpret=True)
    return jnp.sum(jnp.sin(out))

  for attempt in (lambda: jax.hessian(f)(k), lambda: jax.jvp(f, (k,), (k,)),
                  lambda: jax.jacrev(jax.grad(f))(k)):
    with pytest.raises(REFUSAL) as excinfo:
      attempt()
    _assert_refusal(excinfo, "pallas")
