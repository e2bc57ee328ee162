"""jaxsoft.attention.context_parallel_attention against the single-device dot_product_attention.

Each test starts one fresh Python on 8 fake CPU devices (a 2 x 4 mesh: a batch axis
"data" and the context axis "context", cp = 4) in float64, runs the context-parallel
call under ``jit`` for a matrix of normalizers (one per kernel class: softmax E,
stablemax S, sigmoid P, standardized_softmax R, sparsemax T), masks and strategies, and
compares the output and the gradients with respect to q, k and v (a VJP with the
cotangent cos(out)) with ``dot_product_attention`` on the unsharded arrays. The two
computations are the same float64 arithmetic up to the order of the reductions (the
context-parallel one sums over the same keys, gathered), so they agree to ~1e-15; the
tolerance 1e-10 leaves room for that and fails on any wrong visibility (an extra or
missing key changes O(1) weights).

The masked case crosses every shard boundary: T = 32 in 8 load-balanced chunks of 4, with
segments [0..5), [5..19), [19..32) in batch 0 and [0..20), [20..32) in batch 1, query
lengths 30 and 24 and key lengths 27 and 13 (so batch 1's query rows 20..23 see no key:
zeros, as on one device); the GQA layout has N = 4 query heads and K = 2
key heads (ulysses repeats the key heads to 4). The strategies: all_gather (every class),
ulysses (softmax and sparsemax by default), ring (``jaxsoft.attention._ring``: classes E,
S and P by default; it refuses R).
"""

import pytest

from tests.helpers import run_on_cpu_devices

_PRELUDE = r"""
import os
# the same answers, compiled with fewer XLA passes (compilation is most of this test's time)
os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_enable_x64", True)
from jaxsoft.attention import context_parallel_attention, dot_product_attention

mesh = jax.make_mesh((2, 4), ("data", "context"))
B, T, N, K, H = 2, 32, 4, 2, 8
rng = np.random.default_rng(0)  # numpy's generator: no XLA compile for the test data
q = jnp.asarray(rng.standard_normal((B, T, N, H)))
k = jnp.asarray(rng.standard_normal((B, T, K, H)))
v = jnp.asarray(rng.standard_normal((B, T, K, H)))
seg = jnp.asarray([[0] * 5 + [1] * 14 + [2] * 13, [0] * 20 + [3] * 12], jnp.int32)
# batch 1's queries 20..23 (segment 3, all of whose keys lie past length 13) see no key
MASKED = dict(is_causal=True, query_seq_lengths=jnp.array([30, 24]),
              key_value_seq_lengths=jnp.array([27, 13]), segment_ids=seg)
# name -> (dot_product_attention keywords, context-parallel-only keywords)
CASES = {
    "masked_causal_balanced": (MASKED, {}),
    "causal_window_unbalanced": (dict(is_causal=True, local_window_size=(5, 0)),
                                 dict(load_balance=False)),
    "plain": ({}, {}),
}

def with_grads(attend, normalizer, kwargs, impl):
  def f(q, k, v):
    return attend(q, k, v, normalizer=normalizer, implementation=impl, **kwargs)
  out, vjp = jax.vjp(f, q, k, v)
  return (out, *vjp(jnp.cos(out)))

def reference(keys):  # dot_product_attention ("xla", unsharded) for (normalizer, case) keys
  def ref_all(q, k, v):
    return {(n, c): with_grads(dot_product_attention, n, CASES[c][0], "xla") for n, c in keys}
  return jax.jit(ref_all)(q, k, v)

def compare(strategy, keys, want, impl=None, hlo=None):
  def cp_all(q, k, v):
    return {(n, c): with_grads(lambda *a, **kw: context_parallel_attention(
        *a, mesh=mesh, batch_axes="data", strategy=strategy, **kw, **CASES[c][1]),
        n, CASES[c][0], impl) for n, c in keys}
  compiled = jax.jit(cp_all).lower(q, k, v).compile()
  got = compiled(q, k, v)
  for key in keys:
    for name, a, b in zip(("out", "dq", "dk", "dv"), got[key], want[key], strict=True):
      assert a.dtype == jnp.float64 and not np.isnan(a).any(), (strategy, key, name)
      np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12,
                                 err_msg=f"{strategy} {impl} {key} {name}")
  if hlo is not None:
    assert hlo in compiled.as_text(), (strategy, hlo)
  print("ok", strategy, impl, flush=True)
"""

