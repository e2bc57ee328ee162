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
* ``kind="transnormer"``: TransNormerLLM's LRPE-d attention (learned angles ``lrpe_theta
  [N, K]`` started at :func:`jaxsoft.linear.lrpe_theta`, the depth's Lightning decay) and its
  linear gate :math:`U = W_u x` (Qin et al. 2023, "TransNormerLLM"; the output norm is the
  mixers' per-head RMSNorm with a scale, where the paper's SRMSNorm spans the width without
  one).

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
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from jaxsoft import linear as js_linear
from jaxsoft._validation import head_layout, positive_int
from jaxsoft.nn._linear_kinds import (
  GLA_GATE_NORMALIZER,
  GLA_GATE_RANK,
  LINEAR_MIXER_TABLE,
  TTT_ETA_BASE,
  LinearKind,
)
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["LinearMixer", "GatedDeltaNet", "DeltaNet", "GLA", "SimpleGLA",
           "LightningAttention", "LinearAttention", "HedgehogFeatureMap", "causal_conv",
           "causal_conv_step", "rms_norm", "LINEAR_MIXER_KINDS", "LINEAR_MIXER_TABLE",
           "LinearKind", "GLA_GATE_RANK", "GLA_GATE_NORMALIZER", "TTT_ETA_BASE"]

LINEAR_MIXER_KINDS = tuple(LINEAR_MIXER_TABLE)
# The kinds that take causal=False (a bidirectional form).
_NON_CAUSAL = tuple(name for name, row in LINEAR_MIXER_TABLE.items() if row.direction != "causal")


def causal_conv(u: jax.Array, w: jax.Array) -> jax.Array:
  r"""Causal depthwise convolution, the short convolution of the linear-attention layers.

  .. math::
    y_t = \sum_{i=0}^{c-1} w_i \odot u_{t-c+1+i}

  with ``u`` zero before the first position.

  Args:
    u: the input ``[B, T, C]``.
    w: the filter ``[c, C]``, one of width ``c`` per channel.

  Returns:
    ``y [B, T, C]``.

  Examples:
    >>> from jaxsoft.nn import causal_conv
    >>> causal_conv(jnp.arange(1.0, 5.0).reshape(1, 4, 1), jnp.array([[1.0], [10.0]]))[..., 0]
    Array([[10., 21., 32., 43.]], dtype=float32)

  References:
    S. Yang, B. Wang, Y. Shen, R. Panda & Y. Kim, 2024, "Gated Linear Attention Transformers
    with Hardware-Efficient Training" (the short convolution of its layers).
  """
  c, t = w.shape[0], u.shape[1]
  padded = jnp.pad(u, ((0, 0), (c - 1, 0), (0, 0)))
  out = w[None, 0:1] * padded[:, :t]                                  # [1, 1, C] * [B, t, C]
  for i in range(1, c):
    out = out + w[None, i:i + 1] * padded[:, i:i + t]
  return out


