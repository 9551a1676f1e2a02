"""Speculative decoding: drafters, acceptance rules, adaptive depth. Facts: REFERENCE.md section 5.

A drafter proposes up to k tokens, each with the distribution q it was drawn from (None: the draft
was chosen deterministically, q is one-hot on it). The verify pass gives the target distribution p
for every row; an acceptance rule decides how many drafts to keep and which token follows them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from duet.engine.choices import Accept, Draft
from duet.engine.errors import DuetError
from duet.engine.model import Model
from duet.engine.sampling import Sampler, candidates_top_k, compiled_twins, probabilities, process_logits

EXACT, LOSSY = Accept.EXACT, Accept.LOSSY
DRAFTERS = tuple(Draft)  # the words of engine/choices.py


@dataclass
class Draft:
    tokens: list[int]
    q: list[np.ndarray | None]  # per draft: the distribution it was drawn from, or None if one-hot
    q_ids: list[np.ndarray | None] = field(default_factory=list)  # per draft: the ids q covers (none given: all)
    # The same q as the compiled acceptance reads them, where a drafter had them so (the one-call MTP
    # drafts): (q [k, W], q_ids [k, W], counts [k]), draft i's q over q_ids[i, :counts[i]].
    packed: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def through_stop(self, stops) -> Draft:
        """The drafts up to the first stop token, inclusive: a reply ends there, so a row after it
        could never be committed."""
        for i, token in enumerate(self.tokens):
            if token in stops:
                packed = None if self.packed is None else tuple(a[: i + 1] for a in self.packed)
                return Draft(self.tokens[: i + 1], self.q[: i + 1], self.q_ids[: i + 1], packed)
        return self


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafts kept
    next_token: int  # the token after them: the correction, or the bonus when all were kept
    lossy: int  # drafts kept only because of the lossy rule


# --------------------------------------------------------------------------------------------
# Acceptance


def accept(rule: str, target: np.ndarray, draft: Draft, sampler: Sampler, columns: np.ndarray | None = None) -> Verdict:
    """Decide on a verify pass. target [k + 1, V]: processed logits of each verify row; columns: the
    ids of target's columns when it covers a few (None: all of them, in order).

    Greedy (temperature 0): keep drafts while each equals the argmax of the row before it. The
    lossy rule cannot keep more there, since the greedy target puts all its mass on the argmax.
    Sampling, exact: keep x ~ q with probability min(1, p(x) / q(x)); on rejection draw from
    norm(max(0, p - q)), which makes the output distributed exactly as p.
    Sampling, lossy (mode-biased): on rejection, with r drawn from that residual, keep x anyway if
    p(x) >= p(r); each such keep is counted in `lossy`.

    p and q may each cover a few ids (columns, a draft's q_ids): an id outside them has probability 0,
    so the rule reads p(x) and q(x) by id and forms the residual over the ids either covers only when
    it rejects (building every row over the union of the cycle's ids took ~15 us a cycle).
    """
    if sampler.params.greedy:
        best = np.argmax(target, axis=-1)
        return accept_greedy(best if columns is None else columns[best], draft.tokens)
    verdict = _accept_in_one_call(rule, target, draft, sampler, columns)
    if verdict is not None:
        return verdict
    lossy = 0
    for i, (x, q, q_ids) in enumerate(itertools.zip_longest(draft.tokens, draft.q, draft.q_ids[: len(draft.tokens)])):
        p = probabilities(target[i])
        p_x = _probability_of(x, p, columns)
        q_x = 1.0 if q is None else _probability_of(x, q, q_ids)
        if sampler.rng.random() * q_x < p_x:  # u < p(x) / q(x) without dividing
            continue
        r = _draw_residual(p, columns, q, q_ids, x, sampler)
        if rule == LOSSY and p_x >= _probability_of(r, p, columns):
            lossy += 1
            continue
        return Verdict(i, r, lossy)
    bonus = sampler.draw(probabilities(target[len(draft.tokens)]))
    return Verdict(len(draft.tokens), bonus if columns is None else int(columns[bonus]), lossy)


def _accept_in_one_call(rule: str, target: np.ndarray, draft: Draft, sampler: Sampler,
                        columns: np.ndarray | None) -> Verdict | None:
    """accept's sampled rules in one compiled call (compiled_sampling.accept_rows): the same verdict
    from the same draws of the sampler's generator, which it leaves as the loop would. None where the
    loop runs: the compiled twins off, or draws from anything but a numpy Generator (the tests'
    scripted ones). In a sampled demo cycle the loop's ~25 numpy calls took ~87 us (the residual's
    union of ids most of it), this ~22 (in the decode loop, timed by wrappers)."""
    twins = compiled_twins()
    if twins is None or type(sampler.rng) is not np.random.Generator or target.dtype != np.float32:
        return None
    q_rows, q_ids, counts = draft.packed or _packed_q(draft)
    columns = np.arange(target.shape[1]) if columns is None else np.asarray(columns, np.int64)
    kept, token, lossy = twins.accept_rows(np.ascontiguousarray(target), columns, np.asarray(draft.tokens, np.int64), q_rows,
                                           q_ids, counts, rule == LOSSY, sampler.rng.bit_generator.ctypes.bit_generator.value)
    return Verdict(int(kept), int(token), int(lossy))


def _packed_q(draft: Draft) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draft.packed from the drafts' q lists; a q of None gets count -1: one-hot on its draft."""
    k = len(draft.tokens)
    qs = list(itertools.zip_longest(draft.q[:k], draft.q_ids[:k]))
    width = max((len(q) for q, _ in qs if q is not None), default=0)
    q_rows, q_ids, counts = np.zeros((k, width), np.float32), np.zeros((k, width), np.int64), np.full(k, -1, np.int64)
    for i, (q, ids) in enumerate(qs):
        if q is not None:
            counts[i] = len(q)
            q_rows[i, : len(q)] = q
            q_ids[i, : len(q)] = np.arange(len(q)) if ids is None else ids
    return q_rows, q_ids, counts


def _probability_of(token: int, probs: np.ndarray, ids: np.ndarray | None) -> float:
    """The probability of id `token` under probs over `ids` (ascending; None: every id): 0 where absent."""
    if ids is None:
        return float(probs[token])
    at = int(np.searchsorted(ids, token))
    return float(probs[at]) if at < len(ids) and ids[at] == token else 0.0


def _draw_residual(p: np.ndarray, p_ids: np.ndarray | None, q: np.ndarray | None, q_ids: np.ndarray | None,
                   drafted: int, sampler: Sampler) -> int:
    """An id drawn from norm(max(0, p - q)), p over p_ids and q over q_ids (None: every id; q None:
    one-hot on `drafted`), over the ids either covers in ascending order: the whole vocabulary's
    draw, less its zeros."""
    if p_ids is None and (q is None or q_ids is None):
        return sampler.draw(residual(p, q, drafted))
    if q is None:
        q, q_ids = np.ones(1, p.dtype), np.array([drafted])
    p_ids = np.arange(len(p)) if p_ids is None else p_ids
    q_ids = np.arange(len(q)) if q_ids is None else q_ids
    union = np.union1d(p_ids, q_ids)
    p_on, q_on = np.zeros(len(union), p.dtype), np.zeros(len(union), q.dtype)
    p_on[np.searchsorted(union, p_ids)] = p
    q_on[np.searchsorted(union, q_ids)] = q
    return int(union[sampler.draw(residual(p_on, q_on, drafted))])


def residual(p: np.ndarray, q: np.ndarray | None, drafted: int) -> np.ndarray:
    """norm(max(0, p - q)); q None means one-hot on the drafted token."""
    if q is None:
        q = np.zeros_like(p)
        q[drafted] = 1.0
    rest = np.maximum(p - q, 0.0)
    total = rest.sum()
    return rest / total if total > 0 else p


def accept_greedy(best: np.ndarray, drafts: list[int]) -> Verdict:
    """Greedy acceptance from each verify row's argmax id best [k + 1]: keep drafts while each equals
    the argmax of the row before it; the next token is the argmax after the last kept."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == best[kept]:
        kept += 1
    return Verdict(kept, int(best[kept]), 0)


# --------------------------------------------------------------------------------------------
# Drafters


class NoDrafter:
    """The drafter interface, drafting nothing: every cycle is a plain decode step."""

    name = "none"
    depth_cap = 0  # most drafts a cycle may ask for
    reads_prompt_hidden = False  # start() needs the hidden state of every prompt row, not the last one only
    state = None  # what it carries to the next turn of a conversation (engine.generate.PromptCache): nothing

    def start(self, prompt: list[int], hidden: np.ndarray, first: int) -> None:
        pass

    def propose(self, history: list[int], k: int, sampler: Sampler) -> Draft:
        return Draft([], [])

    def commit(self, committed: list[int], hidden: np.ndarray) -> None:
        pass


class NgramDrafter(NoDrafter):
    """Prompt lookup: find the longest recent n-gram (n = 3..1) earlier in the history and propose
    the tokens that followed it. Drafts are deterministic (q one-hot)."""

    name = "ngram"
    depth_cap = 7
    MAX_N = 3

    def propose(self, history: list[int], k: int, sampler: Sampler) -> Draft:
        for n in range(min(self.MAX_N, len(history) - 1), 0, -1):
            tail = history[-n:]
            # Latest earlier occurrence first: recent context predicts best.
            for start in range(len(history) - n - 1, -1, -1):
                if history[start : start + n] == tail:
                    follow = history[start + n : start + n + k]
                    return Draft(follow, [None] * len(follow))
        return Draft([], [])


class MTPDrafter:
    """The checkpoint's multi-token-prediction head. Its KV cache holds one row per committed
    position t, fed (x_{t+1}, h_t); the last row's output predicts the first draft. Further drafts
    apply the same layer to its own output and its own drafted token, then are rolled back."""

    name = "mtp"
    depth_cap = 4
    reads_prompt_hidden = True

    def __init__(self, model: Model):
        self.model = model
        self.state = model.new_mtp_state()
        self.hidden: np.ndarray | None = None  # MTP output of the last committed row [1, H]

    def start(self, prompt: list[int], hidden: np.ndarray, first: int) -> None:
        """hidden: the prompt's last rows, those prefilled (a PromptCache held the rows before them,
        and self.state those rows' MTP rows)."""
        self.commit(list(prompt[len(prompt) - hidden.shape[0] + 1 :]) + [first], hidden)

    def commit(self, committed: list[int], hidden: np.ndarray) -> None:
        """Rows for the newly committed tokens: committed[j] is x_{t+1} for main hidden[j] = h_t."""
        self.hidden = self.model.mtp_forward(self.state, committed, hidden, last_only=True)

    def propose(self, history: list[int], k: int, sampler: Sampler) -> Draft:
        committed_length = self.state.length
        if argmax_only(sampler.params):
            tokens = self.model.mtp_greedy_drafts(self.state, self.hidden, k)
            self.state.rewind(committed_length)
            return Draft(tokens, [None] * len(tokens), [None] * len(tokens))
        drafted = self.model.mtp_sampled_drafts(self.state, self.hidden, k, sampler.params, sampler.rng.random)
        if drafted is not None:
            self.state.rewind(committed_length)
            return Draft(*drafted)
        draft, hidden = Draft([], []), self.hidden
        for i in range(k):
            if i:
                hidden = self.model.mtp_forward(self.state, [draft.tokens[-1]], hidden)
            values, ids = self.model.draft_candidates(hidden, candidates_top_k(sampler.params), sampler.params.temperature)
            token, q = _draw_draft(values[0], ids, sampler, history + draft.tokens)
            draft.tokens.append(token)
            draft.q.append(q)
            draft.q_ids.append(ids)
        self.state.rewind(committed_length)
        return draft


def argmax_only(params) -> bool:
    """Whether picking a token needs only the argmax of the raw logits (greedy, no penalties), so a
    pass's logits need not leave the device (Model.greedy_ids)."""
    return params.greedy and not params.penalizes


def _draw_draft(logits: np.ndarray, columns: np.ndarray | None, sampler: Sampler,
                previous: list[int]) -> tuple[int, np.ndarray | None]:
    """(the draft, q over the columns) from one row of logits over `columns` (None: every id)."""
    processed = process_logits(logits, sampler.params, previous, columns)
    q = None if sampler.params.greedy else probabilities(processed)
    column = int(np.argmax(processed)) if q is None else sampler.draw(q)
    return (column if columns is None else int(columns[column])), q


def drafter_kind(kind: str, model: Model) -> str:
    """The drafter a choice names: auto is the checkpoint's MTP head where it has one, else n-gram lookup."""
    if kind not in DRAFTERS:
        raise DuetError(f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTERS)}")
    if kind == "auto":
        return "mtp" if model.mtp is not None else "ngram"
    return kind


