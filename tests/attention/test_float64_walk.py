"""Every attention path and every public attention function keeps float64 under
``JAX_ENABLE_X64`` (issue 37's guard "float64 stays float64": no public function silently
computes in float32).

Two walks, each generated from the library's own lists so that a new entry joins them:

* ``dot_product_attention``: every CPU implementation ("xla"; "xla_chunked" with 4 x 4
  blocks, so rows span several key blocks, a partial last one included; "pallas" in the
  Pallas interpreter, ``JAXSOFT_PALLAS_INTERPRET=1``) x every registered normalizer, on a
  causal call with key padding (``key_value_seq_lengths``) and a dense bias, in float64.
  The output is float64 and equals ``tests/reference_f64.attention64`` (numpy float64
  dense attention with the normalizer's float64 reference, ``reference_f64.normalizer``)
  to 1e-10: float64 arithmetic on these O(1) values is ~1e-15 off, one float32 rounding
  anywhere ~1e-7. Gradients (of ``sum sin(1.3 y + 0.2)``, every output entry with its own
  weight): on "xla" ``jax.test_util.check_grads`` (order 1, reverse mode) in float64; on
  the blockwise paths equal to the dense path's float64 gradient to 1e-10. The
  blockwise paths refuse kernel class X (no blockwise rule, stochastic normalizers): the
  refusal is a NotImplementedError naming the implementation and the normalizer. The
  stochastic normalizers (their PRNG key in ``normalizer_params``) have no reference: on
  "xla" they get the perturbation test below.
* the other public functions of ``jaxsoft.attention`` (:data:`CASES`, one or more calls
  per function built from its signature and docstring example; a public function missing
  from the table fails ``test_every_public_attention_function_is_walked`` unless it is in
  :data:`EXCLUDED` with its reason). Without a float64 reference per function, a
  computation in float64 is told from one in float32 by perturbation (as
  tests/losses/test_float64_walk.py): the inputs are float32 values held in float64;
  each float argument in turn is scaled entrywise by ``1 + r 2^-30`` (|r| in [0.5, 1],
  random signs), below float32's half ulp (2^-25), so the moved input rounds back to the
  same float32 values and a computation cast to float32 returns the very same output. A
  float64 one moves. Every floating output is float64 and finite, and the output moves
  when any float argument moves (arguments that cannot move it, e.g. the energies of a
  hard choice, are listed per case with the reason). Where differentiable, a float64
  finite-difference check of the gradient (``check_grads``, order 1, reverse mode).

The default run is a sample (:data:`DEFAULT_MATRIX`, :data:`DEFAULT_CASES`); ``-m slow``
walks everything (the Pallas cases are also marked ``kernels``).
"""

import dataclasses
import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxsoft as js
from jaxsoft import normalizers as Nm
from jaxsoft.attention import _chunked
from kernels_pallas.backends import INTERPRET_ENV
from tests import reference_f64 as R

A = js.attention
EPS = 2.0 ** -30  # a relative change float64 holds and float32 rounds away
TOL = 1e-10


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


@pytest.fixture(autouse=True)
def _pallas_interpreted(monkeypatch):
  """The Pallas cases run the kernels in the interpreter on a CPU."""
  monkeypatch.setenv(INTERPRET_ENV, "1")


def _functional(out):
  """``sum sin(1.3 y + 0.2)`` over the floating leaves of ``out``."""
  total = 0.0
  for leaf in jax.tree.leaves(out):
    if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.inexact):
      total = total + jnp.sum(jnp.sin(1.3 * leaf + 0.2))
  return total


def _move(x, seed):
  """``x (1 + r EPS)`` per entry, ``|r|`` in [0.5, 1] with random signs."""
  rng = np.random.default_rng([seed, 7])
  r = rng.uniform(0.5, 1.0, size=np.shape(x)) * rng.choice([-1.0, 1.0], size=np.shape(x))
  return np.asarray(x, np.float64) * (1.0 + r * EPS)


