"""L13 large-output layers, part 1: sampled softmax (log-Q correction), word2vec negative
sampling, hierarchical softmax over a tree given as arrays, and the Augment-and-Reduce bound.

The layers that take hidden states use the convention of :func:`linear_cross_entropy`:
``h [..., d]`` hidden states, ``w [d, N]`` output vectors (one column per class or tree
node), integer ``labels`` of ``h``'s shape without its last axis, and ``where`` an example
mask of ``labels``' shape. One loss per example comes back in ``h``'s dtype (bf16/fp16
are computed in float32); a False / ignored example has loss 0 and zero gradient, and a
label outside ``[0, V)`` has loss ``+inf`` (never NaN). The random draws take an explicit
``jax.random`` key.
"""

from __future__ import annotations

import heapq
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import concrete, positive_int
from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc

__all__ = [
    "augment_reduce_loss",
    "hierarchical_softmax_log_probs",
    "hierarchical_softmax_loss",
    "huffman_tree",
    "negative_sampling_loss",
    "sampled_softmax_loss",
    "unigram_proposal",
]


# ------------------------------------------------------------------------ shared checks


def check_hidden(h, w, fn, w_name="w") -> tuple[jax.Array, jax.Array, Any]:
  """``h [..., d]`` and ``w [d, N]`` as float arrays (integers promote, as jax.nn's inputs);
  returns them in the compute dtype."""
  h, w = lc.check_hidden_and_weights(lc.float_input(h, "h", fn), lc.float_input(w, w_name, fn),
                                     fn, w_name)
  ct = nc.compute_dtype(jnp.result_type(h.dtype, w.dtype))
  return h.astype(ct), w.astype(ct), h.dtype


def finish_labels(loss, labels, n, keep, dtype):
  """``+inf`` for labels outside [0, n), then 0 (zero gradient) where ``keep`` is False."""
  in_range = (labels >= 0) & (labels < n)
  return lc.finish(jnp.where(in_range, loss, jnp.inf), keep, dtype)


def check_ids(ids, n, name, fn, shape=None) -> jax.Array:
  """Integer ids in [0, n) (of ``shape`` when given; their range is checked when known at
  trace time)."""
  a = concrete(ids)
  ids = lc.check_labels(ids, jnp.shape(ids) if shape is None else shape, fn, name)
  if a is not None and a.size and (a.min() < 0 or a.max() >= n):
    raise ValueError(f"{fn}: `{name}` must hold ids in [0, {n})")
  return ids


def _check_weights(a, name, fn):
  """Raise unless ``a`` (a concrete array, or None when traced) is finite, >= 0, not all 0."""
  if a is not None and (not np.all(np.isfinite(a)) or np.any(a < 0) or a.sum() <= 0):
    raise ValueError(f"{fn}: `{name}` must be finite, >= 0 and not all 0")


def _check_key(key, fn):
  if key is None:
    raise ValueError(f"{fn}: `key` (a jax.random key) is required to draw the samples")
  return key


def _log_proposal(proposal, n, fn, dtype):
  """log of the normalised proposal ``[n]`` (uniform when None); entries 0 give -inf.

  Normalised in ``dtype`` (the loss's compute dtype) promoted with the proposal's own: a
  float64 proposal (or float64 ``h``) stays float64, float32 stays float32."""
  if proposal is None:
    return jnp.full((n,), -np.log(n), dtype)
  q = jnp.asarray(proposal)
  q = q.astype(nc.compute_dtype(jnp.result_type(q.dtype, dtype)))
  if q.shape != (n,):
    raise ValueError(f"{fn}: `proposal` of shape {q.shape} must be [{n}] (one weight per class)")
  _check_weights(concrete(proposal), "proposal", fn)
  q = jax.lax.stop_gradient(q)
  q = q / jnp.sum(q)
  return jnp.where(q > 0, jnp.log(jnp.where(q > 0, q, 1.0)), -jnp.inf)


def _gather_columns(w, idx):
  """``w[:, idx]`` moved to ``idx.shape + (d,)``."""
  return jnp.take(w.T, idx, axis=0)


def _safe_labels(labels, n):
  return jnp.where((labels >= 0) & (labels < n), labels, 0)


