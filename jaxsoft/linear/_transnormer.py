r"""TransNormerLLM's parts around Lightning Attention: LRPE, SRMSNorm and the LRPE-d attention.

Feature A33 (Qin et al. 2023, "TransNormerLLM: A Faster and Better Large Language Model with
Improved TransNormer"). The decay alone is :func:`jaxsoft.linear.lightning_attention`; this
module adds

* LRPE, the linearised relative positional encoding (Qin et al. 2022, "The Devil in Linear
  Transformer"): token ``p``'s query or key is rotated by the unitary ``diag(e^{iθ p})``,
  written in real numbers by doubling the channels,
  ``lrpe(x)_p = [x_p ⊙ cos(θ p), x_p ⊙ sin(θ p)]``, so that
  ``lrpe(q)_i · lrpe(k)_j = Σ_c q_{ic} k_{jc} cos(θ_c (i - j))``: the product depends on the
  positions through ``i - j`` only, and the rotated keys still factor through a linear
  state.
* LRPE-d, LRPE together with the exponential decay (:func:`transnormer_attention`):
  ``o_i = scale · Σ_{j <= i} λ_n^{i-j} Σ_c q_{ic} k_{jc} cos(θ_c (i - j)) v_j``.
* SRMSNorm, the simple RMS norm without a learned scale: ``x / sqrt(mean(x²) + eps)``.

The gated layer (``O = SRMSNorm(attention) ⊙ U`` with ``U = X W_u``, then ``W_o``) is the
``"transnormer"`` kind of :class:`jaxsoft.nn.LinearMixer`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jaxsoft._validation import concrete
from jaxsoft.linear import _checks
from jaxsoft.linear._lightning import lightning_attention, lightning_attention_step
from jaxsoft.normalizers.common import compute_dtype, output_dtype

__all__ = ["lrpe", "lrpe_theta", "srms_norm", "transnormer_attention",
           "transnormer_attention_step"]


def lrpe_theta(num_heads: int, head_dim: int, base: float = 10000.0) -> jax.Array:
  r"""The starting LRPE angles ``θ [N, K]`` of TransNormerLLM.

  ``θ_{n, c} = base^{-2 (n K + c) / (N K)}``: one geometric ladder over all ``N·K``
  channels of the layer, cut into heads (so each head gets its own frequencies). The paper
  learns ``θ``; this starting schedule is [R], reconstructed from the released
  TransNormerLLM code (the paper does not state it).

  Args:
    num_heads: N >= 1.
    head_dim: K >= 1.
    base: the ladder's base, a positive finite number (10000).

  Returns:
    ``θ [N, K]`` float32, in ``(0, 1]``.

  Examples:
    >>> lrpe_theta(2, 2, base=16.0)  # 16^0, 16^(-1/2), 16^(-1), 16^(-3/2)
    Array([[1.    , 0.25  ],
           [0.0625, 0.0156]], dtype=float32)

  References:
    Z. Qin et al., 2023, "TransNormerLLM: A Faster and Better Large Language Model with
    Improved TransNormer".
  """
  fn_name = "lrpe_theta"
  n = _checks.check_int(num_heads, "num_heads", fn_name, 1)
  k = _checks.check_int(head_dim, "head_dim", fn_name, 1)
  base = _checks.check_positive_number(base, "base", fn_name)
  exponent = -2.0 * np.arange(n * k, dtype=np.float64) / (n * k)
  return jnp.asarray((base ** exponent).reshape(n, k), jnp.float32)


def _positions(positions, B: int, T: int, fn_name: str, dtype) -> jax.Array:
  """``[B or 1, T, 1, 1]`` in ``dtype``: ``arange(T)``, or the given scalar / ``[T]`` /
  ``[B, T]`` positions."""
  if positions is None:
    return jnp.arange(T, dtype=dtype).reshape(1, T, 1, 1)
  p = jnp.asarray(positions)
  if not (jnp.issubdtype(p.dtype, jnp.integer) or jnp.issubdtype(p.dtype, jnp.floating)):
    raise ValueError(f"{fn_name}: `positions` must be an integer or floating array, got "
                     f"dtype {p.dtype}")
  if p.ndim == 0:
    p = jnp.broadcast_to(p, (T,))
  if p.shape == (T,):
    return p.astype(dtype).reshape(1, T, 1, 1)
  if p.shape == (B, T):
    return p.astype(dtype).reshape(B, T, 1, 1)
  raise ValueError(f"{fn_name}: `positions` must be a scalar or have shape [T] = [{T}] or "
                   f"[B, T] = [{B}, {T}], got {p.shape}")


def _theta(theta, N: int, K: int, fn_name: str, dtype) -> jax.Array:
  """``[1, 1, N or 1, K]`` in ``dtype``: the given ``[N, K]`` / ``[K]`` angles or
  :func:`lrpe_theta`."""
  if theta is None:
    return lrpe_theta(N, K).astype(dtype).reshape(1, 1, N, K)
  theta = _checks.check_floating(theta, "theta", fn_name)
  if theta.shape not in ((N, K), (K,)):
    raise ValueError(f"{fn_name}: `theta` must have shape [N, K] = [{N}, {K}] or [K] = [{K}], "
                     f"got {theta.shape}")
  values = concrete(theta, np.float64)
  if values is not None and not np.all(np.isfinite(values)):
    raise ValueError(f"{fn_name}: `theta` must be finite")
  return theta.astype(dtype).reshape(1, 1, *((N, K) if theta.ndim == 2 else (1, K)))


def _lrpe(x, theta, positions, fn_name: str, dtype) -> jax.Array:
  """LRPE of ``x [B, T, N, K]`` in ``dtype`` (checked arguments)."""
  B, T, N, K = x.shape
  angle = _theta(theta, N, K, fn_name, dtype) * _positions(positions, B, T, fn_name, dtype)
  x = x.astype(dtype)
  return jnp.concatenate([x * jnp.cos(angle), x * jnp.sin(angle)], axis=-1)


def lrpe(x: ArrayLike, theta: ArrayLike | None = None, *,
         positions: ArrayLike | None = None) -> jax.Array:
  r"""LRPE, the linearised relative positional encoding of TransNormer, applied to q or k.

  Feature A33. Token ``p``'s vector is multiplied by the unitary ``diag(e^{iθ p})``; in
  real numbers the channels double:

  .. math::
    \mathrm{lrpe}(x)_p = [x_p \odot \cos(θ p),\; x_p \odot \sin(θ p)], \qquad
    \mathrm{lrpe}(q)_i \cdot \mathrm{lrpe}(k)_j = \sum_c q_{ic} k_{jc} \cos(θ_c (i - j)),

  so a query-key product depends on the two positions only through ``i - j`` (shifting
  every position by the same amount changes nothing), and ``θ = 0`` gives back
  ``q_i · k_j``. Apply it to both ``q`` and ``k`` (with the same ``θ``) before any linear
  attention of :mod:`jaxsoft.linear`; :func:`transnormer_attention` does so with
  Lightning Attention's decay.

  Args:
    x: ``[B, T, N, K]`` queries or keys.
    theta: the angles ``[N, K]`` (one per head and channel) or ``[K]`` (shared by the
      heads); None: :func:`lrpe_theta` ``(N, K)``.
    positions: each token's position: None (``0 .. T-1``), a scalar (every token at it: a
      decoding step), ``[T]`` or ``[B, T]``.

  Returns:
    ``[B, T, N, 2K]`` in ``x``'s dtype (computed in float32 for bf16 / fp16, float64
    stays float64).

  Examples:
    >>> x = jnp.ones((1, 3, 1, 1))
    >>> lrpe(x, jnp.array([jnp.pi / 3]))[0, :, 0]  # [cos(θ p), sin(θ p)], p = 0, 1, 2
    Array([[ 1.   ,  0.   ],
           [ 0.5  ,  0.866],
           [-0.5  ,  0.866]], dtype=float32)

    The product of a rotated query and key depends on ``i - j`` only (``[B, T, N, K] =
    [1, 5, 2, 4]``):

    >>> q, k = jax.random.normal(jax.random.key(0), (2, 1, 5, 2, 4))
    >>> q = k = jnp.broadcast_to(q[:, :1], q.shape)  # the same vector at every position
    >>> s = jnp.einsum("bink,bjnk->bnij", lrpe(q), lrpe(k))[0, 0]
    >>> bool(jnp.allclose(s[1, 0], s[4, 3])), bool(jnp.allclose(s[0, 1], s[3, 4]))
    (True, True)

  References:
    Z. Qin, W. Sun, H. Deng, D. Li, Y. Wei, B. Lv, J. Yan, L. Kong & Y. Zhong, 2022, "The
    Devil in Linear Transformer".

    Z. Qin et al., 2023, "TransNormerLLM: A Faster and Better Large Language Model with
    Improved TransNormer".
  """
  fn_name = "lrpe"
  x = _checks.check_floating(x, "x", fn_name)
  if x.ndim != 4:
    raise ValueError(f"{fn_name}: `x` must have shape [B, T, N, K], got {x.shape}")
  return _lrpe(x, theta, positions, fn_name, compute_dtype(x.dtype)).astype(x.dtype)


def srms_norm(x: ArrayLike, *, axis: int = -1, eps: float = 1e-6) -> jax.Array:
  r"""SRMSNorm, TransNormerLLM's simple RMS norm: no learned scale, no centring.

  Feature A33.

  .. math::
    \mathrm{SRMSNorm}(x) = \frac{x}{\sqrt{\frac1d \sum_i x_i^2 + ε}}
    \;\; (= x / (\lVert x \rVert_2 / \sqrt d) \text{ for } ε = 0)

  Invariant to a positive rescaling of ``x`` (up to ``ε``), the output's mean square is
  ``mean(x²) / (mean(x²) + ε) <= 1``.

  Args:
    x: any real array.
    axis: the axis normalised (the last).
    eps: ``ε > 0`` added to the mean square.

  Returns:
    The normalised ``x``, same shape and dtype (computed in float32 for bf16 / fp16).

  Examples:
    >>> srms_norm(jnp.array([3.0, 4.0]), eps=1e-12)  # ‖x‖ = 5, d = 2
    Array([0.8485, 1.1314], dtype=float32)

  References:
    Z. Qin et al., 2023, "TransNormerLLM: A Faster and Better Large Language Model with
    Improved TransNormer".
  """
  fn_name = "srms_norm"
  x = _checks.check_floating(x, "x", fn_name)
  eps = _checks.check_eps(eps, fn_name)
  if isinstance(axis, bool) or not isinstance(axis, int) or not -max(x.ndim, 1) <= axis < x.ndim:
    raise ValueError(f"{fn_name}: `axis` must be an int in [-{x.ndim}, {x.ndim}), got {axis!r}")
  x32 = x.astype(compute_dtype(x.dtype))
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axis, keepdims=True) + eps)
          ).astype(x.dtype)


def transnormer_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike | None = None,
                          theta: ArrayLike | None = None, *, positions: ArrayLike | None = None,
                          layer_idx: int = 0, num_layers: int = 1, scale: float | None = None,
                          initial_state: ArrayLike | None = None,
                          output_final_state: bool = False,
                          segment_ids: ArrayLike | None = None,
                          implementation: str | None = None, chunk_size: int = 64) -> Any:
  r"""TransNormerLLM's LRPE-d attention: Lightning Attention on LRPE-rotated queries and keys.

  Feature A33.

  .. math::
    o_i = \text{scale} \sum_{j \le i} λ_n^{i-j} \sum_c q_{ic} k_{jc} \cos(θ_c (i - j))\, v_j,
    \qquad λ_n = e^{g_n},

  i.e. :func:`jaxsoft.linear.lightning_attention` of :func:`lrpe` ``(q)``, :func:`lrpe`
  ``(k)`` (state ``[B, N, 2K, V]``): the decay handles attention dilution, the rotation
  relative positions, and the whole is still linear (parallel, recurrent, chunked or Pallas
  forms). ``θ = 0`` is Lightning Attention itself. The weights depend on ``i - j``, so
  packed sequences (``segment_ids``) need no position reset: each segment's output is the
  one it has alone.

  Args:
    q, k: ``[B, T, N, K]``.
    v: ``[B, T, N, V]``.
    g: ``[N]`` log decays ``<= 0``, or None: :func:`jaxsoft.linear.lightning_decay`
      ``(N, layer_idx, num_layers)``.
    theta: LRPE's angles ``[N, K]`` or ``[K]``; None: :func:`lrpe_theta` ``(N, K)``.
    positions: as in :func:`lrpe` (None: ``0 .. T-1``; decoding after a prefix: offset them).
    layer_idx, num_layers: the depth, used only when ``g`` is None.
    scale: multiplies ``q`` (default ``K^{-1/2}`` of the un-doubled ``K``).
    initial_state: ``[B, N, 2K, V]`` or None.
    output_final_state, segment_ids, implementation, chunk_size: as in
      :func:`jaxsoft.linear.lightning_attention`.

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, final_state [B, N, 2K, V])`` (the
    state in the compute dtype).

  Examples:
    >>> from jaxsoft.linear import lightning_attention
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 6, 2, 4))
    >>> o = jax.jit(transnormer_attention)(q, k, v)
    >>> o.shape
    (1, 6, 2, 4)
    >>> theta0 = jnp.zeros((2, 4))  # no rotation: Lightning Attention
    >>> bool(jnp.allclose(transnormer_attention(q, k, v, theta=theta0),
    ...                   lightning_attention(q, k, v), atol=1e-5))
    True

  References:
    Z. Qin et al., 2023, "TransNormerLLM: A Faster and Better Large Language Model with
    Improved TransNormer".

    Z. Qin, W. Sun, H. Deng, D. Li, Y. Wei, B. Lv, J. Yan, L. Kong & Y. Zhong, 2022, "The
    Devil in Linear Transformer".
  """
  fn_name = "transnormer_attention"
  q, k, v = _checks.check_qkv(q, k, v, fn_name)
  dtype = _checks.compute_dtype_of(q, k, v)
  scale = _checks.resolve_scale(scale, q.shape[-1], fn_name)
  qr, kr = (_lrpe(x, theta, positions, fn_name, dtype) for x in (q, k))
  out = lightning_attention(qr, kr, v.astype(dtype), g, layer_idx=layer_idx,
                            num_layers=num_layers, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, segment_ids=segment_ids,
                            implementation=implementation, chunk_size=chunk_size)
  result = jnp.result_type(*(output_dtype(t.dtype) for t in (q, k, v)))
  if output_final_state:
    return out[0].astype(result), out[1]
  return out.astype(result)


def transnormer_attention_step(q: ArrayLike, k: ArrayLike, v: ArrayLike,
                               state: ArrayLike | None = None, *, position: ArrayLike = 0,
                               g: ArrayLike | None = None, theta: ArrayLike | None = None,
                               layer_idx: int = 0, num_layers: int = 1,
                               scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  r"""One decoding step of :func:`transnormer_attention` at ``position``.

  ``S = λ S + lrpe(k) v^T``, ``o = S^T (scale · lrpe(q))``, both rotated by ``θ · position``.

  Args:
    q, k: ``[B, N, K]``; v: ``[B, N, V]``.
    state: ``[B, N, 2K, V]`` or None (zeros).
    position: the token's position, a scalar or ``[B]``.
    g, theta, layer_idx, num_layers, scale: as in :func:`transnormer_attention`.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, new_state [B, N, 2K, V] in the compute dtype)``.

  Examples:
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 3, 2, 4))
    >>> o, state = None, None
    >>> for t in range(3):
    ...   o, state = transnormer_attention_step(q[:, t], k[:, t], v[:, t], state, position=t)
    >>> state.shape
    (1, 2, 8, 4)
    >>> bool(jnp.allclose(o, transnormer_attention(q, k, v)[:, -1], atol=1e-5))
    True

  References:
    Z. Qin et al., 2023, "TransNormerLLM" (in full: :func:`transnormer_attention`).
  """
  fn_name = "transnormer_attention_step"
  q, k, v = _checks.check_qkv_step(q, k, v, fn_name)
  dtype = _checks.compute_dtype_of(q, k, v)
  B = q.shape[0]
  position = jnp.asarray(position)
  if position.shape not in ((), (B,)):
    raise ValueError(f"{fn_name}: `position` must be a scalar or have shape [B] = [{B}], got "
                     f"{position.shape}")
  positions = jnp.broadcast_to(position, (B,)).reshape(B, 1)
  scale = _checks.resolve_scale(scale, q.shape[-1], fn_name)
  qr, kr = (_lrpe(x[:, None], theta, positions, fn_name, dtype)[:, 0] for x in (q, k))
  o, state = lightning_attention_step(qr, kr, v.astype(dtype), state, g=g, layer_idx=layer_idx,
                                      num_layers=num_layers, scale=scale)
  return o.astype(jnp.result_type(*(output_dtype(t.dtype) for t in (q, k, v)))), state
