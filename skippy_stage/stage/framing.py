"""The TCP frame transport's wire format: length-prefixed protobuf messages on a socket.

``bench`` measured a 2304-byte frame to another process and back at ~30 us over a bare TCP
socket against ~350 us over a grpcio bidi stream, so frames between stages default to this
(``hop_transport: "tcp"``); the gRPC ActivationStream stays the service's contract and
fallback. The messages are the same protobufs either way, so both paths share one
validator. A message on the socket is::

    u32 big-endian length N | u8 kind | N-1 bytes of the serialised message

The first message a dialler sends is a :class:`FrameHello` (purpose, bearer token), answered
by a :class:`FrameWelcome`; a refusal is followed by the listener closing the connection.
TLS, when the stage has certificates, wraps the socket before the hello (Python's ``ssl``
with the same files as gRPC's listener). Sockets get keepalive and TCP_USER_TIMEOUT so a
silent peer (a pulled cable) is noticed within ``LINK_TIMEOUT_S`` even while frames wait
unacknowledged.
"""

from __future__ import annotations

import enum
import socket
import ssl
import struct
import threading

from skippy_stage import tracing
from skippy_stage.errors import InvalidRequestError
from skippy_stage.security import Credentials
from skippy_stage.v1 import stage_pb2 as pb

FRAME_VERSION = 1
_HEADER = struct.Struct(">IB")
# A silent peer is given up after this long (keepalive probes and unacknowledged sends).
LINK_TIMEOUT_S = 10.0
# How long a dialler may take to finish TLS and send its hello.
HANDSHAKE_TIMEOUT_S = 10.0


class Kind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    HOP_REQUEST = 3
    HOP_REPLY = 4
    RETURNED_BATCH = 5


MESSAGE_TYPES = {
    Kind.HELLO: pb.FrameHello,
    Kind.WELCOME: pb.FrameWelcome,
    Kind.HOP_REQUEST: pb.HopRequest,
    Kind.HOP_REPLY: pb.HopReply,
    Kind.RETURNED_BATCH: pb.ReturnedBatch,
}


class LinkClosed(Exception):
    """The peer closed the connection, or it broke (the message says how)."""


