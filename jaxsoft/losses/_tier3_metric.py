"""L17 (part 2), losses on embeddings: WCDAS (wrapped-Cauchy angular softmax), NBC-softmax,
OPL (orthogonal projection loss) and PMRL (softmax over singular values)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft.losses import _common as lc
from jaxsoft.losses._margin import _l2_normalize, check_margin, check_positive, cosine_logits
from jaxsoft.normalizers import common as nc

__all__ = [
    "nbc_softmax_loss",
    "orthogonal_projection_loss",
    "pmrl_loss",
    "wcdas_loss",
    "wrapped_cauchy_log_density",
]


def wrapped_cauchy_log_density(theta: ArrayLike, concentration: ArrayLike,
                               loc: ArrayLike = 0.0) -> jax.Array:
  r"""Log density of the wrapped Cauchy distribution on the circle.

  .. math::
    \mathrm{wC}(\theta; \mu, \rho) = \frac{1}{2\pi}
      \frac{1 - \rho^2}{1 + \rho^2 - 2\rho\cos(\theta - \mu)}, \qquad \rho \in [0, 1),

  uniform at :math:`\rho = 0`, concentrating at :math:`\mu` as :math:`\rho \to 1`;
  heavier-tailed than the von Mises with the same peak.

  Args:
    theta: angles (radians).
    concentration: ρ in [0, 1), broadcast with ``theta``.
    loc: μ, broadcast with ``theta``.

  Returns:
    :math:`\log \mathrm{wC}` in float32 (float64 for float64 inputs).
  """
  t = jnp.asarray(theta)
  rho = jnp.asarray(concentration)
  dtype = nc.compute_dtype(jnp.result_type(t.dtype, rho.dtype, jnp.float32))
  return _wc_log_kernel(jnp.cos(t.astype(dtype) - jnp.asarray(loc, dtype)),
                        rho.astype(dtype)) - math.log(2 * math.pi)


def _wc_log_kernel(cos, rho):
  """log((1 - rho^2) / (1 + rho^2 - 2 rho cos)) = log(2 pi wC), written with log1p."""
  return jnp.log1p(-jnp.square(rho)) - jnp.log(jnp.square(1.0 - rho) + 2.0 * rho * (1.0 - cos))


def wcdas_loss(embeddings: ArrayLike, class_weights: ArrayLike, labels: ArrayLike,
               concentration: ArrayLike, *, scale: float = 1.0,
               where: ArrayLike | None = None,
               ignore_index: int | None = None) -> jax.Array:
  r"""WCDAS: softmax CE over wrapped-Cauchy angular kernel logits (feature L17) [R].

  From B. Han et al., "Wrapped Cauchy Distributed Angular Softmax for Long-Tailed Visual
  Recognition" (ICML 2023): each class's angular distribution is a mixture of wrapped
  Cauchy kernels around its centres, with a trainable per-class concentration
  :math:`\rho_c`, and the log of that mixture is the class logit. The exact logit is not
  recorded; this reconstruction [R], with :math:`\theta_{ck}` the angle between the
  embedding and the k-th of the K centres of class c (:math:`\cos\theta` from the
  L2-normalised vectors, no ``arccos``), is

  .. math::
    z_c = s \log\frac1K \sum_{k=1}^{K} 2\pi\,\mathrm{wC}(\theta_{ck}; 0, \rho_c)
        = s \log\frac1K \sum_k \frac{1 - \rho_c^2}{1 + \rho_c^2 - 2\rho_c\cos\theta_{ck}},
    \qquad \ell = -\log\mathrm{softmax}(z)_y.

  :math:`\rho_c = 0` gives :math:`z_c = 0` (no preference for class c); a larger
  :math:`\rho_c` sharpens class c's kernel (more compact, larger margin), and a class's
  logit is bounded by :math:`s\log\frac{1+\rho_c}{1-\rho_c}`. Keep :math:`\rho \in [0, 1)`
  by construction (e.g. a sigmoid of a free parameter).

  Args:
    embeddings: ``[..., d]`` features (L2-normalised inside).
    class_weights: ``[d, C]`` class centres, or ``[d, C, K]`` with K kernels per class.
    labels: integer classes of ``embeddings``' shape without the last axis.
    concentration: ρ, ``[C]`` (or a scalar) in [0, 1); differentiable.
    scale: s > 0.
    where: optional class or example mask, as :func:`arcface_loss`.
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``embeddings``' dtype.

  Example:
    >>> import jax.numpy as jnp, jaxsoft as js
    >>> jnp.set_printoptions(precision=4)
    >>> x, w = jnp.array([[1.0, 0.0]]), jnp.eye(2)
    >>> print(js.losses.wcdas_loss(x, w, jnp.array([0]), jnp.array([0.5, 0.5])))
    [0.1823]
  """
  fn = "wcdas_loss"
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  check_positive(scale, "scale", fn)
  out_dtype = jnp.asarray(embeddings).dtype
  w = jnp.asarray(class_weights)
  if w.ndim not in (2, 3):
    raise ValueError(f"{fn}: `class_weights` must be [d, C] or [d, C, K] (K kernels per "
                     f"class), got shape {w.shape}")
  if w.ndim == 2:
    w = w[..., None]
  n_cls, n_ker = w.shape[1], w.shape[2]
  # every kernel's cosine (cosine_logits would keep only the largest of a class's K)
  cos = cosine_logits(embeddings, w.reshape(w.shape[0], n_cls * n_ker), fn)
  cos = cos.reshape(cos.shape[:-1] + (n_cls, n_ker))
  try:
    rho_np = np.asarray(concentration, np.float64)
  except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    rho_np = None  # traced (a learned concentration): the caller vouches for its range
  if rho_np is not None and not np.all((rho_np >= 0) & (rho_np < 1)):
    raise ValueError(f"{fn}: `concentration` must lie in [0, 1), got {concentration!r}")
  rho = jnp.asarray(concentration, cos.dtype)
  if rho.ndim > 1 or (rho.ndim == 1 and rho.shape[0] not in (1, n_cls)):
    raise ValueError(f"{fn}: `concentration` must be a scalar or [C] = [{n_cls}], got "
                     f"{rho.shape}")
  rho = jnp.broadcast_to(rho, (n_cls,))[:, None]
  logits = scale * (jax.nn.logsumexp(_wc_log_kernel(cos, rho), axis=-1) - math.log(n_ker))
  labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise ValueError(f"{fn}: `labels` must have an integer dtype, got {labels.dtype}")
  if labels.shape != logits.shape[:-1]:
    raise ValueError(f"{fn}: `labels` of shape {labels.shape} must have the shape of "
                     f"`embeddings` without its last axis, {logits.shape[:-1]}")
  axis = logits.ndim - 1
  z, mask, axis = lc.prepare(logits, axis, where, fn)
  z_y, label_visible = lc.gather_label(z, mask, labels, axis)
  lse, visible = lc.masked_logsumexp(z, mask, axis)
  return lc.integer_finish(lse - z_y, labels, visible, label_visible, ignore_index, out_dtype)


def _check_batch(embeddings, labels, where, fn, name="embeddings"):
  """``[B, d]`` float32/64 embeddings, ``[B]`` integer labels and a ``[B]`` keep mask."""
  x = jnp.asarray(embeddings)
  if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim != 2:
    raise ValueError(f"{fn}: `{name}` must be floating [B, d], got {x.shape} {x.dtype}")
  y = jnp.asarray(labels)
  if not jnp.issubdtype(y.dtype, jnp.integer) or y.shape != x.shape[:1]:
    raise ValueError(f"{fn}: `labels` must be [B] = {x.shape[:1]} integers, got "
                     f"{y.shape} {y.dtype}")
  keep = jnp.ones(y.shape, bool) if where is None else jnp.asarray(where, bool)
  if keep.shape != y.shape:
    raise ValueError(f"{fn}: `where` must be a [B] example mask, got shape {keep.shape}")
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

  Example:
    >>> import jax.numpy as jnp, jaxsoft as js
    >>> f = jnp.array([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]])
    >>> print(round(float(js.losses.orthogonal_projection_loss(f, jnp.array([0, 0, 1]))), 6))
    0.0
  """
  fn = "orthogonal_projection_loss"
  g = check_margin(gamma, fn, name="gamma")
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

  Example:
    >>> import jax.numpy as jnp, jaxsoft as js
    >>> jnp.set_printoptions(precision=4)
    >>> x, w = jnp.array([[1.0, 0.0], [0.0, 1.0]]), jnp.eye(2)
    >>> print(js.losses.nbc_softmax_loss(x, w, jnp.array([0, 1]), weight=0.0))
    [0.3133 0.3133]
  """
  fn = "nbc_softmax_loss"
  lam = check_margin(weight, fn, name="weight")
  check_positive(temperature, "temperature", fn)
  if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
    raise ValueError(f"{fn}: `block_size` must be an int >= 1, got {block_size!r}")
  out_dtype = jnp.asarray(embeddings).dtype
  x, y, keep = _check_batch(embeddings, labels, where, fn)
  w = jnp.asarray(class_weights)
  if not jnp.issubdtype(w.dtype, jnp.floating) or w.ndim != 2 or w.shape[0] != x.shape[1]:
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
  sums = jnp.einsum("ij,jb,jd->ibd", other, in_block, xh)
  means = nc.safe_divide(sums, counts[..., None])
  neg = jnp.einsum("id,ibd->ib", xh, means) / temperature
  logits = jnp.concatenate([(pos / temperature)[:, None], neg], axis=1)
  mask = jnp.concatenate([jnp.ones((n, 1), bool), counts > 0], axis=1)
  lse, _ = lc.masked_logsumexp(logits, mask, 1)
  contrast = lse - pos / temperature
  return lc.finish(ce + lam * contrast, keep & visible, out_dtype)


def pmrl_loss(embeddings: ArrayLike, *, temperature: float = 1.0,
              where: ArrayLike | None = None) -> jax.Array:
  r"""PMRL alignment loss: softmax CE over singular values, target the largest (L17).

  From X. Liu et al., "Principled Multimodal Representation Learning" (2025). For one
  instance, its M modality embeddings, L2-normalised, are the rows of
  :math:`Z \in \mathbb{R}^{M\times d}` with singular values
  :math:`\sigma_1 \ge \dots \ge \sigma_M`:

  .. math::
    \ell = -\log\frac{e^{\sigma_1/\tau}}{\sum_k e^{\sigma_k/\tau}}.

  Since :math:`\sum_k\sigma_k^2 = \lVert Z\rVert_F^2 = M`, raising :math:`\sigma_1`
  pushes Z to rank 1 (all modalities aligned); identical embeddings give
  :math:`\sigma_1 = \sqrt M`, the others 0, and the minimum
  :math:`\log(1 + (M - 1)e^{-\sqrt M/\tau})`. Invariant to a common rotation of the
  embeddings. The paper's instance-wise contrastive regulariser on the leading singular
  vectors (against collapse) is left to the caller. The singular values' gradient
  :math:`\partial\sigma_k/\partial Z = u_k v_k^\top` stays finite when they are repeated.

  Args:
    embeddings: ``[..., M, d]``: M modality embeddings per instance (any scale).
    temperature: τ > 0.
    where: optional ``[..., M]`` modality mask (False rows are left out: the sums run
      over the visible ones; an instance with none gets 0).

  Returns:
    ``[...]`` losses in ``embeddings``' dtype.

  Example:
    >>> import jax.numpy as jnp, jaxsoft as js
    >>> z = jnp.array([[1.0, 0.0], [2.0, 0.0]])  # aligned: sigma = (sqrt 2, 0)
    >>> print(round(float(js.losses.pmrl_loss(z)), 4))
    0.2176
  """
  fn = "pmrl_loss"
  check_positive(temperature, "temperature", fn)
  z = jnp.asarray(embeddings)
  if not jnp.issubdtype(z.dtype, jnp.floating) or z.ndim < 2:
    raise ValueError(f"{fn}: `embeddings` must be floating [..., M, d], got {z.shape} {z.dtype}")
  m = z.shape[-2]
  zc = _l2_normalize(z.astype(nc.compute_dtype(z.dtype)), axis=-1)
  keep = jnp.ones(z.shape[:-1], bool)
  if where is not None:
    wh = jnp.asarray(where, bool)
    try:
      keep = jnp.broadcast_to(wh, z.shape[:-1])
    except ValueError:
      raise ValueError(f"{fn}: `where` of shape {wh.shape} does not broadcast to the "
                       f"modalities {z.shape[:-1]}") from None
    zc = jnp.where(keep[..., None], zc, 0.0)
  sigma = jnp.linalg.svd(zc, compute_uv=False)  # descending
  n_vis = jnp.sum(keep, axis=-1, keepdims=True)
  # masked rows add zero singular values: keep only the n_vis largest
  smask = jnp.arange(sigma.shape[-1]) < n_vis
  lse, visible = lc.masked_logsumexp(sigma / temperature, smask, -1)
  loss = lse - sigma[..., 0] / temperature if m > 0 else lse
  return lc.finish(loss, visible, z.dtype)
