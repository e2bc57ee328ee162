"""N15 truncated softmax: top-k, top-p (nucleus), epsilon-, eta- and basis-aware truncation.

Each keeps a set K of the visible entries of a row and renormalises the softmax over it:

    w_i = e^{x_i} / sum_{j in K} e^{x_j}   for i in K,   0 elsewhere.

They differ only in K. The kept set carries no gradient (it is piecewise constant in x);
the weights are differentiable inside K, zero-gradient outside.

Blockwise (attention's ``xla_chunked`` and Pallas paths, where no row is ever whole):
top-k and top-p are class T, K = {x >= tau} with tau found by a search over key blocks
(top-p's target, p times the row's softmax sum, comes from a statistics pass first);
epsilon and eta are class R, since their K = {x >= m + log(level · l)} is a closed form of
the row's softmax statistics (m, l) (and, for eta, the entropy's carried sum). The dense
functions here are the references.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import concrete
from jaxsoft.normalizers import common as c
from jaxsoft.normalizers import row_blocks as blocks
from jaxsoft.normalizers.spec import (
  NormalizerSpec,
  Param,
  ThresholdRule,
  TileRule,
  identity_score_map,
  register,
)

__all__ = ["top_k_softmax", "top_p_softmax", "epsilon_softmax", "eta_softmax",
           "basis_aware_softmax"]

DEFAULT_K = 8
_K = Param("k", DEFAULT_K, low=1, sample=3, static=True)
_P = Param("p", 0.9, low=0.0, high=1.0, low_open=True, sample=0.5, static=True)
_EPSILON = Param("epsilon", 3e-4, low=0.0, high=1.0, high_open=True, sample=0.05)
_ETA = Param("eta", 3e-4, low=0.0, high=1.0, high_open=True, sample=0.05)


def _softmax_over(xs, keep, axis):
  """Softmax restricted to ``keep`` (exact zeros elsewhere; an empty row gives zeros)."""
  m = c.masked_max(xs, keep, axis)
  e = jnp.where(keep, jnp.exp(jnp.where(keep, xs - m, 0.0)), 0.0)
  return c.safe_divide(e, jnp.sum(e, axis=axis, keepdims=True))


@c.dense_rules
def top_k_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                  k: int = DEFAULT_K) -> jax.Array:
  r"""Top-k (sparse) softmax (feature N15, kernel class T; S. Sun et al. 2021).

  From "Sparse-softmax: A Simpler and Faster Alternative Softmax Transformation" (Sun et
  al. 2021, arXiv 2112.12433):

  .. math::
    w_i = \frac{e^{x_i}}{\sum_{j \in \Omega_k} e^{x_j}} \; (i \in \Omega_k), \qquad 0 \text{ otherwise}

  with ``Omega_k`` the visible entries at least as large as the k-th largest visible entry
  (entries tied with it are all kept, so the map is permutation equivariant and equals its
  threshold rule ``1[x >= tau]``; without ties exactly k are kept). A row with fewer than
  k visible entries keeps all of them, so ``k = n`` is ``jax.nn.softmax`` and ``k = 1`` the one-hot argmax. Also the top-K
  MoE gate (H. Nguyen et al., "Statistical Perspective of Top-K Sparse Softmax Gating
  Mixture of Experts", ICLR 2024) and the softmax over a top-M subset of the vocabulary
  that some fast decoders use.

  Args:
    x: scores.
    k: entries kept per row, a static int in ``[1, x.shape[axis]]``; default 8.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.

  Returns:
    Weights of ``x``'s shape and dtype; a row with no visible entry is all zeros.

  Raises:
    ValueError: ``k`` not an int in ``[1, x.shape[axis]]``, bad ``axis`` or ``where``.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.5, -1.0])
    >>> js.normalizers.top_k_softmax(x, k=2)  # softmax over the two largest, exact zeros
    Array([0.7311, 0.2689, 0.    , 0.    ], dtype=float32)
    >>> js.normalizers.top_k_softmax(x, k=4)  # k = n: softmax
    Array([0.6095, 0.2242, 0.136 , 0.0303], dtype=float32)

  References:
    S. Sun et al., 2021, "Sparse-softmax: A Simpler and Faster Alternative Softmax
    Transformation".

    H. Nguyen et al., 2024, "Statistical Perspective of Top-K Sparse Softmax Gating
    Mixture of Experts".
  """
  if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
    raise ValueError(f"top_k_softmax: `k` must be a static int, got {k!r}")
  shape = np.shape(x)
  axis = c.canonical_axis(axis, len(shape), "top_k_softmax")
  if not 1 <= k <= shape[axis]:
    raise ValueError(f"top_k_softmax: `k` must be in [1, {shape[axis]}] (the row length along "
                     f"axis {axis}), got {k}")
  return _top_k_softmax(x, where, k=int(k), axis=axis)


@functools.partial(jax.jit, static_argnames=("k", "axis"))
def _top_k_softmax(x, where, k, axis):
  xs, mask, axis = c.prepare(x, axis, where, "top_k_softmax")
  n = xs.shape[axis]
  if k < n:
    xl = jnp.moveaxis(jnp.where(mask, xs, -jnp.inf), axis, -1)
    vals, _ = jax.lax.top_k(jax.lax.stop_gradient(xl), int(k))
    kth = jnp.moveaxis(vals[..., -1:], -1, axis)  # -inf when fewer than k are visible
    keep = jnp.logical_and(jax.lax.stop_gradient(xs) >= kth, mask)
  else:
    keep = mask
  return c.finish(_softmax_over(xs, keep, axis), mask, jnp.asarray(x).dtype)


def _full_softmax(xs, mask, axis):
  return jax.lax.stop_gradient(_softmax_over(xs, mask, axis))


@c.dense_rules
def top_p_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                  p: float = 0.9) -> jax.Array:
  r"""Nucleus (top-p) softmax (feature N15, kernel class T; A. Holtzman et al. 2020).

  From "The Curious Case of Neural Text Degeneration" (Holtzman, Buys, Du, Forbes & Choi,
  ICLR 2020, arXiv 1904.09751):

  .. math::
    K = \text{the smallest set of largest } \pi_i \text{ with } \sum_{i \in K} \pi_i \ge p,
    \qquad w_i = \pi_i / \textstyle\sum_{j \in K} \pi_j \; (i \in K)

  with ``pi = softmax(x)`` over the visible entries. An entry is kept when the mass of the
  entries strictly before it (in descending order) is below p; entries tied with the last
  kept probability are kept too. ``p = 1`` keeps every visible entry (softmax).
  Blockwise (class T): K = {x >= tau} with tau the largest score whose upper mass
  ``sum_{x_j >= tau} e^{x_j - m}`` reaches ``p · l``, ``(m, l)`` the row's softmax
  statistics from a first pass; scores within a relative 2^-21 of tau count as tied.

  Args:
    x: scores.
    p: nucleus mass in (0, 1]; default 0.9 (a Python float).
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.

  Returns:
    Weights of ``x``'s shape and dtype; a row with no visible entry is all zeros.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.5, -1.0])  # softmax: [0.6095, 0.2242, 0.136, 0.0303]
    >>> js.normalizers.top_p_softmax(x, p=0.8)  # 0.6095 + 0.2242 >= 0.8
    Array([0.7311, 0.2689, 0.    , 0.    ], dtype=float32)
    >>> js.normalizers.top_p_softmax(x, p=0.9)
    Array([0.6285, 0.2312, 0.1402, 0.    ], dtype=float32)

  References:
    A. Holtzman, J. Buys, L. Du, M. Forbes & Y. Choi, 2020, "The Curious Case of Neural
    Text Degeneration".
  """
  _P.validate(p, "top_p_softmax")
  p_value = concrete(p, np.float64)
  if p_value is None or p_value.size != 1:
    raise ValueError(
        "top_p_softmax: `p` must be a static Python float (it is compiled into the cut), got "
        f"{'a traced value' if p_value is None else f'an array of shape {p_value.shape}'}; "
        "under jit pass it through static_argnames or functools.partial")
  return _top_p_softmax(x, where, float(p_value.reshape(())), axis=axis)


@functools.partial(jax.jit, static_argnames=("p", "axis"))
def _top_p_softmax(x, where, p, axis):
  xs, mask, axis = c.prepare(x, axis, where, "top_p_softmax")
  if p >= 1.0:
    keep = mask
  else:
    probs = _full_softmax(xs, mask, axis)
    desc = -jnp.sort(-probs, axis=axis)
    before = jnp.cumsum(desc, axis=axis) - desc
    last_kept = jnp.min(jnp.where(before < p, desc, jnp.inf), axis=axis, keepdims=True)
    keep = jnp.logical_and(mask, probs >= last_kept)
  return c.finish(_softmax_over(xs, keep, axis), mask, jnp.asarray(x).dtype)


@functools.partial(jax.jit, static_argnames=("axis", "fn_name"))
def _truncated_softmax(x, where, level, axis, fn_name):
  """Keeps ``pi_i >= threshold`` and always the row's argmax, then renormalises.

  The threshold is ``level`` (epsilon), or for ``eta_softmax`` ``min(eta, sqrt(eta) e^-H)``.
  """
  xs, mask, axis = c.prepare(x, axis, where, fn_name)
  probs = _full_softmax(xs, mask, axis)
  threshold = jnp.asarray(level, xs.dtype)
  if fn_name == "eta_softmax":
    plogp = jnp.where(probs > 0, probs * jnp.log(jnp.where(probs > 0, probs, 1.0)), 0.0)
    entropy = -jnp.sum(plogp, axis=axis, keepdims=True)
    threshold = jnp.minimum(threshold, jnp.sqrt(threshold) * jnp.exp(-entropy))
  top = jnp.max(probs, axis=axis, keepdims=True)
  keep = jnp.logical_and(mask, jnp.logical_or(probs >= threshold, probs >= top))
  return c.finish(_softmax_over(xs, keep, axis), mask, jnp.asarray(x).dtype)


@c.dense_rules
def epsilon_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                    epsilon: ArrayLike = 3e-4) -> jax.Array:
  r"""epsilon-truncated softmax (feature N15, kernel class R; Hewitt, Manning & Liang 2022).

  .. math::
    K = \{i : \pi_i \ge \varepsilon\} \cup \{\arg\max \pi\}, \qquad
    w_i = \pi_i / \textstyle\sum_{j \in K} \pi_j \; (i \in K)

  with ``pi = softmax(x)`` over the visible entries (J. Hewitt, C. D. Manning & P. Liang,
  "Truncation Sampling as Language Model Desmoothing", Findings of EMNLP 2022, arXiv
  2210.15191; the argmax is always kept, as in the reference implementation's
  ``min_tokens_to_keep = 1``). Blockwise (class R): K = {x >= m + min(0, log(epsilon l))}
  from the row's softmax statistics (m, l), merged over key blocks; an entry within a
  relative 2^-16 of the max counts as the argmax.

  Args:
    x, axis, where: as in :func:`top_p_softmax`.
    epsilon: probability threshold in [0, 1); default 3e-4 (the paper's range for large
      vocabularies is 1e-4 to 1e-3).

  Returns:
    Weights of ``x``'s shape and dtype; a row with no visible entry is all zeros.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.5, -1.0])  # softmax: [0.6095, 0.2242, 0.136, 0.0303]
    >>> js.normalizers.epsilon_softmax(x, epsilon=0.05)  # drops pi < 0.05
    Array([0.6285, 0.2312, 0.1402, 0.    ], dtype=float32)

  References:
    J. Hewitt, C. D. Manning & P. Liang, 2022, "Truncation Sampling as Language Model
    Desmoothing".
  """
  _EPSILON.validate(epsilon, "epsilon_softmax")
  return _truncated_softmax(x, where, epsilon, axis=axis, fn_name="epsilon_softmax")


@c.dense_rules
def eta_softmax(x: ArrayLike, axis: int = -1, where: ArrayLike | None = None, *,
                eta: ArrayLike = 3e-4) -> jax.Array:
  r"""eta-truncated softmax (feature N15, kernel class R; Hewitt, Manning & Liang 2022).

  From "Truncation Sampling as Language Model Desmoothing" (J. Hewitt, C. D. Manning &
  P. Liang, Findings of EMNLP 2022, arXiv 2210.15191):

  .. math::
    \eta' = \min\!\left(\eta, \sqrt{\eta}\, e^{-H(\pi)}\right), \quad
    K = \{i : \pi_i \ge \eta'\} \cup \{\arg\max \pi\}, \quad
    w_i = \pi_i / \textstyle\sum_{j \in K} \pi_j \; (i \in K)

  with ``pi = softmax(x)`` over the visible entries and ``H`` its Shannon entropy (nats):
  the threshold drops for high-entropy rows, so a flat row keeps more entries.
  Blockwise (class R): K = {x >= m + min(0, log(eta' l))} from the row's softmax (m, l) and
  the entropy ``H = log l - sum_j e^{x_j - m}(x_j - m) / l``, merged over key blocks; an
  entry within a relative 2^-16 of the max counts as the argmax.

  Args:
    x: scores.
    eta: base threshold in [0, 1); default 3e-4.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0.

  Returns:
    Weights of ``x``'s shape and dtype; a row with no visible entry is all zeros.

  Examples:
    >>> flat = jnp.array([1.0, 0.9, 0.8, 0.7, -1.0])  # softmax: [0.28, 0.25, 0.23, 0.21, 0.04]
    >>> js.normalizers.epsilon_softmax(flat, epsilon=0.22)  # a fixed threshold of 0.22
    Array([0.3672, 0.3322, 0.3006, 0.    , 0.    ], dtype=float32)
    >>> js.normalizers.eta_softmax(flat, eta=0.22)  # high entropy lowers it to about 0.11
    Array([0.2887, 0.2612, 0.2363, 0.2138, 0.    ], dtype=float32)

  References:
    J. Hewitt, C. D. Manning & P. Liang, 2022, "Truncation Sampling as Language Model
    Desmoothing".
  """
  _ETA.validate(eta, "eta_softmax")
  return _truncated_softmax(x, where, eta, axis=axis, fn_name="eta_softmax")


def _constraint_basis(basis):
  """An orthonormal basis (columns) of span([W, 1]): the same equality constraints, well
  conditioned (float64, host side)."""
  a = np.concatenate([basis, np.ones((basis.shape[0], 1))], axis=1)
  u_, sv, _ = np.linalg.svd(a, full_matrices=False)
  rank = int(np.sum(sv > sv[0] * max(a.shape) * np.finfo(np.float64).eps))
  return u_[:, :rank]


def basis_aware_keep(logits, mask, basis, tau: float, tol: float):
  """The kept set of :func:`basis_aware_softmax` for rows ``logits [R, V]`` (numpy, host).

  Returns ``(keep [R, V] bool, lp_min [R, V])``: ``lp_min[r, i]`` the LP bound on
  ``min p_i`` that decided token i (``p_hat_i - tau`` where that is positive and no LP
  ran; NaN for masked tokens and for tokens ruled out by another LP's solution).
  """
  from scipy.optimize import linprog  # type: ignore[import-untyped]  # noqa: PLC0415

  logits = np.asarray(logits, np.float64)
  mask = np.asarray(mask, bool)
  q = _constraint_basis(np.asarray(basis, np.float64))
  keep = np.zeros(logits.shape, bool)
  lp_min = np.full(logits.shape, np.nan)
  for r in range(logits.shape[0]):
    vis = mask[r]
    if not vis.any():
      continue
    z = np.where(vis, logits[r], -np.inf)
    e = np.exp(z - z[vis].max())
    p_hat = e / e.sum()
    keep[r] = vis & ((p_hat > tau) | (p_hat >= p_hat.max()))
    lp_min[r] = np.where(vis & (p_hat > tau), p_hat - tau, np.nan)
    lower = np.where(vis, np.maximum(p_hat - tau, 0.0), 0.0)
    bounds = list(zip(lower, np.where(vis, 1.0, 0.0), strict=True))
    a_eq, b_eq = q.T, q.T @ p_hat
    undecided = vis & ~keep[r]
    for i in np.flatnonzero(undecided):
      if not undecided[i]:
        continue  # ruled out by an earlier LP's solution
      cost = np.zeros(p_hat.shape)
      cost[i] = 1.0
      res = linprog(cost, A_eq=a_eq, b_eq=b_eq, bounds=bounds, method="highs")
      if res.status != 0:  # no certificate: the token stays truncated, as by the threshold
        undecided[i] = False
        continue
      lp_min[r, i] = res.fun
      keep[r, i] = res.fun > tol
      undecided[i] = False
      undecided &= ~(res.x <= tol)  # tokens this witness p sets to 0 are truncated too
  return keep, lp_min


def basis_aware_softmax(x: ArrayLike, basis: ArrayLike, axis: int = -1,
                        where: ArrayLike | None = None, *, tau: float = 3e-4,
                        tol: float = 1e-8) -> jax.Array:
  r"""Basis-aware threshold (BAT) truncated softmax (feature N15) [R].

  From M. Finlayson, J. Hewitt, A. Koller, S. Swayamdipta & A. Sabharwal, 2024, "Closing
  the Curious Case of Neural Text Degeneration" (ICLR 2024): a model's output
  :math:`\hat p = \mathrm{softmax}(W h)` with an unembedding :math:`W \in \mathbb{R}^{V
  \times d}`, ``d << V`` (the softmax bottleneck), is taken to be the best rank-d fit of
  the true distribution p, so that ``W^T p = W^T p_hat`` (the cross-entropy's stationarity
  in h); and, as the threshold argument assumes, the model overestimates no token by more
  than tau, ``p_j >= p_hat_j - tau``. A token is kept when no p consistent with both can
  give it zero probability:

  .. math::
    K = \Big\{ i : \min_{p \in P} p_i > \mathrm{tol} \Big\}, \quad
    P = \{ p \ge 0,\ \textstyle\sum_j p_j = 1,\ W^\top p = W^\top \hat p,\
    p \ge \hat p - \tau \}, \qquad w_i = \hat p_i / \textstyle\sum_{j \in K} \hat p_j

  Every token with ``p_hat_i > tau`` is kept (``min p_i >= p_hat_i - tau > 0``: these
  are epsilon-sampling's, so K contains the epsilon set at ``epsilon = tau``); the
  basis constraint can prove a token below the threshold nonzero as well, which the
  threshold alone cannot. With a full-rank basis (``d >= V``) P is ``{p_hat}`` and every
  token is kept; with no basis (``W`` a column of ones) K is the epsilon set. The
  argmax is always kept. Reconstructed [R]: the constraint set (the paper's exact form of
  the bound and its LP are not in this project's sources); ``tol`` absorbs the LP
  solver's feasibility tolerance.

  The kept set is decided on the host by one linear program per token below the
  threshold (``scipy.optimize.linprog``, HiGHS, float64; a solution that sets other
  tokens to 0 rules them out too), through ``jax.pure_callback``: it works under ``jit``
  and ``vmap`` but costs up to V LPs in V variables per row, meant for sampling with
  small or pre-filtered vocabularies, not for training. K carries no gradient; the
  weights are differentiable in ``x`` inside K.

  Args:
    x: logits, ``V`` entries along ``axis`` (ideally ``W h``: the guarantee assumes it).
    basis: ``W [V, d]``, the unembedding whose column span holds the logits.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; False entries get exactly 0 and
      are not in the vocabulary (``p_j = 0`` in P).
    tau: the threshold, the most the model overestimates a token, in (0, 1); default
      3e-4 (a Python float).
    tol: an LP minimum above ``tol`` proves a token nonzero (``>= 0``; default 1e-8).

  Returns:
    Weights of ``x``'s shape and dtype; a row with no visible entry is all zeros.

  Examples:
    Logits ``W h`` of a rank-2 basis over V = 4 tokens. Token 0 falls below tau = 0.05,
    but ``W^T p = W^T p_hat`` and ``sum p = 1`` pin ``p_0 = p_hat_0`` (the one direction
    left free, ``(0, -2, 1, 1)``, does not move it), so the basis proves it nonzero:

    >>> W = jnp.array([[1.0, 1.0], [-1.0, 1.0], [-2.0, 0.0], [0.0, 2.0]])
    >>> x = W @ jnp.array([-2.0, 3.0])
    >>> js.normalizers.softmax(x)
    Array([0.0045, 0.2436, 0.0896, 0.6623], dtype=float32)
    >>> js.normalizers.epsilon_softmax(x, epsilon=0.05)
    Array([0.    , 0.2447, 0.09  , 0.6652], dtype=float32)
    >>> js.normalizers.basis_aware_softmax(x, W, tau=0.05)
    Array([0.0045, 0.2436, 0.0896, 0.6623], dtype=float32)

  References:
    M. Finlayson, J. Hewitt, A. Koller, S. Swayamdipta & A. Sabharwal, 2024, "Closing the
    Curious Case of Neural Text Degeneration".

    J. Hewitt, C. D. Manning & P. Liang, 2022, "Truncation Sampling as Language Model
    Desmoothing".
  """
  name = "basis_aware_softmax"
  tau_v = concrete(tau, np.float64)
  if tau_v is None or tau_v.size != 1 or not 0.0 < float(tau_v.reshape(())) < 1.0:
    raise ValueError(f"{name}: `tau` must be a static float in (0, 1), got {tau!r}")
  tol_v = concrete(tol, np.float64)
  if tol_v is None or tol_v.size != 1 or not float(tol_v.reshape(())) >= 0.0:
    raise ValueError(f"{name}: `tol` must be a static float >= 0, got {tol!r}")
  w = jnp.asarray(basis)
  c.check_real(w, name)
  x_shape = jnp.shape(x)
  if not x_shape:
    raise ValueError(f"{name}: `x` must have the vocabulary axis (rank >= 1), got a scalar")
  ax0 = c.canonical_axis(axis, len(x_shape), name)
  if w.ndim != 2 or w.shape[0] != x_shape[ax0]:
    raise ValueError(f"{name}: `basis` must be [V, d] with V = {x_shape[ax0]} (the length of "
                     f"`x` along axis {axis}), got shape {w.shape}")
  return _basis_aware_softmax(x, w, where, float(tau_v.reshape(())),
                              float(tol_v.reshape(())), axis=ax0)


@functools.partial(jax.jit, static_argnames=("tau", "tol", "axis"))
def _basis_aware_softmax(x, basis, where, tau, tol, axis):
  name = "basis_aware_softmax"
  xs, mask, axis = c.prepare(x, axis, where, name)
  xl = jax.lax.stop_gradient(c.to_last(xs, axis))
  ml = c.to_last(mask, axis)

  def host(logits, visible, w):
    logits, visible = np.asarray(logits), np.asarray(visible)
    v = logits.shape[-1]
    keep, _ = basis_aware_keep(logits.reshape(-1, v), visible.reshape(-1, v), w, tau, tol)
    return keep.reshape(logits.shape)

  keep = jax.pure_callback(host, jax.ShapeDtypeStruct(xl.shape, jnp.bool_), xl, ml,
                           jax.lax.stop_gradient(basis), vmap_method="sequential")
  keep = jnp.logical_and(mask, c.from_last(keep, axis))
  return c.finish(_softmax_over(xs, keep, axis), mask, jnp.asarray(x).dtype)


# --- class-T rule for top-k (the example of the ThresholdRule docstring) ------------------

# exp(-110) underflows to 0 in float32, so entries further than this below the max have
# weight 0 whether or not they are among the k largest: the bracket need not reach them.
_TOPK_REACH = 110.0


def _topk_score_map(x, length, **_):
  return x


def _topk_mass(z, tau, *_, **__):
  return (z >= tau).astype(jnp.result_type(z, jnp.float32))


def _topk_target(length, k=DEFAULT_K, **_):
  # min(k, length) written as jnp.clip, a jitted function: the Pallas interpreter inside
  # jax.shard_map (default check_vma) evaluates a kernel's equations on blocks that vary
  # over the mesh axes (``length`` is read from a ref) while they were traced without
  # them, so a bare min of a constant and ``length`` failed there ("requires varying
  # manual axes to match"); the equations inside a jitted call keep their traced types.
  return jnp.clip(length, max=jnp.asarray(k, length.dtype))


def _topk_bracket(m, length, **_):
  return m - _TOPK_REACH, m + 1.0


def _topk_weight(z, tau, m, **_):
  return jnp.where(z >= tau, jnp.exp(jnp.minimum(z - m, 0.0)), 0.0)


TOP_K_RULE = ThresholdRule(
    score_map=_topk_score_map, mass=_topk_mass, target=_topk_target,
    bracket=_topk_bracket, weight=_topk_weight,
    # tau must be the lower end ``lo`` of the final bracket (count >= k there); 48
    # halvings take the 111-wide bracket below float32 resolution.
    iterations=48)

# --- class-T rule for top-p: top-k's search with a mass-weighted count ------------------
# The kept set of top-p is {z >= tau} with tau the largest score whose upper mass
# sum_{z_j >= tau} e^{z_j - m} reaches p times the row's sum_j e^{z_j - m}: a threshold rule
# whose target needs the row's softmax statistics (m, l) first (``ThresholdRule.stats``).


def _top_p_stats_derive(stats, length, **_):
  m, l = jax.lax.stop_gradient(stats)
  return {"row_max": blocks.finite_or_zero(m), "row_sum": l}


def _top_p_mass(z, tau, *_, row_max=0.0, **__):
  return jnp.where(z >= tau, jnp.exp(jnp.minimum(z - row_max, 0.0)), 0.0)


@jax.jit
def _top_p_share(p, row_sum):
  # one jitted function, as jnp.clip in _topk_target: row_sum is read from a ref, see there
  return jnp.minimum(p, 1.0) * row_sum


def _top_p_target(length, p=0.9, row_sum=1.0, **_):
  return _top_p_share(p, row_sum)


TOP_P_RULE = ThresholdRule(
    score_map=_topk_score_map, mass=_top_p_mass, target=_top_p_target,
    bracket=_topk_bracket, weight=_topk_weight, iterations=48,
    stats=blocks.row_stats_rule((blocks.SOFTMAX,), _top_p_stats_derive, None))


# --- class-R rules for epsilon and eta truncation ----------------------------------------
# Their kept set {pi_i >= threshold} needs no search: pi_i = e^{x_i - m} / l, so it is
# {x_i >= m + log(threshold * l)}, a closed form of the row's softmax statistics (m, l)
# (eta's threshold also needs the entropy H = log l - t / l, blocks.ENTROPY). A first
# pass over the key blocks merges the statistics, a second (class E) is softmax over the
# kept entries.


def _cut(m, l, threshold):
  """The kept entries' lower bound ``m + min(0, log(threshold l))`` (the argmax is always
  kept), and the row max; no gradient (the kept set is piecewise constant in x)."""
  m, l = jax.lax.stop_gradient(m), jax.lax.stop_gradient(l)
  row_max = blocks.finite_or_zero(m)
  gap = jnp.log(jnp.where(l > 0, threshold * l, 1.0))
  return {"cut": row_max + jnp.minimum(gap, 0.0), "row_max": row_max}


def _epsilon_derive(stats, length, epsilon=_EPSILON.default, **_):
  m, l = stats
  return _cut(m, l, epsilon)


def _eta_derive(stats, length, eta=_ETA.default, **_):
  m, l, t = jax.lax.stop_gradient(stats)
  entropy = jnp.log(jnp.where(l > 0, l, 1.0)) - c.safe_divide(t, l)
  return _cut(m, l, jnp.minimum(eta, jnp.sqrt(eta) * jnp.exp(-entropy)))


def _kept_exp(z, m, cut=-jnp.inf, row_max=0.0, **_):
  """``e^{z - m}`` on the kept entries: ``z >= cut``, or tied with the row max within the
  relative ``RECOMPUTE_TOLERANCE`` (a recomputed tile may round the argmax an ulp low)."""
  keep = jnp.logical_or(z >= cut, blocks.at_row_max(z, row_max))
  return jnp.where(keep, jnp.exp(jnp.where(keep, z - m, 0.0)), 0.0)


_KEPT_SOFTMAX = TileRule(score_map=identity_score_map, numerator=_kept_exp,
                         denominator=_kept_exp, kernel_class="E")
EPSILON_RULE = blocks.row_stats_rule((blocks.SOFTMAX,), _epsilon_derive, _KEPT_SOFTMAX)
ETA_RULE = blocks.row_stats_rule((blocks.ENTROPY,), _eta_derive, _KEPT_SOFTMAX)

_COMMON: dict[str, Any] = dict(kernel_class="T", catalogue_id="N15", can_be_sparse=True,
                               smooth=False)

SPEC = register(NormalizerSpec(
    name="top_k_softmax", fn=top_k_softmax, params=(_K,), threshold=TOP_K_RULE,
    description="softmax over the k largest (k=8 by default), 0 elsewhere", **_COMMON))
SPEC_TOP_P = register(NormalizerSpec(
    name="top_p_softmax", fn=top_p_softmax, params=(_P,), threshold=TOP_P_RULE,
    description="nucleus: softmax over the smallest top set with mass >= p", **_COMMON))
# epsilon and eta: class R (row statistics, then softmax over the kept entries)
_COMMON_R = {**_COMMON, "kernel_class": "R"}
SPEC_EPSILON = register(NormalizerSpec(
    name="epsilon_softmax", fn=epsilon_softmax, params=(_EPSILON,), row_stats=EPSILON_RULE,
    description="softmax over {pi >= epsilon} (and the argmax)", **_COMMON_R))
SPEC_ETA = register(NormalizerSpec(
    name="eta_softmax", fn=eta_softmax, params=(_ETA,), row_stats=ETA_RULE,
    description="softmax over {pi >= min(eta, sqrt(eta) e^-H)} (and the argmax)",
    **_COMMON_R))
