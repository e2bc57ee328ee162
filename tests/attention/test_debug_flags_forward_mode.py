"""Forward mode on the blockwise attention paths under ``jax.debug_infs`` / ``jax.debug_nans``.

Without the flags, ``jax.jvp`` / ``jax.jacfwd`` (and second order) of ``xla_chunked`` and
the Pallas kernels raise :class:`jaxsoft.attention.UnsupportedDifferentiation`, naming the
implementation and the dense path; ``implementation=None`` (or a list) catches it and runs
the dense path. With a flag on, those paths run inside the debug wrapper's custom VJP
(``jaxsoft/attention/_debug_checks.py``), and forward mode gave JAX's bare
"can't apply forward-mode autodiff (jvp) to a custom_vjp function" TypeError instead, which
no automatic choice catches. Both flags, both paths: the same clear error as without them,
and a list of implementations falls back to the dense path, whose tangent it returns.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from kernels_pallas.backends import INTERPRET_ENV

FLAGS = {"debug_infs": jax.debug_infs, "debug_nans": jax.debug_nans}


def _inputs():
  ks = jax.random.split(jax.random.key(0), 2)
  q = jax.random.normal(ks[0], (1, 8, 2, 4), jnp.float32)
  return q, jax.random.normal(ks[1], q.shape, jnp.float32)


def _attend(implementation):
  return lambda q: js.attention.dot_product_attention(q, q, q, is_causal=True,
                                                      implementation=implementation)


@pytest.mark.parametrize("flag", sorted(FLAGS))
@pytest.mark.parametrize("implementation", ["xla_chunked", "pallas"])
def test_forward_mode_under_debug_flags_raises_the_clear_error(implementation, flag,
                                                               monkeypatch):
  monkeypatch.setenv(INTERPRET_ENV, "1")
  q, t = _inputs()
  f = _attend(implementation)
  derivatives = {
      "jvp": lambda: jax.jvp(f, (q,), (t,)),
      "jacfwd": lambda: jax.jacfwd(lambda q: f(q).sum())(q),
      "hessian": lambda: jax.hessian(lambda q: f(q).sum())(q),
  }
  for what, take in derivatives.items():
    with FLAGS[flag](True), pytest.raises(js.attention.UnsupportedDifferentiation) as err:
      take()
    assert f"implementation='{implementation}'" in str(err.value), (what, str(err.value))
    assert "implementation='xla'" in str(err.value), what  # the way out


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_forward_mode_under_debug_flags_falls_back_to_the_dense_path(flag):
  q, t = _inputs()
  jvp = jax.jit(lambda impl, q, t: jax.jvp(_attend(impl), (q,), (t,)), static_argnums=0)
  want = jvp("xla", q, t)
  with FLAGS[flag](True):
    got = jvp(("xla_chunked", "xla"), q, t)
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
