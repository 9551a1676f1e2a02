"""`duet bench heads`: what the output heads of engine/heads.py cost per row, side by side in one run.

On a random fp32 head of a real geometry (Qwen3.5-0.8B: 248,320 x 1,024), one hidden row at a
time as in decode: the full head, the draft head over the shortlist (65,536 rows there: what each
MTP draft ranks), and the host-tables head (int4 ranking of every id, then 64 bf16 rows rescored).
Ratios are against the full head, measured interleaved, best of `--repeats`.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from duet.app.bench.common import GEOMETRIES, positive_int
from duet.engine.backend.cpu import DenseLinear
from duet.engine.heads import RescoredHead, ShortlistHead, shortlist_ids

HEADS = ("full head", "draft shortlist", "host tables (int4 + rescoring)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="qwen3.5-0.8b")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs of each head, best kept (default 5)")
    parser.add_argument("--rows", type=positive_int, default=8, help="decode rows per timed run (default 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with all figures")


def run(args: argparse.Namespace) -> int:
    geometry = GEOMETRIES[args.geometry]
    vocab, hidden = geometry["vocab_size"], geometry["hidden_size"]
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((vocab, hidden), dtype=np.float32) * np.float32(hidden ** -0.5)
    ids = shortlist_ids(vocab, [])
    runs = {
        HEADS[0]: DenseLinear(weight),
        HEADS[1]: ShortlistHead(DenseLinear(weight[: len(ids)]), ids, vocab),
        HEADS[2]: RescoredHead(weight),
    }
    rows = rng.standard_normal((args.rows, hidden), dtype=np.float32)
    best = {name: float("inf") for name in runs}
    for _ in range(args.repeats):
        for name, head in runs.items():  # interleaved, so drift in machine load hits every head alike
            started = time.perf_counter()
            for row in rows:
                head(row[None])
            best[name] = min(best[name], (time.perf_counter() - started) / args.rows)
    result = {
        "geometry": args.geometry, "vocab": vocab, "hidden": hidden, "shortlist_rows": len(ids),
        "ms_per_row": {name: round(seconds * 1e3, 3) for name, seconds in best.items()},
        "vs_full_head": {name: round(best[HEADS[0]] / seconds, 3) for name, seconds in best.items()},
    }
    print(json.dumps(result) if args.json else heads_table(result))
    return 0


def heads_table(result: dict) -> str:
    lines = [f"{result['geometry']}: head {result['vocab']:,} x {result['hidden']:,}, "
             f"shortlist {result['shortlist_rows']:,} rows, one row at a time",
             f"{'head':34} {'ms/row':>9} {'speed vs full':>14}"]
    for name, ms in result["ms_per_row"].items():
        lines.append(f"{name:34} {ms:9.3f} {result['vs_full_head'][name]:13.2f}x")
    return "\n".join(lines)
