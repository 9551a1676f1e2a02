"""The generation loop: prefill the prompt, then one cycle per step, one event per cycle.

A cycle commits the tokens the model produced in one pass over the weights; without a drafter that
is one token. Each cycle yields a `Tokens` event carrying the new text and the running stats, and
the loop ends with one `Finished` event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.errors import DuetError
from engine.loader import LoadedModel
from engine.sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class GenerateOptions:
    max_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    context: int | None = None  # token budget for prompt + reply; None: the model's maximum

    def __post_init__(self):
        if self.max_tokens < 1:
            raise DuetError(f"max tokens must be at least 1 (got {self.max_tokens})")
        if self.context is not None and self.context < 2:
            raise DuetError(f"context must be at least 2 tokens (got {self.context})")


@dataclass
class Stats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time after the first token
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    accept_by_position: list[float] = field(default_factory=list)
    n_lossy: int = 0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first (which prefill produced) over the time they took."""
        after_first = self.generated_tokens - 1
        return after_first / self.decode_seconds if after_first > 0 and self.decode_seconds else 0.0

    @property
    def tokens_per_cycle(self) -> float:
        return self.generated_tokens / self.cycles if self.cycles else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

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
            "accept_by_position": list(self.accept_by_position),
            "n_lossy": self.n_lossy,
        }


@dataclass(frozen=True)
class Tokens:
    token_ids: list[int]
    text: str
    stats: Stats


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" (an eos id), "length" (max_tokens), "context" (budget full), "cancelled"
    stats: Stats


def generate(lm: LoadedModel, prompt_ids: list[int], options: GenerateOptions,
             cancel: threading.Event | None = None) -> Iterator[Tokens | Finished]:
    """Generate a reply to `prompt_ids`; stop on any eos id, max_tokens, the context budget or cancel."""
    budget = options.context or lm.config.max_position_embeddings
    if not prompt_ids:
        raise DuetError("the prompt is empty; give some text")
    if len(prompt_ids) >= budget:
        raise DuetError(f"the prompt is {len(prompt_ids)} tokens but the context budget is {budget}; "
                        "shorten the prompt or raise --context")
    model, sampler = lm.model, Sampler(options.sampling)
    decoder = lm.tokenizer.stream_decoder()
    stats = Stats(prompt_tokens=len(prompt_ids))
    state = model.new_state()
    generated: list[int] = []

    started = time.perf_counter()
    logits = model.logits(model.forward(state, prompt_ids)[-1:])[0]
    stats.prefill_seconds = time.perf_counter() - started
    decode_started = time.perf_counter()
    while True:
        token = sampler.pick(logits, generated)
        generated.append(token)
        stats.generated_tokens += 1
        stats.cycles += 1
        stats.decode_seconds = time.perf_counter() - decode_started
        stopped = token in lm.tokenizer.eos_ids
        text = "" if stopped else decoder.push([token])
        yield Tokens([token], text, stats)
        reason = _finish_reason(stopped, len(generated), options.max_tokens, state.length + 1, budget, cancel)
        if reason:
            tail = decoder.flush()
            if tail:
                yield Tokens([], tail, stats)
            yield Finished(reason, stats)
            return
        if stats.generated_tokens == 1:
            decode_started = time.perf_counter()
        logits = model.logits(model.forward(state, [token]))[0]


def _finish_reason(stopped: bool, produced: int, max_tokens: int, next_length: int, budget: int,
                   cancel: threading.Event | None) -> str | None:
    if stopped:
        return "stop"
    if cancel is not None and cancel.is_set():
        return "cancelled"
    if produced >= max_tokens:
        return "length"
    if next_length >= budget:
        return "context"
    return None