_CLASSES = ("softmax", "stablemax", "sigmoid", "standardized_softmax", "sparsemax")

_DEFAULT = _PRELUDE + f"""
MASKED_KEYS = [(n, "masked_causal_balanced") for n in {_CLASSES!r}]
OTHER_KEYS = [("softmax", "causal_window_unbalanced"), ("softmax", "plain")]
want = reference(MASKED_KEYS + OTHER_KEYS)
compare("all_gather", MASKED_KEYS + OTHER_KEYS, want, hlo="all-gather")
compare("ulysses", [MASKED_KEYS[0], MASKED_KEYS[-1]], want, hlo="all-to-all")
compare("ring", MASKED_KEYS[:3], want, hlo="collective-permute")

def refused(match, **kw):
  try:
    context_parallel_attention(q, k, v, mesh=mesh, **kw)
  except ValueError as e:
    assert all(m in str(e) for m in match), e
  else:
    raise AssertionError(f"no ValueError for {{kw}}")

refused(["strategy", "all_gather", "ring", "ulysses", "'nope'"], strategy="nope")
refused(["axis_name", "'seq'", "('data', 'context')"], axis_name="seq")
refused(["batch_axes", "'model'"], batch_axes="model")
k3 = jnp.ones((B, 20, 1, H))  # T = S = 20: divisible by cp = 4 but not by 2·cp = 8
try:
  context_parallel_attention(q[:, :20], k3, k3, mesh=mesh, is_causal=True)
except ValueError as e:
  assert "length 20 must be divisible by 8" in str(e), e
else:
  raise AssertionError("no ValueError for T = 20 with load_balance and cp = 4")
try:
  context_parallel_attention(q[:, :, :2], k[:, :, :1], v[:, :, :1], mesh=mesh,
                             strategy="ulysses")
except ValueError as e:
  assert "N = 2" in str(e) and "'context'" in str(e) and "4" in str(e), e
else:
  raise AssertionError("no ValueError for N = 2 heads over 4 devices")
print("ok errors")
"""


def test_context_parallel_equals_single_device():
  """Both strategies, one normalizer per kernel class, causal + load balance + lengths +
  segments + GQA (forward and gradients), the unbalanced causal window and plain cases,
  the collectives in the compiled HLO, and the refusals."""
  proc = run_on_cpu_devices(_DEFAULT, 8)
  assert proc.stdout.split("\n")[:-1] == [
      "ok all_gather None", "ok ulysses None", "ok ring None", "ok errors"], proc.stdout


_REGISTRY = ("softmax", "softmax_sink", "ssmax", "softpick", "sigmoid", "stablemax",
             "sparsemax", "entmax15", "top_k_softmax", "standardized_softmax")


