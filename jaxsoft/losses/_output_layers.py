"""L13 large-output layers, part 2: VQ-logits, WaveRNN's dual softmax, PixelCNN++'s
discretised logistic mixture, the pointer sentinel mixture and softmax-CPR logits.

Conventions as in ``_large_output``: ``h [..., d]`` hidden states, ``w`` / ``codebook``
``[d, N]``, integer ``labels`` of the batch shape, ``where`` an example mask of
``labels``' shape; one loss per example in the input's dtype (bf16/fp16 computed in
float32); a False / ignored example gets loss 0 with zero gradient and a label outside
the valid range ``+inf`` (never NaN).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import positive_int
from jaxsoft.losses import _common as lc
from jaxsoft.losses._classification import softmax_cross_entropy_with_integer_labels
from jaxsoft.losses._large_output import check_hidden, check_ids, finish_labels
from jaxsoft.normalizers import common as nc

__all__ = [
    "discretized_logistic_mixture_loss",
    "dual_softmax_loss",
    "pointer_sentinel_log_probs",
    "pointer_sentinel_loss",
    "softmax_cpr_logits",
    "vq_logits",
    "vq_logits_cross_entropy",
]


def _float(a, name, fn) -> jax.Array:
  return lc.float_input(a, name, fn)


def _context_mask(context_where, shape, fn) -> jax.Array:
  """The mask of the context positions ``[..., L]`` (all True when ``context_where`` is None)."""
  if context_where is None:
    return jnp.ones(shape, bool)
  ctx = jnp.asarray(context_where)
  if ctx.shape != tuple(shape):
    raise ValueError(f"{fn}: `context_where` of shape {ctx.shape} must be {tuple(shape)}")
  return ctx.astype(bool)


def _scatter(values, ids, keep, n, mode):
  """Rows ``[..., n]`` holding ``values [..., L]`` at ``ids [..., L]`` (``keep`` only);
  ``mode`` "add" sums repeated ids, "set" writes (repeats must carry equal values)."""
  batch = ids.shape[:-1]
  rows = math.prod(batch)
  length = ids.shape[-1]
  ids2 = jnp.where(keep, ids, n).reshape(rows, length)       # n: dropped
  vals2 = jnp.broadcast_to(values, ids.shape).reshape(rows, length)
  r = jnp.arange(rows)[:, None]
  ref = jnp.zeros((rows, n), vals2.dtype).at[r, ids2]
  out = ref.add(vals2, mode="drop") if mode == "add" else ref.set(vals2, mode="drop")
  return out.reshape(batch + (n,))


# ----------------------------------------------------------------------------- VQ-logits


def _check_vq(h, codebook, assignment, fn) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
  h, c, dtype = check_hidden(h, codebook, fn, w_name="codebook")
  assignment = jnp.asarray(assignment)
  if assignment.ndim != 1:
    raise ValueError(f"{fn}: `assignment` must be [V] (the code of each class), got shape "
                     f"{assignment.shape}")
  assignment = check_ids(assignment, c.shape[1], "assignment", fn)
  return h, c, assignment, dtype


def vq_logits(h: ArrayLike, codebook: ArrayLike, assignment: ArrayLike, *,
              bias: ArrayLike | None = None) -> jax.Array:
  r"""VQ-Logits: vocabulary logits from a small codebook (feature L13).

  From "VQ-Logits: Compressing the Output Bottleneck of Large Language Models via Vector
  Quantized Logits" (2025): the ``[d, V]`` output matrix is replaced by a codebook
  :math:`C \in \mathbb{R}^{d \times K}`, K ≪ V, and a map :math:`\pi: V \to \{0..K-1\}`,

  .. math::
    l_v = h \cdot C_{:, \pi(v)} + b_v,

  i.e. K dot products scattered to the vocabulary: O(K·d + V) per example instead of
  O(V·d). It equals a dense layer with ``w = codebook[:, assignment]``; classes sharing a
  code get equal logits (without the bias), so equal probabilities. Whether the paper adds
  the per-class bias b is not known [R]; it is optional here.

  Args:
    h: ``[..., d]`` hidden states.
    codebook: ``[d, K]`` code vectors.
    assignment: ``[V]`` int code of each class.
    bias: optional ``[V]`` per-class bias.

  Returns:
    ``[..., V]`` logits in ``h``'s dtype.

  Examples:
    >>> h, codebook = jnp.array([[1.0, 2.0]]), jnp.array([[1.0, 0.0], [0.0, 1.0]])
    >>> print(js.losses.vq_logits(h, codebook, jnp.array([0, 1, 1, 0])))  # 4 classes, 2 codes
    [[1. 2. 2. 1.]]

  References:
    "VQ-Logits: Compressing the Output Bottleneck of Large Language Models via Vector Quantized
    Logits", 2025 (its authors are not recorded here).
  """
  fn = "vq_logits"
  h, c, assignment, dtype = _check_vq(h, codebook, assignment, fn)
  out = jnp.take(h @ c, assignment, axis=-1)
  if bias is not None:
    b = _float(bias, "bias", fn)
    if b.shape != assignment.shape:
      raise ValueError(f"{fn}: `bias` of shape {b.shape} must be [V] = {assignment.shape}")
    out = out + lc.at_rank(b.astype(out.dtype), out.ndim)
  return out.astype(dtype)


def vq_logits_cross_entropy(h: ArrayLike, codebook: ArrayLike, assignment: ArrayLike,
                            labels: ArrayLike, *, where: ArrayLike | None = None,
                            ignore_index: int | None = None) -> jax.Array:
  r"""Softmax CE of :func:`vq_logits` (no bias) without the ``[..., V]`` logits (feature L13).

  With :math:`z_k = h \cdot C_{:,k}` and :math:`n_k = |\pi^{-1}(k)|` the classes of code k,

  .. math::
    \ell = -\log \frac{e^{z_{\pi(y)}}}{\sum_k n_k\, e^{z_k}}
         = \mathrm{LSE}_k(z_k + \log n_k) - z_{\pi(y)},

  so the cost is O(K·d + V) (the code counts) and the result equals the softmax CE of the
  scattered logits. Codes with no class (:math:`n_k = 0`) drop out.

  Args:
    h: ``[..., d]`` hidden states.
    codebook: ``[d, K]`` code vectors.
    assignment: ``[V]`` int code of each class.
    labels: integer classes of ``h``'s shape without its last axis.
    where: optional example mask of ``labels``' shape.
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``h``'s dtype.

  Examples:
    >>> h, codebook = jnp.array([[1.0, 2.0]]), jnp.array([[1.0, 0.0], [0.0, 1.0]])
    >>> assignment, y = jnp.array([0, 1, 1, 0]), jnp.array([1])
    >>> print(js.losses.vq_logits_cross_entropy(h, codebook, assignment, y))
    [1.0064]
    >>> print(js.losses.softmax_cross_entropy_with_integer_labels(
    ...     js.losses.vq_logits(h, codebook, assignment), y))
    [1.0064]

  References:
    "VQ-Logits: Compressing the Output Bottleneck of Large Language Models via Vector Quantized
    Logits", 2025 (its authors are not recorded here).
  """
  fn = "vq_logits_cross_entropy"
  h, c, assignment, dtype = _check_vq(h, codebook, assignment, fn)
  v, k = assignment.shape[0], c.shape[1]
  labels, keep = lc.example_labels(labels, h.shape[:-1], where, ignore_index, fn)
  z = h @ c
  counts = jnp.zeros((k,), z.dtype).at[assignment].add(1.0)
  used = counts > 0
  log_n = jnp.where(used, jnp.log(jnp.where(used, counts, 1.0)), 0.0)
  lse, _ = lc.masked_logsumexp(z + lc.at_rank(log_n, z.ndim), jnp.broadcast_to(used, z.shape), -1)
  code_y = assignment[jnp.where((labels >= 0) & (labels < v), labels, 0)]
  z_y = jnp.take_along_axis(z, code_y[..., None], axis=-1)[..., 0]
  return finish_labels(lse - z_y, labels, v, keep, dtype)


# --------------------------------------------------------------------------- dual softmax


def dual_softmax_loss(coarse_logits: ArrayLike, fine_logits: ArrayLike, labels: ArrayLike, *,
                      where: ArrayLike | None = None,
                      ignore_index: int | None = None) -> jax.Array:
  r"""WaveRNN's dual softmax over a value split into coarse and fine parts (feature L13).

  From N. Kalchbrenner, E. Elsen, K. Simonyan, S. Noury, N. Casagrande, E. Lockhart,
  F. Stimberg, A. van den Oord, S. Dieleman & K. Kavukcuoglu, "Efficient Neural Audio
  Synthesis" (ICML 2018). A value :math:`y = c\,K_f + f` (16-bit audio: the high and the
  low 8 bits, :math:`K_c = K_f = 256`) is predicted as

  .. math::
    \ell = -\log \mathrm{softmax}(z^c)_c - \log \mathrm{softmax}(z^f)_f,

  where the fine logits :math:`z^f` are those computed given the true coarse part c
  (teacher forcing). The factorised distribution sums to 1 over all :math:`K_c K_f`
  values and costs :math:`K_c + K_f` logits instead of :math:`K_c K_f`.

  Args:
    coarse_logits: ``[..., K_c]`` logits of the coarse part.
    fine_logits: ``[..., K_f]`` logits of the fine part given the true coarse part.
    labels: integer values in ``[0, K_c K_f)`` of the batch shape.
    where: optional example mask of ``labels``' shape.
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``coarse_logits``' dtype.

  Examples:
    >>> coarse, fine = jnp.zeros((1, 4)), jnp.zeros((1, 4))  # 16 values y = 4 c + f
    >>> print(js.losses.dual_softmax_loss(coarse, fine, jnp.array([13])))  # uniform: log 16
    [2.7726]

  References:
    N. Kalchbrenner, E. Elsen, K. Simonyan, S. Noury, N. Casagrande, E. Lockhart, F. Stimberg,
    A. van den Oord, S. Dieleman & K. Kavukcuoglu, 2018, "Efficient Neural Audio Synthesis"
    (ICML).
  """
  fn = "dual_softmax_loss"
  zc = lc.check_logits(coarse_logits, fn)
  zf = lc.check_logits(fine_logits, fn)
  if zc.shape[:-1] != zf.shape[:-1]:
    raise ValueError(f"{fn}: `coarse_logits` {zc.shape} and `fine_logits` {zf.shape} must have "
                     "the same batch shape")
  labels, keep = lc.example_labels(labels, zc.shape[:-1], where, ignore_index, fn)
  kc, kf = zc.shape[-1], zf.shape[-1]
  y = jnp.where((labels >= 0) & (labels < kc * kf), labels, 0)
  ct = nc.compute_dtype(jnp.result_type(zc.dtype, zf.dtype))
  loss = (softmax_cross_entropy_with_integer_labels(zc.astype(ct), y // kf)
          + softmax_cross_entropy_with_integer_labels(zf.astype(ct), y % kf))
  return finish_labels(loss, labels, kc * kf, keep, zc.dtype)


# --------------------------------------------------------- discretised logistic mixture


def _log_bin_mass(x, half, mean, log_scale, first, last):
  """log[σ((x + half − μ)/s) − σ((x − half − μ)/s)], open at the edge bins, stably."""
  inv_s = jnp.exp(-log_scale)
  a = (x + half - mean) * inv_s
  b = (x - half - mean) * inv_s
  # σ(a) − σ(b) = σ(b)·(1 − σ(a))·(e^{a−b} − 1), exact and free of cancellation.
  mid = jax.nn.log_sigmoid(b) - jax.nn.softplus(a) + jnp.log(jnp.expm1(a - b))
  return jnp.where(first, jax.nn.log_sigmoid(a), jnp.where(last, jax.nn.log_sigmoid(-b), mid))


def discretized_logistic_mixture_loss(logit_weights: ArrayLike, means: ArrayLike,
                                      log_scales: ArrayLike, labels: ArrayLike, *,
                                      num_bins: int = 256, where: ArrayLike | None = None,
                                      ignore_index: int | None = None) -> jax.Array:
  r"""PixelCNN++'s discretised logistic mixture likelihood, negated (feature L13).

  From T. Salimans, A. Karpathy, X. Chen & D. P. Kingma, "PixelCNN++: Improving the
  PixelCNN with Discretized Logistic Mixture Likelihood and Other Modifications"
  (ICLR 2017). Bin :math:`k \in \{0..B-1\}` has centre :math:`x = 2k/(B-1) - 1` in
  [-1, 1] and half-width :math:`\delta = 1/(B-1)`; with :math:`\pi = \mathrm{softmax}`
  of the mixture logits,

  .. math::
    P(k) = \sum_m \pi_m \Bigl[\sigma\Bigl(\frac{x + \delta - \mu_m}{s_m}\Bigr)
      - \sigma\Bigl(\frac{x - \delta - \mu_m}{s_m}\Bigr)\Bigr],

  where the edge bins extend to :math:`\mp\infty` (their outer σ is 0 or 1), so the B
  probabilities telescope to exactly 1. Each bin's mass is computed in log space as
  :math:`\log\sigma(b) - \mathrm{softplus}(a) + \log(e^{a-b} - 1)`, without the
  cancellation of the difference of sigmoids (the authors' code switches to the density
  at the bin centre instead). :math:`\log s` is clamped below at -7 as in that code.
  The coupling of the RGB channels' means (each shifted by the previous channels) is the
  caller's: compute ``means`` per channel and call this once per channel.

  Args:
    logit_weights: ``[..., M]`` mixture logits.
    means: ``[..., M]`` component locations :math:`\mu` (in [-1, 1] units).
    log_scales: ``[..., M]`` :math:`\log s`.
    labels: integer bins in ``[0, num_bins)`` of the batch shape.
    num_bins: B >= 2 (256 for 8-bit data).
    where: optional example mask of ``labels``' shape.
    ignore_index: a label value whose examples get loss 0.

  Returns:
    :math:`-\log P(\text{label})` per example, in ``logit_weights``' dtype.

  Examples:
    >>> w, mu, log_s = jnp.zeros((4, 1)), jnp.zeros((4, 1)), jnp.full((4, 1), -1.0)
    >>> p = jnp.exp(-js.losses.discretized_logistic_mixture_loss(w, mu, log_s, jnp.arange(4), num_bins=4))
    >>> print(p, round(float(p.sum()), 4))  # the 4 bins' probabilities sum to 1
    [0.1404 0.3596 0.3596 0.1404] 1.0

  References:
    T. Salimans, A. Karpathy, X. Chen & D. P. Kingma, 2017, "PixelCNN++: Improving the PixelCNN
    with Discretized Logistic Mixture Likelihood and Other Modifications" (ICLR).
  """
  fn = "discretized_logistic_mixture_loss"
  logits = lc.check_logits(logit_weights, fn)
  dtype = logits.dtype
  shape = logits.shape
  mu = _float(means, "means", fn)
  ls = _float(log_scales, "log_scales", fn)
  for name, a in (("means", mu), ("log_scales", ls)):
    if a.shape != shape:
      raise ValueError(f"{fn}: `{name}` of shape {a.shape} must have `logit_weights`' shape "
                       f"{shape}")
  b_count = positive_int(num_bins, "num_bins", fn)
  if b_count < 2:
    raise ValueError(f"{fn}: `num_bins` must be an int >= 2, got {num_bins!r}")
  labels, keep = lc.example_labels(labels, shape[:-1], where, ignore_index, fn)
  ct = nc.compute_dtype(dtype)
  k = jnp.clip(labels, 0, b_count - 1)
  x = (2.0 * k.astype(ct) / (b_count - 1) - 1.0)[..., None]
  log_p = _log_bin_mass(x, 1.0 / (b_count - 1), mu.astype(ct), jnp.maximum(ls.astype(ct), -7.0),
                        (k == 0)[..., None], (k == b_count - 1)[..., None])
  log_pi = jax.nn.log_softmax(logits.astype(ct), axis=-1)
  loss = -jax.nn.logsumexp(log_pi + log_p, axis=-1)
  return finish_labels(loss, labels, b_count, keep, dtype)


# --------------------------------------------------------------- pointer sentinel mixture


def pointer_sentinel_log_probs(vocab_logits: ArrayLike, pointer_scores: ArrayLike,
                               sentinel_score: ArrayLike, context_ids: ArrayLike, *,
                               context_where: ArrayLike | None = None) -> jax.Array:
  r"""The pointer sentinel mixture's log-probabilities over the vocabulary (feature L13).

  From S. Merity, C. Xiong, J. Bradbury & R. Socher, "Pointer Sentinel Mixture Models"
  (ICLR 2017). With pointer scores :math:`z_i = q \cdot h_i` over the L context positions
  and the sentinel score :math:`q \cdot s`,

  .. math::
    a = \mathrm{softmax}([z; q \cdot s]), \quad g = a_{L+1}, \quad
    p(w) = g\,\mathrm{softmax}(u)_w + \sum_{i:\, x_i = w} a_i,

  so p sums to 1, a word absent from the context gets :math:`g\,p_{\text{vocab}}(w)`, and
  the gate g is learned through the sentinel. Masked context positions
  (``context_where`` False) take no attention.

  Args:
    vocab_logits: ``[..., V]`` logits u of the vocabulary softmax.
    pointer_scores: ``[..., L]`` scores :math:`z_i` of the context positions.
    sentinel_score: ``[...]`` the sentinel's score.
    context_ids: ``[..., L]`` int word ids :math:`x_i` in ``[0, V)``.
    context_where: optional ``[..., L]`` mask of the context positions.

  Returns:
    ``[..., V]`` log-probabilities in ``vocab_logits``' dtype.

  Examples:
    >>> vocab, ptr = jnp.array([[1.0, 0.0, 0.0, -1.0]]), jnp.array([[2.0, 0.0]])
    >>> ids = jnp.array([[3, 3]])  # both context positions hold word 3
    >>> log_p = js.losses.pointer_sentinel_log_probs(vocab, ptr, jnp.array([0.0]), ids)
    >>> print(jnp.exp(log_p), round(float(jnp.exp(log_p).sum()), 4))
    [[0.0569 0.0209 0.0209 0.9012]] 1.0

  References:
    S. Merity, C. Xiong, J. Bradbury & R. Socher, 2017, "Pointer Sentinel Mixture Models"
    (ICLR).
  """
  fn = "pointer_sentinel_log_probs"
  return _pointer(vocab_logits, pointer_scores, sentinel_score, context_ids, context_where,
                  None, fn)


def pointer_sentinel_loss(vocab_logits: ArrayLike, pointer_scores: ArrayLike,
                          sentinel_score: ArrayLike, context_ids: ArrayLike, labels: ArrayLike, *,
                          context_where: ArrayLike | None = None, where: ArrayLike | None = None,
                          ignore_index: int | None = None) -> jax.Array:
  r""":math:`-\log p(y)` of :func:`pointer_sentinel_log_probs` (feature L13).

  Args:
    vocab_logits, pointer_scores, sentinel_score, context_ids, context_where: as
      :func:`pointer_sentinel_log_probs`.
    labels: integer words of the batch shape.
    where: optional example mask of ``labels``' shape.
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``vocab_logits``' dtype.

  Examples:
    >>> vocab, ptr = jnp.array([[1.0, 0.0, 0.0, -1.0]]), jnp.array([[2.0, 0.0]])
    >>> ids = jnp.array([[3, 3]])
    >>> print(js.losses.pointer_sentinel_loss(vocab, ptr, jnp.array([0.0]), ids, jnp.array([3])))
    [0.104]

  References:
    S. Merity, C. Xiong, J. Bradbury & R. Socher, 2017, "Pointer Sentinel Mixture Models"
    (ICLR).
  """
  fn = "pointer_sentinel_loss"
  return _pointer(vocab_logits, pointer_scores, sentinel_score, context_ids, context_where,
                  (labels, where, ignore_index), fn)


def _pointer(vocab_logits, pointer_scores, sentinel_score, context_ids, context_where, target, fn):
  u = lc.check_logits(vocab_logits, fn)
  dtype = u.dtype
  ct = nc.compute_dtype(dtype)
  batch, v = u.shape[:-1], u.shape[-1]
  z = _float(pointer_scores, "pointer_scores", fn)
  if z.ndim != u.ndim or z.shape[:-1] != batch:
    raise ValueError(f"{fn}: `pointer_scores` of shape {z.shape} must be {batch} + (L,)")
  s = _float(sentinel_score, "sentinel_score", fn)
  if s.shape != batch:
    raise ValueError(f"{fn}: `sentinel_score` of shape {s.shape} must be {batch}")
  ids = check_ids(context_ids, v, "context_ids", fn, shape=z.shape)
  ctx = _context_mask(context_where, z.shape, fn)
  zs = jnp.concatenate([z.astype(ct), s.astype(ct)[..., None]], axis=-1)
  amask = jnp.concatenate([ctx, jnp.ones(batch + (1,), bool)], axis=-1)
  zs = jnp.where(amask, zs, 0.0)
  lse_a, _ = lc.masked_logsumexp(zs, amask, -1)
  log_a = zs - lse_a[..., None]
  log_g = log_a[..., -1]
  a = jnp.where(ctx, jnp.exp(log_a[..., :-1]), 0.0)
  ptr = _scatter(a, ids, ctx, v, "add")                       # [..., V]
  log_pv = jax.nn.log_softmax(u.astype(ct), axis=-1)
  if target is None:
    return _mix(log_g[..., None], log_pv, ptr).astype(dtype)
  labels, where, ignore_index = target
  labels, keep = lc.example_labels(labels, batch, where, ignore_index, fn)
  y = jnp.where((labels >= 0) & (labels < v), labels, 0)[..., None]
  log_p = _mix(log_g, jnp.take_along_axis(log_pv, y, -1)[..., 0],
               jnp.take_along_axis(ptr, y, -1)[..., 0])
  return finish_labels(-log_p, labels, v, keep, dtype)


def _mix(log_g, log_pv, ptr):
  """log(g·p_vocab + ptr), exact in log space where ptr = 0."""
  hit = ptr > 0
  return jnp.where(hit, jnp.log(jnp.where(hit, jnp.exp(log_g + log_pv) + ptr, 1.0)),
                   log_g + log_pv)


# ----------------------------------------------------------------------------- softmax-CPR


def softmax_cpr_logits(h: ArrayLike, w: ArrayLike, *, bias: ArrayLike | None = None,
                       context_ids: ArrayLike | None = None,
                       context_where: ArrayLike | None = None,
                       context_h: ArrayLike | None = None, reranker_h: ArrayLike | None = None,
                       k: int | None = None,
                       pointer_scores: ArrayLike | None = None) -> jax.Array:
  r"""Softmax-CPR output logits: context, reranker and pointer partitions (feature L13).

  From H.-S. Chang, Z. Yao, A. Gon, H. Yu & A. McCallum, "Revisiting the Architectures
  like Pointer Networks to Efficiently Improve the Next Word Distribution, Summarization
  Factuality, and Beyond" (Findings of ACL 2023). Starting from the usual logits
  :math:`l_v = h \cdot w_{:,v} + b_v`, each partition adds a dot product with its own
  projection of the final hidden state, on a few words only [R: the partitions' exact
  parametrisation is reconstructed]:

  .. math::
    l'_v = l_v + [v \in \mathcal{C}]\, h_c \cdot w_{:,v}
      + [v \in \mathrm{top}_k(l)]\, h_r \cdot w_{:,v}
      + \sum_{t:\, x_t = v} z_t,

  with :math:`\mathcal{C}` the words of the context ``context_ids`` (C, ``context_h``),
  the k words of largest :math:`l` (R, ``reranker_h``; the selection carries no gradient)
  and pointer scores :math:`z_t` of the context positions (P, ``pointer_scores``, e.g.
  :math:`h_p \cdot g_t`). The softmax of :math:`l'` (e.g.
  :func:`softmax_cross_entropy_with_integer_labels`) is no longer limited by the rank
  d + 1 of :math:`\log\mathrm{softmax}(h w)` (the softmax bottleneck). With no partition
  (or zero projections) the logits are the plain ``h @ w + bias``.

  Args:
    h: ``[..., d]`` hidden states.
    w: ``[d, V]`` output vectors.
    bias: optional ``[V]`` bias.
    context_ids: ``[..., L]`` int context words (needed by C and P).
    context_where: optional ``[..., L]`` mask of the context positions.
    context_h: optional ``[..., d]`` projection :math:`h_c` (C partition).
    reranker_h: optional ``[..., d]`` projection :math:`h_r` (R partition, with ``k``).
    k: the reranker's number of words, ``1 <= k <= V``.
    pointer_scores: optional ``[..., L]`` pointer scores (P partition).

  Returns:
    ``[..., V]`` logits in ``h``'s dtype.

  Examples:
    >>> h, w = jnp.array([[1.0, 0.0]]), jnp.array([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    >>> print(js.losses.softmax_cpr_logits(h, w))  # no partition: h @ w
    [[ 1.  0. -1.]]
    >>> print(js.losses.softmax_cpr_logits(h, w, context_ids=jnp.array([[2]]),
    ...     pointer_scores=jnp.array([[3.0]])))  # P: word 2's pointer score added
    [[1. 0. 2.]]

  References:
    H.-S. Chang, Z. Yao, A. Gon, H. Yu & A. McCallum, 2023, "Revisiting the Architectures like
    Pointer Networks to Efficiently Improve the Next Word Distribution, Summarization
    Factuality, and Beyond" (Findings of ACL).
  """
  fn = "softmax_cpr_logits"
  h, w, dtype = check_hidden(h, w, fn)
  batch, v = h.shape[:-1], w.shape[1]
  logits = h @ w
  if bias is not None:
    b = _float(bias, "bias", fn)
    if b.shape != (v,):
      raise ValueError(f"{fn}: `bias` of shape {b.shape} must be [{v}]")
    logits = logits + lc.at_rank(b.astype(logits.dtype), logits.ndim)
  out = logits

  def proj(a, name):
    a = _float(a, name, fn)
    if a.shape != h.shape:
      raise ValueError(f"{fn}: `{name}` of shape {a.shape} must have `h`'s shape {h.shape}")
    return a.astype(h.dtype)

  if context_h is not None or pointer_scores is not None:
    if context_ids is None:
      raise ValueError(f"{fn}: `context_ids` is required with `context_h` or `pointer_scores`")
    ids = jnp.asarray(context_ids)
    if ids.ndim != h.ndim or ids.shape[:-1] != batch:
      raise ValueError(f"{fn}: `context_ids` of shape {ids.shape} must be {batch} + (L,)")
    ids = check_ids(ids, v, "context_ids", fn)
    ctx = _context_mask(context_where, ids.shape, fn)
    if context_h is not None:
      hc = proj(context_h, "context_h")
      vals = jnp.einsum("...d,...ld->...l", hc, jnp.take(w.T, ids, axis=0))
      out = out + _scatter(vals, ids, ctx, v, "set")
    if pointer_scores is not None:
      z = _float(pointer_scores, "pointer_scores", fn)
      if z.shape != ids.shape:
        raise ValueError(f"{fn}: `pointer_scores` of shape {z.shape} must be {ids.shape}")
      out = out + _scatter(z.astype(h.dtype), ids, ctx, v, "add")
  if reranker_h is not None:
    k = lc.int_in_range(k, "k", 1, v, fn, " with `reranker_h`")
    hr = proj(reranker_h, "reranker_h")
    _, top = jax.lax.top_k(jax.lax.stop_gradient(logits), k)
    vals = jnp.einsum("...d,...kd->...k", hr, jnp.take(w.T, top, axis=0))
    out = out + _scatter(vals, top, jnp.ones(top.shape, bool), v, "set")
  return out.astype(dtype)
