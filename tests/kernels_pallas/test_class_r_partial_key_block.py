"""Class R attention in the Pallas kernels when the key length is not a multiple of the key
block (issue 37, defect 17 reported ``affine_softmax`` at its defaults on the Pallas path at
S = 250 giving a weight of 1.0000305 and row sums off by 3e-5, where S = 256 was exact).
This guards the property; it is not that report's reproducer: at these shapes (and with
random q, k of head dimension 64, causal or not) the code before issue 37's first fix
(eb5ab18~1) already passed, so the reported configuration is still unidentified.

One query over S = 250 keys (``jaxsoft.testing.weight_probe``: the attention output is the
weight row) with the kernel's default blocks, so the last key block is partly padding, and
the same at S = 256 (no padding). The reference is the registered normalizer's own function
on the same scores in float64 (its dense formula, tested against numpy elsewhere), not any
attention path. Tolerance: float32 weights of rows of 250 terms, each a few float32 ulps of
its size, so 2e-6 absolute on weights <= 1; the defect's 3e-5 is fifteen times that. Rows:
a random one (scores N(0, 3^2)) and a peaked one (one score 20 above the rest: a weight
within 1e-7 of 1, where a padded key's mass shows most).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from jaxsoft import normalizers as Nm
from kernels_pallas.backends import INTERPRET_ENV

CLASS_R = [n for n in Nm.names() if Nm.get(n).kernel_class == "R"]


def _rows(s):
  rng = np.random.default_rng(5)
  random = 3.0 * rng.standard_normal(s)
  peaked = rng.standard_normal(s)
  peaked[s // 3] += 20.0
  return {"random": random.astype(np.float32), "peaked": peaked.astype(np.float32)}


# default: the defect's case (affine_softmax, S = 250); -m slow: every class-R normalizer at
# S = 250 and the unpadded S = 256
CASES = [pytest.param(name, s, id=f"{name}-{s}",
                      marks=() if (name, s) == ("affine_softmax", 250) else pytest.mark.slow)
         for name in CLASS_R for s in (250, 256)]


@pytest.mark.parametrize("name,s", CASES)
def test_partial_last_key_block_gives_the_normalizer_weights(name, s, monkeypatch):
  monkeypatch.setenv(INTERPRET_ENV, "1")
  rows = _rows(s)
  call = jax.jit(lambda q, k, v: js.attention.dot_product_attention(
      q, k, v, scale=1.0, normalizer=name, implementation="pallas"))
  for kind, z in rows.items():
    got = np.asarray(call(*js.testing.weight_probe(jnp.asarray(z)))[0, 0, 0], np.float64)
    with jax.enable_x64(True):
      want = np.asarray(Nm.get(name).fn(jnp.asarray(z, jnp.float64)))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6, err_msg=f"{name} {kind} S={s}")
    np.testing.assert_allclose(got.sum(), want.sum(), rtol=0, atol=2e-6,
                               err_msg=f"{name} {kind} S={s}: row sum")
