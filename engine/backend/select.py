"""Which op set runs the model: `cupy` when a CUDA device and CuPy are both present, else `cpu`.

The check never imports CuPy on a machine without a GPU: the driver is asked for a device count
through libcuda directly (ctypes), and CuPy is only looked up, not imported.
"""

from __future__ import annotations

import ctypes
import importlib.util

BACKENDS = ("cpu", "cupy")


def cuda_device_count() -> int:
    """Devices the NVIDIA driver sees; 0 without a driver or device."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def cupy_installed() -> bool:
    return importlib.util.find_spec("cupy") is not None


def backend_name(requested: str = "auto") -> str:
    """`auto` -> `cupy` where it can run, else `cpu`; an explicit `cupy` that cannot run -> ValueError."""
    if requested not in ("auto", *BACKENDS):
        raise ValueError(f"unknown backend {requested!r}; use auto, cpu or cupy")
    if requested == "cpu":
        return "cpu"
    usable = cupy_installed() and cuda_device_count() > 0
    if requested == "cupy" and not usable:
        raise ValueError("backend cupy needs an NVIDIA GPU and CuPy (pip install 'duet[gpu]')")
    return "cupy" if usable else "cpu"


def gpu_geometry_problem(config) -> str | None:
    """Why our GPU kernels cannot run a model of this geometry (one line), or None when they can."""
    if config.head_dim not in (64, 128, 256):
        return f"attention head_dim {config.head_dim} (the kernels take 64, 128 or 256)"
    if config.linear_key_head_dim not in (32, 64, 128) or config.linear_value_head_dim % 32:
        return (f"DeltaNet key/value head dims {config.linear_key_head_dim}/{config.linear_value_head_dim} "
                "(the kernels take keys of 32, 64 or 128 and values in multiples of 32)")
    flash = config.flash
    if flash is not None and (flash.indexer_head_dim % 32 or not 32 <= flash.indexer_head_dim <= 256):
        return f"QSA indexer head_dim {flash.indexer_head_dim} (the kernels take multiples of 32 up to 256)"
    if flash is not None and flash.block_topk > QSA_MAX_TOP:
        return f"QSA keeping {flash.block_topk} blocks a query (the kernels keep up to {QSA_MAX_TOP})"
    return None


QSA_MAX_TOP = 1024  # engine/kernels/flash_next.cu's QSA_MAX_TOP: the top blocks a row keeps
