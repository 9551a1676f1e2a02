"""Which models exist: the catalog (models/catalog.toml) and the models on disk.

Models on disk are the bundled demo model, the folders in duet's models dir (downloads and
imports land there only once complete and verified) and the model repos in the Hugging Face cache.
"""

from __future__ import annotations

import os
import shutil
import tomllib
import uuid
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from duet.app.settings import bundled_demo_model
from duet.engine.checkpoint.headers import read_headers
from duet.engine.errors import DuetError
from duet.engine.loader import check_model

STAGING = ".staging"  # downloads and imports in progress; never listed as models
FORMATS = ("bf16", "int4", "gguf", "trellis")


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    format: str
    params: str
    description: str
    source: str
    repo: str = ""
    files: tuple[str, ...] = ()
    community: bool = False
    bundled: bool = False


@dataclass(frozen=True)
class LocalModel:
    name: str
    path: Path
    size: int
    where: str  # "bundled", "duet" (our models dir) or "hf-cache"
    repo: str = ""
    revisions: tuple[str, ...] = field(default=(), compare=False)  # commit hashes, for the HF cache


def catalog_path() -> Path:
    return Path(str(files("duet.models") / "catalog.toml"))


def load_catalog(path: Path | None = None) -> list[CatalogEntry]:
    path = path or catalog_path()
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
        entries = [CatalogEntry(**{**entry, "files": tuple(entry.get("files", ()))}) for entry in raw["model"]]
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as error:
        raise DuetError(f"{path}: not a valid model catalog ({error}); reinstall duet") from None
    for entry in entries:
        if entry.format not in FORMATS:
            raise DuetError(f"{path}: model {entry.name!r} has format {entry.format!r}; known: {', '.join(FORMATS)}")
    return entries


def find_in_catalog(name: str, catalog: list[CatalogEntry]) -> CatalogEntry | None:
    """The entry called `name` or with repo `name` (case-insensitive)."""
    wanted = name.lower()
    return next((e for e in catalog if wanted in (e.name.lower(), e.repo.lower())), None)


# ---- on disk ----


def folder_name(repo: str) -> str:
    """Where a repo lands in the models dir: owner/name -> owner--name."""
    return repo.replace("/", "--")


def repo_of(folder: str) -> str:
    """The repo a downloaded folder came from (owner--name -> owner/name); empty for imports."""
    return folder.replace("--", "/", 1) if "--" in folder else ""


