r"""Sparse State Expansion (SSE): linear attention over P state partitions, top-k routed (A12 / DSSA).

SpikingBrain 2.0's Dual-Space Sparse Attention mixes MoBA layers
(:func:`block_sparse_attention`, ``method="moba"``) with SSE layers: linear attention whose
state is expanded into P partitions, each token writing to and reading from only the k
partitions its router selects.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxsoft.attention._checks import check_int

__all__ = ["sparse_state_expansion", "sse_gates"]


def sse_gates(router_logits: ArrayLike, top_k: int) -> jax.Array:
  r"""SSE's sparse routing gates: softmax over each token's top-k partitions, 0 elsewhere.

  .. math::
    g_{t,p} = \frac{e^{r_{t,p}}\, [p \in I_t]}{\sum_{p' \in I_t} e^{r_{t,p'}}}, \qquad
    I_t = \operatorname{top}_k(r_t)

  (ties: the lower partition index first). Differentiable in the logits with the
  selection held fixed.

  Args:
    router_logits: ``[..., P]`` float.
    top_k: k, an int in ``[1, P]``.

  Returns:
    ``[..., P]`` in the logits' float dtype (at least float32 inside).

  Examples:
    >>> g = js.attention.sse_gates(jnp.array([0.0, 2.0, 1.0, 2.0]), 2)
    >>> g.round(3)
    Array([0. , 0.5, 0. , 0.5], dtype=float32)

  References:
    Y. Pan, Y. An, Z. Li, Y. Chou, R.-J. Zhu, X. Wang, M. Wang, J. Wang & G. Li, 2025,
    "Scaling Linear Attention with Sparse State Expansion" (arXiv 2507.16577).
  """
  fn = "sse_gates"
  r = jnp.asarray(router_logits)
  if r.ndim < 1 or not jnp.issubdtype(r.dtype, jnp.floating):
    raise ValueError(f"{fn}: `router_logits` must be a float array [..., P], got "
                     f"{r.dtype}{list(r.shape)}")
  p = r.shape[-1]
  k = check_int(top_k, "top_k", 1, fn, p)
  return _gates(r.astype(jnp.promote_types(r.dtype, jnp.float32)), k)


def _gates(r, k: int):
  _, idx = lax.top_k(lax.stop_gradient(r), k)
  sel = jnp.any(jax.nn.one_hot(idx, r.shape[-1], dtype=bool), axis=-2)
  return jax.nn.softmax(jnp.where(sel, r, -jnp.inf), axis=-1, where=sel) * sel


def sparse_state_expansion(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                           router_logits: ArrayLike, *, top_k: int, scale: float = 1.0,
                           key_value_seq_lengths: ArrayLike | None = None,
                           chunk_size: int = 64) -> jax.Array:
  r"""Sparse State Expansion [R]: causal linear attention with P routed state partitions.

  Each head keeps P states :math:`S_p \in \mathbb{R}^{H \times H_v}`. Token t's router
  selects its top-k partitions :math:`I_t` with gates :math:`g_t` (:func:`sse_gates`,
  softmax over the selected logits), *writes* its key-value outer product into them and
  *reads* its output from them:

  .. math::
    S_{p,t} = S_{p,t-1} + g_{t,p}\, k_t v_t^\top, \qquad
    o_t = s \sum_{p \in I_t} g_{t,p}\, q_t^\top S_{p,t}
        = s \sum_{j \le t} (g_t \cdot g_j)\,(q_t \cdot k_j)\, v_j .

  Only the k selected rows-blocks of the expanded state :math:`[P H, H_v]` change per
  token (the row-sparse update), so the state grows with P at a constant cost per token
  in a kernel; here it runs chunked (``chunk_size`` tokens: the quadratic form inside a
  chunk, the partition states carried across chunks), exact for any chunk size.

  [R] The exact SSE form is not recorded in this project's sources (SpikingBrain 2.0
  names "several state partitions selected sparsely per token"; the SSE paper's
  abstract: softmax-based top-k selection, partitions with shared parameters, write-read
  gating). Reconstructed: the same gates for writing and reading, no normaliser and no
  decay; a row-sparse key (the paper's top-k classification of the key itself) is the
  caller's feature map on ``key``. The routing logits come from the caller (a linear map
  of the token, usually).

  Args:
    query: ``[B, T, N, H]``.
    key: ``[B, T, N, H]``.
    value: ``[B, T, N, Hv]``.
    router_logits: ``[B, T, N, P]``: the partition scores of each token and head.
    top_k: partitions per token, an int in ``[1, P]``.
    scale: s, the output scale (a number; linear attention has no softmax temperature).
    key_value_seq_lengths: optional int ``[B]``: tokens at or after ``len_b`` neither
      write nor read (their outputs are 0).
    chunk_size: tokens per chunk of the computation (an int >= 1; the result does not
      depend on it beyond float rounding).

  Returns:
    ``[B, T, N, Hv]`` in query's dtype (float32 inside; float64 stays float64).
    Differentiable in query, key, value and the router logits (the selection held fixed).

  Examples:
    With one partition (P = k = 1) SSE is plain causal linear attention:

    >>> x = jnp.sin(jnp.arange(48.0)).reshape(1, 6, 2, 4)  # [B, T, N, H]
    >>> out = js.attention.sparse_state_expansion(x, x, x, jnp.zeros((1, 6, 2, 1)), top_k=1)
    >>> w = jnp.einsum("btnh,bsnh->bnts", x, x) * jnp.tril(jnp.ones((6, 6)))[None, None]
    >>> bool(jnp.allclose(out, jnp.einsum("bnts,bsnh->btnh", w, x), atol=1e-5))
    True

  References:
    Y. Pan, Y. An, Z. Li, Y. Chou, R.-J. Zhu, X. Wang, M. Wang, J. Wang & G. Li, 2025,
    "Scaling Linear Attention with Sparse State Expansion" (arXiv 2507.16577).

    SpikingBrain 2.0, 2025, Dual-Space Sparse Attention: MoBA and SSE layers (authors
    and title as in the SpikingBrain technical report; not recorded in full here).
  """
  fn = "sparse_state_expansion"
  q, k, v, r = (jnp.asarray(a) for a in (query, key, value, router_logits))
  for name, a in (("query", q), ("key", k), ("value", v), ("router_logits", r)):
    if a.ndim != 4 or not jnp.issubdtype(a.dtype, jnp.floating):
      raise ValueError(f"{fn}: `{name}` must be a 4-d float array, got {a.dtype}{list(a.shape)}")
  B, T, N, H = q.shape
  if k.shape != q.shape:
    raise ValueError(f"{fn}: `key` must have query's shape {q.shape}, got {k.shape}")
  if v.shape[:3] != (B, T, N):
    raise ValueError(f"{fn}: `value` must be [B, T, N, Hv] = [{B}, {T}, {N}, Hv], got {v.shape}")
  if r.shape[:3] != (B, T, N) or r.shape[3] < 1:
    raise ValueError(f"{fn}: `router_logits` must be [B, T, N, P] = [{B}, {T}, {N}, P], got "
                     f"{r.shape}")
  P = r.shape[3]
  kk = check_int(top_k, "top_k", 1, fn, P)
  C = check_int(chunk_size, "chunk_size", 1, fn)
  s = float(scale)
  if not math.isfinite(s):
    raise ValueError(f"{fn}: `scale` must be a finite number, got {scale!r}")
  cdt = jnp.promote_types(jnp.result_type(q.dtype, k.dtype, v.dtype, r.dtype), jnp.float32)
  g = _gates(r.astype(cdt), kk)  # [B, T, N, P]
  if key_value_seq_lengths is not None:
    lens = jnp.asarray(key_value_seq_lengths)
    if lens.shape != (B,) or not jnp.issubdtype(lens.dtype, jnp.integer):
      raise ValueError(f"{fn}: `key_value_seq_lengths` must be an int array [{B}], got "
                       f"{lens.dtype}{list(lens.shape)}")
    g = g * (jnp.arange(T)[None, :] < lens[:, None])[:, :, None, None].astype(cdt)
  nc = -(-T // C)
  Tp = nc * C

  def prep(a):  # [B, T, N, X] -> [nc, B, N, C, X], zero padded (a padded token has g = 0)
    a = jnp.pad(a.astype(cdt), ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
    return jnp.moveaxis(a.reshape(B, nc, C, N, -1), (1, 3), (0, 2))

  qc, kc, vc, gc = prep(q * s if s != 1.0 else q), prep(k), prep(v), prep(g)
  causal = jnp.tril(jnp.ones((C, C), bool))

  def body(state, xs):  # state [B, N, P, H, Hv]
    qx, kx, vx, gx = xs
    inter = jnp.einsum("bncp,bnch,bnphv->bncv", gx, qx, state)
    w = jnp.einsum("bnch,bndh->bncd", qx, kx) * jnp.einsum("bncp,bndp->bncd", gx, gx)
    intra = jnp.einsum("bncd,bndv->bncv", jnp.where(causal, w, 0.0), vx)
    state = state + jnp.einsum("bncp,bnch,bncv->bnphv", gx, kx, vx)
    return state, inter + intra

  init = jnp.zeros((B, N, P, H, v.shape[-1]), cdt)
  _, out = lax.scan(body, init, (qc, kc, vc, gc))  # [nc, B, N, C, Hv]
  out = jnp.moveaxis(out, (0, 2), (1, 3)).reshape(B, Tp, N, -1)[:, :T]
  return out.astype(q.dtype)
