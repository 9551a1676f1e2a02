"""The house's import rules (DESIGN.md), read from the source with `ast`: every import, at module
level or inside a function, counts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "engine")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: frozenset[str] = frozenset()) -> set[str]:
    """Absolute names this file imports. `from a import b` counts as a.b when that is one of
    `modules` (a submodule), else as a (a name a's __init__ defines)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.removeprefix("duet.") for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}".removeprefix("duet.")
                names.add(sub if sub in modules else node.module.removeprefix("duet."))
    return names


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """Our modules -> the modules of ours they import (a package counts as its __init__)."""
    files = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    modules = frozenset(files)
    return {name: {m for m in imported_modules(path, modules) if m in files} for name, path in files.items()}


def test_the_graph_sees_our_modules(graph):
    assert {"engine.model", "engine.loader", "engine.checkpoint.hf", "app.session"} <= graph.keys()
    assert "engine.checkpoint.hf" in graph["engine.loader"]  # a known edge: the reader finds real imports


def test_every_import_of_ours_goes_through_the_duet_package():
    """The wheel installs app/, engine/ and models/ as duet.app, duet.engine and duet.models only."""
    for package in (*PACKAGES, "tests"):
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0]
            bare = [n for n in names if n.split(".")[0] in ("app", "engine", "models")]
            assert not bare, f"{path.relative_to(ROOT)} imports {bare}; write duet.{bare[0]}"


def test_checkpoint_readers_only_read(graph):
    """Readers return stored tensors: no backend, no model, no assembly."""
    for name, imports in graph.items():
        if name.startswith("engine.checkpoint"):
            bad = {m for m in imports if m.startswith(("engine.backend", "engine.model", "engine.assemble", "engine.heads"))}
            assert not bad, f"{name} imports {sorted(bad)}"


def test_the_engine_never_imports_the_app(graph):
    for name in (n for n in graph if n.startswith("engine")):
        assert not {m for m in graph[name] if m.startswith("app")}, f"{name} imports the app"
    for path in (ROOT / "engine").rglob("*.py"):
        ui = {m for m in imported_modules(path) if m.split(".")[0] in ("textual", "rich")}
        assert not ui, f"{path} imports {sorted(ui)}"


def test_no_import_cycles(graph):
    """Depth-first search for a back edge among our modules."""
    state: dict[str, str] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
