"""How a frame leaves a stage for the next one: the ``Hop`` interface and its transports.

Frames flow one way. ``Hop.send`` hands a frame to the transport and returns: nothing
answers a frame that went well (the final stage sends its outputs to the head). What
comes back on an edge is its back channel — errors, and outputs that are relayed — and
every message of it goes to ``on_reply``, called on the transport's reader thread. When
a link that was up breaks, ``on_broken`` hears it once: every frame in flight through it
is lost, and the stage tells those above it.

Transports:

* :class:`TcpHop` — a length-prefixed TCP connection (``framing``) to the neighbour's frame
  listener; the default, because ``bench`` measures its floor far below gRPC's.
* :class:`StreamHop` — the gRPC ``ActivationStream``, the service's contract and fallback.
* :class:`LocalHop` — a stage in this process, called on the sender's thread: stage logic
  tested without sockets.

Failures become :class:`DownstreamError` naming the neighbour here and nowhere else.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from skippy_stage import tracing
from skippy_stage.config import PeerConfig
from skippy_stage.errors import DownstreamError, InvalidRequestError
from skippy_stage.security import Credentials
from skippy_stage.stage import codec, framing
from skippy_stage.stage.ports import StageBelow
from skippy_stage.stage.steps import Frame, Reply
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

OnReply = Callable[[Reply], None]
OnBroken = Callable[[DownstreamError], None]


class Hop(Protocol):
    """One edge towards the downstream."""

    def send(self, frame: Frame) -> None:
        """Hand the frame to the transport; DownstreamError (UNAVAILABLE) when the link cannot be had."""

    def release(self, session_ids: list[str], *, moved: bool = False, retired: bool = False) -> None:
        """Drop sessions this edge opened below, in order with the frames sent before (a
        ``HopRequest.drop_session_ids``), or with ``moved`` let go of them without ending them
        (``moved_session_ids``: a stand-in's edge feeds them now), or with ``retired`` end them but
        keep their KV as resident prefixes (``retire_session_ids``); nothing when no link is up (a
        link's end frees its sessions below by itself). Never raises."""

    def close(self) -> None: ...


class TcpHop:
    """Frames over a TCP connection to the downstream's frame listener.

    The connection opens on the first frame (the port is looked up over gRPC each time a link
    is opened, since a restarted neighbour may listen elsewhere) and reopens on the first
    frame after it broke. One reader thread per link turns back-channel messages into
    ``on_reply`` calls.
    """

    def __init__(self, peer: PeerConfig, *, port: Callable[[], int], credentials: Credentials, stage_id: str,
                 max_message_bytes: int, connect_timeout_s: float, on_reply: OnReply, on_broken: OnBroken) -> None:
        self.peer = peer
        self.host = peer.endpoint.rpartition(":")[0].strip("[]")
        self._port = port
        self._creds = credentials
        self._stage_id = stage_id
        self._max = max_message_bytes
        self._connect_timeout_s = connect_timeout_s
        self._on_reply = on_reply
        self._on_broken = on_broken
        self._lock = threading.Lock()
        self._link: framing.FrameSocket | None = None
        self._closed = False

    def _error(self, what: str) -> DownstreamError:
        return DownstreamError(f"stage {self.peer.stage_id} at {self.peer.endpoint} failed: UNAVAILABLE: {what}",
                               stage_id=self.peer.stage_id)

    def _connect(self) -> framing.FrameSocket:
        with self._lock:
            if self._closed:
                raise self._error("the link is closed")
            if self._link is not None:
                return self._link
            try:
                port = self._port()
                link = framing.dial(self.host, port, creds=self._creds, purpose=pb.FrameHello.PURPOSE_HOP,
                                    stage_id=self._stage_id, max_message_bytes=self._max,
                                    timeout_s=self._connect_timeout_s)
            except DownstreamError:
                raise
            except framing.Refused as exc:
                # A wrong token, version or purpose: the two stages are configured apart.
                raise DownstreamError(f"stage {self.peer.stage_id} refused the frame link: {exc}",
                                      stage_id=self.peer.stage_id, code_name="FAILED_PRECONDITION") from None
            except (OSError, framing.LinkClosed, InvalidRequestError) as exc:
                raise self._error(f"cannot open the frame link: {exc}") from None
            self._link = link
            threading.Thread(target=self._read, args=(link,), name="hop-tcp-reader", daemon=True).start()
            return link

    @property
    def plain_link(self) -> framing.FrameSocket | None:
        """The live link on a plain socket (``framing.plain``); None until the first frame has opened it."""
        return framing.plain(self._link)

    def broke(self, link: framing.FrameSocket, detail: str) -> DownstreamError:
        """A send on ``link`` failed: drop it (stages above hear of it); the error for the frame."""
        self._broke(link, detail)
        return self._error(detail)

    def send(self, frame: Frame) -> None:
        link = self._connect()
        try:
            tracing.mark("s0")
            link.send(framing.Kind.HOP_REQUEST, codec.frame_to_pb(frame))
            tracing.mark("s1")
        except framing.LinkClosed as exc:
            raise self.broke(link, str(exc)) from None

    def release(self, session_ids: list[str], *, moved: bool = False, retired: bool = False) -> None:
        link = self._link
        if link is None:
            return
        try:
            link.send(framing.Kind.HOP_REQUEST, _release(session_ids, moved, retired))
        except framing.LinkClosed as exc:
            self._broke(link, str(exc))

    def _read(self, link: framing.FrameSocket) -> None:
        detail = "closed by the peer"
        try:
            while True:
                kind, body = link.receive()
                try:
                    reply = framing.parse(kind, body, framing.Kind.HOP_REPLY)
                except InvalidRequestError as exc:
                    detail = f"sent a message that is not a HopReply: {exc}"
                    break
                self._on_reply(codec.reply_from_pb(reply))
        except (framing.LinkClosed, InvalidRequestError) as exc:
            detail = str(exc)
        self._broke(link, detail)

    def _broke(self, link: framing.FrameSocket, detail: str) -> None:
        with self._lock:
            if self._link is not link:
                return  # already noticed (by the other side of the same link)
            self._link = None
            closed = self._closed
        link.close()
        if not closed:
            self._on_broken(self._error(f"frame link broke: {detail}"))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            link, self._link = self._link, None
        if link is not None:
            link.close()


class _StreamClosed(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "activation stream closed"


class StreamHop:
    """Frames over one long-lived gRPC ActivationStream; reopened on the frame after a break."""

    def __init__(self, peer: PeerConfig, stub: pb_grpc.StageServiceStub, metadata, *,
                 translate: Callable[[grpc.RpcError], DownstreamError], on_reply: OnReply,
                 on_broken: OnBroken) -> None:
        self.peer = peer
        self._stub = stub
        self._metadata = metadata
        self._translate = translate
        self._on_reply = on_reply
        self._on_broken = on_broken
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue | None = None
        self._closed = False

    def _open(self) -> queue.SimpleQueue:
        with self._lock:
            if self._closed:
                raise DownstreamError(f"stage {self.peer.stage_id}: the stream is closed", stage_id=self.peer.stage_id)
            if self._outbox is None:
                outbox: queue.SimpleQueue = queue.SimpleQueue()

                def requests():
                    while (item := outbox.get()) is not None:
                        yield item
                call = self._stub.ActivationStream(requests(), metadata=self._metadata)
                self._outbox = outbox
                threading.Thread(target=self._read, args=(call, outbox), name="hop-stream-reader",
                                 daemon=True).start()
            return self._outbox

    def send(self, frame: Frame) -> None:
        self._open().put(codec.frame_to_pb(frame))

    def release(self, session_ids: list[str], *, moved: bool = False, retired: bool = False) -> None:
        outbox = self._outbox
        if outbox is not None:
            outbox.put(_release(session_ids, moved, retired))

    def _read(self, call, outbox: queue.SimpleQueue) -> None:
        try:
            for reply in call:
                self._on_reply(codec.reply_from_pb(reply))
            error: grpc.RpcError = _StreamClosed()
        except grpc.RpcError as err:
            error = err
        outbox.put(None)
        with self._lock:
            if self._outbox is outbox:
                self._outbox = None
            closed = self._closed
        if not closed:
            self._on_broken(self._translate(error))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._outbox is not None:
                self._outbox.put(None)
                self._outbox = None


class LocalHop:
    """A downstream stage in this process: its frame runs on the sender's thread."""

    def __init__(self, peer: PeerConfig, target: StageBelow, *, on_reply: OnReply, on_broken: OnBroken) -> None:
        self.peer = peer
        self.target = target
        self._on_reply = on_reply
        self._on_broken = on_broken
        target.inbound.add(self._on_reply)

    def send(self, frame: Frame) -> None:
        if self.target.runtime is None:
            raise DownstreamError(f"stage {self.peer.stage_id} is not loaded", stage_id=self.peer.stage_id)
        self.target.accept_frame(frame, self._on_reply)

    def release(self, session_ids: list[str], *, moved: bool = False, retired: bool = False) -> None:
        if retired:
            self.target.retire_sessions(session_ids, None)
        elif not moved:  # frames from here open unowned sessions, which nothing needs to let go of
            self.target.release_sessions(session_ids, None)

    def close(self) -> None:
        self.target.inbound.discard(self._on_reply)


def _release(session_ids: list[str], moved: bool, retired: bool) -> pb.HopRequest:
    if retired:
        return pb.HopRequest(retire_session_ids=session_ids)
    return pb.HopRequest(moved_session_ids=session_ids) if moved else pb.HopRequest(drop_session_ids=session_ids)


def stamp(frame: Frame) -> Frame:
    """Mark the moment the frame is handed to its transport (the receiver's hop latency)."""
    frame.sent_unix_ns = time.time_ns()
    return frame
