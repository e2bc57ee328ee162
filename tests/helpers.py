"""Helpers shared by the test modules (no tests here): `from tests import helpers`.

* inputs: ``normal`` (jax.random); from numpy's generator, with no ``jax.random``
  compilation: ``standard_normal``, ``rows`` / ``rows_and_mask`` (no JAX work at import
  time), ``random_cotangent``, ``make_qkv``; ``LazyCases`` builds named parameter cases on
  first use instead of at collection; ``ROOT`` and ``load_script`` (bench/);
  ``train_argv`` / ``train_records`` (the tiny model the train/ tests run);
* comparisons: ``vjp_close``, ``value_and_vjp``, ``value_and_grads``, ``assert_same``;
* the normalizer checks shared by the N02-N24 files (``tile_eval``, ``check_tile_rule``,
  ``check_mask_is_delete``, ``check_masked_columns``, ``check_fully_masked``,
  ``check_low_precision``, ``check_raises``); they compare against independent
  computations, never the function itself;
* parametrization: ``sampled`` (a default subset, the rest under ``slow``),
  ``LOW_PRECISION``, the tolerances ``FWD`` / ``BWD``.
"""

import collections.abc
import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]  # the repository
FWD = dict(rtol=1e-5, atol=1e-5)
BWD = dict(rtol=1e-4, atol=1e-4)
# bfloat16 in the default run, float16 with `-m slow`.
LOW_PRECISION = [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)]


# ---------------------------------------------------------------------------------- inputs


def _standard_normal(seed, shape):
  """float32 standard normals from numpy's ``default_rng(seed)``.

  Test data comes from numpy, not ``jax.random``: each new shape of a threefry draw is a
  separate XLA compilation of several CPU-seconds on this suite's 2-core machine (measured
  4-7 s with JAX 0.10.2), paid again by every pytest worker that collects the module."""
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def standard_normal(seed, shape):
  """Standard normals from numpy's ``default_rng(seed)`` in JAX's default float dtype
  (float32, float64 under ``JAX_ENABLE_X64``), like ``jax.random.normal(key, shape)``."""
  return jnp.asarray(_standard_normal(seed, shape), jax.dtypes.canonicalize_dtype(jnp.float64))


def normal(seed, shape, scale=1.0, dtype=jnp.float32):
  """``scale`` times standard normals drawn (in float32) from ``jax.random.key(seed)``.

  (Its callers' data-dependent preconditions were written against these draws; new test data
  should come from :func:`standard_normal` or :func:`rows`, which compile nothing.)"""
  return (scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)).astype(dtype)


def rows(seed, shape, scale=1.0):
  """float32 rows ``scale * N(0, 1)`` from numpy's ``default_rng(seed)``."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def rows_and_mask(seed, shape, scale=1.0, p=0.7):
  """``rows(seed, shape, scale)`` and, from the same generator, a mask visible with
  probability ``p`` whose first column is always visible (no fully masked row)."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)
  mask = rng.random(shape) < p
  mask[:, 0] = True
  return x, jnp.asarray(mask)


def random_rows(seed, shape=(6, 11), scale=1.5, masked=True):
  """Random scores and a random mask with one fully masked row and one full row."""
  rng = np.random.default_rng(seed)
  x = (scale * rng.standard_normal(shape)).astype(np.float32)
  mask = rng.random(shape) < 0.75
  mask[0] = False
  mask[1] = True
  if not masked:
    mask[:] = True
  return jnp.asarray(x), jnp.asarray(mask)


def random_cotangent(shape, seed=7, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def make_qkv(seed=0, B=2, T=11, S=None, N=4, K=2, H=8, Hv=None, dtype=jnp.float32):
  """Attention inputs q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv]."""
  S = T if S is None else S
  Hv = H if Hv is None else Hv
  rng = np.random.default_rng(seed)  # numpy, not jax.random: see _standard_normal
  q, k, v = (jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
             for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv)))
  return q, k, v


