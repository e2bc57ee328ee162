"""PMRL's instance-wise contrastive regulariser on the leading singular vectors of each
instance's modality embeddings (feature L17, with :func:`jaxsoft.losses.pmrl_loss`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive
from jaxsoft.losses import _common as lc
from jaxsoft.losses._margin import _l2_normalize
from jaxsoft.normalizers import common as nc

__all__ = ["pmrl_contrastive_regularizer"]


def _eig_parts(a):
  w, q = jnp.linalg.eigh(a)  # ascending
  u = q[..., -1]
  # sign: a non-negative entry sum, and where the sum is 0 up to rounding (two unit
  # modalities with a negative cosine give u = (1, -1)/sqrt(2) exactly, whose computed sum
  # is +-1e-17: the sign, and the loss, would jump with the rounding) a non-negative first
  # entry
  total = jnp.sum(u, axis=-1, keepdims=True)
  tie = jnp.abs(total) <= 8 * u.shape[-1] * jnp.finfo(u.dtype).eps
  sign = jnp.where(jnp.where(tie, u[..., :1], total) < 0, -1.0, 1.0).astype(u.dtype)
  return w, q, u * sign


@jax.custom_jvp
def _top_eigenvector(a):
  """The unit eigenvector of the largest eigenvalue of symmetric ``a [..., M, M]``, its sign
  fixed by a non-negative entry sum; the tangent is finite for any spectrum."""
  return _eig_parts(a)[2]


@_top_eigenvector.defjvp
def _top_eigenvector_jvp(primals, tangents):
  (a,), (da,) = primals, tangents
  w, q, u = _eig_parts(a)
  # du = sum_{k: lambda_k < lambda_1} q_k q_k^T dA u / (lambda_1 - lambda_k): first-order
  # perturbation theory; components of a repeated top eigenvalue (no defined direction) get 0
  gap = w[..., -1:] - w
  tol = 1e3 * jnp.finfo(w.dtype).eps * jnp.maximum(jnp.abs(w[..., -1:]), jnp.finfo(w.dtype).tiny)
  inv = jnp.where(gap > tol, 1.0 / jnp.where(gap > tol, gap, 1.0), 0.0)
  das = 0.5 * (da + jnp.swapaxes(da, -1, -2))
  dau = jnp.einsum("...ij,...j->...i", das, u)
  du = jnp.einsum("...ik,...k->...i", q, inv * jnp.einsum("...ik,...i->...k", q, dau))
  return u, du


def pmrl_contrastive_regularizer(embeddings: ArrayLike, *, temperature: float = 0.1,
                                 where: ArrayLike | None = None) -> jax.Array:
  r"""PMRL's instance-wise contrastive regulariser on the leading singular vectors (L17).

  From X. Liu, X. Xia, S.-K. Ng & T.-S. Chua, "Principled Multimodal Representation
  Learning" (2025): the alignment loss (:func:`jaxsoft.losses.pmrl_loss`) pulls each
  instance's modality embeddings onto one leading direction; this regulariser keeps the
  directions of different instances apart so that the representations do not collapse.
  For instance i, the L2-normalised modality embeddings are the rows :math:`z_i^m` of
  :math:`Z_i \in \mathbb{R}^{M\times d}`, and :math:`v_i` is the leading right singular
  vector of :math:`Z_i` (unit). The regulariser is an InfoNCE over the batch with each
  instance's direction as its own positive, as in the authors' reference code:

  .. math::
    \ell_i = -\log \frac{e^{v_i\cdot v_i/\tau}}{\sum_{j} e^{v_i\cdot v_j/\tau}}
    = \log \sum_j e^{(v_i\cdot v_j - 1)/\tau}.

  A singular vector's sign is arbitrary, and :math:`v_i\cdot v_j` depends on it: [R] the
  sign is fixed so that :math:`v_i` points along the modalities,
  :math:`\sum_m z_i^m\cdot v_i \ge 0`, and where that sum is 0 (two modalities with a
  negative cosine) so that :math:`z_i^1\cdot v_i \ge 0` (the reference code keeps
  whatever sign its SVD routine returns). Invariant to a rotation applied to every
  embedding; :math:`\ell_i \ge 0`, near 0 when the directions are far apart. :math:`v_i` is computed from the top eigenvector
  :math:`u_i` of the Gram matrix :math:`Z_iZ_i^\top` as
  :math:`Z_i^\top u_i / \lVert Z_i^\top u_i\rVert`; its gradient is the exact one
  (first-order perturbation theory) where :math:`\sigma_1` is simple, and stays finite (no
  NaN) when singular values repeat.

  Args:
    embeddings: ``[N, M, d]``: M modality embeddings for each of N instances (any scale).
    temperature: τ > 0.
    where: optional ``[N]`` instance mask or ``[N, M]`` modality mask: a False modality is
      left out of its instance's direction; an instance with no visible modality is neither
      an anchor nor a negative and gets 0 with zero gradient.

  Returns:
    ``[N]`` losses in ``embeddings``' dtype (float32 compute for bf16/fp16).

  Examples:
    >>> z = jnp.array([[[1.0, 0.0], [1.0, 0.1]], [[0.0, 1.0], [0.1, 1.0]]])
    >>> js.losses.pmrl_contrastive_regularizer(z, temperature=0.5)
    Array([0.1528, 0.1528], dtype=float32)

  References:
    X. Liu, X. Xia, S.-K. Ng & T.-S. Chua, 2025, "Principled Multimodal Representation
    Learning".
  """
  fn = "pmrl_contrastive_regularizer"
  check_positive(temperature, "temperature", fn)
  z = lc.float_input(embeddings, "embeddings", fn)
  if z.ndim != 3:
    raise ValueError(f"{fn}: `embeddings` must be floating [N, M, d], got {z.shape} {z.dtype}")
  n, m, _ = z.shape
  zc = _l2_normalize(z.astype(nc.compute_dtype(z.dtype)), axis=-1)
  keep = jnp.ones((n, m), bool)
  if where is not None:
    wh = jnp.asarray(where, bool)
    if wh.shape == (n,):
      wh = wh[:, None]
    if wh.ndim != 2:
      raise ValueError(f"{fn}: `where` of shape {wh.shape} must be [N] = ({n},) or "
                       f"[N, M] = {(n, m)}")
    try:
      keep = jnp.broadcast_to(wh, (n, m))
    except ValueError:
      raise ValueError(f"{fn}: `where` of shape {wh.shape} must be [N] = ({n},) or "
                       f"[N, M] = {(n, m)}") from None
  zc = jnp.where(keep[..., None], zc, 0.0)
  inst = jnp.any(keep, axis=-1)  # [N]
  if m == 0 or n == 0:
    return jnp.zeros((n,), z.dtype)
  u = _top_eigenvector(jnp.einsum("nmd,nkd->nmk", zc, zc))  # [N, M]
  v = jnp.einsum("nmd,nm->nd", zc, u)
  norm = jnp.sqrt(jnp.sum(jnp.square(v), axis=-1, keepdims=True))
  ok = norm != 0  # True for a NaN norm (`norm > 0` would zero a NaN instance: a finite loss)
  v = jnp.where(ok, v / jnp.where(ok, norm, 1.0), 0.0)
  logits = jnp.einsum("nd,jd->nj", v, v) / temperature  # [N, N]
  cols = jnp.broadcast_to(inst[None, :], logits.shape)
  lse, _ = lc.masked_logsumexp(logits, cols, -1)
  loss = lse - jnp.diagonal(logits)
  return lc.finish(loss, inst, z.dtype)
