"""PromptCache: a chat turn continues the states its last reply left instead of prefilling the whole
conversation again, and starts afresh whenever those states are not what a fresh prefill would
build on. On the demo model (trained, so greedy replies have clear margins) and a tiny random one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import add_random_mtp_head, build_reference, save_reference

from duet.engine import GenerateOptions, PromptCache, SamplingParams, Tokens, generate, load_model
from duet.engine.generate import Finished
from duet.engine.speculative import Draft, MTPDrafter

MODELS = Path(__file__).resolve().parents[2] / "models"
QUESTIONS = ["Tell me about the land of Egypt.", "And then?", "Who went with them?"]


@pytest.fixture(scope="module")
def demo():
    return load_model(MODELS / "demo")


def reply(lm, prompt: list[int], options: GenerateOptions, cache: PromptCache | None = None,
          turn_start: int | None = None):
    """(tokens, text, stats) of one reply."""
    events = list(generate(lm, prompt, options, cache=cache, turn_start=turn_start))
    tokens = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
    finished = events[-1]
    assert isinstance(finished, Finished)
    return tokens, "".join(e.text for e in events if isinstance(e, Tokens)), finished.stats


def chat_prompt(lm, chat: list[dict]) -> list[int]:
    return lm.tokenizer.encode(lm.tokenizer.render_chat(chat, add_generation_prompt=True))


@pytest.mark.parametrize("draft", ["mtp", "ngram", "none"])
def test_each_turn_prefills_only_what_the_last_reply_did_not_hold(demo, draft):
    """Three turns through the chat template: from the second on, the prompt's rows up to the end of
    the last reply are reused, and every reply is the one a fresh prefill of the whole conversation
    gives (greedy; the last reply's drafts and rollbacks included)."""
    cache, chat = PromptCache(), []
    options = GenerateOptions(max_tokens=40, draft=draft)
    for turn, question in enumerate(QUESTIONS):
        chat.append({"role": "user", "content": question})
        prompt = chat_prompt(demo, chat)
        held = len(cache.tokens) if cache.state is not None else 0
        tokens, text, stats = reply(demo, prompt, options, cache)
        assert tokens == reply(demo, prompt, options)[0]
        assert stats.cached_tokens == held and (held > 0) == (turn > 0)
        assert prompt[:held] == cache.tokens[:held]
        assert stats.to_dict().get("cached_tokens", 0) == held
        chat.append({"role": "assistant", "content": text})


@pytest.mark.parametrize("draft", ["mtp", "none"])
def test_a_turn_that_renders_the_last_reply_otherwise_continues_from_the_turns_start(demo, draft):
    """A template that rewrites earlier replies (a reasoning model's thinking left out) breaks the
    prompt off inside the held reply: the checkpoint at the end of the message it answered serves,
    and the reply is a fresh prefill's. With the q4 KV cache (its exact rows move on) no checkpoint
    is kept."""
    chat = [{"role": "user", "content": QUESTIONS[0]}]
    opening = len(demo.tokenizer.encode(demo.tokenizer.render_chat(chat, add_generation_prompt=False)))  # to the message end
    for kv, kept in [("bf16", opening), ("q4", 0)]:
        cache, options = PromptCache(), GenerateOptions(max_tokens=24, draft=draft, kv=kv)
        text = reply(demo, chat_prompt(demo, chat), options, cache, turn_start=opening)[1]
        rewritten = chat + [{"role": "assistant", "content": "And " + text}, {"role": "user", "content": QUESTIONS[1]}]
        prompt = chat_prompt(demo, rewritten)
        tokens, _, stats = reply(demo, prompt, options, cache)
        assert stats.cached_tokens == kept and tokens == reply(demo, prompt, options)[0]


def test_a_reply_that_ends_on_an_accepted_stop_token_is_held_with_its_row(demo):
    """Sampled with n-gram drafts, the demo's first reply ends on a stop token the verify pass kept
    as a draft: the state holds every token of the reply, and the next turn still continues it."""
    cache = PromptCache()
    chat = [{"role": "user", "content": QUESTIONS[0]}]
    options = GenerateOptions(max_tokens=40, draft="ngram", sampling=SamplingParams(temperature=0.7, top_k=20, seed=0))
    prompt = chat_prompt(demo, chat)
    tokens, text, stats = reply(demo, prompt, options, cache)
    assert tokens[-1] in demo.tokenizer.eos_ids and cache.tokens == prompt + tokens  # the stop token's row too
    chat += [{"role": "assistant", "content": text}, {"role": "user", "content": QUESTIONS[1]}]
    assert reply(demo, chat_prompt(demo, chat), options, cache)[2].cached_tokens == len(prompt + tokens)


def test_drafts_end_at_a_stop_token():
    draft = Draft([5, 2, 7, 8], [None, None, np.ones(3), None])
    cut = draft.through_stop({0, 2})
    assert cut.tokens == [5, 2] and cut.q == [None, None] and cut.packed is None
    packed = (np.ones((4, 3), np.float32), np.zeros((4, 3), np.int64), np.full(4, 3))
    assert [len(a) for a in Draft(draft.tokens, draft.q, [], packed).through_stop({7}).packed] == [3, 3, 3]
    assert draft.through_stop({9}) is draft


def test_anything_else_starts_afresh(demo):
    """An edited turn, another drafter, KV cache kind, route or model: nothing is reused, and the
    cache lets go of what it held as soon as it is asked."""
    first = chat_prompt(demo, [{"role": "user", "content": QUESTIONS[0]}])
    options = GenerateOptions(max_tokens=12, draft="mtp")

    def held_after(lm=demo) -> PromptCache:
        cache = PromptCache()
        tokens = reply(lm, first, options, cache)[0]
        assert cache.tokens == first + tokens[:-1] and cache.state is not None
        return cache

    def continued(cache, lm, prompt, options) -> int:
        stats = reply(lm, prompt, options, cache)[2]
        return stats.cached_tokens

    cache = held_after()
    follow = cache.tokens + [cache.tokens[-1]] * 3  # any tokens after the held ones
    edited = [first[0] + 1] + follow[1:]
    assert continued(cache, demo, edited, options) == 0
    for change in [dict(draft="none"), dict(kv="q4")]:
        assert continued(held_after(), demo, follow, GenerateOptions(max_tokens=12, **{"draft": "mtp", **change})) == 0
    assert continued(held_after(), load_model(MODELS / "demo"), follow, options) == 0  # another load: other weights
    cache = held_after()
    assert cache.take(follow[: len(cache.tokens)], demo.model, ("bf16", "bf16", "mtp")) is None  # nothing left to prefill
    assert cache.state is None and cache.take(follow, demo.model, ("bf16", "bf16", "mtp")) is None  # let go


def test_a_route_switch_starts_afresh():
    lm = load_model(MODELS / "demo_int4", route="w4a16")
    cache, options = PromptCache(), GenerateOptions(max_tokens=8, draft="ngram")
    prompt = chat_prompt(lm, [{"role": "user", "content": QUESTIONS[0]}])
    reply(lm, prompt, options, cache)
    lm.use_route("w4a8")
    assert reply(lm, cache.tokens + prompt, options, cache)[2].cached_tokens == 0  # rows of w4a16's weights
    held = len(cache.tokens)
    assert reply(lm, cache.tokens + prompt, options, cache)[2].cached_tokens == held  # w4a8's from then on


@pytest.fixture(scope="module")
def mtp_lm(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    ref = build_reference("qwen3_5_text", seed=41, hidden_size=128, intermediate_size=256, head_dim=32,
                          linear_key_head_dim=32, linear_value_head_dim=32)
    save_reference(ref, path)
    add_random_mtp_head(path, ref, seed=42)
    return load_model(path)


def test_held_states_continue_as_a_fresh_prefill_would(mtp_lm):
    """Whatever the reply's cycles rolled back (depth-3 MTP drafts of a random model), the held KV
    caches, DeltaNet and conv states continue to the same hidden states as one prefill of the whole
    sequence, and so does the MTP head's own state."""
    model = mtp_lm.model
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 300, 70)]  # past one 64-row prefill chunk
    cache = PromptCache()
    tokens, _, stats = reply(mtp_lm, prompt, GenerateOptions(max_tokens=24, depth=3, draft="mtp"), cache)
    assert stats.drafted > stats.accepted  # some rows were rolled back
    follow = prompt + tokens + [7, 8, 9]
    state, mtp_state, last_hidden, n = cache.take(follow, model, (mtp_lm.route, "bf16", "mtp"))
    assert n >= len(prompt) + len(tokens) - 1
    continued = model.forward(state, follow[n:])
    fresh = model.forward(model.new_state(), follow)
    scale = np.abs(fresh).max()
    np.testing.assert_allclose(continued, fresh[n:], rtol=0, atol=1e-4 * scale)

    assert_drafter_continues(model, mtp_state, last_hidden, continued, follow, fresh)


