"""Compiled CPU kernels (numba): every route's Linear reading each weight once for all the token
rows of a call, with each row's result bit-identical however many rows run.

The numpy Linears of engine/backend/cpu.py are the readable reference; these compute the same
route numerics (DESIGN.md contracts) in another summation order, stated per kernel. Speed comes
from two things:

- Units laid out position-major. A quantized row is repacked once at load into `UnitPlanes`:
  for each unit of `unit` inputs that shares one weight scale (32 for W4 and GGUF blocks on w4a8,
  16 for Q6_K, 128 for W4 on w4a16), position j of every unit is stored side by
  side, codes [N, unit, U]. The dot products of all U units of a row then grow together, one vector
  op per position, with no horizontal sum per unit; the unit's scale is applied once at the end.
- The token rows share the weight. A weight row is decoded once into a small scratch (L1) and
  multiplied against each of the T <= 16 token rows in turn; the loop over tokens sits outside
  every reduction, so a token row runs the same instructions, in the same order, whether it is
  alone (a decode step) or one of k + 1 verify rows. That keeps exact acceptance exact while a
  verify pass costs little more than one step. Longer calls (prefill) run in tiles of 16 rows.

Threads: the kernels release the GIL and take a range of weight rows, so engine/backend/threads.py
splits a product's rows between the cores; a weight row's result does not depend on the split.
Compiled machine code is cached on disk (platformdirs cache, `numba/`), so only the first run
compiles (`compile_kernels`, which reports progress). Without numba the numpy Linears run, and
`unavailable()` says why in one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import platformdirs

from duet.engine.backend import MAX_ROWS, cpu
from duet.engine.backend.threads import in_parallel
from duet.engine.quant.activation import ACT_BLOCK, quantize_int8_blocks, round_to_bf16
from duet.engine.quant.gguf_blocks import BlockMatrix
from duet.engine.quant.w4 import GROUP, W4Weight

CACHE_DIR = Path(platformdirs.user_cache_dir("duet")) / "numba"
KERNELS_ENV = "DUET_CPU_KERNELS"  # "numpy" runs the numpy reference Linears instead
# Products smaller than this many weights run whole on the calling thread: handing a part to the
# other core costs ~40 us, more than a [512, 256] product takes.
SPLIT_MIN_WEIGHTS = 1 << 18


def _load_numba():
    """numba, with its on-disk cache pointed at ours; None when it cannot be imported."""
    os.environ.setdefault("NUMBA_CACHE_DIR", str(CACHE_DIR))
    try:
        import numba
    except ImportError:
        return None
    return numba


_numba = _load_numba()


def unavailable() -> str | None:
    """Why the compiled kernels are not used (one line), or None when they are."""
    if os.environ.get(KERNELS_ENV, "compiled") == "numpy":
        return f"{KERNELS_ENV}=numpy: the numpy reference Linears run"
    if _numba is None:
        return "numba is not installed: the numpy reference Linears run (pip install numba for ~10x faster CPU decoding)"
    return None


def _jit(fastmath: bool = False):
    return _numba.njit(nogil=True, cache=True, fastmath=fastmath) if _numba else (lambda f: f)


# ---------------------------------------------------------------------------------------------
# Kernels. Shapes: N weight rows, U units a row, T <= 16 token rows; [lo, hi) is this thread's
# share of weight rows; out [T, N] fp32. Integer products are cast back to their narrow type at
# each step so that LLVM keeps them narrow (numba widens integer arithmetic to int64, which turns
# a 16-lane multiply-add into 4-lane ones).


@_jit()
def _w4a8_nibbles(codes, scale, x, x_scale, out, lo, hi):
    """Levels -8..7, two a byte: codes uint8 [N, unit/2, U], low nibble position j, high nibble
    position j + unit/2, each stored + 8. x int16 [T, unit, U] (int8 activation levels).

    out[t, n] = sum over units v, in order, of fp32(dot_v) * (scale[n, v] * x_scale[t, v]); a
    unit's dot is exact in int16: |dot| <= 32 * 8 * 127 = 32512 < 2^15."""
    T, half, U = x.shape[0], codes.shape[1], codes.shape[2]
    w = np.empty((2 * half, U), np.int16)
    dots = np.empty(U, np.int16)
    for n in range(lo, hi):
        for j in range(half):
            for v in range(U):
                byte = np.int16(codes[n, j, v])
                w[j, v] = np.int16((byte & 15) - 8)
                w[j + half, v] = np.int16((byte >> 4) - 8)
        for t in range(T):
            dots[:] = 0
            for j in range(2 * half):
                for v in range(U):
                    dots[v] = np.int16(dots[v] + np.int16(w[j, v] * x[t, j, v]))
            acc = np.float32(0)
            for v in range(U):
                acc += np.float32(dots[v]) * (scale[n, v] * x_scale[t, v])
            out[t, n] = acc


