"""One generated walk of the registries under remat, scan, ``jax.export``, vmap, jit with traced
hyperparameters, forward mode and second order (issue 37's "Transformations" guard: a new
function inherits all of it).

The walk: every registered normalizer (``jaxsoft.normalizers.names()``); every CPU
implementation of ``js.attention.dot_product_attention`` ("xla", "xla_chunked", and the
Pallas kernel in interpret mode) with a normalizer of each kernel class E, S, P, T and R;
every ``jaxsoft.linear`` family in each of its forms (``jaxsoft.linear.IMPLEMENTATIONS``:
the Pallas chunk kernels where a family has them); every loss with the ``axis`` contract of
tests/losses/test_axis_contract.py. Each case is a function of arrays whose leading axis is
the batch, differentiated in a fixed nonlinear functional of its floating outputs
(``sum sin(1.3 y + 0.2)``: every output entry reaches the gradient with its own weight). The
reference is the plain jitted call (value and gradient); each check computes the same thing
under one transformation:

* ``jax.checkpoint`` (remat) of the function: the same value and gradient;
* ``lax.scan`` over two stacked inputs: equal to a Python loop of the plain call;
* ``jax.export`` with a symbolic batch (``symbolic_shape("b")``), serialized and
  deserialized, called at two batch sizes: equal to the plain call at each;
* ``jax.vmap`` with ``in_axes=1`` (the two inputs stacked on a non-leading axis): equal to
  the loop;
* ``jax.jit`` with the case's floating hyperparameters traced (normalizers: every
  ``Param`` not declared ``static``; attention: its normalizer's; losses: the keyword
  floats annotated ``ArrayLike``): equal to the static call, and the gradient in them
  equal to a float64 central difference;
* forward mode: ``jax.test_util.check_grads`` (fwd and rev) in float64 and ``jax.jacfwd``
  equal to ``jax.grad``; ``jax.jvp`` of a jitted call equal to reverse mode, or JAX's
  custom_vjp TypeError where the call has a custom VJP (never a number);
* second order: Hessian-vector products (``jax.jvp`` of ``jax.grad``, ``jax.grad`` of
  ``jax.grad``) equal to a float64 central difference of the gradient;

and, on the blockwise attention paths and the Pallas linear kernels (first-order reverse
mode only, documented), forward mode and second order raise
``js.attention.UnsupportedDifferentiation``.

Tolerance: every pair is the same float32 computation (no reference formula in between),
compiled into a different program: XLA may fuse, reorder and contract differently, so a
few float32 ulps per operation over rows of at most a few dozen terms, and the iterative
solvers (threshold bisection, fixed points) stop at the same tolerance: 2e-5 relative,
with an absolute floor of 2e-5 of the largest entry. Integer outputs (indices) are equal.
The reference must be finite (no silent NaN). The derivative checks' float64 tolerances
are justified where they are defined.

The default run samples one case per registry (:data:`DEFAULT`); ``-m slow`` walks everything
(the Pallas cases run the kernels in the Pallas interpreter, ``JAXSOFT_PALLAS_INTERPRET=1``,
as the other CPU tests of the kernels do; they are also marked ``kernels``).
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import jax.test_util as jtu
import numpy as np
import pytest
from jax import export

import jaxsoft as js
from jaxsoft import linear
from jaxsoft import normalizers as N
from kernels_pallas.backends import INTERPRET_ENV

F32 = np.float32
# The second batch size of the exported programs (the first is the reference's, 2).
BATCHES = (2, 3)


@dataclasses.dataclass(frozen=True)
class Case:
  """``fn(*arrays)`` -> a pytree; ``make(batch, seed)`` -> the arrays (batch leading).

  ``hparams``: the case's traceable floating hyperparameters and the (non-default) values
  the traced-hyperparameter check uses; ``build(**hparams)`` -> ``fn`` with those
  hyperparameters (Python floats or traced arrays). ``smooth``: the derivative is that of
  the function, so finite differences check it (False for a surrogate, sampled or
  non-differentiable one: the normalizers declared not smooth, the losses documented "Not
  differentiable"; the checks against differences then compare the modes only).
  ``reverse_only``:
  the path is documented first-order reverse mode only (its forward mode and second order
  raise ``js.attention.UnsupportedDifferentiation``). ``custom_vjp``: the derivative of the
  call is a custom VJP (the blockwise attention paths, the linear chunked and Pallas
  forms), which ``jax.jvp`` of a ``jax.jit``-compiled call cannot pass (JAX's TypeError).
  ``keyed``: the case draws random numbers, which differ between float32 and float64.
  """

  fn: Callable
  make: Callable
  hparams: Mapping[str, float] = dataclasses.field(default_factory=dict)
  build: Callable | None = None
  smooth: bool = True
  reverse_only: bool = False
  custom_vjp: bool = False
  keyed: bool = False


def _rng(seed, salt):
  return np.random.default_rng([seed, salt])


def _normal(rng, shape, scale=1.0):
  return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)


def _uniform(rng, shape, lo, hi):
  return jnp.asarray(rng.uniform(lo, hi, shape), jnp.float32)


# ----------------------------------------------------------------------------- normalizers


def _row_length(spec):
  """Longer than any integer hyperparameter's default (top-k's k < row length)."""
  ints = [p.default for p in spec.params
          if isinstance(p.default, int) and not isinstance(p.default, bool)]
  return max([8] + [k + 2 for k in ints])


def _spec_hparams(spec):
  """A spec's traceable hyperparameters (every one not declared ``static``) with a value
  (the declared sample, else the default; None, a data-dependent default, is left out)."""
  out = {}
  for p in spec.params:
    value = p.sample if p.sample is not None else p.default
    if not p.static and isinstance(value, float):
      out[p.name] = value
  return out


def _normalizer_case(name):
  spec = N.get(name)
  n = _row_length(spec)
  key = jax.random.key(0)

  def build(**hp):
    def fn(x, where):
      if spec.needs_key:
        return spec.fn(key, x, axis=-1, where=where, **hp)
      return spec.fn(x, axis=-1, where=where, **hp)
    return fn

  def make(batch, seed):
    rng = _rng(seed, 1)
    where = rng.random((batch, 3, n)) < 0.75
    where[..., 0] = True
    return _normal(rng, (batch, 3, n), 2.0), jnp.asarray(where)

  return Case(build(), make, _spec_hparams(spec), build, spec.smooth, keyed=spec.needs_key)


# ----------------------------------------------------------------------------- attention

# One normalizer of each kernel class attention dispatches on (X, the stochastic class,
# has its own key plumbing and is walked as a normalizer above).
ATTENTION_NORMALIZERS = {"E": "softmax", "S": "stablemax", "P": "sigmoid", "T": "sparsemax",
                         "R": "standardized_softmax"}
# The implementations that run on a CPU (the GPU/TPU ones: pallas_triton,
# pallas_mosaic_tpu and cudnn need their device; "pallas" runs the kernel interpreted).
ATTENTION_IMPLEMENTATIONS = ("xla", "xla_chunked", "pallas")


# The blockwise paths: a custom VJP, first-order reverse mode only (documented in
# jaxsoft.attention.differentiation).
BLOCKWISE = ("xla_chunked", "pallas")


def _attention_case(implementation, normalizer):
  def build(**hp):
    def fn(q, k, v, lengths):
      return js.attention.dot_product_attention(
          q, k, v, is_causal=True, key_value_seq_lengths=lengths,
          implementation=implementation, normalizer=normalizer, normalizer_params=hp or None)
    return fn

  def make(batch, seed):
    rng = _rng(seed, 2)
    T, N_, K, H = 6, 2, 1, 4
    return (_normal(rng, (batch, T, N_, H)), _normal(rng, (batch, T, K, H)),
            _normal(rng, (batch, T, K, H)), jnp.asarray(rng.integers(3, T + 1, batch), jnp.int32))

  spec = N.get(normalizer)
  blockwise = implementation in BLOCKWISE
  return Case(build(), make, _spec_hparams(spec), build, spec.smooth,
              reverse_only=blockwise, custom_vjp=blockwise)


# ----------------------------------------------------------------------------- linear

T_LIN, N_LIN, K_LIN, V_LIN, CHUNK = 8, 2, 3, 2, 4
PALLAS_CHUNK = 16


def _qkv(rng, batch, unit_keys=False):
  shape = (batch, T_LIN, N_LIN)
  q, k = _normal(rng, shape + (K_LIN,)), _normal(rng, shape + (K_LIN,))
  return q, (linear.l2_normalize(k) if unit_keys else k), _normal(rng, shape + (V_LIN,))


def _gate(rng, batch, *extra):
  return _uniform(rng, (batch, T_LIN, N_LIN) + extra, -1.0, -0.05)


def _beta(rng, batch):
  return _uniform(rng, (batch, T_LIN, N_LIN), 0.1, 1.5)


# family -> (its forms, call(form) -> fn, make_extra(rng, batch) -> the arrays after q, k, v,
# unit keys). ``fn`` returns the output and, where the family has one, the final state.
def _state(fn, **kw):
  def call(form):
    # the Triton chunk kernels take power-of-two chunks >= 16 only: T_LIN is then one
    # partial chunk (the chunked form's own split is walked with CHUNK)
    kws = dict(kw, chunk_size=PALLAS_CHUNK) if form == "pallas" and "chunk_size" in kw else kw
    return lambda q, k, v, *a: fn(q, k, v, *a, implementation=form, output_final_state=True,
                                  **kws)
  return call


_FORMS = ("parallel", "recurrent", "chunked")
_PALLAS_FORMS = _FORMS + ("pallas",)  # the variants with the Pallas chunk kernels
LOG_DECAY = jnp.asarray([[-0.3, -0.8], [-0.1, -0.5]], jnp.float32)  # interdomain, [N, 2]
LINEAR_FAMILIES = {
    "linear_attention": (_FORMS, _state(linear.linear_attention, chunk_size=CHUNK),
                         lambda rng, b: (), False),
    "simple_gla": (_PALLAS_FORMS, _state(linear.simple_gla, chunk_size=CHUNK),
                   lambda rng, b: (_gate(rng, b),), False),
    "gla": (_FORMS, _state(linear.gla, chunk_size=CHUNK),
            lambda rng, b: (_gate(rng, b, K_LIN),), False),
    "delta_rule": (_PALLAS_FORMS, _state(linear.delta_rule, chunk_size=CHUNK),
                   lambda rng, b: (_beta(rng, b),), True),
    "gated_delta_rule": (_PALLAS_FORMS, _state(linear.gated_delta_rule, chunk_size=CHUNK),
                         lambda rng, b: (_gate(rng, b), _beta(rng, b)), True),
    "lightning_attention": (_PALLAS_FORMS, _state(linear.lightning_attention, chunk_size=CHUNK,
                                                  layer_idx=1, num_layers=3),
                            lambda rng, b: (), False),
    "taylor_linear_attention": (_FORMS, _state(linear.taylor_linear_attention, order=2,
                                               chunk_size=CHUNK), lambda rng, b: (), False),
    "cosformer": (_FORMS, _state(linear.cosformer, max_len=T_LIN, chunk_size=CHUNK),
                  lambda rng, b: (), False),
    "mala": (_FORMS, _state(linear.mala, chunk_size=CHUNK), lambda rng, b: (), False),
    "ttt_linear": (("recurrent", "chunked"), _state(linear.ttt_linear, mini_batch_size=CHUNK),
                   lambda rng, b: (_uniform(rng, (b, T_LIN, N_LIN), 0.0, 0.5),), False),
    "transnormer_attention": (_FORMS, _state(linear.transnormer_attention, chunk_size=CHUNK),
                              lambda rng, b: (), False),
    "softmax_linear_attention": (
        _FORMS, lambda form: lambda q, k, v, ql, kl, g, beta: linear.softmax_linear_attention(
            q, k, v, ql, kl, g=g, beta=beta, implementation=form, chunk_size=CHUNK,
            output_final_state=True),
        lambda rng, b: (_normal(rng, (b, T_LIN, N_LIN)), _normal(rng, (b, T_LIN, N_LIN)),
                        _gate(rng, b), _beta(rng, b)), True),
    "ccq": (_FORMS, _state(linear.ccq, chunk_size=CHUNK),
            lambda rng, b: (_gate(rng, b), _beta(rng, b)), True),
    "interdomain_attention": (
        _FORMS, lambda form: lambda q, k, v, bi, bo: linear.interdomain_attention(
            q, k, v, bi, bo, LOG_DECAY, implementation=form, chunk_size=CHUNK,
            output_final_state=True),
        lambda rng, b: (_uniform(rng, (b, T_LIN, N_LIN, 2), 0.1, 0.9),
                        _uniform(rng, (b, T_LIN, N_LIN, 2), 0.1, 0.9)), False),
    "native_hybrid_attention": (_FORMS, _state(linear.native_hybrid_attention, window=2,
                                               chunk_size=CHUNK),
                                lambda rng, b: (_gate(rng, b, 2),), False),
    "mhla": (("parallel", "chunked"),
             lambda form: lambda q, k, v: linear.mhla(
                 q, k, v, jnp.full((T_LIN // 2, T_LIN // 2), 0.5) + 0.1 * jnp.eye(T_LIN // 2),
                 block_size=2, implementation=form),
             lambda rng, b: (), False),
    # one form (no ``implementation``): bidirectional, a global normaliser
    "rala": ((None,), lambda form: lambda q, k, v, gate: linear.rala(q, k, v, gate),
             lambda rng, b: (_uniform(rng, (b, T_LIN, N_LIN, V_LIN), 0.5, 1.5),), False),
}


# The families whose chunked form is their own (plain autodiff); every other family's is
# jaxsoft.linear's shared chunked recurrence (linear/recurrence.py: a custom VJP).
OWN_CHUNKED_FORM = ("ttt_linear", "native_hybrid_attention", "mhla")


def _linear_case(family, form):
  _, call, extra, unit_keys = LINEAR_FAMILIES[family]

  def make(batch, seed):
    rng = _rng(seed, 3)
    return _qkv(rng, batch, unit_keys) + tuple(extra(rng, batch))

  # the Pallas chunk kernels: first-order reverse mode only (jaxsoft.linear's docs); the
  # shared chunked form differentiates with a custom VJP (forward mode, seen, runs it
  # under autodiff instead)
  custom = form == "pallas" or (form == "chunked" and family not in OWN_CHUNKED_FORM)
  return Case(call(form), make, reverse_only=form == "pallas", custom_vjp=custom)


# ----------------------------------------------------------------------------- losses

C = 8  # classes
L = js.losses
CURRENT = jnp.asarray([True, False, True, True, False, True, True, False])


def _labels(rng, batch):
  return jnp.asarray(rng.integers(0, C, batch), jnp.int32)


def _probs(rng, batch):
  return jax.nn.softmax(_normal(rng, (batch, C), 2.0))


# loss -> (fn, make_extra(rng, batch) -> the arrays after the logits)
LOSSES = {
    "softmax_cross_entropy": (L.softmax_cross_entropy, lambda r, b: (_probs(r, b),)),
    "softmax_cross_entropy_with_integer_labels": (L.softmax_cross_entropy_with_integer_labels,
                                                  lambda r, b: (_labels(r, b),)),
    "top_k_cross_entropy": (lambda x, y: L.top_k_cross_entropy(x, y, 3),
                            lambda r, b: (_labels(r, b),)),
    "stablemax_cross_entropy": (L.stablemax_cross_entropy, lambda r, b: (_labels(r, b),)),
    "softmax_collapse_fraction": (lambda x, y: L.softmax_collapse_fraction(30 * x, y),
                                  lambda r, b: (_labels(r, b),)),
    "z_loss": (L.z_loss, lambda r, b: ()),
    "spherical_z_loss": (L.spherical_z_loss, lambda r, b: (_labels(r, b),)),
    "ovr_bce_loss": (L.ovr_bce_loss, lambda r, b: (_probs(r, b),)),
    "gol_loss": (L.gol_loss, lambda r, b: (_labels(r, b),)),
    "l2_svm_loss": (L.l2_svm_loss, lambda r, b: (_labels(r, b),)),
    "msp": (L.msp, lambda r, b: ()),
    "energy_score": (L.energy_score, lambda r, b: ()),
    "marginalized_energy": (L.marginalized_energy, lambda r, b: ()),
    "energy_bounded_loss": (lambda x, y, o, **hp: L.energy_bounded_loss(x, y, o, margin_in=-3.0,
                                                                        **hp),
                            lambda r, b: (_labels(r, b), _normal(r, (b, C), 2.0))),
    "ece": (lambda x, y: L.ece(x, y, num_bins=4), lambda r, b: (_labels(r, b),)),
    # labels among the current classes (one outside them has an infinite loss, documented)
    "continual_cross_entropy": (
        lambda x, y: L.continual_cross_entropy(x, y, CURRENT),
        lambda r, b: (jnp.asarray(r.choice(np.flatnonzero(np.asarray(CURRENT)), b), jnp.int32),)),
    "logit_standardized_kd_loss": (L.logit_standardized_kd_loss,
                                   lambda r, b: (_normal(r, (b, C), 2.0),)),
    # the teachers' axis leads in the loss's signature: [B, 2, C] moved to [2, B, C]
    "averaged_teacher_kd_loss": (
        lambda x, t, **hp: L.averaged_teacher_kd_loss(x, jnp.moveaxis(t, 1, 0), **hp),
        lambda r, b: (_normal(r, (b, 2, C), 2.0),)),
    "squared_error_logit_loss": (L.squared_error_logit_loss,
                                 lambda r, b: (_labels(r, b), _uniform(r, (b,), -2.0, -0.5))),
    "tempnet_dro_loss": (lambda x, y, t: L.tempnet_dro_loss(x, y, t, rho=0.1),
                         lambda r, b: (_labels(r, b), _uniform(r, (b,), 0.5, 1.5))),
    "expectation_alignment": (L.expectation_alignment, lambda r, b: ()),
    "geometry_consistency_loss": (L.geometry_consistency_loss, lambda r, b: (_probs(r, b),)),
    "fenchel_young_loss": (L.fenchel_young_loss, lambda r, b: (_labels(r, b),)),
    "dice_semimetric_loss": (lambda x, t: L.dice_semimetric_loss(jax.nn.sigmoid(x), t),
                             lambda r, b: (_uniform(r, (b, C), 0.0, 1.0),)),
    "sigmoid_head_loss": (
        lambda x, y, lm: L.sigmoid_head_loss(jax.random.key(1), x, y, lm, 2, num_filtered=2),
        lambda r, b: (_labels(r, b), _normal(r, (b, C), 2.0))),
    "sigmoid_head_negatives": (
        lambda lm, y: L.sigmoid_head_negatives(jax.random.key(2), lm, y, 2, num_filtered=2),
        lambda r, b: (_labels(r, b),)),
}


def _loss_hparams(loss):
  """A loss's traceable hyperparameters, declared by its signature: the keyword-only
  floating parameters annotated ``ArrayLike`` (a temperature, a label smoothing; a
  ``float`` or ``int`` annotation is a Python constant), each at a non-default value
  (0.7 times the default, 0.1 for a zero default)."""
  out = {}
  for p in inspect.signature(loss).parameters.values():
    if (p.kind == p.KEYWORD_ONLY and "ArrayLike" in str(p.annotation)
        and isinstance(p.default, float)):
      out[p.name] = 0.7 * p.default if p.default else 0.1
  return out


def _loss_case(name):
  fn, extra = LOSSES[name]

  def make(batch, seed):
    rng = _rng(seed, 4)
    return (_normal(rng, (batch, C), 2.0),) + tuple(extra(rng, batch))

  loss = getattr(L, name)
  return Case(fn, make, _loss_hparams(loss), lambda **hp: functools.partial(fn, **hp),
              smooth="not differentiable" not in (loss.__doc__ or "").lower())


# ----------------------------------------------------------------------------- the walk


def _cases():
  cases, marks = {}, {}
  for name in N.names():
    cases[f"normalizer-{name}"] = functools.partial(_normalizer_case, name)
  for impl in ATTENTION_IMPLEMENTATIONS:
    for name in ATTENTION_NORMALIZERS.values():
      cases[f"attention-{impl}-{name}"] = functools.partial(_attention_case, impl, name)
      if impl == "pallas":
        marks[f"attention-{impl}-{name}"] = pytest.mark.kernels
  for family, (forms, *_) in LINEAR_FAMILIES.items():
    for form in forms:
      cid = f"linear-{family}" + (f"-{form}" if form else "")
      cases[cid] = functools.partial(_linear_case, family, form)
      if form == "pallas":
        marks[cid] = pytest.mark.kernels
  for name in LOSSES:
    cases[f"loss-{name}"] = functools.partial(_loss_case, name)
  return cases, marks


CASES, KERNEL_CASES = _cases()
# The default run: one case per registry, on the paths that shape arithmetic (the chunked
# attention's block table broke jax.export with a symbolic batch), a custom backward or a
# threshold solve (the Fenchel-Young loss of sparsemax) make fragile; -m slow walks all.
DEFAULT = ("normalizer-softmax", "attention-xla_chunked-softmax",
           "linear-gated_delta_rule-chunked", "loss-fenchel_young_loss")


def _params(default=DEFAULT, select=None):
  """The cases as pytest params (``select(cid)``: those kept), ``default`` unmarked, the
  others ``slow``."""
  params = []
  for cid in CASES:
    if select is not None and not select(cid):
      continue
    marks = [m for m in (KERNEL_CASES.get(cid),) if m is not None]
    if cid not in default:
      marks.append(pytest.mark.slow)
    params.append(pytest.param(cid, id=cid, marks=marks))
  return params


@pytest.fixture(autouse=True)
def _pallas_interpreted(monkeypatch):
  """The Pallas cases run the kernels in the interpreter on a CPU (elsewhere the kernels
  refuse a platform they cannot compile for)."""
  monkeypatch.setenv(INTERPRET_ENV, "1")


@functools.cache
def _case(cid) -> Case:
  return CASES[cid]()


def _functional(out):
  """``sum sin(1.3 y + 0.2)`` over the floating leaves of ``out``, in float32 (float64
  when a leaf is: the derivative checks run in float64)."""
  floats = [leaf for leaf in jax.tree.leaves(out) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
  dtype = jnp.result_type(jnp.float32, *(leaf.dtype for leaf in floats))
  total = jnp.zeros((), dtype)
  for leaf in floats:
    total = total + jnp.sum(jnp.sin(1.3 * leaf + 0.2)).astype(dtype)
  return total


def _with_grads(fn, args):
  """``vg(*args) -> (fn(*args), gradients of _functional in the floating args)``."""
  diff = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.inexact))

  def vg(*args):
    def f(*floats):
      full = list(args)
      for i, a in zip(diff, floats, strict=True):
        full[i] = a
      out = fn(*full)
      return _functional(out), out
    (_, out), grads = jax.value_and_grad(f, argnums=tuple(range(len(diff))), has_aux=True)(
        *(args[i] for i in diff))
    return out, grads

  return vg


@functools.cache
def _plain(cid):
  case = _case(cid)
  return jax.jit(_with_grads(case.fn, case.make(2, 0)))


@functools.cache
def _reference(cid, batch, seed):
  """The plain jitted call's value and gradients, as numpy (finite)."""
  want = jax.tree.map(np.asarray, _plain(cid)(*_case(cid).make(batch, seed)))
  for leaf in jax.tree.leaves(want):
    if np.issubdtype(leaf.dtype, np.inexact):
      assert np.all(np.isfinite(leaf)), f"{cid}: the plain call is not finite"
  return want


def _assert_same(got, want, what):
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for i, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
    g = np.asarray(g)
    assert g.shape == w.shape and g.dtype == w.dtype, (what, i, g.shape, w.shape, g.dtype)
    if np.issubdtype(w.dtype, np.inexact):
      scale = float(np.max(np.abs(w), initial=0.0))
      np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5 * scale + 1e-7,
                                 err_msg=f"{what}, leaf {i}")
    else:
      np.testing.assert_array_equal(g, w, err_msg=f"{what}, leaf {i}")


