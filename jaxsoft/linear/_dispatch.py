"""Shared front end of the variants: common validation, layout changes and the choice of form."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxsoft.attention.differentiation import forward_mode as _forward_mode
from jaxsoft.attention.differentiation import refuse_unsupported_ad as _refuse_ad
from jaxsoft.linear import _checks, recurrence
from jaxsoft.linear import chunk as _chunk
from jaxsoft.linear.context_parallel import active as _cp_active
from jaxsoft.linear.context_parallel import states as _cp_states
from kernels_pallas import backends
from kernels_pallas import linear as pallas_linear
from kernels_pallas import sharding as pallas_sharding

__all__ = ["Call", "prepare", "prepare_step", "forward", "finish"]


@dataclasses.dataclass
class Call:
  """A validated call: ``q``, ``k``, ``v`` in ``[B, T, N, ...]`` cast to the compute dtype
  (:func:`_checks.compute_dtype_of` them: float32, float64 for float64 inputs; ``q`` not yet
  scaled: a feature map comes first), the output dtype and the resolved options."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  dtype: Any
  segment_ids: jax.Array | None
  implementation: str
  chunk_size: int
  scale: Any
  fn_name: str


def prepare(fn_name: str, q, k, v, *, scale, segment_ids, implementation,
            chunk_size, pallas: bool = False) -> Call:
  """Checks ``q, k, v``, ``segment_ids``, ``chunk_size``, ``implementation`` and ``scale``
  (``pallas``: the variant has the Pallas chunk kernels)."""
  q, k, v = _checks.check_qkv(q, k, v, fn_name)
  B, T, _, K = q.shape
  chunk_size = _checks.check_chunk_size(chunk_size, fn_name)
  impl = _checks.check_implementation(implementation, T, chunk_size, fn_name, pallas=pallas)
  seg = _checks.check_segment_ids(segment_ids, (B, T), fn_name)
  scale = _checks.resolve_scale(scale, K, fn_name)
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  cdt = _checks.compute_dtype_of(q, k, v)
  return Call(q.astype(cdt), k.astype(cdt), v.astype(cdt), dtype, seg, impl, chunk_size, scale,
              fn_name)


def forward(call: Call, q, k, v, g, beta, S0) -> tuple[jax.Array, jax.Array]:
  """Runs the chosen form on ``[B, T, N, ...]`` inputs (``q`` scaled), every one cast to the
  call's compute dtype (that of ``call.q``).

  Returns ``(o [B, T, N, V], S_T [B, N, K, V])`` in the compute dtype.
  """
  B, T = q.shape[:2]
  cdt = call.q.dtype
  to_bn = lambda x: None if x is None else jnp.moveaxis(x.astype(cdt), 1, 2)
  run = _chunk.run_ids(call.segment_ids, B, T, like=q)
  cp = _cp_active()
  if cp is not None:   # context parallel: start from this shard's incoming state
    S0, S_final = _cp_states(call, to_bn(q), to_bn(k), to_bn(v), to_bn(g), to_bn(beta), run, S0,
                             cp)
  if S0 is None:   # zeros built from the inputs: the batch sharding of an explicit mesh
    S0 = jnp.zeros_like(jnp.einsum("bnk,bnv->bnkv", k[:, 0], v[:, 0]), dtype=cdt)
  # the scans over time carry the state: it varies over every shard_map axis the inputs do
  S0 = _chunk.vary_like(S0.astype(cdt), q, k, v, g, beta, run)
  args = (to_bn(q), to_bn(k), to_bn(v), to_bn(g), to_bn(beta), run, S0)
  # forward mode (jax.jvp, jax.jacfwd) cannot pass the chunked form's custom VJP: the same
  # chunked arithmetic then runs differentiated by autodiff; the Pallas kernels refuse it,
  # and a second order (their backward is not differentiable: JAX's "Linearization failed")
  forward_mode = _forward_mode(args)
  if call.implementation == "pallas":
    _refuse_ad(args, f"{call.fn_name}: implementation='pallas'",
               "Use implementation='chunked' (the same chunked form in XLA), which "
               "supports jax.jvp, jax.jacfwd and second order.")
    o, S_T = _pallas(call, args)
  elif call.implementation == "recurrent":
    o, S_T = recurrence.recurrent(*args)
  elif call.implementation == "chunked":
    o, S_T = recurrence.chunked(*args, chunk=min(call.chunk_size, T), recompute=not forward_mode)
  else:  # parallel: one chunk holding the whole sequence
    o, S_T = recurrence.chunked(*args, chunk=T, recompute=False)
  if cp is not None:   # the last shard's end state, which every shard has from the fold
    S_T = S_final
  return jnp.moveaxis(o, 2, 1), S_T


def _pallas(call: Call, args) -> tuple[jax.Array, jax.Array]:
  """The Pallas chunk kernels (``kernels_pallas.linear``) on the driver of the default
  platform: Triton on GPUs, Mosaic on TPUs, the Triton driver in interpret mode where
  ``JAXSOFT_PALLAS_INTERPRET=1``; elsewhere NotImplementedError. The kernels compute in the
  call's compute dtype (float64 for float64 inputs: Triton and the interpreter); Mosaic has no
  float64, so float64 inputs raise ValueError there rather than computing in float32."""
  try:
    backend, interpret = backends.pick_backend(None)
  except NotImplementedError as e:
    raise NotImplementedError(f"implementation='pallas': {e}") from None
  if backend == "mosaic_tpu" and call.q.dtype == jnp.float64:
    raise ValueError(
        f"{call.fn_name}: implementation='pallas' runs the Mosaic TPU kernels, which have no "
        "float64; `q`, `k`, `v` are float64: use implementation='chunked' (float64 throughout)")
  # inputs sharded on a mesh (outside shard_map): the kernels run on each device's shard
  return pallas_linear.chunked(*args, chunk=call.chunk_size, backend=backend, interpret=interpret,
                               segments=call.segment_ids is not None,
                               layout=pallas_sharding.call_layout(call))


def finish(o: jax.Array, state: Any, dtype: Any, output_final_state: bool) -> Any:
  """``o`` in the input dtype, with the final state (in the compute dtype) when asked for."""
  o = o.astype(dtype)
  return (o, state) if output_final_state else o


def prepare_step(fn_name: str, q, k, v, state, *, scale, state_name: str = "state"):
  """Checks one decoding step: ``q, k [B, N, K]``, ``v [B, N, V]``, ``state [B, N, K, V]``
  or None (zeros). Returns ``(q, k, v, state)`` in the compute dtype
  (:func:`_checks.compute_dtype_of` ``q, k, v``), the output dtype and the scale."""
  q, k, v, shape, cdt = _checks.check_step_inputs(q, k, v, fn_name)
  K = shape[2]
  state = (jnp.zeros_like(jnp.einsum("bnk,bnv->bnkv", k, v), dtype=cdt) if state is None
           else _checks.check_state(state, shape, fn_name, state_name, dtype=cdt))
  scale = _checks.resolve_scale(scale, K, fn_name)
  dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
  return (q.astype(cdt), k.astype(cdt), v.astype(cdt), state), dtype, scale
