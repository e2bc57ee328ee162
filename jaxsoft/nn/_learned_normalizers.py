"""Learned-parameter normalizers as Flax NNX modules.

Each module owns the parameters of one normalizer and returns its hyperparameters (per head,
per query or per input), or applies the normalizer with them. Every parameter is kept in
its valid range by construction (temperatures through a sigmoid between two bounds or a
softplus, bounded token terms through tanh), and each module starts at a documented
baseline:

* :class:`MultiMax` (N11): ``t = 0`` is softmax (``init_std=0`` starts there);
* :class:`QASSMax` (N06): at init (zero last layers) it is SSMax with ``s = 1``;
* :class:`SSA` (N07): at init (zero token projection) it is ``ssa_softmax`` at
  ``alpha_init``; ``alpha -> -inf`` is softmax;
* :class:`AffineScaled` (A15, N27): at init (zero projections) it is ``affine_softmax``
  with ``alpha = alpha_init`` (default 1: softmax) and no bias mass;
* :class:`ASEntmax` (N18): at init (zero projection) it is ``asentmax`` with
  ``beta = beta_init``; ``beta = 0, delta = 1`` is alpha-entmax;
* :class:`PolarSink` (N12): at init it is ``polar_softmax`` at its defaults; a null bias
  and alpha -> -inf give softmax;
* :class:`TempNet` (N31): at init the temperature is the constant ``tau_init``;
* :class:`MoEGate` (N32): ``softmax(sigmoid(W x + b) / tau)``; ``activation=False`` is
  the plain dense-to-sparse gate ``softmax((W x + b) / tau)``;
* :class:`DirichletCalibration` (N30): at init ``W = I``, ``b = 0``, the identity map.

Attention. Every module but DirichletCalibration plugs into
:class:`jaxsoft.nn.MultiHeadAttention` through ``learned=(module, ...)``. Its
``normalizer`` attribute names the registered normalizer it belongs to (the layer's
``normalizer`` must be that one), and the layer calls

* ``attention_hyperparams(q, n_visible)``: with ``q`` the queries ``[B, N, T, H]`` and
  ``n_visible`` the number of keys each query sees (broadcastable to ``[B, N, T, 1]``),
  a dict of the normalizer's hyperparameters, each broadcastable to the scores
  ``[B, N, T, S]``;
* ``attention_queries(q, n_visible)``: the queries the scores are computed from (``q``
  itself for all but :class:`QASSMax`, which rescales them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import ArrayLike

from jaxsoft import normalizers as nz
from jaxsoft._validation import finite_float, positive_int
from jaxsoft.attention import masks as _masks
from jaxsoft.attention import softplus_from_range, softplus_to_range

__all__ = ["MultiMax", "QASSMax", "SSA", "AffineScaled", "ASEntmax", "PolarSink", "TempNet",
           "MoEGate", "DirichletCalibration"]

# Open lower bounds at 0 kept open in float32 (softplus underflows to exactly 0).
_GAMMA_MARGIN = 1e-3
_TAU_MARGIN = 1e-3

_MULTIMAX_NAMES = ("t1", "t2", "t3", "t4", "b1", "b2", "b3", "b4")


def _per_head(value, num_heads: int, name: str, owner: str) -> jax.Array:
  """A per-head initial value: a finite scalar or an array of shape ``[num_heads]``."""
  v = np.asarray(value, np.float64)
  if v.ndim == 0:
    v = np.full((num_heads,), finite_float(v, name, owner))
  if v.shape != (num_heads,):
    raise ValueError(f"{owner}: `{name}` must be a float or an array of shape "
                     f"[num_heads] = [{num_heads}], got shape {v.shape}")
  if not np.all(np.isfinite(v)):
    raise ValueError(f"{owner}: `{name}` must be finite, got {value!r}")
  return jnp.asarray(v, jnp.float32)


def _learned_value(param: nnx.Param, shape: tuple[int, ...], name: str, owner: str):
  """The current value of a learned parameter, at least float32; ValueError naming it when
  an assignment changed its shape."""
  v = jnp.asarray(param[...])
  if tuple(v.shape) != shape:
    raise ValueError(f"{owner}: learned parameter `{name}` must have shape {shape}, got "
                     f"{tuple(v.shape)}")
  return v.astype(jnp.promote_types(v.dtype, jnp.float32))


def _head_queries(q, num_heads: int, head_dim: int | None, owner: str) -> jax.Array:
  """``q`` checked to be ``[B, N, T, H]`` with this module's N (and H when it has one)."""
  q = jnp.asarray(q)
  ok = q.ndim == 4 and q.shape[1] == num_heads and (head_dim is None or q.shape[3] == head_dim)
  if not ok:
    h = "H" if head_dim is None else head_dim
    raise ValueError(f"{owner}: `q` must have shape [B, {num_heads}, T, {h}] (queries per "
                     f"head), got {q.shape}")
  return q


def _query_projection(module: Any, q, kernel: str, bias: str, owner: str) -> jax.Array:
  """``w_h . q + c_h``, ``[B, N, T]`` for queries ``q [B, N, T, H]``, with the module's
  per-head learned ``kernel`` ``[N, H]`` and ``bias`` ``[N]`` (attribute names)."""
  q = _head_queries(q, module.num_heads, module.head_dim, owner)
  w = _learned_value(getattr(module, kernel), (module.num_heads, module.head_dim), kernel, owner)
  c = _learned_value(getattr(module, bias), (module.num_heads,), bias, owner)
  z = jnp.einsum("bnth,nh->bnt", q.astype(jnp.promote_types(q.dtype, w.dtype)), w)
  return z + c[None, :, None]


def _visible(n_visible, q, owner: str) -> jax.Array:
  """``n_visible`` as float32 broadcastable to ``[B, N, T, 1]``."""
  n = jnp.asarray(n_visible, jnp.float32)
  want = q.shape[:3] + (1,)
  try:
    if n.ndim > 4:
      raise ValueError
    jnp.broadcast_shapes((1,) * (4 - n.ndim) + n.shape, want)  # symbolic dims allowed
  except ValueError:
    raise ValueError(f"{owner}: `n_visible` of shape {n.shape} does not broadcast to "
                     f"[B, N, T, 1] = {want}") from None
  return n.reshape((1,) * (4 - n.ndim) + n.shape)


class LearnedNormalizer(nnx.Module):
  """The attention protocol the learned-parameter modules share (see the module docstring).

  Subclasses set ``normalizer`` (the registered name whose hyperparameters they produce)
  and implement :meth:`attention_hyperparams`; :meth:`attention_queries` leaves the
  queries as they are unless a module rescales them.

  Examples:
    A module that gives softmax a fixed temperature, plugged into the layer:

    >>> class Sharpen(js.nn.LearnedNormalizer):
    ...   normalizer = "softmax"
    ...   def attention_hyperparams(self, q, n_visible):
    ...     return {"temperature": 0.5}
    >>> layer = js.nn.MultiHeadAttention(2, 8, learned=(Sharpen(),), rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((1, 3, 8))).shape
    (1, 3, 8)

  References:
    A. Vaswani, N. Shazeer, N. Parmar, J. Uszkoreit, L. Jones, A. N. Gomez, Ł. Kaiser &
    I. Polosukhin, 2017, "Attention Is All You Need" (the attention the modules plug into).
  """

  normalizer: str = "softmax"

  def attention_hyperparams(self, q: ArrayLike,
                            n_visible: ArrayLike | None) -> dict[str, Any]:
    """The normalizer's hyperparameters for queries ``q [B, N, T, H]`` that see
    ``n_visible`` keys (broadcastable to ``[B, N, T, 1]``), each broadcastable to the
    scores ``[B, N, T, S]``."""
    raise NotImplementedError

  def attention_queries(self, q: ArrayLike, n_visible: ArrayLike) -> jax.Array:
    """The queries ``[B, N, T, H]`` the scores are computed from (``q`` unchanged)."""
    del n_visible
    return jnp.asarray(q)

  changes_values: bool = False
  """Whether :meth:`attention_values` changes the values (the layer must then apply it)."""

  def attention_values(self, v: ArrayLike) -> jax.Array:
    """The values ``[B, K, S, H]`` (K key/value heads) the weights average (``v``
    unchanged)."""
    return jnp.asarray(v)


