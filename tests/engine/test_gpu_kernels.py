"""Each GPU op (engine/backend/cupy_backend.py) against the CPU route numerics (engine/backend/cpu.py,
cpu_ops.py, engine/cache.py), on two devices (the `cp` fixture): a GPU, where there is one
(elsewhere those cases are skipped with the reason; the kernels are still compiled for sm_86 and
sm_90 by test_kernels_compile.py), and the simulated device (simulated_device.py), where numpy twins
of the kernels run under the same op wrappers: it checks the launches and the twins, not the CUDA code.

Flash-Next's steps (hyper-connection norms, mixing and injection, the PLE gate and dilated conv, QSA's
block pooling, selection and sparse attention) are held to engine/flash_next.FlashCpuOps the same way.

Per-op tolerances (what may differ, and the bound that follows):
- bit-exact: bf16 rounding, int8 activation codes and scales (plain and Hadamard-rotated): the same
  operations in the same order.
- fp32 sums in another order (GEMVs, attention, DeltaNet, norms): |gpu - cpu| <= SUM_RTOL x the sum
  of the absolute terms (a dot's error bound is ~n eps of that; n eps / sqrt-ish in practice).
- expf/sinf/cosf to 2 ulp (silu, sigmoid, softplus, RoPE angles): relative 1e-5 of the magnitude.
"""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from simulated_device import cupy_fixture

from duet.engine.backend import cpu
from duet.engine.backend import cupy_backend as gb
from duet.engine.cache import DeltaNetState, IndexedKVCache, KVCache, PLEState, Q4KVCache
from duet.engine.checkpoint.safetensors import bf16_to_f32
from duet.engine.backend.cpu_ops import apply_rope, attend, causal_conv, delta_rule_rows, l2_normalize, rms_norm, rope_tables, sigmoid, silu
from duet.engine.flash_next import FlashCpuOps, stream_norm
from duet.engine.quant.activation import f32_to_bf16_bits, quantize_int8_blocks, round_to_bf16
from duet.engine.quant.gguf_blocks import BlockMatrix
from duet.engine.quant.trellis import TrellisWeight, rotated_int8_activations, rotation_signs
from duet.engine.quant.w4 import W4Weight, pack_levels

cp = cupy_fixture()
pytestmark = pytest.mark.usefixtures("cp")  # every test runs on each device

SUM_RTOL = 2e-6
ROW_COUNTS = [1, 3, 8, 9, 16, 21]  # one and two n8 tiles, partial tiles, and a prefill past 16 rows


def host(a) -> np.ndarray:
    return a.get()


def assert_sum_close(got, want, magnitude, rtol=SUM_RTOL):
    """|got - want| <= rtol x magnitude elementwise (magnitude: the sum of |terms|)."""
    err = np.abs(np.asarray(got, np.float64) - want)
    bound = rtol * magnitude + 1e-30
    assert np.all(err <= bound), f"worst error {float((err / bound).max()):.2f}x the bound"