@_jit()
def _w4a8_bytes(codes, scale, minimum, x, x_scale, x_sum, out, lo, hi):
    """Levels in the int8 range, one a byte: codes int8 [N, unit, U]; x int16 [T, unit, U].

    out[t, n] = sum_v fp32(dot_v) * (scale[n, v] * x_scale[t, v]), minus, for types with a minimum
    (minimum [N, U]; [N, 0] when there is none), sum_v (x_sum[t, v] * x_scale[t, v]) * minimum[n, v];
    each sum in unit order. A product fits int16 (|level * x| <= 128 * 127 = 16256), a unit's dot int32."""
    T, unit, U = x.shape[0], codes.shape[1], codes.shape[2]
    has_minimum = minimum.shape[1] > 0
    w = np.empty((unit, U), np.int16)
    dots = np.empty(U, np.int32)
    for n in range(lo, hi):
        for j in range(unit):
            for v in range(U):
                w[j, v] = codes[n, j, v]
        for t in range(T):
            dots[:] = 0
            for j in range(unit):
                for v in range(U):
                    dots[v] = np.int32(dots[v] + np.int32(np.int16(w[j, v] * x[t, j, v])))
            acc = np.float32(0)
            for v in range(U):
                acc += np.float32(dots[v]) * (scale[n, v] * x_scale[t, v])
            if has_minimum:
                offset = np.float32(0)
                for v in range(U):
                    offset += (x_sum[t, v] * x_scale[t, v]) * minimum[n, v]
                acc -= offset
            out[t, n] = acc


@_jit()
def _w4a16_nibbles(codes, scale, x, out, lo, hi):
    """W4 on w4a16: codes uint8 [N, 64, G] as in _w4a8_nibbles with 128-input units (groups);
    x fp32 [T, 128, G], bf16-rounded. Per group an fp32 sum over positions 0..127 in order (each
    product level * x is exact), then out[t, n] = sum_g, in order, of sums[g] * scale[n, g]."""
    T, half, G = x.shape[0], codes.shape[1], codes.shape[2]
    w = np.empty((2 * half, G), np.float32)
    sums = np.empty(G, np.float32)
    for n in range(lo, hi):
        for j in range(half):
            for g in range(G):
                byte = np.int32(codes[n, j, g])
                w[j, g] = np.float32((byte & 15) - 8)
                w[j + half, g] = np.float32((byte >> 4) - 8)
        for t in range(T):
            sums[:] = 0
            for j in range(2 * half):
                for g in range(G):
                    sums[g] += w[j, g] * x[t, j, g]
            acc = np.float32(0)
            for g in range(G):
                acc += sums[g] * scale[n, g]
            out[t, n] = acc


@_jit(fastmath=True)
def _dense(weight, x, out, lo, hi):
    """fp32 weight [N, K] against fp32 x [T, K]. fastmath lets LLVM split each dot into vector lanes;
    the split is fixed by K and the compiled code alone, the same for every token row."""
    T, K = x.shape
    for n in range(lo, hi):
        for t in range(T):
            acc = np.float32(0)
            for k in range(K):
                acc += weight[n, k] * x[t, k]
            out[t, n] = acc


# ---------------------------------------------------------------------------------------------
# Repacking at load.


@dataclass(frozen=True)
class UnitPlanes:
    """A quantized matrix [N, K] as the kernels read it (module docstring).

    codes    uint8 [N, unit/2, U] (`nibbles`: levels -8..7, two a byte) or int8 [N, unit, U]
    scale    fp32 [N, U]: the weight scale of each unit (bf16, f16 or products of them, exact)
    minimum  fp32 [N, U] for Q4_K / Q5_K, else [N, 0]
    """

    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray
    unit: int
    nibbles: bool

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.unit * self.codes.shape[2]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.minimum.nbytes


REPACK_ROWS_WEIGHTS = 1 << 20  # weights repacked at a time


