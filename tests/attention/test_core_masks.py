"""MaskStructure: the closed-form per-row counts and ranges, the block tables and the
full-tile test agree with the dense mask they describe (and with jax.nn's masks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention._masks import MaskStructure


def _structures():
  rng = np.random.default_rng(0)
  B, T, S = 2, 13, 17
  seg_runs = np.sort(rng.integers(0, 4, (B, S)), axis=1)
  yield MaskStructure(T, S)
  yield MaskStructure(T, S, is_causal=True)
  yield MaskStructure(T, S, window=(3, 1))
  yield MaskStructure(T, S, is_causal=True, window=(4, 0),
                      kv_lengths=jnp.array([9, 17]), q_lengths=jnp.array([13, 5]))
  yield MaskStructure(T, S, window=(-2, 5))
  yield MaskStructure(T, S, q_segment_ids=jnp.asarray(seg_runs[:, :T]),
                      kv_segment_ids=jnp.asarray(seg_runs), is_causal=True)
  yield MaskStructure(T, S, q_segment_ids=jnp.asarray(rng.integers(0, 3, (B, T))),
                      kv_segment_ids=jnp.asarray(rng.integers(0, 3, (B, S))), window=(5, 5),
                      kv_lengths=jnp.array([12, 3]))


STRUCTURES = list(_structures())


def _dense(st):
  B = 2
  return np.broadcast_to(np.asarray(st.dense()), (B, 1, st.T, st.S))[:, 0]


def test_dense_matches_jax_nn_masks():
  T, S = 13, 17
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  st = MaskStructure(T, S, is_causal=True, window=(3, 1))
  np.testing.assert_array_equal(np.asarray(st.dense())[0, 0],
                                (j <= i) & (i - 3 <= j) & (j <= i + 1))


@pytest.mark.parametrize("idx", range(len(STRUCTURES)))
def test_row_ranges_and_counts(idx):
  st = STRUCTURES[idx]
  dense = _dense(st)  # [B, T, S]
  lo, hi, count = (np.broadcast_to(np.asarray(a), dense.shape[:2]) for a in st.row_ranges())
  np.testing.assert_array_equal(count, dense.sum(-1))
  j = np.arange(st.S)
  inside = (j >= lo[..., None]) & (j < hi[..., None])
  assert not np.any(dense & ~inside)  # every visible key lies in [lo, hi)
  nonempty = count > 0
  # the range is tight: its ends are visible keys
  b, t = np.nonzero(nonempty)
  assert np.all(dense[b, t, lo[b, t]]) and np.all(dense[b, t, hi[b, t] - 1])
  np.testing.assert_array_equal(np.asarray(st.visible_counts()).shape[-1], st.T)


@pytest.mark.parametrize("idx", range(len(STRUCTURES)))
@pytest.mark.parametrize("bq,bk", [(4, 4), (5, 3), (16, 16)])
def test_block_ranges_cover_every_visible_tile(idx, bq, bk):
  st = STRUCTURES[idx]
  dense = _dense(st)
  nq, nk = -(-st.T // bq), -(-st.S // bk)
  kb_lo, kb_hi = (np.asarray(a) for a in st.block_key_ranges(bq, nq, bk))
  padded = np.zeros((2, nq * bq, nk * bk), bool)
  padded[:, :st.T, :st.S] = dense
  tiles = padded.reshape(2, nq, bq, nk, bk).any(axis=(0, 2, 4))  # [nq, nk]
  for qi in range(nq):
    for kj in range(nk):
      if tiles[qi, kj]:
        assert kb_lo[qi] <= kj < kb_hi[qi], (qi, kj)
  if st.is_causal and not st.has_segments and st.window is None:
    assert tiles.sum() < nq * nk  # causal structure does skip blocks
    assert np.sum(kb_hi - kb_lo) < nq * nk


@pytest.mark.parametrize("idx", range(len(STRUCTURES)))
def test_tile_is_full_is_exact_or_conservative(idx):
  st = STRUCTURES[idx]
  dense = _dense(st)
  bq = bk = 4
  for qs in range(0, st.T, bq):
    for ks in range(0, st.S, bk):
      if bool(st.tile_is_full(jnp.int32(qs), bq, jnp.int32(ks), bk)):
        assert qs + bq <= st.T and ks + bk <= st.S
        assert dense[:, qs:qs + bq, ks:ks + bk].all(), (qs, ks)


def test_row_ranges_under_jit():
  st = STRUCTURES[-1]
  got = jax.jit(lambda s: s.row_ranges())(st)
  want = st.row_ranges()
  for a, b in zip(got, want, strict=False):
    np.testing.assert_array_equal(a, b)
