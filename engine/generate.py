"""The generation loop: prefill, then cycles of draft -> verify -> accept -> commit or roll back.

A cycle runs the last committed token plus k drafts as k + 1 rows through every layer in one
call, keeps the rows the acceptance rule agrees with, rolls the state back to the last kept row,
and commits the kept drafts plus one more token. Without drafts a cycle is one decode step.
Each cycle yields a `Tokens` event (new text, this cycle's figures, running stats); the loop ends
with one `Finished` event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from duet.engine.choices import KVCache
from duet.engine.errors import DuetError
from duet.engine.experts import check_moe_skip
from duet.engine.loader import LoadedModel
from duet.engine.sampling import Sampler, SamplingParams, candidates_top_k, process_rows
from duet.engine.speculative import EXACT, Depth, accept, accept_greedy, argmax_only, check_rule, draft_costs, make_drafter


@dataclass(frozen=True)
class GenerateOptions:
    max_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    context: int | None = None  # token budget for prompt + reply; None: the model's maximum
    draft: str = "auto"  # auto (MTP when the checkpoint has it, else n-gram), mtp, ngram, none
    depth: int | None = None  # drafts per cycle; None: adaptive (engine/speculative.py's Depth)
    accept: str = EXACT  # exact or lossy; the starting value of Switches.accept
    kv: KVCache = KVCache.BF16  # attention KV cache: unquantized, or q4 (Hadamard-rotated 4-bit, exact sink/recent)
    moe_skip: float = 0.0  # MoE: router weight of off-card routes a row may skip, lossy cycles only (engine/experts.py)

    def __post_init__(self):
        if self.max_tokens < 1:
            raise DuetError(f"max tokens must be at least 1 (got {self.max_tokens})")
        if self.context is not None and self.context < 2:
            raise DuetError(f"context must be at least 2 tokens (got {self.context})")
        check_rule(self.accept)
        check_moe_skip(self.moe_skip, self.accept)
        runnable = [kv for kv in KVCache if kv.runs]
        if self.kv not in runnable:
            raise DuetError(f"KV cache type {self.kv!r} cannot run; choose {' or '.join(runnable)}")


@dataclass
class Switches:
    """Settings the UI may flip while a reply streams; read at the start of every cycle."""

    accept: str = EXACT
    route: str | None = None  # another route of the loaded weights to run from the next pass; None: keep


@dataclass
class PromptCache:
    """What a reply leaves for the next turn of its conversation: the sequence state (KV caches,
    DeltaNet and conv states) and the drafter's, and the tokens whose rows they hold.

    A chat turn's prompt is the last prompt, the reply and a new message, so when the held tokens
    begin the next prompt only the rest is prefilled. Where the next prompt renders the reply
    otherwise than it was generated (a template that leaves a reasoning model's thinking out of
    earlier turns) or answers the same turn again (a regenerated reply), a checkpoint of the state
    at the start of the reply's turn (`turn_start` of generate) serves instead. DeltaNet's state
    cannot be cut back to an earlier token, so any other prompt (an edited turn) starts afresh, as
    does another model, route, KV cache kind or drafter: rows are reused only where a fresh prefill
    would have run the same weights over the same tokens.
    """

    tokens: list[int] = field(default_factory=list)  # the tokens whose rows `state` holds, in order
    state: object = None
    # An MTP drafter's state, whose rows follow the state's (cut back, when taken, to the rows before
    # the last: that row pairs the last token's hidden state with the token after it, which the next
    # prompt may not follow), and the hidden state of the state's last row [1, H].
    drafter_state: object = None
    last_hidden: object = None
    # The start of the reply's turn: its tokens, the state's checkpoint there and that row's hidden state.
    turn_tokens: list[int] = field(default_factory=list)
    turn_checkpoint: object = None
    turn_hidden: object = None
    model: object = None  # the Model whose weights made the states ...
    settings: tuple = ()  # ... under (route, KV cache kind, drafter name)

    def take(self, prompt_ids: list[int], model, settings: tuple):
        """(state, drafter state, last hidden state, tokens held) when the held rows, or those up to
        the turn's start, begin prompt_ids (with a token after them left to prefill), else None.
        Empties the cache either way, so the caller owns the states (and a state that does not fit is
        let go before a new one is made: never two on a card)."""
        state, drafter_state, made_by = self.state, self.drafter_state, self.model
        held = [(self.tokens, None, self.last_hidden), (self.turn_tokens, self.turn_checkpoint, self.turn_hidden)]
        self.state = self.drafter_state = self.last_hidden = self.turn_checkpoint = self.turn_hidden = self.model = None
        if state is None or model is not made_by or settings != self.settings:
            return None
        for tokens, checkpoint, hidden in held:
            n = len(tokens)
            if hidden is None or len(prompt_ids) <= n or list(prompt_ids[:n]) != tokens:
                continue
            if checkpoint is not None:
                state.restore(checkpoint)
            if drafter_state is not None:
                drafter_state.rewind(n - 1)
            return state, drafter_state, hidden, n
        return None

    def keep(self, state, drafter_state, last_hidden, history: list[int], model, settings: tuple,
             turn: tuple | None = None) -> None:
        """Hold these states for the next turn. history: the prompt and the reply's tokens, of which
        state holds the rows of all, or all but the last (the reply's last token is the row a next
        cycle would have run; else only the turn's start is held); drafter_state: the drafter's (None:
        it keeps none); last_hidden: the hidden state of the state's last row; turn: (tokens,
        state.checkpoint(), hidden state of its last row) at the start of the reply's turn, or None."""
        rows = state.length
        whole = rows <= len(history) and (drafter_state is None or drafter_state.length >= rows - 1)
        self.tokens, self.last_hidden = (history[:rows], last_hidden) if whole else ([], None)
        self.turn_tokens, self.turn_checkpoint, self.turn_hidden = turn or ([], None, None)
        self.state, self.drafter_state, self.model, self.settings = state, drafter_state, model, settings


