"""Sampled speculative decoding against exact distributions (REFERENCE.md section 5).

One cycle of `accept()` on a toy model with a 5-token vocabulary and 3 drafts is checked against an
independent enumerator written here from the definition of the rules, never from the code under
test:

* the exact rule: the enumerated cycle, continued by plain sampling, is the model's own
  distribution (to 1e-12, a check of the enumerator); the sampled cycles match the enumeration and
  the model (chi-square), and the same statistic rejects deliberately wrong distributions;
* the lossy rule: the sampled cycles match the enumerated closed form, which drifts from the model
  by exactly the extra acceptance it makes (first position), and `Verdict.lossy` counts those keeps.

Both drafter kinds are covered: drafts drawn from a distribution q that acceptance is told (as MTP
gives), and drafts fixed by the history with q None, one-hot (as n-gram lookup gives; the history,
and so the draft, varies from cycle to cycle). Every scenario commits, with real probability, after a
rejection at the first draft, after one in the middle, and after keeping every draft (the bonus).

Chi-square p-values are computed here in closed form (no scipy). A comparison fails below
p = 1e-6; with under 30 such comparisons in the file the chance that a correct engine fails one for
a given seed is under 3e-5 (Bonferroni). The seeds are fixed, so a run is reproducible.
"""

from __future__ import annotations

import functools
import math
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import pytest

from duet.engine.sampling import Sampler, SamplingParams
from duet.engine.speculative import EXACT, LOSSY, Draft, accept, residual

pytestmark = pytest.mark.usefixtures("sampler_path")  # each test on the compiled kernels and on numpy

V = 5  # vocabulary
K = 3  # drafts per cycle: first, middle, last, then the bonus row
TRIALS = 12_000  # sampled cycles per scenario, ~0.1 ms each; the negative controls reject at p < 1e-100
ALPHA = 1e-6  # chi-square p-value below which a comparison fails (see the module docstring)
MTP, NGRAM = "mtp", "ngram"


# ---------------------------------------------------------------------------------------------
# Chi-square in closed form


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with df degrees of freedom: the closed forms for whole df
    (Abramowitz & Stegun 26.4.4 and 26.4.5), summed in log space so large df do not overflow."""
    if x <= 0:
        return 1.0
    h = x / 2
    if df % 2 == 0:
        total = sum(math.exp(j * math.log(h) - h - math.lgamma(j + 1)) for j in range(df // 2))
    else:
        total = math.erfc(math.sqrt(h))
        total += sum(math.exp((j + 0.5) * math.log(h) - h - math.lgamma(j + 1.5)) for j in range(df // 2))
    return min(1.0, total)


def test_chi2_sf_matches_table_values():
    # Upper critical values from the NIST/SEMATECH e-Handbook, section 1.3.6.7.4.
    for x, df, p in [(3.841, 1, 0.05), (9.488, 4, 0.05), (20.515, 5, 0.001), (29.588, 10, 0.001),
                     (149.449, 100, 0.001), (124.342, 100, 0.05)]:
        assert chi2_sf(x, df) == pytest.approx(p, rel=2e-3)  # the table prints 4 significant figures


def chi_square_p(counts: Counter, probs: dict, pool_below: float = 5.0) -> float:
    """Goodness-of-fit p-value of observed counts against probs (outcome -> probability).

    Cells expected fewer than `pool_below` times are pooled into one cell (Cochran's rule, so the
    chi-square approximation holds). An observation the distribution gives probability 0 is
    impossible under it: p-value 0.
    """
    n = sum(counts.values())
    if any(probs.get(key, 0.0) <= 0.0 for key in counts):
        return 0.0
    cells, pooled_e, pooled_o = [], 0.0, 0
    for key, prob in probs.items():
        e = n * prob
        if e < pool_below:
            pooled_e += e
            pooled_o += counts.get(key, 0)
        else:
            cells.append((counts.get(key, 0), e))
    if pooled_e > 0:
        cells.append((pooled_o, pooled_e))
    if pooled_e and pooled_e < pool_below and len(cells) > 2:  # the pool itself too small: merge it with another cell
        (o1, e1), (o2, e2) = cells.pop(), cells.pop()
        cells.append((o1 + o2, e1 + e2))
    assert len(cells) >= 2, "a goodness-of-fit test needs at least two cells"
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return chi2_sf(stat, len(cells) - 1)


# ---------------------------------------------------------------------------------------------
# A toy model and two toy drafters; a cycle's rows depend on the drafts before them


LEVELS = np.array([-1.6, -0.5, 0.0, 0.8, 1.7])  # few logit values, so exact ties between tokens are common


@dataclass(frozen=True)
class Scenario:
    kind: str  # MTP: drafts drawn from q, which acceptance is told; NGRAM: q None (one-hot)
    seed: int
    sharpness: float = 1.0  # logit scale: a sharper model keeps more deterministic drafts

    @functools.cache
    def logits(self, prefix: tuple[int, ...]) -> np.ndarray:
        """The target's processed logits after the cycle's earlier drafts `prefix` (float32, as the
        engine's verify rows). Values repeat, and some rows forbid a token (-inf, as top-k does)."""
        rng = np.random.default_rng([self.seed, 0, len(prefix), *prefix])
        row = rng.choice(LEVELS, size=V) * self.sharpness
        if rng.random() < 0.3:
            row[rng.integers(V)] = -np.inf
        return row.astype(np.float32)

    @functools.cache
    def p(self, prefix: tuple[int, ...]) -> np.ndarray:
        """The target distribution of that row, float64, by this file's own softmax."""
        row = self.logits(prefix).astype(np.float64)
        weights = np.exp(row - row.max())
        return weights / weights.sum()

    @functools.cache
    def d(self, prefix: tuple[int, ...]) -> np.ndarray:
        """How the draft after `prefix` is distributed. MTP: this is q, near p but not equal (it even
        drafts forbidden tokens). NGRAM: a lookup's draft is fixed by the history, which varies from
        cycle to cycle; d is that variation, unknown to acceptance (q None), and mostly the mode."""
        rng = np.random.default_rng([self.seed, 1, len(prefix), *prefix])
        if self.kind == MTP:
            return 0.35 * self.p(prefix) + 0.65 * rng.dirichlet(np.ones(V))
        return 0.6 * np.eye(V)[np.argmax(self.p(prefix))] + 0.4 * rng.dirichlet(np.ones(V))

    def q(self, prefix: tuple[int, ...]) -> np.ndarray | None:
        return self.d(prefix) if self.kind == MTP else None

    def drafts(self, prefix: tuple[int, ...]) -> list[tuple[int, float, np.ndarray]]:
        """(draft, its probability, the q acceptance uses: one-hot for q None) after prefix."""
        d = self.d(prefix)
        return [(x, float(d[x]), d if self.kind == MTP else np.eye(V)[x]) for x in range(V) if d[x] > 0]

    @functools.cache
    def cdf(self, prefix: tuple[int, ...], which: str) -> np.ndarray:
        return np.cumsum(getattr(self, which)(prefix))

    def draw(self, rng: np.random.Generator, prefix: tuple[int, ...], which: str) -> int:
        """A token from p or d after prefix, by a generator of the test's own (inverse CDF)."""
        cdf = self.cdf(prefix, which)
        return min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), V - 1)

    def target(self, tokens: tuple[int, ...]) -> np.ndarray:
        """The verify rows [K + 1, V] for these drafts: row i follows drafts[:i]."""
        return np.stack([self.logits(tokens[:i]) for i in range(len(tokens) + 1)])


