"""The sampler's compiled kernels (engine/backend/compiled_sampling.py) against the numpy code they
stand in for (engine/sampling.py, CpuOps.top_k_candidates), on rows like a sampled cycle's: ties,
-inf outside a shortlist or a row's top-k, whole rows. Bit for bit where the kernel's module says so;
softmax within its stated bound."""

from __future__ import annotations

import functools
import zlib
from pathlib import Path

import numpy as np
import pytest

import duet.engine.sampling as sampling
from duet.engine import Draft, GenerateOptions, SamplingParams, generate, load_model, speculative
from duet.engine.backend import compiled_sampling
from duet.engine.backend.cpu_ops import CpuOps
from duet.engine.sampling import Sampler, process_logits, process_rows
from test_sampling_reference import ScriptedRng

DEMO = Path(__file__).parents[2] / "models" / "demo"


def rows_like_a_cycle(seed: int, T: int, V: int, ties: bool, shortlist: bool) -> np.ndarray:
    """Logits [T, V]: on a grid of 1/4 when `ties` (equal values, and quotients that tie after the
    temperature), -inf outside a random third of the ids when `shortlist`."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((T, V)) * 3).astype(np.float32)
    if ties:
        logits = np.round(logits * 4) / 4
    if shortlist:
        logits[:, rng.random(V) < 2 / 3] = -np.inf
    return logits


CASES = [(seed, T, V, ties, shortlist) for seed, (T, V) in enumerate([(1, 50), (4, 50), (4, 4096), (2, 33_333)])
         for ties in (False, True) for shortlist in (False, True)]


@pytest.mark.parametrize("n", [*range(0, 300), 1000, 4096, 33_333, 248_320])
def test_the_pairwise_sum_is_numpys_to_the_bit(n):
    values = np.exp(np.random.default_rng(n).standard_normal(n) * 5)
    assert compiled_sampling._pairwise_sum(values, n, 0.0) == values.sum()


@pytest.mark.parametrize("seed,T,V,ties,shortlist", CASES)
@pytest.mark.parametrize("top_k,temperature", [(1, 1.0), (5, 0.7), (20, 0.7), (40, 1e-3)])
def test_top_k_candidates_are_the_numpy_op_sets(seed, T, V, ties, shortlist, top_k, temperature):
    logits = rows_like_a_cycle(seed, T, V, ties, shortlist)
    values, columns = CpuOps(compiled_steps=True).top_k_candidates(logits, top_k, temperature)
    expected_values, expected_columns = CpuOps(compiled_steps=False).top_k_candidates(logits, top_k, temperature)
    np.testing.assert_array_equal(columns, expected_columns)
    np.testing.assert_array_equal(values, expected_values)


@pytest.mark.parametrize("seed,T,V,ties,shortlist", CASES)
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=20, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.6, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=1000, top_p=0.5),
    SamplingParams(temperature=0.7),
])
def test_warped_rows_are_numpys(seed, T, V, ties, shortlist, params, monkeypatch):
    logits = rows_like_a_cycle(seed, T, V, ties, shortlist)
    warped, warped_row = process_rows(logits, params, [], []), process_logits(logits[0], params, [])
    monkeypatch.setattr(sampling, "_compiled", None)
    np.testing.assert_array_equal(warped, process_rows(logits, params, [], []))
    np.testing.assert_array_equal(warped_row, process_logits(logits[0], params, []))


@pytest.mark.parametrize("seed,T,V,ties,shortlist", CASES)
def test_softmax_is_numpys_within_four_ulp_of_float64(seed, T, V, ties, shortlist, monkeypatch):
    """exp from the C library against numpy's own: the kernel's docstring bound. In float32 (what the
    acceptance rule and draft q read) that rounds to the same value but for one in ~10^8."""
    processed = process_rows(rows_like_a_cycle(seed, T, V, ties, shortlist), SamplingParams(temperature=0.7, top_p=0.9), [], [])
    ours64 = np.stack([sampling._softmax64(row) for row in processed])
    ours32 = sampling.probabilities(processed)
    monkeypatch.setattr(sampling, "_compiled", None)
    numpys64 = np.stack([sampling._softmax64(row) for row in processed])
    np.testing.assert_allclose(ours64, numpys64, rtol=4 * 2.0**-52, atol=0)
    np.testing.assert_allclose(ours32, numpys64.astype(np.float32), rtol=2.0**-23, atol=0)
    assert (ours64 == 0).tolist() == (numpys64 == 0).tolist()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_draws_are_numpys_at_every_boundary(dtype, monkeypatch):
    """Uniform draws on and beside every cumulative boundary of rows with zeros, in both dtypes the
    sampler draws from (float32 probabilities, float64 for a plain pick)."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        probs = rng.random(30).astype(dtype) * (rng.random(30) < 0.6)
        probs[rng.integers(30)] = 0.5
        cdf = np.cumsum(probs[probs > 0], dtype=np.float64)
        cdf /= cdf[-1]
        us = [0.0, *cdf[:-1], *np.nextafter(cdf[:-1], 0), *rng.random(20)]
        sampler = Sampler(SamplingParams(temperature=1.0))
        sampler.rng = ScriptedRng(us)
        ours = [sampler.draw(probs) for _ in us]
        monkeypatch.setattr(sampling, "_compiled", None)
        sampler.rng = ScriptedRng(us)
        assert ours == [sampler.draw(probs) for _ in us]
        monkeypatch.undo()


