"""The header-only readers (engine/checkpoint/headers.py) against independent references (issue 16, item 7).

Every expected value comes from outside the code under test: what a GGUF file holds from the `gguf` package
(GGUFReader; files written by its GGUFWriter, split files by its own shard naming) or from bytes laid out here
as the GGUF format defines them; what a safetensors file holds from the `safetensors` library (safe_open) and
huggingface_hub's own header reader (HfApi.get_safetensors_metadata against tests/app/fake_hub.py); what an
HTTP range is from RFC 9110 (`bytes=first-last`, inclusive). Remote reads run against an in-process
httpx.MockTransport that answers as the hub does and records every request.

Fast on purpose (about a second): mutmut re-runs these tests for every mutant of headers.py.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as T

import headeronly as ho
from duet.engine.checkpoint import headers as hd
from duet.engine.checkpoint.headers import read_gguf_header, read_headers
from duet.engine.checkpoint.safetensors import TensorInfo
from duet.engine.errors import CheckpointError, DuetError



# --- GGUF files written by the gguf package ---------------------------------------------------------------

SCALAR_KEYS = [("k.u8", 200, T.UINT8), ("k.i8", -100, T.INT8), ("k.u16", 60000, T.UINT16), ("k.i16", -30000, T.INT16),
               ("k.u32", 4_000_000_000, T.UINT32), ("k.i32", -2_000_000_000, T.INT32), ("k.f32", 0.25, T.FLOAT32),
               ("k.bool", True, T.BOOL), ("k.false", False, T.BOOL), ("k.u64", 2**63 + 5, T.UINT64),
               ("k.i64", -2**62, T.INT64), ("k.f64", 1.0 / 3.0, T.FLOAT64), ("k.str", "größe ✓", T.STRING)]
ARRAY_KEYS = [("a.u8", [1, 2, 255], T.UINT8), ("a.i16", [-5, 7], T.INT16), ("a.f32", [0.5, -1.5], T.FLOAT32),
              ("a.str", ["x", "", "yz"], T.STRING), ("a.bool", [True, False], T.BOOL),
              ("a.1024", list(range(1024)), T.UINT32), ("a.1025", list(range(1025)), T.UINT16),
              ("a.strs", [f"t{i}" for i in range(1500)], T.STRING), ("a.i64", list(range(-3, 2000)), T.INT64),
              ("after", 7, T.UINT32)]  # read after the skipped arrays: they were stepped over exactly
TENSORS = {"f32": (Q.F32, (3, 5)), "f16": (Q.F16, (4, 2)), "bf16": (Q.BF16, (2, 2, 3)), "q8": (Q.Q8_0, (3, 64)),
           "q4k": (Q.Q4_K, (2, 256)), "iq4": (Q.IQ4_XS, (1, 256)), "i8": (Q.I8, (7,)), "four": (Q.F32, (1, 2, 1, 3))}


def write_with_gguf(path: Path, alignment: int | None = None, tensors=TENSORS, keys=SCALAR_KEYS + ARRAY_KEYS) -> Path:
    writer = gguf.GGUFWriter(path, "qwen35")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for name, value, vtype in keys:
        writer.add_key_value(name, value, T.ARRAY if isinstance(value, list) else vtype, vtype if isinstance(value, list) else None)
    data = 0
    for name, (kind, shape) in tensors.items():
        nbytes = ho.quant_bytes(kind, shape)
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=kind)
        data += -(-nbytes // (alignment or 32)) * (alignment or 32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with open(path, "r+b") as f:  # the data: a hole after the padded header
        f.truncate(-(-path.stat().st_size // (alignment or 32)) * (alignment or 32) + data)
    return path


def reader_keys(reader: gguf.GGUFReader) -> dict:
    """Keys as GGUFReader gives them; arrays longer than 1024 items are kept as None (the reader's rule)."""
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = field.contents()
        out[name] = None if field.types[0] == T.ARRAY and len(field.data) > 1024 else value
    return out


def reader_tensors(reader: gguf.GGUFReader) -> dict[str, TensorInfo]:
    return {t.name: TensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)),
                               int(t.data_offset), int(t.data_offset) + int(t.n_bytes)) for t in reader.tensors}


# Written and read by the gguf package once, when the module is imported (mutmut imports it once a run): the
# tests below then run only the code under test.
_ROOT = Path(tempfile.mkdtemp(prefix="duet-reader-reference-"))
atexit.register(lambda pid=os.getpid(): os.getpid() == pid and shutil.rmtree(_ROOT, ignore_errors=True))  # not in forks


def _reference(path: Path) -> tuple[dict, dict[str, TensorInfo]]:
    reader = gguf.GGUFReader(path)
    return reader_keys(reader), reader_tensors(reader)


def _with_version(src: Path, version: int) -> Path:
    path = src.with_name(f"v{version}.gguf")
    data = src.read_bytes()
    path.write_bytes(data[:4] + struct.pack("<I", version) + data[8:])
    return path


def _reader_accepts(path: Path) -> bool:
    try:
        gguf.GGUFReader(path)
        return True
    except ValueError:
        return False


KEYS_FILES = {a: write_with_gguf(_ROOT / f"keys{a}.gguf", a) for a in (None, 1, 256)}
KEYS_REF = {a: _reference(p) for a, p in KEYS_FILES.items()}
VERSIONS = {v: _with_version(KEYS_FILES[None], v) for v in (1, 2, 4)}
VERSIONS_READ = {v: _reader_accepts(p) for v, p in VERSIONS.items()}


@pytest.fixture(scope="module")
def made() -> Path:
    return _ROOT


@pytest.mark.parametrize("alignment", [None, 1, 256])
def test_keys_and_tensors_read_as_ggufreader_reads_them(alignment):
    tensors, metadata = read_gguf_header(KEYS_FILES[alignment])
    keys, reference = KEYS_REF[alignment]
    assert metadata == keys
    assert [type(metadata[k]) for k, *_ in SCALAR_KEYS] == [type(v) for _, v, _ in SCALAR_KEYS]
    assert tensors == reference and list(tensors) == list(reference)


def test_version_2_is_read_and_versions_1_and_4_are_refused_as_ggufreader_refuses_them():
    assert VERSIONS_READ == {1: False, 2: True, 4: False}
    assert read_gguf_header(VERSIONS[2]) == read_gguf_header(KEYS_FILES[None])
    for version in (1, 4):
        assert refused(VERSIONS[version]) == f"{VERSIONS[version]}: GGUF version {version} is not supported (2 and 3 are)"


# --- GGUF bytes laid out as the format defines them ------------------------------------------------------

def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def ti(name: str | bytes, dims: tuple[int, ...], ggml_type: int, offset: int) -> bytes:
    """Tensor info: dims innermost first, as the file stores them."""
    return s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<II", ggml_type, 0)[:4] + struct.pack("<Q", offset)


def raw_gguf(path: Path, keys: list[bytes], infos: list[bytes], data_bytes: int, alignment: int = 32, version: int = 3,
             n_tensors: int | None = None, n_keys: int | None = None, pad: bool = True) -> Path:
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                 len(keys) if n_keys is None else n_keys) + b"".join(keys) + b"".join(infos)
    if pad:
        head += b"\0" * (-len(head) % alignment)
    path.write_bytes(head + b"\x11" * data_bytes)
    return path


def refused(path: Path) -> str:
    with pytest.raises(CheckpointError) as caught:
        read_gguf_header(path)
    return str(caught.value)


def test_offsets_out_of_file_order_and_the_last_tensor_ending_at_the_end(tmp_path):
    infos = [ti("b", (4,), Q.F32, 32), ti("a", (8,), Q.F16, 0), ti("c", (2, 3), Q.F32, 64)]  # c: 24 bytes, to EOF
    path = raw_gguf(tmp_path / "order.gguf", [], infos, 64 + 24)
    tensors, metadata = read_gguf_header(path)
    assert tensors == reader_tensors(gguf.GGUFReader(path)) and list(tensors) == ["b", "a", "c"] and metadata == {}
    assert tensors["c"].end == path.stat().st_size


def test_no_tensors_and_a_file_that_ends_with_its_header(tmp_path):
    path = raw_gguf(tmp_path / "empty.gguf", [kv("x", 4, struct.pack("<I", 9)), kv("e", 9, struct.pack("<IQ", 4, 0))], [], 0, pad=False)
    assert read_gguf_header(path) == ({}, {"x": 9, "e": []})
    assert reader_keys(gguf.GGUFReader(path)) == {"x": 9, "e": []}


def test_scalar_tensor_eight_dims_and_a_type_gguf_does_not_know(tmp_path):
    infos = [ti("scalar", (), Q.F32, 0), ti("eight", (1,) * 7 + (2,), Q.F16, 32), ti("custom", (10,), 200, 64)]
    path = raw_gguf(tmp_path / "dims.gguf", [], infos, 64 + 50)
    tensors, _ = read_gguf_header(path)
    same_layout = infos[:2] + [ti("custom", (10,), Q.I8, 64)]  # the header has the same length
    reference = reader_tensors(gguf.GGUFReader(raw_gguf(tmp_path / "ref.gguf", [], same_layout, 64 + 50)))
    assert tensors["scalar"] == reference["scalar"] and tensors["eight"] == reference["eight"]
    begin = reference["custom"].begin
    assert tensors["custom"] == TensorInfo("custom", "ggml type 200", (10,), begin, begin + 50)  # to the end of the file


