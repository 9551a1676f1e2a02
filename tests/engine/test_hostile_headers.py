"""Hostile checkpoints, generated: whatever a safetensors or GGUF header holds, reading it ends in one line
of CheckpointError or a correct load; never a traceback, a hang, or an allocation larger than the file.

Hypothesis builds files structurally from valid ones and mutates fields: safetensors' length prefix and
each JSON entry's dtype, shape and data_offsets; GGUF's version, counts, string and array lengths, value
types, dims, ggml types, offsets and general.alignment. It also flips and cuts bytes of valid files.
Readers under test: the safetensors parser and loader (SafetensorsFile), the GGUF header reader, the
loader's reading of it (long arrays kept, GGUFCheckpoint), read_headers on local files and on a hub that
an httpx.MockTransport serves (it records every byte range asked for), and `duet models info`.

A load counts as correct when it is checked: every tensor lies inside the file after the header, no two
overlap, sizes follow from shapes, the bytes read back are the file's; where the reference readers (the
safetensors library, the gguf package) accept a file too, ours gives the same tensors.

Bounds: each read runs under a 5 s alarm (a hang fails the example; the hypothesis deadline catches the
merely slow) and tracemalloc's peak during it stays under twice the file's size plus 1 MiB: a string or
JSON header is read, then decoded (two copies at most), and OVERHEAD covers the Python objects of the
few-kB headers made here. A declared length never counts: the huge-length tests use 40-byte files. Examples are derandomized with no database, so CI runs the same inputs
each time; FUZZ_EXAMPLES=5000 searches longer locally with fresh random inputs.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import struct
import tracemalloc
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import gguf
import httpx
import numpy as np
import pytest
import safetensors
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import headeronly as ho
from duet.app.cli import main
from duet.engine.checkpoint import headers as headers_module
from duet.engine.checkpoint.gguf import GGUFCheckpoint
from duet.engine.checkpoint.headers import FIRST_BLOCK, MAX_BLOCK, read_gguf_header, read_headers
from duet.engine.checkpoint.safetensors import DTYPES, MAX_HEADER_BYTES, SafetensorsCheckpoint, SafetensorsFile
from duet.engine.config import ModelConfig
from duet.engine.errors import CheckpointError, DuetError

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # random F64 bits past fp32's range

DATA = Path(__file__).parent / "data"
REAL_GGUF = DATA / "llamacpp_qwen35_mtp_f16.gguf"
OVERHEAD = 1 << 20
HANG_S = 5.0
FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0"))


def fuzz(examples: int):
    """Bounded and reproducible in CI; FUZZ_EXAMPLES=n searches n random examples instead."""
    return settings(max_examples=FUZZ_EXAMPLES or examples, deadline=2000, derandomize=not FUZZ_EXAMPLES,
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile")


# --- the property -------------------------------------------------------------------------------------

@contextmanager
def alarm(seconds: float):
    def hang(signum, frame):
        raise TimeoutError(f"the reader ran past {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def assert_one_line(error: Exception, source: str | None = None) -> None:
    message = str(error)
    assert message and message.isprintable() and message.splitlines() == [message], repr(message)
    assert source is None or message.startswith(f"{source}: "), f"{message!r} does not name {source}"


def outcome(read, size: int, errors=CheckpointError, overhead: int | None = OVERHEAD, hang_s: float = HANG_S,
            source: str | None = None):
    """What `read()` returns, or None when it refused the file with one line of `errors` (starting with
    `source: `, the file it names, when given). Any other exception propagates and fails the example;
    so do a hang and a peak allocation past 2 size + overhead (overhead None: not measured,
    tracemalloc slows the gguf package's reader fourfold)."""
    if overhead is None:
        with alarm(hang_s):
            try:
                return read()
            except errors as error:
                assert_one_line(error, source)
                return None
    tracemalloc.start()
    try:
        with alarm(HANG_S):
            result = read()
    except errors as error:
        assert_one_line(error, source)
        result = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak <= 2 * size + overhead, f"peak allocation {peak} for a file of {size} bytes"
    return result


def assert_laid_out(tensors, data_start: int, size: int) -> None:
    """Inside the file after the header, and no byte shared by two tensors."""
    spans = sorted((t.begin, t.end) for t in tensors.values())
    assert all(data_start <= begin <= end <= size for begin, end in spans)
    assert all(end <= next_begin for (_, end), (next_begin, _) in zip(spans, spans[1:]))


# --- safetensors --------------------------------------------------------------------------------------

HOSTILE_DTYPES = st.sampled_from(["F8_E4M3", "F8_E5M2", "C64", "f32", "", "BF16 ", "F32\n"]) | st.none() | \
    st.integers(-2, 2**64) | st.lists(st.sampled_from(["F32", "I8"]), max_size=2)
HOSTILE_DIMS = st.sampled_from([-1, -(2**63), 2**31, 2**32, 2**63 - 1, 2**63, 2**64 + 1, 10**30, True, False,
                                1.0, 2.5, "4", None, [2]])
HOSTILE_SHAPES = st.lists(st.integers(0, 3) | HOSTILE_DIMS, max_size=4) | st.sampled_from([None, 4, "4", {}, [[]]]) | \
    st.lists(st.sampled_from([2**16, 2**20, 2**32 + 1]), min_size=2, max_size=5)  # products that overflow 64 bits
HOSTILE_OFFSETS = st.lists(st.integers(-(2**64), 2**64) | HOSTILE_DIMS, max_size=3) | st.sampled_from([None, 0, "0-4", {}])
NAMES = st.text(max_size=6) | st.sampled_from(["__metadata__", "a\nTraceback (most recent call last):", "\u2028", "\x00"])
METADATA = st.none() | st.dictionaries(st.text(max_size=3), st.text(max_size=3) | st.integers() | st.lists(st.integers(), max_size=2), max_size=3) \
    | st.sampled_from([[], "pt", 7])


@st.composite
def safetensors_files(draw) -> bytes:
    """A valid file of up to four small tensors, then at most three mutations of its fields."""
    names = draw(st.lists(NAMES, max_size=4, unique=True))
    header, data, offset = {}, b"", 0
    for name in names:
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        data += draw(st.binary(min_size=nbytes, max_size=nbytes))
        offset += nbytes
    if draw(st.booleans()):
        header["__metadata__"] = draw(METADATA)
    tensors = [n for n in header if n != "__metadata__"]
    for mutation in draw(st.lists(st.sampled_from(["dtype", "shape", "offsets", "shift", "reverse", "overlap",
                                                   "entry", "data"]), max_size=3)):
        if mutation == "data":
            data = draw(st.sampled_from([data[:-1], data + b"\0", b"", data * 2]))
            continue
        if not tensors:
            continue
        entry = header[draw(st.sampled_from(tensors))]
        if mutation == "entry":
            entry.clear()
            entry.update(draw(st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets", "x"]), st.integers(), max_size=2)))
        elif not isinstance(entry.get("data_offsets"), list) or len(entry["data_offsets"]) != 2:
            continue
        elif mutation == "dtype":
            entry["dtype"] = draw(HOSTILE_DTYPES | st.sampled_from(sorted(DTYPES)))
        elif mutation == "shape":
            entry["shape"] = draw(HOSTILE_SHAPES)
        elif mutation == "offsets":
            entry["data_offsets"] = draw(HOSTILE_OFFSETS)
        elif mutation == "shift":  # out of the file, or into a neighbour
            delta = draw(st.integers(-64, 64) | st.sampled_from([2**40, 2**63, -(2**63)]))
            entry["data_offsets"] = [o + delta for o in entry["data_offsets"]]
        elif mutation == "reverse":
            entry["data_offsets"] = entry["data_offsets"][::-1]
        elif mutation == "overlap":  # the same span as another tensor's, or straddling it
            other = header[draw(st.sampled_from(tensors))]
            if isinstance(other.get("data_offsets"), list) and len(other["data_offsets"]) == 2:
                begin = other["data_offsets"][0] + draw(st.integers(0, 3))
                entry["data_offsets"] = [begin, begin + entry["data_offsets"][1] - entry["data_offsets"][0]]
    blob = json.dumps(header).encode()
    blob += b" " * draw(st.integers(0, 7))
    prefix = draw(st.sampled_from([len(blob)]) | st.sampled_from([0, 1, len(blob) - 1, len(blob) + 1, 2**63, 2**64 - 1,
                                                                  MAX_HEADER_BYTES + 1]))
    return prefix.to_bytes(8, "little") + blob + data


def raw_headers(draw_json) -> bytes:
    blob = json.dumps(draw_json).encode()
    return len(blob).to_bytes(8, "little") + blob


def check_safetensors(path: Path, blob: bytes):
    """The property for one file, through the loader; the file's tensors, or None when refused."""
    path.write_bytes(blob)
    file = outcome(lambda: SafetensorsFile(path), len(blob), source=str(path))
    if file is None:
        return None
    header_end = 8 + int.from_bytes(blob[:8], "little")
    assert_laid_out(file.tensors, header_end, len(blob))
    for name, info in file.tensors.items():
        assert info.nbytes == math.prod(info.shape) * DTYPES[info.dtype].itemsize
        assert file.raw(name).shape == info.shape and file.raw(name).tobytes() == blob[info.begin:info.end]
        if info.dtype in ("F32", "F16", "BF16", "F64"):
            assert file.read_f32(name).shape == info.shape
    file.close()  # the arrays over the mapping are gone
    return file.tensors


def reference_safetensors(blob: bytes):
    """What the safetensors library reads from the same bytes (name -> (dtype, shape, bytes)), or None."""
    try:
        return {name: (t["dtype"], tuple(t["shape"]), bytes(t["data"])) for name, t in safetensors.deserialize(blob)}
    except Exception:  # the reference's refusals come in several types; only its acceptance is compared
        return None


@fuzz(150)
@given(blob=safetensors_files())
@example(blob=raw_headers({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}) + b"\0" * 4)
@example(blob=raw_headers({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                           "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}) + b"\0" * 4)
@example(blob=raw_headers({"a\nb": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}) + b"\0" * 4)
def test_safetensors_header_fields(work, blob):
    ours = check_safetensors(work / "model.safetensors", blob)
    reference = reference_safetensors(blob)
    if reference is not None and all(dtype in DTYPES for dtype, *_ in reference.values()):
        assert ours is not None, "the safetensors library reads this file and we refuse it"
        assert {n: (t.dtype, t.shape, blob[t.begin:t.end]) for n, t in ours.items()} == reference


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                    max_leaves=12)


@fuzz(80)
@given(header=JSON | st.dictionaries(NAMES, JSON, max_size=3), data=st.binary(max_size=16))
@example(header=None, data=b"[" * 100_000 + b"]" * 100_000)
def test_safetensors_header_of_any_json(work, header, data):
    """Any JSON document as the header (a list, a string, entries of the wrong kind), and raw bytes after."""
    blob = raw_headers(header) + data if header is not None else len(data).to_bytes(8, "little") + data
    check_safetensors(work / "model.safetensors", blob)


def test_safetensors_json_the_parser_itself_refuses(work):
    """An integer of 5000 digits (Python's int limit) and arrays nested 10^5 deep (the recursion limit)."""
    for header in (b'{"a":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}',
                   b"[" * 100_000 + b"]" * 100_000):
        assert check_safetensors(work / "model.safetensors", len(header).to_bytes(8, "little") + header) is None


@pytest.fixture(scope="module")
def valid_safetensors(tmp_path_factory) -> bytes:
    from safetensors.numpy import save

    rng = np.random.default_rng(0)
    return save({"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.integers(0, 9, (5,), dtype=np.int64),
                 "c": np.zeros((0, 2), np.float16), "d": rng.integers(0, 2, (7,)).astype(np.uint16)},
                metadata={"format": "pt"})


@fuzz(80)
@given(data=st.data())
def test_safetensors_byte_flips_and_cuts(work, valid_safetensors, data):
    blob = bytearray(valid_safetensors)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(blob) - 1))
        blob[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.none() | st.integers(0, len(blob)))
    check_safetensors(work / "model.safetensors", bytes(blob[:cut]))


def test_valid_safetensors_load_as_the_library_reads_them(work, valid_safetensors):
    assert check_safetensors(work / "model.safetensors", valid_safetensors).keys() == {"a", "b", "c", "d"}


def test_huge_declared_header_lengths_allocate_nothing(work):
    """The prefix announces 99 MiB, 100 MiB + 1 and 2^64 - 1 bytes of a 1 KiB file, and 100 MiB + 1 of a
    sparse 200 MiB one: each is refused before the header is read, with a line that says which."""
    path = work / "model.safetensors"
    for declared in (99 << 20, MAX_HEADER_BYTES + 1, 2**64 - 1):
        path.write_bytes(declared.to_bytes(8, "little") + b"{}" + b" " * 1014)
        assert outcome(lambda: SafetensorsFile(path), 1024) is None
    with open(path, "wb") as f:
        f.write((MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b"{}")
        f.truncate(200 << 20)
    with pytest.raises(CheckpointError, match="100 MiB"):
        outcome(lambda: SafetensorsFile(path), 0, errors=())


def test_sharded_index_naming_an_impossible_file(work):
    folder = work / "sharded"
    folder.mkdir(exist_ok=True)
    for weight_map in ({"a": "x\x00y.safetensors"}, {"a": "../outside.safetensors"}, [1], {"a": ["b"]}):
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        assert outcome(lambda: SafetensorsCheckpoint(folder), 0) is None


# --- GGUF ---------------------------------------------------------------------------------------------

U32, U64, STRING, ARRAY = 4, 10, 8, 9
Q8_0, F16, TRELLIS = 8, 1, 200


def gguf_str(text: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(text) if length is None else length) + text


def array(item_type: int, payloads: list[bytes]) -> bytes:
    return struct.pack("<IQ", item_type, len(payloads)) + b"".join(payloads)


def real_keys() -> list[list]:
    """[key, value type, encoded value] of every key of a file llama.cpp's converter wrote."""
    blob, reader = REAL_GGUF.read_bytes(), gguf.GGUFReader(REAL_GGUF)
    keys = []
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        start = field.offset + 8 + len(name.encode()) + 4
        end = field.offset + sum(int(part.nbytes) for part in field.parts)
        keys.append([name.encode(), int(field.types[0]), blob[start:end]])
    return keys


TOKENIZER = (b"tokenizer.ggml.tokens", b"tokenizer.ggml.token_type", b"tokenizer.ggml.merges", b"tokenizer.chat_template")
BASE_KEYS = [key for key in real_keys() if key[0] not in TOKENIZER]  # the model's keys: a fast example
LONG_KEYS = [key for key in real_keys() if key[0] in TOKENIZER] + [  # long arrays, stepped over undecoded
    [b"tokenizer.ggml.scores", ARRAY, array(6, [struct.pack("<f", i) for i in range(1100)])],
    [b"duet.test.strings", ARRAY, array(STRING, [gguf_str(b"s%d" % i) for i in range(1100)])],
]
BASE_TENSORS = [  # [name, dims innermost first, ggml type, bytes]
    [b"token_embd.weight", [64, 32], F16, 64 * 32 * 2],
    [b"blk.0.ffn_up.weight", [64, 2], Q8_0, 2 * 2 * 34],
    [b"blk.0.ffn_up_exps.weight", [64, 4, 2], F16, 64 * 4 * 2 * 2],
    [b"output_norm.weight", [64], 0, 256],
]


def encode_gguf(spec: dict) -> bytes:
    kv = b"".join(gguf_str(k, spec["key_lengths"].get(i)) + struct.pack("<I", t) + v
                  for i, (k, t, v) in enumerate(spec["keys"]))
    infos = b""
    for i, (name, dims, ggml_type, _) in enumerate(spec["tensors"]):
        n_dims = spec["n_dims"].get(i, len(dims))
        infos += gguf_str(name) + struct.pack("<I", n_dims) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", ggml_type, spec["offsets"][i])
    counts = (spec["n_tensors"] % 2**64, spec["n_keys"] % 2**64)  # 2^64 - 1 keys, plus one, wrap
    head = b"GGUF" + struct.pack("<IQQ", spec["version"], *counts) + kv + infos
    head += b"\0" * (-len(head) % 32)
    return head + spec["data"]


def valid_gguf_spec() -> dict:
    offsets, at = [], 0
    for *_, nbytes in BASE_TENSORS:
        offsets.append(at)
        at += -(-nbytes // 32) * 32
    rng = np.random.default_rng(1)
    return {"version": 3, "n_tensors": len(BASE_TENSORS), "n_keys": len(BASE_KEYS),
            "keys": [list(k) for k in BASE_KEYS], "tensors": [list(t) for t in BASE_TENSORS], "offsets": offsets,
            "key_lengths": {}, "n_dims": {}, "data": rng.integers(0, 256, at, dtype=np.uint8).tobytes()}


HUGE = st.sampled_from([2**26, 2**26 + 1, 2**32 - 1, 2**63, 2**64 - 1])
GGUF_MUTATIONS = ["long_arrays", "version", "n_tensors", "n_keys", "key_length", "key_bytes", "value_type", "string_length",
                  "array_type", "array_count", "alignment", "n_dims", "dims", "ggml_type", "offset", "overlap",
                  "duplicate", "data"]


class Blob(bytes):
    """A generated file, shown in a failure report by the mutations that made it, not its 50 kB."""

    def __repr__(self) -> str:
        return f"<{len(self)} bytes: {self.made}>"


@st.composite
def gguf_files(draw) -> Blob:
    spec = valid_gguf_spec()
    keys, tensors = spec["keys"], spec["tensors"]
    mutations = draw(st.lists(st.sampled_from(GGUF_MUTATIONS), max_size=3))
    for mutation in mutations:
        k = draw(st.integers(0, len(keys) - 1))
        t = draw(st.integers(0, len(tensors) - 1))
        strings = [i for i, (_, vtype, _) in enumerate(keys) if vtype == STRING]
        arrays = [i for i, (_, vtype, _) in enumerate(keys) if vtype == ARRAY]
        if mutation == "long_arrays":
            keys += [list(key) for key in LONG_KEYS]
            spec["n_keys"] += len(LONG_KEYS)
        elif mutation == "version":
            spec["version"] = draw(st.sampled_from([0, 1, 2, 4, 2**16, 2**32 - 1]))
        elif mutation in ("n_tensors", "n_keys"):
            spec[mutation] = draw(st.integers(0, spec[mutation] + 2) | HUGE)
        elif mutation == "key_length":
            spec["key_lengths"][k] = draw(st.integers(0, 64) | HUGE)
        elif mutation == "key_bytes":
            keys[k][0] = draw(st.sampled_from([b"", b"\xff\xfe", b"a\nb", b"general.architecture", keys[0][0]]))
        elif mutation == "value_type":
            keys[k][1] = draw(st.integers(0, 14) | st.just(2**32 - 1))
        elif mutation == "string_length":
            i = draw(st.sampled_from(strings))
            keys[i][2] = struct.pack("<Q", draw(st.integers(0, 300) | HUGE)) + keys[i][2][8:]
        elif mutation == "array_type":  # unknown, nested, or a scalar that reinterprets the items
            i = draw(st.sampled_from(arrays))
            keys[i][2] = struct.pack("<I", draw(st.integers(0, 14) | st.just(2**32 - 1))) + keys[i][2][4:]
        elif mutation == "array_count":
            i = draw(st.sampled_from(arrays))
            keys[i][2] = keys[i][2][:4] + struct.pack("<Q", draw(st.integers(0, 2000) | HUGE)) + keys[i][2][12:]
        elif mutation == "alignment":
            vtype = draw(st.sampled_from([U32, U32, U64, STRING]))
            value = draw(st.sampled_from([0, 1, 3, 31, 32, 64, 2**31, 2**32 - 1]))
            payload = gguf_str(b"32") if vtype == STRING else struct.pack("<Q" if vtype == U64 else "<I", value)
            keys.append([b"general.alignment", vtype, payload])
            spec["n_keys"] += 1
        elif mutation == "n_dims":
            spec["n_dims"][t] = draw(st.integers(0, 9) | st.just(2**32 - 1))
        elif mutation == "dims":  # zero, huge, and products past 2^64
            tensors[t][1] = draw(st.lists(st.integers(0, 70) | HUGE | st.sampled_from([2**32, 2**62]), min_size=1, max_size=4))
        elif mutation == "ggml_type":  # known to the gguf package or not (a custom trellis type)
            tensors[t][2] = draw(st.integers(0, 45) | st.sampled_from([TRELLIS, 2**31, 2**32 - 1]))
        elif mutation == "offset":
            spec["offsets"][t] = draw(st.integers(0, len(spec["data"]) + 64) | HUGE)
        elif mutation == "overlap":
            spec["offsets"][t] = spec["offsets"][draw(st.integers(0, len(tensors) - 1))]
        elif mutation == "duplicate":
            tensors[t][0] = tensors[draw(st.integers(0, len(tensors) - 1))][0]
        elif mutation == "data":
            spec["data"] = spec["data"][:draw(st.integers(0, len(spec["data"])))]
    blob = Blob(encode_gguf(spec))
    blob.made = ", ".join(mutations) or "valid"  # the values drawn are in the report's draw log
    return blob


def check_gguf(path: Path, blob: bytes):
    """The property for one GGUF file, through the header reader as read_headers and as the loader read it
    (long arrays kept); where ours and the gguf package both read it, the same tensors."""
    path.write_bytes(blob)
    found = outcome(lambda: read_gguf_header(path), len(blob), source=str(path))
    outcome(lambda: read_headers(str(path)), len(blob), source=str(path))
    loaded = outcome(lambda: read_gguf_header(path, arrays=True), len(blob), source=str(path))
    if found is None:
        assert loaded is None, "the loader reads a file the header reader refuses"
        return None
    if loaded is not None:
        assert loaded[0] == found[0]
    # The package trusts every count (it loops for ever on some), so it only sees files ours accepted.
    try:
        with alarm(HANG_S):
            reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, struct.error):  # what the package raises on what it cannot read
        reader = None
    tensors, metadata = found
    alignment = metadata.get("general.alignment", 32)
    assert_laid_out(tensors, 0, len(blob))
    assert all(t.begin % alignment == 0 for t in tensors.values())
    if reader is not None:
        for t in reader.tensors:
            assert (tensors[t.name].begin, tensors[t.name].nbytes, tensors[t.name].shape) == \
                   (t.data_offset, t.n_bytes, tuple(int(d) for d in reversed(t.shape)))
    return found


def test_the_valid_gguf_reads_as_the_gguf_package_reads_it(work):
    tensors, metadata = check_gguf(work / "model.gguf", encode_gguf(valid_gguf_spec()))
    assert metadata["general.architecture"] == "qwen35" and len(tensors) == len(BASE_TENSORS)
    assert read_headers(str(work / "model.gguf")).config.vocab_size == 32


@fuzz(150)
@given(blob=gguf_files())
def test_gguf_header_fields(work, blob):
    check_gguf(work / "model.gguf", blob)


@fuzz(50)
@given(data=st.data())
def test_gguf_byte_flips_and_cuts_of_a_converted_file(work, data):
    """llama.cpp's own file, its header (12 kB before the data) flipped and cut; the loader sees it too."""
    blob = bytearray(REAL_GGUF.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, 12_000))
        blob[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.none() | st.integers(0, 13_000))
    path = work / "model.gguf"
    if check_gguf(path, bytes(blob[:cut])) is not None:
        outcome(lambda: GGUFCheckpoint(path), len(blob), overhead=None)


def huge_length_gguf(what: str) -> bytes:
    """A header that declares far more than the file holds: a key of 2^26 bytes, an array of 2^26 u64s
    (512 MiB), an array of 2^64 - 1 items, or arrays nested 50 000 deep."""
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    body = {"key": gguf_str(b"k", 2**26),
            "array": gguf_str(b"k") + struct.pack("<IIQ", ARRAY, U64, 2**26),
            "endless": gguf_str(b"k") + struct.pack("<IIQ", ARRAY, 0, 2**64 - 1),
            "nested": gguf_str(b"k") + struct.pack("<I", ARRAY) + struct.pack("<IQ", ARRAY, 1) * 50_000}[what]
    return head + body + b"ab"


@pytest.mark.parametrize("what", ["key", "array", "endless", "nested"])
def test_huge_declared_gguf_lengths_allocate_nothing_and_end(work, what):
    """Before the fix, the 512 MiB array was allocated for a 40-byte file; the gguf package looped for
    ever over the endless array and overflowed the stack on the nested one."""
    blob = huge_length_gguf(what)
    assert check_gguf(work / "model.gguf", blob) is None


def refused_gguf(case: str) -> bytes:
    """The valid file with one fault in a part the fuzzing above reaches only by chance."""
    spec = valid_gguf_spec()
    if case == "a skipped string past the end":  # stepped over undecoded (arrays=False): its length is still checked
        strings = [gguf_str(b"s%d" % i) for i in range(1100)] + [gguf_str(b"ab", 2**40)]  # long: never decoded
        spec["keys"].append([b"duet.test.strings", ARRAY, array(STRING, strings)])
        spec["n_keys"] += 1
    else:  # "rows not whole blocks": a Q8_0 tensor whose rows hold 33 values
        spec["tensors"][1][1] = [33, 2]
    return encode_gguf(spec)


@pytest.mark.parametrize("case", ["a skipped string past the end", "rows not whole blocks"])
def test_faults_deep_in_a_gguf_header_are_refused_naming_the_file(work, case):
    path = work / "model.gguf"
    path.write_bytes(refused_gguf(case))
    with pytest.raises(CheckpointError) as refused:
        read_gguf_header(path)
    assert_one_line(refused.value, str(path))


def with_key(key: bytes, vtype: int, payload: bytes, drop: tuple[bytes, ...] = ()) -> bytes:
    """The valid file with one key's value type and value replaced, and the keys `drop` left out."""
    spec = valid_gguf_spec()
    for entry in spec["keys"]:
        if entry[0] == key:
            entry[1:] = [vtype, payload]
    spec["keys"] = [entry for entry in spec["keys"] if entry[0] not in drop]
    spec["n_keys"] = len(spec["keys"])
    return encode_gguf(spec)


CONFIG_KEYS_REFUSED = {  # found by this file: gguf_names.gguf_config computed with them unchecked
    # case: (key, value type, value, the key the one line names)
    "architecture as a list": (b"general.architecture", ARRAY, array(STRING, [gguf_str(b"qwen35")]),
                               "general.architecture"),  # TypeError: unhashable
    "block_count as a string": (b"qwen35.block_count", STRING, gguf_str(b"6"), "qwen35.block_count"),  # TypeError
    "block_count of 2^40 (a list of 2^40 layer types)": (b"qwen35.block_count", U64, struct.pack("<Q", 2**40),
                                                         "qwen35.block_count"),  # a hang
    "block_count of 1, the MTP block alone": (b"qwen35.block_count", U32, struct.pack("<I", 1), "qwen35.block_count"),
    "head_count of 0": (b"qwen35.attention.head_count", U32, struct.pack("<I", 0),
                        "qwen35.attention.head_count"),  # ZeroDivisionError
    "head_count of 0 per layer": (b"qwen35.attention.head_count", ARRAY, array(U32, [struct.pack("<I", 0)] * 6),
                                  "qwen35.attention.head_count"),
    "time_step_rank of 0": (b"qwen35.ssm.time_step_rank", U32, struct.pack("<I", 0),
                            "qwen35.ssm.time_step_rank"),  # ZeroDivisionError
    "time_step_rank not dividing inner_size": (b"qwen35.ssm.time_step_rank", U32, struct.pack("<I", 3),
                                               "qwen35.ssm.time_step_rank"),
    "embedding_length as strings": (b"qwen35.embedding_length", ARRAY, array(STRING, [gguf_str(b"x")]),
                                    "qwen35.embedding_length"),  # TypeError
    "embedding_length as an empty array": (b"qwen35.embedding_length", ARRAY, array(U32, []), "qwen35.embedding_length"),
    "embedding_length of 2^40": (b"qwen35.embedding_length", U64, struct.pack("<Q", 2**40), "qwen35.embedding_length"),
    "freq_base negative": (b"qwen35.rope.freq_base", 6, struct.pack("<f", -1.0), "qwen35.rope.freq_base"),
    "freq_base NaN": (b"qwen35.rope.freq_base", 6, struct.pack("<f", math.nan), "qwen35.rope.freq_base"),
    "rms epsilon as a bool": (b"qwen35.attention.layer_norm_rms_epsilon", 7, b"\x01",
                              "qwen35.attention.layer_norm_rms_epsilon"),
    "rope dimension past the head": (b"qwen35.rope.dimension_count", U32, struct.pack("<I", 64),
                                     "qwen35.rope.dimension_count"),
    "full_attention_interval of 0": (b"qwen35.full_attention_interval", U32, struct.pack("<I", 0),
                                     "qwen35.full_attention_interval"),
    "nextn_predict_layers negative": (b"qwen35.nextn_predict_layers", 5, struct.pack("<i", -1),
                                      "qwen35.nextn_predict_layers"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_KEYS_REFUSED))
def test_model_keys_of_the_wrong_type_or_value(work, case):
    """Each was a TypeError, ZeroDivisionError or hang in gguf_config; now one line naming the file and the key.
    (full_attention_interval only counts where recurrent_layers is absent: that key goes too.)"""
    key, vtype, payload, named = CONFIG_KEYS_REFUSED[case]
    drop = (b"qwen35.attention.recurrent_layers",) if key == b"qwen35.full_attention_interval" else ()
    blob, path = with_key(key, vtype, payload, drop), work / "model.gguf"
    assert read_gguf_header_ok(path, blob)
    with pytest.raises(CheckpointError) as refused:
        outcome(lambda: read_headers(str(path)), len(blob), errors=(), overhead=None, hang_s=1.0)
    assert_one_line(refused.value)
    assert str(refused.value).startswith(f"{path}: ") and named in str(refused.value), str(refused.value)
    assert "download it again" in str(refused.value) or "duet reads" in str(refused.value)


CONFIG_JSON_REFUSED = {  # text_config field -> value; each was a traceback, a hang or an absurd config
    "num_attention_heads": 0,  # ZeroDivisionError (head_dim = hidden // heads)
    "num_hidden_layers": 2**40,  # a hang building 2^40 layer types
    "hidden_size": 2**62,  # accepted
    "vocab_size": 0,  # accepted
    "num_key_value_heads": 0,  # accepted
    "linear_conv_kernel_dim": 0,  # accepted
    "full_attention_interval": "4",  # TypeError, once layer_types is gone
    "layer_types": [["linear_attention"]] * 64,  # TypeError: unhashable
    "model_type": ["qwen3_5_text"],  # TypeError: unhashable
    "rope_parameters": {"rope_type": "default", "rope_theta": 10**400},  # OverflowError
    "partial_rotary_factor": math.inf,  # OverflowError (rotary_dim)
    "rms_norm_eps": -1.0,  # accepted
}
CONFIG_JSON_TEXT_REFUSED = {
    "arrays nested 10^5 deep": "[" * 100_000 + "]" * 100_000,  # RecursionError
    "an integer of 5000 digits": '{"model_type": "qwen3_5", "vocab_size": ' + "9" * 5000 + "}",  # ValueError
}


@pytest.mark.parametrize("field", sorted(CONFIG_JSON_REFUSED))
def test_config_json_values_of_the_wrong_type_or_value(tmp_path, field):
    raw = ho.config_27b()
    text = raw["text_config"]
    if field in ("full_attention_interval", "partial_rotary_factor"):
        text.pop("layer_types", None), text["rope_parameters"].pop(field, None)
    text[field] = CONFIG_JSON_REFUSED[field]
    if field == "model_type":
        raw["model_type"] = CONFIG_JSON_REFUSED[field]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    named = "rope_theta" if field == "rope_parameters" else "model_type" if field == "model_type" else field
    with pytest.raises(CheckpointError) as refused, alarm(1.0):
        ModelConfig.from_file(path)
    assert_one_line(refused.value)
    assert str(refused.value).startswith(f"{path}: ") and named in str(refused.value), str(refused.value)


@pytest.mark.parametrize("case", sorted(CONFIG_JSON_TEXT_REFUSED))
def test_config_json_the_parser_itself_refuses(tmp_path, case):
    path = tmp_path / "config.json"
    path.write_text(CONFIG_JSON_TEXT_REFUSED[case])
    with pytest.raises(CheckpointError, match="config.json is not valid JSON; re-download the model") as refused:
        ModelConfig.from_file(path)
    assert_one_line(refused.value)


def test_the_27b_config_json_is_accepted(tmp_path):
    """The bounds leave a real config alone (the 27B model's geometry, REFERENCE.md section 1)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(ho.config_27b()))
    c = ModelConfig.from_file(path)
    assert (c.vocab_size, c.num_hidden_layers, c.head_dim, c.rotary_dim) == (ho.V, ho.LAYERS, ho.HEAD_DIM, 64)


def read_gguf_header_ok(path: Path, blob: bytes) -> bool:
    path.write_bytes(blob)
    return outcome(lambda: read_gguf_header(path), len(blob)) is not None


# --- the hub ------------------------------------------------------------------------------------------

class MockHub:
    """One repo `o/r` on a MockTransport: the file list and Range requests, each recorded (file, start,
    bytes asked). `declared` overrides the size that Content-Range announces (a lying server)."""

    def __init__(self, files: dict[str, bytes], declared: int | None = None):
        self.files, self.declared, self.asked = files, declared, []
        self._client = httpx.Client

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/models/o/r/revision/main":
            return httpx.Response(200, json={"siblings": [{"rfilename": name} for name in self.files]})
        name = re.fullmatch(r"/o/r/resolve/main/(.+)", request.url.path)[1]
        data = self.files[name]
        wanted = re.fullmatch(r"bytes=(\d+)-(\d+)", request.headers.get("range", ""))
        if not wanted:
            return httpx.Response(200, content=data)
        start, last = int(wanted[1]), int(wanted[2])
        self.asked.append((name, start, last + 1 - start))
        if start >= len(data):
            return httpx.Response(416)
        body = data[start:last + 1]
        total = self.declared if self.declared is not None else len(data)
        return httpx.Response(206, content=body, headers={"content-range": f"bytes {start}-{start + len(body) - 1}/{total}"})

    @contextmanager
    def serving(self):
        real = httpx.Client
        transport = httpx.MockTransport(self.handle)
        with mock.patch.object(headers_module.httpx, "Client", lambda **kw: real(transport=transport, **kw)), \
                mock.patch.dict(os.environ, {"HF_ENDPOINT": "http://hub.test"}):
            os.environ.pop("HF_TOKEN", None)
            yield self


def same_reading(remote, local) -> None:
    """Remote and local reads of the same bytes agree: both refuse, or both give the same tensors."""
    assert (remote is None) == (local is None)
    if remote is not None:
        assert {n: (t.dtype, t.shape, t.begin, t.end) for n, t in remote.tensors.items()} == \
               {n: (t.dtype, t.shape, t.begin, t.end) for n, t in local.tensors.items()}


@fuzz(60)
@given(blob=gguf_files())
def test_remote_gguf_headers(work, blob):
    (work / "model.gguf").write_bytes(blob)
    with MockHub({"model.gguf": blob}).serving() as hub:
        remote = outcome(lambda: read_headers("o/r"), len(blob), errors=DuetError)
    same_reading(remote, outcome(lambda: read_headers(str(work / "model.gguf")), len(blob)))
    assert all(start + asked <= max(len(blob), FIRST_BLOCK) for _, start, asked in hub.asked)


@fuzz(60)
@given(blob=safetensors_files())
def test_remote_safetensors_headers(work, blob):
    folder = work / "repo"
    folder.mkdir(exist_ok=True)
    config = json.dumps(ho.config_27b()).encode()
    (folder / "config.json").write_bytes(config)
    (folder / "model.safetensors").write_bytes(blob)
    with MockHub({"config.json": config, "model.safetensors": blob}).serving() as hub:
        remote = outcome(lambda: read_headers("o/r"), len(blob), errors=DuetError)
    same_reading(remote, outcome(lambda: read_headers(str(folder)), len(blob)))
    header_end = 8 + int.from_bytes(blob[:8], "little")
    assert all(start + asked <= min(header_end, len(blob)) for name, start, asked in hub.asked if name == "model.safetensors")


@fuzz(60)
@given(blob=gguf_files(), declared=st.integers(0, 2**40))
def test_a_hub_that_lies_about_the_size(blob, declared):
    with MockHub({"model.gguf": blob}, declared=declared).serving() as hub:
        outcome(lambda: read_headers("o/r"), len(blob), errors=DuetError)
    assert all(asked <= MAX_HEADER_BYTES and start + asked <= MAX_HEADER_BYTES + MAX_BLOCK for _, start, asked in hub.asked)


@pytest.mark.parametrize("what", ["key", "array", "endless"])
def test_a_lying_hub_gets_no_request_past_the_header_cap(what):
    """The server says the file is 1 TB; the header declares 64 MiB strings, 512 MiB arrays or 2^64 items.
    Nothing past MAX_HEADER_BYTES is asked for, and the reading ends in one line."""
    blob = huge_length_gguf(what)
    with MockHub({"model.gguf": blob}, declared=10**12).serving() as hub:
        assert outcome(lambda: read_headers("o/r"), len(blob), errors=DuetError) is None
    assert hub.asked and all(start + asked <= MAX_HEADER_BYTES for _, start, asked in hub.asked)


def test_a_lying_hub_with_a_huge_safetensors_prefix():
    config = json.dumps(ho.config_27b()).encode()
    for declared_header in (99 << 20, 2**63):
        blob = declared_header.to_bytes(8, "little") + b"{}"
        with MockHub({"config.json": config, "model.safetensors": blob}, declared=10**12).serving() as hub:
            assert outcome(lambda: read_headers("o/r"), len(blob), errors=DuetError) is None
        assert all(asked <= MAX_HEADER_BYTES for _, _, asked in hub.asked)


def test_a_listing_of_names_that_are_not_strings():
    hub = MockHub({})
    hub.handle = lambda request: httpx.Response(200, json={"siblings": [{"rfilename": 7}, {"rfilename": "a\nb"}]})
    with hub.serving():
        assert outcome(lambda: read_headers("o/r"), 0, errors=DuetError) is None


# --- the CLI ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["nested gguf", "tensor named with a newline", "deep json"])
def test_models_info_on_a_hostile_file_is_one_line_exit_2(work, capsys, kind):
    if kind == "deep json":
        target = work / "cli"
        target.mkdir(exist_ok=True)
        (target / "config.json").write_text(json.dumps(ho.config_27b()))
        header = b"[" * 100_000 + b"]" * 100_000
        (target / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    else:
        target = work / "cli.gguf"
        spec = valid_gguf_spec()
        if kind == "tensor named with a newline":
            spec["tensors"][1][1] = [63, 2]  # not whole Q8_0 blocks, so the named tensor is refused
            spec["tensors"][1][0] = b"blk.0\nTraceback (most recent call last):"
        target.write_bytes(encode_gguf(spec) if kind != "nested gguf" else huge_length_gguf("nested"))
    assert main(["models", "info", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("duet: ")