def segment_mask(q_seg, kv_seg):
  """The dense mask [B, 1, T, S] of segment ids (an oracle for segment_ids)."""
  return (q_seg[:, :, None] == kv_seg[:, None, :])[:, None]


class LazyCases(collections.abc.Mapping):
  """Named cases whose values hold arrays: the names are known at collection (for
  parametrize), each value is built by its factory on first access and then kept."""

  def __init__(self, **factories):
    self._factories = factories
    self._built = {}

  def __getitem__(self, name):
    if name not in self._built:
      self._built[name] = self._factories[name]()
    return self._built[name]

  def __iter__(self):
    return iter(self._factories)

  def __len__(self):
    return len(self._factories)


def sampled(values, default, ids=None):
  """pytest params: the ``default`` subset runs always, the rest only with ``-m slow``."""
  ids = ids or [str(v) for v in values]
  return [pytest.param(v, id=i, marks=() if i in default else pytest.mark.slow)
          for v, i in zip(values, ids, strict=False)]


# One tiny decoder LM for the tests that train through train.main (resume, compare, multi-device):
# the same configuration compiles to the same programs, so the run's compilation cache
# (tests/conftest.py) serves the repeats. batch_size 8 divides the 8 fake devices.
TRAIN_ARGV = ("--dataset", "text", "--seq_len", "16", "--batch_size", "8", "--d_model", "16",
              "--num_layers", "1", "--num_heads", "2", "--mlp_dim", "32", "--steps", "6",
              "--warmup_steps", "1", "--log_every", "1", "--progress", "off")
TRAIN_STEPS = 6


def train_argv(*extra):
  """The command line of train.main for the tiny test model, then ``extra``."""
  return [*TRAIN_ARGV, *map(str, extra)]


def train_records(workdir):
  """(steps, losses, grad norms) of a run's metrics.jsonl."""
  from train import metrics  # pylint: disable=g-import-not-at-top  (train/ is not a package dep)
  records = metrics.read_jsonl(pathlib.Path(workdir) / "metrics.jsonl")
  return ([r["step"] for r in records], np.array([r["loss"] for r in records]),
          np.array([r["grad_norm"] for r in records]))


def load_script(relpath, name):
  """Imports the script ``ROOT / relpath`` (e.g. a benchmark) as module ``name``."""
  spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


# ----------------------------------------------------------------------------- comparisons


def vjp_close(f, g, x, atol=1e-6, rtol=1e-5, vjp_atol=None, vjp_rtol=None, ct=None):
  """f(x) == g(x), and their VJPs agree for a random cotangent (default tolerances: the
  forward ones)."""
  ct = random_cotangent(x.shape) if ct is None else ct
  out, vjp = jax.vjp(f, x)
  want, vjp_want = jax.vjp(g, x)
  chex.assert_trees_all_close(out, want, atol=atol, rtol=rtol)
  chex.assert_trees_all_close(vjp(ct), vjp_want(ct), atol=atol if vjp_atol is None else vjp_atol,
                              rtol=rtol if vjp_rtol is None else vjp_rtol)


def value_and_vjp(f, *args, seed=99):
  """``(f(*args), cotangents of every argument, ct)`` for a random output cotangent ``ct``
  (all ones when ``seed`` is None), in one jitted call."""

  shape = jax.eval_shape(f, *args)
  ct = (jnp.ones(shape.shape, shape.dtype) if seed is None
        else jnp.asarray(_standard_normal(seed, shape.shape)).astype(shape.dtype))

  @jax.jit
  def run(ct, *a):
    out, vjp = jax.vjp(f, *a)
    return out, vjp(ct), ct

  return run(ct, *args)


