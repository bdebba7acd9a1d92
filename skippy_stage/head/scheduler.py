"""The head's iteration-level scheduler: every active session advances in one shared batch.

Each step, a worker gathers the next token of every session it runs (decode) and a
budgeted, n_ubatch-sized chunk of prompts still being read (prefill) into ONE
IterationBatch that travels down the whole chain. ``max_inflight`` workers each own a
disjoint group of sessions, so while one group's batch is on stage k the next group's
batch can run on the stage above: the stages stay busy with several users.

Admission is against the lanes and the KV pool; a bounded queue holds sessions that wait
for room. A full queue, or a wait longer than ``admission_wait_s``, is refused with
CapacityError carrying a retry hint — never a crash, never an unbounded wait.

A group with a speculating session keeps up to ``window_depth`` of its verify windows in flight
(``_run_windows``; the policy and the window's bookkeeping are ``windows``): the next window goes
out on the guess that the one before it is kept whole, and a window cut short makes those behind
it stale. Every other case runs one step at a time (``_run_step``).

The step and drop actions are injected (``Stage.process`` / ``Stage.drop_session`` at run
time), so the bookkeeping here is tested without a model. What a step carries is decided in
``step_plan``; the tasks and the events their handlers receive are ``tasks``.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from skippy_stage import tracing
from skippy_stage.errors import (
    CapacityError,
    DownstreamError,
    InvalidFieldError,
    PrefixMissError,
    RuntimeFailure,
    SessionStateError,
    SkippyError,
    StageUnavailableError,
    UnknownSessionError,
    is_prefix_miss,
)
from skippy_stage.head.drafting import ReturnedDraft
from skippy_stage.head.inflight import BatchCount
from skippy_stage.head.prefixes import PrefixCache
from skippy_stage.head.step_plan import (
    chain_prefill,
    chain_window,
    image_start,
    live_windows,
    plan_step,
    prefill_ahead,
)
from skippy_stage.head.tasks import FINISH_LENGTH, FINISH_STOP, End, Failed, PromptLogprobs, Sampled, Task, Tokens
from skippy_stage.head.windows import ChainTiming, Window, WindowDepth
from skippy_stage.model.logprobs import TokenLogprob
from skippy_stage.model.sampling import plain_greedy
from skippy_stage.model.schedule import ScheduleStep
from skippy_stage.stage.steps import PHASE_DECODE, Output, Outputs, Step, StepEntry

log = structlog.get_logger("skippy_stage.scheduler")

# An idle worker looks again at least this often even if nobody notifies it (a safety net: every
# change an idle worker must act on notifies it).
IDLE_RECHECK_S = 1.0


@dataclass(frozen=True)
class SchedulerLimits:
    lane_count: int
    kv_pool_tokens: int
    max_context: int  # KV cells one session may hold
    n_batch: int
    n_ubatch: int
    max_inflight: int = 1
    max_queue: int = 64
    max_queue_wait_s: float = 30.0
    step_timeout_s: float = 60.0
    # How long a session whose chain failed waits for it to come back before failing;
    # 0 disables recovery.
    recovery_wait_s: float = 15.0
    # Tokens sampled within this long of a task's last delivery wait for the next (0: each at once).
    stream_interval_s: float = 0.0
    # Most speculative windows of one session in flight (1: one step at a time; ``windows``).
    window_depth: int = 1
    # Most chunks of one prompt in flight down the chain (1: one at a time; ``step_plan.chain_prefill``).
    prefill_chunks: int = 1


StepFn = Callable[[Step, float], Outputs]

# The head's lone greedy generation (``Stage.process_lone``): the step, its timeout, the callback
# for each token fed after the first (None for the first step) that says whether to go on (and,
# called from C, whether to ring the handler's bell), how many tokens may come back before the
# scheduler must see one, and the handler's bell (``Events.bell``).
LoneFn = Callable[[Step, float, Callable[..., int], int, object], Outputs]
DropFn = Callable[[str], None]
# Sessions to drop and sessions to retire, sent down the chain in band, in order with the frames
# (``Stage.end_sessions``): it returns once the message has left and never raises.
ReleaseFn = Callable[[list[str], list[str]], None]
PrefixEvent = Callable[[str, int], None]  # ("hit", tokens reused) or ("miss", 0)
IsEog = Callable[[int], bool]


class InFlight(Protocol):
    """A step sent on (``FramePath.start_step``): ``result`` waits for its outputs."""

    sent_at: float  # perf_counter at the send
    returned_at: float | None  # perf_counter when the outputs arrived (None: not yet)

    def result(self) -> Outputs: ...


# Send a step on without waiting for it (the head keeps speculative windows in flight).
SendFn = Callable[[Step, float], InFlight]


@dataclass
class _Sent:
    """A step of ``_run_windows`` in flight: its entries' tasks and windows, in entry order."""

    request_id: str
    flight: InFlight
    plan: list[tuple[Task, int]]
    windows: list[Window]
    recorded: dict[int, ScheduleStep]