def _draw(rng, *shape, scale=1.0, low=None, high=None):
  """float32 values (so that a float32 computation sees the moved input unchanged) in a
  float64 array: normal(0, scale) or uniform(low, high)."""
  x = rng.uniform(low, high, shape) if low is not None else scale * rng.standard_normal(shape)
  return np.asarray(x, np.float32).astype(np.float64)


# ================================================================ dot_product_attention

IMPLEMENTATIONS = ("xla", "xla_chunked", "pallas")  # those that run on a CPU
B, T, S, NQ, NK, H = 2, 7, 9, 2, 1, 4
LENGTHS = (9, 5)  # batch 1: keys 5..8 are padding
BLOCK = 4
# Hyperparameters other than the defaults: top-k below the visible count.
PARAMS = {"top_k_softmax": {"k": 3}}
# Normalizers whose gradient is by definition not the derivative of the forward: the
# straight-through estimators, and the Dirichlet sample's implicit reparameterization
# gradient (jax.random.gamma's: unbiased over the key, not the derivative of the sample at
# a fixed key; jax.random.dirichlet alone is 5% off a finite difference). No
# finite-difference check; float64 gradients only.
SURROGATE_GRADIENT = {"step_straight_through", "gumbel_softmax_hard", "dirichlet_resample"}
# A one-hot forward: the output moves with the values only; the queries, keys and bias
# move the (soft sample's) gradient instead.
HARD_FORWARD = {"gumbel_softmax_hard"}
# The default sample (the full matrix is ~15 minutes on 2 cores; a Pallas case in the
# interpreter ~10 s): a threshold normalizer on the dense path, softmax blockwise, and the
# Pallas path's refusal of class X.
DEFAULT_MATRIX = ("xla-sparsemax", "xla_chunked-softmax", "pallas-congestion_softmax")


def _matrix():
  return [pytest.param(impl, name, id=f"{impl}-{name}",
                       marks=() if f"{impl}-{name}" in DEFAULT_MATRIX else pytest.mark.slow)
          for impl in IMPLEMENTATIONS for name in Nm.names()]


def _refused(impl, spec):
  """The blockwise paths run every kernel class but X (no blockwise rule; the stochastic
  normalizers are class X)."""
  return impl != "xla" and spec.kernel_class == "X"


@pytest.fixture
def small_blocks(monkeypatch):
  monkeypatch.setattr(_chunked, "BLOCK_Q", BLOCK)
  monkeypatch.setattr(_chunked, "BLOCK_K", BLOCK)


def _inputs():
  rng = np.random.default_rng(0)
  return (_draw(rng, B, T, NQ, H), _draw(rng, B, S, NK, H), _draw(rng, B, S, NK, H),
          _draw(rng, B, 1, T, S))


def _visible():
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  return (j <= i)[None, None] & (j < np.asarray(LENGTHS)[:, None, None, None])


def _attention(impl, name):
  spec = Nm.get(name)
  params = dict(PARAMS.get(name, {}))
  if spec.needs_key:
    params["key"] = jax.random.key(0)

  def f(q, k, v, bias):
    return js.attention.dot_product_attention(
        q, k, v, bias, is_causal=True, key_value_seq_lengths=jnp.asarray(LENGTHS, jnp.int32),
        implementation=impl, normalizer=name, normalizer_params=params or None)
  return f


@functools.cache
def _dense_grads(name):
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(a) for a in _inputs())
    f = _attention("xla", name)
    return jax.tree.map(np.asarray, jax.jit(jax.grad(
        lambda *a: _functional(f(*a)), argnums=(0, 1, 2, 3)))(*args))


def test_every_deterministic_normalizer_has_a_float64_reference():
  stochastic = {n for n in Nm.names() if Nm.get(n).needs_key}
  assert set(Nm.names()) - stochastic <= set(R.FORMULAS)
  assert all(Nm.get(n).kernel_class == "X" for n in stochastic)


