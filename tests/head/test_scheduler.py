"""Scheduler: the head's bookkeeping of shared batches, admission and session release.

The chain of stages below the head is not under test here: a fake step samples a
deterministic token for every entry that asks for one (``token_at(session, position)``)
and records each request it received; the drop action records which sessions were freed.
A gate on the fake step holds a batch "on the wire", so tests decide exactly which tasks
are waiting when the scheduler next looks at its queue.
"""

from __future__ import annotations

import queue
import threading
import time
import types
import zlib
from collections.abc import Callable

import numpy as np
import pytest
from support.waiting import eventually

from skippy_stage.errors import (
    CapacityError,
    DownstreamError,
    InvalidFieldError,
    PrefixMissError,
    SkippyError,
    StageUnavailableError,
)
from skippy_stage.head import scheduler as scheduler_module
from skippy_stage.head.inflight import BatchCount
from skippy_stage.head.prefixes import PrefixCache
from skippy_stage.head.scheduler import Scheduler, SchedulerLimits
from skippy_stage.head.tasks import End, Failed, PromptLogprobs, Task, Tokens
from skippy_stage.model.logprobs import TokenLogprob
from skippy_stage.model.mrope import ImageGrid
from skippy_stage.model.projector import MediaSpan, media_keys
from skippy_stage.model.sampling import SamplingParams
from skippy_stage.stage.steps import PHASE_DECODE, PHASE_PREFILL, Output, Outputs, Step, StepEntry

EOG = 1  # the fake model's end-of-generation token; token_at never returns it
WAIT_S = 2.0  # longest any test waits for one event


def token_at(session_id: str, position: int) -> int:
    """The token the fake model puts at ``position`` of ``session_id``."""
    return 100 + (zlib.crc32(session_id.encode()) + 7 * position) % 1000


class FakeChain:
    """Stands in for the stages below the head: answers steps, records steps and drops."""

    def __init__(self, *, eog_at: dict[str, int] | None = None, delay_s: float = 0.0,
                 fail: Callable[[Step], SkippyError | None] | None = None) -> None:
        self.requests: list[Step] = []
        self.drops: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.eog_at = eog_at or {}
        self.delay_s = delay_s
        self.fail = fail
        self.drop_prompt_logprobs = False  # a final stage that does not return what was asked
        self.in_flight = 0
        self.max_in_flight = 0
        self._arrived: queue.SimpleQueue[Step] = queue.SimpleQueue()
        self._dropped: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.retired: list[str] = []
        self._retired: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._lock = threading.Lock()

    def step(self, request: Step, timeout_s: float) -> Outputs:
        with self._lock:
            self.requests.append(request)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self._arrived.put(request)
        try:
            if not self.gate.wait(WAIT_S):
                raise DownstreamError("the test never opened the gate", stage_id="fake")
            if self.delay_s:
                time.sleep(self.delay_s)
            error = self.fail(request) if self.fail is not None else None
            if error is not None:
                raise error
            return Outputs([self._output(e) for e in request.entries], "fake-final")
        finally:
            with self._lock:
                self.in_flight -= 1

    def _output(self, entry: StepEntry) -> Output:
        prompt_lps = None
        if entry.prompt_logprobs is not None and not self.drop_prompt_logprobs:
            # row i: the token at the next position, its "logprob" minus that position
            following = [*entry.token_ids[1:], *([] if entry.next_token is None else [entry.next_token])]
            prompt_lps = tuple(TokenLogprob(t, -float(entry.positions[0] + 1 + i), ()) for i, t in enumerate(following))
        if not entry.sample_last:
            return Output(entry.session_id, prompt_logprobs=prompt_lps)
        position = entry.positions[-1] + 1
        return Output(entry.session_id, EOG if self.eog_at.get(entry.session_id) == position
                      else token_at(entry.session_id, position), prompt_logprobs=prompt_lps)

    def drop(self, session_id: str) -> None:
        with self._lock:
            self.drops.append(session_id)
        self._dropped.put(session_id)

    def retire(self, session_id: str) -> None:
        with self._lock:
            self.retired.append(session_id)
        self._retired.put(session_id)

    def wait_retired(self, session_id: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while self._retired.get(timeout=max(0.01, deadline - time.monotonic())) != session_id:
            pass

    def next_request(self, timeout: float = WAIT_S) -> Step:
        """The next request to reach the fake (raises queue.Empty if none arrives in time)."""
        return self._arrived.get(timeout=timeout)

    def wait_dropped(self, *session_ids: str) -> None:
        seen: set[str] = set()
        deadline = time.monotonic() + WAIT_S
        while not set(session_ids) <= seen:
            seen.add(self._dropped.get(timeout=max(0.01, deadline - time.monotonic())))

    def sessions_per_request(self) -> list[set[str]]:
        with self._lock:
            return [{e.session_id for e in r.entries} for r in self.requests]


@pytest.fixture
def make_scheduler():
    """``(chain, **limits) -> Scheduler`` over the fake chain; every one is closed afterwards."""
    made: list[tuple[Scheduler, FakeChain]] = []

    def make(chain: FakeChain, batch_count: BatchCount | None = None, **limits: object) -> Scheduler:
        values: dict[str, object] = {"lane_count": 4, "kv_pool_tokens": 100_000, "max_context": 10_000,
                                     "n_batch": 512, "n_ubatch": 512, "step_timeout_s": WAIT_S, **limits}
        scheduler = Scheduler(SchedulerLimits(**values), step=chain.step, drop=chain.drop,
                              is_eog=lambda token: token == EOG, batch_count=batch_count)
        made.append((scheduler, chain))
        return scheduler

    yield make
    for scheduler, chain in made:
        chain.gate.set()
        scheduler.close()


def make_task(session_id: str, prompt_len: int, max_tokens: int) -> Task:
    return Task(session_id=session_id, prompt=list(range(10, 10 + prompt_len)), sampling=SamplingParams(),
                max_tokens=max_tokens)


def outcome(task: Task) -> tuple[list[int], End | Failed]:
    """Every token the task streamed, and the event that ended it."""
    tokens: list[int] = []
    while True:
        event = task.events.get(timeout=WAIT_S)
        if isinstance(event, (End, Failed)):
            return tokens, event
        tokens.append(event)


def expected_tokens(task: Task, n: int | None = None) -> list[int]:
    n = task.max_tokens if n is None else n
    return [token_at(task.session_id, len(task.prompt) + i) for i in range(n)]


def layout(request: Step) -> list[tuple[str, str]]:
    return [(e.session_id, "decode" if e.phase == PHASE_DECODE else "prefill") for e in request.entries]


# -- shared batches ------------------------------------------------------------------


def test_active_sessions_advance_together_in_one_request_per_step_decodes_first(make_scheduler):
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain)
    a = make_task("a", 3, 4)
    scheduler.submit(a)
    assert layout(chain.next_request()) == [("a", "prefill")]
    b, c = make_task("b", 2, 4), make_task("c", 2, 4)
    scheduler.submit(b)
    scheduler.submit(c)
    chain.gate.set()

    for task in (a, b, c):
        assert outcome(task) == (expected_tokens(task), End("length"))
    chain.wait_dropped("a", "b", "c")
    assert [layout(r) for r in chain.requests] == [
        [("a", "prefill")],
        [("a", "decode"), ("b", "prefill"), ("c", "prefill")],
        [("a", "decode"), ("b", "decode"), ("c", "decode")],
        [("a", "decode"), ("b", "decode"), ("c", "decode")],
        [("b", "decode"), ("c", "decode")],
    ]
    assert len({r.request_id for r in chain.requests}) == len(chain.requests)
    for request in chain.requests:
        for entry in request.entries:
            if entry.phase == PHASE_DECODE:
                # A decode feeds back the token sampled for this very position.
                assert list(entry.token_ids) == [token_at(entry.session_id, entry.positions[0])]
                assert entry.sample_last
    assert scheduler.steps == 5


