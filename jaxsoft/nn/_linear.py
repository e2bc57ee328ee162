r"""Flax NNX layers for the linear-attention family, wired as their papers wire them.

Every layer maps ``x [B, T, d]`` to ``[B, T, d]``:

.. math::
  [q; k; v]_t = \mathrm{SiLU}\bigl(\mathrm{conv}_w([W_q; W_k; W_v]\, x)\bigr)_t, \qquad
  \mathrm{conv}_w(u)_t = \sum_{i=0}^{c-1} w_i \odot u_{t-c+1+i}

(a short causal depthwise convolution of width ``c = conv_size``, zero before the start),
the kind's recurrence ``o = mix(q, k, v, gates)`` from :mod:`jaxsoft.linear`, then per head
:math:`\mathrm{RMSNorm}(o_t) \odot \mathrm{SiLU}(W_r x_t)` and the output projection
:math:`W_o`. The gates:

* :class:`GatedDeltaNet`: the decay :math:`\log\alpha_t = -e^{A}\,\mathrm{softplus}(W_a x_t +
  b_{dt})` (Mamba-2's parametrisation) and the write strength :math:`\beta_t = \sigma(W_\beta
  x_t)`, keys and queries L2-normalised (S. Yang, J. Kautz & A. Hatamizadeh, 2025, "Gated
  Delta Networks: Improving Mamba2 with Delta Rule").
* :class:`DeltaNet`: :math:`\beta_t` alone (S. Yang, B. Wang, Y. Zhang, Y. Shen & Y. Kim,
  2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length").
* :class:`GLA`: the per-channel decay :math:`\log\alpha_t = \log\sigma(W^2 W^1 x_t + b)/16`
  through a rank-16 bottleneck (S. Yang, B. Wang, Y. Shen, R. Panda & Y. Kim, 2024, "Gated
  Linear Attention Transformers with Hardware-Efficient Training"); :class:`SimpleGLA` has one
  such gate per head.
* :class:`LightningAttention`: a fixed decay per head that depends on the layer's depth
  (Qin et al. 2024, "Lightning Attention-2" / TransNormerLLM).
* :class:`LinearAttention`: no gate; ``feature_map`` is a name of
  :data:`jaxsoft.linear.FEATURE_MAPS`, ``"favor"`` (Performer's random features, drawn from
  ``jax.random.key(feature_seed)``; Choromanski et al., 2021, "Rethinking Attention with
  Performers"), a callable, or a :class:`HedgehogFeatureMap` whose parameters the layer then
  owns (Katharopoulos et al. 2020, "Transformers are RNNs").
* ``LinearMixer(kind="cosformer")`` (``M = max_len``) and ``kind="mala"``.
* ``kind="ttt_linear"``: TTT-Linear's inner learning rate per token and head,
  :math:`\eta_t = \eta_{base}\,\sigma(W_\eta x_t)` with :math:`\eta_{base} = 1`, mini-batches of
  ``mini_batch_size`` (Sun et al. 2024, "Learning to (Learn at Test Time): RNNs with Expressive
  Hidden States").
* ``kind="ccq"`` and ``kind="softmax_linear_attention"``: SimpleGLA's decay gate as the backbone;
  CCQ contracts the queries with strength ``strength``; the softmax-over-heads read and write
  gates are :math:`W_{g} x_t` and :math:`W_{g'} x_t` per head.
* ``kind="native_hybrid"``: ``num_slots`` slots per head with forget gates
  :math:`\log\sigma(W_s x_t + b)/16` and a sliding window of ``window`` tokens under one softmax.
* ``kind="interdomain"``: ``num_slots`` basis functions per head with coefficients
  :math:`W_b x_t`, read-outs :math:`W_\psi x_t` and learned decays :math:`-e^{A_r}` (a
  reconstruction, as :func:`jaxsoft.linear.interdomain_attention`).
* ``kind="mhla"``: MHLA's block summaries mixed by a learned ``C [N, M_max, M_max]`` per head,
  ``M_max = ⌈max_len / block_size⌉`` blocks, sliced to the ``M = ⌈T / block_size⌉`` blocks of
  the input and started at ones (lower-triangular ones when causal), i.e. as vanilla linear
  attention with ``feature_map`` ("MHLA: Multi-Head Linear Attention", 2026; a
  reconstruction, as :func:`jaxsoft.linear.mhla`). Causal by default; ``causal=False`` is the
  paper's bidirectional form (no decoding).
* ``kind="rala"``: rank-augmented linear attention (Fan, Huang & He 2025, "Breaking the
  Low-Rank Dilemma of Linear Attention"; a reconstruction, as :func:`jaxsoft.linear.rala`):
  key weights :math:`α_j = T\,\mathrm{softmax}_j(\bar q \cdot k_j / \sqrt K)` over the whole
  sequence and the paper's linear output gate: :math:`\mathrm{RMSNorm}(o_t) \odot W_r x_t`
  (no SiLU). The mean query makes it bidirectional: it needs ``causal=False`` (its default)
  and cannot decode. The short convolution stays causal in every kind.

Decoding: :meth:`LinearMixer.init_state` gives the zero state (the convolution's last
``c - 1`` inputs, the recurrent state of the kind's ``*_step`` function, the position) and
:meth:`LinearMixer.step` advances it by one token at O(1) cost in the length (for ``"mhla"``
the state holds the ``M_max`` block summaries, :func:`jaxsoft.linear.mhla_step`: O(M_max)).

:class:`HedgehogFeatureMap` owns the parameters of :func:`jaxsoft.linear.hedgehog_feature_map`
and its attention-distillation loss (Zhang, Bhatia, Kumbong & Ré 2024, "The Hedgehog & the
Porcupine: Expressive Linear Attentions with Softmax Mimicry").
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from jaxsoft import linear as js_linear

__all__ = ["LinearMixer", "GatedDeltaNet", "DeltaNet", "GLA", "SimpleGLA",
           "LightningAttention", "LinearAttention", "HedgehogFeatureMap", "causal_conv",
           "causal_conv_step", "rms_norm", "LINEAR_MIXER_KINDS", "GLA_GATE_RANK",
           "GLA_GATE_NORMALIZER"]

LINEAR_MIXER_KINDS = ("gated_delta_rule", "delta_rule", "simple_gla", "gla",
                      "lightning_attention", "linear", "cosformer", "mala", "ttt_linear", "ccq",
                      "softmax_linear_attention", "native_hybrid", "interdomain", "mhla",
                      "rala")
_BIDIRECTIONAL = ("rala",)  # kinds with no causal form (they read the whole sequence)
_EITHER = ("mhla",)  # kinds with a causal and a bidirectional form
GLA_GATE_RANK = 16  # GLA's low-rank gate bottleneck
GLA_GATE_NORMALIZER = 16.0  # GLA divides log sigmoid by 16 (slow decay at initialisation)
TTT_ETA_BASE = 1.0  # TTT-Linear's base inner learning rate


def causal_conv(u: jax.Array, w: jax.Array) -> jax.Array:
  """Causal depthwise convolution ``y_t = sum_i w_i * u_{t-c+1+i}`` of ``u [B, T, C]`` with
  ``w [c, C]`` (zero before the first position)."""
  c, t = w.shape[0], u.shape[1]
  padded = jnp.pad(u, ((0, 0), (c - 1, 0), (0, 0)))
  out = w[0] * padded[:, :t]
  for i in range(1, c):
    out = out + w[i] * padded[:, i:i + t]
  return out


def causal_conv_step(u: jax.Array, w: jax.Array, window: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
  """One position of :func:`causal_conv`: ``u [B, C]`` and the previous ``c - 1`` inputs
  ``window [B, c - 1, C]`` -> (``y [B, C]``, the next window)."""
  full = jnp.concatenate([window, u[:, None].astype(window.dtype)], axis=1)  # [B, c, C]
  y = jnp.sum(w[None] * full, axis=1)
  return y, full[:, 1:]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
  """RMSNorm over the last axis, ``x / sqrt(mean(x^2) + eps) * scale``, computed in float32
  and returned in ``x``'s dtype."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (normed * scale).astype(x.dtype)


