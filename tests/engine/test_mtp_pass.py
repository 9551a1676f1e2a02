"""The MTP head's pass in one compiled call (CpuOps.mtp_rows: compiled.mtp_rows), and a cycle's greedy
or sampled drafts in one (CpuOps.mtp_greedy_drafts, mtp_sampled_drafts), against the same work through
the op set's calls (Model.mtp_forward, draft_greedy_ids, draft_candidates and the sampler's steps
without a plan), which test_model_parity.py, test_heads.py and test_sampling_kernels.py hold to
transformers, the whole head and numpy: every output row and every cached key and value with the same
bits, the same drafts, the same q and the same draws of the generator. On the demo checkpoint, whose
bf16 Linears run as lanes on AVX-512 CPUs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from duet.engine import SamplingParams, load_model
from duet.engine.backend import compiled, compiled_sampling, cpu_ops
from duet.engine.backend.cpu_ops import CpuOps
from duet.engine.sampling import Sampler
from duet.engine.speculative import MTPDrafter

MODELS = Path(__file__).resolve().parents[2] / "models"


@pytest.fixture(scope="module")
def demo():
    return load_model(MODELS / "demo").model


def test_the_head_has_a_plan_where_its_lanes_kernels_run(demo):
    lanes = compiled.bf16_dot_kernels()[0] == "avx512"
    assert (demo.mtp_plan is not None) == lanes
    if lanes:  # the tied table and the shortlist's rows are lanes too: greedy drafts run in one call
        assert demo.mtp_plan.embed is demo.embed.lanes and demo.mtp_plan.draft_rows is demo.draft_head.linear.lanes
        np.testing.assert_array_equal(demo.mtp_plan.draft_ids, demo.draft_head.ids)
    assert CpuOps(compiled_steps=False).mtp_plan(demo) is None
    assert CpuOps().mtp_plan(SimpleNamespace(mtp=demo.layers[0])) is None  # not an MTP head: no fc, no attention layer


def _count_calls(monkeypatch, kernel, size) -> list:
    """The calls of a one-call kernel (through threads.in_team), each as size(its arguments)."""
    calls, in_team = [], cpu_ops.in_team

    def counted(team, alone, args):
        if alone is kernel:
            calls.append(size(args))
        in_team(team, alone, args)

    monkeypatch.setattr(cpu_ops, "in_team", counted)
    return calls


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
    calls = _count_calls(monkeypatch, compiled.mtp_rows, lambda args: args[1].shape[0])
    one_call = _passes(demo, ids, hidden, past, last_only)
    monkeypatch.setattr(demo, "mtp_plan", None)
    op_calls = _passes(demo, ids, hidden, past, last_only)
    if plan is not None:
        assert calls == ([1, 3, 5, 2] if past == 40 else [])
    for got, want in zip(one_call[0], op_calls[0]):  # shapes and bits
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(one_call[1], op_calls[1])
    np.testing.assert_array_equal(one_call[2], op_calls[2])


@pytest.mark.parametrize("past", [40, 1100])
def test_greedy_drafts_in_one_call_are_the_op_sets_drafts(demo, monkeypatch, past):
    ids = np.random.default_rng(past + 1).integers(0, demo.config.vocab_size, past + 2)
    hidden = demo.forward(demo.new_state(), ids)
    plan = demo.mtp_plan
    calls = _count_calls(monkeypatch, compiled.mtp_greedy_drafts, lambda args: len(args[19]))  # drafts

    def drafts(k: int):
        state = demo.new_mtp_state()
        last = demo.mtp_forward(state, ids[1 : past + 2], hidden[: past + 1], last_only=True)
        tokens = demo.mtp_greedy_drafts(state, last, k)
        cache = state.layers[0]
        return tokens, (state.length, state.length_before_last_call, cache.length), cache.keys[:, : cache.length].copy()

    for k in (1, 2, 4, 7):
        monkeypatch.setattr(demo, "mtp_plan", plan)
        one_call = drafts(k)
        monkeypatch.setattr(demo, "mtp_plan", None)
        op_calls = drafts(k)
        assert len(one_call[0]) == k and one_call[0] == op_calls[0] and one_call[1] == op_calls[1]
        np.testing.assert_array_equal(one_call[2], op_calls[2])
    if plan is not None:
        assert calls == ([1, 2, 4, 7] if past == 40 else [])
    assert demo.mtp_greedy_drafts(demo.new_mtp_state(), hidden[:1], 0) == []


def test_only_a_model_with_a_plan_loads_the_one_call_kernels(monkeypatch):
    """Held in memory the two kernels cost ~10 MB: a model that cannot use them does not prepare them."""
    prepared = []
    steps = compiled.mtp_kernel_steps
    monkeypatch.setattr(compiled, "mtp_kernel_steps", lambda: prepared.append(True) or steps())
    assert load_model(MODELS / "demo_int4").model.mtp_plan is None
    load_model(MODELS / "demo_gguf" / "demo-q8_0.gguf")
    assert prepared == []
    planned = load_model(MODELS / "demo").model.mtp_plan is not None
    assert prepared == [True] * planned


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=20, top_p=0.95),
                                    SamplingParams(temperature=1.3, top_k=200),
                                    SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.1)])  # penalties: the drafter's own steps
def test_sampled_drafts_in_one_call_are_the_drafters_own(demo, monkeypatch, params):
    prompt = list(np.random.default_rng(9).integers(0, demo.config.vocab_size, 60))
    hidden = demo.forward(demo.new_state(), prompt)
    plan = demo.mtp_plan
    calls = _count_calls(monkeypatch, compiled_sampling.mtp_sampled_drafts, lambda args: len(args[23]))  # drafts

    def drafts(k: int, seed: int):
        drafter, sampler = MTPDrafter(demo), Sampler(SamplingParams(**{**params.__dict__, "seed": seed}))
        drafter.start(prompt, hidden, 7)
        draft = drafter.propose(prompt + [7], k, sampler)
        assert drafter.state.length == len(prompt)  # the drafts' rows rolled back
        return draft, sampler.rng.random()  # the next draw: the generator moved as far

    for k, seed in ((1, 0), (3, 1), (4, 2), (7, 3)):
        monkeypatch.setattr(demo, "mtp_plan", plan)
        one_call, after = drafts(k, seed)
        monkeypatch.setattr(demo, "mtp_plan", None)
        op_calls, op_after = drafts(k, seed)
        assert one_call.tokens == op_calls.tokens and len(one_call.tokens) == k and after == op_after
        for i, (q, q_ids, want_q, want_ids) in enumerate(zip(one_call.q, one_call.q_ids, op_calls.q, op_calls.q_ids)):
            np.testing.assert_array_equal(q.view(np.uint32), want_q.view(np.uint32))
            np.testing.assert_array_equal(q_ids, want_ids)
            if one_call.packed is not None:  # what the compiled acceptance reads: the same q
                packed_q, packed_ids, counts = one_call.packed
                np.testing.assert_array_equal(packed_q[i, : counts[i]].view(np.uint32), want_q.view(np.uint32))
                np.testing.assert_array_equal(packed_ids[i, : counts[i]], want_ids)
        assert (one_call.packed is not None) == (plan is not None and not params.penalizes)
    if plan is not None:
        assert calls == ([] if params.penalizes else [1, 3, 4, 7])


@pytest.mark.parametrize("kernel", ["rows", "greedy drafts", "sampled drafts"])
def test_every_team_gives_the_bits_of_one_member_alone(demo, kernel):
    """A team kernel (compiled.py's MTP section) run alone, by 2 and 3 members at once, and by 2 members
    on one thread of numba's (one after the other: the first claims every chunk, the second must find
    them done, not wait for a member that has not started): the same outputs and cached keys and
    values, bit for bit."""
    import numba

    plan = demo.mtp_plan
    if plan is None:  # no bf16 lanes on this CPU (AVX-512 only), so no one-call kernels to team up
        assert compiled.bf16_dot_kernels()[0] != "avx512"
        return
    ids = np.random.default_rng(5).integers(0, demo.config.vocab_size, 60)
    hidden = demo.forward(demo.new_state(), ids)
    state = demo.new_mtp_state()
    last = demo.mtp_forward(state, ids[1:51], hidden[:50], last_only=True)
    state.layers[0].reserve(60)
    H = hidden.shape[1]

    def run(driver, members):
        """The kernel on fresh outputs and a copy of the cache: its outputs and the cache's rows."""
        cache = SimpleNamespace(keys=state.layers[0].keys.copy(), values=state.layers[0].values.copy(), length=50)
        head = plan.head_args(51, cache)
        if kernel == "rows":  # three rows, the last alone through attention and the MLP
            outputs = [np.empty((1, H), np.float32)]
            args = (np.ascontiguousarray(demo.embed[ids[51:54]], np.float32), np.ascontiguousarray(hidden[50:53]), *head, 2,
                    outputs[0], *compiled.pass_scratch(3, 2, head))
            alone, team = compiled.mtp_rows, compiled.mtp_rows_team
        elif kernel == "greedy drafts":
            outputs = [np.empty(4, np.int64)]
            args = (last, plan.embed, plan.draft_rows, plan.draft_ids, *head, outputs[0], *compiled.drafting_scratch(4, plan.draft_rows, head))
            alone, team = compiled.mtp_greedy_drafts, compiled.mtp_greedy_drafts_team
        else:
            S = len(plan.draft_ids)
            outputs = [np.empty(4, np.int64), np.zeros((4, S), np.float32), np.zeros((4, S), np.int64), np.empty(4, np.int64)]
            args = (last, plan.embed, plan.draft_rows, plan.draft_ids, *head, 20, np.float32(0.8), 0.95,
                    np.array([0.1, 0.5, 0.9, 0.3]), *outputs, *compiled.drafting_scratch(4, plan.draft_rows, head))
            alone, team = compiled_sampling.mtp_sampled_drafts, compiled_sampling.mtp_sampled_drafts_team
        if driver:
            team(args, members)
        else:
            alone(*args, 0, 1)
        return [*outputs, cache.keys[:, :54], cache.values[:, :54]]

    want = run(False, 1)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        one_after_another = run(True, 2)
    finally:
        numba.set_num_threads(threads)
    for got in (run(True, 2), run(True, 3), one_after_another):
        for array, wanted in zip(got, want):
            np.testing.assert_array_equal(array.view(np.uint8), wanted.view(np.uint8))
