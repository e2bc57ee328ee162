"""A11 reuse of top-k selections (jaxsoft/attention/_topk_reuse.py).

Oracles: a numpy float64 decode loop written from the Selection Cache rule (cosine test,
soft-vote or per-head top-k, exact softmax over the kept keys); brute force over every
anchor set for the DP; the kept-mass matrix from its definition.
"""

import functools
import itertools
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import (
    anchor_layer_scores,
    init_selection_cache,
    select_anchor_layers,
    selection_cache_step,
)
from jaxsoft.attention._topk import topk_attention
from tests.helpers import check_raises

ROOT = pathlib.Path(__file__).resolve().parents[2]
B, N, K, H, S, TOPK, STEPS = 2, 4, 2, 8, 16, 4, 6


# ------------------------------------------------------------------ Selection Cache


def _np_decode(qs, k, v, lengths, threshold, selection, scale):
  """float64 decode loop: qs [STEPS, B, N, H]; returns outputs, reselect flags, indices."""
  qs, k, v = (np.asarray(a, np.float64) for a in (qs, k, v))
  G = N // K
  kr, vr = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)  # [B, S, N, H]
  outs, flags, idxs = [], [], []
  cq = [None] * B
  ci = [None] * B
  for t in range(qs.shape[0]):
    o_t, f_t, i_t = np.zeros((B, N, v.shape[-1])), [], np.zeros((B, N, TOPK), int)
    for b in range(B):
      q = qs[t, b]
      vis = np.arange(S) < lengths[t, b]
      re = cq[b] is None
      if not re:
        cos = q.ravel() @ cq[b].ravel() / (np.linalg.norm(q) * np.linalg.norm(cq[b]))
        re = cos < threshold
      logits = scale * np.einsum("nh,snh->ns", q, kr[b])
      if re:
        z = np.where(vis, logits, -np.inf)
        if selection == "soft_vote":
          p = np.exp(z - z.max(-1, keepdims=True))
          vote = (p / p.sum(-1, keepdims=True)).sum(0)
          idx = np.tile(np.argsort(-vote)[:TOPK], (N, 1))
        else:
          idx = np.argsort(-z, axis=-1)[:, :TOPK]
        cq[b], ci[b] = q, idx
      idx = ci[b]
      sel = np.take_along_axis(logits, idx, axis=-1)
      w = np.exp(sel - sel.max(-1, keepdims=True))
      w /= w.sum(-1, keepdims=True)
      o_t[b] = np.einsum("nr,nrh->nh", w, vr[b][idx, np.arange(N)[:, None]])
      f_t.append(re)
      i_t[b] = idx
    outs.append(o_t)
    flags.append(f_t)
    idxs.append(i_t)
  return np.stack(outs), np.array(flags), np.stack(idxs)


def _decode_inputs():
  rng = np.random.default_rng(0)
  k = rng.normal(size=(B, S, K, H)).astype(np.float32)
  v = rng.normal(size=(B, S, K, H)).astype(np.float32)
  # batch 0: one query with a little noise (cos ~ 0.999 with the cached one), another from
  # step 3; batch 1: switching between two random queries (|cos| ~ 0.2) every 2 steps
  base = rng.normal(size=(3, N, H))
  pattern = [(0, 0), (0, 0), (0, 2), (1, 2), (1, 0), (1, 0)]
  qs = np.stack([base[list(p)] + 0.03 * rng.normal(size=(B, N, H)) for p in pattern])
  qs = qs.astype(np.float32)
  lengths = np.stack([np.array([S - STEPS + t, S - 2 * STEPS + 2 * t + 1]) for t in
                      range(STEPS)]).astype(np.int32)
  return qs, k, v, lengths


@functools.partial(jax.jit, static_argnums=4)
def _decode(qs, k, v, lengths, selection):
  def step(cache, x):
    q, ln = x
    out, cache, re = selection_cache_step(
        q[:, None], k, v, cache, top_k=TOPK, threshold=0.9, key_value_seq_lengths=ln,
        selection=selection)
    return cache, (out[:, 0], re, cache.indices)
  return jax.lax.scan(step, init_selection_cache(B, N, H, TOPK), (qs, lengths))[1]


