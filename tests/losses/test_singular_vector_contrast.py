"""pmrl_contrastive_regularizer (PMRL's contrastive regulariser on the leading singular
vectors, feature L17) against a float64 NumPy reference built on numpy's SVD: values,
gradients (finite differences), repeated singular values, masks, rotation invariance, bf16
and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from tests.helpers import check_raises, rows
from tests.losses.references import grads64

reg = jax.jit(js.losses.pmrl_contrastive_regularizer, static_argnames=("temperature",))


def _np_reg(e, tau, keep=None):
  """InfoNCE among the instances' leading right singular vectors (numpy SVD of the visible
  rows; sign: sum_m z_m . v >= 0), each its own positive; float64."""
  e = np.asarray(e, np.float64)
  n, m, _ = e.shape
  keep = np.ones((n, m), bool) if keep is None else keep
  z = e / np.linalg.norm(e, axis=-1, keepdims=True)
  inst = keep.any(-1)
  v = np.zeros((n, e.shape[-1]))
  for i in np.flatnonzero(inst):
    vi = np.linalg.svd(z[i][keep[i]])[2][0]
    v[i] = vi if np.sum(z[i][keep[i]] @ vi) >= 0 else -vi
  out = np.zeros(n)
  for i in np.flatnonzero(inst):
    logits = v[inst] @ v[i] / tau
    out[i] = np.log(np.exp(logits).sum()) - 1.0 / tau
  return out


def _case():
  e = np.asarray(rows(0, (5, 3, 4), 1.0), np.float64)
  keep = np.ones((5, 3), bool)
  keep[1, 2] = False
  keep[3] = False
  return e, keep


def test_against_reference_and_masks():
  e, keep = _case()
  inst = np.array([True, True, False, True, True])

  @jax.jit
  def run(e):
    f = lambda w: js.losses.pmrl_contrastive_regularizer(e, temperature=0.3, where=w)
    g = jax.grad(lambda x: jnp.sum(js.losses.pmrl_contrastive_regularizer(
        x, temperature=0.3, where=keep)))(e)
    return f(None), f(keep), f(inst), f(np.repeat(inst[:, None], 3, 1)), g

  full, masked, by_instance, by_modality, _ = run(jnp.asarray(e, jnp.float32))
  # float32 eigh of 3x3 Gram matrices: ~1e-6 relative in v, scaled by 1/tau -> 2e-5
  np.testing.assert_allclose(full, _np_reg(e, 0.3), rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(masked, _np_reg(e, 0.3, keep), rtol=2e-5, atol=2e-5)
  assert float(masked[3]) == 0.0
  # an instance mask [N] equals the modality mask of its rows
  np.testing.assert_allclose(by_instance, by_modality, rtol=1e-6)
  # identical modalities (sigma = (sqrt 3, 0, 0): repeated zeros) and one scaled: finite
  same = np.repeat(e[:, :1], 3, axis=1)
  same[0, 1] *= 2.0
  full, masked, _, _, g = run(jnp.asarray(same, jnp.float32))
  np.testing.assert_allclose(full, _np_reg(same, 0.3), rtol=2e-5, atol=2e-5)
  assert np.all(np.isfinite(np.asarray(g))) and np.all(np.isfinite(np.asarray(masked)))


@pytest.mark.slow
def test_gradients_float64():
  e, keep = _case()
  grads64(lambda a: reg(a, temperature=0.3), e)
  grads64(lambda a: reg(a, temperature=0.3, where=keep), e)


@pytest.mark.slow
def test_repeated_singular_values_rotation_and_bf16():
  base = np.asarray(rows(1, (4, 1, 5), 1.0), np.float64)
  same = np.repeat(base, 3, axis=1)  # identical modalities: sigma = (sqrt 3, 0, 0)
  same[0, 1] *= 2.0  # (scale is normalised away)

  @jax.jit
  def value_grad(a):
    return jax.value_and_grad(lambda x: jnp.sum(js.losses.pmrl_contrastive_regularizer(
        x, temperature=0.5)))(a)

  v, g = value_grad(jnp.asarray(same, jnp.float32))
  assert np.isfinite(float(v)) and np.all(np.isfinite(np.asarray(g)))
  np.testing.assert_allclose(v, _np_reg(same, 0.5).sum(), rtol=1e-5)
  # a common rotation changes nothing
  e = np.asarray(rows(2, (4, 3, 5), 1.0), np.float64)
  q = np.linalg.qr(np.random.default_rng(0).normal(size=(5, 5)))[0]
  np.testing.assert_allclose(reg(e @ q.T, temperature=0.5), reg(e, temperature=0.5),
                             rtol=1e-5, atol=1e-6)
  low = reg(jnp.asarray(e, jnp.bfloat16), temperature=0.5)
  assert low.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(low, np.float32),
                             _np_reg(np.asarray(jnp.asarray(e, jnp.bfloat16), np.float64), 0.5),
                             rtol=1e-2, atol=1e-2)  # bf16 output: 8 bits
  f = js.losses.pmrl_contrastive_regularizer
  check_raises(
      ("embeddings", lambda: f(jnp.ones((3, 4)))),
      ("temperature", lambda: f(jnp.ones((2, 3, 4)), temperature=0.0)),
      ("where", lambda: f(jnp.ones((2, 3, 4)), where=jnp.ones((2, 2), bool))))
