"""The test-suite generated from the registry: every NormalizerSpec brings its own tests.

* ``check_normalizer`` (jaxsoft.testing) on every registered spec, parametrized by name;
* hypothesis-generated rows (finite floats, varied lengths and masks) checking the
  properties each spec declares;
* spec sanity: names, catalogue ids, kernel classes and rules, parameter declarations;
* ``check_normalizer`` itself can fail: broken variants of softmax are each caught by the
  property they break.
"""

import dataclasses
import functools
import inspect
import re

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import normalizers, testing
from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import KERNEL_CLASSES
from tests.helpers import sampled

NAMES = normalizers.names()
# The default run draws hypothesis rows for one cheap normalizer per kernel class (E, S, P,
# T, X); `-m slow` draws them for every registered one.
SAMPLED = ["gumbel_softmax", "sigmoid", "softmax", "sparsemax", "stablemax"]


# --------------------------------------------------------------------------- check_normalizer


# One normalizer per kernel class (the sink as E's extra column) by default: each run of
# check_normalizer compiles every property's program (10-16 s); the others of
# REGISTRY_DEFAULT (ssmax, softpick, entmax15, top_k_softmax) run it under -m slow and
# have their own oracle files.
CHECK_DEFAULT = ("softmax", "softmax_sink", "stablemax", "sigmoid", "sparsemax",
                 "standardized_softmax")


@pytest.mark.parametrize("name", sampled(NAMES, CHECK_DEFAULT))
def test_check_normalizer(name):
  """Every declared property at the default hyperparameters (samples: parameter checks)."""
  spec = normalizers.get(name)
  checked = testing.check_normalizer(spec, quick=True)
  for prop, declared in [("sums_to_one", spec.sums_to_one), ("nonnegative", spec.nonnegative),
                         ("shift_invariance", spec.shift_invariant),
                         ("check_grads", spec.smooth)]:
    assert (prop in checked) == declared, prop
  assert {"mask_invariance", "fully_masked_row", "low_precision", "grad"} <= set(checked)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_check_normalizer_full(name):
  """Every property at every hyperparameter setting, on a second set of random rows."""
  testing.check_normalizer(normalizers.get(name), key=jax.random.key(7))


# --------------------------------------------------------------------------- hypothesis


def _call(spec, x, where=None, **hp):
  if spec.needs_key:
    return spec.fn(jax.random.key(3), x, where=where, **hp)
  return spec.fn(x, where=where, **hp)


def _min_length(spec):
  """Rows longer than any integer hyperparameter (top-k's k <= row length), plus one to
  delete a column."""
  ints = [p.default for p in spec.params
          if isinstance(p.default, int) and not isinstance(p.default, bool)]
  return max([2] + [k + 2 for k in ints])


@st.composite
def _rows_and_mask(draw, spec):
  lo = _min_length(spec)
  n = draw(st.sampled_from([lo, lo + 3, lo + 6]))
  r = draw(st.sampled_from([1, 3]))
  x = draw(hnp.arrays(np.float32, (r, n), elements=st.floats(
      -30, 30, allow_nan=False, allow_infinity=False, width=32)))
  mask = draw(hnp.arrays(np.bool_, (r, n)))
  return x, mask


def _assert_declared(spec, w, mask):
  w = np.asarray(w, np.float64)
  assert np.all(np.isfinite(w))
  assert np.all(w[~mask] == 0), "masked entries must be exactly 0"
  if spec.nonnegative:
    assert np.all(w >= 0)
  sums = w.sum(-1)
  if spec.sums_to_one:
    np.testing.assert_allclose(sums[mask.any(-1)], 1.0, atol=1e-5)
  if spec.sums_to_one or spec.at_most_one:
    assert np.all(sums <= 1 + 1e-5)
  assert np.all(sums[~mask.any(-1)] == 0), "fully masked rows must be all zeros"


def _hypothesis_names():
  return [n if n in SAMPLED else pytest.param(n, marks=pytest.mark.slow) for n in NAMES]


