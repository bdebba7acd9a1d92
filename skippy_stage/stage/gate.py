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

    @contextmanager
    def passing(self) -> Iterator[None]:
        """One frame (or coalesced frames, or a step) through this stage: compute and send."""
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._passing += 1
        try:
            yield
        finally:
            with self._cond:
                self._passing -= 1
                self._cond.notify_all()

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
