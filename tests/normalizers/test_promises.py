"""docs/numerics.md's promises for every registered normalizer and loss, tested at the shared rules.

Signature (hyperparameters keyword-only), numerics (integer promotion, the +inf and NaN
rules, finite gradients through masked entries, a float64 reference on random and
extreme rows), bad input (empty arrays) and the drop-in claims (``jax.nn.softmax``,
optax's losses). The randomized test samples a few seeded cases by default; the full
matrix is marked slow.
"""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft as js
from jaxsoft import normalizers as N
from jaxsoft.normalizers import common as c
from tests import reference_f64 as ref64
from tests.helpers import registry_sample

NAMES = N.names()
POINTWISE = [n for n in NAMES if N.get(n).kernel_class == "P"]
# each +inf entry's own limit, for the pointwise (unnormalized) class
POINTWISE_INF_LIMIT = {"sigmoid": 1.0, "relu": np.inf, "relu2": np.inf, "relu_n": np.inf,
                       "ovr_sigmoid": 1.0, "gumbel_cdf": 1.0, "nested_sigmoid": 1.0,
                       "multiscreen": 1.0}
# normalizing ones whose limit on each of k +inf entries is not 1/k (at the defaults)
INF_SHARE = {"clipped_softmax": lambda k: np.clip(1.03 / k - 0.03, 0.0, 1.0),
             "sa_softmax": lambda k: np.inf}


def _call(name, x, axis=-1, where=None, **hp):
  spec = N.get(name)
  if name == "top_k_softmax" and "k" not in hp:  # the default k = 8 exceeds these rows
    shape = np.shape(x)
    hp["k"] = max(1, min(2, shape[axis])) if -len(shape) <= axis < len(shape) else 1
  if spec.needs_key:
    return spec.fn(jax.random.key(0), x, axis, where, **hp)
  return spec.fn(x, axis, where, **hp)


def _learned(spec):
  """The differentiable (row-broadcast) hyperparameters at a valid non-default value."""
  return {p.name: (p.sample if p.sample is not None else p.default) for p in spec.params
          if p.row_broadcast and (p.sample is not None or p.default is not None)}


# --- signature ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_promise_signature_keyword_only_hyperparameters(name):
  spec = N.get(name)
  params = list(inspect.signature(spec.fn).parameters.values())
  lead = ["key"] if spec.needs_key else []
  positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  assert positional == lead + ["x", "axis", "where"]
  by_name = {p.name: p for p in params}
  assert by_name["axis"].default == -1 and by_name["where"].default is None
  rest = [p for p in params if p.name not in positional]
  assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in rest), rest
  for p in spec.params:
    assert by_name[p.name].kind == inspect.Parameter.KEYWORD_ONLY, p.name
  # the second positional argument is the axis, never a hyperparameter
  x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5)), jnp.float32)
  np.testing.assert_array_equal(_call(name, x, 0), _call(name, x, axis=0))


def test_promise_signature_registry_rejects_positional_hyperparameters():
  base = N.get("softmax")

  @c.dense_rules
  def positional(x, temperature=1.0, axis=-1, where=None):
    return N.softmax(x, axis, where, temperature=temperature)

  with pytest.raises(ValueError, match="keyword-only"):
    N.register(dataclasses.replace(base, name="_positional", fn=positional))

  def undecorated(x, axis=-1, where=None, *, temperature=1.0):
    return N.softmax(x, axis, where, temperature=temperature)

  with pytest.raises(ValueError, match="dense_rules"):
    N.register(dataclasses.replace(base, name="_undecorated", fn=undecorated))
  assert "_positional" not in N.REGISTRY and "_undecorated" not in N.REGISTRY


# --- dtype --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", registry_sample(NAMES))
def test_promise_numerics_integer_inputs_promote(name):
  xi = jnp.array([[1, 2, 3, -1], [0, 0, 5, 2]], jnp.int32)
  want = _call(name, xi.astype(jnp.float32))
  got = _call(name, xi)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(got, want)
  got_b = _call(name, jnp.array([[True, False, True]]))
  assert got_b.dtype == jnp.float32
  np.testing.assert_array_equal(got_b, _call(name, jnp.array([[1.0, 0.0, 1.0]])))


