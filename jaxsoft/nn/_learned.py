"""Learned-parameter normalizers as Flax NNX modules.

Each module owns the parameters of one normalizer and returns its hyperparameters (per head,
per query or per input), or applies the normalizer with them. Every parameter is kept in
its valid range by construction (temperatures through a sigmoid between two bounds), and
each module starts at a documented baseline:

* :class:`MultiMax` (N11): ``t = 0`` is softmax (``init_std=0`` starts there);
* :class:`QASSMax` (N06): at init (zero last layers) it is SSMax with ``s = 1``;
* :class:`TempNet` (N31): at init the temperature is the constant ``tau_init``;
* :class:`DirichletCalibration` (N30): at init ``W = I``, ``b = 0``, the identity map.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from jaxsoft import normalizers as nz
from jaxsoft.normalizers import _calibration

__all__ = ["MultiMax", "QASSMax", "TempNet", "DirichletCalibration"]

_MULTIMAX_NAMES = ("t1", "t2", "t3", "t4", "b1", "b2", "b3", "b4")


def _positive_int(value, name: str, owner: str) -> int:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{owner}: `{name}` must be a positive int, got {value!r}")
  return value


class MultiMax(nnx.Module):
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
  """

  def __init__(self, num_heads: int, *, init_std: float = 0.02, rngs: nnx.Rngs):
    _positive_int(num_heads, "num_heads", "MultiMax")
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
    s = jnp.asarray(scores)
    if s.ndim < 3 or s.shape[-3] != self.num_heads:
      raise ValueError(f"MultiMax: `scores` must have shape [..., {self.num_heads}, T, S], got "
                       f"{s.shape}")
    return nz.multimax(s, -1, where, **self.hyperparameters())


class QASSMax(nnx.Module):
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

  Args:
    num_heads: N.
    head_dim: d_h.
    hidden: the MLPs' hidden width (64 in TabICLv2).
    rngs: ``nnx.Rngs``.
  """

  def __init__(self, num_heads: int, head_dim: int, *, hidden: int = 64, rngs: nnx.Rngs):
    for name, v in (("num_heads", num_heads), ("head_dim", head_dim), ("hidden", hidden)):
      _positive_int(v, name, "QASSMax")
    self.num_heads, self.head_dim = num_heads, head_dim
    zeros = nnx.initializers.zeros_init()
    self.base_in = nnx.Linear(1, hidden, rngs=rngs)
    self.base_out = nnx.Linear(hidden, num_heads * head_dim, kernel_init=zeros, rngs=rngs)
    self.gate_in = nnx.Linear(head_dim, hidden, rngs=rngs)
    self.gate_out = nnx.Linear(hidden, head_dim, kernel_init=zeros, rngs=rngs)

  def base(self, log_n: ArrayLike) -> jax.Array:
    """``base(l) = l (1 + tanh(MLP_base(l)))``, ``[..., N, d_h]`` for ``l`` of shape ``[...]``."""
    ell = jnp.asarray(log_n, jnp.float32)[..., None]
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
    n = jnp.asarray(n, jnp.float32)
    try:
      n = jnp.broadcast_to(n, q.shape[:2])
    except ValueError:
      raise ValueError(f"QASSMax: `n` of shape {n.shape} does not broadcast to [B, T] = "
                       f"{q.shape[:2]}") from None
    log_n = jnp.log(jnp.maximum(n, 1.0))
    return (q * self.base(log_n) * self.gate(q)).astype(q.dtype)


class TempNet(nnx.Module):
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
  """

  def __init__(self, in_features: int, *, hidden: int = 64, tau_min: float = 0.05,
               tau_max: float = 2.0, tau_init: float = 1.0, rngs: nnx.Rngs):
    _positive_int(in_features, "in_features", "TempNet")
    _positive_int(hidden, "hidden", "TempNet")
    if not 0 < tau_min < tau_max:
      raise ValueError(f"TempNet: need 0 < `tau_min` < `tau_max`, got {tau_min!r}, {tau_max!r}")
    if not tau_min < tau_init < tau_max:
      raise ValueError(f"TempNet: `tau_init` must lie in ({tau_min}, {tau_max}), got "
                       f"{tau_init!r}")
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
  """

  def __init__(self, num_classes: int, *, rngs: nnx.Rngs | None = None):
    del rngs
    _positive_int(num_classes, "num_classes", "DirichletCalibration")
    self.weights = nnx.Param(jnp.eye(num_classes, dtype=jnp.float32))
    self.bias = nnx.Param(jnp.zeros((num_classes,), jnp.float32))

  def __call__(self, log_probs: ArrayLike) -> jax.Array:
    return _calibration.dirichlet_calibration(log_probs, self.weights[...], self.bias[...])

  def penalty(self, lambda_od: float = 1.0, lambda_b: float = 1.0) -> jax.Array:
    """The ODIR regulariser of the current W, b."""
    return _calibration.odir_penalty(self.weights[...], self.bias[...], lambda_od=lambda_od,
                                     lambda_b=lambda_b)
