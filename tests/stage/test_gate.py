"""The gate in front of a stage's downstream edge: a hand-off sees every frame that computed here
already sent, and no frame starts while it moves the sessions."""

from __future__ import annotations

import threading
import time

import pytest

from skippy_stage.stage import gate as gate_module
from skippy_stage.stage.gate import ConditionGate, EdgeGate

# The C gate where the extension is built (what stages use) and its Python stand-in, one contract.
KINDS = [ConditionGate] + ([gate_module.Gate] if gate_module.Gate is not ConditionGate else [])


@pytest.fixture(params=KINDS, ids=lambda kind: kind.__module__.rsplit(".", 1)[-1] + "." + kind.__name__)
def gate(request) -> EdgeGate:
    return EdgeGate(request.param)


def test_closing_waits_for_the_frames_passing_and_holds_new_ones_until_it_opens(gate):
    events: list[str] = []
    inside = threading.Event()
    leave = threading.Event()

    def frame(name: str, started: threading.Event | None = None, hold: threading.Event | None = None) -> None:
        with gate.passing():
            events.append(f"{name} in")
            if started is not None:
                started.set()
            if hold is not None:
                hold.wait(5)
            events.append(f"{name} out")

    first = threading.Thread(target=frame, args=("a", inside, leave))
    first.start()
    assert inside.wait(5)
    closer_done = threading.Event()

    def close() -> None:
        with gate.closed(5) as quiet:
            events.append(f"closed quiet={quiet}")
            late = threading.Thread(target=frame, args=("b",))
            late.start()
            time.sleep(0.1)  # b must wait at the gate, not run inside the hand-off
            events.append("opening")
        late.join(5)
        closer_done.set()

    closer = threading.Thread(target=close)
    closer.start()
    time.sleep(0.1)
    assert events == ["a in"], "the hand-off waits for the frame under way"
    leave.set()
    assert closer_done.wait(5)
    first.join(5)
    closer.join(5)
    assert events == ["a in", "a out", "closed quiet=True", "opening", "b in", "b out"]


def test_a_frame_that_does_not_leave_in_time_makes_the_close_report_it_and_the_gate_still_opens(gate):
    inside, leave = threading.Event(), threading.Event()

    def stuck() -> None:
        with gate.passing():
            inside.set()
            leave.wait(5)

    t = threading.Thread(target=stuck)
    t.start()
    assert inside.wait(5)
    with gate.closed(0.05) as quiet:
        assert quiet is False
    leave.set()
    t.join(5)
    with gate.passing():  # open again
        pass
    assert gate.wait_idle(1)


def test_one_hand_off_closes_at_a_time_and_an_idle_wait_sees_the_frames_passing(gate):
    """A second close waits for the first to open again; ``wait_idle`` says whether a frame is
    passing, waiting for it to leave up to its timeout; an exception inside a pass is not swallowed."""
    order: list[str] = []
    first_closed = threading.Event()
    release = threading.Event()

    def hand_off(name: str, hold: threading.Event | None) -> None:
        with gate.closed(1) as quiet:
            order.append(f"{name} closed {quiet}")
            if hold is not None:
                first_closed.set()
                hold.wait(5)
            order.append(f"{name} opens")

    first = threading.Thread(target=hand_off, args=("first", release))
    first.start()
    assert first_closed.wait(5)
    second = threading.Thread(target=hand_off, args=("second", None))
    second.start()
    time.sleep(0.1)
    assert order == ["first closed True"], "the second hand-off waits for the first"
    release.set()
    first.join(5)
    second.join(5)
    assert order == ["first closed True", "first opens", "second closed True", "second opens"]

    inside, leave = threading.Event(), threading.Event()

    def frame() -> None:
        with gate.passing():
            inside.set()
            leave.wait(5)

    t = threading.Thread(target=frame)
    t.start()
    assert inside.wait(5)
    assert gate.wait_idle(0) is False and gate.wait_idle(0.05) is False
    threading.Timer(0.05, leave.set).start()
    assert gate.wait_idle(5) is True
    t.join(5)
    with pytest.raises(ValueError), gate.passing():
        raise ValueError("inside the pass")
    assert gate.wait_idle(0) is True
