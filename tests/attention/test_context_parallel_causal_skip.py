"""Causal block skipping of context_parallel_attention on implementation="xla_chunked".

Each device's queries are two load-balanced chunks (chunks i and 2cp-1-i), and the keys it
sees are gathered (all_gather) or the whole sequence after an all-to-all (ulysses), in the
shards' dual-chunk order. Put back in sequence order (a static reshape and flip), a causal
query block sees a prefix of the key blocks, and the chunked loops visit only those: all_gather
through the loop bounds of its dense mask, ulysses by passing ``is_causal`` and the lengths
to the call. Before, every (query block, key block) tile of a causal call ran.

The tiles are counted as they run: ``_chunked._tile`` is wrapped with a ``jax.debug.callback``
that adds one per tile to a counter labelled, at trace time, by the sweep that traced it
(the forward or the backward pass). ``compiled.cost_analysis()`` would count each loop body
once, whatever its trip count. The expected count is a brute-force count of the
(query block, key block) pairs of a numpy causal mask that hold a visible entry, times the
loops that run: one per batch shard for all_gather (its devices split the query blocks of
the shard), one per device for ulysses (each runs the whole sequence for its heads).

Each test is one fresh Python on 8 fake CPU devices (a 2 x 4 mesh: "data" and "context",
cp = 4) in float64 with 4 x 4 tiles (T = 64: 16 key blocks, so a causal sequence runs
136 of 256 tiles per sweep). Values and gradients are compared with the one-device
``dot_product_attention(implementation="xla")``: the same float64 arithmetic up to the
order of the sums (~1e-15); 1e-10 fails on any missing or extra visible key (an O(1)
change of the weights).
"""

import pytest

from tests.helpers import run_on_cpu_devices

_PRELUDE = r"""
import os
# the same answers, compiled with fewer XLA passes (compilation is most of this test's time)
os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
import collections
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_enable_x64", True)
from jaxsoft.attention import _chunked, context_parallel_attention, dot_product_attention

BLOCK = 4
_chunked.BLOCK_Q = _chunked.BLOCK_K = BLOCK
TILES = collections.Counter()
SWEEP = ["?"]
_tile, _forward, _backward = _chunked._tile, _chunked._forward, _chunked._backward

def counted_tile(*args, **kwargs):  # one count per tile the loops run, by sweep
  label = SWEEP[0]
  jax.debug.callback(lambda: TILES.update([label]))
  return _tile(*args, **kwargs)

def labelled(fn, label):
  def traced(*args, **kwargs):
    SWEEP[0] = label
    return fn(*args, **kwargs)
  return traced

_chunked._tile = counted_tile
_chunked._forward = labelled(_forward, "fwd")
_chunked._backward = labelled(_backward, "bwd")

mesh = jax.make_mesh((2, 4), ("data", "context"))
B, T, N, K, H = 2, 64, 4, 2, 8
rng = np.random.default_rng(0)  # numpy's generator: no XLA compile for the test data
q = jnp.asarray(rng.standard_normal((B, T, N, H)))
k = jnp.asarray(rng.standard_normal((B, T, K, H)))
v = jnp.asarray(rng.standard_normal((B, T, K, H)))
seg = jnp.asarray([[0] * 10 + [1] * 30 + [2] * 24, [0] * 40 + [3] * 24], jnp.int32)
MASKED = dict(query_seq_lengths=jnp.array([60, 50]), key_value_seq_lengths=jnp.array([55, 40]),
              segment_ids=seg)

def block_pairs(visible):  # brute force: (query block, key block) pairs with a visible entry
  nb = T // BLOCK
  return int(visible.reshape(nb, BLOCK, nb, BLOCK).any(axis=(1, 3)).sum())

CAUSAL_PAIRS = block_pairs(np.tril(np.ones((T, T), bool)))
ALL_PAIRS = block_pairs(np.ones((T, T), bool))
LOOPS = {"all_gather": 2, "ulysses": 8}  # loops over the whole sequence, all devices together

def run(attend, **kw):  # (out, dq, dk, dv) of a VJP with the cotangent cos(out), and the tiles
  def f(q, k, v):
    return attend(q, k, v, **kw)
  def with_grads():
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(jnp.cos(out)))
  TILES.clear()
  res = jax.block_until_ready(jax.jit(with_grads)())
  jax.effects_barrier()
  return res, dict(TILES)

def context_parallel(strategy):
  return lambda *a, **kw: context_parallel_attention(*a, mesh=mesh, batch_axes="data",
                                                     strategy=strategy, **kw)

def check(strategy, normalizer, masks=None, plain=False, exact=True):
  kw = dict(is_causal=True, normalizer=normalizer, **(masks or {}))
  want, _ = run(dot_product_attention, implementation="xla", **kw)
  got, tiles = run(context_parallel(strategy), implementation="xla_chunked", **kw)
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
    assert a.dtype == jnp.float64 and not np.isnan(a).any(), (strategy, normalizer, name)
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12,
                               err_msg=f"{strategy} {normalizer} {name}")
  if plain:  # the same call without is_causal: every tile, in the same sweeps
    _, full = run(context_parallel(strategy), implementation="xla_chunked",
                  normalizer=normalizer)
    assert set(full) == set(tiles) == {"fwd", "bwd"}, (full, tiles)
    for sweep, n in tiles.items():
      if exact:  # the same passes over each query block: the pairs' share exactly
        assert n * ALL_PAIRS == full[sweep] * CAUSAL_PAIRS, (strategy, normalizer, tiles, full)
      else:  # a threshold search's steps depend on the rows: the share, give or take a step
        assert n <= 0.6 * full[sweep], (strategy, normalizer, tiles, full)
  return tiles
"""

