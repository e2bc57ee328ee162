"""The Mosaic TPU driver: generic interpret mode, TPU interpret mode, race detection."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

import kernels_pallas as kp
from tests.kernels_pallas.test_engine import ENGINE_NAMES, assert_matches, inputs, reference

# Mosaic tiles: query blocks a multiple of 8, key blocks of 128 lanes (segment ids are
# blocked along the lane axis).
SMALL = dict(block_q=16, block_k=128)
DEFAULT_NAMES = ["softmax", "softpick", "stablemax", "sigmoid"]
# A sample of the classes by default, every E/S/P normalizer under -m slow.
NAMES = [n if n in DEFAULT_NAMES else pytest.param(n, marks=pytest.mark.slow)
         for n in ENGINE_NAMES]


def _kfn(name, interpret=True, block_sizes=SMALL, **kw):
  def f(q, k, v):
    return kp.attention(q, k, v, normalizer=name, backend="mosaic_tpu", interpret=interpret,
                        block_sizes=block_sizes, **kw)
  return f


@pytest.mark.parametrize("name", NAMES)
def test_mosaic_driver_causal_gqa(name):
  q, k, v, ct = inputs(t=40, n=4, kh=2, seed=20)
  assert_matches(_kfn(name, is_causal=True),
                 lambda q, k, v: reference(q, k, v, normalizer=name, is_causal=True),
                 (q, k, v), ct)


def test_mosaic_driver_segments_window_cross():
  b, t, s = 2, 24, 150
  q, k, v, ct = inputs(b=b, t=t, s=s, n=2, kh=1, seed=22)
  seg = (jnp.array([[0] * 12 + [1] * 12, [1] * 24], jnp.int32),
         jnp.array([[0] * 100 + [1] * 50, [0] * 75 + [1] * 75], jnp.int32))
  kv_len = jnp.array([150, 120], jnp.int32)
  assert_matches(
      _kfn("softmax", segment_ids=seg, local_window_size=(200, 100),
           key_value_seq_lengths=kv_len),
      lambda q, k, v: reference(q, k, v, segment_ids=seg, window=(200, 100), kv_len=kv_len),
      (q, k, v), ct)


def test_mosaic_default_blocks_long():
  # T = 384: Mosaic's default tiles (384 rows, 384 keys: one tile, multiple of 128).
  q, k, v, ct = inputs(t=384, n=1, kh=1, h=64, seed=23)
  assert_matches(_kfn("softmax", block_sizes=None, is_causal=True),
                 lambda q, k, v: reference(q, k, v, is_causal=True), (q, k, v), ct)


def test_force_tpu_interpret_mode():
  q, k, v, ct = inputs(t=32, n=2, kh=1, seed=24)
  with pltpu.force_tpu_interpret_mode():
    assert_matches(_kfn("sigmoid", interpret=False, is_causal=True),
                   lambda q, k, v: reference(q, k, v, normalizer="sigmoid", is_causal=True),
                   (q, k, v), ct)


def test_tpu_interpret_detect_races_uninitialized_nan():
  # Uninitialized memory reads NaN: any scratch or output the kernel forgets to write
  # shows up in the result; races between grid steps are reported.
  q, k, v, ct = inputs(t=32, n=2, kh=1, seed=25)
  params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
  assert_matches(_kfn("softmax", interpret=params, is_causal=True),
                 lambda q, k, v: reference(q, k, v, is_causal=True), (q, k, v), ct)
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  assert ipc.races is not None and not ipc.races.races_found

