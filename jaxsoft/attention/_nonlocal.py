"""The softmax-free non-local block (feature A27), re-associated to O(T·d^2)."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jaxsoft.attention._checks import check_rank
from jaxsoft.normalizers.common import compute_dtype

__all__ = ["nonlocal_block"]

_HI = lax.Precision.HIGHEST


def nonlocal_block(x: ArrayLike, w_theta: ArrayLike, w_phi: ArrayLike, w_g: ArrayLike,
                   w_out: ArrayLike, *, num_heads: int = 1, scale: float | None = None,
                   use_softmax: bool = False) -> jax.Array:
  r"""The softmax-free non-local block: a scaled dot product, re-associated (feature A27).

  For positions x_i (a flattened image or sequence), per head:

  .. math::
    y_i = \sum_j f(\theta_i, \phi_j)\, g_j, \qquad z_i = x_i + W_z y_i

  with :math:`\theta = x W_\theta`, :math:`\phi = x W_\phi`, :math:`g = x W_g`. The
  softmax-free block takes :math:`f = s\, \theta_i \cdot \phi_j` (s = ``scale``, default
  1/T, the classic "dot product" non-local block), which re-associates to
  :math:`y = s\, \Theta (\Phi^\top G)`: O(T·d^2) time, no T x T array, and heads at no
  extra cost. ``use_softmax=True`` is the original embedded-Gaussian block,
  :math:`f = \mathrm{softmax}_j(\theta_i \cdot \phi_j)` (O(T^2)), for comparison.

  [R] The paper's value of s (Cho et al. 2022) is not established; 1/T is the classic
  choice.

  Args:
    x: [B, T, C].
    w_theta, w_phi: [C, D]; w_g: [C, Dv]; w_out: [Dv, C]. D and Dv must divide by
      ``num_heads``.
    num_heads: heads (the projections are split along D and Dv).
    scale: s (None = 1/T).
    use_softmax: the softmax (embedded Gaussian) block instead.

  Returns:
    z [B, T, C] in x's dtype (computed in float32 at least: bf16 and fp16 widen, float64 stays).

  Examples:
    One head, the same projection for theta, phi and g: the re-associated block equals the
    quadratic form :math:`x + \tfrac1T (\Theta \Theta^\top) \Theta W_z`.

    >>> x = jnp.sin(jnp.arange(24.0)).reshape(1, 4, 6)       # [B, T, C]
    >>> w = 0.1 * jnp.cos(jnp.arange(48.0)).reshape(6, 8)    # [C, D]
    >>> z = js.attention.nonlocal_block(x, w, w, w, w.T)
    >>> z.shape
    (1, 4, 6)
    >>> theta = x[0] @ w
    >>> bool(jnp.allclose(z[0], x[0] + (theta @ theta.T / 4) @ theta @ w.T, atol=1e-6))
    True

  References:
    Y. Cho et al., 2022, "Rethinking Efficacy of Softmax for Lightweight Non-Local Neural
    Networks".

    X. Wang, R. Girshick, A. Gupta & K. He, 2018, "Non-local Neural Networks" (CVPR 2018).
  """
  fn = "nonlocal_block"
  xa = check_rank(x, "x", 3, "[B, T, C]", fn)
  B, T, C = xa.shape
  w_theta, w_phi, w_g, w_out = (jnp.asarray(w) for w in (w_theta, w_phi, w_g, w_out))
  for w, name in ((w_theta, "w_theta"), (w_phi, "w_phi"), (w_g, "w_g")):
    if w.ndim != 2 or w.shape[0] != C:
      raise ValueError(f"{fn}: `{name}` must have shape [C={C}, D], got {w.shape}")
  if w_phi.shape != w_theta.shape:
    raise ValueError(f"{fn}: `w_phi` must have the shape of `w_theta` {w_theta.shape}, got {w_phi.shape}")
  if w_out.shape != (w_g.shape[1], C):
    raise ValueError(f"{fn}: `w_out` must have shape [Dv={w_g.shape[1]}, C={C}], got {w_out.shape}")
  if isinstance(num_heads, bool) or not isinstance(num_heads, numbers.Integral) or num_heads < 1 or (
      w_theta.shape[1] % num_heads or w_g.shape[1] % num_heads):
    raise ValueError(
        f"{fn}: `num_heads` must be an int >= 1 dividing D={w_theta.shape[1]} and "
        f"Dv={w_g.shape[1]}, got {num_heads!r}")
  cdt = compute_dtype(xa.dtype)
  xc = xa.astype(cdt)
  nh = int(num_heads)

  def heads(w):
    return jnp.einsum("btc,cd->btd", xc, w.astype(cdt), precision=_HI).reshape(B, T, nh, -1)

  th, ph, g = heads(w_theta), heads(w_phi), heads(w_g)
  if use_softmax:
    logits = jnp.einsum("binh,bjnh->bnij", th, ph, precision=_HI)
    y = jnp.einsum("bnij,bjnh->binh", jax.nn.softmax(logits, -1), g, precision=_HI)
  else:
    s = 1.0 / T if scale is None else scale
    state = jnp.einsum("bjnh,bjnv->bnhv", ph, g, precision=_HI)  # Phi^T G per head
    y = s * jnp.einsum("binh,bnhv->binv", th, state, precision=_HI)
  z = xc + jnp.einsum("btd,dc->btc", y.reshape(B, T, -1), w_out.astype(cdt), precision=_HI)
  return z.astype(xa.dtype)