def random_w4(N: int, K: int, seed: int) -> W4Weight:
    rng = np.random.default_rng(seed)
    levels = rng.integers(-8, 8, (N, K))
    scales = rng.uniform(0.001, 0.02, (N, K // 128)).astype(np.float32)
    return W4Weight(pack_levels(levels), f32_to_bf16_bits(scales))


# ------------------------------------------------------------------------ w4a16 ---

@pytest.mark.parametrize("T", ROW_COUNTS)
@pytest.mark.parametrize("N,K", [(512, 1024), (64, 5120)])  # one split, and groups split over blocks
def test_w4a16_matches_cpu(T, N, K):
    w = random_w4(N, K, seed=T + N)
    x = np.random.default_rng(T).standard_normal((T, K)).astype(np.float32)
    want = cpu.W4A16Linear(w)(x)
    linear = gb.W4A16Linear(w)
    got = host(linear(x))
    magnitude = np.abs(round_to_bf16(x)) @ np.abs(w.dequantize()).T
    assert_sum_close(got, want, magnitude)
    # a split's last arrival sums the partials in split order and leaves the counts for the next call
    assert np.array_equal(host(linear(x)), got) and not host(linear.arrivals).any()


@pytest.mark.parametrize("T", [1, 4, 16, 21])
@pytest.mark.parametrize("I,K", [(256, 1024), (32, 5120)])  # one split, and groups split over blocks
def test_w4a16_gate_up_ends_in_swiglu(T, I, K):
    """An MLP's gate | up on w4a16 (ops.gate_up's form, rows interleaved per 16-row tile) gives
    silu(gate) * up from its product's epilogue: the CPU's swiglu within the product's bound, the
    same as the GPU's separate product and silu_mul, and its bf16 bits for the down projection."""
    from duet.engine.backend.cpu_ops import CpuOps

    w = random_w4(2 * I, K, seed=T + I)
    x = np.random.default_rng(T).standard_normal((T, K)).astype(np.float32)
    fused = gb.SwiGLUW4A16Linear(gb.W4A16Linear(w))
    got = fused.swiglu(x, gb.EMIT_BF16)
    values = host(got.f32)
    assert values.shape == (T, I) and np.array_equal(host(got.bf16), f32_to_bf16_bits(values))
    separate = host(gb.silu_mul(gb.W4A16Linear(w)(x)))
    np.testing.assert_allclose(values, separate, rtol=1e-6, atol=1e-30)
    gate_up = cpu.W4A16Linear(w)(x)
    magnitude = np.abs(round_to_bf16(x)) @ np.abs(w.dequantize()).T  # each product's bound, carried through silu * up
    want = CpuOps(compiled_steps=False).swiglu(cpu.W4A16Linear(w), x)
    slack = SUM_RTOL * (magnitude[:, :I] * np.abs(gate_up[:, I:]) + magnitude[:, I:] * np.abs(gate_up[:, :I])) * 1.2
    assert np.all(np.abs(values - want) <= slack + 1e-6 * np.abs(want) + 1e-30)
    assert np.array_equal(host(fused.swiglu(x)), values) and not host(fused.arrivals).any()


@pytest.mark.parametrize("T", ROW_COUNTS)
def test_bf16_weights_stay_bf16_on_the_card_and_match_cpu(T):
    """The bf16 route keeps a checkpoint's bf16 bits on the card (bf16_gemv widens them exactly):
    the CPU's BF16Linear within the fp32 sum bound, any T; the draft shortlist's leading rows read
    the same bits; an MLP's gate | up gives silu(gate) * up from the same pass (bf16_swiglu) as the
    product and silu_mul give it; a tied table's rows widen exactly (embed_bf16)."""
    from duet.engine.backend.cupy_model import Embedding
    from duet.engine.weights import BF16Matrix

    rng = np.random.default_rng(T)
    bits = f32_to_bf16_bits(rng.standard_normal((96, 264)).astype(np.float32) * 0.05)  # K a multiple of 8, not 256
    matrix, x = BF16Matrix(bits), rng.standard_normal((T, 264)).astype(np.float32)
    linear = gb.BF16Linear(matrix)
    assert linear.bits.dtype == np.uint16 and linear.shape == (96, 264)
    got, weight = host(linear(x)), matrix.dequantize()
    assert_sum_close(got, cpu.BF16Linear(matrix)(x), np.abs(x) @ np.abs(weight).T)
    assert np.array_equal(host(linear.leading_rows(32)(x)), got[:, :32])
    fused = host(gb.SwiGLUBF16Linear(linear).swiglu(x))
    np.testing.assert_allclose(fused, host(gb.silu_mul(linear(x))), rtol=1e-6, atol=1e-30)
    ids = np.array([5, 0, 95, 5][: max(1, T % 5)])
    assert np.array_equal(host(Embedding(linear.bits, bf16=True)[ids]), weight[ids])


def test_bf16_rounding_is_bit_exact(cp):
    x = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 1e3
    assert np.array_equal(host(gb.to_bf16_bits(cp.asarray(x))), f32_to_bf16_bits(x))


# ------------------------------------------------------------------------- w4a8 ---

def test_int8_activations_are_bit_exact(cp):
    x = np.random.default_rng(1).standard_normal((5, 1024)).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: scale 0, codes 0
    q, scale = gb.quantize_int8(cp.asarray(x))
    want_q, want_scale = quantize_int8_blocks(x)
    assert np.array_equal(host(q).reshape(want_q.shape), want_q.astype(np.int8))
    assert np.array_equal(host(scale), want_scale)


def random_blocks(qtype: Q, N: int, K: int, seed: int) -> BlockMatrix:
    rng = np.random.default_rng(seed)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (N * K // block, type_size), dtype=np.uint8)
    raw[:, 0:2] = rng.uniform(-0.02, 0.02, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)  # d
    return BlockMatrix(qtype, raw.reshape(N, -1), K)


def w4a8_weights(N: int, K: int, seed: int):
    return [random_w4(N, K, seed)] + [random_blocks(qt, N, K, seed) for qt in (Q.Q8_0, Q.Q4_0, Q.IQ4_XS)]


@pytest.mark.parametrize("T", ROW_COUNTS)
@pytest.mark.parametrize("kind", range(4), ids=["int4", "q8_0", "q4_0", "iq4_xs"])
def test_w4a8_matches_cpu(T, kind):
    N, K = 96, 1024
    w = w4a8_weights(N, K, seed=T)[kind]
    x = np.random.default_rng(T).standard_normal((T, K)).astype(np.float32)
    want = cpu.W4A8Linear(w)(x)
    got = host(gb.W4A8Linear(w)(x))
    q, scale = quantize_int8_blocks(x)
    magnitude = (np.abs(q) * scale[..., None]).reshape(T, K) @ np.abs(w.dequantize()).T
    assert_sum_close(got, want, magnitude)


@pytest.mark.parametrize("T", ROW_COUNTS)
@pytest.mark.parametrize("kind", range(4), ids=["int4", "q8_0", "q4_0", "iq4_xs"])
def test_w4a8_swiglu_is_the_product_then_silu_mul(T, kind):
    """An MLP's gate | up on w4a8 with SwiGLU in the product (int8_swiglu_*, int8_gemv's sums), with
    the forms the down projection reads, any T: bit for bit the product then silu_mul where the product
    is int8_gemv's too (GGUF blocks); W4's product runs on tensor cores (w4a8_mma_*: the same exact dots,
    summed in another order), so there within the fp32 sum bound carried through silu * up."""
    I, K = 64, 1024
    w = w4a8_weights(2 * I, K, seed=T)[kind]
    x = np.random.default_rng(T).standard_normal((T, K)).astype(np.float32)
    both = gb.EMIT_BF16 | gb.EMIT_INT8
    fused = gb.SwiGLUW4A8Linear(gb.W4A8Linear(w)).swiglu(x, both)
    product = host(gb.W4A8Linear(w)(x))
    if not isinstance(w, W4Weight):
        separate = gb.silu_mul(product, both)
        for form in ("f32", "bf16", "q", "scale"):
            assert np.array_equal(host(getattr(fused, form)), host(getattr(separate, form))), form
        return
    q, scale = quantize_int8_blocks(x)
    magnitude = (np.abs(q) * scale[..., None]).reshape(T, K) @ np.abs(w.dequantize()).T
    slack = SUM_RTOL * (magnitude[:, :I] * np.abs(product[:, I:]) + magnitude[:, I:] * np.abs(product[:, :I])) * 1.2
    want = silu(product[:, :I]) * product[:, I:]
    assert np.all(np.abs(host(fused.f32) - want) <= slack + 1e-6 * np.abs(want) + 1e-30)


def test_w4a8_refuses_block_types_without_a_device_decoder():
    with pytest.raises(ValueError, match="Q6_K"):
        gb.W4A8Linear(random_blocks(Q.Q6_K, 16, 256, 0))


def test_ops_refuse_shapes_their_kernels_do_not_take():
    with pytest.raises(ValueError, match="N % 16 == 0"):
        gb.W4A16Linear(random_w4(40, 128, 0))
    mixed, z, gates = np.zeros((1, 64), np.float32), np.zeros((1, 32), np.float32), np.zeros((1, 1), np.float32)
    with pytest.raises(ValueError, match="key dims 32, 64, 128"):
        gb.deltanet(mixed, z, SimpleNamespace(decay_rate=gates[0]), 1, 16, gb.DeltaNetState(64, 4, 1, 16, 32), [], 1e-6,
                    b=gates, a=gates)


def test_linears_report_their_weights_shape():
    w = random_w4(32, 256, 0)
    linears = [gb.DenseLinear(w.dequantize()), gb.W4A16Linear(w), gb.PermutedInput(gb.W4A8Linear(w), np.arange(256)[::-1])]
    assert [linear.shape for linear in linears] == [(32, 256)] * 3


def random_trellis(N: int, K: int, k: int, seed: int) -> TrellisWeight:
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (N // 16 * K // 8, 16 * k), dtype=np.uint8)  # any stream is a valid code
    return TrellisWeight(packed, rng.uniform(0.5, 2.0, N).astype(np.float32), (N, K), k, seed)


def test_rotated_int8_activations_are_bit_exact(cp):
    x = np.random.default_rng(2).standard_normal((3, 512)).astype(np.float32)
    signs = cp.asarray(rotation_signs(512, 11))
    q, scale = gb.rotate_quantize_int8(cp.asarray(x), signs)
    want_q, want_scale = rotated_int8_activations(x, 11)
    assert np.array_equal(host(q).reshape(want_q.shape), want_q.astype(np.int8))
    assert np.array_equal(host(scale), want_scale)


@pytest.mark.parametrize("T", [1, 5, 16])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_trellis_matches_cpu(T, k):
    N, K = 64, 1024
    w = random_trellis(N, K, k, seed=k)
    x = np.random.default_rng(T).standard_normal((T, K)).astype(np.float32)
    want = cpu.TrellisLinear(w)(x)
    got = host(gb.TrellisLinear(w)(x))
    q, scale = rotated_int8_activations(x, w.seed)
    magnitude = (np.abs(q) * scale[..., None]).reshape(T, K) @ np.abs(w.dequantize_rotated()).T
    assert_sum_close(got, want, magnitude)


# --------------------------------------------------------------------- DeltaNet ---

def deltanet_inputs(rng, T: int, dk: int, dv: int, hk: int, hv: int, KW: int = 4) -> SimpleNamespace:
    """A DeltaNet layer's parameters and two calls' in_proj outputs and normed inputs, random."""
    C = 2 * hk * dk + hv * dv
    return SimpleNamespace(
        C=C, KW=KW, mixed=rng.standard_normal((2, T, C)).astype(np.float32), z=rng.standard_normal((2, T, hv * dv)).astype(np.float32),
        b=rng.standard_normal((2, T, hv)).astype(np.float32), a=rng.standard_normal((2, T, hv)).astype(np.float32),
        layer=SimpleNamespace(conv=rng.standard_normal((C, KW)).astype(np.float32), decay_rate=-np.exp(rng.standard_normal(hv).astype(np.float32)),
                              dt_bias=rng.standard_normal(hv).astype(np.float32), norm=rng.standard_normal(dv).astype(np.float32)),
        history=rng.standard_normal((KW - 1, C)).astype(np.float32), start=rng.standard_normal((hv, dk, dv)).astype(np.float32) * 0.1,
        x=rng.standard_normal((2, T, 256)).astype(np.float32),  # the normed input, and in_proj_b | in_proj_a in bf16
        ba_bits=f32_to_bf16_bits(rng.standard_normal((2 * hv, 256)).astype(np.float32) * 0.1))


def test_the_conv_ring_is_the_kernels():
    from simulated_device import constant

    assert gb.CONV_RING == constant("deltanet", "CONV_RING") and gb.CONV_RING & (gb.CONV_RING - 1) == 0


@pytest.mark.parametrize("b_and_a", ["columns", "in the launch"])
@pytest.mark.parametrize("dk,dv,hk,hv", [(32, 64, 2, 4), (128, 128, 16, 48)])
def test_deltanet_launch_matches_cpu_and_rolls_back(dk, dv, hk, hv, b_and_a, cp):
    """The conv over the ring's history, the rule and the gated norm in one launch a slice, against
    the CPU's causal_conv, delta_rule_rows and rms_norm * silu: outputs, the state, a rollback into the
    last slice after which the next call (reading its history from the ring) continues as the CPU that
    saw only the kept rows, and a rollback that replays the recorded rows to the very bits a call of
    those rows leaves. The first call runs as two slices, as a longer call would. b and a come as
    columns of the projection, or from in_proj_b/a's bf16 rows times the normed input in the launch
    (a W4 checkpoint's 16-bit rows)."""
    rng = np.random.default_rng(dk)
    T, eps = 5, 1e-6
    d = deltanet_inputs(rng, T, dk, dv, hk, hv)
    layer = d.layer
    if b_and_a == "in the launch":
        d.b, d.a = np.split(d.x @ bf16_to_f32(d.ba_bits).T, 2, axis=-1)  # what the launch makes

    def cpu_call(state: DeltaNetState, call: int, rows: int):
        conv = causal_conv(d.mixed[call, :rows], layer.conv, state)
        q, k = (l2_normalize(conv[:, i * hk * dk : (i + 1) * hk * dk].reshape(rows, hk, dk)) for i in range(2))
        q, k = np.repeat(q * np.float32(dk ** -0.5), hv // hk, axis=1), np.repeat(k, hv // hk, axis=1)
        log_decay = layer.decay_rate * np.logaddexp(0.0, d.a[call, :rows] + layer.dt_bias).astype(np.float32)
        o = delta_rule_rows(q, k, conv[:, 2 * hk * dk :].reshape(rows, hv, dv), sigmoid(d.b[call, :rows]), log_decay, state)
        return (rms_norm(o, layer.norm, eps) * silu(d.z[call, :rows].reshape(rows, hv, dv))).reshape(rows, hv * dv)

    P = 40  # the history's positions 37..39 sit in the ring's rows for them
    state = gb.DeltaNetState(d.C, d.KW, hv, dk, dv)
    ring = np.zeros(state.ring.shape, np.float32)
    ring[np.arange(P - d.KW + 1, P) % ring.shape[0]] = d.history
    state.ring[...], state.recurrent[...] = cp.asarray(ring), cp.asarray(d.start)

    def gpu_call(call: int, slices: list):
        # q | k | v, z, b and a read in place from wider rows, as the model passes columns of its projection
        wide = cp.asarray(np.concatenate([d.mixed[call], d.z[call], d.b[call], d.a[call], np.full((T, 3), np.nan, np.float32)], axis=1))
        C, Z = d.C, d.C + hv * dv
        at = [(piece, cp.asarray([position], dtype=cp.int32)) for piece, position in slices]
        if b_and_a == "in the launch":
            b_a = {"ba_weight": cp.asarray(d.ba_bits), "x": cp.asarray(d.x[call])}
        else:
            b_a = {"b": wide[:, Z:Z + hv], "a": wide[:, Z + hv:Z + 2 * hv]}
        return host(gb.deltanet(wide[:, :C], wide[:, C:Z], layer, hk, dk, state, at, eps, **b_a))

    cpu_state = DeltaNetState(d.C, d.KW, hv, dk, dv)
    cpu_state.conv, cpu_state.recurrent = d.history.copy(), d.start.copy()
    want = cpu_call(cpu_state, 0, T)
    np.testing.assert_allclose(gpu_call(0, [(slice(0, 3), P), (slice(3, T), P + 3)]), want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(host(state.recurrent), cpu_state.recurrent, rtol=1e-4, atol=1e-5)  # its last: S itself
    state.keep(1)  # the first row of the second slice: the state after 4 rows
    kept = DeltaNetState(d.C, d.KW, hv, dk, dv)
    kept.conv, kept.recurrent = d.history.copy(), d.start.copy()
    cpu_call(kept, 0, 4)
    np.testing.assert_allclose(host(state.recurrent), kept.recurrent, rtol=1e-4, atol=1e-5)
    before = state.saved()
    np.testing.assert_allclose(gpu_call(1, [(slice(0, T), P + 4)]), cpu_call(kept, 1, T), rtol=1e-4, atol=1e-5)
    state.keep(3)  # replayed from the recorded rows: the very bits a call of those 3 rows leaves
    replayed = host(state.recurrent)
    state.restore(before)
    gpu_call(1, [(slice(0, 3), P + 4)])
    np.testing.assert_array_equal(replayed, host(state.recurrent))


# -------------------------------------------------------------------- attention ---

def attention_inputs(T, past, heads, kv, hd, seed):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((past + T, kv, hd)).astype(np.float32)
    values = rng.standard_normal((past + T, kv, hd)).astype(np.float32)
    q = rng.standard_normal((T, heads, hd)).astype(np.float32)
    return q, keys, values


@pytest.mark.parametrize("T,past", [(1, 0), (1, 700), (6, 1500)])
@pytest.mark.parametrize("hd", [64, 256])
@pytest.mark.parametrize("heads,kv", [(8, 2), (24, 4), (32, 2)])  # a block serves 4, 6 or (in two passes) 16 query heads
def test_attention_bf16_cache_matches_cpu(T, past, hd, heads, kv, cp):
    q, keys, values = attention_inputs(T, past, heads, kv, hd, seed=T + past)
    cache = gb.KVCache(kv, hd, capacity=past + T)
    cache.append(keys, in_wider_rows(values, cp), cp.asarray([0], cp.int32))
    got = host(gb.attend(q, cache, cp.asarray([past], cp.int32), past))
    # the GPU cache stores bf16: the CPU reference reads the same rounded rows
    k_rounded, v_rounded = (round_to_bf16(a).transpose(1, 0, 2) for a in (keys, values))
    want = attend(q, k_rounded, v_rounded, past)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # the last chunk to arrive combines, and leaves the counts at 0 for the next launch
    assert np.array_equal(host(gb.attend(q, cache, cp.asarray([past], cp.int32), past)), got)
    assert not host(cache.arrivals(0)).any()


@pytest.mark.parametrize("T,past", [(1, 2), (4, 300), (3, 1200)])
def test_attention_q4_cache_matches_cpu(T, past, cp):
    heads, kv, hd = 8, 2, 128
    q, keys, values = attention_inputs(T, past, heads, kv, hd, seed=past)
    cpu_cache = Q4KVCache(kv, hd)
    cpu_cache.append(keys.transpose(1, 0, 2), values.transpose(1, 0, 2))
    cache = gb.Q4KVCache(kv, hd, capacity=past + T)
    for start in range(0, past + T, 16):  # appended as decode and verify steps would
        rows = slice(start, min(past + T, start + 16))
        cache.append(keys[rows], in_wider_rows(values[rows], cp), cp.asarray([start], cp.int32))
    assert np.array_equal(host(cache.signs), cpu_cache.signs)
    got = host(gb.attend(q, cache, cp.asarray([past], cp.int32), past))
    want = np.concatenate([attend(q[t:t + 1], *cpu_cache.rows(past + t + 1), past + t) for t in range(T)])
    # codes can differ where a rotated value sits on a rounding boundary (the CPU rotates by a float64
    # matmul, the GPU by fp32 butterflies): one level of one group moves an output by ~scale / 7.
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=2e-3)


def in_wider_rows(x: np.ndarray, cp, before: int = 5, after: int = 3):
    """x [T, ...] as the columns of wider device rows (NaN around them), as the stacked q | k | v
    projection hands the kernels its column ranges to read in place."""
    rows = x.reshape(x.shape[0], -1)
    wide = np.concatenate([np.full((len(rows), before), np.nan, np.float32), rows,
                           np.full((len(rows), after), np.nan, np.float32)], axis=1)
    return cp.asarray(wide)[:, before : before + rows.shape[1]]


# ------------------------------------------------------------------------ norms ---

def test_norms_gates_and_rope_match_cpu(cp):
    rng = np.random.default_rng(4)
    T, heads, hd, eps = 3, 4, 256, 1e-6
    x = rng.standard_normal((T, 5120)).astype(np.float32)
    w = rng.standard_normal(5120).astype(np.float32)
    np.testing.assert_allclose(host(gb.rms_norm(x, w, eps)), rms_norm(x, w, eps), rtol=1e-5, atol=1e-6)


    q_and_gate = rng.standard_normal((T, heads * 2 * hd)).astype(np.float32)
    norm_w = 1 + rng.standard_normal(hd).astype(np.float32) * 0.1
    rotary, theta, past = 64, 1e7, 100_000
    inv_freq = 1.0 / theta ** (np.arange(0, rotary, 2, dtype=np.float32) / rotary)
    got = host(gb.qk_norm_rope(q_and_gate, norm_w, inv_freq, cp.asarray([past], cp.int32), heads, hd, 2 * hd, rotary, eps))
    cos, sin = rope_tables(np.arange(past, past + T), rotary, theta)
    want = apply_rope(rms_norm(q_and_gate.reshape(T, heads, 2 * hd)[..., :hd], norm_w, eps), cos, sin)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(host(gb.qk_norm_rope(in_wider_rows(q_and_gate, cp), norm_w, inv_freq, cp.asarray([past], cp.int32),
                                                       heads, hd, 2 * hd, rotary, eps)), got)
    keys = rng.standard_normal((T, 2 * hd)).astype(np.float32)  # two key heads, normed and rotated in the same launch
    key_w = 1 + rng.standard_normal(hd).astype(np.float32) * 0.1
    q_too, k = (host(a) for a in gb.qk_norm_rope(in_wider_rows(q_and_gate, cp), norm_w, inv_freq, cp.asarray([past], cp.int32),
                                                 heads, hd, 2 * hd, rotary, eps, keys=in_wider_rows(keys, cp), key_weight=key_w))
    np.testing.assert_array_equal(q_too, got)
    np.testing.assert_allclose(k, apply_rope(rms_norm(keys.reshape(T, 2, hd), key_w, eps), cos, sin), rtol=1e-5, atol=1e-5)

    attn = rng.standard_normal((T, heads * hd)).astype(np.float32)
    gate = q_and_gate.reshape(T, heads, 2 * hd)[..., hd:].reshape(T, heads * hd)
    gated = host(gb.attention_gate(attn, q_and_gate, hd))
    np.testing.assert_allclose(gated, attn * sigmoid(gate), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(host(gb.attention_gate(attn, in_wider_rows(q_and_gate, cp), hd)), gated)

    gate_up = rng.standard_normal((T, 2 * 1024)).astype(np.float32)
    np.testing.assert_allclose(host(gb.silu_mul(gate_up)), silu(gate_up[:, :1024]) * gate_up[:, 1024:], rtol=1e-5, atol=1e-7)


def test_keys_normed_into_a_bf16_cache_are_what_an_append_stores(cp):
    """qk_norm_rope with a bf16 cache to append to (a decode or verify pass's attention) stores the
    keys it norms and rotates, and the values, exactly as KVCache.append stores the keys it would
    return and the same values; the queries are the same bits either way."""
    rng = np.random.default_rng(8)
    T, heads, kv, hd, past = 4, 4, 2, 64, 37
    qkv = rng.standard_normal((T, heads * 2 * hd + 2 * kv * hd)).astype(np.float32)
    q_and_gate, k, v = (in_wider_rows(qkv[:, a:b], cp) for a, b in ((0, heads * 2 * hd), (heads * 2 * hd, -kv * hd), (-kv * hd, None)))
    norm_q, norm_k = (1 + rng.standard_normal(hd).astype(np.float32) * 0.1 for _ in range(2))
    inv_freq = 1.0 / 1e7 ** (np.arange(0, 16, 2, dtype=np.float32) / 16)
    start = cp.asarray([past + 1], cp.int32)  # the MTP layer's rotary positions run one past its cache index
    cache_start = cp.asarray([past], cp.int32)
    norm_rope = lambda **cache: gb.qk_norm_rope(q_and_gate, norm_q, inv_freq, start, heads, hd, 2 * hd, 16, 1e-6,  # noqa: E731
                                                keys=k, key_weight=norm_k, **cache)
    appended, fused = gb.KVCache(kv, hd, capacity=past + T + 2), gb.KVCache(kv, hd, capacity=past + T + 2)
    q, keys = norm_rope()
    appended.append(keys, v, cache_start)
    q_fused = norm_rope(append_to=fused, values=v, cache_start=cache_start)
    assert np.array_equal(host(q_fused), host(q))
    assert np.array_equal(host(fused.keys), host(appended.keys)) and np.array_equal(host(fused.values), host(appended.values))
    assert fused.length == appended.length == T and host(fused.keys)[:, past : past + T].any()


def test_stacked_linears_of_two_forms_give_columns_that_read_in_place(cp):
    """A ConcatOutputs of a W4 Linear and a dense one (a W4 checkpoint's in_proj with its 16-bit b|a
    rows): its Columns hold the CPU's stacked output; a range inside one part is that part's own
    columns, any range (negative, or across the parts) reads what the joined rows hold."""
    from duet.engine.backend.cupy_model import ConcatOutputs

    rng = np.random.default_rng(3)
    w4, dense = random_w4(64, 256, seed=4), rng.standard_normal((8, 256)).astype(np.float32)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    columns = ConcatOutputs([gb.W4A8Linear(w4), gb.DenseLinear(dense)])(cp.asarray(x))
    want = cpu.ConcatOutputs([cpu.W4A8Linear(w4), cpu.DenseLinear(dense)])(x)
    joined = host(gb.device_f32(columns))
    assert columns.shape == want.shape == joined.shape
    assert_sum_close(joined, want, np.abs(x) @ np.abs(np.concatenate([w4.dequantize(), dense])).T)
    assert np.array_equal(host(columns[:, 10:20]), host(columns.parts[0][:, 10:20]))
    for key in [(slice(None), slice(-8, -4)), (slice(None), slice(-4, None)), (slice(1, None), slice(0, 64)),
                (slice(None), slice(60, 68)), slice(1, 2)]:
        assert np.array_equal(host(columns[key]), joined[key]), key


def test_the_kernels_feeding_linears_emit_their_inputs_bit_for_bit(cp):
    """Each kernel whose output only Linears read (a layer's norms, SwiGLU alone or in w4a8's product,
    DeltaNet's launch, attention's gate, alone or in the combine) writes, beside its fp32 rows, the bf16
    bits and int8 codes and scales that f32_to_bf16_bits and quantize_int8_blocks make of them; the W4
    Linears read those and give the bits they give from the fp32 rows (no conversion launched)."""
    rng = np.random.default_rng(9)
    T, hd, heads = 3, 64, 4
    both = gb.EMIT_BF16 | gb.EMIT_INT8
    x, delta = (cp.asarray(rng.standard_normal((T, 256)).astype(np.float32)) for _ in range(2))
    w = cp.asarray(1 + rng.standard_normal(256).astype(np.float32) * 0.1)
    zeros = cp.zeros((T, 256), cp.float32)  # an all-zero block (scale 0, codes 0) in every row
    q_and_gate = in_wider_rows(rng.standard_normal((T, heads * 2 * hd)).astype(np.float32), cp)
    o = rng.standard_normal((T, heads, hd)).astype(np.float32)
    d = deltanet_inputs(rng, T, 32, 64, 2, 4)

    def deltanet(forms):  # DeltaNet's gated norm, the end of its launch (a fresh state each time: the same values)
        state = gb.DeltaNetState(d.C, d.KW, 4, 32, 64)
        return gb.deltanet(d.mixed[0], d.z[0], d.layer, 2, 32, state, [(slice(0, T), cp.asarray([7], cp.int32))], 1e-6,
                           forms=forms, b=d.b[0], a=d.a[0])

    gate_up = rng.standard_normal((T, 2 * 256)).astype(np.float32)
    swiglu_w4a8 = gb.SwiGLUW4A8Linear(gb.W4A8Linear(random_w4(2 * 256, 256, seed=3)))
    q, keys, values = attention_inputs(T, 40, heads, 2, hd, seed=10)
    cache = gb.KVCache(2, hd, capacity=48)
    cache.append(keys, values, cp.asarray([0], cp.int32))
    start = cp.asarray([40], cp.int32)
    attended = lambda forms: gb.attend(q, cache, start, 40, gates=q_and_gate, forms=forms)  # noqa: E731
    assert np.array_equal(host(attended(0)), host(gb.attention_gate(gb.attend(q, cache, start, 40), q_and_gate, hd)))
    produced = {"rms_norm": lambda forms: gb.rms_norm(x, w, 1e-6, forms),
                "attention's combine, gated": attended,
                "add_rms_norm": lambda forms: gb.add_rms_norm(x, delta, w, 1e-6, forms)[1],
                "add_rms_norm of zeros": lambda forms: gb.add_rms_norm(zeros, zeros, w, 1e-6, forms)[1],
                "silu_mul": lambda forms: gb.silu_mul(gate_up, forms),
                "w4a8 gate | up with SwiGLU": lambda forms: swiglu_w4a8.swiglu(x, forms),
                "deltanet's gated norm": deltanet,
                "attention_gate": lambda forms: gb.attention_gate(o.reshape(T, -1), q_and_gate, hd, forms)}
    linears = [gb.W4A16Linear(random_w4(32, 256, seed=1)), gb.W4A8Linear(random_w4(32, 256, seed=2))]
    for name, produce in produced.items():
        plain, emitted = produce(0), produce(both)
        assert isinstance(emitted, gb.Activations) and not isinstance(plain, gb.Activations), name
        values = host(plain)
        assert np.array_equal(host(emitted.f32), values), name
        assert np.array_equal(host(emitted.bf16), f32_to_bf16_bits(values)), name
        want_q, want_scale = quantize_int8_blocks(values)
        assert np.array_equal(host(emitted.q).reshape(want_q.shape), want_q.astype(np.int8)), name
        assert np.array_equal(host(emitted.scale), want_scale), name
        for linear in linears:
            if linear.K == values.shape[1]:
                assert np.array_equal(host(linear(emitted)), host(linear(plain))), name
                assert np.array_equal(host(linear(emitted[1:])), host(linear(plain[1:]))), name  # rows slice every form
    # int8 needs whole 32-blocks: a 48-wide output emits bf16 only
    odd = gb.silu_mul(rng.standard_normal((T, 96)).astype(np.float32), both)
    assert odd.q is None and odd.bf16 is not None


# ------------------------------------------------------------------- Flash-Next ---
# engine/flash_next.FlashCpuOps is the reference of each step.

FLASH = FlashCpuOps(compiled_steps=False)


@pytest.mark.parametrize("T", [1, 5, 21])
def test_hyper_connection_steps_match_cpu(T, cp):
    rng = np.random.default_rng(T)
    hc, H, eps = 3, 256, 1e-6
    streams = rng.standard_normal((T, hc * H)).astype(np.float32)
    norm = 1 + 0.2 * rng.standard_normal(hc * H).astype(np.float32)
    normed = stream_norm(FLASH, streams, norm, hc, eps)
    got = host(gb.rms_norm(streams.reshape(T, hc, H), norm.reshape(hc, H), eps)).reshape(T, hc * H)  # a weight row per stream
    np.testing.assert_allclose(got, normed, rtol=1e-5, atol=1e-6)
    low = rng.standard_normal((T, 24)).astype(np.float32)
    np.testing.assert_allclose(host(gb.silu_div(low, hc)), FLASH.silu_div(low, hc), rtol=1e-5, atol=1e-7)
    logits = rng.standard_normal((T, hc * H)).astype(np.float32)
    np.testing.assert_allclose(host(gb.hc_mix(normed, logits, hc)), FLASH.hc_mix(normed, logits, hc), rtol=1e-5, atol=1e-6)
    out, inject = rng.standard_normal((T, H)).astype(np.float32), rng.standard_normal((T, hc)).astype(np.float32)
    np.testing.assert_allclose(host(gb.hc_inject(streams, out, inject, hc)), FLASH.hc_inject(streams, out, inject, hc),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1, 4, 21])
def test_ple_gate_and_dilated_conv_match_cpu_and_roll_back(T, cp):
    rng = np.random.default_rng(10 + T)
    hc, H, K, dilation = 3, 64, 4, 3
    C, R = hc * H, (K - 1) * dilation
    key, query = (rng.standard_normal((T, C)).astype(np.float32) for _ in range(2))
    value = rng.standard_normal((T, H)).astype(np.float32)
    key[0, :H] = 0.0  # a gate of exactly 0: sign 0, sigmoid 0.5
    gated = FLASH.ple_gate(key, query, value, hc)
    np.testing.assert_allclose(host(gb.ple_gate(key, query, value, hc)), gated, rtol=1e-5, atol=1e-6)

    normed = rng.standard_normal((T, C)).astype(np.float32)
    taps = rng.standard_normal((C, K)).astype(np.float32)
    history = rng.standard_normal((R, C)).astype(np.float32)
    cpu_state, state = PLEState(2, 7, R, C), PLEState(2, 7, R, C, zeros=cp.zeros)
    cpu_state.conv, state.conv[...] = history.copy(), cp.asarray(history)
    want = FLASH.ple_conv(gated, normed, taps, dilation, cpu_state)
    got = host(gb.ple_conv(gated, normed, taps, dilation, state))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # the conv sums in order; silu's expf is not exact
    assert np.array_equal(host(state.conv), cpu_state.conv)
    if 1 < T <= 16:  # a verify's rollback (a prefill keeps no window): the conv inputs after its first row
        for s in (state, cpu_state):
            s.token_window = np.arange(2 + T)
            s.keep(1)
        assert np.array_equal(host(state.conv), cpu_state.conv) and np.array_equal(cpu_state.conv, np.concatenate([history, normed])[1:1 + R])


def test_index_blocks_pool_as_the_cpu_pools_them_across_calls_and_rollbacks(cp):
    """Raw index keys appended in uneven calls with rollbacks between: every complete block pooled (mean,
    norm, RoPE at its first position plus the MTP layer's offset) as the CPU pools it."""
    rng = np.random.default_rng(7)
    d, ratio, rotary, theta, eps, offset = 32, 4, 16, 1e4, 1e-6, 1
    k_norm = 1 + 0.2 * rng.standard_normal(d).astype(np.float32)
    config = SimpleNamespace(rms_norm_eps=eps, rotary_dim=rotary, rope_theta=theta)
    indexer = SimpleNamespace(k_norm=k_norm, ratio=ratio, config=config)
    inv_freq = 1.0 / theta ** (np.arange(0, rotary, 2, dtype=np.float32) / rotary)
    cpu_cache, cache = IndexedKVCache(KVCache(1, 2), d, ratio), gb.IndexedKVCache(gb.KVCache(1, 64, 8), d, ratio, 8)
    for rows, keep in [(7, 7), (9, 3), (1, 1), (13, 10), (300, 300), (5, 2)]:
        raw = rng.standard_normal((rows, d)).astype(np.float32)
        at = cpu_cache.length
        cpu_cache.kv.append(np.zeros((1, rows, 2), np.float32), np.zeros((1, rows, 2), np.float32))
        cpu_cache.append_index_keys(raw, lambda first, blocks: FLASH._pooled(indexer, first, blocks, offset))
        cache.reserve(at + rows)
        cache.kv.length += rows  # as kv.append counts them
        cache.append_index_keys(cp.asarray(raw), at, lambda first, n: gb.pool_index_blocks(
            cache, first, n, k_norm, inv_freq, rotary, offset, eps))
        assert cache.done_blocks == cpu_cache.done_blocks
        np.testing.assert_allclose(host(cache.blocks)[:cache.done_blocks], cpu_cache.blocks, rtol=1e-5, atol=1e-5)
        cpu_cache.truncate(at + keep)
        cache.truncate(at + keep)
        assert (cache.length, cache.done_blocks) == (cpu_cache.length, cpu_cache.done_blocks)


@pytest.mark.parametrize("T,past", [(1, 2), (3, 60), (16, 200)])
def test_qsa_lists_the_rows_the_cpu_selects(T, past, cp):
    """Integer-valued queries and block keys: every score is exact in fp32 in any summation order, so the
    lists must be the CPU's, its ties (relu sums of 0, equal sums) broken toward the earlier block included."""
    rng = np.random.default_rng(past)
    ratio, top, heads, d = 4, 4, 4, 32
    q = rng.integers(-2, 3, (T, heads, d)).astype(np.float32)
    blocks = rng.integers(-2, 3, ((past + T) // ratio + 1, d)).astype(np.float32)
    selected, counts = gb.qsa_select(q, cp.asarray(blocks), cp.asarray([past], cp.int32), past, ratio, top)
    indexer, cpu_cache = SimpleNamespace(ratio=ratio, top_blocks=top), SimpleNamespace(blocks=blocks)
    for t in range(T):
        want = FLASH._selected(indexer, q[t], cpu_cache, past + t)
        assert np.array_equal(host(selected)[t, :host(counts)[t]], want)


@pytest.mark.parametrize("kind", ["bf16", "q4"])
def test_sparse_attention_over_listed_rows_matches_cpu(kind, cp):
    """Each row attends its own ascending list of rows (the sink, blocks of the quantized middle, the
    recent window, itself last) as the CPU's QSA attends the rows it selects."""
    heads, kv, hd, T, past = 8, 2, 128, 3, 300
    q, keys, values = attention_inputs(T, past, heads, kv, hd, seed=11)
    rng = np.random.default_rng(12)
    lists = [np.unique(np.concatenate([[0, 2], rng.choice(past + t, 40, replace=False), np.arange(past + t - 3, past + t + 1)]))
             for t in range(T)]
    selected = np.zeros((T, max(map(len, lists))), np.int32)
    for t, rows in enumerate(lists):
        selected[t, :len(rows)] = rows
    counts = np.array([len(rows) for rows in lists], np.int32)
    start = cp.asarray([past], cp.int32)
    if kind == "bf16":
        cache = gb.KVCache(kv, hd, capacity=past + T)
        cache.append(keys, values, cp.asarray([0], cp.int32))
        k_rounded, v_rounded = (round_to_bf16(a).transpose(1, 0, 2) for a in (keys, values))
        rows_seen = [(k_rounded, v_rounded)] * T
    else:
        cpu_cache = Q4KVCache(kv, hd)
        cpu_cache.append(keys.transpose(1, 0, 2), values.transpose(1, 0, 2))
        cache = gb.Q4KVCache(kv, hd, capacity=past + T)
        for first in range(0, past + T, 16):
            rows = slice(first, min(past + T, first + 16))
            cache.append(keys[rows], values[rows], cp.asarray([first], cp.int32))
        rows_seen = [cpu_cache.rows(past + t + 1) for t in range(T)]
    got = host(gb.attend_selected(q, cache, start, cp.asarray(selected), cp.asarray(counts)))
    want = np.concatenate([attend(q[t:t + 1], k[:, rows], v[:, rows], len(rows) - 1)
                           for t, (rows, (k, v)) in enumerate(zip(lists, rows_seen))])
    # q4: a code may sit on a rounding boundary (see test_attention_q4_cache_matches_cpu)
    np.testing.assert_allclose(got, want, rtol=1e-3 if kind == "q4" else 1e-4, atol=2e-3 if kind == "q4" else 1e-5)
