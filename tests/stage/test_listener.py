"""The TCP frame listener (hop_transport "tcp") against a real 2-stage pipeline.

Frames left gRPC for a plain socket, so the socket's end must guard what gRPC guarded:
hello and version checks, message size limits, undecodable bytes, a flood of connections,
and bad frames answered by name on the back channel. Whatever arrives, both stages stay up
and no session is left behind.
"""

from __future__ import annotations

import socket
import struct
import time

import grpc
import numpy as np
import pytest
from support.pipeline import assert_no_active_sessions

from skippy_stage.security import Credentials
from skippy_stage.stage import framing
from skippy_stage.stage.codec import sampling_to_pb
from skippy_stage.stage.listener import MAX_CONNECTIONS
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 1 << 20


@pytest.fixture(scope="module")
def pipeline(smollm2, start_pipeline):
    return start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, max_message_bytes=MAX_MESSAGE_BYTES)


def status(pipeline, index: int) -> pb.StageStatus:
    with grpc.insecure_channel(str(pipeline.configs[index]["bind_addr"])) as channel:
        return pb_grpc.StageServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=5)


def dial(pipeline, index: int, purpose: int = pb.FrameHello.PURPOSE_HOP) -> framing.FrameSocket:
    return framing.dial("127.0.0.1", status(pipeline, index).frame_port, creds=Credentials(), purpose=purpose,
                        stage_id="test", max_message_bytes=MAX_MESSAGE_BYTES, timeout_s=5)


def frame(session: str, position: int = 0, *, layer_start: int = 0, layer_end: int = 15, width: int = 576,
          relay: bool = True) -> pb.HopRequest:
    rows = np.zeros((1, width), dtype=np.float32)
    payload = rows.tobytes()
    descriptor = pb.FrameDescriptor(version=1, dtype=pb.DTYPE_F32, layout=pb.LAYOUT_TOKEN_MAJOR, producer_stage_index=0,
                                    layer_start=layer_start, layer_end=layer_end, token_count=1, sequence_count=1,
                                    payload_bytes=len(payload), width=width)
    entry = pb.BatchEntry(session_id=session, phase=pb.PHASE_PREFILL, positions=[position], token_ids=[1],
                          sample_last=True, sampling=sampling_to_pb(None))
    request = pb.IterationBatchRequest(request_id="t", entries=[entry],
                                       frame=pb.ActivationFrame(descriptor=descriptor, payload=payload))
    return pb.HopRequest(hop_id=7, request=request, relay=relay)


def reply(link: framing.FrameSocket) -> pb.HopReply:
    kind, body = link.receive()
    return framing.parse(kind, body, framing.Kind.HOP_REPLY)


def assert_healthy(pipeline) -> None:
    for proc in pipeline.procs:
        assert proc.poll() is None, "a stage exited"
    assert_no_active_sessions(pipeline.configs[:2])
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        text = "".join(m.text for m in pb_grpc.StageServiceStub(channel).Generate(
            pb.GenerateRequest(prompt="The capital of France is", max_tokens=4), timeout=30))
    assert text.startswith(" Paris")


def test_both_ends_advertise_the_listener(pipeline):
    head, tail = status(pipeline, 0), status(pipeline, 1)
    assert head.hop_transport == tail.hop_transport == "tcp"
    assert head.frame_port and tail.frame_port and not tail.tls


def test_a_relayed_frame_gets_its_outputs_back_on_the_link_it_came_on(pipeline):
    link = dial(pipeline, 1)
    try:
        link.send(framing.Kind.HOP_REQUEST, frame("relayed"))
        answer = reply(link)
        assert answer.code == 0 and answer.hop_id == 7
        assert answer.response.outputs[0].session_id == "relayed" and answer.response.outputs[0].has_token
        assert status(pipeline, 1).active_sessions == 1
    finally:
        link.close()
    assert_healthy(pipeline)  # the session ended with the link that opened it


