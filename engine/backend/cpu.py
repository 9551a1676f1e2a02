"""numpy linear layers. Every route's Linear takes x [T, K] and returns x @ W^T [T, N] in fp32.

Routes (DESIGN.md contracts): `bf16` DenseLinear, `w4a16` W4A16Linear, `w4a8` W4A8Linear.
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from threadpoolctl import ThreadpoolController

from engine.errors import CheckpointError
from engine.quant.activation import ACT_BLOCK, quantize_int8_blocks, round_to_bf16
from engine.quant.gguf_blocks import BlockMatrix
from engine.quant.trellis import TrellisWeight, rotated_int8_activations
from engine.quant.w4 import GROUP, W4Weight


@functools.cache
def reuse_freed_memory() -> None:
    """Let glibc keep freed activation buffers for reuse instead of handing them back to the OS.

    A prefill step makes and frees temporaries of a few MB each. By default glibc returns the top of
    the heap to the OS once 2x the largest recently freed block is free there, so every elementwise op
    page-faults its output in again: silu over [128, 6144] took 2.6 ms that way, 1.2 ms with this.
    Blocks of 32 MB and more (weights, long prompts) still come from mmap and go back when freed;
    at most 256 MB of freed heap is kept. Process-wide, once; a no-op where libc has no mallopt.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the interpreter runs on
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    mallopt(M_MMAP_THRESHOLD, 32 << 20)
    mallopt(M_TRIM_THRESHOLD, 256 << 20)


# Prefill splits its work into one part per core. ufunc loops and BLAS calls release the GIL, so
# Python threads are enough: SiLU and the causal conv over [128, 6144] take 2.2 ms on two cores
# against 3.8 ms on one. Results are bit-identical however the work is split: each element, row or
# head is computed by the same code either way. The parts follow the thread count numpy's BLAS was
# given (OPENBLAS_NUM_THREADS; one thread per core by default) and the cores this process may use.
BLAS = ThreadpoolController()


def _parts() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    blas_threads = min((lib.num_threads for lib in BLAS.select(user_api="blas").lib_controllers), default=1)
    return max(1, min(cores, blas_threads))


PARTS = _parts()


class _Worker:
    """A thread that runs the parts it is handed, one at a time, and reports each on `done`: None,
    or the exception the part raised. A plain queue each way: a no-op split took 43 us so, 107 us
    with a ThreadPoolExecutor's futures; a 0.8B prefill splits ~230 times."""

    def __init__(self, name: str):
        self.parts: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            work, lo, hi, done = self.parts.get()
            try:
                work(lo, hi)
            except BaseException as error:  # handed to the caller, which raises it
                done.put(error)
            else:
                done.put(None)


_workers: list[_Worker] = []  # started on first use, one per part beyond the caller's


def _worker(i: int) -> _Worker:
    while len(_workers) <= i:
        _workers.append(_Worker(f"duet-numpy-{len(_workers)}"))
    return _workers[i]


_blas_limited = threading.local()  # .depth: one_blas_thread contexts the thread is inside


@contextmanager
def one_blas_thread():
    """Context: numpy's BLAS on the calling thread only. Prefill runs under it as a whole, so no
    product wakes OpenBLAS's workers, which would then spin for ~0.1 s on the cores the parts need
    (the causal conv right after a two-thread GEMM took 6.0 ms, median, against 3.0 ms when the
    workers slept at once). Inside one already (every split of a prefill), it costs nothing: setting
    and restoring the limit took ~9 us, ~230 times a prefill."""
    depth = getattr(_blas_limited, "depth", 0)
    _blas_limited.depth = depth + 1
    try:
        if depth:
            yield
        else:
            with BLAS.limit(limits=1, user_api="blas"):
                yield
    finally:
        _blas_limited.depth = depth


_SPLITTING = threading.Lock()  # held while a split runs: a split inside one, or beside one, runs whole


