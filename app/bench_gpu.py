"""W4 GEMV bandwidth on the GPU against the physical limit, both routes side by side.

Each weight of the 27B geometry (REFERENCE.md section 1: hidden 5120, 24 query / 4 KV heads of 256,
DeltaNet 16 key / 48 value heads of 128, intermediate 17408, vocab 248320) as random INT4 in the W4
layout, run through the w4a16 and w4a8 Linears at 1, 4, 8 and 16 rows. A figure is weight bytes
(packed nibbles + bf16 scales) over the median time of one call, route overheads (activation
rounding or int8 quantization) included, as a share of the device-to-device copy bandwidth
measured in the same run ((bytes read + bytes written) / time, what a memory-bound pass can reach).
Each weight has enough copies in rotation that the L2 cache never holds the one being read.

    python -m app.bench_gpu [--json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

HIDDEN, HEAD_DIM, Q_HEADS, KV_HEADS = 5120, 256, 24, 4
DN_KEY_HEADS, DN_VALUE_HEADS, DN_DIM = 16, 48, 128
INTERMEDIATE, VOCAB = 17408, 248320
SHAPES = {  # name: (N outputs, K inputs)
    "attn q_proj (query|gate)": (2 * Q_HEADS * HEAD_DIM, HIDDEN),
    "attn k_proj / v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn o_proj": (HIDDEN, Q_HEADS * HEAD_DIM),
    "deltanet in_proj_qkv": (2 * DN_KEY_HEADS * DN_DIM + DN_VALUE_HEADS * DN_DIM, HIDDEN),
    "deltanet in_proj_z": (DN_VALUE_HEADS * DN_DIM, HIDDEN),
    "deltanet out_proj": (HIDDEN, DN_VALUE_HEADS * DN_DIM),
    "mlp gate_up": (2 * INTERMEDIATE, HIDDEN),
    "mlp down": (HIDDEN, INTERMEDIATE),
    "lm_head (int4 ranking)": (VOCAB, HIDDEN),
}
ROWS = (1, 4, 8, 16)
ROUTES = ("w4a16", "w4a8")
ROTATION_BYTES = 512 << 20  # weight bytes cycled through per shape: several times any L2 cache


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Device-to-device copy, (read + written bytes) / median time, in bytes/s."""
    import cupy as cp

    src = cp.ones(nbytes // 4, cp.float32)
    dst = cp.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.__setitem__(Ellipsis, src), repeats)


def _median_seconds(call, repeats: int) -> float:
    import cupy as cp

    for _ in range(3):
        call()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record()
        call()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def random_w4(N: int, K: int, rng: np.random.Generator):
    """Random nibbles and bf16 scales in the W4 layout (the bytes are what is measured)."""
    from engine.quant.w4 import W4Weight

    packed = rng.integers(0, 1 << 32, (N, K // 8), dtype=np.uint32)
    scales = np.full((N, K // 128), 0x3C00, np.uint16)  # bf16 2^-7
    return W4Weight(packed, scales)


def gemv_table(shapes=SHAPES, rows=ROWS, routes=ROUTES, repeats: int = 20) -> dict:
    """{copy_bytes_per_s, rows, results: [{name, N, K, weight_bytes, route, rows, bytes_per_s, of_copy}]}."""
    import cupy as cp

    from engine.backend import cupy_backend

    copy = copy_bandwidth()
    rng = np.random.default_rng(0)
    results = []
    for name, (N, K) in shapes.items():
        weight = random_w4(N, K, rng)
        copies = max(1, -(-ROTATION_BYTES // weight.nbytes))
        for route in routes:
            linears = [cupy_backend.make_linear(weight, route) for _ in range(copies)]
            for T in rows:
                x = cp.asarray(rng.standard_normal((T, K)).astype(np.float32))
                turn = iter(range(1 << 62))
                seconds = _median_seconds(lambda: linears[next(turn) % copies](x), repeats)
                results.append({"name": name, "N": N, "K": K, "weight_bytes": weight.nbytes, "route": route,
                                "rows": T, "bytes_per_s": weight.nbytes / seconds,
                                "of_copy": weight.nbytes / seconds / copy})
            linears.clear()  # free this route's copies before the next route uploads its own
            cp.get_default_memory_pool().free_all_blocks()
    return {"device": cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode(),
            "copy_bytes_per_s": copy, "rows": list(rows), "results": results}


def format_table(report: dict) -> str:
    rows = report["rows"]
    head = f"{'weight':26} {'N x K':>14} {'MB':>7} {'route':6}" + "".join(f" {f'{t} row' + ('s' if t > 1 else ''):>16}" for t in rows)
    lines = [f"{report['device']}: device-to-device copy {report['copy_bytes_per_s'] / 1e9:.0f} GB/s "
             f"(read + written); each cell: weight GB/s and % of copy", head]
    by_key = {(r["name"], r["route"], r["rows"]): r for r in report["results"]}
    for name in dict.fromkeys(r["name"] for r in report["results"]):
        for route in dict.fromkeys(r["route"] for r in report["results"]):
            first = by_key[(name, route, rows[0])]
            cells = "".join(f" {by_key[(name, route, t)]['bytes_per_s'] / 1e9:8.0f} ({by_key[(name, route, t)]['of_copy']:4.0%})"
                            for t in rows)
            lines.append(f"{name:26} {first['N']:>6} x {first['K']:<6} {first['weight_bytes'] / 1e6:7.1f} {route:6}{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.bench_gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    report = gemv_table(repeats=args.repeats)
    print(json.dumps(report) if args.json else format_table(report))


if __name__ == "__main__":
    main()
