"""A small decoder-only LM (flax.nnx) whose attention is jaxsoft's.

Embeddings -> ``num_layers`` pre-norm blocks (RMSNorm -> attention with RoPE -> residual,
RMSNorm -> GELU MLP -> residual) -> RMSNorm -> tied output projection. ``--layers`` makes a
hybrid stack: each block's mixer is this normalizer block or a linear / sparse attention layer of
train.layers (e.g. three Gated DeltaNet layers per softmax layer). Parameters are float32;
``dtype`` sets the compute dtype of every matmul (bf16 mixed precision). The attention
normalizer, variant and implementation come from the config; ``--learned`` names normalizer
hyperparameters learned per head (held free and mapped into their valid range by
``jaxsoft.nn.param_transform``, as ``jaxsoft.nn.MultiHeadAttention`` does). ``attention_stats``
measures the entropy and sparsity of the attention weights of one layer on a slice of a batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxsoft import attention as js_attention
from jaxsoft import losses as js_losses
from jaxsoft import normalizers
from jaxsoft.nn import param_transform
from jaxsoft.normalizers.common import safe_divide
from train import layers
from train import sharding as tsharding
from train.attn_residuals import AttentionResiduals
from train.config import ATTENTION_VARIANTS, Config, attention_normalizer, layer_kinds
from train.positions import rope

__all__ = ["Transformer", "make_model", "attention_stats", "rope", "attention_kwargs"]

# Set by train.sharding when the attention implementation is a Pallas kernel: Pallas calls are not
# auto-partitioned, so they run under jax.shard_map over the batch axis.
AttentionWrapper = Callable[[Callable[..., jax.Array]], Callable[..., jax.Array]]


def _named(init, *names: str | None):
  """``init`` with the Flax NNX logical axis names of its array's dimensions (mapped to mesh
  axes by ``train.sharding.LOGICAL_AXIS_RULES``); not sharded at creation (the train state is
  laid out by its jitted initialiser's out_shardings, and sampling has no mesh)."""
  return nnx.with_partitioning(init, names, eager_sharding=False)


_KERNEL = nnx.initializers.lecun_normal()  # nnx.Linear's default
_ZEROS, _ONES = nnx.initializers.zeros_init(), nnx.initializers.ones_init()


def _rms_norm(cfg: Config, rngs: nnx.Rngs) -> nnx.RMSNorm:
  return nnx.RMSNorm(cfg.d_model, dtype=_dtype(cfg), param_dtype=jnp.float32,
                     scale_init=_named(_ONES, "norm"), rngs=rngs)


def attention_kwargs(cfg: Config) -> dict[str, Any]:
  """The keyword arguments of jaxsoft's dot_product_attention that this config selects."""
  kwargs: dict[str, Any] = dict(is_causal=True, normalizer=attention_normalizer(cfg)[0],
                                implementation=cfg.implementation or None)
  if cfg.attention == "window":
    kwargs["local_window_size"] = (cfg.window, 0)
  elif cfg.attention == "softcap":
    kwargs["logits_soft_cap"] = cfg.softcap
  return kwargs


def _attend(q, k, v, hparams, *, kwargs, call=js_attention.dot_product_attention):
  """``call`` (dot_product_attention, or train.sharding's context-parallel attention) with the
  block's hyperparameters."""
  return call(q, k, v, normalizer_params=hparams or None, **kwargs)


def _attend_cached(q, keys, values, position, hparams, *, kwargs):
  """The query ``q [B, 1, N, H]`` at ``position`` against the cached ``keys``, ``values``
  ``[B, max_len, kv_heads, H]``: the keys ``<= position`` are visible (and ``>= position -
  window`` for the window variant), with the block's normalizer."""
  j = jnp.arange(keys.shape[1])
  visible = j <= position
  kwargs = dict(kwargs)
  window = kwargs.pop("local_window_size", None)
  if window is not None:
    visible &= j >= position - window[0]
  kwargs.update(is_causal=False, implementation="xla")
  return js_attention.dot_product_attention(
      q, keys.astype(q.dtype), values.astype(q.dtype), mask=visible[None, None, None, :],
      normalizer_params=hparams or None, **kwargs)


def _initial_free(cfg: Config) -> dict[str, float]:
  """The free (unconstrained) starting value of each learned hyperparameter: its default mapped
  back through ``param_transform``."""
  normalizer, names = attention_normalizer(cfg)
  spec = normalizers.get(normalizer)
  out = {}
  with jax.ensure_compile_time_eval():  # concrete even when the model is built under eval_shape
    for name in names:
      param = spec.param(name)
      start = param.default if param.default is not None else param.sample
      out[name] = float(param_transform(param)[1](float(start)))
  return out


class Attention(nnx.Module):
  """Multi-head (GQA) causal self-attention with RoPE; weights from jaxsoft's normalizer.

  Decodes with a KV cache: :meth:`init_cache` and :meth:`step`, the interface of the mixers
  of train.layers.
  """

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs, wrap: AttentionWrapper | None = None):
    linear = functools.partial(nnx.Linear, use_bias=False, dtype=_dtype(cfg),
                               param_dtype=jnp.float32, rngs=rngs)
    self.num_heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    self.rope_base = cfg.rope_base
    # Megatron layout: Q, K, V column-parallel (split by head), O row-parallel.
    self.q = linear(cfg.d_model, cfg.num_heads * cfg.head_dim,
                    kernel_init=_named(_KERNEL, "embed", "heads"))
    self.k = linear(cfg.d_model, cfg.kv_heads * cfg.head_dim,
                    kernel_init=_named(_KERNEL, "embed", "kv_heads"))
    self.v = linear(cfg.d_model, cfg.kv_heads * cfg.head_dim,
                    kernel_init=_named(_KERNEL, "embed", "kv_heads"))
    self.o = linear(cfg.num_heads * cfg.head_dim, cfg.d_model,
                    kernel_init=_named(_KERNEL, "heads", "embed"))
    # A07 gated attention: each head's output is scaled by sigma(x W_theta).
    self.gate = linear(cfg.d_model, cfg.num_heads) if cfg.attention == "gated" else None
    self.normalizer, _ = attention_normalizer(cfg)
    self.fixed = dict(cfg.normalizer_kwargs)
    # Learned normalizer hyperparameters, one free value per head (`learned/alpha`, ...).
    free = _initial_free(cfg)
    self.learned = nnx.Dict({name: nnx.Param(jnp.full((cfg.num_heads,), z0, jnp.float32))
                             for name, z0 in free.items()}) if free else None
    kwargs = attention_kwargs(cfg)
    attend = functools.partial(_attend, kwargs=kwargs)
    self.attend = wrap(attend) if wrap is not None else attend
    # K/V gathered over context by constraints, unless a context-parallel attention does it.
    self.kv_length = "act_length" if getattr(wrap, "context_parallel", False) else None
    self.attend_cached = functools.partial(_attend_cached, kwargs=kwargs)

  def learned_values(self) -> dict[str, jax.Array]:
    """The learned hyperparameters in their valid range, ``{name: [num_heads]}``."""
    if self.learned is None:
      return {}
    spec = normalizers.get(self.normalizer)
    return {name: param_transform(spec.param(name))[0](z[...])
            for name, z in self.learned.items()}

  def hparams(self) -> dict[str, Any]:
    """The normalizer's hyperparameters: the fixed ones, then the learned ones ``[N, 1, 1]``."""
    learned = {k: v.reshape(-1, 1, 1) for k, v in self.learned_values().items()}
    return {**self.fixed, **learned}

  def qk(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    b, t, _ = x.shape
    q = self.q(x).reshape(b, t, self.num_heads, self.head_dim)
    k = self.k(x).reshape(b, t, self.kv_heads, self.head_dim)
    return rope(q, positions, self.rope_base), rope(k, positions, self.rope_base)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    b, t, _ = x.shape
    q, k = self.qk(x, positions)
    v = self.v(x).reshape(b, t, self.kv_heads, self.head_dim)
    # Exact under context parallelism: the queries keep their positions' shard, the keys and
    # values are gathered over the sequence (GSPMD all-gathers them along ``context``; or
    # they stay sharded for jaxsoft's context_parallel_attention, which gathers them itself).
    q = tsharding.constrain(q, ("act_batch", "act_length", "act_heads", None))
    k, v = (tsharding.constrain(a, ("act_batch", self.kv_length, "act_kv_heads", None))
            for a in (k, v))
    out = self.attend(q, k, v, self.hparams())
    out = tsharding.constrain(out, ("act_batch", "act_length", "act_heads", None))
    return self._output(out, x)

  def _output(self, out: jax.Array, x: jax.Array) -> jax.Array:
    """The gated (A07) heads ``out [B, T, N, H]`` through the output projection."""
    if self.gate is not None:
      out = out * jax.nn.sigmoid(self.gate(x))[..., None].astype(out.dtype)
    b, t = out.shape[:2]
    return self.o(out.reshape(b, t, self.num_heads * self.head_dim))

  def init_cache(self, batch: int, max_len: int) -> dict[str, Any]:
    """Zero key and value buffers ``[B, max_len, kv_heads, head_dim]``."""
    dtype = self.k.dtype or jnp.float32
    shape = (batch, max_len, self.kv_heads, self.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

  def step(self, x: jax.Array, position: jax.Array, cache: dict[str, Any]
           ) -> tuple[jax.Array, dict[str, Any]]:
    """One token ``x [B, 1, d]`` at ``position``: its key and value written into the cache at
    ``position``, its query attending to the cached keys it may see -> (``[B, 1, d]``, the
    cache)."""
    b = x.shape[0]
    positions = jnp.full((b, 1), position)
    q, k = self.qk(x, positions)
    v = self.v(x).reshape(b, 1, self.kv_heads, self.head_dim)
    keys = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), position,
                                               1)
    values = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype),
                                                 position, 1)
    out = self.attend_cached(q, keys, values, position, self.hparams())
    return self._output(out, x), {"k": keys, "v": values}