@pytest.mark.parametrize("bad, field", [
    (dict(layer_start=10, layer_end=14), "layer_end=14"),
    (dict(width=64), "width"),
])
def test_a_bad_frame_is_answered_by_name_and_the_link_stays_usable(pipeline, bad, field):
    link = dial(pipeline, 1)
    try:
        link.send(framing.Kind.HOP_REQUEST, frame("bad", **bad))
        answer = reply(link)
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and answer.hop_id == 7
        assert field in answer.message and answer.failed_stage == "stage-1"
        assert list(answer.session_ids) == ["bad"]
        link.send(framing.Kind.HOP_REQUEST, pb.HopRequest(hop_id=8))  # no entries at all
        assert "entries is empty" in reply(link).message
    finally:
        link.close()
    assert_healthy(pipeline)


def test_undecodable_bytes_and_a_wrong_kind_are_invalid_argument(pipeline):
    link = dial(pipeline, 1)
    try:
        link.sock.sendall(struct.pack(">IB", 6, framing.Kind.HOP_REQUEST) + b"\xff\xff\xff\xff\xff")
        answer = reply(link)
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "does not parse" in answer.message
        link.send(framing.Kind.RETURNED_BATCH, pb.ReturnedBatch(return_key="x"))
        answer = reply(link)
        assert "kind=RETURNED_BATCH is not accepted" in answer.message
    finally:
        link.close()
    assert_healthy(pipeline)


def test_a_message_over_the_size_limit_is_refused_naming_the_limit_and_the_link_closed(pipeline):
    link = dial(pipeline, 1)
    try:
        link.sock.sendall(struct.pack(">IB", MAX_MESSAGE_BYTES + 100, framing.Kind.HOP_REQUEST))
        answer = reply(link)
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert f"max_message_bytes={MAX_MESSAGE_BYTES}" in answer.message
        with pytest.raises(framing.LinkClosed):
            link.receive()
    finally:
        link.close()
    assert_healthy(pipeline)


@pytest.mark.parametrize("hello, why", [
    (pb.FrameHello(version=99, purpose=pb.FrameHello.PURPOSE_HOP), "version=99"),
    (pb.FrameHello(version=1, purpose=pb.FrameHello.PURPOSE_RETURN), "not the head"),
    (pb.FrameHello(version=1), "purpose=0"),
])
def test_a_wrong_hello_is_refused_with_the_reason(pipeline, hello, why):
    raw = socket.create_connection(("127.0.0.1", status(pipeline, 1).frame_port), timeout=5)
    link = framing.FrameSocket(raw, max_message_bytes=MAX_MESSAGE_BYTES)
    try:
        link.send(framing.Kind.HELLO, hello)
        kind, body = link.receive()
        welcome = framing.parse(kind, body, framing.Kind.WELCOME)
        assert welcome.code != 0 and why in welcome.message
        with pytest.raises(framing.LinkClosed):
            link.receive()
    finally:
        link.close()


def test_the_head_takes_no_frames_only_returns(pipeline):
    with pytest.raises(framing.Refused) as refused:
        dial(pipeline, 0)
    assert "takes no frames" in str(refused.value)
    dial(pipeline, 0, pb.FrameHello.PURPOSE_RETURN).close()


def test_garbage_instead_of_a_hello_and_a_flood_of_connections_leave_the_stage_up(pipeline):
    port = status(pipeline, 1).frame_port
    garbage = socket.create_connection(("127.0.0.1", port), timeout=5)
    garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    garbage.settimeout(5)
    # "GET " read as a length prefix is far past max_message_bytes: the hello never parses and
    # the listener closes the connection at once (no hang, no crash).
    assert garbage.recv(1024) == b""
    garbage.close()
    flood = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_CONNECTIONS + 8)]
    try:
        extra = flood[-1]
        extra.settimeout(5)
        assert extra.recv(16) == b"", "a connection past the limit must be closed at once"
    finally:
        for conn in flood:
            conn.close()
    deadline = time.monotonic() + 10
    while True:  # the slots come back as the flood's threads notice the closed sockets
        try:
            dial(pipeline, 1).close()
            break
        except (OSError, framing.LinkClosed):
            assert time.monotonic() < deadline, "the listener did not recover from the flood"
            time.sleep(0.2)
    assert_healthy(pipeline)
