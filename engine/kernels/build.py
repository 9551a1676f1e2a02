"""Compile and load the CUDA sources in this folder.

At run time (`load`) a source is compiled by NVRTC through CuPy's RawModule for the current
device, once per device and process (CuPy also keeps the cubin in its on-disk cache).
Without a GPU (`compile_report`) every source is compiled to a cubin for a named architecture and
ptxas's verbose log gives each kernel's registers, stack frame and spills: NVRTC through CuPy's
binding when the NVRTC library is installed (the `test` extra installs it), else the CUDA
toolkit's nvcc on PATH. Both run the same ptxas on the same text, so they report the same thing.

Sources include "common.cuh"; it is pasted in before compiling, so the text compiled, and so
CuPy's cache key, covers every line the kernels depend on.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
# Every kernel the backend launches, by source file; the compile test holds each file to its list.
KERNELS = {
    "w4a16": ("w4a16_gemm_t8", "w4a16_gemm_t16", "w4a16_swiglu_t8", "w4a16_swiglu_t16", "f32_to_bf16_bits"),
    "dense": ("bf16_gemv", "bf16_swiglu", "embed_bf16"),
    "w4a8": ("quantize_int8_blocks", "rotate_quantize_int8", "trellis_gemv", "w4a8_mma_t8", "w4a8_mma_t16",
             *(f"int8_{kind}_{codec}_t{rows}" for kind in ("gemv", "swiglu") for codec in ("w4", "q8_0", "q4_0", "iq4_xs")
               for rows in (4, 16))),
    "deltanet": tuple(f"deltanet_{kind}_dk{dk}" for kind in ("rows", "keep") for dk in (32, 64, 128)),
    "attention": tuple(f"attention_{kind}_hd{hd}" for hd in (64, 128, 256)
                       for kind in ("bf16", "partial_q4", "partial_exact"))
                 + tuple(f"sparse_attention_partial_{kind}_hd{hd}" for hd in (64, 128, 256) for kind in ("bf16", "q4", "exact"))
                 + ("attention_combine", "kv_append_bf16", "kv_append_q4"),
    "norms": ("rms_norm", "add_rms_norm", "qk_norm_rope",
              "qk_norm_rope_append_bf16", "silu_mul", "attention_gate"),
    "flash_next": ("silu_div", "hc_mix", "hc_inject", "ple_gate", "ple_conv", "index_pool", "index_scores", "qsa_select"),
}
SOURCES = tuple(KERNELS)
ARCHES = ("sm_86", "sm_90")  # RTX 3090 (the product's card) and H100/H200
# IEEE division, square root and denormals (NVRTC's defaults, spelled out): the kernels reproduce
# the CPU route's roundings where they can (activation scales, int8 codes, bf16 rounding).
OPTIONS = ("-std=c++17", "--prec-div=true", "--prec-sqrt=true", "--ftz=false")


def source_text(name: str) -> str:
    """The source as compiled: `#include "common.cuh"` replaced by the header's text."""
    text = (KERNEL_DIR / f"{name}.cu").read_text()
    header = (KERNEL_DIR / "common.cuh").read_text().replace("#pragma once\n", "")
    return text.replace('#include "common.cuh"\n', header)


# ----------------------------------------------------------------------------- run time ---

@functools.cache
def load(name: str, device: int):
    """cupy.RawModule of a source for one device (the caller has made it current)."""
    import cupy

    return cupy.RawModule(code=source_text(name), options=OPTIONS, backend="nvrtc")


def kernel(name: str, function: str):
    """A kernel function of a source, compiled for the current device."""
    import cupy

    assert function in KERNELS[name], f"{function} is not listed in build.KERNELS[{name!r}]"
    return load(name, cupy.cuda.Device().id).get_function(function)


# ------------------------------------------------------------------- compile check (no GPU) ---

@dataclass(frozen=True)
class KernelUsage:
    source: str
    kernel: str
    arch: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int


@dataclass(frozen=True)
class CompileResult:
    source: str
    arch: str
    compiler: str  # "nvrtc X.Y" or "nvcc"
    cubin_bytes: int
    log: str


class CompileError(RuntimeError):
    pass


def compile_cubin(name: str, arch: str) -> CompileResult:
    """Compile one source to a cubin for `arch` with ptxas's verbose resource report."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:
        nvrtc = None
    if nvrtc is not None:
        try:
            version = nvrtc.getVersion()
        except Exception:  # the binding is there but no NVRTC library could be loaded
            nvrtc = None
    if nvrtc is not None:
        return _compile_nvrtc(nvrtc, version, name, arch)
    if shutil.which("nvcc"):
        return _compile_nvcc(name, arch)
    raise CompileError("no CUDA compiler: install NVRTC (pip install 'duet[test]') or put nvcc on PATH")


def _compile_nvrtc(nvrtc, version, name: str, arch: str) -> CompileResult:
    program = nvrtc.createProgram(source_text(name), f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, [*OPTIONS, f"-arch={arch}", "--ptxas-options=-v"])
        except Exception as error:
            raise CompileError(f"{name}.cu for {arch}: {error}\n{nvrtc.getProgramLog(program)}") from None
        log = nvrtc.getProgramLog(program)
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    return CompileResult(name, arch, "nvrtc %d.%d" % version, len(cubin), log.rstrip("\x00"))


def _compile_nvcc(name: str, arch: str) -> CompileResult:
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / f"{name}.cu", Path(tmp) / f"{name}.cubin"
        src.write_text(source_text(name))
        done = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", *OPTIONS, "-Xptxas", "-v", "-o", str(cubin), str(src)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise CompileError(f"{name}.cu for {arch}: nvcc failed\n{done.stderr}")
        return CompileResult(name, arch, "nvcc", cubin.stat().st_size, done.stderr)


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_usage(result: CompileResult) -> list[KernelUsage]:
    """ptxas -v lines -> one KernelUsage per entry function (frame and register lines follow the entry line)."""
    usages, current = [], None
    for line in result.log.splitlines():
        if m := _ENTRY.search(line):
            current = {"kernel": m.group(1), "arch": m.group(2)}
        elif current is not None and (m := _FRAME.search(line)):
            current["frame"] = tuple(int(v) for v in m.groups())
        elif current is not None and (m := _USED.search(line)):
            smem = _SMEM.search(line)
            stack, stores, loads = current["frame"]
            usages.append(KernelUsage(result.source, current["kernel"], current["arch"], int(m.group(1)), stack,
                                      stores, loads, int(smem.group(1)) if smem else 0))
            current = None
    return usages


def compile_report(arches=ARCHES) -> tuple[list[CompileResult], list[KernelUsage]]:
    """Compile every source for every arch; (results, per-kernel usage)."""
    results = [compile_cubin(name, arch) for name in SOURCES for arch in arches]
    return results, [u for r in results for u in parse_usage(r)]


def format_report(usages: list[KernelUsage]) -> str:
    lines = [f"{'source':10} {'kernel':34} {'arch':6} {'regs':>4} {'stack':>5} {'spill st':>8} {'spill ld':>8} {'smem':>6}"]
    lines += [f"{u.source:10} {u.kernel:34} {u.arch:6} {u.registers:4d} {u.stack_bytes:5d} {u.spill_stores:8d} "
              f"{u.spill_loads:8d} {u.shared_bytes:6d}" for u in usages]
    return "\n".join(lines)


if __name__ == "__main__":
    compiled, usage = compile_report()
    print(f"compiler: {compiled[0].compiler}")
    print(format_report(usage))
