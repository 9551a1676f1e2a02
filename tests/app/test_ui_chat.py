"""The chat screen under Textual's Pilot, on a tiny real model: send, stream, stop, switches, context."""

from __future__ import annotations

import json
import threading

import pytest
from pilot_wait import pace, record_notices, wait_for
from textual.widgets import Collapsible, Input, Label, Markdown, Select, Static, Switch

from duet.app import session as session_module
from duet.app.settings import Config, load_config, user_paths
from duet.app.store import Store
from duet.app.session import EngineChoices, Launch
from duet.app.ui.app import DuetApp
from duet.app.ui.screens.chat import ChatScreen
from duet.app.ui.screens.dialogs import CodeBlockPicker, Confirm, ContextFullChoice, ExportChoice, ReplySettings, TextPrompt
from duet.app.ui.widgets.conversation_list import ConversationList
from duet.app.ui.widgets.message_view import MessageView
from duet.app.ui.widgets.readouts import ContextMeter

SIZE = (140, 40)
pytestmark = pytest.mark.anyio


@pytest.fixture
def make_app(tmp_path, monkeypatch, tiny_model):
    monkeypatch.setenv("DUET_HOME", str(tmp_path / "home"))

    def make(config: Config | None = None, context: int | None = None, model=None) -> DuetApp:
        launch = Launch(model or tiny_model, context=context, choices=EngineChoices(draft="none"))
        app = DuetApp(user_paths(), config or Config(max_tokens=12), launch)
        app.notices = record_notices(app)
        return app

    return make


def last_note(app):
    return app.notices[-1]


def chat(app) -> ChatScreen:
    return app.screen if isinstance(app.screen, ChatScreen) else next(s for s in app.screen_stack if isinstance(s, ChatScreen))


async def loaded(pilot) -> ChatScreen:
    screen = chat(pilot.app)
    await wait_for(pilot, lambda: screen.host.lm is not None)
    return screen


def replies_shown(screen) -> int:
    return sum(1 for view in screen.query(MessageView) if view.role == "assistant" and view.message is not None)


async def send(pilot, text: str) -> ChatScreen:
    """Type a message, press Enter, and wait until its reply is saved and shown."""
    screen = await loaded(pilot)
    before = replies_shown(screen)
    screen.query_one("#prompt", Input).value = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: replies_shown(screen) > before and not screen.streaming)
    return screen


async def start_streaming(pilot, text: str = "the lazy dog") -> ChatScreen:
    """Send a message and return once its reply has started streaming, paced to last past the test's keys."""
    screen = await loaded(pilot)
    pace(screen.host.lm)
    screen.query_one("#prompt", Input).value = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: screen.streaming and screen.reply_view.text)
    return screen


def saved_messages(app):
    store = Store(app.paths.database)
    conversations = store.conversations()
    messages = store.messages(conversations[0].id) if conversations else []
    store.close()
    return messages