def value_and_grads(fn, args, seed=7):
  """fn(*args) and the gradients of <fn(*args), ct> for a random cotangent ct."""
  out = fn(*args)
  ct = jnp.asarray(_standard_normal(seed, out.shape)).astype(out.dtype)
  grads = jax.grad(lambda *a: jnp.sum((fn(*a) * ct).astype(jnp.float32)),
                   argnums=tuple(range(len(args))))(*args)
  return out, grads


def assert_same(fn_a, fn_b, args, fwd_tol=1e-5, bwd_tol=1e-4):
  """Outputs and every input cotangent of fn_a and fn_b agree."""
  out_a, g_a = value_and_grads(fn_a, args)
  out_b, g_b = value_and_grads(fn_b, args)
  chex.assert_trees_all_close(out_a, out_b, atol=fwd_tol, rtol=fwd_tol)
  chex.assert_trees_all_close(g_a, g_b, atol=bwd_tol, rtol=bwd_tol)
  for g in jax.tree.leaves(g_a):
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
  return out_a, g_a


def check_raises(*cases, error=ValueError):
  """Each ``(match, call)``: ``call()`` raises ``error`` with a message matching ``match``."""
  for match, call in cases:
    with pytest.raises(error, match=match):
      call()


# ------------------------------------------------------------------ normalizer checks


def tile_eval(spec, x, mask, hp=None, splits=()):
  """Evaluates ``spec.tile`` on rows ``x [..., S]`` with an online (m, l) merge over key
  blocks cut at ``splits`` (empty = one dense block), as a blockwise driver would.

  Each block's numerators are computed at the running max of that moment and rescaled
  to the final max at the end (the FlashAttention merge), so a tile rule whose numerator
  and denominator do not rescale by ``e^{m_old - m_new}`` fails here.
  """
  hp = dict(hp or {})
  rule = spec.tile
  x = jnp.asarray(x, jnp.float32)
  mask = jnp.broadcast_to(mask, x.shape)
  xs = jnp.where(mask, x, 0.0)
  length = jnp.sum(mask, axis=-1, keepdims=True).astype(jnp.float32)
  z = rule.score_map(xs, length, **hp)
  zero = jnp.zeros_like(length)
  if rule.denominator is None:  # class P
    return jnp.where(mask, rule.numerator(z, zero, **hp), 0.0)
  edges = [0, *sorted(splits), x.shape[-1]]
  m = jnp.full_like(length, -jnp.inf)
  den = zero
  parts = []
  for a, b in zip(edges[:-1], edges[1:], strict=True):
    zb, mb = z[..., a:b], mask[..., a:b]
    if rule.uses_max:
      blk = jnp.max(jnp.where(mb, zb, -jnp.inf), axis=-1, keepdims=True)
      m_new = jnp.maximum(m, blk)
      floor = rule.floor_value(length, hp)  # a declared floor of the stabiliser
      if floor is not None:
        m_new = jnp.where(jnp.isneginf(m_new), m_new, jnp.maximum(m_new, floor))
      m_new = jax.lax.stop_gradient(m_new)
    else:
      m_new = zero
    m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    scale = jnp.where(jnp.isfinite(m), jnp.exp(m - m_use), 0.0) if rule.uses_max else 1.0
    den = den * scale + jnp.sum(jnp.where(mb, rule.denominator(zb, m_use, **hp), 0.0), -1,
                                keepdims=True)
    parts.append((jnp.where(mb, rule.numerator(zb, m_use, **hp), 0.0), m_use, mb))
    m = m_new
  m_f = jnp.where(jnp.isfinite(m), m, 0.0)
  num = jnp.concatenate(
      [jnp.where(mb, nb * (jnp.exp(mu - m_f) if rule.uses_max else 1.0), 0.0)
       for nb, mu, mb in parts], axis=-1)
  den = den + (rule.offset(m_f, length, **hp) if rule.offset is not None else 0.0)
  ok = den != 0
  w = jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)
  return jnp.where(mask, w, 0.0)


