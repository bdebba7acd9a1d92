"""Waiting for what another thread or process records after the event a test saw.

A stage sends first and books after (metrics, callbacks, freed sessions): the send is what the
client waits for, so its bookkeeping must not delay it. A test that reads that bookkeeping right
after the reply races it; it waits here instead, with a deadline, and then asserts."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(read: Callable[[], T], done: Callable[[T], bool], within_s: float = 10.0) -> T:
    """``read()`` once ``done`` holds for it, or its last value after ``within_s`` (for the
    test's own assertion to report)."""
    deadline = time.monotonic() + within_s
    while True:
        value = read()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.02)