def test_promise_numerics_integer_logits_promote_in_losses():
  xi = jnp.array([[1, 2, 3], [0, 0, 5]])
  labels = jnp.array([2, 0])
  for loss in (js.losses.softmax_cross_entropy_with_integer_labels,
               js.losses.stablemax_cross_entropy, js.losses.fenchel_young_loss):
    got = loss(xi, labels)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, loss(xi.astype(jnp.float32), labels))
  probs = jax.nn.one_hot(labels, 3)
  np.testing.assert_array_equal(js.losses.softmax_cross_entropy(xi, probs),
                                js.losses.softmax_cross_entropy(xi.astype(jnp.float32), probs))


# --- +inf and NaN -------------------------------------------------------------------------


def _limit_z(posinf, vis):
  """Standardised scores as the k +inf entries of n grow together (a numpy float64 limit)."""
  n = vis.sum(-1, keepdims=True)
  k = posinf.sum(-1, keepdims=True)
  with np.errstate(divide="ignore", invalid="ignore"):
    hi = np.where(k > 0, np.sqrt((n - k) / np.maximum(k, 1)), 0.0)
    lo = np.where(n > k, -np.sqrt(k / np.maximum(n - k, 1)), 0.0)
  return np.where(vis, np.where(posinf, hi, lo), 0.0)


def _inf_expected(name, x, where):
  """The +inf rule of the module docstring of ``_common``, in numpy."""
  if name in ref64.FORMULAS:  # the float64 reference of the formula and its +inf rule
    return ref64.normalizer(name, x, where)
  x = np.asarray(x, np.float64)
  vis = np.ones(x.shape, bool) if where is None else np.broadcast_to(where, x.shape)
  vis = vis & (x != -np.inf)
  posinf = vis & (x == np.inf)
  if name == "nap":
    return _limit_z(posinf, vis)
  if name == "standardized_softmax":
    e = np.where(vis, np.exp(_limit_z(posinf, vis)), 0.0)
    return e / e.sum(-1, keepdims=True)
  if name in POINTWISE:
    finite = np.where(posinf, 1e30, x)
    base = np.asarray(_call(name, jnp.asarray(finite, jnp.float32), where=where), np.float64)
    return np.where(posinf, POINTWISE_INF_LIMIT[name], base)
  if name == "gumbel_softmax_hard":  # one-hot: the first +inf entry
    first = np.argmax(posinf, axis=-1)[..., None]
    return np.where(posinf.any(-1, keepdims=True) & (np.arange(x.shape[-1]) == first), 1.0, 0.0)
  k = np.maximum(posinf.sum(-1, keepdims=True), 1)
  return np.where(posinf, INF_SHARE.get(name, lambda k: 1.0 / k)(k), 0.0)


@pytest.mark.parametrize("name", registry_sample(NAMES))
def test_promise_numerics_inf_and_nan_rule(name):
  inf, nan = np.inf, np.nan
  x = np.array([[1.0, inf, 0.0, -1.0],       # one +inf: all its mass
                [inf, 2.0, inf, -inf],       # two: half each
                [inf, 3.0, 1.0, 2.0]], np.float32)
  where = np.array([[True, True, True, True],
                    [True, True, True, True],
                    [False, True, True, True]])  # a masked +inf is just masked
  got = np.asarray(_call(name, jnp.asarray(x), where=jnp.asarray(where)), np.float64)
  want_rows = _inf_expected(name, x[:2], where[:2])
  np.testing.assert_allclose(got[:2], want_rows, rtol=1e-6, atol=0)
  if not N.get(name).needs_key:  # (the noise depends on the shape)
    np.testing.assert_allclose(got[2, 1:], np.asarray(_call(name, jnp.asarray(x[2, 1:]))),
                               rtol=1e-6, atol=1e-7, err_msg="masked +inf")
  assert got[2, 0] == 0
  if name != "gumbel_softmax_hard":
    hp = _learned(N.get(name))
    g = jax.grad(lambda v, h: jnp.sum(jnp.where(jnp.isfinite(x), _call(name, v, **h), 0.0)),
                 argnums=(0, 1))(jnp.asarray(x), hp)
    for leaf in jax.tree.leaves(g):
      assert np.isfinite(np.asarray(leaf)).all(), "gradient of +inf rows"
  # NaN: a visible NaN makes the row's visible entries NaN; a masked NaN is ignored
  y = np.array([[1.0, nan, 0.0, 2.0], [1.0, nan, 0.0, 2.0]], np.float32)
  wy = np.array([[True, True, True, False], [True, False, True, True]])
  out = np.asarray(_call(name, jnp.asarray(y), where=jnp.asarray(wy)))
  assert np.isnan(out[0, :3]).all() and out[0, 3] == 0
  clean = np.where(np.isnan(y), 0.0, y).astype(np.float32)
  np.testing.assert_array_equal(out[1], np.asarray(_call(name, jnp.asarray(clean),
                                                         where=jnp.asarray(wy)))[1])


