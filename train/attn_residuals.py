r"""Block Attention Residuals (A46) as a train/ configuration: ``--attention_residual_blocks G``.

The plain pre-norm stack adds every sublayer's output (attention and MLP of each decoder
block) to one residual stream. With Block Attention Residuals the sublayers are grouped
into residual blocks of ``G`` decoder blocks (2G sublayers); the stream is kept as the
completed blocks' representations :math:`v_0` (the token embedding), :math:`v_1, \dots`
(each the sum of its block's sublayer outputs) and the current block's partial sum, and
the input of sublayer l is :func:`jaxsoft.nn.block_attention_residual` of them with the
sublayer's own pseudo-query :math:`w_l \in \mathbb{R}^d`:

.. math::

   h_l = \sum_i \alpha_{l,i} v_i, \qquad
   \alpha_l = \mathrm{softmax}_i(w_l \cdot \mathrm{RMS}(v_i)),

per token. The final hidden state is the same mixture with one more pseudo-query [R]
(the paper's output-layer treatment is not recorded in this project's sources). The
queries start at 0: uniform weights, :math:`h_l = x_l / S` for the plain stream's
:math:`x_l` (the sum of the S sources), which each sublayer's RMSNorm maps to the plain
model's normalised input, so at initialisation the model computes the plain model's
function up to the norms' epsilon (an RMSNorm of :math:`x / S` is that of x with
:math:`\epsilon` scaled by :math:`S^2`). A sublayer that starts a residual block has no
partial sum yet and mixes the completed blocks only.

References:
  Kimi Team (G. Chen et al.), 2026, "Attention Residuals" (Moonshot AI; arXiv, March 2026).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxsoft.nn import block_attention_residual

__all__ = ["AttentionResiduals"]


class AttentionResiduals(nnx.Module):
  """The residual routing of a stack of ``num_sublayers`` sublayers, ``group`` decoder blocks
  (2 ``group`` sublayers) per residual block; pseudo-queries ``[num_sublayers + 1, d]``
  float32, zero-initialised (logical axes: replicated)."""

  def __init__(self, d_model: int, num_sublayers: int, group: int, *, rngs: nnx.Rngs):
    if group < 1:
      raise ValueError(f"AttentionResiduals: `group` must be >= 1, got {group}")
    self.span = 2 * group  # sublayers per residual block
    init = nnx.with_partitioning(nnx.initializers.zeros_init(), (None, "norm"),
                                 eager_sharding=False)
    self.queries = nnx.Param(init(rngs.params(), (num_sublayers + 1, d_model), jnp.float32))

  def mix(self, done: Sequence[jax.Array], partial: jax.Array | None, index: int) -> jax.Array:
    """Sublayer ``index``'s input: the completed blocks ``done`` and the partial sum."""
    sources = list(done) + ([] if partial is None else [partial])
    return block_attention_residual(jnp.stack(sources), self.queries[index])

  def __call__(self, x: jax.Array, sublayers: Sequence[Callable[[jax.Array], jax.Array]],
               stop: int | None = None) -> jax.Array:
    """Runs ``sublayers`` (each input -> output to add) from the embedding ``x``; returns the
    final mixture, or with ``stop`` the input sublayer ``stop`` would get."""
    done: list[jax.Array] = [x]
    partial = None
    for i, sublayer in enumerate(sublayers):
      h = self.mix(done, partial, i)
      if i == stop:
        return h
      out = sublayer(h)
      partial = out if partial is None else partial + out
      if (i + 1) % self.span == 0:
        done.append(partial)
        partial = None
    return self.mix(done, partial, len(sublayers))
