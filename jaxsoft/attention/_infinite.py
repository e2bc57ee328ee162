"""Infinite Self-Attention (feature A25): attention propagated along all walks of the token graph.

The Neumann series :math:`\\sum_{t \\ge 1} \\gamma^t A^t V = ((I - \\gamma A)^{-1} - I) V`
of the dense attention map A, truncated or solved (a reconstruction from its paper; dense,
O(T^2) memory per head, O(T^3) time for the exact solve), and Linear-InfSA, its linear-time
form: values pooled by an approximation of the principal eigenvector of A.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from jaxsoft._validation import concrete, positive_int
from jaxsoft.attention._checks import check_rank
from jaxsoft.attention._parameters import per_head
from jaxsoft.attention._uniattn import attention_map
from jaxsoft.normalizers import spec as _spec
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["infsa_attention", "linear_infsa_attention"]

_HI = lax.Precision.HIGHEST


def infsa_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike,
                    bias: ArrayLike | None = None, mask: ArrayLike | None = None, *,
                    gamma: ArrayLike, terms: int | None = None, normalize: bool = False,
                    **kwargs: Any) -> jax.Array:
  r"""Infinite Self-Attention: attention propagated along all walks of the tokens (A25) [R].

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

  [R] The paper (G. Roffo et al. 2026) sums
  the series across layers on a ReLU, Frobenius-normalised map (pass such a normalizer to
  match its base); here the series of its kernel :math:`(I - \gamma A)^{-1} - I` is applied
  to one map (softmax by default), truncated or solved exactly. Linear-InfSA (the principal
  eigenvector form) is :func:`linear_infsa_attention`.

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
    [B, T, N, Hv] in query's dtype (computed in float32 at least: bf16 and fp16 widen, float64 stays).

  Examples:
    The truncated series approaches the exact solve; the normalised kernel at
    ``gamma = 0`` is attention, and it is row-stochastic (values of 1 give 1).

    >>> q = jnp.sin(jnp.arange(64.0)).reshape(1, 4, 2, 8)   # [B, T, N, H]
    >>> k, v = jnp.cos(q), q
    >>> exact = js.attention.infsa_attention(q, k, v, gamma=0.5, is_causal=True)
    >>> exact.shape
    (1, 4, 2, 8)
    >>> series = js.attention.infsa_attention(q, k, v, gamma=0.5, terms=30, is_causal=True)
    >>> bool(jnp.allclose(series, exact, atol=1e-5))
    True
    >>> plain = js.attention.infsa_attention(q, k, v, gamma=0.0, normalize=True, is_causal=True)
    >>> bool(jnp.allclose(plain, js.attention.dot_product_attention(q, k, v, is_causal=True),
    ...                   atol=1e-6))
    True
    >>> ones = js.attention.infsa_attention(q, k, jnp.ones_like(v), gamma=0.5, normalize=True)
    >>> bool(jnp.allclose(ones, 1.0, atol=1e-5))
    True

  References:
    G. Roffo et al., 2026, "Self-Attention And Beyond the Infinite: Towards Linear
    Transformers with Infinite Self-Attention" (arXiv 2603.00175).

    L. Katz, 1953, "A New Status Index Derived from Sociometric Analysis" (Psychometrika
    18; the discounted walk sum).
  """
  fn = "infsa_attention"
  q = check_rank(query, "query", 4, "[B, T, N, H]", fn)
  v = check_rank(value, "value", 4, "[B, T, K, Hv]", fn)
  if isinstance(gamma, bool):
    raise ValueError(f"{fn}: `gamma` must be a float or a per-head array, got {gamma!r}")
  g = per_head(gamma, q.shape[2], "gamma", fn)  # [] or [N, 1, 1]
  g_np = concrete(g)
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
  a = attention_map(fn, query, key, bias, mask, kwargs)  # [B, N, T, S]
  B, N, T, S = a.shape
  if S != T:
    raise ValueError(f"{fn}: `key` must have the queries' length T={T} (self-attention), "
                     f"got S={S}")
  if not bounded:
    a_np = concrete(a)
    if a_np is not None and g_np is not None and a_np.size:
      rho = np.max(np.abs(np.linalg.eigvals(np.asarray(a_np, np.float64))), axis=(0, 2))  # [N]
      if not np.all(np.abs(g_np).reshape(-1) * rho < 1):
        raise ValueError(f"{fn}: `gamma` must satisfy |gamma| * rho(A) < 1 for convergence; "
                         f"rho(A) per head = {np.round(rho, 4).tolist()}, got gamma = {gamma!r}")
  g = g.astype(a.dtype)
  g = g.reshape((1,) * (4 - g.ndim) + g.shape)  # [N, 1, 1] -> [1, N, 1, 1], explicitly
  K = v.shape[2]
  cdt = a.dtype
  vn = jnp.repeat(v.astype(cdt), N // K, axis=2)  # query head n reads value head n // G
  vn = jnp.transpose(vn, (0, 2, 1, 3))  # [B, N, T, Hv]

  def apply(y):
    return jnp.einsum("bnts,bnsh->bnth", a, y, precision=_HI)

  first = apply(vn)
  if terms is None:  # sum_{t>=1} gamma^(t-1) A^t V = (I - gamma A)^-1 A V
    base = jnp.linalg.solve(jnp.eye(T, dtype=cdt)[None, None] - g * a, first)
  else:
    def step(_, carry):
      total, power = carry
      power = g * apply(power)
      return total + power, power

    base, _ = lax.fori_loop(1, int(terms), step, (first, first))
  out = ((1.0 - g) if normalize else g) * base
  out_dtype = q.dtype if jnp.issubdtype(q.dtype, jnp.floating) else jnp.float32
  return jnp.transpose(out, (0, 2, 1, 3)).astype(out_dtype)


def linear_infsa_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike, *,
                           gamma: ArrayLike, iterations: int = 1,
                           key_value_seq_lengths: ArrayLike | None = None,
                           scale: float | None = None, eps: float = 1e-6) -> jax.Array:
  r"""Linear-InfSA: values pooled by the principal eigenvector of the attention graph (A25) [R].

  Infinite Self-Attention's linear-time form. Near :math:`\gamma \rho(A) = 1` the Neumann
  kernel is dominated by the principal eigenvector of A: for positive A,
  :math:`(1 - \gamma\rho)(I - \gamma A)^{-1} \to u x^\top / (x^\top u)` with
  :math:`x^\top A = \rho x^\top` (eigenvector centrality, the limit of Katz centrality),
  so every token's output tends to a multiple of the same centrality-weighted value
  :math:`x^\top V / x^\top 1`. Linear-InfSA computes that vector for
  :math:`A = \mathrm{ReLU}(s\, Q K^\top)` by power iteration without forming A, pulling
  the ReLU outside the sum over queries (:math:`\sum_t x_t \mathrm{ReLU}(s\, q_t \cdot k_j)
  \approx \mathrm{ReLU}(s\, \bar q \cdot k_j)`, :math:`\bar q = \sum_t x_t q_t`), and gives
  every token the pooled value:

  .. math::
    x^{(0)}_t = \frac{\lVert q_t \rVert}{\sum_{t'} \lVert q_{t'} \rVert}, \qquad
    a^{(m)}_j = \mathrm{ReLU}\Big(s \sum_t x^{(m-1)}_t\, q_t \cdot k_j\Big), \qquad
    x^{(m)} = \frac{a^{(m)}}{\sum_j a^{(m)}_j + \epsilon}, \qquad
    o_i = \gamma \sum_j x^{(M)}_j v_j \;\; \text{for every } i

  with M = ``iterations``: O(M·T·H + T·Hv) time and an O(H) state per head. ``iterations=1``
  is the paper's algorithm (the energy-weighted query summary, one matrix-vector product).
  Where it is exact: when every :math:`s\, q_t \cdot k_j \ge 0` (e.g. positive q and k)
  the ReLU is the identity on A's entries, so :math:`x^{(M)}` is exactly M steps of power
  iteration on :math:`A^\top` from :math:`x^{(0)}`, converging (Perron-Frobenius, A > 0)
  to A's normalised principal left eigenvector, and the output to
  :math:`\gamma\, x^\top V / x^\top 1`, the limit of the exact form's centrality-pooled
  output :math:`x^{(0)\top} O_{\text{exact}} / x^{(0)\top} O_{\text{exact}}(V{=}1)` of
  :func:`infsa_attention` with ``normalizer="relu"`` as :math:`\gamma\rho(A) \to 1`. The
  gap otherwise: ReLU is convex, so :math:`\mathrm{ReLU}(s\, \bar q \cdot k_j) \le
  \sum_t x_t \mathrm{ReLU}(s\, q_t \cdot k_j)` (Jensen), with equality exactly when the
  :math:`q_t \cdot k_j` of the weighted queries share a sign: keys that only some queries
  favour are under-weighted, and the result is not A's eigenvector (the paper reports a
  cosine of 0.985 to the dominant eigenvector of the quadratic operator in its trained
  model; on random Gaussian q and k, T = 64, H = 16, we measured 0.51-0.76, mean 0.68,
  with one iteration and mean 0.62 with 20: more linearised steps converge to the
  linearised operator's fixed point, not to A's eigenvector).

  [R] The formulas follow the authors' reference code (a paper-level description gives
  only "approximates the principal eigenvector ... with an O(d_h) state"): the energy
  pooling, :math:`s = 1/H` (q and k each scaled by :math:`1/\sqrt{H}`, also in the energy,
  :math:`x^{(0)} = e / (\sum e + \epsilon)` with :math:`e_t = \sqrt{s} \lVert q_t \rVert`),
  the ReLU, the :math:`\epsilon` and the output broadcast to all positions are theirs;
  ``iterations > 1`` (more linearised power steps) and the padding lengths are additions.
  Not causal: every token reads the pool of the whole sequence.

  Args:
    query: [B, T, N, H]; key: [B, T, K, H]; value: [B, T, K, Hv] (self-attention; GQA: query
      head n pools with key/value head n // (N / K)).
    gamma: the output scale (the paper's :math:`\rho`, its discount), a scalar or per head
      ``[N]``; differentiable.
    iterations: M, the number of linearised power steps (an int >= 1).
    key_value_seq_lengths: optional int ``[B]``: tokens at positions >= the length are
      padding, left out of the pooling (as queries and as keys); a length of 0 gives 0.
    scale: s > 0, the logit scale; None = 1/H as the reference code.
    eps: > 0, added to the normalising sums (the reference code's 1e-6).

  Returns:
    [B, T, N, Hv] in query's dtype (float32 inside for bf16); every position holds the
    same pooled vector. Differentiable in query, key, value and gamma.

  Examples:
    With positive queries and keys, enough iterations reach A's principal left
    eigenvector:

    >>> q = 1.0 + jnp.sin(jnp.arange(24.0)).reshape(1, 6, 1, 4) ** 2   # [B, T, N, H]
    >>> k, v = 1.0 + jnp.cos(q) ** 2, jnp.sin(q)
    >>> out = js.attention.linear_infsa_attention(q, k, v, gamma=1.0, iterations=20)
    >>> out.shape
    (1, 6, 1, 4)
    >>> a = (q[0, :, 0] @ k[0, :, 0].T) / 4                          # A = ReLU(s Q K^T)
    >>> w, vecs = jnp.linalg.eig(a.T)
    >>> x = jnp.abs(vecs[:, jnp.argmax(w.real)].real)
    >>> bool(jnp.allclose(out[0, 0, 0], (x / x.sum()) @ v[0, :, 0], atol=1e-5))
    True

  References:
    G. Roffo et al., 2026, "Self-Attention And Beyond the Infinite: Towards Linear
    Transformers with Infinite Self-Attention" (arXiv 2603.00175; Linear-InfSA and its
    reference code).

    P. Bonacich, 1972, "Factoring and weighting approaches to status scores and clique
    identification" (J. Math. Sociology 2; eigenvector centrality).
  """
  fn = "linear_infsa_attention"
  q = check_rank(query, "query", 4, "[B, T, N, H]", fn)
  k = check_rank(key, "key", 4, "[B, T, K, H]", fn)
  v = check_rank(value, "value", 4, "[B, T, K, Hv]", fn)
  B, T, N, H = q.shape
  if k.shape[:2] != (B, T) or k.shape[3] != H or k.shape[2] < 1 or N % k.shape[2]:
    raise ValueError(f"{fn}: `key` must have shape [B, T, K, H] = [{B}, {T}, K, {H}] with K "
                     f"dividing N={N}, got {k.shape}")
  if v.shape[:3] != k.shape[:3]:
    raise ValueError(f"{fn}: `value` must have shape [B, T, K, Hv] = {list(k.shape[:3])} + "
                     f"[Hv], got {v.shape}")
  if isinstance(gamma, bool):
    raise ValueError(f"{fn}: `gamma` must be a float or a per-head array, got {gamma!r}")
  g = per_head(gamma, N, "gamma", fn)  # [] or [N, 1, 1]
  g_np = concrete(g)
  if g_np is not None and not np.all(np.isfinite(g_np)):
    raise ValueError(f"{fn}: `gamma` must be finite, got {gamma!r}")
  iterations = positive_int(iterations, "iterations", fn)
  for val, name in ((scale, "scale"), (eps, "eps")):
    if val is not None and (isinstance(val, bool) or not isinstance(val, numbers.Real)
                            or not 0 < float(val) < np.inf):
      raise ValueError(f"{fn}: `{name}` must be a finite float > 0, got {val!r}")
  s = 1.0 / H if scale is None else float(scale)
  cdt = compute_dtype(q.dtype)
  G = N // k.shape[2]
  # query head n reads key/value head n // G: [B, T, N, .] -> [B, N, T, .]
  qn = jnp.transpose(q.astype(cdt), (0, 2, 1, 3)) * jnp.asarray(s ** 0.5, cdt)
  kn = jnp.transpose(jnp.repeat(k.astype(cdt), G, axis=2), (0, 2, 1, 3)) * jnp.asarray(
      s ** 0.5, cdt)
  vn = jnp.transpose(jnp.repeat(v.astype(cdt), G, axis=2), (0, 2, 1, 3))
  valid = jnp.ones((B, 1, T), bool)
  if key_value_seq_lengths is not None:
    lens = jnp.asarray(key_value_seq_lengths)
    if lens.shape != (B,) or not jnp.issubdtype(lens.dtype, jnp.integer):
      raise ValueError(f"{fn}: `key_value_seq_lengths` must be an int array [B] = [{B}], got "
                       f"{lens.shape} {lens.dtype}")
    valid = (jnp.arange(T)[None, :] < lens[:, None])[:, None, :]  # [B, 1, T]
  e2 = jnp.sum(qn * qn, axis=-1)  # [B, N, T]; the norm with a zero gradient at q = 0
  pos = e2 > 0
  energy = jnp.where(valid & pos, jnp.sqrt(jnp.where(pos, e2, 1)), 0)
  x = energy / (jnp.sum(energy, axis=-1, keepdims=True) + eps)

  def step(_, x):
    q_bar = jnp.einsum("bnt,bnth->bnh", x, qn, precision=_HI)
    a = jnp.where(valid, jax.nn.relu(jnp.einsum("bnh,bnjh->bnj", q_bar, kn, precision=_HI)),
                  0)
    return a / (jnp.sum(a, axis=-1, keepdims=True) + eps)

  x = lax.fori_loop(0, iterations, step, x)
  g = g.astype(cdt).reshape((1, -1, 1) if g.ndim else ())  # [] or [1, N, 1]
  pooled = g * jnp.einsum("bnj,bnjh->bnh", x, vn, precision=_HI)  # [B, N, Hv]
  out = jnp.broadcast_to(pooled[:, None], (B, T, N, vn.shape[-1]))
  out_dtype = q.dtype if jnp.issubdtype(q.dtype, jnp.floating) else jnp.float32
  return out.astype(out_dtype)