async def test_loading_shows_the_model_and_empty_readouts(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await loaded(pilot)
        await pilot.pause()
        assert not screen.query_one("#loading").display
        assert "tiny" in str(screen.query_one("#model-name", Label).render())
        figures = str(screen.query_one("#figures").render())
        assert "decode" in figures and "acceptance" in figures and "—" in figures


async def test_loading_says_when_it_prepares_the_cpu_kernels(make_app, monkeypatch):
    """After the weights, a load compiles the CPU kernels (a machine's first run) or loads them from the
    cache; while that runs the header says so in words."""
    from duet.engine.backend import compiled

    release = threading.Event()
    real = compiled.compile_kernels

    def first_run(report=None, **kernels):
        report(1, 5)
        release.wait(10)
        real(report, **kernels)

    monkeypatch.setattr(compiled, "compile_kernels", first_run)
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = chat(app)
        name = screen.query_one("#model-name", Label)
        await wait_for(pilot, lambda: "preparing CPU kernels" in str(name.render()))
        assert screen.query_one("#loading").display
        release.set()
        await loaded(pilot)
        assert "tiny" in str(name.render()) and not screen.query_one("#loading").display


async def test_a_model_that_fails_to_load_is_one_notification(make_app, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    app = make_app(model=broken)
    async with app.run_test(size=SIZE) as pilot:
        screen = chat(app)
        await wait_for(pilot, lambda: any("Could not load" in (n.title or "") for n in app.notices))
        (note,) = [n for n in app.notices if n.title == "Could not load the model"]
        assert "config.json" in note.message and "\n" not in note.message
        screen.query_one("#prompt", Input).value = "hello"
        await pilot.press("enter")
        await pilot.pause()
        assert saved_messages(app) == []


async def test_send_streams_a_reply_and_saves_both_messages(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "the quick brown fox")
        views = list(screen.query(MessageView))
        assert [v.role for v in views] == ["user", "assistant"]
        user, reply = saved_messages(app)
        assert user.content == "the quick brown fox"
        assert reply.content == views[1].text
        assert (reply.model, reply.route, reply.accept) == ("tiny", "bf16", "exact")
        assert reply.stats["generated_tokens"] > 0 and "decode_tok_s" in reply.stats
        assert "tok/s" in views[1].border_title
        assert "tok/s" in str(screen.query_one("#figures").render())
        assert "experts" not in str(screen.query_one("#figures").render())  # not a MoE model
        titles = [str(item.query_one(Label).render()) for item in screen.query_one(ConversationList).children]
        assert titles == ["the quick brown fox"]
        used = screen.session.context_used()
        assert f"{used:,} / 4,096" in str(screen.query_one("#context-label", Label).render())
        assert screen.query_one("#prompt", Input).value == ""


@pytest.fixture
def paced(monkeypatch):
    """The app's engine held by the test between events (PacedEngine)."""
    engine = PacedEngine(session_module.generate)
    monkeypatch.setattr(session_module, "generate", engine)
    return engine


class PacedEngine:
    """The engine's event stream, let through a counted number of events at a time.

    `generate` is a generator: while its consumer (the reply worker) waits here, the engine computes
    nothing, so a test can press keys "while a reply streams" on any machine, however fast."""

    def __init__(self, generate):
        self.generate, self.allowed, self.passed = generate, 1, 0
        self.changed = threading.Condition()

    def __call__(self, *args, **kwargs):
        for event in self.generate(*args, **kwargs):
            with self.changed:
                self.changed.wait_for(lambda: self.passed < self.allowed, timeout=30)
                self.passed += 1
            yield event

    def allow(self, events: int) -> None:
        with self.changed:
            self.allowed += events
            self.changed.notify_all()

    @property
    def held(self) -> bool:
        return self.passed == self.allowed

    async def send(self, pilot, screen, text: str) -> None:
        """Send `text`; return once its paced reply shows text."""
        screen.query_one("#prompt", Input).value = text
        await pilot.press("enter")
        await self.until_shown(pilot, screen)

    async def until_shown(self, pilot, screen) -> None:
        """One cycle at a time until the reply shows text (a token can be part of a character)."""
        for _ in range(100):
            await wait_for(pilot, lambda: self.held)
            await pilot.pause(0.05)
            if screen.streaming and screen.reply_view.text:
                return
            self.allow(1)
        raise AssertionError("the reply showed no text in 100 cycles")


async def test_at_80_columns_the_panels_fold_and_the_readout_takes_one_line_of_words(make_app):
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await send(pilot, "the quick brown fox")
        line = screen.query_one("#readout-line", Label)
        assert not screen.query_one(ConversationList).display and not screen.query_one("#panel").display
        assert line.display and screen.query_one("#chat").size.width >= 60
        words = str(line.render())
        assert "tok/s" in words and "bf16" in words and "exact" in words and "ctx " in words
        assert screen.query(MessageView).last().content_region.width >= 60  # a reply line holds 60 characters
        await pilot.press("ctrl+t")
        assert "lossy" in str(line.render())
        await pilot.press("f4")  # the panel back, the one-line readout gone
        assert screen.query_one("#panel").display and not line.display
        assert "accept: lossy" in str(screen.query_one("#accept-label", Label).render())
        await pilot.press("f4", "ctrl+b")
        assert not screen.query_one("#panel").display and screen.query_one(ConversationList).display
        await pilot.resize_terminal(140, 40)  # wide again: both panels back
        await pilot.pause()
        assert screen.query_one("#panel").display and screen.query_one(ConversationList).display and not line.display


async def test_every_engine_choice_is_on_a_key_and_shown_in_words(make_app, tiny_model, tmp_path):
    """F5 route, F6 drafts, F7 depth, F9 KV cache: taken from the next reply (no reload), said in the
    panel and the one-line readout."""
    from duet.app.cli import main

    app = make_app()  # drafts none, as make_app launches
    async with app.run_test(size=SIZE) as pilot:
        screen = await loaded(pilot)
        choices = lambda: str(screen.query_one("#engine-choices", Label).render())  # noqa: E731
        assert choices() == "drafts: none\ndepth: auto\nKV cache: bf16"
        await pilot.press("f6", "f7", "f9")  # no MTP head here: none -> auto
        assert choices() == "drafts: auto\ndepth: 1\nKV cache: q4"
        options = screen.host.reply_options(app.config)
        assert (options.draft, options.depth, options.kv) == ("auto", 1, "q4")
        await send(pilot, "five six seven eight five six seven eight five six")
        assert saved_messages(app)[-1].stats["drafter"] == "ngram"  # auto without an MTP head
        await pilot.press("f5")
        assert "runs the bf16 route only" in last_note(app).message
        await pilot.press("f4")
        line = str(screen.query_one("#readout-line", Label).render())
        assert "depth 1 kv q4" in line and "drafts" not in line  # only what differs from the defaults

    int4 = tmp_path / "tiny-int4"
    assert main(["convert", str(tiny_model), str(int4), "--format", "int4"]) == 0
    app = make_app(model=int4)
    async with app.run_test(size=SIZE) as pilot:
        screen = await loaded(pilot)
        await pilot.press("f5")
        await pilot.pause()
        assert screen.query_one("#route", Select).value == "w4a8" and screen.host.switches.route == "w4a8"
        assert "Route w4a8 from the next reply" in last_note(app).message


async def test_f1_lists_every_key_and_hides_again(make_app):
    from textual.widgets import HelpPanel

    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(pilot)
        await pilot.press("f1")
        await pilot.pause()
        assert app.screen.query(HelpPanel)
        await pilot.press("f1")
        await pilot.pause()
        assert not app.screen.query(HelpPanel)


async def test_resizing_while_a_reply_streams_loses_no_text(make_app, endless_model, paced):
    app = make_app(Config(max_tokens=100_000), model=endless_model)
    async with app.run_test(size=SIZE) as pilot:
        screen = await loaded(pilot)
        await paced.send(pilot, screen, "over the lazy dog")
        before = screen.reply_view.text
        for size in ((80, 24), (200, 60), (100, 30)):
            await pilot.resize_terminal(*size)
            paced.allow(5)
            await wait_for(pilot, lambda: paced.held)
            await pilot.pause()
        await pilot.press("escape")
        paced.allow(100_000)
        await wait_for(pilot, lambda: not screen.streaming)
        reply = saved_messages(app)[-1]
        assert reply.content.startswith(before) and screen.query(MessageView).last().text == reply.content


async def test_a_moe_models_readout_says_where_its_experts_came_from(make_app, tmp_path):
    """The readout panel adds the expert figures (engine/experts.py) for a MoE model, and only for one."""
    from conftest import build_reference, save_reference

    moe = save_reference(build_reference("qwen4_exp_text", seed=6), tmp_path / "flash")
    app = make_app(model=moe)
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "the quick brown fox")
        figures = str(screen.query_one("#figures").render())
        assert "experts on card  100% of routes" in figures and "0.00 MB/token" in figures
        assert saved_messages(app)[-1].stats["expert_hit_rate"] == 1.0


async def test_keys_work_while_a_reply_streams_and_esc_stops_it(make_app, endless_model, paced):
    app = make_app(Config(max_tokens=100_000), model=endless_model)
    async with app.run_test(size=SIZE) as pilot:
        screen = await loaded(pilot)
        posted = []
        original = screen.post_message
        screen.post_message = lambda message: posted.append(message) or original(message)
        await paced.send(pilot, screen, "over the lazy dog")
        await pilot.press("ctrl+b")  # hide the conversation list
        assert not screen.query_one(ConversationList).display
        await pilot.press("a", "b", "c")
        assert screen.query_one("#prompt", Input).value == "abc"
        await pilot.press("ctrl+t")  # lossy acceptance, read by the engine from its next cycle
        assert screen.session.switches.accept == "lossy"
        assert screen.streaming
        paced.allow(300)  # cycles run lossy, streaming as fast as the engine goes
        await wait_for(pilot, lambda: paced.held)
        await pilot.press("escape")
        paced.allow(100_000)
        await wait_for(pilot, lambda: not screen.streaming)
        reply = saved_messages(app)[-1]
        assert reply.stopped and reply.accept == "exact→lossy"
        assert 300 <= reply.stats["generated_tokens"] < 400
        view = screen.query(MessageView).last()
        assert view.has_class("-stopped") and "stopped" in view.border_title
        streamed = [m for m in posted if isinstance(m, ChatScreen.Streamed)]
        assert len(streamed) < reply.stats["generated_tokens"] / 2  # batched, never one message per token


async def test_regenerate_replaces_the_last_reply(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "fox")
        first_id = saved_messages(app)[-1].id
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: replies_shown(screen) == 1 and saved_messages(app)[-1].id != first_id)
        messages = saved_messages(app)
        assert [m.role for m in messages] == ["user", "assistant"] and messages[-1].id != first_id
        assert [v.role for v in screen.query(MessageView)] == ["user", "assistant"]