def test_promise_numerics_entmax15_inf_example():
  """The issue's example: ``entmax15([1, inf, 0])`` gave ``[0.25, inf, 0]``."""
  np.testing.assert_array_equal(N.entmax15(jnp.array([1.0, jnp.inf, 0.0])), [0.0, 1.0, 0.0])


# --- masked entries: finite gradients (the double where) ----------------------------------


@pytest.mark.parametrize("name", registry_sample([n for n in NAMES if _learned(N.get(n))]))
@pytest.mark.parametrize("level", [-100.0, -1e4])
def test_promise_numerics_masked_entries_keep_gradients_finite(name, level):
  """A masked entry next to visible scores far below 0 (every causal row at -100)."""
  x = jnp.array([[level, level + 1.0, 0.0], [level, 0.0, 0.0]], jnp.float32)
  where = jnp.array([[True, True, False], [True, False, False]])
  hp = {k: jnp.asarray(v, jnp.float32) for k, v in _learned(N.get(name)).items()}
  ct = jnp.array([[0.3, -0.7, 1.1], [0.5, 0.2, -0.4]])

  def loss(v, h, w):
    return jnp.sum(_call(name, v, where=w, **h) * ct)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))  # one program per call, not op by op
  g = grad(x, hp, where)
  for leaf in jax.tree.leaves(g):
    assert np.isfinite(np.asarray(leaf)).all()
  # masking the third column == a -inf logit there (a different route to the same mask)
  x_neg = x.at[:, 2].set(-jnp.inf).at[1, 1].set(-jnp.inf)
  g_neg = grad(x_neg, hp, None)
  for k in hp:
    np.testing.assert_allclose(g[1][k], g_neg[1][k], rtol=1e-5, atol=1e-30, err_msg=k)


def test_promise_numerics_issue_example_temperature_gradient():
  g = jax.grad(lambda t: N.softmax(jnp.array([-100.0, 0.0]), where=jnp.array([True, False]),
                                   temperature=t).sum())(jnp.ones(1))
  assert np.isfinite(np.asarray(g)).all()


# --- bad input: empty arrays --------------------------------------------------------------


@pytest.mark.parametrize("name", registry_sample(NAMES))
def test_promise_bad_input_empty_arrays(name):
  for shape, axis in [((0, 4), -1), ((3, 0), -1), ((2, 0, 4), 1), ((0,), 0)]:
    for dtype in (jnp.float32, jnp.bfloat16, jnp.int32):
      out = _call(name, jnp.zeros(shape, dtype), axis)
      assert out.shape == shape and out.dtype == c.output_dtype(dtype)
  with pytest.raises(ValueError, match="`axis`"):
    _call(name, jnp.zeros((0, 4)), 2)


def test_promise_bad_input_losses_with_zero_examples():
  L = js.losses
  for logits in (jnp.zeros((0, 5)), jnp.zeros((0, 5), jnp.int32)):
    labels = jnp.zeros((0,), jnp.int32)
    assert L.softmax_cross_entropy_with_integer_labels(logits, labels).shape == (0,)
    assert L.softmax_cross_entropy(logits, jnp.zeros((0, 5))).shape == (0,)
    assert L.stablemax_cross_entropy(logits, labels).shape == (0,)
    assert L.fenchel_young_loss(logits, labels).shape == (0,)
    assert L.top_k_cross_entropy(logits, labels, 2).shape == (0,)
  # a zero-sized class axis: nothing is visible, loss 0
  np.testing.assert_array_equal(
      L.softmax_cross_entropy(jnp.zeros((3, 0)), jnp.zeros((3, 0))), np.zeros(3))


# --- drop-in ------------------------------------------------------------------------------


