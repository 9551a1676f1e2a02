"""The duet Textual app: opens the chat screen on a model; everything else lives in screens/ and widgets/."""

from __future__ import annotations

import argparse
from pathlib import Path

from textual.app import App
from textual.binding import Binding

from app.catalog import find_local
from app.headless import parse_depth
from app.session import EngineChoices, Launch
from app.settings import Config, Paths, bundled_demo_model, load_config, save_config, user_paths
from app.store import Store
from app.ui.screens.chat import ChatScreen
from engine.errors import DuetError

HEADLESS_ONLY = ("raw", "json", "max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "presence_penalty", "seed")


class DuetApp(App):
    CSS_PATH = "duet.tcss"
    TITLE = "duet"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", id="app.quit", priority=True)]

    def __init__(self, paths: Paths, config: Config, launch: Launch):
        super().__init__()
        self.paths, self.config, self.launch = paths, config, launch
        self.store = Store(paths.database)

    def on_mount(self) -> None:
        self.set_keymap(self.config.keys)
        launch = self.launch
        self.push_screen(ChatScreen(launch))

    async def action_quit(self) -> None:
        for screen in self.screen_stack:
            if isinstance(screen, ChatScreen):
                screen.stop_and_wait()
        self.exit()

    def on_unmount(self) -> None:
        self.store.close()

    def save_config(self) -> None:
        save_config(self.config, self.paths.config_file)


def run_ui(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`duet [--model M] [--route R] [--accept A] [--draft D] [--depth N] [--kv K] [--context N]`: the chat UI."""
    given = [name for name in HEADLESS_ONLY if getattr(args, name) != parser.get_default(name)]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise DuetError(f"{flag} applies to --headless; in the chat UI set replies up with ctrl+s")
    paths = user_paths()
    config = load_config(paths.config_file)
    launch = Launch(model_path(args.model, config, paths), args.route, args.context,
                    EngineChoices(args.draft, parse_depth(args.depth), args.kv, args.host_tables), args.accept)
    DuetApp(paths, config, launch).run()
    return 0


def model_path(name: str | None, config: Config, paths: Paths) -> Path:
    """--model, else the config's model: a folder or .gguf file, or a name from `duet models list`; else the demo."""
    name = name or config.model
    folder = Path(name).expanduser() if name else bundled_demo_model()
    if folder.exists():
        return folder
    found = find_local(name, paths.models_dir) if name else None
    if found is None:
        raise DuetError(f"{folder}: no such model folder or file, and no model of that name on disk; "
                        "see duet models list")
    return found.path
