"""Activation rounding of the two quantized routes, and fp32 -> bf16 rounding.

- `w4a16` rounds activations to bf16 (round to nearest, ties to even), as the GPU stores them.
- `w4a8` quantizes activations to int8 per block of ACT_BLOCK inputs: scale = absmax / 127 in
  fp32, q = round(x / scale). 32 is the k of one int8 mma (m16n8k32) and divides every weight
  block (INT4 groups of 128, GGUF blocks of 32 and 256), so a block never straddles two weight scales
  except Q6_K's scales of 16, which split it in two.
"""

from __future__ import annotations

import numpy as np

ACT_BLOCK = 32
INT8_MAX = 127


# What PTX's cvt.rn.bf16.f32 writes for any NaN: the rounding carry below would run a NaN with a
# full mantissa (0x7FFFFFFF) into the sign bit and make it -0.0.
BF16_NAN = 0x7FFF


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits (uint16), round to nearest even: add 0x7FFF plus the kept lsb, drop 16 bits."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(BF16_NAN), rounded)


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest bf16 value, as fp32."""
    return (f32_to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def quantize_int8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [T, K] -> (q [T, K/32, 32] integer values -127..127 held in fp32, scales fp32 [T, K/32]).

    x is approximately q * scale; |x - q * scale| <= scale / 2 elementwise. An all-zero block has
    scale 0 and q 0.
    """
    T, K = x.shape
    blocks = x.astype(np.float32).reshape(T, K // ACT_BLOCK, ACT_BLOCK)
    scales = np.abs(blocks).max(axis=-1) / np.float32(INT8_MAX)
    safe = np.where(scales > 0, scales, np.float32(1))[..., None]
    return np.rint(blocks / safe), scales
