"""Speculative decoding: exactness of greedy, the exact and lossy sampling rules, rollback, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import build_reference, save_reference
from conftest import run_generate as run
from duet.engine import GenerateOptions, SamplingParams, Tokens, generate, load_model
from duet.engine.cache import IndexedKVCache, KVCache, WithPLE
from duet.engine.sampling import Sampler
from duet.engine.speculative import LOSSY, Draft, MTPDrafter, NoDrafter, accept


class OracleDrafter(NoDrafter):
    """Knows the true continuation; each draft is right with probability `right`, else a wrong token."""

    name = "oracle"
    depth_cap = 5

    def __init__(self, truth: list[int], prompt_len: int, right: float, seed: int):
        self.truth, self.prompt_len, self.right = truth, prompt_len, right
        self.rng = np.random.default_rng(seed)

    def propose(self, history, k, sampler):
        done = len(history) - self.prompt_len
        drafts = []
        for true in self.truth[done : done + k]:
            drafts.append(true if self.rng.random() < self.right else (true + 1) % 300)
        return Draft(drafts, [None] * len(drafts))


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "qwen4_exp_text"])
def model_of_each_type(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_reference(build_reference(request.param, seed=21), path)
    # No eos, so every run is 48 tokens long whatever the random model emits.
    tok_config = path / "tokenizer_config.json"
    tok_config.write_text(json.dumps({k: v for k, v in json.loads(tok_config.read_text()).items() if k != "eos_token"}))
    return load_model(path)


@pytest.mark.parametrize("right", [0.0, 0.5, 0.9])
def test_greedy_with_drafts_equals_greedy_without(model_of_each_type, right):
    lm = model_of_each_type
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 300, 30)]
    truth, _ = run(lm, prompt, GenerateOptions(max_tokens=48, draft="none"))
    oracle = OracleDrafter(truth, len(prompt), right, seed=4)
    drafted, finished = run(lm, prompt, GenerateOptions(max_tokens=48), drafter=oracle)
    assert drafted == truth
    stats = finished.stats
    assert stats.drafted > 0
    if right == 0.0:
        assert stats.accepted == 0
    if right == 0.9:
        assert stats.accepted > 0 and stats.accepted < stats.drafted and stats.tokens_per_cycle > 1.5


def test_ngram_drafts_keep_greedy_output(model_of_each_type):
    lm = model_of_each_type
    prompt = [5, 6, 7, 8, 9] * 8  # repetitive, so prompt lookup finds matches
    truth, _ = run(lm, prompt, GenerateOptions(max_tokens=40, draft="none"))
    drafted, finished = run(lm, prompt, GenerateOptions(max_tokens=40, draft="ngram"))
    assert drafted == truth and finished.stats.drafted > 0


def test_rule_switch_between_cycles_is_read_live(model_of_each_type):
    from duet.engine import Switches

    lm = model_of_each_type
    switches = Switches("exact")
    options = GenerateOptions(max_tokens=20, draft="ngram", sampling=SamplingParams(temperature=1.0, seed=1))
    rules = []
    for event in generate(lm, [5, 6, 7, 8] * 6, options, switches=switches):
        if isinstance(event, Tokens) and event.cycle:
            rules.append(event.cycle.rule)
            switches.accept = LOSSY
    assert rules[0] == "exact" and set(rules[1:]) == {"lossy"}


# ---------------------------------------------------------------------------------------------
# The rules on known distributions


def random_pair(rng, vocab=6):
    p = rng.dirichlet(np.ones(vocab))
    q = rng.dirichlet(np.ones(vocab))
    return p, q


def first_emitted(rule, p, q, sampler) -> tuple[int, int]:
    """Draft one token from q, verify against p; return (first emitted token, lossy count)."""
    x = sampler.draw(q)
    target = np.log(np.stack([p, p]))  # processed logits; the bonus row is never the first token
    verdict = accept(rule, target, Draft([x], [q]), sampler)
    return (x if verdict.accepted else verdict.next_token), verdict.lossy


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_exact_sampling_follows_p_not_q():
    rng = np.random.default_rng(0)
    p, q = random_pair(rng)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=5))
    counts = np.zeros(len(p))
    for _ in range(20000):
        counts[first_emitted("exact", p, q, sampler)[0]] += 1
    # chi-square, 5 degrees of freedom: 99.9% quantile is 20.5
    assert chi_square(counts, p) < 20.5
    assert chi_square(counts, q) > 200


def lossy_output_exactly(p, q):
    """The lossy rule's output distribution and its extra acceptance rate, by enumeration."""
    a = np.minimum(1.0, p / q)
    residual = np.maximum(p - q, 0)
    residual /= residual.sum()
    out = q * a
    extra = 0.0
    for x in range(len(p)):
        reject = q[x] * (1 - a[x])
        keep_anyway = residual[p <= p[x]].sum()
        extra += reject * keep_anyway
        out[x] += reject * keep_anyway
        out += reject * residual * (p > p[x])
    return out, extra


def test_lossy_extra_acceptance_equals_total_variation():
    rng = np.random.default_rng(1)
    for _ in range(50):
        p, q = random_pair(rng, vocab=8)
        out, extra = lossy_output_exactly(p, q)
        assert out.sum() == pytest.approx(1.0)
        assert extra == pytest.approx(0.5 * np.abs(out - p).sum(), abs=1e-12)