async def test_new_switch_rename_and_delete_conversations(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "first chat")
        await pilot.press("ctrl+n")
        assert screen.conversation_id is None and not screen.query(MessageView)
        await send(pilot, "second chat")
        listing = screen.query_one(ConversationList)
        assert [item.conversation.title for item in listing.children] == ["second chat", "first chat"]
        listing.index = 1
        listing.action_select_cursor()
        await wait_for(pilot, lambda: screen.conversation_id == listing.children[1].conversation.id)
        await pilot.pause()
        assert screen.query(MessageView).first().text == "first chat"

        await pilot.press("f2")
        assert isinstance(app.screen, TextPrompt)
        app.screen.query_one(Input).value = "Renamed chat"
        await pilot.press("enter")
        await pilot.pause()
        assert app.store.conversation(screen.conversation_id).title == "Renamed chat"

        await pilot.press("f8")
        assert isinstance(app.screen, Confirm)
        await pilot.click("#yes")
        await pilot.pause()
        assert [c.title for c in app.store.conversations()] == ["second chat"]
        assert screen.query(MessageView).first().text == "second chat"


async def test_settings_change_the_engine_and_host_tables_ask_before_reloading(make_app, tmp_path):
    from conftest import build_reference, save_reference

    wide = save_reference(build_reference("qwen3_5_text", seed=4, hidden_size=128), tmp_path / "wide")  # int4 head: 128s
    app = make_app(model=wide)
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "hello")
        lm = screen.host.lm

        async def save_engine_settings(context: str) -> None:
            await pilot.press("ctrl+s")
            dialog = app.screen
            dialog.query_one("#draft", Select).value = "ngram"
            dialog.query_one("#depth", Select).value = "2"
            dialog.query_one("#kv", Select).value = "q4"
            dialog.query_one("#context", Input).value = context
            await pilot.press("ctrl+s")
            await pilot.pause()

        await save_engine_settings("999999999")
        assert "context budget must be from 2 to 4,096 tokens" in last_note(app).message
        await save_engine_settings("1,000")
        options = screen.host.reply_options(app.config)
        assert (options.draft, options.depth, options.kv, screen.host.budget) == ("ngram", 2, "q4", 1000)
        assert "/ 1,000" in str(screen.query_one("#context-label", Label).render()) and screen.host.lm is lm
        assert "drafts: ngram" in str(screen.query_one("#engine-choices", Label).render())

        await pilot.press("ctrl+s")
        app.screen.query_one("#host-tables", Switch).value = True
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, Confirm))
        await pilot.click("#yes")
        await wait_for(pilot, lambda: screen.host.lm is not lm and screen.host.lm is not None)
        assert screen.host.lm.host_tables and screen.host.choices.host_tables
        await send(pilot, "again")
        assert saved_messages(app)[-1].stats["generated_tokens"] > 0


