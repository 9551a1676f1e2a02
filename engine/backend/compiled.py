"""Compiled CPU kernels (numba): every route's Linear reading each weight once for all the token
rows of a call, with each row's result bit-identical however many rows run.

The numpy Linears of engine/backend/cpu.py are the readable reference; these compute the same
route numerics (DESIGN.md contracts) in another summation order, stated per kernel. Speed comes
from the layouts and from sharing each weight read between the token rows:

- Units laid out position-major. A quantized matrix is repacked once at load into `UnitPlanes`:
  for each unit of `unit` inputs that shares one weight scale (128 for trellis and for W4 in
  w4a16's portable loops), position j of every unit is stored side by side, and R weight rows
  side by side too (codes [N / R, unit, U * R]). The dot products of all units of R rows then grow
  together, one vector op per position, with no horizontal sum per unit; each unit's scale is
  applied once at the end.
- W4 and every GGUF block type on w4a8 are laid out the other way round (`RowPlanes`): a unit's 16
  weight rows side by side in one vector, each row's four bytes of a quad in its int32 lane, so one
  activation quad broadcast to all lanes serves 16 rows. The activations stay as quantized, one
  byte a level (the position-major layout repeats them for each of the R rows), a tile of 8 token
  rows shares each weight load, and a call of any length reads each weight once: 2.6-4.1x the
  position-major kernels' speed from 4 token rows up (0.8B shapes, two cores).
- The token rows share the weight read. In the UnitPlanes kernels a group of weight rows is read
  from memory once and stays in L1 while each of the T <= 16 token rows runs the same code against
  it (longer calls run in tiles of 16 rows); integer dots are exact and every fp32 sum runs in a
  fixed order per token row, so a token row gets the same bits whether it is alone (a decode step)
  or one of k + 1 verify rows. That keeps exact acceptance exact.

Threads: the kernels release the GIL and take a range of weight rows, so engine/backend/threads.py
splits a product's rows between the cores; a weight row's result does not depend on the split.
Compiled machine code is cached on disk (platformdirs cache, `numba/<digest of the kernel sources>`:
kernel_cache_dir), so only the first run after an install or upgrade compiles (about a second a
kernel). Without numba the numpy Linears run, and `unavailable()` says why in one line.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import platformdirs
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from duet.engine.backend import MAX_ROWS, cpu
from duet.engine.backend.threads import in_compiled_parts, in_parallel
from duet.engine.quant.activation import ACT_BLOCK, INT8_MAX, round_to_bf16
from duet.engine.quant.gguf_blocks import BlockMatrix
from duet.engine.quant.trellis import TrellisWeight, rotated_int8_activations
from duet.engine.quant.w4 import GROUP, W4Weight
from duet.engine.checkpoint.safetensors import bf16_to_f32, release_file_pages
from duet.engine.weights import BF16Matrix

STALE_CACHE_SECONDS = 86400  # another version's kernel folder untouched this long is removed


def kernel_cache_dir(root: Path, sources: Sequence[Path]) -> Path:
    """root/<digest of the sources' bytes>, made where missing; then the other folders in root (other
    versions' kernels) that nothing has written to for STALE_CACHE_SECONDS are removed: not at once,
    as a duet of another version may be running from one. numba checks a cached kernel against its
    own file alone, so a kernel calling one from another file (compiled_sampling's drafting kernel
    runs this module's MTP pass) kept that file's old code, inlined, after the file changed; one
    folder per version of all kernel sources cannot."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.read_bytes())
    folder = root / digest.hexdigest()[:16]
    if not folder.is_dir():
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:  # no cache folder can be made there: numba finds another place, or compiles every run
            return folder
        now = time.time()
        for other in root.iterdir():
            try:
                stale = other != folder and now - other.stat().st_mtime > STALE_CACHE_SECONDS
            except OSError:  # removed meanwhile by another process
                continue
            if stale:
                shutil.rmtree(other, ignore_errors=True)
    return folder


_ENGINE = Path(__file__).parents[1]
# Every file with kernels, and those whose constants the kernels take in as they compile (ACT_BLOCK, GROUP)
KERNEL_SOURCES = [_ENGINE / "backend" / name for name in ("compiled.py", "compiled_sampling.py")] + [
    _ENGINE / "quant" / name for name in ("activation.py", "w4.py")]
CACHE_DIR = kernel_cache_dir(Path(platformdirs.user_cache_dir("duet")) / "numba", KERNEL_SOURCES)
KERNELS_ENV = "DUET_CPU_KERNELS"  # "numpy" runs the numpy reference Linears instead
# Products smaller than this many weights run whole on the calling thread. Handing a part to a Python
# worker cost ~40 us (the bound was 2^20 then); a region of numba's threads starts in 2-5 us: a w4a8
# [256, 256] product took 7.6 us a token row split, 9.4 whole.
SPLIT_MIN_WEIGHTS = 1 << 16
# The fp32-lane kernels (_bf16_lanes, _w4a16_lanes) do a weight's work in far less time than the int8
# ones: they split from this many multiply-adds (weights x token rows). Measured on two cores, a row
# of [512, 512] 3.6 us whole, 5.2 split; of [4096, 256] 23.7 whole, 12.1 split; the break-even was
# between 2^18 and 2^19 in every shape of the demo's.
SPLIT_MIN_PRODUCTS = 1 << 19


_CPU_FEATURES: set[str] = set()  # the CPU features the kernels are compiled for (avx2, avx512vnni, ...)


def _load_numba():
    """numba, with its on-disk cache pointed at ours; None when it cannot be imported."""
    os.environ.setdefault("NUMBA_CACHE_DIR", str(CACHE_DIR))
    try:
        import llvmlite.binding
    except ImportError:
        return None
    features = llvmlite.binding.get_host_cpu_features()
    if all(features.get(f) for f in ("avx512f", "avx512bw", "avx512vl")):
        # LLVM vectorizes with 256-bit registers on AVX-512 CPUs unless told otherwise (for the clock
        # drop of older Xeons). Full-width vectors, measured on one Emerald Rapids core: the Q4_0
        # 3584 x 1024 w4a8 product 323-435 -> 290-295 us a token row; bf16 [1024, 256] 16.6 -> 13.4 us.
        os.environ.setdefault("NUMBA_CPU_FEATURES", features.flatten() + ",-prefer-256-bit")
    # what the kernels are compiled for: the features numba is told (a user's NUMBA_CPU_FEATURES too)
    target = os.environ.get("NUMBA_CPU_FEATURES", features.flatten())
    _CPU_FEATURES.update(feature[1:] for feature in target.split(",") if feature.startswith("+"))
    try:
        import numba
    except ImportError:
        return None
    numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]  # where numba was imported first, it read no folder
    return numba


_numba = _load_numba()


def unavailable() -> str | None:
    """Why the compiled kernels are not used (one line), or None when they are."""
    if os.environ.get(KERNELS_ENV, "compiled") == "numpy":
        return f"{KERNELS_ENV}=numpy: the numpy reference Linears run"
    if _numba is None:
        return "numba is not installed: the numpy reference Linears run (pip install numba for ~10x faster CPU decoding)"
    return None


def int8_dot_kernels() -> list[str]:
    """The integer-dot kernel families this CPU runs, the default first: "vnni" (AVX512-VNNI's
    vpdpbusd, 64 byte products an instruction) where the CPU has it, else "avx2" (vpmaddubsw and
    vpmaddwd, 32 byte products in two instructions) where it has AVX2, and always "generic" (plain
    loops that LLVM vectorizes). Their integer dots are exact, so all give the same bits."""
    if {"avx512f", "avx512bw", "avx512vl", "avx512vnni"} <= _CPU_FEATURES:
        return ["vnni", "generic"]
    return ["avx2", "generic"] if "avx2" in _CPU_FEATURES else ["generic"]


def w4a16_kernels() -> list[str]:
    """The w4a16 product kernel families this CPU runs, the default first: "avx512" (W4A16Lanes: a
    block of 32 weight rows' levels from one 16-byte load into fp32 lanes, fused multiply-adds)
    where the CPU has AVX-512, and always "generic" (W4A16Linear's unit planes, plain loops). Both
    sum each group in k order and the groups in order, so they give the same bits."""
    return ["avx512", "generic"] if {"avx512f", "avx512bw", "avx512vl", "fma"} <= _CPU_FEATURES else ["generic"]


def bf16_dot_kernels() -> list[str]:
    """The bf16 x fp32 product kernel families this CPU runs, the default first: "avx512" (weight
    rows in the lanes of 512-bit vectors, one fused multiply-add chain over k per row: _bf16_lanes)
    where the CPU has AVX-512, and always "generic" (_dense_bf16). Both keep a row's bits however
    many token rows run; their summation orders differ, each within the fp32 sum bound."""
    return ["avx512", "generic"] if {"avx512f", "avx512bw", "avx512vl", "fma"} <= _CPU_FEATURES else ["generic"]


def kernel_jit(fastmath: bool = False, inline: str = "never"):
    """numba's njit for our kernels: no GIL, cached on disk, and numpy's error model (a float division
    by zero gives inf, as in numpy: Python's ZeroDivisionError check in a loop stops LLVM vectorizing it)."""
    if not _numba:
        return lambda f: f
    return _numba.njit(nogil=True, cache=True, fastmath=fastmath, inline=inline, error_model="numpy")


def parts_driver(kernel):
    """The driver that runs kernel(*args, lo, hi) over [0, n) cut into `parts` contiguous ranges on
    numba's threads at once: driver(args, n, parts). Each range runs the kernel's own code, so every
    item has the bits of a whole run. None without numba."""
    return _PARTS_DRIVERS.get(kernel)


_SEEN_SPLITS: list | None = None  # while compile_kernels runs: (kernel, args, n) of every split_kernel call


def split_kernel(kernel, args: tuple, n: int, split: bool = True) -> None:
    """kernel(*args, lo, hi) over [0, n), in parts on numba's threads when `split` (threads.in_compiled_parts)."""
    if _SEEN_SPLITS is not None:
        _SEEN_SPLITS.append((kernel, args, n))
    if not split:  # most of a small model's products: straight to the kernel (~1 us of calls less, ~40 a step)
        kernel(*args, 0, n)
        return
    in_compiled_parts(parts_driver(kernel), kernel, args, n)


# The int8 kernels in quads (vpdpbusd's layout) run this CPU's family: a column is the lanes one vector
# holds (16 int32 lanes of 64 bytes for vpdpbusd, 8 of 32 bytes on AVX2), QUAD_BLOCK columns are summed
# side by side, one accumulator register each: 8 columns read 256 (AVX2) or 512 bytes of a plane row in
# a run, which kept a 65,536 x 1024 product at one row streaming (2 columns on AVX2: 0.77x the generic
# loops there; 8: 1.30x; vpdpbusd 4 -> 8 columns: no loss). Byte planes hold level + QUAD_BIAS:
# vpdpbusd multiplies unsigned by signed bytes (+ 128), AVX2's sign trick takes the signed level itself.
QUAD_FAMILY = int8_dot_kernels()[0]
QUAD_COLUMN = 16 if QUAD_FAMILY == "vnni" else 8
QUAD_BLOCK = 8
QUAD_BIAS = 128 if QUAD_FAMILY == "vnni" else 0


# ---------------------------------------------------------------------------------------------
# Kernels. Shapes: N weight rows in G groups of R rows; U units a row, L = U * R lanes a group
# (lane v * R + r is unit v of the group's row r); T <= 16 token rows, x repeated R times along the
# lanes; [lo, hi) is this thread's share of groups; out [T, N] fp32. Putting R rows side by side
# makes the vector loops long enough to pay for themselves (K = 1024 has only 32 units a row).
# Integer products are cast back to their narrow type at each step so that LLVM keeps them narrow
# (numba widens integer arithmetic to int64, which turns a 16-lane multiply-add into 4-lane ones).
# Integer dots are exact, so the order their terms fold in does not matter; only the fp32 sums'
# order does, and it is fixed by the matrix's shape alone.


def unit_scales(row, scratch):
    """A group's unit scales as fp32: the row itself when it is fp32, or its f16 bits decoded into
    scratch (uint32 [L], returned seen as fp32). Compiled per dtype (numba's overload below); this
    plain version serves numpy callers and tests."""
    return row if row.dtype == np.float32 else row.view(np.float16).astype(np.float32)


def group_scales(scale, block_scales, g, scratch):
    """RowPlanes group g's scales as rows_tile reads them: (scales, d). fp32 unit scales [U * 16]
    (unit v's row r at v * 16 + r: scale[g] itself, or its f16 bits decoded into scratch) and no d;
    or a K-quant's int8 scale codes as they are and its blocks' d and dmin decoded into scratch as fp32
    [B * 32] (block b's d of row r at 32 b + r, dmin at 32 b + 16 + r). Compiled per dtype (numba's
    overload below); this plain version serves numpy callers and tests. scratch uint32 [>= U * 16]."""
    if scale.dtype == np.int8:
        return scale[g], unit_scales(block_scales[g], scratch[: block_scales.shape[1]])
    return unit_scales(scale[g], scratch[: scale.shape[1]]), scratch[:0].view(np.float32)


