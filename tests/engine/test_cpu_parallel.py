"""Prefill's work split between cores (engine.backend.threads.in_parallel): every item once, nested
splits run whole, errors surface, and results are those of one part: bit-identical where our code
fixes the summation order, within the summation-order bound where BLAS does (OpenBLAS picks its
kernel by a product's shape: on an AMD EPYC with AVX-512 a run of 150 tokens and all 300 gave
different last bits)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import duet.engine.backend.cpu as cpu
from duet.engine.backend import threads
from conftest import build_reference, save_reference
from duet.engine.loader import load_model
from duet.engine.quant.w4 import quantize_rtn


def test_parts_cover_every_item_once_on_several_threads(monkeypatch):
    monkeypatch.setattr(threads, "PARTS", 2)
    seen, idents = [], set()

    def work(lo, hi):
        seen.extend(range(lo, hi))
        idents.add(threading.get_ident())

    threads.in_parallel(work, 37)
    assert sorted(seen) == list(range(37))
    assert len(idents) == 2


def test_a_split_inside_a_split_runs_whole(monkeypatch):
    """The inner call must not wait for a worker the outer call is using (a deadlock)."""
    monkeypatch.setattr(threads, "PARTS", 2)
    inner_ranges = []

    def outer(lo, hi):
        threads.in_parallel(lambda a, b: inner_ranges.append((a, b)), 10)

    runner = threading.Thread(target=threads.in_parallel, args=(outer, 4))
    runner.start()
    runner.join(timeout=30)
    assert not runner.is_alive(), "nested in_parallel deadlocked"
    assert inner_ranges == [(0, 10), (0, 10)]


def test_a_parts_error_is_raised_to_the_caller(monkeypatch):
    monkeypatch.setattr(threads, "PARTS", 2)

    def work(lo, hi):
        if lo == 0:  # the part a worker thread runs
            raise ValueError("part failed")

    with pytest.raises(ValueError, match="part failed"):
        threads.in_parallel(work, 8)
    threads.in_parallel(lambda lo, hi: None, 8)  # the lock was released


def blas_threads() -> int:
    return min(lib.num_threads for lib in threads.blas().select(user_api="blas").lib_controllers)


def test_one_blas_thread_holds_until_the_outermost_context_leaves():
    """A split inside a prefill enters the context again: leaving the inner one keeps the limit."""
    before = blas_threads()
    with threads.one_blas_thread():
        with threads.one_blas_thread():
            assert blas_threads() == 1
        assert blas_threads() == 1
        threads.in_parallel(lambda lo, hi: None, 8)
        assert blas_threads() == 1
    assert blas_threads() == before


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = save_reference(build_reference("qwen3_5_text", seed=3), tmp_path_factory.mktemp("parallel") / "m")
    return load_model(folder, tokenizer=False, backend="cpu").model


def within_summation_order(got: np.ndarray, want: np.ndarray, x: np.ndarray, weight: np.ndarray) -> bool:
    """|got - want| within K float32 roundings of sum |x||w| (the bound on any order of a K-term sum),
    on both sides."""
    bound = 2 * x.shape[-1] * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(weight).T)
    return bool((np.abs(got - want) <= bound).all())


# Hidden and DeltaNet states after a whole prefill: a few layers of products each within its
# summation-order bound (~1e-6 relative) compound; a wrong split (rows or heads mixed up) is O(1).
PREFILL_RTOL = 1e-4


def prefill(model, parts: int, monkeypatch, tokens):
    monkeypatch.setattr(threads, "PARTS", parts)
    state = model.new_state()
    hidden = model.forward(state, tokens)
    deltanet = [cache.recurrent.copy() for cache in state.layers if hasattr(cache, "recurrent")]
    return hidden, deltanet


def test_prefill_split_or_not_agrees_to_summation_order(tiny_model, monkeypatch):
    tokens = list(np.random.default_rng(0).integers(0, tiny_model.config.vocab_size, 90))
    one_hidden, one_states = prefill(tiny_model, 1, monkeypatch, tokens)
    for parts in (2, 3):  # 3 parts: uneven, and more parts than the 2 key heads
        hidden, states = prefill(tiny_model, parts, monkeypatch, tokens)
        np.testing.assert_allclose(hidden, one_hidden, rtol=0, atol=PREFILL_RTOL * np.abs(one_hidden).max())
        for a, b in zip(states, one_states):
            np.testing.assert_allclose(a, b, rtol=0, atol=PREFILL_RTOL * np.abs(b).max())


@pytest.mark.parametrize("linear", [cpu.W4A16Linear, cpu.W4A8Linear])
@pytest.mark.parametrize("rows", [1, 40])
def test_quantized_chunks_split_between_cores_give_the_same_output(linear, rows, monkeypatch):
    rng = np.random.default_rng(1)
    layer = linear(quantize_rtn(rng.standard_normal((300, 256), dtype=np.float32)))
    x = rng.standard_normal((rows, 256), dtype=np.float32)
    monkeypatch.setattr(cpu, "CHUNK_WEIGHTS", 256 * 64)  # 5 chunks of 64 rows
    monkeypatch.setattr(threads, "PARTS", 1)
    whole = layer(x)
    monkeypatch.setattr(threads, "PARTS", 2)
    assert np.array_equal(layer(x), whole)


@pytest.mark.parametrize("linear", [cpu.DenseLinear, cpu.W4A16Linear, cpu.W4A8Linear])
@pytest.mark.parametrize("rows", [3, 40])
def test_the_feature_major_product_is_the_transposed_product(linear, rows, monkeypatch):
    """by_feature ([N, T], what the MLP keeps its intermediate in) holds exactly linear(x).T."""
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((300, 256), dtype=np.float32)
    layer = linear(weight if linear is cpu.DenseLinear else quantize_rtn(weight))
    x = rng.standard_normal((rows, 256), dtype=np.float32)
    monkeypatch.setattr(threads, "PARTS", 2)
    by_feature = layer.by_feature(x)
    assert by_feature.flags.c_contiguous and np.array_equal(by_feature, layer(x).T)


@pytest.mark.parametrize("layout", ["token-major", "feature-major"])
def test_a_long_prefill_split_by_tokens_gives_one_products_values(layout, monkeypatch):
    """Past TOKEN_SPLIT_MIN tokens each core takes a run of tokens: the values equal one unsplit
    product's and the weight-row split's (to summation order: BLAS may pick its kernel by shape),
    whether x comes token-major or as a transposed feature-major array (as the MLP's down
    projection gets it)."""
    rng = np.random.default_rng(5)
    layer = cpu.DenseLinear(rng.standard_normal((640, 256), dtype=np.float32))
    x = rng.standard_normal((300, 256), dtype=np.float32)
    if layout == "feature-major":
        x = np.ascontiguousarray(x.T).T
    monkeypatch.setattr(cpu, "TOKEN_SPLIT_MIN", 64)
    monkeypatch.setattr(threads, "PARTS", 1)
    whole = layer(x)
    by_rows = layer.by_feature(x).T
    for parts in (2, 3):
        monkeypatch.setattr(threads, "PARTS", parts)
        assert within_summation_order(layer(x), whole, x, layer.weight)
    assert within_summation_order(by_rows, whole, x, layer.weight)
