"""Losses, pooling, nn attention helpers and a few attention / normalizer functions need no implicit rank promotion (issue 37).

Under ``jax.numpy_rank_promotion("raise")`` (the setting of JAX's own test suite and of many
users') each function below traces, forward and backward, as it does without the setting,
given batched inputs next to lower-rank per-class / per-head / shared arrays (a bias
``[V]``, a proposal ``[V]``, tree paths ``[V, L]``, a codebook's counts, concentrations
``[C]``, thresholds ``[H]``, prototypes ``[M, d]``, an attention mask ``[T, S]``, per-head
biases ``[N]``). Each once raised: the lower-rank array met the batched one in a jnp
operation that broadcast it by rank.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsoft as js
from train import positions

L = js.losses
B, T, D, V = 2, 3, 4, 6
_rng = np.random.default_rng(37)


def _normal(shape):   # numpy: building the inputs dispatches no jax op
  return _rng.standard_normal(shape).astype(np.float32)


H = _normal((B, T, D))
W = _normal((D, V))
BIAS = _normal((V,))
LABELS = jnp.array([[0, 5, 2], [3, 1, 4]])
KEY = jax.random.key(1)
PATHS, CODES = L.huffman_tree([5, 3, 2, 2, 1, 1])             # V = 6 leaves, V - 1 nodes
ASSIGN = jnp.array([0, 2, 1, 0, 2, 2])                          # V classes onto 3 codes
PROBS = _normal((B, 2, T, 5))
PROBS = np.exp(PROBS) / np.exp(PROBS).sum(-1, keepdims=True)    # [B, H = 2, T, S]
X_SETS = _normal((B, 5, D))                                     # B pools of 5 tokens


CASES = {
    "sampled_softmax_loss": (
        lambda h, w, b: L.sampled_softmax_loss(KEY, h, w, LABELS, 5, bias=b,
                                               proposal=jnp.arange(1.0, V + 1.0)),
        (H, W, BIAS)),
    "hierarchical_softmax_log_probs": (
        lambda h, w: L.hierarchical_softmax_log_probs(h, w, PATHS, CODES), (H, W[:, :V - 1])),
    "augment_reduce_loss": (
        lambda z: L.augment_reduce_loss(KEY, z, LABELS, 3), (_normal((B, T, V)),)),
    "pmrl_loss": (
        lambda z: L.pmrl_loss(z, where=jnp.array([[True, True, False], [True, True, True]])),
        (H,)),
    "vq_logits": (
        lambda h, c, b: L.vq_logits(h, c, ASSIGN, bias=b), (H, W[:, :3], BIAS)),
    "vq_logits_cross_entropy": (
        lambda h, c: L.vq_logits_cross_entropy(h, c, ASSIGN, LABELS), (H, W[:, :3])),
    "wcdas_loss": (   # K = 2 centres per class, one concentration per class
        lambda e, w, rho: L.wcdas_loss(e, w, LABELS, rho),
        (H, _normal((D, V, 2)), jnp.linspace(0.1, 0.8, V))),
    "wrapped_cauchy_log_density": (   # angles [3] against concentrations [2, 1]
        L.wrapped_cauchy_log_density, (jnp.array([0.0, 1.0, 3.0]), jnp.array([[0.2], [0.7]]))),
    "softmax_cpr_logits": (
        lambda h, w, b: L.softmax_cpr_logits(h, w, bias=b), (H, W, BIAS)),
    "attention_entropy_penalty": (   # one threshold per head
        lambda p, th: L.attention_entropy_penalty(p, th, tolerance=0.0),
        (PROBS, jnp.array([0.3, 0.9]))),
    "entropic_ot_weights": (   # prototypes [M, d] shared by the B pools
        lambda x, pr: js.pooling.entropic_ot_weights(x, prototypes=pr, num_iters=5),
        (X_SETS, _normal((3, D)))),
    "nn.attention_weights": (   # a [T, S] bias and mask, causal, lengths [B], a window
        lambda q, bias: js.nn.attention_weights(
            q, q, bias, bias > 0, is_causal=True, query_seq_lengths=jnp.array([3, 2]),
            key_value_seq_lengths=jnp.array([2, 3]), local_window_size=1),
        (_normal((B, T, 2, D)), _normal((T, T)))),
    "nn.SSA.token_temperature": (   # per-head projection bias [N]; q [B, N, T, H]
        lambda q: js.nn.SSA(2, D).token_temperature(q), (_normal((B, 2, T, D)),)),
    "nn.MultiHeadAttention.log_forget_gates": (   # forget bias [N]; x [B, T, D]
        lambda x: js.nn.MultiHeadAttention(2, D, forget_gate=True, rngs=nnx.Rngs(0))
        .log_forget_gates(x), (H,)),
    "nn.SoftMoE": (   # expert biases [n, f]; slots [B, n, p, d]
        lambda x: js.nn.SoftMoE(D, 2, rngs=nnx.Rngs(0))(x), (H,)),
    "train.positions.rope": (   # frequencies [H/2]; positions [B, T]
        lambda x: positions.rope(x, jnp.arange(T)[None].repeat(B, 0), 10000.0),
        (_normal((B, T, 2, D)),)),
    "entropic_ot_pool": (
        lambda x, pr: js.pooling.entropic_ot_pool(x, prototypes=pr, num_iters=5),
        (X_SETS, _normal((3, D)))),
    "attention.gated_attention_output": (   # gate bias [N, H]; x [B, T, D]
        js.attention.gated_attention_output,
        (_normal((B, T, 2, D)), H, _normal((D, 2, D)), _normal((2, D)))),
    "attention.infsa_attention": (   # per-head gamma [N]; the solve's identity [T, T]
        lambda q: js.attention.infsa_attention(q, q, q, gamma=jnp.array([0.3, 0.5])),
        (_normal((B, T, 2, D)),)),
    "normalizers.dirichlet_logits": (   # bias [K] on log-probabilities [B, T, K]
        lambda lp, w, b: js.normalizers.dirichlet_logits(lp, w, b),
        (_normal((B, T, V)), _normal((V, V)), BIAS)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_needs_no_rank_promotion(name):
  fn, args = CASES[name]

  def value_and_grad(*a):   # forward and backward (custom rules may use jnp too)
    return jax.value_and_grad(lambda a0, *rest: jnp.sum(fn(a0, *rest)))(*a)

  # eval_shape traces as jit does (the setting acts at trace time) and compiles nothing: a
  # promotion raises while tracing. The values are those of the other tests (the fixes
  # only make each broadcast explicit).
  want = jax.eval_shape(value_and_grad, *args)
  with jax.numpy_rank_promotion("raise"):
    got = jax.eval_shape(value_and_grad, *args)
  assert got == want