def _bias(bias, n, fn, dtype):
  """The output bias ``[n]`` in ``dtype`` (the compute dtype) promoted with its own, or None."""
  if bias is None:
    return None
  b = lc.float_input(bias, "bias", fn)
  if b.shape != (n,):
    raise ValueError(f"{fn}: `bias` must be a float array of shape [{n}], got {b.shape} {b.dtype}")
  return b.astype(nc.compute_dtype(jnp.result_type(b.dtype, dtype)))


# ---------------------------------------------------------------------- sampled softmax


def sampled_softmax_loss(key: jax.Array | None, h: ArrayLike, w: ArrayLike, labels: ArrayLike,
                         num_samples: int, *, proposal: ArrayLike | None = None,
                         bias: ArrayLike | None = None, sampled: ArrayLike | None = None,
                         where: ArrayLike | None = None,
                         ignore_index: int | None = None) -> jax.Array:
  r"""Sampled softmax with the log-Q correction (feature L13).

  Importance-sampled softmax of Y. Bengio & J.-S. Senécal, "Adaptive Importance Sampling
  to Accelerate Training of a Neural Probabilistic Language Model" (IEEE TNN 2008) and
  S. Jean, K. Cho, R. Memisevic & Y. Bengio, "On Using Very Large Target Vocabulary for
  Neural Machine Translation" (ACL 2015). S classes :math:`s_1..s_S` are drawn with
  replacement from the proposal Q (shared by the batch, as TensorFlow's candidate
  samplers do), and with :math:`o_v = h \cdot w_{:,v} + b_v`

  .. math::
    \ell = \log\Bigl(e^{o_y} + \sum_{i:\, s_i \ne y} e^{o_{s_i} - \log(S\,Q(s_i))}\Bigr) - o_y .

  The sum is an unbiased estimate of :math:`\sum_{v \ne y} e^{o_v}` (the draws equal to
  the label, "accidental hits", are removed), so as S grows the loss tends to the full
  softmax CE; only the S sampled columns of ``w`` are touched (O(S·d) per example
  instead of O(V·d)). Unlike TensorFlow's ``sampled_softmax_loss`` the true logit is not
  corrected by :math:`\log Q(y)` (that would make the estimate grow with S).

  Passing ``sampled`` (explicit class ids, e.g. ``arange(V)``) instead of drawing: with
  ``sampled = arange(V)`` and a uniform Q (:math:`S\,Q \equiv 1`) this is exactly the
  full softmax CE.

  Args:
    key: a ``jax.random`` key (may be None when ``sampled`` is given).
    h: ``[..., d]`` hidden states.
    w: ``[d, V]`` output vectors.
    labels: integer classes of ``h``'s shape without its last axis.
    num_samples: S >= 1 (ignored when ``sampled`` is given).
    proposal: ``[V]`` non-negative weights of Q (normalised inside; default uniform),
      e.g. :func:`unigram_proposal`. No gradient flows into it.
    bias: optional ``[V]`` output bias b.
    sampled: optional ``[S]`` int class ids used instead of drawing.
    where: optional example mask of ``labels``' shape.
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``h``'s dtype.

  Examples:
    >>> h = jnp.array([[1.0, 0.0], [0.5, -1.0]])
    >>> w = jnp.array([[1.0, -1.0, 0.5], [0.0, 1.0, -0.5]])
    >>> y = jnp.array([0, 2])
    >>> print(js.losses.sampled_softmax_loss(None, h, w, y, 3, sampled=jnp.arange(3)))  # = full CE
    [0.555  0.6335]

  References:
    Y. Bengio & J.-S. Senécal, 2008, "Adaptive Importance Sampling to Accelerate Training of a
    Neural Probabilistic Language Model" (IEEE Transactions on Neural Networks).

    S. Jean, K. Cho, R. Memisevic & Y. Bengio, 2015, "On Using Very Large Target Vocabulary for
    Neural Machine Translation" (ACL).
  """
  fn = "sampled_softmax_loss"
  h, w, dtype = check_hidden(h, w, fn)
  v = w.shape[1]
  labels, keep = lc.example_labels(labels, h.shape[:-1], where, ignore_index, fn)
  log_q = _log_proposal(proposal, v, fn, h.dtype)
  b = _bias(bias, v, fn, h.dtype)
  if sampled is None:
    s_count = positive_int(num_samples, "num_samples", fn)
    sampled = jax.random.categorical(_check_key(key, fn), log_q, shape=(s_count,))
  else:
    sampled = check_ids(sampled, v, "sampled", fn)
    if sampled.ndim != 1:
      raise ValueError(f"{fn}: `sampled` must be a 1-d int array of class ids, got shape "
                       f"{sampled.shape}")
    s_count = sampled.shape[0]
  y = _safe_labels(labels, v)
  o_y = jnp.sum(h * _gather_columns(w, y), axis=-1)
  o_s = h @ _gather_columns(w, sampled).T                     # [..., S]
  if b is not None:
    o_y = o_y + b[y]
    o_s = o_s + lc.at_rank(b[sampled], o_s.ndim)
  o_s = o_s - lc.at_rank(jnp.log(float(s_count)) + log_q[sampled], o_s.ndim)
  mask = (lc.at_rank(sampled, o_s.ndim) != y[..., None]) & lc.at_rank(
      jnp.isfinite(log_q[sampled]), o_s.ndim)
  z = jnp.concatenate([o_y[..., None], o_s], axis=-1)
  zmask = jnp.concatenate([jnp.ones(o_y.shape + (1,), bool), mask], axis=-1)
  lse, _ = lc.masked_logsumexp(jnp.where(zmask, z, 0.0), zmask, -1)
  return finish_labels(lse - o_y, labels, v, keep, dtype)


