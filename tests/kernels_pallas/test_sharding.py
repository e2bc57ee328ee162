"""sharded_attention under jit on 8 fake CPU devices (its own process: the device count is
fixed at start-up), forward and gradients: array hyperparameters and segments against a
dense reference (and the residual pair, with distance scores); a dense bias, a dense mask
and FoX's decay (split along the axes they hold in full, kept whole along broadcast ones)
against the unsharded kernel and the dense XLA path."""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_sections_on_cpu_devices


def _prelude(t: int, seed: int) -> str:
  """The scripts' common start: imports, a 4 x 2 ("data", "model") mesh of the 8 devices,
  q, k, v and an output cotangent ``ct`` of ``t`` tokens, and ``rnd(*shape)``: float32
  normals from numpy's generator ``rng`` (no eager JAX compilation per draw)."""
  return textwrap.dedent(f"""
      import jax, jax.numpy as jnp, numpy as np
      from jax.sharding import NamedSharding, PartitionSpec as P
      import jaxsoft as js
      import kernels_pallas as kp

      assert jax.device_count() == 8
      mesh = jax.make_mesh((4, 2), ("data", "model"))
      b, t, n, kh, h = 4, {t}, 4, 2, 16
      rng = np.random.default_rng({seed})
      rnd = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
      q, ct = rnd(b, t, n, h), rnd(b, t, n, h)
      k, v = rnd(b, t, kh, h), rnd(b, t, kh, h)
  """)


SCRIPT = _prelude(32, 0) + textwrap.dedent("""
    from tests.kernels_pallas.test_engine import reference
    temp = jnp.array([1.0, 0.5, 2.0, 1.5]).reshape(n, 1, 1)
    seg = jnp.asarray(np.repeat(np.arange(2), 16)[None].repeat(b, 0), jnp.int32)
    def ref_loss(q, k, v, temp):
      o = reference(q, k, v, params={"temperature": temp}, segment_ids=seg, is_causal=True)
      return jnp.sum(o * ct), o
    # the references run jitted (one compilation rather than one per op) on one device
    (rval, rout), rgrads = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3),
                                                      has_aux=True))(q, k, v, temp)
    kw = dict(is_causal=True, normalizer="idw_softmax", score="distance",
              return_residual=True)
    ref_o, ref_r = jax.jit(lambda q, k, v: js.attention.dot_product_attention(
        q, k, v, implementation="xla", **kw))(q, k, v)
    shard = NamedSharding(mesh, P("data", None, "model", None))
    q, k, v = (jax.device_put(x, shard) for x in (q, k, v))

    def loss(q, k, v, temp):
      o = kp.sharded_attention(mesh, q, k, v, batch_axis="data", head_axis="model",
                               normalizer_params={"temperature": temp}, segment_ids=seg,
                               is_causal=True, backend="triton", interpret=True,
                               block_sizes=dict(block_q=16, block_k=16))
      return jnp.sum(o * ct), o

    with jax.set_mesh(mesh):
      (val, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                                     has_aux=True))(q, k, v, temp)
    np.testing.assert_allclose(out, rout, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, rgrads):
      np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)
    assert out.sharding.spec == P("data", None, "model", None), out.sharding

    # return_residual (the pair's residual sharded over batch and heads) with distances
    with jax.set_mesh(mesh):
      out_r, res = jax.jit(lambda q, k, v: kp.sharded_attention(
          mesh, q, k, v, batch_axis="data", head_axis="model", backend="triton",
          interpret=True, block_sizes=dict(block_q=16, block_k=16), **kw))(q, k, v)
    np.testing.assert_allclose(out_r, ref_o, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(res, ref_r, atol=1e-5, rtol=1e-5)
    assert res.sharding.spec == P("data", None, "model"), res.sharding
    print("SHARDED_OK")
""")


SCRIPT_DENSE = _prelude(16, 1) + textwrap.dedent("""
    bias = rnd(b, 1, t, t)                                   # per batch row, all heads
    mask = jnp.asarray(rng.random((1, n, t, t)) < 0.7)       # per head, all batch rows
    mask = mask | jnp.eye(t, dtype=bool)[None, None]         # every row sees its own key
    cq, ck = 0.3 * rnd(2, b, t, n)                           # FoX decay
    kw = dict(is_causal=True, normalizer="softmax_sink",
              normalizer_params={"sink_logit": 0.5})

    def loss(attn):
      def f(q, k, v, bias, cq, ck):
        o = attn(q, k, v, bias, mask, decay_bias=(cq, ck), **kw)
        return jnp.sum(o * ct), o
      return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))

    pallas = dict(backend="triton", interpret=True, block_sizes=dict(block_q=16, block_k=16))
    args = (q, k, v, bias, cq, ck)
    (_, ref_out), ref_grads = loss(lambda *a, **k_: kp.attention(*a, **k_, **pallas))(*args)
    (_, xla_out), xla_grads = loss(lambda *a, **k_: js.attention.dot_product_attention(
        *a, **k_, implementation="xla"))(*args)
    shard = NamedSharding(mesh, P("data", None, "model", None))
    q, k, v = (jax.device_put(x, shard) for x in (q, k, v))
    with jax.set_mesh(mesh):
      (_, out), grads = loss(lambda *a, **k_: kp.sharded_attention(
          mesh, *a, batch_axis="data", head_axis="model", **k_, **pallas))(
              q, k, v, bias, cq, ck)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(out, xla_out, atol=1e-5, rtol=1e-5)
    assert len(grads) == 6 and grads[3].shape == bias.shape
    for g, r, x in zip(grads, ref_grads, xla_grads):
      np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)
      np.testing.assert_allclose(g, x, atol=1e-4, rtol=1e-4)
    assert out.sharding.spec == P("data", None, "model", None), out.sharding
    print("SHARDED_DENSE_OK")
""")


# Both scripts run in one process (one start-up and import of JAX); each prints its marker
# or its traceback, so the two tests fail independently.
@pytest.fixture(scope="module")
def run_on_8_devices():
  return run_sections_on_cpu_devices([("sharded", SCRIPT), ("sharded_dense", SCRIPT_DENSE)], 8)


def test_sharded_attention_on_8_devices(run_on_8_devices):
  proc = run_on_8_devices
  assert "SHARDED_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_sharded_dense_bias_mask_and_decay_on_8_devices(run_on_8_devices):
  proc = run_on_8_devices
  assert "SHARDED_DENSE_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
