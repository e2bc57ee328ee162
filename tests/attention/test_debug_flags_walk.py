"""Every attention implementation with every registered normalizer under ``jax.debug_infs``
and ``jax.debug_nans`` (issue 37's guard: "the attention and normalizer tests also under
``jax.debug_infs`` / ``jax.debug_nans`` where the inputs are finite"; the normalizers
themselves are walked in tests/normalizers/test_debug_infs.py).

The walk: the implementations that run on a CPU (``xla``; ``xla_chunked`` with 4 x 4
blocks, so the keys span a whole block, a partly visible one and padding; ``pallas`` in
interpret mode) times every registered normalizer the implementation takes (class X, the
stochastic and iterative class, runs on ``xla`` only; a stochastic normalizer gets its key
through ``normalizer_params``). One call carries every kind of mask at once: ``is_causal``, a
dense mask that hides every key from query 0 (a fully masked row), key and query sequence
lengths (padded keys; rows past the query length) and segment ids with a local window.
The inputs are finite, so neither flag may trip, forward or backward (``jax.vjp`` called
eagerly under the flags, as a user would); the values and the gradients in q, k and v are
those of the same call without the flags, jitted. Both are float32 programs XLA compiles
apart (fusion, order), and the iterative solvers stop at the same tolerance: a few ulps,
checked at rtol 1e-5 / atol 1e-6, far below any change a wrong rule makes.

Default: the kernel classes the dense-path tests of tests/attention/test_debug_infs.py leave
out (S, P and R on ``xla``; its default covers E and T there and E on ``xla_chunked``);
``-m slow``: everything (the Pallas cases are also marked ``kernels``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js
from jaxsoft import normalizers as Nm
from jaxsoft.attention import _chunked
from jaxsoft.normalizers import spec as _spec
from kernels_pallas.backends import INTERPRET_ENV

B, T, N, K, H = 2, 6, 2, 1, 4
IMPLEMENTATIONS = ("xla", "xla_chunked", "pallas")
# hyperparameters a normalizer needs at this row length (top-k's k must be below it)
PARAMS = {"top_k_softmax": {"k": 2}}
DEFAULT = {("xla", "stablemax"), ("xla", "sigmoid"), ("xla", "standardized_softmax")}
MASKS = dict(
    is_causal=True,
    mask=jnp.asarray(np.tril(np.ones((T, T), bool), -1)),  # query 0 sees no key
    key_value_seq_lengths=jnp.array([4, 6], jnp.int32),
    query_seq_lengths=jnp.array([6, 3], jnp.int32),
    segment_ids=jnp.array([[0, 0, 1, 1, 1, 2]] * B, jnp.int32),
    local_window_size=(3, 0))


def _matrix():
  params = []
  for impl in IMPLEMENTATIONS:
    for name in Nm.names():
      if impl != "xla" and Nm.get(name).kernel_class == "X":
        continue
      marks = [] if (impl, name) in DEFAULT else [pytest.mark.slow]
      if impl == "pallas":
        marks.append(pytest.mark.kernels)
      params.append(pytest.param(impl, name, id=f"{impl}-{name}", marks=marks))
  return params


def test_the_default_covers_every_class_the_dense_tests_leave_out():
  """The default cases are registered names of the classes their comment says."""
  classes = {(impl, Nm.get(name).kernel_class) for impl, name in DEFAULT}
  assert classes == {("xla", "S"), ("xla", "P"), ("xla", "R")}
  assert {Nm.get(n).kernel_class for n in Nm.names()} == set(_spec.KERNEL_CLASSES)


def _inputs():
  rng = np.random.default_rng(0)
  q = rng.normal(size=(B, T, N, H))
  k, v = rng.normal(size=(2, B, T, K, H))
  ct = rng.normal(size=(B, T, N, H))
  return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, v, ct))


def _value_and_grads(impl, name):
  params = dict(PARAMS.get(name, {}))
  if Nm.get(name).needs_key:
    params["key"] = jax.random.key(3)

  def run(q, k, v, ct):
    def f(q, k, v):
      return js.attention.dot_product_attention(
          q, k, v, implementation=impl, normalizer=name, normalizer_params=params, **MASKS)
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(ct))

  return run


@pytest.mark.parametrize("impl,name", _matrix())
def test_finite_inputs_trip_neither_flag(impl, name, monkeypatch):
  monkeypatch.setattr(_chunked, "BLOCK_Q", 4)
  monkeypatch.setattr(_chunked, "BLOCK_K", 4)
  monkeypatch.setenv(INTERPRET_ENV, "1")
  args = _inputs()
  run = _value_and_grads(impl, name)
  want = jax.jit(run)(*args)
  for leaf in want:
    assert np.all(np.isfinite(np.asarray(leaf))), f"{impl}-{name}: the unchecked call"
  with jax.debug_infs(True), jax.debug_nans(True):
    got = run(*args)
  for i, (a, b) in enumerate(zip(got, want, strict=True)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                               err_msg=f"{impl}-{name}, output {i}")
