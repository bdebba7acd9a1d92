"""Lanes and KV admission: the single owner of which session holds which llama.cpp sequence.

A lane is a llama.cpp sequence id. A session is bound to one lane for its life; dropping
it resets the lane's KV cells and returns the lane, warm, to an idle pool (bounded by
``cache_idle_slots``) or, past the bound, its index to the free list. A lane whose reset
fails is discarded: its index goes back to the free list marked dirty and is reset again
before reuse, so "all execution lanes are busy" always means exactly that.

Admission is all-or-nothing per batch and happens before anything reaches llama.cpp: a
session that would overflow its lane's KV cells or the pool is refused with
:class:`CapacityError`. The bookkeeping is behind one lock, but a released lane's reset (the
one llama.cpp call, injected) runs outside it, the lane in no pool meanwhile: ``stats`` may show
one lane fewer for that moment, and the caller must serialise resets with its decodes (the
runtime holds its compute lock around both). This module imports neither grpc nor llama_cpp,
so it is tested directly.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from skippy_stage.errors import CapacityError, SessionStateError, UnknownSessionError


@dataclass
class SessionLane:
    session_id: str
    lane: int
    n_tokens: int = 0
    last_used: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Admission:
    """One batch entry's claim: session, first position, number of new tokens."""

    session_id: str
    start_pos: int
    n_tokens: int


@dataclass(frozen=True)
class LaneRow:
    lane: int
    state: str  # "active", "idle" (warm, reset) or "free"
    session_id: str | None
    n_tokens: int


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


@dataclass(frozen=True)
class DropResult:
    session_id: str
    lane: int
    n_tokens: int
    reset_seconds: float
    discarded: bool


ResetFn = Callable[[int], bool]


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
        owner: str = "this stage",
        lane_limit_hint: str = "",
    ) -> None:
        """``lane_limit_hint`` names the setting that raises ``cells_per_lane``, for refusals."""
        self.owner = owner
        self.lane_limit_hint = lane_limit_hint
        self.lane_count = lane_count
        self.cells_per_lane = cells_per_lane
        self.kv_pool_tokens = kv_pool_tokens
        self.idle_bound = lane_count if cache_idle_slots is None else cache_idle_slots
        self._reset = reset
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
            return None if found is None else SessionLane(found.session_id, found.lane, found.n_tokens, found.last_used)

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
                rows[s.lane] = LaneRow(s.lane, "active", s.session_id, s.n_tokens)
            for lane in self._idle:
                rows[lane] = LaneRow(lane, "idle", None, 0)
            for lane in self._free:
                rows[lane] = LaneRow(lane, "free", None, 0)
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
            )

    # -- admission -------------------------------------------------------------------

    def admit(self, admissions: Sequence[Admission]) -> tuple[dict[str, int], list[str]]:
        """Bind and check every entry of one batch, or none of them.

        Returns the lane of every session and the sessions this call bound anew (the
        caller releases those with :meth:`release` if the batch then fails).
        """
        names = [a.session_id for a in admissions]
        if len(set(names)) != len(names):
            duplicate = next(n for n in names if names.count(n) > 1)
            raise SessionStateError(f"session_id={duplicate!r} appears twice in one batch")
        with self._lock:
            new: list[Admission] = []
            total_new = 0
            for a in admissions:
                bound = self._sessions.get(a.session_id)
                if bound is None:
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
            if used + total_new > self.kv_pool_tokens:
                raise CapacityError(
                    f"batch needs {total_new} KV cells but only {self.kv_pool_tokens - used} of "
                    f"kv_pool_tokens={self.kv_pool_tokens} are free"
                )
            available = len(self._idle) + len(self._free)
            if len(new) > available:
                raise CapacityError(
                    f"all execution lanes are busy (lane_count={self.lane_count}, "
                    f"{len(self._sessions)} sessions active, {len(new)} new sessions asked for)"
                )
            bound_now: list[str] = []
            try:
                for a in new:
                    lane = self._take_lane()
                    self._sessions[a.session_id] = SessionLane(a.session_id, lane)
                    bound_now.append(a.session_id)
            except CapacityError:
                for session_id in bound_now:  # nothing was computed in them: clean, no reset needed
                    self._place_locked(self._sessions.pop(session_id).lane, clean=True)
                raise
            lanes = {a.session_id: self._sessions[a.session_id].lane for a in admissions}
            return lanes, bound_now

    def advance(self, session_id: str, n_tokens: int) -> None:
        """Record tokens that llama.cpp has accepted into the session's lane."""
        with self._lock:
            s = self._sessions[session_id]
            s.n_tokens += n_tokens
            s.last_used = time.monotonic()

    def release(self, session_ids: Sequence[str]) -> None:
        """Undo bindings made by a batch that failed (their lanes are reset)."""
        with self._lock:
            unbound = [self._sessions.pop(sid) for sid in session_ids if sid in self._sessions]
        for lane in unbound:
            self._reset_and_place(lane)

    def drop(self, session_id: str) -> DropResult:
        with self._lock:
            unbound = self._sessions.pop(session_id, None)
        if unbound is None:
            raise UnknownSessionError(f"session_id={session_id!r} is not bound to a lane on this stage")
        return self._reset_and_place(unbound)

    def idle_sessions(self, older_than_s: float) -> list[str]:
        """Sessions unused for longer than the given time (for TTL expiry)."""
        cutoff = time.monotonic() - older_than_s
        with self._lock:
            return [s.session_id for s in self._sessions.values() if s.last_used < cutoff]

    # -- internals (lock held, except _reset_and_place) -------------------------------

    def _take_lane(self) -> int:
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
