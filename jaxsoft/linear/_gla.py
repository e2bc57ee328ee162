r"""Gated linear attention: a decay per head (``simple_gla``) or per key channel (``gla``).

Feature A38. ``simple_gla`` is the scalar-decay recurrence of RetNet (Sun et al. 2023,
"Retentive Network: A Successor to Transformer for Large Language Models", with a fixed
decay) and of Lightning Attention (Qin et al. 2024, "Lightning Attention-2: A Free Lunch
for Handling Unlimited Sequence Lengths in Large Language Models"); ``gla`` is Gated
Linear Attention (Yang, Wang, Shen, Panda & Kim 2024, "Gated Linear Attention Transformers
with Hardware-Efficient Training", ICML 2024) with a data-dependent decay per key channel.
The conventions (layouts, ``scale`` applied to ``q``, the ``[K, V]`` state) are those of
flash-linear-attention's ``chunk_simple_gla`` / ``chunk_gla``.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.typing import ArrayLike

from jaxsoft.linear import _checks, _dispatch
from jaxsoft.linear import recurrence as _recurrence

__all__ = ["simple_gla", "simple_gla_step", "gla", "gla_step"]


def _gated(fn_name: str, per_channel: bool, q, k, v, g, *, scale, initial_state,
           output_final_state, segment_ids, implementation, chunk_size):
  call = _dispatch.prepare(fn_name, q, k, v, scale=scale, segment_ids=segment_ids,
                           implementation=implementation, chunk_size=chunk_size,
                           pallas=not per_channel)
  B, T, N, K = call.q.shape
  if per_channel:
    g = _checks.check_gate(g, (B, T, N, K), "[B, T, N, K]", fn_name)
  else:
    g = _checks.check_gate(g, (B, T, N), "[B, T, N]", fn_name)
  S0 = _checks.check_optional_state(initial_state, (B, N, K, call.v.shape[-1]), fn_name,
                                    dtype=call.q.dtype)
  o, S_T = _dispatch.forward(call, call.q * call.scale, call.k, call.v, g, None, S0)
  return _dispatch.finish(o, S_T, call.dtype, output_final_state)


def simple_gla(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike, *,
               scale: float | None = None, initial_state: ArrayLike | None = None,
               output_final_state: bool = False, segment_ids: ArrayLike | None = None,
               implementation: str | None = None, chunk_size: int = 64) -> Any:
  r"""Linear attention with a scalar decay per head and token (feature A38).

  .. math::
    S_t = e^{g_t} S_{t-1} + k_t v_t^\top, \qquad o_t = S_t^\top (\text{scale} \cdot q_t)

  so ``o_t = scale · Σ_{j<=t} e^{g_{j+1} + ... + g_t} (q_t · k_j) v_j``: the decayed
  causal attention of RetNet (Sun et al. 2023) and Lightning Attention (Qin et al. 2024).

  Args:
    q, k: ``[B, T, N, K]``.
    v: ``[B, T, N, V]``.
    g: ``[B, T, N]`` log decays, ``<= 0`` and finite (``exp(g)`` is the decay).
    scale: multiplies ``q``; default ``K ** -0.5``.
    initial_state: ``[B, N, K, V]`` or None (zeros).
    output_final_state: also return the final state ``[B, N, K, V]`` (in the compute dtype:
      float32, float64 for float64 inputs).
    segment_ids: ``[B, T]`` ints; the state is reset where the id changes (packed sequences).
    implementation: ``"parallel"`` (T x T per head), ``"recurrent"`` (a scan over tokens),
      ``"chunked"`` (a scan over chunks; memory O(T·K·V / chunk_size + T·chunk_size)) or
      None (parallel when T <= chunk_size, else chunked). ``"pallas"``: the chunked form
      by Pallas kernels (``kernels_pallas.linear``: Triton on GPUs, Mosaic on TPUs, the
      interpreter where ``JAXSOFT_PALLAS_INTERPRET=1``; NotImplementedError elsewhere);
      chunk_size must then be a power of two >= 16 (Triton) or a multiple of 8 (Mosaic).
    chunk_size: the chunk length of the chunked form (T need not be a multiple).

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, final_state)``.

  Examples:
    >>> q = k = jnp.ones((1, 3, 1, 2)); v = jnp.arange(3.0).reshape(1, 3, 1, 1)
    >>> g = jnp.full((1, 3, 1), jnp.log(0.5))
    >>> simple_gla(q, k, v, g, scale=1.0)[0, :, 0, 0]
    Array([0., 2., 5.], dtype=float32)

    The three forms agree (``[B, T, N, K] = [1, 8, 2, 4]``, two chunks of 4; the options
    are static under ``jax.jit``):

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> g = jnp.full((1, 8, 2), jnp.log(0.9))
    >>> fn = jax.jit(simple_gla, static_argnames=("implementation", "chunk_size"))
    >>> o = fn(q, k, v, g, implementation="recurrent")
    >>> o.shape
    (1, 8, 2, 4)
    >>> bool(jnp.allclose(o, fn(q, k, v, g, implementation="chunked", chunk_size=4), atol=1e-5))
    True

  References:
    Y. Sun, L. Dong, S. Huang, S. Ma, Y. Xia, J. Xue, J. Wang & F. Wei, 2023, "Retentive
    Network: A Successor to Transformer for Large Language Models".

    Z. Qin, W. Sun, D. Li, X. Shen, W. Sun & Y. Zhong, 2024, "Lightning Attention-2: A Free
    Lunch for Handling Unlimited Sequence Lengths in Large Language Models".
  """
  return _gated("simple_gla", False, q, k, v, g, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, segment_ids=segment_ids,
                implementation=implementation, chunk_size=chunk_size)


def gla(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike, *,
        scale: float | None = None, initial_state: ArrayLike | None = None,
        output_final_state: bool = False, segment_ids: ArrayLike | None = None,
        implementation: str | None = None, chunk_size: int = 64) -> Any:
  r"""Gated Linear Attention: a decay per head, token and key channel (feature A38).

  .. math::
    S_t = \operatorname{diag}(e^{g_t}) S_{t-1} + k_t v_t^\top, \qquad
    o_t = S_t^\top (\text{scale} \cdot q_t)

  (Yang, Wang, Shen, Panda & Kim 2024, "Gated Linear Attention Transformers with
  Hardware-Efficient Training"). The intra-chunk scores ``Σ_c q_ic k_jc e^{G_ic - G_jc}``
  are built by that paper's secondary chunking, applied recursively: the chunk is halved,
  the pairs across the halves are one matmul of queries and keys decayed to the second
  half's first token (every exponent ``<= 0``), and each half is split again. No
  ``[chunk, chunk, K]`` tensor is formed: the chunked form's memory is
  O(T·chunk_size + T·K·log(chunk_size) + T·K·V / chunk_size) and the parallel form holds
  ``[T, T]`` per head, as for :func:`simple_gla`.

  Args:
    q, k: ``[B, T, N, K]``.
    v: ``[B, T, N, V]``.
    g: ``[B, T, N, K]`` log decays, ``<= 0`` and finite.
    scale, initial_state, output_final_state, segment_ids, implementation, chunk_size: as in
      :func:`simple_gla` (but ``"pallas"`` raises NotImplementedError: the kernels take
      one decay per head).

  Returns:
    ``o [B, T, N, V]`` in the inputs' dtype, or ``(o, final_state)``.

  Examples:
    >>> q = k = jnp.ones((1, 2, 1, 2)); v = jnp.ones((1, 2, 1, 1))
    >>> g = jnp.log(jnp.array([[[[1.0, 0.5]], [[1.0, 0.5]]]]))   # channel 2 halves
    >>> o, S = gla(q, k, v, g, scale=1.0, output_final_state=True)
    >>> S[0, 0, :, 0]
    Array([2. , 1.5], dtype=float32)

    One decay shared by the channels is :func:`simple_gla` (``[B, T, N, K] = [1, 8, 2, 4]``):

    >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 2, 4))
    >>> g_head = jax.nn.log_sigmoid(jax.random.normal(jax.random.key(1), (1, 8, 2)))
    >>> o = jax.jit(gla)(q, k, v, jnp.repeat(g_head[..., None], 4, axis=-1))
    >>> o.shape
    (1, 8, 2, 4)
    >>> bool(jnp.allclose(o, jax.jit(simple_gla)(q, k, v, g_head), atol=1e-5))
    True

  References:
    S. Yang, B. Wang, Y. Shen, R. Panda & Y. Kim, 2024, "Gated Linear Attention Transformers
    with Hardware-Efficient Training".
  """
  return _gated("gla", True, q, k, v, g, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, segment_ids=segment_ids,
                implementation=implementation, chunk_size=chunk_size)


def _gated_step(fn_name: str, per_channel: bool, q, k, v, g, state, scale):
  (q, k, v, S), dtype, scale = _dispatch.prepare_step(fn_name, q, k, v, state, scale=scale)
  B, N, K = q.shape
  if per_channel:
    g = _checks.check_gate(g, (B, N, K), "[B, N, K]", fn_name)
  else:
    g = _checks.check_gate(g, (B, N), "[B, N]", fn_name)
  o, S = _recurrence.step(S, q * scale, k, v, g.astype(q.dtype), None)
  return o.astype(dtype), S


def simple_gla_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike,
                    state: ArrayLike | None = None, *,
                    scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  r"""One decoding step of :func:`simple_gla`: ``S = e^g S + k v^T``, ``o = S^T (scale q)``.

  Args:
    q, k: ``[B, N, K]``; v: ``[B, N, V]``; g: ``[B, N]`` log decays (``<= 0``).
    state: ``[B, N, K, V]`` or None (zeros).
    scale: default ``K ** -0.5``.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, new_state [B, N, K, V] in the compute dtype)``.

  Examples:
    >>> o, S = simple_gla_step(jnp.ones((1, 1, 2)), jnp.ones((1, 1, 2)), jnp.ones((1, 1, 1)),
    ...                        jnp.zeros((1, 1)), scale=1.0)
    >>> o
    Array([[[2.]]], dtype=float32)

  References:
    Sun et al., 2023, "Retentive Network"; Qin et al., 2024, "Lightning Attention-2"
    (in full: :func:`simple_gla`).
  """
  return _gated_step("simple_gla_step", False, q, k, v, g, state, scale)


def gla_step(q: ArrayLike, k: ArrayLike, v: ArrayLike, g: ArrayLike,
             state: ArrayLike | None = None, *,
             scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  r"""One decoding step of :func:`gla`: ``S = diag(e^g) S + k v^T``, ``o = S^T (scale q)``.

  Args:
    q, k: ``[B, N, K]``; v: ``[B, N, V]``; g: ``[B, N, K]`` log decays (``<= 0``).
    state: ``[B, N, K, V]`` or None (zeros).
    scale: default ``K ** -0.5``.

  Returns:
    ``(o [B, N, V] in the inputs' dtype, new_state [B, N, K, V] in the compute dtype)``.

  Examples:
    >>> S = jnp.ones((1, 1, 2, 1))
    >>> o, S = gla_step(jnp.ones((1, 1, 2)), jnp.zeros((1, 1, 2)), jnp.zeros((1, 1, 1)),
    ...                 jnp.log(jnp.array([[[1.0, 0.5]]])), S, scale=1.0)
    >>> S[0, 0, :, 0]
    Array([1. , 0.5], dtype=float32)

  References:
    Yang et al., 2024, "Gated Linear Attention Transformers" (in full: :func:`gla`).
  """
  return _gated_step("gla_step", True, q, k, v, g, state, scale)