@dataclass
class Stats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, rows a PromptCache held from the turn before (not prefilled)
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time after the first token
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    n_lossy: int = 0
    routes: list[str] = field(default_factory=list)  # the routes the passes ran, in the order they were switched to
    rules: list[str] = field(default_factory=list)  # likewise the acceptance rules of the cycles
    drafted_at: list[int] = field(default_factory=list)  # per draft position: how often drafted
    accepted_at: list[int] = field(default_factory=list)  # ... and how often kept
    # MoE, over the decode passes: routes to experts on the card, routes run from host RAM, routes skipped
    expert_hits: int = 0
    expert_misses: int = 0
    n_skipped: int = 0
    host_expert_bytes: int = 0

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens prefilled (not those a PromptCache held) over the time they took."""
        return (self.prompt_tokens - self.cached_tokens) / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first (which prefill produced) over the time they took."""
        after_first = self.generated_tokens - 1
        return after_first / self.decode_seconds if after_first > 0 and self.decode_seconds else 0.0

    @property
    def tokens_per_cycle(self) -> float:
        """Committed tokens per verify pass (the first token comes from prefill, not a cycle)."""
        return (self.generated_tokens - 1) / self.cycles if self.cycles else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def accept_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def lossy_rate(self) -> float:
        """Extra acceptances the lossy rule made, per draft: the drift it opened from the target."""
        return self.n_lossy / self.drafted if self.drafted else 0.0

    @property
    def routed_experts(self) -> bool:
        """Whether the decode passes counted routed experts (a MoE model)."""
        return self.expert_hits + self.expert_misses + self.n_skipped > 0

    @property
    def expert_hit_rate(self) -> float:
        routes = self.expert_hits + self.expert_misses
        return self.expert_hits / routes if routes else 0.0

    @property
    def host_bytes_per_token(self) -> float:
        """Expert bytes the decode passes read from host RAM, per token they committed."""
        after_first = self.generated_tokens - 1
        return self.host_expert_bytes / after_first if after_first > 0 else 0.0

    def record_routes(self, routing) -> None:
        """The expert routing's counts since the decode began (engine/experts.py)."""
        self.expert_hits, self.expert_misses, self.n_skipped = routing.hits, routing.misses, routing.skipped
        self.host_expert_bytes = routing.misses * routing.expert_bytes

    def record_cycle(self, drafted: int, accepted: int, lossy: int) -> None:
        self.cycles += 1
        self.drafted += drafted
        self.accepted += accepted
        self.n_lossy += lossy
        while len(self.drafted_at) < drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "prefill_tok_s": round(self.prefill_tok_s, 3),
            "decode_tok_s": round(self.decode_tok_s, 3),
            "cycles": self.cycles,
            "tokens_per_cycle": round(self.tokens_per_cycle, 4),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "accept_by_position": [round(a, 4) for a in self.accept_by_position],
            "n_lossy": self.n_lossy,
            "lossy_rate": round(self.lossy_rate, 4),
            "mean_depth": round(self.drafted / self.cycles, 3) if self.cycles else 0.0,
            "routes": list(self.routes),
            "rules": list(self.rules),
        } | ({"cached_tokens": self.cached_tokens} if self.cached_tokens else {}) \
          | ({"expert_hit_rate": round(self.expert_hit_rate, 4), "host_bytes_per_token": round(self.host_bytes_per_token),
              "n_skipped": self.n_skipped} if self.routed_experts else {})

    def ran(self, route: str, rule: str | None = None) -> None:
        """Note the route (and rule) of a pass when it differs from the previous pass's."""
        for seen, value in ((self.routes, route), (self.rules, rule)):
            if value is not None and (not seen or seen[-1] != value):
                seen.append(value)


