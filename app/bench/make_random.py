"""`duet bench make-random`: a random fp32 checkpoint with a real model's geometry, to run the other
benchmarks on."""

from __future__ import annotations

import argparse
from pathlib import Path

from duet.app.bench.common import GEOMETRIES, positive_int, require_reference
from duet.engine.errors import DuetError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="qwen3.5-0.8b")
    parser.add_argument("--out", required=True, help="new folder to write config.json and model.safetensors into")
    parser.add_argument("--layers", type=positive_int, help="N layers instead of the geometry's own count, full attention every 4th")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DuetError(f"{out}: already exists and is not an empty folder; pass --out with a new folder")
    require_reference("make-random")
    import torch
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(random_model_config(args.geometry, args.layers))  # default init: normal(0, 0.02)
    model.save_pretrained(out)
    print(f"wrote {out} ({sum(p.numel() for p in model.parameters()) / 1e6:,.0f}M parameters, fp32)")
    return 0


def random_model_config(name: str, layers: int | None = None):
    """Qwen3_5TextConfig of geometry `name`; with `layers`, layer_types follow the every-4th pattern."""
    from transformers import Qwen3_5TextConfig

    fields = dict(GEOMETRIES[name])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return Qwen3_5TextConfig(**fields)
