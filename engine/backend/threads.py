"""The CPU worker threads that split a prefill's work between the cores, and numpy's BLAS limits.

`start()` is called once a model is built (engine/model.py): it sizes the split to the cores and
BLAS threads this process has and keeps glibc from handing freed activation buffers back to the OS.
Until then `in_parallel` runs every piece of work whole.
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import threading
from contextlib import contextmanager, nullcontext

from threadpoolctl import ThreadpoolController


def reuse_freed_memory() -> None:
    """Let glibc keep freed activation buffers for reuse instead of handing them back to the OS.

    A prefill step makes and frees temporaries of a few MB each. By default glibc returns the top of
    the heap to the OS once 2x the largest recently freed block is free there, so every elementwise op
    page-faults its output in again: silu over [128, 6144] took 2.6 ms that way, 1.2 ms with this.
    Blocks of 32 MB and more (weights, long prompts) still come from mmap and go back when freed;
    at most 256 MB of freed heap is kept. Process-wide; a no-op where libc has no mallopt.
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
BLAS: ThreadpoolController | None = None  # made on first use: inspecting the loaded libraries takes a while
PARTS = 1  # parts a split makes; start() sets one per core


@functools.cache
def start() -> None:
    """Size the split to this process (PARTS), start a worker per part beyond the caller's, and set
    the allocator up. Once a process; later calls do nothing."""
    global PARTS
    PARTS = _parts()
    for i in range(PARTS - 1):
        _worker(i)
    reuse_freed_memory()


def blas() -> ThreadpoolController:
    """threadpoolctl's view of the BLAS and OpenMP libraries this process has loaded."""
    global BLAS
    if BLAS is None:
        BLAS = ThreadpoolController()
    return BLAS


def _parts() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    blas_threads = min((lib.num_threads for lib in blas().select(user_api="blas").lib_controllers), default=1)
    return max(1, min(cores, blas_threads))


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


_workers: list[_Worker] = []  # one per part beyond the caller's


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
            with blas().limit(limits=1, user_api="blas"):
                yield
    finally:
        _blas_limited.depth = depth


_SPLITTING = threading.Lock()  # held while a split runs: a split inside one, or beside one, runs whole


def in_parallel(work, n: int, split: bool = True, blas: bool = True) -> None:
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
        with one_blas_thread() if blas else nullcontext():
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


def in_compiled_parts(parallel, serial, args: tuple, n: int) -> None:
    """A compiled kernel of the form kernel(*args, lo, hi) over [0, n): serial(*args, 0, n), or, when
    more than one core serves, parallel(args, n, parts), which cuts [0, n) into PARTS
    contiguous parts that numba's own threads run at once (a region starts in ~2-5 us; a handoff to
    the workers above took ~100 us under the GIL, ~115 times a 0.8B decode step). One split runs at a
    time, as in in_parallel: a kernel called beside or inside another split runs whole (numba's
    fallback thread pool may not be entered by two threads at once)."""
    parts = min(PARTS, n)
    if parallel is None or parts < 2 or not _SPLITTING.acquire(blocking=False):
        serial(*args, 0, n)
        return
    try:
        parallel(args, n, parts)
    finally:
        _SPLITTING.release()


def in_team(team, alone, args: tuple) -> None:
    """A compiled team kernel, kernel(*args, member, members), whose members share each stage of its
    work (compiled.py's MTP section): team(args, PARTS), its driver, running PARTS members on numba's
    threads at once; or alone(*args, 0, 1) on the calling thread where one core serves or another split
    runs (as in_compiled_parts). Each stage's output has the same bits either way."""
    if team is None or PARTS < 2 or not _SPLITTING.acquire(blocking=False):
        alone(*args, 0, 1)
        return
    try:
        team(args, PARTS)
    finally:
        _SPLITTING.release()
