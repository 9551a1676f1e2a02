"""Boundaries of the logit processors and the sampler against independent references.

References: transformers' own logits processors (temperature, repetition penalty, top-p, min-p) and
their validation of settings; torch's softmax; the definitions written out here in plain Python
(presence penalty: subtract once per distinct earlier token; drawing: token i is drawn from a
uniform u in [0, 1) iff P(< i) <= u * total < P(<= i), evaluated in exact rational arithmetic).
Found by mutation testing (docs/TESTING.md): each test pins a boundary the broader comparisons in
test_sampling.py do not reach (ties, settings at the edge of their range, a float32 cumulative sum).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from duet.engine.errors import DuetError
from duet.engine.sampling import Sampler, SamplingParams, probabilities, process_logits, process_rows
from test_sampling import one_torch_thread, transformers_processed  # noqa: F401 (an autouse fixture: one torch thread)

pytestmark = pytest.mark.usefixtures("sampler_path")  # each test on the compiled kernels and on numpy

VOCAB = 41




def reference(logits: np.ndarray, input_ids: list[int], *, penalty=1.0, temperature=0.0, top_p=1.0, min_p=0.0):
    """transformers' processors, in generate's order, on one row (float32 in, float32 out)."""
    processors = LogitsProcessorList()
    if penalty != 1:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty))
    if temperature:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_p < 1:
        processors.append(TopPLogitsWarper(top_p))
    if min_p:
        processors.append(MinPLogitsWarper(min_p))
    ids = torch.tensor([input_ids], dtype=torch.long)
    return processors(ids, torch.from_numpy(logits[None].copy()))[0].numpy()


# ---------------------------------------------------------------------------------------------
# Settings


@pytest.mark.parametrize("name,value", [
    ("temperature", -0.5), ("top_k", -3), ("top_p", 1.25), ("min_p", 2.5),
    ("repetition_penalty", -2.0), ("presence_penalty", float("nan")), ("seed", -7),
])
def test_a_refused_setting_is_named_with_its_value(name, value):
    with pytest.raises(DuetError) as raised:
        SamplingParams(**{name: value})
    message = str(raised.value)
    assert message.startswith("invalid sampling setting: ") and name in message and str(value) in message


@pytest.mark.parametrize("name,value", [
    ("temperature", True), ("temperature", "0.7"), ("top_k", True), ("top_k", "5"), ("top_k", 5.0),
    ("top_p", "0.9"), ("min_p", False), ("repetition_penalty", True), ("presence_penalty", "1"),
    ("seed", True), ("seed", "3"), ("seed", 3.0),
])
def test_bools_strings_and_floats_for_whole_numbers_are_refused(name, value):
    # A bool is an int to Python, a string compares to nothing: neither is a setting.
    with pytest.raises(DuetError, match="invalid sampling setting"):
        SamplingParams(**{name: value})


def test_the_edges_of_each_range_are_accepted_as_transformers_accepts_them():
    # transformers takes the same edges: top_p 1.0, min_p 0 and 1, penalty just above 0, T above 0.
    TopPLogitsWarper(1.0), MinPLogitsWarper(0.0), MinPLogitsWarper(1.0)
    RepetitionPenaltyLogitsProcessor(1e-3), TemperatureLogitsWarper(1e-3), TopKLogitsWarper(1)
    for settings in [dict(temperature=0), dict(top_k=0), dict(top_p=1.0), dict(min_p=0.0), dict(min_p=1.0),
                     dict(repetition_penalty=1e-3), dict(presence_penalty=-2.0), dict(seed=0), dict(seed=None)]:
        SamplingParams(**settings)


# ---------------------------------------------------------------------------------------------
# Processors


def test_penalties_and_temperature_are_transformers_float32_operations_exactly():
    """Penalty 2.0 (and 1.3) then temperature, in float32 as transformers computes them: bit for bit,
    so the processed row stays float32 (the dtype of the verify rows)."""
    logits = (np.random.default_rng(11).standard_normal(VOCAB) * 3).astype(np.float32)
    previous = [0, 4, 4, 9, 17, 40]
    for penalty, temperature in [(2.0, 0.0), (2.0, 0.6), (1.3, 1.7)]:
        ours = process_logits(logits, SamplingParams(temperature, repetition_penalty=penalty), previous)
        expected = reference(logits, previous, penalty=penalty, temperature=temperature)
        assert ours.dtype == expected.dtype == np.float32
        np.testing.assert_array_equal(ours, expected)


def test_presence_penalty_of_one_subtracts_one_from_each_distinct_earlier_token():
    logits = (np.random.default_rng(12).standard_normal(VOCAB) * 3).astype(np.float32)
    previous = [2, 2, 30, 7]
    expected = [float(v) - (1.0 if i in set(previous) else 0.0) for i, v in enumerate(logits)]
    ours = process_logits(logits, SamplingParams(presence_penalty=1.0), previous)
    # Both sides subtract 1 once from a float32; the float64 of the right side rounds the same way.
    np.testing.assert_allclose(ours, np.array(expected, dtype=np.float32), rtol=0, atol=0)


def test_verify_row_i_counts_exactly_the_drafts_before_it():
    """Every draft is among the highest logits and new (not earlier generated, not drafted twice), so
    missing or extra penalties show in every row; the reference is transformers' processors on each
    row with input_ids previous + drafts[:i]."""
    rng = np.random.default_rng(13)
    rows = 5
    logits = (rng.standard_normal((rows, VOCAB)) * 3).astype(np.float32)
    logits[:, [20, 21, 22, 23]] = [6.0, 5.0, 4.5, 4.0]  # positive: the penalty divides them
    previous = [3, 8]
    drafts = [20, 21, 22, 23]  # the last one is only ever counted in the last row
    for params in [SamplingParams(temperature=0.8, repetition_penalty=2.0),
                   SamplingParams(repetition_penalty=1.3)]:
        ours = process_rows(logits, params, previous, drafts)
        for i in range(rows):
            expected = reference(logits[i], previous + drafts[:i], penalty=params.repetition_penalty,
                                 temperature=params.temperature)
            np.testing.assert_array_equal(ours[i], expected)


def test_top_p_removes_a_token_when_the_mass_above_it_equals_top_p_exactly():
    """Equal logits give probabilities exact in binary (1/4, 1/2): with top_p 1/2 the mass above the
    third of four equal tokens is exactly 1/2, and transformers removes it (cumulative <= 1 - top_p).
    Which of equal tokens goes is not defined by top-p (transformers drops the lower ids, duet the
    higher), so the count is compared."""
    for logits, top_p in [(np.zeros(4, dtype=np.float32), 0.5), (np.zeros(2, dtype=np.float32), 0.5),
                          (np.array([1.0, 1.0, 1.0, 1.0, -np.inf, 1.0, 1.0, 1.0], np.float32), 0.75)]:
        ours = process_logits(logits, SamplingParams(temperature=1.0, top_p=top_p), [])
        expected = reference(logits, [], temperature=1.0, top_p=top_p)
        assert np.isfinite(ours).sum() == np.isfinite(expected).sum()


def test_min_p_one_keeps_every_token_tied_with_the_most_likely():
    logits = np.array([2.0, -1.0, 2.0, 0.5, 2.0, -np.inf], dtype=np.float32)
    ours = process_logits(logits, SamplingParams(temperature=1.0, min_p=1.0), [])
    expected = reference(logits, [], temperature=1.0, min_p=1.0)
    np.testing.assert_array_equal(ours, expected)
    assert np.isfinite(ours).sum() == 3


def test_probabilities_of_rows_far_apart_are_each_rows_own_softmax():
    """Each row is shifted by its own maximum: a row 2000 below another must not underflow to 0/0."""
    logits = np.array([[1000.0, 999.0, 990.0], [-1000.0, -1001.0, -1010.0]], dtype=np.float32)
    expected = torch.softmax(torch.from_numpy(logits).double(), dim=-1).numpy()
    # float32 output of a float64 softmax: half an ulp of float32 (6e-8 relative) at most.
    np.testing.assert_allclose(probabilities(logits), expected, rtol=1.2e-7, atol=0)


# ---------------------------------------------------------------------------------------------
# Drawing


class ScriptedRng:
    def __init__(self, values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


def exact_draw(probs, u: float) -> int:
    """Inverse CDF in exact rationals: the token whose interval [P(< i), P(<= i)) holds u * total."""
    weights = [Fraction(float(p)) for p in probs]
    target, below = Fraction(u) * sum(weights), Fraction(0)
    for i, w in enumerate(weights):
        if below <= target < below + w:
            return i
        below += w
    raise AssertionError("u must lie in [0, 1)")


@pytest.mark.parametrize("probs,us", [
    # Unnormalised weights (draw's contract): total 4, boundaries at u = 1/4 and 3/4.
    (np.array([1.0, 2.0, 1.0]), [0.0, 0.2499, 0.25, 0.5, 0.7499, 0.75, 0.9, 0.999]),
    # A zero-probability token is never drawn, even at u exactly on its (empty) interval.
    (np.array([1.0, 0.0, 1.0]), [0.0, 0.5, np.nextafter(0.5, 0), 0.75]),
    (np.array([0.0, 1.0]), [0.0, 0.3]),
    # float32 weights whose float32 running sum rounds 1/2 + 2^-25 down to 1/2: u = 1/2 belongs to
    # token 1, which a float32 cumulative sum would hand to token 2.
    (np.array([2.0**-25, 0.5, 0.5 - 2.0**-25], dtype=np.float32), [0.5, np.nextafter(0.5, 1), 2.0**-26]),
])
def test_draw_is_the_exact_inverse_cdf(probs, us):
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    sampler.rng = ScriptedRng(us)
    assert [sampler.draw(probs) for _ in us] == [exact_draw(probs, u) for u in us]


@pytest.mark.parametrize("vocab", [VOCAB, 50_000])
def test_top_p_after_top_k_as_transformers_on_a_large_vocabulary(vocab):
    """Top-p looks only at the tokens top-k left (it sorted the whole vocabulary before: 9.8 ms a row at
    248,320 tokens); the kept set and values must be transformers' top-k then top-p. (Ties are pinned
    elsewhere: ours keeps every token tied with the k-th, torch.topk exactly k.)"""
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
    for top_k, top_p in ((20, 0.95), (5, 0.5), (64, 0.999)):
        params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
        want = transformers_processed(logits[None], params, [0])[0]
        got = process_logits(logits, params, [])
        assert np.array_equal(np.isfinite(got), np.isfinite(want)), (top_k, top_p)
        np.testing.assert_array_equal(got[np.isfinite(got)], want[np.isfinite(want)])
