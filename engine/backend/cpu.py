"""numpy linear layers. Every route's Linear takes x [T, K] and returns x @ W^T [T, N] in fp32.

Routes (DESIGN.md contracts): `bf16` DenseLinear, `w4a16` W4A16Linear, `w4a8` W4A8Linear.
"""

from __future__ import annotations

import sys

import numpy as np

from duet.engine.backend import MAX_ROWS
from duet.engine.backend.threads import in_parallel
from duet.engine.quant.activation import ACT_BLOCK, quantize_int8_blocks, round_to_bf16
from duet.engine.quant.gguf_blocks import BlockMatrix
from duet.engine.quant.trellis import TrellisWeight, rotated_int8_activations
from duet.engine.quant.w4 import GROUP, W4Weight
from duet.engine.weights import BF16Matrix, InputOrder


# From this many tokens, a token-major prefill product splits its tokens between the cores rather
# than its weight rows: each core's run of tokens is then long enough for x @ W^T to run as fast
# as W @ x^T, and no block is copied back to token-major, a copy that grows with T (two cores,
# 8224 x 1024 at 2048 tokens: 176 GFLOPS by weight rows and copy, 259 by tokens). Whole 0.8B
# prefills, in-process A/B: 2048 tokens 103.3 -> 120.1 tok/s, 1024 tokens 1.01x-1.06x; at 256 and
# 512 no gain beyond noise, and at 128 the weight-row split is ahead (142 against 112 GFLOPS).
# The token runs give one product's values to summation order: OpenBLAS picks its kernel by shape,
# so the last bits may differ (they did on an AMD EPYC with AVX-512; on an Intel Xeon 75 of 75 cuts
# were bit-identical). Decode and verify rows never take this path: each row is its own product.
TOKEN_SPLIT_MIN = 1024


class Linear:
    """What every route's Linear offers: __call__, x [T, K] -> x @ W^T [T, N], and the same product
    feature-major."""

    @property
    def nbytes(self) -> int:
        """Bytes of weight this Linear holds in memory."""
        return self.weight.nbytes

    def by_feature(self, x: np.ndarray) -> np.ndarray:
        """(x @ W^T)^T as a C-contiguous [N, T] array, for callers that keep prefill activations
        feature-major. Here a transposing copy; DenseLinear forms it without one."""
        return np.ascontiguousarray(self(x).T)


class DenseLinear(Linear):
    """Unquantized weight [N, K] held in fp32 (the `bf16` route: bf16/fp16 checkpoints widened once)."""

    route = "bf16"

    def __init__(self, weight: np.ndarray):
        self.weight = np.ascontiguousarray(weight, dtype=np.float32)

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.shape[0] <= MAX_ROWS:
            # BLAS reads W^T through the transposed view; no copy of the weight is made. Rows are
            # made contiguous first, so a row's result does not depend on the layout it came in.
            return np.stack([row @ self.weight.T for row in np.ascontiguousarray(x)])
        if x.shape[0] >= TOKEN_SPLIT_MIN:
            return self._by_tokens(x)
        return self._product(x, token_major=True)

    def _by_tokens(self, x: np.ndarray) -> np.ndarray:
        """x @ W^T with each core taking a run of tokens, straight into the token-major result."""
        out = np.empty((x.shape[0], self.weight.shape[0]), np.float32)
        in_parallel(lambda lo, hi: np.matmul(x[lo:hi], self.weight.T, out=out[lo:hi]), x.shape[0])
        return out

    def by_feature(self, x: np.ndarray) -> np.ndarray:
        return super().by_feature(x) if x.shape[0] <= MAX_ROWS else self._product(x, token_major=False)

    def _product(self, x: np.ndarray, token_major: bool) -> np.ndarray:
        # Each core computes W @ x^T (the faster operand order in OpenBLAS: 19.3 against 21.6 ms for
        # the DeltaNet in_proj 8224 x 1024 at 128 rows, one thread) for its part of the weight rows:
        # that is the feature-major [N, T] result, which __call__ copies back to token-major block by
        # block. On two cores the whole 128-token prefill of the 0.8B geometry took 1.20x as long with
        # OpenBLAS's own two threads on x @ W^T, whose workers then spin on the cores the numpy parts
        # need (median of 10, alternating in one process). An x that is itself a transposed
        # feature-major array makes x^T a plain operand.
        N, T = self.weight.shape[0], x.shape[0]
        by_weight_row = np.empty((N, T), np.float32)
        out = np.empty((T, N), np.float32) if token_major else by_weight_row

        def weight_rows(lo: int, hi: int) -> None:
            np.matmul(self.weight[lo:hi], x.T, out=by_weight_row[lo:hi])
            if token_major:
                copy_transposed(out[:, lo:hi], by_weight_row[lo:hi])

        in_parallel(weight_rows, N)
        return out


