"""The gate in front of a stage's downstream edge: frames pass it on their way through the
stage, and a hand-off closes it to move the sessions below to a stand-in.

Why a gate and not the edge's lock: a frame holds its pass from before its compute to after
its send, so once ``closed()`` returns, every token this stage has computed is on its way
down (the stage below will hold exactly this stage's count of each session) and no new one
is. Frames that arrive meanwhile wait at the gate (their upstream feels it as latency, never
as an error); the hand-off is bounded, and an expired wait opens the gate again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class EdgeGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._passing = 0
        self._closed = False
        self._pass = _Passing(self)

    def passing(self) -> _Passing:
        """One frame (or coalesced frames, or a step) through this stage: compute and send."""
        return self._pass

    @contextmanager
    def closed(self, timeout_s: float) -> Iterator[bool]:
        """Hold new frames and wait for the ones passing to leave; yields whether they all left
        within ``timeout_s`` (if not, the caller should not rely on the counts below). The gate
        opens again on exit, whatever happened inside."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._closed:  # one hand-off at a time
                self._cond.wait()
            self._closed = True
            while self._passing and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            drained = self._passing == 0
        try:
            yield drained
        finally:
            with self._cond:
                self._closed = False
                self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no frame is passing (a draining stage, before it stops); True if none is."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._passing and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            return self._passing == 0


class _Passing:
    """``EdgeGate.passing()``: a plain context manager (a generator-based one costs several
    times as much, and a frame passes one per stage per token)."""

    __slots__ = ("_gate",)

    def __init__(self, gate: EdgeGate) -> None:
        self._gate = gate

    def __enter__(self) -> None:
        gate = self._gate
        with gate._cond:
            while gate._closed:
                gate._cond.wait()
            gate._passing += 1

    def __exit__(self, *exc: object) -> None:
        gate = self._gate
        with gate._cond:
            gate._passing -= 1
            if not gate._passing:  # only ``closed`` and ``wait_idle`` wait, for none passing
                gate._cond.notify_all()
