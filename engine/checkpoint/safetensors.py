"""Lazy, defensive reading of safetensors files (single or sharded).

Layout of a safetensors file: 8 bytes little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data
block; offsets are relative to the start of the data block. The file is memory-mapped and a
tensor's bytes are only touched when it is read, so unused tensors (a vision tower) cost nothing.
Every offset, shape and dtype is checked against the file before anything is read.
"""

from __future__ import annotations

import json
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from duet.engine.errors import CheckpointError

# safetensors dtype -> (numpy dtype of the stored bits, bytes per element)
DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # raw bits; widened to fp32 by bf16_to_f32
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "U16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "BOOL": np.dtype("?"),
}
FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
MAX_HEADER_BYTES = 100 * 1024 * 1024


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 is the top half of an fp32: shift the 16 stored bits into place."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def release_file_pages(array: np.ndarray) -> None:
    """Let go of the file pages behind a memory-mapped array once its values have been copied.

    The pages stay in the OS's page cache (a later read, such as an embedding lookup or a switch to
    the bf16 route, maps them again), but no longer count in this process's resident memory: the
    0.8B Q4_0 file was held twice after loading, as its blocks and as what was made from them.
    Arrays not backed by a file mapping are left alone; only whole pages inside the array go."""
    mapped = array
    while mapped is not None and not isinstance(mapped, mmap.mmap):
        mapped = getattr(mapped, "base", None)
    if mapped is None or not array.size:
        return
    base = np.frombuffer(mapped, np.uint8).ctypes.data
    offset = array.ctypes.data - base
    first, last = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE, (offset + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        mapped.madvise(mmap.MADV_DONTNEED, first, last - first)


class SafetensorsFile:
    """One .safetensors file: parsed header, data mapped on first read."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.tensors, self.metadata = parse_header(self.path)
        self._map: mmap.mmap | None = None

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            with open(self.path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        return self._map

    def raw(self, name: str) -> np.ndarray:
        """The stored array, zero-copy over the mapping (bf16 as uint16 bits)."""
        info = self.tensors[name]
        count = math.prod(info.shape)
        array = np.frombuffer(self._mapped(), dtype=DTYPES[info.dtype], count=count, offset=info.begin)
        return array.reshape(info.shape)

    def read_f32(self, name: str) -> np.ndarray:
        """A float tensor as a new fp32 array (the mapping is not kept alive by it)."""
        info = self.tensors[name]
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(self.path, f"tensor {name} is {info.dtype}, expected a float type")
        stored = self.raw(name)
        if info.dtype == "BF16":
            return bf16_to_f32(stored)
        return stored.astype(np.float32)

    def read_ints(self, name: str) -> np.ndarray:
        """An I64 tensor (hash constants: the plan refuses any other type first), exactly, as a new array."""
        info = self.tensors[name]
        if info.dtype != "I64":
            raise CheckpointError(self.path, f"tensor {name} is {info.dtype}, expected I64")
        return self.raw(name).astype(np.int64)

    def mapped(self, name: str) -> np.ndarray:
        """The stored array on a mapping of its own, which outlives close(): a table a model gathers
        rows from while it runs (bf16 as uint16 bits). Nothing is read until a row is used."""
        info = self.tensors[name]
        return np.memmap(self.path, DTYPES[info.dtype], "r", offset=info.begin, shape=info.shape)

    def read_bits(self, name: str) -> np.ndarray:
        """A bf16 tensor's 16-bit patterns as a new uint16 array (the mapping is not kept alive by it)."""
        if self.tensors[name].dtype != "BF16":
            raise CheckpointError(self.path, f"tensor {name} is {self.tensors[name].dtype}, expected BF16")
        stored = self.raw(name)
        bits = np.array(stored)
        release_file_pages(stored)  # the copy is what the model keeps
        return bits

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def parse_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(path, "file is truncated before its header; re-download it")
            header_len = header_length(path, prefix, size)
            header_bytes = handle.read(header_len)
    except OSError as exc:
        raise CheckpointError(path, f"cannot read the file ({exc.strerror})") from None
    return parse_header_bytes(path, header_bytes, size)


def header_length(source: str | Path, prefix: bytes, size: int) -> int:
    """The header length that the first 8 bytes of a file of `size` bytes announce, checked."""
    header_len = int.from_bytes(prefix, "little")
    if header_len > size - 8:
        raise CheckpointError(source, "header length runs past the end of the file; the file is truncated or not safetensors")
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(source, f"header length {header_len} is over {MAX_HEADER_BYTES >> 20} MiB, more than any "
                                      "model's; the file is corrupt or not safetensors")
    return header_len


def parse_header_bytes(source: str | Path, header_bytes: bytes, size: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors and metadata of a header already read (from a file, or a range request), checked against `size`."""
    header_len = len(header_bytes)
    try:
        header = json.loads(header_bytes)
    except (ValueError, RecursionError):  # bad JSON or UTF-8, an integer of 5000 digits, arrays nested 10^5 deep
        raise CheckpointError(source, "header is not valid JSON; the file is corrupt, re-download it") from None
    if not isinstance(header, dict):
        raise CheckpointError(source, "header is not a JSON object; the file is corrupt, re-download it")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    tensors = {name: _tensor_info(source, name, entry, data_start, size) for name, entry in header.items()}
    _check_disjoint(source, tensors)
    return tensors, {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {}


def _tensor_info(path: str | Path, name: str, entry, data_start: int, size: int) -> TensorInfo:
    def bad(problem: str) -> CheckpointError:
        return CheckpointError(path, f"tensor {name}: {problem}; the file is corrupt, re-download it")

    if not isinstance(entry, dict):
        raise bad("header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:  # a list is no dict key
        raise CheckpointError(path, f"tensor {name}: dtype {dtype!r} is not supported")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):  # JSON true is no size
        raise bad(f"invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise bad(f"invalid data_offsets {offsets!r}")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPES[dtype].itemsize or begin < 0:
        raise bad(f"data_offsets {offsets} do not match shape {shape} of {dtype}")
    if data_start + end > size:
        raise CheckpointError(path, f"tensor {name} ends past the end of the file: the file is truncated, re-download it")
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_disjoint(source: str | Path, tensors: dict[str, TensorInfo]) -> None:
    """The format lays tensors end to end: two that share a byte mean a corrupt (or crafted) header."""
    spans = sorted(tensors.values(), key=lambda t: (t.begin, t.end))
    for first, second in zip(spans, spans[1:]):
        if second.begin < first.end:
            raise CheckpointError(source, f"tensors {first.name} and {second.name} overlap in the data; "
                                          "the file is corrupt, re-download it")


class SafetensorsCheckpoint:
    """All tensors of a model folder: `model.safetensors` or the shards of its index."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.files: list[SafetensorsFile] = [SafetensorsFile(p) for p in _shard_paths(self.model_dir)]
        self._where: dict[str, SafetensorsFile] = {}
        for file in self.files:
            for name in file.tensors:
                self._where[name] = file

    def names(self) -> list[str]:
        return list(self._where)

    def info(self, name: str) -> TensorInfo:
        return self._where[name].tensors[name]

    def file_of(self, name: str) -> Path:
        return self._where[name].path

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def read_f32(self, name: str) -> np.ndarray:
        return self._where[name].read_f32(name)

    def read_bits(self, name: str) -> np.ndarray:
        return self._where[name].read_bits(name)

    def read_ints(self, name: str) -> np.ndarray:
        return self._where[name].read_ints(name)

    def mapped(self, name: str) -> np.ndarray:
        return self._where[name].mapped(name)

    def close(self) -> None:
        for file in self.files:
            file.close()


def _shard_paths(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.exists():
        paths = []
        for shard in shard_names(index, index.read_bytes()):
            if "\0" in shard:  # the OS cannot even look such a name up
                raise CheckpointError(index, f"shard {shard!r} is not a file name; the index is corrupt, re-download the model")
            path = (model_dir / shard).resolve()
            if model_dir.resolve() not in path.parents:
                raise CheckpointError(index, f"shard {shard!r} points outside the model folder; refusing to read it")
            if not path.exists():
                raise CheckpointError(path, "shard listed in model.safetensors.index.json is missing; re-download the model")
            paths.append(path)
        return paths
    if single.exists():
        return [single]
    loose = sorted(model_dir.glob("*.safetensors"))
    if loose:
        return loose
    raise CheckpointError(model_dir, "no model.safetensors or model.safetensors.index.json here; point --model at a model folder")


def shard_names(source: str | Path, index_bytes: bytes) -> list[str]:
    """The shard files a model.safetensors.index.json names, sorted."""
    try:
        weight_map = json.loads(index_bytes)["weight_map"]
        return sorted({str(shard) for shard in weight_map.values()})
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        raise CheckpointError(source, "index is not valid JSON with a weight_map; re-download the model") from None
