"""The models screen: the catalog, the models on disk, download, delete, import, and what a model is.

Downloads and imports run in thread workers and report through posted messages. Choosing a model
on disk (Enter) returns its folder to the chat screen, which loads it.
"""

from __future__ import annotations

import threading
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Label, ProgressBar, Static

from duet.app.catalog import (
    CatalogEntry, LocalModel, clear_stale_staging, delete_model, describe_lines, describe_model, human_size,
    import_model, load_catalog, local_models,
)
from duet.app.downloads import DownloadProgress, download_model, remote_model
from duet.app.models_info import ModelPlan, card_summary, host_memory, host_summary, info_lines, plan_model
from duet.app.ui.screens.dialogs import Confirm, TextPrompt
from duet.engine import DuetError


class ModelsScreen(Screen):
    BINDINGS = [
        Binding("escape", "close", "Back", id="models.close"),
        Binding("d", "download", "Download", id="models.download"),
        Binding("x", "cancel_download", "Cancel download", id="models.cancel"),
        Binding("delete", "delete", "Delete", id="models.delete"),
        Binding("i", "import_folder", "Import", id="models.import"),
        Binding("p", "plan", "Plan", id="models.plan"),
    ]

    class Progressed(Message):
        def __init__(self, progress: DownloadProgress):
            super().__init__()
            self.progress = progress

    class Finished(Message):
        """A download ended: the model it registered, or why nothing was kept."""

        def __init__(self, model: LocalModel | None, error: str | None):
            super().__init__()
            self.model, self.error = model, error

    class Imported(Finished):
        """An import ended."""

    class Planned(Message):
        """What a model needs on a card, from its headers, or why it cannot be planned."""

        def __init__(self, plan: ModelPlan | None, error: str | None):
            super().__init__()
            self.plan, self.error = plan, error

    def __init__(self):
        super().__init__()
        self.catalog: list[CatalogEntry] = []
        self.local: list[LocalModel] = []
        self.cancel: threading.Event | None = None  # set while a download runs

    def compose(self) -> ComposeResult:
        yield Header()
        with VerticalScroll(id="models"):
            yield Label("Catalog · d downloads the highlighted model", classes="section")
            yield DataTable(id="catalog", cursor_type="row", zebra_stripes=True)
            yield Label("On disk · Enter chats with it · Delete removes it · i imports a folder · "
                        "p plans either", classes="section")
            yield DataTable(id="local", cursor_type="row", zebra_stripes=True)
            with Vertical(id="download"):
                yield Label(id="download-file")
                yield ProgressBar(id="file-bar", show_eta=False)
                yield Label(id="download-total")
                yield ProgressBar(id="total-bar", show_eta=False)
            with Vertical(id="placement"):
                yield Label(id="vram-label")
                yield ProgressBar(id="vram-bar", show_eta=False)
                yield Label(id="host-label")
                yield ProgressBar(id="host-bar", show_eta=False)
            yield Static(id="model-info")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#download").display = False
        self.query_one("#placement").display = False
        catalog = self.query_one("#catalog", DataTable)
        catalog.add_columns("name", "params", "format", "repo", "made by")
        local = self.query_one("#local", DataTable)
        local.add_columns("name", "where", "size")
        try:
            self.catalog = load_catalog()
        except DuetError as error:
            self.notify(str(error), severity="error")
        for entry in self.catalog:
            made_by = "bundled" if entry.bundled else "community" if entry.community else "model authors"
            catalog.add_row(entry.name, entry.params, entry.format, entry.repo or "—", made_by, key=entry.name)
        clear_stale_staging(self.app.paths.models_dir)
        self.show_local_models()
        catalog.focus()

    def show_local_models(self) -> None:
        self.local = local_models(self.app.paths.models_dir)
        table = self.query_one("#local", DataTable)
        table.clear()
        for model in self.local:
            table.add_row(model.name, model.where, human_size(model.size), key=str(model.path))

    def action_close(self) -> None:
        if self.cancel is not None:
            self.notify("A download is running; press x to cancel it first", severity="warning")
            return
        self.dismiss(None)

    # ---- what the highlighted model is ----

    @on(DataTable.RowHighlighted)
    def row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.has_focus:
            self.describe(event.data_table)

    def on_descendant_focus(self, event) -> None:
        if isinstance(event.widget, DataTable):
            self.describe(event.widget)

    def describe(self, table: DataTable) -> None:
        """Show what the highlighted row of a table is."""
        if table.row_count == 0:
            return
        if table.id == "catalog":
            lines = catalog_lines(self.catalog[table.cursor_row])
        else:
            lines = local_lines(self.local[table.cursor_row])
        self.query_one("#model-info", Static).update("\n".join(lines))

    @on(DataTable.RowSelected, "#local")
    def local_selected(self, event: DataTable.RowSelected) -> None:
        if self.cancel is None:
            self.dismiss(self.local[event.cursor_row].path)

    # ---- download ----

    def action_download(self) -> None:
        table = self.query_one("#catalog", DataTable)
        if self.cancel is not None:
            self.notify("One download at a time; press x to cancel this one", severity="warning")
            return
        if not self.catalog or not table.has_focus:
            self.notify("Highlight a catalog model to download", severity="warning")
            return
        entry = self.catalog[table.cursor_row]
        if entry.bundled:
            self.notify(f"{entry.name} ships with duet; nothing to download")
            return
        self.cancel = threading.Event()
        self.query_one("#download").display = True
        self.query_one("#download-file", Label).update(f"asking the hub about {entry.repo}…")
        self.download_in_background(entry, self.cancel)

    @work(thread=True, group="download")
    def download_in_background(self, entry: CatalogEntry, cancel: threading.Event) -> None:
        try:
            remote = remote_model(entry.repo, entry.files)
            model = download_model(remote, self.app.paths.models_dir,
                                   lambda p: self.post_message(self.Progressed(p)), cancel)
        except DuetError as error:
            self.post_message(self.Finished(None, str(error)))
            return
        self.post_message(self.Finished(model, None))

    def on_models_screen_progressed(self, message: Progressed) -> None:
        p = message.progress
        eta = f" · {p.eta_seconds:.0f} s left" if p.eta_seconds is not None else ""
        self.query_one("#download-file", Label).update(
            f"{p.filename}: {human_size(p.file_done)} of {human_size(p.file_total)}")
        self.query_one("#file-bar", ProgressBar).update(total=max(p.file_total, 1), progress=p.file_done)
        self.query_one("#download-total", Label).update(
            f"all files: {human_size(p.done)} of {human_size(p.total)} · {human_size(p.bytes_per_second)}/s{eta}")
        self.query_one("#total-bar", ProgressBar).update(total=max(p.total, 1), progress=p.done)

    def on_models_screen_finished(self, message: Finished) -> None:
        self.cancel = None
        self.query_one("#download").display = False
        self.report_result(message)

    def on_models_screen_imported(self, message: Imported) -> None:
        self.report_result(message)

    def report_result(self, message: Finished) -> None:
        if message.error:
            self.notify(message.error, title="Nothing was kept", severity="error", timeout=10)
        else:
            self.notify(f"{message.model.name} is ready ({human_size(message.model.size)})")
        self.show_local_models()

    def action_cancel_download(self) -> None:
        if self.cancel is not None:
            self.cancel.set()
            self.query_one("#download-file", Label).update("cancelling…")

    # ---- the plan: bill of bytes and fit, from headers only ----

    def action_plan(self) -> None:
        source = self.highlighted_source()
        if source is None:
            self.notify("Highlight a model in either table to plan it", severity="warning")
            return
        self.query_one("#model-info", Static).update(f"reading the tensor headers of {source[0]}…")
        self.plan_in_background(*source)

    def highlighted_source(self) -> tuple[str, tuple[str, ...]] | None:
        """(folder or hub repo, file patterns) of the highlighted row of the focused table."""
        table = self.focused
        if not isinstance(table, DataTable) or table.row_count == 0:
            return None
        if table.id == "local":
            return str(self.local[table.cursor_row].path), ()
        entry = self.catalog[table.cursor_row]
        bundled = next((m for m in self.local if m.where == "bundled"), None)
        if entry.bundled:
            return (str(bundled.path), ()) if bundled else None
        return entry.repo, entry.files

    @work(thread=True, exclusive=True, group="plan")
    def plan_in_background(self, source: str, patterns: tuple[str, ...]) -> None:
        try:
            plan = plan_model(source, patterns)
        except DuetError as error:
            self.post_message(self.Planned(None, str(error)))
            return
        self.post_message(self.Planned(plan, None))

    def on_models_screen_planned(self, message: Planned) -> None:
        if message.error:
            self.query_one("#model-info", Static).update(f"cannot plan it: {message.error}")
            return
        self.query_one("#model-info", Static).update("\n".join(info_lines(message.plan)))
        self.show_placement(message.plan)

    def show_placement(self, model: ModelPlan) -> None:
        """VRAM and host bars of the plan."""
        plan, memory = model.report.plan, host_memory()
        self.query_one("#vram-label", Label).update(card_summary(plan))
        self.query_one("#vram-bar", ProgressBar).update(total=plan.card.vram, progress=min(plan.used, plan.card.vram))
        self.query_one("#host-label", Label).update(host_summary(plan, memory))
        on_host = sum(plan.on_host.values())
        self.query_one("#host-bar", ProgressBar).update(total=memory, progress=min(on_host, memory))
        self.query_one("#placement").display = True

    # ---- delete and import ----

    def action_delete(self) -> None:
        table = self.query_one("#local", DataTable)
        if not self.local or not table.has_focus:
            self.notify("Highlight a model on disk to delete", severity="warning")
            return
        model = self.local[table.cursor_row]
        question = f"Delete {model.name} ({human_size(model.size)}) from {model.where}?"
        self.app.push_screen(Confirm(question, "Delete"), lambda yes: self.delete_confirmed(model, yes))

    def delete_confirmed(self, model: LocalModel, yes: bool | None) -> None:
        if not yes:
            return
        try:
            freed = delete_model(model)
        except (DuetError, OSError) as error:
            self.notify(str(error), severity="error")
            return
        self.notify(f"Deleted {model.name}; freed {human_size(freed)}")
        self.show_local_models()

    def action_import_folder(self) -> None:
        self.app.push_screen(TextPrompt("Import the model folder at", placeholder="/path/to/model"), self.import_from)

    def import_from(self, folder: str | None) -> None:
        if folder:
            self.import_in_background(Path(folder))

    @work(thread=True, group="import")
    def import_in_background(self, folder: Path) -> None:
        try:
            model = import_model(folder, self.app.paths.models_dir)
        except (DuetError, OSError) as error:
            self.post_message(self.Imported(None, str(error)))
            return
        self.post_message(self.Imported(model, None))


def catalog_lines(entry: CatalogEntry) -> list[str]:
    return [f"{entry.name} · {entry.params} · {entry.format}", entry.description,
            f"repo: {entry.repo}" if entry.repo else "ships with duet",
            f"source: {entry.source}" + (" · community files" if entry.community else "")]


def local_lines(model: LocalModel) -> list[str]:
    try:
        lines = describe_lines(describe_model(model.path))
    except DuetError as error:
        lines = [f"cannot be read: {error}"]
    return [f"{model.name} · {model.path}", *lines]
