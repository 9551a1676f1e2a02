"""Waiting in Pilot tests: let the app run until a condition holds, within a bound."""

from __future__ import annotations


async def wait_for(pilot, condition, timeout: float = 20.0) -> None:
    """Let the app run until condition() holds; fail if it does not within `timeout` seconds."""
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError("the app did not get there in time")
