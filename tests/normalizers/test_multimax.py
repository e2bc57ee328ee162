"""N11 multimax against a float64 numpy reference of the official code's formula."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

import jaxsoft.normalizers as N
from tests import helpers
from tests import reference_f64 as ref64
from tests.normalizers import masking
from tests.normalizers.reference import softmax64

# jitted once: each call compiles per shape, not per primitive (the tests stay cheap)
MULTIMAX = jax.jit(N.multimax)

HP = dict(t1=0.5, t2=0.8, t3=-0.1, t4=0.2, b1=-1.0, b2=1.0, b3=-2.0, b4=2.0)
ZERO = dict.fromkeys(HP, 0.0)


def _mm(x, where=None, **hp):
  """MULTIMAX with every parameter passed (traced): one compilation per shape."""
  return MULTIMAX(x, where=where, **{**ZERO, **hp})


def _reference(x, mask, t1=0.0, t2=0.0, t3=0.0, t4=0.0, b1=0.0, b2=0.0, b3=0.0, b4=0.0):
  x = np.asarray(x, np.float64)
  mask = np.broadcast_to(np.asarray(mask, bool), x.shape)
  r = lambda v: np.maximum(v, 0.0)  # noqa: E731
  z = x + t1 * r(b1 - x) + t2 * r(x - b2) + t3 * r(b3 - x) ** 2 + t4 * r(x - b4) ** 2
  return softmax64(z, mask)


def test_matches_reference():
  x, mask = helpers.random_rows(0, scale=2.0)
  for hp in (HP, {"t1": 1.0, "b1": 0.3}, {"t4": 0.5, "b4": -1.0}):
    chex.assert_trees_all_close(_mm(x, where=mask, **hp),
                                _reference(x, mask, **hp).astype(np.float32), atol=1e-6)


def test_t_zero_is_softmax_and_identity_inside_the_breakpoints():
  x, mask = helpers.random_rows(1, scale=3.0)
  chex.assert_trees_all_close(_mm(x, where=mask), jax.nn.softmax(
      jnp.where(mask, x, -jnp.inf), axis=-1).at[0].set(0.0), atol=1e-7)
  # with t = 0 but any b, still softmax
  chex.assert_trees_all_close(_mm(x, where=mask, b1=-1.0, b2=2.0),
                              N.softmax(x, where=mask), atol=1e-7)
  # scores inside [b1, b2] = [b3, b4] are not modulated
  inside = jnp.array([-0.9, -0.2, 0.4, 0.95])
  chex.assert_trees_all_close(_mm(inside, t1=0.7, t2=0.7, t3=0.3, t4=0.3, b1=-1.0,
                                         b2=1.0, b3=-1.0, b4=1.0), N.softmax(inside), atol=1e-7)


def test_sharper_and_suppresses_low_entries():
  x = jnp.array([2.0, 1.8, 0.0, -1.5, -2.0])
  sm = np.asarray(N.softmax(x))
  mm = np.asarray(_mm(x, t1=0.5, t2=1.0, b1=-1.0, b2=1.0))
  assert mm[0] / mm[1] > sm[0] / sm[1]  # the top pair stays (multi-modal), sharper
  assert mm[3:].sum() / mm.sum() < sm[3:].sum()  # less mass below b1
  assert mm[0] + mm[1] > sm[0] + sm[1]
  assert np.all(np.diff(mm) < 0)  # 1 - t1 >= 0: order kept


def test_gradients_float64_away_from_breakpoints_and_at_them():
  x, mask = helpers.random_rows(2)
  with jax.enable_x64(True):
    hp = {k: jnp.full((x.shape[0], 1), v, jnp.float64) for k, v in HP.items()}
    xs = jnp.asarray(x, jnp.float64)
    # the rows keep every score at least 0.02 from every breakpoint (checked)
    for b in (-2.0, -1.0, 1.0, 2.0):
      assert np.min(np.abs(np.asarray(x)[np.asarray(mask)] - b)) > 0.02
    check_grads(lambda x, t1, t2, t3, t4: _mm(x, where=mask, **{**hp, "t1": t1, "t2": t2,
                                                                       "t3": t3, "t4": t4}),
                (xs, hp["t1"], hp["t2"], hp["t3"], hp["t4"]), order=1, modes=("fwd", "rev"),
                eps=1e-4)
    g = jax.grad(lambda x: jnp.sum(_mm(x, t1=0.5, t2=0.5, b1=0.0, b2=1.0) ** 2))(
        jnp.array([0.0, 1.0, 0.5], jnp.float64))  # entries exactly at the kinks
    assert np.all(np.isfinite(np.asarray(g)))


def test_masks_low_precision_tile_rule():
  """Masked rows == the reference of the rows with those entries deleted, bf16/fp16 == the
  reference up to one rounding, and the chunked attention path == dense float64 attention
  (tests.reference_f64)."""
  ref64.check_masks_low_precision_tile_rule(MULTIMAX, "multimax", _reference, HP)


def test_masked_entries_and_fully_masked_rows_are_exactly_zero():
  """where=False and -inf give exact zeros, with zero gradient (the float64 reference
  comparisons above only bound them by atol)."""
  masking.check_hidden_entries_exact_zero(MULTIMAX)
