"""Logit processors and a seeded sampler.

Processors run in the order transformers' `generate` runs them: repetition penalty, presence
penalty, temperature, top-k, top-p, min-p. Removed tokens get -inf. A verify pass has one row per
draft position, and row i counts the drafts before it as generated (`process_rows`).

Rows may cover the whole vocabulary or a few of its ids (`columns`, ascending): top-k sampling
reads only the ids top-k keeps (the op sets' top_k_candidates), and every processor, softmax and
draw gives those ids the values it would give them in whole rows, where the rest are -inf. At
248,320 ids a sampled draft's processing and draw took 3.0 ms over whole rows.

These functions are the readable reference. Where numba runs, the warpers without penalties or
min-p, the softmax and the draw run as compiled twins (engine/backend/compiled_sampling.py, which
states how close they are): one call a step instead of ~10 numpy calls on a few dozen numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from duet.engine.backend import compiled_sampling
from duet.engine.errors import DuetError

# The compiled twins of the warpers, softmax and draw (engine/backend/compiled_sampling.py), or None:
# these numpy functions run. Decided once: every sampled step would read the environment again.
_compiled = compiled_sampling if compiled_sampling.available() else None


def compiled_twins():
    """The compiled twins in use (engine/backend/compiled_sampling.py), or None where this numpy code runs."""
    return _compiled


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 is greedy: penalties apply, the warpers after them do not
    top_k: int = 0  # 0 is off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
        _require(_finite(t) and t >= 0, f"temperature must be 0 (greedy) or more, got {t}")
        _require(_whole(k) and k >= 0, f"top_k must be a whole number, 0 for off, got {k}")
        _require(_finite(p) and 0 < p <= 1, f"top_p must be above 0 and at most 1, got {p}")
        _require(_finite(m) and 0 <= m <= 1, f"min_p must be between 0 and 1, got {m}")
        penalty = self.repetition_penalty
        _require(_finite(penalty) and penalty > 0, f"repetition_penalty must be above 0 (1 is off), got {penalty}")
        presence = self.presence_penalty
        _require(_finite(presence), f"presence_penalty must be a finite number, got {presence}")
        seed = self.seed
        _require(seed is None or (_whole(seed) and seed >= 0), f"seed must be a whole number >= 0, got {seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalizes(self) -> bool:
        """Whether tokens already generated are penalised (which needs the ids seen so far)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0


def candidates_top_k(params: SamplingParams) -> int:
    """When sampling without penalties and with top-k on, params.top_k: the ids top-k keeps (the k
    largest of logits / temperature and any tied with the k-th) are all the processors leave of a row,
    so only they need leave the device (Model.logits). Else 0: whole rows (greedy rows go by argmax,
    Model.greedy_ids; penalties lower seen tokens, which can let a token from outside the k in)."""
    return params.top_k if not params.greedy and not params.penalizes else 0


