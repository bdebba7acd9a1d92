"""The calls on a stage's sessions besides frames: free, drop, trim, move, expire.

A session is bound on every stage of the chain. The calls that end or cut one (``drop_session``,
``trim_session``) act here and then on the stage below, in one call down the edge; an upstream
connection that ends, or lets go of sessions, frees or disowns them here and, in band, below
(``release_sessions``, ``disown_sessions``); a hand-off moves one stage's page of a session to a
stand-in (``export_session``, ``import_session``). A drop that cannot reach the stages below (the
edge is broken) is remembered and sent again once it answers. The calls that free a session
below pass the edge gate, so a hand-off never moves a session one of them is freeing.
"""

from __future__ import annotations

import threading
import time

from skippy_stage.config import MAX_SESSION_ID_LEN, StageConfig
from skippy_stage.errors import DownstreamError, InvalidRequestError, SkippyError, UnknownSessionError
from skippy_stage.model.runtime import KvPage
from skippy_stage.stage.codec import Released
from skippy_stage.stage.downstream import DownstreamClient, LocalDownstream, timeout_for
from skippy_stage.stage.gate import EdgeGate
from skippy_stage.stage.lifecycle import Lifecycle, StageState
from skippy_stage.stage.peers import Peer
from skippy_stage.stage.reports import StageDrop, StageTrim


