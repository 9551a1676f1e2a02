"""A duet app killed with SIGKILL while a reply streams keeps every message completed before it."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import build_reference, save_reference

from duet.app.settings import user_paths
from duet.app.store import Store

DRIVER = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from textual.widgets import Input
    from duet.app.settings import Config, user_paths
    from duet.app.session import EngineChoices, Launch
    from duet.app.ui.app import DuetApp

    async def until(pilot, condition, what, seconds=30):
        for _ in range(int(seconds / 0.05)):
            if condition():
                return
            await pilot.pause(0.05)
        raise SystemExit(f"timed out waiting for {what}")

    async def drive():
        launch = Launch(Path(sys.argv[1]), choices=EngineChoices(draft="none"))
        app = DuetApp(user_paths(), Config(max_tokens=int(sys.argv[2])), launch)
        async with app.run_test(size=(120, 40)) as pilot:
            screen = app.screen
            # a fresh clone compiles the CPU kernels first (about 30 s on two busy cores)
            await until(pilot, lambda: screen.host.lm is not None, "the model", seconds=240)
            for text in ("first message", "second message"):
                screen.query_one("#prompt", Input).value = text
                await pilot.press("enter")
                await until(pilot, lambda: not screen.streaming, f"the reply to {text!r} to end")
            app.config.max_tokens = 1_000_000  # the third reply streams until killed (see CONTEXT)
            screen.query_one("#prompt", Input).value = "third message"
            await pilot.press("enter")
            await until(pilot, lambda: screen.streaming and screen.reply_view.text, "the third reply to stream")
            print("STREAMING", flush=True)
            await asyncio.sleep(60)

    asyncio.run(drive())
""")


CONTEXT = 262_144


def test_sigkill_mid_reply_loses_no_completed_message(tmp_path, monkeypatch):
    # A context long enough that the third reply still streams when the driver looks: at 4,096
    # positions this model filled it in 0.8 s, sometimes before the UI's polls saw it streaming.
    model = save_reference(build_reference("qwen3_5_text", max_position_embeddings=CONTEXT), tmp_path / "endless")
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    del tokenizer_config["eos_token"]  # replies run to max_tokens unless stopped
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    monkeypatch.setenv("DUET_HOME", str(tmp_path / "home"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    log = tmp_path / "driver.log"  # the driver's stderr: why it stopped, when it stops before streaming
    with open(log, "wb") as stderr:
        app = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", DRIVER, str(model), "6"],
                               stdout=subprocess.PIPE, stderr=stderr, env=env)
        try:
            said = app.stdout.readline()
            assert said == b"STREAMING\n", f"the driver said {said!r}, exit {app.poll()}; its stderr ends:\n{log.read_text()[-3000:]}"
        finally:
            app.send_signal(signal.SIGKILL)
            app.wait(timeout=10)

    database = user_paths().database
    with sqlite3.connect(database) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    store = Store(database)
    (conversation,) = store.conversations()
    messages = store.messages(conversation.id)
    store.close()
    assert [(m.role, m.content) for m in messages[::2]] == [
        ("user", "first message"), ("user", "second message"), ("user", "third message")]
    assert [m.role for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert all(m.finish_reason == "length" and m.stats["generated_tokens"] == 6 for m in messages[1:4:2])
