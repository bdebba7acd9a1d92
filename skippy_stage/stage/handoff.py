"""Moving the live sessions of a draining downstream to its stand-in, instead of losing them.

The upstream of the draining stage does it, because it is the one that knows the stand-in
(``downstream_alternates``) and the one whose frames must not cross the move. With its gate
closed (no frame computes or leaves here; the ones under way have left), every session this
stage holds has been sent down to exactly its token count here; for each, the draining
stage exports its page once it holds that count (``wait_for_tokens``; the frames still on
their way land first) and frees the lane, the stand-in imports it, and then the edge
switches. The stages below the draining one keep their sessions: the stand-in sends to the
same downstream. Frames that waited at the gate go to the stand-in; the head sees a slower
step, not an error, and the text is the text it would have been (same KV bytes, same
batches).

A session that cannot be moved (no lane there, a page refused, time up) is not retried: its
next frame fails at the stand-in, and the head recovers it by a re-prefill, as after a crash.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from skippy_stage.errors import DownstreamError
from skippy_stage.stage.downstream import DownstreamClient
from skippy_stage.stage.stage import Stage

log = structlog.get_logger("skippy_stage.handoff")


@dataclass(frozen=True)
class Handoff:
    moved: tuple[str, ...]
    lost: tuple[tuple[str, str], ...]  # (session_id, why)
    seconds: float


def live_sessions(stage: Stage) -> list[tuple[str, int]]:
    """(session_id, tokens) of every session bound here: with the gate closed, what the stage
    below holds of each (every session of a chain passes every stage)."""
    stats = stage.require_runtime().stats()
    return [(row.session_id, row.n_tokens) for row in stats.lanes
            if row.state == "active" and row.session_id and row.n_tokens > 0]


def hand_off(stage: Stage, stand_in: DownstreamClient, timeout_s: float) -> Handoff:
    """Move every live session from ``stage.downstream`` (draining) to ``stand_in`` (serving
    the same layers), then switch the edge to it. Never raises: what could not move is lost."""
    draining = stage.downstream
    slog = stage.log.bind(from_stage=draining.peer.stage_id if draining else None, to_stage=stand_in.peer.stage_id)
    started = time.monotonic()
    deadline = started + timeout_s
    moved: list[str] = []
    lost: list[tuple[str, str]] = []
    with stage.gate.closed(timeout_s) as quiet:
        if draining is None or not quiet:
            why = "no downstream" if draining is None else f"frames still passing after {timeout_s}s"
            lost = [(session_id, why) for session_id, _ in live_sessions(stage)]
        else:
            for session_id, tokens in live_sessions(stage):
                left = deadline - time.monotonic()
                if left <= 0:
                    lost.append((session_id, f"hand-off time ({timeout_s}s) used up"))
                    continue
                try:
                    page = draining.export_session(session_id, wait_for_tokens=tokens, release=True, timeout_s=left)
                    stand_in.import_session(session_id, page, max(0.001, deadline - time.monotonic()))
                    moved.append(session_id)
                except DownstreamError as exc:
                    lost.append((session_id, str(exc)))
        stage.switch_downstream(stand_in)
    report = Handoff(tuple(moved), tuple(lost), time.monotonic() - started)
    stage.metrics.handoffs(outcome="moved").inc(len(report.moved))
    stage.metrics.handoffs(outcome="lost").inc(len(report.lost))
    slog.info("sessions handed to the stand-in", moved=len(report.moved), lost=len(report.lost),
              seconds=round(report.seconds, 3))
    for session_id, why in report.lost:
        slog.warning("session not handed off; the head will re-prefill it", session_id=session_id, error=why)
    return report
