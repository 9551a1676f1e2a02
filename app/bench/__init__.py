"""`duet bench NAME`: benchmarks that print ratios measured side by side in one run.

BENCHMARKS is the registry: a name, a one-line help, and the module of app.bench whose
`add_arguments(parser)` adds the benchmark's flags and whose `run(args)` runs it and returns the exit
code. It builds `duet bench`'s subcommands and the names `duet --help` lists. A module is imported
only when `duet bench` is parsed; torch and transformers (the `test` extra) and CuPy only inside the
benchmarks that need them.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    name: str
    help: str
    module: str  # duet.app.bench.<module>: add_arguments(parser) and run(args)


BENCHMARKS = (
    Benchmark("decode", "prefill and greedy decode tok/s: ours against transformers eager, same weights and threads",
              "decode"),
    Benchmark("make-random", "write a random fp32 checkpoint with a real model's geometry", "make_random"),
    Benchmark("quality", "mean KL divergence and top-1 agreement of B's next-token distributions against A's",
              "quality"),
    Benchmark("routes", "per route: the GEMV's weight bytes streamed per second and greedy decode tok/s", "routes"),
    Benchmark("spec", "tokens per cycle and tok/s of each drafter and rule against no drafts", "spec"),
    Benchmark("trellis", "trellis-code MSE on unit Gaussians against grids and the Shannon bound", "trellis"),
    Benchmark("gpu", "W4 GEMVs and the decode cycle on the GPU against copy bandwidth, both routes", "gpu"),
    Benchmark("heads", "ms per row of the full head, the draft shortlist and host tables", "heads"),
    Benchmark("cpu", "load, prefill and decode tok/s and what drafts buy on the CPU; with --llama-bench, llama.cpp "
              "on the same GGUF file", "cpu"),
)


def add_bench_commands(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for benchmark in BENCHMARKS:
        module = importlib.import_module(f"duet.app.bench.{benchmark.module}")
        command = commands.add_parser(benchmark.name, help=benchmark.help)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
