"""The models screen under Pilot: catalog, models on disk, download through a local hub, delete, import."""

from __future__ import annotations

import pytest
from fake_hub import FakeHub
from pilot_wait import record_notices, wait_for
from textual.widgets import DataTable, Input, Label

from duet.app import catalog as catalog_module
from duet.app.catalog import import_model
from duet.app.settings import Config, user_paths
from duet.app.session import EngineChoices, Launch
from duet.app.ui.app import DuetApp
from duet.app.ui.screens.chat import ChatScreen
from duet.app.ui.screens.dialogs import Confirm, TextPrompt
from duet.app.ui.screens.models import ModelsScreen

SIZE = (140, 45)
REPO = "duet-tests/tiny"
pytestmark = pytest.mark.anyio

CATALOG = """
[[model]]
name = "tiny-remote"
repo = "duet-tests/tiny"
format = "bf16"
params = "tiny"
description = "a tiny model on the local test hub"
source = "tests"

[[model]]
name = "locked"
repo = "duet-tests/locked"
format = "bf16"
params = "tiny"
community = true
description = "a repo the hub refuses without a token"
source = "tests"
"""


@pytest.fixture
def hub(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG)
    monkeypatch.setattr(catalog_module, "catalog_path", lambda: catalog)
    with FakeHub() as fake:
        fake.add_folder(REPO, tiny_model)
        fake.add_folder("duet-tests/locked", tiny_model)
        fake.repo_status["duet-tests/locked"] = 401
        monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
        yield fake


def make_app(model) -> DuetApp:
    app = DuetApp(user_paths(), Config(max_tokens=8), Launch(model, choices=EngineChoices(draft="none")))
    app.notices = record_notices(app)
    return app


async def open_models(pilot) -> ModelsScreen:
    chat = pilot.app.screen
    await wait_for(pilot, lambda: chat.host.lm is not None)
    await pilot.press("f3")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ModelsScreen))
    return pilot.app.screen


def rows(screen: ModelsScreen, table: str) -> list[str]:
    data = screen.query_one(table, DataTable)
    return [str(data.get_row_at(i)[0]) for i in range(data.row_count)]


def highlight(screen: ModelsScreen, table: str, name: str) -> None:
    data = screen.query_one(table, DataTable)
    data.focus()
    data.move_cursor(row=rows(screen, table).index(name))


def notes(app) -> list[str]:
    return [n.message for n in app.notices]


async def test_lists_the_catalog_and_models_on_disk_and_describes_them(hub, tiny_model):
    import_model(tiny_model, user_paths().models_dir, "imported")
    app = make_app(tiny_model)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        assert rows(screen, "#catalog") == ["tiny-remote", "locked"]
        assert "imported" in rows(screen, "#local")
        highlight(screen, "#catalog", "locked")
        await pilot.pause()
        info = str(screen.query_one("#model-info").render())
        assert "refuses without a token" in info and "community" in info
        highlight(screen, "#local", "imported")
        await pilot.pause()
        info = str(screen.query_one("#model-info").render())
        assert "5 layers (4 DeltaNet + 1 attention)" in info and "on disk" in info
        await pilot.press("escape")
        assert isinstance(app.screen, ChatScreen)


async def test_enter_on_a_model_on_disk_loads_it_for_chat(hub, tiny_model):
    import_model(tiny_model, user_paths().models_dir, "other")
    app = make_app(tiny_model)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        highlight(screen, "#local", "other")
        await pilot.press("enter")
        chat = app.screen
        assert isinstance(chat, ChatScreen)
        await wait_for(pilot, lambda: chat.host.lm is not None and chat.host.lm.name == "other")
        assert "other" in str(chat.query_one("#model-name", Label).render())


