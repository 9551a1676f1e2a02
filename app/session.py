"""ChatSession: one conversation + a loaded model + its chat template -> a stream of reply events;
EngineHost: the loaded model and the engine's settings for a chat UI run.

The UI talks to the engine only through this module. `stream_reply` runs in a worker thread: it
renders the conversation, runs the engine's generator, coalesces its per-cycle events into chunks
at most every `BATCH_SECONDS` (the UI gets a few posted messages a second, never one per token),
and saves the reply when it ends, stopped or not. The context budget is checked before anything is
sent: a conversation that no longer fits raises ContextFull, and the user chooses what to drop.
A reply's engine options are built here (`reply_options`), for the UI and `duet --headless` alike.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from duet.app.settings import FRESH_SEED
from duet.app.store import Conversation, Message, Store
from duet.engine.speculative import MTPDrafter, depth_cap
from duet.engine import (
    Accept, Draft, DuetError, Finished, GenerateOptions, KVCache, LoadedModel, LoadProgress, PromptCache, Route,
    SamplingParams, Stats, Switches, Tokens, generate, load_model,
)

BATCH_SECONDS = 0.05
LOAD_PROGRESS_STEP = 0.02  # report load progress at most every 2% of the bytes
WARN_SHARE = 0.8  # the context meter warns from this share of the budget on
TITLE_CHARS = 48
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SWITCHED = "→"  # a reply whose route or rule was switched while it streamed is saved as "w4a16→w4a8"
DEFAULT_TITLE = "New chat"


class ContextFull(DuetError):
    """The conversation plus the new message does not fit the context budget."""

    def __init__(self, needed: int, budget: int):
        self.needed, self.budget = needed, budget
        super().__init__(f"the conversation needs {needed:,} tokens but the context budget is {budget:,}; "
                         "start a new conversation or drop the oldest turns")


@dataclass(frozen=True)
class Readout:
    """The figures the readout panel shows, copied out of the engine's running stats."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, rows the last reply left (engine.PromptCache): not prefilled again
    generated_tokens: int = 0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    recent_tok_s: float = 0.0  # over the last chunk only: what the sparkline plots
    first_token_s: float | None = None
    tokens_per_cycle: float = 0.0
    drafted: int = 0
    acceptance_rate: float | None = None  # None when nothing was drafted
    accept_by_position: tuple[float, ...] = ()
    n_lossy: int = 0
    expert_hit_rate: float | None = None  # MoE: routes to experts on the card (None: not a MoE)
    host_bytes_per_token: float = 0.0  # expert bytes a token read from host RAM
    n_skipped: int = 0  # routes --moe-skip skipped

    @classmethod
    def of(cls, stats: Stats, recent_tok_s: float, first_token_s: float | None) -> Readout:
        return cls.of_saved(stats.to_dict(), recent_tok_s, first_token_s)

    @classmethod
    def of_saved(cls, stats: dict, recent_tok_s: float | None = None, first_token_s: float | None = None) -> Readout:
        """The readout of running stats (Stats.to_dict) or of a saved reply's stats JSON."""
        drafted = stats.get("drafted", 0)
        return cls(
            prompt_tokens=stats.get("prompt_tokens", 0), cached_tokens=stats.get("cached_tokens", 0),
            generated_tokens=stats.get("generated_tokens", 0),
            prefill_tok_s=stats.get("prefill_tok_s", 0.0), decode_tok_s=stats.get("decode_tok_s", 0.0),
            recent_tok_s=stats.get("decode_tok_s", 0.0) if recent_tok_s is None else recent_tok_s,
            first_token_s=stats.get("first_token_s") if first_token_s is None else first_token_s,
            tokens_per_cycle=stats.get("tokens_per_cycle", 0.0), drafted=drafted,
            acceptance_rate=stats.get("acceptance_rate") if drafted else None,
            accept_by_position=tuple(stats.get("accept_by_position", ())), n_lossy=stats.get("n_lossy", 0),
            expert_hit_rate=stats.get("expert_hit_rate"), host_bytes_per_token=stats.get("host_bytes_per_token", 0.0),
            n_skipped=stats.get("n_skipped", 0),
        )


