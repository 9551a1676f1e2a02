"""Modal dialogs: each returns its answer through dismiss(), or None when cancelled with Esc."""

from __future__ import annotations

from dataclasses import replace

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Select, Switch, TextArea

from duet.app.session import EngineChoices, sampling_params
from duet.app.settings import FRESH_SEED, Config
from duet.engine import Draft, DuetError, KVCache

SHOWN_CODE_CHARS = 60


class Dialog(ModalScreen):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def action_cancel(self) -> None:
        self.dismiss(None)


class CodeBlockPicker(Dialog):
    """Which code block to copy, shown by its first line."""

    def __init__(self, blocks: list[str]):
        super().__init__()
        self.blocks = blocks

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Copy which code block?")
            yield OptionList(*(Text(_first_line(block)) for block in self.blocks))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.blocks[event.option_index])


class TextPrompt(Dialog):
    """One line of text: a title, a path."""

    def __init__(self, question: str, value: str = "", placeholder: str = ""):
        super().__init__()
        self.question, self.value, self.placeholder = question, value, placeholder

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question)
            yield Input(self.value, placeholder=self.placeholder, id="answer")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)


class Confirm(Dialog):
    def __init__(self, question: str, yes: str):
        super().__init__()
        self.question, self.yes = question, yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question)
            with Horizontal(classes="buttons"):
                yield Button(self.yes, variant="error", id="yes")
                yield Button("Cancel", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class ContextFullChoice(Dialog):
    """At the context limit the user chooses: a new conversation, or drop the oldest turns."""

    def __init__(self, needed: int, budget: int):
        super().__init__()
        self.needed, self.budget = needed, budget

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(f"This message needs {self.needed:,} tokens of context; the budget is {self.budget:,}.\n"
                        "Nothing is cut without asking. What should duet do?")
            with Horizontal(classes="buttons"):
                yield Button("New conversation", variant="primary", id="new")
                yield Button("Drop oldest turns", variant="warning", id="drop")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None if event.button.id == "cancel" else event.button.id)


class ExportChoice(Dialog):
    """Where to export, and as Markdown or JSON; returns (folder, "md" | "json")."""

    def __init__(self, folder: str):
        super().__init__()
        self.folder = folder

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Export this conversation to the folder")
            yield Input(self.folder, id="folder")
            with Horizontal(classes="buttons"):
                yield Button("Markdown", variant="primary", id="md")
                yield Button("JSON", id="json")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss((self.query_one("#folder", Input).value, event.button.id))


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")


class ReplySettings(Dialog):
    """The system prompt of this conversation, the sampling settings and the engine's (drafts, depth, KV
    cache, context budget, host tables); returns (system prompt, Config, EngineChoices, context)."""

    BINDINGS = [Binding("ctrl+s", "save", "Save")]

    def __init__(self, system_prompt: str, config: Config, choices: EngineChoices | None = None,
                 context: int | None = None):
        super().__init__()
        self.system_prompt, self.config = system_prompt, config
        self.choices, self.context = choices or EngineChoices(), context

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog", id="settings"):
            yield Label("System prompt (this conversation, and new ones)")
            yield TextArea(self.system_prompt, id="system-prompt")
            with Grid(id="sampling"):
                for name in SAMPLING_FIELDS:
                    yield Label(name.replace("_", " "))
                    yield Input(str(getattr(self.config, name)), id=name)
            yield Label(f"seed {FRESH_SEED}: a fresh seed each reply; temperature 0: greedy", classes="hint")
            yield Label("Engine (this run; from the next reply)")
            with Grid(id="engine"):
                c = self.choices
                yield Label("drafts")
                yield Select([(d, d) for d in Draft], value=c.draft, allow_blank=False, id="draft")
                yield Label("depth")
                yield Select([("auto", "auto")] + [(str(n), str(n)) for n in range(1, 8)],
                             value="auto" if c.depth is None else str(c.depth), allow_blank=False, id="depth")
                yield Label("KV cache")
                yield Select([(kv, kv) for kv in KVCache if kv.runs], value=c.kv, allow_blank=False, id="kv")
                yield Label("context")
                yield Input("" if self.context is None else str(self.context), placeholder="the model's longest", id="context")
                yield Label("host tables")
                yield Switch(c.host_tables, id="host-tables")
            yield Label("host tables change how the head is built: the model loads again", classes="hint")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)

    def action_save(self) -> None:
        try:
            config = self._edited_config()
        except DuetError as error:
            self.notify(str(error), severity="error")
            return
        depth = self.query_one("#depth", Select).value
        choices = replace(self.choices, draft=Draft(self.query_one("#draft", Select).value),
                          depth=None if depth == "auto" else int(depth), kv=KVCache(self.query_one("#kv", Select).value),
                          host_tables=self.query_one("#host-tables", Switch).value)
        text = self.query_one("#context", Input).value.strip().replace(",", "")
        if text and not text.isdigit():
            self.notify(f"context must be a whole number of tokens, or empty for the model's longest (got {text!r})",
                        severity="error")
            return
        self.dismiss((self.query_one("#system-prompt", TextArea).text, config, choices, int(text) if text else None))

    def _edited_config(self) -> Config:
        values = {}
        for name in SAMPLING_FIELDS:
            kind = type(getattr(self.config, name))
            text = self.query_one(f"#{name}", Input).value.strip()
            try:
                values[name] = kind(text)
            except ValueError:
                raise DuetError(f"{name.replace('_', ' ')} must be a {'whole ' if kind is int else ''}number "
                                f"(got {text!r})") from None
        config = replace(self.config, **values)
        sampling_params(config)  # raises DuetError on a bad value
        return config


def _first_line(block: str) -> str:
    line = block.strip().splitlines()[0] if block.strip() else "(empty)"
    return line if len(line) <= SHOWN_CODE_CHARS else line[: SHOWN_CODE_CHARS - 1] + "…"