def check_tile_rule(spec, hp=None, seed=0, scale=1.5, atol=2e-6, rtol=2e-5):
  """Dense and blockwise (random key splits) tile evaluation == spec.fn, values and VJP."""
  hp = dict(hp or {})
  x, mask = random_rows(seed, scale=scale)
  rng = np.random.default_rng(seed + 1)
  fn = lambda x: spec.fn(x, where=mask, **hp)
  want, vjp = jax.vjp(fn, x)
  ct = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
  (want_dx,) = vjp(ct)
  for splits in [(), (3,), tuple(sorted(rng.choice(np.arange(1, 11), 3, replace=False)))]:
    got, tvjp = jax.vjp(lambda x, sp=splits: tile_eval(spec, x, mask, hp, sp), x)
    chex.assert_trees_all_close(got, want, atol=atol, rtol=rtol)
    chex.assert_trees_all_close(tvjp(ct)[0], want_dx, atol=10 * atol, rtol=10 * rtol)


def check_mask_is_delete(fn, x, col, **hp):
  """Masking column ``col`` (where=False or x=-inf) == deleting it; its weight is 0."""
  keep = np.ones(x.shape[-1], bool)
  keep[col] = False
  want = fn(x[..., keep], **hp)
  for masked in (fn(x, where=jnp.asarray(keep), **hp),
                 fn(x.at[..., col].set(-jnp.inf), **hp)):
    chex.assert_trees_all_close(masked[..., keep], want, atol=1e-6, rtol=1e-5)
    assert np.all(np.asarray(masked[..., col]) == 0)
  # The gradient of the kept entries is unchanged, the masked entry gets none.
  ct = jnp.asarray(np.random.default_rng(3).standard_normal(x.shape), x.dtype)
  g_mask = jax.grad(lambda x: jnp.sum(fn(x, where=jnp.asarray(keep), **hp) * ct))(x)
  g_del = jax.grad(lambda y: jnp.sum(fn(y, **hp) * ct[..., keep]))(x[..., keep])
  chex.assert_trees_all_close(g_mask[..., keep], g_del, atol=1e-6, rtol=1e-5)
  assert np.all(np.asarray(g_mask[..., col]) == 0)


def check_masked_columns(fn, x, cols, empty_row, atol):
  """Columns ``cols`` hidden by ``where`` == deleted (their weight exactly 0), -inf scores
  == where=False exactly, and row ``empty_row`` fully masked is all zeros; returns that
  row-mask for further checks."""
  keep = np.ones(x.shape[-1], bool)
  keep[list(cols)] = False
  p = fn(x, where=keep)
  chex.assert_trees_all_close(p[:, keep], fn(x[:, keep]), atol=atol)
  assert bool(jnp.all(p[:, ~keep] == 0))
  chex.assert_trees_all_close(fn(jnp.where(keep, x, -jnp.inf)), p, atol=0)
  mask = jnp.ones(x.shape, bool).at[empty_row].set(False)
  assert bool(jnp.all(fn(x, where=mask)[empty_row] == 0))
  return mask


