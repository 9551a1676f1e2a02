"""The duet Textual app: opens the chat screen on a model; everything else lives in screens/ and widgets/."""

from __future__ import annotations

from textual.app import App
from textual.binding import Binding

from duet.app.session import Launch
from duet.app.settings import Config, Paths, save_config
from duet.app.store import Store
from duet.app.ui.screens.chat import ChatScreen


class DuetApp(App):
    CSS_PATH = "duet.tcss"
    TITLE = "duet"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", id="app.quit", priority=True),
                Binding("f1", "toggle_keys", "Keys", id="app.keys")]

    def __init__(self, paths: Paths, config: Config, launch: Launch):
        super().__init__()
        self.paths, self.config, self.launch = paths, config, launch
        self.store = Store(paths.database)

    def action_toggle_keys(self) -> None:
        """Every key of the screen in view, in a side panel (Textual's help panel); F1 again hides it."""
        if self.screen.query("HelpPanel"):
            self.action_hide_help_panel()
        else:
            self.action_show_help_panel()

    def on_mount(self) -> None:
        self.set_keymap(self.config.keys)
        self.push_screen(ChatScreen(self.launch))

    def on_unmount(self) -> None:
        self.store.close()

    def save_config(self) -> None:
        save_config(self.config, self.paths.config_file)


def run_ui(paths: Paths, config: Config, launch: Launch) -> int:
    """The chat UI until the user quits."""
    DuetApp(paths, config, launch).run()
    return 0
