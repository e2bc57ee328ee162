"""Multimodal representation alignment: PMRL, the softmax CE over the singular values of an
instance's modality embeddings (feature L17)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive
from jaxsoft.losses import _common as lc
from jaxsoft.losses._margin import _l2_normalize
from jaxsoft.normalizers import common as nc

__all__ = ["pmrl_loss"]


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

  Examples:
    >>> z = jnp.array([[1.0, 0.0], [2.0, 0.0]])  # aligned: sigma = (sqrt 2, 0)
    >>> print(round(float(js.losses.pmrl_loss(z)), 4))
    0.2176

  References:
    X. Liu et al., 2025, "Principled Multimodal Representation Learning".
  """
  fn = "pmrl_loss"
  check_positive(temperature, "temperature", fn)
  z = lc.float_input(embeddings, "embeddings", fn)
  if z.ndim < 2:
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
  smask = lc.at_rank(jnp.arange(sigma.shape[-1]), n_vis.ndim) < n_vis
  lse, visible = lc.masked_logsumexp(sigma / temperature, smask, -1)
  loss = lse - sigma[..., 0] / temperature if m > 0 else lse
  return lc.finish(loss, visible, z.dtype)