class SessionCalls(Lifecycle):
    """A stage's session calls, on the lifecycle (the part of ``Stage`` the control plane calls)."""

    def __init__(self, config: StageConfig) -> None:
        super().__init__(config)
        # Frames, steps and session calls pass it; a hand-off to a stand-in closes it.
        self.gate = EdgeGate()
        # The edge below (None: the final stage). ``Stage`` wires it; the monitor may switch it, so
        # every call reads it once and keeps that edge.
        self.downstream: DownstreamClient | LocalDownstream | None = None
        self._moved_away = 0  # sessions exported and released here (a hand-off to a stand-in)
        self._pending_drops: set[str] = set()
        self._pending_lock = threading.Lock()
        self._drop_retry = threading.Lock()

    def remember_drops(self, session_ids: list[str]) -> None:
        """Sessions the stages below may still hold behind a broken edge: freed there once it
        answers again (``retry_pending_drops``; the idle TTL is only the last resort)."""
        if self.downstream is None or not session_ids:
            return
        with self._pending_lock:
            self._pending_drops.update(session_ids)

    def retry_pending_drops(self) -> None:
        """Send the drops the stages below have not confirmed yet (the health monitor calls
        this whenever the downstream answers)."""
        downstream = self.downstream
        if downstream is None or not self._drop_retry.acquire(blocking=False):
            return  # a retry is already under way
        try:
            with self._pending_lock:
                pending = list(self._pending_drops)
            for session_id in pending:
                try:
                    downstream.drop_session(session_id, self.timeouts.health_probe_s)
                except DownstreamError as exc:
                    if exc.code_name != "NOT_FOUND":
                        continue  # still unreachable: keep it for the next retry
                with self._pending_lock:
                    self._pending_drops.discard(session_id)
        finally:
            self._drop_retry.release()

    def expire_idle_sessions(self) -> list[str]:
        """Free sessions idle for longer than session_idle_ttl_s; returns their ids."""
        ttl = self.config.session_idle_ttl_s
        if not ttl or self.runtime is None:
            return []
        expired = self.runtime.lanes.idle_sessions(ttl)
        for session_id in expired:
            try:
                self.runtime.drop_session(session_id)
                self.log.info("session expired", session_id=session_id, idle_ttl_s=ttl)
            except UnknownSessionError:
                pass  # freed meanwhile
        return expired

    def peer_closed(self, peer: Peer) -> None:
        """An upstream connection ended: free the sessions it still owns, here and below."""
        runtime = self.runtime
        if runtime is not None:
            self.release_sessions(runtime.lanes.owned_by(peer), peer)

    def release_sessions(self, session_ids: list[str], owner: Peer | None) -> None:
        """Free those of ``session_ids`` that ``owner``'s connection owns here, and send their drop
        down this stage's edge in order with the frames already sent on it (``LocalHop``'s sessions
        and the head's have no owner: ``owner`` None frees the unowned ones). The chain's own edge
        (and the head, ``owner`` None) frees resident prefixes of those ids too: a prefix is the
        stage's, and only the chain that left it there may end it this way. Never raises."""
        runtime = self.runtime
        if runtime is None or not session_ids or self.state is StageState.STOPPED:
            return
        with self.gate.passing():  # a hand-off must not move a session this frees below
            freed = runtime.drop_owned(session_ids, owner, residents=owner is None or owner.chain)
            downstream = self.downstream
            if freed and downstream is not None:
                downstream.release(freed)

    def retire_sessions(self, session_ids: list[str], owner: Peer | None) -> None:
        """End those of ``session_ids`` that ``owner``'s connection owns here but keep each one's KV
        as a resident prefix (``retire_session``), and send their retirement down this stage's edge
        in order with the frames already sent on it (the head's finished sessions, when it keeps
        prefixes; ``owner`` None: the unowned ones). Never raises."""
        runtime = self.runtime
        if runtime is None or not session_ids or self.state is StageState.STOPPED:
            return
        with self.gate.passing():
            retired = runtime.retire_owned(session_ids, owner)
            downstream = self.downstream
            if retired and downstream is not None:
                downstream.release(retired, retired=True)

    def end_sessions(self, dropped: list[str], retired: list[str]) -> None:
        """The head ends sessions it opened: ``dropped`` freed (resident prefixes of those ids too),
        ``retired`` kept as resident prefixes, here and, in band, on every stage below — a frame
        sent after this returns finds them gone, so nothing waits for a round trip. Never raises."""
        self.release_sessions(dropped, None)
        self.retire_sessions(retired, None)

    def take_release(self, released: Released, owner: Peer | None) -> None:
        """A release message from the edge above (``owner``'s): its drops, then its retirements, then
        the sessions that moved above it. Never raises."""
        self.release_sessions(released.dropped, owner)
        self.retire_sessions(released.retired, owner)
        self.disown_sessions(released.moved, owner)

    def disown_sessions(self, session_ids: list[str], owner: Peer | None) -> None:
        """The stage above let these sessions go to a stand-in: they stay bound here, no longer
        ``owner``'s, so its connection's end does not free them (the stand-in's feeds them)."""
        runtime = self.runtime
        if runtime is None or owner is None:
            return
        for session_id in session_ids:
            runtime.lanes.disown(session_id, owner)

    def free_sessions(self, session_ids: list[str]) -> None:
        """Free sessions on this stage only (after a failure), ignoring unknown ones."""
        if self.runtime is None:
            return
        for session_id in session_ids:
            try:
                self.runtime.drop_session(session_id)
            except UnknownSessionError:
                pass

    def drop_session(self, session_id: str, remaining_s: float | None, *, keep_prefix: bool = False) -> list[StageDrop]:
        """Free the session here and on every stage below; NOT_FOUND only if no stage had it.

        ``keep_prefix``: each stage keeps the session's KV as a resident prefix instead (the
        head retires a finished session so a later one may start from it). It passes the gate:
        a hand-off under way must not move a session this call is freeing below."""
        _check_session_id(session_id)
        with self.gate.passing():
            return self._drop_session(session_id, remaining_s, keep_prefix=keep_prefix)

    def _drop_session(self, session_id: str, remaining_s: float | None, *, keep_prefix: bool) -> list[StageDrop]:
        runtime = self.require_runtime()
        try:
            result = runtime.retire_session(session_id) if keep_prefix else runtime.drop_session(session_id)
            stages = [StageDrop(self.config.stage_id, True, result.reset_seconds * 1e3)]
        except UnknownSessionError:
            stages = [StageDrop(self.config.stage_id, False)]
        downstream = self.downstream
        if downstream is not None:
            try:
                stages.extend(downstream.drop_session(session_id, remaining_s, keep_prefix))
            except DownstreamError as exc:
                if exc.code_name != "NOT_FOUND":
                    self.remember_drops([session_id])
                    raise
                stages.append(StageDrop(downstream.peer.stage_id, False))
        if not any(s.found for s in stages):
            raise UnknownSessionError(f"session_id={session_id!r} is not bound on stage {self.config.stage_id} or below")
        return stages

    def trim_session(self, session_id: str, tokens: int, remaining_s: float | None) -> list[StageTrim]:
        """Cut the session back to its first ``tokens`` here and on every stage below, in one call.

        A bad count is refused here before any stage cuts (every stage holds the same tokens of a
        session). If a stage below fails after this one cut, the stages would disagree on the
        session's length: it is dropped everywhere, and the error says so."""
        _check_session_id(session_id)
        with self.gate.passing():
            return self._trim_session(session_id, tokens, remaining_s)

    def _trim_session(self, session_id: str, tokens: int, remaining_s: float | None) -> list[StageTrim]:
        before = self.require_runtime().trim_session(session_id, tokens)
        stages = [StageTrim(self.config.stage_id, before)]
        downstream = self.downstream
        if downstream is not None:
            try:
                stages.extend(downstream.trim_session(session_id, tokens, remaining_s))
            except DownstreamError as exc:
                try:
                    self._drop_session(session_id, remaining_s, keep_prefix=False)
                except SkippyError:
                    pass
                raise DownstreamError(f"{exc}; session_id={session_id!r} was dropped on every stage (a trim that "
                                      f"half happened would leave them disagreeing)", stage_id=exc.stage_id,
                                      code_name=exc.code_name) from None
        return stages

    def export_session(self, session_id: str, *, wait_for_tokens: int = 0, wait_for_batches: int = 0,
                       release: bool = False, remaining_s: float | None = None) -> KvPage:
        """This stage's KV of a live session, as a page (for a stand-in of the same layers).

        ``wait_for_tokens``: the upstream of a draining stage names the count it has sent; the
        frames still on their way land first (polled: a hand-off is rare and short), and the page
        then holds exactly that many (``wait_for_batches``: and was fed exactly that many batches, a
        count a speculative rewind cannot take back). ``release``: the session moved, free its lane."""
        _check_session_id(session_id)
        runtime = self.require_runtime()
        if wait_for_tokens or wait_for_batches:
            budget = timeout_for(remaining_s, self.timeouts.hop_s)
            # stop waiting a little before the caller's deadline, so it hears why, not a timeout
            deadline = time.monotonic() + budget - min(0.1, budget / 2)
            while time.monotonic() < deadline:
                bound = runtime.lanes.lane_of(session_id)
                if bound is None or (bound.batches >= wait_for_batches if wait_for_batches
                                     else bound.n_tokens >= wait_for_tokens):
                    break
                time.sleep(0.002)
        if release:
            self._count_moved(+1)  # before the lane goes: the drain must not see it idle and stop
        try:
            page = runtime.export_session(session_id, self.config.max_message_bytes, tokens=wait_for_tokens or None,
                                          batches=wait_for_batches or None, release=release)
        except SkippyError:
            if release:
                self._count_moved(-1)
            raise
        self.metrics.sessions_moved.labels("exported").inc()
        downstream = self.downstream
        if release and downstream is not None:
            # The stages below keep it for the stand-in: once this stage's last frame of it has left
            # (nothing new comes in: the upstream's gate is closed), the edge below lets it go.
            self.gate.wait_idle(min(1.0, timeout_for(remaining_s, self.timeouts.hop_s)))
            downstream.release([session_id], moved=True)
        return page

    def _count_moved(self, change: int) -> None:
        with self._pending_lock:  # exports run on several gRPC threads at once
            self._moved_away += change

    def import_session(self, session_id: str, page: KvPage, *, resident: bool = False) -> int:
        _check_session_id(session_id)
        tokens = self.require_runtime().import_session(session_id, page, resident=resident)
        self.metrics.sessions_moved.labels("imported").inc()
        return tokens


def _check_session_id(session_id: str) -> None:
    """Refuse an id no lane could be bound to, before any stage is asked."""
    if not session_id or len(session_id) > MAX_SESSION_ID_LEN:
        raise InvalidRequestError(f"session_id must be 1..{MAX_SESSION_ID_LEN} characters, got {len(session_id)}")
