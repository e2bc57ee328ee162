r"""MHLA: linear attention with token-level heads, block summaries mixed by learned weights.

Feature A36 (Zhang et al. 2026, "MHLA: Restoring Expressivity of Linear Attention via
Token-Level Multi-Head", arXiv 2601.07832). Vanilla linear
attention sums every key into one ``K' x V`` state, so its attention matrix has rank at
most ``K'`` ("global context collapse"). MHLA splits the tokens into ``M`` blocks of
``b`` tokens, keeps each block's summary

.. math::
  S_β = \sum_{j \in β} φ(k_j) v_j^\top, \qquad z_β = \sum_{j \in β} φ(k_j),

and lets the queries of block ``i`` read their own mixture
``\tilde S_i = Σ_β c_{iβ} S_β``, ``\tilde z_i = Σ_β c_{iβ} z_β`` with learned coefficients
``C [M, M]``: ``o = φ(q)^\top \tilde S_i / φ(q)^\top \tilde z_i``. The rank bound becomes
``Σ_β min(|β|, K')``. Constraints on ``C`` (sign, causal masking) are not given in the
abstract; this is a reconstruction [R]: ``C`` is used as given, and the causal form keeps only
``β <= i`` with the own block read causally (token ``t`` sees the keys ``j <= t`` of its
block), so that query ``t`` in block ``i`` weighs key ``j`` by ``c_{i, β(j)} φ(q_t)·φ(k_j)``.
``C`` = all ones is vanilla linear attention.

Decoding (:func:`mhla_step`, causal only): there is no fixed-size recurrent form, since
``C`` mixes every earlier block, but a state of the ``M_max`` block summaries
``[S_β; z_β]`` (the current block's one a running sum) gives the causal output token by
token at ``O(M_max·K'·V)`` per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import concrete, positive_int
from jaxsoft.linear import _checks, _features, _linear_attention, chunk
from jaxsoft.linear.context_parallel import active as _cp_active
from jaxsoft.linear.context_parallel import block_summaries as _cp_block_summaries
from jaxsoft.linear.context_parallel import shard_count as _cp_shard_count

__all__ = ["mhla", "mhla_step"]


def _parallel(fq, fk, v, C, block, causal, eps):
  T = fq.shape[1]
  blk = jnp.arange(T) // block
  coef = C[:, blk][:, :, blk]                                           # [N, T, T]
  w = jnp.einsum("btnk,bsnk->bnts", fq, fk) * coef[None]
  if causal:
    w = jnp.where(jnp.tril(jnp.ones((T, T), bool)), w, 0.0)
  num = jnp.einsum("bnts,bsnv->btnv", w, v)
  den = jnp.moveaxis(jnp.sum(w, -1), 1, 2)[..., None]
  return _linear_attention.safe_divide(num, den, eps)


def _chunked(fq, fk, v, C, block, causal, eps, plan=None):
  B, T, N, _ = fq.shape
  pad = (-T) % block
  fq, fk, v = (chunk.pad_time(x, 1, pad) for x in (fq, fk, v))       # padded keys are 0
  vv = jnp.concatenate([v, jnp.ones_like(v[..., :1])], axis=-1)        # the ones: denominators
  qc, kc, vc = (chunk.to_chunks(x, 1, block) for x in (fq, fk, vv))   # [B, m, b, N, ...]
  S = jnp.einsum("bmcnk,bmcnv->bmnkv", kc, vc)                         # block summaries
  m, first = S.shape[1], jnp.zeros((), jnp.int32)   # this shard's first block: 0 alone
  if plan is not None:   # under context_parallel: every shard's summaries, this shard's rows
    S, first = _cp_block_summaries(S, plan, "mhla")
    C = jax.lax.dynamic_slice_in_dim(C, first, m, axis=1)             # [N, m, M]
  if causal:
    row = first + jnp.arange(m)                                        # global block indices
    C_inter = jnp.where(row[:, None] > jnp.arange(C.shape[-1])[None], C, 0.0)
    intra = jnp.einsum("bmink,bmjnk->bmnij", qc, kc)
    intra = jnp.where(jnp.tril(jnp.ones((block, block), bool)), intra, 0.0)
    own = jnp.take_along_axis(C, row[None, :, None], axis=-1)[..., 0]   # c_{ii}: [N, m]
    intra = intra * jnp.moveaxis(own, 0, 1)[None, :, :, None, None]
    out = (jnp.einsum("bmcnk,nmi,binkv->bmcnv", qc, C_inter, S)
           + jnp.einsum("bmnij,bmjnv->bminv", intra, vc))
  else:
    out = jnp.einsum("bmcnk,nmi,binkv->bmcnv", qc, C, S)
  out = chunk.from_chunks(out, 1)[:, :T]
  return _linear_attention.safe_divide(out[..., :-1], out[..., -1:], eps)


def mhla(q: ArrayLike, k: ArrayLike, v: ArrayLike, mixing: ArrayLike, *, block_size: int,
         feature_map: str | Callable[[jax.Array], jax.Array] = "elu1", causal: bool = True,
         implementation: str | None = None, eps: float = 1e-6) -> jax.Array:
  r"""Multi-head linear attention over token blocks, mixed by ``C`` (feature A36, [R]).

  .. math::
    o_t = \frac{\sum_{j} c_{β(t) β(j)}\, φ(q_t) \cdot φ(k_j)\, v_j}
               {\sum_{j} c_{β(t) β(j)}\, φ(q_t) \cdot φ(k_j)}

  over ``j <= t`` (causal) or all ``j``, ``β(t) = ⌊t / b⌋`` the block of ``t``
  (Zhang et al. 2026, "MHLA"; see the module docstring). The chunked form
  computes it from the block summaries in O(T·K'·V + M²·K'·V). ``scale`` cancels in the
  ratio, so there is none.

  Args:
    q, k: ``[B, T, N, K]`` (before the feature map); v: ``[B, T, N, V]``.
    mixing: ``C``, ``[M, M]`` (shared by the heads) or ``[N, M, M]``, ``M = ⌈T / b⌉`` (the
      whole sequence's ``T`` under :func:`jaxsoft.linear.context_parallel`, which runs the
      chunked form from the all-gathered block summaries).
    block_size: ``b``, a positive int.
    feature_map: as in :func:`jaxsoft.linear.linear_attention`.
    causal: causal (the reconstruction above) or bidirectional (the paper's vision model).
    implementation: ``"parallel"`` (T x T), ``"chunked"`` (block summaries) or None
      (chunked). There is no recurrent form: ``C`` mixes every earlier block.
    eps: the smallest denominator magnitude (its sign kept).

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype.

  Examples:
    >>> q = k = jnp.zeros((1, 4, 1, 1)); v = jnp.arange(4.0).reshape(1, 4, 1, 1)
    >>> C = jnp.array([[1.0, 0.0], [0.0, 1.0]])   # each block reads only itself
    >>> fn = jax.jit(mhla, static_argnames=("implementation", "block_size", "causal"))
    >>> fn(q, k, v, C, block_size=2, causal=False)[0, :, 0, 0]
    Array([0.5, 0.5, 2.5, 2.5], dtype=float32)

    The two forms give the same output (``[B, T, N, K] = [1, 8, 2, 4]``, two blocks of 4):

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> C = jnp.array([[1.0, 0.0], [0.5, 1.0]])
    >>> o = fn(q, k, v, C, block_size=4, implementation="parallel")
    >>> o.shape
    (1, 8, 2, 4)
    >>> o_chunked = fn(q, k, v, C, block_size=4, implementation="chunked")
    >>> bool(jnp.allclose(o, o_chunked, atol=1e-5))
    True

  References:
    K. Zhang, Y. Huang, Y. Deng, J. Yu, J. Chen, H. Ling, E. Xie & D. Zhou, 2026, "MHLA:
    Restoring Expressivity of Linear Attention via Token-Level Multi-Head".
  """
  fn_name = "mhla"
  phi = _features.resolve(feature_map, fn_name)
  eps = _checks.check_eps(eps, fn_name)
  fq, fk, v, dtype = _features.apply(phi, q, k, v, fn_name)
  B, T, N, _ = fq.shape
  block = positive_int(block_size, "block_size", fn_name)
  plan = _cp_active()
  if plan is not None and T % block:
    raise ValueError(f"{fn_name}: under context_parallel each shard's length must be a multiple "
                     f"of `block_size` = {block} (a block may not straddle two shards), got "
                     f"T_shard = {T}")
  M = math.ceil(T * (1 if plan is None else _cp_shard_count(plan, fn_name)) / block)
  C = jnp.asarray(mixing)
  if C.shape not in ((M, M), (N, M, M)):
    raise ValueError(f"{fn_name}: `mixing` must have shape [M, M] or [N, M, M] with "
                     f"M = ceil(T / block_size) = {M}, N = {N}, got {C.shape}")
  cdt = _checks.compute_dtype_of(fq, fk, v)
  C = jnp.broadcast_to(_checks.check_gate_logits(C, C.shape, fn_name, "mixing", dtype=cdt),
                       (N, M, M))
  implementation = _checks.check_forms(implementation, ("parallel", "chunked"), "chunked",
                                       fn_name)
  args = (fq.astype(cdt), fk.astype(cdt), v.astype(cdt), C, block, causal, eps)
  if plan is not None:   # the block summaries of every shard (the parallel form needs all keys)
    return _chunked(*args, plan=plan).astype(dtype)
  form = _parallel if implementation == "parallel" else _chunked
  return form(*args).astype(dtype)


def mhla_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, mixing: ArrayLike, state: Any = None, *,
              position: ArrayLike, block_size: int,
              feature_map: str | Callable[[jax.Array], jax.Array] = "elu1",
              eps: float = 1e-6) -> tuple[jax.Array, jax.Array]:
  r"""One decoding step of causal :func:`mhla` at token ``position`` (``t``).

  With ``i = ⌊t / b⌋``: ``[S_i; z_i] += φ(k_t) [v_t; 1]^\top`` (the running sum of the current
  block), then

  .. math::
    o_t = \frac{φ(q_t)^\top \sum_{β \le i} c_{iβ} S_β}{φ(q_t)^\top \sum_{β \le i} c_{iβ} z_β},

  which is the causal :func:`mhla` at ``t`` (Zhang et al. 2026, "MHLA";
  reconstruction [R], see the module docstring).

  Args:
    q, k: ``[B, N, K]`` (before the feature map); v: ``[B, N, V]``.
    mixing: ``C``, ``[M, M]`` or ``[N, M, M]``: ``M`` blocks of ``b`` tokens bound the positions,
      ``t < M·b``; the full call on ``T`` tokens uses its leading ``[⌈T/b⌉, ⌈T/b⌉]`` corner.
    state: the summaries ``[B, N, M, K', V + 1]`` (``z`` as the last column), or None: zeros.
    position: ``t``, an int or ``[B]`` ints (may be traced). Outside ``[0, M·b)`` it raises
      ValueError where concrete; a traced one there gives NaN outputs (never a silent value).
    block_size, feature_map, eps: as in :func:`mhla`.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, new_state)``.

  Examples:
    >>> C = jnp.array([[1.0, 0.0], [0.0, 1.0]])   # each block reads only itself
    >>> state = None
    >>> for t in range(3):
    ...   one = jnp.full((1, 1, 1), float(t))
    ...   o, state = mhla_step(0 * one, 0 * one, one, C, state, position=t, block_size=2)
    >>> o[0, 0, 0]   # block 1 holds only token 2
    Array(2., dtype=float32)

  References:
    Zhang et al., 2026, "MHLA" (in full: :func:`mhla`).
  """
  fn_name = "mhla_step"
  phi = _features.resolve(feature_map, fn_name)
  eps = _checks.check_eps(eps, fn_name)
  fq, fk, v, dtype = _features.apply(phi, q, k, v, fn_name, step=True)
  B, N, F = fk.shape
  V = v.shape[-1]
  block_size = positive_int(block_size, "block_size", fn_name)
  C = _checks.check_floating(mixing, "mixing", fn_name)
  if C.ndim not in (2, 3) or C.shape[-1] != C.shape[-2] or C.ndim == 3 and C.shape[0] != N:
    raise ValueError(f"{fn_name}: `mixing` must have shape [M, M] or [N, M, M] with N = {N}, "
                     f"got {C.shape}")
  M = C.shape[-1]
  cdt = _checks.compute_dtype_of(fq, fk, v)
  C = jnp.broadcast_to(_checks.check_gate_logits(C, C.shape, fn_name, "mixing", dtype=cdt),
                       (N, M, M))
  pos = jnp.asarray(position)
  if not jnp.issubdtype(pos.dtype, jnp.integer) or pos.shape not in ((), (B,)):
    raise ValueError(f"{fn_name}: `position` must be an int or [B] = [{B}] ints, got "
                     f"{pos.shape} {pos.dtype}")
  values = concrete(pos, np.float64)
  if values is not None and not np.all((values >= 0) & (values < M * block_size)):
    raise ValueError(f"{fn_name}: `position` must lie in [0, M * block_size = "
                     f"{M * block_size}), got {values}")
  if state is None:
    state = jnp.zeros((B, N, M, F, V + 1), cdt)
  state = _checks.check_floating(state, "state", fn_name)
  if state.shape != (B, N, M, F, V + 1):
    raise ValueError(f"{fn_name}: `state` must have shape [B, N, M, K', V + 1] = "
                     f"{[B, N, M, F, V + 1]}, got {state.shape}")
  block = jnp.broadcast_to(pos // block_size, (B,))                     # i, per sequence
  here = (jnp.arange(M)[None] == block[:, None]).astype(cdt)            # [B, M] one-hot
  vv = jnp.concatenate([v.astype(cdt), jnp.ones((B, N, 1), cdt)], axis=-1)
  write = jnp.einsum("bnk,bnv->bnkv", fk.astype(cdt), vv)
  state = state.astype(cdt) + here[:, None, :, None, None] * write[:, :, None]
  row = jnp.moveaxis(jnp.take(C, block, axis=1), 1, 0)                 # [B, N, M]: c_{iβ}
  row = jnp.where(jnp.arange(M)[None, None] <= block[:, None, None], row, 0.0)    # β <= i
  out = jnp.einsum("bnk,bnm,bnmkv->bnv", fq.astype(cdt), row, state)
  o = _linear_attention.safe_divide(out[..., :-1], out[..., -1:], eps)
  inside = (jnp.broadcast_to(pos, (B,)) >= 0) & (block < M)             # traced: NaN outside
  o = jnp.where(inside[:, None, None], o, jnp.nan)
  return o.astype(dtype), state
