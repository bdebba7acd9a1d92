"""The upstream edges as this stage sees them: their back channels, and which one a reply goes up.

Each upstream edge has a back channel, a :data:`Sink`: it carries errors, and outputs that are
relayed, up that edge. :class:`Inbound` holds the back channels of every upstream edge (an edge
that broke below is news to all of them); :class:`Routes` remembers which one each recent step
came down, so a reply from below goes back up the edge its frame came on. A back channel that is
a remote connection is also a :class:`~skippy_stage.stage.peers.Peer`: it owns the sessions its
frames open (``owner_of``).
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable

from skippy_stage.errors import DownstreamError, SkippyError
from skippy_stage.stage.peers import Peer
from skippy_stage.stage.status import status_for
from skippy_stage.stage.steps import Reply

# One upstream edge's back channel: sends one Reply up it and never raises.
Sink = Callable[[Reply], None]


class Inbound:
    """The back channels of this stage's upstream edges: where errors and relayed outputs
    from below go on. A sink sends one HopReply up one edge and never raises."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sinks: list[Sink] = []

    def add(self, sink: Sink) -> None:
        with self._lock:
            self._sinks.append(sink)

    def discard(self, sink: Sink) -> None:
        with self._lock:
            if sink in self._sinks:
                self._sinks.remove(sink)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sinks)

    def broadcast(self, reply: Reply) -> int:
        with self._lock:
            sinks = list(self._sinks)
        for sink in sinks:
            sink(reply)
        return len(sinks)


class Routes:
    """Which upstream edge (and hop id on it) each recent step came in on, by return key, so a
    reply from below goes back up the edge its frame came down. Bounded: the oldest are
    forgotten first (a step that went well leaves no reply to take its route)."""

    def __init__(self, limit: int = 4096) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self._routes: OrderedDict[str, tuple[Sink, int]] = OrderedDict()

    def claim(self, key: str, sink: Sink, hop_id: int) -> str:
        """Route replies for ``key`` to ``sink``; the key to send down. A key that is empty or
        already routed (never from a real head, whose keys are random) gets a fresh one, so
        no client can make replies of another step, or the "edge broke" of an empty key, its own."""
        with self._lock:
            if not key or key in self._routes:
                key = uuid.uuid4().hex
            self._routes[key] = (sink, hop_id)
            while len(self._routes) > self._limit:
                self._routes.popitem(last=False)
        return key

    def take(self, key: str) -> tuple[Sink, int] | None:
        with self._lock:
            return self._routes.pop(key, None)


def error_reply(exc: SkippyError, *, return_key: str, session_ids: list[str], hop_id: int = 0,
                stage_id: str = "") -> Reply:
    """The back-channel message for a failed frame. ``failed_stage`` names the stage that failed:
    the one given, or the deeper one a DownstreamError names."""
    code, message = status_for(exc)
    failed = exc.stage_id if isinstance(exc, DownstreamError) else stage_id
    return Reply(hop_id=hop_id, code=code.name, message=message, failed_stage=failed, return_key=return_key,
                 session_ids=tuple(session_ids))


def owner_of(sink: Sink) -> Peer | None:
    """The upstream connection a back channel belongs to (None: an in-process edge)."""
    return sink if isinstance(sink, Peer) else None