@dataclass(frozen=True)
class ReplyChunk:
    """New reply text since the previous chunk, and the figures so far."""

    text: str
    readout: Readout


@dataclass(frozen=True)
class ReplyDone:
    """The reply ended (finish_reason stop, length, context or cancelled) and is saved as `message`."""

    message: Message
    readout: Readout


@dataclass
class ChatSession:
    """A conversation with a loaded model. `switches` may be flipped while a reply streams."""

    store: Store
    conversation: Conversation
    lm: LoadedModel
    context_budget: int
    switches: Switches = field(default_factory=Switches)
    prompt_cache: PromptCache = field(default_factory=PromptCache)  # the last reply's states, for the next turn

    @property
    def route(self) -> str:
        return self.lm.route

    def messages(self) -> list[Message]:
        return self.store.messages(self.conversation.id)

    def refresh(self) -> None:
        self.conversation = self.store.conversation(self.conversation.id)

    # ---- context ----

    def chat(self, messages: list[Message], new_text: str | None = None) -> list[dict]:
        """The in-context messages (and a message about to be sent) as the chat template takes them."""
        chat = [{"role": "system", "content": self.conversation.system_prompt}] if self.conversation.system_prompt else []
        chat += [{"role": m.role, "content": m.content} for m in messages if m.in_context]
        if new_text is not None:
            chat.append({"role": "user", "content": new_text})
        return chat

    def prompt_text(self, messages: list[Message], new_text: str | None = None) -> str:
        """The chat template rendered over chat(messages, new_text), with the reply's opening."""
        return self.lm.tokenizer.render_chat(self.chat(messages, new_text), add_generation_prompt=True)

    def prompt_ids(self, messages: list[Message], new_text: str | None = None) -> list[int]:
        return self.lm.tokenizer.encode(self.prompt_text(messages, new_text))

    def context_used(self) -> int:
        return len(self.prompt_ids(self.messages()))

    def check_fits(self, text: str) -> int:
        """Tokens the prompt with `text` needs; raises ContextFull when that leaves no room to reply."""
        needed = len(self.prompt_ids(self.messages(), text))
        if needed >= self.context_budget:
            raise ContextFull(needed, self.context_budget)
        return needed

    def drop_oldest_turns(self, text: str) -> int:
        """Leave the oldest turns out of the context until `text` fits in half the budget; returns how many."""
        messages = [m for m in self.messages() if m.in_context]
        dropped: list[int] = []
        while messages and len(self.prompt_ids(messages, text)) > self.context_budget // 2:
            turn = _oldest_turn(messages)
            dropped += [m.id for m in turn]
            messages = messages[len(turn):]
        if len(self.prompt_ids(messages, text)) >= self.context_budget:
            raise DuetError("this message alone is longer than the context budget; shorten it")
        self.store.drop_from_context(dropped)
        return len(dropped)

    # ---- sending ----

    def add_user_message(self, text: str) -> Message:
        """Save the user's message (after check_fits); the first one also titles the conversation."""
        text = text.strip()
        if not text:
            raise DuetError("the message is empty; type something first")
        if self.conversation.title == DEFAULT_TITLE and not self.messages():
            self.store.rename(self.conversation.id, _title_from(text))
            self.refresh()
        return self.store.add_message(self.conversation.id, "user", text)

    def reopen_last_turn(self) -> None:
        """Delete the last reply, if any, so the last user message can be answered again."""
        messages = self.messages()
        if messages and messages[-1].role == "assistant":
            self.store.delete_message(messages.pop().id)
        if not messages:
            raise DuetError("there is nothing to regenerate; send a message first")

    def stream_reply(self, options: GenerateOptions, cancel: threading.Event,
                     batch_seconds: float = BATCH_SECONDS) -> Iterator[ReplyChunk | ReplyDone]:
        """Reply to the conversation as it is saved; run in a worker thread. Saves the reply at the end."""
        messages = self.messages()
        if not messages or messages[-1].role != "user":
            raise DuetError("the conversation does not end with a message to answer")
        prompt = self.prompt_text(messages)
        prompt_ids = self.lm.tokenizer.encode(prompt)
        turn_start = self.lm.tokenizer.turn_start(self.chat(messages), prompt_ids)  # the cache keeps the state there too
        started = time.perf_counter()
        # A template that opens the think block in the prompt: the reply starts inside it, so it
        # is saved (and shown) with its opening tag, as a model that opens the block itself writes it.
        opened = THINK_OPEN + "\n" if prompt.rstrip().endswith(THINK_OPEN) else ""
        batcher = _Batcher(started, batch_seconds, opened)
        for event in generate(self.lm, prompt_ids, options, cancel=cancel, switches=self.switches, cache=self.prompt_cache,
                              turn_start=turn_start):
            if isinstance(event, Tokens):
                chunk = batcher.add(event)
                if chunk:
                    yield chunk
            elif isinstance(event, Finished):
                if batcher.pending:
                    yield batcher.flush(event.stats)
                yield ReplyDone(self._save_reply(batcher, event), batcher.readout(event.stats))

    def _save_reply(self, batcher: _Batcher, finished: Finished) -> Message:
        stats = finished.stats.to_dict() | {"first_token_s": batcher.first_token_s, "drafter": finished.drafter}
        return self.store.add_message(
            self.conversation.id, "assistant", "".join(batcher.text), model=self.lm.name,
            route=SWITCHED.join(finished.stats.routes) or self.route,
            accept=SWITCHED.join(finished.stats.rules) or self.switches.accept, stats=stats, finish_reason=finished.finish_reason)


