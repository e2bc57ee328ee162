"""One tile rule, three users: the reference evaluators of jaxsoft.testing, the chunked XLA
attention path and the Pallas engine all run ``jaxsoft.normalizers.tile``.

The rules here are written for this test (not registered) and chosen where readings of a
rule used to disagree: a class-S rule whose offset depends on the stabiliser (a user that
ran a max for class S would change it), a class-E rule whose denominator differs from its
numerator, with an offset and a floor, and a class-P rule. Each is compared with a closed
form written independently of the rule, forward and backward; declarations that do not fit
their class are rejected when the spec is built.
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from jaxsoft import testing
from jaxsoft.attention import _chunked
from jaxsoft.attention import dot_product_attention as dpa
from jaxsoft.normalizers import REGISTRY, NormalizerSpec, TileRule
from jaxsoft.normalizers import common as c
from tests import helpers
from tests.helpers import assert_same, make_qkv

FWD = dict(rtol=1e-5, atol=1e-6)


def _closed_form(weights_of):
  """``fn(x, axis=-1, where=None)`` from a closed form on the visible entries."""

  def fn(x, axis=-1, where=None):
    xs, mask, axis = c.prepare(x, axis, where, "closed_form")
    xs, mask = jnp.moveaxis(xs, axis, -1), jnp.moveaxis(mask, axis, -1)
    w = jnp.where(mask, weights_of(xs, mask), 0.0)
    return c.finish(jnp.moveaxis(w, -1, axis), jnp.moveaxis(mask, -1, axis),
                    jnp.asarray(x).dtype)

  return fn


def _s_with_stabiliser_offset(x, mask):
  # e^x / (1 + sum e^x): class S evaluates at m = 0, where the offset e^{-m} is 1.
  e = jnp.where(mask, jnp.exp(x), 0.0)
  return e / (1.0 + jnp.sum(e, -1, keepdims=True))


def _e_with_own_denominator(x, mask):
  # e^x / (2 sum e^x + max(e^{max x}, 1)): stabilised by m = max(max x, 0), offset e^{-m}.
  m = jnp.max(jnp.where(mask, x, -jnp.inf), -1, keepdims=True)
  m = jnp.maximum(jnp.where(jnp.isfinite(m), m, 0.0), 0.0)
  e = jnp.where(mask, jnp.exp(x - m), 0.0)
  d = 2.0 * jnp.sum(e, -1, keepdims=True) + jnp.exp(-m)
  return jnp.where(mask.any(-1, keepdims=True), e / d, 0.0)


def _p_sigmoid(x, mask):
  return jax.nn.sigmoid(x - 1.0)


SPECS = {
    "S_offset_of_m": NormalizerSpec(
        name="test_s_offset_of_m", fn=_closed_form(_s_with_stabiliser_offset), kernel_class="S",
        catalogue_id="", sums_to_one=False, shift_invariant=False,
        tile=TileRule(score_map=lambda x, n: x, numerator=lambda z, m: jnp.exp(z),
                      denominator=lambda z, m: jnp.exp(z),
                      offset=lambda m, n: jnp.exp(-m))),
    "E_own_denominator": NormalizerSpec(
        name="test_e_own_denominator", fn=_closed_form(_e_with_own_denominator),
        kernel_class="E", catalogue_id="", sums_to_one=False, shift_invariant=False,
        tile=TileRule(score_map=lambda x, n: x, numerator=lambda z, m: jnp.exp(z - m),
                      denominator=lambda z, m: 2.0 * jnp.exp(z - m),
                      offset=lambda m, n: jnp.exp(-m), m_floor=0.0)),
    "P_sigmoid": NormalizerSpec(
        name="test_p_sigmoid", fn=_closed_form(_p_sigmoid), kernel_class="P", catalogue_id="",
        sums_to_one=False, at_most_one=False, shift_invariant=False,
        tile=TileRule(score_map=lambda x, n: x - 1.0, numerator=lambda z, m: jax.nn.sigmoid(z))),
}


def _rows(seed=0, shape=(5, 12)):
  x = 2.0 * jax.random.normal(jax.random.key(seed), shape)
  mask = np.ones(shape, bool)
  mask[1] = False            # a fully masked row
  mask[2, :8] = False        # whole leading blocks masked
  mask[3, ::3] = False
  return x, jnp.asarray(mask)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_evaluators_equal_the_closed_form(name):
  """User 1: jaxsoft.testing's dense and online evaluators (random block splits)."""
  spec = SPECS[name]
  x, mask = _rows()
  want = spec.fn(x, where=mask)
  chex.assert_trees_all_close(testing.evaluate_tile_rule(spec, x, where=mask), want, **FWD)
  v = helpers.standard_normal(1, (x.shape[-1], 3))
  cot = helpers.standard_normal(2, (x.shape[0], 3))
  # jitted: one program per evaluator and block split rather than op by op
  want_o, vjp_want = jax.vjp(jax.jit(lambda x, v: spec.fn(x, where=mask) @ v), x, v)
  for blocks in ([12], [5, 7], [3, 1, 4, 4]):
    got, vjp_got = jax.vjp(jax.jit(
        lambda x, v, b=blocks: testing.evaluate_tile_rule_online(spec, x, v, b, where=mask)),
        x, v)
    chex.assert_trees_all_close(got, want_o, **FWD)
    chex.assert_trees_all_close(vjp_got(cot), vjp_want(cot), rtol=1e-4, atol=1e-5)