def alignment_key(vtype: int, payload: bytes) -> bytes:
    return kv("general.alignment", vtype, payload)


@pytest.mark.parametrize("key, shown", [(alignment_key(4, struct.pack("<I", 48)), "48"), (alignment_key(4, struct.pack("<I", 0)), "0"),
                                        (alignment_key(5, struct.pack("<i", -32)), "-32"), (alignment_key(6, struct.pack("<f", 32.0)), "32.0"),
                                        (alignment_key(7, b"\x01"), "True"), (alignment_key(8, s("32")), "'32'")])
def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path, key, shown):
    path = raw_gguf(tmp_path / "align.gguf", [key], [ti("t", (4,), Q.F32, 0)], 64)
    assert refused(path) == f"{path}: general.alignment {shown} is not a power of two; the file is corrupt"


def test_a_custom_alignment_moves_the_data(tmp_path):
    path = raw_gguf(tmp_path / "a.gguf", [alignment_key(4, struct.pack("<I", 128))], [ti("t", (4,), Q.F32, 128)], 128 + 16, alignment=128)
    tensors, _ = read_gguf_header(path)
    assert tensors == reader_tensors(gguf.GGUFReader(path)) and tensors["t"].begin % 128 == 0
    unaligned = raw_gguf(tmp_path / "u.gguf", [alignment_key(4, struct.pack("<I", 128))], [ti("t", (4,), Q.F32, 96)], 256, alignment=128)
    assert refused(unaligned) == f"{unaligned}: tensor t has offset 96, outside the file or unaligned; the file is truncated or corrupt"


MSG_TRUNC = "file ends inside its GGUF header; it is truncated, re-download it"


def test_malformed_headers_are_refused_with_one_line(tmp_path):
    def case(name, keys=(), infos=(), data=64, **kw):
        return refused(raw_gguf(tmp_path / f"{name}.gguf", list(keys), list(infos), data, **kw)).split(": ", 1)[1]

    assert refused(_magic(tmp_path)) == f"{tmp_path / 'm.gguf'}: not a GGUF file (the magic bytes are wrong)"
    assert case("dupkey", [kv("x", 0, b"\1"), kv("x", 0, b"\2")]) == "GGUF key x appears twice; the file is corrupt, re-download it"
    assert case("duptensor", infos=[ti("t", (4,), Q.F32, 0), ti("t", (4,), Q.F32, 32)]) == \
        "tensor t appears twice; the file is corrupt, re-download it"
    assert case("dims", infos=[ti("t", (1,) * 9, Q.F32, 0)]) == "tensor t has 9 dimensions; the file is corrupt"
    assert case("vtype", [kv("x", 13, b"\0" * 8)]) == "GGUF value type 13 is unknown; the file is corrupt or too new"
    assert case("nested", [kv("x", 9, struct.pack("<IQ", 9, 1))]) == \
        "GGUF array of value type 9 is not supported; the file is corrupt or too new"
    assert case("arr13", [kv("x", 9, struct.pack("<IQ", 13, 1))]) == \
        "GGUF array of value type 13 is not supported; the file is corrupt or too new"
    assert case("utf8", infos=[ti(b"\xff\xfe", (4,), Q.F32, 0)]) == "a GGUF key or tensor name is not UTF-8; the file is corrupt"
    assert case("rows", infos=[ti("t", (33, 2), Q.Q8_0, 0)]) == \
        "tensor t: rows of 33 are not whole Q8_0 blocks of 32; the file is corrupt"
    assert case("overlap", infos=[ti("a", (16,), Q.F32, 0), ti("b", (4,), Q.F32, 32)]) == \
        "tensor a runs into the next tensor or past the end of the file; the file is truncated or corrupt"
    assert case("pastend", infos=[ti("a", (20,), Q.F32, 0)]) == \
        "tensor a runs into the next tensor or past the end of the file; the file is truncated or corrupt"
    assert case("offset", infos=[ti("a", (1,), Q.F32, 96)]) == \
        "tensor a has offset 96, outside the file or unaligned; the file is truncated or corrupt"
    assert case("count", n_keys=(1 << 26) + 1) == f"GGUF header claims {(1 << 26) + 1} entries; the file is corrupt, re-download it"
    assert case("maxcount", n_tensors=1 << 26, data=0, pad=False) == MSG_TRUNC  # the largest count is believed, then the file ends
    assert case("cut", [kv("x", 8, struct.pack("<Q", 500) + b"ab")], data=0, pad=False) == MSG_TRUNC


def _magic(tmp_path: Path) -> Path:
    path = raw_gguf(tmp_path / "m.gguf", [], [], 64)
    path.write_bytes(b"GGUX" + path.read_bytes()[4:])
    return path


def test_exact_fits_at_the_end_of_the_file(tmp_path):
    # a tensor of exactly its room, and one beginning exactly at the end of the file (zero bytes)
    path = raw_gguf(tmp_path / "fit.gguf", [], [ti("a", (8,), Q.F32, 0), ti("z", (0,), Q.F32, 32)], 32)
    tensors, _ = read_gguf_header(path)
    assert tensors == reader_tensors(gguf.GGUFReader(path))
    assert refused(raw_gguf(tmp_path / "tight.gguf", [], [ti("a", (9,), Q.F32, 0)], 32 + 3)).endswith(
        "tensor a runs into the next tensor or past the end of the file; the file is truncated or corrupt")


def test_a_header_past_the_limit_is_refused_before_reading(tmp_path, monkeypatch):
    limit = 3 << 20
    monkeypatch.setattr(hd, "MAX_HEADER_BYTES", limit)
    head = len(b"GGUF") + 4 + 8 + 8 + 8 + 1 + 4 + 8  # magic, version, counts, key "x", type, string length
    fits = raw_gguf(tmp_path / "fits.gguf", [kv("x", 8, s("a" * (limit - head)))], [], 0, pad=False)
    assert read_gguf_header(fits)[1] == {"x": "a" * (limit - head)}
    over = raw_gguf(tmp_path / "over.gguf", [kv("x", 8, s("a" * (limit + 1 - head)))], [], 0, pad=False)
    assert refused(over) == f"{over}: GGUF header runs past 3 MiB, more than any model's; the file is corrupt, re-download it"


def test_a_file_that_shrinks_while_it_is_read(tmp_path):
    """The size was taken before the file was cut (a download still being written): the short read is refused."""
    path = raw_gguf(tmp_path / "m.gguf", [kv("x", 4, struct.pack("<I", 9))], [], 0, pad=False, n_keys=2)
    with open(path, "rb") as handle:
        with pytest.raises(CheckpointError) as caught:
            hd.parse_gguf_header(hd._FileStream(handle, "src", path.stat().st_size + 100), "src", path.stat().st_size + 100)
    assert str(caught.value) == f"src: {MSG_TRUNC}"
    path = raw_gguf(tmp_path / "m.gguf", [kv("x", 4, struct.pack("<I", 9))], [], 0, pad=False)
    with open(path, "rb") as handle:
        stream = hd._FileStream(handle, "src", path.stat().st_size)
        assert hd.parse_gguf_header(stream, "src", path.stat().st_size) == ({}, {"x": 9}) and stream.tell() == path.stat().st_size


def test_an_unreadable_file_is_one_line(tmp_path):
    with pytest.raises(CheckpointError) as caught:
        read_gguf_header(tmp_path)  # a folder: open() fails
    assert str(caught.value) == f"{tmp_path}: cannot read the file (Is a directory)"


# --- local folders and files ------------------------------------------------------------------------------

# llama.cpp's converter output (tests/engine/data): small, so a mutant that misreads a count reaches the end of the
# file at once (a sparse multi-GB file would keep it reading zeros for minutes).
MODEL_GGUF = _ROOT / "model.gguf"
shutil.copy(Path(__file__).parent / "data" / "llamacpp_qwen35_mtp_f16.gguf", MODEL_GGUF)
MODEL_KEYS, MODEL_REF = _reference(MODEL_GGUF)


@pytest.fixture(scope="module")
def model_gguf() -> Path:
    return MODEL_GGUF


def test_read_headers_of_a_gguf_file(model_gguf, monkeypatch):
    monkeypatch.setenv("HOME", str(model_gguf.parent))
    headers = read_headers("~/model.gguf")
    assert (headers.source, headers.format, headers.files) == ("~/model.gguf", "gguf", (str(model_gguf),))
    layers = MODEL_KEYS["qwen35.block_count"] - MODEL_KEYS["qwen35.nextn_predict_layers"]  # the MTP block is the last
    assert headers.file_bytes == model_gguf.stat().st_size and headers.config.num_hidden_layers == layers
    assert headers.tensors == MODEL_REF


