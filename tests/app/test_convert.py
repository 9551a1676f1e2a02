"""`duet convert` to INT4 safetensors and GGUF: our files load back; bad files get one line and exit 2."""

from __future__ import annotations

import errno
import json
import os
import shutil

import gguf
import numpy as np
import pytest

from duet.app.cli import main
from conftest import build_reference, save_reference
from duet.engine import load_model
from duet.engine.checkpoint.safetensors import SafetensorsFile

DIMS = dict(hidden_size=128, intermediate_size=256, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_reference(build_reference("qwen3_5_text", seed=4, **DIMS), tmp_path_factory.mktemp("convert") / "src")


def one_line_exit_2(argv, capsys, *needles):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def test_int4_file_names_its_format_and_loads_back(source, tmp_path, capsys):
    assert main(["convert", str(source), str(tmp_path / "int4"), "--format", "int4"]) == 0
    metadata = SafetensorsFile(tmp_path / "int4" / "model.safetensors").metadata
    assert metadata["duet.format"] == "int4-pack-quantized" and metadata["duet.version"] == "1"
    config = json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and "model.layers.0.linear_attn.in_proj_a" in config["ignore"]
    lm = load_model(tmp_path / "int4")
    assert lm.route == "w4a16" and lm.routes == ("w4a16", "w4a8", "bf16")
    assert lm.tokenizer.render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("fmt,types", [("gguf-f16", {"F16", "F32"}), ("gguf-q8_0", {"Q8_0", "F32"}),
                                       ("gguf-q4_0", {"Q4_0", "Q8_0", "F32"}), ("gguf-bf16", {"BF16", "F32"})])
def test_gguf_file_is_what_llamacpp_reads_and_loads_back(source, tmp_path, fmt, types):
    path = tmp_path / "model.gguf"
    assert main(["convert", str(source), str(path), "--format", fmt]) == 0
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "qwen35"
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert "tokenizer.chat_template" in reader.fields
    assert {t.tensor_type.name for t in reader.tensors} == types
    lm = load_model(path)
    ids = lm.tokenizer.encode("the quick brown fox")
    assert ids == load_model(source).tokenizer.encode("the quick brown fox")
    assert np.isfinite(lm.model.logits(lm.model.forward(lm.model.new_state(), ids))).all()


def test_convert_refuses_an_existing_destination(source, tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    one_line_exit_2(["convert", str(source), str(tmp_path / "taken"), "--format", "int4"], capsys, "already exists")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["notes.txt"]


def test_gguf_from_a_folder_without_tokenizer_json_is_one_line_exit_2(source, tmp_path, capsys):
    """A GGUF file carries its tokenizer: say which folder lacks it and what to do, and write nothing."""
    bare = tmp_path / "bare"
    shutil.copytree(source, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    out = tmp_path / "out"
    out.mkdir()
    one_line_exit_2(["convert", str(bare), str(out / "model.gguf"), "--format", "gguf-q8_0"], capsys,
                    str(bare), "tokenizer.json", "--format int4")
    assert list(out.iterdir()) == []


def test_a_failed_write_leaves_nothing_at_dst(source, tmp_path, capsys, monkeypatch):
    """The disk fills up halfway through: one line, and neither DST nor a partial file is left."""
    from duet.app import convert

    def disk_full(path, tensors, metadata):
        path.write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(convert, "write_safetensors", disk_full)
    one_line_exit_2(["convert", str(source), str(tmp_path / "int4"), "--format", "int4"], capsys,
                    str(tmp_path / "int4"), os.strerror(errno.ENOSPC), "nothing was written")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    """Every matrix takes 64 or 96 inputs: none is a whole number of INT4's 128-groups."""
    return save_reference(build_reference("qwen3_5_text", seed=4, head_dim=16), tmp_path_factory.mktemp("narrow") / "src")


@pytest.mark.parametrize("fmt", ["int4", "trellis-4"])
def test_a_model_no_matrix_of_which_fits_is_refused_with_what_to_use(narrow, tmp_path, capsys, fmt):
    one_line_exit_2(["convert", str(narrow), str(tmp_path / "out"), "--format", fmt], capsys,
                    str(narrow), f"{fmt} would code none", "64 inputs, not a multiple of 128", "gguf-q8_0")
    assert list(tmp_path.iterdir()) == []


def test_int4_names_the_matrices_it_leaves_16_bit_and_why(tmp_path, capsys):
    """The tiny model's o_proj takes 128 inputs; the other matrices take 64 or 96."""
    source = save_reference(build_reference("qwen3_5_text", seed=4), tmp_path / "src")
    capsys.readouterr()
    assert main(["convert", str(source), str(tmp_path / "int4"), "--format", "int4"]) == 0
    wrote, kept = capsys.readouterr().out.splitlines()
    assert wrote.startswith(f"wrote {tmp_path / 'int4'}: 1 matrices INT4")
    assert kept.startswith("not quantized, their sizes do not fit int4: ")
    for module in ("model.layers.*.mlp.down_proj (96 inputs, not a multiple of 128)",
                   "model.layers.*.linear_attn.out_proj (64 inputs, not a multiple of 128)",
                   "model.layers.*.self_attn.q_proj (64 inputs, not a multiple of 128)"):
        assert module in kept
    assert "o_proj" not in kept and "embed_tokens" not in kept
    ignore = json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.0.mlp.down_proj" in ignore and "model.layers.3.self_attn.o_proj" not in ignore


def test_truncated_gguf_is_one_line_exit_2(source, tmp_path, capsys):
    path = tmp_path / "model.gguf"
    assert main(["convert", str(source), str(path), "--format", "gguf-q8_0"]) == 0
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    capsys.readouterr()
    one_line_exit_2(["--headless", "hi", "--raw", "--model", str(path)], capsys, "truncated", str(path))


def test_unsupported_block_type_names_it_and_lists_the_supported(tmp_path, capsys):
    path = tmp_path / "q3k.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35")
    q3k_row = np.zeros(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q3_K][1], np.uint8)
    writer.add_tensor("token_embd.weight", np.tile(q3k_row, (4, 1)), raw_dtype=gguf.GGMLQuantizationType.Q3_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    one_line_exit_2(["--headless", "hi", "--model", str(path)], capsys, "Q3_K", "Q4_K", "IQ4_XS", "token_embd.weight")


def test_int4_scales_that_do_not_match_the_weights_are_one_line_exit_2(source, tmp_path, capsys):
    """Rewrite one module's weight_scale with a group count that does not divide its inputs."""
    from duet.app.convert import write_safetensors

    folder = tmp_path / "int4"
    assert main(["convert", str(source), str(folder), "--format", "int4"]) == 0
    file = SafetensorsFile(folder / "model.safetensors")
    tensors = {name: (info.dtype, info.shape, file.raw(name).tobytes()) for name, info in file.tensors.items()}
    file.close()
    rows = tensors["model.layers.0.mlp.up_proj.weight_scale"][1][0]
    tensors["model.layers.0.mlp.up_proj.weight_scale"] = ("BF16", (rows, 3), np.zeros((rows, 3), np.uint16).tobytes())
    write_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})
    capsys.readouterr()
    one_line_exit_2(["--headless", "hi", "--raw", "--model", str(folder)], capsys,
                    "model.layers.0.mlp.up_proj.weight_scale", "scales do not match the weights")


def test_a_qwen3_next_with_dense_layers_is_refused_for_gguf(tmp_path, capsys):
    """llama.cpp's qwen3next has experts in every layer; a model with mlp_only_layers cannot be one."""
    source = save_reference(build_reference("qwen3_next", **DIMS), tmp_path / "src")
    capsys.readouterr()
    one_line_exit_2(["convert", str(source), str(tmp_path / "model.gguf"), "--format", "gguf-q8_0"], capsys,
                    "mlp_only_layers", "--format int4")
    assert not (tmp_path / "model.gguf").exists()
