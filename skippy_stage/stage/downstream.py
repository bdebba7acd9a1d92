"""The client side of one edge: this stage's channel to the stage below it.

Two planes. Frames go through a :class:`~skippy_stage.stage.hops.Hop` of the configured
transport (``hop_transport``), one way, never waited for. Control calls — health, status,
DropSession — go over gRPC, each with a deadline (the caller's remaining time, capped by
the hop timeout). Every failure becomes a DownstreamError naming the stage which failed:
the one below us, or a deeper one that it named in its own error (trailing metadata
``skippy-failed-stage``, or ``HopReply.failed_stage``). gRPC errors are translated here.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from skippy_stage.config import PeerConfig
from skippy_stage.errors import DownstreamError, SkippyError
from skippy_stage.model.runtime import KvPage
from skippy_stage.security import Credentials
from skippy_stage.stage import codec, hops
from skippy_stage.stage.channels import channel_options
from skippy_stage.stage.peers import STAGE_ID_METADATA
from skippy_stage.stage.ports import StageBelow
from skippy_stage.stage.reports import StageDrop, StageReport, StageTrim
from skippy_stage.stage.round_trips import RoundTrips
from skippy_stage.stage.status import status_for
from skippy_stage.stage.steps import Frame, Reply
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

FAILED_STAGE_KEY = "skippy-failed-stage"
# Codes a downstream returns about the *request* (relayed as they are); anything else
# means the downstream itself is in trouble and becomes UNAVAILABLE.
_RELAYED_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: "INVALID_ARGUMENT",
    grpc.StatusCode.FAILED_PRECONDITION: "FAILED_PRECONDITION",
    grpc.StatusCode.NOT_FOUND: "NOT_FOUND",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "RESOURCE_EXHAUSTED",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DEADLINE_EXCEEDED",
    grpc.StatusCode.CANCELLED: "CANCELLED",
}


@dataclass(frozen=True)
class HealthProbe:
    ok: bool
    detail: str


class DownstreamClient:
    """One channel to the next stage, shared by every request thread, and its frame hop."""

    def __init__(self, peer: PeerConfig, *, max_message_bytes: int, hop_timeout_s: float, connect_timeout_s: float,
                 transport: str, stage_id: str, on_reply: hops.OnReply, on_broken: hops.OnBroken,
                 credentials: Credentials | None = None) -> None:
        self.peer = peer
        self.hop_timeout_s = hop_timeout_s
        self.transport = transport
        creds = credentials or Credentials()
        self._tls = creds.tls
        self._stage_id = stage_id
        self._metadata = creds.call_metadata()
        self._channel = creds.channel(peer.endpoint, channel_options(max_message_bytes))
        self._stub = pb_grpc.StageServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._lock = threading.Lock()
        self._closed = False
        # Every answered health probe, timed: this link's round trip (``round_trips``).
        self.round_trips = RoundTrips()
        self.hop: hops.Hop
        if transport == "tcp":
            self.hop = hops.TcpHop(peer, port=lambda: self.frame_port(connect_timeout_s), credentials=creds,
                                   stage_id=stage_id, max_message_bytes=max_message_bytes,
                                   connect_timeout_s=connect_timeout_s, on_reply=on_reply, on_broken=on_broken)
        else:
            # The stream names this stage: the stage below recognises its upstream by it (``peers``).
            named = (*(self._metadata or ()), (STAGE_ID_METADATA, stage_id.encode()))
            self.hop = hops.StreamHop(peer, self._stub, named, translate=self._translate,
                                      on_reply=on_reply, on_broken=on_broken)

    def timeout_for(self, remaining: float | None) -> float:
        return timeout_for(remaining, self.hop_timeout_s)

    def _translate(self, err: grpc.RpcError) -> DownstreamError:
        code = err.code()
        details = err.details() or ""
        failed = None
        for key, value in getattr(err, "trailing_metadata", lambda: ())() or ():
            if key == FAILED_STAGE_KEY:
                failed = value
        if failed is not None:
            return DownstreamError(details, stage_id=failed, code_name=_RELAYED_CODES.get(code, "UNAVAILABLE"))
        if code in _RELAYED_CODES and code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            return DownstreamError(f"stage {self.peer.stage_id}: {details}", stage_id=self.peer.stage_id,
                                   code_name=_RELAYED_CODES[code])
        return DownstreamError(
            f"stage {self.peer.stage_id} at {self.peer.endpoint} failed: {code.name}: {details}",
            stage_id=self.peer.stage_id,
            code_name="DEADLINE_EXCEEDED" if code == grpc.StatusCode.DEADLINE_EXCEEDED else "UNAVAILABLE",
        )

    def send(self, frame: Frame) -> None:
        """Hand one frame to the hop; DownstreamError when the link cannot be had."""
        self.hop.send(hops.stamp(frame))

    def release(self, session_ids: list[str], *, moved: bool = False, retired: bool = False) -> None:
        """Drop (or, ``moved``, let go of; ``retired``, keep as prefixes) sessions this edge opened below, in
        band (``Hop.release``)."""
        self.hop.release(session_ids, moved=moved, retired=retired)

    def frame_port(self, timeout_s: float) -> int:
        """The downstream's TCP frame listener, as it advertises it (asked on every new link)."""
        status = self.status(timeout_s)
        if not status.frame_port:
            raise DownstreamError(f"stage {self.peer.stage_id} at {self.peer.endpoint} has no TCP frame listener "
                                  f"(its hop_transport={status.hop_transport!r}, this stage's 'tcp')",
                                  stage_id=self.peer.stage_id, code_name="FAILED_PRECONDITION")
        return int(status.frame_port)

    def reply_error(self, reply: Reply) -> DownstreamError:
        return reply_error(self.peer, reply)

    def drop_session(self, session_id: str, remaining: float | None, keep_prefix: bool = False) -> list[StageDrop]:
        try:
            return codec.drops_from_pb(self._stub.DropSession(
                pb.DropSessionRequest(session_id=session_id, keep_prefix=keep_prefix),
                timeout=self.timeout_for(remaining), metadata=self._metadata))
        except grpc.RpcError as err:
            raise self._translate(err) from None

    def trim_session(self, session_id: str, tokens: int, remaining: float | None) -> list[StageTrim]:
        try:
            return codec.trims_from_pb(self._stub.TrimSession(
                pb.TrimSessionRequest(session_id=session_id, tokens=tokens),
                timeout=self.timeout_for(remaining), metadata=self._metadata))
        except grpc.RpcError as err:
            raise self._translate(err) from None

    def export_session(self, session_id: str, *, wait_for_tokens: int, release: bool, timeout_s: float,
                       wait_for_batches: int = 0) -> KvPage:
        """The downstream's own KV page of a session (that stage only, not the ones below it)."""
        try:
            return codec.page_from_pb(self._stub.ExportSession(
                pb.ExportSessionRequest(session_id=session_id, wait_for_tokens=wait_for_tokens,
                                        wait_for_batches=wait_for_batches, release=release),
                timeout=timeout_s, metadata=self._metadata))
        except grpc.RpcError as err:
            raise self._translate(err) from None

    def import_session(self, session_id: str, page: KvPage, timeout_s: float, *, resident: bool = False) -> int:
        try:
            return int(self._stub.ImportSession(pb.ImportSessionRequest(session_id=session_id,
                                                                        page=codec.page_to_pb(page),
                                                                        resident=resident),
                                                timeout=timeout_s, metadata=self._metadata).tokens)
        except grpc.RpcError as err:
            raise self._translate(err) from None

    def status(self, timeout_s: float) -> StageReport:
        try:
            return codec.report_from_pb(self._stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s,
                                                             metadata=self._metadata))
        except grpc.RpcError as err:
            raise self._translate(err) from None

    def probe_health(self, timeout_s: float) -> HealthProbe:
        """Ask the downstream's standard health service; SERVING means its whole chain is.

        An answer, whatever it says, crossed the link both ways: its time is a round-trip sample."""
        try:
            sent = time.perf_counter()
            resp = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            self.round_trips.add(time.perf_counter() - sent)
        except grpc.RpcError as err:
            detail = f"stage {self.peer.stage_id} at {self.peer.endpoint}: {err.code().name}"
            if err.code() == grpc.StatusCode.UNAVAILABLE and self._accepts_tcp(timeout_s):
                # Something listens there but does not speak gRPC the way this stage does.
                detail += (f"; it accepts connections but does not answer this stage's gRPC "
                           f"{'over TLS' if self._tls else 'in plaintext'} ({self._stage_id} has TLS "
                           f"{'on' if self._tls else 'off'}): are tls_cert_path/tls_ca_path set alike on "
                           f"{self._stage_id} and {self.peer.stage_id}?")
            return HealthProbe(False, detail)
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            detail = (f"stage {self.peer.stage_id} reports "
                      f"{health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}")
            return HealthProbe(False, detail + self._why_not_serving(timeout_s))
        return HealthProbe(True, "")

    def _why_not_serving(self, timeout_s: float) -> str:
        """The health protocol has no reason field; the downstream's status does. Its own state or
        what it knows of the chain below it: an operator then reads the stage that failed, not the
        first one that noticed."""
        try:
            report = self.status(timeout_s)
        except SkippyError:
            return ""
        if report.state != "serving":
            return f": it is {report.state}"
        return f": {report.downstream_error}" if report.downstream_error else ""

    def _accepts_tcp(self, timeout_s: float) -> bool:
        import socket

        host, _, port = self.peer.endpoint.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout_s, 0.5)).close()
            return True
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.hop.close()
                self._channel.close()