def test_prompts_are_prefilled_in_n_ubatch_chunks_within_the_n_batch_budget(make_scheduler):
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain, n_ubatch=4, n_batch=6)
    a = make_task("a", 10, 2)
    scheduler.submit(a)
    chain.next_request()
    b = make_task("b", 6, 2)
    scheduler.submit(b)
    chain.gate.set()

    assert outcome(a) == (expected_tokens(a), End("length"))
    assert outcome(b) == (expected_tokens(b), End("length"))
    chain.wait_dropped("a", "b")
    steps = [[(e.session_id, list(e.positions), e.sample_last) for e in r.entries] for r in chain.requests]
    assert steps == [
        [("a", [0, 1, 2, 3], False)],
        [("a", [4, 5, 6, 7], False), ("b", [0, 1], False)],  # b gets what is left of the budget
        [("a", [8, 9], True), ("b", [2, 3, 4, 5], True)],  # only a prompt's last chunk samples
        [("a", [10], True), ("b", [6], True)],
    ]
    prompts = {"a": a.prompt, "b": b.prompt}
    for request in chain.requests:
        assert sum(len(e.positions) for e in request.entries) <= 6
        for entry in request.entries:
            if entry.phase == PHASE_PREFILL:
                assert list(entry.token_ids) == prompts[entry.session_id][entry.positions[0] : entry.positions[-1] + 1]


# -- how a task ends -----------------------------------------------------------------


def test_a_task_ends_with_length_after_max_tokens_and_its_session_is_dropped_once(make_scheduler):
    chain = FakeChain()
    scheduler = make_scheduler(chain)
    task = make_task("x", 5, 3)
    scheduler.submit(task)
    assert outcome(task) == (expected_tokens(task), End("length"))
    chain.wait_dropped("x")
    assert chain.drops == ["x"]
    assert eventually(scheduler.active, lambda n: n == 0) == 0  # the drop wakes us before the group is gone
    assert len(chain.requests) == 3  # one prefill, two decodes


def test_a_task_ends_with_stop_on_an_end_of_generation_token_which_is_not_streamed(make_scheduler):
    chain = FakeChain(eog_at={"x": 5 + 2})
    scheduler = make_scheduler(chain)
    task = make_task("x", 5, 10)
    scheduler.submit(task)
    assert outcome(task) == (expected_tokens(task, 2), End("stop"))
    chain.wait_dropped("x")
    assert chain.drops == ["x"]
    assert eventually(scheduler.active, lambda n: n == 0) == 0  # the drop wakes us before the group is gone


