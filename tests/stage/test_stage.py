"""Stage logic over the in-process hop: frames flow one way, errors come back up.

Three real stages (each its own runtime and sliced file) are chained in this process with
``Stage.connect_local``: a frame runs on the sender's thread, exactly the code path a frame
from a socket takes after parsing. No sockets, so what is checked here is the stage's own
logic: the one-way flow, the direct return and the relay, and what a failure frees.
"""

from __future__ import annotations

import threading

import pytest
from support.chain import split_configs

from skippy_stage.errors import DownstreamError
from skippy_stage.model.loader import reference_llama
from skippy_stage.stage.stage import Stage
from skippy_stage.stage.steps import PHASE_DECODE, PHASE_PREFILL, Frame, Outputs, Reply, Step, StepEntry

PROMPT = "The capital of France is"
N_TOKENS = 12
THREE = [(0, 10), (10, 20), (20, 30)]


def chain(model, cache, *, direct: bool, lanes: list[int] | None = None) -> list[Stage]:
    configs = split_configs(model, THREE, cache, n_threads=2, kv_unified=False)
    stages = []
    for i, cfg in enumerate(configs):
        if lanes is not None:
            from dataclasses import replace

            cfg = replace(cfg, lane_count=lanes[i], ctx_size=2048)
        stage = Stage(cfg, max_message_bytes=cfg.max_message_bytes)
        stage.load()
        stages.append(stage)
    for upper, lower in zip(stages, stages[1:]):
        upper.connect_local(lower)
    if direct:
        stages[-1].return_locally(stages[0])
    return stages


def prefill(session: str, start: int, tokens: list[int]) -> Step:
    entry = StepEntry(session_id=session, phase=PHASE_PREFILL if len(tokens) > 1 else PHASE_DECODE,
                      positions=range(start, start + len(tokens)), token_ids=tokens, sample_last=True)
    return Step(request_id=session, entries=[entry])


def step(head: Stage, session: str, start: int, tokens: list[int]) -> Outputs:
    return head.process(prefill(session, start, tokens), 30.0)


def greedy(head: Stage, session: str, prompt: list[int], n: int) -> list[int]:
    out = [step(head, session, 0, prompt).outputs[0].token]
    for _ in range(n - 1):
        out.append(step(head, session, len(prompt) + len(out) - 1, [out[-1]]).outputs[0].token)
    return out


@pytest.fixture(scope="module")
def expected(smollm2):
    llm = reference_llama(smollm2, n_ctx=2048, verbose=False)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
    tokens = []
    for token in llm.generate(prompt, temp=0.0, reset=True):
        tokens.append(token)
        if len(tokens) == N_TOKENS:
            break
    llm.close()
    return prompt, tokens


def close(stages: list[Stage]) -> None:
    for stage in stages:
        stage.close()


@pytest.mark.parametrize("direct", [True, False], ids=["straight-to-the-head", "relayed-up-the-edges"])
def test_frames_flow_one_way_and_the_text_is_the_unsplit_models(smollm2, slice_cache, expected, direct):
    prompt, tokens = expected
    stages = chain(smollm2, slice_cache, direct=direct)
    try:
        assert greedy(stages[0], "s1", prompt, N_TOKENS) == tokens
        registry = stages[0].metrics.registry
        by_path = {path: registry.get_sample_value("skippy_returns_total", {"path": path}) or 0
                   for path in ("direct", "relay")}
        assert by_path == ({"direct": N_TOKENS, "relay": 0} if direct else {"direct": 0, "relay": N_TOKENS})
        # Nothing waits below the head: no stage keeps a step open once it is answered.
        assert all(len(s.returns._waiting) == 0 for s in stages)
        for stage in stages:
            assert stage.runtime.stats().active_sessions == 1
        stages[0].drop_session("s1", 5.0)
        assert [s.runtime.stats().active_sessions for s in stages] == [0, 0, 0]
    finally:
        close(stages)


def test_a_stage_failing_mid_batch_names_itself_and_every_stage_frees_the_session(smollm2, slice_cache, expected):
    """Stage 1 has one lane, the others two: a second session is refused there. The head gets
    RESOURCE_EXHAUSTED naming stage-1, and no stage holds the refused session afterwards."""
    prompt, _ = expected
    stages = chain(smollm2, slice_cache, direct=True, lanes=[2, 1, 2])
    try:
        step(stages[0], "first", 0, prompt)
        with pytest.raises(DownstreamError) as info:
            step(stages[0], "second", 0, prompt)
        assert info.value.stage_id == "stage-1"
        assert info.value.code_name == "RESOURCE_EXHAUSTED"
        assert "lane" in str(info.value)
        for stage in stages:
            bound = {row.session_id for row in stage.runtime.stats().lanes if row.session_id}
            assert bound == {"first"}, (stage.config.stage_id, bound)
        # The first session goes on undisturbed.
        assert step(stages[0], "first", len(prompt), [1]).outputs[0].token is not None
    finally:
        close(stages)