async def test_settings_change_the_system_prompt_and_sampling(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "hello")
        before = screen.session.context_used()
        await pilot.press("ctrl+s")
        dialog = app.screen
        assert isinstance(dialog, ReplySettings)
        dialog.query_one("#system-prompt").text = "You are a fox."
        dialog.query_one("#temperature", Input).value = "hot"
        await pilot.press("ctrl+s")
        assert app.screen is dialog  # a bad value keeps the dialog open, with one line saying why
        assert "temperature must be a number" in last_note(app).message
        dialog.query_one("#temperature", Input).value = "0.7"
        dialog.query_one("#top_k", Input).value = "20"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.screen is screen
        assert (app.config.temperature, app.config.top_k, app.config.system_prompt) == (0.7, 20, "You are a fox.")
        assert load_config(app.paths.config_file).temperature == 0.7
        assert app.store.conversation(screen.conversation_id).system_prompt == "You are a fox."
        assert screen.session.context_used() > before


async def test_export_to_markdown_and_json(make_app, tmp_path):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "export me")
        for button in ("#md", "#json"):
            await pilot.press("ctrl+o")
            assert isinstance(app.screen, ExportChoice)
            app.screen.query_one("#folder", Input).value = str(tmp_path / "out")
            await pilot.click(button)
            await pilot.pause()
        markdown = (tmp_path / "out" / f"export-me-{screen.conversation_id}.md").read_text()
        assert markdown.startswith("# export me") and "**User**\n\nexport me" in markdown
        exported = json.loads((tmp_path / "out" / f"export-me-{screen.conversation_id}.json").read_text())
        assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]


