"""A simulated CUDA device: the GPU backend's Python (engine/backend/cupy_backend.py, cupy_model.py)
run on numpy, so CI exercises its orchestration on every run, GPU or not.

The backend reaches the GPU through two names, the `cupy` module and engine.kernels.build.kernel.
`installed(monkeypatch)` rebinds both, in every engine module that holds them, to one SimulatedDevice:
`SimulatedCupy` is the part of CuPy's API the backend uses, over numpy arrays standing for device
memory, and `SimulatedDevice.kernel` hands out a numpy twin of each CUDA kernel, written from the
kernel's argument contract in engine/kernels/*.cu with the CPU route's numerics where the kernel
reproduces them (engine/backend/cpu.py, cpu_ops.py, engine/cache.py, engine/quant/).

What it checks, as a real device would (or would silently get wrong):
- every launch against the kernel's signature parsed from the very source the GPU compiles: the
  argument count, device arrays of the declared element type for pointers, and for scalars the
  exact numpy type of the C type (CuPy passes a Python int as 8 bytes, a float as a double);
- a pointer is the memory from the array's first element to the end of its allocation: offsets,
  strided views and reinterpreting views mean what they mean on the card, and a read or write past
  the allocation raises;
- a twin computes only what the launched grid covers, and memory from `empty` is poisoned (NaN, or
  the largest integer), so a grid too small, a partial slot no kernel wrote, or a read of an unset
  buffer shows in the results;
- graph capture records instead of running: kernels, CuPy operations and writes issued on the
  capturing stream go on a tape that `graph.launch` replays on the same buffers, so a capture
  advances no cache or state and a replay reads what the input buffers hold at launch;
- inside a capture, what the driver refuses or what would be unsafe raises and invalidates the
  capture (end_capture then raises too): host transfers (`asarray` of host data, `set`, `get`,
  `asnumpy`), allocations outside a graph's own memory pool (a later allocation could reuse them),
  a kernel function loaded for the first time and cuBLAS's first product (the backend runs every
  row count uncaptured before capturing it).

What it does not model: the CUDA code itself (fragment layouts, shared memory, warp shuffles, races;
the GPU tests check every kernel on a real device), the kernels' fp32 summation orders (twins sum as
numpy does), asynchrony (every operation runs in issue order, so a missing synchronisation cannot
show), reuse of freed memory (no allocation is ever handed out twice) and speed.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from threadpoolctl import threadpool_limits

from duet.engine.backend import cpu, cpu_ops, select
from duet.engine.backend.select import backend_name
from duet.engine.cache import DeltaNetState, dequantize_q4, hadamard, quantize_q4
from duet.engine.checkpoint.safetensors import bf16_to_f32
from duet.engine.flash_next import FlashCpuOps
from duet.engine.kernels import build
from duet.engine.quant.activation import f32_to_bf16_bits, quantize_int8_blocks
from duet.engine.quant.gguf_blocks import IQ4_KVALUES
from duet.engine.quant.trellis import MULTIPLIERS, TrellisWeight, _hadamard_blocks
from duet.engine.quant.w4 import W4Weight

SM_COUNT = 82  # an RTX 3090's multiprocessors: the W4A16 split count depends on it


class CaptureError(RuntimeError):
    """What the CUDA driver refuses during a stream capture (cudaErrorStreamCaptureUnsupported)."""


# --------------------------------------------------------------------------- the sources ---

C_TYPES = {"float": np.float32, "int": np.int32, "long long": np.int64, "u64": np.uint64,
           "unsigned long long": np.uint64, "u32": np.uint32, "u16": np.uint16, "u8": np.uint8,
           "signed char": np.int8}


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str
    pointer: bool

    @property
    def dtype(self) -> type:
        return C_TYPES[self.ctype]


@dataclass(frozen=True)
class Source:
    """One .cu file as compiled: each extern "C" kernel's parameters and the numeric #defines."""

    kernels: dict[str, tuple[Param, ...]]
    constants: dict[str, int]


_MACRO = re.compile(r"^#define (\w+)\(([^)]*)\)((?:.*\\\n)*.*)$", re.M)
_CONSTANT = re.compile(r"^#define (\w+) (\d+)\b", re.M)
_ENTRY = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\(\d+(?:, \d+)?\) )?(\w+)\(([^)]*)\)')


def expand_macros(text: str) -> str:
    """Expand the function-like macros that stamp out kernels (INT8_KERNELS(w4, W4Codec, 4) and the like)."""
    macros, text = _MACRO.findall(text), _MACRO.sub("", text)
    for name, params, body in macros:
        names = [p.strip() for p in params.split(",")]
        body = body.replace("\\\n", "\n")

        def expand(call, names=names, body=body):
            for param, value in zip(names, (v.strip() for v in call.group(1).split(","))):
                body = re.sub(rf"##{param}\b|\b{param}\b", value, body)
            return body.replace("##", "")  # what is left pastes text to text: name_##x##_t8 -> name_x_t8

        text = re.sub(rf"^{name}\(([^)]*)\)\s*$", expand, text, flags=re.M)
    return text


def parse_param(text: str) -> Param:
    words = [w for w in text.replace("*", " * ").split() if w not in ("const", "__restrict__")]
    return Param(words[-1], " ".join(w for w in words[:-1] if w != "*"), "*" in words)


def parse_source(text: str) -> Source:
    kernels = {name: tuple(parse_param(p) for p in params.split(","))
               for name, params in _ENTRY.findall(expand_macros(text))}
    return Source(kernels, {name: int(value) for name, value in _CONSTANT.findall(text)})


SOURCES = {name: parse_source(build.source_text(name)) for name in build.SOURCES}


def constant(source: str, name: str) -> int:
    return SOURCES[source].constants[name]


# ------------------------------------------------------------------------------ memory ---

def poison(a: np.ndarray) -> None:
    """What uninitialised device memory holds here: NaN, or the largest integer (an index out of range)."""
    a.fill(np.nan if a.dtype.kind == "f" else np.iinfo(a.dtype).max)


class DeviceArray:
    """A cupy.ndarray stand-in: `a` is a numpy view into `root`, the allocation it lives in. numpy
    functions refuse it, as they refuse a CuPy array; ufuncs and operators run as device operations."""

    def __init__(self, device: SimulatedDevice, a: np.ndarray, root: np.ndarray):
        self.device, self.a, self.root = device, a, root

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    ndim = property(lambda self: self.a.ndim)
    size = property(lambda self: self.a.size)
    nbytes = property(lambda self: self.a.nbytes)
    strides = property(lambda self: self.a.strides)
    T = property(lambda self: self._view(self.a.T))

    def _view(self, a: np.ndarray) -> DeviceArray:
        return DeviceArray(self.device, a, self.root)

    def pointer(self) -> np.ndarray:
        """What a kernel gets: the memory from this array's first element to the end of its allocation."""
        offset = self.a.__array_interface__["data"][0] - self.root.__array_interface__["data"][0]
        memory = self.root.reshape(-1).view(np.uint8)
        n = (memory.size - offset) // self.a.itemsize
        return memory[offset:offset + n * self.a.itemsize].view(self.a.dtype)

    def reshape(self, *shape) -> DeviceArray:
        r = self.a.reshape(*shape)
        return self._view(r) if np.may_share_memory(r, self.a) else self.device.produce(lambda: self.a.reshape(*shape))

    def view(self, dtype) -> DeviceArray:
        return self._view(self.a.view(dtype))

    def astype(self, dtype) -> DeviceArray:
        return self.device.produce(lambda: self.a.astype(dtype))

    def copy(self) -> DeviceArray:
        return self.device.produce(self.a.copy)

    def argmax(self, axis=None) -> DeviceArray:
        return self.device.produce(lambda: self.a.argmax(axis=axis))

    def set(self, host: np.ndarray) -> None:
        """A host-to-device copy, with cupy.ndarray.set's checks."""
        self.device.refuse("a host-to-device copy (ndarray.set)")
        if host.dtype != self.dtype:
            raise TypeError(f"{host.dtype} array cannot be set to {self.dtype} array")
        if host.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {host.shape}")
        if not self.a.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        self.a[...] = host

    def get(self) -> np.ndarray:
        self.device.refuse("a device-to-host copy")
        return self.a.copy()

    def __getitem__(self, key) -> DeviceArray:
        key = self.device.index(key)
        if any(isinstance(k, np.ndarray) for k in (key if isinstance(key, tuple) else (key,))):
            return self.device.produce(lambda: self.a[key])  # a gather: reads the index array at run time
        return self._view(self.a[key])

    def __setitem__(self, key, value) -> None:
        key, value = self.device.index(key), self.device.operand(value)
        self.device.issue(lambda: self.a.__setitem__(key, value))

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        device = self.device
        args = [device.operand(x) for x in inputs]
        if ufunc is np.matmul:
            device.use_blas()
        run = getattr(ufunc, method)
        if out is None:
            return device.produce(lambda: run(*args, **kwargs))
        targets = tuple(device.operand(o) for o in out)
        device.issue(lambda: run(*args, out=targets, **kwargs))
        return out[0] if len(out) == 1 else out

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    def __array_function__(self, func, types, args, kwargs):
        raise TypeError(f"numpy.{func.__name__} on a device array: the simulated device runs only cupy's functions")

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype})"


