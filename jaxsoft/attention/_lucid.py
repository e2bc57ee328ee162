"""LUCID attention (feature A14): causal softmax attention on preconditioned values."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxsoft.attention._api import dot_product_attention
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["lucid_attention", "lucid_preconditioned_values"]


@jax.custom_vjp
def _unit_lower_solve(lower, rhs):
  """X with ``tril(lower) X = rhs`` (unit diagonal; batched over leading dims)."""
  return lax.linalg.triangular_solve(lower, rhs, left_side=True, lower=True, unit_diagonal=True)


def _unit_lower_solve_fwd(lower, rhs):
  x = _unit_lower_solve(lower, rhs)
  return x, (lower, x)


def _unit_lower_solve_bwd(res, dx):
  # The adjoint of X = L^{-1} B: dB = L^{-T} dX (one more triangular solve, transposed) and
  # dL = -dB X^T restricted to the strictly lower triangle (the unit diagonal is fixed).
  lower, x = res
  drhs = lax.linalg.triangular_solve(lower, dx, left_side=True, lower=True, transpose_a=True,
                                     unit_diagonal=True)
  dlower = -jnp.tril(jnp.einsum("...ih,...jh->...ij", drhs, x), k=-1)
  return dlower, drhs


_unit_lower_solve.defvjp(_unit_lower_solve_fwd, _unit_lower_solve_bwd)


def _rms_normalize(k, eps: float):
  return k * lax.rsqrt(jnp.mean(k * k, axis=-1, keepdims=True) + eps)


def lucid_preconditioned_values(key: ArrayLike, value: ArrayLike, *,
                                key_scale: float | None = None) -> jax.Array:
  r"""LUCID's preconditioned values: ``Y = tril(exp(K K^T / s))^{-1} V`` (feature A14).

  Per batch and key/value head.

  Computed as a unit-lower-triangular solve: with :math:`g_{ij} = k_i \cdot k_j / s`,
  :math:`\mathrm{tril}(e^{g}) = D L'` where :math:`D = \mathrm{diag}(e^{g_{ii}})` and
  :math:`L'_{ij} = e^{g_{ij} - g_{ii}}` (j <= i), so :math:`Y = L'^{-1} D^{-1} V`; for keys
  of equal norm (RMS-normalised) every entry of L' is at most 1 (no overflow). The
  gradient is the solve's adjoint (one transposed triangular solve), not autodiff through
  the solver.

  Args:
    key: [B, S, K, H] (already normalised as the caller wants).
    value: [B, S, K, Hv].
    key_scale: s > 0; None = sqrt(H).

  Returns:
    [B, S, K, Hv] in float32 (float64 for float64 inputs).

  Examples:
    Three copies of one key and value: the solve gives all the mass to the first copy
    (:math:`e^{-|k|^2/s}` of it) and none to the duplicates.

    >>> key = jnp.ones((1, 3, 1, 2))     # [B, S, K, H]
    >>> value = jnp.ones((1, 3, 1, 1))
    >>> js.attention.lucid_preconditioned_values(key, value)[0, :, 0, 0]
    Array([0.2431, 0.    , 0.    ], dtype=float32)

  References:
    S. S. Duvvuri, N. Patel, N. Gupta & I. S. Dhillon, 2026, "LUCID: Attention with
    Preconditioned Representations" (arXiv 2602.10410).
  """
  k, v = jnp.asarray(key), jnp.asarray(value)
  cdt = compute_dtype(jnp.promote_types(k.dtype, v.dtype))
  s = jnp.sqrt(jnp.asarray(k.shape[-1], cdt)) if key_scale is None else key_scale
  kt = jnp.transpose(k.astype(cdt), (0, 2, 1, 3))  # [B, K, S, H]
  vt = jnp.transpose(v.astype(cdt), (0, 2, 1, 3))
  g = jnp.einsum("bkih,bkjh->bkij", kt, kt) / s
  diag = jnp.diagonal(g, axis1=-2, axis2=-1)  # [B, K, S]
  tril = jnp.tril(jnp.ones(g.shape[-2:], bool))
  # exp only where j <= i (the upper part is never read, and must not overflow)
  lower = jnp.where(tril, jnp.exp(jnp.where(tril, g - diag[..., :, None], 0.0)), 0.0)
  y = _unit_lower_solve(lower, jnp.exp(-diag)[..., None] * vt)
  return jnp.transpose(y, (0, 2, 1, 3))


def lucid_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike, *,
                    scale: float | None = None, key_scale: float | None = None,
                    normalize_keys: bool = True, eps: float = 1e-6,
                    implementation: str | Sequence[str] | None = None) -> jax.Array:
  r"""LUCID attention: causal softmax attention on key-decorrelated values (feature A14).

  .. math::
    O = \mathrm{softmax}_{\mathrm{causal}}\!\big(s_q\, Q \hat K^\top\big)\;
        \big(M \circ \exp(\hat K \hat K^\top / s_k)\big)^{-1} V

  with M the lower-triangular causal mask, :math:`\hat K = \mathrm{RMSNorm}(K)`
  (``normalize_keys``; no learned gain), :math:`s_q` = ``scale`` (default 1/sqrt(H)) and
  :math:`s_k` = ``key_scale`` (default sqrt(H)). The preconditioner is lower triangular, so
  the layer stays causal; it solves the kernel least-squares problem in the RKHS of
  :math:`\exp(\langle\cdot,\cdot\rangle)` instead of Nadaraya-Watson averaging, which
  cancels the mass of duplicated keys. Cost O(T^2 (H + Hv)), like attention; the solve is
  :func:`lucid_preconditioned_values` (a unit-triangular solve with its adjoint as the
  gradient) and the attention is :func:`dot_product_attention` (``implementation`` is
  passed on).

  From S. S. Duvvuri, N. Patel, N. Gupta, I. S. Dhillon, "LUCID: Attention with
  Preconditioned Representations" (2026, arXiv 2602.10410). [R] The placement of the RMS
  normalisation (here on the keys of both the logits and the preconditioner) and the kernel
  scale are reconstructions; the preconditioner ``(M ∘ exp(K K^T))^{-1}`` and the
  triangular solve are the authors'.

  Args:
    query: [B, T, N, H]; key: [B, T, K, H]; value: [B, T, K, Hv] (self-attention; GQA:
      the preconditioner is per key/value head).
    scale: logit scale; key_scale: the preconditioner's kernel scale (> 0).
    normalize_keys: RMS-normalise the keys first (recommended: then every entry of the
      scaled triangular factor is <= 1).
    eps: the RMS norm's epsilon.
    implementation: of the attention step (see :func:`dot_product_attention`).

  Returns:
    [B, T, N, Hv] in query's dtype (computed in float32 at least; the solve always in float32 or
    float64). Differentiable in query, key and value.

  Examples:
    Causal: changing the last token leaves the earlier outputs as they were.

    >>> q = jnp.sin(jnp.arange(64.0)).reshape(1, 4, 2, 8)   # [B, T, N, H]
    >>> k, v = jnp.cos(q), q
    >>> out = js.attention.lucid_attention(q, k, v)
    >>> out.shape
    (1, 4, 2, 8)
    >>> changed = js.attention.lucid_attention(q, k.at[:, 3].set(1.0), v.at[:, 3].set(1.0))
    >>> bool(jnp.allclose(changed[:, :3], out[:, :3], atol=1e-6))
    True

  References:
    S. S. Duvvuri, N. Patel, N. Gupta & I. S. Dhillon, 2026, "LUCID: Attention with
    Preconditioned Representations" (arXiv 2602.10410).
  """
  fn = "lucid_attention"
  q, k, v = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
  for t, name in ((q, "query"), (k, "key"), (v, "value")):
    if t.ndim != 4:
      raise ValueError(f"{fn}: `{name}` must have shape [B, T, heads, H], got {t.shape}")
  if q.shape[1] != k.shape[1]:
    raise ValueError(
        f"{fn}: LUCID is causal self-attention: `query` and `key` need the same length, got "
        f"{q.shape[1]} and {k.shape[1]}")
  if v.shape[:3] != k.shape[:3]:
    raise ValueError(f"{fn}: `value` {v.shape} must match `key` {k.shape} in [B, T, K]")
  if key_scale is not None and not float(key_scale) > 0:
    raise ValueError(f"{fn}: `key_scale` must be > 0, got {key_scale!r}")
  if not float(eps) > 0:
    raise ValueError(f"{fn}: `eps` must be > 0, got {eps!r}")
  cdt = compute_dtype(k.dtype)
  kh = _rms_normalize(k.astype(cdt), eps) if normalize_keys else k.astype(cdt)
  y = lucid_preconditioned_values(kh, v, key_scale=key_scale)
  out = dot_product_attention(q, kh, y, scale=scale, is_causal=True,
                              implementation=implementation)
  return out.astype(q.dtype)
