"""The context budget and max_tokens reached in the middle of a cycle whose drafts would overrun them.

The rule (engine/generate.py): prompt + reply never exceed the budget. A reply that reaches it ends
with finish_reason "context" after exactly budget - prompt tokens; one that reaches max_tokens first
ends with "length" after exactly max_tokens. A cycle near either limit drafts only as deep as the
room left, so nothing accepted is dropped and nothing past the limit is emitted, and no cache ever
holds a row past the budget. The independent reference is a greedy run without drafts, whose greedy
output speculative decoding must reproduce token for token (DESIGN.md, Acceptance).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import add_random_mtp_head, build_reference, save_reference

from duet.engine import Finished, GenerateOptions, Tokens, generate, load_model
from duet.engine.speculative import Draft, MTPDrafter, NgramDrafter, NoDrafter

PROMPT = [int(t) for t in np.random.default_rng(8).integers(0, 300, 25)]
DEPTH = 4  # a full cycle commits DEPTH + 1 tokens


@pytest.fixture(scope="module")
def endless_mtp(tmp_path_factory):
    """A tiny model with an MTP head and no eos token: every reply runs until a limit stops it."""
    path = tmp_path_factory.mktemp("endless-mtp")
    ref = build_reference("qwen3_5_text", seed=23)
    save_reference(ref, path)
    add_random_mtp_head(path, ref, seed=24)
    tok_config = path / "tokenizer_config.json"
    tok_config.write_text(json.dumps({k: v for k, v in json.loads(tok_config.read_text()).items() if k != "eos_token"}))
    return path


@pytest.fixture(scope="module")
def lm(endless_mtp):
    return load_model(endless_mtp)


@pytest.fixture(scope="module")
def truth(lm):
    """The greedy reply without drafts, longer than any limit below: the reference."""
    tokens, finished, _ = run(lm, PROMPT, GenerateOptions(max_tokens=48, draft="none"))
    assert finished.finish_reason == "length" and len(tokens) == 48
    return tokens


class Oracle(NoDrafter):
    """Proposes the true continuation, as deep as asked: every draft is accepted, and near a limit
    it would happily propose tokens past it (the truth runs on)."""

    name = "oracle"
    depth_cap = 7

    def __init__(self, truth: list[int]):
        self.truth = truth

    def propose(self, history, k, sampler):
        done = len(history) - len(PROMPT)
        follow = self.truth[done: done + k]
        return Draft(follow, [None] * len(follow))


class RowWatch:
    """The most rows the main model's state and the MTP head's state ever held, read after every
    forward of either (drafted rows included, before they are rolled back)."""

    def __init__(self, model, monkeypatch):
        self.main = self.mtp = 0
        forward, mtp_forward = model.forward, model.mtp_forward

        def watched_forward(state, *args, **kwargs):
            out = forward(state, *args, **kwargs)
            self.main = max(self.main, state.length, *(getattr(c, "length", 0) for c in state.layers))
            return out

        def watched_mtp_forward(state, *args, **kwargs):
            out = mtp_forward(state, *args, **kwargs)
            self.mtp = max(self.mtp, state.length)
            return out

        monkeypatch.setattr(model, "forward", watched_forward)
        monkeypatch.setattr(model, "mtp_forward", watched_mtp_forward)


def run(lm, prompt, options, drafter=None):
    tokens, cycles, finished = [], [], None
    for event in generate(lm, prompt, options, drafter=drafter):
        if isinstance(event, Tokens):
            assert finished is None
            tokens.extend(event.token_ids)
            if event.cycle is not None:
                cycles.append(event.cycle)
                assert len(event.token_ids) == event.cycle.accepted + 1  # every kept draft plus one, none dropped
        else:
            assert isinstance(event, Finished)
            finished = event
    return tokens, finished, cycles


def depths_allowed(cycles, reply_tokens: int, depth: int) -> list[int]:
    """Per cycle, the drafts that fit: as deep as asked, but never more than the tokens left minus one."""
    allowed, left = [], reply_tokens - 1  # the first token came from prefill
    for cycle in cycles:
        allowed.append(min(depth, left - 1))
        left -= cycle.accepted + 1
    return allowed


def check_stats(finished, tokens, cycles):
    stats = finished.stats
    assert stats.generated_tokens == len(tokens)
    assert stats.prompt_tokens == len(PROMPT)
    assert stats.cycles == len(cycles)
    assert stats.drafted == sum(c.drafted for c in cycles) and stats.accepted == sum(c.accepted for c in cycles)
    assert 0 <= stats.accepted <= stats.drafted
    assert 1 + sum(c.accepted + 1 for c in cycles) == len(tokens)  # prefill's token, then each cycle's
    assert stats.tokens_per_cycle == pytest.approx((len(tokens) - 1) / len(cycles))
    assert stats.to_dict()["tokens_per_cycle"] == round((len(tokens) - 1) / len(cycles), 4)


# Room after the first token is budget - prompt - 1. Full cycles commit 5 each; the remainders 1..4
# leave a last cycle that must draft 0..3 instead of 4; 0 ends exactly on a full cycle.
@pytest.mark.parametrize("reply_tokens", [21, 22, 23, 24, 25])
def test_the_budget_reached_mid_cycle_with_accepted_drafts_ends_exactly_at_the_budget(lm, truth, monkeypatch, reply_tokens):
    budget = len(PROMPT) + reply_tokens
    watch = RowWatch(lm.model, monkeypatch)
    tokens, finished, cycles = run(lm, PROMPT, GenerateOptions(max_tokens=1000, context=budget, depth=DEPTH),
                                   drafter=Oracle(truth))
    assert finished.finish_reason == "context"
    assert len(tokens) == budget - len(PROMPT)
    assert tokens == truth[: len(tokens)]
    assert watch.main <= budget
    check_stats(finished, tokens, cycles)
    assert all(c.accepted == c.drafted for c in cycles)
    assert [c.drafted for c in cycles] == depths_allowed(cycles, reply_tokens, DEPTH)
    last = (reply_tokens - 1) % (DEPTH + 1)
    assert cycles[-1].drafted == (last - 1 if last else DEPTH)  # 4 drafts would have overrun: they were cut


@pytest.mark.parametrize("max_tokens", [10, 12, 13, 16])
def test_max_tokens_reached_mid_cycle_emits_exactly_max_tokens(lm, truth, monkeypatch, max_tokens):
    watch = RowWatch(lm.model, monkeypatch)
    tokens, finished, cycles = run(lm, PROMPT, GenerateOptions(max_tokens=max_tokens, depth=DEPTH), drafter=Oracle(truth))
    assert finished.finish_reason == "length"
    assert tokens == truth[:max_tokens]
    assert watch.main < len(PROMPT) + max_tokens  # the last token is emitted, never run
    check_stats(finished, tokens, cycles)
    assert [c.drafted for c in cycles] == depths_allowed(cycles, max_tokens, DEPTH)


def test_the_limit_that_comes_first_names_the_finish(lm, truth):
    budget = len(PROMPT) + 17
    tokens, finished, _ = run(lm, PROMPT, GenerateOptions(max_tokens=14, context=budget, depth=DEPTH), drafter=Oracle(truth))
    assert (finished.finish_reason, tokens) == ("length", truth[:14])
    tokens, finished, _ = run(lm, PROMPT, GenerateOptions(max_tokens=20, context=budget, depth=DEPTH), drafter=Oracle(truth))
    assert (finished.finish_reason, tokens) == ("context", truth[:17])
    tokens, finished, _ = run(lm, PROMPT, GenerateOptions(max_tokens=17, context=budget, depth=DEPTH), drafter=Oracle(truth))
    assert (finished.finish_reason, tokens) == ("length", truth[:17])  # both at once: max_tokens is what the user set


@pytest.mark.parametrize("draft", ["mtp", "ngram"])
@pytest.mark.parametrize("depth", [3, 4])
def test_real_drafters_stop_at_the_budget_with_the_greedy_prefix(lm, truth, monkeypatch, draft, depth):
    budget = len(PROMPT) + 23
    watch = RowWatch(lm.model, monkeypatch)
    drafter = MTPDrafter(lm.model) if draft == "mtp" else NgramDrafter()
    tokens, finished, cycles = run(lm, PROMPT, GenerateOptions(max_tokens=1000, context=budget, depth=depth, draft=draft),
                                   drafter=drafter)
    assert (finished.finish_reason, finished.drafter) == ("context", draft)
    assert tokens == truth[: budget - len(PROMPT)]
    assert watch.main <= budget and watch.mtp <= budget
    check_stats(finished, tokens, cycles)
    allowed = depths_allowed(cycles, len(tokens), depth)
    if draft == "mtp":  # MTP drafts as deep as allowed, whatever it guesses
        assert [c.drafted for c in cycles] == allowed and cycles[-1].drafted < depth
        assert drafter.state.length == budget - 1  # one row per committed position, drafts rolled back
    else:  # prompt lookup drafts what it finds, up to what is allowed
        assert all(c.drafted <= a for c, a in zip(cycles, allowed))


def test_a_prompt_one_short_of_the_budget_gets_one_token(lm, truth):
    tokens, finished, cycles = run(lm, PROMPT, GenerateOptions(context=len(PROMPT) + 1, depth=DEPTH), drafter=Oracle(truth))
    assert (finished.finish_reason, tokens, cycles) == ("context", truth[:1], [])


def test_headless_json_reports_the_context_finish(capsys, endless_mtp):
    from duet.app.cli import main

    def headless(*args):
        capsys.readouterr()
        assert main(["--headless", "fox jumps over the lazy dog", "--raw", "--model", str(endless_mtp), "--json", *args]) == 0
        return json.loads(capsys.readouterr().out)

    budget = 40
    result = headless("--context", str(budget), "--draft", "mtp", "--depth", "4", "--max-tokens", "1000")
    prompt_tokens = result["stats"]["prompt_tokens"]
    assert result["finish_reason"] == "context"
    assert len(result["tokens"]) == result["stats"]["generated_tokens"] == budget - prompt_tokens
    reference = headless("--draft", "none", "--max-tokens", str(budget - prompt_tokens))
    assert reference["finish_reason"] == "length"
    assert result["tokens"] == reference["tokens"] and result["text"] == reference["text"]
    stats = result["stats"]
    assert stats["drafted"] > 0 and 0 <= stats["accepted"] <= stats["drafted"]
    assert stats["tokens_per_cycle"] == round((stats["generated_tokens"] - 1) / stats["cycles"], 4)
