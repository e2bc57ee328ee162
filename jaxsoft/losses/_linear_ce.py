"""L08 linear (chunked-vocabulary) cross-entropy: CE from hidden states and the output matrix
without ever materialising the ``[tokens, vocab]`` logits."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive, finite_float, positive_int
from jaxsoft.attention import differentiation
from jaxsoft.linear.chunk import sum_like, vary_like
from jaxsoft.losses import _common as lc
from jaxsoft.normalizers import common as nc
from kernels_pallas import backends, cross_entropy

__all__ = ["linear_cross_entropy"]


def linear_cross_entropy(h: ArrayLike, w: ArrayLike, labels: ArrayLike, *,
                         where: ArrayLike | None = None, ignore_index: int | None = None,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         softcap: float | None = None, token_chunk_size: int | None = None,
                         vocab_chunk_size: int | None = None,
                         implementation: str | None = None) -> jax.Array:
  r"""Softmax cross-entropy of the logits ``h @ w``, never materialised (feature L08).

  With logits :math:`z_{tv} = c \tanh\bigl((h_t \cdot w_{:,v}) / c\bigr)` (the ``softcap``
  :math:`c`; no cap when it is None), the loss of token t with label y is

  .. math::
    \ell_t = (1 - \epsilon)\,\bigl(\mathrm{LSE}_v(z_t) - z_{ty}\bigr)
      + \epsilon\,\Bigl(\mathrm{LSE}_v(z_t) - \tfrac{1}{V}\sum_v z_{tv}\Bigr)
      + \lambda\,\mathrm{LSE}_v(z_t)^2,

  the cross-entropy against the smoothed one-hot target (:math:`\epsilon` =
  ``label_smoothing``, as ``optax.smooth_labels``) plus the :math:`\log^2 Z` regulariser
  (:math:`\lambda` = ``z_loss``; see :func:`z_loss`).

  This is Cut Cross-Entropy: E. Wijmans, B. Huval, A. Hertzberg, V. Koltun &
  P. Krähenbühl, "Cut Your Losses in Large-Vocabulary Language Models" (2024,
  arXiv 2411.09009), the approach also used by Chronicals. The tokens are taken
  ``token_chunk_size`` at a time; for each token chunk the log-sum-exp runs over vocabulary
  chunks of ``vocab_chunk_size`` columns with the online-softmax recurrence (M. Milakov &
  N. Gimelshein, "Online normalizer calculation for softmax", 2018): a running max m and a
  rescaled running sum l. Only ``[token_chunk_size, vocab_chunk_size]`` logits exist at a
  time. The gradient is a custom VJP that recomputes each chunk's logits from the saved
  per-token LSE: :math:`\partial\ell/\partial z_{tv} = (1 + 2\lambda\,\mathrm{LSE})\,p_{tv}
  - (1-\epsilon)[v = y] - \epsilon/V`, then ``dh += dz @ w_chunkᵀ`` and
  ``dw_chunk += h_chunkᵀ @ dz``. Memory is O(tokens·d + d·V) for the inputs and their
  gradients plus one chunk of logits, instead of O(tokens·V).
  Forward mode (``jax.jvp``, ``jax.jacfwd``; not through the custom VJP) differentiates the
  same chunked forward pass by autodiff, one chunk of logit tangents at a time; the Pallas
  implementations raise :class:`jaxsoft.attention.UnsupportedDifferentiation` there.

  The chunks need not divide the axes: the last vocabulary chunk is shifted back to end at
  V and its columns already counted are masked; the tokens are padded to a whole chunk.

  ``implementation="pallas"`` computes the same loss with Pallas kernels (a forward kernel
  per token block over the vocabulary blocks, and dh / dw kernels that recompute each
  tile's logits; ``kernels_pallas.cross_entropy``): the Triton kernel on GPUs, the Mosaic
  one on TPUs, ``"pallas_triton"`` / ``"pallas_mosaic_tpu"`` to pick one. On a platform
  without that backend it raises NotImplementedError unless the environment variable
  ``JAXSOFT_PALLAS_INTERPRET=1`` asks for the Pallas interpreter (CPU tests).

  Edge cases (as :func:`softmax_cross_entropy_with_integer_labels`): a token whose ``where``
  is False or whose label equals ``ignore_index`` has loss 0 and zero gradient; a label
  outside ``[0, V)`` that is not ``ignore_index`` has loss ``+inf`` and zero gradient.
  bf16/fp16 inputs are computed in float32 chunk by chunk; the loss comes back in
  ``h``'s dtype and the gradients in ``h``'s and ``w``'s (integer inputs promote as
  jax.nn's do: float32).

  Data parallelism: with the tokens sharded on an explicit mesh (``jax.make_mesh``'s
  default) the loss and gradients equal the unsharded ones, each token chunk taking its
  tokens strided across the shards (``token_chunk_size`` must then divide the number of
  tokens: a padded sharded axis is refused with a ValueError); inside ``jax.shard_map``
  the gradient of a replicated ``w`` is summed over the shards, as autodiff sums it.

  Args:
    h: ``[..., d]`` hidden states (float).
    w: ``[d, V]`` output (unembedding) matrix.
    labels: integer labels of ``h``'s shape without its last axis.
    where: optional boolean mask of ``labels``' shape (False: token ignored).
    ignore_index: a label value whose tokens get loss 0 (e.g. -100).
    label_smoothing: :math:`\epsilon \in [0, 1)` (a Python float).
    z_loss: :math:`\lambda \ge 0`, the weight of :math:`\mathrm{LSE}^2` (e.g. 1e-4).
    softcap: None or :math:`c > 0`: logits :math:`c\tanh(z/c)` (Gemma 2's final-logit cap).
    token_chunk_size: tokens per chunk (clipped to the number of tokens); None: 256 for
      ``"xla"``, the kernel's default block for Pallas (Triton: a power of two >= 16;
      Mosaic TPU: a multiple of 8).
    vocab_chunk_size: vocabulary columns per chunk (clipped to V); None: 1024 for ``"xla"``,
      the kernel's default for Pallas (Triton: a power of two >= 16; Mosaic: a multiple
      of 128).
    implementation: None or ``"xla"`` (the chunked XLA path above), ``"pallas"``,
      ``"pallas_triton"`` or ``"pallas_mosaic_tpu"``.

  Returns:
    One loss per token, of ``labels``' shape, in ``h``'s dtype.

  Examples:
    >>> h = jnp.array([[1.0, 0.0], [0.5, -1.0], [0.0, 2.0]])
    >>> w = jnp.array([[1.0, -1.0, 0.5], [0.0, 1.0, -0.5]])
    >>> print(js.losses.linear_cross_entropy(h, w, jnp.array([0, 1, 2]), vocab_chunk_size=2))
    [0.555  2.8835 3.1698]

  References:
    E. Wijmans, B. Huval, A. Hertzberg, V. Koltun & P. Krähenbühl, 2024, "Cut Your Losses in
    Large-Vocabulary Language Models" (arXiv 2411.09009).

    M. Milakov & N. Gimelshein, 2018, "Online normalizer calculation for softmax".
  """
  fn = "linear_cross_entropy"
  # integer / boolean inputs promote as jax.nn's do, then the shared checks
  h, w = lc.check_hidden_and_weights(lc.float_input(h, "h", fn), lc.float_input(w, "w", fn), fn)
  labels, keep = lc.example_labels(labels, h.shape[:-1], where, ignore_index, fn)
  eps = lc.nonnegative_float(label_smoothing, "label_smoothing", fn, upper=1.0)
  lam = lc.nonnegative_float(z_loss, "z_loss", fn)
  cap = None if softcap is None else check_positive(finite_float(softcap, "softcap", fn),
                                                    "softcap", fn)
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"{fn}: `implementation` must be one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  for name, v in (("token_chunk_size", token_chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
    if v is not None:
      positive_int(v, name, fn)

  out_dtype = h.dtype
  batch_shape, d = h.shape[:-1], h.shape[-1]
  n = math.prod(batch_shape)
  if n == 0:
    return jnp.zeros(batch_shape, out_dtype)
  vocab = w.shape[1]
  dtype = jnp.dtype(nc.compute_dtype(jnp.result_type(h.dtype, w.dtype)))
  forward_mode = differentiation.forward_mode((h, w))
  if implementation not in (None, "xla"):
    if forward_mode:
      differentiation.refuse_unsupported_ad(
          (h, w), f"{fn}: implementation={implementation!r}",
          "Use implementation='xla' (or None), which supports jax.jvp and jax.jacfwd.")
    loss = _pallas(implementation, h.reshape(n, d), w, labels.reshape(n), keep.reshape(n),
                   eps, lam, cap, dtype, token_chunk_size, vocab_chunk_size)
    return loss.reshape(batch_shape).astype(out_dtype)
  tc = int(TOKEN_CHUNK if token_chunk_size is None else token_chunk_size)
  if not jax.export.is_symbolic_dim(n):   # a symbolic n (jax.export) keeps the whole chunk
    tc = min(tc, n)
  if any(lc._sharded_along(h, i) for i in range(h.ndim - 1)) and n % tc:
    raise ValueError(
        f"{fn}: the {n} tokens are sharded on an explicit mesh and token_chunk_size = {tc} "
        "does not divide them (the padding of a sharded axis is not supported): pass a "
        "token_chunk_size that divides the number of tokens")
  vc = min(int(VOCAB_CHUNK if vocab_chunk_size is None else vocab_chunk_size), vocab)
  n_pad = -(-n // tc) * tc
  h2 = jnp.pad(h.reshape(n, d), ((0, n_pad - n), (0, 0)))
  y2 = jnp.pad(labels.reshape(n).astype(jnp.int32), (0, n_pad - n))
  keep2 = jnp.pad(keep.reshape(n), (0, n_pad - n))
  in_range = (y2 >= 0) & (y2 < vocab)
  cfg = _Config(tc, vc, eps, lam, cap, dtype)
  # forward mode (jax.jvp, jax.jacfwd) cannot pass the custom VJP: the same chunked forward
  # pass, differentiated by autodiff (the tangents of one chunk of logits at a time)
  loss_fn = _forward_loss if forward_mode else _lce
  loss = loss_fn(cfg, h2, w, jnp.where(in_range, y2, 0), keep2 & in_range)
  loss = jnp.where(keep2 & ~in_range, jnp.inf, loss)[:n]
  return loss.reshape(batch_shape).astype(out_dtype)


IMPLEMENTATIONS = (None, "xla", "pallas", "pallas_triton", "pallas_mosaic_tpu")
# The XLA path's default chunks: a [256, 1024] float32 tile of logits is 1 MiB, which stays
# in a CPU core's cache across the passes over it (bench/losses.py: 2048 tokens x 32k
# vocabulary, d = 256, ran faster than with [1024, 4096] or [128, 512] tiles).
TOKEN_CHUNK, VOCAB_CHUNK = 256, 1024


def _pallas(implementation, h, w, y, keep, eps, lam, cap, dtype, token_chunk_size,
            vocab_chunk_size):
  """The Pallas kernels (kernels_pallas.cross_entropy) on the flattened tokens; +inf for a kept label outside [0, V)."""
  backend = {"pallas": None, "pallas_triton": "triton",
             "pallas_mosaic_tpu": "mosaic_tpu"}[implementation]
  backend, interpret = backends.pick_backend(backend)
  y = y.astype(jnp.int32)
  in_range = (y >= 0) & (y < w.shape[1])
  loss = cross_entropy.linear_cross_entropy_tokens(
      h, w, jnp.where(in_range, y, 0), keep & in_range, label_smoothing=eps, z_loss=lam,
      softcap=cap, compute_dtype=dtype, backend=backend, interpret=interpret,
      token_chunk_size=token_chunk_size, vocab_chunk_size=vocab_chunk_size)
  return jnp.where(keep & ~in_range, jnp.inf, loss)


class _Config(NamedTuple):
  """The static configuration (hashable, for ``nondiff_argnums``)."""
  tc: int
  vc: int
  eps: float
  lam: float
  cap: float | None
  dtype: Any


def _capped(z_raw, cap):
  """Logits after the soft cap, and d(logit)/d(raw) (None without a cap)."""
  if cap is None:
    return z_raw, None
  z = cap * jnp.tanh(z_raw / cap)
  return z, 1.0 - jnp.square(z / cap)


def _vocab_chunk(w, k, cfg):
  """Chunk k of the columns of w (the last one shifted back to end at V) and the mask of
  the columns that chunk k owns (those not already counted by an earlier chunk; None when
  the chunks divide V, so that every chunk owns all its columns)."""
  vocab = w.shape[1]
  if vocab % cfg.vc == 0:
    start = k * cfg.vc
    own = None
  else:
    start = jnp.minimum(k * cfg.vc, vocab - cfg.vc)
  wk = jax.lax.dynamic_slice_in_dim(w, start, cfg.vc, axis=1).astype(cfg.dtype)
  cols = start + jnp.arange(cfg.vc)
  if vocab % cfg.vc:
    own = cols >= k * cfg.vc
  return wk, cols, own, start


def _owned(own, x, fill):
  """x where the chunk owns the column, ``fill`` elsewhere (x itself when it owns all)."""
  return x if own is None else jnp.where(own, x, fill)


def _token_chunks(a, tc):
  """``[n, ...] -> [n / tc, tc, ...]``, chunk ``c`` holding the tokens ``c, c + n / tc, ...``
  (strided: the loops run over the chunk axis, which must not be sharded; on an explicit
  mesh the token axis's sharding stays on the ``tc`` tokens of each chunk)."""
  return jnp.moveaxis(a.reshape((tc, a.shape[0] // tc) + a.shape[1:]), 1, 0)


def _from_token_chunks(a):
  """The inverse of :func:`_token_chunks`: ``[n / tc, tc, ...] -> [n, ...]``."""
  return jnp.moveaxis(a, 0, 1).reshape((-1,) + a.shape[2:])


def _chunk_forward(cfg, w, hc, yc):
  """Per token of one chunk: LSE over the vocabulary, the label's logit, the sum of logits."""
  hc = hc.astype(cfg.dtype)
  n_vc = -(-w.shape[1] // cfg.vc)

  def body(carry, k):
    m, l, s, z_y = carry
    wk, cols, own, _ = _vocab_chunk(w, k, cfg)
    z, _ = _capped(hc @ wk, cfg.cap)
    m_new = jnp.maximum(m, jnp.max(_owned(own, z, -jnp.inf), axis=-1))
    l = l * jnp.exp(m - m_new) + jnp.sum(_owned(own, jnp.exp(z - m_new[:, None]), 0.0), -1)
    if cfg.eps:  # the row sum of the logits, for label smoothing only
      s = s + jnp.sum(_owned(own, z, 0.0), axis=-1)
    # the label's logit, read from the tile that holds it (no gather of w's columns by the
    # labels, whose output sharding an explicit mesh cannot infer)
    z_y = z_y + jnp.sum(_owned(own, jnp.where(cols[None, :] == yc[:, None], z, 0.0), 0.0), -1)
    return (m_new, l, s, z_y), None

  # the carries are built from the inputs (the shape of a logit column), so they have the
  # sharding and the shard_map varying axes of the logits the loop adds into them
  zeros = jnp.zeros_like(hc @ w[:, :1], dtype=cfg.dtype)[:, 0]
  (m, l, s, z_y), _ = jax.lax.scan(body, (zeros - jnp.inf, zeros, zeros, zeros),
                                   jnp.arange(n_vc))
  return m + jnp.log(l), z_y, s


def _forward(cfg, h, w, y, keep):
  def chunk(args):
    hc, yc = args
    return _chunk_forward(cfg, w, hc, yc)

  lse, z_y, s = jax.lax.map(chunk, (_token_chunks(h, cfg.tc), _token_chunks(y, cfg.tc)))
  lse, z_y, s = (_from_token_chunks(a) for a in (lse, z_y, s))
  loss = cross_entropy.token_loss(lse, z_y, s, eps=cfg.eps, lam=cfg.lam, vocab=w.shape[1])
  return jnp.where(keep, loss, 0.0), lse


def _backward(cfg, h, w, y, lse, g, coef_p):
  vocab = w.shape[1]
  n_vc = -(-vocab // cfg.vc)

  def token_chunk(dw, args):
    hc, yc, gc, cc, lc_ = args
    hc = hc.astype(cfg.dtype)
    dw_sharding = jax.typeof(dw).sharding if lc._sharded_along(hc, 0) else None

    def vocab_step(carry, k):
      dh, dw = carry
      wk, cols, own, start = _vocab_chunk(w, k, cfg)
      z, dcap = _capped(hc @ wk, cfg.cap)
      p = jnp.exp(z - lc_[:, None])
      target = jnp.where(cols[None, :] == yc[:, None], 1.0 - cfg.eps, 0.0)
      if cfg.eps:
        target = target + cfg.eps / vocab
      dz = _owned(own, cc[:, None] * p - gc[:, None] * target, 0.0)
      if dcap is not None:
        dz = dz * dcap
      dh = dh + dz @ wk.T
      # a sum over the tokens: on an explicit mesh that shards them, dw keeps w's sharding
      dwk = jnp.matmul(hc.T, dz, out_sharding=dw_sharding)
      dw = jax.lax.dynamic_update_slice_in_dim(
          dw, jax.lax.dynamic_slice_in_dim(dw, start, cfg.vc, axis=1) + dwk, start, axis=1)
      return (dh, dw), None

    dh0 = vary_like(jnp.zeros_like(hc), w, gc, cc, lc_)
    (dh, dw), _ = jax.lax.scan(vocab_step, (dh0, dw), jnp.arange(n_vc))
    return dw, dh

  chunks = tuple(_token_chunks(a, cfg.tc) for a in (h, y, g, coef_p, lse))
  # dw sums over every token: it varies over the shard_map axes h, g and the rest do
  dw0 = vary_like(jnp.zeros_like(w, dtype=cfg.dtype), h, y, g, coef_p, lse)
  dw, dh = jax.lax.scan(token_chunk, dw0, chunks)
  dh = _from_token_chunks(dh)
  # a weight shared by every shard gets the sum of their gradients, as autodiff gives it
  return sum_like(dh, h), sum_like(dw, w)


_lce = cross_entropy.chunked_loss_vjp(_forward, _backward)


def _forward_loss(cfg, h, w, y, keep):
  """The loss of :func:`_forward` without the custom VJP (autodiff: every derivative)."""
  return _forward(cfg, h, w, y, keep)[0]
