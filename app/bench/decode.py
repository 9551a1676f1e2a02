"""`duet bench decode`: prefill and greedy decode tok/s of our engine against transformers eager, on the
same weights with the same threads, measured in turns in one run."""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from duet.app.bench.common import (
    WARMUP_PROMPT_TOKENS, Engine, Run, blas_threads, geometry, ours_engine, positive_int, random_prompt,
    require_reference,
)
from duet.engine.config import ModelConfig
from duet.engine.errors import DuetError
from duet.engine.loader import load_model
from duet.engine.model import Model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model folder (config.json and safetensors; no tokenizer needed)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=128, help="prefill length P (default 128)")
    parser.add_argument("--new-tokens", type=positive_int, default=32,
                        help="decode steps N after the token prefill produced, one token each (default 32)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="interleaved runs per engine; best counts (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with all figures")


@dataclass(frozen=True)
class Rates:
    prefill_tok_s: float
    decode_tok_s: float


def run(args: argparse.Namespace) -> int:
    model_dir = Path(args.model).expanduser()
    if not model_dir.is_dir():
        raise DuetError(f"{model_dir}: no such model folder; pass --model with a folder holding config.json")
    config = ModelConfig.from_file(model_dir / "config.json")
    require_reference("decode")
    threads = blas_threads()
    with TransformersProcess(model_dir, threads) as reference:
        engines = {"duet": ours_engine(load_ours(model_dir)), "transformers": reference}
        prompt = random_prompt(config.vocab_size, args.prompt_tokens)
        runs = interleaved_runs(engines, prompt, args.new_tokens, args.repeats)
    result = decode_result(config, threads, reference.torch_threads, args, runs)
    if not result["tokens_agree"]:
        print(f"duet bench decode: warning: greedy tokens of duet and transformers differ from token "
              f"{result['first_mismatch']} on", file=sys.stderr)
    print(json.dumps(result) if args.json else decode_table(result))
    return 0


def load_ours(model_dir: Path) -> Model:
    return load_model(model_dir, route="bf16", tokenizer=False, backend="cpu").model


def load_transformers(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def transformers_engine(model) -> Engine:
    """Cached greedy decode by hand (not `generate()`), so both engines do the same work.

    Prefill keeps the logits of the last row only (`logits_to_keep=1`). Ours goes one step further,
    as the app's own prefill does when no MTP drafter reads the prompt rows: its last layer runs the
    query, output projection and feed-forward for the last row alone (Model.forward's last_only,
    3.5% of the products of a 0.8B prefill); transformers offers no such switch.
    """
    import torch
    from transformers import DynamicCache

    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def next_token(ids: list[int], cache) -> int:
        out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{cache_kwarg: cache})
        return int(out.logits[0, -1].argmax())

    def timed_greedy(prompt: list[int], steps: int) -> Run:
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            started = time.perf_counter()
            tokens = [next_token(prompt, cache)]
            prefilled = time.perf_counter()
            for _ in range(steps):
                tokens.append(next_token(tokens[-1:], cache))
            return Run(prefilled - started, time.perf_counter() - prefilled, tokens)

    return timed_greedy


class TransformersProcess:
    """The transformers engine in a process of its own, taking turns with ours on request.

    Our engine changes process-wide settings (glibc's allocator, numpy's BLAS thread pool); in one
    process they sped transformers up too (its 128-token prefill at 2 threads: 71.8 -> 82.7 and
    85.8 -> 100.8 tok/s with our allocator setting), so the reference would not be the transformers
    a user runs. A spawned child starts from a fresh interpreter; the two still take turns, so
    machine noise hits both.
    """

    def __init__(self, model_dir: Path, threads: int):
        context = multiprocessing.get_context("spawn")
        self._pipe, child_end = context.Pipe()
        self._process = context.Process(target=serve_transformers, args=(str(model_dir), threads, child_end),
                                        name="duet-bench-transformers", daemon=True)
        self._process.start()
        child_end.close()
        self.pid = self._process.pid
        self.torch_threads = self._reply()

    def __call__(self, prompt: list[int], steps: int) -> Run:
        self._pipe.send((prompt, steps))
        return self._reply()

    def _reply(self):
        try:
            kind, value = self._pipe.recv()
        except EOFError:
            raise DuetError("the transformers process of the benchmark ended without a reply; run it again to see why") from None
        if kind == "error":
            raise DuetError(f"transformers could not run the benchmark: {value}")
        return value

    def __enter__(self) -> TransformersProcess:
        return self

    def __exit__(self, *exc) -> None:
        if self._process.is_alive():
            self._pipe.send(None)
            self._process.join(timeout=30)
        self._process.kill()
        self._pipe.close()


def serve_transformers(model_dir: str, threads: int, pipe) -> None:
    """The child's loop: load once, then one timed run per (prompt, steps) request until None."""
    try:
        import torch

        torch.set_num_threads(threads)
        engine = transformers_engine(load_transformers(Path(model_dir)))
        pipe.send(("ready", torch.get_num_threads()))
        while (request := pipe.recv()) is not None:
            pipe.send(("run", engine(*request)))
    except Exception as error:  # reported to the parent as one line
        pipe.send(("error", f"{type(error).__name__}: {error}"))


def interleaved_runs(engines: dict[str, Engine], prompt: list[int], steps: int, repeats: int) -> dict[str, list[Run]]:
    """One untimed warm-up each, then the engines take turns (first place alternating) so noise hits both."""
    for timed_greedy in engines.values():
        timed_greedy(prompt[:WARMUP_PROMPT_TOKENS], 1)
    runs: dict[str, list[Run]] = {name: [] for name in engines}
    names = list(engines)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else reversed(names):
            runs[name].append(engines[name](prompt, steps))
    return runs


def best_rates(runs: list[Run], prompt_tokens: int, steps: int) -> Rates:
    return Rates(prompt_tokens / min(r.prefill_s for r in runs), steps / min(r.decode_s for r in runs))


def first_mismatch(ours: list[int], theirs: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)


def decode_result(config: ModelConfig, numpy_threads: int, torch_threads: int, args: argparse.Namespace,
                  runs: dict[str, list[Run]]) -> dict:
    P, N = args.prompt_tokens, args.new_tokens
    ours, theirs = best_rates(runs["duet"], P, N), best_rates(runs["transformers"], P, N)
    mismatch = first_mismatch(runs["duet"][0].tokens, runs["transformers"][0].tokens)
    return {
        "benchmark": "decode",
        "model": str(Path(args.model).expanduser().resolve()),
        "geometry": geometry(config),
        "threads": {"numpy_blas": numpy_threads, "torch": torch_threads},
        "prompt_tokens": P,
        "new_tokens": N,
        "repeats": args.repeats,
        "duet": asdict(ours),
        "transformers": asdict(theirs),
        "ratio": {"prefill": ours.prefill_tok_s / theirs.prefill_tok_s, "decode": ours.decode_tok_s / theirs.decode_tok_s},
        "tokens_agree": mismatch is None,
        "first_mismatch": mismatch,
    }


def decode_table(result: dict) -> str:
    g, threads = result["geometry"], result["threads"]
    ours, theirs, ratio = result["duet"], result["transformers"], result["ratio"]
    agree = "agree" if result["tokens_agree"] else "DIFFER (see the warning above)"
    return "\n".join([
        f"{result['model']}: {g['model_type']}, {g['layers']} layers ({g['full_attention_layers']} full attention), "
        f"hidden {g['hidden']}, vocab {g['vocab']}",
        f"prompt {result['prompt_tokens']} tokens, {result['new_tokens']} decode steps, best of {result['repeats']}; "
        f"threads: numpy BLAS {threads['numpy_blas']}, torch {threads['torch']}",
        "",
        f"{'engine':<25}{'prefill tok/s':>14}{'decode tok/s':>14}",
        f"{'duet (numpy)':<25}{ours['prefill_tok_s']:>14.2f}{ours['decode_tok_s']:>14.2f}",
        f"{'transformers eager':<25}{theirs['prefill_tok_s']:>14.2f}{theirs['decode_tok_s']:>14.2f}",
        f"{'ratio duet/transformers':<25}{ratio['prefill']:>13.2f}x{ratio['decode']:>13.2f}x",
        "",
        f"greedy tokens: {agree}",
    ])
