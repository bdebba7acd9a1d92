"""One stage: its runtime, its edges, and what happens to a frame passing through.

Frames flow one way. A stage runs a frame's entries through its layers on the thread that
received it and hands its own frame to the downstream hop; the final stage sends the
outputs straight to the head (``return_to``) or, failing that, back up the edges. Nobody
waits for the stages below except whoever started a step: the head's scheduler, or a
unary IterationBatch/ActivationFrame caller. Those wait on ``returns`` by the step's key.

Errors travel back up the edges' back channels as HopReplies naming the failed stage and
the frame's sessions; every stage on the way frees those sessions and passes the reply
on, so "a session that fails anywhere is freed on every stage". A link that breaks loses
every frame in flight through it: the stage above tells everyone above it, and the head
fails (and recovers) every step it waits for. The stage below loses the sessions the broken
link opened: an upstream connection owns its sessions, and its end frees them here and, in
band, on every stage below (``peers``).

The stage speaks domain types (``steps``, ``reports``); the servicer (``service``), the TCP
frame listener (``listener``) and the socket transports are thin shells around it that
convert at the edge (``codec``).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import structlog

from skippy_stage import tracing
from skippy_stage.config import MAX_SESSION_ID_LEN, PeerConfig, StageConfig
from skippy_stage.errors import (
    DownstreamError,
    InvalidRequestError,
    SkippyError,
    StageUnavailableError,
    UnknownSessionError,
)
from skippy_stage.metrics import StageMetrics, Tally
from skippy_stage.model.runtime import KvPage, StageRuntime, decode_error
from skippy_stage.model.slicing import read_model_info
from skippy_stage.security import Credentials
from skippy_stage.stage import native_frames
from skippy_stage.stage.downstream import DownstreamClient, HealthProbe, HopFuture, LocalDownstream, timeout_for
from skippy_stage.stage.gate import EdgeGate
from skippy_stage.stage.hops import TcpHop
from skippy_stage.stage.peers import Peer, Peers
from skippy_stage.stage.reports import StageDrop, StageReport, StageTrim
from skippy_stage.stage.returns import LocalReturn, ReturnBox, StreamReturn, TcpReturn
from skippy_stage.stage.status import status_for
from skippy_stage.stage.steps import (
    Frame,
    Output,
    Outputs,
    Reply,
    StageShape,
    Step,
    forward_step,
    outputs_from_results,
    runtime_entries,
)

log = structlog.get_logger("skippy_stage.stage")

# A draining stage waits for sessions fed within this many seconds (work under way); older
# ones are a client's leftovers, freed when the stage stops.
DRAIN_IDLE_S = 2.0

# One upstream edge's back channel: sends one Reply up it and never raises.
Sink = Callable[[Reply], None]


class StageState(enum.Enum):
    LOADING = "loading"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"


_TRANSITIONS = {
    StageState.LOADING: {StageState.SERVING, StageState.DRAINING, StageState.STOPPED},
    StageState.SERVING: {StageState.DRAINING, StageState.STOPPED},
    StageState.DRAINING: {StageState.STOPPED},
    StageState.STOPPED: set(),
}


@dataclass(frozen=True)
class Timeouts:
    """Every timeout, named by its scope: a view of the StageConfig's fields (see there)."""

    hop_s: float
    health_probe_s: float
    health_interval_s: float
    step_s: float
    drop_s: float

    @classmethod
    def from_config(cls, cfg: StageConfig) -> Timeouts:
        return cls(hop_s=cfg.hop_timeout_s, health_probe_s=cfg.health_probe_s, health_interval_s=cfg.health_interval_s,
                   step_s=cfg.step_timeout_s, drop_s=cfg.drop_timeout_s)


