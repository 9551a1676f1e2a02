"""`duet bench ...`: benchmarks that print ratios measured side by side in one run.

    duet bench decode --model DIR          our engine against transformers eager, same weights, same threads
    duet bench make-random --out DIR       a random checkpoint with a real model's geometry to run it on
    duet bench quality --model A --vs B    mean KL and top-1 agreement of B's routes against A over a fixed text
    duet bench routes --model DIR          each route's GEMV weight bytes/s and decode tok/s on one checkpoint
    duet bench spec [--model DIR]          tokens per cycle and tok/s of each drafter and rule against no drafts
    duet bench heads                       ms per row of the full head, the draft shortlist and host tables

Each benchmark is a sibling sub-subcommand: an `add_*` function registers its arguments and sets
`run`, which returns the exit code. torch and transformers (the `test` extra) are imported only
inside the commands that need them.
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from app.bench_gpu import add_gpu_command
from app.bench_trellis import add_trellis_command
from app.bench_spec import add_spec_command
from engine.config import FULL_ATTENTION, ModelConfig
from engine.errors import DuetError
from engine.loader import load_model, open_model
from engine.model import Model

PROMPT_SEED = 0
WARMUP_PROMPT_TOKENS = 8

# Text geometries of real checkpoints, as Qwen3_5TextConfig arguments (REFERENCE.md section 1).
GEOMETRIES = {
    "qwen3.5-0.8b": dict(
        vocab_size=248320, hidden_size=1024, num_hidden_layers=24, intermediate_size=3584,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, tie_word_embeddings=True, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    ),
}


def add_bench_commands(parser: argparse.ArgumentParser) -> None:
    benchmarks = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    add_decode_command(benchmarks)
    add_make_random_command(benchmarks)
    add_quality_command(benchmarks)
    add_routes_command(benchmarks)
    add_spec_command(benchmarks)
    add_trellis_command(benchmarks)
    add_gpu_command(benchmarks)
    from app.bench_heads import add_heads_command  # here: bench_heads reads this module's GEOMETRIES

    add_heads_command(benchmarks)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {value})")
    return value


# --------------------------------------------------------------------------------------------
# duet bench decode


def add_decode_command(benchmarks) -> None:
    decode = benchmarks.add_parser(
        "decode", help="prefill and greedy decode tok/s: ours against transformers eager, same weights and threads")
    decode.add_argument("--model", required=True, help="model folder (config.json and safetensors; no tokenizer needed)")
    decode.add_argument("--prompt-tokens", type=positive_int, default=128, help="prefill length P (default 128)")
    decode.add_argument("--new-tokens", type=positive_int, default=32,
                        help="decode steps N after the token prefill produced, one token each (default 32)")
    decode.add_argument("--repeats", type=positive_int, default=3, help="interleaved runs per engine; best counts (default 3)")
    decode.add_argument("--json", action="store_true", help="print one JSON object with all figures")
    decode.set_defaults(run=run_decode_bench)


@dataclass(frozen=True)
class Run:
    """One timed generation: prefill of the prompt, then one forward pass per decode step."""

    prefill_s: float
    decode_s: float
    tokens: list[int]  # greedy: the one prefill produced, then one per decode step


@dataclass(frozen=True)
class Rates:
    prefill_tok_s: float
    decode_tok_s: float


Engine = Callable[[list[int], int], Run]  # (prompt ids, decode steps) -> Run


def run_decode_bench(args: argparse.Namespace) -> int:
    model_dir = Path(args.model).expanduser()
    if not model_dir.is_dir():
        raise DuetError(f"{model_dir}: no such model folder; pass --model with a folder holding config.json")
    config = ModelConfig.from_file(model_dir / "config.json")
    require_reference("decode")
    threads = blas_threads()
    with TransformersProcess(model_dir, threads) as reference:
        engines = {"duet": ours_engine(load_ours(model_dir, config)), "transformers": reference}
        prompt = random_prompt(config.vocab_size, args.prompt_tokens)
        runs = interleaved_runs(engines, prompt, args.new_tokens, args.repeats)
    result = decode_result(config, threads, reference.torch_threads, args, runs)
    if not result["tokens_agree"]:
        print(f"duet bench decode: warning: greedy tokens of duet and transformers differ from token "
              f"{result['first_mismatch']} on", file=sys.stderr)
    print(json.dumps(result) if args.json else decode_table(result))
    return 0


def require_reference(benchmark: str) -> None:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise DuetError(f"duet bench {benchmark} needs torch and transformers: pip install 'duet[test]'") from None


def blas_threads() -> int:
    """Threads numpy's BLAS runs matmuls on: threadpoolctl's report, else what OpenBLAS picks itself."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return openblas_default_threads()
    pools = [p for p in threadpool_info() if p["user_api"] == "blas"]
    numpy_pools = [p for p in pools if "numpy" in p["filepath"]]
    return (numpy_pools + pools)[0]["num_threads"] if pools else openblas_default_threads()


