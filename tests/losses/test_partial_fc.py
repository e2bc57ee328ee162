"""L07 partial_fc_loss: equal to the unsharded margin loss at sampling rate 1, equal to the
margin loss over the sampled classes below it; sharded over 8 CPU devices in a subprocess."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests import helpers
from tests.helpers import check_raises, normal

L = js.losses
B, D, C = 6, 8, 24
LABELS = jnp.array([0, 5, 9, 15, 23, 5])


def _inputs():
  return normal(0, (B, D)), normal(1, (D, C))


def _value_and_grads(f, x, w):
  ct = normal(9, (B,))
  return jax.jit(lambda a, b: (f(a, b), jax.vjp(f, a, b)[1](ct)))(x, w)


@pytest.mark.parametrize("margin_type", ["arcface", "cosface"])
def test_rate_one_equals_the_margin_loss(margin_type):
  x, w = _inputs()
  ours = _value_and_grads(lambda a, b: L.partial_fc_loss(
      a, b, LABELS, margin_type=margin_type, scale=16.0, margin=0.3), x, w)
  ref_fn = L.arcface_loss if margin_type == "arcface" else L.cosface_loss
  ref = _value_and_grads(lambda a, b: ref_fn(a, b, LABELS, scale=16.0, margin=0.3), x, w)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), ours, ref)


def test_sampling_is_the_margin_loss_over_the_sampled_classes():
  x, w = _inputs()
  key = jax.random.key(3)
  f = lambda a, b: L.partial_fc_loss(a, b, LABELS, sample_rate=0.25, key=key, scale=16.0)
  loss, (dx, dw) = _value_and_grads(f, x, w)
  sampled = np.any(np.asarray(dw) != 0, axis=0)
  # every positive is kept, plus negatives up to max(ceil(0.25 C), min(B, C)) = 6 in all
  assert sampled[np.asarray(LABELS)].all() and sampled.sum() == 6
  ref_loss, (ref_dx, ref_dw) = _value_and_grads(
      lambda a, b: L.arcface_loss(a, b, LABELS, scale=16.0, where=jnp.asarray(sampled)[None]),
      x, w)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dw, ref_dw, rtol=1e-4, atol=1e-5)
  full, again, other = jax.jit(lambda x, w: (
      L.arcface_loss(x, w, LABELS, scale=16.0),
      L.partial_fc_loss(x, w, LABELS, sample_rate=0.25, key=key, scale=16.0),
      L.partial_fc_loss(x, w, LABELS, sample_rate=0.25, key=jax.random.key(4), scale=16.0)))(x, w)
  assert np.all(loss <= full + 1e-5)
  # the same key samples the same classes: equal up to the rounding of another compiled
  # program (1 ulp seen); another key samples others
  np.testing.assert_allclose(again, loss, rtol=1e-6, atol=0)
  assert not np.allclose(other, loss, rtol=1e-4, atol=0)


def test_masks_ignore_index_and_one_device_mesh():
  x, w = _inputs()
  labels = LABELS.at[1].set(-100).at[2].set(C)
  where = jnp.array([True, True, True, False, True, True])
  mesh = jax.make_mesh((1,), ("model",))
  out, ref, lo = jax.jit(lambda x, w: (
      L.partial_fc_loss(x, w, labels, mesh=mesh, where=where, ignore_index=-100),
      L.arcface_loss(x, w, labels, where=where, ignore_index=-100),
      L.partial_fc_loss(x.astype(jnp.bfloat16), w, LABELS)))(x, w)
  np.testing.assert_allclose(out, ref, rtol=1e-5)
  assert out[1] == 0.0 and out[3] == 0.0 and out[2] == jnp.inf
  assert lo.dtype == jnp.bfloat16


SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jaxsoft as js
    assert jax.device_count() == 8
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    x = jax.random.normal(jax.random.key(0), (6, 8))
    w = jax.random.normal(jax.random.key(1), (8, 32, 2))     # 2 sub-centres per class
    y = jnp.array([0, 7, 8, 15, 31, 7])
    ct = jax.random.normal(jax.random.key(2), (6,))
    def run(f, w):
      return jax.jit(lambda a, b: (f(a, b), jax.vjp(f, a, b)[1](ct)))(x, w)
    # the centres live sharded over "model"; the references get a plain copy
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "model", None)))
    pfc = lambda **kw: (lambda a, b: js.losses.partial_fc_loss(a, b, y, mesh=mesh, scale=16.0,
                                                               **kw))
    ours = run(pfc(), ws)
    ref = run(lambda a, b: js.losses.arcface_loss(a, b, y, scale=16.0), w)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), ours, ref)
    assert ours[1][1].sharding.spec == P(None, "model", None), ours[1][1].sharding
    # sampled: 8 classes per shard, 2 kept (max(ceil(0.25 * 8), min(6, 8)) = 6 of 8)
    loss, (dx, dw) = run(pfc(sample_rate=0.25, key=jax.random.key(5), margin_type="cosface",
                             margin=0.35), ws)
    sampled = np.any(np.asarray(dw) != 0, axis=(0, 2))
    assert sampled[np.asarray(y)].all() and sampled.reshape(4, 8).sum(1).tolist() == [6] * 4
    ref_loss, (rdx, rdw) = run(lambda a, b: js.losses.cosface_loss(
        a, b, y, scale=16.0, where=jnp.asarray(sampled)[None]), w)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, rdx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw, rdw, rtol=1e-4, atol=1e-5)
    print("PARTIAL_FC_OK")
""")


def test_class_sharded_on_8_devices():
  env = dict(os.environ)
  env["XLA_FLAGS"] = helpers.fake_device_flags(8)
  env["JAX_PLATFORMS"] = "cpu"
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "PARTIAL_FC_OK" in proc.stdout


def test_bad_input_names_the_argument():
  x, w = _inputs()
  mesh = jax.make_mesh((1,), ("model",))
  check_raises(
      ("`embeddings`", lambda: L.partial_fc_loss(x[0], w, LABELS[0])),
      ("`class_weights`", lambda: L.partial_fc_loss(x, w.T, LABELS)),
      ("`labels`", lambda: L.partial_fc_loss(x, w, LABELS[:3])),
      ("`sample_rate`", lambda: L.partial_fc_loss(x, w, LABELS, sample_rate=0.0)),
      ("`key`", lambda: L.partial_fc_loss(x, w, LABELS, sample_rate=0.5)),
      ("`margin_type`", lambda: L.partial_fc_loss(x, w, LABELS, margin_type="sphere")),
      ("`margin`", lambda: L.partial_fc_loss(x, w, LABELS, margin=-1.0)),
      ("`class_axis`", lambda: L.partial_fc_loss(x, w, LABELS, mesh=mesh, class_axis="x")),
      ("`where`", lambda: L.partial_fc_loss(x, w, LABELS, where=jnp.ones((2,), bool))),
  )
