"""A generation's events on their way to its handler, and the bell that wakes the handler.

The scheduler puts each task's tokens (and its end or failure) here; the task's handler (the
Generate stream, the HTTP API) takes them. ``put`` wakes the handler at once. ``put_quiet``
leaves the wake to a later ``ring``: the head's lone generation puts its tokens from the token
callback it runs with the GIL held, right after a step's frame has left, and the C loop rings the
bell once it has released the GIL (``FramePath.lone``'s ``bell``). Woken earlier, the handler would
block on the GIL the scheduler's thread still holds and be woken a second time — four switches of
the core the next stage's decode needs at that moment.

The bell is ``_frames.Bell`` (rung from C without the GIL) where the extension is built, else a
condition variable with the same contract.
"""

from __future__ import annotations

import collections
import queue
import threading
import time


class ConditionBell:
    """``_frames.Bell``'s contract on a condition variable: ``wait`` is True once rung since the
    last wait (rings in between count as one), False at its timeout."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rung = False

    def ring(self) -> None:
        with self._cond:
            self._rung = True
            self._cond.notify()

    def wait(self, timeout_s: float | None) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._rung, timeout_s)
            rung, self._rung = self._rung, False
            return rung


try:
    from skippy_stage.stage._frames import Bell
except ImportError:  # no C compiler at install: nothing rings from C, a condition variable will do
    Bell = ConditionBell  # type: ignore[misc,assignment]


class Events:
    """A task's events, in order: ``put`` and ``put_quiet`` from the scheduler, ``get`` and
    ``get_nowait`` from the handler (``queue.Empty`` when none came)."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()
        self.bell = Bell()
        self._unrung = False

    def put(self, item: object) -> None:
        self._items.append(item)
        self._unrung = False
        self.bell.ring()

    def put_quiet(self, item: object) -> None:
        """Add ``item`` without waking the handler: whoever put it rings (``ring``, or the C loop)."""
        self._items.append(item)
        self._unrung = True

    def ring(self) -> None:
        """Wake the handler for what ``put_quiet`` added, if nothing has woken it since."""
        if self._unrung:
            self._unrung = False
            self.bell.ring()

    def hand_ring(self) -> bool:
        """True when ``put_quiet`` added something nothing has rung for since; from then on, the
        caller rings for it (the C loop, once it has released the GIL)."""
        unrung, self._unrung = self._unrung, False
        return unrung

    def get_nowait(self) -> object:
        try:
            return self._items.popleft()
        except IndexError:
            raise queue.Empty from None

    def get(self, timeout: float | None = None) -> object:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._items.popleft()
            except IndexError:
                pass
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or not self.bell.wait(left):
                return self.get_nowait()  # raises queue.Empty if still nothing