# The operators the backend applies to device arrays are their ufuncs, which run as device operations.
for _name, _ufunc in {"add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide,
                      "matmul": np.matmul, "lshift": np.left_shift}.items():
    setattr(DeviceArray, f"__{_name}__", lambda self, other, ufunc=_ufunc: ufunc(self, other))
    setattr(DeviceArray, f"__r{_name}__", lambda self, other, ufunc=_ufunc: ufunc(other, self))
DeviceArray.__neg__ = lambda self: np.negative(self)
DeviceArray.__ge__ = lambda self, other: np.greater_equal(self, other)
DeviceArray.__iadd__ = lambda self, other: np.add(self, other, out=(self,))
del _name, _ufunc


# ------------------------------------------------------------------------------ device ---

class Stream:
    def __init__(self, device: SimulatedDevice):
        self.device = device

    def __enter__(self) -> Stream:
        self.device.streams.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.device.streams.pop()

    def begin_capture(self) -> None:
        self.device.begin_capture(self)

    def end_capture(self) -> Graph:
        return self.device.end_capture(self)


class Graph:
    """A captured tape: launch() runs its operations in order, on the buffers they were captured with
    (at once: the simulated device runs everything in issue order, whatever the stream)."""

    def __init__(self, tape: list):
        self.tape = tape

    def launch(self, stream: Stream) -> None:
        for operation in self.tape:
            operation()


class MemoryPool:
    """cupy.cuda.MemoryPool: a graph's own pool. The simulated device allocates with numpy and never
    hands memory out twice, so the pool only marks that an allocation is a graph's."""

    def malloc(self, nbytes: int):
        raise NotImplementedError("the simulated device does not call allocators")


class SimulatedDevice:
    """Stream order, capture state and the kernels loaded: the state behind SimulatedCupy."""

    def __init__(self):
        self.streams = [Stream(self)]  # the current stream last
        self.capturing: Stream | None = None
        self.tape: list = []
        self.capture_invalid = False
        self.allocators: list = []  # allocators in use (cupy.cuda.using_allocator)
        self.kernels: dict[str, SimulatedKernel] = {}  # the kernel functions loaded
        self.blas_ready = False
        self.refused_kernel: str | None = None  # a kernel whose capture the driver refuses (tests of the fallback)

    @property
    def recording(self) -> bool:
        """Operations issued now go on a capture's tape."""
        return self.capturing is not None and self.streams[-1] is self.capturing

    def issue(self, operation) -> None:
        if self.recording:
            self.tape.append(operation)
        else:
            operation()

    def refuse(self, what: str) -> None:
        """Raise, invalidating the capture, if `what` happens while recording."""
        if self.recording:
            self.capture_invalid = True
            raise CaptureError(f"{what} inside a stream capture")

    def begin_capture(self, stream: Stream) -> None:
        if self.capturing is not None:
            raise CaptureError("a capture is already in progress")
        self.capturing, self.tape, self.capture_invalid = stream, [], False

    def end_capture(self, stream: Stream) -> Graph:
        if self.capturing is not stream:
            raise CaptureError("end_capture on a stream that is not capturing")
        self.capturing = None
        if self.capture_invalid:
            raise CaptureError("the capture was invalidated by an earlier error")
        return Graph(self.tape)

    def use_blas(self) -> None:
        if not self.blas_ready:
            self.refuse("cuBLAS's first product (it makes its handle and workspace then)")
            self.blas_ready = True

    def allocate(self, shape, dtype) -> DeviceArray:
        if self.recording and not self.allocators:
            self.refuse("an allocation from the default memory pool (a later allocation could reuse it)")
        a = np.empty(shape, dtype)
        poison(a)
        return DeviceArray(self, a, a)

    def produce(self, compute) -> DeviceArray:
        """A new array from one device operation. While recording, the operation runs at replay;
        computing it now only gives the shape and type (the inputs hold whatever they hold: a gather
        by indices a captured kernel writes would fail here, and the backend has none)."""
        with np.errstate(all="ignore"):
            value = compute()
        if not self.recording:
            value = np.ascontiguousarray(value)
            return DeviceArray(self, value, value)
        out = self.allocate(value.shape, value.dtype)
        self.tape.append(lambda: np.copyto(out.a, compute()))
        return out

    def operand(self, x):
        """A device array's memory, or a scalar; host arrays are refused as CuPy refuses them."""
        if isinstance(x, DeviceArray):
            return x.a
        if isinstance(x, (np.ndarray, list)):
            raise TypeError(f"Unsupported type {type(x)}: a host array where a device array is needed")
        return x

    def index(self, key):
        return tuple(self.operand(k) for k in key) if isinstance(key, tuple) else self.operand(key)

    def kernel(self, name: str, function: str) -> SimulatedKernel:
        """engine.kernels.build.kernel on this device."""
        assert function in build.KERNELS[name], f"{function} is not listed in build.KERNELS[{name!r}]"
        if function not in self.kernels:
            self.refuse(f"loading kernel {function}")
            self.kernels[function] = SimulatedKernel(self, function, SOURCES[name].kernels[function], TWINS[function])
        return self.kernels[function]


class SimulatedKernel:
    """A compiled kernel function: (grid, block, args) checked against the source's signature, then
    the twin runs in stream order (or goes on the capture's tape)."""

    def __init__(self, device: SimulatedDevice, name: str, params: tuple[Param, ...], twin):
        self.device, self.name, self.params, self.twin = device, name, params, twin

    def __call__(self, grid: tuple, block: tuple, args: tuple) -> None:
        grid, block = (tuple(max(1, int(d)) for d in (tuple(dims) + (1, 1))[:3]) for dims in (grid, block))
        bound = self.bind(args)
        if self.name == self.device.refused_kernel:
            self.device.refuse(f"{self.name} (refused by the simulated driver)")
        self.device.issue(lambda: self.twin(grid, block, bound))

    def bind(self, args: tuple) -> SimpleNamespace:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        bound = {}
        for param, arg in zip(self.params, args):
            if not param.pointer:
                if type(arg) is not param.dtype:
                    raise TypeError(f"{self.name}: {param.name} is a C {param.ctype}; pass numpy.{param.dtype.__name__}, "
                                    f"not {type(arg).__name__}")
                bound[param.name] = arg
            elif arg is None:  # CuPy before 14 passes None as a null argument address: a crash on the GPU
                raise TypeError(f"{self.name}: {param.name} is None; pass a device array (a one-element dummy where "
                                "the kernel does not read it)")
            elif not isinstance(arg, DeviceArray) or arg.dtype != param.dtype:
                got = f"a {arg.dtype} device array" if isinstance(arg, DeviceArray) else type(arg).__name__
                raise TypeError(f"{self.name}: {param.name} is a {param.ctype}*, got {got}")
            else:
                bound[param.name] = arg.pointer()
        return SimpleNamespace(**bound)


