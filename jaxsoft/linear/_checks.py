"""Argument validation for ``jaxsoft.linear`` (every error is a ValueError naming the argument).

Layouts follow flash-linear-attention: ``q, k [B, T, N, K]``, ``v [B, T, N, V]``, scalar
gates ``[B, T, N]``, per-channel gates ``[B, T, N, K]``, ``beta [B, T, N]``, states
``[B, N, K, V]``. Gates, logits and states come back in the call's compute dtype
(:func:`compute_dtype_of` ``q, k, v``: float32, or float64 for float64 inputs). Value checks
(``g <= 0``, ``beta`` in ``[0, 2]``) run on concrete arrays only; traced values (under
``jit`` or ``grad``) are checked for shape and dtype only.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft._validation import concrete, positive_int
from jaxsoft.normalizers.common import compute_dtype, output_dtype

__all__ = [
    "IMPLEMENTATIONS",
    "check_floating",
    "compute_dtype_of",
    "check_qkv",
    "check_qkv_step",
    "check_step_inputs",
    "check_gate",
    "check_beta",
    "check_decay_and_beta",
    "check_gate_logits",
    "check_state",
    "check_optional_state",
    "check_tuple",
    "check_segment_ids",
    "check_chunk_size",
    "check_implementation",
    "check_forms",
    "check_eps",
    "check_int",
    "check_positive_number",
    "resolve_scale",
]

IMPLEMENTATIONS = ("parallel", "recurrent", "chunked", "pallas")


def check_floating(x, name: str, fn_name: str) -> jax.Array:
  """``x`` as a JAX array of a floating dtype: integers and booleans promote as
  ``jax.nn``'s inputs do (float32, float64 for 64-bit integers under x64:
  :func:`jaxsoft.normalizers.common.output_dtype`); any other dtype (complex, ...) is a
  ValueError naming the argument."""
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.floating):
    return x
  if not (jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_):
    raise ValueError(f"{fn_name}: `{name}` must be a real (floating, integer or boolean) "
                     f"array, got dtype {x.dtype}")
  return x.astype(output_dtype(x.dtype))


def compute_dtype_of(*arrays) -> jnp.dtype:
  """The dtype a variant computes in: :func:`jaxsoft.normalizers.common.compute_dtype` of
  the promoted dtype of ``arrays`` (``q, k, v``; integers and booleans count as the float
  they promote to): bf16 / fp16 widen to float32, float32 and float64 stay as they are."""
  return compute_dtype(jnp.result_type(*(output_dtype(jnp.asarray(a).dtype) for a in arrays)))


def _check_qkv(q, k, v, fn_name: str, lead: str) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``q, k [lead..., K]`` and ``v [lead..., V]`` with ``lead`` ``"B, T, N"`` or ``"B, N"``."""
  q, k, v = (check_floating(t, n, fn_name) for t, n in ((q, "q"), (k, "k"), (v, "v")))
  ndim = lead.count(",") + 2
  for t, name, last in ((q, "q", "K"), (k, "k", "K"), (v, "v", "V")):
    if t.ndim != ndim:
      raise ValueError(f"{fn_name}: `{name}` must have shape [{lead}, {last}], got {t.shape}")
  if k.shape != q.shape:
    raise ValueError(f"{fn_name}: `k` of shape {k.shape} must match `q` [{lead}, K] = {q.shape}")
  if v.shape[:-1] != q.shape[:-1]:
    raise ValueError(
        f"{fn_name}: `v` of shape {v.shape} must match `q` in [{lead}] = {q.shape[:-1]}")
  return q, k, v


def check_qkv(q, k, v, fn_name: str) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``q, k [B, T, N, K]`` and ``v [B, T, N, V]``: floating, 4-D, matching."""
  return _check_qkv(q, k, v, fn_name, "B, T, N")


def check_qkv_step(q, k, v, fn_name: str) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One decoding step: ``q, k [B, N, K]`` and ``v [B, N, V]``."""
  return _check_qkv(q, k, v, fn_name, "B, N")