def unigram_proposal(counts: ArrayLike, power: float = 0.75) -> jax.Array:
  r"""word2vec's noise distribution :math:`P_n(w) \propto U(w)^{3/4}` (feature L13).

  From T. Mikolov, I. Sutskever, K. Chen, G. Corrado & J. Dean, "Distributed
  Representations of Words and Phrases and their Compositionality" (NeurIPS 2013).

  Args:
    counts: ``[V]`` non-negative class counts U(w).
    power: the exponent (0.75 in the paper; 1 gives the unigram, 0 the uniform).

  Returns:
    ``[V]`` probabilities summing to 1: float32, or float64 for float64 counts (and for
    64-bit integer counts under x64, as jax.nn promotes them).

  Examples:
    >>> print(js.losses.unigram_proposal(jnp.array([16.0, 1.0, 0.0])))  # 16^(3/4) = 8 : 1 : 0
    [0.8889 0.1111 0.    ]

  References:
    T. Mikolov, I. Sutskever, K. Chen, G. Corrado & J. Dean, 2013, "Distributed Representations
    of Words and Phrases and their Compositionality" (NeurIPS).
  """
  fn = "unigram_proposal"
  c = jnp.asarray(counts)
  c = c.astype(nc.compute_dtype(c.dtype))
  if c.ndim != 1 or c.shape[0] == 0:
    raise ValueError(f"{fn}: `counts` must be a non-empty 1-d array, got shape {c.shape}")
  _check_weights(concrete(counts), "counts", fn)
  p = jnp.where(c > 0, jnp.power(jnp.where(c > 0, c, 1.0), power), 0.0)
  return p / jnp.sum(p)


