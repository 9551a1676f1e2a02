"""Trellis files: `duet convert --format trellis-K`, loading on the w4a8 route, KL, and bad files.

The numpy encoder codes ~15 tiles (128 weights) a second here, so the model is the tiny one with
intermediate_size 128: only down_proj (K = 128) is coded, 5 x 64 x 128 weights, 320 tiles. INT4
converts the same matrices (its rule is K % 128 == 0 too), so their KL figures compare like for like.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from duet.app.cli import main
from duet.app.convert import write_safetensors
from conftest import build_reference, moe_fields, randomize, save_reference, tiny_text_config
from duet.engine import load_model
from duet.engine.assemble import stacked_linear
from duet.engine.backend import MAX_ROWS
from duet.engine.backend import compiled
from duet.engine.backend.cpu import TrellisLinear
from duet.engine.checkpoint.safetensors import SafetensorsFile
from duet.engine.quant import trellis
from test_routes import decode, mean_kl

PROMPT = [int(t) for t in np.random.default_rng(2).integers(0, 300, 24)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("trellis")
    source = save_reference(build_reference("qwen3_5_text", seed=3, intermediate_size=128), root / "source")
    paths = {"source": source}
    for fmt in ("int4", "trellis-4"):
        paths[fmt] = root / fmt
        assert main(["convert", str(source), str(paths[fmt]), "--format", fmt]) == 0
    return paths


def test_file_metadata_and_tensors(converted):
    file = SafetensorsFile(converted["trellis-4"] / "model.safetensors")
    assert file.metadata["duet.format"] == "trellis" and file.metadata["duet.trellis.k"] == "4"
    assert json.loads(file.metadata["duet.trellis.multipliers"]) == {str(k): c for k, c in trellis.MULTIPLIERS.items()}
    codes = file.tensors["model.layers.0.mlp.down_proj.trellis_codes"]
    assert (codes.dtype, codes.shape) == ("U8", (64 // 16 * 128 // 8, 64))
    assert "model.layers.0.mlp.up_proj.weight" in file.tensors  # K = 64: kept 16-bit


def test_loads_on_w4a8_and_beats_int4_on_kl(converted):
    lm = load_model(converted["trellis-4"])
    assert lm.route == "w4a8" and lm.routes == ("w4a8", "bf16")
    expected = decode(load_model(converted["source"]), PROMPT)
    forced = [int(t) for t in expected.argmax(axis=-1)]
    kl_trellis = mean_kl(expected, decode(lm, PROMPT, forced))
    kl_int4 = mean_kl(expected, decode(load_model(converted["int4"], route="w4a8"), PROMPT, forced))
    print(f"mean KL(bf16 || route) on w4a8: trellis-4 {kl_trellis:.6f}, int4 g128 {kl_int4:.6f}")
    assert kl_trellis < kl_int4


def test_trellis_linear_matches_the_dequantized_weight_and_is_row_independent():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((32, 256)).astype(np.float32)
    x = rng.standard_normal((MAX_ROWS + 3, 256)).astype(np.float32)
    coded = trellis.quantize_matrix(w, 3, seed=9, step=trellis.STEPS[3])
    linear = TrellisLinear(coded)
    y = linear(x)
    reference = x @ coded.dequantize().T
    assert np.abs(y - reference).max() < 0.02 * np.abs(reference).max()  # int8 activation rounding only
    assert np.array_equal(linear(x[:MAX_ROWS])[3], linear(x[3:4])[0])


def rewrite(src, dst, metadata=None, drop_tile=False, coded_as=None, row_scale=None):
    """A copy of the trellis folder with its metadata changed (None: a key left out), one tile cut off
    a matrix, (coded_as) layer 0's down_proj codes standing in for another module's 16-bit weight, or
    (row_scale) layer 1's down_proj row scale made another array by the given function."""
    shutil.copytree(src, dst)
    file = SafetensorsFile(src / "model.safetensors")
    tensors = {}
    for name, info in file.tensors.items():
        data, dtype = np.array(file.raw(name)), info.dtype
        if drop_tile and name == "model.layers.1.mlp.down_proj.trellis_codes":
            data = data[:-1]
        if row_scale and name == "model.layers.1.mlp.down_proj.trellis_row_scale":
            data = row_scale(data.view(np.float32))
            dtype = {np.float16: "F16", np.float32: "F32"}[data.dtype.type]
        if coded_as and name.startswith("model.layers.0.mlp.down_proj.trellis_"):
            tensors[name.replace("down_proj", coded_as)] = (dtype, data.shape, data.tobytes())
        if coded_as and name == f"model.layers.0.mlp.{coded_as}.weight":
            continue
        tensors[name] = (dtype, data.shape, data.tobytes())
    changed = {**file.metadata, **(metadata or {})}
    write_safetensors(dst / "model.safetensors", tensors, {key: value for key, value in changed.items() if value is not None})
    file.close()
    return dst