SCENARIOS = {MTP: Scenario(MTP, seed=18), NGRAM: Scenario(NGRAM, seed=46, sharpness=2.0)}


# ---------------------------------------------------------------------------------------------
# The independent enumerator


def norm_residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    rest = np.maximum(p - q, 0.0)
    return rest / rest.sum()


def enumerate_cycle(scn: Scenario, rule: str, k: int = K, wrong: str | None = None) -> dict:
    """Exact distribution of one cycle's outcome (committed tokens, lossy keeps), from REFERENCE.md:
    keep draft x ~ q with probability min(1, p(x)/q(x)); else draw r from norm(max(0, p - q)) and
    commit r, except that the lossy rule keeps x anyway when p(x) >= p(r); after k kept drafts the
    bonus is drawn from row k.

    `wrong` builds a deliberately wrong distribution for negative controls: "bonus_row" draws the
    bonus from row k - 1; "residual_keeps_draft" draws r from norm(p) for one-hot drafts;
    "strict_lossy" keeps only when p(x) > p(r).
    """
    out: dict = defaultdict(float)

    def walk(prefix: tuple[int, ...], prob: float, lossy: int) -> None:
        p = scn.p(prefix)
        if len(prefix) == k:
            bonus = scn.p(prefix[:-1]) if wrong == "bonus_row" and k else p
            for y in range(V):
                out[(prefix + (y,), lossy)] += prob * bonus[y]
            return
        for x, weight, q in scn.drafts(prefix):
            keep = min(1.0, p[x] / q[x])
            if keep > 0:
                walk(prefix + (x,), prob * weight * keep, lossy)
            if keep == 1.0:
                continue
            res = norm_residual(p, q)
            if wrong == "residual_keeps_draft" and scn.kind == NGRAM:
                res = p
            rejected = prob * weight * (1.0 - keep)
            for r in range(V):
                if res[r] == 0:
                    continue
                kept_anyway = p[x] > p[r] if wrong == "strict_lossy" else p[x] >= p[r]
                if rule == LOSSY and kept_anyway:
                    walk(prefix + (x,), rejected * res[r], lossy + 1)
                else:
                    out[(prefix + (r,), lossy)] += rejected * res[r]

    walk((), 1.0, 0)
    return {key: prob for key, prob in out.items() if prob > 0}


def committed_only(dist: dict) -> dict:
    marginal: dict = defaultdict(float)
    for (tokens, _), prob in dist.items():
        marginal[tokens] += prob
    return dict(marginal)


def extend(scn: Scenario, dist: dict, length: int = K + 1) -> dict:
    """Continue each committed sequence by plain sampling from the model up to `length` tokens."""
    out: dict = defaultdict(float)
    stack = list(committed_only(dist).items())
    while stack:
        tokens, prob = stack.pop()
        if len(tokens) == length:
            out[tokens] += prob
            continue
        p = scn.p(tokens)
        stack.extend((tokens + (y,), prob * p[y]) for y in range(V) if p[y] > 0)
    return dict(out)


def model_joint(scn: Scenario, length: int = K + 1) -> dict:
    """The model's own distribution of `length` tokens: prod_i p(y_i | y_<i)."""
    return extend(scn, {((), 0): 1.0}, length)


def first_token(dist: dict) -> np.ndarray:
    out = np.zeros(V)
    for (tokens, _), prob in dist.items():
        out[tokens[0]] += prob
    return out


def by_class(dist: dict) -> dict:
    """Outcome class of each committed sequence: rejected at the first draft, in the middle, or every
    draft kept (the last token is the bonus)."""
    out: dict = defaultdict(float)
    for (tokens, _), prob in dist.items():
        out[outcome_class(len(tokens))] += prob
    return dict(out)


def outcome_class(committed: int) -> str:
    return {1: "reject_first", K + 1: "accept_all"}.get(committed, "reject_middle")


def tv(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(key, 0.0) - b.get(key, 0.0)) for key in set(a) | set(b))


