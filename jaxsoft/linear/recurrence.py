r"""The one recurrence behind every variant, in its three forms (recurrent, chunked, parallel).

Internal layout ``[B, N, T, ...]``, every array in the call's compute dtype (float32, or
float64 for float64 inputs), ``q`` already scaled (and feature-mapped). The
state ``S [B, N, K, V]`` follows the (gated) delta recurrence

.. math::
  \tilde S_t = \operatorname{diag}(e^{g_t}) S_{t-1}, \qquad
  S_t = \tilde S_t + k_t u_t^\top, \qquad o_t = S_t^\top q_t,

with ``u_t = v_t`` (linear attention, GLA: no ``beta``) or the delta-rule write
``u_t = beta_t (v_t - \tilde S_t^\top k_t)``. ``g`` is a log decay, one per head
(``[B, N, T]``) or one per key channel (``[B, N, T, K]``), or None (no decay). At a run
change (a new segment) the previous state is dropped: ``\tilde S_t = 0``.

Chunked form (chunk length C; the parallel form is the same computation with one chunk of
length T). Inside a chunk, with ``G_i`` the cumulative log decay from the chunk start to
token ``i`` (inclusive) and ``S_0`` the state at the chunk start,

.. math::
  S_i = e^{G_i} S_0 + \sum_{j \le i} e^{G_i - G_j} k_j u_j^\top .

For the delta rule this gives ``(I + A) U = \beta \odot V - \operatorname{diag}(\beta e^G) K S_0``
with ``A_{ij} = \beta_i e^{G_i - G_j} k_i \cdot k_j`` for ``j < i``: the UT / WY
representation (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule
over Sequence Length"): one unit-lower-triangular inverse per chunk
(:func:`unit_lower_inverse`, recursive block inversion) gives
``W = (I + A)^{-1} \operatorname{diag}(\beta e^G) K`` and ``\tilde U = (I + A)^{-1}
(\beta \odot V)``, so ``U = \tilde U - W S_0``. Then

.. math::
  O = \operatorname{diag}(e^G) Q S_0 + ((Q K^\top) \odot \Gamma) U, \qquad
  S_C = e^{G_C} S_0 + (K \odot e^{G_C - G})^\top U,

``\Gamma_{ij} = e^{G_i - G_j}`` for ``j \le i`` in the same run, else 0 (per channel
``\sum_c q_{ic} k_{jc} e^{G_{ic} - G_{jc}}``). Every exponent is a masked difference
``G_i - G_j`` with ``j <= i`` (so ``<= 0``; in :func:`channel_scores`, a difference to a
token between them): the masks are applied before ``exp``, which never sees a large
positive number. Only the chunk-start states are carried, by a
``lax.scan`` over chunks (which for the delta rules' chunked form also forms each chunk's
``U = \tilde U - W S_0``, as flash-linear-attention's kernels do: :func:`_scan_values`);
everything else is computed for all chunks at once.

Backward pass of the chunked form (feature K07): a custom VJP keeps the inputs, the
chunk-start states (``O(T·K·V / C)``) and, for the delta rules, the UT transform: the
inverse ``(I + A)^{-1}`` (``T·C`` numbers), the WY factors ``W``, ``\tilde U`` and the
written values ``U`` (``T·(K + 2V)``), as flash-linear-attention's ``chunk_gated_delta_rule``
keeps its ``A``. The backward pass rebuilds every chunk's scores and decays from the inputs,
for all chunks at once as the forward pass does; a reverse ``lax.scan`` over the chunks
carries only the state cotangent ``[K, V]``, and the cotangents of the chunk terms and of
the inputs then follow for all chunks at once: the recomputing backward of Lightning
Attention (Qin et al. 2024) and of flash-linear-attention's chunk kernels, with no
``[T, T]`` buffer and no per-chunk scores kept between the passes. The UT transform is
differentiated by hand from the kept ``(I + A)^{-1}, W, \tilde U`` (four products; see
:func:`_chunked_recompute_bwd`) and the Gram matrix ``K K^T`` by :func:`_gram`. The
parallel form (one chunk) is left to autodiff, an independent path the tests compare
against: there the UT inverse is differentiated by its own rule
(``d(I + A)^{-1} = -X dA X``), and gla's per-channel scores by :func:`channel_scores`
(recursive secondary chunking, no ``[C, C, K]`` tensor).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxsoft.linear import chunk as _chunk

__all__ = ["step", "recurrent", "chunked", "unit_lower_inverse", "channel_scores"]


def step(S: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array | None,
         beta: jax.Array | None, keep: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """One token: ``S [B, N, K, V]``, ``q, k [B, N, K]``, ``v [B, N, V]``, ``g`` None,
  ``[B, N]`` or ``[B, N, K]``, ``beta`` None or ``[B, N]``, ``keep`` None or ``[B]`` bool
  (False drops the previous state). Returns ``(o [B, N, V], new S)``."""
  if keep is not None:
    S = jnp.where(keep[:, None, None, None], S, 0.0)
  if g is not None:
    d = jnp.exp(g)
    S = S * (d[..., None, None] if d.ndim == 2 else d[..., None])
  if beta is None:
    u = v
  else:
    u = beta[..., None] * (v - jnp.einsum("bnkv,bnk->bnv", S, k))
  S = S + k[..., :, None] * u[..., None, :]
  return jnp.einsum("bnkv,bnk->bnv", S, q), S


def recurrent(q, k, v, g, beta, run, S0) -> tuple[jax.Array, jax.Array]:
  """The token-by-token ``lax.scan``; ``run [B, T]`` run ids. Returns ``(o [B, N, T, V], S_T)``."""
  keep = jnp.concatenate(
      [jnp.ones_like(run[:, :1], dtype=bool), run[:, 1:] == run[:, :-1]], axis=1)
  time_first = lambda x: None if x is None else jnp.moveaxis(x, 2, 0)
  xs = (time_first(q), time_first(k), time_first(v), time_first(g), time_first(beta),
        jnp.moveaxis(keep, 1, 0))

  def body(S, x):
    q_t, k_t, v_t, g_t, b_t, keep_t = x
    o_t, S = step(S, q_t, k_t, v_t, g_t, b_t, keep_t)
    return S, o_t

  S_T, o = jax.lax.scan(body, S0, xs)
  return jnp.moveaxis(o, 0, 2), S_T


def _masked_exp(mask: jax.Array, x: jax.Array) -> jax.Array:
  """``exp(x)`` where ``mask``, exactly 0 elsewhere (masked before the exp)."""
  return jnp.exp(jnp.where(mask, x, -jnp.inf))


@jax.custom_jvp
def unit_lower_inverse(A: jax.Array) -> jax.Array:
  """``(I + A)^{-1}`` for strictly lower-triangular ``A [..., C, C]``, by recursive 2 x 2
  block inversion: ``[[L11, 0], [L21, L22]]^{-1} = [[X11, 0], [-X22 L21 X11, X22]]``,
  from 1 x 1 diagonal blocks up (``C`` padded to a power of two): log2(C) levels of batched
  matmuls, no loop over rows. This is block forward substitution (the same products in
  another order); on CPU it is 30-100x faster than XLA's batched triangular solve at
  C = 64 ... 256, with the same float32 error (~1e-7 relative on the tests' inputs).
  """
  return _block_inverse(A)


def _block_inverse(A: jax.Array) -> jax.Array:
  C = A.shape[-1]
  P = 1 << max(C - 1, 0).bit_length()
  batch = A.shape[:-2]
  A = jnp.pad(A, [(0, 0)] * len(batch) + [(0, P - C), (0, P - C)])
  X = jnp.ones_like(A[..., :1, None])   # [..., P, 1, 1]: the inverses of the 1 x 1 diagonal blocks
  s = 1
  while s < P:
    nb = P // s
    # one axis split at a time: an explicit mesh's reshape rule takes those
    blocks = A.reshape(batch + (nb, s, P)).reshape(batch + (nb, s, nb, s))[..., 1::2, :, 0::2, :]
    L21 = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [..., nb/2, s, s]
    X11, X22 = X[..., 0::2, :, :], X[..., 1::2, :, :]
    X21 = -(X22 @ L21 @ X11)
    X = jnp.concatenate([jnp.concatenate([X11, jnp.zeros_like(X11)], axis=-1),
                         jnp.concatenate([X21, X22], axis=-1)], axis=-2)
    s *= 2
  return X[..., 0, :C, :C]


@unit_lower_inverse.defjvp
def _unit_lower_inverse_jvp(primals, tangents):
  """``d(I + A)^{-1} = -X dA X`` with ``X = (I + A)^{-1}`` and ``dA`` kept strictly lower
  (only those entries of ``A`` are read). Linear in ``dA``, so reverse mode transposes it
  to ``dA = tril(-X^T dX X^T, -1)``: two batched matmuls with only ``X`` kept, instead of
  differentiating through the block recursion."""
  (A,), (dA,) = primals, tangents
  X = _block_inverse(A)
  i = jnp.arange(A.shape[-1])
  dA = jnp.where(i[:, None] > i[None, :], dA, 0.0)
  return X, -(X @ dA @ X)


@jax.custom_jvp
def _gram(x: jax.Array) -> jax.Array:
  """``x x^T`` over the last axis, with the tangent ``P + P^T``, ``P = dx x^T``: reverse mode
  transposes it to ``dx = (D + D^T) x`` (one product where autodiff of the einsum does two),
  and forward mode (``jax.jvp``, ``jax.jacfwd``) and higher orders work as for any JVP rule."""
  return jnp.einsum("...ik,...jk->...ij", x, x)


@_gram.defjvp
def _gram_jvp(primals, tangents):
  (x,), (dx,) = primals, tangents
  P = jnp.einsum("...ik,...jk->...ij", dx, x)
  return _gram(x), P + jnp.swapaxes(P, -1, -2)


def channel_scores(x: jax.Array, y: jax.Array, G: jax.Array, mask: jax.Array) -> jax.Array:
  r"""``Σ_c x_ic y_jc e^{G_ic - G_jc}`` where ``mask[i, j]`` (else exactly 0), with no
  ``[C, C, K]`` tensor: ``x, y, G [..., C, K]`` (``G`` non-increasing along C, as the
  cumulative sums of log decays ``<= 0`` are), ``mask [..., C, C]`` (broadcastable; true
  only for ``j <= i``).

  The secondary chunking of Yang et al. 2024 ("Gated Linear Attention Transformers with
  Hardware-Efficient Training"), applied recursively: the chunk (padded to a power of two)
  is halved, and the pairs with ``i`` in the second half and ``j`` in the first go through
  one matmul with ``r`` the first token of the second half,
  ``(x_i ⊙ e^{G_i - G_r}) · (y_j ⊙ e^{G_r - G_j})``, both exponents ``<= 0`` (never a large
  positive number, so no overflow and no mask needed before the ``exp``); each half is then
  split again, down to the diagonal ``x_i · y_i``. log2(C) levels of batched matmuls,
  ``O(C·K·log C)`` exponentials instead of ``C²·K``, assembled as the block recursion of
  :func:`unit_lower_inverse` assembles its inverse.
  """
  C, K = x.shape[-2:]
  P = 1 << max(C - 1, 0).bit_length()
  x, y, G = (_chunk.pad_time(t, t.ndim - 2, P - C, mode=m)
             for t, m in ((x, "zero"), (y, "zero"), (G, "edge")))
  lead = x.shape[:-2]
  S = jnp.sum(x * y, axis=-1)[..., None, None]                  # [..., P, 1, 1]: i == j
  b = 1
  while b < P:
    xb, yb, Gb = (t.reshape(lead + (P // (2 * b), 2, b, K)) for t in (x, y, G))
    ref = Gb[..., 1, :1, :]                                      # [..., m, 1, K]
    xq = xb[..., 1, :, :] * jnp.exp(Gb[..., 1, :, :] - ref)
    yk = yb[..., 0, :, :] * jnp.exp(ref - Gb[..., 0, :, :])
    S21 = jnp.einsum("...mik,...mjk->...mij", xq, yk)           # [..., m, b, b]
    S11, S22 = S[..., 0::2, :, :], S[..., 1::2, :, :]
    S = jnp.concatenate([jnp.concatenate([S11, jnp.zeros_like(S11)], axis=-1),
                         jnp.concatenate([S21, S22], axis=-1)], axis=-2)
    b *= 2
  mask = jnp.pad(mask, [(0, 0)] * (mask.ndim - 2) + [(0, P - C), (0, P - C)])
  return jnp.where(mask, S[..., 0, :, :], 0.0)[..., :C, :C]


def _chunk_parts(qc, kc, vc, gc, bc, rc, run_prev):
  """Everything of a chunk that does not depend on its start state, up to the UT inverse, for
  all chunks at once.

  ``qc, kc [B, N, nC, C, K]``, ``vc [B, N, nC, C, V]``, ``gc [B, N, nC, C(, K)]``, ``bc``
  None or ``[B, N, nC, C]``, ``rc [B, nC, C]`` run ids, ``run_prev [B, nC]`` the run before
  each chunk. Returns ``(qd, kd, ds, P, Kb, Vb, A)``: the decayed queries ``e^G q``, keys
  ``e^{G_C - G} k``, the state decay ``e^{G_C}``, the intra-chunk scores ``(Q K^T) ⊙ Γ``
  ``[.., C, C]``, and the right-hand sides and matrix of the UT transform,
  ``β e^G K``, ``β V`` and the strictly lower ``A`` (``None, V, None`` without ``beta``).
  """
  C = qc.shape[3]
  per_channel = gc.ndim == 5
  run_last = rc[..., -1]
  sees_start = (rc == run_prev[..., None])[:, None]                    # [B, 1, nC, C]
  reaches_end = (rc == run_last[..., None])[:, None]                   # [B, 1, nC, C]
  carries = (run_last == run_prev)[:, None]                            # [B, 1, nC]
  same = rc[..., :, None] == rc[..., None, :]                          # [B, nC, C, C]
  i = jnp.arange(C)
  incl = (same & (i[:, None] >= i[None, :])[None, None])[:, None]      # [B, 1, nC, C, C]
  strict = (same & (i[:, None] > i[None, :])[None, None])[:, None]

  G = jnp.cumsum(gc, axis=3)                                           # from the chunk start
  G_last = G[:, :, :, -1]
  if per_channel:
    dq = _masked_exp(sees_start[..., None], G)                         # [B, N, nC, C, K]
    dk = _masked_exp(reaches_end[..., None], G_last[..., None, :] - G)
    ds = _masked_exp(carries[..., None], G_last)                       # [B, N, nC, K]

    def scores(x, y, mask):
      return channel_scores(x, y, G, mask)
  else:
    dq = _masked_exp(sees_start, G)[..., None]                         # [B, N, nC, C, 1]
    dk = _masked_exp(reaches_end, G_last[..., None] - G)[..., None]
    ds = _masked_exp(carries, G_last)[..., None]                       # [B, N, nC, 1]
    # one exp for both masks: the strict decays are the inclusive ones off the diagonal
    decay = _masked_exp(incl, G[..., :, None] - G[..., None, :])       # [B, N, nC, C, C]

    def scores(x, y, mask):
      xy = _gram(x) if x is y else jnp.einsum("...ik,...jk->...ij", x, y)
      return xy * (decay if mask is incl else jnp.where(i[:, None] > i[None, :], decay, 0.0))

  P = scores(qc, kc, incl)
  if bc is None:
    return dq * qc, dk * kc, ds, P, None, vc, None
  b = bc[..., None]                                                    # [B, N, nC, C, 1]
  return dq * qc, dk * kc, ds, P, b * dq * kc, b * vc, b * scores(kc, kc, strict)


def _parts_of(xs, rc, run_prev):
  """:func:`_chunk_parts` of the chunked inputs ``xs = (qc, kc, vc, gc, bc)``."""
  qc, kc, vc, gc, bc = xs
  return _chunk_parts(qc, kc, vc, gc, bc, rc, run_prev)


def _terms(xs, rc, run_prev):
  """The chunk terms ``(qd, kd, ds, P, U_tilde, W)`` of :func:`_chunk_parts` with the UT
  transform done: ``W = (I + A)^{-1} β e^G K`` and ``U_tilde = (I + A)^{-1} β V`` (``v``
  and None without ``beta``)."""
  qd, kd, ds, P, Kb, Vb, A = _parts_of(xs, rc, run_prev)
  if A is None:
    return qd, kd, ds, P, Vb, None
  T_inv = unit_lower_inverse(A)                                        # (I + A)^{-1}
  return qd, kd, ds, P, T_inv @ Vb, T_inv @ Kb


def _chunk_values(U_tilde, W, starts) -> jax.Array:
  """The values written in each chunk, ``U = U_tilde - W S`` (``U_tilde`` without ``beta``)."""
  return U_tilde if W is None else U_tilde - jnp.einsum("...ck,...kv->...cv", W, starts)


def _chunk_out(qd, kd, ds, P, U, starts) -> tuple[jax.Array, jax.Array]:
  """Outputs ``[B, N, nC, C, V]`` and end states ``[B, N, nC, K, V]`` from the chunk terms,
  the written values ``U`` and the start states ``[B, N, nC, K, V]``."""
  o = jnp.einsum("...ck,...kv->...cv", qd, starts) + jnp.einsum("...ij,...jv->...iv", P, U)
  return o, starts * ds[..., None] + jnp.einsum("...ck,...cv->...kv", kd, U)


def _chunk_apply(terms, starts) -> tuple[jax.Array, jax.Array]:
  """:func:`_chunk_out` from the chunk terms ``(qd, kd, ds, P, U_tilde, W)``."""
  qd, kd, ds, P, U_tilde, W = terms
  return _chunk_out(qd, kd, ds, P, _chunk_values(U_tilde, W, starts), starts)


def _chunk_first(x):
  return None if x is None else jnp.moveaxis(x, 2, 0)


def _state_map(terms) -> tuple[jax.Array | None, jax.Array]:
  r"""The chunk's end state as an affine map of its start state, for all chunks at once:
  ``S_end = e^{G_C} S - M S + b`` with ``M = \bar K^T W`` ``[K, K]`` (None without ``beta``)
  and ``b = \bar K^T \tilde U`` ``[K, V]``, so that the scans over chunks do one
  ``[K, K] x [K, V]`` product per chunk (none for the gated linear attentions)."""
  _, kd, _, _, U_tilde, W = terms
  M = None if W is None else jnp.einsum("...ck,...cj->...kj", kd, W)
  return M, jnp.einsum("...ck,...cv->...kv", kd, U_tilde)


def _scan_starts(terms, S0) -> tuple[jax.Array, jax.Array]:
  """The chunk-start states ``[B, N, nC, K, V]`` and the final state, by a scan over chunks."""
  ds = terms[2]
  M, b = _state_map(terms)

  def body(S, x):
    ds_c, m_c, b_c = x
    S_end = S * ds_c[..., None] + b_c
    if m_c is not None:
      S_end = S_end - jnp.einsum("bnkj,bnjv->bnkv", m_c, S)
    return S_end, S

  S_T, starts = jax.lax.scan(body, S0, tuple(_chunk_first(x) for x in (ds, M, b)))
  return jnp.moveaxis(starts, 0, 2), S_T


def _scan_values(ds, kd, U_tilde, W, S0) -> tuple[jax.Array, jax.Array, jax.Array]:
  r"""The delta rules' scan over chunks as flash-linear-attention's chunk kernels run it:
  each chunk's written values ``U = \tilde U - W S`` and end state
  ``e^{G_C} S + \bar K^T U`` in the step (two ``[C, K] x [K, V]`` products per chunk, no
  ``[K, K]`` map ``\bar K^T W`` formed). Returns the chunk-start states, ``U`` (both
  ``[B, N, nC, ...]``) and the final state."""
  def body(S, x):
    ds_c, kd_c, ut_c, w_c = x
    U_c = ut_c - jnp.einsum("bnck,bnkv->bncv", w_c, S)
    return S * ds_c[..., None] + jnp.einsum("bnck,bncv->bnkv", kd_c, U_c), (S, U_c)

  S_T, (starts, U) = jax.lax.scan(body, S0, tuple(_chunk_first(x) for x in (ds, kd, U_tilde, W)))
  return jnp.moveaxis(starts, 0, 2), jnp.moveaxis(U, 0, 2), S_T


def _chunked_plain(xs, rc, run_prev, S0):
  """The chunked form differentiated by autodiff (which keeps every chunk's terms)."""
  terms = _terms(xs, rc, run_prev)
  starts, S_T = _scan_starts(terms, S0)
  return _chunk_apply(terms, starts)[0], S_T


@jax.custom_vjp
def _chunked_recompute(xs, rc, run_prev, S0):
  """:func:`_chunked_plain` with a backward pass that recomputes chunk by chunk (K07)."""
  return _chunked_plain(xs, rc, run_prev, S0)


def _chunked_recompute_fwd(xs, rc, run_prev, S0):
  qd, kd, ds, P, Kb, Vb, A = _parts_of(xs, rc, run_prev)
  if A is None:
    U, wy = Vb, None
    starts, S_T = _scan_starts((qd, kd, ds, P, U, None), S0)
  else:
    T_inv = unit_lower_inverse(A)                                      # (I + A)^{-1}
    U_tilde, W = T_inv @ Vb, T_inv @ Kb
    starts, U, S_T = _scan_values(ds, kd, U_tilde, W, S0)
    # Residuals: the inputs, the chunk-start states and, for the delta rules, the UT
    # transform (its inverse and the WY factors W, U_tilde) and the written values U:
    # O(T·(K + 2V + C)) numbers. The scores and the decays are recomputed in the backward
    # pass, for all chunks at once.
    wy = (T_inv, U_tilde, W, U)
  return (_chunk_out(qd, kd, ds, P, U, starts)[0], S_T), (xs, rc, run_prev, starts, wy)


def _chunked_recompute_bwd(res, cts):
  r"""The backward pass from the inputs, the chunk-start states and (delta rules) the UT
  transform: every chunk's scores and decays are rebuilt at once (batched over chunks, as in
  the forward pass), a reverse scan over the chunks carries only the state cotangent
  ``dS [K, V]``,

  .. math::
    dU_c = P_c^\top dO_c + \bar K_c dS_{c+1}, \qquad
    dS_c = \bar Q_c^\top dO_c + e^{G_C} dS_{c+1} - W_c^\top dU_c

  (``\bar Q = e^G Q``, ``\bar K = e^{G_C - G} K``; no ``W`` term without ``beta``), and the
  chunk terms' cotangents then follow for all chunks at once from ``jax.vjp`` of the
  chunk-local computation against ``(dO_c, dS_{c+1})`` (the recomputing backward of
  Lightning Attention and of flash-linear-attention's chunk kernels). The UT transform
  ``W = X β e^G K``, ``\tilde U = X β V`` with ``X = (I + A)^{-1}`` is differentiated by
  hand from the saved ``X, W, \tilde U``, as flash-linear-attention's gated delta rule does:

  .. math::
    d(β e^G K) = X^\top dW, \quad d(β V) = X^\top d\tilde U, \quad
    dA = -(d(β V)\, \tilde U^\top + d(β e^G K)\, W^\top)

  (``dA = -X^T dX X^T`` with ``dX = dW (β e^G K)^T + d\tilde U (β V)^T``; only its strictly
  lower entries reach the inputs, ``A`` being masked there), four products instead of
  rebuilding ``X`` and differentiating through it."""
  xs, rc, run_prev, starts, wy = res
  do, dS_T = cts
  parts, parts_vjp = jax.vjp(lambda xs: _parts_of(xs, rc, run_prev), xs)
  qd, kd, ds, P, _, Vb, _ = parts
  T_inv, U_tilde, W, U = (None, Vb, None, Vb) if wy is None else wy
  # the parts of dS_c that do not depend on dS_{c+1}, for all chunks at once
  dS_q = jnp.einsum("...ck,...cv->...kv", qd, do)
  if wy is None:
    def body(dS, x):   # dS_c = \bar Q_c^T dO_c + e^{G_C} dS_{c+1}
      ds_c, dsq_c = x
      return dsq_c + ds_c[..., None] * dS, dS

    dS0, d_ends = jax.lax.scan(body, dS_T, tuple(_chunk_first(x) for x in (ds, dS_q)),
                               reverse=True)
  else:
    PtdO = jnp.einsum("...ij,...iv->...jv", P, do)

    def body(dS, x):   # dU_c = P_c^T dO_c + \bar K_c dS_{c+1}, then dS_c
      ds_c, kd_c, w_c, ptdo_c, dsq_c = x
      dU_c = ptdo_c + jnp.einsum("bnck,bnkv->bncv", kd_c, dS)
      dS_start = dsq_c + ds_c[..., None] * dS - jnp.einsum("bnck,bncv->bnkv", w_c, dU_c)
      return dS_start, (dS, dU_c)

    dS0, (d_ends, dU) = jax.lax.scan(
        body, dS_T, tuple(_chunk_first(x) for x in (ds, kd, W, PtdO, dS_q)), reverse=True)
  _, out_vjp = jax.vjp(_chunk_out, qd, kd, ds, P, U, starts)
  dqd, dkd, dds, dP, dU_out, _ = out_vjp((do, jnp.moveaxis(d_ends, 0, 2)))
  dparts: tuple[Any, ...]
  if wy is None:
    dparts = (dqd, dkd, dds, dP, None, dU_out, None)
  else:
    dU_tilde = jnp.moveaxis(dU, 0, 2)                                  # the scan's dU
    dW = -jnp.einsum("...cv,...kv->...ck", dU_tilde, starts)           # U = U_tilde - W S
    dKb = jnp.einsum("...ji,...jk->...ik", T_inv, dW)                  # X^T dW
    dVb = jnp.einsum("...ji,...jv->...iv", T_inv, dU_tilde)            # X^T dU_tilde
    dA = -(jnp.einsum("...iv,...jv->...ij", dVb, U_tilde)
           + jnp.einsum("...ik,...jk->...ij", dKb, W))
    dparts = (dqd, dkd, dds, dP, dKb, dVb, dA)
  (dxs,) = parts_vjp(dparts)
  return dxs, None, None, dS0


_chunked_recompute.defvjp(_chunked_recompute_fwd, _chunked_recompute_bwd)


def chunked(q, k, v, g, beta, run, S0, chunk: int,
            recompute: bool = True) -> tuple[jax.Array, jax.Array]:
  """The chunked form (see the module docstring). Returns ``(o [B, N, T, V], S_T)``.

  ``recompute=True`` (the chunked form, K07) differentiates with a custom VJP that keeps
  only the inputs and the chunk-start states and rebuilds each chunk's terms in a reverse
  scan; ``False`` (the parallel form: one chunk) leaves the backward pass to autodiff.
  """
  B, N, T, K = q.shape
  C = chunk
  pad = (-T) % C
  q, k, v = (_chunk.pad_time(x, 2, pad) for x in (q, k, v))
  g = jnp.zeros_like(q[..., 0]) if g is None else _chunk.pad_time(g, 2, pad)
  run = _chunk.pad_time(run, 1, pad, mode="edge")
  bc = None if beta is None else _chunk.to_chunks(_chunk.pad_time(beta, 2, pad), 2, C)
  xs = tuple(_chunk.to_chunks(x, 2, C) for x in (q, k, v, g)) + (bc,)  # [B, N, nC, C, ...]
  rc = _chunk.to_chunks(run, 1, C)                                     # [B, nC, C]
  run_prev = jnp.concatenate([rc[:, :1, 0], rc[:, :-1, -1]], axis=1)   # run before each chunk
  o, S_T = (_chunked_recompute if recompute else _chunked_plain)(xs, rc, run_prev, S0)
  return _chunk.from_chunks(o, 2)[:, :, :T], S_T
