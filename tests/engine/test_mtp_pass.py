"""The MTP head's pass in one compiled call (CpuOps.mtp_rows: compiled.mtp_rows) against the same pass
through the op set's calls (Model.mtp_forward without a plan), which test_model_parity.py holds to
transformers: every output row and every cached key and value with the same bits, so exact drafting
stays exact. On the demo checkpoint, whose bf16 Linears run as lanes on AVX-512 CPUs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from duet.engine import load_model
from duet.engine.backend import compiled
from duet.engine.backend.cpu_ops import CpuOps

MODELS = Path(__file__).resolve().parents[2] / "models"


@pytest.fixture(scope="module")
def demo():
    return load_model(MODELS / "demo").model


def test_the_head_has_a_plan_where_its_lanes_kernels_run(demo):
    assert (demo.mtp_plan is not None) == (compiled.bf16_dot_kernels()[0] == "avx512")
    assert CpuOps(compiled_steps=False).mtp_plan(demo.mtp) is None
    assert CpuOps().mtp_plan(demo.layers[0]) is None  # not an MTP head: no fc, no attention layer


def _passes(model, ids, hidden, past: int, last_only: bool):
    """A prefill of `past` rows, then passes of 1, 3, 5 and 2 rows: (their outputs, the cache's keys and values)."""
    state = model.new_mtp_state()
    outputs = [model.mtp_forward(state, ids[1 : past + 1], hidden[:past])]
    at = past
    for T in (1, 3, 5, 2):
        outputs.append(model.mtp_forward(state, ids[at + 1 : at + 1 + T], hidden[at : at + T], last_only=last_only))
        at += T
    cache = state.layers[0]
    assert state.length == cache.length == at
    return outputs, cache.keys[:, :at].copy(), cache.values[:, :at].copy()


@pytest.mark.parametrize("last_only", [False, True])
@pytest.mark.parametrize("past", [40, 1100])  # 1100: the op set splits attention's KV heads, so its calls run the pass
def test_one_call_gives_each_row_the_op_sets_bits(demo, monkeypatch, past, last_only):
    ids = np.random.default_rng(past).integers(0, demo.config.vocab_size, past + 12)
    hidden = demo.forward(demo.new_state(), ids)
    plan = demo.mtp_plan
    calls = []
    kernel = compiled.mtp_rows
    monkeypatch.setattr(compiled, "mtp_rows", lambda *args: (calls.append(args[1].shape[0]), kernel(*args)))
    one_call = _passes(demo, ids, hidden, past, last_only)
    monkeypatch.setattr(demo, "mtp_plan", None)
    op_calls = _passes(demo, ids, hidden, past, last_only)
    if plan is not None:
        assert calls == ([1, 3, 5, 2] if past == 40 else [])
    for got, want in zip(one_call[0], op_calls[0]):  # shapes and bits
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(one_call[1], op_calls[1])
    np.testing.assert_array_equal(one_call[2], op_calls[2])