def test_a_broken_edge_fails_the_waiting_steps_and_tells_the_stages_above(smollm2, slice_cache, expected):
    """What the stage above a dead link does: every step waiting at the head fails at once with
    UNAVAILABLE naming the stage that went away, and the head stops calling itself ready."""
    from concurrent.futures import ThreadPoolExecutor

    prompt, _ = expected
    stages = chain(smollm2, slice_cache, direct=True)
    try:
        gate = threading.Event()
        final = stages[2]
        original = final.accept_frame

        arrived = threading.Event()

        def stuck(hop, sink):  # the final stage takes the frame and never answers
            arrived.set()
            gate.wait(10)
        final.accept_frame = stuck
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(step, stages[0], "s", 0, prompt)
            # The step is in flight once its frame reached the final stage: the head waits for it.
            assert arrived.wait(30), "the step's frame never reached the final stage"
            assert len(stages[0].returns._waiting) == 1
            lost = DownstreamError("stage stage-2 at local failed: UNAVAILABLE: frame link broke",
                                   stage_id="stage-2")
            stages[1]._link_broken(stages[1].downstream, lost)
            gate.set()
            with pytest.raises(DownstreamError) as info:
                waiting.result(5)
        final.accept_frame = original
        assert info.value.stage_id == "stage-2" and info.value.code_name == "UNAVAILABLE"
        assert not stages[1].ready
        # The head frees the session it started (the scheduler's recovery drops it everywhere).
        assert stages[0].runtime.stats().active_sessions == 0
    finally:
        close(stages)


def test_a_link_breaking_is_a_warning_unless_its_stage_is_stopping_too_and_nothing_was_lost(smollm2, slice_cache):
    """Stages stopped together (``up``, ``demo``) see their neighbours close: with nothing in flight
    that is no news to an operator; the same break while serving, or one that loses steps, is."""
    import structlog

    from skippy_stage.stage.returns import HopFuture
    from skippy_stage.stage.stage import StageState

    stages = chain(smollm2, slice_cache, direct=True)
    try:
        lost = DownstreamError("stage stage-2 at local failed: UNAVAILABLE: frame link broke", stage_id="stage-2")
        levels = {}
        for state in (StageState.SERVING, StageState.DRAINING):
            for stage in stages[:2]:
                if stage.state is not state:
                    stage.transition(state)
            with structlog.testing.capture_logs() as logs:
                stages[1]._link_broken(stages[1].downstream, lost)
            levels[state] = {(e["stage_id"], e["event"]): e["log_level"] for e in logs if "broke" in e["event"]}
        assert levels[StageState.SERVING] == {("stage-1", "downstream link broke"): "warning",
                                              ("stage-0", "an edge below broke"): "warning"}
        assert levels[StageState.DRAINING] == {}, "not warnings (the tests' loggers keep warnings and up)"
        # Stopping too, but a step was waiting on the link: that loss is news.
        stages[1].returns.expect(HopFuture())
        with structlog.testing.capture_logs() as logs:
            stages[1]._link_broken(stages[1].downstream, lost)
        assert [(e["stage_id"], e["log_level"], e["steps_lost"]) for e in logs if e["event"] == "downstream link broke"] \
            == [("stage-1", "warning", 1)]
    finally:
        close(stages)


class _Collector:
    """Stands in for the final stage below stage-1: keeps the frames it is sent."""

    def __init__(self, config) -> None:
        from skippy_stage.stage.upstream import Inbound

        self.config = config
        self.runtime = object()
        self.inbound = Inbound()
        self.frames: list[Frame] = []

    def accept_frame(self, frame: Frame, sink) -> None:
        self.frames.append(frame)


def test_frames_that_arrive_together_run_in_one_decode_and_each_gets_its_own_outputs(smollm2, slice_cache, expected):
    """Two sessions' frames reach the final stage at once: one llama_decode, two outputs, the
    same tokens as each frame alone (separate lanes: a session's cells never mix)."""
    prompt, tokens = expected
    stages = chain(smollm2, slice_cache, direct=False)
    final = stages[2]
    collector = _Collector(final.config)
    stages[1].connect_local(collector)
    try:
        for session in ("a", "b"):
            with pytest.raises(DownstreamError):  # nothing answers: the collector keeps the frame
                stages[0].process(prefill(session, 0, prompt), 0.2)
        assert len(collector.frames) == 2
        together: list[Reply] = []
        final.accept_frames(collector.frames, together.append)
        assert [r.code for r in together] == ["OK", "OK"]
        assert [r.outputs.outputs[0].session_id for r in together] == ["a", "b"]
        assert final.metrics.registry.get_sample_value("skippy_coalesced_frames_total") == 2
        for session in ("a", "b"):
            final.drop_session(session, 1.0)
        alone: list[Reply] = []
        for frame in collector.frames:
            final.accept_frame(frame, alone.append)
        assert [r.outputs.outputs[0].token for r in together] == [r.outputs.outputs[0].token for r in alone]
        assert together[0].outputs.outputs[0].token == tokens[0]
    finally:
        close(stages)


def test_a_frame_that_cannot_go_on_is_answered_under_the_key_it_came_with(smollm2, slice_cache, expected):
    """The upstream matches an error to its step by the key it sent; a key this stage had to
    replace (here: none at all) must not leak into the error, or the upstream waits it out."""
    prompt, _ = expected
    stages = chain(smollm2, slice_cache, direct=True)
    try:
        head_frames: list[Frame] = []

        class Catch:  # stands in for stage-1's view from above: keeps the frame stage-0 sends
            runtime = object()
            inbound = stages[1].inbound

            def accept_frame(self, frame, sink):
                head_frames.append(frame)
        stages[0].connect_local(Catch())
        with pytest.raises(DownstreamError):
            stages[0].process(prefill("s", 0, prompt), 0.2)
        frame = head_frames[0]
        frame.step.return_key = ""  # as a hostile or careless upstream might send it
        final, stages[2].runtime = stages[2].runtime, None  # the stage below cannot take it
        replies: list[Reply] = []
        stages[1].accept_frame(frame, replies.append)
        stages[2].runtime = final
        assert [(r.code, r.return_key) for r in replies] == [("UNAVAILABLE", "")]
        assert replies[0].failed_stage == "stage-2"
    finally:
        close(stages)
