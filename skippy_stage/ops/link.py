"""A link emulator in user space: TCP relays that add a one-way delay, jitter and a bandwidth cap.

The kernel's netem is not available on the hosts this project is measured on, so a split over a
real link (a rack, a LAN, another site) is emulated here, on loopback: every edge of a chain runs
through a :class:`Relay` that holds each chunk of bytes for the configured time before passing it
on. It is a tool for the benchmark and the tests (``skippy-stage up --link-delay-ms``), never a
production path.

A :class:`Link` is the same in both directions. Per direction of a connection, a chunk read at
time ``t`` is written on at::

    sent = max(t, wire free) + n * 8 / (mbit * 1e6)      (with ``mbit``; else ``t``)
    due  = max(previous chunk's due, sent + delay_s + uniform(0, jitter_s))

so bytes are never reordered (jitter only ever delays them more), and a capped link serialises
chunks one after the other. The wire of one direction is shared by every connection of one
relay (an :class:`EdgeRelay` shares it across the ports of one edge, as one cable would).
End of stream travels the same way: a half-close arrives ``delay_s`` after it was seen. A reset
or error on either side, or closing the relay, aborts the connection at once on both sides
(a reset, not an orderly end).

Precision is the point (the delays studied are 0.1 to 30 ms), so each direction of a connection
has a reader thread that stamps chunks as they come in and a writer thread that sleeps until
each one is due, in waits of microsecond resolution (``threading.Condition.wait``, with the
thread's timer slack cut to 1 ns on Linux); an event loop would round its timeouts to 1 ms. A
sleep of milliseconds on a virtual CPU still ends 0.1-0.3 ms late, so the writer sleeps until a
margin before the chunk is due (learnt from how late its sleeps end) and polls from there.

A chain's edges (frames down from stage i to stage i+1, the final stage's direct return to the
head) are relayed by :func:`relay_chain`. A stage reaches its neighbour's TCP frame listener at
the port the neighbour advertises, on the host of the neighbour's endpoint, so each edge's relay
listens on a loopback address of its own (``127.0.0.2``, ``127.0.0.3``, ...) on the *same*
ports as the stage behind it: its gRPC port and its frame port (which must be fixed in its
config). Both transports then cross the relay without any stage knowing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import random
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import structlog

from skippy_stage.config import parse_endpoint
from skippy_stage.errors import SkippyError

log = structlog.get_logger("skippy_stage.link")

# Largest read from a socket at once: a chunk is delayed (and serialised) as a whole.
CHUNK_BYTES = 256 * 1024
# Bytes one direction of a connection holds before it stops reading (the sender's own TCP
# buffers then fill, as on a link whose bandwidth-delay product is full).
MAX_QUEUED_BYTES = 16 * 1024 * 1024
# How long a relay tries to reach its target for each connection it accepts.
CONNECT_TIMEOUT_S = 5.0
# How long close() waits for each connection's threads to end.
CLOSE_TIMEOUT_S = 2.0

# A thread waking from a sleep of milliseconds on a virtual CPU is often 0.1-0.3 ms late (the
# 2-vCPU hosts), far beyond the precision wanted: a writer sleeps until a margin before a chunk is
# due and polls from there. The margin follows how late its sleeps end (twice the running mean),
# within these bounds.
MIN_MARGIN_S = 50e-6
MAX_MARGIN_S = 2e-3

_PR_SET_TIMERSLACK = 29


@dataclass(frozen=True)
class Link:
    """One emulated link, the same in both directions."""

    delay_s: float = 0.0
    """Fixed one-way delay added to every chunk."""
    jitter_s: float = 0.0
    """Extra one-way delay drawn uniformly from [0, jitter_s] per chunk (never reordering bytes)."""
    mbit: float | None = None
    """Bandwidth cap in Mbit/s (10^6 bits); unset: no cap."""

    def __post_init__(self) -> None:
        for name in ("delay_s", "jitter_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < 3600:
                raise SkippyError(f"link {name}={value!r} must be a number of seconds >= 0")
        if self.mbit is not None and (not isinstance(self.mbit, (int, float)) or not self.mbit > 0):
            raise SkippyError(f"link mbit={self.mbit!r} must be > 0 (or unset: no cap)")

    @classmethod
    def from_ms(cls, delay_ms: float, jitter_ms: float = 0.0, mbit: float | None = None) -> Link:
        return cls(delay_s=delay_ms / 1000, jitter_s=jitter_ms / 1000, mbit=mbit)

    def describe(self) -> str:
        text = f"{self.delay_s * 1000:g} ms one-way"
        if self.jitter_s:
            text += f" + up to {self.jitter_s * 1000:g} ms jitter"
        if self.mbit is not None:
            text += f", {self.mbit:g} Mbit/s"
        return text


class _Wire:
    """One direction of a link's bandwidth: when it is next free. Shared by the connections of a relay."""

    def __init__(self, mbit: float | None) -> None:
        self._s_per_byte = 8 / (mbit * 1e6) if mbit else 0.0
        self._lock = threading.Lock()
        self._free_at = 0.0

    def occupy(self, now: float, n_bytes: int) -> float:
        """Put ``n_bytes`` on the wire at ``now`` (after whatever is on it); when they are all sent."""
        if not self._s_per_byte:
            return now
        with self._lock:
            self._free_at = max(self._free_at, now) + n_bytes * self._s_per_byte
            return self._free_at


