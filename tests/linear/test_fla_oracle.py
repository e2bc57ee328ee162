"""Features A38, A39 against flash-linear-attention's own PyTorch references.

flash-linear-attention (``fla-core``, test-only dependency with ``torch`` and ``einops``)
ships a naive PyTorch twin beside each kernel (``fla/ops/<variant>/naive.py``). Importing
the ``fla`` package needs Triton, so the naive files are loaded by path on CPU. Outputs and
final states of the chunked (and recurrent) forms are compared with fla's recurrences, and
for the gated delta rule the gradients with torch autograd through fla's recurrence.
"""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.linear import cases


def _naive(variant: str):
  """``fla/ops/<variant>/naive.py`` as a module, without importing the ``fla`` package."""
  spec = importlib.util.find_spec("fla")
  assert spec is not None and spec.submodule_search_locations, "fla-core is not installed"
  path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "ops" / variant / "naive.py"
  mod_spec = importlib.util.spec_from_file_location(f"fla_naive_{variant}", path)
  module = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(module)
  return module


def _torch(x):
  return torch.from_numpy(np.asarray(x, np.float32).copy())


def _fla(variant, args):
  """fla's naive recurrence on ``args`` (float32 torch tensors): ``(o, final_state)``."""
  t = {n: _torch(x) for n, x in args.items()}
  if variant == "simple_gla":
    return _naive("simple_gla").naive_recurrent_simple_gla(
        t["q"], t["k"], t["v"], t["g"], initial_state=t["initial_state"],
        output_final_state=True)
  if variant == "gla":
    return _naive("gla").naive_recurrent_gla(
        t["q"], t["k"], t["v"], t["g"], initial_state=t["initial_state"],
        output_final_state=True)
  if variant == "delta_rule":   # heads-first layout [B, N, T, ...]
    hf = lambda x: x.transpose(1, 2)
    o, S = _naive("delta_rule").delta_rule_recurrence(
        hf(t["q"]), hf(t["k"]), hf(t["v"]), t["beta"].transpose(1, 2),
        initial_state=t["initial_state"], output_final_state=True)
    return o.transpose(1, 2), S
  return _naive("gated_delta_rule").naive_recurrent_gated_delta_rule(
      t["q"], t["k"], t["v"], t["beta"], t["g"], initial_state=t["initial_state"],
      output_final_state=True)


@pytest.mark.parametrize("variant", [
    pytest.param("simple_gla", marks=pytest.mark.slow), "gla",
    pytest.param("delta_rule", marks=pytest.mark.slow),
    pytest.param("gated_delta_rule", marks=pytest.mark.slow)])
@pytest.mark.parametrize("form", ["chunked", pytest.param("recurrent", marks=pytest.mark.slow)])
def test_matches_fla_naive_recurrence(variant, form):
  """T = 19, chunks of 8, an initial state, beta up to 1.95 for the delta rules (the default
  run checks gla here and the gated delta rule in the gradient test below; every variant
  and form under ``-m slow``)."""
  args = cases.inputs(variant, B=2, T=19, N=2, K=8, V=5, seed=11)
  o, S = cases.call(variant, args, implementation=form, chunk_size=8)
  o_fla, S_fla = _fla(variant, args)
  np.testing.assert_allclose(o, o_fla.numpy(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(S, S_fla.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_simple_gla_matches_fla_naive_chunk_form():
  """fla's own chunked twin (``naive_chunk_simple_gla``, chunk 16, T not a multiple)."""
  args = cases.inputs("simple_gla", B=1, T=21, N=2, K=8, V=4, seed=12)
  o, S = cases.call("simple_gla", args, implementation="chunked", chunk_size=8)
  t = {n: _torch(x) for n, x in args.items()}
  o_fla, S_fla = _naive("simple_gla").naive_chunk_simple_gla(
      t["q"], t["k"], t["v"], t["g"], initial_state=t["initial_state"],
      output_final_state=True, chunk_size=16)
  np.testing.assert_allclose(o, o_fla.numpy(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(S, S_fla.numpy(), rtol=1e-4, atol=1e-5)


def test_gated_delta_rule_gradients_match_torch_autograd():
  """The output, the final state and d/d(q, k, v, g, beta, initial_state) of
  ``sum(o * w) + sum(S * w_S)``: jax through the chunked form's custom VJP vs torch autograd
  through fla's naive recurrence."""
  args = cases.inputs("gated_delta_rule", B=1, T=13, N=2, K=4, V=3, seed=13)
  w = np.asarray(jax.random.normal(jax.random.key(1), args["v"].shape))
  ws = np.asarray(jax.random.normal(jax.random.key(2), args["initial_state"].shape))

  def loss(a):
    o, S = cases._call("gated_delta_rule", a, implementation="chunked", chunk_size=4)
    return jnp.sum(o * w) + jnp.sum(S * ws), (o, S)

  (_, (o_jax, S_jax)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(args)
  t = {n: _torch(x).requires_grad_(True) for n, x in args.items()}
  o, S = _naive("gated_delta_rule").naive_recurrent_gated_delta_rule(
      t["q"], t["k"], t["v"], t["beta"], t["g"], initial_state=t["initial_state"],
      output_final_state=True)
  np.testing.assert_allclose(o_jax, o.detach().numpy(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(S_jax, S.detach().numpy(), rtol=1e-4, atol=1e-5)
  ((o * _torch(w)).sum() + (S * _torch(ws)).sum()).backward()
  for name, x in t.items():
    want = x.grad.numpy()
    np.testing.assert_allclose(grads[name], want, rtol=1e-4,
                               atol=1e-5 * float(np.max(np.abs(want))), err_msg=name)