class Block(nnx.Module):
  """Pre-norm decoder block: x + mix(norm(x)), then x + mlp(norm(x)).

  The mixer is the normalizer block :class:`Attention` for the variants ``full``, ``window``,
  ``softcap``, ``gated``, else the linear or sparse layer of ``kind`` (train.layers).
  """

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs, wrap: AttentionWrapper | None = None,
               attention_factory=None, kind: str | None = None, layer_idx: int = 0):
    dtype = _dtype(cfg)
    self.kind = kind = kind or cfg.attention
    self.attn_norm = _rms_norm(cfg, rngs)
    self.attn: Any
    if kind in ATTENTION_VARIANTS:
      self.attn = (attention_factory or Attention)(layers.variant_config(cfg, kind), rngs=rngs,
                                                   wrap=wrap)
    else:
      self.attn = layers.make_mixer(cfg, kind, layer_idx, rngs=rngs)
    self.mlp_norm = _rms_norm(cfg, rngs)
    linear = functools.partial(nnx.Linear, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
    # Megatron layout: up column-parallel (its bias split with it), down row-parallel.
    self.up = linear(cfg.d_model, cfg.mlp_dim, kernel_init=_named(_KERNEL, "embed", "mlp"),
                     bias_init=_named(_ZEROS, "mlp"))
    self.down = linear(cfg.mlp_dim, cfg.d_model, kernel_init=_named(_KERNEL, "mlp", "embed"),
                       bias_init=_named(_ZEROS, None))

  def _mlp(self, x: jax.Array) -> jax.Array:
    return x + self.mlp_delta(x)

  def mlp_delta(self, x: jax.Array) -> jax.Array:
    """The MLP sublayer's output (what it adds to the residual stream)."""
    hidden = jax.nn.gelu(self.up(self.mlp_norm(x)))
    hidden = tsharding.constrain(hidden, ("act_batch", "act_length", "act_mlp"))
    return self.down(hidden)

  def sublayers(self, positions: jax.Array) -> list[Callable[[jax.Array], jax.Array]]:
    """The attention and MLP sublayers as input -> output (``--attention_residual_blocks``)."""
    return [lambda h: self.attn(self.attn_norm(h), positions), self.mlp_delta]

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    return self._mlp(x + self.attn(self.attn_norm(x), positions))

  def init_cache(self, batch: int, max_len: int) -> Any:
    return self.attn.init_cache(batch, max_len)

  def step(self, x: jax.Array, position: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
    """One token ``x [B, 1, d]`` at ``position`` with this block's decoding cache."""
    out, cache = self.attn.step(self.attn_norm(x), position, cache)
    return self._mlp(x + out), cache


class Transformer(nnx.Module):
  """tokens [B, T] int32 -> logits [B, T, vocab] float32.

  ``hidden`` gives the final (normalised) hidden states and ``output_matrix`` the ``[d, vocab]``
  output layer (the tied embedding, or its own matrix with ``--tie_embeddings false``);
  ``token_losses`` is the per-token cross-entropy, by default ``jaxsoft.losses.
  linear_cross_entropy`` of the two (``--loss linear_ce``: the ``[tokens, vocab]`` logits are
  never materialised) or of the materialised logits (``--loss dense``). ``init_cache`` and
  ``decode_step`` generate one token at a time (KV caches for the normalizer blocks, recurrent
  states for the linear layers).
  """

  def __init__(self, cfg: Config, vocab_size: int, *, rngs: nnx.Rngs,
               wrap: AttentionWrapper | None = None, attention_factory=None):
    dtype = _dtype(cfg)
    self.cfg = cfg  # static (a frozen dataclass)
    # std 1/sqrt(d): the tied output layer then starts with unit-scale logits (loss ≈ log vocab).
    self.embed = nnx.Embed(vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                           embedding_init=_named(nnx.initializers.normal(cfg.d_model ** -0.5),
                                                 "vocab", "embed"), rngs=rngs)
    self.blocks = nnx.List([Block(cfg, rngs=rngs, wrap=wrap, attention_factory=attention_factory,
                                  kind=kind, layer_idx=i)
                            for i, kind in enumerate(layer_kinds(cfg))])
    self.final_norm = _rms_norm(cfg, rngs)
    self.unembed = None if cfg.tie_embeddings else nnx.Param(
        _named(nnx.initializers.normal(cfg.d_model ** -0.5), "embed", "vocab")(
            rngs.params(), (cfg.d_model, vocab_size), jnp.float32))
    self.chunked_loss = cfg.loss == "linear_ce"
    # Block Attention Residuals (train.attn_residuals): the stream as softmax mixtures
    self.residuals = AttentionResiduals(
        cfg.d_model, 2 * len(self.blocks), cfg.attention_residual_blocks,
        rngs=rngs) if cfg.attention_residual_blocks else None

  def hidden(self, tokens: jax.Array) -> jax.Array:
    """The final normalised hidden states ``[B, T, d]`` (compute dtype)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = self.embed(tokens)
    if self.residuals is not None:
      return self.final_norm(self.residuals(x, self._sublayers(positions)))
    for block in self.blocks:
      x = tsharding.constrain(x, ("act_batch", "act_length", "act_embed"))
      x = block(x, positions)
    return self.final_norm(x)

  def _sublayers(self, positions: jax.Array) -> list[Callable[[jax.Array], jax.Array]]:
    constrain = functools.partial(tsharding.constrain,
                                  names=("act_batch", "act_length", "act_embed"))
    return [lambda h, f=f: f(constrain(h)) for b in self.blocks for f in b.sublayers(positions)]

  def output_matrix(self) -> jax.Array:
    """The output layer ``[d, vocab]`` (float32 parameters)."""
    if self.unembed is None:
      return self.embed.embedding[...].T
    return self.unembed[...]

  def logits(self, h: jax.Array) -> jax.Array:
    """Logits of hidden states ``h [..., d]``, float32 whatever the compute dtype."""
    if self.unembed is None:
      return self.embed.attend(h).astype(jnp.float32)
    return jnp.dot(h, self.unembed[...].astype(h.dtype)).astype(jnp.float32)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return self.logits(self.hidden(tokens))

  def token_losses(self, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Cross-entropy of each next-token target ``[B, T]`` (float32)."""
    h = self.hidden(inputs)
    if self.chunked_loss:
      return js_losses.linear_cross_entropy(h.astype(jnp.float32), self.output_matrix(), targets)
    # (vocab-parallel under a mesh: the logits split over ``tensor`` by vocabulary entry)
    logits = tsharding.constrain(self.logits(h), ("act_batch", "act_length", "act_vocab"))
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)

  def init_cache(self, batch: int, max_len: int) -> list[Any]:
    """Every block's empty decoding cache for sequences of up to ``max_len`` tokens."""
    return [block.init_cache(batch, max_len) for block in self.blocks]

  def decode_step(self, tokens: jax.Array, position: jax.Array, cache: list[Any]
                  ) -> tuple[jax.Array, list[Any]]:
    """``tokens [B]`` at ``position`` (a scalar) -> (logits ``[B, vocab]`` float32, cache)."""
    x = self.embed(tokens[:, None])
    if self.residuals is not None:
      caches = list(cache)

      def attn_step(h, i):
        out, caches[i] = self.blocks[i].attn.step(self.blocks[i].attn_norm(h), position,
                                                  caches[i])
        return out

      fns = [f for i, b in enumerate(self.blocks)
             for f in (functools.partial(attn_step, i=i), b.mlp_delta)]
      return self.logits(self.final_norm(self.residuals(x, fns)))[:, 0], caches
    new_cache = []
    for block, block_cache in zip(self.blocks, cache, strict=True):
      x, block_cache = block.step(x, position, block_cache)
      new_cache.append(block_cache)
    return self.logits(self.final_norm(x))[:, 0], new_cache


def _dtype(cfg: Config):
  return jnp.dtype(cfg.dtype)


def make_model(cfg: Config, vocab_size: int, seed: int, **kwargs) -> Transformer:
  return Transformer(cfg, vocab_size, rngs=nnx.Rngs(seed), **kwargs)


def attention_stats(model: Transformer, tokens: jax.Array, cfg: Config,
                    layer: int | None = None) -> dict[str, jax.Array]:
  """Entropy and sparsity of one layer's attention weights on ``tokens`` (a small slice).

  Recomputes the dense weights ``normalizer(q k^T / sqrt(H), where=mask)`` of ``layer`` (all
  heads; default: the first normalizer block, ``{}`` when the stack has none) with the
  registry's reference function, so it is exact for every normalizer and costs
  one layer on a slice. Entropy is that of each row renormalised to sum to one (defined for
  normalizers whose rows need not sum to one), averaged over rows with a visible key;
  ``attn_sparsity`` is the fraction of visible entries that are exactly 0; ``attn_mass`` the mean
  row sum (1 for normalizers that sum to one).
  """
  if layer is None:
    layer = next((i for i, b in enumerate(model.blocks) if b.kind in ATTENTION_VARIANTS), -1)
    if layer < 0:
      return {}
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  x = model.embed(tokens)
  if model.residuals is not None:  # the layer's input through the residual mixtures
    x = model.residuals(x, model._sublayers(positions), stop=2 * layer)
  else:
    for block in model.blocks[:layer]:
      x = block(x, positions)
  block = model.blocks[layer]
  if block.kind not in ATTENTION_VARIANTS:
    raise ValueError(f"layer: block {layer} is a {block.kind!r} layer, not a normalizer block")
  variant = block.kind
  q, k = block.attn.qk(block.attn_norm(x), positions)
  q, k = q.astype(jnp.float32), k.astype(jnp.float32)
  groups = q.shape[2] // k.shape[2]
  k = jnp.repeat(k, groups, axis=2)
  scores = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
  if variant == "softcap":
    scores = cfg.softcap * jnp.tanh(scores / cfg.softcap)
  t = tokens.shape[1]
  i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
  mask = j <= i
  if variant == "window":
    mask &= j >= i - cfg.window
  mask = jnp.broadcast_to(mask, scores.shape)
  w = normalizers.get(block.attn.normalizer).fn(scores, axis=-1, where=mask,
                                                **block.attn.hparams())
  mass = jnp.sum(w, axis=-1, keepdims=True)
  p = safe_divide(w, mass)
  entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
  visible = jnp.sum(mask)
  return {
      "attn_entropy": jnp.mean(entropy),
      "attn_sparsity": jnp.sum((w == 0) & mask) / visible,
      "attn_mass": jnp.mean(mass),
  }
