"""The client side of one hop: this stage's long-lived channel to the stage below it.

Every call carries a deadline (the caller's remaining time, capped by the hop timeout),
and every failure becomes a DownstreamError that names the stage which failed: the one
below us, or a deeper one that it named in its own error (trailing metadata
``skippy-failed-stage``). gRPC errors are translated here and nowhere else.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from skippy_stage.config import PeerConfig
from skippy_stage.errors import DownstreamError
from skippy_stage.security import Credentials
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


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Keepalive so a dead peer is noticed between requests, and the stage's size limit."""
    return [
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Reconnect quickly once a restarted peer is back.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


@dataclass(frozen=True)
class HealthProbe:
    ok: bool
    detail: str


_CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class _HopStream:
    """One long-lived ActivationStream to the downstream; frames are matched by hop_id.

    A reader thread resolves each frame's future as its reply arrives; when the stream
    breaks, every pending frame fails with UNAVAILABLE naming the downstream, and the next
    frame opens a new stream.
    """

    def __init__(self, stub: pb_grpc.StageServiceStub, metadata) -> None:  # noqa: ANN001
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._broken: grpc.RpcError | None = None
        self._call = stub.ActivationStream(self._requests(), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="hop-stream-reader", daemon=True)
        self._reader.start()

    def _requests(self):  # noqa: ANN202
        while True:
            item = self._outbox.get()
            if item is None:
                return
            yield item

    def _read(self) -> None:
        try:
            for reply in self._call:
                with self._lock:
                    future = self._pending.pop(reply.hop_id, None)
                if future is not None:
                    future.set_result(reply)
            error = None
        except grpc.RpcError as err:
            error = err
        with self._lock:
            self._broken = error or _StreamClosed()
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(self._broken)

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def send(self, hop: pb.HopRequest) -> Future:
        future: Future = Future()
        with self._lock:
            if self._broken is not None:
                future.set_exception(self._broken)
                return future
            self._pending[hop.hop_id] = future
        self._outbox.put(hop)
        return future

    def forget(self, hop_id: int) -> None:
        with self._lock:
            self._pending.pop(hop_id, None)

    def close(self) -> None:
        self._outbox.put(None)
        self._call.cancel()


class HopFuture(Future):
    """A frame's answer: an IterationBatchResponse, or a DownstreamError. The first settle wins
    (the head settles it from either the relayed answer or the final stage's direct return)."""

    def __init__(self) -> None:
        super().__init__()
        self.cancel_hop: Callable[[], object] = lambda: None

    def settle(self, *, result: pb.IterationBatchResponse | None = None,
               error: BaseException | None = None) -> bool:
        """Resolve the future unless something already did; True when this call resolved it."""
        try:
            if error is not None:
                self.set_exception(error)
            else:
                self.set_result(result)
        except InvalidStateError:
            return False
        return True


class _StreamClosed(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "activation stream closed"

    def trailing_metadata(self) -> tuple:
        return ()


class DownstreamClient:
    """One channel to the next stage, shared by every request thread."""

    def __init__(self, peer: PeerConfig, *, max_message_bytes: int, hop_timeout_s: float,
                 transport: str = "stream", credentials: Credentials | None = None) -> None:
        self.peer = peer
        self.hop_timeout_s = hop_timeout_s
        self.transport = transport
        creds = credentials or Credentials()
        self._metadata = creds.call_metadata()
        self._channel = creds.channel(peer.endpoint, channel_options(max_message_bytes))
        self._stub = pb_grpc.StageServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._lock = threading.Lock()
        self._closed = False
        self._stream: _HopStream | None = None
        self._hop_ids = itertools.count(1)

    def timeout_for(self, remaining: float | None) -> float:
        return self.hop_timeout_s if remaining is None else max(0.001, min(remaining, self.hop_timeout_s))

    def _translate(self, err: grpc.RpcError) -> DownstreamError:
        code = err.code()
        details = err.details() or ""
        failed = None
        for key, value in err.trailing_metadata() or ():
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

    def forward(self, request: pb.IterationBatchRequest, remaining: float | None) -> pb.IterationBatchResponse:
        """Send one frame and wait for its answer (relayed from the final stage)."""
        return self.wait(self.submit(request, remaining), self.timeout_for(remaining))

    def wait(self, future: HopFuture, timeout: float, hop: HopFuture | None = None) -> pb.IterationBatchResponse:
        """The answer of ``future`` within ``timeout`` (else DEADLINE_EXCEEDED, and the hop —
        ``future`` itself unless given — is given up)."""
        try:
            return future.result(timeout=timeout + 0.05)
        except FutureTimeout:
            (hop or future).cancel_hop()
            raise DownstreamError(f"stage {self.peer.stage_id} at {self.peer.endpoint} did not answer within "
                                  f"{timeout:.3f}s", stage_id=self.peer.stage_id, code_name="DEADLINE_EXCEEDED") from None

    def submit(self, request: pb.IterationBatchRequest, remaining: float | None) -> HopFuture:
        """Send one frame; the future resolves to the answer or fails with a DownstreamError."""
        timeout = self.timeout_for(remaining)
        out = HopFuture()
        if self.transport == "stream":
            stream = self._open_stream()
            hop_id = next(self._hop_ids)
            inner = stream.send(pb.HopRequest(hop_id=hop_id, request=request, timeout_s=timeout))
            out.cancel_hop = lambda: stream.forget(hop_id)

            def done(f: Future) -> None:
                try:
                    out.settle(result=self._from_reply(f.result()))
                except grpc.RpcError as err:
                    out.settle(error=self._translate(err))
                except DownstreamError as exc:
                    out.settle(error=exc)
            inner.add_done_callback(done)
            return out
        call = self._stub.ActivationFrame.future(request, timeout=timeout, metadata=self._metadata)
        out.cancel_hop = call.cancel

        def unary_done(c: grpc.Future) -> None:
            try:
                out.settle(result=c.result())
            except grpc.RpcError as err:
                out.settle(error=self._translate(err))
        call.add_done_callback(unary_done)
        return out

    def _open_stream(self) -> _HopStream:
        with self._lock:
            if self._stream is None or self._stream.broken:
                if self._stream is not None:
                    self._stream.close()
                self._stream = _HopStream(self._stub, self._metadata)
            return self._stream

    def _from_reply(self, reply: pb.HopReply) -> pb.IterationBatchResponse:
        if reply.code == 0:
            return reply.response
        code = _CODE_BY_VALUE.get(reply.code, grpc.StatusCode.UNKNOWN)
        if reply.failed_stage:
            raise DownstreamError(reply.message, stage_id=reply.failed_stage,
                                  code_name=_RELAYED_CODES.get(code, "UNAVAILABLE"))
        if code in _RELAYED_CODES:
            raise DownstreamError(f"stage {self.peer.stage_id}: {reply.message}", stage_id=self.peer.stage_id,
                                  code_name=_RELAYED_CODES[code])
        raise DownstreamError(f"stage {self.peer.stage_id} failed: {code.name}: {reply.message}",
                              stage_id=self.peer.stage_id)

    def drop_session(self, session_id: str, remaining: float | None) -> pb.DropSessionResponse:
        try:
            return self._stub.DropSession(pb.DropSessionRequest(session_id=session_id), timeout=self.timeout_for(remaining),
                                          metadata=self._metadata)
        except grpc.RpcError as err:
            raise self._translate(err) from None

    def status(self, timeout_s: float) -> pb.StageStatus:
        try:
            return self._stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as err:
            raise self._translate(err) from None

    def probe_health(self, timeout_s: float) -> HealthProbe:
        """Ask the downstream's standard health service; SERVING means its whole chain is."""
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as err:
            return HealthProbe(False, f"stage {self.peer.stage_id} at {self.peer.endpoint}: {err.code().name}")
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            return HealthProbe(False, f"stage {self.peer.stage_id} reports {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}")
        return HealthProbe(True, "")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                if self._stream is not None:
                    self._stream.close()
                self._channel.close()
