"""jaxsoft.attention.dot_product_attention is a drop-in for jax.nn.dot_product_attention:
jax.nn's own documented calls (positional and keyword, GQA, bias, mask, causal, lengths,
local windows, return_residual, implementation) replayed against jax.nn, forward and
gradients. The one documented difference, rows with no visible key, is checked apart."""

import functools
import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from jaxsoft.attention import _dense
from jaxsoft.attention import dot_product_attention as dpa
from tests.helpers import make_qkv, normal, sampled

B, T, S, N, K, H = 2, 7, 9, 4, 2, 8
q, k, v = make_qkv(0, B=B, T=T, S=S, N=N, K=K, H=H)
bias = 0.5 * normal(1, (B, N, T, S))
# a mask that leaves every query row at least one key (column 0)
_mask = np.random.default_rng(2).random((B, 1, T, S)) < 0.7
_mask[..., 0] = True
mask = jnp.asarray(_mask)
lengths_q = jnp.array([7, 4], jnp.int32)
lengths_kv = jnp.array([9, 3], jnp.int32)

# jax.nn's documented arguments: (name, kwargs) replayed as they are.
CALLS = {
    "plain": {},
    "causal": {"is_causal": True},
    "bias": {"bias": bias},
    "mask": {"mask": mask},
    "bias_mask_causal": {"bias": bias, "mask": mask, "is_causal": True},
    "scale": {"scale": 0.3},
    "lengths": {"query_seq_lengths": lengths_q, "key_value_seq_lengths": lengths_kv},
    "window_int": {"local_window_size": 3},
    "window_pair": {"local_window_size": (2, 1)},
    "causal_window_lengths": {"is_causal": True, "local_window_size": (3, 0),
                              "key_value_seq_lengths": lengths_kv},
    "implementation_xla": {"implementation": "xla"},
    "implementation_none": {"implementation": None},
}
DEFAULT = ("plain", "bias_mask_causal", "lengths", "window_pair", "implementation_xla")


def _visible_rows(kwargs):
  """[B, T, N]: rows with at least one visible key (the documented difference elsewhere)."""
  ones = jnp.ones((B, T, N, 1))
  _, lse = jax.nn.dot_product_attention(ones, jnp.ones((B, S, K, 1)), jnp.ones((B, S, K, 1)),
                                        return_residual=True, **{
                                            n: a for n, a in kwargs.items()
                                            if n not in ("bias", "scale", "implementation")})
  return lse > -1e30  # jax.nn's masked rows: a large negative number (+ log S)


@pytest.mark.parametrize("name", sampled(list(CALLS), DEFAULT))
def test_promise_drop_in_jax_nn_attention_calls(name):
  """Positional and keyword calls, output and residual equal jax.nn's on visible rows."""
  kwargs = CALLS[name]
  ref, ref_res = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kwargs)
  out_pos = dpa(q, k, v, return_residual=False, **kwargs)
  out, res = dpa(query=q, key=k, value=v, return_residual=True, **kwargs)
  chex.assert_trees_all_equal(out_pos, out)
  assert out.shape == ref.shape and res.shape == ref_res.shape == (B, T, N)
  assert out.dtype == ref.dtype and res.dtype == ref_res.dtype
  rows = np.array(_visible_rows(kwargs))
  if "query_seq_lengths" in kwargs:  # rows past the query length: zeros in both
    rows &= np.arange(T)[None, :, None] < np.asarray(kwargs["query_seq_lengths"])[:, None, None]
  np.testing.assert_allclose(np.asarray(out)[rows], np.asarray(ref)[rows], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(res)[rows], np.asarray(ref_res)[rows], atol=1e-5,
                             rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(res)[~np.asarray(_visible_rows(kwargs))], -np.inf)