def _stack(trees, axis=0):
  return jax.tree.map(lambda *xs: np.stack(xs, axis=axis), *trees)


@pytest.mark.parametrize("cid", _params())
def test_remat_gives_the_plain_value_and_gradient(cid):
  case = _case(cid)
  args = case.make(2, 0)
  got = jax.jit(_with_grads(jax.checkpoint(case.fn), args))(*args)
  _assert_same(got, _reference(cid, 2, 0), f"{cid}: jax.checkpoint")


@pytest.mark.parametrize("cid", _params())
def test_scan_over_a_stacked_axis_equals_a_loop(cid):
  case = _case(cid)
  a0, a1 = case.make(2, 0), case.make(2, 1)
  vg = _with_grads(case.fn, a0)
  stacked = jax.tree.map(lambda x, y: jnp.stack([x, y]), a0, a1)
  got = jax.jit(lambda xs: jax.lax.scan(lambda c, x: (c, vg(*x)), None, xs)[1])(stacked)
  _assert_same(got, _stack([_reference(cid, 2, 0), _reference(cid, 2, 1)]),
               f"{cid}: lax.scan")


@pytest.mark.parametrize("cid", _params())
def test_vmap_over_a_non_leading_axis_equals_a_loop(cid):
  case = _case(cid)
  a0, a1 = case.make(2, 0), case.make(2, 1)
  stacked = jax.tree.map(lambda x, y: jnp.stack([x, y], axis=1), a0, a1)
  got = jax.jit(jax.vmap(_with_grads(case.fn, a0), in_axes=1))(*stacked)
  _assert_same(got, _stack([_reference(cid, 2, 0), _reference(cid, 2, 1)]),
               f"{cid}: vmap(in_axes=1)")


