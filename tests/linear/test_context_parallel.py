"""Context parallelism of the recurrent linear families (jaxsoft.linear.context_parallel).

The sequence is split over a 4-device mesh axis inside ``jax.shard_map`` (8 fake CPU devices,
in a subprocess: the device count is fixed when JAX starts). The reference is the unsharded
call of the same function on the whole sequence in its token-by-token recurrent form (an
independent computation: one scan over all T tokens, no chunks, no maps, no fold); the
sharded calls use the chunked form (chunks of 2, two per shard) or the recurrent one (the
shard maps come from the chunk terms either way). float64 throughout: the sharded path adds
the shard maps' compositions (a few products of [K, K] or [K] maps with entries <= 1 in
magnitude for these inputs), so the two agree to ~1e-14; the tolerance 1e-9 leaves room and
is far below the error of dropping the incoming state (~1e-1, checked).

segment_ids straddle the shard boundaries (a run crossing 4|8, resets exactly at 4 and at 8,
a reset inside a shard) and every call starts from an initial state (random, with the shapes
of the family's structure, entries in (0.1, 0.9)).
"""

import textwrap

import pytest

from tests.helpers import run_on_cpu_devices

_PRELUDE = textwrap.dedent("""
    import os
    # small programs run once: XLA's cheapest CPU code generation compiles them fastest
    os.environ["XLA_FLAGS"] += (" --xla_backend_optimization_level=0"
                                " --xla_llvm_disable_expensive_passes=true")
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_enable_x64", True)
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import jaxsoft.linear as jl

    CP = 4
    mesh = jax.make_mesh((CP,), ("cp",), axis_types=(AxisType.Explicit,))
    B, T, N, K, R = 2, 16, 2, 4, 2
    # row 0: a run crossing the 4|8 boundary, resets inside shards; row 1: resets AT 4 and 8
    seg = jnp.array([[0] * 3 + [1] * 6 + [2] * 7, [0] * 4 + [1] * 4 + [2] * 5 + [3] * 3],
                    jnp.int32)
    rng = np.random.default_rng(0)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s))
    unit = lambda *s: jnp.asarray(rng.uniform(0.1, 0.9, size=s))
    logdecay = lambda *s: jnp.log(jnp.asarray(rng.uniform(0.6, 1.0, size=s)))
    l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    qkv = lambda: (normal(B, T, N, K), normal(B, T, N, K), normal(B, T, N, K))

    # name -> () -> (positional arrays, keyword arrays, static keywords)
    CASES = {
        "linear_attention": lambda: (qkv(), {}, {}),
        "simple_gla": lambda: ((*qkv(), logdecay(B, T, N)), {}, {}),
        "gla": lambda: ((*qkv(), logdecay(B, T, N, K)), {}, {}),
        "delta_rule": lambda: ((*qkv(), unit(B, T, N)), {}, {"qk_l2norm": True}),
        "gated_delta_rule": lambda: ((*qkv(), logdecay(B, T, N), unit(B, T, N)), {},
                                     {"qk_l2norm": True}),
        "lightning_attention": lambda: (qkv(), {}, {"layer_idx": 1, "num_layers": 4}),
        "taylor_linear_attention": lambda: (tuple(0.5 * x for x in qkv()), {}, {}),
        "mala": lambda: (qkv(), {}, {}),
        "ccq": lambda: ((lambda q, k, v: (q, l2(k), v, logdecay(B, T, N)))(*qkv()), {},
                        {"strength": 0.5}),
        "softmax_linear_attention": lambda: ((*qkv(), normal(B, T, N), normal(B, T, N)),
                                             {"g": logdecay(B, T, N)}, {}),
        "interdomain_attention": lambda: ((*qkv(), normal(B, T, N, R), normal(B, T, N, R),
                                           -unit(N, R)), {}, {}),
        "transnormer_attention": lambda: (qkv(), {}, {}),
        "cosformer": lambda: (qkv(), {}, {}),
        # mini-batches of 2 (two per shard); l2-normalised keys and η < 1 keep W bounded
        "ttt_linear": lambda: ((lambda q, k, v: (q, l2(k), v, unit(B, T, N)))(*qkv()), {},
                               {"mini_batch_size": 2}),
        # a window of 3 reaches 2 tokens into the previous shard; 2 slots
        "native_hybrid_attention": lambda: ((*qkv(), logdecay(B, T, N, 2)), {}, {"window": 3}),
        # blocks of 2 (two per shard), the whole sequence's mixing [8, 8], entries > 0
        "mhla": lambda: ((*qkv(), unit(N, T // 2, T // 2)), {}, {"block_size": 2}),
    }
    # the reference form of the families without a token-by-token one
    REFERENCE_FORM = {"mhla": "parallel"}

    def spec(x):
      return P(None, "cp") if x.ndim >= 2 and x.shape[:2] == (B, T) else P()

    def put(tree):
      return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec(x))), tree)

    def loss(out):
      o, S = out if isinstance(out, tuple) else (out, ())
      return jnp.sum(jnp.sin(o)) + sum(jnp.sum(jnp.cos(s)) for s in jax.tree.leaves(S))

    def close(a, b, what, tol=1e-9):
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape and x.dtype == np.float64, (what, x.shape, y.shape, x.dtype)
        err = np.max(np.abs(x - y) / (tol + tol * np.abs(y)))
        assert err <= 1.0, (what, float(np.max(np.abs(x - y))))

    def check(name, hlo=False, control=False, implementation="chunked", case=None, **more):
      import inspect
      fn = getattr(jl, name)
      args, kwa, static = (case or CASES[name])()
      static = dict(static, **more)
      takes = inspect.signature(fn).parameters
      opts_ref = dict(static, implementation=REFERENCE_FORM.get(name, "recurrent"))
      opts = dict(static, implementation=implementation)
      if "chunk_size" in takes:
        opts["chunk_size"] = 2
      state = {}
      if "initial_state" in takes:
        # an initial state of the family's structure (its final state's shapes), entries in
        # (0.1, 0.9): positive like the normalisers' z, so no denominator comes near 0
        shapes = jax.eval_shape(lambda: fn(*args, **kwa, **static, output_final_state=True))[1]
        state = {"initial_state": jax.tree.map(lambda s: unit(*s.shape), shapes)}
        opts_ref["output_final_state"] = opts["output_final_state"] = True
      segs = {"segment_ids": seg} if "segment_ids" in takes else {}
      cpf = jl.context_parallel(fn, axis_name="cp")
      in_specs = jax.tree.map(spec, (args, kwa, state, segs))
      out_specs = (P(None, "cp"), jax.tree.map(lambda _: P(), state["initial_state"])) if state \
          else P(None, "cp")
      sharded = jax.shard_map(lambda a, kw, S, sg: cpf(*a, **kw, **S, **sg, **opts),
                              mesh=mesh, in_specs=in_specs, out_specs=out_specs)
      first = lambda out: out[0] if isinstance(out, tuple) else out
      alone = jax.shard_map(lambda a, kw, S, sg: first(fn(*a, **kw, **S, **sg, **opts)),
                            mesh=mesh, in_specs=in_specs, out_specs=P(None, "cp"))
      ref = lambda a, kw, S, sg: fn(*a, **kw, **S, **sg, **opts_ref)

      def value_and_grads(f, a, kw, S, sg):
        return jax.value_and_grad(lambda a, kw, S: (lambda out: (loss(out), out))(f(a, kw, S, sg)),
                                  argnums=(0, 1, 2), has_aux=True)(a, kw, S)

      def both(inputs, inputs_ref):
        extra = alone(*inputs) if control else None
        return (value_and_grads(sharded, *inputs), value_and_grads(ref, *inputs_ref), extra)

      inputs = put((args, kwa, state, segs))
      inputs_ref = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())),
                                (args, kwa, state, segs))
      compiled = jax.jit(both).lower(inputs, inputs_ref).compile()
      ((_, out_cp), g_cp), ((_, out_ref), g_ref), o_alone = compiled(inputs, inputs_ref)
      close(out_cp, out_ref, name + " forward")
      close(g_cp, g_ref, name + " gradients")
      if hlo:
        assert "all-gather" in compiled.as_text(), name
      if control:   # each shard alone (no incoming state): far from the reference
        assert float(jnp.max(jnp.abs(o_alone - first(out_ref)))) > 1e-2, name
      print("ok", name)
""")


