"""GGUF block codecs: each quantized block type decoded to integer levels and per-sub-block scales.

A GGUF row of K weights is K / block blocks of `type_size` bytes. Every supported type decodes to

    weight = scale[sub] * level - minimum[sub]      (fp32, the same operations as ggml's reference)

with small integer levels (int8 range) and one scale (and, for Q4_K/Q5_K, one minimum) per
sub-block. That form is what the w4a8 route multiplies against int8 activations, and its
dequantization is bit-exact against `gguf.quants.dequantize`. Layouts (ggml-common.h, QK_K = 256):

    Q8_0   34 B / 32:  d f16 | qs int8[32]                         level = qs
    Q4_0   18 B / 32:  d f16 | qs[16]: k < 16 low nibble of qs[k], k >= 16 high nibble of qs[k-16]
                                                                   level = nibble - 8
    Q4_K  144 B / 256: d f16 | dmin f16 | scales[12] (8 x 6-bit sc, 8 x 6-bit m) | qs[128]
                       sub-block 2c / 2c+1 = low / high nibbles of qs[32c .. 32c+31]
                       scale = d * sc, minimum = dmin * m, level = nibble (0..15)
    Q5_K  176 B / 256: Q4_K plus qh[32] before qs: bit s of qh[i] is bit 4 of sub-block s, input i
    Q6_K  210 B / 256: ql[128] | qh[64] | scales int8[16] | d f16; 16 sub-blocks of 16
                       half h: low nibbles of ql[64h..] are inputs 0..63, high nibbles 64..127;
                       bits 2j..2j+1 of qh[32h + i] are bits 4..5 of input 32j + i; level = q - 32
    IQ4_XS 136 B / 256: d f16 | scales_h u16 | scales_l[4] | qs[128]; 8 sub-blocks of 32
                       ls = (4 bits of scales_l) | (2 bits of scales_h) << 4, scale = d * (ls - 32)
                       low / high nibbles of qs[16s ..] are inputs 0..15 / 16..31, level = KVALUES[nibble]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # levels [n, subs, sub], scale [n, subs], minimum
IQ4_KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _f16(raw: np.ndarray) -> np.ndarray:
    """A block's 2-byte f16 field, bytes [..., 2] -> fp32 [..., 1]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(raw: np.ndarray, run: int) -> np.ndarray:
    """Bytes [n, m] -> nibbles [n, m / run, 2, run]: per run of bytes, all low nibbles then all high."""
    runs = raw.reshape(raw.shape[0], -1, 1, run)
    return (runs >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0xF)


def decode_q8_0(blocks: np.ndarray) -> Decoded:
    return np.ascontiguousarray(blocks[:, 2:]).view(np.int8)[:, None, :], _f16(blocks[:, :2]), None


def decode_q4_0(blocks: np.ndarray) -> Decoded:
    levels = _nibbles(blocks[:, 2:], 16).astype(np.int8) - np.int8(8)
    return levels.reshape(-1, 1, 32), _f16(blocks[:, :2]), None


def k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes -> (sc [n, 8], m [n, 8]), 6 bits each.

    Bytes 0-3 hold sc0-3 (low 6 bits) and the top 2 bits of sc4-7; bytes 4-7 the same for m;
    bytes 8-11 hold the low 4 bits of sc4-7 (low nibble) and of m4-7 (high nibble).
    """
    d, m, low4 = np.split(packed.reshape(-1, 3, 4), 3, axis=1)
    sc = np.concatenate([d & 0x3F, (low4 & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (low4 >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(-1, 8), mins.reshape(-1, 8)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, m = k_scale_min(blocks[:, 4:16])
    return _f16(blocks[:, :2]) * sc.astype(np.float32), _f16(blocks[:, 2:4]) * m.astype(np.float32)


def decode_q4_k(blocks: np.ndarray) -> Decoded:
    scale, minimum = _k_scales(blocks)
    return _nibbles(blocks[:, 16:], 32).reshape(-1, 8, 32).astype(np.int8), scale, minimum


def decode_q5_k(blocks: np.ndarray) -> Decoded:
    scale, minimum = _k_scales(blocks)
    low = _nibbles(blocks[:, 48:], 32).reshape(-1, 8, 32)
    high = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & np.uint8(1)  # [n, 8, 32]
    return (low | (high << np.uint8(4))).astype(np.int8), scale, minimum


def decode_q6_k(blocks: np.ndarray) -> Decoded:
    low = _nibbles(blocks[:, :128], 64).reshape(-1, 8, 32)
    high = (blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    levels = (low | (high.reshape(-1, 8, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
    scale = _f16(blocks[:, 208:210]) * np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    return levels.reshape(-1, 16, 16), scale, None


def iq4_xs_sub_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks [n, 136] -> each sub-block's ls - 32, int8 [n, 8] (its scale is d times it)."""
    high = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))
    low = (blocks[:, 4:8, None] >> np.array([0, 4], np.uint8)).reshape(-1, 8) & np.uint8(0xF)
    return (low | ((high & 3).astype(np.uint8) << np.uint8(4))).astype(np.int8) - np.int8(32)


