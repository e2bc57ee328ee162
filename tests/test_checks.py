"""jaxsoft.checks: declared hyperparameter ranges become checkify checks (issue 37, traced
hyperparameters), and non-finite leaves are named."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxsoft as js
from jaxsoft.normalizers import spec as spec_lib
from tests import helpers


def _checked_jit(fn):
  """``args -> the checkify message or None`` of ``fn``, compiled once (one program per test)."""
  run = jax.jit(checkify.checkify(fn))
  return lambda *args: run(*args)[0].get()


def _error(fn, *args):
  return _checked_jit(fn)(*args)


def _outside(param):
  """A value just outside the declared range (the bound itself when it is open)."""
  if param.low is not None:
    return param.low if param.low_open else param.low - 1.0
  return param.high if param.high_open else param.high + 1.0


def _inside(param):
  return param.sample if param.sample is not None else param.default


BOUNDED = [(s.name, p) for s in (spec_lib.get(n) for n in spec_lib.names()) for p in s.params
           if (p.low is not None or p.high is not None)
           and isinstance(_inside(p), float) and not isinstance(_inside(p), bool)]


def test_every_declared_range_is_checked_when_traced():
  assert len(BOUNDED) >= 10
  # One compiled program for the whole registry: branch i checks the i-th declared range.
  branches = [lambda v, name=name, param=param: js.checks.check_hparams(name, {param.name: v})
              for name, param in BOUNDED]
  run = jax.jit(checkify.checkify(lambda i, v: jax.lax.switch(i, branches, v)))
  for i, (name, param) in enumerate(BOUNDED):
    assert run(i, jnp.float32(_inside(param)))[0].get() is None, (name, param)
    msg = run(i, jnp.float32(_outside(param)))[0].get()
    assert msg is not None, (name, param.name)
    assert msg.startswith(f"{name}: `{param.name}` must be"), msg
    assert run(i, jnp.float32(math.nan))[0].get().startswith(
        f"{name}: `{param.name}` must not be NaN")


def test_traced_entmax_alpha_at_or_below_one_is_reported_under_jit():
  entmax = js.checks.checked("entmax")
  x = jnp.array([1.0, 0.5, -1.0])
  run = jax.jit(checkify.checkify(lambda x, a: entmax(x, alpha=a)))
  error = lambda a: run(x, jnp.float32(a))[0].get()  # noqa: E731
  assert error(1.5) is None
  assert error(1.0) == "entmax: `alpha` must be > 1.0, got 1.0 (`check` failed)"
  assert error(0.5) == "entmax: `alpha` must be > 1.0, got 0.5 (`check` failed)"
  # The checked function computes the normalizer's own weights.
  err, p = run(x, jnp.float32(1.25))
  err.throw()
  plain = jax.jit(lambda x, a: js.normalizers.entmax(x, alpha=a))(x, jnp.float32(1.25))
  np.testing.assert_array_equal(p, plain)


def test_per_row_alpha_names_the_first_bad_entry_under_vmap_and_grad():
  entmax = js.checks.checked("entmax")
  x = jnp.array([[1.0, 0.5, -1.0], [0.2, 0.1, 0.0]])

  def loss(alpha):
    return jnp.sum(entmax(x, alpha=alpha[:, None]) * jnp.arange(3.0)[None])

  error = _checked_jit(jax.grad(loss))
  assert error(jnp.array([1.5, 1.25])) is None
  msg = error(jnp.array([1.5, 0.75]))
  assert msg.startswith("entmax: `alpha` must be > 1.0, got 0.75"), msg
  batched = jax.vmap(lambda a: entmax(x, alpha=a))
  assert "got 0.25" in _error(batched, jnp.array([2.0, 0.25]))


def test_negative_temperature_reaches_attention_through_check_hparams():
  q = helpers.standard_normal(0, (1, 4, 2, 8))

  def attend(t):
    params = {"temperature": t}
    js.checks.check_hparams("softmax", params, context=" (layer 3)")
    return js.attention.dot_product_attention(q, q, q, normalizer="softmax",
                                              normalizer_params=params)

  error = _checked_jit(attend)
  assert error(jnp.float32(0.7)) is None
  assert error(jnp.float32(-0.75)) == (
      "softmax: `temperature` must be > 0.0, got -0.75 (layer 3) (`check` failed)")


def test_concrete_values_raise_at_once_and_misuse_is_named():
  with pytest.raises(ValueError, match=r"entmax: `alpha` must be > 1.0, got 0.5"):
    js.checks.check_hparams("entmax", {"alpha": np.array([1.5, 0.5])})
  with pytest.raises(ValueError, match=r"normalizer 'entmax' has no hyperparameter `beta`"):
    js.checks.check_hparams("entmax", {"beta": 1.0})
  with pytest.raises(TypeError, match=r"checked: `normalizer` must be a registered name"):
    js.checks.checked(jax.nn.softmax)
  js.checks.check_hparams("ssmax", {"n": None})  # a data-dependent default: nothing to check


def test_check_finite_names_the_leaf():
  tree = {"a": {"w": jnp.ones(3)}, "b": [jnp.zeros(2), jnp.array([0.0, -jnp.inf])],
          "step": jnp.int32(3)}
  check = lambda t: js.checks.check_finite(t, "gradient")  # noqa: E731
  assert _error(check, tree) == "non-finite gradient at ['b'][1] (`check` failed)"
  tree["b"][1] = jnp.zeros(2)
  assert _error(check, tree) is None
  assert _error(check, {"a": {"w": jnp.array([jnp.nan])}}).startswith(
      "non-finite gradient at ['a']['w']")
