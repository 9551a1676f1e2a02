"""A tiny model converted to each format, run on each route it supports: greedy tokens and KL against bf16.

Random weights give flat next-token distributions (a median top-2 gap of ~0.3 logits over 320
tokens), so any 4-bit noise flips a greedy pick at once, where a trained model's peaked
distribution would not. `peaked_reference` keeps the random layers but adds a bigram backbone
(strong embeddings, an output head that favours a fixed successor of each token) and halves the
residual branches: its median top-1 probability is ~0.8, like a trained model's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.cli import main
from conftest import build_reference, save_reference
from engine import CheckpointError, load_model
from engine.model import softmax

DIMS = dict(hidden_size=128, intermediate_size=256, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32)
STEPS = 64
CASES = [("int4", "w4a16"), ("int4", "w4a8"), ("int4", "bf16"), ("gguf-f16", "bf16"),
         ("gguf-q8_0", "w4a8"), ("gguf-q8_0", "bf16"), ("gguf-q4_0", "w4a8"), ("gguf-q4_0", "bf16")]


def peaked_reference(seed: int):
    ref = build_reference("qwen3_5_text", seed=seed, **DIMS)
    with torch.no_grad():
        embed = ref.model.embed_tokens.weight
        embed.mul_(8)
        successor = embed[torch.randperm(embed.shape[0], generator=torch.Generator().manual_seed(seed))]
        ref.lm_head.weight.add_(1.4 * successor / successor.norm(dim=1, keepdim=True))
        for name, param in ref.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                param.mul_(0.5)
    return ref


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The bf16 source folder and its conversion to every format, by `duet convert`."""
    root = tmp_path_factory.mktemp("routes")
    source = save_reference(peaked_reference(5), root / "source")
    paths = {"source": source}
    for fmt in {fmt for fmt, _ in CASES}:
        paths[fmt] = root / (fmt if fmt == "int4" else f"{fmt}.gguf")
        assert main(["convert", str(source), str(paths[fmt]), "--format", fmt]) == 0
    return paths


def decode(lm, prompt: list[int], forced: list[int] | None = None) -> np.ndarray:
    """Logits of STEPS decode steps, one token each: greedy, or following `forced` tokens."""
    model, state = lm.model, lm.model.new_state()
    hidden = model.forward(state, prompt)[-1:]
    logits = []
    for step in range(STEPS):
        logits.append(model.logits(hidden)[0])
        token = int(np.argmax(logits[-1])) if forced is None else forced[step]
        hidden = model.forward(state, [token])
    return np.stack(logits)


def mean_kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    p, q = softmax(p_logits.astype(np.float64)), softmax(q_logits.astype(np.float64))
    return float(np.mean(np.sum(p * (np.log(p) - np.log(q)), axis=-1)))


@pytest.fixture(scope="module")
def baseline(converted):
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 300, 40)]
    logits = decode(load_model(converted["source"]), prompt)
    return prompt, [int(t) for t in logits.argmax(axis=-1)], logits


@pytest.mark.parametrize("fmt,route", CASES)
def test_greedy_tokens_of_each_format_and_route_agree_with_bf16(converted, baseline, fmt, route):
    """Along the bf16 model's 64 greedy tokens, each route picks the same token at most steps.

    Every step sees the same context (the bf16 run's tokens), so one near-tie costs one step, not
    the rest of the run.
    """
    prompt, expected, expected_logits = baseline
    lm = load_model(converted[fmt], route=route)
    assert lm.route == route
    logits = decode(lm, prompt, forced=expected)
    agree = int(np.sum(logits.argmax(axis=-1) == expected))
    print(f"{fmt:10} {route:6} greedy agreement {agree}/{STEPS}, mean KL(bf16 || route) {mean_kl(expected_logits, logits):.5f}")
    assert agree >= 0.75 * STEPS


@pytest.mark.parametrize("fmt,route", [("int4", "w4a16"), ("gguf-q8_0", "w4a8"), ("gguf-f16", "bf16"), ("source", "bf16")])
def test_natural_route_is_picked_by_auto(converted, fmt, route):
    assert load_model(converted[fmt]).route == route


@pytest.mark.parametrize("fmt,route,message", [
    ("gguf-q4_0", "w4a16", "route w4a16 cannot run GGUF Q4_0/Q8_0 weights; use --route w4a8 or bf16"),
    ("gguf-f16", "w4a8", "route w4a8 cannot run GGUF float weights; use --route bf16"),
    ("source", "w4a16", "route w4a16 cannot run bf16 safetensors weights; use --route bf16"),
])
def test_a_route_that_cannot_run_a_format_says_so_naming_both(converted, fmt, route, message):
    with pytest.raises(CheckpointError, match=message):
        load_model(converted[fmt], route=route)


def test_route_error_is_one_line_exit_2_from_the_cli(converted, capsys):
    code = main(["--headless", "the", "--raw", "--model", str(converted["gguf-q4_0"]), "--route", "w4a16"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "w4a16" in err and "Q4_0" in err
