"""Errors a user can act on. Each carries one line: what is wrong, and what to do about it.

The CLI prints `str(error)` and exits 2; the UI shows it in a notification. Anything that is not a
DuetError is a bug in duet and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path


class DuetError(Exception):
    """A user-facing error: the message is a single line that names the problem and the remedy."""

    def __init__(self, message: str):
        super().__init__(one_line(message))


class CheckpointError(DuetError):
    """A model file that cannot be used as it is (missing, truncated, malformed, unsupported)."""

    def __init__(self, path: str | Path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


def one_line(text: str) -> str:
    """`text` with line breaks and other unprintable characters escaped (`\\n`): a name read from a
    hostile file (a tensor called "a\\nTraceback ...") cannot break the message into several lines."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