def _write_split() -> list[Path]:
    folder = _ROOT / "split"
    folder.mkdir()
    writer = gguf.GGUFWriter(folder / "Model.gguf", "qwen35", split_max_tensors=3)
    for name, value, vtype in SCALAR_KEYS:
        writer.add_key_value(name, value, vtype)
    for i in range(7):
        writer.add_tensor(f"t{i}", np.full((i + 1, 32), i, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(folder.glob("*.gguf"))


SPLIT = _write_split()
SPLIT_REF = [_reference(p) for p in SPLIT]  # per part: keys, tensors


@pytest.fixture(scope="module")
def split_parts() -> list[Path]:
    return SPLIT


@pytest.fixture
def any_config(monkeypatch) -> list:
    """gguf_config (gguf_names.py, tested elsewhere) replaced: what it was given is kept, the file's name returned."""
    given = []
    monkeypatch.setattr(hd, "gguf_config", lambda meta, shapes, where: (given.append((meta, shapes, where)), where)[1])
    return given


def test_split_gguf_as_the_gguf_package_writes_and_reads_it(split_parts, any_config, tmp_path):
    parts, folder = split_parts, split_parts[0].parent
    assert [p.name for p in parts] == [f"Model-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    expected = {n: t for _, tensors in SPLIT_REF for n, t in tensors.items()}
    sizes = sum(part.stat().st_size for part in parts)
    first_keys = SPLIT_REF[0][0]
    for source in (parts[0], folder):
        headers = read_headers(str(source))
        assert headers.tensors == expected and headers.files == tuple(map(str, parts)) and headers.file_bytes == sizes
        assert headers.config == str(parts[0]) and headers.format == "gguf"
    assert any_config[0] == (first_keys, {n: t.shape for n, t in expected.items()}, str(parts[0])) == any_config[1]
    (tmp_path / parts[0].name).write_bytes(parts[0].read_bytes())
    (tmp_path / parts[2].name).write_bytes(parts[2].read_bytes())
    parts = [tmp_path / p.name for p in parts]
    with pytest.raises(CheckpointError) as caught:
        read_headers(str(parts[0]))
    assert str(caught.value) == f"{parts[0]}: split GGUF file Model-00002-of-00003.gguf is missing; download every part"


def test_which_gguf_in_a_folder_is_the_model(tmp_path, model_gguf):
    with pytest.raises(CheckpointError) as caught:
        read_headers(str(tmp_path))
    assert str(caught.value) == f"{tmp_path}: no config.json with safetensors and no .gguf file here; not a model"
    (tmp_path / "config.json").write_text("{}")  # a config.json without safetensors is not a safetensors model
    (tmp_path / "mmproj-F16.gguf").write_bytes(b"GGUF")
    (tmp_path / "Other-00002-of-00002.gguf").write_bytes(b"GGUF")
    (tmp_path / "Model.gguf").symlink_to(model_gguf)
    found = read_headers(str(tmp_path))
    assert (found.files, found.source, found.format) == ((str(tmp_path / "Model.gguf"),), str(tmp_path), "gguf")
    for name in ("a.gguf", "b-00001-of-00002.gguf", "c.gguf", "d.gguf", "e.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(CheckpointError) as caught:
        read_headers(str(tmp_path))
    assert str(caught.value) == (f"{tmp_path}: holds 6 GGUF models (Model.gguf, a.gguf, b-00001-of-00002.gguf, c.gguf, d.gguf, "
                                 "e.gguf); name the file you mean")
    (tmp_path / "f.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError) as caught:
        read_headers(str(tmp_path))
    assert str(caught.value) == (f"{tmp_path}: holds 7 GGUF models (Model.gguf, a.gguf, b-00001-of-00002.gguf, c.gguf, d.gguf, "
                                 "e.gguf, ...); name the file you mean")


def test_a_file_that_is_not_gguf_and_a_name_that_is_nothing(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError) as caught:
        read_headers(str(tmp_path / "model.bin"))
    assert str(caught.value) == f"{tmp_path / 'model.bin'}: not a .gguf file; pass a model folder or a GGUF file"
    for source in ("nothing-here", "a/b/c.txt", "a/b c", str(tmp_path / "missing")):
        with pytest.raises(DuetError) as caught:
            read_headers(source)
        assert str(caught.value) == f"{source}: no such file or folder, and not a hub repo id (owner/name)"


@pytest.fixture(scope="module")
def st_folder(made) -> Path:
    folder = made / "st"
    folder.mkdir(exist_ok=True)  # _ROOT outlives a test run under mutmut: each forked run writes it again
    rng = np.random.default_rng(3)
    safetensors.numpy.save_file({"w.a": rng.standard_normal((3, 4)).astype(np.float32), "w.b": np.arange(6, dtype=np.int8),
                                 "w.c": np.zeros((2, 2, 2), np.float16)}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(ho.config_27b()))
    return folder


def library_tensors(path: Path) -> dict[str, TensorInfo]:
    """dtype, shape and absolute byte range of each tensor: safe_open, and the u64 header length."""
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8:8 + n])
    out = {}
    with safetensors.safe_open(path, "np") as f:
        for name in f.keys():
            sl = f.get_slice(name)
            begin, end = header[name]["data_offsets"]
            out[name] = TensorInfo(name, sl.get_dtype(), tuple(sl.get_shape()), 8 + n + begin, 8 + n + end)
    return out


def test_a_safetensors_folder(st_folder):
    headers = read_headers(str(st_folder))
    path = st_folder / "model.safetensors"
    assert (headers.source, headers.format, headers.files, headers.file_bytes) == \
           (str(st_folder), "safetensors", (str(path),), path.stat().st_size)
    assert headers.tensors == library_tensors(path) and headers.config.num_hidden_layers == ho.LAYERS


# --- the hub: an in-process transport that answers as the hub does ------------------------------------------

class MockHub:
    """Serves `files` (name -> bytes) of repo o/r; `status` forces an answer; records every request."""

    def __init__(self, files: dict[str, bytes], ranges: bool = True, sizes: bool = True):
        self.files, self.ranges, self.sizes = files, ranges, sizes
        self.status: dict[str, int] = {}
        self.requests: list[httpx.Request] = []
        self.empty: set[str] = set()
        self.short: set[str] = set()  # answered one byte short of the range, the size still whole
        self.listing: bytes | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.raw_path.decode()
        if path.startswith("/api/models/"):
            body = self.listing if self.listing is not None else json.dumps({"siblings": [{"rfilename": f} for f in self.files]}).encode()
            return httpx.Response(self.status.get("listing", 200), content=body)
        prefix = "/o/r/resolve/"
        assert path.startswith(prefix), path
        name = path[len(prefix):].partition("/")[2]
        name = httpx.URL("http://x/" + name).path[1:]
        if name in self.status:
            return httpx.Response(self.status[name])
        data = self.files.get(name)
        if data is None:
            return httpx.Response(404)
        wanted = request.headers.get("range")
        if wanted and self.ranges:
            first, last = map(int, wanted.removeprefix("bytes=").split("-"))  # RFC 9110: both inclusive
            if first >= len(data):
                return httpx.Response(416)
            body = b"" if name in self.empty else data[first:last + 1 - (name in self.short and first > 0)]
            headers = {"content-range": f"bytes {first}-{first + len(body) - 1}/{len(data)}"} if self.sizes else {}
            return httpx.Response(206, headers=headers, content=body)
        if not self.sizes:
            return httpx.Response(200, content=iter([data]))  # streamed: no content-length
        return httpx.Response(200, headers={"content-length": str(len(data))}, content=data)

    def ranges_of(self, name: str) -> list[str | None]:
        return [r.headers.get("range") for r in self.requests if r.url.path.endswith("/" + name)]


@pytest.fixture
def serve(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://hub.test/")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    real = httpx.Client

    def start(hub: MockHub):
        class Client(real):
            def __init__(self, **kwargs):
                super().__init__(transport=httpx.MockTransport(hub), **kwargs)
        monkeypatch.setattr(httpx, "Client", Client)
        return hub
    return start


def folder_files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_remote_safetensors_fetch_the_length_and_the_header_exactly(st_folder, serve):
    hub = serve(MockHub(folder_files(st_folder)))
    headers = read_headers("o/r")
    path = st_folder / "model.safetensors"
    assert headers.tensors == library_tensors(path) and headers.file_bytes == path.stat().st_size
    assert (headers.source, headers.format, headers.files) == ("o/r", "safetensors", ("o/r/model.safetensors",))
    assert headers.config.num_hidden_layers == ho.LAYERS
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert [str(r.url) for r in hub.requests] == ["http://hub.test/api/models/o/r/revision/main",
                                                  "http://hub.test/o/r/resolve/main/config.json",
                                                  "http://hub.test/o/r/resolve/main/model.safetensors",
                                                  "http://hub.test/o/r/resolve/main/model.safetensors"]
    assert [r.headers.get("range") for r in hub.requests] == [None, None, "bytes=0-7", f"bytes=8-{8 + n - 1}"]
    assert all(r.headers["user-agent"] == "duet" and "authorization" not in r.headers for r in hub.requests)


def test_remote_shards_as_huggingface_hub_writes_them(tmp_path, serve):
    """Shards and index as huggingface_hub splits them (the sharding save_pretrained uses), each read by safe_open."""
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    state = {f"layer.{i}.w": np.arange(i * 40 + 40, dtype=np.float32).reshape(-1, 8) for i in range(6)} | \
            {"emb": np.ones((5, 3), np.float16)}
    split = split_state_dict_into_shards_factory(state, get_storage_size=lambda a: a.nbytes, max_shard_size=600,
                                                 filename_pattern="model{suffix}.safetensors")
    for filename, names in split.filename_to_tensors.items():
        safetensors.numpy.save_file({n: state[n] for n in names}, tmp_path / filename)
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(ho.config_27b()))
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    hub = serve(MockHub(folder_files(tmp_path)))
    headers = read_headers("o/r")
    assert len(shards) > 2 and headers.files == tuple(f"o/r/{name}" for name in shards)
    expected = {}
    for name in shards:
        expected |= library_tensors(tmp_path / name)
    assert headers.tensors == expected and set(expected) == set(weight_map) == set(state)
    assert headers.file_bytes == sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    assert hub.ranges_of("model.safetensors.index.json") == [None]


def test_remote_safetensors_without_an_index(tmp_path, serve):
    for name in ("b.safetensors", "a.safetensors"):
        safetensors.numpy.save_file({name: np.zeros(3, np.float32)}, tmp_path / name)
    (tmp_path / "sub").mkdir()
    safetensors.numpy.save_file({"sub": np.zeros(3, np.float32)}, tmp_path / "sub" / "c.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(ho.config_27b()))
    serve(MockHub(folder_files(tmp_path)))
    headers = read_headers("o/r")
    assert headers.files == ("o/r/a.safetensors", "o/r/b.safetensors") and set(headers.tensors) == {"a.safetensors", "b.safetensors"}
    safetensors.numpy.save_file({"one": np.zeros(2, np.float32)}, tmp_path / "model.safetensors")
    serve(MockHub(folder_files(tmp_path)))
    assert read_headers("o/r").files == ("o/r/model.safetensors",)


def test_remote_safetensors_refusals(st_folder, serve, monkeypatch):
    files = folder_files(st_folder)
    config = files["config.json"]

    def error(**changes) -> str:
        serve(MockHub({k: v for k, v in (files | changes).items() if v is not None}))
        with pytest.raises(DuetError) as caught:
            read_headers("o/r")
        return str(caught.value)

    assert error(**{"config.json": b"{"}) == "o/r/config.json: config.json is not valid JSON"
    assert error(**{"config.json": b"[" * 100_000 + b"]" * 100_000}) == "o/r/config.json: config.json is not valid JSON"
    assert error(**{"config.json": b"[1]"}) == "o/r/config.json: config.json must hold a JSON object"
    assert error(**{"config.json": b"{}"}).startswith("o/r/config.json: unknown model_type None; ")  # config.py's message, this file named
    assert error(**{hd.INDEX: b"{}"}) == "o/r/model.safetensors.index.json: index is not valid JSON with a weight_map; re-download the model"
    index = json.dumps({"weight_map": {"w": "model-2.safetensors"}}).encode()
    assert error(**{hd.INDEX: index}) == "o/r/model.safetensors.index.json: names shard 'model-2.safetensors', which the repo does not have"
    data = files["model.safetensors"]
    assert error(**{"model.safetensors": data[:5]}) == "o/r/model.safetensors: file is truncated before its header"
    corrupt = data[:8] + b"{not json" + data[17:]
    assert error(**{"model.safetensors": corrupt}) == "o/r/model.safetensors: header is not valid JSON; the file is corrupt, re-download it"
    n = struct.unpack("<Q", data[:8])[0]
    assert error(**{"model.safetensors": data[:8 + n - 1]}).startswith("o/r/model.safetensors: ")
    padded = config + b" " * ((1 << 20) - len(config))  # 1 MiB of valid JSON
    monkeypatch.setattr(hd, "MAX_JSON_BYTES", 1 << 20)
    serve(MockHub(files | {"config.json": padded}))
    assert read_headers("o/r").format == "safetensors"  # exactly the limit is read
    assert error(**{"config.json": padded + b" "}) == "o/r/config.json: larger than 1 MiB; not a config or index file"
    monkeypatch.setattr(hd, "MAX_JSON_BYTES", 20)  # a listing past the limit is cut, and fails to parse
    assert error() == "o/r: http://hub.test answered the file listing with something that is not the hub's JSON"


def test_a_header_cut_inside_is_refused(serve):
    data = safetensors.numpy.save({"w": np.zeros(4, np.float32)})
    hub = MockHub({"config.json": json.dumps(ho.config_27b()).encode(), "model.safetensors": data})
    hub.short.add("model.safetensors")
    serve(hub)
    with pytest.raises(CheckpointError) as caught:
        read_headers("o/r")
    assert str(caught.value) == "o/r/model.safetensors: file ends inside its header; it is truncated"


def test_answers_of_the_hub(st_folder, serve, monkeypatch):
    files = folder_files(st_folder)

    def error(status: dict[str, int], spec: str = "o/r") -> str:
        hub = MockHub(files)
        hub.status = status
        serve(hub)
        with pytest.raises(DuetError) as caught:
            read_headers(spec)
        return str(caught.value)

    for code in (401, 403):
        assert error({"config.json": code}) == (f"o/r/config.json: the hub refused access (HTTP {code}); the repo is gated or "
                                                "private: accept its terms and set HF_TOKEN")
    assert error({"listing": 404}) == "o/r: not found on http://hub.test at revision main"
    assert error({"model.safetensors": 416}) == "o/r/model.safetensors: the file is shorter than its header says; it is truncated"
    assert error({"model.safetensors": 500}) == "o/r/model.safetensors: http://hub.test answered HTTP 500; try again later"
    assert error({"model.safetensors": 302}) == "o/r/model.safetensors: http://hub.test answered HTTP 302; try again later"
    for body in (b"not json", b"{}", b'{"siblings": [{"rfilename": 3}]}', b'{"siblings": 3}', b"[" * 100_000):
        hub = MockHub(files)
        hub.listing = body
        serve(hub)
        with pytest.raises(DuetError) as caught:
            read_headers("o/r")
        assert str(caught.value) == "o/r: http://hub.test answered the file listing with something that is not the hub's JSON"

    def unreachable(request):
        raise httpx.ConnectError("refused")
    serve(unreachable)
    with pytest.raises(DuetError) as caught:
        read_headers("o/r")
    assert str(caught.value) == "o/r: cannot reach http://hub.test (ConnectError); check the network or HF_ENDPOINT"


def test_token_revision_and_endpoint(st_folder, serve, monkeypatch):
    hub = serve(MockHub(folder_files(st_folder)))
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    read_headers("o/r", revision="refs/pr/1")
    assert {r.headers.get("authorization") for r in hub.requests} == {"Bearer hf_secret"}
    assert str(hub.requests[0].url) == "http://hub.test/api/models/o/r/revision/refs%2Fpr%2F1"
    assert str(hub.requests[1].url) == "http://hub.test/o/r/resolve/refs%2Fpr%2F1/config.json"
    monkeypatch.delenv("HF_ENDPOINT")
    hub = serve(MockHub(folder_files(st_folder)))
    read_headers("o/r")
    assert str(hub.requests[0].url) == "https://huggingface.co/api/models/o/r/revision/main"


def test_redirects_are_followed_and_the_token_stays_home(st_folder, serve, monkeypatch):
    files = folder_files(st_folder)
    inner = MockHub(files)

    def hub(request):
        if request.url.host == "hub.test" and request.url.path.endswith(".safetensors"):
            inner.requests.append(request)
            return httpx.Response(302, headers={"location": str(request.url.copy_with(host="cdn.test"))})
        return inner(request)
    serve(hub)
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert read_headers("o/r").tensors == library_tensors(st_folder / "model.safetensors")
    cdn = [r for r in inner.requests if r.url.host == "cdn.test"]
    assert len(cdn) == 2 and all("authorization" not in r.headers for r in cdn)


def test_a_server_that_ignores_ranges(st_folder, serve):
    hub = serve(MockHub(folder_files(st_folder), ranges=False))
    assert read_headers("o/r").tensors == library_tensors(st_folder / "model.safetensors")
    assert hub.ranges_of("model.safetensors")[0] == "bytes=0-7"


# --- GGUF on the hub ------------------------------------------------------------------------------------

# A GGUF whose header is about 40 KB: with a 1 KiB first block and an 8 KiB cap, the blocks double and cap.
BIG = write_with_gguf(_ROOT / "big.gguf", keys=SCALAR_KEYS + [("long", "L" * 20_000, T.STRING),
                                                              ("a.strs", [f"t{i}" for i in range(2000)], T.STRING)])
BIG_REF = _reference(BIG)[1]


@pytest.fixture(scope="module")
def big_header() -> Path:
    return BIG


def test_remote_gguf_reads_in_doubling_blocks(big_header, serve, monkeypatch, any_config):
    monkeypatch.setattr(hd, "FIRST_BLOCK", 1024)
    monkeypatch.setattr(hd, "MAX_BLOCK", 8192)
    data = big_header.read_bytes()
    hub = serve(MockHub({"q/Model.gguf": data, "README.md": b"x"}))
    headers = read_headers("o/r/q/Model.gguf")
    assert headers.tensors == BIG_REF
    assert (headers.files, headers.file_bytes, headers.source) == (("o/r/q/Model.gguf",), len(data), "o/r/q/Model.gguf")
    spans = [tuple(map(int, r.removeprefix("bytes=").split("-"))) for r in hub.ranges_of("Model.gguf")]
    assert spans[0] == (0, 1023) and all(b[0] == a[1] + 1 for a, b in zip(spans, spans[1:]))
    lengths = [last - first + 1 for first, last in spans]
    # doubling from 1 KiB, capped at 8 KiB; the 20 kB string is fetched in one request of what it needs
    header_end = min(t.begin for t in headers.tensors.values())
    assert spans[-1][1] < len(data) and spans[-1][1] + 1 >= header_end - 32
    string_end = data.index(b"L" * 20_000) + 20_000
    assert lengths[1] == string_end - 1024  # one request of what the string needs, more than the block (2 KiB)
    assert lengths[2:4] == [4096, 8192] and set(lengths[4:-1]) == {8192} and len(lengths) > 5
    assert lengths[-1] == 8192 or spans[-1][1] == len(data) - 1


def test_remote_gguf_near_the_end_of_the_file(tmp_path, serve, monkeypatch, any_config):
    monkeypatch.setattr(hd, "FIRST_BLOCK", 128)
    path = raw_gguf(tmp_path / "m.gguf", [kv("x", 8, s("v" * 100))], [ti("t", (4,), Q.F32, 0)], 16)
    data = path.read_bytes()
    hub = serve(MockHub({"m.gguf": data}))
    assert read_headers("o/r/m.gguf").tensors == read_gguf_header(path)[0] == \
        reader_tensors(gguf.GGUFReader(path))
    spans = [tuple(map(int, r.removeprefix("bytes=").split("-"))) for r in hub.ranges_of("m.gguf")]
    assert len(data) < 128 + 256 and spans == [(0, 127), (128, len(data) - 1)]  # the second block would pass the end: only what is there


def test_remote_gguf_refusals(big_header, serve, monkeypatch, any_config):
    data = big_header.read_bytes()

    def error(spec="o/r", **kw) -> str:
        hub = MockHub({"Model.gguf": data}, **kw)
        serve(hub)
        with pytest.raises(DuetError) as caught:
            read_headers(spec)
        return str(caught.value)

    assert error(sizes=False, ranges=False) == "o/r/Model.gguf: the server did not say how large the file is"
    assert error("o/r/x.gguf") == "o/r: has no file x.gguf at revision main"
    assert error("o/r/../x.gguf") == "o/r/../x.gguf: a file path in a repo may not contain '..'"
    monkeypatch.setattr(hd, "FIRST_BLOCK", 1024)
    hub = MockHub({"Model.gguf": data})
    hub.empty.add("Model.gguf")
    serve(hub)
    with pytest.raises(DuetError) as caught:
        read_headers("o/r")
    assert str(caught.value) == "o/r/Model.gguf: the server sent nothing for a range inside the file"


def test_remote_split_gguf_and_patterns(split_parts, big_header, serve, any_config):
    parts = split_parts
    files = {f"Q8/{p.name}": p.read_bytes() for p in parts} | {"Q4/Other.gguf": big_header.read_bytes()}
    serve(MockHub(files))
    headers = read_headers("o/r", patterns=("Q8/*",))
    expected = {n: t for _, tensors in SPLIT_REF for n, t in tensors.items()}
    assert headers.tensors == expected and headers.config == f"o/r/Q8/{parts[0].name}"
    assert headers.files == tuple(f"o/r/Q8/{p.name}" for p in parts) and headers.file_bytes == sum(p.stat().st_size for p in parts)
    assert any_config[0][0] == SPLIT_REF[0][0]
    serve(MockHub(files))
    assert read_headers("o/r", patterns=("Q4/*", "nothing")).files == ("o/r/Q4/Other.gguf",)
    serve(MockHub(files))
    with pytest.raises(CheckpointError) as caught:
        read_headers("o/r")
    assert str(caught.value) == f"o/r: holds 2 GGUF models (Q4/Other.gguf, Q8/{parts[0].name}); name the file you mean"


# --- the HF folder reader (engine/checkpoint/hf.py) against transformers' own files ---------------------------
# Built once when the module is imported (mutmut's forkserver imports it once per run): each folder is what
# transformers' save_pretrained writes for a tiny random model; the reference values are read back with safe_open.

import torch  # noqa: E402
from conftest import add_random_mtp_head, build_reference, split_fused_experts  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from duet.engine.checkpoint.hf import TensorPlan, checkpoint_name, qwen3_next_rows, read_weights  # noqa: E402
from duet.engine.checkpoint.safetensors import SafetensorsCheckpoint  # noqa: E402
from duet.engine.config import ModelConfig  # noqa: E402




def _save(name: str, kind: str, split: bool = False, mtp: bool = False, fused: bool = False, **overrides) -> Path:
    folder = _ROOT / name
    model = build_reference(kind, **overrides)
    model.save_pretrained(folder)
    if fused:  # the experts as transformers holds them, [E, ...] tensors (as some hub checkpoints store them)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors", metadata={"format": "pt"})
    if split:
        split_fused_experts(folder)
    if mtp:
        add_random_mtp_head(folder, model.model if hasattr(model.model, "layers") else model.model.language_model, seed=1)
    return folder


HF = {"text": _save("text", "qwen3_5_text"), "mm_tied": _save("mm", "qwen3_5", tie=True),
      "moe_fused": _save("moe", "qwen3_5_moe_text", fused=True), "moe_split": _save("moes", "qwen3_5_moe", split=True),
      "next": _save("next", "qwen3_next"), "mtp": _save("mtp", "qwen3_5_text", mtp=True),
      "h128": _save("h128", "qwen3_5_text", hidden_size=128)}


def open_hf(folder: Path) -> tuple[SafetensorsCheckpoint, ModelConfig]:
    return SafetensorsCheckpoint(folder), ModelConfig.from_file(folder / "config.json")


def saved(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in folder.glob("*.safetensors"):
        out |= load_file(path)
    return out


def model_keys(names, prefix: str) -> dict[str, str]:
    """Checkpoint name -> model key for every text-model tensor a checkpoint holds (the vision tower aside)."""
    return {n: n.removeprefix(prefix) for n in names if not n.startswith("model.visual.")}


@pytest.mark.parametrize("name, prefix, fused, mtp", [("text", "model.", False, False), ("mm_tied", "model.language_model.", False, False),
                                                      ("moe_fused", "model.", True, False), ("moe_split", "model.language_model.", False, False),
                                                      ("mtp", "model.", False, True)])
def test_read_weights_gives_every_saved_tensor_by_model_key(name, prefix, fused, mtp):
    ckpt, config = open_hf(HF[name])
    calls = []
    weights = read_weights(ckpt, config, lambda done, total: calls.append((done, total)))
    reference = saved(HF[name])
    keys = model_keys(reference, prefix)
    assert set(weights.tensors) == set(keys.values())
    for checkpoint_key, key in keys.items():
        value = weights.tensors[key]
        assert value.dtype == np.float32 and np.array_equal(value, reference[checkpoint_key].float().numpy()), key
    assert (weights.has_mtp, weights.fused_experts, weights.config) == (mtp, fused, config)
    sizes = [t.numel() * t.element_size() for t in (reference[n] for n in keys)]
    assert [total for _, total in calls] == [sum(sizes)] * len(keys) and calls[-1][0] == sum(sizes)
    assert sorted(done for done, _ in calls) == [done for done, _ in calls] and len({d for d, _ in calls}) == len(keys)
    assert "lm_head.weight" in weights.tensors or config.tie_word_embeddings


def test_without_progress_and_mtp_layers_the_file_lacks():
    ckpt, config = open_hf(HF["text"])
    assert set(read_weights(ckpt, config).tensors) == set(model_keys(saved(HF["text"]), "model.").values())
    stated = ModelConfig.from_dict(json.loads((HF["text"] / "config.json").read_text()) | {"mtp_num_hidden_layers": 1})
    assert not TensorPlan(ckpt, stated).has_mtp  # config.json promises an MTP head the files do not have
    ckpt, config = open_hf(HF["mtp"])
    assert not TensorPlan(ckpt, ModelConfig.from_dict(json.loads((HF["mtp"] / "config.json").read_text()) | {"mtp_num_hidden_layers": 0})).has_mtp
    assert TensorPlan(ckpt, config, quantized=FakeQuantized(["mtp.fc.weight"])).has_mtp


def test_qwen3_next_projections_split_as_transformers_orders_them():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    folder = HF["next"]
    ckpt, config = open_hf(folder)
    weights = read_weights(ckpt, config)
    reference = saved(folder)
    deltanet = [i for i, kind in enumerate(config.layer_types) if kind != "full_attention"]
    hf_config = __import__("transformers").AutoConfig.from_pretrained(folder)
    net = Qwen3NextGatedDeltaNet(hf_config, layer_idx=deltanet[0])
    for i in deltanet:
        p = f"model.layers.{i}.linear_attn."
        qkvz, ba = reference[p + "in_proj_qkvz.weight"], reference[p + "in_proj_ba.weight"]
        # rows of the weight are the projection's outputs: feed the transposed weight as a [1, H, rows] "activation"
        q, k, v, z, b, a = net.fix_query_key_value_ordering(qkvz.T[None], ba.T[None])
        flat = lambda t: t.reshape(t.shape[1], -1).T.numpy()  # noqa: E731
        key = f"layers.{i}.linear_attn."
        assert np.array_equal(weights.tensors[key + "in_proj_qkv.weight"], np.concatenate([flat(q), flat(k), flat(v)]))
        assert np.array_equal(weights.tensors[key + "in_proj_z.weight"], flat(z))
        assert np.array_equal(weights.tensors[key + "in_proj_b.weight"], flat(b))
        assert np.array_equal(weights.tensors[key + "in_proj_a.weight"], flat(a))
        assert key + "in_proj_qkvz.weight" not in weights.tensors and key + "in_proj_ba.weight" not in weights.tensors
    others = {n.removeprefix("model."): t for n, t in reference.items() if "in_proj_qkvz" not in n and "in_proj_ba" not in n}
    assert set(weights.tensors) == set(others) | {f"layers.{i}.linear_attn.in_proj_{x}.weight" for i in deltanet for x in "qkv z b a".split()}
    for key, value in others.items():
        assert np.array_equal(weights.tensors[key], value.float().numpy()), key
    (qkv, z), (b, a) = qwen3_next_rows(config)
    assert len(qkv) + len(z) == reference[f"model.layers.{deltanet[0]}.linear_attn.in_proj_qkvz.weight"].shape[0]


def test_checkpoint_names():
    assert checkpoint_name("layers.1.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"
    assert checkpoint_name("norm.weight", "model.language_model.") == "model.language_model.norm.weight"
    assert checkpoint_name("mtp.fc.weight", "x.") == "mtp.fc.weight" and checkpoint_name("lm_head.weight", "x.") == "lm_head.weight"
    assert checkpoint_name("lm_headx", "x.") == "x.lm_headx" and checkpoint_name("mtpx", "x.") == "x.mtpx"


def rewritten(tmp_path: Path, name: str, change) -> SafetensorsCheckpoint:
    """The saved folder with its tensors changed by `change(dict)`, written by safetensors' save_file."""
    folder = tmp_path / name
    folder.mkdir()
    tensors = saved(HF[name])
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text((HF[name] / "config.json").read_text())
    return folder


def hf_refused(folder: Path, **kw) -> str:
    ckpt, config = open_hf(folder)
    with pytest.raises(CheckpointError) as caught:
        read_weights(ckpt, config, **kw)
    return str(caught.value)


def test_what_the_headers_refuse(tmp_path):
    name = "model.layers.3.self_attn.k_proj.weight"
    folder = rewritten(tmp_path, "text", lambda t: t.pop(name))
    assert hf_refused(folder) == f"{folder}: tensor {name} is missing; the checkpoint is incomplete or not a qwen3_5_text model"
    folder = rewritten(tmp_path, "mm_tied", lambda t: t.update({"model.language_model.norm.weight": torch.zeros(65)}))
    assert hf_refused(folder) == (f"{folder / 'model.safetensors'}: tensor model.language_model.norm.weight has shape [65], "
                                  "config.json implies [64]; the files do not belong together")
    for dtype, shown in ((torch.int32, "I32"), (torch.float64, "F64")):
        folder = tmp_path / f"d{shown}"
        (tmp_path / f"x{shown}").mkdir()
        folder = rewritten(tmp_path / f"x{shown}", "text", lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(dtype)})) \
            if False else _retyped(tmp_path / f"x{shown}", dtype)
        assert hf_refused(folder) == (f"{folder / 'model.safetensors'}: tensor model.norm.weight is {shown}; "
                                      "this reader takes bf16/fp16/fp32 weights")
    for dtype in (torch.float16, torch.float32, torch.bfloat16):
        folder = _retyped(tmp_path / f"ok{dtype}".replace(".", "_"), dtype)
        ckpt, config = open_hf(folder)
        assert np.array_equal(read_weights(ckpt, config).tensors["norm.weight"], saved(HF["text"])["model.norm.weight"].to(dtype).float().numpy())


def _retyped(where: Path, dtype) -> Path:
    where.mkdir(exist_ok=True)
    return rewritten(where, "text", lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(dtype)}))


class FakeQuantized(dict):
    """What TensorPlan asks of the INT4 modules: membership, check, nbytes and read (quantized.py's interface)."""

    def __init__(self, names, nbytes=1000):
        super().__init__({n: None for n in names})
        self.checked, self.size = {}, nbytes

    def check(self, name, shape):
        self.checked[name] = shape

    def nbytes(self, name):
        return self.size

    def read(self, name):
        return ("w4", name)


def test_host_tables_and_quantized_modules(tmp_path):
    ckpt, config = open_hf(HF["text"])
    with pytest.raises(CheckpointError) as caught:
        read_weights(ckpt, config, host_tables=True)
    assert str(caught.value) == (f"{HF['text'] / 'model.safetensors'}: --host-tables needs a hidden size that is a multiple of 128 "
                                 "for its int4 head (this model's is 64); run without it")
    ckpt, config = open_hf(HF["h128"])
    assert read_weights(ckpt, config, host_tables=True).tensors["lm_head.weight"].shape == (config.vocab_size, 128)
    quantized = FakeQuantized(["lm_head.weight", "model.layers.0.mlp.up_proj.weight"])
    with pytest.raises(CheckpointError) as caught:
        read_weights(ckpt, config, quantized=quantized, host_tables=True)
    assert str(caught.value) == (f"{HF['h128'] / 'model.safetensors'}: --host-tables rescores with the float head, but lm_head.weight "
                                 "is stored quantized here; run without --host-tables")
    ckpt, config = open_hf(HF["mm_tied"])
    tied = FakeQuantized(["model.language_model.embed_tokens.weight"])
    with pytest.raises(CheckpointError, match="but model.language_model.embed_tokens.weight is stored quantized"):
        read_weights(ckpt, config, quantized=tied, host_tables=True)
    ckpt, config = open_hf(HF["text"])
    up = "model.layers.0.mlp.up_proj.weight"
    quantized = FakeQuantized([up])
    calls = []
    weights = read_weights(ckpt, config, lambda d, t: calls.append(t), quantized=quantized)
    assert weights.tensors["layers.0.mlp.up_proj.weight"] == ("w4", up)
    assert quantized.checked == {up: (config.intermediate_size, config.hidden_size)}
    reference = saved(HF["text"])
    assert calls[0] == sum(t.numel() * t.element_size() for n, t in reference.items() if n != up) + 1000


# --- the INT4 readers (engine/checkpoint/quantized.py) against compressed-tensors' own packing -----------------
# Layouts (REFERENCE.md section 2): compressed-tensors weight_packed int32 [N, K/8], 8 values along K per word,
# value i at bits 4i, stored +8; GPTQ qweight int32 [K/8, N] packed along K, scales [K/g, N], qzeros [K/g, N/8].
# Both are packed here by compressed_tensors' pack_to_int32 (packed_dim 1 and 0) and unpacked by its
# unpack_from_int32; the dequantized weight is scale x level, restated in plain numpy.

from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402

from duet.engine.checkpoint.quantized import GPTQ, CompressedTensors, read_quantization  # noqa: E402

QN, QK = 16, 512


def ct_pack(levels: np.ndarray) -> np.ndarray:
    return pack_to_int32(torch.from_numpy(levels.astype(np.int8)), 4).numpy()


def gptq_pack(levels_kn: np.ndarray) -> np.ndarray:
    return pack_to_int32(torch.from_numpy(levels_kn.astype(np.int8)), 4, packed_dim=0).numpy()


def ct_levels(packed: np.ndarray, shape) -> np.ndarray:
    return unpack_from_int32(torch.from_numpy(packed), 4, torch.Size(shape)).numpy().astype(np.int64)


def bf16_exact(shape, seed) -> np.ndarray:
    values = np.random.default_rng(seed).uniform(1e-3, 2e-2, shape).astype(np.float32)
    return (values.view(np.uint32) & 0xFFFF0000).view(np.float32)  # bf16 holds these exactly


def levels_of(seed, shape) -> np.ndarray:
    return np.random.default_rng(seed).integers(-8, 8, shape)


CT = {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128}}}}
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}


