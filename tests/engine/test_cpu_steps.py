"""The compiled per-row steps of a decode or verify pass (engine/backend/compiled.py: exp_f32,
rms_norm_rows, swiglu_rows, conv_rows) against float64 formulas written here from REFERENCE.md's
definitions, not from the kernels.

Bounds: U = 2^-24 is fp32's unit roundoff. A sum of n terms in any order is within n U sum|terms| of
the exact sum (Higham); each further fp32 operation adds at most U relative; exp_f32 is within 2 ulp
(<= 4 U relative, as an ulp is at most 2 U of the value). Rows: each row's bits are the same alone
and among up to 16 rows, which keeps exact acceptance exact.
"""

from __future__ import annotations

import numpy as np
import numba
import pytest

from duet.engine.backend import compiled
from duet.engine.backend.cpu_ops import CpuOps
from duet.engine.cache import RECENT_ROWS, DeltaNetState, Q4KVCache

U = 2.0**-24


@numba.njit
def _exp_each(x, out):
    for i in range(x.shape[0]):
        out[i] = compiled.exp_f32(x[i])


def test_exp_is_within_two_ulp_of_float64_exp():
    x = np.concatenate([np.linspace(-87, 88, 1_000_001, dtype=np.float32), np.float32([-87, -1e-30, 0, 1e-30, 88])])
    got = np.empty_like(x)
    _exp_each(x, got)
    want = np.exp(x.astype(np.float64))
    ulps = np.abs(got - want) / np.spacing(want.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 2.0, f"{ulps.max():.2f} ulp"
    assert got[-3] == 1.0


def test_exp_clamps_outside_the_normal_range():
    """Below -87 the result stays a tiny normal float (no subnormal slow path), above 88 finite."""
    x = np.float32([-1000, -100, 100, 1000])
    got = np.empty_like(x)
    _exp_each(x, got)
    assert np.all(got[:2] > 0) and np.all(got[:2] < 1e-37) and np.all(got[:2] >= np.finfo(np.float32).tiny)
    assert np.all(np.isfinite(got[2:])) and np.all(got[2:] > 1e38)


def rows_alone_and_together(kernel, inputs: list[np.ndarray], out_shape: tuple[int, ...]) -> np.ndarray:
    """The kernel over all rows at once; asserts each row gives the same bits run alone."""
    together = np.empty(out_shape, np.float32)
    kernel(*inputs, together)
    for t in range(out_shape[0]):
        alone = np.empty((1, *out_shape[1:]), np.float32)
        kernel(*[x[t : t + 1] if x.ndim == 2 and x.shape[0] == out_shape[0] else x for x in inputs], alone)
        np.testing.assert_array_equal(alone[0], together[t])
    return together


def silu64(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


@pytest.mark.parametrize("D", [64, 256, 1000])
def test_rms_norm_rows_within_the_bound_of_float64(D):
    rng = np.random.default_rng(D)
    x = (rng.standard_normal((16, D)) * rng.uniform(0.01, 100, (16, 1))).astype(np.float32)
    weight = rng.standard_normal(D).astype(np.float32)
    eps = np.float32(1e-6)
    got = np.empty_like(x)
    compiled.rms_norm_rows(x, weight, eps, got)
    for t in range(16):
        alone = np.empty((1, D), np.float32)
        compiled.rms_norm_rows(x[t : t + 1], weight, eps, alone)
        np.testing.assert_array_equal(alone[0], got[t])
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + float(eps)) * weight
    # mean of squares: D U relative (positive terms); the square root halves it; rsqrt, 2 products: 4 U
    np.testing.assert_array_less(np.abs(got - want), (D / 2 + 5) * U * np.abs(want) + 1e-37)


def test_add_rms_norm_rows_adds_the_residual_and_norms_the_sum():
    """A decoder layer's residual add and the norm after it in one pass: the sum is x + delta in fp32
    exactly as numpy adds it, the norm rms_norm_rows' of that sum, bit for bit; a row alone keeps its bits."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((16, 256)) * rng.uniform(0.01, 100, (16, 1))).astype(np.float32)
    delta = rng.standard_normal((16, 256)).astype(np.float32)
    weight = rng.standard_normal(256).astype(np.float32)
    eps = np.float32(1e-6)
    total, normed = np.empty_like(x), np.empty_like(x)
    compiled.add_rms_norm_rows(x, delta, weight, eps, total, normed)
    assert np.array_equal(total, x + delta)
    want = np.empty_like(x)
    compiled.rms_norm_rows(x + delta, weight, eps, want)
    assert np.array_equal(normed, want)
    alone_total, alone = np.empty((1, 256), np.float32), np.empty((1, 256), np.float32)
    compiled.add_rms_norm_rows(x[5:6], delta[5:6], weight, eps, alone_total, alone)
    assert np.array_equal(alone[0], normed[5])


def test_qk_norm_rope_rows_within_the_bound_of_float64():
    """compiled.qk_norm_rope_rows: from the stacked projection's rows (per query head [query | gate],
    then the keys, then the values), each query head of rows first.. and each key head of every row
    normed, then rotated at its token's position, against float64 formulas of REFERENCE.md's
    zero-centred norm and NeoX rotate-half (pairs i, i + 8 of 16 rotated dims) at the same fp32
    angles; a token's heads alone give the bits they get among others. Bound: the norm's
    (hd / 2 + 5) U relative, then a rotated value a cos - b sin adds 4 U of |a| + |b| (cos and sin
    rounded, two products and a sum)."""
    from duet.engine.backend.cpu_ops import rope_frequencies

    rng = np.random.default_rng(5)
    T, first, heads, kv, hd, start = 5, 2, 3, 2, 64, 1000
    queries = heads * 2 * hd
    qkv = (rng.standard_normal((T, queries + 2 * kv * hd)) * rng.uniform(0.01, 100, (T, 1))).astype(np.float32)
    q_norm, k_norm = (rng.standard_normal(hd).astype(np.float32) for _ in range(2))
    inv_freq = rope_frequencies(16, 1e7)
    eps = np.float32(1e-6)
    q, k = np.empty((T - first, heads, hd), np.float32), np.empty((kv, T, hd), np.float32)
    compiled.qk_norm_rope_rows(qkv, first, q_norm, k_norm, eps, start, inv_freq, q, k)
    for t in range(T):
        q_alone, k_alone = np.empty((1, heads, hd), np.float32), np.empty((kv, 1, hd), np.float32)
        compiled.qk_norm_rope_rows(qkv[t : t + 1], 0, q_norm, k_norm, eps, start + t, inv_freq, q_alone, k_alone)
        np.testing.assert_array_equal(k_alone[:, 0], k[:, t])
        if t >= first:
            np.testing.assert_array_equal(q_alone[0], q[t - first])
    positions = np.arange(start, start + T, dtype=np.float32)
    heads_in = {"q": (qkv[first:, :queries].reshape(T - first, heads, 2 * hd)[..., :hd], q_norm, positions[first:], q),
                "k": (qkv[:, queries : queries + kv * hd].reshape(T, kv, hd), k_norm, positions, k.transpose(1, 0, 2))}
    for x, weight, at, got in heads_in.values():
        x64 = x.astype(np.float64)
        normed = x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + float(eps)) * weight
        angles = (at[:, None, None] * inv_freq[None, None, :]).astype(np.float64)  # the fp32 angles the kernel forms
        a, b = normed[..., :8], normed[..., 8:16]
        want = np.concatenate([a * np.cos(angles) - b * np.sin(angles), b * np.cos(angles) + a * np.sin(angles),
                               normed[..., 16:]], axis=-1)
        norm_bound = (hd / 2 + 5) * U
        pair = np.concatenate([np.abs(a) + np.abs(b)] * 2, axis=-1)
        bound = np.concatenate([(norm_bound + 4 * U) * pair, norm_bound * np.abs(normed[..., 16:])], axis=-1)
        np.testing.assert_array_less(np.abs(got - want), bound + 1e-37)
        assert not np.array_equal(got[..., :16], normed[..., :16].astype(np.float32))  # rotated indeed


def test_swiglu_rows_within_the_bound_of_float64():
    rng = np.random.default_rng(3)
    gate_up = (rng.standard_normal((16, 2 * 300)) * 6).astype(np.float32)
    got = rows_alone_and_together(lambda g, out: compiled.swiglu_rows(g, out, 0, out.shape[0]), [gate_up], (16, 300))
    g, u = gate_up[:, :300].astype(np.float64), gate_up[:, 300:].astype(np.float64)
    want = silu64(g) * u
    # exp 4 U, 1 + e <= 4 U (its share of e), the division and the product: 10 U
    np.testing.assert_array_less(np.abs(got - want), 10 * U * np.abs(want) + 1e-37)


def test_a_prefills_swiglu_rows_split_between_threads_keep_their_bits():
    """A prefill's SwiGLU runs swiglu_rows over its token rows in parts: each row's bits as in one run."""
    gate_up = (np.random.default_rng(4).standard_normal((40, 2 * 300)) * 6).astype(np.float32)
    whole = np.empty((40, 300), np.float32)
    compiled.swiglu_rows(gate_up, whole, 0, 40)
    for parts in (2, 3, 40):
        split = np.empty((40, 300), np.float32)
        compiled.parts_driver(compiled.swiglu_rows)((gate_up, split), 40, parts)
        np.testing.assert_array_equal(split, whole)


@pytest.mark.parametrize("T", [1, 3, 16])
def test_conv_rows_within_the_bound_of_float64(T):
    rng = np.random.default_rng(T)
    K, C = 4, 96
    window = (rng.standard_normal((K - 1 + T, C)) * 3).astype(np.float32)
    taps = rng.standard_normal((C, K)).astype(np.float32)
    got = np.empty((T, C), np.float32)
    compiled.conv_rows(window, np.ascontiguousarray(taps.T), got)
    terms = np.stack([window[j : j + T].astype(np.float64) * taps[:, j] for j in range(K)])  # [K, T, C]
    total = terms.sum(axis=0)
    want = silu64(total)
    # the tap sum's error (K U sum|terms|) goes through SiLU, whose slope is below 1.1; then 10 U as SwiGLU
    bound = 1.1 * K * U * np.abs(terms).sum(axis=0) + 10 * U * np.abs(want) + 1e-37
    np.testing.assert_array_less(np.abs(got - want), bound)


def test_a_verify_rows_conv_has_each_rows_decode_bits_and_rolls_forward_the_state():
    """CpuOps.causal_conv (compiled for up to 16 rows): T rows at once give the bits of T one-row
    steps, and leave the same conv state."""
    rng = np.random.default_rng(5)
    K, C, T = 4, 64, 5
    taps = rng.standard_normal((C, K)).astype(np.float32)
    start = rng.standard_normal((K - 1, C)).astype(np.float32)
    mixed = rng.standard_normal((T, C)).astype(np.float32)
    together, stepped = DeltaNetState(C, K, 1, 4, 4), DeltaNetState(C, K, 1, 4, 4)
    together.conv, stepped.conv = start.copy(), start.copy()
    ops = CpuOps(compiled_steps=True)
    all_rows = ops.causal_conv(mixed, taps, together)
    one_by_one = np.concatenate([ops.causal_conv(mixed[t : t + 1], taps, stepped) for t in range(T)])
    np.testing.assert_array_equal(all_rows, one_by_one)
    np.testing.assert_array_equal(together.conv, stepped.conv)
    np.testing.assert_array_equal(together.conv, mixed[-(K - 1) :])


@pytest.mark.parametrize("past", [2, 60, 200])  # sink and exact rows only; some rows coded for the later verify rows; most coded
def test_attend_q4_rows_reads_what_each_rows_decode_step_would(past):
    """compiled.attend_q4_rows against gated softmax attention in float64 over Q4KVCache.rows(end) of
    each row's own end (the sink, the codes rotated back, the exact recent window that moves with the
    row): within the attend_rows bound with the two rotation products (hd terms each, on the query
    and on the coded values' sum) counted in; a row alone and the KV heads split give the same bits."""
    rng = np.random.default_rng(11)
    T, heads, kv, hd = 5, 4, 2, 64
    cache = Q4KVCache(kv, hd)
    for start in range(0, past + T, 7):  # appended a few rows at a time, as decode and verify passes do
        n = min(7, past + T - start)
        cache.append(rng.standard_normal((kv, n, hd)).astype(np.float32), rng.standard_normal((kv, n, hd)).astype(np.float32))
    q = rng.standard_normal((T, heads, hd)).astype(np.float32)
    gates = (rng.standard_normal((T, heads * 2 * hd)) * 3).astype(np.float32)

    def attend(rows, at, first=0):
        got = np.empty((rows.shape[0], heads * hd), np.float32)
        args = (rows, cache.codes.view(np.uint16)[..., 0], cache.scales.view(np.uint16), cache.sink, cache.ring, cache.hadamard, cache.signs,
                RECENT_ROWS, at, gates[first : first + rows.shape[0]], got)
        return got, args

    got, args = attend(q, past)
    compiled.attend_q4_rows(*args, 0, kv)
    split, split_args = attend(q, past)
    compiled.split_kernel(compiled.attend_q4_rows, split_args, kv)
    np.testing.assert_array_equal(split, got)
    scale = hd**-0.5
    for t in range(T):
        alone, alone_args = attend(q[t : t + 1], past + t, t)
        compiled.attend_q4_rows(*alone_args, 0, kv)
        np.testing.assert_array_equal(alone[0], got[t])
        keys, values = cache.rows(past + t + 1)
        for h in range(heads):
            k64, v64, q64 = keys[h // 2].astype(np.float64), values[h // 2].astype(np.float64), q[t, h].astype(np.float64)
            scores = k64 @ q64 * scale
            weights = np.exp(scores - scores.max())
            weights /= weights.sum()
            gate = 1 / (1 + np.exp(-gates[t, h * 2 * hd + hd : (h + 1) * 2 * hd].astype(np.float64)))
            want = (weights @ v64) * gate
            score_error = 3 * hd * U * (np.abs(k64) @ np.abs(q64)).max() * scale
            bound = (2 * score_error + (len(k64) + 15 + 2 * hd) * U) * np.abs(v64).max()
            np.testing.assert_array_less(np.abs(got[t, h * hd : (h + 1) * hd] - want), bound)


@pytest.mark.parametrize("past", [15, 150])  # within one block of keys (64 of head dim 64), and across three
def test_attend_rows_within_the_bound_of_float64_softmax_attention(past):
    """compiled.attend_rows against gated softmax attention in float64, each row over its own keys,
    with grouped query heads, the gates read from the stacked projection's rows; a row alone gives
    the bits it gets among others, and the KV heads split between threads the bits of one run. Bound:
    a score's dot of hd terms errs by at most hd U sum|q_d k_d| (scaled); softmax turns score errors
    of at most e into weight errors of at most 2e relative; the weighted sum of n values adds n U; exp
    adds 4 U; the gate (an exp, a sum, a division) 7 U more."""
    rng = np.random.default_rng(7)
    T, heads, kv, hd = 5, 4, 2, 64
    q = rng.standard_normal((T, heads, hd)).astype(np.float32)
    keys = rng.standard_normal((kv, past + T + 3, hd)).astype(np.float32)  # rows past the last query unread
    values = rng.standard_normal((kv, past + T + 3, hd)).astype(np.float32)
    gates = (rng.standard_normal((T, heads * 2 * hd + 2 * kv * hd)) * 3).astype(np.float32)
    got, split = np.empty((T, heads * hd), np.float32), np.empty((T, heads * hd), np.float32)
    compiled.attend_rows(q, keys, values, past, gates, got, 0, kv)
    compiled.split_kernel(compiled.attend_rows, (q, keys, values, past, gates, split), kv)
    np.testing.assert_array_equal(split, got)
    for t in range(T):
        alone = np.empty((1, heads * hd), np.float32)
        compiled.attend_rows(q[t : t + 1], keys, values, past + t, gates[t : t + 1], alone, 0, kv)
        np.testing.assert_array_equal(alone[0], got[t])
    scale = hd**-0.5
    for t in range(T):
        n = past + t + 1
        for h in range(heads):
            k64, v64, q64 = keys[h // 2, :n].astype(np.float64), values[h // 2, :n].astype(np.float64), q[t, h].astype(np.float64)
            scores = k64 @ q64 * scale
            weights = np.exp(scores - scores.max())
            weights /= weights.sum()
            gate = 1 / (1 + np.exp(-gates[t, h * 2 * hd + hd : (h + 1) * 2 * hd].astype(np.float64)))
            want = (weights @ v64) * gate
            score_error = hd * U * (np.abs(k64) @ np.abs(q64)).max() * scale
            bound = (2 * score_error + (n + 15) * U) * np.abs(v64).max()
            np.testing.assert_array_less(np.abs(got[t, h * hd : (h + 1) * hd] - want), bound)
