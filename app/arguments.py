"""The engine's flags (model, route, acceptance, drafts, KV cache, context), for every command that runs
a model, and flags that take one of the engine's words (engine.choices)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path

from duet.app.catalog import find_local
from duet.app.session import EngineChoices
from duet.app.settings import Config, Paths, bundled_demo_model
from duet.engine import Accept, Draft, DuetError, KVCache, Route, check_moe_skip

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


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose a model and how the engine runs it: `duet`, `duet --headless`, `duet serve`."""
    parser.add_argument("--model", help="model folder (default: the bundled demo model)")
    parser.add_argument("--route", **choice(Route), default=Route.AUTO,
                        help="kernel route: auto picks the checkpoint's natural one (bf16 for float weights, "
                             "w4a16 for INT4 safetensors, w4a8 for quantized GGUF)")
    parser.add_argument("--accept", **choice(Accept), default=Accept.EXACT,
                        help="speculative acceptance: exact keeps the model's distribution, lossy keeps more drafts")
    parser.add_argument("--context", type=int, help="token budget for prompt + reply (default: the model's)")
    parser.add_argument("--kv", **choice(RUNNABLE_KV, RENAMED_KV | PLANNING_ONLY_KV), default=KVCache.BF16,
                        help="attention KV cache: bf16 (16-bit rows; the CPU keeps fp32), or q4 (4-bit, "
                             "Hadamard-rotated, exact sink and recent rows)")
    parser.add_argument("--host-tables", action="store_true",
                        help="rank the vocabulary with an int4 copy of the head and rescore the best 64 with the "
                             "bf16 rows, as on a card whose bf16 tables live in host memory: greedy ids unchanged, "
                             "sampling limited to those 64")
    parser.add_argument("--moe-skip", type=float, default=0.0, metavar="BUDGET",
                        help="MoE, lossy: skip off-card experts of a row within this share of its router weight, "
                             "its first five routes kept (llamAmpere's --moe-skip; needs --accept lossy)")
    parser.add_argument("--draft", **choice(Draft), default=Draft.AUTO,
                        help="drafter: auto uses the MTP head when the checkpoint has one, else n-gram lookup")
    parser.add_argument("--depth", default="auto",
                        help="drafts per cycle: auto (adaptive) or a number up to 4 (MTP) / 7 (n-gram)")


def engine_choices(args: argparse.Namespace) -> EngineChoices:
    """The engine choices of `duet`, `duet --headless` and `duet serve` (`--draft`, `--depth`, `--kv`,
    `--host-tables`, `--moe-skip`)."""
    check_moe_skip(args.moe_skip, args.accept)
    return EngineChoices(args.draft, parse_depth(args.depth), args.kv, args.host_tables, args.moe_skip)


def parse_depth(value: str) -> int | None:
    if value == "auto":
        return None
    if not value.isdigit():
        raise DuetError(f"--depth takes auto or a whole number (got {value!r})")
    return int(value)


def chat_model_path(name: str | None, config: Config, paths: Paths) -> Path:
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
