"""Hybrid stacks (train/layers.py): layer kinds, the linear layers' wiring, causality, the loss."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxsoft import nn as js_nn
from tests.nn.test_linear_modules import check_against_reference
from train import config, layers, model
from train import train as train_lib
from train.config import LAYER_KINDS, Config, ConfigError

TINY = dict(d_model=16, num_heads=2, mlp_dim=32, seq_len=8, block_size=4, top_k=2,
            favor_features=8, workdir="unused")


def _cfg(**overrides):
  return Config(**{**TINY, **overrides})


def _jit_init(fn):
  """An nnx module built under jit (eager initialisation is slow on CPU)."""
  graphdef, _ = nnx.split(nnx.eval_shape(fn))
  return nnx.merge(graphdef, jax.jit(lambda: nnx.state(fn()))())


# ------------------------------------------------------------------------------ configuration


def test_layers_repeat_to_num_layers_and_softmax_takes_the_attention_variant():
  cfg = _cfg(num_layers=5, layers="gated_delta_rule, gated_delta_rule,softmax")
  assert config.layer_kinds(cfg) == ("gated_delta_rule", "gated_delta_rule", "full",
                                     "gated_delta_rule", "gated_delta_rule")
  gated = dataclasses.replace(cfg, attention="gated", num_layers=3)
  assert config.layer_kinds(gated)[-1] == "gated"
  assert config.layer_kinds(_cfg(num_layers=2, attention="gla")) == ("gla", "gla")
  for kind in LAYER_KINDS:  # every advertised kind is accepted by validate
    config.validate(_cfg(num_layers=1, attention=kind), check_workdir=False)


@pytest.mark.parametrize("overrides, match", [
    (dict(attention="gdn"), r"--attention: unknown layer kind 'gdn'; valid: full, .*gated_delta_rule"
                            r".*linear:favor.*block_sparse_attention:moba.*lucid_attention"),
    (dict(num_layers=2, layers="gla,nope"), r"--layers: unknown layer kind 'nope'.*softmax"),
    (dict(num_layers=2, layers="gla,gla,softmax"), r"--layers names 3 layers but --num_layers"),
    (dict(attention="gla", learned="temperature"), r"--learned: no layer is a normalizer block"),
    (dict(conv_size=0), r"--conv_size must be positive"),
    (dict(loss="sparse"), r"--loss: unknown value 'sparse'"),
])
def test_bad_layer_configs_raise_naming_the_flag(overrides, match):
  with pytest.raises(ConfigError, match=match):
    config.validate(_cfg(**overrides), check_workdir=False)


# ------------------------------------------------------------------------- the linear layers


def test_the_linear_layers_use_jaxsofts_causal_conv():
  # the convolution and its step form are tested against a numpy loop in
  # tests/nn/test_linear_modules.py; the layers here re-export them
  assert layers.causal_conv is js_nn.causal_conv
  assert layers.causal_conv_step is js_nn.causal_conv_step


def _gated_delta_reference(layer, x):
  """Gated DeltaNet written out: the projections, conv, gates and the per-token recurrence
  S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T q_t / sqrt(K), in plain jnp
  (no jaxsoft)."""
  p = lambda v: v[...]  # noqa: E731
  b, t, _ = x.shape
  n, h = layer.num_heads, layer.head_dim
  u = x @ p(layer.qkv.kernel)
  w = p(layer.conv)
  padded = jnp.pad(u, ((0, 0), (w.shape[0] - 1, 0), (0, 0)))
  u = jax.nn.silu(sum(w[i][None, None] * padded[:, i:i + t] for i in range(w.shape[0])))
  q, k, v = (a.reshape(b, t, n, h) for a in jnp.split(u, 3, axis=-1))
  q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  per_head = lambda a: a[None, None]  # noqa: E731  [N] -> [1, 1, N]
  alpha = jnp.exp(-per_head(jnp.exp(p(layer.A_log))) * jax.nn.softplus(
      x @ p(layer.a.kernel) + per_head(p(layer.dt_bias))))
  beta = jax.nn.sigmoid(x @ p(layer.beta.kernel))
  eye = jnp.eye(h)[None, None]

  def token(S, inputs):  # one step of the recurrence (a scan: compiled once, not t times)
    qq, kk, vv, a, bb = inputs
    proj = eye - bb[:, :, None, None] * kk[..., :, None] * kk[..., None, :]
    S = (a[:, :, None, None] * jnp.einsum("bnij,bnjv->bniv", proj, S)
         + bb[:, :, None, None] * kk[..., :, None] * vv[..., None, :])
    return S, jnp.einsum("bnkv,bnk->bnv", S, qq) * h ** -0.5

  _, outs = jax.lax.scan(token, jnp.zeros((b, n, h, h)),
                         tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, alpha, beta)))
  o = jnp.moveaxis(outs, 0, 1)
  o = o / jnp.sqrt(jnp.mean(o * o, axis=-1, keepdims=True) + 1e-6) * p(layer.o_norm)[None, None, None]
  o = o.reshape(b, t, n * h) * jax.nn.silu(x @ p(layer.gate.kernel))
  return o @ p(layer.o.kernel)


def test_gated_delta_rule_layer_matches_its_recurrence_forward_and_backward():
  cfg = _cfg()
  layer = _jit_init(lambda: layers.LinearMixer(cfg, "gated_delta_rule", 0, rngs=nnx.Rngs(0)))
  check_against_reference(layer, _gated_delta_reference,
                          jax.random.normal(jax.random.key(1), (2, 8, 16)))


def _perturbed_outputs(kind, dtype="float32", t=8, at=5):
  cfg = _cfg(num_layers=1, attention=kind, dtype=dtype)
  net = _jit_init(lambda: model.make_model(cfg, 32, seed=0))
  tokens = jax.random.randint(jax.random.key(3), (2, t), 0, 32)
  changed = tokens.at[:, at].set((tokens[:, at] + 1) % 32)
  fwd = nnx.jit(lambda m, x: m(x))
  return fwd(net, tokens), fwd(net, changed)


_DEFAULT_KINDS = ("gated_delta_rule", "gla", "linear:favor", "multi_token_attention")


@pytest.mark.parametrize("kind", [k if k in _DEFAULT_KINDS else pytest.param(k, marks=pytest.mark.slow)
                                  for k in LAYER_KINDS])
def test_every_kind_is_causal_and_finite(kind):
  a, b = map(np.asarray, _perturbed_outputs(kind))  # (checked in numpy: no eager dispatch)
  np.testing.assert_array_equal(a[:, :5], b[:, :5])
  assert float(np.max(np.abs(a[:, 5:] - b[:, 5:]))) > 0  # the change is seen from 5 on
  assert np.all(np.isfinite(a))


@pytest.mark.parametrize("kind", ["gated_delta_rule",
                                  *(pytest.param(k, marks=pytest.mark.slow) for k in
                                    ("gla", "linear:favor", "cosformer", "topk_attention"))])
def test_bf16_layers_stay_finite_and_close_to_float32(kind):
  a32 = np.asarray(_perturbed_outputs(kind)[0])  # (checked in numpy: no eager dispatch)
  a16 = _perturbed_outputs(kind, dtype="bfloat16")[0]
  assert a16.dtype == jnp.float32
  a16 = np.asarray(a16)
  assert np.all(np.isfinite(a16))
  if kind == "topk_attention":  # bf16 rounding may swap which keys are the top k: finite only
    return
  # Logits of order 1: bf16 compute keeps them to a few percent.
  assert float(np.max(np.abs(a16 - a32))) < 0.1 * float(np.max(np.abs(a32))) + 0.05


def test_weight_decay_skips_filters_decays_and_the_mta_kernel_but_not_an_untied_output():
  cfg = _cfg(num_layers=3, layers="gated_delta_rule,multi_token_attention,softmax",
             tie_embeddings=False)
  params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: model.make_model(cfg, 32, 0))))
  flat = {jax.tree_util.keystr(path): bool(v) for path, v in
          jax.tree_util.tree_leaves_with_path(train_lib.decay_mask(params))}
  decayed = {k for k, v in flat.items() if v}
  assert decayed == {k for k in flat if k.endswith("['kernel']")} | {"['unembed']"}
  for name in ("conv", "A_log", "dt_bias", "o_norm", "mta_kernel", "embedding"):
    assert any(f"['{name}']" in k for k in flat) and not any(
        f"['{name}']" in k for k in decayed), name


# ---------------------------------------------------------------------------------- the loss


def _loss_and_grads(graphdef, batch):
  return jax.jit(jax.value_and_grad(lambda p: train_lib.loss_sums(graphdef, p, batch)[0]))


@pytest.mark.parametrize("tie", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_linear_ce_loss_equals_the_materialised_cross_entropy(tie):
  cfg = _cfg(num_layers=1, tie_embeddings=tie)
  net = _jit_init(lambda: model.make_model(cfg, 256, seed=0))
  graphdef, params = nnx.split(net)
  # (only its graph: abstract, no initialisation to compile)
  dense_graphdef, _ = nnx.split(nnx.eval_shape(lambda: model.make_model(
      dataclasses.replace(cfg, loss="dense"), 256, seed=0)))
  assert net.chunked_loss and (net.unembed is None) == tie
  rng = np.random.default_rng(0)
  batch = {"inputs": jnp.asarray(rng.integers(0, 256, (2, 8)), jnp.int32),
           "targets": jnp.asarray(rng.integers(0, 256, (2, 8)), jnp.int32),
           "weights": jnp.asarray(rng.random((2, 8)) < 0.8, jnp.float32)}
  chunked = _loss_and_grads(graphdef, batch)
  loss, grads = chunked(params)
  loss_dense, grads_dense = _loss_and_grads(dense_graphdef, batch)(params)
  # An independent oracle: log_softmax of the materialised logits (numpy, float64).
  logits = np.asarray(nnx.jit(lambda m, x: m(x))(net, batch["inputs"]), np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.sum(np.exp(logp), axis=-1, keepdims=True))
  expected = -np.sum(np.take_along_axis(logp, np.asarray(batch["targets"])[..., None], -1)[..., 0]
                     * np.asarray(batch["weights"]))
  np.testing.assert_allclose(loss, expected, rtol=1e-5)
  np.testing.assert_allclose(loss, loss_dense, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_dense), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  if not tie:  # the untied output matrix is trained
    assert float(np.max(np.abs(jax.tree.leaves(grads["unembed"])[0]))) > 0
  # Extreme weights (every parameter x 30: logits in the thousands) stay finite. (Scaled and
  # checked in numpy: eager jnp ops would compile once per parameter shape.)
  big_loss, big_grads = chunked(jax.tree.map(lambda w: np.float32(30.0) * np.asarray(w), params))
  assert np.isfinite(float(big_loss)) and float(big_loss) > float(loss)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(big_grads))