# Cases that cannot be exported with a symbolic batch: id -> (error type, the message the
# error must match, why). None so far: a new case that cannot export must be listed here
# with its reason (and raise a clear error), or be fixed.
EXPORT_REFUSES: dict[str, tuple[type[Exception], str, str]] = {}


@pytest.mark.parametrize("cid", _params())
def test_export_with_a_symbolic_batch_round_trips(cid):
  case = _case(cid)
  args = case.make(2, 0)
  b, = export.symbolic_shape("b")
  specs = [jax.ShapeDtypeStruct((b,) + a.shape[1:], a.dtype) for a in args]
  vg = jax.jit(_with_grads(case.fn, args))
  if cid in EXPORT_REFUSES:
    error, message, _ = EXPORT_REFUSES[cid]
    with pytest.raises(error, match=message):
      export.export(vg)(*specs)
    return
  exported = export.deserialize(export.export(vg)(*specs).serialize())
  for batch in BATCHES:
    _assert_same(exported.call(*case.make(batch, 0)), _reference(cid, batch, 0),
                 f"{cid}: exported, batch {batch}")


# ----------------------------------------------------------------------------- derivatives
# The checks below differentiate the scalar ``F = _functional(fn(*arrays))`` in the floating
# arrays (integer arrays, e.g. lengths and labels, stay fixed), in float64 under
# ``jax.enable_x64`` where a float64 finite difference is the reference: a central
# difference with step h has a truncation error h^2/6 |F'''| and a rounding error
# ~ eps64 |F| / h; at h = 1e-5 both are below 1e-9 of the scale of these O(1) inputs and
# O(100)-term sums, so 1e-6 (relative, with a floor of 1e-6 of the largest entry) holds
# with room, while a dropped term (the ~0 key Hessian of issue 37's item 10) is O(1) off.


