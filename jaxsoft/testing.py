"""Public property checks for normalizers, and reference evaluators of their kernel rules.

``check_normalizer(fn, spec)`` runs the invariants a :class:`NormalizerSpec` declares
on any callable with the normalizer signature
``fn(x, axis=-1, where=None, **hparams)`` (``fn(key, x, ...)`` for stochastic ones). It is
what jaxsoft's own generated test-suite runs on every registered normalizer, and a user
writing a new normalizer can run it in one line::

    import dataclasses, jaxsoft as js
    spec = dataclasses.replace(js.normalizers.get("softmax"), name="my_softmax", fn=my_softmax)
    js.testing.check_normalizer(my_softmax, spec)   # AssertionError naming the property

The rule evaluators are plain-``jnp``, dense or blockwise, readings of the per-tile math a
spec ships for the chunked XLA path and the Pallas engine (kernel classes as in
docs/feature_ids.md):

* :func:`evaluate_tile_rule` -- classes E, S, P on a whole row;
* :func:`evaluate_tile_rule_online` -- the same rule over key blocks with the online
  (m, l) merge of FlashAttention, fused with the weighted sum of a value matrix;
* :func:`evaluate_threshold_rule` -- class T by a fixed number of bisection steps.

:func:`weight_probe` builds one query over given key scores with one-hot values, so an
attention function's output is its weight row.

Tolerances (documented because a user relies on them):

* ``SAME_TOL`` (float32, rtol 1e-5, atol 1e-6): two computations of the same value that
  only differ in summation order or tracing (jit, vmap, permuted columns, deleted masked
  columns, array vs scalar hyperparameters).
* ``SHIFT_TOL`` (rtol 1e-4, atol 1e-5): ``fn(x + c)`` vs ``fn(x)``; a shift by c moves
  the float32 rounding of every logit by up to ulp(c) (6e-5 at c = 1000).
* ``LOW_PRECISION_TOL``: a bfloat16 / float16 input ``xq`` must give
  ``fn(xq) ≈ fn(float32(xq))`` within (rtol, atol) = (2e-2, 1e-2) for bfloat16 and
  (4e-3, 2e-3) for float16: computed in float32 inside, only the final rounding (and the
  rounding of intermediate casts) differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import test_util as jtu
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers import tile
from jaxsoft.normalizers.spec import REGISTRY, NormalizerSpec, ThresholdRule, TileRule

__all__ = [
    "SAME_TOL",
    "SHIFT_TOL",
    "LOW_PRECISION_TOL",
    "PROPERTIES",
    "check_normalizer",
    "evaluate_tile_rule",
    "evaluate_tile_rule_online",
    "evaluate_threshold_rule",
    "weight_probe",
]

SAME_TOL = dict(rtol=1e-5, atol=1e-6)
SHIFT_TOL = dict(rtol=1e-4, atol=1e-5)
LOW_PRECISION_TOL = {
    jnp.dtype(jnp.bfloat16): dict(rtol=2e-2, atol=1e-2),
    jnp.dtype(jnp.float16): dict(rtol=4e-3, atol=2e-3),
}
# Monte-Carlo checks of stochastic normalizers (needs_key) compare the means of two sets of
# n draws entry by entry. A weight in [0, 1] has variance <= 1/4 (attained by the one-hot
# hard sample at p = 1/2), so each mean has a standard error <= 0.5 / sqrt(n) and the
# difference of two independent means <= 0.5 * sqrt(2 / n). A 5-sigma margin at atol 0.05
# needs 0.5 * sqrt(2 / n) <= 0.01, i.e. n >= 5000 (4096 gave 4.5 sigma; 512 fails on
# gumbel_softmax_hard). The cost is the compilation, not the draws: 256 and 5000 draws take
# the same time on CPU.
_MC_DRAWS = 5000
_MC_ATOL = 0.05

PROPERTIES = (
    "param_defaults",     # the spec's defaults are the function's defaults
    "shape_dtype",        # same shape and dtype out, for float32, bfloat16, float16
    "axis",               # fn(x, axis=0) is fn along the other axis
    "nonnegative",        # every weight >= 0 (where declared)
    "dense_support",      # visible weights > 0 on moderate rows (can_be_sparse=False)
    "sums_to_one",        # rows with a visible entry sum to 1 (where declared)
    "at_most_one",        # rows sum to <= 1 (where declared)
    "shift_invariance",   # fn(x + c) == fn(x), c per row, also c = +-1000 (where declared)
    "permutation_equivariance",
    "mask_invariance",    # masking a column == deleting it; masked weight exactly 0
    "neg_inf_as_masked",  # a -inf logit behaves as where=False
    "fully_masked_row",   # all zeros, zero and finite gradient
    "huge_logits",        # finite at |x| ~ 1e4 in float32, declared properties hold
    "tiny_logits",        # finite at |x| ~ 1e-30, declared properties hold
    "low_precision",      # bfloat16 / float16: finite, close to the float32 result
    "jit",
    "vmap",
    "grad",               # finite, zero at masked entries, same under jit
    "check_grads",        # float64 numerical gradients, fwd and rev (smooth=True)
    "param_values",       # default and sample work; per-row arrays; out of range -> ValueError
)


# ---------------------------------------------------------------------------------------
# check_normalizer


class _Failure(AssertionError):
  pass


@dataclasses.dataclass(eq=False)  # hashable by identity, as jax.jit needs
class _Caller:
  """Calls a normalizer uniformly: ``(x, where, **hparams)``, the key supplied if needed."""

  fn: Callable[..., Any]
  spec: NormalizerSpec
  hparams: dict
  key: Any

  def __call__(self, x, where=None, axis=-1, key=None, **override):
    hp = {**self.hparams, **override}
    if self.spec.needs_key:
      return self.fn(self.key if key is None else key, x, axis=axis, where=where, **hp)
    return self.fn(x, axis=axis, where=where, **hp)


def _resolve(fn, spec) -> tuple[Callable[..., Any], NormalizerSpec]:
  if isinstance(fn, NormalizerSpec):
    spec, fn = (fn if spec is None else spec), fn.fn
  if isinstance(spec, str):
    spec = REGISTRY[spec]
  if spec is None:
    spec = next((s for s in REGISTRY.values() if s.fn is fn), None)
  if spec is None:
    # An undeclared callable: only the properties every normalizer must have.
    spec = NormalizerSpec(
        name=getattr(fn, "__name__", repr(fn)), fn=fn, kernel_class="X", catalogue_id="",
        sums_to_one=False, at_most_one=False, nonnegative=False, shift_invariant=False,
        can_be_sparse=True, smooth=False)
  if not callable(fn):
    raise TypeError(f"check_normalizer: `fn` must be callable, got {fn!r}")
  return fn, spec


def _close(actual, expected, what: str, rtol: float, atol: float):
  a = np.asarray(jnp.asarray(actual, jnp.float32) if _is_low(actual) else actual)
  e = np.asarray(jnp.asarray(expected, jnp.float32) if _is_low(expected) else expected)
  if a.shape != e.shape:
    raise _Failure(f"{what}: shape {a.shape} != expected {e.shape}")
  if not np.allclose(a, e, rtol=rtol, atol=atol, equal_nan=False):
    err = np.abs(a.astype(np.float64) - e.astype(np.float64))
    i = np.unravel_index(np.nanargmax(np.where(np.isnan(err), np.inf, err)), err.shape)
    raise _Failure(f"{what}: max abs error {err[i]:.3g} at index {tuple(int(k) for k in i)} "
                   f"(got {a[i]!r}, expected {e[i]!r}; rtol={rtol}, atol={atol})")


def _is_low(a) -> bool:
  return jnp.asarray(a).dtype in (jnp.bfloat16, jnp.float16)


def _finite(a, what: str):
  a = np.asarray(jnp.asarray(a, jnp.float32))
  if not np.all(np.isfinite(a)):
    bad = np.argwhere(~np.isfinite(a))[0]
    raise _Failure(f"{what}: non-finite value {a[tuple(bad)]} at index {tuple(int(k) for k in bad)}")


def _row_properties(spec: NormalizerSpec, w, mask, what: str, sum_atol: float = 1e-5,
                    check_dense: bool = False):
  """The declared pointwise / row-sum properties of weights ``w`` (last axis = row)."""
  w = np.asarray(jnp.asarray(w, jnp.float32), np.float64)
  mask = np.broadcast_to(np.asarray(mask, bool), w.shape)
  _finite(w, what)
  if np.any(w[~mask] != 0):
    raise _Failure(f"{what}: masked entries must be exactly 0, got {w[~mask][w[~mask] != 0][:4]}")
  if spec.nonnegative and np.any(w < 0):
    raise _Failure(f"nonnegative: {what}: negative weight {w.min():.3g}")
  if check_dense and spec.nonnegative and not spec.can_be_sparse and np.any(w[mask] <= 0):
    raise _Failure(f"dense_support: {what}: a visible entry got weight {w[mask].min():.3g} "
                   "but the spec declares can_be_sparse=False")
  sums = w.sum(-1)
  visible = mask.any(-1)
  if spec.sums_to_one and not np.allclose(sums[visible], 1.0, rtol=0, atol=sum_atol):
    raise _Failure(f"sums_to_one: {what}: row sums {sums[visible]}")
  if (spec.sums_to_one or spec.at_most_one) and np.any(sums > 1 + sum_atol):
    raise _Failure(f"at_most_one: {what}: row sum {sums.max():.7g} > 1")


def _row_property_names(spec: NormalizerSpec) -> list[str]:
  """The properties :func:`_row_properties` checks for this spec."""
  flags = (("nonnegative", spec.nonnegative),
           ("dense_support", spec.nonnegative and not spec.can_be_sparse),
           ("sums_to_one", spec.sums_to_one),
           ("at_most_one", spec.sums_to_one or spec.at_most_one))
  return [name for name, on in flags if on]


def _masks(shape) -> np.ndarray:
  """Masks with every pattern the checks need: full, one or two hidden, one visible."""
  r, n = shape
  mask = np.ones(shape, bool)
  for i in range(r):
    pattern = i % 4
    if pattern == 1:
      mask[i, (i * 3) % n] = False
    elif pattern == 2:
      mask[i, 0] = mask[i, n - 1] = False
    elif pattern == 3:
      mask[i] = False
      mask[i, i % n] = True
  return mask


def _settings(spec: NormalizerSpec) -> list[tuple[str, dict]]:
  base = {p.name: p.default for p in spec.params if p.default is not None}
  out = [("defaults", base)]
  for p in spec.params:
    if p.sample is not None:
      out.append((f"{p.name}={p.sample!r}", {**base, p.name: p.sample}))
  return out


def _is_float_value(v) -> bool:
  return isinstance(v, (float, np.floating)) and not isinstance(v, bool)


def _out_of_range(p) -> list:
  bad = []
  if p.low is not None:
    bad.append(p.low if p.low_open else p.low - 1)
  if p.high is not None:
    bad.append(p.high if p.high_open else p.high + 1)
  return bad


def _well_separated(key, shape, dtype):
  """Rows whose entries are >= ~0.4 apart: away from ties and support changes."""
  r, n = shape
  base = np.linspace(-1.5, 1.5, n)
  keys = jax.random.split(key, r + 1)
  rows = [np.asarray(jax.random.permutation(keys[i], base)) for i in range(r)]
  noise = np.asarray(jax.random.uniform(keys[-1], shape, minval=-0.05, maxval=0.05))
  return jnp.asarray(np.stack(rows) + noise, dtype)


class _Checker:
  """Runs the properties for one hyperparameter setting; raises AssertionError on failure.

  Calls run eagerly: JAX caches each primitive's compilation per shape and dtype, so the
  later hyperparameter settings (and the next normalizer) reuse nearly all of it, where a
  fresh ``jax.jit`` per setting would recompile everything.
  """

  def __init__(self, fn, spec, hparams, label, x, key, ran: set[str]):
    self.spec = spec
    self.ran = ran  # the properties that ran and passed, for check_normalizer's result
    self.label = label
    self.eager = _Caller(fn, spec, hparams, key)
    self.call = self.eager
    self.hparams = hparams
    self.x = x
    self.mask = jnp.asarray(_masks(x.shape))
    self.key = key

  @contextlib.contextmanager
  def prop(self, *names):
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      detail = str(e) if isinstance(e, _Failure) else f"raised {type(e).__name__}: {e}"
      raise AssertionError(
          f"normalizer {self.spec.name!r} [{self.label}] fails property "
          f"'{' / '.join(names)}': {detail}") from e
    self.ran.update(names)

  # -- forward properties ---------------------------------------------------------------

  def shape_dtype(self):
    with self.prop("shape_dtype"):
      # One shape per dtype, and ranks 1 to 3 in float32 (each is a fresh compilation).
      for xi in (self.x, self.x.astype(jnp.bfloat16), self.x.astype(jnp.float16), self.x[0],
                 jnp.stack([self.x, -self.x])):
        w = self.call(xi)
        if w.shape != xi.shape or w.dtype != xi.dtype:
          raise _Failure(f"input {xi.dtype}{list(xi.shape)} gave {w.dtype}{list(w.shape)}")
    with self.prop("axis"):
      if self.spec.needs_key:  # the noise follows the layout: compare means of draws
        _close(self._mc_mean(self.x.T, self.mask.T, axis=0).T, self._mc_mean(self.x, self.mask),
               f"Monte-Carlo mean over {_MC_DRAWS} keys, fn(x.T, axis=0).T vs fn(x)", rtol=0,
               atol=_MC_ATOL)
        return
      w = self.call(self.x, self.mask)
      wt = self.call(self.x.T, self.mask.T, axis=0)
      _close(wt.T, w, "fn(x.T, axis=0).T vs fn(x)", **SAME_TOL)

  def row_properties(self):
    w = self.call(self.x, self.mask)
    with self.prop(*_row_property_names(self.spec)):
      _row_properties(self.spec, w, self.mask, "random rows", check_dense=True)
      _row_properties(self.spec, self.call(self.x), np.ones(self.x.shape, bool),
                      "random rows, no mask", check_dense=True)

  def shift_invariance(self):
    if not self.spec.shift_invariant:
      return
    with self.prop("shift_invariance"):
      w = self.call(self.x, self.mask)
      cs = jax.random.uniform(jax.random.fold_in(self.key, 1), (self.x.shape[0], 1),
                              minval=-5.0, maxval=5.0)
      _close(self.call(self.x + cs, self.mask), w, "fn(x + c) vs fn(x), c ~ U(-5, 5)",
             **SHIFT_TOL)
      for shift in (1000.0, -1000.0):
        xs = self.x + shift  # (x + c) - c is exact in float32 here (Sterbenz)
        ws = self.call(xs, self.mask)
        _finite(ws, f"fn(x {shift:+g})")
        _close(ws, self.call(xs - shift, self.mask), f"fn(x {shift:+g}) vs fn(x)", **SHIFT_TOL)

  def permutation_equivariance(self):
    with self.prop("permutation_equivariance"):
      perm = np.asarray(jax.random.permutation(jax.random.fold_in(self.key, 2),
                                               self.x.shape[-1]))
      if self.spec.needs_key:
        got = self._mc_mean(self.x[:, perm], self.mask[:, perm])
        want = self._mc_mean(self.x, self.mask)[:, perm]
        _close(got, want, f"Monte-Carlo mean over {_MC_DRAWS} keys, permuted columns",
               rtol=0, atol=_MC_ATOL)
      else:
        _close(self.call(self.x[:, perm], self.mask[:, perm]),
               self.call(self.x, self.mask)[:, perm], "fn(x[:, perm]) vs fn(x)[:, perm]",
               **SAME_TOL)

  def _mc_mean(self, x, where, axis=-1):
    if not hasattr(self, "_mc"):
      def mean(x, where, keys, axis):
        draws = jax.vmap(lambda k: self.eager(x, where, axis=axis, key=k).astype(jnp.float32))
        return jnp.mean(draws(keys), axis=0)
      # One compilation per shape: eager vmap over thousands of keys compiles every op.
      self._mc = jax.jit(mean, static_argnames=("axis",))
    keys = jax.random.split(jax.random.fold_in(self.key, 3), _MC_DRAWS)
    return self._mc(x, where, keys, axis=axis)

  def mask_invariance(self):
    n = self.x.shape[-1]
    with self.prop("mask_invariance"):
      # Batch over the deleted column j: masking j must equal deleting it (n counts visible).
      cols = np.arange(n)
      x_rep = jnp.broadcast_to(self.x, (n,) + self.x.shape)
      hide = np.asarray(self.mask)[None] & (cols[None, None, :] != cols[:, None, None])
      keep = np.stack([np.delete(cols, j) for j in cols])  # [n, n-1]
      x_del = jnp.stack([self.x[:, keep[j]] for j in cols])
      m_del = np.stack([np.asarray(self.mask)[:, keep[j]] for j in cols])
      if self.spec.needs_key:
        masked = jnp.stack([self._mc_mean(self.x, hide[j]) for j in (0, n // 2)])
        deleted = jnp.stack([self._mc_mean(x_del[j], m_del[j]) for j in (0, n // 2)])
        for i, j in enumerate((0, n // 2)):
          _close(masked[i][:, keep[j]], deleted[i],
                 f"Monte-Carlo mean, column {j} masked vs deleted", rtol=0, atol=_MC_ATOL)
        w = self.call(x_rep, jnp.asarray(hide))
      else:
        w = self.call(x_rep, jnp.asarray(hide))
        w_del = self.call(x_del, jnp.asarray(m_del))
        for j in cols:
          _close(w[j][:, keep[j]], w_del[j], f"column {j} masked vs deleted", **SAME_TOL)
      _row_properties(self.spec, w, hide, "rows with a masked column")
    with self.prop("neg_inf_as_masked"):
      x_inf = jnp.where(self.mask, self.x, -jnp.inf)
      _close(self.call(x_inf), self.call(self.x, self.mask), "-inf logits vs where=False",
             **SAME_TOL)
      _close(self.call(x_inf, self.mask), self.call(self.x, self.mask),
             "-inf logits and where=False together", **SAME_TOL)

  def fully_masked_row(self):
    with self.prop("fully_masked_row"):
      none = jnp.zeros(self.x.shape, bool)
      all_inf = jnp.full(self.x.shape, -jnp.inf)
      for what, (x, where) in {"where all False": (self.x, none),
                               "all logits -inf": (all_inf, None)}.items():
        w = self.call(x, where)
        if np.any(np.asarray(w) != 0):
          raise _Failure(f"{what}: weights {np.asarray(w)[0]} are not all zeros")
        cot = jax.random.normal(jax.random.fold_in(self.key, 4), self.x.shape)
        g = jax.grad(lambda x_, w_=where, c_=cot: jnp.sum(self.call(x_, w_) * c_))(x)
        if not np.all(np.asarray(g) == 0):
          raise _Failure(f"{what}: gradient {np.asarray(g)[0]} is not all zeros")

  def extreme_logits(self):
    scale = jnp.max(jnp.abs(self.x)) + 1e-6
    with self.prop("huge_logits"):
      for mag in (1e4, -1e4):
        xh = self.x / scale * mag
        w = self.call(xh, self.mask)
        _row_properties(self.spec, w, self.mask, f"x scaled to max |x| = {abs(mag):g}",
                        sum_atol=1e-4)
        g = jax.grad(lambda x_: jnp.sum(self.call(x_, self.mask) ** 2))(xh)
        _finite(g, f"gradient at max |x| = {abs(mag):g}")
    with self.prop("tiny_logits"):
      xt = self.x / scale * 1e-30
      _row_properties(self.spec, self.call(xt, self.mask), self.mask,
                      "x scaled to max |x| = 1e-30", sum_atol=1e-4)

  def low_precision(self):
    scale = jnp.max(jnp.abs(self.x)) + 1e-6
    inputs = {"random rows": self.x, "max |x| = 100": self.x / scale * 100.0}
    if self.spec.shift_invariant:
      inputs.update({"x + 1000": self.x + 1000.0, "x - 1000": self.x - 1000.0})
    with self.prop("low_precision"):
      for dt, tol in LOW_PRECISION_TOL.items():
        for what, xi in inputs.items():
          xq = xi.astype(dt)
          w = self.call(xq, self.mask)
          if w.dtype != dt:
            raise _Failure(f"{dt.name} {what}: output dtype {w.dtype}")
          _finite(w, f"{dt.name} {what}")
          ref = self.call(xq.astype(jnp.float32), self.mask)
          _close(w, ref, f"{dt.name} {what} vs float32 on the same rounded input", **tol)
          if np.any(np.asarray(w)[~np.asarray(self.mask)] != 0):
            raise _Failure(f"{dt.name} {what}: masked entries not exactly 0")

  # -- transformations --------------------------------------------------------------------

  def jit_vmap_grad(self):
    w = self.call(self.x, self.mask)
    with self.prop("jit"):
      jitted = jax.jit(self.eager, static_argnames=("axis",))
      _close(jitted(self.x, self.mask), w, "jit(fn) vs fn", **SAME_TOL)
      _close(jitted(self.x[0]), self.call(self.x[0]), "jit(fn) vs fn, one row", **SAME_TOL)
    with self.prop("vmap"):
      rows = jnp.stack([self.call(self.x[i], self.mask[i]) for i in range(self.x.shape[0])])
      _close(jax.vmap(lambda x, m: self.call(x, m))(self.x, self.mask), rows,
             "vmap(fn) over rows vs one call per row", **SAME_TOL)
      if not self.spec.needs_key:
        _close(w, rows, "fn on a batch vs one call per row", **SAME_TOL)
      else:
        keys = jax.random.split(self.key, 3)
        per_key = jnp.stack([self.call(self.x, self.mask, key=k) for k in keys])
        _close(jax.vmap(lambda k: self.call(self.x, self.mask, key=k))(keys), per_key,
               "vmap over keys vs one call per key", **SAME_TOL)
    with self.prop("grad"):
      cot = jax.random.normal(jax.random.fold_in(self.key, 5), self.x.shape)
      loss = lambda x, m: jnp.sum(self.call(x, m) * cot)
      g = jax.grad(lambda x, m: jnp.sum(self.eager(x, m) * cot))(self.x, self.mask)
      _finite(g, "gradient")
      if np.any(np.asarray(g)[~np.asarray(self.mask)] != 0):
        raise _Failure("gradient at masked entries is not exactly 0")
      _close(jax.jit(jax.grad(loss))(self.x, self.mask), g, "jit(grad(fn)) vs grad(fn)",
             rtol=1e-5, atol=1e-5)
      x_inf = jnp.where(self.mask, self.x, -jnp.inf)
      g_inf = jax.grad(lambda x: jnp.sum(self.call(x) * cot))(x_inf)
      _finite(g_inf, "gradient with -inf logits")
      _close(g_inf, g, "gradient with -inf logits vs where=False", rtol=1e-5, atol=1e-5)

  def check_grads(self, x64_key):
    """Float64 numerical vs automatic gradients, order 1, fwd and rev."""
    if not self.spec.smooth:
      return
    with self.prop("check_grads"), jax.enable_x64(True):
      shape = (4, self.x.shape[-1])
      x = _well_separated(x64_key, shape, jnp.float64)
      where = jnp.asarray(_masks(shape))
      w = self.call(x, where)
      if w.dtype != jnp.float64:
        raise _Failure(f"float64 input gave {w.dtype}")
      try:
        jtu.check_grads(lambda x_: self.eager(x_, where), (x,), order=1,
                        modes=("fwd", "rev"))
      except AssertionError as e:
        raise _Failure(f"gradient with respect to `x`: {e}") from None
      for p in self.spec.params:
        v = self.hparams.get(p.name)
        if p.row_broadcast and _is_float_value(v):
          vs = jnp.full((shape[0], 1), v, jnp.float64)
          try:
            jtu.check_grads(lambda x_, v_, name=p.name: self.eager(x_, where, **{name: v_}),
                            (x, vs), order=1, modes=("fwd", "rev"))
          except AssertionError as e:
            raise _Failure(f"gradient with respect to `x` and a float64 per-row `{p.name}` "
                           f"array: {e}") from None


def _check_params(fn, spec, x, key, check):
  """Defaults match the signature; per-row arrays; out-of-range values raise ValueError."""
  call = _Caller(fn, spec, {}, key)
  base = {p.name: p.default for p in spec.params if p.default is not None}
  mask = jnp.asarray(_masks(x.shape))
  with check("param_defaults"):
    sig: Mapping[str, inspect.Parameter]
    try:
      sig = inspect.signature(fn).parameters
    except (TypeError, ValueError):
      sig = {}
    for p in spec.params:
      if p.name in sig and sig[p.name].default is not inspect.Parameter.empty:
        d = sig[p.name].default
        if not (d is p.default or (d is not None and p.default is not None and d == p.default)):
          raise _Failure(f"`{p.name}`: the spec declares default {p.default!r}, the "
                         f"function's signature has {d!r}")
      if p.default is not None:
        p.validate(p.default, spec.name)
      if p.sample is not None:
        p.validate(p.sample, spec.name)
    if all(p.name in sig and sig[p.name].default is not inspect.Parameter.empty
           for p in spec.params):
      _close(call(x, mask), call(x, mask, **base), "omitting the hyperparameters vs passing "
             "the declared defaults", **SAME_TOL)
  with check("param_values"):
    for p in spec.params:
      values = [v for v in (p.default, p.sample) if v is not None]
      if p.row_broadcast and values and not isinstance(values[0], bool):
        # Row r uses values[r % len(values)]: an array of per-row values == scalar calls.
        per_row = np.array([values[i % len(values)] for i in range(x.shape[0])])[:, None]
        got = call(x, mask, **{**base, p.name: jnp.asarray(per_row, jnp.float32)})
        want = jnp.stack([call(x, mask, **{**base, p.name: values[i % len(values)]})[i]
                          for i in range(x.shape[0])])
        _close(got, want, f"`{p.name}` as a per-row array vs scalar calls", **SAME_TOL)
        jitted = jax.jit(lambda x_, v_, name=p.name: call(x_, mask, **{**base, name: v_}))
        _close(jitted(x, jnp.asarray(per_row, jnp.float32)), got,
               f"jit with a traced `{p.name}`", **SAME_TOL)
      for bad in _out_of_range(p):
        try:
          call(x, mask, **{**base, p.name: bad})
        except ValueError as e:
          if p.name not in str(e):
            raise _Failure(f"`{p.name}`={bad!r} raised ValueError without naming "
                           f"`{p.name}`: {e}") from None
        else:
          raise _Failure(f"`{p.name}`={bad!r} is outside [{p.low}, {p.high}] but raised no "
                         "ValueError")


def check_normalizer(fn: Callable[..., Any] | NormalizerSpec,
                     spec: NormalizerSpec | str | None = None, *, key: jax.Array | None = None,
                     rows: ArrayLike | None = None, quick: bool = False) -> tuple[str, ...]:
  """Checks a normalizer against the invariants its spec declares.

  Runs, for the default hyperparameters and for each parameter's ``sample`` value, the
  properties listed in :data:`PROPERTIES`: shape and dtype preserved (float32, bfloat16,
  float16, float64); ``axis`` honoured; non-negative, rows summing to 1 or to at most 1
  and no exact zero on a visible entry, where declared; shift invariance (per-row shifts,
  also +-1000) where declared; permutation equivariance; mask invariance (masking a column
  equals deleting it, so length-dependent normalizers must count only visible entries);
  ``-inf`` logits behave as masked; fully masked rows give zeros with a zero, finite
  gradient; huge (|x| ~ 1e4) and tiny (|x| ~ 1e-30) logits stay finite with the declared
  properties; bfloat16 and float16 inputs give finite outputs within
  :data:`LOW_PRECISION_TOL` of the float32 result on the same rounded input; ``jit``,
  ``vmap`` and ``grad`` agree with the eager function and gradients are finite and 0 at
  masked entries; ``jax.test_util.check_grads`` (order 1, fwd and rev) in float64 at
  well-separated random points (away from ties and support changes) when
  ``spec.smooth``, also with respect to row-broadcast float hyperparameters; every
  parameter's default and sample work, per-row parameter arrays equal scalar calls, and an
  out-of-range value (``Param.low``/``high``) raises a ValueError naming the parameter.

  For a stochastic normalizer (``spec.needs_key``) the noise is tied to positions, so
  permutation equivariance and mask invariance are checked on the mean of 5000 draws
  (``atol`` 0.05, a 5-sigma margin); everything else uses one fixed key. ``smooth`` covers
  the default and numeric hyperparameter samples; a boolean switch (e.g. a straight-through
  ``hard=True``) is exempt from ``check_grads`` since its gradient is a surrogate by design.

  Args:
    fn: the normalizer ``fn(x, axis=-1, where=None, **hparams)`` (``fn(key, x, ...)``
      when ``spec.needs_key``), or a :class:`NormalizerSpec` (its ``fn`` is checked).
    spec: the declaration to check against: a spec or a registered name. ``None`` looks
      ``fn`` up in the registry, and for an unregistered callable checks only what every
      normalizer must satisfy (no sum, sign or shift claims; pass a spec, e.g.
      ``dataclasses.replace(get("softmax"), fn=fn)``, to check more).
    key: PRNG key for the random rows (and the normalizer's noise); default ``key(0)``.
    rows: optional float array ``[R, n]`` (n >= 2) of finite logits to check on instead
      of the random default ``[8, 10]`` rows; masks are generated for its shape. A
      hyperparameter bounded by the row length (top-k's k) must stay below n - 1, since
      mask invariance deletes a column.
    quick: check the default hyperparameters only (the parameter declarations, sample
      values in per-row arrays and out-of-range errors are still checked); for a fast
      sampled test run, with the full sweep over every sample left to a slow one.

  Returns:
    The names of the properties that ran and passed (those the spec declares and that
    apply to it), in the order of :data:`PROPERTIES`.

  Raises:
    AssertionError: naming the normalizer, the hyperparameter setting and the property.

  Examples:
    >>> def hot_softmax(x, axis=-1, where=None, *, temperature=2.0):
    ...   return js.normalizers.softmax(x, axis, where, temperature=temperature)
    >>> js.testing.check_normalizer(hot_softmax, "softmax")  # the spec says T = 1
    Traceback (most recent call last):
    ...
    AssertionError: normalizer 'softmax' fails property 'param_defaults': `temperature`: ...

  References:
    K. Claessen & J. Hughes, 2000, "QuickCheck: A Lightweight Tool for Random Testing of
    Haskell Programs".
  """
  fn, spec = _resolve(fn, spec)
  key = jax.random.key(0) if key is None else key
  if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.wrap_key_data(key)  # a raw uint32 key from jax.random.PRNGKey
  data_key, fn_key, x64_key = jax.random.split(key, 3)
  if rows is None:
    x = 2.0 * jax.random.normal(data_key, (8, 10), jnp.float32)
  else:
    x = jnp.asarray(rows, jnp.float32)
    if x.ndim != 2 or x.shape[-1] < 2:
      raise ValueError(f"check_normalizer: `rows` must have shape [R, n] with n >= 2, got "
                       f"{x.shape}")
    if not np.all(np.isfinite(np.asarray(x))):
      raise ValueError("check_normalizer: `rows` must be finite")

  ran: set[str] = set()

  @contextlib.contextmanager
  def check(name):
    try:
      yield
    except Exception as e:  # pylint: disable=broad-except
      detail = str(e) if isinstance(e, _Failure) else f"raised {type(e).__name__}: {e}"
      raise AssertionError(f"normalizer {spec.name!r} fails property '{name}': {detail}") from e
    if spec.params:  # with no parameter there was nothing to check
      ran.add(name)

  _check_params(fn, spec, x, fn_key, check)
  settings = _settings(spec)
  for i, (label, hparams) in enumerate(settings[:1] if quick else settings):
    ck = _Checker(fn, spec, hparams, label, x, fn_key, ran)
    ck.shape_dtype()
    ck.row_properties()
    ck.shift_invariance()
    ck.permutation_equivariance()
    ck.mask_invariance()
    ck.fully_masked_row()
    ck.extreme_logits()
    ck.low_precision()
    ck.jit_vmap_grad()
    # A boolean switch (e.g. gumbel's straight-through ``hard``) may use a surrogate gradient.
    if i == 0 or not any(isinstance(v, bool) and v for v in hparams.values()):
      ck.check_grads(x64_key)
  return tuple(p for p in PROPERTIES if p in ran)


# ---------------------------------------------------------------------------------------
# Rule evaluators


_Rule = TypeVar("_Rule", TileRule, ThresholdRule)


def _rule_of(rule, cls: type[_Rule], field: str) -> _Rule:
  """The ``field`` rule ("tile" or "threshold") of a spec, or a bare rule of type ``cls``."""
  if isinstance(rule, NormalizerSpec):
    found = getattr(rule, field)
    if found is None:
      raise ValueError(f"normalizer {rule.name!r} has no {field} rule (class "
                       f"{rule.kernel_class})")
    return found
  if not isinstance(rule, cls):
    raise ValueError(f"`rule` must be a {cls.__name__} or a NormalizerSpec, got "
                     f"{type(rule).__name__}")
  rule.validate()  # a bare tile rule must say its kernel class
  return rule


def evaluate_tile_rule(rule: TileRule | NormalizerSpec, x: ArrayLike, axis: int = -1,
                       where: ArrayLike | None = None, **hparams: Any) -> jax.Array:
  r"""Dense evaluation of a class E/S/P tile rule over whole rows.

  With V the visible entries of a row (``where`` True and ``x > -inf``), n = |V|,
  ``z = score_map(x, n, **hparams)`` and ``m`` the row max of z over V (class E, floored
  by ``m_floor``; 0 for classes S and P, and 0 for a row with nothing visible):

  .. math::
    w_j = \frac{\mathrm{numerator}(z_j, m)}{\sum_{k \in V} \mathrm{denominator}(z_k, m)
          + \mathrm{offset}(m, n)} \quad (E, S), \qquad w_j = \mathrm{numerator}(z_j, m)
          \quad (P)

  with ``w_j = 0`` off V and for a zero denominator. This is the whole row as one block
  of the same tile math (``jaxsoft.normalizers.tile``) that the chunked and Pallas
  attention paths run blockwise; it equals the normalizer itself.

  Args:
    rule: a :class:`TileRule` (with its ``kernel_class``) or a spec carrying one.
    x: scores; computed in float32 for low-precision inputs.
    axis: the row axis.
    where: optional boolean mask broadcastable to ``x``.
    **hparams: the normalizer's hyperparameters, passed to every rule function.

  Returns:
    Weights of ``x``'s shape and dtype.

  Examples:
    >>> x = jnp.array([2.0, 1.0, 0.0, -1.0])
    >>> js.testing.evaluate_tile_rule(js.normalizers.get("softmax"), x, temperature=0.5)
    Array([0.865 , 0.1171, 0.0158, 0.0021], dtype=float32)
    >>> js.normalizers.softmax(x, temperature=0.5)  # the function agrees with its rule
    Array([0.865 , 0.1171, 0.0158, 0.0021], dtype=float32)

  References:
    M. Milakov & N. Gimelshein, 2018, "Online normalizer calculation for softmax".

    T. Dao, D. Y. Fu, S. Ermon, A. Rudra & C. Ré, 2022, "FlashAttention: Fast and
    Memory-Efficient Exact Attention with IO-Awareness".
  """
  rule = _rule_of(rule, TileRule, "tile")
  xs, mask, axis = c.prepare(x, axis, where, "evaluate_tile_rule")
  xs, mask = jnp.moveaxis(xs, axis, -1), jnp.moveaxis(mask, axis, -1)
  length = c.visible_count(mask, -1, xs.dtype)
  m, l = tile.init_rows(rule, length.shape, xs.dtype)
  m, l, num, _ = tile.online_update(rule, xs, mask, m, l, length, hparams)
  m, d = tile.finalize(rule, m, l, length, hparams)
  w = jnp.moveaxis(tile.normalize(rule, num, d), -1, axis)
  return c.finish(w, jnp.moveaxis(mask, -1, axis), jnp.asarray(x).dtype)


def evaluate_tile_rule_online(rule: TileRule | NormalizerSpec, x: ArrayLike, v: ArrayLike,
                              block_sizes: Sequence[int], where: ArrayLike | None = None,
                              **hparams: Any) -> jax.Array:
  r"""Blockwise (online) evaluation of a tile rule fused with a weighted sum: ``w(x) @ v``.

  The row (last axis of ``x``, length S) is cut into consecutive key blocks of the given
  sizes. Per row the state (m, l, acc) starts at (-inf, 0, 0) (class E; m = 0 for S and
  P); for each block b with scores z_b (``z = score_map(x, n)``, n the visible count of
  the whole row, known before the pass as in attention):

  .. math::
    m' = \max(m, \max z_b), \quad \alpha = e^{m - m'} \\
    l' = \alpha l + \sum_{j \in b} \mathrm{denominator}(z_j, m'), \quad
    acc' = \alpha\, acc + \sum_{j \in b} \mathrm{numerator}(z_j, m')\, v_j

  (FlashAttention's rescaling merge). Classes S and P keep m = 0 and α = 1, and class P
  carries no l. Finally ``O = acc / (l + offset(m, n))`` (0 when that is 0; class P:
  ``O = acc``). These are the same functions (``jaxsoft.normalizers.tile``) the chunked
  attention path and the Pallas engine call per tile. A block with no visible entry
  leaves the state unchanged and a fully masked row gives O = 0, with gradients free of
  NaN. Differentiable with respect to ``x``, ``v`` and array hparams.

  Args:
    rule: a :class:`TileRule` (with its ``kernel_class``) or a spec carrying one.
    x: scores ``[..., S]`` (the row is the last axis).
    v: values ``[S, H]`` or broadcastable ``[..., S, H]``.
    block_sizes: positive ints summing to S (unequal sizes allowed).
    where: optional boolean mask broadcastable to ``x``.
    **hparams: the normalizer's hyperparameters.

  Returns:
    ``[..., H]`` in float32 (float64 for float64 inputs).

  Examples:
    >>> softmax = js.normalizers.get("softmax")
    >>> x = jnp.array([2.0, 1.0, 0.0, -1.0])
    >>> js.testing.evaluate_tile_rule_online(softmax, x, jnp.eye(4), [1, 3])  # the weights
    Array([0.6439, 0.2369, 0.0871, 0.0321], dtype=float32)
    >>> v = jnp.arange(4.0)[:, None]
    >>> js.testing.evaluate_tile_rule_online(softmax, x, v, [2, 2]), softmax(x) @ v
    (Array([0.5073], dtype=float32), Array([0.5073], dtype=float32))

  References:
    M. Milakov & N. Gimelshein, 2018, "Online normalizer calculation for softmax".

    T. Dao, D. Y. Fu, S. Ermon, A. Rudra & C. Ré, 2022, "FlashAttention: Fast and
    Memory-Efficient Exact Attention with IO-Awareness".
  """
  rule = _rule_of(rule, TileRule, "tile")
  xs, mask, _ = c.prepare(x, -1, where, "evaluate_tile_rule_online")
  s = xs.shape[-1]
  block_sizes = [int(b) for b in block_sizes]
  if any(b <= 0 for b in block_sizes) or sum(block_sizes) != s:
    raise ValueError(f"evaluate_tile_rule_online: `block_sizes` {block_sizes} must be positive "
                     f"and sum to the row length {s}")
  v = jnp.asarray(v, xs.dtype)
  if v.ndim < 2 or v.shape[-2] != s:
    raise ValueError(f"evaluate_tile_rule_online: `v` must have shape [..., {s}, H], got "
                     f"{v.shape}")
  length = c.visible_count(mask, -1, xs.dtype)
  m, l = tile.init_rows(rule, length.shape, xs.dtype)
  acc = jnp.zeros(xs.shape[:-1] + (v.shape[-1],), xs.dtype)
  start = 0
  for size in block_sizes:
    blk = slice(start, start + size)
    start += size
    m, l, num, alpha = tile.online_update(rule, xs[..., blk], mask[..., blk], m, l, length,
                                          hparams)
    acc = tile.rescale(acc, alpha) + jnp.einsum("...s,...sh->...h", num, v[..., blk, :])
  m, d = tile.finalize(rule, m, l, length, hparams)
  return tile.normalize(rule, acc, d)


def evaluate_threshold_rule(rule: ThresholdRule | NormalizerSpec, x: ArrayLike, axis: int = -1,
                            where: ArrayLike | None = None, **hparams: Any) -> jax.Array:
  r"""Dense bisection evaluation of a class-T threshold rule.

  With z = ``score_map(x, n)`` and m its row max over the visible entries V,
  ``(lo, hi) = bracket(m, n)`` and ``iterations`` bisection steps keep
  ``sum_V mass(z, lo) >= target(n) > sum_V mass(z, hi)``; then, with τ = lo,

  .. math::
    w_j = \mathrm{weight}(z_j, \tau, m) / \sum_{k \in V} \mathrm{weight}(z_k, \tau, m)

  (0 off V and for a zero sum). Taking the lower end keeps the whole support (e.g. exactly
  the k largest for top-k); the final normalisation absorbs the residual error of the
  fixed-iteration solve. Forward only: τ is held constant under differentiation (the
  blockwise kernels use support-restricted backward rules instead).

  Args:
    rule: a :class:`ThresholdRule` or a spec carrying one.
    x, axis, where, **hparams: as in :func:`evaluate_tile_rule`.

  Returns:
    Weights of ``x``'s shape and dtype.

  Examples:
    >>> rule = js.normalizers.get("top_k_softmax").threshold  # a bare rule or its spec
    >>> js.testing.evaluate_threshold_rule(rule, jnp.array([2.0, 1.0, 0.0, -1.0]), k=2)
    Array([0.7311, 0.2689, 0.    , 0.    ], dtype=float32)

  References:
    A. F. T. Martins & R. F. Astudillo, 2016, "From Softmax to Sparsemax: A Sparse Model of
    Attention and Multi-Label Classification".

    B. Peters, V. Niculae & A. F. T. Martins, 2019, "Sparse Sequence-to-Sequence Models".
  """
  rule = _rule_of(rule, ThresholdRule, "threshold")
  xs, mask, axis = c.prepare(x, axis, where, "evaluate_threshold_rule")
  length = c.visible_count(mask, axis, xs.dtype)
  if rule.stats is not None:  # its derived hyperparameters (top-p: softmax's m, l)
    last = tile.with_row_stats(rule, jnp.moveaxis(xs, axis, -1), jnp.moveaxis(mask, axis, -1),
                               jnp.moveaxis(length, axis, -1), hparams)
    hparams = {name: jnp.moveaxis(a, -1, axis) if name not in hparams else a
               for name, a in last.items()}
  z = rule.score_map(xs, length, **hparams)
  m = c.masked_max(z, mask, axis)
  lo, hi = rule.bracket(m, length, **hparams)
  lo = jnp.broadcast_to(jnp.asarray(lo, xs.dtype), m.shape)
  hi = jnp.broadcast_to(jnp.asarray(hi, xs.dtype), m.shape)
  target = rule.target(length, **hparams)

  def step(_, bounds):
    lo, hi = bounds
    tau = 0.5 * (lo + hi)
    total = jnp.sum(jnp.where(mask, rule.mass(z, tau, **hparams), 0.0), axis=axis,
                    keepdims=True)
    above = total >= target
    return jnp.where(above, tau, lo), jnp.where(above, hi, tau)

  lo, hi = jax.lax.fori_loop(0, rule.iterations, step, (lo, hi))
  tau = jax.lax.stop_gradient(lo)
  wt = jnp.where(mask, rule.weight(z, tau, m, **hparams), 0.0)
  w = c.safe_divide(wt, jnp.sum(wt, axis=axis, keepdims=True))
  return c.finish(w, mask, jnp.asarray(x).dtype)


def weight_probe(scores: ArrayLike) -> tuple[jax.Array, jax.Array, jax.Array]:
  r"""One query over keys with the given scores and one-hot values: the output is the weights.

  With ``q = 1`` (``[1, 1, 1, 1]``), ``k_j = z_j`` (``[1, S, 1, 1]``) and ``v_j = e_j``
  (``[1, S, 1, S]``), an attention call with ``scale=1.0`` has logits ``z`` and returns
  :math:`\sum_j w_j e_j = w`, so ``out[0, 0, 0]`` is the weight row an attention
  normalizer gives the scores ``z``.

  Args:
    scores: ``[S]`` float scores.

  Returns:
    ``(q, k, v)`` in the layout ``[B, T, N, H]`` of :func:`jaxsoft.attention.dot_product_attention`.

  Examples:
    >>> q, k, v = js.testing.weight_probe(jnp.array([2.0, 1.0, 0.0]))
    >>> js.attention.dot_product_attention(q, k, v, scale=1.0)[0, 0, 0]
    Array([0.6652, 0.2447, 0.09  ], dtype=float32)
    >>> js.normalizers.softmax(jnp.array([2.0, 1.0, 0.0]))
    Array([0.6652, 0.2447, 0.09  ], dtype=float32)
  """
  z = jnp.asarray(scores)
  if z.ndim != 1 or z.shape[0] == 0 or not jnp.issubdtype(z.dtype, jnp.floating):
    raise ValueError(f"weight_probe: `scores` must be a non-empty 1-D float array, got "
                     f"{z.dtype} of shape {z.shape}")
  n = z.shape[0]
  q = jnp.ones((1, 1, 1, 1), z.dtype)
  return q, z.reshape(1, n, 1, 1), jnp.eye(n, dtype=z.dtype).reshape(1, n, 1, n)
