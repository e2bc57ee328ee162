"""The mesh flags' syntax: the axis names, ``--mesh`` / ``--dcn_mesh`` parsing and the
context-parallel strategies this jaxsoft offers.

Apart from train.sharding (which lays devices and arrays out) so that train.config can check
the flags without importing the module that imports it; train.sharding re-exports these names.
"""

from __future__ import annotations

from train.errors import ConfigError

__all__ = ["DATA", "FSDP", "CONTEXT", "TENSOR", "MESH_AXES", "parse_mesh", "context_strategies"]

DATA, FSDP, CONTEXT, TENSOR = "data", "fsdp", "context", "tensor"
MESH_AXES = (DATA, FSDP, CONTEXT, TENSOR)  # outermost first


def parse_mesh(text: str, flag: str = "--mesh") -> dict[str, int]:
  """``"data=2,fsdp=-1"`` -> ``{"data": 2, "fsdp": -1}``; raises ConfigError naming ``flag``.

  Each axis (one of :data:`MESH_AXES`) at most once, a positive size or ``-1`` (at most one
  ``-1``: it takes the devices the others leave). ``""`` is ``{}``.
  """
  sizes: dict[str, int] = {}
  for item in (part.strip() for part in text.split(",")):
    if not item:
      continue
    name, eq, value = item.partition("=")
    name = name.strip()
    if not eq:
      raise ConfigError(f"{flag}: expected AXIS=SIZE pairs, got {item!r}")
    if name not in MESH_AXES:
      raise ConfigError(f"{flag}: unknown mesh axis {name!r}; axes: {', '.join(MESH_AXES)}")
    if name in sizes:
      raise ConfigError(f"{flag}: axis {name!r} given twice")
    try:
      size = int(value)
    except ValueError:
      raise ConfigError(f"{flag}: size of {name!r} must be an integer, got {value!r}") from None
    if size == 0 or size < -1:
      raise ConfigError(f"{flag}: size of {name!r} must be positive or -1, got {size}")
    sizes[name] = size
  if sum(size == -1 for size in sizes.values()) > 1:
    raise ConfigError(f"{flag}: -1 (fill the rest) may be given for one axis only, got {text!r}")
  return sizes


def context_strategies() -> tuple[str, ...]:
  """The strategies of ``jaxsoft.attention.context_parallel_attention`` (none when this jaxsoft
  has no such module)."""
  try:
    from jaxsoft.attention import context_parallel  # pylint: disable=import-outside-toplevel
  except ImportError:
    return ()
  return tuple(context_parallel.STRATEGIES)
