"""L18 ACOL, the auto-clustering output layer: k softmax nodes per class whose
probabilities sum to the class's, with the graph-based activity regulariser (GAR) that
makes the duplicates compete, so they learn sub-clusters (latent sub-classes) of each class.

Logits come as ``[..., C, k]``: C classes (the coarse labels, the paper's parents) times
k duplicates each (the paper's layer is one flat ``[..., C*k]`` vector whose node
``j*C + c`` belongs to class c: ``z.reshape(..., k, C).swapaxes(-1, -2)`` gives this
layout).

References:
  O. Kilinc & I. Uysal, 2017, "Auto-clustering Output Layer: Automatic Learning of Latent
  Annotations in Neural Networks" (arXiv 1702.08648).

  O. Kilinc & I. Uysal, 2018, "GAR: An Efficient and Scalable Graph-Based Activity
  Regularization for Semi-Supervised Learning" (Neurocomputing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc

__all__ = ["acol_gar", "acol_loss", "acol_probabilities"]


def _nodes(logits, fn: str) -> jax.Array:
  z = lc.check_logits(logits, fn)
  if z.ndim < 2 or z.shape[-1] < 1 or z.shape[-2] < 1:
    raise ValueError(f"{fn}: `logits` must be [..., C, k] with at least one class and one "
                     f"sub-cluster node per class, got shape {z.shape}")
  return z


def _parent_logits(x, mask):
  """``LSE_j z[c, j]`` over the visible nodes of each class and the class's visible flag."""
  return lc.masked_logsumexp(x, mask, -1)


def acol_probabilities(logits: ArrayLike, *, where: ArrayLike | None = None) -> jax.Array:
  r"""ACOL output layer: class probabilities as sums over duplicated softmax nodes (L18).

  From O. Kilinc & I. Uysal, "Auto-clustering Output Layer: Automatic Learning of Latent
  Annotations in Neural Networks" (2017): every class c has k softmax nodes
  :math:`z_{c,1..k}`, the softmax runs over all C·k of them and a fixed pooling layer
  sums each class's nodes,

  .. math::
    p_c = \sum_{j=1}^{k} \mathrm{softmax}(z)_{c,j}
        = \frac{e^{\mathrm{LSE}_j z_{c,j}}}{\sum_{c'} e^{\mathrm{LSE}_j z_{c',j}}},

  i.e. a softmax over the log-sum-exp pooled class logits (so k = 1 is the softmax).
  Which node of its class an example activates is its sub-cluster:
  ``jax.nn.softmax(logits, axis=(-2, -1))`` gives the node probabilities.

  Args:
    logits: ``[..., C, k]`` node logits (C classes, k nodes each).
    where: optional node mask broadcastable to ``logits`` (a class may have fewer nodes;
      ``-inf`` logits are masked too); a class with no visible node gets probability 0.

  Returns:
    ``[..., C]`` class probabilities, in ``logits``' dtype (bf16/fp16 computed in float32);
    a row with no visible node is all zeros.

  Examples:
    >>> z = jnp.array([[2.0, 0.0], [1.0, 1.0], [-1.0, 0.5]])   # C = 3 classes, k = 2 nodes
    >>> print(js.losses.acol_probabilities(z))
    [0.5295 0.3432 0.1273]
    >>> print(jax.nn.softmax(z, axis=(-2, -1)).sum(-1))          # sums of the node softmax
    [0.5295 0.3432 0.1273]

  References:
    O. Kilinc & I. Uysal, 2017, "Auto-clustering Output Layer: Automatic Learning of Latent
    Annotations in Neural Networks" (arXiv 1702.08648).
  """
  fn = "acol_probabilities"
  z = _nodes(logits, fn)
  x, mask, _ = nc.prepare(z, -1, where, fn)      # `where`: a node mask, broadcast as given
  parent, class_visible = _parent_logits(x, mask)                    # [..., C]
  lse, row_visible = lc.masked_logsumexp(parent, class_visible, -1)  # [...]
  p = jnp.where(class_visible, jnp.exp(parent - lse[..., None]), 0.0)
  return lc.finish(p, row_visible[..., None], z.dtype)


