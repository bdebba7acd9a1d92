"""Sampled tokens straight back from the final stage to the head (``return_to``).

The final stage sends each batch's outputs to the head over ReturnResults and relays them
up through the stages as well; the head takes the first copy. Checked from outside, on
real ``serve`` processes: the text is the unsplit model's, the direct copy is the one that
settles the steps, a head the final stage cannot reach costs nothing but speed, and a
session a stage below loses between steps is re-prefilled, not failed.
"""

from __future__ import annotations

import grpc
import pytest
from support.pipeline import StreamingRun, assert_no_active_sessions, grpc_generate, reference_texts, scrape, status
from support.waiting import eventually

from skippy_stage.cli.local import free_ports
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

PROMPT = "The capital of France is"
THREE = [(0, 10), (10, 20), (20, 30)]


def returns_counted(port: int) -> dict[str, float]:
    """skippy_returns_total by path, scraped from a stage's metrics endpoint."""
    counts = {}
    for line in scrape(port).splitlines():
        if line.startswith('skippy_returns_total{path="'):
            path = line.split('"')[1]
            counts[path] = float(line.rsplit(" ", 1)[1])
    return counts


@pytest.fixture(scope="module")
def reference(smollm2):
    return reference_texts(smollm2, [PROMPT], 24)[0]


def test_the_final_stage_returns_tokens_straight_to_the_head_and_the_text_is_unchanged(
        smollm2, start_pipeline, reference):
    metrics = free_ports("127.0.0.1", 3)
    pipeline = start_pipeline(smollm2, THREE, n_threads=1, metrics_port=metrics)
    assert pipeline.configs[2]["return_to"]["endpoint"] == pipeline.head_endpoint
    text, last = grpc_generate(pipeline.head_endpoint, PROMPT, 24)
    assert text == reference
    # A frame's metrics are recorded once it has left (metrics.Tally): the last one may be counted a
    # moment after the client has its token.
    final = eventually(lambda: returns_counted(metrics[2]), lambda f: f.get("sent", 0) >= last.completion_tokens)
    head = returns_counted(metrics[0])
    assert final["sent"] >= last.completion_tokens  # a direct copy of every step left the final stage
    assert head.get("direct", 0) + head.get("relay", 0) >= last.completion_tokens  # every step settled
    # Direct copies reached the head and settled steps (which copy wins a given step is a race:
    # speed is bench's to measure). With no direct copy arriving, every step is the relay's
    # (test_a_head_the_final_stage_cannot_reach_costs_only_the_relay: 0 direct).
    assert head.get("direct", 0) > 0, head
    assert_no_active_sessions(pipeline.configs)


def test_relay_only_gives_the_same_text(smollm2, start_pipeline, reference):
    pipeline = start_pipeline(smollm2, THREE, n_threads=1, return_path="relay")
    assert "return_to" not in pipeline.configs[2]
    assert grpc_generate(pipeline.head_endpoint, PROMPT, 24)[0] == reference


def test_a_head_the_final_stage_cannot_reach_costs_only_the_relay(smollm2, start_pipeline, reference):
    """return_to names a port nobody listens on: every direct return fails to send, the
    relayed copy settles every step, and the text is the same."""
    dead = free_ports("127.0.0.1", 1)[0]
    metrics = free_ports("127.0.0.1", 2)
    pipeline = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, metrics_port=metrics,
                              return_to=[None, {"stage_id": "stage-0", "stage_index": 0,
                                                "endpoint": f"127.0.0.1:{dead}"}])
    text, last = grpc_generate(pipeline.head_endpoint, PROMPT, 24)
    assert text == reference
    # the relay is counted after it has settled the step it carried
    head = eventually(lambda: returns_counted(metrics[0]), lambda h: h.get("relay", 0) >= last.completion_tokens)
    assert head.get("direct", 0) == 0
    assert head["relay"] >= last.completion_tokens
    assert_no_active_sessions(pipeline.configs)


@pytest.mark.parametrize("return_path", ["direct", "relay"])
def test_a_session_lost_below_the_head_between_steps_is_re_prefilled_with_identical_text(
        smollm2, start_pipeline, return_path):
    """What a broken chain behind a direct return leaves (or a stage restarted between two
    steps): the head still holds a session the stages below do not. The next step gets
    NOT_FOUND from below, and the head re-prefills the session's tokens and goes on."""
    pipeline = start_pipeline(smollm2, THREE, n_threads=1, recovery_wait_s=30, return_path=return_path)
    prompt = "Here is a short poem about the sea:\n"
    undisturbed, _ = grpc_generate(pipeline.head_endpoint, prompt, 48)
    run = StreamingRun(pipeline.head_endpoint, prompt, 48)
    assert run.started.wait(60)
    stage1 = str(pipeline.configs[1]["bind_addr"])
    sessions = [lane.session_id for lane in status(stage1).lanes if lane.session_id]
    assert len(sessions) == 1
    with grpc.insecure_channel(stage1) as channel:
        dropped = pb_grpc.StageServiceStub(channel).DropSession(pb.DropSessionRequest(session_id=sessions[0]),
                                                                 timeout=10)
    assert [s.stage_id for s in dropped.stages if s.found] == ["stage-1", "stage-2"]
    run.worker.join(120)
    assert "error" not in run.outcome, run.outcome.get("error")
    assert "".join(run.pieces) == undisturbed
    assert run.outcome["done"].completion_tokens == 48
    assert_no_active_sessions(pipeline.configs)


def test_return_results_is_refused_below_the_head_and_long_return_keys_are_refused(smollm2, start_pipeline):
    pipeline = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1)
    below = str(pipeline.configs[1]["bind_addr"])
    with grpc.insecure_channel(below) as channel:
        stub = pb_grpc.StageServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.ReturnResults(iter([pb.ReturnedBatch(return_key="k")]), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "head stage only" in err.value.details()
    with grpc.insecure_channel(pipeline.head_endpoint) as channel:
        stub = pb_grpc.StageServiceStub(channel)
        # A return nobody waits for (late, or forged) is ignored, not an error.
        ack = stub.ReturnResults(iter([pb.ReturnedBatch(return_key="nobody-waits"),
                                       pb.ReturnedBatch(return_key="x" * 10_000)]), timeout=10)
        assert ack.accepted == 0
        entry = pb.BatchEntry(session_id="s", phase=pb.PHASE_PREFILL, positions=[0], token_ids=[1], sample_last=True)
        with pytest.raises(grpc.RpcError) as err:
            stub.IterationBatch(pb.IterationBatchRequest(entries=[entry], return_key="k" * 65), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "return_key" in err.value.details() and "65" in err.value.details()
    # The stage stays up and serves.
    assert_no_active_sessions([pipeline.head_endpoint], within_s=10)
    assert grpc_generate(pipeline.head_endpoint, PROMPT, 4)[1].done
