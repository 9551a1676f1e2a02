"""The quantization codecs against references that share no code with them.

- bf16 rounding: torch's own conversion, `torch.tensor(x).to(torch.bfloat16)` (round to nearest, ties
  to even), at exact ties, next to them, at overflow, for subnormals and for non-float32 inputs.
- int8 activation blocks and RTN INT4: their definitions re-stated with torch (`torch.round` is
  round half to even, as the GPU's cvt.rni).
- W4 packing: compressed-tensors' own `pack_to_int32` / `unpack_from_int32` (the format we mirror),
  and the bit layout of REFERENCE.md section 2 written out per element in plain Python.
- GGUF blocks: `gguf.quants.quantize` / `gguf.quants.dequantize` (llama.cpp's reference in numpy).
- Trellis: REFERENCE.md section 4 re-stated in plain Python integers (the 16-bit window of the
  circular stream, x = state * C mod 2^32, the byte sum, ((b + 2) >> 2) - 128), and the least-squares
  path of a few steps found by brute force over every path.

No expected value here is computed by the code under test. Everything runs in a few seconds.
"""

from __future__ import annotations

import importlib.util
import pathlib

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from duet.engine.quant import activation as A
from duet.engine.quant import gguf_blocks as G
from duet.engine.quant import trellis as T
from duet.engine.quant import w4 as W



def _compressed_tensors_packing():
    """compressed-tensors' pack_to_int32 / unpack_from_int32, loaded from the installed file alone:
    the package's __init__ imports transformers (25 s here); helpers.py needs only torch."""
    root = pathlib.Path(importlib.util.find_spec("compressed_tensors").origin).parent
    spec = importlib.util.spec_from_file_location("_ct_pack_helpers", root / "compressors/pack_quantized/helpers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.pack_to_int32, module.unpack_from_int32


pack_to_int32, unpack_from_int32 = _compressed_tensors_packing()

# ------------------------------------------------------------------------------------- bf16 ---


def torch_bf16_bits(x) -> np.ndarray:
    """torch's round-to-nearest-even conversion, as uint16 bits."""
    return torch.tensor(np.asarray(x)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def torch_bf16_values(x) -> np.ndarray:
    return torch.tensor(np.asarray(x)).to(torch.bfloat16).to(torch.float32).numpy()


def f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def tie_and_neighbour_inputs() -> np.ndarray:
    """float32 values whose dropped 16 bits sit at, just below and just above the half-way point,
    with the kept lsb even and odd, both signs, normal and subnormal, up to the largest finite float
    (which rounds to inf) and the largest value that does not."""
    highs = np.array([0x3F80, 0x3F81, 0x4049, 0x404A, 0x0001, 0x0002, 0x0080, 0x7F7E, 0x7F7F,
                      0xBF80, 0xBF81, 0xC2F6, 0x8001, 0x8000, 0x0000], np.uint32)
    lows = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    return f32((highs[:, None] << 16) | lows[None, :]).reshape(-1)


def spread_inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 32, 4096, dtype=np.uint64).astype(np.uint32)
    bits = bits[(bits >> 23) & 0xFF != 0xFF]  # no inf or nan (NaN bits are compared apart)
    return np.concatenate([f32(bits), rng.standard_normal(1024).astype(np.float32),
                           np.array([0.0, -0.0, np.inf, -np.inf, 1.0, 3.4028235e38], np.float32)])


def test_tie_inputs_really_are_ties():
    # the test data is what it says: half the inputs' dropped halves are exactly 0x8000
    lows = tie_and_neighbour_inputs().view(np.uint32) & 0xFFFF
    assert np.count_nonzero(lows == 0x8000) == 15


@pytest.mark.parametrize("inputs", [tie_and_neighbour_inputs, spread_inputs])
def test_f32_to_bf16_bits_is_torchs_conversion(inputs):
    x = inputs()
    ours = A.f32_to_bf16_bits(x)
    assert ours.dtype == np.uint16 and ours.shape == x.shape
    assert np.array_equal(ours, torch_bf16_bits(x))


@pytest.mark.parametrize("inputs", [tie_and_neighbour_inputs, spread_inputs])
def test_round_to_bf16_is_torchs_conversion(inputs):
    x = inputs()
    ours = A.round_to_bf16(x)
    assert ours.dtype == np.float32 and ours.shape == x.shape
    assert np.array_equal(ours.view(np.uint32), torch_bf16_values(x).view(np.uint32))


def test_every_nan_is_the_canonical_bf16_nan():
    # PTX ISA, cvt: a NaN converted to .bf16 is the canonical NaN 0x7FFF, whatever its sign and payload.
    # A NaN with a full mantissa used to carry into the sign bit and come out as -0.0.
    bits = np.array([0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0x7FFF8000, 0xFFFFFFFF, 0x7F800001], np.uint32)
    nan = bits.view(np.float32)
    assert np.all(np.isnan(torch_bf16_values(nan)))
    assert np.array_equal(A.f32_to_bf16_bits(nan), np.full(len(bits), 0x7FFF, np.uint16))
    assert np.array_equal(A.round_to_bf16(nan).view(np.uint32), np.full(len(bits), 0x7FFF0000, np.uint32))


def test_canonical_nan_stays_nan():
    # torch writes its own NaN pattern (0xFFFF here), so only NaN-ness is compared
    nan = np.array([np.nan, -np.nan], np.float32)
    assert np.all(np.isnan(torch_bf16_values(nan)))
    assert np.all(np.isnan((A.f32_to_bf16_bits(nan).astype(np.uint32) << 16).view(np.float32)))
    assert np.all(np.isnan(A.round_to_bf16(nan)))


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32])
def test_bf16_of_other_dtypes_is_torchs_conversion(dtype):
    """torch converts float64 to bf16 through float32 (double rounding), as we do; float16 and
    int32 values of this size are exact in float32, so their result is unambiguous."""
    rng = np.random.default_rng(1)
    if dtype is np.float64:
        # values just above a bf16 tie by less than float32 can hold: the tie rule decides
        base = tie_and_neighbour_inputs().astype(np.float64)
        x = np.concatenate([base, base * (1 + 2.0**-30), rng.standard_normal(256) * 1e3])
    elif dtype is np.float16:
        x = rng.standard_normal(512).astype(np.float16) * np.float16(100)
    else:
        x = rng.integers(-70000, 70000, 512).astype(np.int32)
    x = x.reshape(-1, 2)
    assert np.array_equal(A.f32_to_bf16_bits(x), torch_bf16_bits(x))
    ours = A.round_to_bf16(x)
    assert ours.dtype == np.float32 and ours.shape == x.shape
    assert np.array_equal(ours, torch_bf16_values(x))


