"""engine/cache.py against independent references of what each cache must hold.

- KV caches: a plain Python list of rows re-states the contents after append / truncate / keep /
  rewind; a query reading rows(end) must see exactly the first `end` rows of that list.
- The 4-bit cache (REFERENCE.md section 6; cache.py's docstring): rows rotated by
  diag(signs) @ H / sqrt(head_dim), H the Walsh-Hadamard matrix built here from its definition
  H[i, j] = (-1)^popcount(i & j), not from Sylvester's recursion as cache.hadamard does; 4-bit
  symmetric levels -7..7 with an fp16 scale absmax / 7 per 32 rotated values; the first SINK_ROWS
  rows and the RECENT_ROWS rows before a query exact. The test rows are built in the rotated domain
  on a dyadic grid (level + u) * 2^e with |u| <= 3/8 and one level +-7 per group, so every step
  (rotation, scale, division, rounding, rotation back) is exact in float32 in any summation order:
  the expected rows, codes and scales are exact, and every comparison is equality (no tolerance).
- DeltaNet / conv state and SequenceState: after keep(rows) / rewind(length) the state must equal
  that of a run which only ever saw the kept rows (the no-draft run), fed through the same CPU
  kernels but never rolled back; the conv history is also checked against the list of inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from duet.engine.backend import MAX_ROWS
from duet.engine.backend.cpu_ops import causal_conv, delta_rule_rows
from duet.engine.cache import (Q4_GROUP, RECENT_ROWS, SINK_ROWS, DeltaNetState, IndexedKVCache, KVCache, PLEState,
                               Q4KVCache, SequenceState, dequantize_q4, hadamard, quantize_q4)


def test_the_definitions_constants():
    """Restated (REFERENCE.md section 6, cache.py's docstring) so that a change of them in cache.py is a
    failure here, not an expectation the references below silently follow."""
    assert (SINK_ROWS, RECENT_ROWS, Q4_GROUP, MAX_ROWS) == (4, 128, 32, 16)


# ---- references

class ListCache:
    """What a KV cache must hold: the list of (key row, value row) appended and not cut off."""

    def __init__(self, kv: int, hd: int):
        self.kv, self.hd = kv, hd
        self.rows: list[tuple[np.ndarray, np.ndarray]] = []

    def append(self, keys: np.ndarray, values: np.ndarray) -> None:  # [kv, T, hd]
        self.rows += [(keys[:, t].copy(), values[:, t].copy()) for t in range(keys.shape[1])]

    def truncate(self, length: int) -> None:
        del self.rows[length:]

    def first(self, end: int) -> tuple[np.ndarray, np.ndarray]:
        return stack_rows(self.rows[:end], self.kv, self.hd)


def stack_rows(rows: list, kv: int, hd: int) -> tuple[np.ndarray, np.ndarray]:
    """[(key [kv, hd], value [kv, hd])] -> keys, values [kv, len(rows), hd]."""
    return tuple(np.stack([row[side] for row in rows], axis=1) if rows else np.zeros((kv, 0, hd), np.float32)
                 for side in (0, 1))


def walsh_hadamard(n: int) -> np.ndarray:
    """H[i, j] = (-1)^popcount(i & j): the Walsh-Hadamard matrix from its definition."""
    return np.array([[(-1.0) ** bin(i & j).count("1") for j in range(n)] for i in range(n)])


def assert_same_rows(cache, reference: ListCache, ends) -> None:
    """rows(end) is the reference's, and rows_at (a sparse query's read) its rows at any indices."""
    assert cache.length == len(reference.rows)
    rng = np.random.default_rng(len(reference.rows))
    for end in ends:
        indices = np.sort(rng.choice(end, min(end, 40), replace=False)) if end else np.zeros(0, np.int64)
        for got, at, want in zip(cache.rows(end), cache.rows_at(indices, end), reference.first(end)):
            assert got.dtype == np.float32 and got.shape == want.shape
            assert np.array_equal(got, want), end
            assert at.dtype == np.float32 and np.array_equal(at, want[:, indices]), end


def random_rows(rng, kv: int, T: int, hd: int) -> tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal((kv, T, hd)).astype(np.float32), rng.standard_normal((kv, T, hd)).astype(np.float32))


# ---- Hadamard

@pytest.mark.parametrize("n", [1, 2, 4, 8, 32, 64])
def test_hadamard_is_the_walsh_hadamard_matrix_of_its_definition(n):
    h = hadamard(n)
    assert h.shape == (n, n) and np.array_equal(h, walsh_hadamard(n))
    assert np.array_equal(h @ h.T, n * np.eye(n))  # the defining property, independent of both constructions


# ---- full KV cache

def test_kv_cache_holds_exactly_the_rows_appended_and_not_truncated():
    rng = np.random.default_rng(0)
    cache, reference = KVCache(3, 8, capacity=4), ListCache(3, 8)
    # Appends that fit, fill the capacity exactly, grow it from full and from part full, and a
    # block larger than twice the capacity; truncates then appends overwriting the cut rows.
    for op, n in [("a", 3), ("a", 1), ("a", 1), ("a", 6), ("t", 9), ("a", 2), ("a", 40), ("t", 100), ("t", 20),
                  ("a", 16), ("t", 30), ("a", 1), ("t", 0), ("a", 5)]:
        if op == "a":
            keys, values = random_rows(rng, 3, n, 8)
            cache.append(keys, values)
            reference.append(keys, values)
        else:
            cache.truncate(n)
            reference.truncate(n)
        assert_same_rows(cache, reference, range(len(reference.rows) + 1))


def test_kv_cache_capacity_doubles_and_fits_a_large_block():
    """The docstring's growth rule: by doubling, or to the block's size when that is larger; never
    while the rows fit (a cache is sized for 262,144 tokens, REFERENCE.md section 6)."""
    cache = KVCache(1, 2)
    assert cache.keys.shape == cache.values.shape == (1, 256, 2)
    cache.append(np.ones((1, 256, 2), np.float32), np.ones((1, 256, 2), np.float32))
    assert cache.keys.shape[1] == 256
    cache.append(np.ones((1, 1, 2), np.float32), np.ones((1, 1, 2), np.float32))
    assert cache.keys.shape[1] == cache.values.shape[1] == 512
    cache.append(np.ones((1, 2000, 2), np.float32), np.ones((1, 2000, 2), np.float32))
    assert cache.keys.shape[1] == cache.values.shape[1] == 2257


# ---- 4-bit codes

def test_q4_codes_layout_and_levels_from_the_definition():
    """quantize_q4 / dequantize_q4 on values chosen as (level + u) * scale, no value near a rounding
    tie: every code and scale is known exactly from the docstring's layout."""
    rng = np.random.default_rng(1)
    levels = rng.integers(-6, 7, (5, 3, 64))
    levels[..., 7], levels[..., 40] = 7, -7  # absmax of group 0 and group 1: the scale is 2^e exactly
    exponents = rng.integers(-4, 4, (5, 3, 2))
    u = rng.choice([-0.375, -0.25, -0.125, 0.0, 0.125, 0.25, 0.375], (5, 3, 64))
    u[..., [7, 40]] = 0
    x = ((levels + u) * np.repeat(2.0 ** exponents, 32, axis=-1)).astype(np.float32)
    x[1, 2, 32:] = 0  # a group of zeros: scale 0, codes 8
    codes, scales = quantize_q4(x)
    want_levels = levels.copy()
    want_levels[1, 2, 32:] = 0
    assert codes.dtype == np.uint8 and codes.shape == (5, 3, 32)
    assert scales.dtype == np.float16 and scales.shape == (5, 3, 2)
    want_scales = 2.0 ** exponents
    want_scales[1, 2, 1] = 0
    assert np.array_equal(scales.astype(np.float64), want_scales)
    for index in np.ndindex(5, 3):
        for i in range(32):  # value 2i in the low nibble, 2i + 1 in the high one, each + 8
            assert codes[index][i] == (want_levels[index][2 * i] + 8) + 16 * (want_levels[index][2 * i + 1] + 8)
    assert np.array_equal(dequantize_q4(codes, scales), (want_levels * np.repeat(want_scales, 32, axis=-1)).astype(np.float32))