@pytest.mark.parametrize("change, message", [
    ({"duet.version": "7"}, "trellis metadata version '7' is not '1'"),
    ({"duet.trellis.k": "5"}, "duet.trellis.k '5' is not one of 2, 3, 4"),
    ({"duet.trellis.k": None}, "duet.trellis.k '' is not one of 2, 3, 4"),  # None: the key is left out
    ({"duet.trellis.seed": "x"}, "duet.trellis.seed 'x' is not a non-negative integer"),
    ({"duet.trellis.seed": None}, "duet.trellis.seed '' is not a non-negative integer"),
    ({"duet.trellis.multipliers": "{"}, "duet.trellis.multipliers has no multiplier for k=4"),
    ({"duet.trellis.multipliers": json.dumps({"4": 12345})}, "multiplier 12345 for k=4 is not this duet's"),
])
def test_corrupt_metadata_is_one_line_exit_2(converted, tmp_path, capsys, change, message):
    bad = rewrite(converted["trellis-4"], tmp_path / "bad", metadata=change)
    assert main(["--headless", "the", "--raw", "--model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "model.safetensors" in err


def test_a_route_that_cannot_run_trellis_weights_is_one_line_exit_2(converted, capsys):
    """w4a16 multiplies bf16 activations by 4-bit levels; trellis levels need the w4a8 route."""
    assert main(["--headless", "the", "--raw", "--route", "w4a16", "--model", str(converted["trellis-4"])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "route w4a16 cannot run trellis-4 weights; use --route w4a8 or bf16" in err


def test_wrong_tile_count_is_one_line_exit_2(converted, tmp_path, capsys):
    bad = rewrite(converted["trellis-4"], tmp_path / "bad", drop_tile=True)
    assert main(["--headless", "the", "--raw", "--model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "model.layers.1.mlp.down_proj.trellis_codes is U8 [63, 64]; a [64, 128] weight at 4 bits takes U8 [64, 64] (64 tiles)" in err


def shard(src, dst, second_metadata: dict) -> None:
    """The trellis folder as two shards (layer 1's tensors in the second) with an index; the second
    shard's metadata updated by second_metadata."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    file = SafetensorsFile(src / "model.safetensors")
    names = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for name, info in file.tensors.items():
        data = np.array(file.raw(name))
        names[sorted(names)[".layers.1." in name]][name] = (info.dtype, data.shape, data.tobytes())
    for i, (shard_name, tensors) in enumerate(sorted(names.items())):
        write_safetensors(dst / shard_name, tensors, {**file.metadata, **(second_metadata if i else {})})
    index = {"metadata": {}, "weight_map": {name: shard_name for shard_name, tensors in names.items() for name in tensors}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    file.close()


def test_sharded_trellis_files_load_and_must_agree_on_k_and_seed(converted, tmp_path, capsys):
    shard(converted["trellis-4"], tmp_path / "agree", {})
    one_file = decode(load_model(converted["trellis-4"]), PROMPT[:4])
    assert np.array_equal(decode(load_model(tmp_path / "agree"), PROMPT[:4]), one_file)
    shard(converted["trellis-4"], tmp_path / "differ", {"duet.trellis.seed": "99"})
    assert main(["--headless", "the", "--raw", "--model", str(tmp_path / "differ")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model-00002-of-00002.safetensors" in err
    assert err.endswith(": trellis metadata (k, seed) differs from the checkpoint's other files\n")


@pytest.mark.parametrize("row_scale, found", [
    (lambda scale: scale.astype(np.float16), "F16 [64]"),  # the right length, the wrong type
    (lambda scale: scale[:-1], "F32 [63]"),  # the right type, one row short
])
def test_a_wrong_row_scale_is_one_line_exit_2(converted, tmp_path, capsys, row_scale, found):
    bad = rewrite(converted["trellis-4"], tmp_path / "bad", row_scale=row_scale)
    assert main(["--headless", "the", "--raw", "--model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"model.layers.1.mlp.down_proj.trellis_row_scale is {found}; expected F32 [64]" in err


def test_codes_for_a_weight_trellis_cannot_code_are_one_line_exit_2(converted, tmp_path, capsys):
    """up_proj is [128, 64]: K = 64 is no whole Hadamard block, so no trellis file may code it."""
    bad = rewrite(converted["trellis-4"], tmp_path / "bad", coded_as="up_proj")
    assert main(["--headless", "the", "--raw", "--model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors" in err
    assert "model.layers.0.mlp.up_proj.trellis_codes codes a [128, 64] weight; trellis needs N % 16 == 0 and K % 128 == 0" in err


def test_stacked_trellis_weights_run_as_one_linear():
    rng = np.random.default_rng(8)
    gate, up = (trellis.quantize_matrix(rng.standard_normal((n, 128)).astype(np.float32), 2, seed=3, step=trellis.STEPS[2])
                for n in (32, 16))
    linear = stacked_linear([gate, up], "w4a8")
    assert type(linear).__name__ == "TrellisLinear" and linear.shape == (48, 128)  # numpy's or the compiled twin
    np.testing.assert_array_equal(linear.weight.dequantize(), np.concatenate([gate.dequantize(), up.dequantize()]))


def qwen3_next_with_coded_projections(seed: int):
    """One DeltaNet layer and a MoE whose K = 128 matrices the converter codes: in_proj_qkvz [192, 128]
    (two key heads, so its split takes bands from both halves), experts' and shared gate/up."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    text = tiny_text_config(hidden_size=128, num_hidden_layers=1)
    config = tf.Qwen3NextConfig(**text, **moe_fields(num_experts=2, moe_intermediate_size=16,
                                                     shared_expert_intermediate_size=16),
                                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    model = tf.Qwen3NextForCausalLM(config)
    randomize(model, seed)
    return model.eval()


@pytest.fixture(scope="module")
def next_trellis(tmp_path_factory):
    root = tmp_path_factory.mktemp("next")
    source = save_reference(qwen3_next_with_coded_projections(5), root / "source")
    assert main(["convert", str(source), str(root / "trellis-2"), "--format", "trellis-2"]) == 0
    return source, root / "trellis-2"


def test_qwen3_next_fused_projections_convert_and_run(next_trellis):
    source, coded = next_trellis
    file = SafetensorsFile(coded / "model.safetensors")
    assert "model.layers.0.linear_attn.in_proj_qkvz.trellis_codes" in file.tensors
    assert "model.layers.0.linear_attn.in_proj_ba.weight" in file.tensors  # kept 16-bit
    lm, reference = load_model(coded), load_model(source)
    assert lm.route == "w4a8"
    # The split regroups qkvz's rows per key head into q | k | v | z, which must hold the source's
    # rows; the 16-bit b | a rows run beside them.
    coded_rows, float_rows = lm.model.layers[0].mixer.in_proj.parts
    assert [type(coded_rows).__name__, type(float_rows).__name__] == ["TrellisLinear", "DenseLinear"]
    w = coded_rows.weight.dequantize()
    expected = reference.model.layers[0].mixer.in_proj.weight[: w.shape[0]]
    assert np.mean((w - expected) ** 2) < 0.15 * np.mean(expected ** 2)  # 2-bit coding error, ~7%
    expected = decode(reference, PROMPT)
    forced = [int(t) for t in expected.argmax(axis=-1)]
    on_w4a8 = decode(lm, PROMPT, forced)
    dequantized = decode(load_model(coded, route="bf16"), PROMPT, forced)
    print(f"qwen3_next trellis-2: mean KL(bf16 || w4a8) {mean_kl(expected, on_w4a8):.5f}, "
          f"KL(dequantized || w4a8) {mean_kl(dequantized, on_w4a8):.5f}")
    assert mean_kl(dequantized, on_w4a8) < 0.01  # the route adds int8 activation rounding only


def test_routes_bench_runs_a_trellis_model(next_trellis, capsys):
    _, coded = next_trellis
    assert main(["bench", "routes", "--model", str(coded), "--new-tokens", "2", "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result["routes"]) == ["w4a8", "bf16"]
    coded_gemv, dense = result["routes"]["w4a8"], result["routes"]["bf16"]
    assert coded_gemv["gemv_shape"] == dense["gemv_shape"] == [32, 128]  # the shared expert's gate and up
    if compiled.unavailable():  # numpy decodes the 2-bit codes at every product: codes + one fp32 row scale per row
        assert coded_gemv["gemv_weight_bytes"] == 32 * 128 * 2 // 8 + 32 * 4
    else:  # the compiled kernels hold the levels decoded to int8, one fp32 scale per 128 (engine/backend/compiled.py)
        assert coded_gemv["gemv_weight_bytes"] == 32 * 128 + 32 * 4
    assert dense["gemv_weight_bytes"] == 32 * 128 * 4
    assert all(r["gemv_gb_s"] > 0 and r["decode_tok_s"] > 0 for r in result["routes"].values())
