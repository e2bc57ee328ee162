"""Tier-3 attention rows (features A19, A22, A25), each a reconstruction from its paper.

* A19 :func:`multiscreen_attention`: Multiscreen screening attention, cosine similarities
  screened against an absolute threshold (the N38 ``multiscreen`` normalizer), no
  competition between keys.
* A22 :func:`uniattn_shared_map` and :func:`uniattn`: UniAttn, one attention map computed
  once and reused by the later blocks of a superblock, plus a linear compensation.
* A25 :func:`infsa_attention`: Infinite Self-Attention, the Neumann series
  :math:`\\sum_{t \\ge 1} \\gamma^t A^t V = ((I - \\gamma A)^{-1} - I) V`, truncated or solved.

All three are dense (O(T·S) memory per head): the references the papers' faster forms
would be checked against.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from jaxsoft._validation import concrete as _concrete
from jaxsoft.attention._api import dot_product_attention
from jaxsoft.attention._dense import dense_logits
from jaxsoft.attention._variants import per_head
from jaxsoft.attention.call import AttentionCall
from jaxsoft.normalizers import spec as _spec
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["multiscreen_attention", "uniattn_shared_map", "uniattn", "infsa_attention"]

_HI = lax.Precision.HIGHEST


def _check_4d(t, name: str, layout: str, fn: str):
  t = jnp.asarray(t)
  if t.ndim != 4:
    raise ValueError(f"{fn}: `{name}` must have shape {layout}, got {t.shape}")
  return t


def _attention_map(fn: str, query, key, bias, mask, kwargs: dict[str, Any]) -> jax.Array:
  """The dense weights [B, N, T, S] that ``dot_product_attention`` would apply (float32,
  float64 for float64 inputs): same validation, masks, GQA and normalizers."""
  q = _check_4d(query, "query", "[B, T, N, H]", fn)
  k = _check_4d(key, "key", "[B, S, K, H]", fn)
  allowed = {"scale", "is_causal", "query_seq_lengths", "key_value_seq_lengths",
             "local_window_size", "segment_ids", "logits_soft_cap", "normalizer",
             "normalizer_params", "decay_bias"}
  for name in kwargs:
    if name not in allowed:
      raise ValueError(f"{fn}: unexpected argument `{name}`")
  dummy_v = jnp.zeros(k.shape[:3] + (1,), jnp.float32)
  call = AttentionCall.create(q, k, dummy_v, bias=bias, mask=mask, **kwargs)
  logits = dense_logits(call.q, call.k, scale=call.scale, decay_bias=call.decay_bias,
                        logits_soft_cap=call.logits_soft_cap, bias=call.bias)
  visible = jnp.broadcast_to(call.structure.dense(), logits.shape)
  if call.mask is not None:
    visible = visible & call.mask
  weights = call.normalize_fn()(logits, visible).astype(logits.dtype)
  return jnp.where(visible, weights, 0.0)  # exact zeros off the visible set


# ------------------------------------------------------------------------------- A19


def multiscreen_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                          bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                          theta: ArrayLike = 0.0, power: ArrayLike = 1.0, eps: float = 1e-6,
                          **kwargs: Any) -> jax.Array:
  r"""Multiscreen screening attention (feature A19; K. M. Nakanishi 2026) [R].

  From "Screening Is Enough" (K. M. Nakanishi, 2026, arXiv 2604.01178): each key is judged
  against an explicit threshold on a *bounded* query-key similarity; keys below it are
  discarded and the rest aggregated, with no competition between keys and no unit mass to
  redistribute. The paper's exact map is not established; this is the reconstruction:

  .. math::
    s_{ij} = \frac{q_i \cdot k_j}{\|q_i\|\,\|k_j\|} \in [-1, 1], \qquad
    w_{ij} = \mathrm{clip}\Big(\frac{s_{ij} - \theta}{1 - \theta}, 0, 1\Big)^{p}, \qquad
    o_i = \sum_{j \in V_i} w_{ij}\, v_j

  i.e. :func:`dot_product_attention` with unit-norm queries and keys, ``scale=1`` and the
  N38 ``multiscreen`` normalizer in the attention slot. Weights lie in [0, 1]; a key below
  the threshold has weight exactly 0, so appending such keys leaves the output unchanged
  (softmax fails this) and a query with no key above it outputs 0. No normalisation by
  the other keys' weights is applied (the paper may use one that does not involve them).

  Args:
    query: [B, T, N, H]; key: [B, S, K, H]; value: [B, S, K, Hv] (GQA when N % K == 0).
    bias, mask: as :func:`dot_product_attention` (a bias is added to the cosine
      similarity; similarities above 1 then count as 1).
    theta: the threshold in [-1, 1), a scalar or per head ``[N]``; differentiable.
    power: the sharpness p > 0, a scalar or per head ``[N]``.
    eps: the floor of the norms (a zero query or key has similarity 0 with everything).
    **kwargs: the other arguments of :func:`dot_product_attention` (``is_causal``, the
      sequence lengths, ``local_window_size``, ``segment_ids``, ``implementation``, ...),
      except ``scale``, ``normalizer`` and ``normalizer_params``, which this fixes.

  Returns:
    [B, T, N, Hv] in query's dtype.
  """
  fn = "multiscreen_attention"
  for name in ("scale", "normalizer", "normalizer_params", "logits_soft_cap"):
    if name in kwargs:
      raise ValueError(f"{fn}: `{name}` is fixed by the screening rule and cannot be passed")
  q = _check_4d(query, "query", "[B, T, N, H]", fn)
  k = _check_4d(key, "key", "[B, S, K, H]", fn)
  if not float(eps) > 0:
    raise ValueError(f"{fn}: `eps` must be > 0, got {eps!r}")
  n_heads = q.shape[2]
  th = _concrete(theta)
  if th is not None and (np.any(~np.isfinite(th)) or np.any(th < -1) or np.any(th >= 1)):
    raise ValueError(f"{fn}: `theta` must be in [-1, 1), got {theta!r}")
  pw = _concrete(power)
  if pw is not None and (np.any(~np.isfinite(pw)) or np.any(pw <= 0)):
    raise ValueError(f"{fn}: `power` must be finite and > 0, got {power!r}")
  params = {"theta": per_head(theta, n_heads, "theta", fn),
            "power": per_head(power, n_heads, "power", fn)}
  out_dtype = q.dtype if jnp.issubdtype(q.dtype, jnp.floating) else jnp.float32
  cdt = compute_dtype(jnp.promote_types(q.dtype, k.dtype))

  def unit(x):
    x = x.astype(cdt)
    return x * lax.rsqrt(jnp.maximum(jnp.sum(x * x, -1, keepdims=True), eps * eps))

  out = dot_product_attention(unit(q), unit(k), value, bias, mask, scale=1.0,
                              normalizer="multiscreen", normalizer_params=params, **kwargs)
  return out.astype(out_dtype)


# ------------------------------------------------------------------------------- A22


def uniattn_shared_map(query: ArrayLike, key: ArrayLike, bias: ArrayLike | None = None,
                       mask: ArrayLike | None = None, **kwargs: Any) -> jax.Array:
  r"""The attention map a UniAttn superblock computes once (feature A22) [R].

  .. math:: A = f\big(s\, Q K^\top + \mathrm{bias}\big) \text{ over the visible keys}

  the dense weights :func:`dot_product_attention` would apply (softmax by default: rows
  with a visible key sum to 1), for the first block of a superblock; :func:`uniattn`
  applies it to the values of every block.

  Args:
    query: [B, T, N, H]; key: [B, S, K, H] (GQA when N % K == 0).
    bias, mask: as :func:`dot_product_attention`.
    **kwargs: ``scale``, ``is_causal``, the sequence lengths, ``local_window_size``,
      ``segment_ids``, ``logits_soft_cap``, ``normalizer``, ``normalizer_params``,
      ``decay_bias``, as :func:`dot_product_attention`.

  Returns:
    [B, N, T, S] in float32 (float64 for float64 inputs); exact zeros off the visible set.
  """
  return _attention_map("uniattn_shared_map", query, key, bias, mask, kwargs)


def uniattn(attn_map: ArrayLike, values: ArrayLike, x: ArrayLike | None = None,
            w_c: ArrayLike | None = None) -> jax.Array:
  r"""UniAttn: one shared attention map applied to several blocks' values (feature A22) [R].

  Consecutive transformer blocks form a superblock; the softmax map A of its first block
  (:func:`uniattn_shared_map`) is reused by every block l, and a linear projection
  compensates the error of the reuse:

  .. math:: o_l = A\, V_l + X_l W_{c,l}

  so the later blocks need neither keys (no K cache) nor a softmax. With the same queries
  and keys in every block and :math:`W_c = 0` it is exact. From Y. Xiong et al.,
  "UniAttn: Reducing Inference Costs via Softmax Unification for Post-Training LLMs"
  (2025, arXiv 2502.00439). [R] The compensation is written as one matrix per block from
  that block's input X_l to its attention output; the paper's exact placement is not
  established.

  Args:
    attn_map: A [B, N, T, S] (e.g. from :func:`uniattn_shared_map`); differentiable.
    values: [L, B, S, K, Hv] (L blocks) or [B, S, K, Hv] (one block); N % K == 0 (GQA:
      query head n reads value head n // (N / K)).
    x: optional block inputs [L, B, T, C] (or [B, T, C] for 4-D ``values``).
    w_c: optional compensation [L, C, N, Hv] (or [C, N, Hv]); given with ``x``.

  Returns:
    [L, B, T, N, Hv] (or [B, T, N, Hv]) in the values' dtype (float32 inside).
  """
  fn = "uniattn"
  a = _check_4d(attn_map, "attn_map", "[B, N, T, S]", fn)
  v = jnp.asarray(values)
  if v.ndim not in (4, 5):
    raise ValueError(f"{fn}: `values` must have shape [L, B, S, K, Hv] or [B, S, K, Hv], "
                     f"got {v.shape}")
  single = v.ndim == 4
  if single:
    v = v[None]
  L, B, S, K, Hv = v.shape
  if a.shape[0] != B or a.shape[3] != S:
    raise ValueError(f"{fn}: `attn_map` must have shape [B, N, T, S] = [{B}, N, T, {S}] to "
                     f"match `values`, got {a.shape}")
  N, T = a.shape[1], a.shape[2]
  if K == 0 or N % K:
    raise ValueError(f"{fn}: `values` heads K={K} must divide the map's heads N={N}")
  if (x is None) != (w_c is None):
    raise ValueError(f"{fn}: `x` and `w_c` must be given together (got only "
                     f"`{'x' if w_c is None else 'w_c'}`)")
  out_dtype = v.dtype if jnp.issubdtype(v.dtype, jnp.floating) else jnp.float32
  cdt = compute_dtype(jnp.promote_types(a.dtype, v.dtype))
  ag = a.astype(cdt).reshape(B, K, N // K, T, S)
  out = jnp.einsum("bkgts,lbskh->lbtkgh", ag, v.astype(cdt), precision=_HI)
  out = out.reshape(L, B, T, N, Hv)
  if x is not None:
    xa, wa = jnp.asarray(x), jnp.asarray(w_c)
    x_shape, w_shape = xa.shape, wa.shape
    if single:
      xa, wa = xa[None], wa[None]
    if xa.ndim != 4 or xa.shape[:3] != (L, B, T):
      lay = "[B, T, C]" if single else "[L, B, T, C]"
      raise ValueError(f"{fn}: `x` must have shape {lay} with L={L}, B={B}, T={T}, got "
                       f"{x_shape}")
    C = xa.shape[3]
    if wa.shape != (L, C, N, Hv):
      lay = f"[C, N, Hv] = [{C}, {N}, {Hv}]" if single else f"[L, C, N, Hv] = [{L}, {C}, {N}, {Hv}]"
      raise ValueError(f"{fn}: `w_c` must have shape {lay}, got {w_shape}")
    out = out + jnp.einsum("lbtc,lcnh->lbtnh", xa.astype(cdt), wa.astype(cdt), precision=_HI)
  out = out.astype(out_dtype)
  return out[0] if single else out


# ------------------------------------------------------------------------------- A25



def infsa_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                    bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                    gamma: ArrayLike, terms: int | None = None, normalize: bool = False,
                    **kwargs: Any) -> jax.Array:
  r"""Infinite Self-Attention: attention propagated along all walks of the token graph (A25) [R].

  With A the dense self-attention map, the discounted Neumann (Katz / PageRank) kernel sums
  the walks of every length t >= 1:

  .. math::
    O = \sum_{t=1}^{\infty} \gamma^{t} A^t V = \big((I - \gamma A)^{-1} - I\big) V
      = \gamma\, (I - \gamma A)^{-1} A V, \qquad
    O_{\text{terms}} = \sum_{t=1}^{\text{terms}} \gamma^{t} A^t V

  The series converges when the spectral radius :math:`\rho(\gamma A) < 1`; for a
  normalizer whose rows sum to at most 1 (softmax, sparsemax, ...) :math:`|\gamma| < 1`
  suffices, and the truncation error is then at most
  :math:`|\gamma|^{\text{terms}+1} / (1 - |\gamma|) \max|V|`. With ``normalize`` the kernel
  is :math:`(1 - \gamma)(I - \gamma A)^{-1} A` instead (the same kernel times
  :math:`(1-\gamma)/\gamma`): for a row-stochastic A it is row-stochastic too (outputs are
  convex combinations of values), and ``gamma=0`` is plain attention :math:`A V`. A causal
  A is lower triangular and so are its powers and the inverse: the result stays causal.
  GQA: each query head propagates along its own map, starting from its key/value head's
  values.

  From G. Roffo et al., "Self-Attention And Beyond the Infinite: Towards Linear
  Transformers with Infinite Self-Attention" (2026, arXiv 2603.00175). [R] The paper sums
  the series across layers on a ReLU, Frobenius-normalised map (pass such a normalizer to
  match its base); here the series of its kernel :math:`(I - \gamma A)^{-1} - I` is applied
  to one map (softmax by default), truncated or solved exactly. Linear-InfSA (the principal
  eigenvector form) is not reproduced.

  Args:
    query: [B, T, N, H]; key: [B, T, K, H]; value: [B, T, K, Hv] (self-attention: S = T).
    bias, mask: as :func:`dot_product_attention`.
    gamma: the discount, a scalar or per head ``[N]`` (differentiable, e.g. a learned
      ``sigmoid`` of a free parameter) with :math:`\rho(\gamma A) < 1`: |gamma| < 1 for a
      normalizer whose rows sum to at most 1; for any other normalizer (or a callable)
      :math:`|\gamma| \rho(A) < 1`. Both are checked when the values are concrete (not
      under jit or grad, where an invalid gamma gives a meaningless result).
    terms: the number of powers of A summed (an int >= 1), or None for the exact solve
      with ``jnp.linalg.solve`` (O(T^3) per head).
    normalize: use the row-stochastic kernel :math:`(1-\gamma)(I - \gamma A)^{-1} A`.
    **kwargs: ``scale``, ``is_causal``, the sequence lengths, ``local_window_size``,
      ``segment_ids``, ``logits_soft_cap``, ``normalizer``, ``normalizer_params``,
      ``decay_bias``, as :func:`dot_product_attention`.

  Returns:
    [B, T, N, Hv] in query's dtype (float32 inside).
  """
  fn = "infsa_attention"
  q = _check_4d(query, "query", "[B, T, N, H]", fn)
  v = _check_4d(value, "value", "[B, T, K, Hv]", fn)
  if isinstance(gamma, bool):
    raise ValueError(f"{fn}: `gamma` must be a float or a per-head array, got {gamma!r}")
  g = per_head(gamma, q.shape[2], "gamma", fn)  # [] or [N, 1, 1]
  g_np = _concrete(g)
  if g_np is not None and not np.all(np.isfinite(g_np)):
    raise ValueError(f"{fn}: `gamma` must be finite, got {gamma!r}")
  if terms is not None and (isinstance(terms, bool) or not isinstance(terms, numbers.Integral)
                            or terms < 1):
    raise ValueError(f"{fn}: `terms` must be an int >= 1 or None, got {terms!r}")
  if not isinstance(normalize, (bool, np.bool_)):
    raise ValueError(f"{fn}: `normalize` must be a bool, got {normalize!r}")
  spec = _spec.resolve(kwargs.get("normalizer", "softmax"))
  bounded = isinstance(spec, _spec.NormalizerSpec) and spec.at_most_one
  if bounded and g_np is not None and not np.all(np.abs(g_np) < 1):
    raise ValueError(f"{fn}: `gamma` must satisfy |gamma| < 1 (spectral radius of gamma*A "
                     f"below 1 for rows summing to at most 1), got {gamma!r}")
  a = _attention_map(fn, query, key, bias, mask, kwargs)  # [B, N, T, S]
  B, N, T, S = a.shape
  if S != T:
    raise ValueError(f"{fn}: `key` must have the queries' length T={T} (self-attention), "
                     f"got S={S}")
  if not bounded:
    a_np = _concrete(a)
    if a_np is not None and g_np is not None and a_np.size:
      rho = np.max(np.abs(np.linalg.eigvals(np.asarray(a_np, np.float64))), axis=(0, 2))  # [N]
      if not np.all(np.abs(g_np).reshape(-1) * rho < 1):
        raise ValueError(f"{fn}: `gamma` must satisfy |gamma| * rho(A) < 1 for convergence; "
                         f"rho(A) per head = {np.round(rho, 4).tolist()}, got gamma = {gamma!r}")
  g = g.astype(a.dtype)
  K = v.shape[2]
  cdt = a.dtype
  vn = jnp.repeat(v.astype(cdt), N // K, axis=2)  # query head n reads value head n // G
  vn = jnp.transpose(vn, (0, 2, 1, 3))  # [B, N, T, Hv]

  def apply(y):
    return jnp.einsum("bnts,bnsh->bnth", a, y, precision=_HI)

  first = apply(vn)
  if terms is None:  # sum_{t>=1} gamma^(t-1) A^t V = (I - gamma A)^-1 A V
    base = jnp.linalg.solve(jnp.eye(T, dtype=cdt) - g * a, first)
  else:
    def step(_, carry):
      total, power = carry
      power = g * apply(power)
      return total + power, power

    base, _ = lax.fori_loop(1, int(terms), step, (first, first))
  out = ((1.0 - g) if normalize else g) * base
  out_dtype = q.dtype if jnp.issubdtype(q.dtype, jnp.floating) else jnp.float32
  return jnp.transpose(out, (0, 2, 1, 3)).astype(out_dtype)