@pytest.mark.parametrize("kind", [MTP, NGRAM])
def test_enumerated_exact_cycle_is_the_model_distribution(kind):
    scn = SCENARIOS[kind]
    dist = enumerate_cycle(scn, EXACT)
    assert sum(dist.values()) == pytest.approx(1.0, abs=1e-12)
    # Float64 sums of a few hundred terms: 1e-12 is far above rounding and far below any real error.
    assert np.allclose(first_token(dist), scn.p(()), rtol=0, atol=1e-12)
    joint, extended = model_joint(scn), extend(scn, dist)
    assert tv(extended, joint) < 1e-12
    # Each outcome class is likely enough that the sampled tests below see it thousands of times.
    classes = by_class(dist)
    assert min(classes.values()) > 0.1, classes
    # The negative controls are materially wrong (the sampled tests show their statistic rejects them).
    for wrong in ["bonus_row"] + (["residual_keeps_draft"] if kind == NGRAM else []):
        assert tv(extend(scn, enumerate_cycle(scn, EXACT, wrong=wrong)), joint) > 0.03, wrong


def lossy_one_position(p: np.ndarray, q: np.ndarray, drafted: np.ndarray) -> tuple[np.ndarray, float]:
    """Closed form of the lossy rule at one position, drafts distributed as `drafted` and checked
    against q: (the output distribution, the probability of a lossy keep)."""
    res = norm_residual(p, q) if np.any(p > q) else np.zeros(V)
    out, extra = np.zeros(V), 0.0
    for x in np.flatnonzero(drafted):
        keep = min(1.0, p[x] / q[x])
        rejected = drafted[x] * (1 - keep)
        anyway = res[p <= p[x]].sum()  # r ranked no higher than x: x is kept
        out[x] += drafted[x] * keep + rejected * anyway
        out += rejected * res * (p > p[x])
        extra += rejected * anyway
    return out, extra


@pytest.mark.parametrize("kind", [MTP, NGRAM])
def test_enumerated_lossy_drift_equals_extra_acceptance(kind):
    scn = SCENARIOS[kind]
    lossy = enumerate_cycle(scn, LOSSY)
    assert sum(lossy.values()) == pytest.approx(1.0, abs=1e-12)
    # First position, closed form against the enumerator (1e-12: float64 rounding of short sums).
    p, d = scn.p(()), scn.d(())
    if kind == MTP:  # one q for every draft
        groups = [(1.0, d, d)]
    else:  # q is one-hot on whichever token the lookup drafted
        groups = [(d[x], np.eye(V)[x], np.eye(V)[x]) for x in np.flatnonzero(d)]
    mixture, extra = np.zeros(V), 0.0
    for weight, q, drafted in groups:
        out, keeps = lossy_one_position(p, q, drafted)
        # Every lossy keep moves one unit of mass from the replacement r (p > q there) to the draft
        # x (q > p there), disjoint sets for one q, so the drift opened is the extra acceptance.
        assert 0.5 * np.abs(out - p).sum() == pytest.approx(keeps, abs=1e-12)
        mixture += weight * out
        extra += weight * keeps
    assert np.allclose(first_token(lossy), mixture, rtol=0, atol=1e-12)
    drift = 0.5 * np.abs(mixture - p).sum()
    assert drift > 0.02  # the rule really drifts here
    if kind == MTP:
        assert drift == pytest.approx(extra, abs=1e-12)
    else:  # across lookups a token is drafted in one and the replacement in another: mass cancels
        assert drift <= extra + 1e-12
    # Over the whole cycle the output drifts from the model, and ties (p(x) == p(r)) matter.
    assert tv(extend(scn, lossy), model_joint(scn)) > 0.02
    assert tv(lossy, enumerate_cycle(scn, LOSSY, wrong="strict_lossy")) > 0.02
    assert min(by_class(lossy).values()) > 0.1


def test_residual_is_the_normalised_positive_part():
    scn = SCENARIOS[MTP]
    for prefix in [(), (0,), (1, 2), (3, 3, 4)]:
        p32 = np.exp(scn.logits(prefix).astype(np.float64) - scn.logits(prefix).max())
        p32 = (p32 / p32.sum()).astype(np.float32)  # the dtype accept() hands to residual()
        q = scn.q(prefix)
        for x in range(V):
            for q_x, expected in [(q, norm_residual(p32.astype(np.float64), q)),
                                  (None, norm_residual(p32.astype(np.float64), np.eye(V)[x]))]:
                got = residual(p32, q_x, x)
                # float32 p: its rounding (6e-8 relative) is the only difference from float64.
                assert np.allclose(got, expected, rtol=0, atol=1e-6)
                assert abs(float(np.sum(got, dtype=np.float64)) - 1.0) < 1e-6


# ---------------------------------------------------------------------------------------------
# Sampled cycles


@functools.cache
def simulate(kind: str, rule: str) -> tuple[Counter, Counter, np.ndarray]:
    """TRIALS cycles through accept(), drafts drawn by the same seeded sampler (as MTP does).

    Returns counts of (committed tokens, lossy keeps), counts of the committed tokens continued by
    plain sampling from the model to K + 1 tokens (a separate generator, test machinery only), and
    the lossy count of every cycle.
    """
    scn = SCENARIOS[kind]
    sampler = Sampler(SamplingParams(temperature=1.0, seed=101 + 2 * (kind == NGRAM) + (rule == LOSSY)))
    history = np.random.default_rng(303)  # NGRAM: the varying history that fixes each lookup's drafts
    extender = np.random.default_rng(202)
    outcomes, extended, lossy = Counter(), Counter(), np.zeros(TRIALS, dtype=np.int64)
    for t in range(TRIALS):
        tokens, qs = [], []
        for _ in range(K):
            q = scn.q(tuple(tokens))
            tokens.append(scn.draw(history, tuple(tokens), "d") if q is None else sampler.draw(q))
            qs.append(q)
        verdict = accept(rule, scn.target(tuple(tokens)), Draft(list(tokens), qs), sampler)
        committed = tuple(tokens[: verdict.accepted]) + (verdict.next_token,)
        outcomes[(committed, verdict.lossy)] += 1
        lossy[t] = verdict.lossy
        while len(committed) < K + 1:
            committed += (scn.draw(extender, committed, "p"),)
        extended[committed] += 1
    return outcomes, extended, lossy


