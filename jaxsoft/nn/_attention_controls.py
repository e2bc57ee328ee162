"""Attention controls (feature A49) as a Flax NNX layer, with hybrids of real attention heads.

The computations are ``jaxsoft.attention``'s :func:`~jaxsoft.attention.no_mixing_attention`,
:func:`~jaxsoft.attention.fixed_map_attention` and
:func:`~jaxsoft.attention.embedding_qk_attention`; this module holds their parameters (the
learned map, the position embeddings and their Q/K projections) and the projections of the
values, of the real heads' queries and keys, and of the output.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import ArrayLike

from jaxsoft._validation import head_layout, positive_int
from jaxsoft.attention import (
    dot_product_attention,
    embedding_qk_attention,
    fixed_map_attention,
    no_mixing_attention,
)

__all__ = ["AttentionControl", "ATTENTION_CONTROLS"]

# control -> what replaces attention's map on the control heads
ATTENTION_CONTROLS: Mapping[str, str] = {
    "none": "no token mixing: each position's output is its own value",
    "uniform": "the uniform average over the visible positions (softmax of zero scores)",
    "fixed": "a learned sequence-independent [T, T] score map per head, started at zero "
             "(the uniform average), through the normalizer",
    "static_qk": "queries and keys from learned position embeddings, values from the tokens",
    "random_qk": "queries and keys from fixed random position embeddings (drawn from "
                 "`seed`, never trained), values from the tokens",
}
_POSITIONAL = ("fixed", "static_qk", "random_qk")


class AttentionControl(nnx.Module):
  r"""A self-attention layer whose token mixing is a control (A49), or a hybrid with real heads.

  The first ``real_heads`` R of the N heads are real attention; the other N - R heads are
  the ``control``:

  .. math::
    V = x W_V, \quad o^{\text{real}} = \mathrm{attn}_f(x W_Q, x W_K, V_{:R}), \quad
    o^{\text{ctl}} = \begin{cases}
      V_{R:} & \text{none} \\
      \mathrm{fixed\_map}(0, V_{R:}) & \text{uniform} \\
      \mathrm{fixed\_map}(S, V_{R:}) & \text{fixed} \\
      \mathrm{embedding\_qk}(P W_{\tilde Q}, P W_{\tilde K}, V_{R:}) & \text{static\_qk,
      random\_qk}
    \end{cases}

    y = [o^{\text{real}}; o^{\text{ctl}}]\, W_O

  with S a learned ``[N - R, L, L]`` score map (started at 0: the uniform average), P the
  ``[L, E]`` position embeddings (learned for ``static_qk``; for ``random_qk`` standard
  normal draws from ``jax.random.key(seed)``, recomputed at each call and never a
  parameter), L = ``max_len``, f the ``normalizer`` (every path but ``none`` and
  ``uniform``, which is always the plain average). The control heads' weights do not
  depend on the input (except ``none``, which has none). With R = 0 it is the pure
  control; R = N is ordinary attention. Queries and keys carry no position encoding here:
  a caller adds one by transforming :meth:`real_qk`'s output before :meth:`mix` (train/
  applies RoPE). Reconstructions [R] of the paper's variants: their exact definitions
  are not in its abstract.

  Args:
    d_model: the width ``d`` of ``x``.
    num_heads: N.
    head_dim: H (default ``d_model // num_heads``).
    control: a key of ``ATTENTION_CONTROLS``: ``"none"``, ``"uniform"``, ``"fixed"``,
      ``"static_qk"`` or ``"random_qk"``.
    max_len: L, the longest sequence (needed by ``fixed``, ``static_qk``, ``random_qk``).
    real_heads: R in [0, N], the heads that are real attention.
    causal: causal masks on every path.
    normalizer: the normalizer of the real heads and of ``fixed`` / ``static_qk`` /
      ``random_qk`` (a registered name, a NormalizerSpec or a callable).
    normalizer_params: its fixed hyperparameters.
    embed_dim: E, the width of the position embeddings (default ``d_model``).
    seed: the key of ``random_qk``'s embeddings.
    use_bias: biases on the projections.
    dtype: the computation dtype of the projections.
    param_dtype: the dtype of the parameters.
    rngs: the parameters' random streams.

  Returns:
    Called on ``x [..., T, d]`` (T <= ``max_len``): ``[..., T, d]``.

  Examples:
    >>> layer = js.nn.AttentionControl(8, 2, control="fixed", max_len=6, real_heads=1,
    ...                                rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.key(0), (2, 6, 8))
    >>> apply = nnx.jit(lambda layer, x: layer(x))
    >>> y = apply(layer, x)
    >>> y.shape, layer.scores.shape                # one learned 6 x 6 map for the control head
    ((2, 6, 8), (1, 6, 6))
    >>> x2 = x.at[:, 4].set(10.0)                  # causal: the future does not leak
    >>> bool(jnp.allclose(apply(layer, x2)[:, :4], y[:, :4]))
    True

  References:
    H. Xue, N. S. Moosavi & N. Aletras, 2025, "Deconstructing Attention: Investigating
    Design Principles for Effective Language Modeling" (arXiv 2510.11602).
  """

  def __init__(self, d_model: int, num_heads: int, head_dim: int | None = None, *,
               control: str, max_len: int | None = None, real_heads: int = 0,
               causal: bool = True, normalizer: str | Callable[..., Any] = "softmax",
               normalizer_params: Mapping[str, Any] | None = None,
               embed_dim: int | None = None, seed: int = 0, use_bias: bool = False,
               dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
               rngs: nnx.Rngs) -> None:
    name = type(self).__name__
    d, n, h = head_layout(d_model, num_heads, head_dim, name)
    if control not in ATTENTION_CONTROLS:
      raise ValueError(f"{name}: `control` must be one of {tuple(ATTENTION_CONTROLS)}, got "
                       f"{control!r}")
    if isinstance(real_heads, bool) or not isinstance(real_heads, int) or not (
        0 <= real_heads <= n):
      raise ValueError(f"{name}: `real_heads` must be an int in [0, {n}], got {real_heads!r}")
    if not isinstance(causal, bool):
      raise ValueError(f"{name}: `causal` must be a bool, got {causal!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
      raise ValueError(f"{name}: `seed` must be an int, got {seed!r}")
    positional = control in _POSITIONAL and real_heads < n
    if positional and max_len is None:
      raise ValueError(f"{name}: control {control!r} needs `max_len` (its map or embeddings "
                       "cover that many positions)")
    self.max_len: int | None = None if max_len is None else positive_int(max_len, "max_len",
                                                                         name)
    e = d if embed_dim is None else positive_int(embed_dim, "embed_dim", name)
    self.control: str = control
    self.num_heads: int = n
    self.head_dim: int = h
    self.real_heads: int = real_heads
    self.causal: bool = causal
    self.normalizer: Any = normalizer
    self.normalizer_params: dict[str, Any] = dict(normalizer_params or {})
    self.seed: int = seed
    self.embed_dim: int = e
    ctl = n - real_heads
    linear = functools.partial(nnx.Linear, use_bias=use_bias, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)
    self.value: nnx.Linear = linear(d, n * h)
    self.out: nnx.Linear = linear(n * h, d)
    self.query: nnx.Linear | None = linear(d, real_heads * h) if real_heads else None
    self.key: nnx.Linear | None = linear(d, real_heads * h) if real_heads else None
    scores = positions = position_query = position_key = None
    if positional:
      assert self.max_len is not None
      if control == "fixed":
        scores = nnx.Param(jnp.zeros((ctl, self.max_len, self.max_len), param_dtype))
      else:
        position_query, position_key = linear(e, ctl * h), linear(e, ctl * h)
        if control == "static_qk":
          positions = nnx.Param(jax.random.normal(rngs.params(), (self.max_len, e),
                                                  param_dtype))
    self.scores: nnx.Param | None = scores
    self.positions: nnx.Param | None = positions
    self.position_query: nnx.Linear | None = position_query
    self.position_key: nnx.Linear | None = position_key

  def values(self, x: jax.Array) -> jax.Array:
    """The values of every head, ``[..., T, N, H]``."""
    return self._heads(self.value(x), self.num_heads)

  def real_qk(self, x: jax.Array) -> tuple[jax.Array | None, jax.Array | None]:
    """The real heads' queries and keys ``[..., T, R, H]`` (None, None when R = 0)."""
    if self.query is None or self.key is None:
      return None, None
    return (self._heads(self.query(x), self.real_heads),
            self._heads(self.key(x), self.real_heads))

  def position_embeddings(self, length: int) -> jax.Array:
    """P ``[length, E]`` of ``static_qk`` (learned) or ``random_qk`` (drawn from ``seed``)."""
    if self.positions is not None:
      return self.positions[...][:length]
    assert self.max_len is not None
    return jax.random.normal(jax.random.key(self.seed), (self.max_len, self.embed_dim),
                             jnp.float32)[:length]

  def mix(self, q: jax.Array | None, k: jax.Array | None, v: jax.Array) -> jax.Array:
    """Real attention of ``q``, ``k`` on the first R heads of ``v [..., T, N, H]``, the
    control on the rest -> ``[..., T, N, H]``."""
    t = v.shape[-3]
    if self.max_len is not None and self.control in _POSITIONAL and t > self.max_len:
      raise ValueError(f"{type(self).__name__}: {t} positions but control "
                       f"{self.control!r} covers `max_len` = {self.max_len}")
    parts = []
    r = self.real_heads
    if r:
      assert q is not None and k is not None
      parts.append(_batched(dot_product_attention, q, k, v[..., :r, :],
                            is_causal=self.causal, normalizer=self.normalizer,
                            normalizer_params=self.normalizer_params or None))
    if r < self.num_heads:
      parts.append(self._control(v[..., r:, :]))
    return parts[0] if len(parts) == 1 else jnp.concatenate(
        [p.astype(jnp.result_type(*parts)) for p in parts], axis=-2)

  def _control(self, v: jax.Array) -> jax.Array:
    t = v.shape[-3]
    kwargs: dict[str, Any] = dict(is_causal=self.causal, normalizer=self.normalizer,
                                  normalizer_params=self.normalizer_params or None)
    if self.control == "none":
      return no_mixing_attention(v)
    if self.control == "uniform":
      return fixed_map_attention(jnp.zeros((t, t), jnp.float32), v, is_causal=self.causal)
    if self.scores is not None:
      return fixed_map_attention(self.scores[...][:, :t, :t], v, **kwargs)
    assert self.position_query is not None and self.position_key is not None
    p = self.position_embeddings(t)
    ctl = v.shape[-2]
    return embedding_qk_attention(self._heads(self.position_query(p), ctl),
                                  self._heads(self.position_key(p), ctl), v, **kwargs)

  def _heads(self, y: jax.Array, heads: int) -> jax.Array:
    return y.reshape(*y.shape[:-1], heads, self.head_dim)

  def __call__(self, x: ArrayLike) -> jax.Array:
    """``x [..., T, d]`` -> ``[..., T, d]``."""
    x = jnp.asarray(x)
    if x.ndim < 2:
      raise ValueError(f"{type(self).__name__}: `x` must have shape [..., T, d], got "
                       f"{x.shape}")
    q, k = self.real_qk(x)
    mixed = self.mix(q, k, self.values(x))
    return self.out(mixed.reshape(*mixed.shape[:-2], -1))


def _batched(fn: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array,
             **kwargs: Any) -> jax.Array:
  """``fn`` (taking ``[B, T, N, H]`` or ``[T, N, H]``) over any leading axes of q, k, v."""
  lead = q.shape[:-3]
  if len(lead) <= 1:
    return fn(q, k, v, **kwargs)
  rows = math.prod(lead)
  out = fn(*(a.reshape(rows, *a.shape[-3:]) for a in (q, k, v)), **kwargs)
  return out.reshape(*lead, *out.shape[1:])
