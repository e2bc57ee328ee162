"""N15 truncated softmax: top-k, top-p, epsilon- and eta-truncation against dense references."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft.normalizers as jn
from jaxsoft.normalizers import epsilon_softmax, eta_softmax, top_k_softmax, top_p_softmax
from tests import helpers
from tests.helpers import normal


def _softmax64(x, keep):
  """float64 softmax over the entries in ``keep`` (numpy), 0 elsewhere."""
  x = np.asarray(x, np.float64)
  e = np.where(keep, np.exp(np.where(keep, x - np.max(np.where(keep, x, -np.inf), -1,
                                                       keepdims=True), 0)), 0)
  s = e.sum(-1, keepdims=True)
  return np.where(s > 0, e / np.where(s > 0, s, 1), 0)


def reference_keep_top_k(x, k, mask):
  """Visible entries >= the k-th largest visible entry (ties with it are all kept)."""
  x = np.asarray(x, np.float64)
  keep = np.zeros(x.shape, bool)
  for idx in np.ndindex(*x.shape[:-1]):
    vis = np.nonzero(mask[idx])[0]
    if len(vis) <= k:
      keep[idx + (vis,)] = True
      continue
    kth = np.sort(x[idx][vis])[::-1][k - 1]
    keep[idx + (vis[x[idx][vis] >= kth],)] = True
  return keep


def reference_keep_top_p(x, p, mask):
  probs = _softmax64(x, mask)
  keep = np.zeros(x.shape, bool)
  for idx in np.ndindex(*x.shape[:-1]):
    order = np.argsort(-probs[idx], kind="stable")
    total = 0.0
    for j in order:
      if not mask[idx][j] or total >= p:
        break
      keep[idx + (j,)] = True
      total += probs[idx][j]
  return keep


def _mask(seed, shape, p=0.8):
  return np.array(jax.random.bernoulli(jax.random.PRNGKey(seed), p, shape))


@pytest.mark.parametrize("k", [1, 3, 7, 12])
def test_top_k_matches_reference(k):
  x = normal(0, (10, 12), 2.0)
  mask = _mask(1, x.shape)
  mask[0, :] = False
  mask[1, :2] = True
  mask[1, 2:] = False  # fewer than k visible entries: all of them are kept
  want = _softmax64(x, reference_keep_top_k(x, k, mask) & mask)
  got = top_k_softmax(x, k=k, where=mask)
  chex.assert_trees_all_close(got, jnp.asarray(want, jnp.float32), atol=1e-6)
  n_kept = np.minimum(k, mask.sum(-1))
  assert np.array_equal(np.asarray(jnp.sum(got > 0, -1)), n_kept)


def test_top_k_closed_forms():
  x = normal(2, (6, 9))
  chex.assert_trees_all_close(top_k_softmax(x, k=9), jax.nn.softmax(x), atol=1e-6)
  chex.assert_trees_all_close(top_k_softmax(x, k=1), jax.nn.one_hot(jnp.argmax(x, -1), 9), atol=0)
  ties = jnp.array([1.0, 3.0, 3.0, 3.0, 0.0])
  # every entry tied with the k-th largest is kept (permutation equivariance)
  chex.assert_trees_all_close(top_k_softmax(ties, k=2), jnp.array([0, 1, 1, 1, 0]) / 3.0, atol=1e-7)


def test_top_k_gradients_and_axis():
  x = normal(3, (4, 5, 8))
  ct = normal(4, x.shape)
  keep = reference_keep_top_k(np.asarray(x), 3, np.ones(x.shape, bool))
  ref = lambda v: jax.nn.softmax(jnp.where(keep, v, -jnp.inf), axis=-1)  # noqa: E731
  # jitted: one program each rather than op by op
  out, vjp = jax.vjp(jax.jit(lambda v: top_k_softmax(v, k=3)), x)
  ref_out, ref_vjp = jax.vjp(jax.jit(ref), x)
  chex.assert_trees_all_close(out, ref_out, atol=1e-6)
  chex.assert_trees_all_close(vjp(ct), ref_vjp(ct), atol=1e-6)
  assert bool(jnp.all(jnp.where(keep, 0.0, vjp(ct)[0]) == 0))  # zero gradient outside top-k
  chex.assert_trees_all_close(top_k_softmax(x, k=3, axis=1),
                              jnp.moveaxis(top_k_softmax(jnp.moveaxis(x, 1, -1), k=3), -1, 1),
                              atol=0)


def test_top_k_check_grads_float64():
  from jax.test_util import check_grads
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.PRNGKey(5), (3, 8), dtype=jnp.float64)
    # jitted: check_grads compiles each derivative program once instead of op by op
    check_grads(jax.jit(lambda v: top_k_softmax(v, k=4)), (x,), order=1, modes=("fwd", "rev"),
                eps=1e-6)


@pytest.mark.parametrize("p", [0.3, 0.7, 0.95, 1.0])
def test_top_p_matches_reference(p):
  x = normal(6, (10, 15), 1.5)
  mask = _mask(7, x.shape)
  mask[0] = False
  want = _softmax64(x, reference_keep_top_p(x, p, mask))
  chex.assert_trees_all_close(top_p_softmax(x, p=p, where=mask), jnp.asarray(want, jnp.float32),
                              atol=1e-6)


def test_top_p_one_is_softmax():
  x = normal(8, (5, 7))
  chex.assert_trees_all_close(top_p_softmax(x, p=1.0), jax.nn.softmax(x), atol=1e-6)


@pytest.mark.parametrize("eps", [0.0, 0.02, 0.1, 0.5])
def test_epsilon_matches_reference(eps):
  x = normal(9, (10, 15), 1.5)
  mask = _mask(10, x.shape)
  mask[0] = False
  probs = _softmax64(x, mask)
  keep = mask & ((probs >= eps) | (probs == probs.max(-1, keepdims=True)))
  chex.assert_trees_all_close(epsilon_softmax(x, epsilon=eps, where=mask),
                              jnp.asarray(_softmax64(x, keep), jnp.float32), atol=1e-6)


@pytest.mark.parametrize("eta", [0.01, 0.1, 0.4])
def test_eta_matches_reference(eta):
  x = normal(11, (10, 15), 1.5)
  mask = _mask(12, x.shape)
  mask[0] = False
  probs = _softmax64(x, mask)
  with np.errstate(divide="ignore", invalid="ignore"):
    entropy = -np.sum(np.where(probs > 0, probs * np.log(probs), 0), -1, keepdims=True)
  thr = np.minimum(eta, np.sqrt(eta) * np.exp(-entropy))
  keep = mask & ((probs >= thr) | (probs == probs.max(-1, keepdims=True)))
  chex.assert_trees_all_close(eta_softmax(x, eta=eta, where=mask),
                              jnp.asarray(_softmax64(x, keep), jnp.float32), atol=1e-6)


ALL = [lambda v, **kw: top_k_softmax(v, k=4, **kw), lambda v, **kw: top_p_softmax(v, p=0.8, **kw),
       lambda v, **kw: epsilon_softmax(v, epsilon=0.05, **kw), lambda v, **kw: eta_softmax(v, eta=0.05, **kw)]


@pytest.mark.parametrize("fn", ALL)
def test_masks_and_fully_masked_rows(fn):
  x = normal(13, (6, 10))
  mask = helpers.check_masked_columns(fn, x, cols=(0, 7), empty_row=3, atol=1e-6)
  g = jax.jit(jax.grad(lambda v: jnp.sum(fn(v, where=mask) * jnp.arange(10.0)[None])))(x)
  assert bool(jnp.all(jnp.isfinite(g))) and bool(jnp.all(g[3] == 0))


@pytest.mark.parametrize("fn", ALL)
@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float16, 1e-3)])
def test_low_precision_and_shifts(fn, dtype, tol):
  x = normal(14, (8, 12), 2.0)
  y = fn(x.astype(dtype))
  assert y.dtype == dtype
  chex.assert_trees_all_close(y.astype(jnp.float32), fn(x.astype(dtype).astype(jnp.float32)),
                              atol=tol)
  chex.assert_trees_all_close(fn(x + 1000.0), fn(x), atol=1e-3)
  chex.assert_trees_all_close(fn(x - 1000.0), fn(x), atol=1e-3)
  assert not bool(jnp.any(jnp.isnan(fn(jnp.full((2, 5), 60000.0, dtype)).astype(jnp.float32))))


@pytest.mark.parametrize("fn", ALL)
def test_jit_vmap_and_sums_to_one(fn):
  x = normal(15, (3, 4, 9))
  chex.assert_trees_all_close(jax.jit(fn)(x), fn(x), atol=1e-7)
  chex.assert_trees_all_close(jax.vmap(fn)(x), fn(x), atol=1e-7)
  chex.assert_trees_all_close(jnp.sum(fn(x), -1), jnp.ones((3, 4)), atol=1e-6)


def test_bad_input():
  x = jnp.ones((2, 5))
  for bad in (0, 6, -1, 2.0, jnp.array(2)):
    with pytest.raises(ValueError, match="`k`"):
      top_k_softmax(x, k=bad)
  for bad in (0.0, 1.5, -0.1):
    with pytest.raises(ValueError, match="`p`"):
      top_p_softmax(x, p=bad)
  with pytest.raises(ValueError, match="epsilon"):
    epsilon_softmax(x, epsilon=1.0)
  with pytest.raises(ValueError, match="eta"):
    eta_softmax(x, eta=-0.5)
  with pytest.raises(ValueError, match="axis"):
    top_k_softmax(x, k=2, axis=3)


def test_specs():
  for name in ("top_k_softmax", "top_p_softmax", "epsilon_softmax", "eta_softmax"):
    spec = jn.get(name)
    assert spec.catalogue_id == "N15" and spec.can_be_sparse
  # epsilon and eta cut at a closed form of the row's softmax statistics: class R
  for name in ("epsilon_softmax", "eta_softmax"):
    assert jn.get(name).kernel_class == "R" and jn.get(name).row_stats is not None
  assert jn.get("top_k_softmax").defaults == {"k": 8}
  assert jn.get("top_k_softmax").threshold is not None


_CHUNKED = ("xla_chunked",)
_ALL_BLOCKWISE = ("xla_chunked", "pallas_triton", "pallas_mosaic_tpu")


@pytest.mark.parametrize("name,level,impls", [
    ("epsilon_softmax", 0.9, _CHUNKED), ("epsilon_softmax", 0.02, _ALL_BLOCKWISE),
    ("eta_softmax", 0.9, _CHUNKED), ("eta_softmax", 0.02, _ALL_BLOCKWISE)])
def test_blockwise_truncation_matches_dense(name, level, impls, monkeypatch):
  """epsilon/eta in attention blockwise (class R: the cut from the row's softmax
  statistics, then softmax over the kept keys) against the dense path, forward and
  gradients. epsilon = 0.9 keeps only the argmax of every row (the cut lies above the max,
  so the argmax is kept by its own rule); eta = 0.9 lowers its level with the row's
  entropy; 0.02 keeps a few keys; a batch row without keys."""
  from jaxsoft.attention import dot_product_attention as dpa
  monkeypatch.setenv("JAXSOFT_PALLAS_INTERPRET", "1")  # the Pallas kernels on CPU
  ks = jax.random.split(jax.random.PRNGKey(4), 4)
  q, k, v = (jax.random.normal(x, (2, 80, 2, 16)) * 2.0 for x in ks[:3])
  ct = jax.random.normal(ks[3], v.shape)
  hp = {"epsilon" if name == "epsilon_softmax" else "eta": level}
  lens = jnp.array([80, 0])

  def run(impl):
    def loss(q, k, v):
      o = dpa(q, k, v, is_causal=True, normalizer=name, normalizer_params=hp,
              key_value_seq_lengths=lens, implementation=impl)
      return jnp.sum(o * ct), o
    # one jitted program per implementation (eager, every op compiled on its own)
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)

  (_, ref), gref = run("xla")
  if name == "epsilon_softmax" and level == 0.9:  # one key per row: its value
    s = jnp.einsum("btnh,bsnh->bnts", q[:1], k[:1]) / 4.0
    top = jnp.argmax(jnp.where(jnp.tril(jnp.ones((80, 80), bool)), s, -jnp.inf), -1)
    want = jnp.take_along_axis(jnp.transpose(v[:1], (0, 2, 1, 3)), top[..., None], 2)
    np.testing.assert_allclose(ref[:1], jnp.transpose(want, (0, 2, 1, 3)), atol=1e-6)
  np.testing.assert_array_equal(ref[1], 0.0)
  for impl in impls:
    (_, out), g = run(impl)
    np.testing.assert_allclose(out, ref, atol=2e-5, err_msg=impl)
    for a, b in zip(g, gref, strict=True):
      np.testing.assert_allclose(a, b, atol=2e-4, err_msg=impl)


@pytest.mark.parametrize("name,hp,impls", [
    ("top_k_softmax", {"k": 3}, _CHUNKED), ("top_p_softmax", {"p": 0.5}, _ALL_BLOCKWISE),
    ("top_p_softmax", {"p": 1.0}, _CHUNKED)])
def test_blockwise_top_k_top_p_match_dense(name, hp, impls, monkeypatch):
  """top-k and top-p in attention blockwise (the threshold search; top-p's target from a
  statistics pass) against the dense path, forward and every cotangent, with a soft cap,
  a dense mask and bias and 4 x 4 chunks. On these inputs xla_chunked once halved the
  argmax's gradient: its backward recomputed the top score an ulp above the max pass's, where
  the weight's clamp ``exp(min(z - m, 0))`` has slope 1/2."""
  from jaxsoft.attention import _chunked
  from jaxsoft.attention import dot_product_attention as dpa
  monkeypatch.setenv("JAXSOFT_PALLAS_INTERPRET", "1")
  monkeypatch.setattr(_chunked, "BLOCK_Q", 4)
  monkeypatch.setattr(_chunked, "BLOCK_K", 4)
  b, t, n = 2, 11, 4
  q, k, v = helpers.make_qkv(3, b, t, N=n, K=2, H=8)
  bias = 0.5 * helpers.standard_normal(4, (b, n, t, t))
  mask = jax.random.bernoulli(jax.random.PRNGKey(2), 0.7, (b, 1, t, t))
  kw = dict(mask=mask, logits_soft_cap=2.0, normalizer=name, normalizer_params=hp)

  def fn(impl):  # jitted: one program per implementation rather than op by op
    return jax.jit(lambda q, k, v, bias: dpa(q, k, v, bias, implementation=impl, **kw))

  for impl in impls:
    helpers.assert_same(fn(impl), fn("xla"), (q, k, v, bias))