def negative_sampling_loss(key: jax.Array | None, h: ArrayLike, w: ArrayLike, labels: ArrayLike,
                           num_negatives: int, *, proposal: ArrayLike | None = None,
                           bias: ArrayLike | None = None, negatives: ArrayLike | None = None,
                           where: ArrayLike | None = None,
                           ignore_index: int | None = None) -> jax.Array:
  r"""word2vec negative sampling (NEG) (feature L13).

  From T. Mikolov, I. Sutskever, K. Chen, G. Corrado & J. Dean, "Distributed
  Representations of Words and Phrases and their Compositionality" (NeurIPS 2013): with
  :math:`o_v = h \cdot w_{:,v} + b_v` and k negatives :math:`n_i \sim P_n` drawn
  independently for every example,

  .. math::
    \ell = -\log\sigma(o_y) - \sum_{i=1}^{k} \log\sigma(-o_{n_i}),

  a logistic loss that tells the label apart from noise (it is not a normalised
  likelihood). As in word2vec, a negative equal to the label is kept. The gradient is
  :math:`-(1-\sigma(o_y))` on the label and :math:`\sigma(o_{n_i})` on each negative.

  Args:
    key: a ``jax.random`` key (may be None when ``negatives`` is given).
    h: ``[..., d]`` hidden (input-word) vectors.
    w: ``[d, V]`` output vectors.
    labels: integer classes of ``h``'s shape without its last axis.
    num_negatives: k >= 1 (ignored when ``negatives`` is given).
    proposal: ``[V]`` noise weights (default uniform; word2vec uses
      :func:`unigram_proposal`).
    bias: optional ``[V]`` output bias.
    negatives: optional ``[..., k]`` int negatives used instead of drawing.
    where: optional example mask of ``labels``' shape.
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``h``'s dtype.

  Examples:
    >>> h, w = jnp.array([[1.0, 0.0]]), jnp.array([[2.0, -1.0, 0.0], [0.0, 1.0, 1.0]])
    >>> negatives = jnp.array([[1, 2]])  # given instead of drawn
    >>> print(js.losses.negative_sampling_loss(None, h, w, jnp.array([0]), 2, negatives=negatives))
    [1.1333]

  References:
    T. Mikolov, I. Sutskever, K. Chen, G. Corrado & J. Dean, 2013, "Distributed Representations
    of Words and Phrases and their Compositionality" (NeurIPS).
  """
  fn = "negative_sampling_loss"
  h, w, dtype = check_hidden(h, w, fn)
  v = w.shape[1]
  labels, keep = lc.example_labels(labels, h.shape[:-1], where, ignore_index, fn)
  b = _bias(bias, v, fn, h.dtype)
  if negatives is None:
    k = positive_int(num_negatives, "num_negatives", fn)
    log_q = _log_proposal(proposal, v, fn, h.dtype)
    negatives = jax.random.categorical(_check_key(key, fn), log_q, shape=labels.shape + (k,))
  else:
    negatives = check_ids(negatives, v, "negatives", fn)
    if negatives.shape[:-1] != labels.shape or negatives.ndim != labels.ndim + 1:
      raise ValueError(f"{fn}: `negatives` must be an int array of shape {labels.shape} + (k,), "
                       f"got {negatives.shape}")
  y = _safe_labels(labels, v)
  o_y = jnp.sum(h * _gather_columns(w, y), axis=-1)
  o_n = jnp.einsum("...d,...kd->...k", h, _gather_columns(w, negatives))
  if b is not None:
    o_y = o_y + b[y]
    o_n = o_n + b[negatives]
  loss = -jax.nn.log_sigmoid(o_y) - jnp.sum(jax.nn.log_sigmoid(-o_n), axis=-1)
  return finish_labels(loss, labels, v, keep, dtype)


# ------------------------------------------------------------------- hierarchical softmax


def huffman_tree(counts) -> tuple[np.ndarray, np.ndarray]:
  r"""The Huffman tree of word2vec's hierarchical softmax, as ``(paths, codes)`` arrays.

  From T. Mikolov et al. 2013, "Distributed Representations of Words and Phrases and
  their Compositionality" (frequent classes get short codes). Classes are the leaves;
  the V - 1 internal nodes are numbered 0..V-2 (the root is V-2). ``paths[v]`` lists the
  internal nodes from the root down to leaf v, padded with -1; ``codes[v, j]`` is the
  branch taken at ``paths[v, j]`` (0 or 1; 0 at padding). A concrete (numpy) helper.

  Args:
    counts: ``[V]`` class counts (V >= 2).

  Returns:
    ``paths`` and ``codes``, both int32 ``[V, L]`` with L the depth of the deepest leaf.

  Examples:
    >>> paths, codes = js.losses.huffman_tree([5, 1, 1])  # the frequent class 0 gets a 1-bit code
    >>> print(paths)
    [[ 1 -1]
     [ 1  0]
     [ 1  0]]
    >>> print(codes)
    [[1 0]
     [0 0]
     [0 1]]

  References:
    T. Mikolov, I. Sutskever, K. Chen, G. Corrado & J. Dean, 2013, "Distributed Representations
    of Words and Phrases and their Compositionality" (NeurIPS).

    D. A. Huffman, 1952, "A Method for the Construction of Minimum-Redundancy Codes"
    (Proceedings of the IRE).
  """
  c = np.asarray(counts, np.float64)
  if c.ndim != 1 or c.shape[0] < 2 or not np.all(np.isfinite(c)) or np.any(c < 0):
    raise ValueError(f"huffman_tree: `counts` must be a 1-d array of >= 2 finite counts >= 0, "
                     f"got {c!r}")
  v = c.shape[0]
  heap = [(float(c[i]), i, i) for i in range(v)]       # (count, tie-break, node); leaves 0..V-1
  heapq.heapify(heap)
  parent = {}
  nxt = v
  while len(heap) > 1:
    c0, _, a = heapq.heappop(heap)
    c1, _, b = heapq.heappop(heap)
    parent[a] = (nxt, 0)
    parent[b] = (nxt, 1)
    heapq.heappush(heap, (c0 + c1, nxt, nxt))
    nxt += 1
  rows = []
  for leaf in range(v):
    path, code, node = [], [], leaf
    while node in parent:
      p, bit = parent[node]
      path.append(p - v)
      code.append(bit)
      node = p
    rows.append((path[::-1], code[::-1]))
  depth = max(len(p) for p, _ in rows)
  paths = np.full((v, depth), -1, np.int32)
  codes = np.zeros((v, depth), np.int32)
  for i, (p, cd) in enumerate(rows):
    paths[i, :len(p)] = p
    codes[i, :len(cd)] = cd
  return paths, codes


