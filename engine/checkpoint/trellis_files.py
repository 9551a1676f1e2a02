"""duet's trellis safetensors files (`duet convert --format trellis-{2,3,4}`), read as TrellisWeight.

Recognised by the safetensors `__metadata__` (string values, as the format requires):

    duet.format               "trellis"
    duet.version              "1"
    duet.trellis.k            "2", "3" or "4": bits per weight
    duet.trellis.multipliers  JSON {"2": C, "3": C, "4": C}: the 1MAD multipliers the codes were made with
    duet.trellis.seed         the rotation seed (integer)

A coded module has, instead of `.weight` [N, K] (N % 16 == 0, K % 128 == 0):

    .trellis_codes      U8  [N/16 * K/8, 16 * k]  tile streams (engine/quant/trellis.py, to_tiles order)
    .trellis_row_scale  F32 [N]                   per-row scale of the rotated levels

Other modules keep their 16-bit `.weight`.
"""

from __future__ import annotations

import json

import numpy as np

from duet.engine.checkpoint.quantized import Int4Modules
from duet.engine.checkpoint.safetensors import SafetensorsCheckpoint, SafetensorsFile
from duet.engine.errors import CheckpointError
from duet.engine.quant import trellis

FORMAT, VERSION = "trellis", "1"
TRELLIS_ROUTES = ("w4a8", "bf16")


def trellis_metadata(k: int, seed: int) -> dict[str, str]:
    """The `__metadata__` entries of a trellis file."""
    return {"duet.format": FORMAT, "duet.version": VERSION, "duet.trellis.k": str(k),
            "duet.trellis.multipliers": json.dumps({str(r): c for r, c in trellis.MULTIPLIERS.items()}),
            "duet.trellis.seed": str(seed)}


def read_trellis(ckpt: SafetensorsCheckpoint) -> TrellisModules | None:
    """The checkpoint's trellis modules if its files say they are ours; None for any other file."""
    ours = [f for f in ckpt.files if f.metadata.get("duet.format") == FORMAT]
    if not ours:
        return None
    k, seed = _parse_metadata(ours[0])
    for other in ours[1:]:
        if _parse_metadata(other) != (k, seed):
            raise CheckpointError(other.path, "trellis metadata (k, seed) differs from the checkpoint's other files")
    return TrellisModules(ckpt, k, seed)


def _parse_metadata(file: SafetensorsFile) -> tuple[int, int]:
    meta = file.metadata

    def bad(problem: str) -> CheckpointError:
        return CheckpointError(file.path, f"trellis metadata {problem}; re-convert with `duet convert --format trellis-K`")

    if meta.get("duet.version") != VERSION:
        raise bad(f"version {meta.get('duet.version')!r} is not {VERSION!r}")
    k_text, seed_text = meta.get("duet.trellis.k", ""), meta.get("duet.trellis.seed", "")
    if k_text not in {str(r) for r in trellis.RATES}:
        raise bad(f"duet.trellis.k {k_text!r} is not one of {', '.join(map(str, trellis.RATES))}")
    if not seed_text.isdigit():
        raise bad(f"duet.trellis.seed {seed_text!r} is not a non-negative integer")
    try:
        multiplier = json.loads(meta.get("duet.trellis.multipliers", ""))[k_text]
    except (ValueError, TypeError, KeyError):
        raise bad(f"duet.trellis.multipliers has no multiplier for k={k_text}") from None
    if multiplier != trellis.MULTIPLIERS[int(k_text)]:
        raise bad(f"multiplier {multiplier!r} for k={k_text} is not this duet's {trellis.MULTIPLIERS[int(k_text)]}")
    return int(k_text), int(seed_text)


class TrellisModules(Int4Modules):
    """Trellis-coded weights of a checkpoint by the name the model asks for (`...q_proj.weight`)."""

    routes = TRELLIS_ROUTES
    suffixes = (".trellis_codes", ".trellis_row_scale")

    def __init__(self, ckpt: SafetensorsCheckpoint, k: int, seed: int):
        super().__init__(ckpt)
        self.k, self.seed = k, seed
        self.description = f"trellis-{k}"

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        module = name[: -len(".weight")]
        codes, scale = self._tensor(module, ".trellis_codes"), self._tensor(module, ".trellis_row_scale")
        N, K = shape
        tiles, tile_bytes = N // trellis.TILE_ROWS * (K // trellis.TILE_COLS), trellis.TILE * self.k // 8
        if N % trellis.TILE_ROWS or K % trellis.HADAMARD_BLOCK:
            raise self._bad(module, ".trellis_codes", f"codes a [{N}, {K}] weight; trellis needs N % 16 == 0 and K % 128 == 0")
        if codes.dtype != "U8" or codes.shape != (tiles, tile_bytes):
            raise self._bad(module, ".trellis_codes", f"is {codes.dtype} {list(codes.shape)}; a [{N}, {K}] weight at "
                                                      f"{self.k} bits takes U8 [{tiles}, {tile_bytes}] ({tiles} tiles)")
        if scale.dtype != "F32" or scale.shape != (N,):
            raise self._bad(module, ".trellis_row_scale", f"is {scale.dtype} {list(scale.shape)}; expected F32 [{N}]")

    def read(self, name: str) -> trellis.TrellisWeight:
        module = name[: -len(".weight")]
        codes = self._raw(module, ".trellis_codes").view(np.uint8)
        row_scale = self._raw(module, ".trellis_row_scale").view(np.float32)
        N = row_scale.shape[0]
        K = codes.shape[0] // (N // trellis.TILE_ROWS) * trellis.TILE_COLS
        return trellis.TrellisWeight(codes, row_scale, (N, K), self.k, self.seed)
