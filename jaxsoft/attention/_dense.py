"""implementation="xla": the dense reference, written for clarity, not speed.

Every other implementation is a faster way to compute exactly this.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.attention.call import AttentionCall
from jaxsoft.attention.masks import MaskStructure
from jaxsoft.attention.scores import safe_distance
from jaxsoft.normalizers import spec as _spec
from jaxsoft.normalizers import tile
from jaxsoft.normalizers.common import compute_dtype, jit_under_debug_checks, visible_count

__all__ = ["dense_logits", "dense_weights", "dense_attention", "row_statistic"]


def dense_logits(q: ArrayLike, k: ArrayLike, *, scale: float,
                 decay_bias: tuple[ArrayLike, ArrayLike] | None = None,
                 logits_soft_cap: float | None = None, bias: ArrayLike | None = None,
                 score: str = "dot") -> jax.Array:
  r"""The attention logits every implementation computes, in the order all paths use.

  .. math::
    \ell_{bnij} = c\,\tanh\!\Big(\frac{s\, q_{bin} \cdot k_{bj\kappa(n)}
        + cq_{bin} - ck_{bjn}}{c}\Big) + \mathrm{bias}_{bnij}

  with s the scale, c the soft cap (no tanh when None), the decay terms only with
  ``decay_bias=(cq, ck)``, and kappa(n) = n // (N / K) the key/value head of query
  head n (GQA; jax.nn's grouping). With ``score="distance"`` the Euclidean distance
  ``||q_{bin} - k_{bj\kappa(n)}||`` (:func:`safe_distance` of the expanded square) replaces
  ``s q·k`` (``scale`` is then ignored).

  Args:
    q: queries [B, T, N, H]; k: keys [B, S, K, H] (N % K == 0).
    scale: s, the logit scale (a Python float).
    decay_bias: None or ``(cq [B, T, N], ck [B, S, N])`` (e.g. :func:`forget_gate_decay`).
    logits_soft_cap: None or c > 0.
    bias: None or an array broadcastable to [B, N, T, S], added last.
    score: ``"dot"`` or ``"distance"``.

  Returns:
    [B, N, T, S] in float32 (float64 for float64 inputs).

  Examples:
    >>> q = jnp.ones((1, 2, 2, 4))   # [B, T, N, H]
    >>> k = jnp.ones((1, 3, 1, 4))   # [B, S, K, H]: one key/value head for both heads
    >>> logits = js.attention.dense_logits(q, k, scale=0.5)
    >>> logits.shape, logits[0, 1]
    ((1, 2, 2, 3), Array([[2., 2., 2.],
           [2., 2., 2.]], dtype=float32))

  References:
    A. Vaswani, N. Shazeer, N. Parmar, J. Uszkoreit, L. Jones, A. N. Gomez, Ł. Kaiser &
    I. Polosukhin, 2017, "Attention Is All You Need".

    J. Ainslie, J. Lee-Thorp, M. de Jong, Y. Zemlyanskiy, F. Lebrón & S. Sanghai, 2023,
    "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints".
  """
  q, k = jnp.asarray(q), jnp.asarray(k)
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  cdt = compute_dtype(q.dtype)  # float32 (float64 for float64 inputs)
  qg = q.astype(cdt).reshape(B, T, K, G, H)
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(cdt))
  if score == "distance":
    qn = jnp.transpose(jnp.sum(qg * qg, axis=-1), (0, 2, 3, 1))[..., None]  # [B, K, G, T, 1]
    kf = k.astype(cdt)
    kn = jnp.transpose(jnp.sum(kf * kf, axis=-1), (0, 2, 1))[:, :, None, None, :]  # [B,K,1,1,S]
    logits = safe_distance(qn + kn - 2.0 * logits).reshape(B, N, T, k.shape[1])
  else:
    logits = scale * logits.reshape(B, N, T, k.shape[1])
  if decay_bias is not None:
    cq, ck = jnp.asarray(decay_bias[0], cdt), jnp.asarray(decay_bias[1], cdt)
    logits = logits + (jnp.transpose(cq, (0, 2, 1))[..., :, None]
                       - jnp.transpose(ck, (0, 2, 1))[..., None, :])
  if logits_soft_cap is not None:
    logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
  if bias is not None:
    logits = logits + jnp.asarray(bias, cdt)
  return logits


def dense_weights(fn: str, query: ArrayLike, key: ArrayLike, value: ArrayLike,
                  bias: ArrayLike | None, mask: ArrayLike | None, kwargs: Mapping[str, Any],
                  allowed: Collection[str]) -> tuple[AttentionCall, jax.Array, jax.Array]:
  """The validated call, its dense weights [B, N, T, S] and their visibility.

  The weights :func:`dot_product_attention` would apply (same validation, masks, GQA and
  normalizers; float32, float64 for float64 inputs), with exact zeros off the visible set,
  and the visibility (bool, the same shape): the map the dense variants (UniAttn, InfSA,
  Polar attention) work on. ``kwargs`` are the caller's other arguments of
  :func:`dot_product_attention`; a name outside ``allowed`` is a ValueError naming ``fn``.
  """
  for name in kwargs:
    if name not in allowed:
      raise ValueError(f"{fn}: unexpected argument `{name}`")
  call = AttentionCall.create(query, key, value, bias=bias, mask=mask, **kwargs)
  logits = dense_logits(call.q, call.k, scale=call.scale, decay_bias=call.decay_bias,
                        logits_soft_cap=call.logits_soft_cap, bias=call.bias, score=call.score)
  visible = jnp.broadcast_to(call.structure.dense(), logits.shape)
  if call.mask is not None:
    visible = visible & call.mask
  weights = call.normalize_fn()(logits, visible).astype(logits.dtype)
  return call, jnp.where(visible, weights, 0.0), visible


def _threshold(rule: _spec.ThresholdRule, x, visible, n, hp):
  """Class T: tau of each row by bisection with the rule (``-inf`` for an empty row)."""
  hp = tile.with_row_stats(rule, x, visible, n, hp)
  z0 = rule.score_map(jnp.where(visible, x, 0.0), n, **hp)
  m = jnp.max(jnp.where(visible, z0, -jnp.inf), axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  z = jnp.where(visible, z0, m)
  lo, hi = rule.bracket(m, n, **hp)
  lo, hi = (jnp.broadcast_to(jnp.asarray(a, x.dtype), m.shape) for a in (lo, hi))
  target = rule.target(n, **hp)

  def step(_, bracket):
    lo, hi = bracket
    mid = 0.5 * (lo + hi)
    mass = jnp.sum(jnp.where(visible, rule.mass(z, mid, **hp), 0.0), axis=-1, keepdims=True)
    ok = mass >= target  # mass is non-increasing in tau: True up to the root
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  lo, _ = jax.lax.fori_loop(0, rule.iterations, step, (lo, hi))
  return jnp.where(n > 0, lo, -jnp.inf)


def row_statistic(spec, params, logits, visible):
  r"""The residual of ``return_residual``: one number per row, [B, N, T] (no gradient).

  With the normalizer's tile rule (classes E and S), ``w_j = numerator_j / D``: the
  residual is ``log D`` in the logits' own scale (``m + log D`` for the stabiliser m):

  .. math::
    r_i = \log\Big(\sum_{j \in V_i} \mathrm{denominator}(z_{ij}) + \mathrm{offset}_i\Big)

  so softmax gives the log-sum-exp of its logits (jax.nn's residual), softmax_sink /
  softmax_n / softmax_1 include their offset (the sink's mass), ssmax the log-sum-exp of
  its scaled scores ``s log(n) x``, and a row with D = 0 gives ``-inf``. Class P: 0 (its
  D is 1). Class T (with a threshold rule: sparsemax, entmax, top-k): the threshold tau in
  the rule's score units (``-inf`` for a row with no visible key). NotImplementedError
  for the other normalizers (no row statistic is defined) and plain callables.

  Args:
    spec: the NormalizerSpec; params: its hyperparameters (arrays broadcast against
      ``logits`` with size 1 along S).
    logits: [B, N, T, S] in the compute dtype; visible: bool, the same shape.
  """
  if not isinstance(spec, _spec.NormalizerSpec):
    raise NotImplementedError("`return_residual` needs a registered normalizer, not a callable")
  hp = {**spec.defaults, **params}
  # float arrays in the compute dtype, with the logits' rank (a per-head [N, 1, 1] gets its
  # leading axis explicitly: no implicit rank promotion)
  hp = {name: jnp.asarray(a, logits.dtype).reshape((1,) * (logits.ndim - a.ndim) + a.shape)
        if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.floating) else a
        for name, a in hp.items()}
  n = visible_count(visible, -1, logits.dtype)
  if spec.kernel_class in ("E", "S", "P") and spec.tile is not None:
    rule = spec.tile
    if spec.kernel_class == "P":
      return jnp.zeros(logits.shape[:-1], logits.dtype)
    m0, l0 = tile.init_rows(rule, n.shape, logits.dtype)
    m, l, _, _ = tile.online_update(rule, logits, visible, m0, l0, n, hp)
    m, d = tile.finalize(rule, m, l, n, hp)
    stat = m + jnp.log(d)
  elif spec.kernel_class == "T" and spec.threshold is not None:
    stat = _threshold(spec.threshold, logits, visible, n, hp)
  else:
    raise NotImplementedError(
        f"`return_residual`: normalizer {spec.name!r} (kernel class {spec.kernel_class}) has "
        "no row statistic (it needs a tile rule or a threshold rule)")
  return jax.lax.stop_gradient(jnp.broadcast_to(stat, n.shape)[..., 0])


@jit_under_debug_checks
def dense_attention(q, k, v, *, bias, mask, structure: MaskStructure, scale, logits_soft_cap,
                    normalize, decay_bias=None, statistic=None, zeros_where_masked=False,
                    score="dot"):
  """Dense attention: weights = normalize(logits, visible), out = weights @ v.

  Args:
    q: [B, T, N, H]; k: [B, S, K, H]; v: [B, S, K, Hv].
    bias: None or broadcastable to [B, N, T, S]; mask: None or bool, same.
    structure: the mask structure (causal, window, lengths, segments).
    scale: the logit scale; logits_soft_cap: None or the tanh cap.
    normalize: ``normalize(logits, where)`` -> weights [B, N, T, S] (the normalizer with
      its hyperparameters bound); it sees the visibility as ``where`` and counts the
      visible keys of each row itself (length-dependent normalizers).
    decay_bias: None or (cq [B, T, N], ck [B, S, N]).
    statistic: None, or ``statistic(logits, visible) -> [B, N, T]`` (:func:`row_statistic`
      with the normalizer bound) to also return the residual.
    zeros_where_masked: True when ``normalize`` is a registered normalizer, whose contract
      (checked for each by the generated tests) gives exact zeros where ``where`` is
      False; a plain callable's weights are zeroed there by this function.
    score: ``"dot"`` or ``"distance"`` (see :func:`dense_logits`).

  Returns:
    [B, T, N, Hv] in q's dtype; with ``statistic``, ``(out, residual [B, T, N])``.

  Under ``jax.debug_infs`` / ``jax.debug_nans`` it runs as one jitted computation
  (:func:`~jaxsoft.normalizers.common.jit_under_debug_checks`), as ``jax.nn``'s attention
  does: the masked logits' sentinels are internal, only the result is checked.
  """
  B, T, N, _ = q.shape
  K = k.shape[2]
  logits = dense_logits(q, k, scale=scale, decay_bias=decay_bias,
                        logits_soft_cap=logits_soft_cap, bias=bias, score=score)
  visible = jnp.broadcast_to(structure.dense(), logits.shape)
  if mask is not None:
    visible = visible & mask
  weights = normalize(logits, visible).astype(logits.dtype)
  if not zeros_where_masked:  # exact zeros off the visible set, whatever a callable does
    weights = jnp.where(visible, weights, 0.0)
  weights = weights.reshape(B, K, N // K, T, -1)
  out = jnp.einsum("bkgts,bskh->btkgh", weights, v.astype(logits.dtype))
  out = out.reshape(B, T, N, v.shape[-1]).astype(q.dtype)
  if statistic is None:
    return out
  return out, jnp.transpose(statistic(logits, visible), (0, 2, 1)).astype(q.dtype)
