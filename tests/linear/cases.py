"""Inputs and call wrappers for the five variants (no tests here)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxsoft import linear
from tests.linear import reference

VARIANTS = ("linear_attention", "simple_gla", "gla", "delta_rule", "gated_delta_rule")
FORMS = ("parallel", "recurrent", "chunked")


def segments(B, T, seed=0):
  """``[B, T]`` ids with a few changes (one id coming back), including one at t = 1."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((B, T), np.int32)
  for b in range(B):
    cuts = sorted(rng.choice(np.arange(1, T), size=min(3, T - 1), replace=False))
    cuts[0] = 1 if b == 0 else cuts[0]
    for i, c in enumerate(cuts):
      ids[b, c:] = (i + 1) % 2   # 0, 1, 0, 1: an id that comes back is a new segment
  return jnp.asarray(ids)


def inputs(variant, B=2, T=11, N=2, K=4, V=3, *, seed=0, state=True, dtype=jnp.float32,
           strong_decay=False):
  """The differentiable arguments of ``variant`` as a dict of arrays."""
  ks = jax.random.split(jax.random.key(seed), 8)
  args = {
      "q": jax.random.normal(ks[0], (B, T, N, K)),
      "k": jax.random.normal(ks[1], (B, T, N, K)),
      "v": jax.random.normal(ks[2], (B, T, N, V)),
  }
  if variant in ("delta_rule", "gated_delta_rule"):
    args["k"] = linear.l2_normalize(args["k"])
    args["beta"] = jax.random.uniform(ks[3], (B, T, N), minval=0.05, maxval=1.95)
  low = -30.0 if strong_decay else -1.0
  if variant in ("simple_gla", "gated_delta_rule"):
    args["g"] = jax.random.uniform(ks[4], (B, T, N), minval=low, maxval=0.0)
  if variant == "gla":
    args["g"] = jax.random.uniform(ks[4], (B, T, N, K), minval=low, maxval=0.0)
  if state:
    S = 0.5 * jax.random.normal(ks[5], (B, N, K, V))
    if variant == "linear_attention":
      args["initial_state"] = (S, jax.random.uniform(ks[6], (B, N, K), minval=0.5, maxval=2.0))
    else:
      args["initial_state"] = S
  return jax.tree.map(lambda x: x.astype(dtype), args)


def call(variant, args, **kwargs):
  """``linear.<variant>`` on ``args`` with ``output_final_state=True``, jitted (one compile
  instead of one per eager op; the eager path's value checks are tested in test_checks)."""
  return jax.jit(functools.partial(_call, variant, **kwargs))(args)


def _call(variant, args, **kwargs):
  a = dict(args)
  fn = getattr(linear, variant)
  if variant in ("simple_gla", "gla"):
    return fn(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), output_final_state=True,
              **a, **kwargs)
  if variant == "delta_rule":
    return fn(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("beta"), output_final_state=True,
              **a, **kwargs)
  if variant == "gated_delta_rule":
    return fn(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"),
              output_final_state=True, **a, **kwargs)
  return fn(a.pop("q"), a.pop("k"), a.pop("v"), output_final_state=True, **a, **kwargs)


def reference_call(variant, args, segment_ids=None):
  """The numpy float64 loop for the same call: ``(o, final_state)``."""
  a = {n: jax.tree.map(np.asarray, x) for n, x in args.items()}
  seg = None if segment_ids is None else np.asarray(segment_ids)
  if variant == "linear_attention":
    phi = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))   # elu(x) + 1
    return reference.normalized_linear_attention(
        phi(a["q"]), phi(a["k"]), a["v"], initial_state=a.get("initial_state"),
        segment_ids=seg)
  return reference.recurrence(a["q"], a["k"], a["v"], g=a.get("g"), beta=a.get("beta"),
                              initial_state=a.get("initial_state"), segment_ids=seg)
