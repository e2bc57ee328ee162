"""ExpAlign's Expectation Alignment Head and geometry-consistency loss (feature L09).

The soft multiple-instance-learning expectation of token-region similarities and a
free-energy consistency loss against a geometry prior (beside
:func:`~jaxsoft.losses.top_k_multi_positive_loss`, ExpAlign's Top-K multi-positive term).

References:
  J. Hu, T. Bai, F. Wu, W. Li, Z. Peng & Y. Zhang, 2026, "ExpAlign: Expectation-Guided
  Vision-Language Alignment for Open-Vocabulary Grounding" (arXiv 2601.22666).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive
from jaxsoft.losses import _common as lc
from jaxsoft.losses._common import Axis
from jaxsoft.losses._contrastive import _check_nonnegative
from jaxsoft.normalizers import common as nc

__all__ = ["expectation_alignment", "geometry_consistency_loss"]


def _rows(x, name, axis, where, fn, **like):
  """Merged class axis, float32 (float64 kept) inputs with 0 at masked entries, the mask."""
  x = lc.float_input(x, name, fn)
  if x.ndim == 0:
    raise ValueError(f"{fn}: `{name}` must have an axis to reduce, got a scalar")
  x, where, axis, merged = lc.class_rows(x, axis, where, fn, name, **like)
  xs, mask, axis = lc.prepare(x, axis, where, fn)
  return xs, mask, axis, x.dtype, merged


def expectation_alignment(similarity: ArrayLike, *, temperature: ArrayLike = 1.0,
                          axis: Axis = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""ExpAlign's Expectation Alignment Head: soft-MIL pooling of similarities (feature L09).

  For a region r with similarities :math:`s_{r,t} = \langle f_r, g_t\rangle` to the tokens t
  (the entries along ``axis``), the attention :math:`a_{r,t} = \mathrm{softmax}_t(s_{r,t} /
  \tau_a)` selects tokens softly and the head's score is the expected similarity under it:

  .. math::
    S(r) = \sum_t a_{r,t}\, s_{r,t}, \qquad
    \frac{\partial S}{\partial s_{r,t}} = a_{r,t}\Big(1 + \frac{s_{r,t} - S(r)}{\tau_a}\Big).

  :math:`\min_t s \le S \le \max_t s`; S is invariant to permuting the tokens, tends to the
  mean as :math:`\tau_a \to \infty` and to the max as :math:`\tau_a \to 0`. The same pooling
  over regions (``axis`` the region axis) is the instance selection of the paper's MIL
  formulation. Masked entries (``where`` False, ``-inf``) take no weight; a row with nothing
  visible gives 0 with zero gradient.

  Args:
    similarity: the similarities, the pooled entries along ``axis``.
    temperature: :math:`\tau_a > 0`.
    axis: the pooled axis: an int, a tuple of axes pooled as one, or None (all).
    where: an element mask broadcastable to ``similarity``, or a row mask with one dimension
      fewer (a False row gives 0).

  Returns:
    ``similarity``'s shape without ``axis``, in its dtype (computed in float32 for
    bf16/fp16).

  Examples:
    >>> s = jnp.array([[1.0, 2.0, 4.0]])
    >>> print(js.losses.expectation_alignment(s, temperature=1.0))
    [3.6456]

  References:
    Hu et al., 2026, "ExpAlign: Expectation-Guided Vision-Language Alignment for
    Open-Vocabulary Grounding" (arXiv 2601.22666): the Expectation Alignment Head.
  """
  fn = "expectation_alignment"
  tau = check_positive(temperature, "temperature", fn)
  xs, mask, ax, dtype, _ = _rows(similarity, "similarity", axis, where, fn)
  z = xs / tau
  # e / sum(e): a convex combination to rounding, so min s <= S <= max s holds at any tau
  e = jnp.where(mask, jnp.exp(z - nc.masked_max(z, mask, ax)), 0.0)
  total = jnp.sum(e, axis=ax)
  visible = total != 0
  pooled = jnp.sum(e * xs, axis=ax) / jnp.where(visible, total, 1.0)
  return lc.finish(pooled, visible, dtype)