async def test_copy_a_message_and_its_code_blocks(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await loaded(pilot)
        conversation = app.store.create_conversation("code")
        app.store.add_message(conversation.id, "user", "show code")
        app.store.add_message(conversation.id, "assistant", "One:\n\n```py\nprint(1)\n```\n\nTwo:\n\n```sh\necho 2\n```",
                              model="tiny", route="bf16", accept="exact")
        await screen.open_conversation(conversation.id)
        await pilot.pause()
        reply = screen.query(MessageView).last()
        reply.focus()
        await pilot.press("c")
        assert app.clipboard == reply.text
        await pilot.press("k")
        assert isinstance(app.screen, CodeBlockPicker)
        await pilot.press("down", "enter")
        await pilot.pause()
        assert app.clipboard == "echo 2\n"
        question = screen.query(MessageView).first()
        question.focus()
        await pilot.press("k")
        assert "no code block" in last_note(app).message


async def test_context_meter_warns_and_the_limit_asks_what_to_drop(make_app):
    app = make_app(context=160)
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "the quick brown fox jumps")
        await send(pilot, "over the lazy dog and then")
        meter = screen.query_one(ContextMeter)
        used = screen.session.context_used()
        assert meter.has_class("-warn") == (used >= 0.8 * 160)
        long_text = "in light " * 30
        screen.query_one("#prompt", Input).value = long_text
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ContextFullChoice))  # one pause was not always enough
        await pilot.click("#drop")
        await wait_for(pilot, lambda: replies_shown(screen) == 3 and not screen.streaming)
        messages = saved_messages(app)
        assert len(messages) == 6  # nothing deleted
        assert not messages[0].in_context and messages[-2].content == long_text.strip()
        assert "not in context" in screen.query(MessageView).first().border_title

        longer_text = "in light " * 50  # fits alone, not after what is in the context now
        screen.query_one("#prompt", Input).value = longer_text
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, ContextFullChoice)
        await pilot.click("#new")
        await wait_for(pilot, lambda: replies_shown(screen) == 1 and not screen.streaming)
        assert len(app.store.conversations()) == 2
        assert [v.text for v in screen.query(MessageView)][0] == longer_text.strip()


async def test_key_bindings_can_be_remapped_in_the_config(make_app):
    app = make_app(Config(max_tokens=12, keys={"chat.new": "ctrl+j"}))
    async with app.run_test(size=SIZE) as pilot:
        screen = await send(pilot, "remap")
        await pilot.press("ctrl+n")
        assert screen.conversation_id is not None
        await pilot.press("ctrl+j")
        assert screen.conversation_id is None