def test_bf16_of_a_strided_view_reads_the_view():
    x = np.random.default_rng(2).standard_normal((8, 6)).astype(np.float32)[:, ::3].T
    assert np.array_equal(A.f32_to_bf16_bits(x), torch_bf16_bits(np.ascontiguousarray(x)))
    assert np.array_equal(A.round_to_bf16(x), torch_bf16_values(np.ascontiguousarray(x)))


# ---------------------------------------------------------------- int8 activation blocks ---


def torch_int8_blocks(x: np.ndarray, block: int = 32):
    """scale = absmax / 127 in fp32 per block of 32; q = round half to even (x / scale); 0 for a zero block."""
    t = torch.tensor(x, dtype=torch.float32).reshape(x.shape[0], -1, block)
    scale = t.abs().amax(dim=-1) / 127.0
    q = torch.where(scale[..., None] > 0, torch.round(t / scale[..., None]), torch.zeros_like(t))
    return q.numpy(), scale.numpy()


def test_int8_blocks_are_the_definition():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 128)).astype(np.float32) * rng.uniform(0.1, 10, (5, 1)).astype(np.float32)
    x[2, 32:64] = 0.0  # an all-zero block: scale 0, q 0
    x[3, :32] = 0.0
    x[3, 5] = -2.5  # a block whose only value is negative: its absmax is |x|
    q, scale = A.quantize_int8_blocks(x)
    ref_q, ref_scale = torch_int8_blocks(x)
    assert q.shape == (5, 4, 32) and scale.shape == (5, 4)
    assert q.dtype == np.float32 and scale.dtype == np.float32
    assert np.array_equal(scale, ref_scale) and np.array_equal(q, ref_q)
    assert scale[2, 1] == 0 and not q[2, 1].any() and q[3, 0, 5] == -127


def test_int8_blocks_round_ties_to_even():
    # absmax 127 makes the scale exactly 1, so x / scale = x: the ties are exact
    x = np.zeros((1, 64), np.float32)
    x[0, :8] = [127, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, 126.5]
    x[0, 32:36] = [-127, 0.25, 7.5, -8.5]
    q, scale = A.quantize_int8_blocks(x)
    assert np.array_equal(scale, [[1.0, 1.0]])
    assert np.array_equal(q[0, 0, :8], [127, 2, 4, -2, -0, 0, 2, 126])
    assert np.array_equal(q[0, 1, :4], [-127, 0, 8, -8])
    assert np.array_equal(q, torch_int8_blocks(x)[0])


def test_int8_blocks_of_float64_input_scale_in_float32():
    x = np.random.default_rng(4).standard_normal((2, 64))  # float64
    q, scale = A.quantize_int8_blocks(x)
    ref_q, ref_scale = torch_int8_blocks(x.astype(np.float32))
    assert scale.dtype == np.float32 and np.array_equal(scale, ref_scale) and np.array_equal(q, ref_q)


# ---------------------------------------------------------------------------------------- W4 ---


def layout_word_by_hand(levels8) -> int:
    """REFERENCE.md section 2: value i of a word at bits 4i, stored as level + 8."""
    word = 0
    for i, level in enumerate(levels8):
        word |= (int(level) + 8) << (4 * i)
    return word


def w4_levels(seed: int, shape) -> np.ndarray:
    levels = np.random.default_rng(seed).integers(-8, 8, shape)
    levels[0, :16] = np.arange(-8, 8)  # every level, in order, at least once
    return levels


def test_pack_levels_is_compressed_tensors_packing():
    levels = w4_levels(5, (6, 256))
    ours = W.pack_levels(levels)
    reference = pack_to_int32(torch.tensor(levels, dtype=torch.int8), 4).numpy()
    assert ours.dtype == np.uint32 and ours.shape == (6, 32)
    assert np.array_equal(ours.view(np.int32), reference)
    assert int(ours[1, 3]) == layout_word_by_hand(levels[1, 24:32])
    assert int(ours[0, 0]) == 0x76543210 and int(ours[0, 1]) == 0xFEDCBA98  # levels -8..7 -> nibbles 0..15


def test_unpack_levels_is_compressed_tensors_unpacking():
    words = np.random.default_rng(6).integers(0, 1 << 32, (4, 16), dtype=np.uint64).astype(np.uint32)
    reference = unpack_from_int32(torch.tensor(words.view(np.int32)), 4, torch.Size((4, 128))).numpy()
    ours = W.unpack_levels(words)
    assert ours.dtype == np.int8 and np.array_equal(ours, reference)
    assert np.array_equal(W.W4Weight(words, np.zeros((4, 1), np.uint16)).levels(), reference)


