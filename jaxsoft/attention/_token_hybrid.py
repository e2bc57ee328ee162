"""Token-level hybrids of softmax attention and Gated DeltaNet in one layer (A46): NAtS-L's
token routing (which keys go to the softmax cache, which into the recurrent state) and Oryx's
per-position mixer switch (which queries read by softmax attention, which read the state)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft import linear as _linear
from jaxsoft.normalizers import common as c

__all__ = ["nats_attention", "oryx_attention", "straight_through_route"]


def _inputs(q, k, v, gates, fn):
  q, k, v = (jnp.asarray(a) for a in (q, k, v))
  for name, a in (("query", q), ("key", k), ("value", v)):
    if a.ndim != 4 or not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{fn}: `{name}` must be a floating [B, T, N, K] array, got "
                       f"{a.shape} {a.dtype}")
  if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
    raise ValueError(f"{fn}: `query` {q.shape}, `key` {k.shape} and `value` {v.shape} must "
                     "share [B, T, N] (and query/key K)")
  out = []
  ct = _compute_dtype(q, k, v)
  for name, a in gates.items():
    a = jnp.asarray(a)
    if a.shape != q.shape[:3]:
      raise ValueError(f"{fn}: `{name}` must be [B, T, N] = {q.shape[:3]}, got {a.shape}")
    out.append(a.astype(ct))
  return q, k, v, out


def _compute_dtype(q, k, v):
  """float32, or float64 for float64 inputs (under JAX_ENABLE_X64)."""
  return jnp.promote_types(jnp.result_type(q, k, v), jnp.float32)


def _weighted_causal_softmax(q, k, v, weight, scale):
  r""":math:`o_i = \sum_{j \le i} w_j e^{l_{ij}} v_j / \sum_{j \le i} w_j e^{l_{ij}}` (0 when
  the denominator is 0), :math:`l = \text{scale}\; q k^\top`, in float32 (float64 for
  float64 inputs)."""
  ct = _compute_dtype(q, k, v)
  f32 = lambda a: a.astype(ct)  # noqa: E731
  logits = jnp.einsum("btnk,bsnk->bnts", f32(q), f32(k)) * scale
  t = q.shape[1]
  causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
  w = jnp.moveaxis(weight, 1, 2)[:, :, None, :] * causal  # [B, N, T, S]
  live = w > 0
  m = jax.lax.stop_gradient(jnp.max(jnp.where(live, logits, -jnp.inf), -1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = w * jnp.exp(jnp.where(live, logits - m, 0.0))
  den = jnp.sum(e, -1, keepdims=True)
  p = e / jnp.where(den > 0, den, 1.0)
  return jnp.einsum("bnts,bsnv->btnv", p, f32(v))


def _gdn(q, k, v, g, beta, scale, implementation):
  return _linear.gated_delta_rule(q, k, v, g, beta, scale=scale, qk_l2norm=True,
                                  implementation=implementation).astype(_compute_dtype(q, k, v))


def _scale(scale, q):
  return q.shape[-1] ** -0.5 if scale is None else float(scale)


def straight_through_route(logits: ArrayLike) -> jax.Array:
  r"""A hard 0/1 route with the sigmoid's gradient, the straight-through estimator (A46).

  .. math::
    r = \mathbf{1}[\sigma(z) > 1/2] + \sigma(z) - \mathrm{sg}(\sigma(z)),

  forward the step :math:`\mathbf{1}[z > 0]`, backward :math:`\sigma'(z)`: the learned
  per-token decision of :func:`nats_attention` and :func:`oryx_attention` in training.

  Args:
    logits: the router's scores z (any shape).

  Returns:
    routes of ``logits``' shape, exactly 0 or 1, in float32 (float64 for float64
    logits: the gradient is computed in the logits' precision).

  Examples:
    >>> js.attention.straight_through_route(jnp.array([-2.0, 0.5]))
    Array([0., 1.], dtype=float32)
    >>> jax.grad(lambda z: js.attention.straight_through_route(z).sum())(jnp.array([0.0]))
    Array([0.25], dtype=float32)

  References:
    Y. Bengio, N. Léonard & A. Courville, 2013, "Estimating or Propagating Gradients Through
    Stochastic Neurons for Conditional Computation" (arXiv 1308.3432).
  """
  z = jnp.asarray(logits)
  p = jax.nn.sigmoid(z.astype(c.compute_dtype(z.dtype)))
  return (p > 0.5).astype(p.dtype) + p - jax.lax.stop_gradient(p)


def nats_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike, g: ArrayLike,
                   beta: ArrayLike, keep: ArrayLike, *, scale: float | None = None,
                   implementation: str | None = None) -> jax.Array:
  r"""NAtS-L token routing in one causal layer: softmax over kept tokens + Gated DeltaNet (A46).

  A per-token route :math:`r_j \in [0, 1]` (``keep``; 0/1 from
  :func:`straight_through_route` in training) sends token j to the softmax KV cache
  (:math:`r_j = 1`, kept "for future queries") or into the fixed-size recurrent state
  (:math:`r_j = 0`, "short-term"), and the readouts add:

  .. math::
    o_i = \underbrace{\frac{\sum_{j \le i} r_j e^{l_{ij}} v_j}{\sum_{j \le i} r_j e^{l_{ij}}}}
          _{\text{softmax over kept tokens (0 if none)}}
        + \underbrace{S_i^\top \hat q_i}_{\text{Gated DeltaNet}}, \qquad
    S_i = e^{g_i} S_{i-1} + (1 - r_i)\beta_i\, \hat k_i (v_i - e^{g_i} S_{i-1}^\top \hat k_i)^\top,

  with :math:`l_{ij} = \text{scale}\; q_i \cdot k_j` (shared projections), :math:`\hat q,
  \hat k` L2-normalised (:func:`jaxsoft.linear.gated_delta_rule` with ``qk_l2norm``): a kept
  token does not write the state. ``keep`` = 1 everywhere is causal softmax attention, 0
  everywhere is Gated DeltaNet; a decoder's KV cache holds only the kept tokens (memory
  :math:`\propto \sum_j r_j`). [R] The paper scores chunks (a mean-pooled, learned two-way
  score per chunk); a route constant over each chunk gives that granularity. The sum of the
  two readouts is our reading.

  Args:
    query, key: ``[B, T, N, K]``.
    value: ``[B, T, N, V]``.
    g: ``[B, T, N]`` log decays ``<= 0``.
    beta: ``[B, T, N]`` write strengths in [0, 1].
    keep: ``[B, T, N]`` routes in [0, 1] (1 = softmax cache).
    scale: the logit scale, default :math:`K^{-1/2}` (also the state's read scale).
    implementation: Gated DeltaNet's (``jaxsoft.linear.IMPLEMENTATIONS``).

  Returns:
    ``[B, T, N, V]`` in ``value``'s dtype.

  Examples:
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 6, 2, 4))
    >>> g, beta = jnp.full((1, 6, 2), -0.1), jnp.full((1, 6, 2), 0.5)
    >>> o = jax.jit(js.attention.nats_attention)(q, k, v, g, beta, jnp.ones((1, 6, 2)))
    >>> dense = js.attention.dot_product_attention(q, k, v, is_causal=True)
    >>> bool(jnp.allclose(o, dense, atol=1e-5))
    True

  References:
    D. Deng, A. B. Winje, L. Fehring & M. Lindauer, 2026, "Neural Attention Search Linear:
    Towards Adaptive Token-Level Hybrid Attention Models" (arXiv 2602.03681).

    S. Yang, J. Kautz & A. Hatamizadeh, 2025, "Gated Delta Networks: Improving Mamba2 with
    Delta Rule" (arXiv 2412.06464).
  """
  fn = "nats_attention"
  q, k, v, (g, beta, keep) = _inputs(query, key, value, {"g": g, "beta": beta, "keep": keep}, fn)
  sc = _scale(scale, q)
  soft = _weighted_causal_softmax(q, k, v, keep, sc)
  state = _gdn(q, k, v, g, beta * (1.0 - keep), sc, implementation)
  return (soft + state).astype(v.dtype)


def oryx_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike, g: ArrayLike,
                   beta: ArrayLike, mode: ArrayLike, *, scale: float | None = None,
                   implementation: str | None = None) -> jax.Array:
  r"""Oryx's hybrid mixer: each position reads by softmax attention or the recurrence (A46).

  The projections are shared by the two modes. The Gated DeltaNet state is written at every
  token; a position in attention mode (:math:`m_i = 1`) reads softmax attention over the
  cached K/V of every token so far, one in recurrent mode (:math:`m_i = 0`) reads the state:

  .. math::
    o_i = m_i \sum_{j \le i} \mathrm{softmax}_j(l_{ij})\, v_j + (1 - m_i)\, S_i^\top \hat q_i,

  :math:`l_{ij} = \text{scale}\; q_i \cdot k_j`, S as :func:`jaxsoft.linear.gated_delta_rule`
  (``qk_l2norm``), all from the same q, k, v. ``mode`` = 1 everywhere is causal softmax
  attention with the shared weights, 0 everywhere the recurrent baseline; any schedule is
  causal. The schedule is fixed (e.g. every r-th position, or spans: the paper switches by
  chunk or span) or learned (:func:`straight_through_route` of a router). [R] The paper gives
  each mode its own queries over shared keys and values; here the query is shared too. This training form computes both readouts;
  a decoder computes the one its mode asks for.

  Args:
    query, key, value, g, beta, scale, implementation: as in :func:`nats_attention`.
    mode: ``[B, T, N]`` in [0, 1] (1 = attention read), in place of its ``keep``.

  Returns:
    As :func:`nats_attention`: ``[B, T, N, V]`` in ``value``'s dtype.

  Examples:
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 6, 2, 4))
    >>> g, beta = jnp.full((1, 6, 2), -0.1), jnp.full((1, 6, 2), 0.5)
    >>> o = jax.jit(js.attention.oryx_attention)(q, k, v, g, beta, jnp.zeros((1, 6, 2)))
    >>> gdn = jax.jit(js.linear.gated_delta_rule, static_argnames='qk_l2norm')(
    ...     q, k, v, g, beta, qk_l2norm=True)
    >>> bool(jnp.allclose(o, gdn, atol=1e-5))
    True

  References:
    K. Y. Li, A. Trockman, A. T. Suresh & Z. Sun, 2026, "Multi-Mixer Models: Flexible
    Sequence Modeling with Shared Representations" (Oryx; arXiv 2605.28769).

    S. Yang, J. Kautz & A. Hatamizadeh, 2025, "Gated Delta Networks: Improving Mamba2 with
    Delta Rule" (arXiv 2412.06464).
  """
  fn = "oryx_attention"
  q, k, v, (g, beta, mode) = _inputs(query, key, value, {"g": g, "beta": beta, "mode": mode}, fn)
  sc = _scale(scale, q)
  soft = _weighted_causal_softmax(q, k, v, jnp.ones_like(mode), sc)
  state = _gdn(q, k, v, g, beta, sc, implementation)
  m = jnp.expand_dims(mode, -1)
  return (m * soft + (1.0 - m) * state).astype(v.dtype)
