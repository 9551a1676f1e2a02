"""A conversation exported to a file: Markdown to read, or JSON with every field the store keeps."""

from __future__ import annotations

import json
import re
from pathlib import Path

from duet.app.store import Conversation, Message, Store
from duet.engine import DuetError

SLUG_CHARS = 40


def export_conversation(store: Store, conversation_id: int, folder: Path, kind: str) -> Path:
    """Write the conversation into `folder` as `kind` ("md" or "json"); returns the file written."""
    conversation = store.conversation(conversation_id)
    render = export_markdown if kind == "md" else export_json
    path = folder.expanduser() / f"{_slug(conversation.title)}-{conversation.id}.{kind}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render(conversation, store.messages(conversation_id)), encoding="utf-8")
    except OSError as error:
        raise DuetError(f"{path}: cannot write ({error.strerror}); pick another folder") from None
    return path


def export_markdown(conversation: Conversation, messages: list[Message]) -> str:
    lines = [f"# {conversation.title}", ""]
    if conversation.system_prompt:
        lines += ["**System**", "", conversation.system_prompt, ""]
    for message in messages:
        lines += [f"**{_heading(message)}**", "", message.content, ""]
    return "\n".join(lines)


def export_json(conversation: Conversation, messages: list[Message]) -> str:
    return json.dumps({
        "title": conversation.title,
        "system_prompt": conversation.system_prompt,
        "created": conversation.created,
        "messages": [{
            "role": m.role, "content": m.content, "created": m.created, "model": m.model, "route": m.route,
            "accept": m.accept, "stats": m.stats, "finish_reason": m.finish_reason, "in_context": m.in_context,
        } for m in messages],
    }, ensure_ascii=False, indent=2)


def _heading(message: Message) -> str:
    if message.role == "user":
        return "User"
    made_with = " · ".join(part for part in (message.model, message.route, message.accept) if part)
    stopped = " (stopped)" if message.stopped else ""
    return f"Assistant ({made_with}){stopped}" if made_with else f"Assistant{stopped}"


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:SLUG_CHARS] or "conversation"
