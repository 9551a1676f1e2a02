"""The GPU model (engine/backend/cupy_model.py) against the CPU engine on tiny models, on a GPU machine.

Elsewhere the GPU tests are skipped with the reason (the kernels are still compile-checked in
test_kernels_compile.py); the backend choice's refusal without a GPU runs here.

The tiny model is the routes test's "peaked" one (a bigram backbone over random layers, median
top-1 probability ~0.8), in the geometry our kernels take (head_dim 64, DeltaNet heads of 32), so a
greedy pick is never a near-tie that fp32 summation order could flip. Tolerances:
- greedy tokens: equal to the CPU engine's (the contract; the margins above make it meaningful);
- logits along a forced sequence: within LOGIT_RTOL of the largest |logit|: the "full" KV cache
  keeps bf16 rows on the card (fp32 on the CPU), which moves a logit by a few 1e-3 of the scale;
- a replayed CUDA graph against the uncaptured pass: within CAPTURE_RTOL (the same kernels on the
  same data; only cuBLAS may choose another algorithm inside a capture), and the same ids.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import add_random_mtp_head, build_reference, save_reference
from app.cli import main
from engine import DuetError, GenerateOptions, SamplingParams, Switches, Tokens, generate, load_model
from engine.backend.select import backend_name

GPU = backend_name("auto") == "cupy"
needs_gpu = pytest.mark.skipif(not GPU, reason="needs an NVIDIA GPU and CuPy (pip install 'duet[gpu]'); "
                                               "the kernels are compile-checked in test_kernels_compile.py")
if GPU:
    import cupy as cp

    from engine.backend.cupy_model import GpuModel

DIMS = dict(hidden_size=128, intermediate_size=256, head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32)
LOGIT_RTOL = 2e-2
CAPTURE_RTOL = 1e-5
CASES = [("source", "bf16"), ("int4", "w4a16"), ("int4", "w4a8")]


def peaked_reference(seed: int):
    """tests/engine/test_routes.py's peaked model in the GPU kernels' geometry."""
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
def models(tmp_path_factory):
    """The bf16 folder (with an MTP head) and its INT4 conversion by `duet convert`."""
    root = tmp_path_factory.mktemp("gpu_model")
    ref = peaked_reference(7)
    source = save_reference(ref, root / "source")
    add_random_mtp_head(source, ref, seed=8)
    assert main(["convert", str(source), str(root / "int4"), "--format", "int4"]) == 0
    return {"source": source, "int4": root / "int4"}


def load(path, route: str, backend: str, monkeypatch):
    monkeypatch.setenv("DUET_BACKEND", backend)
    lm = load_model(path, route=route)
    monkeypatch.delenv("DUET_BACKEND")
    assert isinstance(lm.model, GpuModel) == (backend == "cupy")
    return lm


PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 300, 40)]


def forced_logits(model, kv: str, tokens: list[int]) -> np.ndarray:
    """Logits after the prompt and after each of `tokens`, one decode step at a time."""
    state = model.new_state(kv)
    rows = [model.logits(model.forward(state, PROMPT)[-1:])[0]]
    rows += [model.logits(model.forward(state, [t]))[0] for t in tokens]
    return np.stack(rows)


def greedy_tokens(lm, kv: str, draft: str, max_tokens: int = 40, switches: Switches | None = None,
                  switch_at: int | None = None, to: tuple[str, str] | None = None) -> tuple[list[int], dict]:
    """A greedy reply's tokens; with switch_at, the route and rule flip after that many tokens."""
    options = GenerateOptions(max_tokens=max_tokens, sampling=SamplingParams(temperature=0), draft=draft, kv=kv)
    switches = switches or Switches()
    tokens, stats = [], None
    for event in generate(lm, PROMPT, options, switches=switches):
        if isinstance(event, Tokens):
            tokens += event.token_ids
            if switch_at is not None and len(tokens) >= switch_at and switches.route is None:
                switches.route, switches.accept = to
        else:
            stats = event.stats.to_dict()
    return tokens, stats