class SimulatedCuda:
    """cupy.cuda: streams, graph memory pools, the device's attributes."""

    MemoryPool = MemoryPool

    def __init__(self, device: SimulatedDevice):
        self.device = device

    def Stream(self, non_blocking: bool = False) -> Stream:  # noqa: N802 (CuPy's name)
        return Stream(self.device)

    def get_current_stream(self) -> Stream:
        return self.device.streams[-1]

    @contextlib.contextmanager
    def using_allocator(self, allocator):
        self.device.allocators.append(allocator)
        try:
            yield
        finally:
            self.device.allocators.pop()

    def Device(self) -> SimpleNamespace:  # noqa: N802 (CuPy's name)
        return SimpleNamespace(id=0, attributes={"MultiProcessorCount": SM_COUNT})


class SimulatedCupy:
    """The part of the cupy module the GPU backend and its tests use."""

    ndarray = DeviceArray
    float32, int8, uint8, uint16, int32, uint32, uint64 = np.float32, np.int8, np.uint8, np.uint16, np.int32, np.uint32, np.uint64

    def __init__(self, device: SimulatedDevice):
        self.device = device
        self.cuda = SimulatedCuda(device)

    def asarray(self, a, dtype=None) -> DeviceArray:
        if isinstance(a, DeviceArray):
            return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
        self.device.refuse("a host-to-device copy (cupy.asarray)")
        host = np.asarray(a, dtype=dtype)
        out = self.device.allocate(host.shape, host.dtype)
        out.a[...] = host
        return out

    def asnumpy(self, a) -> np.ndarray:
        """A device array's contents; a host array as it is (as CuPy takes one)."""
        return a.get() if isinstance(a, DeviceArray) else np.asarray(a)

    def ascontiguousarray(self, a, dtype=None) -> DeviceArray:
        a = self.asarray(a, dtype)
        return a if a.a.flags.c_contiguous else a.copy()

    def empty(self, shape, dtype=np.float64) -> DeviceArray:
        return self.device.allocate(shape, dtype)

    def empty_like(self, a: DeviceArray) -> DeviceArray:
        return self.device.allocate(a.shape, a.dtype)

    def zeros(self, shape, dtype=np.float64) -> DeviceArray:
        return self.device.produce(lambda: np.zeros(shape, dtype))

    def zeros_like(self, a: DeviceArray) -> DeviceArray:
        return self.zeros(a.shape, a.dtype)

    def ones(self, shape, dtype=np.float64) -> DeviceArray:
        return self.device.produce(lambda: np.ones(shape, dtype))

    def full(self, shape, fill_value, dtype=None) -> DeviceArray:
        return self.device.produce(lambda: np.full(shape, fill_value, dtype))

    def concatenate(self, arrays, axis: int = 0) -> DeviceArray:
        parts = [self.device.operand(a) for a in arrays]
        if not all(isinstance(a, DeviceArray) for a in arrays):
            raise TypeError("cupy.concatenate takes device arrays")
        return self.device.produce(lambda: np.concatenate(parts, axis=axis))

    def partition(self, a: DeviceArray, kth: int, axis: int = -1) -> DeviceArray:
        return self.device.produce(lambda: np.partition(self.device.operand(a), kth, axis=axis))

    def nonzero(self, a: DeviceArray) -> tuple[DeviceArray, ...]:
        """Its size depends on the values: CuPy synchronises, and a capture refuses it."""
        self.device.refuse("cupy.nonzero (its output size is read back from the device)")
        return tuple(self.asarray(index) for index in np.nonzero(self.device.operand(a)))

    def exp(self, x: DeviceArray) -> DeviceArray:
        if not isinstance(x, DeviceArray):
            raise TypeError(f"Unsupported type {type(x)}")
        return np.exp(x)


@contextlib.contextmanager
def installed(monkeypatch):
    """A fresh simulated device under the GPU backend while the context lasts (monkeypatch undoes the
    rest at the test's end): `cupy` and build.kernel rebound in every engine module holding them, and
    the driver reporting one device. Yields the cupy stand-in, for tests that move data themselves.

    numpy's BLAS runs on one thread meanwhile: the twins' products are small, and OpenBLAS's idle
    workers spin on the cores a test run needs (a demo reply took 3.7 s with two threads on two busy
    cores, 0.8 s with one)."""
    import cupy

    import duet.engine.backend.cupy_model  # noqa: F401  the loader's way into the GPU backend: imports the rest

    device = SimulatedDevice()
    simulated = SimulatedCupy(device)
    real_kernel = build.kernel
    for name, module in list(sys.modules.items()):
        if name == "duet.engine" or name.startswith("duet.engine."):
            for attr, value in list(vars(module).items()):
                if value is cupy:
                    monkeypatch.setattr(module, attr, simulated)
                elif value is real_kernel:
                    monkeypatch.setattr(module, attr, device.kernel)
    monkeypatch.setattr(select, "cuda_device_count", lambda: 1)
    with threadpool_limits(limits=1, user_api="blas"):
        yield simulated


NO_GPU = ("needs an NVIDIA GPU and CuPy (pip install 'duet[gpu]'); here the kernels are compile-checked in "
          "test_kernels_compile.py and the backend's Python runs on the simulated device")


def cupy_fixture():
    """A GPU test module's `cp` fixture (`cp = cupy_fixture()`): the cupy module the GPU backend runs
    on, CuPy on a real device (skipped without one) and then the simulated device, which runs
    everywhere and proves the Python around the kernels, not the kernels."""

    @pytest.fixture(params=["cuda", "simulated"])
    def cp(request, monkeypatch):
        if request.param == "simulated":
            with installed(monkeypatch) as simulated:
                yield simulated
            return
        if backend_name("auto") != "cupy":
            pytest.skip(NO_GPU)
        import cupy

        yield cupy

    return cp


# ------------------------------------------------------------------------------- twins ---
# One per kernel of build.KERNELS: twin(grid, block, a), a holding the launch's arguments by the
# .cu parameter names (pointers as flat memory, see DeviceArray.pointer). Twins read and write
# what the kernel does, for the part of the work the grid covers.

def take(pointer: np.ndarray, *shape: int) -> np.ndarray:
    """The first prod(shape) elements at a pointer, as an array of that shape (a view)."""
    n = math.prod(shape)
    if pointer.size < n:
        raise IndexError(f"a kernel reads {n} elements where its allocation holds {pointer.size}")
    return pointer[:n].reshape(shape)


def take_rows(pointer: np.ndarray, rows: int, width: int, stride: int) -> np.ndarray:
    """`rows` rows of `width` elements, row r at pointer + r * stride (a copy: the rows may sit inside
    wider ones)."""
    if rows and (rows - 1) * stride + width > pointer.size:
        raise IndexError(f"a kernel reads {rows} rows of {width} at a stride of {stride} where its allocation "
                         f"holds {pointer.size}")
    return pointer[np.arange(rows)[:, None] * stride + np.arange(width)]


@functools.cache
def rotation(n: int) -> np.ndarray:
    """H / sqrt(n), H Sylvester's Hadamard matrix (engine.cache.Q4KVCache's rotation): symmetric, orthonormal."""
    matrix = hadamard(n) / np.sqrt(n)
    matrix.flags.writeable = False
    return matrix


def threads(grid: tuple, block: tuple) -> int:
    return grid[0] * block[0]


