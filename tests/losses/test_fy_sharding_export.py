"""linear_cross_entropy and fenchel_young_loss under JAX's data-parallel defaults and
jax.export (issue 37, defects 13, 14 and 16).

- A token batch sharded over ``data`` on an Explicit mesh and inside ``jax.shard_map``
  (default ``check_vma``, the weight replicated): linear_cross_entropy's loops carried
  ``jnp.zeros(shape)`` ("scan body function carry input and carry output must have equal
  types"), scanned over the sharded token axis and gathered label columns with no output
  sharding; the loss and the gradients in ``h`` and ``w`` must equal the unsharded ones
  (the gradient of the replicated ``w`` summed over the shards, as autodiff gives it).
- ``jax.export`` with a symbolic batch: ``min(token_chunk_size, n)`` compared a symbolic
  token count; the exported loss and gradient must equal the jitted ones at two batch sizes.
- Integer hidden states and weights promote as jax.nn's inputs do.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jaxsoft as js
from tests.helpers import run_on_cpu_devices

_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import jaxsoft as js

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    h = jax.random.normal(jax.random.key(1), (8, 5))
    w = jax.random.normal(jax.random.key(2), (5, 7))
    labels = jnp.array([0, 1, 2, 3, 4, 5, 6, 1], jnp.int32)

    def loss_and_grads(h, w, y):
      def total(h, w):
        loss = js.losses.linear_cross_entropy(h, w, y, label_smoothing=0.1, z_loss=1e-3,
                                              softcap=3.0, vocab_chunk_size=3,
                                              token_chunk_size=2)
        return jnp.sum(loss * jnp.cos(jnp.arange(8.0)[: loss.shape[0]])), loss
      (_, loss), grads = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(h, w)
      return loss, grads

    want = jax.jit(loss_and_grads)(h, w, labels)
    data = NamedSharding(mesh, P("data"))
    hs, ys = jax.device_put(h, data), jax.device_put(labels, data)
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):
      explicit = jax.jit(loss_and_grads)(hs, ws, ys)
    # in shard_map each shard sees 4 tokens (the weights of the cotangent restart at 0)
    def local(h, w, y):
      loss, (dh, dw) = loss_and_grads(h, w, y)
      return loss, (dh, dw)
    want_local = [jax.jit(loss_and_grads)(h[i:i + 4], w, labels[i:i + 4]) for i in (0, 4)]
    sm = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                               out_specs=(P("data"), (P("data"), P()))))(hs, ws, ys)
    want_sm = (jnp.concatenate([a[0] for a in want_local]),
               (jnp.concatenate([a[1][0] for a in want_local]),
                want_local[0][1][1] + want_local[1][1][1]))
    for mode, got, ref in (("explicit", explicit, want), ("shard_map", sm, want_sm)):
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                                   err_msg=mode)
    # a token chunk that does not divide the sharded tokens would pad a sharded axis: refused
    try:
      with jax.set_mesh(mesh):
        js.losses.linear_cross_entropy(hs, ws, ys, token_chunk_size=3)
    except ValueError as e:
      assert "linear_cross_entropy" in str(e) and "token_chunk_size" in str(e), e
    else:
      raise AssertionError("no error for token_chunk_size=3 on 8 sharded tokens")
    print("ok")
""")


def test_linear_cross_entropy_sharded_batch_gives_the_unsharded_results():
  proc = run_on_cpu_devices(_SCRIPT, 2)
  assert proc.stdout.split()[-1:] == ["ok"]


def _export_round_trip(f, make):
  """``f`` exported with a symbolic leading dimension, called at two batch sizes, against
  the jitted ``f``."""
  b, = export.symbolic_shape("b")
  specs = [jax.ShapeDtypeStruct((b,) + a.shape[1:], a.dtype) for a in make(3)]
  exported = export.export(jax.jit(f))(*specs)
  for batch in (3, 5):
    args = make(batch)
    got, want = exported.call(*args), jax.jit(f)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      assert g.shape == w.shape
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def _logits_and_labels(n_classes):
  def make(batch):
    x = jax.random.normal(jax.random.key(batch), (batch, 2, n_classes))
    return x, jnp.arange(2 * batch, dtype=jnp.int32).reshape(batch, 2) % n_classes
  return make


def test_linear_cross_entropy_exports_with_a_symbolic_batch():
  w = jax.random.normal(jax.random.key(7), (5, 7))

  def f(h, y):
    return jax.value_and_grad(lambda h: js.losses.linear_cross_entropy(
        h, w, y, vocab_chunk_size=3, token_chunk_size=4).sum())(h)

  def make(batch):
    return jax.random.normal(jax.random.key(batch), (batch, 3, 5)), jnp.ones((batch, 3), jnp.int32)

  _export_round_trip(f, make)


@pytest.mark.slow
@pytest.mark.parametrize("normalizer", ["softmax", "entmax"])
def test_fenchel_young_loss_exports_with_a_symbolic_batch(normalizer):
  """A guard (these two exported before too); sparsemax and entmax15 export once the
  threshold normalizers' row blocks keep a symbolic row count (normalizers.common)."""
  def f(x, y):
    return jax.value_and_grad(lambda x: js.losses.fenchel_young_loss(x, y, normalizer).sum())(x)

  _export_round_trip(f, _logits_and_labels(6))


def test_linear_cross_entropy_promotes_integer_inputs():
  h = jnp.asarray(np.random.default_rng(0).integers(-2, 3, (4, 3)), jnp.int32)
  w = jnp.asarray(np.random.default_rng(1).integers(-2, 3, (3, 5)), jnp.int32)
  y = jnp.array([0, 4, 2, 1], jnp.int32)
  got = js.losses.linear_cross_entropy(h, w, y, vocab_chunk_size=2)
  want = js.losses.linear_cross_entropy(h.astype(jnp.float32), w.astype(jnp.float32), y,
                                        vocab_chunk_size=2)
  assert got.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