def restrict(counts: Counter, probs: dict, cls: str) -> tuple[Counter, dict]:
    """The outcomes of one class, everything else lumped into one cell: a coarser partition of the
    same outcome space, so the goodness-of-fit test stays valid."""
    other = ("other",)
    sub_counts, sub_probs = Counter(), defaultdict(float)
    for key, n in counts.items():
        sub_counts[key if outcome_class(len(key[0])) == cls else other] += n
    for key, prob in probs.items():
        sub_probs[key if outcome_class(len(key[0])) == cls else other] += prob
    return sub_counts, dict(sub_probs)


CASES = [(MTP, EXACT), (NGRAM, EXACT), (MTP, LOSSY), (NGRAM, LOSSY)]


# The full comparison comes first: simulate() is cached, so only the first test to ask for a case
# calls accept(), and mutation testing (scripts/mutation.sh) runs just the tests that called the
# mutated function. The first test must therefore be the one that sees every outcome.
@pytest.mark.parametrize("kind,rule", CASES)
def test_sampled_cycles_match_the_enumeration(kind, rule):
    scn = SCENARIOS[kind]
    counts, _, lossy = simulate(kind, rule)
    expected = enumerate_cycle(scn, rule)
    assert chi_square_p(counts, expected) > ALPHA
    accepted = Counter(len(tokens) - 1 for tokens, _ in counts.elements())
    accepted_expected: dict = defaultdict(float)
    for (tokens, _), prob in expected.items():
        accepted_expected[len(tokens) - 1] += prob
    assert chi_square_p(accepted, dict(accepted_expected)) > ALPHA
    # Verdict.lossy: its mean against the enumerated mean. 5.3 standard errors is two-sided
    # p = 1.2e-7 for the normal limit (TRIALS cycles of a count bounded by K).
    mean = sum(n * prob for (_, n), prob in expected.items())
    var = sum(n * n * prob for (_, n), prob in expected.items()) - mean**2
    assert abs(lossy.mean() - mean) <= 5.3 * math.sqrt(var / TRIALS) + 1e-12
    if rule == LOSSY:
        assert mean > 0.05  # so the check above has something to count
    # Negative controls: the same statistic on the same samples rejects wrong distributions.
    wrongs = ["bonus_row"]
    # The lossy rule mostly keeps a draft redrawn as its own replacement (p(x) >= p(x)): that bug
    # shows there in the lossy count only, so its control is the exact rule's.
    wrongs += ["residual_keeps_draft"] if kind == NGRAM and rule == EXACT else []
    wrongs += ["strict_lossy"] if rule == LOSSY else []
    for wrong in wrongs:
        assert chi_square_p(counts, enumerate_cycle(scn, rule, wrong=wrong)) < ALPHA, wrong
    other_rule = LOSSY if rule == EXACT else EXACT
    assert chi_square_p(committed_view(counts), committed_only(enumerate_cycle(scn, other_rule))) < ALPHA


@pytest.mark.parametrize("kind,rule", CASES)
@pytest.mark.parametrize("cls", ["reject_first", "reject_middle", "accept_all"])
def test_sampled_cycles_match_the_enumeration_per_outcome(kind, rule, cls):
    """Each outcome class on its own: rejection at the first draft, in the middle, and the bonus."""
    scn = SCENARIOS[kind]
    counts = simulate(kind, rule)[0]
    expected = enumerate_cycle(scn, rule)
    assert chi_square_p(*restrict(counts, expected, cls)) > ALPHA


def committed_view(counts: Counter) -> Counter:
    out = Counter()
    for (tokens, _), n in counts.items():
        out[tokens] += n
    return out


@pytest.mark.parametrize("kind", [MTP, NGRAM])
def test_exact_rule_output_is_the_model_distribution(kind):
    """(a) against the model itself, no enumerator: the first committed token follows p of row 0,
    and the committed tokens continued by plain sampling follow the model's joint distribution."""
    scn = SCENARIOS[kind]
    counts, extended, _ = simulate(kind, EXACT)
    p0 = {y: float(scn.p(())[y]) for y in range(V) if scn.p(())[y] > 0}
    first = Counter()
    for (tokens, _), n in counts.items():
        first[tokens[0]] += n
    assert chi_square_p(first, p0) > ALPHA
    joint = model_joint(scn)
    assert chi_square_p(extended, joint) > ALPHA
    # Negative controls: the drafts' own distribution, and the bonus drawn from the row before its
    # own (a row read for the wrong position).
    d0 = scn.d(())
    assert chi_square_p(first, {y: float(d0[y]) for y in range(V) if d0[y] > 0}) < ALPHA
    shifted = extend(scn, enumerate_cycle(scn, EXACT, wrong="bonus_row"))
    assert chi_square_p(extended, shifted) < ALPHA


# ---------------------------------------------------------------------------------------------
# Boundaries no sampling test can reach, and the greedy path


