"""jaxsoft inside Flax's own attention layers: docs/flax.md runs as written, NNX's
cached decoding equals the causal forward, and Linen's layers compute the normalizer asked for.

Oracles: Flax itself (its default attention_fn for softmax, its causal forward for the
cached decode) and a reference written here from the Linen layer's own projections.
"""

import pathlib
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxsoft as js

FLAX_PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "flax.md"
B, T, F, N = 2, 7, 16, 4
# length dependent (ssmax, sigmoid's -log n bias), threshold (sparsemax), no sum to one (softmax_1)
NORMALIZERS = [("softmax", {}), ("ssmax", {"s": 0.5}), ("sigmoid", {}), ("sparsemax", {}),
               ("softmax_1", {})]


def _section_blocks():
  section = FLAX_PAGE.read_text()  # the page is the section: "Using jaxsoft in an existing Flax model"
  return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def _x(seed=0):
  return jax.random.normal(jax.random.key(seed), (B, T, F))


def test_flax_page_runs_as_written():
  blocks = _section_blocks()
  assert len(blocks) == 2, "one NNX block and one Linen block"
  ns = {}
  exec(compile(blocks[0], "docs/flax.md (NNX)", "exec"), ns)  # noqa: S102  (asserts decode == forward)
  assert isinstance(ns["layer"], nnx.MultiHeadAttention) and ns["steps"].shape == ns["x"].shape
  chex.assert_trees_all_close(ns["steps"], ns["full"], atol=1e-5)
  exec(compile(blocks[1], "docs/flax.md (Linen)", "exec"), ns)  # noqa: S102
  assert isinstance(ns["layer"], nn.MultiHeadDotProductAttention)
  assert ns["y"].shape == ns["x"].shape and bool(jnp.isfinite(ns["y"]).all())


def _nnx_layer(name, hp, implementation=None, seed=0):
  return nnx.MultiHeadAttention(
      num_heads=N, in_features=F, decode=True, rngs=nnx.Rngs(seed),
      attention_fn=js.nn.attention_fn(name, implementation=implementation, **hp))


# Jitted layer calls: one compilation per call form instead of one per eager operation
# (the page test above runs the layers eagerly).
_step = nnx.jit(lambda m, xt: m(xt))
_causal_forward = nnx.jit(lambda m, x: m(x, mask=nnx.make_causal_mask(x[..., 0]), decode=False))


def _cached_decode(layer, x):
  layer.init_cache((B, T, F))
  return jnp.concatenate([_step(layer, x[:, t:t + 1]) for t in range(T)], axis=1)


@pytest.mark.parametrize("name, hp", NORMALIZERS, ids=[n for n, _ in NORMALIZERS])
def test_nnx_cached_decode_equals_causal_forward(name, hp):
  x = _x()
  layer = _nnx_layer(name, hp)
  full = _causal_forward(layer, x)
  steps = _cached_decode(layer, x)
  chex.assert_trees_all_close(steps, full, atol=1e-5, rtol=1e-5)
  # and the normalizer is really in use: it differs from Flax's default softmax layer
  if name != "softmax":
    default = nnx.MultiHeadAttention(num_heads=N, in_features=F, decode=False, rngs=nnx.Rngs(0))
    ref = _causal_forward(default, x)
    assert float(jnp.max(jnp.abs(ref - full))) > 1e-3


def test_nnx_cached_decode_on_the_chunked_path():
  x = _x(1)
  layer = _nnx_layer("ssmax", {"s": 0.5}, implementation="xla_chunked")
  full = _causal_forward(layer, x)
  steps = _cached_decode(layer, x)
  chex.assert_trees_all_close(steps, full, atol=1e-5, rtol=1e-5)


def _linen_pair(name, hp, **kw):
  mine = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=F,
                                         attention_fn=js.nn.attention_fn(name, **hp), **kw)
  ref = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=F, **kw)
  return mine, ref


def test_linen_softmax_equals_linen_default_forward_and_gradients():
  x = _x(2)
  mask = nn.make_causal_mask(x[..., 0])
  mine, ref = _linen_pair("softmax", {})
  params = jax.jit(ref.init)(jax.random.key(1), x)

  def forward_and_grad(layer):  # one compilation per layer, not one per eager operation
    loss = lambda p: jnp.sum(jnp.sin(layer.apply(p, x, mask=mask)))
    return jax.jit(lambda p: (layer.apply(p, x, mask=mask), jax.grad(loss)(p)))(params)

  (out_m, g_m), (out_r, g_r) = forward_and_grad(mine), forward_and_grad(ref)
  chex.assert_trees_all_close(out_m, out_r, atol=1e-6)
  chex.assert_trees_all_close(g_m, g_r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, hp", NORMALIZERS[1:], ids=[n for n, _ in NORMALIZERS[1:]])
def test_linen_layer_applies_the_normalizer(name, hp):
  x = _x(3)
  mask = nn.make_causal_mask(x[..., 0])
  mine, _ = _linen_pair(name, hp)
  params = mine.init(jax.random.key(1), x)
  p = params["params"]
  proj = lambda w, b: jnp.einsum("btf,fnh->btnh", x, w) + b[None, None]
  q = proj(p["query"]["kernel"], p["query"]["bias"])
  k = proj(p["key"]["kernel"], p["key"]["bias"])
  v = proj(p["value"]["kernel"], p["value"]["bias"])
  logits = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(q.shape[-1])
  causal = jnp.tril(jnp.ones((T, T), bool))
  w = js.normalizers.get(name).fn(logits, where=causal, **hp)
  o = jnp.einsum("bnts,bsnh->btnh", w, v)
  expected = jnp.einsum("btnh,nhf->btf", o, p["out"]["kernel"]) + p["out"]["bias"][None, None]
  chex.assert_trees_all_close(mine.apply(params, x, mask=mask), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, hp", [NORMALIZERS[1], NORMALIZERS[3]], ids=["ssmax", "sparsemax"])
def test_linen_cached_decode_equals_causal_forward(name, hp):
  x = _x(4)
  layer = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=F, decode=True,
                                          attention_fn=js.nn.attention_fn(name, **hp))
  variables = layer.init(jax.random.key(1), x)
  full = layer.clone(decode=False).apply({"params": variables["params"]}, x,
                                         mask=nn.make_causal_mask(x[..., 0]))
  cache, steps = variables["cache"], []
  for t in range(T):
    out, mutated = layer.apply({"params": variables["params"], "cache": cache}, x[:, t:t + 1],
                               mutable=["cache"])
    cache = mutated["cache"]
    steps.append(out)
  chex.assert_trees_all_close(jnp.concatenate(steps, axis=1), full, atol=1e-5, rtol=1e-5)
