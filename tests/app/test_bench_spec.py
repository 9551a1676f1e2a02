"""`duet bench spec`: every drafter and rule in one run, with the speed-up measured against no drafts."""

from __future__ import annotations

import json

import pytest

from duet.app.cli import main


def test_spec_bench_reports_each_drafter_and_rule(capsys, tiny_model_dir):
    capsys.readouterr()
    assert main(["bench", "spec", "--model", str(tiny_model_dir), "--max-tokens", "12", "--repeats", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["repeats"] == 3
    runs = {(r["prompt"], r["drafter"], r["accept"]): r for r in result["runs"]}
    assert set(runs) == {(p, d, a) for p in ("prose", "copy") for d, a in
                         (("none", "exact"), ("ngram", "exact"), ("ngram", "lossy"))}
    for (prompt, _, _), run in runs.items():
        baseline = runs[(prompt, "none", "exact")]["decode_tok_s"]
        assert len(run["decode_tok_s_runs"]) == 3 and run["decode_tok_s"] == sorted(run["decode_tok_s_runs"])[1]  # the median
        assert run["decode_tok_s"] > 0
        assert abs(run["speedup"] - run["decode_tok_s"] / baseline) < 0.01
        baseline_runs = runs[(prompt, "none", "exact")]["decode_tok_s_runs"]  # each round against its own run without drafts
        assert run["speedup_runs"] == [pytest.approx(t / b, abs=2e-3) for t, b in zip(run["decode_tok_s_runs"], baseline_runs)]
        low, high = run["speedup_quartiles"]
        assert min(run["speedup_runs"]) <= low <= sorted(run["speedup_runs"])[1] <= high <= max(run["speedup_runs"])
        assert run["tokens_per_cycle"] >= 1.0


def test_spec_bench_refuses_no_repeats_in_one_line(capsys, tiny_model_dir):
    assert main(["bench", "spec", "--model", str(tiny_model_dir), "--repeats", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["duet: --repeats must be at least 1 (got 0)"]
