"""A layer package served over HTTP from a thread of the test: every request recorded (path, Range
header, User-Agent, which names the stage fetching), ``Range: bytes=N-`` answered with 206, and a
chosen file's first response cut off halfway, as a connection that drops mid-part."""

from __future__ import annotations

import re
import threading
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass(frozen=True)
class Served:
    path: str
    range: str | None
    agent: str


class PackageServer:
    """Serves ``root`` on 127.0.0.1 until closed (a context manager)."""

    def __init__(self, root: Path, *, drop_once: Iterable[str] = ()) -> None:
        self.root = root
        self.drop_once = set(drop_once)
        self.requests: list[Served] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.owner = self  # type: ignore[attr-defined]
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="package-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/"

    def paths(self, agent: str | None = None) -> list[str]:
        """The paths requested (by a User-Agent containing ``agent``), in order."""
        with self._lock:
            return [r.path for r in self.requests if agent is None or agent in r.agent]

    def __enter__(self) -> PackageServer:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        owner: PackageServer = self.server.owner  # type: ignore[attr-defined]
        name = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path.lstrip("/"))
        wanted = self.headers.get("Range")
        with owner._lock:
            owner.requests.append(Served(name, wanted, self.headers.get("User-Agent", "")))
            drop = name in owner.drop_once
            owner.drop_once.discard(name)
        path = owner.root / name
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start = 0
        if wanted is not None:
            match = re.fullmatch(r"bytes=(\d+)-", wanted)
            if match is None or int(match[1]) >= len(data):
                self.send_error(416)
                return
            start = int(match[1])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if drop:  # half the bytes, then the connection goes
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass
