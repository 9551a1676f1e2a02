"""The benchmark registry drives `duet bench`'s subcommands, their flags and the help that names them."""

from __future__ import annotations

import argparse

import pytest

from duet.app.bench import BENCHMARKS, add_bench_commands
from duet.app.cli import main

FLAGS = {  # each benchmark's flags, as they were before the registry
    "cpu": {"--model", "--llama-bench", "--prompt-tokens", "--tokens", "--threads", "--repeats", "--json"},
    "decode": {"--model", "--prompt-tokens", "--new-tokens", "--repeats", "--json"},
    "make-random": {"--geometry", "--out", "--layers"},
    "quality": {"--model", "--vs", "--tokens", "--json"},
    "routes": {"--model", "--new-tokens", "--repeats", "--json"},
    "spec": {"--model", "--max-tokens", "--temperature", "--seed", "--repeats", "--json"},
    "trellis": {"--json"},
    "gpu": {"--json", "--repeats", "--layers", "--table"},
    "heads": {"--geometry", "--repeats", "--rows", "--json"},
}


def bench_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser()
    add_bench_commands(parser)
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(commands.choices)


def test_every_registered_benchmark_is_a_subcommand_with_its_flags():
    parsers = bench_parsers()
    assert list(parsers) == [b.name for b in BENCHMARKS] and set(parsers) == set(FLAGS)
    for name, parser in parsers.items():
        flags = {flag for action in parser._actions for flag in action.option_strings} - {"-h", "--help"}
        assert flags == FLAGS[name], name
        assert callable(parser.get_default("run"))


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_the_help_names_every_benchmark_with_its_line(capsys):
    code, out, _ = run_cli(capsys, "bench", "--help")
    assert code == 0
    flat = " ".join(out.split())
    assert all(b.name in flat and " ".join(b.help.split()) in flat for b in BENCHMARKS)
    _, out, _ = run_cli(capsys, "--help")
    assert "duet bench {" + ",".join(b.name for b in BENCHMARKS) + "}" in " ".join(out.split())


def test_an_unknown_benchmark_is_one_line(capsys):
    code, _, err = run_cli(capsys, "bench", "fastest")
    assert code == 2 and err.count("\n") == 1 and "invalid choice: 'fastest'" in err
