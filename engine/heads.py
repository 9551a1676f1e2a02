"""Output heads beyond one plain Linear: the draft shortlist and the rescoring head of `--host-tables`.

Both seed engines (REFERENCE.md section 6) keep the per-pass bytes of the head small:
- Drafts rank a shortlist of the vocabulary (shortlist_rows), not all of it. A draft outside the
  shortlist is never proposed; verification still scores the whole vocabulary, so exact acceptance
  stays exact and only the acceptance rate can change.
- With host tables the bf16 head stays in host memory and an int4 copy ranks the vocabulary; the
  RESCORE_CANDIDATES best of each row are scored again with their bf16 rows.

Every head here maps hidden [T, H] to logits [T, V] over the whole vocabulary, -inf for the ids it
does not score, so sampling and acceptance never need to know which head ran.
"""

from __future__ import annotations

import numpy as np

from duet.engine.backend.cpu import W4A16Linear
from duet.engine.quant.w4 import quantize_rtn

SHORTLIST_ROWS = 65_536  # most rows of the draft head: the seed's 65,536-row draft vocabulary ...
SHORTLIST_OF = 248_320  # ... of the family's 248,320 ids; a smaller vocabulary keeps the same share
SHORTLIST_MIN = 1_024  # fewer ids than this: drafts rank them all (the head is then a small part of a draft)
RESCORE_CANDIDATES = 64  # int4-ranked candidates per row rescored with bf16 rows (the seed: 16 to 64)


def shortlist_rows(vocab: int) -> int:
    """Rows of the head a draft ranks: the seed's share of the vocabulary, at most SHORTLIST_ROWS, at
    least SHORTLIST_MIN, whole blocks of 64 rows (a compiled bf16 head's pair of 32-row lane blocks,
    so the block is a view); the whole vocabulary where that is no smaller.

    On the demo (4,096 ids) the leading 1,088 hold every id of its greedy replies to the bench
    prompts, and a draft's head took 6 us, not 19 (bf16, one row, this 2-core EPYC).
    """
    share = -(-vocab * SHORTLIST_ROWS // SHORTLIST_OF)
    return min(vocab, SHORTLIST_ROWS, max(SHORTLIST_MIN, -(-share // 64) * 64))


def shortlist_ids(vocab: int, always: list[int]) -> np.ndarray | None:
    """Token ids drafts may propose: the first shortlist_rows(vocab) ids plus `always` (the stop
    tokens); None when that is the whole vocabulary.

    Byte-level BPE numbers its tokens in merge order: the byte alphabet first, then each merge as it
    was learned from the most frequent pairs, so the lowest ids are the most common tokens. Taking
    them as they are keeps the shortlist rows one contiguous block of the head (a view, no copy).
    """
    rows = shortlist_rows(vocab)
    if vocab <= rows:
        return None
    extra = sorted({int(i) for i in always if rows <= i < vocab})
    return np.concatenate([np.arange(rows), np.asarray(extra, dtype=np.int64)])


class ShortlistHead:
    """Logits of the shortlisted ids through `linear` (the head's rows of those ids, in that order)."""

    def __init__(self, linear, ids: np.ndarray, vocab: int):
        self.linear, self.ids, self.vocab = linear, ids, vocab

    def scores(self, hidden: np.ndarray) -> np.ndarray:
        """The shortlisted ids' logits [T, S], in the order of ids."""
        return self.linear(hidden)

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        logits = np.full((hidden.shape[0], self.vocab), -np.inf, np.float32)
        logits[:, self.ids] = self.scores(hidden)
        return logits

    def greedy_ids(self, hidden: np.ndarray) -> np.ndarray:
        """Each row's argmax id over the shortlist, as argmax of __call__ (ids ascend, so the first of
        equal maxima is the same id) without the [T, V] array."""
        return self.ids[self.scores(hidden).argmax(axis=-1)]


class RescoredHead:
    """`--host-tables`: an int4 copy of the head (W4 group-128 round-to-nearest, run on the w4a16
    route) ranks every id; each row's RESCORE_CANDIDATES best are scored with the bf16 rows.

    Greedy ids are the bf16 head's whenever its best id ranks among the int4 head's top candidates,
    which the int4 error (a few hundredths of a logit) leaves far from in practice. Sampling sees
    only the candidates: it is sampling with top-k 64 on the int4 ranking, which changes nothing
    under a top-k of 64 or less and cuts the far tail otherwise.
    """

    def __init__(self, weight, candidates: int = RESCORE_CANDIDATES):
        self.weight = weight  # [V, H] bf16 values (BF16Matrix, or fp32 holding them): the rescoring rows
        self.ranking = W4A16Linear(quantize_rtn(weight if isinstance(weight, np.ndarray) else weight.dequantize()))
        self.candidates = min(candidates, weight.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        coarse = self.ranking(hidden)  # [T, V]
        best = np.argpartition(-coarse, self.candidates - 1, axis=-1)[:, : self.candidates]  # [T, C]
        logits = np.full(coarse.shape, -np.inf, np.float32)
        for t, ids in enumerate(best):
            logits[t, ids] = self.weight[ids] @ hidden[t]  # only the candidates' bf16 rows are read
        return logits
