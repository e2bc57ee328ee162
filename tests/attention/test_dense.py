"""implementation="xla" (the dense reference) against jax.nn.dot_product_attention and
closed forms: every mask kind, GQA/MQA, cross-attention, vmap, outputs and gradients."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import dot_product_attention as dpa
from tests.attention.reference import assert_same_jit as assert_same
from tests.helpers import LazyCases, make_qkv, sampled, segment_mask

B, T, N, K, H = 2, 11, 4, 2, 8


def _bias(shape, seed=3):
  return 0.5 * jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _mask(shape, seed=4, p=0.7):
  m = jax.random.bernoulli(jax.random.PRNGKey(seed), p, shape)
  # keep the diagonal so that no row is fully masked (jax.nn averages such rows)
  return m | jnp.broadcast_to(jnp.eye(shape[-2], shape[-1], dtype=bool), shape)


# every mask kind jax.nn knows, and combinations (arrays built on first use, not at import)
MASK_CASES = LazyCases(
    none=lambda: {},
    bias=lambda: {"bias": _bias((B, N, T, T))},
    bias_broadcast=lambda: {"bias": _bias((1, N, 1, T))},
    causal=lambda: {"is_causal": True},
    padding=lambda: {"query_seq_lengths": jnp.array([7, 11], jnp.int32),
                     "key_value_seq_lengths": jnp.array([5, 11], jnp.int32)},
    mask=lambda: {"mask": _mask((B, 1, T, T))},
    window=lambda: {"local_window_size": (3, 2)},
    window_int=lambda: {"local_window_size": 2},
    causal_window_bias=lambda: {"is_causal": True, "local_window_size": (4, 0),
                                "bias": _bias((1, 1, T, T))},
    causal_padding_mask=lambda: {"is_causal": True, "mask": _mask((1, N, T, T)),
                                 "key_value_seq_lengths": jnp.array([9, 11], jnp.int32)},
)


@pytest.mark.parametrize(
    "case", sampled(sorted(MASK_CASES),
                    {"bias_broadcast", "causal_padding_mask", "causal_window_bias"}))
def test_softmax_matches_jax_nn(case):
  kw = dict(MASK_CASES[case])
  q, k, v = make_qkv(0, B, T, N=N, K=K, H=H)
  bias = kw.pop("bias", None)
  args = (q, k, v) if bias is None else (q, k, v, bias)
  ref = functools.partial(jax.nn.dot_product_attention, **kw)
  ours = functools.partial(dpa, implementation="xla", **kw)
  assert_same(ours, ref, args)


@pytest.mark.parametrize(
    "shape", sampled([(2, 9, 13, 4, 4), (2, 9, 13, 6, 2), (1, 5, 8, 3, 1)], {"gqa_cross"},
                     ids=["mha_cross", "gqa_cross", "mqa"]))
def test_heads_and_cross_attention(shape):
  b, t, s, n, kh = shape
  q, k, v = make_qkv(1, b, t, S=s, N=n, K=kh, H=H)
  bias = _bias((b, n, t, s))
  kw = {"is_causal": True}  # i sees j <= i also when T != S (top-left aligned)
  assert_same(functools.partial(dpa, implementation="xla", **kw),
              functools.partial(jax.nn.dot_product_attention, **kw), (q, k, v, bias))


def test_unbatched_and_vmap():
  q, k, v = make_qkv(2, 3, 6, N=2, K=2, H=H)
  ours = jax.vmap(lambda q, k, v: dpa(q, k, v, is_causal=True, implementation="xla"))
  ref = jax.vmap(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
  assert_same(ours, ref, (q, k, v))


def test_segment_ids_match_explicit_mask():
  q, k, v = make_qkv(3, B, T, N=N, K=K, H=H)
  seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2], [5, 5, 7, 7, 7, 7, 7, 7, 1, 1, 1]])
  ours = functools.partial(dpa, segment_ids=seg, is_causal=True, implementation="xla")
  ref = functools.partial(jax.nn.dot_product_attention, mask=segment_mask(seg, seg),
                          is_causal=True)
  assert_same(ours, ref, (q, k, v))


def test_soft_cap_decay_and_temperature_closed_forms():
  q, k, v = make_qkv(4, B, T, N=N, K=K, H=H)
  bias = _bias((B, N, T, T))
  cap, scale = 2.0, 0.7
  cq = jnp.cumsum(-jax.random.uniform(jax.random.PRNGKey(5), (B, T, N)), axis=1)
  temp = jnp.array([0.5, 1.0, 2.0, 3.0]).reshape(N, 1, 1)

  def ours(q, k, v, bias, cq, temp):
    return dpa(q, k, v, bias, scale=scale, is_causal=True, logits_soft_cap=cap,
               decay_bias=(cq, cq), normalizer_params={"temperature": temp},
               implementation="xla")

  def ref(q, k, v, bias, cq, temp):  # written out: scale, decay, cap, bias, mask, softmax
    kk = jnp.repeat(k, N // K, axis=2)
    vv = jnp.repeat(v, N // K, axis=2)
    s = scale * jnp.einsum("btnh,bsnh->bnts", q, kk)
    c = jnp.transpose(cq, (0, 2, 1))
    s = s + c[..., :, None] - c[..., None, :]
    s = cap * jnp.tanh(s / cap) + bias
    w = jax.nn.softmax(s / temp[None], axis=-1, where=jnp.tril(jnp.ones((T, T), bool)))
    return jnp.einsum("bnts,bsnh->btnh", w, vv)

  assert_same(ours, ref, (q, k, v, bias, cq, temp))


def test_length_dependent_normalizer_sees_visible_count():
  # ssmax: softmax(s·log(n_i)·x) with n_i the visible keys of row i (causal + padding)
  q, k, v = make_qkv(5, B, T, N=N, K=K, H=H)
  kvl = jnp.array([6, 11], jnp.int32)
  s_param = 0.8

  def ours(q, k, v):
    return dpa(q, k, v, is_causal=True, key_value_seq_lengths=kvl, normalizer="ssmax",
               normalizer_params={"s": s_param}, implementation="xla")

  def ref(q, k, v):
    i = jnp.arange(T)
    n = jnp.minimum(i[None, :] + 1, kvl[:, None]).astype(jnp.float32)  # [B, T]
    kk, vv = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    x = jnp.einsum("btnh,bsnh->bnts", q, kk) / np.sqrt(H)
    x = x * (s_param * jnp.log(n))[:, None, :, None]
    vis = (i[None, :] <= i[:, None])[None, None] & (i[None, :] < kvl[:, None])[:, None, None, :]
    w = jax.nn.softmax(x, axis=-1, where=vis)
    return jnp.einsum("bnts,bsnh->btnh", w, vv)

  assert_same(ours, ref, (q, k, v))


def test_fully_masked_rows_are_zero_with_finite_grads():
  q, k, v = make_qkv(6, B, T, N=N, K=K, H=H)
  mask = jnp.ones((1, 1, T, T), bool).at[..., 3, :].set(False)
  def loss(q, k, v):
    o = dpa(q, k, v, mask=mask, implementation="xla")
    return jnp.sum(o ** 2), o

  # the output and the gradients in one jitted program (op by op costs several times more)
  (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  np.testing.assert_array_equal(np.asarray(o[:, 3]), 0.0)
  np.testing.assert_array_equal(np.asarray(grads[0][:, 3]), 0.0)
  assert all(np.all(np.isfinite(g)) for g in grads)
  # other rows equal jax.nn
  ref = jax.nn.dot_product_attention(q, k, v, mask=mask)
  rows = np.r_[0:3, 4:T]
  np.testing.assert_allclose(o[:, rows], ref[:, rows], atol=1e-5)


def test_bf16_inputs():
  q, k, v = make_qkv(7, B, T, N=N, K=K, H=H, dtype=jnp.bfloat16)
  out = dpa(q, k, v, is_causal=True, implementation="xla")
  assert out.dtype == jnp.bfloat16
  ref = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                     v.astype(jnp.float32), is_causal=True)
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2, rtol=2e-2)


def test_check_grads_float64():
  with jax.enable_x64(True):
    q, k, v = make_qkv(8, 1, 5, N=2, K=1, H=4, dtype=jnp.float64)
    bias = _bias((1, 2, 5, 5)).astype(jnp.float64)
    # jit: check_grads evaluates f many times; one compiled program instead of op by op
    f = jax.jit(lambda q, k, v, b: dpa(q, k, v, b, is_causal=True, logits_soft_cap=3.0,
                                       implementation="xla"))
    jax.test_util.check_grads(f, (q, k, v, bias), order=1, modes=("rev",))
    assert f(q, k, v, bias).dtype == jnp.float64


def test_callable_normalizer():
  q, k, v = make_qkv(9, B, T, N=N, K=K, H=H)
  fn = lambda x, axis=-1, where=None: jax.nn.softmax(x, axis=axis, where=where)  # noqa: E731
  out = dpa(q, k, v, is_causal=True, normalizer=fn)
  chex.assert_trees_all_close(out, jax.nn.dot_product_attention(q, k, v, is_causal=True),
                              atol=1e-5)
