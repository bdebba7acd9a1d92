"""Lanes and KV admission: the single owner of which session holds which llama.cpp sequence.

A lane is a llama.cpp sequence id. A session is bound to one lane for its life; dropping
it resets the lane's KV cells and returns the lane, warm, to an idle pool (bounded by
``cache_idle_slots``) or, past the bound, its index to the free list. A lane whose reset
fails is discarded: its index goes back to the free list marked dirty and is reset again
before reuse, so "all execution lanes are busy" always means exactly that.

A session may instead *retire*: its lane keeps its KV as a resident prefix under the
session's id (at most ``cache_idle_slots`` of them, least recently used evicted first), and
a later session that names the prefix takes the lane, keeping its first N tokens. A new session
may also *fork* a live one: it takes a lane of its own and a copy of the live session's first N
tokens' KV (the injected ``fork``, one llama.cpp copy), so n choices of one prompt prefill it
once. Resident
prefixes yield to live work: a new session that finds no idle or free lane, or a batch that
finds the KV pool full, evicts the least recently used one (its reset runs under the lock,
like a discarded lane's retry: rare, and one llama.cpp call).

Admission is all-or-nothing per batch and happens before anything reaches llama.cpp: a
session that would overflow its lane's KV cells or the pool is refused with
:class:`CapacityError`. The bookkeeping is behind one lock, but a released lane's reset (the
one llama.cpp call, injected) runs outside it, the lane in no pool meanwhile: ``stats`` may show
one lane fewer for that moment, and the caller must serialise resets with its decodes (the
runtime holds its compute lock around both). This module imports neither grpc nor llama_cpp,
so it is tested directly.

A live session may have an *owner*: the upstream connection it was opened over (``stage.peers``
says who that is and why). The table only keeps the mark and counts by it: a connection's
sessions are listed when it closes and freed only while it still owns them
(:meth:`LaneTable.drop_owned`); a session fed over another connection moves to that one (a
stand-in's link takes over the sessions a hand-off moved); and an owner with a :class:`Quota`
(a peer not known to be the chain) opens new sessions only while all the sessions of that quota
stay within its limit. A session opened by no connection (the head's own, a unary call, an
import) and a resident prefix have no owner.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from skippy_stage.errors import (
    CapacityError,
    InvalidRequestError,
    PrefixMissError,
    SessionStateError,
    UnknownSessionError,
)


@dataclass
class SessionLane:
    session_id: str
    lane: int
    n_tokens: int = 0
    last_used: float = field(default_factory=time.monotonic)
    # Batches that fed it (every stage sees the same ones): a count that only grows, where the
    # token count may come back (speculative rewinds).
    batches: int = 0
    # The connection it was opened (or last fed) over, or None (see the module docstring); the
    # native frame path compares it with the link a frame came on.
    owner: SessionOwner | None = None


@dataclass(eq=False)
class Quota:
    """The most live sessions that the owners sharing this object may hold together."""

    limit: int
    # Whose limit, for the refusal (e.g. "peers at 10.0.0.7 that are not this stage's upstream").
    holder: str
    # The setting that raises it, for the refusal.
    setting: str = ""


class SessionOwner(Protocol):
    """What opens sessions over a connection (``stage.peers.Peer``): its quota, None for none."""

    quota: Quota | None


@dataclass(slots=True)  # not frozen: built per frame, and frozen __init__ costs ~4x (object.__setattr__ per field)
class Admission:
    """One batch entry's claim: session, first position, number of new tokens.

    A new session with ``prefix_id`` takes that resident prefix's lane and keeps its first
    ``start_pos`` tokens (the rest are trimmed away). A new session with ``fork_of`` takes a lane of
    its own holding a copy of that live session's first ``start_pos`` tokens.
    """

    session_id: str
    start_pos: int
    n_tokens: int
    prefix_id: str | None = None
    fork_of: str | None = None


@dataclass(frozen=True)
class ResidentRow:
    prefix_id: str
    lane: int
    n_tokens: int
    age_s: float


@dataclass(frozen=True)
class LaneRow:
    lane: int
    state: str  # "active", "idle" (warm, reset) or "free"
    session_id: str | None
    n_tokens: int
    batches: int = 0


@dataclass(frozen=True)
class LaneStats:
    lane_count: int
    active_sessions: int
    idle_lanes: int
    free_lanes: int
    max_session_tokens: int
    total_session_tokens: int
    kv_pool_tokens: int
    kv_cells_per_lane: int
    discarded_lanes: int
    lanes: tuple[LaneRow, ...]
    resident: tuple[ResidentRow, ...] = ()


@dataclass(frozen=True)
class DropResult:
    session_id: str
    lane: int
    n_tokens: int
    reset_seconds: float
    discarded: bool


ResetFn = Callable[[int], bool]
TrimFn = Callable[[int, int], bool]  # (lane, keep): drop the lane's KV from position ``keep`` on
ForkFn = Callable[[int, int, int], bool]  # (source lane, new lane, keep): copy the first ``keep`` tokens' KV


class LaneTable:
    """Session-to-lane binding with KV accounting, under one lock.

    The one llama.cpp call it makes, a lane's reset, runs outside the lock when a session is
    released; only re-trying a lane whose reset failed before happens under it (rare).
    """

    def __init__(
        self,
        *,
        lane_count: int,
        cells_per_lane: int,
        kv_pool_tokens: int,
        cache_idle_slots: int | None,
        reset: ResetFn,
        trim: TrimFn | None = None,
        fork: ForkFn | None = None,
        resident_slots: int | None = None,
        owner: str = "this stage",
        lane_limit_hint: str = "",
    ) -> None:
        """``lane_limit_hint`` names the setting that raises ``cells_per_lane``, for refusals.
        ``resident_slots`` bounds the resident prefixes (unset: the idle bound); without ``trim``
        none is kept, since there is no way to reuse a prefix in part, nor to trim a session; without
        ``fork`` a session cannot be forked."""
        self.owner = owner
        self.lane_limit_hint = lane_limit_hint
        self.lane_count = lane_count
        self.cells_per_lane = cells_per_lane
        self.kv_pool_tokens = kv_pool_tokens
        self.idle_bound = lane_count if cache_idle_slots is None else cache_idle_slots
        self._reset = reset
        self._trim = trim
        self._fork = fork
        self.resident_slots = self.idle_bound if resident_slots is None else resident_slots
        self._resident: OrderedDict[str, SessionLane] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._sessions: dict[str, SessionLane] = {}
        self._idle: deque[int] = deque()
        self._free: list[int] = list(range(lane_count))
        heapq.heapify(self._free)
        self._dirty: set[int] = set()
        self._discarded = 0

    # -- queries ---------------------------------------------------------------------

    def lane_of(self, session_id: str) -> SessionLane | None:
        with self._lock:
            found = self._sessions.get(session_id)
            return None if found is None else SessionLane(found.session_id, found.lane, found.n_tokens, found.last_used,
                                                          found.batches)

    def resident_lane(self, prefix_id: str) -> SessionLane | None:
        with self._lock:
            found = self._resident.get(prefix_id)
            return None if found is None else SessionLane(found.session_id, found.lane, found.n_tokens, found.last_used,
                                                          found.batches)

    def next_position(self, session_id: str) -> int:
        with self._lock:
            found = self._sessions.get(session_id)
            if found is None:
                raise UnknownSessionError(f"session_id={session_id!r} is not bound to a lane on this stage")
            return found.n_tokens

    def stats(self) -> LaneStats:
        with self._lock:
            rows: dict[int, LaneRow] = {}
            for s in self._sessions.values():
                rows[s.lane] = LaneRow(s.lane, "active", s.session_id, s.n_tokens, s.batches)
            for lane in self._idle:
                rows[lane] = LaneRow(lane, "idle", None, 0)
            for lane in self._free:
                rows[lane] = LaneRow(lane, "free", None, 0)
            now = time.monotonic()
            resident = tuple(ResidentRow(p, r.lane, r.n_tokens, now - r.last_used) for p, r in self._resident.items())
            for r in resident:
                rows[r.lane] = LaneRow(r.lane, "resident", r.prefix_id, r.n_tokens)
            tokens = [s.n_tokens for s in self._sessions.values()]
            return LaneStats(
                lane_count=self.lane_count,
                active_sessions=len(self._sessions),
                idle_lanes=len(self._idle),
                free_lanes=len(self._free),
                max_session_tokens=max(tokens, default=0),
                total_session_tokens=sum(tokens),
                kv_pool_tokens=self.kv_pool_tokens,
                kv_cells_per_lane=self.cells_per_lane,
                discarded_lanes=self._discarded,
                lanes=tuple(rows[i] for i in sorted(rows)),
                resident=resident,
            )

    # -- admission -------------------------------------------------------------------

    def admit(self, admissions: Sequence[Admission], owner: SessionOwner | None = None
              ) -> tuple[dict[str, int], list[str]]:
        """Bind and check every entry of one batch, or none of them.

        Returns the lane of every session and the sessions this call bound anew (the
        caller releases those with :meth:`release` if the batch then fails). ``owner``: the
        connection the batch came over, which owns the new sessions and takes over the others
        (None: the sessions keep whatever owner they have); its quota bounds the new ones.
        """
        names = [a.session_id for a in admissions]
        if len(set(names)) != len(names):
            duplicate = next(n for n in names if names.count(n) > 1)
            raise SessionStateError(f"session_id={duplicate!r} appears twice in one batch")
        with self._lock:
            new: list[Admission] = []
            taken: set[str] = set()
            total_new = 0
            for a in admissions:
                bound = self._sessions.get(a.session_id)
                if a.fork_of is not None:
                    self._check_fork_locked(a, bound)
                    new.append(a)
                    have = a.start_pos
                elif bound is None and a.prefix_id is not None:
                    resident = self._resident.get(a.prefix_id)
                    if resident is None or a.prefix_id in taken:
                        raise PrefixMissError(f"prefix_id={a.prefix_id!r} is not resident on {self.owner} "
                                              f"(evicted, or never kept here)")
                    if a.start_pos > resident.n_tokens:
                        raise PrefixMissError(f"prefix_id={a.prefix_id!r} holds {resident.n_tokens} tokens on "
                                              f"{self.owner}; positions start at {a.start_pos}")
                    taken.add(a.prefix_id)
                    new.append(a)
                    have = a.start_pos
                elif bound is None:
                    if a.start_pos != 0:
                        raise UnknownSessionError(
                            f"session_id={a.session_id!r} is not bound on {self.owner} "
                            f"(positions start at {a.start_pos}, a new session starts at 0)"
                        )
                    new.append(a)
                    have = 0
                else:
                    if a.start_pos != bound.n_tokens:
                        raise SessionStateError(
                            f"positions[0]={a.start_pos} for session_id={a.session_id!r}, "
                            f"expected the session's next position {bound.n_tokens}"
                        )
                    have = bound.n_tokens
                if have + a.n_tokens > self.cells_per_lane:
                    raise CapacityError(
                        f"session_id={a.session_id!r} would hold {have + a.n_tokens} tokens; "
                        f"a lane has {self.cells_per_lane} KV cells"
                        + (f" ({self.lane_limit_hint})" if self.lane_limit_hint else "")
                    )
                total_new += a.n_tokens
            used = sum(s.n_tokens for s in self._sessions.values())
            kept = sum(a.start_pos for a in new if a.prefix_id is not None or a.fork_of is not None)
            evictable = [p for p in self._resident if p not in taken]
            resident_tokens = sum(self._resident[p].n_tokens for p in evictable)
            if used + kept + total_new > self.kv_pool_tokens:
                raise CapacityError(
                    f"batch needs {total_new} KV cells but only {self.kv_pool_tokens - used - kept} of "
                    f"kv_pool_tokens={self.kv_pool_tokens} are free"
                )
            quota = getattr(owner, "quota", None)
            if quota is not None and new:
                held = sum(1 for s in self._sessions.values() if getattr(s.owner, "quota", None) is quota)
                if held + len(new) > quota.limit:
                    raise CapacityError(
                        f"{quota.holder} hold {held} sessions on {self.owner}; {len(new)} more would pass their cap "
                        f"of {quota.limit}" + (f" ({quota.setting})" if quota.setting else "")
                    )
            lanes_needed = sum(1 for a in new if a.prefix_id is None)
            if lanes_needed > len(self._idle) + len(self._free) + len(evictable):
                raise CapacityError(
                    f"all execution lanes are busy (lane_count={self.lane_count}, "
                    f"{len(self._sessions)} sessions active, {len(new)} new sessions asked for)"
                )
            # Resident prefixes hold KV cells too: the least recently used give way to this batch.
            while evictable and used + kept + total_new + resident_tokens > self.kv_pool_tokens:
                victim = evictable.pop(0)
                resident_tokens -= self._resident[victim].n_tokens
                self._evict_locked(victim)
            bound_now: list[str] = []
            try:
                # Prefixes first: a fresh session's lane may come from evicting a resident, never
                # one this batch claims.
                for a in sorted(new, key=lambda a: a.prefix_id is None):
                    if a.prefix_id is not None:
                        self._bind_prefix_locked(a)
                    elif a.fork_of is not None:
                        self._bind_fork_locked(a)
                    else:
                        self._sessions[a.session_id] = SessionLane(a.session_id, self._take_lane())
                    bound_now.append(a.session_id)
            except BaseException:
                for session_id in bound_now:
                    s = self._sessions.pop(session_id)
                    # a prefix's lane still holds its kept tokens: reset it; a fresh one is clean
                    self._place_locked(s.lane, clean=s.n_tokens == 0 or self._try_reset(s.lane))
                raise
            if owner is not None:
                for a in admissions:
                    self._sessions[a.session_id].owner = owner
            lanes = {a.session_id: self._sessions[a.session_id].lane for a in admissions}
            return lanes, bound_now

    def advance(self, session_id: str, n_tokens: int, *, batches: int | None = None) -> None:
        """Record tokens that llama.cpp has accepted into the session's lane (one batch, or an
        imported page's ``batches``)."""
        with self._lock:
            s = self._sessions[session_id]
            s.n_tokens += n_tokens
            s.batches = s.batches + 1 if batches is None else batches
            s.last_used = time.monotonic()

    def release(self, session_ids: Sequence[str]) -> None:
        """Undo bindings made by a batch that failed (their lanes are reset)."""
        with self._lock:
            unbound = [self._sessions.pop(sid) for sid in session_ids if sid in self._sessions]
        for lane in unbound:
            self._reset_and_place(lane)

    def drop(self, session_id: str) -> DropResult:
        """Free a session's lane, or a resident prefix of that id."""
        with self._lock:
            unbound = self._sessions.pop(session_id, None) or self._resident.pop(session_id, None)
        if unbound is None:
            raise UnknownSessionError(f"session_id={session_id!r} is not bound to a lane on this stage")
        return self._reset_and_place(unbound)

    def drop_owned(self, session_id: str, owner: SessionOwner | None, *, residents: bool = False) -> DropResult | None:
        """Free a live session if ``owner`` still owns it (None: if nobody does), or with
        ``residents`` and no live session of that id a resident prefix of it (the stage's, whoever
        opened it); None (nothing done) otherwise."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                s = self._resident.pop(session_id, None) if residents else None
                if s is None:
                    return None
            elif s.owner is not owner:
                return None
            else:
                del self._sessions[session_id]
        return self._reset_and_place(s)

    def owns(self, session_id: str, owner: SessionOwner | None) -> bool:
        """Whether a live session of that id is bound and ``owner``'s (None: nobody's)."""
        with self._lock:
            s = self._sessions.get(session_id)
            return s is not None and s.owner is owner

    def disown(self, session_id: str, owner: SessionOwner) -> bool:
        """Let a live session go from ``owner`` without ending it (it moved above that connection);
        whether it was ``owner``'s."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None or s.owner is not owner:
                return False
            s.owner = None
            return True

    def owned_by(self, owner: SessionOwner) -> list[str]:
        """The live sessions ``owner`` owns."""
        with self._lock:
            return [s.session_id for s in self._sessions.values() if s.owner is owner]

    def retire(self, session_id: str) -> DropResult:
        """End a session but keep its lane's KV as a resident prefix under its id (or drop it when
        no prefix may be kept). Evicted prefixes are reset outside the lock."""
        with self._lock:
            s = self._sessions.pop(session_id, None)
            if s is None:
                raise UnknownSessionError(f"session_id={session_id!r} is not bound to a lane on this stage")
            if self._trim is None or self.resident_slots <= 0 or s.n_tokens == 0:
                keep = False
            else:
                keep = True
                s.last_used = time.monotonic()
                s.owner = None  # a resident prefix is the stage's, whoever opened the session
                stale = self._resident.pop(session_id, None)  # an id reused after it retired once
                if stale is not None:
                    self._place_locked(stale.lane, clean=self._try_reset(stale.lane))
                self._resident[session_id] = s
                evicted = []
                while len(self._resident) > self.resident_slots:
                    _, oldest = self._resident.popitem(last=False)
                    evicted.append(oldest)
        if not keep:
            return self._reset_and_place(s)
        for oldest in evicted:
            self._reset_and_place(oldest)
        return DropResult(session_id, s.lane, s.n_tokens, 0.0, discarded=False)

    def trim(self, session_id: str, n_tokens: int) -> int:
        """Cut a live session back to its first ``n_tokens``, its KV with the injected ``trim``
        (under the lock: the caller serialises it with its decodes); returns what it held."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                raise UnknownSessionError(f"session_id={session_id!r} is not bound to a lane on {self.owner}")
            if not 0 <= n_tokens <= s.n_tokens:
                raise InvalidRequestError(f"tokens={n_tokens} for session_id={session_id!r}: the session holds "
                                          f"{s.n_tokens} on {self.owner}")
            before = s.n_tokens
            if n_tokens < before and (self._trim is None or not self._try_trim(s.lane, n_tokens)):
                raise InvalidRequestError(f"tokens={n_tokens} for session_id={session_id!r}: this model's state "
                                          f"cannot be cut back there on {self.owner} (recurrent layers, a sliding "
                                          f"window already past that position, or inside an image's rows)")
            s.n_tokens = n_tokens
            s.last_used = time.monotonic()
            return before

    def resident_prefixes(self) -> set[str]:
        with self._lock:
            return set(self._resident)

    def busy_sessions(self, within_s: float) -> list[str]:
        """Sessions used within the last ``within_s`` seconds."""
        cutoff = time.monotonic() - within_s
        with self._lock:
            return [s.session_id for s in self._sessions.values() if s.last_used >= cutoff]

    def idle_sessions(self, older_than_s: float) -> list[str]:
        """Sessions unused for longer than the given time (for TTL expiry)."""
        cutoff = time.monotonic() - older_than_s
        with self._lock:
            return [s.session_id for s in self._sessions.values() if s.last_used < cutoff]

    # -- internals (lock held, except _reset_and_place) -------------------------------

    def _check_fork_locked(self, a: Admission, bound: SessionLane | None) -> None:
        """A fork names a new session and a session bound before this batch that holds the tokens it keeps."""
        if self._fork is None:
            raise InvalidRequestError(f"fork_of={a.fork_of!r} for session_id={a.session_id!r}: {self.owner} cannot "
                                      f"copy a session's state (recurrent layers)")
        if bound is not None:
            raise SessionStateError(f"session_id={a.session_id!r} is already bound on {self.owner}; fork_of names "
                                    f"the source of a new session")
        source = self._sessions.get(a.fork_of)
        if source is None:
            raise UnknownSessionError(f"fork_of={a.fork_of!r} is not a live session on {self.owner}")
        if a.start_pos > source.n_tokens:
            raise SessionStateError(f"fork_of={a.fork_of!r} holds {source.n_tokens} tokens on {self.owner}; "
                                    f"positions start at {a.start_pos}")

    def _bind_fork_locked(self, a: Admission) -> None:
        lane = self._take_lane()
        source = self._sessions[a.fork_of]
        why = "a sliding window already past them"
        try:
            copied = bool(self._fork(source.lane, lane, a.start_pos))
        except Exception as exc:  # noqa: BLE001 - a failed copy leaves the lane in doubt: it is reset below
            copied, why = False, repr(exc)
        if not copied:
            self._place_locked(lane, clean=self._try_reset(lane))
            raise SessionStateError(f"fork_of={a.fork_of!r}: its first {a.start_pos} tokens could not be copied on "
                                    f"{self.owner} ({why})")
        self._sessions[a.session_id] = SessionLane(a.session_id, lane, a.start_pos)

    def _bind_prefix_locked(self, a: Admission) -> None:
        resident = self._resident.pop(a.prefix_id)
        if a.start_pos < resident.n_tokens and not (self._trim is not None and self._try_trim(resident.lane, a.start_pos)):
            self._place_locked(resident.lane, clean=self._try_reset(resident.lane))
            raise PrefixMissError(f"prefix_id={a.prefix_id!r} could not be cut to {a.start_pos} tokens on {self.owner}")
        self._sessions[a.session_id] = SessionLane(a.session_id, resident.lane, a.start_pos)

    def _evict_locked(self, prefix_id: str) -> None:
        resident = self._resident.pop(prefix_id)
        self._place_locked(resident.lane, clean=self._try_reset(resident.lane))

    def _try_trim(self, lane: int, keep: int) -> bool:
        try:
            return bool(self._trim(lane, keep))
        except Exception:  # noqa: BLE001 - a failed trim is a miss: the caller resets the lane
            return False

    def _take_lane(self) -> int:
        if not self._idle and not self._free and self._resident:
            self._evict_locked(next(iter(self._resident)))  # the least recently used prefix
        if self._idle:
            return self._idle.popleft()
        unusable: list[int] = []
        try:
            while self._free:
                lane = heapq.heappop(self._free)
                if lane not in self._dirty or self._try_reset(lane):
                    self._dirty.discard(lane)
                    return lane
                unusable.append(lane)  # a discarded lane that still cannot be reset
        finally:
            for lane in unusable:
                heapq.heappush(self._free, lane)
        raise CapacityError(f"all execution lanes are busy (lane_count={self.lane_count})")

    def _try_reset(self, lane: int) -> bool:
        try:
            return bool(self._reset(lane))
        except Exception:  # noqa: BLE001 - any failure of the injected reset discards the lane
            return False

    def _place_locked(self, lane: int, *, clean: bool) -> None:
        if not clean:
            self._discarded += 1
            self._dirty.add(lane)
            heapq.heappush(self._free, lane)
        elif len(self._idle) < self.idle_bound:
            self._idle.append(lane)
        else:
            heapq.heappush(self._free, lane)

    def _reset_and_place(self, s: SessionLane) -> DropResult:
        """Reset an unbound session's lane, then give it back to the pools.

        The reset is llama.cpp work, so it runs outside the lock (status and metrics readers
        never wait for it); meanwhile the lane is in no pool, so nobody can take it. A lane
        whose reset failed is discarded until a later reset succeeds (``_take_lane``).
        """
        started = time.perf_counter()
        ok = self._try_reset(s.lane)
        seconds = time.perf_counter() - started
        with self._lock:
            self._place_locked(s.lane, clean=ok)
        return DropResult(s.session_id, s.lane, s.n_tokens, seconds, discarded=not ok)