def _check_tree(paths, codes, n_nodes, fn) -> tuple[jax.Array, jax.Array]:
  pn, cn = concrete(paths), concrete(codes)
  paths = jnp.asarray(paths)
  codes = jnp.asarray(codes)
  if paths.ndim != 2 or codes.shape != paths.shape:
    raise ValueError(f"{fn}: `paths` and `codes` must both be [V, L], got {paths.shape} and "
                     f"{codes.shape}")
  if not jnp.issubdtype(paths.dtype, jnp.integer):
    raise ValueError(f"{fn}: `paths` must have an integer dtype, got {paths.dtype}")
  if pn is not None and cn is not None:
    if np.any(pn < -1) or np.any(pn >= n_nodes):
      raise ValueError(f"{fn}: `paths` must hold node ids in [0, {n_nodes}) (the columns of `w`) "
                       "or -1 for padding")
    if not np.all((cn == 0) | (cn == 1)):
      raise ValueError(f"{fn}: `codes` must be 0 or 1")
  return paths, codes


def _path_log_probs(scores, codes, valid):
  """Σ_j log σ((1 − 2c_j)·score_j) over the valid steps of each path."""
  sign = lc.at_rank(1.0 - 2.0 * codes.astype(scores.dtype), scores.ndim)
  valid = lc.at_rank(valid, scores.ndim)
  return jnp.sum(jnp.where(valid, jax.nn.log_sigmoid(sign * scores), 0.0), axis=-1)


def hierarchical_softmax_loss(h: ArrayLike, w: ArrayLike, labels: ArrayLike, paths: ArrayLike,
                              codes: ArrayLike, *, where: ArrayLike | None = None,
                              ignore_index: int | None = None) -> jax.Array:
  r"""Hierarchical softmax over a binary tree given as arrays (feature L13).

  F. Morin & Y. Bengio, "Hierarchical Probabilistic Neural Network Language Model"
  (AISTATS 2005); with a Huffman tree as in T. Mikolov et al., "Distributed
  Representations of Words and Phrases and their Compositionality" (NeurIPS 2013). Leaf v
  is reached from the root through the internal nodes :math:`n_1..n_L` (``paths[v]``)
  taking branches :math:`c_j \in \{0, 1\}` (``codes[v]``):

  .. math::
    \ell = -\log p(y \mid h), \qquad
    \log p(v \mid h) = \sum_{j=1}^{L(v)} \log\sigma\bigl((1 - 2c_j)\, h \cdot w_{:, n_j}\bigr).

  Since :math:`\sigma(s) + \sigma(-s) = 1` at every node, the probabilities of all leaves
  sum to 1 whenever the paths are those of a full binary tree (e.g. :func:`huffman_tree`).
  Cost O(L·d) per example, L ≈ log2 V.

  Args:
    h: ``[..., d]`` hidden states.
    w: ``[d, N]`` node vectors (N internal nodes, V - 1 for a full tree).
    labels: integer leaves (classes) of ``h``'s shape without its last axis.
    paths: ``[V, L]`` int node ids from the root, -1 for padding.
    codes: ``[V, L]`` branches, 0 or 1.
    where: optional example mask of ``labels``' shape.
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One loss per example, in ``h``'s dtype.

  Examples:
    >>> paths, codes = js.losses.huffman_tree([5, 1, 1])
    >>> h, w = jnp.array([[1.0, -0.5]]), jnp.array([[0.3, -1.0], [0.2, 0.4]])
    >>> print(js.losses.hierarchical_softmax_loss(h, w, jnp.array([0]), paths, codes))
    [0.2633]

  References:
    F. Morin & Y. Bengio, 2005, "Hierarchical Probabilistic Neural Network Language Model"
    (AISTATS).

    T. Mikolov, I. Sutskever, K. Chen, G. Corrado & J. Dean, 2013, "Distributed Representations
    of Words and Phrases and their Compositionality" (NeurIPS).
  """
  fn = "hierarchical_softmax_loss"
  h, w, dtype = check_hidden(h, w, fn)
  paths, codes = _check_tree(paths, codes, w.shape[1], fn)
  v = paths.shape[0]
  labels, keep = lc.example_labels(labels, h.shape[:-1], where, ignore_index, fn)
  y = _safe_labels(labels, v)
  p_y, c_y = paths[y], codes[y]                                # [..., L]
  valid = p_y >= 0
  scores = jnp.einsum("...d,...ld->...l", h, _gather_columns(w, jnp.where(valid, p_y, 0)))
  loss = -_path_log_probs(scores, c_y, valid)
  return finish_labels(loss, labels, v, keep, dtype)


