"""NaN and ``±inf`` logits walked over every public loss (issue 37's guard "NaN and inf
propagate like optax").

One table of tiny calls covers every public function of ``jaxsoft.losses``
(``test_every_public_loss_is_walked``: a new loss must join it, or the short list of
utilities that take no logits). For each, on a batch of three examples:

- **NaN**: one NaN in example 0's input (its logits, scores or embedding) makes example 0's
  loss NaN (a batch-level loss: the loss NaN), never a finite number; the other examples'
  losses are those of the clean batch where the loss is per example (``COUPLED`` lists the
  losses whose examples see each other: contrastive matrices, batch statistics). An
  example whose ``where`` is False keeps loss 0 even with a NaN in it.
- **-inf** on a non-target class of a class-logit loss is a masked class (the package's
  rule, ``jaxsoft.losses``' docstring): the loss is finite and equals the loss with that
  class masked by a class ``where`` (or, for losses whose ``where`` is an example mask
  only, the loss with the logit at ``-1e30``, the formula's limit).
- **+inf** on the target class and on another visible class follows the package's
  documented rule (``jaxsoft.losses``' docstring: NaN for the log-sum-exp losses, as
  optax's, the formula's value elsewhere): checked against ``POSINF``, a table written
  from each formula (a row of the table says why).

The reference for "unaffected" is the same loss on the clean batch; for "masked class" the
same loss with a class mask: both are independent of the non-finite path under test. A few
losses run by default, every one with ``-m slow``.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft.losses as L
from tests.helpers import sampled
from tests.losses.test_masked_batches import CASES as WHERE_CASES
from tests.losses.test_masked_batches import LABELS, B, C, D

NAN, INF = float("nan"), float("inf")
# Public names that are no loss on logits: constructors, schedules, optimizers, constants.
NOT_LOSSES = {
    "FENCHEL_YOUNG_NORMALIZERS",  # a tuple of names
    "MidamPoolState",             # a state container
    "huffman_tree",               # integer codes from counts
    "madacos_alpha_schedule",     # an optax schedule
    "midam_pool_init",            # a zero state
    "orthogonal_gradient",        # an optax transformation
    "unigram_proposal",           # a distribution from counts (no logits)
    "sigmoid_head_negatives",     # returns class indices (its loss is sigmoid_head_loss)
}


def _normal(seed, *shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _extra_cases():
  """The public losses that take no ``where`` or whose ``where`` selects the data they
  summarise (not in test_masked_batches' table): name -> (call(*floats), floats)."""
  logits, emb, w = _normal(30, B, C), _normal(31, B, D), _normal(32, D, C)
  paths, codes = L.huffman_tree(jnp.arange(1, C + 1, dtype=jnp.float32))
  ctx = jnp.array([[1, 2], [3, 0], [4, 4]])
  return {
      "acol_probabilities": (lambda z: L.acol_probabilities(z), (_normal(33, B, C, 2),)),
      "adacos_scale": (  # the dynamic scale (the fixed one does not read the batch)
          lambda e, c: L.adacos_scale(e, c, LABELS, previous_scale=10.0), (emb, w)),
      "attention_entropy_penalty": (  # [B, heads, T, S] probabilities; one value per head
          lambda a: L.attention_entropy_penalty(jax.nn.softmax(a), jnp.array([0.5, 0.5])),
          (_normal(34, B, 2, 3, 4),)),
      "class_separation_penalty": (lambda c: L.class_separation_penalty(c), (w,)),
      "dirichlet_calibrate": (  # the calibrated probabilities (a -inf class keeps 0)
          lambda z: jax.nn.softmax(L.dirichlet_calibrate(z, jnp.eye(C) / 2.0, jnp.zeros(C))),
          (logits,)),
      "ece": (lambda z: L.ece(z, LABELS, num_bins=4), (logits,)),
      "energy_score": (lambda z: L.energy_score(z), (logits,)),
      "fit_dirichlet_calibration": (
          lambda z: L.fit_dirichlet_calibration(z, LABELS, num_steps=2)[0], (logits,)),
      "fit_temperature": (lambda z: L.fit_temperature(z, LABELS, num_steps=3), (logits,)),
      "fourier_head_cross_entropy": (  # N = 1: 2 (N + 1) real coefficients
          lambda a: L.fourier_head_cross_entropy(a, jnp.array([1, 0, 3]), 4),
          (_normal(35, B, 4),)),
      "hierarchical_softmax_log_probs": (
          lambda h, v: L.hierarchical_softmax_log_probs(h, v, paths, codes),
          (emb, _normal(36, C - 1, D))),
      "madacos_scale_margin": (
          lambda e, c: jnp.stack(L.madacos_scale_margin(e, c, LABELS)), (emb, w)),
      "marginalized_energy": (lambda z: L.marginalized_energy(z), (logits,)),
      "msp": (lambda z: L.msp(z), (logits,)),
      "odin": (lambda e: L.odin(lambda u: u @ w, e, temperature=2.0), (emb,)),
      "partial_fc_loss": (lambda e, c: L.partial_fc_loss(e, c, LABELS), (emb, w)),
      "pointer_sentinel_log_probs": (
          lambda v, p, s: L.pointer_sentinel_log_probs(v, p, s, ctx),
          (logits, _normal(37, B, 2), _normal(38, B))),
      "soft_info_nce_weights": (lambda s: L.soft_info_nce_weights(s), (_normal(39, B, B),)),
      "soft_msm": (lambda x, y: L.soft_msm(x, y), (_normal(40, B, 5), _normal(41, B, 5))),
      "softmax_collapse_fraction": (  # one fraction per batch; rows 0 and 2 collapse
          lambda z: L.softmax_collapse_fraction(z, LABELS),
          (logits * jnp.array([[40.0], [1.0], [40.0]]),)),
      "softmax_cpr_logits": (lambda h, c: L.softmax_cpr_logits(h, c), (emb, w)),
      "spilled_energy": (lambda z: L.spilled_energy(z, LABELS), (logits,)),
      "vq_logits": (lambda h, cb: L.vq_logits(h, cb, jnp.array([0, 1, 1, 0, 1])),
                    (emb, _normal(42, D, 2))),
      "wrapped_cauchy_log_density": (
          lambda t: L.wrapped_cauchy_log_density(t, 0.5), (_normal(43, B, C),)),
  }


def _cases():
  """name -> (call(*floats), floats, example where's shape or None)."""
  def all_visible(call, shape):
    return lambda *xs: call(jnp.ones(shape, bool), *xs)

  cases = {}
  for name, (call, floats, where_shape) in WHERE_CASES.items():
    cases[name] = (all_visible(call, where_shape), floats, where_shape)
  for name, (call, floats) in _extra_cases().items():
    cases[name] = (call, floats, None)
  return cases


CASES = _cases()

# Losses whose examples see each other (a batch statistic, a contrastive matrix read by
# columns too, a mean over the batch): a NaN in example 0 may reach every value.
COUPLED = {
    "acol_gar", "acol_loss", "adacos_scale", "class_separation_penalty", "ece",
    "fit_dirichlet_calibration", "fit_temperature", "info_nce", "madacos_loss",
    "madacos_scale_margin", "midam_auc_loss", "nbc_softmax_loss",
    "orthogonal_projection_loss", "pmrl_contrastive_regularizer", "pmrl_loss",
    "soft_clip_loss", "softmax_collapse_fraction",
}
# Where the NaN goes when not at _nan_index: continual_cross_entropy's class 1 is an old
# (masked) class, and spilled_energy's step 0 reads row 0 only at its token (the NaN goes
# to step 1's logits, whose log-sum-exp step 0 reads).
NAN_AT = {"continual_cross_entropy": (0, 2), "spilled_energy": (1, 1)}
# The outputs a NaN reaches when not all of example 0's: elementwise functions and the
# [B, H] penalties (one entry), soft_info_nce_weights (row 0 but its positive, whose
# weight is 1 by definition).
NAN_OUT = {"wrapped_cauchy_log_density": (0, 1), "attention_entropy_penalty": (0, 1),
           "soft_info_nce_weights": (0, slice(1, None))}


def _nan_index(name, x):
  """Example 0's entry that gets the NaN: a non-target class (1) on every further axis."""
  return NAN_AT.get(name, (0,) + tuple(min(1, n - 1) for n in x.shape[1:]))


def _with(x, index, value):
  return x.at[index].set(value)


def test_every_public_loss_is_walked():
  public = {n for n in L.__all__ if n not in NOT_LOSSES}
  assert public == set(CASES), (sorted(public - set(CASES)), sorted(set(CASES) - public))
  assert COUPLED <= set(CASES) and set(NAN_OUT) <= set(CASES)
  with_class_axis = {n for n, (_, floats, _) in CASES.items() if floats[0].shape == (B, C)}
  assert with_class_axis == set(POSINF) | NOT_CLASS_LOGITS, sorted(
      with_class_axis ^ (set(POSINF) | NOT_CLASS_LOGITS))


def _nan_outputs(name):
  call, floats, _ = CASES[name]
  x = floats[0]
  bad = _with(x, _nan_index(name, x), NAN)
  f = jax.jit(lambda *xs: (call(*xs), call(bad, *xs[1:])))
  return [np.asarray(a) for a in f(*floats)]


NAN_DEFAULT = ("spherical_z_loss", "madacos_scale_margin")


@pytest.mark.parametrize("name", sampled(sorted(CASES), NAN_DEFAULT))
def test_nan_input_gives_a_nan_loss_for_its_example(name):
  clean, got = _nan_outputs(name)
  assert np.all(np.isfinite(clean)), name
  if name == "softmax_collapse_fraction":  # documented: a NaN row is not collapsed,
    call, (x,), _ = CASES[name]             # as a uniform row is not
    uniform = np.asarray(jax.jit(call)(x.at[0].set(0.0)))
    assert clean > uniform  # row 0 collapses when finite: the NaN moves the fraction
    np.testing.assert_allclose(got, uniform, rtol=1e-6)
    return
  if got.ndim == 0:  # one value for the batch
    assert np.isnan(got), (name, got)
    return
  region = np.zeros(got.shape, bool)
  region[NAN_OUT.get(name, 0)] = True
  assert np.isnan(got[region]).all(), (name, got)  # never a finite number
  if name not in COUPLED:  # the rest is the clean batch's
    np.testing.assert_allclose(got[~region], clean[~region], rtol=1e-6, atol=1e-7,
                               err_msg=name)


EXAMPLE_MASKED = sorted(n for n, (_, _, s) in CASES.items() if s == (B,))


@pytest.mark.parametrize("name", sampled(EXAMPLE_MASKED, ("nbc_softmax_loss",)))
def test_nan_in_a_masked_example_stays_out(name):
  call, floats, _ = WHERE_CASES[name]
  x = floats[0]
  keep = jnp.array([False, True, True])
  bad = _with(x, _nan_index(name, x), NAN)
  got, clean = jax.jit(lambda *xs: (call(keep, bad, *xs[1:]), call(keep, *xs)))(*floats)
  got, clean = np.asarray(got), np.asarray(clean)
  assert not np.isnan(got).any(), (name, got)
  np.testing.assert_allclose(got, clean, rtol=1e-6, atol=1e-7, err_msg=name)
  if got.ndim and name not in COUPLED:
    assert got[0] == 0, (name, got)


# ------------------------------------------------------------------- ±inf on class logits

# The losses whose first input is class logits [B, C] (example 0's target is class
# LABELS[0] = 0): name -> (+inf on a non-target class, +inf on the target class), each
#   "nan":   NaN: the max-shifted log-sum-exp meets inf - inf (optax's losses give NaN too);
#   "inf":   +inf, the formula's limit (a visible class with infinite logit / margin);
#   "limit": the formula's finite limit, checked against the loss at a logit of 1e30.
LSE = ("nan", "nan")  # the softmax family: a +inf meets the max shift (as optax)
CE = ("inf", "nan")   # log-sum-exp minus the target's logit: +inf, or inf - inf
POSINF = {
    "adpo_loss": LSE,
    "augment_reduce_loss": ("nan", "limit"),  # a +inf target's loss is 0, its other LSE
    "averaged_teacher_kd_loss": LSE,
    "continual_cross_entropy": CE,
    "decoupled_softmax_loss": CE,
    "dirichlet_calibrate": LSE,  # its log-softmax at the +inf entry: inf - inf
    "dual_softmax_loss": CE,
    "ece": LSE,  # the softmax confidence
    "energy_bounded_loss": CE,
    "energy_score": ("inf", "inf"),  # log-sum-exp alone: its limit
    "expectation_alignment": LSE,
    "fenchel_young_loss": LSE,
    "fit_dirichlet_calibration": LSE,  # the fit's log-softmax features: inf - inf
    "fit_temperature": LSE,  # the NLL's log-sum-exp: inf - inf
    "geometry_consistency_loss": LSE,
    "gol_loss": LSE,
    "l2_svm_loss": ("inf", "limit"),  # squared hinges: infinite margin violation, or none
    "logit_standardized_kd_loss": LSE,  # standardised logits: (inf - mean) / std = inf / inf
    "marginalized_energy": ("-inf", "-inf"),  # minus a log-sum-exp
    "midam_auc_loss": ("inf", "inf"),  # a pooled score of +inf in a squared AUC margin
    "midam_pool_update": LSE,
    "msp": LSE,
    "ovr_bce_loss": ("inf", "nan"),  # softplus(x) - x at +inf: inf - inf (optax's too)
    "pairwise_softmax_loss": ("limit", "nan"),
    "pointer_sentinel_log_probs": LSE,
    "pointer_sentinel_loss": LSE,
    "sigmoid_head_loss": ("inf", "limit"),  # sigmoid BCE: -log(1 - 1), -log 1 = 0
    "soft_top_k_loss": LSE,  # the threshold's bracket holds the +inf
    "softmax_cross_entropy": LSE,  # y (x - LSE) at the +inf entry: inf - inf
    "softmax_cross_entropy_with_integer_labels": CE,
    "softmax_loss_at_k": CE,
    "spherical_z_loss": LSE,  # standardised logits: inf / inf
    "spilled_energy": ("inf", "-inf"),  # LSE(z[t + 1]) - z[t, y_t]
    "squared_error_logit_loss": CE,
    "stablemax_cross_entropy": CE,  # s(x) = x + 1 grows without bound: +inf, or inf / inf
    "tempnet_dro_loss": CE,
    "top_k_cross_entropy": CE,
    "top_k_multi_positive_loss": CE,
    "top_k_threshold_loss": ("inf", "inf"),
    "z_loss": ("inf", "inf"),
}
CLASS_LOGITS = set(POSINF)
# The other [B, C] first inputs, which are no class logits (or, for the calibration maps,
# noted below): not walked with ±inf.
NOT_CLASS_LOGITS = {
    "dice_semimetric_loss",        # probabilities (a sigmoid of the input): ±inf are 1 and 0
    "soft_msm",                    # time series: ±inf values meet inf - inf in the costs
    "softmax_collapse_fraction",   # a diagnostic of float32 rounding, not a loss
    "wrapped_cauchy_log_density",  # angles: cos(±inf) has no limit
}
# The fits' class ``where`` (they are not in test_masked_batches' table, whose ``where``
# is per example): the -inf logit's reference is the fit with that class masked.
FIT_CLASS_WHERE = {
    "fit_dirichlet_calibration":
        lambda m, z: L.fit_dirichlet_calibration(z, LABELS, num_steps=2, where=m)[0],
    "fit_temperature": lambda m, z: L.fit_temperature(z, LABELS, num_steps=3, where=m),
}
# Class-logit losses whose ``where`` is an example mask only (no class mask) or for which a
# -inf logit is not a removed class: checked against the formula's limit, -1e30.
NO_CLASS_WHERE = {
    "augment_reduce_loss", "dual_softmax_loss", "pointer_sentinel_loss",
    "midam_pool_update",   # instances of a bag pooled by a mean: -inf is a member scoring -inf
    "sigmoid_head_loss",   # a -inf negative still fills its sampled slot (with loss 0)
}
# Where the ±inf goes when not at (0, 1) / (0, LABELS[0]): spilled_energy's step 0 reads
# step 1's log-sum-exp and its own token's logit.
INF_AT = {"continual_cross_entropy": ((0, 2), (0, 0)), "spilled_energy": ((1, 1), (0, 0))}
BIG = 1e30


def _class_logit_outputs(name):
  call, floats, _ = CASES[name]
  x = floats[0]
  assert x.shape == (B, C), name
  other, target = INF_AT.get(name, ((0, 1), (0, int(LABELS[0]))))
  variants = {"clean": x, "neginf": x.at[other].set(-INF), "negbig": x.at[other].set(-BIG)}
  for where, index in (("other", other), ("target", target)):
    for kind, value in (("inf", INF), ("big", BIG), ("half", 1e15)):
      variants[f"pos{kind}_{where}"] = x.at[index].set(value)
  outs = jax.jit(lambda vs, rest: {k: call(v, *rest) for k, v in vs.items()})(variants,
                                                                             floats[1:])
  outs = {k: np.asarray(o) for k, o in outs.items()}
  if (name in WHERE_CASES and name not in NO_CLASS_WHERE) or name in FIT_CLASS_WHERE:
    where_call = FIT_CLASS_WHERE.get(name) or WHERE_CASES[name][0]
    classes = jnp.ones((B, C), bool).at[other].set(False)
    outs["masked"] = np.asarray(jax.jit(lambda *xs: where_call(classes, *xs))(*floats))
  return outs


def _row0(a):
  """Example 0's values (the value itself for a loss with one value per batch)."""
  return a if a.ndim == 0 else a[0]


POSINF_DEFAULT = ("l2_svm_loss",)


@pytest.mark.parametrize("name", sampled(sorted(POSINF), POSINF_DEFAULT))
def test_neginf_logit_is_a_masked_class(name):
  outs = _class_logit_outputs(name)
  got = outs["neginf"]
  assert np.all(np.isfinite(got)), (name, got)
  want = outs.get("masked", outs["negbig"])
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("name", sampled(sorted(POSINF), POSINF_DEFAULT))
def test_posinf_logit_follows_the_documented_rule(name):
  outs = _class_logit_outputs(name)
  for where, rule in zip(("other", "target"), POSINF[name], strict=True):
    got, clean = outs[f"posinf_{where}"], outs["clean"]
    row0, big0, half0 = (_row0(outs[f"pos{k}_{where}"]) for k in ("inf", "big", "half"))
    if name not in COUPLED and got.ndim:  # the other examples do not see example 0
      np.testing.assert_allclose(got[1:], clean[1:], rtol=1e-6, atol=1e-7, err_msg=name)
    if rule == "nan":
      assert np.isnan(row0).all(), (name, where, row0)
    elif rule in ("inf", "-inf"):
      sign = 1.0 if rule == "inf" else -1.0
      assert np.all(row0 == sign * INF), (name, where, row0)
      # the limit is infinite indeed: the loss grows without bound along the way
      assert np.all((sign * big0 == INF) | (sign * big0 > sign * half0)), (name, big0, half0)
    else:
      assert rule == "limit", rule
      assert np.all(np.isfinite(row0)), (name, where, row0)
      np.testing.assert_allclose(row0, big0, rtol=1e-6, atol=1e-7, err_msg=f"{name} {where}")