def _f64(tree):
  return jax.tree.map(
      lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a,
      tree)


def _scalar(fn, args):
  """``(F, floats)``: F(*floats) = _functional(fn(*args with the floats replaced))."""
  diff = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.inexact))

  def F(*floats):
    full = list(args)
    for i, a in zip(diff, floats, strict=True):
      full[i] = a
    return _functional(fn(*full))

  return F, tuple(args[i] for i in diff)


def _directions(floats, seed=7):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in floats)


def _close64(got, want, what, rtol=1e-6):
  for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
    g, w = np.asarray(g), np.asarray(w)
    assert np.all(np.isfinite(w)), f"{what}, leaf {i}: the reference is not finite"
    scale = float(np.max(np.abs(w), initial=0.0))
    np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale + 1e-12,
                               err_msg=f"{what}, leaf {i}")


def _has_hparams(cid):
  return bool(_case(cid).hparams)


# One case per registry with hyperparameters (the linear families take theirs as arrays):
# entmax's alpha (a threshold solve differentiated in alpha), the attention temperature,
# a label smoothing (the chunked attention's took ~20 s: -m slow).
DEFAULT_HPARAMS = ("normalizer-entmax", "attention-xla-softmax", "loss-softmax_cross_entropy")


@pytest.mark.parametrize("cid", _params(DEFAULT_HPARAMS, select=_has_hparams))
def test_jit_with_traced_hyperparameters_equals_the_static_call(cid):
  """The case's traceable hyperparameters (``Case.hparams``) as jit arguments: the same
  value and gradients as the same values compiled in as Python constants (the walk's
  2e-5). Where differentiable (``Case.smooth``), the float64 gradient in them
  equals a float64 central difference of the traced call (1e-6, see above), and the
  float32 gradient the float64 one (1e-3 of the largest: float32 sums of O(100) terms,
  each rounded at ~1e-7 of its size, and the solvers' float32 stopping tolerance; not for
  a ``keyed`` case, whose float32 and float64 draws differ)."""
  case = _case(cid)
  names, values = tuple(case.hparams), tuple(case.hparams.values())
  args = case.make(2, 0)
  diff = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.inexact))

  def traced(h, *a):
    return case.build(**dict(zip(names, h, strict=True)))(*a)

  def with_h_grads(h, *a):
    """(output, gradients in the floating arrays), gradients in the hyperparameters."""
    def f(h, floats):
      full = list(a)
      for i, x in zip(diff, floats, strict=True):
        full[i] = x
      out = traced(h, *full)
      return _functional(out), out
    (_, out), (gh, ga) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        h, tuple(a[i] for i in diff))
    return (out, ga), gh

  want = jax.jit(_with_grads(case.build(**case.hparams), args))(*args)
  got, g32 = jax.jit(with_h_grads)(tuple(jnp.asarray(v, jnp.float32) for v in values), *args)
  _assert_same(got, jax.tree.map(np.asarray, want), f"{cid}: traced {names}")
  assert np.all(np.isfinite(np.asarray(g32))), f"{cid}: gradient in {names} not finite"
  if not case.smooth:
    return
  steps = np.array([1e-5 * max(1.0, abs(v)) for v in values])
  with jax.enable_x64(True):
    args64 = _f64(args)
    h64 = jnp.asarray(values, jnp.float64)

    def grad_and_difference(h):
      value = lambda h: _functional(traced(tuple(h), *args64))
      shifts = jnp.concatenate([jnp.diag(steps), -jnp.diag(steps)])
      f = jax.vmap(value)(h[None] + shifts)
      return jax.grad(value)(h), (f[:len(values)] - f[len(values):]) / (2 * steps)

    g64, fd = jax.jit(grad_and_difference)(h64)
  scale = max(1.0, float(np.max(np.abs(g64))))
  for i, name in enumerate(names):
    np.testing.assert_allclose(float(g64[i]), float(fd[i]), rtol=1e-6, atol=1e-6 * scale,
                               err_msg=f"{cid}: d/d{name} (float64) vs central difference")
    if not case.keyed:
      np.testing.assert_allclose(float(g32[i]), float(g64[i]), rtol=1e-3, atol=1e-3 * scale,
                                 err_msg=f"{cid}: d/d{name} float32 vs float64")


