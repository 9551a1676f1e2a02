"""The chat screen: conversations on the left, the conversation in the middle, readouts on the right.

The screen shows; app.session's EngineHost holds the model, its route, the budget and the switches.
The model loads and replies generate in thread workers; they reach this screen as posted messages
(load progress throttled by the host, reply text batched by ChatSession), so keys work while a reply
streams.
"""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path

from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Label, ListView, ProgressBar, Select, Switch
from textual.worker import Worker, get_current_worker

from duet.app.exports import export_conversation
from duet.app.session import ChatSession, ContextFull, EngineHost, Launch, Readout, ReplyChunk, ReplyDone
from duet.app.ui.screens.dialogs import Confirm, ContextFullChoice, ExportChoice, ReplySettings, TextPrompt
from duet.app.ui.screens.models import ModelsScreen
from duet.app.ui.widgets.conversation_list import ConversationItem, ConversationList
from duet.app.ui.widgets.message_view import MessageView
from duet.app.ui.widgets.readouts import ContextMeter, ReadoutLine, Readouts, SwitchPanel
from duet.engine import Accept, Draft, DuetError, KVCache, LoadedModel, LoadProgress, Route

QUIT_WAIT_SECONDS = 5.0  # on quit, how long to wait for a stopped reply to be saved
# Below this many columns the conversation list (28) and the panel (34) would leave the chat too
# narrow (80 columns: 18): both fold away, the readout takes one line, and F4 / ctrl+b bring them back.
WIDE_COLUMNS = 120


