"""Block Attention Residuals as a train/ configuration (``--attention_residual_blocks``,
train.attn_residuals): at its identity setting (pseudo-queries 0) the model is the plain
one, the routing of every sublayer is the formula's, it trains, and cached decoding
equals the forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.train.test_train_step import TINY as STEP_TINY
from tests.train.test_train_step import _setup
from train import model
from train import train as train_lib
from train.config import Config, ConfigError, validate

TINY = dict(STEP_TINY, num_layers=2, learning_rate=1e-2)
_FORWARD = nnx.jit(lambda m, x: m(x))


def _models(group, **kw):
  cfg = Config(**{**TINY, **kw})
  plain = model.make_model(cfg, 64, 0)
  routed = model.make_model(Config(**{**TINY, **kw, "attention_residual_blocks": group}), 64, 0)
  return cfg, plain, routed


def _tokens(cfg, seed=1):
  return jax.random.randint(jax.random.key(seed), (2, cfg.seq_len), 0, 64)


@pytest.mark.parametrize("group", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_identity_setting_is_the_plain_model(group):
  # the other parameters are drawn first, so both models hold the same ones; zero queries
  # mix uniformly: each sublayer sees RMSNorm(x / S) = RMSNorm(x) with eps scaled by S^2
  # (S <= 3 sources, mean x^2 ~ 1 / d = 1/16, eps = 1e-6: a relative 1e-4 at most)
  cfg, plain, routed = _models(group)
  assert routed.residuals.queries[...].shape == (2 * cfg.num_layers + 1, cfg.d_model)
  tokens = _tokens(cfg)
  want = np.asarray(_FORWARD(plain, tokens))
  np.testing.assert_allclose(np.asarray(_FORWARD(routed, tokens)), want, rtol=1e-3, atol=1e-3)
  # a non-zero query changes the function (the routing is live)
  routed.residuals.queries[...] = jax.random.normal(jax.random.key(2),
                                                    routed.residuals.queries[...].shape)
  assert np.abs(np.asarray(_FORWARD(routed, tokens)) - want).max() > 1e-2


@pytest.mark.slow  # eager sublayer calls: ~5 s
def test_each_sublayer_gets_the_formulas_mixture():
  # an independent loop over the sources: completed blocks (the embedding first, then one
  # per decoder block: 2 sublayers) and the partial sum, softmax over w . RMS(v) per token
  cfg, _, routed = _models(1)
  w = jax.random.normal(jax.random.key(3), routed.residuals.queries[...].shape)
  routed.residuals.queries[...] = w
  tokens = _tokens(cfg)
  positions = jnp.broadcast_to(jnp.arange(cfg.seq_len), tokens.shape)
  subs = routed._sublayers(positions)

  def mix(sources, q):
    v = np.stack([np.asarray(s, np.float64) for s in sources])
    keys = v / np.sqrt(np.mean(v * v, -1, keepdims=True) + 1e-6)
    z = keys @ np.asarray(q, np.float64)
    a = np.exp(z - z.max(0))
    return (a / a.sum(0))[..., None].__mul__(v).sum(0)

  done, partial, inputs = [np.asarray(routed.embed(tokens))], None, []
  for i, f in enumerate(subs):
    h = mix(done + ([] if partial is None else [partial]), w[i])
    inputs.append(h)
    out = np.asarray(f(jnp.asarray(h, jnp.float32)), np.float64)
    partial = out if partial is None else partial + out
    if (i + 1) % 2 == 0:
      done, partial = done + [partial], None
  final = mix(done + ([] if partial is None else [partial]), w[len(subs)])
  got = routed.residuals(routed.embed(tokens), subs)
  # float32 mixtures of O(1) values against float64 (the sublayers fed the float64 mixture
  # rounded to float32): a few ulps through 4 sublayers
  np.testing.assert_allclose(np.asarray(got), final, rtol=1e-4, atol=1e-4)
  stop = routed.residuals(routed.embed(tokens), subs, stop=3)  # block 1's MLP input
  np.testing.assert_allclose(np.asarray(stop), inputs[3], rtol=1e-4, atol=1e-4)


def test_the_train_step_traces_and_the_flag_is_checked():
  cfg = Config(**{**TINY, "attention_residual_blocks": 1})
  graphdef, params = nnx.split(nnx.eval_shape(lambda: model.make_model(cfg, 256, 0)))
  batch = {name: jax.ShapeDtypeStruct((4, cfg.seq_len), dtype) for name, dtype in
           (("inputs", jnp.int32), ("targets", jnp.int32), ("weights", jnp.float32))}
  (loss, _), grads = jax.eval_shape(jax.value_and_grad(
      lambda p, b: train_lib.loss_sums(graphdef, p, b), has_aux=True), params, batch)
  assert loss.shape == () and jax.tree.structure(grads) == jax.tree.structure(params)
  with pytest.raises(ConfigError, match="attention_residual_blocks"):
    validate(Config(**{**TINY, "attention_residual_blocks": -1}), check_workdir=False)


@functools.cache
def _trained(group):
  _, graphdef, state, batch, step = _setup(**dict(TINY, attention_residual_blocks=group))
  first, losses = state, []
  for _ in range(3):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return graphdef, first, state, losses


@pytest.mark.slow
def test_it_trains_and_the_queries_learn():
  _, first, last, losses = _trained(1)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  moved = np.abs(np.asarray(last["params"]["residuals"]["queries"])
                 - np.asarray(first["params"]["residuals"]["queries"]))
  # every query that mixes two or more sources learns (and the final one); the first
  # sublayer's has one source, the embedding, whose softmax weight is 1 whatever w
  assert moved[0].max() == 0 and np.all(moved[1:].max(axis=1) > 0), moved.max(axis=1)


@pytest.mark.slow
def test_cached_decoding_equals_the_forward():
  graphdef, _, state, _ = _trained(1)
  net = nnx.merge(graphdef, state["params"])
  cfg = Config(**TINY)
  tokens = _tokens(cfg, 4)
  want = np.asarray(nnx.jit(lambda m, x: m(x))(net, tokens))
  decode = nnx.jit(lambda m, t, p, c: m.decode_step(t, p, c))
  cache, outs = net.init_cache(2, cfg.seq_len), []
  for p in range(cfg.seq_len):
    logits, cache = decode(net, tokens[:, p], jnp.int32(p), cache)
    outs.append(np.asarray(logits))
  np.testing.assert_allclose(np.stack(outs, 1), want, atol=2e-5, rtol=2e-5)