def _fine_timer_slack() -> None:
    """This thread's sleeps end within about a microsecond of their deadline (Linux; the default
    slack lets the kernel wake it up to 50 us late)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Direction:
    """Bytes from ``src`` to ``dst``, each chunk held until it is due."""

    def __init__(self, conn: _Connection, src: socket.socket, dst: socket.socket, wire: _Wire) -> None:
        self.conn = conn
        self.src = src
        self.dst = dst
        self.wire = wire
        self.cond = threading.Condition()
        self.queue: deque[tuple[float, bytes | None]] = deque()  # (due, chunk); None: end of stream
        self.queued_bytes = 0
        self.last_due = 0.0
        self.sending = False
        self.margin_s = MIN_MARGIN_S * 2  # learnt: see _next

    def read(self) -> None:
        link = self.conn.link
        rng = self.conn.rng
        try:
            while True:
                data = self.src.recv(CHUNK_BYTES)
                now = time.monotonic()
                with self.cond:
                    if self.conn.aborted:
                        return
                    if data:
                        sent = self.wire.occupy(now, len(data))
                        jitter = rng.uniform(0.0, link.jitter_s) if link.jitter_s else 0.0
                        due = max(self.last_due, sent + link.delay_s + jitter)
                    else:
                        due = max(self.last_due, now + link.delay_s)
                    self.last_due = due
                    if not self.queue:
                        self.cond.notify_all()  # a later chunk is never due before the head of the queue
                    self.queue.append((due, data or None))
                    self.queued_bytes += len(data)
                    if not data:
                        return
                    while self.queued_bytes > MAX_QUEUED_BYTES and not self.conn.aborted:
                        self.cond.wait()
        except OSError as exc:
            self.conn.abort(f"read: {exc}")
        finally:
            self.conn.thread_done()

    def _next(self) -> list[bytes | None] | None:
        """The chunks due now (waiting until the first is); None once the connection is aborted."""
        with self.cond:
            while True:
                if self.conn.aborted:
                    return None
                if not self.queue:
                    self.cond.wait()
                    continue
                due_at = self.queue[0][0]
                wait = due_at - time.monotonic()
                if wait <= 0:
                    break
                if wait > self.margin_s:
                    # Asleep until a margin before it is due; how late it woke sets the next margin.
                    if not self.cond.wait(wait - self.margin_s):
                        late = time.monotonic() - (due_at - self.margin_s)
                        self.margin_s = min(MAX_MARGIN_S, max(MIN_MARGIN_S, 0.9 * self.margin_s + 0.2 * late))
                else:
                    # Within the margin: poll, the lock (and the GIL) let go between polls.
                    self.cond.release()
                    try:
                        time.sleep(0)
                    finally:
                        self.cond.acquire()
            now = time.monotonic()
            due: list[bytes | None] = []
            while self.queue and self.queue[0][0] <= now:
                data = self.queue.popleft()[1]
                due.append(data)
                if data is None:
                    break
                self.queued_bytes -= len(data)
            self.cond.notify_all()  # a reader may be waiting for room
            self.sending = True
            return due

    def write(self) -> None:
        _fine_timer_slack()
        try:
            while True:
                chunks = self._next()
                if chunks is None:
                    return
                data = b"".join(c for c in chunks if c is not None)
                if data:
                    self.dst.sendall(data)
                self.sending = False
                if chunks[-1] is None:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
        except OSError as exc:
            self.conn.abort(f"write: {exc}")
        finally:
            self.sending = False
            self.conn.thread_done()


class _Connection:
    """One accepted connection and its connection to the target: two directions, four threads."""

    def __init__(self, relay: Relay, client: socket.socket) -> None:
        self.relay = relay
        self.link = relay.link
        self.rng = relay.rng
        self.client = client
        self.server: socket.socket | None = None
        self.aborted = False
        self._lock = threading.Lock()
        self._live = 0
        self.done = threading.Event()
        self.directions: list[_Direction] = []

    def start(self) -> None:
        """Reach the target and start pumping (on a thread of its own: a slow connect holds no one up)."""
        try:
            server = socket.create_connection(self.relay.target, timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            log.info("link relay cannot reach its target", target=self.relay.target_endpoint, reason=str(exc))
            self.server = None
            self.abort("connect")
            self._close()
            return
        server.settimeout(None)
        _tune(server)
        _tune(self.client)
        with self._lock:
            self.server = server
            if self.aborted:  # the relay closed while this connected
                self._close()
                return
            up, down = self.relay.wires
            self.directions = [_Direction(self, self.client, server, up), _Direction(self, server, self.client, down)]
            self._live = 4
        for d in self.directions:
            threading.Thread(target=d.read, name="link-read", daemon=True).start()
            threading.Thread(target=d.write, name="link-write", daemon=True).start()

    def abort(self, reason: str) -> None:
        """Reset both sides and wake every thread of this connection; idempotent."""
        with self._lock:
            if self.aborted:
                return
            self.aborted = True
            socks = [s for s in (self.client, self.server) if s is not None]
        log.debug("link connection reset", target=self.relay.target_endpoint, reason=reason)
        for sock in socks:
            with contextlib.suppress(OSError):
                # Closed with a zero linger time, the socket sends a reset rather than an end of stream.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RD)  # wakes a reader, sends nothing
        for d in self.directions:
            if d.sending:  # a writer blocked on a full socket wakes only when it is shut for writing
                with contextlib.suppress(OSError):
                    d.dst.shutdown(socket.SHUT_WR)
            with d.cond:
                d.cond.notify_all()

    def thread_done(self) -> None:
        with self._lock:
            self._live -= 1
            last = self._live == 0
        if last:
            self._close()

    def _close(self) -> None:
        for sock in (self.client, self.server):
            if sock is not None:
                sock.close()
        self.relay._forget(self)
        self.done.set()


class Relay:
    """Listens on ``listen`` and relays each connection to ``target`` through ``link``.

    ``wires``: the (to target, from target) bandwidth of a link this relay shares with others
    (:class:`EdgeRelay`); by default its own. ``seed``: the jitter's random sequence.
    """

    def __init__(self, target: tuple[str, int], link: Link, *, listen: tuple[str, int] = ("127.0.0.1", 0),
                 wires: tuple[_Wire, _Wire] | None = None, seed: int | None = None) -> None:
        self.target = target
        self.link = link
        self.wires = wires or (_Wire(link.mbit), _Wire(link.mbit))
        self.rng = random.Random(seed)
        family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
        try:
            self._sock = socket.create_server(listen, family=family, backlog=64)
        except OSError as exc:
            raise SkippyError(f"link relay cannot listen on {_endpoint(*listen)}: {exc.strerror}") from exc
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._lock = threading.Lock()
        self._connections: set[_Connection] = set()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="link-accept", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """Where to connect instead of the target (``host:port``)."""
        return _endpoint(*self.address)

    @property
    def target_endpoint(self) -> str:
        return _endpoint(*self.target)

    @property
    def connections(self) -> int:
        """Connections relayed now."""
        with self._lock:
            return len(self._connections)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn = _Connection(self, client)
            with self._lock:
                if self._closed:
                    client.close()
                    return
                self._connections.add(conn)
            threading.Thread(target=conn.start, name="link-connect", daemon=True).start()

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._connections.discard(conn)

    def close(self) -> None:
        """Stop listening and reset every connection relayed now."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live = list(self._connections)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._sock.close()
        for conn in live:
            conn.abort("the relay closed")
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for conn in live:
            conn.done.wait(max(0.0, deadline - time.monotonic()))
        self._thread.join(CLOSE_TIMEOUT_S)

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EdgeRelay:
    """One edge of a chain: the ports of the stage behind it, each relayed on ``listen_host`` at the
    same port number, all through one link (their bandwidth shared)."""

    def __init__(self, target_host: str, ports: Sequence[int], link: Link, *, listen_host: str,
                 seed: int | None = None) -> None:
        self.listen_host = listen_host
        self.link = link
        wires = (_Wire(link.mbit), _Wire(link.mbit))
        rng = random.Random(seed)
        self.relays: list[Relay] = []
        try:
            for port in ports:
                self.relays.append(Relay((target_host, port), link, listen=(listen_host, port), wires=wires,
                                         seed=rng.getrandbits(64)))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for relay in self.relays:
            relay.close()


