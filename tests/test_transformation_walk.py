"""One generated walk of the registries under remat, scan, ``jax.export`` and vmap (issue 37's
"Transformations" guard: a new function inherits all of it).

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
  the loop.

Tolerance: every pair is the same float32 computation (no reference formula in between),
compiled into a different program: XLA may fuse, reorder and contract differently, so a
few float32 ulps per operation over rows of at most a few dozen terms, and the iterative
solvers (threshold bisection, fixed points) stop at the same tolerance: 2e-5 relative,
with an absolute floor of 2e-5 of the largest entry. Integer outputs (indices) are equal.
The reference must be finite (no silent NaN).

The default run samples one case per registry (:data:`DEFAULT`); ``-m slow`` walks everything
(the Pallas cases run the kernels in the Pallas interpreter, ``JAXSOFT_PALLAS_INTERPRET=1``,
as the other CPU tests of the kernels do; they are also marked ``kernels``).
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
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
  """``fn(*arrays)`` -> a pytree; ``make(batch, seed)`` -> the arrays (batch leading)."""

  fn: Callable
  make: Callable


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


def _normalizer_case(name):
  spec = N.get(name)
  n = _row_length(spec)
  key = jax.random.key(0)

  def fn(x, where):
    if spec.needs_key:
      return spec.fn(key, x, axis=-1, where=where)
    return spec.fn(x, axis=-1, where=where)

  def make(batch, seed):
    rng = _rng(seed, 1)
    where = rng.random((batch, 3, n)) < 0.75
    where[..., 0] = True
    return _normal(rng, (batch, 3, n), 2.0), jnp.asarray(where)

  return Case(fn, make)


# ----------------------------------------------------------------------------- attention

# One normalizer of each kernel class attention dispatches on (X, the stochastic class,
# has its own key plumbing and is walked as a normalizer above).
ATTENTION_NORMALIZERS = {"E": "softmax", "S": "stablemax", "P": "sigmoid", "T": "sparsemax",
                         "R": "standardized_softmax"}
# The implementations that run on a CPU (the GPU/TPU ones: pallas_triton,
# pallas_mosaic_tpu and cudnn need their device; "pallas" runs the kernel interpreted).
ATTENTION_IMPLEMENTATIONS = ("xla", "xla_chunked", "pallas")


def _attention_case(implementation, normalizer):
  def fn(q, k, v, lengths):
    return js.attention.dot_product_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=lengths,
        implementation=implementation, normalizer=normalizer)

  def make(batch, seed):
    rng = _rng(seed, 2)
    T, N_, K, H = 6, 2, 1, 4
    return (_normal(rng, (batch, T, N_, H)), _normal(rng, (batch, T, K, H)),
            _normal(rng, (batch, T, K, H)), jnp.asarray(rng.integers(3, T + 1, batch), jnp.int32))

  return Case(fn, make)


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


def _linear_case(family, form):
  _, call, extra, unit_keys = LINEAR_FAMILIES[family]

  def make(batch, seed):
    rng = _rng(seed, 3)
    return _qkv(rng, batch, unit_keys) + tuple(extra(rng, batch))

  return Case(call(form), make)


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
    "energy_bounded_loss": (lambda x, y, o: L.energy_bounded_loss(x, y, o, margin_in=-3.0),
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
        lambda x, t: L.averaged_teacher_kd_loss(x, jnp.moveaxis(t, 1, 0)),
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


def _loss_case(name):
  fn, extra = LOSSES[name]

  def make(batch, seed):
    rng = _rng(seed, 4)
    return (_normal(rng, (batch, C), 2.0),) + tuple(extra(rng, batch))

  return Case(fn, make)


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


def _params(default=DEFAULT):
  params = []
  for cid in CASES:
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
  """``sum sin(1.3 y + 0.2)`` over the floating leaves of ``out``."""
  total = jnp.zeros((), jnp.float32)
  for leaf in jax.tree.leaves(out):
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
      total = total + jnp.sum(jnp.sin(1.3 * leaf + 0.2)).astype(jnp.float32)
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
