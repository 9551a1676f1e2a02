"""`duet bench trellis`: what the trellis code buys over per-weight grids on i.i.d. unit Gaussians.

At each rate k (2, 3, 4 bits per weight), SEQUENCES sequences of SEQUENCE_LENGTH samples
(np.random.default_rng(SEED)), each coded as SEQUENCE_LENGTH / 128 tail-biting tiles at the best
of the rate's global steps (trellis.SCALES), the MSE averaged over the sequences. Beside it:
- the same code run over each sequence as one free stream, at the same steps: what the seed's
  article measured, 2 to 4% below the tiles, whose short circles pay for closing (trellis.py);
- the best uniform 2^k-level grid on the same sequences (levels (i + 1/2) * delta, i = -2^(k-1) ..
  2^(k-1) - 1, the best delta of a fine search per sequence, clipping included);
- the Lloyd-Max quantizer's MSE for the Gaussian density itself (the best any scalar quantizer
  can do in expectation), by Lloyd iteration on the exact interval moments;
- the Shannon bound 2^(-2k).
Encoder speed is tiles coded per second over the rate's whole scale search (one process, numpy).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from duet.engine.quant import trellis

SEQUENCES = 4
SEQUENCE_LENGTH = 1024
SEED = 2026
GRID_DELTAS = np.linspace(0.1, 1.5, 281)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object with all figures")


def run(args: argparse.Namespace) -> int:
    result = trellis_result()
    print(json.dumps(result) if args.json else trellis_table(result))
    return 0


def trellis_result() -> dict:
    rng = np.random.default_rng(SEED)
    sequences = rng.standard_normal((SEQUENCES, SEQUENCE_LENGTH)).astype(np.float32)
    rates = {str(k): rate_figures(sequences, k) for k in trellis.RATES}
    return {"sequences": SEQUENCES, "sequence_length": SEQUENCE_LENGTH, "seed": SEED, "rates": rates}


def rate_figures(sequences: np.ndarray, k: int) -> dict:
    start = time.perf_counter()
    coded = [trellis.best_scale_mse(seq.reshape(-1, trellis.TILE), k) for seq in sequences]
    seconds = time.perf_counter() - start
    tiles = sequences.size // trellis.TILE * len(trellis.SCALES[k])
    return {
        "trellis_mse": float(np.mean([mse for mse, _ in coded])),
        "trellis_steps": [step for _, step in coded],
        "stream_mse": float(np.mean([stream_mse(seq, k) for seq in sequences])),
        "grid_mse": float(np.mean([best_grid_mse(seq, k) for seq in sequences])),
        "lloyd_max_mse": lloyd_max_gaussian_mse(1 << k),
        "shannon_mse": 2.0 ** (-2 * k),
        "encoder_tiles_per_s": tiles / seconds,
    }


def stream_mse(x: np.ndarray, k: int) -> float:
    """Lowest MSE over the rate's steps of x [L] coded as one free stream (not storable as tiles)."""
    levels = trellis.level_table(k)
    return min(float(np.mean((levels[trellis.free_path(x[None] / step, k)[0]] * step - x) ** 2))
               for step in trellis.SCALES[k])


def best_grid_mse(x: np.ndarray, k: int) -> float:
    """Lowest MSE of a uniform mid-rise grid of 2^k levels over GRID_DELTAS (clipped at the ends)."""
    half = 1 << (k - 1)
    x = x.astype(np.float64)[None, :]
    deltas = GRID_DELTAS[:, None]
    index = np.clip(np.floor(x / deltas), -half, half - 1)
    return float(np.min(np.mean(((index + 0.5) * deltas - x) ** 2, axis=1)))


def lloyd_max_gaussian_mse(levels: int, iterations: int = 300) -> float:
    """MSE of the Lloyd-Max quantizer with `levels` levels for N(0, 1), from the exact moments.

    With centroids c_i of the cells [a_i, b_i] (c_i = (phi(a_i) - phi(b_i)) / P_i), the MSE is
    1 - sum_i P_i c_i^2.
    """
    centroids = np.linspace(-2.0, 2.0, levels)
    for _ in range(iterations):
        edges = [-math.inf, *((centroids[:-1] + centroids[1:]) / 2), math.inf]
        mass = np.array([_cdf(b) - _cdf(a) for a, b in zip(edges[:-1], edges[1:])])
        centroids = np.array([_pdf(a) - _pdf(b) for a, b in zip(edges[:-1], edges[1:])]) / mass
    return float(1.0 - np.sum(mass * centroids ** 2))


def _pdf(x: float) -> float:
    return 0.0 if math.isinf(x) else math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def trellis_table(result: dict) -> str:
    lines = [
        f"trellis code on i.i.d. unit Gaussians: {result['sequences']} x {result['sequence_length']} samples "
        f"(seed {result['seed']}), best of {len(trellis.SCALES[2])} global steps per sequence; trellis: as stored, "
        f"in {trellis.TILE}-weight tail-biting tiles; stream: each sequence as one free stream",
        f"{'bits':>4}  {'trellis':>8}  {'stream':>8}  {'grid':>8}  {'Lloyd-Max':>9}  {'Shannon':>8}  {'vs Shannon':>10}  {'tiles/s':>8}",
    ]
    for k, r in result["rates"].items():
        over = r["trellis_mse"] / r["shannon_mse"] - 1
        lines.append(f"{k:>4}  {r['trellis_mse']:8.5f}  {r['stream_mse']:8.5f}  {r['grid_mse']:8.5f}  {r['lloyd_max_mse']:9.5f}  "
                     f"{r['shannon_mse']:8.5f}  {over:+10.1%}  {r['encoder_tiles_per_s']:8.1f}")
    return "\n".join(lines)