class BF16Linear(DenseLinear):
    """`bf16` route on a bf16 checkpoint's matrix (BF16Matrix): the numpy reference widens it once."""

    def __init__(self, weight: BF16Matrix):
        super().__init__(weight.dequantize())


TRANSPOSE_BLOCK = 8192  # floats per block of a transposing copy: 32 KB, an L1's worth


def copy_transposed(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src.T for src [n, T], by blocks of src rows: numpy's one-step copy of a transposed
    view walks dst with a stride of its row length (6.5 ms for [8224, 128] at once, 0.9 ms by blocks)."""
    n, T = src.shape
    step = max(1, TRANSPOSE_BLOCK // T)
    for i in range(0, n, step):
        dst[:, i : i + step] = src[i : i + step].T


# --------------------------------------------------------------------------------------------
# Quantized routes. Both decode a chunk of weight rows at a time from the stored packed form
# (never a full fp32 copy), then form one fp32 dot product per weight block and scale it.
# A chunk is decoded once per call and serves every row of x.

CHUNK_WEIGHTS = 1 << 20  # weights decoded at a time (4 MB of fp32 levels)


class W4A16Linear(Linear):
    """`w4a16`: W4 weights (bf16 scale per 128) against bf16-rounded activations.

    y[n] = sum over groups g of scale[n, g] * (sum over the group's 128 k of level[n, k] * bf16(x[k])),
    the inner sum in fp32. level * bf16(x) is exact in fp32 (4 + 8 significant bits), so only the
    fp32 summation rounds, as on the GPU.
    """

    route = "w4a16"

    def __init__(self, weight: W4Weight):
        self.weight = weight

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return _by_chunks(self.weight, _w4a16_rows, round_to_bf16(x))


def _w4a16_rows(levels: np.ndarray, scale: np.ndarray, minimum: None, x: np.ndarray) -> np.ndarray:
    """levels [r, G, 128], scale [r, G], x [T, K] -> [T, r]."""
    G = levels.shape[1]
    sums = np.matmul(levels.transpose(1, 0, 2), x.reshape(-1, G, GROUP).transpose(1, 2, 0))  # [G, r, T]
    return np.einsum("grt,rg->tr", sums, scale)


class W4A8Linear(Linear):
    """`w4a8`: integer weight levels against int8 activations (absmax per 32 inputs, fp32 scale).

    For each block u of min(32, weight sub-block) inputs: an integer dot product of weight levels and
    activation levels, then fp32 rescale by weight scale x activation scale, summed over blocks;
    weights with a minimum (Q4_K, Q5_K) subtract minimum x activation scale x sum of activation levels.
    The integer dots are formed in fp32, which is exact: |sum| <= 32 x 128 x 127 < 2^24.
    Runs W4 weights and every GGUF block type (`BlockMatrix`).
    """

    route = "w4a8"

    def __init__(self, weight: W4Weight | BlockMatrix):
        self.weight = weight
        self.unit = min(ACT_BLOCK, weight.block_size())

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def __call__(self, x: np.ndarray) -> np.ndarray:
        q, act_scale = quantize_int8_blocks(x)
        return _by_chunks(self.weight, self._rows, q, act_scale)

    def _rows(self, levels: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None,
              q: np.ndarray, act_scale: np.ndarray) -> np.ndarray:
        """levels [r, S, sub], scale/minimum [r, S]; q [T, K/32, 32], act_scale [T, K/32] -> [T, r]."""
        r, S, sub = levels.shape
        u = self.unit
        units = S * sub // u
        q = q.reshape(q.shape[0], units, u)
        act_scale = np.repeat(act_scale, ACT_BLOCK // u, axis=1)  # [T, U]
        dots = np.matmul(levels.reshape(r, units, u).transpose(1, 0, 2), q.transpose(1, 2, 0))  # [U, r, T]
        weight_scale = np.repeat(scale, sub // u, axis=1)  # [r, U]
        out = np.einsum("urt,rut->tr", dots, weight_scale[:, :, None] * act_scale.T[None])
        if minimum is not None:
            out -= (q.sum(axis=-1) * act_scale) @ np.repeat(minimum, sub // u, axis=1).T
        return out


class TrellisLinear(Linear):
    """`w4a8` for trellis weights (engine/quant/trellis.py): activations rotated by the weight's
    Hadamard, int8 per 128-block; per block an integer dot against the int8 trellis levels, rescaled
    by the activation scale; the row scale last. y[n] = row_scale[n] * sum_b act_scale[b] * dot_b.
    """

    route = "w4a8"

    def __init__(self, weight: TrellisWeight):
        self.weight = weight

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def __call__(self, x: np.ndarray) -> np.ndarray:
        q, act_scale = rotated_int8_activations(x, self.weight.seed)
        return _by_chunks(self.weight, _trellis_rows, q, act_scale)


def _trellis_rows(levels: np.ndarray, row_scale: np.ndarray, q: np.ndarray, act_scale: np.ndarray) -> np.ndarray:
    """levels [r, B, 128], row_scale [r]; q [T, B, 128], act_scale [T, B] -> [T, r]."""
    dots = np.matmul(levels.transpose(1, 0, 2), q.transpose(1, 2, 0))  # [B, r, T], exact integers
    return np.einsum("brt,tb->tr", dots, act_scale) * row_scale[None, :]


def _by_chunks(weight, rows_fn, *inputs: np.ndarray) -> np.ndarray:
    """Decode CHUNK_WEIGHTS weights at a time and apply rows_fn; up to MAX_ROWS rows one by one.

    inputs are per-row arrays [T, ...] (the activation in the route's form). The chunks are split
    between the cores even for one row: decoding a chunk is numpy work of milliseconds.
    """
    N, K = weight.shape
    T = inputs[0].shape[0]
    out = np.empty((T, N), np.float32)
    step = max(1, CHUNK_WEIGHTS // K)
    starts = range(0, N, step)

    def chunks(lo: int, hi: int) -> None:
        for start in starts[lo:hi]:
            stop = min(N, start + step)
            decoded = weight.decode_rows(start, stop)
            if T <= MAX_ROWS:
                for t in range(T):
                    out[t, start:stop] = rows_fn(*decoded, *(a[t : t + 1] for a in inputs))[0]
            else:
                out[:, start:stop] = rows_fn(*decoded, *inputs)

    in_parallel(chunks, len(starts))
    return out


class ConcatOutputs(Linear):
    """Several linears on the same input, outputs side by side (gate and up of different storage forms)."""

    def __init__(self, parts: list):
        self.parts = parts

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return np.concatenate([p(x) for p in self.parts], axis=-1)


class PermutedInput(Linear):
    """A linear whose input columns come in another order: y = linear(x[:, order]).

    GGUF files of qwen35 store DeltaNet value heads tiled; the model computes them grouped, so
    out_proj (whose input is value heads) takes its input reordered instead of its blocks.
    """

    def __init__(self, linear, order: np.ndarray):
        self.linear, self.order = linear, order

    @property
    def shape(self) -> tuple[int, int]:
        return self.linear.shape

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.linear(x[:, self.order])


def make_linear(weight, route: str, linears=None):
    """The route's Linear for a weight: float matrices (fp32, bf16 bits) always run dense; quantized
    ones per route.

    `bf16` runs quantized weights dequantized to fp32 (exact values), which isolates weight error
    from activation rounding. The loader has already refused routes a checkpoint cannot run.
    `linears`: the module whose Linear classes are made, this one by default; the GPU's
    (engine/backend/cupy_backend.py) has the same classes over the same stored weights.
    """
    kinds = linears or sys.modules[__name__]
    if isinstance(weight, InputOrder):
        return kinds.PermutedInput(make_linear(weight.weight, route, linears), weight.order)
    if isinstance(weight, BF16Matrix):
        return kinds.BF16Linear(weight)
    if isinstance(weight, np.ndarray):
        return kinds.DenseLinear(weight)
    if route == "bf16":
        return kinds.DenseLinear(weight.dequantize())
    if route == "w4a16" and isinstance(weight, W4Weight):
        return kinds.W4A16Linear(weight)
    if route == "w4a8" and isinstance(weight, TrellisWeight):
        return kinds.TrellisLinear(weight)
    if route == "w4a8":
        return kinds.W4A8Linear(weight)
    raise ValueError(f"route {route} cannot run {type(weight).__name__}")