def test_static_hyperparameters_refuse_a_traced_value_naming_it():
  """A hyperparameter declared ``static`` (``Param.static``: a count, an order, a cut
  compiled into the program) raises ValueError naming it when traced; the others are the
  traced check's (above)."""
  x = jnp.zeros((2, 8), jnp.float32)
  static = [(name, p) for name in N.names() for p in N.get(name).params if p.static]
  assert static, "no static hyperparameter declared"
  for name, p in static:
    spec = N.get(name)
    value = p.sample if p.sample is not None else p.default

    def call(v, spec=spec, p=p):
      if spec.needs_key:
        return spec.fn(jax.random.key(0), x, **{p.name: v})
      return spec.fn(x, **{p.name: v})

    with pytest.raises(ValueError, match=f"`{p.name}`"):
      jax.eval_shape(call, jnp.asarray(value))


# The cheap cases (every normalizer's check_grads in both modes runs by default in
# jaxsoft.testing.check_normalizer, the linear forms' forward mode in
# tests/test_forward_mode.py): the class-R chunked attention's refusal (it gave JAX's bare
# custom_vjp error), the Pallas linear kernels' refusal, a loss.
DEFAULT_FORWARD = ("attention-xla_chunked-standardized_softmax", "linear-simple_gla-pallas",
                   "loss-softmax_cross_entropy_with_integer_labels")


