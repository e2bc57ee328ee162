"""Attention variants built on :func:`dot_product_attention` (features A03, A07-A10).

The feature ids are explained, with the papers behind each, in docs/feature_ids.md.

Pure functions; the learned parameters they take (per-head sinks, SSMax ``s``, entmax
``alpha``, gate weights, forget gates) are held by the Flax modules of ``jaxsoft.nn``.

* A03 :func:`hopfield_retrieval` and :func:`hopfield_energy`: the OutEffHop (modern
  Hopfield) retrieval ``xi <- Xi · normalizer(beta Xi^T xi)``, iterated, any normalizer.
* A07 :func:`gated_attention_output`: ``SDPA ⊙ sigmoid(X W_theta)`` per head.
* A08 :func:`forget_gate_decay`, :func:`forgetting_attention` and
  :func:`acp_prune_threshold`: Forgetting attention (FoX) with the ACP block-pruning bound.
* A09 :func:`ssmax_attention`: SSMax attention with a (learned) per-head ``s``.
* A10 :func:`entmax_attention` and :func:`sparsemax_attention`: adaptively sparse
  attention with a (learned) per-head ``alpha``.
* :func:`softplus_to_range` and :func:`softplus_from_range`: the safe parameterisations
  (``alpha = 1 + softplus(z)``, ``s = softplus(z)``) and their inverses for initialising.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft.attention._api import dot_product_attention
from jaxsoft.normalizers import common as c
from jaxsoft.normalizers import spec

__all__ = [
    "hopfield_retrieval",
    "hopfield_energy",
    "gated_attention_output",
    "forget_gate_decay",
    "forgetting_attention",
    "acp_prune_threshold",
    "ssmax_attention",
    "entmax_attention",
    "sparsemax_attention",
    "per_head",
    "softplus_to_range",
    "softplus_from_range",
]


# ----------------------------------------------------------------------------------------
# Safe parameterisations: a learned parameter is kept in its valid range by construction
# (alpha = 1 + softplus(z), s = softplus(z)), never clipped after an update.


def softplus_to_range(free: ArrayLike, low: float = 0.0, margin: float = 0.0) -> jax.Array:
  r"""``low + margin + softplus(free)``: an unconstrained parameter mapped above ``low``.

  .. math:: \theta = \ell + \epsilon + \log(1 + e^{z})

  ``alpha = softplus_to_range(z, 1.0)`` is the learned entmax alpha of A10 (> 1),
  ``softplus_to_range(z)`` the SSMax ``s`` of A09 and a positive temperature. ``margin``
  keeps an *open* bound open in floating point: softplus underflows to exactly 0 for
  ``z`` below about -100 (float32), so without it ``alpha`` could reach 1 exactly.
  Computed in float32 (or float64) whatever the dtype of ``free``.
  """
  free = jnp.asarray(free)
  z = free.astype(c.compute_dtype(free.dtype))
  return low + margin + jax.nn.softplus(z)


def softplus_from_range(value: ArrayLike, low: float = 0.0, margin: float = 0.0) -> jax.Array:
  r"""The inverse of :func:`softplus_to_range`: the free parameter giving ``value``.

  .. math:: z = y + \log(1 - e^{-y}),\quad y = \theta - \ell - \epsilon > 0

  Raises ValueError naming ``value`` when a concrete value is not above
  ``low + margin``.
  """
  v = jnp.asarray(value, dtype=jnp.float32)
  y = v - low - margin
  try:
    concrete = np.asarray(y)
  except Exception:  # a tracer: checked only when concrete
    concrete = None
  if concrete is not None and np.any(concrete <= 0):
    raise ValueError(
        f"softplus_from_range: `value` must be > low + margin = {low + margin}, got {value}")
  # log(expm1(y)) written to stay finite for large y (expm1 overflows past ~88 in f32).
  return y + jnp.log(-jnp.expm1(-y))


def per_head(value: ArrayLike, num_heads: int, name: str, fn_name: str) -> jax.Array:
  """A scalar or a per-head vector ``[N]`` -> a normalizer parameter for logits ``[B,N,T,S]``.

  Scalars pass through; a vector of length ``num_heads`` becomes ``[N, 1, 1]`` (one value
  per head, broadcast right-aligned against the logits with size 1 along the keys).
  """
  v = jnp.asarray(value)
  if v.ndim == 0:
    return v
  if v.shape != (num_heads,):
    raise ValueError(
        f"{fn_name}: `{name}` must be a scalar or have shape [num_heads] = ({num_heads},), "
        f"got {v.shape}")
  return v.reshape(num_heads, 1, 1)


def _check_qkv_heads(q, fn_name: str) -> int:
  q = jnp.asarray(q)
  if q.ndim != 4:
    raise ValueError(f"{fn_name}: `q` must have shape [B, T, N, H], got {q.shape}")
  return q.shape[2]


def _merge_params(normalizer_params: Mapping[str, Any] | None, extra: dict[str, Any],
                  fn_name: str) -> dict[str, Any]:
  params = dict(normalizer_params or {})
  for k in extra:
    if k in params:
      raise ValueError(f"{fn_name}: `{k}` is given both as an argument and in `normalizer_params`")
  params.update(extra)
  return params


# ----------------------------------------------------------------------------------------
# A03 Hopfield retrieval (OutEffHop).


def _row_normalize(normalizer, z, where, normalizer_params, fn_name: str):
  """Applies a normalizer given as a registered name, a NormalizerSpec or a callable."""
  fn = spec.resolve(normalizer)
  params = dict(normalizer_params or {})
  if isinstance(fn, spec.NormalizerSpec):
    if fn.needs_key:
      raise ValueError(
          f"{fn_name}: `normalizer` {fn.name!r} needs a PRNG key; pass a callable that closes "
          "over one")
    fn.validate(params)
  return fn(z, axis=-1, where=where, **params)


def hopfield_retrieval(query_state: ArrayLike, memory: ArrayLike, *, beta: ArrayLike,
                       num_iters: int = 1,
                       normalizer: str | spec.NormalizerSpec | Callable[..., Any] = "softmax_1",
                       normalizer_params: Mapping[str, Any] | None = None,
                       where: ArrayLike | None = None) -> jax.Array:
  r"""Modern-Hopfield retrieval, iterated (feature A03; OutEffHop, J. Hu et al. 2024).

  OutEffHop is from J. Hu et al., "Outlier-Efficient Hopfield Layers for Large
  Transformer-Based Models" (ICML 2024, arXiv 2404.03828).

  With the stored patterns :math:`\Xi = [\xi^1, \dots, \xi^M]` (the rows of ``memory``)
  and a state :math:`\xi`, each iteration applies

  .. math:: \xi \leftarrow \Xi \, f(\beta\, \Xi^\top \xi)

  where ``f`` is the normalizer over the M patterns: ``softmax`` is the modern Hopfield
  network of H. Ramsauer et al., "Hopfield Networks is All You Need" (ICLR 2021, arXiv
  2008.02217), whose one step is attention; ``softmax_1`` (the default,
  :math:`e^{z_i} / (1 + \sum_j e^{z_j})`) is OutEffHop, whose implicit zero logit lets a
  state that matches no pattern retrieve (nearly) nothing. Any registered normalizer (a
  name, a NormalizerSpec) or a callable ``f(z, axis=-1, where=None, **params)`` works; for
  ``softmax`` and ``softmax_1`` each step does not increase :func:`hopfield_energy`
  (the update is the concave-convex procedure on it).

  Args:
    query_state: states ``[..., Q, d]`` (Q states retrieved at once).
    memory: patterns ``[..., M, d]``; leading dimensions broadcast with ``query_state``.
    beta: inverse temperature > 0 (a scalar or an array broadcast to ``[..., Q, 1]``).
    num_iters: number of update steps, a static int >= 1.
    normalizer: the normalizer over patterns (default ``"softmax_1"``).
    normalizer_params: extra hyperparameters of the normalizer.
    where: optional boolean mask broadcast to ``[..., Q, M]``: which patterns are stored.

  Returns:
    The state after ``num_iters`` updates, ``[..., Q, d]`` in ``query_state``'s dtype
    (computed in float32 for bf16/fp16). Differentiable in all array arguments.
  """
  fn_name = "hopfield_retrieval"
  if isinstance(num_iters, bool) or not isinstance(num_iters, numbers.Integral) or num_iters < 1:
    raise ValueError(f"{fn_name}: `num_iters` must be an int >= 1, got {num_iters!r}")
  xi = jnp.asarray(query_state)
  mem = jnp.asarray(memory)
  if xi.ndim < 2 or mem.ndim < 2:
    raise ValueError(
        f"{fn_name}: `query_state` [..., Q, d] and `memory` [..., M, d] need rank >= 2, got "
        f"{xi.shape} and {mem.shape}")
  if xi.shape[-1] != mem.shape[-1]:
    raise ValueError(
        f"{fn_name}: `query_state` and `memory` must share the pattern dimension d, got "
        f"{xi.shape[-1]} and {mem.shape[-1]}")
  _check_positive(beta, "beta", fn_name)
  out_dtype = xi.dtype
  cdt = c.compute_dtype(jnp.result_type(xi.dtype, mem.dtype))
  xi = xi.astype(cdt)
  mem = mem.astype(cdt)
  beta = jnp.asarray(beta, cdt)

  def step(_, state):
    z = beta * jnp.einsum("...qd,...md->...qm", state, mem)
    w = _row_normalize(normalizer, z, where, normalizer_params, fn_name).astype(cdt)
    return jnp.einsum("...qm,...md->...qd", w, mem)

  # The first step also broadcasts the state against memory's leading dimensions, so the
  # loop carry has a fixed shape.
  xi = step(0, xi)
  xi = jax.lax.fori_loop(1, num_iters, step, xi)
  return xi.astype(out_dtype)


def hopfield_energy(query_state: ArrayLike, memory: ArrayLike, *, beta: ArrayLike,
                    offset: float = 1.0) -> jax.Array:
  r"""The Hopfield energy that :func:`hopfield_retrieval` descends (softmax / softmax_1).

  .. math::
    E(\xi) = -\frac{1}{\beta} \log\Big(c + \sum_{i=1}^{M} e^{\beta \langle \xi^i, \xi\rangle}
    \Big) + \tfrac12 \langle \xi, \xi \rangle

  with ``offset`` :math:`c = 1` for OutEffHop's ``softmax_1`` (``lse_1``) and ``c = 0`` for
  the modern Hopfield network (``softmax``). Returns ``[..., Q]`` in float32 (or float64).
  """
  if offset < 0:
    raise ValueError(f"hopfield_energy: `offset` must be >= 0, got {offset}")
  xi = jnp.asarray(query_state)
  mem = jnp.asarray(memory)
  cdt = c.compute_dtype(jnp.result_type(xi.dtype, mem.dtype))
  xi = xi.astype(cdt)
  mem = mem.astype(cdt)
  beta = jnp.asarray(beta, cdt)
  z = beta * jnp.einsum("...qd,...md->...qm", xi, mem)
  if offset > 0:
    z = jnp.concatenate([z, jnp.full(z.shape[:-1] + (1,), math.log(offset), cdt)], axis=-1)
  lse = jax.nn.logsumexp(z, axis=-1)
  beta_row = jnp.broadcast_to(beta, z.shape[:-1] + (1,))[..., 0]
  return -lse / beta_row + 0.5 * jnp.sum(xi * xi, axis=-1)


def _check_positive(value, name: str, fn_name: str):
  try:
    v = np.asarray(value, dtype=np.float64)
  except Exception:  # a tracer: cannot be checked at trace time
    return
  if np.any(np.isnan(v)) or np.any(v <= 0):
    raise ValueError(f"{fn_name}: `{name}` must be > 0, got {value}")


# ----------------------------------------------------------------------------------------
# A07 gated attention.


def gated_attention_output(attn_out: ArrayLike, x: ArrayLike, w_gate: ArrayLike,
                           b_gate: ArrayLike | None = None) -> jax.Array:
  r"""Gated attention output (feature A07; Z. Qiu et al. 2025, "G1" position).

  From "Gated Attention for Large Language Models: Non-linearity, Sparsity, and
  Attention-Sink-Free" (Z. Qiu et al. 2025, arXiv 2505.06708), whose "G1" gate sits right
  after the attention, before the output projection:

  .. math:: Y' = Y \odot \sigma(X W_\theta + b_\theta)

  an elementwise, head-specific, query-dependent sigmoid gate computed from the layer
  input ``X`` (the pre-norm hidden state the queries were projected from) and applied to
  the attention output ``Y = SDPA(Q, K, V)`` of each head before the output projection.
  A gate near 0 lets a head output nothing, which removes the need for an attention sink.

  Args:
    attn_out: ``Y``, ``[..., T, N, H]``.
    x: ``X``, ``[..., T, D]``.
    w_gate: ``[D, N, H]`` (elementwise gate) or ``[D, N]`` (one scalar gate per head).
    b_gate: optional bias ``[N, H]`` or ``[N]`` matching ``w_gate``.

  Returns:
    ``Y'`` of ``attn_out``'s shape and dtype (the gate is computed in float32 for
    low-precision inputs).
  """
  fn_name = "gated_attention_output"
  y = jnp.asarray(attn_out)
  x = jnp.asarray(x)
  w = jnp.asarray(w_gate)
  if y.ndim < 3:
    raise ValueError(f"{fn_name}: `attn_out` must have shape [..., T, N, H], got {y.shape}")
  if x.shape[:-1] != y.shape[:-2]:
    raise ValueError(
        f"{fn_name}: `x` [..., T, D] must match `attn_out` [..., T, N, H] in its leading "
        f"dimensions, got {x.shape} and {y.shape}")
  n, h = y.shape[-2:]
  d = x.shape[-1]
  if w.shape not in ((d, n, h), (d, n)):
    raise ValueError(
        f"{fn_name}: `w_gate` must have shape [D, N, H] = {(d, n, h)} or [D, N] = {(d, n)}, "
        f"got {w.shape}")
  cdt = c.compute_dtype(jnp.result_type(y.dtype, x.dtype, w.dtype))
  g = jnp.tensordot(x.astype(cdt), w.astype(cdt), axes=1)  # [..., T, N, H] or [..., T, N]
  if b_gate is not None:
    b = jnp.asarray(b_gate)
    if b.shape != w.shape[1:]:
      raise ValueError(f"{fn_name}: `b_gate` must have shape {w.shape[1:]}, got {b.shape}")
    g = g + b.astype(cdt)
  g = jax.nn.sigmoid(g)
  if w.ndim == 2:
    g = g[..., None]
  return (y.astype(cdt) * g).astype(y.dtype)


# ----------------------------------------------------------------------------------------
# A08 Forgetting attention (FoX) and adaptive computation pruning (ACP).


def forget_gate_decay(log_f: ArrayLike) -> tuple[jax.Array, jax.Array]:
  r"""The FoX decay bias as ``(cq, ck)`` for ``dot_product_attention(decay_bias=...)``.

  With per-token, per-head log forget gates :math:`\log f_t = \log\sigma(w_f^\top x_t + b_f)
  \le 0` and their cumulative sum :math:`c_t = \sum_{l \le t} \log f_l`,

  .. math:: D_{ij} = \sum_{l=j+1}^{i} \log f_l = c_i - c_j \quad (j \le i)

  is added to the scaled logits (Lin et al., ICLR 2025): ``cq = ck = c``. ``D_ij <= 0`` and
  decreases as ``j`` moves into the past; ``f = 1`` gives plain causal attention and a
  constant ``f`` an ALiBi slope of ``-log f``. Only ``j <= i`` is meaningful: use it with
  causal attention. The cumulative sum is taken in float32 (float64 for float64 input);
  ``c_i - c_j`` then carries an absolute error of about ``eps·|c_T|``.

  Args:
    log_f: ``[B, T, N]`` log forget gates (e.g. ``jax.nn.log_sigmoid(gate_logits)``).

  Returns:
    ``(cq, ck)``, both ``[B, T, N]``.
  """
  lf = jnp.asarray(log_f)
  if lf.ndim != 3:
    raise ValueError(f"forget_gate_decay: `log_f` must have shape [B, T, N], got {lf.shape}")
  cum = jnp.cumsum(lf.astype(c.compute_dtype(lf.dtype)), axis=1)
  return cum, cum


def acp_prune_threshold(q: ArrayLike, k: ArrayLike, *, epsilon: float,
                        scale: float | None = None) -> jax.Array:
  r"""A decay threshold below which FoX attention weights are provably below ``epsilon``.

  Adaptive computation pruning (ACP, Lin et al. 2025) skips the (i, j) pairs whose decay
  :math:`D_{ij}` is so negative that their weight is negligible. With the scaled logits
  :math:`s_{ij}` bounded by :math:`|s_{ij}| \le U`, softmax weights satisfy

  .. math::
    a_{ij} = \frac{e^{s_{ij} + D_{ij}}}{\sum_l e^{s_{il} + D_{il}}}
      \le e^{s_{ij} + D_{ij} - s_{ii} - D_{ii}} \le e^{2U + D_{ij}}

  (the denominator holds the diagonal term, with :math:`D_{ii} = 0`), so
  :math:`D_{ij} < \log\epsilon - 2U \Rightarrow a_{ij} < \epsilon`. Here
  :math:`U = \text{scale} \cdot \max_i \lVert q_i \rVert \cdot \max_j \lVert k_j \rVert`
  (Cauchy-Schwarz), one bound over the whole batch. Since :math:`D_{ij}` only decreases
  as ``j`` moves into the past, the pruned pairs of a row form a prefix, so a blockwise
  kernel skips whole key blocks. Dropping pruned weights of total mass ``P`` and
  renormalising changes an output by at most ``2 P max|v|``, so with at most ``S`` pruned
  keys per row the error is below ``2 S epsilon max|v|``. The bound needs the diagonal
  (self-attention, causal, the query's own key visible) and the softmax normalizer.

  Args:
    q: ``[B, T, N, H]``; k: ``[B, S, K, H]``.
    epsilon: the weight bound, in (0, 1).
    scale: the logit scale (default ``1/sqrt(H)``).

  Returns:
    A scalar threshold (float32) for ``forgetting_attention(prune_threshold=...)``; it is
    a function of ``q`` and ``k`` but carries no gradient. The chunked path builds its
    block skip table from a concrete float, so compute it outside ``jit`` (e.g. once from
    a representative batch, or from a static bound ``U`` as ``log(eps) - 2U``).
  """
  if not 0.0 < float(epsilon) < 1.0:
    raise ValueError(f"acp_prune_threshold: `epsilon` must be in (0, 1), got {epsilon}")
  q = jnp.asarray(q)
  k = jnp.asarray(k)
  if scale is None:
    scale = 1.0 / math.sqrt(q.shape[-1])
  cdt = c.compute_dtype(jnp.result_type(q.dtype, k.dtype))
  qn = jnp.max(jnp.linalg.norm(q.astype(cdt), axis=-1))
  kn = jnp.max(jnp.linalg.norm(k.astype(cdt), axis=-1))
  u = jnp.abs(jnp.asarray(scale, cdt)) * qn * kn
  return jax.lax.stop_gradient(math.log(epsilon) - 2.0 * u)


def forgetting_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, log_f: ArrayLike, *,
                         prune_threshold: float | None = None, is_causal: bool = True,
                         **kwargs: Any) -> jax.Array:
  r"""Forgetting attention (FoX, feature A08): causal attention with a forget-gate decay.

  .. math::
    o_i = \sum_{j \le i} \frac{e^{s_{ij} + D_{ij}}}{\sum_{l \le i} e^{s_{il} + D_{il}}} v_j,
    \qquad D_{ij} = \sum_{l=j+1}^{i} \log f_l

  (Z. Lin, E. Nikishin, X. O. He & A. Courville, "Forgetting Transformer: Softmax
  Attention with a Forget Gate", ICLR 2025, arXiv 2503.02130), computed by
  :func:`dot_product_attention` with ``decay_bias=forget_gate_decay(log_f)``: a rank-1
  structured bias, so the chunked and Pallas paths never materialise ``D``.

  ``prune_threshold`` turns on adaptive computation pruning (ACP; Z. Lin et al. 2025,
  "Adaptive Computation Pruning for the Forgetting Transformer", arXiv 2504.06949): key
  blocks whose decay is below the threshold for every pair are skipped
  (``decay_prune_threshold``). With the threshold of :func:`acp_prune_threshold`
  (``log eps - 2U``, ``U`` a bound on ``|s_ij|``) every skipped weight is below ``eps``
  and each output moves by less than ``2 S eps max|v|``; a very negative threshold prunes
  nothing.

  Args:
    q, k, v: ``[B, T, N, H]``, ``[B, T, K, H]``, ``[B, T, K, H]`` (self-attention: the
      gates belong to the tokens, so queries and keys are the same sequence).
    log_f: ``[B, T, N]`` log forget gates (``<= 0``), one per query head.
    prune_threshold: optional concrete float ``< 0``, the decay threshold of ACP (used by
      the ``"xla_chunked"`` path; the dense path computes every pair); ``None`` prunes
      nothing.
    is_causal: default True (the decay is defined for ``j <= i`` only).
    **kwargs: any other argument of :func:`dot_product_attention` (mask, segment_ids,
      normalizer, implementation, ...).

  Returns:
    ``[B, T, N, H]`` in ``q``'s dtype.
  """
  fn_name = "forgetting_attention"
  for bad in ("decay_bias", "decay_prune_threshold"):
    if bad in kwargs:
      raise ValueError(f"{fn_name}: `{bad}` is set from `log_f` / `prune_threshold`")
  q = jnp.asarray(q)
  k = jnp.asarray(k)
  lf = jnp.asarray(log_f)
  if q.ndim != 4 or k.ndim != 4:
    raise ValueError(f"{fn_name}: `q` and `k` must be [B, T, N, H], got {q.shape}, {k.shape}")
  if q.shape[1] != k.shape[1]:
    raise ValueError(
        f"{fn_name}: forget gates need self-attention (`q` and `k` of the same length), got "
        f"T={q.shape[1]} and S={k.shape[1]}")
  if lf.shape != q.shape[:3]:
    raise ValueError(
        f"{fn_name}: `log_f` must have shape [B, T, N] = {q.shape[:3]}, got {lf.shape}")
  cq, ck = forget_gate_decay(lf)
  return dot_product_attention(
      q, k, v, is_causal=is_causal, decay_bias=(cq, ck),
      decay_prune_threshold=prune_threshold, **kwargs)


# ----------------------------------------------------------------------------------------
# A09 SSMax attention, A10 adaptively sparse attention.


def ssmax_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, bias: ArrayLike | None = None,
                    mask: ArrayLike | None = None, *, s: ArrayLike = 0.43,
                    normalizer_params: Mapping[str, Any] | None = None, **kwargs: Any) -> jax.Array:
  r"""SSMax attention with a per-head ``s`` (feature A09; K. M. Nakanishi 2025).

  From "Scalable-Softmax Is Superior for Attention" (Nakanishi 2025, arXiv 2501.19399):

  .. math::
    \mathrm{SSMax}(z)_j = \frac{n^{s z_j}}{\sum_l n^{s z_l}}
      = \mathrm{softmax}\big((s \log n)\, z\big)_j

  on the scaled logits of each query row, with ``n`` the number of keys that row sees
  (causal and padding aware, so query ``i`` of a causal row uses ``n = i + 1``). A
  learned ``s`` is kept positive as ``s = softplus(z)`` (:func:`softplus_to_range`);
  ``jaxsoft.nn.MultiHeadAttention(normalizer="ssmax", learned=("s",))`` holds it.

  Args:
    q, k, v, bias, mask: as :func:`dot_product_attention`.
    s: a scalar or a per-head vector ``[N]`` (differentiable).
    normalizer_params: other SSMax hyperparameters (e.g. its optional ``bias``).
    **kwargs: other arguments of :func:`dot_product_attention`.
  """
  n_heads = _check_qkv_heads(q, "ssmax_attention")
  params = _merge_params(
      normalizer_params, {"s": per_head(s, n_heads, "s", "ssmax_attention")}, "ssmax_attention")
  return dot_product_attention(q, k, v, bias, mask, normalizer="ssmax", normalizer_params=params,
                               **kwargs)


def entmax_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, bias: ArrayLike | None = None,
                     mask: ArrayLike | None = None, *, alpha: ArrayLike = 1.5,
                     normalizer_params: Mapping[str, Any] | None = None,
                     **kwargs: Any) -> jax.Array:
  r"""alpha-entmax attention with a per-head ``alpha`` (feature A10; Correia et al. 2019).

  From "Adaptively Sparse Transformers" (G. M. Correia, V. Niculae & A. F. T. Martins,
  EMNLP 2019, arXiv 1909.00015):

  .. math::
    \alpha\text{-entmax}(z)_j = \big[(\alpha - 1) z_j - \tau\big]_+^{1/(\alpha-1)},
    \quad \tau \text{ such that } \textstyle\sum_j = 1

  on the scaled logits of each query row: ``alpha -> 1`` is softmax, ``alpha = 2``
  sparsemax; keys below the threshold get exactly zero weight. A learned ``alpha`` is
  kept above 1 as ``alpha = 1 + softplus(z)`` (:func:`softplus_to_range` with ``low=1``);
  ``jaxsoft.nn.MultiHeadAttention(normalizer="entmax", learned=("alpha",))`` holds it.
  The gradient with respect to ``alpha`` flows through the normalizer.

  Args:
    q, k, v, bias, mask: as :func:`dot_product_attention`.
    alpha: ``> 1``, a scalar or a per-head vector ``[N]`` (differentiable).
    **kwargs: other arguments of :func:`dot_product_attention`.
  """
  fn_name = "entmax_attention"
  n_heads = _check_qkv_heads(q, fn_name)
  try:
    a = np.asarray(alpha, dtype=np.float64)
  except Exception:
    a = None
  if a is not None and (np.any(np.isnan(a)) or np.any(a <= 1.0)):
    raise ValueError(f"{fn_name}: `alpha` must be > 1, got {alpha}")
  params = _merge_params(
      normalizer_params, {"alpha": per_head(alpha, n_heads, "alpha", fn_name)}, fn_name)
  return dot_product_attention(q, k, v, bias, mask, normalizer="entmax", normalizer_params=params,
                               **kwargs)


def sparsemax_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, bias: ArrayLike | None = None,
                        mask: ArrayLike | None = None, **kwargs: Any) -> jax.Array:
  r"""Sparsemax attention (feature A10 at ``alpha = 2``; Martins & Astudillo 2016).

  Sparsemax is from A. F. T. Martins & R. F. Astudillo, "From Softmax to Sparsemax: A
  Sparse Model of Attention and Multi-Label Classification" (ICML 2016, arXiv
  1602.02068):

  .. math:: \mathrm{sparsemax}(z) = \arg\min_{p \in \Delta} \lVert p - z \rVert^2

  on the scaled logits of each query row: the Euclidean projection onto the simplex.
  """
  return dot_product_attention(q, k, v, bias, mask, normalizer="sparsemax", **kwargs)
