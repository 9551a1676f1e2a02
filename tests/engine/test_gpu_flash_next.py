"""Flash-Next (qwen4_exp) on the GPU op set against the CPU engine, on two devices (the `cp` fixture of
simulated_device.py: a GPU where there is one, skipped with the reason elsewhere, and the simulated
device everywhere). The CPU engine is itself pinned to transformers' qwen4_exp (test_flash_next.py).

The model is a tiny random qwen4_exp from transformers (conftest.flash_fields) in the geometry our kernels
take (attention heads of 64, DeltaNet keys and values of 32, indexer heads of 32), with a random MTP head
(conftest.add_random_flash_mtp_head): three residual streams, PLE on two DeltaNet layers, a QSA budget
of 16 tokens in blocks of 4, MoE top-2, the DeltaNet gate a sigmoid. Prompts hold EOS tokens (where the
n-gram history restarts) and run several times the QSA budget. Tolerances as test_gpu_model.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import add_random_flash_mtp_head, build_reference, run_generate, save_reference
from simulated_device import constant, cupy_fixture
from test_flash_next import EOS, prompt_ids
from test_gpu_model import LOGIT_RTOL, decided_rows, decode_logits, greedy_tokens, load
from test_speculative import OracleDrafter

from duet.engine import GenerateOptions, SamplingParams
from duet.engine.backend import select
from duet.engine.backend.cupy_model import GpuOps
from duet.engine.config import ModelConfig
from duet.engine.loader import choose_backend

cp = cupy_fixture()
KERNEL_GEOMETRY = dict(head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32, indexer_head_dim=32)
PROMPT = 150  # past the q4 cache's ring of exact rows (RECENT_ROWS + MAX_ROWS): its quantized middle rows in play
STEPS = 40


@pytest.fixture(scope="module")
def flash_gpu_dir(tmp_path_factory):
    ref = build_reference("qwen4_exp_text", seed=6, **KERNEL_GEOMETRY)
    folder = save_reference(ref, tmp_path_factory.mktemp("flash_gpu") / "m")
    add_random_flash_mtp_head(folder, ref, seed=8)
    return folder


@pytest.fixture(scope="module")
def prompt(flash_gpu_dir) -> list[int]:
    ids = prompt_ids(PROMPT, ModelConfig.from_file(flash_gpu_dir / "config.json").vocab_size, seed=3)
    ids[40:60] = np.tile(ids[20:25], 4)  # a repeated stretch: n-gram drafts find matches in the prompt
    return [int(t) for t in ids]


def test_the_gpu_backend_takes_flash_next_in_the_kernels_geometry(flash_gpu_dir, tmp_path, monkeypatch):
    """A GPU present, Flash-Next runs on it; an indexer head the kernels do not take is one line; the
    kernels' bound on the blocks a row keeps is the one select.py checks."""
    import json
    import shutil

    monkeypatch.setattr(select, "cuda_device_count", lambda: 1)  # as if a GPU were here
    assert choose_backend(ModelConfig.from_file(flash_gpu_dir / "config.json"), flash_gpu_dir, "auto") == "cupy"
    folder = shutil.copytree(flash_gpu_dir, tmp_path / "odd")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "indexer_head_dim": 48}))
    assert select.gpu_geometry_problem(ModelConfig.from_file(folder / "config.json")) == (
        "QSA indexer head_dim 48 (the kernels take multiples of 32 up to 256)")
    assert select.QSA_MAX_TOP == constant("flash_next", "QSA_MAX_TOP")


@pytest.mark.usefixtures("cp")
@pytest.mark.parametrize("kv", ["bf16", "q4"])
def test_logits_along_a_forced_sequence_match_the_cpu_engine(flash_gpu_dir, prompt, monkeypatch, kv):
    """A prefill of 150 tokens (ten slices of rows, blocks pooled across them) and 40 decode
    steps along the CPU's greedy picks: the logits within LOGIT_RTOL, the decided picks the same."""
    cpu_lm, gpu_lm = load(flash_gpu_dir, "bf16", "cpu", monkeypatch), load(flash_gpu_dir, "bf16", "cupy", monkeypatch)
    assert isinstance(gpu_lm.model.ops, GpuOps) and gpu_lm.model.config.flash.ple_layers == (0, 2)
    want = decode_logits(cpu_lm.model, kv, prompt, STEPS)
    got = decode_logits(gpu_lm.model, kv, prompt, STEPS, forced=[int(t) for t in want.argmax(axis=-1)])
    worst = np.abs(got - want).max() / np.abs(want).max()
    decided = decided_rows(want, got)
    print(f"flash-next kv {kv}: worst |gpu - cpu| {worst:.2e} of the largest logit; {decided.sum()} of {len(want)} decided")
    assert worst <= LOGIT_RTOL
    assert np.array_equal(got.argmax(axis=-1)[decided], want.argmax(axis=-1)[decided])
    assert decided.sum() >= len(want) - 5


