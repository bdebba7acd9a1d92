"""Transport security and authentication for every listener and every downstream channel.

* TLS: a stage with ``tls_cert_path`` and ``tls_key_path`` serves only TLS; with
  ``tls_ca_path`` too it demands a client certificate signed by that CA (mutual TLS). Its
  downstream channel trusts the same CA and presents the same certificate, so one
  certificate per stage (with both serverAuth and clientAuth usage) covers both roles.
* A bearer token (``auth_token_path``) is checked on every RPC except the health service,
  which orchestrators probe without credentials; stages pass it on downstream.
* Protected mode (Redis's): a stage that other hosts can reach (``bind_addr`` not loopback) with
  neither a token nor TLS refuses to start (:func:`check_exposure`) unless ``allow_insecure``
  says the network is trusted. Who may then hold the stage's lanes is ``stage.peers``'s rule.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc

from skippy_stage.config import StageConfig, parse_endpoint
from skippy_stage.errors import ConfigError

UNAUTHENTICATED_EXEMPT = ("/grpc.health.v1.Health/",)


def _read(path: str | None, what: str, stage_id: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"stage {stage_id}: cannot read {what} {path}: {exc.strerror}") from exc


def loopback(host: str) -> bool:
    """Whether only this host can reach ``host`` (a name other than localhost may resolve to any
    address, so it counts as reachable)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(cfg: StageConfig) -> None:
    """Refuse to serve on an address other hosts can reach with neither a token nor TLS: anyone
    reaching the ports could feed the stage frames and hold its lanes (ConfigError naming why),
    unless ``allow_insecure`` says the network is trusted."""
    host = parse_endpoint(cfg.bind_addr, stage_id=cfg.stage_id, field_name="bind_addr", allow_port_zero=True).host
    if loopback(host) or cfg.allow_insecure or cfg.auth_token_path is not None or cfg.tls_cert_path is not None:
        return
    raise ConfigError(
        f"stage {cfg.stage_id}: bind_addr={cfg.bind_addr!r} can be reached from other hosts and the stage has "
        f"neither auth_token_path nor tls_cert_path, so anyone who reaches its ports could feed it frames and hold "
        f"its lanes: give every stage of the chain the same token file (auth_token_path), or TLS, or set "
        f"allow_insecure: true if the network itself is trusted (allow_insecure={cfg.allow_insecure!r})"
    )


@dataclass(frozen=True)
class Credentials:
    """What one stage needs to listen and to dial, read once at start-up."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    token: str | None = None

    @property
    def tls(self) -> bool:
        return self.cert is not None or self.ca is not None

    @classmethod
    def from_config(cls, cfg: StageConfig) -> Credentials:
        token_bytes = _read(cfg.auth_token_path, "auth token", cfg.stage_id)
        token = token_bytes.decode().strip() if token_bytes is not None else None
        if token_bytes is not None and not token:
            raise ConfigError(f"stage {cfg.stage_id}: auth_token_path={cfg.auth_token_path!r} is empty")
        return cls(
            cert=_read(cfg.tls_cert_path, "TLS certificate", cfg.stage_id),
            key=_read(cfg.tls_key_path, "TLS key", cfg.stage_id),
            ca=_read(cfg.tls_ca_path, "TLS CA", cfg.stage_id),
            token=token,
        )

    def server_credentials(self) -> grpc.ServerCredentials:
        # Listening needs a certificate; a CA alone (tls is true) only serves a client.
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.ca is not None)

    def channel(self, endpoint: str, options: list[tuple[str, int]]) -> grpc.Channel:
        if not self.tls:
            return grpc.insecure_channel(endpoint, options=options)
        creds = grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                             certificate_chain=self.cert or None)
        return grpc.secure_channel(endpoint, creds, options=options)

    def call_metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("authorization", f"Bearer {self.token}"),) if self.token else None


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call without ``authorization: Bearer <token>``, except health checks."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(_request, context: grpc.ServicerContext):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token in 'authorization' metadata")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(deny)
        self._deny_unary_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(UNAUTHENTICATED_EXEMPT):
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization" and hmac.compare_digest(value.encode(), self._expected):
                return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return self._deny_stream
        if handler.response_streaming:
            return self._deny_unary_stream
        return self._deny_unary
