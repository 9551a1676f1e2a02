"""The catalog, models on disk (our folder and the HF cache), import, delete, and `duet models ...`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import interruptible
from fake_hub import FakeHub

from duet.app.catalog import (
    STAGING, check_model, clear_stale_staging, delete_model, describe_model, find_in_catalog, find_local,
    hf_cache_dir, hf_cache_models, import_model, load_catalog, local_models, new_staging_dir,
)
from duet.app.cli import main
from duet.app.settings import user_paths
from duet.engine.errors import DuetError

REPO = "duet-tests/tiny"


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DUET_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return user_paths()


@pytest.fixture
def hub(tiny_model, home, monkeypatch):
    with FakeHub() as fake:
        fake.add_folder(REPO, tiny_model)
        monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
        yield fake


def test_the_shipped_catalog_names_the_variants_the_app_offers():
    catalog = load_catalog()
    formats = {entry.format for entry in catalog}
    assert formats == {"bf16", "int4", "gguf", "trellis"}
    assert find_in_catalog("demo", catalog).bundled
    assert find_in_catalog("Qwen/Qwen3.5-0.8B", catalog).name == "qwen3.5-0.8b"
    assert find_in_catalog("ukisai/Swift-1.5-Qwen3.8-27b-INT4", catalog).community
    assert all(entry.repo.count("/") == 1 for entry in catalog if not entry.bundled)
    assert len({entry.name for entry in catalog}) == len(catalog)


def test_a_broken_catalog_is_one_line(tmp_path):
    path = tmp_path / "catalog.toml"
    path.write_text('[[model]]\nname = "x"\nformat = "bf16"\n')
    with pytest.raises(DuetError, match="not a valid model catalog"):
        load_catalog(path)
    path.write_text('[[model]]\nname="x"\nformat="fp8"\nparams="1B"\ndescription="d"\nsource="s"\n')
    with pytest.raises(DuetError, match="format 'fp8'"):
        load_catalog(path)


def test_models_dir_and_hf_cache_are_listed_but_staging_is_not(hub, home, tiny_model):
    from huggingface_hub import hf_hub_download

    import_model(tiny_model, home.models_dir, "mine")
    new_staging_dir(home.models_dir, "half-done")
    for name in ("config.json", "model.safetensors"):
        hf_hub_download(REPO, name, endpoint=hub.endpoint, cache_dir=hf_cache_dir())
    models = {m.name: m for m in local_models(home.models_dir)}
    assert models["mine"].where == "duet" and models["mine"].repo == ""
    assert models[REPO].where == "hf-cache" and models[REPO].size > 900_000
    assert not any(STAGING in str(m.path) for m in models.values())
    assert find_local("DUET-TESTS/TINY", home.models_dir).where == "hf-cache"
    freed = delete_model(models[REPO])
    assert freed == models[REPO].size and hf_cache_models() == []


def test_import_checks_headers_before_copying(home, tiny_model, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_model / name).read_bytes())
    config = json.loads((tiny_model / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    (broken / "model.safetensors").write_bytes((tiny_model / "model.safetensors").read_bytes())
    with pytest.raises(DuetError, match="shape") as error:
        import_model(broken, home.models_dir)
    assert "\n" not in str(error.value)
    assert not (home.models_dir / "broken").exists()
    model = import_model(tiny_model, home.models_dir)
    assert check_model(model.path).hidden_size == 64
    with pytest.raises(DuetError, match="already there"):
        import_model(tiny_model, home.models_dir)
    with pytest.raises(DuetError, match="not a model folder or .gguf file"):
        import_model(tmp_path / "nothing", home.models_dir)


def test_stale_staging_of_dead_processes_is_cleared(home):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = home.models_dir / STAGING / f"{dead.stdout.strip()}-abcd1234-old"
    stale.mkdir(parents=True)
    mine = new_staging_dir(home.models_dir, "current")
    assert clear_stale_staging(home.models_dir) == 1
    assert not stale.exists() and mine.exists()


def test_bundled_model_cannot_be_deleted(home):
    from duet.app.catalog import LocalModel

    with pytest.raises(DuetError, match="ships with duet"):
        delete_model(LocalModel("demo", home.models_dir, 0, "bundled"))


def test_describe_reads_geometry_from_headers(tiny_model):
    description = describe_model(tiny_model)
    assert (description["layers"], description["deltanet_layers"], description["attention_layers"]) == (5, 4, 1)
    assert description["tensor_bytes_by_dtype"]["F32"] > 0 and description["max_context"] == 4096


# ---- the command line ----


def run(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["models", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_pull_list_rm(hub, home, capsys):
    code, _, err = run(capsys, "pull", REPO)
    assert code == 0 and "duet-tests--tiny" in err
    code, out, _ = run(capsys, "list")
    assert code == 0 and "qwen3.5-0.8b" in out and "duet-tests--tiny" in out
    code, out, _ = run(capsys, "rm", REPO)
    assert code == 0 and out.startswith("deleted duet-tests--tiny; freed ")
    assert not (home.models_dir / "duet-tests--tiny").exists()


def test_cli_errors_are_one_line_with_exit_2(hub, home, capsys, tmp_path):
    hub.repo_status[REPO] = 401
    for args, problem in [
        (("pull", REPO), "set HF_TOKEN"),
        (("pull", "duet-tests/missing"), "not found on the hub (404)"),
        (("pull", "no-such-name"), "not in the catalog"),
        (("pull", "demo"), "ships with duet"),
        (("rm", "nothing"), "no model of that name"),
        (("import", str(tmp_path / "nowhere")), "not a model folder or .gguf file"),
    ]:
        code, _, err = run(capsys, *args)
        assert code == 2 and problem in err and err.count("\n") == 1, (args, err)


def test_cli_import(home, tiny_model, capsys):
    code, out, _ = run(capsys, "import", str(tiny_model), "--name", "copied")
    assert code == 0 and out.startswith("imported copied:")
    assert find_local("copied", home.models_dir).where == "duet"


def test_ctrl_c_during_pull_keeps_nothing(hub, home, tiny_model):
    hub.slow["model.safetensors"] = 0.5
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    pull = subprocess.Popen([sys.executable, "-m", "duet.app.cli", "models", "pull", REPO], env=env,
                            stderr=subprocess.PIPE, text=True, preexec_fn=interruptible)
    deadline = time.monotonic() + 30
    while not any(method == "GET" and path.endswith("model.safetensors") for method, path in hub.requests):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pull.send_signal(signal.SIGINT)
    _, err = pull.communicate(timeout=30)
    assert pull.returncode == 130 and "nothing was kept" in err
    assert not (home.models_dir / "duet-tests--tiny").exists()
    assert not any((home.models_dir / STAGING).iterdir())