class Scheduler:
    """Runs tasks in shared batches on ``max_inflight`` worker threads."""

    def __init__(self, limits: SchedulerLimits, *, step: StepFn, drop: DropFn, is_eog: IsEog,
                 chain_ready: Callable[[], bool] = lambda: True, stage_id: str = "head",
                 retire: DropFn | None = None, prefixes: PrefixCache | None = None,
                 on_prefix: PrefixEvent = lambda kind, tokens: None,
                 on_recovery: Callable[[], None] = lambda: None,
                 on_speculation: Callable[[int, int], None] = lambda drafted, accepted: None,
                 on_stale: Callable[[int], None] = lambda rows: None,
                 lone: LoneFn | None = None, send: SendFn | None = None, release: ReleaseFn | None = None,
                 batch_count: BatchCount | None = None) -> None:
        """``retire`` and ``prefixes`` turn the prefix cache on: a finished session is retired on
        every stage (its KV kept under its id) instead of dropped, and a new one starts from the
        resident prefix sharing most of its prompt. ``release``: finished sessions end in band
        (``_free``); ``drop`` and ``retire`` stay the calls for the rest. ``batch_count``: how many of
        the ``max_inflight`` workers take new sessions, measured (``inflight``); unset, all of them."""
        self.limits = limits
        self._retire = retire
        self.prefixes = prefixes if retire is not None else None
        self._on_prefix = on_prefix
        self._on_recovery = on_recovery
        self._on_speculation = on_speculation
        self._chain_ready = chain_ready
        self._step = step
        self._send = send
        self.timing = ChainTiming()  # what a window's trip costs, for every session's depth
        self._on_stale = on_stale
        self._lone = lone
        self._drop = drop
        self._release = release
        self.batch_count = batch_count
        self._is_eog = is_eog
        self.log = log.bind(stage_id=stage_id)
        self._cond = threading.Condition()
        self._waiting: deque[Task] = deque()
        self._groups: list[list[Task]] = [[] for _ in range(limits.max_inflight)]
        self._reserved = 0
        self._asleep = 0
        self._closed = False
        self._batch_ids = itertools.count()
        self._local = threading.local()
        self.steps = 0
        # With a measured count, a worker starts only once it is wanted: an idle one still costs the
        # head's steps (measured: 16 sessions on loopback, 12% fewer tokens/s with 1 of 4 admitting).
        self._workers: list[threading.Thread] = []
        with self._cond:
            self._start_workers(limits.max_inflight if batch_count is None else 1)

    def _start_workers(self, count: int) -> None:
        """Workers up to ``count`` running (under ``_cond``)."""
        while len(self._workers) < min(count, self.limits.max_inflight):
            worker = threading.Thread(target=self._run, args=(len(self._workers),),
                                      name=f"scheduler-{len(self._workers)}", daemon=True)
            self._workers.append(worker)
            worker.start()

    # -- the client side -------------------------------------------------------------

    def submit(self, task: Task, forks: list[Task] | None = None, *, share_prompt: bool = True) -> None:
        """Queue ``task``; ``forks`` are more choices of the same prompt, admitted with it into its
        group. With ``share_prompt`` (a model whose KV can be copied) they start as copies of its KV
        once it has prefilled all but the prompt's last token, so the prompt is prefilled once."""
        family = [task, *(forks or [])]
        if len(family) > self.limits.lane_count:
            raise InvalidFieldError("n", f"n={len(family)} choices need as many lanes at once; this pipeline has "
                                         f"lane_count={self.limits.lane_count}")
        need = sum(member.reserve(self.limits.max_context) for member in family)
        if len(family) > 1 and need > self.limits.kv_pool_tokens:
            raise InvalidFieldError("n", f"n={len(family)} choices of a {len(task.prompt)}-token prompt with "
                                         f"max_tokens={task.max_tokens} need {need} KV cells at once; this pipeline "
                                         f"holds kv_pool_tokens={self.limits.kv_pool_tokens}: lower n or max_tokens")
        task.forks = family[1:]
        # (not where the prompt's last row is inside an M-RoPE image: no copy keeps part of one)
        if task.forks and share_prompt and len(task.prompt) > 1 \
                and image_start(task, len(task.prompt) - 1) == len(task.prompt) - 1:
            task.hold_at = len(task.prompt) - 1
            for fork in task.forks:
                fork.fork_from = task
        with self._cond:
            if self._closed:
                raise StageUnavailableError("the head is shutting down; retry on another replica")
            # A free lane admits at once; only sessions that must wait count against the queue.
            free_lanes = max(0, self.limits.lane_count - sum(len(g) for g in self._groups))
            waiting = sum(1 + len(t.forks) for t in self._waiting)
            if waiting + len(family) - 1 >= self.limits.max_queue + free_lanes:
                raise self._capacity(f"admission queue is full ({self.limits.max_queue} sessions waiting for a lane)")
            self._waiting.append(task)
            if self.batch_count is not None:
                self._start_workers(self.batch_count.count())
            self._cond.notify_all()

    def batches(self) -> int:
        """How many batches the head keeps in flight now (``batch_count``; else every worker)."""
        return self.limits.max_inflight if self.batch_count is None else self.batch_count.count()

    def queue_depth(self) -> int:
        with self._cond:
            return len(self._waiting)

    def asleep(self) -> int:
        """Workers waiting for something to do: only a notify (or their next look) wakes them."""
        with self._cond:
            return self._asleep

    def active(self) -> int:
        with self._cond:
            return sum(len(g) for g in self._groups)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            waiting, self._waiting = list(self._waiting), deque()
            self._cond.notify_all()
        for task in (member for leader in waiting for member in (leader, *leader.forks)):
            task.events.put(Failed(StageUnavailableError("the head is shutting down; retry on another replica")))
        with self._cond:
            workers = list(self._workers)
        for worker in workers:
            worker.join(timeout=self.limits.step_timeout_s)

    def _capacity(self, why: str) -> CapacityError:
        """A refusal with a retry hint: a quarter of the admission wait, within 0.1..5 s."""
        retry_s = max(0.1, min(self.limits.max_queue_wait_s / 4, 5.0))
        return CapacityError(f"{why}; retry after {int(retry_s * 1000)} ms", retry_after_s=retry_s)

    # -- the worker side -------------------------------------------------------------

    def _admit_locked(self, index: int, group: list[Task]) -> None:
        """Admit waiting sessions into worker ``index``'s ``group`` while there is room, up to its
        fair share of the batches in flight (``batch_count``): a worker that woke first would
        otherwise take every session that came at once, and the other batches would run empty. A
        worker beyond the count takes none (what it runs, it finishes)."""
        batches = self.batches()
        if index >= batches:
            return
        self._start_workers(batches)  # the count may have grown since the last submit
        now = time.monotonic()
        active = sum(len(g) for g in self._groups)
        wanted = active + sum(1 + len(t.forks) for t in self._waiting)
        share = -(-min(wanted, self.limits.lane_count) // batches)
        while self._waiting:
            task = self._waiting[0]
            family = [task, *task.forks]
            if task.cancelled:
                self._waiting.popleft()
                for fork in reversed([f for f in task.forks if not f.cancelled]):
                    fork.fork_from = None  # the others of the request still wait, on their own
                    self._waiting.appendleft(fork)
                continue
            if now - task.enqueued_at > self.limits.max_queue_wait_s:
                self._waiting.popleft()
                for member in family:
                    member.events.put(Failed(self._capacity(f"waited {now - task.enqueued_at:.1f}s for a lane "
                                                            f"(admission_wait_s={self.limits.max_queue_wait_s})")))
                continue
            if group and len(group) + len(family) > share and len(group) > min(map(len, self._groups[:batches])):
                return  # another worker's (it was woken with this one); the smallest group takes any family
            reserve = sum(member.reserve(self.limits.max_context) for member in family)
            if active + len(family) > self.limits.lane_count or self._reserved + reserve > self.limits.kv_pool_tokens:
                return
            self._waiting.popleft()
            for member in family:
                member.admitted_at = now
                group.append(member)
            self._reserved += reserve
            active += len(family)
            for member in family:
                if member.fork_from is None:
                    self._claim_prefix(member)

    def _claim_prefix(self, task: Task) -> None:
        if (self.prefixes is None or task.replay is not None or task.prefilled or task.prompt_logprobs is not None
                or task.schedule is not None):
            return  # (a prompt's logprobs need every prompt row computed; a schedule, every row fed)
        # A source of forks keeps at least the token before its hold to prefill: the step that carries
        # the prefix is never the one its forks copy it in.
        match = self.prefixes.claim(task.prompt if task.hold_at is None else task.prompt[: task.hold_at],
                                    fit=(lambda n: image_start(task, n)) if task.media else None)
        if match is None:
            self._on_prefix("miss", 0)
            return
        task.prefix_id, task.prefilled, task.cached_tokens = match.prefix_id, match.reuse, match.reuse

    def _release_locked(self, group: list[Task], task: Task) -> None:
        group.remove(task)
        self._reserved -= task.reserve(self.limits.max_context)
        self._cond.notify_all()

    def _run(self, index: int) -> None:
        group = self._groups[index]
        while True:
            with self._cond:
                finished = [t for t in group if t.cancelled]
            for task in finished:  # nothing of it is in flight: its record is complete
                if task.schedule is not None:
                    task.schedule.settle()
            # Free finished sessions on every stage *before* their lanes count as free here:
            # otherwise another worker admits a session into a lane a stage still holds (in band,
            # the release is ahead of any frame that could).
            if finished:
                self._free(finished)
            with self._cond:
                for task in finished:
                    self._release_locked(group, task)
                closing = self._closed and not group
                if not closing:
                    self._admit_locked(index, group)
                batch = list(group)
                if not batch and not finished and not closing:
                    self._asleep += 1
                    try:
                        self._cond.wait(self._idle_wait_s())
                    finally:
                        self._asleep -= 1
            if closing:
                return
            if not batch:
                self.flush_events()
            if batch:
                try:
                    if self._windowed(batch):
                        self._run_windows(batch)
                    else:
                        self._run_step(batch)
                except Exception as exc:
                    self.flush_events()
                    self.log.exception("scheduler step crashed", sessions=[t.session_id for t in batch])
                    failure = RuntimeFailure(f"the head's scheduler failed a step: {exc!r}")
                    for task in batch:
                        self._fail(task, failure)

    def _idle_wait_s(self) -> float:
        """How long an idle worker sleeps (under ``_cond``): until notified (a task came, a lane was
        freed, the head closes), or the admission deadline of the task first in the queue, or
        ``IDLE_RECHECK_S`` at most. An idle head polled 20 times a second before: ~3 ms of CPU a
        second for nothing, on the cores its neighbours decode on."""
        if not self._waiting:
            return IDLE_RECHECK_S
        deadline = self._waiting[0].enqueued_at + self.limits.max_queue_wait_s
        return min(IDLE_RECHECK_S, max(0.001, deadline - time.monotonic()))

    def _free(self, finished: list[Task]) -> None:
        """End finished sessions on every stage: each one retired (its KV stays resident on every
        stage as a prefix, its tokens here) or dropped, and the prefixes the cache let go of dropped.
        With ``release``, in band: one message down the chain that every later frame follows, so
        nothing waits for a round trip (over real links a chain's; 16 sessions one after the
        other cost 16 of them before). Else one call down the chain per session."""
        dropped: list[str] = []
        retired: list[str] = []
        if self._release is not None:
            # A failed session's state is uncertain (the head may no longer hold what a stage
            # below does, and the in-band release passes on only what each stage held): by call.
            for task in finished:
                if not task.failed:
                    self._ending(task, dropped, retired)
            if dropped or retired:
                self._release(dropped, retired)
            dropped, retired = [], []
            finished = [task for task in finished if task.failed]
        for task in finished:
            self._ending(task, dropped, retired)
        for session_id in retired:
            try:
                self._retire(session_id)
            except SkippyError as exc:
                self.log.info("session retire incomplete", session_id=session_id, error=str(exc))
                self._drop_quietly(session_id)
                self.prefixes.forget(session_id)
        for session_id in dropped:
            self._drop_quietly(session_id)

    def _ending(self, task: Task, dropped: list[str], retired: list[str]) -> None:
        """What ending ``task`` releases: its session, retired as a prefix (the cache then lets go of
        some, dropped) or dropped; a prefix it claimed but never carried down, dropped."""
        if task.prefix_id is not None:  # claimed but never carried down: no session holds it yet
            dropped.extend((task.prefix_id, task.session_id))
            task.prefix_id = None
            return
        # What the stages hold: the part of the prompt (or replay) prefilled so far, or, once it all
        # was, every token fed since.
        feed = task.to_feed
        fed = list(feed[: task.prefilled]) if task.prefilled < len(feed) or not task.history else task.history
        if self._retire is not None and self.prefixes is not None and not task.failed and fed \
                and task.recovering is None:
            retired.append(task.session_id)
            dropped.extend(self.prefixes.add(task.session_id, fed))
            return
        dropped.append(task.session_id)

    def _drop_quietly(self, session_id: str) -> None:
        try:
            self._drop(session_id)
        except UnknownSessionError:
            pass  # nothing held it (a stage evicted the prefix first, or it never got there)
        except SkippyError as exc:
            self.log.info("session release incomplete", session_id=session_id, error=str(exc))

    def _fail(self, task: Task, error: SkippyError) -> None:
        task.failed = True
        self._deliver(task)
        task.events.put(Failed(error))
        task.cancel()

    def _recover(self, batch: list[Task]) -> None:
        """Re-prefill sessions whose chain failed, once it answers again (or give up)."""
        now = time.monotonic()
        waiting = [t for t in batch if t.recovering is not None and not t.cancelled]
        if not waiting:
            return
        ready = self._chain_ready()
        for task in waiting:
            if ready:
                old = task.session_id
                task.stale_sessions.append(old)
                task.session_id = uuid.uuid4().hex
                task.replay = list(task.history) if task.history else list(task.prompt)
                task.prefilled = 0
                task.recovering = None
                task.recoveries += 1
                self._on_recovery()
                self.log.info("session recovering: re-prefilling through the chain", session_id=task.session_id,
                              previous_session_id=old, tokens=len(task.history))
                for stale in list(task.stale_sessions):
                    try:
                        self._drop(stale)  # a stage that outlived the failure may still hold it
                        task.stale_sessions.remove(stale)
                    except UnknownSessionError:
                        task.stale_sessions.remove(stale)
                    except SkippyError:
                        pass  # part of the chain is still away; the idle TTL is the backstop
            elif now > (task.failing_since or now) + self.limits.recovery_wait_s:
                self._fail(task, task.recovering)
        if not ready:
            time.sleep(0.05)

    def _emit(self, task: Task, token: int | Sampled | PromptLogprobs) -> None:
        """Hand a sampled token to its waiting handler — once the next step's frame has left.

        The handler's work (text, the client's stream) would otherwise wake up exactly when this
        thread's next step needs the CPU and the GIL (the critical path: outputs in, next frame
        out), on a host where the stages already share the cores. ``flush_events`` delivers
        them: the step function calls it once the frame is sent, and the worker after every step.
        """
        pending = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = []
        pending.append((task, token))

    def flush_events(self, *, quiet_for: Task | None = None) -> None:
        """Deliver the tokens this worker thread held back (see ``_emit``): each task's together,
        one event. With a stream interval (the task's own, else ``stream_interval_s``), a task's
        tokens wait (here, so its handler is not woken for them) until that long after its last
        delivery; its end delivers them at once. ``quiet_for``: that task's without waking its
        handler (``Events.put_quiet``: the caller rings)."""
        pending = getattr(self._local, "pending", None)
        if not pending:
            return
        default = self.limits.stream_interval_s
        now = time.monotonic()
        held = []
        by_task: dict[int, tuple[Task, list]] = {}
        for task, token in pending:
            by_task.setdefault(id(task), (task, []))[1].append(token)
        for task, tokens in by_task.values():
            interval = default if task.stream_interval_s is None else task.stream_interval_s
            if interval and now < task.delivered_at + interval and not task.cancelled:
                held.extend((task, token) for token in tokens)
                continue
            self._put(task, tokens, now, quiet=task is quiet_for)
        pending[:] = held

    def _deliver(self, task: Task) -> None:
        """Hand ``task``'s held tokens to its handler now (it ends or fails)."""
        pending = getattr(self._local, "pending", None)
        if not pending:
            return
        mine = [token for t, token in pending if t is task]
        if mine:
            pending[:] = [(t, token) for t, token in pending if t is not task]
            self._put(task, mine, time.monotonic())

    @staticmethod
    def _put(task: Task, tokens: list, now: float, *, quiet: bool = False) -> None:
        """One event for the handler: prompt logprobs stay events of their own, ahead of tokens."""
        put = task.events.put_quiet if quiet else task.events.put
        run: list = []
        for token in tokens:
            if isinstance(token, PromptLogprobs):
                if run:
                    put(run[0] if len(run) == 1 else Tokens(tuple(run)))
                    run = []
                put(token)
            else:
                run.append(token)
        if run:
            put(run[0] if len(run) == 1 else Tokens(tuple(run)))
        task.delivered_at = now

    def _run_step(self, batch: list[Task]) -> None:
        self._recover(batch)
        entries, plan = plan_step(batch, n_batch=self.limits.n_batch, n_ubatch=self.limits.n_ubatch,
                                  max_context=self.limits.max_context)
        if not entries:
            self.flush_events()
            return
        request = Step(request_id=f"step-{next(self._batch_ids)}", entries=entries)
        recorded = self._record_sent(plan, entries)
        tracing.mark("built")
        try:
            limit = self._lone_limit(batch, plan, entries)
            if limit:
                task, fed = batch[0], []
                try:
                    response = self._lone(request, self.limits.step_timeout_s, self._on_lone_token(task, fed), limit,
                                          task.events.bell)
                finally:
                    task.events.ring()  # what the token callback put that the C loop did not ring for
                    for token in fed:  # the callback's bookkeeping, left until the run is over
                        self.steps += 1
                        task.samples += 1
                        self._record(task, token, fed_now=True)
            else:
                if self.batch_count is None:
                    response = self._step(request, self.limits.step_timeout_s)
                else:
                    started = time.perf_counter()
                    response = self._step(request, self.limits.step_timeout_s)
                    self.batch_count.step(time.perf_counter() - started)
        except SkippyError as exc:
            self._step_failed(exc, request.request_id, plan, recorded)
            return
        self._take_outputs(response, plan, recorded)

    # -- speculative windows in flight (``windows``) ------------------------------------

    def _windowed(self, batch: list[Task]) -> bool:
        """Whether ``batch`` runs with steps in flight: the head can send a step without waiting for
        it (``send``), a session of it speculates (and depth may exceed one) or has a prompt chunk to
        send before those in flight come back (``prefill_ahead``), and no session needs steps of
        its own (forks holding for their source)."""
        limits = self.limits
        return (self._send is not None
                and ((limits.window_depth > 1 and any(t.drafter is not None for t in batch))
                     or any(prefill_ahead(t, n_ubatch=limits.n_ubatch, chunks=limits.prefill_chunks) for t in batch))
                and not any(t.forks or t.fork_from is not None or t.hold_at is not None for t in batch))

    def _run_windows(self, batch: list[Task]) -> None:
        """``batch``'s steps with windows in flight: send whatever can go — the next entry of every
        session with nothing live in flight (``plan_step``: a rewind to where it really is, after a
        cut-short window), the next chunk of each prompt behind its chunks in flight
        (``chain_prefill``) and a window chained behind each speculating session's live ones within
        its depth (``chain_window``) — then take the oldest step's outputs; until the group must
        change (a session ended or waits to recover, another waits for a lane, or nothing needs
        steps in flight any more) and nothing is in flight. Outputs come back in the order the steps
        left: the frames of an edge keep it."""
        self._recover(batch)
        waiting = {id(t) for t in batch if t.recovering is not None}  # for the chain: the others go on
        for task in batch:
            if task.drafter is not None and task.depth is None:
                limit = min(task.window_depth or self.limits.window_depth, self.limits.window_depth)
                task.depth = WindowDepth(limit, self.timing)
        inflight: deque[_Sent] = deque()
        try:
            while True:
                if not self._must_regroup(batch, waiting):
                    while (sent := self._send_windows(batch)) is not None:
                        inflight.append(sent)
                if not inflight:
                    self.flush_events()
                    return
                self._take_windows(inflight.popleft())
        finally:
            for task in batch:
                task.windows.clear()

    def _must_regroup(self, batch: list[Task], waiting: set[int]) -> bool:
        """Stop sending: a session of the group ended, or its step failed and it must recover (its
        lane is freed, or its session replaced, only with nothing in flight; ``waiting``: those that
        already wait for the chain to come back), nothing needs steps in flight any more (a prompt's
        chunks all sent, and nobody speculates: the next step may be a lone run), a session waits
        for a lane this group could take, or the head closes."""
        if any(t.cancelled or (t.recovering is not None and id(t) not in waiting) for t in batch):
            return True
        if not self._windowed(batch):
            return True
        with self._cond:
            free = self.limits.lane_count - sum(len(g) for g in self._groups)
            return self._closed or (bool(self._waiting) and free > 0)

    def _send_windows(self, batch: list[Task]) -> _Sent | None:
        """One step of what can go now (see ``_run_windows``), sent on; None when nothing can."""
        ready = [t for t in batch if not live_windows(t) and not t.cancelled]
        entries, plan = plan_step(ready, n_batch=self.limits.n_batch, n_ubatch=self.limits.n_ubatch,
                                  max_context=self.limits.max_context) if ready else ([], [])
        windows = []
        for (task, n_prefill), entry in zip(plan, entries):
            windows.append(Window(start=int(entry.positions[0]), tokens=[int(t) for t in entry.token_ids],
                                  n_prefill=n_prefill, drafted=task.drafted, samples=entry.sample_last))
            task.drafted = 0
        rows = sum(len(e.positions) for e in entries)
        outputs = sum(len(e.positions) if e.verify or e.all_rows or e.prompt_logprobs is not None
                      else int(e.sample_last) for e in entries)
        planned = {id(t) for t, _ in plan}
        for task in batch:
            if id(task) in planned:
                continue
            chunk = chain_prefill(task, room=self.limits.n_batch - rows, outputs=self.limits.n_ubatch - outputs,
                                  n_ubatch=self.limits.n_ubatch, chunks=self.limits.prefill_chunks)
            if chunk is not None:
                entry, window = chunk
                entries.append(entry)
                plan.append((task, window.n_prefill))
                windows.append(window)
                planned.add(id(task))
                rows += len(window.tokens)
                outputs += len(window.tokens) if entry.all_rows else int(window.samples)
        for task in batch:
            room = min(self.limits.n_batch - rows, self.limits.n_ubatch - outputs)
            if room <= 0:
                break
            chained = None if id(task) in planned else chain_window(task, room=room,
                                                                    max_context=self.limits.max_context)
            if chained is not None:
                entry, window = chained
                entries.append(entry)
                plan.append((task, 0))
                windows.append(window)
                rows += len(window.tokens)
                outputs += len(window.tokens)
        if not entries:
            return None
        request = Step(request_id=f"step-{next(self._batch_ids)}", entries=entries)
        recorded = self._record_sent(plan, entries)
        for (task, _), window in zip(plan, windows):
            window.record = recorded.get(id(task))
            task.windows.append(window)
        tracing.mark("built")
        try:
            flight = self._send(request, self.limits.step_timeout_s)
        except SkippyError as exc:
            for (task, _), window in zip(plan, windows):
                task.windows.remove(window)
            self._step_failed(exc, request.request_id, plan, recorded)
            return None
        return _Sent(request.request_id, flight, plan, windows, recorded)

    def _take_windows(self, sent: _Sent) -> None:
        """The oldest step in flight came back (or failed): each window's outputs, in order."""
        try:
            response = sent.flight.result()
        except SkippyError as exc:
            failing = []
            for (task, n_prefill), window in zip(sent.plan, sent.windows):
                task.windows.remove(window)
                if window.stale or task.cancelled or task.recovering is not None:
                    if task.schedule is not None and window.record is not None:
                        task.schedule.failed(window.record, exc)
                    continue
                task.stale_windows()  # nothing behind it can be kept: the session recovers or fails
                failing.append((task, n_prefill))
            if failing:
                self._step_failed(exc, sent.request_id, failing, sent.recorded)
            return
        arrived = sent.flight.returned_at or time.perf_counter()
        if any(w.decode for w in sent.windows):  # (what a window costs, not a prompt's chunk)
            self.timing.trip(arrived - sent.flight.sent_at)
            for task, _ in sent.plan:
                if task.arrived_at is not None and task.arrived_at > sent.flight.sent_at:
                    self.timing.gap(arrived - task.arrived_at)  # both were in flight: what one more costs
                    break
            else:
                self.timing.relax()
        for task, _ in sent.plan:
            task.arrived_at = arrived
        self._take_outputs(response, sent.plan, sent.recorded, sent.windows)

    def _window_returned(self, task: Task, window: Window, out: Output, final_stage_id: str,
                         recorded: dict[int, ScheduleStep]) -> None:
        """One window's outputs: dropped when stale; else taken, and every later window of the task
        turns stale unless this one was kept whole and the next one's first token is its last sample."""
        task.windows.remove(window)  # the task's oldest
        stale = window.stale or task.cancelled
        if window.chained and not stale and out.token is None:
            # The final stage found that it does not continue the last sample, though the head's check
            # of the window before it passed: believe the stage (it did not sample it).
            self.log.warning("a chained window came back unsampled", session_id=task.session_id,
                             start=window.start)
            task.stale_windows()
            stale = True
        if task.schedule is not None and window.record is not None:
            task.schedule.returned(window.record, out, stale=stale)
        if stale:
            if window.decode and not task.cancelled:
                self._on_stale(len(window.tokens))
            return
        tokens = self._take_output(task, window.n_prefill, out, final_stage_id, window.drafted,
                                   chained=window.chained)
        if task.cancelled or task.recovering is not None:
            task.stale_windows()
            return
        if not window.samples:
            return
        whole = len(tokens) == window.most
        following = live_windows(task)
        continued = whole and (not following or following[0].tokens[0] == tokens[-1])
        if task.depth is not None and window.drafted:
            task.depth.window_kept(continued)
        if not continued:
            task.stale_windows()

    def _step_failed(self, exc: SkippyError, request_id: str, plan: list[tuple[Task, int]],
                     recorded: dict[int, ScheduleStep]) -> None:
        """A step did not come back: its sessions recover (re-prefill) or fail."""
        self.flush_events()
        for task, _ in plan:
            if task.schedule is not None:
                task.schedule.failed(recorded[id(task)], exc)
        # UNAVAILABLE: a stage below is gone. NOT_FOUND from below: a stage lost sessions the
        # head still holds (it restarted between steps, or freed them after the chain broke
        # behind a direct return). Either way re-prefilling through the chain recovers them.
        recoverable = isinstance(exc, DownstreamError) and exc.code_name in ("UNAVAILABLE", "NOT_FOUND") \
            and self.limits.recovery_wait_s > 0
        # A stage that lost a resident prefix: the stages above it ran the step, those below did
        # not, so every session of the step prefills again from scratch, the lost prefix's too.
        miss = is_prefix_miss(exc)
        self.log.warning("step failed", request_id=request_id, error=str(exc),
                         recovering=recoverable or miss, prefix_miss=miss, sessions=[t.session_id for t, _ in plan])
        lost = []
        if isinstance(exc, PrefixMissError):
            # This stage refused the batch before running any of it: only the sessions that named
            # a prefix start over, under the same id, from position 0.
            for task, _ in plan:
                if task.prefix_id is not None:
                    self._on_prefix("miss", 0)
                    lost.append(task.prefix_id)
                    task.prefix_id, task.cached_tokens, task.prefilled = None, 0, 0
            for prefix_id in lost:
                self._drop_quietly(prefix_id)
            return
        for task, _ in plan:
            if task.prefix_id is not None:  # the step that would have carried it did not get through
                self._on_prefix("miss", 0)
                lost.append(task.prefix_id)
                task.prefix_id, task.cached_tokens = None, 0
            if miss:
                task.recovering = exc
                if task.failing_since is None:
                    task.failing_since = time.monotonic()
            elif recoverable:
                task.recovering = exc
                if task.failing_since is None:
                    task.failing_since = time.monotonic()
                if time.monotonic() > task.failing_since + self.limits.recovery_wait_s:
                    self._fail(task, exc)
            else:
                self._fail(task, exc)
        for prefix_id in lost:
            self._drop_quietly(prefix_id)  # stages below the miss may still hold it

    def _take_outputs(self, response: Outputs, plan: list[tuple[Task, int]], recorded: dict[int, ScheduleStep],
                      windows: list[Window] | None = None) -> None:
        """A step's outputs, entry by entry; with ``windows`` (one per entry: ``_run_windows``), each
        entry's window decides whether its samples count (a stale one's do not) and what follows."""
        self.flush_events()  # the previous step's tokens, if the step function did not already
        self.steps += 1
        if len(response.outputs) != len(plan):
            exc = RuntimeFailure(f"stage {response.final_stage_id} answered {len(response.outputs)} outputs "
                                 f"for {len(plan)} entries")
            for task, _ in plan:
                if not task.cancelled:
                    self._fail(task, exc)
            return
        for i, ((task, n_prefill), out) in enumerate(zip(plan, response.outputs)):
            window = windows[i] if windows is not None else None
            if window is not None:
                self._window_returned(task, window, out, response.final_stage_id, recorded)
                continue
            if task.schedule is not None:
                task.schedule.returned(recorded[id(task)], out)
            drafted, task.drafted = task.drafted, 0
            self._take_output(task, n_prefill, out, response.final_stage_id, drafted)
        tracing.mark("took")

    def _take_output(self, task: Task, n_prefill: int, out: Output, final_stage_id: str, drafted: int, *,
                     chained: bool = False) -> tuple[int, ...]:
        """One entry's output for ``task``: its prompt's progress and its samples, each taken as if
        sampled in a step of its own. ``drafted``: the drafts the entry carried (a chained window's
        first token is one too). Returns the samples (none: the entry sampled nothing, or failed)."""
        for i, logprob in enumerate(out.prompt_logprobs or ()):
            task.prompt_lps[task.prefilled + 1 + i] = logprob
        task.prefilled += n_prefill
        task.fork_from = None  # a fork carried through the chain is a session like any other
        if task.hold_at is not None and task.prefilled > task.hold_at:
            task.hold_at = None
        if task.prefix_id is not None and n_prefill:
            self._on_prefix("hit", task.cached_tokens)
            task.prefix_id = None
        if out.token is None:
            return ()
        task.failing_since = None
        if task.first_token_at is None:
            task.first_token_at = time.monotonic()
        if isinstance(task.drafter, ReturnedDraft) and out.draft is None:
            self._fail(task, SessionStateError(
                f"speculative.drafter='mtp': the final stage {final_stage_id} returned a sample without a draft; it "
                f"drafts only with native_mtp_enabled: true, on a model with multi-token-prediction layers"))
            return ()
        # A verify entry's samples: the drafts it kept, then the one that rejected a draft (or
        # followed the last): each as if sampled in a step of its own.
        tokens = out.tokens if out.tokens is not None else (out.token,)
        task.samples += len(tokens)
        if drafted:
            accepted = len(tokens) - 1 + chained  # (a chained window's first token was confirmed to get here)
            self._on_speculation(drafted, accepted)
            if task.draft_budget is not None:
                task.draft_budget.record(drafted, accepted)
        if task.prompt_logprobs is not None and not task.prompt_lps_sent and not self._send_prompt_logprobs(task):
            self._fail(task, RuntimeFailure(f"stage {final_stage_id} returned logprobs for "
                                            f"{len(task.prompt_lps)} of the prompt's {len(task.prompt) - 1} "
                                            f"tokens after the first"))
            return ()
        if task.top_logprobs is not None and (out.logprobs is None or len(out.logprobs) != len(tokens)):
            self._fail(task, RuntimeFailure(f"stage {final_stage_id} returned "
                                            f"{len(out.logprobs or ())} logprobs for {len(tokens)} tokens"))
            return ()
        logprobs = out.logprobs if out.logprobs is not None else (None,) * len(tokens)
        for token, logprob in zip(tokens, logprobs):
            if not self._take(task, token, fed_now=n_prefill == 0, logprob=logprob):
                break
        else:
            if isinstance(task.drafter, ReturnedDraft):  # the final stage's guess after the last sample
                task.drafter.offer(len(task.history) + 1, out.draft)
        return tuple(tokens)

    @staticmethod
    def _record_sent(plan: list[tuple[Task, int]], entries: list[StepEntry]) -> dict[int, ScheduleStep]:
        """The entries of tasks that record their schedule, recorded as sent (they ask for digests);
        by the task's id."""
        if not any(task.schedule is not None for task, _ in plan):
            return {}
        rows = sum(len(e.positions) for e in entries)
        return {id(task): task.schedule.sent(entry, rows) for (task, _), entry in zip(plan, entries)
                if task.schedule is not None}

    def _lone_limit(self, batch: list[Task], plan: list[tuple[Task, int]], entries: list[StepEntry]) -> int:
        """How many tokens a lone generation may take (``LoneFn``) before this scheduler must see
        one — its length or context reached — or 0 when this step is not one: one task alone at
        the head, decoding one plain greedy token, with nothing that needs the scheduler between
        its steps (drafts, logprobs, forks)."""
        if self._lone is None or len(batch) != 1 or len(plan) != 1 or plan[0][1] or len(entries) != 1:
            return 0
        task, entry = batch[0], entries[0]
        if (entry.phase != PHASE_DECODE or len(entry.positions) != 1 or entry.rewind or entry.verify
                or entry.top_logprobs is not None or entry.prefix_id is not None or task.drafter is not None
                or task.top_logprobs is not None or task.forks or task.fork_from is not None
                or task.schedule is not None or not plain_greedy(task.sampling) or self._others_active()):
            return 0
        return min(task.max_tokens - task.generated, self.limits.max_context - entry.positions[0] - 1)

    def _others_active(self) -> bool:
        """Another session waits or runs (or the head closes): the scheduler's turn."""
        return bool(self._waiting) or self._closed or sum(len(g) for g in self._groups) > 1

    def _on_lone_token(self, task: Task, fed: list[int]) -> Callable[..., int]:
        """The lone generation's token callback. It runs right after each frame has left, on the
        core the next stage's decode is about to need, on caches that decode emptied: it only hands
        the token to the handler and records it in ``fed``; the scheduler's bookkeeping for the
        tokens waits until the run is over (``_run_step``), when ``_record`` does it as ``_take``
        would have. Every token it gets was fed to a step, so the C loop has already checked it
        (no end of generation, within the limits)."""
        events, cancelled = task.events, task._cancelled
        interval = self.limits.stream_interval_s if task.stream_interval_s is None else task.stream_interval_s

        def on_token(token: int | None, quiet: bool = False) -> int:
            """Returns bit 0: go on; bit 1 (``quiet``, from the C loop): its handler's bell is the
            caller's to ring, once the GIL is released (``Events``)."""
            if token is not None:
                fed.append(token)
                if interval:  # held (``flush_events``) until the interval has passed
                    self._emit(task, token)
                    self.flush_events(quiet_for=task if quiet else None)
                elif quiet:
                    events.put_quiet(token)
                else:
                    events.put(token)
            else:  # the first step's frame: what the step before it emitted goes now
                self.flush_events(quiet_for=task if quiet else None)
            ring = 2 if quiet and events.hand_ring() else 0
            return ring | (not (cancelled.is_set() or self._others_active()))
        return on_token

    @staticmethod
    def _record(task: Task, token: int, *, fed_now: bool) -> None:
        """``task`` generated ``token`` (the bookkeeping of ``_take``, without emitting it)."""
        if task.schedule is not None:
            task.schedule.emit(token)
        if task.last_token is not None and fed_now:
            task.history.append(task.last_token)  # it was fed in this step
        elif not task.history:
            task.history = list(task.prompt)
        task.generated += 1
        task.last_token = token

    def _send_prompt_logprobs(self, task: Task) -> bool:
        """Emit the prompt's logprobs ahead of its first sampled token; False if some are missing."""
        found = [task.prompt_lps.get(p) for p in range(1, len(task.prompt))]
        if any(lp is None for lp in found):
            return False
        task.prompt_lps_sent = True
        self._emit(task, PromptLogprobs(tuple(task.prompt), (None, *found)))
        return True

    def _take(self, task: Task, token: int, *, fed_now: bool, logprob: TokenLogprob | None = None) -> bool:
        """One sampled token of ``task``: emit it, or end the task; False once it ended."""
        if self._is_eog(token):
            self.flush_events()
            self._deliver(task)
            task.events.put(End(FINISH_STOP))
            task.cancel()
            return False
        self._record(task, token, fed_now=fed_now)
        self._emit(task, token if logprob is None else Sampled(token, logprob))
        position = len(task.prompt) + task.generated - 1
        if task.generated >= task.max_tokens or position + 1 >= self.limits.max_context:
            self.flush_events()
            self._deliver(task)
            task.events.put(End(FINISH_LENGTH))
            task.cancel()
            return False
        return True
