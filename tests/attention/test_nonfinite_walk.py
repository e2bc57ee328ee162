"""NaN and ``±inf`` walked over ``dot_product_attention``'s implementations (issue 37's guard
"NaN and inf propagate like optax": every attention path, the documented outcome).

For every implementation (``xla``; ``xla_chunked`` with 4 x 4 blocks, so that the keys
span a whole block, a partly visible one and padding; ``pallas`` in interpret mode) and one
normalizer of every kernel class (``CLASS_NORMALIZERS``, checked against the registry's
classes; class X has the dense path only), on a causal call with key padding
(``key_value_seq_lengths``) and a finite bias, each case changes one entry:

- ``nan_q``: a NaN in one query: that query's row is NaN (every value), the others are
  unchanged (jax.nn's rule, docs/numerics.md);
- ``nan_bias``: a NaN at a visible bias entry: that row is NaN in every head;
- ``nan_hidden_bias``: NaN at bias entries the causal mask and the padding hide: no
  change (a NaN at a masked entry is ignored, docs/numerics.md);
- ``nan_padded_value``, ``nan_padded_key``: NaN in the value or key of a padded key (past
  ``key_value_seq_lengths``): no change (the output sums over the visible keys only, the
  docstring's formula), and no NaN in any gradient (``test_hidden_nan_stays_out_of_the_
  gradients``);
- ``nan_value``: NaN in one component of a key's value: that component of every row that
  sees the key is NaN, the other components are unchanged (a row the causal structure
  hides the key from may get 0 · NaN there, documented as jax.nn's);
- ``neginf_bias``: a ``-inf`` bias entry masks its key: equal to the call with ``mask``
  False there;
- ``posinf_bias``: a ``+inf`` bias entry follows the normalizer's ``+inf`` rule
  (``jaxsoft.attention.posinf``, docs/numerics.md).

The reference is independent of the attention paths: the logits in numpy float64, the
registered normalizer's own function (whose NaN / ``±inf`` rules its own generated tests
check) on them with ``where`` = the visible set, and the weighted sum over the visible
keys, also in float64. Default: softmax on ``xla``; ``-m slow``: the whole matrix.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import normalizers as Nm
from jaxsoft.attention import _chunked
from jaxsoft.attention import dot_product_attention as dpa
from jaxsoft.normalizers import spec as _spec
from kernels_pallas.backends import INTERPRET_ENV

B, T, S, N, K, H = 1, 8, 8, 2, 1, 4
KV_LEN = 6  # keys 6, 7 are padding, in the second 4-key block with keys 4, 5
NAN, INF = np.nan, np.inf
CLASS_NORMALIZERS = {"E": "softmax", "S": "stablemax", "P": "sigmoid", "T": "sparsemax",
                     "R": "standardized_softmax", "X": "congestion_softmax"}
IMPLEMENTATIONS = ("xla", "xla_chunked", "pallas")


def _inputs():
  rng = np.random.default_rng(0)
  q = rng.normal(size=(B, T, N, H)).astype(np.float32)
  k = rng.normal(size=(B, S, K, H)).astype(np.float32)
  v = rng.normal(size=(B, S, K, H)).astype(np.float32)
  bias = rng.normal(size=(B, 1, T, S)).astype(np.float32)
  return q, k, v, bias


def _visible():
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  return (j <= i) & (j < KV_LEN)  # [T, S]


# name -> (q, k, v, bias, mask) changes of the clean inputs
def _cases():
  q, k, v, bias = _inputs()

  def at(a, index, value):
    a = a.copy()
    a[index] = value
    return a

  mask = np.ones((T, S), bool)
  mask[5, 2] = False
  return {
      "clean": (q, k, v, bias, None),
      "nan_q": (at(q, (0, 3, 0, 1), NAN), k, v, bias, None),
      "nan_bias": (q, k, v, at(bias, (0, 0, 5, 2), NAN), None),
      "nan_hidden_bias": (q, k, v, at(at(bias, (0, 0, 2, 5), NAN), (0, 0, 7, 7), NAN), None),
      "nan_padded_value": (q, k, at(v, (0, 7, 0, slice(None)), NAN), bias, None),
      "nan_padded_key": (q, at(k, (0, 6, 0, slice(None)), NAN), v, bias, None),
      "nan_value": (q, k, at(v, (0, 1, 0, 2), NAN), bias, None),
      "neginf_bias": (q, k, v, at(bias, (0, 0, 5, 2), -INF), None),
      "neginf_mask": (q, k, v, bias, mask),  # the reference of neginf_bias
      "posinf_bias": (q, k, v, at(bias, (0, 0, 5, 2), INF), None),
  }


CASES = _cases()
HIDDEN = ("nan_hidden_bias", "nan_padded_value", "nan_padded_key")


def _reference(name, q, k, v, bias, mask):
  """Float64: logits in numpy, the registered normalizer on them, the sum over visible keys."""
  logits = np.einsum("btnh,bsnh->bnts", q.astype(np.float64),
                     np.repeat(k, N // K, axis=2).astype(np.float64)) / np.sqrt(H)
  logits = logits + bias.astype(np.float64)
  visible = np.broadcast_to(_visible() if mask is None else _visible() & mask, logits.shape)
  with jax.enable_x64(True):
    w = np.asarray(Nm.get(name).fn(jnp.asarray(logits), -1, jnp.asarray(visible)))
  vv = np.repeat(v, N // K, axis=2).astype(np.float64)  # [B, S, N, H]
  terms = w[..., None] * np.transpose(vv, (0, 2, 1, 3))[:, :, None]  # [B, N, T, S, H]
  out = np.sum(np.where(visible[..., None], terms, 0.0), axis=3)
  return np.transpose(out, (0, 2, 1, 3))  # [B, T, N, H]


def _run_all(impl, name):
  """Every case's output from one jitted call of ``impl`` (one compilation)."""
  def one(q, k, v, bias, mask):
    return dpa(q, k, v, bias, mask, is_causal=True,
               key_value_seq_lengths=jnp.array([KV_LEN], jnp.int32),
               normalizer=name, implementation=impl)

  arrays = {c: tuple(None if a is None else jnp.asarray(a) for a in args)
            for c, args in CASES.items()}
  outs = jax.jit(lambda arrays: {c: one(*a) for c, a in arrays.items()})(arrays)
  return {c: np.asarray(o) for c, o in outs.items()}