@pytest.mark.parametrize("drafter", [Draft.MTP, Draft.NGRAM, Draft.NONE])
def test_a_seeded_sampled_reply_is_the_same_on_the_kernels_and_on_numpy(drafter, monkeypatch):
    """The whole sampled cycle (candidates, drafts' q, acceptance, draws) on the demo: the same tokens
    and the same acceptance with the kernels as with the numpy code."""
    lm = load_model(DEMO)
    prompt = lm.tokenizer.encode(lm.tokenizer.render_chat([{"role": "user", "content": "Tell me of the sea."}]))
    options = GenerateOptions(max_tokens=48, draft=drafter,
                              sampling=SamplingParams(temperature=0.7, top_k=20, top_p=0.95, seed=5))

    def reply():
        *replies, done = generate(lm, prompt, options)
        stats = done.stats
        return [t for event in replies for t in event.token_ids], (stats.cycles, stats.drafted, stats.accepted, stats.accepted_at)

    ours = reply()
    monkeypatch.setattr(sampling, "_compiled", None)
    monkeypatch.setattr(lm.model.ops, "top_k_candidates", functools.partial(CpuOps.top_k_candidates, CpuOps(compiled_steps=False)))
    assert reply() == ours
    assert ours[1][1] > 0 or drafter == Draft.NONE  # drafts were judged


def a_verify(rng: np.random.Generator, V: int, k: int, top_k: int, kind: str):
    """(processed verify rows [k + 1, C], their columns or None, a Draft) like a sampled cycle's: drafts
    that are mostly among a row's candidates, each with q over a few ids ("sparse", as MTP drafts),
    over every id ("whole") or none (one-hot, as n-gram drafts)."""
    logits = (rng.standard_normal((k + 1, V)) * 3).astype(np.float32)
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=0.9)
    values, columns = CpuOps(compiled_steps=True).top_k_candidates(logits, top_k, params.temperature)
    ids = np.arange(V) if columns is None else columns
    likeliest = ids[np.argmax(values[:k], axis=-1)]  # a draft the row before it favours, most of the time
    drafts = np.where(rng.random(k) < 0.75, likeliest, rng.choice(ids, size=k))
    target = process_rows(values, params, [], drafts.tolist(), columns)
    q, q_ids = [], []
    for i, x in enumerate(drafts):
        if kind == "sparse":
            these = np.union1d(rng.choice(V, size=int(rng.integers(1, 30)), replace=False), [x])
            weights = rng.random(len(these)).astype(np.float32) * (rng.random(len(these)) < 0.9)  # zeros among them
            weights = weights if weights.sum() > 0 else np.ones(len(these), np.float32)
            q.append((weights / weights.sum()).astype(np.float32))
            q_ids.append(these)
        elif kind == "whole":  # near the target row's own distribution, with some mass on every id
            weights = np.full(V, 0.1 / V, np.float32)
            weights[ids] += sampling.probabilities(target[i]) * rng.random(len(ids)).astype(np.float32)
            q.append((weights / weights.sum()).astype(np.float32))
            q_ids.append(None)
        else:
            q.append(None)
    return target, columns, speculative.Draft(drafts.tolist(), q, q_ids)


