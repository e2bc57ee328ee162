"""The adapter ``jaxsoft.attention.dot_product_attention`` calls for the Pallas implementations.

Every call the engine cannot compute *exactly* raises NotImplementedError, so that the
dispatcher falls back to XLA: a dense ``bias`` or ``mask``, ``decay_bias``, a plain
callable or a normalizer of kernel class T/R/X, a stochastic normalizer, a value head dim
different from the key head dim, a traced ``scale``, or a platform with no Pallas backend
(CPU, unless ``JAXSOFT_PALLAS_INTERPRET=1`` asks for interpret mode).
"""

from __future__ import annotations

import os

import jax

from jaxsoft.normalizers import _spec
from kernels_pallas import _api
from kernels_pallas import engine as E

__all__ = ["dot_product_attention", "pick_backend", "INTERPRET_ENV"]

INTERPRET_ENV = "JAXSOFT_PALLAS_INTERPRET"
_ALIASES = {"pallas_triton": "triton", "pallas_mosaic_tpu": "mosaic_tpu", "pallas": None}
_PLATFORM_BACKEND = {"gpu": "triton", "cuda": "triton", "rocm": "triton", "tpu": "mosaic_tpu"}


def _interpret_requested() -> bool:
  return os.environ.get(INTERPRET_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def pick_backend(backend: str | None) -> tuple[str, bool]:
  """(driver, interpret) for ``backend`` on the default JAX platform.

  ``None`` picks from the platform (gpu -> triton, tpu -> mosaic_tpu). A platform that
  cannot run the requested driver raises NotImplementedError, unless the environment
  variable ``JAXSOFT_PALLAS_INTERPRET=1`` asks for the Pallas interpreter (CPU tests and
  notebooks), in which case ``None`` means the Triton driver.
  """
  backend = _ALIASES.get(backend, backend)
  if backend not in (None, "triton", "mosaic_tpu"):
    raise ValueError(
        f"`backend` must be None, 'triton' or 'mosaic_tpu', got {backend!r}")
  platform = jax.default_backend()
  native = _PLATFORM_BACKEND.get(platform)
  if backend is None:
    backend = native
  if backend is not None and backend == native:
    return backend, False
  if _interpret_requested():
    return backend or "triton", True
  raise NotImplementedError(
      f"no Pallas {backend or 'backend'} on platform {platform!r} (set {INTERPRET_ENV}=1 to "
      "run the Pallas kernels in interpret mode)")


def dot_product_attention(q, k, v, *, backend=None, bias=None, mask=None, scale=None,
                          is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, segment_ids=None, logits_soft_cap=None,
                          spec=None, normalizer_params=None, decay_bias=None):
  """Runs :func:`kernels_pallas.attention` for a canonical jaxsoft attention call.

  Arguments are those of ``jaxsoft.attention.dot_product_attention`` after validation
  (q [B, T, N, H], k/v [B, S, K, H], ``segment_ids`` a pair or None, ``spec`` a
  NormalizerSpec). Raises NotImplementedError for anything not computed exactly.
  """
  if bias is not None:
    raise NotImplementedError("the Pallas engine takes no dense `bias`")
  if mask is not None:
    raise NotImplementedError("the Pallas engine takes no dense `mask` (use the structure: "
                              "is_causal, local_window_size, segment_ids, sequence lengths)")
  if decay_bias is not None:
    raise NotImplementedError("the Pallas engine does not implement `decay_bias` yet")
  spec = _spec.resolve("softmax" if spec is None else spec)
  if not E.supports(spec) or spec.needs_key:
    raise NotImplementedError(
        f"the Pallas engine runs registered normalizers of kernel class E, S or P, got {spec!r}")
  params = dict(normalizer_params or {})
  if "key" in params:
    raise NotImplementedError("the Pallas engine runs no stochastic normalizer")
  if v.shape[-1] != k.shape[-1]:
    raise NotImplementedError("the Pallas engine needs equal key and value head dims")
  if scale is not None:
    try:
      scale = float(scale)
    except (TypeError, jax.errors.ConcretizationTypeError):
      raise NotImplementedError("the Pallas engine needs a concrete `scale`") from None
  driver, interpret = pick_backend(backend)
  return _api.attention(
      q, k, v, normalizer=spec, normalizer_params=params, scale=scale, is_causal=is_causal,
      local_window_size=local_window_size, segment_ids=segment_ids,
      logits_soft_cap=logits_soft_cap, backend=driver, interpret=interpret,
      query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths)
