"""L19 training-free hallucination scores from the logits of a language model's head:
the spilled energy between consecutive decoding steps and the marginalized energy.

They sit beside the L16 scores (:func:`~jaxsoft.losses.energy_score`, the free energy of one
classifier output): here the LM head is read as a chain of energy-based models, one per
decoding step, and the scores compare them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive
from jaxsoft.losses import _common as lc

__all__ = ["marginalized_energy", "spilled_energy"]


def marginalized_energy(logits: ArrayLike, *, beta: ArrayLike = 1.0, axis: lc.Axis = -1,
                        where: ArrayLike | None = None) -> jax.Array:
  r"""Marginalized energy of one decoding step, :math:`E'_t = -\log\sum_v e^{\beta z_{t,v}}`
  (feature L19).

  From A. R. Minut, H. Dewidar & I. Masi, "Spilled Energy in Large Language Models"
  (ICLR 2026): the LM head's softmax over the vocabulary read as an energy-based model,
  whose free energy (the energy with the next token marginalized out) is measurable at a
  single step. It is :func:`~jaxsoft.losses.energy_score` (L16) with the opposite sign
  and :math:`\beta = 1/T` inside the sum and no factor T outside:
  :math:`E' = -\mathrm{energy\_score}(z, T = 1/\beta) \cdot \beta`. Higher (less negative)
  means a flatter, lower-confidence step; the paper aggregates it over the tokens of the
  answer (mean, max, min or sum) and uses it as a hallucination score. Its gradient is
  :math:`-\beta\,\mathrm{softmax}(\beta z)`. A row with no visible entry gets 0.

  Args:
    logits: ``[..., V, ...]`` logits of the LM head, one row per decoding step.
    beta: inverse temperature :math:`\beta > 0` (the paper's default 1).
    axis: the vocabulary axis, or a tuple of axes forming it (None: all), as the losses.
    where: optional vocabulary mask broadcastable to ``logits``, or, with one dimension
      fewer, a mask over steps (a masked step gets 0 with zero gradient).

  Returns:
    One energy per step (``logits``' shape without ``axis``), in ``logits``' dtype
    (bf16/fp16 computed in float32).

  Examples:
    >>> z = jnp.array([[4.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    >>> print(js.losses.marginalized_energy(z))  # -log sum exp(z)
    [-4.036  -2.0986]
    >>> print(-js.losses.energy_score(z))
    [-4.036  -2.0986]

  References:
    A. R. Minut, H. Dewidar & I. Masi, 2026, "Spilled Energy in Large Language Models"
    (ICLR); the authors' code: github.com/OmnAI-Lab/spilled-energy.

    W. Liu, X. Wang, J. D. Owens & Y. Li, 2020, "Energy-based Out-of-distribution
    Detection" (NeurIPS).
  """
  fn = "marginalized_energy"
  b = check_positive(beta, "beta", fn)
  logits, where, axis, _ = lc.class_rows(logits, axis, where, fn)
  x, mask, axis, dtype = lc.prepare_logits(logits, axis, where, fn)
  lse, visible = lc.masked_logsumexp(b * x, mask, axis)
  return lc.finish(-lse, visible, dtype)


def spilled_energy(logits: ArrayLike, tokens: ArrayLike, *, beta: ArrayLike = 1.0,
                   where: ArrayLike | None = None) -> jax.Array:
  r"""Spilled energy between consecutive decoding steps (feature L19).

  From A. R. Minut, H. Dewidar & I. Masi, "Spilled Energy in Large Language Models"
  (ICLR 2026). With :math:`z_t` the LM head's logits at step t and :math:`y_t` the token
  chosen from them, two energies of the same prefix :math:`(\ldots, y_t)` should be equal
  if the chain of per-step energy-based models were consistent: the energy the model gave
  the chosen token, :math:`E_t = -\beta z_{t, y_t}`, and the marginalized (free) energy of
  the next step, once :math:`y_t` is in the context,
  :math:`E'_{t+1} = -\log\sum_v e^{\beta z_{t+1, v}}` (:func:`marginalized_energy`). The
  spilled energy is their difference

  .. math::
    \Delta_t = E_t - E'_{t+1}
             = \log\sum_v e^{\beta z_{t+1, v}} - \beta z_{t, y_t},
    \qquad t = 0, \ldots, T - 2,

  large where the model drifts into an inconsistent (hallucinated) continuation. The
  paper locates the answer's tokens and aggregates :math:`\Delta` over them (mean, max,
  min or sum); pass ``where`` to keep only those steps and reduce the result.

  [R] The paper's text gives the two energies and says they "should theoretically match";
  the alignment and sign are read from the authors' code (``spilled_energy_torch``:
  ``delta = -E_margin + E`` with ``E`` from the previous step's logit of the current
  token), which prepends a 0-energy entry for the first token; here the result has one
  entry per transition instead (T - 1 of them), and is signed (their documentation quotes
  :math:`|\Delta|`: take ``jnp.abs`` for that).

  Args:
    logits: ``[..., T, V]`` logits of T decoding steps: ``logits[..., t, :]`` is the
      distribution ``tokens[..., t]`` was chosen from, and step t + 1's logits are
      computed with that token in the context (the ``scores`` of a generate loop, or a
      teacher-forced pass's logits with ``tokens`` the input shifted left by one).
    tokens: ``[..., T]`` integer token ids; the last one is not used (no step follows it).
    beta: inverse temperature :math:`\beta > 0` (the paper's default 1).
    where: optional ``[..., T]`` step mask (the answer's tokens, or padding): transition t
      counts when steps t and t + 1 are both visible, else it is 0 with zero gradient;
      or a vocabulary mask broadcastable to ``logits`` (masked entries leave the sums; a
      chosen token that is masked gives ``+inf``).

  Returns:
    ``[..., T - 1]`` spilled energies, in ``logits``' dtype (bf16/fp16 computed in
    float32).

  Examples:
    >>> z = jnp.array([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0], [3.0, 0.0, 0.0]])
    >>> y = jnp.array([0, 1, 0])
    >>> print(js.losses.spilled_energy(z, y))  # LSE(z[t + 1]) - z[t, y[t]]
    [-0.4486  2.0949]
    >>> print(-js.losses.marginalized_energy(z[1:]) - z[:-1][jnp.arange(2), y[:-1]])
    [-0.4486  2.0949]

  References:
    A. R. Minut, H. Dewidar & I. Masi, 2026, "Spilled Energy in Large Language Models"
    (ICLR); the authors' code: github.com/OmnAI-Lab/spilled-energy.
  """
  fn = "spilled_energy"
  b = check_positive(beta, "beta", fn)
  z = lc.check_logits(logits, fn)
  if z.ndim < 2:
    raise ValueError(f"{fn}: `logits` must be [..., T, V] (a step and a vocabulary axis), "
                     f"got shape {z.shape}")
  if z.shape[-2] < 1:
    raise ValueError(f"{fn}: `logits` must have at least one step, got shape {z.shape}")
  tokens = lc.check_labels(tokens, z.shape[:-1], fn, "tokens",
                           "`logits`' shape without the vocabulary axis")
  x, mask, _, dtype = lc.prepare_logits(z, -1, where, fn)
  lse, visible = lc.masked_logsumexp(b * x, mask, -1)            # [..., T]
  x_y, token_visible = lc.gather_label(x, mask, tokens, -1)      # [..., T]
  delta = lse[..., 1:] - b * x_y[..., :-1]
  delta = jnp.where(token_visible[..., :-1], delta, jnp.inf)
  keep = visible[..., 1:] & visible[..., :-1]
  return lc.finish(delta, keep, dtype)
