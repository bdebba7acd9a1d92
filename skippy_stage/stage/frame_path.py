"""A stage's frame path in Python: a frame passing through, a step waited for, and what
comes back up from below.

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

A frame alone on a plain link may take the compiled path instead (``native_frames``); whatever
that path declines runs here, and its rare outcomes come back here (``refuse_frame``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout

from skippy_stage import tracing
from skippy_stage.config import StageConfig
from skippy_stage.errors import DownstreamError, InvalidRequestError, SkippyError
from skippy_stage.metrics import Tally
from skippy_stage.model.runtime import decode_error
from skippy_stage.stage import native_frames
from skippy_stage.stage.downstream import DownstreamClient, HealthProbe, LocalDownstream
from skippy_stage.stage.hops import TcpHop
from skippy_stage.stage.lifecycle import StageState
from skippy_stage.stage.peers import Peer
from skippy_stage.stage.returns import HopFuture, LocalReturn, ReturnBox, StreamReturn, TcpReturn
from skippy_stage.stage.sessions import SessionCalls
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
from skippy_stage.stage.upstream import Inbound, Routes, Sink, error_reply, owner_of


class FramePath(SessionCalls):
    """A stage's data plane, on its session calls (a failed frame frees its sessions)."""

    def __init__(self, config: StageConfig, *, max_message_bytes: int) -> None:
        super().__init__(config)
        self.max_message_bytes = max_message_bytes
        self.shape: StageShape | None = None  # set once loaded
        self.downstream_health = HealthProbe(config.downstream is None, "not probed yet")
        self.returns = ReturnBox()
        self.inbound = Inbound()
        self.routes = Routes()
        # Where a final stage sends a step's outputs (None: back up the edges); ``Stage`` wires it.
        self.return_path: TcpReturn | StreamReturn | LocalReturn | None = None
        # The compiled paths (set once loaded; None: Python only): plain frames from above (below
        # the head), and the head's own plain decode steps.
        self.native: native_frames.NativeFrames | None = None
        self.native_head: native_frames.NativeHead | None = None

    def _prepare(self, step: Step, tally: Tally):
        """Check one step against this stage (no llama.cpp yet): its runtime entries."""
        runtime = self.require_runtime()
        entries = runtime_entries(step, self.shape)
        self._check_reply_fits(step, runtime.n_vocab)
        if step.frame is not None:
            tally.received.append((step.frame.descriptor.dtype, len(step.frame.payload)))
        return entries

    def _check_reply_fits(self, step: Step, n_vocab: int) -> None:
        """Refuse up front a batch whose logits could not travel back within the size limit."""
        wanted = sum(1 for e in step.entries if e.want_logits)
        reply_bytes = wanted * n_vocab * 5 + 64 * len(step.entries)  # packed floats + framing
        if wanted and reply_bytes > self.max_message_bytes:
            raise InvalidRequestError(
                f"{wanted} entries set want_logits: the reply (~{reply_bytes} bytes) exceeds "
                f"max_message_bytes={self.max_message_bytes}"
            )

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
                results = self._compute([e for _, entries in group for e in entries], tally, owner_of(sink))
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
            results = self._compute(entries, tally, owner_of(sink))
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
        return self.start_step(step, remaining_s, relay=relay, on_sent=on_sent).result()

    def start_step(self, step: Step, remaining_s: float | None, *, relay: bool | None = None,
                   on_sent: Callable[[], None] | None = None) -> StepInFlight:
        """``process`` without the wait: this stage's part of ``step`` (its layers, the frame sent
        on), then the step in flight, whose ``result`` waits for the outputs. The head keeps several
        speculative windows of a session in flight this way; frames on an edge keep their order, so
        every stage runs them in the order they were started."""
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
                else:
                    entries = self._prepare(step, tally)
                    results = self._compute(entries, tally)
                if downstream is None:
                    outcome.settle(result=outputs_from_results(results, self.config.stage_id))
                elif not key:
                    sessions = [e.session_id for e in entries]
                    key = self.returns.expect(outcome)
                    step.return_key = key
                    try:
                        self._pass_on(step, results, downstream, relay=relay, remaining_s=timeout, sink=None,
                                      tally=tally)
                    except SkippyError as exc:
                        # freed before the pass ends: a hand-off must not list a session that failed
                        self._failed(exc, sessions, step.request_id)
                        sessions = []
                        raise
            in_flight = StepInFlight(self, step, outcome, downstream, key, sessions, timeout)
            if on_sent is not None:
                on_sent()  # while the stages below work: the head's side jobs (the client's stream)
            self.metrics.record(tally)
            return in_flight
        except SkippyError as exc:
            if sessions:
                self._failed(exc, sessions, step.request_id)
            if key:
                self.returns.forget(key)
            raise
        finally:
            self.metrics.record(tally)  # what a failed step computed (empty once recorded after the send)

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


class StepInFlight:
    """A step whose frame has left (``FramePath.start_step``): ``result`` waits for its outputs.

    Its deadline runs from the send, however late ``result`` is called; ``returned_at`` is when the
    outputs (or the error) arrived (``perf_counter``; None while in flight), so a caller that takes
    results in order still sees each step's own trip."""

    def __init__(self, path: FramePath, step: Step, outcome: HopFuture, downstream, key: str, sessions: list[str],
                 timeout_s: float) -> None:
        self._path = path
        self._step = step
        self._outcome = outcome
        self._downstream = downstream
        self._key = key
        self._sessions = sessions
        self._timeout_s = timeout_s
        self.sent_at = time.perf_counter()
        self.returned_at: float | None = None
        outcome.add_done_callback(self._arrived)

    def _arrived(self, _future) -> None:
        self.returned_at = time.perf_counter()

    def done(self) -> bool:
        return self._outcome.done()

    def result(self) -> Outputs:
        """The step's outputs; raises its error (its sessions freed here, as ``process`` does)."""
        downstream = self._downstream
        try:
            if downstream is None:
                return self._outcome.result()
            try:
                tracing.mark("wait")
                left = self._timeout_s + 0.05 - (time.perf_counter() - self.sent_at)
                outputs = self._outcome.result(timeout=max(0.0, left))
                tracing.mark("woke")
            except FutureTimeout:
                raise DownstreamError(f"stage {downstream.peer.stage_id} at {downstream.peer.endpoint}: the step's "
                                      f"outputs did not arrive within {self._timeout_s:.3f}s",
                                      stage_id=downstream.peer.stage_id, code_name="DEADLINE_EXCEEDED") from None
            self._path.metrics.hop_seconds.observe((self.returned_at or time.perf_counter()) - self.sent_at)
            return outputs
        except SkippyError as exc:
            if self._sessions:
                self._path._failed(exc, self._sessions, self._step.request_id)
            raise
        finally:
            if self._key:
                self._path.returns.forget(self._key)
