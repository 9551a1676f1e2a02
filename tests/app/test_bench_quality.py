"""`duet bench quality` and `duet bench routes` on a tiny checkpoint and its INT4 and GGUF conversions."""

from __future__ import annotations

import json

import pytest

from duet.app.cli import main
from duet.engine.backend import compiled
from conftest import build_reference, save_reference

DIMS = dict(hidden_size=128, intermediate_size=256, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    source = save_reference(build_reference("qwen3_5_text", seed=3, **DIMS), root / "source")
    assert main(["convert", str(source), str(root / "int4"), "--format", "int4"]) == 0
    assert main(["convert", str(source), str(root / "f32.gguf"), "--format", "gguf-f32"]) == 0
    return source, root / "int4", root / "f32.gguf"


def test_quality_reports_every_route_of_an_int4_checkpoint(models, capsys):
    source, int4, _ = models
    assert main(["bench", "quality", "--model", str(source), "--vs", str(int4), "--tokens", "48", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 48 and result["reference_route"] == "bf16"
    assert list(result["routes"]) == ["w4a16", "w4a8", "bf16"]
    for figures in result["routes"].values():
        assert 0 < figures["mean_kl"] < 5 and 0 <= figures["top1_agreement"] <= 1


def test_quality_of_an_exact_conversion_is_zero_kl(models, capsys):
    source, _, f32 = models
    assert main(["bench", "quality", "--model", str(source), "--vs", str(f32), "--tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "bf16" in out and "100.0%" in out and "mean KL" in out


def test_routes_bench_times_each_route(models, capsys):
    _, int4, _ = models
    assert main(["bench", "routes", "--model", str(int4), "--new-tokens", "2", "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result["routes"]) == ["w4a16", "w4a8", "bf16"]
    w4, dense = result["routes"]["w4a16"], result["routes"]["bf16"]
    assert w4["gemv_shape"] == dense["gemv_shape"] == [512, 128]
    # The bytes the GEMV streams: nibbles + one scale per 128, bf16 as stored (numpy Linears) or fp32 in
    # the compiled kernels' planes (engine/backend/compiled.py).
    scale_bytes = 2 if compiled.unavailable() else 4
    assert w4["gemv_weight_bytes"] == 512 * 128 // 2 + 512 * scale_bytes
    assert dense["gemv_weight_bytes"] == 512 * 128 * 4
    assert all(r["gemv_gb_s"] > 0 and r["decode_tok_s"] > 0 for r in result["routes"].values())
