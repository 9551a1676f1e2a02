"""`duet bench spec`: every drafter and rule in one run, with the speed-up measured against no drafts."""

from __future__ import annotations

import json

from duet.app.cli import main


def test_spec_bench_reports_each_drafter_and_rule(capsys, tiny_model_dir):
    capsys.readouterr()
    assert main(["bench", "spec", "--model", str(tiny_model_dir), "--max-tokens", "12", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    runs = {(r["prompt"], r["drafter"], r["accept"]): r for r in result["runs"]}
    assert set(runs) == {(p, d, a) for p in ("prose", "copy") for d, a in
                         (("none", "exact"), ("ngram", "exact"), ("ngram", "lossy"))}
    for (prompt, _, _), run in runs.items():
        baseline = runs[(prompt, "none", "exact")]["decode_tok_s"]
        assert run["decode_tok_s"] > 0
        assert abs(run["speedup"] - run["decode_tok_s"] / baseline) < 0.01
        assert run["tokens_per_cycle"] >= 1.0