def geometry_consistency_loss(scores: ArrayLike, geometry: ArrayLike, *,
                              temperature: ArrayLike = 1.0, axis: Axis = -1,
                              where: ArrayLike | None = None) -> jax.Array:
  r"""A geometry-consistency loss in ExpAlign's free-energy form (feature L09; reconstruction).

  ExpAlign's abstract names a "Geometry-Aware Consistency Objective derived from a
  Lagrangian-constrained free-energy minimization" without its formula; this is our reading.
  The free energy of a row's scores is :math:`F(s) = -\tau \log \sum_r e^{s_r / \tau} =
  \min_{a \in \Delta} \big[-\sum_r a_r s_r + \tau \sum_r a_r \log a_r\big]`, attained at
  :math:`a = \mathrm{softmax}(s / \tau)` (the head's attention). Constraining the attention
  to the geometry prior :math:`q_r = g_r / \sum_{r'} g_{r'}` (``geometry`` g >= 0, e.g. each
  region's IoU with the grounded box) costs the free-energy gap

  .. math::
    \ell = \frac{1}{\tau}\Big(-\sum_r q_r s_r - F(s)\Big)
         = \log \sum_r e^{s_r/\tau} - \sum_r q_r \frac{s_r}{\tau}
         = \mathrm{KL}\big(q \,\|\, \mathrm{softmax}(s/\tau)\big) + H(q),

  the cross-entropy from the prior to the attention, minimised over s exactly when
  :math:`\mathrm{softmax}(s/\tau) = q`; :math:`\partial\ell/\partial s = (\mathrm{softmax}
  (s/\tau) - q)/\tau`. A one-hot g is softmax cross-entropy on the region it marks. A row
  with no visible entry or no visible geometry mass gives 0 with zero gradient.

  Args:
    scores: region scores (e.g. :func:`expectation_alignment` of each region), the regions
      along ``axis``.
    geometry: nonnegative geometry weights of ``scores``' shape.
    temperature: :math:`\tau > 0`.
    axis: the region axis: an int, a tuple of axes read as one, or None (all).
    where: an element mask broadcastable to ``scores``, or a row mask with one dimension
      fewer (a False row gives 0).

  Returns:
    ``scores``' shape without ``axis``, in its dtype (computed in float32 for bf16/fp16).

  Examples:
    >>> s = jnp.array([[2.0, 0.0, -1.0]])
    >>> g = jnp.array([[0.8, 0.2, 0.0]])
    >>> print(js.losses.geometry_consistency_loss(s, g))
    [0.5698]

  References:
    Hu et al., 2026, "ExpAlign: Expectation-Guided Vision-Language Alignment for
    Open-Vocabulary Grounding" (arXiv 2601.22666): its Geometry-Aware Consistency Objective,
    in the reading above.
  """
  fn = "geometry_consistency_loss"
  tau = check_positive(temperature, "temperature", fn)
  g = lc.float_input(geometry, "geometry", fn)
  if g.shape != jnp.shape(scores):
    raise ValueError(f"{fn}: `geometry` of shape {g.shape} must have `scores`' shape "
                     f"{jnp.shape(scores)}")
  _check_nonnegative(g, "geometry", fn)
  xs, mask, ax, dtype, (g,) = _rows(scores, "scores", axis, where, fn, geometry=g)
  g = jnp.where(mask, g.astype(xs.dtype), 0.0)
  mass = jnp.sum(g, axis=ax, keepdims=True)
  has_mass = mass > 0
  q = g / jnp.where(has_mass, mass, 1.0)
  z = xs / tau
  lse, visible = lc.masked_logsumexp(z, mask, ax)
  loss = lse - jnp.sum(q * z, axis=ax)
  return lc.finish(loss, visible & jnp.squeeze(has_mass, ax), dtype)
