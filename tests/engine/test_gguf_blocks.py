"""GGUF block codecs: bit-exact against gguf.quants.dequantize, and the w4a8 route on every block type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from duet.engine.backend.cpu import W4A8Linear
from duet.engine.quant.activation import quantize_int8_blocks
from duet.engine.quant.gguf_blocks import CODECS, BlockMatrix, dequantize_blocks

# Byte offsets of each block type's f16 fields (ggml-common.h): d, and dmin for the K-quants with minimums.
F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,)}
TYPES = list(F16_FIELDS)


def random_blocks(qtype: Q, count: int, seed: int) -> np.ndarray:
    """Random bytes for the quantized fields, finite random f16 for the scales."""
    rng = np.random.default_rng(seed)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (count, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = rng.uniform(-0.02, 0.02, count).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(count, 2)
    return blocks


def test_every_required_type_has_a_codec():
    assert set(TYPES) == set(CODECS)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decode_is_bit_exact_against_gguf_reference(qtype):
    blocks = random_blocks(qtype, 512, seed=qtype.value)
    ours = dequantize_blocks(qtype, blocks)
    reference = gguf.quants.dequantize(blocks.reshape(-1), qtype).reshape(ours.shape)
    assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_block_matrix_rows_match_reference(qtype):
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    N, K = 24, 2 * 256
    raw = random_blocks(qtype, N * K // block, seed=7).reshape(N, K // block * type_size)
    matrix = BlockMatrix(qtype, raw, K)
    reference = gguf.quants.dequantize(raw, qtype)
    assert np.array_equal(matrix.dequantize(), reference)
    assert np.array_equal(matrix[np.array([3, 3, 0])], reference[[3, 3, 0]])  # embedding lookup


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_w4a8_on_each_type_is_within_the_activation_rounding_bound(qtype):
    """|y - x W^T| <= sum over k of |W[n, k]| * scale(block of k) / 2, the int8 rounding of x, plus fp32 slack."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    N, K = 40, 512
    raw = random_blocks(qtype, N * K // block, seed=11).reshape(N, -1)
    weight = BlockMatrix(qtype, raw, K)
    dense = weight.dequantize()
    x = np.random.default_rng(3).standard_normal((20, K)).astype(np.float32)
    y = W4A8Linear(weight)(x)
    exact = x.astype(np.float64) @ dense.T.astype(np.float64)
    _, act_scale = quantize_int8_blocks(x)
    bound = (np.repeat(act_scale, 32, axis=1) / 2) @ np.abs(dense).T
    slack = 1e-5 * (np.abs(x) @ np.abs(dense).T)
    assert np.all(np.abs(y - exact) <= bound + slack)
    assert np.abs(y - exact).max() > 0  # activations really were rounded


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_w4a8_row_does_not_depend_on_how_many_rows_came(qtype):
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    weight = BlockMatrix(qtype, random_blocks(qtype, 16 * 256 // block, seed=2).reshape(16, -1), 256)
    x = np.random.default_rng(0).standard_normal((9, 256)).astype(np.float32)
    linear = W4A8Linear(weight)
    assert np.array_equal(linear(x)[4], linear(x[4:5])[0])