def test_context_parallel_matches_unsharded():
  """One diagonal-gate family (GLA), one delta-rule family (Gated DeltaNet), plain linear
  attention and two with their own state passing (Native Hybrid Attention's slots and
  window halo, MHLA's gathered block summaries; cosFormer and TTT-Linear run in the slow
  tests, to keep the default suite's time): outputs, final state and the gradients of q, k,
  v, the gates, beta, the slot gates, the mixing matrix and the initial state equal the
  unsharded call's; the compiled program holds an all-gather; the shards run alone (no
  context parallelism) do not match (the comparison can fail)."""
  script = _PRELUDE + textwrap.dedent("""
      check("gla", hlo=True, control=True)
      check("gated_delta_rule", implementation="recurrent")
      check("linear_attention", implementation="recurrent")
      check("native_hybrid_attention")
      check("mhla")
  """)
  out = run_on_cpu_devices(script, 8).stdout
  assert out.count("ok ") == 5, out


def _recurrent_families():
  """The functions of jaxsoft.linear with a recurrent state: those with a ``*_step``."""
  import jaxsoft.linear as jl
  return sorted(n for n in jl.__all__ if f"{n}_step" in jl.__all__)


def test_every_recurrent_family_is_classified():
  """A new recurrent family must be added to CONTEXT_PARALLEL_FAMILIES (and to the cases of
  the slow test) or to CONTEXT_PARALLEL_UNSUPPORTED with its reason."""
  import jaxsoft.linear as jl
  families = set(_recurrent_families())
  assert families == set(jl.CONTEXT_PARALLEL_FAMILIES) | set(jl.CONTEXT_PARALLEL_UNSUPPORTED)
  assert not set(jl.CONTEXT_PARALLEL_FAMILIES) & set(jl.CONTEXT_PARALLEL_UNSUPPORTED)
  for name in jl.CONTEXT_PARALLEL_UNSUPPORTED:
    with pytest.raises(NotImplementedError, match=name):
      jl.context_parallel(getattr(jl, name), axis_name="cp")
  with pytest.raises(ValueError, match="`fn`"):
    jl.context_parallel(jl.l2_normalize, axis_name="cp")


