"""MaskStructure: the closed-form per-row counts and ranges, the block tables, the kernel
segment ids and the full-tile test agree with the dense mask they describe (and with
jax.nn's masks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsoft.attention import masks as _masks
from jaxsoft.attention.masks import MaskStructure


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


@pytest.mark.parametrize("idx", range(len(STRUCTURES)))
@pytest.mark.parametrize("bq,bk,extra", [(4, 4, 0), (5, 3, 1), (16, 16, 2)])
def test_block_table_is_exact_and_tight(idx, bq, bk, extra):
  """Every tile holding a visible entry is marked (exact); when each row's visible keys are
  contiguous (no segment ids, or sorted ones) exactly those are (tight). Blocks added past
  T and S (the kernels' padding) are unmarked."""
  st = STRUCTURES[idx]
  dense = _dense(st)
  nq, nk = -(-st.T // bq) + extra, -(-st.S // bk) + extra
  table = np.broadcast_to(np.asarray(st.block_table(bq, bk, nq, nk)), (2, nq, nk))
  padded = np.zeros((2, nq * bq, nk * bk), bool)
  padded[:, :st.T, :st.S] = dense
  tiles = padded.reshape(2, nq, bq, nk, bk).any(axis=(2, 4))
  assert np.all(table[tiles])
  contiguous = all(np.all(np.diff(np.flatnonzero(row)) == 1) for row in dense.reshape(-1, st.S))
  if contiguous:
    np.testing.assert_array_equal(table, tiles)
  lo, hi = (np.asarray(a) for a in _masks.table_ranges(jnp.asarray(table), axis=2))
  for b, qi in zip(*np.nonzero(tiles.any(-1)), strict=True):
    marked = np.flatnonzero(table[b, qi])
    assert lo[b, qi] == marked[0] and hi[b, qi] == marked[-1] + 1
  assert np.all(lo[~table.any(-1)] == 0) and np.all(hi[~table.any(-1)] == 0)


@pytest.mark.parametrize("idx", range(len(STRUCTURES)))
def test_kernel_segment_ids_with_positions_visible(idx):
  """The kernels' view: lengths and padding folded into sentinel ids, compared by
  positions_visible with the closed-form part, reproduces the dense mask."""
  st = STRUCTURES[idx]
  t_pad, s_pad = st.T + 3, st.S + 5
  ids = st.kernel_segment_ids(t_pad, s_pad)
  assert (ids is None) == (not st.is_per_batch)
  i = jax.lax.broadcasted_iota(jnp.int32, (t_pad, s_pad), 0)
  j = jax.lax.broadcasted_iota(jnp.int32, (t_pad, s_pad), 1)
  q_seg, kv_seg = (None, None) if ids is None else (ids[0][:, :, None], ids[1][:, None, :])
  if ids is not None:  # the positions at the rank of the ids (no implicit rank promotion)
    i, j = i[None], j[None]
  vis = _masks.positions_visible(i, j, is_causal=st.is_causal, window=st.window, q_len=st.T,
                                 kv_len=st.S, q_seg=q_seg, kv_seg=kv_seg)
  vis = np.broadcast_to(np.ones((t_pad, s_pad), bool) if vis is None else np.asarray(vis),
                        (2, t_pad, s_pad))
  np.testing.assert_array_equal(vis[:, :st.T, :st.S], _dense(st))
  assert not vis[:, st.T:].any() and not vis[:, :, st.S:].any()
  if ids is not None:  # padding never matches a valid id, nor the other side's padding
    assert np.all(np.asarray(ids[0])[:, st.T:] == _masks.Q_PAD_SEGMENT)
    assert np.all(np.asarray(ids[1])[:, st.S:] == _masks.K_PAD_SEGMENT)


@pytest.mark.parametrize("kwargs,name", [
    (dict(block_q=0, block_k=4), "block_q"),
    (dict(block_q=4, block_k=2.5), "block_k"),
    (dict(block_q=4, block_k=4, num_q_blocks=1), "num_q_blocks"),
])
def test_block_table_rejects_bad_blocks(kwargs, name):
  st = MaskStructure(T=10, S=10, is_causal=True)
  with pytest.raises(ValueError, match=f"`{name}`"):
    st.block_table(**kwargs)


def test_block_table_with_a_fully_masked_row_batch():
  """A batch whose rows see nothing (length 0) has no visible tile and zero counts."""
  st = MaskStructure(T=8, S=8, kv_lengths=jnp.array([0, 8], jnp.int32))
  table = np.asarray(st.block_table(4, 4))
  assert not table[0].any() and table[1].all()
  assert np.all(np.asarray(st.visible_counts())[0] == 0)