def int4_folder(where: Path, tensors: dict, quant: dict | None, nest: bool = False) -> tuple[Path, SafetensorsCheckpoint]:
    where.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(tensors, where / "model.safetensors")
    config = {} if quant is None else ({"text_config": {"quantization_config": quant}} if nest else {"quantization_config": quant})
    (where / "config.json").write_text(json.dumps(config))
    return where, SafetensorsCheckpoint(where)


def ct_tensors(levels, scale, prefix="m", shape=None) -> dict:
    return {f"{prefix}.weight_packed": ct_pack(levels), f"{prefix}.weight_scale": scale,
            f"{prefix}.weight_shape": np.array(shape or levels.shape, np.int64)}


@pytest.mark.parametrize("group", [128, 256, 512])
def test_compressed_tensors_read_as_compressed_tensors_unpacks(tmp_path, group):
    levels, scale = levels_of(1, (QN, QK)), bf16_exact((QN, QK // group), 2)
    tensors = ct_tensors(levels, scale) | {"n.weight": np.ones(4, np.float32)}
    folder, ckpt = int4_folder(tmp_path, tensors, CT)
    modules = read_quantization(folder, ckpt)
    assert type(modules) is CompressedTensors and modules.description == "INT4 compressed-tensors"
    assert modules.routes == ("w4a16", "w4a8", "bf16")
    assert "m.weight" in modules and "n.weight" not in modules and "m.weight_packed" not in modules and "x.weight" not in modules
    modules.check("m.weight", (QN, QK))
    w4 = modules.read("m.weight")
    assert np.array_equal(w4.levels(), ct_levels(tensors["m.weight_packed"], (QN, QK)))
    assert np.array_equal(w4.dequantize(), np.repeat(scale, group, axis=1) * levels)
    assert modules.nbytes("m.weight") == sum(tensors[f"m.{s}"].nbytes for s in ("weight_packed", "weight_scale", "weight_shape"))


def test_fp16_scales_round_to_bf16(tmp_path):
    levels = levels_of(3, (QN, QK))
    scale = np.random.default_rng(4).uniform(1e-3, 2e-2, (QN, QK // 128)).astype(np.float16)
    folder, ckpt = int4_folder(tmp_path, ct_tensors(levels, scale), CT | {"quant_method": "compressed_tensors"})
    w4 = read_quantization(folder, ckpt).read("m.weight")
    bf16 = torch.from_numpy(scale.astype(np.float32)).to(torch.bfloat16).float().numpy()  # torch's round to bf16
    assert np.array_equal(w4.dequantize(), np.repeat(bf16, 128, axis=1) * levels)


def gptq_tensors(levels_kn, scales, stored_zero: int, prefix="m", g_idx=True) -> dict:
    groups = scales.shape[0]
    zeros = np.full((groups, levels_kn.shape[1]), stored_zero - 8)
    out = {f"{prefix}.qweight": gptq_pack(levels_kn), f"{prefix}.scales": scales, f"{prefix}.qzeros": ct_pack(zeros)}
    if g_idx:
        out[f"{prefix}.g_idx"] = (np.arange(levels_kn.shape[0]) // (levels_kn.shape[0] // groups)).astype(np.int32)
    return out


@pytest.mark.parametrize("quant, stored_zero, nest", [
    (GPTQ_CONFIG, 7, False), (GPTQ_CONFIG | {"checkpoint_format": "gptq_v2"}, 8, False),
    ({"quant_method": "auto-round", "bits": 4, "sym": True, "packing_format": "auto_round:auto_gptq"}, 7, True)])
def test_gptq_read_as_its_layout_says(tmp_path, quant, stored_zero, nest):
    levels_kn, scales = levels_of(5, (QK, QN)), bf16_exact((QK // 128, QN), 6).astype(np.float16)
    tensors = gptq_tensors(levels_kn, scales, stored_zero)
    folder, ckpt = int4_folder(tmp_path, tensors, quant, nest)
    modules = read_quantization(folder, ckpt)
    assert type(modules) is GPTQ and modules.description == "INT4 GPTQ" and modules.stored_zero == stored_zero
    modules.check("m.weight", (QN, QK))
    w4 = modules.read("m.weight")
    assert np.array_equal(w4.levels(), levels_kn.T)
    assert np.array_equal(w4.dequantize(), (np.repeat(scales.astype(np.float32), 128, axis=0) * levels_kn).T)
    assert modules.nbytes("m.weight") == sum(a.nbytes for a in tensors.values())
    # without g_idx (AutoRound leaves it out) the module reads the same
    folder, ckpt = int4_folder(tmp_path / "nog", gptq_tensors(levels_kn, scales, stored_zero, g_idx=False), quant, nest)
    modules = read_quantization(folder, ckpt)
    modules.check("m.weight", (QN, QK))
    assert np.array_equal(modules.read("m.weight").dequantize(), w4.dequantize())


def quant_refused(tmp_path, quant, tensors=None, nest=False) -> str:
    folder, ckpt = int4_folder(tmp_path, tensors or {"x": np.zeros(1, np.float32)}, quant, nest)
    with pytest.raises(CheckpointError) as caught:
        read_quantization(folder, ckpt)
    return str(caught.value).removeprefix(f"{folder / 'config.json'}: ")


def test_quantization_configs(tmp_path):
    assert read_quantization(*int4_folder(tmp_path / "none", {"x": np.zeros(1, np.float32)}, None)) is None
    assert read_quantization(*int4_folder(tmp_path / "empty", {"x": np.zeros(1, np.float32)}, {})) is None
    assert quant_refused(tmp_path / "awq", {"quant_method": "awq", "bits": 4}) == \
        "quantization 'awq' (gptq) is not supported; duet reads compressed-tensors pack-quantized, GPTQ and AutoRound auto_gptq INT4"
    assert quant_refused(tmp_path / "ar", {"quant_method": "auto-round", "packing_format": "auto_round:auto_awq"}) == \
        "quantization 'auto-round' (auto_round:auto_awq) is not supported; duet reads compressed-tensors pack-quantized, GPTQ and AutoRound auto_gptq INT4"
    assert quant_refused(tmp_path / "nomethod", {"bits": 4}) == \
        "quantization '' (gptq) is not supported; duet reads compressed-tensors pack-quantized, GPTQ and AutoRound auto_gptq INT4"
    assert quant_refused(tmp_path / "fmt", CT | {"format": "float-quantized"}) == \
        "compressed-tensors format 'float-quantized' is not supported; duet reads pack-quantized INT4"
    assert quant_refused(tmp_path / "nofmt", {"quant_method": "compressed-tensors"}) == \
        "compressed-tensors format None is not supported; duet reads pack-quantized INT4"
    for i, weights in enumerate([{"num_bits": 8, "symmetric": True}, {"num_bits": 4, "symmetric": False}, {"num_bits": 4},
                                 {"num_bits": 4, "symmetric": True, "type": "float"}, {}]):
        groups = {"g": {"weights": weights}} if weights else {"g": {}}
        assert quant_refused(tmp_path / f"g{i}", CT | {"config_groups": groups}) == \
            "config group g is not symmetric 4-bit int weights; duet reads symmetric INT4"
    folder, ckpt = int4_folder(tmp_path / "groups", {"x": np.zeros(1, np.float32)}, CT | {"config_groups": None}, nest=True)
    assert type(read_quantization(folder, ckpt)) is CompressedTensors
    ok = {"num_bits": 4, "symmetric": True}  # type defaults to int
    folder, ckpt = int4_folder(tmp_path / "deftype", {"x": np.zeros(1, np.float32)}, CT | {"config_groups": {"g": {"weights": ok}}})
    assert type(read_quantization(folder, ckpt)) is CompressedTensors
    for i, quant in enumerate([GPTQ_CONFIG | {"bits": 8}, GPTQ_CONFIG | {"sym": False}, {"quant_method": "gptq"}]):
        assert quant_refused(tmp_path / f"q{i}", quant) == "GPTQ weights must be symmetric 4-bit (bits 4, sym true) for duet"
    assert quant_refused(tmp_path / "act", GPTQ_CONFIG | {"desc_act": True}) == \
        "GPTQ with desc_act (act-order) is not supported; use a desc_act false checkpoint"
    folder, ckpt = int4_folder(tmp_path / "nosym", {"x": np.zeros(1, np.float32)}, {"quant_method": "gptq", "bits": 4})
    assert type(read_quantization(folder, ckpt)) is GPTQ and read_quantization(folder, ckpt).stored_zero == 7


def int4_refused(modules, name="m.weight", shape=(QN, QK)) -> str:
    with pytest.raises(CheckpointError) as caught:
        modules.check(name, shape)
    return str(caught.value)


def test_compressed_tensors_that_do_not_fit(tmp_path):
    levels, scale = levels_of(7, (QN, QK)), bf16_exact((QN, QK // 128), 8)
    good = ct_tensors(levels, scale)

    def modules(name, **changes):
        tensors = {k: v for k, v in (good | changes).items() if v is not None}
        folder, ckpt = int4_folder(tmp_path / name, tensors, CT)
        return read_quantization(folder, ckpt), folder / "model.safetensors"

    m, path = modules("shape")
    assert int4_refused(m, shape=(QN, QK + 8)) == f"{path}: tensor m.weight_packed holds a [{QN}, {QK}] weight, the config implies [{QN}, {QK + 8}]"
    assert int4_refused(m, shape=(QN + 1, QK)).endswith(f"holds a [{QN}, {QK}] weight, the config implies [{QN + 1}, {QK}]")
    m, path = modules("f32", **{"m.weight_packed": good["m.weight_packed"].astype(np.float32)})
    assert int4_refused(m) == f"{path}: tensor m.weight_packed is F32 [{QN}, {QK // 8}]; expected int32 [N, K/8]"
    m, path = modules("3d", **{"m.weight_packed": good["m.weight_packed"][None]})
    assert int4_refused(m) == f"{path}: tensor m.weight_packed is I32 [1, {QN}, {QK // 8}]; expected int32 [N, K/8]"
    m, path = modules("u32", **{"m.weight_packed": good["m.weight_packed"].view(np.uint32)})
    m.check("m.weight", (QN, QK))
    assert np.array_equal(m.read("m.weight").levels(), levels)
    m, path = modules("stated", **{"m.weight_shape": np.array([QN, QK - 8], np.int32)})
    assert int4_refused(m) == f"{path}: tensor m.weight_shape says [{QN}, {QK - 8}] but weight_packed holds [{QN}, {QK}]"
    for name, bad in (("s3", bf16_exact((QN, 3), 1)), ("s64", bf16_exact((QN, QK // 64), 1)), ("s1d", bf16_exact((QN,), 1)),
                      ("srows", bf16_exact((QN + 1, 4), 1))):
        m, path = modules(name, **{"m.weight_scale": bad})
        assert int4_refused(m) == (f"{path}: tensor m.weight_scale has shape {list(bad.shape)}, which does not match its {QK}-input "
                                   "weights in groups of a multiple of 128: the scales do not match the weights")
    m, path = modules("noscale", **{"m.weight_scale": None})
    assert int4_refused(m) == f"{tmp_path / 'noscale'}: tensor m.weight_scale is missing; the INT4 checkpoint is incomplete"
    m, path = modules("noshape", **{"m.weight_shape": None})
    with pytest.raises(KeyError):
        m.check("m.weight", (QN, QK))


def test_gptq_that_does_not_fit(tmp_path):
    levels_kn, scales = levels_of(9, (QK, QN)), bf16_exact((QK // 128, QN), 10).astype(np.float16)
    good = gptq_tensors(levels_kn, scales, 8)

    def modules(name, **changes):
        tensors = {k: v for k, v in (good | changes).items() if v is not None}
        folder, ckpt = int4_folder(tmp_path / name, tensors, GPTQ_CONFIG | {"checkpoint_format": "gptq_v2"})
        return read_quantization(folder, ckpt), folder / "model.safetensors"

    m, path = modules("shape")
    assert int4_refused(m, shape=(QN, QK * 2)) == f"{path}: tensor m.qweight holds a [{QN}, {QK}] weight, the config implies [{QN}, {QK * 2}]"
    assert int4_refused(m, shape=(QN * 2, QK)).endswith(f"holds a [{QN}, {QK}] weight, the config implies [{QN * 2}, {QK}]")
    m, path = modules("f16", **{"m.qweight": np.zeros(good["m.qweight"].shape, np.float16)})  # its words do not fit f16: only the type matters
    assert int4_refused(m) == f"{path}: tensor m.qweight is F16 [{QK // 8}, {QN}]; expected int32 [K/8, N]"
    m, path = modules("1d", **{"m.qweight": good["m.qweight"].reshape(-1)})
    assert int4_refused(m) == f"{path}: tensor m.qweight is I32 [{QK // 8 * QN}]; expected int32 [K/8, N]"
    m, path = modules("scales", **{"m.scales": scales.T.copy()})
    assert int4_refused(m) == (f"{path}: tensor m.scales has shape [{QN}, {QK // 128}], which does not match its {QK}-input "
                               "weights in groups of a multiple of 128: the scales do not match the weights")
    asym = np.full((QK // 128, QN), 0)
    asym[1, 5] = -3
    m, path = modules("zeros", **{"m.qzeros": ct_pack(asym)})
    assert int4_refused(m) == f"{path}: tensor m.qzeros is not the symmetric zero point 8 [4, {QN // 8}]; duet reads symmetric GPTQ only"
    m, path = modules("zshape", **{"m.qzeros": ct_pack(np.zeros((QK // 128 + 1, QN), int))})
    assert "tensor m.qzeros is not the symmetric zero point 8" in int4_refused(m)
    order = good["m.g_idx"].copy()
    order[[0, 200]] = order[[200, 0]]
    m, path = modules("gidx", **{"m.g_idx": order})
    assert int4_refused(m) == f"{path}: tensor m.g_idx reorders inputs (act-order); duet reads desc_act false GPTQ only"
    m, path = modules("noq", **{"m.qzeros": None})
    with pytest.raises(KeyError):
        m.check("m.weight", (QN, QK))
    m, path = modules("nos", **{"m.scales": None})
    assert int4_refused(m) == f"{tmp_path / 'nos'}: tensor m.scales is missing; the INT4 checkpoint is incomplete"
    v1_folder, ckpt = int4_folder(tmp_path / "v1", good, GPTQ_CONFIG)  # zeros of 8 in a v1 file (which stores 7)
    assert "not the symmetric zero point 7" in int4_refused(read_quantization(v1_folder, ckpt))


def test_read_weights_takes_the_int4_modules(tmp_path):
    """A tiny transformers model with its MLP projections replaced by compressed-tensors INT4, read end to end."""
    folder = tmp_path / "ct"
    folder.mkdir()
    tensors = {k: v.float().numpy() for k, v in saved(HF["h128"]).items()}
    config = json.loads((HF["h128"] / "config.json").read_text()) | {"quantization_config": CT}
    expected = {}
    for name in [n for n in tensors if n.endswith(("mlp.up_proj.weight", "self_attn.o_proj.weight"))]:
        n_rows, k = tensors[name].shape
        levels, scale = levels_of(len(expected), (n_rows, k)), bf16_exact((n_rows, k // 128), 11)
        del tensors[name]
        tensors |= ct_tensors(levels, scale, name.removesuffix(".weight"))
        expected[name.removeprefix("model.")] = np.repeat(scale, 128, axis=1) * levels
    safetensors.numpy.save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    ckpt, model_config = open_hf(folder)
    modules = read_quantization(folder, ckpt)
    calls = []
    weights = read_weights(ckpt, model_config, lambda d, t: calls.append((d, t)), quantized=modules)
    for key, dense in expected.items():
        assert np.array_equal(weights.tensors[key].dequantize(), dense)
    assert calls[-1][0] == calls[-1][1] == sum(a.nbytes for a in tensors.values())


def test_remote_gguf_files_that_end_early_or_exactly(tmp_path, serve, any_config):
    whole = raw_gguf(tmp_path / "whole.gguf", [kv("x", 4, struct.pack("<I", 9))], [], 0, pad=False).read_bytes()
    hub = serve(MockHub({"Model.gguf": whole}))
    headers = read_headers("o/r")
    assert (headers.tensors, any_config[-1][0], headers.format, headers.file_bytes) == ({}, {"x": 9}, "gguf", len(whole))
    assert hub.ranges_of("Model.gguf") == [f"bytes=0-{hd.FIRST_BLOCK - 1}"]  # the header ends with the file: one request

    def error(data: bytes, **kw) -> str:
        serve(MockHub({"Model.gguf": data}, **kw))
        with pytest.raises(DuetError) as caught:
            read_headers("o/r")
        return str(caught.value)

    assert error(whole[:-1]) == f"o/r/Model.gguf: {MSG_TRUNC}"
    assert error(b"", ranges=False) == f"o/r/Model.gguf: {MSG_TRUNC}"  # an empty file has a size: 0
    assert error(b"GGUX" + whole[4:]) == "o/r/Model.gguf: not a GGUF file (the magic bytes are wrong)"


def test_remote_split_with_a_missing_part(split_parts, serve, any_config):
    files = {f"Q8/{p.name}": p.read_bytes() for p in split_parts if "00002" not in p.name}
    serve(MockHub(files))
    with pytest.raises(CheckpointError) as caught:
        read_headers(f"o/r/Q8/{split_parts[0].name}")
    assert str(caught.value) == f"o/r/Q8/{split_parts[0].name}: split GGUF file Model-00002-of-00003.gguf is missing; download every part"