@pytest.mark.parametrize("impl,name", _matrix())
def test_dot_product_attention_computes_float64_in_float64(x64, small_blocks, impl, name):
  spec = Nm.get(name)
  args = tuple(jnp.asarray(a) for a in _inputs())
  f = jax.jit(_attention(impl, name))
  if _refused(impl, spec):
    with pytest.raises(NotImplementedError, match=rf"(?s){impl}.*{name}"):
      f(*args)
    return
  out = f(*args)
  assert out.dtype == jnp.float64, out.dtype
  loss = jax.jit(lambda *a: _functional(f(*a)))
  if spec.needs_key:  # no reference: the output moves with every input
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    for i in range(4):
      moved = list(args)
      moved[i] = jnp.asarray(_move(args[i], i))
      if name in HARD_FORWARD and i != 2:
        assert any(bool(jnp.any(g != h)) for g, h in zip(grad(*moved), grad(*args),
                                                          strict=True)), (name, i)
      else:
        assert float(jnp.max(jnp.abs(f(*moved) - out))) > 0, (name, i)
  else:
    bias = np.asarray(args[3])
    hp = PARAMS.get(name, {})
    want = R.attention64(*args[:3], _visible(),
                         lambda z, m: R.normalizer(name, z + bias, where=m, **hp))
    np.testing.assert_allclose(np.asarray(out), want, rtol=TOL, atol=TOL)
  if impl == "xla":
    if name in SURROGATE_GRADIENT:
      grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
      assert all(g.dtype == jnp.float64 and bool(jnp.all(jnp.isfinite(g))) for g in grads)
    else:
      check_grads(loss, args, order=1, modes=["rev"])
    return
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
  for g, w, what in zip(grads, _dense_grads(name), "qkvb", strict=True):
    assert g.dtype == jnp.float64, (what, g.dtype)
    scale = max(1.0, float(np.max(np.abs(w))))
    np.testing.assert_allclose(np.asarray(g), w, rtol=TOL, atol=TOL * scale, err_msg=what)


# ================================================================ the other public functions


@dataclasses.dataclass(frozen=True)
class Case:
  """``fn(*floats)`` -> a pytree; ``make(rng)`` -> the float arguments (float64 numpy).

  still: indices of arguments that need not move the output (with the reason in the
  table); grad: check the gradient by finite differences; jit: compile the call; probe:
  ``"grad"`` when the forward is piecewise constant (the float64 arithmetic shows in the
  gradient).
  """

  fn: Callable
  make: Callable
  still: tuple = ()
  grad: bool = True
  probe: str = "value"
  jit: bool = True


def _qkv(rng, b=1, t=5, s=None, n=2, k=1, h=4, hv=None):
  s = t if s is None else s
  return (_draw(rng, b, t, n, h), _draw(rng, b, s, k, h), _draw(rng, b, s, k, hv or h))


def _qkv_fn(fn, **kw):
  """A call ``fn(q, k, v, **kw)`` on standard [1, 5, 2, 4] / [1, 5, 1, 4] inputs."""
  return Case(lambda q, k, v: fn(q, k, v, **kw), lambda rng: _qkv(rng))


def _mesh():
  return jax.make_mesh((1,), ("context",))


def _selection_step(q, k, v):
  cache = A.init_selection_cache(1, 2, 4, top_k=2, dtype=jnp.float64)
  out, cache, _ = A.selection_cache_step(q, k, v, cache, top_k=2, threshold=0.9)
  out2, _, _ = A.selection_cache_step(q, k, v, cache, top_k=2, threshold=0.9)
  return out, out2


