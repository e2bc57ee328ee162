"""The error every configuration check raises (train.config, train.sharding, train.mesh_flags)."""

__all__ = ["ConfigError"]


class ConfigError(ValueError):
  """A bad configuration; raised before any work is done. The message names the problem."""
