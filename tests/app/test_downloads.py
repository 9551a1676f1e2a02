"""Downloads through the real huggingface_hub client against a local hub (HF_ENDPOINT on 127.0.0.1)."""

from __future__ import annotations

import threading

import huggingface_hub.constants
import pytest
from conftest import build_reference, save_reference
from fake_hub import FakeHub

from duet.app.catalog import STAGING, check_model, local_models
from duet.app.downloads import DownloadCancelled, download_model, remote_model
from duet.engine import load_model
from duet.engine.errors import DuetError

REPO = "duet-tests/tiny"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_reference(build_reference("qwen3_5_text"), tmp_path_factory.mktemp("src") / "tiny")


@pytest.fixture
def hub(tiny_folder, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    with FakeHub() as fake:
        fake.add_folder(REPO, tiny_folder)
        monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
        yield fake


def registered(models_dir):
    return [m.name for m in local_models(models_dir) if m.where == "duet"]


def staging_left(models_dir):
    staging = models_dir / STAGING
    return list(staging.iterdir()) if staging.exists() else []


def test_complete_download_is_verified_registered_and_loads(hub, tmp_path, tiny_folder):
    models_dir = tmp_path / "models"
    remote = remote_model(REPO)
    assert {f.name for f in remote.files} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert remote.size == sum(p.stat().st_size for p in tiny_folder.iterdir() if p.name in {f.name for f in remote.files})
    reports = []
    model = download_model(remote, models_dir, reports.append)
    assert model.path == models_dir / "duet-tests--tiny" and model.repo == REPO
    assert registered(models_dir) == ["duet-tests--tiny"]
    assert not (model.path / ".cache").exists() and staging_left(models_dir) == []
    assert (model.path / "model.safetensors").read_bytes() == (tiny_folder / "model.safetensors").read_bytes()
    check_model(model.path)
    assert load_model(model.path).config.hidden_size == 64
    last = reports[-1]
    assert last.done == last.total == remote.size and last.eta_seconds == 0
    assert {r.filename for r in reports} == {f.name for f in remote.files}
    assert all(r.file_done <= r.file_total for r in reports)
    assert ("HEAD", f"/{REPO}/resolve/{remote.commit}/model.safetensors") in hub.requests
    with pytest.raises(DuetError, match="already downloaded"):
        download_model(remote, models_dir)


def test_file_patterns_choose_what_is_fetched(hub):
    remote = remote_model(REPO, ("*.json",))
    assert all(f.name.endswith(".json") for f in remote.files)
    with pytest.raises(DuetError, match="no files match"):
        remote_model(REPO, ("*.gguf",))


def test_missing_repo_is_a_404_line(hub):
    with pytest.raises(DuetError, match=r"not found on the hub \(404\)") as error:
        remote_model("duet-tests/nothing-here")
    assert "\n" not in str(error.value)


def test_unauthorized_says_to_set_hf_token(hub):
    hub.repo_status[REPO] = 401
    with pytest.raises(DuetError, match="set HF_TOKEN") as error:
        remote_model(REPO)
    assert "401" in str(error.value) and "\n" not in str(error.value)


def test_unauthorized_file_mid_download_registers_nothing(hub, tmp_path):
    models_dir = tmp_path / "models"
    remote = remote_model(REPO)
    hub.repo_status[REPO] = 401
    with pytest.raises(DuetError, match="HF_TOKEN"):
        download_model(remote, models_dir)
    assert registered(models_dir) == [] and staging_left(models_dir) == []


def test_the_token_is_sent_but_never_kept(hub, tmp_path, monkeypatch):
    secret = "hf_secret_token_for_tests"
    monkeypatch.setenv("HF_TOKEN", secret)
    models_dir = tmp_path / "models"
    model = download_model(remote_model(REPO), models_dir)
    for path in model.path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes()


def test_dropped_connection_then_server_error_registers_nothing(hub, tmp_path):
    models_dir = tmp_path / "models"
    hub.drop_after["model.safetensors"] = 1000
    with pytest.raises(DuetError, match="answered 500"):
        download_model(remote_model(REPO), models_dir)
    assert registered(models_dir) == [] and staging_left(models_dir) == []


def test_dropped_connection_resumes_and_the_result_is_verified(hub, tmp_path, tiny_folder):
    models_dir = tmp_path / "models"
    hub.drop_after["model.safetensors"] = 1000
    hub.after_drop_status = 0  # the retry with Range succeeds
    model = download_model(remote_model(REPO), models_dir)
    assert (model.path / "model.safetensors").read_bytes() == (tiny_folder / "model.safetensors").read_bytes()


def test_corrupted_bytes_fail_the_hash_and_register_nothing(hub, tmp_path):
    models_dir = tmp_path / "models"
    hub.corrupt.add("tokenizer.json")
    with pytest.raises(DuetError, match="does not match the hub's hash"):
        download_model(remote_model(REPO), models_dir)
    assert registered(models_dir) == [] and staging_left(models_dir) == []


def test_cancel_mid_file_stops_and_cleans_up(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 1 << 14)
    models_dir = tmp_path / "models"
    hub.slow["model.safetensors"] = 0.05
    cancel = threading.Event()

    def report(progress):
        if progress.filename == "model.safetensors" and 0 < progress.file_done < progress.file_total:
            cancel.set()

    with pytest.raises(DownloadCancelled):
        download_model(remote_model(REPO), models_dir, report, cancel)
    assert registered(models_dir) == [] and staging_left(models_dir) == []


def test_not_enough_disk_space_is_said_before_anything_is_fetched(hub, tmp_path, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(DuetError, match="free some space"):
        download_model(remote_model(REPO), tmp_path / "models")
    assert not any(method == "GET" and "/resolve/" in path for method, path in hub.requests)
