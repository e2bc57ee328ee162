"""Argument validation for ``jaxsoft.linear`` (every error is a ValueError naming the argument).

Layouts follow flash-linear-attention: ``q, k [B, T, N, K]``, ``v [B, T, N, V]``, scalar
gates ``[B, T, N]``, per-channel gates ``[B, T, N, K]``, ``beta [B, T, N]``, states
``[B, N, K, V]``. Value checks (``g <= 0``, ``beta`` in ``[0, 2]``) run on concrete arrays
only; traced values (under ``jit`` or ``grad``) are checked for shape and dtype only.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "IMPLEMENTATIONS",
    "check_qkv",
    "check_qkv_step",
    "check_gate",
    "check_beta",
    "check_gate_logits",
    "check_state",
    "check_segment_ids",
    "check_chunk_size",
    "check_implementation",
    "resolve_scale",
]

IMPLEMENTATIONS = ("parallel", "recurrent", "chunked", "pallas")

def _concrete(x) -> np.ndarray | None:
  """``x`` as a float64 numpy array, or None when it is traced."""
  try:
    return np.asarray(x, dtype=np.float64)
  except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return None


def _floating(x, name: str, fn_name: str) -> jax.Array:
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{fn_name}: `{name}` must be a floating array, got dtype {x.dtype}")
  return x


def check_qkv(q, k, v, fn_name: str) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``q, k [B, T, N, K]`` and ``v [B, T, N, V]``: floating, 4-D, matching."""
  q, k, v = (_floating(t, n, fn_name) for t, n in ((q, "q"), (k, "k"), (v, "v")))
  for t, name, last in ((q, "q", "K"), (k, "k", "K"), (v, "v", "V")):
    if t.ndim != 4:
      raise ValueError(f"{fn_name}: `{name}` must have shape [B, T, N, {last}], got {t.shape}")
  if k.shape != q.shape:
    raise ValueError(
        f"{fn_name}: `k` of shape {k.shape} must match `q` [B, T, N, K] = {q.shape}")
  if v.shape[:3] != q.shape[:3]:
    raise ValueError(
        f"{fn_name}: `v` of shape {v.shape} must match `q` in [B, T, N] = {q.shape[:3]}")
  return q, k, v


def check_qkv_step(q, k, v, fn_name: str) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One decoding step: ``q, k [B, N, K]`` and ``v [B, N, V]``."""
  q, k, v = (_floating(t, n, fn_name) for t, n in ((q, "q"), (k, "k"), (v, "v")))
  for t, name, last in ((q, "q", "K"), (k, "k", "K"), (v, "v", "V")):
    if t.ndim != 3:
      raise ValueError(f"{fn_name}: `{name}` must have shape [B, N, {last}], got {t.shape}")
  if k.shape != q.shape:
    raise ValueError(f"{fn_name}: `k` of shape {k.shape} must match `q` [B, N, K] = {q.shape}")
  if v.shape[:2] != q.shape[:2]:
    raise ValueError(f"{fn_name}: `v` of shape {v.shape} must match `q` in [B, N] = {q.shape[:2]}")
  return q, k, v


def check_gate(g, shape: tuple[int, ...], layout: str, fn_name: str, name: str = "g") -> jax.Array:
  """A log-space decay of the given shape, ``<= 0`` (and not NaN) where concrete."""
  g = _floating(g, name, fn_name)
  if g.shape != tuple(shape):
    raise ValueError(f"{fn_name}: `{name}` must have shape {layout} = {list(shape)}, got {g.shape}")
  values = _concrete(g)
  if values is not None and not np.all(np.isfinite(values) & (values <= 0.0)):
    bad = values[~(np.isfinite(values) & (values <= 0.0))]
    raise ValueError(
        f"{fn_name}: `{name}` is a log decay and must be finite and <= 0 (a decay exp(g) in "
        f"(0, 1]; use segment_ids to reset the state), got {bad.ravel()[:4]}")
  return g


def check_beta(beta, shape: tuple[int, ...], fn_name: str) -> jax.Array:
  """The delta-rule write strength ``[B, T, N]`` (or ``[B, N]`` for a step), in ``[0, 2]``."""
  beta = _floating(beta, "beta", fn_name)
  if beta.shape != tuple(shape):
    layout = "[B, T, N]" if len(shape) == 3 else "[B, N]"
    raise ValueError(f"{fn_name}: `beta` must have shape {layout} = {list(shape)}, got {beta.shape}")
  values = _concrete(beta)
  if values is not None and not np.all((values >= 0.0) & (values <= 2.0)):
    raise ValueError(
        f"{fn_name}: `beta` must lie in [0, 2] (values in (1, 2] give the transition "
        f"I - beta k k^T a negative eigenvalue), got min {np.nanmin(values)}, max "
        f"{np.nanmax(values)}" + (" and NaN" if np.any(np.isnan(values)) else ""))
  return beta


def check_gate_logits(x, shape: tuple[int, ...], fn_name: str, name: str) -> jax.Array:
  """Real-valued gate logits (or coefficients) of the given shape, finite where concrete;
  float32 is returned."""
  x = _floating(x, name, fn_name)
  if x.shape != tuple(shape):
    raise ValueError(f"{fn_name}: `{name}` must have shape {list(shape)}, got {x.shape}")
  values = _concrete(x)
  if values is not None and not np.all(np.isfinite(values)):
    raise ValueError(f"{fn_name}: `{name}` must be finite")
  return x.astype(jnp.float32)


def check_state(state, shape: tuple[int, ...], fn_name: str,
                name: str = "initial_state") -> jax.Array:
  """A state ``[B, N, K, V]`` (float32 is returned)."""
  state = _floating(state, name, fn_name)
  if state.shape != tuple(shape):
    raise ValueError(
        f"{fn_name}: `{name}` must have shape [B, N, K, V] = {list(shape)}, got {state.shape}")
  return state.astype(jnp.float32)


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
  if (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
      or chunk_size < 1):
    raise ValueError(f"{fn_name}: `chunk_size` must be a positive int, got {chunk_size!r}")
  return int(chunk_size)


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


def resolve_scale(scale: Any, K: int, fn_name: str) -> Any:
  """``scale`` or the default ``K ** -0.5``."""
  if scale is None:
    return K ** -0.5
  values = _concrete(scale)
  if values is not None and (values.ndim != 0 or not np.isfinite(values)):
    raise ValueError(f"{fn_name}: `scale` must be a finite scalar, got {scale!r}")
  return scale