@pytest.mark.parametrize("name", sampled(list(CALLS), ("bias_mask_causal", "lengths")))
def test_promise_drop_in_jax_nn_attention_gradients(name):
  kwargs = dict(CALLS[name])
  b = kwargs.pop("bias", jnp.zeros((1, N, 1, S)))
  rows = _visible_rows(kwargs)[..., None]
  if "query_seq_lengths" in kwargs:
    rows &= (jnp.arange(T)[None, :, None] < kwargs["query_seq_lengths"][:, None, None])[..., None]
  ct = jnp.where(rows, normal(3, (B, T, N, H)), 0.0)

  def loss(f, *args):
    return jnp.sum(f(*args[:3], args[3], **kwargs) * ct)

  # jitted: one program each instead of op-by-op dispatch
  got = jax.jit(jax.grad(functools.partial(loss, dpa), argnums=(0, 1, 2, 3)))(q, k, v, b)
  want = jax.jit(jax.grad(functools.partial(loss, jax.nn.dot_product_attention),
                          argnums=(0, 1, 2, 3)))(q, k, v, b)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


def test_promise_drop_in_jax_nn_attention_unbatched_and_mqa():
  """[T, N, H] inputs and MQA (K = 1), as jax.nn's docstring allows."""
  q3, k3, v3 = q[0], k[0, :, :1], v[0, :, :1]
  # jitted: one program each instead of op-by-op dispatch
  out, res = jax.jit(functools.partial(dpa, return_residual=True, is_causal=True))(q3, k3, v3)
  ref, ref_res = jax.jit(functools.partial(
      jax.nn.dot_product_attention, return_residual=True, is_causal=True))(q3, k3, v3)
  assert out.shape == ref.shape == (T, N, H) and res.shape == ref_res.shape == (T, N)
  chex.assert_trees_all_close((out, res), (ref, ref_res), atol=1e-5, rtol=1e-5)


def test_promise_drop_in_jax_nn_attention_signature():
  """Every parameter of jax.nn's, with the same name, position and default."""
  ours = inspect.signature(dpa).parameters
  for name, p in inspect.signature(jax.nn.dot_product_attention).parameters.items():
    assert name in ours, name
    assert ours[name].kind == p.kind, name
    if p.default is not inspect.Parameter.empty and p.default is not Ellipsis:
      assert ours[name].default == p.default, name
  assert list(ours)[:5] == ["query", "key", "value", "bias", "mask"]


def test_promise_drop_in_rows_without_a_visible_key_are_zero():
  """The documented difference: zeros and a -inf residual, where jax.nn averages the values."""
  m = mask.at[:, :, 2, :].set(False)
  out, res = dpa(q, k, v, mask=m, return_residual=True)
  np.testing.assert_array_equal(np.asarray(out[:, 2]), 0.0)
  np.testing.assert_array_equal(np.asarray(res[:, 2]), -np.inf)
  ref = jax.nn.dot_product_attention(q, k, v, mask=m)
  assert not np.allclose(np.asarray(ref[:, 2]), 0.0)


def test_promise_drop_in_cudnn_is_jax_nn_cudnn_or_not_implemented():
  """implementation="cudnn": jax.nn's cuDNN attention on a CUDA GPU, NotImplementedError
  naming it elsewhere or for what it does not compute."""
  if jax.default_backend() == "gpu":  # pragma: no cover (CPU CI)
    qb, kb, vb = (a.astype(jnp.bfloat16) for a in (q, k, v))  # cuDNN takes half precision
    chex.assert_trees_all_close(
        dpa(qb, kb, vb, implementation="cudnn").astype(jnp.float32),
        jax.nn.dot_product_attention(qb, kb, vb, implementation="cudnn").astype(jnp.float32),
        atol=1e-2)
    with pytest.raises(NotImplementedError, match="cudnn"):
      dpa(qb, kb, vb, implementation="cudnn", normalizer="sparsemax")
    return
  with pytest.raises(NotImplementedError, match="cudnn"):
    dpa(q, k, v, implementation="cudnn")
  # in a sequence it falls through to the next implementation
  chex.assert_trees_all_close(dpa(q, k, v, implementation=("cudnn", "xla")),
                              jax.nn.dot_product_attention(q, k, v), atol=1e-5)


# -------------------------------------------------------------- the residual of each class

RESIDUAL_CASES = {
    "softmax": {}, "softmax_sink": {"sink_logit": 0.7}, "softmax_1": {}, "ssmax": {"s": 0.8},
    "stablemax": {}, "lssar": {}, "sigmoid": {}, "sparsemax": {}, "entmax15": {},
    "top_k_softmax": {"k": 3},
}