def hierarchical_softmax_log_probs(h: ArrayLike, w: ArrayLike, paths: ArrayLike,
                                   codes: ArrayLike) -> jax.Array:
  r"""All leaves' :math:`\log p(v \mid h)` of :func:`hierarchical_softmax_loss` (feature L13).

  O(N·d + V·L) per example; for inference or checks (``exp`` sums to 1 over a full tree).

  Args:
    h: ``[..., d]`` hidden states.
    w: ``[d, N]`` node vectors.
    paths: ``[V, L]`` int node ids from the root, -1 for padding.
    codes: ``[V, L]`` branches, 0 or 1.

  Returns:
    ``[..., V]`` log-probabilities in ``h``'s dtype.

  Examples:
    >>> paths, codes = js.losses.huffman_tree([5, 1, 1])
    >>> h, w = jnp.array([[1.0, -0.5]]), jnp.array([[0.3, -1.0], [0.2, 0.4]])
    >>> log_p = js.losses.hierarchical_softmax_log_probs(h, w, paths, codes)
    >>> print(log_p, jnp.exp(log_p).sum())  # -log_p[0, 0] is hierarchical_softmax_loss's
    [[-0.2633 -2.0614 -2.2614]] 1.0

  References:
    Those of :func:`hierarchical_softmax_loss`.
  """
  fn = "hierarchical_softmax_log_probs"
  h, w, dtype = check_hidden(h, w, fn)
  paths, codes = _check_tree(paths, codes, w.shape[1], fn)
  valid = paths >= 0
  node_scores = h @ w                                           # [..., N]
  scores = jnp.take(node_scores, jnp.where(valid, paths, 0), axis=-1)   # [..., V, L]
  return _path_log_probs(scores, codes, valid).astype(dtype)


# --------------------------------------------------------------------- Augment and Reduce