def _inverse_softplus(y: jax.Array) -> jax.Array:
  return y + jnp.log(-jnp.expm1(-y))


def _positive_int(owner: str, name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise ValueError(f"{owner}: `{name}` must be a positive int, got {value!r}")
  return int(value)


# -------------------------------------------------------------------------------- Hedgehog


class HedgehogFeatureMap(nnx.Module):
  r"""Hedgehog's learned feature map as a module: per head
  :math:`φ(x) = [\operatorname{softmax}(xW + b), \operatorname{softmax}(-xW - b)]`
  (Zhang, Bhatia, Kumbong & Ré 2024, "The Hedgehog & the Porcupine"), ``W [N, K, F]``
  starting at the identity, ``b [N, F]`` at zero (plus ``noise · N(0, 1)`` when ``noise > 0``).

  Call it on ``[..., N, K]`` to get ``[..., N, 2F]``; pass it as ``feature_map=`` to
  :func:`jaxsoft.linear.linear_attention` or to :class:`LinearAttention`. Train it with
  :meth:`distillation_loss` (the cross-entropy of causal softmax attention against the
  linear-attention map it induces).
  """

  def __init__(self, num_heads: int, head_dim: int, feature_dim: int | None = None, *,
               noise: float = 0.0, rngs: nnx.Rngs | None = None):
    name = "HedgehogFeatureMap"
    num_heads = _positive_int(name, "num_heads", num_heads)
    head_dim = _positive_int(name, "head_dim", head_dim)
    if feature_dim is not None:
      feature_dim = _positive_int(name, "feature_dim", feature_dim)
    if not noise >= 0:
      raise ValueError(f"{name}: `noise` must be >= 0, got {noise!r}")
    if noise > 0 and rngs is None:
      raise ValueError(f"{name}: `rngs` is required when `noise` > 0")
    key = rngs.params() if noise > 0 and rngs is not None else None
    p = js_linear.hedgehog_init(num_heads, head_dim, feature_dim, key=key, noise=noise)
    self.num_heads, self.head_dim = num_heads, head_dim
    self.W = nnx.Param(p["W"])
    self.b = nnx.Param(p["b"])

  def params(self) -> dict[str, ArrayLike]:
    """``{"W", "b"}`` as plain arrays (the input of the ``jaxsoft.linear.hedgehog_*`` functions)."""
    return {"W": self.W[...], "b": self.b[...]}

  def __call__(self, x: jax.Array) -> jax.Array:
    return js_linear.hedgehog_feature_map(self.params())(x)

  def attention_weights(self, q: ArrayLike, k: ArrayLike) -> jax.Array:
    """The causal linear-attention map ``[B, N, T, T]`` of ``q, k [B, T, N, K]``."""
    return js_linear.hedgehog_attention_weights(self.params(), q, k)

  def distillation_loss(self, q: ArrayLike, k: ArrayLike, *,
                        scale: float | None = None) -> jax.Array:
    """:func:`jaxsoft.linear.hedgehog_distillation_loss` with this module's parameters."""
    return js_linear.hedgehog_distillation_loss(self.params(), q, k, scale=scale)


# ----------------------------------------------------------------------------- the layers


class LinearMixer(nnx.Module):
  """A linear-attention layer of ``kind`` (one of :data:`LINEAR_MIXER_KINDS`) with the
  projections, short convolution, gates, per-head RMSNorm and SiLU output gate of the
  module docstring.

  Args:
    kind: the recurrence.
    d_model: the width of ``x``.
    num_heads, head_dim: ``N`` and ``K = V`` (``head_dim`` default ``d_model // num_heads``).
    conv_size: the width ``c >= 1`` of the causal depthwise convolution (4 in the papers).
    feature_map: for ``kind="linear"`` (and ``"mala"``, ``"mhla"``, ``"rala"``): a name of
      ``jaxsoft.linear.FEATURE_MAPS``, ``"favor"`` (``"linear"`` only), a callable or a
      HedgehogFeatureMap.
    normalize: for ``kind="linear"``: divide by ``φ(q)·Σφ(k)`` (False: the numerator alone).
    favor_features, feature_seed: the number of random features and the key of ``"favor"``.
    layer_idx, num_layers: the depth that sets Lightning Attention's decays.
    max_len: cosFormer's ``M``; for ``"mhla"`` the longest sequence, decoded or not
      (``M_max`` blocks).
    block_size: MHLA's tokens per block ``b``.
    causal: None (the kind's own: False for ``"rala"``, True otherwise); False is allowed for
      ``"mhla"`` and ``"rala"`` only (a bidirectional layer: no ``step``), True not for
      ``"rala"``.
    mini_batch_size: TTT-Linear's inner mini-batch.
    strength: CCQ's contraction strength.
    num_slots: the slots of ``"native_hybrid"`` and the basis functions of ``"interdomain"``.
    window: the sliding window of ``"native_hybrid"`` (the token itself included).
    implementation, chunk_size: passed to the full-sequence function (None: its default).
    dtype: the computation dtype (parameters stay float32).
    rngs: the parameters' random streams.
  """

  def __init__(self, kind: str, d_model: int, num_heads: int, head_dim: int | None = None, *,
               conv_size: int = 4, feature_map: Any = "elu1", normalize: bool = True,
               favor_features: int = 64, feature_seed: int = 0, layer_idx: int = 0,
               num_layers: int = 1, max_len: float = 2048.0, implementation: str | None = None,
               chunk_size: int = 64, mini_batch_size: int = 16, strength: float = 1.0,
               num_slots: int = 8, window: int = 64, block_size: int = 64,
               causal: bool | None = None, dtype: Any = jnp.float32, rngs: nnx.Rngs):
    name = type(self).__name__
    if kind not in LINEAR_MIXER_KINDS:
      raise ValueError(f"{name}: `kind` must be one of {LINEAR_MIXER_KINDS}, got {kind!r}")
    d = _positive_int(name, "d_model", d_model)
    n = _positive_int(name, "num_heads", num_heads)
    if head_dim is None:
      if d % n:
        raise ValueError(f"{name}: `num_heads` ({n}) must divide `d_model` ({d}) when "
                         "`head_dim` is not given")
      head_dim = d // n
    h = _positive_int(name, "head_dim", head_dim)
    c = _positive_int(name, "conv_size", conv_size)
    if implementation is not None and implementation not in js_linear.IMPLEMENTATIONS:
      raise ValueError(f"{name}: `implementation` must be None or one of "
                       f"{js_linear.IMPLEMENTATIONS}, got {implementation!r}")
    if kind in ("linear", "mala", "mhla", "rala") and not (
        callable(feature_map) or feature_map == "favor" and kind == "linear"
        or isinstance(feature_map, str) and feature_map in js_linear.FEATURE_MAPS):
      raise ValueError(f"{name}: `feature_map` must be one of "
                       f"{sorted(js_linear.FEATURE_MAPS)}, 'favor' or a callable, got "
                       f"{feature_map!r}")
    if kind == "ttt_linear" and implementation not in (None, "recurrent", "chunked"):
      raise ValueError(f"{name}: `implementation` of kind 'ttt_linear' must be None, "
                       f"'recurrent' or 'chunked', got {implementation!r}")
    if kind == "mhla" and implementation not in (None, "parallel", "chunked"):
      raise ValueError(f"{name}: `implementation` of kind 'mhla' must be None, 'parallel' or "
                       f"'chunked' (no recurrent form), got {implementation!r}")
    if kind == "rala" and implementation is not None:
      raise ValueError(f"{name}: `implementation` of kind 'rala' must be None (it has one "
                       f"form), got {implementation!r}")
    if causal is None:
      causal = kind not in _BIDIRECTIONAL
    if not isinstance(causal, bool):
      raise ValueError(f"{name}: `causal` must be None or a bool, got {causal!r}")
    if causal and kind in _BIDIRECTIONAL:
      raise ValueError(f"{name}: kind {kind!r} is bidirectional (its key weights use the mean "
                       "of all the queries), it has no causal form: `causal` must be False or "
                       "None")
    if not causal and kind not in _BIDIRECTIONAL + _EITHER:
      raise ValueError(f"{name}: `causal` = False needs a kind with a bidirectional form "
                       f"{_BIDIRECTIONAL + _EITHER}, got kind {kind!r}")
    if not (isinstance(strength, numbers.Real) and strength >= 0):
      raise ValueError(f"{name}: `strength` must be a number >= 0, got {strength!r}")
    if not (isinstance(max_len, numbers.Real) and max_len > 0):
      raise ValueError(f"{name}: `max_len` must be a positive number, got {max_len!r}")
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"{name}: `dtype` must be a floating dtype, got {dtype}")
    linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype,
                               param_dtype=jnp.float32, rngs=rngs)
    self.kind: str = kind
    self.layer_idx: int = int(layer_idx)
    self.num_layers: int = int(num_layers)
    self.num_heads: int = n
    self.head_dim: int = h
    self.d_model: int = d
    self.dtype: Any = dtype
    self.max_len: float = float(max_len)
    self.normalize: bool = bool(normalize)
    self.implementation: str | None = implementation
    self.chunk_size: int = int(chunk_size)
    self.feature_map: Any = feature_map
    self.favor_features: int = _positive_int(name, "favor_features", favor_features)
    self.feature_seed: int = int(feature_seed)
    self.mini_batch_size: int = _positive_int(name, "mini_batch_size", mini_batch_size)
    self.strength: float = float(strength)
    self.num_slots: int = _positive_int(name, "num_slots", num_slots)
    self.window: int = _positive_int(name, "window", window)
    self.block_size: int = _positive_int(name, "block_size", block_size)
    self.causal: bool = causal
    m = self.num_slots
    self.qkv: nnx.Linear = linear(d, 3 * n * h)
    self.o: nnx.Linear = linear(n * h, d)
    self.gate: nnx.Linear = linear(d, n * h)  # the output gate SiLU(W_r x)
    self.o_norm: nnx.Param = nnx.Param(jnp.ones((h,), jnp.float32))
    bound = 1.0 / math.sqrt(c)  # PyTorch's Conv1d default for a depthwise filter
    self.conv: nnx.Param = nnx.Param(jax.random.uniform(rngs.params(), (c, 3 * n * h), jnp.float32,
                                             -bound, bound))
    gated = kind == "gated_delta_rule"
    self.a: nnx.Linear | None = linear(d, n) if gated else None  # Gated DeltaNet's decay rate
    if gated:
      self.A_log: nnx.Param = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (n,), jnp.float32,
                                                        1.0, 16.0)))
      dt = jnp.exp(jax.random.uniform(rngs.params(), (n,), jnp.float32,
                                      math.log(1e-3), math.log(1e-1)))
      self.dt_bias: nnx.Param = nnx.Param(_inverse_softplus(dt))
    self.beta: nnx.Linear | None = linear(d, n) if kind in ("gated_delta_rule", "delta_rule") else None
    biased = functools.partial(nnx.Linear, use_bias=True, dtype=dtype, param_dtype=jnp.float32,
                               rngs=rngs)
    decayed = kind in ("simple_gla", "ccq", "softmax_linear_attention")
    self.gk: nnx.Linear | None = (biased(d, n) if decayed else
               linear(d, GLA_GATE_RANK) if kind == "gla" else None)
    self.gk2: nnx.Linear | None = biased(GLA_GATE_RANK, n * h) if kind == "gla" else None
    self.eta: nnx.Linear | None = linear(d, n) if kind == "ttt_linear" else None
    self.head_gate: nnx.Linear | None = (linear(d, 2 * n) if kind == "softmax_linear_attention"
                                         else None)
    self.slots: nnx.Linear | None = biased(d, n * m) if kind == "native_hybrid" else None
    self.basis: nnx.Linear | None = linear(d, 2 * n * m) if kind == "interdomain" else None
    if kind == "mhla":  # C starts as vanilla linear attention (causal: the blocks <= i)
      blocks = math.ceil(self.max_len / self.block_size)
      ones = jnp.ones((blocks, blocks), jnp.float32)
      self.mixing: nnx.Param = nnx.Param(jnp.broadcast_to(
          jnp.tril(ones) if causal else ones, (n, blocks, blocks)))
    if kind == "interdomain":  # decay rates e^A in [0.01, 0.5], spread like Mamba's
      self.basis_log_rate: nnx.Param = nnx.Param(jnp.log(jax.random.uniform(
          rngs.params(), (n, m), jnp.float32, 0.01, 0.5)))

  # -- the pieces shared by the full and the one-step forms.

  def _heads(self, x: jax.Array) -> jax.Array:
    return x.reshape(*x.shape[:-1], self.num_heads, self.head_dim)

  def _check_x(self, x: Any, ndim: int, layout: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim != ndim or x.shape[-1] != self.d_model or not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{type(self).__name__}: `x` must be a floating array {layout} with "
                       f"d = {self.d_model}, got {x.dtype}{list(x.shape)}")
    return x.astype(self.dtype)

  def _gates(self, x: jax.Array) -> dict[str, jax.Array]:
    """The data-dependent gates of ``x [..., d]`` (float32): ``g`` and/or ``beta``."""
    out: dict[str, jax.Array] = {}
    if self.a is not None:
      rate = jax.nn.softplus(self.a(x).astype(jnp.float32) + self.dt_bias[...])
      out["g"] = -jnp.exp(self.A_log[...]) * rate
    if self.beta is not None:
      out["beta"] = jax.nn.sigmoid(self.beta(x).astype(jnp.float32))
    if self.kind in ("simple_gla", "ccq", "softmax_linear_attention"):
      assert self.gk is not None
      out["g"] = jax.nn.log_sigmoid(self.gk(x).astype(jnp.float32)) / GLA_GATE_NORMALIZER
    if self.eta is not None:
      out["eta"] = TTT_ETA_BASE * jax.nn.sigmoid(self.eta(x).astype(jnp.float32))
    if self.head_gate is not None:
      out["q_gate"], out["k_gate"] = jnp.split(self.head_gate(x).astype(jnp.float32), 2, -1)
    if self.slots is not None:
      a = jax.nn.log_sigmoid(self.slots(x).astype(jnp.float32)) / GLA_GATE_NORMALIZER
      out["slots"] = a.reshape(*a.shape[:-1], self.num_heads, self.num_slots)
    if self.basis is not None:
      b = self.basis(x).astype(jnp.float32)
      b = b.reshape(*b.shape[:-1], 2, self.num_heads, self.num_slots)
      out["basis_in"], out["basis_out"] = b[..., 0, :, :], b[..., 1, :, :]
      out["log_decay"] = -jnp.exp(self.basis_log_rate[...])
    if self.kind == "gla":
      assert self.gk is not None and self.gk2 is not None
      g = jax.nn.log_sigmoid(self.gk2(self.gk(x)).astype(jnp.float32)) / GLA_GATE_NORMALIZER
      out["g"] = self._heads(g)
    return out

  def _feature_map(self) -> Any:
    if isinstance(self.feature_map, str) and self.feature_map == "favor":
      return js_linear.favor_feature_map(jax.random.key(self.feature_seed), self.head_dim,
                                         self.favor_features)
    return self.feature_map

  def _finish(self, o: jax.Array, x: jax.Array) -> jax.Array:
    """Per-head RMSNorm, the SiLU output gate (RALA's: linear), the output projection."""
    o = rms_norm(o, self.o_norm[...]).astype(self.dtype)
    gate = self.gate(x)
    o = o.reshape(*o.shape[:-2], -1) * (gate if self.kind == "rala" else jax.nn.silu(gate))
    return self.o(o)

  def _mixing(self, t: int) -> jax.Array:
    """MHLA's ``C`` sliced to the ``⌈t / b⌉`` blocks of ``t`` tokens."""
    blocks = math.ceil(t / self.block_size)
    if blocks > self.mixing.shape[-1]:
      raise ValueError(f"{type(self).__name__}: `x` has T = {t} tokens, more than the "
                       f"{self.mixing.shape[-1]} blocks of {self.block_size} that `max_len` = "
                       f"{self.max_len:g} gives kind 'mhla'")
    return self.mixing[...][:, :blocks, :blocks]

  def _check_causal(self) -> None:
    if not self.causal:
      raise ValueError(f"{type(self).__name__}: kind {self.kind!r} with causal=False is "
                       "bidirectional (every output reads the whole sequence): it cannot "
                       "decode token by token")

  def __call__(self, x: jax.Array) -> jax.Array:
    """``x [B, T, d]`` -> ``[B, T, d]`` (the whole sequence, causally unless ``causal=False``)."""
    x = self._check_x(x, 3, "[B, T, d]")
    u = jax.nn.silu(causal_conv(self.qkv(x), self.conv[...].astype(self.dtype)))
    q, k, v = (self._heads(part) for part in jnp.split(u, 3, axis=-1))
    gates, kind = self._gates(x), self.kind
    impl: dict[str, Any] = dict(implementation=self.implementation, chunk_size=self.chunk_size)
    if kind == "gated_delta_rule":
      o = js_linear.gated_delta_rule(q, k, v, gates["g"], gates["beta"], qk_l2norm=True, **impl)
    elif kind == "delta_rule":
      o = js_linear.delta_rule(q, k, v, gates["beta"], qk_l2norm=True, **impl)
    elif kind == "simple_gla":
      o = js_linear.simple_gla(q, k, v, gates["g"], **impl)
    elif kind == "gla":
      o = js_linear.gla(q, k, v, gates["g"], **impl)
    elif kind == "lightning_attention":
      o = js_linear.lightning_attention(q, k, v, layer_idx=self.layer_idx,
                                        num_layers=self.num_layers, **impl)
    elif kind == "linear":
      o = js_linear.linear_attention(q, k, v, feature_map=self._feature_map(),
                                     normalize=self.normalize, **impl)
    elif kind == "cosformer":
      o = js_linear.cosformer(q, k, v, max_len=self.max_len, **impl)
    elif kind == "mala":
      o = js_linear.mala(q, k, v, feature_map=self._feature_map(), **impl)
    elif kind == "ttt_linear":
      o = js_linear.ttt_linear(q, k, v, gates["eta"], mini_batch_size=self.mini_batch_size,
                               implementation=self.implementation)
    elif kind == "ccq":
      o = js_linear.ccq(q, k, v, gates["g"], strength=self.strength, **impl)
    elif kind == "softmax_linear_attention":
      o = js_linear.softmax_linear_attention(q, k, v, gates["q_gate"], gates["k_gate"],
                                             g=gates["g"], **impl)
    elif kind == "native_hybrid":
      o = js_linear.native_hybrid_attention(q, k, v, gates["slots"], window=self.window, **impl)
    elif kind == "mhla":
      o = js_linear.mhla(q, k, v, self._mixing(x.shape[1]), block_size=self.block_size,
                         feature_map=self._feature_map(), causal=self.causal,
                         implementation=self.implementation)
    elif kind == "rala":
      o = js_linear.rala(q, k, v, feature_map=self._feature_map())
    else:  # interdomain
      o = js_linear.interdomain_attention(q, k, v, gates["basis_in"], gates["basis_out"],
                                          gates["log_decay"], **impl)
    return self._finish(o, x)

  def _step_fn(self, q, k, v, gates, position, state):
    kind = self.kind
    if kind == "gated_delta_rule":
      return js_linear.gated_delta_rule_step(q, k, v, gates["g"], gates["beta"], state,
                                             qk_l2norm=True)
    if kind == "delta_rule":
      return js_linear.delta_rule_step(q, k, v, gates["beta"], state, qk_l2norm=True)
    if kind == "simple_gla":
      return js_linear.simple_gla_step(q, k, v, gates["g"], state)
    if kind == "gla":
      return js_linear.gla_step(q, k, v, gates["g"], state)
    if kind == "lightning_attention":
      return js_linear.lightning_attention_step(q, k, v, state, layer_idx=self.layer_idx,
                                                num_layers=self.num_layers)
    if kind == "linear":
      return js_linear.linear_attention_step(q, k, v, state, feature_map=self._feature_map(),
                                             normalize=self.normalize)
    if kind == "cosformer":
      return js_linear.cosformer_step(q, k, v, state, position=position, max_len=self.max_len)
    if kind == "mala":
      return js_linear.mala_step(q, k, v, state, feature_map=self._feature_map())
    if kind == "ttt_linear":
      return js_linear.ttt_linear_step(q, k, v, gates["eta"], state,
                                       mini_batch_size=self.mini_batch_size)
    if kind == "ccq":
      return js_linear.ccq_step(q, k, v, gates["g"], None, state, strength=self.strength)
    if kind == "softmax_linear_attention":
      return js_linear.softmax_linear_attention_step(q, k, v, gates["q_gate"], gates["k_gate"],
                                                     state, g=gates["g"])
    if kind == "mhla":
      return js_linear.mhla_step(q, k, v, self.mixing[...], state, position=position,
                                 block_size=self.block_size, feature_map=self._feature_map())
    if kind == "native_hybrid":
      return js_linear.native_hybrid_attention_step(q, k, v, gates["slots"], state,
                                                    window=self.window)
    return js_linear.interdomain_attention_step(q, k, v, gates["basis_in"], gates["basis_out"],
                                                gates["log_decay"], state)

  def init_state(self, batch: int) -> dict[str, Any]:
    """The decoding state of ``batch`` sequences before their first token: the zero
    convolution window ``conv [B, c - 1, 3NK]``, the zero recurrent state ``state`` (shaped
    by the kind's ``*_step`` function) and ``position = 0``. A bidirectional layer
    (``causal=False``: ``"rala"``) raises ValueError."""
    self._check_causal()
    batch = _positive_int(type(self).__name__, "batch", batch)
    width = self.conv.shape[0] - 1
    window = jnp.zeros((batch, width, self.conv.shape[1]), self.dtype)
    one = jnp.zeros((batch, self.num_heads, self.head_dim), self.dtype)
    x = jnp.zeros((batch, self.d_model), self.dtype)
    _, state = jax.eval_shape(lambda: self._step_fn(one, one, one, self._gates(x), 0, None))
    return {"conv": window, "state": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), state),
            "position": jnp.zeros((), jnp.int32)}

  def decode(self, x: jax.Array, position: Any, conv: jax.Array, state: Any
             ) -> tuple[jax.Array, jax.Array, Any]:
    """One token ``x [B, d]`` at ``position`` from the window ``conv`` and recurrent
    ``state`` -> (``y [B, d]``, the next window, the next state)."""
    self._check_causal()
    x = self._check_x(x, 2, "[B, d]")
    y, window = causal_conv_step(self.qkv(x), self.conv[...].astype(self.dtype), conv)
    u = jax.nn.silu(y.astype(self.dtype))
    q, k, v = (self._heads(part) for part in jnp.split(u, 3, axis=-1))
    o, state = self._step_fn(q, k, v, self._gates(x), position, state)
    return self._finish(o, x), window, state

  def step(self, x: jax.Array, state: dict[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
    """One decoding step: ``x [B, d]`` (the next token of each sequence) and the state of
    :meth:`init_state` -> (``y [B, d]``, the advanced state). Feeding a sequence through
    ``step`` one token at a time gives ``self(x)`` position by position."""
    if not (isinstance(state, dict) and {"conv", "state", "position"} <= set(state)):
      raise ValueError(f"{type(self).__name__}: `state` must be the dict of init_state, got "
                       f"{type(state).__name__}")
    y, window, rec = self.decode(x, state["position"], state["conv"], state["state"])
    return y, {"conv": window, "state": rec, "position": state["position"] + 1}


class GatedDeltaNet(LinearMixer):
  """Gated DeltaNet (Yang, Kautz & Hatamizadeh 2025): :class:`LinearMixer` of kind
  ``"gated_delta_rule"``."""

  def __init__(self, d_model: int, num_heads: int, head_dim: int | None = None, **kwargs: Any):
    super().__init__("gated_delta_rule", d_model, num_heads, head_dim, **kwargs)


class DeltaNet(LinearMixer):
  """DeltaNet (Schlag et al. 2021; Yang et al. 2024): :class:`LinearMixer` of kind
  ``"delta_rule"``."""

  def __init__(self, d_model: int, num_heads: int, head_dim: int | None = None, **kwargs: Any):
    super().__init__("delta_rule", d_model, num_heads, head_dim, **kwargs)


class GLA(LinearMixer):
  """Gated Linear Attention (Yang et al. 2024), a decay per key channel: :class:`LinearMixer`
  of kind ``"gla"``."""

  def __init__(self, d_model: int, num_heads: int, head_dim: int | None = None, **kwargs: Any):
    super().__init__("gla", d_model, num_heads, head_dim, **kwargs)


class SimpleGLA(LinearMixer):
  """GLA with one data-dependent decay per head: :class:`LinearMixer` of kind
  ``"simple_gla"``."""

  def __init__(self, d_model: int, num_heads: int, head_dim: int | None = None, **kwargs: Any):
    super().__init__("simple_gla", d_model, num_heads, head_dim, **kwargs)


class LightningAttention(LinearMixer):
  """Lightning Attention's fixed per-head decays of depth ``layer_idx / num_layers``:
  :class:`LinearMixer` of kind ``"lightning_attention"``."""

  def __init__(self, d_model: int, num_heads: int, head_dim: int | None = None, **kwargs: Any):
    super().__init__("lightning_attention", d_model, num_heads, head_dim, **kwargs)


class LinearAttention(LinearMixer):
  """Linear attention with ``feature_map`` (Katharopoulos et al. 2020): :class:`LinearMixer`
  of kind ``"linear"``. A :class:`HedgehogFeatureMap` passed as ``feature_map`` becomes a
  submodule, trained with the layer."""

  def __init__(self, d_model: int, num_heads: int, head_dim: int | None = None, *,
               feature_map: str | Callable[[jax.Array], jax.Array] = "elu1", **kwargs: Any):
    super().__init__("linear", d_model, num_heads, head_dim, feature_map=feature_map, **kwargs)
