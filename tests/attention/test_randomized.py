"""Randomized attention against an independent float64 reference, forward and gradients.

Each case draws shapes (T != S, GQA, Hv != H), a mask (causal, windows, sequence lengths
including 0, segment ids, a dense mask with a fully masked row, a bias with -inf entries), a
dtype (float32, bfloat16, float64), extreme logits (scores in the hundreds, rows whose every
logit is below -88, sink logits far above the scores) and a normalizer with a learned
hyperparameter, and compares "xla" and "xla_chunked" (small blocks, so several of them) with
the formulas written out in plain jnp and evaluated in float64: the output and the gradients
of q, k, v, the bias and the hyperparameter. A few Pallas cases run in interpret mode. A
sample runs by default (seeded); the full sweep is ``-m slow``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import _chunked
from jaxsoft.attention import dot_product_attention as dpa
from kernels_pallas import _api as kernels_api

NAMES = ("softmax", "softmax_sink", "ssmax", "sigmoid", "sparsemax")
LEARNED = {"softmax": "temperature", "softmax_sink": "sink_logit", "ssmax": "s",
           "sigmoid": "bias"}
TOL = {"float32": 2e-4, "bfloat16": 4e-2, "float64": 1e-9}
# The default sample: float32 with a sink logit 300 above the scores, a mask, causal and
# query lengths; float64 with extreme scores, a window and a mask (bfloat16: e.g. seed 37).
DEFAULT_SEEDS = (59, 43)
SLOW_SEEDS = tuple(s for s in range(60) if s not in DEFAULT_SEEDS)


@dataclasses.dataclass
class Case:
  """One drawn call: arrays in NumPy float64 (rounded to ``dtype``), the call's keywords."""

  dtype: str
  name: str
  q: np.ndarray
  k: np.ndarray
  v: np.ndarray
  bias: np.ndarray | None
  hp: np.ndarray | None  # the learned hyperparameter [N, 1, 1], or None
  kwargs: dict  # structure keywords (is_causal, window, lengths, segment ids, mask, cap)
  visible: np.ndarray  # [B, N, T, S] from the structure and the mask (not the bias)
  ct: np.ndarray  # output cotangent

  @property
  def params_name(self):
    return LEARNED.get(self.name)