class Inbound:
    """The back channels of this stage's upstream edges: where errors and relayed outputs
    from below go on. A sink sends one HopReply up one edge and never raises."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sinks: list[Sink] = []

    def add(self, sink: Sink) -> None:
        with self._lock:
            self._sinks.append(sink)

    def discard(self, sink: Sink) -> None:
        with self._lock:
            if sink in self._sinks:
                self._sinks.remove(sink)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sinks)

    def broadcast(self, reply: Reply) -> int:
        with self._lock:
            sinks = list(self._sinks)
        for sink in sinks:
            sink(reply)
        return len(sinks)


class Routes:
    """Which upstream edge (and hop id on it) each recent step came in on, by return key, so a
    reply from below goes back up the edge its frame came down. Bounded: the oldest are
    forgotten first (a step that went well leaves no reply to take its route)."""

    def __init__(self, limit: int = 4096) -> None:
        self._lock = threading.Lock()
        self._limit = limit
        self._routes: OrderedDict[str, tuple[Sink, int]] = OrderedDict()

    def claim(self, key: str, sink: Sink, hop_id: int) -> str:
        """Route replies for ``key`` to ``sink``; the key to send down. A key that is empty or
        already routed (never from a real head, whose keys are random) gets a fresh one, so
        no client can make replies of another step, or the "edge broke" of an empty key, its own."""
        with self._lock:
            if not key or key in self._routes:
                key = uuid.uuid4().hex
            self._routes[key] = (sink, hop_id)
            while len(self._routes) > self._limit:
                self._routes.popitem(last=False)
        return key

    def take(self, key: str) -> tuple[Sink, int] | None:
        with self._lock:
            return self._routes.pop(key, None)


def error_reply(exc: SkippyError, *, return_key: str, session_ids: list[str], hop_id: int = 0,
                stage_id: str = "") -> Reply:
    """The back-channel message for a failed frame. ``failed_stage`` names the stage that failed:
    the one given, or the deeper one a DownstreamError names."""
    code, message = status_for(exc)
    failed = exc.stage_id if isinstance(exc, DownstreamError) else stage_id
    return Reply(hop_id=hop_id, code=code.name, message=message, failed_stage=failed, return_key=return_key,
                 session_ids=tuple(session_ids))


class Stage:
    """The stage's domain object; owns the runtime, the downstream edge and the return path."""

    def __init__(self, config: StageConfig, *, max_message_bytes: int) -> None:
        self.config = config
        self.timeouts = Timeouts.from_config(config)
        self.max_message_bytes = max_message_bytes
        self.log = log.bind(stage_id=config.stage_id, run_id=config.run_id)
        self.runtime: StageRuntime | None = None
        self.shape: StageShape | None = None
        self.architecture = ""
        self._state = StageState.LOADING
        self._state_lock = threading.Lock()
        self.credentials = Credentials.from_config(config)
        self.peers = Peers(config, self.credentials)
        self.metrics = StageMetrics(config.stage_id)
        self.returns = ReturnBox()
        self.inbound = Inbound()
        self.routes = Routes()
        # Frames, steps and session calls pass it; a hand-off to a stand-in closes it.
        self.gate = EdgeGate()
        self._moved_away = 0  # sessions exported and released here (a hand-off to a stand-in)
        # The TCP frame listener's port once it listens (advertised in GetStatus).
        self.frame_port = 0
        self.downstream = self.client_for(config.downstream) if config.downstream is not None else None
        self.downstream_health = HealthProbe(config.downstream is None, "not probed yet")
        self._pending_drops: set[str] = set()
        self._pending_lock = threading.Lock()
        self._drop_retry = threading.Lock()
        self.return_path: TcpReturn | StreamReturn | LocalReturn | None = None
        # The compiled paths (set once loaded; None: Python only): plain frames from above (below
        # the head), and the head's own plain decode steps.
        self.native: native_frames.NativeFrames | None = None
        self.native_head: native_frames.NativeHead | None = None
        if config.return_to is not None:
            if config.hop_transport == "tcp":
                self.return_path = TcpReturn(config.return_to, credentials=self.credentials,
                                             stage_id=config.stage_id, max_message_bytes=max_message_bytes)
            else:
                self.return_path = StreamReturn(config.return_to, stage_id=config.stage_id,
                                                max_message_bytes=max_message_bytes, credentials=self.credentials)

    # -- lifecycle -------------------------------------------------------------------

    def client_for(self, peer: PeerConfig) -> DownstreamClient:
        client: DownstreamClient | None = None

        def broken(error: DownstreamError) -> None:
            self._link_broken(client, error)
        client = DownstreamClient(peer, max_message_bytes=self.max_message_bytes, hop_timeout_s=self.timeouts.hop_s,
                                  connect_timeout_s=self.timeouts.health_probe_s * 2,
                                  transport=self.config.hop_transport, stage_id=self.config.stage_id,
                                  on_reply=self._from_below, on_broken=broken, credentials=self.credentials)
        return client

    def connect_local(self, target: Stage) -> None:
        """Chain ``target`` (a stage of this process) below this one: frames run on the
        sender's thread, and (final target) outputs come straight back here."""
        if self.downstream is not None:
            self.downstream.close()
        client = None

        def broken(error: DownstreamError) -> None:
            self._link_broken(client, error)
        peer = self.config.downstream or PeerConfig(target.config.stage_id, target.config.stage_index, "local")
        client = LocalDownstream(peer, target, hop_timeout_s=self.timeouts.hop_s, on_reply=self._from_below,
                                 on_broken=broken)
        self.downstream = client
        self.downstream_health = HealthProbe(True, "")

    def return_locally(self, head: Stage) -> None:
        """Final stage: send outputs straight to ``head``, a stage of this process."""
        self.return_path = LocalReturn(head)

    def switch_downstream(self, client: DownstreamClient, *, close_old: bool = True) -> None:
        """Send frames to another stage serving the same layers (the old one stopped answering).

        The swap is one assignment; every call reads ``self.downstream`` once and keeps that
        edge, so a frame sent to the old one just as it closes fails UNAVAILABLE (and the head
        recovers it) instead of mixing two edges in one call. A hand-off keeps the old one open a
        little longer (``close_old=False``) to move resident prefixes through it, and closes it."""
        old, self.downstream = self.downstream, client
        self.downstream_health = HealthProbe(False, f"switched to {client.peer.stage_id}; edge not agreed yet")
        self.log.warning("downstream switched", from_stage=old.peer.stage_id if old else None,
                         to_stage=client.peer.stage_id, endpoint=client.peer.endpoint)
        if old is not None and close_old:
            old.close()

    @property
    def state(self) -> StageState:
        return self._state

    def transition(self, new: StageState) -> bool:
        """Move to ``new`` if the lifecycle allows it; False when it does not."""
        with self._state_lock:
            if new not in _TRANSITIONS[self._state]:
                return False
            self._state = new
        self.log.info("stage state", state=new.value)
        return True

    def load(self) -> None:
        """Slice (or reuse) the stage file and load it; the slow part of start-up."""
        self.architecture = read_model_info(self.config.model_path).architecture
        runtime = StageRuntime(self.config)
        self.shape = StageShape(
            stage_id=self.config.stage_id, stage_index=self.config.stage_index,
            layer_start=self.config.layer_start, layer_end=self.config.layer_end, n_embd=runtime.n_embd,
            include_embeddings=self.config.include_embeddings, include_output=self.config.include_output,
            wire_dtype=self.config.wire_dtype,
        )
        self.runtime = runtime
        self.native = native_frames.for_stage(self)
        self.native_head = native_frames.for_head(self)
        if self.native_head is not None:
            self.returns.lone = self.native_head.wait
        m = self.metrics
        m.gauge_from("lanes_active", lambda: runtime.stats().active_sessions)
        m.gauge_from("lanes_idle", lambda: runtime.stats().idle_lanes)
        m.gauge_from("kv_cells_used", lambda: runtime.stats().total_session_tokens)
        m.gauge_from("kv_cells_total", lambda: runtime.stats().kv_pool_tokens)
        m.gauge_from("resident_prefixes", lambda: len(runtime.stats().resident))
        self.transition(StageState.SERVING)

    @property
    def accepting_frames(self) -> bool:
        """Whether a frame may run here now (serving, or draining work already admitted)."""
        return self.runtime is not None and self._state in (StageState.SERVING, StageState.DRAINING)

    @property
    def ready(self) -> bool:
        """Loaded, serving, and (with a downstream) the whole chain below answers."""
        return self._state is StageState.SERVING and self.downstream_health.ok

    def require_runtime(self, *, draining_ok: bool = True) -> StageRuntime:
        """The runtime, or UNAVAILABLE; work already admitted may finish while draining."""
        if self.runtime is None or self._state is StageState.LOADING:
            raise StageUnavailableError(f"stage {self.config.stage_id} is still loading")
        if self._state is StageState.DRAINING and draining_ok:
            return self.runtime
        if self._state is not StageState.SERVING:
            raise StageUnavailableError(f"stage {self.config.stage_id} is {self._state.value}")
        return self.runtime

    def wait_drained(self, timeout_s: float) -> bool:
        """Draining: wait until no session here is at work (bound and fed within the last
        ``DRAIN_IDLE_S``) and no frame is passing, so the generations under way finish or move to
        a stand-in (``handoff``) before the process stops. A session nobody has fed for that long
        (a client that went away) does not hold the drain; True if nothing was left at work.

        After a hand-off the upstream still has to switch its edge: stopping first would break
        the link it still sends on (and fail its steps), so the wait lasts until it has closed
        the link (it does right after switching)."""
        deadline = time.monotonic() + timeout_s
        while True:
            runtime = self.runtime
            busy = [] if runtime is None else runtime.lanes.busy_sessions(DRAIN_IDLE_S)
            switching = self._moved_away > 0 and len(self.inbound) > 0
            if not busy and not switching and self.gate.wait_idle(0):
                self.log.info("drained", sessions_handed_off=self._moved_away)
                return True
            if time.monotonic() >= deadline:
                self.log.warning("drain grace over; sessions still at work", sessions=busy[:16])
                return False
            time.sleep(0.02)

    def close(self) -> None:
        self.transition(StageState.STOPPED)
        if self.downstream is not None:
            self.downstream.close()
        if self.return_path is not None:
            self.return_path.close()
        if self.runtime is not None:
            self.runtime.close()

    # -- the frame path --------------------------------------------------------------

    def _prepare(self, step: Step, tally: Tally):
        """Check one step against this stage (no llama.cpp yet): its runtime entries."""
        runtime = self.require_runtime()
        entries = runtime_entries(step, self.shape)
        self._check_reply_fits(step, runtime.n_vocab)
        if step.frame is not None:
            tally.received.append((step.frame.descriptor.dtype, len(step.frame.payload)))
        return entries

    def _compute(self, entries, tally: Tally, owner: Peer | None = None):
        """One llama_decode over ``entries`` (of one batch, or of several frames coalesced);
        ``owner``: the upstream connection they came over (it owns the sessions they open)."""
        started = time.perf_counter()
        results = self.require_runtime().run_batch(entries, owner)
        tally.computes.append((time.perf_counter() - started, len(entries), sum(len(e.positions) for e in entries),
                               [int(e.positions[0]) for e in entries if e.fork_of is not None]))
        return results

    def _pass_on(self, step: Step, results, downstream: DownstreamClient | LocalDownstream | None, *, relay: bool,
                 remaining_s: float | None, sink: Sink | None, tally: Tally, hop_id: int = 0) -> Outputs | None:
        """Hand this stage's output on: a frame to ``downstream`` (the edge the caller read once:
        the monitor may switch it meanwhile), or (final stage) the outputs to the head, to
        ``sink`` (relayed up one edge), or returned (None when sent)."""
        if downstream is None:
            outputs = outputs_from_results(results, self.config.stage_id)
            if not relay and self.return_path is not None and step.return_key:
                if self.return_path.send(step.return_key, outputs):
                    tally.returns.append("sent")
                    return None
            if sink is None:
                return outputs
            sink(Reply(hop_id=hop_id, return_key=step.return_key, outputs=outputs))
            tally.returns.append("relayed")
            return None
        forward = forward_step(step, results, self.shape)
        downstream.send(Frame(step=forward, relay=relay, timeout_s=downstream.timeout_for(remaining_s)))
        tally.sent.append((self.shape.wire_dtype, len(forward.frame.payload)))
        return None

    def accept_frame(self, frame: Frame, sink: Sink) -> None:
        """A frame from the upstream edge whose back channel is ``sink``; never raises.

        Runs on the receiving thread: this stage's layers, then the frame on (or the outputs
        back). A failure frees the frame's sessions here and goes up ``sink`` naming them.
        """
        tally = Tally()
        try:
            with self.gate.passing():
                self._accept_one(frame, sink, tally)
        finally:
            self.metrics.record(tally)

    def _accept_one(self, frame: Frame, sink: Sink, tally: Tally) -> None:
        self._observe_latency(frame, tally)
        try:
            entries = self._prepare(frame.step, tally)
        except SkippyError as exc:
            self.refuse_frame(frame, exc, sink)
            return
        self._finish(frame, entries, sink, tally)

    def accept_frames(self, frames: list[Frame], sink: Sink) -> None:
        """Frames that arrived together on one edge: run in one llama_decode, then each passed
        on as its own frame (their steps may belong to different groups of the head). A frame
        that fails its checks is answered alone; if the joint decode is refused (say, a session
        of one frame has no lane), each frame runs on its own, so one bad frame never fails
        another (the runtime rolls a refused batch back entirely)."""
        tally = Tally()
        try:
            with self.gate.passing():
                if len(frames) == 1:
                    self._accept_one(frames[0], sink, tally)
                else:
                    self._accept_together(frames, sink, tally)
        finally:
            self.metrics.record(tally)

    def _accept_together(self, frames: list[Frame], sink: Sink, tally: Tally) -> None:
        ready: list[tuple[Frame, list]] = []
        for frame in frames:
            try:
                ready.append((frame, self._prepare(frame.step, tally)))
            except SkippyError as exc:
                self.refuse_frame(frame, exc, sink)
        budget = self.config.n_batch
        groups: list[list[tuple[Frame, list]]] = []
        for item in ready:
            tokens = sum(len(e.positions) for e in item[1])
            if groups and budget >= tokens:
                groups[-1].append(item)
            else:
                groups.append([item])
                budget = self.config.n_batch
            budget -= tokens
        for group in groups:
            for frame, _ in group:
                self._observe_latency(frame, tally)
            if len(group) == 1:
                self._finish(group[0][0], group[0][1], sink, tally)
                continue
            self.metrics.coalesced_frames.inc(len(group))
            try:
                results = self._compute([e for _, entries in group for e in entries], tally, _owner(sink))
            except SkippyError:
                for frame, entries in group:
                    self._finish(frame, entries, sink, tally)
                continue
            offset = 0
            for frame, entries in group:
                mine, offset = results[offset:offset + len(entries)], offset + len(entries)
                self._send_on(frame, mine, sink, tally)

    @staticmethod
    def _observe_latency(frame: Frame, tally: Tally) -> None:
        if frame.sent_unix_ns:
            tally.latencies.append(max(0.0, (time.time_ns() - frame.sent_unix_ns) / 1e9))

    def _finish(self, frame: Frame, entries, sink: Sink, tally: Tally) -> None:
        """Run one checked frame alone and pass it on (errors go up ``sink``)."""
        try:
            results = self._compute(entries, tally, _owner(sink))
        except SkippyError as exc:
            self.refuse_frame(frame, exc, sink)
            return
        self._send_on(frame, results, sink, tally)

    def _send_on(self, frame: Frame, results, sink: Sink, tally: Tally) -> None:
        step = frame.step
        downstream = self.downstream
        incoming = step.return_key
        try:
            if downstream is not None:
                step.return_key = self.routes.claim(incoming, sink, frame.hop_id)
            self._pass_on(step, results, downstream, relay=frame.relay, remaining_s=frame.timeout_s or None, sink=sink,
                          tally=tally, hop_id=frame.hop_id)
            tally.frames_ok += 1
        except SkippyError as exc:
            if step.return_key != incoming:  # the frame never left: answer under the key it came with
                self.routes.take(step.return_key)
                step.return_key = incoming
            self.refuse_frame(frame, exc, sink)

    def refuse_frame(self, frame: Frame, exc: SkippyError, sink: Sink) -> None:
        """A frame failed here or could not go on: free its sessions, say so up its edge."""
        step = frame.step
        sessions = step.session_ids[:1024]
        self._failed(exc, sessions, step.request_id)
        self.metrics.requests(rpc="Frame", code=status_for(exc)[0].name).inc()
        sink(error_reply(exc, return_key=step.return_key[:64], session_ids=sessions, hop_id=frame.hop_id,
                         stage_id=self.config.stage_id))

    def _failed(self, exc: SkippyError, sessions: list[str], request_id: str) -> None:
        """A batch failed here or below: free its sessions on this stage (and, if the edge
        below broke, remember to free them below once it answers again)."""
        self.free_sessions(sessions)
        if isinstance(exc, DownstreamError):
            self.metrics.forward_failures.labels(exc.stage_id).inc()
            if exc.code_name == "UNAVAILABLE":
                self.downstream_health = HealthProbe(False, str(exc))
                self.remember_drops(sessions)
            self.log.warning("batch lost below; sessions freed", failed_stage=exc.stage_id, error=str(exc),
                             sessions=sessions[:16], request_id=request_id)

    def process(self, step: Step, remaining_s: float | None, *, relay: bool | None = None,
                on_sent: Callable[[], None] | None = None) -> Outputs:
        """Run one step from here down and wait for its outputs: the head's scheduler, and the
        unary IterationBatch / ActivationFrame / Decode calls.

        The head lets the final stage return straight to it; any other stage asks for the
        outputs to be relayed back up to it (``relay``). ``on_sent`` runs once this stage's part
        is done (the frame sent on), before the wait.
        """
        tracing.mark("proc")
        if relay is None:
            relay = not self.config.include_embeddings
        outcome = HopFuture()
        key = ""
        sessions: list[str] = []
        tally = Tally()
        try:
            with self.gate.passing():  # from compute to the frame's send, as for a frame from above
                downstream = self.downstream
                timeout = downstream.timeout_for(remaining_s) if downstream is not None else 0.0
                if downstream is not None and self._native_step(step, downstream, outcome, relay=relay,
                                                                timeout_s=timeout, tally=tally):
                    key, sessions = step.return_key, step.session_ids
                    started = time.perf_counter()
                else:
                    entries = self._prepare(step, tally)
                    results = self._compute(entries, tally)
                if downstream is None:
                    outputs = outputs_from_results(results, self.config.stage_id)
                elif not key:
                    sessions = [e.session_id for e in entries]
                    key = self.returns.expect(outcome)
                    step.return_key = key
                    started = time.perf_counter()
                    try:
                        self._pass_on(step, results, downstream, relay=relay, remaining_s=timeout, sink=None,
                                      tally=tally)
                    except SkippyError as exc:
                        # freed before the pass ends: a hand-off must not list a session that failed
                        self._failed(exc, sessions, step.request_id)
                        sessions = []
                        raise
            if on_sent is not None:
                on_sent()  # while the stages below work: the head's side jobs (the client's stream)
            self.metrics.record(tally)
            if downstream is None:
                return outputs
            try:
                tracing.mark("wait")
                outputs = outcome.result(timeout=timeout + 0.05)
                tracing.mark("woke")
            except FutureTimeout:
                raise DownstreamError(f"stage {downstream.peer.stage_id} at {downstream.peer.endpoint}: the step's "
                                      f"outputs did not arrive within {timeout:.3f}s", stage_id=downstream.peer.stage_id,
                                      code_name="DEADLINE_EXCEEDED") from None
            self.metrics.hop_seconds.observe(time.perf_counter() - started)
            return outputs
        except SkippyError as exc:
            if sessions:
                self._failed(exc, sessions, step.request_id)
            raise
        finally:
            self.metrics.record(tally)  # what a failed step computed (empty once recorded after the send)
            if key:
                self.returns.forget(key)

    def process_lone(self, step: Step, remaining_s: float | None, *, on_token: Callable[..., int],
                     limit: int, eog: bytes, bell: object = None) -> Outputs:
        """``process`` for the head's lone greedy generation: ``step`` (one plain decode entry)
        and, on each token that comes back, the next step with it, in C
        (``NativeHead.lone``), while fewer than ``limit`` tokens came back, none in ``eog`` and
        ``on_token`` (called once a step's frame has left: None for the first, else the token it
        fed) says go on. From the C loop it is called ``on_token(fed, True)`` and returns bit 0 go
        on, bit 1 ring ``bell`` (``_frames.Bell``, rung once the GIL is released); called here, with
        the token alone, it wakes its handler itself. Returns the last step's outputs, or raises
        its error, as ``process`` would for that step; anything the C path cannot take runs
        through ``process``."""
        native = self.native_head
        downstream = self.downstream
        hop = downstream.hop if isinstance(downstream, DownstreamClient) else None
        link = hop.plain_link if isinstance(hop, TcpHop) else None
        done = None
        if native is not None and link is not None and not step.return_key:
            timeout = downstream.timeout_for(remaining_s)
            done = native.lone(step, self, downstream, link, timeout_s=timeout, limit=limit, eog=eog,
                               on_token=on_token, bell=bell)
        if done is None:
            return self.process(step, remaining_s, on_sent=lambda: on_token(None))
        how, value, steps, computes, hops, final_id = done
        entry = step.entries[0]
        self._record_lone(computes, steps, hops, answered=len(hops) - (how in (native_frames.LONE_SETTLED,
                                                                            native_frames.LONE_TIMEOUT)))
        if how == native_frames.LONE_TOKEN:
            return Outputs(outputs=[Output(session_id=entry.session_id, token=value)], final_stage_id=final_id)
        if how == native_frames.LONE_DECLINED:
            if not steps:
                return self.process(step, remaining_s, on_sent=lambda: on_token(None))
            on_token(value)  # a token that came back: the scheduler's before the step that feeds it runs
            position = entry.positions[0] + steps
            return self.process(Step(request_id=f"{step.request_id}+{steps}", entries=[dataclasses.replace(
                entry, positions=range(position, position + 1), token_ids=[value],
                draws_before=entry.draws_before + steps)]), remaining_s)
        if how in (native_frames.LONE_DECODE_FAILED, native_frames.LONE_UNSENT):
            rc, fed = value
            if fed is not None:
                on_token(fed)  # it came back before the step that fed it failed: the scheduler's
            if how == native_frames.LONE_DECODE_FAILED:
                raise decode_error(rc, 1)  # the runtime cut the KV back; as ``process``, nothing freed here
            exc = hop.broke(link, "send failed")
        elif how == native_frames.LONE_SETTLED:
            if not isinstance(value, BaseException):
                return value
            exc = value
        else:
            exc = DownstreamError(f"stage {downstream.peer.stage_id} at {downstream.peer.endpoint}: the step's "
                                  f"outputs did not arrive within {timeout:.3f}s", stage_id=downstream.peer.stage_id,
                                  code_name="DEADLINE_EXCEEDED")
        if isinstance(exc, SkippyError):
            self._failed(exc, [entry.session_id], step.request_id)
        raise exc

    def _record_lone(self, computes: list[float], steps: int, hops: list[float], *, answered: int) -> None:
        """A lone run's metrics, as ``process`` records its steps': each decode, each frame sent,
        and each return that came (``answered``: the first so many waits, which a token ended)."""
        tally = Tally()
        tally.computes.extend((compute_s, 1, 1, []) for compute_s in computes)
        tally.native += len(computes)
        tally.sent.extend([("f32", self.native_head.row_bytes)] * steps)
        self.metrics.record(tally)
        self.metrics.lone_steps.inc(steps)
        for seconds in hops[:answered]:
            self.metrics.hop_seconds.observe(seconds)
        if answered > 0:
            self.metrics.returns(path="direct").inc(answered)

    def _native_step(self, step: Step, downstream, outcome: HopFuture, *, relay: bool, timeout_s: float,
                     tally: Tally) -> bool:
        """The head's step through the C path, sent on under a key ``outcome`` waits for; False
        (nothing done, no key registered) when the Python path must run it. A failed send frees
        the step's sessions here before the error goes up, as the Python path does. A step that
        came with a return key of its own (a unary call's) is the Python path's: it checks it."""
        if self.native_head is None or step.return_key:
            return False
        step.return_key = self.returns.expect(outcome)
        sent = False
        try:
            sent = self.native_head.run(step, downstream, relay=relay, timeout_s=timeout_s, tally=tally)
        except DownstreamError as exc:
            self._failed(exc, step.session_ids, step.request_id)
            raise
        finally:
            if not sent:
                self.returns.forget(step.return_key)
        if not sent:
            step.return_key = ""
        return sent

    def _from_below(self, reply: Reply) -> None:
        """A message on the downstream edge's back channel (its reader thread): settle the step
        waiting here, or pass it up; an error first frees its sessions on this stage."""
        downstream = self.downstream
        if reply.code == "OK":
            if self.returns.deliver(reply.return_key, reply.outputs):
                self.metrics.returns(path="relay").inc()
            elif not self._up(reply):
                self.log.info("relayed outputs nobody waits for any more", return_key=reply.return_key[:64])
            return
        error = (downstream.reply_error(reply) if downstream is not None else
                 DownstreamError(reply.message, stage_id=reply.failed_stage or "below"))
        sessions = list(reply.session_ids)
        if sessions:
            self.free_sessions(sessions)
        if not reply.return_key:
            # The edge below the failed stage broke: whatever was in flight through it is lost.
            if error.code_name == "UNAVAILABLE":
                self.downstream_health = HealthProbe(False, str(error))
            lost = self.returns.fail_all(error)
            self._log_break("an edge below broke", lost, failed_stage=error.stage_id, error=str(error))
            self.inbound.broadcast(reply)
            return
        if not self.returns.fail(reply.return_key, error):
            self._up(reply)

    def _up(self, reply: Reply) -> bool:
        """Send a reply from below up the edge its step came down. One whose step has no route
        here any more (a unary caller that gave up) is dropped: nobody above waits for it."""
        route = self.routes.take(reply.return_key)
        if route is None:
            return False
        sink, hop_id = route
        sink(dataclasses.replace(reply, hop_id=hop_id))
        return True

    def _link_broken(self, client: DownstreamClient | None, error: DownstreamError) -> None:
        """The link to the downstream broke: fail every step waiting here, tell the stages above."""
        if client is not None and client is self.downstream:
            self.downstream_health = HealthProbe(False, str(error))
        lost = self.returns.fail_all(error)
        self._log_break("downstream link broke", lost, failed_stage=error.stage_id, error=str(error))
        self.inbound.broadcast(error_reply(error, return_key="", session_ids=[]))

    def _log_break(self, event: str, lost: int, **fields: object) -> None:
        """A warning, unless nothing was lost and this stage is on its way out too: stages that
        stop together (``up``, ``demo``) see their neighbours close, and that is no news."""
        quiet = lost == 0 and self.state in (StageState.DRAINING, StageState.STOPPED)
        (self.log.info if quiet else self.log.warning)(event, steps_lost=lost, **fields)

    def deliver_return(self, key: str, outputs: Outputs) -> bool:
        """A final stage's direct return; False when no step waits for it (late or unknown)."""
        settled = self.returns.deliver(key, outputs)
        if settled:
            self.metrics.returns(path="direct").inc()
        return settled

    def remember_drops(self, session_ids: list[str]) -> None:
        """Sessions the stages below may still hold behind a broken edge: freed there once it
        answers again (``retry_pending_drops``; the idle TTL is only the last resort)."""
        if self.downstream is None or not session_ids:
            return
        with self._pending_lock:
            self._pending_drops.update(session_ids)

    def retry_pending_drops(self) -> None:
        """Send the drops the stages below have not confirmed yet (the health monitor calls
        this whenever the downstream answers)."""
        downstream = self.downstream
        if downstream is None or not self._drop_retry.acquire(blocking=False):
            return  # a retry is already under way
        try:
            with self._pending_lock:
                pending = list(self._pending_drops)
            for session_id in pending:
                try:
                    downstream.drop_session(session_id, self.timeouts.health_probe_s)
                except DownstreamError as exc:
                    if exc.code_name != "NOT_FOUND":
                        continue  # still unreachable: keep it for the next retry
                with self._pending_lock:
                    self._pending_drops.discard(session_id)
        finally:
            self._drop_retry.release()

    def expire_idle_sessions(self) -> list[str]:
        """Free sessions idle for longer than session_idle_ttl_s; returns their ids."""
        ttl = self.config.session_idle_ttl_s
        if not ttl or self.runtime is None:
            return []
        expired = self.runtime.lanes.idle_sessions(ttl)
        for session_id in expired:
            try:
                self.runtime.drop_session(session_id)
                self.log.info("session expired", session_id=session_id, idle_ttl_s=ttl)
            except UnknownSessionError:
                pass  # freed meanwhile
        return expired

    def _check_reply_fits(self, step: Step, n_vocab: int) -> None:
        """Refuse up front a batch whose logits could not travel back within the size limit."""
        wanted = sum(1 for e in step.entries if e.want_logits)
        reply_bytes = wanted * n_vocab * 5 + 64 * len(step.entries)  # packed floats + framing
        if wanted and reply_bytes > self.max_message_bytes:
            raise InvalidRequestError(
                f"{wanted} entries set want_logits: the reply (~{reply_bytes} bytes) exceeds "
                f"max_message_bytes={self.max_message_bytes}"
            )

    def peer_closed(self, peer: Peer) -> None:
        """An upstream connection ended: free the sessions it still owns, here and below."""
        runtime = self.runtime
        if runtime is not None:
            self.release_sessions(runtime.lanes.owned_by(peer), peer)

    def release_sessions(self, session_ids: list[str], owner: Peer | None) -> None:
        """Free those of ``session_ids`` that ``owner``'s connection owns here, and send their drop
        down this stage's edge in order with the frames already sent on it (``LocalHop``'s sessions
        have no owner: ``owner`` None frees the unowned ones). Never raises."""
        runtime = self.runtime
        if runtime is None or not session_ids or self._state is StageState.STOPPED:
            return
        with self.gate.passing():  # a hand-off must not move a session this frees below
            freed = runtime.drop_owned(session_ids, owner)
            downstream = self.downstream
            if freed and downstream is not None:
                downstream.release(freed)

    def disown_sessions(self, session_ids: list[str], owner: Peer | None) -> None:
        """The stage above let these sessions go to a stand-in: they stay bound here, no longer
        ``owner``'s, so its connection's end does not free them (the stand-in's feeds them)."""
        runtime = self.runtime
        if runtime is None or owner is None:
            return
        for session_id in session_ids:
            runtime.lanes.disown(session_id, owner)

    def free_sessions(self, session_ids: list[str]) -> None:
        """Free sessions on this stage only (after a failure), ignoring unknown ones."""
        if self.runtime is None:
            return
        for session_id in session_ids:
            try:
                self.runtime.drop_session(session_id)
            except UnknownSessionError:
                pass

    def drop_session(self, session_id: str, remaining_s: float | None, *, keep_prefix: bool = False) -> list[StageDrop]:
        """Free the session here and on every stage below; NOT_FOUND only if no stage had it.

        ``keep_prefix``: each stage keeps the session's KV as a resident prefix instead (the
        head retires a finished session so a later one may start from it). It passes the gate:
        a hand-off under way must not move a session this call is freeing below."""
        _check_session_id(session_id)
        with self.gate.passing():
            return self._drop_session(session_id, remaining_s, keep_prefix=keep_prefix)

    def _drop_session(self, session_id: str, remaining_s: float | None, *, keep_prefix: bool) -> list[StageDrop]:
        runtime = self.require_runtime()
        try:
            result = runtime.retire_session(session_id) if keep_prefix else runtime.drop_session(session_id)
            stages = [StageDrop(self.config.stage_id, True, result.reset_seconds * 1e3)]
        except UnknownSessionError:
            stages = [StageDrop(self.config.stage_id, False)]
        downstream = self.downstream
        if downstream is not None:
            try:
                stages.extend(downstream.drop_session(session_id, remaining_s, keep_prefix))
            except DownstreamError as exc:
                if exc.code_name != "NOT_FOUND":
                    self.remember_drops([session_id])
                    raise
                stages.append(StageDrop(downstream.peer.stage_id, False))
        if not any(s.found for s in stages):
            raise UnknownSessionError(f"session_id={session_id!r} is not bound on stage {self.config.stage_id} or below")
        return stages

    def trim_session(self, session_id: str, tokens: int, remaining_s: float | None) -> list[StageTrim]:
        """Cut the session back to its first ``tokens`` here and on every stage below, in one call.

        A bad count is refused here before any stage cuts (every stage holds the same tokens of a
        session). If a stage below fails after this one cut, the stages would disagree on the
        session's length: it is dropped everywhere, and the error says so."""
        _check_session_id(session_id)
        with self.gate.passing():
            return self._trim_session(session_id, tokens, remaining_s)

    def _trim_session(self, session_id: str, tokens: int, remaining_s: float | None) -> list[StageTrim]:
        before = self.require_runtime().trim_session(session_id, tokens)
        stages = [StageTrim(self.config.stage_id, before)]
        downstream = self.downstream
        if downstream is not None:
            try:
                stages.extend(downstream.trim_session(session_id, tokens, remaining_s))
            except DownstreamError as exc:
                try:
                    self._drop_session(session_id, remaining_s, keep_prefix=False)
                except SkippyError:
                    pass
                raise DownstreamError(f"{exc}; session_id={session_id!r} was dropped on every stage (a trim that "
                                      f"half happened would leave them disagreeing)", stage_id=exc.stage_id,
                                      code_name=exc.code_name) from None
        return stages

    def export_session(self, session_id: str, *, wait_for_tokens: int = 0, wait_for_batches: int = 0,
                       release: bool = False, remaining_s: float | None = None) -> KvPage:
        """This stage's KV of a live session, as a page (for a stand-in of the same layers).

        ``wait_for_tokens``: the upstream of a draining stage names the count it has sent; the
        frames still on their way land first (polled: a hand-off is rare and short), and the page
        then holds exactly that many (``wait_for_batches``: and was fed exactly that many batches, a
        count a speculative rewind cannot take back). ``release``: the session moved, free its lane."""
        _check_session_id(session_id)
        runtime = self.require_runtime()
        if wait_for_tokens or wait_for_batches:
            budget = timeout_for(remaining_s, self.timeouts.hop_s)
            # stop waiting a little before the caller's deadline, so it hears why, not a timeout
            deadline = time.monotonic() + budget - min(0.1, budget / 2)
            while time.monotonic() < deadline:
                bound = runtime.lanes.lane_of(session_id)
                if bound is None or (bound.batches >= wait_for_batches if wait_for_batches
                                     else bound.n_tokens >= wait_for_tokens):
                    break
                time.sleep(0.002)
        if release:
            self._count_moved(+1)  # before the lane goes: the drain must not see it idle and stop
        try:
            page = runtime.export_session(session_id, self.config.max_message_bytes, tokens=wait_for_tokens or None,
                                          batches=wait_for_batches or None, release=release)
        except SkippyError:
            if release:
                self._count_moved(-1)
            raise
        self.metrics.sessions_moved.labels("exported").inc()
        downstream = self.downstream
        if release and downstream is not None:
            # The stages below keep it for the stand-in: once this stage's last frame of it has left
            # (nothing new comes in: the upstream's gate is closed), the edge below lets it go.
            self.gate.wait_idle(min(1.0, timeout_for(remaining_s, self.timeouts.hop_s)))
            downstream.release([session_id], moved=True)
        return page

    def _count_moved(self, change: int) -> None:
        with self._pending_lock:  # exports run on several gRPC threads at once
            self._moved_away += change

    def import_session(self, session_id: str, page: KvPage, *, resident: bool = False) -> int:
        _check_session_id(session_id)
        tokens = self.require_runtime().import_session(session_id, page, resident=resident)
        self.metrics.sessions_moved.labels("imported").inc()
        return tokens

    def status(self) -> StageReport:
        cfg = self.config
        downstream = self.downstream
        health = self.downstream_health
        runtime = self.runtime
        return StageReport(
            stage_id=cfg.stage_id, stage_index=cfg.stage_index, run_id=cfg.run_id, topology_id=cfg.topology_id,
            model_id=cfg.model_id or cfg.model_path, architecture=self.architecture,
            layer_start=cfg.layer_start, layer_end=cfg.layer_end, include_embeddings=cfg.include_embeddings,
            include_output=cfg.include_output, state=self._state.value, wire_dtype=cfg.wire_dtype,
            hop_transport=cfg.hop_transport, frame_port=self.frame_port, tls=self.credentials.cert is not None,
            downstream_ok=health.ok, downstream_error="" if health.ok else health.detail,
            downstream_stage_id=downstream.peer.stage_id if downstream else "",
            downstream_endpoint=downstream.peer.endpoint if downstream else "",
            n_embd=runtime.n_embd if runtime is not None else 0,
            lanes=runtime.stats() if runtime is not None else None,
        )


def _owner(sink: Sink) -> Peer | None:
    """The upstream connection a back channel belongs to (None: an in-process edge)."""
    return sink if isinstance(sink, Peer) else None


def _check_session_id(session_id: str) -> None:
    """Refuse an id no lane could be bound to, before any stage is asked."""
    if not session_id or len(session_id) > MAX_SESSION_ID_LEN:
        raise InvalidRequestError(f"session_id must be 1..{MAX_SESSION_ID_LEN} characters, got {len(session_id)}")
