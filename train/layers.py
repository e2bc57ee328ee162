r"""The token mixers of hybrid stacks besides the normalizer block, and decoding with caches.

Every mixer maps ``x [B, T, d]`` (the block's normalised input) to ``[B, T, d]`` and has a
one-token ``step(x [B, 1, d], position, cache) -> (out, cache)`` for generation:

* :class:`LinearMixer`, the linear family of ``jaxsoft.linear`` (``gated_delta_rule``,
  ``delta_rule``, ``simple_gla``, ``gla``, ``lightning_attention``, ``linear:<feature map>``,
  ``cosformer``, ``mala``, ``ttt_linear``, ``ccq``, ``softmax_linear_attention``,
  ``native_hybrid``, ``interdomain``, ``mhla``): :class:`jaxsoft.nn.LinearMixer` configured from
  the ``Config``,
  laid out as Gated Linear Attention and Gated DeltaNet layers are:

  .. math::
    [q; k; v]_t = \mathrm{SiLU}\bigl(\mathrm{conv}_w([W_q; W_k; W_v]\, x)\bigr)_t, \qquad
    \mathrm{conv}_w(u)_t = \sum_{i=0}^{c-1} w_i \odot u_{t-c+1+i}

  (a causal depthwise convolution of width ``c = --conv_size``, zero before the start), the
  kind's recurrence ``o = mix(q, k, v, gates)``, then per head
  :math:`\mathrm{RMSNorm}(o_t) \odot \mathrm{SiLU}(W_r x_t)` and the output projection
  :math:`W_o`. The gates: Gated DeltaNet's decay
  :math:`\log\alpha_t = -e^{A}\,\mathrm{softplus}(W_a x_t + b_{dt})` (Mamba-2's
  parametrisation) and write strength :math:`\beta_t = \sigma(W_\beta x_t)`, keys and queries
  L2-normalised (S. Yang, J. Kautz & A. Hatamizadeh, 2025, "Gated Delta Networks: Improving
  Mamba2 with Delta Rule"); DeltaNet's :math:`\beta_t` alone (S. Yang, B. Wang, Y. Zhang,
  Y. Shen & Y. Kim, 2024, "Parallelizing Linear Transformers with the Delta Rule over
  Sequence Length"); GLA's per-channel decay :math:`\log\alpha_t = \log\sigma(W^2 W^1 x_t +
  b)/16` through a rank-16 bottleneck (S. Yang, B. Wang, Y. Shen, R. Panda & Y. Kim, 2024,
  "Gated Linear Attention Transformers with Hardware-Efficient Training"), one such gate per
  head for ``simple_gla``; Lightning Attention's fixed per-head decay of this layer's depth;
  none for the rest. ``linear:favor`` draws its random features from a key fixed by the layer
  index (Performer, Choromanski et al., 2021, "Rethinking Attention with Performers");
  ``linear:identity`` is the unnormalised form (its denominator could vanish). ``cosformer``
  uses ``M = --seq_len``; ``mhla`` (causal) mixes blocks of ``--block_size`` tokens with a
  learned ``C`` for the ``⌈--seq_len / --block_size⌉`` blocks, started at lower-triangular
  ones (vanilla linear attention). RALA (``jaxsoft.nn.LinearMixer(kind="rala")``) is
  bidirectional and is refused as a layer (``config.BIDIRECTIONAL_KINDS``). The decoding cache
  is the convolution's last ``c - 1`` inputs and the recurrent state, advanced by the kind's
  ``*_step`` function (for ``mhla`` the summaries of the ``⌈--seq_len / --block_size⌉``
  blocks, the current one a running sum).
* :class:`SparseAttention`, ``jaxsoft.attention``'s self-attention layers of
  ``train.kinds.SPARSE_ATTENTION`` (``topk_attention``, ``block_sparse_attention:<method>``,
  ``multi_token_attention`` with a learned per-head kernel of 3 query rows x 5 keys started at
  the identity, as its paper does, ``lucid_attention``, ``multiscreen_attention``,
  ``infsa_attention`` with gamma 1/2) with the normalizer block's q/k/v/o projections and
  RoPE. Their decoding cache is the layer's input history: each step recomputes the layer over
  it and keeps the last position (exact: every kind is causal, the block-sparse methods
  choosing key blocks per query token).

* :class:`ControlAttention`, the attention controls of ``train.kinds.CONTROL_ATTENTION``
  (A49, :class:`jaxsoft.nn.AttentionControl`): ``no_mixing`` (each position's output is its
  own value: no token mixing), ``uniform_mixing`` (the causal average of the values),
  ``fixed_map`` (a learned sequence-independent ``--seq_len`` x ``--seq_len`` map per head
  through ``--normalizer``, started at the causal average), ``static_qk`` / ``random_qk``
  (queries and keys from learned / fixed random position embeddings, values from the
  tokens), and ``hybrid:<control>``: the first ``num_heads // 2`` heads real attention with
  RoPE and ``--normalizer``, the rest the control. Their maps do not depend on the input;
  the positional ones cover ``--seq_len`` positions. Layer-level hybrids are ``--layers``
  (e.g. ``softmax,fixed_map,fixed_map,fixed_map``).
* :class:`PoNetLayer`, PoNet's pooling mixer (A51, :class:`jaxsoft.nn.PoNetMixer`) as
  ``ponet``: segments of ``--block_size`` tokens, a local window of 3, and the causal
  reconstruction of :func:`jaxsoft.attention.ponet_mix` (the paper's model is an encoder:
  its global and segment pools see the future; here token i pools j <= i only). No
  positional encoding (the running pools and the window order the tokens).

The sparse, control and PoNet layers decode by recomputation (:class:`RecomputedDecoding`):
the cache is the layer's input history, and each step recomputes the layer over it and keeps
the last position (exact: every kind is causal).

:func:`make_mixer` builds any of them from one table, :data:`MIXERS` (``kind -> builder``), made
from the kinds of ``train.kinds``. Their parameters carry Flax NNX logical axis names
(:data:`PARAMETER_NAMES`, written by :func:`name_parameters`), which
``train.sharding.LOGICAL_AXIS_RULES`` maps to the mesh: the Megatron layout over ``tensor``
(projections into the heads column-parallel, out of them row-parallel) and the model width over
``fsdp``, as the normalizer block's. The normalizer block (``train.model.Attention``) owns its
KV cache and decoding step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsoft import attention as js_attention
from jaxsoft import nn as js_nn
from jaxsoft.nn import causal_conv, causal_conv_step
from train import sharding as tsharding
from train.config import Config
from train.kinds import (
    ATTENTION_VARIANTS,
    BIDIRECTIONAL_KINDS,
    CONTROL_ATTENTION,
    CONTROL_KINDS,
    FOX_KINDS,
    LINEAR_KINDS,
    PONET_WINDOW,
    POOLING_KINDS,
    SPARSE_ATTENTION,
    SPARSE_KINDS,
)
from train.positions import rope

__all__ = ["LinearMixer", "SparseAttention", "ControlAttention", "PoNetLayer", "FoXProLayer",
           "RecomputedDecoding", "make_mixer", "MIXERS", "NEEDS", "causal_conv",
           "causal_conv_step", "variant_config", "MTA_QUERY_WIDTH", "MTA_KEY_WIDTH",
           "PARAMETER_NAMES", "name_parameters"]

MTA_QUERY_WIDTH, MTA_KEY_WIDTH = 3, 5

Names = tuple[str | None, ...]

# The Flax NNX logical axis names of every mixer's parameters, ``{class name: {parameter path:
# names}}`` (paths ``/``-joined as ``nnx.iter_graph`` gives them); train.sharding's
# LOGICAL_AXIS_RULES maps the names to mesh axes, as for train.model's normalizer block. The
# Megatron layout: projections into the heads are column-parallel (``("embed", "heads")``: rows
# over ``fsdp``, head columns over ``tensor``), those out of them row-parallel
# (``("heads", "embed")``), per-head vectors split with their heads, RMSNorm scales replicated.
# The fused ``[W_q; W_k; W_v]`` columns of the linear mixers (and their convolution) split in
# contiguous blocks that follow the heads only within each of q, k, v, so GSPMD moves the
# straddling block when it splits the three; the fused ``[q; k]`` head gates and the
# ``[in; out]`` basis of the interdomain kind stay whole over ``tensor`` (small).
_SHARED_LINEAR: dict[str, Names] = {
    "qkv/kernel": ("embed", "heads"), "conv": (None, "heads"), "gate/kernel": ("embed", "heads"),
    "o/kernel": ("heads", "embed"), "o_norm": ("norm",),
    # the kinds' gates and parameters (jaxsoft.nn's linear-kind parts)
    "a/kernel": ("embed", "heads"), "A_log": ("heads",), "dt_bias": ("heads",),
    "beta/kernel": ("embed", "heads"), "eta/kernel": ("embed", "heads"),
    "gk/kernel": ("embed", "heads"), "gk/bias": ("heads",),    # one decay per head
    "gk2/kernel": (None, "heads"), "gk2/bias": ("heads",),      # GLA: W^2 of the rank-16 gate
    "head_gate/kernel": ("embed", None), "slots/kernel": ("embed", "heads"),
    "slots/bias": ("heads",), "basis/kernel": ("embed", None), "basis_log_rate": ("heads", None),
    "lrpe_theta": ("heads", None), "mixing": ("heads", None, None),
}
PARAMETER_NAMES: Mapping[str, Mapping[str, Names]] = {
    "LinearMixer": _SHARED_LINEAR,
    "SparseAttention": {
        "q/kernel": ("embed", "heads"), "k/kernel": ("embed", "kv_heads"),
        "v/kernel": ("embed", "kv_heads"), "o/kernel": ("heads", "embed"),
        "mta_kernel": ("heads", None, None)},
    "ControlAttention": {
        "value/kernel": ("embed", "heads"), "value/bias": ("heads",),
        "out/kernel": ("heads", "embed"), "out/bias": (None,),
        "query/kernel": ("embed", "heads"), "query/bias": ("heads",),
        "key/kernel": ("embed", "heads"), "key/bias": ("heads",),
        "scores": ("heads", None, None), "positions": (None, "embed"),
        "position_query/kernel": ("embed", "heads"), "position_query/bias": ("heads",),
        "position_key/kernel": ("embed", "heads"), "position_key/bias": ("heads",)},
    "PoNetLayer": {
        **{f"{name}/{part}": names for name in ("query", "key", "gate", "segment", "local")
           for part, names in (("kernel", ("embed", "heads")), ("bias", ("heads",)))},
        "out/kernel": ("heads", "embed"), "out/bias": (None,)},
    "FoXProLayer": {
        "attn/query/kernel": ("embed", "heads", None), "attn/query/bias": ("heads", None),
        "attn/key/kernel": ("embed", "kv_heads", None), "attn/key/bias": ("kv_heads", None),
        "attn/value/kernel": ("embed", "kv_heads", None),
        "attn/value/bias": ("kv_heads", None),
        "attn/out/kernel": ("heads", None, "embed"), "attn/out/bias": (None,),
        "attn/gate_kernel": ("embed", "heads", None), "attn/gate_bias": ("heads", None),
        "attn/forget_kernel": ("embed", "heads"), "attn/forget_bias": ("heads",),
        "k_shift_kernel": ("embed", "kv_heads"), "v_shift_kernel": ("embed", "kv_heads"),
        "q_norm_scale": ("heads", None), "k_norm_scale": ("kv_heads", None),
        "out_norm_scale": ("heads", None)},
}


def name_parameters(module: nnx.Module, names: Mapping[str, Names]) -> None:
  """Gives each ``nnx.Param`` of ``module`` whose ``/``-joined path is in ``names`` those
  logical axis names (the metadata ``nnx.with_partitioning`` writes, not applied at creation);
  train.sharding lays a named parameter out by ``LOGICAL_AXIS_RULES`` and an unnamed one by the
  FSDP rule. Raises ValueError when a name list's length is not the parameter's rank."""
  for path, node in nnx.iter_graph(module):
    key = "/".join(str(p) for p in path)
    if isinstance(node, nnx.Param) and key in names:
      if len(names[key]) != node.ndim:
        raise ValueError(f"names: {len(names[key])} logical names for {key!r} of shape "
                         f"{tuple(node.shape)}")
      node.set_metadata(out_sharding=names[key], eager_sharding=False)


class _PositionFree:
  """A mixer without a position encoding: ``layer(x, positions)`` ignores ``positions`` (the
  layer's own structure orders the tokens: a causal convolution and decays, causal pools and
  a window, a forget gate) and applies the ``jaxsoft.nn`` module it extends to ``x``."""

  def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    del positions
    return super().__call__(x)  # type: ignore[misc]


class LinearMixer(_PositionFree, js_nn.LinearMixer):
  """A linear-attention layer of kind ``kind`` (one of ``config.LINEAR_KINDS``):
  :class:`jaxsoft.nn.LinearMixer` configured from ``cfg``, with the decoding-cache interface
  of the other mixers (``init_cache``, ``step(x, position, cache)``)."""

  def __init__(self, cfg: Config, kind: str, layer_idx: int, *, rngs: nnx.Rngs):
    if kind in BIDIRECTIONAL_KINDS:
      raise ValueError(f"kind: {kind!r} cannot be a layer here: {BIDIRECTIONAL_KINDS[kind]}")
    if kind not in LINEAR_KINDS:
      raise ValueError(f"kind: {kind!r} is not a linear kind; one of {LINEAR_KINDS}")
    base, _, feature_map = kind.partition(":")
    super().__init__(base, cfg.d_model, cfg.num_heads, cfg.head_dim, conv_size=cfg.conv_size,
                     feature_map=feature_map or "elu1", normalize=kind != "linear:identity",
                     favor_features=cfg.favor_features, feature_seed=layer_idx,
                     layer_idx=layer_idx, num_layers=cfg.num_layers,
                     max_len=float(cfg.seq_len), block_size=cfg.block_size, dtype=cfg.dtype,
                     rngs=rngs)
    name_parameters(self, PARAMETER_NAMES["LinearMixer"])
    if hasattr(self, "gk2"):  # GLA: ``gk`` is W^1, the bottleneck's first half
      name_parameters(self, {"gk/kernel": ("embed", None)})

  def init_cache(self, batch: int, max_len: int) -> dict[str, Any]:
    """Zero convolution window and the zero recurrent state (shaped by the kind's step)."""
    del max_len
    state = self.init_state(batch)
    return {"conv": state["conv"], "state": state["state"]}

  def step(self, x: jax.Array, position: jax.Array,  # type: ignore[override]
           cache: dict[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
    """``x [B, 1, d]`` at ``position`` -> (``[B, 1, d]``, the advanced cache)."""
    y, window, state = self.decode(x[:, 0], position, cache["conv"], cache["state"])
    return y[:, None], {"conv": window, "state": state}


# What a sparse kind may ask of its layer (``SparseKind.needs``): keyword -> (layer, keys) ->
# value. ``kernel`` is a parameter: the layer owns a Multi-Token Attention kernel for it.
NEEDS: Mapping[str, Callable[[Any, jax.Array], Any]] = {
    "top_k": lambda layer, k: min(layer.top_k, k.shape[1]),
    "top_k_blocks": lambda layer, k: layer.top_k,
    "block_size": lambda layer, k: layer.block_size,
    "skip_threshold": lambda layer, k: layer.skip_threshold,
    "kernel": lambda layer, k: layer.mta_kernel[...],
}


class RecomputedDecoding:
  """Decoding by recomputation, for a causal layer ``layer(x [B, T, d], positions)``: the
  cache is the layer's input history ``[B, max_len, d]``; a step writes its token, recomputes
  the layer over the history and keeps the output at its position. The layer sets ``width``
  (d), ``cache_dtype`` and ``max_positions`` (the positions it covers, or None)."""

  width: int
  cache_dtype: Any
  max_positions: int | None = None

  def init_cache(self, batch: int, max_len: int) -> dict[str, Any]:
    """The layer-input history ``[B, max_len, d]`` (zeros)."""
    if self.max_positions is not None and max_len > self.max_positions:
      raise ValueError(f"max_len: this {type(self).__name__} layer covers --seq_len = "
                       f"{self.max_positions} positions, got {max_len}")
    return {"x": jnp.zeros((batch, max_len, self.width), self.cache_dtype)}

  def step(self, x: jax.Array, position: jax.Array, cache: dict[str, Any]
           ) -> tuple[jax.Array, dict[str, Any]]:
    """Writes ``x [B, 1, d]`` at ``position``, recomputes the layer over the history and
    returns its output at ``position``."""
    history = jax.lax.dynamic_update_slice_in_dim(cache["x"], x.astype(cache["x"].dtype),
                                                  position, axis=1)
    b, length, _ = history.shape
    positions = jnp.broadcast_to(jnp.arange(length), (b, length))
    out = jax.lax.dynamic_slice_in_dim(self(history, positions), position, 1,  # type: ignore[operator]
                                       axis=1)
    return out, {"x": history}


class SparseAttention(RecomputedDecoding, nnx.Module):
  """A jaxsoft.attention self-attention layer (one of ``config.SPARSE_KINDS``) with RoPE: the
  function of its row of ``train.kinds.SPARSE_ATTENTION``, with the keywords the row needs."""

  def __init__(self, cfg: Config, kind: str, layer_idx: int, *, rngs: nnx.Rngs):
    if kind not in SPARSE_KINDS:
      raise ValueError(f"kind: {kind!r} is not a sparse attention kind; one of {SPARSE_KINDS}")
    del layer_idx
    dtype = jnp.dtype(cfg.dtype)
    linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype,
                               param_dtype=jnp.float32, rngs=rngs)
    self.kind, self.dtype = kind, dtype
    self.width, self.cache_dtype = cfg.d_model, dtype
    self.num_heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    self.rope_base, self.top_k = cfg.rope_base, cfg.top_k
    self.block_size, self.skip_threshold = cfg.block_size, cfg.skip_threshold
    self.q = linear(cfg.d_model, cfg.num_heads * cfg.head_dim)
    self.k = linear(cfg.d_model, cfg.kv_heads * cfg.head_dim)
    self.v = linear(cfg.d_model, cfg.kv_heads * cfg.head_dim)
    self.o = linear(cfg.num_heads * cfg.head_dim, cfg.d_model)
    self.mta_kernel = (nnx.Param(js_attention.mta_identity_kernel(
        cfg.num_heads, MTA_QUERY_WIDTH, MTA_KEY_WIDTH))
        if "kernel" in SPARSE_ATTENTION[kind].needs else None)
    name_parameters(self, PARAMETER_NAMES["SparseAttention"])

  def _attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    row = SPARSE_ATTENTION[self.kind]
    needed = {name: NEEDS[name](self, k) for name in row.needs}
    return row.fn(q, k, v, **row.fixed, **needed)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    q = rope(self.q(x).reshape(b, t, self.num_heads, self.head_dim), positions, self.rope_base)
    k = rope(self.k(x).reshape(b, t, self.kv_heads, self.head_dim), positions, self.rope_base)
    v = self.v(x).reshape(b, t, self.kv_heads, self.head_dim)
    # As the normalizer block: the queries keep their shard of the sequence, the keys and
    # values are gathered over it, the heads split over ``tensor`` (no-ops without a mesh).
    q = tsharding.constrain(q, ("act_batch", "act_length", "act_heads", None))
    k, v = (tsharding.constrain(a, ("act_batch", None, "act_kv_heads", None)) for a in (k, v))
    out = self._attend(q, k, v)
    out = tsharding.constrain(out, ("act_batch", "act_length", "act_heads", None))
    return self.o(out.reshape(b, t, self.num_heads * self.head_dim))

class ControlAttention(RecomputedDecoding, js_nn.AttentionControl):
  """An attention-control layer (one of ``config.CONTROL_KINDS``, A49): its row of
  ``train.kinds.CONTROL_ATTENTION`` as :class:`jaxsoft.nn.AttentionControl` over
  ``--seq_len`` positions, the real heads of a hybrid with RoPE; ``random_qk`` draws its
  embeddings from the layer index."""

  def __init__(self, cfg: Config, kind: str, layer_idx: int, *, rngs: nnx.Rngs):
    if kind not in CONTROL_KINDS:
      raise ValueError(f"kind: {kind!r} is not an attention control; one of {CONTROL_KINDS}")
    row = CONTROL_ATTENTION[kind]
    if row.hybrid and cfg.num_heads < 2:
      raise ValueError(f"kind: {kind!r} makes half the heads real attention: it needs "
                       f"--num_heads >= 2, got {cfg.num_heads}")
    dtype = jnp.dtype(cfg.dtype)
    super().__init__(cfg.d_model, cfg.num_heads, cfg.head_dim, control=row.control,
                     max_len=cfg.seq_len, real_heads=cfg.num_heads // 2 if row.hybrid else 0,
                     normalizer=cfg.normalizer, normalizer_params=cfg.normalizer_kwargs,
                     seed=layer_idx, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
    self.kind, self.rope_base = kind, cfg.rope_base
    self.width, self.cache_dtype = cfg.d_model, dtype
    covers = self.scores is not None or self.position_query is not None
    self.max_positions = cfg.seq_len if covers else None
    name_parameters(self, PARAMETER_NAMES["ControlAttention"])

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:  # type: ignore[override]
    q, k = self.real_qk(x)
    if q is not None and k is not None:
      q, k = rope(q, positions, self.rope_base), rope(k, positions, self.rope_base)
    mixed = self.mix(q, k, self.values(x))
    return self.out(mixed.reshape(*mixed.shape[:-2], -1))


class PoNetLayer(_PositionFree, RecomputedDecoding, js_nn.PoNetMixer):
  """PoNet's pooling mixer (``ponet``, A51): :class:`jaxsoft.nn.PoNetMixer` with
  ``causal=True`` (a reconstruction: the paper's model is an encoder), segments of
  ``--block_size`` tokens and a local window of 3."""

  def __init__(self, cfg: Config, kind: str, layer_idx: int, *, rngs: nnx.Rngs):
    if kind not in POOLING_KINDS:
      raise ValueError(f"kind: {kind!r} is not a pooling kind; one of {POOLING_KINDS}")
    del layer_idx
    dtype = jnp.dtype(cfg.dtype)
    super().__init__(cfg.d_model, cfg.num_heads, cfg.head_dim, window=PONET_WINDOW,
                     segment_size=cfg.block_size, causal=True, dtype=dtype,
                     param_dtype=jnp.float32, rngs=rngs)
    self.width, self.cache_dtype = cfg.d_model, dtype
    name_parameters(self, PARAMETER_NAMES["PoNetLayer"])


class FoXProLayer(_PositionFree, RecomputedDecoding, js_nn.FoXProAttention):  # type: ignore[misc]
  """The Forgetting Transformer's Pro block (``fox_pro``, A08):
  :class:`jaxsoft.nn.FoXProAttention` with every part on (forget gate, KV shift, QK-norm,
  output norm, output gate) and no position encoding, as in the paper; decoding by
  recomputation (the mixin's cache)."""

  def __init__(self, cfg: Config, kind: str, layer_idx: int, *, rngs: nnx.Rngs):
    if kind not in FOX_KINDS:
      raise ValueError(f"kind: {kind!r} is not a FoX kind; one of {FOX_KINDS}")
    del layer_idx
    dtype = jnp.dtype(cfg.dtype)
    super().__init__(cfg.num_heads, cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.d_model,
                     num_kv_heads=cfg.kv_heads, use_bias=False, dtype=dtype,
                     param_dtype=jnp.float32, rngs=rngs)
    self.width, self.cache_dtype = cfg.d_model, dtype
    name_parameters(self, PARAMETER_NAMES["FoXProLayer"])


# The layers besides the normalizer block: kind -> builder (cfg, kind, layer_idx, *, rngs).
MIXERS: Mapping[str, Callable[..., nnx.Module]] = {
    **dict.fromkeys(LINEAR_KINDS, LinearMixer),
    **dict.fromkeys(SPARSE_KINDS, SparseAttention),
    **dict.fromkeys(CONTROL_KINDS, ControlAttention),
    **dict.fromkeys(POOLING_KINDS, PoNetLayer),
    **dict.fromkeys(FOX_KINDS, FoXProLayer),
}


def make_mixer(cfg: Config, kind: str, layer_idx: int, *, rngs: nnx.Rngs) -> nnx.Module:
  """The layer of ``kind`` (a key of :data:`MIXERS`, not a normalizer-block variant)."""
  if kind not in MIXERS:
    raise ValueError(f"kind: unknown layer kind {kind!r}; one of "
                     f"{ATTENTION_VARIANTS + tuple(MIXERS)}")
  return MIXERS[kind](cfg, kind, layer_idx, rngs=rngs)


def variant_config(cfg: Config, kind: str) -> Config:
  """``cfg`` with ``attention`` set to the normalizer-block variant ``kind``."""
  return dataclasses.replace(cfg, attention=kind)
