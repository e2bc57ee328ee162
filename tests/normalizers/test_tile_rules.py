"""Kernel rules vs the normalizers: every TileRule (E/S/P) and ThresholdRule (T) in the registry.

The chunked XLA path and the Pallas engine compute a normalizer from its rule, never from
its function, so each rule must reproduce ``spec.fn``: densely (output and gradient), online
over random key blocks with FlashAttention's (m, l) merge fused with ``@ V`` (feature E04:
random tile splits, fully masked rows, fully masked blocks), and, for class T, by bisection.
The evaluators themselves are first checked against independent oracles (jax.nn.softmax,
optax's simplex projection, closed forms), so a rule and a function cannot agree on a
shared mistake in the evaluator.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsoft import normalizers, testing
from jaxsoft.normalizers import ThresholdRule, TileRule
from tests import helpers
from tests.helpers import REGISTRY_DEFAULT

TILE_SPECS = sorted(n for n, s in normalizers.REGISTRY.items() if s.tile is not None)
THRESHOLD_SPECS = sorted(n for n, s in normalizers.REGISTRY.items() if s.threshold is not None)
FWD = dict(rtol=1e-5, atol=1e-6)
BWD = dict(rtol=1e-4, atol=1e-5)


def _settings(spec):
  base = {p.name: p.default for p in spec.params if p.default is not None}
  out = [pytest.param(base, id="defaults")]
  for p in spec.params:
    if p.sample is not None:
      out.append(pytest.param({**base, p.name: p.sample}, id=f"{p.name}={p.sample}"))
  return out


def _cases(names):
  """(name, hparams) params: the normalizers of ``REGISTRY_DEFAULT`` by default, the rest
  with ``-m slow``."""
  return [pytest.param(n, s.values[0], id=f"{n}-{s.id}",
                       marks=() if n in REGISTRY_DEFAULT else pytest.mark.slow)
          for n in names for s in _settings(normalizers.get(n))]


def _rows(key, shape=(6, 13)):
  """Scores, a mask with a fully masked row, a single-entry row and -inf logits."""
  x = 2.0 * jax.random.normal(key, shape, jnp.float32)
  mask = np.array(jax.random.bernoulli(jax.random.fold_in(key, 1), 0.75, shape))
  mask[0] = True
  mask[1] = False            # fully masked row
  mask[2] = False
  mask[2, 5] = True          # one visible entry
  mask[3, :7] = False        # a masked prefix: whole leading blocks masked
  x = x.at[4, 2].set(-jnp.inf)  # -inf logits behave as masked
  return x, jnp.asarray(mask)


def _split(rng, s):
  """Random block sizes summing to s (1 to 5 blocks, unequal)."""
  k = int(rng.integers(1, 6))
  cuts = np.sort(rng.choice(np.arange(1, s), size=k - 1, replace=False)) if k > 1 else []
  return [int(b) for b in np.diff(np.concatenate([[0], cuts, [s]]))]


# --------------------------------------------------------------------------- evaluators


def test_dense_tile_evaluator_matches_jax_softmax():
  rule = TileRule(score_map=lambda x, n: x, numerator=lambda z, m: jnp.exp(z - m),
                  denominator=lambda z, m: jnp.exp(z - m), kernel_class="E")
  x, mask = _rows(jax.random.key(0))
  got = testing.evaluate_tile_rule(rule, x, where=mask)
  want = jax.nn.softmax(jnp.where(mask, x, -jnp.inf), axis=-1)
  visible = np.asarray(mask & jnp.isfinite(x)).any(-1)
  chex.assert_trees_all_close(got[visible], want[visible], **FWD)
  assert np.all(np.asarray(got[~visible]) == 0)


def test_dense_tile_evaluator_s_and_p_closed_forms():
  x, mask = _rows(jax.random.key(1))
  mask = mask & jnp.isfinite(x)
  spherical = TileRule(score_map=lambda x, n: x, numerator=lambda z, m: z * z + 0.5,
                       denominator=lambda z, m: z * z + 0.5, kernel_class="S")
  q = jnp.where(mask, x * x + 0.5, 0.0)
  want = q / jnp.maximum(q.sum(-1, keepdims=True), 1e-30)
  chex.assert_trees_all_close(testing.evaluate_tile_rule(spherical, x, where=mask), want, **FWD)
  sigmoid_n = TileRule(score_map=lambda x, n: x - jnp.log(jnp.maximum(n, 1.0)),
                       numerator=lambda z, m: jax.nn.sigmoid(z), kernel_class="P")
  n = mask.sum(-1, keepdims=True)
  want = jnp.where(mask, jax.nn.sigmoid(x - jnp.log(jnp.maximum(n, 1))), 0.0)
  chex.assert_trees_all_close(testing.evaluate_tile_rule(sigmoid_n, x, where=mask), want, **FWD)


def test_online_evaluator_matches_softmax_attention_with_offset():
  """softmax_1 = softmax([x, 0])[:-1] through the online merge, random splits, vs jax.nn."""
  rule = TileRule(score_map=lambda x, n: x, numerator=lambda z, m: jnp.exp(z - m),
                  denominator=lambda z, m: jnp.exp(z - m), offset=lambda m, n: jnp.exp(-m),
                  kernel_class="E")
  x, mask = _rows(jax.random.key(2))
  v = helpers.standard_normal(3, (13, 4))
  xe = jnp.concatenate([jnp.where(mask, x, -jnp.inf), jnp.zeros((6, 1))], -1)
  want = jax.nn.softmax(xe, axis=-1)[:, :-1] @ v
  rng = np.random.default_rng(0)
  for _ in range(4):
    got = testing.evaluate_tile_rule_online(rule, x, v, _split(rng, 13), where=mask)
    chex.assert_trees_all_close(got, want, **FWD)


def test_online_evaluator_rejects_bad_blocks():
  spec = normalizers.get("softmax")
  with pytest.raises(ValueError, match="block_sizes"):
    testing.evaluate_tile_rule_online(spec, jnp.zeros((2, 5)), jnp.zeros((5, 3)), [2, 2])
  with pytest.raises(ValueError, match="`v`"):
    testing.evaluate_tile_rule_online(spec, jnp.zeros((2, 5)), jnp.zeros((4, 3)), [5])


def test_threshold_evaluator_matches_optax_sparsemax():
  rule = ThresholdRule(
      score_map=lambda x, n: x, mass=lambda z, t: jnp.maximum(z - t, 0.0),
      target=lambda n: jnp.ones_like(n), bracket=lambda m, n: (m - 1.0, m),
      weight=lambda z, t, m: jnp.maximum(z - t, 0.0), iterations=40)
  x = 2.0 * helpers.standard_normal(4, (5, 9))
  want = jax.vmap(optax.projections.projection_simplex)(x)
  chex.assert_trees_all_close(testing.evaluate_threshold_rule(rule, x), want, atol=1e-6)
  mask = jnp.arange(9) < 6
  got = testing.evaluate_threshold_rule(rule, x, where=mask)
  want = jax.vmap(optax.projections.projection_simplex)(x[:, :6])
  chex.assert_trees_all_close(got[:, :6], want, atol=1e-6)
  assert np.all(np.asarray(got[:, 6:]) == 0)


def test_threshold_evaluator_top_k_closed_form():
  k = 3
  rule = ThresholdRule(
      score_map=lambda x, n: x, mass=lambda z, t: (z >= t).astype(z.dtype),
      target=lambda n: jnp.minimum(float(k), n), bracket=lambda m, n: (m - 20.0, m + 1.0),
      weight=lambda z, t, m: jnp.where(z >= t, jnp.exp(z - m), 0.0), iterations=40)
  x = helpers.standard_normal(5, (4, 8))
  kth = jnp.sort(x, axis=-1)[:, -k][:, None]
  want = jax.nn.softmax(jnp.where(x >= kth, x, -jnp.inf), axis=-1)
  chex.assert_trees_all_close(testing.evaluate_threshold_rule(rule, x), want, **FWD)


# --------------------------------------------------------------------------- registry


def test_every_blockwise_class_has_a_rule():
  assert "softmax" in TILE_SPECS
  for name, spec in normalizers.REGISTRY.items():
    assert (spec.tile is not None) == (spec.kernel_class in "ESP"), name


@pytest.mark.parametrize("name,hparams", _cases(TILE_SPECS))
def test_dense_tile_rule_equals_fn(name, hparams):
  spec = normalizers.get(name)
  x, mask = _rows(jax.random.key(6))
  cot = jax.random.normal(jax.random.key(7), x.shape)
  f_rule = lambda x: testing.evaluate_tile_rule(spec, x, where=mask, **hparams)
  f_spec = lambda x: spec.fn(x, where=mask, **hparams)
  w_rule, vjp_rule = jax.vjp(f_rule, x)
  w_spec, vjp_spec = jax.vjp(f_spec, x)
  chex.assert_trees_all_close(w_rule, w_spec, **FWD)
  chex.assert_trees_all_close(vjp_rule(cot), vjp_spec(cot), **BWD)


def _check_online(name, hparams, splits):
  spec = normalizers.get(name)
  x, mask = _rows(jax.random.key(8))
  v = helpers.standard_normal(9, (x.shape[-1], 5))
  cot = helpers.standard_normal(10, (x.shape[0], 5))
  # jitted (hyperparameters bound as constants): one program per split, not op by op
  want, vjp_want = jax.vjp(jax.jit(lambda x, v: spec.fn(x, where=mask, **hparams) @ v), x, v)
  g_want = vjp_want(cot)
  for blocks in splits:
    got, vjp_got = jax.vjp(jax.jit(
        lambda x, v, b=blocks: testing.evaluate_tile_rule_online(spec, x, v, b, where=mask,
                                                                 **hparams)), x, v)
    chex.assert_trees_all_close(got, want, **FWD)
    chex.assert_trees_all_close(vjp_got(cot), g_want, **BWD)
    assert np.all(np.asarray(got[1]) == 0)  # fully masked row


# Rows of _rows(): row 3 masks columns 0-6, so the blocks [7] and [2], [5] are entirely
# masked there; the same splits for every spec let eager compilations be shared.
SPLITS = ([7, 6], [2, 5, 1, 5])


@pytest.mark.parametrize("name,hparams", _cases(TILE_SPECS))
def test_online_tile_rule_equals_fn_times_v(name, hparams):
  """E04: key blocks, masked blocks and rows; output and cotangents of x and V."""
  _check_online(name, hparams, SPLITS)


@pytest.mark.slow
@pytest.mark.parametrize("name,hparams", _cases(TILE_SPECS))
def test_online_tile_rule_random_splits(name, hparams):
  rng = np.random.default_rng(0)
  _check_online(name, hparams, [_split(rng, 13) for _ in range(4)] + [[1] * 13])


@pytest.mark.parametrize("name,hparams", _cases(TILE_SPECS))
def test_online_tile_rule_extreme_logits(name, hparams):
  """The running max keeps the blockwise form finite at |x| ~ 1000 where fn is."""
  spec = normalizers.get(name)
  x, mask = _rows(jax.random.key(11))
  x = x * 300.0  # entries up to ~ +-1500 (x * 300 keeps -inf)
  v = helpers.standard_normal(12, (x.shape[-1], 3))
  want = spec.fn(x, where=mask, **hparams) @ v
  got = testing.evaluate_tile_rule_online(spec, x, v, [3, 4, 6], where=mask, **hparams)
  assert np.all(np.isfinite(np.asarray(want)))
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,hparams", _cases(THRESHOLD_SPECS))
def test_threshold_rule_equals_fn(name, hparams):
  spec = normalizers.get(name)
  x, mask = _rows(jax.random.key(13))
  if spec.params and "k" in hparams:  # top-k needs rows of at least k entries
    x = jnp.concatenate([x, x[:, :4] - 5.0], -1)
    mask = jnp.concatenate([mask, mask[:, :4]], -1)
  got = testing.evaluate_threshold_rule(spec, x, where=mask, **hparams)
  want = spec.fn(x, where=mask, **hparams)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=2e-6)
  assert np.all(np.asarray(got[1]) == 0)
