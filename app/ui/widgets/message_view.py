"""One message of a conversation: a header line (who, made with what, how fast) and its markdown."""

from __future__ import annotations

import re

from markdown_it import MarkdownIt
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Markdown
from textual.widgets.markdown import MarkdownStream

from app.store import Message
from app.ui.screens.dialogs import CodeBlockPicker


CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def displayable(text: str) -> str:
    """Text safe to draw: control characters (a model can emit ESC) shown as U+FFFD, never sent to the terminal."""
    return CONTROL_CHARACTERS.sub("\ufffd", text)


def code_blocks(markdown: str) -> list[str]:
    """The contents of the fenced and indented code blocks of a markdown text, in order."""
    return [token.content for token in MarkdownIt().parse(markdown) if token.type in ("fence", "code_block")]


def header_text(message: Message) -> str:
    """'You', or 'duet · model · route · accept · tok/s', with what happened to the reply."""
    if message.role == "user":
        return "You" + ("  (not in context)" if not message.in_context else "")
    parts = ["duet", message.model, message.route, message.accept]
    if message.stats.get("decode_tok_s"):
        parts.append(f"{message.stats['decode_tok_s']:.1f} tok/s")
    if message.stopped:
        parts.append("stopped")
    elif message.finish_reason in ("length", "context"):
        parts.append("max tokens" if message.finish_reason == "length" else "context full")
    if not message.in_context:
        parts.append("not in context")
    return " · ".join(part for part in parts if part)


class MessageView(Vertical, can_focus=True):
    """A saved message, or a reply being written (`message` None until it is saved)."""

    BINDINGS = [
        ("c", "copy_message", "Copy"),
        ("k", "copy_code", "Copy code"),
    ]

    def __init__(self, message: Message | None = None, role: str = "assistant"):
        self.message = message
        self.role = message.role if message else role
        super().__init__(classes=f"message -{self.role}")
        self.border_title = header_text(message) if message else "duet · writing…"

    def compose(self) -> ComposeResult:
        yield Markdown(displayable(self.message.content) if self.message else "")

    @property
    def text(self) -> str:
        """The message as saved (while streaming: as shown so far)."""
        return self.message.content if self.message else self.query_one(Markdown).source

    def stream(self) -> MarkdownStream:
        return Markdown.get_stream(self.query_one(Markdown))

    async def finish(self, message: Message) -> None:
        """The reply is saved: show its full text and its header."""
        self.message = message
        self.border_title = header_text(message)
        self.set_class(message.stopped, "-stopped")
        await self.query_one(Markdown).update(displayable(message.content))

    def action_copy_message(self) -> None:
        self.app.copy_to_clipboard(self.text)
        self.notify("Copied the message")

    def action_copy_code(self) -> None:
        blocks = code_blocks(self.text)
        if not blocks:
            self.notify("This message has no code block", severity="warning")
        elif len(blocks) == 1:
            self._copy_code(blocks[0])
        else:
            self.app.push_screen(CodeBlockPicker(blocks), self._copy_code)

    def _copy_code(self, block: str | None) -> None:
        if block is not None:
            self.app.copy_to_clipboard(block)
            self.notify("Copied the code block")