def test_q4_zero_groups_code_as_zero_without_nan_arithmetic():
    """An all-zero group has scale 0: its levels are 0 (codes 8) and the codec must not divide 0 by 0
    on the way (numpy's cast of NaN to int8 is undefined: x86 gives 0, other machines need not)."""
    x = np.zeros((3, 64), np.float32)
    x[1, 40:] = np.linspace(-1, 1, 24)
    with np.errstate(divide="raise", invalid="raise", over="raise"):
        codes, scales = quantize_q4(x)
        back = dequantize_q4(codes, scales)
    assert np.all(codes[0] == 0x88) and np.all(codes[1, :16] == 0x88) and not scales[0].any() and scales[1, 0] == 0
    assert not back[0].any() and not back[1, :32].any() and np.abs(back[1, 40:] - x[1, 40:]).max() <= scales[1, 1] / 2


def test_q4_levels_stay_within_plus_minus_7_when_the_fp16_scale_rounds_down():
    """Tiny groups: absmax / 7 = 1.4 * 2^-24 is an fp16 subnormal that rounds to 2^-24, below absmax / 7,
    so absmax / scale = 9.8. The definition's levels are clipped to -7..7 (a level past 7 would spill
    into the next value's nibble). The scale is a power of two, so x / scale is exact: no tolerance."""
    rng = np.random.default_rng(6)
    top = np.float32(7 * 1.4 * 2.0**-24)
    x = (rng.uniform(-1, 1, (4, 64)) * top).astype(np.float32)
    x[:, 3], x[:, 40] = top, -top  # absmax positive in group 0, negative in group 1
    codes, scales = quantize_q4(x)
    assert np.all(scales.astype(np.float64) == 2.0**-24)
    want = np.clip(np.round(x.astype(np.float64) * 2.0**24), -7, 7)  # np.round: half to even, as rint
    assert np.array_equal(dequantize_q4(codes, scales).astype(np.float64) * 2.0**24, want)
    assert np.abs(want).max() == 7 and np.array_equal((codes & 0xF) - 8.0, want[:, 0::2])


