"""E17: softmax attention is a low-pass filter (catalogue 004#10, Marin et al., "Token Pooling
in Vision Transformers"; notebooks/16_attention_low_pass).

The attention matrix P comes from js.attention.dot_product_attention with the identity as the
values. Checked, in float64: P 1 = 1 (the constant signal passes), every other eigenvalue lies
within Dobrushin's coefficient delta(P) < 1, the max-min range of any signal contracts by
delta(P); with positional tokens P is circulant and its eigenvalues (the frequency response)
fall with the frequency; stacks attenuate the non-constant part more with depth; the energy
form holds for a doubly stochastic P but not for every softmax P (the counterexample).
"""

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js

S, H = 32, 8


@jax.jit
def _attention_matrices_jit(q, k):
  eye = jnp.broadcast_to(jnp.eye(k.shape[1], dtype=k.dtype), (k.shape[0],) + (k.shape[1],) * 2)
  return js.attention.dot_product_attention(q[:, :, None], k[:, :, None], eye[:, :, None],
                                            scale=1.0)[:, :, 0]


def _attention_matrices(q, k):
  """[B, S, h <= H] queries and keys -> [B, S, S] attention matrices (scale 1), float64. Padded
  to [8, S, H] with zeros (which change no dot product) so that every call shares one program."""
  b, h = q.shape[0], q.shape[-1]
  pad = lambda a: np.pad(a, ((0, 8 - b), (0, 0), (0, H - h)))  # noqa: E731
  with jax.enable_x64(True):
    out = np.asarray(_attention_matrices_jit(jnp.asarray(pad(q)), jnp.asarray(pad(k))))[:b]
  assert out.dtype == np.float64
  return out


def _dobrushin(P):
  return np.array([1.0 - np.minimum(p[:, None, :], p[None, :, :]).sum(-1).min() for p in P])


def _centre(x):
  return x - x.mean(axis=-2, keepdims=True)


def test_dc_passes_other_eigenvalues_and_the_range_contract_by_dobrushins_coefficient():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(8, S, H))
  w = rng.normal(size=(2, H, H)) / np.sqrt(H)
  P = _attention_matrices(x @ w[0] / H ** 0.25, x @ w[1] / H ** 0.25)
  # reference: the softmax of the logits in numpy float64 (1e-15: a few roundoffs of p ~ 1/S)
  logits = (x @ w[0]) @ np.swapaxes(x @ w[1], -1, -2) / np.sqrt(H)
  ref = np.exp(logits - logits.max(-1, keepdims=True))
  np.testing.assert_allclose(P, ref / ref.sum(-1, keepdims=True), rtol=1e-12, atol=1e-15)
  np.testing.assert_allclose(P @ np.ones(S), 1.0, rtol=0, atol=S * 2.0 ** -52)
  delta = _dobrushin(P)
  assert np.all(delta < 1)  # positive rows overlap
  mags = np.sort(np.abs(np.linalg.eigvals(P)), axis=-1)
  np.testing.assert_allclose(mags[:, -1], 1.0, atol=1e-12)
  assert np.all(mags[:, -2] <= delta + 1e-12)  # Seneta: |lambda_2| <= delta(P)
  v = rng.normal(size=(S, 5))
  osc = lambda a: a.max(-2) - a.min(-2)  # noqa: E731
  assert np.all(osc(P @ v) <= delta[:, None] * osc(v)[None] + 1e-12)


def test_positional_tokens_give_a_circulant_low_pass_filter_and_depth_attenuates_more():
  t = np.arange(S)
  omega = 2 * np.pi * np.arange(1, 4) / S
  pos = np.concatenate([np.cos(np.outer(t, omega)), np.sin(np.outer(t, omega))], axis=1)
  P = _attention_matrices(pos[None], pos[None])[0]
  for i in range(S):  # circulant: row i is row 0 shifted by i (1e-15: roundoff of p ~ 1/S)
    np.testing.assert_allclose(P[i], np.roll(P[0], i), rtol=0, atol=1e-15)
  response = np.fft.fft(P[0]).real  # the eigenvalues of a circulant matrix
  np.testing.assert_allclose(np.sort(np.linalg.eigvals(P).real), np.sort(response), atol=1e-12)
  assert abs(response[0] - 1) < 1e-14
  half = response[1: S // 2 + 1]
  assert np.all(np.abs(half) < 1) and np.all(np.diff(half[: S // 4]) < 0)  # monotone low-pass
  assert abs(half[-1]) < 1e-2 * half[0]  # 1.1e-3 against 0.74
  # depth: a random signal's non-constant part shrinks with every extra layer (pure stack)
  rng = np.random.default_rng(1)
  x = rng.normal(size=(8, S, H))
  w = rng.normal(size=(8, 2, H, H)) / np.sqrt(H)
  Ps = _attention_matrices(np.einsum("bsh,bhk->bsk", x, w[:, 0]) / H ** 0.25,
                           np.einsum("bsh,bhk->bsk", x, w[:, 1]) / H ** 0.25)
  v = rng.normal(size=(S, 16))
  left, out = [], v
  for layer in range(8):
    out = Ps[layer] @ out
    left.append(np.linalg.norm(_centre(out)) / np.linalg.norm(_centre(v)))
  assert np.all(np.diff(left) < 0) and left[0] < 0.6 and left[-1] < 1e-3


def test_energy_form_holds_for_doubly_stochastic_attention_not_for_every_softmax():
  # the counterexample: rows that pick (0, 1, 1) from values (0, 1/2, 1)
  P = np.asarray(js.normalizers.softmax(jnp.asarray(40.0 * np.array([[1.0, 0, 0], [0, 0, 1],
                                                                      [0, 0, 1]]))))
  v = np.array([[0.0], [0.5], [1.0]])
  assert np.sum(_centre(P @ v) ** 2) > 1.3 * np.sum(_centre(v) ** 2)  # 2/3 against 1/2
  # symmetric self-attention q = k = v = x at a large scale spreads the tokens ...
  rng = np.random.default_rng(2)
  x = rng.normal(size=(8, S, 4))
  q = np.sqrt(8.0) * x / 4 ** 0.25
  P = _attention_matrices(q, q)
  gain = np.linalg.norm(_centre(P @ x), axis=(-2, -1)) / np.linalg.norm(_centre(x), axis=(-2, -1))
  assert np.all(gain > 1)
  # ... and its Sinkhorn (doubly stochastic) normalisation cannot: ||C D v|| <= ||C v||
  q = x / 4 ** 0.25
  D = _attention_matrices(q, q)
  for _ in range(300):
    D = D / D.sum(-2, keepdims=True)
    D = D / D.sum(-1, keepdims=True)
  np.testing.assert_allclose(D.sum(-2), 1.0, atol=1e-12)
  gain = np.linalg.norm(_centre(D @ x), axis=(-2, -1)) / np.linalg.norm(_centre(x), axis=(-2, -1))
  assert np.all(gain <= 1 + 1e-12)
