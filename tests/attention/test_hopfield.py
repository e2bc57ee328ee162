"""A03 hopfield_retrieval and hopfield_energy (jaxsoft/attention/_hopfield.py).

Every check compares to the explicit iteration written here (jax.nn.softmax, softmax_1 as
a softmax with a zero logit appended) on the output and on every input cotangent, plus the
energy's closed form, its descent and float64 finite differences.
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxsoft.attention import hopfield_energy, hopfield_retrieval
from tests.attention.reference import assert_fn_close
from tests.helpers import FWD, normal


def _softmax_1_ref(z):
  zz = jnp.concatenate([z, jnp.zeros(z.shape[:-1] + (1,), z.dtype)], axis=-1)
  return jax.nn.softmax(zz, axis=-1)[..., :-1]


def _hopfield_ref(xi, mem, beta, iters, normalize):
  for _ in range(iters):
    xi = normalize(beta * xi @ mem.T) @ mem
  return xi


def _patterns(m=8, d=32):
  mem = normal(0, (m, d))
  return mem / jnp.linalg.norm(mem, axis=-1, keepdims=True) * math.sqrt(d)


@pytest.mark.parametrize("normalizer", ["softmax", "softmax_1"])
def test_hopfield_large_beta_retrieves_stored_pattern(normalizer):
  mem = _patterns()
  noisy = mem[jnp.array([3, 5])] + normal(1, (2, 32), 0.3)
  out = hopfield_retrieval(noisy, mem, beta=4.0, num_iters=1, normalizer=normalizer)
  chex.assert_trees_all_close(out, mem[jnp.array([3, 5])], atol=1e-4)


@pytest.mark.parametrize("normalizer,ref", [
    ("softmax", lambda z: jax.nn.softmax(z, axis=-1)),
    ("softmax_1", _softmax_1_ref),
])
def test_hopfield_matches_explicit_iteration(normalizer, ref):
  mem = normal(2, (6, 5), 0.7)
  xi = normal(3, (3, 5))
  beta = jnp.float32(0.8)
  f = lambda x, m, b: hopfield_retrieval(x, m, beta=b, num_iters=3, normalizer=normalizer)
  r = lambda x, m, b: _hopfield_ref(x, m, b, 3, ref)
  assert_fn_close(f, r, (xi, mem, beta))


def test_hopfield_callable_normalizer_and_where():
  mem = normal(4, (6, 5))
  xi = normal(5, (2, 5))
  where = jnp.array([True, False, True, True, False, True])
  out = hopfield_retrieval(
      xi, mem, beta=0.5, num_iters=2,
      normalizer=lambda z, axis=-1, where=None: jax.nn.softmax(z, axis=axis, where=where),
      where=where)
  ref = _hopfield_ref(xi, mem[where], 0.5, 2, lambda z: jax.nn.softmax(z, axis=-1))
  chex.assert_trees_all_close(out, ref, **FWD)


@pytest.mark.parametrize("normalizer,offset", [("softmax", 0.0), ("softmax_1", 1.0)])
def test_hopfield_energy_does_not_increase(normalizer, offset):
  mem = normal(6, (10, 8))
  xi = normal(7, (4, 8))

  @jax.jit
  def energies(xi):
    es = [hopfield_energy(xi, mem, beta=0.3, offset=offset)]
    for _ in range(5):
      xi = hopfield_retrieval(xi, mem, beta=0.3, num_iters=1, normalizer=normalizer)
      es.append(hopfield_energy(xi, mem, beta=0.3, offset=offset))
    return jnp.stack(es)

  e = np.asarray(energies(xi))
  assert np.all(np.diff(e, axis=0) <= 1e-4), e
  assert np.all(e[-1] < e[0] - 1e-3), e  # and it does descend


def test_hopfield_energy_closed_form():
  mem = normal(8, (5, 3))
  xi = normal(9, (2, 3))
  z = 0.7 * xi @ mem.T
  want = -np.log(1.0 + np.exp(np.asarray(z, np.float64)).sum(-1)) / 0.7 + 0.5 * np.sum(
      np.asarray(xi, np.float64) ** 2, -1)
  np.testing.assert_allclose(hopfield_energy(xi, mem, beta=0.7), want, rtol=1e-5)


def test_hopfield_check_grads_f64():
  with jax.enable_x64(True):
    mem = jax.random.normal(jax.random.key(0), (5, 4), jnp.float64)
    xi = jax.random.normal(jax.random.key(1), (2, 4), jnp.float64)
    # jit: check_grads evaluates f many times; one compiled program instead of op by op
    f = jax.jit(lambda x, m, b: hopfield_retrieval(x, m, beta=b, num_iters=2,
                                                   normalizer="softmax_1"))
    check_grads(f, (xi, mem, jnp.float64(0.6)), order=1, modes=("rev",))


def test_hopfield_bf16_in_float32():
  mem = normal(10, (6, 8))
  xi = normal(11, (2, 8))
  out = jax.jit(lambda x, m: hopfield_retrieval(x, m, beta=0.5, num_iters=2))(
      xi.astype(jnp.bfloat16), mem.astype(jnp.bfloat16))
  assert out.dtype == jnp.bfloat16
  ref = jax.jit(lambda x, m: _hopfield_ref(x, m, 0.5, 2, _softmax_1_ref))(
      xi.astype(jnp.bfloat16).astype(jnp.float32), mem.astype(jnp.bfloat16).astype(jnp.float32))
  chex.assert_trees_all_close(out.astype(jnp.float32), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("call,arg", [
    (lambda: hopfield_retrieval(jnp.ones((2, 3)), jnp.ones((4, 3)), beta=1.0, num_iters=0),
     "num_iters"),
    (lambda: hopfield_retrieval(jnp.ones((2, 3)), jnp.ones((4, 3)), beta=-1.0), "beta"),
    (lambda: hopfield_retrieval(jnp.ones((2, 3)), jnp.ones((4, 2)), beta=1.0),
     "query_state"),
])
def test_bad_input_names_the_argument(call, arg):
  with pytest.raises(ValueError, match=arg):
    call()


def test_unknown_normalizer_is_a_key_error():
  with pytest.raises(KeyError, match="nope"):
    hopfield_retrieval(jnp.ones((2, 3)), jnp.ones((4, 3)), beta=1.0, normalizer="nope")