@pytest.mark.parametrize("selection", ["soft_vote", pytest.param("per_head", marks=pytest.mark.slow)])
def test_selection_cache_decode_matches_float64_loop(selection):
  qs, k, v, lengths = _decode_inputs()
  out, re, idx = _decode(qs, k, v, lengths, selection)
  want, want_re, want_idx = _np_decode(qs, k, v, lengths, 0.9, selection, H ** -0.5)
  np.testing.assert_array_equal(np.asarray(re), want_re)
  np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(want_idx, -1))
  # float32 softmax over 4 logits of size ~3 and one-term sums: ~1e-6 relative; 1e-5
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
  # the scenario exercises both branches in both batch elements
  re = np.asarray(re)
  assert re[:, 0].tolist() == [True, False, False, True, False, False]
  assert re[:, 1].tolist() == [True, False, True, False, True, False]


@pytest.mark.slow
def test_threshold_above_one_reselects_every_step_and_all_keys_is_dense():
  qs, k, v, lengths = _decode_inputs()

  @functools.partial(jax.jit, static_argnums=0)
  def run(top_k):
    def step(cache, x):
      q, ln = x
      out, cache, re = selection_cache_step(q[:, None], k, v, cache, top_k=top_k,
                                            threshold=1.5, key_value_seq_lengths=ln)
      fresh = topk_attention(q[:, None], k, v, top_k=top_k, key_value_seq_lengths=ln,
                             selection="soft_vote")
      dense = jax.nn.dot_product_attention(q[:, None], k, v, key_value_seq_lengths=ln)
      return cache, (out, re, fresh, dense)
    return jax.lax.scan(step, init_selection_cache(B, N, H, top_k), (qs, lengths))[1]

  out, re, fresh, _ = run(TOPK)
  assert bool(re.all())
  np.testing.assert_allclose(out, fresh, rtol=1e-6, atol=1e-6)  # the same program path
  out, _, _, dense = run(S)
  np.testing.assert_allclose(out, dense, rtol=1e-5, atol=1e-5)  # float32 sums of 16 terms


def test_selection_cache_errors():
  q, k = jnp.zeros((1, 1, 2, 4)), jnp.zeros((1, 8, 1, 4))
  c = init_selection_cache(1, 2, 4, 3)
  step = selection_cache_step
  check_raises(
      ("selection_cache_step: `query`", lambda: step(q[:, 0], k, k, c, top_k=3, threshold=.9)),
      ("one decode token", lambda: step(jnp.zeros((1, 2, 2, 4)), k, k, c, top_k=3,
                                        threshold=.9)),
      ("`top_k`", lambda: step(q, k, k, c, top_k=9, threshold=.9)),
      ("`threshold`", lambda: step(q, k, k, c, top_k=3, threshold=None)),
      ("`cache.indices`", lambda: step(q, k, k, c, top_k=2, threshold=.9)),
      ("`cache` must be", lambda: step(q, k, k, (1, 2, 3), top_k=3, threshold=.9)),
      ("`selection`", lambda: step(q, k, k, c, top_k=3, threshold=.9, selection="x")),
      ("init_selection_cache: `top_k`", lambda: init_selection_cache(1, 2, 4, 0)),
      ("select_anchor_layers: `scores`", lambda: select_anchor_layers(jnp.zeros((2, 3)), 1)),
      ("`num_anchors`", lambda: select_anchor_layers(jnp.zeros((3, 3)), 4)),
      ("anchor_layer_scores: `top_k`", lambda: anchor_layer_scores(jnp.zeros((2, 5)), 6)),
      ("anchor_layer_scores: `weights`", lambda: anchor_layer_scores(jnp.zeros(5), 1)),
  )


# ------------------------------------------------------------------ anchor layers


def _brute_force(m, budget):
  """Best total over every anchor set containing layer 0 with at most ``budget`` anchors."""
  L = m.shape[0]
  best = -np.inf
  for r in range(budget):
    for rest in itertools.combinations(range(1, L), r):
      anchors = (0,) + rest
      a = np.maximum.accumulate(np.where(np.isin(np.arange(L), anchors), np.arange(L), 0))
      best = max(best, m[a, np.arange(L)].sum())
  return best