# a per-head array hyperparameter (ssmax's s, [N, 1, 1]) enters shard_map replicated (ulysses
# slices it to each device's head group); its gradient is the sum over the devices'
_PER_HEAD = r"""
s_heads = jnp.asarray([0.3, 0.5, 0.7, 0.9], jnp.float64).reshape(N, 1, 1)
def per_head(attend, **kw):
  def f(q, s):
    return attend(q, k, v, normalizer="ssmax", normalizer_params={"s": s}, **MASKED, **kw)
  out, vjp = jax.vjp(f, q, s_heads)
  return (out, *vjp(jnp.cos(out)))
want_ph = jax.jit(lambda: per_head(dot_product_attention))()
for strategy in ("all_gather", "ulysses"):
  got_ph = jax.jit(lambda: per_head(context_parallel_attention, mesh=mesh, batch_axes="data",
                                    strategy=strategy))()
  for a, b in zip(got_ph, want_ph, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=strategy)
  print("ok per-head", strategy, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("implementation,strategy", [
    (impl, s) for impl in ("xla", "xla_chunked", "pallas") for s in ("all_gather", "ulysses")]
    + [("xla", "ring")])
def test_context_parallel_full_matrix(implementation, strategy):
  """Every default-registry normalizer (classes E, S, P, R, T, with the length-dependent
  ssmax) x the three mask cases, for one strategy on one implementation (pallas: the
  interpreter on CPU). The ring strategy ignores ``implementation`` (it runs with "xla"
  only), for classes E, S and P; with "xla", the per-head hyperparameter case too."""
  cases = ("masked_causal_balanced", "causal_window_unbalanced", "plain")
  # ring: classes E, S and P here (it refuses R; its class-T backward is tested in
  # tests/attention/test_ring.py on a 1-D mesh)
  names = [n for n in _REGISTRY if strategy != "ring" or n not in (
      "standardized_softmax", "sparsemax", "entmax15", "top_k_softmax")]
  script = _PRELUDE + f"keys = [(n, c) for n in {names!r} for c in {cases!r}]\n"
  script += f"compare({strategy!r}, keys, reference(keys), impl={implementation!r})\n"
  expected = [f"ok {strategy} {implementation}"]
  if implementation == "xla" and strategy == "all_gather":
    script += _PER_HEAD
    expected += ["ok per-head all_gather", "ok per-head ulysses"]
  # pallas on CPU: the interpreter, which JAXSOFT_PALLAS_INTERPRET asks for (without it the
  # call raises NotImplementedError: no Pallas backend on the CPU platform)
  env = {"JAXSOFT_PALLAS_INTERPRET": "1"} if implementation.startswith("pallas") else None
  proc = run_on_cpu_devices(script, 8, env=env, timeout=3000)
  assert proc.stdout.split("\n")[:-1] == expected, proc.stdout


@pytest.mark.parametrize("normalizer", [
    "entmax15",
    pytest.param("sparsemax", marks=pytest.mark.slow),
    pytest.param("top_k_softmax", marks=pytest.mark.slow),
    pytest.param("top_p_softmax", marks=pytest.mark.slow),
    pytest.param("softmax", marks=pytest.mark.slow)])
def test_pallas_runs_inside_shard_map_with_check_vma(monkeypatch, normalizer):
  """implementation="pallas" (the interpreter) inside context_parallel_attention's
  shard_map keeps shard_map's default varying-axes check (``check_vma``, which was turned off
  for Pallas, then for the interpreter with a kernel class T normalizer): the traced
  shard_map says so, and the interpreter's lowering of the forward and backward kernels
  (where an invariant constant meeting a varying block fails: entmax15's bracket
  ``max(length, 1)``, top-k's target ``min(k, length)``, top-p's ``min(p, 1) * row_sum``)
  passes, with the dense result, values and gradients. Class T by default (entmax15, whose
  bracket failed); sparsemax, top-k, top-p and softmax in the slow run. One device in this
  process (a 1 x 1 mesh: the varying-axes types are the same at any axis size; the 8-device
  runs are the slow matrix's pallas cases). Tolerance: float32 kernels against the float32
  dense path over 16 keys, errors ~1e-6; a wrong key would move the output by ~1e-1."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxsoft.attention import context_parallel_attention, dot_product_attention

  monkeypatch.setenv("JAXSOFT_PALLAS_INTERPRET", "1")
  mesh = jax.make_mesh((1, 1), ("data", "context"))
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((2, 16, 2, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((2, 16, 1, 8)), jnp.float32) for _ in range(2))
  masks = dict(is_causal=True, key_value_seq_lengths=jnp.array([16, 9]),
               normalizer=normalizer)

  def loss(attend):
    def f(q, k, v):
      out = attend(q, k, v, **masks)
      return jnp.sum(jnp.cos(out)), out
    return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)

  sharded = loss(lambda *a, **kw: context_parallel_attention(
      *a, mesh=mesh, batch_axes="data", implementation="pallas", **kw))
  traced = jax.jit(sharded).trace(q, k, v)
  flags = [e.params["check_vma"] for e in traced.jaxpr.eqns if e.primitive.name == "shard_map"]
  assert flags and all(flags), flags  # the forward's shard_map and its transpose
  (_, got), g_got = traced.lower().compile()(q, k, v)
  (_, want), g_want = jax.jit(loss(lambda *a, **kw: dot_product_attention(
      *a, implementation="xla", **kw)))(q, k, v)
  for a, b in zip((got, *g_got), (want, *g_want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
