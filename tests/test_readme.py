"""README's first command is a new user's first impression: it must sample as the chat app does,
and what it prints on the bundled demo model must not be a loop."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from duet.app.cli import main
from duet.app.settings import Config

README = Path(__file__).resolve().parents[1] / "README.md"


def first_duet_command() -> list[str]:
    """The arguments of the `duet ...` that ends README's first shell block."""
    block = re.search(r"```sh\n(.*?)```", README.read_text(encoding="utf-8"), re.S).group(1)
    words = shlex.split(block.strip().split("&&")[-1])
    assert words[0] == "duet"
    return words[1:]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def longest_repeat(tokens: list[int], n: int = 6) -> int:
    """How often the most frequent run of n tokens occurs."""
    runs = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return max((runs.count(r) for r in set(runs)), default=0)


def reply_tokens(capsys, args: list[str]) -> list[int]:
    capsys.readouterr()
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["tokens"]


def test_the_first_command_samples_with_the_chat_defaults():
    args = first_duet_command()
    defaults = Config()
    assert float(flag(args, "--temperature")) == defaults.temperature
    assert int(flag(args, "--top-k")) == defaults.top_k
    assert float(flag(args, "--top-p")) == defaults.top_p


def test_the_first_command_does_not_loop_where_greedy_decoding_does(capsys):
    args = first_duet_command()
    greedy = [a for i, a in enumerate(args) if not (a.startswith("--t") or args[i - 1].startswith("--t"))]
    assert "--temperature" not in greedy and "--top-k" not in greedy
    # Negative control: the greedy reply repeats a six-token phrase ("and will make thee a land of Egypt").
    assert longest_repeat(reply_tokens(capsys, greedy)) >= 3
    for seed in range(3):
        assert longest_repeat(reply_tokens(capsys, [*args, "--seed", str(seed)])) < 3
