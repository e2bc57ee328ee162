"""Float64 references and inputs shared by the normalizer test files."""

import jax.numpy as jnp
import numpy as np

from tests import helpers


def softmax64(x, mask=None):
  """float64 numpy softmax over the last axis; masked entries and a row with nothing
  visible get 0 (``mask`` defaults to the finite entries; ``-inf`` is always masked)."""
  x = np.asarray(x, np.float64)
  mask = np.isfinite(x) if mask is None else np.asarray(mask) & (x > -np.inf)
  z = np.where(mask, x, -np.inf)
  top = np.max(z, -1, keepdims=True)
  e = np.where(mask, np.exp(z - np.where(np.isfinite(top), top, 0.0)), 0.0)
  s = e.sum(-1, keepdims=True)
  return np.divide(e, s, out=np.zeros_like(e), where=s > 0)


def masked_rows():
  """Scores with a -inf entry, hidden columns and one fully masked row (row 0)."""
  x, mask = helpers.random_rows(11, (5, 9))
  return x.at[2, 1].set(-jnp.inf), mask
