"""Training data that needs no download: the pydoc_data corpus and synthetic probes.

A batch is a pure function of ``(seed, position)``: ``position`` counts the optimizer steps' batches
drawn so far and is saved in every checkpoint, so a resumed run reads exactly the batches an
uninterrupted run would. Every process computes the same global batch *indices* and materialises
only its own rows, so the data are identical for any number of hosts and devices.

Batches are dicts of int32 ``inputs``/``targets`` and float32 ``weights`` (the loss mask: all ones
for text, ones on the answer tokens for the probes), each ``[rows, seq_len]``.

``Dataset.held_out()`` is the evaluation split: windows of the corpus's last 5% (never trained on)
for text, and for the probes fresh draws from a stream of their own. Held-out batches do not depend
on the seed, so runs with different seeds are evaluated on the same data.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

__all__ = ["Dataset", "make_dataset", "corpus_bytes", "PROBE_VOCAB"]

# Probe vocabulary: 4 special tokens, then content tokens.
PAD, SEP, QUERY, NEEDLE = 0, 1, 2, 3
_FIRST = 4
PROBE_VOCAB = 64


@functools.cache
def corpus_bytes() -> np.ndarray:
  """The ``pydoc_data`` topics text (ships with CPython, ~465k characters) as UTF-8 bytes."""
  from pydoc_data import topics  # pylint: disable=import-outside-toplevel

  text = "\n".join(topics.topics[k] for k in sorted(topics.topics))
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


SPLITS = ("train", "eval")
_EVAL_STREAM = 0x6576616C  # "eval": the held-out batches' seed, whatever the run's seed


def _rng(seed: int, position: int, split: str = "train") -> np.random.Generator:
  if split == "eval":
    return np.random.default_rng([_EVAL_STREAM, position])
  return np.random.default_rng([seed, position])


@dataclasses.dataclass(frozen=True)
class Dataset:
  """A deterministic batch stream: ``batch(position, rows)`` for global row indices ``rows``."""

  name: str
  vocab_size: int
  seq_len: int
  batch_size: int
  seed: int
  split: str = "train"

  def held_out(self) -> Dataset:
    """The same stream over the evaluation split."""
    return dataclasses.replace(self, split="eval")

  def batch(self, position: int, rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The rows ``rows`` (global indices, default all) of global batch number ``position``."""
    rows = np.arange(self.batch_size) if rows is None else np.asarray(rows)
    rng = _rng(self.seed, position, self.split)
    if self.name == "text":
      seq, weights = _text(rng, self.batch_size, self.seq_len + 1, rows, self.split)
    else:
      seq, weights = _PROBES[self.name](rng, self.batch_size, self.seq_len + 1, rows)
    return {"inputs": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32),
            "weights": weights[:, 1:].astype(np.float32)}


def make_dataset(name: str, seq_len: int, batch_size: int, seed: int) -> Dataset:
  vocab = 256 if name == "text" else PROBE_VOCAB
  return Dataset(name, vocab, seq_len, batch_size, seed)


def _text(rng, batch, length, rows, split="train"):
  """Random windows of the corpus's first 95% (train) or of the rest (eval, held out)."""
  tokens = corpus_bytes()
  train_end = int(len(tokens) * 0.95)
  low, high = (0, train_end - length) if split == "train" else (train_end, len(tokens) - length)
  offsets = rng.integers(low, high, size=batch)[rows]
  seq = tokens[offsets[:, None] + np.arange(length)]
  return seq, np.ones(seq.shape, np.float32)


def _content(rng, shape, low=_FIRST, high=PROBE_VOCAB):
  return rng.integers(low, high, size=shape)


def _recall(rng, batch, length, rows):
  """Associative recall: ``k1 v1 k2 v2 ... QUERY k_i`` -> ``v_i`` (distinct keys per row).

  At most one pair per key token (30); longer sequences are left-padded with PAD.
  """
  half = _FIRST + (PROBE_VOCAB - _FIRST) // 2
  pairs = min((length - 3) // 2, half - _FIRST)
  keys = np.argsort(rng.random((batch, half - _FIRST)), axis=1)[:, :pairs] + _FIRST
  values = _content(rng, (batch, pairs), low=half)
  which = rng.integers(0, pairs, size=batch)
  seq = np.full((batch, length), PAD)
  body = np.stack([keys, values], axis=-1).reshape(batch, 2 * pairs)
  seq[:, length - 3 - 2 * pairs:length - 3] = body
  seq[:, -3] = QUERY
  seq[:, -2] = keys[np.arange(batch), which]
  seq[:, -1] = values[np.arange(batch), which]
  weights = np.zeros(seq.shape, np.float32)
  weights[:, -1] = 1.0
  return seq[rows], weights[rows]


def _copy_like(rng, batch, length, rows, transform):
  n = (length - 1) // 2
  src = _content(rng, (batch, n))
  seq = np.full((batch, length), PAD)
  seq[:, :n] = src
  seq[:, n] = SEP
  seq[:, n + 1:2 * n + 1] = transform(src)
  weights = np.zeros(seq.shape, np.float32)
  weights[:, n + 1:2 * n + 1] = 1.0
  return seq[rows], weights[rows]


def _copy(rng, batch, length, rows):
  """Copy: ``x SEP`` -> ``x``."""
  return _copy_like(rng, batch, length, rows, lambda x: x)


def _sort(rng, batch, length, rows):
  """Sort: ``x SEP`` -> ``sorted(x)``."""
  return _copy_like(rng, batch, length, rows, lambda x: np.sort(x, axis=1))


def _needle(rng, batch, length, rows):
  """Needle in a haystack: random tokens with ``NEEDLE v`` somewhere; ``QUERY`` -> ``v``."""
  seq = _content(rng, (batch, length))
  where = rng.integers(0, length - 4, size=batch)
  value = _content(rng, batch)
  idx = np.arange(batch)
  seq[idx, where] = NEEDLE
  seq[idx, where + 1] = value
  seq[:, -2] = QUERY
  seq[:, -1] = value
  weights = np.zeros(seq.shape, np.float32)
  weights[:, -1] = 1.0
  return seq[rows], weights[rows]


_PROBES = {"recall": _recall, "copy": _copy, "sort": _sort, "needle": _needle}