def augment_reduce_loss(key: jax.Array, logits: ArrayLike, labels: ArrayLike, num_samples: int, *,
                        location: ArrayLike | None = None, where: ArrayLike | None = None,
                        ignore_index: int | None = None) -> jax.Array:
  r"""Augment and Reduce (A&R) bound on the softmax likelihood, negated (feature L13).

  From F. J. R. Ruiz, M. K. Titsias, A. B. Dieng & D. M. Blei, "Augment and Reduce:
  Stochastic Inference for Large Categorical Distributions" (ICML 2018). Softmax is the
  latent-utility model :math:`y = \arg\max_k (\psi_k + \varepsilon_k)` with Gumbel noise:

  .. math::
    p(y \mid \psi) = \int \phi(\varepsilon) \prod_{k \ne y}
      \Phi(\varepsilon + \psi_y - \psi_k)\, d\varepsilon, \qquad
    \Phi(x) = e^{-e^{-x}}.

  *Augment*: a Gumbel variational distribution :math:`q(\varepsilon)` with location
  :math:`\mu` gives, in closed form [R: derived here from that integral],

  .. math::
    \log p(y \mid \psi) \ge \mathcal{B}(\mu) = 1 - \mu - e^{-\mu}\,(1 + S), \qquad
    S = \sum_{k \ne y} e^{\psi_k - \psi_y},

  tight at :math:`\mu^* = \log(1 + S)`, where :math:`\mathcal{B} = \log\mathrm{softmax}_y`.
  *Reduce*: S is replaced by the unbiased estimate
  :math:`\hat S = \frac{K-1}{n}\sum_{i=1}^n e^{\psi_{k_i} - \psi_y}` over n classes drawn
  uniformly (with replacement) from the K - 1 others, so the returned
  :math:`-\hat{\mathcal{B}}(\mu)` is an unbiased estimate of an upper bound on the CE:
  :math:`\mathbb{E}[-\hat{\mathcal B}] = -\mathcal B(\mu) \ge \mathrm{CE}`. The
  multinomial-probit variant (Gaussian noise) has no closed form and is not offered.

  ``location``: the per-example :math:`\mu` (a local variational parameter the paper
  optimises with the model, e.g. stored per data point). None uses the optimum
  :math:`\log(1 + S)` computed from all logits without gradient: then the expected value
  is exactly the softmax CE, at O(K) cost (useful as a check of the estimator).

  Args:
    key: a ``jax.random`` key for the class draws.
    logits: ``[..., K]`` utilities :math:`\psi` (K >= 2; class axis last).
    labels: integer classes of ``logits``' shape without the last axis.
    num_samples: n >= 1 classes drawn per example.
    location: optional :math:`\mu`, broadcastable to ``labels``' shape.
    where: optional example mask of ``labels``' shape.
    ignore_index: a label value whose examples get loss 0.

  Returns:
    One value per example, in ``logits``' dtype.

  Examples:
    >>> logits, y = jnp.array([[2.0, 0.0]]), jnp.array([0])  # K = 2: the one draw is exact
    >>> print(js.losses.augment_reduce_loss(jax.random.key(0), logits, y, 1))
    [0.1269]
    >>> print(js.losses.softmax_cross_entropy_with_integer_labels(logits, y))
    [0.1269]

  References:
    F. J. R. Ruiz, M. K. Titsias, A. B. Dieng & D. M. Blei, 2018, "Augment and Reduce:
    Stochastic Inference for Large Categorical Distributions" (ICML).
  """
  fn = "augment_reduce_loss"
  logits = jnp.asarray(lc.check_logits(logits, fn))
  dtype = logits.dtype
  x = logits.astype(nc.compute_dtype(dtype))
  k = x.shape[-1]
  if k < 2:
    raise ValueError(f"{fn}: `logits` needs at least 2 classes, got shape {x.shape}")
  labels, keep = lc.example_labels(labels, x.shape[:-1], where, ignore_index, fn)
  n = positive_int(num_samples, "num_samples", fn)
  y = _safe_labels(labels, k)
  psi_y = jnp.take_along_axis(x, y[..., None], axis=-1)[..., 0]
  u = jax.random.randint(_check_key(key, fn), labels.shape + (n,), 0, k - 1)
  others = u + (u >= y[..., None])                             # uniform over k != y
  diff = jnp.take_along_axis(x, others, axis=-1) - psi_y[..., None]
  # S_hat = (K-1)/n Σ e^{diff}; B = 1 − μ − e^{−μ}(1 + S_hat), computed in log space.
  log_s_hat = jax.nn.logsumexp(diff, axis=-1) + jnp.log((k - 1) / n)
  if location is None:
    full = jnp.where(lc.at_rank(jnp.arange(k), x.ndim) == y[..., None], -jnp.inf,
                     x - psi_y[..., None])
    mu = jax.lax.stop_gradient(jnp.logaddexp(0.0, jax.nn.logsumexp(full, axis=-1)))
  else:
    mu = jnp.broadcast_to(jnp.asarray(location, x.dtype), labels.shape)
  loss = mu - 1.0 + jnp.exp(jnp.logaddexp(0.0, log_s_hat) - mu)
  return finish_labels(loss, labels, k, keep, dtype)
