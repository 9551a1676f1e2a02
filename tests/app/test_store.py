"""The conversation store: WAL, what each message records, bad files, and a killed writer."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from duet.app.store import Store
from duet.engine.errors import DuetError


@pytest.fixture
def store(tmp_path):
    store = Store(tmp_path / "chats.sqlite3")
    yield store
    store.close()


def test_database_uses_write_ahead_logging(store):
    with sqlite3.connect(store.path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_reply_records_model_route_accept_stats_and_stop(store):
    chat = store.create_conversation("Fox facts", "Be brief.")
    store.add_message(chat.id, "user", "hello")
    store.add_message(chat.id, "assistant", "hi", model="tiny", route="bf16", accept="lossy",
                      stats={"decode_tok_s": 12.5, "n_lossy": 3}, finish_reason="cancelled")
    reopened = Store(store.path)
    user, reply = reopened.messages(chat.id)
    assert (user.role, user.content, user.stopped) == ("user", "hello", False)
    assert (reply.model, reply.route, reply.accept) == ("tiny", "bf16", "lossy")
    assert reply.stats == {"decode_tok_s": 12.5, "n_lossy": 3}
    assert reply.stopped
    reopened.close()


def test_conversations_newest_first_rename_and_delete(store):
    first = store.create_conversation("first")
    second = store.create_conversation("second")
    store.add_message(first.id, "user", "bump")
    assert [c.title for c in store.conversations()] == ["first", "second"]
    store.rename(second.id, "  renamed \n chat ")
    assert store.conversation(second.id).title == "renamed chat"
    with pytest.raises(DuetError, match="needs a title"):
        store.rename(second.id, "   ")
    store.delete_conversation(first.id)
    assert [c.title for c in store.conversations()] == ["renamed chat"]
    assert store.messages(first.id) == []


def test_dropped_messages_stay_saved(store):
    chat = store.create_conversation()
    old = store.add_message(chat.id, "user", "old")
    store.add_message(chat.id, "user", "new")
    store.drop_from_context([old.id])
    assert [(m.content, m.in_context) for m in store.messages(chat.id)] == [("old", False), ("new", True)]


def test_a_file_that_is_not_a_database_is_one_line_and_kept(tmp_path):
    path = tmp_path / "chats.sqlite3"
    path.write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(DuetError, match="not a readable duet database") as error:
        Store(path)
    assert "\n" not in str(error.value)
    assert path.read_bytes() == b"not sqlite at all" * 100


WRITER = textwrap.dedent("""
    import sys, time
    from duet.app.store import Store
    store = Store(sys.argv[1])
    chat = store.create_conversation("crash test")
    for i in range(1000000):
        store.add_message(chat.id, "user" if i % 2 == 0 else "assistant", f"message {i}")
        if i == 20:
            print("written", flush=True)
""")


def test_a_killed_writer_loses_no_committed_message(tmp_path):
    path = tmp_path / "chats.sqlite3"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, env=env)
    assert writer.stdout.readline() == b"written\n"
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=10)
    store = Store(path)
    (chat,) = store.conversations()
    contents = [m.content for m in store.messages(chat.id)]
    assert len(contents) > 20
    assert contents == [f"message {i}" for i in range(len(contents))]
    store.close()
