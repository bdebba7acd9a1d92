"""The watch a stage keeps on the chain below it, on one thread.

Every ``health_interval_s``: probe the downstream's health service (each answer timed: the
edge's round trip, ``stage/round_trips``; a final stage times the head's over its direct return
too); when the downstream does not answer, switch to the first ``downstream_alternates`` stand-in
that does (handing it the live sessions first when the downstream is draining rather than gone);
once per (re)connection, agree on the edge (layer continuity, width, architecture, transport)
before this stage calls itself SERVING; free sessions the stages below may still hold
(``retry_pending_drops``) and sessions idle past their TTL.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import structlog

from skippy_stage.errors import DownstreamError
from skippy_stage.stage.downstream import DownstreamClient, HealthProbe
from skippy_stage.stage.handoff import hand_off
from skippy_stage.stage.stage import Stage

log = structlog.get_logger("skippy_stage.monitor")


class DownstreamMonitor:
    def __init__(self, stage: Stage, set_health: Callable[[bool], None]) -> None:
        self.stage = stage
        self.config = stage.config
        self._set_health = set_health

    def check_edge(self) -> HealthProbe:
        """Agree on the edge with the downstream: layer continuity, width, architecture.

        Done once per (re)connection, before this stage calls itself SERVING; a mismatch
        keeps it NOT_SERVING with the reason in its status and logs.
        """
        try:
            below = self.stage.downstream.status(self.stage.timeouts.health_probe_s)
        except DownstreamError as exc:
            return HealthProbe(False, str(exc))
        problems = []
        if below.hop_transport and below.hop_transport != self.config.hop_transport:
            problems.append(f"it takes frames over hop_transport={below.hop_transport!r}, this stage "
                            f"({self.config.stage_id}) sends them over {self.config.hop_transport!r}; set the same "
                            f"hop_transport on both ends")
        if below.layer_start != self.config.layer_end:
            problems.append(f"its layer_start={below.layer_start} != this stage's layer_end={self.config.layer_end}")
        if self.stage.runtime is not None and below.n_embd and below.n_embd != self.stage.runtime.n_embd:
            problems.append(f"its n_embd={below.n_embd} != this stage's n_embd={self.stage.runtime.n_embd}")
        if below.architecture and self.stage.architecture and below.architecture != self.stage.architecture:
            problems.append(f"its architecture {below.architecture!r} != {self.stage.architecture!r}")
        if problems:
            detail = f"edge to stage {below.stage_id} refused: " + "; ".join(problems)
            log.error("edge mismatch", stage_id=self.config.stage_id, detail=detail)
            return HealthProbe(False, detail)
        log.info("edge agreed", stage_id=self.config.stage_id, downstream=below.stage_id,
                 layers=f"{self.config.layer_end}:{below.layer_end}", width=below.n_embd, wire_dtype=self.config.wire_dtype)
        return HealthProbe(True, "")

    def try_alternates(self) -> bool:
        """Switch to the first configured stand-in that answers SERVING; True if switched.

        A downstream that still answers and says it is draining (SIGTERM) hands its live
        sessions to the stand-in first; one that is gone loses them (the head re-prefills)."""
        current = self.stage.downstream
        for peer in (self.config.downstream, *self.config.downstream_alternates):
            if peer == current.peer:
                continue
            candidate = self.stage.client_for(peer)
            if candidate.probe_health(self.stage.timeouts.health_probe_s).ok:
                if self._draining(current) and self.stage.runtime is not None:
                    hand_off(self.stage, candidate)
                else:
                    self.stage.switch_downstream(candidate)
                return True
            candidate.close()
        return False

    def _draining(self, client: DownstreamClient) -> bool:
        try:
            return client.status(self.stage.timeouts.health_probe_s).state == "draining"
        except DownstreamError:
            return False

    def run(self, stop: threading.Event) -> None:
        """The watch, until ``stop``: a bug in one round is logged, never the end of the watch."""
        edge_ok = False
        while not stop.is_set():
            try:
                edge_ok = self._round(edge_ok)
            except Exception:
                log.exception("downstream watch round failed", stage_id=self.config.stage_id)
                edge_ok = False
            stop.wait(self.stage.timeouts.health_interval_s)

    def _round(self, edge_ok: bool) -> bool:
        timeouts = self.stage.timeouts
        if self.stage.downstream is not None:
            probe = self.stage.downstream.probe_health(timeouts.health_probe_s)
            if not probe.ok and self.try_alternates():
                edge_ok = False  # a new edge: agree on it before calling the stage SERVING
                probe = self.stage.downstream.probe_health(timeouts.health_probe_s)
            if not probe.ok:
                edge_ok = False
            elif not edge_ok and self.stage.runtime is not None:
                probe = self.check_edge()
                edge_ok = probe.ok
            if probe.ok != self.stage.downstream_health.ok:
                log.info("downstream health", stage_id=self.config.stage_id, ok=probe.ok, detail=probe.detail)
            self.stage.downstream_health = probe
        if self.stage.return_path is not None:
            self.stage.return_path.probe(timeouts.health_probe_s)  # the return link's round trip
        self._set_health(self.stage.ready)
        if self.stage.downstream_health.ok:
            self.stage.retry_pending_drops()
        self.stage.expire_idle_sessions()
        return edge_ok
