"""Paths duet uses: the bundled demo model, and (later) config and data dirs from platformdirs."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def bundled_demo_model() -> Path:
    """The small trained model that ships inside the package (models/demo)."""
    return Path(str(files("models") / "demo"))