def test_a_task_ends_with_length_when_its_session_fills_max_context(make_scheduler):
    chain = FakeChain()
    scheduler = make_scheduler(chain, max_context=8)
    task = make_task("x", 5, 100)
    scheduler.submit(task)
    assert outcome(task) == (expected_tokens(task, 3), End("length"))
    chain.wait_dropped("x")
    assert max(max(e.positions) for r in chain.requests for e in r.entries) < 8


def deliveries(task: Task) -> tuple[list[list[int]], End | Failed]:
    """The task's tokens as its handler was handed them (one list a wake), and the end."""
    handed: list[list[int]] = []
    while True:
        event = task.events.get(timeout=WAIT_S)
        if isinstance(event, (End, Failed)):
            return handed, event
        handed.append(list(event.items) if isinstance(event, Tokens) else [event])


class StepClock:
    """The scheduler's clock, moved by steps only (``ClockedChain``): what falls within a stream
    interval then depends on the steps taken, not on this machine's speed."""

    def __init__(self) -> None:
        self.now = time.monotonic()  # tasks stamp their enqueue time from the real clock
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class ClockedChain(FakeChain):
    """A FakeChain each of whose steps takes ``step_s`` on ``clock``."""

    def __init__(self, clock: StepClock, step_s: float) -> None:
        super().__init__()
        self.clock, self.step_s = clock, step_s

    def step(self, request: Step, timeout_s: float) -> Outputs:
        self.clock.advance(self.step_s)
        return super().step(request, timeout_s)


def test_a_stream_interval_hands_tokens_over_together_the_first_alone_and_all_before_the_end(
        make_scheduler, monkeypatch):
    """stream_interval_s: tokens within the interval of the task's last delivery wait in the
    scheduler (its handler is not woken for them) and go over together; the end delivers the rest."""
    clock = StepClock()
    monkeypatch.setattr(scheduler_module, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=time.sleep))
    scheduler = make_scheduler(ClockedChain(clock, step_s=0.01), stream_interval_s=0.045)
    task = make_task("x", 5, 40)
    scheduler.submit(task)
    handed, end = deliveries(task)
    assert end == End("length")
    assert [t for batch in handed for t in batch] == expected_tokens(task)
    # The first goes at once; then a delivery once 45 ms have passed since the last one: each
    # fifth step of 10 ms; the end hands over what is left (39 = 7 x 5 + 4).
    assert [len(batch) for batch in handed] == [1, 5, 5, 5, 5, 5, 5, 5, 4]


def test_a_requests_own_stream_interval_overrides_the_heads_either_way(make_scheduler):
    """Task.stream_interval_s (GenerateRequest.stream_interval_ms): a client that wants the whole
    text is handed its tokens together under a head that streams each; one that wants each token
    gets each under a head that holds them."""
    def handed(head_s: float, own_s: float) -> tuple[Task, list[list[int]]]:
        scheduler = make_scheduler(FakeChain(delay_s=0.002), stream_interval_s=head_s)
        task = make_task(f"own-{own_s}", 5, 20)
        task.stream_interval_s = own_s
        scheduler.submit(task)
        batches, end = deliveries(task)
        assert end == End("length")
        return task, batches

    whole, batches = handed(head_s=0.0, own_s=10.0)
    assert batches == [expected_tokens(whole, 1), expected_tokens(whole)[1:]]  # the first, then the rest at the end
    each, batches = handed(head_s=10.0, own_s=0.0)
    assert batches == [[token] for token in expected_tokens(each)]


def test_held_tokens_reach_the_handler_before_a_stop_or_a_failure(make_scheduler):
    chain = FakeChain(eog_at={"x": 5 + 6})
    scheduler = make_scheduler(chain, stream_interval_s=10.0)  # nothing but an end sends them
    task = make_task("x", 5, 20)
    scheduler.submit(task)
    handed, end = deliveries(task)
    assert (handed, end) == ([expected_tokens(task, 1), expected_tokens(task, 6)[1:]], End("stop"))

    error = DownstreamError("stage stage-2 failed", stage_id="stage-2", code_name="INTERNAL")
    failing = FakeChain(fail=lambda request: error if len(chain_steps(failing)) > 4 else None)
    scheduler = make_scheduler(failing, stream_interval_s=10.0)
    task = make_task("y", 5, 20)
    scheduler.submit(task)
    handed, end = deliveries(task)
    assert end == Failed(error)
    assert [t for batch in handed for t in batch] == expected_tokens(task, 4)


def chain_steps(chain: FakeChain) -> list[Step]:
    with chain._lock:
        return list(chain.requests)


# -- admission -----------------------------------------------------------------------


def test_a_full_admission_queue_refuses_with_a_retry_hint(make_scheduler):
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain, lane_count=1, max_queue=1)
    running, waiting = make_task("running", 2, 2), make_task("waiting", 2, 2)
    scheduler.submit(running)
    chain.next_request()  # admitted: the only lane is taken
    scheduler.submit(waiting)
    assert scheduler.queue_depth() == 1
    with pytest.raises(CapacityError, match="retry after"):
        scheduler.submit(make_task("refused", 2, 2))
    chain.gate.set()

    assert outcome(running) == (expected_tokens(running), End("length"))
    assert outcome(waiting) == (expected_tokens(waiting), End("length"))
    chain.wait_dropped("running", "waiting")
    assert all(len(s) == 1 for s in chain.sessions_per_request())  # one lane: never together
    assert "refused" not in chain.drops