class _PerHeadNormalizer(LearnedNormalizer):
  """A learned normalizer whose hyperparameters are one value per head, whatever the query
  (:meth:`hyperparameters`, each ``[N, 1, 1]``)."""

  num_heads: int

  def hyperparameters(self) -> dict[str, jax.Array]:
    raise NotImplementedError

  def attention_hyperparams(self, q: ArrayLike,
                            n_visible: ArrayLike | None) -> dict[str, Any]:
    """Each head's values as ``[N, 1, 1]`` (the queries only fix N)."""
    del n_visible
    _head_queries(q, self.num_heads, None, type(self).__name__)
    return self.hyperparameters()

  def _apply_per_head(self, fn, scores: ArrayLike, where: ArrayLike | None) -> jax.Array:
    """``fn`` over the last axis of ``scores [..., N, T, S]`` with each head's values."""
    s = jnp.asarray(scores)
    if s.ndim < 3 or s.shape[-3] != self.num_heads:
      raise ValueError(f"{type(self).__name__}: `scores` must have shape "
                       f"[..., {self.num_heads}, T, S], got {s.shape}")
    return fn(s, -1, where, **self.hyperparameters())


class MultiMax(_PerHeadNormalizer):
  r"""MultiMax's learned slopes and breakpoints, per head (feature N11).

  From Y. Zhou, M. Fritz, M. Keuper, "MultiMax: Sparse and Multi-Modal Attention Learning"
  (ICML 2024): parameters ``t1..t4`` and ``b1..b4`` (``ts`` and ``ranges`` in the official
  code, one set per layer, ``trunc_normal(std=0.02)``), here one set per head, for
  :func:`jaxsoft.normalizers.multimax`. They are unconstrained, as in the paper (the map
  keeps the order of the scores when ``t1 <= 1`` and ``t2 >= -1``; not enforced).

  Args:
    num_heads: N; the hyperparameters come back as ``[N, 1, 1]`` arrays for scores
      ``[B, N, T, S]``.
    init_std: standard deviation of the truncated-normal init (0.02 as in the code); 0
      starts exactly at softmax.
    rngs: ``nnx.Rngs`` for the init.

  In attention (``learned=(MultiMax(N, ...),)`` with ``normalizer="multimax"``) each head
  uses its own parameters.

  Examples:
    >>> mm = js.nn.MultiMax(2, init_std=0.0, rngs=nnx.Rngs(0))   # t = 0: softmax
    >>> scores = jnp.array([[[0.0, 1.0, 2.0]], [[1.0, 1.0, 1.0]]])   # [N, T, S]
    >>> mm(scores)
    Array([[[0.09  , 0.2447, 0.6652]],
           [[0.3333, 0.3333, 0.3333]]], dtype=float32)
    >>> sorted(mm.hyperparameters())
    ['b1', 'b2', 'b3', 'b4', 't1', 't2', 't3', 't4']

  References:
    Y. Zhou, M. Fritz & M. Keuper, 2024, "MultiMax: Sparse and Multi-Modal Attention
    Learning".
  """

  normalizer = "multimax"

  def __init__(self, num_heads: int, *, init_std: float = 0.02, rngs: nnx.Rngs):
    positive_int(num_heads, "num_heads", "MultiMax")
    if not init_std >= 0:
      raise ValueError(f"MultiMax: `init_std` must be >= 0, got {init_std!r}")
    self.num_heads = num_heads
    init = jax.nn.initializers.truncated_normal(init_std)
    self.t = nnx.Param(init(rngs.params(), (4, num_heads), jnp.float32))
    self.b = nnx.Param(init(rngs.params(), (4, num_heads), jnp.float32))

  def hyperparameters(self) -> dict[str, jax.Array]:
    """``{"t1": [N, 1, 1], ..., "b4": [N, 1, 1]}`` for :func:`jaxsoft.normalizers.multimax`."""
    vals = jnp.concatenate([self.t[...], self.b[...]], axis=0)
    return {name: vals[i].reshape(self.num_heads, 1, 1) for i, name in enumerate(_MULTIMAX_NAMES)}

  def __call__(self, scores: ArrayLike, where: ArrayLike | None = None) -> jax.Array:
    """``multimax(scores)`` over the last axis with each head's parameters; ``scores``
    ``[..., N, T, S]``."""
    return self._apply_per_head(nz.multimax, scores, where)