@dataclass
class ChainRelays:
    """The relayed endpoints of a chain's edges (see :func:`relay_chain`); close it when the
    stages have stopped."""

    downstream: list[str]
    """``downstream[i]``: where stage i reaches stage i + 1."""
    return_to: str | None
    """Where the final stage reaches the head (direct return), or None."""
    edges: list[EdgeRelay]

    def close(self) -> None:
        for edge in self.edges:
            edge.close()

    def __enter__(self) -> ChainRelays:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def relay_chain(endpoints: Sequence[str], link: Link, *, frame_ports: Sequence[int | None] | None = None,
                direct_return: bool = True, seed: int | None = None) -> ChainRelays:
    """A relay for every edge of the chain whose stages listen at ``endpoints`` (stage order).

    ``frame_ports[j]``: stage j's TCP frame listener, relayed beside its gRPC port (None: not
    relayed; stage j must then take no frames over TCP). ``direct_return``: the final stage also
    sends to the head (the edge ``return_to``), which gets a relay of its own.
    """
    frame_ports = list(frame_ports) if frame_ports is not None else [None] * len(endpoints)
    if len(frame_ports) != len(endpoints):
        raise SkippyError(f"{len(frame_ports)} frame ports for {len(endpoints)} stages")
    targets = [parse_endpoint(e, stage_id=f"stage-{i}", field_name="endpoint") for i, e in enumerate(endpoints)]
    for i, target in enumerate(targets):
        try:
            address = ipaddress.ip_address(target.host)
        except ValueError:
            raise SkippyError(f"link emulation needs stages at IP addresses: stage {i} is at {endpoints[i]!r}") from None
        if address.is_unspecified:
            raise SkippyError(f"link emulation needs stages bound to one address, not {endpoints[i]!r}: "
                              f"its relay listens on another loopback address at the same ports")
    edges_to = list(range(1, len(targets)))  # edge i: stage i -> stage i + 1
    if direct_return and len(targets) > 1:
        edges_to.append(0)
    rng = random.Random(seed)
    hosts = _listen_hosts(len(edges_to), avoid={t.host for t in targets})
    edges: list[EdgeRelay] = []
    relayed: list[str] = []
    try:
        for host, j in zip(hosts, edges_to):
            ports = [targets[j].port] + ([frame_ports[j]] if frame_ports[j] else [])
            edges.append(EdgeRelay(targets[j].host, ports, link, listen_host=host, seed=rng.getrandbits(64)))
            relayed.append(_endpoint(host, targets[j].port))
    except BaseException:
        for edge in edges:
            edge.close()
        raise
    n_down = len(targets) - 1
    return ChainRelays(downstream=relayed[:n_down], return_to=relayed[n_down] if len(relayed) > n_down else None,
                       edges=edges)


def _listen_hosts(n: int, *, avoid: set[str]) -> list[str]:
    """``n`` loopback addresses 127.0.0.k (every 127.x.y.z reaches this host on Linux), none in ``avoid``."""
    hosts = [h for h in (f"127.0.0.{k}" for k in range(2, 255)) if h not in avoid][:n]
    if len(hosts) < n:
        raise SkippyError(f"link emulation relays at most {len(hosts)} edges, not {n}")
    return hosts


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