def test_an_idle_scheduler_acts_on_a_submit_at_once_not_on_its_next_look(make_scheduler, monkeypatch):
    # An idle worker sleeps until notified; with its safety-net look 30 s away, only the notify
    # of submit can start the task within the test's wait.
    monkeypatch.setattr(scheduler_module, "IDLE_RECHECK_S", 30.0)
    chain = FakeChain()
    scheduler = make_scheduler(chain, max_inflight=2)
    assert eventually(scheduler.asleep, lambda n: n == 2) == 2  # both wait, their next look 30 s away
    task = make_task("late", 2, 3)
    scheduler.submit(task)
    assert outcome(task) == (expected_tokens(task), End("length"))


def test_an_idle_worker_fails_a_queued_task_at_its_admission_deadline(make_scheduler, monkeypatch):
    # One lane, held by a task whose step is stuck on the wire: the only worker that could look
    # at the queue is the idle one, and it must wake for the queued task's deadline by itself.
    monkeypatch.setattr(scheduler_module, "IDLE_RECHECK_S", 30.0)
    chain = FakeChain()
    scheduler = make_scheduler(chain, lane_count=1, max_inflight=2, max_queue_wait_s=0.2)
    running, waiting = make_task("running", 2, 1_000_000), make_task("waiting", 2, 2)
    chain.gate.clear()
    scheduler.submit(running)
    chain.next_request()
    scheduler.submit(waiting)

    tokens, event = outcome(waiting)
    assert chain.in_flight == 1, "failed by the busy worker after its step, not by the idle one on time"
    assert tokens == [] and isinstance(event, Failed) and "admission_wait_s=0.2" in str(event.error)
    chain.gate.set()
    running.cancel()
    chain.wait_dropped("running")


def test_a_task_waiting_longer_than_max_queue_wait_fails_naming_the_wait(make_scheduler):
    chain = FakeChain(delay_s=0.005)
    scheduler = make_scheduler(chain, lane_count=1, max_queue_wait_s=0.2)
    running, waiting = make_task("running", 2, 1_000_000), make_task("waiting", 2, 2)
    scheduler.submit(running)
    chain.next_request()
    submitted = time.monotonic()
    scheduler.submit(waiting)

    tokens, event = outcome(waiting)
    waited = time.monotonic() - submitted
    assert tokens == []
    assert isinstance(event, Failed) and isinstance(event.error, CapacityError)
    message = str(event.error)
    assert "waited" in message and "admission_wait_s=0.2" in message and "retry after" in message
    assert waited >= 0.2  # it waited admission_wait_s out (no upper bound: CI machines stall)
    running.cancel()
    chain.wait_dropped("running")
    assert "waiting" not in set().union(*chain.sessions_per_request())
    assert "waiting" not in chain.drops  # it never held a session


@pytest.mark.parametrize(("kv_pool_tokens", "together"), [(39, False), (40, True)], ids=["pool-too-small", "pool-fits"])
def test_a_task_whose_kv_reservation_does_not_fit_waits_for_the_pool(make_scheduler, kv_pool_tokens, together):
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain, lane_count=4, kv_pool_tokens=kv_pool_tokens)
    first, second = make_task("first", 10, 10), make_task("second", 10, 10)  # 20 KV cells each
    scheduler.submit(first)
    chain.next_request()
    scheduler.submit(second)
    chain.gate.set()

    assert outcome(first) == (expected_tokens(first), End("length"))
    assert outcome(second) == (expected_tokens(second), End("length"))
    chain.wait_dropped("first", "second")
    sessions = chain.sessions_per_request()
    if together:
        assert {"first", "second"} in sessions
    else:
        last_first = max(i for i, s in enumerate(sessions) if "first" in s)
        first_second = min(i for i, s in enumerate(sessions) if "second" in s)
        assert last_first < first_second


def test_a_cancelled_waiting_task_is_skipped_without_a_session(make_scheduler):
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain, lane_count=1)
    running, waiting = make_task("running", 2, 2), make_task("waiting", 2, 2)
    scheduler.submit(running)
    chain.next_request()
    scheduler.submit(waiting)
    waiting.cancel()
    chain.gate.set()

    assert outcome(running) == (expected_tokens(running), End("length"))
    chain.wait_dropped("running")
    assert "waiting" not in set().union(*chain.sessions_per_request())
    assert "waiting" not in chain.drops
    assert scheduler.queue_depth() == 0


# -- failure and cancellation --------------------------------------------------------


@pytest.mark.parametrize(("code_name", "limits"), [("INTERNAL", {}), ("UNAVAILABLE", {"recovery_wait_s": 0})],
                         ids=["not-recoverable", "recovery-disabled"])
def test_a_failed_step_fails_every_task_of_its_batch_and_drops_their_sessions(make_scheduler, code_name, limits):
    error = DownstreamError("stage stage-2 failed", stage_id="stage-2", code_name=code_name)
    chain = FakeChain(fail=lambda request: error if len(request.entries) == 2 else None)
    chain.gate.clear()
    scheduler = make_scheduler(chain, **limits)
    a, b = make_task("a", 2, 5), make_task("b", 2, 5)
    scheduler.submit(a)
    chain.next_request()
    scheduler.submit(b)
    chain.gate.set()

    assert outcome(a) == (expected_tokens(a, 1), Failed(error))
    assert outcome(b) == ([], Failed(error))
    chain.wait_dropped("a", "b")
    assert sorted(chain.drops) == ["a", "b"]
    assert eventually(scheduler.active, lambda n: n == 0) == 0  # the drop wakes us before the group is gone
    # The scheduler itself survives the failure.
    c = make_task("c", 2, 2)
    scheduler.submit(c)
    assert outcome(c) == (expected_tokens(c), End("length"))