def _cases():
  c: dict[str, Case] = {}
  kv = lambda rng, *shape: (_draw(rng, *shape), _draw(rng, *shape))  # noqa: E731
  c["dot_product_attention"] = _qkv_fn(A.dot_product_attention, is_causal=True)
  c["dense_logits"] = Case(lambda q, k, b: A.dense_logits(q, k, scale=0.5, bias=b),
                           lambda rng: (*_qkv(rng)[:2], _draw(rng, 1, 2, 5, 5)))
  c["hopfield_retrieval"] = Case(
      lambda x, m, beta: A.hopfield_retrieval(x, m, beta=beta, num_iters=2),
      lambda rng: (_draw(rng, 3, 4), _draw(rng, 5, 4), np.float64(2.0)))
  c["hopfield_energy"] = Case(lambda x, m, beta: A.hopfield_energy(x, m, beta=beta),
                              lambda rng: (_draw(rng, 3, 4), _draw(rng, 5, 4), np.float64(2.0)))
  c["gated_attention_output"] = Case(
      A.gated_attention_output,
      lambda rng: (_draw(rng, 1, 3, 2, 4), _draw(rng, 1, 3, 5), _draw(rng, 5, 2), _draw(rng, 2)))
  c["forget_gate_decay"] = Case(A.forget_gate_decay,
                                lambda rng: (_draw(rng, 1, 5, 2, low=-1.0, high=-0.05),))
  c["forgetting_attention"] = Case(
      A.forgetting_attention,
      lambda rng: (*_qkv(rng, k=2), _draw(rng, 1, 5, 2, low=-1.0, high=-0.05)))
  c["acp_prune_threshold"] = Case(lambda q, k: A.acp_prune_threshold(q, k, epsilon=1e-3),
                                  lambda rng: _qkv(rng)[:2], grad=False)  # no gradient
  c["ssmax_attention"] = Case(lambda q, k, v, s: A.ssmax_attention(q, k, v, s=s, is_causal=True),
                              lambda rng: (*_qkv(rng), _draw(rng, 2, low=0.3, high=1.0)))
  c["entmax_attention"] = Case(
      lambda q, k, v, a: A.entmax_attention(q, k, v, alpha=a, is_causal=True),
      lambda rng: (*_qkv(rng), _draw(rng, 2, low=1.3, high=1.8)))
  c["sparsemax_attention"] = _qkv_fn(A.sparsemax_attention, is_causal=True)
  c["per_head"] = Case(lambda x: A.per_head(x, 2, "s", "test"), lambda rng: (_draw(rng, 2),))
  c["softplus_to_range"] = Case(lambda z: A.softplus_to_range(z, 1.0, 0.01),
                                lambda rng: (_draw(rng, 4),))
  c["softplus_from_range"] = Case(lambda a: A.softplus_from_range(a, 1.0, 0.01),
                                  lambda rng: (_draw(rng, 4, low=1.2, high=3.0),))
  c["merge_kv"] = Case(lambda k, v: A.merge_kv(k, v, jnp.asarray([0, 0, 1, 2, 1]), num_clusters=3),
                       lambda rng: _qkv(rng)[1:])
  for impl in ("xla", "xla_chunked"):
    c[f"topk_attention-{impl}"] = _qkv_fn(A.topk_attention, top_k=2, implementation=impl,
                                          block_k=2)
  block_sparse = {"blasst": dict(skip_threshold=1.0), "moba": dict(top_k_blocks=2),
                  "bfla": dict(mass_threshold=0.9), "prism": dict(top_k_blocks=2)}
  for method, kw in block_sparse.items():
    c[f"block_sparse_attention-{method}"] = Case(
        lambda q, k, v, kw=kw, method=method: A.block_sparse_attention(
            q, k, v, method=method, block_size=4, is_causal=True, **kw),
        lambda rng: _qkv(rng, t=12, h=8))
  c["blasst_calibrate"] = Case(
      lambda q, k: A.blasst_calibrate(q, k, target_sparsity=0.5, block_size=4, is_causal=True),
      lambda rng: (_draw(rng, 1, 16, 1, 8, scale=2.0), _draw(rng, 1, 16, 1, 8, scale=2.0)),
      grad=False, jit=False)  # a calibration on concrete samples (numpy inside)
  c["sparse_state_expansion"] = Case(
      lambda q, k, v, r: A.sparse_state_expansion(q, k, v, r, top_k=2, chunk_size=2),
      lambda rng: (*_qkv(rng, k=2), _draw(rng, 1, 5, 2, 3)))
  c["sse_gates"] = Case(lambda r: A.sse_gates(r, 2), lambda rng: (_draw(rng, 3, 4),))
  c["lucid_attention"] = _qkv_fn(A.lucid_attention)
  c["lucid_preconditioned_values"] = Case(A.lucid_preconditioned_values,
                                          lambda rng: _qkv(rng)[1:])
  for impl in ("xla", "xla_chunked"):
    c[f"multi_token_attention-{impl}"] = Case(
        lambda q, k, v, w, impl=impl: A.multi_token_attention(
            q, k, v, kernel=w, implementation=impl, block_q=2),
        lambda rng: (*_qkv(rng), _draw(rng, 2, 2, 3)))
  c["tensor_attention-dense"] = Case(
      lambda q, k1, k2, v1, v2: A.tensor_attention(q, k1, k2, v1, v2, is_causal=True),
      lambda rng: (_draw(rng, 1, 4, 2, 4), *kv(rng, 1, 4, 2, 4), *kv(rng, 1, 4, 2, 3)))
  c["tensor_attention-polynomial"] = Case(
      lambda q, k1, k2, v1, v2: A.tensor_attention(q, k1, k2, v1, v2,
                                                   implementation="polynomial", degree=2),
      lambda rng: (_draw(rng, 1, 4, 2, 3, scale=0.5), *kv(rng, 1, 4, 2, 3), *kv(rng, 1, 4, 2, 2)))
  c["soft_attention"] = Case(lambda q, v: A.soft_attention(q, v, num_landmarks=3, num_iters=20),
                             lambda rng: (_draw(rng, 1, 6, 2, 4), _draw(rng, 1, 6, 2, 3)))
  c["gaussian_kernel"] = Case(A.gaussian_kernel, lambda rng: (_draw(rng, 3, 2), _draw(rng, 4, 2)))
  c["newton_schulz_pinv"] = Case(
      lambda a: A.newton_schulz_pinv(a, 30),
      lambda rng: (np.asarray([[2.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 1.5]])
                   + _draw(rng, 3, 3, scale=0.05),))
  c["nonlocal_block"] = Case(
      lambda x, a, b, g, o: A.nonlocal_block(x, a, b, g, o, num_heads=2, use_softmax=True),
      lambda rng: (_draw(rng, 1, 4, 6), *(_draw(rng, 6, 8, scale=0.3) for _ in range(3)),
                   _draw(rng, 8, 6, scale=0.3)))
  c["multiscreen_attention"] = Case(
      lambda q, k, v, th: A.multiscreen_attention(q, k, v, theta=th, is_causal=True),
      lambda rng: (*_qkv(rng), np.float64(0.25)))
  c["uniattn"] = Case(
      A.uniattn,
      lambda rng: (_draw(rng, 1, 2, 4, 5, low=0.0, high=0.4),
                   _draw(rng, 2, 1, 5, 1, 3), _draw(rng, 2, 1, 4, 3), _draw(rng, 2, 3, 2, 3)))
  c["uniattn_shared_map"] = Case(lambda q, k: A.uniattn_shared_map(q, k, is_causal=True),
                                 lambda rng: _qkv(rng)[:2])
  c["infsa_attention"] = Case(lambda q, k, v, g: A.infsa_attention(q, k, v, gamma=g,
                                                                   is_causal=True),
                              lambda rng: (*_qkv(rng), np.float64(0.5)))
  c["infsa_attention-series"] = Case(
      lambda q, k, v, g: A.infsa_attention(q, k, v, gamma=g, terms=10, normalize=True),
      lambda rng: (*_qkv(rng), np.float64(0.5)))
  c["linear_infsa_attention"] = Case(
      lambda q, k, v, g: A.linear_infsa_attention(q, k, v, gamma=g, iterations=5),
      lambda rng: (_draw(rng, 1, 6, 1, 4, low=0.5, high=2.0),
                   _draw(rng, 1, 6, 1, 4, low=0.5, high=2.0), _draw(rng, 1, 6, 1, 3),
                   np.float64(1.0)))
  c["polar_attention"] = _qkv_fn(A.polar_attention, is_causal=True)
  c["polar_sink_attention"] = Case(
      lambda q, k, v, nb, mg: A.polar_sink_attention(q, k, v, null_bias=nb, magnitude_gain=mg,
                                                     is_causal=True),
      lambda rng: (*_qkv(rng), np.float64(0.5), np.float64(1.0)))
  for impl in ("recurrent", "chunked"):
    c[f"polar_memory-{impl}"] = Case(
        lambda q, k, v, rho, beta, g, impl=impl: A.polar_memory(
            q, k, v, rho, beta, g, implementation=impl, chunk_size=2),
        lambda rng: (*_qkv(rng, t=5, k=2), _draw(rng, 1, 5, 2), _draw(rng, 1, 5, 2, low=0.1,
                                                                         high=0.9),
                     _draw(rng, 1, 5, 2, 4)))
  c["ponet_mix"] = Case(
      lambda q, k, o, sv, lv, v: A.ponet_mix(q, k, o, sv, lv, value=v, segment_size=2, window=3),
      lambda rng: tuple(_draw(rng, 1, 6, 2, 3) for _ in range(6)))
  for method in ("parallel", "cumprod", "loop"):
    c[f"monotonic_attention_probs-{method}"] = Case(
        lambda p, method=method: A.monotonic_attention_probs(p, method=method),
        lambda rng: (_draw(rng, 3, 5, low=0.1, high=0.9),))
    c[f"monotonic_attention-{method}"] = Case(
        lambda q, k, v, b, method=method: A.monotonic_attention(q, k, v, b, method=method),
        lambda rng: (*_qkv(rng, t=3, s=5), _draw(rng, 3, 5)))
  # the hard choice is a step function of the energies: only the values move it
  c["hard_monotonic_attention"] = Case(
      lambda q, k, v: A.hard_monotonic_attention(q, k, v), lambda rng: _qkv(rng, t=3, s=5),
      still=(0, 1))
  c["chunkwise_attention"] = Case(
      lambda q, k, v, b: A.chunkwise_attention(q, k, v, b, chunk_size=2),
      lambda rng: (*_qkv(rng, t=3, s=5), _draw(rng, 3, 5)))
  c["chunkwise_attention-hard"] = Case(  # hard monotonic choice (see above), soft chunk
      lambda q, k, v, b: A.chunkwise_attention(q, k, v, b, chunk_size=2, hard=True),
      lambda rng: (*_qkv(rng, t=3, s=5), _draw(rng, 3, 5)))
  c["local_window_attention"] = Case(
      lambda q, k, v, b: A.local_window_attention(q, k, v, b, window=2),
      lambda rng: (*_qkv(rng, t=3, s=5), _draw(rng, 3, 5)))
  c["segmental_attention"] = Case(
      lambda q, k, v, b: A.segmental_attention(q, k, v, b),
      lambda rng: (*_qkv(rng, t=3, s=5), _draw(rng, 3, 5)))
  c["no_mixing_attention"] = Case(lambda v: A.no_mixing_attention(v, num_heads=2),
                                  lambda rng: (_draw(rng, 1, 5, 1, 3),))
  c["fixed_map_attention"] = Case(A.fixed_map_attention,
                                  lambda rng: (_draw(rng, 5, 5), _draw(rng, 1, 5, 1, 3)))
  c["embedding_qk_attention"] = Case(
      A.embedding_qk_attention,
      lambda rng: (_draw(rng, 5, 2, 4), _draw(rng, 5, 1, 4), _draw(rng, 1, 5, 1, 3)))
  c["tropical_attention"] = _qkv_fn(A.tropical_attention)
  c["selection_cache_step"] = Case(_selection_step, lambda rng: _qkv(rng, t=1, s=6))
  # the top-k choice is piecewise constant in the weights; the scores are sums of them
  c["anchor_layer_scores"] = Case(lambda w: A.anchor_layer_scores(w, top_k=2),
                                  lambda rng: (_draw(rng, 3, 1, 2, 4, 6, low=0.0, high=1.0),))
  c["select_anchor_layers"] = Case(
      lambda m: A.select_anchor_layers(m, num_anchors=2),
      lambda rng: (np.triu(_draw(rng, 4, 4, low=0.0, high=1.0)) + np.eye(4),), grad=False)
  c["context_parallel_attention"] = Case(
      lambda q, k, v: A.context_parallel_attention(q, k, v, mesh=_mesh(), is_causal=True),
      lambda rng: _qkv(rng, t=4))
  for name in ("nats_attention", "oryx_attention"):
    c[name] = Case(
        getattr(A, name),
        lambda rng: (*_qkv(rng, t=6, k=2), _draw(rng, 1, 6, 2, low=-0.5, high=-0.05),
                     _draw(rng, 1, 6, 2, low=0.1, high=0.9), _draw(rng, 1, 6, 2, low=0.1,
                                                                   high=0.9)))
  # the forward is 0 or 1: the float64 arithmetic is its straight-through gradient's
  c["straight_through_route"] = Case(A.straight_through_route, lambda rng: (_draw(rng, 6),),
                                     grad=False, probe="grad")
  return c


