"""L08 linear_cross_entropy against optax on the full logits and a float64 numpy reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft as js
from tests.helpers import check_raises, normal

lce = js.losses.linear_cross_entropy
N, D, V = 37, 8, 53          # chunk sizes 8 and 16 divide neither 37 tokens nor 53 columns


def _inputs(seed, n=N, d=D, v=V, scale=1.0):
  h = normal(seed, (n, d), scale=scale)
  w = normal(seed + 1, (d, v), scale=1.0 / np.sqrt(d))
  y = jax.random.randint(jax.random.key(seed + 2), (n,), 0, v)
  return h, w, y


def _reference(h, w, y, ct, eps=0.0, lam=0.0, cap=None):
  """float64 numpy: per-token loss and the gradients of <loss, ct> in h and w."""
  h, w, ct = (np.asarray(a, np.float64) for a in (h, w, ct))
  y = np.asarray(y)
  raw = h @ w
  z = raw if cap is None else cap * np.tanh(raw / cap)
  m = z.max(-1, keepdims=True)
  lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[:, 0]
  p = np.exp(z - lse[:, None])
  onehot = np.eye(w.shape[1])[y]
  z_y = z[np.arange(len(y)), y]
  loss = lse - (1 - eps) * z_y - eps * z.mean(-1) + lam * lse**2
  dz = (1 + 2 * lam * lse)[:, None] * p - (1 - eps) * onehot - eps / w.shape[1]
  if cap is not None:
    dz = dz * (1 - (z / cap) ** 2)
  dz = dz * ct[:, None]
  return loss, dz @ w.T, h.T @ dz


def _value_and_grads(f, h, w, ct):
  @jax.jit
  def run(h, w):
    out, vjp = jax.vjp(f, h, w)
    return out, vjp(ct.astype(out.dtype))
  return run(h, w)


def test_equals_optax_on_the_full_logits():
  h, w, y = _inputs(0)
  ct = normal(9, (N,))
  ours = _value_and_grads(
      lambda a, b: lce(a, b, y, token_chunk_size=8, vocab_chunk_size=16), h, w, ct)
  ref = _value_and_grads(
      lambda a, b: optax.losses.softmax_cross_entropy_with_integer_labels(a @ b, y), h, w, ct)
  chex.assert_trees_all_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunks", [(8, 16), (5, 53), (64, 7), (1, 1)])
def test_matches_float64_reference_with_smoothing_z_loss_and_softcap(chunks):
  h, w, y = _inputs(1, scale=3.0)
  ct = normal(10, (N,))
  kw = dict(label_smoothing=0.1, z_loss=1e-2, softcap=2.5)
  out, (dh, dw) = _value_and_grads(
      lambda a, b: lce(a, b, y, token_chunk_size=chunks[0], vocab_chunk_size=chunks[1], **kw),
      h, w, ct)
  loss, rdh, rdw = _reference(h, w, y, ct, eps=0.1, lam=1e-2, cap=2.5)
  np.testing.assert_allclose(out, loss, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dh, rdh, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dw, rdw, rtol=1e-4, atol=1e-5)


def test_smoothing_matches_optax_smooth_labels():
  h, w, y = _inputs(2)
  got = lce(h, w, y, label_smoothing=0.2, token_chunk_size=6, vocab_chunk_size=10)
  want = optax.losses.softmax_cross_entropy(h @ w, optax.smooth_labels(jax.nn.one_hot(y, V), 0.2))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_where_ignore_index_and_labels_out_of_range():
  h, w, y = _inputs(3)
  y = y.at[4].set(-100).at[5].set(V).at[6].set(-1)
  where = jnp.ones((N,), bool).at[0].set(False).at[6].set(False)
  ct = normal(11, (N,))
  out, (dh, dw) = _value_and_grads(
      lambda a, b: lce(a, b, y, where=where, ignore_index=-100, token_chunk_size=8,
                       vocab_chunk_size=16), h, w, ct)
  dropped = np.array([0, 4, 6])           # where False, ignore_index, where False (over -1)
  np.testing.assert_array_equal(out[dropped], 0.0)
  assert out[5] == jnp.inf                # a label naming no class: +inf, no gradient
  kept = np.setdiff1d(np.arange(N), [0, 4, 5, 6])
  assert np.all(np.isfinite(dh)) and np.all(np.isfinite(dw))
  np.testing.assert_array_equal(dh[np.array([0, 4, 5, 6])], 0.0)
  loss, rdh, rdw = _reference(h[kept], w, y[kept], ct[kept])
  np.testing.assert_allclose(out[kept], loss, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dh[kept], rdh, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dw, rdw, rtol=1e-4, atol=1e-5)


def test_batch_shape_and_empty():
  h, w, y = _inputs(4, n=12)
  got = lce(h.reshape(3, 4, D), w, y.reshape(3, 4), token_chunk_size=5, vocab_chunk_size=9)
  assert got.shape == (3, 4)
  np.testing.assert_allclose(got.reshape(-1), lce(h, w, y), rtol=1e-6)
  assert lce(jnp.zeros((0, D)), w, jnp.zeros((0,), jnp.int32)).shape == (0,)


def test_bfloat16_is_computed_in_float32():
  h, w, y = _inputs(5)
  hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  ct = normal(12, (N,))
  f = lambda a, b: lce(a, b, y, z_loss=1e-3, token_chunk_size=8, vocab_chunk_size=16)
  out, (dh, dw) = _value_and_grads(f, hb, wb, ct)
  assert out.dtype == dh.dtype == dw.dtype == jnp.bfloat16
  # the bf16 inputs, upcast: only the output and gradient roundings remain
  loss, rdh, rdw = _reference(hb.astype(jnp.float32), wb.astype(jnp.float32), y,
                              ct.astype(jnp.bfloat16).astype(jnp.float32), lam=1e-3)
  np.testing.assert_allclose(out.astype(np.float32), loss, rtol=1e-2)
  np.testing.assert_allclose(dh.astype(np.float32), rdh, rtol=1e-2, atol=1e-4)
  np.testing.assert_allclose(dw.astype(np.float32), rdw, rtol=1e-2, atol=1e-4)


def test_extreme_logits_are_finite_and_exact():
  h, w, y = _inputs(6, scale=3e3)         # logits of order 1e4: e^z overflows float32
  ct = jnp.ones((N,))
  out, (dh, dw) = _value_and_grads(
      lambda a, b: lce(a, b, y, token_chunk_size=8, vocab_chunk_size=16), h, w, ct)
  loss, rdh, rdw = _reference(h, w, y, ct)
  assert np.all(np.isfinite(out)) and np.all(np.isfinite(dh)) and np.all(np.isfinite(dw))
  np.testing.assert_allclose(out, loss, rtol=1e-4, atol=0.5)
  np.testing.assert_allclose(dh, rdh, rtol=1e-3, atol=1e-3)
  capped = _value_and_grads(
      lambda a, b: lce(a, b, y, softcap=30.0, token_chunk_size=8, vocab_chunk_size=16), h, w, ct)
  assert all(np.all(np.isfinite(a)) for a in jax.tree.leaves(capped))


def test_vmap_and_checkpoint():
  h, w, y = _inputs(9, n=12)
  hb, yb = h.reshape(3, 4, D), y.reshape(3, 4)
  f = lambda a, b, c: lce(a, b, c, z_loss=1e-3, token_chunk_size=3, vocab_chunk_size=20)

  @jax.jit
  def run(hb, w):
    plain = jax.value_and_grad(lambda a, b: f(a, b, yb).sum(), argnums=(0, 1))(hb, w)
    mapped = jax.value_and_grad(
        lambda a, b: jax.vmap(f, in_axes=(0, None, 0))(a, b, yb).sum(), argnums=(0, 1))(hb, w)
    remat = jax.value_and_grad(
        lambda a, b: jax.checkpoint(f)(a, b, yb).sum(), argnums=(0, 1))(hb, w)
    return plain, mapped, remat

  plain, mapped, remat = run(hb, w)
  chex.assert_trees_all_close(mapped, plain, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(remat, plain, rtol=1e-6, atol=1e-7)


def _all_shapes(jaxpr, acc):
  """Every array shape in a jaxpr and in the jaxprs nested in its equations (scan bodies,
  custom-VJP rules, pjit calls)."""
  acc.update(tuple(v.aval.shape) for v in (*jaxpr.invars, *jaxpr.constvars))
  for eqn in jaxpr.eqns:
    acc.update(tuple(v.aval.shape) for v in eqn.outvars)
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          _all_shapes(sub, acc)
  return acc


def test_no_tokens_by_vocab_array_in_forward_or_backward():
  h, w, y = _inputs(7)

  def largest(f):
    grad = jax.value_and_grad(lambda a, b: f(a, b).sum(), argnums=(0, 1))
    shapes = _all_shapes(jax.make_jaxpr(grad)(h, w).jaxpr, set())
    return max(int(np.prod(s)) for s in shapes)

  ours = largest(lambda a, b: lce(a, b, y, label_smoothing=0.1, z_loss=1e-3, softcap=5.0,
                                  token_chunk_size=8, vocab_chunk_size=16))
  # the largest arrays are the inputs and their gradients: w / dw ([d, V])
  assert ours == D * V < N * V
  # the same inspection does see the logits of the plain computation
  full = largest(lambda a, b: optax.losses.softmax_cross_entropy_with_integer_labels(a @ b, y))
  assert full == N * V


def test_bad_input_names_the_argument():
  h, w, y = _inputs(8, n=4)
  check_raises(
      ("`w`", lambda: lce(h, w.T, y)),
      ("`w`", lambda: lce(h, jnp.zeros((D, 0)), y)),
      ("`h`", lambda: lce(jnp.zeros((4, D), jnp.complex64), w, y)),
      ("`labels`", lambda: lce(h, w, y[:3])),
      ("`labels`", lambda: lce(h, w, y.astype(jnp.float32))),
      ("`where`", lambda: lce(h, w, y, where=jnp.ones((3,), bool))),
      ("`label_smoothing`", lambda: lce(h, w, y, label_smoothing=1.0)),
      ("`z_loss`", lambda: lce(h, w, y, z_loss=-1.0)),
      ("`softcap`", lambda: lce(h, w, y, softcap=0.0)),
      ("`token_chunk_size`", lambda: lce(h, w, y, token_chunk_size=0)),
      ("`vocab_chunk_size`", lambda: lce(h, w, y, vocab_chunk_size=2.5)),
      ("`ignore_index`", lambda: lce(h, w, y, ignore_index=0.5)),
      ("`implementation`", lambda: lce(h, w, y, implementation="cudnn")),
  )


def test_default_chunks_and_implementation_xla():
  # 300 tokens x 1100 columns: the default chunks (256 x 1024) divide neither axis
  h, w, y = _inputs(10, n=300, v=1100)
  ref = lce(h, w, y, token_chunk_size=256, vocab_chunk_size=1024, label_smoothing=0.1)
  np.testing.assert_array_equal(lce(h, w, y, label_smoothing=0.1), ref)
  np.testing.assert_array_equal(lce(h, w, y, label_smoothing=0.1, implementation="xla"), ref)
  loss, _, _ = _reference(h, w, y, jnp.ones((300,)), eps=0.1)
  np.testing.assert_allclose(ref, loss, rtol=1e-5, atol=1e-5)