def _round(x, dtype):
  return np.asarray(jnp.asarray(x, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)


def draw(seed: int, pallas: bool = False) -> Case:
  """A random case; ``pallas``: float32 and a class E/S/P normalizer (the Pallas engine takes
  every structure, a dense bias or mask and Hv != H as xla_chunked does)."""
  r = np.random.default_rng(seed)
  K, G = int(r.choice([1, 2])), int(r.choice([1, 2, 3]))
  N = K * G
  B, T, S = int(r.integers(1, 3)), int(r.integers(1, 33)), int(r.integers(1, 33))
  H = int(r.choice([4, 8]))
  Hv = int(r.choice([H, H + 3]))
  dtype = "float32" if pallas else str(r.choice(["float32", "float32", "bfloat16", "float64"]))
  name = str(r.choice(NAMES))
  extreme = dtype != "bfloat16" and r.random() < 0.35
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  vis = np.ones((B, 1, T, S), bool)
  kwargs: dict = {}
  if r.random() < 0.4:
    kwargs["is_causal"] = True
    vis &= j <= i
  if r.random() < 0.3:
    left = int(r.integers(-2, 6))
    right = int(r.integers(-left, 6))  # left + right >= 0: a non-empty window
    kwargs["local_window_size"] = (left, right)
    vis &= (j >= i - left) & (j <= i + right)
  for key, L, axis in (("query_seq_lengths", T, i), ("key_value_seq_lengths", S, j)):
    if r.random() < 0.3:
      lengths = r.integers(0, L + 1, B)
      kwargs[key] = jnp.asarray(lengths, jnp.int32)
      vis &= axis[None, None] < lengths[:, None, None, None]
  if r.random() < 0.25:
    q_seg = np.sort(r.integers(0, 3, (B, T)), axis=-1)
    kv_seg = np.sort(r.integers(0, 3, (B, S)), axis=-1)
    kwargs["segment_ids"] = (jnp.asarray(q_seg, jnp.int32), jnp.asarray(kv_seg, jnp.int32))
    vis &= (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]
  if r.random() < 0.3:
    mask = r.random((B, 1, T, S)) < 0.7
    mask[:, :, r.integers(0, T)] = False  # a fully masked row
    kwargs["mask"] = jnp.asarray(mask)
    vis = vis & mask
  if r.random() < 0.2:
    kwargs["logits_soft_cap"] = 20.0
  bias = None
  if r.random() < 0.4:
    bias = r.standard_normal((B, N, T, S))
    if r.random() < 0.3:
      bias[r.random(bias.shape) < 0.1] = -np.inf
    if extreme:  # one row whose every logit is far below -88
      bias[:, :, r.integers(0, T)] -= 300.0
    bias = _round(bias, dtype) if dtype != "float64" else bias
  q_scale = 12.0 if extreme else 1.0
  q = r.standard_normal((B, T, N, H)) * q_scale
  k, v = r.standard_normal((B, S, K, H)), r.standard_normal((B, S, K, Hv))
  if dtype != "float64":
    q, k, v = (_round(x, dtype) for x in (q, k, v))
  hp = None
  if name in LEARNED and r.random() < 0.7:
    if name == "softmax":
      hp = r.uniform(0.5, 2.0, (N, 1, 1))
    elif name == "ssmax":
      hp = r.uniform(0.3, 1.5, (N, 1, 1))
    else:
      hp = r.standard_normal((N, 1, 1))
      if extreme and name == "softmax_sink":
        hp[0] = 300.0  # far above the scores: the offset overflows float32
  return Case(dtype=dtype, name=name, q=q, k=k, v=v, bias=bias, hp=hp, kwargs=kwargs,
              visible=np.broadcast_to(vis, (B, N, T, S)), ct=r.standard_normal((B, T, N, Hv)))


# ------------------------------------------------------------------ the float64 reference


def _softmax(z, vis, sink=None):
  m = jnp.max(jnp.where(vis, z, -jnp.inf), axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  if sink is not None:
    m = jnp.maximum(m, sink)
  m = jax.lax.stop_gradient(m)
  e = jnp.where(vis, jnp.exp(jnp.where(vis, z - m, 0.0)), 0.0)
  d = jnp.sum(e, axis=-1, keepdims=True)
  if sink is not None:
    d = d + jnp.exp(sink - m)
  return e / jnp.where(d > 0, d, 1.0)


def _sparsemax(x, vis):
  srt = -jnp.sort(-jnp.where(vis, x, -jnp.inf), axis=-1)
  fin = jnp.isfinite(srt)
  srt = jnp.where(fin, srt, 0.0)
  cs = jnp.cumsum(srt, axis=-1)
  kk = jnp.arange(1, x.shape[-1] + 1, dtype=x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))
  size = jnp.sum(fin & (1.0 + kk * srt > cs), axis=-1, keepdims=True)
  tau = (jnp.take_along_axis(cs, jnp.maximum(size - 1, 0), axis=-1) - 1.0) / jnp.maximum(size, 1)
  return jnp.where(vis, jnp.maximum(x - tau, 0.0), 0.0)


def _weights(name, x, vis, hp):
  n = jnp.sum(vis, axis=-1, keepdims=True).astype(x.dtype)
  xs = jnp.where(vis, x, 0.0)
  hp = None if hp is None else hp[None]  # [1, N, 1, 1]: the rank of x
  if name == "softmax":
    return _softmax(xs / (1.0 if hp is None else hp), vis)
  if name == "ssmax":
    return _softmax((0.43 if hp is None else hp) * jnp.log(jnp.maximum(n, 1.0)) * xs, vis)
  if name == "softmax_sink":
    return _softmax(xs, vis, sink=jnp.zeros(()) if hp is None else hp)
  if name == "sigmoid":
    b = -jnp.log(jnp.maximum(n, 1.0)) if hp is None else hp
    return jnp.where(vis, jax.nn.sigmoid(xs + b), 0.0)
  return _sparsemax(xs, vis)


def reference(case: Case, q, k, v, bias, hp):
  """Attention written out from its definition (jnp, float64 under x64)."""
  G = q.shape[2] // k.shape[2]
  kk, vv = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
  x = jnp.einsum("btnh,bsnh->bnts", q, kk) / np.sqrt(q.shape[-1])
  cap = case.kwargs.get("logits_soft_cap")
  if cap is not None:
    x = cap * jnp.tanh(x / cap)
  vis = jnp.asarray(case.visible)
  if bias is not None:
    vis = vis & jnp.isfinite(bias)
    x = x + jnp.where(vis, bias, 0.0)
  w = _weights(case.name, x, vis, hp)
  return jnp.einsum("bnts,bsnh->btnh", w, vv)


def _value_and_grads(fn, case: Case, dtype):
  args = [jnp.asarray(a, dtype) for a in (case.q, case.k, case.v)]
  args.append(None if case.bias is None else jnp.asarray(case.bias, dtype))
  args.append(None if case.hp is None else jnp.asarray(case.hp, jnp.promote_types(dtype,
                                                                                   jnp.float32)))
  ct = jnp.asarray(case.ct, jnp.promote_types(dtype, jnp.float32))

  @jax.jit  # one program for the output and its VJP (op-by-op eager compiles each op)
  def out_and_grads(args, ct):
    out, vjp = jax.vjp(lambda *a: fn(*a).astype(ct.dtype), *args)
    return out, vjp(ct)

  out, grads = out_and_grads(args, ct)
  return [np.asarray(out, np.float64)] + [
      None if g is None else np.asarray(g, np.float64) for g in grads]


_REFERENCES: dict = {}


def _reference_value_and_grads(seed: int, case: Case):
  """The float64 reference of a drawn case, computed once per seed."""
  if seed not in _REFERENCES:
    with jax.enable_x64(True):
      _REFERENCES[seed] = _value_and_grads(lambda *a: reference(case, *a), case, jnp.float64)
  return _REFERENCES[seed]


def _run(seed: int, case: Case, implementation: str):
  def fn(q, k, v, bias, hp):
    params = {} if hp is None else {case.params_name: hp}
    return dpa(q, k, v, bias, normalizer=case.name, normalizer_params=params,
               implementation=implementation, **case.kwargs)

  with jax.enable_x64(case.dtype == "float64"):
    got = _value_and_grads(fn, case, jnp.dtype(case.dtype))
  want = _reference_value_and_grads(seed, case)
  tol = TOL[case.dtype]
  for label, g, w in zip(("out", "dq", "dk", "dv", "dbias", "dhp"), got, want, strict=True):
    if w is None:
      continue
    assert np.all(np.isfinite(g)), f"{implementation} {label}: not finite\n{case}"
    scale = max(1.0, float(np.max(np.abs(w), initial=0.0)))
    np.testing.assert_allclose(g, w, atol=tol * scale, rtol=tol,
                               err_msg=f"{implementation} {label} {case.name} {case.dtype}")


@pytest.fixture
def small_blocks(monkeypatch):
  """Several query and key blocks in the chunked path."""
  monkeypatch.setattr(_chunked, "BLOCK_Q", 8)
  monkeypatch.setattr(_chunked, "BLOCK_K", 16)


def _seed_params(default, slow):
  return [pytest.param(s, id=f"seed{s}") for s in default] + [
      pytest.param(s, id=f"seed{s}", marks=pytest.mark.slow) for s in slow]


@pytest.mark.parametrize("implementation", ["xla", "xla_chunked"])
@pytest.mark.parametrize("seed", _seed_params(DEFAULT_SEEDS, SLOW_SEEDS))
def test_promise_numerics_randomized_against_float64(seed, implementation, small_blocks):
  _run(seed, draw(seed), implementation)


@pytest.mark.parametrize("seed", _seed_params((0,), tuple(range(1, 12))))
def test_promise_numerics_randomized_pallas_interpret(seed, monkeypatch):
  monkeypatch.setenv(kernels_api.INTERPRET_ENV, "1")
  _run(1000 + seed, draw(1000 + seed, pallas=True), "pallas_triton")
