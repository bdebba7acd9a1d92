"""The TCP frame listener: the receiving end of ``hop_transport: "tcp"``.

Two kinds of connection arrive here (``FrameHello.purpose``): an upstream neighbour's frames
(any stage but the head), and the final stage's direct returns (the head). Each connection
has one thread, and that thread runs the frames it reads — no hand-off to a pool — so a
frame's compute starts as soon as its bytes are in.

It guards what the gRPC listener guards: the same TLS and mutual TLS (Python's ``ssl`` with
the stage's files), the same bearer token (in the hello, compared in constant time), the
same message size limit, a bounded number of connections, a deadline on the handshake,
and hostile bytes answered with INVALID_ARGUMENT on the back channel, never a crash.

A frame link is a peer (``peers``): it owns the sessions its frames open, which end with it
here and, by a drop sent in band, on every stage below; one that is not the chain's own holds
at most ``peer_session_cap`` of them with the other such links from its host.
"""

from __future__ import annotations

import hmac
import socket
import ssl
import threading
from collections.abc import Callable

import grpc
import structlog

from skippy_stage import tracing
from skippy_stage.errors import ConfigError, InvalidRequestError
from skippy_stage.stage import codec, framing, native_frames
from skippy_stage.stage.peers import Peer
from skippy_stage.stage.stage import Stage
from skippy_stage.stage.steps import Reply
from skippy_stage.stage.upstream import error_reply
from skippy_stage.v1 import stage_pb2 as pb

log = structlog.get_logger("skippy_stage.listener")

MAX_CONNECTIONS = 64
# Frames run together at most (the n_batch budget splits them further).
MAX_COALESCED = 16


def _back_channel(link: framing.FrameSocket) -> Callable[[Reply], None]:
    """Sends one Reply up ``link``; never raises."""
    def send(reply: Reply) -> None:
        try:
            link.send(framing.Kind.HOP_REPLY, codec.reply_to_pb(reply))
        except framing.LinkClosed:
            pass  # the upstream is gone; it fails its own steps
    return send


def _welcome(link: framing.FrameSocket, code: grpc.StatusCode, message: str, stage_id: str) -> None:
    try:
        link.send(framing.Kind.WELCOME, pb.FrameWelcome(code=code.value[0], message=message, stage_id=stage_id))
    except framing.LinkClosed:
        pass