def torch_rtn(weight: np.ndarray):
    """compressed-tensors' symmetric INT4 round to nearest, group 128, restated with torch:
    scale = bf16(absmax / 7.5), level = clamp(round_half_even(w / scale), -8, 7), 0 where scale is 0."""
    g = torch.tensor(weight, dtype=torch.float32).reshape(weight.shape[0], -1, 128)
    scale = (g.abs().amax(dim=-1) / 7.5).to(torch.bfloat16)
    s = scale.to(torch.float32)[..., None]
    levels = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1.0)), torch.zeros_like(g)).clamp(-8, 7)
    return levels.reshape(weight.shape).to(torch.int8).numpy(), scale.view(torch.int16).numpy().view(np.uint16)


def test_quantize_rtn_is_the_definition():
    rng = np.random.default_rng(7)
    weight = rng.standard_normal((6, 384)).astype(np.float32) * rng.uniform(0.01, 2, (6, 1)).astype(np.float32)
    weight[1, 128:256] = 0.0  # a zero group: scale 0, every level 0 (nibble 8)
    weight[2, :128] = -np.abs(weight[2, :128])  # absmax from a negative value: clips to -8
    ref_levels, ref_scales = torch_rtn(weight)
    w4 = W.quantize_rtn(weight)
    assert w4.packed.dtype == np.uint32 and w4.scales.dtype == np.uint16
    assert np.array_equal(w4.scales, ref_scales)
    assert np.array_equal(w4.packed.view(np.int32), pack_to_int32(torch.tensor(ref_levels), 4).numpy())
    assert np.all(w4.packed[1, 16:32] == 0x88888888)


def test_quantize_rtn_rounds_ties_to_even_and_clips():
    # absmax 7.5 -> scale exactly 1.0, so w / scale = w and the ties are exact
    row = np.zeros(128, np.float32)
    row[:10] = [7.5, -7.5, 2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5, 6.5]
    ref_levels, ref_scales = torch_rtn(row[None])
    w4 = W.quantize_rtn(row[None])
    assert w4.scales[0, 0] == 0x3F80  # bf16 1.0
    assert list(w4.levels()[0, :10]) == [7, -8, 2, 4, -2, -4, 0, 0, 2, 6]
    assert np.array_equal(w4.levels(), ref_levels) and np.array_equal(w4.scales, ref_scales)


def test_quantize_rtn_of_float64_quantizes_its_float32_value():
    # 2.5 + 2^-30 is 2.5 in float32 (a tie, to even: 2); computed in float64 it would round to 3
    row = np.zeros((1, 128))
    row[0, :3] = [7.5, 2.5 + 2.0**-30, -3.5 - 2.0**-30]
    w4 = W.quantize_rtn(row)
    assert list(w4.levels()[0, :3]) == [7, 2, -4]
    assert np.array_equal(w4.levels(), torch_rtn(row)[0])


def test_quantize_rtn_of_a_group_below_bf16s_range_is_zero_without_warnings():
    # absmax / 7.5 underflows bf16 (and float32) to 0 while the weights are not 0: x / 0 must not warn
    row = np.zeros((2, 128), np.float32)
    row[0, :4] = [1e-45, -1e-45, 0.0, 1e-45]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w4 = W.quantize_rtn(row)
    assert np.all(w4.scales == 0) and np.all(w4.packed == 0x88888888)
    assert np.array_equal(w4.levels(), torch_rtn(row)[0])


def test_quantize_rtn_scale_is_bf16_rounded_at_a_tie():
    # absmax / 7.5 lands exactly on a bf16 tie (1 + 2^-8, even below) and just above one
    row = np.zeros((2, 128), np.float32)
    row[0, 0] = np.float32(7.5 * (1 + 2.0**-8))
    row[1, 0] = np.float32(7.5 * (1 + 3 * 2.0**-8))
    assert np.array_equal(W.quantize_rtn(row).scales[:, 0], torch_rtn(row)[1][:, 0])
    assert list(W.quantize_rtn(row).scales[:, 0]) == [0x3F80, 0x3F82]


