"""The op set on an NVIDIA GPU: CuPy arrays and our kernels (engine/kernels/*.cu).

Linear classes mirror engine/backend/cpu.py (x [T, K] -> x @ W^T [T, N], fp32) and reproduce each
route's numerics (DESIGN.md contracts): the CPU classes are the reference the GPU tests hold them
to. Inputs may be numpy or CuPy arrays; outputs are CuPy arrays. Only imported once
engine.backend.select has found a GPU and CuPy.
"""

from __future__ import annotations

import cupy as cp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from duet.engine.backend import MAX_ROWS
from duet.engine.cache import Q4_GROUP, RECENT_ROWS, SINK_ROWS
from duet.engine.kernels.build import kernel
from duet.engine.quant.activation import ACT_BLOCK
from duet.engine.quant.gguf_blocks import BlockMatrix, iq4_xs_sub_scales
from duet.engine.quant.trellis import MULTIPLIERS, TrellisWeight, rotation_signs
from duet.engine.quant.w4 import GROUP, W4Weight


def _i32(v) -> np.int32:
    return np.int32(v)


def _i64(v) -> np.int64:
    return np.int64(v)


def _f32(v) -> np.float32:
    return np.float32(v)


def device_f32(x) -> cp.ndarray:
    """x as contiguous fp32 on the device (an Activations' fp32 rows, Columns joined)."""
    if isinstance(x, Activations):
        x = x.f32
    elif isinstance(x, Columns):
        x = x.joined()
    return cp.ascontiguousarray(cp.asarray(x, dtype=cp.float32))


# The forms of a Linear's input its producing kernel can write beside the fp32 value (common.cuh's
# emit_forms): what the w4a16 and w4a8 Linears read. A Linear class's READS names its form.
EMIT_BF16, EMIT_INT8 = 1, 2


class Activations:
    """A Linear's input as the kernel that made it emitted it: fp32 rows [T, K] and the forms the op
    set's Linears read (bf16 bits [T, K] for w4a16; int8 codes [T, K] with an fp32 scale per 32
    inputs [T, K / 32] for w4a8; None where not emitted), so no Linear launches a conversion. Rows
    slice every form alike; anything else reads the fp32 rows."""

    def __init__(self, f32: cp.ndarray, bf16: cp.ndarray | None, q: cp.ndarray | None, scale: cp.ndarray | None):
        self.f32, self.bf16, self.q, self.scale = f32, bf16, q, scale

    @property
    def shape(self) -> tuple[int, ...]:
        return self.f32.shape

    def __getitem__(self, rows) -> Activations:
        return Activations(*(None if a is None else a[rows] for a in (self.f32, self.bf16, self.q, self.scale)))


class Columns:
    """The outputs [T, N_i] of Linears stacked by rows (cupy_model.ConcatOutputs), side by side as
    one [T, sum N_i] whose columns are never copied together for a range that lies in one part:
    indexing [rows, start:stop] there is a view of that part's output. The kernels read such
    ranges in place (DeltaNet's q | k | v, z, b and a; attention's q, k and v), so a pass over a
    checkpoint whose projections mix storage forms (W4 beside 16-bit in_proj_a/b) joins nothing;
    anything else reads them joined."""

    def __init__(self, parts: list):
        self.parts = parts
        self.starts = np.cumsum([0] + [p.shape[1] for p in parts])

    @property
    def shape(self) -> tuple[int, int]:
        return self.parts[0].shape[0], int(self.starts[-1])

    def __getitem__(self, key):
        rows, columns = key if isinstance(key, tuple) else (key, slice(None))
        if isinstance(columns, slice) and columns.step in (None, 1):
            start, stop, _ = columns.indices(self.shape[1])
            for part, lo, hi in zip(self.parts, self.starts, self.starts[1:]):
                if lo <= start and stop <= hi:
                    return part[rows, start - lo : stop - lo]
        return self.joined()[key]

    def joined(self) -> cp.ndarray:
        return cp.concatenate(self.parts, axis=-1)