# ---- the 4-bit cache

def grid_rows(rng, kv: int, T: int, signs: np.ndarray, zero_group_every: int = 0):
    """Exact rows [kv, T, hd, 2] (key, value) and the rows the 4-bit code must give back, built in the
    rotated domain: per group of 32, levels in -6..6 plus one +-7 (the absmax), times 2^e, plus u * 2^e
    (|u| <= 3/8, never at the absmax) on the exact rows. Rotated back with R.T = H diag(signs) / sqrt(hd):
    all values are dyadic with under 24 significant bits, so float32 holds them and the cache's float32
    products and sums are exact. Also the levels and exponents, for the codes and scales."""
    hd = signs.shape[0]
    groups = hd // 32
    levels = rng.integers(-6, 7, (kv, T, 2, hd))
    at = rng.integers(0, 32, (kv, T, 2, groups)) + 32 * np.arange(groups)
    np.put_along_axis(levels, at, rng.choice([-7, 7], at.shape), axis=-1)
    exponents = rng.integers(-3, 3, (kv, T, 2, groups))
    u = rng.choice([-3, -2, -1, 0, 1, 2, 3], (kv, T, 2, hd)) / 8
    np.put_along_axis(u, at, 0, axis=-1)
    if zero_group_every:
        levels[:, ::zero_group_every, :, :32] = 0
        u[:, ::zero_group_every, :, :32] = 0
    scale = np.repeat(2.0 ** exponents, 32, axis=-1)
    back = walsh_hadamard(hd) * signs[None, :] / np.sqrt(hd)  # R.T: y @ R.T undoes x @ R

    def unrotate(r):
        y = r @ back
        assert np.array_equal(y.astype(np.float32), y)
        return y.astype(np.float32).transpose(0, 1, 3, 2)  # [kv, T, hd, 2]

    exact, coded = unrotate((levels + u) * scale), unrotate(levels * scale)
    scales = 2.0 ** exponents
    if zero_group_every:
        scales[:, ::zero_group_every, :, 0] = 0
    return exact, coded, levels, scales