_CAUSAL_TILES = r"""
assert (CAUSAL_PAIRS, ALL_PAIRS) == (136, 256)
strategy = STRATEGY
tiles = check(strategy, "softmax")
# softmax: one forward and one backward sweep, each over the causal pairs only
assert tiles == {"fwd": LOOPS[strategy] * CAUSAL_PAIRS, "bwd": LOOPS[strategy] * CAUSAL_PAIRS}, (
    strategy, tiles)
print("ok", tiles["fwd"] / (LOOPS[strategy] * ALL_PAIRS), flush=True)
"""


@pytest.mark.parametrize("strategy", [
    "all_gather", pytest.param("ulysses", marks=pytest.mark.slow)])
def test_causal_context_parallel_runs_the_causal_tiles(strategy):
  """Causal with load balance, softmax (class E), GQA: values and gradients equal the
  one-device call, and the forward and backward sweeps each run exactly the tiles of the
  causal pairs (136 of 256 per loop over the sequence: 0.53). all_gather by default;
  ulysses (whose call is the one-device causal call for its head group) in the slow run."""
  proc = run_on_cpu_devices(_PRELUDE + f"STRATEGY = {strategy!r}\n" + _CAUSAL_TILES, 8)
  assert proc.stdout.split("\n")[:-1] == ["ok 0.53125"], proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["all_gather", "ulysses"])
def test_causal_context_parallel_skips_tiles_for_every_class(strategy):
  """Classes S, P and R (the statistics pass): each sweep runs exactly the causal share
  (136/256) of the tiles the non-causal call runs; class T (sparsemax, entmax15, top-k),
  whose threshold search takes as many steps over the tiles as its rows need: at most
  0.6 of them (the causal rows' searches differ from the full rows'); and the causal call with lengths and
  segment ids crossing the shards (values and gradients only: lengths and segments cut
  further tiles, differently per batch shard)."""
  script = _PRELUDE + f"""
for normalizer in ("stablemax", "sigmoid", "standardized_softmax"):
  check({strategy!r}, normalizer, plain=True)
for normalizer in ("sparsemax", "entmax15", "top_k_softmax"):
  check({strategy!r}, normalizer, plain=True, exact=False)
for normalizer in ("softmax", "sparsemax"):
  check({strategy!r}, normalizer, masks=MASKED)
print("ok", flush=True)
"""
  proc = run_on_cpu_devices(script, 8, timeout=3000)
  assert proc.stdout.split("\n")[:-1] == ["ok"], proc.stdout