@pytest.fixture(scope="module")
def cpu_flash_reply(flash_gpu_dir, prompt):
    """The CPU engine's greedy reply (no drafts) for a kv cache, and which of its picks the device's logits
    along it leave decided (test_gpu_model.decided_rows), once per device and cache."""
    replies = {}

    def reply(device, kv: str) -> tuple[list[int], np.ndarray]:
        key = type(device).__name__, kv
        if key not in replies:
            with pytest.MonkeyPatch.context() as monkeypatch:
                cpu_lm = load(flash_gpu_dir, "bf16", "cpu", monkeypatch)
                tokens, _ = greedy_tokens(cpu_lm, prompt, kv, "none", max_tokens=STEPS)
                want = decode_logits(cpu_lm.model, kv, prompt, len(tokens) - 1)
                got = decode_logits(load(flash_gpu_dir, "bf16", "cupy", monkeypatch).model, kv, prompt, len(tokens) - 1,
                                    forced=tokens)
            replies[key] = tokens, decided_rows(want, got)
        return replies[key]

    return reply


@pytest.mark.parametrize("draft", ["none", "ngram", "mtp", "oracle"])
@pytest.mark.parametrize("kv", ["bf16", "q4"])
def test_greedy_tokens_equal_the_cpu_engines(cp, flash_gpu_dir, prompt, cpu_flash_reply, monkeypatch, kv, draft):
    """With no drafts, n-gram and MTP drafts the GPU's reply is the CPU's without drafts, token for token,
    or parts from it first at a pick that is not decided: every verify pass rolls back the KV rows, the
    indexer's keys and pooled blocks, DeltaNet's states and PLE's history and conv exactly. This random
    model never repeats itself, so n-gram and MTP drafts are all rejected (a verify keeps its first row);
    the oracle's drafts (the CPU's reply, each right with probability 0.7) are kept in part, at any depth."""
    want, decided = cpu_flash_reply(cp, kv)
    assert EOS in prompt and len(want) == STEPS
    lm = load(flash_gpu_dir, "bf16", "cupy", monkeypatch)
    options = GenerateOptions(max_tokens=STEPS, sampling=SamplingParams(temperature=0), draft="none" if draft == "oracle" else draft,
                              kv=kv)
    oracle = OracleDrafter(want, len(prompt), right=0.7, seed=5) if draft == "oracle" else None
    got, finished = run_generate(lm, prompt, options, drafter=oracle)
    parted = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert got == want if parted is None else not decided[parted]
    stats = finished.stats
    assert draft == "none" or stats.drafted > 0
    if draft == "oracle":
        assert stats.drafted > stats.accepted > 0


@pytest.mark.usefixtures("cp")
def test_mtp_draft_logits_match_the_cpu_engine(flash_gpu_dir, prompt, monkeypatch):
    """The MTP head (a QSA layer whose positions run one ahead of its cache rows, fed the trunk's streams)
    over the prompt in one call, then step by step: its draft logits within LOGIT_RTOL of the CPU's. Greedy
    replies cannot show a wrong draft (exact acceptance rejects it); these logits do."""
    logits = []
    for backend in ("cpu", "cupy"):
        model = load(flash_gpu_dir, "bf16", backend, monkeypatch).model
        streams = model.forward(model.new_state(), prompt)
        state, split = model.new_mtp_state(), 60
        rows = [model.draft_logits(model.mtp_forward(state, prompt[1:split + 1], streams[:split]))]
        rows += [model.draft_logits(model.mtp_forward(state, prompt[i + 1:i + 2], streams[i:i + 1]))
                 for i in range(split, len(prompt) - 1)]
        logits.append(np.concatenate(rows))
    want, got = logits
    assert np.abs(got - want).max() <= LOGIT_RTOL * np.abs(want).max()
    assert np.array_equal(got.argmax(axis=-1)[decided_rows(want, got)], want.argmax(axis=-1)[decided_rows(want, got)])
