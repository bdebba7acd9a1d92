"""Outputs back to the stage that waits for them: the waiting side and the final stage's side.

Frames flow one way; a step's outputs come back by one of two ways. A final stage with
``return_to`` sends them straight to the head (one leg, whatever the number of stages),
over the transport of ``hop_transport``: a TCP link to the head's frame listener, or the
gRPC ReturnResults stream. Without it — or when the frame asked to be relayed, or the
head cannot be reached just now — they travel back up the edges' back channels, one leg
per stage. Errors always travel the back channels, so every stage on the way frees the
failed sessions (``Stage._from_below``). The downstream watch times a call of the head's health
service over the direct return's channel every round: that link's round trip (``round_trips``).

Keys are random per step, so a stale or forged return cannot settle another step (and a
client that saw one key cannot work out the next: keys travel down through every stage).
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from concurrent.futures import Future, InvalidStateError

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from skippy_stage import tracing
from skippy_stage.config import PeerConfig
from skippy_stage.errors import DownstreamError, InvalidRequestError
from skippy_stage.security import Credentials
from skippy_stage.stage import codec, framing
from skippy_stage.stage.channels import channel_options
from skippy_stage.stage.ports import HeadAbove
from skippy_stage.stage.round_trips import RoundTrips
from skippy_stage.stage.steps import Outputs
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

log = structlog.get_logger("skippy_stage.returns")

# After a failed attempt to reach the head, relay for this long before trying again, so an
# unreachable head costs one connect timeout per interval, not one per step.
RETRY_AFTER_S = 1.0
CONNECT_TIMEOUT_S = 1.0


class HopFuture(Future):
    """A step's outputs, or a DownstreamError. The first settle wins
    (the final stage's direct return, a relayed copy, or an error from the back channel)."""

    def settle(self, *, result: Outputs | None = None,
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


class ReturnBox:
    """The steps this stage waits for (every step at the head; a unary call elsewhere), by key."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, HopFuture] = {}
        # The head's lone generation (``native_frames.NativeHead.lone``) waits here under keys it
        # makes itself; what is not one plain token for it settles it as a future would be.
        self.lone = None  # a _frames.ReturnWait

    def expect(self, future: HopFuture) -> str:
        key = secrets.token_hex(16)  # as random as a UUID, without building one per step
        with self._lock:
            self._waiting[key] = future
        return key

    def forget(self, key: str) -> None:
        with self._lock:
            self._waiting.pop(key, None)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._waiting

    def deliver(self, key: str, outputs: Outputs) -> bool:
        """Settle the step waiting under ``key``; False if none waits (late, or unknown)."""
        with self._lock:
            future = self._waiting.pop(key, None)
        if future is None:
            return self.lone is not None and self.lone.settle(key, outputs)
        return future.settle(result=outputs)

    def fail(self, key: str, error: DownstreamError) -> bool:
        with self._lock:
            future = self._waiting.pop(key, None)
        if future is None:
            return self.lone is not None and self.lone.settle(key, error)
        return future.settle(error=error)

    def fail_all(self, error: DownstreamError) -> int:
        """An edge below broke: every step in flight is lost. Returns how many were waiting."""
        with self._lock:
            futures, self._waiting = list(self._waiting.values()), {}
        lone = self.lone is not None and self.lone.settle(None, error)
        return sum(f.settle(error=error) for f in futures) + lone


class _Backoff:
    def __init__(self) -> None:
        self._until = 0.0

    def blocked(self) -> bool:
        return time.monotonic() < self._until

    def trip(self) -> None:
        self._until = time.monotonic() + RETRY_AFTER_S


class TcpReturn:
    """The final stage's TCP link to the head's frame listener. ``send`` is False whenever the
    outputs could not be handed to a live link; the caller relays them then."""

    def __init__(self, head: PeerConfig, *, credentials: Credentials, stage_id: str, max_message_bytes: int) -> None:
        self.head = head
        self.log = log.bind(stage_id=stage_id, head=head.stage_id, endpoint=head.endpoint)
        self._host = head.endpoint.rpartition(":")[0].strip("[]")
        self._creds = credentials
        # The head's frame port is whatever it advertises (asked on every new link).
        self._channel = credentials.channel(head.endpoint, channel_options(max_message_bytes))
        self._stub = pb_grpc.StageServiceStub(self._channel)
        self.round_trips = RoundTrips()
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._stage_id = stage_id
        self._max = max_message_bytes
        self._lock = threading.Lock()
        self._link: framing.FrameSocket | None = None
        self._backoff = _Backoff()
        self._closed = False

    def _connect(self) -> framing.FrameSocket | None:
        with self._lock:
            if self._link is not None or self._closed or self._backoff.blocked():
                return self._link
            try:
                port = self._stub.GetStatus(pb.GetStatusRequest(), timeout=CONNECT_TIMEOUT_S,
                                            metadata=self._creds.call_metadata()).frame_port
                if not port:
                    raise DownstreamError(f"head {self.head.stage_id} advertises no TCP frame listener",
                                          stage_id=self.head.stage_id)
                self._link = framing.dial(self._host, port, creds=self._creds, purpose=pb.FrameHello.PURPOSE_RETURN,
                                          stage_id=self._stage_id, max_message_bytes=self._max,
                                          timeout_s=CONNECT_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - any failure means "relay instead"
                self._backoff.trip()
                self.log.warning("cannot reach the head for direct returns; relaying", error=str(exc))
                return None
            threading.Thread(target=self._watch, args=(self._link,), name="return-link", daemon=True).start()
            return self._link

    def _watch(self, link: framing.FrameSocket) -> None:
        """The head sends nothing on this link: a read returning means it closed or broke."""
        try:
            link.receive()
        except (framing.LinkClosed, InvalidRequestError, OSError):
            pass
        self._drop(link)

    @property
    def plain_link(self) -> framing.FrameSocket | None:
        """The live link on a plain socket (``framing.plain``); None until the first send has connected it."""
        return framing.plain(self._link)

    def broke(self, link: framing.FrameSocket, detail: str) -> None:
        """A send on ``link`` failed: drop it (the next send reconnects); the caller relays."""
        self.log.warning("direct return link to the head broke; relaying", error=detail)
        self._drop(link)

    def _drop(self, link: framing.FrameSocket) -> None:
        with self._lock:
            if self._link is link:
                self._link = None
        link.close()

    def probe(self, timeout_s: float) -> None:
        """Time one call of the head's health service over this link (``time_health_call``)."""
        time_health_call(self._health, self.round_trips, timeout_s)

    def send(self, key: str, outputs: Outputs) -> bool:
        link = self._connect()
        if link is None:
            return False
        try:
            tracing.mark("s0")
            link.send(framing.Kind.RETURNED_BATCH, codec.returned_to_pb(key, outputs))
            tracing.mark("s1")
            return True
        except framing.LinkClosed as exc:
            self.broke(link, str(exc))
            return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            link, self._link = self._link, None
        if link is not None:
            link.close()
        self._channel.close()


class StreamReturn:
    """The final stage's ReturnResults stream to the head (hop_transport "stream")."""

    def __init__(self, head: PeerConfig, *, stage_id: str, max_message_bytes: int,
                 credentials: Credentials | None = None) -> None:
        self.log = log.bind(stage_id=stage_id, head=head.stage_id, endpoint=head.endpoint)
        creds = credentials or Credentials()
        self._metadata = creds.call_metadata()
        self._channel = creds.channel(head.endpoint, channel_options(max_message_bytes))
        self._stub = pb_grpc.StageServiceStub(self._channel)
        self.round_trips = RoundTrips()
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue | None = None
        self._call: grpc.Future | None = None
        self._backoff = _Backoff()
        self._closed = False

    def _open(self) -> queue.SimpleQueue | None:
        with self._lock:
            if self._closed:
                return None
            if self._outbox is not None and self._call is not None and not self._call.done():
                return self._outbox
            if self._call is not None and self._call.done():
                self.log.warning("return stream to the head ended; reopening", error=_describe(self._call))
            if self._outbox is not None:
                self._outbox.put(None)  # ends the old stream's request iterator (and its thread)
                self._outbox = self._call = None
            if self._backoff.blocked():
                return None
            try:
                grpc.channel_ready_future(self._channel).result(timeout=CONNECT_TIMEOUT_S)
            except grpc.FutureTimeoutError:
                self._backoff.trip()
                self.log.warning("cannot reach the head for direct returns; relaying")
                return None
            outbox: queue.SimpleQueue = queue.SimpleQueue()

            def items(box: queue.SimpleQueue = outbox):
                while (item := box.get()) is not None:
                    yield item
            self._call = self._stub.ReturnResults.future(items(), metadata=self._metadata)
            self._outbox = outbox
            return outbox

    def probe(self, timeout_s: float) -> None:
        """Time one call of the head's health service over this link (``time_health_call``)."""
        time_health_call(self._health, self.round_trips, timeout_s)

    def send(self, key: str, outputs: Outputs) -> bool:
        outbox = self._open()
        if outbox is None:
            return False
        outbox.put(codec.returned_to_pb(key, outputs))
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._outbox is not None:
                self._outbox.put(None)
            if self._call is not None:
                self._call.cancel()
        self._channel.close()


class LocalReturn:
    """Outputs straight to a head in this process (stage logic tested without sockets)."""

    round_trips: RoundTrips | None = None  # no link to measure

    def __init__(self, head: HeadAbove) -> None:
        self.head = head

    def probe(self, timeout_s: float) -> None:
        pass

    def send(self, key: str, outputs: Outputs) -> bool:
        self.head.deliver_return(key, outputs)
        return True

    def close(self) -> None:
        pass


def time_health_call(health: health_pb2_grpc.HealthStub, round_trips: RoundTrips, timeout_s: float) -> None:
    """One call of the head's standard health service, timed into ``round_trips`` when answered
    (whatever it says): the return link's round trip. A head that does not answer adds nothing;
    the returns themselves notice a link that is down."""
    try:
        sent = time.perf_counter()
        health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=timeout_s)
        round_trips.add(time.perf_counter() - sent)
    except grpc.RpcError:
        pass


def _describe(call: grpc.Future) -> str:
    try:
        error = call.exception(timeout=0)
    except grpc.FutureCancelledError:
        return "cancelled"
    if error is None:
        return "closed by the head"
    return f"{error.code().name}: {error.details()}" if isinstance(error, grpc.RpcError) else repr(error)