def test_cancel_stops_a_running_task_and_drops_its_session(make_scheduler):
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain)
    task = make_task("x", 2, 100)
    scheduler.submit(task)
    chain.next_request()
    task.cancel()
    chain.gate.set()

    chain.wait_dropped("x")
    assert chain.drops == ["x"]
    assert eventually(scheduler.active, lambda n: n == 0) == 0  # the drop wakes us before the group is gone
    with pytest.raises(queue.Empty):
        chain.next_request(timeout=0.2)
    assert len(chain.requests) == 1


# -- concurrency and shutdown --------------------------------------------------------


def test_max_inflight_two_has_two_disjoint_groups_on_the_wire_at_once(make_scheduler):
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain, lane_count=2, max_inflight=2)
    a, b = make_task("a", 2, 3), make_task("b", 2, 3)
    scheduler.submit(a)
    assert layout(chain.next_request()) == [("a", "prefill")]
    scheduler.submit(b)
    assert layout(chain.next_request()) == [("b", "prefill")]  # while a's step is still held
    assert chain.in_flight == 2
    chain.gate.set()

    assert outcome(a) == (expected_tokens(a), End("length"))
    assert outcome(b) == (expected_tokens(b), End("length"))
    chain.wait_dropped("a", "b")
    assert chain.max_in_flight == 2
    assert all(len(s) == 1 for s in chain.sessions_per_request())


def test_max_inflight_one_keeps_a_second_task_off_the_wire_until_the_step_returns(make_scheduler):
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain, lane_count=2, max_inflight=1)
    a, b = make_task("a", 2, 3), make_task("b", 2, 3)
    scheduler.submit(a)
    chain.next_request()
    scheduler.submit(b)
    with pytest.raises(queue.Empty):
        chain.next_request(timeout=0.2)
    chain.gate.set()
    assert outcome(b) == (expected_tokens(b), End("length"))
    assert chain.max_in_flight == 1


def measured_count(ring_share: float, cap: int) -> BatchCount:
    """A count of batches as the head measures it, its ring ``ring_share`` of whatever a step of the
    fake chain takes (so the count does not depend on this machine's speed)."""
    batches = BatchCount(cap=cap, stages=3, shared_cores=True, ring_s=lambda: batches.step_s * ring_share)
    batches.step(0.09)
    return batches


def scheduler_workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("scheduler-")}


def test_sessions_that_come_at_once_are_shared_fairly_between_the_batches_in_flight(make_scheduler):
    """With two batches worth keeping in flight (links a third of a step), six sessions become two
    batches of at most three on the wire at once — not one worker's group of five and another's of one."""
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain, lane_count=6, max_inflight=4, batch_count=measured_count(1 / 3, cap=4))
    tasks = [make_task(f"s{i}", 2, 4) for i in range(6)]
    for task in tasks:
        scheduler.submit(task)
    chain.next_request()
    chain.next_request()
    chain.gate.set()
    for task in tasks:
        assert outcome(task) == (expected_tokens(task), End("length"))
    chain.wait_dropped(*(t.session_id for t in tasks))
    assert chain.max_in_flight == 2
    groups = chain.sessions_per_request()
    assert max(len(g) for g in groups) == 3, groups


def test_a_request_with_several_choices_is_admitted_while_lanes_are_free_whatever_the_fair_share(make_scheduler):
    """Three choices of one prompt need three lanes in one group at once, above the fair share of two
    batches that each run a session: the smaller group takes them as soon as they come."""
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain, lane_count=8, max_inflight=2, batch_count=measured_count(1 / 3, cap=2))
    first, second = make_task("a", 2, 6), make_task("b", 2, 6)
    scheduler.submit(first)
    chain.next_request()
    scheduler.submit(second)
    chain.next_request()
    family = [make_task(f"n{i}", 2, 3) for i in range(3)]
    scheduler.submit(family[0], forks=family[1:], share_prompt=False)
    chain.gate.set()
    for task in (first, second, *family):
        assert outcome(task) == (expected_tokens(task), End("length"))
    together = [s for s in chain.sessions_per_request() if {"n0", "n1", "n2"} <= s]
    assert together, "the three choices ran in one batch"
    assert any(len(s & {"a", "b"}) == 1 for s in together), "beside a session still running: not after it"


def test_where_one_batch_is_enough_one_worker_runs_every_session_in_one_batch(make_scheduler):
    """On loopback (the ring a few percent of a step) the head keeps one batch, and starts no more
    workers than that: an idle worker still costs its steps."""
    chain = FakeChain()
    chain.gate.clear()
    before = scheduler_workers()
    scheduler = make_scheduler(chain, lane_count=4, max_inflight=4, batch_count=measured_count(0.02, cap=4))
    tasks = [make_task(f"t{i}", 2, 3) for i in range(4)]
    scheduler.submit(tasks[0])
    chain.next_request()
    for task in tasks[1:]:
        scheduler.submit(task)
    with pytest.raises(queue.Empty):
        chain.next_request(timeout=0.2)
    assert len(scheduler_workers() - before) == 1
    chain.gate.set()
    for task in tasks:
        assert outcome(task) == (expected_tokens(task), End("length"))
    assert chain.max_in_flight == 1
    assert {"t0", "t1", "t2", "t3"} in chain.sessions_per_request()


