"""Downloads through the real huggingface_hub client against a local hub (HF_ENDPOINT on 127.0.0.1).

Faults are real where the machine allows: connections the server drops mid-file, a pull process
killed with SIGKILL, a disk that fills up (a tmpfs when we may mount one, else a file size limit),
bytes that differ from the listing, repo file names that try to leave the models folder.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import huggingface_hub.constants
import pytest
from conftest import build_reference, save_reference
from fake_hub import COMMIT, FakeHub

from duet.app.catalog import STAGING, check_model, import_model, local_models
from duet.app.cli import main
from duet.app.downloads import DownloadCancelled, RemoteFile, RemoteModel, check_repo_path, download_model, remote_model
from duet.app.settings import user_paths
from duet.engine import load_model
from duet.engine.errors import DuetError

REPO = "duet-tests/tiny"
CHUNK = 1 << 14  # huggingface_hub writes what it reads in pieces this size (10 MiB by default)
# `duet models pull` in its own process, writing in small pieces as it would for a big file, so a
# partial file is on disk mid-transfer; FSIZE > 0 caps file size (SIGXFSZ ignored: writes get EFBIG).
PULL = f"""
import resource, signal, sys
import huggingface_hub.constants
huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE = {CHUNK}
fsize = int(sys.argv[1])
if fsize:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
from duet.app.cli import main
sys.exit(main(["models", "pull", *sys.argv[2:]]))
"""


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


@pytest.fixture
def home(tmp_path, monkeypatch):
    """DUET_HOME in tmp, for `duet models ...` in this process and in the pulls it starts."""
    monkeypatch.setenv("DUET_HOME", str(tmp_path / "home"))
    return user_paths()


def start_pull(repo: str = REPO, fsize: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PULL, str(fsize), repo], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(condition, pull: subprocess.Popen, what: str, timeout: float = 30) -> None:
    """Poll until condition() holds; fail at once if the pull ended first, and after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if pull.poll() is not None:
            pytest.fail(f"the pull ended (exit {pull.returncode}) before {what}: {pull.stderr.read()}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def partial_bytes(models_dir, of: bytes) -> int:
    """Bytes in huggingface_hub's .incomplete files of the file whose content is `of` under models_dir
    (their names hold its ETag, the sha256 the hub gives an LFS file; files come and go as we look). Counting
    every .incomplete file let a small file's transient one stand in for model.safetensors's: the test
    then killed the pull before any of that file was written (a CI run failed so, 1 in ~10)."""
    total = 0
    for path in models_dir.rglob(f"*.{hashlib.sha256(of).hexdigest()}.*incomplete"):  # <name hash>.<etag>.<transfer>.incomplete
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            pass
    return total


def files_under(folder) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def duet_lines(err: str) -> list[str]:
    """What the CLI said as duet (progress lines name files; errors start with `duet:`)."""
    return [line for line in err.splitlines() if line.startswith("duet:")]


def listed_on_disk(capsys) -> list[str]:
    """The names `duet models list` shows as on disk (the lines after its `on disk (...)` header)."""
    assert main(["models", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("on disk ("))
    return [line.split()[0] for line in lines[header + 1:]]


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


def test_a_failed_pull_never_shows_or_keeps_the_token(hub, home, tmp_path, monkeypatch):
    secret = "hf_secret_token_for_tests"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("HF_HUB_VERBOSITY", "debug")  # huggingface_hub logs every request it sends
    hub.drop_after["model.safetensors"] = 1000  # then 500 on the retry
    pull = start_pull()
    out, err = pull.communicate(timeout=60)
    assert pull.returncode == 2 and "answered 500" in duet_lines(err)[0]
    assert hub.served and all(request.authorized for request in hub.served)  # the token was sent
    assert secret not in out + err
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_dropped_connection_then_server_error_registers_nothing(hub, tmp_path):
    models_dir = tmp_path / "models"
    hub.drop_after["model.safetensors"] = 1000
    with pytest.raises(DuetError, match="answered 500"):
        download_model(remote_model(REPO), models_dir)
    assert registered(models_dir) == [] and staging_left(models_dir) == []


def test_dropped_connection_resumes_with_range_and_fetches_only_the_rest(hub, tmp_path, tiny_folder, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
    models_dir = tmp_path / "models"
    data = (tiny_folder / "model.safetensors").read_bytes()
    cut = 5 * CHUNK  # whole pieces: all of them reach the disk before the drop
    hub.drop_after["model.safetensors"] = cut
    hub.after_drop_status = 0  # the retry with Range succeeds
    reports = []
    model = download_model(remote_model(REPO), models_dir, reports.append)
    first, second = hub.gets("model.safetensors")
    assert (first.range, first.sent) == (None, cut)
    assert (second.range, second.status, second.sent) == (f"bytes={cut}-", 206, len(data) - cut)
    assert (model.path / "model.safetensors").read_bytes() == data
    assert max(r.file_done for r in reports if r.filename == "model.safetensors") == len(data)
    assert reports[-1].done == reports[-1].total


def test_sigkill_mid_pull_leaves_nothing_that_looks_complete_and_the_next_pull_starts_over(hub, home, tiny_folder,
                                                                                            capsys):
    models_dir = home.models_dir
    data = (tiny_folder / "model.safetensors").read_bytes()
    hub.gate["model.safetensors"] = threading.Event()  # the first 64 KiB, then the server holds the rest
    pull = start_pull()
    wait_for(lambda: partial_bytes(models_dir, data) > 0, pull, "part of model.safetensors was written")
    pull.kill()
    pull.wait(timeout=10)
    hub.gate["model.safetensors"].set()
    left = list(files_under(models_dir))
    assert left and all(path.parts[0] == STAGING for path in left), left
    assert not any(path.name == "model.safetensors" for path in left)
    assert 0 < partial_bytes(models_dir, data) < len(data)
    assert not (models_dir / "duet-tests--tiny").exists()
    assert "duet-tests--tiny" not in listed_on_disk(capsys)

    # A new process does not resume the killed one's file: huggingface_hub 2.x writes each transfer
    # to a process-unique .incomplete file. It clears the dead pull's staging and starts the file over.
    pull = start_pull()
    _, err = pull.communicate(timeout=60)
    assert pull.returncode == 0, err
    second = hub.gets("model.safetensors")[-1]
    assert (second.range, second.sent) == (None, len(data))
    assert (models_dir / "duet-tests--tiny" / "model.safetensors").read_bytes() == data
    assert staging_left(models_dir) == []
    assert "duet-tests--tiny" in listed_on_disk(capsys)


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem that can fill up: a 300 MiB tmpfs (room for the 256 MiB the pull keeps free).

    Mounting needs root (CAP_SYS_ADMIN); elsewhere the test below still runs with a file size limit.
    """
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = shutil.which("mount") and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300m", "tmpfs", str(disk)],
                                                       capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (needs root); the file-size-limit case covers the write error")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(path) -> None:
    """Write to path until the disk is full (while the pull writes too: whoever gets ENOSPC first)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        for piece in (bytes(1 << 20), bytes(1 << 12)):
            try:
                while True:
                    os.write(fd, piece)
            except OSError as error:
                assert error.errno == errno.ENOSPC, error
    finally:
        os.close(fd)


@pytest.mark.parametrize("limit", ["full-disk", "file-size-limit"])
def test_a_write_that_fails_midway_is_one_line_and_keeps_what_was_saved(limit, hub, tmp_path, tiny_folder, monkeypatch,
                                                                          request, capsys):
    disk = request.getfixturevalue("small_disk") if limit == "full-disk" else tmp_path
    monkeypatch.setenv("DUET_HOME", str(disk / "home"))
    models_dir = user_paths().models_dir
    kept = import_model(tiny_folder, models_dir, "kept")
    before = files_under(kept.path)
    if limit == "full-disk":
        hub.gate["model.safetensors"] = threading.Event()  # the first 64 KiB, then the server holds the rest
        pull = start_pull()
        wait_for(lambda: any(get.sent for get in hub.gets("model.safetensors")), pull, "model.safetensors started")
        fill(disk / "filler")  # another program fills the disk, after the free-space check the pull made first
        hub.gate["model.safetensors"].set()
        problem = "the disk filled up while writing model.safetensors"
    else:
        pull = start_pull(fsize=256 << 10)
        problem = "model.safetensors is larger than this system lets a file grow"
    _, err = pull.communicate(timeout=60)
    assert pull.returncode == 2 and "Traceback" not in err, err
    [line] = duet_lines(err)
    assert problem in line and "the download needs 9" in line and "nothing was kept" in line, line
    assert files_under(kept.path) == before
    assert sorted(p.name for p in models_dir.iterdir()) == [STAGING, "kept"] and staging_left(models_dir) == []
    on_disk = listed_on_disk(capsys)
    assert "kept" in on_disk and "duet-tests--tiny" not in on_disk


ESCAPES = ["../evil.safetensors", "a/../../evil.safetensors", "{tmp}/evil.safetensors", "..\\evil.safetensors",
           "a\\..\\..\\evil.safetensors", "evil\0.safetensors", "C:evil.safetensors", "a/C:evil.safetensors",
           ".cache/huggingface/download/model.safetensors.metadata.json", "./evil.safetensors", "a//evil.json", ""]


@pytest.mark.parametrize("name", ESCAPES)
def test_file_names_that_leave_the_model_folder_are_refused_before_anything_is_written(hub, tmp_path, name):
    name = name.format(tmp=tmp_path)
    hub.repos["duet-tests/evil"] = {**hub.repos[REPO], name: b"not a model"}
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(DuetError, match="points outside the model folder; refusing") as error:
        remote_model("duet-tests/evil", ("*",))
    assert "\n" not in str(error.value)
    # A listing made elsewhere (the models screen) is checked again before any byte is written.
    evil = RemoteModel("duet-tests/evil", COMMIT, (*remote_model(REPO).files, RemoteFile(name, 11, None, None)))
    with pytest.raises(DuetError, match="points outside the model folder; refusing"):
        download_model(evil, tmp_path / "models")
    assert sorted(tmp_path.rglob("*")) == before
    assert not any("/resolve/" in path for _, path in hub.requests)


def test_names_that_stay_inside_pass():
    for name in ("model.safetensors", "sub/dir/model-00001-of-00002.safetensors", "odd..name.json", ".gitattributes"):
        check_repo_path(REPO, name)


def test_a_broken_link_where_the_model_goes_is_refused(hub, tmp_path):
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    (models_dir / "duet-tests--tiny").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DuetError, match="a broken link is in the way; remove it"):
        download_model(remote_model(REPO), models_dir)
    assert not (tmp_path / "elsewhere").exists()
    assert not any(method == "GET" and "/resolve/" in path for method, path in hub.requests)


def test_a_file_of_another_size_than_listed_fails_the_size_check(hub, tmp_path, tiny_folder):
    models_dir = tmp_path / "models"
    size = (tiny_folder / "model.safetensors").stat().st_size
    hub.served_instead["model.safetensors"] = (tiny_folder / "model.safetensors").read_bytes() + bytes(100)
    with pytest.raises(DuetError, match=f"model.safetensors: got {size + 100:,} bytes, the hub lists {size:,}; "
                                        "download again"):
        download_model(remote_model(REPO), models_dir)
    assert registered(models_dir) == [] and staging_left(models_dir) == []


def test_a_transfer_shorter_than_announced_is_one_line(hub, tmp_path, tiny_folder):
    """huggingface_hub's own size check (HEAD's size against the bytes the GET brought) raises a
    multi-line OSError; the user gets one line."""
    models_dir = tmp_path / "models"
    size = (tiny_folder / "model.safetensors").stat().st_size
    hub.announce["model.safetensors"] = size + 100
    with pytest.raises(DuetError, match=f"model.safetensors: the hub announced {size + 100:,} bytes and sent "
                                        f"{size:,}; the transfer was cut or corrupted, download again") as error:
        download_model(remote_model(REPO), models_dir)
    assert "\n" not in str(error.value)
    assert registered(models_dir) == [] and staging_left(models_dir) == []


@pytest.mark.parametrize("name", ["tokenizer.json", "model.safetensors"])  # git blob id, LFS sha256
def test_corrupted_bytes_fail_the_hash_and_register_nothing(hub, tmp_path, name):
    models_dir = tmp_path / "models"
    hub.corrupt.add(name)
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
