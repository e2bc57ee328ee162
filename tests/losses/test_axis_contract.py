"""The losses' ``axis`` contract and input dtypes (issue 37, defects 5 and 16).

- A tuple ``axis`` (None: every axis) works as optax 0.2.8 reads it: the named axes form one
  class axis, an integer label is a flat index into ``logits[axis]``; checked against optax
  itself and, for every class-axis loss, against the same loss on the explicitly merged
  logits (the definition).
- ``axis`` is positional where optax's loss of the same name has it positional, and
  keyword-only everywhere else (optax's rule: its losses with hyperparameters put ``axis``
  after ``*``).
- Integer inputs promote to float as jax.nn's (and the normalizers') do.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft as js
from tests.helpers import check_raises, normal, sampled

L = js.losses
SHAPE = (2, 3, 4, 5)  # classes on axes 1 and 3: 15 classes per example, batch (2, 4)


def _merged(a, axes):
  """``a`` with ``axes`` moved last (in the order given) and flattened: optax's reading."""
  axes = tuple(d % a.ndim for d in axes)
  rest = tuple(d for d in range(a.ndim) if d not in axes)
  moved = jnp.transpose(a, rest + axes)
  return moved.reshape(moved.shape[:len(rest)] + (-1,))


def _int_labels(seed, shape, n):
  return jax.random.randint(jax.random.key(seed), shape, 0, n)


def _probs(seed, axes):
  return jax.nn.softmax(normal(seed, SHAPE, 2.0), axis=axes)