CASES = _cases()
# Public names that are not functions of float arrays, with the reason.
EXCLUDED = {
    "alternating_matching": "returns integer cluster ids (no float output)",
    "blasst_skip_threshold": "Python arithmetic on a length and a Python float",
    "init_selection_cache": "allocates zeros of the given dtype (walked through "
                            "selection_cache_step with dtype=float64)",
    "load_balance_order": "returns an integer permutation",
    "mta_identity_kernel": "a constant of the given dtype (no float input)",
}
# The default sample: the two functions that computed in float32 (softplus_from_range,
# straight_through_route), a monotonic alignment and an attention variant.
DEFAULT_CASES = ("softplus_from_range", "straight_through_route",
                 "monotonic_attention_probs-parallel", "polar_attention")


def _function_name(cid):
  return cid.split("-", 1)[0]


def test_every_public_attention_function_is_walked():
  """A new public function of ``jaxsoft.attention`` must join :data:`CASES` (or
  :data:`EXCLUDED` with its reason); classes and constants are not functions."""
  public = {n for n in A.__all__
            if callable(getattr(A, n)) and not inspect.isclass(getattr(A, n))}
  walked = {_function_name(cid) for cid in CASES}
  assert walked.isdisjoint(EXCLUDED)
  assert walked | set(EXCLUDED) == public, sorted((walked | set(EXCLUDED)) ^ public)


