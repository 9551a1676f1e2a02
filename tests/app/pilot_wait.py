"""Waiting in Pilot tests: let the app run until a condition holds, within a bound."""

from __future__ import annotations

from types import SimpleNamespace


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
