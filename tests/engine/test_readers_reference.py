"""The checkpoint readers against independent references, case by case (issue 16, item 7: mutation testing).

Every expected value here comes from outside the code under test: what a safetensors file holds from the
`safetensors` library (safe_open, its numpy and torch loaders) and from the header bytes as the format
defines them; what a GGUF file holds from the `gguf` package (GGUFReader, gguf.quants.dequantize) and from
llama.cpp's converter output in tests/engine/data; files are written by the safetensors library,
huggingface_hub's save_torch_state_dict (the sharding transformers' save_pretrained uses) and the gguf
package's GGUFWriter. Where a file is malformed, the library refusing it too is the reference.

Fast on purpose (a few seconds): mutmut re-runs these tests for every mutant of
engine/checkpoint/safetensors.py, gguf.py and headers.py (scripts/mutation.sh).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch
from gguf import GGMLQuantizationType as Q
from huggingface_hub import save_torch_state_dict

from duet.engine.checkpoint import safetensors as st
from duet.engine.checkpoint.safetensors import (
    MAX_HEADER_BYTES,
    SafetensorsCheckpoint,
    SafetensorsFile,
    TensorInfo,
    bf16_to_f32,
    header_length,
    parse_header_bytes,
    shard_names,
)
from duet.engine.errors import CheckpointError

DATA = Path(__file__).parent / "data"


# --- safetensors ---------------------------------------------------------------------------------------

def numpy_tensors() -> dict[str, np.ndarray]:
    """One tensor of every numpy-representable dtype the format has, scalars and empty ones included."""
    rng = np.random.default_rng(7)
    return {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16": rng.standard_normal((4, 2)).astype(np.float16),
        "f64": rng.standard_normal((2, 3, 2)),
        "i64": rng.integers(-2**40, 2**40, (5,)),
        "i32": rng.integers(-2**20, 2**20, (2, 2)).astype(np.int32),
        "i16": rng.integers(-300, 300, (3,)).astype(np.int16),
        "i8": rng.integers(-100, 100, (7,)).astype(np.int8),
        "u8": rng.integers(0, 255, (6,)).astype(np.uint8),
        "u16": rng.integers(0, 60000, (3, 1)).astype(np.uint16),
        "u32": rng.integers(0, 2**31, (2,)).astype(np.uint32),
        "bool": rng.integers(0, 2, (4,)).astype(bool),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }


@pytest.fixture(scope="module")
def library_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    safetensors.numpy.save_file(numpy_tensors(), path, metadata={"format": "np", "note": "written by the library"})
    return path


def library_header(path: Path) -> tuple[int, dict]:
    """The header as the format defines it: u64 length, then that much JSON."""
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    return n, json.loads(blob[8:8 + n])


def test_every_dtype_reads_as_the_library_reads_it(library_file):
    ours = SafetensorsFile(library_file)
    n, header = library_header(library_file)
    with safetensors.safe_open(library_file, framework="numpy") as theirs:
        assert sorted(ours.tensors) == sorted(theirs.keys())
        assert ours.metadata == theirs.metadata() == {"format": "np", "note": "written by the library"}
        for name in theirs.keys():
            expected, info = theirs.get_tensor(name), ours.tensors[name]
            raw = ours.raw(name)
            assert raw.dtype == expected.dtype and raw.shape == expected.shape
            np.testing.assert_array_equal(raw, expected)
            begin, end = header[name]["data_offsets"]
            assert (info.name, info.dtype, info.shape) == (name, header[name]["dtype"], expected.shape)
            assert (info.begin, info.end, info.nbytes) == (8 + n + begin, 8 + n + end, expected.nbytes)
            if expected.dtype.kind == "f":
                got = ours.read_f32(name)
                assert got.dtype == np.float32 and got.shape == expected.shape
                np.testing.assert_array_equal(got, expected.astype(np.float32))
            else:
                with pytest.raises(CheckpointError, match=rf"^{library_file}: tensor {name} is {info.dtype}, expected a float type$"):
                    ours.read_f32(name)
    del raw  # a zero-copy view keeps the mapping open
    ours.close()
    ours.close()  # twice is harmless
    assert ours._map is None


def test_read_f32_is_a_copy_that_outlives_the_mapping(library_file):
    ours = SafetensorsFile(library_file)
    got = ours.read_f32("f32")
    ours.close()
    got[0, 0] = 1.0  # writable, and no longer backed by the closed mapping
    with safetensors.safe_open(library_file, framework="numpy") as theirs:
        np.testing.assert_array_equal(got[1:], theirs.get_tensor("f32")[1:])


def test_bf16_widens_as_torch_widens_it(tmp_path):
    values = torch.tensor([[1.0, -2.5, 3.140625, 65280.0], [1e-30, -0.0, float("inf"), 7.0]], dtype=torch.bfloat16)
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": values}, path)
    ours = SafetensorsFile(path)
    assert ours.tensors["w"].dtype == "BF16"
    got = ours.read_f32("w")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, values.float().numpy())
    np.testing.assert_array_equal(bf16_to_f32(ours.raw("w")), values.float().numpy())
    assert ours.raw("w").dtype == np.uint16
    np.testing.assert_array_equal(ours.raw("w"), values.view(torch.int16).numpy().view(np.uint16))


def test_read_ints_takes_i64_exactly_and_refuses_any_other_type_in_one_line(tmp_path):
    """Hash constants of 45+ bits: read exactly as int64; a float or narrower integer tensor is refused
    by the reader itself too (the loader's plan refuses them first), naming the file and the tensor."""
    path = tmp_path / "model.safetensors"
    big = np.array([2**62 + 1, -(2**45) - 3, 1], np.int64)
    safetensors.numpy.save_file({"constants": big, "narrow": big.astype(np.int32), "floats": big.astype(np.float32)}, path)
    ours = SafetensorsFile(path)
    got = ours.read_ints("constants")
    assert got.dtype == np.int64 and got.tolist() == big.tolist()
    for name, dtype in (("narrow", "I32"), ("floats", "F32")):
        with pytest.raises(CheckpointError) as error:
            ours.read_ints(name)
        assert str(error.value) == f"{path}: tensor {name} is {dtype}, expected I64"


def test_metadata_of_other_kinds(tmp_path):
    """__metadata__ absent or null gives {}; values that are no strings come back as str (the library
    itself only writes strings)."""
    for metadata, expected in [(None, {}), ({"a": 1, "b": "x"}, {"a": "1", "b": "x"}), ([1], {}), ("s", {})]:
        header = {"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
        if metadata is not None:
            header["__metadata__"] = metadata
        path = write_raw(tmp_path / "m.safetensors", header, b"\x05")
        tensors, meta = st.parse_header(path)
        assert meta == expected and list(tensors) == ["t"]


def write_raw(path: Path, header, data: bytes, length: int | None = None) -> Path:
    body = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


def library_refuses(path: Path) -> bool:
    try:
        with safetensors.safe_open(path, framework="numpy") as f:
            for name in f.keys():
                f.get_tensor(name)
    except Exception:
        return True
    return False


def entry(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


# (case: header, data bytes, the start of our one line after "path: ")
REFUSED = {
    "entry not an object": ({"t": [1]}, b"", "tensor t: header entry is not an object; the file is corrupt, re-download it"),
    "unknown dtype": ({"t": entry(dtype="F8")}, b"\0" * 8, "tensor t: dtype 'F8' is not supported"),
    "dtype a list": ({"t": entry(dtype=["F32"])}, b"\0" * 8, "tensor t: dtype ['F32'] is not supported"),
    "shape not a list": ({"t": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}, b"\0" * 8,
                         "tensor t: invalid shape 2; the file is corrupt, re-download it"),
    "negative dim": ({"t": entry(shape=(-2,), offsets=(0, 0))}, b"", "tensor t: invalid shape [-2]"),
    "bool dim": ({"t": entry(shape=(True,), offsets=(0, 4))}, b"\0" * 4, "tensor t: invalid shape [True]"),
    "float dim": ({"t": entry(shape=(2.0,))}, b"\0" * 8, "tensor t: invalid shape [2.0]"),
    "offsets missing": ({"t": {"dtype": "F32", "shape": [2]}}, b"\0" * 8, "tensor t: invalid data_offsets None"),
    "three offsets": ({"t": entry(offsets=(0, 8, 8))}, b"\0" * 8, "tensor t: invalid data_offsets [0, 8, 8]"),
    "one offset": ({"t": entry(offsets=(8,))}, b"\0" * 8, "tensor t: invalid data_offsets [8]"),
    "offset a float": ({"t": entry(offsets=(0, 8.0))}, b"\0" * 8, "tensor t: invalid data_offsets [0, 8.0]"),
    "offset a bool": ({"t": entry(dtype="U8", shape=(1,), offsets=(False, True))}, b"\0", "tensor t: invalid data_offsets"),
    "span one short": ({"t": entry(offsets=(0, 7))}, b"\0" * 8,
                       "tensor t: data_offsets [0, 7] do not match shape [2] of F32; the file is corrupt, re-download it"),
    "span one long": ({"t": entry(offsets=(0, 9))}, b"\0" * 9, "tensor t: data_offsets [0, 9] do not match shape [2] of F32"),
    "negative begin": ({"t": entry(offsets=(-8, 0))}, b"\0" * 8, "tensor t: data_offsets [-8, 0] do not match"),
    "past the end by one": ({"t": entry()}, b"\0" * 7,
                            "tensor t ends past the end of the file: the file is truncated, re-download it"),
    "overlap": ({"a": entry(), "b": entry(offsets=(4, 12))}, b"\0" * 12,
                "tensors a and b overlap in the data; the file is corrupt, re-download it"),
    "overlap out of order": ({"b": entry(offsets=(4, 12)), "a": entry()}, b"\0" * 12, "tensors a and b overlap"),
    "same span": ({"a": entry(), "b": entry()}, b"\0" * 8, "tensors a and b overlap"),
    "not an object": ([1, 2], b"", "header is not a JSON object; the file is corrupt, re-download it"),
    "not JSON": (b"{nope", b"", "header is not valid JSON; the file is corrupt, re-download it"),
    "nested deep": (b"[" * 100_000 + b"]" * 100_000, b"", "header is not valid JSON"),
    "not UTF-8": (b'{"\xff": 1}', b"", "header is not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_malformed_headers_the_library_refuses_too(tmp_path, case):
    header, data, message = REFUSED[case]
    path = write_raw(tmp_path / "model.safetensors", header, data)
    assert library_refuses(path)
    with pytest.raises(CheckpointError) as refused:
        SafetensorsFile(path)
    assert str(refused.value).startswith(f"{path}: {message}"), str(refused.value)


def test_edges_the_library_accepts_too(tmp_path):
    """Tensors end to end, the last ending at the file's last byte, one of zero size between them, and a
    header that ends at the file's end (no data at all) are all valid."""
    data = np.arange(5, dtype=np.float32).tobytes()
    header = {"a": entry(offsets=(0, 8)), "z": entry(shape=(0,), offsets=(8, 8)), "b": entry(shape=(3,), offsets=(8, 20))}
    path = write_raw(tmp_path / "model.safetensors", header, data)
    ours = SafetensorsFile(path)
    with safetensors.safe_open(path, framework="numpy") as theirs:
        for name in "azb":
            np.testing.assert_array_equal(ours.raw(name), theirs.get_tensor(name))
    assert ours.tensors["b"].end == path.stat().st_size
    empty = write_raw(tmp_path / "empty.safetensors", {}, b"")
    assert SafetensorsFile(empty).tensors == {} and not library_refuses(empty)


def test_header_length_bounds(tmp_path):
    """The u64 prefix: a header that fills the file exactly is read; one byte more is refused, as is a
    header past MAX_HEADER_BYTES however large the file."""
    assert header_length("f", struct.pack("<Q", 92), 100) == 92
    with pytest.raises(CheckpointError, match="^f: header length runs past the end of the file; the file is truncated or not safetensors$"):
        header_length("f", struct.pack("<Q", 93), 100)
    assert header_length("f", struct.pack("<Q", MAX_HEADER_BYTES), MAX_HEADER_BYTES + 8) == MAX_HEADER_BYTES
    with pytest.raises(CheckpointError, match=r"^f: header length 104857601 is over 100 MiB, more than any model's; "
                                              r"the file is corrupt or not safetensors$"):
        header_length("f", struct.pack("<Q", MAX_HEADER_BYTES + 1), 2**40)
    assert MAX_HEADER_BYTES == 100 * 1024 * 1024  # the safetensors library's own limit (100 MB)
    for n in range(8):
        path = tmp_path / "short.safetensors"
        path.write_bytes(b"\x02" * n)
        assert library_refuses(path)
        with pytest.raises(CheckpointError, match=f"^{path}: file is truncated before its header; re-download it$"):
            SafetensorsFile(path)
    path = write_raw(tmp_path / "long.safetensors", {}, b"", length=3)
    assert library_refuses(path)
    with pytest.raises(CheckpointError, match=f"^{path}: header length runs past the end"):
        SafetensorsFile(path)


def test_parse_header_bytes_checks_against_the_given_size():
    """The hub reader passes the header and the size Content-Range announced: offsets count from 8 + header."""
    body = json.dumps({"t": entry()}).encode()
    tensors, meta = parse_header_bytes("remote", body, 8 + len(body) + 8)
    assert (tensors["t"].begin, tensors["t"].end, meta) == (8 + len(body), 16 + len(body), {})
    with pytest.raises(CheckpointError, match="^remote: tensor t ends past the end of the file"):
        parse_header_bytes("remote", body, 8 + len(body) + 7)


def test_an_unreadable_file_is_one_line(tmp_path):
    with pytest.raises(CheckpointError, match=f"^{tmp_path}: cannot read the file \\(Is a directory\\)$"):
        SafetensorsFile(tmp_path)
    with pytest.raises(CheckpointError, match="cannot read the file \\(No such file or directory\\)$"):
        SafetensorsFile(tmp_path / "missing.safetensors")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Shards and index as transformers' save_pretrained writes them (huggingface_hub's save_torch_state_dict)."""
    torch.manual_seed(3)
    state = {f"model.layers.{i}.{part}": torch.randn(16, 8, dtype=torch.bfloat16 if i % 2 else torch.float32)
             for i in range(4) for part in ("mlp.up_proj.weight", "input_layernorm.weight")}
    state["lm_head.weight"] = torch.randn(32, 8, dtype=torch.float16)
    folder = tmp_path_factory.mktemp("sharded")
    save_torch_state_dict(state, folder, max_shard_size=1500)
    return folder, state


def test_a_sharded_checkpoint_reads_as_the_library_reads_it(sharded):
    folder, state = sharded
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 2
    ckpt = SafetensorsCheckpoint(folder)
    assert [f.path.name for f in ckpt.files] == shard_files
    assert sorted(ckpt.names()) == sorted(state)
    for name, tensor in state.items():
        assert name in ckpt and ckpt.file_of(name) == (folder / index["weight_map"][name]).resolve()
        assert ckpt.info(name).shape == tuple(tensor.shape)
        with safetensors.safe_open(ckpt.file_of(name), framework="pt") as theirs:
            np.testing.assert_array_equal(ckpt.read_f32(name), theirs.get_tensor(name).float().numpy())
    assert "model.missing" not in ckpt
    assert shard_names("i", (folder / "model.safetensors.index.json").read_bytes()) == shard_files
    ckpt.close()
    assert all(f._map is None for f in ckpt.files)


def test_single_and_loose_files(tmp_path, library_file):
    single = tmp_path / "single"
    single.mkdir()
    (single / "model.safetensors").write_bytes(library_file.read_bytes())
    (single / "other.safetensors").write_bytes(b"junk")  # model.safetensors wins over loose files
    assert [f.path for f in SafetensorsCheckpoint(single).files] == [single / "model.safetensors"]
    loose = tmp_path / "loose"
    loose.mkdir()
    for name in ("b.safetensors", "a.safetensors"):
        safetensors.numpy.save_file({name[0]: np.ones(2, np.float32)}, loose / name)
    ckpt = SafetensorsCheckpoint(loose)
    assert [f.path.name for f in ckpt.files] == ["a.safetensors", "b.safetensors"] and sorted(ckpt.names()) == ["a", "b"]
    with pytest.raises(CheckpointError, match=f"^{tmp_path}: no model.safetensors or model.safetensors.index.json here; "
                                              "point --model at a model folder$"):
        SafetensorsCheckpoint(tmp_path)


def test_an_index_that_names_bad_shards(tmp_path, library_file):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(library_file.read_bytes())  # ignored: the index wins
    index = folder / "model.safetensors.index.json"
    cases = {
        "a\0b": f"^{index}: shard 'a\\\\x00b' is not a file name; the index is corrupt, re-download the model$",
        "../model.safetensors": f"^{index}: shard '../model.safetensors' points outside the model folder; refusing to read it$",
        "gone.safetensors": f"^{(folder / 'gone.safetensors').resolve()}: shard listed in model.safetensors.index.json is "
                            "missing; re-download the model$",
    }
    for shard, message in cases.items():
        index.write_text(json.dumps({"weight_map": {"t": shard}}))
        with pytest.raises(CheckpointError, match=message):
            SafetensorsCheckpoint(folder)
    index.write_text("{")
    with pytest.raises(CheckpointError, match=f"^{index}: index is not valid JSON with a weight_map"):
        SafetensorsCheckpoint(folder)
    (tmp_path / "model.safetensors").write_bytes(library_file.read_bytes())
    index.write_text(json.dumps({"weight_map": {"t": "model.safetensors"}}))
    assert [f.path for f in SafetensorsCheckpoint(folder).files] == [(folder / "model.safetensors").resolve()]


@pytest.mark.parametrize("body", [b"{", b"[]", b"{}", b'{"weight_map": 3}', b'{"weight_map": [1]}', b"[" * 50_000],
                         ids=["cut", "list", "no map", "map 3", "map list", "deep"])
def test_an_index_that_is_not_an_index(body):
    with pytest.raises(CheckpointError, match="^i: index is not valid JSON with a weight_map; re-download the model$"):
        shard_names("i", body)


def test_shard_names_are_sorted_and_unique():
    index = {"weight_map": {"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors", "w": 5}}
    assert shard_names("i", json.dumps(index).encode()) == ["5", "a.safetensors", "b.safetensors"]


# --- GGUF -----------------------------------------------------------------------------------------------

from duet.engine.checkpoint.gguf import FLOAT_ROUTES, QUANTIZED_ROUTES, GGUFCheckpoint, find_gguf  # noqa: E402
from duet.engine.quant.gguf_blocks import BlockMatrix  # noqa: E402

QWEN35_MTP, QWEN35MOE, QWEN3NEXT = (DATA / f"llamacpp_{n}_f16.gguf" for n in ("qwen35_mtp", "qwen35moe", "qwen3next"))
# GGUF tensor -> model tensor that llama.cpp's converter stored unchanged (REFERENCE.md section 2), blk.0 of each file
AS_STORED = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "blk.0.ssm_norm.weight": "model.layers.0.linear_attn.norm.weight",
    "blk.0.ssm_dt.bias": None,  # rows permuted on qwen35 (tiled V heads): checked as a set of values below
    "blk.3.attn_k.weight": "model.layers.3.self_attn.k_proj.weight",
    "blk.3.attn_v.weight": "model.layers.3.self_attn.v_proj.weight",
    "blk.3.attn_output.weight": "model.layers.3.self_attn.o_proj.weight",
}
DENSE_MLP = {f"blk.{i}.ffn_{p}.weight": f"model.layers.{i}.mlp.{p}_proj.weight" for i in (0, 3) for p in ("gate", "up", "down")}
SHARED_EXPERT = {f"blk.{i}.ffn_{p}_shexp.weight": f"model.layers.{i}.mlp.shared_expert.{p}_proj.weight"
                 for i in (0, 3) for p in ("gate", "up", "down")}
NORMS = {"output_norm.weight": "model.norm.weight", "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
         "blk.3.attn_q_norm.weight": "model.layers.3.self_attn.q_norm.weight"}  # stored as 1 + w


def reader_data(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    """A tensor's values as the gguf package gives them: fp32 in numpy order, dequantized where quantized."""
    t = next(t for t in reader.tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))


@pytest.mark.parametrize("path", [QWEN35_MTP, QWEN35MOE, QWEN3NEXT], ids=lambda p: p.stem)
def test_llamacpp_tensors_read_as_the_gguf_package_reads_them(path):
    ckpt, reader = GGUFCheckpoint(path), gguf.GGUFReader(path)
    moe = path != QWEN35_MTP
    stored = dict(AS_STORED) | (SHARED_EXPERT if moe else DENSE_MLP)
    for name, key in stored.items():
        if key is not None:
            np.testing.assert_array_equal(ckpt.read_f32(key), reader_data(reader, name), err_msg=name)
            assert ckpt.info(key).shape == reader_data(reader, name).shape and key in ckpt
    for name, key in NORMS.items():
        np.testing.assert_array_equal(ckpt.read_f32(key), reader_data(reader, name) - np.float32(1), err_msg=name)
    np.testing.assert_array_equal(np.sort(ckpt.read_f32("model.layers.0.linear_attn.dt_bias")),
                                  np.sort(reader_data(reader, "blk.0.ssm_dt.bias")))
    np.testing.assert_allclose(np.sort(ckpt.read_f32("model.layers.0.linear_attn.A_log")),
                               np.sort(np.log(-reader_data(reader, "blk.0.ssm_a"))), rtol=1e-6)
    if moe:
        experts = reader_data(reader, "blk.0.ffn_up_exps.weight")
        for e in range(experts.shape[0]):
            np.testing.assert_array_equal(ckpt.read_f32(f"model.layers.0.mlp.experts.{e}.up_proj.weight"), experts[e])
            assert ckpt.entries[f"model.layers.0.mlp.experts.{e}.up_proj.weight"].nbytes == \
                   next(t.n_bytes for t in reader.tensors if t.name == "blk.0.ffn_up_exps.weight") // experts.shape[0]
        gate = reader_data(reader, "blk.0.ffn_gate_inp_shexp.weight")  # ne [64, 1]: one row
        np.testing.assert_array_equal(ckpt.read_f32("model.layers.0.mlp.shared_expert_gate.weight").reshape(-1), gate.reshape(-1))
    for t in reader.tensors:
        if t.name in stored and stored[t.name] is not None:
            assert ckpt.entries[stored[t.name]].nbytes == t.n_bytes and ckpt.entries[stored[t.name]].source == t.name
    assert ckpt.block_types == [] and ckpt.routes == FLOAT_ROUTES == ("bf16",) and ckpt.description == "GGUF float"
    assert ckpt.arch == reader.fields["general.architecture"].contents()
    assert ckpt.config.vocab_size == reader_data(reader, "token_embd.weight").shape[0]
    assert ckpt.config.num_hidden_layers == reader.fields[f"{ckpt.arch}.block_count"].contents() - (0 if moe else 1)
    assert ckpt.file_of("lm_head.weight") == path and ckpt.model_dir == path
    assert "lm_head.missing" not in ckpt and "model.layers.0.mlp.up_proj.weight" not in ckpt.quantized
    assert "lm_head.missing" not in ckpt.quantized
    if not moe:  # the MTP block: blk.{n_layer}.nextn.* (REFERENCE.md section 2)
        n = reader.fields["qwen35.block_count"].contents() - 1
        np.testing.assert_array_equal(ckpt.read_f32("mtp.fc.weight"), reader_data(reader, f"blk.{n}.nextn.eh_proj.weight"))
        np.testing.assert_array_equal(ckpt.read_f32("mtp.layers.0.mlp.up_proj.weight"), reader_data(reader, f"blk.{n}.ffn_up.weight"))
    assert all(type(entry.nbytes) is int for entry in ckpt.entries.values())
    assert ckpt.config.eos_token_ids == (reader.fields["tokenizer.ggml.eos_token_id"].contents(),)
    head = next(t for t in reader.tensors if t.name == "output.weight")
    assert ckpt.info("lm_head.weight") == TensorInfo("lm_head.weight", "F32", tuple(int(d) for d in reversed(head.shape)),
                                                     0, head.n_bytes)  # what TensorPlan reads of a checkpoint
    assert len(ckpt.names()) == len(ckpt.entries) and set(ckpt.names()) == set(ckpt.entries)
    ckpt.close()


def test_the_tokenizer_reads_the_files_vocabulary():
    ckpt, fields = GGUFCheckpoint(QWEN35_MTP), gguf.GGUFReader(QWEN35_MTP).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    tok = ckpt.tokenizer()
    eos, pad = fields["tokenizer.ggml.eos_token_id"].contents(), fields["tokenizer.ggml.padding_token_id"].contents()
    assert tok.eos_ids == {eos} and tok.eos_token == tokens[eos] and tok.pad_token == tokens[pad]
    assert tok.bos_token is None and "tokenizer.ggml.bos_token_id" not in fields
    assert tok.chat_template == fields["tokenizer.chat_template"].contents()
    assert tok.decode(tok.encode("hello world, again")) == "hello world, again"


def rewrite(src: Path, dst: Path, types: dict[str, Q] = {}, keys: dict[str, tuple] = {}, drop: tuple[str, ...] = (),
            drop_tensors: tuple[str, ...] = ()) -> Path:
    """`src` written again by the gguf package's GGUFWriter: tensors in `types` converted (gguf.quants.quantize,
    from their fp32 values), keys replaced (name -> (value, type[, sub type])) or dropped."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
            continue
        if name in keys:
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    for name, (value, *kinds) in keys.items():
        writer.add_key_value(name, value, *kinds)
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        values = reader_data(reader, t.name)
        kind = types.get(t.name)
        if kind is None:
            writer.add_tensor(t.name, np.array(t.data))
        elif kind == Q.F32:
            writer.add_tensor(t.name, values.astype(np.float32))
        else:
            blocks = gguf.quants.quantize(values, kind)
            writer.add_tensor(t.name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


QUANTIZED = {"blk.0.ffn_up.weight": Q.Q8_0, "blk.0.ffn_down.weight": Q.Q4_0, "blk.3.attn_k.weight": Q.Q8_0,
             "token_embd.weight": Q.BF16, "output.weight": Q.F32, "blk.0.ssm_norm.weight": Q.F16,
             "blk.0.attn_norm.weight": Q.Q8_0}  # a norm the converter keeps f32, quantized here: read as fp32


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory) -> Path:
    return rewrite(QWEN35_MTP, tmp_path_factory.mktemp("q") / "q.gguf", QUANTIZED)


def test_quantized_and_bf16_tensors_read_as_gguf_dequantize_reads_them(quantized_gguf):
    ckpt, reader = GGUFCheckpoint(quantized_gguf), gguf.GGUFReader(quantized_gguf)
    assert ckpt.block_types == ["Q4_0", "Q8_0"] and ckpt.routes == QUANTIZED_ROUTES == ("w4a8", "bf16")
    assert ckpt.description == "GGUF Q4_0/Q8_0"
    for name, key in {**AS_STORED, **DENSE_MLP}.items():
        if key is None:
            continue
        expected = reader_data(reader, name)
        kind = QUANTIZED.get(name)
        quantized = kind in (Q.Q8_0, Q.Q4_0)
        assert (key in ckpt.quantized) == quantized, name
        assert ckpt.entries[key].quantized == quantized
        np.testing.assert_allclose(ckpt.read_f32(key) if not quantized else ckpt.read_f32(key).dequantize(), expected,
                                   rtol=0, atol=0, err_msg=name)
        if quantized:
            blocks = ckpt.quantized.read(key)
            assert isinstance(blocks, BlockMatrix)
            np.testing.assert_array_equal(blocks.dequantize(), expected)
            assert ckpt.quantized.nbytes(key) == next(t.n_bytes for t in reader.tensors if t.name == name)
            ckpt.quantized.check(key, expected.shape)
            with pytest.raises(CheckpointError, match=rf"^{quantized_gguf}: tensor {name} holds \[{expected.shape[0]}, "
                                                      rf"{expected.shape[1]}\] for {key}, the metadata implies \[1, 2\]$"):
                ckpt.quantized.check(key, (1, 2))
    np.testing.assert_array_equal(ckpt.read_f32("model.layers.0.input_layernorm.weight"),
                                  reader_data(reader, "blk.0.attn_norm.weight") - np.float32(1))
    bf16 = ckpt.read_f32("model.embed_tokens.weight")
    assert bf16.dtype == np.float32
    original = reader_data(gguf.GGUFReader(QWEN35_MTP), "token_embd.weight")
    np.testing.assert_array_equal(bf16, torch.from_numpy(original).bfloat16().float().numpy())


def expect_refused(path: Path, message: str) -> None:
    with pytest.raises(CheckpointError) as refused:
        GGUFCheckpoint(path)
    assert str(refused.value) == f"{path}: {message}", str(refused.value)


def test_files_the_loader_refuses(tmp_path):
    missing = rewrite(QWEN35_MTP, tmp_path / "missing.gguf", drop_tensors=("blk.2.ffn_up.weight",))
    expect_refused(missing, "tensor blk.2.ffn_up.weight is missing; the file is not a complete qwen35 GGUF")
    wrong = rewrite(QWEN35_MTP, tmp_path / "wrong.gguf", keys={"qwen35.feed_forward_length": (64, gguf.GGUFValueType.UINT32)})
    expect_refused(wrong, "tensor blk.0.ffn_gate.weight has shape [96, 64], the metadata implies [64, 64]; "
                          "the file is corrupt or mislabelled")
    q5 = rewrite(QWEN35_MTP, tmp_path / "q5.gguf", {"blk.0.ffn_up.weight": Q.Q5_0})
    expect_refused(q5, "tensor blk.0.ffn_up.weight is Q5_0, a block type duet does not read; supported: "
                       "F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS")
    no_heads = rewrite(QWEN35_MTP, tmp_path / "heads.gguf", keys={"qwen35.attention.head_count": (0, gguf.GGUFValueType.UINT32)})
    expect_refused(no_heads, "metadata key qwen35.attention.head_count is 0, not an integer from 1 to 1048576; "
                             "the file is corrupt, download it again or convert it again")
    llama = rewrite(QWEN35_MTP, tmp_path / "llama.gguf", keys={"general.architecture": ("llama", gguf.GGUFValueType.STRING)})
    expect_refused(llama, "GGUF architecture 'llama' (key general.architecture) is not supported; "
                          "duet reads qwen35, qwen35moe, qwen3next, qwen4exp")


def tokenizer_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as refused:
        GGUFCheckpoint(path).tokenizer()
    return str(refused.value).removeprefix(f"{path}: ")


def test_tokenizer_keys_the_loader_refuses(tmp_path):
    S, U = gguf.GGUFValueType.STRING, gguf.GGUFValueType.UINT32
    assert tokenizer_error(rewrite(QWEN35_MTP, tmp_path / "a.gguf", keys={"tokenizer.ggml.model": ("llama", S)})) == \
        "tokenizer model 'llama' is not supported; duet reads gpt2-style BPE"
    assert tokenizer_error(rewrite(QWEN35_MTP, tmp_path / "b.gguf", drop=("tokenizer.ggml.model",))) == \
        "metadata key tokenizer.ggml.model is missing; the file is not a complete qwen35 GGUF"
    assert tokenizer_error(rewrite(QWEN35_MTP, tmp_path / "c.gguf", drop=("tokenizer.ggml.merges",))) == \
        "metadata key tokenizer.ggml.merges is missing; the file is not a complete qwen35 GGUF"
    n = len(gguf.GGUFReader(QWEN35_MTP).fields["tokenizer.ggml.tokens"].contents())
    assert tokenizer_error(rewrite(QWEN35_MTP, tmp_path / "d.gguf", keys={"tokenizer.ggml.padding_token_id": (n, U)})) == \
        f"metadata key tokenizer.ggml.padding_token_id is {n}, not a token id"
    assert tokenizer_error(rewrite(QWEN35_MTP, tmp_path / "e.gguf", keys={"tokenizer.ggml.bos_token_id": ("1", S)})) == \
        "metadata key tokenizer.ggml.bos_token_id is '1', not a token id"
    last = rewrite(QWEN35_MTP, tmp_path / "f.gguf", keys={"tokenizer.ggml.eot_token_id": (n - 1, U),
                                                            "tokenizer.ggml.bos_token_id": (0, U)})
    tok = GGUFCheckpoint(last).tokenizer()  # the last token and token 0 are ids; eot ends a turn too
    eos = gguf.GGUFReader(QWEN35_MTP).fields["tokenizer.ggml.eos_token_id"].contents()
    assert tok.eos_ids == {eos, n - 1} and tok.bos_token == gguf.GGUFReader(QWEN35_MTP).fields["tokenizer.ggml.tokens"].contents()[0]
    assert tokenizer_error(rewrite(QWEN35_MTP, tmp_path / "h.gguf", keys={"tokenizer.ggml.pre": ("nope", S)})).startswith(
        "tokenizer pre-tokenizer 'nope' is not supported; duet reads ")  # the key is read, and the file named
    no_pre = GGUFCheckpoint(rewrite(QWEN35_MTP, tmp_path / "g.gguf", drop=("tokenizer.ggml.pre",))).tokenizer()
    assert no_pre.decode(no_pre.encode("plain gpt-2 split")) == "plain gpt-2 split"  # llama.cpp's default pre-tokenizer


def test_find_gguf(tmp_path):
    assert find_gguf(QWEN35_MTP) == QWEN35_MTP
    assert find_gguf(tmp_path) is None
    (tmp_path / "a.txt").write_text("x")
    assert find_gguf(tmp_path / "a.txt") is None and find_gguf(tmp_path / "nothing.gguf") is None
    (tmp_path / "b.gguf").write_bytes(b"")
    assert find_gguf(tmp_path) == tmp_path / "b.gguf"
    (tmp_path / "a.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"^{tmp_path}: holds several GGUF files \\(a.gguf, b.gguf\\); "
                                              "pass --model with one of them$"):
        find_gguf(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert find_gguf(tmp_path) is None


DEMO_GGUF = Path(__file__).parents[2] / "models" / "demo_gguf" / "demo-q8_0.gguf"


def test_gguf_checkpoint_refusals(tmp_path):
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'x.gguf'}: file not found; pass --model with a .gguf file$"):
        GGUFCheckpoint(tmp_path / "x.gguf")
    with pytest.raises(CheckpointError, match="file not found"):
        GGUFCheckpoint(tmp_path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(QWEN35_MTP.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"^{cut}: file ends inside its GGUF header"):
        GGUFCheckpoint(cut)
    assert list(GGUFCheckpoint(QWEN35_MTP).tensors) == [t.name for t in gguf.GGUFReader(QWEN35_MTP).tensors]


@pytest.mark.parametrize("path", [QWEN35_MTP, DEMO_GGUF], ids=["llamacpp", "demo"])
def test_gguf_metadata_as_the_gguf_package_reads_it(path):
    """Every key, long arrays (the demo's 4,096 tokens and token types, merges) included, as
    gguf.GGUFReader decodes it."""
    ours, reference = GGUFCheckpoint(path).fields, gguf.GGUFReader(path).fields
    assert list(ours) == [key for key in reference if not key.startswith("GGUF.")]
    for key, value in ours.items():
        assert value == reference[key].contents(), key
    assert len(ours["tokenizer.ggml.merges"]) > 0


def test_a_block_type_the_gguf_package_does_not_know(tmp_path):
    """Our header reader sizes an unknown type by the next offset; the checkpoint then names the type it refuses."""
    reader = gguf.GGUFReader(QWEN35_MTP)
    last = max(reader.tensors, key=lambda t: t.data_offset)
    type_part = last.field.parts[-2]  # name length, name, n_dims, dims, type, offset
    at = type_part.ctypes.data - reader.data.ctypes.data
    blob = bytearray(QWEN35_MTP.read_bytes())
    assert struct.unpack_from("<I", blob, at)[0] == int(last.tensor_type)
    struct.pack_into("<I", blob, at, 200)
    path = tmp_path / "custom.gguf"
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError) as refused:
        GGUFCheckpoint(path)
    assert str(refused.value) == (f"{path}: tensor {last.name} is ggml type 200, a block type duet does not read; "
                                  "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS")


def test_quantized_experts_and_router_read_as_gguf_dequantize_reads_them(tmp_path):
    """Stacked experts [E, out, in] quantized stay blocks, one expert each; a router the converter keeps f32,
    quantized here, is read as fp32 [E, H]; f16 tensors widen to fp32, not fp64."""
    path = rewrite(QWEN35MOE, tmp_path / "moe.gguf", {"blk.0.ffn_up_exps.weight": Q.Q8_0, "blk.0.ffn_gate_inp.weight": Q.Q8_0})
    ckpt, reader = GGUFCheckpoint(path), gguf.GGUFReader(path)
    experts = reader_data(reader, "blk.0.ffn_up_exps.weight")
    for e in range(experts.shape[0]):
        key = f"model.layers.0.mlp.experts.{e}.up_proj.weight"
        assert key in ckpt.quantized
        np.testing.assert_array_equal(ckpt.quantized.read(key).dequantize(), experts[e])
    router = ckpt.read_f32("model.layers.0.mlp.gate.weight")
    assert router.dtype == np.float32 and "model.layers.0.mlp.gate.weight" not in ckpt.quantized
    np.testing.assert_array_equal(router, reader_data(reader, "blk.0.ffn_gate_inp.weight"))
    for key in ("model.layers.0.mlp.shared_expert.up_proj.weight", "lm_head.weight", "model.norm.weight"):
        assert ckpt.read_f32(key).dtype == np.float32, key