# float32 on both sides, summed in different orders over at most 120 classes: a relative
# difference of a few float32 ulps times the number of terms.
OPTAX_TOL = dict(rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("axes", sampled([(1, 3), (3, 1), (-3, -1)], {"1,3"},
                                          ids=["1,3", "3,1", "-3,-1"]))
def test_tuple_axis_integer_labels_equals_optax(axes):
  x = normal(0, SHAPE, 3.0)
  labels = _int_labels(1, (2, 4), 15)
  # both in one compilation instead of one per eager operation
  mine, ref = jax.jit(lambda x, labels: (
      L.softmax_cross_entropy_with_integer_labels(x, labels, axes),
      optax.losses.softmax_cross_entropy_with_integer_labels(x, labels, axis=axes)))(x, labels)
  assert mine.shape == ref.shape == (2, 4)
  np.testing.assert_allclose(mine, ref, **OPTAX_TOL)


def test_tuple_axis_integer_labels_with_where_equals_optax():
  x = normal(2, SHAPE, 3.0)
  labels = _int_labels(3, (2, 4), 15)
  classes = jax.random.bernoulli(jax.random.key(4), 0.8, SHAPE)
  classes = classes.at[..., 0].set(True)  # label 0 stays visible ...
  labels = jnp.where(jnp.take_along_axis(_merged(classes, (1, 3)), labels[..., None],
                                         axis=-1)[..., 0], labels, 0)  # ... and every label
  examples = jnp.array([[True, False, True, True], [False, True, True, True]])
  for where in (classes, examples):
    mine = L.softmax_cross_entropy_with_integer_labels(x, labels, (1, 3), where)
    ref = optax.losses.softmax_cross_entropy_with_integer_labels(x, labels, axis=(1, 3),
                                                                  where=where)
    np.testing.assert_allclose(mine, ref, **OPTAX_TOL)


@pytest.mark.parametrize("axes", sampled([(1, 3), None, (0, 1, 2, 3)], {"1,3", "None"},
                                          ids=["1,3", "None", "all"]))
def test_tuple_axis_probability_labels_equals_optax(axes):
  x = normal(5, SHAPE, 3.0)
  y = jax.nn.softmax(normal(6, SHAPE, 2.0), axis=axes)
  mine = L.softmax_cross_entropy(x, y, axes)
  ref = optax.losses.softmax_cross_entropy(x, y, axis=axes)
  assert mine.shape == ref.shape
  np.testing.assert_allclose(mine, ref, **OPTAX_TOL)
  where = jax.random.bernoulli(jax.random.key(7), 0.8, SHAPE).at[:, 0, :, 0].set(True)
  if axes == (1, 3):
    mine = L.softmax_cross_entropy(x, y, axes, where)
    ref = optax.losses.softmax_cross_entropy(x, y, axis=axes, where=where)
    np.testing.assert_allclose(mine, ref, **OPTAX_TOL)


def test_tuple_axis_gradient_equals_optax():
  x = normal(8, SHAPE, 3.0)
  labels = _int_labels(9, (2, 4), 15)
  g = jax.grad(lambda z: L.softmax_cross_entropy_with_integer_labels(z, labels, (1, 3)).sum())
  g_ref = jax.grad(lambda z: optax.losses.softmax_cross_entropy_with_integer_labels(
      z, labels, axis=(1, 3)).sum())
  np.testing.assert_allclose(jax.jit(g)(x), jax.jit(g_ref)(x), rtol=1e-5, atol=1e-6)


# Every loss of js.losses whose `axis` is a class axis: (call with a given axis, the arrays
# laid out like the logits). The reference is the same loss on the merged arrays, axis=-1.
def _class_axis_losses():
  x, t = normal(10, SHAPE, 2.0), normal(11, SHAPE, 2.0)
  ints = _int_labels(12, (2, 4), 15)
  p = _probs(13, (1, 3))
  cur = jnp.zeros(SHAPE, bool).at[:, :2].set(True)
  return {
      "softmax_cross_entropy": lambda ax, m: L.softmax_cross_entropy(m(x), m(p), ax),
      "softmax_cross_entropy_with_integer_labels":
          lambda ax, m: L.softmax_cross_entropy_with_integer_labels(m(x), ints, ax),
      "top_k_cross_entropy": lambda ax, m: L.top_k_cross_entropy(m(x), ints, 4, axis=ax),
      "stablemax_cross_entropy": lambda ax, m: L.stablemax_cross_entropy(m(x), m(p), axis=ax),
      "softmax_collapse_fraction":
          lambda ax, m: L.softmax_collapse_fraction(m(x * 30), ints, axis=ax),
      "z_loss": lambda ax, m: L.z_loss(m(x), axis=ax),
      "spherical_z_loss": lambda ax, m: L.spherical_z_loss(m(x), ints, axis=ax),
      "ovr_bce_loss": lambda ax, m: L.ovr_bce_loss(m(x), m(p), axis=ax),
      "gol_loss": lambda ax, m: L.gol_loss(m(x), ints, axis=ax),
      "l2_svm_loss": lambda ax, m: L.l2_svm_loss(m(x), ints, axis=ax),
      "msp": lambda ax, m: L.msp(m(x), axis=ax),
      "energy_score": lambda ax, m: L.energy_score(m(x), axis=ax),
      "marginalized_energy": lambda ax, m: L.marginalized_energy(m(x), axis=ax),
      "energy_bounded_loss":
          lambda ax, m: L.energy_bounded_loss(m(x), ints, m(t), margin_in=-3.0, axis=ax),
      "ece": lambda ax, m: L.ece(m(x), ints, num_bins=4, axis=ax),
      "continual_cross_entropy":
          lambda ax, m: L.continual_cross_entropy(m(x), ints, m(cur), axis=ax),
      "logit_standardized_kd_loss":
          lambda ax, m: L.logit_standardized_kd_loss(m(x), m(t), axis=ax),
      "averaged_teacher_kd_loss": lambda ax, m: L.averaged_teacher_kd_loss(
          m(x), jnp.stack([m(t), m(2 * t)]), axis=ax),
      "squared_error_logit_loss": lambda ax, m: L.squared_error_logit_loss(
          m(x), ints, -jnp.ones((2, 4)), axis=ax),
      "tempnet_dro_loss": lambda ax, m: L.tempnet_dro_loss(
          m(x), ints, jnp.full((2, 4), 0.7), rho=0.1, axis=ax),
      "expectation_alignment": lambda ax, m: L.expectation_alignment(m(x), axis=ax),
      "geometry_consistency_loss":
          lambda ax, m: L.geometry_consistency_loss(m(x), m(p), axis=ax),
  }


CLASS_AXIS_LOSSES = _class_axis_losses()


@pytest.mark.parametrize("name", sampled(sorted(CLASS_AXIS_LOSSES), {
    "softmax_cross_entropy", "stablemax_cross_entropy", "averaged_teacher_kd_loss",
    "continual_cross_entropy", "ovr_bce_loss"}))
def test_tuple_axis_is_the_merged_class_axis(name):
  call = CLASS_AXIS_LOSSES[name]
  mine = call((1, 3), lambda a: a)
  ref = call(-1, lambda a: a if a.shape != SHAPE else _merged(a, (1, 3)))
  assert mine.shape == ref.shape
  np.testing.assert_allclose(mine, ref, rtol=1e-6, atol=1e-7)


def test_every_class_axis_loss_is_covered():
  """A loss gaining an ``axis`` must join CLASS_AXIS_LOSSES (or its owner's own tests)."""
  others = {"dice_semimetric_loss",  # axis = the axes summed over, tuples tested in its file
            "fenchel_young_loss",    # jaxsoft/losses/_fenchel_young.py, tested there
            # an int axis only: the sampled negatives are indices along one class axis
            "sigmoid_head_loss", "sigmoid_head_negatives"}
  with_axis = {n for n in dir(L) if not n.startswith("_") and callable(getattr(L, n))
               and "axis" in _params(getattr(L, n))}
  assert with_axis - others == set(CLASS_AXIS_LOSSES)


def test_tuple_axis_example_where_and_empty_rows():
  x = normal(14, SHAPE, 2.0)
  ints = _int_labels(15, (2, 4), 15)
  keep = jnp.array([[True, False, True, True], [True, True, False, True]])
  out = L.stablemax_cross_entropy(x, ints, axis=(1, 3), where=keep)
  ref = L.stablemax_cross_entropy(_merged(x, (1, 3)), ints, where=keep)
  np.testing.assert_allclose(out, ref, rtol=1e-6)
  assert out[0, 1] == 0 and out[1, 2] == 0


def test_bad_axis_names_the_function_and_argument():
  x, y = normal(16, SHAPE), _int_labels(17, (2, 4), 15)
  ce = L.softmax_cross_entropy_with_integer_labels
  check_raises(
      (r"softmax_cross_entropy_with_integer_labels: `axis` must be an int, a tuple",
       lambda: ce(x, y, "1")),
      (r"softmax_cross_entropy_with_integer_labels: `axis` .* twice", lambda: ce(x, y, (1, 1))),
      (r"z_loss: `axis` 4 is out of range", lambda: L.z_loss(x, axis=(1, 4))),
      (r"z_loss: `axis` must be an int, a tuple", lambda: L.z_loss(x, axis=(1.0, 3))),
      (r"softmax_cross_entropy: `labels` of shape \(2, 3, 4, 4\) must have the shape of "
       r"`logits`", lambda: L.softmax_cross_entropy(x, x[..., :4], (1, 3))),
      (r"softmax_cross_entropy_with_integer_labels: `labels`", lambda: ce(x, y[:, :3], (1, 3))),
  )


# ---------------------------------------------------------------- positional or keyword-only


def _params(fn):
  return inspect.signature(fn).parameters


def _public_losses():
  return {n: getattr(L, n) for n in dir(L) if not n.startswith("_")
          and inspect.isfunction(getattr(L, n))}


def test_axis_is_positional_exactly_where_optax_has_it_positional():
  checked = 0
  for name, fn in _public_losses().items():
    params = _params(fn)
    if "axis" not in params:
      continue
    checked += 1
    mine = params["axis"]
    ref_fn = getattr(optax.losses, name, None)
    if ref_fn is not None and "axis" in _params(ref_fn):
      ref_params = _params(ref_fn)
      ref = ref_params["axis"]
      assert mine.kind == ref.kind, (name, mine.kind, ref.kind)
      if ref.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD:
        names, ref_names = list(params), list(ref_params)
        i = ref_names.index("axis")
        assert names[:i + 2] == ref_names[:i + 2], (name, names, ref_names)  # ..., axis, where
    else:
      assert mine.kind == inspect.Parameter.KEYWORD_ONLY, (name, mine.kind)
    assert mine.default == -1, name
  assert checked >= 15


def test_optax_positional_calls_work_unchanged():
  x = normal(18, (3, 5))
  y = _int_labels(19, (3,), 5)
  where = jnp.array([True, False, True])
  p = jax.nn.softmax(normal(20, (3, 5)))

  @jax.jit  # one compilation instead of one per eager operation
  def run(x, y, where, p):
    return ((L.softmax_cross_entropy_with_integer_labels(x, y, -1, where),
             optax.losses.softmax_cross_entropy_with_integer_labels(x, y, -1, where)),
            (L.softmax_cross_entropy(x, p, 0), optax.losses.softmax_cross_entropy(x, p, 0)))

  for mine, ref in run(x, y, where, p):
    np.testing.assert_allclose(mine, ref, rtol=1e-6)


# ---------------------------------------------------------------- integer inputs promote


def _int_cases():
  """name -> (loss, args, indices of the arrays that are real-valued inputs)."""
  ints = lambda seed, shape: jax.random.randint(jax.random.key(seed), shape, -3, 4)  # noqa: E731
  y = jnp.array([0, 2, 1, 3])
  return {
      "info_nce": (L.info_nce, (ints(0, (4, 4)),), (0,)),
      "soft_info_nce": (L.soft_info_nce, (ints(1, (4, 4)), jnp.ones((4, 4), jnp.int32)), (0, 1)),
      "decoupled_softmax_loss": (L.decoupled_softmax_loss,
                                 (ints(2, (4, 4)), jnp.eye(4, dtype=bool)), (0,)),
      "arcface_loss": (L.arcface_loss, (ints(3, (4, 6)), ints(4, (6, 5)), y), (0, 1)),
      "cosface_loss": (L.cosface_loss, (ints(5, (4, 6)), ints(6, (6, 5)), y), (0, 1)),
      "normalized_softmax_loss": (L.normalized_softmax_loss,
                                  (ints(7, (4, 6)), ints(8, (6, 5)), y), (0, 1)),
      "nbc_softmax_loss": (L.nbc_softmax_loss, (ints(19, (4, 6)), ints(20, (6, 5)), y), (0, 1)),
      "wcdas_loss": (L.wcdas_loss, (ints(21, (4, 6)), ints(22, (6, 5)), y, 0.5), (0, 1)),
      "orthogonal_projection_loss": (L.orthogonal_projection_loss, (ints(9, (4, 6)), y), (0,)),
      "pmrl_loss": (L.pmrl_loss, (ints(10, (4, 3, 6)),), (0,)),
      "sdpo_loss": (L.sdpo_loss, (ints(11, (4,)), ints(12, (4, 2)), ints(13, (4,)),
                                  ints(14, (4, 2))), (0, 1, 2, 3)),
      "midam_auc_loss": (L.midam_auc_loss, (ints(15, (4, 3)), jnp.array([0, 1, 1, 0])), (0,)),
      "soft_msm": (L.soft_msm, (ints(16, (2, 5)), ints(17, (2, 5))), (0, 1)),
      "madacos_loss": (L.madacos_loss, (ints(24, (4, 6)), ints(25, (6, 5)), y), (0, 1)),
      "soft_top_k_loss": (lambda s, p: L.soft_top_k_loss(s, p, k=2),
                          (ints(23, (4, 5)), jnp.eye(4, 5, dtype=bool)), (0,)),
      "softmax_cross_entropy_with_integer_labels":
          (L.softmax_cross_entropy_with_integer_labels, (ints(18, (4, 5)), y), (0,)),
  }


INT_CASES = _int_cases()


@pytest.mark.parametrize("name", sampled(sorted(INT_CASES), {"info_nce", "arcface_loss",
                                                            "sdpo_loss"}))
def test_integer_inputs_promote_as_jax_nn(name):
  fn, args, real = INT_CASES[name]
  floats = [a.astype(jnp.float32) if i in real else a for i, a in enumerate(args)]
  out = fn(*args)
  ref = fn(*floats)
  assert out.dtype == jnp.float32, (name, out.dtype)
  np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)


def test_complex_inputs_are_refused_naming_the_argument():
  z = jnp.ones((4, 4), jnp.complex64)
  check_raises(
      (r"info_nce: `scores` must have a real dtype", lambda: L.info_nce(z)),
      (r"arcface_loss: `embeddings` must have a real dtype",
       lambda: L.arcface_loss(z, jnp.ones((4, 3)), jnp.array([0, 1, 2, 0]))),
  )
