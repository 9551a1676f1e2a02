"""Logit processors against transformers' own processors; the sampler against its distribution."""

from __future__ import annotations

import itertools

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
from duet.engine.sampling import Sampler, SamplingParams, candidates_top_k, probabilities, process_logits, process_rows

pytestmark = pytest.mark.usefixtures("sampler_path")  # each test on the compiled kernels and on numpy

VOCAB = 97


@pytest.fixture(autouse=True)
def one_torch_thread():
    # transformers' processors on tiny tensors are dominated by thread hand-off on a many-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_logits(seed: int, rows: int = 1) -> np.ndarray:
    # Positive and negative logits, so both branches of the repetition penalty are exercised.
    return (np.random.default_rng(seed).standard_normal((rows, VOCAB)) * 3).astype(np.float32)


def transformers_processed(logits: np.ndarray, params: SamplingParams, previous_ids: list[int]) -> np.ndarray:
    """What transformers' generate does to logits under these settings (its processors, in its order)."""
    processors = LogitsProcessorList()
    if params.repetition_penalty != 1:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.temperature > 0:
        processors.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            processors.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1:
            processors.append(TopPLogitsWarper(params.top_p))
        if params.min_p > 0:
            processors.append(MinPLogitsWarper(params.min_p))
    input_ids = torch.tensor([previous_ids] * logits.shape[0], dtype=torch.long)
    return processors(input_ids, torch.from_numpy(logits.copy())).numpy()


def assert_same_processed(ours: np.ndarray, reference: np.ndarray) -> None:
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(reference))
    finite = np.isfinite(reference)
    np.testing.assert_allclose(ours[finite], reference[finite], rtol=1e-6, atol=1e-5)


SETTINGS = list(
    itertools.product(
        (0.0, 0.3, 1.0, 1.7),  # temperature
        (0, 1, 5, 40),  # top_k
        (1.0, 0.9, 0.5, 0.05),  # top_p
        (0.0, 0.05, 0.3),  # min_p
        (1.0, 1.3, 0.7),  # repetition_penalty
    )
)


def test_process_logits_matches_transformers_processors() -> None:
    previous_ids = [3, 3, 17, 50, 96, 0, 17, 42]  # repeats count once
    for case, (temperature, top_k, top_p, min_p, penalty) in enumerate(SETTINGS):
        params = SamplingParams(temperature, top_k, top_p, min_p, repetition_penalty=penalty)
        logits = random_logits(case, rows=3)
        reference = transformers_processed(logits, params, previous_ids)
        assert_same_processed(process_logits(logits, params, previous_ids), reference)
        assert_same_processed(process_logits(logits[0], params, previous_ids), reference[0])


def test_rows_already_cut_to_a_shortlist_or_their_top_k_match_transformers_processors() -> None:
    """Rows mostly -inf (a draft shortlist's, the device's top-k cut) go the finite entries' way: the
    same result as transformers' processors, whole rows of them or one at a time, a row with fewer
    finite entries than k and a row of ties at the k-th included."""
    logits = random_logits(7, rows=4)
    logits[0, 60:] = -np.inf  # a shortlist of the first 60 ids
    logits[1, 3:] = -np.inf  # fewer than k left
    logits[2, np.argsort(-logits[2])[5:]] = -np.inf  # cut to its top 5
    logits[3, 100:] = -np.inf
    logits[3, [4, 9, 30]] = logits[3, :100].max() + 1  # three tied at the top
    for top_k in (1, 3, 5, 40):
        params = SamplingParams(1.3, top_k, top_p=0.9)
        reference = transformers_processed(logits, params, [])
        assert_same_processed(process_logits(logits, params, []), reference)
        for row, expected in zip(logits, reference):
            assert_same_processed(process_logits(row, params, []), expected)


def test_presence_penalty_subtracts_once_per_distinct_previous_token() -> None:
    logits = random_logits(1)[0]
    previous_ids = [5, 5, 5, 9, 60]
    expected = logits.copy()
    for token in set(previous_ids):
        expected[token] -= 0.75
    params = SamplingParams(presence_penalty=0.75)
    np.testing.assert_allclose(process_logits(logits, params, previous_ids), expected, rtol=0, atol=1e-6)


def test_presence_penalty_applies_after_repetition_penalty() -> None:
    logits = random_logits(2)[0]
    previous_ids = [1, 2, 2, 80]
    expected = transformers_processed(logits[None], SamplingParams(repetition_penalty=1.4), previous_ids)[0]
    expected[[1, 2, 80]] -= 0.5
    expected /= 0.8
    params = SamplingParams(temperature=0.8, repetition_penalty=1.4, presence_penalty=0.5)
    np.testing.assert_allclose(process_logits(logits, params, previous_ids), expected, rtol=1e-6, atol=1e-5)


def test_process_rows_counts_earlier_drafts_as_generated() -> None:
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.8, repetition_penalty=1.5, presence_penalty=0.4)
    previous_ids = [7, 8, 9]
    drafts = [30, 7, 31, 30]
    logits = random_logits(3, rows=len(drafts) + 1)
    rows = process_rows(logits, params, previous_ids, drafts)
    for i in range(len(drafts) + 1):
        expected = process_logits(logits[i], params, previous_ids + drafts[:i])
        np.testing.assert_array_equal(rows[i], expected)


def test_probabilities_are_a_softmax_with_zero_mass_on_removed_tokens() -> None:
    params = SamplingParams(temperature=0.7, top_k=10)
    processed = process_logits(random_logits(4)[0], params, [])
    probs = probabilities(processed)
    reference = torch.softmax(torch.from_numpy(processed).double(), dim=-1).float().numpy()
    assert probs.dtype == np.float32
    np.testing.assert_allclose(probs, reference, rtol=1e-6, atol=1e-9)
    assert np.all(probs[np.isneginf(processed)] == 0)
    assert np.isfinite(probabilities(np.array([1e4, -1e4, 0.0], dtype=np.float32))).all()


