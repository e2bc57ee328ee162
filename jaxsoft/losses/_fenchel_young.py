"""L02 Fenchel-Young losses of the softmax / entmax / sparsemax family (Tsallis entropies)."""

from __future__ import annotations

import functools
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft import normalizers
from jaxsoft._validation import concrete
from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc

__all__ = ["fenchel_young_loss", "FENCHEL_YOUNG_NORMALIZERS"]

# alpha of the Tsallis entropy each normalizer is the regularised argmax of; None = a
# hyperparameter (entmax's `alpha`).
_ALPHA = {"softmax": 1.0, "entmax15": 1.5, "sparsemax": 2.0, "entmax": None}
#: The ``normalizer`` values :func:`fenchel_young_loss` takes, each with the α of the Tsallis
#: entropy it is the regularised argmax of (``None``: entmax's ``alpha`` is a hyperparameter).
FENCHEL_YOUNG_NORMALIZERS = types.MappingProxyType(_ALPHA)


def fenchel_young_loss(logits: ArrayLike, labels: ArrayLike,
                       normalizer: str | normalizers.NormalizerSpec = "sparsemax", *,
                       axis: int = -1, where: ArrayLike | None = None, ignore_index: int | None = None,
                       **hparams: Any) -> jax.Array:
  r"""Fenchel-Young loss of a Tsallis-regularised normalizer (feature L02).

  For the normalizer :math:`p = \hat y_\Omega(\theta) = \arg\max_{p \in \Delta}
  \langle \theta, p\rangle - \Omega(p)` (M. Blondel, A. F. T. Martins & V. Niculae,
  "Learning with Fenchel-Young Losses", JMLR 2020, arXiv 1901.02324):

  .. math::
    L_\Omega(\theta; y) = \Omega(y) - \Omega(p) + \langle \theta, p - y \rangle
      = \Omega^*(\theta) + \Omega(y) - \langle \theta, y \rangle,

  with the Tsallis negentropy
  :math:`\Omega_\alpha(p) = \frac{\sum_j p_j^\alpha - 1}{\alpha(\alpha - 1)}`
  (Shannon :math:`\sum_j p_j \log p_j` at :math:`\alpha = 1`):

  ============  =====================  ===============================================
  normalizer    alpha                  loss
  ============  =====================  ===============================================
  "softmax"     1                      CE for integer labels; KL(y || p) for targets
  "entmax15"    1.5                    1.5-entmax loss (Peters, Niculae & Martins 2019)
  "entmax"      ``alpha`` (> 1)        alpha-entmax loss (Correia et al. 2019)
  "sparsemax"   2                      sparsemax loss (Martins & Astudillo 2016)
  ============  =====================  ===============================================

  Properties: :math:`L \ge 0`, with equality iff :math:`p = y` (e.g. for sparsemax when
  the target logit leads the others by at least 1); the gradient in the logits is
  exactly :math:`p - y` (a ``custom_jvp`` on :math:`\Omega^*`: no differentiation
  through the normalizer's solve), and for ``"entmax"`` the gradient in ``alpha`` is
  :math:`\partial_\alpha \Omega_\alpha(y) - \partial_\alpha \Omega_\alpha(p)` (Danskin).

  Numerics: computed in float32 (bf16/fp16 inputs) on max-centred logits (the loss is
  shift invariant for targets on the simplex), with
  :math:`\sum_j p_j^\alpha - 1 = \sum_j p_j \operatorname{expm1}((\alpha-1)\log p_j)` so
  that alpha near 1 loses no precision; tiny negative rounding is clipped to 0 in the
  value (not in the gradient), and centred logits below the float range are clamped to
  its edge (so the loss stays finite, never NaN, for any finite logits). Probability
  targets must lie on the simplex of the visible classes; mass on masked classes is
  dropped. Masked / ignored examples and labels naming
  no visible class are handled as in :func:`softmax_cross_entropy_with_integer_labels`
  (loss 0, resp. ``+inf``). Gradients in probability ``labels`` are exact up to a
  constant along the all-ones direction (which the simplex does not have), taking the
  entropy's derivative as 0 at zero entries. Every derivative is taken (``jax.grad``,
  ``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``): the rule on :math:`\Omega^*` is a
  ``custom_jvp``, differentiated again through the normalizer's own derivative.

  Args:
    logits: ``[..., K, ...]`` float scores (bf16/fp16 computed in float32).
    labels: integer class indices (``logits``' shape without ``axis``) or probability
      targets (``logits``' shape, a floating dtype).
    normalizer: ``"sparsemax"``, ``"entmax15"``, ``"entmax"`` or ``"softmax"`` (a name
      or the registered ``NormalizerSpec``).
    axis: the class axis.
    where: optional mask, broadcastable to ``logits`` (False classes are left out) or
      with one dimension fewer (per example; a False example gets loss 0).
    ignore_index: with integer labels, a label value whose examples get loss 0.
    **hparams: ``alpha`` for ``"entmax"`` (default 1.5): a float > 1 or an array
      broadcast to the rows (size 1 along ``axis``); differentiable.

  Returns:
    One loss per example, in ``logits``' dtype.

  Examples:
    >>> logits = jnp.array([[2.0, 0.5, -1.0], [0.0, 0.3, 0.1]])
    >>> print(js.losses.fenchel_young_loss(logits, jnp.array([0, 1]), "sparsemax"))
    [0.   0.19]

  References:
    M. Blondel, A. F. T. Martins & V. Niculae, 2020, "Learning with Fenchel-Young Losses"
    (JMLR).

    A. F. T. Martins & R. F. Astudillo, 2016, "From Softmax to Sparsemax: A Sparse Model of
    Attention and Multi-Label Classification" (ICML).

    B. Peters, V. Niculae & A. F. T. Martins, 2019, "Sparse Sequence-to-Sequence Models" (ACL).

    G. M. Correia, V. Niculae & A. F. T. Martins, 2019, "Adaptively Sparse Transformers"
    (EMNLP).
  """
  fn = "fenchel_young_loss"
  name = _normalizer_name(normalizer, fn)
  alpha = _alpha(name, hparams, fn)
  x, mask, axis, dtype = lc.prepare_logits(logits, axis, where, fn)
  labels, y = lc.integer_or_probability_labels(labels, x, mask, axis, ignore_index, fn)
  integer_labels = y is None
  if integer_labels:
    x_y, label_visible = lc.gather_label(x, mask, labels, axis)
    y = lc.one_hot(labels, x.shape[axis], axis) * jnp.expand_dims(label_visible, axis)
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  if alpha is not None and np.ndim(alpha) > 0:
    alpha = nc.row_param(alpha, x.shape, axis, "alpha", fn, x.dtype)

  # The loss is invariant to a per-row shift of the logits (for simplex targets): centre
  # them so <theta, p - y> does not cancel catastrophically for huge logits.
  z = jnp.where(mask, _centre(x, nc.masked_max(x, mask, axis)), 0.0)
  alpha_arr = jnp.asarray(1.0 if alpha is None else alpha, x.dtype) if name != "softmax" else None
  conjugate = _conjugate(z, mask, alpha_arr, axis, name)
  loss = conjugate - jnp.sum(z * y, axis=axis) + _omega(y, alpha_arr, axis)
  # Omega(p) and <z, p> round independently: keep the value >= 0 with an untouched gradient.
  loss = loss + jax.lax.stop_gradient(jnp.maximum(loss, 0.0) - loss)

  visible = jnp.any(mask, axis=axis)
  if integer_labels:
    return lc.integer_finish(loss, labels, visible, label_visible, ignore_index, dtype)
  return lc.finish(loss, visible, dtype)


