"""Output heads: host tables (int4 ranking, bf16 rescoring) and the draft shortlist, on tiny real models."""

from __future__ import annotations

import numpy as np
import pytest

from duet.app.cli import main
from conftest import add_random_mtp_head, build_reference, save_reference
from duet.engine import GenerateOptions, SamplingParams, Tokens, generate, load_model
from duet.engine import heads
from duet.engine.heads import RESCORE_CANDIDATES, RescoredHead
from duet.engine.speculative import MTPDrafter

STEPS = 64
DIMS = dict(hidden_size=128, intermediate_size=256, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """A tiny qwen3_5_text with a random MTP head and no stop token (every run is max_tokens long)."""
    import json

    path = tmp_path_factory.mktemp("heads")
    ref = build_reference("qwen3_5_text", seed=31, **DIMS)  # hidden 128: one W4 group per head row
    save_reference(ref, path)
    add_random_mtp_head(path, ref, seed=32)
    config = path / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "eos_token"}))
    return path


def prompt_of(seed: int, length: int = 30) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 300, length)]


def hidden_states(lm, prompt: list[int], steps: int = STEPS) -> np.ndarray:
    """Final hidden states along the bf16 head's greedy path, one per position [steps, H]."""
    model, state = lm.model, lm.model.new_state()
    hidden = model.forward(state, prompt)[-1:]
    rows = []
    for _ in range(steps):
        rows.append(hidden[0])
        hidden = model.forward(state, [int(np.argmax(model.logits(hidden)[0]))])
    return np.stack(rows)


def run(lm, prompt, options, drafter=None):
    tokens, finished = [], None
    for event in generate(lm, prompt, options, drafter=drafter):
        if isinstance(event, Tokens):
            tokens += event.token_ids
        else:
            finished = event
    return tokens, finished


def test_host_tables_greedy_ids_equal_the_bf16_heads_at_every_position(mtp_model):
    plain, tables = load_model(mtp_model), load_model(mtp_model, host_tables=True)
    assert isinstance(tables.model.lm_head, RescoredHead)
    hidden = hidden_states(plain, prompt_of(1))
    exact, rescored = plain.model.logits(hidden), tables.model.logits(hidden)
    assert np.array_equal(exact.argmax(axis=-1), rescored.argmax(axis=-1))
    finite = np.isfinite(rescored)
    assert (finite.sum(axis=-1) == RESCORE_CANDIDATES).all()
    np.testing.assert_allclose(rescored[finite], exact[finite], rtol=1e-5, atol=1e-5)  # the bf16 rows' own scores
    # The int4 ranking alone is not the bf16 head: rescoring is what makes the ids equal.
    ranking = tables.model.lm_head.ranking(hidden)
    assert np.abs(ranking - exact).max() > 1e-3
    # And through the engine: 64 greedy tokens identical, drafts or not.
    prompt = prompt_of(2)
    truth, _ = run(plain, prompt, GenerateOptions(max_tokens=STEPS, draft="none"))
    assert run(tables, prompt, GenerateOptions(max_tokens=STEPS, draft="none"))[0] == truth
    assert run(tables, prompt, GenerateOptions(max_tokens=STEPS, draft="mtp"))[0] == truth


def test_rescoring_with_sixteen_candidates_still_finds_the_bf16_argmax(mtp_model):
    """The seed's lower bound of candidates; how often the int4 top-16 misses the argmax is printed."""
    lm = load_model(mtp_model)
    hidden = hidden_states(lm, prompt_of(3))
    head = RescoredHead(lm.model.lm_head.weight, candidates=16)
    exact = lm.model.logits(hidden)
    assert np.array_equal(head(hidden).argmax(axis=-1), exact.argmax(axis=-1))


def test_sampling_with_host_tables_draws_only_from_the_candidates(mtp_model):
    lm = load_model(mtp_model, host_tables=True)
    prompt = prompt_of(4)
    options = GenerateOptions(max_tokens=40, draft="none", sampling=SamplingParams(temperature=1.5, seed=7))
    tokens, _ = run(lm, prompt, options)
    model, state = lm.model, lm.model.new_state()
    hidden = model.forward(state, prompt)[-1:]
    for token in tokens:
        assert np.isfinite(model.logits(hidden)[0, token])  # every sampled id was a rescored candidate
        hidden = model.forward(state, [token])