@kernel_jit(inline="always")
def unit_scale_of(group_scale, block_d, v, r, per_block):
    """Unit v's scale of row r as rows_tile makes it from group_scales' (scales, d): the fp32 value,
    or a K-quant's code times its block's d (per_block units a block)."""
    if block_d.shape[0] == 0:
        return np.float32(group_scale[v * ROWS + r])
    return block_d[v // per_block * 2 * ROWS + r] * np.float32(group_scale[v * ROWS + r])


@kernel_jit()
def decode_f16_bits(row, scratch):
    """f16 bits -> fp32 (scratch uint32 [n], returned seen as fp32), exactly, in integer arithmetic:
    unit_scales on CPUs without F16C. No fp32 subnormal operand (one costs the core a slow microcode
    assist): sign, exponent and mantissa move to fp32's places, the exponent rebiased (+112; all ones
    for an infinity or NaN; zeros stay zero). f16 subnormals, rare in scales, then get a second
    pass: mantissa * 2^-24. Where the CPU has F16C, widen_f16 converts 16 a vcvtph2ps: a Q4_0
    decode group's scales took 78 ns this way, ~9 ns so (one core, 256 scales)."""
    subnormals = np.uint32(0)
    for i in range(row.shape[0]):
        bits = np.uint32(row[i])
        exponent = bits & np.uint32(0x7C00)
        rebias = np.uint32(224 << 23) if exponent == np.uint32(0x7C00) else np.uint32(112 << 23)
        rebias = rebias if exponent != np.uint32(0) else np.uint32(0)
        magnitude = ((bits & np.uint32(0x7FFF)) << np.uint32(13)) + rebias
        scratch[i] = magnitude | ((bits & np.uint32(0x8000)) << np.uint32(16))
        subnormals |= bits & np.uint32(0x3FF) if exponent == np.uint32(0) else np.uint32(0)
    values = scratch.view(np.float32)
    for i in range(values.shape[0] if subnormals else 0):
        bits = np.uint32(row[i])
        if bits & np.uint32(0x7C00) == np.uint32(0):
            small = np.float32(bits & np.uint32(0x3FF)) * np.float32(2.0**-24)
            values[i] = -small if bits & np.uint32(0x8000) else small
    return values


if _numba:
    import llvmlite.ir
    from numba.extending import intrinsic, overload

    @intrinsic
    def widen_f16(typingctx, row, scratch):
        """In compiled code: scratch[i] = the fp32 bits of the f16 bits row[i], exactly (subnormals,
        infinities and NaNs included), 16 at a time through LLVM's fpext of half vectors (one
        vcvtph2ps where the CPU has F16C), the last few one by one. row uint16, scratch uint32: 1-D
        C arrays of one length."""
        types = _numba.types
        if (row.dtype, scratch.dtype) != (types.uint16, types.uint32):
            return None

        def codegen(context, builder, signature, args):
            from numba.core import cgutils

            ir = llvmlite.ir
            intp = context.get_value_type(types.intp)
            source, target = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args))
            n = cgutils.unpack_tuple(builder, source.shape, 1)[0]
            sixteen = ir.Constant(intp, 16)

            def widen(width: int, at) -> None:
                halves, floats = ir.VectorType(ir.HalfType(), width), ir.VectorType(ir.FloatType(), width)
                value = builder.load(builder.bitcast(builder.gep(source.data, [at]), halves.as_pointer()), align=2)
                builder.store(builder.fpext(value, floats), builder.bitcast(builder.gep(target.data, [at]), floats.as_pointer()), align=4)

            vectors = builder.sdiv(n, sixteen)
            with cgutils.for_range(builder, vectors) as loop:
                widen(16, builder.mul(loop.index, sixteen))
            with cgutils.for_range(builder, builder.sub(n, builder.mul(vectors, sixteen))) as loop:
                widen(1, builder.add(builder.mul(vectors, sixteen), loop.index))
            return context.get_dummy_value()

        return types.void(row, scratch), codegen

    @overload(unit_scales, jit_options={"nogil": True})
    def _unit_scales_compiled(row, scratch):
        if row.dtype != _numba.types.uint16:
            return lambda row, scratch: row
        if "f16c" in _CPU_FEATURES:  # else LLVM would widen each half through a library call

            def widen(row, scratch):
                widen_f16(row, scratch)
                return scratch.view(np.float32)

            return widen

        return lambda row, scratch: decode_f16_bits(row, scratch)

    @overload(group_scales, jit_options={"nogil": True})
    def _group_scales_compiled(scale, block_scales, g, scratch):
        if scale.dtype == _numba.types.int8:
            return lambda scale, block_scales, g, scratch: (scale[g], unit_scales(block_scales[g], scratch[: block_scales.shape[1]]))
        return lambda scale, block_scales, g, scratch: (unit_scales(scale[g], scratch[: scale.shape[1]]), scratch[:0].view(np.float32))

    @intrinsic
    def as_float32(typingctx, bits):
        """In compiled code: the fp32 whose bit pattern is the low 32 bits of the unsigned integer
        `bits` (numba widens uint32 arithmetic to uint64), a reinterpretation in the register that
        LLVM vectorizes, no conversion."""
        if not isinstance(bits, _numba.types.Integer) or bits.signed or bits.bitwidth < 32:
            return None

        def codegen(context, builder, signature, args):
            low = builder.trunc(args[0], llvmlite.ir.IntType(32)) if bits.bitwidth > 32 else args[0]
            return builder.bitcast(low, llvmlite.ir.FloatType())

        return _numba.types.float32(bits), codegen

    def _tally_at(context, builder, signature, args):
        """The address of tally[index] (an int64 array's element) in compiled code."""
        from numba.core import cgutils

        tally = context.make_array(signature.args[0])(context, builder, args[0])
        return cgutils.get_item_pointer(context, builder, signature.args[0], tally, [args[1]], wraparound=False)

    @intrinsic
    def tally_add(typingctx, tally, index):
        """In compiled code: tally[index] += 1 as one atomic step (sequentially consistent), giving the
        count before it: threads that add at once each get a count of their own (a team's claims)."""
        if not isinstance(tally, _numba.types.Array) or tally.dtype != _numba.types.int64:
            return None

        def codegen(context, builder, signature, args):
            one = llvmlite.ir.Constant(llvmlite.ir.IntType(64), 1)
            return builder.atomic_rmw("add", _tally_at(context, builder, signature, args), one, "seq_cst")

        return _numba.types.int64(tally, _numba.types.intp), codegen

    @intrinsic
    def tally_read(typingctx, tally, index):
        """In compiled code: tally[index], read as an atomic acquire: whatever a thread wrote before its
        tally_add is seen by the thread that reads the count it made. LLVM keeps every such read in a
        loop (a plain read it would read once)."""
        if not isinstance(tally, _numba.types.Array) or tally.dtype != _numba.types.int64:
            return None

        def codegen(context, builder, signature, args):
            return builder.load_atomic(_tally_at(context, builder, signature, args), "acquire", 8)

        return _numba.types.int64(tally, _numba.types.intp), codegen

    @intrinsic
    def next_uniform(typingctx, bitgen):
        """In compiled code: the next value numpy's Generator.random() would give, drawn from the bit
        generator itself: `bitgen` is the address of its bitgen_t (BitGenerator.ctypes.bit_generator),
        whose fields are pointers, {state, next_uint64, next_uint32, next_double, next_raw}. Calling
        next_double(state) is what random() does, so the value and the state after are the same. The
        generator's lock is not taken: a sampler draws from one thread, and holds the generator."""
        if not isinstance(bitgen, _numba.types.Integer):
            return None

        def codegen(context, builder, signature, args):
            ir = llvmlite.ir
            byte_pointer = ir.IntType(8).as_pointer()
            fields = builder.inttoptr(args[0], byte_pointer.as_pointer())
            next_double = ir.FunctionType(ir.DoubleType(), [byte_pointer])
            draw = builder.bitcast(builder.load(builder.gep(fields, [ir.Constant(ir.IntType(32), 3)])), next_double.as_pointer())
            return builder.call(draw, [builder.load(fields)])

        return _numba.types.float64(bitgen), codegen

    class _Int8Dots:
        """The int8 dot instructions of this CPU's family (int8_dot_kernels' "vnni" or "avx2"), declared
        in the module `builder` writes, on int32 vectors of QUAD_COLUMN lanes (one 4-byte group a lane)."""

        def __init__(self, builder):
            from numba.core import cgutils

            ir = llvmlite.ir
            self.builder, self.words = builder, ir.VectorType(ir.IntType(32), QUAD_COLUMN)
            function = lambda name, result, *operands: cgutils.get_or_insert_function(  # noqa: E731
                builder.module, ir.FunctionType(result, list(operands)), name)
            if QUAD_FAMILY == "vnni":
                self._vpdpbusd = function("llvm.x86.avx512.vpdpbusd.512", *[self.words] * 4)
                return
            self.bytes, shorts, self.i1 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(16), 16), ir.IntType(1)
            self._maddubs = function("llvm.x86.avx2.pmadd.ub.sw", shorts, self.bytes, self.bytes)
            self._maddwd = function("llvm.x86.avx2.pmadd.wd", self.words, shorts, shorts)
            self._sign = function("llvm.x86.avx2.psign.b", self.bytes, self.bytes, self.bytes)
            self._abs = function("llvm.abs.v32i8", self.bytes, self.bytes, self.i1)
            self._ones = ir.Constant(shorts, [1] * 16)

        def vpdpbusd(self, acc, unsigned, signed):
            """vnni: acc + each lane's 4 products of unsigned by signed bytes."""
            return self.builder.call(self._vpdpbusd, [acc, unsigned, signed])

        def pairs(self, unsigned, signed):
            """avx2: int16 sums of adjacent products of unsigned by signed bytes (vpmaddubsw, saturating)."""
            b = self.builder
            return b.call(self._maddubs, [b.bitcast(unsigned, self.bytes), b.bitcast(signed, self.bytes)])

        def signed_pairs(self, levels, x):
            """avx2: pairs of signed levels by x, by the sign trick: |w| (unsigned, 128 for -128) times
            x with w's sign, each pair at most 2 * 128 * 127 = 32512 < 2^15."""
            b = self.builder
            w = b.bitcast(levels, self.bytes)
            magnitude = b.call(self._abs, [w, llvmlite.ir.Constant(self.i1, 0)])
            return self.pairs(magnitude, b.call(self._sign, [b.bitcast(x, self.bytes), w]))

        def widen(self, acc, pairs):
            """avx2: acc + each lane's two int16 pairs (vpmaddwd by ones)."""
            return self.builder.add(acc, self.builder.call(self._maddwd, [pairs, self._ones]))

    @intrinsic
    def quad_columns(typingctx, plane, x, dots, x_at, quads, lanes):
        """In compiled code, on the CPU of int8_dot_kernels()'s "vnni" or "avx2" family only (LLVM
        cannot emit their instructions elsewhere): dots[c] for lanes c < lanes // QUAD_COLUMN *
        QUAD_COLUMN = the sum over quads p of the 4 products of plane's bytes (p * lanes + c) * 4 + s
        with x's bytes x_at + (p * lanes + c) * 4 + s (int8), s = 0..3. A plane byte is read as the
        family stores it: uint8 on vnni (vpdpbusd multiplies unsigned by signed bytes: levels + 128),
        int8 on avx2. plane uint8, x int8, dots int32: 1-D C arrays; lanes past the last whole column
        are left alone. Accumulators stay in registers, QUAD_BLOCK columns at a time.

        vnni: one vpdpbusd multiplies 64 byte pairs and adds each 4 into an int32 lane. avx2:
        vpmaddubsw multiplies 32 unsigned by signed bytes and adds pairs into int16 (saturating),
        vpmaddwd by ones adds those pairs into int32, the levels through the sign trick (_Int8Dots)."""
        types = _numba.types
        if (plane.dtype, x.dtype, dots.dtype) != (types.uint8, types.int8, types.int32):
            return None
        signature = types.void(plane, x, dots, types.intp, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            from numba.core import cgutils

            ir = llvmlite.ir
            plane_v, x_v, dots_v, x_at, quads_v, lanes_v = args
            vector = ir.VectorType(ir.IntType(32), QUAD_COLUMN)
            intp = context.get_value_type(types.intp)
            const = lambda v: ir.Constant(intp, v)  # noqa: E731
            int8 = _Int8Dots(builder)
            data = [context.make_array(t)(context, builder, v).data for t, v in zip(signature.args[:3], args[:3])]
            accumulators = [cgutils.alloca_once(builder, vector) for _ in range(QUAD_BLOCK)]

            def load(array, at):
                return builder.load(builder.bitcast(builder.gep(array, [at]), vector.as_pointer()), align=1)

            def dot(acc, codes, at):
                """acc + the quads' sums of one column's plane bytes `codes` with x's at byte `at`."""
                if QUAD_FAMILY == "vnni":
                    return int8.vpdpbusd(acc, codes, load(data[1], at))
                return int8.widen(acc, int8.signed_pairs(codes, load(data[1], at)))

            def columns_from(first, count: int) -> None:
                for acc in accumulators[:count]:
                    builder.store(ir.Constant(vector, None), acc)
                with cgutils.for_range(builder, quads_v) as p:
                    for j in range(count):
                        lane = builder.mul(builder.add(first, const(j)), const(QUAD_COLUMN))
                        byte = builder.mul(builder.add(builder.mul(p.index, lanes_v), lane), const(4))
                        acc = builder.load(accumulators[j])
                        builder.store(dot(acc, load(data[0], byte), builder.add(x_at, byte)), accumulators[j])
                for j in range(count):
                    out = builder.gep(data[2], [builder.mul(builder.add(first, const(j)), const(QUAD_COLUMN))])
                    builder.store(builder.load(accumulators[j]), builder.bitcast(out, vector.as_pointer()), align=1)

            columns = builder.sdiv(lanes_v, const(QUAD_COLUMN))
            blocks = builder.sdiv(columns, const(QUAD_BLOCK))
            with cgutils.for_range(builder, blocks) as block:
                columns_from(builder.mul(block.index, const(QUAD_BLOCK)), QUAD_BLOCK)
            done = builder.mul(blocks, const(QUAD_BLOCK))
            with cgutils.for_range(builder, builder.sub(columns, done)) as rest:
                columns_from(builder.add(done, rest.index), 1)
            return context.get_dummy_value()

        return signature, codegen

    def _bf16_tile(tokens: int, blocks: int):
        """The intrinsic below for a tile of `tokens` token rows by `blocks` blocks of 32 weight rows."""

        def bf16_tile(typingctx, lanes, x, out, block, t0):
            """In compiled code: out[t0 + i, (block + j) * 32 + r] = sum over k of bf16 weight
            lanes[block + j, k, r] times x[t0 + i, k], for i < tokens, j < blocks, r < 32: one fused
            multiply-add a k, in k order from 0, per output. lanes uint16 [B, K, 32] (32 weight rows
            side by side at each k); x fp32 [T, K]; out fp32 [T, >= B * 32]; C arrays.

            A 64-byte load holds a k's 32 rows: as 16 uint32 lanes, shifting left by 16 gives the
            even rows' fp32 values and masking the low half off the odd rows' (bf16 is fp32's top
            half). Each of the tile's 2 * blocks * tokens accumulators is one vector register; an
            output's value depends only on its row and token, never on the tile it was computed in."""
            types = _numba.types
            if (lanes.dtype, x.dtype, out.dtype) != (types.uint16, types.float32, types.float32):
                return None
            signature = types.void(lanes, x, out, types.intp, types.intp)

            def codegen(context, builder, signature, args):
                from numba.core import cgutils

                ir = llvmlite.ir
                lanes_v, x_v, out_v, block, t0 = args
                intp = context.get_value_type(types.intp)
                const = lambda v: ir.Constant(intp, v)  # noqa: E731
                i32, words, floats = ir.IntType(32), ir.VectorType(ir.IntType(32), 16), ir.VectorType(ir.FloatType(), 16)
                fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats, [floats] * 3), "llvm.fma.v16f32")
                W, X, O = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:3], args[:3]))
                K, x_row, out_row = (cgutils.unpack_tuple(builder, a.shape, n)[1] for a, n in ((W, 3), (X, 2), (O, 2)))
                accumulators = [[cgutils.alloca_once(builder, floats) for _ in range(2 * blocks)] for _ in range(tokens)]
                for acc in sum(accumulators, []):
                    builder.store(ir.Constant(floats, None), acc)
                sixteen, high_half = ir.Constant(words, [16] * 16), ir.Constant(words, [-65536] * 16)
                with cgutils.for_range(builder, K) as loop:
                    k = loop.index
                    weights = []  # per block: even rows, odd rows
                    for j in range(blocks):
                        at = builder.mul(builder.add(builder.mul(builder.add(block, const(j)), K), k), const(32))
                        w = builder.load(builder.bitcast(builder.gep(W.data, [at]), words.as_pointer()), align=2)
                        weights += [builder.bitcast(builder.shl(w, sixteen), floats), builder.bitcast(builder.and_(w, high_half), floats)]
                    for i in range(tokens):
                        splat = _splat(builder, builder.load(builder.gep(X.data, [builder.add(builder.mul(builder.add(t0, const(i)), x_row), k)])))
                        for acc, w in zip(accumulators[i], weights):
                            builder.store(builder.call(fma, [w, splat, builder.load(acc)]), acc)
                rows_in_order = ir.Constant(ir.VectorType(i32, 32), [v for r in range(16) for v in (r, 16 + r)])
                for i in range(tokens):
                    for j in range(blocks):
                        both = builder.shuffle_vector(builder.load(accumulators[i][2 * j]), builder.load(accumulators[i][2 * j + 1]), rows_in_order)
                        at = builder.add(builder.mul(builder.add(t0, const(i)), out_row), builder.mul(builder.add(block, const(j)), const(32)))
                        builder.store(both, builder.bitcast(builder.gep(O.data, [at]), ir.VectorType(ir.FloatType(), 32).as_pointer()), align=4)
                return context.get_dummy_value()

            return signature, codegen

        return intrinsic(bf16_tile)

    # tiles: a decode step 1 token x 4 blocks (8 independent chains hide the multiply-add latency);
    # more tokens, on each pair of blocks 4 x 2 (16 accumulators) while more than 6 rows are left,
    # then one tile of the 1 to 6 left (up to 24 accumulators, 4 weight vectors and the token's:
    # 29 of AVX-512's 32 registers). Lanes come in whole pairs of blocks (BF16Linear pads them).
    _tile_1x4 = _bf16_tile(1, 4)
    _tile_1x2, _tile_2x2, _tile_3x2, _tile_4x2, _tile_5x2, _tile_6x2 = (_bf16_tile(tokens, 2) for tokens in range(1, 7))

    def _splat(builder, value):
        """An fp32 value in all 16 lanes of a vector."""
        ir = llvmlite.ir
        floats = ir.VectorType(ir.FloatType(), 16)
        one = builder.insert_element(ir.Constant(floats, None), value, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, ir.Constant(floats, None), ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))

    def _w4a16_tile(tokens: int, blocks: int):
        """The intrinsic below for a tile of `tokens` token rows by `blocks` blocks of 32 weight rows."""

        def w4a16_tile(typingctx, nibbles, scales, x, out, block, t0):
            """In compiled code: out[t0 + i, (block + j) * 32 + r] = sum over groups g, in order, of
            scales[block + j, g, r] times the fp32 sum, in k order, of level(block + j, k, r) * x[t0 +
            i, k] over the group's 128 k; i < tokens, j < blocks, r < 32. nibbles uint8 [B, K, 16]:
            at each k a block's byte r holds row r's level + 8 in its low nibble and row r + 16's in
            its high one; scales fp32 [B, K / 128, 32]; x fp32 [T, K], bf16-rounded; out fp32
            [T, >= B * 32]; C arrays.

            A 16-byte load holds a k's 32 levels: widened to 16 int32 lanes, the low nibbles (- 8) are
            rows 0-15 and the high ones rows 16-31, converted to fp32 exactly. level * x is exact in
            fp32 (4 + 8 significant bits), so the fused multiply-add rounds only the sum, as the
            route's fp32 sum does; a group's sum is scaled, then added to the total (two roundings, as
            _w4a16_nibbles: the same bits). Per output one group sum and one running total, vector
            registers both; an output's value depends only on its row and token, never on the tile."""
            types = _numba.types
            if (nibbles.dtype, scales.dtype, x.dtype, out.dtype) != (types.uint8, types.float32, types.float32, types.float32):
                return None
            signature = types.void(nibbles, scales, x, out, types.intp, types.intp)

            def codegen(context, builder, signature, args):
                from numba.core import cgutils

                ir = llvmlite.ir
                block, t0 = args[4:]
                intp = context.get_value_type(types.intp)
                const = lambda v: ir.Constant(intp, v)  # noqa: E731
                words, floats = ir.VectorType(ir.IntType(32), 16), ir.VectorType(ir.FloatType(), 16)
                fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats, [floats] * 3), "llvm.fma.v16f32")
                W, S, X, O = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:4], args[:4]))
                K, x_row, out_row = (cgutils.unpack_tuple(builder, a.shape, n)[1] for a, n in ((W, 3), (X, 2), (O, 2)))
                G = builder.sdiv(K, const(GROUP))
                vector = lambda: cgutils.alloca_once(builder, floats)  # noqa: E731
                # per token, per block: [rows 0-15, rows 16-31]
                group_sums = [[vector() for _ in range(2 * blocks)] for _ in range(tokens)]
                totals = [[vector() for _ in range(2 * blocks)] for _ in range(tokens)]
                for total in sum(totals, []):
                    builder.store(ir.Constant(floats, None), total)
                low, eight, four = (ir.Constant(words, [v] * 16) for v in (15, 8, 4))
                with cgutils.for_range(builder, G) as group:
                    for acc in sum(group_sums, []):
                        builder.store(ir.Constant(floats, None), acc)
                    with cgutils.for_range(builder, const(GROUP)) as position:
                        k = builder.add(builder.mul(group.index, const(GROUP)), position.index)
                        levels = []  # per block: rows 0-15, rows 16-31
                        for j in range(blocks):
                            at = builder.mul(builder.add(builder.mul(builder.add(block, const(j)), K), k), const(16))
                            codes = builder.load(builder.bitcast(builder.gep(W.data, [at]), ir.VectorType(ir.IntType(8), 16).as_pointer()), align=1)
                            codes = builder.zext(codes, words)
                            levels += [builder.sitofp(builder.sub(builder.and_(codes, low), eight), floats),
                                       builder.sitofp(builder.sub(builder.lshr(codes, four), eight), floats)]
                        for i in range(tokens):
                            splat = _splat(builder, builder.load(builder.gep(X.data, [builder.add(builder.mul(builder.add(t0, const(i)), x_row), k)])))
                            for acc, w in zip(group_sums[i], levels):
                                builder.store(builder.call(fma, [w, splat, builder.load(acc)]), acc)
                    for j in range(blocks):
                        at = builder.mul(builder.add(builder.mul(builder.add(block, const(j)), G), group.index), const(32))
                        for half in range(2):
                            scale = builder.load(builder.bitcast(builder.gep(S.data, [builder.add(at, const(16 * half))]), floats.as_pointer()), align=4)
                            for i in range(tokens):
                                acc, total = group_sums[i][2 * j + half], totals[i][2 * j + half]
                                builder.store(builder.fadd(builder.load(total), builder.fmul(builder.load(acc), scale)), total)
                for i in range(tokens):
                    for j in range(blocks):
                        for half in range(2):
                            at = builder.add(builder.mul(builder.add(t0, const(i)), out_row), builder.add(builder.mul(builder.add(block, const(j)), const(32)), const(16 * half)))
                            builder.store(builder.load(totals[i][2 * j + half]), builder.bitcast(builder.gep(O.data, [at]), floats.as_pointer()), align=4)
                return context.get_dummy_value()

            return signature, codegen

        return intrinsic(w4a16_tile)

    # tiles of at most 16 accumulators (a group sum and a total per 16 outputs): a decode step 1 token
    # x 4 blocks; more tokens, for each pair of blocks 4 x 1 twice while 4 rows are left, then 2 x 2
    # and 1 x 2; a last block alone 4 x 1 and 1 x 1
    _w4a16_4x1, _w4a16_2x2, _w4a16_1x4, _w4a16_1x2, _w4a16_1x1 = (
        _w4a16_tile(*shape) for shape in ((4, 1), (2, 2), (1, 4), (1, 2), (1, 1)))

    def _rows_tile(tokens: int):
        """The intrinsic below for a tile of `tokens` token rows."""

        def rows_tile(typingctx, codes, scales, block_d, minimum, q, x_sum, x_scale, acc, g, t0):
            """In compiled code, on the CPU of int8_dot_kernels()'s "vnni" or "avx2" family only:
            acc[i, r] = the sum over units v, in order from 0, of fp32(dot) * (scale * x_scale[t0 + i,
            v]), dot = the integer dot of weight row 16 g + r's unit v (32 inputs, or Q6_K's 16) with
            token row t0 + i's, minus the codes' stored offset times x_sum[t0 + i, v] (nibbles: 8;
            bytes: QUAD_BIAS); i < tokens, r < 16. codes uint8 [G, U * 256 (nibbles, or bytes of
            16-input units) or U * 512] (RowPlanes); scales group g's: fp32 [U * 16], scale =
            scales[v * 16 + r], or a K-quant's int8 codes, scale = block_d[32 b + r] * fp32(scales[v *
            16 + r]) for v's block b (block_d fp32 [B * 32], the group's d: group_scales), the
            product made here as a unit is used (a pass of its own over a group's scales stalled the
            weights' stream: 1.45x the time of fp32 scales on a [8192, 4096] Q4_K matrix). K-quant
            codes with a minimum (int8 [U * 16], the group's codes; else empty): then acc[i, r] -= the
            sum over units v, in order, of (fp32(x_sum[t0 + i, v]) * x_scale[t0 + i, v]) * (block_d[32
            b + 16 + r] * fp32(minimum[v * 16 + r]), less 8 * scale for nibbles: Q4_K's - 8 comes back
            through its minimum), made here as well. q int8 [T, K], x_sum int32 and x_scale fp32 [T,
            U], acc fp32 [>= tokens, 16]: C arrays.

            A unit's 16 rows lie in one 64-byte vector per quad p of positions, a row's four bytes in
            one int32 lane (nibbles: low ones positions 4p..4p+3, high ones 16 + 4p..; bytes: 4p..4p+3
            of 8 quads). Loaded (and for nibbles masked and shifted) once, they serve every token of
            the tile, whose 4 activation bytes for the quad are broadcast to all lanes: one
            vpbroadcastd from L1, where the position-major planes read a copy per lane. vnni:
            vpdpbusd adds a lane's 4 products into int32, in two chains. avx2: two 8-lane halves,
            vpmaddubsw pairs into int16 (nibbles: <= 2 * 15 * 127, a quad's two sums <= 7620; bytes:
            the sign trick), vpmaddwd by ones to int32 (_Int8Dots).
            The integers are exact; the fp32 steps are those of _w4a8_rows_loops, in its order."""
            types = _numba.types
            if (codes.dtype, block_d.dtype, minimum.dtype, q.dtype, x_sum.dtype, x_scale.dtype, acc.dtype) != (
                    types.uint8, types.float32, types.int8, types.int8, types.int32, types.float32, types.float32) or \
                    scales.dtype not in (types.float32, types.int8):
                return None
            coded = scales.dtype == types.int8
            signature = types.void(codes, scales, block_d, minimum, q, x_sum, x_scale, acc, types.intp, types.intp)

            def codegen(context, builder, signature, args):
                from numba.core import cgutils

                ir = llvmlite.ir
                g, t0 = args[8:]
                intp = context.get_value_type(types.intp)
                const = lambda v: ir.Constant(intp, v)  # noqa: E731
                W = QUAD_COLUMN  # int32 lanes a vector: 16 rows in 16 // W vectors
                halves = 16 // W
                i32 = ir.IntType(32)
                words, floats = ir.VectorType(i32, W), ir.VectorType(ir.FloatType(), W)
                int8 = _Int8Dots(builder)
                C, S, D, MN, Q, XS, XC, A = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:8], args[:8]))
                has_minimum = builder.icmp_signed(">", cgutils.unpack_tuple(builder, MN.shape, 1)[0], const(0))
                row_bytes = cgutils.unpack_tuple(builder, C.shape, 2)[1]
                K = cgutils.unpack_tuple(builder, Q.shape, 2)[1]
                U = cgutils.unpack_tuple(builder, XS.shape, 2)[1]
                low_nibbles, four = ir.Constant(words, [0x0F0F0F0F] * W), ir.Constant(words, [4] * W)

                def splat(value, vector):
                    one = builder.insert_element(ir.Constant(vector, None), value, ir.Constant(i32, 0))
                    return builder.shuffle_vector(one, ir.Constant(vector, None), ir.Constant(ir.VectorType(i32, W), [0] * W))

                def load(pointer, vector, at, align):
                    return builder.load(builder.bitcast(builder.gep(pointer, [at]), vector.as_pointer()), align=align)

                totals = [[cgutils.alloca_once(builder, floats) for _ in range(halves)] for _ in range(tokens)]
                minimum_totals = [[cgutils.alloca_once(builder, floats) for _ in range(halves)] for _ in range(tokens)] if coded else []
                for total in sum(totals + minimum_totals, []):
                    builder.store(ir.Constant(floats, None), total)

                def units(nibbles: bool, inputs: int) -> None:
                    """The sum over units of `inputs` (32, or Q6_K's 16) into the totals, for nibble or byte codes."""
                    unit_bytes, offset = (256, 8) if nibbles else (16 * inputs, QUAD_BIAS)
                    # (weight vectors [half], activation offset in the unit) for each quad a lane sums
                    quads = [(p, 4 * p) for p in range(4)] + [(p, 16 + 4 * p) for p in range(4)] if nibbles else \
                        [(p, 4 * p) for p in range(inputs // 4)]
                    with cgutils.for_range(builder, U) as unit:
                        v = unit.index
                        base = builder.add(builder.mul(g, row_bytes), builder.mul(v, const(unit_bytes)))
                        stored = [[load(C.data, words, builder.add(base, const(64 * p + 4 * W * h)), 1) for h in range(halves)]
                                  for p in range(unit_bytes // 64)]
                        if nibbles:  # shifting each 32-bit lane by 4 moves every byte's high nibble down
                            weights = [[builder.and_(c, low_nibbles) for c in quad] for quad in stored] + \
                                      [[builder.and_(builder.lshr(c, four), low_nibbles) for c in quad] for quad in stored]
                        else:
                            weights = stored
                        scale_at = [builder.add(builder.mul(v, const(16)), const(W * h)) for h in range(halves)]
                        if coded:  # the block's d (v // units a block: a shift) times the unit's codes
                            d_at = builder.mul(builder.udiv(v, const(256 // inputs)), const(32))
                            weight_scale = [builder.fmul(load(D.data, floats, builder.add(d_at, const(W * h)), 4),
                                                         builder.sitofp(load(S.data, ir.VectorType(ir.IntType(8), W), at, 1), floats))
                                            for h, at in enumerate(scale_at)]
                        else:
                            weight_scale = [load(S.data, floats, at, 4) for at in scale_at]
                        for i in range(tokens):
                            row = builder.add(t0, const(i))
                            x_at = builder.add(builder.mul(row, K), builder.mul(v, const(inputs)))
                            x = [splat(load(Q.data, i32, builder.add(x_at, const(at)), 1), words) for _, at in quads]
                            unit_at = builder.add(builder.mul(row, U), v)
                            bias = splat(builder.mul(builder.load(builder.gep(XS.data, [unit_at])), ir.Constant(i32, offset)), words)
                            scale = splat(builder.load(builder.gep(XC.data, [unit_at])), floats)
                            for h in range(halves):
                                if QUAD_FAMILY == "vnni":
                                    sums = [ir.Constant(words, None)] * 2
                                    for j, w in enumerate(weights):
                                        sums[j % 2] = int8.vpdpbusd(sums[j % 2], w[h], x[j])
                                    dot = builder.add(sums[0], sums[1])
                                elif nibbles:  # a quad's low and high nibbles' pairs add in int16, then widen
                                    dot = ir.Constant(words, None)
                                    for j in range(4):
                                        dot = int8.widen(dot, builder.add(int8.pairs(weights[j][h], x[j]), int8.pairs(weights[4 + j][h], x[4 + j])))
                                else:
                                    dot = ir.Constant(words, None)
                                    for j, w in enumerate(weights):
                                        dot = int8.widen(dot, int8.signed_pairs(w[h], x[j]))
                                term = builder.fmul(builder.sitofp(builder.sub(dot, bias), floats), builder.fmul(weight_scale[h], scale))
                                builder.store(builder.fadd(builder.load(totals[i][h]), term), totals[i][h])
                        if coded:
                            with builder.if_then(has_minimum):  # the unit's minima, then each token's share
                                eight = ir.Constant(floats, [8.0] * W)
                                minima = []
                                for h, at in enumerate(scale_at):
                                    low = builder.fmul(load(D.data, floats, builder.add(d_at, const(16 + W * h)), 4),
                                                       builder.sitofp(load(MN.data, ir.VectorType(ir.IntType(8), W), at, 1), floats))
                                    minima.append(builder.fsub(low, builder.fmul(eight, weight_scale[h])) if nibbles else low)
                                for i in range(tokens):
                                    unit_at = builder.add(builder.mul(builder.add(t0, const(i)), U), v)
                                    x_unit = splat(builder.fmul(builder.sitofp(builder.load(builder.gep(XS.data, [unit_at])), ir.FloatType()),
                                                                builder.load(builder.gep(XC.data, [unit_at]))), floats)
                                    for h in range(halves):
                                        builder.store(builder.fadd(builder.load(minimum_totals[i][h]), builder.fmul(x_unit, minima[h])), minimum_totals[i][h])

                # a unit's bytes and inputs tell the codes: 256 and 32 nibbles, 512 and 32 or 256 and 16 bytes
                of_bytes = builder.icmp_signed("==", row_bytes, builder.mul(U, const(512)))
                of_nibbles = builder.icmp_signed("==", K, builder.mul(U, const(32)))
                with builder.if_else(of_bytes) as (on_bytes, on_short_units):
                    with on_bytes:
                        units(nibbles=False, inputs=32)
                    with on_short_units:
                        with builder.if_else(of_nibbles) as (on_nibbles, on_sixteens):
                            with on_nibbles:
                                units(nibbles=True, inputs=32)
                            with on_sixteens:
                                units(nibbles=False, inputs=16)
                acc_row = cgutils.unpack_tuple(builder, A.shape, 2)[1]
                for i in range(tokens):
                    for h in range(halves):
                        at = builder.add(builder.mul(const(i), acc_row), const(W * h))
                        total = builder.load(totals[i][h])
                        if coded:  # less the minima's sum (0 without minima: the same bits)
                            total = builder.fsub(total, builder.load(minimum_totals[i][h]))
                        builder.store(total, builder.bitcast(builder.gep(A.data, [at]), floats.as_pointer()), align=4)
                return context.get_dummy_value()

            return signature, codegen

        return intrinsic(rows_tile)

    # tiles of 8 token rows (8 weight vectors, 8 totals and the broadcasts: ~24 of AVX-512's 32
    # registers), then one of 4, 2 and 1 for the rows left
    _rows_tile_8, _rows_tile_4, _rows_tile_2, _rows_tile_1 = (_rows_tile(tokens) for tokens in (8, 4, 2, 1))

    def _delta_columns(vectors: int):
        """The intrinsic below for a block of `vectors` x 16 value columns."""

        def delta_columns(typingctx, S, q, k, v, beta, decay, h, rows, last, out, c0):
            """In compiled code: _delta_row's steps for head h's rows [0, rows) on value columns [c0,
            c0 + 16 vectors) (the step is independent per column: u_j and o_j read column j of the state
            alone), each row's u and o in registers and the block's state, dk x 16 vectors x 4 bytes,
            staying in L1 from row to row: the state before row 0 read from S[h], every row's written to
            last[h] (rows after the first update it in place: a step reads a state row before writing
            it). The fp32 steps of _delta_row, each rounded alone in its order (sums over dk in order),
            so its bits. S, last [H, dk, dv]; q, k [T, H, dk]; v, out [T, H, dv]; beta, decay [T, H]:
            C arrays. (_delta_row's loops kept u and o in memory and read and wrote each head's whole
            state twice a row from L2: 46-57 us a row of 16 heads of 128 x 128.)"""
            types = _numba.types
            f32 = types.float32
            if any(a.dtype != f32 for a in (S, q, k, v, beta, decay, last, out)):
                return None
            signature = types.void(S, q, k, v, beta, decay, types.intp, types.intp, last, out, types.intp)

            def codegen(context, builder, signature, args):
                from numba.core import cgutils

                ir = llvmlite.ir
                intp = context.get_value_type(types.intp)
                const = lambda n: ir.Constant(intp, n)  # noqa: E731
                floats = ir.VectorType(ir.FloatType(), 16)
                S_, Q_, K_, V_, B_, D_ = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:6], args[:6]))
                h, rows = args[6], args[7]
                L_, O_ = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[8:10], args[8:10]))
                c0 = args[10]
                H, dk, dv = cgutils.unpack_tuple(builder, S_.shape, 3)

                def vector_at(pointer, at):
                    return builder.bitcast(builder.gep(pointer, [at]), floats.as_pointer())

                head = builder.mul(builder.mul(h, dk), dv)  # head h's state at [h, 0, 0]
                u = [cgutils.alloca_once(builder, floats) for _ in range(vectors)]
                o = [cgutils.alloca_once(builder, floats) for _ in range(vectors)]
                with cgutils.for_range(builder, rows) as row:
                    t = row.index
                    source = builder.select(builder.icmp_signed("==", t, const(0)), S_.data, L_.data)
                    at_th = builder.add(builder.mul(t, H), h)  # [t, h]
                    e_g = _splat(builder, builder.load(builder.gep(D_.data, [at_th])))
                    b = _splat(builder, builder.load(builder.gep(B_.data, [at_th])))
                    keys = builder.mul(at_th, dk)
                    values = builder.add(builder.mul(at_th, dv), c0)
                    for acc in u + o:
                        builder.store(ir.Constant(floats, None), acc)
                    with cgutils.for_range(builder, dk) as i_loop:  # u = S'^T k, S' = e^g S
                        i = i_loop.index
                        k_i = _splat(builder, builder.load(builder.gep(K_.data, [builder.add(keys, i)])))
                        state_row = builder.add(builder.add(head, builder.mul(i, dv)), c0)
                        for c in range(vectors):
                            s = builder.load(vector_at(source, builder.add(state_row, const(16 * c))), align=4)
                            builder.store(builder.fadd(builder.load(u[c]), builder.fmul(builder.fmul(s, e_g), k_i)), u[c])
                    for c in range(vectors):  # u = beta (v - S'^T k)
                        v_c = builder.load(vector_at(V_.data, builder.add(values, const(16 * c))), align=4)
                        builder.store(builder.fmul(builder.fsub(v_c, builder.load(u[c])), b), u[c])
                    with cgutils.for_range(builder, dk) as i_loop:  # S' += k u^T; o = S'^T q
                        i = i_loop.index
                        k_i = _splat(builder, builder.load(builder.gep(K_.data, [builder.add(keys, i)])))
                        q_i = _splat(builder, builder.load(builder.gep(Q_.data, [builder.add(keys, i)])))
                        state_row = builder.add(builder.add(head, builder.mul(i, dv)), c0)
                        for c in range(vectors):
                            s = builder.load(vector_at(source, builder.add(state_row, const(16 * c))), align=4)
                            after = builder.fadd(builder.fmul(s, e_g), builder.fmul(k_i, builder.load(u[c])))
                            builder.store(after, vector_at(L_.data, builder.add(state_row, const(16 * c))), align=4)
                            builder.store(builder.fadd(builder.load(o[c]), builder.fmul(after, q_i)), o[c])
                    for c in range(vectors):
                        builder.store(builder.load(o[c]), vector_at(O_.data, builder.add(values, const(16 * c))), align=4)
                return context.get_dummy_value()

            return signature, codegen

        return intrinsic(delta_columns)

    # blocks of 64 columns (4 chains of u and of o hide the adds' latency; a block of 128 x 64 state
    # is 32 KB), then 16 at a time for the rest
    _delta_columns_64, _delta_columns_16 = _delta_columns(4), _delta_columns(1)


@kernel_jit(fastmath=True, inline="always")  # inlined into numba's IR: a call left to LLVM stops the vectorizer
def exp_f32(x):
    """e^x in fp32, written so that LLVM vectorizes it (libm's expf is one scalar call a value, ~3x
    numpy's vectorized exp): x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' degree-6 polynomial,
    2^n placed in the exponent bits. Within 2 ulp of e^x on [-87, 88]; x is clamped there (e^-100
    gives ~1.6e-38, not 0), which keeps 2^n a normal float."""
    x = min(max(x, np.float32(-87.0)), np.float32(88.0))
    n = np.floor(x * np.float32(1.44269504) + np.float32(0.5))
    r = (x - n * np.float32(0.693359375)) + n * np.float32(2.12194440e-4)  # ln2 in two parts: r exact
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    return (p * r * r + r + np.float32(1)) * as_float32(np.uint32(np.int32(n) + 127) << np.uint32(23))


@kernel_jit(inline="always")  # inlined into numba's IR: _rescale took 61 ns for 256 lanes calling it, 42 with it inlined
def _fold(terms, L):
    """Sum terms [n] (n a multiple of L) down to terms[:L]: halves add while the count of L-runs
    is even (one vector loop each), then the runs left add in order. Integer sums are exact in any
    order; for fp32 the order is fixed by n and L."""
    n = terms.shape[0]
    while n > L and (n // L) % 2 == 0:
        n //= 2
        for i in range(n):
            terms[i] += terms[n + i]
    for run in range(1, n // L):
        for i in range(L):
            terms[i] += terms[run * L + i]


@kernel_jit()
def _rescale(dots, offset, lane_sum, scale, x_scale, terms, R, out, t, first):
    """out[t, first + r] = sum over units v of fp32(dot_i) * (scale[i] * x_scale[i]), i = v*R + r, for
    the R rows of a group (x_scale per lane: the unit's activation scale, repeated for the R rows), where
    dot_i = dots[i] - offset * lane_sum[i] in int32: the levels' stored offset (vpdpbusd bytes' + 128)
    taken off in the same pass (a pass of its own took ~20 of a decode group row's ~185 ns).

    Order, fixed by U and R alone (never by T or the thread split): _fold's over the terms [L] in runs
    of R (units v and v + U/2 add while the count of units is even, then the units left in order). One chain of U dependent adds per row instead took ~165
    of the ~390 ns a decode step spends on a group of 4 x 1024 Q4_0 weights; this takes ~40."""
    for i in range(dots.shape[0]):
        terms[i] = np.float32(np.int32(dots[i] - offset * lane_sum[i])) * (scale[i] * x_scale[i])
    _fold(terms, R)
    row = out[t]
    for r in range(min(R, row.shape[0] - first)):
        row[first + r] = terms[r]


@kernel_jit()
def _w4a8_bytes(codes, scale, x, x_scale, R, out, lo, hi):
    """Levels in the int8 range, one a byte (trellis): codes int8 [G, unit * L]; x int16 [T, unit * L];
    x_scale fp32 [T, L] as in _rescale.

    out[t, n] as _rescale. A product fits int16 (|level * x| <= 128 * 127 = 16256), and so does the sum of two; a term holds four
    positions of a lane (j, j + unit/4, j + unit/2, j + 3 unit/4; unit is 16, 32 or 128), and the
    terms fold in int32."""
    T, quarter, L = x.shape[0], codes.shape[1] // 4, scale.shape[1]
    terms32, terms, scratch = np.empty(quarter, np.int32), np.empty(L, np.float32), np.empty(L, np.uint32)
    for g in range(lo, hi):
        c, group_scale = codes[g], unit_scales(scale[g], scratch)
        c0, c1, c2, c3 = c[:quarter], c[quarter : 2 * quarter], c[2 * quarter : 3 * quarter], c[3 * quarter :]
        for t in range(T):
            xt = x[t]
            x0, x1, x2, x3 = xt[:quarter], xt[quarter : 2 * quarter], xt[2 * quarter : 3 * quarter], xt[3 * quarter :]
            for i in range(quarter):  # four positions a term: two int16 pairs, added in int32
                terms32[i] = (np.int32(np.int16(np.int16(c0[i]) * x0[i]) + np.int16(np.int16(c2[i]) * x2[i]))
                              + np.int32(np.int16(np.int16(c1[i]) * x1[i]) + np.int16(np.int16(c3[i]) * x3[i])))
            _fold(terms32, L)
            _rescale(terms32[:L], np.int32(0), terms32[:L], group_scale, x_scale[t], terms, R, out, t, g * R)  # no stored offset


@kernel_jit()
def _quad_tail(plane, x, x_at, quads, dots):
    """What quad_columns leaves: dots[c] for the lanes past the last whole column, the same sums in
    loops (plane uint8 read as unsigned, or int8)."""
    L = dots.shape[0]
    for c in range(L // QUAD_COLUMN * QUAD_COLUMN, L):
        total = np.int32(0)
        for p in range(quads):
            for s in range(4):
                at = (p * L + c) * 4 + s
                total += np.int32(plane[at]) * np.int32(x[x_at + at])
        dots[c] = total


@kernel_jit()
def _w4a8_byte_quads(codes, scale, x, x_scale, lane_sum, R, out, lo, hi):
    """_w4a8_bytes with quad_columns. codes uint8 [G, unit/4 * L * 4]: level + QUAD_BIAS at byte
    (p, lane, s) for position 4p + s; x int8 [T, unit/4 * L * 4] likewise; lane_sum int32 [T, L]
    (the sum of each lane's unit's activation levels). dot = the quads' sum - QUAD_BIAS lane_sum:
    _w4a8_bytes' integers, then its rescale, so its bits."""
    T, n, L = x.shape[0], codes.shape[1], scale.shape[1]
    quads = n // (4 * L)
    dots, terms, scratch = np.empty(L, np.int32), np.empty(L, np.float32), np.empty(L, np.uint32)
    for g in range(lo, hi):
        c, group_scale = codes[g], unit_scales(scale[g], scratch)
        tail_plane = c if QUAD_BIAS else c.view(np.int8)  # the tail reads the levels as the columns do
        for t in range(T):
            quad_columns(c, x[t], dots, 0, quads, L)
            _quad_tail(tail_plane, x[t], 0, quads, dots)
            _rescale(dots, np.int32(QUAD_BIAS), lane_sum[t], group_scale, x_scale[t], terms, R, out, t, g * R)


ROWS = 16  # weight rows a RowPlanes group holds: one vpdpbusd's int32 lanes (two AVX2 vectors)
# token rows a rows_tile runs on a group's weights (AVX2's 16 registers hold a tile of 2 without spilling)
ROWS_TILE = 8 if QUAD_FAMILY == "vnni" else 2


@kernel_jit(inline="always")
def _rows_minimum(group_scale, block_d, minimum, fold, per_block, g, x_sum, x_scale, out, T, rows, total):
    """_w4a8_rows_loops' minima, in rows_tile's numbers and order (K-quants with a minimum: minimum
    their codes, group g's; [0] else): out[t, 16 g + r] -= the sum over units v, in order, of
    (fp32(x_sum[t, v]) * x_scale[t, v]) * (block_d[32 b + 16 + r] * fp32(minimum[v * 16 + r]), less 8
    * unit_scale_of(v, r) where `fold`); total fp32 [16] is scratch."""
    U = x_sum.shape[1] if minimum.shape[0] else 0
    for t in range(T if U else 0):
        total[:] = 0
        for v in range(U):
            unit = np.float32(x_sum[t, v]) * x_scale[t, v]
            for r in range(ROWS):
                low = block_d[v // per_block * 2 * ROWS + ROWS + r] * np.float32(minimum[v * ROWS + r])
                value = low - np.float32(8) * unit_scale_of(group_scale, block_d, v, r, per_block) if fold else low
                total[r] = total[r] + unit * value
        for r in range(rows):
            out[t, g * ROWS + r] -= total[r]


@kernel_jit()
def _w4a8_rows(codes, scale, minimum, block_scales, q, x_sum, x_scale, out, lo, hi):
    """W4 and GGUF blocks on w4a8 through rows_tile (int8_dot_kernels' "vnni" or "avx2"): groups [lo, hi)
    of RowPlanes' codes, scale, minimum and block_scales (group_scales' forms) against q int8 [T, K]
    (the activation levels as they are), x_sum int32 [T, U], x_scale fp32 [T, U], into out [T, N].
    Every token row of the call runs on a group's 16 rows (8 KB of Q4_0 codes at K = 1024, in L1)
    before the next group, so a prefill reads each weight once; per token row _w4a8_rows_loops' bits."""
    T, N = out.shape
    acc = np.empty((ROWS_TILE, ROWS), np.float32)
    scratch = np.empty(scale.shape[1], np.uint32)
    for g in range(lo, hi):
        group_scale, block_d = group_scales(scale, block_scales, g, scratch)
        rows = min(ROWS, N - g * ROWS)
        t = 0
        while t < T:
            tile = ROWS_TILE if T - t >= ROWS_TILE else 4 if T - t >= 4 else 2 if T - t >= 2 else 1
            if tile == 8:
                _rows_tile_8(codes, group_scale, block_d, minimum[g], q, x_sum, x_scale, acc, g, t)
            elif tile == 4:
                _rows_tile_4(codes, group_scale, block_d, minimum[g], q, x_sum, x_scale, acc, g, t)
            elif tile == 2:
                _rows_tile_2(codes, group_scale, block_d, minimum[g], q, x_sum, x_scale, acc, g, t)
            else:
                _rows_tile_1(codes, group_scale, block_d, minimum[g], q, x_sum, x_scale, acc, g, t)
            for i in range(tile):
                for r in range(rows):
                    out[t + i, g * ROWS + r] = acc[i, r]
            t += tile


@kernel_jit()
def _w4a8_rows_loops(codes, scale, minimum, block_scales, q, x_sum, x_scale, out, lo, hi):
    """_w4a8_rows in plain loops (the "generic" family), the same numbers in the same order: per
    token row t and weight row n = 16 g + r, total = 0, then for each unit v in order total +=
    fp32(dot - offset x_sum[t, v]) * (unit_scale_of(v, n) * x_scale[t, v]), dot the unit's 32
    (Q6_K: 16) products of stored code x level, exact in int32. Nibbles (offset 8): byte (v, p, r,
    s) of a group holds positions 4p + s (low) and 16 + 4p + s (high); bytes (offset 0 here, where
    levels are stored as they are): byte (v, p, r, s) position 4p + s, p < inputs / 4."""
    T, N = out.shape
    U = x_sum.shape[1]
    inputs = q.shape[1] // U  # a unit's: 32, or Q6_K's 16
    nibbles = codes.shape[1] == 256 * U and inputs == 32
    scratch, unit_total = np.empty(scale.shape[1], np.uint32), np.empty(ROWS, np.float32)
    for g in range(lo, hi):
        group_scale, block_d = group_scales(scale, block_scales, g, scratch)
        c = codes[g]
        for t in range(T):
            for r in range(min(ROWS, N - g * ROWS)):
                total = np.float32(0)
                for v in range(U):
                    dot = np.int32(0)
                    if nibbles:
                        for p in range(4):
                            for s in range(4):
                                byte = np.int32(c[v * 256 + p * 64 + r * 4 + s])
                                dot += (byte & 15) * np.int32(q[t, v * 32 + 4 * p + s]) + (byte >> 4) * np.int32(q[t, v * 32 + 16 + 4 * p + s])
                        dot -= 8 * x_sum[t, v]
                    else:
                        for p in range(inputs // 4):
                            for s in range(4):
                                dot += np.int32(np.int8(c[v * 16 * inputs + p * 64 + r * 4 + s])) * np.int32(q[t, v * inputs + 4 * p + s])
                    term = np.float32(dot) * (unit_scale_of(group_scale, block_d, v, r, 256 // inputs) * x_scale[t, v])
                    total = total + term
                out[t, g * ROWS + r] = total
        _rows_minimum(group_scale, block_d, minimum[g], nibbles, 256 // inputs, g, x_sum, x_scale, out, T, min(ROWS, N - g * ROWS), unit_total)


@kernel_jit()
def _w4a16_nibbles(codes, scale, x, units, out, lo, hi):
    """W4 on w4a16: codes uint8 [G, 32, L, 2], byte (p, lane, s) holding positions 2p + s (low nibble)
    and 64 + 2p + s (high) as level + 8, with `units` 128-input units (groups) a row; x fp32 [T, 128, L], bf16-rounded; scale fp32 [G, L]. Per group an fp32 sum over positions
    0..127 in order (each product level * x is exact), then out[t, n] = sum over groups, in order,
    of sum * scale."""
    T, pairs, L = x.shape[0], codes.shape[1], codes.shape[2]
    half = 2 * pairs
    R = L // units
    w = np.empty((2 * half, L), np.float32)
    sums = np.empty(L, np.float32)
    acc = np.empty(R, np.float32)
    for g in range(lo, hi):
        for p in range(pairs):
            for s in range(2):
                for lane in range(L):
                    byte = np.int32(codes[g, p, lane, s])
                    w[2 * p + s, lane] = np.float32((byte & 15) - 8)
                    w[half + 2 * p + s, lane] = np.float32((byte >> 4) - 8)
        for t in range(T):
            sums[:] = 0
            for j in range(2 * half):
                for lane in range(L):
                    sums[lane] += w[j, lane] * x[t, j, lane]
            acc[:] = 0
            for v in range(units):
                for r in range(R):
                    acc[r] += sums[v * R + r] * scale[g, v * R + r]
            for r in range(min(R, out.shape[1] - g * R)):
                out[t, g * R + r] = acc[r]


@kernel_jit()
def _int8_units(x, unit, q, x_scale, unit_sum, lo, hi):
    """The w4a8 route's activations in one pass (quantize_int8_blocks in numpy took ~30 us a call,
    110 calls a 0.8B step): x fp32 [T, K] -> q int8 [T, K], each input's level where the input is;
    x_scale fp32 [T, U]: the scale of the 32-input block holding unit u (absmax / 127); unit_sum
    int32 [T, U]: each unit's sum of levels (what the kernels take the codes' stored offset off
    with). Levels round half to even (np.rint), as quantize_int8_blocks: the same bits. Token rows [lo, hi)."""
    K = x.shape[1]
    per_block = ACT_BLOCK // unit  # units an activation scale covers (2 for Q6_K's 16)
    for t in range(lo, hi):
        for b in range(K // ACT_BLOCK):
            absmax = np.float32(0)
            for i in range(b * ACT_BLOCK, (b + 1) * ACT_BLOCK):
                absmax = max(absmax, abs(x[t, i]))
            scale = absmax / np.float32(INT8_MAX)
            safe = scale if scale > 0 else np.float32(1)
            for u in range(b * per_block, (b + 1) * per_block):
                x_scale[t, u] = scale
                total = np.int32(0)
                for j in range(u * unit, (u + 1) * unit):
                    level = np.rint(x[t, j] / safe)
                    total += np.int32(level)
                    q[t, j] = level
                unit_sum[t, u] = total


# A prefill's rows of activations split between the cores from this many rows; a verify pass's few
# rows take less than handing half over costs.
INT8_UNITS_SPLIT_ROWS = 8

DENSE_GROUP = 4  # weight rows a dense dot loop serves at once: each load of x feeds four products


def weight_value(w):
    """A dense weight as fp32: an fp32 as it is, bf16 bits moved to the top half of an fp32 (exact).
    Compiled per dtype (numba's overload below), in the register the weight is used in."""
    return w if w.dtype == np.float32 else np.uint32(np.uint32(w) << 16).view(np.float32)


if _numba:
    @overload(weight_value, jit_options={"nogil": True})
    def _weight_value_compiled(w):
        if w == _numba.types.uint16:
            return lambda w: as_float32(np.uint32(w) << np.uint32(16))
        return lambda w: w


@kernel_jit(fastmath=True)
def _dense_groups(weight, x, out, lo, hi):
    """Weight [N, K] (fp32, or bf16 bits: weight_value) against fp32 x [T, K], groups [lo, hi) of
    DENSE_GROUP weight rows. fastmath lets LLVM split each dot into vector lanes; the split is fixed
    by K and the compiled loop a weight row runs in (a full group's, or the last rows' one at a
    time), the same for every token row."""
    T, K = x.shape
    N = weight.shape[0]
    for g in range(lo, hi):
        n = g * DENSE_GROUP
        for t in range(T):
            if n + DENSE_GROUP <= N:
                acc0 = acc1 = acc2 = acc3 = np.float32(0)
                for k in range(K):
                    xk = x[t, k]
                    acc0 += weight_value(weight[n, k]) * xk
                    acc1 += weight_value(weight[n + 1, k]) * xk
                    acc2 += weight_value(weight[n + 2, k]) * xk
                    acc3 += weight_value(weight[n + 3, k]) * xk
                out[t, n], out[t, n + 1], out[t, n + 2], out[t, n + 3] = acc0, acc1, acc2, acc3
            else:
                for row in range(n, N):
                    acc = np.float32(0)
                    for k in range(K):
                        acc += weight_value(weight[row, k]) * x[t, k]
                    out[t, row] = acc


@kernel_jit(fastmath=True)
def _dense(weight, x, out, lo, hi):
    """fp32 weight [N, K]: _dense_groups."""
    _dense_groups(weight, x, out, lo, hi)


@kernel_jit(fastmath=True)
def _dense_bf16(bits, x, out, lo, hi):
    """bf16 weight bits [N, K]: _dense_groups, reading 2 bytes a weight; the same dot loops, so the
    same bits as _dense on the widened matrix."""
    _dense_groups(bits, x, out, lo, hi)


def token_rows(x: np.ndarray, K: int) -> np.ndarray:
    """x as the kernels read it: fp32, C-contiguous [T, K]. Any other width is refused here: a kernel
    trusts its K inputs a row and would read past the weights' end."""
    if x.ndim != 2 or x.shape[1] != K:
        raise ValueError(f"token rows of shape {x.shape} for a matrix of {K} inputs")
    return np.ascontiguousarray(x, dtype=np.float32)


def _dense_rows(kernel, weight: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Up to MAX_ROWS token rows through a dense kernel: one weight read for all rows, each row's bits
    as when alone, the weight's row groups split between the cores when the product pays for it."""
    N, K = weight.shape
    x = token_rows(x, K)
    out = np.empty((x.shape[0], N), np.float32)
    split_kernel(kernel, (weight, x, out), -(-N // DENSE_GROUP), split=N * K >= SPLIT_MIN_WEIGHTS)
    return out


@kernel_jit()
def _bf16_lanes(lanes, x, out, lo, hi):
    """bf16 weight lanes [B, K, 32] (B even) against fp32 x [T, K] into out [T, B * 32], pairs of
    blocks of 32 weight rows [lo, hi), through _bf16_tile's tiles (AVX-512 CPUs: bf16_dot_kernels).
    Up to 6 token rows (a verify) run in one tile, more in tiles of 4 first, all on a pair of blocks
    before the next pair: a 5-row verify was a 4-row sweep of the whole matrix and a 1-row one (4
    multiply-add chains, which wait on their latency), 221 us against 131 for 4 rows on a
    [3584, 1024] matrix."""
    T = x.shape[0]
    pair = lo
    if T == 1:
        while hi - pair >= 2:
            _tile_1x4(lanes, x, out, 2 * pair, 0)
            pair += 2
    for b in range(2 * pair, 2 * hi, 2):
        t = 0
        while T - t > 6:
            _tile_4x2(lanes, x, out, b, t)
            t += 4
        rest = T - t
        if rest == 1:
            _tile_1x2(lanes, x, out, b, t)
        elif rest == 2:
            _tile_2x2(lanes, x, out, b, t)
        elif rest == 3:
            _tile_3x2(lanes, x, out, b, t)
        elif rest == 4:
            _tile_4x2(lanes, x, out, b, t)
        elif rest == 5:
            _tile_5x2(lanes, x, out, b, t)
        elif rest == 6:
            _tile_6x2(lanes, x, out, b, t)


@kernel_jit()
def _w4a16_lanes(nibbles, scales, x, out, lo, hi):
    """W4 nibble lanes [B, K, 16] with scales [B, K / 128, 32] against bf16-rounded fp32 x [T, K] into
    out [T, >= B * 32], blocks [lo, hi) of 32 weight rows, through _w4a16_tile's tiles (AVX-512 CPUs:
    w4a16_kernels). All token rows run on a pair of blocks before the next pair, as in _bf16_lanes."""
    T = x.shape[0]
    b = lo
    if T == 1:
        while hi - b >= 4:
            _w4a16_1x4(nibbles, scales, x, out, b, 0)
            b += 4
    while hi - b >= 2:
        t = 0
        while T - t >= 4:
            _w4a16_4x1(nibbles, scales, x, out, b, t)
            _w4a16_4x1(nibbles, scales, x, out, b + 1, t)
            t += 4
        if T - t >= 2:
            _w4a16_2x2(nibbles, scales, x, out, b, t)
            t += 2
        if t < T:
            _w4a16_1x2(nibbles, scales, x, out, b, t)
        b += 2
    if b < hi:
        t = 0
        while T - t >= 4:
            _w4a16_4x1(nibbles, scales, x, out, b, t)
            t += 4
        while t < T:
            _w4a16_1x1(nibbles, scales, x, out, b, t)
            t += 1


@kernel_jit()
def _widen_bf16(bits, wide):
    """wide[:rows] = bf16 bits [rows, K] moved to the top half of uint32s: the fp32 values, exactly
    (numpy's two-pass widening took ~40% of a bf16 prefill's products)."""
    for r in range(bits.shape[0]):
        for k in range(bits.shape[1]):
            wide[r, k] = np.uint32(bits[r, k]) << np.uint32(16)


@kernel_jit(inline="always")  # inlined in numba's IR: delta_rule_rows and delta_replay run the same code
def _delta_row(before, after, q, k, v, beta, decay, update, o):
    """Gated DeltaNet's step for one head and row (REFERENCE.md section 1): S' = e^g S; u = beta (v -
    S'^T k); S' += k u^T; o = S'^T q, in one pass over S for u and one writing S' and summing o.
    before, after [dk, dv] (not the same array: _delta_rows' loops); q, k [dk]; v, o, update (scratch for u) [dv];
    decay = e^g. Each sum runs over dk in order, so a row's bits never depend on the rows run with it
    (cpu_ops.delta_update is the numpy reference)."""
    dk, dv = before.shape
    update[:] = 0
    for i in range(dk):
        for j in range(dv):
            update[j] += (before[i, j] * decay) * k[i]
    for j in range(dv):
        update[j] = (v[j] - update[j]) * beta
    o[:] = 0
    for i in range(dk):
        for j in range(dv):
            after[i, j] = before[i, j] * decay + k[i] * update[j]
            o[j] += after[i, j] * q[i]


@kernel_jit()
def delta_rule_rows(S, q, k, v, beta, decay, last, out, lo, hi):
    """Gated DeltaNet's recurrence row by row (_delta_row) for heads [lo, hi) (heads are independent:
    the cores share them). S [H, dk, dv] the state before the first row (not written); q, k [T, H, dk];
    v [T, H, dv]; beta, decay (e^g) [T, H]; last [H, dk, dv] receives the state after the last row, the
    only state written (a rollback replays the rows it keeps from S: delta_replay); out [T, H, dv]."""
    for h in range(lo, hi):
        _delta_rows(S, q, k, v, beta, decay, h, q.shape[0], last, out)


@kernel_jit(inline="always")
def _delta_rows(S, q, k, v, beta, decay, h, rows, last, out):
    """Head h's first `rows` rows from S[h] into last[h]. Where dv is a multiple of 16 (every head of the
    Qwen3.5 family: 128; the demo's: 64), delta_columns' blocks of value columns. Else _delta_row's
    loops, the states between rows alternating between a scratch state and last[h] so that no row reads
    the array it writes: LLVM then vectorizes its passes (in place, its overlap check sent them to
    scalar code, 2.6x the time of a 4-row verify); every operand a C-contiguous row ([t, h] of C
    arrays), which the vectorizer needs as well."""
    dk, dv = S.shape[1:]
    if dv % 16 == 0:
        for c0 in range(0, dv - dv % 64, 64):
            _delta_columns_64(S, q, k, v, beta, decay, h, rows, last, out, c0)
        for c0 in range(dv - dv % 64, dv, 16):
            _delta_columns_16(S, q, k, v, beta, decay, h, rows, last, out, c0)
        return
    update = np.empty(dv, np.float32)
    if rows == 1:  # a decode step: S to last, no choice of arrays for LLVM to check for overlap
        _delta_row(S[h], last[h], q[0, h], k[0, h], v[0, h], beta[0, h], decay[0, h], update, out[0, h])
        return
    between = np.empty((dk, dv), np.float32)
    for t in range(rows):
        after = last[h] if (rows - 1 - t) % 2 == 0 else between
        before = S[h] if t == 0 else (between if (rows - 1 - t) % 2 == 0 else last[h])
        _delta_row(before, after, q[t, h], k[t, h], v[t, h], beta[t, h], decay[t, h], update, out[t, h])


@kernel_jit()
def _delta_replay(prior, k, v, beta, decay, rows, S):
    """S = prior after rows [0, rows) of delta_rule_rows (their outputs unread: k stands in for q)."""
    out = np.empty((rows, prior.shape[0], v.shape[2]), np.float32)
    if rows == 0:
        S[:] = prior
    for h in range(prior.shape[0]):
        _delta_rows(prior, k, k, v, beta, decay, h, rows, S, out)


def delta_replay(prior: np.ndarray, row_inputs: tuple, rows: int) -> np.ndarray:
    """The state after the first `rows` rows of a delta_rule_rows call, from the state before it and the
    rows' (k, v, beta, decay) it recorded (engine.cache.DeltaNetState.keep): the bits that call had there."""
    S = np.empty_like(prior)
    _delta_replay(prior, *row_inputs, rows, S)
    return S


@kernel_jit(fastmath=True)
def deltanet_heads(mixed, z, b, a, decay_rate, dt_bias, norm, eps, per_key, S, last, k, v, beta, decay, out, lo, hi):
    """Gated DeltaNet after the conv, for T <= 16 rows, every step per value head fused (numpy's
    cpu_ops.CpuOps.deltanet runs ~20 array ops a layer here: ~0.5 ms of a 0.8B decode step's layer):
    q, k L2-normalised (q also by dk^-1/2), beta = sigmoid(b), g = decay_rate * softplus(a + dt_bias),
    the recurrence of delta_rule_rows, then the gated norm o * rsqrt(mean(o^2) + eps) * norm * silu(z).

    mixed [T, 2 Hk dk + Hv dv] (q | k | v after conv and SiLU); z [T, Hv, dv]; b, a [T, Hv];
    S [Hv, dk, dv] the state before; last [Hv, dk, dv] after the last row; k [T, Hv, dk], v [T, Hv, dv],
    beta, decay [T, Hv]: receive the rule's inputs of each row (what delta_replay reads); out
    [T, Hv, dv]; value heads [lo, hi), head h reading key head h // per_key. fastmath vectorizes the
    norms' sums: their order is fixed by dk and dv alone, so a row's bits are the same alone or among others."""
    T, H, dv = z.shape
    dk = S.shape[1]
    Hk = H // per_key
    # delta_rule_rows' other inputs for all heads (this range's filled): its C-contiguous signature, reused
    q, o = np.empty((T, H, dk), np.float32), np.empty((T, H, dv), np.float32)
    for h in range(lo, hi):
        key = h // per_key
        for t in range(T):
            q_sum, k_sum = np.float32(0), np.float32(0)
            for i in range(dk):
                q_sum += mixed[t, key * dk + i] * mixed[t, key * dk + i]
                k_sum += mixed[t, (Hk + key) * dk + i] * mixed[t, (Hk + key) * dk + i]
            q_scale = np.float32(1) / np.sqrt(q_sum + np.float32(1e-6)) * np.float32(dk**-0.5)
            k_scale = np.float32(1) / np.sqrt(k_sum + np.float32(1e-6))
            for i in range(dk):
                q[t, h, i] = mixed[t, key * dk + i] * q_scale
                k[t, h, i] = mixed[t, (Hk + key) * dk + i] * k_scale
            for j in range(dv):
                v[t, h, j] = mixed[t, 2 * Hk * dk + h * dv + j]
            beta[t, h] = np.float32(1) / (np.float32(1) + np.exp(-b[t, h]))
            x = a[t, h] + dt_bias[h]
            log_decay = decay_rate[h] * (max(x, np.float32(0)) + np.log1p(np.exp(-abs(x))))  # g: softplus
            decay[t, h] = np.float32(np.exp(log_decay))
        delta_rule_rows(S, q, k, v, beta, decay, last, o, h, h + 1)
        for t in range(T):
            total = np.float32(0)
            for j in range(dv):
                total += o[t, h, j] * o[t, h, j]
            scale = np.float32(1) / np.sqrt(total / np.float32(dv) + eps)
            for j in range(dv):  # exp_f32 vectorizes; libm's exp is a scalar call a value (~1 us a row of 4 heads of 64)
                gate = z[t, h, j] / (np.float32(1) + exp_f32(-z[t, h, j]))
                out[t, h, j] = o[t, h, j] * scale * norm[j] * gate


# Per-row steps of a decode or verify pass (T <= MAX_ROWS rows). numpy spends more on calling its
# few-element array ops than on their arithmetic there; each step below is one pass instead, and
# every row runs the same loop whatever T is, so a verify row keeps its decode step's bits.


@kernel_jit(fastmath=True, inline="always")  # inlined in numba's IR: its callers pass rows of other layouts
def _rms_norm_row(x, weight, eps, out):
    """out = x * rsqrt(mean(x^2) + eps) * weight for one row x [D]; weight [D]."""
    D = x.shape[0]
    total = np.float32(0)
    for d in range(D):
        total += x[d] * x[d]
    scale = np.float32(1) / np.sqrt(total / np.float32(D) + eps)
    for d in range(D):
        out[d] = x[d] * scale * weight[d]


@kernel_jit(fastmath=True)
def rms_norm_rows(x, weight, eps, out):
    """out[m] = x[m] * rsqrt(mean(x[m]^2) + eps) * weight for the rows of x [M, D]; weight [D]."""
    for m in range(x.shape[0]):
        _rms_norm_row(x[m], weight, eps, out[m])


@kernel_jit(fastmath=True)
def add_rms_norm_rows(x, delta, weight, eps, total, out):
    """total = x + delta, then rms_norm_rows of it into out: a decoder layer's residual add and the
    norm after it in one pass. x, delta, total, out [M, D]; weight [D]."""
    M, D = x.shape
    for m in range(M):
        for d in range(D):
            total[m, d] = x[m, d] + delta[m, d]
    rms_norm_rows(total, weight, eps, out)


@kernel_jit(fastmath=True, inline="always")  # inlined in numba's IR: q and k heads are views of other layouts
def _norm_rope_head(x, weight, eps, position, inv_freq, out):
    """One head x [hd] normed into out [hd]: x * rsqrt(mean(x^2) + eps) * weight (the zero-centred
    norm's 1 + w), then NeoX rotate-half on pairs (i, i + half), i < half = len(inv_freq), by the
    fp32 angle position * inv_freq[i] as cpu_ops.rope_tables forms it, its cosine and sine rounded
    from float64."""
    half = inv_freq.shape[0]
    _rms_norm_row(x, weight, eps, out)
    for i in range(half):
        angle = np.float64(np.float32(position) * inv_freq[i])
        cos, sin = np.float32(np.cos(angle)), np.float32(np.sin(angle))
        first, second = out[i], out[i + half]
        out[i] = first * cos - second * sin
        out[i + half] = second * cos + first * sin


@kernel_jit(fastmath=True)
def qk_norm_rope_rows(qkv, first, q_norm, k_norm, eps, start, inv_freq, q, k):
    """Gated attention's queries and keys for the rows of a decode or verify pass, normed and rotated
    in one pass (numpy's two norms, rope_tables and two apply_rope took ~25 us a layer), from the
    stacked projection qkv [T, heads * 2 hd | kv * hd | kv * hd] (row t at position start + t; per
    query head [query | gate]): q [T - first, heads, hd] for rows first.., k [kv, T, hd] for every row,
    laid out as the cache takes it. A row's bits depend on its own values and position only."""
    T, kv_heads, hd = k.shape[1], k.shape[0], k.shape[2]
    heads = q.shape[1]
    for t in range(T):
        row = qkv[t]
        if t >= first:
            for h in range(heads):
                _norm_rope_head(row[h * 2 * hd : h * 2 * hd + hd], q_norm, eps, start + t, inv_freq, q[t - first, h])
        keys = row[heads * 2 * hd :]
        for j in range(kv_heads):
            _norm_rope_head(keys[j * hd : (j + 1) * hd], k_norm, eps, start + t, inv_freq, k[j, t])


@kernel_jit(fastmath=True)
def swiglu_rows(gate_up, out, lo, hi):
    """out [T, I] = silu(gate) * up for gate_up [T, 2I] (gate features, then up features), token
    rows [lo, hi): a verify pass's few rows, or a prefill's, split between the cores (the gate/up
    product comes out token-major from the compiled Linears; numpy took a transposing copy, then
    exp, divide and multiply passes)."""
    inner = out.shape[1]
    for t in range(lo, hi):
        gate, up, o = gate_up[t, :inner], gate_up[t, inner:], out[t]  # views from 0: no negative-index checks
        for i in range(inner):
            o[i] = gate[i] / (np.float32(1) + exp_f32(-gate[i])) * up[i]


# attend_rows reads keys and values in blocks of this many bytes a KV head (fp32 rows): a block stays
# in L1 while every query head of the group and every verify row takes its turn over it (16 KB beat
# 32 and 128 KB at 1,024-16,384 keys of the 0.8B geometry, most at 16,384 and four rows: 0.36x the
# old kernel's time against 0.41x and 0.45x).
ATTEND_BLOCK_BYTES = 16 * 1024


@kernel_jit(fastmath=True)
def attend_rows(q, keys, values, past, gates, out, lo, hi):
    """Causal GQA for a decode or verify pass, as cpu_ops.attend, gated, for KV heads [lo, hi) and
    the query heads reading them: q [T, heads, hd] at positions past, past + 1, ...; keys, values
    [kv, >= past + T, hd]; gates [T, >= heads * 2 hd], head h's gate at columns h * 2 hd + hd .. (the
    stacked projection's rows: [query | gate] per head); out [T, heads * hd]. Row t reads keys
    0..past + t (query head h reads KV head h // (heads / kv)): scores q.k / sqrt(hd), softmax (max
    subtracted), the weighted sum of values, each over the row's own keys in order, then times
    sigmoid(gate), so a row gets the same bits whatever rows run with it.

    Keys and values go by blocks of ATTEND_BLOCK_BYTES, each served to every query head of its group
    and every row that sees it before the next is read: a row and head at a time read a KV head's
    rows T * group times from memory. 0.8B geometry, 16,384 keys, a layer: one row 10.8 -> 6.3 ms,
    four rows 39.5 -> 17.8 ms on one core; 3.3 and 7.8 ms with the KV heads split between two.
    Within a block, dots and weighted values go four keys at a time from the block's start, the last
    few one by one: which keys go together depends on the row's position alone, not on the rows
    beside it. A dot of 64 terms alone was one chain of multiply-adds and a reduction, latency-bound:
    demo geometry (4 heads, 2 KV heads, head dim 64), one row over 1,000 keys 62 -> 35 us."""
    T, heads, hd = q.shape
    group = heads // keys.shape[0]
    block = max(1, ATTEND_BLOCK_BYTES // (4 * hd))
    scale = np.float32(1) / np.sqrt(np.float32(hd))
    scores = np.empty((T * group, past + T), np.float32)  # row t * group + a: row t, head a of the group
    top = np.empty(T * group, np.float32)
    mass = np.empty(T * group, np.float32)
    for g in range(lo, hi):
        keys_g, values_g = keys[g], values[g]
        top[:] = -np.inf
        for start in range(0, past + T, block):
            for t in range(max(0, start - past), T):  # the rows that see the block's first key
                stop = min(start + block, past + t + 1)
                for a in range(group):
                    query, r = q[t, g * group + a], t * group + a
                    row, best = scores[r], top[r]
                    j = start
                    while j + 4 <= stop:  # four keys' dots side by side: four independent chains, not one
                        k0, k1, k2, k3 = keys_g[j], keys_g[j + 1], keys_g[j + 2], keys_g[j + 3]
                        s0, s1, s2, s3 = np.float32(0), np.float32(0), np.float32(0), np.float32(0)
                        for d in range(hd):
                            s0 += query[d] * k0[d]
                            s1 += query[d] * k1[d]
                            s2 += query[d] * k2[d]
                            s3 += query[d] * k3[d]
                        row[j], row[j + 1], row[j + 2], row[j + 3] = s0 * scale, s1 * scale, s2 * scale, s3 * scale
                        best = max(best, max(max(row[j], row[j + 1]), max(row[j + 2], row[j + 3])))
                        j += 4
                    for j in range(j, stop):
                        key = keys_g[j]
                        total = np.float32(0)
                        for d in range(hd):
                            total += query[d] * key[d]
                        row[j] = total * scale
                        best = max(best, row[j])
                    top[r] = best
        for t in range(T):
            for a in range(group):
                r, h = t * group + a, g * group + a
                row, total = scores[r], np.float32(0)
                for j in range(past + t + 1):
                    row[j] = exp_f32(row[j] - top[r])
                    total += row[j]
                mass[r] = total
                out[t, h * hd : (h + 1) * hd] = 0
        for start in range(0, past + T, block):
            for t in range(max(0, start - past), T):
                stop = min(start + block, past + t + 1)
                for a in range(group):
                    r, h = t * group + a, g * group + a
                    o, row = out[t, h * hd : (h + 1) * hd], scores[r]
                    j = start
                    while j + 4 <= stop:  # four values a pass over o: a quarter of its loads and stores
                        w0, w1, w2, w3 = row[j] / mass[r], row[j + 1] / mass[r], row[j + 2] / mass[r], row[j + 3] / mass[r]
                        v0, v1, v2, v3 = values_g[j], values_g[j + 1], values_g[j + 2], values_g[j + 3]
                        for d in range(hd):
                            o[d] += (w0 * v0[d] + w1 * v1[d]) + (w2 * v2[d] + w3 * v3[d])
                        j += 4
                    for j in range(j, stop):
                        weight, value = row[j] / mass[r], values_g[j]
                        for d in range(hd):
                            o[d] += weight * value[d]
        for t in range(T):
            for a in range(group):
                h = g * group + a
                o, gate = out[t, h * hd : (h + 1) * hd], gates[t, h * 2 * hd + hd : (h + 1) * 2 * hd]
                for d in range(hd):
                    o[d] = o[d] / (np.float32(1) + exp_f32(-gate[d]))


@kernel_jit(fastmath=True, inline="always")
def _q4_image(code_pairs, scales, side, image, byte_scales):
    """A coded row's rotated image (engine/cache.py's Q4KVCache layout, its codes' key and value bytes
    read as one uint16 so that the loads are contiguous), its even elements first:
    image[i] = element 2i (byte i's low nibble), image[hd / 2 + i] = element 2i + 1 (its high nibble),
    each less 8 times its group's scale (scales, fp32); side 0 the key, 1 the value. A byte's two
    elements go to two contiguous halves, not to stores two apart; the query and the value sums follow
    that order. The scales are spread a byte each (byte_scales [hd / 2]) so that one flat loop decodes
    the row: loops of a group's 16 bytes took 2.3x as long."""
    half = image.shape[0] // 2
    per_scale = half // scales.shape[0]  # bytes a scale covers
    for k in range(scales.shape[0]):
        for i in range(k * per_scale, (k + 1) * per_scale):
            byte_scales[i] = scales[k]
    shift = 8 * side  # code_pairs[i]: byte i of the key, and above it byte i of the value
    low, high = image[:half], image[half:]
    for i in range(half):
        byte = (np.int32(code_pairs[i]) >> shift) & 0xFF
        low[i] = np.float32((byte & 0xF) - 8) * byte_scales[i]
        high[i] = np.float32((byte >> 4) - 8) * byte_scales[i]


@kernel_jit(inline="always")
def _even_first(d, half):
    """The element of a row that _q4_image's order puts at d: 2d for the first half, 2(d - half) + 1 after."""
    return 2 * d if d < half else 2 * (d - half) + 1


@kernel_jit(fastmath=True)
def _block_images(code_pairs, scale_bits, sink, ring, start, stop, past, T, exact_rows, side, plains, images, scratch):
    """Cache rows [start, stop)'s keys (side 0) or values (1) for attend_q4_rows, one row each in
    plains (as stored exact: sink or ring) where a row of the pass reads it exact, and in images
    (decoded) where one reads its codes. Row j is exact for the rows t < j + exact_rows - past (their
    window of exact rows reaches it) and always in the sink. Decoded once a block, a row then serves
    every row and query head of the pass from L1; the block's fp16 scales are widened in one
    unit_scales call (scratch: their bits, the widened values, _q4_image's byte_scales)."""
    bits, widened, byte_scales = scratch
    sink_rows, groups = sink.shape[0], scale_bits.shape[1]
    for j in range(start, stop):
        for k in range(groups):
            bits[(j - start) * groups + k] = scale_bits[j, k, side]
    n = (stop - start) * groups
    scales = unit_scales(bits[:n], widened[:n])
    for j in range(start, stop):
        first = max(0, j - past)  # the first row of the pass that sees row j
        coded_from = T if j < sink_rows else max(first, min(T, j + exact_rows - past))
        if first < coded_from:
            stored = sink[j, :, side] if j < sink_rows else ring[j % ring.shape[0], :, side]
            plains[j - start, :] = stored
        if coded_from < T:
            _q4_image(code_pairs[j], scales[(j - start) * groups : (j - start + 1) * groups], side, images[j - start], byte_scales)


@kernel_jit(fastmath=True)
def attend_q4_rows(q, code_pairs, scale_bits, sink, ring, hadamard, signs, exact_rows, past, gates, out, lo, hi):
    """attend_rows over a 4-bit KV cache (engine/cache.py's Q4KVCache: its codes [kv, n, hd / 2, 2]
    read as code_pairs [kv, n, hd / 2] uint16, scale_bits [kv, n, hd / 32, 2] fp16 bits, exact rows in
    sink [kv, s, hd, 2] and the ring [kv, r, hd, 2], key and value side by side) for KV heads [lo, hi):
    row t, at position past + t, reads each key as its decode step's Q4KVCache.rows would give it,
    the first len(sink) and the exact_rows before its own end exact, the others from their codes.

    A coded row holds (x * signs) @ H (H symmetric and orthonormal). Rather than turning every coded
    key and value back (a product of hd^2 each), the query turns once, q . k = ((q * signs) @ H) . r,
    and the coded values are summed as stored and turned back once: sum w x = ((sum w r) @ H) * signs.
    The same sums in another rounding than rotating each row back: within the bound of the rotation's
    products, and a row's bits do not depend on the rows beside it. Every coded row is decoded once a
    pass for every row and query head that reads it: a Q4KVCache.rows call a row decoded and rotated
    back the whole history (0.3 s a token at 4,096 tokens of the 0.8B geometry with 8 layers, 17 ms
    now, 16 with the bf16 cache). A layer's 4,096 coded keys on one core: 2.6 ms, 1.5 for the same keys
    in fp32 (decoding is most of the difference)."""
    T, heads, hd = q.shape
    group = heads // code_pairs.shape[0]
    sink_rows = sink.shape[1]
    scale = np.float32(1) / np.sqrt(np.float32(hd))
    scores = np.empty((T * group, past + T), np.float32)  # row t * group + a: row t, head a of the group
    turned = np.empty((T * group, hd), np.float32)  # (q * signs) @ H
    exact_sum = np.empty((T * group, hd), np.float32)
    coded_sum = np.empty((T * group, hd), np.float32)
    top = np.empty(T * group, np.float32)
    mass = np.empty(T * group, np.float32)
    block = max(1, ATTEND_BLOCK_BYTES // (4 * hd))
    plains, images = np.empty((block, hd), np.float32), np.empty((block, hd), np.float32)  # a block's rows exact, and coded
    groups = block * scale_bits.shape[2]  # scales in a block of rows
    scratch = np.empty(groups, np.uint16), np.empty(groups, np.uint32), np.empty(hd // 2, np.float32)  # _block_images'
    for g in range(lo, hi):
        codes_g, scales_g, sink_g, ring_g = code_pairs[g], scale_bits[g], sink[g], ring[g]
        for t in range(T):
            for a in range(group):
                query, r = q[t, g * group + a], t * group + a
                for e in range(hd):  # in _q4_image's order; H is symmetric: its column is a row, read in order
                    column = hadamard[_even_first(e, hd // 2)]
                    total = np.float32(0)
                    for d in range(hd):
                        total += query[d] * signs[d] * column[d]
                    turned[r, e] = total
        top[:] = -np.inf
        for start in range(0, past + T, block):
            stop = min(start + block, past + T)
            _block_images(codes_g, scales_g, sink_g, ring_g, start, stop, past, T, exact_rows, 0, plains, images, scratch)
            for t in range(max(0, start - past), T):  # the rows that see the block's first key
                for a in range(group):
                    r = t * group + a
                    query, turned_query, best = q[t, g * group + a], turned[r], top[r]
                    for j in range(start, min(stop, past + t + 1)):
                        total = np.float32(0)
                        if j < sink_rows or j >= past + t + 1 - exact_rows:  # exact for this row
                            key = plains[j - start]
                            for d in range(hd):
                                total += query[d] * key[d]
                        else:
                            key = images[j - start]
                            for d in range(hd):
                                total += turned_query[d] * key[d]
                        scores[r, j] = total * scale
                        best = max(best, scores[r, j])
                    top[r] = best
        for r in range(T * group):
            t = r // group
            total = np.float32(0)
            for j in range(past + t + 1):
                scores[r, j] = exp_f32(scores[r, j] - top[r])
                total += scores[r, j]
            mass[r] = total
        exact_sum[:] = 0
        coded_sum[:] = 0
        for start in range(0, past + T, block):
            stop = min(start + block, past + T)
            _block_images(codes_g, scales_g, sink_g, ring_g, start, stop, past, T, exact_rows, 1, plains, images, scratch)
            for t in range(max(0, start - past), T):
                for a in range(group):
                    r = t * group + a
                    exact, coded = exact_sum[r], coded_sum[r]
                    for j in range(start, min(stop, past + t + 1)):
                        weight = scores[r, j] / mass[r]
                        if j < sink_rows or j >= past + t + 1 - exact_rows:
                            value = plains[j - start]
                            for d in range(hd):
                                exact[d] += weight * value[d]
                        else:
                            value = images[j - start]
                            for d in range(hd):
                                coded[d] += weight * value[d]
        for t in range(T):
            for a in range(group):
                r, h = t * group + a, g * group + a
                gate = gates[t, h * 2 * hd + hd : (h + 1) * 2 * hd]
                turned_back = exact_sum[r]  # + (coded_sum @ H) * signs, a row of H at a time (coded_sum in _q4_image's order)
                for d in range(hd):
                    weight, row = coded_sum[r, d], hadamard[_even_first(d, hd // 2)]
                    for e in range(hd):
                        turned_back[e] += weight * row[e] * signs[e]
                for e in range(hd):
                    out[t, h * hd + e] = turned_back[e] / (np.float32(1) + exp_f32(-gate[e]))


@kernel_jit(fastmath=True)
def conv_rows(window, taps_by_lag, out):
    """Depthwise causal conv then SiLU over the T rows after the window's first K - 1: window
    [K - 1 + T, C] (the conv state's rows, then the new rows), taps_by_lag [K, C], out [T, C]; tap j
    reads row t + j, as cpu_ops.causal_conv, and the taps add in j order."""
    T, C = out.shape
    K = taps_by_lag.shape[0]
    for t in range(T):
        o = out[t]
        first, taps = window[t], taps_by_lag[0]
        for c in range(C):
            o[c] = first[c] * taps[c]
        for j in range(1, K):
            row, taps = window[t + j], taps_by_lag[j]
            for c in range(C):
                o[c] += row[c] * taps[c]
        for c in range(C):
            o[c] = o[c] / (np.float32(1) + exp_f32(-o[c]))


@kernel_jit()
def lane_rows(lanes, rows, ids, out):
    """out [n, K] (uint32): the fp32 bits of rows ids [n] of bf16 weight lanes [B, K, 32] holding `rows`
    rows, row i being lane i % 32 of block i // 32 (a tied table's lookups). False, with nothing
    written, if an id is not one of the rows. A row's K values lie 64 bytes apart, a cache line each:
    numpy's fancy index over them took 4.8 us for three rows of the demo (48 us with the table out of
    cache), this 1.2 (17)."""
    for r in range(ids.shape[0]):
        if not 0 <= ids[r] < rows:
            return False
    for r in range(ids.shape[0]):
        block, lane = ids[r] // 32, ids[r] % 32
        for d in range(lanes.shape[1]):
            out[r, d] = np.uint32(lanes[block, d, lane]) << np.uint32(16)  # bf16 is the top half of an fp32
    return True


# ---------------------------------------------------------------------------------------------
# An MTP head's pass in one call (cpu_ops.CpuOps.mtp_rows). A small head's draft pass is some fourteen
# op calls whose arithmetic is a few microseconds each: the demo's one-row pass took 66 us through the
# op set, 38 this way (three rows: 76 and 50). The same kernels run in the same order on the same
# rows, so every row gets the bits the op-by-op pass gives it.
#
# The cores share such a call as a team (threads.in_team): member m of `members` runs kernel(*args, m,
# members) at once with the others. Each product is cut into a chunk a member (pairs of 32-row weight
# blocks, as its parts driver cuts it) and attention into its KV heads; a member claims a stage's chunks
# one by one (tally_add on the stage's claim count) until none is left, then waits until all are done
# (tally_read on its done count) before it reads the stage's output. A member that finds every chunk
# claimed only waits for them, so no member ever waits on one that has not started, and one member
# alone does all: the same kernel runs alone (members = 1) where one core serves, and numba may run a
# team's members one after another. The steps between products (norms, RoPE, SwiGLU, a draft's argmax)
# are a few hundred values: every member computes them itself, the same bits, into arrays of its own.
# Each stage's output has its own place in the call's `shared` array, never reused within the call, so
# a member that comes late reads what that stage wrote. Member 0 alone writes results. On the demo, two
# cores, warm: a commit pass of 3 rows 62 -> 50 us, three greedy drafts 101 -> 75 us (a lone draft, its
# head alone, 10.3 -> 13.5: the team's start costs more than half a 6 us product saves).

TEAM_STAGES_A_PASS = 6  # fc, the qkv projection, attention, o_proj, gate_up, down


@kernel_jit()
def _claim(tally, stage, chunks):
    """The chunk of `stage` this member computes next, or -1 when all are claimed (tally[2 stage]
    counts the claims, tally[2 stage + 1] the chunks done)."""
    taken = tally_add(tally, 2 * stage)
    return taken if taken < chunks else -1


@kernel_jit()
def _finish_stage(tally, stage, chunks):
    """Wait until every chunk of `stage` is done; the next stage."""
    while tally_read(tally, 2 * stage + 1) < chunks:
        pass
    return stage + 1


@kernel_jit()
def _team_product(lanes, x, out, tally, stage, members):
    """out [T, B * 32] = x [T, K] through bf16 weight lanes [B, K, 32] (_bf16_lanes), a chunk of pairs
    of blocks a member, as `stage`; the next stage."""
    pairs = lanes.shape[0] // 2
    chunks = min(members, pairs)
    chunk = _claim(tally, stage, chunks)
    while chunk >= 0:
        _bf16_lanes(lanes, x, out, pairs * chunk // chunks, pairs * (chunk + 1) // chunks)
        tally_add(tally, 2 * stage + 1)
        chunk = _claim(tally, stage, chunks)
    return _finish_stage(tally, stage, chunks)


@kernel_jit()
def _stage_widths(fc, qkv_proj, o_proj, gate_up, down):
    """The widths of an MTP pass's stage outputs: fc's, the qkv projection's, attention's (o_proj's
    input), o_proj's, gate_up's and down's."""
    return (fc.shape[0] * 32, qkv_proj.shape[0] * 32, o_proj.shape[1], o_proj.shape[0] * 32, gate_up.shape[0] * 32,
            down.shape[0] * 32)


@kernel_jit()
def pass_floats(T, first, fc, qkv_proj, o_proj, gate_up, down):
    """The floats of `shared` an MTP pass over T rows takes (mtp_rows): fc's and the qkv projection's
    outputs for every row, the others for rows first.. only."""
    widths = _stage_widths(fc, qkv_proj, o_proj, gate_up, down)
    return T * (widths[0] + widths[1]) + (T - first) * (widths[2] + widths[3] + widths[4] + widths[5])


@kernel_jit()
def draft_floats(draft_rows, fc, qkv_proj, o_proj, gate_up, down):
    """The floats of `shared` a draft takes (mtp_greedy_drafts, compiled_sampling.mtp_sampled_drafts):
    its head's scores, then its one-row pass's outputs."""
    return draft_rows.shape[0] * 32 + pass_floats(1, 0, fc, qkv_proj, o_proj, gate_up, down)


def _head_linears(head: tuple) -> tuple:
    """fc, qkv_proj, o_proj, gate_up and down of the MTP kernels' shared arguments (mtp_rows' norms..down)."""
    return head[2], head[3], head[12], head[13], head[14]


def pass_scratch(T: int, first: int, head: tuple) -> tuple[np.ndarray, np.ndarray]:
    """shared and tally (zeros) for mtp_rows over T rows from `first`, alone or as a team; head: the
    kernels' shared arguments (cpu_ops.MTPPlan.head_args)."""
    floats = pass_floats(T, first, *_head_linears(head))
    return np.empty(floats, np.float32), np.zeros(2 * TEAM_STAGES_A_PASS, np.int64)


def drafting_scratch(k: int, draft_rows, head: tuple) -> tuple[np.ndarray, np.ndarray]:
    """shared and tally (zeros) for k drafts in one call (mtp_greedy_drafts, compiled_sampling.mtp_sampled_drafts):
    a head product and a one-row pass a draft."""
    floats = k * draft_floats(draft_rows, *_head_linears(head))
    return np.empty(floats, np.float32), np.zeros(2 * k * (1 + TEAM_STAGES_A_PASS), np.int64)


@kernel_jit()
def _rows_of(shared, at, rows, width):
    """shared[at : at + rows * width] as rows [rows, width]."""
    return shared[at : at + rows * width].reshape((rows, width))


@kernel_jit()
def _draft_places(shared, i, draft_rows, fc, qkv_proj, o_proj, gate_up, down):
    """Draft i's places in `shared`: its head's scores [1, S], its pass's outputs."""
    size = draft_floats(draft_rows, fc, qkv_proj, o_proj, gate_up, down)
    scores = _rows_of(shared, i * size, 1, draft_rows.shape[0] * 32)
    return scores, shared[i * size + draft_rows.shape[0] * 32 : (i + 1) * size]


@kernel_jit()
def _mtp_pass(embedded, hidden, norms, eps, fc, qkv_proj, heads, q_norm, k_norm, start, inv_freq, keys, values,
              past, o_proj, gate_up, down, first, out, shared, tally, stage, members):
    """A member's part of mtp_rows' pass from `stage` on, the stage outputs in shared (pass_floats),
    out its own; the stage after the pass."""
    T, H = hidden.shape
    kv, hd = keys.shape[0], keys.shape[2]
    R = T - first
    widths = _stage_widths(fc, qkv_proj, o_proj, gate_up, down)
    x, qkv = _rows_of(shared, 0, T, widths[0]), _rows_of(shared, T * widths[0], T, widths[1])
    at = T * (widths[0] + widths[1])
    attended = _rows_of(shared, at, R, widths[2])
    projected = _rows_of(shared, at + R * widths[2], R, widths[3])
    gate_and_up = _rows_of(shared, at + R * (widths[2] + widths[3]), R, widths[4])
    lowered = _rows_of(shared, at + R * (widths[2] + widths[3] + widths[4]), R, widths[5])
    e, h = np.empty((T, H), np.float32), np.empty((T, H), np.float32)
    rms_norm_rows(embedded, norms[0], eps, e)
    rms_norm_rows(hidden, norms[1], eps, h)
    both = np.empty((T, 2 * H), np.float32)  # [embedding ; hidden], as fc reads them
    both[:, :H] = e
    both[:, H:] = h
    stage = _team_product(fc, both, x, tally, stage, members)
    normed = np.empty((T, H), np.float32)
    rms_norm_rows(x, norms[2], eps, normed)
    stage = _team_product(qkv_proj, normed, qkv, tally, stage, members)  # [T, heads * 2 hd | kv * hd | kv * hd]
    q, k = np.empty((R, heads, hd), np.float32), np.empty((kv, T, hd), np.float32)
    qk_norm_rope_rows(qkv, first, q_norm, k_norm, eps, start, inv_freq, q, k)
    v = 2 * heads * hd + kv * hd  # the first value column
    j = _claim(tally, stage, kv)
    while j >= 0:  # a KV head a chunk: its keys and values cached, then the query heads that read them
        for t in range(T):
            keys[j, past + t] = k[j, t]
            values[j, past + t] = qkv[t, v + j * hd : v + (j + 1) * hd]
        attend_rows(q, keys, values, past + first, qkv[first:], attended, j, j + 1)
        tally_add(tally, 2 * stage + 1)
        j = _claim(tally, stage, kv)
    stage = _finish_stage(tally, stage, kv)
    stage = _team_product(o_proj, attended, projected, tally, stage, members)
    residual, normed = np.empty((R, H), np.float32), np.empty((R, H), np.float32)
    add_rms_norm_rows(x[first:], projected, norms[3], eps, residual, normed)
    stage = _team_product(gate_up, normed, gate_and_up, tally, stage, members)
    gated = np.empty((R, gate_and_up.shape[1] // 2), np.float32)
    swiglu_rows(gate_and_up, gated, np.int64(0), R)
    stage = _team_product(down, gated, lowered, tally, stage, members)
    add_rms_norm_rows(residual, lowered, norms[4], eps, np.empty_like(residual), out)
    return stage


@kernel_jit()
def mtp_rows(embedded, hidden, norms, eps, fc, qkv_proj, heads, q_norm, k_norm, start, inv_freq, keys, values,
             past, o_proj, gate_up, down, first, out, shared, tally, member, members):
    """Model.mtp_forward's pass over T rows: embedded [T, H] (the table rows of the tokens x_{t+1}),
    hidden [T, H] (h_t); norms [5, H]: the embedding's, the hidden state's, the layer's input and
    post-attention norms and the head's final norm; the Linears as bf16 lanes (rows a multiple of 64).
    The layer's keys and values go to keys, values [kv, >= past + T, hd] at rows past..; row t sits at
    position start + t. out [T - first, H]: the head's output for rows first.. (first = T - 1: the
    last row alone, whose attention and feed-forward alone run, as LAST_ROW_ALONE lets the op set).
    Member `member` of a team of `members` (threads.in_team): shared of pass_floats(T, first, ...) floats,
    tally zeros [2 TEAM_STAGES_A_PASS]."""
    _mtp_pass(embedded, hidden, norms, eps, fc, qkv_proj, heads, q_norm, k_norm, start, inv_freq, keys, values, past,
              o_proj, gate_up, down, first, out if member == 0 else np.empty_like(out), shared, tally, 0, members)


@kernel_jit()
def mtp_draft_pass(token, embed, h, norms, eps, fc, qkv_proj, heads, q_norm, k_norm, start, inv_freq, keys, values, past,
                   o_proj, gate_up, down, shared, tally, stage, members):
    """A drafting member's next MTP output: h [1, H] becomes mtp_rows' pass over draft `token` (its row of
    the tied table's lanes `embed`) and h, at `start`, its key and value cached at row `past`, its stage
    outputs in shared from `stage` on; the stage after it."""
    table_row, out = np.empty(h.shape, np.uint32), np.empty(h.shape, np.float32)  # the draft's table row as fp32 bits
    lane_rows(embed, embed.shape[0] * 32, np.full(1, token), table_row)  # a drafted id: one of the rows
    stage = _mtp_pass(table_row.view(np.float32), h, norms, eps, fc, qkv_proj, heads, q_norm, k_norm, start, inv_freq,
                      keys, values, past, o_proj, gate_up, down, np.int64(0), out, shared, tally, stage, members)
    h[:] = out
    return stage


@kernel_jit()
def draft_scores(draft_rows, h, shared, i, fc, qkv_proj, o_proj, gate_up, down, tally, stage, members):
    """Draft i's head scores [1, S] over the draft rows (bf16 lanes) from h [1, H], computed by the team
    into their place in shared; (the scores, draft i's pass's place, the next stage)."""
    scores, place = _draft_places(shared, i, draft_rows, fc, qkv_proj, o_proj, gate_up, down)
    return scores, place, _team_product(draft_rows, h, scores, tally, stage, members)


@kernel_jit()
def mtp_greedy_drafts(hidden, embed, draft_rows, draft_ids, norms, eps, fc, qkv_proj, heads, q_norm, k_norm, start, inv_freq,
                      keys, values, past, o_proj, gate_up, down, drafts, shared, tally, member, members):
    """A drafter's greedy MTP drafts in one call: drafts[i] is the draft head's argmax over its rows
    (draft_rows: bf16 lanes of the ids draft_ids; the first of equal maxima, or the first NaN, as
    np.argmax) on the MTP output h, first hidden [1, H]; while more are asked, h becomes mtp_rows' pass
    over that draft (its row of the tied table's lanes `embed`) at the next position, its keys and
    values cached at rows past, past + 1, ... Per draft this is what Model.draft_greedy_ids and
    Model.mtp_forward compute, with the same kernels, so the same ids. Member `member` of a team of
    `members` (threads.in_team): shared of k draft_floats(...), tally zeros [2 k (1 + TEAM_STAGES_A_PASS)]."""
    h, stage = hidden.copy(), 0
    for i in range(drafts.shape[0]):
        scores, place, stage = draft_scores(draft_rows, h, shared, i, fc, qkv_proj, o_proj, gate_up, down, tally, stage, members)
        best, top = 0, scores[0, 0]
        if top == top:
            for j in range(1, draft_ids.shape[0]):
                if scores[0, j] != scores[0, j]:
                    best = j
                    break
                if scores[0, j] > top:
                    best, top = j, scores[0, j]
        if member == 0:
            drafts[i] = draft_ids[best]
        if i + 1 < drafts.shape[0]:
            stage = mtp_draft_pass(draft_ids[best], embed, h, norms, eps, fc, qkv_proj, heads, q_norm, k_norm, start + i,
                                   inv_freq, keys, values, past + i, o_proj, gate_up, down, place, tally, stage, members)


# ---------------------------------------------------------------------------------------------
# Repacking at load.


# Parts drivers (parts_driver), one a kernel that products split, written out: numba's disk cache
# missed every run for a driver made by a closure over its kernel or taking the kernel as an argument
# (~14 s of compiling at each load).
def _parallel_jit(driver):
    return _numba.njit(parallel=True, nogil=True, cache=True, error_model="numpy")(driver) if _numba else None


_prange = _numba.prange if _numba else range


@_parallel_jit
def _w4a8_bytes_parts(args, n, parts):
    for p in _prange(parts):
        _w4a8_bytes(*args, n * p // parts, n * (p + 1) // parts)


@_parallel_jit
def _w4a8_byte_quads_parts(args, n, parts):
    for p in _prange(parts):
        _w4a8_byte_quads(*args, n * p // parts, n * (p + 1) // parts)


@_parallel_jit
def _w4a8_rows_parts(args, n, parts):
    for p in _prange(parts):
        _w4a8_rows(*args, n * p // parts, n * (p + 1) // parts)


@_parallel_jit
def _w4a8_rows_loops_parts(args, n, parts):
    for p in _prange(parts):
        _w4a8_rows_loops(*args, n * p // parts, n * (p + 1) // parts)


@_parallel_jit
def _w4a16_nibbles_parts(args, n, parts):
    for p in _prange(parts):
        _w4a16_nibbles(*args, n * p // parts, n * (p + 1) // parts)


@_parallel_jit
def _dense_parts(args, n, parts):
    for p in _prange(parts):
        _dense(*args, n * p // parts, n * (p + 1) // parts)


@_parallel_jit
def _dense_bf16_parts(args, n, parts):
    for p in _prange(parts):
        _dense_bf16(*args, n * p // parts, n * (p + 1) // parts)


@_parallel_jit
def _bf16_lanes_parts(args, n, parts):
    for p in _prange(parts):
        _bf16_lanes(*args, n * p // parts, n * (p + 1) // parts)


@_parallel_jit
def _w4a16_lanes_parts(args, n, parts):
    for p in _prange(parts):
        _w4a16_lanes(*args, n * p // parts, n * (p + 1) // parts)


@_parallel_jit
def _int8_units_parts(args, n, parts):
    for p in _prange(parts):
        _int8_units(*args, n * p // parts, n * (p + 1) // parts)


@_parallel_jit
def _swiglu_rows_parts(args, n, parts):
    for p in _prange(parts):
        swiglu_rows(*args, n * p // parts, n * (p + 1) // parts)


@_parallel_jit
def _deltanet_heads_parts(args, n, parts):
    for p in _prange(parts):
        deltanet_heads(*args, n * p // parts, n * (p + 1) // parts)


@_parallel_jit
def _attend_rows_parts(args, n, parts):
    for p in _prange(parts):
        attend_rows(*args, n * p // parts, n * (p + 1) // parts)


@_parallel_jit
def _attend_q4_rows_parts(args, n, parts):
    for p in _prange(parts):
        attend_q4_rows(*args, n * p // parts, n * (p + 1) // parts)


_PARTS_DRIVERS = {_w4a8_bytes: _w4a8_bytes_parts, _w4a8_byte_quads: _w4a8_byte_quads_parts,
                  _w4a8_rows: _w4a8_rows_parts, _w4a8_rows_loops: _w4a8_rows_loops_parts,
                  _w4a16_nibbles: _w4a16_nibbles_parts, _dense: _dense_parts, _dense_bf16: _dense_bf16_parts,
                  _bf16_lanes: _bf16_lanes_parts, _w4a16_lanes: _w4a16_lanes_parts, deltanet_heads: _deltanet_heads_parts, _int8_units: _int8_units_parts,
                  swiglu_rows: _swiglu_rows_parts, attend_rows: _attend_rows_parts,
                  attend_q4_rows: _attend_q4_rows_parts}


# Team drivers (threads.in_team): the members of a team kernel (the MTP section) on numba's threads at once.
@_parallel_jit
def mtp_rows_team(args, members):
    for member in _prange(members):
        mtp_rows(*args, np.int64(member), members)  # prange's index is unsigned: one signature, not two


@_parallel_jit
def mtp_greedy_drafts_team(args, members):
    for member in _prange(members):
        mtp_greedy_drafts(*args, np.int64(member), members)  # prange's index is unsigned: one signature, not two


@dataclass(frozen=True)
class UnitPlanes:
    """A quantized matrix [N, K] as the kernels read it (module docstring, kernel shapes: lane v * R + r).

    codes    `nibbles` (W4 for the w4a16 loops; levels -8..7 + 8, two a byte): uint8 [G, unit/4, L, 2],
             byte (p, lane, s) holding positions 2p + s and unit/2 + 2p + s. Else one level a byte:
             int8 [G, unit, L]; or, `quads`, uint8 [G, unit/4, L, 4], level + QUAD_BIAS of position
             4p + s (as this CPU's quad_columns reads it). (W4 and GGUF blocks on w4a8: RowPlanes.)
    scale    [G, L]: the weight scale of each unit, fp32 (bf16 or a product of f16s, exact)
    Rows past N (the last group's padding) have level 0 and scale 0.
    """

    codes: np.ndarray
    scale: np.ndarray
    rows: int
    group: int  # weight rows side by side in a group (R)
    unit: int
    nibbles: bool
    quads: bool  # laid out for the quad_columns kernels (int8_dot_kernels' "vnni" or "avx2")

    @property
    def units(self) -> int:
        return self.K // self.unit

    @property
    def K(self) -> int:
        return self.codes.shape[2] // self.group * self.unit

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.K

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    @property
    def width(self) -> int:
        """Adjacent positions a lane holds in a run: 4 (quads), 2 (nibble pairs) or 1."""
        return self.codes.shape[3]

    @property
    def flat_codes(self) -> np.ndarray:
        """codes as [G, positions * L] (a view): the w4a8 kernels loop over a group's bytes flat."""
        return self.codes.reshape(self.codes.shape[0], -1)


MIN_LANES = 256  # lanes a group should have at least: R = ceil(256 / U), at most MAX_GROUP rows (256 rather
# than 128: a group's fixed costs, the fold and the rescale, spread over twice the weights; -10% time)
MAX_GROUP = 8
REPACK_ROWS_WEIGHTS = 1 << 20  # weights repacked at a time


def rows_per_group(units: int) -> int:
    return max(1, min(MAX_GROUP, -(-MIN_LANES // units)))


def repack(weight: W4Weight | TrellisWeight, unit: int, quads: bool = False) -> UnitPlanes:
    """Lay a matrix's levels out by units of `unit` inputs, R rows side by side, a chunk of rows at a
    time split between the cores. Two levels a byte for W4 (the w4a16 loops, _w4a16_nibbles);
    `quads`: in runs of four positions a lane, for the quad_columns kernels (UnitPlanes.codes)."""
    N, K = weight.shape
    U = K // unit
    R = rows_per_group(U)
    G = -(-N // R)
    nibbles = isinstance(weight, W4Weight)
    width = 4 if quads else 2 if nibbles else 1  # adjacent positions a lane
    positions = unit // 2 if nibbles else unit  # bytes a unit has in a row
    codes = np.empty((G, positions // width, R * U, width), np.uint8 if quads or nibbles else np.int8)
    flip = QUAD_BIAS if quads and not nibbles else 0  # level + 128 on vnni
    scale = np.empty((G, R * U), np.float32)
    step = R * max(1, REPACK_ROWS_WEIGHTS // K // R)  # whole groups

    def lanes(values: np.ndarray) -> np.ndarray:
        """[r, ..., U] rows -> [ceil(r / R), ..., U * R], unit v of the group's row r at lane v * R + r;
        a last, partial group is padded with level 0 (nibble code 0x88) and scale 0."""
        rows, pad = values.shape[0], -values.shape[0] % R
        if pad:
            fill = 0x88 if nibbles and values.dtype == np.uint8 else 0
            values = np.concatenate([values, np.full((pad, *values.shape[1:]), fill, values.dtype)])
        grouped = values.reshape((rows + pad) // R, R, *values.shape[1:-1], U)
        return np.moveaxis(grouped, 1, -1).reshape((rows + pad) // R, *values.shape[1:-1], U * R)

    def chunks(lo: int, hi: int) -> None:
        for start in range(lo * step, min(N, hi * step), step):
            stop = min(N, start + step)
            first, last = start // R, -(-stop // R)
            by_unit, unit_scale = _units(weight, start, stop, unit, nibbles)
            laid = lanes(by_unit)  # [g, positions, L]: nibbles' byte j holds positions j and j + unit/2
            by_width = laid.reshape(last - first, positions // width, width, R * U).transpose(0, 1, 3, 2)
            codes[first:last] = by_width.astype(np.int16) + flip if flip else by_width
            scale[first:last] = lanes(unit_scale)

    in_parallel(chunks, -(-N // step))
    return UnitPlanes(codes, scale, N, R, unit, nibbles, quads)


def _units(weight: W4Weight | BlockMatrix | TrellisWeight, start: int, stop: int, unit: int, nibbles: bool):
    """Rows start..stop as (codes [r, positions, U], scale [r, U]), through the form's codec
    (engine/quant; K-quants, whose minimum this leaves out, go through _k_blocks_to_rows). Trellis
    levels come decoded to int8 (the route applies the row scale after the sum, so their unit scales
    are 1). `nibbles`: two levels a byte, positions j and j + unit/2, each + 8 (W4's -8..7)."""
    rows = stop - start
    if isinstance(weight, TrellisWeight):
        levels, _ = weight.decode_rows(start, stop)  # [r, K/128, 128], rotated basis
        by_unit = levels.astype(np.int8).transpose(0, 2, 1)
        return by_unit, np.ones((rows, by_unit.shape[2]), np.float32)
    levels, sub_scale, _ = weight.decode_rows(start, stop)  # [r, S, sub], [r, S]
    per_sub = levels.shape[2] // unit  # units one scale covers
    by_unit = levels.reshape(rows, -1, unit).transpose(0, 2, 1)  # [r, unit, U]
    if nibbles:
        stored = (by_unit + 8).astype(np.uint8)
        by_unit = stored[:, : unit // 2] | (stored[:, unit // 2 :] << np.uint8(4))
    return by_unit, np.repeat(sub_scale, per_sub, axis=1)


@dataclass(frozen=True)
class RowPlanes:
    """W4 or GGUF levels as _w4a8_rows reads them: ROWS weight rows side by side in a group, by
    units of inputs under one scale, a row's four bytes of a quad of positions in one int32 lane.

    codes  uint8 [G, U * 256] `nibbles` (W4, Q4_0: level + 8, two a byte; Q4_K: its 0..15 levels as
           they are, its minimum less 8 scales): group g's byte v * 256 + p * 64 + r * 4 + s holds
           row 16 g + r's positions 4p + s (low nibble) and 16 + 4p + s (high) of unit v, Q4_0's own
           block bytes 2 + 4p + s; or [G, U * 16 * unit] (Q8_0, Q5_K, Q6_K, IQ4_XS: one level a byte,
           + QUAD_BIAS as this CPU's rows_tile reads it): byte v * 16 unit + p * 64 + r * 4 + s is
           position 4p + s, Q8_0's block byte 2 + 4p + s
    scale  [G, U * 16]: unit v's scale of row 16 g + r at v * 16 + r; Q4_0's and Q8_0's f16 bits as
           their blocks hold them, fp32 (W4's bf16 group scale for each of its units, IQ4_XS's
           sub-block scale), or a K-quant's sub-block scale code (int8: Q4_K's and Q5_K's 6 bits,
           Q6_K's int8), multiplied by its block's d as rows_tile uses it
    minimum int8 [G, U * 16] for Q4_K and Q5_K: the minimum's code, times dmin (weight = scale x
           level - minimum), else [G, 0]
    block_scales uint16 [G, B * 32] for K-quants: block b's f16 d of row 16 g + r at 32 b + r, dmin
           at 32 b + 16 + r, else [G, 0]. A K-quant's scales so take ~1/16 of a byte a weight, as in
           its file (fp32 products took 1/4 to 1/2 a byte: a Q4_K_M file's planes were 1.41x its
           bytes, 1.15x so)
    unit   inputs a unit (one scale) holds: 32, or Q6_K's 16 (bytes [G, U * 256], 4 quads a unit)
    Rows past N (the last group's padding) have level 0 and scale 0."""

    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray
    block_scales: np.ndarray
    rows: int
    nibbles: bool
    unit: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.codes.shape[1] // (8 if self.nibbles else 16)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.minimum.nbytes + self.block_scales.nbytes

    def leading(self, groups: int) -> RowPlanes:
        """The first `groups` groups alone (views, no copy)."""
        return replace(self, codes=self.codes[:groups], scale=self.scale[:groups], minimum=self.minimum[:groups],
                       block_scales=self.block_scales[:groups], rows=groups * ROWS)


def repack_rows(weight: W4Weight | BlockMatrix, flip: int = 0) -> RowPlanes:
    """A W4 or GGUF matrix as RowPlanes, a chunk of groups at a time split between the cores: Q4_0's
    and Q8_0's bytes move as they are (_blocks_to_rows), K-quants' are decoded in one compiled pass
    (_k_blocks_to_rows: a 0.8B Q4_K_M file's Q6_K head took 1.0 s through the codec, 0.2 s so), other
    levels come through their codec; byte levels xor `flip` (QUAD_BIAS for vnni)."""
    N, K = weight.shape
    unit = min(ACT_BLOCK, weight.block_size())  # 32, or Q6_K's 16
    U, G = K // unit, -(-N // ROWS)
    as_stored = isinstance(weight, BlockMatrix) and weight.qtype.name in ("Q4_0", "Q8_0")
    nibbles = isinstance(weight, W4Weight) or weight.qtype.name in ("Q4_0", "Q4_K")  # Q4_K: its 0..15 levels as they are
    k_quant = isinstance(weight, BlockMatrix) and weight.qtype.name in K_QUANT_KINDS
    codes = np.empty((G, U * (256 if nibbles else 16 * unit)), np.uint8)
    scale = np.empty((G, U * ROWS), np.uint16 if as_stored else np.int8 if k_quant else np.float32)
    minimum = np.empty((G, U * ROWS if k_quant and weight.qtype.name != "Q6_K" else 0), np.int8)
    block_scales = np.empty((G, K // 256 * 2 * ROWS if k_quant else 0), np.uint16)
    step = max(1, REPACK_ROWS_WEIGHTS // K // ROWS)  # groups at a time

    def by_group(values: np.ndarray, pad: int, fill) -> np.ndarray:
        """Rows [r, U] or [r, U, p, s] padded with `fill` to whole groups -> per group [v, (p,) r, (s)], flat."""
        values = np.concatenate([values, np.full((pad, *values.shape[1:]), fill, values.dtype)])
        grouped = values.reshape(-1, ROWS, *values.shape[1:])  # [g, r, v, ...]
        if grouped.ndim == 3:
            return grouped.transpose(0, 2, 1).reshape(len(grouped), -1)
        return grouped.transpose(0, 2, 3, 1, 4).reshape(len(grouped), -1)

    if isinstance(weight, BlockMatrix):  # read-only, as a file's memory map (a shortlist's rows are a copy): one signature
        raw = weight.raw.view()
        raw.flags.writeable = False

    def chunks(lo: int, hi: int) -> None:
        for first in range(lo * step, min(G, hi * step), step):
            last = min(G, first + step)
            start, stop = first * ROWS, min(N, last * ROWS)
            if as_stored:
                _blocks_to_rows(raw, codes, scale, first, last, 0 if nibbles else flip, 0x88 if nibbles else flip)
            elif k_quant:
                _k_blocks_to_rows(raw, K_QUANT_KINDS[weight.qtype.name], codes, scale, minimum, block_scales, first, last, flip)
            else:
                by_unit, unit_scale = _units(weight, start, stop, unit, nibbles)  # [r, positions, U], [r, U]
                pad = (last - first) * ROWS - (stop - start)
                quads = by_unit.transpose(0, 2, 1).reshape(stop - start, U, -1, 4)  # [r, v, p, s]
                if not nibbles:  # int8 levels as this family's kernel reads them
                    quads = (quads.astype(np.int16) ^ flip).astype(np.uint8) if flip else quads.astype(np.int8).view(np.uint8)
                codes[first:last] = by_group(quads, pad, 0x88 if nibbles else flip)
                scale[first:last] = by_group(unit_scale.astype(np.float32), pad, 0)
            if isinstance(weight, BlockMatrix):
                release_file_pages(weight.raw[start:stop])

    in_parallel(chunks, -(-G // step))
    return RowPlanes(codes, scale, minimum, block_scales, N, nibbles, unit)


@kernel_jit()
def _blocks_to_rows(raw, codes, scale, first, last, flip, fill):
    """Q4_0 or Q8_0 blocks [N, U * (2 + payload)] (bytes: f16 scale, then the payload: Q4_0's byte j
    holding positions j and j + 16 as nibble + 8, Q8_0's byte j position j) -> RowPlanes codes and
    f16 scale bits of groups [first, last): payload byte j of row 16 g + r's block v to codes[g,
    v * 16 * payload + j // 4 * 64 + r * 4 + j % 4], xor flip; rows past N get `fill` and scale 0."""
    N = raw.shape[0]
    U = scale.shape[1] // ROWS
    block = raw.shape[1] // U
    payload = block - 2
    for g in range(first, last):
        for r in range(ROWS):
            n = g * ROWS + r
            for v in range(U):
                for j in range(payload):
                    at = v * 16 * payload + j // 4 * 64 + r * 4 + j % 4
                    codes[g, at] = raw[n, v * block + 2 + j] ^ flip if n < N else fill
                bits = np.uint16(raw[n, v * block]) | (np.uint16(raw[n, v * block + 1]) << np.uint16(8)) if n < N else np.uint16(0)
                scale[g, v * ROWS + r] = bits


K_QUANT_KINDS = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2}  # _k_blocks_to_rows' kind


@kernel_jit()
def _k_blocks_to_rows(raw, kind, codes, scale, minimum, block_scales, first, last, flip):
    """Q4_K, Q5_K or Q6_K blocks (kind 0, 1, 2; layouts: engine/quant/gguf_blocks.py) [N, B * type size]
    -> RowPlanes of groups [first, last), as repack_rows' codec path lays them (a unit is a sub-block):
    Q4_K's 0..15 levels as nibbles (positions j and 16 + j of a unit in byte j); Q5_K's and Q6_K's
    levels (Q6_K's q - 32) a byte each, xor flip; each unit's scale code (and minimum code) and each
    block's f16 d (and dmin) bits as the block holds them (rows_tile multiplies them as the codec
    does). Rows past N: level 0, scale 0. One pass over the file's bytes: the codec path decoded to
    fp32 levels and reordered them in numpy."""
    N = raw.shape[0]
    unit = 16 if kind == 2 else 32
    U = scale.shape[1] // ROWS
    per_block = 256 // unit  # units (sub-blocks) a block
    blocks = U // per_block
    size = raw.shape[1] // blocks
    levels = np.empty(256, np.int32)
    sc, mn = np.zeros(16, np.int32), np.zeros(8, np.int32)
    for g in range(first, last):
        for r in range(ROWS):
            n = g * ROWS + r
            for b in range(blocks):
                block = raw[n, b * size : (b + 1) * size] if n < N else raw[0, 0:size]
                d_at, dmin_at = (208, 0) if kind == 2 else (0, 2)  # the f16 d's (and dmin's) bytes
                if n >= N:  # as the codec path pads: nibbles 0x88 (the kernels' - 8 leaves 0), bytes level 0
                    levels[:] = 8 if kind == 0 else 0
                    sc[:], mn[:] = 0, 0
                elif kind == 2:  # Q6_K: ql[128] | qh[64] | scales int8[16] | d
                    for e in range(256):
                        h, half, byte = e // 128, (e % 128) // 64, e % 64
                        low = (np.int32(block[64 * h + byte]) >> (4 * half)) & 15
                        high = (np.int32(block[128 + 32 * h + e % 32]) >> (2 * ((e % 128) // 32))) & 3
                        levels[e] = (low | (high << 4)) - 32
                    for j in range(16):
                        sc[j] = np.int32(np.int8(block[192 + j]))
                else:  # Q4_K / Q5_K: d | dmin | scales[12] | (Q5_K: qh[32]) | qs[128]
                    qs = 16 if kind == 0 else 48
                    for e in range(256):
                        sub, i = e // 32, e % 32
                        levels[e] = (np.int32(block[qs + 32 * (sub // 2) + i]) >> (4 * (sub % 2))) & 15
                        if kind == 1:
                            levels[e] |= ((np.int32(block[16 + i]) >> sub) & 1) << 4
                    for j in range(4):  # k_scale_min's 6-bit fields
                        sc[j], mn[j] = np.int32(block[4 + j]) & 63, np.int32(block[8 + j]) & 63
                        sc[4 + j] = (np.int32(block[12 + j]) & 15) | ((np.int32(block[4 + j]) >> 2) & 48)
                        mn[4 + j] = (np.int32(block[12 + j]) >> 4) | ((np.int32(block[8 + j]) >> 2) & 48)
                d_bits = np.uint16(block[d_at]) | (np.uint16(block[d_at + 1]) << np.uint16(8))
                dmin_bits = np.uint16(block[dmin_at]) | (np.uint16(block[dmin_at + 1]) << np.uint16(8))
                block_scales[g, 2 * b * ROWS + r] = d_bits if n < N else 0
                block_scales[g, (2 * b + 1) * ROWS + r] = dmin_bits if n < N and kind != 2 else 0
                for j in range(per_block):
                    v = b * per_block + j
                    scale[g, v * ROWS + r] = sc[j]
                    if kind != 2:
                        minimum[g, v * ROWS + r] = mn[j]
                    for p in range(unit // 4 if kind != 0 else 4):
                        for q in range(4):
                            if kind == 0:  # nibbles: positions 4p + q (low) and 16 + 4p + q (high) of unit v
                                codes[g, v * 256 + p * 64 + r * 4 + q] = np.uint8(levels[j * unit + 4 * p + q] | (levels[j * unit + 16 + 4 * p + q] << 4))
                            else:
                                codes[g, v * 16 * unit + p * 64 + r * 4 + q] = np.uint8((levels[j * unit + 4 * p + q] ^ flip) & 255)


# ---------------------------------------------------------------------------------------------
# Linears.


class PlanesLinear(cpu.Linear):
    """A compiled Linear on a repacked matrix (`planes`: UnitPlanes or RowPlanes): its shape and bytes are theirs."""

    planes: UnitPlanes | RowPlanes

    @property
    def shape(self) -> tuple[int, int]:
        return self.planes.shape

    @property
    def nbytes(self) -> int:
        return self.planes.nbytes


class TiledLinear(PlanesLinear):
    """What the UnitPlanes Linears share: the call in tiles of token rows. Each kind has prepare(x
    rows) -> the activations as its kernel reads them, and launch(prepared, out rows) -> (kernel,
    args): the kernel runs kernel(*args, lo, hi) over groups [lo, hi)."""

    planes: UnitPlanes

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """out [T, N], MAX_ROWS token rows at a time, each tile's row groups split between the
        cores when the product is large enough to pay for it."""
        N, K = self.shape
        x = token_rows(x, K)
        out = np.empty((x.shape[0], N), np.float32)
        groups = self.planes.codes.shape[0]
        for t0 in range(0, x.shape[0], MAX_ROWS):
            kernel, args = self.launch(self.prepare(x[t0 : t0 + MAX_ROWS]), out[t0 : t0 + MAX_ROWS])
            split_kernel(kernel, args, groups, split=N * K >= SPLIT_MIN_WEIGHTS)
        return out

    def leading_rows(self, stop: int) -> TiledLinear | None:
        """This Linear over weight rows 0..stop-1 alone, reading the same planes (no copy): the draft
        shortlist's leading block of the head. None when stop does not end a group of rows."""
        p = self.planes
        if stop % p.group or stop > p.rows:
            return None
        groups = stop // p.group
        leading = copy.copy(self)
        leading.planes = replace(p, codes=p.codes[:groups], scale=p.scale[:groups], rows=stop)
        return leading

    def by_lanes(self, values: np.ndarray, dtype) -> np.ndarray:
        """Token rows [T, K] -> [T, unit, U * R]: position-major as the codes, each unit repeated for the R rows."""
        p = self.planes
        T = values.shape[0]
        by_unit = values.reshape(T, p.units, p.unit).transpose(0, 2, 1)
        return np.repeat(by_unit.astype(dtype), p.group, axis=2)


class W4A8Linear(PlanesLinear):
    """`w4a8` on W4 and GGUF blocks, as cpu.W4A8Linear: activations int8 per 32 inputs (absmax, fp32
    scale), an integer dot per unit, fp32 rescale, the units summed in order (RowPlanes, _w4a8_rows;
    `kernels` is one of int8_dot_kernels(), the first by default: "generic" runs _w4a8_rows_loops
    for the same bits). The activations stay one byte a level, as quantized, for the kernel to
    broadcast: a call of any length is one pass over the weights."""

    route = "w4a8"
    def __init__(self, weight: W4Weight | BlockMatrix, kernels: str | None = None):
        family = kernels or QUAD_FAMILY
        self.planes = repack_rows(weight, flip=QUAD_BIAS if family == "vnni" else 0)
        self.kernel = _w4a8_rows_loops if family == "generic" else _w4a8_rows

    def prepare(self, x: np.ndarray):
        """x fp32 [T, K] -> levels int8 [T, K], each unit's level sum int32 [T, U] and scale fp32 [T, U]
        (the scale of the 32 inputs holding the unit)."""
        T, K = x.shape
        U = K // self.planes.unit
        q, unit_sum, x_scale = np.empty((T, K), np.int8), np.empty((T, U), np.int32), np.empty((T, U), np.float32)
        split_kernel(_int8_units, (x, self.planes.unit, q, x_scale, unit_sum), T, split=T >= INT8_UNITS_SPLIT_ROWS)
        return q, unit_sum, x_scale

    def launch(self, prepared, out: np.ndarray):
        """(kernel, args): the kernel runs kernel(*args, lo, hi) over groups [lo, hi), as TiledLinear's."""
        p = self.planes
        return self.kernel, (p.codes, p.scale, p.minimum, p.block_scales, *prepared, out)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = np.empty((x.shape[0], self.planes.rows), np.float32)
        kernel, args = self.launch(self.prepare(token_rows(x, self.shape[1])), out)
        N, K = self.planes.shape
        split_kernel(kernel, args, self.planes.codes.shape[0], split=N * K >= SPLIT_MIN_WEIGHTS)
        return out

    def leading_rows(self, stop: int) -> W4A8Linear | None:
        """This Linear over weight rows 0..stop-1 alone, reading the same codes (no copy): the draft
        shortlist's leading block of the head. None when stop does not end a group of rows."""
        if stop % ROWS or stop > self.planes.rows:
            return None
        leading = copy.copy(self)
        leading.planes = self.planes.leading(stop // ROWS)
        return leading


class TrellisLinear(TiledLinear):
    """`w4a8` on trellis weights, as cpu.TrellisLinear: activations rotated by the weight's Hadamard and
    quantized per 128-block; y[n] = row_scale[n] * sum over blocks, in order, of act_scale[b] * dot_b.
    The levels are decoded once at load into int8 planes: 8 bits a weight held for the file's 2-4, the
    price of not running the trellis decoder at every product (the numpy Linear does, a whole
    matrix's worth of it per call); a decoder inside the kernel is the next step. `kernels` as W4A8Linear's."""

    route = "w4a8"

    def __init__(self, weight: TrellisWeight, kernels: str | None = None):
        self.weight = weight  # the coded form (a few bits a weight), as the numpy Linear keeps it
        self.seed, self.row_scale = weight.seed, weight.row_scale.astype(np.float32)
        self.planes = repack(weight, GROUP, quads=(kernels or QUAD_FAMILY) != "generic")

    def prepare(self, x: np.ndarray):
        q, act_scale = rotated_int8_activations(x, self.seed)  # [T, B, 128], [T, B]
        T, p = x.shape[0], self.planes
        lane_scale = np.repeat(act_scale.astype(np.float32), p.group, axis=1)  # [T, B * R]
        if not p.quads:
            levels = self.by_lanes(q.reshape(T, -1), np.int16)  # [T, 128, L]
            return levels.reshape(T, -1), lane_scale, None
        levels = self.by_lanes(q.reshape(T, -1), np.int8)  # [T, 128, L] -> quads [T, 32, L, 4]
        quads = np.ascontiguousarray(levels.reshape(T, GROUP // 4, 4, -1).transpose(0, 1, 3, 2))
        lane_sum = np.repeat(q.sum(axis=2, dtype=np.int32), p.group, axis=1)  # [T, B * R]
        return quads.reshape(T, -1), lane_scale, lane_sum

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = super().__call__(x)
        out *= self.row_scale
        return out

    def launch(self, prepared, out: np.ndarray):
        q, lane_scale, lane_sum = prepared
        p = self.planes
        if p.quads:
            return _w4a8_byte_quads, (p.flat_codes, p.scale, q, lane_scale, lane_sum, p.group, out)
        return _w4a8_bytes, (p.flat_codes, p.scale, q, lane_scale, p.group, out)


def w4a16_linear(weight: W4Weight, kernels: str | None = None) -> W4A16Lanes | W4A16Linear:
    """The compiled `w4a16` Linear of this CPU's family (w4a16_kernels), or of the one named."""
    return W4A16Lanes(weight) if (kernels or w4a16_kernels()[0]) == "avx512" else W4A16Linear(weight)


class W4A16Lanes(cpu.Linear):
    """`w4a16` on W4 (w4a16_kernels' "avx512"): bf16-rounded activations, an fp32 sum per 128-group
    in k order, scaled, the groups summed in order, as cpu.W4A16Linear. 32 weight rows lie side by
    side at each input, two levels a byte (nibbles [B, K, 16], byte r: row r's level + 8 low, row
    r + 16's high; rows past N level 0), their scales [B, K / 128, 32], so _w4a16_lanes's vectors
    take a block's 32 levels from one 16-byte load: the planes' loops (_w4a16_nibbles) ran a
    1024 x 1024 product at 460 us a token row on one core. Every row computes the same way whatever
    rows run beside it, a prefill's too (all rows on a pair of blocks before the next: one weight read)."""

    route = "w4a16"

    def __init__(self, weight: W4Weight):
        N, K = weight.shape
        self.rows, blocks = N, -(-N // 32)
        self.nibbles = np.empty((blocks, K, 16), np.uint8)
        self.scales = np.empty((blocks, K // GROUP, 32), np.float32)
        step = max(1, REPACK_ROWS_WEIGHTS // K // 32)  # blocks repacked at a time

        def chunks(lo: int, hi: int) -> None:
            for first in range(lo * step, min(blocks, hi * step), step):
                last = min(blocks, first + step)
                start, stop = first * 32, min(N, last * 32)
                levels, scale, _ = weight.decode_rows(start, stop)  # [r, K/128, 128], [r, K/128]
                codes = np.full(((last - first) * 32, K), 8, np.uint8)  # padding rows: level 0, scale 0
                codes[: stop - start] = levels.reshape(stop - start, K) + 8
                scales = np.zeros(((last - first) * 32, K // GROUP), np.float32)
                scales[: stop - start] = scale
                halves = codes.reshape(last - first, 2, 16, K)  # [b, rows 0-15 | 16-31, 16, K]
                self.nibbles[first:last] = (halves[:, 0] | (halves[:, 1] << np.uint8(4))).transpose(0, 2, 1)
                self.scales[first:last] = scales.reshape(last - first, 32, K // GROUP).transpose(0, 2, 1)

        in_parallel(chunks, -(-blocks // step))

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.nibbles.shape[1]

    @property
    def nbytes(self) -> int:
        return self.nibbles.nbytes + self.scales.nbytes

    def leading_rows(self, stop: int) -> W4A16Lanes | None:
        """This Linear over weight rows 0..stop-1 alone, reading the same bytes (no copy): the draft
        shortlist's leading block of the head. None when stop does not end a block of 32 rows."""
        if stop % 32:
            return None
        leading = copy.copy(self)
        leading.rows, leading.nibbles, leading.scales = stop, self.nibbles[: stop // 32], self.scales[: stop // 32]
        return leading

    def __call__(self, x: np.ndarray) -> np.ndarray:
        N, K = self.shape
        x = round_to_bf16(token_rows(x, K))
        blocks = self.nibbles.shape[0]
        out = np.empty((x.shape[0], blocks * 32), np.float32)
        split_kernel(_w4a16_lanes, (self.nibbles, self.scales, x, out), blocks, split=N * K * x.shape[0] >= SPLIT_MIN_PRODUCTS)
        return out if N == blocks * 32 else np.ascontiguousarray(out[:, :N])


class W4A16Linear(TiledLinear):
    """`w4a16` on W4 (w4a16_kernels' "generic"): bf16-rounded activations, an fp32 sum per
    128-group, scaled, as cpu.W4A16Linear; sums in position then group order (_w4a16_nibbles)."""

    route = "w4a16"

    def __init__(self, weight: W4Weight):
        self.planes = repack(weight, GROUP)

    def prepare(self, x: np.ndarray):
        return self.by_lanes(round_to_bf16(x), np.float32)

    def launch(self, x: np.ndarray, out: np.ndarray):
        return _w4a16_nibbles, (self.planes.codes, self.planes.scale, x, self.planes.units, out)


class DenseLinear(cpu.DenseLinear):
    """`bf16` route: up to MAX_ROWS rows through the compiled dense kernel (one weight read for all
    rows, each row's bits as when alone); prefill through BLAS, as cpu.DenseLinear."""

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.shape[0] > MAX_ROWS:
            return super().__call__(x)
        return _dense_rows(_dense, self.weight, x)


class BF16Linear(cpu.Linear):
    """`bf16` route on a bf16 checkpoint's matrix kept as its bits (BF16Matrix): half the memory of
    an fp32 copy and half the bytes a pass reads. On AVX-512 (bf16_dot_kernels' "avx512") the rows
    are laid 32 side by side at each input (lanes [B, K, 32] in whole pairs of blocks, rows past N
    zero) for _bf16_lanes, which runs every token row, a prefill's too, on a pair of blocks before
    the next: one weight read a call, each row's bits as when alone, at the cores' multiply-add peak
    (widening the weights to fp32 for BLAS took 3-6x as long at 25 to 512 rows). Else the bits are
    kept as they are for _dense_bf16 up to MAX_ROWS rows, a prefill through BLAS on blocks of
    WIDEN_ROWS weight rows widened as they are used, each core taking its share of the rows."""

    route = "bf16"
    WIDEN_ROWS = 256  # weight rows widened at a time in a prefill: 1 MB of fp32 at K = 1024

    def __init__(self, weight: BF16Matrix, kernels: str | None = None):
        bits = weight.bits
        self.rows = bits.shape[0]
        if (kernels or bf16_dot_kernels()[0]) == "avx512":
            N, K = bits.shape
            whole = N // 32
            self.lanes, self.bits = np.zeros((-(-N // 64) * 2, K, 32), np.uint16), None
            self.lanes[:whole] = bits[: whole * 32].reshape(whole, 32, K).transpose(0, 2, 1)
            if N % 32:  # a last, partial block: its rows, the rest of its lanes zero
                self.lanes[whole, :, : N - whole * 32] = bits[whole * 32 :].T
            release_file_pages(bits)
        else:
            self.lanes, self.bits = None, np.ascontiguousarray(bits)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, (self.bits if self.lanes is None else self.lanes).shape[1]

    @property
    def nbytes(self) -> int:
        return (self.bits if self.lanes is None else self.lanes).nbytes

    def leading_rows(self, stop: int) -> BF16Linear | None:
        """This Linear over weight rows 0..stop-1 alone, reading the same bits (no copy): the draft
        shortlist's leading block of the head. None when stop does not end a pair of blocks of 32 lanes."""
        if self.lanes is not None and stop % 64:
            return None
        leading = copy.copy(self)
        leading.rows = stop
        if self.lanes is None:
            leading.bits = self.bits[:stop]
        else:
            leading.lanes = self.lanes[: stop // 32]
        return leading

    def __getitem__(self, ids) -> np.ndarray:
        """Weight rows by index as fp32 [len(ids), K]: a tied embedding's lookups read the head's own bits."""
        if self.lanes is None:
            return bf16_to_f32(self.bits[ids])
        ids = np.asarray(ids, np.int64)
        bits = np.empty((ids.size, self.lanes.shape[1]), np.uint32)
        if not lane_rows(self.lanes, self.rows, ids.reshape(-1), bits):
            raise IndexError(f"token ids {ids.min()}..{ids.max()} reach past the table's {self.rows} rows")
        return bits.view(np.float32).reshape(*ids.shape, -1)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = token_rows(x, self.shape[1])
        if self.lanes is not None:
            blocks, K, _ = self.lanes.shape
            out = np.empty((x.shape[0], blocks * 32), np.float32)
            split_kernel(_bf16_lanes, (self.lanes, x, out), blocks // 2, split=self.rows * K * x.shape[0] >= SPLIT_MIN_PRODUCTS)
            return out if self.rows == blocks * 32 else np.ascontiguousarray(out[:, : self.rows])
        N, K = self.bits.shape
        if x.shape[0] <= MAX_ROWS:
            return _dense_rows(_dense_bf16, self.bits, x)
        out = np.empty((x.shape[0], N), np.float32)
        by_weight_row = np.empty((N, x.shape[0]), np.float32)

        def weight_rows(lo: int, hi: int) -> None:  # W @ x^T, as cpu.DenseLinear's prefill (its faster order)
            wide = np.empty((self.WIDEN_ROWS, K), np.uint32)  # in L2: widened, used, overwritten
            for start in range(lo, hi, self.WIDEN_ROWS):
                stop = min(hi, start + self.WIDEN_ROWS)
                _widen_bf16(self.bits[start:stop], wide)
                np.matmul(wide[: stop - start].view(np.float32), x.T, out=by_weight_row[start:stop])
                cpu.copy_transposed(out[:, start:stop], by_weight_row[start:stop])

        in_parallel(weight_rows, N)
        return out


COMPILED_MARK = "compiled"  # a file in CACHE_DIR: a run has compiled (or loaded) every model kernel there
HELPER_SECONDS = 900  # the longest a first run waits for its helper before it compiles the rest itself


def compile_kernels(report: Callable[[int, int], None] | None = None, model_kernels: bool = True,
                    also: Sequence[Callable[[], None]] = (), helper: str | None = None) -> None:
    """Compile every kernel for the argument types the Linears pass (or load it from the disk cache),
    reporting (kernels done, kernels in all) after each. A machine's first run compiles, about a
    second a kernel; later runs load them in milliseconds. Each kernel runs once on a tiny input
    through the same code a model uses, so the types match what the model will pass. model_kernels
    False: only the steps `also` names (kernels of other modules: the sampler's, which every backend runs).

    helper: Python code that compiles the kernels of `also` (compiled_sampling.FIRST_RUN_HELPER). A first
    run (no COMPILED_MARK in the cache folder) on two cores or more runs it in a helper process, which
    compiles those kernels into the same disk cache while this process compiles the model's; then this
    one loads them. On 2 cores the demo's first compile took 100 s alone (the model kernels ~52 s, the
    sampler's and the MTP passes' ~48) and 60 s so."""
    if unavailable():
        return
    steps = (_model_kernel_steps() if model_kernels else []) + list(also)
    first_run = model_kernels and not (CACHE_DIR / COMPILED_MARK).exists()
    process = _start_helper(helper) if helper and first_run else None
    try:
        with _seeing_splits() as seen:
            for done, step in enumerate(steps, 1):
                if process is not None and done > len(steps) - len(also):  # the helper's kernels: load what it wrote
                    _wait_for(process)
                    process = None
                _run_step(step, seen)
                if report:
                    report(done, len(steps))
    finally:
        if process is not None:
            process.kill()
            process.wait()
    if model_kernels:
        with contextlib.suppress(OSError):  # a cache folder that could not be made: no mark, no error
            (CACHE_DIR / COMPILED_MARK).touch()


@contextlib.contextmanager
def _seeing_splits():
    """While compile steps run: the list split_kernel notes each split in (_SEEN_SPLITS)."""
    global _SEEN_SPLITS
    _SEEN_SPLITS = seen = []
    try:
        yield seen
    finally:
        _SEEN_SPLITS = None


def _run_step(step: Callable[[], None], seen: list) -> None:
    """A compile step, then the parts drivers of the kernels it split (_SEEN_SPLITS, here `seen`): its
    inputs are too small to split, so they are called here, with the same argument types."""
    step()
    for kernel, args, n in seen:
        parts_driver(kernel)(args, n, 2)
    seen.clear()


def run_compile_steps(steps: Sequence[Callable[[], None]]) -> None:
    """compile_kernels' steps without its report: what a first run's helper process runs."""
    with _seeing_splits() as seen:
        for step in steps:
            _run_step(step, seen)


def _start_helper(code: str):
    """A first run's helper process running `code`, or None where one core is all there is, or no
    interpreter to start (an embedding Python may have no sys.executable), or it cannot start. It
    inherits NUMBA_CACHE_DIR and NUMBA_CPU_FEATURES (_load_numba set them), so it writes the kernels
    this process would, where it looks for them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cores < 2 or not sys.executable:
        return None
    try:
        return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None


def _wait_for(helper) -> None:
    """Wait for the helper to end. One that runs past HELPER_SECONDS is stopped: whatever it did not
    write, this process then compiles itself. (numba writes a cache file under another name and renames
    it, so a stopped helper leaves no half-written kernel.)"""
    try:
        helper.wait(timeout=HELPER_SECONDS)
    except subprocess.TimeoutExpired:
        helper.kill()
        helper.wait()


def _model_kernel_steps() -> list[Callable[[], None]]:
    """compile_kernels' steps for a model's kernels: each Linear kind at one and four rows, and each step kernel."""
    rng = np.random.default_rng(0)
    x1, x4 = rng.standard_normal((1, 256), np.float32), rng.standard_normal((4, 256), np.float32)

    def blocks(name: str) -> BlockMatrix:
        qtype = GGMLQuantizationType[name]
        raw = np.zeros((8, 256 // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]), np.uint8)
        raw.flags.writeable = False  # as a file's memory map: the repack kernels' one signature
        return BlockMatrix(qtype, raw, 256)

    w4 = W4Weight(np.zeros((8, 32), np.uint32), np.zeros((8, 2), np.uint16))
    trellis = TrellisWeight(np.zeros((32, 32), np.uint8), np.ones(16, np.float32), (16, 256), 2, 0)  # 32 tiles of 16 x 8, 2 bits
    # each kernel for each scale dtype it meets: f16 bits (Q4_0, Q8_0), fp32 (IQ4_XS, W4) and codes (Q4_K, Q6_K)
    linears = [W4A8Linear(blocks(name)) for name in ("Q4_0", "IQ4_XS", "Q8_0", "Q4_K", "Q6_K")] + [W4A8Linear(w4), TrellisLinear(trellis), w4a16_linear(w4), DenseLinear(x4),
                                                                                         BF16Linear(BF16Matrix(np.zeros((8, 256), np.uint16)))]
    steps = [lambda linear=linear: (linear(x1), linear(x4)) for linear in linears]
    vector, rows = np.zeros(2, np.float32), np.zeros((1, 2), np.float32)  # 2 value heads of 4, one key head
    state, head_rows = np.zeros((2, 4, 4), np.float32), np.zeros((1, 2, 4), np.float32)  # [Hv, dk, dv], [T, Hv, dk or dv]
    steps.append(lambda: split_kernel(deltanet_heads, (np.zeros((1, 16), np.float32), head_rows, rows, rows,
                                                       vector, vector, np.zeros(4, np.float32), np.float32(1e-6), 2,
                                                       state, state.copy(), head_rows.copy(), head_rows.copy(), rows.copy(), rows.copy(),
                                                       head_rows.copy()), 2, split=False))
    steps.append(lambda: delta_replay(state, (head_rows, head_rows, rows, rows), 1))
    steps.append(lambda: rms_norm_rows(rows, vector, np.float32(1e-6), rows.copy()))
    steps.append(lambda: add_rms_norm_rows(rows, rows, vector, np.float32(1e-6), rows.copy(), rows.copy()))
    steps.append(lambda: qk_norm_rope_rows(np.zeros((1, 16), np.float32), 0, vector, vector, np.float32(1e-6), 0,
                                           np.ones(1, np.float32), np.zeros((1, 2, 2), np.float32), np.zeros((2, 1, 2), np.float32)))
    steps.append(lambda: split_kernel(swiglu_rows, (np.zeros((1, 4), np.float32), rows.copy()), 1, split=False))
    steps.append(lambda: conv_rows(np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32), rows.copy()))
    steps.append(lambda: split_kernel(attend_rows, (np.zeros((1, 2, 4), np.float32), np.zeros((1, 4, 4), np.float32), np.zeros((1, 4, 4), np.float32),
                                                    0, np.zeros((1, 24), np.float32), np.zeros((1, 8), np.float32)), 1, split=False))
    hd = 32  # a Q4KVCache's smallest head: one fp16 scale a row and side
    steps.append(lambda: split_kernel(attend_q4_rows, (np.zeros((1, 2, hd), np.float32), np.zeros((1, 4, hd // 2), np.uint16),
                                                       np.zeros((1, 4, 1, 2), np.uint16), np.zeros((1, 4, hd, 2), np.float32),
                                                       np.zeros((1, 8, hd, 2), np.float32), np.eye(hd, dtype=np.float32),
                                                       np.ones(hd, np.float32), 2, 0, np.zeros((1, 4 * hd), np.float32),
                                                       np.zeros((1, 2 * hd), np.float32)), 1, split=False))
    if bf16_dot_kernels()[0] == "avx512":  # a tied table in lanes: its lookups
        steps.append(lambda: lane_rows(np.zeros((2, 8, 32), np.uint16), 64, np.zeros(1, np.int64), np.zeros((1, 8), np.uint32)))
    return steps


def tiny_mtp_head() -> tuple:
    """The arguments the MTP kernels share, mtp_rows' from norms to down, for a head of hidden 64 (one
    query and one KV head of 16, an MLP of 64; its embedding and draft rows: `down`'s lanes): the
    compile steps' inputs (mtp_kernel_steps, compiled_sampling.mtp_drafting_steps)."""
    lanes = [np.zeros((2 * n, k, 32), np.uint16) for n, k in ((1, 128), (1, 64), (1, 16), (2, 64), (1, 64))]
    kv_rows, vector = np.zeros((1, 8, 16), np.float32), np.ones(16, np.float32)
    return (np.ones((5, 64), np.float32), np.float32(1e-6), lanes[0], lanes[1], 1, vector, vector, 1, np.ones(4, np.float32),
            kv_rows, kv_rows.copy(), 0, lanes[2], lanes[3], lanes[4])


def mtp_kernel_steps() -> list[Callable[[], None]]:
    """compile_kernels' steps for the MTP passes in one call (mtp_rows, mtp_greedy_drafts), for a model
    with an MTP plan (cpu_ops.CpuOps.mtp_plan) alone (compiled_sampling.mtp_drafting_steps): held in
    memory they cost ~10 MB, 2% of a 0.8B Q4_0 file's resident bytes, which a model without the plan
    would carry for nothing."""
    if bf16_dot_kernels()[0] != "avx512":
        return []
    head, x = tiny_mtp_head(), np.ones((1, 64), np.float32)
    rows = head[-1]
    rows_args = lambda: (x, x.copy(), *head, 0, np.zeros((1, 64), np.float32), *pass_scratch(1, 0, head))
    drafts_args = lambda: (x, rows, rows, np.arange(64), *head, np.zeros(2, np.int64), *drafting_scratch(2, rows, head))
    return [lambda: mtp_rows(*rows_args(), 0, 1), lambda: mtp_rows_team(rows_args(), 2),
            lambda: mtp_greedy_drafts(*drafts_args(), 0, 1), lambda: mtp_greedy_drafts_team(drafts_args(), 2)]


def make_linear(weight, route: str):
    """The compiled Linear for a weight and route where there is one, else numpy's (cpu.make_linear)."""
    if unavailable():
        return cpu.make_linear(weight, route)
    return cpu.make_linear(weight, route, linears=_COMPILED)


class _Compiled:
    """The Linear kinds cpu.make_linear makes, compiled where a kernel exists."""

    DenseLinear = DenseLinear
    BF16Linear = BF16Linear
    W4A16Linear = staticmethod(w4a16_linear)
    W4A8Linear = W4A8Linear
    TrellisLinear = TrellisLinear
    PermutedInput = cpu.PermutedInput


_COMPILED = _Compiled()
