"""Snapshots of the main screens (pytest-textual-snapshot); `pytest --snapshot-update` accepts changes."""

from __future__ import annotations

import pytest

from duet.app import catalog as catalog_module
from duet.app.catalog import import_model
from duet.app.settings import Config, user_paths
from duet.app.store import Store
from duet.app.session import Launch
from duet.app.ui.app import DuetApp
from duet.app.ui.screens.chat import ChatScreen

SIZE = (130, 36)
STATS = {"prompt_tokens": 24, "generated_tokens": 40, "prefill_tok_s": 812.5, "decode_tok_s": 41.3, "cycles": 18,
         "tokens_per_cycle": 2.1667, "drafted": 52, "accepted": 21, "acceptance_rate": 0.4038,
         "accept_by_position": [0.62, 0.35, 0.18], "n_lossy": 2, "first_token_s": 0.031, "drafter": "mtp"}
REPLY = "The fox answers in a code block:\n\n```python\nprint('jumps over the lazy dog')\n```\n\nThen it runs far away."


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(catalog_module, "bundled_demo_model", lambda: tmp_path / "no-demo")
    return user_paths()


def saved_conversation(paths) -> None:
    store = Store(paths.database)
    older = store.create_conversation("Older chat")
    store.add_message(older.id, "user", "hello")
    chat = store.create_conversation("The quick brown fox", "Answer briefly.")
    store.add_message(chat.id, "user", "What does the fox do?")
    store.add_message(chat.id, "assistant", REPLY, model="tiny", route="bf16", accept="exact", stats=STATS,
                      finish_reason="stop")
    store.add_message(chat.id, "user", "And then?")
    store.add_message(chat.id, "assistant", "It stops", model="tiny", route="bf16", accept="lossy",
                      stats={**STATS, "decode_tok_s": 38.9}, finish_reason="cancelled")
    store.close()


def duet(model, context=None) -> DuetApp:
    return DuetApp(user_paths(), Config(), Launch(model, context=context))


async def until_loaded(pilot, *keys: str) -> None:
    """Wait for the model, press keys, and hold still: no blinking cursor, no pending rendering."""
    for _ in range(400):
        if isinstance(pilot.app.screen, ChatScreen) and pilot.app.screen.host.lm is not None:
            break
        await pilot.pause(0.05)
    await pilot.press(*keys)
    await pilot.pause()
    for field in pilot.app.screen.query("Input, TextArea"):
        field.cursor_blink = False  # a blinking cursor would make the picture depend on timing
    await pilot.wait_for_scheduled_animations()
    await pilot.pause(0.3)  # let the markdown finish rendering, whatever the machine's load


def test_chat_screen_with_a_saved_conversation(snap_compare, home, tiny_model):
    saved_conversation(home)
    assert snap_compare(duet(tiny_model), terminal_size=SIZE, run_before=until_loaded)


@pytest.mark.parametrize("colour", ["colour", "no-colour"])
def test_chat_screen_at_80_by_24(snap_compare, home, tiny_model, monkeypatch, colour):
    """The common default terminal: both side panels folded, the readout in one line of words (so a
    monochrome terminal, NO_COLOR, still says exact or lossy)."""
    if colour == "no-colour":
        monkeypatch.setenv("NO_COLOR", "1")
    saved_conversation(home)
    assert snap_compare(duet(tiny_model), terminal_size=(80, 24), run_before=until_loaded)


@pytest.mark.parametrize("size", [(120, 40), (200, 60)], ids=["120x40", "200x60"])
def test_chat_screen_when_wide(snap_compare, home, tiny_model, size):
    """From 120 columns on, the conversation list and the figures panel stand beside the chat."""
    saved_conversation(home)
    assert snap_compare(duet(tiny_model), terminal_size=size, run_before=until_loaded)


def test_chat_screen_empty(snap_compare, home, tiny_model):
    assert snap_compare(duet(tiny_model), terminal_size=SIZE, run_before=until_loaded)


def test_reply_settings_dialog(snap_compare, home, tiny_model):
    saved_conversation(home)
    assert snap_compare(duet(tiny_model), terminal_size=SIZE, run_before=lambda pilot: until_loaded(pilot, "ctrl+s"))


def test_context_full_dialog(snap_compare, home, tiny_model):
    async def fill_context(pilot):
        await until_loaded(pilot)
        pilot.app.screen.query_one("#prompt").value = "in light " * 40
        await until_loaded(pilot, "enter")

    saved_conversation(home)
    assert snap_compare(duet(tiny_model, context=96), terminal_size=SIZE, run_before=fill_context)


def test_models_screen(snap_compare, home, tiny_model):
    import_model(tiny_model, home.models_dir, "tiny")
    assert snap_compare(duet(tiny_model), terminal_size=SIZE, run_before=lambda pilot: until_loaded(pilot, "f3"))
