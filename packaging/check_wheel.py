"""Check that a built duet wheel carries everything the app needs at run time.

    python packaging/check_wheel.py dist/duet-0.1.0-py3-none-any.whl [--source REPO]

The source tree is the list of what must ship: every module and every data file (model weights,
config and card, chat templates, CUDA sources, styles) under app/, engine/ and models/. tests/
must not ship. Prints one line per problem and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

PACKAGES = ("app", "engine", "models")
NOT_SHIPPED = ("models/recipe/",)  # the demo model's training recipe: run from the repo, never at run time
SHIPPED_SUFFIXES = {".py", ".toml", ".json", ".jinja", ".safetensors", ".md", ".cu", ".cuh", ".tcss", ".txt", ".gguf"}


def needed_files(source: Path) -> list[str]:
    """Paths, as the wheel names them (under the one import package, duet/), of every file under the
    packages that must ship."""
    return sorted(
        "duet/" + path.relative_to(source).as_posix()
        for package in PACKAGES
        for path in (source / package).rglob("*")
        if path.is_file() and path.suffix in SHIPPED_SUFFIXES and "__pycache__" not in path.parts
        and not path.relative_to(source).as_posix().startswith(NOT_SHIPPED)
    )


def check_wheel(wheel: Path, source: Path) -> list[str]:
    """One line per problem: a needed file the wheel lacks, or a test file it carries."""
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    missing = [f"missing: {name}" for name in needed_files(source) if name not in shipped]
    stray = [f"should not ship: {name}" for name in sorted(shipped)
             if name.startswith(("tests/", *(f"duet/{path}" for path in NOT_SHIPPED))) or name.split("/")[0] in PACKAGES]
    return missing + stray


def main() -> int:
    parser = argparse.ArgumentParser(description="Check a duet wheel against the source tree.")
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="repository root (default: the one holding this script)")
    args = parser.parse_args()
    problems = check_wheel(args.wheel, args.source)
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