class ScriptedRng:
    """Stands in for the sampler's generator: random() returns the given values in order."""

    def __init__(self, values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


def scripted_sampler(*values) -> Sampler:
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    sampler.rng = ScriptedRng(values)
    return sampler


@pytest.mark.parametrize("rule", [EXACT, LOSSY])
@pytest.mark.parametrize("with_q", [True, False])
def test_a_draft_the_target_forbids_is_never_kept_even_at_u_zero(rule, with_q):
    """Accept iff u < p(x)/q(x), strictly: random() can return 0.0, and a token top-k removed
    (p = 0) must still be rejected then. The residual draw then lands on token 2."""
    with np.errstate(divide="ignore"):  # log 0 = -inf: the token is removed
        logits = np.log(np.array([[0.0, 0.5, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]], dtype=np.float32))
    q = np.array([0.7, 0.1, 0.1, 0.1]) if with_q else None
    verdict = accept(rule, logits, Draft([0], [q]), scripted_sampler(0.0, 0.6))
    assert (verdict.accepted, verdict.next_token, verdict.lossy) == (0, 2, 0)


def test_acceptance_is_strict_at_the_ratio():
    """u exactly p(x)/q(x) rejects: P(u < r) = r for u uniform on the multiples of 2^-53 in [0, 1)."""
    logits = np.log(np.array([[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]], dtype=np.float32))
    verdict = accept(EXACT, logits, Draft([0], [None]), scripted_sampler(0.5, 0.9))
    assert (verdict.accepted, verdict.next_token) == (0, 2)
    verdict = accept(EXACT, logits, Draft([0], [None]), scripted_sampler(np.nextafter(0.5, 0), 0.9))
    assert (verdict.accepted, verdict.next_token) == (1, 2)  # kept; bonus from row 1 (1/3 each)


@pytest.mark.parametrize("rule", [EXACT, LOSSY])
@pytest.mark.parametrize("drafts,accepted", [
    ([], 0), ([4, 1, 2], 0), ([3, 4, 2], 1), ([3, 1, 4], 2), ([3, 1, 2], 3),
])
def test_greedy_keeps_drafts_while_they_are_each_rows_argmax(rule, drafts, accepted):
    argmax = [3, 1, 2, 0]  # per verify row; the bonus row's differs from the last draft row's
    rows = np.full((len(drafts) + 1, V), -1.0, dtype=np.float32)
    for i in range(len(drafts) + 1):
        rows[i, argmax[i]] = 2.0
        rows[i, (argmax[i] + 1) % V] = 1.0
    verdict = accept(rule, rows, Draft(drafts, [None] * len(drafts)), Sampler(SamplingParams(temperature=0.0)))
    assert (verdict.accepted, verdict.next_token, verdict.lossy) == (accepted, argmax[accepted], 0)


@pytest.mark.parametrize("rule", [EXACT, LOSSY])
def test_a_cycle_over_the_top_k_candidates_decides_as_over_whole_rows(rule):
    """Verify rows and drafts' q over the few ids top-k keeps (the op sets' top_k_candidates, as
    generate and the MTP drafter read them) give the verdict whole rows give, for the same draws:
    kept, rejected with a residual draw, and drafts outside the target's candidates (p = 0), with
    sampled (q) and deterministic (one-hot) drafts."""
    from duet.engine.backend.cpu_ops import CpuOps
    from duet.engine.sampling import probabilities, process_logits, process_rows

    vocab, rng, ops = 60, np.random.default_rng(11), CpuOps()
    for case in range(300):
        params = SamplingParams(temperature=0.8, top_k=int(rng.integers(1, 8)), top_p=0.9, seed=case)
        depth = int(rng.integers(1, 4))
        tokens, whole_q, few_q, q_ids = [], [], [], []
        for _ in range(depth):
            draft_logits = (rng.standard_normal((1, vocab)) * 2).astype(np.float32)
            if rng.random() < 0.3:  # a deterministic draft, anywhere in the vocabulary
                tokens.append(int(rng.integers(vocab)))
                whole_q.append(None), few_q.append(None), q_ids.append(None)
                continue
            q = probabilities(process_logits(draft_logits[0], params, []))
            tokens.append(Sampler(params).draw(q))
            values, ids = ops.top_k_candidates(draft_logits, params.top_k, params.temperature)
            whole_q.append(q), few_q.append(probabilities(process_logits(values[0], params, [], ids))), q_ids.append(ids)
        logits = (rng.standard_normal((depth + 1, vocab)) * 2).astype(np.float32)
        values, columns = ops.top_k_candidates(logits, params.top_k, params.temperature)
        whole = accept(rule, process_rows(logits, params, [], tokens), Draft(tokens, whole_q), Sampler(params))
        few = accept(rule, process_rows(values, params, [], tokens, columns), Draft(tokens, few_q, q_ids), Sampler(params),
                     columns)
        assert few == whole, case


def test_residual_without_positive_part_falls_back_to_p():
    """p <= q everywhere (so p == q, or p one-hot on the draft with q None): norm(max(0, p - q)) is
    0/0, and acceptance never asks for it (u * q(x) < p(x) always holds). residual() answers p."""
    p = np.array([0.25, 0.5, 0.25], dtype=np.float32)
    np.testing.assert_array_equal(residual(p, p.astype(np.float64), 1), p)
    one_hot = np.array([0.0, 1.0, 0.0], dtype=np.float32)
    np.testing.assert_array_equal(residual(one_hot, None, 1), one_hot)


# ---------------------------------------------------------------------------------------------
# Drafters, depth and the rule's name, each against a plain restatement of its definition

from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402
import zlib  # noqa: E402

from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor  # noqa: E402
import torch  # noqa: E402

from duet.engine.choices import Accept  # noqa: E402
from duet.engine.choices import Draft as DraftChoice  # noqa: E402
from duet.engine.errors import DuetError  # noqa: E402
from duet.engine.model import Model  # noqa: E402
from duet.engine.speculative import (  # noqa: E402
    Depth,
    DraftCosts,
    MTPDrafter,
    NgramDrafter,
    NoDrafter,
    check_rule,
    draft_costs,
    make_drafter,
)

MODELS = Path(__file__).resolve().parents[2] / "models"


def lookup_reference(history: list[int], k: int) -> list[int]:
    """Prompt lookup as its docstring defines it: for n = 3, 2, 1, the last n tokens; their latest
    earlier occurrence (starting before the tail does); the k tokens after it."""
    for n in (3, 2, 1):
        tail = history[len(history) - n:] if n <= len(history) else None
        starts = [s for s in range(len(history) - n) if history[s:s + n] == tail]
        if starts:
            return history[max(starts) + n:][:k]
    return []


def test_ngram_lookup_matches_its_definition_on_random_histories():
    rng = np.random.default_rng(5)
    drafter, sampler = NgramDrafter(), Sampler(SamplingParams())
    checked = Counter()
    for _ in range(4000):
        history = [int(t) for t in rng.integers(0, int(rng.integers(2, 6)), size=int(rng.integers(0, 20)))]
        k = int(rng.integers(0, 9))
        draft = drafter.propose(history, k, sampler)
        expected = lookup_reference(history, k)
        assert (draft.tokens, draft.q) == (expected, [None] * len(expected)), (history, k)
        checked[len(expected)] += 1
    assert all(checked[n] > 20 for n in range(9))  # empty, short and full-depth drafts all occur


@pytest.mark.parametrize("history,k,expected", [
    ([1, 2, 3, 9, 1, 2, 3], 4, [9, 1, 2, 3]),  # the 3-gram wins
    ([5, 1, 2, 7, 2, 8, 1, 2], 2, [7, 2]),  # the 2-gram [1, 2] at 1, not the 1-gram [2] at 4
    ([4, 6, 4, 7, 4], 3, [7, 4]),  # the latest earlier [4], and the draft stops at the history's end
    ([1, 1, 1], 5, [1]), ([3, 3], 2, [3]), ([2], 3, []), ([], 3, []), ([1, 2, 3], 2, []),
])
def test_ngram_lookup_examples(history, k, expected):
    draft = NgramDrafter().propose(history, k, Sampler(SamplingParams()))
    assert draft.tokens == expected and draft.q == [None] * len(expected)


class SymbolicState:
    """The MTP head's cache: one row (x_{t+1}, h_t) per position it has seen."""

    def __init__(self):
        self.rows: list = []

    @property
    def length(self) -> int:
        return len(self.rows)

    def rewind(self, length: int) -> None:
        del self.rows[length:]


def symbols(*items) -> np.ndarray:
    out = np.empty((len(items), 1), dtype=object)
    for i, item in enumerate(items):
        out[i, 0] = item
    return out


class SymbolicModel:
    """Stands in for Model's MTP interface. An MTP output is the symbol ("mtp", the cache rows up to
    its own), so it names exactly what the layer attended to; draft logits are a fixed pseudo-random
    function of the symbol they are computed from."""

    mtp_plan = None  # no one-call form: Model's own loops draft (mtp_forward, then the draft head)
    mtp_greedy_drafts = Model.mtp_greedy_drafts
    mtp_sampled_drafts = Model.mtp_sampled_drafts

    def __init__(self, vocab: int = 6):
        self.vocab, self.mtp, self.calls = vocab, "head", []

    def new_mtp_state(self):
        return SymbolicState()

    def mtp_forward(self, state, next_tokens, hidden, last_only: bool = False):
        assert len(next_tokens) == len(hidden)
        out = []
        for x, h in zip(next_tokens, hidden[:, 0]):
            state.rows.append((int(x), h))
            out.append(("mtp", tuple(state.rows)))
        return symbols(*out[-1:] if last_only else out)

    def draft_candidates(self, hidden, top_k: int = 0, temperature: float = 1.0):
        """Whole rows whatever top_k asks (Model may send only what top-k keeps; the processors apply it)."""
        return np.stack([logits_of(h, self.vocab) for h in hidden[:, 0]]), None

    def draft_greedy_ids(self, hidden):
        return self.draft_candidates(hidden)[0].argmax(axis=-1)


def logits_of(symbol, vocab: int) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(repr(symbol).encode()))
    return (rng.standard_normal(vocab) * 2 + 1).astype(np.float32)