def timeout_for(remaining: float | None, cap_s: float) -> float:
    """A call's deadline: what is left of the caller's (at least 1 ms), capped by the hop
    timeout. No deadline, or a client's NaN, means the cap."""
    if remaining is None or remaining != remaining:
        return cap_s
    return max(0.001, min(remaining, cap_s))


def reply_error(peer: PeerConfig, reply: Reply) -> DownstreamError:
    """The DownstreamError a back-channel error from ``peer``'s edge stands for."""
    code = getattr(grpc.StatusCode, reply.code, grpc.StatusCode.UNKNOWN)
    if reply.failed_stage:
        return DownstreamError(reply.message, stage_id=reply.failed_stage,
                               code_name=_RELAYED_CODES.get(code, "UNAVAILABLE"))
    if code in _RELAYED_CODES:
        return DownstreamError(f"stage {peer.stage_id}: {reply.message}", stage_id=peer.stage_id,
                               code_name=_RELAYED_CODES[code])
    return DownstreamError(f"stage {peer.stage_id} failed: {code.name}: {reply.message}", stage_id=peer.stage_id)


class LocalDownstream:
    """The downstream edge to a stage in this process: frames over a :class:`~hops.LocalHop`
    (run on the sender's thread), control calls made directly. Stage logic is tested on it
    without sockets; it translates errors as the gRPC client does."""

    round_trips: RoundTrips | None = None  # no link to measure

    def __init__(self, peer: PeerConfig, target: StageBelow, *, hop_timeout_s: float, on_reply: hops.OnReply,
                 on_broken: hops.OnBroken) -> None:
        self.peer = peer
        self.target = target
        self.hop_timeout_s = hop_timeout_s
        self.transport = "local"
        self.hop = hops.LocalHop(peer, target, on_reply=on_reply, on_broken=on_broken)

    def timeout_for(self, remaining: float | None) -> float:
        return timeout_for(remaining, self.hop_timeout_s)

    def send(self, frame: Frame) -> None:
        self.hop.send(hops.stamp(frame))

    def release(self, session_ids: list[str], *, moved: bool = False, retired: bool = False) -> None:
        self.hop.release(session_ids, moved=moved, retired=retired)

    def reply_error(self, reply: Reply) -> DownstreamError:
        return reply_error(self.peer, reply)

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except DownstreamError:
            raise
        except SkippyError as exc:
            code, message = status_for(exc)
            raise DownstreamError(f"stage {self.peer.stage_id}: {message}", stage_id=self.peer.stage_id,
                                  code_name=_RELAYED_CODES.get(code, "UNAVAILABLE")) from None

    def drop_session(self, session_id: str, remaining: float | None, keep_prefix: bool = False) -> list[StageDrop]:
        return self._call(lambda: self.target.drop_session(session_id, remaining, keep_prefix=keep_prefix))

    def trim_session(self, session_id: str, tokens: int, remaining: float | None) -> list[StageTrim]:
        return self._call(self.target.trim_session, session_id, tokens, remaining)

    def status(self, timeout_s: float) -> StageReport:
        return self._call(self.target.status)

    def probe_health(self, timeout_s: float) -> HealthProbe:
        return HealthProbe(True, "") if self.target.ready else HealthProbe(False, f"stage {self.peer.stage_id} not ready")

    def close(self) -> None:
        self.hop.close()
