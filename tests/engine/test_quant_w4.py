"""INT4 safetensors formats and the two quantized routes on the W4 layout.

Each format's reference dequantization is written here from the format's definition, element by
element, independent of the loader: compressed-tensors `pack-quantized` and GPTQ.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from duet.engine.backend.cpu import DenseLinear, W4A8Linear, W4A16Linear
from duet.engine.checkpoint.quantized import CompressedTensors, GPTQ, read_quantization
from duet.engine.checkpoint.safetensors import SafetensorsCheckpoint
from duet.engine.errors import CheckpointError
from duet.engine.quant.activation import quantize_int8_blocks, round_to_bf16
from duet.engine.quant.w4 import W4Weight, pack_levels, quantize_rtn, unpack_levels

N, K = 48, 512
BF16_ROUNDOFF = 2.0**-8  # |bf16(x) - x| <= 2^-8 |x|: 8 significant bits, round to nearest


def random_levels(seed: int, shape=(N, K)) -> np.ndarray:
    return np.random.default_rng(seed).integers(-8, 8, shape)


def bf16_values(shape, seed: int) -> np.ndarray:
    """Random positive scales that bf16 holds exactly, as fp32."""
    return round_to_bf16(np.random.default_rng(seed).uniform(1e-3, 2e-2, shape).astype(np.float32))


def nibble(word: int, i: int) -> int:
    return (int(word) >> (4 * i)) & 0xF


def test_w4_bit_layout_input_8j_plus_i_in_bits_4i_stored_plus_8():
    levels = random_levels(0, (3, 32))
    packed = pack_levels(levels)
    assert packed.dtype == np.uint32 and packed.shape == (3, 4)
    for n in range(3):
        for k in range(32):
            assert nibble(packed[n, k // 8], k % 8) - 8 == levels[n, k]
    assert np.array_equal(unpack_levels(packed), levels)


def test_rtn_quantization_keeps_every_weight_within_half_a_step():
    weight = np.random.default_rng(1).standard_normal((N, K)).astype(np.float32)
    w4 = quantize_rtn(weight)
    step = np.repeat((w4.scales.astype(np.uint32) << 16).view(np.float32), 128, axis=1)
    clipped = weight > 7 * step  # the top of the range clips to level 7
    assert np.all(np.abs(w4.dequantize() - weight)[~clipped] <= step[~clipped] / 2 * (1 + 1e-6))


# ---- compressed-tensors pack-quantized


def pack_compressed_tensors(levels: np.ndarray) -> np.ndarray:
    """The format's definition: int32 [N, K/8], value i of each word at bits 4i, stored as level + 8."""
    rows, cols = levels.shape
    packed = np.zeros((rows, cols // 8), np.uint32)
    for i in range(8):
        packed |= (levels[:, i::8] + 8).astype(np.uint32) << np.uint32(4 * i)
    return packed.view(np.int32)


def dequantize_compressed_tensors(packed: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """w[n, k] = weight_scale[n, k // group] * (((weight_packed[n, k // 8] >> 4 (k % 8)) & 15) - 8)."""
    words = packed.view(np.uint32)
    out = np.empty((words.shape[0], words.shape[1] * 8), np.float32)
    for n in range(out.shape[0]):
        for k in range(out.shape[1]):
            out[n, k] = scale[n, k // group] * (nibble(words[n, k // 8], k % 8) - 8)
    return out


def write_checkpoint(folder, tensors: dict, quantization_config: dict):
    folder.mkdir(exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"quantization_config": quantization_config}))
    return SafetensorsCheckpoint(folder)


CT_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                                              "symmetric": True, "group_size": 128}}}}


@pytest.mark.parametrize("group", [128, 256, -1])
def test_compressed_tensors_unpacks_to_its_documented_dequantization(tmp_path, group):
    levels = random_levels(2)
    groups = 1 if group == -1 else K // group
    scale = bf16_values((N, groups), seed=3)
    packed = pack_compressed_tensors(levels)
    ckpt = write_checkpoint(tmp_path / "ct", {
        "m.q_proj.weight_packed": packed, "m.q_proj.weight_scale": scale,
        "m.q_proj.weight_shape": np.array([N, K], np.int64), "m.norm.weight": np.ones(K, np.float32),
    }, CT_CONFIG)
    modules = read_quantization(tmp_path / "ct", ckpt)
    assert isinstance(modules, CompressedTensors)
    assert "m.q_proj.weight" in modules and "m.norm.weight" not in modules
    modules.check("m.q_proj.weight", (N, K))
    w4 = modules.read("m.q_proj.weight")
    expected = dequantize_compressed_tensors(packed, scale, K if group == -1 else group)
    assert np.array_equal(w4.dequantize(), expected)