class Q4ListCache(ListCache):
    """The 4-bit cache's definition over the list of rows: rows(end) gives row i exact when
    i < SINK_ROWS or i >= end - RECENT_ROWS, else its 4-bit image."""

    def __init__(self, kv: int, hd: int):
        super().__init__(kv, hd)
        self.coded: list[tuple[np.ndarray, np.ndarray]] = []

    def append_rows(self, exact: np.ndarray, coded: np.ndarray) -> None:
        self.append(exact[..., 0], exact[..., 1])
        self.coded += [(coded[:, t, :, 0].copy(), coded[:, t, :, 1].copy()) for t in range(coded.shape[1])]

    def truncate(self, length: int) -> None:
        super().truncate(length)
        del self.coded[length:]

    def first(self, end: int) -> tuple[np.ndarray, np.ndarray]:
        rows = [self.rows[i] if i < SINK_ROWS or i >= end - RECENT_ROWS else self.coded[i] for i in range(end)]
        return stack_rows(rows, self.kv, self.hd)


def q4_ends(past: int, length: int):
    """The ends a query may read after a call appended rows [past, length) (past == length: after a
    rollback). A call's row t reads rows(t + 1), so a verify pass of up to MAX_ROWS rows reads
    past + 1 .. length; a prefill reads rows(past) before its own rows. Past a rollback (at most MAX_ROWS
    rows, generate.py's keep) the exact ring (RECENT_ROWS + MAX_ROWS rows) no longer holds what the
    rolled-back rows overwrote, and no caller reads there: ends before max(past, length - MAX_ROWS) are
    not a query's."""
    return range(max(past, length - MAX_ROWS), length + 1)


def test_q4_cache_rows_are_the_definition_exactly():
    rng = np.random.default_rng(2)
    cache, reference = Q4KVCache(3, 64), Q4ListCache(3, 64)
    signs = cache.signs
    assert signs.shape == (64,) and set(np.unique(signs)) == {-1.0, 1.0}
    total = 0
    # Short calls (decode, verify), a prefill longer than the exact ring (RECENT_ROWS + MAX_ROWS),
    # rollbacks of a verify pass, and every end a query can read after each.
    for op, n in [("a", 1), ("a", 2), ("a", 3), ("a", 9), ("t", 12), ("a", 16), ("t", 20), ("a", 150), ("a", 5),
                  ("t", 170), ("a", 16), ("a", 300), ("a", 7), ("t", 480), ("a", 16), ("t", 489), ("a", 1)]:
        past = len(reference.rows)
        if op == "a":
            exact, coded, _, _ = grid_rows(rng, 3, n, signs, zero_group_every=5)
            cache.append(exact[..., 0], exact[..., 1])
            reference.append_rows(exact, coded)
        else:
            cache.truncate(n)
            reference.truncate(n)
        total = len(reference.rows)
        assert_same_rows(cache, reference, q4_ends(min(past, total), total))
    assert total == 490


def test_q4_cache_stores_codes_and_scales_in_the_documented_layout():
    """codes uint8 [kv, rows, hd / 2, 2 (key, value)], value 2i in the low nibble and 2i + 1 in the high one,
    each + 8; scales fp16 [kv, rows, hd / 32, 2]: the layout engine/placement.py sizes (0.5 + 2/32 bytes a value)."""
    rng = np.random.default_rng(3)
    cache = Q4KVCache(2, 64, seed=5)
    exact, _, levels, scales = grid_rows(rng, 2, 40, cache.signs, zero_group_every=3)
    cache.append(exact[:, :30, :, 0], exact[:, :30, :, 1])
    cache.append(exact[:, 30:, :, 0], exact[:, 30:, :, 1])
    assert cache.codes.dtype == np.uint8 and cache.scales.dtype == np.float16
    codes = cache.codes[:, :40]
    assert codes.shape == (2, 40, 32, 2) and cache.scales[:, :40].shape == (2, 40, 2, 2)
    levels = levels.transpose(0, 1, 3, 2)  # [kv, T, hd, side]
    assert np.array_equal(codes, (levels[:, :, 0::2] + 8) + 16 * (levels[:, :, 1::2] + 8))
    assert np.array_equal(cache.scales[:, :40].astype(np.float64), scales.transpose(0, 1, 3, 2))


