"""How a step's outputs find the stage that waits for them.

The waiting side (``ReturnBox``): keys are random per step, the first answer settles a step
(a direct return and a relayed copy may both arrive), an unknown or late key settles
nothing, and a broken edge fails every step still waiting. The final stage's side
(``TcpReturn``): a head that cannot be reached makes ``send`` say False at once, so the
outputs are relayed instead, and it is not dialled again on every step.
"""

from __future__ import annotations

import socket

import pytest

from skippy_stage.config import PeerConfig
from skippy_stage.errors import DownstreamError
from skippy_stage.security import Credentials
from skippy_stage.stage import returns
from skippy_stage.stage.returns import HopFuture, ReturnBox, TcpReturn
from skippy_stage.stage.steps import Output, Outputs

OUTPUTS = Outputs([Output("s", 7)], "stage-2")


def test_each_step_gets_its_own_random_key_and_the_first_answer_wins():
    box = ReturnBox()
    first, second = HopFuture(), HopFuture()
    k1, k2 = box.expect(first), box.expect(second)
    assert k1 != k2 and len(k1) == 32
    assert box.deliver(k1, OUTPUTS)
    assert not box.deliver(k1, Outputs([Output("s", 8)], "stage-2"))  # the relayed copy, later
    assert first.result(0) is OUTPUTS
    assert not box.fail(k1, DownstreamError("late", stage_id="stage-1"))
    assert k2 in box and k1 not in box


def test_keys_are_unique_per_step_and_differ_between_stages():
    """Random per step: never the same key twice in one box, and no stage's keys predict
    another's (or the next one)."""
    one, other = ReturnBox(), ReturnBox()
    keys = [one.expect(HopFuture()) for _ in range(2000)]
    assert len(set(keys)) == 2000 and all(len(k) == 32 for k in keys)
    assert not set(keys) & {other.expect(HopFuture()) for _ in range(2000)}


def test_an_unknown_or_forgotten_key_settles_nothing():
    box = ReturnBox()
    future = HopFuture()
    key = box.expect(future)
    box.forget(key)  # the caller gave up (deadline)
    assert not box.deliver(key, OUTPUTS)
    assert not box.deliver("forged", OUTPUTS)
    assert not future.done()


def test_a_broken_edge_fails_every_waiting_step_with_its_error():
    box = ReturnBox()
    futures = [HopFuture() for _ in range(3)]
    for f in futures:
        box.expect(f)
    lost = DownstreamError("stage stage-2 failed: UNAVAILABLE: frame link broke", stage_id="stage-2")
    assert box.fail_all(lost) == 3
    for f in futures:
        with pytest.raises(DownstreamError) as info:
            f.result(0)
        assert info.value.stage_id == "stage-2"
    assert box.fail_all(lost) == 0


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_head_means_relay_and_is_not_dialled_again_on_every_step(monkeypatch):
    monkeypatch.setattr(returns, "RETRY_AFTER_S", 3600.0)  # the back-off outlasts the test, however slow
    path = TcpReturn(PeerConfig("stage-0", 0, f"127.0.0.1:{closed_port()}"), credentials=Credentials(),
                     stage_id="stage-2", max_message_bytes=1 << 20)
    try:
        assert path.send("k", OUTPUTS) is False
        dials = []
        monkeypatch.setattr(returns.framing, "dial", lambda *a, **k: dials.append(a))
        for _ in range(20):
            assert path.send("k", OUTPUTS) is False
        assert dials == []
    finally:
        path.close()
