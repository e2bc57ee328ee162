r"""BLASST's threshold calibration: :math:`\lambda = c / L` (feature A12).

BLASST skips a key block for a query row when the block's largest logit lies more than
:math:`\tau = \ln(1/\lambda)` below the row's running max (:func:`block_sparse_attention`,
``method="blasst"``). Its abstract reports an inverse relation between the best threshold
and the context length; this module takes that rule as :math:`\lambda(L) = c / L` with a
constant c fitted once, so that

.. math::
  \tau(L) = \max\big(0,\ \ln(L / c)\big)

for a call with L keys. The skip decision of a (row, block) pair does not depend on
:math:`\tau` except through the comparison itself: a skipped block lies below the running
max, so the running max is the prefix max of all visited block maxima, and the pair is
skipped iff its *margin* :math:`\delta = m^{(j-1)} - \tilde m^{(j)}` exceeds :math:`\tau`.
With :math:`z = \delta - \ln L` the pair is skipped iff :math:`z > -\ln c`, so the c that
skips a fraction s of the pairs of a sample is a quantile, no search:

.. math::
  c = \exp\big(-Q_{1-s}(z)\big).

Sparsity-aware training (the skip active in the forward pass) needs no other function: the
blasst path is differentiable in query, key and value with the block choice held fixed
(its backward visits only the kept pairs, a straight-through treatment of the piecewise-
constant decision), so a model calls :func:`block_sparse_attention` with
``skip_calibration=c`` in its training step; tests/attention/test_blasst_calibration.py
trains such a model with plain gradient steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.typing import ArrayLike

from jaxsoft.attention._checks import check_int

__all__ = ["blasst_calibrate", "blasst_skip_threshold"]


def blasst_skip_threshold(length: int, calibration: float) -> float:
  r"""BLASST's skip threshold :math:`\tau(L) = \max(0, \ln(L / c))`, i.e. :math:`\lambda = c / L`.

  A key block is skipped when its max logit is below the running max minus :math:`\tau`
  (``skip_threshold`` of :func:`block_sparse_attention`); :math:`\tau = \ln(1/\lambda)`
  with :math:`\lambda(L) = c / L`, the threshold's inverse relation to the context length
  that BLASST reports. :math:`\tau` is clipped at 0 (``L <= c``: a negative threshold
  would skip blocks above the running max).

  Args:
    length: L, the number of keys of the call (an int >= 1).
    calibration: c > 0 (:func:`blasst_calibrate`).

  Returns:
    tau, a float >= 0.

  Examples:
    >>> js.attention.blasst_skip_threshold(1024, 4.0) == math.log(256.0)
    True

  References:
    BLASST, 2025, skip-softmax block skipping with a threshold calibrated per context
    length (authors and full title not recorded in this project's sources; the rule as in
    NVIDIA Model-Optimizer's skip-softmax kernel, which cites it).
  """
  fn = "blasst_skip_threshold"
  length = check_int(length, "length", 1, fn)
  c = float(calibration)
  if not (c > 0 and math.isfinite(c)):
    raise ValueError(f"{fn}: `calibration` must be a finite number > 0, got {calibration!r}")
  return max(0.0, math.log(length / c))


def _margins(q, k, bs: int, scale: float | None, causal: bool, kv_len):
  """The skip margins of one sample: m^(j-1) - m̃^(j) per visible (row, key block) pair in
  BLASST's visiting order (own block, then backwards, wrapping when not causal), -inf for
  a pair that is never skipped (the first visible block of its row). float64, numpy."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  if k.ndim != 4 or k.shape[0] != B or k.shape[3] != H or K < 1 or N % K:
    raise ValueError(f"blasst_calibrate: `key` must be [B, S, K, H] matching `query` "
                     f"{q.shape} (N % K == 0), got {k.shape}")
  s = (1.0 / math.sqrt(H) if scale is None else float(scale))
  kk = np.repeat(k, N // K, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, kk) * s
  vis = np.ones((B, 1, T, S), bool)
  if kv_len is not None:
    vis = vis & (np.arange(S)[None, None, None, :] < np.asarray(kv_len).reshape(B, 1, 1, 1))
  if causal:
    vis = vis & (np.arange(S)[None, :] <= np.arange(T)[:, None])[None, None]
  nk = -(-S // bs)
  x = np.where(vis, logits, -np.inf)
  x = np.pad(x, [(0, 0)] * 3 + [(0, nk * bs - S)], constant_values=-np.inf)
  M = x.reshape(B, N, T, nk, bs).max(-1)  # [B, N, T, nk]
  diag = np.minimum(np.arange(T) // bs, nk - 1)
  order = (diag[:, None] - np.arange(nk)[None, :]) % nk
  Mo = np.take_along_axis(M, np.broadcast_to(order, M.shape), axis=-1)
  prev = np.maximum.accumulate(Mo, axis=-1)
  prev = np.concatenate([np.full_like(prev[..., :1], -np.inf), prev[..., :-1]], -1)
  seen = Mo != -np.inf
  with np.errstate(invalid="ignore"):
    margin = np.where(prev == -np.inf, -np.inf, prev - Mo)
  return margin[seen]


def blasst_calibrate(query: ArrayLike | Sequence[ArrayLike], key: ArrayLike | Sequence[ArrayLike],
                     *, target_sparsity: float, block_size: int = 64, scale: float | None = None,
                     is_causal: bool = False,
                     key_value_seq_lengths: ArrayLike | Sequence[ArrayLike | None] | None = None
                     ) -> float:
  r"""Fits BLASST's constant c of :math:`\lambda(L) = c / L` to a target sparsity.

  For every visible (query row, key block) pair of the sample, in BLASST's visiting order
  (the row's own block, then backwards), the margin
  :math:`\delta = m^{(j-1)} - \tilde m^{(j)}` (running max of the blocks before minus the
  block's max logit; a row's first block has none and is never skipped) decides the skip:
  the pair is skipped iff :math:`\delta > \tau(L) = \ln(L / c)`. With
  :math:`z = \delta - \ln L` (L = the sample's key length S) the fraction skipped is the
  fraction of :math:`z > -\ln c`, so

  .. math::
    c = \exp\big(-Q_{1 - s}(z)\big)

  with :math:`Q_{1-s}` the (1 - s)-quantile of z over all pairs of all samples (pooled
  over several lengths: the c that fits them together). Then
  ``block_sparse_attention(..., method="blasst", skip_calibration=c)`` skips about the
  fraction s of the pairs at every length where the :math:`1/L` rule holds. Sparsity here
  is skipped pairs / visible pairs, as ``return_stats``' ``kept_tokens`` counts them. The
  margins are computed from dense float64 scores (numpy): a calibration sample, not a
  long context.

  Args:
    query: [B, T, N, H], or a sequence of such arrays (samples of different lengths).
    key: [B, S, K, H] (N % K == 0), or a sequence matching ``query``.
    target_sparsity: s in (0, 1), the fraction of (row, block) pairs to skip.
    block_size: the block size the attention calls will use.
    scale: logit scale (None = 1/sqrt(H)); is_causal: query i sees keys j <= i.
    key_value_seq_lengths: optional int [B] (or one per sample, or None).

  Returns:
    c, a float > 0. ValueError when fewer than the fraction s of the sample's pairs can
    be skipped at all.

  Examples:
    Calibrate on two lengths, then check the sparsity at a third:

    >>> rng = np.random.default_rng(0)
    >>> xs = [rng.standard_normal((1, n, 1, 16)).astype("f4") * 2 for n in (128, 256)]
    >>> c = js.attention.blasst_calibrate(xs, xs, target_sparsity=0.5, block_size=16,
    ...                                   is_causal=True)
    >>> x = rng.standard_normal((1, 192, 1, 16)).astype("f4") * 2
    >>> _, st = js.attention.block_sparse_attention(
    ...     x, x, x, method="blasst", block_size=16, is_causal=True, skip_calibration=c,
    ...     return_stats=True)
    >>> vis = np.tril(np.ones((12, 12), bool)).repeat(16, 0)  # [T, nk] causal pairs
    >>> kept = np.asarray(st["kept_tokens"][0, 0])
    >>> float(round(1 - kept.sum() / vis.sum(), 1))
    0.5

  References:
    BLASST, 2025, skip-softmax block skipping with a threshold inversely related to the
    context length (authors and full title not recorded in this project's sources; the
    rule as in NVIDIA Model-Optimizer's skip-softmax kernel, which cites it).
  """
  fn = "blasst_calibrate"
  bs = check_int(block_size, "block_size", 1, fn)
  s = float(target_sparsity)
  if not 0 < s < 1:
    raise ValueError(f"{fn}: `target_sparsity` must be in (0, 1), got {target_sparsity!r}")
  many = isinstance(query, (list, tuple))
  qs: list[Any] = list(query) if isinstance(query, (list, tuple)) else [query]
  ks: list[Any] = list(key) if isinstance(key, (list, tuple)) else [key]
  if len(ks) != len(qs) or not qs:
    raise ValueError(f"{fn}: `query` and `key` must be arrays or sequences of the same "
                     f"(nonzero) length, got {len(qs)} and {len(ks)}")
  lens: list[Any]
  if key_value_seq_lengths is None:
    lens = [None] * len(qs)
  elif many:
    lens = list(key_value_seq_lengths)  # type: ignore[arg-type]
  else:
    lens = [key_value_seq_lengths]
  if len(lens) != len(qs):
    raise ValueError(f"{fn}: `key_value_seq_lengths` needs one entry per sample, got "
                     f"{len(lens)} for {len(qs)}")
  zs = []
  for q, k, kl in zip(qs, ks, lens, strict=True):
    if np.ndim(q) != 4 or np.ndim(k) != 4:
      raise ValueError(f"{fn}: `query` [B, T, N, H] and `key` [B, S, K, H] must be 4-d, got "
                       f"{np.shape(q)} and {np.shape(k)}")
    zs.append(_margins(q, k, bs, scale, bool(is_causal), kl) - math.log(np.shape(k)[1]))
  z = np.concatenate(zs)
  if np.isnan(z).any():
    raise ValueError(f"{fn}: the sample's logits hold NaN")
  thr = float(np.quantile(z, 1.0 - s, method="higher"))
  if thr == -math.inf:  # fewer skippable pairs than the target (one block per row, ...)
    raise ValueError(f"{fn}: the sample cannot reach `target_sparsity`={s}: only "
                     f"{np.isfinite(z).mean():.3f} of its (row, block) pairs can be skipped "
                     "(a row's first block never is); use longer samples or a smaller "
                     "`block_size`")
  # the pairs skipped are z > -ln c: the (1 - s) quantile (ties: at most s skipped)
  return float(math.exp(min(-thr, 700.0)))