def assert_drafter_continues(model, mtp_state, last_hidden, continued, follow, fresh) -> None:
    drafter = MTPDrafter(model)
    drafter.state = mtp_state
    drafter.start(follow, np.concatenate([last_hidden, continued]), first=11)
    again = MTPDrafter(model)
    again.start(follow, fresh, first=11)
    assert drafter.state.length == again.state.length == len(follow)
    np.testing.assert_allclose(drafter.hidden, again.hidden, rtol=0, atol=1e-4 * np.abs(again.hidden).max())


def test_the_turns_checkpoint_brings_the_states_back_as_they_were(mtp_lm):
    """After a reply of depth-3 MTP drafts, the checkpoint at the turn's start restores the KV caches,
    DeltaNet and conv states and the MTP head's state to continue as one prefill of the turn's start
    and what follows it would."""
    model = mtp_lm.model
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 300, 90)]
    cache = PromptCache()
    reply(mtp_lm, prompt, GenerateOptions(max_tokens=24, depth=3, draft="mtp"), cache, turn_start=75)
    follow = prompt[:75] + [5, 6, 7, 8]
    state, mtp_state, last_hidden, n = cache.take(follow, model, (mtp_lm.route, "bf16", "mtp"))
    assert n == 75 and state.length == 75 and mtp_state.length == 74
    continued = model.forward(state, follow[n:])
    fresh = model.forward(model.new_state(), follow)
    np.testing.assert_allclose(continued, fresh[n:], rtol=0, atol=1e-4 * np.abs(fresh).max())
    assert_drafter_continues(model, mtp_state, last_hidden, continued, follow, fresh)