def depth_cap(kind: str, model: Model) -> int:
    """Most drafts a cycle may ask of the drafter `kind` names (0: it drafts nothing)."""
    return {"mtp": MTPDrafter, "ngram": NgramDrafter}.get(drafter_kind(kind, model), NoDrafter).depth_cap


def make_drafter(kind: str, model: Model):
    kind = drafter_kind(kind, model)
    if kind == "mtp":
        if model.mtp is None:
            raise DuetError("this checkpoint has no MTP head (no mtp.* tensors); use --draft ngram or none")
        return MTPDrafter(model)
    return NgramDrafter() if kind == "ngram" else NoDrafter()


# --------------------------------------------------------------------------------------------
# Depth


@dataclass(frozen=True)
class DraftCosts:
    """What drafting costs, in decode steps (the time of a one-row pass): per draft (drafting it, and
    its row in the verify pass) and per cycle at any depth (the MTP head's pass over the committed rows)."""

    per_draft: float = 0.0
    per_cycle: float = 0.0


def draft_costs(drafter, lm) -> DraftCosts:
    """The costs of `drafter`'s drafts on the loaded model `lm` (engine/loader.py): a verify row as its
    op set states it; an MTP draft (and the commit pass) as the share of a decode pass's bytes it
    reads, from placement's bill. Neither is timed, so a seeded run drafts the same at any speed."""
    row = lm.model.ops.VERIFY_ROW_COST
    if not isinstance(drafter, MTPDrafter):
        return DraftCosts(per_draft=row)
    share = lm.mtp_draft_share
    return DraftCosts(per_draft=share + row, per_cycle=share)


