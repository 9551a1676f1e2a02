"""Output heads beyond one plain Linear: the draft shortlist and the rescoring head of `--host-tables`.

Both seed engines (REFERENCE.md section 6) keep the per-pass bytes of the head small:
- Drafts rank a shortlist of the vocabulary (SHORTLIST_ROWS rows), not all of it. A draft outside
  the shortlist is never proposed; verification still scores the whole vocabulary, so exact
  acceptance stays exact and only the acceptance rate can change.
- With host tables the bf16 head stays in host memory and an int4 copy ranks the vocabulary; the
  RESCORE_CANDIDATES best of each row are scored again with their bf16 rows.

Every head here maps hidden [T, H] to logits [T, V] over the whole vocabulary, -inf for the ids it
does not score, so sampling and acceptance never need to know which head ran.
"""

from __future__ import annotations

import numpy as np

from duet.engine.backend.cpu import W4A16Linear
from duet.engine.quant.w4 import quantize_rtn

SHORTLIST_ROWS = 65_536  # rows of the draft head (the seed's 65,536-row draft vocabulary)
RESCORE_CANDIDATES = 64  # int4-ranked candidates per row rescored with bf16 rows (the seed: 16 to 64)


def shortlist_ids(vocab: int, always: list[int]) -> np.ndarray | None:
    """Token ids drafts may propose: the first SHORTLIST_ROWS ids plus `always` (the stop tokens);
    None when that is the whole vocabulary.

    Byte-level BPE numbers its tokens in merge order: the byte alphabet first, then each merge as it
    was learned from the most frequent pairs, so the lowest ids are the most common tokens. Taking
    them as they are keeps the shortlist rows one contiguous block of the head (a view, no copy).
    """
    rows = SHORTLIST_ROWS
    if vocab <= rows:
        return None
    extra = sorted({int(i) for i in always if rows <= i < vocab})
    return np.concatenate([np.arange(rows), np.asarray(extra, dtype=np.int64)])


class ShortlistHead:
    """Logits of the shortlisted ids through `linear` (the head's rows of those ids, in that order)."""

    def __init__(self, linear, ids: np.ndarray, vocab: int):
        self.linear, self.ids, self.vocab = linear, ids, vocab

    def __call__(self, hidden: np.ndarray) -> np.ndarray:
        logits = np.full((hidden.shape[0], self.vocab), -np.inf, np.float32)
        logits[:, self.ids] = self.linear(hidden)
        return logits


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