def _emitted(y: cp.ndarray, forms: int) -> tuple[tuple, Activations | cp.ndarray]:
    """The emit arguments of a kernel writing y [T, K] (buffers for the forms asked, one-element
    stand-ins for the others: a kernel argument is never None) and what the call returns: y, or y
    with its forms. int8 needs whole 32-blocks: K % 32 == 0."""
    T, K = y.shape[0], y.size // max(1, y.shape[0])
    if K % 32:
        forms &= ~EMIT_INT8
    bf16 = cp.empty((T, K), cp.uint16) if forms & EMIT_BF16 else cp.empty(1, cp.uint16)
    q = cp.empty((T, K), cp.int8) if forms & EMIT_INT8 else cp.empty(1, cp.int8)
    scale = cp.empty((T, K // 32), cp.float32) if forms & EMIT_INT8 else cp.empty(1, cp.float32)
    result = Activations(y, *((bf16,) if forms & EMIT_BF16 else (None,)),
                         *((q, scale) if forms & EMIT_INT8 else (None, None))) if forms else y
    return (bf16, q, scale, _i32(forms)), result


def _emitted_rows(emit: tuple, rows: slice) -> tuple:
    """_emitted's emit arguments for rows of its output: the buffers the forms ask for, sliced; the
    one-element stand-ins of the others whole."""
    bf16, q, scale, forms = emit
    int8 = int(forms) & EMIT_INT8
    return (bf16[rows] if int(forms) & EMIT_BF16 else bf16, q[rows] if int8 else q, scale[rows] if int8 else scale, forms)


def _sm_count() -> int:
    return cp.cuda.Device().attributes["MultiProcessorCount"]


def _row_slices(T: int):
    """The GEMV kernels take at most MAX_ROWS rows; longer inputs (prefill) run slice by slice."""
    return [slice(s, min(T, s + MAX_ROWS)) for s in range(0, T, MAX_ROWS)]


def _blocks(n: int, per: int) -> int:
    return (n + per - 1) // per


# ------------------------------------------------------------------------------ linears ---

class DenseLinear:
    """`bf16` route on an fp32 matrix (a GGUF F32 tensor, or a quantized one dequantized): cuBLAS."""

    route = "bf16"

    def __init__(self, weight: np.ndarray):
        self.weight = device_f32(weight)

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def __call__(self, x) -> cp.ndarray:
        return device_f32(x) @ self.weight.T


class RowSlicedLinear:
    """The quantized routes' kernels take at most MAX_ROWS rows: y [T, N] from the subclass's
    run_rows(x [t <= MAX_ROWS, K]) -> [t, N] over slices of x."""

    N: int
    K: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.N, self.K

    def __call__(self, x) -> cp.ndarray:
        if not isinstance(x, Activations):
            x = device_f32(x)
        if x.shape[0] <= MAX_ROWS:  # a decode or verify pass: the kernel's output is the result, no copy
            return self.run_rows(x)
        out = cp.empty((x.shape[0], self.N), cp.float32)
        for rows in _row_slices(x.shape[0]):
            out[rows] = self.run_rows(x[rows])
        return out


class BF16Linear(RowSlicedLinear):
    """`bf16` route on a bf16 checkpoint's matrix (BF16Matrix): its bits stay bf16 on the card (half
    of an fp32 copy's memory and of the bytes a pass reads), widened exactly in bf16_gemv, which
    multiplies fp32 activations and sums in fp32, as the CPU's BF16Linear."""

    route = "bf16"

    def __init__(self, weight):
        self.bits = weight if isinstance(weight, cp.ndarray) else cp.asarray(weight.bits)  # uint16 [N, K]
        self.N, self.K = self.bits.shape
        if self.K % 8:
            raise ValueError(f"bf16_gemv needs K % 8 == 0, got {self.N} x {self.K}")

    def leading_rows(self, stop: int) -> BF16Linear:
        """This Linear over weight rows 0..stop-1, reading the same bits (the draft shortlist's block)."""
        return BF16Linear(self.bits[:stop])

    def run_rows(self, x) -> cp.ndarray:
        x = device_f32(x)
        T = x.shape[0]
        out = cp.empty((T, self.N), cp.float32)
        kernel("dense", "bf16_gemv")((_blocks(self.N, 8),), (256,), (self.bits, x, out, _i32(self.N), _i32(self.K), _i32(T)))
        return out


class SwiGLUBF16Linear(BF16Linear):
    """An MLP's gate | up on the bf16 route whose product ends in silu(gate) * up (bf16_swiglu: a warp
    takes a feature's gate and up rows; no silu_mul launch). `swiglu(x)` is what ops.swiglu asks of it."""

    def __init__(self, linear: BF16Linear):
        super().__init__(linear.bits)

    def swiglu(self, x, forms: int = 0) -> cp.ndarray:
        """silu(gate) * up [T, N / 2] of x [T, K] (the bf16 route's down projection reads fp32: no forms)."""
        x = device_f32(x)
        T, I = x.shape[0], self.N // 2
        out = cp.empty((T, I), cp.float32)
        for rows in _row_slices(T):
            kernel("dense", "bf16_swiglu")((_blocks(I, 8),), (256,),
                                          (self.bits, x[rows], out[rows], _i32(I), _i32(self.K), _i32(x[rows].shape[0])))
        return out


def embed_bf16(table: cp.ndarray, ids) -> cp.ndarray:
    """Rows ids (host or device) of a bf16 table (uint16 bits [V, H]) as fp32 [T, H], in one launch."""
    ids = cp.asarray(ids, dtype=cp.int32)
    out = cp.empty((ids.shape[0], table.shape[1]), cp.float32)
    kernel("dense", "embed_bf16")((ids.shape[0],), (256,), (table, ids, out, _i32(table.shape[1])))
    return out


class W4A16Linear(RowSlicedLinear):
    """`w4a16`: bf16 activations, W4 weights decoded in registers, mma.sync bf16, fp32 per group.

    Grid: one block per 16 output rows; when that leaves the GPU short of blocks, the 128-groups
    are split over blockIdx.y into partial outputs, which each tile's last split sums in a fixed
    order (`arrivals` counts a tile's finished splits; the kernel leaves it at 0).
    """

    route = "w4a16"
    READS = EMIT_BF16

    def __init__(self, weight: W4Weight):
        N, K = weight.shape
        if N % 16 or K % GROUP:
            raise ValueError(f"w4a16 on the GPU needs N % 16 == 0 and K % 128 == 0, got {N} x {K}")
        self.packed = cp.asarray(weight.packed)
        self.scales = cp.asarray(weight.scales)
        self.N, self.K = N, K
        self.splits, self.arrivals = _tile_splits(N, K)

    def run_rows(self, x: cp.ndarray | Activations) -> cp.ndarray:
        T = x.shape[0]
        xb = x.bf16 if isinstance(x, Activations) and x.bf16 is not None else to_bf16_bits(device_f32(x))
        out = cp.empty((T, self.N), cp.float32)
        partial = cp.empty((self.splits, T, self.N), cp.float32) if self.splits > 1 else out  # one split: unread
        name = "w4a16_gemm_t8" if T <= 8 else "w4a16_gemm_t16"
        kernel("w4a16", name)((self.N // 16, self.splits), (256,),
                              (self.packed, self.scales, xb, partial, out, self.arrivals, _i32(self.N), _i32(self.K), _i32(T)))
        return out


class SwiGLUW4A16Linear(W4A16Linear):
    """An MLP's gate | up on w4a16 whose product ends in silu(gate) * up (the kernel's SwiGLU epilogue,
    no silu_mul launch): each 16-row tile holds gate rows 8b .. 8b + 7, then the up rows of the same
    features, moved so at upload. `swiglu(x)` is what ops.swiglu asks of it; each output keeps the
    bits of its gate and up rows' sums, which the move does not touch."""

    def __init__(self, linear: W4A16Linear):
        N = linear.N
        if N % 32:
            raise ValueError(f"a gate | up of {N} rows does not split into 16-row tiles of 8 features")
        features = np.arange(N // 2).reshape(-1, 8)  # [tiles, 8]
        order = cp.asarray(np.concatenate([features, features + N // 2], axis=1).ravel())  # tile b: gate rows, then up
        super().__init__(W4Weight(linear.packed[order], linear.scales[order]))

    def __call__(self, x):
        raise TypeError("a SwiGLU gate | up runs through ops.swiglu (its rows are interleaved)")

    def swiglu(self, x, forms: int = 0) -> cp.ndarray | Activations:
        """silu(gate) * up [T, N / 2] of x [T, K], also as bf16 bits where forms ask (then Activations)."""
        T, I = x.shape[0], self.N // 2
        out = cp.empty((T, I), cp.float32)
        bf16 = cp.empty((T, I), cp.uint16) if forms & EMIT_BF16 else cp.empty(1, cp.uint16)
        for rows in _row_slices(T):
            xb = x.bf16[rows] if isinstance(x, Activations) and x.bf16 is not None else to_bf16_bits(device_f32(x)[rows])
            t = xb.shape[0]
            partial = cp.empty((self.splits, t, self.N), cp.float32) if self.splits > 1 else out
            kernel("w4a16", "w4a16_swiglu_t8" if t <= 8 else "w4a16_swiglu_t16")(
                (self.N // 16, self.splits), (256,),
                (self.packed, self.scales, xb, partial, out[rows], self.arrivals, _i32(self.N), _i32(self.K), _i32(t),
                 bf16[rows] if forms & EMIT_BF16 else bf16, _i32(forms & EMIT_BF16)))
        return Activations(out, bf16, None, None) if forms & EMIT_BF16 else out


def _tile_splits(N: int, K: int) -> tuple[int, cp.ndarray]:
    """How many blocks share a 16-row tile's 128-groups in the W4 tensor-core kernels (8 warps a
    block, a group a warp at least; splits until ~4 blocks an SM), and the tiles' arrival counts."""
    groups, tiles = K // GROUP, N // 16
    splits = max(1, min(groups // 8, _blocks(4 * _sm_count(), tiles)))
    return splits, cp.zeros(tiles if splits > 1 else 1, cp.int32)


def to_bf16_bits(x: cp.ndarray) -> cp.ndarray:
    """fp32 -> bf16 bits (uint16), round to nearest even."""
    out = cp.empty(x.shape, cp.uint16)
    kernel("w4a16", "f32_to_bf16_bits")((_blocks(x.size, 256),), (256,), (x, out, _i64(x.size)))
    return out


def quantize_int8(x: cp.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
    """x [T, K] -> (q int8 [T, K], scale fp32 [T, K/32]): engine.quant.activation.quantize_int8_blocks."""
    T, K = x.shape
    q = cp.empty((T, K), cp.int8)
    scale = cp.empty((T, K // ACT_BLOCK), cp.float32)
    n_blocks = T * K // ACT_BLOCK
    kernel("w4a8", "quantize_int8_blocks")((_blocks(n_blocks, 8),), (256,), (x, q, scale, _i64(n_blocks)))
    return q, scale


INT8_WARP_ROWS = 4  # w4a8.cu's: weight rows an int8 GEMV warp takes, sharing the activation loads


def _int8_input(x: cp.ndarray | Activations) -> tuple[cp.ndarray, cp.ndarray]:
    """x as the int8 kernels read it: (codes [T, K], scale per 32 [T, K / 32]), the emitted forms when
    the kernel that made x wrote them, else quantized here."""
    return (x.q, x.scale) if isinstance(x, Activations) and x.q is not None else quantize_int8(device_f32(x))


def _int8_width(T: int) -> int:
    """The int8 kernels' token rows (w4a8.cu's _t4 and _t16 variants: the registers T needs)."""
    return 4 if T <= 4 else 16


# Codecs the int8 GEMV decodes on the device: kernel suffix per storage form.
INT8_CODECS = {GGMLQuantizationType.Q8_0: "q8_0", GGMLQuantizationType.Q4_0: "q4_0",
               GGMLQuantizationType.IQ4_XS: "iq4_xs"}


def gguf_planes(weight: BlockMatrix) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF matrix's blocks as int8_gemv streams them (w4a8.cu's codecs): (quant plane uint8 [N, K]
    (Q8_0) or [N, K / 2], each 32-input unit's bytes as the block stores them; scale words uint16 [N, ...]:
    each unit's f16 d (Q8_0, Q4_0), or per 256 inputs (IQ4_XS) d then the 8 units' ls - 32 as int8 bytes)."""
    (N, K), qtype = weight.shape, weight.qtype
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = weight.raw.reshape(N, -1, type_size)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.uint16)  # [N, blocks, 1]
    if qtype == GGMLQuantizationType.IQ4_XS:
        sub_scales = iq4_xs_sub_scales(blocks.reshape(-1, type_size)).reshape(N, -1, 8).view(np.uint16)  # [N, blocks, 4]
        return np.ascontiguousarray(blocks[..., 8:]).reshape(N, -1), np.concatenate([d, sub_scales], axis=-1).reshape(N, -1)
    return np.ascontiguousarray(blocks[..., 2:]).reshape(N, -1), d.reshape(N, -1)


class W4A8Linear(RowSlicedLinear):
    """`w4a8`: int8 activations (absmax per 32), weights decoded to int8 per 32-input unit, exact
    integer dots, fp32 rescale by weight scale x activation scale. W4 weights in 16-row tiles on int8
    tensor cores (w4a8_mma_*), GGUF Q8_0, Q4_0, IQ4_XS blocks (and W4 of other row counts) by dp4a
    (int8_gemv_*); either way one kernel for every T, so a verify row has its decode step's bits."""

    route = "w4a8"
    READS = EMIT_INT8

    def __init__(self, weight: W4Weight | BlockMatrix):
        N, K = weight.shape
        self.tensor_cores = isinstance(weight, W4Weight) and N % 16 == 0 and K % GROUP == 0
        if isinstance(weight, W4Weight):
            self.codec, self.weights, self.scales = "w4", cp.asarray(weight.packed).view(cp.uint8), cp.asarray(weight.scales)
            if self.tensor_cores:
                self.splits, self.arrivals = _tile_splits(N, K)
        elif isinstance(weight, BlockMatrix) and weight.qtype in INT8_CODECS:
            self.codec, (self.weights, self.scales) = INT8_CODECS[weight.qtype], (cp.asarray(p) for p in gguf_planes(weight))
        else:
            kind = weight.qtype.name if isinstance(weight, BlockMatrix) else type(weight).__name__
            raise ValueError(f"w4a8 on the GPU runs W4, Q8_0, Q4_0 and IQ4_XS weights, not {kind}")
        self.row_bytes = self.weights.nbytes // N
        self.N, self.K = N, K

    def run_rows(self, x: cp.ndarray | Activations) -> cp.ndarray:
        q, scale = _int8_input(x)
        T = q.shape[0]
        out = cp.empty((T, self.N), cp.float32)
        if self.tensor_cores:
            partial = cp.empty((self.splits, T, self.N), cp.float32) if self.splits > 1 else out  # one split: unread
            kernel("w4a8", "w4a8_mma_t8" if T <= 8 else "w4a8_mma_t16")(
                (self.N // 16, self.splits), (256,),
                (self.weights.view(cp.uint32), self.scales, q, scale, partial, out, self.arrivals, _i32(self.N), _i32(self.K),
                 _i32(T)))
            return out
        kernel("w4a8", f"int8_gemv_{self.codec}_t{_int8_width(T)}")(
            (_blocks(self.N, 8 * INT8_WARP_ROWS),), (256,),
            (self.weights, self.scales, _i64(self.row_bytes), q, scale, out, _i32(self.N), _i32(self.K), _i32(T)))
        return out


class SwiGLUW4A8Linear(W4A8Linear):
    """An MLP's gate | up on w4a8 whose product ends in silu(gate) * up (int8_swiglu_*: a block takes
    32 features' gate and up rows, each sum as int8_gemv makes it; no silu_mul launch), also in the
    forms the down projection reads. `swiglu(x)` is what ops.swiglu asks of it."""

    def __init__(self, linear: W4A8Linear):
        if linear.N % 64:
            raise ValueError(f"a gate | up of {linear.N} rows does not split into blocks of 32 features")
        self.__dict__.update(linear.__dict__)  # the same weights on the card, not a copy

    def __call__(self, x):
        raise TypeError("a SwiGLU gate | up runs through ops.swiglu")

    def swiglu(self, x, forms: int = 0) -> cp.ndarray | Activations:
        """silu(gate) * up [T, N / 2] of x [T, K], also in the emitted `forms` (then Activations)."""
        T, I = x.shape[0], self.N // 2
        q, scale = _int8_input(x)
        out = cp.empty((T, I), cp.float32)
        emit, result = _emitted(out, forms)
        for rows in _row_slices(T):
            t = rows.stop - rows.start
            kernel("w4a8", f"int8_swiglu_{self.codec}_t{_int8_width(t)}")(
                (I // 32,), (256,),
                (self.weights, self.scales, _i64(self.row_bytes), q[rows], scale[rows], out[rows], _i32(I), _i32(self.K),
                 _i32(t), *_emitted_rows(emit, rows)))
        return result


class TrellisLinear(RowSlicedLinear):
    """`w4a8` for trellis weights: activations rotated like the weight and int8 per 128-block, levels
    decoded from the tile streams (1MAD, dp4a), exact block dots, y = row_scale * sum ascale * dot."""

    route = "w4a8"

    def __init__(self, weight: TrellisWeight):
        N, K = weight.shape
        self.packed = cp.asarray(weight.packed)
        self.row_scale = device_f32(weight.row_scale)
        self.signs = device_f32(rotation_signs(K, weight.seed))
        self.k, self.multiplier = weight.k, np.uint32(MULTIPLIERS[weight.k])
        self.N, self.K = N, K

    def run_rows(self, x: cp.ndarray | Activations) -> cp.ndarray:
        q, scale = rotate_quantize_int8(device_f32(x), self.signs)
        T = q.shape[0]
        out = cp.empty((T, self.N), cp.float32)
        kernel("w4a8", "trellis_gemv")((self.N // 16,), (128,),
                                       (self.packed, _i32(self.k), self.multiplier, self.row_scale, q, scale,
                                        out, _i32(self.N), _i32(self.K), _i32(T)))
        return out


def rotate_quantize_int8(x: cp.ndarray, signs: cp.ndarray) -> tuple[cp.ndarray, cp.ndarray]:
    """x [T, K] -> (q int8 [T, K], scale [T, K/128]): engine.quant.trellis.rotated_int8_activations."""
    T, K = x.shape
    q = cp.empty((T, K), cp.int8)
    scale = cp.empty((T, K // 128), cp.float32)
    n_blocks = T * K // 128
    kernel("w4a8", "rotate_quantize_int8")((_blocks(n_blocks, 8),), (256,), (x, signs, q, scale, _i64(n_blocks), _i32(K)))
    return q, scale


class PermutedInput:
    """y = linear(x[:, order]) (see engine.backend.cpu.PermutedInput)."""

    def __init__(self, linear, order: np.ndarray):
        self.linear, self.order = linear, cp.asarray(order)

    @property
    def shape(self) -> tuple[int, int]:
        return self.linear.shape

    def __call__(self, x) -> cp.ndarray:
        return self.linear(device_f32(x)[:, self.order])


# --------------------------------------------------------------------------- row ops ---

def rms_norm(x, weight, eps: float, forms: int = 0) -> cp.ndarray | Activations:
    """x [..., D] / sqrt(mean(x^2) + eps) * weight over the last axis (zero-centred norms pass 1 + w).
    weight [D], or [k, D] when the rows take k weights in turn (Flash-Next's streams: x [T, hc, H], weight [hc, H]).
    With `forms` (x [T, D]), also those forms (then Activations) for the Linear that reads it."""
    x, weight = device_f32(x), device_f32(weight)
    D = x.shape[-1]
    y = cp.empty_like(x)
    emit, normed = _emitted(y, forms)
    kernel("norms", "rms_norm")((x.size // D,), (256,), (x, weight, y, _i32(D), _i32(weight.size // D), _f32(eps), *emit))
    return normed


def add_rms_norm(x, delta, weight, eps: float, forms: int = 0) -> tuple[cp.ndarray, cp.ndarray | Activations]:
    """(x + delta, rms_norm of it with weight [D]) over rows of D [T, D], in one kernel: the residual add
    of a decoder layer and the norm that follows it; the norm also in the emitted `forms` (then
    Activations) for the Linear that reads it."""
    x, delta = device_f32(x), device_f32(delta)
    D = x.shape[-1]
    total, y = cp.empty_like(x), cp.empty_like(x)
    emit, normed = _emitted(y, forms)
    kernel("norms", "add_rms_norm")((x.size // D,), (256,), (x, delta, device_f32(weight), total, y, _i32(D), _f32(eps), *emit))
    return total, normed


def _rows(x) -> tuple[cp.ndarray, int]:
    """A 2-D fp32 input a kernel reads row by row in place, and its row stride in elements: columns
    taken from wider rows cost no copy."""
    if isinstance(x, cp.ndarray) and x.dtype == cp.float32 and x.ndim == 2 and x.strides[1] == 4:
        return x, x.strides[0] // 4
    x = device_f32(x)
    return x, x.shape[1]


def qk_norm_rope(x, weight, inv_freq, start: cp.ndarray, heads: int, head_dim: int, head_stride: int,
                 rotary_dim: int, eps: float, keys=None, key_weight=None, append_to: KVCache | None = None, values=None,
                 cache_start: cp.ndarray | None = None):
    """Attention queries (or any heads): per head zero-centred RMSNorm then partial NeoX RoPE at
    positions start[0] + t. x [T, C] holds head h at columns h * head_stride .. + head_dim; returns
    [T, heads, head_dim]. With keys [T, kv * head_dim] and key_weight, the keys' heads too in the same
    launch: returns (queries, keys [T, kv, head_dim]); with a bf16 cache `append_to` as well, the keys
    and values [T, kv * head_dim] go into it at cache_start[0] + t instead (KVCache.append's rows),
    and the queries alone return. Rows may be wider: the stacked projection's columns, read in place."""
    x, row_stride = _rows(x)
    T = x.shape[0]
    y = cp.empty((T, heads, head_dim), cp.float32)
    if keys is None:
        k, k_stride, k_weight, kv = x, row_stride, weight, 0  # no key blocks: never read
    else:
        (k, k_stride), k_weight = _rows(keys), key_weight
        kv = k.shape[1] // head_dim
    args = (x, k, device_f32(weight), device_f32(k_weight), device_f32(inv_freq), start, y)
    shape = (_i32(head_dim), _i64(row_stride), _i64(k_stride), _i32(heads), _i32(head_stride), _i32(rotary_dim), _f32(eps))
    if append_to is not None:
        v, v_stride = _rows(values)
        kernel("norms", "qk_norm_rope_append_bf16")((heads + kv, T), (head_dim,),
                                                    (*args, *shape, v, _i64(v_stride), append_to.keys, append_to.values,
                                                     cache_start, _i32(append_to.keys.shape[1])))
        append_to.length += T
        return y
    yk = cp.empty((T, kv, head_dim), cp.float32) if kv else y  # no key heads: never written
    kernel("norms", "qk_norm_rope")((heads + kv, T), (head_dim,), (*args, yk, *shape))
    return y if keys is None else (y, yk)


def silu_mul(gate_up, forms: int = 0) -> cp.ndarray | Activations:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I], also in the emitted `forms` (then Activations)
    for the down projection."""
    gate_up = device_f32(gate_up)
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = cp.empty((T, I), cp.float32)
    emit, result = _emitted(out, forms)
    kernel("norms", "silu_mul")((_blocks(out.size, 256),), (256,), (gate_up, out, _i32(I), _i64(out.size), *emit))
    return result


def attention_gate(attn, q_and_gate, head_dim: int, forms: int = 0) -> cp.ndarray | Activations:
    """attn [T, heads * D] times sigmoid of the gate half of q_and_gate [T, heads * 2D] (per head
    [query | gate]; rows may be wider: the stacked projection's, read in place); also in the emitted
    `forms` (then Activations) for o_proj."""
    attn = device_f32(attn)
    q_and_gate, row_stride = _rows(q_and_gate.reshape(q_and_gate.shape[0], -1))
    out = cp.empty_like(attn)
    emit, result = _emitted(out, forms)
    kernel("norms", "attention_gate")((_blocks(out.size, 256),), (256,),
                                      (attn, q_and_gate, out, _i32(head_dim), _i32(attn.shape[1] // head_dim),
                                       _i64(row_stride), _i64(out.size), *emit))
    return result


# -------------------------------------------------------------------------- DeltaNet ---

CONV_RING = 32  # deltanet.cu's: rows of a DeltaNet layer's conv history ring, >= KW - 1 + MAX_ROWS


class DeltaNetState:
    """The conv's history as a ring of positions [CONV_RING, C] (deltanet.cu: a call reads the
    rows before its first position and writes its own, so a rollback needs no copy) and the recurrent
    state [Hv, dk, dv] on the device, with what a rollback of the last short call replays: the state
    before it (`prior`) and each row's inputs to the rule (`row_inputs` [MAX_ROWS, Hv, dk + dv + 2],
    deltanet.cu's ROW_INPUTS) (engine.cache.DeltaNetState). A copy of the state after every row took
    MAX_ROWS states: 2.4 GB at the 27B's 48 layers of 3 MB; this holds one."""

    def __init__(self, channels: int, kernel_size: int, value_heads: int, key_dim: int, value_dim: int):
        if kernel_size - 1 + MAX_ROWS > CONV_RING:
            raise ValueError(f"the GPU's DeltaNet conv takes up to {CONV_RING - MAX_ROWS + 1} taps, this model has {kernel_size}")
        self.ring = cp.zeros((CONV_RING, channels), cp.float32)
        self.recurrent = cp.zeros((value_heads, key_dim, value_dim), cp.float32)
        self.prior = cp.zeros((value_heads, key_dim, value_dim), cp.float32)
        self.row_inputs = cp.zeros((MAX_ROWS, value_heads, key_dim + value_dim + 2), cp.float32)
        self.arrivals = cp.zeros(value_heads, cp.int32)  # a head's column blocks done, 0 between launches

    def keep(self, rows: int) -> None:
        """Make the state after the first `rows` rows of the last launch, fewer than it ran, current: the
        state before it with those rows replayed (deltanet_keep; the ring's rows past them are written
        again when their positions run again)."""
        Hv, dk, dv = self.recurrent.shape
        kernel("deltanet", f"deltanet_keep_dk{dk}")((Hv, dv // 32), (128,),
                                                    (self.prior, self.row_inputs, self.recurrent, _i32(rows), _i32(Hv), _i32(dv)))

    def saved(self) -> tuple:
        """engine.cache.DeltaNetState.saved: the whole ring (the rows before any later position)."""
        return self.ring.copy(), self.recurrent.copy()

    def restore(self, saved: tuple) -> None:
        """Back into the same arrays, which captured cycles read."""
        self.ring[...], self.recurrent[...] = saved


def deltanet(mixed, z, layer, Hk: int, dk: int, state: DeltaNetState, slices, eps: float, sigmoid: bool = False,
             forms: int = 0, b=None, a=None, ba_weight=None, x=None) -> cp.ndarray | Activations:
    """Gated DeltaNet's core for a call's rows, a launch a slice of <= 16 rows (slices: (rows, start)
    pairs, start int32 [1] on the device: the position of the slice's first row): the causal conv, the
    gated delta rule row by row (the last launch, when of more than one row, recording what state.keep
    replays) and the gated norm, in one launch (deltanet.cu).

    mixed [T, 2 Hk dk + Hv dv]: in_proj's q | k | v columns before the conv; z [T, Hv dv]: both columns
    of wider rows, read in place. beta = sigmoid(b), g = decay_rate * softplus(a + dt_bias) from b, a
    [T, Hv] (raw in_proj_b/a outputs, columns of the same wider rows), or from ba_weight [2 Hv, H] bf16
    bits (in_proj_b's rows then in_proj_a's) times x [T, H], multiplied in the launch. layer: its conv
    taps [C, KW], decay_rate, dt_bias and norm weight. Returns norm(o) * silu(z) (sigmoid(z) with
    `sigmoid`) [T, Hv dv], also in the emitted `forms` (then Activations) for out_proj.
    """
    (mixed, in_stride), (z, z_stride) = _rows(mixed), _rows(z)
    T, Hv = mixed.shape[0], layer.decay_rate.shape[0]
    dv = z.shape[1] // Hv
    if dk not in (32, 64, 128) or dv % 32:
        raise ValueError(f"deltanet kernel takes key dims 32, 64, 128 and value dims of 32s, got {dk}, {dv}")
    if ba_weight is None:
        (b, ba_stride), (a, a_stride) = _rows(b), _rows(a)
        if a_stride != ba_stride:  # the kernel takes one stride for both: compact rows of each
            b, a, ba_stride = cp.ascontiguousarray(b), cp.ascontiguousarray(a), b.shape[1]
        ba_weight, x, K = cp.empty(1, cp.uint16), cp.empty((T, 1), cp.float32), 0  # unread stand-ins
    else:
        x, K = device_f32(x), ba_weight.shape[1]
        b = a = cp.empty((T, 1), cp.float32)  # unread stand-ins
        ba_stride = 0
    taps, decay_rate, dt_bias, norm = (device_f32(v) for v in (layer.conv, layer.decay_rate, layer.dt_bias, layer.norm))
    y = cp.empty((T, Hv * dv), cp.float32)
    emit, result = _emitted(y, forms)
    for i, (piece, start) in enumerate(slices):  # each slice writes its rows of y and of the forms it emits
        t = piece.stop - piece.start
        o = cp.empty((t, Hv, dv), cp.float32)
        record = t > 1 and i == len(slices) - 1  # what a rollback into the last launch replays
        kernel("deltanet", f"deltanet_rows_dk{dk}")(
            (Hv, dv // 32), (128,),
            (mixed[piece], taps, state.ring, start, b[piece], a[piece], ba_weight, x[piece] if K else x, _i32(K),
             decay_rate, dt_bias, state.recurrent, _i32(record), state.prior, state.row_inputs, o, z[piece], norm,
             _f32(eps), _i32(sigmoid), y[piece],
             *_emitted_rows(emit, piece), state.arrivals, _i32(t), _i32(Hk), _i32(Hv), _i32(dv), _i32(taps.shape[1]),
             _i64(in_stride), _f32(dk ** -0.5), _i64(ba_stride), _i64(z_stride)))
    return result


# ------------------------------------------------------------------------- attention ---

ATTENTION_CHUNK = 512  # keys per block of a row and head on the q4 cache; longer contexts spread over more blocks
# Keys per block of a row and KV head on the bf16 cache (attention_bf16: one block serves the KV head's
# query heads): a 1k context is 8 chunks, 128 blocks for 4 rows of 4 KV heads. Divides ATTENTION_CHUNK,
# which buckets a captured cycle's keys.
GQA_CHUNK = 128


class KVCache:
    """bf16 keys and values [kv, capacity, head_dim] on the device. query_heads: the attention's, which
    sizes the chunk arrival counts attention_bf16 keeps (one per query row and head) up front, so a
    captured cycle never makes them."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int, query_heads: int = 0):
        self.keys = cp.zeros((kv_heads, capacity, head_dim), cp.uint16)
        self.values = cp.zeros_like(self.keys)
        self.length = 0
        self.signs = cp.ones(head_dim, cp.float32)  # the combine's rotation signs, unread here: no slot is rotated
        self._arrivals = cp.zeros(MAX_ROWS * query_heads, cp.int32)

    def arrivals(self, n: int) -> cp.ndarray:
        """At least n chunk arrival counts, 0 between launches (each launch leaves them so)."""
        if self._arrivals.size < n:
            self._arrivals = cp.zeros(n, cp.int32)
        return self._arrivals

    def append(self, k, v, start: cp.ndarray) -> None:
        """k [T, kv, hd] and v [T, kv * hd] (rows may be wider: read in place) at positions start[0] + t
        (start[0] == self.length)."""
        k, (v, v_stride) = device_f32(k), _rows(v.reshape(v.shape[0], -1))
        T, kv, hd = k.shape
        kernel("attention", "kv_append_bf16")((T, kv), (hd,), (k, v, self.keys, self.values, start,
                                                               _i32(self.keys.shape[1]), _i32(hd), _i64(v_stride)))
        self.length += T

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def reserve(self, rows: int) -> bool:
        """Room for positions 0 .. rows - 1 (capacity at least doubles); True when the arrays moved."""
        if rows <= self.keys.shape[1]:
            return False
        self.keys, self.values = (_grown(a, rows, self.length) for a in (self.keys, self.values))
        return True


def _grown(array: cp.ndarray, rows: int, length: int, axis: int = 1) -> cp.ndarray:
    """array with its capacity axis (1: [kv, capacity, ...]) at max(rows, 2 x capacity), rows 0 ..
    length - 1 kept."""
    shape = list(array.shape)
    shape[axis] = max(rows, 2 * shape[axis])
    grown = cp.zeros(tuple(shape), array.dtype)
    kept = (slice(None),) * axis + (slice(0, length),)
    grown[kept] = array[kept]
    return grown


class Q4KVCache:
    """engine.cache.Q4KVCache on the device: codes and f16 scales per 32 of the rotated rows, exact
    fp32 sink rows and a ring of the latest RECENT_ROWS + MAX_ROWS rows. Keys and values are kept
    in separate arrays."""

    def __init__(self, kv_heads: int, head_dim: int, capacity: int, seed: int = 0):
        self.signs = device_f32(np.random.default_rng(seed).choice([-1.0, 1.0], head_dim).astype(np.float32))
        self.key_codes = cp.zeros((kv_heads, capacity, head_dim // 2), cp.uint8)
        self.value_codes = cp.zeros_like(self.key_codes)
        self.key_scales = cp.zeros((kv_heads, capacity, head_dim // Q4_GROUP), cp.uint16)
        self.value_scales = cp.zeros_like(self.key_scales)
        self.sink_keys = cp.zeros((kv_heads, SINK_ROWS, head_dim), cp.float32)
        self.sink_values = cp.zeros_like(self.sink_keys)
        self.ring_rows = RECENT_ROWS + MAX_ROWS
        self.ring_keys = cp.zeros((kv_heads, self.ring_rows, head_dim), cp.float32)
        self.ring_values = cp.zeros_like(self.ring_keys)
        self.length = 0

    def append(self, k, v, start: cp.ndarray) -> None:
        """KVCache.append's rows, coded."""
        k, (v, v_stride) = device_f32(k), _rows(v.reshape(v.shape[0], -1))
        T, kv, hd = k.shape
        kernel("attention", "kv_append_q4")((T, kv, 2), (hd,),
                                            (k, v, self.signs, self.key_codes, self.key_scales, self.value_codes,
                                             self.value_scales, self.sink_keys, self.sink_values, self.ring_keys,
                                             self.ring_values, _i32(self.ring_rows), start,
                                             _i32(self.key_codes.shape[1]), _i32(hd), _i64(v_stride)))
        self.length += T

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def reserve(self, rows: int) -> bool:
        """Room for positions 0 .. rows - 1 in the coded arrays (the sink and ring are fixed)."""
        if rows <= self.key_codes.shape[1]:
            return False
        self.key_codes, self.value_codes, self.key_scales, self.value_scales = (
            _grown(a, rows, self.length) for a in (self.key_codes, self.value_codes, self.key_scales, self.value_scales))
        return True


def attend(q, cache: KVCache | Q4KVCache, start: cp.ndarray, past: int, gates=None, forms: int = 0):
    """Causal GQA of q [T, heads, hd] (T <= 16; row t at position start[0] + t, whose KV rows the
    cache already holds) -> [T, heads * hd]. `past` = start[0] on the host, to size the grid. With
    gates (q_and_gate [T, heads * 2 hd], rows may be wider): times sigmoid of each head's gate, and
    in the emitted `forms` (then Activations), as attention_gate would give it."""
    q = device_f32(q)
    T, heads, hd = q.shape
    scale = _f32(hd ** -0.5)
    end = past + T
    if isinstance(cache, KVCache):  # partials and combine in one launch, a block serving a KV head's query heads
        kv, capacity = cache.keys.shape[0], cache.keys.shape[1]
        chunks = _blocks(end, GQA_CHUNK)
        part_ml = cp.empty((T, heads, chunks, 2), cp.float32)
        part_acc = cp.empty((T, heads, chunks, hd), cp.float32)
        out, tail, result = _combine_outputs(T, heads * hd, gates, forms)
        kernel("attention", f"attention_bf16_hd{hd}")(
            (chunks, kv, T), (128,),
            (q, cache.keys, cache.values, _i32(capacity), start, _i32(heads), _i32(kv), _i32(GQA_CHUNK), scale,
             part_ml, part_acc, cache.arrivals(T * kv), out, *tail))
        return result
    else:
        kv, capacity = cache.key_codes.shape[0], cache.key_codes.shape[1]
        exact_chunks = _blocks(SINK_ROWS + RECENT_ROWS, ATTENTION_CHUNK)
        q4_chunks = max(1, _blocks(max(0, end - RECENT_ROWS - SINK_ROWS), ATTENTION_CHUNK))
        n_plain, n_slots = exact_chunks, exact_chunks + q4_chunks
        part_ml = cp.empty((T, heads, n_slots, 2), cp.float32)
        part_acc = cp.empty((T, heads, n_slots, hd), cp.float32)
        kernel("attention", f"attention_partial_exact_hd{hd}")(
            (exact_chunks, heads, T), (128,),
            (q, cache.sink_keys, cache.sink_values, cache.ring_keys, cache.ring_values, _i32(cache.ring_rows), start,
             _i32(heads), _i32(kv), _i32(ATTENTION_CHUNK), scale, part_ml, part_acc, _i32(n_slots)))
        kernel("attention", f"attention_partial_q4_hd{hd}")(
            (q4_chunks, heads, T), (128,),
            (q, cache.signs, cache.key_codes, cache.key_scales, cache.value_codes, cache.value_scales, _i32(capacity),
             start, _i32(heads), _i32(kv), _i32(ATTENTION_CHUNK), scale, part_ml, part_acc, _i32(exact_chunks),
             _i32(n_slots)))
    return _combined(part_ml, part_acc, cache.signs, n_plain, n_slots, gates, forms)


def _combined(part_ml: cp.ndarray, part_acc: cp.ndarray, signs: cp.ndarray, n_plain: int, n_slots: int, gates=None,
              forms: int = 0) -> cp.ndarray | Activations:
    """The partials' slots [T, heads, n_slots, ...] combined (the rotated ones, from n_plain on, unrotated) -> [T, heads * hd],
    gated and in the emitted forms with gates (attend)."""
    T, heads, _, hd = part_acc.shape
    out, tail, result = _combine_outputs(T, heads * hd, gates, forms)
    kernel("attention", "attention_combine")((heads, T), (hd,),
                                             (part_ml, part_acc, signs, out, _i32(hd), _i32(n_plain), _i32(n_slots), *tail))
    return result


def _combine_outputs(T: int, width: int, gates, forms: int) -> tuple[cp.ndarray, tuple, cp.ndarray | Activations]:
    """A combine's output out [T, width], the arguments after it (gates with their row stride, whether
    to gate, the emit arguments: forms only with gates) and what the call returns."""
    out = cp.empty((T, width), cp.float32)
    gate_rows, gate_stride = _rows(gates.reshape(T, -1)) if gates is not None else (out, 0)  # ungated: unread
    emit, result = _emitted(out, forms if gates is not None else 0)
    return out, (gate_rows, _i64(gate_stride), _i32(gates is not None), *emit), result


# ------------------------------------------------------------------------ Flash-Next ---
# engine/flash_next.py's steps (FlashCpuOps there is the reference), engine/kernels/flash_next.cu.

def silu_div(x, divisor: int) -> cp.ndarray:
    """silu(x / divisor), elementwise."""
    x = device_f32(x)
    out = cp.empty_like(x)
    kernel("flash_next", "silu_div")((_blocks(x.size, 256),), (256,), (x, out, _f32(divisor), _i64(x.size)))
    return out


def hc_mix(normed, logits, hc: int) -> cp.ndarray:
    """The mean over streams of sigmoid(logits) * normed, both [T, hc * H] -> [T, H]."""
    normed, logits = device_f32(normed), device_f32(logits)
    T, H = normed.shape[0], normed.shape[1] // hc
    mixed = cp.empty((T, H), cp.float32)
    kernel("flash_next", "hc_mix")((_blocks(mixed.size, 256),), (256,), (normed, logits, mixed, _i32(H), _i32(hc), _i64(mixed.size)))
    return mixed


def hc_inject(streams, out, logits, hc: int) -> cp.ndarray:
    """Each stream of streams [T, hc * H] plus out [T, H] times 2 sigmoid(logits / hc), logits [T, hc]."""
    streams, out, logits = device_f32(streams), device_f32(out), device_f32(logits)
    injected = cp.empty_like(streams)
    kernel("flash_next", "hc_inject")((_blocks(streams.size, 256),), (256,),
                                      (streams, out, logits, injected, _i32(out.shape[1]), _i32(hc), _i64(streams.size)))
    return injected


def ple_gate(key, query, value, hc: int) -> cp.ndarray:
    """value [T, H] into each stream, weighed by the sign-sqrt gate of key . query per stream (both [T, hc * H])."""
    key, query, value = device_f32(key), device_f32(query), device_f32(value)
    T, H = value.shape
    gated = cp.empty((T, hc * H), cp.float32)
    kernel("flash_next", "ple_gate")((T * hc,), (256,), (key, query, value, gated, _i32(H), _i32(hc), _f32(np.sqrt(H))))
    return gated


def ple_conv(gated, normed, taps, dilation: int, state) -> cp.ndarray:
    """gated + silu of the dilated causal conv of normed [T, C] (taps [C, K]) after state.conv's inputs; the
    state advanced, a short call's window kept for a rollback (engine.cache.PLEState, its conv on the device)."""
    gated, normed = device_f32(gated), device_f32(normed)
    T, C = normed.shape
    window = cp.empty((state.conv.shape[0] + T, C), cp.float32)
    out = cp.empty((T, C), cp.float32)
    kernel("flash_next", "ple_conv")((_blocks(C, 256),), (256,), (normed, device_f32(taps), state.conv, window, gated, out,
                                                                  _i32(T), _i32(C), _i32(taps.shape[1]), _i32(dilation)))
    state.conv_window = window if T <= MAX_ROWS else None
    state.conv = window[T:].copy()
    return out


class IndexedKVCache:
    """engine.cache.IndexedKVCache on the device: the attention cache `kv` (KVCache or Q4KVCache), the
    indexer's raw keys [capacity, d] and the pooled key of every complete block of `ratio` rows
    [capacity / ratio + 1, d], pooled once, as its block completes. `length` is kv's; setting it (a
    rollback) forgets the blocks past it."""

    def __init__(self, kv, index_dim: int, ratio: int, capacity: int):
        self.kv, self.ratio = kv, ratio
        self.raw = cp.zeros((capacity, index_dim), cp.float32)
        self.blocks = cp.zeros((capacity // ratio + 1, index_dim), cp.float32)
        self.done_blocks = 0

    @property
    def length(self) -> int:
        return self.kv.length

    @length.setter
    def length(self, length: int) -> None:
        self.kv.length = length
        self.done_blocks = min(self.done_blocks, length // self.ratio)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def reserve(self, rows: int) -> bool:
        """Room for positions 0 .. rows - 1; True when an array moved."""
        moved = self.kv.reserve(rows)
        if rows <= self.raw.shape[0]:
            return moved
        self.raw = _grown(self.raw, rows, self.length, axis=0)
        self.blocks = _grown(self.blocks, rows // self.ratio + 1, self.done_blocks, axis=0)
        return True

    def append_index_keys(self, raw, at: int, pool) -> None:
        """Raw index keys [t, d] of cache rows at .. at + t - 1; pool(first_block, n) pools the n blocks they complete."""
        end = at + raw.shape[0]
        self.raw[at:end] = raw
        complete = end // self.ratio
        if complete > self.done_blocks:
            pool(self.done_blocks, complete - self.done_blocks)
            self.done_blocks = complete


def pool_index_blocks(cache: IndexedKVCache, first_block: int, n: int, k_norm, inv_freq, rotary_dim: int, offset: int,
                      eps: float) -> None:
    """Blocks first_block .. + n of the cache's raw keys pooled into cache.blocks: mean, norm, RoPE at the
    block's first position (its first cache row + offset)."""
    kernel("flash_next", "index_pool")((n,), (cache.raw.shape[1],),
                                       (cache.raw, device_f32(k_norm), device_f32(inv_freq), cache.blocks, _i32(first_block),
                                        _i32(cache.ratio), _i32(rotary_dim), _i32(offset), _f32(eps)))


def qsa_select(q, blocks, start: cp.ndarray, past: int, ratio: int, top_blocks: int) -> tuple[cp.ndarray, cp.ndarray]:
    """The cache rows each query row reads, q [T, heads, d] the indexer's queries of cache rows start[0] + t
    (`past` = start[0] on the host, to size the buffers), blocks [>= (past + T) / ratio, d] the pooled keys:
    selected int32 [T, width] (ascending, the first counts[t] of row t) and counts int32 [T]."""
    q = device_f32(q)
    T, heads, d = q.shape
    n_blocks = max(1, (past + T) // ratio)
    scores = cp.empty((T, n_blocks), cp.float32)
    kernel("flash_next", "index_scores")((_blocks(n_blocks, 8), T), (256,),
                                         (q, blocks, start, scores, _i32(heads), _i32(d), _i32(ratio), _i32(n_blocks)))
    width = min(past + T, (top_blocks + 1) * ratio - 1)  # top blocks and a tail, or every row while fewer blocks are complete
    selected = cp.empty((T, width), cp.int32)
    counts = cp.empty(T, cp.int32)
    kernel("flash_next", "qsa_select")((T,), (256,), (scores, start, selected, counts, _i32(n_blocks), _i32(ratio),
                                                      _i32(top_blocks), _i32(width)))
    return selected, counts


def attend_selected(q, cache: KVCache | Q4KVCache, start: cp.ndarray, selected: cp.ndarray, counts: cp.ndarray,
                    gates=None, forms: int = 0):
    """QSA's sparse attention: q [T, heads, hd] (row t the cache's row start[0] + t, already in it) over the
    cache rows selected[t, :counts[t]] -> [T, heads * hd]; gates, forms: as attend's."""
    q = device_f32(q)
    T, heads, hd = q.shape
    width, scale = selected.shape[1], _f32(hd ** -0.5)
    if isinstance(cache, KVCache):
        kv, capacity = cache.keys.shape[0], cache.keys.shape[1]
        n_plain = n_slots = _blocks(width, ATTENTION_CHUNK)
        part_ml = cp.empty((T, heads, n_slots, 2), cp.float32)
        part_acc = cp.empty((T, heads, n_slots, hd), cp.float32)
        kernel("attention", f"sparse_attention_partial_bf16_hd{hd}")(
            (n_slots, heads, T), (128,),
            (q, cache.keys, cache.values, _i32(capacity), selected, counts, _i32(width), _i32(heads), _i32(kv),
             _i32(ATTENTION_CHUNK), scale, part_ml, part_acc, _i32(n_slots)))
        return _combined(part_ml, part_acc, cache.signs, n_plain, n_slots, gates, forms)
    kv, capacity = cache.key_codes.shape[0], cache.key_codes.shape[1]
    n_plain = _blocks(SINK_ROWS + RECENT_ROWS, ATTENTION_CHUNK)
    n_slots = n_plain + _blocks(width, ATTENTION_CHUNK)
    part_ml = cp.empty((T, heads, n_slots, 2), cp.float32)
    part_acc = cp.empty((T, heads, n_slots, hd), cp.float32)
    kernel("attention", f"sparse_attention_partial_exact_hd{hd}")(
        (n_plain, heads, T), (128,),
        (q, cache.sink_keys, cache.sink_values, cache.ring_keys, cache.ring_values, _i32(cache.ring_rows), start, selected,
         counts, _i32(width), _i32(heads), _i32(kv), _i32(ATTENTION_CHUNK), scale, part_ml, part_acc, _i32(n_slots)))
    kernel("attention", f"sparse_attention_partial_q4_hd{hd}")(
        (n_slots - n_plain, heads, T), (128,),
        (q, cache.signs, cache.key_codes, cache.key_scales, cache.value_codes, cache.value_scales, _i32(capacity), start,
         selected, counts, _i32(width), _i32(heads), _i32(kv), _i32(ATTENTION_CHUNK), scale, part_ml, part_acc,
         _i32(n_plain), _i32(n_slots)))
    return _combined(part_ml, part_acc, cache.signs, n_plain, n_slots, gates, forms)