def check_step_inputs(q, k, v, fn_name: str) -> tuple[jax.Array, jax.Array, jax.Array,
                                                      tuple[int, ...], Any]:
  """The start of a decoding step: ``q, k [B, N, K]`` and ``v [B, N, V]`` checked
  (:func:`check_qkv_step`), returned with their sizes ``(B, N, K, V)`` and the compute
  dtype (:func:`compute_dtype_of` ``q, k, v``)."""
  q, k, v = check_qkv_step(q, k, v, fn_name)
  return q, k, v, (*q.shape, v.shape[-1]), compute_dtype_of(q, k, v)


def check_gate(g, shape: tuple[int, ...], layout: str, fn_name: str, name: str = "g") -> jax.Array:
  """A log-space decay of the given shape, ``<= 0`` (and not NaN) where concrete."""
  g = check_floating(g, name, fn_name)
  if g.shape != tuple(shape):
    raise ValueError(f"{fn_name}: `{name}` must have shape {layout} = {list(shape)}, got {g.shape}")
  values = concrete(g, np.float64)
  if values is not None and not np.all(np.isfinite(values) & (values <= 0.0)):
    bad = values[~(np.isfinite(values) & (values <= 0.0))]
    raise ValueError(
        f"{fn_name}: `{name}` is a log decay and must be finite and <= 0 (a decay exp(g) in "
        f"(0, 1]; use segment_ids to reset the state), got {bad.ravel()[:4]}")
  return g


def check_beta(beta, shape: tuple[int, ...], fn_name: str) -> jax.Array:
  """The delta-rule write strength ``[B, T, N]`` (or ``[B, N]`` for a step), in ``[0, 2]``."""
  beta = check_floating(beta, "beta", fn_name)
  if beta.shape != tuple(shape):
    layout = "[B, T, N]" if len(shape) == 3 else "[B, N]"
    raise ValueError(f"{fn_name}: `beta` must have shape {layout} = {list(shape)}, got {beta.shape}")
  values = concrete(beta, np.float64)
  if values is not None and not np.all((values >= 0.0) & (values <= 2.0)):
    raise ValueError(
        f"{fn_name}: `beta` must lie in [0, 2] (values in (1, 2] give the transition "
        f"I - beta k k^T a negative eigenvalue), got min {np.nanmin(values)}, max "
        f"{np.nanmax(values)}" + (" and NaN" if np.any(np.isnan(values)) else ""))
  return beta


def check_decay_and_beta(g, beta, shape: tuple[int, ...], fn_name: str, *,
                         dtype) -> tuple[jax.Array | None, jax.Array | None]:
  """A backbone's optional scalar log decays ``g`` and delta-rule strengths ``beta``, both
  of ``shape`` (``[B, T, N]``, or ``[B, N]`` for a step): in ``dtype``, or None."""
  if g is not None:
    layout = "[B, T, N]" if len(shape) == 3 else "[B, N]"
    g = check_gate(g, shape, layout, fn_name).astype(dtype)
  if beta is not None:
    beta = check_beta(beta, shape, fn_name).astype(dtype)
  return g, beta


def check_gate_logits(x, shape: tuple[int, ...], fn_name: str, name: str, *,
                      dtype) -> jax.Array:
  """Real-valued gate logits (or coefficients) of the given shape, finite where concrete;
  returned in ``dtype``."""
  x = check_floating(x, name, fn_name)
  if x.shape != tuple(shape):
    raise ValueError(f"{fn_name}: `{name}` must have shape {list(shape)}, got {x.shape}")
  values = concrete(x, np.float64)
  if values is not None and not np.all(np.isfinite(values)):
    raise ValueError(f"{fn_name}: `{name}` must be finite")
  return x.astype(dtype)


def check_state(state, shape: tuple[int, ...], fn_name: str, name: str = "initial_state", *,
                dtype) -> jax.Array:
  """A state ``[B, N, K, V]``, returned in ``dtype`` (the call's compute dtype)."""
  state = check_floating(state, name, fn_name)
  if state.shape != tuple(shape):
    raise ValueError(
        f"{fn_name}: `{name}` must have shape [B, N, K, V] = {list(shape)}, got {state.shape}")
  return state.astype(dtype)


def check_optional_state(state, shape: tuple[int, ...], fn_name: str,
                         name: str = "initial_state", *, dtype) -> jax.Array | None:
  """None, or :func:`check_state`'s state in ``dtype``."""
  return None if state is None else check_state(state, shape, fn_name, name, dtype=dtype)


