"""Speculative windows in flight: the head's bookkeeping against a fake chain that keeps order.

The fake stands in for the stages below the head as they behave: each session's KV is the
tokens at its positions; a frame's rewind cuts it back, a frame must start at the next position
(else the step fails as a stage refuses it), and the final stage samples a deterministic model
(``model_token``: a function of everything before the position), every row of a verify window up to
the first rejected draft, and a window marked ``continues`` only if its first token is the last
sample at its position. Frames are run in the order they were sent and their outputs come back a
fixed latency later, so several windows really are in flight. A drafter that knows the model but
guesses wrong at chosen positions makes windows get cut short, and the ones behind them stale.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from skippy_stage.errors import DownstreamError, InvalidRequestError, SessionStateError
from skippy_stage.head.drafting import DraftBudget
from skippy_stage.head.scheduler import Scheduler, SchedulerLimits
from skippy_stage.head.tasks import End, Failed, Task, Tokens
from skippy_stage.head.windows import ChainTiming, WindowDepth
from skippy_stage.model.sampling import SamplingParams
from skippy_stage.stage.steps import Output, Outputs, Step

EOG = 1
WAIT_S = 10.0


def model_token(tokens: list[int]) -> int:
    """The fake model's greedy token after ``tokens``: mostly a repeating pattern, so a drafter that
    looks back can guess it."""
    last = tokens[-1] if tokens else 0
    return 100 + (last * 7 + len(tokens) // 13) % 50


def greedy(prompt: list[int], n: int, eog_after: int | None = None) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        token = EOG if eog_after is not None and len(out) == eog_after else model_token(prompt + out)
        if token == EOG:
            break
        out.append(token)
    return out


class _Flight:
    def __init__(self) -> None:
        self.sent_at = time.perf_counter()
        self.returned_at: float | None = None
        self._done = threading.Event()
        self._outputs: Outputs | None = None
        self._error: Exception | None = None

    def settle(self, outputs: Outputs | None, error: Exception | None) -> None:
        self._outputs, self._error = outputs, error
        self.returned_at = time.perf_counter()
        self._done.set()

    def result(self) -> Outputs:
        assert self._done.wait(WAIT_S), "the fake chain never answered"
        if self._error is not None:
            raise self._error
        return self._outputs


class OrderedChain:
    """The stages below the head, in order, with ``latency_s`` between a send and its outputs."""

    def __init__(self, *, latency_s: float = 0.02, eog_at: dict[str, int] | None = None,
                 fail: Callable[[Step], Exception | None] | None = None) -> None:
        self.latency_s = latency_s
        self.eog_at = eog_at or {}  # session -> position whose sample is EOG
        self.fail = fail
        self.kv: dict[str, list[int]] = {}
        self.last: dict[str, tuple[int, int]] = {}  # session -> (position, token) of its last sample
        self.sent: list[Step] = []
        self.drops: list[tuple[str, int]] = []  # (session, frames in flight when it was dropped)
        self.in_flight = 0
        self.max_in_flight = 0
        self.in_flight_at_send: list[int] = []  # per step sent, how many others were in flight
        self.stale_windows = 0
        self._lock = threading.Lock()

    def send(self, step: Step, timeout_s: float) -> _Flight:
        flight = _Flight()
        with self._lock:
            self.sent.append(step)
            self.in_flight_at_send.append(self.in_flight)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                error = self.fail(step) if self.fail is not None else None
                outputs = None if error is not None else Outputs([self._run(e) for e in step.entries], "fake")
            except SessionStateError as exc:
                outputs, error = None, exc

        def arrive() -> None:
            with self._lock:
                self.in_flight -= 1
            flight.settle(outputs, error)
        threading.Timer(self.latency_s, arrive).start()
        return flight

    def step(self, step: Step, timeout_s: float) -> Outputs:
        return self.send(step, timeout_s).result()

    def _run(self, entry) -> Output:
        sid = entry.session_id
        kv = self.kv.setdefault(sid, [])
        start = int(entry.positions[0])
        if entry.rewind and start < len(kv):
            del kv[start:]
        if start != len(kv):
            raise SessionStateError(f"positions[0]={start} for {sid}, expected {len(kv)}")
        tokens = [int(t) for t in entry.token_ids]
        kv.extend(tokens)
        if not entry.sample_last:
            return Output(sid)
        if entry.continues and self.last.get(sid) != (start, tokens[0]):
            self.stale_windows += 1
            return Output(sid, tokens=())  # stale: nothing sampled
        rows = range(len(tokens)) if entry.verify else [len(tokens) - 1]
        samples = []
        for i in rows:
            position = start + i + 1
            sample = EOG if self.eog_at.get(sid) == position else model_token(kv[:position])
            samples.append(sample)
            if entry.verify and i + 1 < len(tokens) and sample != tokens[i + 1]:
                break
        self.last[sid] = (start + (len(samples) if entry.verify else len(tokens)), samples[-1])
        return Output(sid, token=samples[-1], tokens=tuple(samples) if entry.verify else None)

    def drop(self, session_id: str) -> None:
        with self._lock:
            self.drops.append((session_id, self.in_flight))
            self.kv.pop(session_id, None)
            self.last.pop(session_id, None)


def guessing_drafter(wrong_at: set[int]) -> Callable[[list[int], int], list[int]]:
    """Drafts the model's own tokens, except a wrong one at each position of ``wrong_at``."""
    def draft(history: list[int], k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            position = len(history) + len(out)
            token = model_token(history + out)
            out.append(token + 1 if position in wrong_at else token)
        return out
    return draft


def run(chain: OrderedChain, prompt: list[int], *, max_tokens: int, depth: int = 4, k: int = 4,
        wrong_at: set[int] | frozenset[int] = frozenset(), session_id: str = "s") -> tuple[list[int], object]:
    scheduler = Scheduler(SchedulerLimits(lane_count=2, kv_pool_tokens=4096, max_context=1024, n_batch=64,
                                          n_ubatch=64, window_depth=depth),
                          step=chain.step, send=chain.send, drop=chain.drop, is_eog=lambda t: t == EOG)
    try:
        task = Task(session_id=session_id, prompt=prompt, sampling=SamplingParams(), max_tokens=max_tokens)
        task.drafter = guessing_drafter(set(wrong_at))
        task.draft_budget = DraftBudget(k, adaptive=False)
        scheduler.submit(task)
        return collect(task), task
    finally:
        scheduler.close()


def collect(task: Task) -> tuple[list[int], object]:
    tokens: list[int] = []
    while True:
        event = task.events.get(timeout=WAIT_S)
        if isinstance(event, End):
            return tokens
        if isinstance(event, Failed):
            raise event.error
        tokens.extend(event.items if isinstance(event, Tokens) else [event])


PROMPT = [5, 6, 7, 8, 9, 10]


def test_windows_in_flight_give_the_models_greedy_tokens_and_keep_several_windows_out():
    chain = OrderedChain(latency_s=0.03)
    tokens, _ = run(chain, PROMPT, max_tokens=60)
    assert tokens == greedy(PROMPT, 60)
    assert chain.max_in_flight >= 2
    assert any(e.continues for s in chain.sent for e in s.entries)


def test_a_window_cut_short_makes_the_ones_behind_it_stale_and_the_next_rewinds_to_where_the_session_is():
    wrong = {len(PROMPT) + p for p in (9, 23, 24, 40)}
    chain = OrderedChain(latency_s=0.03)
    tokens, _ = run(chain, PROMPT, max_tokens=60, wrong_at=wrong)
    assert tokens == greedy(PROMPT, 60)
    assert chain.stale_windows > 0  # windows sent behind a rejection were not sampled
    # after a rejection the next plain window starts at the session's real length, rewinding
    rewinds = [e for s in chain.sent for e in s.entries if not e.continues and int(e.positions[0]) > len(PROMPT)]
    assert rewinds and all(e.rewind for e in rewinds)


def test_an_end_of_generation_inside_a_window_ends_it_and_the_session_is_freed_after_its_windows_came_back():
    eog_position = len(PROMPT) + 17
    chain = OrderedChain(latency_s=0.03, eog_at={"s": eog_position})
    tokens, _ = run(chain, PROMPT, max_tokens=60)
    assert tokens == greedy(PROMPT, 60, eog_after=eog_position - len(PROMPT))
    deadline = time.monotonic() + WAIT_S
    while not chain.drops and time.monotonic() < deadline:
        time.sleep(0.01)
    assert chain.drops == [("s", 0)]


def test_max_tokens_inside_a_window_ends_it_with_exactly_that_many():
    chain = OrderedChain(latency_s=0.02)
    tokens, _ = run(chain, PROMPT, max_tokens=13)
    assert tokens == greedy(PROMPT, 13)


def test_depth_one_is_one_step_at_a_time():
    chain = OrderedChain(latency_s=0.01)
    tokens, _ = run(chain, PROMPT, max_tokens=30, depth=1, wrong_at={len(PROMPT) + 7})
    assert tokens == greedy(PROMPT, 30)
    assert chain.max_in_flight == 1
    assert not any(e.continues for s in chain.sent for e in s.entries)


def test_a_step_in_flight_that_fails_fails_the_generation_without_hanging():
    def fail(step: Step) -> Exception | None:
        if any(int(e.positions[0]) >= len(PROMPT) + 20 for e in step.entries):
            return DownstreamError("stage-2 refused the frame", stage_id="stage-2", code_name="INTERNAL")
        return None
    chain = OrderedChain(latency_s=0.02, fail=fail)
    with pytest.raises(DownstreamError, match="refused"):
        run(chain, PROMPT, max_tokens=60)


def test_a_session_waiting_for_a_lane_is_admitted_while_another_speculates():
    chain = OrderedChain(latency_s=0.02)
    scheduler = Scheduler(SchedulerLimits(lane_count=2, kv_pool_tokens=4096, max_context=1024, n_batch=64,
                                          n_ubatch=64, window_depth=4),
                          step=chain.step, send=chain.send, drop=chain.drop, is_eog=lambda t: t == EOG)
    try:
        first = Task(session_id="a", prompt=PROMPT, sampling=SamplingParams(), max_tokens=80)
        first.drafter, first.draft_budget = guessing_drafter(set()), DraftBudget(4, adaptive=False)
        scheduler.submit(first)
        time.sleep(0.1)
        second = Task(session_id="b", prompt=[11, 12, 13], sampling=SamplingParams(), max_tokens=20)
        scheduler.submit(second)
        assert collect(second) == greedy([11, 12, 13], 20)
        assert collect(first) == greedy(PROMPT, 80)
    finally:
        scheduler.close()


def depth_for(*, trip_s: float, gap_s: float, kept: float, limit: int = 8) -> int:
    timing = ChainTiming()
    timing.trip(trip_s)
    if gap_s:
        timing.gap(gap_s)
    return WindowDepth(limit, timing, kept=kept).depth()


def test_depth_grows_with_the_trip_the_windows_hide_and_with_how_often_they_are_kept():
    # 10 ms links: a 40 ms trip of which 8 ms compute
    assert depth_for(trip_s=0.040, gap_s=0.008, kept=0.9) == 8
    assert 1 < depth_for(trip_s=0.040, gap_s=0.008, kept=0.6) < 8
    assert depth_for(trip_s=0.040, gap_s=0.008, kept=0.1) == 1
    # loopback: a trip is nearly all compute, only near-certain windows pay
    assert depth_for(trip_s=0.010, gap_s=0.009, kept=0.8) == 1
    assert depth_for(trip_s=0.010, gap_s=0.009, kept=0.99) > 1
    # bounded by the config, and 1 until a trip was measured
    assert depth_for(trip_s=0.040, gap_s=0.008, kept=0.95, limit=3) == 3
    assert WindowDepth(8, ChainTiming()).depth() == 1


def test_a_requests_window_depth_bounds_its_own_windows():
    chain = OrderedChain(latency_s=0.02)
    scheduler = Scheduler(SchedulerLimits(lane_count=2, kv_pool_tokens=4096, max_context=1024, n_batch=64,
                                          n_ubatch=64, window_depth=4),
                          step=chain.step, send=chain.send, drop=chain.drop, is_eog=lambda t: t == EOG)
    try:
        task = Task(session_id="s", prompt=PROMPT, sampling=SamplingParams(), max_tokens=40, window_depth=1)
        task.drafter, task.draft_budget = guessing_drafter(set()), DraftBudget(4, adaptive=False)
        scheduler.submit(task)
        assert collect(task) == greedy(PROMPT, 40)
    finally:
        scheduler.close()
    assert chain.max_in_flight == 1


def test_a_window_that_continues_must_be_a_verify_window_and_a_request_names_a_depth_in_range():
    from skippy_stage.server.service import generate_spec_from_pb
    from skippy_stage.stage.steps import StageShape, StepEntry, runtime_entries
    from skippy_stage.v1 import stage_pb2 as pb

    shape = StageShape(stage_id="stage-0", stage_index=0, layer_start=0, layer_end=30, n_embd=8,
                       include_embeddings=True, include_output=True, wire_dtype="f32")
    step = Step(request_id="r", entries=[StepEntry(session_id="s", positions=range(3, 5), token_ids=[7, 8],
                                                   sample_last=True, continues=True)])
    with pytest.raises(InvalidRequestError, match=r"entries\[0\]\.continues needs verify"):
        runtime_entries(step, shape)
    for depth in (0, 9):
        request = pb.GenerateRequest(prompt="hi", speculative=pb.Speculative(drafter="ngram", window_depth=depth))
        with pytest.raises(InvalidRequestError, match=f"speculative.window_depth={depth}"):
            generate_spec_from_pb(request, max_tokens_limit=512)
    request = pb.GenerateRequest(prompt="hi", speculative=pb.Speculative(window_depth=2))
    assert generate_spec_from_pb(request, max_tokens_limit=512).speculative.window_depth == 2


def test_a_gap_measured_in_a_busy_moment_relaxes_until_windows_overlap_again():
    timing = ChainTiming()
    timing.trip(0.040)
    timing.gap(0.045)  # the host was busy: no second window pays
    depth = WindowDepth(4, timing, kept=0.9)
    assert depth.depth() == 1
    for _ in range(40):
        timing.relax()
    assert depth.depth() > 1


# -- a long prompt's chunks in flight ------------------------------------------------------------

def prefill_run(chain: OrderedChain, prompt: list[int], *, chunks: int, max_tokens: int = 8,
                speculate: bool = False) -> list[int]:
    scheduler = Scheduler(SchedulerLimits(lane_count=2, kv_pool_tokens=4096, max_context=1024, n_batch=64,
                                          n_ubatch=64, window_depth=4, prefill_chunks=chunks),
                          step=chain.step, send=chain.send, drop=chain.drop, is_eog=lambda t: t == EOG)
    try:
        task = Task(session_id="s", prompt=prompt, sampling=SamplingParams(), max_tokens=max_tokens)
        if speculate:
            task.drafter, task.draft_budget = guessing_drafter(set()), DraftBudget(4, adaptive=False)
        scheduler.submit(task)
        return collect(task)
    finally:
        scheduler.close()


LONG = [10 + i % 37 for i in range(64 * 4 + 9)]  # 5 chunks of n_ubatch=64, the last of 9


def chunk_starts(chain: OrderedChain) -> list[tuple[int, int]]:
    return [(int(e.positions[0]), len(e.positions)) for s in chain.sent for e in s.entries if e.phase == "prefill"]


@pytest.mark.parametrize("speculate", [False, True])
def test_a_long_prompts_chunks_leave_before_the_first_came_back_as_the_same_batches(speculate):
    alone = OrderedChain(latency_s=0.02)
    assert prefill_run(alone, LONG, chunks=1, speculate=speculate) == greedy(LONG, 8)
    assert alone.max_in_flight == 1 or speculate  # (speculation keeps windows in flight after the prompt)
    chain = OrderedChain(latency_s=0.02)
    assert prefill_run(chain, LONG, chunks=4, speculate=speculate) == greedy(LONG, 8)
    assert chain.max_in_flight == 4  # at most prefill_chunks of the prompt at once
    # the chunks are those of one at a time, each in a step of its own, the last one sampling
    assert chunk_starts(chain) == chunk_starts(alone) == [(0, 64), (64, 64), (128, 64), (192, 64), (256, 9)]
    prefill = [e for s in chain.sent for e in s.entries if e.phase == "prefill"]
    assert [e.sample_last for e in prefill] == [False] * 4 + [True]


def test_a_prompt_of_one_chunk_and_the_decode_after_a_long_one_run_one_step_at_a_time():
    chain = OrderedChain(latency_s=0.01)
    assert prefill_run(chain, PROMPT, chunks=4, max_tokens=12) == greedy(PROMPT, 12)
    assert chain.max_in_flight == 1
    chain = OrderedChain(latency_s=0.01)
    assert prefill_run(chain, LONG, chunks=4, max_tokens=12) == greedy(LONG, 12)
    decode = [i for i, s in enumerate(chain.sent) if s.entries[0].phase != "prefill"]
    assert len(decode) == 11  # one step per token after the prompt's, each alone in flight
    assert [chain.in_flight_at_send[i] for i in decode] == [0] * 11


def test_a_chunk_in_flight_that_fails_fails_the_generation_and_nothing_behind_it_counts():
    def fail(step: Step) -> Exception | None:
        if any(int(e.positions[0]) == 128 for e in step.entries):
            return DownstreamError("stage-2 refused the frame", stage_id="stage-2", code_name="INTERNAL")
        return None
    chain = OrderedChain(latency_s=0.02, fail=fail)
    with pytest.raises(DownstreamError, match="refused"):
        prefill_run(chain, LONG, chunks=4)
