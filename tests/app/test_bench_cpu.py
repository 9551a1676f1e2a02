"""`duet bench cpu`: load, memory, prefill and decode on the CPU and what drafts buy, in one run; llama.cpp
only where a built llama-bench is given (it is a peer we measure against, never installed here)."""

from __future__ import annotations

import json
from pathlib import Path

from duet.app.cli import main

DEMO = Path(__file__).parents[2] / "models" / "demo"


def test_cpu_bench_reports_load_speed_and_draft_speedups(capsys):
    capsys.readouterr()
    assert main(["bench", "cpu", "--model", str(DEMO), "--prompt-tokens", "16", "--tokens", "6", "--repeats", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    ours = result["duet"]
    assert result["repeats"] == 2
    assert result["kernels"] == "compiled (numba)" and "llama_cpp" not in result
    assert ours["route"] == "bf16" and ours["prompt_tokens"] == 16 and 1 <= ours["generated_tokens"] <= 6
    assert ours["load_s"] > 0 and ours["prefill_tok_s"] > 0 and ours["decode_tok_s"] > 0
    assert ours["file_bytes"] == (DEMO / "model.safetensors").stat().st_size and ours["resident_bytes"] > ours["file_bytes"]
    assert set(ours["drafts"]) == {"ngram", "mtp"}  # the demo has an MTP head
    for draft in ours["drafts"].values():
        assert draft["tokens_per_cycle"] >= 1.0
        assert abs(draft["speedup"] - draft["decode_tok_s"] / ours["decode_tok_s"]) < 0.01


def test_a_missing_llama_bench_is_one_line(capsys, tmp_path):
    code = main(["bench", "cpu", "--model", str(DEMO), "--llama-bench", str(tmp_path / "llama-bench")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "no such file" in err and "Traceback" not in err
