"""Which Pallas driver runs on this platform: ``triton`` (GPU) or ``mosaic_tpu`` (TPU).

Every kernel family (attention, decode, linear, cross entropy) picks its driver here.
On CPU the kernels run only in the Pallas interpreter, which the environment variable
``JAXSOFT_PALLAS_INTERPRET=1`` asks for (tests and notebooks).
"""

from __future__ import annotations

import os
from typing import Any

import jax

__all__ = ["BACKENDS", "INTERPRET_ENV", "pick_backend", "check_backend", "row_grid_params",
           "hide_masked"]

BACKENDS = ("triton", "mosaic_tpu")
INTERPRET_ENV = "JAXSOFT_PALLAS_INTERPRET"
_PLATFORM_BACKEND = {"gpu": "triton", "cuda": "triton", "rocm": "triton", "tpu": "mosaic_tpu"}


def check_backend(backend: str, owner: str) -> str:
  """``backend`` itself when it names a driver; ValueError naming ``owner`` otherwise."""
  if backend not in BACKENDS:
    raise ValueError(f"{owner}: `backend` must be one of {BACKENDS}, got {backend!r}")
  return backend


def pick_backend(backend: str | None) -> tuple[str, bool]:
  """(driver, interpret) for ``backend`` on the default JAX platform.

  ``None`` picks from the platform (gpu -> triton, tpu -> mosaic_tpu). A platform that
  cannot run the requested driver raises NotImplementedError, unless the environment
  variable ``JAXSOFT_PALLAS_INTERPRET=1`` asks for the Pallas interpreter (CPU tests and
  notebooks), in which case ``None`` means the Triton driver.

  Examples:
    >>> import os
    >>> from kernels_pallas.backends import INTERPRET_ENV, pick_backend
    >>> os.environ[INTERPRET_ENV] = "1"       # on a CPU: the interpreter
    >>> pick_backend(None)
    ('triton', True)
    >>> del os.environ[INTERPRET_ENV]
  """
  if backend not in (None, *BACKENDS):
    raise ValueError(f"`backend` must be None or one of {BACKENDS}, got {backend!r}")
  platform = jax.default_backend()
  native = _PLATFORM_BACKEND.get(platform)
  if backend in (None, native) and native is not None:
    return native, False
  if os.environ.get(INTERPRET_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
    return backend or "triton", True
  raise NotImplementedError(
      f"no Pallas {backend or 'backend'} on platform {platform!r} (set {INTERPRET_ENV}=1 to "
      "run the Pallas kernels in interpret mode)")


def row_grid_params(backend: str, interpret: Any) -> tuple[Any, Any]:
  """``(compiler_params, interpret)`` for a row kernel: a 1-D grid of independent programs,
  each owning whole rows (``single_pass``, ``two_pass``, ``quantized``, ``fused_top_k``).

  Triton: 4 warps, no software pipelining (a program loops over its own columns); Mosaic
  TPU: the grid axis is "parallel" (megacore may split it). ``interpret`` as the caller
  got it, in the form ``pl.pallas_call`` takes for that backend.
  """
  if backend == "triton":
    from jax.experimental.pallas import triton as plgpu
    return plgpu.CompilerParams(num_warps=4, num_stages=1), bool(interpret)
  from jax.experimental.pallas import tpu as pltpu
  return (pltpu.CompilerParams(dimension_semantics=("parallel",)),
          interpret if interpret is not None else False)


def hide_masked(x: Any, where: Any, err: Any) -> Any:
  """``x`` with the entries ``where`` hides set to -inf (a row kernel's input; ``where``
  None: ``x`` unchanged). ``where`` must be boolean (the rule of
  ``jaxsoft._validation.boolean_mask``: a float or integer mask is refused, never cast, so
  a 0/1 float mask cannot silently mean something else). ``err(message)`` builds the error
  raised when ``where`` is not boolean or does not broadcast to ``x``, so the message
  names the caller."""
  if where is None:
    return x
  import jax.numpy as jnp
  w = jnp.asarray(where)
  if w.dtype != jnp.bool_:
    raise err(f"`where` must be boolean, got {w.dtype}")
  try:
    w = jnp.broadcast_to(w, x.shape)
  except (ValueError, TypeError):
    raise err(f"`where` {jnp.shape(where)} must broadcast to x {x.shape}") from None
  return jnp.where(w, x, -jnp.inf)
