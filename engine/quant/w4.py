"""The engine's W4 layout: symmetric INT4 weights, one bf16 scale per 128 consecutive inputs.

Stored form of a weight W [N, K] (N outputs, K inputs, K a multiple of 128), and exactly what the
GPU W4A16 kernel streams:

    packed  uint32 [N, K/8]    word j of row n holds k = 8j .. 8j+7; input k = 8j + i sits in
                               bits 4i .. 4i+3 as the unsigned nibble u = level + 8 (level -8..7)
    scales  uint16 [N, K/128]  bf16 bits of the scale of inputs 128g .. 128g+127 of row n

    W[n, k] = bf16(scales[n, k // 128]) * (nibble(n, k) - 8)

Little-endian, byte b of a word holds k = 8j + 2b (low nibble) and 8j + 2b + 1 (high nibble).
On the GPU, `(w >> 4i) & 0x000F000F | 0x43004300` makes the bf16 pair (128 + u_i, 128 + u_{i+4}),
and one bf16x2 fma with 1.0 and -136.0 gives the exact levels (REFERENCE.md section 3): a
register then holds inputs 8j + i and 8j + i + 4, and the kernel loads activations in that order.

compressed-tensors `pack-quantized` uses this very bit layout (int32 [N, K/8]); GPTQ packs the
same nibble order along K in qweight [K/8, N], so both repack by a reinterpretation or a transpose.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from duet.engine.checkpoint.safetensors import bf16_to_f32
from duet.engine.quant.activation import f32_to_bf16_bits

GROUP = 128  # inputs per scale
NIBBLES = 8  # inputs per uint32 word
OFFSET = 8  # stored nibble = level + OFFSET
LEVEL_MIN, LEVEL_MAX = -8, 7
# Round-to-nearest symmetric INT4 as compressed-tensors and GPTQ compute it: the scale maps the
# group's absmax to half the 16-level range, 7.5; levels clip to -8..7.
HALF_RANGE = 7.5

# Every uint16 (four nibbles, k ascending from the low nibble) -> its four signed levels.
_LEVELS_OF_HALFWORD = (((np.arange(1 << 16, dtype=np.uint32)[:, None] >> (4 * np.arange(4, dtype=np.uint32)))
                        & 0xF).astype(np.float32) - OFFSET)


@dataclass(frozen=True)
class W4Weight:
    """A weight matrix in the W4 layout (see the module docstring)."""

    packed: np.ndarray  # uint32 [N, K / 8]
    scales: np.ndarray  # uint16 bf16 bits [N, K / 128]

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * NIBBLES

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes

    def block_size(self) -> int:
        """Inputs that share one scale: the unit `decode_rows` returns."""
        return GROUP

    def decode_rows(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, None]:
        """Rows start..stop as (levels fp32 [rows, K/128, 128], scales fp32 [rows, K/128], no minimum)."""
        rows = stop - start
        halfwords = self.packed[start:stop].view(np.uint16).reshape(-1)  # little-endian: low half first
        levels = np.take(_LEVELS_OF_HALFWORD, halfwords, axis=0)  # [rows * K/4, 4]
        return levels.reshape(rows, -1, GROUP), bf16_to_f32(self.scales[start:stop]), None

    def levels(self) -> np.ndarray:
        """Signed levels int8 [N, K]."""
        return unpack_levels(self.packed)

    def dequantize(self) -> np.ndarray:
        """W as fp32 [N, K]: every value is exact (bf16 scale times a small integer)."""
        N, K = self.shape
        scales = bf16_to_f32(self.scales)
        return (self.levels().reshape(N, -1, GROUP) * scales[:, :, None]).reshape(N, K)

    def take_rows(self, rows: np.ndarray) -> W4Weight:
        return W4Weight(self.packed[rows], self.scales[rows])


def pack_levels(levels: np.ndarray) -> np.ndarray:
    """Signed levels int [N, K] in -8..7 -> packed uint32 [N, K/8] (input 8j + i in bits 4i..4i+3)."""
    N, K = levels.shape
    nibbles = (levels.astype(np.int64) + OFFSET).astype(np.uint32).reshape(N, K // NIBBLES, NIBBLES)
    return np.bitwise_or.reduce(nibbles << (4 * np.arange(NIBBLES, dtype=np.uint32)), axis=-1)


def unpack_levels(packed: np.ndarray) -> np.ndarray:
    """packed uint32 [N, K/8] -> signed levels int8 [N, K]."""
    nibbles = (packed[..., None] >> (4 * np.arange(NIBBLES, dtype=np.uint32))) & 0xF
    return (nibbles.astype(np.int8) - OFFSET).reshape(packed.shape[0], -1)


def quantize_rtn(weight: np.ndarray) -> W4Weight:
    """Round-to-nearest symmetric INT4, group 128: scale = bf16(absmax / 7.5), level = clip(round(w / scale))."""
    N, K = weight.shape
    groups = weight.astype(np.float32).reshape(N, K // GROUP, GROUP)
    scale_bits = f32_to_bf16_bits(np.abs(groups).max(axis=-1) / np.float32(HALF_RANGE))
    scales = bf16_to_f32(scale_bits)[:, :, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        levels = np.where(scales > 0, np.rint(groups / scales), 0.0)
    levels = np.clip(levels, LEVEL_MIN, LEVEL_MAX).reshape(N, K)
    return W4Weight(pack_levels(levels), scale_bits)


def repack_scales(scales: np.ndarray, group: int, K: int) -> np.ndarray:
    """Float scales [N, K / group] of a symmetric INT4 file -> bf16 bits [N, K / 128].

    A group of a multiple of 128 inputs (or one per row, group -1) spans whole 128-groups, so its
    scale repeats exactly; smaller groups cannot be expressed and are refused by the caller.
    """
    per_128 = K // GROUP if group == -1 else group // GROUP
    return f32_to_bf16_bits(np.repeat(scales.astype(np.float32), per_128, axis=1))
