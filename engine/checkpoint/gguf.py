"""GGUF checkpoints (llama.cpp's format) of the qwen35, qwen35moe and qwen3next architectures.

The header is parsed by our checked reader (headers.read_gguf_header: every count, length and offset
checked against the file; the gguf package's reader trusts them, and took 10 s over a 248k-token
vocabulary) and the data memory-mapped; the file is presented to hf.TensorPlan under the HF names the
model assembly knows; which GGUF tensor holds each, and what llama.cpp's converter did to it, is the table in
gguf_names.py. Every tensor's shape is checked against that table before any data is read.

Float tensors (F32, F16, BF16) are widened to fp32; quantized ones stay as the file's blocks
(quant/gguf_blocks.BlockMatrix, memory-mapped) and run on the w4a8 route, or dequantized on bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from duet.engine.checkpoint.gguf_names import (EOS_KEY, NGRAM_TABLE, GGUFTensor, Link, check_architecture, gguf_config,
                                              gguf_tensors, ngram_constants)
from duet.engine.checkpoint.headers import read_gguf_header
from duet.engine.checkpoint.hf import checkpoint_name
from duet.engine.checkpoint.safetensors import TensorInfo, bf16_to_f32
from duet.engine.errors import CheckpointError
from duet.engine.quant.gguf_blocks import CODECS, SUPPORTED_TYPES, BlockMatrix
from duet.engine.tokenizer import Tokenizer
from duet.engine.weights import same_storage, stack_rows

QUANTIZED_ROUTES = ("w4a8", "bf16")  # the natural route first
FLOAT_ROUTES = ("bf16",)


def find_gguf(path: Path) -> Path | None:
    """path itself if it is a .gguf file; the one .gguf of a folder without config.json; else None."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            names = ", ".join(p.name for p in found)
            raise CheckpointError(path, f"holds several GGUF files ({names}); pass --model with one of them")
        return found[0] if found else None
    return None


@dataclass(frozen=True)
class Entry:
    """One model tensor (HF name) and how to make it from the GGUF file."""

    source: str  # GGUF tensor name, for messages
    shape: tuple[int, ...]  # HF shape
    nbytes: int
    quantized: bool
    load: Callable[[], object]
    dtype: str = "F32"  # what the loaded tensor is: fp32 (or blocks, when quantized); I64 for hash constants