L_DP, BUDGETS = 6, (3,)  # the sweep over every budget is the slow test below


@jax.jit
def _anchor_program(ms, w):
  dp = [jax.lax.map(lambda m, b=b: select_anchor_layers(m, b), ms) for b in BUDGETS]
  return dp, anchor_layer_scores(w, 3)


def test_anchor_dp_equals_brute_force_and_scores_match_definition():
  rng = np.random.default_rng(1)
  ms = rng.uniform(size=(8, L_DP, L_DP))  # any matrix: reuse may even beat the own set
  w = rng.dirichlet(np.ones(7), size=(3, 2, 5))  # [L=3, 2 heads, 5 rows, S=7]
  dp, got = _anchor_program(ms.astype(np.float32), w.astype(np.float32))
  for b, (assign, total) in zip(BUDGETS, dp, strict=True):
    assign, total = np.asarray(assign), np.asarray(total)
    for i, m in enumerate(ms):
      best = _brute_force(m, b)
      a = assign[i]
      # a valid assignment: layer 0 an anchor, each layer its nearest anchor at or before it,
      # at most b anchors
      anchors = a == np.arange(L_DP)
      assert anchors[0] and anchors.sum() <= b
      np.testing.assert_array_equal(
          a, np.maximum.accumulate(np.where(anchors, np.arange(L_DP), 0)))
      # float32 sums of 6 terms in [0, 1]: ~1e-6; 1e-5
      np.testing.assert_allclose(m[a, np.arange(L_DP)].sum(), best, rtol=1e-5)
      np.testing.assert_allclose(total[i], best, rtol=1e-5)
  want = np.zeros((3, 3))
  for a_, l_ in itertools.product(range(3), range(3)):
    top = np.argsort(-w[a_], axis=-1)[..., :3]
    want[a_, l_] = np.take_along_axis(w[l_], top, axis=-1).sum(-1).mean()
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # float32 sums of 3 terms < 1


@pytest.mark.slow
@pytest.mark.parametrize("L", [1, 2, 7])
def test_anchor_dp_equals_brute_force_sweep(L):
  rng = np.random.default_rng(L)
  for b in range(1, L + 1):
    for _ in range(3):
      m = rng.normal(size=(L, L))
      _, total = select_anchor_layers(m.astype(np.float32), b)
      np.testing.assert_allclose(total, _brute_force(m, b), rtol=1e-5, atol=1e-5)
  # budget L with M[l, l] the largest entry of each column: every layer selects
  full = select_anchor_layers(jnp.eye(L) + 0.5, L)[0]
  np.testing.assert_array_equal(full, np.arange(L))


# ------------------------------------------------------------------ benchmark


@pytest.mark.slow
def test_benchmark_runs_at_a_tiny_size():
  out = subprocess.run([sys.executable, str(ROOT / "bench" / "token_select_cpu.py"), "--quick"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert out.returncode == 0, out.stderr
  assert "check passed" in out.stdout and "full / cached" in out.stdout, out.stdout


@pytest.mark.slow
def test_slow_drift_reselects_against_the_cached_query():
  # q_t rotates by 10 degrees a step; theta = cos 25 degrees: every consecutive pair is similar
  # (cos 10 degrees), but the query is 30 degrees from the cached one at steps 3, 6, 9
  ang = np.deg2rad(10.0 * np.arange(10))
  qs = np.stack([np.cos(ang), np.sin(ang)], -1).astype(np.float32)[:, None, None, None, :]
  k = np.random.default_rng(0).normal(size=(1, 8, 1, 2)).astype(np.float32)
  c = init_selection_cache(1, 1, 2, 3)
  flags = []
  for q in qs:
    _, c, re = selection_cache_step(q, k, k, c, top_k=3, threshold=float(np.cos(np.deg2rad(25))))
    flags.append(bool(re[0]))
  assert flags == [t % 3 == 0 for t in range(10)]
