"""NormalizerSpec: the declaration every normalizer ships with, and the registry.

A spec says what a normalizer is (its function, its kernel class, the properties it
guarantees, its hyperparameters and their valid ranges) and, for the blockwise classes
E, S and P, the *tile rule*: the per-block math that the chunked XLA path and the Pallas
engine share. The test-suite is generated from these declarations.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "Param",
    "TileRule",
    "ThresholdRule",
    "RowStatsRule",
    "NormalizerSpec",
    "REGISTRY",
    "register",
    "check_signature",
    "get",
    "names",
    "resolve",
    "identity_score_map",
    "temperature_score_map",
    "exp_numerator",
    "sigmoid_numerator",
]

KERNEL_CLASSES = ("E", "S", "P", "R", "T", "X")


@dataclasses.dataclass(frozen=True)
class Param:
  """A hyperparameter of a normalizer.

  Attributes:
    name: keyword name in the normalizer's signature.
    default: value used when the caller omits it (``None`` allowed when the
      docstring gives the data-dependent default, e.g. ssmax's ``n``).
    low, high: valid range (``None`` = unbounded on that side).
    low_open, high_open: whether the bound itself is excluded.
    sample: a valid, non-default value the generated tests also exercise.
    row_broadcast: ``True`` when an array broadcast to the rows is accepted
      (shape broadcastable against ``x`` with size 1 along ``axis``).
    static: ``True`` when the value must be a Python constant (a count, an order, a cut
      compiled into the program: top-k's ``k``, top-p's ``p``); a traced value raises
      ValueError naming it. Every other hyperparameter may be traced (a ``jax.jit``
      argument, a learned value), with the same result as the constant.

  Examples:
    >>> from jaxsoft.normalizers import Param
    >>> temperature = Param("temperature", 1.0, low=0.0, low_open=True, sample=0.5)
    >>> temperature.validate(2.0, "my_softmax")  # in range: nothing to say
    >>> temperature.validate(0.0, "my_softmax")
    Traceback (most recent call last):
    ...
    ValueError: my_softmax: `temperature` must be > 0.0, got 0.0

  References:
    The ranges are declarations for the test-suite generated from the registry, in the
    spirit of property-based testing: K. Claessen & J. Hughes, 2000, "QuickCheck: A
    Lightweight Tool for Random Testing of Haskell Programs".
  """

  name: str
  default: Any
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  sample: Any = None
  row_broadcast: bool = False
  static: bool = False

  def validate(self, value, fn_name: str) -> None:
    """Raises ValueError naming the argument when a *concrete* value is out of range."""
    if value is None:
      return
    try:
      v = float(value)  # only concrete scalars are checked at trace time
    except Exception:  # arrays / tracers: checked by the caller if it can
      return
    if math.isnan(v):
      raise ValueError(f"{fn_name}: `{self.name}` must not be NaN")
    if self.low is not None and (v < self.low or (self.low_open and v == self.low)):
      op = ">" if self.low_open else ">="
      raise ValueError(f"{fn_name}: `{self.name}` must be {op} {self.low}, got {value}")
    if self.high is not None and (v > self.high or (self.high_open and v == self.high)):
      op = "<" if self.high_open else "<="
      raise ValueError(f"{fn_name}: `{self.name}` must be {op} {self.high}, got {value}")


@dataclasses.dataclass(frozen=True)
class TileRule:
  """Per-tile math of classes E, S and P, shared by every blockwise path.

  Over key blocks, with ``z = score_map(x, length, **hp)`` elementwise and ``m`` the
  stabiliser (class E: the running row max of ``z`` over visible entries; S and P: 0), a
  normalizer of these classes computes::

      w_j = numerator(z_j, m, **hp) / D,
      D   = sum_j denominator(z_j, m, **hp) + offset(m, length, **hp)   (E, S)
      D   = 1                                                         (P)

  ``numerator`` and ``denominator`` scale by the same factor when ``m`` changes
  (``f(z, m') = f(z, m)·e^{m-m'}`` for class E), so the online (m, l) merge of
  FlashAttention applies; ``offset`` is the row's extra mass (softmax_n's ``n·e^{-m}``,
  a sink logit's ``e^{s-m}``), ``None`` meaning 0. Masked entries contribute 0 to D and
  a row whose D is 0 gets zero weights.

  The kernel class is declared once, on the :class:`NormalizerSpec`; the spec stores it
  here (``kernel_class``), and what the class implies is derived from it:
  ``uses_max`` (class E) and ``normalized`` (classes E and S). A declaration that does not
  fit its class is rejected when the spec is built: E and S need a ``denominator``; P
  takes none and no ``offset``; ``m_floor`` is for class E only.

  ``m_floor`` (class E): when set, the stabiliser is ``max(running max, m_floor)`` (a
  ``-inf`` max of a fully masked block stays ``-inf``). Rules whose numerator,
  denominator or offset contain ``e^{-m}`` declare a floor so a key block whose scores
  are all below about -88 cannot overflow it: a number (softpick, softmax_1: 0), or a
  function ``m_floor(length, **hp)`` of the hyperparameters giving a per-row floor
  (softmax_n: ``log n``, the sink's own logit, so ``n·e^{-m} <= 1``; ``-inf``, no floor,
  for ``n = 0``). :func:`floor_value` evaluates either.

  ``length`` is the number of visible entries of the row (broadcast like a row
  statistic). Backward: with dP_j = dO·v_j and Δ = dO·O,
  ``dz_j = (numerator'(z_j)·dP_j − denominator'(z_j)·Δ) / D`` (P: ``numerator'·dP``),
  the derivatives taken elementwise at fixed ``m``. The math itself lives once, in
  ``jaxsoft.normalizers.tile``.

  Examples:
    >>> from jaxsoft.normalizers import TileRule
    >>> from jaxsoft.normalizers.spec import exp_numerator, identity_score_map
    >>> rule = TileRule(score_map=identity_score_map, numerator=exp_numerator,
    ...                 denominator=exp_numerator, kernel_class="E")  # softmax's rule
    >>> rule.uses_max, rule.normalized
    (True, True)
    >>> js.testing.evaluate_tile_rule(rule, jnp.array([0.0, 0.0, jnp.log(2.0)]))
    Array([0.25, 0.25, 0.5 ], dtype=float32)

  References:
    M. Milakov & N. Gimelshein, 2018, "Online normalizer calculation for softmax".

    T. Dao, D. Y. Fu, S. Ermon, A. Rudra & C. Ré, 2022, "FlashAttention: Fast and
    Memory-Efficient Exact Attention with IO-Awareness".
  """

  score_map: Callable[..., Any]
  numerator: Callable[..., Any]
  denominator: Callable[..., Any] | None = None
  offset: Callable[..., Any] | None = None
  m_floor: float | Callable[..., Any] | None = None
  kernel_class: str | None = None

  @classmethod
  def softmax(cls, score_map: Callable[..., Any], **fields: Any) -> TileRule:
    """The class-E rule ``e^{z - m} / sum e^{z - m}`` of ``z = score_map(x, length, **hp)``.

    Softmax of a score map: numerator and denominator are both :func:`exp_numerator`;
    ``fields`` are the other fields (``offset``, ``m_floor``, ``kernel_class``).

    Examples:
      >>> from jaxsoft.normalizers import TileRule
      >>> from jaxsoft.normalizers.spec import temperature_score_map
      >>> rule = TileRule.softmax(temperature_score_map, kernel_class="E")
      >>> js.testing.evaluate_tile_rule(rule, jnp.array([0.0, jnp.log(3.0)]))
      Array([0.25, 0.75], dtype=float32)
    """
    return cls(score_map=score_map, numerator=exp_numerator, denominator=exp_numerator,
               **fields)

  def floor_value(self, length, hp: Mapping[str, Any]):
    """The stabiliser's floor for rows of visible count ``length``, or None (no floor)."""
    if self.m_floor is None or not callable(self.m_floor):
      return self.m_floor
    return self.m_floor(length, **hp)

  @property
  def uses_max(self) -> bool:
    """The stabiliser is the running row max (class E); S and P use m = 0."""
    return self._declared_class() == "E"

  @property
  def normalized(self) -> bool:
    """Weights are divided by a row denominator (classes E and S); P is not."""
    return self._declared_class() in ("E", "S")

  def _declared_class(self) -> str:
    if self.kernel_class is None:
      raise ValueError(
          "this TileRule has no kernel class yet: build it into a NormalizerSpec, or pass "
          "kernel_class='E', 'S' or 'P'")
    return self.kernel_class

  def validate(self, where: str = "TileRule") -> None:
    """Raises ValueError when the declaration does not fit its kernel class."""
    kind = self._declared_class()
    if kind not in ("E", "S", "P"):
      raise ValueError(f"{where}: a TileRule is for kernel classes E, S and P, got {kind!r}")
    if kind in ("E", "S") and self.denominator is None:
      raise ValueError(f"{where}: a class-{kind} tile rule needs a `denominator` (the row sum "
                       "is part of the class); a rule without one is class P")
    if kind == "P" and (self.denominator is not None or self.offset is not None):
      raise ValueError(f"{where}: a class-P tile rule has no row sum: `denominator` and "
                       "`offset` must be None (declare class S or E to normalise)")
    if self.m_floor is not None and kind != "E":
      raise ValueError(f"{where}: `m_floor` floors the running max of class E; class {kind} "
                       "has no running max")


# --- building blocks of tile rules, shared by the normalizers and the Pallas engine ------
# (the engine recognises them by identity to pick its fast paths)


def identity_score_map(x, length, **_):
  """The score map of rules that use the logits as they are."""
  return x


def temperature_score_map(x, length, temperature=1.0, **_):
  """The score map of softmax with temperature: ``x / T``, computed as ``x (1 / T)`` (one
  reciprocal per row, not a divide per score in the kernels' loops), and ``x`` itself
  for a static T = 1 (plain softmax)."""
  if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
    if temperature == 1:
      return x
    if temperature == 0:  # (refused by the normalizers' checks; no Python ZeroDivisionError)
      return x / temperature
  return x * (1.0 / temperature)


def exp_numerator(z, m, **_):
  """Class-E numerator and denominator: e^{z - m}."""
  return jnp.exp(z - m)


def sigmoid_numerator(z, m, **_):
  """Class-P numerator of sigmoid attention: sigma(z) (the bias is in the score map)."""
  return jax.nn.sigmoid(z)


@dataclasses.dataclass(frozen=True)
class ThresholdRule:
  """Class T: weights from a per-row threshold tau solved over the whole row.

  With ``z = score_map(x, length, **hp)`` elementwise and ``m`` the row max of ``z`` over
  visible entries, tau solves ``sum_j mass(z_j, tau, **hp) = target(length, **hp)``
  (``mass`` non-increasing in tau; ``bracket(m, length, **hp) -> (lo, hi)`` encloses the
  root: ``sum mass(lo) >= target >= sum mass(hi)``), and then::

      w_j = weight(z_j, tau, m, **hp) / sum_k weight(z_k, tau, m, **hp)

  (the final normalisation removes the residual error of a finite solve). A blockwise
  driver computes m in a first pass over key blocks, tau by a search whose every step is a
  pass over the key blocks (``jaxsoft.normalizers.tile``: bisection, at most
  ``iterations`` halvings of the bracket) and then runs a class-P/E pass with ``weight``.
  Examples: sparsemax ``mass = weight = [z - tau]_+`` with target 1; top-k
  ``mass = 1[z >= tau]`` with target ``min(k, n)`` and ``weight = e^{z-m}·1[z >= tau]``.

  ``newton_power(**hp) -> p`` (optional) names an exponent for which
  ``M(tau)^p = (sum_j mass(z_j, tau))^p`` is convex in tau, e.g. ``p = alpha - 1`` for
  entmax's ``mass = [z - tau]_+^{1/(alpha - 1)}`` with ``alpha <= 2`` (then ``M^p`` is the
  ``L_{1/p}`` norm of the convex, non-negative ``[z_j - tau]_+``), ``p = 1`` for sparsemax.
  The search then also takes Newton steps on ``M^p - target^p`` (from below the root they
  stay below it; on sparsemax's fixed support one step is exact, Michelot's iteration) and
  stops once the mass at the lower end is within a few ulps of the target: a handful of
  passes instead of ``iterations``. A p without that convexity (entmax with alpha > 2)
  costs only speed: every Newton point is checked like a bisection point. ``None`` (top-k,
  whose mass is a step function): bisection only.

  ``stats`` (optional): a :class:`RowStatsRule` without a ``second`` pass whose statistics
  a blockwise driver merges over the key blocks before the max pass; ``derive``'s outputs
  join the hyperparameters of ``score_map``, ``mass``, ``target`` and ``bracket`` as
  constants (no gradient: they may only move the threshold of a rule whose kept set is
  piecewise constant, e.g. top-p's ``target = p · sum_j e^{z_j - m}``).

  Examples:
    >>> rule = js.normalizers.get("sparsemax").threshold  # [z - tau]_+ with target 1
    >>> rule.iterations
    30
    >>> js.testing.evaluate_threshold_rule(rule, jnp.array([1.0, 0.8, -1.0]))  # tau = 0.4
    Array([0.6, 0.4, 0. ], dtype=float32)

  References:
    A. F. T. Martins & R. F. Astudillo, 2016, "From Softmax to Sparsemax: A Sparse Model of
    Attention and Multi-Label Classification".

    C. Michelot, 1986, "A finite algorithm for finding the projection of a point onto the
    canonical simplex of R^n".

    B. Peters, V. Niculae & A. F. T. Martins, 2019, "Sparse Sequence-to-Sequence Models".
  """

  score_map: Callable[..., Any]
  mass: Callable[..., Any]
  target: Callable[..., Any]
  bracket: Callable[..., Any]
  weight: Callable[..., Any]
  iterations: int = 30
  newton_power: Callable[..., Any] | None = None
  stats: RowStatsRule | None = None

  def validate(self, where: str = "ThresholdRule") -> None:
    """Raises ValueError naming the field that does not fit the declaration."""
    for name in ("score_map", "mass", "target", "bracket", "weight"):
      if not callable(getattr(self, name)):
        raise ValueError(f"{where}: ThresholdRule.{name} must be callable, got "
                         f"{getattr(self, name)!r}")
    if self.newton_power is not None and not callable(self.newton_power):
      raise ValueError(f"{where}: ThresholdRule.newton_power must be None or callable "
                       f"(hyperparameters -> p), got {self.newton_power!r}")
    it = self.iterations
    if isinstance(it, bool) or not isinstance(it, int) or it < 1:
      raise ValueError(f"{where}: ThresholdRule.iterations must be a positive int, got {it!r}")
    if self.stats is not None and (not isinstance(self.stats, RowStatsRule)
                                   or self.stats.second is not None):
      raise ValueError(f"{where}: ThresholdRule.stats must be a RowStatsRule without a "
                       f"`second` pass (its derived values feed the threshold), got "
                       f"{self.stats!r}")


@dataclasses.dataclass(frozen=True)
class RowStatsRule:
  """Class R: per-row statistics of the whole row first, then an ordinary E or P pass.

  A blockwise driver keeps ``stats`` (a tuple of per-row arrays, size 1 on the key axis)
  for each query row, starting at ``init(row_shape, dtype)``; for each key block it folds
  ``block(x, mask)`` (the block's own statistics of the visible logits) in with
  ``merge(a, b)``, which must be associative (Chan et al.'s merge of count, mean and M2;
  the online (m, l) merge of softmax). ``derive(stats, length, **hp)`` turns the row's
  statistics into extra per-row hyperparameters of ``second``, a class E or P
  :class:`TileRule` that a second pass over the key blocks runs as for any E/P normalizer.

  Gradients: the weights depend on x directly (through ``second``, at fixed derived
  hyperparameters) and through the statistics. ``tangent(x, mask, stats)`` returns, for
  one block and the row's final ``stats``, per-row sums whose derivative with respect to
  the block's x equals the derivative of the final statistics (0 for a component without
  gradient, such as a stabilising max): e.g. ``(0, sum x / n, sum (x - mean)^2)`` for
  (count, mean, M2). A backward pass takes the derived hyperparameters' cotangents from a
  first sweep, pulls them back through ``derive`` to cotangents of the statistics, and adds
  ``vjp(tangent)`` per tile in its main sweep.
  """

  init: Callable[..., tuple]
  block: Callable[..., tuple]
  merge: Callable[..., tuple]
  derive: Callable[..., dict]
  tangent: Callable[..., tuple]
  second: TileRule | None  # None only as a ThresholdRule's ``stats``

  def validate(self, where: str = "RowStatsRule") -> None:
    """Raises ValueError unless ``second`` is a class E or P tile rule."""
    if self.second is None:
      raise ValueError(f"{where}: a class-R row-statistics rule needs a `second` pass")
    self.second.validate(f"{where}: RowStatsRule.second")
    if self.second.kernel_class not in ("E", "P"):
      raise ValueError(f"{where}: the second pass of a row-statistics rule is class E or P, "
                       f"got {self.second.kernel_class!r}")

  def over_blocks(self, x, mask, length, block_sizes, **hp) -> dict:
    """The derived hyperparameters from consecutive key blocks of the last axis of ``x``
    (a plain reading of what a blockwise driver does)."""
    stats = self.init(x.shape[:-1] + (1,), x.dtype)
    start = 0
    for size in block_sizes:
      part = self.block(x[..., start:start + size], mask[..., start:start + size])
      stats = self.merge(stats, part)
      start += size
    if start != x.shape[-1]:
      raise ValueError(f"block sizes {tuple(block_sizes)} do not cover the row of {x.shape[-1]}")
    return self.derive(stats, length, **hp)


@dataclasses.dataclass(frozen=True)
class NormalizerSpec:
  """The declaration of one normalizer (see the README's "Adding a normalizer").

  Attributes:
    name: registry name, usable as ``normalizer="name"`` everywhere.
    fn: ``fn(x, axis=-1, where=None, *, **hparams)``, hyperparameters keyword-only
      (``fn(key, x, ...)`` when ``needs_key``); checked by :func:`register`.
    kernel_class: one of E, S, P, R, T, X (explained in docs/feature_ids.md).
    catalogue_id: the feature id, e.g. "N01" (listed in docs/feature_ids.md).
    sums_to_one: rows with a visible entry sum to 1.
    at_most_one: rows sum to at most 1 (implied by ``sums_to_one``).
    nonnegative: every weight is >= 0.
    shift_invariant: ``fn(x + c) == fn(x)`` for a per-row constant c.
    can_be_sparse: exact zeros can appear on visible entries.
    length_dependent: the output depends on n, the visible count of the row.
    params: hyperparameters with defaults and valid ranges.
    tile: the tile rule for classes E, S, P; ``None`` otherwise.
    threshold: the threshold rule for class T; ``None`` otherwise.
    row_stats: the row-statistics rule for class R (blockwise: statistics merged over key
      blocks, then an E or P pass); ``None`` otherwise (the dense path only).
    needs_key: the function takes a PRNG key first (stochastic normalizers).
    smooth: differentiable everywhere (``check_grads`` applies at random points).
    residuals: ``"output"`` when reverse mode keeps only the output (and per-row
      statistics) between the forward and the backward pass, as ``jax.nn.softmax`` does:
      the derivative is written as a function of the output (a ``custom_jvp``); a
      generated test holds it to that. ``"any"`` (the default) promises nothing.
    description: one line for tables.

  Examples:
    >>> spec = js.normalizers.get("sparsemax")
    >>> spec.kernel_class, spec.catalogue_id, spec.can_be_sparse
    ('T', 'N16', True)
    >>> spec(jnp.array([1.0, 0.8, -1.0]))  # calling a spec calls its function
    Array([0.6, 0.4, 0. ], dtype=float32)

  References:
    M. Milakov & N. Gimelshein, 2018, "Online normalizer calculation for softmax".

    T. Dao, D. Y. Fu, S. Ermon, A. Rudra & C. Ré, 2022, "FlashAttention: Fast and
    Memory-Efficient Exact Attention with IO-Awareness".
  """

  name: str
  fn: Callable[..., Any]
  kernel_class: str
  catalogue_id: str
  sums_to_one: bool = True
  at_most_one: bool = True
  nonnegative: bool = True
  shift_invariant: bool = True
  can_be_sparse: bool = False
  length_dependent: bool = False
  params: tuple[Param, ...] = ()
  tile: TileRule | None = None
  threshold: ThresholdRule | None = None
  row_stats: RowStatsRule | None = None
  needs_key: bool = False
  smooth: bool = True
  residuals: str = "any"
  description: str = ""

  def __post_init__(self):
    if self.kernel_class not in KERNEL_CLASSES:
      raise ValueError(f"kernel_class must be one of {KERNEL_CLASSES}, got {self.kernel_class!r}")
    if self.residuals not in ("any", "output"):
      raise ValueError(f"normalizer {self.name!r}: residuals must be 'any' or 'output', got "
                       f"{self.residuals!r}")
    where = f"normalizer {self.name!r}"
    if self.kernel_class in ("E", "S", "P"):
      if self.tile is None:
        raise ValueError(f"{where} of class {self.kernel_class} needs a tile rule")
      if self.tile.kernel_class not in (None, self.kernel_class):
        raise ValueError(f"{where} is declared class {self.kernel_class} but its tile rule says "
                         f"class {self.tile.kernel_class}")
      # the class is declared once, on the spec; the rule carries it for its users
      object.__setattr__(self, "tile",
                         dataclasses.replace(self.tile, kernel_class=self.kernel_class))
      self.tile.validate(where)
    elif self.tile is not None:
      raise ValueError(f"{where} of class {self.kernel_class} cannot carry a tile rule")
    if self.kernel_class != "T" and self.threshold is not None:
      raise ValueError(f"{where} of class {self.kernel_class} cannot carry a threshold rule")
    if self.threshold is not None:
      self.threshold.validate(where)
    if self.row_stats is not None:
      if self.kernel_class != "R":
        raise ValueError(f"{where} of class {self.kernel_class} cannot carry a row-statistics "
                         "rule")
      self.row_stats.validate(where)

  @property
  def defaults(self) -> dict[str, Any]:
    return {p.name: p.default for p in self.params}

  def param(self, name: str) -> Param:
    for p in self.params:
      if p.name == name:
        return p
    raise KeyError(f"normalizer {self.name!r} has no parameter {name!r}")

  def validate(self, hparams: Mapping[str, Any]) -> None:
    """Raises ValueError naming the argument for unknown or out-of-range hparams."""
    known = {p.name for p in self.params}
    for k, v in hparams.items():
      if k not in known:
        raise ValueError(
            f"normalizer {self.name!r} got unknown hyperparameter `{k}`; it takes {sorted(known)}")
      self.param(k).validate(v, self.name)

  def __call__(self, *args, **kwargs):
    return self.fn(*args, **kwargs)


REGISTRY: dict[str, NormalizerSpec] = {}


_LEADING = ("x", "axis", "where")


def check_signature(fn: Callable[..., Any], needs_key: bool, name: str) -> None:
  """Raises ValueError unless ``fn`` is ``fn([key,] x, axis=-1, where=None, *, **hparams)``.

  ``x``, ``axis`` and ``where`` (after the PRNG ``key`` of stochastic normalizers) are the
  only positional parameters, in that order, ``axis`` defaulting to -1 and ``where`` to
  None; every hyperparameter is keyword-only, so a second positional argument is always
  the axis (as in ``jax.nn.softmax``), never silently a hyperparameter.
  """
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):
    raise ValueError(f"normalizer {name!r}: cannot read the signature of {fn!r}") from None
  leading = (("key",) if needs_key else ()) + _LEADING
  positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                p.VAR_POSITIONAL)]
  want = f"({', '.join(leading[:-2])}, axis=-1, where=None, *, <hyperparameters>)"
  got = tuple(p.name for p in positional)
  if got != leading or any(p.kind == p.VAR_POSITIONAL for p in positional):
    raise ValueError(
        f"normalizer {name!r}: the signature must be {want} with every hyperparameter "
        f"keyword-only; got positional parameters {got}")
  by_name = {p.name: p for p in params}
  if by_name["axis"].default != -1 or by_name["where"].default is not None:
    raise ValueError(f"normalizer {name!r}: the signature must be {want} (axis defaults to "
                     "-1 and where to None)")


