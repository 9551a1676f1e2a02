"""One message of a conversation: a header line (who, made with what, how fast) and its markdown."""

from __future__ import annotations

import re

from markdown_it import MarkdownIt
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Collapsible, Markdown, Static

from duet.app.session import split_thinking
from duet.app.store import Message
from duet.app.ui.screens.dialogs import CodeBlockPicker


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


def thinking_title(reasoning: str | None, done: bool = True) -> str:
    words = len((reasoning or "").split())
    return f"Thought · {words:,} words" if done else f"Thinking… {words:,} words"


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
        self.written = message.content if message else ""  # the reply text as streamed so far
        self._stream = None

    def compose(self) -> ComposeResult:
        with Collapsible(collapsed=self.message is not None, classes="thinking"):
            yield Static(classes="reasoning", markup=False)
        yield Markdown(displayable(self._parts()[1]))

    def on_mount(self) -> None:
        self._show_reasoning()

    def _parts(self) -> tuple[str | None, str]:
        """(reasoning, answer) of what is written so far; a user's message is all answer."""
        if self.role != "assistant":
            return None, self.written
        return split_thinking(self.written, streaming=self.message is None)

    @property
    def text(self) -> str:
        """The answer as saved (while streaming: as written so far), without its reasoning."""
        return self._parts()[1]

    async def append(self, text: str) -> None:
        """More of a streaming reply: reasoning goes to the thinking box, the answer streams as markdown."""
        shown_answer = self.text
        self.written += text
        answer = self.text
        self._show_reasoning()
        if answer != shown_answer:
            if self._stream is None:
                self._stream = Markdown.get_stream(self.query_one(Markdown))
            await self._stream.write(displayable(answer[len(shown_answer):]))

    async def stop_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    async def finish(self, message: Message) -> None:
        """The reply is saved: show its full text and its header; the reasoning folds away."""
        await self.stop_stream()
        self.message, self.written = message, message.content
        self.border_title = header_text(message)
        self.set_class(message.stopped, "-stopped")
        self._show_reasoning()
        self.query_one(Collapsible).collapsed = True
        await self.query_one(Markdown).update(displayable(self.text))

    def _show_reasoning(self) -> None:
        """The thinking box: shown while a reply reasons, and after it when the reasoning is not empty."""
        reasoning, answer = self._parts()
        box = self.query_one(Collapsible)
        box.display = reasoning is not None and (bool(reasoning) or self.message is None)
        box.title = thinking_title(reasoning, done=self.message is not None or bool(answer))
        self.query_one(".reasoning", Static).update(displayable(reasoning or ""))

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