@pytest.mark.parametrize("cid", _params(DEFAULT_FORWARD))
def test_forward_mode_equals_reverse_mode(cid):
  """``jax.test_util.check_grads`` (order 1, forward and reverse, float64) of the walk's
  functional (where ``Case.smooth``), and ``jax.jacfwd`` equal to ``jax.grad`` (the same
  derivative by the two modes, float64: 1e-9); a path documented first-order reverse only
  (``Case.reverse_only``) raises UnsupportedDifferentiation for ``jax.jvp`` instead."""
  case = _case(cid)
  with jax.enable_x64(True):
    F, floats = _scalar(case.fn, _f64(case.make(2, 0)))
    if case.reverse_only:
      with pytest.raises(js.attention.UnsupportedDifferentiation, match="forward-mode"):
        jax.jit(functools.partial(jax.jvp, F))(floats, _directions(floats))
      return
    # check_grads(F, floats, order=1, modes=("fwd", "rev")) with each piece compiled
    if case.smooth:
      Fj = jax.jit(F)
      jtu.check_jvp(Fj, jax.jit(functools.partial(jax.jvp, F)), floats)
      jtu.check_vjp(Fj, functools.partial(jax.vjp, Fj), floats)
    argnums = tuple(range(len(floats)))
    fwd, rev = jax.jit(lambda *a: (jax.jacfwd(F, argnums)(*a), jax.grad(F, argnums)(*a)))(
        *floats)
    _close64(fwd, rev, f"{cid}: jacfwd vs grad", rtol=1e-9)


