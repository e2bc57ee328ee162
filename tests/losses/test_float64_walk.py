"""Every public name of ``jaxsoft.losses`` keeps float64 under ``JAX_ENABLE_X64`` (issue 37's
guard "float64 stays float64": no public function silently computes in float32).

Two tables cover ``jaxsoft.losses.__all__``: the losses that take ``where`` (the table of
``test_masked_batches``, called with every example visible) and :data:`EXTRA`, every other
function that computes floats (probabilities, logits, scores, calibration fits, the
MadaCos schedule, ⊥Grad); :data:`EXCLUDED` names the rest with the reason
(``test_every_public_name_is_walked``: a new public name must join one of the three).

A computation in float64 is told from one in float32 without a reference per function:
the inputs are float32 values taken as float64, and each float input in turn is moved,
every entry scaled by ``1 + r 2^-30`` (r in [0.5, 1] with random signs, so that scale- and
shift-invariant functions move too), a change below float32's half ulp (2^-25). A
computation that casts that input to float32 rounds the moved values back to the very same
float32 values and returns the very same output (as ``odin``, the calibration maps,
``unigram_proposal`` and ``adacos_scale``'s ``previous_scale`` did before they were
fixed); one in float64 moves every output. So every floating output must be float64 and
must change when any one input moves (moving one input at a time also catches a function
that casts only one of its inputs). The gradients of a nonlinear functional of the outputs
are float64 too and pass ``jax.test_util.check_grads`` (order 1, reverse mode) at float64
tolerances, except where a docstring says no gradient flows (:data:`GRAD_ARGNUMS`). The
float64 *values* against independent float64 references are the business of
``test_float64_references``. A few functions by default (``tests/default_sample.txt`` may
leave some of :data:`DEFAULT` to the slow run), all of them with ``-m slow``.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft.losses as L
from tests.helpers import sampled
from tests.losses.test_masked_batches import CASES, KEY, LABELS, NOT_PER_EXAMPLE, B, C, D, _normal

EPS = 2.0 ** -30  # a relative change float64 holds and float32 rounds away
# Documented float32 arithmetic: MIDAM's pool runs in its state's dtype (midam_pool_init's
# ``dtype``, float32 by default, so that a lax.scan carry keeps one dtype).
FLOAT32_STATE = {"midam_pool_update"}
DEFAULT = ("dual_softmax_loss", "sdpo_loss", "squared_error_logit_loss")
DEFAULT_EXTRA = ("adacos_scale", "unigram_proposal")

# Public names that are not functions computing floats from float inputs.
EXCLUDED = {
    "FENCHEL_YOUNG_NORMALIZERS": "a constant: the normalizer names fenchel_young_loss takes",
    "MidamPoolState": "a NamedTuple class; its float64 state is walked in midam_pool_update",
    "midam_pool_init": "a constructor without float inputs (its `dtype` argument makes the "
                       "float64 state walked in midam_pool_update)",
    "huffman_tree": "integer-valued: the (paths, codes) arrays of a Huffman tree",
    "sigmoid_head_negatives": "integer-valued: sampled class ids",
    "softmax_collapse_fraction": "a documented float32 diagnostic: whether float32 softmax "
                                 "cross-entropy rounds to exactly 0 (its docstring)",
}


def _uniform(seed, lo, hi, *shape):
  return jnp.asarray(np.random.default_rng(seed).uniform(lo, hi, size=shape), jnp.float32)


def _extra():
  """name -> (call(*floats) -> a pytree of arrays, floats): every public function without
  ``where`` in the loss table, with inputs after its docstring's example."""
  emb, w, logits = _normal(0, B, D), _normal(1, D, C), _normal(2, B, C)
  paths, codes = L.huffman_tree(jnp.arange(1, C + 1, dtype=jnp.float32))
  ctx = jnp.array([[1, 2], [3, 0], [4, 4]])

  def orthogonal(g, p):
    tx = L.orthogonal_gradient()
    return tx.update({"w": g}, tx.init({"w": p}), {"w": p})[0]

  return {
      "acol_probabilities": (L.acol_probabilities, (_normal(30, B, C, 2),)),
      "adacos_scale": (lambda e, c, s: L.adacos_scale(e, c, LABELS, previous_scale=s),
                       (emb, w, jnp.float32(3.0))),
      # tolerance 0 and low targets: every head outside its band, the penalty active
      "attention_entropy_penalty": (
          lambda z, t: L.attention_entropy_penalty(jax.nn.softmax(z), t, tolerance=0.0),
          (_normal(31, 1, 2, 3, 4), _uniform(32, 0.05, 0.2, 2))),
      "class_separation_penalty": (L.class_separation_penalty, (_normal(33, D, C),)),
      "dirichlet_calibrate": (L.dirichlet_calibrate,
                              (logits, _normal(34, C, C), _normal(35, C))),
      "ece": (lambda x: L.ece(x, LABELS, num_bins=4), (logits,)),
      "energy_score": (L.energy_score, (logits,)),
      "fit_dirichlet_calibration": (
          lambda x: L.fit_dirichlet_calibration(x, LABELS, num_steps=2), (logits,)),
      "fit_temperature": (lambda x: L.fit_temperature(x, LABELS, num_steps=3), (logits,)),
      "fourier_head_cross_entropy": (
          lambda a, b: L.fourier_head_cross_entropy(a + 1j * b, LABELS, 6, gamma=0.01),
          (_normal(36, B, 3), _normal(37, B, 3))),
      "hierarchical_softmax_log_probs": (
          lambda h, v: L.hierarchical_softmax_log_probs(h, v, paths, codes),
          (emb, _normal(8, C - 1, D))),
      # the step is the float input (the rates are static Python numbers)
      "madacos_alpha_schedule": (
          lambda t: L.madacos_alpha_schedule(0.5, 0.02, transition_steps=100)(t),
          (jnp.float32(30.0),)),
      # min_scale 1 and ratio 10: neither the scale's floor nor the margin's 0 is active
      "madacos_scale_margin": (
          lambda e, c: L.madacos_scale_margin(e, c, LABELS, alpha=0.02, ratio=10.0,
                                              min_scale=1.0), (emb, w)),
      "marginalized_energy": (L.marginalized_energy, (logits,)),
      "msp": (L.msp, (logits,)),
      "odin": (lambda x, c: L.odin(lambda v: v @ c, x, temperature=2.0, epsilon=0.01),
               (emb, w)),
      "orthogonal_gradient": (orthogonal, (_normal(38, D), _normal(39, D))),
      "partial_fc_loss": (lambda e, c: L.partial_fc_loss(e, c, LABELS), (emb, w)),
      "pointer_sentinel_log_probs": (
          lambda v, p, s: L.pointer_sentinel_log_probs(v, p, s, ctx),
          (logits, _normal(10, B, 2), _normal(11, B))),
      "soft_info_nce_weights": (lambda s: L.soft_info_nce_weights(s, temperature=0.5),
                                (_normal(40, B, C),)),
      "soft_msm": (lambda x, y: L.soft_msm(x, y, gamma=0.5),
                   (_normal(41, 2, 5), _normal(42, 2, 4))),
      "softmax_cpr_logits": (
          lambda h, c, b, p: L.softmax_cpr_logits(h, c, bias=b, context_ids=ctx,
                                                  pointer_scores=p),
          (emb, w, _normal(43, C), _normal(44, B, 2))),
      "spilled_energy": (lambda x: L.spilled_energy(x, LABELS), (logits,)),
      "unigram_proposal": (L.unigram_proposal, (_uniform(45, 0.5, 20.0, C),)),
      "vq_logits": (lambda h, cb, b: L.vq_logits(h, cb, jnp.array([0, 1, 1, 0, 1]), bias=b),
                    (emb, _normal(20, D, 2), _normal(46, C))),
      "wrapped_cauchy_log_density": (
          L.wrapped_cauchy_log_density, (_normal(47, B), _uniform(48, 0.1, 0.9, B),
                                         _normal(49, B))),
  }


