"""L07 Partial FC: a margin softmax whose class centres are sharded over a mesh axis and
sampled per step; the log-sum-exp is reduced across shards (pmax, then psum)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive
from jaxsoft.losses import _common as lc
from jaxsoft.losses._margin import angular_margin_target, cosine_logits

__all__ = ["partial_fc_loss"]


def partial_fc_loss(embeddings: ArrayLike, class_weights: ArrayLike, labels: ArrayLike, *,
                    mesh: jax.sharding.Mesh | None = None, class_axis: str = "model",
                    sample_rate: float = 1.0, key: jax.Array | None = None,
                    margin_type: str = "arcface", scale: float = 64.0, margin: float = 0.5,
                    easy_margin: bool = False, where: ArrayLike | None = None,
                    ignore_index: int | None = None) -> jax.Array:
  r"""Partial FC: class-sharded, class-sampled margin softmax (feature L07).

  From X. An, X. Zhu, Y. Gao, Y. Xiao, Y. Zhao, Z. Feng, L. Wu, B. Qin, M. Zhang, D. Zhang
  & Y. Fu, "Partial FC: Training 10 Million Identities on a Single Machine" (ICCVW 2021),
  and X. An, J. Deng, J. Guo, Z. Feng, X. Zhu, J. Yang & T. Liu, "Killing Two Birds with
  One Stone: Efficient and Robust Training of Face Recognition CNNs by Partial FC"
  (CVPR 2022). The class centres ``class_weights [d, C]`` are split over the ``class_axis``
  of ``mesh`` (K shards of C/K classes); the features are replicated (all-gathered) on
  every shard. Each shard keeps every centre that is a positive of the batch plus
  uniformly sampled negatives, :math:`\max(\lceil rC/K\rceil, \min(B, C/K))` centres in
  all (so every positive fits), computes the cosine logits of those only, applies the
  margin to the label's logit (ArcFace :math:`\cos(\theta_y + m)` or CosFace
  :math:`\cos\theta_y - m`, as :func:`arcface_loss` / :func:`cosface_loss`) and the
  softmax CE runs over the sampled classes of all shards:

  .. math::
    M = \mathrm{pmax}_k \max_{j \in S_k} s\,\cos\theta_j, \qquad
    \mathrm{LSE} = M + \log \mathrm{psum}_k \sum_{j \in S_k} e^{s\cos\theta_j - M},
    \qquad \ell = \mathrm{LSE} - s\,\phi(\theta_y).

  Gradients reach only the sampled centres. With ``sample_rate = 1`` it equals the
  unsharded :func:`arcface_loss` / :func:`cosface_loss`; below 1 it is a biased estimate
  (fewer denominator terms, so never above the full loss). ``mesh=None`` runs the same
  computation on one device (the sampling still applies).

  Args:
    embeddings: ``[B, d]`` features (replicated; L2-normalised inside).
    class_weights: ``[d, C]`` (or ``[d, C, K]`` with sub-centres) class centres; C must be
      a multiple of the size of ``class_axis``. Pass it sharded as ``P(None, class_axis)``
      to avoid a reshard.
    labels: ``[B]`` integer classes.
    mesh: the mesh holding ``class_axis``, or None.
    class_axis: the mesh axis the classes are split over.
    sample_rate: r in (0, 1], the fraction of each shard's centres kept.
    key: a PRNG key for the sampling; required when ``sample_rate < 1``. Each shard folds
      in its index.
    margin_type: ``"arcface"`` or ``"cosface"``.
    scale: s > 0.
    margin: the ArcFace angle in [0, π) or the CosFace cosine margin >= 0.
    easy_margin: ArcFace's easy-margin rule.
    where: optional ``[B]`` example mask (False: loss 0, zero gradient).
    ignore_index: a label value whose examples get loss 0.

  Returns:
    ``[B]`` losses in ``embeddings``' dtype (a label outside ``[0, C)`` gets ``+inf``).

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (4, 8))
    >>> w = jax.random.normal(jax.random.key(1), (8, 16))
    >>> y = jnp.array([0, 5, 9, 15])
    >>> full = js.losses.partial_fc_loss(x, w, y)
    >>> bool(jnp.allclose(full, js.losses.arcface_loss(x, w, y), rtol=1e-5))
    True
    >>> part = js.losses.partial_fc_loss(x, w, y, sample_rate=0.5, key=jax.random.key(2))
    >>> bool(jnp.all(part <= full + 1e-4))
    True

  References:
    X. An, X. Zhu, Y. Gao, Y. Xiao, Y. Zhao, Z. Feng, L. Wu, B. Qin, M. Zhang, D. Zhang & Y. Fu,
    2021, "Partial FC: Training 10 Million Identities on a Single Machine" (ICCV workshops).

    X. An, J. Deng, J. Guo, Z. Feng, X. Zhu, J. Yang & T. Liu, 2022, "Killing Two Birds with One
    Stone: Efficient and Robust Training of Face Recognition CNNs by Partial FC" (CVPR).

    J. Deng, J. Guo, N. Xue & S. Zafeiriou, 2019, "ArcFace: Additive Angular Margin Loss for
    Deep Face Recognition" (CVPR).

    H. Wang, Y. Wang, Z. Zhou, X. Ji, D. Gong, J. Zhou, Z. Li & W. Liu, 2018, "CosFace: Large
    Margin Cosine Loss for Deep Face Recognition" (CVPR).
  """
  fn = "partial_fc_loss"
  ignore_index = lc.check_ignore_index(ignore_index, fn)
  x = jnp.asarray(embeddings)
  w = jnp.asarray(class_weights)
  if x.ndim != 2:
    raise ValueError(f"{fn}: `embeddings` must be [B, d], got shape {x.shape}")
  labels = jnp.asarray(lc.check_integer_labels(labels, x.shape, 1, fn))
  if w.ndim not in (2, 3) or w.shape[0] != x.shape[1]:
    raise ValueError(f"{fn}: `class_weights` must be [d, C] or [d, C, K] with d = {x.shape[1]}, "
                     f"got shape {w.shape}")
  if margin_type == "arcface":
    m = lc.nonnegative_float(margin, "margin", fn, upper=math.pi)
    target = lambda c: angular_margin_target(c, m, easy_margin)  # noqa: E731
  elif margin_type == "cosface":
    m = lc.nonnegative_float(margin, "margin", fn)
    target = lambda c: c - m  # noqa: E731
  else:
    raise ValueError(f"{fn}: `margin_type` must be 'arcface' or 'cosface', got {margin_type!r}")
  scale = check_positive(scale, "scale", fn)
  rate = float(sample_rate)
  if not 0.0 < rate <= 1.0:
    raise ValueError(f"{fn}: `sample_rate` must be in (0, 1], got {sample_rate!r}")
  if rate < 1.0 and key is None:
    raise ValueError(f"{fn}: `key` is required when `sample_rate` < 1 (class sampling)")
  key = jax.random.key(0) if key is None else key
  n_shards = 1
  if mesh is not None:
    if class_axis not in mesh.axis_names:
      raise ValueError(f"{fn}: `class_axis` {class_axis!r} is not an axis of `mesh` "
                       f"{mesh.axis_names}")
    n_shards = mesh.shape[class_axis]
  n_classes = w.shape[1]
  if n_classes % n_shards:
    raise ValueError(f"{fn}: `class_weights` has C = {n_classes} classes, not a multiple of the "
                     f"{n_shards} shards of mesh axis {class_axis!r}")
  c_local = n_classes // n_shards
  n_sample = min(c_local, max(math.ceil(rate * c_local), min(x.shape[0], c_local)))
  keep = lc.example_keep(where, labels, ignore_index, fn)

  def shard_fn(x, w_local, labels, keep, key):
    axis = class_axis if mesh is not None else None
    return _local_margin_ce(x, w_local, labels, keep, key, axis, n_sample, target, scale, fn)

  if mesh is None:
    loss, owned = shard_fn(x, w, labels, keep, key)
  else:
    w_spec = P(None, class_axis) if w.ndim == 2 else P(None, class_axis, None)
    w = jax.device_put(w, NamedSharding(mesh, w_spec))
    x, labels, keep = (jax.device_put(a, NamedSharding(mesh, P())) for a in (x, labels, keep))
    loss, owned = jax.shard_map(shard_fn, mesh=mesh, in_specs=(P(), w_spec, P(), P(), P()),
                                out_specs=(P(), P()))(x, w, labels, keep, key)
  loss = jnp.where(owned, loss, jnp.inf)
  return lc.finish(loss, keep, x.dtype)


def _local_margin_ce(x, w_local, labels, keep, key, axis, n_sample, target, scale, fn):
  """One shard's part; the row statistics are reduced over ``axis`` (None: one shard)."""
  psum = (lambda v: jax.lax.psum(v, axis)) if axis else (lambda v: v)
  pmax = (lambda v: jax.lax.pmax(v, axis)) if axis else (lambda v: v)
  c_local = w_local.shape[1]
  shard = jax.lax.axis_index(axis) if axis else 0
  local = labels - shard * c_local
  mine = keep & (local >= 0) & (local < c_local)
  if n_sample < c_local:
    positive = jnp.zeros((c_local,), bool).at[jnp.where(mine, local, c_local)].set(
        True, mode="drop")
    priority = jnp.where(positive, 2.0, jax.random.uniform(jax.random.fold_in(key, shard),
                                                           (c_local,)))
    _, idx = jax.lax.top_k(priority, n_sample)
    w_local = jnp.take(w_local, idx, axis=1)
  else:
    idx = jnp.arange(c_local)
  cos = cosine_logits(x, w_local, fn)                         # [B, n_sample]
  hit = (idx[None, :] == local[:, None]) & mine[:, None]
  c_y = psum(jnp.sum(jnp.where(hit, cos, 0.0), axis=-1))
  owned = psum(jnp.sum(hit, axis=-1)) > 0
  phi = target(c_y)
  logits = scale * jnp.where(hit, phi[:, None], cos)
  m = jax.lax.stop_gradient(pmax(jnp.max(jax.lax.stop_gradient(logits), axis=-1)))
  total = psum(jnp.sum(jnp.exp(logits - m[:, None]), axis=-1))
  loss = m + jnp.log(total) - scale * phi
  return loss, owned