def check_tuple(value: Any, length: int, name: str, fn_name: str, form: str) -> None:
  """A state made of ``length`` parts (a tuple or a list); ``form`` describes it in the error."""
  if not (isinstance(value, (tuple, list)) and len(value) == length):
    raise ValueError(f"{fn_name}: `{name}` must be {form} or None")


def check_segment_ids(segment_ids, shape: tuple[int, int], fn_name: str) -> jax.Array | None:
  """``[B, T]`` integers, or None."""
  if segment_ids is None:
    return None
  seg = jnp.asarray(segment_ids)
  if not jnp.issubdtype(seg.dtype, jnp.integer):
    raise ValueError(f"{fn_name}: `segment_ids` must be an integer array, got dtype {seg.dtype}")
  if seg.shape != tuple(shape):
    raise ValueError(
        f"{fn_name}: `segment_ids` must have shape [B, T] = {list(shape)}, got {seg.shape}")
  return seg.astype(jnp.int32)


def check_chunk_size(chunk_size: Any, fn_name: str) -> int:
  """A positive int."""
  return positive_int(chunk_size, "chunk_size", fn_name)


def check_eps(eps: Any, fn_name: str) -> float:
  """A denominator floor: a Python number > 0."""
  if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
    raise ValueError(f"{fn_name}: `eps` must be a positive float, got {eps!r}")
  return float(eps)


def check_int(value: Any, name: str, fn_name: str, low: int = 0) -> int:
  """A Python or NumPy int ``>= low`` (bools refused)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
    raise ValueError(f"{fn_name}: `{name}` must be an int >= {low}, got {value!r}")
  return int(value)


def check_positive_number(value: Any, name: str, fn_name: str) -> float:
  """A static real number, finite and > 0 (bools refused)."""
  if (isinstance(value, bool) or not isinstance(value, numbers.Real)
      or not math.isfinite(value) or value <= 0):
    raise ValueError(f"{fn_name}: `{name}` must be a positive finite number, got {value!r}")
  return float(value)


def check_implementation(implementation: Any, T: int, chunk_size: int, fn_name: str,
                         pallas: bool = False) -> str:
  """``"parallel" | "recurrent" | "chunked" | "pallas"``.

  None picks the parallel form when ``T <= chunk_size`` (one chunk: the chunked form is then
  the same computation) and the chunked form above. Measured on CPU (B = 1, N = 4,
  K = V = 64), the chunked form is already 2x faster than the parallel one at T = 256
  (chunk 64), and the parallel form holds T x T (T x T x K for per-channel decays) buffers.
  None never picks ``"pallas"``. ``pallas``: whether the variant has the Pallas chunk
  kernels (scalar decays: simple_gla, lightning_attention, the delta rules); for the others
  ``"pallas"`` raises NotImplementedError.
  """
  if implementation is None:
    return "parallel" if T <= chunk_size else "chunked"
  if implementation == "pallas" and not pallas:
    raise NotImplementedError(
        f"{fn_name}: implementation='pallas' is not implemented for this variant (the Pallas "
        "kernels cover simple_gla, lightning_attention, delta_rule and gated_delta_rule); use "
        "'chunked', 'parallel' or 'recurrent'")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"{fn_name}: `implementation` must be one of {IMPLEMENTATIONS} or None, got "
        f"{implementation!r}")
  return str(implementation)


def check_forms(implementation: Any, forms: tuple[str, ...], default: str, fn_name: str) -> str:
  """``implementation`` for a variant with only some of the forms: one of ``forms``, or
  None for ``default``."""
  if implementation is None:
    return default
  if implementation not in forms:
    raise ValueError(f"{fn_name}: `implementation` must be {', '.join(map(repr, forms))} or "
                     f"None, got {implementation!r}")
  return str(implementation)


def resolve_scale(scale: Any, K: int, fn_name: str) -> Any:
  """``scale`` or the default ``K ** -0.5``."""
  if scale is None:
    return K ** -0.5
  values = concrete(scale, np.float64)
  if values is not None and (values.ndim != 0 or not np.isfinite(values)):
    raise ValueError(f"{fn_name}: `scale` must be a finite scalar, got {scale!r}")
  return scale
