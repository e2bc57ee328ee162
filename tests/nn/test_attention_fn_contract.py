"""js.nn.attention_fn as a Flax drop-in, and the nn shape arithmetic under jax.export
(issue 37, defects 9 and 14).

The oracle is Flax itself: Linen's ``MultiHeadDotProductAttention`` with its own
``dot_product_attention`` (same parameters, same call), and ``flax.linen.dot_product_attention``.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

import jaxsoft as js
from tests.helpers import normal

X = normal(0, (2, 5, 16))


def _linen(attention_fn, force, dropout_rate=0.0, deterministic=True):
  """Linen MHA in bf16 (output, sown weights); ``attention_fn=None`` is Flax's own."""
  kw = {} if attention_fn is None else {"attention_fn": attention_fn}
  m = nn.MultiHeadDotProductAttention(num_heads=2, dtype=jnp.bfloat16, dropout_rate=dropout_rate,
                                      force_fp32_for_softmax=force, **kw)
  # jitted: one compilation per call instead of one per eager operation
  params = jax.jit(lambda key: m.init(key, X, X, deterministic=True))(jax.random.key(1))
  out, state = jax.jit(lambda params: m.apply(
      params, X, X, sow_weights=True, deterministic=deterministic, mutable=["intermediates"],
      rngs={"dropout": jax.random.key(2)}))(params)
  return out, state["intermediates"]["attention_weights"][0]


# Flax forms the logits in bf16 (relative error 2^-8 on logits of size ~1) before its
# float32 softmax; ours forms them in float32: the weights differ by about 2^-8.
BF16_WEIGHTS_TOL = 2.0 ** -7


@pytest.mark.parametrize("force", [False, True])
def test_linen_force_fp32_for_softmax_is_honoured(force):
  out_ref, w_ref = _linen(None, force)
  out, w = _linen(js.nn.attention_fn(), force)
  assert w.dtype == w_ref.dtype == (jnp.float32 if force else jnp.bfloat16)
  assert out.dtype == out_ref.dtype
  np.testing.assert_allclose(np.asarray(w, np.float32), np.asarray(w_ref, np.float32),
                             atol=BF16_WEIGHTS_TOL)


def test_force_fp32_for_softmax_fast_path_returns_float32_as_flax():
  q, k, v = (normal(s, (2, 4, 2, 8), dtype=jnp.bfloat16) for s in (3, 4, 5))
  fn = js.nn.attention_fn()
  for force in (False, True):
    # both in one compilation instead of one per eager operation
    ref, out = jax.jit(lambda q, k, v, force=force: (
        nn.dot_product_attention(q, k, v, force_fp32_for_softmax=force),
        fn(q, k, v, force_fp32_for_softmax=force, deterministic=True)))(q, k, v)
    assert out.dtype == ref.dtype, (force, out.dtype, ref.dtype)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2)  # bf16 values, bf16 logits in Flax
  # float32 weights are honoured for a float64 caller by never narrowing below it
  q64 = np.asarray(q, np.float64)
  with jax.enable_x64(True):
    out = jax.eval_shape(lambda q: fn(q, q, q, force_fp32_for_softmax=True, deterministic=True),
                         jnp.asarray(q64))  # the dtype alone: traced, not compiled
    assert out.dtype == jnp.float64


def test_dropout_key_value_length_mismatch_names_the_arguments():
  q, k = normal(6, (2, 4, 2, 8)), normal(7, (2, 5, 2, 8))
  v = normal(8, (2, 6, 2, 8))
  fn = js.nn.attention_fn()
  with pytest.raises(AssertionError):  # Flax refuses it too (an assert)
    nn.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(0))
  for kw in ({"dropout_rate": 0.5, "dropout_rng": jax.random.key(0)}, {}):
    with pytest.raises(ValueError, match=r"attention_fn: `value` of shape \(2, 6, 2, 8\) must "
                                         r"match `key` of shape \(2, 5, 2, 8\)"):
      fn(q, k, v, deterministic=False, **kw)


def test_custom_einsums_are_refused_not_ignored():
  q = normal(9, (1, 3, 2, 4))
  with pytest.raises(NotImplementedError, match="qk_attn_weights_einsum"):
    js.nn.attention_fn()(q, q, q, qk_attn_weights_einsum=jnp.einsum,
                         attn_weights_value_einsum=jnp.einsum)


def _spec(*shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def test_attention_fn_exports_with_a_symbolic_batch():
  fn = js.nn.attention_fn("softmax")
  b = export.symbolic_shape("b")[0]

  def f(q, k, v, mask):
    return fn(q, k, v, mask=mask, deterministic=True)

  exp = export.export(jax.jit(f))(_spec(b, 3, 2, 4), _spec(b, 5, 2, 4), _spec(b, 5, 2, 4),
                                  _spec(b, 1, 3, 5, dtype=jnp.bool_))
  rng = np.random.default_rng(13)
  for batch in (1, 3):
    q, k, v = normal(10, (batch, 3, 2, 4)), normal(11, (batch, 5, 2, 4)), normal(12,
                                                                                (batch, 5, 2, 4))
    mask = rng.random((batch, 1, 3, 5)) < 0.7
    mask[..., 0] = True
    mask = jnp.asarray(mask)
    # the reference jitted: one compilation per batch instead of one per eager operation
    np.testing.assert_allclose(exp.call(q, k, v, mask), jax.jit(f)(q, k, v, mask), rtol=1e-6,
                               atol=1e-6)


def test_learned_normalizer_exports_with_a_symbolic_batch():
  qa = js.nn.QASSMax(2, 4, hidden=8, rngs=nnx.Rngs(0))
  b = export.symbolic_shape("b")[0]

  def f(q, n):
    return qa.attention_queries(q, n)

  exp = export.export(jax.jit(f))(_spec(b, 2, 3, 4), _spec(b, 1, 3, 1))
  for batch in (1, 2):
    q = normal(14, (batch, 2, 3, 4))
    n = jnp.asarray(np.broadcast_to(np.arange(1.0, 4.0, dtype=np.float32)[None, None, :, None],
                                    (batch, 1, 3, 1)))
    # the reference jitted: one compilation per batch instead of one per eager operation
    np.testing.assert_allclose(exp.call(q, n), jax.jit(f)(q, n), rtol=1e-6, atol=1e-6)