def test_close_fails_queued_tasks_refuses_new_ones_and_lets_admitted_ones_finish(make_scheduler):
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain, lane_count=1)
    running, waiting = make_task("running", 2, 3), make_task("waiting", 2, 3)
    scheduler.submit(running)
    chain.next_request()
    scheduler.submit(waiting)
    closer = threading.Thread(target=scheduler.close)
    closer.start()

    tokens, event = outcome(waiting)
    assert tokens == []
    assert isinstance(event, Failed) and isinstance(event.error, StageUnavailableError)
    assert "shutting down" in str(event.error)
    with pytest.raises(StageUnavailableError, match="shutting down"):
        scheduler.submit(make_task("late", 2, 3))
    chain.gate.set()
    assert outcome(running) == (expected_tokens(running), End("length"))
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert "waiting" not in set().union(*chain.sessions_per_request())


def test_close_still_drops_the_sessions_of_tasks_that_finish_while_closing(make_scheduler):
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain, lane_count=1)
    running = make_task("running", 2, 3)
    scheduler.submit(running)
    chain.next_request()
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    chain.gate.set()
    assert outcome(running) == (expected_tokens(running), End("length"))
    closer.join(WAIT_S)
    assert chain.drops == ["running"]


def test_a_step_that_crashes_fails_its_tasks_and_the_worker_keeps_serving(make_scheduler):
    """Anything a step raises (not only SkippyError) must reach the waiting clients."""
    chain = FakeChain()
    calls = {"n": 0}
    real_step = chain.step

    def flaky(request, timeout):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("boom")
        return real_step(request, timeout)

    chain.step = flaky
    scheduler = make_scheduler(chain, lane_count=1)
    first = make_task("first", 2, 3)
    scheduler.submit(first)
    event = first.events.get(timeout=5)
    assert isinstance(event, Failed) and "boom" in str(event.error)
    second = make_task("second", 2, 3)
    scheduler.submit(second)
    events = [second.events.get(timeout=5) for _ in range(4)]
    assert isinstance(events[-1], End)


# -- resident prefixes ----------------------------------------------------------------------


def make_prefix_scheduler(chain: FakeChain, events: list, capacity: int = 4, **limits: object) -> Scheduler:
    values: dict[str, object] = {"lane_count": 4, "kv_pool_tokens": 100_000, "max_context": 10_000,
                                 "n_batch": 512, "n_ubatch": 512, "step_timeout_s": WAIT_S, **limits}
    return Scheduler(SchedulerLimits(**values), step=chain.step, drop=chain.drop, is_eog=lambda token: token == EOG,
                     retire=chain.retire, prefixes=PrefixCache(capacity),
                     on_prefix=lambda kind, tokens: events.append((kind, tokens)))


def follow_up(scheduler: Scheduler, chain: FakeChain, new_tokens: list[int]) -> Task:
    """Run a first turn ("turn-1", 10 prompt tokens, 3 generated) to its retirement, then submit the
    next turn: its prompt, the two tokens it fed back, then ``new_tokens``."""
    first = make_task("turn-1", prompt_len=10, max_tokens=3)
    scheduler.submit(first)
    tokens, end = outcome(first)
    assert isinstance(end, End)
    chain.wait_retired("turn-1")
    second = Task(session_id="turn-2", prompt=first.prompt + tokens[:2] + new_tokens, sampling=SamplingParams(),
                  max_tokens=2)
    scheduler.submit(second)
    return second


def test_a_finished_session_is_retired_and_the_next_prompt_starts_from_it(make_scheduler):
    chain, events = FakeChain(), []
    scheduler = make_prefix_scheduler(chain, events)
    try:
        second = follow_up(scheduler, chain, [900, 901])
        _, end = outcome(second)
        assert isinstance(end, End) and second.cached_tokens == 12
        entry = next(e for r in chain.requests for e in r.entries if e.session_id == "turn-2")
        assert entry.prefix_id == "turn-1" and list(entry.positions) == [12, 13]
        assert ("hit", 12) in events and ("miss", 0) in events  # the first turn found nothing
    finally:
        scheduler.close()


def test_a_stage_that_lost_the_prefix_makes_the_session_prefill_from_scratch(make_scheduler):
    def fail(request: Step) -> SkippyError | None:
        if any(e.prefix_id for e in request.entries):
            return DownstreamError("stage stage-2: prefix miss: prefix_id='turn-1' is not resident on stage stage-2",
                                   stage_id="stage-2", code_name="FAILED_PRECONDITION")
        return None

    chain, events = FakeChain(fail=fail), []
    scheduler = make_prefix_scheduler(chain, events, recovery_wait_s=0.0)  # a miss recovers even so
    try:
        second = follow_up(scheduler, chain, [900])
        streamed, end = outcome(second)
        assert isinstance(end, End) and len(streamed) == 2 and second.cached_tokens == 0
        assert ("miss", 0) in events[1:]
        redo = [e for r in chain.requests for e in r.entries if e.session_id == second.session_id]
        assert second.session_id != "turn-2" and list(redo[0].positions)[0] == 0 and redo[0].prefix_id is None
        chain.wait_dropped("turn-2", "turn-1")  # the half-run session, and the prefix stages below still hold
    finally:
        scheduler.close()


