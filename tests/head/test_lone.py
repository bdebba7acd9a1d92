"""The head's lone greedy generation on real ``serve`` processes (``Stage.process_lone``).

One session alone at the head, decoding greedily, runs its steps back to back in C: the head's
layers, the frame sent, the token back over the return link, the next step — the scheduler sees
each token after the next step has left. It must be invisible but for speed: the unsplit model's
text, the end at an end-of-generation token or at max_tokens exactly, a second session admitted
as soon as it comes (the run hands back to the scheduler after the step in flight), a cancelled
generation's session freed on every stage. The loop itself, its limits and outcomes, are checked
in one process in ``tests/stage/test_native_frames.py``.
"""

from __future__ import annotations

import pytest
from support.pipeline import (
    StreamingRun,
    assert_no_active_sessions,
    grpc_generate,
    metric,
    reference_texts,
    scrape,
)

from skippy_stage.cli.local import free_ports
from skippy_stage.v1 import stage_pb2 as pb

LONG = "The capital of France is"
OTHER = "Here is a short poem about the sea:\n"
ENDS = "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"  # ends itself in ~12 tokens


@pytest.fixture(scope="module")
def references(smollm2):
    return dict(zip(["long", "other", "ends"], reference_texts(smollm2, [LONG, OTHER, ENDS], 48)))


@pytest.fixture(scope="module")
def pipeline(smollm2, start_pipeline):
    ports = free_ports("127.0.0.1", 2)
    # Separate lanes (kv_unified off): a session's text then does not depend on who shares its steps.
    started = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, metrics_port=ports, kv_unified=False)
    return started, ports[0]


def lone_steps(port: int) -> float:
    return metric(scrape(port), "skippy_lone_steps_total")


def test_a_lone_greedy_generation_runs_back_to_back_in_c_with_the_unsplit_models_text(pipeline, references):
    started, port = pipeline
    before = lone_steps(port)
    text, last = grpc_generate(started.head_endpoint, LONG, 48)
    assert text == references["long"]
    assert (last.finish_reason, last.completion_tokens) == (pb.FINISH_REASON_LENGTH, 48)
    # every decode step but the first (it opens the link to the next stage, in Python)
    assert lone_steps(port) - before >= 46
    text, last = grpc_generate(started.head_endpoint, ENDS, 48)
    assert text == references["ends"]
    assert last.finish_reason == pb.FINISH_REASON_STOP and last.completion_tokens < 48
    assert_no_active_sessions(started.configs)


def test_a_session_that_comes_mid_generation_is_admitted_and_both_texts_are_as_when_alone(pipeline, references):
    started, _ = pipeline
    alone = grpc_generate(started.head_endpoint, OTHER, 48)[0]
    first = StreamingRun(started.head_endpoint, LONG, 48, after_pieces=6)
    assert first.started.wait(60)
    second = StreamingRun(started.head_endpoint, OTHER, 48)
    second.join(120)
    first.join(60)
    assert first.error is None and second.error is None, (first.error, second.error)
    assert "".join(first.pieces) == references["long"]
    assert "".join(second.pieces) == alone
    # Admitted as it came (the first's lone run gave way after its step in flight), not once the
    # first had finished: its first token came while the first still had dozens to make. A lone
    # run that kept the head would make the second wait for all 48 of the first's.
    before_second = sum(t < second.arrived[0] for t in first.arrived)
    assert before_second < len(first.arrived) / 2, (before_second, len(first.arrived))
    assert_no_active_sessions(started.configs)


def test_cancelling_a_lone_generation_stops_its_steps_and_frees_its_session_on_every_stage(pipeline, references):
    started, port = pipeline
    alone_before = lone_steps(port)
    assert grpc_generate(started.head_endpoint, LONG, 48)[0] == references["long"]
    alone = lone_steps(port) - alone_before  # the steps one 48-token generation takes on its own

    before = lone_steps(port)
    run = StreamingRun(started.head_endpoint, LONG, 2000, after_pieces=6)
    assert run.started.wait(60)
    run.cancel()
    run.join(30)
    assert_no_active_sessions(started.configs)
    cancelled = lone_steps(port) - before
    assert 6 <= cancelled < 1000, cancelled  # it ran, and stopped long before its max_tokens
    # Nothing of it runs on once its session is gone: the next generation's steps are exactly those
    # of a generation alone (a loop left running would add its own), and its text is the reference.
    mark = lone_steps(port)
    assert grpc_generate(started.head_endpoint, LONG, 48)[0] == references["long"]
    assert lone_steps(port) - mark == alone
    assert lone_steps(port) - before == cancelled + alone


def test_with_lone_steps_off_every_step_goes_through_the_scheduler_and_the_text_is_the_same(
        smollm2, start_pipeline, references):
    ports = free_ports("127.0.0.1", 2)
    started = start_pipeline(smollm2, [(0, 15), (15, 30)], n_threads=1, metrics_port=ports, lone_steps=False)
    assert grpc_generate(started.head_endpoint, LONG, 48)[0] == references["long"]
    assert lone_steps(ports[0]) == 0