def decode_iq4_xs(blocks: np.ndarray) -> Decoded:
    levels = IQ4_KVALUES[_nibbles(blocks[:, 8:], 16).reshape(-1, 8, 32)]
    return levels, _f16(blocks[:, :2]) * iq4_xs_sub_scales(blocks).astype(np.float32), None


@dataclass(frozen=True)
class Codec:
    type_size: int  # bytes per block
    sub: int  # weights per scale
    decode: Callable[[np.ndarray], Decoded]


def _codec(qtype: GGMLQuantizationType, sub: int, decode) -> Codec:
    _, type_size = GGML_QUANT_SIZES[qtype]
    return Codec(type_size, sub, decode)


CODECS = {
    GGMLQuantizationType.Q8_0: _codec(GGMLQuantizationType.Q8_0, 32, decode_q8_0),
    GGMLQuantizationType.Q4_0: _codec(GGMLQuantizationType.Q4_0, 32, decode_q4_0),
    GGMLQuantizationType.Q4_K: _codec(GGMLQuantizationType.Q4_K, 32, decode_q4_k),
    GGMLQuantizationType.Q5_K: _codec(GGMLQuantizationType.Q5_K, 32, decode_q5_k),
    GGMLQuantizationType.Q6_K: _codec(GGMLQuantizationType.Q6_K, 16, decode_q6_k),
    GGMLQuantizationType.IQ4_XS: _codec(GGMLQuantizationType.IQ4_XS, 32, decode_iq4_xs),
}
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
SUPPORTED_TYPES = FLOAT_TYPES + tuple(CODECS)


def dequantize_blocks(qtype: GGMLQuantizationType, blocks: np.ndarray) -> np.ndarray:
    """Blocks uint8 [n, type_size] -> fp32 weights [n, block]."""
    levels, scale, minimum = CODECS[qtype].decode(blocks)
    weights = scale[..., None] * levels.astype(np.float32)
    if minimum is not None:
        weights = weights - minimum[..., None]
    return weights.reshape(blocks.shape[0], -1)


@dataclass(frozen=True)
class BlockMatrix:
    """A GGUF weight matrix [N, K] kept as the file's blocks: raw uint8 [N, K / block * type_size]."""

    qtype: GGMLQuantizationType
    raw: np.ndarray
    K: int

    @property
    def codec(self) -> Codec:
        return CODECS[self.qtype]

    @property
    def shape(self) -> tuple[int, int]:
        return self.raw.shape[0], self.K

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def block_size(self) -> int:
        """Inputs that share one scale: the unit `decode_rows` returns."""
        return self.codec.sub

    def decode_rows(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Rows start..stop as (levels fp32 [rows, K/sub, sub], scale [rows, K/sub], minimum or None)."""
        codec, rows = self.codec, stop - start
        levels, scale, minimum = codec.decode(self.raw[start:stop].reshape(-1, codec.type_size))
        subs = self.K // codec.sub
        return (levels.reshape(rows, subs, codec.sub).astype(np.float32), scale.reshape(rows, subs),
                None if minimum is None else minimum.reshape(rows, subs))

    def dequantize(self) -> np.ndarray:
        return self[np.arange(self.shape[0])]

    def __getitem__(self, rows) -> np.ndarray:
        """Rows dequantized to fp32 (an embedding lookup reads a few rows of the table this way)."""
        selected = self.raw[rows]
        blocks = selected.reshape(-1, self.codec.type_size)
        return dequantize_blocks(self.qtype, blocks).reshape(*selected.shape[:-1], self.K)

    def take_rows(self, rows: np.ndarray) -> BlockMatrix:
        return BlockMatrix(self.qtype, self.raw[rows], self.K)

