"""Ring attention (jaxsoft.attention._ring) on 4 fake CPU devices against the dense path.

Each check runs ``ring_attention`` inside ``jax.shard_map`` over a 4-device "context" axis,
in float64, on a sequence whose chunks are in the dual-chunk order of causal load balancing
(shard i holds chunks i and 2cp-1-i: positions are not contiguous per shard), with segment
ids and key validity that cross shard boundaries, and compares the output and the
gradients with respect to q, k and v with the single-device dense
``dot_product_attention(implementation="xla")`` given the equivalent boolean mask built
from the positions. Tolerance: the reference and the ring compute the same float64 sums
over at most 32 keys in a different order (errors ~1e-15, the measured figure); class T's
threshold search ends within 4 ulps of the threshold. 1e-9 leaves that margin a million
times over and stays far below any real mistake (a wrong key visible or hidden moves an
output by ~1e-1).
"""

import textwrap

import pytest

from tests.helpers import run_on_cpu_devices

PRELUDE = textwrap.dedent("""
    import os
    # these tests compile a dozen small programs and run each once: XLA's backend
    # optimisation would cost more than it saves
    os.environ["XLA_FLAGS"] += (" --xla_backend_optimization_level=0"
                                " --xla_llvm_disable_expensive_passes=true")
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_enable_x64", True)
    from jax.sharding import PartitionSpec as P
    import jaxsoft as js
    from jaxsoft.attention._ring import ring_attention

    CP = 4
    B, T, N, K, H = 2, 32, 4, 2, 8
    MESH = jax.make_mesh((CP,), ("context",), devices=jax.devices()[:CP],
                         axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    Q = jnp.asarray(rng.normal(size=(B, T, N, H)))
    KK = jnp.asarray(rng.normal(size=(B, T, K, H)))
    V = jnp.asarray(rng.normal(size=(B, T, K, H)))
    COT = jnp.asarray(rng.normal(size=(B, T, N, H)))
    C = T // (2 * CP)  # dual-chunk order: shard i holds chunks i and 2cp-1-i
    ORDER = np.concatenate([np.r_[i * C:(i + 1) * C, (2 * CP - 1 - i) * C:(2 * CP - i) * C]
                            for i in range(CP)])
    POS = jnp.asarray(np.broadcast_to(ORDER, (B, T)).astype(np.int32))
    # segments and padding cross the shard boundaries; in batch 0 the key at position 0 is
    # invalid, so (causal) the query at position 0 sees no key: its row must be zeros
    SEG = jnp.asarray(np.stack([(ORDER >= 13), (ORDER >= 20)]).astype(np.int32))
    VALID = jnp.asarray(np.stack([ORDER != 0, ORDER < 30]))
    TOL = 1e-9

    def call(name, causal, window, params, cap, segments):
      def f(q, k, v, pos, seg, valid):
        return ring_attention(
            q, k, v, axis_name="context", q_positions=pos, kv_positions=pos,
            q_segment_ids=seg if segments else None, kv_segment_ids=seg if segments else None,
            kv_valid=valid, is_causal=causal, local_window_size=window, normalizer=name,
            normalizer_params=params, scale=None, logits_soft_cap=cap, implementation=None)
      return jax.shard_map(f, mesh=MESH, in_specs=P(None, "context"),
                           out_specs=P(None, "context"))

    def dense_mask(causal, window, segments):
      pi, pj = POS[:, :, None], POS[:, None, :]
      vis = VALID[:, None, :] & jnp.ones(pi.shape, bool)
      if segments:
        vis = vis & (SEG[:, :, None] == SEG[:, None, :])
      if causal:
        vis = vis & (pj <= pi)
      if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        vis = vis & (pj >= pi - left) & (pj <= pi + right)
      return vis[:, None]

    def value_and_grads(fn):
      def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * COT), out
      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    def check(name, causal=True, window=None, params=None, cap=None, segments=True,
              grads=True):
      ring = call(name, causal, window, params, cap, segments)
      mask = dense_mask(causal, window, segments)

      def dense(q, k, v):
        return js.attention.dot_product_attention(
            q, k, v, mask=mask, normalizer=name, normalizer_params=params,
            logits_soft_cap=cap, implementation="xla")

      ring_grads = value_and_grads(lambda q, k, v: ring(q, k, v, POS, SEG, VALID))
      if grads:
        (_, got), g_got = ring_grads(Q, KK, V)
        (_, want), g_want = value_and_grads(dense)(Q, KK, V)
      else:
        got, g_got = jax.jit(ring)(Q, KK, V, POS, SEG, VALID), ()
        want, g_want = jax.jit(dense)(Q, KK, V), ()
      for what, a, b in zip(("out", "dq", "dk", "dv"), (got, *g_got), (want, *g_want)):
        assert bool(jnp.all(jnp.isfinite(a))), (name, what, "not finite")
        err = float(jnp.max(jnp.abs(a - b)))
        assert err <= TOL * (1.0 + float(jnp.max(jnp.abs(b)))), (name, causal, window, what, err)
      empty = ~jnp.any(mask[:, 0], axis=-1)  # rows with no visible key: zeros
      assert bool(jnp.all(jnp.where(empty[..., None, None], got, 0.0) == 0.0)), name
      return int(jnp.sum(empty)), ring_grads
""")


