"""Stored tensors as the checkpoint readers hand them over, and the stacking of matrices by rows.

A stored matrix is one of:
    np.ndarray      float weights in fp32 [N, K] (fp32 / fp16 files, GGUF float tensors)
    BF16Matrix      a bf16 checkpoint's matrix as its 16-bit patterns, widened where used
    W4Weight        4-bit levels, bf16 scale per 128 inputs (engine/quant/w4.py)
    BlockMatrix     a GGUF file's quantized blocks as they are (engine/quant/gguf_blocks.py)
    TrellisWeight   trellis-coded tiles, Hadamard-rotated (engine/quant/trellis.py)
    InputOrder      any of the above whose input columns are stored in another order
A table read a few rows at a time and never whole (Flash-Next's n-gram embeddings) is a ShardedRows.
Readers produce these (engine/checkpoint/*); the assembler (engine/assemble.py) hands them to a
backend, which turns each into a Linear of the chosen route. Nothing here computes a product.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES

from duet.engine.checkpoint.safetensors import bf16_to_f32, release_file_pages
from duet.engine.config import ModelConfig
from duet.engine.quant.gguf_blocks import BlockMatrix
from duet.engine.quant.trellis import TrellisWeight
from duet.engine.quant.w4 import W4Weight

HEAD_KEY = {True: "embed_tokens.weight", False: "lm_head.weight"}  # the output head's model key, by tie_word_embeddings


@dataclass(frozen=True)
class BF16Matrix:
    """A bf16 matrix kept as stored: bits uint16 [N, K], half the bytes of the fp32 it stands for
    (bf16 is the top half of an fp32, so widening is exact). Linears read the bits (the compiled
    CPU kernel) or widen once (the numpy reference, the GPU upload); an embedding widens the rows it
    looks up."""

    bits: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.bits.shape

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes

    def dequantize(self) -> np.ndarray:
        return bf16_to_f32(self.bits)

    def __getitem__(self, rows) -> np.ndarray:
        return bf16_to_f32(self.bits[rows])


@dataclass(frozen=True)
class InputOrder:
    """A weight whose input columns are stored in another order: the model's x is gathered by `order`
    (GGUF qwen35 files keep DeltaNet value heads tiled; the model computes them grouped)."""

    weight: object
    order: np.ndarray


@dataclass(frozen=True)
class ShardedRows:
    """A table stored in shards along its rows (HF's `ngram_embedding.shard_{j}.weight`), kept as views
    of the memory-mapped files: a lookup gathers its rows from the page cache. Never read whole and
    never concatenated: Flash-Next's n-gram tables are tens of GB and a token reads a few rows."""

    shards: tuple  # [rows_j, D] each: fp32 or fp16 values, bf16 bits (uint16), or a GGUF file's blocks
    bf16: bool

    @property
    def starts(self) -> np.ndarray:
        """First row of each shard, then the row count."""
        return np.concatenate([[0], np.cumsum([shard.shape[0] for shard in self.shards])])

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.starts[-1]), self.shards[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(shard.nbytes for shard in self.shards)

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        """Rows [*ids.shape, D] in fp32; ids must be below the row count."""
        flat = np.asarray(ids, dtype=np.int64).ravel()
        starts = self.starts
        shard_of = np.searchsorted(starts, flat, side="right") - 1
        out = np.empty((flat.size, self.shape[1]), np.float32)
        for j in np.unique(shard_of):
            at = np.nonzero(shard_of == j)[0]
            rows = self.shards[j][flat[at] - starts[j]]
            out[at] = bf16_to_f32(rows) if self.bf16 else rows
        return out.reshape(*np.shape(ids), self.shape[1])


@dataclass
class ModelWeights:
    """Every tensor a model needs, by model key (`layers.3.mlp.down_proj.weight`, `lm_head.weight`,
    `mtp.fc.weight`), whatever the checkpoint called it. Vectors are fp32 arrays; matrices are stored
    matrices (see above). `fused_experts`: experts come as [E, ...] tensors (`experts.gate_up_proj`)."""

    config: ModelConfig
    tensors: dict
    has_mtp: bool
    fused_experts: bool

    def __call__(self, key: str):
        return self.tensors[key]


def row_runs(parts: list) -> list:
    """Matrices to be stacked by rows (gate then up; q | k | v | z | b | a), merged wherever
    consecutive parts share a storage form: one stored matrix per run, in order."""
    runs = [[parts[0]]]
    for part in parts[1:]:
        if same_storage(runs[-1][0], part):
            runs[-1].append(part)
        else:
            runs.append([part])
    return [stack_rows(run) for run in runs]


def same_storage(a, b) -> bool:
    """Whether b can join a in one stored matrix (same form, same block layout along K)."""
    if isinstance(a, (np.ndarray, W4Weight, BF16Matrix)):
        return type(a) is type(b)
    if isinstance(a, TrellisWeight):
        return isinstance(b, TrellisWeight) and (a.k, a.seed, a.shape[1]) == (b.k, b.seed, b.shape[1])
    if isinstance(a, BlockMatrix):
        return isinstance(b, BlockMatrix) and (a.qtype, a.K) == (b.qtype, b.K)
    return False  # InputOrder and the like stay as they are


def stack_rows(run: list):
    """One stored matrix holding the rows of every matrix of run (all of one storage form), in order."""
    first = run[0]
    if len(run) == 1:
        return first
    if isinstance(first, np.ndarray):
        return np.concatenate(run)
    if isinstance(first, BF16Matrix):
        return BF16Matrix(np.concatenate([p.bits for p in run]))
    if isinstance(first, W4Weight):
        return W4Weight(np.concatenate([p.packed for p in run]), np.concatenate([p.scales for p in run]))
    if isinstance(first, TrellisWeight):
        # Tiles are stored row band by row band (trellis.to_tiles), so stacking rows concatenates tiles.
        return TrellisWeight(np.concatenate([p.packed for p in run]), np.concatenate([p.row_scale for p in run]),
                             (sum(p.shape[0] for p in run), first.shape[1]), first.k, first.seed)
    stacked = BlockMatrix(first.qtype, np.concatenate([p.raw for p in run]), first.K)
    for part in run:  # the copy is what the model keeps (gate | up, q | k | v | z ...)
        release_file_pages(part.raw)
    return stacked


def take_columns(matrix, cols: slice):
    """A contiguous run of a stored matrix's input columns: a view of float weights, the blocks that hold
    it for GGUF blocks (the run must start and end on a block)."""
    if isinstance(matrix, np.ndarray):
        return matrix[:, cols]
    if isinstance(matrix, BlockMatrix):
        size, block = GGML_QUANT_SIZES[matrix.qtype]  # weights, bytes a block
        if cols.start % size or cols.stop % size:
            raise ValueError(f"columns {cols.start}:{cols.stop} cut a block of {size}")
        return BlockMatrix(matrix.qtype, matrix.raw[:, cols.start // size * block : cols.stop // size * block],
                           cols.stop - cols.start)
    raise ValueError(f"cannot take columns of a {type(matrix).__name__}")


def take_rows(matrix, rows: np.ndarray | slice):
    """Some rows of a stored matrix: a view for float weights (fp32, bf16 bits) and slices, a copy of
    the rows' blocks else."""
    if isinstance(matrix, np.ndarray):
        return matrix[rows]
    if isinstance(matrix, BF16Matrix):
        return BF16Matrix(matrix.bits[rows])
    index = np.arange(matrix.shape[0])[rows]
    taken = matrix.take_rows(index)
    if isinstance(matrix, BlockMatrix) and index.size:  # the copy is what the model keeps
        release_file_pages(matrix.raw[index.min() : index.max() + 1])
    return taken