EXTRA = _extra()


def _where_case(name):
  """The loss table's call, as a function of the floats with every example visible."""
  call, floats, where_shape = CASES[name]
  if name == "midam_pool_update":  # the documented float64 state
    call = lambda m, s: L.midam_pool_update(L.midam_pool_init(B, dtype=jnp.float64), s,
                                            jnp.arange(B), where=m)[0]
  elif name == "augment_reduce_loss":  # a location of its own: None takes log(1 + S) of the
    # logits without gradient, so the derivative would not be the value's
    call = lambda m, x, mu: L.augment_reduce_loss(KEY, x, LABELS, 4, location=mu, where=m)
    floats = (*floats, _normal(50, B))
  elif name == "energy_bounded_loss":  # margin_out 0: the outlier hinge active, so it moves
    call = lambda m, x, o: L.energy_bounded_loss(x, LABELS, o, margin_out=0.0, where=m,
                                                 outlier_where=m)
  return (lambda *xs: call(jnp.ones(where_shape, bool), *xs)), floats


# Functions whose outputs carry no gradient (or not in every input), by definition: the
# gradient check takes the inputs listed (none: only the dtype of the zero gradients).
GRAD_ARGNUMS = {
    "adacos_scale": (),  # "No gradient flows through it"
    "madacos_scale_margin": (),  # "No gradient flows through them"
    "soft_info_nce_weights": (),  # "No gradient flows (the weights are estimates)"
    "ece": (),  # "Not differentiable (a binned count)"
    # the fits take their held-out logits without gradient (an optimisation's result)
    "fit_temperature": (),
    "fit_dirichlet_calibration": (),
    "soft_clip_loss": (0,),  # "The targets carry no gradient"
    "top_k_threshold_loss": (1,),  # "no gradient flows into scores"
}


