"""The layer kinds of a hybrid stack, derived from two tables.

* the normalizer block's variants :data:`ATTENTION_VARIANTS` (``train.model.Attention``);
* the linear mixers: every causal row of ``jaxsoft.nn.LINEAR_MIXER_TABLE``
  (:data:`LINEAR_KINDS`; ``linear`` once per feature map, ``linear:<map>``); the
  bidirectional rows cannot be a layer of this causal LM (:data:`BIDIRECTIONAL_KINDS`, with
  the reason);
* the sparse / structured self-attentions of ``jaxsoft.attention``: this module's table
  :data:`SPARSE_ATTENTION` (``name -> SparseKind``), whose keys are :data:`SPARSE_KINDS`;
* the attention controls (A49, ``jaxsoft.nn.AttentionControl``): :data:`CONTROL_ATTENTION`
  (``name -> ControlKind``), whose keys are :data:`CONTROL_KINDS`: each control alone and as
  ``hybrid:<control>``, half the heads real attention;
* the pooling mixers: :data:`POOLING_KINDS` (``ponet``, ``jaxsoft.nn.PoNetMixer``'s causal
  reconstruction).

:data:`LAYER_KINDS` (the values ``--attention`` and ``--layers`` take) is their union, in
that order. A new linear layer is a row of ``jaxsoft.nn.LINEAR_MIXER_TABLE``, a new sparse
attention a row of :data:`SPARSE_ATTENTION`, a new control a row of :data:`CONTROLS`: each
reaches the command line from there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxsoft import attention as js_attention
from jaxsoft import nn as js_nn

__all__ = ["ATTENTION_VARIANTS", "FEATURE_MAP_KINDS", "linear_kinds", "bidirectional_kinds",
           "LINEAR_KINDS", "BIDIRECTIONAL_KINDS", "SparseKind", "SPARSE_ATTENTION",
           "SPARSE_KINDS", "LAYER_KINDS", "INFSA_GAMMA", "CONTROLS", "ControlKind",
           "CONTROL_ATTENTION", "CONTROL_KINDS", "POOLING_KINDS", "PONET_WINDOW", "FOX_KINDS",
           "HYBRID_GATE_CHANNELS", "token_hybrid", "hybrid_layers"]

ATTENTION_VARIANTS = ("full", "window", "softcap", "gated")
# The linear kinds named once per feature map on the command line (`linear:elu1`, ...).
FEATURE_MAP_KINDS = ("linear",)
INFSA_GAMMA = 0.5  # the discount of infsa_attention's walks (normalised: gamma = 0 is softmax)


def linear_kinds(table: Mapping[str, js_nn.LinearKind]) -> tuple[str, ...]:
  """The layer kinds of ``table``'s rows with a causal form, in the table's order; a kind of
  :data:`FEATURE_MAP_KINDS` once per feature map it accepts (``name:map``)."""
  kinds: list[str] = []
  for name, row in table.items():
    if row.direction == "bidirectional":
      continue
    kinds += ([f"{name}:{feature_map}" for feature_map in row.feature_maps]
              if name in FEATURE_MAP_KINDS else [name])
  return tuple(kinds)


def bidirectional_kinds(table: Mapping[str, js_nn.LinearKind]) -> dict[str, str]:
  """``{kind: why it cannot be a layer here}`` for ``table``'s rows with no causal form."""
  return {name: f"{row.title} is bidirectional: {row.why_bidirectional}, so a position would "
                "see the future; it has no causal form for this causal LM"
          for name, row in table.items() if row.direction == "bidirectional"}


LINEAR_KINDS = linear_kinds(js_nn.LINEAR_MIXER_TABLE)
# jaxsoft.nn.LinearMixer kinds that exist but cannot be a layer of this causal LM, and why.
BIDIRECTIONAL_KINDS = bidirectional_kinds(js_nn.LINEAR_MIXER_TABLE)


@dataclasses.dataclass(frozen=True)
class SparseKind:
  """A sparse / structured self-attention layer: ``fn(q, k, v, **fixed, **needed)``.

  ``needs`` names the keywords the layer fills from the config (``train.layers.NEEDS``:
  ``top_k``, ``top_k_blocks``, ``block_size``, ``skip_threshold``, and ``kernel``, a learned
  Multi-Token Attention kernel the layer then owns); ``fixed`` the constant ones.
  """

  fn: Callable[..., Any]
  needs: tuple[str, ...] = ()
  fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)


_CAUSAL = {"is_causal": True}
# The value channels a token-level hybrid layer reads its route, write strength and decay from.
HYBRID_GATE_CHANNELS = 3


