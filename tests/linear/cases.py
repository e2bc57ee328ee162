"""Inputs, call wrappers and shared checks for the linear-family tests (no tests here).

The five base variants (linear attention, simple GLA, GLA, the two delta rules) have their
inputs and calls here; every variant's test file uses the helpers below: random ``q, k, v``,
the chunked call, the agreement of the forms with every gradient, decoding token by token.
"""

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
    phi = reference.elu1
    return reference.normalized_linear_attention(
        phi(a["q"]), phi(a["k"]), a["v"], initial_state=a.get("initial_state"),
        segment_ids=seg)
  return reference.recurrence(a["q"], a["k"], a["v"], g=a.get("g"), beta=a.get("beta"),
                              initial_state=a.get("initial_state"), segment_ids=seg)


def random_qkv(keys, B, T, N, K, V, *, unit_keys=False):
  """``{"q", "k": [B, T, N, K], "v": [B, T, N, V]}`` drawn from the first three of ``keys``
  (standard normal; ``k`` L2-normalised along K when ``unit_keys``)."""
  k = jax.random.normal(keys[1], (B, T, N, K))
  return {"q": jax.random.normal(keys[0], (B, T, N, K)),
          "k": linear.l2_normalize(k) if unit_keys else k,
          "v": jax.random.normal(keys[2], (B, T, N, V))}


def gated_delta_inputs(keys, B, T, N, K, V):
  """Unit keys and a Gated DeltaNet backbone's ``g`` (in ``[-1, 0]``) and ``beta`` (in
  ``[0.05, 1.5]``), ``[B, T, N]``, from the first five of ``keys``."""
  a = random_qkv(keys, B, T, N, K, V, unit_keys=True)
  a["g"] = jax.random.uniform(keys[3], (B, T, N), minval=-1.0, maxval=0.0)
  a["beta"] = jax.random.uniform(keys[4], (B, T, N), minval=0.05, maxval=1.5)
  return a


def chunked(call, args, *, chunk_size=4, segment_ids=None):
  """``call(args, implementation="chunked", ...)`` jitted: its ``(o, final_state)``."""
  return jax.jit(functools.partial(call, implementation="chunked", chunk_size=chunk_size,
                                   segment_ids=segment_ids))(args)


def assert_matches_reference(call, args, reference_fn, *, segment_ids, tol=2e-5):
  """The chunked call (chunks of 4) gives ``reference_fn(args in float64, segment_ids as
  numpy)``'s output."""
  o, _ = chunked(call, args, segment_ids=segment_ids)
  a64 = jax.tree.map(lambda x: np.asarray(x, np.float64), args)
  want = reference_fn(a64, None if segment_ids is None else np.asarray(segment_ids))
  np.testing.assert_allclose(o, want, rtol=tol, atol=tol)


def assert_forms_agree(call, args, forms, *, segment_ids, key, chunk_size=4):
  """The forms of ``call`` (``call(args, implementation=, chunk_size=, segment_ids=)`` ->
  ``(o, final_state)``) agree with ``forms[0]``: the value of a random linear function of
  ``o`` and the final state, and its gradient with respect to every entry of ``args`` (each
  of which must be non-zero)."""
  # the shapes only: no compilation of a forward that the gradients recompute anyway
  o, S = jax.eval_shape(functools.partial(call, implementation=forms[0], chunk_size=chunk_size,
                                          segment_ids=segment_ids), args)
  keys = iter(jax.random.split(key, 4))
  w = (jax.random.normal(next(keys), o.shape),
       jax.tree.map(lambda s: jax.random.normal(next(keys), s.shape), S))

  def loss(form, args, w):
    o, S = call(args, implementation=form, chunk_size=chunk_size, segment_ids=segment_ids)
    return jnp.sum(o * w[0]) + sum(jnp.sum(s * c) for s, c in zip(
        jax.tree.leaves(S), jax.tree.leaves(w[1]), strict=True))

  results = {f: jax.jit(jax.value_and_grad(functools.partial(loss, f)))(args, w) for f in forms}
  want_v, want_g = results[forms[0]]
  for form in forms[1:]:
    got_v, got_g = results[form]
    np.testing.assert_allclose(got_v, want_v, rtol=1e-5, err_msg=form)
    for name in args:
      for got, want in zip(jax.tree.leaves(got_g[name]), jax.tree.leaves(want_g[name]),
                           strict=True):
        scale = float(jnp.max(jnp.abs(want)))
        assert scale > 0, f"d/d{name} is 0"
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * scale,
                                   err_msg=f"{form} d/d{name}")


def assert_steps_match(step, xs, state, o, final_state, *, tol=1e-5):
  """``step(x_t, state) -> (o_t, state)`` token by token over ``xs`` (a dict of
  ``[B, T, ...]`` arrays, sliced at each ``t``; the Python int ``t`` is ``x_t["t"]``) gives
  the full call's ``o`` and ``final_state``. Returns the last state (for a caller to compare
  a part of it)."""
  outs = []
  for t in range(o.shape[1]):
    o_t, state = step({n: x[:, t] for n, x in xs.items()} | {"t": t}, state)
    outs.append(o_t)
  np.testing.assert_allclose(jnp.stack(outs, axis=1), o, rtol=tol, atol=tol)
  if final_state is not None:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=tol, atol=tol),
                 state, final_state)
  return state