def test_lossy_rule_samples_match_the_exact_figures():
    rng = np.random.default_rng(2)
    p, q = random_pair(rng)
    out, extra = lossy_output_exactly(p, q)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=9))
    counts, lossy = np.zeros(len(p)), 0
    trials = 20000
    for _ in range(trials):
        token, kept = first_emitted(LOSSY, p, q, sampler)
        counts[token] += 1
        lossy += kept
    assert chi_square(counts, out) < 20.5
    assert lossy / trials == pytest.approx(extra, abs=4 * np.sqrt(extra / trials) + 1e-3)
    assert extra > 0.01  # the pair opens real drift, so the check above means something


# ---------------------------------------------------------------------------------------------
# Rollback


def carried(cache) -> list[np.ndarray]:
    """What a layer's cache carries into the next call, whatever its kind."""
    if isinstance(cache, WithPLE):  # Flash-Next: a DeltaNet layer's state and its n-gram history and conv
        return carried(cache.mixer) + [cache.ple.tokens, cache.ple.conv]
    if isinstance(cache, IndexedKVCache):  # Flash-Next: QSA's keys and values, raw and pooled index keys
        return carried(cache.kv) + [cache.raw, cache.blocks]
    if isinstance(cache, KVCache):
        return [cache.keys[:, : cache.length], cache.values[:, : cache.length]]
    return [cache.conv, cache.recurrent]


def test_rollback_equals_decoding_only_the_accepted_tokens(model_of_each_type):
    model = model_of_each_type.model
    ids = np.random.default_rng(6).integers(0, 300, 90)
    verified, plain = model.new_state(), model.new_state()
    model.forward(verified, ids[:70])
    model.forward(plain, ids[:70])
    model.forward(verified, ids[70:76])  # last token + 5 drafts
    verified.keep(3)  # two drafts kept
    for i in range(70, 73):
        model.forward(plain, ids[i : i + 1])
    assert verified.length == plain.length == 73
    for ours, theirs in zip(verified.layers, plain.layers):
        assert all(np.array_equal(a, b) for a, b in zip(carried(ours), carried(theirs), strict=True))
    step = ids[73:74]
    assert np.array_equal(model.logits(model.forward(verified, step)), model.logits(model.forward(plain, step)))


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("args,needle", [
    (("--draft", "ngram", "--depth", "0"), "between 1 and 7"),
    (("--draft", "ngram", "--depth", "8"), "between 1 and 7"),
    (("--draft", "ngram", "--depth", "two"), "whole number"),
    (("--draft", "mtp",), "no MTP head"),
])
def test_bad_speculative_flags(capsys, tiny_model_dir, args, needle):
    from duet.app.cli import main

    capsys.readouterr()
    code = main(["--headless", "hi", "--model", str(tiny_model_dir), *args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and needle in err


def test_mtp_drafts_keep_greedy_output_and_roll_back_their_own_cache(tmp_path):
    from conftest import add_random_mtp_head

    ref = build_reference("qwen3_5_text", seed=23)
    save_reference(ref, tmp_path)
    add_random_mtp_head(tmp_path, ref, seed=24)
    lm = load_model(tmp_path)
    prompt = [int(t) for t in np.random.default_rng(8).integers(0, 300, 25)]
    truth, _ = run(lm, prompt, GenerateOptions(max_tokens=32, draft="none"))
    drafter = MTPDrafter(lm.model)
    drafted, finished = run(lm, prompt, GenerateOptions(max_tokens=32, depth=3), drafter=drafter)
    assert drafted == truth
    assert finished.drafter == "mtp" and finished.stats.drafted > 0
    # Drafted rows are rewound: the MTP cache holds one row per committed position t (x_{t+1}, h_t).
    assert drafter.state.length == drafter.state.layers[0].length == len(prompt) + len(drafted) - 1


def test_an_mtp_commit_of_the_last_row_alone_caches_and_returns_what_all_rows_would(tmp_path):
    """A drafter's commit reads only its last row (MTPDrafter.commit, mtp_forward's last_only): that row
    has the bits it has among the others, and every row's keys and values are cached all the same."""
    from conftest import add_random_mtp_head

    ref = build_reference("qwen3_5_text", seed=23)
    save_reference(ref, tmp_path)
    add_random_mtp_head(tmp_path, ref, seed=24)
    model = load_model(tmp_path).model
    prompt = [int(t) for t in np.random.default_rng(8).integers(0, 300, 12)]
    hidden = model.forward(model.new_state(), prompt)
    whole, alone = model.new_mtp_state(), model.new_mtp_state()
    for start, stop in ((0, 5), (5, 8), (8, 11)):  # a prompt's rows, then commits of three rows each
        rows = model.mtp_forward(whole, prompt[start + 1 : stop + 1], hidden[start:stop])
        last = model.mtp_forward(alone, prompt[start + 1 : stop + 1], hidden[start:stop], last_only=True)
        assert last.shape[0] == 1 and np.array_equal(last, rows[-1:])
        cached, cached_alone = whole.layers[0], alone.layers[0]
        assert alone.length == whole.length == stop
        assert np.array_equal(cached_alone.keys[:, :stop], cached.keys[:, :stop])
        assert np.array_equal(cached_alone.values[:, :stop], cached.values[:, :stop])