def repack(weight: W4Weight | BlockMatrix, unit: int) -> UnitPlanes:
    """Decode the stored form a chunk of rows at a time (its codec, engine/quant) and lay the levels
    out by units of `unit` inputs. Two levels a byte where every level fits a nibble (W4, Q4_0)."""
    N, K = weight.shape
    U = K // unit
    nibbles = isinstance(weight, W4Weight) or (isinstance(weight, BlockMatrix) and weight.codec.sub == 32
                                               and weight.qtype.name == "Q4_0")
    codes = np.empty((N, unit // 2, U), np.uint8) if nibbles else np.empty((N, unit, U), np.int8)
    scale = np.empty((N, U), np.float32)
    has_minimum = isinstance(weight, BlockMatrix) and weight.qtype.name in ("Q4_K", "Q5_K")
    minimum = np.empty((N, U if has_minimum else 0), np.float32)
    step = max(1, REPACK_ROWS_WEIGHTS // K)
    starts = range(0, N, step)

    def chunks(lo: int, hi: int) -> None:
        for start in starts[lo:hi]:
            stop = min(N, start + step)
            levels, sub_scale, sub_minimum = weight.decode_rows(start, stop)  # [r, S, sub], [r, S]
            per_sub = levels.shape[2] // unit  # units a scale covers
            by_unit = levels.reshape(stop - start, U, unit).transpose(0, 2, 1)  # [r, unit, U]
            if nibbles:
                stored = (by_unit + 8).astype(np.uint8)
                codes[start:stop] = stored[:, : unit // 2] | (stored[:, unit // 2 :] << np.uint8(4))
            else:
                codes[start:stop] = by_unit
            scale[start:stop] = np.repeat(sub_scale, per_sub, axis=1)
            if has_minimum:
                minimum[start:stop] = np.repeat(sub_minimum, per_sub, axis=1)

    in_parallel(chunks, len(starts))
    return UnitPlanes(codes, scale, minimum, unit, nibbles)


# ---------------------------------------------------------------------------------------------
# Linears. Each has prepare(x rows) -> the activations as its kernel reads them, and
# kernel(prepared, out rows, lo, hi).


class TiledLinear(cpu.Linear):
    @property
    def nbytes(self) -> int:
        return self.planes.nbytes

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """out [T, N], MAX_ROWS token rows at a time, each tile's weight rows split between the
        cores when the product is large enough to pay for it."""
        N, K = self.shape
        out = np.empty((x.shape[0], N), np.float32)
        for t0 in range(0, x.shape[0], MAX_ROWS):
            prepared, out_rows = self.prepare(x[t0 : t0 + MAX_ROWS]), out[t0 : t0 + MAX_ROWS]
            in_parallel(lambda lo, hi: self.kernel(prepared, out_rows, lo, hi), N, split=N * K >= SPLIT_MIN_WEIGHTS)
        return out


def _by_unit(values: np.ndarray, unit: int, dtype) -> np.ndarray:
    """[T, ..., unit] (units in input order) -> contiguous [T, unit, U] (position-major, as the codes)."""
    T = values.shape[0]
    return np.ascontiguousarray(values.reshape(T, -1, unit).transpose(0, 2, 1), dtype=dtype)


class W4A8Linear(TiledLinear):
    """`w4a8` on W4 and GGUF blocks: activations int8 per 32 inputs (absmax, fp32 scale), an
    integer dot per unit, fp32 rescale, as cpu.W4A8Linear; sums in unit order (_w4a8_nibbles,
    _w4a8_bytes)."""

    route = "w4a8"

    def __init__(self, weight: W4Weight | BlockMatrix):
        self.planes = repack(weight, min(ACT_BLOCK, weight.block_size()))

    @property
    def shape(self) -> tuple[int, int]:
        return self.planes.shape

    def prepare(self, x: np.ndarray):
        p = self.planes
        q, act_scale = quantize_int8_blocks(x)  # [T, K/32, 32], [T, K/32]
        x_scale = np.ascontiguousarray(np.repeat(act_scale, ACT_BLOCK // p.unit, axis=1))  # [T, U]
        if p.minimum.shape[1]:
            x_sum = q.reshape(x.shape[0], -1, p.unit).sum(axis=-1, dtype=np.float32)
        else:
            x_sum = x_scale  # not read
        return _by_unit(q, p.unit, np.int16), x_scale, x_sum

    def kernel(self, prepared, out: np.ndarray, lo: int, hi: int) -> None:
        q, x_scale, x_sum = prepared
        p = self.planes
        if p.nibbles:
            _w4a8_nibbles(p.codes, p.scale, q, x_scale, out, lo, hi)
        else:
            _w4a8_bytes(p.codes, p.scale, p.minimum, q, x_scale, x_sum, out, lo, hi)


class W4A16Linear(TiledLinear):
    """`w4a16` on W4: bf16-rounded activations, an fp32 sum per 128-group, scaled, as
    cpu.W4A16Linear; sums in position then group order (_w4a16_nibbles)."""

    route = "w4a16"

    def __init__(self, weight: W4Weight):
        self.planes = repack(weight, GROUP)

    @property
    def shape(self) -> tuple[int, int]:
        return self.planes.shape

    def prepare(self, x: np.ndarray):
        return _by_unit(round_to_bf16(x), GROUP, np.float32)

    def kernel(self, x: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
        _w4a16_nibbles(self.planes.codes, self.planes.scale, x, out, lo, hi)


class DenseLinear(cpu.DenseLinear):
    """`bf16` route: up to MAX_ROWS rows through the compiled dense kernel (one weight read for all
    rows, each row's bits as when alone); prefill through BLAS, as cpu.DenseLinear."""

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.shape[0] > MAX_ROWS:
            return super().__call__(x)
        N, K = self.weight.shape
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], N), np.float32)
        in_parallel(lambda lo, hi: _dense(self.weight, x, out, lo, hi), N, split=N * K >= SPLIT_MIN_WEIGHTS)
        return out


def make_linear(weight, route: str):
    """The compiled Linear for a weight and route where there is one, else numpy's (cpu.make_linear)."""
    if unavailable():
        return cpu.make_linear(weight, route)
    return cpu.make_linear(weight, route, linears=_COMPILED)


class _Compiled:
    """The Linear kinds cpu.make_linear makes, compiled where a kernel exists."""

    DenseLinear = DenseLinear
    W4A16Linear = W4A16Linear
    W4A8Linear = W4A8Linear
    TrellisLinear = cpu.TrellisLinear  # no kernel yet: an int8 repack would hold 2-4x the coded bytes
    PermutedInput = cpu.PermutedInput


_COMPILED = _Compiled()