@pytest.mark.parametrize("kind", ["sparse", "whole", "one-hot"])
@pytest.mark.parametrize("top_k", [20, 0])
@pytest.mark.parametrize("rule", [speculative.EXACT, speculative.LOSSY])
def test_sampled_acceptance_in_one_call_is_the_loops_with_the_same_draws(kind, top_k, rule, monkeypatch):
    """compiled_sampling.accept_rows against speculative.accept's loop: the same verdict in every case,
    and the sampler's generator left at the same draw (its next values equal), over cycles that keep
    every draft, reject at each depth, and (lossy) keep drafts only by the lossy rule."""
    rng = np.random.default_rng(zlib.crc32(f"{kind} {top_k} {rule}".encode()))
    verdicts = []
    for case in range(300):
        k = int(rng.integers(0, 5))
        target, columns, draft = a_verify(rng, 300 if top_k else 60, k, top_k, kind)
        seed = int(rng.integers(2**31))
        sampler = Sampler(SamplingParams(temperature=0.7, seed=seed))
        ours = speculative.accept(rule, target, draft, sampler, columns)
        ours_after = sampler.rng.random(3)
        with monkeypatch.context() as patched:
            patched.setattr(speculative, "compiled_twins", lambda: None)
            sampler = Sampler(SamplingParams(temperature=0.7, seed=seed))
            assert speculative.accept(rule, target, draft, sampler, columns) == ours, case
        np.testing.assert_array_equal(sampler.rng.random(3), ours_after)
        verdicts.append((ours.accepted, ours.accepted == k, ours.lossy))
    assert {accepted for accepted, _, _ in verdicts if accepted < 4} == {0, 1, 2, 3}
    assert any(all_kept for _, all_kept, _ in verdicts) and not all(all_kept for _, all_kept, _ in verdicts)
    assert any(lossy for _, _, lossy in verdicts) == (rule == speculative.LOSSY)


@pytest.mark.parametrize("n", [*range(0, 300), 1000, 4096])
def test_the_float32_pairwise_sum_is_numpys_to_the_bit(n):
    values = (np.random.default_rng(n).random(n) ** 4).astype(np.float32)
    assert compiled_sampling._pairwise_sum(values, n, np.float32(0)) == values.sum()


def test_residual_draws_are_the_loops_at_every_boundary():
    """compiled_sampling._residual_draw against speculative._draw_residual (p over a row's candidates,
    q over a draft's ids, or one-hot): uniforms on and beside each cumulative boundary of the residual,
    where a last-bit difference in its float32 sum or quotient would pick another id."""
    rng = np.random.default_rng(11)
    for case in range(60):
        p_ids = np.sort(rng.choice(200, size=int(rng.integers(1, 90)), replace=False))
        p = rng.random(len(p_ids)).astype(np.float32) ** 3
        p /= p.sum()
        drafted = int(rng.choice(p_ids))
        if case % 3:
            q_ids = np.union1d(rng.choice(200, size=int(rng.integers(1, 40)), replace=False), [drafted])
            q = (rng.random(len(q_ids)) ** 3).astype(np.float32)
            q /= q.sum()
        else:
            q, q_ids = None, None
        one_hot = (np.ones(1, np.float32), np.array([drafted])) if q is None else (q, q_ids)
        union = np.union1d(p_ids, one_hot[1])
        p_on, q_on = np.zeros(len(union), np.float32), np.zeros(len(union), np.float32)
        p_on[np.searchsorted(union, p_ids)], q_on[np.searchsorted(union, one_hot[1])] = p, one_hot[0]
        probs = speculative.residual(p_on, q_on, drafted)
        cdf = np.cumsum(probs[probs > 0], dtype=np.float64)
        cdf /= cdf[-1]
        for u in [0.0, *cdf[:-1], *np.nextafter(cdf[:-1], 0), *rng.random(5)]:
            sampler = Sampler(SamplingParams(temperature=1.0))
            sampler.rng = ScriptedRng([u])
            expected = speculative._draw_residual(p, p_ids, q, q_ids, drafted, sampler)
            assert compiled_sampling._residual_draw(p, p_ids, *one_hot, u) == expected, (case, u)
