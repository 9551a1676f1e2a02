"""Downloads through huggingface_hub: progress, cancel, verify, and nothing half-done left registered.

A download first asks the hub for the repo's file list with sizes and hashes (one API call), then
fetches each file with `hf_hub_download` into a staging folder, reporting bytes through a tqdm
class that also checks the cancel flag. Each file is checked against the hub's size and sha256
(LFS files) or git blob id (small files); only when every file passes is the folder moved into the
models dir under its final name. Any failure or cancel removes the staging folder.

Resuming: when a connection drops mid-file, huggingface_hub asks again with `Range: bytes=N-` for
the bytes it has not written yet, within the same pull. It does not resume across processes: each
transfer writes a process-unique `.incomplete` file (huggingface_hub 2.x, PR #4228), so a pull
that was killed leaves only its staging folder, which the next pull clears and starts over.

Repo file names are checked before anything is written: no absolute, drive or `..` paths, no
backslashes or NUL, nothing in huggingface_hub's own `.cache` folder. A full disk or any other
write error is one line that says what to do, never a traceback.

The token comes from HF_TOKEN as huggingface_hub reads it; duet never logs or stores it.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath

from duet.app.catalog import LocalModel, folder_name, folder_size, hf_cache_dir, human_size, new_staging_dir
from duet.engine.errors import DuetError

MODEL_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.md", "*.gguf", "*.model", "*.py")
REPORT_SECONDS = 0.1
HASH_CHUNK = 1 << 20
FREE_SPACE_MARGIN = 1 << 28  # keep 256 MiB free beyond the download


class DownloadCancelled(DuetError):
    def __init__(self, repo: str):
        super().__init__(f"{repo}: download cancelled; nothing was kept")


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # LFS files
    blob_id: str | None  # git blob sha1, for files stored in git itself


@dataclass(frozen=True)
class RemoteModel:
    repo: str
    commit: str
    files: tuple[RemoteFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class DownloadProgress:
    filename: str
    file_done: int
    file_total: int
    done: int
    total: int
    bytes_per_second: float

    @property
    def eta_seconds(self) -> float | None:
        return (self.total - self.done) / self.bytes_per_second if self.bytes_per_second > 0 else None


def hub_endpoint() -> str | None:
    """HF_ENDPOINT as set now (huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_ENDPOINT") or None


def remote_model(repo: str, patterns: tuple[str, ...] = (), revision: str | None = None) -> RemoteModel:
    """The files of a repo that match the patterns (model files when none), with sizes and hashes."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=hub_endpoint()).model_info(repo, revision=revision, files_metadata=True)
    except Exception as error:
        raise hub_error(error, repo) from None
    wanted = patterns or MODEL_FILES
    chosen = tuple(
        RemoteFile(s.rfilename, s.lfs.size if s.lfs else (s.size or 0), s.lfs.sha256 if s.lfs else None, s.blob_id)
        for s in info.siblings or []
        if any(fnmatch.fnmatch(s.rfilename, p) for p in wanted)
    )
    if not chosen:
        raise DuetError(f"{repo}: no files match {', '.join(wanted)}; check the repo or the file patterns")
    for remote in chosen:
        check_repo_path(repo, remote.name)
    return RemoteModel(repo, info.sha, chosen)


def download_model(model: RemoteModel, models_dir: Path, report: Callable[[DownloadProgress], None] | None = None,
                   cancel: threading.Event | None = None) -> LocalModel:
    """Fetch, verify and register `model` in models_dir; on any failure nothing is left there."""
    from huggingface_hub import hf_hub_download

    target = models_dir / folder_name(model.repo)
    if target.is_symlink() and not target.exists():  # the rename at the end cannot replace it
        raise DuetError(f"{target}: a broken link is in the way; remove it, then pull again")
    if target.exists():
        raise DuetError(f"{target}: already downloaded; delete it first to download again")
    for remote in model.files:
        check_repo_path(model.repo, remote.name)
    check_free_space(models_dir, model.size)
    cancel = cancel or threading.Event()
    staging = new_staging_dir(models_dir, target.name)
    tracker = _Tracker(model, report, cancel)
    try:
        for remote in model.files:
            tracker.start_file(remote)
            try:
                hf_hub_download(model.repo, remote.name, revision=model.commit, local_dir=staging / "model",
                                cache_dir=hf_cache_dir(), endpoint=hub_endpoint(), tqdm_class=tracker.bar_class())
            except DownloadCancelled:
                raise
            except Exception as error:
                raise transfer_error(error, remote, model, models_dir) from None
            verify_file(staging / "model" / remote.name, remote)
            tracker.end_file(remote)
        shutil.rmtree(staging / "model" / ".cache", ignore_errors=True)  # huggingface_hub's resume metadata
        (staging / "model").rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return LocalModel(target.name, target, folder_size(target), "duet", model.repo)


def check_repo_path(repo: str, name: str) -> None:
    """A repo's file names stay inside its folder, read as POSIX or Windows paths, and out of huggingface_hub's."""
    parts = name.split("/")
    if (not name or "\\" in name or "\0" in name or parts[0] == ".cache"
            or any(part in ("", ".", "..") or PureWindowsPath(part).anchor for part in parts)):
        raise DuetError(f"{repo}: file name {name!r} points outside the model folder; refusing to download it")


def check_free_space(models_dir: Path, size: int) -> None:
    models_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(models_dir).free
    if free < size + FREE_SPACE_MARGIN:
        raise DuetError(f"{models_dir}: the download needs {size / 1e9:.2f} GB and {free / 1e9:.2f} GB is free; "
                        "free some space or delete a model")


def verify_file(path: Path, remote: RemoteFile) -> None:
    """Size, then sha256 (LFS) or git blob id; a mismatch is a failed download."""
    actual = path.stat().st_size
    if actual != remote.size:
        raise DuetError(f"{remote.name}: got {actual:,} bytes, the hub lists {remote.size:,}; download again")
    if remote.sha256:
        digest, expected = hashlib.sha256(), remote.sha256
    elif remote.blob_id:
        digest, expected = hashlib.sha1(f"blob {actual}\0".encode()), remote.blob_id
    else:
        return
    with path.open("rb") as file:
        while chunk := file.read(HASH_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise DuetError(f"{remote.name}: content does not match the hub's hash; the transfer was corrupted, download again")


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
SIZE_CHECK = re.compile(r"Consistency check failed: file should be of size (\d+) but has size (\d+)")


def transfer_error(error: Exception, remote: RemoteFile, model: RemoteModel, models_dir: Path) -> DuetError:
    """One line for a file that failed: what the hub or network said, a write that failed, or the wrong size."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if not isinstance(error, OSError) or isinstance(error, (HfHubHTTPError, LocalEntryNotFoundError, ConnectionError,
                                                            TimeoutError)):
        return hub_error(error, model.repo)
    needs = f"the download needs {human_size(model.size)} there"
    if error.errno in DISK_FULL:
        return DuetError(f"{models_dir}: the disk filled up while writing {remote.name}; {needs}; "
                         "free some space or delete a model, then pull again; nothing was kept")
    if error.errno == errno.EFBIG:
        return DuetError(f"{models_dir}: {remote.name} is larger than this system lets a file grow (ulimit -f or "
                         f"the filesystem's limit); {needs}; raise the limit or choose another models folder; "
                         "nothing was kept")
    if match := SIZE_CHECK.search(str(error)):
        return DuetError(f"{remote.name}: the hub announced {int(match[1]):,} bytes and sent {int(match[2]):,}; "
                         "the transfer was cut or corrupted, download again")
    reason = error.strerror or type(error).__name__
    return DuetError(f"{models_dir}: cannot write {remote.name} ({reason}); check that the folder is writable "
                     "and has room, then pull again; nothing was kept")


