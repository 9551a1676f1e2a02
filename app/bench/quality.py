"""`duet bench quality`: mean KL divergence and top-1 agreement of checkpoint B's next-token
distributions, on every route it runs, against reference A's over a fixed text."""

from __future__ import annotations

import argparse
import json

import numpy as np

from duet.app.bench.common import positive_int
from duet.engine.loader import load_model, open_model
from duet.engine.model import Model

QUALITY_TEXT = (
    "The lighthouse keeper climbed the spiral stairs each evening to light the lamp. Ships passing in the "
    "night relied on its steady beam to find the harbour, and the keeper kept a log of every vessel he saw. "
    "One winter a storm cut the island off for three weeks; he rationed his oil, burned the lamp at half "
    "strength, and wrote that the sea had never looked so wide. When the supply boat finally came, the crew "
    "found him asleep at the desk, the log open at a page that listed forty ships by name."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="reference checkpoint A (folder or .gguf)")
    parser.add_argument("--vs", required=True, help="checkpoint B, run on every route it supports")
    parser.add_argument("--tokens", type=positive_int, default=256, help="most tokens of the fixed text (default 256)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with all figures")


def run(args: argparse.Namespace) -> int:
    reference = load_model(args.model)
    ids = reference.tokenizer.encode(QUALITY_TEXT)[: args.tokens]
    expected = forward_logits(reference.model, ids)
    opened = open_model(args.vs, tokenizer=False)  # headers only: which routes B runs
    opened.checkpoint.close()
    result = {"benchmark": "quality", "model": str(reference.path), "reference_route": reference.route,
              "vs": args.vs, "tokens": len(ids), "routes": {}}
    for route in opened.routes:
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
