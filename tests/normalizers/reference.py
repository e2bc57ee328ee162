"""Float64 references and inputs shared by the tests of the kernel-arithmetic softmaxes
(test_kernel_softmax) and the quantised ones (test_quantized)."""

import jax.numpy as jnp
import numpy as np

from tests import helpers


def softmax64(x, mask=None):
  """float64 numpy softmax over the last axis (masked entries 0)."""
  x = np.asarray(x, np.float64)
  mask = np.isfinite(x) if mask is None else np.asarray(mask) & (x > -np.inf)
  m = np.max(np.where(mask, x, -np.inf), -1, keepdims=True)
  e = np.where(mask, np.exp(np.where(mask, x, m) - m), 0.0)
  return e / e.sum(-1, keepdims=True)


def masked_rows():
  """Scores with a -inf entry, hidden columns and one fully masked row (row 0)."""
  x, mask = helpers.random_rows(11, (5, 9))
  return x.at[2, 1].set(-jnp.inf), mask
