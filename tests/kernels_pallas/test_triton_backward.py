"""The Triton driver's passes: the causal loop bound, exp2 in the backward, no divide per
score, and the anchors' launch parameters.

* Loop bound (counted): a NaN planted in one key block reaches a query block's output
  (forward) or dQ (dQ pass) only if that pass visits the pair, since a visited but masked
  tile still multiplies its zero weights by the NaN values; likewise a NaN query block
  reaches dK only through a visited pair (dK/dV pass). Causal with equal block sizes,
  nq = 3 blocks: each pass visits exactly nq (nq + 1) / 2 = 6 (query block, key block)
  pairs, where walking every block would visit 9.
* The kernels' Triton IR (printed by ``debug=True`` while exporting for CUDA): with the
  K06 ``exp2`` flag the forward, dQ and dK/dV kernels each compute exp2 and no natural
  exp; none of them divides per score (a [block_q, block_k] ``arith.divf``), with a
  temperature and a soft cap too; a forward tile of 128 x 128 runs 8 warps and 3 stages
  and the 64 x 64 backward tiles 4 warps and 2 stages (the anchors).
* The exp2 backward's gradients equal the float64 dense reference's (soft cap and
  temperature: the soft cap's derivative reads natural-unit logits).
"""

from __future__ import annotations

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels_pallas as kp
from kernels_pallas import triton
from tests.kernels_pallas.test_engine import inputs, reference
from tests.kernels_pallas.test_lowering import export_fwd_bwd


def _visited_pairs(backward: bool):
  """Which blocks a NaN block reaches in the forward (and with ``backward`` in dQ and
  dK/dV): causal, T = 48 in 16-row blocks."""
  t, bl, nq = 48, 16, 3
  q, k, v, ct = inputs(b=2 * nq if backward else nq, t=t, n=1, kh=1, h=16, seed=91)
  rows = np.arange(t) // bl
  for blk in range(nq):  # batch blk: key block blk is NaN; batch nq + blk: query block blk
    k = k.at[blk, rows == blk].set(jnp.nan)
    v = v.at[blk, rows == blk].set(jnp.nan)
    if backward:
      q = q.at[nq + blk, rows == blk].set(jnp.nan)
  f = lambda q, k, v: kp.attention(  # noqa: E731
      q, k, v, is_causal=True, backend="triton", interpret=True,
      block_sizes=kp.BlockSizes(bl, bl, bl, bl, bl, bl))

  def nan_blocks(x, batches):  # [len(batches), nq]: which blocks of each batch hold a NaN
    x = np.asarray(x)[batches].reshape(len(batches), nq, -1)
    return np.isnan(x).any(axis=-1)

  first, second = list(range(nq)), list(range(nq, 2 * nq))
  if not backward:
    return (nan_blocks(f(q, k, v), first),)
  out, vjp = jax.vjp(f, q, k, v)
  dq, dk, _ = vjp(ct)
  return nan_blocks(out, first), nan_blocks(dq, first), nan_blocks(dk, second)


# [poisoned block, reached block]: a NaN key block reaches the query blocks at or after it
# (forward, dQ); a NaN query block the key blocks at or before it (dK/dV)
REACHED = np.tril(np.ones((3, 3), bool)).T


def test_the_forward_walks_only_the_causally_visible_blocks():
  (fwd,) = _visited_pairs(backward=False)
  assert int(fwd.sum()) == 6  # of 9 pairs
  np.testing.assert_array_equal(fwd, REACHED)


@pytest.mark.slow
def test_each_pass_walks_only_the_causally_visible_blocks():
  fwd, dq, dkv = _visited_pairs(backward=True)
  assert [int(x.sum()) for x in (fwd, dq, dkv)] == [6, 6, 6]  # of 9 pairs
  np.testing.assert_array_equal(fwd, REACHED)
  np.testing.assert_array_equal(dq, REACHED)
  np.testing.assert_array_equal(dkv, REACHED.T)


def _kernel_texts(**kw):
  """{kernel name: its Triton IR} of the forward + backward of one call, exported for CUDA."""
  shape = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    mlir = export_fwd_bwd(lambda q, k, v: kp.attention(
        q, k, v, is_causal=True, backend="triton", debug=True, **kw), "triton", shape, shape)
  mods = re.split(r"The Triton module for pallas_call ", buf.getvalue())[1:]
  return {m.split()[0]: m for m in mods}, mlir