def test_q4_cache_capacity_doubles_and_never_grows_while_rows_fit():
    """One-row appends: capacity is the smallest power of two holding the rows (doubling, as the
    docstring says); a block larger than twice the capacity gets exactly its size."""
    cache = Q4KVCache(1, 32)
    row = np.ones((1, 1, 32), np.float32)
    for n in range(1, 70):
        cache.append(row, row)
        assert cache.codes.shape[1] == cache.scales.shape[1] == 1 << (n - 1).bit_length(), n
    cache.append(np.ones((1, 300, 32), np.float32), np.ones((1, 300, 32), np.float32))
    assert cache.codes.shape[1] == cache.scales.shape[1] == 369


@pytest.mark.parametrize("head_dim", [16, 48, 96, 33])
def test_q4_cache_refuses_a_head_dim_the_code_cannot_hold(head_dim):
    with pytest.raises(ValueError, match="power-of-two head_dim divisible by 32"):
        Q4KVCache(1, head_dim)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_q4_cache_takes_power_of_two_head_dims_divisible_by_32(head_dim):
    """64 and 256 (the 27B geometry's, REFERENCE.md section 1): sqrt(head_dim) is a power of two, so the grid is exact."""
    rng = np.random.default_rng(head_dim)
    cache, reference = Q4KVCache(2, head_dim), Q4ListCache(2, head_dim)
    exact, coded, _, _ = grid_rows(rng, 2, 140, cache.signs)
    cache.append(exact[..., 0], exact[..., 1])
    reference.append_rows(exact, coded)
    assert_same_rows(cache, reference, q4_ends(0, 140))


def test_q4_cache_head_dim_32_keeps_sink_and_recent_rows_exact():
    """sqrt(32) is irrational, so no exact grid: the exact rows, and the rest within the 4-bit step."""
    rng = np.random.default_rng(32)
    cache = Q4KVCache(2, 32)
    keys, values = random_rows(rng, 2, 140, 32)
    cache.append(keys, values)
    got = cache.rows(140)
    exact = list(range(SINK_ROWS)) + list(range(140 - RECENT_ROWS, 140))
    coded = list(range(SINK_ROWS, 140 - RECENT_ROWS))
    for rows, want in zip(got, (keys, values)):
        assert rows.shape == (2, 140, 32) and np.array_equal(rows[:, exact], want[:, exact])
        # A rotated value is off by at most half a step, absmax / 14 of its row's rotated values
        # (one group: head_dim 32); the orthonormal rotation keeps the error's norm. 1e-3: the fp16
        # scale may round up from absmax / 7 by 2^-11 (4.9e-4), float32 rotations add ~1e-6.
        rotated_absmax = np.abs((want[:, coded] * cache.signs) @ walsh_hadamard(32) / np.sqrt(32)).max(-1)
        error = np.linalg.norm(rows[:, coded] - want[:, coded], axis=-1)
        assert np.all(error > 0) and np.all(error <= np.sqrt(32) * rotated_absmax / 14 * (1 + 1e-3))


def test_q4_signs_are_a_function_of_the_seed():
    """The device cache draws its signs from the same seed (cupy_backend.Q4KVCache): equal seeds must
    give equal signs and rows, and the seed must matter."""
    a, b, c = Q4KVCache(1, 64), Q4KVCache(1, 64, seed=0), Q4KVCache(1, 64, seed=1)
    assert np.array_equal(a.signs, b.signs) and not np.array_equal(a.signs, c.signs)
    assert a.signs.dtype == np.float32
    rows = np.random.default_rng(4).standard_normal((1, 200, 64)).astype(np.float32)
    for cache in (a, b, c):
        cache.append(rows, rows)
    assert np.array_equal(a.rows(200)[0], b.rows(200)[0]) and not np.array_equal(a.rows(200)[0], c.rows(200)[0])


