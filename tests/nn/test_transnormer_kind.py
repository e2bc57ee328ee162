"""Feature A33, the gated TransNormer layer: ``LinearMixer(kind="transnormer")`` (a row of
jaxsoft/nn/_linear_kinds.py).

Oracle: the layer written out in jnp from its parameters (the projections, the short
convolution and SiLU, the LRPE-d attention as the dense formula ``Σ_{j<=i} λ^{i-j}
Σ_c q_ic k_jc cos(θ_c (i - j)) v_j / sqrt(K)``, the per-head RMS norm and the linear gate
``U = W_u x``, the output projection); one-token decoding against the full forward; the
learned LRPE angles get gradients (slow)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsoft import linear as js_linear
from jaxsoft import nn as js_nn
from tests import helpers

D, N, H, T, B = 8, 2, 4, 5, 2


def _layer(**kwargs):
  fn = lambda: js_nn.LinearMixer("transnormer", D, N, H, conv_size=2, layer_idx=1,
                                 num_layers=3, rngs=nnx.Rngs(0), **kwargs)
  graphdef, _ = nnx.split(nnx.eval_shape(fn))
  return nnx.merge(graphdef, jax.jit(lambda: nnx.state(fn()))())


def _by_hand(layer, x):
  p = lambda v: v[...]
  u = x @ p(layer.qkv.kernel)
  w = p(layer.conv)
  u = (w[1][None, None, :] * u                                 # width-2 causal conv
       + w[0][None, None, :] * jnp.pad(u, ((0, 0), (1, 0), (0, 0)))[:, :-1])
  q, k, v = (a.reshape(B, T, N, H) for a in jnp.split(jax.nn.silu(u), 3, axis=-1))
  theta = p(layer.lrpe_theta)                                              # [N, H]
  g = js_linear.lightning_decay(N, 1, 3)                                   # [N]
  i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
  d = (i - j).astype(jnp.float32)
  cos = jnp.cos(theta[:, None, None, :] * d[None, :, :, None])             # [N, T, T, H]
  decay = jnp.where(i >= j, jnp.exp(g[:, None, None] * jnp.maximum(d, 0.0)[None]), 0.0)
  s = jnp.einsum("bink,bjnk,nijk->bnij", q, k, cos) * decay[None] / jnp.sqrt(H)
  o = jnp.einsum("bnij,bjnv->binv", s, v)
  o = o / jnp.sqrt(jnp.mean(o * o, -1, keepdims=True) + 1e-6) * p(layer.o_norm)[None, None, None]
  return (o.reshape(B, T, N * H) * (x @ p(layer.gate.kernel))) @ p(layer.o.kernel)


def test_layer_matches_its_formula_and_decodes():
  layer = _layer()
  x = helpers.standard_normal(1, (B, T, D))
  graphdef, params = nnx.split(layer)

  @jax.jit
  def run(params, x):
    model = nnx.merge(graphdef, params)
    return model(x), _by_hand(model, x)

  full, want = run(params, x)
  # float32 layers of width 8 over 5 tokens: ~1e-6 relative; the RMS norm divides by
  # RMS(o) >= ~1e-2
  np.testing.assert_allclose(full, want, rtol=2e-4, atol=2e-5)
  np.testing.assert_array_equal(layer.lrpe_theta[...], js_linear.lrpe_theta(N, H))
  step = jax.jit(functools.partial(lambda g, p, x, s: nnx.merge(g, p).step(x, s), graphdef))
  state = layer.init_state(B)
  assert state["state"].shape == (B, N, 2 * H, H)
  outs = []
  for t in range(T):
    y, state = step(params, x[:, t], state)
    outs.append(y)
  np.testing.assert_allclose(jnp.stack(outs, 1), full, rtol=2e-4, atol=2e-5)
  assert "transnormer" in js_nn.LINEAR_MIXER_KINDS
  assert js_nn.LINEAR_MIXER_TABLE["transnormer"].direction == "causal"


@pytest.mark.slow
def test_the_angles_are_learned():
  layer = _layer()
  x = helpers.standard_normal(1, (B, T, D))
  graphdef, params = nnx.split(layer)
  grads = jax.jit(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p)(x) ** 2)))(params)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    assert bool(jnp.all(jnp.isfinite(g))), path
    assert float(jnp.max(jnp.abs(g))) > 0, path
  assert grads["lrpe_theta"][...].shape == (N, H)