def mtp_reference(cache: list, k: int, history: list[int], pick) -> list[int]:
    """The MTP docstring: the last committed row's output predicts the first draft; each further
    draft runs the layer on (previous draft, previous output) after the committed rows."""
    rows, tokens = list(cache), []
    out = ("mtp", tuple(rows))
    for i in range(k):
        if i:
            rows.append((tokens[-1], out))
            out = ("mtp", tuple(rows))
        tokens.append(pick(logits_of(out, 6), history + tokens, i))
    return tokens


def penalised(logits: np.ndarray, previous: list[int], penalty: float) -> np.ndarray:
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    ids = torch.tensor([previous], dtype=torch.long) if previous else torch.zeros((1, 0), dtype=torch.long)
    return processor(ids, torch.from_numpy(logits[None].copy()))[0].numpy()


def test_mtp_drafter_reads_the_committed_rows_and_rolls_back_its_drafts():
    """Greedy with a strong repetition penalty (transformers' processor as the reference), so each
    draft depends on the history and the drafts before it."""
    model = SymbolicModel()
    drafter = MTPDrafter(model)
    prompt, first = [3, 1, 4, 1, 5], 2
    hidden = symbols(*[("h", t) for t in range(len(prompt))])
    drafter.start(prompt, hidden, first)
    cache = [(x, ("h", t)) for t, x in enumerate(prompt[1:] + [first])]
    assert drafter.state.rows == cache

    params = SamplingParams(repetition_penalty=4.0)
    sampler = Sampler(params)

    def greedy(logits, previous, _):
        return int(np.argmax(penalised(logits, previous, 4.0)))

    history = prompt + [first]
    for k in (1, 4, 3):
        draft = drafter.propose(history, k, sampler)
        assert draft.tokens == mtp_reference(cache, k, history, greedy)
        assert draft.q == [None] * k  # greedy drafts are one-hot
        assert drafter.state.rows == cache  # the drafted rows are rolled back
    # Commit two tokens: their rows join the cache, the output of the last one predicts the next draft.
    drafter.commit([draft.tokens[0], 0], symbols(("h", 5), ("h", 6)))
    cache += [(draft.tokens[0], ("h", 5)), (0, ("h", 6))]
    assert drafter.state.rows == cache
    history += [draft.tokens[0], 0]
    assert drafter.propose(history, 4, sampler).tokens == mtp_reference(cache, 4, history, greedy)
    # Repeated tokens in the history really change the drafts here (the penalty is not idle).
    assert mtp_reference(cache, 4, [], lambda lg, prev, _: int(np.argmax(penalised(lg, prev, 4.0)))) != \
        mtp_reference(cache, 4, history, greedy)