def test_a_prefix_the_head_stage_itself_no_longer_holds_restarts_only_that_session(make_scheduler):
    """Stage 0 refuses the whole batch before running any of it: the other sessions go on as
    they were, the one that named the prefix prefills from 0 under the same id."""
    def fail(request: Step) -> SkippyError | None:
        if any(e.prefix_id for e in request.entries):
            return PrefixMissError("prefix_id='turn-1' is not resident on stage stage-0")
        return None

    chain, events = FakeChain(fail=fail), []
    scheduler = make_prefix_scheduler(chain, events)
    try:
        second = follow_up(scheduler, chain, [900])
        streamed, end = outcome(second)
        assert isinstance(end, End) and streamed == expected_tokens(second) and second.session_id == "turn-2"
        entries = [e for r in chain.requests for e in r.entries if e.session_id == "turn-2"]
        assert entries[0].prefix_id == "turn-1" and list(entries[1].positions)[0] == 0 and entries[1].prefix_id is None
        assert ("miss", 0) in events[1:]
    finally:
        scheduler.close()


# -- n choices of one prompt ---------------------------------------------------------


def family_layout(request: Step) -> list[tuple[str, list[int], str | None]]:
    return [(e.session_id, list(e.positions), e.fork_of) for e in request.entries]



def test_choices_of_a_prompt_that_ends_inside_an_m_rope_image_each_prefill_it(make_scheduler):
    """No copy keeps part of an M-RoPE image (its rows share one model position): choices of a prompt
    whose last row is inside one do not fork, each prefills the prompt itself."""
    chain = FakeChain()
    scheduler = make_scheduler(chain)
    rows = np.zeros((6, 4), dtype=np.float32)
    span = MediaSpan(2, rows, "cd" * 32, media_keys("cd" * 32, 6), grid=(3, 2))
    family = [Task(session_id=s, prompt=[10, 11, *span.key], sampling=SamplingParams(), max_tokens=2, media=(span,))
              for s in "ab"]
    scheduler.submit(family[0], family[1:])
    for task in family:
        assert outcome(task)[1] == End("length")
    assert all(e.fork_of is None for r in chain.requests for e in r.entries)
    images = [(e.session_id, list(e.positions), e.image) for r in chain.requests for e in r.entries if e.image]
    assert sorted(images) == [("a", [2, 3, 4, 5, 6, 7], ImageGrid(3, 2)), ("b", [2, 3, 4, 5, 6, 7], ImageGrid(3, 2))]

def test_forks_join_their_source_at_its_prompts_last_token_and_copy_the_rest(make_scheduler):
    """The source prefills all but the prompt's last token (no sample), then one step feeds that token
    to it and to every fork, each fork naming the source: the prompt is prefilled once."""
    chain = FakeChain()
    scheduler = make_scheduler(chain, n_ubatch=4)
    a, b, c = make_task("a", 6, 2), make_task("b", 6, 2), make_task("c", 6, 2)
    scheduler.submit(a, [b, c])
    for task in (a, b, c):
        assert outcome(task) == (expected_tokens(task), End("length"))
    assert [family_layout(r) for r in chain.requests[:3]] == [
        [("a", [0, 1, 2, 3], None)],
        [("a", [4], None)],
        [("a", [5], None), ("b", [5], "a"), ("c", [5], "a")],
    ]
    assert not chain.requests[1].entries[0].sample_last
    assert all(e.sample_last and e.token_ids == [15] for e in chain.requests[2].entries)
    assert all(e.fork_of is None for r in chain.requests[3:] for e in r.entries)


def test_a_family_is_admitted_whole_or_waits_and_more_choices_than_lanes_are_refused(make_scheduler):
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain, lane_count=3)
    solo = make_task("solo", 2, 2)
    scheduler.submit(solo)
    chain.next_request()
    a, b, c = make_task("a", 3, 1), make_task("b", 3, 1), make_task("c", 3, 1)
    scheduler.submit(a, [b, c])  # three lanes, one taken: the family waits for all three
    chain.gate.set()
    assert outcome(solo)[1] == End("length")
    for task in (a, b, c):
        assert outcome(task) == (expected_tokens(task), End("length"))
    family = {"a", "b", "c"}
    assert [s & family for s in chain.sessions_per_request() if s & family] == [{"a"}, family]
    with pytest.raises(InvalidFieldError, match="n=4 choices need as many lanes"):
        scheduler.submit(make_task("x", 3, 1), [make_task(f"x{i}", 3, 1) for i in range(3)])


def test_a_family_whose_kv_cannot_fit_the_pool_at_once_is_refused_naming_n(make_scheduler):
    scheduler = make_scheduler(FakeChain(), kv_pool_tokens=100, max_context=100)
    with pytest.raises(InvalidFieldError, match="need 120 KV cells at once; this pipeline holds kv_pool_tokens=100"):
        scheduler.submit(make_task("x", 10, 50), [make_task("y", 10, 50)])