class QASSMax(LearnedNormalizer):
  r"""Query-aware scalable softmax: the query scaling of QASSMax (feature N06).

  From TabICLv2 (soda-inria/tabicl; arXiv 2602.11139, 2026), as several reimplementations
  quote it: before ordinary softmax attention the queries are rescaled,

  .. math::
    \tilde q_{h,i} = q_{h,i} \odot \mathrm{base}(\log n)_h \odot
      \big(1 + \tanh(\mathrm{MLP}_{gate}(q_{h,i}))\big),

  n the number of keys the query sees. ``MLP_gate``: ``d_h -> hidden -> d_h`` (GELU), last
  layer zero-initialised, so the gate is 1 at init. [R] The base is taken in the
  "init = SSMax" form some reimplementations use:
  ``base(l) = l * (1 + tanh(MLP_base(l)))`` with ``MLP_base: 1 -> hidden -> N d_h`` (GELU)
  and a zero last layer, so at init ``q~ = q log n`` and ``softmax(q~ k^T / sqrt d)`` is
  SSMax with ``s = 1`` (the paper's own ``MLP_base(log n)`` without the ``l`` factor is
  not pinned down by the note). Both factors stay in ``(0, 2)`` times their baseline.
  The scale is computed in the queries' dtype, at least float32: float64 queries (under
  ``JAX_ENABLE_X64``) get a float64 ``log n``; bfloat16 queries are rescaled in float32 and
  returned in bfloat16.

  Args:
    num_heads: N.
    head_dim: d_h.
    hidden: the MLPs' hidden width (64 in TabICLv2).
    rngs: ``nnx.Rngs``.

  In attention (``learned=(QASSMax(N, H),)`` with ``normalizer="softmax"``) the layer's
  queries are rescaled by :meth:`attention_queries` with each query's visible count n.

  Examples:
    >>> qa = js.nn.QASSMax(2, 4, hidden=8, rngs=nnx.Rngs(0))
    >>> q = jnp.ones((1, 3, 2, 4))                          # [B, T, N, d_h]
    >>> n = jnp.arange(1.0, 4.0)                            # causal rows see 1, 2, 3 keys
    >>> qa(q, n)[0, :, 0, 0]                                # at init q log n: SSMax, s = 1
    Array([0.    , 0.6931, 1.0986], dtype=float32)

  References:
    TabICLv2, 2026 (arXiv 2602.11139; soda-inria/tabicl): the query-aware scaling, as
    its reimplementations quote it.

    K. M. Nakanishi, 2025, "Scalable-Softmax Is Superior for Attention" (SSMax, the
    baseline at init).
  """

  normalizer = "softmax"

  def __init__(self, num_heads: int, head_dim: int, *, hidden: int = 64, rngs: nnx.Rngs):
    for name, v in (("num_heads", num_heads), ("head_dim", head_dim), ("hidden", hidden)):
      positive_int(v, name, "QASSMax")
    self.num_heads, self.head_dim = num_heads, head_dim
    zeros = nnx.initializers.zeros_init()
    self.base_in = nnx.Linear(1, hidden, rngs=rngs)
    self.base_out = nnx.Linear(hidden, num_heads * head_dim, kernel_init=zeros, rngs=rngs)
    self.gate_in = nnx.Linear(head_dim, hidden, rngs=rngs)
    self.gate_out = nnx.Linear(hidden, head_dim, kernel_init=zeros, rngs=rngs)

  def base(self, log_n: ArrayLike) -> jax.Array:
    """``base(l) = l (1 + tanh(MLP_base(l)))``, ``[..., N, d_h]`` for ``l`` of shape ``[...]``
    (computed in ``l``'s float dtype, at least float32)."""
    ell = jnp.asarray(log_n)
    ell = ell.astype(jnp.promote_types(ell.dtype, jnp.float32))[..., None]
    h = self.base_out(jax.nn.gelu(self.base_in(ell)))
    scale = ell * (1.0 + jnp.tanh(h))
    return scale.reshape(scale.shape[:-1] + (self.num_heads, self.head_dim))

  def gate(self, q: ArrayLike) -> jax.Array:
    """``1 + tanh(MLP_gate(q))`` elementwise, in (0, 2); ``q`` ``[..., N, d_h]``."""
    return 1.0 + jnp.tanh(self.gate_out(jax.nn.gelu(self.gate_in(jnp.asarray(q)))))

  def __call__(self, q: ArrayLike, n: ArrayLike) -> jax.Array:
    """The rescaled queries ``q~`` of ``q`` ``[B, T, N, d_h]``; ``n`` (keys seen, >= 1)
    broadcasts to ``[B, T]`` (a scalar, ``[T]`` for causal rows ``i + 1``, or ``[B, T]``)."""
    q = jnp.asarray(q)
    if q.ndim != 4 or q.shape[-2:] != (self.num_heads, self.head_dim):
      raise ValueError(f"QASSMax: `q` must have shape [B, T, {self.num_heads}, "
                       f"{self.head_dim}], got {q.shape}")
    n = jnp.asarray(n).astype(jnp.promote_types(q.dtype, jnp.float32))
    try:
      n = jnp.broadcast_to(n, q.shape[:2])
    except ValueError:
      raise ValueError(f"QASSMax: `n` of shape {n.shape} does not broadcast to [B, T] = "
                       f"{q.shape[:2]}") from None
    log_n = jnp.log(jnp.maximum(n, 1.0))
    return (q * self.base(log_n) * self.gate(q)).astype(q.dtype)

  def attention_hyperparams(self, q: ArrayLike,
                            n_visible: ArrayLike | None) -> dict[str, Any]:
    """None: QASSMax acts on the queries (:meth:`attention_queries`)."""
    del n_visible
    _head_queries(q, self.num_heads, self.head_dim, "QASSMax")
    return {}

  def attention_queries(self, q: ArrayLike, n_visible: ArrayLike) -> jax.Array:
    """``q~`` of ``q [B, N, T, d_h]``, head h rescaled with its own row's count n."""
    q = _head_queries(q, self.num_heads, self.head_dim, "QASSMax")
    shape = _visible(n_visible, q, "QASSMax").shape  # checks n_visible (float32 there)
    dtype = jnp.promote_types(q.dtype, jnp.float32)  # float64 queries: float64 log n
    n = jnp.asarray(n_visible).astype(dtype).reshape(shape)[..., 0]  # [B', N', T']
    log_n = jnp.log(jnp.maximum(n, 1.0))
    if n.shape[1] == 1:  # one count for every head: base(l) is [B', 1, T', N, d_h]
      base = jnp.moveaxis(self.base(log_n[:, 0]), 2, 1)
    else:  # head h takes base(l_h)[h]
      base = jnp.moveaxis(jnp.diagonal(self.base(log_n), axis1=1, axis2=3), -1, 1)
    return (q * base * self.gate(q)).astype(q.dtype)


class TempNet(LearnedNormalizer):
  r"""TempNet: a per-input temperature ``tau(x)`` in ``(tau_min, tau_max)`` (feature N31).

  From Z.-H. Qiu, S. Guo, M. Xu, T. Zhao, L. Zhang, T. Yang, "To Cool or not to Cool?
  Temperature Network Meets Large Foundation Models via DRO" (ICML 2024): a small network
  predicts the temperature that scales the logits, ``softmax(z / tau(x))``.
  [R] Architecture (the paper's is not recorded in the catalogue): ``features -> hidden``
  (GELU) ``-> 1``, then ``tau = tau_min + (tau_max - tau_min) sigmoid(.)``, in range by
  construction (the bounds themselves are reached only where float32's sigmoid saturates). The last layer starts at zero weight with the bias giving ``tau_init``, so
  at init TempNet is the constant temperature ``tau_init``: ``softmax(z / tau_init)``.

  Args:
    in_features: size of the features ``x`` the temperature is predicted from.
    hidden: hidden width.
    tau_min, tau_max: the temperature's open range, ``0 < tau_min < tau_max``.
    tau_init: the initial (constant) temperature, inside the range.
    rngs: ``nnx.Rngs``.

  In attention (``learned=(TempNet(F),)`` with ``normalizer="softmax"``) the temperature
  is predicted from the queries: from all heads of a query (``F = N H``), one temperature
  per query ``[B, 1, T, 1]``; from each head's query (``F = H``), ``[B, N, T, 1]``.

  Examples:
    >>> tn = js.nn.TempNet(4, hidden=8, tau_init=0.5, rngs=nnx.Rngs(0))
    >>> tn.temperature(jnp.ones((2, 4)))                    # constant tau_init at init
    Array([[0.5],
           [0.5]], dtype=float32)
    >>> tn(jnp.ones((1, 4)), jnp.array([[0.0, 1.0]]))       # softmax([0, 1] / 0.5)
    Array([[0.1192, 0.8808]], dtype=float32)

  References:
    Z.-H. Qiu, S. Guo, M. Xu, T. Zhao, L. Zhang & T. Yang, 2024, "To Cool or not to Cool?
    Temperature Network Meets Large Foundation Models via DRO".
  """

  normalizer = "softmax"

  def __init__(self, in_features: int, *, hidden: int = 64, tau_min: float = 0.05,
               tau_max: float = 2.0, tau_init: float = 1.0, rngs: nnx.Rngs):
    positive_int(in_features, "in_features", "TempNet")
    positive_int(hidden, "hidden", "TempNet")
    if not 0 < tau_min < tau_max:
      raise ValueError(f"TempNet: need 0 < `tau_min` < `tau_max`, got {tau_min!r}, {tau_max!r}")
    if not tau_min < tau_init < tau_max:
      raise ValueError(f"TempNet: `tau_init` must lie in ({tau_min}, {tau_max}), got "
                       f"{tau_init!r}")
    self.in_features = in_features
    self.tau_min, self.tau_max = float(tau_min), float(tau_max)
    u = (tau_init - tau_min) / (tau_max - tau_min)
    self.hidden = nnx.Linear(in_features, hidden, rngs=rngs)
    self.out = nnx.Linear(hidden, 1, kernel_init=nnx.initializers.zeros_init(),
                          bias_init=nnx.initializers.constant(math.log(u) - math.log1p(-u)),
                          rngs=rngs)

  def temperature(self, features: ArrayLike) -> jax.Array:
    """``tau(x)``, ``[..., 1]`` for features ``[..., in_features]``."""
    h = self.out(jax.nn.gelu(self.hidden(jnp.asarray(features, jnp.float32))))
    return self.tau_min + (self.tau_max - self.tau_min) * jax.nn.sigmoid(h)

  def __call__(self, features: ArrayLike, logits: ArrayLike,
               where: ArrayLike | None = None) -> jax.Array:
    """``softmax(logits / tau(features))`` over the last axis; ``features [..., F]`` and
    ``logits [..., K]`` share their leading dims."""
    return nz.softmax(logits, -1, where, temperature=self.temperature(features))

  def attention_hyperparams(self, q: ArrayLike,
                            n_visible: ArrayLike | None) -> dict[str, Any]:
    """``{"temperature": tau(q)}``: ``[B, 1, T, 1]`` from the concatenated heads (when
    ``in_features = N H``), else ``[B, N, T, 1]`` from each head (``in_features = H``)."""
    del n_visible
    q = jnp.asarray(q)
    if q.ndim != 4:
      raise ValueError(f"TempNet: `q` must have shape [B, N, T, H], got {q.shape}")
    b, n, t, h = q.shape
    if self.in_features == n * h:
      feats = jnp.transpose(q, (0, 2, 1, 3)).reshape(b, t, n * h)
      return {"temperature": self.temperature(feats)[:, None]}
    if self.in_features == h:
      return {"temperature": self.temperature(q)}
    raise ValueError(f"TempNet: `q` {q.shape} gives neither N H nor H = in_features "
                     f"({self.in_features}) features per query")


