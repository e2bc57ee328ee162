"""A NaN logit at a visible entry gives a NaN loss, as optax's: never a silent 0.

Every loss whose normaliser is ``losses._common.masked_logsumexp`` is called on a batch
whose first row holds one NaN at a visible entry (the second row is finite) and compared
with optax (or ``jax.nn``) on the same inputs: equal values where the loss is the same
function, else the same rows NaN. A NaN at a *masked* entry stays out of the loss (optax's
``where`` does the same), and a row with no visible entry keeps its documented 0.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxsoft.losses as L

NAN = float("nan")
X = jnp.array([[1.0, NAN, 0.0, -0.5], [0.3, -1.2, 2.0, 0.1]])  # row 0: a NaN at a visible class
Y = jnp.array([0, 2])
ONE_HOT = jax.nn.one_hot(Y, 4)
DIAGONAL = jnp.array([0, 1])        # the positives of the score-matrix losses
EMB = jnp.array([[1.0, NAN, 0.5], [0.2, -1.0, 0.4]])
W = jnp.array([[1.0, 0.0, -1.0, 0.5], [0.0, 1.0, 0.0, -0.5], [0.3, 0.2, 0.1, 1.0]])
KEY = jax.random.key(0)


def _optax_ce(logits, labels=Y):
  return optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels)


def _log_stablemax_score(x):
  return jnp.sign(x) * jnp.log1p(jnp.abs(x))


def _cases():
  """name -> (jaxsoft's loss, optax's value on the same inputs, whether they are equal).

  Where the loss is not optax's function (``equal`` False), the reference is optax's CE on
  the logits the loss normalises, and only the NaN rows must agree."""
  square = X[:, :2]
  cb, assign = W[:, :2], jnp.array([0, 1, 1, 0])
  return {
      "softmax_cross_entropy_with_integer_labels": (
          lambda: L.softmax_cross_entropy_with_integer_labels(X, Y), lambda: _optax_ce(X), True),
      "softmax_cross_entropy": (
          lambda: L.softmax_cross_entropy(X, ONE_HOT),
          lambda: optax.losses.softmax_cross_entropy(X, ONE_HOT), True),
      "stablemax_cross_entropy": (  # softmax CE of log s(x)
          lambda: L.stablemax_cross_entropy(X, Y), lambda: _optax_ce(_log_stablemax_score(X)),
          True),
      "stablemax_cross_entropy_probability_targets": (
          lambda: L.stablemax_cross_entropy(X, ONE_HOT),
          lambda: optax.losses.softmax_cross_entropy(_log_stablemax_score(X), ONE_HOT), True),
      "top_k_cross_entropy": (lambda: L.top_k_cross_entropy(X, Y, 4), lambda: _optax_ce(X), True),
      "fenchel_young_loss": (lambda: L.fenchel_young_loss(X, Y, "softmax"),
                             lambda: _optax_ce(X), True),
      "z_loss": (lambda: L.z_loss(X), lambda: jnp.square(jax.nn.logsumexp(X, axis=-1)), True),
      "energy_score": (lambda: L.energy_score(X), lambda: jax.nn.logsumexp(X, axis=-1), True),
      "msp": (lambda: L.msp(X), lambda: jnp.max(jax.nn.softmax(X, axis=-1), axis=-1), True),
      "continual_cross_entropy": (
          lambda: L.continual_cross_entropy(X, Y, jnp.ones((4,), bool)), lambda: _optax_ce(X),
          True),
      "info_nce": (lambda: L.info_nce(X), lambda: _optax_ce(X, DIAGONAL), True),
      "soft_info_nce": (lambda: L.soft_info_nce(X, jnp.ones(X.shape)),
                        lambda: _optax_ce(X, DIAGONAL), True),
      "decoupled_softmax_loss": (  # one positive per row: InfoNCE
          lambda: L.decoupled_softmax_loss(X, jnp.eye(2, 4, dtype=bool)),
          lambda: _optax_ce(X, DIAGONAL), True),
      "top_k_multi_positive_loss": (
          lambda: L.top_k_multi_positive_loss(X, jnp.eye(2, 4, dtype=bool)),
          lambda: _optax_ce(X, DIAGONAL), True),
      "soft_clip_loss": (  # no smoothing: the symmetric InfoNCE
          lambda: L.soft_clip_loss(square, jnp.eye(2), smoothing=0.0),
          lambda: 0.5 * (_optax_ce(square, DIAGONAL) + _optax_ce(square.T, DIAGONAL)), True),
      "pairwise_softmax_loss": (lambda: L.pairwise_softmax_loss(X, Y, activation="exp"),
                                lambda: _optax_ce(X), True),
      "softmax_loss_at_k": (lambda: L.softmax_loss_at_k(X, Y, k=2), lambda: _optax_ce(X), False),
      "squared_error_logit_loss": (
          lambda: L.squared_error_logit_loss(X, Y, jnp.array([-1.0, -0.5])),
          lambda: jnp.square(-_optax_ce(X) - jnp.array([-1.0, -0.5])), True),
      "logit_standardized_kd_loss": (lambda: L.logit_standardized_kd_loss(X, 2.0 * X),
                                     lambda: _optax_ce(X), False),
      "averaged_teacher_kd_loss": (lambda: L.averaged_teacher_kd_loss(X, 2.0 * X[None]),
                                   lambda: _optax_ce(X), False),
      "normalized_softmax_loss": (lambda: L.normalized_softmax_loss(EMB, W, Y),
                                  lambda: _optax_ce(EMB @ W), False),
      "arcface_loss": (lambda: L.arcface_loss(EMB, W, Y), lambda: _optax_ce(EMB @ W), False),
      "cosface_loss": (lambda: L.cosface_loss(EMB, W, Y), lambda: _optax_ce(EMB @ W), False),
      "wcdas_loss": (lambda: L.wcdas_loss(EMB, W, Y, 0.5), lambda: _optax_ce(EMB @ W), False),
      "nbc_softmax_loss": (  # no contrastive term (it mixes the batch's rows): softmax CE
          lambda: L.nbc_softmax_loss(EMB, W, Y, weight=0.0), lambda: _optax_ce(EMB @ W), True),
      "noisy_softmax_loss": (lambda: L.noisy_softmax_loss(KEY, EMB, W, Y),
                             lambda: _optax_ce(EMB @ W), False),
      "sampled_softmax_loss": (  # every class sampled, uniform proposal: the full CE
          lambda: L.sampled_softmax_loss(None, EMB, W, Y, 4, sampled=jnp.arange(4)),
          lambda: _optax_ce(EMB @ W), True),
      "vq_logits_cross_entropy": (
          lambda: L.vq_logits_cross_entropy(EMB, cb, assign, Y),
          lambda: _optax_ce(L.vq_logits(EMB, cb, assign)), True),
      "dual_softmax_loss": (
          lambda: L.dual_softmax_loss(X, 0.5 * X, jnp.array([1, 14])),
          lambda: _optax_ce(X, jnp.array([0, 3])) + _optax_ce(0.5 * X, jnp.array([1, 2])),
          True),
      "pointer_sentinel_loss": (
          lambda: L.pointer_sentinel_loss(X, X[:, :2], jnp.zeros((2,)), jnp.array([[0, 1]] * 2),
                                          Y),
          lambda: _optax_ce(X), False),
      "sdpo_loss": (  # softmax CE over [r_p, r_d...], target 0
          lambda: L.sdpo_loss(X[:, 0], X[:, 1:], jnp.zeros((2,)), jnp.zeros((2, 3))),
          lambda: _optax_ce(X, jnp.array([0, 0])), True),
      "pmrl_loss": (lambda: L.pmrl_loss(EMB[:, None, :] * jnp.ones((2, 2, 1))),
                    lambda: _optax_ce(X), False),
  }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_nan_logit_gives_nan_loss_like_optax(name):
  loss, reference, equal = CASES[name]
  got, want = np.asarray(jax.jit(loss)()), np.asarray(jax.jit(reference)())
  assert np.isnan(got[0]) and np.isnan(want[0]), name
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=name)
  if equal:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("name", ["softmax_cross_entropy_with_integer_labels",
                                  "softmax_cross_entropy", "stablemax_cross_entropy"])
def test_nan_logit_at_a_masked_class_stays_out_like_optax(name):
  where = jnp.array([[True, False, True, True], [True, True, True, True]])
  calls = {
      "softmax_cross_entropy_with_integer_labels": (
          lambda: L.softmax_cross_entropy_with_integer_labels(X, Y, where=where),
          lambda: optax.losses.softmax_cross_entropy_with_integer_labels(X, Y, where=where)),
      "softmax_cross_entropy": (
          lambda: L.softmax_cross_entropy(X, ONE_HOT, where=where),
          lambda: optax.losses.softmax_cross_entropy(X, ONE_HOT, where=where)),
      "stablemax_cross_entropy": (
          lambda: L.stablemax_cross_entropy(X, Y, where=where),
          lambda: _optax_ce(jnp.where(where, _log_stablemax_score(X), -jnp.inf))),
  }
  loss, reference = calls[name]
  got = jax.jit(loss)()
  assert bool(jnp.all(jnp.isfinite(got)))
  np.testing.assert_allclose(got, jax.jit(reference)(), rtol=1e-5)


def test_nan_logit_in_a_masked_example_or_empty_row_keeps_loss_zero():
  @jax.jit
  def losses():
    empty = jnp.full((1, 3), -jnp.inf)
    return (L.softmax_cross_entropy_with_integer_labels(X, Y, where=jnp.array([False, True])),
            L.softmax_cross_entropy(empty, jnp.ones((1, 3)) / 3), L.z_loss(empty))

  masked_example, empty_ce, empty_z = losses()
  np.testing.assert_allclose(masked_example, [0.0, _optax_ce(X)[1]], rtol=1e-6)
  np.testing.assert_array_equal(empty_ce, [0.0])
  np.testing.assert_array_equal(empty_z, [0.0])


def test_nan_logit_row_counts_as_not_collapsed():
  collapsed = jnp.array([[40.0, 0.0, 0.0], [NAN, 0.0, 0.0]])
  fraction = jax.jit(L.softmax_collapse_fraction)(collapsed, jnp.array([0, 0]))
  assert float(fraction) == 0.5
