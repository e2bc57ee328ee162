"""Soft MoE (feature A21): every slot a softmax mixture of tokens, every output a softmax
mixture of slots."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from flax.typing import Dtype
from jax.typing import ArrayLike

from jaxsoft._validation import positive_int
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["SoftMoE", "soft_moe_weights", "soft_moe"]


def _masked_softmax(z, where, axis):
  z = jnp.where(where, z, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(z, axis=axis, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.where(where, jnp.exp(jnp.where(where, z, m) - m), 0.0)
  d = jnp.sum(e, axis=axis, keepdims=True)
  return e / jnp.where(d > 0, d, 1.0)


def soft_moe_weights(x: ArrayLike, phi: ArrayLike, *, scale: ArrayLike | None = None,
                     mask: ArrayLike | None = None) -> tuple[jax.Array, jax.Array]:
  r"""Soft MoE's dispatch and combine weights from the logits :math:`L = X \Phi`.

  .. math::
    D_{ij} = \frac{e^{L_{ij}}}{\sum_{i'} e^{L_{i'j}}} \ \text{(over tokens)}, \qquad
    C_{ij} = \frac{e^{L_{ij}}}{\sum_{j'} e^{L_{ij'}}} \ \text{(over slots)}

  With ``scale`` (the paper's normalised variant for large d):
  :math:`L = \mathrm{scale} \cdot \hat X \hat\Phi` with tokens and slot parameters
  l2-normalised along the feature axis.

  Args:
    x: tokens [B, m, d]; phi: slot parameters [d, s] (s = experts x slots per expert).
    scale: None (plain logits) or the learnable scalar of the normalised variant.
    mask: optional bool [B, m]: padding tokens (False) get no dispatch weight and a zero
      combine row.

  Returns:
    ``(dispatch [B, m, s], combine [B, m, s])`` in float32 (float64 for float64 input):
    each dispatch column and each visible combine row sums to 1.

  Examples:
    >>> x = jax.random.normal(jax.random.key(0), (1, 3, 2))    # 3 tokens of d = 2
    >>> phi = jax.random.normal(jax.random.key(1), (2, 2))     # 2 slots
    >>> dispatch, combine = js.nn.soft_moe_weights(x, phi)
    >>> dispatch.sum(axis=1)                                   # over tokens, per slot
    Array([[1., 1.]], dtype=float32)
    >>> combine.sum(axis=2)                                    # over slots, per token
    Array([[1., 1., 1.]], dtype=float32)

  References:
    J. Puigcerver, C. Riquelme, B. Mustafa & N. Houlsby, 2024, "From Sparse to Soft Mixtures
    of Experts".
  """
  x, phi = jnp.asarray(x), jnp.asarray(phi)
  cdt = compute_dtype(x.dtype)
  x, phi = x.astype(cdt), phi.astype(cdt)
  if scale is not None:
    x = x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-12)
    phi = phi * jax.lax.rsqrt(jnp.sum(phi * phi, 0, keepdims=True) + 1e-12)
    logits = jnp.asarray(scale, cdt) * jnp.einsum("bmd,ds->bms", x, phi)
  else:
    logits = jnp.einsum("bmd,ds->bms", x, phi)
  where = jnp.ones(logits.shape, bool) if mask is None else jnp.asarray(mask, bool)[..., None]
  where = jnp.broadcast_to(where, logits.shape)
  return _masked_softmax(logits, where, 1), _masked_softmax(logits, where, 2)


def soft_moe(x: ArrayLike, phi: ArrayLike, experts: Callable[[jax.Array], jax.Array], *,
             num_experts: int, scale: ArrayLike | None = None,
             mask: ArrayLike | None = None) -> jax.Array:
  r"""Soft MoE: :math:`Y = C\, f(D^\top X)` (feature A21).

  The slots :math:`\tilde X = D^\top X` ([B, s, d], convex combinations of the tokens) are
  split into ``num_experts`` groups of s / n slots; ``experts`` maps them
  ``[B, n, s/n, d] -> [B, n, s/n, d_out]`` (expert e on its own slots), and each output
  token is the combine-weighted sum of the slot outputs. No token is dropped and the
  shapes are static; the layer mixes the whole sequence, so it is not causal.

  From J. Puigcerver, C. Riquelme, B. Mustafa, N. Houlsby, "From Sparse to Soft Mixtures of
  Experts" (ICLR 2024).

  Args:
    x: tokens [B, m, d].
    phi: slot parameters [d, s], s divisible by ``num_experts``.
    experts: ``[B, n, s/n, d] -> [B, n, s/n, d_out]``, expert e on its own slots.
    num_experts: n.
    scale: None (plain logits) or the scalar of the normalised variant
      (:func:`soft_moe_weights`).
    mask: optional bool [B, m]: padding tokens take no part.

  Returns:
    [B, m, d_out] in x's dtype.

  Examples:
    >>> x = jnp.arange(6.0).reshape(1, 3, 2)       # tokens [0, 1], [2, 3], [4, 5]
    >>> phi = jnp.zeros((2, 2))                    # equal logits: every slot is the mean [2, 3]
    >>> js.nn.soft_moe(x, phi, lambda slots: 2 * slots, num_experts=2)
    Array([[[4., 6.],
            [4., 6.],
            [4., 6.]]], dtype=float32)

  References:
    J. Puigcerver, C. Riquelme, B. Mustafa & N. Houlsby, 2024, "From Sparse to Soft Mixtures
    of Experts".
  """
  x = jnp.asarray(x)
  if x.ndim != 3:
    raise ValueError(f"soft_moe: `x` must have shape [B, m, d], got {x.shape}")
  phi = jnp.asarray(phi)
  if phi.ndim != 2 or phi.shape[0] != x.shape[-1] or phi.shape[1] % num_experts:
    raise ValueError(
        f"soft_moe: `phi` must have shape [d={x.shape[-1]}, s] with s divisible by "
        f"num_experts={num_experts}, got {phi.shape}")
  dispatch, combine = soft_moe_weights(x, phi, scale=scale, mask=mask)
  B, s = x.shape[0], phi.shape[1]
  slots = jnp.einsum("bms,bmd->bsd", dispatch, x.astype(dispatch.dtype))
  out = experts(slots.reshape(B, num_experts, s // num_experts, -1))
  out = out.reshape(B, s, -1).astype(dispatch.dtype)
  return jnp.einsum("bms,bsd->bmd", combine, out).astype(x.dtype)


class SoftMoE(nnx.Module):
  r"""A Soft MoE layer with MLP experts (feature A21; :func:`soft_moe`).

  Each expert e is a two-layer MLP :math:`f_e(x) = W^{(2)}_e\,\mathrm{gelu}(W^{(1)}_e x +
  b^{(1)}_e) + b^{(2)}_e` applied to its ``slots_per_expert`` slots.

  Args:
    in_features: d (also the output size).
    num_experts: n; slots_per_expert: p (s = n·p slots).
    hidden_features: the experts' hidden size (default 4·d).
    normalize: the paper's normalised logits with a learnable scale (initialised to 1).
    dtype: computation dtype (default: the input's); param_dtype: parameter dtype.
    rngs: nnx.Rngs.

  Examples:
    >>> moe = js.nn.SoftMoE(4, num_experts=2, slots_per_expert=1, hidden_features=8,
    ...                     rngs=nnx.Rngs(0))
    >>> moe.w1.shape                                 # [experts, d, hidden]
    (2, 4, 8)
    >>> moe(jnp.ones((1, 3, 4))).shape               # [B, m, d]
    (1, 3, 4)

  References:
    J. Puigcerver, C. Riquelme, B. Mustafa & N. Houlsby, 2024, "From Sparse to Soft Mixtures
    of Experts".
  """

  def __init__(self, in_features: int, num_experts: int, slots_per_expert: int = 1, *,
               hidden_features: int | None = None, normalize: bool = False,
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               rngs: nnx.Rngs) -> None:
    for arg, val in (("in_features", in_features), ("num_experts", num_experts),
                     ("slots_per_expert", slots_per_expert)):
      positive_int(val, arg, "SoftMoE")
    hidden = 4 * in_features if hidden_features is None else hidden_features
    positive_int(hidden, "hidden_features", "SoftMoE")
    self.num_experts = num_experts
    self.dtype = dtype
    init = initializers.lecun_normal()
    n, d = num_experts, in_features
    self.phi = nnx.Param(init(rngs.params(), (d, n * slots_per_expert), param_dtype))
    self.scale = nnx.Param(jnp.ones((), param_dtype)) if normalize else None
    self.w1 = nnx.Param(jax.vmap(lambda k: init(k, (d, hidden), param_dtype))(
        jax.random.split(rngs.params(), n)))
    self.b1 = nnx.Param(jnp.zeros((n, hidden), param_dtype))
    self.w2 = nnx.Param(jax.vmap(lambda k: init(k, (hidden, d), param_dtype))(
        jax.random.split(rngs.params(), n)))
    self.b2 = nnx.Param(jnp.zeros((n, d), param_dtype))

  def experts(self, slots: jax.Array) -> jax.Array:
    """``[B, n, p, d] -> [B, n, p, d]``: expert e's MLP on its p slots."""
    dt = slots.dtype
    h = jnp.einsum("bnpd,ndf->bnpf", slots, self.w1[...].astype(dt))
    h = jax.nn.gelu(h + self.b1[...].astype(dt)[None, :, None])  # bias [n, f] as [1, n, 1, f]
    out = jnp.einsum("bnpf,nfd->bnpd", h, self.w2[...].astype(dt))
    return out + self.b2[...].astype(dt)[None, :, None]

  def __call__(self, x: ArrayLike, mask: ArrayLike | None = None) -> jax.Array:
    """x [B, m, d] (mask: optional bool [B, m]) -> [B, m, d]."""
    x = jnp.asarray(x)
    if self.dtype is not None:
      x = x.astype(self.dtype)
    scale = None if self.scale is None else self.scale[...]
    return soft_moe(x, self.phi[...], self.experts, num_experts=self.num_experts, scale=scale,
                    mask=mask)