def in_parallel(work, n: int, split: bool = True) -> None:
    """work(lo, hi) over [0, n) in PARTS contiguous parts at once, when asked; n counts independent
    items (rows, heads, channels). A decode step does not split: handing work to another thread
    costs more than its few hundred elements. Each part runs its products on one BLAS thread (parts
    of several BLAS threads each would put more threads than cores). One part per core beat finer
    parts the threads take in turn: on two cores a prefill took 10% longer with 4 parts, 18% with 8."""
    parts = min(PARTS, n)
    if not split or parts < 2 or not _SPLITTING.acquire(blocking=False):
        work(0, n)
        return
    try:
        bounds = [n * i // parts for i in range(parts + 1)]
        done: queue.SimpleQueue = queue.SimpleQueue()
        with one_blas_thread():
            for i in range(parts - 1):
                _worker(i).parts.put((work, bounds[i], bounds[i + 1], done))
            try:
                work(bounds[-2], n)
            finally:
                errors = [done.get() for _ in range(parts - 1)]  # every part has ended
        for error in errors:
            if error is not None:
                raise error
    finally:
        _SPLITTING.release()


# Up to this many rows (a decode step, or a speculative verify of 1 + drafts) each row is its own
# matrix-vector product, so a row's result does not depend on how many rows came with it: a
# verify row is bit-identical to the one-row decode step it stands for, and drafts can never flip
# a greedy token on a near-tie. Longer inputs (prefill) take one matrix-matrix product.
ROWWISE_MAX = 16


# From this many tokens, a token-major prefill product splits its tokens between the cores rather
# than its weight rows: each core's run of tokens is then long enough for x @ W^T to run as fast
# as W @ x^T, and no block is copied back to token-major, a copy that grows with T (two cores,
# 8224 x 1024 at 2048 tokens: 176 GFLOPS by weight rows and copy, 259 by tokens). Whole 0.8B
# prefills, in-process A/B: 2048 tokens 103.3 -> 120.1 tok/s, 1024 tokens 1.01x-1.06x; at 256 and
# 512 no gain beyond noise, and at 128 the weight-row split is ahead (142 against 112 GFLOPS).
# Cut anywhere, the token runs give the same bits as one product (75 of 75 shapes and cuts checked).
TOKEN_SPLIT_MIN = 1024


class Linear:
    """What every route's Linear offers: __call__, x [T, K] -> x @ W^T [T, N], and the same product
    feature-major."""

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
        if x.shape[0] <= ROWWISE_MAX:
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
        return super().by_feature(x) if x.shape[0] <= ROWWISE_MAX else self._product(x, token_major=False)

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
    """Decode CHUNK_WEIGHTS weights at a time and apply rows_fn; up to ROWWISE_MAX rows one by one.

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
            if T <= ROWWISE_MAX:
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


@dataclass(frozen=True)
class InputOrder:
    """A weight whose input columns are stored in another order: the model's x is gathered by `order`."""

    weight: object
    order: np.ndarray


def make_linear(weight, route: str):
    """The route's Linear for a weight: fp32 arrays always run dense; quantized ones per route.

    `bf16` runs quantized weights dequantized to fp32 (exact values), which isolates weight error
    from activation rounding. The loader has already refused routes a checkpoint cannot run.
    """
    if isinstance(weight, InputOrder):
        return PermutedInput(make_linear(weight.weight, route), weight.order)
    if isinstance(weight, np.ndarray):
        return DenseLinear(weight)
    if route == "bf16":
        return DenseLinear(weight.dequantize())
    if route == "w4a16" and isinstance(weight, W4Weight):
        return W4A16Linear(weight)
    if route == "w4a8" and isinstance(weight, TrellisWeight):
        return TrellisLinear(weight)
    if route == "w4a8":
        return W4A8Linear(weight)
    raise ValueError(f"route {route} cannot run {type(weight).__name__}")


def stacked_linear(parts: list, route: str):
    """One Linear over weight matrices stacked by rows (gate then up; q | k | v | z | b | a): each run
    of consecutive parts in one storage form is merged into one matrix, and the runs run side by side."""
    runs = [[parts[0]]]
    for part in parts[1:]:
        if _same_storage(runs[-1][0], part):
            runs[-1].append(part)
        else:
            runs.append([part])
    linears = [make_linear(_stack_rows(run), route) for run in runs]
    return linears[0] if len(linears) == 1 else ConcatOutputs(linears)


def _same_storage(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(a, W4Weight):
        return type(a) is type(b)
    if isinstance(a, TrellisWeight):
        return isinstance(b, TrellisWeight) and (a.k, a.seed, a.shape[1]) == (b.k, b.seed, b.shape[1])
    if isinstance(a, BlockMatrix):
        return isinstance(b, BlockMatrix) and (a.qtype, a.K) == (b.qtype, b.K)
    return False  # InputOrder and the like run as they are


def _stack_rows(run: list):
    first = run[0]
    if len(run) == 1:
        return first
    if isinstance(first, np.ndarray):
        return np.concatenate(run)
    if isinstance(first, W4Weight):
        return W4Weight(np.concatenate([p.packed for p in run]), np.concatenate([p.scales for p in run]))
    if isinstance(first, TrellisWeight):
        # Tiles are stored row band by row band (trellis.to_tiles), so stacking rows concatenates tiles.
        return TrellisWeight(np.concatenate([p.packed for p in run]), np.concatenate([p.row_scale for p in run]),
                             (sum(p.shape[0] for p in run), first.shape[1]), first.k, first.seed)
    return BlockMatrix(first.qtype, np.concatenate([p.raw for p in run]), first.K)


def resolve_route(requested: str, available: tuple[str, ...], description: str, source) -> str:
    """`auto` -> the checkpoint's natural route (first of available); a route it cannot run -> one line."""
    if requested == "auto":
        return available[0]
    if requested not in available:
        others = " or ".join(available)
        raise CheckpointError(source, f"route {requested} cannot run {description} weights; use --route {others}")
    return requested