@pytest.mark.parametrize("name", _hypothesis_names())
@hypothesis.given(data=st.data())
def test_declared_properties_hypothesis(name, data):
  spec = normalizers.get(name)
  x, mask = data.draw(_rows_and_mask(spec))
  w = _call(spec, x, mask)
  assert w.shape == x.shape and w.dtype == x.dtype
  _assert_declared(spec, w, mask)
  tol = dict(rtol=1e-4, atol=1e-5)  # |x| <= 30: a shift moves float32 rounding by 4e-6

  if spec.shift_invariant:
    shift = data.draw(st.floats(-10, 10, width=32))
    np.testing.assert_allclose(_call(spec, x + np.float32(shift), mask), w, **tol)

  if spec.needs_key:  # its noise is tied to positions: only the key-free claims below
    return
  perm = np.asarray(data.draw(st.permutations(range(x.shape[-1]))))
  np.testing.assert_allclose(_call(spec, x[:, perm], mask[:, perm]), np.asarray(w)[:, perm],
                             **tol)
  # Masking column j == deleting it (n counts the visible entries only).
  j = data.draw(st.integers(0, x.shape[-1] - 1))
  hidden = mask.copy()
  hidden[:, j] = False
  keep = np.delete(np.arange(x.shape[-1]), j)
  w_hidden = np.asarray(_call(spec, x, hidden))
  assert np.all(w_hidden[:, j] == 0)
  np.testing.assert_allclose(w_hidden[:, keep], _call(spec, x[:, keep], mask[:, keep]), **tol)
  # -inf logits behave as masked.
  x_inf = np.where(mask, x, -np.inf).astype(np.float32)
  np.testing.assert_allclose(_call(spec, x_inf), w, **tol)


# --------------------------------------------------------------------------- spec sanity


def test_registry_is_populated_and_names_are_unique():
  assert "softmax" in normalizers.REGISTRY
  assert NAMES == sorted(set(NAMES))
  for name, spec in normalizers.REGISTRY.items():
    assert spec.name == name
    assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
  with pytest.raises(ValueError, match="already registered"):
    normalizers.register(dataclasses.replace(normalizers.get("softmax")))


@pytest.mark.parametrize("name", NAMES)
def test_spec_declaration(name):
  spec = normalizers.get(name)
  assert re.fullmatch(r"N\d{2}", spec.catalogue_id), spec.catalogue_id  # docs/feature_ids.md
  assert spec.kernel_class in KERNEL_CLASSES
  assert (spec.tile is not None) == (spec.kernel_class in ("E", "S", "P"))
  if spec.threshold is not None:
    assert spec.kernel_class == "T"
  if spec.sums_to_one:
    assert spec.at_most_one
  if spec.tile is not None and spec.kernel_class == "P":
    assert spec.tile.denominator is None and not spec.tile.uses_max
  if spec.tile is not None and spec.kernel_class in ("E", "S"):
    assert spec.tile.denominator is not None
    assert spec.tile.uses_max == (spec.kernel_class == "E")
  assert spec.description
  fn = spec.fn.func if isinstance(spec.fn, functools.partial) else spec.fn
  doc = inspect.getdoc(fn) or ""
  assert spec.catalogue_id in doc, (
      f"{name}: the docstring should name its catalogue id {spec.catalogue_id}")


@pytest.mark.parametrize("name", NAMES)
def test_spec_params(name):
  spec = normalizers.get(name)
  names = [p.name for p in spec.params]
  assert len(names) == len(set(names))
  sig = inspect.signature(spec.fn).parameters
  for p in spec.params:
    assert p.name in sig, f"{name}: `{p.name}` is not an argument of the function"
    assert p.name not in ("x", "axis", "where", "key")
    for v in (p.default, p.sample):
      p.validate(v, name)  # both declared values are in range
    assert p.sample is not None and p.sample != p.default, (
        f"{name}: `{p.name}` needs a valid non-default sample for the generated tests")
    assert p.default is not None or p.sample is not None


def test_get_unknown_name_raises_key_error_naming_it():
  with pytest.raises(KeyError, match="no_such_normalizer"):
    normalizers.get("no_such_normalizer")
  with pytest.raises(KeyError, match="no_such_normalizer"):
    normalizers.resolve("no_such_normalizer")


# --------------------------------------------------------------------------- the checker fails


def _softmax_like(body):
  """A normalizer from ``body(xs, mask, axis)`` with the softmax spec's declarations."""
  def fn(x, axis=-1, where=None, temperature=1.0):
    normalizers.get("softmax").param("temperature").validate(temperature, "mutant")
    xs, mask, axis = c.prepare(x, axis, where, "mutant")
    w = body(xs / temperature, mask, axis)
    return c.finish(w, mask, jnp.asarray(x).dtype)
  return fn