def _normalizer_name(normalizer, fn_name: str) -> str:
  if isinstance(normalizer, normalizers.NormalizerSpec):
    normalizer = normalizer.name
  if not isinstance(normalizer, str) or normalizer not in _ALPHA:
    raise KeyError(
        f"{fn_name}: unknown `normalizer` {normalizer!r}; Fenchel-Young losses are provided "
        f"for {', '.join(sorted(_ALPHA))}")
  return normalizer


def _alpha(name: str, hparams, fn_name: str):
  allowed = {"alpha"} if name == "entmax" else set()
  for key in hparams:
    if key not in allowed:
      raise ValueError(
          f"{fn_name}: normalizer {name!r} got unknown hyperparameter `{key}`; it takes "
          f"{sorted(allowed) or 'none'}")
  if name != "entmax":
    return _ALPHA[name]
  alpha = hparams.get("alpha", 1.5)
  values = concrete(alpha, np.float64)  # concrete values are checked now
  if values is None:
    return alpha
  if np.any(np.isnan(values)) or np.any(values <= 1.0):
    raise ValueError(f"{fn_name}: entmax `alpha` must be > 1, got {alpha}")
  return alpha


@jax.custom_jvp
def _centre(x, m):
  """``x - m`` kept finite (it overflows for logits of opposite sign near the float max),
  with the derivative of ``x - m``: the loss stays finite and its gradient p - y."""
  return jnp.maximum(x - m, -jnp.finfo(x.dtype).max)