def w4_weight(seed: int, n: int = 5, k: int = 384) -> tuple[W.W4Weight, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    levels = w4_levels(seed, (n, k))
    scale_bits = torch_bf16_bits(rng.uniform(-0.1, 0.1, (n, k // 128)).astype(np.float32))
    words = pack_to_int32(torch.tensor(levels, dtype=torch.int8), 4).numpy().view(np.uint32)
    return W.W4Weight(words, scale_bits), levels, scale_bits


def test_w4_weight_dequantizes_per_the_layout():
    weight, levels, scale_bits = w4_weight(8)
    scales = torch.tensor(scale_bits.view(np.int16)).view(torch.bfloat16).to(torch.float32).numpy()
    expected = np.empty(levels.shape, np.float32)
    for n in range(levels.shape[0]):
        for k in range(levels.shape[1]):
            expected[n, k] = scales[n, k // 128] * levels[n, k]  # exact: bf16 times a small integer
    assert weight.shape == (5, 384) and weight.nbytes == 5 * 48 * 4 + 5 * 3 * 2
    assert weight.block_size() == 128
    assert np.array_equal(weight.dequantize(), expected)
    taken = weight.take_rows(np.array([4, 0, 4]))
    assert np.array_equal(taken.dequantize(), expected[[4, 0, 4]])


def test_w4_decode_rows_gives_levels_and_scales():
    weight, levels, scale_bits = w4_weight(9)
    got_levels, got_scales, minimum = weight.decode_rows(1, 4)
    assert minimum is None
    assert got_levels.shape == (3, 3, 128) and got_levels.dtype == np.float32
    assert np.array_equal(got_levels.reshape(3, -1), levels[1:4])
    assert np.array_equal(got_scales, torch_bf16_values(f32(scale_bits[1:4].astype(np.uint32) << 16)))


@pytest.mark.parametrize("group", [128, 256, 384, -1])
def test_repack_scales_repeats_each_scale_over_its_128_groups(group):
    K = 768
    groups = 1 if group == -1 else K // group
    scales = np.random.default_rng(10).uniform(1e-3, 2e-2, (3, groups)).astype(np.float16)
    ours = W.repack_scales(scales, group, K)
    per = (K if group == -1 else group) // 128
    expected = torch_bf16_bits(np.repeat(scales.astype(np.float32), per, axis=1))
    assert ours.dtype == np.uint16 and ours.shape == (3, K // 128)
    assert np.array_equal(ours, expected)


# ----------------------------------------------------------------------------------- trellis ---
# REFERENCE.md section 4 in plain integers: weight t's state is the 16-bit window of the circular
# stream ending at its own k bits; x = state * C mod 2^32; b = sum of x's 4 bytes;
# level = ((b + 2) >> 2) - 128. One multiplier per rate; MULTIPLIERS is the file format itself.


def level_by_hand(state: int, c: int) -> int:
    x = (state * c) % 2**32
    b = sum((x >> (8 * i)) & 0xFF for i in range(4))
    return ((b + 2) >> 2) - 128


def levels_by_hand(c: int) -> np.ndarray:
    """The same formula over all 65,536 states with numpy uint64 (no wrap: 0xFFFF * C < 2^48)."""
    x = (np.arange(1 << 16, dtype=np.uint64) * np.uint64(c)) % np.uint64(1 << 32)
    b = sum((x >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4))
    return ((b + np.uint64(2)) >> np.uint64(2)).astype(np.int64) - 128


def stream_bits(packed_row: np.ndarray) -> list[int]:
    """Stream bit order: bit 0 is the MSB of byte 0."""
    return [(int(byte) >> (7 - j)) & 1 for byte in packed_row for j in range(8)]


def windows_by_hand(packed_row: np.ndarray, k: int) -> list[int]:
    bits = stream_bits(packed_row)
    length = len(bits)
    states = []
    for t in range(length // k):
        end = (t + 1) * k
        state = 0
        for i in range(end - 16, end):
            state = (state << 1) | bits[i % length]
        states.append(state)
    return states


@pytest.mark.parametrize("k", T.RATES)
def test_level_of_every_state_is_the_definition(k):
    c = T.MULTIPLIERS[k]
    expected = levels_by_hand(c)
    for state in (0, 1, 2, 255, 256, 0x1234, 0x8000, 0xFFFF):
        assert expected[state] == level_by_hand(state, c)
    plain, gpu_form = T.level_of_states(np.arange(1 << 16), c), T.level_of_states_dp4a(np.arange(1 << 16), c)
    assert np.array_equal(plain, expected) and np.array_equal(gpu_form, expected)
    assert plain.dtype == gpu_form.dtype == np.int16  # "int8 as int16 values", both forms
    table = T.level_table(k)
    assert table.dtype == np.float32 and np.array_equal(table, expected.astype(np.float32))


def test_level_by_hand_for_multipliers_that_carry_every_byte():
    c = 0xFFFFFFFF  # state * C = -state mod 2^32: every byte of x matters
    states = np.array([1, 2, 0x0101, 0x7FFF, 0xFFFF, 0xABCD])
    expected = [level_by_hand(int(s), c) for s in states]
    assert list(T.level_of_states(states, c)) == expected
    assert list(T.level_of_states_dp4a(states, c)) == expected
    assert T.level_of_states(np.array([1]), 0xFF000000)[0] == level_by_hand(1, 0xFF000000) == ((255 + 2) >> 2) - 128


def test_dp4a_is_the_byte_dot_product_mod_2_32():
    rng = np.random.default_rng(20)
    a = rng.integers(0, 1 << 32, 64, dtype=np.uint64).astype(np.uint32)
    for b, c in ((0x40404040, 128), (0xFFFFFFFF, 0xFFFFFF00), (0x01020304, 7)):
        expected = [(c + sum(((int(x) >> s) & 0xFF) * ((b >> s) & 0xFF) for s in (0, 8, 16, 24))) % 2**32 for x in a]
        got = T.dp4a(a, b, c)
        assert got.dtype == np.uint32 and list(got) == expected


def random_streams(n: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, T.TILE * k // 8), dtype=np.uint8)


@pytest.mark.parametrize("k", T.RATES)
def test_unpack_and_decode_read_the_circular_windows(k):
    packed = random_streams(2, k, 21 + k)
    states = T.unpack_states(packed, k)
    levels = T.decode_tiles(packed, k)
    assert states.shape == (2, T.TILE) and states.dtype == np.uint32 and levels.dtype == np.int8  # as documented
    c = T.MULTIPLIERS[k]
    for row in range(2):
        expected = windows_by_hand(packed[row], k)
        assert list(states[row]) == expected
        assert list(levels[row]) == [level_by_hand(s, c) for s in expected]


@pytest.mark.parametrize("k", T.RATES)
def test_pack_states_writes_each_weights_own_bits(k):
    packed = random_streams(3, k, 30 + k)
    states = np.array([windows_by_hand(row, k) for row in packed])
    ours = T.pack_states(states, k)
    assert ours.dtype == np.uint8 and np.array_equal(ours, packed)


# Brute force: every path of a few steps is a bit string of 16 + (steps - 1) k bits, state t its
# window of 16 bits ending at bit 16 + t k. Targets are quarter integers and levels integers, so the
# costs are exact in float32 and the least cost is compared exactly.

def path_states(strings: np.ndarray, steps: int, k: int, total: int) -> np.ndarray:
    return np.stack([(strings >> np.int64(total - 16 - t * k)) & 0xFFFF for t in range(steps)], axis=-1)


def brute_force(target: np.ndarray, k: int, levels: np.ndarray, prefix: int | None = None) -> float:
    steps = len(target)
    total = 16 + (steps - 1) * k
    low = 16 - k
    if prefix is None:
        strings = np.arange(1 << total, dtype=np.int64)
    else:  # top 16 - k bits and bottom 16 - k bits both prefix, the middle free
        free = total - 2 * low
        strings = (np.int64(prefix) << (total - low)) | (np.arange(1 << free, dtype=np.int64) << low) | prefix
    states = path_states(strings, steps, k, total)
    return float(((target[None, :] - levels[states]) ** 2).sum(axis=1).min())


def cost(target: np.ndarray, path: np.ndarray, levels: np.ndarray) -> float:
    return float(((target - levels[path]) ** 2).sum())


def is_shift_register(path: np.ndarray, k: int, circular: bool) -> bool:
    mask = (1 << (16 - k)) - 1
    ok = all((int(path[t]) >> k) == (int(path[t - 1]) & mask) for t in range(1, len(path)))
    return ok and (not circular or (int(path[0]) >> k) == (int(path[-1]) & mask))


def quarter_targets(shape, seed: int) -> np.ndarray:
    return (np.round(np.random.default_rng(seed).standard_normal(shape) * 36 * 4) / 4).astype(np.float32)


@pytest.mark.parametrize("k,steps", [(2, 3), (3, 2), (4, 2)])
def test_free_viterbi_finds_the_least_squares_path(k, steps):
    levels = levels_by_hand(T.MULTIPLIERS[k]).astype(np.float32)
    target = quarter_targets((2, steps), 40 + k)
    paths = T.free_path(target.astype(np.float64), k)
    assert paths.shape == (2, steps)
    for row in range(2):
        assert is_shift_register(paths[row], k, circular=False)
        assert cost(target[row], paths[row], levels) == brute_force(target[row], k, levels)


@pytest.mark.parametrize("k,steps", [(2, 9), (3, 7), (4, 5)])
def test_closed_viterbi_finds_the_least_squares_path_with_its_ends_fixed(k, steps):
    levels = levels_by_hand(T.MULTIPLIERS[k]).astype(np.float32)
    target = quarter_targets((2, steps), 50 + k)
    prefix = np.array([0x1234, 0x2BCD]) & ((1 << (16 - k)) - 1)
    paths = T._viterbi(target, levels, k, prefix)
    low = 16 - k
    for row in range(2):
        path = paths[row]
        assert is_shift_register(path, k, circular=False)
        assert (int(path[0]) >> k) == prefix[row] and (int(path[-1]) & ((1 << low) - 1)) == prefix[row]
        assert cost(target[row], path, levels) == brute_force(target[row], k, levels, int(prefix[row]))


def viterbi_by_hand(target: np.ndarray, k: int, levels: np.ndarray, shared: int | None = None) -> np.ndarray:
    """Least-squares state path, a plain dynamic programme over the 65,536 states: the predecessors
    of s are (hi << (16 - k)) | (s >> k). With `shared`, state 0 starts with those 16 - k bits and the
    last state ends with them. float32 costs, added in the encoder's order (error, then best into
    the state), and ties to the largest hi, so that a tie-free target has exactly one answer."""
    low = 16 - k
    states = np.arange(1 << 16)
    cost = (np.float32(target[0]) - levels) ** 2
    if shared is not None:
        cost = np.where(states >> k == shared, cost, np.float32(np.inf))
    back = []
    for t in range(1, len(target)):
        by_hi = cost.reshape(1 << k, 1 << low)  # [hi, mid]: state (hi << low) | mid
        hi = (1 << k) - 1 - by_hi[::-1].argmin(axis=0)  # per mid = s >> k
        back.append(hi[states >> k])
        cost = (np.float32(target[t]) - levels) ** 2
        cost += by_hi.min(axis=0)[states >> k]
    if shared is not None:
        cost = np.where(states & ((1 << low) - 1) == shared, cost, np.float32(np.inf))
    path = [int(cost.argmin())]
    for hi in reversed(back):
        path.append((int(hi[path[-1]]) << low) | (path[-1] >> k))
    return np.array(path[::-1])


def encode_by_hand(target: np.ndarray, k: int, cuts=(0, 64)) -> np.ndarray:
    """Tail-biting as the module docstring and QTIP Alg. 4 say: a free pass over the tile rotated by
    half, then close the circle at 0 and at 64, each time keeping the 16 - k bits the current path
    shares across the cut and coding everything else afresh."""
    levels = levels_by_hand(T.MULTIPLIERS[k]).astype(np.float32)
    mask = (1 << (16 - k)) - 1
    path = np.roll(viterbi_by_hand(np.roll(target, -64), k, levels), 64)
    for cut in cuts:
        path = np.roll(viterbi_by_hand(np.roll(target, -cut), k, levels, int(path[cut - 1]) & mask), cut)
    return path


@pytest.mark.parametrize("k,tiles", [(2, 2), (4, 1)])
def test_encoded_tile_is_the_tail_biting_algorithm(k, tiles):
    # Gaussian targets: no two paths tie in float32 cost, so the path itself is compared
    target = (np.random.default_rng(60 + k).standard_normal((tiles, T.TILE)) * 36).astype(np.float32)
    paths = T.encode_states(target.astype(np.float64), k)
    for row in range(tiles):  # each tile on its own: rolls along the tile, never across tiles
        assert is_shift_register(paths[row], k, circular=True)
        assert np.array_equal(paths[row], encode_by_hand(target[row], k))


def test_half_rotation_pass_closed_at_0_alone(monkeypatch):
    # Without the re-closing passes the result is the cut-0 closure of the half-rotation's guess:
    # this pins the first two passes, which the last pass usually makes irrelevant.
    monkeypatch.setattr(T, "REFINE_CUTS", ())
    target = (np.random.default_rng(66).standard_normal((2, T.TILE)) * 36).astype(np.float32)
    paths = T.encode_states(target, 2)
    for row in range(2):
        assert is_shift_register(paths[row], 2, circular=True)
        assert np.array_equal(paths[row], encode_by_hand(target[row], 2, cuts=(0,)))


def test_encode_tiles_codes_chunks_and_packs_own_bits(monkeypatch):
    """encode_tiles = encode_states over ENCODE_CHUNK tiles at a time, concatenated, each weight's own k bits packed."""
    def fake_states(target, k):  # a path per tile made from its first value, to see which tiles went where
        return np.rint(target[:, :1]).astype(np.int64) * 0x0101 + np.arange(T.TILE)[None, :]

    monkeypatch.setattr(T, "encode_states", fake_states)
    monkeypatch.setattr(T, "ENCODE_CHUNK", 2)
    target = np.arange(5, dtype=np.float32)[:, None] * np.ones((5, T.TILE), np.float32) + 1
    packed = T.encode_tiles(target, 3)
    assert packed.shape == (5, T.TILE * 3 // 8)
    for row in range(5):
        bits = [((int(row + 1) * 0x0101 + t) >> (2 - j)) & 1 for t in range(T.TILE) for j in range(3)]
        assert stream_bits(packed[row]) == bits


def sylvester(n: int) -> np.ndarray:
    """H_2n = [[H_n, H_n], [H_n, -H_n]]."""
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h


def signs_by_hand(k_dim: int, seed: int) -> np.ndarray:
    """The file's rotation signs: -1 where np.random.default_rng(seed).random() < 0.5, else +1."""
    return np.array([-1.0 if u < 0.5 else 1.0 for u in np.random.default_rng(seed).random(k_dim)])


def rotate_by_matrix(x: np.ndarray, seed: int) -> np.ndarray:
    """float64: each 128-block of x * signs, times H / sqrt(128)."""
    y = np.asarray(x, np.float64) * signs_by_hand(x.shape[-1], seed)
    return (y.reshape(-1, 128) @ sylvester(128) / np.sqrt(128)).reshape(x.shape)


def fp32_rotation_bound(x: np.ndarray, seed: int) -> np.ndarray:
    """Error bound of the fp32 butterflies: 7 stages and the final scaling each round once
    (relative 2^-24) a partial sum no larger than the block's sum of |x|; the signs are exact.
    8 roundings * 2^-24 * sum|x| / sqrt(128), times 2 for the input's own fp32 rounding."""
    l1 = np.abs(np.asarray(x, np.float64)).reshape(-1, 128).sum(axis=1, keepdims=True)
    return np.broadcast_to(16 * 2.0**-24 * l1 / np.sqrt(128), (l1.shape[0], 128)).reshape(x.shape)


def butterflies_fp32(x: np.ndarray) -> np.ndarray:
    """The fast Walsh-Hadamard transform as the module docstring says it is computed: float32, stage
    h = 1, 2, 4 .. 64 replaces (y[i], y[i + h]) by (y[i] + y[i + h], y[i] - y[i + h]) for i with bit h
    clear, then times float32(1 / sqrt(128)). Same operations, so the same bits."""
    y = np.array(x, np.float32).reshape(-1, 128)
    h = 1
    while h < 128:
        first = np.array([i for i in range(128) if not i & h])
        a, b = y[:, first].copy(), y[:, first + h].copy()
        y[:, first], y[:, first + h] = a + b, a - b
        h *= 2
    return (y * np.float32(1 / np.sqrt(128))).reshape(np.shape(x))


def test_rotation_is_fp32_butterflies_of_the_signed_input():
    x = np.random.default_rng(69).standard_normal((2, 3, 256)).astype(np.float32)  # x [..., K]
    signs = signs_by_hand(256, 4).astype(np.float32)
    assert np.array_equal(T.rotate_inputs(x, 4), butterflies_fp32(x * signs))
    assert np.array_equal(T.unrotate_inputs(x, 4), butterflies_fp32(x) * signs)
    assert np.array_equal(T.rotate_inputs(x[0, 0], 4), butterflies_fp32(x[0, 0] * signs))  # one vector
    assert T.rotate_inputs(x[0, 0], 4).dtype == T.unrotate_inputs(x[0, 0], 4).dtype == np.float32


def test_rotation_is_the_signed_sylvester_transform():
    x = np.random.default_rng(70).standard_normal((3, 256)).astype(np.float32)
    signs = T.rotation_signs(256, 9)
    assert signs.dtype == np.float32 and np.array_equal(signs, signs_by_hand(256, 9))
    rotated = T.rotate_inputs(x, 9)
    assert rotated.dtype == np.float32 and rotated.shape == x.shape
    assert np.all(np.abs(rotated - rotate_by_matrix(x, 9)) <= fp32_rotation_bound(x, 9))
    # unrotate: H then the signs (H symmetric, H H = 128 I)
    back = T.unrotate_inputs(x, 9)
    expected = (x.astype(np.float64).reshape(-1, 128) @ sylvester(128) / np.sqrt(128)).reshape(x.shape) * signs_by_hand(256, 9)
    assert np.all(np.abs(back - expected) <= fp32_rotation_bound(x, 9))


def test_tiles_by_hand():
    w = np.random.default_rng(71).standard_normal((32, 24)).astype(np.float32)
    tiles = T.to_tiles(w)
    assert tiles.shape == (2 * 3, 128)
    for row in range(32):
        for col in range(24):
            assert tiles[(row // 16) * 3 + col // 8, (row % 16) * 8 + col % 8] == w[row, col]
    assert np.array_equal(T.from_tiles(tiles, (32, 24)), w)


def trellis_weight(k: int, seed: int, n: int = 32, k_dim: int = 256) -> T.TrellisWeight:
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (n // 16 * k_dim // 8, T.TILE * k // 8), dtype=np.uint8)
    return T.TrellisWeight(packed, rng.uniform(0.01, 0.1, n).astype(np.float32), (n, k_dim), k, seed)


def rotated_levels_by_hand(weight: T.TrellisWeight) -> np.ndarray:
    """Level [row, col] of the rotated weight: tile (row // 16) * K/8 + col // 8, weight (row % 16) * 8 + col % 8."""
    n, k_dim = weight.shape
    c = T.MULTIPLIERS[weight.k]
    tiles = [[level_by_hand(s, c) for s in windows_by_hand(p, weight.k)] for p in weight.packed]
    return np.array([[tiles[(r // 16) * (k_dim // 8) + col // 8][(r % 16) * 8 + col % 8] for col in range(k_dim)]
                     for r in range(n)], np.float64)


@pytest.mark.parametrize("k", [2, 3])
def test_trellis_weight_decodes_and_unrotates_per_the_format(k):
    weight = trellis_weight(k, 72 + k)
    levels = rotated_levels_by_hand(weight)
    rotated = levels * weight.row_scale[:, None].astype(np.float64)
    got_levels, got_scale = weight.decode_rows(5, 21)  # crosses the 16-row band boundary
    assert got_levels.shape == (16, 2, 128) and got_levels.dtype == np.float32
    assert np.array_equal(got_levels.reshape(16, -1), levels[5:21]) and np.array_equal(got_scale, weight.row_scale[5:21])
    assert np.array_equal(weight.dequantize_rotated(), rotated.astype(np.float32))  # int8 times fp32: one rounding
    expected = (rotated.reshape(-1, 128) @ sylvester(128) / np.sqrt(128)).reshape(rotated.shape) * signs_by_hand(256, weight.seed)
    assert np.all(np.abs(weight.dequantize() - expected) <= fp32_rotation_bound(rotated, weight.seed))
    assert weight.nbytes == weight.packed.size + 32 * 4


def test_trellis_take_rows_moves_bands():
    weight = trellis_weight(4, 80, n=48)
    levels = rotated_levels_by_hand(weight)
    rows = np.r_[32:48, 0:16]
    taken = weight.take_rows(rows)
    assert taken.shape == (32, 256) and taken.k == 4 and taken.seed == 80
    assert np.array_equal(taken.row_scale, weight.row_scale[rows])
    assert np.array_equal(taken.decode_rows(0, 32)[0].reshape(32, -1), levels[rows])
    for start, stop in ((20, 40), (16, 32), (33, 34)):  # windows not starting in the first band
        got, scale = weight.decode_rows(start, stop)
        assert np.array_equal(got.reshape(stop - start, -1), levels[start:stop])
        assert np.array_equal(scale, weight.row_scale[start:stop])
    for bad in (np.arange(8), np.arange(1, 17), np.r_[0:15, 16]):
        with pytest.raises(T.DuetError, match=r"^a trellis weight \[48, 256\] codes rows in 16-row tiles; this model "
                                              r"splits it at rows that cut a tile: convert it to int4 instead$"):
            weight.take_rows(bad)


def test_quantize_matrix_codes_the_unit_rms_rotated_tiles(monkeypatch):
    """quantize_matrix's own arithmetic, with the encoder replaced by a recorder (its search is tested above)."""
    rng = np.random.default_rng(81)
    w = rng.standard_normal((32, 128)).astype(np.float32) * np.geomspace(0.01, 3, 32, dtype=np.float32)[:, None]
    w[16:32:5] = 0.0  # zero rows: scale 1 * step, not a division by zero
    seen = {}

    def recorder(target, k):
        seen["target"], seen["k"] = target, k
        return np.zeros((len(target), T.TILE * k // 8), np.uint8)

    monkeypatch.setattr(T, "encode_tiles", recorder)
    step = 0.03
    q = T.quantize_matrix(w, 3, seed=5, step=step)
    rotated = rotate_by_matrix(w, 5)
    rms = np.sqrt(np.mean(rotated ** 2, axis=1))
    rms = np.where(rms > 0, rms, 1.0)
    expected = rotated / rms[:, None] / step
    target = seen["target"]
    assert seen["k"] == 3 and target.shape == (2 * 16, 128)
    # bound: the rotation's (relative to each block's sum |w|), and 2^-20 of the value for the fp32
    # rms, division by it and by the step
    bound = fp32_rotation_bound(w, 5) / rms[:, None] / step + 2.0**-20 * np.abs(expected)
    by_tile = np.array([[target[(r // 16) * 16 + c // 8, (r % 16) * 8 + c % 8] for c in range(128)] for r in range(32)])
    assert np.all(np.abs(by_tile - expected) <= bound)
    assert q.shape == (32, 128) and q.k == 3 and q.seed == 5 and q.packed.shape == (32, 48)
    assert q.row_scale.dtype == np.float32  # float32 [N], as the class documents
    np.testing.assert_allclose(q.row_scale, rms * step, rtol=2.0**-20)  # fp32 rms of an fp32 rotation


def test_rotated_int8_activations_are_int8_blocks_of_the_rotation():
    x = np.random.default_rng(82).standard_normal((3, 256)).astype(np.float32)
    x[1, 128:] = 0.0  # a zero block: scale 0, q 0
    q, scale = T.rotated_int8_activations(x, 6)
    rotated = torch.tensor(T.rotate_inputs(x, 6)).reshape(3, 2, 128)  # the rotation is checked above
    ref_scale = rotated.abs().amax(dim=-1) / 127.0
    ref_q = torch.where(ref_scale[..., None] > 0, torch.round(rotated / ref_scale[..., None]), 0.0)
    assert q.shape == (3, 2, 128) and np.array_equal(scale, ref_scale.numpy()) and np.array_equal(q, ref_q.numpy())
    assert scale[1, 1] == 0 and not q[1, 1].any()


@pytest.mark.parametrize("k", T.RATES)
def test_level_moments_are_the_moments_of_the_levels(k):
    levels = levels_by_hand(T.MULTIPLIERS[k]).astype(np.float64)
    mean = levels.sum() / levels.size
    var = ((levels - mean) ** 2).sum() / levels.size
    kurt = ((levels - mean) ** 4).sum() / levels.size / var**2 - 3
    got = T.level_moments(T.MULTIPLIERS[k])
    np.testing.assert_allclose(got, (mean, np.sqrt(var), kurt), rtol=1e-12, atol=1e-12)  # float64 summation order


@pytest.mark.parametrize("moments,ok", [((0.49, 36.0, -0.3), True), ((-0.49, 36.0, -0.3), True), ((0.5, 36.0, -0.3), False),
                                        ((-0.5, 36.0, -0.3), False), ((0.0, 35.0, -0.3), True), ((0.0, 37.5, -0.3), True),
                                        ((0.0, 34.99, -0.3), False), ((0.0, 37.51, -0.3), False), ((0.0, 36.0, -0.35), True),
                                        ((0.0, 36.0, -0.25), True), ((0.0, 36.0, -0.36), False), ((0.0, 36.0, -0.24), False)])
def test_near_gaussian_is_the_documented_window(monkeypatch, moments, ok):
    """|mean| < 0.5, std 35..37.5, excess kurtosis -0.35..-0.25 (the module docstring), at its edges."""
    monkeypatch.setattr(T, "level_moments", lambda c: moments)
    assert T.near_gaussian(12345) is ok


def test_near_gaussian_on_real_levels():
    assert all(T.near_gaussian(T.MULTIPLIERS[k]) for k in T.RATES)
    assert not T.near_gaussian(1)  # levels of 16-bit states: x < 2^16, two bytes only


def test_rank_multipliers_tries_each_gaussian_candidate_and_restores(monkeypatch):
    calls = []

    def fake_mse(x, k, scales):
        calls.append((T.MULTIPLIERS[k], k, scales))
        return (1.0 / T.MULTIPLIERS[k], 0.1)

    monkeypatch.setattr(T, "best_scale_mse", fake_mse)
    monkeypatch.setattr(T, "near_gaussian", lambda c: c != 4)
    saved = T.MULTIPLIERS[3]
    ranked = T.rank_multipliers([3, 4, 5, 9], 3, np.zeros((1, 128)), (0.5,))
    assert ranked == [(1 / 9, 9), (1 / 5, 5), (1 / 3, 3)]
    assert calls == [(3, 3, (0.5,)), (5, 3, (0.5,)), (9, 3, (0.5,))]
    assert T.MULTIPLIERS[3] == saved

    def failing(x, k, scales):
        raise RuntimeError("boom")

    monkeypatch.setattr(T, "best_scale_mse", failing)
    with pytest.raises(RuntimeError):
        T.rank_multipliers([3], 3, np.zeros((1, 128)), (0.5,))
    assert T.MULTIPLIERS[3] == saved


def test_best_scale_mse_is_the_lowest_mse_over_the_steps(monkeypatch):
    x = np.full((1, 128), 0.5, np.float32)
    monkeypatch.setattr(T, "quantize_sequences", lambda x, k, step: (None, x.astype(np.float64) + (float(step) - 0.05)))
    # rel: step is a float32 (0.04 to 2^-24), magnified by 0.04 / 0.01 in the difference, squared; float64 after
    assert T.best_scale_mse(x, 2, (0.01, 0.04, 0.2)) == pytest.approx(((0.04 - 0.05) ** 2, 0.04), rel=1e-6)
    mse, step = T.best_scale_mse(x, 4)  # default: SCALES[4]
    assert step == float(T.SCALES[4][-1]) and isinstance(mse, float)  # all below 0.05: the largest is nearest


def test_quantize_sequences_reconstructs_levels_times_step():
    x = (np.random.default_rng(83).standard_normal((1, T.TILE)) * 0.5).astype(np.float32)
    step = 0.5 / 36
    packed, recon = T.quantize_sequences(x, 4, step)
    levels = [level_by_hand(s, T.MULTIPLIERS[4]) for s in windows_by_hand(packed[0], 4)]
    assert recon.dtype == np.float32 and np.array_equal(recon[0], np.array(levels, np.float32) * np.float32(step))
    assert np.mean((recon - x) ** 2) < 0.01 * np.mean(x ** 2)  # 4 bits: ~0.0045 of the variance (section 4)
