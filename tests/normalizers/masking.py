"""The exact-zero check of masked entries shared by the per-normalizer test files."""

import jax
import jax.numpy as jnp
import numpy as np

from tests import helpers


def check_hidden_entries_exact_zero(*fns):
  """``where=False`` and ``-inf`` entries, and the fully masked row 0 of the random rows,
  get exactly 0 weight and exactly 0 gradient from every ``fn(x, where=...)``."""
  x, mask = helpers.random_rows(4)  # row 0 fully masked
  m = np.asarray(mask)
  ct = helpers.random_cotangent(x.shape)
  for fn in fns:
    for args in ((x, mask), (jnp.where(mask, x, -jnp.inf), None)):
      w, vjp = jax.vjp(lambda v, f=fn, wh=args[1]: f(v, where=wh), args[0])
      assert (np.asarray(w)[~m] == 0).all()
      assert (np.asarray(vjp(ct)[0])[~m] == 0).all()