class Depth:
    """How many drafts to ask for: fixed, or the depth expected to commit the most tokens per unit of time.

    Adaptive: with a_i the running rate at which draft i is kept when the drafts before it were
    (each judged cycle moves it RATE_WEIGHT of the way, from PRIOR_RATE), depth d commits
    1 + a_1 + a_1 a_2 + ... + a_1...a_d tokens a cycle, expected, for 1 + per_cycle + d per_draft
    decode steps (DraftCosts); the best d in [1, cap] is asked for, the shallowest of equals. On the
    demo (an MTP draft ~0.27 of a step with its verify row) MTP replies to the bench prompts average
    depth 2.8 greedy, 2.5 sampled at 0.7; the old rule (one deeper after all kept, one shallower
    after none kept) drove greedy replies to 3.4 and its fourth draft cost more than it bought."""

    PRIOR_RATE = 0.8
    RATE_WEIGHT = 0.125

    def __init__(self, drafter, fixed: int | None, costs: DraftCosts = DraftCosts()):
        self.cap = drafter.depth_cap
        if fixed is not None and self.cap and not 1 <= fixed <= self.cap:
            raise DuetError(f"--depth must be between 1 and {self.cap} for {drafter.name} drafts (got {fixed})")
        self.fixed, self.costs = fixed, costs
        self.rates = [self.PRIOR_RATE] * self.cap
        self.current = fixed if fixed is not None else self._best()

    def update(self, drafted: int, accepted: int) -> None:
        """Adaptive: the rates of the drafts this cycle judged (those whose predecessors it kept), then the best depth."""
        if self.fixed is not None or drafted == 0:
            return
        for i in range(min(accepted + 1, drafted)):
            self.rates[i] += self.RATE_WEIGHT * ((i < accepted) - self.rates[i])
        self.current = self._best()

    def _best(self) -> int:
        best, best_value, reach, tokens = 0, 0.0, 1.0, 1.0  # depth 1 is always worth more than 0 here
        for d, rate in enumerate(self.rates, 1):
            reach *= rate
            tokens += reach
            value = tokens / (1 + self.costs.per_cycle + d * self.costs.per_draft)
            if value > best_value:
                best, best_value = d, value
        return best


def check_rule(rule: str) -> str:
    if rule not in (EXACT, LOSSY):
        raise DuetError(f"unknown acceptance rule {rule!r}; choose exact or lossy")
    return rule