def causal_conv_step(u: jax.Array, w: jax.Array, window: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
  r"""One position of :func:`causal_conv`, for decoding token by token.

  .. math::
    y = \sum_{i=0}^{c-2} w_i \odot \mathrm{window}_i + w_{c-1} \odot u

  Args:
    u: this position's input ``[B, C]``.
    w: the filter ``[c, C]``.
    window: the previous ``c - 1`` inputs ``[B, c - 1, C]`` (zeros before the start).

  Returns:
    ``(y [B, C], the next window)``.

  Examples:
    >>> from jaxsoft.nn import causal_conv_step
    >>> w, window = jnp.array([[1.0], [10.0]]), jnp.zeros((1, 1, 1))
    >>> for u in (1.0, 2.0, 3.0):
    ...   y, window = causal_conv_step(jnp.full((1, 1), u), w, window)
    ...   print(y[0, 0])
    10.0
    21.0
    32.0

  References:
    S. Yang, B. Wang, Y. Shen, R. Panda & Y. Kim, 2024, "Gated Linear Attention Transformers
    with Hardware-Efficient Training" (the short convolution of its layers).
  """
  full = jnp.concatenate([window, u[:, None].astype(window.dtype)], axis=1)  # [B, c, C]
  y = jnp.sum(w[None] * full, axis=1)
  return y, full[:, 1:]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
  """RMSNorm over the last axis, ``x / sqrt(mean(x^2) + eps) * scale``, computed in float32
  (float64 for float64 input) and returned in ``x``'s dtype; ``scale`` broadcasts against
  the trailing axes (``[D]``, or ``[heads, D]`` for a per-head norm)."""
  scale = jnp.asarray(scale)
  cdt = compute_dtype(jnp.result_type(x.dtype, scale.dtype))
  xc = x.astype(cdt)
  normed = xc * jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
  scale = scale.astype(cdt).reshape((1,) * (normed.ndim - scale.ndim) + scale.shape)  # explicit
  return (normed * scale).astype(x.dtype)


def _one_of(choices: list[str]) -> str:
  return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"


# -------------------------------------------------------------------------------- Hedgehog


class HedgehogFeatureMap(nnx.Module):
  r"""Hedgehog's learned feature map, a module that owns its parameters.

  Per head,

  .. math::
    φ(x) = [\operatorname{softmax}(xW + b), \operatorname{softmax}(-xW - b)]

  with ``W [N, K, F]`` starting at the identity and ``b [N, F]`` at zero (plus
  ``noise · N(0, 1)`` when ``noise > 0``). Call it on ``[..., N, K]`` to get ``[..., N, 2F]``;
  pass it as ``feature_map=`` to :func:`jaxsoft.linear.linear_attention` or to
  :class:`LinearAttention` (which then trains it with the layer). Train it alone with
  :meth:`distillation_loss` (the cross-entropy of causal softmax attention against the
  linear-attention map it induces).

  Args:
    num_heads: ``N``.
    head_dim: ``K``.
    feature_dim: ``F`` (default ``K``).
    noise: the standard deviation of the noise added to the starting ``W`` and ``b``.
    rngs: the random stream of the noise (needed when ``noise > 0``).

  Returns:
    Called on ``x [..., N, K]``: the features ``[..., N, 2F]``.

  Examples:
    >>> phi = js.nn.HedgehogFeatureMap(num_heads=2, head_dim=4, feature_dim=3)
    >>> jax.eval_shape(phi, jnp.ones((1, 5, 2, 4))).shape  # the shape of phi(x)
    (1, 5, 2, 6)
    >>> phi.W.shape, phi.b.shape
    ((2, 4, 3), (2, 3))

  References:
    M. Zhang, K. Bhatia, H. Kumbong & C. Ré, 2024, "The Hedgehog & the Porcupine: Expressive
    Linear Attentions with Softmax Mimicry".
  """

  def __init__(self, num_heads: int, head_dim: int, feature_dim: int | None = None, *,
               noise: float = 0.0, rngs: nnx.Rngs | None = None):
    name = "HedgehogFeatureMap"
    num_heads = positive_int(num_heads, "num_heads", name)
    head_dim = positive_int(head_dim, "head_dim", name)
    if feature_dim is not None:
      feature_dim = positive_int(feature_dim, "feature_dim", name)
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
  r"""A linear-attention layer of any kind of :data:`LINEAR_MIXER_KINDS`, wired as its paper.

  .. math::
    [q; k; v]_t = \mathrm{SiLU}\bigl(\mathrm{conv}_w([W_q; W_k; W_v]\, x)\bigr)_t, \qquad
    y_t = W_o\bigl(\mathrm{RMSNorm}(o_t) \odot \mathrm{SiLU}(W_r x_t)\bigr)

  with ``o = mix(q, k, v, gates)`` the kind's recurrence of :mod:`jaxsoft.linear` and its
  gates computed from ``x`` (the module docstring lists them; RALA's output gate is linear).
  The kind's row of ``LINEAR_MIXER_TABLE`` (a :class:`LinearKind`) says which function and
  decoding step it calls, which gates and other parameters it adds, which implementations and
  feature maps it takes and whether it is causal. :meth:`init_state` and :meth:`step` decode
  one token at a time, equal to the full forward position by position.

  Args:
    kind: the recurrence, a key of ``LINEAR_MIXER_TABLE``.
    d_model: the width ``d`` of ``x``.
    num_heads: ``N``.
    head_dim: ``K = V`` (default ``d_model // num_heads``).
    conv_size: the width ``c >= 1`` of the causal depthwise convolution (4 in the papers).
    feature_map: for the kinds with a feature map (``"linear"``, ``"mala"``, ``"mhla"``,
      ``"rala"``): a name of ``jaxsoft.linear.FEATURE_MAPS``, ``"favor"`` (``"linear"``
      only), a callable or a :class:`HedgehogFeatureMap` (whose parameters the layer then
      owns).
    normalize: for ``kind="linear"``: divide by ``φ(q)·Σφ(k)`` (False: the numerator alone).
    favor_features: the number of random features of ``"favor"``.
    feature_seed: the key of ``"favor"``'s random features.
    layer_idx: the depth that sets Lightning Attention's decays, with ``num_layers``.
    num_layers: the depth of the stack.
    max_len: cosFormer's ``M``; for ``"mhla"`` the longest sequence, decoded or not
      (``M_max = ⌈max_len / block_size⌉`` blocks).
    implementation: passed to the full-sequence function (None: its default); the kind's row
      says which it takes.
    chunk_size: the chunk of the chunked form.
    mini_batch_size: TTT-Linear's inner mini-batch.
    strength: CCQ's contraction strength.
    num_slots: the slots of ``"native_hybrid"`` and the basis functions of ``"interdomain"``.
    window: the sliding window of ``"native_hybrid"`` (the token itself included).
    block_size: MHLA's tokens per block ``b``.
    causal: None (the kind's own: False for ``"rala"``, True otherwise); False is allowed
      for the kinds with a bidirectional form (``"mhla"``, ``"rala"``: no ``step``), True
      not for ``"rala"``.
    dtype: the computation dtype (parameters stay float32).
    rngs: the parameters' random streams.

  Returns:
    Called on ``x [B, T, d]``: ``y [B, T, d]``, causal unless ``causal=False``.

  Examples:
    >>> layer = js.nn.LinearMixer("simple_gla", d_model=8, num_heads=2, conv_size=4,
    ...                     rngs=nnx.Rngs(0))
    >>> x = jnp.ones((1, 4, 8))
    >>> jax.eval_shape(layer, x).shape  # the shape of layer(x)
    (1, 4, 8)
    >>> state = layer.init_state(batch=1)  # the last c - 1 inputs of the conv, S [B, N, K, V]
    >>> state["conv"].shape, state["state"].shape
    ((1, 3, 24), (1, 2, 4, 4))

  References:
    S. Yang, J. Kautz & A. Hatamizadeh, 2025, "Gated Delta Networks: Improving Mamba2 with
    Delta Rule".

    S. Yang, B. Wang, Y. Shen, R. Panda & Y. Kim, 2024, "Gated Linear Attention Transformers
    with Hardware-Efficient Training".

    A. Katharopoulos, A. Vyas, N. Pappas & F. Fleuret, 2020, "Transformers are RNNs: Fast
    Autoregressive Transformers with Linear Attention".

    Z. Qin et al., 2022, "cosFormer: Rethinking Softmax in Attention".

    Y. Sun et al., 2024, "Learning to (Learn at Test Time): RNNs with Expressive Hidden
    States".
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
    row = LINEAR_MIXER_TABLE[kind]
    d, n, h = head_layout(d_model, num_heads, head_dim, name)
    c = positive_int(conv_size, "conv_size", name)
    if implementation is not None and implementation not in js_linear.IMPLEMENTATIONS:
      raise ValueError(f"{name}: `implementation` must be None or one of "
                       f"{js_linear.IMPLEMENTATIONS}, got {implementation!r}")
    if row.feature_maps and not (
        callable(feature_map) or isinstance(feature_map, str) and feature_map in row.feature_maps):
      raise ValueError(f"{name}: `feature_map` must be one of "
                       f"{sorted(js_linear.FEATURE_MAPS)}, 'favor' or a callable, got "
                       f"{feature_map!r}")
    if implementation is not None and implementation not in row.implementations:
      note = f" ({row.implementation_note})" if row.implementation_note else ""
      raise ValueError(f"{name}: `implementation` of kind {kind!r} must be "
                       f"{_one_of(['None', *map(repr, row.implementations)])}{note}, got "
                       f"{implementation!r}")
    if causal is None:
      causal = row.direction != "bidirectional"
    if not isinstance(causal, bool):
      raise ValueError(f"{name}: `causal` must be None or a bool, got {causal!r}")
    if causal and row.direction == "bidirectional":
      raise ValueError(f"{name}: kind {kind!r} is bidirectional ({row.why_bidirectional}), it "
                       "has no causal form: `causal` must be False or None")
    if not causal and row.direction == "causal":
      raise ValueError(f"{name}: `causal` = False needs a kind with a bidirectional form "
                       f"{_NON_CAUSAL}, got kind {kind!r}")
    if not (isinstance(strength, numbers.Real) and strength >= 0):
      raise ValueError(f"{name}: `strength` must be a number >= 0, got {strength!r}")
    if not (isinstance(max_len, numbers.Real) and max_len > 0):
      raise ValueError(f"{name}: `max_len` must be a positive number, got {max_len!r}")
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"{name}: `dtype` must be a floating dtype, got {dtype}")
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
    self.favor_features: int = positive_int(favor_features, "favor_features", name)
    self.feature_seed: int = int(feature_seed)
    self.mini_batch_size: int = positive_int(mini_batch_size, "mini_batch_size", name)
    self.strength: float = float(strength)
    self.num_slots: int = positive_int(num_slots, "num_slots", name)
    self.window: int = positive_int(window, "window", name)
    self.block_size: int = positive_int(block_size, "block_size", name)
    self.causal: bool = causal
    linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype,
                               param_dtype=jnp.float32, rngs=rngs)
    self.qkv: nnx.Linear = linear(d, 3 * n * h)
    self.o: nnx.Linear = linear(n * h, d)
    self.gate: nnx.Linear = linear(d, n * h)  # the output gate SiLU(W_r x)
    self.o_norm: nnx.Param = nnx.Param(jnp.ones((h,), jnp.float32))
    bound = 1.0 / math.sqrt(c)  # PyTorch's Conv1d default for a depthwise filter
    self.conv: nnx.Param = nnx.Param(jax.random.uniform(rngs.params(), (c, 3 * n * h),
                                                        jnp.float32, -bound, bound))
    for part in row.parts:  # the kind's gates and parameters, drawn in the table's order
      for attribute, value in part.build(self, rngs).items():
        setattr(self, attribute, value)

  @property
  def linear_kind(self) -> LinearKind:
    """This layer's row of ``LINEAR_MIXER_TABLE``."""
    return LINEAR_MIXER_TABLE[self.kind]

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
    """The data-dependent gates of ``x [..., d]`` (float32) that the kind's parts compute."""
    out: dict[str, jax.Array] = {}
    for part in self.linear_kind.parts:
      out.update(part.compute(self, x))
    return out

  def _feature_map(self) -> Any:
    if isinstance(self.feature_map, str) and self.feature_map == "favor":
      return js_linear.favor_feature_map(jax.random.key(self.feature_seed), self.head_dim,
                                         self.favor_features)
    return self.feature_map

  def _finish(self, o: jax.Array, x: jax.Array) -> jax.Array:
    """Per-head RMSNorm, the output gate (SiLU; RALA's: linear), the output projection."""
    o = rms_norm(o, self.o_norm[...]).astype(self.dtype)
    o = o.reshape(*o.shape[:-2], -1) * self.linear_kind.output_gate(self.gate(x))
    return self.o(o)

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
    o = self.linear_kind.forward(self, q, k, v, self._gates(x))
    return self._finish(o, x)

  def _step_fn(self, q: jax.Array, k: jax.Array, v: jax.Array, gates: dict[str, jax.Array],
               position: Any, state: Any) -> tuple[jax.Array, Any]:
    step = self.linear_kind.step
    assert step is not None  # a kind without a step is bidirectional: _check_causal refused it
    return step(self, q, k, v, gates, position, state)

  def init_state(self, batch: int) -> dict[str, Any]:
    """The decoding state of ``batch`` sequences before their first token: the zero
    convolution window ``conv [B, c - 1, 3NK]``, the zero recurrent state ``state`` (shaped
    by the kind's ``*_step`` function) and ``position = 0``. A bidirectional layer
    (``causal=False``: ``"rala"``) raises ValueError."""
    self._check_causal()
    batch = positive_int(batch, "batch", type(self).__name__)
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


class _OneKind(LinearMixer):
  """A :class:`LinearMixer` whose kind is the class's ``KIND``."""

  KIND: ClassVar[str]

  def __init__(self, d_model: int, num_heads: int, head_dim: int | None = None, **kwargs: Any):
    super().__init__(self.KIND, d_model, num_heads, head_dim, **kwargs)


class GatedDeltaNet(_OneKind):
  r"""Gated DeltaNet, the delta rule with a data-dependent decay: :class:`LinearMixer` of
  kind ``"gated_delta_rule"``.

  .. math::
    S_t = α_t (I - β_t k_t k_t^T) S_{t-1} + β_t k_t v_t^T, \qquad o_t = S_t^T q_t

  with :math:`\log α_t = -e^{A}\,\mathrm{softplus}(W_a x_t + b_{dt})` (Mamba-2's
  parametrisation), :math:`β_t = σ(W_β x_t)` and L2-normalised keys and queries.

  Args:
    d_model, num_heads, head_dim, **kwargs: those of :class:`LinearMixer`.

  Examples:
    >>> layer = js.nn.GatedDeltaNet(d_model=8, num_heads=2, rngs=nnx.Rngs(0))
    >>> layer.A_log.shape, layer.dt_bias.shape, layer.beta.kernel.shape  # per head
    ((2,), (2,), (8, 2))
    >>> jax.eval_shape(layer, jnp.ones((1, 4, 8))).shape  # the shape of layer(x)
    (1, 4, 8)

  References:
    S. Yang, J. Kautz & A. Hatamizadeh, 2025, "Gated Delta Networks: Improving Mamba2 with
    Delta Rule".
  """

  KIND = "gated_delta_rule"


class DeltaNet(_OneKind):
  r"""DeltaNet, linear attention whose state is corrected towards ``v_t`` along ``k_t``:
  :class:`LinearMixer` of kind ``"delta_rule"``.

  .. math::
    S_t = (I - β_t k_t k_t^T) S_{t-1} + β_t k_t v_t^T, \qquad o_t = S_t^T q_t

  with :math:`β_t = σ(W_β x_t)` and L2-normalised keys and queries.

  Args:
    d_model, num_heads, head_dim, **kwargs: those of :class:`LinearMixer`.

  Examples:
    >>> layer = js.nn.DeltaNet(d_model=8, num_heads=2, rngs=nnx.Rngs(0))
    >>> layer.conv.shape  # the short convolution of q, k and v: [c, 3 N K]
    (4, 24)
    >>> state = layer.init_state(batch=1)
    >>> y, state = jax.eval_shape(layer.step, jnp.ones((1, 8)), state)  # one token
    >>> y.shape, state["state"].shape
    ((1, 8), (1, 2, 4, 4))

  References:
    I. Schlag, K. Irie & J. Schmidhuber, 2021, "Linear Transformers Are Secretly Fast Weight
    Programmers".

    S. Yang, B. Wang, Y. Zhang, Y. Shen & Y. Kim, 2024, "Parallelizing Linear Transformers
    with the Delta Rule over Sequence Length".
  """

  KIND = "delta_rule"


class GLA(_OneKind):
  r"""Gated Linear Attention, a data-dependent decay per key channel: :class:`LinearMixer` of
  kind ``"gla"``.

  .. math::
    S_t = \mathrm{diag}(α_t) S_{t-1} + k_t v_t^T, \qquad
    \log α_t = \log σ(W^2 W^1 x_t + b) / 16

  through a rank-16 bottleneck ``W^2 W^1``.

  Args:
    d_model, num_heads, head_dim, **kwargs: those of :class:`LinearMixer`.

  Examples:
    >>> layer = js.nn.GLA(d_model=8, num_heads=2, rngs=nnx.Rngs(0))
    >>> layer.gk.kernel.shape, layer.gk2.kernel.shape  # W^1 and W^2: one decay per channel
    ((8, 16), (16, 8))

  References:
    S. Yang, B. Wang, Y. Shen, R. Panda & Y. Kim, 2024, "Gated Linear Attention Transformers
    with Hardware-Efficient Training".
  """

  KIND = "gla"


class SimpleGLA(_OneKind):
  r"""GLA with one data-dependent decay per head: :class:`LinearMixer` of kind
  ``"simple_gla"``.

  .. math::
    S_t = α_t S_{t-1} + k_t v_t^T, \qquad \log α_t = \log σ(w^T x_t + b) / 16

  Args:
    d_model, num_heads, head_dim, **kwargs: those of :class:`LinearMixer`.

  Examples:
    >>> layer = js.nn.SimpleGLA(d_model=8, num_heads=2, rngs=nnx.Rngs(0))
    >>> layer.gk.kernel.shape, layer.gk.bias.shape  # one decay per head
    ((8, 2), (2,))

  References:
    S. Yang, B. Wang, Y. Shen, R. Panda & Y. Kim, 2024, "Gated Linear Attention Transformers
    with Hardware-Efficient Training".
  """

  KIND = "simple_gla"


class LightningAttention(_OneKind):
  r"""Lightning Attention, a fixed decay per head set by the layer's depth:
  :class:`LinearMixer` of kind ``"lightning_attention"``.

  .. math::
    o_t = \sum_{j \le t} λ_n^{t-j} (q_t \cdot k_j) v_j

  with :math:`λ_n` of head ``n`` at depth ``layer_idx / num_layers`` (TransNormerLLM's).

  Args:
    d_model, num_heads, head_dim, **kwargs: those of :class:`LinearMixer` (``layer_idx``,
      ``num_layers`` set the decays).

  Returns:
    Called on ``x [B, T, d]``: ``y [B, T, d]``.

  Examples:
    >>> layer = js.nn.LightningAttention(d_model=8, num_heads=2, layer_idx=1, num_layers=4,
    ...                            rngs=nnx.Rngs(0))
    >>> sorted(nnx.to_pure_dict(nnx.state(layer)))  # no gate: the decays are fixed
    ['conv', 'gate', 'o', 'o_norm', 'qkv']
    >>> jax.eval_shape(layer, jnp.ones((1, 4, 8))).shape  # the shape of layer(x)
    (1, 4, 8)

  References:
    Z. Qin et al., 2024, "Lightning Attention-2: A Free Lunch for Handling Unlimited Sequence
    Lengths in Large Language Models".
  """

  KIND = "lightning_attention"


class LinearAttention(_OneKind):
  r"""Linear attention with a feature map: :class:`LinearMixer` of kind ``"linear"``.

  .. math::
    o_t = \frac{φ(q_t)^T \sum_{j \le t} φ(k_j) v_j^T}{φ(q_t)^T \sum_{j \le t} φ(k_j)}

  (the numerator alone with ``normalize=False``). A :class:`HedgehogFeatureMap` passed as
  ``feature_map`` becomes a submodule, trained with the layer; ``"favor"`` is Performer's
  random features.

  Args:
    d_model, num_heads, head_dim: those of :class:`LinearMixer`.
    feature_map: a name of ``jaxsoft.linear.FEATURE_MAPS``, ``"favor"``, a callable or a
      :class:`HedgehogFeatureMap`.
    **kwargs: the other arguments of :class:`LinearMixer`.

  Returns:
    Called on ``x [B, T, d]``: ``y [B, T, d]``.

  Examples:
    >>> from jaxsoft.nn import HedgehogFeatureMap, LinearAttention
    >>> layer = LinearAttention(d_model=8, num_heads=2,
    ...                         feature_map=HedgehogFeatureMap(2, 4), rngs=nnx.Rngs(0))
    >>> layer.feature_map.W.shape  # Hedgehog's W [N, K, F], trained with the layer
    (2, 4, 4)

  References:
    A. Katharopoulos, A. Vyas, N. Pappas & F. Fleuret, 2020, "Transformers are RNNs: Fast
    Autoregressive Transformers with Linear Attention".

    K. Choromanski et al., 2021, "Rethinking Attention with Performers".
  """

  KIND = "linear"

  def __init__(self, d_model: int, num_heads: int, head_dim: int | None = None, *,
               feature_map: str | Callable[[jax.Array], jax.Array] = "elu1", **kwargs: Any):
    super().__init__(d_model, num_heads, head_dim, feature_map=feature_map, **kwargs)
