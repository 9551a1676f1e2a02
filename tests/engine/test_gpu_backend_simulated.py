"""The simulated device (simulated_device.py) itself, and the GPU backend's paths that the demo-model
tests of test_gpu_model.py do not take: a capture the driver refuses, KV caches that grow mid-reply,
heads on the host or over a draft shortlist, routed experts, a bf16 token table.

Everything here runs on the simulated device, so on every machine. The model-level tests go through
load_model (DUET_BACKEND=cupy) and generate, and compare with the CPU engine as test_gpu_model.py does.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import pytest
from conftest import build_reference, save_reference
from simulated_device import C_TYPES, SOURCES, TWINS, CaptureError, installed
from test_gpu_model import LOGIT_RTOL, MODELS, PROMPT_TEXT, decode_logits, greedy_tokens, load

from duet.engine import GenerateOptions, PromptCache, SamplingParams, Tokens, generate, heads
from duet.engine.backend import cupy_backend as gb
from duet.engine.backend import cupy_model, select
from duet.engine.kernels import build
from duet.engine.tokenizer import Tokenizer


@pytest.fixture
def cp(monkeypatch):
    with installed(monkeypatch) as simulated:
        yield simulated


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return Tokenizer.from_dir(MODELS / "demo").encode(PROMPT_TEXT)


# ---------------------------------------------------------------------------- the device ---

def test_every_kernel_has_a_parsed_signature_and_a_twin():
    for source, names in build.KERNELS.items():
        assert set(SOURCES[source].kernels) == set(names), source
        assert all(p.ctype in C_TYPES for params in SOURCES[source].kernels.values() for p in params)
    assert set(TWINS) == {name for names in build.KERNELS.values() for name in names}


def rms_norm_args(cp, rows: int = 2):
    x = cp.asarray(np.arange(rows * 64, dtype=np.float32).reshape(rows, 64))
    return x, cp.asarray(np.ones(64, np.float32)), cp.empty((rows, 64), cp.float32)


def no_forms(cp) -> tuple:
    """The emit arguments of a kernel asked for no forms beside its fp32 output (common.cuh's emit_forms)."""
    return cp.empty(1, cp.uint16), cp.empty(1, cp.int8), cp.empty(1, cp.float32), np.int32(0)


def test_a_launch_is_checked_against_the_kernels_source(cp):
    rms_norm = build.kernel("norms", "rms_norm")
    x, w, y = rms_norm_args(cp)
    one = np.int32(1)  # weight rows
    rms_norm((2,), (256,), (x, w, y, np.int32(64), one, np.float32(1e-6), *no_forms(cp)))
    want = x.get() / np.sqrt((x.get() ** 2).mean(axis=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(y.get(), want, rtol=1e-6)
    wrong = {"D is a C int; pass numpy.int32, not int": (x, w, y, 64, one, np.float32(1e-6), *no_forms(cp)),  # CuPy would pass 8 bytes
             "eps is a C float; pass numpy.float32, not float": (x, w, y, np.int32(64), one, 1e-6, *no_forms(cp)),
             r"x is a float\*, got ndarray": (x.get(), w, y, np.int32(64), one, np.float32(1e-6), *no_forms(cp)),
             r"w is a float\*, got a uint16 device array": (x, w.astype(cp.uint16), y, np.int32(64), one, np.float32(1e-6), *no_forms(cp)),
             "takes 10 arguments, got 5": (x, w, y, np.int32(64), one)}
    for message, args in wrong.items():
        with pytest.raises(TypeError, match=message):
            rms_norm((2,), (256,), args)


def test_a_kernel_computes_only_what_its_grid_covers(cp):
    x, w, y = rms_norm_args(cp)
    build.kernel("norms", "rms_norm")((1,), (256,), (x, w, y, np.int32(64), np.int32(1), np.float32(1e-6), *no_forms(cp)))  # one block: row 0
    assert np.all(np.isfinite(y.get()[0])) and np.all(np.isnan(y.get()[1]))  # row 1 is still uninitialised memory


def test_a_capture_records_and_each_replay_reads_the_buffers_as_they_are(cp):
    gate_up, out = cp.asarray(np.array([[1, 2, 3, 4]], np.float32)), cp.zeros((1, 2), cp.float32)


    def silu_mul():  # [1, 4] (gate | up) -> out [1, 2]
        build.kernel("norms", "silu_mul")((1,), (256,), (gate_up, out, np.int32(2), np.int64(2), *no_forms(cp)))

    def want(values):
        gate, up = np.float32(values[:2]), np.float32(values[2:])
        return gate / (1 + np.exp(-gate)) * up

    silu_mul()  # uncaptured: runs now (and loads the kernel)
    gate_up.set(np.array([[5, 6, 7, 8]], np.float32))
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc), stream:
        stream.begin_capture()
        silu_mul()
        doubled = gate_up + gate_up
        graph = stream.end_capture()
    np.testing.assert_allclose(out.get()[0], want([1, 2, 3, 4]))  # recorded, not run
    assert np.all(np.isnan(doubled.get()))  # nothing written yet
    for values in ([1, 1, 2, 2], [0, 3, 1, 5]):
        gate_up.set(np.array([values], np.float32))
        graph.launch(stream=cp.cuda.get_current_stream())
        np.testing.assert_allclose(out.get()[0], want(values))
        assert doubled.get()[0].tolist() == [2 * v for v in values]


REFUSED = {
    "host to device": lambda cp, x: cp.asarray(np.zeros(2, np.float32)),
    "set": lambda cp, x: x.set(np.zeros((2, 2), np.float32)),
    "device to host": lambda cp, x: x.get(),
    "default pool": lambda cp, x: cp.empty(2, cp.float32),
    "first load of a kernel": lambda cp, x: gb.silu_mul(x),
    "cuBLAS's first product": lambda cp, x: x @ x,
}


@pytest.mark.parametrize("action", REFUSED)
def test_a_capture_refuses_what_the_driver_would(cp, action):
    x = cp.zeros((2, 2), cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    pool = contextlib.nullcontext() if action == "default pool" else cp.cuda.using_allocator(cp.cuda.MemoryPool().malloc)
    with stream:
        stream.begin_capture()
        with pool:
            with pytest.raises(CaptureError):
                REFUSED[action](cp, x)
        with pytest.raises(CaptureError, match="invalidated"):
            stream.end_capture()
    REFUSED[action](cp, x)  # uncaptured, each is fine


def test_the_simulated_device_leaves_the_backend_as_it_found_it():
    import cupy

    real_kernel, real_count = build.kernel, select.cuda_device_count
    with pytest.MonkeyPatch.context() as monkeypatch, installed(monkeypatch) as simulated:
        assert gb.cp is simulated and cupy_model.cp is simulated and gb.kernel is not real_kernel
    assert gb.cp is cupy and cupy_model.cp is cupy and sys.modules["cupy"] is cupy
    assert gb.kernel is real_kernel and build.kernel is real_kernel
    assert select.cuda_device_count is real_count


# -------------------------------------------------------------- the backend's other paths ---

def test_a_capture_the_driver_refuses_leaves_the_reply_uncaptured_and_unchanged(cp, prompt, monkeypatch):
    want, _ = greedy_tokens(load(MODELS / "demo_int4", "w4a16", "cpu", monkeypatch), prompt, "bf16", "mtp")
    cp.device.refused_kernel = "rms_norm"  # refused inside a capture only
    lm = load(MODELS / "demo_int4", "w4a16", "cupy", monkeypatch)
    got, _ = greedy_tokens(lm, prompt, "bf16", "mtp")
    assert got == want
    assert "rms_norm (refused by the simulated driver) inside a stream capture" in lm.model.ops.graph_error


@pytest.mark.usefixtures("cp")
@pytest.mark.parametrize("from_turn_start", [False, True])
def test_a_turn_continues_the_device_states_the_last_reply_left(prompt, monkeypatch, from_turn_start):
    """engine.PromptCache on the GPU op set: the held device state (its captured graphs, conv rings,
    the MTP head's cache) continues into the next turn as the CPU engine's does, from the reply's end
    or, restored from its checkpoint, from the turn's start (a ring written over since)."""
    turn_start = len(prompt) - 3

    def two_turns(backend: str):
        lm = load(MODELS / "demo_int4", "w4a16", backend, monkeypatch)
        cache = PromptCache()
        options = GenerateOptions(max_tokens=40, sampling=SamplingParams(temperature=0), draft="mtp")
        events = generate(lm, prompt, options, cache=cache, turn_start=turn_start)
        first = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
        follow = (prompt[:turn_start] if from_turn_start else cache.tokens) + prompt
        events = list(generate(lm, follow, options, cache=cache))
        second = [t for e in events if isinstance(e, Tokens) for t in e.token_ids]
        return first, second, events[-1].stats.cached_tokens

    got = two_turns("cupy")
    assert got == two_turns("cpu")
    assert got[2] == turn_start if from_turn_start else got[2] >= len(prompt) + len(got[0]) - 1


@pytest.mark.usefixtures("cp")
def test_the_device_holds_the_deltanet_state_the_memory_plan_counts(monkeypatch):
    """The device's DeltaNet states are what placement's memory plan counts for them: each layer's
    state, and what a verify records for its rollback (the state before it, MAX_ROWS rows of inputs:
    rollback_bytes). Sixteen copies of the state, one after each row, were 2.4 GB on the 27B."""
    from duet.engine.backend import MAX_ROWS
    from duet.engine.placement import deltanet_state_bytes, rollback_bytes

    lm = load(MODELS / "demo", "bf16", "cupy", monkeypatch)
    deltanet = [cache for cache in lm.model.new_state().layers if isinstance(cache, gb.DeltaNetState)]
    held = sum(array.nbytes for cache in deltanet for array in (cache.recurrent, cache.prior, cache.row_inputs))
    assert held == deltanet_state_bytes(lm.config) + rollback_bytes(lm.config, MAX_ROWS)


@pytest.mark.usefixtures("cp")
@pytest.mark.parametrize("kv", ["bf16", "q4"])
def test_kv_caches_grow_mid_reply(prompt, monkeypatch, kv):
    """A 120-token prompt and a 150-token reply pass the caches' first 256 rows: they grow (the graphs
    that wrote the old arrays are dropped) and, in q4, the quantized middle rows come into play. The
    prompt stays under SINK_ROWS + RECENT_ROWS, where CPU and GPU prefills read the same rows."""
    long_prompt = 4 * prompt
    want, _ = greedy_tokens(load(MODELS / "demo", "bf16", "cpu", monkeypatch), long_prompt, kv, "ngram", max_tokens=150)
    got, _ = greedy_tokens(load(MODELS / "demo", "bf16", "cupy", monkeypatch), long_prompt, kv, "ngram", max_tokens=150)
    assert len(long_prompt) + len(got) > cupy_model.KV_CAPACITY
    assert got == want


@pytest.mark.usefixtures("cp")
@pytest.mark.parametrize("fmt,route,host_tables,rows", [
    ("demo", "bf16", False, 1024),  # a view of the float head's device rows
    ("demo_gguf", "w4a8", False, 1024),  # the Q8_0 head's rows through the int8 kernels
    ("demo", "bf16", True, 1000),  # host tables: the head on the host, and the shortlist's int4 rows (not 16s) too
])
def test_draft_shortlists_and_host_heads(prompt, monkeypatch, fmt, route, host_tables, rows):
    """With a draft shortlist (the demo vocabulary is under SHORTLIST_ROWS, so the cut is lowered) the
    draft logits equal the CPU's, and MTP replies equal the CPU's with as many drafts kept."""
    monkeypatch.setattr(heads, "SHORTLIST_ROWS", rows)
    cpu, gpu = (load(MODELS / fmt, route, backend, monkeypatch, host_tables=host_tables) for backend in ("cpu", "cupy"))
    hidden = cpu.model.forward(cpu.model.new_state(), prompt)
    want, got = cpu.model.draft_logits(hidden), gpu.model.draft_logits(hidden)
    scored = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), scored) and scored.sum() == len(want) * rows
    np.testing.assert_allclose(got[scored], want[scored], rtol=1e-4, atol=1e-4 * np.abs(want[scored]).max())
    (want_tokens, want_stats), (got_tokens, got_stats) = (greedy_tokens(lm, prompt, "bf16", "mtp") for lm in (cpu, gpu))
    assert got_tokens == want_tokens and got_stats["accepted"] == want_stats["accepted"]


@pytest.mark.usefixtures("cp")
def test_routed_experts_and_a_bf16_token_table(monkeypatch, tmp_path):
    """A tiny MoE checkpoint (transformers', in the geometry the kernels take, stored in bf16 with its
    own token table): experts are routed on the host, so the pass runs uncaptured, and the table is
    kept as bf16 bits. Logits along the CPU's greedy path match within LOGIT_RTOL."""
    import torch

    reference = build_reference("qwen3_5_moe_text", seed=3, head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32)
    path = save_reference(reference.to(torch.bfloat16), tmp_path / "moe")
    cpu, gpu = load(path, "bf16", "cpu", monkeypatch), load(path, "bf16", "cupy", monkeypatch)
    tokens = cpu.tokenizer.encode("the quick brown fox jumps over")
    want = decode_logits(cpu.model, "bf16", tokens, 8)
    got = decode_logits(gpu.model, "bf16", tokens, 8, forced=[int(t) for t in want.argmax(axis=-1)])
    assert np.abs(got - want).max() <= LOGIT_RTOL * np.abs(want).max()


@pytest.mark.usefixtures("cp")
def test_experts_off_the_card_run_on_the_host(monkeypatch, tmp_path):
    """Issue 18's split on the GPU: placing 40% of a tiny MoE's routed experts on the card turns the
    others into the CPU's compiled Linears run on the host (rows go down, outputs come up; their
    weights are never device arrays). Logits along the CPU's greedy path match within LOGIT_RTOL, the
    hit rate counts the card's routes, and placing them all back puts every expert on the card again."""
    import torch

    from duet.engine.backend import compiled

    reference = build_reference("qwen3_5_moe_text", seed=3, head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32)
    path = save_reference(reference.to(torch.bfloat16), tmp_path / "moe")
    cpu, gpu = load(path, "bf16", "cpu", monkeypatch), load(path, "bf16", "cupy", monkeypatch)
    moe_layers = [layer.ffn for layer in gpu.model.layers if hasattr(layer.ffn, "experts")]
    assert gpu.experts_on_card is not None and gpu.experts_on_card.all()  # a tiny model: the plan holds them all
    assert not any(isinstance(e, cupy_model.OnHost) for ffn in moe_layers for e in ffn.experts)

    routed = int(gpu.experts_on_card.sum())
    routing = gpu.place_experts(on_card=routed * 2 // 5)
    host = [e for ffn in moe_layers for e in ffn.experts if isinstance(e, cupy_model.OnHost)]
    assert len(host) == routed - routing.on_card.sum() > 0
    for expert in host:
        for linear in (expert.linear.gate_up, expert.linear.down):
            assert type(linear).__module__ == compiled.__name__  # the CPU's kernels, the weights in host RAM
    tokens = cpu.tokenizer.encode("the quick brown fox jumps over")
    want = decode_logits(cpu.model, "bf16", tokens, 8)
    got = decode_logits(gpu.model, "bf16", tokens, 8, forced=[int(t) for t in want.argmax(axis=-1)])
    assert np.abs(got - want).max() <= LOGIT_RTOL * np.abs(want).max()
    assert 0 < routing.hits < routing.hits + routing.misses

    gpu.place_experts(on_card=routed)
    assert not any(isinstance(e, cupy_model.OnHost) for ffn in moe_layers for e in ffn.experts)


@pytest.mark.usefixtures("cp")
def test_take_weights_refuses_another_checkpoint(monkeypatch):
    gpu, other = load(MODELS / "demo", "bf16", "cupy", monkeypatch), load(MODELS / "demo_int4", "w4a16", "cpu", monkeypatch)
    with pytest.raises(ValueError, match="same checkpoint"):
        gpu.model.take_weights(other.model)


@pytest.mark.usefixtures("cp")
def test_greedy_and_top_k_replies_leave_the_logits_on_the_device(prompt, monkeypatch):
    """Greedy decoding without penalties reads only each row's argmax id (Model.greedy_ids); top-k
    sampling without penalties only the ids top-k keeps (GpuOps.top_k_candidates). Neither copies a
    [T, V] row to the host, in the verify passes or in the MTP drafts, and each reply is the CPU's
    (the same seed: the processors see the same rows). Top-k off, whole rows cross."""
    from simulated_device import DeviceArray

    from duet.engine import GenerateOptions, SamplingParams, Tokens, generate

    gpu, cpu = (load(MODELS / "demo", "bf16", backend, monkeypatch) for backend in ("cupy", "cpu"))
    copies, get = [], DeviceArray.get
    monkeypatch.setattr(DeviceArray, "get", lambda array: copies.append(array.shape) or get(array))
    vocab = gpu.config.vocab_size

    def reply(lm, sampling: SamplingParams) -> list[int]:
        options = GenerateOptions(max_tokens=24, sampling=sampling, draft="mtp")
        return [t for event in generate(lm, prompt, options) if isinstance(event, Tokens) for t in event.token_ids]

    for sampling in (SamplingParams(), SamplingParams(temperature=0.7, top_k=20, top_p=0.95, seed=1)):
        copies.clear()
        got = reply(gpu, sampling)
        assert copies and not [shape for shape in copies if shape[-1] == vocab], sampling
        assert got == reply(cpu, sampling)
    copies.clear()
    reply(gpu, SamplingParams(temperature=0.7, seed=1))
    assert any(shape[-1] == vocab for shape in copies)


@pytest.mark.parametrize("device", [True, False])
def test_the_top_k_candidates_give_the_processors_the_whole_rows_result(monkeypatch, device):
    """What crosses for top-k sampling (the card's op set, or the CPU's), processed, equals the whole
    row processed at those ids, and the whole row has -inf at every other: every id top-k keeps,
    ties with the k-th included, and those the temperature's fp32 division turns into ties (adjacent
    floats that round to one quotient), at several temperatures, top-p and min-p after."""
    from simulated_device import installed

    from duet.engine.backend.cpu_ops import CpuOps
    from duet.engine.backend.cupy_model import GpuOps
    from duet.engine.sampling import SamplingParams, process_logits

    rng = np.random.default_rng(5)
    base = rng.integers(-40, 40, (6, 300)).astype(np.float32) / 8  # many exact ties
    base[:, ::7] = np.nextafter(base[:, ::7], np.float32(np.inf))  # and neighbours one ulp apart
    with installed(monkeypatch) as cupy:
        ops, rows = (GpuOps.__new__(GpuOps), cupy.asarray(base)) if device else (CpuOps(), base)
        for temperature in (0.3, 0.7, 1.0, 3.0):
            for k in (1, 5, 20, 299):
                params = SamplingParams(temperature=temperature, top_k=k, top_p=0.9, min_p=0.01)
                sent, ids = ops.top_k_candidates(rows, k, temperature)
                assert sent.shape == (6, len(ids)) and np.all(np.diff(ids) > 0)
                assert np.isfinite(sent).sum() <= 6 * (k + 40)
                for row in range(len(base)):
                    whole = process_logits(base[row], params, [])
                    np.testing.assert_array_equal(process_logits(sent[row], params, [], ids), whole[ids])
                    assert np.isneginf(np.delete(whole, ids)).all()