def test_compressed_tensors_fp16_scales_round_to_bf16(tmp_path):
    levels = random_levels(4)
    scale = np.random.default_rng(5).uniform(1e-3, 2e-2, (N, K // 128)).astype(np.float16)
    packed = pack_compressed_tensors(levels)
    ckpt = write_checkpoint(tmp_path / "ct", {"m.weight_packed": packed, "m.weight_scale": scale,
                                              "m.weight_shape": np.array([N, K], np.int32)}, CT_CONFIG)
    w4 = read_quantization(tmp_path / "ct", ckpt).read("m.weight")
    expected = dequantize_compressed_tensors(packed, scale.astype(np.float32), 128)
    assert np.array_equal(w4.levels(), levels)
    assert np.all(np.abs(w4.dequantize() - expected) <= BF16_ROUNDOFF * np.abs(expected))


def test_compressed_tensors_scales_that_do_not_match_the_weights_are_refused(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ct", {
        "m.weight_packed": pack_compressed_tensors(random_levels(6)), "m.weight_scale": bf16_values((N, 3), 7),
        "m.weight_shape": np.array([N, K], np.int64)}, CT_CONFIG)
    with pytest.raises(CheckpointError, match="scales do not match the weights"):
        read_quantization(tmp_path / "ct", ckpt).check("m.weight", (N, K))


# ---- GPTQ / AutoRound


def pack_gptq(levels_kn: np.ndarray, zero_stored: int, groups: int):
    """qweight int32 [K/8, N]: q[k, n] = level + 8 at bits 4 (k % 8) of word k // 8; qzeros [groups, N/8]."""
    k, n = levels_kn.shape
    qweight = np.zeros((k // 8, n), np.uint32)
    for j in range(8):
        qweight |= (levels_kn[j::8] + 8).astype(np.uint32) << np.uint32(4 * j)
    qzeros = np.zeros((groups, n // 8), np.uint32)
    for j in range(8):
        qzeros |= np.uint32(zero_stored << (4 * j))
    return qweight.view(np.int32), qzeros.view(np.int32)


def dequantize_gptq(qweight: np.ndarray, scales: np.ndarray, qzeros: np.ndarray, g_idx: np.ndarray, v1: bool):
    """w[n, k] = scales[g, n] * (q[k, n] - zero[g, n]), g = g_idx[k]; the v1 format stores zero - 1."""
    words, zwords = qweight.view(np.uint32), qzeros.view(np.uint32)
    k_total, n_total = words.shape[0] * 8, words.shape[1]
    out = np.empty((n_total, k_total), np.float32)
    for k in range(k_total):
        g = g_idx[k]
        for n in range(n_total):
            zero = nibble(zwords[g, n // 8], n % 8) + (1 if v1 else 0)
            out[n, k] = scales[g, n] * (nibble(words[k // 8, n], k % 8) - zero)
    return out


@pytest.mark.parametrize("quant_method,checkpoint_format", [("gptq", "gptq"), ("gptq", "gptq_v2"),
                                                             ("auto-round", "auto_round:auto_gptq")])
def test_gptq_unpacks_to_its_documented_dequantization(tmp_path, quant_method, checkpoint_format):
    v1 = checkpoint_format != "gptq_v2"
    levels = random_levels(8, (K, N))  # GPTQ keeps [in, out]
    groups = K // 128
    scales = bf16_values((groups, N), seed=9).astype(np.float16)
    qweight, qzeros = pack_gptq(levels, 7 if v1 else 8, groups)
    g_idx = (np.arange(K) // 128).astype(np.int32)
    config = {"quant_method": quant_method, "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
    config["packing_format" if quant_method == "auto-round" else "checkpoint_format"] = checkpoint_format
    ckpt = write_checkpoint(tmp_path / "gptq", {"m.qweight": qweight, "m.scales": scales, "m.qzeros": qzeros,
                                                "m.g_idx": g_idx}, config)
    modules = read_quantization(tmp_path / "gptq", ckpt)
    assert isinstance(modules, GPTQ)
    modules.check("m.weight", (N, K))
    expected = dequantize_gptq(qweight, scales.astype(np.float32), qzeros, g_idx, v1)
    assert np.array_equal(modules.read("m.weight").dequantize(), expected)


def test_gptq_asymmetric_zero_points_are_refused(tmp_path):
    qweight, qzeros = pack_gptq(random_levels(10, (K, N)), 5, K // 128)
    ckpt = write_checkpoint(tmp_path / "gptq", {"m.qweight": qweight, "m.scales": bf16_values((K // 128, N), 1),
                                                "m.qzeros": qzeros},
                            {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True})
    with pytest.raises(CheckpointError, match="symmetric"):
        read_quantization(tmp_path / "gptq", ckpt).check("m.weight", (N, K))


# ---- the routes, on the same W4 weights


@pytest.fixture(scope="module")
def w4() -> W4Weight:
    return quantize_rtn(np.random.default_rng(12).standard_normal((N, K)).astype(np.float32) * 0.05)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_w4a16_is_within_bf16_activation_rounding_of_the_fp32_matmul(w4, rows):
    """|y - x W^T| <= 2^-8 * (|x| @ |W|^T) from rounding x to bf16, plus fp32 summation slack."""
    dense = w4.dequantize()
    x = np.random.default_rng(rows).standard_normal((rows, K)).astype(np.float32)
    y = W4A16Linear(w4)(x)
    exact = x.astype(np.float64) @ dense.T.astype(np.float64)
    magnitude = np.abs(x) @ np.abs(dense).T
    assert np.all(np.abs(y - exact) <= (BF16_ROUNDOFF + 1e-5) * magnitude)
    # and it is exactly the fp32 products of bf16 activations, up to fp32 summation order
    assert np.allclose(y, round_to_bf16(x) @ dense.T, rtol=0, atol=1e-5 * magnitude.max())


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_w4a8_is_within_int8_activation_rounding_of_the_fp32_matmul(w4, rows):
    dense = w4.dequantize()
    x = np.random.default_rng(rows).standard_normal((rows, K)).astype(np.float32)
    y = W4A8Linear(w4)(x)
    exact = x.astype(np.float64) @ dense.T.astype(np.float64)
    _, act_scale = quantize_int8_blocks(x)
    bound = (np.repeat(act_scale, 32, axis=1) / 2) @ np.abs(dense).T + 1e-5 * (np.abs(x) @ np.abs(dense).T)
    assert np.all(np.abs(y - exact) <= bound)


def test_w4a8_activation_quantization_error_is_measured_and_small():
    x = np.random.default_rng(13).standard_normal((64, 1024)).astype(np.float32)
    q, scale = quantize_int8_blocks(x)
    restored = (q * scale[..., None]).reshape(x.shape)
    error = restored - x
    assert np.all(np.abs(q) <= 127) and np.array_equal(q, np.rint(q))
    assert np.all(np.abs(error) <= np.repeat(scale, 32, axis=1) / 2 * (1 + 1e-6))
    relative_rms = np.sqrt(np.mean(error**2) / np.mean(x**2))
    print(f"w4a8 activation quantization: relative RMS error {relative_rms:.5f} (int8, absmax per 32)")
    assert 0.002 < relative_rms < 0.01  # Gaussian blocks of 32: absmax ~2.5 sigma, step/sqrt(12) ~ 0.6%


@pytest.mark.parametrize("linear_type", [W4A16Linear, W4A8Linear])
def test_a_row_does_not_depend_on_how_many_rows_came_with_it(w4, linear_type):
    x = np.random.default_rng(14).standard_normal((16, K)).astype(np.float32)
    linear = linear_type(w4)
    together = linear(x)
    for t in (0, 7, 15):
        assert np.array_equal(together[t], linear(x[t : t + 1])[0])


def test_bf16_route_runs_the_exact_dequantized_weights(w4):
    x = np.random.default_rng(15).standard_normal((3, K)).astype(np.float32)
    assert np.array_equal(DenseLinear(w4.dequantize())(x), np.stack([row @ w4.dequantize().T for row in x]))


def test_stacked_parts_merge_by_runs_of_one_storage_form():
    """q | k | v | z in W4 and b | a in float (an INT4 DeltaNet): two matrices, not four, same outputs."""
    from duet.engine.assemble import stacked_linear
    from duet.engine.backend.cpu import ConcatOutputs

    rng = np.random.default_rng(3)
    w4 = [quantize_rtn(rng.standard_normal((n, 256)).astype(np.float32)) for n in (48, 16)]
    dense = [rng.standard_normal((4, 256)).astype(np.float32) for _ in range(2)]
    linear = stacked_linear([*w4, *dense], "w4a16")
    # The parts are the numpy Linears or their compiled twins (engine/backend/compiled.py), by route.
    assert isinstance(linear, ConcatOutputs) and [p.route for p in linear.parts] == ["w4a16", "bf16"]
    assert linear.shape == (72, 256)
    x = rng.standard_normal((20, 256)).astype(np.float32)
    separate = np.concatenate([W4A16Linear(w)(x) for w in w4] + [DenseLinear(d)(x) for d in dense], axis=-1)
    np.testing.assert_allclose(linear(x), separate, rtol=1e-5, atol=1e-5)  # one GEMM's summation order
