"""The gate in front of a stage's downstream edge: a hand-off sees every frame that computed here
already sent, and no frame starts while it moves the sessions."""

from __future__ import annotations

import threading
import time

from skippy_stage.stage.gate import EdgeGate


def test_closing_waits_for_the_frames_passing_and_holds_new_ones_until_it_opens():
    gate = EdgeGate()
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


def test_a_frame_that_does_not_leave_in_time_makes_the_close_report_it_and_the_gate_still_opens():
    gate = EdgeGate()
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