def local_models(models_dir: Path) -> list[LocalModel]:
    """The bundled model, then duet's models dir, then the HF cache."""
    found = []
    demo = bundled_demo_model()
    if (demo / "config.json").is_file():
        found.append(LocalModel("demo", demo, folder_size(demo), "bundled"))
    if models_dir.is_dir():
        for folder in sorted(p for p in models_dir.iterdir() if p.is_dir() and p.name != STAGING):
            found.append(LocalModel(folder.name, folder, folder_size(folder), "duet", repo_of(folder.name)))
    return found + hf_cache_models()


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache as the environment says now (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hf_cache_models() -> list[LocalModel]:
    """Model repos in the Hugging Face cache, each at its newest revision."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(hf_cache_dir())
    except CacheNotFound:
        return []
    models = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        models.append(LocalModel(repo.repo_id, newest.snapshot_path, repo.size_on_disk, "hf-cache", repo.repo_id,
                                 tuple(r.commit_hash for r in repo.revisions)))
    return models


def find_local(name: str, models_dir: Path) -> LocalModel | None:
    wanted = name.lower()
    return next((m for m in local_models(models_dir) if wanted in (m.name.lower(), m.repo.lower())), None)


def delete_model(model: LocalModel) -> int:
    """Delete a model from disk; returns the bytes freed. The bundled model stays."""
    if model.where == "bundled":
        raise DuetError("the bundled demo model ships with duet and cannot be deleted")
    if model.where == "hf-cache":
        from huggingface_hub import scan_cache_dir

        strategy = scan_cache_dir(hf_cache_dir()).delete_revisions(*model.revisions)
        strategy.execute()
        return strategy.expected_freed_size
    size = folder_size(model.path)
    shutil.rmtree(model.path)
    return size


def folder_size(path: Path) -> int:
    """Bytes of the files under path, each file counted once (the HF cache links blobs)."""
    seen, total = set(), 0
    for root, _, names in os.walk(path):
        for name in names:
            stat = (Path(root) / name).stat()
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total


# ---- checking and importing ----


def import_model(source: Path, models_dir: Path, name: str | None = None) -> LocalModel:
    """Check a model folder or .gguf file, then copy it (hard links where the disk allows) into the models dir."""
    source = source.expanduser().resolve()
    check_model(source)
    target = models_dir / (name or (source.stem if source.is_file() else source.name))
    if target.exists():
        raise DuetError(f"{target}: a model of that name is already there; pick another name or delete it first")
    staging = new_staging_dir(models_dir, target.name)
    try:
        if source.is_file():
            (staging / "model").mkdir()
            _link_or_copy(str(source), str(staging / "model" / source.name))
        else:
            shutil.copytree(source, staging / "model", copy_function=_link_or_copy)
        (staging / "model").rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return LocalModel(target.name, target, folder_size(target), "duet", repo_of(target.name))


def new_staging_dir(models_dir: Path, name: str) -> Path:
    """A fresh folder for one download or import, named after the process that owns it."""
    staging = models_dir / STAGING / f"{os.getpid()}-{uuid.uuid4().hex[:8]}-{name}"
    staging.mkdir(parents=True)
    return staging


def clear_stale_staging(models_dir: Path) -> int:
    """Remove what downloads and imports of processes no longer running left behind; returns how many."""
    root = models_dir / STAGING
    stale = [p for p in root.iterdir() if not _process_alive(p.name.split("-", 1)[0])] if root.is_dir() else []
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return len(stale)


def _process_alive(pid: str) -> bool:
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


# ---- describing ----


def describe_model(path: Path) -> dict:
    """What the files say, read from the config and the tensor headers only (no weights)."""
    headers = read_headers(str(path))
    config = headers.config
    by_dtype: dict[str, int] = {}
    for info in headers.tensors.values():
        by_dtype[info.dtype] = by_dtype.get(info.dtype, 0) + info.nbytes
    return {
        "path": str(path),
        "format": headers.format,
        "size_on_disk": folder_size(path) if path.is_dir() else path.stat().st_size,
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "deltanet_layers": config.layer_types.count("linear_attention"),
        "attention_layers": config.layer_types.count("full_attention"),
        "hidden_size": config.hidden_size,
        "attention_heads": config.num_attention_heads,
        "kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "experts": config.num_experts,
        "experts_per_token": config.num_experts_per_tok,
        "mtp_layers": config.mtp_num_hidden_layers,
        "max_context": config.max_position_embeddings,
        "tensors": len(headers.tensors),
        "tensor_bytes_by_dtype": by_dtype,
    }


def describe_lines(description: dict) -> list[str]:
    """describe_model's figures as lines a person reads."""
    d = description
    lines = [
        f"{d['model_type']}: {d['layers']} layers ({d['deltanet_layers']} DeltaNet + {d['attention_layers']} attention), "
        f"hidden {d['hidden_size']:,}",
        f"attention: {d['attention_heads']} heads, {d['kv_heads']} KV heads, head dim {d['head_dim']}",
        f"vocabulary {d['vocab_size']:,} · context up to {d['max_context']:,} tokens · MTP layers {d['mtp_layers']}",
    ]
    if d["experts"]:
        lines.append(f"experts: {d['experts']}, {d['experts_per_token']} routed a token")
    weights = ", ".join(f"{human_size(n)} {dtype}" for dtype, n in sorted(d["tensor_bytes_by_dtype"].items()))
    lines.append(f"{d['format']}, {d['tensors']} tensors: {weights} · {human_size(d['size_on_disk'])} on disk")
    return lines


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if abs(n) < 1000:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
