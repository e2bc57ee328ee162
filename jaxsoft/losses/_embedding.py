"""Losses on a batch of labelled embeddings: the orthogonal projection loss (OPL) and
NBC-softmax, softmax CE with a negative-block contrastive term (feature L17)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive, positive_int
from jaxsoft.losses import _common as lc
from jaxsoft.losses._margin import _l2_normalize
from jaxsoft.normalizers import common as nc

__all__ = ["nbc_softmax_loss", "orthogonal_projection_loss"]


def _check_batch(embeddings, labels, where, fn, name="embeddings"):
  """``[B, d]`` float32/64 embeddings, ``[B]`` integer labels and a ``[B]`` keep mask."""
  x = lc.float_input(embeddings, name, fn)
  if x.ndim != 2:
    raise ValueError(f"{fn}: `{name}` must be floating [B, d], got {x.shape} {x.dtype}")
  y, keep = lc.example_labels(labels, x.shape[:1], where, None, fn)
  return x.astype(nc.compute_dtype(x.dtype)), y, keep


def orthogonal_projection_loss(features: ArrayLike, labels: ArrayLike, *, gamma: float = 0.5,
                               where: ArrayLike | None = None) -> jax.Array:
  r"""Orthogonal Projection Loss (OPL), a batch-level auxiliary loss (feature L17).

  From K. Ranasinghe, M. Naseer, M. Hayat, S. Khan & F. S. Khan, "Orthogonal Projection
  Loss" (ICCV 2021). With L2-normalised features :math:`\hat f`, s the mean cosine over
  same-class pairs :math:`i \ne j` and d the mean cosine over different-class pairs:

  .. math::
    L_{\mathrm{OPL}} = (1 - s) + \gamma\,|d|,

  added to CE as :math:`\mathrm{CE} + \lambda L_{\mathrm{OPL}}` (γ = 0.5, λ = 1 in the
  paper). :math:`L \ge 0`, 0 iff each class's features coincide and different classes
  are orthogonal; invariant to the scale of each feature; no parameters. A batch with no
  same-class pair has no s term (s := 1) and one with no different-class pair no d term.

  Args:
    features: ``[B, d]`` features (any scale).
    labels: ``[B]`` integer classes.
    gamma: γ >= 0.
    where: optional ``[B]`` example mask (False examples are left out of every pair).

  Returns:
    A scalar in float32 (float64 for float64 features).

  Examples:
    >>> f = jnp.array([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]])
    >>> print(round(float(js.losses.orthogonal_projection_loss(f, jnp.array([0, 0, 1]))), 6))
    0.0

  References:
    K. Ranasinghe, M. Naseer, M. Hayat, S. Khan & F. S. Khan, 2021, "Orthogonal Projection Loss"
    (ICCV).
  """
  fn = "orthogonal_projection_loss"
  g = lc.nonnegative_float(gamma, "gamma", fn)
  f, y, keep = _check_batch(features, labels, where, fn, "features")
  fh = _l2_normalize(f, axis=-1)
  cos = fh @ fh.T
  pair = keep[:, None] & keep[None, :] & ~jnp.eye(y.shape[0], dtype=bool)
  same = pair & (y[:, None] == y[None, :])
  diff = pair & (y[:, None] != y[None, :])
  n_same = jnp.sum(same).astype(f.dtype)
  s = jnp.where(n_same > 0, nc.safe_divide(jnp.sum(jnp.where(same, cos, 0.0)), n_same), 1.0)
  d = nc.safe_divide(jnp.sum(jnp.where(diff, cos, 0.0)), jnp.sum(diff).astype(f.dtype))
  return (1.0 - s) + g * jnp.abs(d)


def nbc_softmax_loss(embeddings: ArrayLike, class_weights: ArrayLike, labels: ArrayLike, *,
                     weight: float = 1.0, block_size: int = 1, temperature: float = 0.1,
                     where: ArrayLike | None = None) -> jax.Array:
  r"""NBC-softmax: softmax CE plus a negative-block contrastive term (feature L17) [R].

  From G. K. Kulatilleke, S. S. Chandra & M. Portmann, "NBC-Softmax: Darkweb Author
  Fingerprinting and Migration Tracking" (2022). The paper adds to the softmax loss a
  contrastive term whose negatives are *blocks* of the mini-batch; its exact form is not
  recorded, and this is a reconstruction [R]. With logits :math:`z_i = x_i W`, the batch
  cut into consecutive blocks of ``block_size`` examples, :math:`\hat x` the
  L2-normalised embeddings and :math:`\hat w_c` the normalised class proxies:

  .. math::
    \ell_i = \mathrm{CE}(z_i, y_i) + \lambda\Bigl[-\log
      \frac{e^{\hat x_i\cdot\hat w_{y_i}/\tau}}
           {e^{\hat x_i\cdot\hat w_{y_i}/\tau} + \sum_{b} e^{\hat x_i\cdot\hat n_{b,i}/\tau}}
      \Bigr],

  where :math:`n_{b,i}` is the mean of the normalised embeddings of block b whose class
  differs from :math:`y_i` (a block with none is skipped). ``weight = 0`` gives softmax CE;
  the contrastive term is >= 0 and falls as examples align with their proxy and move away
  from other classes; ``block_size = 1`` contrasts every other-class example.

  Args:
    embeddings: ``[B, d]`` features.
    class_weights: ``[d, C]`` linear classifier (its columns are the class proxies).
    labels: ``[B]`` integer classes.
    weight: λ >= 0.
    block_size: examples per negative block, >= 1 (the last block may be shorter).
    temperature: τ > 0.
    where: optional ``[B]`` example mask (False: loss 0, and left out of every block).

  Returns:
    ``[B]`` losses in ``embeddings``' dtype.

  Examples:
    >>> x, w = jnp.array([[1.0, 0.0], [0.0, 1.0]]), jnp.eye(2)
    >>> print(js.losses.nbc_softmax_loss(x, w, jnp.array([0, 1]), weight=0.0))
    [0.3133 0.3133]

  References:
    G. K. Kulatilleke, S. S. Chandra & M. Portmann, 2022, "NBC-Softmax: Darkweb Author
    Fingerprinting and Migration Tracking".
  """
  fn = "nbc_softmax_loss"
  lam = lc.nonnegative_float(weight, "weight", fn)
  check_positive(temperature, "temperature", fn)
  positive_int(block_size, "block_size", fn)
  out_dtype = nc.output_dtype(jnp.result_type(embeddings))
  x, y, keep = _check_batch(embeddings, labels, where, fn)
  w = lc.float_input(class_weights, "class_weights", fn)
  if w.ndim != 2 or w.shape[0] != x.shape[1]:
    raise ValueError(f"{fn}: `class_weights` must be floating [d, C] with d = {x.shape[1]}, "
                     f"got {w.shape} {w.dtype}")
  wc = w.astype(x.dtype)
  ce_logits = x @ wc
  ce, visible = lc.masked_logsumexp(ce_logits, jnp.ones(ce_logits.shape, bool), 1)
  z_y, label_ok = lc.gather_label(ce_logits, jnp.ones(ce_logits.shape, bool), y, 1)
  ce = jnp.where(label_ok, ce - z_y, jnp.inf)
  if lam == 0.0:
    return lc.finish(ce, keep & visible, out_dtype)
  n = x.shape[0]
  xh = _l2_normalize(x, axis=-1)
  wh = _l2_normalize(wc, axis=0)
  pos = jnp.sum(xh * jnp.take(wh, jnp.clip(y, 0, wh.shape[1] - 1), axis=1).T, -1)
  block = jnp.arange(n) // block_size
  n_blocks = -(-n // block_size)
  in_block = jax.nn.one_hot(block, n_blocks, dtype=x.dtype)  # [B, nb]
  # other[i, j]: example j counts as a negative of anchor i.
  other = (keep[None, :] & (y[:, None] != y[None, :])).astype(x.dtype)
  counts = other @ in_block  # [B(anchor), nb]
  # a masked example is left out of the sums (its NaN too: 0 * NaN would reach every anchor)
  sums = jnp.einsum("ij,jb,jd->ibd", other, in_block, jnp.where(keep[:, None], xh, 0.0))
  means = nc.safe_divide(sums, counts[..., None])
  neg = jnp.einsum("id,ibd->ib", xh, means) / temperature
  logits = jnp.concatenate([(pos / temperature)[:, None], neg], axis=1)
  mask = jnp.concatenate([jnp.ones((n, 1), bool), counts > 0], axis=1)
  lse, _ = lc.masked_logsumexp(logits, mask, 1)
  contrast = lse - pos / temperature
  return lc.finish(ce + lam * contrast, keep & visible, out_dtype)