def _per_score_divides(text):
  """The ``arith.divf`` ops on [rows, cols > 1] tensors (a per-row 1 / D is [rows, 1])."""
  return [d for d in re.findall(r"arith\.divf [^:\n]*: tensor<(\d+)x(\d+)xf32>", text)
          if int(d[1]) > 1]


def test_exp2_in_every_pass_no_divide_per_score_and_the_anchor_launch():
  texts, mlir = _kernel_texts(
      normalizer_params={"temperature": 0.5}, logits_soft_cap=20.0, exp2=True,
      block_sizes=kp.BlockSizes(128, 128, 64, 64, 64, 64))
  assert sorted(texts) == ["jaxsoft_attention_dkv_softmax", "jaxsoft_attention_dq_softmax",
                           "jaxsoft_attention_fwd_softmax"]
  for name, text in texts.items():
    assert "exp2" in text and "__nv_expf" not in text, name
    assert _per_score_divides(text) == [], name
  launch = {n: (int(w), int(st)) for n, st, w in re.findall(
      r'name = "(jaxsoft_attention_\w+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32',
      mlir)}
  assert launch == {"jaxsoft_attention_fwd_softmax": (8, 3),
                    "jaxsoft_attention_dq_softmax": (4, 2),
                    "jaxsoft_attention_dkv_softmax": (4, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(),  # natural exp, plain softmax (its score map is the identity at T = 1)
    dict(normalizer="sigmoid", approx_sigmoid=True),  # one tanh.approx per score
])
def test_no_divide_per_score(kw):
  texts, _ = _kernel_texts(**kw)
  assert len(texts) == 3
  for name, text in texts.items():
    assert _per_score_divides(text) == [], name


@pytest.mark.slow  # (the default suite's exp2 check: test_speed_flags, causal GQA softmax)
def test_exp2_backward_gradients_equal_the_dense_path():
  """Soft cap and a static temperature with ``exp2`` (the backward's tiles in log2 units):
  the kernel's cotangents of q, k, v within 1e-4 of the dense path's (``reference``,
  autodiff of jaxsoft's softmax; float32 sums of O(1) terms over up to 48 keys), and the
  exp2 backward is the one that ran."""
  q, k, v, ct = inputs(b=1, t=48, n=4, kh=2, h=16, seed=92)
  q = 10.0 * q
  kw = dict(normalizer_params={"temperature": 0.5}, logits_soft_cap=20.0, is_causal=True)
  ran = []
  grad_tile = triton._grad_tile

  def spy(cfg, *a):
    ran.append(triton.exp2_backward(cfg))
    return grad_tile(cfg, *a)

  def loss(q, k, v):
    return jnp.sum(kp.attention(q, k, v, backend="triton", interpret=True, exp2=True,
                                block_sizes=dict(block_q=16, block_k=16), **kw) * ct)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(triton, "_grad_tile", spy)
    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(lambda q, k, v: jnp.sum(reference(
      q, k, v, is_causal=True, params={"temperature": 0.5}, soft_cap=20.0) * ct),
      argnums=(0, 1, 2))(q, k, v)
  assert ran and all(ran)
  for g, w in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


def test_the_autotuner_starts_from_the_anchors():
  """After the default shape (the reference every candidate is checked against) comes the
  anchors' 128 x 128 forward / 64 x 64 backward shape, whose passes launch with the
  anchors' warps and stages; for head dim 256 (past the anchors' d <= 128) it is not a
  candidate, and a tile other than the anchor's keeps the old launch rule."""
  anchor = kp.BlockSizes(128, 128, 64, 64, 64, 64).resolved()
  cands = kp.candidate_block_sizes("triton", 4096, 4096, 128)
  assert cands[1] == anchor and cands[0] == kp.default_block_sizes("triton", 4096, 4096, 128)
  assert anchor not in kp.candidate_block_sizes("triton", 4096, 4096, 256)

  def cfg(blocks, d=128):
    return type("Cfg", (), dict(blocks=blocks, head_dim_pad=d, hv_pad=d))

  assert [triton.launch_params(cfg(anchor), n, 128) for n in ("fwd", "dq", "dkv")] == [
      (8, 3), (4, 2), (4, 2)]
  assert triton.launch_params(cfg(anchor, 256), "fwd", 128) == (8, 2)  # over the anchor's d
  assert triton.launch_params(cfg(kp.BlockSizes(128, 64)), "fwd", 128) == (8, 2)
  explicit = kp.BlockSizes(128, 128, num_warps=2, num_stages=1).resolved()
  assert triton.launch_params(cfg(explicit), "dq", 128) == (2, 1)