def _one_device(fn, *arrays, **kwargs):
  """``context_parallel(fn)`` traced (not compiled) on a 1-device mesh, the time axis split."""
  import jax
  from jax.sharding import PartitionSpec as P

  import jaxsoft.linear as jl
  mesh = jax.make_mesh((1,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
  cpf = jl.context_parallel(fn, axis_name="cp")
  f = jax.shard_map(lambda *a: cpf(*a, **kwargs), mesh=mesh,
                    in_specs=tuple(P(None, "cp") for _ in arrays), out_specs=P(None, "cp"))
  return jax.eval_shape(f, *arrays)


def test_context_parallel_shard_length_errors():
  """The shard-length rules of the families with their own state passing name the argument:
  TTT-Linear's and MHLA's shards hold whole mini-batches / blocks, Native Hybrid Attention's
  at least window - 1 tokens; cosFormer's max_len covers the whole sequence."""
  import jax.numpy as jnp

  import jaxsoft.linear as jl
  x = jnp.ones((1, 6, 1, 2))
  with pytest.raises(ValueError, match="mini_batch_size"):
    _one_device(jl.ttt_linear, x, x, x, jnp.ones((1, 6, 1)), mini_batch_size=4)
  with pytest.raises(ValueError, match="block_size"):
    _one_device(jl.mhla, x, x, x, mixing=jnp.ones((2, 2)), block_size=4)
  with pytest.raises(ValueError, match="window"):
    _one_device(jl.native_hybrid_attention, x, x, x, jnp.zeros((1, 6, 1, 1)), window=8)
  with pytest.raises(ValueError, match="max_len"):
    _one_device(jl.cosformer, x, x, x, max_len=4)
  # the rules hold, the same calls trace
  assert _one_device(jl.ttt_linear, x, x, x, jnp.ones((1, 6, 1)), mini_batch_size=3).shape \
      == (1, 6, 1, 2)
  assert _one_device(jl.native_hybrid_attention, x, x, x, jnp.zeros((1, 6, 1, 1)),
                     window=7).shape == (1, 6, 1, 2)


def test_cosformer_traced_start_position():
  """cosFormer with a traced start_position (what context_parallel passes) equals the call
  with the same Python int; a traced start without max_len is refused (the largest distance
  is unknown when tracing)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jaxsoft.linear as jl
  q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 5, 2, 3))
  call = lambda s: jl.cosformer(q, k, v, start_position=s, max_len=12.0, output_final_state=True,
                                implementation="recurrent")
  # one program: the traced start and the Python ints 4 and 0
  traced, static, zero = jax.jit(lambda s: (call(s), call(4), call(0)))(jnp.int32(4))
  for x, y in zip(jax.tree.leaves(traced), jax.tree.leaves(static), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
  # the outputs see only i - j, the state the absolute positions: another start changes it
  assert float(jnp.max(jnp.abs(traced[1][0] - zero[1][0]))) > 1e-2
  with pytest.raises(ValueError, match="max_len"):
    jax.jit(lambda s: jl.cosformer(q, k, v, start_position=s))(jnp.int32(4))


@pytest.mark.slow
def test_every_supported_family_matches_unsharded():
  """Every family of CONTEXT_PARALLEL_FAMILIES (derived from the package in the test above):
  forward, final state and gradients equal the unsharded call's."""
  from jaxsoft.linear import CONTEXT_PARALLEL_FAMILIES
  names = list(CONTEXT_PARALLEL_FAMILIES)
  script = _PRELUDE + f"\nassert sorted(CASES) == sorted({names!r})\n" + "".join(
      f"check({n!r})\n" for n in names)
  out = run_on_cpu_devices(script, 8).stdout
  assert out.count("ok ") == len(names), out


@pytest.mark.slow
def test_own_state_passing_families_every_form_matches_unsharded():
  """The four families with their own state passing over their forms and edge cases:
  Native Hybrid Attention's parallel and recurrent forms, a window of 5 (the halo is the
  whole previous shard) and of 1 (no halo); TTT-Linear's recurrent form and one mini-batch
  per shard; MHLA's parallel form (run from the block summaries), bidirectional, one block
  per shard; cosFormer from start_position 3 with an explicit max_len, chunked and parallel."""
  script = _PRELUDE + textwrap.dedent("""
      nha = lambda w: lambda: ((*qkv(), logdecay(B, T, N, 3)), {}, {"window": w})
      for impl in ("parallel", "recurrent", "chunked"):
        check("native_hybrid_attention", implementation=impl)
        check("native_hybrid_attention", implementation=impl, case=nha(5))
      check("native_hybrid_attention", case=nha(1))   # 7 checks of it in all
      check("ttt_linear", implementation="recurrent")
      check("ttt_linear", implementation="recurrent", mini_batch_size=4)
      check("ttt_linear", mini_batch_size=4)
      check("mhla", implementation="parallel")
      check("mhla", causal=False)
      check("mhla", case=lambda: ((*qkv(), unit(T // 4, T // 4)), {}, {"block_size": 4}))
      for impl in ("chunked", "parallel"):
        check("cosformer", implementation=impl, start_position=3, max_len=40)
      check("cosformer", normalize=False)
  """)
  out = run_on_cpu_devices(script, 8).stdout
  assert out.count("ok ") == 16, out


@pytest.mark.slow
def test_mixer_ttt_linear_and_native_hybrid_match_unsharded():
  """context_parallel_mixer on TTT-Linear (mini-batches of 2) and Native Hybrid Attention
  (a window of 3, 2 slots) layers with short convolutions: the layer's output and input
  gradient equal the unsharded layer's; the mixer still refuses cosFormer and MHLA."""
  script = _PRELUDE + textwrap.dedent("""
      from flax import nnx
      import jaxsoft as js
      d, H = 8, 2
      x = normal(B, T, d)
      for kind, extra in (("ttt_linear", {"mini_batch_size": 2}),
                          ("native_hybrid", {"window": 3, "num_slots": 2})):
        layer = js.nn.LinearMixer(kind, d_model=d, num_heads=H, conv_size=3, dtype=jnp.float64,
                                  rngs=nnx.Rngs(0), **extra)
        f = jax.shard_map(lambda x: jl.context_parallel_mixer(layer, x, axis_name="cp"),
                          mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))
        # the gate parts compute in float32 (see the hybrid test): 1e-5
        close(jax.jit(f)(put(x)), layer(x), kind + " forward", 1e-5)
        gx = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)))))(put(x))
        close(gx, jax.grad(lambda x: jnp.sum(jnp.sin(layer(x))))(x), kind + " gradient", 1e-5)
        print("ok", kind)
      for kind in ("cosformer", "mhla"):
        layer = js.nn.LinearMixer(kind, d_model=d, num_heads=H, max_len=T, rngs=nnx.Rngs(0))
        try:
          jax.shard_map(lambda x: jl.context_parallel_mixer(layer, x, axis_name="cp"),
                        mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))(put(x))
        except NotImplementedError:
          print("ok refused", kind)
  """)
  out = run_on_cpu_devices(script, 8).stdout
  assert out.count("ok ") == 4, out


@pytest.mark.slow
def test_hybrid_three_linear_one_attention_matches_unsharded():
  """A 3:1 hybrid (GLA, Gated DeltaNet, DeltaNet mixers with short convolutions, then causal
  softmax attention) with residuals: the sharded model (linear layers through
  context_parallel_mixer, attention on the all-gathered sequence, its own rows kept) gives
  the unsharded outputs and input gradient."""
  script = _PRELUDE + textwrap.dedent("""
      from flax import nnx
      import jaxsoft as js
      d, H = 8, 2
      layers = [js.nn.LinearMixer(kind, d_model=d, num_heads=H, conv_size=4, chunk_size=2,
                                  dtype=jnp.float64, rngs=nnx.Rngs(i))
                for i, kind in enumerate(("gla", "gated_delta_rule", "delta_rule"))]
      attn = js.nn.MultiHeadAttention(H, d, dtype=jnp.float64, param_dtype=jnp.float64,
                                      rngs=nnx.Rngs(7))

      def model(x):
        for layer in layers:
          x = x + layer(x)
        return x + attn(x, is_causal=True)

      def model_cp(x):
        for layer in layers:
          x = x + jl.context_parallel_mixer(layer, x, axis_name="cp")
        full = jax.lax.all_gather(x, "cp", axis=1, tiled=True)
        i, t = jax.lax.axis_index("cp"), x.shape[1]
        return x + jax.lax.dynamic_slice_in_dim(attn(full, is_causal=True), i * t, t, axis=1)

      x = normal(B, T, d)
      f = jax.shard_map(model_cp, mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))
      xs = put(x)
      # the layers compute their gates in float32 (jaxsoft.nn's gate parts cast to it): the
      # two paths' float64 values, equal to ~1e-15, can round to float32 values one ulp
      # (6e-8 relative) apart there, and the gradients pass through those casts: 1e-5
      tol = 1e-5
      close(jax.jit(f)(xs), model(x), "hybrid forward", tol)
      gx = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)))))(xs)
      close(gx, jax.grad(lambda x: jnp.sum(jnp.sin(model(x))))(x), "hybrid gradient", tol)
      print("ok hybrid")
  """)
  out = run_on_cpu_devices(script, 8).stdout
  assert "ok hybrid" in out, out