@dataclass(frozen=True)
class Cycle:
    """One verify pass: how deep it drafted, how many drafts it kept, under which rule and route."""

    drafted: int
    accepted: int
    lossy: int
    rule: str
    route: str


@dataclass(frozen=True)
class Tokens:
    token_ids: list[int]
    text: str
    stats: Stats
    cycle: Cycle | None = None  # None for the first token, which prefill produced


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" (an eos id), "length" (max_tokens), "context" (budget full), "cancelled"
    stats: Stats
    drafter: str = "none"


def generate(lm: LoadedModel, prompt_ids: list[int], options: GenerateOptions,
             cancel: threading.Event | None = None, switches: Switches | None = None,
             drafter=None, cache: PromptCache | None = None, turn_start: int | None = None) -> Iterator[Tokens | Finished]:
    """Generate a reply to `prompt_ids`; stop on any eos id, max_tokens, the context budget or cancel.

    `drafter` overrides options.draft with any object that has the interface of
    engine.speculative.NoDrafter (name, depth_cap, state, start, propose, commit). `cache`: the
    conversation's PromptCache: the rows it holds of this prompt are not run again, and it holds
    this reply's states when the reply ends; with `turn_start` (the prompt's tokens before the
    reply's opening, the end of the conversation's last message) and the bf16 KV cache (the q4
    cache's exact rows move on), also a checkpoint of the state there.
    """
    budget = options.context or lm.config.max_position_embeddings
    if not prompt_ids:
        raise DuetError("the prompt is empty; give some text")
    if len(prompt_ids) >= budget:
        raise DuetError(f"the prompt is {len(prompt_ids)} tokens but the context budget is {budget}; "
                        "shorten the prompt or raise --context")
    model, sampler = lm.model, Sampler(options.sampling)
    drafter = drafter or make_drafter(options.draft, model)
    depth = Depth(drafter, options.depth, draft_costs(drafter, lm))
    switches = switches or Switches(options.accept)
    decoder = lm.tokenizer.stream_decoder()
    stats = Stats(prompt_tokens=len(prompt_ids))
    history = list(prompt_ids)  # prompt + committed tokens, for n-gram lookup
    generated: list[int] = []

    def emit(tokens: list[int], cycle: Cycle | None):
        """Commit tokens up to a stop condition; returns (event, finish reason or None)."""
        reason = None
        kept = []
        for token in tokens:
            kept.append(token)
            reason = _finish_reason(token in lm.tokenizer.eos_ids, len(generated) + len(kept),
                                    options.max_tokens, len(prompt_ids) + len(generated) + len(kept), budget)
            if reason:
                break
        generated.extend(kept)
        history.extend(kept)
        stats.generated_tokens = len(generated)
        text = decoder.push([t for t in kept if t not in lm.tokenizer.eos_ids])
        if reason or (cancel is not None and cancel.is_set()):
            text += decoder.flush()
            reason = reason or "cancelled"
        return Tokens(kept, text, stats, cycle), reason

    def apply_route() -> str:
        if switches.route is not None:
            lm.use_route(switches.route)
        return lm.route

    routing = model.routing

    def skip_under(rule: str) -> None:  # --moe-skip is lossy: it runs in lossy cycles only
        if routing is not None:
            routing.skip_budget = options.moe_skip if rule != EXACT else 0.0

    started = time.perf_counter()
    stats.ran(apply_route())
    skip_under(check_rule(switches.accept))
    settings = (lm.route, options.kv, drafter.name)
    held = cache.take(prompt_ids, model, settings) if cache is not None else None
    if held is None:
        state = model.new_state(options.kv)
    else:
        state, drafter.state, held_hidden, stats.cached_tokens = held
    turn = None
    if cache is not None and turn_start is not None and options.kv == KVCache.BF16 \
            and stats.cached_tokens < turn_start < len(prompt_ids):  # prefilled in two parts, the state kept between
        before = model.forward(state, prompt_ids[stats.cached_tokens : turn_start], last_only=not drafter.reads_prompt_hidden)
        turn = (list(prompt_ids[:turn_start]), state.checkpoint(), before[-1:])
    hidden = model.forward(state, prompt_ids[turn_start if turn else stats.cached_tokens :],
                           last_only=not drafter.reads_prompt_hidden)
    if turn and drafter.reads_prompt_hidden:
        hidden = model.ops.concat([before, hidden], axis=0)
    last_hidden = hidden[-1:]  # of the state's last row, which a next turn's drafter starts from
    on_device = argmax_only(options.sampling)  # greedy without penalties: only argmax ids leave the device
    top_k, temperature = candidates_top_k(options.sampling), options.sampling.temperature  # else what top-k keeps
    if on_device:
        first = int(model.greedy_ids(hidden[-1:])[0])
    else:
        values, columns = model.candidates(hidden[-1:], top_k, temperature)
        first = sampler.pick(values[0], generated, columns)
    stats.prefill_seconds = time.perf_counter() - started

    def finished(reason: str) -> Finished:
        if cache is not None and len(stats.routes) == 1:  # states of one route only
            cache.keep(state, drafter.state, last_hidden, history, model, settings, turn)
        return Finished(reason, stats, drafter.name)

    event, reason = emit([first], None)
    yield event
    if reason:
        yield finished(reason)
        return
    if held is not None and drafter.state is not None:  # its next row: the held rows' last hidden state
        hidden = model.ops.concat([held_hidden, hidden], axis=0)
    drafter.start(prompt_ids, hidden, first)
    if routing is not None:
        routing.reset_counts()  # the figures are the decode's: the prompt is read once
    decode_started = time.perf_counter()
    while True:
        rule, route = check_rule(switches.accept), apply_route()
        stats.ran(route, rule)
        skip_under(rule)
        room = min(options.max_tokens - len(generated), budget - state.length - 1) - 1
        draft = drafter.propose(history, max(0, min(depth.current, room)), sampler).through_stop(lm.tokenizer.eos_ids)
        rows = [generated[-1]] + draft.tokens
        hidden = model.forward(state, rows)  # one pass: every layer sees all k + 1 rows
        if on_device:
            verdict = accept_greedy(model.greedy_ids(hidden), draft.tokens)
        else:
            values, columns = model.candidates(hidden, top_k, temperature)
            target = process_rows(values, options.sampling, generated, draft.tokens, columns)
            verdict = accept(rule, target, draft, sampler, columns)
        state.keep(verdict.accepted + 1)  # roll back past the last kept row
        last_hidden = hidden[verdict.accepted : verdict.accepted + 1]
        committed = draft.tokens[: verdict.accepted] + [verdict.next_token]
        drafter.commit(committed, hidden[: verdict.accepted + 1])
        depth.update(len(draft.tokens), verdict.accepted)
        stats.record_cycle(len(draft.tokens), verdict.accepted, verdict.lossy)
        if routing is not None:
            stats.record_routes(routing)
        event, reason = emit(committed, Cycle(len(draft.tokens), verdict.accepted, verdict.lossy, rule, route))
        stats.decode_seconds = time.perf_counter() - decode_started
        yield event
        if reason:
            yield finished(reason)
            return


def _finish_reason(stopped: bool, produced: int, max_tokens: int, total: int, budget: int) -> str | None:
    if stopped:
        return "stop"
    if produced >= max_tokens:
        return "length"
    if total >= budget:
        return "context"
    return None