def _softmax_body(z, mask, axis):
  e = jnp.where(mask, jnp.exp(z - c.masked_max(z, mask, axis)), 0.0)
  return c.safe_divide(e, jnp.sum(e, axis=axis, keepdims=True))


@jax.custom_jvp
def _bad_grad_exp(z):
  return jnp.exp(z)


@_bad_grad_exp.defjvp
def _bad_grad_exp_jvp(primals, tangents):
  (z,), (t,) = primals, tangents
  return jnp.exp(z), 1.01 * jnp.exp(z) * t  # 1% wrong


def _mutants():
  spec = normalizers.get("softmax")
  good = _softmax_like(_softmax_body)

  def no_dtype(x, axis=-1, where=None, temperature=1.0):
    return good(x, axis, where, temperature).astype(jnp.float32)

  def nan_on_empty(x, axis=-1, where=None, temperature=1.0):
    good(x, axis, where, temperature)  # validates `temperature`
    return jax.nn.softmax(x / temperature, axis=axis, where=where)

  def no_validation(x, axis=-1, where=None, temperature=1.0):
    return good(x, axis, where, abs(temperature) + 1e-3)

  unstable = _softmax_like(lambda z, m, a: c.safe_divide(
      jnp.where(m, jnp.exp(z), 0.0), jnp.sum(jnp.where(m, jnp.exp(z), 0.0), a, keepdims=True)))
  positional = _softmax_like(lambda z, m, a: _softmax_body(
      z + 0.1 * jnp.arange(z.shape[a]).reshape([-1 if i == a else 1 for i in range(z.ndim)]),
      m, a))
  counts_masked = _softmax_like(lambda z, m, a: _softmax_body(
      z * jnp.log(z.shape[a]) / jnp.log(jnp.maximum(c.visible_count(m, a), 2.0)), m, a))
  bad_grad = _softmax_like(lambda z, m, a: c.safe_divide(
      jnp.where(m, _bad_grad_exp(z - c.masked_max(z, m, a)), 0.0),
      jnp.sum(jnp.where(m, _bad_grad_exp(z - c.masked_max(z, m, a)), 0.0), a, keepdims=True)))
  return [
      pytest.param(no_dtype, spec, "shape_dtype", id="dtype-not-preserved"),
      pytest.param(nan_on_empty, spec, "fully_masked_row", id="jax.nn.softmax-nan-rows"),
      pytest.param(no_validation, spec, "param_values", id="temperature-not-validated"),
      pytest.param(unstable, spec, "shift_invariance", id="no-max-subtraction"),
      pytest.param(positional, spec, "permutation_equivariance", id="position-dependent"),
      pytest.param(counts_masked, spec, "mask_invariance", id="n-counts-masked"),
      pytest.param(bad_grad, spec, "check_grads", id="wrong-gradient"),
      pytest.param(_softmax_like(lambda z, m, a: _softmax_body(z, m, a) - 0.01), spec,
                   "nonnegative", id="negative-weights"),
  ]


@pytest.mark.parametrize("fn,spec,prop", _mutants())
def test_check_normalizer_catches(fn, spec, prop):
  spec = dataclasses.replace(spec, name="mutant", fn=fn)
  with pytest.raises(AssertionError, match=f"'{spec.name}'.*'[^']*{prop}"):
    testing.check_normalizer(fn, spec, quick=True)


def test_check_normalizer_accepts_a_correct_reimplementation():
  """The same mutant scaffolding with the right body passes: the failures above are real."""
  good = _softmax_like(_softmax_body)
  spec = dataclasses.replace(normalizers.get("softmax"), name="good_softmax", fn=good)
  # quick=True (the first hyperparameter setting) as for the mutants: the same checks pass
  assert "check_grads" in testing.check_normalizer(good, spec, quick=True)


def test_check_normalizer_without_spec_checks_the_universal_properties():
  def sig(x, axis=-1, where=None):
    xs, mask, axis = c.prepare(x, axis, where, "sig")
    return c.finish(jax.nn.sigmoid(xs), mask, jnp.asarray(x).dtype)
  checked = testing.check_normalizer(sig)
  assert "mask_invariance" in checked and "sums_to_one" not in checked
  with pytest.raises(ValueError, match="rows"):
    testing.check_normalizer(sig, rows=np.zeros((3,)))