def tune(sock: socket.socket) -> None:
    """No Nagle delay on small frames; notice a dead or unreachable peer within LINK_TIMEOUT_S."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 4), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", int(LINK_TIMEOUT_S * 1000))):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def encode(kind: Kind, message) -> bytes:  # message: one of MESSAGE_TYPES
    body = message.SerializeToString()
    return _HEADER.pack(len(body) + 1, kind) + body


# Bytes asked of the socket per read: whatever has arrived, up to this, in one system call.
_READ_CHUNK = 1 << 16


class FrameSocket:
    """One connected socket: whole messages in and out. Sends are serialised by a lock
    (several threads may send on one link); reading belongs to one thread.

    Reads are buffered: one ``recv`` takes whatever has arrived, so a frame usually costs one
    system call (a header then a body took two, and asking whether another had come a third),
    and messages that arrived together are known to be there without asking the kernel.
    """

    def __init__(self, sock: socket.socket, *, max_message_bytes: int) -> None:
        self.sock = sock
        self.max_message_bytes = max_message_bytes
        self.send_lock = threading.Lock()
        self._inbox = bytearray()  # read from the socket, not yet returned

    def send(self, kind: Kind, message) -> None:
        data = encode(kind, message)
        tracing.mark("enc")
        try:
            with self.send_lock:
                self.sock.sendall(data)
        except OSError as exc:
            raise LinkClosed(f"send failed: {exc}") from exc

    def _fill(self, need: int) -> None:
        """Read until ``need`` bytes are buffered: small reads take whatever has arrived; the
        rest of a large body is read straight into its place."""
        inbox = self._inbox
        while len(inbox) < need:
            if need - len(inbox) > _READ_CHUNK:
                self._fill_in_place(need)
                return
            try:
                chunk = self.sock.recv(_READ_CHUNK)
            except OSError as exc:
                raise LinkClosed(f"receive failed: {exc}") from exc
            if not chunk:
                raise LinkClosed("closed by the peer")
            inbox += chunk

    def _fill_in_place(self, need: int) -> None:
        inbox = self._inbox
        got = len(inbox)
        inbox += bytes(need - got)
        try:
            with memoryview(inbox) as view:
                while got < need:
                    k = self.sock.recv_into(view[got:need])
                    if k == 0:
                        raise LinkClosed("closed by the peer")
                    got += k
        except OSError as exc:
            raise LinkClosed(f"receive failed: {exc}") from exc
        finally:
            del inbox[got:]

    def _length(self) -> int:
        """The buffered next message's length field, checked (the header must be buffered)."""
        length, _ = _HEADER.unpack_from(self._inbox)
        if length == 0:
            raise InvalidRequestError("frame message length is 0 (it must include the kind byte)")
        if length - 1 > self.max_message_bytes:
            raise InvalidRequestError(f"frame message of {length - 1} bytes exceeds max_message_bytes="
                                      f"{self.max_message_bytes}")
        return length

    def receive(self) -> tuple[int, bytes]:
        """The next message's kind and body; InvalidRequestError for one too large to read
        (the link is then out of step and must be closed), LinkClosed when it ends."""
        self._fill(_HEADER.size)
        end = _HEADER.size - 1 + self._length()
        self._fill(end)
        inbox = self._inbox
        with memoryview(inbox) as view:
            kind, body = inbox[_HEADER.size - 1], bytes(view[_HEADER.size:end])
        del inbox[:end]
        return kind, body

    def readable(self) -> bool:
        """Whether a whole message is here already (so a receive would not wait for the peer).
        Only what one read brought in counts: a message still arriving is waited for by the
        next receive, not by the ones already here."""
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending() > 0:
            try:  # decrypted already: taking it cannot wait for the peer
                self._inbox += self.sock.recv(self.sock.pending())
            except (OSError, ValueError):
                return True  # the receive says what went wrong
        if len(self._inbox) < _HEADER.size:
            return False
        try:
            return len(self._inbox) >= _HEADER.size - 1 + self._length()
        except InvalidRequestError:
            return True  # the receive says what is wrong with it

    def close(self) -> None:
        """Shut the connection down, then close the descriptor under the send lock. The C frame
        path sends on the raw descriptor without the GIL, holding the send lock: closed meanwhile,
        its number could be handed to a new socket and take the rest of a frame meant for this
        link. The shutdown ends a send blocked on a peer that stopped reading (so the lock comes
        free) and a read in progress; the C reader reads its own duplicate of the descriptor."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self.send_lock:
            self.sock.close()


def plain(link: FrameSocket | None) -> FrameSocket | None:
    """``link`` when it is live on a plain socket (no TLS), which the native frame path writes to
    directly; else None."""
    return link if link is not None and not isinstance(link.sock, ssl.SSLSocket) else None


def parse(kind: int, body: bytes, expected: Kind):
    """The message of ``body``, which must be of kind ``expected``; InvalidRequestError naming
    what was wrong otherwise (the link stays usable: the length prefix kept it in step)."""
    if kind != expected:
        name = Kind(kind).name if kind in Kind._value2member_map_ else str(kind)
        raise InvalidRequestError(f"frame message kind={name} is not accepted here (expected {expected.name})")
    try:
        return MESSAGE_TYPES[expected].FromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, and anything else a corrupt body raises
        raise InvalidRequestError(f"frame message of kind {expected.name} does not parse: {exc}") from None


def server_ssl_context(creds: Credentials) -> ssl.SSLContext | None:
    """The listener's TLS context (None without a certificate): mutual TLS with a CA."""
    if creds.cert is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, creds)
    if creds.ca is not None:
        ctx.load_verify_locations(cadata=creds.ca.decode())
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_ssl_context(creds: Credentials) -> ssl.SSLContext | None:
    """A dialler's TLS context (None without TLS): trusts the CA, presents the certificate."""
    if not creds.tls:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if creds.ca is not None:
        ctx.load_verify_locations(cadata=creds.ca.decode())
    else:
        ctx.load_default_certs()
    if creds.cert is not None:
        _load_chain(ctx, creds)
    return ctx


def _load_chain(ctx: ssl.SSLContext, creds: Credentials) -> None:
    # ssl loads certificates only from files; the bytes were read (and checked) at start.
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="skippy-tls-") as tmp:
        cert, key = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        with open(cert, "wb") as f:
            f.write(creds.cert)
        with os.fdopen(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(creds.key or b"")
        ctx.load_cert_chain(cert, key)


def dial(host: str, port: int, *, creds: Credentials, purpose: int, stage_id: str, max_message_bytes: int,
         timeout_s: float) -> FrameSocket:
    """Connect, secure, say hello and read the welcome; LinkClosed or ConnectionRefused-like
    OSError on the way, and :class:`Refused` when the listener answers no."""
    raw = socket.create_connection((host, port), timeout=timeout_s)
    try:
        tune(raw)
        ctx = client_ssl_context(creds)
        sock = ctx.wrap_socket(raw, server_hostname=host) if ctx is not None else raw
        link = FrameSocket(sock, max_message_bytes=max_message_bytes)
        link.send(Kind.HELLO, pb.FrameHello(version=FRAME_VERSION, purpose=purpose, token=creds.token or "",
                                            stage_id=stage_id))
        kind, body = link.receive()
        welcome = parse(kind, body, Kind.WELCOME)
    except BaseException:
        raw.close()
        raise
    if welcome.code != 0:
        link.close()
        raise Refused(welcome.message or f"refused with code {welcome.code}", welcome.code)
    sock.settimeout(None)
    return link


class Refused(Exception):
    """The listener answered the hello with an error (bad token, wrong purpose, version)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code