def test_greedy_pick_is_argmax_after_penalties() -> None:
    logits = random_logits(5)[0]
    top = int(np.argmax(logits))
    previous_ids = [top]
    params = SamplingParams(temperature=0.0, repetition_penalty=50.0)
    penalized = transformers_processed(logits[None], params, previous_ids)[0]
    assert int(np.argmax(penalized)) != top  # the penalty is strong enough to change the winner
    assert Sampler(params).pick(logits, previous_ids) == int(np.argmax(penalized))


def test_seeded_sampler_is_reproducible() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    logits = random_logits(6)[0]
    first, second = Sampler(params), Sampler(params)
    sequence = [first.pick(logits, []) for _ in range(200)]
    assert sequence == [second.pick(logits, []) for _ in range(200)]
    other = Sampler(SamplingParams(temperature=1.0, top_p=0.95, seed=1235))
    assert sequence != [other.pick(logits, []) for _ in range(200)]


def test_sampled_frequencies_match_probabilities() -> None:
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, seed=7)
    logits = random_logits(8)[0] / 3  # a flatter distribution, so several tokens carry real mass
    probs = probabilities(process_logits(logits, params, [])).astype(np.float64)
    draws = 20_000
    sampler = Sampler(params)
    counts = np.bincount([sampler.pick(logits, []) for _ in range(draws)], minlength=VOCAB)
    assert counts[probs == 0].sum() == 0
    kept = probs > 0
    assert kept.sum() >= 5
    # Pearson chi-square over the kept tokens; 40 is far beyond the 99.99th percentile for <= 11 degrees of freedom,
    # while a sampler that ignored the probabilities (say, uniform over the kept tokens) scores in the thousands.
    expected = draws * probs[kept]
    chi_square = float((((counts[kept] - expected) ** 2) / expected).sum())
    assert chi_square < 40
    uniform = np.full(kept.sum(), draws / kept.sum())
    assert float((((uniform - expected) ** 2) / expected).sum()) > 400


def test_only_top_k_sampling_without_penalties_needs_just_the_top_k_candidates() -> None:
    """A GPU sends only what top-k keeps of a row when that is all the processors can use (the
    GPU side: test_gpu_backend_simulated.py). A penalty can lift a token from outside the raw top k
    into the processed top k, so with one the whole row is needed; greedy goes by argmax ids."""
    logits = np.array([5.0, 4.0, 3.9, 0.0], np.float32)
    penalised = SamplingParams(temperature=1.0, top_k=2, repetition_penalty=2.0)
    kept = np.flatnonzero(process_logits(logits, penalised, [0]) > -np.inf)  # token 0 seen: 5 -> 2.5
    assert list(kept) == [1, 2]  # token 2 was not in the raw top 2
    assert candidates_top_k(penalised) == 0
    assert candidates_top_k(SamplingParams(temperature=1.0, top_k=2, presence_penalty=0.5)) == 0
    assert candidates_top_k(SamplingParams(top_k=2)) == 0  # greedy
    assert candidates_top_k(SamplingParams(temperature=1.0, top_k=2)) == 2


def test_top_p_takes_equally_likely_tokens_in_id_order() -> None:
    """Among equally likely tokens the lower ids count as above the others (a stable order), so the
    cut at top_p is one set whatever sort would be fastest: 64 tokens of three logits, shuffled."""
    logits = np.random.default_rng(0).integers(0, 3, 64).astype(np.float32)
    kept = np.flatnonzero(process_logits(logits, SamplingParams(temperature=1.0, top_p=0.3), []) > -np.inf)
    probs = np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum()
    by_rank = sorted(range(64), key=lambda i: (-logits[i], i))  # most likely first, ties by id
    above = np.cumsum([probs[i] for i in by_rank]) - [probs[i] for i in by_rank]
    assert np.array_equal(kept, np.sort([i for i, mass in zip(by_rank, above) if mass < 0.3]))


def test_a_draw_is_the_first_token_whose_cumulative_probability_passes_the_uniform() -> None:
    """The sampler's definition, over the whole vocabulary: the cumulative float64 sum, normalised,
    searched for the draw. Its zeros (tokens top-k and top-p removed, a residual's emptied entries)
    are skipped by the sampler; the token drawn must be the same, draw after draw, from one seed."""
    rng = np.random.default_rng(3)
    sampler, definition = Sampler(SamplingParams(temperature=1.0, seed=11)), np.random.Generator(np.random.PCG64(11))
    for trial in range(300):
        probs = rng.random(VOCAB).astype(np.float32)
        probs[rng.random(VOCAB) < (0.0, 0.5, 0.97)[trial % 3]] = 0  # none, half, nearly all removed
        probs[rng.integers(VOCAB)] = 0.25  # at least one token possible; unnormalised on purpose
        cdf = np.cumsum(probs, dtype=np.float64)
        want = int(np.searchsorted(cdf / cdf[-1], definition.random(), side="right"))
        assert sampler.draw(probs) == want and probs[want] > 0


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_k": -1},
        {"top_k": 2.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"min_p": 1.1},
        {"repetition_penalty": 0.0},
        {"presence_penalty": float("inf")},
        {"seed": -1},
    ],
)
def test_invalid_settings_raise_a_one_line_duet_error(settings: dict) -> None:
    with pytest.raises(DuetError, match="invalid sampling setting") as raised:
        SamplingParams(**settings)
    assert "\n" not in str(raised.value)
