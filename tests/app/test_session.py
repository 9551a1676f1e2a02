"""ChatSession and EngineHost: batching, saving, stop, switches, the context budget and a reply's engine
options, on a tiny real model."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from conftest import build_reference, save_reference

from duet.app.cli import main_parser
from duet.app.session import (
    LOAD_PROGRESS_STEP, ChatSession, ContextFull, EngineChoices, EngineHost, Launch, Readout, ReplyChunk, ReplyDone,
    reply_options, split_thinking,
)
from duet.app.settings import Config, bundled_demo_model
from duet.app.store import Store
from duet.app.ui.widgets.readouts import readout_rows
from duet.engine import Accept, Draft, DuetError, GenerateOptions, KVCache, LoadProgress, Route, load_model


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return load_model(save_reference(build_reference("qwen3_5_text"), tmp_path_factory.mktemp("model") / "tiny"))


@pytest.fixture
def store(tmp_path):
    store = Store(tmp_path / "chats.sqlite3")
    yield store
    store.close()


def new_session(store, lm, budget=4096, system_prompt="") -> ChatSession:
    return ChatSession(store, store.create_conversation("New chat", system_prompt), lm, budget)


def reply(session, options, cancel=None, batch_seconds=0.05):
    return list(session.stream_reply(options, cancel or threading.Event(), batch_seconds))


def test_reply_streams_in_chunks_and_is_saved_whole(store, tiny_lm):
    session = new_session(store, tiny_lm)
    session.add_user_message("the quick brown fox")
    events = reply(session, GenerateOptions(max_tokens=40, draft="none"), batch_seconds=3600)
    chunks, done = events[:-1], events[-1]
    assert all(isinstance(c, ReplyChunk) for c in chunks) and isinstance(done, ReplyDone)
    assert len(chunks) <= 2  # the first token at once, then the rest when the reply ends
    saved = session.messages()[-1]
    assert saved == done.message
    assert saved.content == "".join(c.text for c in chunks)
    assert (saved.role, saved.model, saved.route, saved.accept) == ("assistant", "tiny", "bf16", "exact")
    assert saved.stats["generated_tokens"] == done.readout.generated_tokens <= 40
    assert saved.stats["first_token_s"] == done.readout.first_token_s > 0
    assert saved.finish_reason in ("stop", "length")


def test_first_chunk_carries_the_time_to_first_token(store, tiny_lm):
    session = new_session(store, tiny_lm)
    session.add_user_message("fox")
    first = next(session.stream_reply(GenerateOptions(max_tokens=5, draft="none"), threading.Event()))
    assert isinstance(first, ReplyChunk)
    assert first.readout.generated_tokens == 1 and first.readout.first_token_s > 0


def test_nothing_drafted_means_no_acceptance_figure(store, tiny_lm):
    session = new_session(store, tiny_lm)
    session.add_user_message("fox")
    done = reply(session, GenerateOptions(max_tokens=8, draft="none"))[-1]
    assert done.readout.drafted == 0 and done.readout.acceptance_rate is None


def test_cancel_stops_the_reply_and_keeps_it_marked(store, tiny_lm):
    session = new_session(store, tiny_lm)
    session.add_user_message("the lazy dog")
    cancel = threading.Event()
    events = []
    for event in session.stream_reply(GenerateOptions(max_tokens=3000, draft="none"), cancel, batch_seconds=0):
        events.append(event)
        cancel.set()
    done = events[-1]
    assert done.message.stopped and done.message.finish_reason == "cancelled"
    assert done.readout.generated_tokens < 3000
    assert session.messages()[-1].stopped


def test_the_accept_switch_is_recorded_with_the_reply(store, tiny_lm):
    session = new_session(store, tiny_lm)
    session.add_user_message("fox")
    session.switches.accept = "lossy"
    done = reply(session, GenerateOptions(max_tokens=4, draft="none"))[-1]
    assert done.message.accept == "lossy"


def test_first_message_titles_the_conversation(store, tiny_lm):
    session = new_session(store, tiny_lm)
    session.add_user_message("  what   does the fox say when it jumps over the lazy dog at night?  ")
    assert session.conversation.title == "what does the fox say when it jumps over the la…"
    with pytest.raises(DuetError, match="empty"):
        session.add_user_message("   ")


def test_system_prompt_is_part_of_the_prompt(store, tiny_lm):
    plain, with_system = new_session(store, tiny_lm), new_session(store, tiny_lm, system_prompt="be a fox")
    assert len(with_system.prompt_ids([], "hi")) > len(plain.prompt_ids([], "hi"))


def test_a_second_turn_reuses_the_first_replys_rows_and_the_readout_says_so(store):
    """The demo model's chat template renders a saved reply as its tokens were generated, so the
    next turn's prompt begins with every row the reply left; a regenerated turn reuses the rows up
    to the end of the message it answers (the cache's checkpoint at the turn's start)."""
    session = new_session(store, load_model(bundled_demo_model()))
    options = GenerateOptions(max_tokens=24, draft="mtp")
    session.add_user_message("Tell me about the land of Egypt.")
    first = reply(session, options)[-1]
    assert first.readout.cached_tokens == 0 and "cached_tokens" not in first.message.stats
    session.add_user_message("And then?")
    second = reply(session, options)[-1]
    reused = second.message.stats["cached_tokens"]
    assert reused == second.readout.cached_tokens >= first.readout.prompt_tokens + first.readout.generated_tokens - 1
    assert ("reused", f"{reused:,} tokens") in readout_rows(second.readout)
    assert ("reused", f"{reused:,} tokens") not in readout_rows(Readout.of_saved(first.message.stats))
    session.reopen_last_turn()
    prompt = session.prompt_ids(session.messages())
    before_reply = session.lm.tokenizer.turn_start(session.chat(session.messages()), prompt)
    assert 0 < reply(session, options)[-1].readout.cached_tokens == before_reply < len(prompt)


def test_regenerate_replaces_only_the_reply(store, tiny_lm):
    session = new_session(store, tiny_lm)
    with pytest.raises(DuetError, match="nothing to regenerate"):
        session.reopen_last_turn()
    session.add_user_message("fox")
    reply(session, GenerateOptions(max_tokens=4, draft="none"))
    session.reopen_last_turn()
    assert [m.role for m in session.messages()] == ["user"]
    session.reopen_last_turn()  # a turn whose reply failed can be answered again
    assert [m.role for m in session.messages()] == ["user"]
    reply(session, GenerateOptions(max_tokens=4, draft="none"))
    assert [m.role for m in session.messages()] == ["user", "assistant"]


def test_a_full_context_asks_and_dropping_turns_keeps_them_saved(store, tiny_lm):
    session = new_session(store, tiny_lm, budget=128)
    for words in ("the quick brown fox jumps", "over the lazy dog and", "then runs far away from home"):
        session.check_fits(words)
        session.add_user_message(words)
        store.add_message(session.conversation.id, "assistant", "the fox runs")
    long_text = "in light " * 20
    with pytest.raises(ContextFull) as full:
        session.check_fits(long_text)
    assert full.value.budget == 128 and full.value.needed >= 128
    dropped = session.drop_oldest_turns(long_text)
    assert dropped >= 2
    assert session.check_fits(long_text) <= 64
    messages = session.messages()
    assert len(messages) == 6  # nothing deleted
    assert [m.in_context for m in messages[:dropped]] == [False] * dropped
    with pytest.raises(DuetError, match="longer than the context budget"):
        session.drop_oldest_turns("fox " * 200)


def test_reply_options_follow_the_config_and_the_engine_choices():
    choices = EngineChoices(draft=Draft.NGRAM, depth=3, kv=KVCache.Q4)
    options = reply_options(Config(max_tokens=7, temperature=0.5, top_k=20, seed=-1), 1024, choices, Accept.LOSSY)
    assert (options.max_tokens, options.context, options.accept) == (7, 1024, "lossy")
    assert (options.draft, options.depth, options.kv) == ("ngram", 3, "q4")
    assert options.sampling.temperature == 0.5 and options.sampling.top_k == 20 and options.sampling.seed is None
    assert reply_options(Config(seed=3), 1024, EngineChoices(), Accept.EXACT).sampling.seed == 3


def test_headless_flags_and_the_config_give_the_same_options_for_the_same_settings():
    args = main_parser().parse_args(["--headless", "fox", "--max-tokens", "7", "--temperature", "0.5", "--top-k", "20",
                                     "--presence-penalty", "0.3", "--seed", "4"])
    config = Config(max_tokens=7, temperature=0.5, top_k=20, top_p=1.0, presence_penalty=0.3, seed=4)
    assert reply_options(args, 512, EngineChoices(), Accept.EXACT) == reply_options(config, 512, EngineChoices(), Accept.EXACT)


def test_the_host_loads_with_progress_and_holds_budget_route_and_switches(store, tmp_path_factory):
    folder = save_reference(build_reference("qwen3_5_text"), tmp_path_factory.mktemp("host") / "tiny")
    host = EngineHost(Launch(folder, choices=EngineChoices(draft=Draft.NONE)))
    reports: list[tuple[float, str]] = []
    lm = host.load(folder, Route.AUTO, lambda share, stage: reports.append((share, stage)))
    assert host.lm is None  # loaded in a worker; the UI's thread makes it current
    # The bytes of weights read, then the CPU kernels compiled or loaded from the cache: each stage's
    # shares rise to 1.0, no more often than every LOAD_PROGRESS_STEP.
    order = [LoadProgress.WEIGHTS, LoadProgress.KERNELS]
    assert [stage for _, stage in reports] == sorted((stage for _, stage in reports), key=order.index)
    for stage in (LoadProgress.WEIGHTS, LoadProgress.KERNELS):
        shares = [share for share, at in reports if at == stage]
        assert shares == sorted(shares) and shares[-1] == 1.0 and len(shares) <= 1 / LOAD_PROGRESS_STEP + 1
    host.use(lm)
    assert host.budget == lm.config.max_position_embeddings
    assert host.routes() == ("bf16",) and not host.switch_route("bf16")  # the route it runs already
    host.set_accept(Accept.LOSSY)
    options = host.reply_options(Config(max_tokens=5))
    assert (options.accept, options.draft, options.context) == ("lossy", "none", host.budget)
    session = host.session(store, store.create_conversation().id)
    assert session.switches is host.switches and session.context_budget == host.budget
    assert EngineHost(Launch(folder, context=96)).budget == 96


def test_the_depth_key_reaches_each_drafters_cap_and_a_depth_past_it_is_one_line(store, tmp_path_factory):
    """The depth key cycles auto, 1 .. the cap the engine takes for the drafter chosen (an MTP head 4,
    n-gram 7), a drafter with a lower cap brings a deeper fixed depth down to it, and the settings'
    depth past the cap is refused before a reply: the engine itself takes the cap and refuses one more."""
    from conftest import add_random_mtp_head

    ref = build_reference("qwen3_5_text", seed=5)
    folder = save_reference(ref, tmp_path_factory.mktemp("host") / "mtp")
    add_random_mtp_head(folder, ref, seed=6)
    host = EngineHost(Launch(folder, choices=EngineChoices(draft=Draft.AUTO)))
    host.use(load_model(folder))

    def keyed_depths() -> list[int | None]:
        return [host.next_depth() for _ in range(9)]

    def replies_at(depth: int) -> bool:
        options = dataclasses.replace(host.reply_options(Config(max_tokens=4, temperature=0)), depth=depth)
        session = new_session(store, host.lm)
        session.add_user_message("one two three one two three one two")
        try:
            reply(session, options)
        except DuetError as error:
            assert f"--depth must be between 1 and {depth - 1}" in str(error)
            return False
        return True

    caps = {}
    for draft in (Draft.AUTO, Draft.MTP, Draft.NGRAM):
        host.choices = EngineChoices(draft=draft)
        depths = keyed_depths()
        caps[draft] = cap = max(d for d in depths if d is not None)
        assert depths[: cap + 2] == [*range(1, cap + 1), None, 1]
        assert replies_at(cap) and not replies_at(cap + 1)
    assert caps == {Draft.AUTO: 4, Draft.MTP: 4, Draft.NGRAM: 7}

    host.choices = EngineChoices(draft=Draft.NGRAM, depth=6)
    assert host.next_draft() == Draft.NONE and host.choices.depth == 6  # no drafts: kept, unused
    host.choices = EngineChoices(draft=Draft.MTP, depth=3)
    host.next_draft()
    assert (host.choices.draft, host.choices.depth) == (Draft.NGRAM, 3)
    host.choices = EngineChoices(draft=Draft.NGRAM, depth=7)
    host.next_draft(), host.next_draft()
    assert (host.choices.draft, host.choices.depth) == (Draft.AUTO, 4)
    with pytest.raises(DuetError, match=r"^mtp drafts take a depth of auto or 1 to 4 \(got 7\)$"):
        host.set_engine(EngineChoices(draft=Draft.MTP, depth=7), None)
    assert host.choices.depth == 4  # refused: nothing changed
    host.set_engine(EngineChoices(draft=Draft.NONE, depth=7), None)  # no drafts: depth unused


@pytest.mark.parametrize("text,expected", [
    ("Plain answer", (None, "Plain answer")),
    ("<think>\nweighing it up\n</think>\n\nThe answer", ("weighing it up", "The answer")),
    ("<think>\n\n</think>\n\nThe answer", ("", "The answer")),
    ("<think>\nstill going", ("still going", "")),
    ("\n<think>x</think>y", ("x", "y")),
    ("<thi", (None, "<thi")),
    ("a </think> in the middle is text", (None, "a </think> in the middle is text")),
])
def test_split_thinking_parts_a_reply_into_reasoning_and_answer(text, expected):
    assert split_thinking(text) == expected


def test_while_streaming_a_start_that_may_become_a_think_tag_is_held_back():
    assert split_thinking("<thi", streaming=True) == (None, "")
    assert split_thinking("<tho", streaming=True) == (None, "<tho")


def test_a_template_that_opens_the_think_block_gives_a_reply_saved_with_its_opening_tag(store, tmp_path_factory):
    """Qwen3.5's template ends the prompt inside `<think>\\n`; the reply is saved as the model wrote it there."""
    import json
    folder = save_reference(build_reference("qwen3_5_text"), tmp_path_factory.mktemp("thinking") / "tiny")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = config["chat_template"].replace("{% if enable_thinking", "<think>\n{% if enable_thinking")
    config_path.write_text(json.dumps(config))
    session = new_session(store, load_model(folder))
    session.add_user_message("fox")
    assert session.prompt_text(session.messages()).endswith("<think>\n")
    events = reply(session, GenerateOptions(max_tokens=8, draft="none"))
    saved = session.messages()[-1]
    assert events[0].text.startswith("<think>\n") and saved.content.startswith("<think>\n")
    reasoning, answer = split_thinking(saved.content)
    assert reasoning is not None and "<think>" not in reasoning
