"""Remote inspection reads only headers: a hub on 127.0.0.1 (HF_ENDPOINT) serves header-only
checkpoints from disk and records every byte range it sends.

The server answers `GET /api/models/{repo}/revision/{rev}` (the file list) and
`GET /{repo}/resolve/{rev}/{file}` with Range support. It never sends more than MAX_BODY bytes in
one response, so a client that asks for a whole 19 GB file gets a bounded reply and fails the test.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

import headeronly as ho
from duet.app.cli import main
from duet.engine.checkpoint.headers import FIRST_BLOCK, MAX_BLOCK, read_headers
from duet.engine.errors import DuetError
from duet.engine.placement import GB, RTX_3090, assess

MAX_BODY = 8 * 2**20
TOKEN = "hf_test_token_never_to_be_logged"
API = re.compile(r"^/api/models/([^/]+/[^/]+)/revision/([^/]+)$")
RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")


class HeaderHub:
    def __init__(self, repos: dict[str, Path], token: str | None = None, honour_ranges: bool = True):
        self.repos, self.token, self.honour_ranges = repos, token, honour_ranges
        self.sent: list[tuple[str, int, int]] = []  # (file, first byte, end) of every body sent
        self.authorization: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())

    @property
    def endpoint(self) -> str:
        return "http://%s:%d" % self.server.server_address

    def bytes_sent(self, name: str) -> int:
        return sum(end - start for file, start, end in self.sent if file == name)

    def __enter__(self) -> HeaderHub:
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub.authorization.append(self.headers.get("authorization", ""))
                if hub.token and self.headers.get("authorization") != f"Bearer {hub.token}":
                    return self._status(401)
                if match := API.match(self.path):
                    return self._listing(match[1])
                if match := RESOLVE.match(self.path):
                    return self._file(match[1], unquote(match[3]))
                self._status(404)

            def _status(self, code: int):
                self.send_response(code)
                self.send_header("content-length", "0")
                self.end_headers()

            def _listing(self, repo: str):
                if repo not in hub.repos:
                    return self._status(404)
                root = hub.repos[repo]
                files = [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file()]
                body = json.dumps({"id": repo, "sha": "0" * 40, "siblings": [{"rfilename": f} for f in files]}).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _file(self, repo: str, name: str):
                path = hub.repos.get(repo, Path("/nonexistent")) / name
                if not path.is_file():
                    return self._status(404)
                size = path.stat().st_size
                wanted = RANGE.match(self.headers.get("range", ""))
                start, end = (int(wanted[1]), min(int(wanted[2]) + 1, size)) if wanted and hub.honour_ranges else (0, size)
                if start >= size:
                    return self._status(416)
                self.send_response(206 if wanted and hub.honour_ranges else 200)
                if wanted and hub.honour_ranges:
                    self.send_header("content-range", f"bytes {start}-{end - 1}/{size}")
                self.send_header("content-length", str(end - start))
                self.end_headers()
                self._send(name, path, start, min(end, start + MAX_BODY))

            def _send(self, name: str, path: Path, start: int, end: int):
                sent = start
                with open(path, "rb") as f:
                    f.seek(start)
                    try:
                        while sent < end:
                            chunk = f.read(min(64 * 1024, end - sent))
                            self.wfile.write(chunk)
                            sent += len(chunk)
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the client hung up once it had what it needed
                hub.sent.append((name, start, sent))
                self.close_connection = True

        return Handler


@pytest.fixture(scope="module")
def repo_27b(tmp_path_factory) -> Path:
    return ho.write_27b_int4(tmp_path_factory.mktemp("hub") / "int4", shards=4)


def header_end(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_remote_safetensors_fetches_exactly_the_headers(repo_27b, monkeypatch):
    with HeaderHub({"seed/swift-27b-int4": repo_27b}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        remote = read_headers("seed/swift-27b-int4")
    local = read_headers(str(repo_27b))
    assert {n: (t.dtype, t.shape, t.begin, t.end) for n, t in remote.tensors.items()} == \
           {n: (t.dtype, t.shape, t.begin, t.end) for n, t in local.tensors.items()}
    assert remote.config == local.config and remote.file_bytes == local.file_bytes
    for shard in sorted(repo_27b.glob("*.safetensors")):
        assert all(end <= header_end(shard) for name, _, end in hub.sent if name == shard.name)  # never the data
        assert hub.bytes_sent(shard.name) == header_end(shard)  # the length prefix and the header, once
    small = {"config.json", "model.safetensors.index.json"}
    assert {name for name, *_ in hub.sent} == small | {p.name for p in repo_27b.glob("*.safetensors")}
    assert all(hub.bytes_sent(n) == (repo_27b / n).stat().st_size for n in small)
    bill = assess(remote, RTX_3090).bill
    assert abs(bill.decoder_weights / GB - 12.596) < 0.02


def test_remote_gguf_reads_the_header_and_at_most_one_block_past_it(tmp_path, monkeypatch):
    (tmp_path / "repo").mkdir()
    path = ho.write_27b_gguf(tmp_path / "repo" / "Model-IQ4_XS.gguf")
    (tmp_path / "repo" / "mmproj-F16.gguf").write_bytes(b"GGUF")  # a vision projector is never the model
    (tmp_path / "repo" / "config.json").write_text("{}")  # a config.json without safetensors: still a GGUF repo
    with HeaderHub({"someone/model-gguf": tmp_path / "repo"}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        remote = read_headers("someone/model-gguf")
    local = read_headers(str(path))
    assert remote.source == "someone/model-gguf" and remote.config == local.config
    assert {n: (t.dtype, t.shape, t.begin) for n, t in remote.tensors.items()} == \
           {n: (t.dtype, t.shape, t.begin) for n, t in local.tensors.items()}
    data_start = min(t.begin for t in local.tensors.values())
    assert data_start < hub.bytes_sent(path.name) <= max(data_start + MAX_BLOCK, FIRST_BLOCK)


def test_token_goes_only_in_the_authorization_header(repo_27b, monkeypatch, caplog, capsys, tmp_path):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("DUET_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with HeaderHub({"gated/model": repo_27b}, token=TOKEN) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        with pytest.raises(DuetError, match="HF_TOKEN"):
            read_headers("gated/model")
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        assert main(["models", "info", "gated/model", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["source"] == "gated/model"
    assert f"Bearer {TOKEN}" in hub.authorization
    assert TOKEN not in out.out + out.err + caplog.text


def test_a_server_that_ignores_ranges_is_read_only_as_far_as_needed(repo_27b, monkeypatch):
    with HeaderHub({"plain/server": repo_27b}, honour_ranges=False) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        remote = read_headers("plain/server")
    assert len(remote.tensors) == len(read_headers(str(repo_27b)).tensors)
    assert all(sent - start <= MAX_BODY for _, start, sent in hub.sent)


def test_missing_repo_is_one_line(monkeypatch):
    with HeaderHub({}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        with pytest.raises(DuetError, match="not found"):
            read_headers("nobody/nothing")