def _move(x, seed):
  """``x (1 + r EPS)`` per entry, ``|r|`` in [0.5, 1] with random signs."""
  rng = np.random.default_rng(seed)
  r = rng.uniform(0.5, 1.0, size=x.shape) * rng.choice([-1.0, 1.0], size=x.shape)
  return x * jnp.asarray(1.0 + r * EPS, jnp.float64)


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def _check_float64(name, call, floats):
  floats = tuple(jnp.asarray(np.asarray(x), jnp.float64) for x in floats)
  outputs = jax.jit(lambda *xs: [y for y in jax.tree.leaves(call(*xs))
                                 if jnp.issubdtype(y.dtype, jnp.inexact)])
  base = outputs(*floats)
  assert base, name
  assert all(y.dtype == jnp.float64 for y in base), (name, [y.dtype for y in base])
  assert all(bool(jnp.all(jnp.isfinite(y))) for y in base), name
  for i, x in enumerate(floats):
    moved = _move(x, i)
    assert bool(jnp.all(moved != x)), (name, i)  # each entry moves in float64 ...
    np.testing.assert_array_equal(moved.astype(jnp.float32), x.astype(jnp.float32))  # not f32
    after = outputs(*floats[:i], moved, *floats[i + 1:])
    # float32 inside: the moved input rounds to the same float32 values, the same output
    assert all(bool(jnp.any(a != b)) for a, b in zip(after, base, strict=True)), (name, i)
  # a nonlinear functional: every output entry reaches the gradient with its own weight
  total = lambda *xs: sum(jnp.sum(jnp.sin(1.3 * y + 0.2)) for y in outputs(*xs))
  grads = jax.jit(jax.grad(total, argnums=tuple(range(len(floats)))))(*floats)
  assert all(g.dtype == jnp.float64 for g in grads), (name, [g.dtype for g in grads])
  argnums = GRAD_ARGNUMS.get(name, tuple(range(len(floats))))
  if argnums:
    def of_checked(*xs):
      args = list(floats)
      for i, x in zip(argnums, xs, strict=True):
        args[i] = x
      return total(*args)
    # central differences of step 1e-6 in float64: truncation ~1e-12, cancellation
    # ~1e-16 / 1e-6 = 1e-10, so 1e-7; a float32 forward pass is off by ~6e-8 / 1e-6 = 6e-2
    check_grads(jax.jit(of_checked), tuple(floats[i] for i in argnums), order=1,
                modes=("rev",), atol=1e-7, rtol=1e-7, eps=1e-6)


def test_every_public_name_is_walked():
  public = set(L.__all__)
  assert not set(EXTRA) & set(CASES) and not set(EXCLUDED) & (set(EXTRA) | set(CASES))
  missing = public - set(CASES) - set(EXTRA) - set(EXCLUDED)
  assert not missing, f"add to EXTRA (or EXCLUDED, with the reason): {sorted(missing)}"
  assert set(CASES) | set(EXTRA) | set(EXCLUDED) <= public
  # the where-losses outside the loss table are the score/fit functions walked here
  where_taking = {n for n in public if callable(getattr(L, n))
                  and not inspect.isclass(getattr(L, n))
                  and "where" in inspect.signature(getattr(L, n)).parameters}
  assert where_taking - set(CASES) == NOT_PER_EXAMPLE
  assert NOT_PER_EXAMPLE <= set(EXTRA) | set(EXCLUDED)


@pytest.mark.parametrize("name", sampled(sorted(CASES), DEFAULT))
def test_loss_computes_float64_inputs_in_float64(x64, name):
  _check_float64(name, *_where_case(name))


@pytest.mark.parametrize("name", sampled(sorted(EXTRA), DEFAULT_EXTRA))
def test_function_computes_float64_inputs_in_float64(x64, name):
  _check_float64(name, *EXTRA[name])