def _gar_terms(x, mask, keep):
  """(affinity, balance) of the rectified node activations of the kept examples."""
  m = x.shape[-2] * x.shape[-1]
  b = jnp.where(mask & keep[..., None, None], jax.nn.relu(x), 0.0).reshape(-1, m)
  sq = b * b
  v = jnp.sum(sq, axis=0)                       # diag(N), N = B^T B: each node's activity
  trace = jnp.sum(v)                            # tr N
  total = jnp.sum(jnp.square(jnp.sum(b, axis=-1)))   # sum of all entries of N
  affinity = nc.safe_divide(total - trace, (m - 1) * trace)
  v2 = jnp.sum(v * v)                           # tr V, V = v v^T
  balance = nc.safe_divide(trace * trace - v2, (m - 1) * v2)
  return affinity, balance


def acol_gar(logits: ArrayLike, *, where: ArrayLike | None = None) -> tuple[jax.Array, jax.Array]:
  r"""Graph-based activity regularisation terms of an ACOL layer: affinity and balance (L18).

  From O. Kilinc & I. Uysal (2017, 2018). Over a batch of m examples, with
  :math:`B = \max(0, Z)` the rectified node logits as an m × n matrix (n = C·k nodes,
  every class's duplicates together), :math:`N = B^\top B` (n × n: how often two nodes
  fire together) and :math:`v = \mathrm{diag}(N)`, :math:`V = v v^\top`:

  .. math::
    \alpha = \frac{\sum_{i \ne j} N_{ij}}{(n - 1) \sum_i N_{ii}}, \qquad
    \beta = \frac{\sum_{i \ne j} V_{ij}}{(n - 1) \sum_i V_{ii}}.

  The affinity :math:`\alpha \in [0, 1]` is 0 when each example activates at most one
  node and 1 when every example activates all nodes equally; the balance
  :math:`\beta \in [0, 1]` is 1 when every node carries the same total activity and 0 when
  one node carries it all. Training minimises :math:`c_\alpha \alpha + c_\beta (1 -
  \beta)` (:func:`acol_loss`): one-hot, evenly used nodes, i.e. a clustering of each
  class into k sub-clusters. Computed without the n × n matrices:
  :math:`\sum_{ij} N_{ij} = \sum_b (\sum_i B_{bi})^2`. A batch with no positive
  activation (or n = 1) gets :math:`\alpha = \beta = 0`, as the authors' code gives with
  its ε in the denominators.

  Args:
    logits: ``[..., C, k]`` node logits; every leading position is an example of the batch.
    where: optional example mask of ``logits``' shape without the last two axes (masked
      examples leave the batch statistics).

  Returns:
    ``(affinity, balance)``, two scalars in ``logits``' dtype (f32 compute for bf16/fp16).

  Examples:
    >>> one_hot = jnp.array([[[5.0, -1.0]], [[-1.0, 3.0]]])   # 2 examples, C = 1, k = 2
    >>> print(jnp.stack(js.losses.acol_gar(one_hot)))  # no co-activation; activities 25, 9
    [0.     0.6374]

  References:
    Kilinc & Uysal, 2018, "GAR: An Efficient and Scalable Graph-Based Activity
    Regularization for Semi-Supervised Learning" (Neurocomputing): the regulariser, as
    ACOL (Kilinc & Uysal, 2017, "Auto-clustering Output Layer", arXiv 1702.08648) applies
    it to the duplicated softmax nodes.
  """
  fn = "acol_gar"
  z = _nodes(logits, fn)
  keep = _example_mask(where, z, fn)
  x, mask, _, dtype = lc.prepare_logits(z, -1, None, fn)
  affinity, balance = _gar_terms(x, mask, keep)
  return affinity.astype(dtype), balance.astype(dtype)


def _example_mask(where, z, fn: str) -> jax.Array:
  if where is None:
    return jnp.ones(z.shape[:-2], bool)
  w = jnp.asarray(where)
  if w.shape != z.shape[:-2]:
    raise ValueError(f"{fn}: `where` of shape {w.shape} must be an example mask of `logits`' "
                     f"shape without the last two axes, {z.shape[:-2]}")
  return w.astype(bool)


