"""`duet bench routes`: per route of one checkpoint, the GEMV's weight bytes streamed per second and
greedy decode tok/s."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from duet.app.bench.common import (
    PROMPT_SEED, WARMUP_PROMPT_TOKENS, blas_threads, geometry, ours_engine, positive_int, random_prompt,
)
from duet.engine.errors import DuetError
from duet.engine.loader import load_model, open_model
from duet.engine.model import Model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model folder (bf16, INT4 or trellis safetensors; no tokenizer needed)")
    parser.add_argument("--new-tokens", type=positive_int, default=8, help="decode steps timed per route (default 8)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="GEMV calls timed per route; best counts")
    parser.add_argument("--json", action="store_true", help="print one JSON object with all figures")


def run(args: argparse.Namespace) -> int:
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
    return {"gemv_shape": [N, K], "gemv_weight_bytes": int(linear.nbytes),
            "gemv_gb_s": linear.nbytes / best / 1e9, "gemv_gweights_s": N * K / best / 1e9}


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
