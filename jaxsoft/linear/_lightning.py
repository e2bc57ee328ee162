r"""Lightning Attention / TransNormer: linear attention with a fixed decay per head.

Feature A33. The state decays by a constant ``λ_n = e^{g_n}`` per head ``n``, the same at
every token:

.. math::
  S_t = λ_n S_{t-1} + k_t v_t^\top, \qquad o_t = S_t^\top (\text{scale} \cdot q_t),

so ``o_t = scale · Σ_{j<=t} λ_n^{t-j} (q_t · k_j) v_j``: the masked softmax-free attention
``(Q K^T ⊙ M) V`` with ``M_{tj} = λ^{t-j}`` of TransNormerLLM (Qin et al. 2023,
"TransNormerLLM: A Faster and Better Large Language Model with Improved TransNormer") and
Lightning Attention (Qin et al. 2024, "Lightning Attention-2: A Free Lunch for Handling
Unlimited Sequence Lengths in Large Language Models"), whose blockwise intra-/inter-block
split is the chunked form here. It is :func:`jaxsoft.linear.simple_gla` with ``g`` constant
in time; this module only builds that ``g`` and calls the same recurrence.

The models' output normalisation (TransNormer's ``NormAttention``, an RMS norm of ``o``) and
output gate are layer choices, not part of the operator: apply them to ``o``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.linear import _checks, _gla

__all__ = ["lightning_attention", "lightning_attention_step", "lightning_decay"]


def _alibi_slopes(n: int) -> list[float]:
  """The ALiBi head slopes (Press, Smith & Lewis 2022): ``2^{-8i/n}``, i = 1..n, for a
  power of two, else those of the next lower power of two plus every other one of the
  next higher."""
  if math.log2(n).is_integer():
    start = 2.0 ** (-8.0 / n)
    return [start ** (i + 1) for i in range(n)]
  low = 2 ** math.floor(math.log2(n))
  return _alibi_slopes(low) + _alibi_slopes(2 * low)[0::2][: n - low]


def lightning_decay(num_heads: int, layer_idx: int = 0, num_layers: int = 1) -> jax.Array:
  r"""The per-head log decays ``g [N]`` of released Lightning Attention models.

  ``g_n = -s_n · (1 - l / (L - 1) + 10^{-5})`` with ``s_n`` the ALiBi slopes
  (``2^{-8n/N}``, n = 1..N, for N a power of two; Press, Smith & Lewis 2022, "Train Short,
  Test Long: Attention with Linear Biases Enables Input Length Extrapolation"), ``l`` the
  layer index and ``L`` the number of layers (``L = 1``: the factor is ``1 + 10^{-5}``).
  Lower layers decay faster; the last layer nearly not at all. This schedule is a
  reconstruction from the released code of Lightning Attention models (MiniMax 2025,
  "MiniMax-01: Scaling Foundation Models with Lightning Attention"); the TransNormerLLM
  paper states its own ``λ = exp(-8h/H · (1 - l/L))``. Pass your own ``g`` to
  :func:`lightning_attention` for another schedule.

  Args:
    num_heads: N >= 1.
    layer_idx: ``0 <= l < L``.
    num_layers: L >= 1.

  Returns:
    ``g [N]`` float32, every entry ``< 0``.

  Examples:
    >>> jnp.exp(lightning_decay(2))
    Array([0.9394, 0.9961], dtype=float32)

  References:
    O. Press, N. A. Smith & M. Lewis, 2022, "Train Short, Test Long: Attention with Linear
    Biases Enables Input Length Extrapolation".

    MiniMax, 2025, "MiniMax-01: Scaling Foundation Models with Lightning Attention".
  """
  fn_name = "lightning_decay"
  for name, value, low in (("num_heads", num_heads, 1), ("num_layers", num_layers, 1),
                           ("layer_idx", layer_idx, 0)):
    _checks.check_int(value, name, fn_name, low)
  if layer_idx >= num_layers:
    raise ValueError(
        f"{fn_name}: `layer_idx` must be < num_layers = {num_layers}, got {layer_idx}")
  return _decay(num_heads, layer_idx, num_layers, jnp.float32)


def _decay(num_heads: int, layer_idx: int, num_layers: int, dtype) -> jax.Array:
  """:func:`lightning_decay` computed in ``dtype`` (arguments checked by the caller)."""
  factor = 1.0 + 1e-5 if num_layers == 1 else 1.0 - layer_idx / (num_layers - 1) + 1e-5
  return -jnp.asarray(_alibi_slopes(int(num_heads)), dtype) * factor


def _head_decay(g, N: int, layer_idx, num_layers, fn_name: str, dtype) -> jax.Array:
  """``g [N]`` in the compute ``dtype``: the given one, or :func:`lightning_decay`'s
  schedule computed in ``dtype`` (float64 inputs get it in float64, not rounded to float32)."""
  if g is None:
    lightning_decay(N, layer_idx, num_layers)   # checks the arguments
    return _decay(N, layer_idx, num_layers, dtype)
  return _checks.check_gate(g, (N,), "[N]", fn_name).astype(dtype)


def lightning_attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike | None = None,
                        *, layer_idx: int = 0, num_layers: int = 1,
                        scale: float | None = None, initial_state: ArrayLike | None = None,
                        output_final_state: bool = False, segment_ids: ArrayLike | None = None,
                        implementation: str | None = None, chunk_size: int = 64) -> Any:
  r"""Lightning Attention / TransNormer: causal linear attention with a fixed decay per head.

  Feature A33.

  .. math::
    S_t = λ_n S_{t-1} + k_t v_t^\top, \qquad o_t = S_t^\top (\text{scale} \cdot q_t),
    \qquad λ_n = e^{g_n}

  i.e. ``o = ((Q K^T ⊙ M) V) · scale`` with ``M_{tj} = λ_n^{t-j}`` for ``j <= t`` (Qin et
  al. 2023, "TransNormerLLM"; Qin et al. 2024, "Lightning Attention-2"). Computed by
  :func:`jaxsoft.linear.simple_gla` with ``g`` broadcast over batch and time; the
  chunked form is Lightning Attention's intra-block / inter-block split.

  Args:
    q, k: ``[B, T, N, K]``.
    v: ``[B, T, N, V]``.
    g: ``[N]`` log decays ``<= 0`` (``0``: no decay, plain causal linear attention), or None:
      :func:`lightning_decay` ``(N, layer_idx, num_layers)``.
    layer_idx, num_layers: the layer's place in the stack, used only when ``g`` is None.
    scale, initial_state, output_final_state, segment_ids, implementation, chunk_size: as in
      :func:`jaxsoft.linear.simple_gla`.

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, final_state [B, N, K, V])`` (the state
    in the compute dtype: float32, float64 for float64 inputs).

  Examples:
    >>> q = k = jnp.ones((1, 3, 1, 1)); v = jnp.ones((1, 3, 1, 1))
    >>> fn = jax.jit(lightning_attention)
    >>> fn(q, k, v, jnp.log(jnp.array([0.5])))[0, :, 0, 0]
    Array([1.  , 1.5 , 1.75], dtype=float32)

    It is :func:`jaxsoft.linear.simple_gla` with the decay fixed in time (``[B, T, N, K] =
    [1, 8, 2, 4]``; ``g`` from :func:`lightning_decay`):

    >>> from jaxsoft.linear import simple_gla
    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> o = fn(q, k, v)
    >>> o.shape
    (1, 8, 2, 4)
    >>> g = jnp.broadcast_to(lightning_decay(2), (1, 8, 2))
    >>> bool(jnp.allclose(o, jax.jit(simple_gla)(q, k, v, g), atol=1e-5))
    True

  References:
    Z. Qin et al., 2023, "TransNormerLLM: A Faster and Better Large Language Model with
    Improved TransNormer".

    Z. Qin, W. Sun, D. Li, X. Shen, W. Sun & Y. Zhong, 2024, "Lightning Attention-2: A Free
    Lunch for Handling Unlimited Sequence Lengths in Large Language Models".
  """
  fn_name = "lightning_attention"
  q, k, v = _checks.check_qkv(q, k, v, fn_name)
  B, T, N, _ = q.shape
  g = jnp.broadcast_to(_head_decay(g, N, layer_idx, num_layers, fn_name,
                                   _checks.compute_dtype_of(q, k, v)), (B, T, N))
  return _gla._gated(fn_name, False, q, k, v, g, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, segment_ids=segment_ids,
                     implementation=implementation, chunk_size=chunk_size)


def lightning_attention_step(q: ArrayLike, k: ArrayLike, v: ArrayLike,
                             state: ArrayLike | None = None, *, g: ArrayLike | None = None,
                             layer_idx: int = 0, num_layers: int = 1,
                             scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  r"""One decoding step of :func:`lightning_attention`: ``S = λ S + k v^T``, ``o = S^T (scale q)``.

  Args:
    q, k: ``[B, N, K]``; v: ``[B, N, V]``.
    state: ``[B, N, K, V]`` or None (zeros).
    g, layer_idx, num_layers, scale: as in :func:`lightning_attention`.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, new_state [B, N, K, V] in the compute dtype)``.

  Examples:
    >>> o, S = lightning_attention_step(jnp.ones((1, 1, 1)), jnp.ones((1, 1, 1)),
    ...                                 jnp.ones((1, 1, 1)), jnp.ones((1, 1, 1, 1)),
    ...                                 g=jnp.log(jnp.array([0.5])))
    >>> o
    Array([[[1.5]]], dtype=float32)

  References:
    Qin et al., 2023, "TransNormerLLM"; Qin et al., 2024, "Lightning Attention-2"
    (in full: :func:`lightning_attention`).
  """
  fn_name = "lightning_attention_step"
  q, k, v = _checks.check_qkv_step(q, k, v, fn_name)
  B, N, _ = q.shape
  g = jnp.broadcast_to(_head_decay(g, N, layer_idx, num_layers, fn_name,
                                   _checks.compute_dtype_of(q, k, v)), (B, N))
  return _gla._gated_step(fn_name, False, q, k, v, g, state, scale)