def openblas_default_threads() -> int:
    """OPENBLAS_NUM_THREADS, then OMP_NUM_THREADS, then one thread per CPU."""
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return os.cpu_count() or 1


def load_ours(model_dir: Path, config: ModelConfig) -> Model:
    return load_model(model_dir, route="bf16", tokenizer=False, backend="cpu").model


def load_transformers(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def random_prompt(vocab_size: int, length: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(PROMPT_SEED).integers(0, vocab_size, length)]


def ours_engine(model: Model) -> Engine:
    def timed_greedy(prompt: list[int], steps: int) -> Run:
        state = model.new_state()
        started = time.perf_counter()
        tokens = [int(np.argmax(model.logits(model.forward(state, prompt, last_only=True))[0]))]
        prefilled = time.perf_counter()
        for _ in range(steps):
            tokens.append(int(np.argmax(model.logits(model.forward(state, tokens[-1:]))[0])))
        return Run(prefilled - started, time.perf_counter() - prefilled, tokens)

    return timed_greedy


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


def geometry(config: ModelConfig) -> dict:
    return {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "full_attention_layers": config.layer_types.count(FULL_ATTENTION),
        "hidden": config.hidden_size,
        "intermediate": config.intermediate_size,
        "vocab": config.vocab_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "linear_key_heads": config.linear_num_key_heads,
        "linear_value_heads": config.linear_num_value_heads,
        "experts": config.num_experts,
        "tie_word_embeddings": config.tie_word_embeddings,
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


# --------------------------------------------------------------------------------------------
# duet bench make-random


def add_make_random_command(benchmarks) -> None:
    make = benchmarks.add_parser("make-random", help="write a random fp32 checkpoint with a real model's geometry")
    make.add_argument("--geometry", choices=sorted(GEOMETRIES), default="qwen3.5-0.8b")
    make.add_argument("--out", required=True, help="new folder to write config.json and model.safetensors into")
    make.add_argument("--layers", type=positive_int, help="N layers instead of the geometry's own count, full attention every 4th")
    make.set_defaults(run=run_make_random)


def run_make_random(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DuetError(f"{out}: already exists and is not an empty folder; pass --out with a new folder")
    require_reference("make-random")
    import torch
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(random_model_config(args.geometry, args.layers))  # default init: normal(0, 0.02)
    model.save_pretrained(out)
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()) / 1e6:,.0f}M parameters, fp32)")
    return 0


def random_model_config(name: str, layers: int | None = None):
    """Qwen3_5TextConfig of geometry `name`; with `layers`, layer_types follow the every-4th pattern."""
    from transformers import Qwen3_5TextConfig

    fields = dict(GEOMETRIES[name])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return Qwen3_5TextConfig(**fields)


# --------------------------------------------------------------------------------------------
# duet bench quality

QUALITY_TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening to light the lamp. Ships passing in the "
    "night relied on its steady beam to find the harbour, and the keeper kept a log of every vessel he saw. "
    "One winter a storm cut the island off for three weeks; he rationed his oil, burned the lamp at half "
    "strength, and wrote that the sea had never looked so wide. When the supply boat finally came, the crew "
    "found him asleep at the desk, the log open at a page that listed forty ships by name."
)


def add_quality_command(benchmarks) -> None:
    quality = benchmarks.add_parser(
        "quality", help="mean KL divergence and top-1 agreement of B's next-token distributions against A's")
    quality.add_argument("--model", required=True, help="reference checkpoint A (folder or .gguf)")
    quality.add_argument("--vs", required=True, help="checkpoint B, run on every route it supports")
    quality.add_argument("--tokens", type=positive_int, default=256, help="most tokens of the fixed text (default 256)")
    quality.add_argument("--json", action="store_true", help="print one JSON object with all figures")
    quality.set_defaults(run=run_quality_bench)


def run_quality_bench(args: argparse.Namespace) -> int:
    reference = load_model(args.model)
    ids = reference.tokenizer.encode(QUALITY_TEXT)[: args.tokens]
    expected = forward_logits(reference.model, ids)
    routes = load_model(args.vs).routes
    result = {"benchmark": "quality", "model": str(reference.path), "reference_route": reference.route,
              "vs": args.vs, "tokens": len(ids), "routes": {}}
    for route in routes:
        candidate = load_model(args.vs, route=route)
        result["routes"][route] = distribution_agreement(expected, forward_logits(candidate.model, ids))
    print(json.dumps(result) if args.json else quality_table(result))
    return 0


