"""Multi-Token Attention (feature A13): a causal 2-D convolution over the logit map, and
head mixing, so that neighbouring queries and keys shape each attention weight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxsoft.attention._checks import check_int
from jaxsoft.attention._dense import dense_logits
from jaxsoft.attention.call import AttentionCall

__all__ = ["multi_token_attention", "mta_identity_kernel"]


def mta_identity_kernel(num_heads: int, query_width: int, key_width: int,
                        dtype=jnp.float32) -> jax.Array:
  """The delta kernel of Multi-Token Attention: with it MTA is standard attention (A13).

  ``[N, c_q, c_k]``, 1 at query offset 0 and the key centre ``c_k // 2``, 0 elsewhere:
  MTA's initialisation, from which the convolution learns to mix neighbouring logits.

  Args:
    num_heads: N.
    query_width: c_q, the past queries the kernel reaches (the query itself included).
    key_width: c_k, the keys centred on j.
    dtype: of the kernel.

  Returns:
    ``[N, c_q, c_k]`` in ``dtype``.

  Examples:
    >>> kernel = js.attention.mta_identity_kernel(2, 2, 3)
    >>> kernel.shape
    (2, 2, 3)
    >>> kernel[0]
    Array([[0., 1., 0.],
           [0., 0., 0.]], dtype=float32)

  References:
    O. Golovneva, T. Wang, J. Weston & S. Sukhbaatar, 2025, "Multi-Token Attention"
    (arXiv 2504.00927).
  """
  return jnp.zeros((num_heads, query_width, key_width), dtype).at[:, 0, key_width // 2].set(1)


def _key_query_conv(x, kernel, halo: bool = False):
  """``y[b,n,i,j] = sum_{a,c} kernel[n,a,c] · x[b,n,i-a, j+c-c_k//2]`` (zero outside).

  With ``halo`` the first c_q - 1 rows of ``x`` are the rows before the first output row
  (no zero padding along the queries; c_q - 1 fewer rows come out)."""
  N, cq, ck = kernel.shape
  # lax.conv is a cross-correlation: flipping the query axis turns i + a' - (cq - 1) into
  # i - a, so the kernel reaches back over cq - 1 past queries
  w = jnp.flip(kernel, axis=1)[:, None].astype(x.dtype)  # [N, 1, cq, ck] (OIHW)
  return lax.conv_general_dilated(
      x, w, window_strides=(1, 1),
      padding=((0 if halo else cq - 1, 0), (ck // 2, ck - 1 - ck // 2)),
      dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=N,
      precision=lax.Precision.HIGHEST)


def _mix_heads(x, head_mix):
  """``x_h <- sum_{h' in group(h)} w[g, h, h'] x_h'`` for head groups of size c_h."""
  B, N, T, S = x.shape
  g, ch, _ = head_mix.shape
  xg = x.reshape(B, g, ch, T, S)
  return jnp.einsum("gij,bgjts->bgits", head_mix.astype(x.dtype), xg,
                    precision=lax.Precision.HIGHEST).reshape(B, N, T, S)


def multi_token_attention(query: ArrayLike, key: ArrayLike, value: ArrayLike, *,
                          kernel: ArrayLike, head_mix: ArrayLike | None = None,
                          head_mix_position: str = "pre", scale: float | None = None,
                          is_causal: bool = True, implementation: str = "xla",
                          block_q: int = 256) -> jax.Array:
  r"""Multi-Token Attention: neighbouring queries and keys shape each weight (A13).

  With :math:`\hat A = s\, Q K^\top` per head (``scale`` s, default 1/sqrt(H)):

  .. math::
    A = \mathrm{softmax}\big(\mathrm{Mask}_{-\infty}(\,\mathrm{Mix}(
        \mathrm{Conv}_\theta(\mathrm{Mask}_0(\hat A)))\,)\big), \qquad
    \mathrm{Conv}_\theta(X)_{ij} = \sum_{a=0}^{c_q-1}\sum_{c=0}^{c_k-1}
        \theta_{ac}\, X_{i-a,\ j+c-\lfloor c_k/2 \rfloor}

  (zero outside the map), O = A V. :math:`\mathrm{Mask}_0` zeroes the future logits
  (j > i) before the convolution, so a convolved logit (i, j) only reads pairs (i', j')
  with j' <= i' <= i: the layer stays causal; :math:`\mathrm{Mask}_{-\infty}` re-applies
  the causal mask. The head mixing Mix acts on groups of c_h consecutive heads,
  :math:`X_h \leftarrow \sum_{h' \in \mathrm{group}(h)} w_{g,h,h'} X_{h'}`, on the logits
  (``head_mix_position="pre"``) or on the weights after the softmax (``"post"``, then
  the rows need not sum to 1). A delta kernel (:func:`mta_identity_kernel`) and identity
  mixing give standard attention. The paper's GroupNorm on the head outputs is the
  caller's (it belongs to the layer, not the attention).

  From O. Golovneva, T. Wang, J. Weston, S. Sukhbaatar, "Multi-Token Attention" (2025,
  arXiv 2504.00927). ``implementation="xla"`` is dense (O(T·S) memory per head);
  ``"xla_chunked"`` loops over blocks of ``block_q`` queries, each with a halo of the
  c_q - 1 query rows before it (the convolution's reach), so the largest intermediate is
  [B, N, block_q + c_q - 1, S], also in the gradient (each block is recomputed).

  Args:
    query: [B, T, N, H]; key: [B, S, K, H]; value: [B, S, K, Hv] (GQA: N % K == 0).
    kernel: [N, c_q, c_k] per-head key-query kernel (c_q past queries including the
      query itself; c_k keys centred on j).
    head_mix: optional [N // c_h, c_h, c_h] mixing matrices (N % c_h == 0).
    head_mix_position: ``"pre"`` (logits) or ``"post"`` (weights).
    scale: logit scale; is_causal: the causal masks above (False: no masks, the
      convolution sees the whole map).
    implementation: ``"xla"`` or ``"xla_chunked"``; block_q: the chunked query block.

  Returns:
    [B, T, N, Hv] in query's dtype (computed in float32 at least: bf16 and fp16 widen, float64 stays). Differentiable in query, key, value,
    kernel and head_mix.

  Examples:
    With the delta kernel MTA is causal attention; a kernel that also reads the previous
    query's logits is computed the same by the chunked path.

    >>> q = jnp.sin(jnp.arange(64.0)).reshape(1, 4, 2, 8)   # [B, T, N, H]
    >>> k, v = jnp.cos(q), q
    >>> kernel = js.attention.mta_identity_kernel(2, 2, 3)  # [N, c_q, c_k]
    >>> out = js.attention.multi_token_attention(q, k, v, kernel=kernel)
    >>> out.shape
    (1, 4, 2, 8)
    >>> bool(jnp.allclose(out, js.attention.dot_product_attention(q, k, v, is_causal=True),
    ...                   atol=1e-6))
    True
    >>> mixed = kernel.at[:, 1, 1].set(0.5)
    >>> bool(jnp.allclose(
    ...     js.attention.multi_token_attention(q, k, v, kernel=mixed),
    ...     js.attention.multi_token_attention(q, k, v, kernel=mixed,
    ...                                        implementation="xla_chunked", block_q=2),
    ...     atol=1e-6))
    True

  References:
    O. Golovneva, T. Wang, J. Weston & S. Sukhbaatar, 2025, "Multi-Token Attention"
    (arXiv 2504.00927).
  """
  fn = "multi_token_attention"
  if jnp.ndim(query) != 4:
    raise ValueError(f"{fn}: `query` must have shape [B, T, N, H], got {jnp.shape(query)}")
  call = AttentionCall.create(query, key, value, scale=scale, is_causal=is_causal)
  B, T, N, _ = call.q.shape
  S = call.k.shape[1]
  kernel = jnp.asarray(kernel)
  if kernel.ndim != 3 or kernel.shape[0] != N or min(kernel.shape[1:]) < 1:
    raise ValueError(f"{fn}: `kernel` must have shape [N={N}, c_q, c_k], got {kernel.shape}")
  if head_mix_position not in ("pre", "post"):
    raise ValueError(f"{fn}: `head_mix_position` must be 'pre' or 'post', got {head_mix_position!r}")
  if head_mix is not None:
    head_mix = jnp.asarray(head_mix)
    if head_mix.ndim != 3 or head_mix.shape[1] != head_mix.shape[2] or (
        head_mix.shape[0] * head_mix.shape[1] != N):
      raise ValueError(
          f"{fn}: `head_mix` must have shape [N // c_h, c_h, c_h] with N={N}, got {head_mix.shape}")
  if implementation not in ("xla", "xla_chunked"):
    raise ValueError(
        f"{fn}: `implementation` must be 'xla' or 'xla_chunked', got {implementation!r}")
  check_int(block_q, "block_q", 1, fn)
  bq = T if implementation == "xla" else min(block_q, T)
  nq = -(-T // bq)
  cq = kernel.shape[1]
  cdt = jnp.promote_types(call.q.dtype, jnp.float32)
  # cq - 1 zero query rows in front (their logits are the convolution's zero padding) and
  # padding to whole blocks at the end: each block reads its rows plus a halo of cq - 1
  qp = jnp.pad(call.q.astype(cdt), ((0, 0), (cq - 1, nq * bq - T), (0, 0), (0, 0)))
  kernel = kernel.astype(cdt)
  K = call.k.shape[2]
  v = call.v.astype(cdt)

  def q_block(qi):
    start = qi * bq
    rows = lax.dynamic_slice_in_dim(qp, start, bq + cq - 1, 1)  # block + halo
    logits = dense_logits(rows, call.k, scale=call.scale)  # [B, N, bq + cq - 1, S]
    pos = start - (cq - 1) + jnp.arange(bq + cq - 1)
    if is_causal:
      logits = jnp.where(jnp.arange(S)[None, :] <= pos[:, None], logits, 0.0)
    x = _key_query_conv(logits, kernel, halo=True)  # [B, N, bq, S]
    if head_mix is not None and head_mix_position == "pre":
      x = _mix_heads(x, head_mix)
    vis = None
    if is_causal:
      vis = jnp.arange(S)[None, :] <= pos[cq - 1:, None]
      x = jnp.where(vis, x, -jnp.inf)
    w = jax.nn.softmax(x, axis=-1)
    if head_mix is not None and head_mix_position == "post":
      w = _mix_heads(w, head_mix)
      if vis is not None:
        w = jnp.where(vis, w, 0.0)
    out = jnp.einsum("bkgts,bskh->btkgh", w.reshape(B, K, N // K, bq, S), v)
    return out.reshape(B, bq, N, -1)

  if nq == 1:
    out = q_block(0)
  else:
    out = lax.map(jax.checkpoint(q_block), jnp.arange(nq))  # [nq, B, bq, N, Hv]
    out = jnp.moveaxis(out, 0, 1).reshape(B, nq * bq, N, -1)
  return out[:, :T].astype(call.q.dtype)