def test_promise_drop_in_jax_nn_softmax():
  """Every ``jax.nn.softmax`` call without ``initial`` gives jax.nn's answer."""
  x = jnp.array([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0])  # jax.nn.softmax's docstring
  m = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4)), jnp.float32)
  where = jnp.asarray(np.random.default_rng(1).random((2, 3, 4)) < 0.7).at[..., 0].set(True)
  calls = [((x,), {}), ((m,), {}), ((m, 0), {}), ((m, 1), {}), ((m,), {"axis": -2}),
           ((m, -1, where), {}), ((m,), {"axis": -1, "where": where}),
           ((m,), {"where": where[:1]}),  # broadcast mask
           ((jnp.array([1, 2, 3]),), {}), ((jnp.arange(6).reshape(2, 3), 0), {}),
           ((m.astype(jnp.bfloat16),), {}), ((np.asarray(m),), {})]
  for args, kw in calls:
    want = jax.nn.softmax(*args, **kw)
    got = N.softmax(*args, **kw)
    assert got.dtype == want.dtype and got.shape == want.shape, (args, kw)
    low = want.dtype == jnp.bfloat16  # jax.nn computes in bf16, jaxsoft in float32
    np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=2e-2 if low else 1e-6,
                               atol=4e-3 if low else 1e-7)
  got = jax.jit(N.softmax, static_argnums=1)(m, 0)
  np.testing.assert_allclose(got, jax.nn.softmax(m, 0), rtol=1e-6)
  # tuple axes: one row over the named axes, as jax.nn's multi-axis softmax
  np.testing.assert_allclose(N.softmax(m, axis=(0, 1)), jax.nn.softmax(m, axis=(0, 1)),
                             rtol=1e-6, atol=1e-7)


def test_promise_drop_in_optax_losses():
  """jaxsoft's losses named as optax's accept optax's calls unchanged and match it."""
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(4, 5)), jnp.float32)
  ints = jnp.asarray(rng.integers(0, 5, size=4))
  probs = jax.nn.softmax(jnp.asarray(rng.normal(size=(4, 5)), jnp.float32))
  ex_where = jnp.array([True, False, True, True])
  cls_where = jnp.asarray(rng.random((4, 5)) < 0.8).at[jnp.arange(4), ints].set(True)
  for name, labels in [("softmax_cross_entropy", probs),
                       ("softmax_cross_entropy_with_integer_labels", ints)]:
    ours, theirs = getattr(js.losses, name), getattr(optax.losses, name)
    for args, kw in [((logits, labels), {}), ((logits, labels, -1), {}),
                     ((), {"logits": logits, "labels": labels}),
                     ((logits, labels), {"axis": -1, "where": cls_where}),
                     ((logits, labels, -1, cls_where), {}),
                     ((logits.T, labels.T if labels.ndim == 2 else labels), {"axis": 0})]:
      np.testing.assert_allclose(ours(*args, **kw), theirs(*args, **kw), rtol=1e-5, atol=1e-6,
                                 err_msg=f"{name} {kw}")
    # optax's per-example mask gives 0 where False in both
    np.testing.assert_allclose(ours(logits, labels, where=ex_where[:, None] & cls_where),
                               theirs(logits, labels, where=ex_where[:, None] & cls_where),
                               rtol=1e-5, atol=1e-6)
  # the sparsemax loss: optax's multiclass_sparsemax_loss is fenchel_young_loss("sparsemax")
  np.testing.assert_allclose(js.losses.fenchel_young_loss(logits, ints, "sparsemax"),
                             optax.losses.multiclass_sparsemax_loss(logits, ints),
                             rtol=1e-5, atol=1e-6)


# --- randomized against a float64 reference -----------------------------------------------

ROW_KINDS = ("normal", "below_88", "spread_1e4", "one_inf", "two_inf", "nan", "masked_nan",
             "ties", "fully_masked", "one_visible")


def _row(kind, s, rng):
  """One row of length ``s`` and its mask."""
  x = rng.normal(size=s) * 2.0
  w = rng.random(s) < 0.75
  w[rng.integers(s)] = True
  if kind == "below_88":
    x = x - 150.0
  elif kind == "spread_1e4":
    x = rng.uniform(-1e4, 1e4, size=s)
  elif kind == "one_inf":
    x[rng.integers(s)] = np.inf
  elif kind == "two_inf" and s >= 2:
    x[rng.choice(s, 2, replace=False)] = np.inf
  elif kind == "nan":
    i = rng.integers(s)
    x[i], w[i] = np.nan, True
  elif kind == "masked_nan":
    i = rng.integers(s)
    x[i], w[i] = np.nan, False
    if not w.any():
      w[(i + 1) % s] = True
  elif kind == "ties":
    x = np.round(x)
  elif kind == "fully_masked":
    w[:] = False
  elif kind == "one_visible":
    w[:] = False
    w[rng.integers(s)] = True
  return x, w