def register(spec: NormalizerSpec) -> NormalizerSpec:
  """Adds ``spec`` to the registry (names are unique) and returns it.

  The function's signature is checked (:func:`check_signature`): hyperparameters must be
  keyword-only; and it must carry ``common.dense_rules`` (the shared input rules).
  Registering the registered spec again is a no-op.

  Args:
    spec: the declaration to add.

  Returns:
    ``spec``.

  Examples:
    >>> import dataclasses
    >>> softmax = js.normalizers.get("softmax")
    >>> js.normalizers.register(softmax) is softmax
    True
    >>> def plain(x, axis=-1, where=None):
    ...   return x
    >>> js.normalizers.register(dataclasses.replace(softmax, name="plain", fn=plain))
    Traceback (most recent call last):
    ...
    ValueError: normalizer 'plain': decorate its function with ...dense_rules, ...

  References:
    M. Milakov & N. Gimelshein, 2018, "Online normalizer calculation for softmax".

    T. Dao, D. Y. Fu, S. Ermon, A. Rudra & C. Ré, 2022, "FlashAttention: Fast and
    Memory-Efficient Exact Attention with IO-Awareness".
  """
  check_signature(spec.fn, spec.needs_key, spec.name)
  base = getattr(spec.fn, "func", spec.fn)  # a functools.partial of a normalizer
  if not getattr(base, "_jaxsoft_dense_rules", False):
    raise ValueError(
        f"normalizer {spec.name!r}: decorate its function with "
        "jaxsoft.normalizers.common.dense_rules, which applies the input rules every "
        "normalizer shares (integer promotion, empty arrays, the +inf and NaN rules)")
  if spec.name in REGISTRY and REGISTRY[spec.name] is not spec:
    raise ValueError(f"normalizer {spec.name!r} is already registered")
  REGISTRY[spec.name] = spec
  return spec