def test_a_fork_cancelled_while_its_source_holds_is_never_forked(make_scheduler):
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain, n_ubatch=2)
    a, b, c = make_task("a", 5, 1), make_task("b", 5, 1), make_task("c", 5, 1)
    scheduler.submit(a, [b, c])
    chain.next_request()  # a's first chunk is on the wire
    b.cancel()
    chain.gate.set()
    for task in (a, c):
        assert outcome(task) == (expected_tokens(task), End("length"))
    assert "b" not in {e.session_id for r in chain.requests for e in r.entries}
    assert ("c", [4], "a") in [row for r in chain.requests for row in family_layout(r)]


def test_forks_of_a_source_cancelled_in_the_queue_still_run_prefilling_for_themselves(make_scheduler):
    chain = FakeChain()
    chain.gate.clear()
    scheduler = make_scheduler(chain, lane_count=2)
    blocker = make_task("blocker", 2, 1)
    scheduler.submit(blocker)
    chain.next_request()
    a, b = make_task("a", 3, 2), make_task("b", 3, 2)
    scheduler.submit(a, [b])
    a.cancel()
    chain.gate.set()
    assert outcome(b) == (expected_tokens(b), End("length"))
    assert ("b", [0, 1, 2], None) in [row for r in chain.requests for row in family_layout(r)]
    assert "a" not in {e.session_id for r in chain.requests for e in r.entries}


def test_without_a_copyable_state_every_choice_prefills_the_prompt(make_scheduler):
    chain = FakeChain()
    scheduler = make_scheduler(chain)
    a, b = make_task("a", 3, 1), make_task("b", 3, 1)
    scheduler.submit(a, [b], share_prompt=False)
    for task in (a, b):
        assert outcome(task) == (expected_tokens(task), End("length"))
    assert family_layout(chain.requests[0]) == [("a", [0, 1, 2], None), ("b", [0, 1, 2], None)]


def test_a_failed_fork_step_recovers_every_choice_by_prefilling_it_alone(make_scheduler):
    """The chain fails the step that forks: once it answers again each choice, the forks too,
    re-prefills its prompt under a new session id, with no fork."""
    failed = []

    def fail(request: Step) -> SkippyError | None:
        if any(e.fork_of for e in request.entries) and not failed:
            failed.append(request)
            return DownstreamError("stage-1 went away", stage_id="stage-1", code_name="UNAVAILABLE")
        return None

    chain = FakeChain(fail=fail)
    scheduler = make_scheduler(chain)
    a, b = make_task("a", 3, 2), make_task("b", 3, 2)
    scheduler.submit(a, [b])
    for task in (a, b):
        tokens, end = outcome(task)
        assert end == End("length") and len(tokens) == 2
    assert failed
    after = [row for r in chain.requests[chain.requests.index(failed[0]) + 1:] for row in family_layout(r)]
    assert all(fork_of is None for _, _, fork_of in after)
    assert {(len(positions), positions[0]) for _, positions, _ in after if positions[0] == 0} == {(3, 0)}


# -- a prompt's logprobs -------------------------------------------------------------


def test_a_prompts_logprobs_are_asked_chunk_by_chunk_and_arrive_before_the_first_token(make_scheduler):
    """Each prompt chunk asks for its rows' logprobs and names the next chunk's first token; the
    task's first event is the prompt's tokens with a logprob for each after the first, by position."""
    chain = FakeChain()
    scheduler = make_scheduler(chain, n_ubatch=4)
    task = make_task("a", 6, 2)
    task.prompt_logprobs = 1
    scheduler.submit(task)
    event = task.events.get(timeout=WAIT_S)
    assert isinstance(event, PromptLogprobs)
    assert event.tokens == tuple(task.prompt) and event.logprobs[0] is None
    assert [(lp.token, lp.logprob) for lp in event.logprobs[1:]] == [(task.prompt[p], -float(p)) for p in range(1, 6)]
    assert outcome(task) == (expected_tokens(task), End("length"))
    prefills = [e for r in chain.requests for e in r.entries if e.phase == PHASE_PREFILL]
    assert [(list(e.positions), e.prompt_logprobs, e.next_token) for e in prefills] == [
        ([0, 1, 2, 3], 1, task.prompt[4]), ([4, 5], 1, None)]


def test_a_final_stage_that_drops_a_prompts_logprobs_fails_the_task_naming_them(make_scheduler):
    chain = FakeChain()
    chain.drop_prompt_logprobs = True
    scheduler = make_scheduler(chain)
    task = make_task("a", 4, 2)
    task.prompt_logprobs = 0
    scheduler.submit(task)
    tokens, end = outcome(task)
    assert tokens == [] and isinstance(end, Failed) and "0 of the prompt's 3 tokens" in str(end.error)


def test_every_sampling_entry_says_how_many_samples_its_session_took_before(make_scheduler):
    """A final stage that builds the session's sampler anew (a hand-off, a recovery) skips that many
    seeded draws: the count is every sample the head received, the prompt's first included."""
    chain = FakeChain()
    scheduler = make_scheduler(chain, n_ubatch=2)
    task = make_task("a", 3, 4)
    scheduler.submit(task)
    assert outcome(task) == (expected_tokens(task), End("length"))
    assert [(list(e.positions), e.sample_last, e.draws_before) for r in chain.requests for e in r.entries] == [
        ([0, 1], False, 0), ([2], True, 0), ([3], True, 1), ([4], True, 2), ([5], True, 3)]
