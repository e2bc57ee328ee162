"""Sparse State Expansion (SSE, the linear half of DSSA): sse_gates and sparse_state_expansion.

Oracle: a numpy float64 recurrence written from the definition, with explicit partition
states (a token writes g_{t,p} k_t v_t^T into its top-k partitions only and reads
sum_p g_{t,p} q_t^T S_p from them), independent of the chunked pairwise form; gradients by
jax.test_util.check_grads in float64; padding against the unpadded sequence; bfloat16
against the float32 result within bfloat16's rounding; chunk-size invariance.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests.helpers import sampled

B, T, N, H, Hv, P = 2, 11, 2, 4, 3, 5


def _inputs(seed=0, dtype=np.float32):
  rng = np.random.default_rng(seed)
  q, k = (rng.standard_normal((B, T, N, H)) for _ in range(2))
  v = rng.standard_normal((B, T, N, Hv))
  r = rng.standard_normal((B, T, N, P)) * 2
  return [a.astype(dtype) for a in (q, k, v, r)]


def _reference(q, k, v, r, top_k, scale=1.0, lens=None):
  q, k, v, r = (np.asarray(a, np.float64) for a in (q, k, v, r))
  out = np.zeros(v.shape)
  for b in range(q.shape[0]):
    for n in range(q.shape[2]):
      S = np.zeros((r.shape[-1], q.shape[-1], v.shape[-1]))
      for t in range(q.shape[1]):
        if lens is not None and t >= lens[b]:
          continue
        sel = np.argsort(-r[b, t, n], kind="stable")[:top_k]
        e = np.exp(r[b, t, n, sel] - r[b, t, n, sel].max())
        g = e / e.sum()
        for p, gp in zip(sel, g, strict=True):
          S[p] += gp * np.outer(k[b, t, n], v[b, t, n])
        out[b, t, n] = scale * sum(gp * q[b, t, n] @ S[p] for p, gp in zip(sel, g, strict=True))
  return out


@pytest.mark.parametrize("case", sampled([(2, 4), (5, 64), (1, 3)], ("2-4",), ["2-4", "5-64", "1-3"]))
def test_matches_partition_recurrence(case):
  top_k, chunk = case
  q, k, v, r = _inputs()
  got = js.attention.sparse_state_expansion(q, k, v, r, top_k=top_k, scale=0.7, chunk_size=chunk)
  want = _reference(q, k, v, r, top_k, 0.7)
  # float32 sums of at most T * H products of unit-size terms
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_padding_gates_and_errors():
  q, k, v, r = _inputs(1)
  lens = np.array([7, 11])
  got = js.attention.sparse_state_expansion(q, k, v, r, top_k=2, key_value_seq_lengths=lens,
                                            chunk_size=4)
  np.testing.assert_allclose(np.asarray(got), _reference(q, k, v, r, 2, lens=lens),
                             rtol=1e-5, atol=1e-5)
  assert not np.any(np.asarray(got)[0, 7:])
  g = np.asarray(js.attention.sse_gates(r, 3))
  assert np.all((g > 0).sum(-1) == 3) and np.allclose(g.sum(-1), 1.0, atol=1e-6)
  for kw, name in ((dict(top_k=0), "top_k"), (dict(top_k=P + 1), "top_k"),
                   (dict(top_k=1, chunk_size=0), "chunk_size")):
    with pytest.raises(ValueError, match=name):
      js.attention.sparse_state_expansion(q, k, v, r, **kw)
  with pytest.raises(ValueError, match="router_logits"):
    js.attention.sparse_state_expansion(q, k, v, r[..., 0], top_k=1)
  with pytest.raises(ValueError, match="key"):
    js.attention.sparse_state_expansion(q, k[:, :3], v, r, top_k=1)


@pytest.mark.slow  # check_grads in float64 and a bfloat16 run (~6 s of CPU)
def test_gradients_float64_and_bfloat16():
  with jax.enable_x64(True):
    q, k, v, r = (jnp.asarray(a) for a in _inputs(2, np.float64))
    f = jax.jit(lambda *a: js.attention.sparse_state_expansion(*a, top_k=2, chunk_size=4))
    assert f(q, k, v, r).dtype == jnp.float64
    # the selection is piecewise constant: a finite step keeps it when the logits are
    # separated by much more than the step (random logits * 2, step 1e-6 scale)
    jax.test_util.check_grads(f, (q, k, v, r), order=1, modes=("rev",), eps=1e-6)
  q, k, v, r = _inputs(3)
  full = np.asarray(js.attention.sparse_state_expansion(q, k, v, r, top_k=2))
  low = js.attention.sparse_state_expansion(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v, r)),
                                            top_k=2)
  assert low.dtype == jnp.bfloat16
  # bfloat16 inputs (8 bits: relative 2^-8 each) through sums of ~T H terms of size ~1
  ref = _reference(*(np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) for a in (q, k, v, r)), 2)
  np.testing.assert_allclose(np.asarray(low, np.float32), ref, rtol=2e-2, atol=5e-2)
  assert np.max(np.abs(np.asarray(low, np.float32) - full)) < 0.5
