"""Stored tensors as the checkpoint readers hand them over, and the stacking of matrices by rows.

A stored matrix is one of:
    np.ndarray      float weights, widened to fp32 [N, K]
    W4Weight        4-bit levels, bf16 scale per 128 inputs (engine/quant/w4.py)
    BlockMatrix     a GGUF file's quantized blocks as they are (engine/quant/gguf_blocks.py)
    TrellisWeight   trellis-coded tiles, Hadamard-rotated (engine/quant/trellis.py)
    InputOrder      any of the above whose input columns are stored in another order
Readers produce these (engine/checkpoint/*); the assembler (engine/assemble.py) hands them to a
backend, which turns each into a Linear of the chosen route. Nothing here computes a product.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from duet.engine.config import ModelConfig
from duet.engine.quant.gguf_blocks import BlockMatrix
from duet.engine.quant.trellis import TrellisWeight
from duet.engine.quant.w4 import W4Weight

HEAD_KEY = {True: "embed_tokens.weight", False: "lm_head.weight"}  # the output head's model key, by tie_word_embeddings


@dataclass(frozen=True)
class InputOrder:
    """A weight whose input columns are stored in another order: the model's x is gathered by `order`
    (GGUF qwen35 files keep DeltaNet value heads tiled; the model computes them grouped)."""

    weight: object
    order: np.ndarray


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


def same_storage(a, b) -> bool:
    """Whether b can join a in one stored matrix (same form, same block layout along K)."""
    if isinstance(a, (np.ndarray, W4Weight)):
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


def take_rows(matrix, rows: np.ndarray | slice):
    """Some rows of a stored matrix: a view for float weights and slices, a copy of the rows' blocks else."""
    if isinstance(matrix, np.ndarray):
        return matrix[rows]
    index = np.arange(matrix.shape[0])[rows]
    taken = matrix.take_rows(index)
    if isinstance(matrix, BlockMatrix) and index.size:  # the copy is what the model keeps
        release_file_pages(matrix.raw[index.min() : index.max() + 1])
    return taken
