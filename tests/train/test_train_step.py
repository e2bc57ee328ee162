"""The train step's math: golden numbers, a loss/gradient oracle, accumulation, masks, data."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from train import data, model, sharding
from train import train as train_lib
from train.config import Config

TINY = dict(dataset="text", seq_len=16, batch_size=4, d_model=16, num_layers=1, num_heads=2,
            mlp_dim=32, steps=4, warmup_steps=1, workdir="unused", seed=0)

# Golden numbers of ONE train step of the TINY config (seed 0, float32, CPU): the mean token
# cross-entropy of the first batch and the global gradient norm before clipping. Any change to
# the model, the initialisation, the data stream or the loss moves them; that is the point.
# If a change is intended, re-derive them with
#   .venv/bin/python -c "from tests.train.test_train_step import golden_step; print(golden_step())"
# and paste the two numbers here, saying why in the commit message.
GOLDEN_LOSS = 5.9700727
GOLDEN_GRAD_NORM = 2.2932262


@functools.cache
def _setup_cached(overrides):
  cfg = Config(**{**TINY, **dict(overrides)})
  mesh = sharding.make_mesh(cfg)
  dataset, graphdef, optimizer, init_fn, _, _, _ = train_lib.build(cfg, mesh)
  state = init_fn()
  batch = sharding.global_batch(dataset, 0, cfg, sharding.batch_sharding(mesh))
  step = jax.jit(train_lib.make_train_step(graphdef, optimizer, train_lib.make_schedule(cfg)))
  return cfg, graphdef, state, batch, step


def _setup(**overrides):
  return _setup_cached(tuple(sorted(overrides.items())))


def golden_step():
  _, _, state, batch, step = _setup()
  _, metrics = step(state, batch)
  return float(metrics["loss"]), float(metrics["grad_norm"])


def test_golden_one_step():
  loss, grad_norm = golden_step()
  np.testing.assert_allclose(loss, GOLDEN_LOSS, rtol=2e-5)
  np.testing.assert_allclose(grad_norm, GOLDEN_GRAD_NORM, rtol=2e-5)


def _reference_loss(graphdef, params, batch):
  """Token-mean cross-entropy written out with log_softmax (independent of optax's helper)."""
  inputs = batch["inputs"].reshape(-1, batch["inputs"].shape[-1])
  targets = batch["targets"].reshape(inputs.shape)
  logits = nnx.merge(graphdef, params)(inputs)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def test_loss_and_grad_norm_match_a_direct_computation():
  _, graphdef, state, batch, step = _setup()
  params = jax.tree.map(np.array, state["params"])  # (host copies: no eager op)
  _, metrics = step(state, batch)
  # Under jit: one compilation instead of the eager model's op-by-op dispatch (same math).
  loss, grads = jax.jit(jax.value_and_grad(functools.partial(_reference_loss, graphdef)))(
      params, batch)
  grad_norm = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads)))
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
  np.testing.assert_allclose(metrics["grad_norm"], grad_norm, rtol=1e-5)


def test_gradient_accumulation_equals_one_big_batch():
  cfg, _, state1, batch1, step1 = _setup()
  _, _, state2, batch2, step2 = _setup(grad_accum=2)
  # The same global batch, split into two micro-batches.
  chex.assert_trees_all_equal(jax.tree.map(lambda x: x.reshape(-1, x.shape[-1]), batch1),
                              jax.tree.map(lambda x: x.reshape(-1, x.shape[-1]), batch2))
  # Step 0 has lr = 0 (the warm-up starts at 0) but fills Adam's first moment mu = (1 - b1)·g:
  # the accumulated gradient, compared directly.
  state1, m1 = step1(state1, batch1)
  state2, m2 = step2(state2, batch2)
  np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-6)
  np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-5)
  mu1 = optax.tree_utils.tree_get(state1["opt_state"], "mu")
  mu2 = optax.tree_utils.tree_get(state2["opt_state"], "mu")
  chex.assert_trees_all_close(mu1, mu2, rtol=1e-5, atol=1e-8)
  # Step 1 moves the parameters; Adam's g/sqrt(v) amplifies round-off in near-zero gradients, so
  # the updates agree to a small fraction of the learning rate rather than to float epsilon.
  state1, _ = step1(state1, batch1)
  state2, _ = step2(state2, batch2)
  lr = float(train_lib.make_schedule(cfg)(1))
  chex.assert_trees_all_close(state1["params"], state2["params"], rtol=0, atol=0.05 * lr)