# ``jax.jvp`` of a ``jax.jit``-compiled call: the library cannot see the forward mode
# through the jit (jaxsoft.attention.differentiation), so a custom VJP inside
# (``Case.custom_vjp``) meets JAX's own refusal, a TypeError, never a number.
_CUSTOM_VJP_JVP = r"can't apply forward-mode autodiff \(jvp\) to a custom_vjp function"


DEFAULT_JVP_OF_JIT = ("normalizer-softmax", "linear-gated_delta_rule-chunked",
                      "loss-fenchel_young_loss")


@pytest.mark.parametrize("cid", _params(DEFAULT_JVP_OF_JIT))
def test_jvp_of_a_jitted_call_equals_reverse_mode_or_refuses(cid):
  """``jax.jvp(jax.jit(F))`` (the jit inside the derivative): the tangent equals
  ``<grad F, t>`` (float64, 1e-9), or, where the call's derivative is a custom VJP
  (``Case.custom_vjp``), JAX's TypeError for it (never a number)."""
  case = _case(cid)
  with jax.enable_x64(True):
    F, floats = _scalar(case.fn, _f64(case.make(2, 0)))
    tangents = _directions(floats)
    if case.custom_vjp:
      with pytest.raises(TypeError, match=_CUSTOM_VJP_JVP):
        jax.jvp(jax.jit(F), floats, tangents)
      return
    value, tangent = jax.jvp(jax.jit(F), floats, tangents)
    want, grads = jax.jit(jax.value_and_grad(F, argnums=tuple(range(len(floats)))))(*floats)
    _close64(value, want, f"{cid}: jvp(jit) value")
    dot = lambda f: sum(jnp.vdot(f(g), f(t)) for g, t in zip(grads, tangents, strict=True))
    np.testing.assert_allclose(float(tangent), float(dot(lambda a: a)), rtol=1e-9,
                               atol=1e-9 * float(dot(jnp.abs)),
                               err_msg=f"{cid}: jvp(jit) tangent vs <grad, t>")


