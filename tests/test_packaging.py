"""The wheel is what users install: build it, check its files, install it into a fresh venv, run duet there."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IGNORED = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", ".pytest_cache")


def run(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def run_ok(*args, cwd: Path) -> subprocess.CompletedProcess:
    done = run(*args, cwd=cwd)
    assert done.returncode == 0, f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the repo (minus what .gitignore ignores), so a stale build/ here cannot leak in."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(REPO, source, ignore=IGNORED)
    run_ok(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp, source, cwd=tmp)
    (built,) = tmp.glob("duet-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding only the wheel; numpy, tokenizers and the rest come from this interpreter.

    Not `venv --system-site-packages`: that runs this interpreter's .pth files, and the repo's
    editable install is one. It appends a finder to sys.meta_path that serves any subpackage the
    wheel lacks (say engine.backend) straight from the repo, hiding the very fault this test is
    for. Instead a plain-path .pth puts this interpreter's site-packages on sys.path after the
    venv's own; `site` runs no .pth files found in folders added that way.
    """
    venv = tmp_path_factory.mktemp("venv")
    run_ok(sys.executable, "-m", "venv", "--clear", "--without-pip", venv, cwd=venv)
    python = venv / "bin" / "python"
    purelib = run_ok(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=venv).stdout.strip()
    Path(purelib, "outer-site-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run_ok(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel, cwd=venv)
    return venv


def test_wheel_carries_runtime_files(wheel):
    done = run(sys.executable, REPO / "packaging" / "check_wheel.py", wheel, "--source", REPO, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr


def test_venv_imports_its_own_copy(venv, tmp_path):
    code = ("import sys, duet.app.cli, duet.engine, duet.models; from duet.app.settings import bundled_demo_model; "
            "print(duet.app.cli.__file__, duet.engine.__file__, duet.models.__file__, bundled_demo_model(), sep='\\n'); "
            "print(*sys.meta_path, sep='\\n')")
    lines = run_ok(venv / "bin" / "python", "-c", code, cwd=tmp_path).stdout.splitlines()
    paths, finders = lines[:4], lines[4:]
    site_packages = str(next((venv / "lib").glob("python*/site-packages")))
    assert all(path.startswith(site_packages) for path in paths), paths
    assert not any("editable" in finder.lower() for finder in finders), finders


def test_headless_from_the_installed_script(venv, tiny_model_dir, tmp_path):
    done = run_ok(venv / "bin" / "duet", "--headless", "hello", "--raw", "--max-tokens", "5",
                  "--model", tiny_model_dir, cwd=tmp_path)
    assert done.stdout.strip()


def test_headless_with_the_bundled_demo_model(venv, tmp_path):
    done = run_ok(venv / "bin" / "duet", "--headless", "In the beginning", "--max-tokens", "8", cwd=tmp_path)
    assert done.stdout.strip()


def test_the_wheel_installs_one_import_package(venv, tmp_path):
    """duet's code is duet.app, duet.engine and duet.models: the names app, engine and models, which
    other projects may use, stay free."""
    code = "import importlib.util as u; print([n for n in ('duet', 'app', 'engine', 'models') if u.find_spec(n)])"
    assert run_ok(venv / "bin" / "python", "-c", code, cwd=tmp_path).stdout.strip() == "['duet']"