def acol_loss(logits: ArrayLike, labels: ArrayLike, *, affinity_weight: float = 1.0,
              balance_weight: float = 1.0, frobenius_weight: float = 1e-6,
              where: ArrayLike | None = None) -> jax.Array:
  r"""ACOL training loss: cross-entropy of the pooled class probabilities plus GAR (L18).

  From O. Kilinc & I. Uysal, "Auto-clustering Output Layer: Automatic Learning of Latent
  Annotations in Neural Networks" (2017): with :math:`p` the class probabilities of
  :func:`acol_probabilities` and :math:`\alpha, \beta` the terms of :func:`acol_gar`,
  over a batch of m examples with node logits Z,

  .. math::
    \mathcal{L} = -\frac{1}{m}\sum_b \log p_{y_b}(z_b)
      + c_\alpha\,\alpha + c_\beta\,(1 - \beta) + c_F \lVert Z \rVert_F^2,

  with :math:`-\log p_y = \mathrm{LSE}_{c,j} z_{c,j} - \mathrm{LSE}_j z_{y,j}`. The
  cross-entropy only asks for the right class; GAR makes the k duplicates of each class
  split its examples between them (sub-clusters). With C = 1 (every label 0) the
  cross-entropy is 0 and the loss is unsupervised clustering into k clusters.
  [R] The defaults :math:`c_\alpha = c_\beta = 1`, :math:`c_F = 10^{-6}` and the
  unnormalised (summed over the batch) Frobenius term are those of the authors' code
  (``lalnets``), whose paper tunes the weights per dataset.

  Args:
    logits: ``[..., C, k]`` node logits; every leading position is an example of the batch.
    labels: integer class labels of ``logits``' shape without the last two axes.
    affinity_weight: :math:`c_\alpha \ge 0`.
    balance_weight: :math:`c_\beta \ge 0`.
    frobenius_weight: :math:`c_F \ge 0`, on the sum of the squared node logits.
    where: optional example mask (as in :func:`acol_gar`): masked examples leave the mean
      and the batch statistics; a batch with no visible example gives 0 with zero
      gradient (the package's rule for masked examples).

  Returns:
    The scalar loss of the batch, in ``logits``' dtype (f32 compute for bf16/fp16); a
    label naming a class with no visible node gives ``+inf``.

  Examples:
    >>> z = jnp.array([[[3.0, -2.0], [0.0, -1.0]], [[-1.0, 2.0], [0.0, 0.0]]])
    >>> y = jnp.array([0, 0])       # both examples in class 0, on different nodes
    >>> print(jnp.round(js.losses.acol_loss(z, y, frobenius_weight=0.0), 4))
    0.9
    >>> # = CE 0.1474 + affinity 0 (one node each) + 1 - balance 0.7526 (2 of 4 nodes used)

  References:
    Kilinc & Uysal, 2017, "Auto-clustering Output Layer: Automatic Learning of Latent
    Annotations in Neural Networks" (arXiv 1702.08648): the training objective, with the
    GAR terms of Kilinc & Uysal, 2018, "GAR: An Efficient and Scalable Graph-Based
    Activity Regularization for Semi-Supervised Learning".
  """
  fn = "acol_loss"
  weights = [lc.nonnegative_float(w, name, fn) for w, name in (
      (affinity_weight, "affinity_weight"), (balance_weight, "balance_weight"),
      (frobenius_weight, "frobenius_weight"))]
  z = _nodes(logits, fn)
  labels = lc.check_labels(labels, z.shape[:-2], fn, "labels",
                           "`logits`' shape without the last two axes")
  keep = _example_mask(where, z, fn)
  x, mask, _, dtype = lc.prepare_logits(z, -1, None, fn)
  parent, class_visible = _parent_logits(x, mask)
  ce, row_visible, label_visible = lc.integer_cross_entropy(parent, class_visible, labels, -1)
  ce = jnp.where(label_visible, ce, jnp.inf)
  kept = keep & row_visible
  ce_mean = nc.safe_divide(jnp.sum(jnp.where(kept, ce, 0.0)), jnp.sum(kept).astype(ce.dtype))
  affinity, balance = _gar_terms(x, mask, keep)
  frob = jnp.sum(jnp.where(mask & keep[..., None, None], x * x, 0.0))
  total = ce_mean + weights[0] * affinity + weights[1] * (1.0 - balance) + weights[2] * frob
  # the package convention: a batch with no visible example costs 0 (1 - balance would be 1)
  return jnp.where(jnp.any(keep), total, 0.0).astype(dtype)