def _case(seed):
  """Random rows of every kind, in a random rank-1..3 layout with a random axis."""
  rng = np.random.default_rng(seed)
  s = int(rng.integers(1, 9))
  kinds = list(ROW_KINDS) * 2
  rows = [_row(k, s, rng) for k in kinds]
  x = np.stack([r[0] for r in rows])
  w = np.stack([r[1] for r in rows])
  rank = int(rng.integers(1, 4))
  if rank == 1:
    i = int(rng.integers(len(rows)))
    return x[i], w[i], 0, [kinds[i]]
  lead = x.shape[0]
  shape = (lead,) if rank == 2 else (2, lead // 2)
  x, w = x.reshape(shape + (s,)), w.reshape(shape + (s,))
  axis = int(rng.integers(rank))
  return np.moveaxis(x, -1, axis), np.moveaxis(w, -1, axis), axis, kinds


DTYPES = ("float32", "bfloat16", "int32", "float64")


def _differentiable_fd(f, x, h=1e-5):
  """Central differences of the float64 numpy function ``f`` at each entry of ``x``, and
  where they are accurate: the one-sided differences agree (no kink, no jump between
  ``x - h`` and ``x + h``) and the central differences at ``h`` and ``h/2`` agree to 1e-7
  of the gradient's scale. The second rule drops points where ``f`` is C1 but its second
  derivative jumps (stablemax at 0, where 1/(1-x) meets x+1): there the central difference
  errs by ~h/4 times the jump, O(h) instead of O(h^2), and halving h halves that error, so
  the two estimates differ by as much as the one at h/2 errs. At a smooth point they differ
  by ~h^2/8 times the third derivative plus rounding 2^-52 |f| / h, ~1e-11: never dropped."""
  x = np.asarray(x, np.float64)
  f0 = f(x)
  g = np.zeros_like(x)
  ok = np.zeros(x.shape, bool)
  for i in np.ndindex(x.shape):
    if not np.isfinite(x[i]):
      continue
    e = np.zeros_like(x)
    e[i] = h
    up, down = (f(x + e) - f0) / h, (f0 - f(x - e)) / h
    half = (f(x + e / 2) - f(x - e / 2)) / h
    g[i] = half
    scale = max(1.0, abs(half))
    ok[i] = abs(up - down) <= 1e-3 * scale and abs(0.5 * (up + down) - half) <= 1e-7 * scale
  return g, ok


def _check_random(name, seed, dtype):
  """The function at ``dtype`` against :mod:`tests.reference_f64` (numpy float64 from the
  formula), values and (where smooth) gradients by central differences of it."""
  spec = N.get(name)
  x, w, axis, _ = _case(seed)
  hp = _learned(spec)
  static = {}
  if dtype == "int32":
    x = np.where(np.isfinite(x), np.clip(np.round(x), -1e4, 1e4), 0.0).astype(np.int32)
  elif dtype == "bfloat16":
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
  xin = jnp.asarray(x, {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int32": jnp.int32,
                        "float64": jnp.float32}[dtype])
  key = jax.random.key(seed)

  if name == "top_k_softmax":
    static["k"] = min(2, x.shape[axis])

  @jax.jit
  def f(v, h):
    if spec.needs_key:
      return spec.fn(key, v, axis, w, **h, **static)
    return spec.fn(v, axis, w, **h, **static)

  def grad(v, h, ct):
    return jax.jit(jax.grad(lambda v, h: jnp.sum(f(v, h) * ct * jnp.isfinite(v)), (0, 1)))(v, h)

  x64 = np.asarray(x, np.float64)
  vis = np.broadcast_to(w, x.shape) & (x64 != -np.inf)
  if dtype == "float64":
    with jax.enable_x64(True):
      got = f(jnp.asarray(x64), {k: jnp.asarray(v, jnp.float64) for k, v in hp.items()})
      assert got.dtype == jnp.float64
      got = np.asarray(got)
  else:
    got = f(xin, hp)
    assert got.dtype == c.output_dtype(xin.dtype), got.dtype
    got = np.asarray(got.astype(jnp.float32), np.float64)
  # rules that need no reference: exact zeros where masked, NaN exactly on NaN rows
  assert (got[~vis] == 0).all(), "masked entries"
  nan_row = np.any(np.isnan(x64) & vis, axis=axis, keepdims=True)
  assert (np.isnan(got) == (nan_row & vis)).all(), "NaN rule"
  if spec.needs_key:
    return  # no float64 reference of the random draw
  ref = ref64.normalizer(name, x64, w, axis, **hp, **static)
  # float32 (and int32 promoted to it): a few roundings of 2^-24 each, amplified by exp
  # of scores up to ~|x| (relative error |x| 2^-24 of e^{x - m}): 2e-4 covers |x| ~ 1e3
  # near the max; the +-1e4 rows put all their mass on entries within O(1) of the max.
  # bfloat16: the input is rounded first (the reference sees the rounded value), the
  # float32 result is rounded to 8 mantissa bits: relative 2^-9 ~ 2e-3, so 2e-2 with the
  # exp amplification. float64: the formulas' float64 roundings, far below 1e-9.
  tol = {"float32": (2e-4, 1e-5), "int32": (2e-4, 1e-5), "float64": (1e-9, 1e-12),
         "bfloat16": (2e-2, 2e-3)}[dtype]
  np.testing.assert_allclose(got, ref, rtol=tol[0], atol=tol[1], equal_nan=True,
                             err_msg=f"{name} seed={seed} {dtype} forward")
  if dtype in ("float32", "float64") and spec.smooth and name not in (
      "top_k_softmax", "top_p_softmax", "epsilon_softmax", "eta_softmax"):
    _check_random_grad(name, seed, dtype, grad, x64, w, axis, hp, static, vis)


def _check_random_grad(name, seed, dtype, grad, x64, w, axis, hp, static, vis):
  """The gradient of <f, ct> against central differences of the float64 reference."""
  dt = jnp.float64 if dtype == "float64" else jnp.float32
  clean = np.where(np.isnan(x64) & vis, 0.0, x64)
  ct = np.random.default_rng(seed + 7).normal(size=x64.shape)
  with jax.enable_x64(dtype == "float64"):
    g = grad(jnp.asarray(clean, dt), {k: jnp.asarray(v, dt) for k, v in hp.items()},
             jnp.asarray(ct, dt))
  for leaf in jax.tree.leaves(g):
    assert np.isfinite(np.asarray(leaf, np.float64)).all(), (
        f"{name} seed={seed} {dtype} gradient not finite")
  fin = np.isfinite(clean)

  def loss(v, h):
    return float(np.sum(np.where(fin, ref64.normalizer(name, v, w, axis, **h, **static), 0.0)
                        * ct))

  # rows with a visible +inf follow their rule, constant in the other entries: skipped
  inf_row = np.broadcast_to(np.any((clean == np.inf) & vis, axis=axis, keepdims=True),
                            x64.shape)
  want_x, ok_x = _differentiable_fd(lambda v: loss(v, hp), clean)
  pairs = [(np.asarray(g[0], np.float64), want_x, ok_x & ~inf_row)]
  if not inf_row.any():
    for k in hp:
      want, ok = _differentiable_fd(lambda v, k=k: loss(clean, {**hp, k: float(v)}),
                                    np.float64(hp[k]))
      pairs.append((np.asarray(g[1][k], np.float64), want, ok))
  # central differences at h = 1e-5 in float64: truncation h^2 f''' / 6 and rounding
  # 2^-52 |L| / h, both far below 1e-6 of the gradient's scale; float32: the forward's
  # rounding amplified by the scores' magnitude (the +-1e4 rows cancel terms as large as x)
  xmag = float(np.abs(np.where(vis & fin, clean, 0.0)).sum())
  for a, b, ok in pairs:
    scale = max(1.0, float(np.abs(b).max()))
    rtol, atol = ((1e-6, 1e-6 * scale + 1e-12 * xmag) if dtype == "float64"
                  else (2e-3, 2e-4 * scale + 1e-6 * xmag))
    np.testing.assert_allclose(np.where(ok, a, 0.0), np.where(ok, b, 0.0), rtol=rtol, atol=atol,
                               err_msg=f"{name} seed={seed} {dtype} gradient")


@pytest.mark.parametrize("name", registry_sample(NAMES))
def test_promise_numerics_randomized_against_float64(name):
  """Sampled: one seeded case per normalizer, the dtype rotating over the names."""
  i = NAMES.index(name)
  _check_random(name, seed=i, dtype=DTYPES[i % len(DTYPES)])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NAMES)
def test_promise_numerics_randomized_against_float64_exhaustive(name, dtype):
  for seed in range(12):
    _check_random(name, seed=1000 + seed, dtype=dtype)