async def test_quitting_mid_reply_keeps_it_marked_stopped(make_app, endless_model):
    app = make_app(Config(max_tokens=4000), model=endless_model)
    async with app.run_test(size=SIZE) as pilot:
        await start_streaming(pilot)
        await pilot.press("ctrl+q")
    reply = saved_messages(app)[-1]
    assert reply.role == "assistant" and reply.stopped


async def test_the_route_switch_lists_the_checkpoints_routes_and_runs_the_chosen_one(make_app, tiny_model, tmp_path):
    from duet.app.cli import main

    int4 = tmp_path / "tiny-int4"
    assert main(["convert", str(tiny_model), str(int4), "--format", "int4"]) == 0
    app = make_app(model=int4)
    async with app.run_test(size=SIZE) as pilot:
        screen = await loaded(pilot)
        lm = screen.host.lm
        select = screen.query_one("#route", Select)
        assert [value for _, value in select._options if value != Select.NULL] == ["w4a16", "w4a8", "bf16"]
        assert select.value == "w4a16"
        select.value = "w4a8"
        await pilot.pause()
        assert "Route w4a8 from the next reply" in last_note(app).message
        await send(pilot, "fox")
        assert screen.host.lm is lm and lm.route == "w4a8"  # the same loaded model, not a reload
        assert saved_messages(app)[-1].route == "w4a8"
        assert "w4a8" in screen.query(MessageView).last().border_title


async def test_switching_route_and_rule_while_a_reply_streams_applies_from_the_next_cycle(make_app, endless_model, tmp_path):
    from duet.app.cli import main

    int4 = tmp_path / "endless-int4"
    assert main(["convert", str(endless_model), str(int4), "--format", "int4"]) == 0
    app = make_app(Config(max_tokens=4000), model=int4)
    async with app.run_test(size=SIZE) as pilot:
        screen = await start_streaming(pilot)
        await pilot.press("ctrl+t")  # first, so the pass that takes the new route also runs the new rule
        screen.query_one("#route", Select).value = "w4a8"
        await pilot.pause()
        # read before the notice can expire (5 s) while the engine gets to its next cycle on a busy machine
        assert "from the next cycle of this reply" in "".join(n.message for n in app.notices)
        await wait_for(pilot, lambda: screen.host.lm.route == "w4a8")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not screen.streaming)
    reply = saved_messages(app)[-1]
    assert reply.route == "w4a16→w4a8" and reply.accept == "exact→lossy" and reply.stopped


async def test_reasoning_streams_into_a_box_that_folds_away_and_is_neither_answer_nor_copied(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await loaded(pilot)
        view = MessageView(role="assistant")
        await screen.query_one("#messages").mount(view)
        box, reasoning = view.query_one(Collapsible), view.query_one(".reasoning", Static)
        await view.append("<thi")  # may yet be the tag: nothing shown
        assert not box.display and view.text == ""
        await view.append("nk>\nweighing it")
        assert box.display and not box.collapsed and box.title == "Thinking… 2 words"
        assert str(reasoning.render()) == "weighing it" and view.text == ""
        await view.append(" up</think>\n\nThe ")
        await view.append("answer, in `code`.")
        assert box.title == "Thought · 3 words"
        await view.stop_stream()
        assert view.query_one(Markdown).source == "The answer, in `code`."
        conversation = app.store.create_conversation("thinking")
        saved = app.store.add_message(conversation.id, "assistant", view.written, model="tiny", route="bf16", accept="exact")
        await view.finish(saved)
        assert box.collapsed and box.display and view.text == "The answer, in `code`."
        view.focus()
        await pilot.press("c")
        assert app.clipboard == "The answer, in `code`."

        empty = app.store.add_message(conversation.id, "assistant", "<think>\n\n</think>\n\nHello", model="tiny")
        await screen.open_conversation(conversation.id)
        shown = screen.query(MessageView).last()
        assert shown.message == empty and not shown.query_one(Collapsible).display  # an empty block is not shown
        assert shown.query_one(Markdown).source == "Hello"