def _reference_statistic(name, params, logits, visible):
  """The documented row statistic from the dense logits, in NumPy (float64)."""
  x = np.asarray(logits, np.float64)
  vis = np.asarray(visible)
  n = vis.sum(-1)
  xm = np.where(vis, x, -np.inf)
  if name == "softmax":
    return np.log(np.exp(xm).sum(-1))
  if name == "softmax_sink":
    return np.log(np.exp(params["sink_logit"]) + np.exp(xm).sum(-1))
  if name == "softmax_1":
    return np.log(1.0 + np.exp(xm).sum(-1))
  if name == "ssmax":
    z = np.where(vis, params["s"] * np.log(np.maximum(n, 1))[..., None] * x, -np.inf)
    return np.log(np.exp(z).sum(-1))
  if name == "sigmoid":
    return np.zeros(x.shape[:-1])
  if name == "top_k_softmax":
    kth = -np.sort(-xm, axis=-1)[..., params["k"] - 1]
    return np.where(n >= params["k"], kth, np.nan)  # fewer than k: any tau below them
  return None


@pytest.mark.parametrize("name", sampled(list(RESIDUAL_CASES),
                                         ("softmax_sink", "ssmax", "sigmoid", "sparsemax")))
def test_promise_drop_in_residual_per_class(name):
  """return_residual is the class's row statistic, the same in xla and xla_chunked."""
  params = RESIDUAL_CASES[name]
  kw = dict(mask=mask, is_causal=True, normalizer=name, normalizer_params=params,
            return_residual=True)
  out, res = dpa(q, k, v, implementation="xla", **kw)
  out_c, res_c = dpa(q, k, v, implementation="xla_chunked", **kw)
  chex.assert_trees_all_close(out_c, out, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(out, dpa(q, k, v, implementation="xla", **{
      **kw, "return_residual": False}))
  logits = js.attention.dense_logits(q, k, scale=1 / np.sqrt(H))
  visible = np.asarray(jnp.broadcast_to(mask, logits.shape)) & np.tril(np.ones((T, S), bool))
  want = _reference_statistic(name, params, logits, visible)
  defined = np.ones(res.shape, bool)
  if want is not None:
    want = np.transpose(want, (0, 2, 1))
    defined = ~np.isnan(want)
    for r in (res, res_c):
      np.testing.assert_allclose(np.asarray(r)[defined], want[defined], atol=1e-4, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(res_c)[defined], np.asarray(res)[defined], atol=1e-4,
                             rtol=1e-4)
  lowest = np.transpose(np.min(np.where(visible, np.asarray(logits), np.inf), -1), (0, 2, 1))
  for r in (res, res_c):  # top-k, fewer than k visible keys: at most the lowest
    assert np.all(np.asarray(r)[~defined] <= lowest[~defined] + 1e-6)
  if name == "sparsemax":  # tau: sum_j [l_j - tau]_+ = 1 over the visible keys
    tau = np.transpose(np.asarray(res, np.float64), (0, 2, 1))[..., None]
    mass = np.where(visible, np.maximum(np.asarray(logits, np.float64) - tau, 0.0), 0.0)
    np.testing.assert_allclose(mass.sum(-1), 1.0, atol=1e-5)
  grads = jax.jit(jax.grad(lambda a: jnp.sum(dpa(a, k, v, implementation="xla_chunked",
                                                 **kw)[1])))(q)
  np.testing.assert_array_equal(np.asarray(grads), 0.0)  # no gradient, as jax.nn


@pytest.mark.parametrize("name", ["epsilon_softmax", "gumbel_softmax"])
def test_promise_drop_in_residual_undefined_is_not_implemented(name):
  params = {"key": jax.random.PRNGKey(0)} if name == "gumbel_softmax" else {}
  with pytest.raises(NotImplementedError, match="return_residual|residual"):
    dpa(q, k, v, normalizer=name, normalizer_params=params, return_residual=True)


def test_row_statistic_rejects_plain_callables():
  with pytest.raises(NotImplementedError, match="callable"):
    _dense.row_statistic(jax.nn.softmax, {}, jnp.zeros((1, 1, 2, 3)), jnp.ones((1, 1, 2, 3), bool))