# The gradients that are by design not the derivative of the function at a fixed key (a
# straight-through or a reparameterised sample): a difference of the gradient is no
# reference for their derivative; the Hessian-vector products by forward over reverse and
# by reverse over reverse must still agree. id -> why.
SURROGATE_GRADIENTS = {
    "normalizer-gumbel_softmax_hard": "straight-through: the gradient is the soft sample's",
    "normalizer-step_straight_through": "straight-through: the gradient is sigmoid's",
    "normalizer-dirichlet_resample": "the implicit reparameterisation gradient of the "
                                     "Dirichlet sample, not pathwise at a fixed key",
}
# Second orders JAX itself refuses: id -> (error, message, why); the test asserts the error
# for reverse over reverse.
SECOND_ORDER_REFUSES: dict[str, tuple[type[Exception], str, str]] = {
    "normalizer-dirichlet_resample": (
        ValueError, "Reverse-mode differentiation does not work for lax.while_loop",
        "JAX's gamma sampler (a rejection while_loop) has no reverse over reverse; forward "
        "over reverse is NaN where a concentration is ~1e-3 (JAX's loggamma second "
        "derivative is NaN there: jax.random.loggamma at 0.001)"),
}

# entmax15 (its Hessian was NaN at an exact 0), the Pallas linear kernels' refusal (grad
# of grad gave JAX's "Linearization failed"), the Fenchel-Young loss (a custom_jvp).
DEFAULT_SECOND = ("normalizer-entmax15", "attention-xla_chunked-softmax",
                  "linear-gated_delta_rule-pallas", "loss-fenchel_young_loss")


@pytest.mark.parametrize("cid", _params(DEFAULT_SECOND))
def test_second_order_equals_a_float64_difference_of_the_gradient(cid):
  """Hessian-vector products in float64, forward over reverse (``jax.jvp`` of
  ``jax.grad``, as ``jax.hessian`` composes them) and reverse over reverse (``jax.grad``
  of ``<jax.grad, v>``), equal to the central difference of the float64 gradient along v
  (1e-6; see above). Piecewise-linear cases (sparsemax) have a Hessian that is 0 almost
  everywhere: random inputs are away from the kinks, and the difference says 0 too. A
  surrogate gradient (:data:`SURROGATE_GRADIENTS`) has the two compositions equal (1e-9)
  instead, or JAX's own refusal (:data:`SECOND_ORDER_REFUSES`). A path
  documented first-order reverse only (``Case.reverse_only``) raises
  UnsupportedDifferentiation for both."""
  case = _case(cid)
  with jax.enable_x64(True):
    F, floats = _scalar(case.fn, _f64(case.make(2, 0)))
    argnums = tuple(range(len(floats)))
    G = jax.grad(F, argnums=argnums)
    v = _directions(floats)
    fwd_rev = lambda: jax.jvp(G, floats, v)[1]
    rev_rev = lambda: jax.grad(
        lambda *a: sum(jnp.vdot(g, d) for g, d in zip(G(*a), v, strict=True)),
        argnums=argnums)(*floats)
    if case.reverse_only:
      for second in (fwd_rev, rev_rev):
        with pytest.raises(js.attention.UnsupportedDifferentiation, match="second- or higher"):
          jax.jit(second)()
      return
    if cid in SECOND_ORDER_REFUSES:
      error, message, _ = SECOND_ORDER_REFUSES[cid]
      with pytest.raises(error, match=message):
        jax.jit(rev_rev)()
      return
    if cid in SURROGATE_GRADIENTS:
      _close64(jax.jit(fwd_rev)(), jax.jit(rev_rev)(), f"{cid}: jvp(grad) vs grad(<grad, v>)",
               rtol=1e-9)
      return
    step = 1e-5

    def all_three():
      up = G(*(a + step * d for a, d in zip(floats, v, strict=True)))
      down = G(*(a - step * d for a, d in zip(floats, v, strict=True)))
      fd = tuple((u - d) / (2 * step) for u, d in zip(up, down, strict=True))
      return fwd_rev(), rev_rev(), fd

    hvp_fwd, hvp_rev, fd = jax.jit(all_three)()
    _close64(hvp_fwd, fd, f"{cid}: jvp(grad) vs central difference of the gradient")
    _close64(hvp_rev, fd, f"{cid}: grad(<grad, v>) vs central difference")


# ----------------------------------------------------------------------------- coverage


def _public(module):
  return {n: getattr(module, n) for n in module.__all__ if callable(getattr(module, n))}


def test_the_walk_covers_the_registries():
  """A new normalizer, linear family or class-axis loss joins the walk (the normalizers by
  construction; a linear family or loss must be added to its table here)."""
  assert {c.split("-", 1)[1] for c in CASES if c.startswith("normalizer-")} == set(N.names())
  assert {N.get(n).kernel_class for n in ATTENTION_NORMALIZERS.values()} == {
      "E", "S", "P", "T", "R"}
  assert all(N.get(n).kernel_class == k for k, n in ATTENTION_NORMALIZERS.items())
  # every sequence mixer of jaxsoft.linear: the functions taking ``implementation``, whose
  # name is not a decoding step's (rala: bidirectional, one form)
  mixers = {n for n, f in _public(linear).items()
            if "implementation" in inspect.signature(f).parameters and not n.endswith("_step")}
  assert mixers | {"rala"} == set(LINEAR_FAMILIES)
  for family, (forms, *_) in LINEAR_FAMILIES.items():
    assert set(forms) <= set(linear.IMPLEMENTATIONS) | {None}, family
  # every loss with a class ``axis`` (tests/losses/test_axis_contract.py)
  with_axis = {n for n, f in _public(L).items() if "axis" in inspect.signature(f).parameters}
  assert with_axis == set(LOSSES)