@_centre.defjvp
def _centre_jvp(primals, tangents):
  return _centre(*primals), tangents[0] - tangents[1]


def _omega(p, alpha, axis: int):
  r"""Tsallis negentropy per row (Shannon when ``alpha`` is None), for p on the simplex.

  :math:`\frac{\sum_j p_j^\alpha - 1}{\alpha(\alpha-1)}
  = \frac{\sum_j p_j\,\operatorname{expm1}((\alpha - 1)\log p_j)}{\alpha(\alpha - 1)}`:
  the right-hand side (equal on the simplex) keeps its precision as alpha -> 1.
  """
  positive = p > 0
  log_p = jnp.log(jnp.where(positive, p, 1.0))
  if alpha is None:
    return jnp.sum(jnp.where(positive, p * log_p, 0.0), axis=axis)
  am1 = alpha - 1.0
  terms = jnp.where(positive, p * jnp.expm1(am1 * log_p), 0.0)
  return (jnp.sum(terms, axis=axis, keepdims=True) / (alpha * am1)).squeeze(axis)


def _weights(z, mask, alpha, axis: int, name: str):
  """p = the normalizer at z (a registered jaxsoft normalizer)."""
  if name == "softmax":
    return normalizers.softmax(z, axis=axis, where=mask)
  if name == "sparsemax":
    return normalizers.sparsemax(z, axis=axis, where=mask)
  if name == "entmax15":
    return normalizers.entmax15(z, axis=axis, where=mask)
  return normalizers.entmax(z, alpha=alpha, axis=axis, where=mask)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _conjugate(z, mask, alpha, axis, name):
  r""":math:`\Omega^*(z) = \max_{p \in \Delta} \langle z, p\rangle - \Omega(p)` per row."""
  return _conjugate_value(z, mask, alpha, axis, name)[0]


def _conjugate_value(z, mask, alpha, axis, name):
  """``(Omega^*(z), p)`` with p the normalizer at z (the maximiser)."""
  if name == "softmax":
    value, _ = lc.masked_logsumexp(z, mask, axis)
    p = normalizers.softmax(z, axis=axis, where=mask)
  else:
    p = _weights(z, mask, alpha, axis, name).astype(z.dtype)
    value = jnp.sum(z * p, axis=axis) - _omega(p, alpha, axis)
  return value, p


@_conjugate.defjvp
def _conjugate_jvp(axis, name, primals, tangents):
  r"""Danskin: the derivative of a max is that of its objective at the maximiser p,
  :math:`d\Omega^* = \langle p, dz\rangle - \partial_\alpha \Omega_\alpha(p)\,d\alpha`, with no
  differentiation through the normalizer's solve. Linear in ``(dz, dalpha)``: reverse mode
  transposes it to ``dz = g p`` (and the ``alpha`` term); forward mode (``jax.jvp``,
  ``jax.jacfwd``) uses it as is; a second derivative differentiates p (the normalizer's own
  derivative), the Hessian of :math:`\Omega^*`."""
  z, mask, alpha = primals
  dz, _, dalpha = tangents
  value, p = _conjugate_value(z, mask, alpha, axis, name)
  dvalue = jnp.sum(p * dz, axis=axis)
  if alpha is not None:
    # an alpha shared by every shard_map shard: transposing the implicit broadcast of alpha
    # against the sharded p sums the shards' cotangents, as autodiff does
    dvalue = dvalue + jax.jvp(lambda a: -_omega(p, a, axis), (alpha,), (dalpha,))[1]
  return value, dvalue
