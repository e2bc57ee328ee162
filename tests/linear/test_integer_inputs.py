"""Integer (and boolean) inputs promote as jax.nn's do (issue 37, defect 16).

``jax.nn.softmax`` and jaxsoft's attention and normalizers take integer arrays and compute in
the float they promote to (float32; float64 for 64-bit integers under x64); jaxsoft.linear
raised "must be a floating array". Every public function of the family, its decoding step
included, now gives on integer ``q, k, v`` (and integer gates, ``beta``, ``eta`` where
integers are valid values) exactly what it gives on the same values cast to float32, in
float32.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft import linear

B, T, N, K, V = 1, 5, 2, 3, 2


def _ints(shape, seed, low=-2, high=3):
  return jnp.asarray(np.random.default_rng(seed).integers(low, high, shape), jnp.int32)


def _qkv(step=False):
  lead = (B, N) if step else (B, T, N)
  return _ints(lead + (K,), 0), _ints(lead + (K,), 1), _ints(lead + (V,), 2)


def _gate(step=False, per_channel=False):  # log decays in {-1, 0}: integers, <= 0
  lead = (B, N) if step else (B, T, N)
  return _ints(lead + ((K,) if per_channel else ()), 3, -1, 1)


def _beta(step=False):                     # write strengths in {0, 1}
  return _ints((B, N) if step else (B, T, N), 4, 0, 2)


def _seq(fn, **kw):
  return lambda: (fn, _qkv(), kw)


# name -> (function, integer arguments, keyword arguments)
CALLS = {
    "linear_attention": lambda: (linear.linear_attention, _qkv(), {}),
    "simple_gla": lambda: (linear.simple_gla, _qkv() + (_gate(),), {}),
    "gla": lambda: (linear.gla, _qkv() + (_gate(per_channel=True),), {}),
    "delta_rule": lambda: (linear.delta_rule, _qkv() + (_beta(),), {}),
    "gated_delta_rule": lambda: (linear.gated_delta_rule, _qkv() + (_gate(), _beta()), {}),
    "lightning_attention": _seq(linear.lightning_attention),
    "taylor_linear_attention": _seq(linear.taylor_linear_attention),
    "cosformer": _seq(linear.cosformer),
    "mala": _seq(linear.mala),
    "ttt_linear": lambda: (linear.ttt_linear, _qkv() + (_beta(),), {"mini_batch_size": 2}),
    "rala": _seq(linear.rala),
    "ccq": lambda: (linear.ccq, _qkv() + (_gate(), _beta()), {}),
    "softmax_linear_attention": lambda: (
        linear.softmax_linear_attention, _qkv() + (_ints((B, T, N), 5),), {}),
    "native_hybrid_attention": lambda: (
        linear.native_hybrid_attention, _qkv() + (_ints((B, T, N, 2), 6, -1, 1),),
        {"window": 2}),
    "mhla": lambda: (linear.mhla, _qkv() + (_ints((2, 2), 7, 0, 2),), {"block_size": 3}),
    "interdomain_attention": lambda: (
        linear.interdomain_attention,
        _qkv() + (_ints((B, T, N, 2), 8), _ints((B, T, N, 2), 9), _ints((N, 2), 10, -1, 1)),
        {}),
    # decoding steps
    "linear_attention_step": lambda: (linear.linear_attention_step, _qkv(True), {}),
    "simple_gla_step": lambda: (linear.simple_gla_step, _qkv(True) + (_gate(True),), {}),
    "gla_step": lambda: (linear.gla_step, _qkv(True) + (_gate(True, True),), {}),
    "delta_rule_step": lambda: (linear.delta_rule_step, _qkv(True) + (_beta(True),), {}),
    "gated_delta_rule_step": lambda: (
        linear.gated_delta_rule_step, _qkv(True) + (_gate(True), _beta(True)), {}),
    "ttt_linear_step": lambda: (linear.ttt_linear_step, _qkv(True) + (_beta(True),),
                                {"mini_batch_size": 2}),
    "native_hybrid_attention_step": lambda: (
        linear.native_hybrid_attention_step, _qkv(True) + (_ints((B, N, 2), 6, -1, 1),),
        {"window": 2}),
}


# a few representative calls by default (each compiles twice); the whole table under -m slow
SAMPLED = ("ttt_linear_step",)


def _as_float32(args):
  return tuple(jnp.asarray(a, jnp.float32) for a in args)


def _check(name):
  fn, args, kw = CALLS[name]()
  assert all(jnp.issubdtype(a.dtype, jnp.integer) for a in args)
  call = jax.jit(functools.partial(fn, **kw))
  got, want = call(*args), call(*_as_float32(args))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    if jnp.issubdtype(w.dtype, jnp.floating):   # (ttt_linear_step's state counts tokens)
      assert g.dtype == jnp.float32, (name, g.dtype)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


@pytest.mark.parametrize("name", SAMPLED)
def test_integer_inputs_compute_as_their_float32_values(name):
  _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(CALLS) - set(SAMPLED)))
def test_integer_inputs_compute_as_their_float32_values_every_function(name):
  _check(name)


def test_boolean_inputs_promote_too():
  q, k, v = (a > 0 for a in _qkv(step=True))
  step = jax.jit(linear.simple_gla_step)
  g = jnp.log(jnp.array([[0.5, 0.25]]))
  got, want = step(q, k, v, g), step(*_as_float32((q, k, v)), g)
  for a, b in zip(got, want, strict=True):
    assert a.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_complex_inputs_are_still_refused_naming_the_argument():
  q, k, v = _as_float32(_qkv())
  with pytest.raises(ValueError, match=r"simple_gla: `v` must be a real"):
    linear.simple_gla(q, k, v.astype(jnp.complex64), _as_float32((_gate(),))[0])
