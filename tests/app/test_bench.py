"""`duet bench`: the decode benchmark run in-process on a tiny checkpoint, and its user errors."""

from __future__ import annotations

import json
import os
import sys

import pytest

from duet.app.bench.common import GEOMETRIES, random_prompt
from duet.app.bench.decode import TransformersProcess, load_transformers, transformers_engine
from duet.app.bench.make_random import random_model_config
from duet.app.cli import main
from conftest import build_reference, save_reference
from duet.engine.config import FULL_ATTENTION, ModelConfig


@pytest.fixture(scope="module")
def tiny_weights_dir(tmp_path_factory):
    """Weights and config.json only: bench decode must not need a tokenizer."""
    folder = tmp_path_factory.mktemp("bench") / "tiny"
    return save_reference(build_reference("qwen3_5_text", seed=1), folder, with_tokenizer=False)


def test_decode_bench_json_reports_both_engines(tiny_weights_dir, capsys):
    code = main(["bench", "decode", "--model", str(tiny_weights_dir), "--json",
                 "--prompt-tokens", "70", "--new-tokens", "4", "--repeats", "1"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompt_tokens"] == 70 and result["new_tokens"] == 4
    assert result["geometry"]["layers"] == 5 and result["geometry"]["hidden"] == 64
    assert result["threads"]["numpy_blas"] >= 1
    assert result["threads"]["torch"] == result["threads"]["numpy_blas"]
    for phase in ("prefill", "decode"):
        ours, theirs = result["duet"][f"{phase}_tok_s"], result["transformers"][f"{phase}_tok_s"]
        assert ours > 0 and theirs > 0
        assert result["ratio"][phase] == pytest.approx(ours / theirs)
    assert result["tokens_agree"] is True and result["first_mismatch"] is None


def test_transformers_reference_runs_in_its_own_process(tiny_weights_dir):
    """Our engine's process-wide settings (allocator, BLAS pool) must not reach the reference; its
    greedy tokens are the ones transformers gives in this process."""
    prompt = random_prompt(ModelConfig.from_file(tiny_weights_dir / "config.json").vocab_size, 20)
    with TransformersProcess(tiny_weights_dir, threads=1) as reference:
        assert reference.pid != os.getpid() and reference.torch_threads == 1
        run = reference(prompt, 5)
    assert run.prefill_s > 0 and run.decode_s > 0
    assert run.tokens == transformers_engine(load_transformers(tiny_weights_dir))(prompt, 5).tokens


def test_decode_bench_prints_a_table(tiny_weights_dir, capsys):
    assert main(["bench", "decode", "--model", str(tiny_weights_dir),
                 "--prompt-tokens", "3", "--new-tokens", "2", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "duet (numpy)" in out and "transformers eager" in out and "greedy tokens: agree" in out


def test_missing_model_folder_is_one_line_exit_2(tmp_path, capsys):
    assert main(["bench", "decode", "--model", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nowhere" in err and "--model" in err


def test_reference_that_cannot_load_is_one_line_exit_2(tmp_path, tiny_weights_dir, capsys):
    (tmp_path / "config.json").write_bytes((tiny_weights_dir / "config.json").read_bytes())  # no weights
    assert main(["bench", "decode", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "transformers could not run" in err and "Traceback" not in err


def test_missing_reference_names_the_extra(tiny_weights_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    assert main(["bench", "decode", "--model", str(tiny_weights_dir)]) == 2
    assert "pip install 'duet[test]'" in capsys.readouterr().err


def test_make_random_geometry_reads_back_as_qwen35_08b():
    config = ModelConfig.from_dict(random_model_config("qwen3.5-0.8b", layers=8).to_dict())
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (248320, 1024, 3584)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 2, 256)
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (16, 16)
    assert (config.rope_theta, config.rotary_dim, config.tie_word_embeddings) == (1e7, 64, True)
    assert [i for i, kind in enumerate(config.layer_types) if kind == FULL_ATTENTION] == [3, 7]


def test_heads_bench_times_each_head_against_the_full_one(monkeypatch, capsys):
    """On a smaller vocabulary than the real geometry's (the command, not its figures, is under test)."""
    monkeypatch.setitem(GEOMETRIES, "qwen3.5-0.8b", dict(GEOMETRIES["qwen3.5-0.8b"], vocab_size=70_000, hidden_size=128))
    assert main(["bench", "heads", "--repeats", "1", "--rows", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # the seed's share of 70,000 ids (65,536 of 248,320: 18,475), in whole blocks of 64
    assert (result["vocab"], result["hidden"], result["shortlist_rows"]) == (70_000, 128, 18_496)
    names = ["full head", "draft shortlist", "host tables (int4 + rescoring)"]
    assert list(result["ms_per_row"]) == names and all(result["ms_per_row"][n] > 0 for n in names)
    assert result["vs_full_head"]["full head"] == 1.0
    assert main(["bench", "heads", "--repeats", "1", "--rows", "1"]) == 0
    assert "draft shortlist" in capsys.readouterr().out
