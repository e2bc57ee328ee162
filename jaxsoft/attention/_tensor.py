"""Tensor (triple-wise) attention (feature A24): each query attends to pairs of keys.

Dense (every pair of keys) or, for bounded entries, the polynomial method: ``exp`` replaced by
its Taylor polynomial, which factors the T x S^2 weight matrix into low-rank factors
(near-linear time in the sequence length).
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from jaxsoft.attention._checks import check_rank
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["tensor_attention"]

_HI = lax.Precision.HIGHEST
_IMPLEMENTATIONS = ("dense", "polynomial")


@functools.cache
def _monomials(H: int, degree: int) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
  """Per degree m <= degree: the monomials of degree m in H variables, as index lists
  ``[r_m, m]`` (h_1 <= ... <= h_m), and their Taylor-multinomial weights ``1 / alpha!``
  (``(x.y.z)^m / m! = sum_alpha x^alpha y^alpha z^alpha / alpha!`` over the exponent
  vectors alpha with ``|alpha| = m``)."""
  out = []
  for m in range(degree + 1):
    combos = list(itertools.combinations_with_replacement(range(H), m))
    idx = np.array(combos, np.int32).reshape(len(combos), m)
    counts = [np.bincount(row, minlength=H) for row in idx] if m else [np.zeros(H, int)]
    w = np.array([1.0 / math.prod(math.factorial(int(c)) for c in cnt) for cnt in counts])
    out.append((idx, w))
  return tuple(out)


def _features(x: jax.Array, degree: int, weighted: bool) -> jax.Array:
  """[..., H] -> [..., r]: the monomials x^alpha, |alpha| <= degree (times 1/alpha! when
  ``weighted``), r = C(H + degree, degree)."""
  parts = []
  for idx, w in _monomials(x.shape[-1], degree):
    f = (jnp.ones(x.shape[:-1] + (1,), x.dtype) if idx.shape[1] == 0
         else jnp.prod(x[..., jnp.asarray(idx)], axis=-1))
    wf = jnp.asarray(w, x.dtype).reshape((1,) * (f.ndim - 1) + (-1,))  # f's rank: no promotion
    parts.append(f * wf if weighted else f)
  return jnp.concatenate(parts, axis=-1)


def _polynomial(q, k1, k2, v1, v2, s, degree, is_causal):
  """sum_{j,k} P(l_ijk) (v1_j * v2_k) / sum_{j,k} P(l_ijk), P the Taylor polynomial of exp,
  through the factorisation P(l_ijk) = sum_r U_ir W1_jr W2_kr (no pair is formed)."""
  u = _features(s * q, degree, weighted=True)  # [B, T, N, r]
  w1, w2 = _features(k1, degree, False), _features(k2, degree, False)  # [B, S, N, r]
  if not is_causal:
    m1 = jnp.einsum("bjnr,bjnh->bnrh", w1, v1, precision=_HI)
    m2 = jnp.einsum("bknr,bknh->bnrh", w2, v2, precision=_HI)
    num = jnp.einsum("binr,bnrh->binh", u, m1 * m2, precision=_HI)
    den = jnp.einsum("binr,bnr->bin", u, jnp.sum(w1, 1) * jnp.sum(w2, 1), precision=_HI)
  else:  # prefix sums over the keys: query i reads the sums over j, k <= i
    T, S = q.shape[1], k1.shape[1]
    rows = jnp.minimum(jnp.arange(T), S - 1)
    m1 = jnp.cumsum(w1[..., None] * v1[..., None, :], axis=1)[:, rows]  # [B, T, N, r, Hv]
    m2 = jnp.cumsum(w2[..., None] * v2[..., None, :], axis=1)[:, rows]
    z = (jnp.cumsum(w1, 1) * jnp.cumsum(w2, 1))[:, rows]  # [B, T, N, r]
    num = jnp.einsum("binr,binrh->binh", u, m1 * m2, precision=_HI)
    den = jnp.einsum("binr,binr->bin", u, z, precision=_HI)
  return num / den[..., None]


def tensor_attention(query: ArrayLike, key1: ArrayLike, key2: ArrayLike, value1: ArrayLike,
                     value2: ArrayLike, *, scale: float | None = None,
                     is_causal: bool = False, implementation: str = "dense",
                     degree: int | None = None) -> jax.Array:
  r"""Tensor (triple-wise) attention: each query attends to pairs of keys (feature A24).

  .. math::
    \ell_{i,(j,k)} = s \sum_h q_{ih}\, k^{(1)}_{jh}\, k^{(2)}_{kh}, \qquad
    o_i = \sum_{j,k} \frac{e^{\ell_{i,(j,k)}}}{\sum_{j',k'} e^{\ell_{i,(j',k')}}}
          \big(v^{(1)}_j \odot v^{(2)}_k\big)

  i.e. :math:`D^{-1} \exp(Q (K_1 \oslash K_2)^\top)(V_1 \oslash V_2)` with the row-wise
  Kronecker product :math:`\oslash`. With ``key2`` and ``value2`` all ones it is standard
  softmax attention on (query, key1, value1). With ``is_causal`` query i sees the pairs
  with j <= i and k <= i. ``implementation="dense"``: every pair, O(T·S^2·H) time and
  O(T·S^2) memory per head.

  ``implementation="polynomial"`` is the paper's fast algorithm for bounded entries:
  ``exp`` is replaced by its Taylor polynomial :math:`P_g(x) = \sum_{m \le g} x^m / m!`
  of degree g = ``degree``, and since
  :math:`(\sum_h a_h b_h c_h)^m / m! = \sum_{|\alpha| = m} a^\alpha b^\alpha c^\alpha /
  \alpha!`, the weights factor as :math:`P_g(\ell_{i,(j,k)}) = \sum_r U_{ir} W^{(1)}_{jr}
  W^{(2)}_{kr}` with the :math:`r = \binom{H+g}{g}` monomials of degree <= g
  (:math:`U = (s q)^\alpha / \alpha!`, :math:`W^{(1)} = k_1^\alpha`,
  :math:`W^{(2)} = k_2^\alpha`). Then

  .. math::
    o_i = \frac{\sum_r U_{ir} \big(\sum_j W^{(1)}_{jr} v^{(1)}_j\big) \odot
                 \big(\sum_k W^{(2)}_{kr} v^{(2)}_k\big)}
               {\sum_r U_{ir} \big(\sum_j W^{(1)}_{jr}\big)\big(\sum_k W^{(2)}_{kr}\big)}

  in O((T + S)·r·Hv) time, no pair formed (causal: prefix sums over the keys,
  O(T·r·Hv) memory). Error bound: if every logit satisfies :math:`|\ell| \le B` (e.g.
  entries of q, k1, k2 bounded by b give :math:`B = s H b^3`), Taylor's remainder gives
  :math:`|P_g(\ell) - e^\ell| \le \varepsilon e^\ell` with
  :math:`\varepsilon = e^B B^{g+1} / (g+1)!`, and for :math:`\varepsilon < 1` every
  output entry is within

  .. math::
    |\tilde o_{ih} - o_{ih}| \le \frac{2\varepsilon}{1 - \varepsilon}
      \max_{j,k} |v^{(1)}_{jh} v^{(2)}_{kh}|

  of the dense one (the weights move by at most :math:`2\varepsilon/(1-\varepsilon)` in
  total). The error falls like :math:`B^{g+1}/(g+1)!` as g grows; the degree needed
  grows with B, which is the paper's point: near-linear time when the entries are
  :math:`o(\sqrt[3]{\log n})`, and no sub-cubic algorithm (under SETH) when they are
  :math:`\Omega(\sqrt[3]{\log n})`. Use an even degree: even Taylor polynomials of exp
  are positive everywhere, so the weights and denominators stay positive even past B.
  Rounding adds about :math:`\sqrt{r}` ulps (the sums over the r features) to the bound:
  ~1e-6 in float32 at r ~ 10^4.

  Args:
    query: [B, T, N, H]; key1, key2: [B, S, N, H]; value1, value2: [B, S, N, Hv].
    scale: s; None = 1/sqrt(H) (so that key2 = 1 reduces to dot_product_attention's
      default).
    is_causal: restrict the pairs to j, k <= i.
    implementation: ``"dense"`` (exact) or ``"polynomial"`` (the bounded-entry
      approximation above).
    degree: g, the Taylor degree of ``"polynomial"`` (an int >= 0, required there; an
      even one keeps the weights positive). The feature count r = C(H + g, g) grows fast
      with H: keep H and g small.

  Returns:
    [B, T, N, Hv] in query's dtype (computed in float32 at least: bf16 and fp16 widen, float64 stays). Differentiable in all five arrays.

  Examples:
    With ``key2`` and ``value2`` all ones it is standard softmax attention:

    >>> q = jnp.sin(jnp.arange(64.0)).reshape(1, 4, 2, 8)   # [B, T, N, H]
    >>> k, v = jnp.cos(q), q
    >>> ones = jnp.ones_like(k)
    >>> out = js.attention.tensor_attention(q, k, ones, v, ones, is_causal=True)
    >>> out.shape
    (1, 4, 2, 8)
    >>> bool(jnp.allclose(out, js.attention.dot_product_attention(q, k, v, is_causal=True),
    ...                   atol=1e-5))
    True

    With bounded entries the polynomial method approaches the dense result as the degree
    grows (here the logits are at most B = 0.19 and the values at most 1, so degree 3 is
    within :math:`2\varepsilon/(1-\varepsilon) \approx 1.1 \cdot 10^{-4}` of it):

    >>> q1, q2, q3 = 0.5 * q, 0.5 * jnp.cos(q), 0.5 * jnp.sin(2 * q)
    >>> dense = js.attention.tensor_attention(q1, q2, q3, v, v)
    >>> err = [float(jnp.max(jnp.abs(js.attention.tensor_attention(
    ...     q1, q2, q3, v, v, implementation="polynomial", degree=g) - dense)))
    ...     for g in (1, 2, 3)]
    >>> err[0] > err[1] > err[2], err[2] < 1.1e-4
    (True, True)

  References:
    J. Alman & Z. Song, 2024, "How to Capture Higher-order Correlations? Generalizing
    Matrix Softmax Attention to Kronecker Computation" (ICLR 2024, arXiv 2310.04064).
  """
  fn = "tensor_attention"
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"{fn}: `implementation` must be one of {_IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  if implementation == "polynomial":
    if (isinstance(degree, bool) or not isinstance(degree, numbers.Integral)
        or degree < 0):
      raise ValueError(f"{fn}: `degree` must be an int >= 0 with implementation="
                       f"'polynomial', got {degree!r}")
    degree = int(degree)
  elif degree is not None:
    raise ValueError(f"{fn}: `degree` is for implementation='polynomial' only, got "
                     f"degree={degree!r} with implementation={implementation!r}")
  q = check_rank(query, "query", 4, "[B, T, N, H]", fn)
  ks = [check_rank(a, n, 4, "[B, S, N, H]", fn) for a, n in ((key1, "key1"), (key2, "key2"))]
  vs = [check_rank(a, n, 4, "[B, S, N, Hv]", fn) for a, n in ((value1, "value1"),
                                                                 (value2, "value2"))]
  B, T, N, H = q.shape
  for a, n in zip(ks, ("key1", "key2"), strict=True):
    if a.shape[0] != B or a.shape[2:] != (N, H) or a.shape[1] != ks[0].shape[1]:
      raise ValueError(f"{fn}: `{n}` must have shape [B, S, N, H] = [{B}, S, {N}, {H}], got {a.shape}")
  S = ks[0].shape[1]
  for a, n in zip(vs, ("value1", "value2"), strict=True):
    if a.shape[:3] != (B, S, N) or a.shape[3] != vs[0].shape[3]:
      raise ValueError(
          f"{fn}: `{n}` must have shape [B, S, N, Hv] = [{B}, {S}, {N}, Hv] (one Hv for both), "
          f"got {a.shape}")
  out_dtype = q.dtype
  cdt = compute_dtype(q.dtype)
  s = 1.0 / float(H) ** 0.5 if scale is None else scale
  q, k1, k2, v1, v2 = (a.astype(cdt) for a in (q, *ks, *vs))
  if implementation == "polynomial":
    assert degree is not None
    return _polynomial(q, k1, k2, v1, v2, s, degree, is_causal).astype(out_dtype)
  logits = s * jnp.einsum("binh,bjnh,bknh->bnijk", q, k1, k2, precision=_HI)
  if is_causal:
    i = jnp.arange(T)[:, None, None]
    vis = (jnp.arange(S)[None, :, None] <= i) & (jnp.arange(S)[None, None, :] <= i)
    logits = jnp.where(vis, logits, -jnp.inf)
  w = jax.nn.softmax(logits.reshape(B, N, T, S * S), axis=-1).reshape(B, N, T, S, S)
  # sum_{j,k} w_ijk (v1_j ⊙ v2_k) without forming the S^2 x Hv Kronecker values
  out = jnp.einsum("bnijk,bjnh,bknh->binh", w, v1, v2, precision=_HI)
  return out.astype(out_dtype)