def test_mtp_drafter_sampling_draws_each_draft_from_its_processed_distribution():
    """q is the softmax of the processed draft logits (transformers' repetition penalty and
    temperature, history and earlier drafts counted), and the draft is q's exact inverse CDF at the
    sampler's uniform."""
    model = SymbolicModel()
    drafter = MTPDrafter(model)
    prompt = [0, 5, 5, 2]
    drafter.start(prompt, symbols(*[("h", t) for t in range(4)]), 3)
    cache = list(drafter.state.rows)
    us = [0.91, 0.07, 0.55, 0.33]
    sampler = Sampler(SamplingParams(temperature=0.7, repetition_penalty=1.8, seed=0))
    sampler.rng = ScriptedRng(list(us))
    expected_q = []

    def draw(logits, previous, i):
        z = penalised(logits, previous, 1.8).astype(np.float64) / 0.7
        q = np.exp(z - z.max())
        q /= q.sum()
        expected_q.append(q)
        cdf, u = np.cumsum(q), us[i]
        return int(np.sum(cdf <= u))  # the first token whose cumulative mass passes u

    history = prompt + [3]
    draft = drafter.propose(history, 4, sampler)
    assert draft.tokens == mtp_reference(cache, 4, history, draw)
    for q, ref in zip(draft.q, expected_q):
        # float32 probabilities of a float64 softmax of float32 logits: 1e-6 covers both roundings.
        np.testing.assert_allclose(q, ref, rtol=0, atol=1e-6)
    assert drafter.state.rows == cache


def test_make_drafter_follows_the_draft_choices():
    with_head, without = SimpleNamespace(mtp="head", new_mtp_state=SymbolicState), SimpleNamespace(mtp=None)
    assert isinstance(make_drafter("auto", with_head), MTPDrafter)
    assert isinstance(make_drafter(DraftChoice.AUTO, without), NgramDrafter)
    assert isinstance(make_drafter("mtp", with_head), MTPDrafter)
    assert type(make_drafter("ngram", with_head)) is NgramDrafter
    assert type(make_drafter("none", with_head)) is NoDrafter
    with pytest.raises(DuetError, match=r"^this checkpoint has no MTP head \(no mtp\.\* tensors\); use --draft ngram or none$"):
        make_drafter("mtp", without)
    with pytest.raises(DuetError, match=r"unknown drafter 'medusa'; choose one of auto, mtp, ngram, none$"):
        make_drafter("medusa", with_head)


def test_each_drafter_states_its_word_cap_and_needs():
    """Names are the words of engine/choices.py; caps are `duet --help`'s ("a number up to 4 (MTP) /
    7 (n-gram)"); only the MTP head reads the hidden state of every prompt row (its cache holds one
    row per committed position)."""
    mtp = MTPDrafter(SimpleNamespace(new_mtp_state=SymbolicState))
    facts = [(d.name, d.depth_cap, d.reads_prompt_hidden) for d in (NoDrafter(), NgramDrafter(), mtp)]
    assert facts == [(DraftChoice.NONE, 0, False), (DraftChoice.NGRAM, 7, False), (DraftChoice.MTP, 4, True)]
    assert mtp.hidden is None


class DepthReference:
    """Depth restated: fixed, or adaptive in [1, cap]. Per draft position a rate, 0.8 at first, moved
    1/8 of the way to 1 (kept) or 0 (not) by each cycle that kept the drafts before it; the depth is
    the d whose expected tokens a cycle, 1 + the sum over i <= d of the rates' running products,
    divided by its cost in decode steps, 1 + per_cycle + d * per_draft, is largest (the first such d);
    cycles that drafted nothing change nothing."""

    def __init__(self, cap: int, fixed: int | None, per_draft: float = 0.0, per_cycle: float = 0.0):
        self.cap, self.fixed, self.per_draft, self.per_cycle = cap, fixed, per_draft, per_cycle
        self.rates = [0.8] * cap
        self.current = fixed if fixed is not None else self.best()

    def best(self) -> int:
        if not self.cap:
            return 0
        values = [(1 + sum(np.prod(self.rates[:i]) for i in range(1, d + 1))) / (1 + self.per_cycle + d * self.per_draft)
                  for d in range(1, self.cap + 1)]
        return 1 + int(np.argmax(values))

    def update(self, drafted: int, accepted: int) -> None:
        if self.fixed is None and drafted:
            for i in range(drafted):
                if i <= accepted:  # the drafts before it were kept: this cycle judged draft i
                    self.rates[i] = self.rates[i] + ((1.0 if i < accepted else 0.0) - self.rates[i]) / 8
            self.current = self.best()