def _probe(case):
  """The compiled function whose floating leaves must be float64 and move."""
  if case.probe == "grad":
    return jax.jit(lambda *xs: jax.grad(lambda *a: _functional(case.fn(*a)),
                                        argnums=tuple(range(len(xs))))(*xs))
  return jax.jit(case.fn) if case.jit else case.fn


def _floating(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)
          if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]


# Under x64 an int64 index scattered into an int32 array warns, and is an error in newer JAX.
@pytest.mark.filterwarnings("error:scatter inputs have incompatible types:FutureWarning")
@pytest.mark.parametrize("cid", [pytest.param(c, marks=() if c in DEFAULT_CASES
                                              else pytest.mark.slow) for c in CASES])
def test_public_function_computes_float64_in_float64(x64, cid):
  case = CASES[cid]
  xs = tuple(np.asarray(x, np.float64) for x in case.make(np.random.default_rng(0)))
  f = _probe(case)
  out = _floating(f(*map(jnp.asarray, xs)))
  assert out, f"{cid}: no floating output"
  for leaf in out:
    assert leaf.dtype == np.float64, (cid, leaf.dtype)
    assert np.all(np.isfinite(leaf)), cid
  for i, x in enumerate(xs):
    if i in case.still:
      continue
    moved = _move(x, i)
    assert np.any(moved != x)
    args = [jnp.asarray(a) for a in xs]
    args[i] = jnp.asarray(moved)
    got = _floating(f(*args))
    assert any(np.any(g != w) for g, w in zip(got, out, strict=True)), (
        f"{cid}: argument {i} moved by 2^-30 (relative) and the output did not: the "
        "computation rounds it to float32")
  if case.grad:
    check_grads(jax.jit(lambda *a: _functional(case.fn(*a))), tuple(map(jnp.asarray, xs)),
                order=1, modes=["rev"])
