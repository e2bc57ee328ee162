"""BLASST's lambda = c / L calibration and training with the skip active (A12).

Oracles: the skip loop itself (``block_sparse_attention(method="blasst")``'s
``kept_tokens``), independent of the calibration's numpy margins: on the calibration
sample the fitted c skips the target fraction to within one pair's share (the margin rule
is exact), and on held-out lengths to within a tolerance (the 1/L rule is an empirical
law; the data are peaked attention logits, where it holds); the threshold formula against
math.log; training: gradient steps through the skip loop lower the loss while it skips.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsoft as js

BS = 8


def _sample(seed, n, heads=4, h=16, scale=2.0):
  return np.random.default_rng(seed).standard_normal((1, n, heads, h)).astype("f4") * scale


def _sparsity(x, c):
  """Skipped / visible causal (row, key block) pairs of the skip loop with lambda = c / L."""
  _, st = js.attention.block_sparse_attention(
      x, x, x, method="blasst", block_size=BS, is_causal=True, skip_calibration=c,
      return_stats=True)
  n = x.shape[1]
  vis = np.tril(np.ones((n // BS, n // BS), bool)).repeat(BS, 0)  # [T, nk]
  kept = np.asarray(st["kept_tokens"][0])  # [N, T, nk]
  assert not np.any(kept & ~vis)
  return 1.0 - kept.sum() / (vis.sum() * x.shape[2])


def test_skip_threshold_formula_and_errors():
  assert js.attention.blasst_skip_threshold(1000, 2.5) == pytest.approx(math.log(400.0))
  assert js.attention.blasst_skip_threshold(3, 5.0) == 0.0  # L <= c: clipped at 0
  for bad in (0.0, -1.0, math.inf, math.nan):
    with pytest.raises(ValueError, match="calibration"):
      js.attention.blasst_skip_threshold(10, bad)
  with pytest.raises(ValueError, match="length"):
    js.attention.blasst_skip_threshold(0, 1.0)
  x = _sample(0, 32)
  with pytest.raises(ValueError, match="target_sparsity"):
    js.attention.blasst_calibrate(x, x, target_sparsity=1.0, block_size=BS)
  with pytest.raises(ValueError, match="cannot reach"):  # one block per row: nothing skips
    js.attention.blasst_calibrate(x, x, target_sparsity=0.5, block_size=32)
  with pytest.raises(ValueError, match="exactly one"):
    js.attention.block_sparse_attention(x, x, x, method="blasst", block_size=BS,
                                        skip_threshold=1.0, skip_calibration=1.0)


@pytest.mark.slow  # three skip-loop compiles (~10 s of CPU)
def test_calibrated_sparsity_on_sample_and_held_out_lengths():
  target = 0.5
  sample = [_sample(1, 64), _sample(2, 128)]
  c = js.attention.blasst_calibrate(sample, sample, target_sparsity=target, block_size=BS,
                                    is_causal=True)
  # on one calibration sample alone the rule is exact: the skip loop skips the target
  # fraction up to ties and the quantile's granularity (one pair in the sample's count)
  alone = js.attention.blasst_calibrate(sample[1], sample[1], target_sparsity=target,
                                        block_size=BS, is_causal=True)
  pairs = sum(range(1, 128 // BS + 1)) * BS * 4
  assert abs(_sparsity(sample[1], alone) - target) <= 1.0 / pairs + 1e-9
  # held-out lengths (between and beyond the sample's): the 1/L law's tolerance (over
  # seeds of this sample size the error spreads to about +-0.05)
  for seed, n in ((3, 96), (4, 192)):
    assert abs(_sparsity(_sample(seed, n), c) - target) < 0.08, n


@pytest.mark.slow  # the skip loop's custom backward compiled (~10 s of CPU)
def test_training_with_the_skip_active_lowers_the_loss():
  """A few plain gradient steps (SGD; optax is not a dependency) on projections feeding
  BLASST with lambda = c / L: the loss falls while a good share of the pairs is skipped."""
  T, D, Hd = 32, 16, 8
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((2, T, D)).astype("f4"))
  target = jnp.asarray(rng.standard_normal((2, T, 1, Hd)).astype("f4"))
  keys = jax.random.split(jax.random.key(6), 3)
  params = [jax.random.normal(kk, (D, Hd)) * 0.8 for kk in keys]

  def qkv(p):
    return [(x @ w)[:, :, None, :] for w in p]

  q0, k0, _ = qkv(params)
  c = js.attention.blasst_calibrate(q0, k0, target_sparsity=0.3, block_size=BS, is_causal=True)

  def loss(p):
    q, k, v = qkv(p)
    out = js.attention.block_sparse_attention(q, k, v, method="blasst", block_size=BS,
                                              is_causal=True, skip_calibration=c)
    return jnp.mean((out - target) ** 2)

  step = jax.jit(lambda p: [w - 0.5 * g for w, g in zip(p, jax.grad(loss)(p), strict=True)])
  losses = [float(loss(params))]
  for _ in range(4):
    params = step(params)
    losses.append(float(loss(params)))
  assert all(np.isfinite(losses))
  assert losses[-1] < 0.9 * losses[0], losses
  q, k, _ = qkv(params)
  _, st = js.attention.block_sparse_attention(q, k, k, method="blasst", block_size=BS,
                                              is_causal=True, skip_calibration=c,
                                              return_stats=True)
  vis = np.tril(np.ones((T // BS, T // BS), bool)).repeat(BS, 0)
  assert 1.0 - np.asarray(st["kept_tokens"]).sum() / (2 * vis.sum()) > 0.1  # still skipping