def w4a16_gemm(tiles: int, swiglu: bool = False):
    """w4a16_gemm_t8 (one n8 tile) / t16: split y sums the groups its warps take (warp w: groups
    8y + w, then every 8 * splits) into its partial output [T, N] (the output itself with one
    split); each tile's last split then sums the partials in split order into the output and sets
    its arrival count back to 0. w4a16_swiglu_t8 / t16: the same sums, then per 16-row tile
    silu(rows 0..7) * rows 8..15 into out [T, N / 2] (and bf16 bits where forms ask)."""
    warps = constant("w4a16", "W4_WARPS")

    def run(grid, block, a):
        N, K, T = int(a.N), int(a.K), int(a.T)
        rows, splits, tokens, G = min(N, 16 * grid[0]), grid[1], min(T, 8 * tiles), K // 128
        packed, scales = take(a.packed, N, K // 8)[:rows], take(a.scales, N, G)[:rows]
        x = bf16_to_f32(take(a.x, T, K)[:tokens])
        sums = np.empty((splits, tokens, rows), np.float32)
        split_of_group = (np.arange(G) // warps) % splits
        for s in range(splits):
            groups = np.flatnonzero(split_of_group == s)
            words, inputs = (np.ravel(n * groups[:, None] + np.arange(n)) for n in (16, 128))
            weight = W4Weight(np.ascontiguousarray(packed[:, words]), np.ascontiguousarray(scales[:, groups]))
            sums[s] = cpu.W4A16Linear(weight)(x[:, inputs]) if len(groups) else 0.0
        if splits > 1:
            if np.any(take(a.arrivals, grid[0]) != 0):
                raise ValueError("w4a16_gemm: a tile's arrival count is not 0 at launch")
            take(a.partial, splits, T, N)[:, :tokens, :rows] = sums
        total = np.zeros((tokens, rows), np.float32)
        for part in sums:  # in split order, as the last split adds
            total += part
        if not swiglu:
            take(a.out, T, N)[:tokens, :rows] = total
            return
        tiled = total.reshape(tokens, rows // 16, 2, 8)  # per tile: gate rows, then up rows
        value = (cpu_ops.silu(tiled[:, :, 0]) * tiled[:, :, 1]).reshape(tokens, rows // 2)
        take(a.out, T, N // 2)[:tokens, : rows // 2] = value
        if int(a.forms) & 1:
            take(a.out_bf16, T, N // 2)[:tokens, : rows // 2] = f32_to_bf16_bits(value)

    return run


def row_dots(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [T, K] times each weight row [N, K] -> [T, N], every output summed on its own (its bits do not
    depend on the other rows, as a warp per row gives them; a BLAS product's blocking would: einsum
    without optimize runs one sum of products per output)."""
    return np.einsum("tk,nk->tn", x, weight)


def bf16_gemv(grid, block, a):
    """A warp per weight row (8 a block): out [T, N] = x [T, K] times the widened bf16 rows."""
    N, K, T = int(a.N), int(a.K), int(a.T)
    rows = min(N, grid[0] * (block[0] // 32))
    take(a.out, T, N)[:, :rows] = row_dots(take(a.x, T, K), bf16_to_f32(take(a.w, N, K)[:rows]))


def bf16_swiglu(grid, block, a):
    """A warp per feature (8 a block): silu(gate) * up of its two widened bf16 rows times x."""
    I, K, T = int(a.I), int(a.K), int(a.T)
    features = min(I, grid[0] * (block[0] // 32))
    weight = bf16_to_f32(take(a.w, 2 * I, K))
    x = take(a.x, T, K)
    gate, up = row_dots(x, weight[:features]), row_dots(x, weight[I : I + features])
    take(a.out, T, I)[:, :features] = cpu_ops.silu(gate) * up


def embed_bf16(grid, block, a):
    T, H = grid[0], int(a.H)
    take(a.out, T, H)[...] = bf16_to_f32(take(a.table, a.table.size // H, H)[take(a.ids, T)])


def f32_to_bf16_bits_twin(grid, block, a):
    n = min(int(a.n), threads(grid, block))
    a.out[:n] = f32_to_bf16_bits(a.x[:n])


def quantize_int8_blocks_twin(grid, block, a):
    blocks = min(int(a.n_blocks), threads(grid, block) // 32)  # a warp per block
    q, scale = quantize_int8_blocks(take(a.x, blocks, 32))
    a.q[:blocks * 32] = q.ravel()
    a.scale[:blocks] = scale.ravel()


def rotate_quantize_int8(grid, block, a):
    blocks, K = min(int(a.n_blocks), threads(grid, block) // 32), int(a.K)
    x = take(a.x, blocks * 128)
    rotated = _hadamard_blocks(x * a.signs[np.arange(x.size) % K]).reshape(blocks, 128)  # the signs run along K
    scale = np.abs(rotated).max(axis=-1) / np.float32(127)
    a.q[:blocks * 128] = np.rint(rotated / np.where(scale > 0, scale, np.float32(1))[:, None]).ravel()
    a.scale[:blocks] = scale


INT8_CODECS = {"w4": None, "q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
               "iq4_xs": GGMLQuantizationType.IQ4_XS}


def int8_rows(codec: str, a, N: int, K: int, T: int, rows: np.ndarray) -> np.ndarray:
    """The CPU W4A8 route's block dots of weight rows `rows` (of N) on the codes the kernel reads: [T, len(rows)]."""
    raw = take(a.weights, N, int(a.row_bytes))[rows]
    q, ascale = take(a.q, T, K // 32, 32).astype(np.float32), take(a.ascale, T, K // 32)
    if codec == "w4":
        weight = W4Weight(raw.view(np.uint32), take(a.scales, N, K // 128)[rows])
        return cpu.W4A8Linear(weight)._rows(*weight.decode_rows(0, len(rows)), q, ascale)
    words = 5 * K // 256 if codec == "iq4_xs" else K // 32  # a row's scale words (w4a8.cu's scale_words)
    levels, scale = plane_units(codec, raw, take(a.scales, N, words)[rows], K)
    dots = np.einsum("rus,tus->tru", levels, q)  # exact in fp32: |dot| <= 32 x 127 x 127
    return (dots * (scale[None] * ascale[:, None, :])).sum(axis=-1)


def plane_units(codec: str, quants: np.ndarray, scales: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray]:
    """w4a8.cu's GGUF plane codecs: (levels fp32 [rows, K / 32, 32], scale fp32 [rows, K / 32]) of rows of a
    quant plane and their scale words."""
    rows, units = quants.shape[0], K // 32
    if codec == "q8_0":
        levels = quants.view(np.int8).reshape(rows, units, 32)
        return levels.astype(np.float32), scales.view(np.float16).astype(np.float32)
    unit_bytes = quants.reshape(rows, units, 16)
    nibbles = np.concatenate([unit_bytes & 0xF, unit_bytes >> 4], axis=-1)  # input k < 16: low nibble of byte k
    if codec == "q4_0":
        return nibbles.astype(np.float32) - 8, scales.view(np.float16).astype(np.float32)
    words = scales.reshape(rows, K // 256, 5)  # per 256 inputs: d, then 8 int8 ls - 32
    d = words[..., 0].view(np.float16).astype(np.float32)
    ls = np.ascontiguousarray(words[..., 1:]).view(np.int8).astype(np.float32)  # [rows, K / 256, 8]
    return IQ4_KVALUES[nibbles].astype(np.float32), (d[..., None] * ls).reshape(rows, units)


def w4a8_mma(tiles: int):
    """w4a8_mma_t8 (one n8 tile) / t16: each unit's exact int8 dots of the W4 rows, times weight scale x
    activation scale; split y sums the groups its warps take (warp w: groups 8y + w, then every
    8 * splits) into its partial output [T, N] (the output itself with one split); each tile's last
    split then sums the partials in split order into the output and sets its arrival count back to 0."""
    warps = constant("w4a8", "W4A8_WARPS")

    def run(grid, block, a):
        N, K, T = int(a.N), int(a.K), int(a.T)
        rows, splits, tokens, U = min(N, 16 * grid[0]), grid[1], min(T, 8 * tiles), K // 32
        weight = W4Weight(take(a.packed, N, K // 8)[:rows], take(a.scales, N, K // 128)[:rows])
        levels, scale, _ = weight.decode_rows(0, rows)  # [rows, K / 128, 128], [rows, K / 128]
        q = take(a.q, T, U, 32).astype(np.float32)[:tokens]
        dots = np.einsum("rus,tus->tru", levels.reshape(rows, U, 32), q)  # exact in fp32
        terms = dots * (np.repeat(scale, 4, axis=1)[None] * take(a.ascale, T, U)[:tokens, None, :])  # [T, rows, U]
        split_of_unit = (np.arange(U) // 4 // warps) % splits
        sums = np.stack([terms[..., split_of_unit == s].sum(axis=-1) for s in range(splits)])  # [splits, T, rows]
        if splits > 1:
            if np.any(take(a.arrivals, grid[0]) != 0):
                raise ValueError("w4a8_mma: a tile's arrival count is not 0 at launch")
            take(a.partial, splits, T, N)[:, :tokens, :rows] = sums
        total = np.zeros((tokens, rows), np.float32)
        for part in sums:  # in split order, as the last split adds
            total += part
        take(a.out, T, N)[:tokens, :rows] = total

    return run


def int8_gemv(codec: str, width: int):
    """int8_gemv_<codec>_t<width>: a warp per INT8_WARP_ROWS weight rows, up to `width` token rows."""

    def run(grid, block, a):
        N, K, T = int(a.N), int(a.K), int(a.T)
        if T > width:
            raise ValueError(f"int8_gemv_{codec}_t{width} takes up to {width} token rows, not {T}")
        rows = min(N, threads(grid, block) // 32 * constant("w4a8", "INT8_WARP_ROWS"))
        take(a.out, T, N)[:, :rows] = int8_rows(codec, a, N, K, T, np.arange(rows))

    return run


def int8_swiglu(codec: str, width: int):
    """int8_swiglu_<codec>_t<width>: a block per 32 features: silu(gate row f) * (up row I + f), with its forms."""

    def run(grid, block, a):
        I, K, T = int(a.I), int(a.K), int(a.T)
        if T > width:
            raise ValueError(f"int8_swiglu_{codec}_t{width} takes up to {width} token rows, not {T}")
        if block[0] != 256:
            raise ValueError("int8_swiglu: 8 warps of 4 features each: blocks of 256")
        features = np.arange(min(I, 32 * grid[0]))
        gate, up = (int8_rows(codec, a, 2 * I, K, T, rows) for rows in (features, I + features))
        y = take(a.out, T, I)
        y[:, : features.size] = cpu_ops.silu(gate) * up
        if features.size == I:
            emit_forms(a, y.ravel())

    return run


def deltanet_keep(DK: int):
    """deltanet_keep_dk<DK>: block (head h, 32 value columns); S = prior, then rows 0 .. rows - 1 of
    row_inputs replayed as the CPU's reference replays its own (cpu_ops.replay_rows), as delta_rule_rows
    ran them in deltanet_rows."""

    def run(grid, block, a):
        if block[0] != 128:
            raise ValueError("deltanet_keep: four threads per value column, 32 columns: blocks of 128")
        Hv, DV, rows = int(a.Hv), int(a.DV), int(a.rows)
        heads, cols = min(Hv, grid[0]), min(DV, 32 * grid[1])
        inputs = take(a.row_inputs, rows, Hv, DK + DV + 2)  # per row and head: k | v | beta | e^g
        row_inputs = (inputs[..., :DK], inputs[..., DK : DK + DV], inputs[..., DK + DV], inputs[..., DK + DV + 1])
        S = cpu_ops.replay_rows(take(a.prior, Hv, DK, DV), row_inputs, rows)
        take(a.state, Hv, DK, DV)[:heads, :, :cols] = S[:heads, :, :cols]

    return run


def trellis_gemv(grid, block, a):
    N, K, T, k = int(a.N), int(a.K), int(a.T), int(a.k)
    if a.multiplier != MULTIPLIERS[k]:
        raise ValueError(f"trellis_gemv: multiplier {a.multiplier:#x} is not rate {k}'s")
    rows = min(N, 16 * grid[0])
    packed = take(a.packed, N // 16 * K // 8, 16 * k)
    weight = TrellisWeight(packed, take(a.row_scale, N), (N, K), k, seed=0)  # the seed rotates inputs only
    q = take(a.q, T, K // 128, 128).astype(np.float32)
    take(a.out, T, N)[:, :rows] = cpu._trellis_rows(*weight.decode_rows(0, rows), q, take(a.ascale, T, K // 128))


def deltanet_rows(DK: int):
    """deltanet_rows_dk<DK>: block (head h, 32 value columns); the causal conv over the ring's history
    (by engine.backend.cpu_ops.causal_conv), then S and the output o by cpu_ops.delta_rule_rows (b and a
    made from in_proj_b/a's rows where K > 0), with `record` S before the launch into prior and each
    row's k | v | beta | e^g into row_inputs (what deltanet_keep replays); the call's
    rows into the ring for the channels the grid's blocks own; the gated norm of every head whose
    column blocks the grid covers, with its forms."""

    def run(grid, block, a):
        if block[0] != 128:
            raise ValueError("deltanet_rows: four threads per value column, 32 columns: blocks of 128")
        T, Hk, Hv, DV, KW, R = int(a.T), int(a.Hk), int(a.Hv), int(a.DV), int(a.KW), constant("deltanet", "CONV_RING")
        if R < KW - 1 + T:
            raise ValueError(f"deltanet_rows: a ring of {R} rows cannot hold {KW - 1} rows of history and {T} new ones apart")
        heads, cols = min(Hv, grid[0]), min(DV, 32 * grid[1])
        C, P = 2 * Hk * DK + Hv * DV, int(take(a.start, 1)[0])
        mixed, ring = take_rows(a.mixed, T, C, int(a.in_stride)), take(a.ring, R, C)
        history = SimpleNamespace(conv=ring[(P - KW + 1 + np.arange(KW - 1)) % R])  # positions P - KW + 1 .. P - 1
        conv = cpu_ops.causal_conv(mixed, take(a.taps, C, KW), history)
        qk = conv[:, : 2 * Hk * DK].reshape(T, 2, Hk, DK)  # normalised here
        q, k = cpu_ops.l2_normalize(qk[:, 0]) * a.q_scale, cpu_ops.l2_normalize(qk[:, 1])
        q, k = (np.repeat(x, Hv // Hk, axis=1) for x in (q, k))  # value head h reads key head h // (Hv / Hk)
        if int(a.K):  # in_proj_b/a's bf16 rows times the normed input, as bf16_gemv
            K = int(a.K)
            b_and_a = row_dots(take(a.x, T, K), bf16_to_f32(take(a.ba_w, 2 * Hv, K)))
            b, raw_a = b_and_a[:, :Hv], b_and_a[:, Hv:]
        else:
            b, raw_a = take_rows(a.b, T, Hv, int(a.ba_stride)), take_rows(a.a, T, Hv, int(a.ba_stride))
        beta = cpu_ops.sigmoid(b)
        log_decay = take(a.decay_rate, Hv) * cpu_ops.softplus(raw_a + take(a.dt_bias, Hv))
        S = take(a.state, Hv, DK, DV)
        state = DeltaNetState(1, 1, Hv, DK, DV)
        state.recurrent = S.copy()
        v = conv[:, 2 * Hk * DK :].reshape(T, Hv, DV)
        o = cpu_ops.delta_rule_rows(q, k, v, beta, log_decay, state)
        take(a.out, T, Hv, DV)[:, :heads, :cols] = o[:, :heads, :cols]
        if int(a.record):
            take(a.prior, Hv, DK, DV)[:heads, :, :cols] = S[:heads, :, :cols]
            inputs = take(a.row_inputs, T, Hv, DK + DV + 2)
            if cols:  # a head's first column block writes its k, beta and e^g
                inputs[:, :heads, :DK] = k[:, :heads]
                inputs[:, :heads, DK + DV] = beta[:, :heads]
                inputs[:, :heads, DK + DV + 1] = state.row_inputs[3][:, :heads]  # e^g as delta_rule_rows ran it
            inputs[:, :heads, DK : DK + cols] = v[:, :heads, :cols]
        S[:heads, :, :cols] = state.recurrent[:heads, :, :cols]
        slots = (P + np.arange(T)) % R
        for hk in range(Hk):
            if hk * (Hv // Hk) < heads:  # the first block of the key head's first value head writes its q and k
                for channel in (hk * DK, (Hk + hk) * DK):
                    ring[slots, channel : channel + DK] = mixed[:, channel : channel + DK]
        for h in range(heads):
            first = 2 * Hk * DK + h * DV
            ring[slots, first : first + cols] = mixed[:, first : first + cols]
        if cols < DV:  # no head's last block ran: nothing normed
            return
        gate = cpu_ops.sigmoid if a.sigmoid else cpu_ops.silu
        z = take_rows(a.z, T, Hv * DV, int(a.z_stride)).reshape(T, Hv, DV)
        y = take(a.y, T, Hv, DV)
        y[:, :heads] = cpu_ops.rms_norm(o[:, :heads], take(a.w, DV), a.eps) * gate(z[:, :heads])
        for t in range(T):  # the normed heads' forms, at their places in [T, Hv * DV]
            at = (t * Hv) * DV
            emit_forms(SimpleNamespace(y_bf16=a.y_bf16[at:], y_q=a.y_q[at:], y_scale=a.y_scale[at // 32 :], forms=a.forms),
                       y[t, :heads].ravel())

    return run


def rms_norm(grid, block, a):
    R, D, k = grid[0], int(a.D), int(a.weight_rows)  # a block per row; row r takes weight row r % k
    x, w, y = take(a.x, R, D), take(a.w, k, D), take(a.y, R, D)
    for s in range(k):
        y[s::k] = cpu_ops.rms_norm(x[s::k], w[s], a.eps)
    emit_forms(a, y.ravel())


def emit_forms(a, values: np.ndarray) -> None:
    """common.cuh's emit_forms beside a kernel's fp32 output `values` (flat, as written from index 0):
    bf16 bits as f32_to_bf16_bits, int8 codes and a scale per 32 as quantize_int8_blocks."""
    forms, n = int(a.forms), values.size
    if forms & 1:
        a.y_bf16[:n] = f32_to_bf16_bits(values)
    if forms & 2:
        if n % 32:
            raise ValueError("an int8 emission needs whole 32-blocks")
        q, scale = quantize_int8_blocks(values.reshape(-1, 32))
        a.y_q[:n] = q.ravel()
        a.y_scale[: n // 32] = scale.ravel()


def add_rms_norm(grid, block, a):
    R, D = grid[0], int(a.D)  # a block per row
    total = take(a.x, R, D) + take(a.delta, R, D)
    take(a.sum, R, D)[...] = total
    y = take(a.y, R, D)
    y[...] = cpu_ops.rms_norm(total, take(a.w, D), a.eps)
    emit_forms(a, y.ravel())


def qk_norm_rope(grid, block, a, append: bool = False):
    blocks, T, D, heads = grid[0], grid[1], int(a.D), int(a.q_heads)
    if block[0] != D:
        raise ValueError("qk_norm_rope: a thread per element of the head")
    rotary = int(a.rotary_dim)
    angles = (a.start[0] + np.arange(T))[:, None].astype(np.float32) * take(a.inv_freq, rotary // 2)[None, :]
    for x, w, first, count, row_stride, head_stride in ((a.xq, a.wq, 0, min(heads, blocks), a.q_row_stride, a.q_head_stride),
                                                       (a.xk, a.wk, heads, blocks - heads, a.k_row_stride, D)):
        if count <= 0:
            continue
        t, h = np.arange(T)[:, None], np.arange(count)[None, :]
        heads_in = x[(t * int(row_stride) + h * int(head_stride))[..., None] + np.arange(D)]  # [T, count, D]
        y = cpu_ops.apply_rope(cpu_ops.rms_norm(heads_in, take(w, D), a.eps), np.cos(angles), np.sin(angles))
        if first == 0:
            take(a.yq, T, count, D)[...] = y
        elif not append:
            take(a.yk, T, count, D)[...] = y
        else:  # keys and values into the bf16 cache, as kv_append_bf16
            positions = int(a.cache_start[0]) + np.arange(T)
            values = take_rows(a.v, T, count * D, int(a.v_row_stride)).reshape(T, count, D)
            for rows, cache in ((y, a.keys), (values, a.values)):
                take(cache, count, int(a.capacity), D)[:, positions] = f32_to_bf16_bits(rows).transpose(1, 0, 2)


def silu_mul(grid, block, a):
    inner, size = int(a.I), int(a.n)
    n = min(size, threads(grid, block))
    gate_up = take(a.gate_up, size // inner, 2 * inner)
    a.out[:n] = (cpu_ops.silu(gate_up[:, :inner]) * gate_up[:, inner:]).ravel()[:n]
    emit_forms(a, a.out[:n])


def attention_gate(grid, block, a):
    D, heads, size = int(a.D), int(a.heads), int(a.n)
    n = min(size, threads(grid, block))
    rows = take_rows(a.q_and_gate, size // (heads * D), heads * 2 * D, int(a.row_stride))
    gate = rows.reshape(-1, 2 * D)[:, D:]  # the second half of each head's [query | gate]
    a.out[:n] = (take(a.attn, size // D, D) * cpu_ops.sigmoid(gate)).ravel()[:n]
    emit_forms(a, a.out[:n])


# attention: a source of rows for a query row ending at `end` is (lo, hi, rows(i) -> keys, values [kv, n, HD])

def bf16_rows(a, kv: int, HD: int):
    keys, values = (take(p, kv, int(a.capacity), HD) for p in (a.keys, a.values))
    return lambda end: (0, end, lambda i: (bf16_to_f32(keys[:, i]), bf16_to_f32(values[:, i])))


def q4_rows(a, kv: int, HD: int):
    """The quantized middle, in the rotated basis."""
    sink, recent, capacity = constant("attention", "Q4_SINK"), constant("attention", "Q4_RECENT"), int(a.capacity)
    codes = [take(p, kv, capacity, HD // 2) for p in (a.key_codes, a.value_codes)]
    scales = [take(p, kv, capacity, HD // 32).view(np.float16) for p in (a.key_scales, a.value_scales)]

    def rows(i):
        return tuple(dequantize_q4(c[:, i], s[:, i]) for c, s in zip(codes, scales))

    return lambda end: (sink, max(sink, end - recent), rows)


def exact_rows(a, kv: int, HD: int):
    """The sink rows, then the ring rows of the recent window."""
    sink_rows, recent, ring_rows = constant("attention", "Q4_SINK"), constant("attention", "Q4_RECENT"), int(a.ring_rows)
    sinks = [take(p, kv, sink_rows, HD) for p in (a.sink_keys, a.sink_values)]
    rings = [take(p, kv, ring_rows, HD) for p in (a.ring_keys, a.ring_values)]

    def source(end: int):
        in_sink, window = min(end, sink_rows), max(sink_rows, end - recent)

        def rows(i):  # i ascending: sink rows first
            positions = window + i[i >= in_sink] - in_sink
            return tuple(np.concatenate([s[:, i[i < in_sink]], r[:, positions % ring_rows]], axis=1)
                         for s, r in zip(sinks, rings))

        return 0, in_sink + max(0, end - window), rows

    return source


def attention_partial(kind: str, HD: int):
    """attention_partial_<kind>_hd<HD>: block (chunk c, head h, row t) writes slot chunk_offset + c:
    (max score, sum of e^(s - max)) and the sum of e^(s - max) v over its rows; an empty chunk (-inf, 0, 0)."""
    sources = {"bf16": bf16_rows, "q4": q4_rows, "exact": exact_rows}

    def run(grid, block, a):
        source = sources[kind](a, int(a.kv), HD)
        partials(kind, HD, grid, a, lambda t: source(int(a.start[0]) + t + 1))

    return run


def sparse_attention_partial(kind: str, HD: int):
    """sparse_attention_partial_<kind>_hd<HD>: attention_partial's slots over the list indices of query row t's
    selected cache rows (selected[t, :counts[t]], ascending): all of them (bf16); on the q4 cache the run of
    quantized middle rows (q4), or the exact rows around it (exact)."""
    sources = {"bf16": bf16_rows, "q4": q4_rows, "exact": exact_by_position}

    def run(grid, block, a):
        width, sink, recent = int(a.width), constant("attention", "Q4_SINK"), constant("attention", "Q4_RECENT")
        rows_at = sources[kind](a, int(a.kv), HD)(0)[2]  # cache rows by position (a row source's rows need no end here)

        def listed(t: int):
            positions = take(a.selected, grid[2], width)[t, : int(a.counts[t])]
            if kind == "bf16":
                return 0, len(positions), lambda i: rows_at(positions[i])
            end = int(a.start[0]) + t + 1
            middle = (positions >= sink) & (positions < max(sink, end - recent))  # a run: the list is ascending
            lo, hi = np.searchsorted(positions, [sink, max(sink, end - recent)])
            assert np.array_equal(np.flatnonzero(middle), np.arange(lo, hi))
            kept = positions[middle] if kind == "q4" else positions[~middle]
            first = lo if kind == "q4" else 0
            return first, first + len(kept), lambda i: rows_at(kept[i - first])

        partials(kind, HD, grid, a, listed)

    return run


def exact_by_position(a, kv: int, HD: int):
    """The q4 cache's exact rows by position: the sink rows below Q4_SINK, the ring's row p % ring_rows above."""
    sink_rows, ring_rows = constant("attention", "Q4_SINK"), int(a.ring_rows)
    sinks = [take(p, kv, sink_rows, HD) for p in (a.sink_keys, a.sink_values)]
    rings = [take(p, kv, ring_rows, HD) for p in (a.ring_keys, a.ring_values)]

    def rows(p):
        return tuple(np.where((p < sink_rows)[None, :, None], s[:, np.minimum(p, sink_rows - 1)], r[:, p % ring_rows])
                     for s, r in zip(sinks, rings))

    return lambda end: (0, end, rows)


def partials(kind: str, HD: int, grid, a, source_of_row) -> None:
    """The partial slots of every block (chunk c, head h, row t) of the grid; source_of_row(t) -> (lo, hi,
    rows(i) -> keys, values [kv, n, HD]) gives the indices the row's chunks run over."""
    chunks, heads, T = grid
    all_heads, kv, chunk, n_slots = int(a.heads), int(a.kv), int(a.chunk), int(a.n_slots)
    offset = int(a.chunk_offset) if kind == "q4" else 0
    q = take(a.q, T, all_heads, HD)[:, :heads]
    if kind == "q4":  # q . k = (H diag(s) q / sqrt(HD)) . r for a row stored rotated
        q = (q * take(a.signs, HD)) @ rotation(HD)
    kv_of_head = np.arange(heads) // (all_heads // kv)
    part_ml, part_acc = take(a.part_ml, T, all_heads, n_slots, 2), take(a.part_acc, T, all_heads, n_slots, HD)
    for t in range(T):
        lo, hi, rows = source_of_row(t)
        for c in range(chunks):
            i, slot = np.arange(lo + c * chunk, min(hi, lo + (c + 1) * chunk)), offset + c
            if not len(i):
                part_ml[t, :heads, slot], part_acc[t, :heads, slot] = (-np.inf, 0.0), 0.0
                continue
            keys, values = (r[kv_of_head] for r in rows(i))  # [heads, n, HD]
            scores = np.einsum("hd,hnd->hn", q[t], keys) * a.scale
            top = scores.max(axis=-1)
            p = np.exp(scores - top[:, None])
            part_ml[t, :heads, slot] = np.stack([top, p.sum(axis=-1)], axis=-1)
            part_acc[t, :heads, slot] = np.einsum("hn,hnd->hd", p, values)


def attention_bf16(HD: int):
    """attention_bf16_hd<HD>: block (chunk c, KV head g, row t) writes the bf16 partials of g's query
    heads, then (the last chunk of each row and KV head) attention_combine's output for them; the
    arrival counts are 0 at launch and left so."""
    partial = attention_partial("bf16", HD)

    def run(grid, block, a):
        chunks, groups, T = grid
        if np.any(take(a.arrivals, T * groups) != 0):
            raise ValueError("attention_bf16: an arrival count is not 0 at launch")
        a.n_slots = chunks  # one slot a chunk
        heads = groups * (int(a.heads) // int(a.kv))  # the query heads of the KV heads the grid covers
        partial((chunks, heads, T), block, a)
        combine(a, heads, T, HD, chunks, chunks)

    return run


def attention_combine(grid, block, a):
    if block[0] != int(a.HD):
        raise ValueError("attention_combine: a thread per output dimension")
    combine(a, grid[0], grid[1], int(a.HD), int(a.n_plain), int(a.n_slots))


def combine(a, heads: int, T: int, HD: int, n_plain: int, n_slots: int) -> None:
    """attention.cu's combine_head for every head and row: the slots rescaled to one max and divided, the
    rotated ones unrotated, gated and emitted where asked."""
    ml, acc = take(a.part_ml, T, heads, n_slots, 2), take(a.part_acc, T, heads, n_slots, HD)
    top, empty = ml[..., 0], ml[..., 0] == -np.inf
    with np.errstate(invalid="ignore"):
        weight = np.exp(top - top.max(axis=-1, keepdims=True))
    weighted = np.where(empty[..., None], np.float32(0), weight[..., None] * acc)  # empty chunks are skipped
    total = np.where(empty, np.float32(0), weight * ml[..., 1]).sum(axis=-1)
    out = weighted[:, :, :n_plain].sum(axis=2)
    if n_slots > n_plain:  # the rotated slots, unrotated: (r @ H / sqrt(HD)) * signs
        out = out + (weighted[:, :, n_plain:].sum(axis=2) @ rotation(HD)) * take(a.signs, HD)
    out = out / total[..., None]
    if int(a.gated):  # attention_gate's step, the gates read in place
        gates = take_rows(a.gates, T, heads * 2 * HD, int(a.gate_row_stride)).reshape(T, heads, 2 * HD)[..., HD:]
        out = out * cpu_ops.sigmoid(gates)
    take(a.out, T, heads, HD)[...] = out
    emit_forms(a, out.ravel())


def kv_append_bf16(grid, block, a):
    T, kv, HD = grid[0], grid[1], int(a.HD)
    if block[0] != HD:
        raise ValueError("kv_append_bf16: a thread per element of the row")
    positions = int(a.start[0]) + np.arange(T)
    for rows, cache in ((take(a.k, T, kv, HD), a.keys), (appended_values(a, T, kv, HD), a.values)):
        take(cache, kv, int(a.capacity), HD)[:, positions] = f32_to_bf16_bits(rows).transpose(1, 0, 2)


def appended_values(a, T: int, kv: int, HD: int) -> np.ndarray:
    """The value rows a kv_append kernel reads in place, [T, kv, HD] at a row stride of v_row_stride."""
    return take_rows(a.v, T, kv * HD, int(a.v_row_stride)).reshape(T, kv, HD)


def kv_append_q4(grid, block, a):
    T, kv, sides, HD = grid[0], grid[1], grid[2], int(a.HD)
    sink_rows, ring_rows, capacity = constant("attention", "Q4_SINK"), int(a.ring_rows), int(a.capacity)
    positions = int(a.start[0]) + np.arange(T)
    in_sink = positions < sink_rows
    for x, codes, scales, sink, ring in ((take(a.k, T, kv, HD), a.key_codes, a.key_scales, a.sink_keys, a.ring_keys),
                                         (appended_values(a, T, kv, HD), a.value_codes, a.value_scales, a.sink_values,
                                          a.ring_values))[:sides]:
        take(ring, kv, ring_rows, HD)[:, positions % ring_rows] = x.transpose(1, 0, 2)
        take(sink, kv, sink_rows, HD)[:, positions[in_sink]] = x[in_sink].transpose(1, 0, 2)
        row_codes, row_scales = quantize_q4((x * take(a.signs, HD)) @ rotation(HD))
        take(codes, kv, capacity, HD // 2)[:, positions] = row_codes.transpose(1, 0, 2)
        take(scales, kv, capacity, HD // 32)[:, positions] = row_scales.view(np.uint16).transpose(1, 0, 2)


# Flash-Next (flash_next.cu): flash_next.FlashCpuOps's steps, the CPU's numerics
FLASH = FlashCpuOps(compiled_steps=False)


def silu_div(grid, block, a):
    n = min(int(a.n), threads(grid, block))
    a.out[:n] = FLASH.silu_div(a.x[:n], a.divisor)


def hc_mix(grid, block, a):
    H, hc, size = int(a.H), int(a.hc), int(a.n)
    n, T = min(size, threads(grid, block)), size // H
    mixed = FLASH.hc_mix(take(a.normed, T, hc * H), take(a.logits, T, hc * H), hc)
    a.mixed[:n] = mixed.ravel()[:n]


def hc_inject(grid, block, a):
    H, hc, size = int(a.H), int(a.hc), int(a.n)
    n, T = min(size, threads(grid, block)), size // (hc * H)
    injected = FLASH.hc_inject(take(a.streams, T, hc * H), take(a.out, T, H), take(a.logits, T, hc), hc)
    a.out_streams[:n] = injected.ravel()[:n]


def ple_gate(grid, block, a):
    R, H, hc = grid[0], int(a.H), int(a.hc)  # a block per stream row
    if a.root_h != np.float32(np.sqrt(H)):
        raise ValueError(f"ple_gate: root_h {a.root_h} is not sqrt(H) in fp32")
    T = -(-R // hc)
    gated = FLASH.ple_gate(take(a.key, T, hc * H), take(a.query, T, hc * H), take(a.value, T, H), hc)
    take(a.gated, R, H)[...] = gated.reshape(T * hc, H)[:R]


def ple_conv(grid, block, a):
    T, C, K, dilation = int(a.T), int(a.C), int(a.K), int(a.dilation)
    c, R = min(C, threads(grid, block)), (K - 1) * dilation  # a thread per channel
    history = take(a.history, R, C)
    state = SimpleNamespace(conv=history.copy())
    x = take(a.x, T, C)
    out = FLASH.ple_conv(take(a.gated, T, C), x, take(a.taps, C, K), dilation, state)
    take(a.window, R + T, C)[:, :c] = np.concatenate([history, x])[:, :c]
    take(a.out, T, C)[:, :c] = out[:, :c]


def index_pool(grid, block, a):
    n, d, ratio, first = grid[0], block[0], int(a.ratio), int(a.first_block)  # a block per new block, a thread per dim
    raw = take(a.raw, (first + n) * ratio, d)[first * ratio:].reshape(n, ratio, d)
    pooled = cpu_ops.rms_norm(raw.mean(axis=1), take(a.w, d), a.eps)
    rotary = int(a.rotary_dim)
    positions = (first + np.arange(n)) * ratio + int(a.offset)
    angles = positions[:, None].astype(np.float32) * take(a.inv_freq, rotary // 2)[None, :]
    take(a.blocks, first + n, d)[first:] = cpu_ops.apply_rope(pooled[:, None, :], np.cos(angles), np.sin(angles))[:, 0]


def index_scores(grid, block, a):
    T, heads, d, ratio, n_blocks = grid[1], int(a.heads), int(a.d), int(a.ratio), int(a.n_blocks)
    covered = min(n_blocks, grid[0] * block[0] // 32)  # a warp per block
    q, blocks = take(a.q, T, heads, d), take(a.blocks, covered, d)
    scores = take(a.scores, T, n_blocks)
    for t in range(T):
        complete = min(covered, (int(a.start[0]) + t + 1) // ratio)
        scores[t, :covered] = -np.inf
        scores[t, :complete] = np.maximum(q[t] @ blocks[:complete].T, 0).sum(axis=0)  # relu summed over heads


def qsa_select(grid, block, a):
    ratio, top_blocks, n_blocks, width = int(a.ratio), int(a.top_blocks), int(a.n_blocks), int(a.width)
    scores, selected = take(a.scores, grid[0], n_blocks), take(a.selected, grid[0], width)
    for t in range(grid[0]):  # a block per query row
        row = int(a.start[0]) + t
        complete = (row + 1) // ratio
        if complete <= top_blocks:
            rows = np.arange(row + 1)
        else:
            top = np.argsort(-scores[t, :complete], kind="stable")[:top_blocks]  # ties: the earlier block
            scores[t, top] = -np.inf  # the kernel marks each block it takes
            tail = np.arange(complete * ratio, row + 1)
            rows = np.concatenate([(np.sort(top)[:, None] * ratio + np.arange(ratio)).ravel(), tail])
        selected[t, :len(rows)] = rows
        a.counts[t] = len(rows)


TWINS = {
    "bf16_gemv": bf16_gemv, "bf16_swiglu": bf16_swiglu, "embed_bf16": embed_bf16, "w4a16_gemm_t8": w4a16_gemm(1), "w4a16_gemm_t16": w4a16_gemm(2),
    "w4a16_swiglu_t8": w4a16_gemm(1, swiglu=True), "w4a16_swiglu_t16": w4a16_gemm(2, swiglu=True),
    "f32_to_bf16_bits": f32_to_bf16_bits_twin,
    "quantize_int8_blocks": quantize_int8_blocks_twin, "rotate_quantize_int8": rotate_quantize_int8,
    "w4a8_mma_t8": w4a8_mma(1), "w4a8_mma_t16": w4a8_mma(2),
    **{f"int8_{kind}_{codec}_t{width}": make(codec, width) for kind, make in (("gemv", int8_gemv), ("swiglu", int8_swiglu))
       for codec in INT8_CODECS for width in (4, 16)}, "trellis_gemv": trellis_gemv,
    **{f"deltanet_rows_dk{dk}": deltanet_rows(dk) for dk in (32, 64, 128)},
    **{f"deltanet_keep_dk{dk}": deltanet_keep(dk) for dk in (32, 64, 128)},
    **{f"attention_bf16_hd{hd}": attention_bf16(hd) for hd in (64, 128, 256)},
    **{f"attention_partial_{kind}_hd{hd}": attention_partial(kind, hd) for hd in (64, 128, 256)
       for kind in ("q4", "exact")},
    **{f"sparse_attention_partial_{kind}_hd{hd}": sparse_attention_partial(kind, hd) for hd in (64, 128, 256)
       for kind in ("bf16", "q4", "exact")},
    "attention_combine": attention_combine, "kv_append_bf16": kv_append_bf16, "kv_append_q4": kv_append_q4,
    "rms_norm": rms_norm, "add_rms_norm": add_rms_norm,
    "qk_norm_rope": qk_norm_rope, "qk_norm_rope_append_bf16": functools.partial(qk_norm_rope, append=True), "silu_mul": silu_mul, "attention_gate": attention_gate,
    "silu_div": silu_div, "hc_mix": hc_mix, "hc_inject": hc_inject, "ple_gate": ple_gate, "ple_conv": ple_conv,
    "index_pool": index_pool, "index_scores": index_scores, "qsa_select": qsa_select,
}
