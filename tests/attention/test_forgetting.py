"""A08 forget_gate_decay, forgetting_attention and acp_prune_threshold
(jaxsoft/attention/_forgetting.py).

Every check compares to causal softmax attention with the decay written as an explicit sum
over the forget gates, on the output and on every input cotangent (random cotangent), plus
float64 finite differences; ACP pruning against the same reference with the pruned key
blocks masked out, and the bound of every pruned weight.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxsoft.attention import acp_prune_threshold, forget_gate_decay, forgetting_attention
from tests.attention.reference import (
    IMPLS,
    apply_weights,
    assert_fn_close,
    causal_mask,
    fox_inputs,
    masked_softmax,
    scaled_logits,
)
from tests.helpers import FWD, normal


def _fox_reference(q, k, v, log_f, keep=None):
  """Causal softmax attention with D_ij = sum_{l=j+1}^{i} log f_l as an explicit sum."""
  t = q.shape[1]
  terms = np.zeros((t, t, t), np.float32)  # terms[i, j, l] = 1 iff j < l <= i
  for i in range(t):
    for j in range(i + 1):
      terms[i, j, j + 1:i + 1] = 1.0
  d = jnp.einsum("btn,ijt->bnij", log_f, terms.astype(log_f.dtype))
  visible = causal_mask(t, t) if keep is None else causal_mask(t, t) & keep
  w = masked_softmax(scaled_logits(q, k) + d, visible)
  return apply_weights(w, v)


@pytest.fixture
def small_blocks(monkeypatch):
  """Chunked attention with 16 x 16 blocks, so short test sequences span many blocks."""
  from jaxsoft.attention import _chunked
  monkeypatch.setattr(_chunked, "BLOCK_Q", 16)
  monkeypatch.setattr(_chunked, "BLOCK_K", 16)
  return 16


def test_forget_gate_decay_is_cumulative_sum():
  log_f = jax.nn.log_sigmoid(normal(0, (2, 6, 3)))
  cq, ck = forget_gate_decay(log_f)
  lf = np.asarray(log_f, np.float64)
  for i in range(6):
    for j in range(i + 1):
      np.testing.assert_allclose(cq[:, i] - ck[:, j], lf[:, j + 1:i + 1].sum(1), atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_forgetting_attention_matches_explicit_sum(impl):
  q, k, v, log_f = fox_inputs()
  f = lambda q, k, v, lf: forgetting_attention(q, k, v, lf, implementation=impl)
  assert_fn_close(f, _fox_reference, (q, k, v, log_f))


def test_forgetting_attention_gqa():
  q, _, _, log_f = fox_inputs(n=4)
  k, v = normal(10, (2, 7, 2, 4)), normal(11, (2, 7, 2, 4))
  out = jax.jit(forgetting_attention)(q, k, v, log_f)  # jitted: one program, not op by op
  ref = jax.jit(_fox_reference)(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), log_f)
  chex.assert_trees_all_close(out, ref, **FWD)


def test_forgetting_attention_unit_gate_is_causal_softmax():
  q, k, v, log_f = fox_inputs()
  out = forgetting_attention(q, k, v, jnp.zeros_like(log_f))
  chex.assert_trees_all_close(out, jax.nn.dot_product_attention(q, k, v, is_causal=True), **FWD)


def test_forgetting_attention_check_grads_f64():
  with jax.enable_x64(True):
    q, k, v, log_f = (a.astype(jnp.float64) for a in fox_inputs(t=5, n=1, h=2))
    # jit: check_grads evaluates f many times; one compiled program instead of op by op
    f = jax.jit(lambda lf, q: forgetting_attention(q, k, v, lf, implementation="xla"))
    check_grads(f, (log_f, q), order=1, modes=("rev",))


def test_forgetting_attention_very_negative_threshold_prunes_nothing(small_blocks):
  q, k, v, log_f = fox_inputs(t=40)
  log_f = 4.0 * log_f  # fast forgetting: a real threshold would prune here
  pruned = lambda q, k, v, lf: forgetting_attention(
      q, k, v, lf, implementation="xla_chunked", prune_threshold=-1e30)
  assert_fn_close(pruned, _fox_reference, (q, k, v, log_f))


def test_forgetting_attention_prunes_exactly_the_decayed_blocks(small_blocks):
  # A (query block, key block) pair is skipped when max_i c_i - min_j c_j < threshold
  # (over the block pair, batches and heads): equal to masking those pairs out.
  t, b = 80, small_blocks
  q, k, v, _ = fox_inputs(t=t, seed=60)
  log_f = jax.nn.log_sigmoid(normal(64, (2, t, 2), 0.5) - 1.0)
  thr = -8.0
  c = np.asarray(jnp.cumsum(log_f, axis=1))  # [B, T, N]
  nb = t // b
  cmax = c.reshape(2, nb, b, 2).max(axis=(0, 2, 3))
  cmin = c.reshape(2, nb, b, 2).min(axis=(0, 2, 3))
  skip = (cmax[:, None] - cmin[None, :]) < thr  # [query block, key block]
  assert skip[np.tril_indices(nb, -1)].any()  # the test prunes something
  keep = ~np.kron(skip, np.ones((b, b), bool))
  # jitted (the threshold stays a concrete float): one program each, not op by op
  out = jax.jit(lambda *a: forgetting_attention(*a, implementation="xla_chunked",
                                                prune_threshold=thr))(q, k, v, log_f)
  reference = jax.jit(_fox_reference)
  chex.assert_trees_all_close(out, reference(q, k, v, log_f, jnp.asarray(keep)), **FWD)
  assert float(jnp.max(jnp.abs(out - reference(q, k, v, log_f)))) > 1e-7


def test_acp_threshold_bounds_every_pruned_weight():
  # Fast-forgetting heads: many pairs fall below the threshold.
  t = 48
  q, k, v, _ = fox_inputs(t=t)
  log_f = jnp.full((2, t, 2), -1.5)
  eps = 1e-3
  thr = acp_prune_threshold(q, k, epsilon=eps)
  cq, ck = forget_gate_decay(log_f)
  d = jnp.transpose(cq, (0, 2, 1))[..., :, None] - jnp.transpose(ck, (0, 2, 1))[..., None, :]
  causal = causal_mask(t, t)
  w = masked_softmax(scaled_logits(q, k) + d, causal)
  pruned = causal[None, None] & (d < thr)
  assert int(pruned.sum()) > 0.3 * int(causal.sum()) * 2  # the bound actually prunes
  assert float(jnp.max(jnp.where(pruned, w, 0.0))) < eps
  # The pruned pairs of each row are a prefix of the causal row (contiguous in the past).
  first_kept = jnp.argmin(pruned, axis=-1)
  j = jnp.arange(t)[None, None, None, :]
  assert bool(jnp.all(pruned == (causal[None, None] & (j < first_kept[..., None]))))


def test_forgetting_attention_acp_error_within_bound(small_blocks):
  t, eps = 96, 1e-2
  q, k, v, _ = fox_inputs(t=t, seed=20)
  log_f = jnp.full((2, t, 2), -1.0)
  thr = float(acp_prune_threshold(q, k, epsilon=eps))
  assert -thr < 0.5 * t  # blocks far enough in the past fall below the threshold
  # jitted (the threshold stays a concrete float): one program each, not op by op
  out = jax.jit(lambda *a: forgetting_attention(*a, implementation="xla_chunked",
                                                prune_threshold=thr))(q, k, v, log_f)
  ref = jax.jit(_fox_reference)(q, k, v, log_f)
  bound = 2 * t * eps * float(jnp.max(jnp.abs(v)))
  assert float(jnp.max(jnp.abs(out - ref))) <= bound
  chex.assert_tree_all_finite(out)


@pytest.mark.parametrize("call,arg", [
    (lambda: forgetting_attention(jnp.ones((1, 4, 2, 3)), jnp.ones((1, 4, 2, 3)),
                                  jnp.ones((1, 4, 2, 3)), jnp.ones((1, 4, 3))), "log_f"),
    (lambda: forgetting_attention(jnp.ones((1, 4, 2, 3)), jnp.ones((1, 5, 2, 3)),
                                  jnp.ones((1, 5, 2, 3)), jnp.ones((1, 4, 2))), "T=4"),
    (lambda: acp_prune_threshold(jnp.ones((1, 2, 1, 2)), jnp.ones((1, 2, 1, 2)),
                                 epsilon=1.5), "epsilon"),
])
def test_bad_input_names_the_argument(call, arg):
  with pytest.raises(ValueError, match=arg):
    call()
