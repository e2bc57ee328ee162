"""Attention with other similarity structures (features A24, A26, A27).

* A24 :func:`tensor_attention`: triple-wise attention over key pairs (Alman & Song).
* A26 :func:`soft_attention` and :func:`newton_schulz_pinv`: SOFT's Nystrom-approximated
  Gaussian-kernel attention, linear in the sequence length.
* A27 :func:`nonlocal_block`: the softmax-free (scaled dot product) non-local block,
  re-associated to O(T·d^2).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxsoft.normalizers.common import compute_dtype

__all__ = ["tensor_attention", "soft_attention", "gaussian_kernel", "newton_schulz_pinv",
           "nonlocal_block"]

_HI = lax.Precision.HIGHEST


def _check_rank(t, name: str, rank: int, layout: str, fn: str):
  t = jnp.asarray(t)
  if t.ndim != rank:
    raise ValueError(f"{fn}: `{name}` must have shape {layout}, got {t.shape}")
  return t


# ------------------------------------------------------------------------------- A24


def tensor_attention(query: ArrayLike, key1: ArrayLike, key2: ArrayLike, value1: ArrayLike,
                     value2: ArrayLike, *, scale: float | None = None,
                     is_causal: bool = False) -> jax.Array:
  r"""Tensor (triple-wise) attention: each query attends to pairs of keys (A24).

  .. math::
    \ell_{i,(j,k)} = s \sum_h q_{ih}\, k^{(1)}_{jh}\, k^{(2)}_{kh}, \qquad
    o_i = \sum_{j,k} \frac{e^{\ell_{i,(j,k)}}}{\sum_{j',k'} e^{\ell_{i,(j',k')}}}
          \big(v^{(1)}_j \odot v^{(2)}_k\big)

  i.e. :math:`D^{-1} \exp(Q (K_1 \oslash K_2)^\top)(V_1 \oslash V_2)` with the row-wise
  Kronecker product :math:`\oslash`. With ``key2`` and ``value2`` all ones it is standard
  softmax attention on (query, key1, value1). With ``is_causal`` query i sees the pairs
  with j <= i and k <= i. Dense: O(T·S^2·H) time and O(T·S^2) memory per head (the paper's
  point is that faster algorithms exist only for small entries).

  From J. Alman, Z. Song, "How to Capture Higher-order Correlations? Generalizing Matrix
  Softmax Attention to Kronecker Computation" (ICLR 2024, arXiv 2310.04064).

  Args:
    query: [B, T, N, H]; key1, key2: [B, S, N, H]; value1, value2: [B, S, N, Hv].
    scale: s; None = 1/sqrt(H) (so that key2 = 1 reduces to dot_product_attention's
      default).
    is_causal: restrict the pairs to j, k <= i.

  Returns:
    [B, T, N, Hv] in query's dtype (float32 inside). Differentiable in all five arrays.
  """
  fn = "tensor_attention"
  q = _check_rank(query, "query", 4, "[B, T, N, H]", fn)
  ks = [_check_rank(a, n, 4, "[B, S, N, H]", fn) for a, n in ((key1, "key1"), (key2, "key2"))]
  vs = [_check_rank(a, n, 4, "[B, S, N, Hv]", fn) for a, n in ((value1, "value1"),
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
  logits = s * jnp.einsum("binh,bjnh,bknh->bnijk", q, k1, k2, precision=_HI)
  if is_causal:
    i = jnp.arange(T)[:, None, None]
    vis = (jnp.arange(S)[None, :, None] <= i) & (jnp.arange(S)[None, None, :] <= i)
    logits = jnp.where(vis, logits, -jnp.inf)
  w = jax.nn.softmax(logits.reshape(B, N, T, S * S), axis=-1).reshape(B, N, T, S, S)
  # sum_{j,k} w_ijk (v1_j ⊙ v2_k) without forming the S^2 x Hv Kronecker values
  out = jnp.einsum("bnijk,bjnh,bknh->binh", w, v1, v2, precision=_HI)
  return out.astype(out_dtype)


# ------------------------------------------------------------------------------- A26


def gaussian_kernel(a: ArrayLike, b: ArrayLike) -> jax.Array:
  r"""SOFT's kernel :math:`S(a_i, b_j) = \exp(-\|a_i - b_j\|^2 / (2\sqrt{d}))` over the
  last axis: ``a`` [..., n, d], ``b`` [..., m, d] -> [..., n, m] (entries in (0, 1])."""
  a, b = jnp.asarray(a), jnp.asarray(b)
  d = a.shape[-1]
  sq = (jnp.sum(a * a, -1)[..., :, None] + jnp.sum(b * b, -1)[..., None, :]
        - 2 * jnp.einsum("...nd,...md->...nm", a, b, precision=_HI))
  return jnp.exp(-jnp.maximum(sq, 0.0) / (2.0 * jnp.sqrt(jnp.asarray(d, a.dtype))))


def newton_schulz_pinv(a: ArrayLike, num_iters: int = 20) -> jax.Array:
  r"""The Moore-Penrose pseudo-inverse of square matrices by Newton-Schulz iteration.

  .. math:: Z_0 = \frac{A^\top}{\|A\|_1 \|A\|_\infty}, \qquad Z_{k+1} = 2 Z_k - Z_k A Z_k

  Z_0 makes :math:`\|I - A Z_0\| < 1` on the range of A, and the iteration converges
  quadratically to :math:`A^\dagger` (SOFT's Newton-Raphson inverse) once the error is below
  1; a condition number kappa needs about log2(kappa^2) iterations before that. For a
  singular (or numerically singular) A, rounding errors in its null space double at each
  iteration, so keep ``num_iters`` moderate (SOFT uses about 20). Batched over leading
  dimensions; differentiable through the iterations.

  Args:
    a: [..., m, m].
    num_iters: a static int >= 0.
  """
  a = jnp.asarray(a)
  if isinstance(num_iters, bool) or not isinstance(num_iters, numbers.Integral) or num_iters < 0:
    raise ValueError(f"newton_schulz_pinv: `num_iters` must be an int >= 0, got {num_iters!r}")
  n1 = jnp.max(jnp.sum(jnp.abs(a), axis=-2), axis=-1)  # max column sum
  ninf = jnp.max(jnp.sum(jnp.abs(a), axis=-1), axis=-1)  # max row sum
  denom = n1 * ninf
  z = jnp.swapaxes(a, -1, -2) / jnp.where(denom > 0, denom, 1.0)[..., None, None]

  def step(_, z):
    return 2 * z - jnp.einsum("...ij,...jk,...kl->...il", z, a, z, precision=_HI)

  return lax.fori_loop(0, num_iters, step, z)


def soft_attention(query: ArrayLike, value: ArrayLike, *, num_landmarks: int,
                   num_iters: int = 20, symmetric_normalize: bool = False,
                   eps: float = 1e-6) -> jax.Array:
  r"""SOFT: softmax-free attention with a Nystrom-approximated Gaussian kernel (A26).

  Keys are tied to queries (one projection), the similarity is the Gaussian kernel
  :func:`gaussian_kernel`, and with m landmarks :math:`\tilde Q` (the means of m
  consecutive segments of the sequence):

  .. math::
    P = S(Q, \tilde Q) \in \mathbb{R}^{T \times m}, \quad A = S(\tilde Q, \tilde Q), \quad
    \hat S = P A^\dagger P^\top, \quad O = \hat S V = P\,(A^\dagger (P^\top V))

  with :math:`A^\dagger` by :func:`newton_schulz_pinv`: O(T·m·(H + Hv) + m^3) time, no
  T x T array. ``symmetric_normalize`` gives SOFT++'s :math:`D^{-1/2} \hat S D^{-1/2} V`
  with :math:`D = \mathrm{diag}(\hat S \mathbf{1})` (row sums clamped to ``eps``). With
  m = T the landmarks are the tokens and :math:`\hat S = S` (when A is invertible).
  Not causal (the landmarks pool the whole sequence).

  From J. Lu, J. Yao, J. Zhang, X. Zhu, H. Xu, W. Gao, C. Xu, T. Xiang, L. Zhang, "SOFT:
  Softmax-free Transformer with Linear Complexity" (NeurIPS 2021). [R] The landmarks here
  are segment means (SOFT uses a strided convolution or pooling); the gradient is autodiff
  through the Newton-Schulz iterations, not the paper's closed form.

  Args:
    query: [B, T, N, H] (also the keys).
    value: [B, T, N, Hv].
    num_landmarks: m, an int dividing T.
    num_iters: Newton-Schulz iterations.
    symmetric_normalize: SOFT++'s symmetric normalisation.
    eps: the floor of the row sums D.

  Returns:
    [B, T, N, Hv] in query's dtype (float32 inside).
  """
  fn = "soft_attention"
  q = _check_rank(query, "query", 4, "[B, T, N, H]", fn)
  v = _check_rank(value, "value", 4, "[B, T, N, Hv]", fn)
  B, T, N, H = q.shape
  if v.shape[:3] != (B, T, N):
    raise ValueError(f"{fn}: `value` must have shape [B, T, N, Hv] = [{B}, {T}, {N}, Hv], got {v.shape}")
  if isinstance(num_landmarks, bool) or not isinstance(num_landmarks, numbers.Integral) or (
      num_landmarks < 1 or T % num_landmarks):
    raise ValueError(f"{fn}: `num_landmarks` must be an int >= 1 dividing T={T}, got {num_landmarks!r}")
  if not float(eps) > 0:
    raise ValueError(f"{fn}: `eps` must be > 0, got {eps!r}")
  cdt = compute_dtype(q.dtype)
  qt = jnp.transpose(q.astype(cdt), (0, 2, 1, 3))  # [B, N, T, H]
  vt = jnp.transpose(v.astype(cdt), (0, 2, 1, 3))
  m = int(num_landmarks)
  landmarks = jnp.mean(qt.reshape(B, N, m, T // m, H), axis=3)
  p = gaussian_kernel(qt, landmarks)  # [B, N, T, m]
  a_pinv = newton_schulz_pinv(gaussian_kernel(landmarks, landmarks), num_iters)

  def apply(x):  # S_hat x = P (A^+ (P^T x)), never T x T
    return jnp.einsum("bntm,bnmx->bntx", p, jnp.einsum(
        "bnml,bnlx->bnmx", a_pinv, jnp.einsum("bntm,bntx->bnmx", p, x, precision=_HI),
        precision=_HI), precision=_HI)

  if symmetric_normalize:
    d = apply(jnp.ones((B, N, T, 1), cdt))
    r = lax.rsqrt(jnp.maximum(d, eps))
    out = r * apply(r * vt)
  else:
    out = apply(vt)
  return jnp.transpose(out, (0, 2, 1, 3)).astype(q.dtype)


# ------------------------------------------------------------------------------- A27


def nonlocal_block(x: ArrayLike, w_theta: ArrayLike, w_phi: ArrayLike, w_g: ArrayLike,
                   w_out: ArrayLike, *, num_heads: int = 1, scale: float | None = None,
                   use_softmax: bool = False) -> jax.Array:
  r"""The non-local block with a softmax-free scaled dot product (A27).

  For positions x_i (a flattened image or sequence), per head:

  .. math::
    y_i = \sum_j f(\theta_i, \phi_j)\, g_j, \qquad z_i = x_i + W_z y_i

  with :math:`\theta = x W_\theta`, :math:`\phi = x W_\phi`, :math:`g = x W_g`. The
  softmax-free block takes :math:`f = s\, \theta_i \cdot \phi_j` (s = ``scale``, default
  1/T, the classic "dot product" non-local block), which re-associates to
  :math:`y = s\, \Theta (\Phi^\top G)`: O(T·d^2) time, no T x T array, and heads at no
  extra cost. ``use_softmax=True`` is the original embedded-Gaussian block,
  :math:`f = \mathrm{softmax}_j(\theta_i \cdot \phi_j)` (O(T^2)), for comparison.

  From Cho et al., "Rethinking Efficacy of Softmax for Lightweight Non-Local Neural
  Networks" (2022); the non-local block is X. Wang, R. Girshick,
  A. Gupta, K. He, "Non-local Neural Networks" (CVPR 2018). [R] The paper's value of s is
  not established; 1/T is the classic choice.

  Args:
    x: [B, T, C].
    w_theta, w_phi: [C, D]; w_g: [C, Dv]; w_out: [Dv, C]. D and Dv must divide by
      ``num_heads``.
    num_heads: heads (the projections are split along D and Dv).
    scale: s (None = 1/T).
    use_softmax: the softmax (embedded Gaussian) block instead.

  Returns:
    z [B, T, C] in x's dtype (float32 inside).
  """
  fn = "nonlocal_block"
  xa = _check_rank(x, "x", 3, "[B, T, C]", fn)
  B, T, C = xa.shape
  w_theta, w_phi, w_g, w_out = (jnp.asarray(w) for w in (w_theta, w_phi, w_g, w_out))
  for w, name in ((w_theta, "w_theta"), (w_phi, "w_phi"), (w_g, "w_g")):
    if w.ndim != 2 or w.shape[0] != C:
      raise ValueError(f"{fn}: `{name}` must have shape [C={C}, D], got {w.shape}")
  if w_phi.shape != w_theta.shape:
    raise ValueError(f"{fn}: `w_phi` must have the shape of `w_theta` {w_theta.shape}, got {w_phi.shape}")
  if w_out.shape != (w_g.shape[1], C):
    raise ValueError(f"{fn}: `w_out` must have shape [Dv={w_g.shape[1]}, C={C}], got {w_out.shape}")
  if isinstance(num_heads, bool) or not isinstance(num_heads, numbers.Integral) or num_heads < 1 or (
      w_theta.shape[1] % num_heads or w_g.shape[1] % num_heads):
    raise ValueError(
        f"{fn}: `num_heads` must be an int >= 1 dividing D={w_theta.shape[1]} and "
        f"Dv={w_g.shape[1]}, got {num_heads!r}")
  cdt = compute_dtype(xa.dtype)
  xc = xa.astype(cdt)
  nh = int(num_heads)

  def heads(w):
    return jnp.einsum("btc,cd->btd", xc, w.astype(cdt), precision=_HI).reshape(B, T, nh, -1)

  th, ph, g = heads(w_theta), heads(w_phi), heads(w_g)
  if use_softmax:
    logits = jnp.einsum("binh,bjnh->bnij", th, ph, precision=_HI)
    y = jnp.einsum("bnij,bjnh->binh", jax.nn.softmax(logits, -1), g, precision=_HI)
  else:
    s = 1.0 / T if scale is None else scale
    state = jnp.einsum("bjnh,bjnv->bnhv", ph, g, precision=_HI)  # Phi^T G per head
    y = s * jnp.einsum("binh,bnhv->binv", th, state, precision=_HI)
  z = xc + jnp.einsum("btd,dc->btc", y.reshape(B, T, -1), w_out.astype(cdt), precision=_HI)
  return z.astype(xa.dtype)
