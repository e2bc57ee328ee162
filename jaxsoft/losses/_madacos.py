"""L06 CFCD's MadaCos: the scale and margin of a CosFace loss set from each batch's
statistics (the scale rising as the batch's median target cosine rises), the progressive
schedule of its target probability over training steps, and the loss."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import concrete, finite_float
from jaxsoft.losses import _common as lc
from jaxsoft.losses._margin import EMBEDDING_BATCH, cosine_logits, margin_cross_entropy
from jaxsoft.normalizers import common as nc

__all__ = ["madacos_alpha_schedule", "madacos_loss", "madacos_scale_margin"]

_STATISTICS = ("example", "median", "mean")

Schedule = Callable[[ArrayLike], jax.Array]
Alpha = float | ArrayLike | Schedule


def madacos_alpha_schedule(init_alpha: float = 0.1, end_alpha: float = 0.02,
                           transition_steps: int = 10000,
                           transition_begin: int = 0) -> Schedule:
  r"""CFCD's progressive MadaCos schedule: the median example's target probability by step
  (feature L06).

  CFCD tunes the MadaCos scale and margin in each batch and "increases them progressively"
  over training. Both grow as the target probability :math:`\rho` of the median example
  falls (:func:`madacos_scale_margin`: the scale's numerator is
  :math:`\log R + \log\frac{1-\rho}{\rho}` and the margin adds
  :math:`\log\frac{1-\rho}{\rho} / s` to the median cosine's gap). This schedule moves
  :math:`\rho` from ``init_alpha`` to ``end_alpha`` linearly in the log-odds:

  .. math::
    \log\frac{1-\rho_t}{\rho_t} = (1-f_t)\log\frac{1-\rho_0}{\rho_0}
      + f_t \log\frac{1-\rho_1}{\rho_1},
    \qquad f_t = \operatorname{clip}\Bigl(\frac{t - t_0}{T}, 0, 1\Bigr),

  so at a fixed batch both :math:`s` and :math:`m` are non-decreasing in the step when
  :math:`\rho_1 \le \rho_0` (and held before ``transition_begin`` :math:`t_0` and after
  :math:`t_0 + T`). A pure function of the step, as an optax schedule: pass it as ``alpha``
  of :func:`madacos_loss` or :func:`madacos_scale_margin` with ``step=``.

  [R]: the paper states only that the scale and margin increase progressively; this
  schedule (its log-odds-linear form and defaults) is a reconstruction. Its endpoint
  ``end_alpha = 0.02`` is the authors' released configuration; with ``init_alpha ==
  end_alpha`` it is that constant.

  Args:
    init_alpha: :math:`\rho_0 \in (0, 1)` at and before ``transition_begin``.
    end_alpha: :math:`\rho_1 \in (0, 1)` from ``transition_begin + transition_steps`` on.
    transition_steps: T >= 1.
    transition_begin: :math:`t_0 \ge 0`.

  Returns:
    A function of the (integer or float, possibly traced) step returning :math:`\rho_t`, a
    scalar of the default float dtype.

  Examples:
    >>> sched = js.losses.madacos_alpha_schedule(0.5, 0.02, transition_steps=100)
    >>> print([round(float(sched(t)), 4) for t in (0, 50, 100, 1000)])
    [0.5, 0.125, 0.02, 0.02]

  References:
    Y. Zhu, Y. Gao, Z. Huang, J. Wang, X. Sun, X. Chen & Y. Fu, 2023, "Coarse-to-Fine:
    Learning Compact Discriminative Representation for Single-Stage Image Retrieval" (ICCV).
  """
  fn = "madacos_alpha_schedule"
  lo = _open_unit(init_alpha, "init_alpha", fn)
  hi = _open_unit(end_alpha, "end_alpha", fn)
  steps = lc.int_in_range(transition_steps, "transition_steps", 1, 2**62, fn)
  begin = lc.int_in_range(transition_begin, "transition_begin", 0, 2**62, fn)
  odds0, odds1 = math.log((1 - lo) / lo), math.log((1 - hi) / hi)

  def schedule(step: ArrayLike) -> jax.Array:
    t = jnp.asarray(step, jnp.result_type(float))
    if t.ndim:
      raise ValueError(f"{fn}: the step must be a scalar, got shape {t.shape}")
    f = jnp.clip((t - begin) / steps, 0.0, 1.0)
    return jax.nn.sigmoid(-((1 - f) * odds0 + f * odds1))

  return schedule


def madacos_scale_margin(embeddings: ArrayLike, class_weights: ArrayLike, labels: ArrayLike, *,
                         alpha: Alpha = 0.02, ratio: float = 9999999.0,
                         min_scale: float = 32.0, statistic: str = "example",
                         where: ArrayLike | None = None,
                         step: ArrayLike | None = None) -> tuple[jax.Array, jax.Array]:
  r"""CFCD's MadaCos scale and margin of the cosine logits, from a batch (feature L06).

  From Y. Zhu, Y. Gao, Z. Huang et al., "Coarse-to-Fine: Learning Compact Discriminative
  Representation for Single-Stage Image Retrieval" (CFCD, ICCV 2023). With
  :math:`c_{\mathrm{med}}` the batch's (lower) median target cosine
  :math:`\cos\theta_{i y_i}` (:func:`cosine_logits`) and :math:`\rho` = ``alpha``:

  .. math::
    s = \max\Bigl(s_{\min},\ \frac{\log\bigl(R (1-\rho)/\rho\bigr)}{1 - c_{\mathrm{med}}}\Bigr),
    \qquad
    m = \max\Bigl(0,\ c_{\mathrm{med}} - \frac1s \log\frac{\rho\,\bar B}{1-\rho}\Bigr),
    \qquad B_i = \sum_{j \ne y_i} e^{s \cos\theta_{ij}},

  where :math:`\bar B` is :math:`B` of the median example (``statistic="example"``, CFCD's
  default), the median or the mean of :math:`B_i` over the batch. With this margin the
  median example's CosFace target probability :math:`e^{s(c-m)} / (e^{s(c-m)} + B)` is
  exactly :math:`\rho` (when :math:`m > 0`), and at :math:`\cos\theta_y = 1` the target
  logit leads the median's by :math:`\log(R(1-\rho)/\rho)`: as training raises the
  median cosine, the scale grows with it (the progressive schedule). Pass the pair to
  :func:`madacos_loss` (traced, under ``jit``) or, as Python floats, to
  :func:`cosface_loss`; CFCD uses margin 0 at evaluation. No gradient flows through them.
  :math:`\bar B` is computed in log space, so a large scale does not overflow it.

  [R]: the paper gives the rule in words; the formulas and defaults (R = 9999999,
  :math:`s_{\min}` = 32, :math:`\rho` = 0.02 in its configs) are those of the authors'
  released code (bassyess/CFCD, ``MadaCosLayerFunction``).

  Args:
    embeddings: ``[..., d]`` features.
    class_weights: ``[d, C]`` (or ``[d, C, K]``) class centres.
    labels: integer classes, ``embeddings``' shape without its last axis.
    alpha: :math:`\rho \in (0, 1)`, the median example's target probability: a float, a
      scalar array (checked when concrete), or a schedule of the step
      (:func:`madacos_alpha_schedule`, the progressive form) evaluated at ``step``.
    ratio: R > 0.
    min_scale: :math:`s_{\min} \ge 0`.
    statistic: ``"example"``, ``"median"`` or ``"mean"``: which :math:`\bar B`.
    where: optional example mask (False: left out of every statistic).
    step: the training step, required with (and only with) a schedule ``alpha``.

  Returns:
    ``(scale, margin)``, scalars in the cosines' dtype (float32; float64 under x64); a
    batch with no example gives ``(min_scale, 0)``.

  Examples:
    >>> x = jnp.array([[1.0, 0.2], [0.1, -1.0], [0.5, 0.5]])
    >>> w = jnp.array([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    >>> s, m = js.losses.madacos_scale_margin(x, w, jnp.array([0, 2, 1]), alpha=0.1)
    >>> print(round(float(s), 3), round(float(m), 4))
    62.532 0.0351

  References:
    Y. Zhu, Y. Gao, Z. Huang, J. Wang, X. Sun, X. Chen & Y. Fu, 2023, "Coarse-to-Fine:
    Learning Compact Discriminative Representation for Single-Stage Image Retrieval" (ICCV).
  """
  fn = "madacos_scale_margin"
  hp = _hyperparameters(alpha, ratio, min_scale, statistic, fn, step)
  cos = cosine_logits(embeddings, class_weights, fn)
  labels = lc.check_labels(labels, cos.shape[:-1], fn, what=EMBEDDING_BATCH)
  keep = lc.example_keep(where, labels, None, fn)
  return _scale_margin(cos, labels, keep, *hp)


def madacos_loss(embeddings: ArrayLike, class_weights: ArrayLike, labels: ArrayLike, *,
                 alpha: Alpha = 0.02, ratio: float = 9999999.0, min_scale: float = 32.0,
                 statistic: str = "example", where: ArrayLike | None = None,
                 ignore_index: int | None = None, step: ArrayLike | None = None) -> jax.Array:
  r"""CFCD's MadaCos loss: CosFace with the batch's adaptive scale and margin (feature L06).

  .. math::
    \ell(x; y) = -\log \frac{e^{s(\cos\theta_y - m)}}
      {e^{s(\cos\theta_y - m)} + \sum_{j \ne y} e^{s \cos\theta_j}},

  :func:`cosface_loss` with :math:`(s, m)` = :func:`madacos_scale_margin` of the same
  batch (its kept examples: ``where`` and not ``ignore_index``), held constant in the
  gradient, as CFCD's layer does. Fixed (s, m) make it :func:`cosface_loss` exactly. With
  ``alpha`` a :func:`madacos_alpha_schedule` and ``step`` the training step, the scale and
  margin also grow progressively over training (CFCD's "increases them progressively").

  Args:
    embeddings, class_weights, labels, where, ignore_index: as in :func:`arcface_loss`.
    alpha, ratio, min_scale, statistic, step: as in :func:`madacos_scale_margin`.

  Returns:
    One loss per example, in ``embeddings``' dtype.

  Examples:
    >>> x = jnp.array([[1.0, 0.2], [0.1, -1.0], [0.5, 0.5]])
    >>> w = jnp.array([[1.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    >>> print(js.losses.madacos_loss(x, w, jnp.array([0, 2, 1]), alpha=0.1))
    [ 0.     14.6416  2.3026]
    >>> sched = js.losses.madacos_alpha_schedule(0.1, 0.02, transition_steps=1000)
    >>> step = jnp.array(0)   # a traced step under jit; at step 0 the schedule gives 0.1
    >>> print(js.losses.madacos_loss(x, w, jnp.array([0, 2, 1]), alpha=sched, step=step))
    [ 0.     14.6416  2.3026]

  References:
    Y. Zhu, Y. Gao, Z. Huang, J. Wang, X. Sun, X. Chen & Y. Fu, 2023, "Coarse-to-Fine:
    Learning Compact Discriminative Representation for Single-Stage Image Retrieval" (ICCV).
  """
  fn = "madacos_loss"
  hp = _hyperparameters(alpha, ratio, min_scale, statistic, fn, step)
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  out_dtype = jnp.result_type(embeddings)
  cos = cosine_logits(embeddings, class_weights, fn)
  labels = lc.check_labels(labels, cos.shape[:-1], fn, what=EMBEDDING_BATCH)
  keep = lc.example_keep(where, labels, ignore_index, fn)
  s, m = _scale_margin(cos, labels, keep, *hp)
  loss, visible, label_visible = margin_cross_entropy(cos, labels, s, lambda c: c - m, where, fn)
  return lc.integer_finish(loss, labels, visible, label_visible, ignore_index,
                           nc.output_dtype(out_dtype))


def _open_unit(value, name, fn):
  """A static float in (0, 1); ValueError otherwise."""
  v = finite_float(value, name, fn)
  if not 0.0 < v < 1.0:
    raise ValueError(f"{fn}: `{name}` must be in (0, 1), got {value!r}")
  return v


def _alpha(alpha, step, fn):
  """alpha as a Python float (static) or a scalar array (a schedule's value at ``step``)."""
  if callable(alpha):
    if step is None:
      raise ValueError(f"{fn}: a schedule `alpha` needs `step` (the training step)")
    alpha = alpha(step)
  elif step is not None:
    raise ValueError(f"{fn}: `step` is given but `alpha` is not a schedule (a callable)")
  if isinstance(alpha, (int, float)):
    return _open_unit(alpha, "alpha", fn)
  a = jnp.asarray(alpha)
  if a.ndim or not jnp.issubdtype(a.dtype, jnp.floating):
    raise ValueError(f"{fn}: `alpha` must be a float scalar, got {a.dtype} of shape {a.shape}")
  values = concrete(a, float)
  if values is not None and not 0.0 < float(values) < 1.0:
    raise ValueError(f"{fn}: `alpha` must be in (0, 1), got {float(values)!r}")
  return jax.lax.stop_gradient(a)


def _hyperparameters(alpha, ratio, min_scale, statistic, fn, step=None):
  """Checked (alpha, ratio, min_scale, statistic), before any array work."""
  alpha = _alpha(alpha, step, fn)
  ratio = float(ratio)
  if not (math.isfinite(ratio) and ratio > 0):
    raise ValueError(f"{fn}: `ratio` must be finite and > 0, got {ratio!r}")
  min_scale = lc.nonnegative_float(min_scale, "min_scale", fn)
  if statistic not in _STATISTICS:
    raise ValueError(f"{fn}: `statistic` must be one of {_STATISTICS}, got {statistic!r}")
  return alpha, ratio, min_scale, statistic


def _scale_margin(cos, labels, keep, alpha, ratio, min_scale, statistic):
  c_all = jax.lax.stop_gradient(cos).reshape(-1, cos.shape[-1])
  y, keep = labels.reshape(-1), keep.reshape(-1)
  n_classes = c_all.shape[-1]
  c_y = jnp.take_along_axis(c_all, y[:, None].clip(0, n_classes - 1), axis=-1)[:, 0]
  n = jnp.sum(keep)
  order = jnp.argsort(jnp.where(keep, c_y, jnp.inf), stable=True)
  i_med = order[jnp.maximum((n - 1) // 2, 0)]
  c_med = c_y[i_med]
  gap = jnp.maximum(1.0 - c_med, jnp.finfo(c_all.dtype).eps)
  log_odds: float | jax.Array
  if isinstance(alpha, float):
    log_odds = math.log((1.0 - alpha) / alpha)       # log((1 - rho) / rho)
    s = jnp.maximum(min_scale, math.log(ratio * (1.0 - alpha) / alpha) / gap)
  else:
    a = alpha.astype(c_all.dtype)
    log_odds = jnp.log1p(-a) - jnp.log(a)
    s = jnp.maximum(min_scale, (math.log(ratio) + log_odds) / gap)
  others = ~jax.nn.one_hot(y, n_classes, dtype=bool)
  log_b, _ = lc.masked_logsumexp(s * c_all, others, axis=-1)   # log B_i
  if statistic == "example":
    log_b_bar = log_b[i_med]
  elif statistic == "median":
    log_b_bar = jnp.sort(jnp.where(keep, log_b, jnp.inf))[jnp.maximum((n - 1) // 2, 0)]
  else:
    log_b_bar = (jax.nn.logsumexp(jnp.where(keep, log_b, -jnp.inf))
                 - jnp.log(jnp.maximum(n, 1)))
  m = jnp.maximum(0.0, c_med - (log_b_bar - log_odds) / s)
  # a NaN cosine of a kept example (a NaN embedding) makes both NaN: the median's sort
  # would put it out of sight and return a finite scale and margin
  nan = jnp.any(keep[:, None] & jnp.isnan(c_all))
  s, m = jnp.where(nan, jnp.nan, s), jnp.where(nan, jnp.nan, m)
  empty = n == 0
  return (jnp.where(empty, min_scale, s).astype(c_all.dtype),
          jnp.where(empty, 0.0, m).astype(c_all.dtype))
