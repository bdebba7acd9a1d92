"""Speculative windows in flight: what a speculating session sends before its last step came back.

A verify window (the last token and up to k drafts) costs a whole trip down the chain and back.
Over real links that trip is mostly waiting (3 stages at 10 ms one-way: 30 ms of delay against a
few ms of compute), so the head keeps up to ``verify_window_depth`` windows of a session in flight:
while window n is verified, it drafts window n+1 from the optimistic continuation — every draft of
n kept, and the sample after them guessed by the drafter — and sends it. The frames of an edge keep
their order, so every stage runs window n+1 right after n.

When n comes back cut short (a draft rejected), or its last sample is not the token n+1 guessed,
every later window is stale. Nothing is sent to undo them: the final stage does not sample a
window that does not continue the session's last sample (``StepEntry.continues``), the head drops
stale outputs, and the next window it sends rewinds every stage to the absolute position the
session really reached (``rewind``), which drops the stale rows from every stage's KV.

Here: a window in flight and the policy for how many (pure; no threads, locks or network). What a
chained window carries is planned with the rest of a step (``step_plan.chain_window``).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from skippy_stage.model.schedule import ScheduleStep


@dataclass
class Window:
    """One entry of a task in flight (plain or speculative, chained or not)."""

    start: int  # positions[0]
    tokens: list[int]  # the tokens it feeds
    n_prefill: int  # prompt tokens it carries (0: a decode window)
    drafted: int  # drafts it carries (a chained window's first token is one)
    samples: bool = True  # the final stage samples it (a prompt's chunk: only its last)
    chained: bool = False  # sent behind another window of the task, on the guess that it is all kept
    stale: bool = False  # an earlier window was cut short: its outputs are dropped
    record: ScheduleStep | None = None

    @property
    def decode(self) -> bool:
        return self.n_prefill == 0

    @property
    def most(self) -> int:
        """The most tokens it can give: a decode window one per row, a prompt's last chunk one."""
        return len(self.tokens) if self.decode else int(self.samples)


class ChainTiming:
    """What a trip down the chain costs, as the head measures it (one for every session: the links and
    the stages are the same): ``trip_s``, the shortest recent trip of a window (send to outputs: what
    an idle chain takes), and ``gap_s``, how long after the outputs of one window those of the next
    come when both were in flight — the chain's compute for a window, which a stale one wastes and
    the step behind it waits for (0 until measured). Worker threads of several groups update it.

    A gap is only measured while windows overlap, and a high one (a busy moment of the host) keeps
    them from overlapping: so each trip measured without one moves the gap a little back towards
    half a trip (``relax``), and once it is low enough for a second window to pay, the next pair
    measures it again."""

    TRIPS = 32
    WEIGHT = 0.3
    RELAX = 0.1

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trips: deque[float] = deque(maxlen=self.TRIPS)
        self.gap_s = 0.0

    @property
    def trip_s(self) -> float:
        with self._lock:
            return min(self._trips) if self._trips else 0.0

    def trip(self, seconds: float) -> None:
        with self._lock:
            self._trips.append(seconds)

    def gap(self, seconds: float) -> None:
        with self._lock:
            self.gap_s = seconds if self.gap_s == 0.0 else self.gap_s + self.WEIGHT * (seconds - self.gap_s)

    def relax(self) -> None:
        with self._lock:
            prior = (min(self._trips) if self._trips else 0.0) / 2
            if self.gap_s > prior:
                self.gap_s += self.RELAX * (prior - self.gap_s)


@dataclass
class WindowDepth:
    """How many windows of one session to keep in flight, from what they pay.

    The window i places behind the one being verified is valid only if every window before it is
    kept whole and each guess of the sample after them is right: with ``kept`` the share of this
    session's windows kept whole and continued by the guess (a moving average), its chance is
    kept**i. When valid it arrives about a gap after the window before it instead of a whole trip
    later; when stale it costs that gap (``ChainTiming``). So window i goes out while
    kept**i * (trip - gap) > (1 - kept**i) * gap: on loopback a trip is mostly compute and only
    near-certain windows pay; at 10 ms a link, a window kept a third of the time does. Until a gap
    is measured it is taken as half a trip. Bounded by ``limit`` (the head's verify_window_depth)."""

    limit: int
    timing: ChainTiming
    kept: float = 0.8
    WEIGHT = 0.3

    def depth(self) -> int:
        trip = self.timing.trip_s
        if self.limit <= 1 or trip <= 0.0:
            return 1
        gap = min(self.timing.gap_s or trip / 2, trip)
        saved = trip - gap
        depth = 1
        while depth < self.limit:
            chance = self.kept ** depth
            if chance * saved <= (1.0 - chance) * gap:
                break
            depth += 1
        return depth

    def window_kept(self, kept: bool) -> None:
        """A window with drafts came back whole and its guess (if one was sent) continued it: True."""
        self.kept += self.WEIGHT * (float(kept) - self.kept)
