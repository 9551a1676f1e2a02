"""A tiny model converted to each format, run on each route it supports: greedy tokens and KL against bf16.

Random weights give flat next-token distributions (a median top-2 gap of ~0.3 logits over 320
tokens), so any 4-bit noise flips a greedy pick at once, where a trained model's peaked
distribution would not. `peaked_reference` keeps the random layers but adds a bigram backbone
(strong embeddings, an output head that favours a fixed successor of each token) and halves the
residual branches: its median top-1 probability is ~0.8, like a trained model's.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from duet.app.cli import main
from conftest import build_reference, save_reference
from duet.engine import CheckpointError, DuetError, GenerateOptions, SamplingParams, Switches, Tokens, generate, load_model
from duet.engine.backend.cpu_ops import softmax
from duet.engine.speculative import NoDrafter

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


class RecordingDrafter(NoDrafter):
    """Drafts nothing; keeps the hidden state of every committed row, which the engine hands drafters."""

    def __init__(self):
        self.hidden = []

    def commit(self, committed, hidden):
        self.hidden.append(hidden[-1].copy())


def greedy_hidden(lms, prompt: list[int], steps: int):
    """Tokens and last hidden states of greedy decoding, running step i on lms[i] over one shared state."""
    state = lms[0].model.new_state()
    hidden = lms[0].model.forward(state, prompt)[-1:]
    tokens, hiddens = [], []
    for step in range(steps):
        tokens.append(int(np.argmax(lms[step].model.logits(hidden)[0])))
        if step + 1 < steps:
            hidden = lms[step + 1].model.forward(state, [tokens[-1]])
            hiddens.append(hidden[0])
    return tokens, np.stack(hiddens)


@pytest.mark.parametrize("fmt", ["int4", "gguf-q4_0"])
def test_a_route_switched_mid_reply_runs_from_the_next_cycle_without_reading_files(converted, baseline, fmt, tmp_path):
    """Greedy, no drafts: the passes before the switch run the natural route, the rest the other.

    The reference runs two separately loaded models, one per route, over one shared sequence
    state: what an honest switch must compute, pass for pass. The switching model's files are
    deleted after loading, so the switch reads nothing from disk.
    """
    prompt, _, _ = baseline
    switch_at, steps = 6, 16
    first, second = load_model(converted[fmt]), load_model(converted[fmt], route="w4a8" if fmt == "int4" else "bf16")
    expected_tokens, expected_hidden = greedy_hidden([first] * switch_at + [second] * (steps - switch_at), prompt, steps)
    _, unswitched_hidden = greedy_hidden([first] * steps, prompt, steps)

    copy = tmp_path / "copy"
    shutil.copytree(converted[fmt], copy) if converted[fmt].is_dir() else (copy.mkdir(), shutil.copy(converted[fmt], copy))
    lm = load_model(copy)
    model = lm.model
    shutil.rmtree(copy)
    switches, recorder = Switches(), RecordingDrafter()
    options = GenerateOptions(max_tokens=steps, sampling=SamplingParams(temperature=0))
    tokens, cycle_routes = [], []
    for event in generate(lm, prompt, options, switches=switches, drafter=recorder):
        if isinstance(event, Tokens):
            tokens += event.token_ids
            cycle_routes.append(event.cycle.route if event.cycle else None)
            if len(tokens) == switch_at:
                switches.route = second.route  # the pass that follows is the first on the new route
        else:
            finished = event
    assert tokens == expected_tokens
    hidden = np.stack(recorder.hidden[: steps - 1])
    assert np.array_equal(hidden, expected_hidden)
    assert not np.allclose(hidden[switch_at - 1 :], unswitched_hidden[switch_at - 1 :], atol=1e-3)
    assert lm.model is model and lm.route == second.route
    assert finished.stats.routes == [first.route, second.route]
    assert cycle_routes[switch_at - 1] == first.route and cycle_routes[switch_at] == second.route


def test_a_route_the_weights_cannot_run_is_refused_in_one_line(converted):
    lm = load_model(converted["gguf-q4_0"])
    with pytest.raises(DuetError, match="cannot run the w4a16 route; it runs w4a8 or bf16"):
        lm.use_route("w4a16")
    assert load_model(converted["source"]).weights is None  # one route only: nothing kept to rebuild
