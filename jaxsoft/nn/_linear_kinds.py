r"""The kinds of :class:`~jaxsoft.nn.LinearMixer` as one table: ``name -> LinearKind``.

A row says everything the layer does differently for its kind: the full-sequence function
and the one-token decoding step of :mod:`jaxsoft.linear` it calls, the gates and other
learned parameters it adds to the shared projections (each a :class:`Part` that builds its
``nnx`` parameters and computes its values from ``x``), the implementations and feature maps
it takes, whether it is causal, bidirectional or either, and its output gate. The layer
reads the row; adding a linear layer is its function file in ``jaxsoft/linear``, one row
here and its tests.

The parts build their parameters in the order of the table (the random draws of
``nnx.Rngs`` follow it), and their names are the layer's attribute names: ``a``, ``A_log``,
``dt_bias`` (Gated DeltaNet's decay), ``beta``, ``gk`` / ``gk2`` (GLA's decays), ``eta``,
``head_gate``, ``slots``, ``basis`` / ``basis_log_rate``, ``mixing`` (MHLA's ``C``) and
``lrpe_theta`` (TransNormerLLM's LRPE angles).
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsoft import linear as js_linear

__all__ = ["LinearKind", "Part", "LINEAR_MIXER_TABLE", "GLA_GATE_RANK", "GLA_GATE_NORMALIZER",
           "TTT_ETA_BASE"]

GLA_GATE_RANK = 16  # GLA's low-rank gate bottleneck
GLA_GATE_NORMALIZER = 16.0  # GLA divides log sigmoid by 16 (slow decay at initialisation)
TTT_ETA_BASE = 1.0  # TTT-Linear's base inner learning rate

Direction = Literal["causal", "bidirectional", "either"]


@dataclasses.dataclass(frozen=True)
class Part:
  """A learned piece of a kind beyond the shared projections.

  Attributes:
    build: ``(layer, rngs) -> {attribute name: nnx.Linear or nnx.Param}``, called once the
      layer's sizes (``d_model``, ``num_heads``, ``head_dim``, ``num_slots``, ``max_len``,
      ``block_size``, ``causal``, ``dtype``) are set; the layer sets the attributes.
    compute: ``(layer, x [..., d]) -> {gate name: float32 array}``, the entries this part
      adds to the ``gates`` the kind's functions receive (none for MHLA's mixing ``C``).
  """

  build: Callable[[Any, nnx.Rngs], dict[str, Any]]
  compute: Callable[[Any, jax.Array], dict[str, jax.Array]] = lambda layer, x: {}


@dataclasses.dataclass(frozen=True)
class LinearKind:
  """One kind of :class:`~jaxsoft.nn.LinearMixer`: the row of ``LINEAR_MIXER_TABLE`` the layer
  reads to build, run and decode.

  ``forward(layer, q, k, v, gates) -> o`` runs the whole sequence (``q, k, v [B, T, N, K]``,
  ``gates`` the float32 values its parts compute from ``x``); ``step(layer, q, k, v, gates,
  position, state) -> (o, state)`` advances one token (``[B, N, K]``), ``None`` for a kind
  with no causal form.

  Attributes:
    title: the layer's name in its paper.
    forward: the full-sequence call.
    step: the one-token decoding call, or None.
    parts: the :class:`Part` s the kind adds, built in this order.
    implementations: the values of ``implementation`` it accepts besides None.
    implementation_note: why the list is short, shown when another is asked for.
    feature_maps: the feature-map names it accepts (it also takes a callable); empty: it has
      no feature map.
    direction: ``"causal"``, ``"bidirectional"`` (no causal form, no decoding) or
      ``"either"`` (``causal=False`` allowed).
    why_bidirectional: for a bidirectional kind, what makes it so.
    output_gate: applied to ``W_r x`` before it multiplies the normalised output (SiLU in
      every paper but RALA's, whose gate is linear).

  Examples:
    >>> from jaxsoft.nn import LINEAR_MIXER_TABLE
    >>> row = LINEAR_MIXER_TABLE["gated_delta_rule"]
    >>> row.title, row.direction, row.step is not None
    ('Gated DeltaNet', 'causal', True)
    >>> LINEAR_MIXER_TABLE["rala"].direction, LINEAR_MIXER_TABLE["rala"].step
    ('bidirectional', None)
  """

  title: str
  forward: Callable[..., jax.Array]
  step: Callable[..., tuple[jax.Array, Any]] | None
  parts: tuple[Part, ...] = ()
  implementations: tuple[str, ...] = js_linear.IMPLEMENTATIONS
  implementation_note: str = ""
  feature_maps: tuple[str, ...] = ()
  direction: Direction = "causal"
  why_bidirectional: str = ""
  output_gate: Callable[[jax.Array], jax.Array] = jax.nn.silu


# ------------------------------------------------------------------------------- the parts


def _dense(layer: Any, rngs: nnx.Rngs, d_in: int, d_out: int, *, bias: bool = False
           ) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, use_bias=bias, dtype=layer.dtype, param_dtype=jnp.float32,
                    rngs=rngs)


def _f32(linear: nnx.Linear, x: jax.Array) -> jax.Array:
  return linear(x).astype(jnp.float32)


def _inverse_softplus(y: jax.Array) -> jax.Array:
  return y + jnp.log(-jnp.expm1(-y))


def _gated_decay_params(layer: Any, rngs: nnx.Rngs) -> dict[str, Any]:
  n = layer.num_heads
  a = _dense(layer, rngs, layer.d_model, n)  # the decay rate
  a_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (n,), jnp.float32, 1.0, 16.0)))
  dt = jnp.exp(jax.random.uniform(rngs.params(), (n,), jnp.float32, math.log(1e-3),
                                  math.log(1e-1)))
  return {"a": a, "A_log": a_log, "dt_bias": nnx.Param(_inverse_softplus(dt))}


def _gated_decay(layer: Any, x: jax.Array) -> dict[str, jax.Array]:
  pre = _f32(layer.a, x)                                     # [..., N]
  per_head = lambda p: p.reshape((1,) * (pre.ndim - 1) + p.shape)   # [N] -> [1, ..., N]
  rate = jax.nn.softplus(pre + per_head(layer.dt_bias[...]))
  return {"g": -per_head(jnp.exp(layer.A_log[...])) * rate}


def _channel_decay(layer: Any, x: jax.Array) -> dict[str, jax.Array]:
  g = jax.nn.log_sigmoid(_f32(layer.gk2, layer.gk(x))) / GLA_GATE_NORMALIZER
  return {"g": g.reshape(*g.shape[:-1], layer.num_heads, layer.head_dim)}


def _slots(layer: Any, x: jax.Array) -> dict[str, jax.Array]:
  a = jax.nn.log_sigmoid(_f32(layer.slots, x)) / GLA_GATE_NORMALIZER
  return {"slots": a.reshape(*a.shape[:-1], layer.num_heads, layer.num_slots)}


def _basis_params(layer: Any, rngs: nnx.Rngs) -> dict[str, Any]:
  n, m = layer.num_heads, layer.num_slots
  basis = _dense(layer, rngs, layer.d_model, 2 * n * m)
  # decay rates e^A in [0.01, 0.5], spread like Mamba's
  rate = jax.random.uniform(rngs.params(), (n, m), jnp.float32, 0.01, 0.5)
  return {"basis": basis, "basis_log_rate": nnx.Param(jnp.log(rate))}


def _basis(layer: Any, x: jax.Array) -> dict[str, jax.Array]:
  b = _f32(layer.basis, x)
  b = b.reshape(*b.shape[:-1], 2, layer.num_heads, layer.num_slots)
  return {"basis_in": b[..., 0, :, :], "basis_out": b[..., 1, :, :],
          "log_decay": -jnp.exp(layer.basis_log_rate[...])}


def _head_gates(layer: Any, x: jax.Array) -> dict[str, jax.Array]:
  q_gate, k_gate = jnp.split(_f32(layer.head_gate, x), 2, -1)
  return {"q_gate": q_gate, "k_gate": k_gate}


def _mixing_params(layer: Any, rngs: nnx.Rngs) -> dict[str, Any]:
  """MHLA's ``C [N, M_max, M_max]``, started as vanilla linear attention (causal: the blocks
  <= i)."""
  del rngs
  blocks = math.ceil(layer.max_len / layer.block_size)
  ones = jnp.ones((blocks, blocks), jnp.float32)
  return {"mixing": nnx.Param(jnp.broadcast_to(jnp.tril(ones) if layer.causal else ones,
                                               (layer.num_heads, blocks, blocks)))}


# Gated DeltaNet's decay log α = -e^A softplus(W_a x + b_dt) (Mamba-2's parametrisation).
GATED_DECAY = Part(_gated_decay_params, _gated_decay)
# The delta rule's write strength β = σ(W_β x).
BETA = Part(lambda layer, rngs: {"beta": _dense(layer, rngs, layer.d_model, layer.num_heads)},
            lambda layer, x: {"beta": jax.nn.sigmoid(_f32(layer.beta, x))})
# One decay per head, log α = log σ(W x + b) / 16 (Simple GLA's; CCQ's and SLA's backbone).
HEAD_DECAY = Part(
    lambda layer, rngs: {"gk": _dense(layer, rngs, layer.d_model, layer.num_heads, bias=True)},
    lambda layer, x: {"g": jax.nn.log_sigmoid(_f32(layer.gk, x)) / GLA_GATE_NORMALIZER})
# GLA's per-channel decay through a rank-16 bottleneck, log α = log σ(W² W¹ x + b) / 16.
CHANNEL_DECAY = Part(
    lambda layer, rngs: {
        "gk": _dense(layer, rngs, layer.d_model, GLA_GATE_RANK),
        "gk2": _dense(layer, rngs, GLA_GATE_RANK, layer.num_heads * layer.head_dim, bias=True)},
    _channel_decay)
# TTT-Linear's inner learning rate η = η_base σ(W_η x).
ETA = Part(lambda layer, rngs: {"eta": _dense(layer, rngs, layer.d_model, layer.num_heads)},
           lambda layer, x: {"eta": TTT_ETA_BASE * jax.nn.sigmoid(_f32(layer.eta, x))})
# The softmax-over-heads read and write gates W_g x, W_g' x.
HEAD_GATES = Part(
    lambda layer, rngs: {"head_gate": _dense(layer, rngs, layer.d_model, 2 * layer.num_heads)},
    _head_gates)
# Native hybrid attention's slot forget gates log σ(W_s x + b) / 16.
SLOTS = Part(lambda layer, rngs: {"slots": _dense(layer, rngs, layer.d_model,
                                                  layer.num_heads * layer.num_slots, bias=True)},
             _slots)
# Interdomain attention's basis coefficients W_b x, read-outs W_ψ x and decays -e^{A_r}.
BASIS = Part(_basis_params, _basis)
# MHLA's learned block mixing C (no value from x).
MIXING = Part(_mixing_params)
# TransNormerLLM's learned LRPE angles θ [N, K], started at lrpe_theta (no value from x).
LRPE_THETA = Part(
    lambda layer, rngs: {"lrpe_theta": nnx.Param(js_linear.lrpe_theta(layer.num_heads,
                                                                      layer.head_dim))},
    lambda layer, x: {"theta": layer.lrpe_theta[...]})


# ---------------------------------------------------------------------- the kinds' calls


def _impl(layer: Any) -> dict[str, Any]:
  """The keywords of the functions with parallel, recurrent and chunked forms."""
  return dict(implementation=layer.implementation, chunk_size=layer.chunk_size)


def mhla_mixing(layer: Any, t: int) -> jax.Array:
  """MHLA's ``C`` sliced to the ``⌈t / b⌉`` blocks of ``t`` tokens."""
  blocks = math.ceil(t / layer.block_size)
  if blocks > layer.mixing.shape[-1]:
    raise ValueError(f"{type(layer).__name__}: `x` has T = {t} tokens, more than the "
                     f"{layer.mixing.shape[-1]} blocks of {layer.block_size} that `max_len` = "
                     f"{layer.max_len:g} gives kind 'mhla'")
  return layer.mixing[...][:, :blocks, :blocks]