@dataclass(frozen=True)
class EngineChoices:
    """What the command line chose for the engine this run (`--draft`, `--depth`, `--kv`, `--host-tables`,
    `--moe-skip`)."""

    draft: Draft = Draft.AUTO
    depth: int | None = None
    kv: KVCache = KVCache.BF16
    host_tables: bool = False
    moe_skip: float = 0.0  # lossy: skipped in exact replies (engine/experts.py)


@dataclass(frozen=True)
class Launch:
    """What a chat UI run starts with: the model, its route, the context budget and the engine choices."""

    model_path: Path
    route: Route = Route.AUTO
    context: int | None = None
    choices: EngineChoices = field(default_factory=EngineChoices)
    accept: Accept = Accept.EXACT


class ReplySettings(Protocol):
    """How a reply samples and how long it may run: the config's reply defaults, or `duet --headless`'s flags."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    seed: int | None  # None or FRESH_SEED: a fresh seed each reply


def sampling_params(settings: ReplySettings) -> SamplingParams:
    """The sampler of a reply; raises DuetError naming a bad value."""
    return SamplingParams(
        temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p, min_p=settings.min_p,
        repetition_penalty=settings.repetition_penalty, presence_penalty=settings.presence_penalty,
        seed=None if settings.seed in (None, FRESH_SEED) else settings.seed)


def reply_options(settings: ReplySettings, context: int | None, choices: EngineChoices, accept: Accept) -> GenerateOptions:
    """Engine options for a reply from the user's settings and this run's engine choices."""
    return GenerateOptions(max_tokens=settings.max_tokens, sampling=sampling_params(settings), context=context,
                           draft=choices.draft, depth=choices.depth, kv=choices.kv, accept=accept,
                           moe_skip=choices.moe_skip if accept == Accept.LOSSY else 0.0)


class EngineHost:
    """The engine for a chat UI run: the loaded model, its route, the context budget and the switches.

    The chat screen talks to the engine through this. `load` runs in a worker thread and returns the
    model; `use` makes it current on the UI's thread, so a later choice of model can supersede one
    still loading. `switches` is shared by every session: the engine reads it at each cycle.
    """

    def __init__(self, launch: Launch):
        self.launch = launch
        self.switches = Switches(launch.accept)
        self.choices = launch.choices  # the next reply's drafts, depth and KV cache: the command line's, then the keys'
        self.context = launch.context  # the context budget; None: the model's longest
        self.lm: LoadedModel | None = None

    def load(self, path: Path, route: Route, report_share: Callable[[float, str], None]) -> LoadedModel:
        """Load a model, reporting (share done, stage) at most every LOAD_PROGRESS_STEP of a stage: the
        bytes of weights read, then the CPU kernels compiled or loaded (LoadProgress's stages)."""
        return load_model(path, progress=_throttled(report_share), route=route, host_tables=self.choices.host_tables)

    def use(self, lm: LoadedModel) -> None:
        self.lm = lm
        self.switches.route = None  # a new model runs its own route until switched

    @property
    def budget(self) -> int:
        """Tokens of prompt and reply: --context (or the settings'), else the model's longest."""
        return self.context or self.lm.config.max_position_embeddings

    def routes(self) -> tuple[Route, ...]:
        """Routes the loaded checkpoint can run, the one it runs first."""
        return tuple(Route(route) for route in (self.lm.route, *(r for r in self.lm.routes if r != self.lm.route)))

    def switch_route(self, route: Route) -> bool:
        """Run `route` from the start of the engine's next pass (no reload); False when it runs already."""
        if self.lm is None or route == (self.switches.route or self.lm.route):
            return False
        self.switches.route = route
        return True

    def set_accept(self, accept: Accept) -> None:
        self.switches.accept = accept  # read at the next cycle

    def session(self, store: Store, conversation_id: int) -> ChatSession:
        return ChatSession(store, store.conversation(conversation_id), self.lm, self.budget, self.switches)

    def reply_options(self, settings: ReplySettings) -> GenerateOptions:
        return reply_options(settings, self.budget, self.choices, self.switches.accept)

    def next_draft(self) -> Draft:
        """The next drafter for the following replies: auto, mtp (with an MTP head), ngram, none. A fixed
        depth past the new drafter's cap comes down to it (no drafts keep it, unused)."""
        kinds = [d for d in Draft if d != Draft.MTP or (self.lm is not None and self.lm.model.mtp is not None)]
        draft = kinds[(kinds.index(self.choices.draft) + 1) % len(kinds)] if self.choices.draft in kinds else Draft.AUTO
        depth, cap = self.choices.depth, self.depth_cap(draft)
        return self._choose(draft=draft, depth=min(depth, cap) if depth is not None and cap else depth).draft

    def next_depth(self) -> int | None:
        """Drafts a cycle for the following replies: adaptive (None), then 1 to the drafter's cap."""
        depth, cap = self.choices.depth, self.depth_cap(self.choices.draft)
        return self._choose(depth=1 if depth is None and cap else None if depth is None or depth >= cap else depth + 1).depth

    def depth_cap(self, draft: Draft) -> int:
        """Most drafts a cycle `draft` can ask for; before a model is loaded, an MTP head's."""
        return depth_cap(draft, self.lm.model) if self.lm is not None else MTPDrafter.depth_cap

    def next_kv(self) -> KVCache:
        """The following replies' KV cache: each type the engine runs, in turn."""
        kinds = [kv for kv in KVCache if kv.runs]
        return self._choose(kv=kinds[(kinds.index(self.choices.kv) + 1) % len(kinds)]).kv

    def set_engine(self, choices: EngineChoices, context: int | None) -> bool:
        """The settings dialog's drafts, depth, KV cache and context budget, from the next reply. Host
        tables change how the head is built, so they wait for a reload (use_host_tables): True when
        `choices` asks for other host tables than the model has."""
        if context is not None and self.lm is not None and not 2 <= context <= self.lm.config.max_position_embeddings:
            raise DuetError(f"the context budget must be from 2 to {self.lm.config.max_position_embeddings:,} tokens "
                            f"(got {context:,})")
        cap = self.depth_cap(choices.draft)
        if choices.depth is not None and cap and not 1 <= choices.depth <= cap:  # no drafts: depth unused
            raise DuetError(f"{choices.draft} drafts take a depth of auto or 1 to {cap} (got {choices.depth})")
        self.choices = dataclasses.replace(choices, host_tables=self.choices.host_tables)
        self.context = context
        return choices.host_tables != self.choices.host_tables

    def use_host_tables(self, host_tables: bool) -> None:
        """For the next load (the caller reloads the model)."""
        self.choices = dataclasses.replace(self.choices, host_tables=host_tables)

    def _choose(self, **change) -> EngineChoices:
        self.choices = dataclasses.replace(self.choices, **change)
        return self.choices


def _throttled(report_share: Callable[[float, str], None]) -> Callable[[LoadProgress], None]:
    """A load-progress callback that reports (share done, stage), at most every LOAD_PROGRESS_STEP of a stage."""
    last, stage = -1.0, None

    def progress(p: LoadProgress) -> None:
        nonlocal last, stage
        share = p.done_bytes / p.total_bytes if p.total_bytes else 1.0
        if p.stage != stage or share - last >= LOAD_PROGRESS_STEP or share >= 1.0:
            last, stage = share, p.stage
            report_share(share, p.stage)

    return progress


class _Batcher:
    """Coalesces per-cycle events into chunks no more often than every `batch_seconds`."""

    def __init__(self, started: float, batch_seconds: float, opening: str = ""):
        self.started, self.batch_seconds = started, batch_seconds
        self.text: list[str] = [opening]  # the reply as saved
        self.pending: list[str] = [opening]  # not yet sent to the UI
        self.first_token_s: float | None = None
        self._last_time, self._last_tokens, self._recent_tok_s = started, 0, 0.0

    def add(self, event: Tokens) -> ReplyChunk | None:
        now = time.perf_counter()
        self.text.append(event.text)
        self.pending.append(event.text)
        if self.first_token_s is None:  # the first token goes out at once: it is the time to first token
            self.first_token_s = now - self.started
            self._last_time, self._last_tokens = now, event.stats.generated_tokens
            return self.flush(event.stats)
        if now - self._last_time < self.batch_seconds:
            return None
        self._recent_tok_s = (event.stats.generated_tokens - self._last_tokens) / (now - self._last_time)
        self._last_time, self._last_tokens = now, event.stats.generated_tokens
        return self.flush(event.stats)

    def flush(self, stats: Stats) -> ReplyChunk:
        text, self.pending = "".join(self.pending), []
        return ReplyChunk(text, self.readout(stats))

    def readout(self, stats: Stats) -> Readout:
        return Readout.of(stats, self._recent_tok_s, self.first_token_s)


def split_thinking(text: str, streaming: bool = False) -> tuple[str | None, str]:
    """(reasoning, answer) of a reply; reasoning is None when the reply has no <think> block.

    While the block is still open, everything so far is reasoning. While streaming, a start that
    may yet become `<think>` is held back.
    """
    stripped = text.lstrip()
    if not stripped.startswith(THINK_OPEN):
        undecided = streaming and stripped and THINK_OPEN.startswith(stripped)
        return (None, "") if undecided else (None, text)
    reasoning, closed, answer = stripped[len(THINK_OPEN):].partition(THINK_CLOSE)
    return reasoning.strip(), answer.lstrip() if closed else ""


def _oldest_turn(messages: list[Message]) -> list[Message]:
    """The first message and the replies that follow it, up to the next user message."""
    end = 1
    while end < len(messages) and messages[end].role == "assistant":
        end += 1
    return messages[:end]


def _title_from(text: str) -> str:
    words = " ".join(text.split())
    return words if len(words) <= TITLE_CHARS else words[: TITLE_CHARS - 1].rstrip() + "…"