# ---- DeltaNet / conv state and SequenceState against the no-draft run

C, K, HV, DK, DV = 6, 4, 2, 4, 3  # channels, conv kernel, value heads, key / value head dims


def deltanet_inputs(rng, T: int):
    return dict(mixed=rng.standard_normal((T, C)).astype(np.float32),
                q=rng.standard_normal((T, HV, DK)).astype(np.float32),
                k=rng.standard_normal((T, HV, DK)).astype(np.float32) / 2,
                v=rng.standard_normal((T, HV, DV)).astype(np.float32),
                beta=rng.uniform(0.1, 0.9, (T, HV)).astype(np.float32),
                log_decay=-rng.uniform(0.01, 1.0, (T, HV)).astype(np.float32))


TAPS = np.random.default_rng(99).standard_normal((C, K)).astype(np.float32)


def run_deltanet(state: DeltaNetState, inputs: dict, rows=slice(None)) -> tuple[np.ndarray, np.ndarray]:
    """One call of the CPU kernels over inputs[rows] (a short call: T <= MAX_ROWS): conv and delta-rule outputs."""
    part = {name: value[rows] for name, value in inputs.items()}
    conv = causal_conv(part["mixed"], TAPS, state)
    return conv, delta_rule_rows(part["q"], part["k"], part["v"], part["beta"], part["log_decay"], state)


def test_deltanet_keep_equals_the_run_that_only_saw_the_kept_rows():
    rng = np.random.default_rng(5)
    prompt, verify, after = deltanet_inputs(rng, 7), deltanet_inputs(rng, MAX_ROWS), deltanet_inputs(rng, 3)
    for rows in [1, 2, 5, MAX_ROWS - 1, MAX_ROWS]:
        rolled, reference = DeltaNetState(C, K, HV, DK, DV), DeltaNetState(C, K, HV, DK, DV)
        run_deltanet(rolled, prompt)
        run_deltanet(rolled, verify)
        rolled.keep(rows)
        run_deltanet(reference, prompt)
        for t in range(rows):  # decode steps, one row each
            run_deltanet(reference, verify, slice(t, t + 1))
        history = np.concatenate([prompt["mixed"], verify["mixed"][:rows]])
        assert np.array_equal(rolled.conv, history[-(K - 1):]) and np.array_equal(reference.conv, history[-(K - 1):])
        assert rolled.conv.shape == (K - 1, C)
        assert np.array_equal(rolled.recurrent, reference.recurrent), rows
        # and the next call continues identically
        for got, want in zip(run_deltanet(rolled, after), run_deltanet(reference, after)):
            assert np.array_equal(got, want)
        assert np.array_equal(rolled.recurrent, reference.recurrent)


def test_a_decode_step_holds_one_recurrent_state_and_a_verify_pass_the_one_before_it_too():
    """What a rollback needs is kept only where one can happen: a one-row call keeps no prior state
    (the 27B geometry's 48 layers would hold 144 MB more), a longer call the state it started from."""
    state, inputs = DeltaNetState(C, K, HV, DK, DV), deltanet_inputs(np.random.default_rng(6), 3)
    run_deltanet(state, inputs, slice(0, 1))
    assert state.prior is None
    before = state.recurrent
    run_deltanet(state, inputs, slice(1, 3))
    assert state.prior is before


def test_deltanet_state_starts_empty():
    state = DeltaNetState(C, K, HV, DK, DV)
    assert state.conv.shape == (K - 1, C) and not state.conv.any() and state.conv.dtype == np.float32
    assert state.recurrent.shape == (HV, DK, DV) and not state.recurrent.any() and state.recurrent.dtype == np.float32
    assert state.window is None and state.prior is None and state.row_inputs == ()


def token_rows(token: int, position: int, kv: int, hd: int) -> np.ndarray:
    """What an attention layer stores for a token at a position: [kv, hd, 2], any fixed function will do."""
    return np.random.default_rng([token, position, hd]).standard_normal((kv, hd, 2)).astype(np.float32)


