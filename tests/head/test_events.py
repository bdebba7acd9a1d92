"""A generation's events on their way to its handler: nothing lost, nothing out of order, and
the handler woken for what was put — at once by ``put``, by a later ring after ``put_quiet``
(the lone C loop rings once it has released the GIL)."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from skippy_stage.head.events import ConditionBell, Events
from skippy_stage.stage import native_frames

BELLS = [ConditionBell] + ([native_frames._frames.Bell] if native_frames._frames is not None else [])


@pytest.mark.parametrize("bell_type", BELLS, ids=lambda b: b.__module__.rsplit(".", 1)[-1])
def test_a_bell_wakes_its_waiter_once_for_every_ring_since_the_last_wait(bell_type):
    bell = bell_type()
    assert bell.wait(0.0) is False and bell.wait(0.02) is False
    bell.ring()
    bell.ring()
    assert bell.wait(0.0) is True
    assert bell.wait(0.0) is False  # the rings between two waits count as one
    woken = []
    waiter = threading.Thread(target=lambda: woken.append(bell.wait(5.0)))
    waiter.start()
    time.sleep(0.05)
    bell.ring()
    waiter.join(5)
    assert woken == [True]


def test_events_come_out_in_order_and_a_quiet_put_waits_for_its_ring():
    events = Events()
    events.put("a")
    events.put_quiet("b")
    assert [events.get(0), events.get_nowait()] == ["a", "b"]
    with pytest.raises(queue.Empty):
        events.get_nowait()
    with pytest.raises(queue.Empty):
        events.get(0.02)
    got = []
    handler = threading.Thread(target=lambda: got.append(events.get(5.0)))
    handler.start()
    time.sleep(0.05)  # waiting on the bell by now
    events.put_quiet("c")  # not woken for it (it would find it at its next look) ...
    time.sleep(0.1)
    assert got == []
    events.ring()  # ... until it is rung
    handler.join(5)
    assert got == ["c"]


def test_a_quiet_put_handed_to_another_ringer_is_not_rung_twice():
    events = Events()
    events.put_quiet("t")
    assert events.hand_ring() is True and events.hand_ring() is False
    events.ring()  # nothing left for this side to ring
    assert events.bell.wait(0.0) is False
    assert events.get_nowait() == "t"
