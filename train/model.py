"""A small decoder-only LM (flax.nnx) whose attention is jaxsoft's.

Embeddings -> ``num_layers`` pre-norm blocks (RMSNorm -> attention with RoPE -> residual,
RMSNorm -> GELU MLP -> residual) -> RMSNorm -> tied output projection. Parameters are float32;
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
from flax import nnx

from jaxsoft import attention as js_attention
from jaxsoft import normalizers
from jaxsoft.nn import param_transform
from jaxsoft.normalizers._common import safe_divide
from train.config import Config, attention_normalizer

__all__ = ["Transformer", "make_model", "attention_stats", "rope", "attention_kwargs"]

# Set by train.sharding when the attention implementation is a Pallas kernel: Pallas calls are not
# auto-partitioned, so they run under jax.shard_map over the batch axis.
AttentionWrapper = Callable[[Callable[..., jax.Array]], Callable[..., jax.Array]]


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
  r"""Rotary position embedding (Su et al., 2021) on ``x [B, T, N, H]``.

  Pairs (x_i, x_{i + H/2}) are rotated by the angle ``p · base^{-2i/H}``, so the score
  ``q_p · k_s`` depends only on ``p - s``. Computed in float32.
  """
  half = x.shape[-1] // 2
  freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions[:, :, None, None].astype(jnp.float32) * freqs  # [B, T, 1, H/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
  return out.astype(x.dtype)


def attention_kwargs(cfg: Config) -> dict[str, Any]:
  """The keyword arguments of jaxsoft's dot_product_attention that this config selects."""
  kwargs: dict[str, Any] = dict(is_causal=True, normalizer=attention_normalizer(cfg)[0],
                                implementation=cfg.implementation or None)
  if cfg.attention == "window":
    kwargs["local_window_size"] = (cfg.window, 0)
  elif cfg.attention == "softcap":
    kwargs["logits_soft_cap"] = cfg.softcap
  return kwargs


def _attend(q, k, v, hparams, *, kwargs):
  return js_attention.dot_product_attention(q, k, v, normalizer_params=hparams or None, **kwargs)


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
  """Multi-head (GQA) causal self-attention with RoPE; weights from jaxsoft's normalizer."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs, wrap: AttentionWrapper | None = None):
    linear = functools.partial(nnx.Linear, use_bias=False, dtype=_dtype(cfg),
                               param_dtype=jnp.float32, rngs=rngs)
    self.num_heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    self.rope_base = cfg.rope_base
    self.q = linear(cfg.d_model, cfg.num_heads * cfg.head_dim)
    self.k = linear(cfg.d_model, cfg.kv_heads * cfg.head_dim)
    self.v = linear(cfg.d_model, cfg.kv_heads * cfg.head_dim)
    self.o = linear(cfg.num_heads * cfg.head_dim, cfg.d_model)
    # A07 gated attention: each head's output is scaled by sigma(x W_theta).
    self.gate = linear(cfg.d_model, cfg.num_heads) if cfg.attention == "gated" else None
    self.normalizer, _ = attention_normalizer(cfg)
    self.fixed = dict(cfg.normalizer_kwargs)
    # Learned normalizer hyperparameters, one free value per head (`learned/alpha`, ...).
    free = _initial_free(cfg)
    self.learned = nnx.Dict({name: nnx.Param(jnp.full((cfg.num_heads,), z0, jnp.float32))
                             for name, z0 in free.items()}) if free else None
    attend = functools.partial(_attend, kwargs=attention_kwargs(cfg))
    self.attend = wrap(attend) if wrap is not None else attend

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
    out = self.attend(q, k, v, self.hparams())
    if self.gate is not None:
      out = out * jax.nn.sigmoid(self.gate(x))[..., None].astype(out.dtype)
    return self.o(out.reshape(b, t, self.num_heads * self.head_dim))


class Block(nnx.Module):
  """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs, wrap: AttentionWrapper | None = None,
               attention_factory=None):
    dtype = _dtype(cfg)
    self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
    self.attn = (attention_factory or Attention)(cfg, rngs=rngs, wrap=wrap)
    self.mlp_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
    linear = functools.partial(nnx.Linear, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
    self.up = linear(cfg.d_model, cfg.mlp_dim)
    self.down = linear(cfg.mlp_dim, cfg.d_model)

  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x), positions)
    return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class Transformer(nnx.Module):
  """tokens [B, T] int32 -> logits [B, T, vocab] float32."""

  def __init__(self, cfg: Config, vocab_size: int, *, rngs: nnx.Rngs,
               wrap: AttentionWrapper | None = None, attention_factory=None):
    dtype = _dtype(cfg)
    # std 1/sqrt(d): the tied output layer then starts with unit-scale logits (loss ≈ log vocab).
    self.embed = nnx.Embed(vocab_size, cfg.d_model, dtype=dtype, param_dtype=jnp.float32,
                           embedding_init=nnx.initializers.normal(cfg.d_model ** -0.5), rngs=rngs)
    self.blocks = nnx.List([Block(cfg, rngs=rngs, wrap=wrap, attention_factory=attention_factory)
                            for _ in range(cfg.num_layers)])
    self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, positions)
    # Tied output layer; the logits and the loss are float32 whatever the compute dtype.
    return self.embed.attend(self.final_norm(x)).astype(jnp.float32)


def _dtype(cfg: Config):
  return jnp.dtype(cfg.dtype)


def make_model(cfg: Config, vocab_size: int, seed: int, **kwargs) -> Transformer:
  return Transformer(cfg, vocab_size, rngs=nnx.Rngs(seed), **kwargs)


def attention_stats(model: Transformer, tokens: jax.Array, cfg: Config,
                    layer: int = 0) -> dict[str, jax.Array]:
  """Entropy and sparsity of one layer's attention weights on ``tokens`` (a small slice).

  Recomputes the dense weights ``normalizer(q k^T / sqrt(H), where=mask)`` of ``layer`` (all
  heads) with the registry's reference function, so it is exact for every normalizer and costs
  one layer on a slice. Entropy is that of each row renormalised to sum to one (defined for
  normalizers whose rows need not sum to one), averaged over rows with a visible key;
  ``attn_sparsity`` is the fraction of visible entries that are exactly 0; ``attn_mass`` the mean
  row sum (1 for normalizers that sum to one).
  """
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  x = model.embed(tokens)
  for block in model.blocks[:layer]:
    x = block(x, positions)
  block = model.blocks[layer]
  q, k = block.attn.qk(block.attn_norm(x), positions)
  q, k = q.astype(jnp.float32), k.astype(jnp.float32)
  groups = q.shape[2] // k.shape[2]
  k = jnp.repeat(k, groups, axis=2)
  scores = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
  if cfg.attention == "softcap":
    scores = cfg.softcap * jnp.tanh(scores / cfg.softcap)
  t = tokens.shape[1]
  i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
  mask = j <= i
  if cfg.attention == "window":
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
