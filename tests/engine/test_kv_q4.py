"""The 4-bit KV cache: codec round trip, exact sink and recent rows, attention error, verify exactness."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import build_reference, save_reference
from duet.engine.cache import RECENT_ROWS, SINK_ROWS, KVCache, Q4KVCache, dequantize_q4, quantize_q4
from duet.engine.loader import load_model
from duet.engine.backend.cpu_ops import attend


def test_codec_round_trip_error_is_within_half_a_step():
    x = np.random.default_rng(0).standard_normal((3, 5, 64)).astype(np.float32)
    codes, scales = quantize_q4(x)
    assert codes.dtype == np.uint8 and codes.shape == (3, 5, 32) and scales.shape == (3, 5, 2)
    step = np.repeat(scales.astype(np.float32), 32, axis=-1)
    assert np.all(np.abs(dequantize_q4(codes, scales) - x) <= step / 2 + 1e-6)


def fill(cache, rows):
    for start in range(0, rows.shape[1], 50):
        cache.append(rows[:, start : start + 50, :, 0], rows[:, start : start + 50, :, 1])


def test_sink_and_recent_rows_are_exact_and_the_rest_close():
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((2, 400, 64, 2)).astype(np.float32)
    rows[..., 5, :] *= 20  # an outlier channel, as real keys have
    q4, full = Q4KVCache(2, 64), KVCache(2, 64)
    fill(q4, rows)
    fill(full, rows)
    keys, values = q4.rows(400)
    exact_keys, exact_values = full.rows(400)
    assert np.array_equal(keys[:, :SINK_ROWS], exact_keys[:, :SINK_ROWS])
    assert np.array_equal(values[:, -RECENT_ROWS:], exact_values[:, -RECENT_ROWS:])
    middle = slice(SINK_ROWS, 400 - RECENT_ROWS)
    relative = np.linalg.norm(keys[:, middle] - exact_keys[:, middle]) / np.linalg.norm(exact_keys[:, middle])
    assert 0 < relative < 0.12


def test_attention_output_error_against_full_kv_is_bounded():
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((2, 600, 64, 2)).astype(np.float32)
    q4, full = Q4KVCache(2, 64), KVCache(2, 64)
    fill(q4, rows)
    fill(full, rows)
    q = rng.standard_normal((1, 4, 64)).astype(np.float32) * 2
    ours, exact = attend(q, *q4.rows(600), 599), attend(q, *full.rows(600), 599)
    # Random values average out in attention, so bound the error by the values' own scale.
    assert np.abs(ours - exact).max() < 0.05 * np.abs(rows[..., 1]).max()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("q4kv")
    save_reference(build_reference("qwen3_5_text", seed=31), path, with_tokenizer=False)
    return load_model(path, tokenizer=False, backend="cpu").model


def test_model_logits_with_q4_kv_stay_close_on_model_data(model):
    ids = np.random.default_rng(3).integers(0, 300, 400)
    full, q4 = model.new_state(), model.new_state("q4")
    model.forward(full, ids[:380])
    model.forward(q4, ids[:380])
    for i in range(380, 400):
        exact = model.logits(model.forward(full, ids[i : i + 1]))
        ours = model.logits(model.forward(q4, ids[i : i + 1]))
        assert np.abs(ours - exact).max() < 0.05 * np.abs(exact).max()


def test_q4_verify_rows_equal_decode_steps_and_roll_back(model):
    ids = np.random.default_rng(4).integers(0, 300, 340)
    verify, decode = model.new_state("q4"), model.new_state("q4")
    model.forward(verify, ids[:330])
    model.forward(decode, ids[:330])
    rows = model.logits(model.forward(verify, ids[330:336]))
    steps = np.concatenate([model.logits(model.forward(decode, ids[i : i + 1])) for i in range(330, 336)])
    assert np.array_equal(rows, steps)
    verify.keep(2)
    again = model.new_state("q4")
    model.forward(again, ids[:330])
    for i in range(330, 332):
        model.forward(again, ids[i : i + 1])
    step = ids[332:333]
    assert np.array_equal(model.logits(model.forward(verify, step)), model.logits(model.forward(again, step)))
