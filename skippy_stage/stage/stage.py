"""One stage: its edges wired to its neighbours, its start and stop, and its report.

:class:`Stage` is the object the servicer (``service``), the TCP frame listener (``listener``),
the monitor and the head's scheduler hold. It is built in parts, each in the module named for
what it owns, each on the one before:

* ``lifecycle`` — the settings, the runtime once loaded, LOADING → SERVING → DRAINING → STOPPED;
* ``sessions`` — the calls on sessions besides frames: drop, trim, export, import, release;
* ``frame_path`` — a frame passing through, a step waited for, and the back channel from below;
* this module — the edges to the neighbours (over the network, or stages of this process),
  loading, draining, closing, and the status report.

The stage speaks domain types (``steps``, ``reports``); the servicer, the listener and the
socket transports are thin shells around it that convert at the edge (``codec``). The edges see
a stage of this process through ``ports`` only.
"""

from __future__ import annotations

import time

from skippy_stage.config import PeerConfig, StageConfig
from skippy_stage.errors import DownstreamError
from skippy_stage.model.runtime import StageRuntime
from skippy_stage.model.slicing import read_model_info, slice_metadata
from skippy_stage.security import Credentials
from skippy_stage.stage import native_frames
from skippy_stage.stage.downstream import DownstreamClient, HealthProbe, LocalDownstream
from skippy_stage.stage.frame_path import FramePath
from skippy_stage.stage.lifecycle import StageState
from skippy_stage.stage.peers import Peers
from skippy_stage.stage.reports import StageReport
from skippy_stage.stage.returns import LocalReturn, StreamReturn, TcpReturn
from skippy_stage.stage.round_trips import NOT_MEASURED, RoundTrip
from skippy_stage.stage.steps import StageShape

# A draining stage waits for sessions fed within this many seconds (work under way); older
# ones are a client's leftovers, freed when the stage stops.
DRAIN_IDLE_S = 2.0


class Stage(FramePath):
    """The stage's domain object; owns the runtime, the edges and the return path."""

    def __init__(self, config: StageConfig, *, max_message_bytes: int) -> None:
        super().__init__(config, max_message_bytes=max_message_bytes)
        self.architecture = ""
        self.model_layers = 0  # the whole model's, once loaded
        self.credentials = Credentials.from_config(config)
        self.peers = Peers(config, self.credentials)
        # The TCP frame listener's port once it listens (advertised in GetStatus).
        self.frame_port = 0
        self.downstream = self.client_for(config.downstream) if config.downstream is not None else None
        if config.return_to is not None:
            if config.hop_transport == "tcp":
                self.return_path = TcpReturn(config.return_to, credentials=self.credentials,
                                             stage_id=config.stage_id, max_message_bytes=max_message_bytes)
            else:
                self.return_path = StreamReturn(config.return_to, stage_id=config.stage_id,
                                                max_message_bytes=max_message_bytes, credentials=self.credentials)
        self.metrics.gauge_from("downstream_rtt_seconds", lambda: self.downstream_rtt().median_s)
        self.metrics.gauge_from("return_rtt_seconds", lambda: self.return_rtt().median_s)

    # -- the edges ---------------------------------------------------------------------

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

    def downstream_rtt(self) -> RoundTrip:
        """The measured round trip to the downstream now in use (none for a stage of this process)."""
        downstream = self.downstream
        trips = downstream.round_trips if downstream is not None else None
        return trips.read() if trips is not None else NOT_MEASURED

    def return_rtt(self) -> RoundTrip:
        """A final stage's measured round trip to the head over its direct return."""
        path = self.return_path
        trips = path.round_trips if path is not None else None
        return trips.read() if trips is not None else NOT_MEASURED

    # -- start, drain, stop -------------------------------------------------------------

    def load(self) -> None:
        """Slice (or reuse) the stage file and load it; the slow part of start-up."""
        info = read_model_info(self.config.model_path)
        sliced = slice_metadata(self.config.model_path)  # a stage file given as is: the model's count
        self.architecture = info.architecture
        self.model_layers = int(sliced["source_block_count"]) if sliced else info.block_count
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
    def ready(self) -> bool:
        """Loaded, serving, and (with a downstream) the whole chain below answers."""
        return self.state is StageState.SERVING and self.downstream_health.ok

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

    def status(self) -> StageReport:
        cfg = self.config
        downstream = self.downstream
        health = self.downstream_health
        runtime = self.runtime
        down_rtt, return_rtt = self.downstream_rtt(), self.return_rtt()
        return StageReport(
            stage_id=cfg.stage_id, stage_index=cfg.stage_index, run_id=cfg.run_id, topology_id=cfg.topology_id,
            model_id=cfg.model_id or cfg.model_path, architecture=self.architecture,
            layer_start=cfg.layer_start, layer_end=cfg.layer_end, include_embeddings=cfg.include_embeddings,
            include_output=cfg.include_output, state=self.state.value, wire_dtype=cfg.wire_dtype,
            hop_transport=cfg.hop_transport, frame_port=self.frame_port, tls=self.credentials.cert is not None,
            downstream_ok=health.ok, downstream_error="" if health.ok else health.detail,
            downstream_stage_id=downstream.peer.stage_id if downstream else "",
            downstream_endpoint=downstream.peer.endpoint if downstream else "",
            n_embd=runtime.n_embd if runtime is not None else 0,
            lanes=runtime.stats() if runtime is not None else None,
            downstream_rtt_us=down_rtt.median_us, downstream_rtt_samples=down_rtt.samples,
            return_rtt_us=return_rtt.median_us, return_rtt_samples=return_rtt.samples,
        )
