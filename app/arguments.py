"""Flags that take one of the engine's words (engine.choices), for every command that has them."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from enum import StrEnum

from duet.engine import KVCache

RUNNABLE_KV = tuple(kv for kv in KVCache if kv.runs)
# What to say, instead of "invalid choice", to a KV cache word a command does not take.
RENAMED_KV = {"full": f"'full' is now called '{KVCache.BF16}'"}
PLANNING_ONLY_KV = {str(kv): f"'{kv}' is for planning only (duet models info); duet runs "
                             f"{' or '.join(repr(str(runs)) for runs in RUNNABLE_KV)}" for kv in KVCache if not kv.runs}


def choice(words: Iterable[StrEnum], retired: dict[str, str] | None = None) -> dict:
    """argparse keywords for one of `words`: the help lists them, the value is the enum member, and a
    wrong word is one line naming the choices (or, for a `retired` word, what to write instead)."""
    allowed = tuple(words)

    def one_of(text: str) -> StrEnum:
        for word in allowed:
            if word == text:
                return word
        if retired and text in retired:
            raise argparse.ArgumentTypeError(retired[text])
        names = ", ".join(repr(str(word)) for word in allowed)
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {names})")

    return {"type": one_of, "choices": allowed}
