"""Conversations in SQLite (stdlib sqlite3, WAL journal).

Every message is committed the moment it is complete: the user's when it is sent, the reply when
generation ends (a stopped reply is kept, with finish_reason "cancelled"). A killed process loses at
most the reply it was writing. Each reply records the model, route, acceptance mode and stats it
was made with. Messages leave the model's context only when the user chooses to drop them; they
stay in the database and on screen.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from duet.engine.errors import DuetError

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content TEXT NOT NULL,
    created REAL NOT NULL,
    model TEXT,
    route TEXT,
    accept TEXT,
    stats TEXT,
    finish_reason TEXT,
    in_context INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    system_prompt: str
    created: float
    updated: float


@dataclass(frozen=True)
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    created: float
    model: str | None = None
    route: str | None = None
    accept: str | None = None
    stats: dict = field(default_factory=dict)
    finish_reason: str | None = None
    in_context: bool = True

    @property
    def stopped(self) -> bool:
        return self.finish_reason == "cancelled"


class Store:
    """One SQLite file; safe to use from the UI thread and a generation worker at once."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.DatabaseError as error:
            raise DuetError(f"{self.path}: not a readable duet database ({error}); move it aside to start afresh") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _migrate(self) -> None:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise DuetError(f"{self.path}: written by a newer duet (schema {version}); upgrade duet")
        with self._db:
            self._db.executescript(SCHEMA)
            self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _write(self, sql: str, parameters: tuple = ()) -> sqlite3.Cursor:
        with self._lock, self._db:
            return self._db.execute(sql, parameters)

    def _read(self, sql: str, parameters: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, parameters).fetchall()

    # ---- conversations ----

    def create_conversation(self, title: str = "New chat", system_prompt: str = "") -> Conversation:
        now = time.time()
        cursor = self._write("INSERT INTO conversations (title, system_prompt, created, updated) VALUES (?, ?, ?, ?)",
                             (title, system_prompt, now, now))
        return Conversation(cursor.lastrowid, title, system_prompt, now, now)

    def conversations(self) -> list[Conversation]:
        """Newest activity first."""
        rows = self._read("SELECT * FROM conversations ORDER BY updated DESC, id DESC")
        return [Conversation(**row) for row in rows]

    def conversation(self, conversation_id: int) -> Conversation:
        rows = self._read("SELECT * FROM conversations WHERE id = ?", (conversation_id,))
        if not rows:
            raise DuetError(f"conversation {conversation_id} does not exist")
        return Conversation(**rows[0])

    def rename(self, conversation_id: int, title: str) -> None:
        title = " ".join(title.split())
        if not title:
            raise DuetError("a conversation needs a title; type a few words")
        self._write("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def set_system_prompt(self, conversation_id: int, system_prompt: str) -> None:
        self._write("UPDATE conversations SET system_prompt = ? WHERE id = ?", (system_prompt, conversation_id))

    def delete_conversation(self, conversation_id: int) -> None:
        self._write("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    # ---- messages ----

    def add_message(self, conversation_id: int, role: str, content: str, *, model: str | None = None,
                    route: str | None = None, accept: str | None = None, stats: dict | None = None,
                    finish_reason: str | None = None) -> Message:
        now = time.time()
        stats = stats or {}
        with self._lock, self._db:
            cursor = self._db.execute(
                "INSERT INTO messages (conversation_id, role, content, created, model, route, accept, stats, "
                "finish_reason) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, content, now, model, route, accept, json.dumps(stats), finish_reason))
            self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        return Message(cursor.lastrowid, conversation_id, role, content, now, model, route, accept, stats,
                       finish_reason)

    def messages(self, conversation_id: int) -> list[Message]:
        rows = self._read("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (conversation_id,))
        return [_message(row) for row in rows]

    def delete_message(self, message_id: int) -> None:
        self._write("DELETE FROM messages WHERE id = ?", (message_id,))

    def drop_from_context(self, message_ids: list[int]) -> None:
        """Leave these messages out of what the model sees; they stay saved and shown."""
        with self._lock, self._db:
            self._db.executemany("UPDATE messages SET in_context = 0 WHERE id = ?", [(i,) for i in message_ids])


def _message(row: sqlite3.Row) -> Message:
    values = dict(row)
    values["stats"] = json.loads(values["stats"] or "{}")
    values["in_context"] = bool(values["in_context"])
    return Message(**values)