def _attention_case(seed):
  q, k, v = make_qkv(seed, B=1, T=40, N=2, K=1, H=16)
  return (q, k, v), dict(is_causal=True, key_value_seq_lengths=jnp.array([33], jnp.int32))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_chunked_attention_equals_dense(name, monkeypatch):
  """User 2: implementation="xla_chunked" (8 x 8 blocks) against the dense fn, fwd and bwd."""
  monkeypatch.setattr(_chunked, "BLOCK_Q", 8)
  monkeypatch.setattr(_chunked, "BLOCK_K", 8)
  args, kw = _attention_case(3)
  spec = SPECS[name]
  # jitted: one program per implementation rather than op by op
  assert_same(jax.jit(functools.partial(dpa, normalizer=spec, implementation="xla_chunked",
                                        **kw)),
              jax.jit(functools.partial(dpa, normalizer=spec, implementation="xla", **kw)), args)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_pallas_engine_equals_dense(name):
  """User 3: the Pallas engine (Triton driver, interpret mode, 16 x 16 blocks)."""
  args, kw = _attention_case(4)
  spec = SPECS[name]
  kernel = functools.partial(kp.attention, normalizer=spec, backend="triton", interpret=True,
                             block_sizes=kp.BlockSizes(16, 16), **kw)
  assert_same(jax.jit(kernel),
              jax.jit(functools.partial(dpa, normalizer=spec, implementation="xla", **kw)), args)


# ------------------------------------------------------------------------- declarations


def _spec(kind, **rule):
  base = dict(score_map=lambda x, n: x, numerator=lambda z, m: jnp.exp(z - m))
  return NormalizerSpec(name="bad", fn=lambda x, axis=-1, where=None: x, kernel_class=kind,
                        catalogue_id="", tile=TileRule(**{**base, **rule}))


@pytest.mark.parametrize("kind", ["E", "S"])
def test_a_normalized_class_needs_a_denominator(kind):
  with pytest.raises(ValueError, match="needs a `denominator`"):
    _spec(kind)


def test_class_p_takes_no_row_sum():
  with pytest.raises(ValueError, match="class-P"):
    _spec("P", denominator=lambda z, m: z)
  with pytest.raises(ValueError, match="class-P"):
    _spec("P", offset=lambda m, n: m)


def test_m_floor_is_for_class_e_only():
  with pytest.raises(ValueError, match="m_floor"):
    _spec("S", denominator=lambda z, m: z, m_floor=0.0)


def test_the_class_is_declared_once():
  rule = TileRule(score_map=lambda x, n: x, numerator=jnp.exp, denominator=jnp.exp,
                  kernel_class="E")
  with pytest.raises(ValueError, match="tile rule says class E"):
    NormalizerSpec(name="bad", fn=lambda x: x, kernel_class="S", catalogue_id="", tile=rule)
  with pytest.raises(TypeError):
    TileRule(score_map=lambda x, n: x, numerator=jnp.exp, uses_max=False)  # no such field
  with pytest.raises(ValueError, match="no kernel class"):
    testing.evaluate_tile_rule(dataclasses.replace(rule, kernel_class=None), jnp.zeros(3))


def test_rules_only_on_their_classes():
  with pytest.raises(ValueError, match="cannot carry a tile rule"):
    _spec("T", denominator=lambda z, m: z)


def test_threshold_rule_fields_are_validated():
  """A class-T spec's ThresholdRule names its bad field when the spec is built."""
  from jaxsoft.normalizers import _topk, row_blocks
  ok = _topk.TOP_K_RULE

  def build(**change):
    return NormalizerSpec(name="bad", fn=lambda x: x, kernel_class="T", catalogue_id="",
                          threshold=dataclasses.replace(ok, **change))

  build()  # the registered rule itself passes
  for change, match in (({"mass": 1.0}, "ThresholdRule.mass"),
                        ({"newton_power": 0.5}, "newton_power"),
                        ({"iterations": 0}, "iterations"), ({"iterations": True}, "iterations"),
                        ({"stats": row_blocks.row_stats_rule(
                            (row_blocks.SOFTMAX,), lambda st, n: {}, _topk._KEPT_SOFTMAX)},
                         "without a `second`")):
    with pytest.raises(ValueError, match=match):
      build(**change)


def test_derived_properties_of_the_registry():
  for name, spec in REGISTRY.items():
    if spec.tile is None:
      continue
    assert spec.tile.kernel_class == spec.kernel_class, name
    assert spec.tile.uses_max == (spec.kernel_class == "E"), name
    assert spec.tile.normalized == (spec.kernel_class in ("E", "S")), name
