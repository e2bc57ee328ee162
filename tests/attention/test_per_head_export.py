"""``jax.export`` with a symbolic batch of attention with per-head hyperparameters (issue 37,
defect 14: shape arithmetic on ``np.broadcast_shapes`` broke the export).

The forward and the gradients in q, k, v and the per-head hyperparameter (entmax's
``alpha`` and SSMax's ``s``, each ``[N, 1, 1]``, as a learned per-head value is passed) are
exported with batch ``b`` symbolic, serialized, deserialized and called at two batch
sizes: equal to the jitted call of the same function at that size (the same program once the
batch is known; float32 rounding of a reordered reduction at most, 1e-6 on O(1) values).
The per-head values are distinct, and each head's output equals the call with that head's
value as a scalar, so a broadcast that dropped the head axis would fail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jaxsoft as js

T, N, H = 6, 3, 4
# normalizer: (hyperparameter name, per-head values)
CASES = {"entmax": ("alpha", (1.2, 1.5, 2.0)), "ssmax": ("s", (0.3, 1.0, 1.7))}


def _inputs(batch, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(key, (batch, T, N, H)) for key in keys)


def _value_and_grads(normalizer, implementation):
  name = CASES[normalizer][0]

  def loss(q, k, v, hp):
    out = js.attention.dot_product_attention(
        q, k, v, normalizer=normalizer, normalizer_params={name: hp}, is_causal=True,
        implementation=implementation)
    return jnp.sum(jnp.sin(out)), out

  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)


# -m slow: ~5 s each (the default suite exports attention with scalar hyperparameters in
# tests/test_transformation_walk.py)
@pytest.mark.slow
@pytest.mark.parametrize("normalizer,implementation", [
    (n, i) for n in sorted(CASES) for i in ("xla", "xla_chunked")])
def test_per_head_hyperparameter_attention_exports_with_a_symbolic_batch(normalizer,
                                                                          implementation):
  name, values = CASES[normalizer]
  hp = jnp.asarray(values, jnp.float32)[:, None, None]
  fn = _value_and_grads(normalizer, implementation)
  b, = export.symbolic_shape("b")
  spec = jax.ShapeDtypeStruct((b, T, N, H), jnp.float32)
  exported = export.deserialize(
      export.export(jax.jit(fn))(spec, spec, spec, jax.ShapeDtypeStruct(hp.shape, hp.dtype))
      .serialize())

  @jax.jit
  def scalar_calls(q, k, v):  # each head's value as a scalar, and the last head's for all
    return [js.attention.dot_product_attention(
        q, k, v, normalizer=normalizer, normalizer_params={name: value}, is_causal=True,
        implementation=implementation) for value in values]

  for batch in (2, 3):
    q, k, v = _inputs(batch, seed=batch)
    got = exported.call(q, k, v, hp)
    want = jax.jit(fn)(q, k, v, hp)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      assert g.shape == w.shape, (g.shape, w.shape)
      np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
  (_, out), (_, _, _, dhp) = got
  assert dhp.shape == (N, 1, 1) and float(jnp.abs(dhp).min()) > 0
  singles = scalar_calls(q, k, v)
  for head, single in enumerate(singles):  # the head axis is honoured
    np.testing.assert_allclose(out[:, :, head], single[:, :, head], rtol=1e-6, atol=1e-6)
  assert not np.allclose(out[:, :, 0], singles[2][:, :, 0], atol=1e-4)
