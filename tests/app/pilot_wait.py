"""Waiting in Pilot tests: let the app run until a condition holds, within a bound; pace the engine so
an action lands while a reply is still being written, on any machine."""

from __future__ import annotations

import time
from types import SimpleNamespace

PASS_SECONDS = 0.02  # a pass of a large model on a consumer GPU, about 50 tok/s


async def wait_for(pilot, condition, timeout: float = 20.0) -> None:
    """Let the app run until condition() holds; fail if it does not within `timeout` seconds."""
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError("the app did not get there in time")


def record_notices(app) -> list[SimpleNamespace]:
    """Every notification the app shows from now on, in order, with its message and title.

    Textual drops a notice from its own list when it expires (5 s); on a loaded machine a test can
    reach its check later than that, so tests read this record instead."""
    shown: list[SimpleNamespace] = []
    notify = app.notify

    def recording(message, *args, title: str = "", **kwargs):
        shown.append(SimpleNamespace(message=message, title=title))
        return notify(message, *args, title=title, **kwargs)

    app.notify = recording
    return shown


def pace(lm, seconds: float = PASS_SECONDS) -> None:
    """Make each forward pass of the tiny model take at least `seconds`, as a real model's does on a GPU:
    a real slow-down (the engine runs every pass) so a test's actions land while the reply is written:
    a reply of 2,000 tokens then takes 40 s, whatever the machine."""
    forward = lm.model.forward

    def paced_forward(*args, **kwargs):
        started = time.perf_counter()
        out = forward(*args, **kwargs)
        time.sleep(max(0.0, seconds - (time.perf_counter() - started)))
        return out

    lm.model.forward = paced_forward