def forward_logits(model: Model, ids: list[int]) -> np.ndarray:
    return model.logits(model.forward(model.new_state(), ids)).astype(np.float64)


def distribution_agreement(p_logits: np.ndarray, q_logits: np.ndarray) -> dict:
    """Mean over positions of KL(p || q) in nats, and the share of positions with the same argmax."""
    p_log = p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True)
    q_log = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
    kl = np.sum(np.exp(p_log) * (p_log - q_log), axis=-1)
    return {"mean_kl": float(kl.mean()), "top1_agreement": float(np.mean(p_logits.argmax(-1) == q_logits.argmax(-1)))}


def quality_table(result: dict) -> str:
    lines = [f"{result['vs']} against {result['model']} ({result['reference_route']}), {result['tokens']} tokens of "
             "the fixed text", "", f"{'route':<8}{'mean KL (nats)':>16}{'top-1 agreement':>18}"]
    for route, figures in result["routes"].items():
        lines.append(f"{route:<8}{figures['mean_kl']:>16.5f}{figures['top1_agreement']:>17.1%}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# duet bench routes


def add_routes_command(benchmarks) -> None:
    routes = benchmarks.add_parser(
        "routes", help="per route: the GEMV's weight bytes streamed per second and greedy decode tok/s")
    routes.add_argument("--model", required=True, help="model folder (bf16, INT4 or trellis safetensors; no tokenizer needed)")
    routes.add_argument("--new-tokens", type=positive_int, default=8, help="decode steps timed per route (default 8)")
    routes.add_argument("--repeats", type=positive_int, default=5, help="GEMV calls timed per route; best counts")
    routes.add_argument("--json", action="store_true", help="print one JSON object with all figures")
    routes.set_defaults(run=run_routes_bench)


def run_routes_bench(args: argparse.Namespace) -> int:
    model_dir = Path(args.model).expanduser()
    if not model_dir.is_dir():
        raise DuetError(f"{model_dir}: no such model folder; pass --model with a folder holding config.json")
    opened = open_model(model_dir, tokenizer=False)  # headers only
    opened.checkpoint.close()
    config, available = opened.config, opened.routes
    result = {"benchmark": "routes", "model": str(model_dir.resolve()), "geometry": geometry(config),
              "threads": blas_threads(), "new_tokens": args.new_tokens, "routes": {}}
    prompt = random_prompt(config.vocab_size, WARMUP_PROMPT_TOKENS)
    for route in available:
        model = load_model(model_dir, route=route, tokenizer=False, backend="cpu").model
        result["routes"][route] = {**gemv_rate(model, args.repeats), "decode_tok_s": decode_rate(model, prompt, args.new_tokens)}
        del model
    print(json.dumps(result) if args.json else routes_table(result))
    return 0


def gemv_rate(model: Model, repeats: int) -> dict:
    """One-row calls of layer 0's feed-forward gate/up matrix: weight bytes (as held in memory) per second."""
    ffn = model.layers[0].ffn
    linear = getattr(ffn, "shared", ffn).gate_up
    x = np.random.default_rng(PROMPT_SEED).standard_normal((1, linear.shape[1])).astype(np.float32)
    linear(x)
    best = min(timed(lambda: linear(x)) for _ in range(repeats))
    N, K = linear.shape
    return {"gemv_shape": [N, K], "gemv_weight_bytes": int(linear.weight.nbytes),
            "gemv_gb_s": linear.weight.nbytes / best / 1e9, "gemv_gweights_s": N * K / best / 1e9}


def decode_rate(model: Model, prompt: list[int], steps: int) -> float:
    run = ours_engine(model)(prompt, steps)
    return steps / run.decode_s


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def routes_table(result: dict) -> str:
    g = result["geometry"]
    lines = [f"{result['model']}: {g['layers']} layers, hidden {g['hidden']}, vocab {g['vocab']}; "
             f"numpy BLAS threads {result['threads']}; {result['new_tokens']} decode steps", "",
             f"{'route':<8}{'GEMV shape':>14}{'weight MB':>11}{'GEMV GB/s':>11}{'Gweights/s':>12}{'decode tok/s':>14}"]
    for route, r in result["routes"].items():
        shape = "x".join(str(d) for d in r["gemv_shape"])
        lines.append(f"{route:<8}{shape:>14}{r['gemv_weight_bytes'] / 1e6:>11.2f}{r['gemv_gb_s']:>11.3f}"
                     f"{r['gemv_gweights_s']:>12.3f}{r['decode_tok_s']:>14.3f}")
    return "\n".join(lines)
