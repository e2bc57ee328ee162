"""The Sigmoid Head's training: binary cross-entropy of an extra sigmoid unembedding head
with negatives sampled away from potentially correct alternatives (feature N33's loss)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import positive_int
from jaxsoft.losses import _common as lc

__all__ = ["sigmoid_head_loss", "sigmoid_head_negatives"]


def _candidates(fn, lm_logits, labels, num_filtered, axis, where):
  """``(x, mask, axis, labels, eligible)``: the LM logits prepared, and the classes that may be
  drawn as negatives (visible, not the label, not among the ``num_filtered`` top LM tokens)."""
  x, mask, ax = lc.prepare(lm_logits, axis, where, fn)
  labels = lc.check_integer_labels(labels, x.shape, ax, fn)
  if isinstance(num_filtered, bool) or not isinstance(num_filtered, int) or num_filtered < 0:
    raise ValueError(f"{fn}: `num_filtered` must be an int >= 0, got {num_filtered!r}")
  k_cls = x.shape[ax]
  ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, ax)
  eligible = mask & (ids != jnp.expand_dims(labels, ax))
  if num_filtered:
    # rank of each class by the LM's logit among the visible ones (ties: the lower id first)
    xs = jnp.moveaxis(jnp.where(mask, x, -jnp.inf), ax, -1)
    top = jax.lax.top_k(xs, min(num_filtered, k_cls))[1]
    hit = jnp.any(top[..., :, None] == lc.at_rank(jnp.arange(k_cls), top.ndim + 1), axis=-2)
    eligible = eligible & ~jnp.moveaxis(hit, -1, ax)
  return x, mask, ax, labels, eligible


def sigmoid_head_negatives(key: jax.Array, lm_logits: ArrayLike, labels: ArrayLike,
                           num_negatives: int, *, num_filtered: int = 10, axis: int = -1,
                           where: ArrayLike | None = None) -> jax.Array:
  r"""Negatives for the Sigmoid Head, drawn away from plausible alternatives (feature N33).

  From the Sigmoid Head of T. A. Dinh & J. Niehues, "Sigmoid Head for Quality Estimation
  under Language Ambiguity" (2026): the negatives for an output position must avoid
  "potentially alternative correct tokens". [R] The heuristic is not in the abstract; this
  reading filters out the ``num_filtered`` tokens that the frozen LM's own (softmax) head
  ranks highest, and the label, and draws ``num_negatives`` distinct negatives uniformly
  from the remaining visible classes (Gumbel top-k: without replacement). Deterministic
  given ``key``.

  Args:
    key: a ``jax.random`` key.
    lm_logits: ``[..., V]`` logits of the frozen LM's softmax head (the filter).
    labels: integer reference tokens of ``lm_logits``' shape without ``axis``.
    num_negatives: k >= 1 negatives per position.
    num_filtered: how many of the LM's top tokens are never negatives (>= 0).
    axis: the vocabulary axis.
    where: optional class mask broadcastable to ``lm_logits`` (masked classes are never
      drawn) or an example mask of ``labels``' shape (a masked example draws nothing).

  Returns:
    ``int32 [..., k]`` negative ids (the vocabulary axis replaced by k, last), distinct within
    a position; ``-1`` fills the slots that found no eligible class.

  Examples:
    >>> lm = jnp.array([[4.0, 3.0, 0.0, 0.0, 0.0]])  # token 1: a plausible alternative
    >>> neg = js.losses.sigmoid_head_negatives(jax.random.key(0), lm, jnp.array([0]), 3,
    ...                                        num_filtered=2)
    >>> sorted(neg[0].tolist())  # neither the label 0 nor the filtered 1
    [2, 3, 4]

  References:
    T. A. Dinh & J. Niehues, 2026, "Sigmoid Head for Quality Estimation under Language
    Ambiguity".
  """
  fn = "sigmoid_head_negatives"
  k = positive_int(num_negatives, "num_negatives", fn)
  x, _, ax, _, eligible = _candidates(fn, lm_logits, labels, num_filtered, axis, where)
  el = jnp.moveaxis(eligible, ax, -1)
  g = jax.random.gumbel(key, el.shape, jnp.float32)
  kk = min(k, el.shape[-1])
  vals, idx = jax.lax.top_k(jnp.where(el, g, -jnp.inf), kk)
  idx = jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)
  if kk < k:
    idx = jnp.concatenate([idx, jnp.full(idx.shape[:-1] + (k - kk,), -1, jnp.int32)], -1)
  return idx


def sigmoid_head_loss(key: jax.Array | None, logits: ArrayLike, labels: ArrayLike,
                      lm_logits: ArrayLike | None, num_negatives: int, *,
                      num_filtered: int = 10, negatives: ArrayLike | None = None,
                      axis: int = -1, where: ArrayLike | None = None) -> jax.Array:
  r"""The Sigmoid Head's binary cross-entropy with filtered negative sampling (feature N33).

  From T. A. Dinh & J. Niehues, "Sigmoid Head for Quality Estimation under Language
  Ambiguity" (2026): an extra unembedding head with a sigmoid,
  :math:`p(w) = \sigma(o_w)` (:func:`jaxsoft.normalizers.ovr_sigmoid`), trained on the frozen
  LM with the reference token y as positive and negatives :math:`n_i` drawn by
  :func:`sigmoid_head_negatives` (never y, never a token the LM's softmax head ranks among
  its ``num_filtered`` top ones):

  .. math::
    \ell = -\log\sigma(o_y) - \sum_{i=1}^{k} \log\sigma(-o_{n_i}).

  Several tokens can then score above 1/2 at once, which softmax cannot. The gradient is
  :math:`-(1 - \sigma(o_y))` on the label and :math:`\sigma(o_{n_i})` on each negative,
  0 elsewhere. [R] The filter is the reading of :func:`sigmoid_head_negatives`.

  Args:
    key: a ``jax.random`` key (may be None when ``negatives`` is given).
    logits: ``[..., V]`` the sigmoid head's logits :math:`o = W_s h`.
    labels: integer reference tokens of ``logits``' shape without ``axis``.
    lm_logits: ``[..., V]`` the frozen LM's logits (the filter; may be None when
      ``negatives`` is given).
    num_negatives: k >= 1 (ignored when ``negatives`` is given).
    num_filtered: the LM's top tokens that are never negatives.
    negatives: optional ``int [..., k]`` negatives used instead of drawing; ``-1`` entries
      are skipped.
    axis: the vocabulary axis.
    where: optional class mask broadcastable to ``logits`` or example mask of ``labels``'
      shape (the package convention).

  Returns:
    One loss per position in ``logits``' dtype (float32 compute for bf16/fp16); 0 with zero
    gradient for masked positions, ``+inf`` when the label names no visible class.

  Examples:
    >>> o = jnp.array([[2.0, 1.5, -1.0, -2.0]])  # the sigmoid head's logits
    >>> neg = jnp.array([[2, 3]])                # given instead of drawn
    >>> print(js.losses.sigmoid_head_loss(None, o, jnp.array([0]), None, 2, negatives=neg))
    [0.5671]

  References:
    T. A. Dinh & J. Niehues, 2026, "Sigmoid Head for Quality Estimation under Language
    Ambiguity".
  """
  fn = "sigmoid_head_loss"
  x, mask, ax, dtype = lc.prepare_logits(logits, axis, where, fn)
  y = lc.check_integer_labels(labels, x.shape, ax, fn)
  if negatives is None:
    if key is None or lm_logits is None:
      raise ValueError(f"{fn}: `key` and `lm_logits` are required to draw the negatives "
                       "(or pass `negatives`)")
    lm = lc.float_input(lm_logits, "lm_logits", fn)
    if lm.shape != jnp.shape(logits):
      raise ValueError(f"{fn}: `lm_logits` of shape {lm.shape} must have the shape of "
                       f"`logits` {jnp.shape(logits)}")
    neg_ids = sigmoid_head_negatives(key, lm, y, num_negatives,
                                     num_filtered=num_filtered, axis=ax, where=where)
  else:
    neg_ids = jnp.asarray(negatives)
    if (not jnp.issubdtype(neg_ids.dtype, jnp.integer)
        or neg_ids.shape[:-1] != y.shape or neg_ids.ndim != y.ndim + 1):
      raise ValueError(f"{fn}: `negatives` must be an int array of shape {y.shape} + "
                       f"(k,), got {neg_ids.shape} {neg_ids.dtype}")
  xl = jnp.moveaxis(x, ax, -1)
  ml = jnp.moveaxis(mask, ax, -1)
  v = xl.shape[-1]
  used = (neg_ids >= 0) & (neg_ids < v)
  nid = jnp.where(used, neg_ids, 0)
  o_n = jnp.take_along_axis(xl, nid, axis=-1)
  used = used & jnp.take_along_axis(ml, nid, axis=-1)
  x_y, label_visible = lc.gather_label(x, mask, y, ax)
  neg = jnp.sum(jnp.where(used, jax.nn.log_sigmoid(-jnp.where(used, o_n, 0.0)), 0.0), axis=-1)
  loss = -jax.nn.log_sigmoid(x_y) - neg
  visible = jnp.any(mask, axis=ax)
  return lc.integer_finish(loss, y, visible, label_visible, None, dtype)