@needs_gpu
@pytest.mark.parametrize("kv", ["full", "q4"])
@pytest.mark.parametrize("fmt,route", CASES)
def test_logits_along_a_forced_sequence_match_the_cpu_model(models, monkeypatch, fmt, route, kv):
    cpu_lm, gpu_lm = load(models[fmt], route, "cpu", monkeypatch), load(models[fmt], route, "cupy", monkeypatch)
    tokens = [int(t) for t in np.random.default_rng(4).integers(0, 300, 24)]
    want, got = forced_logits(cpu_lm.model, kv, tokens), forced_logits(gpu_lm.model, kv, tokens)
    worst = np.abs(got - want).max() / np.abs(want).max()
    print(f"{fmt:6} {route:6} kv {kv:4}: worst |gpu - cpu| {worst:.2e} of the largest logit")
    assert worst <= LOGIT_RTOL
    assert np.array_equal(got.argmax(axis=-1), want.argmax(axis=-1))


@needs_gpu
@pytest.mark.parametrize("draft", ["none", "ngram", "mtp"])
@pytest.mark.parametrize("kv", ["full", "q4"])
@pytest.mark.parametrize("fmt,route", CASES)
def test_greedy_tokens_equal_the_cpu_engines(models, monkeypatch, fmt, route, kv, draft):
    """Every drafter, both KV caches, each route: the GPU's reply is the CPU's, token for token."""
    want, _ = greedy_tokens(load(models[fmt], route, "cpu", monkeypatch), kv, draft)
    got, stats = greedy_tokens(load(models[fmt], route, "cupy", monkeypatch), kv, draft)
    assert got == want
    assert draft == "none" or stats["drafted"] > 0


@needs_gpu
@pytest.mark.parametrize("kv", ["full", "q4"])
def test_switching_route_and_rule_mid_reply_on_the_gpu(models, monkeypatch, kv):
    """w4a16/exact for the first tokens, then w4a8/lossy, MTP drafts throughout: the reply equals
    the CPU engine's under the same switch (greedy, so the lossy rule keeps nothing extra)."""
    flip = ("w4a8", "lossy")
    want, _ = greedy_tokens(load(models["int4"], "w4a16", "cpu", monkeypatch), kv, "mtp", switch_at=12, to=flip)
    lm = load(models["int4"], "w4a16", "cupy", monkeypatch)
    model = lm.model
    got, stats = greedy_tokens(lm, kv, "mtp", switch_at=12, to=flip)
    assert got == want
    assert stats["routes"] == ["w4a16", "w4a8"] and stats["rules"] == ["exact", "lossy"]
    assert lm.model is model and model.version == 1 and model.graph_error is None


@needs_gpu
@pytest.mark.parametrize("kv", ["full", "q4"])
@pytest.mark.parametrize("route", ["w4a16", "w4a8"])
def test_captured_cycle_equals_the_uncaptured_one(models, monkeypatch, route, kv):
    """Verify passes of 1 and 4 rows with rollbacks, run uncaptured on one state and as graph replays
    on another: the same logits, the same ids in the output ring, the same state after keep()."""
    model = load(models["int4"], route, "cupy", monkeypatch).model
    plain, captured = model.new_state(kv), model.new_state(kv)
    model.forward(plain, PROMPT)
    model.forward(captured, PROMPT)
    rng = np.random.default_rng(5)
    ids = []
    for cycle in range(8):
        rows = [int(t) for t in rng.integers(0, 300, 1 if cycle % 2 else 4)]
        model.graphable = False
        want = model.logits(model.forward(plain, rows))
        model.graphable = True
        got = model.logits(model.forward(captured, rows))
        assert model.graph_error is None and captured.graphs, "the cycle was not captured"
        np.testing.assert_allclose(got, want, rtol=CAPTURE_RTOL, atol=CAPTURE_RTOL * np.abs(want).max())
        assert np.array_equal(got.argmax(axis=-1), want.argmax(axis=-1))
        ids.append(got.argmax(axis=-1))
        kept = 1 + cycle % len(rows)
        plain.keep(kept)
        captured.keep(kept)
        assert plain.length == captured.length
    ring, count = cp.asnumpy(captured.ring), int(cp.asnumpy(captured.ring_count)[0])
    assert count == len(ids)  # every cycle was a replay
    for cycle, row in enumerate(ids):
        assert np.array_equal(ring[cycle][: len(row)], row) and np.all(ring[cycle][len(row):] == -1)


@pytest.mark.skipif(GPU, reason="this machine has a GPU: the GPU backend can run")
def test_forcing_the_gpu_without_one_is_one_line(tiny_model, monkeypatch):
    monkeypatch.setenv("DUET_BACKEND", "cupy")
    with pytest.raises(DuetError, match="DUET_BACKEND=cupy: backend cupy needs an NVIDIA GPU") as error:
        load_model(tiny_model)
    assert "\n" not in str(error.value)
