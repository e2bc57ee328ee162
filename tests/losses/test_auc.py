"""midam_auc_loss (feature L17) against a float64 reference: gradients, instance and bag
masks, extreme and bf16 inputs and bad input."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxsoft as js
from tests.helpers import check_raises, rows
from tests.losses.references import grads64, jitted_losses

L = jitted_losses({
    "midam_auc_loss": ("margin",),
})


def _np_midam(h, labels, tau, margin, inst=None):
  h = np.asarray(h, np.float64)
  inst = np.ones(h.shape, bool) if inst is None else np.asarray(inst)
  s = np.array([tau * np.log(np.mean(np.exp(r[k] / tau))) for r, k in zip(h, inst, strict=True)])
  pos, neg = s[np.asarray(labels) == 1], s[np.asarray(labels) == 0]
  return np.mean((margin - (pos[:, None] - neg[None, :])) ** 2)


def test_midam_against_reference_gradient_and_masks():
  h = np.asarray(rows(2, (5, 4), 1.5), np.float64)
  lab = np.array([1, 0, 1, 0, 0])
  inst = np.ones((5, 4), bool)
  inst[1, 2:] = False
  got = L.midam_auc_loss(jnp.asarray(h, jnp.float32), lab, temperature=0.7, margin=0.5,
                         where=inst)
  np.testing.assert_allclose(got, _np_midam(h, lab, 0.7, 0.5, inst), rtol=1e-5)
  grads64(lambda a: L.midam_auc_loss(a, lab, temperature=0.7, where=inst), h)
  # a masked bag is left out (as if deleted)
  bw = np.array([True, True, True, False, True])
  np.testing.assert_allclose(
      L.midam_auc_loss(h, lab, bag_where=bw),
      L.midam_auc_loss(h[bw], lab[bw]), rtol=1e-6)
  # shift invariance; no negative bag gives 0 with zero gradient
  np.testing.assert_allclose(L.midam_auc_loss(h + 3.0, lab), L.midam_auc_loss(h, lab), rtol=1e-5)
  v, g = jax.value_and_grad(lambda a: L.midam_auc_loss(a, jnp.ones(5, int)))(jnp.asarray(h))
  assert float(v) == 0.0 and not np.any(np.asarray(g))


def test_midam_extremes_bf16_and_errors():
  h = jnp.array([[1e4, -1e4], [-1e4, 3.0]], jnp.bfloat16)
  v, g = jax.value_and_grad(lambda a: L.midam_auc_loss(a, jnp.array([1, 0]), temperature=0.01))(h)
  assert np.isfinite(float(v)) and np.all(np.isfinite(np.asarray(g, np.float32)))
  check_raises(
      ("instance_scores", lambda: js.losses.midam_auc_loss(jnp.ones(3), jnp.ones(3, int))),
      ("bag_labels", lambda: js.losses.midam_auc_loss(jnp.ones((3, 2)), jnp.ones(2, int))),
      ("bag_labels", lambda: js.losses.midam_auc_loss(jnp.ones((3, 2)), jnp.ones(3))),
      ("temperature", lambda: js.losses.midam_auc_loss(jnp.ones((3, 2)), jnp.ones(3, int),
                                               temperature=0.0)),
      ("margin", lambda: js.losses.midam_auc_loss(jnp.ones((3, 2)), jnp.ones(3, int), margin=-1.0)))