@pytest.fixture
def small_blocks(monkeypatch):
  monkeypatch.setattr(_chunked, "BLOCK_Q", 4)
  monkeypatch.setattr(_chunked, "BLOCK_K", 4)
  monkeypatch.setenv(INTERPRET_ENV, "1")


def test_one_normalizer_of_every_kernel_class():
  assert set(CLASS_NORMALIZERS) == set(_spec.KERNEL_CLASSES)
  for cls, name in CLASS_NORMALIZERS.items():
    assert Nm.get(name).kernel_class == cls, (cls, name)


def _matrix():
  default = {("xla", "E")}
  return [pytest.param(impl, cls, id=f"{impl}-{CLASS_NORMALIZERS[cls]}",
                       marks=() if (impl, cls) in default else pytest.mark.slow)
          for impl in IMPLEMENTATIONS for cls in CLASS_NORMALIZERS
          if impl == "xla" or cls != "X"]


# float32 paths against a float64 reference on O(1) values summed over <= 8 keys: errors of
# a few 1e-7; 2e-5 is far below the O(0.1) change of a wrong rule (NaN fails outright).
TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl,cls", _matrix())
def test_nonfinite_inputs_follow_the_documented_rule(impl, cls, small_blocks):
  name = CLASS_NORMALIZERS[cls]
  got = _run_all(impl, name)
  want = {c: _reference(name, *args) for c, args in CASES.items()}
  clean = want["clean"]
  assert np.all(np.isfinite(clean))
  np.testing.assert_allclose(got["clean"], clean, **TOL)
  # a NaN query: its row is NaN, nothing else moves
  nan_row = np.zeros(clean.shape, bool)
  nan_row[0, 3, 0] = True
  _check_nan_pattern(got["nan_q"], want["nan_q"], nan_row, "nan_q")
  # a NaN visible bias entry: the row, every head
  nan_row = np.zeros(clean.shape, bool)
  nan_row[0, 5] = True
  _check_nan_pattern(got["nan_bias"], want["nan_bias"], nan_row, "nan_bias")
  # NaN where nothing sees it: no change
  for case in HIDDEN:
    assert np.all(np.isfinite(got[case])), case
    np.testing.assert_allclose(got[case], clean, **TOL, err_msg=case)
  # a NaN value component: that component of every row that sees key 1 (rows 1..7); row 0,
  # which the causal structure hides it from, may get 0 * NaN (documented, as jax.nn)
  nan_row = np.zeros(clean.shape, bool)
  nan_row[0, 1:, :, 2] = True
  free = np.zeros(clean.shape, bool)
  free[0, 0, :, 2] = True
  _check_nan_pattern(got["nan_value"], want["nan_value"], nan_row, "nan_value", free)
  # -inf bias = a masked key
  np.testing.assert_allclose(want["neginf_bias"], want["neginf_mask"], rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(got["neginf_bias"], want["neginf_mask"], **TOL)
  # +inf bias: the normalizer's +inf rule
  assert np.all(np.isfinite(got["posinf_bias"]))
  np.testing.assert_allclose(got["posinf_bias"], want["posinf_bias"], **TOL)


def _check_nan_pattern(got, want, expected, case, free=None):
  """NaN exactly at ``expected`` (``free``: entries the rule leaves open), else ``want``."""
  fixed = np.ones(expected.shape, bool) if free is None else ~free
  assert np.array_equal(np.isnan(want), expected), case  # the reference's rule
  np.testing.assert_array_equal(np.isnan(got)[fixed], expected[fixed], err_msg=case)
  finite = fixed & ~expected
  np.testing.assert_allclose(got[finite], want[finite], **TOL, err_msg=case)


def _grads(impl, name, args, ct):
  def loss(q, k, v, bias):
    out = dpa(q, k, v, bias, is_causal=True, key_value_seq_lengths=jnp.array([KV_LEN], jnp.int32),
              normalizer=name, implementation=impl)
    return jnp.sum(out * ct)
  return jax.grad(loss, argnums=(0, 1, 2, 3))(*(jnp.asarray(a) for a in args[:4]))


@pytest.mark.parametrize("impl,cls", [
    pytest.param(impl, cls, id=f"{impl}-{CLASS_NORMALIZERS[cls]}",
                 marks=pytest.mark.slow)
    for impl in IMPLEMENTATIONS for cls in ("E", "T") if impl != "pallas" or cls == "E"])
def test_hidden_nan_stays_out_of_the_gradients(impl, cls, small_blocks):
  """A NaN the mask hides (a hidden bias entry, a padded key or value) reaches no gradient:
  the gradients equal the clean call's (the hidden entries' own gradients are 0)."""
  name = CLASS_NORMALIZERS[cls]
  ct = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, N, H)), jnp.float32)
  f = jax.jit(lambda cases: {c: _grads(impl, name, CASES[c], ct) for c in cases},
              static_argnums=0)
  got = f(("clean",) + HIDDEN)
  for case in HIDDEN:
    for i, (g, r) in enumerate(zip(got[case], got["clean"], strict=True)):
      g, r = np.asarray(g), np.asarray(r)
      assert np.all(np.isfinite(g)), (case, i)
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=f"{case} {i}")
