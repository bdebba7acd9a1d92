"""Bad requests are refused with the right status and a message naming the field and value.

Run against a real 3-stage SmolLM2 pipeline (layers 0:10 / 10:20 / 20:30), one ``serve``
process per stage on loopback, started once for the module with ``n_batch=64`` and a
1 MiB message limit. Every refusal is checked three ways:

* the gRPC status code, and a message that names the offending field and its value;
* the stage process is still alive and its health service still answers SERVING;
* no stage holds a session it did not hold before (``GetStatus.active_sessions``).

The happy paths that the error cases lean on (opening, listing and dropping a session;
identity, health and reflection) are specified here too.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support.pipeline import StageHandle, handles

from skippy_stage.cli.local import LocalPipeline
from skippy_stage.stage import wire
from skippy_stage.stage.codec import descriptor_to_pb
from skippy_stage.v1 import stage_pb2 as pb

RANGES = [(0, 10), (10, 20), (20, 30)]
N_BATCH = 64
MAX_MESSAGE_BYTES = 1 << 20
LANE_COUNT = 4  # start_pipeline's default
N_EMBD = 576
N_VOCAB = 49152
SERVICE = "skippy.stage.v1.StageService"
RPC_TIMEOUT_S = 30.0
PROMPT = [1, 504, 3458, 282, 4649, 314]  # a few in-vocabulary token ids


@dataclass
class Pipeline:
    local: LocalPipeline
    stages: list[StageHandle]

    def active_sessions(self) -> list[int]:
        return [s.status().active_sessions for s in self.stages]


@pytest.fixture(scope="module")
def pipeline(smollm2, start_pipeline) -> Iterator[Pipeline]:
    local = start_pipeline(smollm2, RANGES, n_batch=N_BATCH, n_ubatch=N_BATCH, max_message_bytes=MAX_MESSAGE_BYTES)
    stages = handles(local.configs, RPC_TIMEOUT_S)
    yield Pipeline(local, stages)
    for stage in stages:
        stage.channel.close()


@pytest.fixture(autouse=True)
def no_session_outlives_a_test(pipeline: Pipeline) -> Iterator[None]:
    """Every test starts and ends with an empty pipeline, so counts below are exact."""
    assert pipeline.active_sessions() == [0, 0, 0]
    yield
    assert pipeline.active_sessions() == [0, 0, 0]


# -- helpers -------------------------------------------------------------------------


def new_session_id(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:8]}"


def token_entry(session_id: str, tokens: list[int], *, start: int = 0, positions: list[int] | None = None,
                sampling: pb.SamplingParams | None = None) -> pb.BatchEntry:
    """A stage-0 entry: token ids at consecutive positions, sampling the next token."""
    return pb.BatchEntry(
        session_id=session_id,
        phase=pb.PHASE_PREFILL,
        positions=positions if positions is not None else list(range(start, start + len(tokens))),
        token_ids=tokens,
        sample_last=True,
        sampling=sampling or pb.SamplingParams(),
    )


def token_batch(*entries: pb.BatchEntry) -> pb.IterationBatchRequest:
    return pb.IterationBatchRequest(request_id=new_session_id("req"), entries=entries)


def stage1_frame_request(session_id: str, n_rows: int = 3, *, width: int = N_EMBD) -> pb.IterationBatchRequest:
    """A valid request for stage 1 (layers 10:20): n_rows zero rows from stage 0 (layers 0:10)."""
    rows = np.zeros((n_rows, width), dtype=np.float32)
    desc = wire.make_descriptor(dtype="f32", producer_stage_index=0, layer_start=0, layer_end=10,
                                token_count=n_rows, sequence_count=1, width=width)
    return pb.IterationBatchRequest(
        request_id=new_session_id("req"),
        entries=[pb.BatchEntry(session_id=session_id, phase=pb.PHASE_PREFILL, positions=list(range(n_rows)),
                               token_ids=PROMPT[:n_rows])],
        frame=pb.ActivationFrame(descriptor=descriptor_to_pb(desc), payload=wire.encode(rows, "f32")),
    )


def open_session(pipeline: Pipeline, session_id: str, tokens: list[int] = PROMPT) -> pb.IterationBatchResponse:
    resp = pipeline.stages[0].stub.IterationBatch(token_batch(token_entry(session_id, tokens)), timeout=RPC_TIMEOUT_S)
    assert [o.session_id for o in resp.outputs] == [session_id]
    assert resp.outputs[0].has_token and 0 <= resp.outputs[0].token < N_VOCAB
    assert resp.final_stage_id == "stage-2"
    return resp


def drop(pipeline: Pipeline, session_id: str) -> pb.DropSessionResponse:
    return pipeline.stages[0].stub.DropSession(pb.DropSessionRequest(session_id=session_id), timeout=RPC_TIMEOUT_S)


def assert_refused(pipeline: Pipeline, stage: int, call: Callable[[], object], code: grpc.StatusCode,
                   *fragments: str) -> str:
    """``call`` fails with ``code`` and a message holding every fragment; nothing else changes.

    Afterwards the stage's process is alive, its health service answers SERVING and no
    stage holds more or fewer sessions than before. Returns the message.
    """
    before = pipeline.active_sessions()
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        if isinstance(result, Iterator):  # a server stream fails while it is read
            list(result)
    err = caught.value
    details = err.details() or ""
    assert err.code() == code, f"expected {code.name}, got {err.code().name}: {details}"
    for fragment in fragments:
        assert fragment in details, f"{fragment!r} is not in the message {details!r}"
    handle = pipeline.stages[stage]
    assert pipeline.local.procs[stage].poll() is None, f"{handle.stage_id} exited"
    assert handle.health_status() == health_pb2.HealthCheckResponse.SERVING
    assert pipeline.active_sessions() == before
    return details


# -- sessions ------------------------------------------------------------------------


def test_unknown_session_not_starting_at_zero_is_not_found(pipeline: Pipeline) -> None:
    sid = new_session_id("ghost")
    request = token_batch(token_entry(sid, PROMPT[:3], start=5))
    assert_refused(pipeline, 0, lambda: pipeline.stages[0].stub.IterationBatch(request, timeout=RPC_TIMEOUT_S),
                   grpc.StatusCode.NOT_FOUND, f"session_id={sid!r}", "positions start at 5")


def test_dropping_an_unknown_session_is_not_found(pipeline: Pipeline) -> None:
    sid = new_session_id("ghost")
    assert_refused(pipeline, 0, lambda: drop(pipeline, sid), grpc.StatusCode.NOT_FOUND, f"session_id={sid!r}")


def test_an_existing_session_continued_at_the_wrong_position_is_a_failed_precondition(pipeline: Pipeline) -> None:
    sid = new_session_id("skip")
    open_session(pipeline, sid, PROMPT[:3])
    try:
        request = token_batch(token_entry(sid, [PROMPT[3]], start=5))
        assert_refused(pipeline, 0, lambda: pipeline.stages[0].stub.IterationBatch(request, timeout=RPC_TIMEOUT_S),
                       grpc.StatusCode.FAILED_PRECONDITION, "positions[0]=5", f"session_id={sid!r}",
                       "next position 3")
        # The refusal did not disturb the session: the right position still works.
        right = token_batch(token_entry(sid, [PROMPT[3]], start=3))
        assert pipeline.stages[0].stub.IterationBatch(right, timeout=RPC_TIMEOUT_S).outputs[0].has_token
        assert [s.status().max_session_tokens for s in pipeline.stages] == [4, 4, 4]
    finally:
        drop(pipeline, sid)


def test_drop_session_frees_the_session_on_every_stage(pipeline: Pipeline) -> None:
    sid = new_session_id("drop")
    open_session(pipeline, sid, PROMPT)
    for stage in pipeline.stages:
        status = stage.status()
        assert status.active_sessions == 1, stage.stage_id
        rows = [row for row in status.lanes if row.session_id == sid]
        assert len(rows) == 1, f"{stage.stage_id} lanes: {status.lanes}"
        assert rows[0].state == "active"
        assert rows[0].tokens == len(PROMPT)
        assert status.total_session_tokens == len(PROMPT)

    resp = drop(pipeline, sid)

    assert [(s.stage_id, s.found) for s in resp.stages] == [("stage-0", True), ("stage-1", True), ("stage-2", True)]
    assert all(s.reset_ms >= 0 for s in resp.stages)
    for stage in pipeline.stages:
        status = stage.status()
        assert status.active_sessions == 0, stage.stage_id
        assert not any(row.session_id == sid for row in status.lanes)
    # Dropping it again finds it nowhere.
    assert_refused(pipeline, 0, lambda: drop(pipeline, sid), grpc.StatusCode.NOT_FOUND, f"session_id={sid!r}")


def test_when_every_lane_is_busy_a_new_session_is_resource_exhausted(pipeline: Pipeline) -> None:
    sids = [new_session_id(f"lane{i}") for i in range(LANE_COUNT)]
    opened: list[str] = []
    try:
        for sid in sids:
            open_session(pipeline, sid, PROMPT[:1])
            opened.append(sid)
        assert pipeline.active_sessions() == [LANE_COUNT] * 3
        for stage in pipeline.stages:
            status = stage.status()
            assert (status.free_lanes, status.idle_lanes) == (0, 0), stage.stage_id

        extra = token_batch(token_entry(new_session_id("fifth"), PROMPT[:1]))
        assert_refused(pipeline, 0, lambda: pipeline.stages[0].stub.IterationBatch(extra, timeout=RPC_TIMEOUT_S),
                       grpc.StatusCode.RESOURCE_EXHAUSTED, "all execution lanes are busy",
                       f"lane_count={LANE_COUNT}")
    finally:
        drops = [drop(pipeline, sid) for sid in opened]
    assert all(s.found for d in drops for s in d.stages)
    for stage in pipeline.stages:
        assert stage.status().active_sessions == 0, stage.stage_id


# -- token batches at the head ---------------------------------------------------------


def test_more_tokens_than_n_batch_are_refused_before_llama_cpp_can_abort(pipeline: Pipeline) -> None:
    request = token_batch(token_entry(new_session_id("big"), [PROMPT[1]] * (N_BATCH + 1)))
    assert_refused(pipeline, 0, lambda: pipeline.stages[0].stub.IterationBatch(request, timeout=RPC_TIMEOUT_S),
                   grpc.StatusCode.INVALID_ARGUMENT, f"n_batch={N_BATCH}", str(N_BATCH + 1))
    assert pipeline.local.procs[0].poll() is None
    # Exactly n_batch tokens is fine.
    sid = new_session_id("full")
    open_session(pipeline, sid, [PROMPT[1]] * N_BATCH)
    drop(pipeline, sid)


@pytest.mark.parametrize("bad_token", [N_VOCAB, -1])
def test_a_token_id_outside_the_vocabulary_is_invalid(pipeline: Pipeline, bad_token: int) -> None:
    request = token_batch(token_entry(new_session_id("vocab"), [PROMPT[0], bad_token, PROMPT[1]]))
    assert_refused(pipeline, 0, lambda: pipeline.stages[0].stub.IterationBatch(request, timeout=RPC_TIMEOUT_S),
                   grpc.StatusCode.INVALID_ARGUMENT, f"token_ids[1]={bad_token}", str(N_VOCAB))


def test_positions_with_a_gap_are_invalid(pipeline: Pipeline) -> None:
    request = token_batch(token_entry(new_session_id("gap"), PROMPT[:3], positions=[0, 1, 3]))
    assert_refused(pipeline, 0, lambda: pipeline.stages[0].stub.IterationBatch(request, timeout=RPC_TIMEOUT_S),
                   grpc.StatusCode.INVALID_ARGUMENT, "positions", "positions[1]=1 is followed by 3")


def test_a_negative_temperature_is_invalid(pipeline: Pipeline) -> None:
    request = token_batch(token_entry(new_session_id("temp"), PROMPT[:2], sampling=pb.SamplingParams(temperature=-1)))
    assert_refused(pipeline, 0, lambda: pipeline.stages[0].stub.IterationBatch(request, timeout=RPC_TIMEOUT_S),
                   grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature=-1")


# -- activation frames at a middle stage -----------------------------------------------


def test_an_unbroken_frame_is_accepted_by_stage_1(pipeline: Pipeline) -> None:
    """The control for the cases below: only the field each of them breaks is wrong."""
    sid = new_session_id("frame")
    resp = pipeline.stages[1].stub.ActivationFrame(stage1_frame_request(sid), timeout=RPC_TIMEOUT_S)
    assert resp.final_stage_id == "stage-2"
    assert [o.session_id for o in resp.outputs] == [sid]
    assert pipeline.active_sessions() == [0, 1, 1]
    dropped = pipeline.stages[1].stub.DropSession(pb.DropSessionRequest(session_id=sid), timeout=RPC_TIMEOUT_S)
    assert [(s.stage_id, s.found) for s in dropped.stages] == [("stage-1", True), ("stage-2", True)]


def test_a_frame_from_the_wrong_layer_range_is_invalid(pipeline: Pipeline) -> None:
    request = stage1_frame_request(new_session_id("layers"))
    request.frame.descriptor.layer_end = 15
    assert_refused(pipeline, 1, lambda: pipeline.stages[1].stub.ActivationFrame(request, timeout=RPC_TIMEOUT_S),
                   grpc.StatusCode.INVALID_ARGUMENT, "frame.descriptor.layer_end=15", "layer_start=10")


def test_a_frame_of_the_wrong_width_is_invalid(pipeline: Pipeline) -> None:
    # Self-consistent (512-wide rows, matching payload_bytes): only the width is wrong.
    request = stage1_frame_request(new_session_id("width"), width=512)
    assert_refused(pipeline, 1, lambda: pipeline.stages[1].stub.ActivationFrame(request, timeout=RPC_TIMEOUT_S),
                   grpc.StatusCode.INVALID_ARGUMENT, "frame.descriptor.width=512", str(N_EMBD))


def test_a_payload_shorter_than_payload_bytes_is_invalid(pipeline: Pipeline) -> None:
    request = stage1_frame_request(new_session_id("payload"))
    declared = request.frame.descriptor.payload_bytes
    request.frame.payload = request.frame.payload[:-4]
    assert_refused(pipeline, 1, lambda: pipeline.stages[1].stub.ActivationFrame(request, timeout=RPC_TIMEOUT_S),
                   grpc.StatusCode.INVALID_ARGUMENT, "payload_bytes", str(declared), str(declared - 4))


def test_an_activation_frame_call_without_a_frame_is_invalid(pipeline: Pipeline) -> None:
    request = stage1_frame_request(new_session_id("noframe"))
    request.ClearField("frame")
    assert_refused(pipeline, 1, lambda: pipeline.stages[1].stub.ActivationFrame(request, timeout=RPC_TIMEOUT_S),
                   grpc.StatusCode.INVALID_ARGUMENT, "frame")


def test_a_message_over_the_size_limit_is_resource_exhausted(pipeline: Pipeline) -> None:
    n_rows = (2 * MAX_MESSAGE_BYTES) // (4 * N_EMBD)  # ~2 MiB of f32 rows
    request = stage1_frame_request(new_session_id("huge"), n_rows=n_rows)
    assert request.ByteSize() > MAX_MESSAGE_BYTES
    assert_refused(pipeline, 1, lambda: pipeline.stages[1].stub.ActivationFrame(request, timeout=RPC_TIMEOUT_S),
                   grpc.StatusCode.RESOURCE_EXHAUSTED, str(MAX_MESSAGE_BYTES))


# -- Generate --------------------------------------------------------------------------


def test_generate_needs_a_prompt_or_messages(pipeline: Pipeline) -> None:
    assert_refused(pipeline, 0, lambda: pipeline.stages[0].stub.Generate(pb.GenerateRequest(max_tokens=4),
                                                                        timeout=RPC_TIMEOUT_S),
                   grpc.StatusCode.INVALID_ARGUMENT, "prompt", "messages")


def test_generate_is_served_by_the_head_only(pipeline: Pipeline) -> None:
    request = pb.GenerateRequest(prompt="The capital of France is", max_tokens=4)
    assert_refused(pipeline, 1, lambda: pipeline.stages[1].stub.Generate(request, timeout=RPC_TIMEOUT_S),
                   grpc.StatusCode.FAILED_PRECONDITION, "Generate", "stage-1", "layer_start=10")


# -- identity, health, reflection -------------------------------------------------------


def test_get_status_reports_each_stage_identity(pipeline: Pipeline) -> None:
    for stage, (start, end) in zip(pipeline.stages, RANGES):
        status = stage.status()
        assert status.stage_id == f"stage-{stage.index}"
        assert status.stage_index == stage.index
        assert (status.layer_start, status.layer_end) == (start, end)
        assert status.n_embd == N_EMBD
        assert status.architecture == "llama"
        assert status.include_embeddings is (stage.index == 0)
        assert status.include_output is (stage.index == len(RANGES) - 1)
        assert status.state == "serving"
        assert status.lane_count == LANE_COUNT
        assert status.downstream_ok is True, status.downstream_error
        expected_downstream = f"stage-{stage.index + 1}" if stage.index + 1 < len(RANGES) else ""
        assert status.downstream_stage_id == expected_downstream


@pytest.mark.parametrize("service", ["", SERVICE])
def test_every_stage_answers_the_standard_health_check(pipeline: Pipeline, service: str) -> None:
    for stage in pipeline.stages:
        assert stage.health_status(service) == health_pb2.HealthCheckResponse.SERVING, stage.stage_id


def test_server_reflection_lists_the_stage_service(pipeline: Pipeline) -> None:
    for stage in pipeline.stages:
        stub = reflection_pb2_grpc.ServerReflectionStub(stage.channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=RPC_TIMEOUT_S)
        names = {svc.name for resp in responses for svc in resp.list_services_response.service}
        assert SERVICE in names, stage.stage_id
        assert "grpc.health.v1.Health" in names
