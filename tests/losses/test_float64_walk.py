"""Every loss with a ``where`` argument keeps float64 under ``JAX_ENABLE_X64`` (issue 37's
guard "float64 stays float64": no public function silently computes in float32).

The losses are the table of ``test_masked_batches`` (every public loss that takes
``where``; a new loss must join it), called on float64 inputs with every example visible.
A computation in float64 is told from one in float32 without a reference per loss: the
loss must be float64 and must move when each float input entry is scaled by ``1 + r 2^-30``
(r in [0.5, 1] with random signs, so that scale- and shift-invariant losses move too), a
change below float32's half ulp (2^-25): the inputs are float32 values, and the moved ones
round back to them, so a computation cast to float32 returns the very same loss (as
``odin`` and the calibration maps did before they were fixed; those take no ``where`` and
have their own test, ``test_calibration_float64``). The gradients are float64 (not required to move:
piecewise-linear losses have locally constant ones). Three losses by default, all of them
with ``-m slow``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft.losses as L
from tests.helpers import sampled
from tests.losses.test_masked_batches import CASES

EPS = 2.0 ** -30  # a relative change float64 holds and float32 rounds away
# Documented float32 arithmetic: MIDAM's pool runs in its state's dtype (midam_pool_init's
# ``dtype``, float32 by default, so that a lax.scan carry keeps one dtype).
FLOAT32_STATE = {"midam_pool_update"}
DEFAULT = ("dual_softmax_loss", "sdpo_loss", "squared_error_logit_loss")


def _move(x, seed):
  """``x (1 + r EPS)`` per entry, ``|r|`` in [0.5, 1] with random signs."""
  rng = np.random.default_rng(seed)
  r = rng.uniform(0.5, 1.0, size=x.shape) * rng.choice([-1.0, 1.0], size=x.shape)
  return x * jnp.asarray(1.0 + r * EPS, jnp.float64)


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def _total(call, where_shape, floats):
  return jnp.sum(call(jnp.ones(where_shape, bool), *floats))


@pytest.mark.parametrize("name", sampled(sorted(CASES), DEFAULT))
def test_loss_computes_float64_inputs_in_float64(x64, name):
  call, floats, where_shape = CASES[name]
  if name in FLOAT32_STATE:
    call = _float64_state(name)
  floats = tuple(jnp.asarray(np.asarray(x), jnp.float64) for x in floats)
  moved = tuple(_move(x, i) for i, x in enumerate(floats))
  assert all(bool(jnp.any(m != x)) for m, x in zip(moved, floats, strict=True))
  f = jax.jit(jax.value_and_grad(lambda *xs: _total(call, where_shape, xs),
                                 argnums=tuple(range(len(floats)))))
  (value, grads), (value_moved, grads_moved) = f(*floats), f(*moved)
  assert value.dtype == jnp.float64, (name, value.dtype)
  assert np.isfinite(float(value)), name
  # float32 inside: both inputs round to the same float32 values, the same loss comes out
  assert float(value_moved) != float(value), name
  assert all(g.dtype == jnp.float64 for g in grads), (name, [g.dtype for g in grads])
  assert all(g.dtype == jnp.float64 for g in grads_moved), name


def _float64_state(name):
  """The table's call with the documented float64 state."""
  assert name == "midam_pool_update"
  b = 3
  return lambda m, s: L.midam_pool_update(L.midam_pool_init(b, dtype=jnp.float64), s,
                                          jnp.arange(b), where=m)[0]