async def test_download_shows_progress_and_registers_the_model(hub, tiny_model):
    hub.slow["model.safetensors"] = 0.02
    app = make_app(tiny_model)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        highlight(screen, "#catalog", "tiny-remote")
        await pilot.press("d")
        assert screen.query_one("#download").display
        await wait_for(pilot, lambda: "all files" in str(screen.query_one("#download-total", Label).render()))
        await wait_for(pilot, lambda: screen.cancel is None)
        assert "duet-tests--tiny" in rows(screen, "#local")
        assert any("duet-tests--tiny is ready" in n for n in notes(app))
        assert not screen.query_one("#download").display


async def test_cancel_keeps_nothing(hub, tiny_model, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 1 << 14)
    hub.slow["model.safetensors"] = 0.2
    app = make_app(tiny_model)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        highlight(screen, "#catalog", "tiny-remote")
        await pilot.press("d")
        await wait_for(pilot, lambda: "model.safetensors" in str(screen.query_one("#download-file", Label).render()))
        await pilot.press("escape")
        assert app.screen is screen  # a running download keeps the screen open
        await pilot.press("x")
        await wait_for(pilot, lambda: screen.cancel is None)
        assert any("cancelled; nothing was kept" in n for n in notes(app))
        assert "duet-tests--tiny" not in rows(screen, "#local")


async def test_a_refused_download_says_to_set_hf_token(hub, tiny_model):
    app = make_app(tiny_model)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        highlight(screen, "#catalog", "locked")
        await pilot.press("d")
        await wait_for(pilot, lambda: screen.cancel is None)
        assert any("HF_TOKEN" in n and "401" in n for n in notes(app))
        assert "duet-tests--locked" not in rows(screen, "#local")


async def test_delete_says_what_it_freed(hub, tiny_model):
    model = import_model(tiny_model, user_paths().models_dir, "doomed")
    app = make_app(tiny_model)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        highlight(screen, "#local", "doomed")
        await pilot.press("delete")
        assert isinstance(app.screen, Confirm)
        await pilot.click("#yes")
        await pilot.pause()
        assert "doomed" not in rows(screen, "#local") and not model.path.exists()
        assert any(n.startswith("Deleted doomed; freed ") for n in notes(app))


async def test_import_checks_the_folder_first(hub, tiny_model, tmp_path):
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "config.json").write_text('{"model_type": "llama"}')
    app = make_app(tiny_model)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        for folder in (not_a_model, tiny_model):
            await pilot.press("i")
            assert isinstance(app.screen, TextPrompt)
            app.screen.query_one(Input).value = str(folder)
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(app.notices) > 0)
            await pilot.pause(0.3)
        assert any("config.json" in n for n in notes(app))
        assert "not-a-model" not in rows(screen, "#local") and "tiny" in rows(screen, "#local")


async def test_plan_a_model_on_disk_shows_the_bill_and_the_bars(hub, tiny_model):
    import_model(tiny_model, user_paths().models_dir, "planned")
    app = make_app(tiny_model)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        highlight(screen, "#local", "planned")
        await pilot.press("p")
        await wait_for(pilot, lambda: screen.query_one("#placement").display)
        assert "verify pass" in str(screen.query_one("#model-info").render())
        vram = str(screen.query_one("#vram-label", Label).render())
        assert " fits at 4,096 tokens" in vram and "GiB" in vram
        assert "host memory" in str(screen.query_one("#host-label", Label).render())


async def test_plan_a_catalog_model_reads_only_its_headers_from_the_hub(hub, tiny_model):
    app = make_app(tiny_model)
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_models(pilot)
        highlight(screen, "#catalog", "tiny-remote")
        await pilot.press("p")
        await wait_for(pilot, lambda: screen.query_one("#placement").display)
        assert "verify pass" in str(screen.query_one("#model-info").render())
        assert "duet-tests--tiny" not in rows(screen, "#local")  # planning downloads nothing
        highlight(screen, "#catalog", "locked")
        await pilot.press("p")
        await wait_for(pilot, lambda: "cannot plan it" in str(screen.query_one("#model-info").render()))
        assert "HF_TOKEN" in str(screen.query_one("#model-info").render())