def check_fully_masked(fn, width=5, **hp):
  """A row with no visible entry: zeros, zero gradient, no NaN (also with -inf scores)."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, width)), jnp.float32)
  where = jnp.asarray([[False] * width, [True] * width])
  for args in [dict(x=x, where=where),
               dict(x=x.at[0].set(-jnp.inf), where=None)]:
    out = fn(args["x"], where=args["where"], **hp)
    assert np.all(np.asarray(out[0]) == 0), out
    assert np.all(np.isfinite(np.asarray(out)))
    g = jax.grad(lambda x, w=args["where"]: jnp.sum(jnp.sin(fn(x, where=w, **hp))))(args["x"])
    assert np.all(np.asarray(g[0]) == 0), g
    assert np.all(np.isfinite(np.asarray(g)))


def check_low_precision(fn, x, atol=(1e-2, 2e-3), **hp):
  """bf16/fp16 in -> same dtype out, close to the f32 result of the rounded input."""
  for dt, tol in zip((jnp.bfloat16, jnp.float16), atol, strict=True):
    xl = x.astype(dt)
    out = fn(xl, **hp)
    assert out.dtype == dt
    want = fn(xl.astype(jnp.float32), **hp)
    chex.assert_trees_all_close(out.astype(jnp.float32), want, atol=tol, rtol=tol)
    assert np.all(np.isfinite(np.asarray(out.astype(jnp.float32))))


def numeric_grad(f, x, h=1e-6):
  """Central differences of a float64 numpy function of one array (an autodiff-free
  gradient for the references)."""
  x = np.asarray(x, np.float64)
  g = np.zeros_like(x)
  for i in np.ndindex(x.shape):
    e = np.zeros_like(x)
    e[i] = h
    g[i] = (f(x + e) - f(x - e)) / (2 * h)
  return g


# The normalizers the heavy generated per-normalizer tests (the numeric promises, the tile
# rules, the chunked and Pallas comparisons; check_normalizer takes six of them,
# test_registry.CHECK_DEFAULT) run by default: every kernel
# class with a blockwise rule (E: softmax, the sink, the length-dependent ssmax, softpick's own
# denominator; S: stablemax; P: sigmoid; T: sparsemax, entmax15, top-k; R: standardized; the
# stochastic class X is drawn by test_registry's hypothesis sample). Every registered
# normalizer runs them under -m slow, and each also has its own test file against its oracle.
REGISTRY_DEFAULT = ("softmax", "softmax_sink", "ssmax", "softpick", "sigmoid", "stablemax",
                    "sparsemax", "entmax15", "top_k_softmax", "standardized_softmax")


def registry_sample(names):
  """pytest params over normalizer ``names``: :data:`REGISTRY_DEFAULT` by default, all with
  ``-m slow``."""
  return sampled(list(names), REGISTRY_DEFAULT)


_REPO = pathlib.Path(__file__).resolve().parents[1]


def fake_device_flags(devices: int) -> str:
  """``XLA_FLAGS`` for a child process on ``devices`` fake CPU devices, keeping this
  process's flags (the test run's compile settings, tests/conftest.py)."""
  return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()


def run_on_cpu_devices(script: str, devices: int, *, env=None, timeout: int = 900):
  """Runs ``script`` in a fresh Python on ``devices`` fake CPU devices (the count is fixed
  at start-up, hence the process), the repository on its path and ``env`` added to the
  environment; asserts it exits 0 and returns the ``CompletedProcess``."""
  full = dict(os.environ, XLA_FLAGS=fake_device_flags(devices),
              JAX_PLATFORMS="cpu", **(env or {}))
  full["PYTHONPATH"] = str(_REPO) + os.pathsep + full.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-c", script], cwd=_REPO, env=full,
                        capture_output=True, text=True, timeout=timeout, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc


_SECTIONS_RUNNER = textwrap.dedent("""
    import traceback
    for name, code in SECTIONS:
      try:
        exec(compile(PRELUDE + code, name, "exec"), {"__name__": name})
      except Exception:
        traceback.print_exc()
""")


def run_sections_on_cpu_devices(sections, devices: int, *, prelude: str = "", env=None):
  """Runs the ``(name, code)`` sections, each after ``prelude``, in one process of
  :func:`run_on_cpu_devices` (one start-up and import of JAX). Each section prints its
  marker or its traceback, so tests that look for their own marker fail independently."""
  script = f"PRELUDE = {prelude!r}\nSECTIONS = {list(sections)!r}\n" + _SECTIONS_RUNNER
  return run_on_cpu_devices(script, devices, env=env)


# tests/conftest.py marks a test that reaches these as ``subprocess``
run_on_cpu_devices.starts_subprocess = True  # type: ignore[attr-defined]
run_sections_on_cpu_devices.starts_subprocess = True  # type: ignore[attr-defined]
