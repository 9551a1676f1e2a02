"""Every CUDA kernel compiles for sm_86 and sm_90 without a GPU; registers and spills are printed.

NVRTC (installed by the `test` extra) compiles them as the GPU backend will; where its library is
missing, nvcc on PATH does. With neither, the test fails: it never skips.
"""

import subprocess
import sys

import pytest

from duet.engine.kernels import build

# Kernels whose stack frame is expected (all rotate by RoPE): cosf/sinf keep a small array for the exact reduction of
# large angles (positions up to 262,144 radians times inv_freq). Nothing may spill anywhere.
STACK_ALLOWED = {"qk_norm_rope", "qk_norm_rope_append_bf16", "index_pool"}
# The W4 GEMMs and the trellis GEMV are the bandwidth-bound hot loops: keep their register budget
# where two 256-thread blocks (or more) fit an SM (65,536 registers).
HOT_REGISTER_LIMIT = {"w4a16_gemm_t8": 128, "w4a16_gemm_t16": 128, "trellis_gemv": 128,
                      "int8_gemv_w4": 128, "int8_gemv_iq4_xs": 128}


@pytest.fixture(scope="module")
def report():
    results, usages = build.compile_report()
    print(f"\ncompiler: {results[0].compiler}")
    print(build.format_report(usages))
    return results, usages


def test_every_kernel_compiles_for_both_arches(report):
    results, usages = report
    assert {r.arch for r in results} == set(build.ARCHES)
    for name in build.SOURCES:
        expected = set(build.KERNELS[name])
        for arch in build.ARCHES:
            found = {u.kernel for u in usages if u.source == name and u.arch == arch}
            assert found == expected, f"{name}.cu for {arch}: ptxas reported {sorted(found)}"
    assert all(r.cubin_bytes > 0 for r in results)


def test_no_spills_and_bounded_registers(report):
    _, usages = report
    for u in usages:
        assert u.spill_stores == 0 and u.spill_loads == 0, u
        assert u.stack_bytes == 0 or u.kernel in STACK_ALLOWED, u
        assert 0 < u.registers <= HOT_REGISTER_LIMIT.get(u.kernel, 255), u


def test_report_parser_reads_ptxas_lines():
    log = ("ptxas info    : 0 bytes gmem\n"
           "ptxas info    : Compiling entry function 'k' for 'sm_86'\n"
           "ptxas info    : Function properties for k\n"
           "ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 42 registers, used 1 barriers, 2048 bytes smem, 368 bytes cmem[0]\n")
    [u] = build.parse_usage(build.CompileResult("x", "sm_86", "nvcc", 1, log))
    assert (u.kernel, u.arch, u.registers, u.stack_bytes, u.spill_stores, u.spill_loads, u.shared_bytes) == \
        ("k", "sm_86", 42, 16, 8, 4, 2048)


def test_compile_error_is_reported():
    with pytest.raises(build.CompileError, match="broken"):
        original = build.source_text
        try:
            build.source_text = lambda name: 'extern "C" __global__ void broken() { undeclared = 1; }\n'
            build.compile_cubin("broken", "sm_86")
        finally:
            build.source_text = original


def test_nvcc_route_agrees():
    """The fallback compiler (nvcc, which the build machines have) reports the same kernels."""
    import shutil

    assert shutil.which("nvcc"), "nvcc is not on PATH; the compile check's fallback route needs the CUDA toolkit"
    result = build._compile_nvcc("w4a16", "sm_86")
    assert {u.kernel for u in build.parse_usage(result)} == set(build.KERNELS["w4a16"])


def test_cpu_path_never_imports_cupy():
    """Importing the engine and running a CPU forward leaves CuPy unimported, GPU or not."""
    code = (
        "import sys\n"
        "from duet.engine import GenerateOptions, generate, load_model\n"
        "from duet.engine.backend.select import backend_name\n"
        "auto = backend_name('auto')\n"
        "lm = load_model('models/demo')\n"
        "events = list(generate(lm, lm.tokenizer.encode('Hello'), GenerateOptions(max_tokens=4)))\n"
        "assert events, 'no events'\n"
        "imported = sorted(m for m in ('cupy', 'cupy_backends') if m in sys.modules)\n"
        "assert auto == 'cupy' or not imported, f'{imported} imported on a machine without a GPU'\n"
        "assert backend_name('cpu') == 'cpu'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