def candidate_rows(T: int, rows: np.ndarray, columns: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Entries (rows[i], columns[i]) = values[i] of T rows, as (values [T, C] over the C distinct
    columns, -inf where a row has no entry; those columns, ascending)."""
    kept = np.unique(columns)
    out = np.full((T, len(kept)), -np.inf, np.float32)
    out[rows, np.searchsorted(kept, columns)] = values
    return out, kept


def process_logits(logits: np.ndarray, params: SamplingParams, previous_ids: Sequence[int],
                   columns: np.ndarray | None = None) -> np.ndarray:
    """Processed logits, (V,) or (rows, V) with every row counting previous_ids as generated;
    columns: the ids of the last axis (None: the whole vocabulary)."""
    seen = np.broadcast_to(_seen_mask(logits.shape[-1], previous_ids, columns), logits.shape) if params.penalizes else None
    return _process(logits, params, seen)


def process_rows(
    logits_rows: np.ndarray, params: SamplingParams, previous_ids: Sequence[int], drafts: Sequence[int],
    columns: np.ndarray | None = None,
) -> np.ndarray:
    """Processed verify rows (rows, V): row i counts previous_ids and drafts[:i] as generated;
    columns: as in process_logits."""
    rows, vocab = logits_rows.shape
    seen = None
    if params.penalizes:  # the mask of ids seen: ~10 us a row of a 4,096-token vocabulary, unread without penalties
        seen = np.tile(_seen_mask(vocab, previous_ids, columns), (rows, 1))
        for i, draft in enumerate(drafts[: rows - 1]):
            seen[i + 1 :, _seen_mask(vocab, [draft], columns)] = True
    return _process(logits_rows, params, seen)


def probabilities(processed_logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, computed in float64, returned as float32."""
    if _compiled is not None and processed_logits.dtype == np.float32:
        return _compiled_softmax(processed_logits, np.float32)
    return _softmax64(processed_logits).astype(np.float32)


class Sampler:
    """Picks the next token: argmax when greedy, else a draw from the processed distribution."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.Generator(np.random.PCG64(params.seed))

    def pick(self, logits: np.ndarray, previous_ids: Sequence[int], columns: np.ndarray | None = None) -> int:
        """The next token from one row of logits (columns: its ids, None: the whole vocabulary)."""
        processed = process_logits(logits, self.params, previous_ids, columns)
        column = int(np.argmax(processed)) if self.params.greedy else self.draw(_softmax64(processed))
        return column if columns is None else int(columns[column])

    def draw(self, probs: np.ndarray) -> int:
        """One token drawn from probs (V,), which need not be normalised: the first token whose
        cumulative probability passes a uniform draw. Only tokens of nonzero probability can be
        drawn, and adding the zeros between them changes no float64 partial sum, so the cumulative
        sum runs over those alone (top-k leaves k of a whole vocabulary): the same token."""
        if _compiled is not None:
            return _compiled.draw_index(probs, self.rng.random())
        possible = np.flatnonzero(probs > 0)  # a mask first: nonzero of a float array took 13 us at 4,096 entries, this 2
        cdf = np.cumsum(probs[possible], dtype=np.float64)
        cdf /= cdf[-1]  # now cdf[-1] == 1.0 exactly, so a uniform draw in [0, 1) always lands on a token
        return int(possible[np.searchsorted(cdf, self.rng.random(), side="right")])


def _process(logits: np.ndarray, params: SamplingParams, seen: np.ndarray | None) -> np.ndarray:
    if _compiled is not None and not params.greedy and seen is None and params.min_p == 0:
        return _compiled.warp_rows(logits, params.temperature, params.top_k, params.top_p)
    processed = _apply_penalties(logits.astype(np.float32), params, seen)
    if params.greedy:
        return processed
    processed = processed / np.float32(params.temperature)
    if params.top_k:
        processed = _top_k(processed, params.top_k)
    if params.top_p < 1:
        processed = _top_p(processed, params.top_p)
    if params.min_p > 0:
        processed = _min_p(processed, params.min_p)
    return processed


def _seen_mask(vocab: int, ids: Sequence[int], columns: np.ndarray | None = None) -> np.ndarray:
    """Which columns are among ids: of the whole vocabulary, or of `columns`."""
    if columns is not None:
        return np.isin(columns, np.asarray(ids, dtype=np.int64))
    seen = np.zeros(vocab, dtype=bool)
    seen[np.asarray(ids, dtype=np.int64)] = True
    return seen


def _apply_penalties(logits: np.ndarray, params: SamplingParams, seen: np.ndarray | None) -> np.ndarray:
    """Penalise each token already generated once, however many times it occurred. logits is the
    caller's own float32 copy: only the seen entries are read and written (whole-row selects took
    ~0.3 ms a row of a 248,320-token vocabulary). seen: None when params do not penalise."""
    if not params.penalizes:
        return logits
    at = np.nonzero(seen)
    values = logits[at]
    if params.repetition_penalty != 1:
        penalty = np.float32(params.repetition_penalty)
        values = np.where(values > 0, values / penalty, values * penalty)
    if params.presence_penalty != 0:
        values = values - np.float32(params.presence_penalty)
    logits[at] = values
    return logits


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest logits, and any tied with the k-th.

    A row that is mostly -inf already (a draft shortlist's, or one the device cut to its top k) is
    ranked over its finite entries alone: numpy's partition slows on so many equal values (30 us
    against 2 for a demo shortlist row of 1,088 finite ids in 4,096). Rows of the candidates top-k
    keeps (top_k_candidates) have no more than k, ties aside: nothing to do."""
    vocab = logits.shape[-1]
    if k >= vocab:
        return logits
    possible = logits > -np.inf
    if (np.count_nonzero(possible, axis=-1) <= k).all():
        return logits
    if possible.all():
        kth_largest = np.partition(logits, vocab - k, axis=-1)[..., vocab - k, None]
        return np.where(logits < kth_largest, -np.inf, logits)
    if logits.ndim == 2:
        return np.stack([_top_k(row, k) for row in logits])
    values = logits[possible]
    if len(values) <= k:
        return logits
    kth_largest = np.partition(values, len(values) - k)[len(values) - k]
    return np.where(logits < kth_largest, -np.inf, logits)


def _top_p(logits: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the most likely tokens until their mass reaches top_p: a token stays while those above it hold less.

    Only tokens still possible take part: after top-k that is k of a 248,320-token vocabulary, whose
    full sort took 9.8 ms a row (the tokens left out have probability 0, sort last and stay -inf)."""
    if logits.ndim == 2:
        return np.stack([_top_p(row, top_p) for row in logits])
    possible = np.flatnonzero(logits > -np.inf)
    values = logits[possible]
    order = np.argsort(-values, kind="stable")  # most likely first
    sorted_probs = _softmax64(values)[order]
    mass_above = np.cumsum(sorted_probs) - sorted_probs
    kept = logits.copy()
    kept[possible[order[mass_above >= top_p]]] = -np.inf
    return kept


def _min_p(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens less likely than min_p times the most likely one."""
    probs = _softmax64(logits)
    return np.where(probs < min_p * probs.max(axis=-1, keepdims=True), -np.inf, logits)


def _softmax64(logits: np.ndarray) -> np.ndarray:
    """Softmax in float64 over the last axis. A row that top-k or top-p cut to the tokens still
    possible is computed over those alone (the rest are exactly 0): over a 248,320-token vocabulary
    the whole row took 0.76 ms, each verify and draft row of a sampled cycle."""
    if _compiled is not None and logits.dtype == np.float32:
        return _compiled_softmax(logits, np.float64)
    if logits.ndim == 1:
        possible = np.flatnonzero(logits > -np.inf)
        if 0 < len(possible) < len(logits):
            out = np.zeros(len(logits), np.float64)
            out[possible] = _softmax64(logits[possible])
            return out
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    weights = np.exp(shifted)
    return weights / weights.sum(axis=-1, keepdims=True)


def _compiled_softmax(logits: np.ndarray, dtype) -> np.ndarray:
    """The compiled softmax of each row over its finite entries (as _softmax64 of a row), in `dtype`."""
    rows = np.ascontiguousarray(logits).reshape(-1, logits.shape[-1])
    out = np.empty(rows.shape, dtype)
    _compiled.softmax_rows(rows, out)
    return out.reshape(logits.shape)


def _require(condition: bool, problem: str) -> None:
    if not condition:
        raise DuetError(f"invalid sampling setting: {problem}")


def _finite(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)
