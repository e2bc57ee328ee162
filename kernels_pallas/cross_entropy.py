"""K08: Pallas kernels of the linear (chunked-vocabulary) cross-entropy.

``jaxsoft.losses.linear_cross_entropy(..., implementation="pallas")`` reaches
:func:`linear_cross_entropy_tokens`. The loss is Cut Cross-Entropy (E. Wijmans, B. Huval,
A. Hertzberg, V. Koltun & P. Krähenbühl, "Cut Your Losses in Large-Vocabulary Language
Models", 2024, arXiv 2411.09009): for token t with hidden state h_t, label y and logits
``z_tv = c tanh((h_t · w_v) / c)`` (the soft cap c; none when it is None),

    loss_t = LSE_v(z_t) - (1 - eps) z_ty - eps mean_v(z_t) + lam LSE_v(z_t)^2

(eps: label smoothing, lam: the z-loss weight), with the ``[tokens, V]`` logits never
materialised. Three kernels, each over ``[bt, bv]`` tiles of logits recomputed from
``h_blk @ w_blk`` (M. Milakov & N. Gimelshein, 2018, "Online normalizer calculation for
softmax", for the running max m and rescaled sum l):

* **forward**, per token block, over the vocabulary blocks: the online LSE, the label's
  logit z_ty and the row sum of the logits (for smoothing); the loss is assembled from
  these three per-token numbers outside the kernel.
* **dh**, per token block, over the vocabulary blocks, and
* **dw**, per vocabulary block, over the token blocks (dw accumulated over the token
  blocks), both from ``dz_tv = g_t ((1 + 2 lam LSE_t) p_tv - (1 - eps)[v = y_t] - eps / V)``
  (times the soft cap's ``1 - (z / c)^2``), with ``p = e^{z - LSE}`` recomputed from the
  saved per-token LSE: ``dh = dz @ w_blkᵀ``, ``dw_blk = h_blkᵀ @ dz``.

Two drivers, as the attention engine: **Triton** (GPUs; grid over one axis, the other
axis's loop inside the kernel; every tile shape a power of two, d padded to one) and
**Mosaic TPU** (grid over both axes, the reduction axis "arbitrary" with the running state
in VMEM scratch; token blocks a multiple of 8, vocabulary blocks of 128 lanes, d padded to
a multiple of 128). Tokens and vocabulary are padded to whole blocks: padded vocabulary
columns are masked out of every max, sum and gradient, padded tokens have zero weight.
Both run on CPU in interpret mode. Every tile holds the whole hidden axis (a ``[bt, d]``
block of h and its dh accumulator, a ``[d, bv]`` block of w and its dw accumulator), so
the default blocks shrink as d grows (:func:`default_block_sizes`, sized on Triton by a
shared-memory model, :func:`triton_shared_memory_bytes`); a split of d with atomic
accumulation, as CCE's Triton kernels do, is not implemented, so from d = 2048 (bf16) the
Triton driver refuses with a ValueError. On an H200 (2026-12-04) the earlier defaults asked
for 327680 bytes of shared memory at d = 1024 and failed to compile; no GPU figure of these
kernels has been measured since. No TPU figures: the Mosaic driver has run in interpret mode
and been cross-lowered only.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.backends import BACKENDS, check_backend

__all__ = ["linear_cross_entropy_tokens", "default_block_sizes", "triton_shared_memory_bytes",
           "TRITON_SHARED_MEMORY_BUDGET", "BACKENDS"]



class Config(NamedTuple):
  """The static configuration of one call (hashable: ``nondiff_argnums``)."""
  bt: int            # tokens per block
  bv: int            # vocabulary columns per block
  vocab: int         # V (the real, unpadded vocabulary)
  eps: float         # label smoothing
  lam: float         # z-loss weight
  cap: float | None  # soft cap
  dtype: Any         # compute dtype (float32, or float64 for float64 inputs)
  backend: str
  interpret: Any     # False, True, or a pltpu.InterpretParams


# Shared memory one Triton program may use on a Hopper GPU (H100/H200: 227 KiB; the limit an
# H200 reported, bench/gpu.py 2026-12-04), less 8 KiB for Triton's own scratch.
TRITON_SHARED_MEMORY_BUDGET = 232448 - 8 * 1024
_TRITON_STAGES = 2  # the loads inside the kernels' loops are double-buffered (num_stages=2)


def triton_shared_memory_bytes(bt: int, bv: int, d_pad: int, itemsize: int,
                               compute_itemsize: int = 4) -> int:
  """Shared memory of the largest of the three Triton kernels (a model, in bytes).

  The block loaded once stays resident, the block loaded in the loop is double-buffered,
  and a backward kernel that upcasts its loop-invariant operand to the compute dtype keeps
  that copy too:

  * forward: ``(bt + 2 bv) d itemsize`` (h block; w blocks in the vocabulary loop);
  * dh: the forward's, plus ``bv d compute_itemsize`` when the inputs are narrower;
  * dw: ``(bv + 2 bt) d itemsize`` (w block; h blocks in the token loop), plus
    ``bt d compute_itemsize`` when narrower.

  Calibrated on one measurement: bf16, d = 1024, bt = 32, bv = 64 asked an H200 for
  327680 bytes, which is the forward's term.

  Args:
    bt, bv: tokens and vocabulary columns per block.
    d_pad: the padded hidden size.
    itemsize: bytes per element of h and w.
    compute_itemsize: bytes per element of the compute dtype.

  Returns:
    The bytes, an int (compare with :data:`TRITON_SHARED_MEMORY_BUDGET`).

  Examples:
    >>> from kernels_pallas import cross_entropy as ce
    >>> ce.triton_shared_memory_bytes(32, 64, 1024, 2, compute_itemsize=2)  # the forward's
    327680
    >>> ce.triton_shared_memory_bytes(32, 64, 1024, 2) > ce.TRITON_SHARED_MEMORY_BUDGET
    True

  References:
    E. Wijmans, B. Huval, A. Hertzberg, V. Koltun & P. Krähenbühl, 2024, "Cut Your Losses
    in Large-Vocabulary Language Models" (the
    blockwise kernels whose tiles hold the whole hidden axis).
  """
  for name, x in (("bt", bt), ("bv", bv), ("d_pad", d_pad), ("itemsize", itemsize),
                  ("compute_itemsize", compute_itemsize)):
    if isinstance(x, bool) or not isinstance(x, int) or x <= 0:
      raise ValueError(f"triton_shared_memory_bytes: `{name}` must be a positive int, got {x!r}")
  upcast = compute_itemsize if compute_itemsize > itemsize else 0
  fwd = (bt + _TRITON_STAGES * bv) * d_pad * itemsize
  dh = fwd + bv * d_pad * upcast
  dw = (bv + _TRITON_STAGES * bt) * d_pad * itemsize + bt * d_pad * upcast
  return max(fwd, dh, dw)


def default_block_sizes(backend: str, d_pad: int, itemsize: int = 2,
                        compute_itemsize: int = 4) -> tuple[int, int]:
  """(tokens per block, vocabulary columns per block) of ``backend`` for the padded hidden
  size ``d_pad``: every tile holds the whole hidden axis (a ``[bt, d]`` block of h and a
  ``[d, bv]`` block of w and dw), so the blocks shrink as d grows. On Triton, from
  ``(64, 128)`` the larger block is halved (down to 16) until
  :func:`triton_shared_memory_bytes` fits :data:`TRITON_SHARED_MEMORY_BUDGET`; no shape
  fits from d = 2048 in bf16 (the caller raises). Mosaic TPU: 256 tokens and 512, 256 or
  128 columns as d grows.

  Args:
    backend: ``"triton"`` or ``"mosaic_tpu"``.
    d_pad: the padded hidden size.
    itemsize: bytes per element of h and w.
    compute_itemsize: bytes per element of the compute dtype.

  Returns:
    ``(bt, bv)``, two ints.

  Examples:
    >>> from kernels_pallas import cross_entropy as ce
    >>> ce.default_block_sizes("triton", 256), ce.default_block_sizes("mosaic_tpu", 1024)
    ((64, 64), (256, 512))

  References:
    E. Wijmans, B. Huval, A. Hertzberg, V. Koltun & P. Krähenbühl, 2024, "Cut Your Losses
    in Large-Vocabulary Language Models".
  """
  if backend == "triton":
    bt, bv = 64, 128
    while triton_shared_memory_bytes(bt, bv, d_pad, itemsize, compute_itemsize) > \
        TRITON_SHARED_MEMORY_BUDGET and max(bt, bv) > 16:
      if bv >= bt:
        bv //= 2
      else:
        bt //= 2
    return bt, bv
  return 256, (512 if d_pad <= 1024 else 256 if d_pad <= 2048 else 128)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _check_blocks(backend: str, bt: int, bv: int, fn: str):
  if backend == "triton":
    for name, x in (("token_chunk_size", bt), ("vocab_chunk_size", bv)):
      if x < 16 or x & (x - 1):
        raise ValueError(f"{fn}: `{name}` must be a power of two >= 16 for the Triton kernel, "
                         f"got {x}")
  else:
    if bt % 8:
      raise ValueError(f"{fn}: `token_chunk_size` must be a multiple of 8 for the Mosaic TPU "
                       f"kernel, got {bt}")
    if bv % 128:
      raise ValueError(f"{fn}: `vocab_chunk_size` must be a multiple of 128 for the Mosaic TPU "
                       f"kernel, got {bv}")


def linear_cross_entropy_tokens(h, w, y, keep, *, label_smoothing: float, z_loss: float,
                                softcap: float | None, compute_dtype, backend: str,
                                interpret=False, token_chunk_size: int | None = None,
                                vocab_chunk_size: int | None = None):
  r"""Per-token linear cross-entropy by the Pallas kernels, the logits never materialised.

  For token t with hidden state ``h_t``, label y and logits ``z_tv = c tanh(h_t . w_v / c)``
  (no tanh without a soft cap c):

  .. math::
    \ell_t = \mathrm{LSE}_v(z_t) - (1 - \epsilon) z_{ty} - \epsilon\,
    \mathrm{mean}_v(z_t) + \lambda\, \mathrm{LSE}_v(z_t)^2

  (eps: label smoothing, lambda: the z-loss weight). The inputs are validated and
  flattened by the caller, :func:`jaxsoft.losses.linear_cross_entropy`.

  Args:
    h: ``[n, d]`` hidden states; w: ``[d, V]``; y: ``[n]`` int32 labels in ``[0, V)``;
    keep: ``[n]`` bool (False: loss 0, no gradient).
    label_smoothing, z_loss, softcap: as :func:`jaxsoft.losses.linear_cross_entropy`.
    compute_dtype: the dtype of the logits and running statistics.
    backend: ``"triton"`` or ``"mosaic_tpu"``; interpret: the Pallas interpreter flag
      (True on CPU, or a ``pltpu.InterpretParams`` for Mosaic).
    token_chunk_size, vocab_chunk_size: the kernel's blocks (None: :func:`default_block_sizes`;
      Triton: powers of two >= 16; Mosaic: multiples of 8 and 128).

  Returns:
    ``[n]`` losses in ``compute_dtype`` (0 where ``keep`` is False), differentiable in h, w.

  Examples:
    Eight tokens, a vocabulary of 40, interpret mode on CPU, against optax on the
    materialised logits:

    >>> import optax
    >>> from kernels_pallas import cross_entropy as ce
    >>> ks = jax.random.split(jax.random.key(0), 3)
    >>> h = jax.random.normal(ks[0], (8, 16))
    >>> w = jax.random.normal(ks[1], (16, 40)) / 4
    >>> y = jax.random.randint(ks[2], (8,), 0, 40)
    >>> loss = jax.jit(lambda h, w: ce.linear_cross_entropy_tokens(
    ...     h, w, y, jnp.ones(8, bool), label_smoothing=0.0, z_loss=0.0, softcap=None,
    ...     compute_dtype=jnp.float32, backend="triton", interpret=True))(h, w)
    >>> ref = optax.softmax_cross_entropy_with_integer_labels(h @ w, y)
    >>> loss.shape, bool(jnp.allclose(loss, ref, atol=1e-5))
    ((8,), True)

  References:
    E. Wijmans, B. Huval, A. Hertzberg, V. Koltun & P. Krähenbühl, 2024, "Cut Your Losses
    in Large-Vocabulary Language Models".

    M. Milakov & N. Gimelshein, 2018, "Online normalizer calculation for softmax".
  """
  fn = "linear_cross_entropy"
  check_backend(backend, fn)
  n, d = h.shape
  vocab = w.shape[1]
  d_pad = _next_pow2(max(d, 16)) if backend == "triton" else _round_up(d, 128)
  itemsize = max(jnp.dtype(h.dtype).itemsize, jnp.dtype(w.dtype).itemsize)
  compute_itemsize = jnp.dtype(compute_dtype).itemsize
  dbt, dbv = default_block_sizes(backend, d_pad, itemsize, compute_itemsize)
  bt = dbt if token_chunk_size is None else int(token_chunk_size)
  bv = dbv if vocab_chunk_size is None else int(vocab_chunk_size)
  _check_blocks(backend, bt, bv, fn)
  if backend == "triton":  # no larger than the padded axis
    bt, bv = min(bt, _next_pow2(max(n, 16))), min(bv, _next_pow2(max(vocab, 16)))
    need = triton_shared_memory_bytes(bt, bv, d_pad, itemsize, compute_itemsize)
    if need > TRITON_SHARED_MEMORY_BUDGET:
      raise ValueError(
          f"{fn}: the Triton kernels hold the whole hidden axis in shared memory, and "
          f"d = {d} (padded to {d_pad}) with {jnp.dtype(h.dtype).name} inputs, token_chunk_size "
          f"= {bt} and vocab_chunk_size = {bv} needs about {need} bytes, over the "
          f"{TRITON_SHARED_MEMORY_BUDGET} a Hopper GPU allows (the kernels do not split d); "
          "use smaller chunks or implementation='xla'")
  else:
    bt, bv = min(bt, _round_up(n, 8)), min(bv, _round_up(vocab, 128))
  n_pad, v_pad = _round_up(n, bt), _round_up(vocab, bv)
  cfg = Config(bt, bv, vocab, float(label_smoothing), float(z_loss),
               None if softcap is None else float(softcap), jnp.dtype(compute_dtype), backend,
               interpret)
  hp = jnp.pad(h, ((0, n_pad - n), (0, d_pad - d)))
  wp = jnp.pad(w, ((0, d_pad - d), (0, v_pad - vocab)))
  yp = jnp.pad(y.astype(jnp.int32), (0, n_pad - n))[:, None]
  kp = jnp.pad(keep, (0, n_pad - n))[:, None]
  return _core(cfg, hp, wp, yp, kp)[:n, 0]


# ---------------------------------------------------------------------------- tile math
# Pure jnp on one [bt, bv] tile, shared by both drivers.


def _dot(cfg: Config, a, b, contract: tuple[int, int]):
  return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                             preferred_element_type=cfg.dtype)


def _tile_logits(cfg: Config, hb, wb, col0):
  """Logits of the tile at vocabulary offset ``col0``: (z, d z / d raw or None, columns,
  valid = column < V)."""
  raw = _dot(cfg, hb, wb, (1, 0))
  cols = col0 + jax.lax.broadcasted_iota(jnp.int32, raw.shape, 1)
  valid = cols < cfg.vocab
  if cfg.cap is None:
    return raw, None, cols, valid
  z = cfg.cap * jnp.tanh(raw / cfg.cap)
  return z, 1.0 - jnp.square(z / cfg.cap), cols, valid


def _init_state(cfg: Config, bt: int):
  """(m, l, label logit, row sum), each [bt, 1]."""
  zeros = jnp.zeros((bt, 1), cfg.dtype)
  return zeros - jnp.inf, zeros, zeros, zeros


def _forward_tile(cfg: Config, state, z, cols, valid, yb):
  """The online-LSE step of one tile; yb [bt, 1] the labels."""
  m, l, zy, s = state
  m_new = jnp.maximum(m, jnp.max(jnp.where(valid, z, -jnp.inf), axis=1, keepdims=True))
  l = l * jnp.exp(m - m_new) + jnp.sum(jnp.where(valid, jnp.exp(z - m_new), 0.0), axis=1,
                                       keepdims=True)
  zy = zy + jnp.sum(jnp.where(cols == yb, z, 0.0), axis=1, keepdims=True)
  s = s + jnp.sum(jnp.where(valid, z, 0.0), axis=1, keepdims=True)
  return m_new, l, zy, s


def _tile_dz(cfg: Config, z, dcap, cols, valid, yb, lse, g, coef):
  """d loss / d raw logits of one tile: ``coef p - g target`` (times the cap's slope)."""
  p = jnp.exp(z - lse)
  target = jnp.where(cols == yb, 1.0 - cfg.eps, 0.0)
  if cfg.eps:
    target = target + cfg.eps / cfg.vocab
  dz = jnp.where(valid, coef * p - g * target, 0.0)
  return dz if dcap is None else dz * dcap


# ------------------------------------------------------------------------------ Triton


def _triton_call(cfg: Config, kernel, name: str, grid, in_specs, out_specs, out_shape, *args):
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=bool(cfg.interpret), name=f"jaxsoft_linear_ce_{name}")(*args)


