"""load_model: a model folder -> weights in memory, tokenizer and config, with progress events."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoint.hf import load_hf_model
from engine.checkpoint.safetensors import SafetensorsCheckpoint
from engine.config import ModelConfig
from engine.errors import DuetError
from engine.model import Model
from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadProgress:
    """Bytes of weights read so far out of the total the model needs."""

    done_bytes: int
    total_bytes: int


@dataclass
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: Model
    tokenizer: Tokenizer
    route: str


def load_model(path: str | Path, progress: Callable[[LoadProgress], None] | None = None) -> LoadedModel:
    """Read config, tokenizer and the tensors the text model needs (never the vision tower).

    Headers, shapes and the tokenizer are all checked before any weight data is read, so a bad
    folder fails fast with one line naming the file.
    """
    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise DuetError(f"{model_dir}: no such model folder; pass --model with a folder holding config.json")
    config = ModelConfig.from_file(model_dir / "config.json")
    tokenizer = Tokenizer.from_dir(model_dir, extra_eos_ids=config.eos_token_ids)
    checkpoint = SafetensorsCheckpoint(model_dir)
    report = (lambda done, total: progress(LoadProgress(done, total))) if progress else None
    model = load_hf_model(checkpoint, config, report)
    checkpoint.close()
    return LoadedModel(model_dir.resolve().name, model_dir.resolve(), config, model, tokenizer, route="bf16")
