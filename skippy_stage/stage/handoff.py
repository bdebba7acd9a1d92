"""Moving the sessions of a draining downstream to its stand-in, instead of losing them.

The upstream of the draining stage does it, because it is the one that knows the stand-in
(``downstream_alternates``) and the one whose frames must not cross the move. With its gate
closed (no frame computes or leaves here; the ones under way have left), every session this
stage holds has been sent down to exactly its token count here; for each, the draining
stage exports its page once it holds that count (``wait_for_tokens``; the frames still on
their way land first) and frees the lane, the stand-in imports it, and then the edge
switches and the gate opens. The stages below the draining one keep their sessions: the
stand-in sends to the same downstream. Frames that waited at the gate go to the stand-in;
the head sees a slower step, not an error, and the text is the text it would have been
(same KV bytes, same batches). Then the resident prefixes follow (no frame needs them
meanwhile: one that names a prefix not there yet is a prefix miss, which costs a prefill,
never text), and only then is the old edge closed, which lets the drained stage stop.

A session that cannot be moved (no lane there, a page refused, time up) is not retried: its
next frame fails at the stand-in, and the head recovers it by a re-prefill, as after a crash.
What does not move exactly: a seeded sampler at temperature > 0 on a final stage restarts
from its seed on the stand-in (llama.cpp cannot export a sampler's random state); greedy
text is exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from skippy_stage.errors import SkippyError
from skippy_stage.stage.downstream import DownstreamClient
from skippy_stage.stage.stage import Stage

log = structlog.get_logger("skippy_stage.handoff")

# The gate may hold the head's steps this long at most (well inside hop and step timeouts), and
# one session's export may wait this long for the frames still on their way to it.
HANDOFF_BUDGET_S = 10.0
SESSION_WAIT_S = 2.0


@dataclass(frozen=True)
class Handoff:
    moved: tuple[str, ...]
    lost: tuple[tuple[str, str], ...]  # (session_id, why)
    prefixes_moved: int
    seconds: float


def live_sessions(stage: Stage) -> list[tuple[str, int, int]]:
    """(session_id, tokens, batches) of every session bound here: with the gate closed, what the
    stage below will hold of each once the frames on their way land (every session of a chain
    passes every stage, in the same batches)."""
    stats = stage.require_runtime().stats()
    return [(row.session_id, row.n_tokens, row.batches) for row in stats.lanes
            if row.state == "active" and row.session_id and row.n_tokens > 0]


def _move(stage: Stage, draining: DownstreamClient, stand_in: DownstreamClient, session_id: str, tokens: int,
          deadline: float, *, resident: bool, batches: int = 0) -> str | None:
    """One session's (or resident prefix's) page from the draining stage to the stand-in; the
    reason when it did not move."""
    left = deadline - time.monotonic()
    if left <= 0:
        return f"hand-off budget ({HANDOFF_BUDGET_S}s) used up"
    try:
        page = draining.export_session(session_id, wait_for_tokens=tokens, wait_for_batches=batches, release=True,
                                       timeout_s=min(left, SESSION_WAIT_S))
        stand_in.import_session(session_id, page, max(0.001, deadline - time.monotonic()), resident=resident)
    except SkippyError as exc:
        return str(exc)
    return None


def hand_off(stage: Stage, stand_in: DownstreamClient, budget_s: float = HANDOFF_BUDGET_S) -> Handoff:
    """Move every session from ``stage.downstream`` (draining) to ``stand_in`` (serving the same
    layers), switch the edge to it, then move the resident prefixes and close the old edge.
    Never raises: what could not move is lost (the head re-prefills it), and the edge switches."""
    draining = stage.downstream
    slog = stage.log.bind(from_stage=draining.peer.stage_id if draining else None, to_stage=stand_in.peer.stage_id)
    started = time.monotonic()
    deadline = started + budget_s
    moved: list[str] = []
    lost: list[tuple[str, str]] = []
    prefixes = 0
    runtime = stage.runtime
    try:
        with stage.gate.closed(budget_s) as quiet:
            for session_id, tokens, batches in live_sessions(stage):
                why = "frames still passing after the budget" if not quiet or draining is None else None
                if why is None and runtime.lanes.lane_of(session_id) is None:
                    continue  # freed meanwhile (a failed step)
                why = why or _move(stage, draining, stand_in, session_id, tokens, deadline, resident=False,
                                   batches=batches)
                if why is None:
                    moved.append(session_id)
                else:
                    lost.append((session_id, why))
            stage.switch_downstream(stand_in, close_old=False)
        if draining is not None:
            for row in runtime.stats().resident:
                if _move(stage, draining, stand_in, row.prefix_id, row.n_tokens, deadline, resident=True) is None:
                    prefixes += 1
    finally:
        if stage.downstream is not stand_in:
            stage.switch_downstream(stand_in, close_old=False)
        if draining is not None:
            draining.close()  # lets the drained stage stop: its upstream link closes
    report = Handoff(tuple(moved), tuple(lost), prefixes, time.monotonic() - started)
    stage.metrics.handoffs(outcome="moved").inc(len(report.moved))
    stage.metrics.handoffs(outcome="lost").inc(len(report.lost))
    slog.info("sessions handed to the stand-in", moved=len(report.moved), lost=len(report.lost),
              prefixes_moved=prefixes, seconds=round(report.seconds, 3))
    for session_id, why in report.lost:
        slog.warning("session not handed off; the head will re-prefill it", session_id=session_id, error=why)
    return report
