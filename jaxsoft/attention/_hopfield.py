"""Modern-Hopfield retrieval with any normalizer (feature A03; OutEffHop).

:func:`hopfield_retrieval` iterates ``xi <- Xi · normalizer(beta Xi^T xi)`` (one step is
attention of the state over the stored patterns); :func:`hopfield_energy` is the energy
each ``softmax`` / ``softmax_1`` step does not increase.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft._validation import check_positive
from jaxsoft.attention._checks import check_int
from jaxsoft.normalizers import common as c
from jaxsoft.normalizers import spec

__all__ = ["hopfield_retrieval", "hopfield_energy"]


def _row_normalize(normalizer, z, where, normalizer_params, fn_name: str):
  """Applies a normalizer given as a registered name, a NormalizerSpec or a callable."""
  fn = spec.resolve(normalizer)
  params = dict(normalizer_params or {})
  if isinstance(fn, spec.NormalizerSpec):
    if fn.needs_key:
      raise ValueError(
          f"{fn_name}: `normalizer` {fn.name!r} needs a PRNG key; pass a callable that closes "
          "over one")
    fn.validate(params)
  return fn(z, axis=-1, where=where, **params)


def hopfield_retrieval(query_state: ArrayLike, memory: ArrayLike, *, beta: ArrayLike,
                       num_iters: int = 1,
                       normalizer: str | spec.NormalizerSpec | Callable[..., Any] = "softmax_1",
                       normalizer_params: Mapping[str, Any] | None = None,
                       where: ArrayLike | None = None) -> jax.Array:
  r"""Modern-Hopfield retrieval: a state attends to stored patterns, iterated (feature A03).

  With the stored patterns :math:`\Xi = [\xi^1, \dots, \xi^M]` (the rows of ``memory``)
  and a state :math:`\xi`, each iteration applies

  .. math:: \xi \leftarrow \Xi \, f(\beta\, \Xi^\top \xi)

  where ``f`` is the normalizer over the M patterns: ``softmax`` is the modern Hopfield
  network of H. Ramsauer et al., "Hopfield Networks is All You Need" (ICLR 2021, arXiv
  2008.02217), whose one step is attention; ``softmax_1`` (the default,
  :math:`e^{z_i} / (1 + \sum_j e^{z_j})`) is OutEffHop, whose implicit zero logit lets a
  state that matches no pattern retrieve (nearly) nothing. Any registered normalizer (a
  name, a NormalizerSpec) or a callable ``f(z, axis=-1, where=None, **params)`` works; for
  ``softmax`` and ``softmax_1`` each step does not increase :func:`hopfield_energy`
  (the update is the concave-convex procedure on it).

  Args:
    query_state: states ``[..., Q, d]`` (Q states retrieved at once).
    memory: patterns ``[..., M, d]``; leading dimensions broadcast with ``query_state``.
    beta: inverse temperature > 0 (a scalar or an array broadcast to ``[..., Q, 1]``).
    num_iters: number of update steps, a static int >= 1.
    normalizer: the normalizer over patterns (default ``"softmax_1"``).
    normalizer_params: extra hyperparameters of the normalizer.
    where: optional boolean mask broadcast to ``[..., Q, M]``: which patterns are stored.

  Returns:
    The state after ``num_iters`` updates, ``[..., Q, d]`` in ``query_state``'s dtype
    (computed in float32 for bf16/fp16). Differentiable in all array arguments.

  Examples:
    Three patterns; a noisy copy of the first is cleaned up in one step, and a state that
    matches no pattern retrieves almost nothing with ``softmax_1`` (OutEffHop) but the
    patterns' average with ``softmax``:

    >>> memory = 2.0 * jnp.eye(3, 4)   # [M, d] = [3, 4]
    >>> noisy = jnp.array([[1.8, 0.3, 0.0, 0.0]])
    >>> bool(jnp.allclose(js.attention.hopfield_retrieval(noisy, memory, beta=4.0),
    ...                   memory[:1], atol=1e-3))
    True
    >>> far = jnp.array([[-1.0, -1.0, -1.0, 0.0]])
    >>> js.attention.hopfield_retrieval(far, memory, beta=4.0)
    Array([[0.0007, 0.0007, 0.0007, 0.    ]], dtype=float32)
    >>> js.attention.hopfield_retrieval(far, memory, beta=4.0, normalizer="softmax")
    Array([[0.6667, 0.6667, 0.6667, 0.    ]], dtype=float32)

  References:
    J. Y.-C. Hu et al., 2024, "Outlier-Efficient Hopfield Layers for Large
    Transformer-Based Models" (ICML 2024, arXiv 2404.03828).

    H. Ramsauer et al., 2021, "Hopfield Networks is All You Need" (ICLR 2021, arXiv
    2008.02217).
  """
  fn_name = "hopfield_retrieval"
  check_int(num_iters, "num_iters", 1, fn_name)
  xi = jnp.asarray(query_state)
  mem = jnp.asarray(memory)
  if xi.ndim < 2 or mem.ndim < 2:
    raise ValueError(
        f"{fn_name}: `query_state` [..., Q, d] and `memory` [..., M, d] need rank >= 2, got "
        f"{xi.shape} and {mem.shape}")
  if xi.shape[-1] != mem.shape[-1]:
    raise ValueError(
        f"{fn_name}: `query_state` and `memory` must share the pattern dimension d, got "
        f"{xi.shape[-1]} and {mem.shape[-1]}")
  check_positive(beta, "beta", fn_name)
  out_dtype = xi.dtype
  cdt = c.compute_dtype(jnp.result_type(xi.dtype, mem.dtype))
  xi = xi.astype(cdt)
  mem = mem.astype(cdt)
  beta = jnp.asarray(beta, cdt)

  def step(_, state):
    z = beta * jnp.einsum("...qd,...md->...qm", state, mem)
    w = _row_normalize(normalizer, z, where, normalizer_params, fn_name).astype(cdt)
    return jnp.einsum("...qm,...md->...qd", w, mem)

  # The first step also broadcasts the state against memory's leading dimensions, so the
  # loop carry has a fixed shape.
  xi = step(0, xi)
  xi = jax.lax.fori_loop(1, num_iters, step, xi)
  return xi.astype(out_dtype)


def hopfield_energy(query_state: ArrayLike, memory: ArrayLike, *, beta: ArrayLike,
                    offset: float = 1.0) -> jax.Array:
  r"""The modern-Hopfield energy that :func:`hopfield_retrieval` descends (feature A03).

  .. math::
    E(\xi) = -\frac{1}{\beta} \log\Big(c + \sum_{i=1}^{M} e^{\beta \langle \xi^i, \xi\rangle}
    \Big) + \tfrac12 \langle \xi, \xi \rangle

  with ``offset`` :math:`c = 1` for OutEffHop's ``softmax_1`` (``lse_1``) and ``c = 0`` for
  the modern Hopfield network (``softmax``); each retrieval step with that normalizer does
  not increase it.

  Args:
    query_state: states ``[..., Q, d]``.
    memory: patterns ``[..., M, d]``; leading dimensions broadcast with ``query_state``.
    beta: inverse temperature > 0 (a scalar or an array broadcast to ``[..., Q, 1]``).
    offset: c >= 0 (1 for ``softmax_1``, 0 for ``softmax``).

  Returns:
    ``[..., Q]`` in float32 (float64 for float64 inputs).

  Examples:
    >>> memory = 2.0 * jnp.eye(3, 4)
    >>> state = jnp.array([[1.8, 0.3, 0.0, 0.0]])
    >>> before = js.attention.hopfield_energy(state, memory, beta=4.0)
    >>> after = js.attention.hopfield_energy(
    ...     js.attention.hopfield_retrieval(state, memory, beta=4.0), memory, beta=4.0)
    >>> before, after, bool(after <= before)
    (Array([-1.935], dtype=float32), Array([-2.], dtype=float32), True)

  References:
    J. Y.-C. Hu et al., 2024, "Outlier-Efficient Hopfield Layers for Large
    Transformer-Based Models" (ICML 2024, arXiv 2404.03828).

    H. Ramsauer et al., 2021, "Hopfield Networks is All You Need" (ICLR 2021, arXiv
    2008.02217).
  """
  if offset < 0:
    raise ValueError(f"hopfield_energy: `offset` must be >= 0, got {offset}")
  xi = jnp.asarray(query_state)
  mem = jnp.asarray(memory)
  cdt = c.compute_dtype(jnp.result_type(xi.dtype, mem.dtype))
  xi = xi.astype(cdt)
  mem = mem.astype(cdt)
  beta = jnp.asarray(beta, cdt)
  z = beta * jnp.einsum("...qd,...md->...qm", xi, mem)
  if offset > 0:
    z = jnp.concatenate([z, jnp.full(z.shape[:-1] + (1,), math.log(offset), cdt)], axis=-1)
  lse = jax.nn.logsumexp(z, axis=-1)
  beta_row = jnp.broadcast_to(beta, z.shape[:-1] + (1,))[..., 0]
  return -lse / beta_row + 0.5 * jnp.sum(xi * xi, axis=-1)
