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
    assert ours.shape == (512, gguf.GGML_QUANT_SIZES[qtype][0]) and ours.dtype == np.float32  # [n, block]
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


# ---- each decoder's parts (levels, scales, minimums) against the layouts of ggml-common.h, byte by byte


def f16_at(block: np.ndarray, offset: int) -> np.float32:
    return np.float32(np.frombuffer(bytes(block[offset : offset + 2]), "<f2")[0])


def scale_min_k4_by_hand(q: np.ndarray, j: int) -> tuple[int, int]:
    """ggml's get_scale_min_k4 for sub-block j of a Q4_K/Q5_K block's 12 scale bytes q."""
    q = [int(v) for v in q]
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def levels_by_hand(qtype: Q, block: np.ndarray) -> tuple[list[int], list[np.float32], list[np.float32] | None]:
    """(levels of the block's weights in order, scale per sub-block, minimum per sub-block)."""
    b = [int(v) for v in block]
    s8 = lambda v: v - 256 if v > 127 else v
    if qtype == Q.Q8_0:
        return [s8(v) for v in b[2:34]], [f16_at(block, 0)], None
    if qtype == Q.Q4_0:
        return [(b[2 + k] & 0xF) - 8 for k in range(16)] + [(b[2 + k] >> 4) - 8 for k in range(16)], [f16_at(block, 0)], None
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = f16_at(block, 0), f16_at(block, 2)
        pairs = [scale_min_k4_by_hand(block[4:16], j) for j in range(8)]
        qs = b[16:144] if qtype == Q.Q4_K else b[48:176]
        levels = []
        for s in range(8):
            for i in range(32):
                q = qs[32 * (s // 2) + i]
                level = (q & 0xF) if s % 2 == 0 else (q >> 4)
                if qtype == Q.Q5_K:
                    level |= ((b[16 + i] >> s) & 1) << 4
                levels.append(level)
        return levels, [d * np.float32(sc) for sc, _ in pairs], [dmin * np.float32(m) for _, m in pairs]
    if qtype == Q.Q6_K:
        ql, qh, sc, d = b[:128], b[128:192], [s8(v) for v in b[192:208]], f16_at(block, 208)
        levels = [0] * 256
        for h in range(2):
            for i in range(64):
                low = ql[64 * h + (i % 64)]
                for j, nib in ((0, low & 0xF), (2, low >> 4)):
                    k = 32 * j + i  # low nibbles: inputs 0..63; high nibbles: 64..127
                    levels[128 * h + k] = nib | (((qh[32 * h + k % 32] >> (2 * (k // 32))) & 3) << 4)
        return [v - 32 for v in levels], [d * np.float32(s) for s in sc], None
    assert qtype == Q.IQ4_XS
    d, scales_h = f16_at(block, 0), b[2] | (b[3] << 8)
    kvalues = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]
    scales, levels = [], []
    for s in range(8):
        ls = ((b[4 + s // 2] >> (4 * (s % 2))) & 0xF) | (((scales_h >> (2 * s)) & 3) << 4)
        scales.append(d * np.float32(ls - 32))
        qs = b[8 + 16 * s : 8 + 16 * s + 16]
        levels += [kvalues[q & 0xF] for q in qs] + [kvalues[q >> 4] for q in qs]
    return levels, scales, None


SUB = {Q.Q8_0: 32, Q.Q4_0: 32, Q.Q4_K: 32, Q.Q5_K: 32, Q.Q6_K: 16, Q.IQ4_XS: 32}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_decoder_parts_follow_the_byte_layout(qtype):
    blocks = random_blocks(qtype, 3, seed=100 + qtype.value)
    levels, scale, minimum = CODECS[qtype].decode(blocks)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    assert levels.dtype == np.int8 and scale.dtype == np.float32
    assert levels.shape == (3, block // SUB[qtype], SUB[qtype]) and scale.shape == (3, block // SUB[qtype])
    for n in range(3):
        ref_levels, ref_scale, ref_min = levels_by_hand(qtype, blocks[n])
        assert levels[n].reshape(-1).tolist() == ref_levels
        assert np.array_equal(scale[n], np.array(ref_scale, np.float32))
        if ref_min is None:
            assert minimum is None
        else:
            assert minimum.dtype == np.float32 and np.array_equal(minimum[n], np.array(ref_min, np.float32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_codec_table_is_ggmls(qtype):
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    codec = CODECS[qtype]
    assert (codec.type_size, codec.sub) == (type_size, SUB[qtype])
    # CODECS is built at import; the builder itself, called now, gives the same entry
    from duet.engine.quant.gguf_blocks import Codec, _codec
    assert _codec(qtype, SUB[qtype], codec.decode) == Codec(type_size, SUB[qtype], codec.decode)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda t: t.name)
def test_blocks_quantized_by_gguf_decode_to_ggufs_values(qtype):
    """Real blocks from gguf.quants.quantize, not random bytes: dequantized exactly as gguf does."""
    weights = np.random.default_rng(5).standard_normal((6, 256)).astype(np.float32)
    weights[1, :32] = 0.0  # a zero block (d = 0)
    raw = gguf.quants.quantize(weights, qtype)
    matrix = BlockMatrix(qtype, raw, 256)
    assert np.array_equal(matrix.dequantize(), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_block_matrix_decode_rows_and_bookkeeping(qtype):
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    N, K = 5, 512
    raw = random_blocks(qtype, N * K // block, seed=17).reshape(N, K // block * type_size)
    matrix = BlockMatrix(qtype, raw, K)
    reference = gguf.quants.dequantize(raw, qtype)
    assert matrix.shape == (N, K) and matrix.nbytes == N * K // block * type_size
    assert matrix.block_size() == SUB[qtype]
    levels, scale, minimum = matrix.decode_rows(1, 4)
    subs = K // SUB[qtype]
    assert levels.shape == (3, subs, SUB[qtype]) and levels.dtype == np.float32 and scale.shape == (3, subs)
    for r, n in enumerate(range(1, 4)):
        by_hand = [levels_by_hand(qtype, b) for b in raw[n].reshape(-1, type_size)]
        assert levels[r].reshape(-1).tolist() == [v for lv, _, _ in by_hand for v in lv]
        assert scale[r].tolist() == [float(s) for _, sc, _ in by_hand for s in sc]
        if minimum is None:
            assert by_hand[0][2] is None
        else:
            assert minimum.shape == (3, subs) and minimum[r].tolist() == [float(m) for _, _, mn in by_hand for m in mn]
    dequantized = scale[..., None] * levels - (0 if minimum is None else minimum[..., None])
    assert np.array_equal(dequantized.reshape(3, K), reference[1:4])
    taken = matrix.take_rows(np.array([4, 1]))
    assert taken.qtype == qtype and taken.K == K and np.array_equal(taken.dequantize(), reference[[4, 1]])
    assert np.array_equal(matrix[2], reference[2])  # one row, as an embedding lookup of one token
