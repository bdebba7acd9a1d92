"""The data plane admits its own chain (``stage.peers``), on real ``serve`` processes and sockets.

An upstream connection (a frame link, an ActivationStream) owns the sessions its frames open:
when it ends they are freed on its stage and every stage below, so a peer that took every lane
and went away leaves nothing behind; a connection that is not the chain's own holds at most
``peer_session_cap`` sessions with the others of its host while it stays; and a stage that other
hosts can reach without a token or TLS does not start unless told the network is trusted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
from support.pipeline import grpc_generate, wait_no_active_sessions

from skippy_stage.config import StageConfig
from skippy_stage.errors import ConfigError
from skippy_stage.security import Credentials, check_exposure
from skippy_stage.stage import framing
from skippy_stage.stage.codec import sampling_to_pb
from skippy_stage.stage.peers import STAGE_ID_METADATA, host_of
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

LANES = 4
CAP = 2  # the middle stage's peer_session_cap
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def pipeline(smollm2, start_pipeline):
    return start_pipeline(smollm2, [(0, 10), (10, 20), (20, 30)], n_threads=1, lane_count=LANES,
                          peer_session_cap=[None, CAP, None])


def stub(pipeline, index: int) -> pb_grpc.StageServiceStub:
    return pb_grpc.StageServiceStub(grpc.insecure_channel(str(pipeline.configs[index]["bind_addr"])))


def active(pipeline) -> list[int]:
    return [stub(pipeline, i).GetStatus(pb.GetStatusRequest(), timeout=5).active_sessions for i in range(3)]


def dial_middle(pipeline, name: str) -> framing.FrameSocket:
    port = stub(pipeline, 1).GetStatus(pb.GetStatusRequest(), timeout=5).frame_port
    return framing.dial("127.0.0.1", port, creds=Credentials(), purpose=pb.FrameHello.PURPOSE_HOP, stage_id=name,
                        max_message_bytes=1 << 20, timeout_s=5)


def frame(session: str, hop_id: int) -> pb.HopRequest:
    """A well-formed prompt frame for the middle stage (layers 10:20) that opens ``session`` there and
    below, its outputs relayed back up the link it came on."""
    payload = np.zeros((1, 576), dtype=np.float32).tobytes()
    descriptor = pb.FrameDescriptor(version=1, dtype=pb.DTYPE_F32, layout=pb.LAYOUT_TOKEN_MAJOR, producer_stage_index=0,
                                    layer_start=0, layer_end=10, token_count=1, sequence_count=1,
                                    payload_bytes=len(payload), width=576)
    entry = pb.BatchEntry(session_id=session, phase=pb.PHASE_PREFILL, positions=[0], token_ids=[1], sample_last=True,
                          sampling=sampling_to_pb(None))
    request = pb.IterationBatchRequest(request_id="stranger", entries=[entry], return_key=f"stranger-{session}",
                                       frame=pb.ActivationFrame(descriptor=descriptor, payload=payload))
    return pb.HopRequest(hop_id=hop_id, request=request, relay=True)


def open_sessions(link: framing.FrameSocket, sessions: list[str]) -> list[pb.HopReply]:
    """Send a frame for each session; their replies, in the order sent."""
    for i, session in enumerate(sessions):
        link.send(framing.Kind.HOP_REQUEST, frame(session, i))
    replies = []
    for _ in sessions:
        kind, body = link.receive()
        replies.append(framing.parse(kind, body, framing.Kind.HOP_REPLY))
    return sorted(replies, key=lambda r: r.hop_id)  # a refusal comes straight back, outputs from below


def test_a_peer_that_takes_every_lane_of_a_middle_stage_and_disconnects_leaves_nothing_behind(pipeline):
    """The issue's stranger, made stronger: its hello gives the upstream's own name (without a token
    a name is all the chain has), so no cap holds it and it takes every lane of the middle stage,
    and through it of the final stage. While it holds them a real request is refused; once it
    disconnects its sessions are freed on both within a second, and a real request succeeds."""
    expected, _ = grpc_generate(pipeline.head_endpoint, PROMPT, 8)
    link = dial_middle(pipeline, "stage-0")
    try:
        replies = open_sessions(link, [f"taken-{i}" for i in range(LANES)])
        assert all(r.code == 0 for r in replies), [r.message for r in replies]
        assert active(pipeline) == [0, LANES, LANES]
        with pytest.raises(grpc.RpcError) as refused:
            grpc_generate(pipeline.head_endpoint, PROMPT, 8)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        link.close()
    assert wait_no_active_sessions(pipeline.configs, within_s=1.0) == [0, 0, 0]
    assert grpc_generate(pipeline.head_endpoint, PROMPT, 8)[0] == expected


def test_a_peer_that_holds_its_connection_open_gets_no_more_than_its_cap(pipeline):
    """A connection that is not the chain's (its hello names another stage, and there is no token)
    opens at most peer_session_cap sessions, counted with every such connection from its host; the
    refusal names the cap. The chain keeps the other lanes meanwhile: requests through it succeed,
    as many at once as there are lanes left; and the stranger's sessions go when it does."""
    expected, _ = grpc_generate(pipeline.head_endpoint, PROMPT, 8)
    first, second = dial_middle(pipeline, "stranger"), dial_middle(pipeline, "stranger-too")
    try:
        replies = open_sessions(first, ["held-0", "held-1", "held-2"])
        assert [r.code for r in replies[:CAP]] == [0] * CAP
        refusal = replies[CAP]
        assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and refusal.failed_stage == "stage-1"
        assert f"peer_session_cap={CAP}" in refusal.message and "127.0.0.1" in refusal.message, refusal.message
        [other] = open_sessions(second, ["held-3"])  # another connection from the same host: the same cap
        assert other.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], other.message
        assert active(pipeline) == [0, CAP, CAP]
        texts: list[str] = []
        runs = [threading.Thread(target=lambda: texts.append(grpc_generate(pipeline.head_endpoint, PROMPT, 8)[0]))
                for _ in range(LANES - CAP)]
        for run in runs:
            run.start()
        for run in runs:
            run.join(120)
        assert texts == [expected] * (LANES - CAP)
        assert active(pipeline)[1] == CAP
    finally:
        first.close()
        second.close()
    assert wait_no_active_sessions(pipeline.configs, within_s=1.0) == [0, 0, 0]


