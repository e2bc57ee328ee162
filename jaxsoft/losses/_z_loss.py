"""L05 the spherical Z-loss (de Brébisson & Vincent 2016) and the log²Z regulariser (PaLM).

Two unrelated things share the name "z-loss"; jaxsoft names them apart:
:func:`spherical_z_loss` is a classification loss on standardised logits,
:func:`z_loss` is the auxiliary penalty :math:`(\\log Z)^2` added to a softmax CE.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive
from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc

__all__ = ["spherical_z_loss", "z_loss"]


def spherical_z_loss(logits: ArrayLike, labels: ArrayLike, *, a: float = 1.0, b: float = 0.0,
                     axis: lc.Axis = -1, where: ArrayLike | None = None,
                     ignore_index: int | None = None) -> jax.Array:
  r"""The Z-loss of the spherical family (feature L05).

  From A. de Brébisson & P. Vincent, "The Z-loss: a shift and scale invariant
  classification loss belonging to the Spherical Family" (2016, arXiv 1604.08859). The
  logits of each row are standardised over its visible classes V,

  .. math::
    z_j = \frac{o_j - \mu}{\sigma}, \quad \mu = \frac{1}{|V|}\sum_{k \in V} o_k, \quad
    \sigma^2 = \frac{1}{|V|}\sum_{k \in V} (o_k - \mu)^2,
    \qquad \ell(o; y) = \frac{1}{a}\,\mathrm{softplus}\bigl(a\,(b - z_y)\bigr),

  so the loss is invariant to :math:`o \mapsto \alpha o + \beta` (:math:`\alpha > 0`),
  depends on o only through :math:`o_y, \sum o_k, \sum o_k^2` (the spherical family: with
  ``o = W h`` the paper computes it in O(d²) per example, independent of the number of
  classes), is bounded (:math:`|z_y| \le \sqrt{|V|-1}`) and tends to the hinge
  :math:`\max(0, b - z_y)` as a → ∞. Its gradient in :math:`z_y` is bounded by 1.

  ``a`` (sharpness) and ``b`` (location) are tuned per task in the paper, which gives no
  defaults; ``a = 1, b = 0`` is :math:`\mathrm{softplus}(-z_y)`. A row whose visible
  logits are all equal has :math:`z = 0`. Probability targets give
  :math:`\sum_j y_j\,\ell(o; j)`. The logits are divided by their row's largest
  magnitude first (the loss is scale invariant), so no logit overflows the moments.

  This is *not* the :math:`\log^2 Z` regulariser, which is :func:`z_loss`.

  Args:
    logits: ``[..., K, ...]`` float logits (bf16/fp16 computed in float32).
    labels: integer class indices (``logits``' shape without ``axis``) or probability
      targets (``logits``' shape, a floating dtype).
    a: sharpness, > 0.
    b: location (margin) on the standardised scale.
    axis: the class axis, or a tuple of axes that form one class axis (None: all), as optax.
    where: optional class mask (broadcastable to ``logits``) or example mask (one
      dimension fewer).
    ignore_index: with integer labels, a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``logits``' dtype.

  Examples:
    >>> logits = jnp.array([[2.0, 0.5, -1.0], [0.0, 0.3, 0.1]])
    >>> print(js.losses.spherical_z_loss(logits, jnp.array([0, 1]), a=2.0, b=1.0))
    [0.2467 0.2062]

  References:
    A. de Brébisson & P. Vincent, 2016, "The Z-loss: a shift and scale invariant classification
    loss belonging to the Spherical Family" (arXiv 1604.08859).
  """
  fn = "spherical_z_loss"
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  a = check_positive(a, "a", fn)
  logits, where, axis, (labels,) = lc.class_rows(logits, axis, where, fn, labels=labels)
  x, mask, axis, dtype = lc.prepare_logits(logits, axis, where, fn)
  z = _standardise(x, mask, axis)
  n = nc.visible_count(mask, axis).squeeze(axis)
  visible = n > 0

  def per_class(zc):
    return jax.nn.softplus(a * (b - zc)) / a

  labels, y = lc.integer_or_probability_labels(labels, x, mask, axis, ignore_index, fn)
  if y is None:
    z_y, label_visible = lc.gather_label(z, mask, labels, axis)
    return lc.integer_finish(per_class(z_y), labels, visible, label_visible, ignore_index, dtype)
  loss = jnp.sum(jnp.where(mask, y * per_class(z), 0.0), axis=axis)
  return lc.finish(loss, visible, dtype)


def z_loss(logits: ArrayLike, *, axis: lc.Axis = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""The :math:`\log^2 Z` regulariser of the softmax normaliser (feature L05).

  .. math::
    \ell(x) = \Bigl(\log \sum_{j \in V} e^{x_j}\Bigr)^2,

  the auxiliary loss that keeps the log-partition function near 0 so the logits do not
  drift (A. Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", 2022,
  with weight 1e-4; also B. Zoph et al., "ST-MoE: Designing Stable and Transferable
  Sparse Expert Models", 2022, on router logits). Multiply by its weight and add it to the
  cross-entropy yourself, or use ``linear_cross_entropy(..., z_loss=weight)``. Its
  gradient is :math:`2 \log Z\,\mathrm{softmax}(x)`.

  Unrelated to :func:`spherical_z_loss`. A row with no visible class has loss 0. The
  value overflows float32 (to ``+inf``) once :math:`|\log Z|` exceeds about 1.8e19.

  Args:
    logits: ``[..., K, ...]`` float logits (bf16/fp16 computed in float32).
    axis: the class axis, or a tuple of axes that form one class axis (None: all), as optax.
    where: optional class mask (broadcastable to ``logits``) or example mask (one
      dimension fewer).

  Returns:
    One value per example, in ``logits``' dtype.

  Examples:
    >>> print(js.losses.z_loss(jnp.array([[0.0, 0.0], [2.0, -1.0]])))
    [0.4805 4.1967]

  References:
    A. Chowdhery et al., 2022, "PaLM: Scaling Language Modeling with Pathways".

    B. Zoph et al., 2022, "ST-MoE: Designing Stable and Transferable Sparse Expert Models".
  """
  fn = "z_loss"
  logits, where, axis, _ = lc.class_rows(logits, axis, where, fn)
  x, mask, axis, dtype = lc.prepare_logits(logits, axis, where, fn)
  lse, visible = lc.masked_logsumexp(x, mask, axis)
  return lc.finish(jnp.square(lse), visible, dtype)


def _standardise(x, mask, axis):
  """(x - mean) / std over the visible entries of each row; 0 where the std is 0."""
  scale = jax.lax.stop_gradient(
      jnp.max(jnp.where(mask, jnp.abs(x), 0.0), axis=axis, keepdims=True))
  # two steps of sqrt(scale): 1/scale itself is subnormal for scale > 2^126, and XLA:CPU
  # flushes subnormals to zero
  root = jnp.sqrt(jnp.where(scale > 0, scale, 1.0))
  xs = x / root / root
  n = nc.visible_count(mask, axis)
  mu = nc.safe_divide(jnp.sum(jnp.where(mask, xs, 0.0), axis=axis, keepdims=True), n)
  c = jnp.where(mask, xs - mu, 0.0)
  var = nc.safe_divide(jnp.sum(jnp.square(c), axis=axis, keepdims=True), n)
  ok = var != 0  # True for a NaN variance (`var > 0` would give a NaN row z = 0, a finite loss)
  return jnp.where(ok & mask, c / jnp.sqrt(jnp.where(ok, var, 1.0)), 0.0)
