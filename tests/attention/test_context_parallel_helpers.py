"""The two context-parallel helpers callers use directly: ``load_balance_order`` (the
dual-chunk permutation) and ``short_conv_halo`` (the previous shard's convolution inputs),
in-process on one device; their multi-device behaviour is tested through
``context_parallel_attention`` and ``context_parallel_mixer`` in subprocesses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxsoft as js


@pytest.mark.parametrize("length,cp", [(8, 1), (8, 2), (24, 4)])
def test_load_balance_order_is_the_dual_chunk_permutation(length, cp):
  order = js.attention.load_balance_order(length, cp)
  assert order.dtype == np.int32 and sorted(order.tolist()) == list(range(length))
  c = length // (2 * cp)
  for i, shard in enumerate(order.reshape(cp, 2 * c)):   # device i: chunks i and 2cp-1-i
    want = list(range(i * c, (i + 1) * c)) + list(range((2 * cp - 1 - i) * c, (2 * cp - i) * c))
    assert shard.tolist() == want


def test_natural_order_undoes_the_dual_chunk_order():
  """The static reshape and flip that all_gather and ulysses use to put gathered rows back
  in sequence order, and its inverse, against load_balance_order's permutation (rows
  carrying their position and a trailing feature axis), for cp = 4 (and 1, the identity)."""
  from jaxsoft.attention.context_parallel import _balanced_order, _natural_order

  for length, cp in ((24, 4), (8, 1)):
    order = js.attention.load_balance_order(length, cp)
    x = np.arange(2 * length * 3).reshape(2, length, 3)  # [B, L, F]
    balanced = x[:, order]
    np.testing.assert_array_equal(_natural_order(jnp.asarray(balanced), cp), x)
    np.testing.assert_array_equal(_balanced_order(jnp.asarray(x), cp), balanced)


@pytest.mark.parametrize("length,cp", [(10, 4), (8, 0)])
def test_load_balance_order_names_the_length_and_cp(length, cp):
  with pytest.raises(ValueError, match=rf"sequence length \({length}\).*cp = {cp}"):
    js.attention.load_balance_order(length, cp)


def _halo(x, conv_size):
  mesh = jax.make_mesh((1,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
  return jax.shard_map(lambda a: js.linear.short_conv_halo(a, conv_size, axis_name="cp"),
                       mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))(x)


def test_short_conv_halo_of_the_first_shard_is_zeros():
  x = jnp.arange(12.0).reshape(1, 4, 3) + 1.0
  halo = _halo(x, 3)
  assert halo.shape == (1, 2, 3) and not np.any(np.asarray(halo))


@pytest.mark.parametrize("conv_size,x,name", [(0, jnp.ones((1, 4, 1)), "conv_size"),
                                              (True, jnp.ones((1, 4, 1)), "conv_size"),
                                              (4, jnp.ones((1, 2, 1)), "x")])
def test_short_conv_halo_names_the_bad_argument(conv_size, x, name):
  with pytest.raises(ValueError, match=f"`{name}`"):
    _halo(x, conv_size)