def test_the_chains_own_upstream_holds_every_lane(pipeline):
    """The head's one link to the middle stage carries all its sessions: the cap is not its."""
    expected, _ = grpc_generate(pipeline.head_endpoint, PROMPT, 16)
    texts: list[str] = []
    runs = [threading.Thread(target=lambda: texts.append(grpc_generate(pipeline.head_endpoint, PROMPT, 16)[0]))
            for _ in range(LANES)]
    for run in runs:
        run.start()
    for run in runs:
        run.join(120)
    assert texts == [expected] * LANES
    assert wait_no_active_sessions(pipeline.configs) == [0, 0, 0]


def test_sessions_an_activation_stream_opened_are_freed_on_every_stage_when_it_ends(pipeline):
    """An ActivationStream is a peer too: named as the upstream (metadata), it opens sessions on the
    middle stage and, through it, on the final one; when the caller stops sending they are freed on
    both, the final stage's by the drop the middle stage sends down its link behind the frames."""
    hops = [frame(f"streamed-{i}", i) for i in range(3)]
    sent = threading.Event()

    def requests():
        yield from hops
        sent.wait(60)  # the stream stays open until the sessions were seen

    call = stub(pipeline, 1).ActivationStream(requests(), metadata=((STAGE_ID_METADATA, b"stage-0"),), timeout=120)
    replies = [next(call) for _ in hops]
    assert all(r.code == 0 for r in replies), [r.message for r in replies]
    assert active(pipeline) == [0, 3, 3]
    sent.set()
    assert list(call) == []
    assert wait_no_active_sessions(pipeline.configs, within_s=1.0) == [0, 0, 0]


def test_a_bad_drop_message_is_answered_by_name_and_the_link_stays_usable(pipeline):
    link = dial_middle(pipeline, "stranger")
    try:
        link.send(framing.Kind.HOP_REQUEST, pb.HopRequest(hop_id=3, drop_session_ids=["x"], request=frame("y", 0).request))
        kind, body = link.receive()
        answer = framing.parse(kind, body, framing.Kind.HOP_REPLY)
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "releases travel alone" in answer.message
        link.send(framing.Kind.HOP_REQUEST, pb.HopRequest(drop_session_ids=["not-mine"]))  # nothing of its own: no-op
        [opened] = open_sessions(link, ["mine"])
        assert opened.code == 0
        link.send(framing.Kind.HOP_REQUEST, pb.HopRequest(drop_session_ids=["mine"]))
        assert wait_no_active_sessions(pipeline.configs, within_s=1.0) == [0, 0, 0]
    finally:
        link.close()


def resident_ids(pipeline, index: int) -> set[str]:
    return {p.prefix_id for p in stub(pipeline, index).GetStatus(pb.GetStatusRequest(), timeout=5).resident_prefixes}


