"""Conversation exports: what the Markdown and JSON files hold, their names, and a folder that cannot be written."""

from __future__ import annotations

import json

import pytest

from duet.app.exports import export_conversation, export_json, export_markdown
from duet.app.store import Store
from duet.engine import DuetError


@pytest.fixture
def store(tmp_path):
    store = Store(tmp_path / "chats.sqlite3")
    yield store
    store.close()


def saved_chat(store) -> int:
    chat = store.create_conversation("Export me: now!", "System words")
    store.add_message(chat.id, "user", "question")
    store.add_message(chat.id, "assistant", "```py\nprint(1)\n```", model="tiny", route="bf16", accept="exact",
                      stats={"decode_tok_s": 3.0}, finish_reason="cancelled")
    return chat.id


def test_export_markdown_and_json(store):
    chat_id = saved_chat(store)
    conversation, messages = store.conversation(chat_id), store.messages(chat_id)
    markdown = export_markdown(conversation, messages)
    assert markdown.startswith("# Export me: now!\n")
    assert "System words" in markdown and "**User**\n\nquestion" in markdown
    assert "**Assistant (tiny · bf16 · exact) (stopped)**\n\n```py\nprint(1)\n```" in markdown
    exported = json.loads(export_json(conversation, messages))
    assert exported["title"] == "Export me: now!"
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    assert exported["messages"][1]["stats"] == {"decode_tok_s": 3.0}
    assert exported["messages"][1]["finish_reason"] == "cancelled"


def test_export_writes_a_file_named_after_the_title_into_a_new_folder(store, tmp_path):
    chat_id = saved_chat(store)
    path = export_conversation(store, chat_id, tmp_path / "new" / "folder", "json")
    assert path == tmp_path / "new" / "folder" / f"export-me-now-{chat_id}.json"
    assert json.loads(path.read_text(encoding="utf-8"))["system_prompt"] == "System words"
    assert export_conversation(store, chat_id, tmp_path, "md").read_text(encoding="utf-8").startswith("# Export me")


def test_a_folder_that_cannot_be_written_is_one_line_naming_the_file(store, tmp_path):
    chat_id = saved_chat(store)
    (tmp_path / "taken").write_text("a file, not a folder")
    with pytest.raises(DuetError, match="cannot write") as error:
        export_conversation(store, chat_id, tmp_path / "taken", "md")
    assert str(tmp_path / "taken") in str(error.value) and "\n" not in str(error.value)