class ChatScreen(Screen):
    # In the footer's order, most used first (a narrow footer shows the first); every one remappable by id.
    BINDINGS = [
        Binding("escape", "stop", "Stop", id="chat.stop"),
        Binding("ctrl+t", "toggle_accept", "Exact/lossy", id="chat.accept"),
        Binding("ctrl+n", "new_conversation", "New", id="chat.new"),
        Binding("ctrl+r", "regenerate", "Regenerate", id="chat.regenerate"),
        Binding("f4", "toggle_panel", "Figures", id="chat.panel"),
        Binding("ctrl+b", "toggle_sidebar", "Chats", id="chat.sidebar"),
        Binding("f5", "next_route", "Route", id="chat.route"),
        Binding("f6", "next_draft", "Drafts", id="chat.draft"),
        Binding("f7", "next_depth", "Depth", id="chat.depth"),
        Binding("f9", "next_kv", "KV cache", id="chat.kv"),
        Binding("ctrl+s", "settings", "Settings", id="chat.settings"),
        Binding("f3", "models", "Models", id="chat.models"),
        Binding("f2", "rename", "Rename", id="chat.rename"),
        Binding("f8", "delete", "Delete", id="chat.delete"),
        Binding("ctrl+o", "export", "Export", id="chat.export"),
    ]

    class Streamed(Message):
        def __init__(self, event: ReplyChunk | ReplyDone):
            super().__init__()
            self.event = event

    class ReplyFailed(Message):
        def __init__(self, error: str):
            super().__init__()
            self.error = error

    class LoadProgressed(Message):
        def __init__(self, share: float, stage: str):
            super().__init__()
            self.share, self.stage = share, stage

    class ModelLoaded(Message):
        def __init__(self, lm: LoadedModel, load: Worker):
            super().__init__()
            self.lm, self.load = lm, load

    class LoadFailed(Message):
        def __init__(self, error: str, load: Worker):
            super().__init__()
            self.error, self.load = error, load

    def __init__(self, launch: Launch):
        super().__init__()
        self.host = EngineHost(launch)
        self.session: ChatSession | None = None
        self.conversation_id: int | None = None
        self.cancel: threading.Event | None = None  # set while a reply streams
        self.narrow: bool | None = None  # the layout's width class, once the screen knows its width
        self.loading: Worker | None = None  # the load of the model last chosen, while it runs
        self.reply_saved = threading.Event()
        self.reply_view: MessageView | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal():
            yield ConversationList(id="conversations")
            with Vertical(id="chat"):
                yield ProgressBar(total=1.0, show_eta=False, id="loading")
                yield VerticalScroll(id="messages")
                yield ReadoutLine(id="readout-line")
                yield Input(placeholder="Message duet · Enter sends · Esc stops a reply", id="prompt")
            with Vertical(id="panel"):
                yield Label("no model", id="model-name")
                yield Readouts(id="readouts")
                yield SwitchPanel(id="switches")
                yield ContextMeter(id="context")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#messages", VerticalScroll).anchor()
        conversations = self.app.store.conversations()
        if conversations:
            await self.open_conversation(conversations[0].id)
        await self.show_conversations()
        self.query_one(SwitchPanel).set_accept(self.host.switches.accept)
        self.query_one(ReadoutLine).set(accept=self.host.switches.accept)
        self.show_choices()
        self.fit_layout(self.app.size.width)
        self.query_one("#prompt", Input).focus()
        self.start_loading(self.host.launch.model_path, self.host.launch.route)

    @property
    def streaming(self) -> bool:
        return self.cancel is not None

    # ---- layout: below WIDE_COLUMNS the side panels fold away and the readout takes one line ----

    def on_resize(self, event: events.Resize) -> None:
        self.fit_layout(event.size.width)

    def fit_layout(self, width: int) -> None:
        """On crossing WIDE_COLUMNS, show or fold both side panels; between crossings the keys decide."""
        narrow = width < WIDE_COLUMNS
        if narrow == self.narrow:
            return
        self.narrow = narrow
        self.query_one(ConversationList).display = not narrow
        self.query_one("#panel").display = not narrow
        self.query_one(ReadoutLine).display = narrow

    # ---- loading the model ----

    def start_loading(self, path: Path, route: Route) -> None:
        self.query_one("#loading", ProgressBar).update(progress=0)
        self.query_one("#loading").display = True
        self.query_one("#model-name", Label).update(f"loading {path.name}…")
        self.loading = self.load_model_in_background(path, route)

    @work(thread=True, exclusive=True, group="load")
    def load_model_in_background(self, path: Path, route: Route) -> None:
        load = get_current_worker()
        try:
            lm = self.host.load(path, route, lambda share, stage: self.post_message(self.LoadProgressed(share, stage)))
        except DuetError as error:
            self.post_message(self.LoadFailed(str(error), load))
            return
        self.post_message(self.ModelLoaded(lm, load))

    def on_chat_screen_load_progressed(self, message: LoadProgressed) -> None:
        self.query_one("#loading", ProgressBar).update(progress=message.share)
        if message.stage == LoadProgress.KERNELS and message.share < 1:
            self.query_one("#model-name", Label).update("preparing CPU kernels (a first run compiles them)…")

    def on_chat_screen_load_failed(self, message: LoadFailed) -> None:
        if message.load is not self.loading:  # a later choice of model superseded this one
            return
        self.loading = None
        self.query_one("#loading").display = False
        self.query_one("#model-name", Label).update("no model · F3 to pick one")
        self.notify(message.error, title="Could not load the model", severity="error", timeout=10)

    def on_chat_screen_model_loaded(self, message: ModelLoaded) -> None:
        if message.load is not self.loading:  # a later choice of model superseded this one
            return
        self.loading, host = None, self.host
        host.use(message.lm)
        self.query_one("#loading").display = False
        self.query_one("#model-name", Label).update(f"{host.lm.name} · {host.budget:,} tokens")
        self.query_one(SwitchPanel).set_routes(host.routes(), host.lm.route)
        self.session = host.session(self.app.store, self.conversation_id) if self.conversation_id is not None else None
        self.update_context_meter()

    # ---- conversations ----

    async def show_conversations(self) -> None:
        await self.query_one(ConversationList).show(self.app.store.conversations(), self.conversation_id)

    async def open_conversation(self, conversation_id: int | None) -> None:
        self.conversation_id = conversation_id
        self.session = (self.host.session(self.app.store, conversation_id)
                        if self.host.lm and conversation_id is not None else None)
        messages = self.app.store.messages(conversation_id) if conversation_id is not None else []
        container = self.query_one("#messages", VerticalScroll)
        await container.remove_children()
        await container.mount_all(MessageView(m) for m in messages)
        container.scroll_end(animate=False)
        replies = [m for m in messages if m.role == "assistant"]
        readout = Readout.of_saved(replies[-1].stats) if replies else Readout()
        self.query_one(Readouts).show(readout)
        self.query_one(ReadoutLine).set(readout=readout)
        self.update_context_meter()

    @on(ListView.Selected, "#conversations")
    async def conversation_selected(self, event: ListView.Selected) -> None:
        if not isinstance(event.item, ConversationItem) or event.item.conversation.id == self.conversation_id:
            return
        if self.refuse_while_streaming():
            await self.show_conversations()
            return
        await self.open_conversation(event.item.conversation.id)

    def refuse_while_streaming(self) -> bool:
        if self.streaming:
            self.notify("A reply is being written; wait for it or press Esc to stop it", severity="warning")
        return self.streaming

    def refuse_without_a_model(self) -> bool:
        """No reply while a model loads: the model chosen answers, never the one it replaces."""
        if self.loading is not None:
            self.notify("The model is still loading; send when it is ready", severity="warning")
        elif self.host.lm is None:
            self.notify("No model is loaded; press F3 to pick one", severity="warning")
        return self.loading is not None or self.host.lm is None

    async def action_new_conversation(self) -> None:
        if not self.refuse_while_streaming():
            await self.open_conversation(None)
            await self.show_conversations()
            self.query_one("#prompt", Input).focus()

    def action_rename(self) -> None:
        if self.conversation_id is None:
            self.notify("Send a message first; then the conversation can be renamed", severity="warning")
            return
        title = self.app.store.conversation(self.conversation_id).title
        self.app.push_screen(TextPrompt("Rename the conversation", title), self.rename_to)

    async def rename_to(self, title: str | None) -> None:
        if title is None:
            return
        try:
            self.app.store.rename(self.conversation_id, title)
        except DuetError as error:
            self.notify(str(error), severity="error")
            return
        if self.session:
            self.session.refresh()
        await self.show_conversations()

    def action_delete(self) -> None:
        if self.refuse_while_streaming() or self.conversation_id is None:
            return
        title = self.app.store.conversation(self.conversation_id).title
        self.app.push_screen(Confirm(f"Delete “{title}” and all its messages?", "Delete"), self.delete_confirmed)

    async def delete_confirmed(self, yes: bool | None) -> None:
        if not yes:
            return
        self.app.store.delete_conversation(self.conversation_id)
        remaining = self.app.store.conversations()
        await self.open_conversation(remaining[0].id if remaining else None)
        await self.show_conversations()
        self.notify("Deleted the conversation")

    def action_toggle_sidebar(self) -> None:
        sidebar = self.query_one(ConversationList)
        sidebar.display = not sidebar.display

    def action_toggle_panel(self) -> None:
        """The readout panel and switches, or the one-line readout in their place."""
        panel = self.query_one("#panel")
        panel.display = not panel.display
        self.query_one(ReadoutLine).display = not panel.display

    # ---- sending and replies ----

    @on(Input.Submitted, "#prompt")
    async def prompt_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text or self.refuse_while_streaming() or self.refuse_without_a_model():
            return
        session = self.ensure_session()
        try:
            session.check_fits(text)
        except ContextFull as full:
            self.app.push_screen(ContextFullChoice(full.needed, full.budget), partial(self.context_choice, text))
            return
        await self.send(text)

    def ensure_session(self) -> ChatSession:
        if self.session is None:
            conversation = self.app.store.create_conversation(system_prompt=self.app.config.system_prompt)
            self.conversation_id = conversation.id
            self.session = self.host.session(self.app.store, conversation.id)
        return self.session

    async def context_choice(self, text: str, choice: str | None) -> None:
        try:
            if choice == "new":
                await self.open_conversation(None)
                self.ensure_session().check_fits(text)
            elif choice == "drop":
                dropped = self.session.drop_oldest_turns(text)
                await self.open_conversation(self.conversation_id)
                self.notify(f"Left the oldest {dropped} messages out of the context; they stay saved")
            else:
                return
        except DuetError as error:
            self.notify(str(error), severity="error")
            return
        await self.send(text)

    async def send(self, text: str) -> None:
        message = self.session.add_user_message(text)
        self.query_one("#prompt", Input).clear()
        await self.query_one("#messages", VerticalScroll).mount(MessageView(message))
        await self.show_conversations()
        await self.start_reply()

    async def start_reply(self) -> None:
        self.cancel, self.reply_saved = threading.Event(), threading.Event()
        self.reply_view = MessageView(role="assistant")
        await self.query_one("#messages", VerticalScroll).mount(self.reply_view)
        self.query_one(Readouts).start_reply()
        options = self.host.reply_options(self.app.config)
        self.generate_in_background(self.session, options, self.cancel, self.reply_saved)

    @work(thread=True, group="reply")
    def generate_in_background(self, session: ChatSession, options, cancel: threading.Event,
                               saved: threading.Event) -> None:
        try:
            for event in session.stream_reply(options, cancel):
                self.post_message(self.Streamed(event))
        except DuetError as error:
            self.post_message(self.ReplyFailed(str(error)))
        finally:
            saved.set()

    async def on_chat_screen_streamed(self, message: Streamed) -> None:
        event, readouts = message.event, self.query_one(Readouts)
        readouts.show(event.readout)
        self.query_one(ReadoutLine).set(readout=event.readout,
                                        context=(event.readout.prompt_tokens + event.readout.generated_tokens, self.host.budget))
        if isinstance(event, ReplyChunk):
            await self.reply_view.append(event.text)
            if event.readout.recent_tok_s:
                readouts.add_speed(event.readout.recent_tok_s)
            self.query_one(ContextMeter).show(event.readout.prompt_tokens + event.readout.generated_tokens, self.host.budget)
            return
        await self.reply_view.finish(event.message)
        self.end_reply()
        if event.message.finish_reason == "context":
            self.notify("The context budget is full; the next message will ask what to drop", severity="warning")

    async def on_chat_screen_reply_failed(self, message: ReplyFailed) -> None:
        await self.reply_view.stop_stream()
        await self.reply_view.remove()
        self.end_reply()
        self.notify(message.error, title="No reply", severity="error", timeout=10)

    def end_reply(self) -> None:
        self.cancel = self.reply_view = None
        self.update_context_meter()

    def action_stop(self) -> None:
        if self.cancel is not None:
            self.cancel.set()

    def on_unmount(self) -> None:
        """The app is closing, however it was asked to (quit, or an error): stop a streaming reply and
        wait until it is saved, marked stopped, before the app closes the store; a reply left running
        would keep the process alive, generating for no one, until max_tokens."""
        if self.cancel is not None:
            self.cancel.set()
            self.reply_saved.wait(QUIT_WAIT_SECONDS)

    async def action_regenerate(self) -> None:
        if self.refuse_while_streaming() or self.refuse_without_a_model() or self.session is None:
            return
        try:
            self.session.reopen_last_turn()
        except DuetError as error:
            self.notify(str(error), severity="warning")
            return
        last = self.query(MessageView).last()
        if last.role == "assistant":
            await last.remove()
        await self.start_reply()

    def update_context_meter(self) -> None:
        if self.host.lm is None:
            return
        used = self.session.context_used() if self.session else 0
        self.query_one(ContextMeter).show(used, self.host.budget)
        self.query_one(ReadoutLine).set(context=(used, self.host.budget), route=self.host.lm.route)

    # ---- switches and settings ----

    @on(Select.Changed, "#route")
    def route_chosen(self, event: Select.Changed) -> None:
        """Another route of the loaded weights: the engine takes it at the start of its next pass, no reload."""
        if event.value is Select.NULL or not self.host.switch_route(event.value):
            return
        when = "from the next cycle of this reply" if self.streaming else "from the next reply"
        self.query_one(ReadoutLine).set(route=event.value)
        self.notify(f"Route {event.value} {when}")

    def action_toggle_accept(self) -> None:
        switch = self.query_one("#accept", Switch)
        switch.value = not switch.value

    @on(Switch.Changed, "#accept")
    def accept_switched(self, event: Switch.Changed) -> None:
        rule = Accept.LOSSY if event.value else Accept.EXACT
        self.host.set_accept(rule)
        self.query_one(SwitchPanel).show_accept(rule)
        self.query_one(ReadoutLine).set(accept=rule)

    def action_next_route(self) -> None:
        """The next route the loaded weights run (the route selector follows; route_chosen takes it)."""
        if self.refuse_without_a_model():
            return
        routes, current = self.host.routes(), self.host.switches.route or self.host.lm.route
        if len(routes) == 1:
            self.notify(f"{self.host.lm.name} runs the {current} route only")
            return
        self.query_one("#route", Select).value = routes[(routes.index(current) + 1) % len(routes)]

    def action_next_draft(self) -> None:
        self.notify(f"Drafts: {self.host.next_draft()} from the next reply")
        self.show_choices()

    def action_next_depth(self) -> None:
        depth = self.host.next_depth()
        self.notify(f"Draft depth: {'auto (adaptive)' if depth is None else depth} from the next reply")
        self.show_choices()

    def action_next_kv(self) -> None:
        self.notify(f"KV cache: {self.host.next_kv()} from the next reply")
        self.show_choices()

    def show_choices(self) -> None:
        """The next reply's engine choices in words: in the panel, and in the one-line readout where
        they differ from the defaults."""
        c = self.host.choices
        self.query_one(SwitchPanel).show_choices(c)
        differ = [str(c.draft) if c.draft != Draft.AUTO else "", f"depth {c.depth}" if c.depth else "",
                  f"kv {c.kv}" if c.kv != KVCache.BF16 else ""]
        self.query_one(ReadoutLine).set(choices=" ".join(part for part in differ if part))

    def action_settings(self) -> None:
        prompt = self.session.conversation.system_prompt if self.session else self.app.config.system_prompt
        self.app.push_screen(ReplySettings(prompt, self.app.config, self.host.choices, self.host.context), self.settings_saved)

    async def settings_saved(self, result: tuple | None) -> None:
        if result is None:
            return
        system_prompt, config, choices, context = result
        try:
            reload = self.host.set_engine(choices, context)
        except DuetError as error:
            self.notify(str(error), severity="error")
            return
        self.show_choices()
        if self.host.lm is not None and self.conversation_id is not None and not self.streaming:
            await self.open_conversation(self.conversation_id)  # its session takes the new budget
        if reload:
            question = (f"{'Use' if choices.host_tables else 'Stop using'} host tables? The model loads again "
                        "(a reply streaming now is stopped first).")
            self.app.push_screen(Confirm(question, "Reload"),
                                 lambda yes: self.reload_with_host_tables(choices.host_tables, yes))
        config.system_prompt = system_prompt
        self.app.config = config
        self.app.save_config()
        if self.session:
            self.app.store.set_system_prompt(self.session.conversation.id, system_prompt)
            self.session.refresh()
        self.update_context_meter()
        self.notify("Saved the settings")

    def reload_with_host_tables(self, host_tables: bool, yes: bool | None) -> None:
        if not yes:
            self.notify("Host tables unchanged")
            return
        self.action_stop()
        self.host.use_host_tables(host_tables)
        self.start_loading(self.host.lm.path if self.host.lm else self.host.launch.model_path, self.host.launch.route)
        self.query_one("#prompt", Input).focus()  # the dialogs had it: type on while the model loads

    # ---- export and models ----

    def action_export(self) -> None:
        if self.conversation_id is None:
            self.notify("Nothing to export yet", severity="warning")
            return
        self.app.push_screen(ExportChoice(str(self.app.paths.exports_dir)), self.export_to)

    def export_to(self, choice: tuple[str, str] | None) -> None:
        if choice is None:
            return
        folder, kind = choice
        try:
            path = export_conversation(self.app.store, self.conversation_id, Path(folder), kind)
        except DuetError as error:
            self.notify(str(error), severity="error")
            return
        self.notify(f"Exported to {path}")

    def action_models(self) -> None:
        if not self.refuse_while_streaming():
            self.app.push_screen(ModelsScreen(), self.model_chosen)

    def model_chosen(self, path: Path | None) -> None:
        self.query_one("#prompt", Input).focus()  # back where the user types (the resumed screen would focus the list)
        if path is not None:
            self.start_loading(path, Route.AUTO)