@pytest.mark.parametrize("cap", [0, 1, 2, 4, 7])
@pytest.mark.parametrize("fixed", [None, -1, 0, 1, 2, 4, 7, 8])
def test_depth_matches_its_definition(cap, fixed):
    drafter = SimpleNamespace(depth_cap=cap, name=f"cap{cap}")
    if cap and fixed is not None and not 1 <= fixed <= cap:
        with pytest.raises(DuetError, match=rf"^--depth must be between 1 and {cap} for cap{cap} drafts \(got {fixed}\)$"):
            Depth(drafter, fixed)
        return
    rng = np.random.default_rng([cap, 1 + (fixed or 0) + 1])
    for per_draft, per_cycle in ((0.0, 0.0), (0.1, 0.0), (0.39, 0.29), (1.5, 0.5)):
        costs = DraftCosts(per_draft, per_cycle)
        depth, reference = Depth(drafter, fixed, costs), DepthReference(cap, fixed, per_draft, per_cycle)
        assert (depth.cap, depth.fixed, depth.current) == (cap, fixed, reference.current)
        keep = rng.uniform(0.3, 1.0)  # this run's chance that a draft is kept
        for _ in range(300):
            drafted = int(rng.integers(0, max(reference.current, 0) + 1))
            accepted = 0
            while accepted < drafted and rng.random() < keep:
                accepted += 1
            depth.update(drafted, accepted)
            reference.update(drafted, accepted)
            assert depth.current == reference.current


def test_the_adaptive_depth_follows_acceptance_and_cost():
    """Drafts kept every time and cheap: the cap. Drafts never kept: one (a cycle drafts at least one,
    to keep judging). A cost above what even kept drafts repay: one. The prior with the demo's MTP
    costs (an MTP draft reads 0.29 of a decode pass; a CPU verify row 0.1): three."""
    drafter = SimpleNamespace(depth_cap=4, name="mtp")
    assert Depth(drafter, None, DraftCosts(0.39, 0.29)).current == 3
    free = Depth(drafter, None, DraftCosts())
    free.rates[:] = [1.0, 0.5, 0.0, 0.0]  # drafts 3 and 4 would add nothing, even for free: not asked for
    free.update(1, 1)
    assert free.current == 2
    for costs, accepted, want in ((DraftCosts(0.1), 1.0, 4), (DraftCosts(0.1), 0.0, 1), (DraftCosts(1.2, 0.3), 1.0, 1)):
        depth = Depth(drafter, None, costs)
        for _ in range(60):
            depth.update(depth.current, round(accepted * depth.current))
        assert depth.current == want, (costs, accepted)


def test_draft_costs_weigh_an_mtp_draft_by_the_bytes_it_reads():
    """On the demo model: a verify row costs what the CPU op set states; an MTP draft and the commit
    pass what placement's bill says an MTP pass reads of a decode pass's bytes (its layer and the
    head's 1,088-row draft shortlist: about a sixth here); n-gram drafts only their row."""
    from duet.engine import load_model
    from duet.engine.checkpoint.headers import read_headers
    from duet.engine.placement import bill_of_bytes, weights_of

    lm = load_model(MODELS / "demo")
    weights = weights_of(read_headers(str(MODELS / "demo")), w4=False)
    share = bill_of_bytes(weights, lm.config, depth=1).drafting / bill_of_bytes(weights, lm.config).verify_pass
    assert lm.mtp_draft_share == share and 0.15 < share < 0.19
    row = lm.model.ops.VERIFY_ROW_COST
    assert draft_costs(MTPDrafter(lm.model), lm) == DraftCosts(per_draft=share + row, per_cycle=share)
    assert draft_costs(NgramDrafter(), lm) == DraftCosts(per_draft=row)


def test_check_rule_takes_the_two_rule_words():
    assert [check_rule("exact"), check_rule("lossy"), check_rule(Accept.LOSSY)] == ["exact", "lossy", "lossy"]
    with pytest.raises(DuetError, match=r"^unknown acceptance rule 'greedy'; choose exact or lossy$"):
        check_rule("greedy")


@pytest.mark.parametrize("rule,expected", [(LOSSY, (3, 2, 2)), (EXACT, (1, 1, 0))])
def test_the_cycle_goes_on_after_each_keep_and_counts_every_lossy_one(rule, expected):
    """A scripted cycle, worked out from the rules by hand. Every row has p = (0.4, 0.4, 0.2) and
    every draft is token 0 with q = (0.8, 0.1, 0.1): kept with probability p(0)/q(0) = 1/2, else r
    is drawn from norm(max(0, p - q)) = (0, 3/4, 1/4).
    Draft 0: u = 0.3 < 1/2, kept. Draft 1: u = 0.9, rejected; r at u = 0.1 is token 1, and
    p(0) >= p(1) (a tie) keeps it under the lossy rule (1 lossy keep), while the exact rule commits
    r = 1 there: (1, 1, 0). Draft 2: the same, 2 lossy keeps. The bonus from row 3 at u = 0.9 is
    token 2 (cumulative 0.4, 0.8, 1.0)."""
    with np.errstate(divide="ignore"):
        rows = np.log(np.tile(np.array([0.4, 0.4, 0.2], dtype=np.float32), (4, 1)))
    q = np.array([0.8, 0.1, 0.1])
    verdict = accept(rule, rows, Draft([0, 0, 0], [q, q, q]), scripted_sampler(0.3, 0.9, 0.1, 0.9, 0.1, 0.9))
    assert (verdict.accepted, verdict.next_token, verdict.lossy) == expected


def test_no_drafter_drafts_nothing():
    draft = NoDrafter().propose([1, 2, 1, 2], 4, Sampler(SamplingParams()))
    assert (draft.tokens, draft.q) == ([], [])