DEFAULT = PRELUDE + textwrap.dedent("""
    # one normalizer per kernel class: E, S, P, T; causal / not, a window, a soft cap. The
    # ring's backward (dK/dV travelling with their block) is class-agnostic around
    # tile.tile_vjp: its gradients are checked here for E and T (T has its own backward),
    # S and P forward only (the time budget; the slow matrix checks every gradient)
    empty, softmax_grads = check("softmax", causal=True)
    assert empty > 0  # the row at position 0 of batch 0 sees no key
    check("sparsemax", causal=False, window=(5, 3))
    check("stablemax", causal=False, window=(5, 3), grads=False)
    check("sigmoid", causal=True, cap=2.0, grads=False)

    # K/V (forward) and dK/dV (backward) travel by collective-permute
    hlo = softmax_grads.lower(Q, KK, V).compile().as_text()
    assert "collective-permute" in hlo

    # forward mode and second order: the project's clear refusal, not a wrong number
    ring = call("softmax", True, None, None, None, True)
    def second_order(f):
      return jax.grad(lambda q: jnp.sum(jax.grad(lambda p: jnp.sum(f(p) ** 2))(q)))(Q)

    for transform in (lambda f: jax.jvp(f, (Q,), (Q,)), second_order):
      try:
        transform(lambda q: ring(q, KK, V, POS, SEG, VALID))
      except js.attention.UnsupportedDifferentiation as e:
        assert "strategy='all_gather'" in str(e), e
      else:
        raise AssertionError("forward mode / second order was not refused")

    # class R is not run on the ring: a clear error naming it and the way out
    try:
      call("standardized_softmax", True, None, None, None, True)(Q, KK, V, POS, SEG, VALID)
    except NotImplementedError as e:
      assert "standardized_softmax" in str(e) and "strategy='all_gather'" in str(e), e
    else:
      raise AssertionError("class R was not refused")
    print("RING-OK")
""")


def test_ring_matches_dense_for_each_kernel_class():
  proc = run_on_cpu_devices(DEFAULT, 8)
  assert "RING-OK" in proc.stdout


# every registered normalizer of the classes the ring runs, causal and windowed
MATRIX = PRELUDE + textwrap.dedent("""
    import sys
    from jaxsoft.normalizers import spec as S
    names = [n for n in js.normalizers.names()
             if S.get(n).kernel_class in ("E", "S", "P", "T") and not S.get(n).needs_key]
    for name in names:
      spec = S.get(name)
      check(name, causal=True)
      check(name, causal=False, window=(6, 2), cap=3.0)
      check(name, causal=False, window=4, segments=False)
      samples = {p.name: p.sample for p in spec.params if p.sample is not None}
      if samples:
        check(name, causal=True, window=(3, 0), params=samples)
      print("OK", name, flush=True)
    print("MATRIX-OK", len(names))
""")


@pytest.mark.slow
def test_ring_matches_dense_for_every_normalizer():
  proc = run_on_cpu_devices(MATRIX, 8, timeout=3000)
  assert "MATRIX-OK" in proc.stdout, proc.stdout[-3000:]


# Class T's gradients on a 2-D (data, context) mesh, through context_parallel_attention with
# lengths, segment ids and causality: the batch split over "data" changes the varying axes of
# the threshold search's cotangents (a (2, 4) mesh of the 8 devices).
TWO_AXES = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_enable_x64", True)
    from jaxsoft.attention import context_parallel_attention, dot_product_attention

    mesh = jax.make_mesh((2, 4), ("data", "context"))
    B, T, N, K, H = 2, 32, 4, 2, 8
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)))
    k = jnp.asarray(rng.standard_normal((B, T, K, H)))
    v = jnp.asarray(rng.standard_normal((B, T, K, H)))
    seg = jnp.asarray([[0] * 5 + [1] * 14 + [2] * 13, [0] * 20 + [3] * 12], jnp.int32)
    masks = dict(is_causal=True, query_seq_lengths=jnp.array([30, 24]),
                 key_value_seq_lengths=jnp.array([27, 13]), segment_ids=seg)

    def grads(attend, name, params):
      loss = lambda q, k, v: jnp.sum(jnp.cos(attend(q, k, v, normalizer=name,
                                                     normalizer_params=params, **masks)))
      return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    ring = lambda *a, **kw: context_parallel_attention(*a, mesh=mesh, batch_axes="data",
                                                       strategy="ring", **kw)
    dense = lambda *a, **kw: dot_product_attention(*a, implementation="xla", **kw)
    for name, params in [("sparsemax", None), ("entmax", {"alpha": 1.3}),
                         ("top_k_softmax", {"k": 4})]:
      err = max(float(jnp.max(jnp.abs(a - b)))
                for a, b in zip(grads(ring, name, params), grads(dense, name, params)))
      assert err < 1e-9, (name, err)
    print("TWO-AXES-OK")
""")


@pytest.mark.slow
def test_ring_class_t_gradients_on_a_two_axis_mesh():
  proc = run_on_cpu_devices(TWO_AXES, 8)
  assert "TWO-AXES-OK" in proc.stdout, proc.stdout[-3000:]
