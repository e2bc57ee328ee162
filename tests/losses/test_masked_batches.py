"""Every loss with a ``where`` argument, on a batch whose examples are all masked out.

The package convention (``jaxsoft.losses``' docstring): masked examples get loss 0 with a
zero gradient, never NaN. One table of tiny calls covers every public loss that takes
``where``; a new loss must join it (``test_every_loss_with_where_is_covered``). Six cases
run by default, all of them with ``-m slow``.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft.losses as L
from tests.helpers import sampled

B, C, D = 3, 5, 4
LABELS = jnp.array([0, 2, 4])
KEY = jax.random.PRNGKey(0)
# Not losses, or fitted/score functions whose `where` selects the data they summarise.
NOT_PER_EXAMPLE = {"acol_probabilities", "adacos_scale", "attention_entropy_penalty", "ece",
                   "energy_score", "marginalized_energy", "spilled_energy",
                   "fit_dirichlet_calibration", "fit_temperature", "msp",
                   "softmax_collapse_fraction", "partial_fc_loss", "madacos_scale_margin",
                   "sigmoid_head_negatives"}


def _normal(seed, *shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _cases():
  """name -> (call(where, *floats), floats, where's shape)."""
  emb, w = _normal(0, B, D), _normal(1, D, C)
  logits, other = _normal(2, B, C), _normal(3, B, C)
  paths, codes = L.huffman_tree(jnp.arange(1, C + 1, dtype=jnp.float32))
  onehot_bool = jnp.eye(B, C, dtype=bool)
  ctx = jnp.array([[1, 2], [3, 0], [4, 4]])
  acol_nodes = _normal(10, B, C, 2)
  return {
      # ACOL's loss and GAR terms are batch statistics: a batch with no visible example is 0
      "acol_gar": (lambda m, z: jnp.stack(L.acol_gar(z, where=m)), (acol_nodes,), (B,)),
      "acol_loss": (lambda m, z: L.acol_loss(z, LABELS, where=m), (acol_nodes,), (B,)),
      "adpo_loss": (lambda m, x, y: L.adpo_loss(x, y, jax.nn.softmax(other), where=m),
                    (logits, other), (B,)),
      "arcface_loss": (lambda m, e, c: L.arcface_loss(e, c, LABELS, where=m), (emb, w), (B,)),
      "augment_reduce_loss": (lambda m, x: L.augment_reduce_loss(KEY, x, LABELS, 4, where=m),
                              (logits,), (B,)),
      "averaged_teacher_kd_loss": (
          lambda m, s, t: L.averaged_teacher_kd_loss(s, t, where=m),
          (logits, _normal(4, 2, B, C)), (B,)),
      "continual_cross_entropy": (
          lambda m, x: L.continual_cross_entropy(
              x, LABELS, jnp.array([True, False, True, False, True]), where=m),
          (logits,), (B,)),
      "constrained_normalized_softmax_loss": (
          lambda m, e, c: L.constrained_normalized_softmax_loss(e, c, LABELS, where=m),
          (emb, w), (B,)),
      "cosface_loss": (lambda m, e, c: L.cosface_loss(e, c, LABELS, where=m), (emb, w), (B,)),
      "decoupled_softmax_loss": (
          lambda m, s: L.decoupled_softmax_loss(s, onehot_bool, where=m), (logits,), (B,)),
      "dice_semimetric_loss": (
          lambda m, p: L.dice_semimetric_loss(jax.nn.sigmoid(p), jnp.eye(B, C), where=m),
          (logits,), (B, C)),
      "discretized_logistic_mixture_loss": (
          lambda m, a, mu, s: L.discretized_logistic_mixture_loss(
              a, mu, s, jnp.array([3, 100, 255]), where=m),
          (_normal(5, B, 2), _normal(6, B, 2), _normal(7, B, 2)), (B,)),
      "dual_softmax_loss": (lambda m, c, f: L.dual_softmax_loss(c, f, LABELS, where=m),
                            (logits, other), (B,)),
      "energy_bounded_loss": (
          lambda m, x, o: L.energy_bounded_loss(x, LABELS, o, where=m, outlier_where=m),
          (logits, other), (B,)),
      "fenchel_young_loss": (lambda m, x: L.fenchel_young_loss(x, LABELS, where=m),
                             (logits,), (B,)),
      "gol_loss": (lambda m, x: L.gol_loss(x, LABELS, where=m), (logits,), (B,)),
      "hierarchical_softmax_loss": (
          lambda m, h, v: L.hierarchical_softmax_loss(h, v, LABELS, paths, codes, where=m),
          (emb, _normal(8, C - 1, D)), (B,)),
      "info_nce": (lambda m, s: L.info_nce(s, symmetric=True, where=m), (_normal(9, B, B),),
                   (B,)),
      "l2_svm_loss": (lambda m, x: L.l2_svm_loss(x, LABELS, where=m), (logits,), (B,)),
      "linear_cross_entropy": (lambda m, h, c: L.linear_cross_entropy(h, c, LABELS, where=m),
                               (emb, w), (B,)),
      "logit_standardized_kd_loss": (
          lambda m, s, t: L.logit_standardized_kd_loss(s, t, where=m), (logits, other), (B,)),
      "midam_pool_update": (
          lambda m, s: L.midam_pool_update(L.midam_pool_init(B), s, jnp.arange(B), where=m)[0],
          (logits,), (B,)),
      "midam_auc_loss": (lambda m, s: L.midam_auc_loss(s, jnp.array([1, 0, 1]), where=m),
                         (logits,), (B, C)),
      "nbc_softmax_loss": (lambda m, e, c: L.nbc_softmax_loss(e, c, LABELS, where=m),
                           (emb, w), (B,)),
      "negative_sampling_loss": (
          lambda m, h, c: L.negative_sampling_loss(KEY, h, c, LABELS, 2, where=m),
          (emb, w), (B,)),
      "noisy_softmax_loss": (
          lambda m, e, c: L.noisy_softmax_loss(KEY, e, c, LABELS, where=m), (emb, w), (B,)),
      "normalized_softmax_loss": (
          lambda m, e, c: L.normalized_softmax_loss(e, c, LABELS, where=m), (emb, w), (B,)),
      "orthogonal_projection_loss": (
          lambda m, e: L.orthogonal_projection_loss(e, LABELS, where=m), (emb,), (B,)),
      "ovr_bce_loss": (lambda m, x: L.ovr_bce_loss(x, LABELS, where=m), (logits,), (B,)),
      "pairwise_softmax_loss": (lambda m, s: L.pairwise_softmax_loss(s, LABELS, where=m),
                                (logits,), (B,)),
      "madacos_loss": (lambda m, e, c: L.madacos_loss(e, c, LABELS, where=m), (emb, w), (B,)),
      "pmrl_contrastive_regularizer": (
          lambda m, e: L.pmrl_contrastive_regularizer(e, where=m), (_normal(21, B, 2, D),), (B,)),
      "pmrl_loss": (lambda m, e: L.pmrl_loss(e, where=m), (emb,), (B,)),
      "pointer_sentinel_loss": (
          lambda m, v, p, s: L.pointer_sentinel_loss(v, p, s, ctx, LABELS, where=m),
          (logits, _normal(10, B, 2), _normal(11, B)), (B,)),
      "sampled_softmax_loss": (
          lambda m, h, c: L.sampled_softmax_loss(KEY, h, c, LABELS, 3, where=m), (emb, w), (B,)),
      "sdpo_loss": (lambda m, a, b, c, d: L.sdpo_loss(a, b, c, d, where=m),
                    (_normal(12, B), _normal(13, B, 2), _normal(14, B), _normal(15, B, 2)), (B,)),
      "sigmoid_head_loss": (
          lambda m, x: L.sigmoid_head_loss(KEY, x, LABELS, other, 2, num_filtered=1, where=m),
          (logits,), (B,)),
      "soft_clip_loss": (lambda m, s, q: L.soft_clip_loss(s, q, where=m),
                         (_normal(16, B, B), _normal(17, B, B)), (B,)),
      "soft_info_nce": (lambda m, s: L.soft_info_nce(s, jnp.ones((B, B)), where=m),
                        (_normal(18, B, B),), (B,)),
      "soft_top_k_loss": (lambda m, s: L.soft_top_k_loss(s, onehot_bool, k=2, where=m),
                          (logits,), (B,)),
      "softmax_cross_entropy": (
          lambda m, x: L.softmax_cross_entropy(x, jax.nn.one_hot(LABELS, C), where=m),
          (logits,), (B,)),
      "softmax_cross_entropy_with_integer_labels": (
          lambda m, x: L.softmax_cross_entropy_with_integer_labels(x, LABELS, where=m),
          (logits,), (B,)),
      "softmax_loss_at_k": (lambda m, s: L.softmax_loss_at_k(s, LABELS, k=2, where=m),
                            (logits,), (B,)),
      "spherical_z_loss": (lambda m, x: L.spherical_z_loss(x, LABELS, where=m), (logits,), (B,)),
      "squared_error_logit_loss": (
          lambda m, x, t: L.squared_error_logit_loss(
              x, LABELS, jnp.take_along_axis(jax.nn.log_softmax(t), LABELS[:, None], 1)[:, 0],
              where=m),
          (logits, other), (B,)),
      "stablemax_cross_entropy": (lambda m, x: L.stablemax_cross_entropy(x, LABELS, where=m),
                                  (logits,), (B,)),
      "tempnet_dro_loss": (
          lambda m, x, t: L.tempnet_dro_loss(x, LABELS, jnp.exp(t), rho=0.5, where=m),
          (logits, _normal(22, B)), (B,)),
      "top_k_cross_entropy": (lambda m, x: L.top_k_cross_entropy(x, LABELS, 2, where=m),
                              (logits,), (B,)),
      "expectation_alignment": (lambda m, s: L.expectation_alignment(s, where=m), (logits,),
                                (B,)),
      "geometry_consistency_loss": (
          lambda m, s, g: L.geometry_consistency_loss(s, jnp.exp(g), where=m), (logits, other),
          (B,)),
      "top_k_multi_positive_loss": (
          lambda m, s: L.top_k_multi_positive_loss(s, onehot_bool, k=2, where=m), (logits,),
          (B,)),
      "top_k_threshold_loss": (lambda m, s, t: L.top_k_threshold_loss(s, t, 2, where=m),
                               (logits, _normal(19, B)), (B,)),
      "vq_logits_cross_entropy": (
          lambda m, h, cb: L.vq_logits_cross_entropy(
              h, cb, jnp.array([0, 1, 1, 0, 1]), LABELS, where=m),
          (emb, _normal(20, D, 2)), (B,)),
      "wcdas_loss": (lambda m, e, c: L.wcdas_loss(e, c, LABELS, 0.5 * jnp.ones(C), where=m),
                     (emb, w), (B,)),
      "z_loss": (lambda m, x: L.z_loss(x, where=m), (logits,), (B,)),
  }


CASES = _cases()
DEFAULT = ("dice_semimetric_loss", "dual_softmax_loss", "noisy_softmax_loss", "sdpo_loss",
           "soft_clip_loss", "squared_error_logit_loss")


def test_every_loss_with_where_is_covered():
  public = {name for name in L.__all__
            if callable(getattr(L, name)) and not inspect.isclass(getattr(L, name))
            and "where" in inspect.signature(getattr(L, name)).parameters}
  assert public - NOT_PER_EXAMPLE == set(CASES)


@pytest.mark.parametrize("name", sampled(sorted(CASES), DEFAULT))
def test_fully_masked_batch_gives_zero_loss_and_zero_gradient(name):
  call, floats, where_shape = CASES[name]
  visible = call(jnp.ones(where_shape, bool), *floats)
  assert bool(jnp.all(jnp.isfinite(visible))) and bool(jnp.any(visible != 0)), name
  hidden = jnp.zeros(where_shape, bool)
  loss = call(hidden, *floats)
  np.testing.assert_array_equal(np.asarray(loss), 0.0)
  grads = jax.grad(lambda *xs: jnp.sum(call(hidden, *xs)), argnums=tuple(range(len(floats))))(
      *floats)
  for g in grads:
    np.testing.assert_array_equal(np.asarray(g), 0.0)
