"""Every registered normalizer in the attention slot: xla_chunked against the dense xla path,
forward and every cotangent (q, k, v, bias and array hyperparameters). The list is read from
the registry at collection time, so a newly registered normalizer is covered automatically."""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxsoft.normalizers as nz
from jaxsoft.attention import _chunked
from jaxsoft.attention import dot_product_attention as dpa
from tests import helpers
from tests.attention.reference import assert_same_jit
from tests.helpers import LazyCases, make_qkv, registry_sample

NAMES = sorted(nz.REGISTRY)
B, T, N, K, H = 2, 11, 4, 2, 8


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
  monkeypatch.setattr(_chunked, "BLOCK_Q", 4)
  monkeypatch.setattr(_chunked, "BLOCK_K", 4)


def _params(spec, per_row=False):
  """Each parameter's sample value; row-broadcast ones as per-head (or per-row) arrays."""
  params = {}
  for p in spec.params:
    if p.sample is None:
      continue
    if p.row_broadcast:
      shape = (B, N, T, 1) if per_row else (N, 1, 1)
      params[p.name] = jnp.full(shape, p.sample, jnp.float32)
    else:
      params[p.name] = p.sample
  return params


def _chunkable(spec) -> bool:
  rule = {"T": spec.threshold, "R": spec.row_stats, "X": None}.get(spec.kernel_class, spec.tile)
  return rule is not None and not spec.needs_key


def _compare(name, kw, params, q, k, v, bias):
  spec = nz.get(name)
  arrays = {n: a for n, a in params.items() if isinstance(a, jax.Array)}
  static = {n: a for n, a in params.items() if n not in arrays}
  if spec.needs_key:
    static["key"] = jax.random.PRNGKey(42)

  def f(impl, q, k, v, bias, arrays):
    return dpa(q, k, v, bias, normalizer=name, normalizer_params={**static, **arrays},
               implementation=impl, **kw)

  if not _chunkable(spec):
    # the chunked path declines (class X, stochastic): NotImplementedError, and the
    # dispatcher falls back to the dense path
    with pytest.raises(NotImplementedError):
      f("xla_chunked", q, k, v, bias, arrays)
    fallback = f(("xla_chunked", "xla"), q, k, v, bias, arrays)
    assert jnp.array_equal(fallback, f("xla", q, k, v, bias, arrays))
    return
  assert_same_jit(functools.partial(f, "xla_chunked"), functools.partial(f, "xla"),
                  (q, k, v, bias, arrays))


@pytest.mark.parametrize("name", registry_sample(NAMES))
def test_chunked_matches_dense(name):
  """Causal + padding + GQA + bias, sampled hyperparameters as per-head arrays."""
  q, k, v = make_qkv(0, B, T, N=N, K=K, H=H)
  bias = 0.5 * helpers.standard_normal(1, (1, N, T, T))
  kw = {"is_causal": True, "key_value_seq_lengths": jnp.array([8, 11], jnp.int32)}
  _compare(name, kw, _params(nz.get(name)), q, k, v, bias)


SLOW_CASES = LazyCases(  # arrays built on first use, not at import
    window_segments=lambda: {"local_window_size": (3, 2),
                             "segment_ids": jnp.array([[0] * 5 + [1] * 6, [2] * 3 + [4] * 8])},
    mask_softcap=lambda: {"mask": jax.random.bernoulli(jax.random.PRNGKey(2), 0.7, (B, 1, T, T)),
                          "logits_soft_cap": 2.0},
    padding_both=lambda: {"query_seq_lengths": jnp.array([6, 11], jnp.int32),
                          "key_value_seq_lengths": jnp.array([9, 4], jnp.int32)},
)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SLOW_CASES))
@pytest.mark.parametrize("name", NAMES)
def test_chunked_matches_dense_sweep(name, case):
  q, k, v = make_qkv(3, B, T, N=N, K=K, H=H)
  bias = 0.5 * helpers.standard_normal(4, (B, N, T, T))
  _compare(name, SLOW_CASES[case], _params(nz.get(name), per_row=True), q, k, v, bias)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in NAMES if _chunkable(nz.get(n)) and nz.get(n).smooth])
def test_check_grads_float64(name):
  with jax.enable_x64(True):
    q, k, v = make_qkv(5, 1, 6, N=2, K=1, H=4, dtype=jnp.float64)
    f = lambda q, k, v: dpa(q, k, v, is_causal=True, normalizer=name,  # noqa: E731
                            implementation="xla_chunked")
    jax.test_util.check_grads(f, (q, k, v), order=1, modes=("rev",), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", [n for n in NAMES if getattr(nz.get(n).tile, "m_floor", None)
                                  is not None])
def test_stabiliser_floor_very_negative_logits(name):
  """Rules with e^{-m} terms declare m_floor: key blocks far below -88 must not overflow."""
  q, k, v = make_qkv(6, 1, T, N=2, K=1, H=H)
  bias = jnp.full((1, 1, T, T), -200.0)
  # jitted: one program each instead of op-by-op dispatch
  out_c, out_d = (jax.jit(functools.partial(dpa, is_causal=True, normalizer=name,
                                            implementation=impl))(q, k, v, bias)
                  for impl in ("xla_chunked", "xla"))
  assert bool(jnp.all(jnp.isfinite(out_c)))
  chex.assert_trees_all_close(out_c, out_d, atol=1e-5, rtol=1e-5)