def test_weight_decay_mask_covers_exactly_the_dense_kernels():
  _, _, state, _, _ = _setup()
  mask = train_lib.decay_mask(state["params"])
  flat = {jax.tree_util.keystr(path): v for path, v in
          jax.tree_util.tree_leaves_with_path(mask)}
  decayed = sorted(k for k, v in flat.items() if v)
  expected = sorted(k for k in flat if k.endswith("['kernel']"))
  assert decayed == expected and expected, flat


def test_adam_update_moves_params_by_at_most_lr_per_coordinate():
  """An AdamW step with bias correction moves each weight by about lr·(1 + wd·|w|) at most."""
  cfg, _, state, batch, step = _setup()
  state, _ = step(state, batch)  # optimizer step 0 has lr = 0 (the warm-up starts at 0)
  before = jax.tree.map(np.array, state["params"])  # (host copies: no eager op)
  new, _ = step(state, batch)
  lr = float(train_lib.make_schedule(cfg)(1))
  assert lr > 0
  # (in numpy: the eager jnp ops compiled once per parameter shape)
  for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(new["params"]), strict=True):
    b, a = np.asarray(b), np.asarray(a)
    bound = lr * (1 + cfg.weight_decay * np.abs(b)) * (1 + 1e-5) + 1e-7
    assert np.all(np.abs(a - b) <= bound)
  moved = sum(int(np.sum(np.asarray(a) != np.asarray(b))) for b, a in
              zip(jax.tree.leaves(before), jax.tree.leaves(new["params"]), strict=True))
  assert moved > 0


def test_rope_makes_scores_depend_only_on_relative_position():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)

  def score(p, s):
    qp = model.rope(q, jnp.array([[p]]), 10000.0)
    ks = model.rope(k, jnp.array([[s]]), 10000.0)
    return jnp.sum(qp * ks)

  np.testing.assert_allclose(score(5, 2), score(13, 10), rtol=1e-5)
  np.testing.assert_allclose(score(0, 0), jnp.sum(q * k), rtol=1e-6)
  assert abs(float(score(5, 2) - score(5, 4))) > 1e-4


def test_data_is_a_function_of_seed_and_position():
  ds = data.make_dataset("text", 16, 4, seed=3)
  a, b = ds.batch(7), ds.batch(7)
  chex.assert_trees_all_equal(a, b)
  assert not np.array_equal(ds.batch(8)["inputs"], a["inputs"])
  np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])
  # Rows are independent of which rows are asked for (each host builds only its own).
  np.testing.assert_array_equal(ds.batch(7, rows=[2, 3])["inputs"], a["inputs"][2:])


@pytest.mark.parametrize("name", ["recall", "copy", "sort", "needle"])
def test_probe_answers_are_determined_by_the_prompt(name):
  ds = data.make_dataset(name, 64, 8, seed=0)  # recall: more positions than keys
  b = ds.batch(0)
  inputs, targets, weights = b["inputs"], b["targets"], b["weights"]
  assert weights.sum() > 0 and inputs.max() < ds.vocab_size
  for row in range(8):
    seq = np.concatenate([inputs[row], targets[row][-1:]])
    answer = targets[row][weights[row] > 0]
    if name == "recall":
      key = seq[-2]
      pos = np.flatnonzero(seq[:-3] == key)
      assert len(pos) == 1 and answer[0] == seq[pos[0] + 1]
    elif name == "needle":
      pos = np.flatnonzero(seq == data.NEEDLE)
      assert len(pos) == 1 and answer[0] == seq[pos[0] + 1]
    else:
      n = len(answer)
      src = seq[:n]
      np.testing.assert_array_equal(answer, src if name == "copy" else np.sort(src))


def test_attention_stats_match_a_dense_softmax():
  cfg, graphdef, state, batch, _ = _setup()
  tokens = batch["inputs"][0, :1]
  # Under jit, as train.py calls it (the eager layer dispatches op by op).
  stats_fn = lambda c: jax.jit(lambda p, x: model.attention_stats(nnx.merge(graphdef, p), x, c))  # noqa: E731
  stats = stats_fn(cfg)(state["params"], tokens)
  np.testing.assert_allclose(stats["attn_mass"], 1.0, rtol=1e-5)
  assert float(stats["attn_sparsity"]) == 0.0  # softmax has no exact zeros
  # Entropy of causal rows lies in [0, mean log(row length)].
  t = tokens.shape[1]
  assert 0.0 < float(stats["attn_entropy"]) <= float(np.mean(np.log(np.arange(1, t + 1)))) + 1e-5
  sparse = dataclasses.replace(cfg, normalizer="sparsemax")
  s2 = stats_fn(sparse)(state["params"], tokens)
  np.testing.assert_allclose(s2["attn_mass"], 1.0, rtol=1e-5)
