"""The gate in front of a stage's downstream edge: frames pass it on their way through the
stage, and a hand-off closes it to move the sessions below to a stand-in.

Why a gate and not the edge's lock: a frame holds its pass from before its compute to after
its send, so once ``closed()`` returns, every token this stage has computed is on its way
down (the stage below will hold exactly this stage's count of each session) and no new one
is. Frames that arrive meanwhile wait at the gate (their upstream feels it as latency, never
as an error); the hand-off is bounded, and an expired wait opens the gate again.

The gate's state is ``_frames.Gate`` where the extension is built: the C frame paths pass it
with a mutex instead of calling into Python twice a frame (see ``native/sync.c``).
``ConditionGate`` is its contract on a condition variable, for where it is not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class ConditionGate:
    """``_frames.Gate``: a context manager a frame passes (``__enter__`` waits while closed),
    ``close(timeout_s)`` (one at a time) and ``open()``, ``wait_idle(timeout_s)``."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._passing = 0
        self._closed = False

    def __enter__(self) -> None:
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._passing += 1

    def __exit__(self, *exc: object) -> bool:
        with self._cond:
            self._passing = max(0, self._passing - 1)
            if not self._passing:  # only ``close`` and ``wait_idle`` wait, for none passing
                self._cond.notify_all()
        return False

    def close(self, timeout_s: float | None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._closed:  # one hand-off at a time
                self._cond.wait()
            self._closed = True
            return self._wait_none(deadline)

    def open(self) -> None:
        with self._cond:
            self._closed = False
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float | None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            return self._wait_none(deadline)

    def _wait_none(self, deadline: float | None) -> bool:
        while self._passing:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._cond.wait(left)
        return self._passing == 0


try:
    from skippy_stage.stage._frames import Gate
except ImportError:  # the extension is not built here
    Gate = ConditionGate  # type: ignore[misc,assignment]


class EdgeGate:
    def __init__(self, gate: type = Gate) -> None:
        self._gate = gate()

    def passing(self):
        """One frame (or coalesced frames, or a step) through this stage, compute and send: a
        context manager (the C paths pass the same object without the interpreter)."""
        return self._gate

    @contextmanager
    def closed(self, timeout_s: float) -> Iterator[bool]:
        """Hold new frames and wait for the ones passing to leave; yields whether they all left
        within ``timeout_s`` (if not, the caller should not rely on the counts below). The gate
        opens again on exit, whatever happened inside."""
        drained = self._gate.close(timeout_s)
        try:
            yield drained
        finally:
            self._gate.open()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no frame is passing (a draining stage, before it stops); True if none is."""
        return self._gate.wait_idle(timeout_s)