class GGUFCheckpoint:
    """A GGUF file seen as a checkpoint with HF tensor names (the interface TensorPlan reads)."""

    def __init__(self, path: Path):
        self.path = self.model_dir = Path(path)
        if not self.path.is_file():
            raise CheckpointError(self.path, "file not found; pass --model with a .gguf file")
        self.tensors, self.fields = read_gguf_header(self.path, arrays=True)
        self.types = {name: _block_type(info.dtype) for name, info in self.tensors.items()}
        self._file = np.memmap(self.path, np.uint8, mode="r").view(np.ndarray)  # plain views: no memmap per slice
        self.arch = self._optional("general.architecture")
        check_architecture(self.arch, self.path)
        self._check_types()
        self.config = gguf_config(self._metadata(), {name: self._shape(name) for name in self.tensors}, self.path)
        self.entries = self._entries()
        self.quantized = QuantizedView(self)

    # ---- what TensorPlan asks of a checkpoint

    def names(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def info(self, name: str) -> TensorInfo:
        entry = self.entries[name]
        return TensorInfo(name, entry.dtype, entry.shape, 0, entry.nbytes)

    def file_of(self, name: str) -> Path:
        return self.path

    def read_f32(self, name: str) -> np.ndarray:
        return self.entries[name].load()

    def read_ints(self, name: str) -> np.ndarray:
        return self.entries[name].load()

    def mapped(self, name: str):
        """A table a model gathers rows from (Flash-Next's n-gram table): fp32 rows, or the file's
        memory-mapped blocks, which a lookup dequantizes a row at a time."""
        return self.entries[name].load()

    def close(self) -> None:
        """Let go of the parsed metadata (the tokenizer's vocabulary and merges alone are some 20 MB of
        Python strings) and the entries, whose loaders point back here: a cycle that would keep both
        until the next garbage collection. Quantized blocks stay memory-mapped for as long as the
        model uses them."""
        self.fields, self.entries = {}, {}

    # ---- what the loader asks

    @property
    def block_types(self) -> list[str]:
        return sorted({kind.name for kind in self.types.values() if kind in CODECS})

    @property
    def routes(self) -> tuple[str, ...]:
        return QUANTIZED_ROUTES if self.block_types else FLOAT_ROUTES

    @property
    def description(self) -> str:
        return "GGUF " + ("/".join(self.block_types) or "float")

    def tokenizer(self) -> Tokenizer:
        model = self._value("tokenizer.ggml.model")
        if model != "gpt2":
            raise CheckpointError(self.path, f"tokenizer model {model!r} is not supported; duet reads gpt2-style BPE")
        tokens = self._value("tokenizer.ggml.tokens")
        return Tokenizer.from_gguf_vocab(
            tokens=tokens,
            token_types=self._value("tokenizer.ggml.token_type"),
            merges=self._value("tokenizer.ggml.merges"),
            pre=self._optional("tokenizer.ggml.pre") or "gpt-2",
            bos_id=self._token_id("tokenizer.ggml.bos_token_id", tokens),
            eos_id=self._token_id(EOS_KEY, tokens),
            pad_id=self._token_id("tokenizer.ggml.padding_token_id", tokens),
            extra_eos_ids=[i for i in [self._token_id("tokenizer.ggml.eot_token_id", tokens)] if i is not None],
            chat_template=self._optional("tokenizer.chat_template"),
            source=self.path,
        )

    # ---- metadata

    def _value(self, key: str):
        if key not in self.fields:
            raise CheckpointError(self.path, f"metadata key {key} is missing; the file is not a complete {self.arch} GGUF")
        return self.fields[key]

    def _optional(self, key: str):
        return self.fields.get(key)

    def _token_id(self, key: str, tokens: list[str]) -> int | None:
        value = self._optional(key)
        if value is not None and not (isinstance(value, int) and 0 <= value < len(tokens)):
            raise CheckpointError(self.path, f"metadata key {key} is {value!r}, not a token id")
        return value

    def _metadata(self) -> dict:
        """The keys the config is made from (the token list and merges are left unread)."""
        return {key: value for key, value in self.fields.items()
                if key.startswith(f"{self.arch}.") or key in ("general.architecture", EOS_KEY)}

    # ---- tensors

    def _check_types(self) -> None:
        for name, kind in self.types.items():
            if kind not in SUPPORTED_TYPES:
                supported = ", ".join(t.name for t in SUPPORTED_TYPES)
                stored = kind.name if kind is not None else self.tensors[name].dtype
                raise CheckpointError(self.path, f"tensor {name} is {stored}, a block type duet does not read; "
                                                 f"supported: {supported}")

    def _shape(self, name: str) -> tuple[int, ...]:
        """numpy order (the reverse of GGUF's ne), trailing ones of ne (leading here) dropped."""
        dims = list(self.tensors[name].shape)
        while len(dims) > 1 and dims[0] == 1:
            dims.pop(0)
        return tuple(dims)

    def _check_shape(self, tensor: GGUFTensor) -> None:
        if tensor.name not in self.tensors:
            raise CheckpointError(self.path, f"tensor {tensor.name} is missing; the file is not a complete {self.arch} GGUF")
        expected = list(tensor.shape)
        while len(expected) > 1 and expected[0] == 1:  # as _shape drops ne's trailing ones
            expected.pop(0)
        if self._shape(tensor.name) != tuple(expected):
            raise CheckpointError(self.path, f"tensor {tensor.name} has shape {list(self._shape(tensor.name))}, the "
                                             f"metadata implies {list(tensor.shape)}; the file is corrupt or mislabelled")

    def _data(self, tensor: GGUFTensor, expert: int | None):
        """The tensor's stored data as numpy rows of the table's shape (one expert's, if given)."""
        info, kind = self.tensors[tensor.name], self.types[tensor.name]
        data = self._file[info.begin : info.end]
        if kind in FLOAT_DTYPES:
            data = data.view(FLOAT_DTYPES[kind])
        data = data.reshape(*tensor.shape[:-1], -1)
        return data if expert is None else data[expert]

    def _float(self, tensor: GGUFTensor, expert: int | None) -> np.ndarray:
        """fp32 in numpy order, whatever the stored type."""
        kind, data = self.types[tensor.name], self._data(tensor, expert)
        if kind == GGMLQuantizationType.F32:
            return np.array(data, dtype=np.float32)
        if kind == GGMLQuantizationType.F16:
            return data.astype(np.float32)
        if kind == GGMLQuantizationType.BF16:
            return bf16_to_f32(np.ascontiguousarray(data))
        return BlockMatrix(kind, data.reshape(-1, data.shape[-1]), tensor.shape[-1]).dequantize().reshape(
            *data.shape[:-1], tensor.shape[-1])

    def _stored(self, tensor: GGUFTensor, expert: int | None):
        """A matrix as the file stores it: fp32 array, or BlockMatrix of the file's blocks."""
        kind = self.types[tensor.name]
        if tensor.float32 or kind not in CODECS:
            return self._float(tensor, expert)
        return BlockMatrix(kind, self._data(tensor, expert), tensor.shape[-1])

    def _entries(self) -> dict[str, Entry]:
        entries: dict[str, Entry] = {}
        pieces: dict[str, list[tuple[GGUFTensor, Link]]] = {}  # model tensors held by several GGUF tensors
        ngram_rows = self._shape(NGRAM_TABLE)[0] if NGRAM_TABLE in self.tensors else 0
        for tensor in gguf_tensors(self.config, self.arch, self.config.mtp_num_hidden_layers > 0, ngram_rows):
            self._check_shape(tensor)
            stored = self.tensors[tensor.name]
            quantized = not tensor.float32 and self.types[tensor.name] in CODECS
            for link in tensor.links:
                if link.part_of is not None:
                    pieces.setdefault(link.key, []).append((tensor, link))
                    continue
                entries[checkpoint_name(link.key)] = Entry(tensor.name, link.model_shape(tensor.shape),
                                                           stored.nbytes // len(tensor.links), quantized,
                                                           partial(self._load, tensor, link))
        for key, parts in pieces.items():
            parts.sort(key=lambda part: part[1].part_of.start)
            shapes = [link.model_shape(tensor.shape) for tensor, link in parts]
            entries[checkpoint_name(key)] = Entry(
                " + ".join(tensor.name for tensor, _ in parts), (sum(shape[0] for shape in shapes), *shapes[0][1:]),
                sum(self.tensors[tensor.name].nbytes for tensor, _ in parts),
                all(self.types[tensor.name] in CODECS for tensor, _ in parts), partial(self._load_parts, parts))
        for key, value in ngram_constants(self._metadata(), self.config, self.path).items():
            entries[checkpoint_name(key)] = Entry("metadata", value.shape, value.nbytes, False, lambda v=value: v, "I64")
        return entries

    def _load(self, tensor: GGUFTensor, link: Link):
        return link.from_gguf(self._stored(tensor, link.expert))

    def _load_parts(self, parts: list[tuple[GGUFTensor, Link]]):
        """A model tensor stacked from the rows several GGUF tensors hold (index_qk_proj from indexer.q_proj
        and indexer.k_proj): one stored matrix when the parts share a form, fp32 otherwise."""
        loaded = [self._load(tensor, link) for tensor, link in parts]
        if all(same_storage(loaded[0], part) for part in loaded[1:]):
            return stack_rows(loaded)
        return np.concatenate([part if isinstance(part, np.ndarray) else part.dequantize() for part in loaded])


class QuantizedView:
    """The quantized matrices of a GGUFCheckpoint, as TensorPlan's `quantized` reads them."""

    def __init__(self, ckpt: GGUFCheckpoint):
        self.ckpt = ckpt

    def __contains__(self, name: str) -> bool:
        entry = self.ckpt.entries.get(name)
        return entry is not None and entry.quantized

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        entry = self.ckpt.entries[name]
        if entry.shape != shape:
            raise CheckpointError(self.ckpt.path, f"tensor {entry.source} holds {list(entry.shape)} for {name}, "
                                                  f"the metadata implies {list(shape)}")

    def nbytes(self, name: str) -> int:
        return self.ckpt.entries[name].nbytes

    def read(self, name: str):
        return self.ckpt.entries[name].load()


FLOAT_DTYPES = {GGMLQuantizationType.F32: np.dtype("<f4"), GGMLQuantizationType.F16: np.dtype("<f2"),
                GGMLQuantizationType.BF16: np.dtype("<u2")}  # bf16 as its bits


def _block_type(name: str) -> GGMLQuantizationType | None:
    """The header reader's type name -> the gguf package's enum; None for a type it does not know."""
    return GGMLQuantizationType.__members__.get(name)