def hub_error(error: Exception, repo: str) -> DuetError:
    """One line for what the hub or the network said; never the request headers (they hold the token)."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if isinstance(error, DuetError):
        return error
    response = getattr(error, "response", None) if isinstance(error, HfHubHTTPError) else None
    status = response.status_code if response is not None else None
    if status == 401:
        return DuetError(f"{repo}: the hub refused access (401); for a private or gated repo set HF_TOKEN "
                         "to a token that can read it")
    if status == 403:
        return DuetError(f"{repo}: access denied (403); accept the repo's terms on the hub and set HF_TOKEN")
    if status == 404:
        return DuetError(f"{repo}: not found on the hub (404); check the repo id, revision and file names")
    if status is not None:
        return DuetError(f"{repo}: the hub answered {status}; try again later")
    if isinstance(error, LocalEntryNotFoundError) or _is_network_error(error):
        return DuetError(f"{repo}: cannot reach the hub ({type(error).__name__}); check the network or HF_ENDPOINT")
    raise error


def _is_network_error(error: Exception) -> bool:
    import httpx2

    return isinstance(error, (httpx2.TransportError, ConnectionError, TimeoutError))


class _Tracker:
    """Counts bytes for the progress report and stops the transfer when cancel is set."""

    def __init__(self, model: RemoteModel, report: Callable[[DownloadProgress], None] | None,
                 cancel: threading.Event):
        self.model, self.report, self.cancel = model, report, cancel
        self.started = time.monotonic()
        self.done_files = 0  # bytes of the files already complete
        self.file: RemoteFile | None = None
        self.file_done = 0
        self.last_report = 0.0

    def start_file(self, remote: RemoteFile) -> None:
        if self.cancel.is_set():
            raise DownloadCancelled(self.model.repo)
        self.file, self.file_done = remote, 0
        self._report(force=True)

    def end_file(self, remote: RemoteFile) -> None:
        self.done_files += remote.size
        self.file_done = 0
        self._report(force=True, file_done=remote.size)

    def advance(self, n: int) -> None:
        if self.cancel.is_set():
            raise DownloadCancelled(self.model.repo)
        self.file_done += n
        self._report(force=False)

    def _report(self, force: bool, file_done: int | None = None) -> None:
        now = time.monotonic()
        if self.report is None or (not force and now - self.last_report < REPORT_SECONDS):
            return
        self.last_report = now
        done = self.done_files + self.file_done
        speed = done / (now - self.started) if now > self.started else 0.0
        file_done = self.file_done if file_done is None else file_done
        self.report(DownloadProgress(self.file.name, file_done, self.file.size, done, self.model.size, speed))

    def bar_class(self) -> type:
        """A tqdm class for huggingface_hub that draws nothing and feeds this tracker."""
        from huggingface_hub.utils import tqdm as hf_tqdm

        tracker = self

        class TrackingBar(hf_tqdm):
            def __init__(self, *args, **kwargs):
                kwargs["disable"] = True
                super().__init__(*args, **kwargs)

            def update(self, n=1):
                tracker.advance(n)
                return super().update(n)

        return TrackingBar
