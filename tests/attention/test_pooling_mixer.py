"""A51 ponet_mix (PoNet's pooling token mixer) and js.nn.PoNetMixer against a numpy float64
oracle written loop by loop from the formulas; masks (padding never leaks), gradients, the
causal reconstruction, bf16, jit and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsoft as js

B, T, N, DK, DV = 2, 9, 2, 3, 2
RNG = np.random.default_rng(51)
Q, K = (RNG.standard_normal((B, T, N, DK)).astype(np.float32) for _ in range(2))
V, O, S, L = (RNG.standard_normal((B, T, N, DV)).astype(np.float32) for _ in range(4))
IDS = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2],
                [5, 5, 3, 3, 3, 3, 9, 9, 9]], np.int32)  # (int32 under x64 too)
MASK = np.ones((B, T), bool)
MASK[0, [1, 8]] = False   # inside a segment, and the last token
MASK[1, 6:] = False       # padding: a whole segment

STATIC = ("segment_size", "window", "causal")
mix = jax.jit(js.attention.ponet_mix, static_argnames=STATIC)


def o_ponet(q, k, v, o, s, l, ids, mask, window, causal):
  """Token by token, head by head, float64."""
  q, k, v, o, s, l = (np.asarray(a, np.float64) for a in (q, k, v, o, s, l))
  b_, t_, n_, dk = q.shape
  out = np.zeros(v.shape)
  for b in range(b_):
    for i in range(t_):
      if not mask[b, i]:
        continue
      seen = [j for j in range(t_) if mask[b, j] and (j <= i or not causal)]
      lo = i
      while lo > 0 and ids[b, lo - 1] == ids[b, i]:
        lo -= 1
      hi = i
      while not causal and hi < t_ - 1 and ids[b, hi + 1] == ids[b, i]:
        hi += 1
      seg = [j for j in range(lo, hi + 1) if mask[b, j]]
      near = range(i - window + 1, i + 1) if causal else range(i - window // 2, i + window // 2 + 1)
      loc = [j for j in near if 0 <= j < t_ and mask[b, j]]
      for n in range(n_):
        qbar = q[b, seen, n].mean(axis=0)
        z = k[b, seen, n] @ qbar / np.sqrt(dk)
        p = np.exp(z - z.max())
        g = (p / p.sum()) @ v[b, seen, n]
        out[b, i, n] = (g + s[b, seg, n].max(axis=0)) * o[b, i, n] + l[b, loc, n].max(axis=0)
  return out


# float32: the global path is a mean, a softmax and a weighted sum over <= 9 tokens (~30
# roundings of 2^-24 on values < 10 in magnitude): 2e-5 absolute and relative is ample.
TOL = {"rtol": 2e-5, "atol": 2e-5}


@pytest.mark.parametrize("causal", [False, True])
def test_matches_float64_oracle_with_segment_ids_and_mask(causal):
  out = mix(Q, K, O, S, L, value=V, segment_ids=IDS, mask=MASK, window=3, causal=causal)
  assert out.shape == (B, T, N, DV) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, o_ponet(Q, K, V, O, S, L, IDS, MASK, 3, causal), **TOL)


def test_segment_size_value_defaults_to_key_and_wider_window():
  out = mix(Q, K, Q, Q, Q, segment_size=4, window=5)  # value = key; Dv = Dk
  ids = np.broadcast_to(np.arange(T) // 4, (B, T))
  want = o_ponet(Q, K, K, Q, Q, Q, ids, np.ones((B, T), bool), 5, False)
  np.testing.assert_allclose(out, want, **TOL)


W = RNG.standard_normal((B, T, N, DV))  # weights of the scalar loss whose gradient is checked


def _loss(args):
  out = js.attention.ponet_mix(*args[:5], value=args[5], segment_ids=IDS, mask=MASK)
  return jnp.sum(W * out), out


# One program for both gradient tests (float64, under jax.enable_x64).
_loss_grad = jax.jit(jax.value_and_grad(_loss, has_aux=True))


def _args64(nan_padding=False):
  args = tuple(jnp.asarray(a, jnp.float64) for a in (Q, K, O, S, L, V))
  if nan_padding:
    args = tuple(jnp.where(jnp.asarray(MASK)[..., None, None], a, jnp.nan) for a in args)
  return args


def test_padding_never_leaks_value_and_gradient():
  """Masked tokens holding NaN: the visible outputs are those of the clean inputs, the masked
  outputs 0, and no gradient (nor NaN) reaches a masked token."""
  with jax.enable_x64(True):
    (_, out), grads = _loss_grad(_args64())
    (_, out_nan), grads_nan = _loss_grad(_args64(nan_padding=True))
  np.testing.assert_array_equal(out_nan, out)
  assert np.all(np.asarray(out)[~MASK] == 0.0)
  for g, g_nan in zip(grads, grads_nan, strict=True):
    np.testing.assert_array_equal(g_nan, g)
    assert np.all(np.asarray(g)[~MASK] == 0.0)
  # a trailing padding is a deletion (batch entry 1 has T = 6 visible tokens)
  short = mix(*(a[1:, :6] for a in (Q, K, O, S, L)), value=V[1:, :6], segment_ids=IDS[1:, :6])
  np.testing.assert_allclose(out[1:, :6], short, **TOL)


def test_gradients_match_central_differences_of_the_float64_oracle():
  """<grad, d> against the oracle's (f(a + h d) - f(a - h d)) / 2h, d random over all six
  inputs at once."""
  with jax.enable_x64(True):
    _, grads = _loss_grad(_args64())
  assert grads[0].dtype == jnp.float64
  args = (Q, K, V, O, S, L)  # the oracle's order
  grads = (grads[0], grads[1], grads[5], grads[2], grads[3], grads[4])

  def f(a):
    return np.sum(W * o_ponet(*a, IDS, MASK, 3, False))

  h = 1e-6
  for _ in range(3):
    d = [RNG.standard_normal(a.shape) for a in args]
    up = [a.astype(np.float64) + h * e for a, e in zip(args, d, strict=True)]
    down = [a.astype(np.float64) - h * e for a, e in zip(args, d, strict=True)]
    fd = (f(up) - f(down)) / (2 * h)
    ad = sum(np.sum(np.asarray(g) * e) for g, e in zip(grads, d, strict=True))
    # generic inputs (no ties in the maxima; h far below the gaps between candidates): the
    # central difference errs by O(h^2) ~ 1e-12 plus roundoff 2^-52 |f| / h ~ 1e-9.
    np.testing.assert_allclose(fd, ad, rtol=1e-7, atol=1e-7)


def test_bf16_in_bf16_out_close_to_float32():
  args = [jnp.asarray(a, jnp.bfloat16) for a in (Q, K, O, S, L, V)]
  out = mix(*args[:5], value=args[5], segment_ids=IDS, mask=MASK)
  assert out.dtype == jnp.bfloat16
  want = o_ponet(*(np.asarray(a, np.float32) for a in (args[0], args[1], args[5], args[2],
                                                      args[3], args[4])), IDS, MASK, 3, False)
  # float32 inside, one rounding to bf16 at the end: 2^-8 relative on outputs < 10
  np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2 ** -8, atol=2e-2)


def test_bad_input_raises():
  f = js.attention.ponet_mix
  with pytest.raises(ValueError, match="exactly one of"):
    f(Q, K, O, S, L, value=V)
  with pytest.raises(ValueError, match="exactly one of"):
    f(Q, K, O, S, L, value=V, segment_ids=IDS, segment_size=3)
  with pytest.raises(ValueError, match="`window` must be odd"):
    f(Q, K, O, S, L, value=V, segment_size=3, window=2)
  with pytest.raises(ValueError, match="`window`"):
    f(Q, K, O, S, L, value=V, segment_size=3, window=0)
  with pytest.raises(ValueError, match="`gate`"):
    f(Q, K, O[..., :1], S, L, value=V, segment_size=3)
  with pytest.raises(ValueError, match="`key`"):
    f(Q, K[:, :5], O, S, L, value=V, segment_size=3)
  with pytest.raises(ValueError, match="`mask`"):
    f(Q, K, O, S, L, value=V, segment_size=3, mask=np.ones((3, T), bool))
  with pytest.raises(ValueError, match="`segment_ids`"):
    f(Q, K, O, S, L, value=V, segment_ids=IDS.astype(np.float32))
  with pytest.raises(ValueError, match="`causal`"):
    f(Q, K, O, S, L, value=V, segment_size=3, causal=1)
  empty = jnp.zeros((2, 0, 1, 3))  # no token: an empty result
  assert f(empty, empty, empty, empty, empty, segment_size=2).shape == (2, 0, 1, 3)


def test_ponet_mixer_module_is_its_projections_around_ponet_mix():
  layer = js.nn.PoNetMixer(6, num_heads=2, segment_size=3, rngs=nnx.Rngs(0))
  x = RNG.standard_normal((B, T, 6)).astype(np.float32)
  run = nnx.jit(lambda m, v, mask: m(v, mask=mask))
  with jax.default_matmul_precision("highest"):  # float32 projections on GPUs too (no TF32)
    y = run(layer, jnp.asarray(x), jnp.asarray(MASK))
    y2 = run(layer, jnp.asarray(x).at[0, 8].set(1e4).at[1, 7].set(-1e4), jnp.asarray(MASK))
  assert y.shape == (B, T, 6)

  def proj(lin):
    w = np.asarray(lin.kernel[...], np.float64)
    b = np.asarray(lin.bias[...], np.float64)
    return lambda a: a @ w + b

  hd = lambda a: a.reshape(B, T, 2, 3)  # noqa: E731
  q, k, o, s, l = (hd(proj(lin)(x.astype(np.float64))) for lin in (
      layer.query, layer.key, layer.gate, layer.segment, layer.local))
  ids = np.broadcast_to(np.arange(T) // 3, (B, T))
  mixed = o_ponet(q, k, k, o, s, l, ids, MASK, 3, False).reshape(B, T, 6)
  # float32: projections of width 6, the mixer, the output projection of width 6: ~25
  # roundings of 2^-24 on values < 20 is ~3e-5; 1e-4 leaves a margin.
  np.testing.assert_allclose(y, proj(layer.out)(mixed), rtol=1e-4, atol=1e-4)
  # padding never leaks through the layer either
  np.testing.assert_allclose(y2[MASK], y[MASK], rtol=1e-6, atol=1e-6)
  abstract = nnx.eval_shape(lambda: js.nn.PoNetMixer(6, num_heads=2, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="`segment_ids`"):
    abstract(x)  # no segment_size and no segment_ids
  with pytest.raises(ValueError, match="`window`"):
    js.nn.PoNetMixer(6, num_heads=2, window=4, rngs=nnx.Rngs(0))


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [1, 3, 7])
@pytest.mark.parametrize("segment_size", [1, 2, 5, 20])
def test_oracle_sweep(causal, window, segment_size):
  if window % 2 == 0 and not causal:
    window += 1
  rng = np.random.default_rng(window * 100 + segment_size)
  t = 13
  q, k = (rng.standard_normal((3, t, 2, 4)).astype(np.float32) for _ in range(2))
  v, o, s, l = (rng.standard_normal((3, t, 2, 3)).astype(np.float32) for _ in range(4))
  mask = rng.random((3, t)) < 0.7
  mask[:, 0] = True
  out = mix(q, k, o, s, l, value=v, segment_size=segment_size, window=window, mask=mask,
            causal=causal)
  ids = np.broadcast_to(np.arange(t) // segment_size, (3, t))
  np.testing.assert_allclose(out, o_ponet(q, k, v, o, s, l, ids, mask, window, causal), **TOL)


def test_causal_mixer_needs_no_implicit_rank_promotion():
  """The causal [T, T] matrix and the [..., T] token mask broadcast explicitly: the causal
  mixer runs under numpy_rank_promotion("raise") (it raised there before)."""
  layer = js.nn.PoNetMixer(8, 2, segment_size=4, causal=True, window=2, rngs=nnx.Rngs(0))
  x = jnp.ones((2, 6, 8))
  with jax.numpy_rank_promotion("raise"):
    out = layer(x)
  assert out.shape == (2, 6, 8)
