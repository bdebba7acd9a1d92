"""The OpenAI API's listener: uvicorn on a background thread of the stage process, with the
stage's own credentials (TLS files, bearer token). Stopping lets generations in flight finish
within a grace period and ends the rest with a 503."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from typing import Any

import structlog
import uvicorn

from skippy_stage.errors import ConfigError, DownstreamError
from skippy_stage.security import Credentials
from skippy_stage.server.openai_api.app import build_app
from skippy_stage.server.openai_api.generation import _Live

log = structlog.get_logger("skippy_stage.openai_api")


class OpenAIServer:
    """uvicorn on a background thread of the stage process, serving :func:`build_app`."""

    def __init__(self, servicer: Any, *, host: str, port: int, grace_s: float = 5.0) -> None:
        self.servicer = servicer
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self.grace_s = grace_s
        self._live = _Live()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        """Bind, start serving, and return once the socket listens (port 0: see ``port``)."""
        cfg = self.servicer.stage.config
        # The same credentials as the gRPC listener: its TLS certificate (and client CA), its token.
        credentials = Credentials.from_config(cfg)
        tls: dict[str, Any] = {}
        if cfg.tls_cert_path is not None:
            tls = {"ssl_certfile": cfg.tls_cert_path, "ssl_keyfile": cfg.tls_key_path}
            if cfg.tls_ca_path is not None:
                tls.update(ssl_ca_certs=cfg.tls_ca_path, ssl_cert_reqs=ssl.CERT_REQUIRED)
        app = build_app(self.servicer, self._live, token=credentials.token)
        config = uvicorn.Config(app, loop="asyncio", http="h11", ws="none", lifespan="off", log_config=None,
                                access_log=False, timeout_graceful_shutdown=5, **tls)
        try:
            config.load()  # here, so that a bad certificate fails the start with its reason
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"stage {cfg.stage_id}: the OpenAI API cannot load its TLS files: {exc}") from None
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.requested_port))
            sock.listen(2048)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"stage {cfg.stage_id}: http_port={self.requested_port} cannot be bound on "
                              f"{self.host}: {exc.strerror or exc}") from None
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="openai-http",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop(0)
                sock.close()
                raise ConfigError(f"stage {cfg.stage_id}: the OpenAI API did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        log.info("openai api listening", stage_id=cfg.stage_id, host=self.host, port=self.port,
                 tls=bool(tls), token=credentials.token is not None)

    def stop(self, grace_s: float | None = None) -> None:
        """Let generations in flight finish within ``grace_s``, end the rest with a 503, stop.

        New requests meanwhile get 503 from the draining stage (``_head`` refuses them).
        """
        if self._server is None or self._thread is None:
            return
        deadline = time.monotonic() + (self.grace_s if grace_s is None else grace_s)
        while self._live.snapshot() and time.monotonic() < deadline:
            time.sleep(0.05)
        config = self.servicer.stage.config
        left = self._live.snapshot()
        for generation in left:
            generation.abort(DownstreamError(f"stage {config.stage_id} is shutting down; retry on another replica",
                                             stage_id=config.stage_id))
        if left:
            log.warning("openai api: generations cut by shutdown", stage_id=config.stage_id, count=len(left))
        self._server.should_exit = True
        self._thread.join(10)
        self._server = None
        self._thread = None