_MAPS = tuple(js_linear.FEATURE_MAPS)

_TABLE: dict[str, LinearKind] = {
    "gated_delta_rule": LinearKind(
        "Gated DeltaNet",
        lambda m, q, k, v, g: js_linear.gated_delta_rule(q, k, v, g["g"], g["beta"],
                                                         qk_l2norm=True, **_impl(m)),
        lambda m, q, k, v, g, position, state: js_linear.gated_delta_rule_step(
            q, k, v, g["g"], g["beta"], state, qk_l2norm=True),
        parts=(GATED_DECAY, BETA)),
    "delta_rule": LinearKind(
        "DeltaNet",
        lambda m, q, k, v, g: js_linear.delta_rule(q, k, v, g["beta"], qk_l2norm=True,
                                                   **_impl(m)),
        lambda m, q, k, v, g, position, state: js_linear.delta_rule_step(
            q, k, v, g["beta"], state, qk_l2norm=True),
        parts=(BETA,)),
    "simple_gla": LinearKind(
        "Simple GLA",
        lambda m, q, k, v, g: js_linear.simple_gla(q, k, v, g["g"], **_impl(m)),
        lambda m, q, k, v, g, position, state: js_linear.simple_gla_step(q, k, v, g["g"], state),
        parts=(HEAD_DECAY,)),
    "gla": LinearKind(
        "GLA (gated linear attention)",
        lambda m, q, k, v, g: js_linear.gla(q, k, v, g["g"], **_impl(m)),
        lambda m, q, k, v, g, position, state: js_linear.gla_step(q, k, v, g["g"], state),
        parts=(CHANNEL_DECAY,)),
    "lightning_attention": LinearKind(
        "Lightning Attention",
        lambda m, q, k, v, g: js_linear.lightning_attention(
            q, k, v, layer_idx=m.layer_idx, num_layers=m.num_layers, **_impl(m)),
        lambda m, q, k, v, g, position, state: js_linear.lightning_attention_step(
            q, k, v, state, layer_idx=m.layer_idx, num_layers=m.num_layers)),
    "transnormer": LinearKind(
        "TransNormerLLM (LRPE-d attention, gate U = W_u x)",
        lambda m, q, k, v, g: js_linear.transnormer_attention(
            q, k, v, theta=g["theta"], layer_idx=m.layer_idx, num_layers=m.num_layers,
            **_impl(m)),
        lambda m, q, k, v, g, position, state: js_linear.transnormer_attention_step(
            q, k, v, state, position=position, theta=g["theta"], layer_idx=m.layer_idx,
            num_layers=m.num_layers),
        parts=(LRPE_THETA,), output_gate=lambda gate: gate),
    "linear": LinearKind(
        "linear attention",
        lambda m, q, k, v, g: js_linear.linear_attention(
            q, k, v, feature_map=m._feature_map(), normalize=m.normalize, **_impl(m)),
        lambda m, q, k, v, g, position, state: js_linear.linear_attention_step(
            q, k, v, state, feature_map=m._feature_map(), normalize=m.normalize),
        feature_maps=(*_MAPS, "favor")),
    "cosformer": LinearKind(
        "cosFormer",
        lambda m, q, k, v, g: js_linear.cosformer(q, k, v, max_len=m.max_len, **_impl(m)),
        lambda m, q, k, v, g, position, state: js_linear.cosformer_step(
            q, k, v, state, position=position, max_len=m.max_len)),
    "mala": LinearKind(
        "MALA (magnitude-aware linear attention)",
        lambda m, q, k, v, g: js_linear.mala(q, k, v, feature_map=m._feature_map(), **_impl(m)),
        lambda m, q, k, v, g, position, state: js_linear.mala_step(
            q, k, v, state, feature_map=m._feature_map()),
        feature_maps=_MAPS),
    "ttt_linear": LinearKind(
        "TTT-Linear",
        lambda m, q, k, v, g: js_linear.ttt_linear(
            q, k, v, g["eta"], mini_batch_size=m.mini_batch_size,
            implementation=m.implementation),
        lambda m, q, k, v, g, position, state: js_linear.ttt_linear_step(
            q, k, v, g["eta"], state, mini_batch_size=m.mini_batch_size),
        parts=(ETA,), implementations=("recurrent", "chunked")),
    "ccq": LinearKind(
        "CCQ (covariance-contracted queries)",
        lambda m, q, k, v, g: js_linear.ccq(q, k, v, g["g"], strength=m.strength, **_impl(m)),
        lambda m, q, k, v, g, position, state: js_linear.ccq_step(
            q, k, v, g["g"], None, state, strength=m.strength),
        parts=(HEAD_DECAY,)),
    "softmax_linear_attention": LinearKind(
        "softmax linear attention",
        lambda m, q, k, v, g: js_linear.softmax_linear_attention(
            q, k, v, g["q_gate"], g["k_gate"], g=g["g"], **_impl(m)),
        lambda m, q, k, v, g, position, state: js_linear.softmax_linear_attention_step(
            q, k, v, g["q_gate"], g["k_gate"], state, g=g["g"]),
        parts=(HEAD_DECAY, HEAD_GATES)),
    "native_hybrid": LinearKind(
        "native hybrid attention",
        lambda m, q, k, v, g: js_linear.native_hybrid_attention(
            q, k, v, g["slots"], window=m.window, **_impl(m)),
        lambda m, q, k, v, g, position, state: js_linear.native_hybrid_attention_step(
            q, k, v, g["slots"], state, window=m.window),
        parts=(SLOTS,)),
    "interdomain": LinearKind(
        "interdomain attention",
        lambda m, q, k, v, g: js_linear.interdomain_attention(
            q, k, v, g["basis_in"], g["basis_out"], g["log_decay"], **_impl(m)),
        lambda m, q, k, v, g, position, state: js_linear.interdomain_attention_step(
            q, k, v, g["basis_in"], g["basis_out"], g["log_decay"], state),
        parts=(BASIS,)),
    "mhla": LinearKind(
        "MHLA (multi-head linear attention)",
        lambda m, q, k, v, g: js_linear.mhla(
            q, k, v, mhla_mixing(m, q.shape[1]), block_size=m.block_size,
            feature_map=m._feature_map(), causal=m.causal, implementation=m.implementation),
        lambda m, q, k, v, g, position, state: js_linear.mhla_step(
            q, k, v, m.mixing[...], state, position=position, block_size=m.block_size,
            feature_map=m._feature_map()),
        parts=(MIXING,), implementations=("parallel", "chunked"),
        implementation_note="no recurrent form", feature_maps=_MAPS, direction="either"),
    "rala": LinearKind(
        "RALA (rank-augmented linear attention)",
        lambda m, q, k, v, g: js_linear.rala(q, k, v, feature_map=m._feature_map()),
        None, implementations=(), implementation_note="it has one form", feature_maps=_MAPS,
        direction="bidirectional",
        why_bidirectional="its key weights use the mean of all the sequence's queries",
        output_gate=lambda gate: gate),
}

# Read-only: a kind is added by a row above, never at run time.
LINEAR_MIXER_TABLE: Mapping[str, LinearKind] = types.MappingProxyType(_TABLE)
