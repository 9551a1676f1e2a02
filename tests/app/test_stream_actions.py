"""What the chat screen does with each action a user takes while a reply streams.

The behaviour, one rule per action:
- New chat, regenerate, delete, another conversation from the list, the models screen (F3): refused
  with a notice that says to wait or press Esc. The reply streams on, into its own conversation.
- Route switch: taken by the engine from the next cycle of this reply, and recorded with it.
- Quit: the reply is stopped, saved marked stopped, and the app exits once it is saved.
- Esc after any of these: the reply stops and is saved with finish_reason "cancelled" (a stopped
  reply is kept, never discarded), and it holds exactly the text the screen was sent.
- A model picked on the models screen is loading: a message (or regenerate) is refused until it is
  ready, so a reply never streams from the old model while the new one takes its place.

Every test streams from a tiny real model without an eos token and a long max_tokens, so the reply
is still being written when the action lands; Esc ends it.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from pilot_wait import pace, record_notices, wait_for
from textual.widgets import Input, Select
from textual.worker import WorkerState

from duet.app.catalog import import_model
from duet.app.session import EngineChoices, Launch, ReplyChunk, ReplyDone
from duet.app.settings import Config, user_paths
from duet.app.store import Store
from duet.app.ui.app import DuetApp
from duet.app.ui.screens.chat import ChatScreen
from duet.app.ui.screens.models import ModelsScreen
from duet.app.ui.widgets.conversation_list import ConversationList
from duet.app.ui.widgets.message_view import MessageView

SIZE = (140, 40)
LONG = 2000  # tokens: far more than any test lets a reply write before it stops it
REFUSED = "A reply is being written"
pytestmark = pytest.mark.anyio


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_HOME", str(tmp_path / "home"))
    return user_paths()


@pytest.fixture
def make_app(home, endless_model):
    """The app on the endless model, with one older conversation already saved."""
    store = Store(home.database)
    older = store.create_conversation("older chat")
    store.add_message(older.id, "user", "an older question")
    store.add_message(older.id, "assistant", "an older answer", model="tiny", route="bf16", accept="exact",
                      finish_reason="stop")
    store.close()

    def make(model=None) -> DuetApp:
        launch = Launch(model or endless_model, choices=EngineChoices(draft="none"))
        app = DuetApp(home, Config(max_tokens=LONG), launch)
        app.notices = record_notices(app)
        return app

    return make


class Received:
    """The reply events the worker posted to the chat screen, in order: what it was sent to show."""

    def __init__(self, screen: ChatScreen):
        self.events = []
        self.worker = None  # the reply's worker, once it streams
        post = screen.post_message

        def record(message):
            if isinstance(message, ChatScreen.Streamed):
                self.events.append(message.event)
            return post(message)

        screen.post_message = record

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, ReplyChunk))

    @property
    def done(self) -> list[ReplyDone]:
        return [e for e in self.events if isinstance(e, ReplyDone)]


def chat(app) -> ChatScreen:
    return next(s for s in app.screen_stack if isinstance(s, ChatScreen))


def notes(app) -> list[str]:
    return [n.message for n in app.notices]


def saved(app) -> dict[str, list]:
    """Every conversation in the database by title: its messages."""
    store = Store(app.paths.database)
    try:
        return {c.title: store.messages(c.id) for c in store.conversations()}
    finally:
        store.close()


def reply_workers(app) -> list:
    return [w for w in app.workers if w.group == "reply"]


async def stream_in_a_new_chat(pilot, text: str = "the lazy dog") -> tuple[ChatScreen, Received]:
    """Open a new chat, send `text`, and return once its reply has started streaming."""
    screen = chat(pilot.app)
    await wait_for(pilot, lambda: screen.host.lm is not None)
    pace(screen.host.lm)
    received = Received(screen)
    await pilot.press("ctrl+n")
    screen.query_one("#prompt", Input).value = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: screen.streaming and received.text)
    (received.worker,) = reply_workers(pilot.app)
    return screen, received


async def stop(pilot, screen: ChatScreen) -> None:
    await pilot.press("escape")
    await wait_for(pilot, lambda: not screen.streaming)


def check_stopped_reply_is_what_was_shown(app, screen: ChatScreen, received: Received, text: str = "the lazy dog"):
    """After Esc: the reply is saved whole in its own conversation, as the screen showed it, its worker
    is done, and the older conversation is untouched."""
    conversations = saved(app)
    assert set(conversations) == {"older chat", text}
    assert [(m.role, m.content) for m in conversations["older chat"]] == [
        ("user", "an older question"), ("assistant", "an older answer")]
    user, reply = conversations[text]
    assert (user.role, user.content, reply.role) == ("user", text, "assistant")
    assert reply.stopped and 0 < reply.stats["generated_tokens"] < LONG
    assert reply.content == received.text  # every chunk shown, and nothing else, is saved
    assert [d.message for d in received.done] == [reply]
    assert screen.conversation_id == reply.conversation_id
    views = list(screen.query(MessageView))
    assert [(v.role, v.written) for v in views] == [("user", text), ("assistant", reply.content)]
    assert views[-1].message == reply and "stopped" in views[-1].border_title
    assert screen.reply_saved.is_set() and screen.cancel is None
    assert received.worker.state == WorkerState.SUCCESS and received.worker.error is None
    assert reply_workers(app) == []  # nothing else generating


async def test_actions_that_would_leave_the_reply_are_refused_while_it_streams(make_app):
    """One reply, each action in turn (one app run keeps the file fast): new chat, regenerate, delete,
    the models screen, another conversation from the list."""
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen, received = await stream_in_a_new_chat(pilot)
        conversation = screen.conversation_id
        listing = screen.query_one(ConversationList)
        assert [item.conversation.title for item in listing.children] == ["the lazy dog", "older chat"]

        async def refused(action: str, act) -> None:
            before = len(notes(app))
            await act()
            await wait_for(pilot, lambda: len(notes(app)) > before)
            assert REFUSED in notes(app)[-1], action
            assert app.screen is screen, action  # no Confirm (F8), no models screen (F3)
            assert screen.streaming and screen.conversation_id == conversation, action
            assert reply_workers(app) == [received.worker], action  # the same reply, still writing
            assert [v.role for v in screen.query(MessageView)] == ["user", "assistant"], action

        for key in ("ctrl+n", "ctrl+r", "f8", "f3"):
            await refused(key, lambda: pilot.press(key))

        async def select_older():
            listing.index = 1
            listing.action_select_cursor()

        await refused("select", select_older)
        await wait_for(pilot, lambda: listing.index == 0)  # the list points at the conversation shown again
        assert received.worker.state == WorkerState.RUNNING
        await stop(pilot, screen)
        check_stopped_reply_is_what_was_shown(app, screen, received)


async def test_the_route_switch_while_a_reply_streams_is_taken_from_the_next_cycle(make_app, endless_model, tmp_path):
    from duet.app.cli import main

    int4 = tmp_path / "endless-int4"
    assert main(["convert", str(endless_model), str(int4), "--format", "int4"]) == 0
    app = make_app(int4)
    async with app.run_test(size=SIZE) as pilot:
        screen, received = await stream_in_a_new_chat(pilot)
        lm = screen.host.lm
        screen.query_one("#route", Select).value = "w4a8"
        await wait_for(pilot, lambda: lm.route == "w4a8")
        assert "Route w4a8 from the next cycle of this reply" in notes(app)[-1]
        await stop(pilot, screen)
        check_stopped_reply_is_what_was_shown(app, screen, received)
        reply = saved(app)["the lazy dog"][-1]
        assert reply.route == "w4a16→w4a8" and screen.host.lm is lm  # the same weights, no reload


async def test_quit_while_a_reply_streams_stops_it_and_saves_it_before_exiting(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen, received = await stream_in_a_new_chat(pilot)
        await pilot.press("ctrl+q")
        shown = received.text
    assert screen.reply_saved.is_set()  # the worker ran to its end before the app exited
    assert received.worker.state in (WorkerState.SUCCESS, WorkerState.CANCELLED)  # cancelled: by the app's exit
    assert received.worker.error is None or isinstance(received.worker.error, asyncio.CancelledError)
    user, reply = saved(app)["the lazy dog"]
    assert reply.stopped and 0 < reply.stats["generated_tokens"] < LONG
    assert reply.content.startswith(shown)  # what was on screen, and what it had written since
    assert len(saved(app)["older chat"]) == 2


async def test_any_exit_while_a_reply_streams_stops_it_and_saves_it(make_app):
    """Not only ctrl+q: an exit the app did not choose (an error elsewhere, app.exit) stops the reply too,
    instead of leaving it generating for no one, and keeping the process alive, until max_tokens."""
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen, received = await stream_in_a_new_chat(pilot)
        started = time.perf_counter()
        app.exit()
    assert time.perf_counter() - started < 5  # LONG tokens would take a minute
    assert screen.reply_saved.is_set()
    user, reply = saved(app)["the lazy dog"]
    assert reply.stopped and 0 < reply.stats["generated_tokens"] < LONG


async def test_a_message_waits_for_a_model_picked_on_the_models_screen(make_app, endless_model, home):
    """Switching model: F3 is refused while a reply streams (above); a reply is refused while the model
    picked loads, so the old model never answers after the user chose another."""
    import_model(endless_model, home.models_dir, "other")
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = chat(app)
        await wait_for(pilot, lambda: screen.host.lm is not None)
        first = screen.host.lm
        gate = threading.Event()
        load = screen.host.load

        def gated_load(*args, **kwargs):
            gate.wait(20)  # the load stays in flight until the test has tried to send
            return load(*args, **kwargs)

        screen.host.load = gated_load
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelsScreen))
        models = app.screen
        table = models.query_one("#local")
        table.focus()
        names = [str(table.get_row_at(i)[0]) for i in range(table.row_count)]
        table.move_cursor(row=names.index("other"))
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is screen)
        screen.query_one("#prompt", Input).value = "are you the new model"
        assert app.focused is screen.query_one("#prompt", Input)  # back where the user types
        await pilot.press("enter")
        await pilot.pause()
        assert not screen.streaming and "loading" in notes(app)[-1]
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert not screen.streaming and "loading" in notes(app)[-1]
        gate.set()
        await wait_for(pilot, lambda: screen.host.lm is not first and screen.host.lm is not None)
        assert screen.host.lm.name == "other"
        assert screen.query_one("#prompt", Input).value == "are you the new model"  # kept, to send again
        pace(screen.host.lm)
        received = Received(screen)
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.streaming and received.text)
        await stop(pilot, screen)
        reply = saved(app)["older chat"][-1]
        assert reply.model == "other" and reply.content == received.text and reply.stopped
