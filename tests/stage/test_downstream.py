"""The client side of an edge: every failure becomes a DownstreamError naming the stage that failed.

The head reports which hop broke, so the name must be right: the stage below when it is the
one in trouble, a deeper one when the error came up the chain naming it, and a client's own
mistake keeps its code (INVALID_ARGUMENT is not an outage). Deadlines are the caller's,
capped by the hop timeout, whatever a client sends.
"""

from __future__ import annotations

import math
import socket

import pytest

from skippy_stage.config import PeerConfig
from skippy_stage.errors import DownstreamError
from skippy_stage.stage.downstream import DownstreamClient, reply_error, timeout_for
from skippy_stage.stage.steps import Reply

PEER = PeerConfig("stage-1", 1, "127.0.0.1:1")


@pytest.mark.parametrize("remaining, expected", [
    (None, 30.0), (math.nan, 30.0), (100.0, 30.0), (2.5, 2.5), (0.0, 0.001), (-4.0, 0.001),
])
def test_a_call_gets_the_callers_remaining_time_capped_by_the_hop_timeout(remaining, expected):
    assert timeout_for(remaining, 30.0) == expected


def test_an_error_naming_a_deeper_stage_keeps_that_name_and_its_code():
    error = reply_error(PEER, Reply(code="RESOURCE_EXHAUSTED", message="stage stage-2: no lane",
                                    failed_stage="stage-2", return_key="k"))
    assert (error.stage_id, error.code_name, str(error)) == ("stage-2", "RESOURCE_EXHAUSTED", "stage stage-2: no lane")


def test_a_request_error_from_below_keeps_its_code_and_names_the_neighbour():
    error = reply_error(PEER, Reply(code="INVALID_ARGUMENT", message="entries[0].positions is empty", return_key="k"))
    assert (error.stage_id, error.code_name) == ("stage-1", "INVALID_ARGUMENT")
    assert "entries[0].positions is empty" in str(error)


def test_anything_else_from_below_is_the_neighbour_being_unavailable():
    error = reply_error(PEER, Reply(code="INTERNAL", message="boom", return_key="k"))
    assert (error.stage_id, error.code_name) == ("stage-1", "UNAVAILABLE")
    assert "INTERNAL" in str(error) and "boom" in str(error)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("transport", ["tcp", "stream"])
def test_a_downstream_that_is_not_there_is_unavailable_by_name(transport):
    peer = PeerConfig("stage-1", 1, f"127.0.0.1:{closed_port()}")
    broken = []
    client = DownstreamClient(peer, max_message_bytes=1 << 20, hop_timeout_s=1.0, connect_timeout_s=0.5,
                              transport=transport, stage_id="stage-0", on_reply=lambda r: None, on_broken=broken.append)
    try:
        probe = client.probe_health(0.5)
        assert not probe.ok and "stage-1" in probe.detail
        with pytest.raises(DownstreamError) as info:
            client.drop_session("s", 0.5)
        assert (info.value.stage_id, info.value.code_name) == ("stage-1", "UNAVAILABLE")
        with pytest.raises(DownstreamError) as info:
            client.status(0.5)
        assert info.value.stage_id == "stage-1"
    finally:
        client.close()
