"""The UI's import rules: app.* modules other than the command line's, and the engine's public API only
(`from engine import X` with X in engine.__all__), never engine.checkpoint, engine.backend or another
engine module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from duet import engine

ROOT = Path(__file__).resolve().parents[2]
UI_FILES = sorted((ROOT / "app" / "ui").rglob("*.py"))
COMMAND_LINE = ("app.cli", "app.arguments", "app.headless", "app.models_cli", "app.bench")  # argparse, stdout writers


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file; `from package import name` counts as package.name too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import; write it absolute"
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def broken_rule(module: str) -> str | None:
    module = module.removeprefix("duet.")
    top = module.split(".")[0]
    if top == "engine" and module != "engine" and module.removeprefix("engine.") not in engine.__all__:
        return "engine internals: import from the engine's public API (engine/__init__.py) or go through app.*"
    if any(module == cli or module.startswith(cli + ".") for cli in COMMAND_LINE):
        return "a command-line module: the UI shares app.* modules with it, never the other way round"
    return None


def test_the_ui_files_are_found():
    assert {"app.py", "chat.py", "models.py", "dialogs.py", "readouts.py"} <= {p.name for p in UI_FILES}


def test_the_ui_imports_no_engine_internals_and_no_command_line_module():
    broken = [f"{path.relative_to(ROOT)}:{line}: {module}: {why}"
              for path in UI_FILES for line, module in imports(path) if (why := broken_rule(module))]
    assert not broken, "\n".join(broken)


def test_the_rule_catches_what_it_is_for():
    assert broken_rule("engine.checkpoint.headers") and broken_rule("engine.placement")
    assert broken_rule("engine.checkpoint")  # from engine import checkpoint
    assert broken_rule("app.headless.parse_depth") and broken_rule("app.bench.gpu")
    assert not broken_rule("engine") and not broken_rule("engine.Route") and not broken_rule("app.session")


def test_loading_the_ui_loads_no_command_line_module():
    """Also what the UI's app.* modules import in turn."""
    probe = ("import sys, duet.app.ui.app; "
             f"print(sorted(m for m in sys.modules if m.removeprefix('duet.').startswith({COMMAND_LINE!r})))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
