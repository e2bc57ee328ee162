"""N14 Dirichlet resampling: a random point of the simplex whose mean is softmax(x)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from jaxsoft.normalizers import common as c
from jaxsoft.normalizers.spec import NormalizerSpec, Param, register

__all__ = ["dirichlet_resample"]

_ALPHA = Param("alpha", 1.0, low=0.0, low_open=True, sample=10.0, row_broadcast=True)
# Entries whose probability is below this get weight 0: their expected share is under
# float32's resolution next to the row's total of 1, and the log-gamma sampler's
# derivative in the concentration (~ log(u) / a^2) would overflow for them.
_P_MIN = 1e-12


def check_key(key, fn_name: str) -> jax.Array:
  """A typed or raw (uint32[2]) PRNG key; ValueError naming ``key`` otherwise."""
  if key is None:
    raise ValueError(f"{fn_name}: `key` is required (a jax.random key); got None")
  k = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key):
    if k.ndim:
      raise ValueError(f"{fn_name}: `key` must be a single PRNG key, got shape {k.shape}")
    return k
  if k.dtype == jnp.uint32 and k.shape == (2,):
    return jax.random.wrap_key_data(k)
  raise ValueError(f"{fn_name}: `key` must be a jax.random key, got {k.dtype}{list(k.shape)}")


def _varying(x) -> frozenset:
  """The mesh axes ``x`` varies over inside ``jax.shard_map`` (empty elsewhere)."""
  axis_type = getattr(jax.typeof(x), "manual_axis_type", None)
  return frozenset() if axis_type is None else frozenset(axis_type.varying)



def _loggamma(key, conc, dtype):
  """``jax.random.loggamma(key, conc)``. On a batch sharded on an Explicit mesh JAX's gamma
  sampler refuses the sharded axis (it maps over the flattened entries, which it wants
  replicated): the concentrations are gathered, sampled as the unsharded call samples them
  (the same draws), and the draws sharded back like ``conc``."""
  sharding = getattr(jax.typeof(conc), "sharding", None)
  if sharding is not None and any(part is not None for part in sharding.spec):
    whole = jax.sharding.reshard(conc, sharding.update(spec=jax.sharding.PartitionSpec()))
    return jax.sharding.reshard(jax.random.loggamma(key, whole, dtype=dtype), sharding)
  return jax.random.loggamma(key, conc, dtype=dtype)


@c.dense_rules(keyed=True)
def dirichlet_resample(key: jax.Array, x: ArrayLike, axis: int = -1,
                       where: ArrayLike | None = None, *, alpha: ArrayLike = 1.0) -> jax.Array:
  r"""Dirichlet resampling of softmax (feature N14, kernel class X).

  From the "Soft Thinking" probing study (abstract: vanilla soft thinking behaves like greedy
  decoding; "Dirichlet resampling and the Gumbel-Softmax trick" restore randomness; authors
  and year not recorded in the catalogue, a 2025 preprint): a soft token's weights are
  resampled as

  .. math::
    \tilde p \sim \mathrm{Dir}(\alpha\, p), \qquad p = \mathrm{softmax}(x),

  drawn as ``g_i ~ Gamma(alpha p_i)``, ``p~ = g / sum g`` (in log space, with
  ``jax.random.loggamma``, so tiny concentrations do not underflow). ``E[p~] = p`` and
  ``Var[p~_i] = p_i (1 - p_i) / (alpha + 1)``: alpha -> inf gives p itself. The gradient is
  the implicit reparameterisation of the gamma sampler (JAX's), an unbiased estimate of
  the gradient of the mean: it is *not* the derivative of one draw at a fixed key, so the
  spec does not declare ``smooth``. Second derivatives are JAX's derivative of that
  gradient: ``jax.grad`` of ``jax.grad`` raises (the sampler's ``while_loop``), and forward
  over reverse (``jax.hessian``) is NaN where a concentration ``alpha p_i`` is below ~3e-3
  (``jax.random.loggamma``'s second derivative there). Entries with p < 1e-12 get weight 0
  (see the module).

  Args:
    key: a ``jax.random`` key (required; deterministic given the key).
    x: logits.
    axis: the axis to normalize over.
    where: optional boolean mask broadcastable to ``x``; masked entries get exactly 0.
    alpha: concentration alpha > 0, a scalar or an array broadcast to the rows;
      differentiable.

  Returns:
    A sample of ``x``'s shape and dtype on the simplex of the visible entries (computed in
    float32); a row with no visible entry is all zeros with zero gradient.

  Examples:
    >>> logits = jnp.log(jnp.array([0.5, 0.3, 0.2]))
    >>> keys = jax.random.split(jax.random.key(0), 20000)
    >>> draws = jax.vmap(lambda k: js.normalizers.dirichlet_resample(k, logits, alpha=5.0))(keys)
    >>> bool(jnp.allclose(draws.sum(-1), 1.0, atol=1e-5))
    True
    >>> bool(jnp.allclose(draws.mean(0), jnp.array([0.5, 0.3, 0.2]), atol=0.01))
    True

  References:
    The "Soft Thinking" probing study, 2025 (a preprint; authors and title not recorded
    in docs/feature_ids.md).

    M. Figurnov, S. Mohamed & A. Mnih, 2018, "Implicit Reparameterization Gradients".
  """
  name = "dirichlet_resample"
  key = check_key(key, name)
  xs, mask, ax, m, hp = c.prepare_params(x, axis, where, name, (_ALPHA, alpha), with_max=True)
  p = c.sum_normalize(jnp.exp(xs - m), mask, ax)
  live = mask & (p >= _P_MIN)
  conc = jnp.where(live, hp["alpha"] * p, 1.0)  # 1.0: a harmless value in the dead branch
  # Inside jax.shard_map (default check_vma) the sampler wants a key that varies like its
  # concentrations: a key the shards share is marked varying (each shard then draws what
  # the unsharded call on its rows draws).
  missing = tuple(sorted(_varying(conc) - _varying(key)))
  if missing:
    key = jax.lax.pcast(key, missing, to="varying")
  logg = _loggamma(key, conc, xs.dtype)
  logg = jnp.where(live, logg, -jnp.inf)
  mx = jax.lax.stop_gradient(jnp.max(logg, axis=ax, keepdims=True))
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  w = c.sum_normalize(jnp.exp(jnp.where(live, logg, mx) - mx), live, ax)
  return c.finish(w, mask, jnp.asarray(x).dtype)


SPEC = register(NormalizerSpec(
    name="dirichlet_resample",
    fn=dirichlet_resample,
    kernel_class="X",
    catalogue_id="N14",
    can_be_sparse=True,  # small concentrations give draws that underflow to 0 in float32
    params=(_ALPHA,),
    needs_key=True,
    smooth=False,  # the reparameterisation gradient is unbiased, not pathwise at a fixed key
    description="a Dir(alpha softmax(x)) sample, explicit PRNG key",
))