def token_deltanet_inputs(tokens: list[int], start: int) -> dict:
    parts = [deltanet_inputs(np.random.default_rng([token, start + i, 7]), 1) for i, token in enumerate(tokens)]
    return {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}


def new_sequence() -> SequenceState:
    return SequenceState([KVCache(2, 8, capacity=4), DeltaNetState(C, K, HV, DK, DV), Q4KVCache(1, 64),
                          DeltaNetState(C, K, HV, DK, DV)])


def run_call(state: SequenceState, tokens: list[int]) -> None:
    """One call of a toy model at the state's position: every layer gets its rows, then advance."""
    for layer in state.layers:
        if isinstance(layer, DeltaNetState):
            run_deltanet(layer, token_deltanet_inputs(tokens, state.length))
        else:
            kv, hd = (layer.sink.shape[0], layer.sink.shape[2]) if isinstance(layer, Q4KVCache) else layer.keys.shape[::2]
            rows = np.stack([token_rows(t, state.length + i, kv, hd) for i, t in enumerate(tokens)], axis=1)
            layer.append(rows[..., 0], rows[..., 1])
    state.advance(len(tokens))


def assert_same_state(got: SequenceState, want: SequenceState, past: int) -> None:
    assert got.length == want.length
    for a, b in zip(got.layers, want.layers, strict=True):
        if isinstance(a, DeltaNetState):
            assert np.array_equal(a.conv, b.conv) and np.array_equal(a.recurrent, b.recurrent)
        else:
            assert a.length == b.length == got.length
            for end in q4_ends(past, got.length):
                for x, y in zip(a.rows(end), b.rows(end)):
                    assert np.array_equal(x, y)


def test_sequence_keep_equals_the_no_draft_run():
    """Calls of 1 + k rows, each cut back by keep(accepted + 1), against a run of only the kept tokens,
    one token a call; the first call is itself rolled back (a short prompt's call). Then a prompt past
    the 4-bit cache's exact ring, and more rollbacks there."""
    calls = [([5, 6, 7, 8, 9], 3), ([11, 12, 13, 14], 4), ([21] + list(range(30, 45)), 1), ([3, 4], 2),
             (list(range(50, 66)), 16), ([70, 71, 72], 2), (150, None), (list(range(80, 96)), 2), ([1, 2, 3], 1),
             (list(range(100, 116)), 5)]
    rolled, reference, kept = new_sequence(), new_sequence(), []
    for tokens, rows in calls:
        if rows is None:  # a long prompt: not rolled back, so both states run it
            tokens = list(np.random.default_rng(8).integers(0, 300, tokens))
            run_call(rolled, tokens)
            run_call(reference, tokens)
            kept += tokens
            continue
        run_call(rolled, tokens)
        assert rolled.length == len(kept) + len(tokens)
        rolled.keep(rows)
        kept += tokens[:rows]
        for token in tokens[:rows]:
            run_call(reference, [token])
        assert rolled.length == len(kept)
        assert_same_state(rolled, reference, past=rolled.length)
    run_call(rolled, [1, 2, 3])
    run_call(reference, [1, 2, 3])
    assert_same_state(rolled, reference, past=rolled.length - 3)
    assert rolled.length == len(kept) + 3 > SINK_ROWS + RECENT_ROWS + MAX_ROWS


def test_sequence_rewind_equals_the_run_that_stopped_there():
    """The MTP head's state (attention only): drafting appends rows, rewind cuts them off again."""
    def mtp_state():
        return SequenceState([KVCache(1, 8, capacity=2), Q4KVCache(1, 64)])

    rewound, reference = mtp_state(), mtp_state()
    run_call(rewound, list(range(10)))
    run_call(reference, list(range(10)))
    for draft in ([40], [41], [42, 43]):
        run_call(rewound, draft)
    rewound.rewind(10)
    assert_same_state(rewound, reference, past=10)
    run_call(rewound, [7, 8])
    run_call(reference, [7, 8])
    assert_same_state(rewound, reference, past=10)
    rewound.rewind(3)
    short = mtp_state()
    run_call(short, [0, 1, 2])
    assert_same_state(rewound, short, past=3)