class FrameListener:
    def __init__(self, stage: Stage, host: str, port: int) -> None:
        self.stage = stage
        cfg = stage.config
        self.log = log.bind(stage_id=cfg.stage_id, run_id=cfg.run_id)
        self._ssl = framing.server_ssl_context(stage.credentials)
        self._token = stage.credentials.token
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._sock = socket.create_server((host, port), family=family, backlog=64)
        except OSError as exc:
            raise ConfigError(f"stage {cfg.stage_id}: cannot bind the frame listener on {host}:{port} "
                              f"(frame_port={cfg.frame_port}): {exc.strerror}") from exc
        self.port = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._links: set[framing.FrameSocket] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="frame-listener", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                self.log.warning("frame connection refused: too many", peer=str(peer), limit=MAX_CONNECTIONS)
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="frame-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        link: framing.FrameSocket | None = None
        try:
            framing.tune(conn)
            conn.settimeout(framing.HANDSHAKE_TIMEOUT_S)
            sock = self._ssl.wrap_socket(conn, server_side=True) if self._ssl is not None else conn
            link = framing.FrameSocket(sock, max_message_bytes=self.stage.max_message_bytes)
            hello = self._handshake(link)
            if hello is None:
                return
            sock.settimeout(None)
            with self._lock:
                if self._closed:
                    return
                self._links.add(link)
            if hello.purpose == pb.FrameHello.PURPOSE_HOP:
                self._frames(link, self.stage.peers.connect(hello.stage_id, str(peer[0]), _back_channel(link)))
            else:
                self._returns(link)
        except (ssl.SSLError, OSError, framing.LinkClosed, InvalidRequestError) as exc:
            self.log.info("frame connection ended", peer=str(peer), reason=str(exc))
        finally:
            if link is not None:
                with self._lock:
                    self._links.discard(link)
                link.close()
            else:
                conn.close()
            self._slots.release()

    def _handshake(self, link: framing.FrameSocket) -> pb.FrameHello | None:
        cfg = self.stage.config
        kind, body = link.receive()
        hello = framing.parse(kind, body, framing.Kind.HELLO)
        refusal = None
        if self._token is not None and not hmac.compare_digest(hello.token.encode(), self._token.encode()):
            refusal = grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token in the frame hello"
        elif hello.version != framing.FRAME_VERSION:
            refusal = (grpc.StatusCode.FAILED_PRECONDITION,
                       f"frame hello version={hello.version}; stage {cfg.stage_id} speaks {framing.FRAME_VERSION}")
        elif hello.purpose == pb.FrameHello.PURPOSE_HOP and cfg.include_embeddings:
            refusal = (grpc.StatusCode.FAILED_PRECONDITION,
                       f"stage {cfg.stage_id} takes no frames (layer_start=0); it is the head")
        elif hello.purpose == pb.FrameHello.PURPOSE_RETURN and not cfg.include_embeddings:
            refusal = (grpc.StatusCode.FAILED_PRECONDITION,
                       f"stage {cfg.stage_id} is not the head (layer_start={cfg.layer_start}); returns go to stage 0")
        elif hello.purpose not in (pb.FrameHello.PURPOSE_HOP, pb.FrameHello.PURPOSE_RETURN):
            refusal = grpc.StatusCode.INVALID_ARGUMENT, f"frame hello purpose={hello.purpose} is not HOP or RETURN"
        if refusal is not None:
            self.stage.metrics.requests(rpc="FrameHello", code=refusal[0].name).inc()
            self.log.info("frame connection refused", from_stage=hello.stage_id[:256], code=refusal[0].name)
            _welcome(link, *refusal, cfg.stage_id)
            return None
        _welcome(link, grpc.StatusCode.OK, "", cfg.stage_id)
        self.log.info("frame link open", from_stage=hello.stage_id[:256],
                      purpose=pb.FrameHello.Purpose.Name(hello.purpose))
        return hello

    def _frames(self, link: framing.FrameSocket, sink: Peer) -> None:
        """Frames from the upstream neighbour, run on this thread in the order they come; the
        sessions they opened are freed here and below once the link ends."""
        stage = self.stage
        if not sink.chain:
            self.log.info("frame link is not the chain's own: its host's sessions are capped", peer_host=sink.host,
                          from_stage=sink.name[:256], peer_session_cap=sink.quota.limit)
        stage.inbound.add(sink)
        native = stage.native
        # Where the frame path is compiled, a plain link is read in C too, and its plain frames run
        # there as they come (``NativeFrames.serve``): this loop sees only what they hand back.
        reads = (native_frames.link_reader(link) if native is not None else None) or link
        served = reads is not link
        try:
            while True:
                frames = []
                drops = None
                # Whatever has arrived by the time this thread is free runs as one decode.
                while drops is None and (not frames or (len(frames) < MAX_COALESCED and reads.readable())):
                    try:
                        kind, body = native.serve(reads, sink) if served and not frames else reads.receive()
                        tracing.mark("recv")
                    except InvalidRequestError as exc:
                        # Too large to read: the link is out of step. Say why, then close it.
                        sink(error_reply(exc, return_key="", session_ids=[], stage_id=stage.config.stage_id))
                        if frames:
                            stage.accept_frames(frames, sink)
                        raise
                    # A frame alone on the link may take the compiled path (frames that came
                    # together are coalesced in Python instead; a served link's took it already).
                    if (native is not None and not served and not frames and kind == framing.Kind.HOP_REQUEST
                            and not reads.readable() and native.run(body, sink)):
                        tracing.mark("done")
                        continue
                    try:
                        hop = framing.parse(kind, body, framing.Kind.HOP_REQUEST)
                        # Sessions let go of above: after the frames before, before those after.
                        drops = codec.released_from_pb(hop)
                        if drops is None:
                            frames.append(codec.frame_from_pb(hop))
                    except InvalidRequestError as exc:
                        stage.metrics.requests(rpc="Frame", code="INVALID_ARGUMENT").inc()
                        sink(error_reply(exc, return_key="bad-frame", session_ids=[], stage_id=stage.config.stage_id))
                        if not frames:
                            continue
                        break
                if frames:
                    tracing.mark("parsed")
                    stage.accept_frames(frames, sink)
                    tracing.mark("done")
                if drops is not None:
                    stage.take_release(drops, sink)
        finally:
            stage.inbound.discard(sink)
            stage.peer_closed(sink)

    def _returns(self, link: framing.FrameSocket) -> None:
        """The final stage's outputs, straight to the head's waiting steps."""
        returns = self.stage.returns
        # A plain link is read in C, where the lone generation's tokens are taken without the GIL.
        reader = native_frames.return_reader(link) if returns.lone is not None else None
        while True:
            kind, body = link.receive() if reader is None else native_frames.read(reader, returns.lone)
            tracing.mark("rrecv")
            try:
                batch = framing.parse(kind, body, framing.Kind.RETURNED_BATCH)
            except InvalidRequestError as exc:
                self.stage.metrics.requests(rpc="FrameReturn", code="INVALID_ARGUMENT").inc()
                self.log.warning("undecodable return dropped", error=str(exc))
                continue
            self.stage.deliver_return(batch.return_key, codec.outputs_from_pb(batch.response))
            tracing.mark("rdeliv")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links, self._links = list(self._links), set()
        self._sock.close()
        for link in links:
            link.close()
