"""A local HTTP server on 127.0.0.1 that answers as the Hugging Face hub does for downloads.

It serves what huggingface_hub calls: `GET /api/models/{repo}[/revision/{rev}]?blobs=true` (file
list with sizes, git blob ids and LFS sha256) and `HEAD`/`GET /{repo}/resolve/{rev}/{file}` with
ETag, X-Repo-Commit, X-Linked-Size/Etag and Content-Length, honouring Range. Faults are switched on
per test: a status for a whole repo, a connection dropped mid-file, corrupted bytes, a slow file, a
file held after its first piece until the test lets it go,
other bytes than the listing describes, a HEAD that announces another size than the GET sends.
Every file request is kept in `served` with its Range header and the body bytes actually written,
counted as they go, so a test can watch a transfer in progress (and kill the client mid-file).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors", ".gguf")
API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@dataclass
class Served:
    """One HEAD or GET of a repo file as the server answered it."""

    method: str
    name: str  # the file's name in the repo
    range: str | None  # the Range header the client sent
    authorized: bool  # an Authorization header came with it
    status: int = 0
    sent: int = 0  # body bytes written to the socket so far


class _QuietServer(ThreadingHTTPServer):
    """Clients that hang up mid-transfer (cancel, Ctrl-C) are expected here, not errors."""

    daemon_threads = True

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.repo_status: dict[str, int] = {}  # repo -> HTTP status for every request about it
        self.drop_after: dict[str, int] = {}  # file -> bytes sent before the connection drops (once)
        self.after_drop_status = 500  # what a resumed request gets after the drop; 0 serves it
        self.corrupt: set[str] = set()  # files served with one byte changed
        self.slow: dict[str, float] = {}  # file -> seconds to wait between 64 KiB pieces (read each piece)
        self.gate: dict[str, threading.Event] = {}  # file -> sent up to its first 64 KiB, the rest once the event is set
        self.served_instead: dict[str, bytes] = {}  # file -> bytes HEAD and GET describe and send (not the listing)
        self.announce: dict[str, int] = {}  # file -> size HEAD announces; GET still sends the real bytes
        self.requests: list[tuple[str, str]] = []
        self.served: list[Served] = []
        self._dropped: set[str] = set()
        self._server = _QuietServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address
        return f"http://{host}:{port}"

    def add_folder(self, repo: str, folder: Path) -> None:
        self.repos[repo] = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for gate in self.gate.values():
            gate.set()
        self._server.shutdown()
        self._server.server_close()

    def gets(self, name: str) -> list[Served]:
        """The GETs of a file so far, oldest first."""
        return [s for s in self.served if s.method == "GET" and s.name == name]

    def model_info(self, repo: str) -> dict:
        siblings = []
        for name, data in self.repos[repo].items():
            entry = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
            if name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            siblings.append(entry)
        return {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings}

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self._answer(body=False)

            def do_GET(self):
                self._answer(body=True)

            def _answer(self, body: bool):
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path))
                if match := API.match(path):
                    self._api(match.group(1))
                elif match := RESOLVE.match(path):
                    self._file(match.group(1), match.group(3), body)
                else:
                    self._status(404, "Entry not found")

            def _status(self, status: int, message: str, error_code: str = ""):
                payload = json.dumps({"error": message}).encode()
                self.send_response(status)
                if error_code:
                    self.send_header("X-Error-Code", error_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _repo_refused(self, repo: str) -> bool:
                if repo in hub.repo_status:
                    self._status(hub.repo_status[repo], "refused", "RepoNotFound" if hub.repo_status[repo] == 404 else "")
                    return True
                if repo not in hub.repos:
                    self._status(404, "Repository not found", "RepoNotFound")
                    return True
                return False

            def _api(self, repo: str):
                if self._repo_refused(repo):
                    return
                payload = json.dumps(hub.model_info(repo)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _file(self, repo: str, name: str, body: bool):
                record = Served(self.command, name, self.headers.get("Range"), "Authorization" in self.headers)
                hub.served.append(record)
                if self._repo_refused(repo):
                    return
                data = hub.repos[repo].get(name)
                if data is None:
                    self._status(404, "Entry not found", "EntryNotFound")
                    return
                if body and name in hub._dropped and hub.after_drop_status:
                    record.status = hub.after_drop_status
                    self._status(hub.after_drop_status, "server error")
                    return
                etag = hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else git_blob_id(data)
                served = bytearray(hub.served_instead.get(name, data))
                if name in hub.corrupt:
                    served[len(served) // 2] ^= 0xFF
                start, end = self._range(len(served))
                size = len(served) if body else hub.announce.get(name, len(served))
                ranged = "Range" in self.headers
                record.status = 206 if ranged else 200
                self.send_response(record.status)
                self.send_header("ETag", f'"{etag}"')
                self.send_header("X-Repo-Commit", COMMIT)
                if name.endswith(LFS_SUFFIXES):
                    self.send_header("X-Linked-Etag", f'"{etag}"')
                    self.send_header("X-Linked-Size", str(size))
                self.send_header("Content-Length", str(end - start if body else size))
                if ranged:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(served)}")
                self.end_headers()
                if body:
                    self._send_body(name, bytes(served[start:end]), record)

            def _range(self, size: int) -> tuple[int, int]:
                """[start, end) asked for by a Range header (bytes=a- or bytes=a-b); the whole file without one."""
                match = re.match(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if not match:
                    return 0, size
                return int(match.group(1)), min(size, int(match.group(2)) + 1 if match.group(2) else size)

            def _send_body(self, name: str, data: bytes, record: Served):
                if name in hub.drop_after and name not in hub._dropped:
                    hub._dropped.add(name)
                    self.wfile.write(data[: hub.drop_after[name]])
                    self.wfile.flush()
                    record.sent = min(len(data), hub.drop_after[name])
                    self.close_connection = True
                    return
                for offset in range(0, len(data), 1 << 16):
                    piece = data[offset: offset + (1 << 16)]
                    self.wfile.write(piece)
                    self.wfile.flush()
                    record.sent += len(piece)
                    if name in hub.gate:
                        hub.gate[name].wait(timeout=60)
                    if pause := hub.slow.get(name, 0.0):
                        time.sleep(pause)

        return Handler
