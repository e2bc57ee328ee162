r"""The tasks of the jaxsoft zoo (``train.zoo``): data, model size, step budget and metric.

Every task is embedded or generated data (nothing is downloaded), and a batch is a pure
function of ``(seed, position)`` as in ``train.data``: every entrant of a task sees the same
batches in the same order, and the evaluation data do not depend on the seed.

=============  ==========================================================  ===============
task           data                                                        metric
=============  ==========================================================  ===============
``lm``         character LM on the pydoc_data corpus (``train.data``)     held-out loss
``mqar``       multi-query associative recall, 2 / 4 / 8 key-value pairs   answer accuracy
``length``     the character LM trained at T = 256, evaluated at 256,      held-out loss
               1024 and 4096                                               at 4096
``listops``    nested MAX / MIN / MED / SM(sum mod 10) expressions         answer accuracy
``grok``       (a + b) mod p from 40 % of the pairs, for the loss variants held-out acc.
=============  ==========================================================  ===============

References:
  S. Arora, S. Eyuboglu, A. Timalsina, I. Johnson, M. Poli, J. Zou, A. Rudra & C. Ré, 2023,
  "Zoology: Measuring and Improving Recall in Efficient Language Models", arXiv 2312.04927
  (multi-query associative recall).
  N. Nangia & S. R. Bowman, 2018, "ListOps: A Diagnostic Dataset for Latent Tree Learning",
  arXiv 1804.06028; Y. Tay et al., 2020, "Long Range Arena", arXiv 2011.04006.
  A. Power, Y. Burda, H. Edwards, I. Babuschkin & V. Misra, 2022, "Grokking: Generalization
  Beyond Overfitting on Small Algorithmic Datasets", arXiv 2201.02177.
  L. Prieto, M. Barsbey, P. A. M. Mediano & T. Birdal, 2025, "Grokking at the Edge of
  Numerical Stability", arXiv 2501.04697.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from train import data

__all__ = ["Task", "TASKS", "mqar_batch", "listops_batch", "listops_value", "grok_split",
           "task_names"]

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Task:
  """One zoo task.

  ``config``: the ``train.config.Config`` fields every entrant of the task shares (model size,
  sequence length, batch, steps, schedule); ``lrs``: the fixed 3-point learning-rate sweep;
  ``train_batch(seed, position, tiny)`` and ``eval_sets(tiny)`` (``{label: [batches]}``, the
  same for every seed) the data; ``metric``: the key of the headline metric among the
  evaluation results and ``higher_is_better`` its direction.
  """

  name: str
  title: str
  config: dict[str, Any]
  lrs: tuple[float, float, float]
  metric: str
  higher_is_better: bool
  vocab_size: int
  train_batch: Callable[[int, int, bool], Batch]
  eval_sets: Callable[[bool], dict[str, list[Batch]]]
  tiny: dict[str, Any] = dataclasses.field(default_factory=dict)
  loss_task: bool = False  # the entrants are loss variants (softmax attention throughout)
  why: str = ""  # why these sizes (the report prints it under the task's table)


def _rng(seed: int, position: int, stream: int) -> np.random.Generator:
  return np.random.default_rng([stream, seed, position])


_EVAL = 0x6576616C  # the evaluation stream's seed (as train.data)

# ---------------------------------------------------------------------------------------------
# 1. Character LM (train.data's text stream).

_LM = dict(seq_len=64, batch_size=16)


def _lm_train(seed: int, position: int, tiny: bool) -> Batch:
  t, b = (16, 4) if tiny else (_LM["seq_len"], _LM["batch_size"])
  return data.make_dataset("text", t, b, seed).batch(position)


def _lm_eval(tiny: bool) -> dict[str, list[Batch]]:
  t, b = (16, 4) if tiny else (_LM["seq_len"], _LM["batch_size"])
  held = data.make_dataset("text", t, b, 0).held_out()
  return {"heldout": [held.batch(i) for i in range(1 if tiny else 8)]}


# ---------------------------------------------------------------------------------------------
# 2. Multi-query associative recall.

MQAR_PAIRS = (2, 4, 8)
MQAR_QUERIES = 4
_MQAR_T = 48
_KEYS = (data._FIRST, data._FIRST + 30)  # key tokens 4..33, value tokens 34..63
_VALUES = (data._FIRST + 30, data.PROBE_VOCAB)


def mqar_batch(rng: np.random.Generator, rows: int, pairs: int, length: int,
               queries: int = MQAR_QUERIES) -> Batch:
  """Multi-query associative recall: ``k1 v1 ... kn vn [PAD ...] q1 a1 q2 a2 ...``.

  The ``n = pairs`` keys of a row are distinct; each query ``q_i`` is one of them and the
  target after it is its value (weight 1 there, 0 elsewhere). Padding sits between the pairs
  and the queries so every row has ``length`` tokens.
  """
  if 2 * pairs + 2 * queries > length + 1:
    raise ValueError(f"length: {length} tokens cannot hold {pairs} pairs and {queries} queries")
  keys = np.argsort(rng.random((rows, _KEYS[1] - _KEYS[0])), axis=1)[:, :pairs] + _KEYS[0]
  values = rng.integers(*_VALUES, size=(rows, pairs))
  which = rng.integers(0, pairs, size=(rows, queries))
  idx = np.arange(rows)[:, None]
  seq = np.full((rows, length + 1), data.PAD)
  seq[:, :2 * pairs] = np.stack([keys, values], -1).reshape(rows, 2 * pairs)
  start = length + 1 - 2 * queries
  seq[:, start::2] = keys[idx, which]
  seq[:, start + 1::2] = values[idx, which]
  weights = np.zeros(seq.shape, np.float32)
  weights[:, start + 1::2] = 1.0
  return {"inputs": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32),
          "weights": weights[:, 1:]}


def _mqar_train(seed: int, position: int, tiny: bool) -> Batch:
  rng = _rng(seed, position, 1)
  pairs = int(rng.choice(MQAR_PAIRS))
  return mqar_batch(rng, 4 if tiny else 32, pairs, 24 if tiny else _MQAR_T)


def _mqar_eval(tiny: bool) -> dict[str, list[Batch]]:
  return {f"pairs{n}": [mqar_batch(_rng(0, i, _EVAL + n), 4 if tiny else 64, n,
                                   24 if tiny else _MQAR_T) for i in range(1 if tiny else 2)]
          for n in MQAR_PAIRS}


# ---------------------------------------------------------------------------------------------
# 3. Length generalisation: the character LM trained at T = 256, evaluated at 256 / 1024 / 4096.

LENGTHS = (256, 1024, 4096)
# (rows per batch, batches) at each evaluation length: 4096, 4096 and 8192 predicted characters
# of held-out text; one row at a time at 4096 (the dense [T, T] weights of every head)
_LENGTH_EVAL_ROWS = {256: (16, 1), 1024: (4, 1), 4096: (1, 2)}


def _length_train(seed: int, position: int, tiny: bool) -> Batch:
  return data.make_dataset("text", 32 if tiny else LENGTHS[0], 4, seed).batch(position)


def _length_eval(tiny: bool) -> dict[str, list[Batch]]:
  lengths = (32, 64) if tiny else LENGTHS
  out = {}
  for t in lengths:
    n_rows, n_batches = (2, 1) if tiny else _LENGTH_EVAL_ROWS[t]
    held = data.make_dataset("text", t, n_rows, 0).held_out()
    out[f"len{t}"] = [held.batch(i) for i in range(n_batches)]
  return out


# ---------------------------------------------------------------------------------------------
# 4. ListOps-style long-range task.

_OPS = ("MAX", "MIN", "MED", "SM")
_DIGIT0 = data._FIRST  # digits 0..9 are tokens 4..13
_OPEN = {op: data._FIRST + 10 + i for i, op in enumerate(_OPS)}  # "[MAX", ...
_CLOSE = data._FIRST + 14  # "]"
_LISTOPS_T = 64
_LISTOPS_DEPTH = 3


def listops_value(tree: Any) -> int:
  """The value of a ListOps tree ``(op, [children])`` or a digit: MAX, MIN, MED (the lower
  median), SM (the sum mod 10)."""
  if isinstance(tree, int):
    return tree
  op, children = tree
  values = sorted(listops_value(c) for c in children)
  if op == "MAX":
    return values[-1]
  if op == "MIN":
    return values[0]
  if op == "MED":
    return values[(len(values) - 1) // 2]
  return sum(values) % 10


def _tree(rng: np.random.Generator, depth: int) -> Any:
  if depth == 0 or rng.random() < 0.3:
    return int(rng.integers(10))
  return (_OPS[int(rng.integers(4))], [_tree(rng, depth - 1) for _ in range(rng.integers(2, 5))])


def _tokens(tree: Any) -> list[int]:
  if isinstance(tree, int):
    return [_DIGIT0 + tree]
  op, children = tree
  return [_OPEN[op], *[t for c in children for t in _tokens(c)], _CLOSE]


def listops_batch(rng: np.random.Generator, rows: int, length: int, depth: int = 4) -> Batch:
  """ListOps rows ``[PAD ...] expression QUERY answer`` (left-padded to ``length`` tokens),
  the target the expression's value (:func:`listops_value`) after ``QUERY``; expressions
  longer than ``length - 2`` tokens are drawn again."""
  seq = np.full((rows, length + 1), data.PAD)
  for r in range(rows):
    while True:
      tree = _tree(rng, depth)
      tokens = _tokens(tree)
      if not isinstance(tree, int) and len(tokens) <= length - 1:
        break
    body = [*tokens, data.QUERY, _DIGIT0 + listops_value(tree)]
    seq[r, length + 1 - len(body):] = body
  weights = np.zeros(seq.shape, np.float32)
  weights[:, -1] = 1.0
  return {"inputs": seq[:, :-1].astype(np.int32), "targets": seq[:, 1:].astype(np.int32),
          "weights": weights[:, 1:]}


def _listops_train(seed: int, position: int, tiny: bool) -> Batch:
  return listops_batch(_rng(seed, position, 4), 4 if tiny else 16,
                       24 if tiny else _LISTOPS_T, 2 if tiny else _LISTOPS_DEPTH)


def _listops_eval(tiny: bool) -> dict[str, list[Batch]]:
  return {"heldout": [listops_batch(_rng(0, i, _EVAL + 4), 4 if tiny else 64,
                                    24 if tiny else _LISTOPS_T, 2 if tiny else _LISTOPS_DEPTH)
                      for i in range(1 if tiny else 4)]}


# ---------------------------------------------------------------------------------------------
# 5. Modular-arithmetic grokking (the loss variants).

GROK_P = 47
GROK_TRAIN_FRACTION = 0.4


def grok_split(p: int = GROK_P, fraction: float = GROK_TRAIN_FRACTION) -> tuple[Batch, Batch]:
  """(train, held-out) batches of ``a b =`` -> ``(a + b) mod p`` (token ``p`` is ``=``): a fixed
  random ``fraction`` of the ``p^2`` pairs to train on (the whole set every step), the rest
  held out; the same split for every seed (the seed changes the initialisation only)."""
  a, b = np.divmod(np.arange(p * p), p)
  perm = np.random.default_rng(0).permutation(p * p)
  n_train = int(fraction * p * p)

  def rows(index):
    inputs = np.stack([a[index], b[index], np.full(len(index), p)], -1).astype(np.int32)
    targets = np.zeros_like(inputs)
    targets[:, -1] = (a[index] + b[index]) % p
    weights = np.zeros(inputs.shape, np.float32)
    weights[:, -1] = 1.0
    return {"inputs": inputs, "targets": targets, "weights": weights}

  return rows(perm[:n_train]), rows(perm[n_train:])


def _grok_train(seed: int, position: int, tiny: bool) -> Batch:
  del seed, position
  return grok_split(7 if tiny else GROK_P)[0]


def _grok_eval(tiny: bool) -> dict[str, list[Batch]]:
  return {"heldout": [grok_split(7 if tiny else GROK_P)[1]]}


# ---------------------------------------------------------------------------------------------

# The model every attention task shares: four thin pre-norm blocks (four so that the 3:1
# hybrid is one pattern), two heads of 16.
_MODEL = dict(d_model=32, num_layers=4, num_heads=2, mlp_dim=64)
# The CI sizes (``--tiny``, a protocol of their own): one block of width 8, two steps.
_TINY = dict(d_model=8, num_layers=1, num_heads=2, mlp_dim=8, steps=2, warmup_steps=1,
             seq_len=16, batch_size=4)
_PROBE = dict(weight_decay=0.0, min_lr_ratio=0.1)
_SWEEP = (1e-3, 3e-3, 1e-2)
# Centred on the reference's best rate: at the lm, length and ListOps budgets softmax's best of
# the first sweep above was its top, 1e-2 (held-out loss 2.31 against 2.59 at 3e-3, commit
# 7a86f0b), so those tasks sweep one step higher; MQAR's best was the middle, 3e-3.
_SWEEP_HIGH = (3e-3, 1e-2, 3e-2)

TASKS: dict[str, Task] = {
    "lm": Task("lm", "character LM, held-out loss (nats/char)",
               dict(_MODEL, **_LM, steps=120, warmup_steps=12), _SWEEP_HIGH, "heldout/loss", False,
               256, _lm_train, _lm_eval, _TINY,
               why="120 steps of 16 x 64 characters (123k characters, random windows of the "
                   "corpus's first 95 %): a unit costs ~48 CPU s (cost.json), and "
                   "the 90 entrants of each attention task share the zoo's ~6 CPU-hours. At 200 "
                   "steps softmax reached 2.26-2.32 nats/char (40 % of the characters right, "
                   "seeds 0 and 1 at lr 3e-3, cost.json): the entrants are compared early in "
                   "training, where how a layer uses context already shows in the loss."),
    "mqar": Task("mqar", "multi-query associative recall, accuracy (mean over 2/4/8 pairs)",
                 dict(_MODEL, **_PROBE, seq_len=_MQAR_T, batch_size=32, steps=100,
                      warmup_steps=10), _SWEEP, "accuracy", True, data.PROBE_VOCAB,
                 _mqar_train, _mqar_eval, dict(_TINY, seq_len=24),
                 why="100 steps of 32 rows (a unit ~48 CPU s). At 200 steps softmax's accuracy "
                     "was 0.49 / 0.28 / 0.17 at 2 / 4 / 8 pairs (cost.json), the 1 / pairs of "
                     "a model that copies one of the row's values without recalling which: at "
                     "this budget the task separates the entrants that start to recall from "
                     "those that do not, not how well each recalls after long training."),
    "length": Task("length", "character LM trained at T = 256, held-out loss at 256 / 1024 / "
                             "4096 (nats/char), loss at 4096",
                   dict(_MODEL, seq_len=LENGTHS[0], batch_size=4, steps=70, warmup_steps=7),
                   _SWEEP_HIGH, "len4096/loss", False, 256, _length_train, _length_eval,
                   dict(_TINY, seq_len=32),
                   why="70 steps of 4 x 256 characters: the training length is the issue's "
                       "(T = 256), and its step costs ~3x the lm task's per character (the "
                       "[256, 256] weights), so the rows are few; the evaluation covers 4096, "
                       "4096 and 8192 held-out characters at 256 / 1024 / 4096. A needle-in-a-"
                       "haystack version (4 key-value pairs per row, 100 steps of 4 rows) stayed "
                       "at chance for softmax (held-out loss 3.44 = log 30 over the values, "
                       "commit f7eab47): too sparse a signal for this budget, so the length "
                       "task is the character LM, whose every position is a target."),
    "listops": Task("listops", "ListOps-style nested expressions, answer accuracy",
                    dict(_MODEL, **_PROBE, seq_len=_LISTOPS_T, batch_size=16, steps=120,
                         warmup_steps=12), _SWEEP_HIGH, "heldout/accuracy", True, data.PROBE_VOCAB,
                    _listops_train, _listops_eval, dict(_TINY, seq_len=24),
                    why="T = 64 (was 96), depth <= 3 (was 4), 120 steps of 16 rows: a unit ~43 "
                        "CPU s. At 200 steps softmax's answer accuracy was 0.14-0.16 (held-out "
                        "loss 2.28, cost.json), the level of the answers' prior (the most "
                        "frequent answer, 0, is 14.5 % of them): the task shows which entrants "
                        "leave the prior within the budget; Long Range Arena's ListOps needs "
                        "far longer training for any model to pass ~37 %."),
    "grok": Task("grok", f"(a + b) mod {GROK_P} from {GROK_TRAIN_FRACTION:.0%} of the pairs, "
                         "held-out accuracy",
                 dict(d_model=32, num_layers=2, num_heads=4, mlp_dim=64, seq_len=3,
                      batch_size=int(GROK_TRAIN_FRACTION * GROK_P * GROK_P), steps=1000,
                      warmup_steps=10, weight_decay=1.0, b2=0.98, min_lr_ratio=1.0),
                 (1e-3, 3e-3, 1e-2), "heldout/accuracy", True, GROK_P + 1, _grok_train,
                 _grok_eval, dict(_TINY, seq_len=3, batch_size=19, steps=3),
                 why="p = 47 (was 59), d_model 32 (was 64), 1000 full-batch steps (was 2000): "
                     "at the earlier size a step of the 1392 training pairs is ~1.7 GFLOP, "
                     "~0.2 CPU s here (an estimate from the FLOPs: its measurement was stopped), "
                     "~2.8 CPU-hours for the task's 25 runs; the new size is ~6x fewer FLOPs "
                     "per run (883 pairs, a quarter of the width's square). Weight decay 1 and "
                     "a constant rate after warm-up, the grokking recipe; whether held-out "
                     "accuracy rises within the 1000 steps is what the task records. The sweep "
                     "1e-3 / 3e-3 / 1e-2: softmax CE's best of 3e-4 / 1e-3 / 3e-3 was the top "
                     "(held-out accuracy 0.29 against 0.13, commit 7a86f0b).",
                 loss_task=True),
}


def task_names() -> tuple[str, ...]:
  """The zoo's tasks, in order."""
  return tuple(TASKS)
