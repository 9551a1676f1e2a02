"""Header-only reading of local checkpoints: safetensors (single and sharded) and GGUF, and how bad
files are refused (one line, exit 2 from the CLI)."""

from __future__ import annotations

import json
import struct

import gguf
import pytest

import headeronly as ho
from duet.app.cli import main
from duet.engine.checkpoint.headers import read_headers
from duet.engine.errors import CheckpointError


@pytest.fixture(scope="module")
def gguf_27b(tmp_path_factory):
    return ho.write_27b_gguf(tmp_path_factory.mktemp("gguf") / "model.gguf")


def test_sharded_and_single_safetensors_give_the_same_headers(tmp_path):
    one = read_headers(str(ho.write_27b_int4(tmp_path / "one", shards=1)))
    four = read_headers(str(ho.write_27b_int4(tmp_path / "four", shards=4)))
    assert len(one.files) == 1 and len(four.files) == 4
    assert {n: (t.dtype, t.shape, t.nbytes) for n, t in one.tensors.items()} == \
           {n: (t.dtype, t.shape, t.nbytes) for n, t in four.tensors.items()}
    assert one.config == four.config and one.config.num_hidden_layers == 64


def test_gguf_header_matches_the_gguf_package_reader(gguf_27b):
    ours = read_headers(str(gguf_27b))
    reference = gguf.GGUFReader(gguf_27b)
    assert len(ours.tensors) == len(reference.tensors)
    for t in reference.tensors:
        mine = ours.tensors[t.name]
        assert (mine.dtype, mine.shape, mine.begin, mine.nbytes) == \
               (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), t.data_offset, t.n_bytes)


def test_gguf_metadata_gives_the_same_geometry_as_config_json(gguf_27b, tmp_path):
    from_gguf = read_headers(str(gguf_27b)).config
    from_json = read_headers(str(ho.write_27b_int4(tmp_path, shards=1))).config
    fields = ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
              "num_key_value_heads", "head_dim", "partial_rotary_factor", "linear_num_key_heads",
              "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
              "intermediate_size", "mtp_num_hidden_layers", "max_position_embeddings", "tie_word_embeddings")
    assert {f: getattr(from_gguf, f) for f in fields} == {f: getattr(from_json, f) for f in fields}


def test_a_block_type_gguf_does_not_know_is_sized_by_the_next_offset(tmp_path):
    headers = read_headers(str(ho.write_flash_next_like_gguf(tmp_path / "flash.gguf")))
    experts = headers.tensors["blk.0.ffn_up_exps.weight"]
    exact = 512 * 640 * 2560 * 49 // 128
    assert experts.dtype == f"ggml type {ho.TRELLIS_TYPE}" and exact <= experts.nbytes < exact + 32


def _head(path, size: int = 2**20) -> bytes:
    """The header and a little data."""
    with open(path, "rb") as f:
        return f.read(size)


def _refused(path, capsys) -> str:
    with pytest.raises(CheckpointError):
        read_headers(str(path))
    assert main(["models", "info", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_malformed_safetensors_header_is_one_line_exit_2(tmp_path, capsys):
    folder = ho.write_27b_int4(tmp_path, shards=1)
    path = folder / "model.safetensors"
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"{not json")
    assert "not valid JSON" in _refused(folder, capsys)


def test_truncated_safetensors_is_refused(tmp_path, capsys):
    folder = ho.write_27b_int4(tmp_path, shards=1)
    with open(folder / "model.safetensors", "r+b") as f:
        f.truncate(10**9)
    assert "truncated" in _refused(folder, capsys)


def test_bad_gguf_files_are_refused(gguf_27b, tmp_path, capsys):
    data = _head(gguf_27b)
    bad_magic = tmp_path / "magic.gguf"
    bad_magic.write_bytes(b"GGUX" + data[4:])
    assert "magic" in _refused(bad_magic, capsys)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:5000])
    assert "truncated" in _refused(cut, capsys)
    short = tmp_path / "short.gguf"  # a whole header, then the file ends before the tensors do
    short.write_bytes(data)
    assert "truncated" in _refused(short, capsys)
    huge = tmp_path / "huge.gguf"
    huge.write_bytes(data[:8] + struct.pack("<Q", 2**40) + data[16:])
    assert "corrupt" in _refused(huge, capsys)


def test_unknown_gguf_architecture_is_refused(tmp_path, capsys):
    path = ho.write_gguf(tmp_path / "llama.gguf", "llama", {"block_count": 1}, {})
    assert "architecture 'llama'" in _refused(path, capsys)


def test_a_split_gguf_with_a_missing_part_is_refused(gguf_27b, tmp_path, capsys):
    first = tmp_path / "model-00001-of-00002.gguf"
    first.write_bytes(_head(gguf_27b))
    assert "00002-of-00002.gguf is missing" in _refused(first, capsys)


def test_models_info_json_has_every_figure(tmp_path, capsys):
    folder = ho.write_27b_int4(tmp_path, shards=2)
    assert main(["models", "info", str(folder), "--json", "--kv", "q4", "--host-tables", "--context", "262144"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["fits"] and report["settings"]["depth"] == 3
    assert abs(report["bill"]["decoder_weights"] / 1e9 - 12.596) < 0.02
    assert set(report["max_context"]) == {"bf16", "q8", "q4"} and report["max_context"]["q4"]["host_tables"] == 262_144
    assert report["ceiling"]["tok_s"] > 0 and report["alternatives"] == []


def test_models_info_table_says_what_would_fit(tmp_path, capsys):
    folder = ho.write_27b_int4(tmp_path, shards=1)
    assert main(["models", "info", str(folder), "--vram", "24", "--bandwidth", "936"]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "--kv q4" in out and "--context " in out
    assert "12.596" in out and "Ceiling: 0.84 x 936 GB/s" in out
