"""Who may hold a stage's lanes: the data plane admits its own chain, and bounds everyone else.

**A peer is one upstream connection**: a TCP frame link (``listener``) or one gRPC
``ActivationStream`` call (``server.service``). It is the unit whose end a stage can see, so it is
the unit that owns sessions: every session opened over it is its own (``LaneTable`` marks the
owner), and when it closes, for whatever reason (a clean close, a crash, a reset, the keepalive
giving up on a silent host after ``framing.LINK_TIMEOUT_S``), the stage frees the sessions it
still owns and passes the drop down its own edge, in order with the frames it sent there
(``HopRequest.drop_session_ids``): the stage below frees those its edge owns and passes them on.
In band, because a drop sent beside the link (a DropSession call) could overtake a frame still on
it, which would then open the session again below with nobody left to free it.

**The chain's own upstream is one connection per edge.** The head opens one link to stage 1
(``hops.TcpHop``, or one ``StreamHop`` stream), carrying every session of every client, and each
stage one link to the next; a link that broke is reopened by the next frame, and a switch to a
stand-in (``downstream_alternates``, a hand-off) opens the stand-in's. So the chain's peer must be
able to hold every lane, while anyone else is held to ``peer_session_cap``. A connection is the
chain's when it proves it: the stage has a bearer token (``auth_token_path``: a connection that
got in presented it, in its ``FrameHello`` or the call's metadata) or mutual TLS (``tls_ca_path``:
it presented a certificate of the chain's CA). Without either, the only thing that tells the
chain apart is the name it gives: the hello's (or the stream's ``skippy-stage-id-bin``) stage id
equal to this stage's ``upstream.stage_id``. A name is not a credential — a stranger that knows
it passes as the chain — which is why a stage that other hosts can reach must have a token or TLS
(``check_exposure``, Redis's protected mode) and loopback is the default bind.

**Everyone else is capped by address**, not by connection: all the sessions that connections from
one remote host hold while not recognised share one :class:`~skippy_stage.model.lanes.Quota` of
``peer_session_cap`` (unset: a quarter of ``lane_count``, at least 1), so a stranger gains nothing
by opening more connections. A stand-in for this stage's upstream with a stage id of its own is
such a peer unless the chain has a token: give the chain a token (or the stand-in the upstream's
stage id) where stand-ins carry real load.

**Recovery and hand-offs.** The head never reuses a session id after a failure (it re-prefills
under a new one and drops the old ids), so freeing on close never races a recovery; it only means
a link that broke takes its sessions with it on every stage below, where before they waited for
the head's drop or the idle TTL. A hand-off moves live sessions to a stand-in and leaves the stages
below it holding them under the drained stage's link: a session fed over another connection moves
to that one (``LaneTable.admit``), so the stand-in's first frame for each takes it over long before
the drained stage stops and closes its link (a session it has not fed by then is freed below, and
the head re-prefills it, as for any session that could not move). Resident prefixes belong to the
stage, not to a connection: they are not freed on close, and live work evicts them anyway.

What this does not cover: sessions opened by unary calls (``IterationBatch``, ``ActivationFrame``,
``Decode``, ``ImportSession``) have no connection to end with; they live until ``DropSession`` or
``session_idle_ttl_s``, and only the token keeps strangers from making them.
"""

from __future__ import annotations

import ipaddress
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote

from skippy_stage.config import StageConfig
from skippy_stage.model.lanes import Quota
from skippy_stage.security import Credentials
from skippy_stage.stage.steps import Reply

# The gRPC metadata key under which a StreamHop names the stage that dials (binary: any stage id).
STAGE_ID_METADATA = "skippy-stage-id-bin"


def session_cap(cfg: StageConfig) -> int:
    """Sessions the connections of one remote host that are not the chain may hold together."""
    return cfg.peer_session_cap if cfg.peer_session_cap is not None else max(1, cfg.lane_count // 4)


def host_of(address: str) -> str:
    """The host of a socket address or a gRPC peer string (``ipv4:1.2.3.4:5``, ``ipv6:%5B::1%5D:5``),
    IPv4-mapped IPv6 written as IPv4, so one host is one key."""
    text = unquote(address)
    scheme, sep, rest = text.partition(":")
    if sep and scheme in ("ipv4", "ipv6", "unix", "unix-abstract"):
        if scheme.startswith("unix"):
            return "local"
        text = rest.rpartition(":")[0] if rest.count(":") == 1 or rest.startswith("[") else rest
    text = text.strip("[]")
    try:
        ip = ipaddress.ip_address(text.split("%")[0])
    except ValueError:
        return text or "unknown"
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


@dataclass(eq=False)
class Peer:
    """One upstream connection: the owner of the sessions opened over it, and the back channel of
    its edge (calling it sends one Reply up the connection, and never raises)."""

    name: str  # the stage id it gave (may be empty, and is only a claim)
    host: str
    quota: Quota | None  # None: the chain's own, which may hold every lane
    send: Callable[[Reply], None]

    def __call__(self, reply: Reply) -> None:
        self.send(reply)

    @property
    def chain(self) -> bool:
        return self.quota is None


class Peers:
    """A stage's rule for the connections that bring it frames: the chain's own, or capped by host."""

    def __init__(self, cfg: StageConfig, credentials: Credentials) -> None:
        self.cfg = cfg
        # A connection that got in proved itself: it presented the token, or a certificate of the CA.
        self._proven = bool(credentials.token) or credentials.ca is not None
        self._lock = threading.Lock()
        self._quotas: weakref.WeakValueDictionary[str, Quota] = weakref.WeakValueDictionary()

    def connect(self, name: str, address: str, send: Callable[[Reply], None]) -> Peer:
        """The peer for a connection from ``address`` whose hello (or metadata) gave ``name``."""
        host = host_of(address)
        upstream = self.cfg.upstream
        if self._proven or (upstream is not None and name == upstream.stage_id):
            return Peer(name, host, None, send)
        with self._lock:
            quota = self._quotas.get(host)
            if quota is None:
                expected = f"upstream {upstream.stage_id!r}" if upstream is not None else "no upstream (unset)"
                quota = Quota(session_cap(self.cfg),
                              f"connections from {host} that are not stage {self.cfg.stage_id}'s chain (no token or "
                              f"mutual TLS, and their hello does not name its {expected})",
                              f"peer_session_cap={self.cfg.peer_session_cap!r}")
                self._quotas[host] = quota
        return Peer(name, host, quota, send)
