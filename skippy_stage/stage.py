"""One stage: its runtime, its downstream hop, and what happens to a batch passing through.

The gRPC servicer (``service``) is a thin shell around this: parse, call, serialise. A
batch runs through the local layers under the runtime's lock, then, outside every lock,
travels to the downstream stage; the answer is relayed back. If the downstream fails,
the sessions of that batch are freed here before the error travels up, so no stage keeps
a half-advanced session: "a session that fails anywhere is freed on every stage".
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass

import structlog

from skippy_stage.config import PeerConfig, StageConfig
from skippy_stage.downstream import DownstreamClient, HealthProbe, HopFuture
from skippy_stage.errors import DownstreamError, InvalidRequestError, SkippyError, UnknownSessionError
from skippy_stage.messages import PB_TO_DTYPE, StageShape, entries_from_request, forward_request, response_from_results
from skippy_stage.metrics import StageMetrics
from skippy_stage.returns import ReturnBox, ReturnClient
from skippy_stage.runtime import StageRuntime
from skippy_stage.security import Credentials
from skippy_stage.slicing import read_model_info
from skippy_stage.v1 import stage_pb2 as pb

log = structlog.get_logger("skippy_stage.stage")


def _codec(request: pb.IterationBatchRequest) -> str:
    return PB_TO_DTYPE.get(request.frame.descriptor.dtype, "unknown")


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
    """Every timeout is named by its scope."""

    hop_s: float = 30.0  # one downstream call, capped further by the caller's deadline
    health_probe_s: float = 1.0  # one downstream health check
    health_interval_s: float = 0.5  # between downstream health checks
    step_s: float = 60.0  # one generation step at the head, end to end


class Stage:
    """The stage's domain object; owns the runtime and the downstream client."""

    def __init__(self, config: StageConfig, *, max_message_bytes: int, timeouts: Timeouts = Timeouts()) -> None:
        self.config = config
        self.timeouts = timeouts
        self.max_message_bytes = max_message_bytes
        self.log = log.bind(stage_id=config.stage_id, run_id=config.run_id)
        self.runtime: StageRuntime | None = None
        self.shape: StageShape | None = None
        self.architecture = ""
        self._state = StageState.LOADING
        self._state_lock = threading.Lock()
        self.downstream = self.client_for(config.downstream) if config.downstream is not None else None
        self.downstream_health = HealthProbe(config.downstream is None, "not probed yet")
        self.metrics = StageMetrics(config.stage_id)
        self._pending_drops: set[str] = set()
        self._pending_lock = threading.Lock()
        self.returns = ReturnBox()
        self.return_client = None if config.return_to is None else ReturnClient(
            config.return_to, stage_id=config.stage_id, max_message_bytes=max_message_bytes,
            credentials=Credentials.from_config(config))

    # -- lifecycle -------------------------------------------------------------------

    def client_for(self, peer: PeerConfig) -> DownstreamClient:
        return DownstreamClient(peer, max_message_bytes=self.max_message_bytes, hop_timeout_s=self.timeouts.hop_s,
                                transport=self.config.hop_transport, credentials=Credentials.from_config(self.config))

    def switch_downstream(self, client: DownstreamClient) -> None:
        """Send frames to another stage serving the same layers (the old one stopped answering)."""
        old, self.downstream = self.downstream, client
        self.downstream_health = HealthProbe(False, f"switched to {client.peer.stage_id}; edge not agreed yet")
        self.log.warning("downstream switched", from_stage=old.peer.stage_id if old else None,
                         to_stage=client.peer.stage_id, endpoint=client.peer.endpoint)
        if old is not None:
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
        m = self.metrics
        m.gauge_from("lanes_active", lambda: runtime.stats().active_sessions)
        m.gauge_from("lanes_idle", lambda: runtime.stats().idle_lanes)
        m.gauge_from("kv_cells_used", lambda: runtime.stats().total_session_tokens)
        m.gauge_from("kv_cells_total", lambda: runtime.stats().kv_pool_tokens)
        self.transition(StageState.SERVING)

    @property
    def ready(self) -> bool:
        """Loaded, serving, and (with a downstream) the whole chain below answers."""
        return self._state is StageState.SERVING and self.downstream_health.ok

    def require_runtime(self, *, draining_ok: bool = True) -> StageRuntime:
        """The runtime, or UNAVAILABLE; work already admitted may finish while draining."""
        if self.runtime is None or self._state is StageState.LOADING:
            raise DownstreamError(f"stage {self.config.stage_id} is still loading", stage_id=self.config.stage_id)
        if self._state is StageState.DRAINING and draining_ok:
            return self.runtime
        if self._state is not StageState.SERVING:
            raise DownstreamError(f"stage {self.config.stage_id} is {self._state.value}", stage_id=self.config.stage_id)
        return self.runtime

    def close(self) -> None:
        self.transition(StageState.STOPPED)
        if self.downstream is not None:
            self.downstream.close()
        if self.return_client is not None:
            self.return_client.close()
        if self.runtime is not None:
            self.runtime.close()

    # -- the batch path --------------------------------------------------------------

    def process(self, request: pb.IterationBatchRequest, remaining_s: float | None) -> pb.IterationBatchResponse:
        """Run the local layers, then forward and relay (or answer, at the final stage)."""
        runtime = self.require_runtime()
        if len(request.return_key) > 64:
            raise InvalidRequestError(f"return_key must be at most 64 characters, got {len(request.return_key)}")
        entries = entries_from_request(request, self.shape)
        self._check_reply_fits(request, runtime.n_vocab)
        m = self.metrics
        if request.HasField("frame"):
            m.activation_bytes.labels("received", _codec(request)).inc(
                len(request.frame.payload))
        started = time.perf_counter()
        results = runtime.run_batch(entries)
        m.compute_seconds.observe(time.perf_counter() - started)
        m.batch_entries.observe(len(entries))
        m.batch_tokens.observe(sum(len(e.positions) for e in request.entries))
        if self.downstream is None:
            response = response_from_results(results, self.config.stage_id)
            if self.return_client is not None and request.return_key:
                self.return_client.send(request.return_key, response)
                m.returns(path="sent").inc()
            return response
        try:
            forward = forward_request(request, results, self.shape)
        except SkippyError:
            self.free_sessions([e.session_id for e in entries])  # this stage advanced; nobody below did
            raise
        m.activation_bytes.labels("sent", self.shape.wire_dtype).inc(len(forward.frame.payload))
        started = time.perf_counter()
        try:
            response = self._forward(forward, remaining_s)
            m.hop_seconds.observe(time.perf_counter() - started)
            return response
        except DownstreamError as exc:
            m.forward_failures.labels(exc.stage_id).inc()
            if exc.code_name == "UNAVAILABLE":
                # Not ready until the health monitor sees the chain answer again.
                self.downstream_health = HealthProbe(False, str(exc))
            sessions = [e.session_id for e in entries]
            self.free_sessions(sessions)
            self._drop_below(sessions)
            self.log.warning("forward failed; sessions freed", failed_stage=exc.stage_id, error=str(exc),
                             sessions=sessions, request_id=request.request_id)
            raise

    def _forward(self, forward: pb.IterationBatchRequest, remaining_s: float | None) -> pb.IterationBatchResponse:
        """Send the frame down and wait for its outputs.

        Below the head, that is the relayed answer. The head also accepts the final stage's
        direct return (``returns``): the step is settled by whichever copy comes first, and
        a relayed error settles it only if the outputs have not already arrived.
        """
        if not self.config.include_embeddings:
            return self.downstream.forward(forward, remaining_s)
        timeout = self.downstream.timeout_for(remaining_s)
        outcome = HopFuture()
        forward.return_key = key = self.returns.expect(outcome)
        try:
            relay = self.downstream.submit(forward, remaining_s)

            def relayed(f: HopFuture) -> None:
                error = f.exception()
                if outcome.settle(result=None if error else f.result(), error=error):
                    self.metrics.returns(path="relay").inc()
                elif error is not None:
                    # The direct copy settled the step; the chain broke after the final stage
                    # answered. The stages that saw it freed the sessions: the next step finds
                    # them gone (NOT_FOUND) and the head re-prefills them.
                    self.log.warning("relayed answer failed after the direct return", error=str(error),
                                     request_id=forward.request_id)
            relay.add_done_callback(relayed)
            return self.downstream.wait(outcome, timeout, hop=relay)
        finally:
            self.returns.forget(key)

    def deliver_return(self, batch: pb.ReturnedBatch) -> bool:
        """A final stage's direct return; False when no step waits for it (late or unknown)."""
        settled = self.returns.deliver(batch.return_key, batch.response)
        if settled:
            self.metrics.returns(path="direct").inc()
        return settled

    def _drop_below(self, session_ids: list[str]) -> None:
        """Best effort, in the background: the stages below may hold the failed batch too.

        (A stage that already answered, when the reply was lost on the way back, has
        advanced its sessions.) The error travels up without waiting for this.
        """
        with self._pending_lock:
            self._pending_drops.update(session_ids)
        threading.Thread(target=self.retry_pending_drops, name="drop-below", daemon=True).start()

    def retry_pending_drops(self) -> None:
        """Send the drops the stages below have not confirmed yet.

        Called after a failure and again whenever the downstream answers health checks, so a
        session stranded below a cut link is freed as soon as the link is back (the idle TTL
        is only the last resort).
        """
        if self.downstream is None:
            return
        with self._pending_lock:
            pending = list(self._pending_drops)
        for session_id in pending:
            try:
                self.downstream.drop_session(session_id, self.timeouts.health_probe_s)
            except DownstreamError as exc:
                if exc.code_name != "NOT_FOUND":
                    continue  # still unreachable: keep it for the next retry
            with self._pending_lock:
                self._pending_drops.discard(session_id)

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

    def _check_reply_fits(self, request: pb.IterationBatchRequest, n_vocab: int) -> None:
        """Refuse up front a batch whose logits could not travel back within the size limit."""
        wanted = sum(1 for e in request.entries if e.want_logits)
        reply_bytes = wanted * n_vocab * 5 + 64 * len(request.entries)  # packed floats + framing
        if wanted and reply_bytes > self.max_message_bytes:
            raise InvalidRequestError(
                f"{wanted} entries set want_logits: the reply (~{reply_bytes} bytes) exceeds "
                f"max_message_bytes={self.max_message_bytes}"
            )

    def free_sessions(self, session_ids: list[str]) -> None:
        """Free sessions on this stage only (after a failure), ignoring unknown ones."""
        if self.runtime is None:
            return
        for session_id in session_ids:
            try:
                self.runtime.drop_session(session_id)
            except UnknownSessionError:
                pass

    def drop_session(self, session_id: str, remaining_s: float | None) -> pb.DropSessionResponse:
        """Free the session here and on every stage below; NOT_FOUND only if no stage had it."""
        if not session_id or len(session_id) > 256:
            raise InvalidRequestError(f"session_id must be 1..256 characters, got {len(session_id)}")
        runtime = self.require_runtime()
        try:
            result = runtime.drop_session(session_id)
            stages = [pb.StageDrop(stage_id=self.config.stage_id, found=True, reset_ms=result.reset_seconds * 1e3)]
        except UnknownSessionError:
            stages = [pb.StageDrop(stage_id=self.config.stage_id, found=False)]
        if self.downstream is not None:
            try:
                stages.extend(self.downstream.drop_session(session_id, remaining_s).stages)
            except DownstreamError as exc:
                if exc.code_name != "NOT_FOUND":
                    raise
                stages.append(pb.StageDrop(stage_id=self.downstream.peer.stage_id, found=False))
        if not any(s.found for s in stages):
            raise UnknownSessionError(f"session_id={session_id!r} is not bound on stage {self.config.stage_id} or below")
        return pb.DropSessionResponse(stages=stages)

    def status(self) -> pb.StageStatus:
        cfg = self.config
        msg = pb.StageStatus(
            stage_id=cfg.stage_id, stage_index=cfg.stage_index, run_id=cfg.run_id, topology_id=cfg.topology_id,
            model_id=cfg.model_id or cfg.model_path, architecture=self.architecture,
            layer_start=cfg.layer_start, layer_end=cfg.layer_end, include_embeddings=cfg.include_embeddings,
            include_output=cfg.include_output, state=self._state.value, wire_dtype=cfg.wire_dtype,
            downstream_ok=self.downstream_health.ok, downstream_error=self.downstream_health.detail if not self.downstream_health.ok else "",
        )
        if self.downstream is not None:
            msg.downstream_stage_id = self.downstream.peer.stage_id
            msg.downstream_endpoint = self.downstream.peer.endpoint
        if self.runtime is not None:
            s = self.runtime.stats()
            msg.n_embd = self.runtime.n_embd
            msg.lane_count, msg.active_sessions, msg.idle_lanes = s.lane_count, s.active_sessions, s.idle_lanes
            msg.free_lanes, msg.max_session_tokens = s.free_lanes, s.max_session_tokens
            msg.total_session_tokens, msg.kv_pool_tokens = s.total_session_tokens, s.kv_pool_tokens
            msg.kv_cells_per_lane, msg.discarded_lanes = s.kv_cells_per_lane, s.discarded_lanes
            msg.lanes.extend(
                pb.LaneRow(lane=r.lane, state=r.state, session_id=r.session_id or "", tokens=r.n_tokens) for r in s.lanes
            )
        return msg