def test_rewind_refuses_a_state_with_deltanet_layers():
    state = new_sequence()
    run_call(state, [1, 2])
    with pytest.raises(AssertionError):
        state.rewind(1)


def test_sequence_state_starts_at_zero():
    state = SequenceState([])
    assert state.length == 0 and state.length_before_last_call == 0 and state.layers == []


# ---- Flash-Next: QSA's indexed cache and PLE's history

def test_indexed_cache_holds_every_raw_key_and_pools_each_block_once_past_its_first_capacity():
    """IndexedKVCache against a list of the raw keys appended: raw is that list (fp32, as the indexer
    computes), blocks are pool() of each complete block of `ratio` keys, each pooled once, when it
    completes, and again after a truncation cut it open. 700 keys in uneven calls: the buffers grow
    past their first 256 rows twice."""
    ratio, d = 4, 6
    cache = IndexedKVCache(KVCache(1, 2), d, ratio)
    keys = np.random.default_rng(3).standard_normal((760, d)).astype(np.float32)
    pooled = []  # (first block, blocks) of every pool call

    def pool(first, blocks):  # any function of the block and its index will do
        pooled.append((first, blocks.shape[0]))
        return blocks.mean(axis=1) + np.arange(first, first + blocks.shape[0], dtype=np.float32)[:, None]

    def append(rows):
        cache.kv.append(np.zeros((1, len(rows), 2), np.float32), np.zeros((1, len(rows), 2), np.float32))
        cache.append_index_keys(rows, pool)

    def expected_blocks(held: np.ndarray) -> np.ndarray:
        complete = len(held) // ratio
        return held[: complete * ratio].reshape(complete, ratio, d).mean(axis=1) + np.arange(complete, dtype=np.float32)[:, None]

    held = np.zeros((0, d), np.float32)
    for size in (1, 255, 1, 3, 100, 40, 300):
        rows, keys = keys[:size], keys[size:]
        append(rows)
        held = np.concatenate([held, rows])
        assert cache.length == len(held) and cache.raw.dtype == cache.blocks.dtype == np.float32
        assert np.array_equal(cache.raw, held) and np.array_equal(cache.blocks, expected_blocks(held))
    assert [first for first, _ in pooled] == [0, 64, 65, 90, 100] and sum(n for _, n in pooled) == 700 // ratio
    cache.truncate(650)  # cuts block 162 open: it is pooled again from the rows that replace its tail
    held = held[:650]
    assert np.array_equal(cache.raw, held) and np.array_equal(cache.blocks, expected_blocks(held))
    append(keys[:60])
    held = np.concatenate([held, keys[:60]])
    assert np.array_equal(cache.raw, held) and np.array_equal(cache.blocks, expected_blocks(held))
    assert pooled[-1] == (162, 15)


def test_ple_state_keeps_the_ids_and_conv_inputs_of_the_rows_it_keeps():
    """PLEState: EOS history before the first token, fp32 conv inputs; keep(n) makes the windows
    after the first n rows of the last call current."""
    state = PLEState(context=2, eos=7, conv_rows=6, channels=3)
    assert state.tokens.tolist() == [7, 7] and state.tokens.dtype == np.int64
    assert state.conv.shape == (6, 3) and state.conv.dtype == np.float32 and not state.conv.any()
    ids, inputs = np.array([11, 12, 13, 14]), np.arange(12, dtype=np.float32).reshape(4, 3) + 1
    state.token_window = np.concatenate([state.tokens, ids])
    state.conv_window = np.concatenate([state.conv, inputs])
    for rows in (4, 1):
        kept = PLEState(2, 7, 6, 3)
        kept.token_window, kept.conv_window = state.token_window, state.conv_window
        kept.keep(rows)
        history = [7, 7, *ids[:rows].tolist()]
        assert kept.tokens.tolist() == history[-2:]
        assert np.array_equal(kept.conv, np.concatenate([np.zeros((6, 3), np.float32), inputs[:rows]])[-6:])
