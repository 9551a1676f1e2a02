"""The compiled CPU kernels (engine/backend/compiled.py) against references they do not share code with.

Expected values: a float64 product of the weights as gguf.quants.dequantize (GGUF blocks), the W4
layout's definition (nibble - 8 times the bf16 scale) or the trellis level function give them,
against the route's activations (int8 levels times their scale, or bf16-rounded values). The
kernels sum in their own order, so each result must lie within the fp32 summation bound of its
terms: |y - y64| <= n * 2^-24 * sum |terms| (n terms, each rounding at most once more per add;
Higham's bound, taken with a factor 2 for the rescale product). The numpy Linears meet the same
bound. Where only one term is summed (one unit) the result must equal numpy's bit for bit.

Row order: a token row gives the same bits alone and among up to 16 rows, and in any tile of a
prefill; a weight row the same bits however the rows are split between threads.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from duet.engine.backend import compiled, compiled_sampling, cpu
from duet.engine.quant import trellis as T
from duet.engine.quant.activation import quantize_int8_blocks, round_to_bf16
from duet.engine.quant.gguf_blocks import BlockMatrix
from duet.engine.quant.w4 import W4Weight, unpack_levels
from duet.engine.weights import BF16Matrix

GGUF_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS)
F16_FIELDS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_XS: (0,)}
U = 2.0**-24  # unit roundoff of fp32


@pytest.fixture(autouse=True)
def compiled_kernels(monkeypatch):
    """These tests are of the compiled kernels (numba is a dependency), whatever DUET_CPU_KERNELS says outside."""
    monkeypatch.delenv(compiled.KERNELS_ENV, raising=False)


def random_blocks(qtype: Q, N: int, K: int, seed: int) -> BlockMatrix:
    """Random bytes for the quantized fields, small finite f16 scales."""
    rng = np.random.default_rng(seed)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (N * K // block, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        raw[:, offset : offset + 2] = rng.uniform(-0.02, 0.02, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return BlockMatrix(qtype, raw.reshape(N, -1), K)


def random_w4(N: int, K: int, seed: int) -> W4Weight:
    rng = np.random.default_rng(seed)
    scales = rng.uniform(0.001, 0.02, (N, K // 128)).astype(np.float32)
    bits = (scales.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16
    return W4Weight(rng.integers(0, 2**32, (N, K // 8), dtype=np.uint32), bits)


def w4_reference(weight: W4Weight) -> np.ndarray:
    """float64 [N, K] from the layout's definition: (nibble - 8) * bf16 scale."""
    scales = (weight.scales.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    levels = unpack_levels(weight.packed).astype(np.float64)
    return (levels.reshape(len(levels), -1, 128) * scales[:, :, None]).reshape(levels.shape)


def gguf_reference(weight: BlockMatrix) -> np.ndarray:
    N, K = weight.shape
    return gguf.quants.dequantize(weight.raw.reshape(-1), weight.qtype).reshape(N, K).astype(np.float64)


def int8_activations(x: np.ndarray) -> np.ndarray:
    """The w4a8 route's activation as float64: int8 level times its block's scale."""
    q, scale = quantize_int8_blocks(x)
    return (q.astype(np.float64) * scale[..., None].astype(np.float64)).reshape(x.shape)


def assert_within_sum_bound(y: np.ndarray, w64: np.ndarray, x64: np.ndarray, terms: int) -> None:
    exact = x64 @ w64.T
    bound = 2 * terms * U * (np.abs(x64) @ np.abs(w64).T) + 1e-30
    excess = np.abs(y - exact) / bound
    assert excess.max() <= 1.0, f"{excess.max():.2f} x the summation bound"


def activations(T_rows: int, K: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((T_rows, K)).astype(np.float32)


ROWS = (1, 2, 3, 5, 8, 16, 40)


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", ROWS)
def test_gguf_w4a8_within_the_sum_bound_of_gguf_reference(qtype, rows):
    weight = random_blocks(qtype, 48, 512, seed=qtype.value)
    x = activations(rows, 512, seed=rows)
    linear = compiled.make_linear(weight, "w4a8")
    assert type(linear) is compiled.W4A8Linear
    y = linear(x)
    assert y.dtype == np.float32 and y.shape == (rows, 48)
    assert_within_sum_bound(y, gguf_reference(weight), int8_activations(x), terms=512)
    assert_within_sum_bound(cpu.W4A8Linear(weight)(x), gguf_reference(weight), int8_activations(x), terms=512)


@pytest.mark.parametrize("route", ["w4a8", "w4a16"])
@pytest.mark.parametrize("rows", ROWS)
def test_w4_within_the_sum_bound_of_the_layout_definition(route, rows):
    weight = random_w4(40, 768, seed=rows)
    x = activations(rows, 768, seed=100 + rows)
    linear = compiled.make_linear(weight, route)
    assert type(linear).__module__ == compiled.__name__ and linear.route == route
    x64 = int8_activations(x) if route == "w4a8" else round_to_bf16(x).astype(np.float64)
    assert_within_sum_bound(linear(x), w4_reference(weight), x64, terms=768)


def random_trellis(N: int, K: int, k: int, seed: int) -> T.TrellisWeight:
    """Any bit stream is a valid trellis code: random tiles, random row scales."""
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (N // 16 * K // 8, 128 * k // 8), dtype=np.uint8)
    return T.TrellisWeight(packed, rng.uniform(0.001, 0.01, N).astype(np.float32), (N, K), k, seed)


def trellis_reference(weight: T.TrellisWeight) -> np.ndarray:
    """float64 [N, K] in the rotated basis: each weight's level from its 16-bit window of the tile's bit
    stream, read here bit by bit (MSB first, circular), through the 1MAD level function; times the row scale."""
    k, tiles = weight.k, weight.packed
    bits = np.unpackbits(tiles, axis=1)  # [tiles, 128 k]
    length = bits.shape[1]
    states = np.zeros((len(tiles), 128), np.int64)
    for t in range(128):
        for b in range((t + 1) * k - 16, (t + 1) * k):
            states[:, t] = states[:, t] * 2 + bits[:, b % length]
    x = (states * T.MULTIPLIERS[k]) % 2**32
    levels = (((x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24) + 2) >> 2) - 128
    N, K = weight.shape
    levels = levels.reshape(N // 16, K // 8, 16, 8).transpose(0, 2, 1, 3).reshape(N, K)  # tiles of 16 x 8
    return levels * weight.row_scale[:, None].astype(np.float64)


@pytest.mark.parametrize("k", [2, 3, 4])
def test_trellis_within_the_sum_bound_of_the_level_function(k):
    weight = random_trellis(32, 256, k, seed=k)
    x = activations(5, 256, seed=k)
    q, scale = T.rotated_int8_activations(x, weight.seed)  # the route's activations, in the rotated basis
    x64 = (q.astype(np.float64) * scale[..., None]).reshape(x.shape)
    linear = compiled.make_linear(weight, "w4a8")
    assert type(linear) is compiled.TrellisLinear
    assert_within_sum_bound(linear(x), trellis_reference(weight), x64, terms=256)


def test_row_plane_activations_are_the_routes_int8_levels_in_place():
    """W4A8Linear keeps the levels where their inputs are, one byte each, with each unit's level sum
    and scale: quantize_int8_blocks' numbers, bit for bit, for halves that round to even, an all-zero
    block (scale 0, levels 0) and a block whose absmax is negative."""
    linear = compiled.W4A8Linear(random_blocks(Q.Q4_0, 16, 256, seed=1))
    x = activations(3, 256, seed=2)
    x[0, :32] = 0.0
    x[1, 32:64] = np.arange(32, dtype=np.float32) - 15.5
    x[1, 32] = 127.0
    x[2, 64:96] *= -100
    q, unit_sum, unit_scale = linear.prepare(x)
    levels, scale = quantize_int8_blocks(x)  # [T, K/32, 32], [T, K/32]
    assert q.dtype == np.int8 and np.array_equal(q, levels.reshape(3, 256))
    assert unit_sum.dtype == np.int32 and np.array_equal(unit_sum, levels.sum(axis=-1))
    assert np.array_equal(unit_scale.view(np.uint32), scale.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("flip", [0, 128])
def test_row_planes_hold_blocks_and_w4_levels_as_laid_out(flip):
    """RowPlanes from Q4_0 and Q8_0 blocks (their bytes moved as stored, Q8_0's xor `flip`) and from W4
    (through its codec): group g's byte v * 256 + p * 64 + r * 4 + s is row 16 g + r's unit v
    positions 4p + s (low nibble) and 16 + 4p + s (high), level + 8; Q8_0's v * 512 + p * 64 + r * 4
    + s position 4p + s; scales per (unit, row); padding rows level 0, scale 0."""
    for weight in (random_blocks(Q.Q4_0, 21, 96, seed=4), random_blocks(Q.Q8_0, 21, 96, seed=6), random_w4(21, 128, seed=5)):
        N, K = weight.shape
        p = compiled.repack_rows(weight, flip)
        nibbles = not isinstance(weight, BlockMatrix) or weight.qtype == Q.Q4_0
        assert p.shape == (N, K) and p.nibbles == nibbles and p.nbytes == p.codes.nbytes + p.scale.nbytes
        assert p.codes.shape == (2, K // 32 * (256 if nibbles else 512))
        if isinstance(weight, BlockMatrix):
            blocks = weight.raw.reshape(N, K // 32, -1)
            unit_scale = blocks[:, :, :2].copy().view(np.uint16)[..., 0]
            levels = np.rint(gguf_reference(weight) / np.repeat(unit_scale.view(np.float16), 32, axis=1))
        else:
            levels = unpack_levels(weight.packed).astype(np.float64)
            unit_scale = np.repeat((weight.scales.astype(np.uint32) << 16).view(np.float32), 4, axis=1)
        if nibbles:
            codes = p.codes.reshape(2, K // 32, 4, 16, 4)  # [g, v, p, r, s]
            quads = np.concatenate([(codes & 15).astype(np.int64) - 8, (codes >> 4).astype(np.int64) - 8], axis=2)
        else:
            quads = (p.codes.reshape(2, K // 32, 8, 16, 4) ^ np.uint8(flip)).view(np.int8).astype(np.int64)
        rows = quads.transpose(0, 3, 1, 2, 4).reshape(32, K)  # [g r, v quads s]
        assert np.array_equal(rows[:N], levels) and not rows[N:].any()
        scales = p.scale.reshape(2, K // 32, 16).transpose(0, 2, 1).reshape(32, K // 32)
        assert np.array_equal(scales[:N], unit_scale) and not scales[N:].any()


@pytest.mark.parametrize("flip", [0, 128])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_k_quant_row_planes_hold_the_codecs_levels_scales_and_minima(qtype, flip):
    """K-quant blocks decoded into RowPlanes in one compiled pass hold, laid out as the other forms,
    exactly what their codec decodes (itself equal to gguf.quants.dequantize, test_gguf_blocks.py):
    Q4_K's 0..15 levels as nibbles with the minimum less 8 scales, Q5_K's and Q6_K's levels a byte
    xor `flip`, and each unit's fp32 scale and minimum as the kernels make them (a multiply of code
    and d, Q4_K's minimum less 8 scales) from the codes and f16 block scales kept as the file holds
    them: the scales add ~1/16 of a byte a weight, not fp32 products; padding rows level 0 (Q4_K's
    nibbles 8), scale 0."""
    weight = random_blocks(qtype, 21, 512, seed=40)
    N, K = weight.shape
    p = compiled.repack_rows(weight, flip)
    levels, unit_scale, unit_minimum = weight.decode_rows(0, N)  # [N, U, unit], [N, U]
    U, unit = levels.shape[1:]
    if p.nibbles:
        codes = p.codes.reshape(2, U, 4, 16, 4)  # [g, v, p, r, s]
        quads = np.concatenate([codes & 15, codes >> 4], axis=2).astype(np.int64)
        padding = 8
    else:
        quads = (p.codes.reshape(2, U, unit // 4, 16, 4) ^ np.uint8(flip)).view(np.int8).astype(np.int64)
        padding = 0
    rows = quads.transpose(0, 3, 1, 2, 4).reshape(32, K)  # [g r, v quads s]
    assert p.nibbles == (qtype == Q.Q4_K) and np.array_equal(rows[:N], levels.reshape(N, K)) and (rows[N:] == padding).all()
    # per group (group_scales, as the kernels read them): the scale codes as kept and the blocks' d and dmin
    scratch = np.empty(U * 16, np.uint32)
    scales, minima = np.empty((2, U * 16), np.float32), np.empty((2, U * 16), np.float32)
    for g in range(2):
        codes, d = compiled.group_scales(p.scale, p.block_scales, g, scratch)
        assert codes.dtype == np.int8 and d.shape == (K // 256 * 32,)
        d_min = np.repeat(d.reshape(-1, 2, 16), U // (K // 256), axis=0)  # [v, d | dmin, r]
        scales[g] = d_min[:, 0].reshape(-1) * codes.astype(np.float32)  # the fp32 multiplies rows_tile makes
        if qtype != Q.Q6_K:
            minima[g] = d_min[:, 1].reshape(-1) * p.minimum[g].astype(np.float32)
            if qtype == Q.Q4_K:
                minima[g] -= np.float32(8) * scales[g]
    by_row = lambda planes: planes.reshape(2, U, 16).transpose(0, 2, 1).reshape(32, U)  # noqa: E731
    assert np.array_equal(by_row(scales)[:N].view(np.uint32), unit_scale.view(np.uint32)) and not by_row(scales)[N:].any()
    if qtype == Q.Q6_K:
        assert unit_minimum is None and p.minimum.size == 0
    else:
        want = unit_minimum - np.float32(8) * unit_scale if qtype == Q.Q4_K else unit_minimum
        assert np.array_equal(by_row(minima)[:N].view(np.uint32), want.view(np.uint32)) and not by_row(minima)[N:].any()
    # codes and levels aside, a 256-weight block's scales keep 16 (Q6_K) or 2 x 8 (K) bytes, and 4 of f16
    assert p.nbytes - p.codes.nbytes == 2 * (K // 256) * 16 * (16 + 4)


def test_q4_k_row_planes_hold_half_a_byte_a_level():
    """Q4_K's 0..15 levels go into nibbles as they are (the kernels' - 8 comes back through the
    minimum, less 8 scales): half the bytes of one level a byte; within the bound of its dequantized
    blocks for a row alone and among a prefill's."""
    weight = random_blocks(Q.Q4_K, 40, 512, seed=8)
    p = compiled.repack_rows(weight)
    assert p.nibbles and p.codes.nbytes == 48 * 512 // 2 and p.minimum.shape == (3, 16 * 16)
    x = activations(20, 512, seed=8)
    y = compiled.make_linear(weight, "w4a8")(x)
    assert_within_sum_bound(y, gguf_reference(weight), int8_activations(x), terms=512)


def family_and_generic(weight, kernels: str):
    """The same matrix as a Linear of the given kernel family and of the generic one."""
    make = compiled.TrellisLinear if isinstance(weight, T.TrellisWeight) else compiled.W4A8Linear
    return make(weight, kernels), make(weight, "generic")


@pytest.mark.parametrize("make", [
    lambda: random_blocks(Q.Q4_0, 45, 800, 31),  # 25 units a row: 200 lanes, 8 past the last whole 16
    lambda: random_blocks(Q.Q8_0, 45, 800, 32),
    lambda: random_blocks(Q.Q4_K, 21, 1280, 33),  # 280 lanes
    lambda: random_blocks(Q.Q5_K, 16, 256, 34),
    lambda: random_blocks(Q.Q6_K, 16, 512, 35),
    lambda: random_blocks(Q.IQ4_XS, 16, 256, 36),
    lambda: random_w4(40, 1024, 37),
    lambda: random_trellis(32, 256, 2, 38),
], ids=["q4_0", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs", "w4", "trellis"])
def test_each_kernel_family_gives_the_same_bits(make):
    """The quad kernels (vpdpbusd on CPUs with AVX512-VNNI, vpmaddubsw + vpmaddwd on AVX2) sum the same
    integer dots as the generic loops, laid out in quads, and rescale them alike: every output bit
    equal, for 1 to 16 rows and a prefill's tiles, with lanes past the last whole column and groups
    padded past the last row. Each family is offered only where the CPU has its instructions."""
    kernels = compiled.int8_dot_kernels()
    vnni = {"avx512vnni", "avx512bw", "avx512vl"} <= compiled._CPU_FEATURES
    assert kernels == (["vnni", "generic"] if vnni else ["avx2", "generic"] if "avx2" in compiled._CPU_FEATURES else ["generic"])
    weight = make()
    x = activations(40, weight.shape[1], seed=9) * np.float32(3)
    for family in kernels[:-1]:
        fast, generic = family_and_generic(weight, family)
        if isinstance(fast, compiled.W4A8Linear):
            assert (fast.kernel, generic.kernel) == (compiled._w4a8_rows, compiled._w4a8_rows_loops)
        else:
            assert fast.planes.quads and not generic.planes.quads
        for rows in (1, 2, 5, 16, 40):
            assert np.array_equal(fast(x[:rows]), generic(x[:rows])), f"{family}, {rows} rows"


def test_w4a16_families_give_the_same_bits():
    """W4A16Lanes (AVX-512: a block of 32 rows' levels from one 16-byte load, fused multiply-adds)
    sums each group in k order and scales it as the generic planes' loops do: every output bit equal
    for 1 to 16 rows and a prefill's tiles, with a last block of 6 rows padded; both within the sum
    bound of the definition. The draft shortlist's leading rows read the same bytes."""
    kernels = compiled.w4a16_kernels()
    assert kernels == (["avx512", "generic"] if {"avx512f", "avx512bw", "avx512vl", "fma"} <= compiled._CPU_FEATURES else ["generic"])
    assert type(compiled.make_linear(random_w4(8, 128, 1), "w4a16")) is (compiled.W4A16Lanes if kernels[0] == "avx512" else compiled.W4A16Linear)
    weight = random_w4(70, 384, seed=41)
    x = activations(40, 384, seed=41) * np.float32(3)
    generic = compiled.w4a16_linear(weight, "generic")
    for family in kernels[:-1]:
        fast = compiled.w4a16_linear(weight, family)
        assert fast.shape == (70, 384) and fast.nbytes == 96 * 384 // 2 + 96 * 3 * 4  # 3 blocks of 32 rows
        for rows in (1, 2, 3, 4, 5, 16, 17, 40):
            assert np.array_equal(fast(x[:rows]), generic(x[:rows])), f"{family}, {rows} rows"
        assert fast.leading_rows(50) is None
        assert np.array_equal(fast.leading_rows(64)(x[:5]), fast(x[:5])[:, :64])
    assert_within_sum_bound(generic(x), w4_reference(weight), round_to_bf16(x).astype(np.float64), terms=384)


def test_the_avx2_family_gives_the_same_bits_on_a_cpu_told_it_has_no_avx512():
    """CI and users' machines differ: on an AVX-512 CPU the avx2 family would never run in-process.
    A child told the host's features without AVX-512 (NUMBA_CPU_FEATURES, which duet reads too) must
    offer avx2 exactly when the CPU has it and give the generic kernels' bits with it."""
    import subprocess
    import sys

    import llvmlite.binding

    features = llvmlite.binding.get_host_cpu_features()
    no_avx512 = ",".join(("+" if on and not name.startswith(("avx512", "avx10", "evex512", "amx")) else "-") + name
                         for name, on in features.items())
    test = f"{__file__}::test_each_kernel_family_gives_the_same_bits"
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                           env={**os.environ, "NUMBA_CPU_FEATURES": no_avx512}, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-3000:]
    assert "8 passed" in child.stdout
    probe = subprocess.run([sys.executable, "-c", "from duet.engine.backend import compiled; print(compiled.int8_dot_kernels())"],
                           env={**os.environ, "NUMBA_CPU_FEATURES": no_avx512}, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == str(["avx2", "generic"] if features.get("avx2") else ["generic"])


@pytest.mark.parametrize("decoder", ["unit_scales", "integer"])
def test_f16_scale_bits_decode_exactly_in_the_kernels(decoder):
    """Q4_0 / Q8_0 planes keep their blocks' f16 scale bits; the kernels decode them (F16C's vcvtph2ps
    where the CPU has it, integer arithmetic elsewhere: both are checked). Every one of the 65,536
    patterns (zeros, subnormals, normals, infinities, NaNs) must give numpy's float16 -> float32
    value, bit for bit (NaNs as NaNs), including the last patterns past a whole vector."""
    import numba

    @numba.njit
    def decoded(row, scratch):
        return compiled.unit_scales(row, scratch).copy()

    bits = np.concatenate([np.arange(1 << 16, dtype=np.uint32), [0x7C01, 0x8001, 0x3C00]]).astype(np.uint16)
    decode = decoded if decoder == "unit_scales" else compiled.decode_f16_bits
    got = decode(bits, np.empty(bits.size, np.uint32))
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_one_unit_equals_numpy_bit_for_bit():
    """K = 32: one integer dot, one rescale, nothing summed in another order."""
    for weight in (random_blocks(Q.Q8_0, 16, 32, 1), random_blocks(Q.Q4_0, 16, 32, 2), random_blocks(Q.IQ4_XS, 16, 256, 3)):
        x = activations(4, weight.shape[1], seed=5)
        if weight.shape[1] == 32:
            assert np.array_equal(compiled.make_linear(weight, "w4a8")(x), cpu.W4A8Linear(weight)(x))


ONE_OF_EACH_KIND = [  # (weight, route) for compiled.make_linear: every Linear kind the kernels run
    lambda: (random_blocks(Q.Q4_0, 64, 1024, 7), "w4a8"),
    lambda: (random_blocks(Q.Q8_0, 64, 1024, 8), "w4a8"),
    lambda: (random_blocks(Q.Q4_K, 64, 1024, 9), "w4a8"),
    lambda: (random_blocks(Q.Q6_K, 64, 1024, 10), "w4a8"),
    lambda: (random_w4(64, 1024, 11), "w4a16"),
    lambda: (random_w4(64, 1024, 12), "w4a8"),
    lambda: (random_trellis(64, 1024, 3, 13), "w4a8"),
    lambda: (np.random.default_rng(14).standard_normal((64, 1000)).astype(np.float32), "bf16"),
    lambda: (random_bf16(66, 1000, 15), "bf16"),
]
KIND_IDS = ["q4_0", "q8_0", "q4_k", "q6_k", "w4a16", "w4a8", "trellis", "dense", "bf16 bits"]


@pytest.mark.parametrize("make", ONE_OF_EACH_KIND, ids=KIND_IDS)
def test_a_token_row_has_the_same_bits_alone_and_among_others(make):
    weight, route = make()
    linear = compiled.make_linear(weight, route)
    x = activations(16, linear.shape[1], seed=3) * np.float32(4)
    alone = np.concatenate([linear(x[t : t + 1]) for t in range(16)])
    for rows in range(2, 17):
        assert np.array_equal(linear(x[:rows]), alone[:rows]), f"{rows} rows"
    assert np.array_equal(linear(x[::-1])[::-1], alone)  # a row's place among the others does not matter


@pytest.mark.parametrize("make", ONE_OF_EACH_KIND, ids=KIND_IDS)
def test_token_rows_of_another_width_are_refused_not_read_past(make):
    """The kernels trust a row's K inputs: rows 32 inputs short or long raise ValueError before any
    kernel runs (a decode's rows and a prefill's), where they once read past the weights' end."""
    weight, route = make()
    linear = compiled.make_linear(weight, route)
    K = linear.shape[1]
    for width in (K - 32, K + 32):
        for rows in (2, 40):
            with pytest.raises(ValueError):
                linear(activations(rows, width, seed=rows))


def test_prefill_tiles_give_each_row_its_decode_bits():
    linear = compiled.make_linear(random_blocks(Q.Q4_0, 64, 1024, 21), "w4a8")
    x = activations(40, 1024, seed=21)
    together = linear(x)
    assert np.array_equal(together[[0, 17, 39]], np.concatenate([linear(x[t : t + 1]) for t in (0, 17, 39)]))


@pytest.mark.parametrize("N", [1, 3, 45])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q5_K])
def test_row_counts_that_leave_a_partial_group(N, qtype):
    """Rows are laid side by side in groups of up to 8; a last, partial group holds padding."""
    weight = random_blocks(qtype, N, 256, seed=N)
    x = activations(3, 256, seed=N)
    y = compiled.make_linear(weight, "w4a8")(x)
    assert y.shape == (3, N)
    assert_within_sum_bound(y, gguf_reference(weight), int8_activations(x), terms=256)


@pytest.mark.parametrize("qtype", [Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)  # a minimum; units of 16
def test_a_weight_row_has_the_same_bits_however_the_rows_are_split(qtype):
    linear = compiled.make_linear(random_blocks(qtype, 96, 512, 31), "w4a8")
    x = activations(3, 512, seed=31)
    prepared = linear.prepare(x)
    groups = linear.planes.codes.shape[0]
    whole = np.empty((3, 96), np.float32)
    kernel, args = linear.launch(prepared, whole)
    kernel(*args, 0, groups)
    parts = np.empty((3, 96), np.float32)
    kernel, args = linear.launch(prepared, parts)
    for lo, hi in ((0, 1), (1, groups // 2), (groups // 2, groups)):
        kernel(*args, lo, hi)
    assert np.array_equal(whole, parts)
    for count in (2, 3, groups):  # numba's threads, each a range of groups
        threaded = np.empty((3, 96), np.float32)
        kernel, args = linear.launch(prepared, threaded)
        compiled.parts_driver(kernel)(args, groups, count)
        assert np.array_equal(whole, threaded), count


def test_dense_rows_within_the_sum_bound_and_prefill_through_blas():
    rng = np.random.default_rng(41)
    weight = rng.standard_normal((72, 1000)).astype(np.float32)
    linear = compiled.make_linear(weight, "bf16")
    for rows in (1, 7, 16, 33):
        x = activations(rows, 1000, seed=rows)
        assert_within_sum_bound(linear(x), weight.astype(np.float64), x.astype(np.float64), terms=1000)


def random_bf16(N: int, K: int, seed: int) -> BF16Matrix:
    """A bf16 matrix as a checkpoint stores it: torch rounds random fp32 to bf16 and gives the bits."""
    import torch

    values = torch.from_numpy(np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32))
    return BF16Matrix(values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


def test_bf16_matrices_run_from_their_bits_within_the_sum_bound():
    """A bf16 checkpoint's matrix stays 2 bytes a weight (BF16Matrix) and runs from its bits: decode,
    verify and prefill rows within the fp32 summation bound of a float64 product with torch's own
    bf16 -> fp32 widening, the numpy reference (which widens once) within the same bound."""
    import torch

    weight = random_bf16(70, 1000, seed=16)  # 70: a last group of 2 rows, a last block of 6 lanes
    assert type(compiled.make_linear(weight, "bf16")) is compiled.BF16Linear
    w64 = torch.from_numpy(weight.bits.view(np.int16)).view(torch.bfloat16).double().numpy()
    for kernels in compiled.bf16_dot_kernels():
        linear = compiled.BF16Linear(weight, kernels)
        held_rows = 128 if kernels == "avx512" else 70  # lanes of 32 rows in pairs, the last padded
        assert linear.shape == (70, 1000) and linear.nbytes == held_rows * 1000 * 2
        for rows in (1, 4, 5, 16, 33):
            x = activations(rows, 1000, seed=rows)
            y = linear(x)
            assert_within_sum_bound(y, w64, x.astype(np.float64), terms=1000)
            if rows <= 16:
                alone = np.concatenate([linear(x[t : t + 1]) for t in range(rows)])
                assert np.array_equal(y, alone), f"{kernels}: {rows} rows"
    for rows in (1, 33):
        x = activations(rows, 1000, seed=rows)
        assert_within_sum_bound(cpu.make_linear(weight, "bf16")(x), w64, x.astype(np.float64), terms=1000)


def test_a_bf16_checkpoint_loads_its_matrices_as_bits(tmp_path):
    """Loading a bf16 safetensors model keeps every Linear and the embedding at 2 bytes a weight
    (an fp32 copy was twice the file); a tied embedding looks its rows up in the head's own bits."""
    from conftest import build_reference, save_reference
    from duet.engine import load_model

    reference = build_reference("qwen3_5", tie=True, seed=2).to(dtype=__import__("torch").bfloat16)
    save_reference(reference, tmp_path, with_tokenizer=False)
    model = load_model(tmp_path, tokenizer=False).model
    assert type(model.lm_head) is compiled.BF16Linear and model.embed is model.lm_head  # one copy of the tied matrix
    table = reference.get_input_embeddings().weight.float().detach().numpy()
    ids = np.array([0, 1, 31, 32, 77, len(table) - 1])
    assert np.array_equal(model.embed[ids], table[ids])
    assert np.array_equal(model.embed[ids.reshape(2, 3)], table[ids.reshape(2, 3)]) and np.array_equal(model.embed[77], table[77])
    for outside in (len(table), len(table) + 40):  # an id past the rows is refused, never read (lanes pad to 64 rows)
        with pytest.raises(IndexError):
            model.embed[np.array([3, outside])]
    mixer = model.layers[0].mixer
    N, K = mixer.in_proj.shape
    held = -(-N // 64) * 64 if compiled.bf16_dot_kernels()[0] == "avx512" else N  # lanes of 32 rows in pairs, the last padded
    assert type(mixer.in_proj) is compiled.BF16Linear and mixer.in_proj.nbytes == 2 * held * K


def test_the_numpy_reference_runs_when_asked(monkeypatch):
    monkeypatch.setenv(compiled.KERNELS_ENV, "numpy")
    assert "numpy" in compiled.unavailable()
    assert type(compiled.make_linear(random_blocks(Q.Q4_0, 16, 64, 1), "w4a8")) is cpu.W4A8Linear


def resident_bytes() -> int:
    """This process's resident set now (Linux: /proc/self/statm, in pages)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


def test_a_repacked_gguf_matrix_lets_go_of_its_file_pages(tmp_path):
    """After the repack, the planes hold the weights; the file's pages leave the resident set (they were
    held twice, 1.40 -> 1.13 GiB peak for the 0.8B Q4_0 file) and the blocks still read back right."""
    weight = random_blocks(Q.Q8_0, 2048, 16384, seed=3)  # 34 MiB of blocks
    path = tmp_path / "blocks.bin"
    weight.raw.tofile(path)
    mapped = BlockMatrix(Q.Q8_0, np.memmap(path, np.uint8, mode="r").reshape(weight.raw.shape), 16384)
    before = resident_bytes()
    assert int(mapped.raw.sum(dtype=np.uint64)) == int(weight.raw.sum(dtype=np.uint64))  # every page read
    touched = resident_bytes()
    assert touched - before > weight.raw.nbytes // 2
    linear = compiled.make_linear(mapped, "w4a8")
    assert resident_bytes() < touched - weight.raw.nbytes // 2 + linear.nbytes
    x = activations(2, 16384, seed=3)
    np.testing.assert_array_equal(linear(x), compiled.make_linear(weight, "w4a8")(x))
    assert np.array_equal(mapped[np.array([0, 2047])], weight[np.array([0, 2047])])  # read again from the file


def mapping_resident_bytes(path: Path) -> int:
    """Resident bytes of this process's memory mappings of `path` (Linux: /proc/self/smaps)."""
    resident, current = 0, ""
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                current = fields[5] if len(fields) > 5 else ""
            elif fields and fields[0] == "Rss:" and current == str(path):
                resident += int(fields[1]) * 1024
    return resident


def test_a_loaded_gguf_model_keeps_no_more_of_its_file_than_its_float_tensors():
    """Matrices stacked at load (q | k | v | z, gate | up) are copies too: after load_model the file's
    pages still resident are at most the float tensors (norms, biases: read as they are) and the
    partial pages at each tensor's ends. Measured on the demo GGUF: 3.6 MB of a 7.5 MB file before
    stacked parts let go of their pages, 1.3 MB after. Tensor sizes from gguf.GGUFReader."""
    from duet.engine import load_model

    path = (Path(__file__).parents[2] / "models" / "demo_gguf" / "demo-q8_0.gguf").resolve()
    tensors = gguf.GGUFReader(path).tensors
    floats = sum(int(t.n_bytes) for t in tensors if t.tensor_type in (Q.F32, Q.F16, Q.BF16))
    lm = load_model(path)
    assert lm.route == "w4a8"
    assert mapping_resident_bytes(path) <= floats + 2 * mmap.PAGESIZE * len(tensors)


def test_the_draft_shortlist_reads_the_heads_own_planes():
    """A compiled head's leading rows serve as the draft shortlist without a copy (the 0.8B file's
    65,536 rows were 72 MB more), with the head's bits; rows that end inside a group are copied."""
    from duet.engine.backend.cpu_ops import CpuOps

    for matrix in (random_blocks(Q.Q8_0, 1000, 256, seed=11), random_blocks(Q.Q6_K, 1000, 256, seed=12)):
        head = compiled.make_linear(matrix, "w4a8")
        x = activations(3, 256, seed=11)
        for stop, shared in ((25 * compiled.ROWS, True), (25 * compiled.ROWS + 3, False)):
            part = CpuOps().shortlist_part(head, matrix, slice(0, stop), "w4a8")
            assert np.shares_memory(part.planes.codes, head.planes.codes) is shared
            np.testing.assert_array_equal(part(x), head(x)[:, :stop])


FIRST_RUN = """
import json
from duet.engine.backend import compiled, compiled_sampling
started, start = [], compiled._start_helper
compiled._start_helper = lambda code: started.append(True) or start(code)
compiled.compile_kernels(also=compiled_sampling.host_steps(mtp_plan=True), helper=compiled_sampling.FIRST_RUN_HELPER)
kernels = [value for module in (compiled, compiled_sampling) for value in vars(module).values() if hasattr(value, "stats")]
helpers = [compiled_sampling.softmax_rows, compiled_sampling.accept_rows] + (
    [compiled.mtp_rows_team, compiled_sampling.mtp_sampled_drafts_team] if compiled.mtp_kernel_steps() else [])
print(json.dumps({"helper": bool(started), "mark": (compiled.CACHE_DIR / compiled.COMPILED_MARK).exists(),
                  "compiled": sum(len(k.stats.cache_misses) for k in kernels),
                  "helpers compiled": sum(len(k.stats.cache_misses) for k in helpers),
                  "helpers loaded": sum(len(k.stats.cache_hits) for k in helpers)}))
"""


def test_a_first_run_leaves_the_sampler_and_mtp_kernels_to_a_helper_process(tmp_path):
    """With an empty kernel cache, compile_kernels (as load_model calls it) hands the sampler's and the MTP
    passes' kernels to a helper process, which compiles them into the same cache while the run compiles
    the model's; the run then loads them, compiling none itself, and leaves its mark. The next run starts
    no helper and compiles nothing: every kernel, the helper's too, loads from the cache."""
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_CACHE_DIR"} | {"XDG_CACHE_HOME": str(tmp_path)}

    def run() -> dict:
        out = subprocess.run([sys.executable, "-c", FIRST_RUN], env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    first = run()
    assert first["helper"] and first["mark"] and first["compiled"] > 0
    assert first["helpers compiled"] == 0 and first["helpers loaded"] > 0
    second = run()
    assert not second["helper"] and second["compiled"] == 0 and second["helpers loaded"] == first["helpers loaded"]


def test_a_first_run_without_an_interpreter_to_start_compiles_alone(monkeypatch):
    """No helper where none can start (an embedding Python's empty sys.executable, a missing file): the
    run compiles everything itself."""
    monkeypatch.setattr(sys, "executable", "")
    assert compiled._start_helper("pass") is None
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert compiled._start_helper("pass") is None


def test_a_kernel_calling_another_files_kernel_gets_its_new_code_after_an_upgrade(tmp_path):
    """numba checks a cached kernel against its own source file alone: after the file a kernel calls
    into changes, the caller's cached machine code still holds the callee's old code (as
    compiled_sampling's drafting kernel held compiled.py's old MTP pass). kernel_cache_dir keys the
    folder by every kernel source, so the new code is compiled; the old folder goes once nothing has
    written to it for a day (a duet of the old version may still run from it)."""
    source = tmp_path / "src"
    source.mkdir()
    inner, outer = source / "inner_kernels.py", source / "outer_kernels.py"
    inner.write_text("import numba\n\n@numba.njit(cache=True)\ndef value():\n    return 1\n")
    outer.write_text("import numba\nfrom inner_kernels import value\n\n@numba.njit(cache=True)\ndef twice():\n    return 2 * value()\n")

    def twice(cache: Path) -> str:
        env = {**os.environ, "PYTHONPATH": str(source), "NUMBA_CACHE_DIR": str(cache)}
        return subprocess.run([sys.executable, "-c", "from outer_kernels import twice; print(twice())"], env=env,
                              capture_output=True, text=True, check=True).stdout.strip()

    root = tmp_path / "cache"
    first = compiled.kernel_cache_dir(root, [inner, outer])
    assert twice(first) == "2" and compiled.kernel_cache_dir(root, [inner, outer]) == first
    inner.write_text(inner.read_text().replace("return 1", "return 5"))
    assert twice(first) == "2"  # one folder for every version: the caller keeps the callee's old code
    second = compiled.kernel_cache_dir(root, [inner, outer])
    assert second != first and sorted(root.iterdir()) == sorted([first, second])  # first written just now
    assert twice(second) == "10"
    day_old = time.time() - compiled.STALE_CACHE_SECONDS - 60
    os.utime(first, (day_old, day_old))
    inner.write_text(inner.read_text().replace("return 5", "return 7"))
    third = compiled.kernel_cache_dir(root, [inner, outer])
    assert sorted(root.iterdir()) == sorted([second, third]) and twice(third) == "14"
    (tmp_path / "a file").write_text("")  # a cache root no folder can be made under: the path, no error
    assert compiled.kernel_cache_dir(tmp_path / "a file" / "numba", [inner]).parent == tmp_path / "a file" / "numba"


def test_compile_kernels_reports_each_and_covers_what_models_pass():
    """compile_kernels (run by load_model) reports every kernel, and prepares each for exactly the
    argument types the models then pass: running a float, an INT4 (both routes) and a GGUF model
    compiles nothing more (numba would otherwise compile a second signature on the first token)."""
    from duet.engine import GenerateOptions, KVCache, SamplingParams, generate, load_model

    reports = []
    compiled.compile_kernels(lambda done, total: reports.append((done, total)), also=compiled_sampling.host_steps(mtp_plan=True))
    assert reports == [(i, len(reports)) for i in range(1, len(reports) + 1)] and len(reports) >= 5
    w4a8 = [compiled._w4a8_rows, compiled._w4a8_byte_quads] if compiled.int8_dot_kernels()[0] != "generic" else \
        [compiled._w4a8_rows_loops, compiled._w4a8_bytes]
    w4a16 = compiled._w4a16_lanes if compiled.w4a16_kernels()[0] == "avx512" else compiled._w4a16_nibbles
    kernels = [*w4a8, w4a16, compiled._dense, compiled.deltanet_heads,
               compiled.rms_norm_rows, compiled.add_rms_norm_rows, compiled.qk_norm_rope_rows, compiled.swiglu_rows, compiled.conv_rows, compiled.attend_rows, compiled.attend_q4_rows,
               compiled._delta_replay]
    mtp = [compiled.mtp_rows, compiled.mtp_greedy_drafts, compiled_sampling.mtp_sampled_drafts, compiled.mtp_rows_team,
           compiled.mtp_greedy_drafts_team, compiled_sampling.mtp_sampled_drafts_team, compiled.lane_rows] \
        if compiled.bf16_dot_kernels()[0] == "avx512" else []  # MTP passes in one call, alone and as a team; tied table lookups
    kernels += mtp
    drivers = [compiled.parts_driver(kernel) for kernel in kernels[:5]]  # the same kernels split between threads
    # the sampler's: softmax into float32 (probabilities) and float64 (a pick), draws from either; the
    # sampled acceptance, for drafts with q (MTP's, packed by the kernel or from lists) and without (n-gram)
    kernels += [compiled_sampling._top_k_columns, compiled_sampling._warp_rows, compiled_sampling.softmax_rows, compiled_sampling._draw_index,
                compiled_sampling.accept_rows]
    prepared = [len(kernel.signatures) for kernel in kernels + drivers]
    # RowPlanes' scales: f16 bits (Q4_0, Q8_0), fp32 (W4, IQ4_XS) and K-quant codes
    assert prepared == [3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1] + [1] * len(mtp) + [1, 1, 2, 2, 1] + [3, 1, 1, 1, 1]
    models = Path(__file__).parents[2] / "models"
    for path in (models / "demo", models / "demo_int4", models / "demo_gguf" / "demo-q8_0.gguf"):
        lm = load_model(path)
        for route in lm.routes:
            lm.use_route(route)
            list(generate(lm, [5, 6, 7, 8] * 5, GenerateOptions(max_tokens=4)))
            list(generate(lm, [5, 6, 7, 8] * 5, GenerateOptions(max_tokens=8, sampling=SamplingParams(temperature=0.7, top_k=20, top_p=0.95))))
            list(generate(lm, [5, 6, 7, 8] * 5, GenerateOptions(max_tokens=4, kv=KVCache.Q4)))
    assert [len(kernel.signatures) for kernel in kernels + drivers] == prepared
