"""`duet bench trellis`: the figures' shape and the reference quantizers (the real run is 4 x 1,024
samples; here 1 x 128 with one step per rate, to stay fast)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from duet.app.bench import trellis as bench_trellis
from duet.app.cli import main
from duet.engine.quant import trellis


def test_lloyd_max_matches_the_published_gaussian_values():
    # Max (1960): 4, 8, 16 levels for N(0, 1).
    assert bench_trellis.lloyd_max_gaussian_mse(4) == pytest.approx(0.1175, abs=2e-4)
    assert bench_trellis.lloyd_max_gaussian_mse(8) == pytest.approx(0.03454, abs=1e-4)
    assert bench_trellis.lloyd_max_gaussian_mse(16) == pytest.approx(0.009497, abs=5e-5)


def test_best_grid_on_many_samples_is_near_the_optimal_uniform_quantizer():
    x = np.random.default_rng(0).standard_normal(20000)
    assert bench_trellis.best_grid_mse(x, 2) == pytest.approx(0.1188, rel=0.03)  # optimal 4-level uniform


def test_json_figures(monkeypatch, capsys):
    monkeypatch.setattr(bench_trellis, "SEQUENCES", 1)
    monkeypatch.setattr(bench_trellis, "SEQUENCE_LENGTH", trellis.TILE)
    monkeypatch.setattr(trellis, "SCALES", {k: (np.float32(trellis.STEPS[k]),) for k in trellis.RATES})
    assert main(["bench", "trellis", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["rates"]) == {"2", "3", "4"}
    for k, rate in result["rates"].items():
        assert rate["shannon_mse"] == 2.0 ** (-2 * int(k))
        assert rate["shannon_mse"] < rate["trellis_mse"] < rate["lloyd_max_mse"]
        assert rate["stream_mse"] <= rate["trellis_mse"]  # one 128-sample stream: a tile's circle is one of its paths
        assert rate["encoder_tiles_per_s"] > 0


def test_table(monkeypatch, capsys):
    monkeypatch.setattr(bench_trellis, "SEQUENCES", 1)
    monkeypatch.setattr(bench_trellis, "SEQUENCE_LENGTH", trellis.TILE)
    monkeypatch.setattr(trellis, "SCALES", {k: (np.float32(trellis.STEPS[k]),) for k in trellis.RATES})
    assert main(["bench", "trellis"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "Lloyd-Max" in lines[1] and "stream" in lines[1] and [line.split()[0] for line in lines[2:]] == ["2", "3", "4"]