class SSA(LearnedNormalizer):
  r"""Selective (SSA) temperature: a learned position scale and query temperature (N07).

  From X. Zhang, X. Chang, M. Li, A. Roy-Chowdhury, J. Chen, S. Oymak, "Selective
  Attention: Enhancing Transformer through Principled Context Control" (NeurIPS 2024):
  the weights are :func:`jaxsoft.normalizers.ssa_softmax`,

  .. math::
    w = \mathrm{softmax}(\tau\, x), \qquad
    \tau = \tau_{tok}(q) + 1 + \sigma(\alpha_h) \log n,

  with a per-head position logit ``alpha_h`` and n the visible keys of the row (the
  query's position under causal masking). [R] The token term is a bounded map of a
  projection of the query, ``tau_tok(q) = tanh(w_h . q + c_h)`` (one vector ``w_h`` and
  bias ``c_h`` per head, ``H + 1`` parameters a head; the paper shares weights with the
  existing projections, its exact form is not recorded), so ``tau > 0`` by construction
  (``tau >= sigma(alpha) log n`` where float32's tanh saturates at -1).
  ``w`` and ``c`` start at 0: at init SSA is ``ssa_softmax(alpha=alpha_init)``; as
  ``alpha -> -inf`` it is softmax.

  **Value temperature** (``value_temperature=True``, the second half of SSA): each value
  is rescaled by a temperature of its own token before the weights average it,

  .. math::
    o_i = \sum_j w_{ij}\, \tau_v(v_j)\, v_j, \qquad
    \tau_v(v_j) = 1 + \tanh(u_k \cdot v_j + d_k) \in (0, 2),

  [R] one vector ``u_k`` and bias ``d_k`` per key/value head k (``H + 1`` parameters a
  head, a projection of the value itself, as the token temperature projects the query;
  the paper names a value temperature ``v_j <- tau_v(x_j) v_j`` of the token and shares
  weights with the existing projections, its exact form is not recorded). ``u`` and
  ``d`` start at 0, so ``tau_v = 1``: at init the outputs are those of SSA without it.
  A token whose ``tau_v`` falls towards 0 is silenced in every query's average (the
  paper's motivation: suppress irrelevant tokens), one whose ``tau_v`` nears 2 is
  amplified; the weights themselves are unchanged. :meth:`attention_values` applies it,
  :meth:`attend` computes the whole SSA attention.

  Args:
    num_heads: N.
    head_dim: H, the size of each head's query (and value).
    alpha_init: the initial position logit (default 0, ``sigma = 1/2``; the normalizer's
      default), a float or one per head ``[N]``.
    value_temperature: learn the value temperature ``tau_v`` (default False).
    num_kv_heads: K, the key/value heads of the values (default N; N % K == 0), used
      with ``value_temperature``.
    rngs: unused (the init is deterministic); accepted for a uniform constructor.

  Examples:
    >>> ssa = js.nn.SSA(2, 4)                    # N = 2 heads of H = 4
    >>> scores = jnp.linspace(-1.0, 1.0, 18).reshape(1, 2, 3, 3)    # [B, N, T, S]
    >>> q = jnp.ones((1, 2, 3, 4))                                   # [B, N, T, H]
    >>> bool(jnp.allclose(ssa(scores, q), js.normalizers.ssa_softmax(scores)))  # at init
    True

    The value temperature: ``1 + tanh(u . v_j + d)`` per token (here d = -1 on both heads):

    >>> ssa = js.nn.SSA(2, 4, value_temperature=True)
    >>> ssa.value_bias[...] = jnp.array([-1.0, -1.0])
    >>> v = jnp.ones((1, 2, 3, 4))                                   # [B, K, S, H]
    >>> print(ssa.value_temperatures(v)[0, 0, :, 0])                 # 1 + tanh(-1)
    [0.2384 0.2384 0.2384]
    >>> o = ssa.attend(scores, q, v)                                 # [B, N, T, H]
    >>> print(o[0, 0, 0])                                            # weights sum to 1
    [0.2384 0.2384 0.2384 0.2384]

  References:
    X. Zhang, X. Chang, M. Li, A. Roy-Chowdhury, J. Chen & S. Oymak, 2024, "Selective
    Attention: Enhancing Transformer through Principled Context Control".
  """

  normalizer = "ssa_softmax"

  def __init__(self, num_heads: int, head_dim: int, *, alpha_init: ArrayLike = 0.0,
               value_temperature: bool = False, num_kv_heads: int | None = None,
               rngs: nnx.Rngs | None = None):
    del rngs
    positive_int(num_heads, "num_heads", "SSA")
    positive_int(head_dim, "head_dim", "SSA")
    if not isinstance(value_temperature, (bool, np.bool_)):
      raise ValueError(f"SSA: `value_temperature` must be a bool, got {value_temperature!r}")
    kv = num_heads if num_kv_heads is None else positive_int(num_kv_heads, "num_kv_heads",
                                                             "SSA")
    if num_heads % kv:
      raise ValueError(f"SSA: `num_heads` ({num_heads}) must be a multiple of `num_kv_heads` "
                       f"({kv})")
    self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, kv
    self.alpha = nnx.Param(_per_head(alpha_init, num_heads, "alpha_init", "SSA"))
    self.token_kernel = nnx.Param(jnp.zeros((num_heads, head_dim), jnp.float32))
    self.token_bias = nnx.Param(jnp.zeros((num_heads,), jnp.float32))
    self.changes_values = bool(value_temperature)
    if self.changes_values:
      self.value_kernel = nnx.Param(jnp.zeros((kv, head_dim), jnp.float32))
      self.value_bias = nnx.Param(jnp.zeros((kv,), jnp.float32))

  def token_temperature(self, q: ArrayLike) -> jax.Array:
    """``tau_tok = tanh(w_h . q + c_h)`` in (-1, 1), ``[B, N, T, 1]`` for ``q [B, N, T, H]``."""
    return jnp.tanh(_query_projection(self, q, "token_kernel", "token_bias", "SSA"))[..., None]

  def attention_hyperparams(self, q: ArrayLike,
                            n_visible: ArrayLike | None) -> dict[str, Any]:
    """``alpha`` per head ``[N, 1, 1]`` and ``token_temperature`` per query
    ``[B, N, T, 1]`` (n enters through the normalizer's own visible count)."""
    del n_visible
    alpha = _learned_value(self.alpha, (self.num_heads,), "alpha", "SSA")
    return {"alpha": alpha.reshape(self.num_heads, 1, 1),
            "token_temperature": self.token_temperature(q)}

  def __call__(self, scores: ArrayLike, q: ArrayLike, where: ArrayLike | None = None) -> jax.Array:
    """``ssa_softmax`` of ``scores [B, N, T, S]`` over the last axis, for queries
    ``q [B, N, T, H]``."""
    return nz.ssa_softmax(scores, -1, where, **self.attention_hyperparams(q, None))

  def _values(self, v: ArrayLike) -> jax.Array:
    v = jnp.asarray(v)
    if not jnp.issubdtype(v.dtype, jnp.floating):
      raise ValueError(f"SSA: `v` must have a floating dtype, got {v.dtype}")
    if not (v.ndim == 4 and v.shape[1] == self.num_kv_heads and v.shape[3] == self.head_dim):
      raise ValueError(f"SSA: `v` must have shape [B, {self.num_kv_heads}, S, "
                       f"{self.head_dim}] (values per key/value head), got {v.shape}")
    return v

  def value_temperatures(self, v: ArrayLike) -> jax.Array:
    """``tau_v = 1 + tanh(u_k . v_j + d_k)`` in (0, 2), ``[B, K, S, 1]`` for values
    ``v [B, K, S, H]`` (float32 at least); ones without ``value_temperature``."""
    v = self._values(v)
    dtype = jnp.promote_types(v.dtype, jnp.float32)
    if not self.changes_values:
      return jnp.ones(v.shape[:3] + (1,), dtype)
    kv = self.num_kv_heads
    u = _learned_value(self.value_kernel, (kv, self.head_dim), "value_kernel", "SSA")
    d = _learned_value(self.value_bias, (kv,), "value_bias", "SSA")
    z = jnp.einsum("bksh,kh->bks", v.astype(dtype), u) + d[None, :, None]
    return (1.0 + jnp.tanh(z))[..., None]

  def attention_values(self, v: ArrayLike) -> jax.Array:
    """``tau_v(v_j) v_j``: the values ``v [B, K, S, H]`` rescaled per token, in ``v``'s
    dtype (``v`` itself without ``value_temperature``)."""
    v = self._values(v)
    if not self.changes_values:
      return v
    return (self.value_temperatures(v) * v).astype(v.dtype)

  def attend(self, scores: ArrayLike, q: ArrayLike, v: ArrayLike,
             where: ArrayLike | None = None) -> jax.Array:
    """The SSA attention output ``o_i = sum_j w_ij tau_v(v_j) v_j``, ``[B, N, T, H]``, for
    ``scores [B, N, T, S]``, queries ``q [B, N, T, H]`` and values ``v [B, K, S, H]``
    (query head n reads key/value head ``n // (N / K)``); ``where`` masks keys as in
    ``__call__`` (a query with no visible key gets 0). bf16/fp16 compute in float32 and
    come back in the promoted dtype of ``scores`` and ``v``."""
    scores = jnp.asarray(scores)
    v = self._values(v)
    if not (scores.ndim == 4 and scores.shape[1] == self.num_heads
            and scores.shape[0] == v.shape[0] and scores.shape[3] == v.shape[2]):
      raise ValueError(f"SSA: `scores` must have shape [B, {self.num_heads}, T, S] with B and "
                       f"S of `v` {v.shape}, got {scores.shape}")
    out_dtype = jnp.promote_types(scores.dtype, v.dtype)
    dtype = jnp.promote_types(out_dtype, jnp.float32)
    w = self(scores.astype(dtype), q, where).astype(dtype)
    vt = self.attention_values(v.astype(dtype))
    b, n, t, s = w.shape
    k = self.num_kv_heads
    o = jnp.einsum("bkgts,bksh->bkgth", w.reshape(b, k, n // k, t, s), vt)
    return o.reshape(b, n, t, self.head_dim).astype(out_dtype)


class AffineScaled(LearnedNormalizer):
  r"""Affine-scaled attention's input-dependent scale and bias (A15, normalizer N27).

  From J. Bae et al., "Affine-Scaled Attention: Towards Flexible and Stable Transformer
  Attention" (2026): the weights are :func:`jaxsoft.normalizers.affine_softmax` with a
  scale and a bias computed from each query token,

  .. math::
    w_{ij} = \alpha(q_i)\,\mathrm{softmax}(x_i)_j + \beta(q_i), \qquad
    \alpha(q) = \mathrm{softplus}(a_h \cdot q + c_h) > 0,

  with, by default, the tied bias :math:`\beta = (1 - \alpha)/n_i` (rows sum to 1,
  interpolating between softmax and uniform), or with ``free_bias=True`` a learned bias
  mass :math:`b(q) = e_h \cdot q + f_h` spread over the row's n visible keys,
  :math:`\beta = b(q)/n_i`, so that rows sum to :math:`\alpha + b` (the relaxed
  normalisation). [R] The abstract says only that an input-dependent scale and a
  corresponding bias are applied to the softmax weights; the softplus scale from a
  per-head projection of the query (``H + 1`` parameters a head) and the bias read as a
  mass per row are this library's reconstruction. The projections start at 0 and the
  scale's bias at ``softplus^{-1}(alpha_init)``: at init ``alpha = alpha_init`` (default
  1) and ``b = 0``, so with the default ``alpha_init`` the module is softmax, tied bias or
  free.

  Args:
    num_heads: N.
    head_dim: H, the size of each head's query.
    alpha_init: the initial scale ``alpha > 0`` (default 1: softmax), a float or one per
      head ``[N]``.
    free_bias: learn the bias mass ``b(q)`` instead of tying ``beta = (1 - alpha) / n``.
    rngs: unused (the init is deterministic); accepted for a uniform constructor.

  Examples:
    >>> aff = js.nn.AffineScaled(2, 4)                # N = 2 heads of H = 4
    >>> scores = jnp.linspace(-1.0, 1.0, 18).reshape(1, 2, 3, 3)    # [B, N, T, S]
    >>> q = jnp.ones((1, 2, 3, 4))                                   # [B, N, T, H]
    >>> bool(jnp.allclose(aff(scores, q), jax.nn.softmax(scores)))  # at init: softmax
    True
    >>> aff.alpha_kernel[...] = jnp.full((2, 4), -0.25)   # alpha = softplus(-1 + 0.5413)
    >>> print(aff.alpha(q)[0, 0, :1, 0], aff(scores, q)[0, 0, 0])    # towards uniform
    [0.4899] [0.3145 0.3326 0.3529]
    >>> layer = js.nn.MultiHeadAttention(2, 8, normalizer="affine_softmax",
    ...                                  learned=(aff,), rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((1, 3, 8))).shape
    (1, 3, 8)

  References:
    J. Bae et al., 2026, "Affine-Scaled Attention: Towards Flexible and Stable Transformer
    Attention" (arXiv 2602.23057).
  """

  normalizer = "affine_softmax"

  def __init__(self, num_heads: int, head_dim: int, *, alpha_init: ArrayLike = 1.0,
               free_bias: bool = False, rngs: nnx.Rngs | None = None):
    del rngs
    owner = "AffineScaled"
    positive_int(num_heads, "num_heads", owner)
    positive_int(head_dim, "head_dim", owner)
    if not isinstance(free_bias, (bool, np.bool_)):
      raise ValueError(f"{owner}: `free_bias` must be a bool, got {free_bias!r}")
    alpha0 = _per_head(alpha_init, num_heads, "alpha_init", owner)
    if not bool(jnp.all(alpha0 > 0.0)):
      raise ValueError(f"{owner}: `alpha_init` must be > 0, got {alpha_init!r}")
    self.num_heads, self.head_dim = num_heads, head_dim
    self.free_bias = bool(free_bias)
    self.alpha_kernel = nnx.Param(jnp.zeros((num_heads, head_dim), jnp.float32))
    self.alpha_bias = nnx.Param(softplus_from_range(alpha0).astype(jnp.float32))
    if self.free_bias:
      self.bias_kernel = nnx.Param(jnp.zeros((num_heads, head_dim), jnp.float32))
      self.bias_bias = nnx.Param(jnp.zeros((num_heads,), jnp.float32))

  def alpha(self, q: ArrayLike) -> jax.Array:
    """``alpha(q) = softplus(a_h . q + c_h) > 0``, ``[B, N, T, 1]`` for ``q [B, N, T, H]``."""
    z = _query_projection(self, q, "alpha_kernel", "alpha_bias", "AffineScaled")
    return jax.nn.softplus(z)[..., None]

  def bias_mass(self, q: ArrayLike) -> jax.Array:
    """``b(q) = e_h . q + f_h``, ``[B, N, T, 1]`` (``free_bias`` only)."""
    if not self.free_bias:
      raise ValueError("AffineScaled: `bias_mass` needs `free_bias=True` (the tied bias is "
                       "(1 - alpha) / n)")
    return _query_projection(self, q, "bias_kernel", "bias_bias", "AffineScaled")[..., None]

  def attention_hyperparams(self, q: ArrayLike,
                            n_visible: ArrayLike | None) -> dict[str, Any]:
    """``alpha`` per query ``[B, N, T, 1]``; with ``free_bias`` also ``beta = b(q) / n``
    (``n_visible`` the keys each query sees, needed then; 0 where n = 0)."""
    out = {"alpha": self.alpha(q)}
    if self.free_bias:
      if n_visible is None:
        raise ValueError("AffineScaled: `n_visible` is needed with `free_bias=True`")
      q = _head_queries(q, self.num_heads, self.head_dim, "AffineScaled")
      n = _visible(n_visible, q, "AffineScaled")
      out["beta"] = self.bias_mass(q) / jnp.maximum(n, 1.0)
    return out

  def __call__(self, scores: ArrayLike, q: ArrayLike, where: ArrayLike | None = None) -> jax.Array:
    """``affine_softmax`` of ``scores [B, N, T, S]`` over the last axis, for queries
    ``q [B, N, T, H]`` (n counted from ``where``)."""
    scores = jnp.asarray(scores)
    if where is None:
      n: Any = float(scores.shape[-1])
    else:
      n = jnp.sum(jnp.broadcast_to(jnp.asarray(where, bool), scores.shape), axis=-1,
                  keepdims=True)
    return nz.affine_softmax(scores, -1, where, **self.attention_hyperparams(q, n))


class ASEntmax(LearnedNormalizer):
  r"""ASEntmax's length-adaptive scale with a learned ``beta(q)`` and ``gamma`` (N18).

  From P. Vasylenko, M. Treviso, A. F. T. Martins et al., "Long-Context Generalization
  with Sparse Attention" (2025): the weights are :func:`jaxsoft.normalizers.asentmax`,

  .. math::
    w = \alpha\text{-entmax}\big((\delta + \beta(q)\,(\log n)^{\gamma_h})\, x\big),
    \qquad \beta(q) = \mathrm{softplus}(w_h . q + c_h),

  per query ``beta >= 0`` from a projection of the query and a per-head
  ``gamma_h = 1e-3 + softplus(g_h) > 0``; ``alpha`` and ``delta`` are fixed. ``w`` starts
  at 0 and ``c`` at ``softplus^{-1}(beta_init)``: at init ASEntmax is
  ``asentmax(alpha, delta, beta=beta_init, gamma=gamma_init)``. ``beta = 0`` (e.g.
  ``c = -1e3``, where float32's softplus is exactly 0) with ``delta = 1`` is alpha-entmax.

  Args:
    num_heads: N.
    head_dim: H.
    alpha: entmax's ``alpha > 1`` (default 1.5), fixed.
    delta: ``delta >= 0`` (default 1), fixed.
    beta_init: ``beta > 0`` at init (default 0.5, the normalizer's default).
    gamma_init: ``gamma > 1e-3`` at init (default 1), a float or one per head ``[N]``.
    rngs: unused (the init is deterministic); accepted for a uniform constructor.

  Examples:
    At init the hyperparameters are asentmax's defaults (``beta = 0.5``, ``gamma = 1``):

    >>> ase = js.nn.ASEntmax(2, 4)                  # N = 2 heads of H = 4
    >>> q = jnp.ones((1, 2, 3, 4))                  # [B, N, T, H]
    >>> hp = ase.attention_hyperparams(q, None)
    >>> hp["alpha"], hp["beta"].shape               # beta per query [B, N, T, 1]
    (1.5, (1, 2, 3, 1))
    >>> hp["beta"][0, :, 0, 0], hp["gamma"].ravel()
    (Array([0.5, 0.5], dtype=float32), Array([1., 1.], dtype=float32))

  References:
    P. Vasylenko, M. Treviso, A. F. T. Martins et al., 2025, "Long-Context Generalization with
    Sparse Attention".
  """

  normalizer = "asentmax"

  def __init__(self, num_heads: int, head_dim: int, *, alpha: float = 1.5, delta: float = 1.0,
               beta_init: float = 0.5, gamma_init: ArrayLike = 1.0,
               rngs: nnx.Rngs | None = None):
    del rngs
    owner = "ASEntmax"
    positive_int(num_heads, "num_heads", owner)
    positive_int(head_dim, "head_dim", owner)
    if not finite_float(alpha, "alpha", owner) > 1.0:
      raise ValueError(f"{owner}: `alpha` must be > 1, got {alpha!r}")
    if not finite_float(delta, "delta", owner) >= 0.0:
      raise ValueError(f"{owner}: `delta` must be >= 0, got {delta!r}")
    if not finite_float(beta_init, "beta_init", owner) > 0.0:
      raise ValueError(f"{owner}: `beta_init` must be > 0, got {beta_init!r}")
    gamma0 = _per_head(gamma_init, num_heads, "gamma_init", owner)
    if not bool(jnp.all(gamma0 > _GAMMA_MARGIN)):
      raise ValueError(f"{owner}: `gamma_init` must be > {_GAMMA_MARGIN}, got {gamma_init!r}")
    self.num_heads, self.head_dim = num_heads, head_dim
    self.alpha, self.delta = float(alpha), float(delta)
    self.beta_kernel = nnx.Param(jnp.zeros((num_heads, head_dim), jnp.float32))
    self.beta_bias = nnx.Param(jnp.full((num_heads,), softplus_from_range(
        beta_init), jnp.float32))
    self.gamma = nnx.Param(softplus_from_range(gamma0, 0.0, _GAMMA_MARGIN))

  def beta(self, q: ArrayLike) -> jax.Array:
    """``beta(q) = softplus(w_h . q + c_h) >= 0``, ``[B, N, T, 1]`` for ``q [B, N, T, H]``."""
    z = _query_projection(self, q, "beta_kernel", "beta_bias", "ASEntmax")
    return jax.nn.softplus(z)[..., None]

  def gamma_values(self) -> jax.Array:
    """``gamma_h = 1e-3 + softplus(g_h)``, ``[N]``."""
    g = _learned_value(self.gamma, (self.num_heads,), "gamma", "ASEntmax")
    return softplus_to_range(g, 0.0, _GAMMA_MARGIN)

  def attention_hyperparams(self, q: ArrayLike,
                            n_visible: ArrayLike | None) -> dict[str, Any]:
    """``alpha``, ``delta`` (fixed), ``beta`` per query ``[B, N, T, 1]``, ``gamma`` per head
    ``[N, 1, 1]`` (n enters through the normalizer's own visible count)."""
    del n_visible
    return {"alpha": self.alpha, "delta": self.delta, "beta": self.beta(q),
            "gamma": self.gamma_values().reshape(self.num_heads, 1, 1)}

  def __call__(self, scores: ArrayLike, q: ArrayLike, where: ArrayLike | None = None) -> jax.Array:
    """``asentmax`` of ``scores [B, N, T, S]`` over the last axis, for queries
    ``q [B, N, T, H]``."""
    return nz.asentmax(scores, -1, where, **self.attention_hyperparams(q, None))


class PolarSink(_PerHeadNormalizer):
  r"""Polar attention's learned length temperature and null logit, per head (N12).

  From ATMA (Kreasof AI, kreasof-ai/atma): the weights are
  :func:`jaxsoft.normalizers.polar_softmax`,

  .. math::
    w = \mathrm{softmax}\big(t \cdot [x, \nu]\big)_{1..n}, \quad
    t = 1 + \mathrm{softplus}(\alpha_h) \log n, \quad
    \nu = b_h + \mathrm{softplus}(\gamma_h) \sqrt{\log(n + 1)},

  with per-head learnable ``alpha``, null bias ``b`` and ``gamma`` (all free: the
  softplus keeps ``t >= 1`` and the null logit's growth positive). At init the values are
  the normalizer's defaults (0) unless given; ``b -> -inf`` removes the null entry and
  ``alpha -> -inf`` the length temperature, leaving softmax.

  Args:
    num_heads: N.
    alpha_init, null_bias_init, gamma_init: initial values, a float or one per head ``[N]``.
    rngs: unused (the init is deterministic); accepted for a uniform constructor.

  Examples:
    >>> sink = js.nn.PolarSink(2)                # alpha, null bias, gamma: 0 per head
    >>> scores = jax.random.normal(jax.random.key(0), (1, 2, 3, 3))   # [B, N, T, S]
    >>> w = sink(scores)
    >>> bool(jnp.allclose(w, js.normalizers.polar_softmax(scores)))    # at init
    True
    >>> bool(jnp.all(w.sum(-1) <= 1.0))                  # the null entry takes the rest
    True

  References:
    Kreasof AI, ATMA (kreasof-ai/atma): polar attention's length temperature and null
    logit.
  """

  normalizer = "polar_softmax"

  def __init__(self, num_heads: int, *, alpha_init: ArrayLike = 0.0,
               null_bias_init: ArrayLike = 0.0, gamma_init: ArrayLike = 0.0,
               rngs: nnx.Rngs | None = None):
    del rngs
    positive_int(num_heads, "num_heads", "PolarSink")
    self.num_heads = num_heads
    self.alpha = nnx.Param(_per_head(alpha_init, num_heads, "alpha_init", "PolarSink"))
    self.null_bias = nnx.Param(_per_head(null_bias_init, num_heads, "null_bias_init",
                                         "PolarSink"))
    self.gamma = nnx.Param(_per_head(gamma_init, num_heads, "gamma_init", "PolarSink"))

  def hyperparameters(self) -> dict[str, jax.Array]:
    """``{"alpha", "null_bias", "gamma"}``, each ``[N, 1, 1]``."""
    return {name: _learned_value(getattr(self, name), (self.num_heads,), name,
                                 "PolarSink").reshape(self.num_heads, 1, 1)
            for name in ("alpha", "null_bias", "gamma")}

  def __call__(self, scores: ArrayLike, where: ArrayLike | None = None) -> jax.Array:
    """``polar_softmax`` of ``scores [..., N, T, S]`` over the last axis, per head (n
    enters through the normalizer's own count)."""
    return self._apply_per_head(nz.polar_softmax, scores, where)


class MoEGate(LearnedNormalizer):
  r"""The activation dense-to-sparse MoE gate with learned ``W``, ``b`` and ``tau`` (N32).

  From H. Nguyen, P. Akbarian, N. Ho, "Is Temperature Sample Efficient for Softmax
  Gaussian Mixture of Experts?" (ICML 2024):

  .. math::
    G(h) = \mathrm{softmax}\big(\sigma(W h + b) / \tau\big), \qquad \sigma = \text{sigmoid}

  (:func:`jaxsoft.normalizers.moe_gate` of the router logits), or, with
  ``activation=False``, the plain dense-to-sparse gate ``softmax((W h + b) / tau)`` (the
  baseline, whose ``(W, b, tau)`` the paper shows to be tied by a PDE). ``tau = 1e-3 + softplus(z) > 0`` by construction, ``tau_init`` at init;
  ``W`` is LeCun-normal, ``b`` zero.

  In attention (``learned=(MoEGate(...),)`` with ``normalizer="moe_gate"``, or
  ``"softmax"`` when ``activation=False``) the scores ``q . k_j / sqrt(d)`` play the
  router logits (the keys are the experts) and only ``tau`` is used.

  Args:
    in_features: size of the inputs ``h``.
    num_experts: E, the gate's width.
    tau_init: the initial temperature, ``> 1e-3`` (default 1).
    activation: the activation gate (default) or the plain gate.
    rngs: ``nnx.Rngs`` for the init of ``W``.

  Examples:
    >>> gate = js.nn.MoEGate(4, 3, rngs=nnx.Rngs(0))       # 4 features, 3 experts
    >>> w = gate(jnp.ones((2, 4)))
    >>> w.shape, w.sum(-1)
    ((2, 3), Array([1., 1.], dtype=float32))
    >>> gate.temperature()
    Array(1., dtype=float32)

  References:
    H. Nguyen, P. Akbarian & N. Ho, 2024, "Is Temperature Sample Efficient for Softmax
    Gaussian Mixture of Experts?".
  """

  def __init__(self, in_features: int, num_experts: int, *, tau_init: float = 1.0,
               activation: bool = True, rngs: nnx.Rngs):
    positive_int(in_features, "in_features", "MoEGate")
    positive_int(num_experts, "num_experts", "MoEGate")
    if not finite_float(tau_init, "tau_init", "MoEGate") > _TAU_MARGIN:
      raise ValueError(f"MoEGate: `tau_init` must be > {_TAU_MARGIN}, got {tau_init!r}")
    if not isinstance(activation, bool):
      raise ValueError(f"MoEGate: `activation` must be a bool, got {activation!r}")
    self.in_features, self.num_experts = in_features, num_experts
    self.activation = activation
    self.normalizer = "moe_gate" if activation else "softmax"
    self.router = nnx.Linear(in_features, num_experts, rngs=rngs)
    self.tau_free = nnx.Param(softplus_from_range(float(tau_init), 0.0, _TAU_MARGIN))

  def temperature(self) -> jax.Array:
    """``tau = 1e-3 + softplus(z)``, a scalar."""
    return softplus_to_range(_learned_value(self.tau_free, (), "tau_free", "MoEGate"),
                                      0.0, _TAU_MARGIN)

  def logits(self, inputs: ArrayLike) -> jax.Array:
    """``W h + b``, ``[..., E]`` for ``h [..., in_features]``."""
    h = jnp.asarray(inputs)
    if h.ndim < 1 or h.shape[-1] != self.in_features:
      raise ValueError(f"MoEGate: `inputs` must have shape [..., {self.in_features}], got "
                       f"{h.shape}")
    return self.router(h)

  def attention_hyperparams(self, q: ArrayLike,
                            n_visible: ArrayLike | None) -> dict[str, Any]:
    """``{"tau": tau}`` (``{"temperature": tau}`` for the plain gate), a scalar."""
    del q, n_visible
    return {"tau" if self.activation else "temperature": self.temperature()}

  def __call__(self, inputs: ArrayLike, where: ArrayLike | None = None) -> jax.Array:
    """The gate weights ``[..., E]`` of inputs ``[..., in_features]`` (``where`` masks
    experts)."""
    z = self.logits(inputs)
    if self.activation:
      return nz.moe_gate(z, -1, where, tau=self.temperature())
    return nz.softmax(z, -1, where, temperature=self.temperature())


class DirichletCalibration(nnx.Module):
  r"""Dirichlet calibration ``softmax(W ln p + b)`` with learned W, b (feature N30).

  From M. Kull, M. Perello-Nieto, M. Kängsepp, T. Silva Filho, H. Song, P. Flach, "Beyond
  temperature scaling: Obtaining well-calibrated multiclass probabilities with Dirichlet
  calibration" (NeurIPS 2019); the map is
  :func:`jaxsoft.normalizers.dirichlet_calibration`. Starts at ``W = I``, ``b = 0`` (the
  identity); ``W = I/T`` is temperature scaling. Fit by log-loss plus :meth:`penalty`
  (ODIR).

  Args:
    num_classes: K.
    rngs: unused (the init is deterministic); accepted for a uniform constructor.

  Examples:
    >>> cal = js.nn.DirichletCalibration(3)
    >>> cal(jnp.log(jnp.array([0.2, 0.3, 0.5])))            # W = I, b = 0: the identity
    Array([0.2, 0.3, 0.5], dtype=float32)
    >>> cal.penalty()
    Array(0., dtype=float32)

  References:
    M. Kull, M. Perello-Nieto, M. Kängsepp, T. Silva Filho, H. Song & P. Flach, 2019,
    "Beyond temperature scaling: Obtaining well-calibrated multiclass probabilities with
    Dirichlet calibration".
  """

  def __init__(self, num_classes: int, *, rngs: nnx.Rngs | None = None):
    del rngs
    positive_int(num_classes, "num_classes", "DirichletCalibration")
    self.weights = nnx.Param(jnp.eye(num_classes, dtype=jnp.float32))
    self.bias = nnx.Param(jnp.zeros((num_classes,), jnp.float32))

  def __call__(self, log_probs: ArrayLike) -> jax.Array:
    return nz.dirichlet_calibration(log_probs, self.weights[...], self.bias[...])

  def penalty(self, lambda_od: float = 1.0, lambda_b: float = 1.0) -> jax.Array:
    """The ODIR regulariser of the current W, b."""
    return nz.odir_penalty(self.weights[...], self.bias[...], lambda_od=lambda_od,
                                     lambda_b=lambda_b)


# --------------------------------------------------------------- MultiHeadAttention's use


def check_attention_modules(modules: Sequence[Any], spec: Any, num_heads: int,
                            owner: str = "MultiHeadAttention", *,
                            applies_values: bool = False) -> None:
  """Raises ValueError naming ``learned`` unless every module fits the layer: it has the
  attention protocol, belongs to the layer's normalizer ``spec`` and has its head count;
  a module that changes the values (``changes_values``) needs a layer that
  ``applies_values`` (:func:`apply_attention_values`)."""
  for mod in modules:
    if getattr(mod, "changes_values", False) and not applies_values:
      raise ValueError(
          f"{owner}: `learned` module {type(mod).__name__} changes the values (a value "
          f"temperature), which this layer does not apply; compute the attention with its "
          f"`attend`, or leave `value_temperature` off")
    if not (hasattr(mod, "attention_hyperparams") and isinstance(
        getattr(mod, "normalizer", None), str)):
      raise ValueError(
          f"{owner}: `learned` takes parameter names or learned-normalizer modules (with "
          f"`normalizer` and `attention_hyperparams`), got {mod!r}")
    kind = type(mod).__name__
    if not isinstance(spec, nz.NormalizerSpec):
      raise ValueError(f"{owner}: `learned` module {kind} needs a registered normalizer, got "
                       f"{spec!r}")
    if mod.normalizer != spec.name:
      raise ValueError(
          f"{owner}: `learned` module {kind} belongs to normalizer {mod.normalizer!r}, but "
          f"the layer's normalizer is {spec.name!r}")
    heads = getattr(mod, "num_heads", None)
    if heads is not None and heads != num_heads:
      raise ValueError(f"{owner}: `learned` module {kind} has num_heads={heads}, the layer "
                       f"{num_heads}")


def visible_key_counts(q_len: int, kv_len: int, mask: ArrayLike | None = None, *,
                       is_causal: bool = False, local_window_size=None,
                       query_seq_lengths: ArrayLike | None = None,
                       key_value_seq_lengths: ArrayLike | None = None,
                       segment_ids=None, batch: int = 1) -> jax.Array:
  """n: the number of keys each query sees, float32 broadcastable to ``[B, N, T, 1]``.

  From the mask structure (``dot_product_attention``'s semantics; no T x S array unless a
  dense ``mask`` ``[B or 1, N or 1, T, S]`` is given, which is counted with it).
  """
  st = _masks.MaskStructure(
      q_len, kv_len, is_causal=bool(is_causal),
      window=_masks.normalize_window(local_window_size),
      q_lengths=None if query_seq_lengths is None else jnp.asarray(query_seq_lengths,
                                                                   jnp.int32),
      kv_lengths=None if key_value_seq_lengths is None else jnp.asarray(
          key_value_seq_lengths, jnp.int32))
  seg = _masks.normalize_segment_ids(segment_ids, batch, q_len, kv_len)
  if seg is not None:
    st.q_segment_ids, st.kv_segment_ids = seg
  if mask is None:
    return st.visible_counts()[:, None, :, None]
  vis = jnp.logical_and(jnp.asarray(mask, bool), st.dense())
  return jnp.sum(vis, axis=-1, keepdims=True).astype(jnp.float32)


def apply_attention_modules(modules: Sequence[Any], q: jax.Array, params: Mapping[str, Any],
                            n_visible: ArrayLike,
                            owner: str = "MultiHeadAttention") -> tuple[jax.Array, dict]:
  """The layer's queries ``q [B, T, N, H]`` and normalizer hyperparameters after its
  learned modules: each module may rescale the queries (``attention_queries``) and adds
  its hyperparameters (computed from the layer's own queries); a name set twice raises
  ValueError naming it."""
  out = dict(params)
  q_in = jnp.swapaxes(q, 1, 2)  # [B, N, T, H], the modules' layout
  qh = q_in
  for mod in modules:
    qh = mod.attention_queries(qh, n_visible)
    for name, value in mod.attention_hyperparams(q_in, n_visible).items():
      if name in out:
        raise ValueError(f"{owner}: the normalizer's `{name}` is set twice (by "
                         f"{type(mod).__name__} and by `learned` or `normalizer_params`)")
      out[name] = value
  return jnp.swapaxes(qh, 1, 2).astype(q.dtype), out


def apply_attention_values(modules: Sequence[Any], v: jax.Array) -> jax.Array:
  """The layer's values ``v [B, S, K, H]`` after its learned modules' ``attention_values``
  (the SSA value temperature), in ``v``'s dtype."""
  if not any(getattr(mod, "changes_values", False) for mod in modules):
    return v
  vh = jnp.swapaxes(v, 1, 2)  # [B, K, S, H], the modules' layout
  for mod in modules:
    vh = mod.attention_values(vh)
  return jnp.swapaxes(vh, 1, 2).astype(v.dtype)