def _triton_forward(cfg: Config, h, w, y):
  bt, bv = cfg.bt, cfg.bv
  (n_pad, d_pad), v_pad = h.shape, w.shape[1]
  row = pl.BlockSpec((bt, 1), lambda i: (i, 0))
  row_shape = jax.ShapeDtypeStruct((n_pad, 1), cfg.dtype)

  def kernel(h_ref, w_ref, y_ref, lse_ref, zy_ref, s_ref):
    hb, yb = h_ref[...], y_ref[...]

    def body(j, state):
      z, _, cols, valid = _tile_logits(cfg, hb, w_ref[:, pl.ds(j * bv, bv)], j * bv)
      return _forward_tile(cfg, state, z, cols, valid, yb)

    m, l, zy, s = jax.lax.fori_loop(0, v_pad // bv, body, _init_state(cfg, bt))
    lse_ref[...] = m + jnp.log(l)
    zy_ref[...] = zy
    s_ref[...] = s

  return _triton_call(
      cfg, kernel, "fwd", (n_pad // bt,),
      [pl.BlockSpec((bt, d_pad), lambda i: (i, 0)),
       pl.BlockSpec((d_pad, v_pad), lambda i: (0, 0)), row],
      [row, row, row], [row_shape] * 3, h, w, y)


def _triton_dh(cfg: Config, h, w, y, lse, g, coef):
  bt, bv = cfg.bt, cfg.bv
  (n_pad, d_pad), v_pad = h.shape, w.shape[1]
  row = pl.BlockSpec((bt, 1), lambda i: (i, 0))
  blk = pl.BlockSpec((bt, d_pad), lambda i: (i, 0))

  def kernel(h_ref, w_ref, y_ref, lse_ref, g_ref, c_ref, dh_ref):
    hb, yb, lse_b, gb, cb = h_ref[...], y_ref[...], lse_ref[...], g_ref[...], c_ref[...]

    def body(j, dh):
      wb = w_ref[:, pl.ds(j * bv, bv)]
      z, dcap, cols, valid = _tile_logits(cfg, hb, wb, j * bv)
      dz = _tile_dz(cfg, z, dcap, cols, valid, yb, lse_b, gb, cb)
      return dh + _dot(cfg, dz, wb.astype(cfg.dtype), (1, 1))

    dh_ref[...] = jax.lax.fori_loop(0, v_pad // bv, body, jnp.zeros((bt, d_pad), cfg.dtype))

  return _triton_call(
      cfg, kernel, "dh", (n_pad // bt,),
      [blk, pl.BlockSpec((d_pad, v_pad), lambda i: (0, 0)), row, row, row, row], blk,
      jax.ShapeDtypeStruct((n_pad, d_pad), cfg.dtype), h, w, y, lse, g, coef)


def _triton_dw(cfg: Config, h, w, y, lse, g, coef):
  bt, bv = cfg.bt, cfg.bv
  (n_pad, d_pad), v_pad = h.shape, w.shape[1]
  full_row = pl.BlockSpec((n_pad, 1), lambda j: (0, 0))
  blk = pl.BlockSpec((d_pad, bv), lambda j: (0, j))

  def kernel(h_ref, w_ref, y_ref, lse_ref, g_ref, c_ref, dw_ref):
    wb = w_ref[...]
    j = pl.program_id(0)

    def body(i, dw):
      sl = pl.ds(i * bt, bt)
      hb = h_ref[sl, :]
      z, dcap, cols, valid = _tile_logits(cfg, hb, wb, j * bv)
      dz = _tile_dz(cfg, z, dcap, cols, valid, y_ref[sl, :], lse_ref[sl, :], g_ref[sl, :],
                    c_ref[sl, :])
      return dw + _dot(cfg, hb.astype(cfg.dtype), dz, (0, 0))

    dw_ref[...] = jax.lax.fori_loop(0, n_pad // bt, body, jnp.zeros((d_pad, bv), cfg.dtype))

  return _triton_call(
      cfg, kernel, "dw", (v_pad // bv,),
      [pl.BlockSpec((n_pad, d_pad), lambda j: (0, 0)), blk] + [full_row] * 4, blk,
      jax.ShapeDtypeStruct((d_pad, v_pad), cfg.dtype), h, w, y, lse, g, coef)


# -------------------------------------------------------------------------- Mosaic TPU


def _mosaic_call(cfg: Config, kernel, name: str, grid, in_specs, out_specs, out_shape, scratch,
                 *args):
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=0, grid=grid, in_specs=in_specs, out_specs=out_specs,
          scratch_shapes=scratch),
      out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=cfg.interpret, name=f"jaxsoft_linear_ce_{name}")(*args)


def _mosaic_forward(cfg: Config, h, w, y):
  bt, bv = cfg.bt, cfg.bv
  (n_pad, d_pad), v_pad = h.shape, w.shape[1]
  nv = v_pad // bv
  row = pl.BlockSpec((bt, 1), lambda i, j: (i, 0))
  row_shape = jax.ShapeDtypeStruct((n_pad, 1), cfg.dtype)

  def kernel(h_ref, w_ref, y_ref, lse_ref, zy_ref, s_ref, m_sc, l_sc, zy_sc, s_sc):
    j = pl.program_id(1)
    scs = (m_sc, l_sc, zy_sc, s_sc)

    @pl.when(j == 0)
    def _init():
      for sc, x in zip(scs, _init_state(cfg, bt), strict=True):
        sc[...] = x

    z, _, cols, valid = _tile_logits(cfg, h_ref[...], w_ref[...], j * bv)
    state = _forward_tile(cfg, tuple(sc[...] for sc in scs), z, cols, valid, y_ref[...])
    for sc, x in zip(scs, state, strict=True):
      sc[...] = x

    @pl.when(j == nv - 1)
    def _finish():
      lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])
      zy_ref[...] = zy_sc[...]
      s_ref[...] = s_sc[...]

  return _mosaic_call(
      cfg, kernel, "fwd", (n_pad // bt, nv),
      [pl.BlockSpec((bt, d_pad), lambda i, j: (i, 0)),
       pl.BlockSpec((d_pad, bv), lambda i, j: (0, j)), row],
      [row, row, row], [row_shape] * 3, [pltpu.VMEM((bt, 1), cfg.dtype)] * 4, h, w, y)


def _mosaic_dh(cfg: Config, h, w, y, lse, g, coef):
  bt, bv = cfg.bt, cfg.bv
  (n_pad, d_pad), v_pad = h.shape, w.shape[1]
  nv = v_pad // bv
  row = pl.BlockSpec((bt, 1), lambda i, j: (i, 0))
  blk = pl.BlockSpec((bt, d_pad), lambda i, j: (i, 0))

  def kernel(h_ref, w_ref, y_ref, lse_ref, g_ref, c_ref, dh_ref, acc):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
      acc[...] = jnp.zeros_like(acc)

    wb = w_ref[...]
    z, dcap, cols, valid = _tile_logits(cfg, h_ref[...], wb, j * bv)
    dz = _tile_dz(cfg, z, dcap, cols, valid, y_ref[...], lse_ref[...], g_ref[...], c_ref[...])
    acc[...] += _dot(cfg, dz, wb.astype(cfg.dtype), (1, 1))

    @pl.when(j == nv - 1)
    def _finish():
      dh_ref[...] = acc[...]

  return _mosaic_call(
      cfg, kernel, "dh", (n_pad // bt, nv),
      [blk, pl.BlockSpec((d_pad, bv), lambda i, j: (0, j)), row, row, row, row], blk,
      jax.ShapeDtypeStruct((n_pad, d_pad), cfg.dtype), [pltpu.VMEM((bt, d_pad), cfg.dtype)],
      h, w, y, lse, g, coef)


def _mosaic_dw(cfg: Config, h, w, y, lse, g, coef):
  bt, bv = cfg.bt, cfg.bv
  (n_pad, d_pad), v_pad = h.shape, w.shape[1]
  nt = n_pad // bt
  row = pl.BlockSpec((bt, 1), lambda j, i: (i, 0))
  blk = pl.BlockSpec((d_pad, bv), lambda j, i: (0, j))

  def kernel(h_ref, w_ref, y_ref, lse_ref, g_ref, c_ref, dw_ref, acc):
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
      acc[...] = jnp.zeros_like(acc)

    hb = h_ref[...]
    z, dcap, cols, valid = _tile_logits(cfg, hb, w_ref[...], j * bv)
    dz = _tile_dz(cfg, z, dcap, cols, valid, y_ref[...], lse_ref[...], g_ref[...], c_ref[...])
    acc[...] += _dot(cfg, hb.astype(cfg.dtype).T, dz, (1, 0))

    @pl.when(i == nt - 1)
    def _finish():
      dw_ref[...] = acc[...]

  return _mosaic_call(
      cfg, kernel, "dw", (v_pad // bv, nt),
      [pl.BlockSpec((bt, d_pad), lambda j, i: (i, 0)), blk, row, row, row, row], blk,
      jax.ShapeDtypeStruct((d_pad, v_pad), cfg.dtype), [pltpu.VMEM((d_pad, bv), cfg.dtype)],
      h, w, y, lse, g, coef)


_DRIVERS = {"triton": (_triton_forward, _triton_dh, _triton_dw),
            "mosaic_tpu": (_mosaic_forward, _mosaic_dh, _mosaic_dw)}


# ------------------------------------------------------------------------- custom VJP


def token_loss(lse, z_y, s, *, eps: float, lam: float, vocab: int):
  r"""The per-token loss from the row statistics (``lse``, the label's logit ``z_y`` and the
  logits' sum ``s``): :math:`\mathrm{lse} - (1 - \epsilon) z_y - \epsilon s / V
  + \lambda\,\mathrm{lse}^2` (label smoothing ``eps``, z-loss ``lam``)."""
  loss = lse - (1.0 - eps) * z_y
  if eps:
    loss = loss - eps * s / vocab
  if lam:
    loss = loss + lam * jnp.square(lse)
  return loss


def chunked_loss_vjp(forward, backward):
  """The custom-VJP loss ``f(cfg, h, w, y, keep)`` of a chunked linear cross-entropy.

  ``forward(cfg, h, w, y, keep) -> (loss, lse)`` (the loss 0 where ``keep`` is False);
  ``backward(cfg, h, w, y, lse, g, coef) -> (dh, dw)`` with ``g`` the cotangent (0 where
  not kept, in ``cfg.dtype``) and ``coef = g (1 + 2 lam lse)`` the softmax term's weight
  (the z-loss ``cfg.lam`` adds its gradient there). The residuals are the inputs and the
  per-token ``lse``, never the logits.
  """

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def loss(cfg, h, w, y, keep):
    return forward(cfg, h, w, y, keep)[0]

  def loss_fwd(cfg, h, w, y, keep):
    out, lse = forward(cfg, h, w, y, keep)
    return out, (h, w, y, keep, lse)

  def loss_bwd(cfg, res, ct):
    h, w, y, keep, lse = res
    g = jnp.where(keep, ct.astype(cfg.dtype), 0.0)
    coef = g * (1.0 + 2.0 * cfg.lam * lse) if cfg.lam else g
    dh, dw = backward(cfg, h, w, y, lse, g, coef)
    return dh.astype(h.dtype), dw.astype(w.dtype), None, None

  loss.defvjp(loss_fwd, loss_bwd)
  return loss


def _forward(cfg: Config, h, w, y, keep):
  lse, zy, s = _DRIVERS[cfg.backend][0](cfg, h, w, y)
  loss = token_loss(lse, zy, s, eps=cfg.eps, lam=cfg.lam, vocab=cfg.vocab)
  return jnp.where(keep, loss, 0.0), lse


def _backward(cfg: Config, h, w, y, lse, g, coef):
  _, dh_fn, dw_fn = _DRIVERS[cfg.backend]
  return dh_fn(cfg, h, w, y, lse, g, coef), dw_fn(cfg, h, w, y, lse, g, coef)


# Padded inputs: h [n_pad, d_pad], w [d_pad, v_pad], y and keep [n_pad, 1].
_core = chunked_loss_vjp(_forward, _backward)

