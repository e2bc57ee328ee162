"""tokamax's attention kernel as an optional implementation of plain softmax attention.

``implementation="tokamax"`` hands a softmax call to :func:`tokamax.dot_product_attention`
(an optional dependency: ``pip install 'jaxsoft[tokamax]'``, which needs Python >= 3.12 and
JAX >= 0.11.1; it is never a base dependency). On a CUDA GPU that is tokamax's Mosaic-GPU
flash-attention kernel (FlashAttention-3 structured on Hopper, with its own backward);
on a CPU its XLA implementation, which keeps the adapter (argument mapping, masks,
gradients) testable without a GPU. On a CUDA GPU the automatic order tries it after
cuDNN, for the calls cuDNN refuses, and skips it silently where tokamax is not importable.

What it computes is jaxsoft's softmax attention, exactly as the dense path defines it:

.. math::
  o_i = \\sum_{j \\in V_i} \\frac{e^{\\ell_{ij}}}{\\sum_{k \\in V_i} e^{\\ell_{ik}}} v_j,
  \\qquad \\ell_{ij} = c \\tanh(s\\, q_i \\cdot k_j / c) + \\mathrm{bias}_{ij}

with a row whose V_i is empty set to zeros (tokamax, like jax.nn, averages the values
there; the adapter zeroes those rows, and their gradient with them). Calls where tokamax
computes something else are refused with NotImplementedError (the dispatcher then tries
the next implementation): another normalizer or ``normalizer_params``, ``segment_ids``,
``decay_bias``, a score other than the dot product, ``return_residual``, a soft cap
together with a bias (tokamax caps ``s q.k + bias``, jaxsoft caps ``s q.k`` before the
bias), a traced ``scale``, mixed or float64 dtypes.

References:
  T. Dao, 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
  Partitioning", arXiv:2307.08691; J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar,
  P. Ramani & T. Dao, 2024, "FlashAttention-3: Fast and Accurate Attention with
  Asynchrony and Low-precision", arXiv:2407.08608 (the kernel tokamax ships for Hopper).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxsoft.attention.call import AttentionCall
from jaxsoft.normalizers import spec as _spec

__all__ = ["tokamax_module", "tokamax_kernel", "run_tokamax", "run_tokamax_auto"]

INSTALL_HINT = ("pip install 'jaxsoft[tokamax]' (tokamax needs Python >= 3.12 and "
                "JAX >= 0.11.1)")


@functools.lru_cache(maxsize=1)
def tokamax_module() -> Any:
  """The ``tokamax`` module, or None where it is not installed or does not import (an
  older JAX or Python than it needs).

  Examples:
    >>> from jaxsoft.attention._tokamax import tokamax_module
    >>> tokamax_module() is None or hasattr(tokamax_module(), "dot_product_attention")
    True
  """
  try:
    import tokamax  # optional: imported on first use only
  except Exception:  # noqa: BLE001 - ImportError, or an incompatible JAX failing its import
    return None
  return tokamax if hasattr(tokamax, "dot_product_attention") else None


def tokamax_kernel(platform: str | None = None) -> str:
  """tokamax's ``implementation=`` name that ``implementation="tokamax"`` runs on
  ``platform`` (default: JAX's default backend): ``"mosaic_gpu"`` (its Mosaic-GPU kernel) on
  a CUDA GPU, ``"xla"`` (its XLA reference) on a CPU; NotImplementedError elsewhere.

  Examples:
    >>> from jaxsoft.attention._tokamax import tokamax_kernel
    >>> tokamax_kernel("gpu"), tokamax_kernel("cpu")
    ('mosaic_gpu', 'xla')
  """
  platform = jax.default_backend() if platform is None else platform
  if platform in ("gpu", "cuda"):
    return "mosaic_gpu"
  if platform == "cpu":
    return "xla"
  raise NotImplementedError(f"tokamax is wired here for CUDA GPUs (and CPU), not {platform!r}")


def _check_call(call: AttentionCall) -> None:
  """NotImplementedError naming what tokamax would compute differently."""
  spec = call.spec
  if not (isinstance(spec, _spec.NormalizerSpec) and spec.name == "softmax" and not call.params):
    raise NotImplementedError("tokamax computes softmax attention only (no normalizer_params)")
  if call.score != "dot":
    raise NotImplementedError(f"tokamax computes dot-product scores only, not "
                              f"score={call.score!r}")
  unsupported = [name for name, value in (
      ("segment_ids", call.segment_ids), ("decay_bias", call.decay_bias)) if value is not None]
  if call.return_residual:
    unsupported.append("return_residual")
  if unsupported:
    raise NotImplementedError(f"tokamax does not take {', '.join(unsupported)}")
  if call.logits_soft_cap is not None and call.bias is not None:
    raise NotImplementedError(
        "tokamax soft-caps the logits after adding the bias (jaxsoft caps them before): "
        "`logits_soft_cap` with a `bias`")
  if not call.q.dtype == call.k.dtype == call.v.dtype:
    raise NotImplementedError("tokamax needs one dtype for q, k and v")
  if call.q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    raise NotImplementedError(f"tokamax computes float32, bfloat16 and float16, not "
                              f"{call.q.dtype}")
  if not isinstance(call.scale, float):
    raise NotImplementedError("tokamax needs a concrete Python float `scale`")


def _rows_with_a_key(call: AttentionCall):
  """Whether each query row sees a key, bool [B, T, N] (broadcastable): the structure's
  visible count (causal, window, lengths) and, with a dense mask, any visible entry."""
  b, t, n = call.q.shape[:3]
  count = call.structure.row_ranges()[2]  # [B or 1, T]
  seen = jnp.broadcast_to((count > 0)[:, None, :], (b, 1, t))  # [B, 1, T]
  if call.mask is not None:
    visible = jnp.logical_and(call.mask, call.structure.dense())  # [B, N|1, T, S]
    seen = jnp.logical_and(seen, jnp.any(visible, axis=-1))
  seen = jnp.broadcast_to(seen, (b, seen.shape[1], t))
  return jnp.moveaxis(seen, 1, 2)  # [B, T, N|1]


def run_tokamax(call: AttentionCall) -> Any:
  """``implementation="tokamax"``: :func:`tokamax.dot_product_attention` with
  ``implementation=tokamax_kernel()`` on the call (see the module docstring for what is
  refused); rows with no visible key are zeros, as on every jaxsoft path."""
  tokamax = tokamax_module()
  if tokamax is None:
    raise NotImplementedError(f"tokamax is not installed or does not import: {INSTALL_HINT}")
  _check_call(call)
  kernel = tokamax_kernel()
  with jax.numpy_rank_promotion("allow"):  # tokamax's masks rely on implicit rank promotion
    out = tokamax.dot_product_attention(
        call.q, call.k, call.v, bias=call.bias, mask=call.mask, scale=call.scale,
        is_causal=bool(call.is_causal), query_seq_lengths=call.query_seq_lengths,
        key_value_seq_lengths=call.key_value_seq_lengths,
        local_window_size=call.local_window_size, logits_soft_cap=call.logits_soft_cap,
        implementation=kernel)
  if (call.mask is None and call.query_seq_lengths is None
      and call.key_value_seq_lengths is None and call.local_window_size is None):
    return out  # every row sees a key (causal rows see key 0)
  return jnp.where(_rows_with_a_key(call)[..., None], out, jnp.zeros((), out.dtype))


def run_tokamax_auto(call: AttentionCall) -> Any:
  """tokamax in the automatic order (after cuDNN, CUDA GPUs only): skipped
  (NotImplementedError) where tokamax is not importable, and for a call it refuses or
  fails to trace (a ValueError, TypeError or RuntimeError becomes NotImplementedError, so
  the next implementation runs)."""
  if tokamax_module() is None:
    raise NotImplementedError("tokamax is not importable")
  try:
    return run_tokamax(call)
  except (ValueError, TypeError, RuntimeError) as e:
    raise NotImplementedError(f"tokamax refused the call: {e}") from e