def test_blockwise_top_p_rows_without_keys_are_zero(monkeypatch):
  """top-p blockwise (statistics pass, then the search) on a batch row with no visible key:
  zeros out, zero and finite gradients, in xla_chunked and the Triton interpreter."""
  from jaxsoft.attention import dot_product_attention as dpa
  monkeypatch.setenv("JAXSOFT_PALLAS_INTERPRET", "1")
  q, k, v = helpers.make_qkv(5, 2, 16, N=2, K=1, H=8)
  lens = jnp.array([16, 0])
  for impl in ("xla_chunked", "pallas_triton"):
    def loss(q, k, v, impl=impl):
      o = dpa(q, k, v, normalizer="top_p_softmax", normalizer_params={"p": 0.5},
              key_value_seq_lengths=lens, implementation=impl)
      return jnp.sum(o ** 2), o
    (_, o), g = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    np.testing.assert_array_equal(o[1], 0.0)
    assert float(jnp.abs(o[0]).max()) > 0
    for a in g:
      assert bool(jnp.all(jnp.isfinite(a))), impl
      np.testing.assert_array_equal(a[1], 0.0)


def test_top_p_traced_p_is_a_clear_error():
  # Issue 37, defect 16: a traced p gave a bare ConcretizationTypeError from deep inside.
  x = jnp.array([2.0, 1.0, 0.5, -1.0])
  with pytest.raises(ValueError, match="top_p_softmax: `p` must be a static Python float"):
    jax.jit(lambda x, p: top_p_softmax(x, p=p))(x, 0.8)
  with pytest.raises(ValueError, match="an array of shape"):
    top_p_softmax(x, p=jnp.array([0.8, 0.9]))
  # static under jit: fine, and equal to the eager call
  f = jax.jit(lambda x: top_p_softmax(x, p=0.8))
  np.testing.assert_array_equal(f(x), top_p_softmax(x, p=0.8))
