"""A13 multi_token_attention (jaxsoft/attention/_multi_token.py).

Oracles: a float64 reference written with explicit shifts and loops (no convolution
primitive) for values and autodiff gradients; jax.test_util.check_grads; standard attention
for the delta kernel; causality by perturbing the future.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import dot_product_attention, mta_identity_kernel, multi_token_attention
from tests.attention.test_topk import largest_intermediate
from tests.helpers import check_raises, make_qkv

B, T, N, K, H, CQ, CK, CH = 2, 9, 4, 2, 8, 3, 5, 2


def reference(q, k, v, kernel, head_mix=None, position="pre"):
  """Dense MTA written from the formula with shifts (float64 when x64 is on)."""
  G = q.shape[2] // k.shape[2]
  kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
  a = jnp.einsum("btnh,bsnh->bnts", q, kr) / np.sqrt(q.shape[-1])
  S = k.shape[1]
  causal = np.arange(S)[None, :] <= np.arange(q.shape[1])[:, None]
  a0 = jnp.where(causal, a, 0.0)
  cq, ck = kernel.shape[1:]
  Tq = q.shape[1]
  # x[i - da, j + dc - ck // 2] for every (da, dc), zero outside the map, by padding
  padded = jnp.pad(a0, ((0, 0), (0, 0), (cq, 0), (ck, ck)))
  c = jnp.zeros_like(a)
  for da in range(cq):
    for dc in range(ck):
      r0, c0 = cq - da, ck + dc - ck // 2
      c = c + kernel[:, da, dc][None, :, None, None] * padded[:, :, r0:r0 + Tq, c0:c0 + S]
  mix = lambda x: x if head_mix is None else jnp.concatenate(
      [jnp.einsum("ij,bjts->bits", head_mix[g], x[:, g * CH:(g + 1) * CH])
       for g in range(head_mix.shape[0])], axis=1)
  if position == "pre":
    c = mix(c)
  w = jax.nn.softmax(jnp.where(causal, c, -jnp.inf), axis=-1)
  if position == "post":
    w = jnp.where(causal, mix(w), 0.0)
  return jnp.einsum("bnts,bsnh->btnh", w, vr)


def _params(seed, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 2)
  kernel = mta_identity_kernel(N, CQ, CK, dtype) + 0.3 * jax.random.normal(ks[0], (N, CQ, CK), dtype)
  mix = jnp.eye(CH, dtype=dtype)[None] + 0.3 * jax.random.normal(ks[1], (N // CH, CH, CH), dtype)
  return kernel, mix


@pytest.mark.parametrize("position", ["pre", "post"])
def test_matches_shift_reference_values_and_grads_float64(position):
  with jax.enable_x64(True):
    q, k, v = (a.astype(jnp.float64) for a in make_qkv(0, B=B, T=T, N=N, K=K, H=H))
    kernel, mix = _params(1, jnp.float64)
    r = lambda q, k, v, kern, mix: reference(q, k, v, kern, mix, position)
    args = (q, k, v, kernel, mix)
    ct = jax.random.normal(jax.random.key(3), (B, T, N, H), jnp.float64)

    def loss(g):  # ((value, output), grads): the output from the same jitted program
      def value(*a):
        out = g(*a)
        return jnp.sum(out * ct), out
      return jax.jit(jax.value_and_grad(value, argnums=tuple(range(5)), has_aux=True))(*args)

    (want_value, want_out), want_grads = loss(r)
    # dense, and chunked with a block (4) that does not divide T = 9 and a halo of CQ - 1
    for impl in ("xla", "xla_chunked"):
      f = lambda q, k, v, kern, mix, impl=impl: multi_token_attention(
          q, k, v, kernel=kern, head_mix=mix, head_mix_position=position, implementation=impl,
          block_q=4)
      (value, out), grads = loss(f)
      chex.assert_trees_all_close((value, grads), (want_value, want_grads), atol=1e-10,
                                  rtol=1e-9)
      np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=1e-12)


def test_chunked_never_builds_t_by_s():
  Tq = 40
  q, k, v = make_qkv(5, B=1, T=Tq, N=2, K=1, H=4)
  kernel, _ = _params(6)
  f = lambda q, k, v: multi_token_attention(q, k, v, kernel=kernel[:2], implementation="xla_chunked",
                                            block_q=8).sum()
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, k, v).jaxpr
  assert largest_intermediate(jaxpr) <= 2 * (8 + CQ - 1) * Tq  # [B, N, block_q + halo, S]


def test_finite_differences_float64():
  with jax.enable_x64(True):
    q, k, v = (a.astype(jnp.float64) for a in make_qkv(2, B=1, T=5, N=2, K=1, H=4))
    kernel = jax.random.normal(jax.random.key(4), (2, 2, 3), jnp.float64)
    mix = jax.random.normal(jax.random.key(5), (1, 2, 2), jnp.float64)
    f = jax.jit(lambda *a: multi_token_attention(*a[:3], kernel=a[3], head_mix=a[4]))
    jax.test_util.check_grads(f, (q, k, v, kernel, mix), order=1, modes=("rev",))


def test_delta_kernel_is_standard_attention_and_rows_sum_to_one():
  q, k, v = make_qkv(6, B=B, T=T, N=N, K=K, H=H)
  f = jax.jit(functools.partial(multi_token_attention, kernel=mta_identity_kernel(N, CQ, CK),
                                head_mix=jnp.broadcast_to(jnp.eye(CH), (N // CH, CH, CH))))
  want = jax.jit(functools.partial(dot_product_attention, is_causal=True))(q, k, v)
  chex.assert_trees_all_close(f(q, k, v), want, atol=1e-5, rtol=1e-5)
  # pre-softmax variant: the weights sum to 1 (a value of ones is returned as ones)
  kernel, mix = _params(7)
  ones = jnp.ones((B, T, K, 3))
  out = jax.jit(functools.partial(multi_token_attention, kernel=kernel, head_mix=mix))(q, k, ones)
  np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-5)


def test_causal_and_bf16():
  q, k, v = make_qkv(8, B=B, T=T, N=N, K=K, H=H)
  kernel, mix = _params(9)
  f = jax.jit(lambda q, k, v: multi_token_attention(q, k, v, kernel=kernel, head_mix=mix))
  out = f(q, k, v)
  t = 4
  bump = lambda a: a.at[:, t + 1:].add(2.0)
  out2 = f(bump(q), bump(k), bump(v))
  np.testing.assert_allclose(np.asarray(out[:, :t + 1]), np.asarray(out2[:, :t + 1]), atol=1e-6)
  assert not np.allclose(np.asarray(out[:, t + 1:]), np.asarray(out2[:, t + 1:]), atol=1e-3)
  # without the causal masks the chunked form (halo only) is still the dense one
  nc = {impl: jax.jit(functools.partial(multi_token_attention, kernel=kernel, head_mix=mix,
                                        is_causal=False, implementation=impl, block_q=4))(q, k, v)
        for impl in ("xla", "xla_chunked")}
  chex.assert_trees_all_close(nc["xla_chunked"], nc["xla"], atol=1e-5, rtol=1e-5)
  assert not np.allclose(np.asarray(nc["xla"]), np.asarray(out), atol=1e-3)
  lo = f(*(a.astype(jnp.bfloat16) for a in (q, k, v)))
  assert lo.dtype == jnp.bfloat16
  want = f(*(a.astype(jnp.bfloat16).astype(jnp.float32) for a in (q, k, v)))
  chex.assert_trees_all_close(lo.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)


def test_errors_name_the_argument():
  q, k, v = make_qkv(0, B=1, T=4, N=2, K=1, H=4)
  kern = mta_identity_kernel(2, 2, 3)
  check_raises(
      ("`kernel`", lambda: multi_token_attention(q, k, v, kernel=kern[:1])),
      ("`head_mix`", lambda: multi_token_attention(q, k, v, kernel=kern, head_mix=jnp.ones((1, 3, 3)))),
      ("`head_mix_position`", lambda: multi_token_attention(q, k, v, kernel=kern,
                                                            head_mix_position="mid")),
      ("`query`", lambda: multi_token_attention(q[0], k, v, kernel=kern)),
      ("`implementation`", lambda: multi_token_attention(q, k, v, kernel=kern,
                                                         implementation="pallas")),
      ("`block_q`", lambda: multi_token_attention(q, k, v, kernel=kern, block_q=0)),
  )