def test_a_stranger_cannot_end_the_chains_resident_prefixes_in_band(pipeline):
    """The head's finished sessions stay on every stage as resident prefixes; a connection that is not
    the chain naming them in a drop or a retirement changes nothing (they are not its sessions)."""
    grpc_generate(pipeline.head_endpoint, PROMPT, 4)
    resident = resident_ids(pipeline, 1)
    assert resident and resident == resident_ids(pipeline, 2)
    link = dial_middle(pipeline, "stranger")
    try:
        link.send(framing.Kind.HOP_REQUEST, pb.HopRequest(drop_session_ids=sorted(resident)))
        link.send(framing.Kind.HOP_REQUEST, pb.HopRequest(retire_session_ids=sorted(resident)))
        [opened] = open_sessions(link, ["after"])  # the link took both before this frame
        assert opened.code == 0
    finally:
        link.close()
    assert wait_no_active_sessions(pipeline.configs, within_s=5.0) == [0, 0, 0]
    assert resident_ids(pipeline, 1) >= resident and resident_ids(pipeline, 2) >= resident


# -- protected mode ----------------------------------------------------------------------------


def config(**fields) -> StageConfig:
    return StageConfig.from_dict({"model_path": "m.gguf", "stage_id": "stage-1", "stage_index": 0, "layer_start": 0,
                                  "layer_end": 20, **fields})


@pytest.mark.parametrize("bind", ["127.0.0.1:7000", "localhost:7000", "[::1]:7000", "127.0.0.2:0"])
def test_a_loopback_bind_needs_nothing(bind):
    check_exposure(config(bind_addr=bind))


@pytest.mark.parametrize("bind", ["0.0.0.0:7000", "[::]:7000", "10.0.0.7:7000", "gpu-a:7000"])
def test_a_bind_other_hosts_reach_needs_a_token_or_tls_or_allow_insecure(bind):
    with pytest.raises(ConfigError) as refused:
        check_exposure(config(bind_addr=bind))
    assert "auth_token_path" in str(refused.value) and "allow_insecure" in str(refused.value)
    assert bind in str(refused.value)
    for fields in ({"auth_token_path": "/run/token"}, {"tls_cert_path": "c.pem", "tls_key_path": "k.pem"},
                   {"allow_insecure": True}):
        check_exposure(config(bind_addr=bind, **fields))


@pytest.mark.parametrize("field, value, why", [
    ("peer_session_cap", -1, ">= 0"), ("peer_session_cap", 5, "lane_count=4"), ("peer_session_cap", "2", "integer"),
    ("allow_insecure", "yes", "true or false"),
])
def test_the_new_fields_are_validated_by_name(field, value, why):
    with pytest.raises(ConfigError) as refused:
        config(**{field: value})
    assert f"{field}={value!r}" in str(refused.value) and why in str(refused.value)


@pytest.mark.parametrize("address, host", [
    ("127.0.0.1", "127.0.0.1"), ("ipv4:10.1.2.3:5555", "10.1.2.3"), ("ipv6:[::1]:5555", "::1"),
    ("ipv6:%5B::ffff:10.0.0.1%5D:80", "10.0.0.1"), ("::ffff:127.0.0.1", "127.0.0.1"), ("unix:/tmp/s", "local"),
])
def test_a_peer_is_counted_by_its_host(address, host):
    assert host_of(address) == host


def test_serve_refuses_to_start_on_an_open_address_without_a_token_and_starts_when_told(smollm2, slice_cache,
                                                                                        tmp_path):
    from skippy_stage.cli.local import LocalPipeline, free_ports

    port = free_ports("127.0.0.1", 1)[0]
    cfg = {"model_path": str(smollm2), "cache_dir": str(slice_cache), "stage_id": "open", "stage_index": 0,
           "layer_start": 0, "layer_end": 30, "n_threads": 1, "bind_addr": f"0.0.0.0:{port}"}
    path = tmp_path / "open.json"
    path.write_text(json.dumps(cfg))
    refused = subprocess.run([sys.executable, "-P", "-m", "skippy_stage", "serve", "--config", str(path)],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert "allow_insecure" in refused.stderr and "auth_token_path" in refused.stderr, refused.stderr[-2000:]
    allowed = LocalPipeline([{**cfg, "allow_insecure": True}], tmp_path)
    try:
        allowed.wait_serving(120)
        assert grpc_generate(f"127.0.0.1:{port}", PROMPT, 4)[0].startswith(" Paris")
    finally:
        allowed.stop()