def token_hybrid(fn: Callable[..., Any], q: Any, k: Any, v: Any) -> Any:
  r"""A token-level hybrid (``jaxsoft.attention.nats_attention`` or ``oryx_attention``) as a
  self-attention layer ``(q, k, v) -> o`` with no parameters of its own.

  The last :data:`HYBRID_GATE_CHANNELS` channels of each value head are the per-token
  route logit z, write logit b and decay logit a, linear maps of the token as a separate
  router would be (the value projection has no RoPE); the other channels are the values:

  .. math::
    r = \mathrm{ST}(z), \quad \beta = \sigma(b), \quad g = \log\sigma(a) / 16

  (the straight-through route of ``jaxsoft.attention.straight_through_route``, GLA's slow
  decay at initialisation). Grouped keys and values are repeated to the query heads, and the
  output is padded back to the head width with zeros.
  """
  c = HYBRID_GATE_CHANNELS
  if v.shape[-1] <= c:
    raise ValueError(f"a token-level hybrid layer reads {c} gates from each value head: it "
                     f"needs a head width > {c}, got {v.shape[-1]}")
  rep = q.shape[2] // k.shape[2]
  if rep > 1:
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  gates = v[..., -c:].astype(jnp.float32)
  out = fn(q, k, v[..., :-c], jax.nn.log_sigmoid(gates[..., 2]) / 16.0,
           jax.nn.sigmoid(gates[..., 1]), js_attention.straight_through_route(gates[..., 0]))
  return jnp.pad(out, [(0, 0)] * 3 + [(0, c)])


def hybrid_layers(linear: str = "gla", anchor: str = "gated", ratio: int = 3) -> str:
  """The ``--layers`` value of a linear:softmax hybrid: ``ratio`` layers of ``linear`` then
  one gated-softmax anchor (``anchor``), e.g. SANA-Video 2.0's 3:1 stack of GLA layers and
  softmax layers with a sigmoid output gate (``--attention gated``); repeated to
  ``--num_layers``.

  Examples:
    >>> hybrid_layers()
    'gla,gla,gla,gated'
  """
  if ratio < 0:
    raise ValueError(f"hybrid_layers: `ratio` must be >= 0, got {ratio}")
  for name, kind in (("linear", linear), ("anchor", anchor)):
    if kind not in LAYER_KINDS:
      raise ValueError(f"hybrid_layers: `{name}` {kind!r} is not a layer kind")
  return ",".join([linear] * ratio + [anchor])

SPARSE_ATTENTION: Mapping[str, SparseKind] = {
    "topk_attention": SparseKind(js_attention.topk_attention, ("top_k",), _CAUSAL),
    **{f"block_sparse_attention:{method}": SparseKind(
        js_attention.block_sparse_attention, ("block_size", need),
        {"method": method, **_CAUSAL})
       for method, need in (("blasst", "skip_threshold"), ("moba", "top_k_blocks"),
                            ("bfla", "top_k_blocks"), ("prism", "top_k_blocks"))},
    # a learned per-head kernel of 3 query rows x 5 keys started at the identity
    "multi_token_attention": SparseKind(js_attention.multi_token_attention, ("kernel",),
                                        _CAUSAL),
    "lucid_attention": SparseKind(js_attention.lucid_attention),
    # A19: unit q, k and the N38 screen at its defaults
    "multiscreen_attention": SparseKind(js_attention.multiscreen_attention, (), _CAUSAL),
    # A25: the normalised Neumann kernel, gamma = 1/2
    "infsa_attention": SparseKind(js_attention.infsa_attention, (),
                                  {"gamma": INFSA_GAMMA, "normalize": True, **_CAUSAL}),
    # A46: token-level hybrids of softmax attention and Gated DeltaNet in one layer, their
    # route, write strength and decay read from the value projection (token_hybrid)
    "nats_attention": SparseKind(lambda q, k, v: token_hybrid(js_attention.nats_attention,
                                                              q, k, v)),
    "oryx_attention": SparseKind(lambda q, k, v: token_hybrid(js_attention.oryx_attention,
                                                              q, k, v)),
}
SPARSE_KINDS = tuple(SPARSE_ATTENTION)


@dataclasses.dataclass(frozen=True)
class ControlKind:
  """An attention-control layer (A49): ``jaxsoft.nn.AttentionControl`` with ``control`` (a
  key of ``jaxsoft.nn.ATTENTION_CONTROLS``) on every head, or with ``hybrid`` on the second
  half of the heads, the first ``num_heads // 2`` real attention (RoPE, the config's
  normalizer)."""

  control: str
  hybrid: bool = False


# The layer kind of each jaxsoft.nn.ATTENTION_CONTROLS control (the paper's principles: no
# mixing; sequence-independent maps, fixed or learned; Q/K from position embeddings).
CONTROLS: Mapping[str, str] = {
    "no_mixing": "none",
    "uniform_mixing": "uniform",
    "fixed_map": "fixed",
    "static_qk": "static_qk",
    "random_qk": "random_qk",
}
CONTROL_ATTENTION: Mapping[str, ControlKind] = {
    **{name: ControlKind(control) for name, control in CONTROLS.items()},
    **{f"hybrid:{name}": ControlKind(control, hybrid=True)
       for name, control in CONTROLS.items()},
}
CONTROL_KINDS = tuple(CONTROL_ATTENTION)
# PoNet (A51) with causal=True: the paper's model is an encoder (its global and segment
# pools see the whole sequence); jaxsoft.attention.ponet_mix's causal reconstruction pools
# only j <= i (running mean query, running segment max, the window ending at i).
POOLING_KINDS = ("ponet",)
PONET_WINDOW = 3  # the local max-pooling window of the authors' code
# The Forgetting Transformer's Pro block (A08, jaxsoft.nn.FoXProAttention): forgetting
# attention with the KV shift, QK-norm, output norm and output gate (no position encoding).
FOX_KINDS = ("fox_pro",)
LAYER_KINDS = (ATTENTION_VARIANTS + LINEAR_KINDS + SPARSE_KINDS + CONTROL_KINDS
               + POOLING_KINDS + FOX_KINDS)