def get(name: str) -> NormalizerSpec:
  """Returns the registered spec for ``name``; KeyError naming it otherwise.

  Args:
    name: a registered name (:func:`names`).

  Returns:
    The :class:`NormalizerSpec`.

  Examples:
    >>> spec = js.normalizers.get("entmax15")
    >>> spec.kernel_class, spec.description
    ('T', '[x/2 - tau]_+^2, exact 1.5-entmax')

  References:
    M. Milakov & N. Gimelshein, 2018, "Online normalizer calculation for softmax".

    T. Dao, D. Y. Fu, S. Ermon, A. Rudra & C. Ré, 2022, "FlashAttention: Fast and
    Memory-Efficient Exact Attention with IO-Awareness".
  """
  try:
    return REGISTRY[name]
  except KeyError:
    raise KeyError(
        f"unknown normalizer {name!r}; registered: {', '.join(sorted(REGISTRY))}") from None


def names() -> list[str]:
  """The registered normalizer names, sorted: what ``normalizer="name"`` accepts.

  Returns:
    A sorted list of names.

  Examples:
    >>> "softmax" in js.normalizers.names(), "sparsemax" in js.normalizers.names()
    (True, True)

  References:
    M. Milakov & N. Gimelshein, 2018, "Online normalizer calculation for softmax".

    T. Dao, D. Y. Fu, S. Ermon, A. Rudra & C. Ré, 2022, "FlashAttention: Fast and
    Memory-Efficient Exact Attention with IO-Awareness".
  """
  return sorted(REGISTRY)


def resolve(normalizer) -> NormalizerSpec | Callable[..., Any]:
  """A name, a NormalizerSpec or a callable -> a spec (or the callable itself).

  How every ``normalizer=`` argument of the library is read.

  Args:
    normalizer: a registered name, a :class:`NormalizerSpec` or a callable with the
      normalizer signature.

  Returns:
    The spec, or the callable unchanged; TypeError for anything else.

  Examples:
    >>> js.normalizers.resolve("softmax") is js.normalizers.get("softmax")
    True
    >>> js.normalizers.resolve(jax.nn.softmax) is jax.nn.softmax  # a callable as it is
    True

  References:
    M. Milakov & N. Gimelshein, 2018, "Online normalizer calculation for softmax".

    T. Dao, D. Y. Fu, S. Ermon, A. Rudra & C. Ré, 2022, "FlashAttention: Fast and
    Memory-Efficient Exact Attention with IO-Awareness".
  """
  if isinstance(normalizer, NormalizerSpec):
    return normalizer
  if isinstance(normalizer, str):
    return get(normalizer)
  if callable(normalizer):
    return normalizer
  raise TypeError(
      f"`normalizer` must be a registered name, a NormalizerSpec or a callable, got {normalizer!r}")

