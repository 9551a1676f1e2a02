"""Header-only readers: every tensor's name, dtype, shape and size, and the model's config, without its data.

Sources: a local model folder (HF safetensors, single or sharded, read by SafetensorsCheckpoint, which
parses headers and maps nothing until a tensor is read), a local GGUF file (single or split, parsed
here), and both of those on the hub, read with HTTP range requests: `HF_ENDPOINT` picks the server and
`HF_TOKEN`, when set, goes in the Authorization header and nowhere else.

What a remote read fetches: the repo's file list, config.json, the shard index, and per safetensors
file its 8-byte length prefix and its JSON header, exactly. A GGUF header has no length field, so it
is read in blocks that double from 64 KiB to 4 MiB; what is fetched past its end is at most one block.
"""

from __future__ import annotations

import json
import math
import os
import re
from fnmatch import fnmatch
import struct
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from duet.engine.checkpoint.gguf_names import gguf_config
from duet.engine.checkpoint.safetensors import (
    MAX_HEADER_BYTES,
    SafetensorsCheckpoint,
    TensorInfo,
    header_length,
    parse_header_bytes,
    shard_names,
)
from duet.engine.config import ModelConfig
from duet.engine.errors import CheckpointError, DuetError

DEFAULT_ENDPOINT = "https://huggingface.co"
INDEX = "model.safetensors.index.json"
MAX_JSON_BYTES = 64 * 1024 * 1024  # config.json and the shard index are kilobytes; refuse anything absurd
FIRST_BLOCK, MAX_BLOCK = 64 * 1024, 4 * 1024 * 1024  # GGUF read-ahead on the hub
SPLIT_GGUF = re.compile(r"^(?P<base>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class CheckpointHeaders:
    source: str  # what the user named: a folder, a file or a repo id
    format: str  # "safetensors" or "gguf"
    config: ModelConfig
    tensors: dict[str, TensorInfo]  # GGUF shapes are given outermost first, as safetensors gives them
    files: tuple[str, ...]
    file_bytes: int  # the weight files' size on disk


def read_headers(source: str, revision: str = "main", patterns: tuple[str, ...] = ()) -> CheckpointHeaders:
    """Headers of a local folder or file, or else of the hub repo `owner/name[/file.gguf]`; `patterns`
    (globs) pick the GGUF model of a repo that has several."""
    path = Path(source).expanduser()
    if path.exists():
        return read_local_headers(path, source)
    if re.fullmatch(r"[\w.-]+/[\w.-]+(/[\w./-]+\.gguf)?", source):
        return read_remote_headers(source, revision, patterns)
    raise DuetError(f"{source}: no such file or folder, and not a hub repo id (owner/name)")


# --- local ------------------------------------------------------------------------------------------

def read_local_headers(path: Path, source: str) -> CheckpointHeaders:
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(path, "not a .gguf file; pass a model folder or a GGUF file")
        return _local_gguf(path, source)
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return _local_safetensors(path, source)
    return _local_gguf(path / _only_gguf_model(path, [p.name for p in path.glob("*.gguf")]), source)


def _local_safetensors(folder: Path, source: str) -> CheckpointHeaders:
    config = ModelConfig.from_file(folder / "config.json")
    checkpoint = SafetensorsCheckpoint(folder)
    tensors = {name: checkpoint.info(name) for name in checkpoint.names()}
    files = tuple(str(f.path) for f in checkpoint.files)
    return CheckpointHeaders(source, "safetensors", config, tensors, files, sum(f.path.stat().st_size for f in checkpoint.files))


def _local_gguf(first: Path, source: str) -> CheckpointHeaders:
    paths = [first.parent / name for name in _split_gguf_names(first.name, lambda name: (first.parent / name).exists(), first)]
    tensors, metadata = {}, None
    for path in paths:
        found, meta = read_gguf_header(path)
        tensors.update(found)
        metadata = metadata or meta  # the first file of a split carries the model's keys
    config = gguf_config(metadata, _shapes(tensors), str(first))
    return CheckpointHeaders(source, "gguf", config, tensors, tuple(map(str, paths)), sum(p.stat().st_size for p in paths))


def _only_gguf_model(where: str | Path, names: list[str]) -> str:
    """The one GGUF model among `names` (the first file of a split; mmproj vision files aside)."""
    models = sorted(n for n in names if not Path(n).name.startswith("mmproj")
                    and (not SPLIT_GGUF.match(n) or SPLIT_GGUF.match(n)["no"] == "00001"))
    if len(models) == 1:
        return models[0]
    if not models:
        raise CheckpointError(where, "no config.json with safetensors and no .gguf file here; not a model")
    shown = ", ".join(models[:6]) + (", ..." if len(models) > 6 else "")
    raise CheckpointError(where, f"holds {len(models)} GGUF models ({shown}); name the file you mean")


def _split_gguf_names(name: str, exists, where) -> list[str]:
    """`name` alone, or every file of the split it starts (`x-00001-of-00003.gguf`), each present."""
    match = SPLIT_GGUF.match(name)
    if not match:
        return [name]
    count = int(match["count"])
    names = [f"{match['base']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    for part in names:
        if not exists(part):
            raise CheckpointError(where, f"split GGUF file {part} is missing; download every part")
    return names


def read_gguf_header(path: Path, arrays: bool = False) -> tuple[dict[str, TensorInfo], dict]:
    """The tensors and metadata of a local GGUF file, every length and offset checked against the file.
    `arrays`: keep long arrays too (the token list and merges a tokenizer needs); else they are skipped."""
    try:
        size = path.stat().st_size
        with open(path, "rb", buffering=1 << 16) as handle:
            return parse_gguf_header(_FileStream(handle, str(path), size), str(path), size, arrays)
    except OSError as exc:
        raise CheckpointError(path, f"cannot read the file ({exc.strerror})") from None


class _FileStream:
    """Sequential reads over an open file that fail with one line when the file ends early."""

    def __init__(self, handle, source: str, size: int):
        self.handle, self.source, self.size, self.pos = handle, source, size, 0

    def read(self, n: int) -> bytes:
        _check_within(self.source, self.pos + n, self.size)
        data = self.handle.read(n)
        if len(data) < n:
            raise CheckpointError(self.source, "file ends inside its GGUF header; it is truncated, re-download it")
        self.pos += n
        return data

    def tell(self) -> int:
        return self.pos


def _check_within(source: str, end: int, size: int) -> None:
    """Before a read up to byte `end` of a GGUF header: a length the file cannot hold (a string of 2^60
    bytes) is refused here, before anything is allocated or fetched."""
    if end > size:
        raise CheckpointError(source, "file ends inside its GGUF header; it is truncated, re-download it")
    if end > MAX_HEADER_BYTES:
        raise CheckpointError(source, f"GGUF header runs past {MAX_HEADER_BYTES >> 20} MiB, more than any model's; "
                                      "the file is corrupt, re-download it")


# --- GGUF header --------------------------------------------------------------------------------------
# Layout: "GGUF", version u32 (2 or 3), tensor count u64, key count u64; keys (string key, u32 type,
# value); tensor infos (string name, u32 n_dims, u64 dims innermost first, u32 ggml type, u64 offset
# into the data block); the data block starts at the next multiple of general.alignment (32).

GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
GGUF_STRING, GGUF_ARRAY = 8, 9
MAX_COUNT = 1 << 26  # no real file has more keys, tensors or array items; a larger count is corruption
KEEP_ARRAY_ITEMS = 1024  # per-layer arrays are kept; token lists and merges are skipped over


def parse_gguf_header(stream, source: str, size: int, arrays: bool = False) -> tuple[dict[str, TensorInfo], dict]:
    if stream.read(4) != b"GGUF":
        raise CheckpointError(source, "not a GGUF file (the magic bytes are wrong)")
    version = _scalar(stream, 4)
    if version not in (2, 3):
        raise CheckpointError(source, f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_keys = _count(stream, source), _count(stream, source)
    metadata = {}
    for _ in range(n_keys):
        key = _string(stream, source)
        if key in metadata:
            raise CheckpointError(source, f"GGUF key {key} appears twice; the file is corrupt, re-download it")
        metadata[key] = _value(stream, _scalar(stream, 4), source, arrays)
    entries = [_tensor_entry(stream, source) for _ in range(n_tensors)]
    alignment = metadata.get("general.alignment", 32)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(source, f"general.alignment {alignment!r} is not a power of two; the file is corrupt")
    data_start = -(-stream.tell() // alignment) * alignment
    return _place_tensors(entries, data_start, size, alignment, source), metadata


def _scalar(stream, code: int):
    fmt = GGUF_SCALARS[code]
    return struct.unpack(fmt, stream.read(struct.calcsize(fmt)))[0]


def _count(stream, source: str) -> int:
    count = _scalar(stream, 10)
    if count > MAX_COUNT:
        raise CheckpointError(source, f"GGUF header claims {count} entries; the file is corrupt, re-download it")
    return count


def _string(stream, source: str) -> str:
    data = stream.read(_count(stream, source))
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(source, "a GGUF key or tensor name is not UTF-8; the file is corrupt") from None


def _value(stream, vtype: int, source: str, arrays: bool = False):
    if vtype in GGUF_SCALARS:
        return _scalar(stream, vtype)
    if vtype == GGUF_STRING:
        return _string(stream, source)
    if vtype != GGUF_ARRAY:
        raise CheckpointError(source, f"GGUF value type {vtype} is unknown; the file is corrupt or too new")
    item_type, count = _scalar(stream, 4), _count(stream, source)
    if item_type not in GGUF_SCALARS and item_type != GGUF_STRING:  # llama.cpp reads no arrays of arrays either
        raise CheckpointError(source, f"GGUF array of value type {item_type} is not supported; the file is corrupt or too new")
    if count > KEEP_ARRAY_ITEMS and not arrays:
        _skip_items(stream, item_type, count, source)
        return None
    if item_type in GGUF_SCALARS:  # one read (checked against the file's size first), decoded at once
        fmt = GGUF_SCALARS[item_type]
        return np.frombuffer(stream.read(count * struct.calcsize(fmt)), fmt).tolist()
    return [_string(stream, source) for _ in range(count)]  # the one other item type allowed above


def _skip_items(stream, item_type: int, count: int, source: str) -> None:
    """Read past a long array of scalars or strings (a token list, merges) without decoding it."""
    if item_type == GGUF_STRING:
        for _ in range(count):
            stream.read(_count(stream, source))
    else:
        stream.read(count * struct.calcsize(GGUF_SCALARS[item_type]))


def _tensor_entry(stream, source: str) -> tuple[str, tuple[int, ...], int, int]:
    name = _string(stream, source)
    n_dims = _scalar(stream, 4)
    if n_dims > 8:
        raise CheckpointError(source, f"tensor {name} has {n_dims} dimensions; the file is corrupt")
    dims = tuple(_scalar(stream, 10) for _ in range(n_dims))
    return name, dims, _scalar(stream, 4), _scalar(stream, 10)


def _place_tensors(entries, data_start: int, size: int, alignment: int, source: str) -> dict[str, TensorInfo]:
    """TensorInfo per entry (in the file's order), each ending before the next offset: no two overlap. A
    type the gguf package does not know (a custom trellis type) is sized by the distance to the next
    tensor's offset, which is its size plus at most the alignment padding."""
    names = [name for name, *_ in entries]
    seen = set()
    for name in names:
        if name in seen:
            raise CheckpointError(source, f"tensor {name} appears twice; the file is corrupt, re-download it")
        seen.add(name)
    by_offset = sorted(entries, key=lambda entry: entry[3])
    limits = [offset for *_, offset in by_offset[1:]] + [size - data_start]
    tensors = {}
    for (name, dims, ggml_type, offset), limit in zip(by_offset, limits):
        if offset % alignment or data_start + offset > size:
            raise CheckpointError(source, f"tensor {name} has offset {offset}, outside the file or unaligned; the file is truncated or corrupt")
        room = limit - offset
        dtype, nbytes = _ggml_size(name, dims, ggml_type, room, source)
        if nbytes > room:
            raise CheckpointError(source, f"tensor {name} runs into the next tensor or past the end of the file; the file is truncated or corrupt")
        begin = data_start + offset
        tensors[name] = TensorInfo(name, dtype, tuple(reversed(dims)), begin, begin + nbytes)
    return {name: tensors[name] for name in names}


def _shapes(tensors: dict[str, TensorInfo]) -> dict[str, tuple[int, ...]]:
    return {name: info.shape for name, info in tensors.items()}


def _ggml_size(name: str, dims: tuple[int, ...], ggml_type: int, room: int, source: str) -> tuple[str, int]:
    try:
        kind = GGMLQuantizationType(ggml_type)
    except ValueError:
        return f"ggml type {ggml_type}", room
    block, block_bytes = GGML_QUANT_SIZES[kind]
    if dims and dims[0] % block:
        raise CheckpointError(source, f"tensor {name}: rows of {dims[0]} are not whole {kind.name} blocks of {block}; the file is corrupt")
    return kind.name, math.prod(dims) // block * block_bytes


# --- the hub ----------------------------------------------------------------------------------------

def read_remote_headers(spec: str, revision: str, patterns: tuple[str, ...]) -> CheckpointHeaders:
    """`owner/name` (safetensors with config.json, or the repo's one GGUF model) or `owner/name/file.gguf`."""
    repo, wanted = _split_spec(spec)
    with Hub(repo, revision) as hub:
        files = hub.list_files()
        if wanted:
            if wanted not in files:
                raise DuetError(f"{repo}: has no file {wanted} at revision {revision}")
            return _remote_gguf(hub, spec, wanted, files)
        if "config.json" in files and any(f.endswith(".safetensors") for f in files):
            return _remote_safetensors(hub, spec, files)
        ggufs = [f for f in files if f.endswith(".gguf") and (not patterns or any(fnmatch(f, p) for p in patterns))]
        return _remote_gguf(hub, spec, _only_gguf_model(repo, ggufs), files)


def _split_spec(spec: str) -> tuple[str, str]:
    """`owner/name/path/file.gguf` -> (`owner/name`, `path/file.gguf`)."""
    owner, name, *rest = spec.split("/")
    if ".." in rest:
        raise DuetError(f"{spec}: a file path in a repo may not contain '..'")
    return f"{owner}/{name}", "/".join(rest)


def _remote_safetensors(hub: Hub, spec: str, files: set[str]) -> CheckpointHeaders:
    config_bytes = hub.read_whole("config.json")
    try:
        raw = json.loads(config_bytes)
    except (ValueError, RecursionError):  # bad JSON or UTF-8, a 5000-digit integer, arrays nested 10^5 deep
        raise CheckpointError(hub.where("config.json"), "config.json is not valid JSON") from None
    if not isinstance(raw, dict):
        raise CheckpointError(hub.where("config.json"), "config.json must hold a JSON object")
    config = ModelConfig.from_dict(raw, hub.where("config.json"))
    if INDEX in files:
        shards = shard_names(hub.where(INDEX), hub.read_whole(INDEX))
        for shard in shards:
            if shard not in files:
                raise CheckpointError(hub.where(INDEX), f"names shard {shard!r}, which the repo does not have")
    else:
        shards = ["model.safetensors"] if "model.safetensors" in files else sorted(
            f for f in files if f.endswith(".safetensors") and "/" not in f)
    tensors, total = {}, 0
    for shard in shards:
        found, size = _remote_safetensors_header(hub, shard)
        tensors.update(found)
        total += size
    return CheckpointHeaders(spec, "safetensors", config, tensors, tuple(hub.where(s) for s in shards), total)


def _remote_safetensors_header(hub: Hub, filename: str) -> tuple[dict[str, TensorInfo], int]:
    """Two range requests: the 8-byte length prefix, then exactly the JSON header."""
    where = hub.where(filename)
    prefix, size = hub.read_range(filename, 0, 8)
    if len(prefix) < 8:
        raise CheckpointError(where, "file is truncated before its header")
    header_len = header_length(where, prefix, size)
    header, _ = hub.read_range(filename, 8, header_len)
    if len(header) < header_len:
        raise CheckpointError(where, "file ends inside its header; it is truncated")
    return parse_header_bytes(where, header, size)[0], size


def _remote_gguf(hub: Hub, spec: str, first: str, files: set[str]) -> CheckpointHeaders:
    folder, _, name = first.rpartition("/")
    prefix = f"{folder}/" if folder else ""
    names = [prefix + n for n in _split_gguf_names(name, lambda n: prefix + n in files, hub.where(first))]
    tensors, metadata, total = {}, None, 0
    for filename in names:
        stream = _RangeStream(hub, filename)
        found, meta = parse_gguf_header(stream, hub.where(filename), stream.size)
        tensors.update(found)
        metadata = metadata or meta
        total += stream.size
    config = gguf_config(metadata, _shapes(tensors), hub.where(first))
    return CheckpointHeaders(spec, "gguf", config, tensors, tuple(hub.where(n) for n in names), total)


class Hub:
    """One repo at one revision on HF_ENDPOINT: its file list, whole small files, and byte ranges."""

    def __init__(self, repo: str, revision: str):
        self.repo, self.revision = repo, revision
        self.endpoint = os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")
        token = os.environ.get("HF_TOKEN")
        headers = {"user-agent": "duet"} | ({"authorization": f"Bearer {token}"} if token else {})
        # httpx drops the Authorization header when a redirect leaves the endpoint's origin (the CDN).
        self.client = httpx.Client(headers=headers, follow_redirects=True, timeout=30.0)

    def __enter__(self) -> Hub:
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()

    def where(self, filename: str) -> str:
        return f"{self.repo}/{filename}"

    def list_files(self) -> set[str]:
        url = f"{self.endpoint}/api/models/{self.repo}/revision/{quote(self.revision, safe='')}"
        body, _ = self._get(url, self.repo, None, MAX_JSON_BYTES)  # a listing past this is cut and fails to parse
        try:
            names = {s["rfilename"] for s in json.loads(body)["siblings"]}
            if all(isinstance(name, str) for name in names):
                return names
        except (ValueError, RecursionError, KeyError, TypeError):
            pass
        raise DuetError(f"{self.repo}: {self.endpoint} answered the file listing with something that is not the hub's JSON")

    def read_whole(self, filename: str) -> bytes:
        """A small file (config.json, the shard index), refused past MAX_JSON_BYTES."""
        body, _ = self._get(self._url(filename), self.where(filename), None, MAX_JSON_BYTES + 1)
        if len(body) > MAX_JSON_BYTES:
            raise DuetError(f"{self.where(filename)}: larger than {MAX_JSON_BYTES >> 20} MiB; not a config or index file")
        return body

    def read_range(self, filename: str, start: int, length: int) -> tuple[bytes, int]:
        """Up to `length` bytes from `start`, and the file's size."""
        return self._get(self._url(filename), self.where(filename), (start, length), length)

    def _url(self, filename: str) -> str:
        return f"{self.endpoint}/{self.repo}/resolve/{quote(self.revision, safe='')}/{quote(filename)}"

    def _get(self, url: str, what: str, span: tuple[int, int] | None, limit: int) -> tuple[bytes, int]:
        headers = {"range": f"bytes={span[0]}-{span[0] + span[1] - 1}"} if span else {}
        try:
            with self.client.stream("GET", url, headers=headers) as response:
                self._check(response, what)
                size = _file_size(response)
                if response.status_code == 206 or not span:
                    return _read_at_most(response, limit), size
                # 200 to a range request: the server sends the whole file; take what we need and hang up.
                return _read_at_most(response, span[0] + span[1])[span[0]:], size
        except httpx.HTTPError as exc:
            raise DuetError(f"{what}: cannot reach {self.endpoint} ({type(exc).__name__}); check the network or HF_ENDPOINT") from None

    def _check(self, response: httpx.Response, what: str) -> None:
        status = response.status_code
        if status in (401, 403):
            raise DuetError(f"{what}: the hub refused access (HTTP {status}); the repo is gated or private: accept its terms and set HF_TOKEN")
        if status == 404:
            raise DuetError(f"{what}: not found on {self.endpoint} at revision {self.revision}")
        if status == 416:
            raise CheckpointError(what, "the file is shorter than its header says; it is truncated")
        if status not in (200, 206):
            raise DuetError(f"{what}: {self.endpoint} answered HTTP {status}; try again later")


def _file_size(response: httpx.Response) -> int:
    content_range = response.headers.get("content-range", "")
    total = content_range.rpartition("/")[2]
    if response.status_code == 206 and total.isdigit():
        return int(total)
    length = response.headers.get("content-length", "")
    return int(length) if length.isdigit() else -1


def _read_at_most(response: httpx.Response, limit: int) -> bytes:
    data = bytearray()
    for chunk in response.iter_bytes():
        data += chunk
        if len(data) >= limit:
            break
    return bytes(data[:limit])


class _RangeStream:
    """Sequential reads over a file on the hub, fetched in blocks that double up to MAX_BLOCK."""

    def __init__(self, hub: Hub, filename: str):
        self.hub, self.filename, self.pos, self.block = hub, filename, 0, FIRST_BLOCK
        first, self.size = hub.read_range(filename, 0, FIRST_BLOCK)
        self.data = bytearray(first)
        if self.size < 0:
            raise DuetError(f"{hub.where(filename)}: the server did not say how large the file is")

    def read(self, n: int) -> bytes:
        _check_within(self.hub.where(self.filename), self.pos + n, self.size)
        while self.pos + n > len(self.data):
            self.block = min(2 * self.block, MAX_BLOCK)
            wanted = min(max(self.block, self.pos + n - len(self.data)), self.size - len(self.data))
            more, _ = self.hub.read_range(self.filename, len(self.data), wanted)
            if not more:
                raise CheckpointError(self.hub.where(self.filename), "the server sent nothing for a range inside the file")
            self.data += more
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def tell(self) -> int:
        return self.pos