def test_host_tables_refuse_a_head_they_cannot_copy_to_int4_in_one_line(mtp_model, tiny_model, tmp_path, capsys):
    gguf = tmp_path / "q4.gguf"
    assert main(["convert", str(mtp_model), str(gguf), "--format", "gguf-q4_0"]) == 0
    for model, needle in [(gguf, "rescores with the float head, but lm_head.weight is stored quantized"),
                          (tiny_model, "needs a hidden size that is a multiple of 128")]:
        capsys.readouterr()
        code = main(["--headless", "hi", "--model", str(model), "--host-tables"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and needle in err


@pytest.fixture
def shortlist_of_200(monkeypatch):
    """A 200-row draft shortlist, so the 320-id tiny vocabulary is larger than it."""
    monkeypatch.setattr(heads, "SHORTLIST_ROWS", 200)


def test_the_draft_shortlist_is_the_first_rows_plus_the_stop_tokens(mtp_model, shortlist_of_200):
    assert heads.shortlist_ids(320, [250, 3, 400]).tolist() == list(range(200)) + [250]
    assert heads.shortlist_ids(200, [250]) is None  # a vocabulary no larger than the shortlist: all of it
    lm = load_model(mtp_model)
    hidden = hidden_states(lm, prompt_of(5), steps=8)
    draft, full = lm.model.draft_logits(hidden), lm.model.logits(hidden)
    ids = lm.model.draft_head.ids
    np.testing.assert_array_equal(draft[:, ids], full[:, ids])
    outside = np.ones(full.shape[1], bool)
    outside[ids] = False
    assert np.isneginf(draft[:, outside]).all()


def test_the_shortlist_keeps_the_seeds_share_of_a_vocabulary():
    """65,536 of the family's 248,320 ids; the same share of a smaller vocabulary in whole blocks of 64
    rows; never under 1,024 rows, so a small vocabulary is ranked whole."""
    assert heads.shortlist_rows(248_320) == heads.shortlist_rows(1_000_000) == 65_536
    assert heads.shortlist_rows(4_096) == 1_088  # the demo: 4,096 * 65,536 / 248,320 = 1,081
    assert heads.shortlist_rows(70_000) == 18_496
    assert heads.shortlist_rows(2_000) == 1_024 and heads.shortlist_rows(320) == 320
    assert heads.shortlist_ids(320, [0]) is None
    demo = heads.shortlist_ids(4_096, [0, 2, 4_000])
    assert demo.tolist() == list(range(1_088)) + [4_000]


def test_a_shortlists_greedy_ids_are_the_argmax_of_its_logits():
    """greedy_ids skips the [T, V] array of __call__ but picks the same ids, the first of equal
    maxima included (a stop token past the leading block ties with a leading id in row 0)."""
    ids = np.array([0, 1, 2, 3, 9])
    scores = np.array([[0.5, 2.0, -1.0, 0.0, 2.0], [1.0, 1.0, 0.0, 3.0, -2.0], [-1.0, -1.0, -1.0, -1.0, 4.0]], np.float32)
    head = heads.ShortlistHead(lambda hidden: scores[: hidden.shape[0]], ids, 12)
    hidden = np.zeros((3, 4), np.float32)
    np.testing.assert_array_equal(head.greedy_ids(hidden), head(hidden).argmax(axis=-1))
    assert head.greedy_ids(hidden).tolist() == [1, 3, 9]


@pytest.mark.parametrize("host_tables", [False, True])
def test_mtp_drafts_come_from_the_shortlist_and_greedy_output_is_unchanged(mtp_model, shortlist_of_200, host_tables):
    lm = load_model(mtp_model, host_tables=host_tables)
    prompt = prompt_of(6)
    truth, _ = run(lm, prompt, GenerateOptions(max_tokens=48, draft="none"))
    drafter = MTPDrafter(lm.model)
    proposed = []
    propose = drafter.propose
    drafter.propose = lambda history, k, sampler: proposed.append(draft := propose(history, k, sampler)) or draft
    tokens, finished = run(lm, prompt, GenerateOptions(max_tokens=48, depth=3), drafter=drafter)
    assert tokens == truth and finished.stats.drafted > 0
    drafted = [t for draft in proposed for t in draft.tokens]
    assert drafted and max(drafted) < 200
    # The shortlist changes what is drafted: without it some drafts would fall outside.
    assert max(truth) >= 200
