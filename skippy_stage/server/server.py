"""A stage's process: its gRPC server (with health and reflection), its frame listener,
the watch on the chain below, the HTTP API at the head, and the signals that drain it."""

from __future__ import annotations

import gc
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from skippy_stage import tracing
from skippy_stage.config import StageConfig
from skippy_stage.errors import ConfigError, DownstreamError
from skippy_stage.security import BearerTokenInterceptor, Credentials, check_exposure
from skippy_stage.server.monitor import DownstreamMonitor
from skippy_stage.server.service import StageServicer, add_to_server
from skippy_stage.server.wake_latency import WakeLatencyRequest
from skippy_stage.stage.listener import FrameListener
from skippy_stage.stage.stage import Stage, StageState
from skippy_stage.v1 import stage_pb2 as pb

log = structlog.get_logger("skippy_stage.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["StageService"].full_name
# A health service name that answers SERVING while the process is up and not draining:
# for liveness probes, which must not restart a stage merely because its downstream is down.
LIVENESS_SERVICE = "liveness"
# How soon the main thread notices a signal delivered to another of the process's threads.
SIGNAL_POLL_S = 0.2


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        # Refuse to share a port with another process: "port in use" must fail loudly.
        ("grpc.so_reuseport", 0),
    ]


class StageServer:
    """A stage's gRPC server with health, reflection and the downstream health monitor."""

    def __init__(self, config: StageConfig) -> None:
        check_exposure(config)  # before anything listens
        # A package stage: the manifest and the model's header fetched and checked (a package that
        # cannot serve this range is refused here); the weights come while the stage loads. Imported
        # here, not with this module: it imports numpy, whose BLAS threads started before llama.cpp's
        # OpenMP binds the process would stay unbound (a co-located stage's threads belong on its cores).
        if config.package_ref is not None:
            from skippy_stage.model import package_stage

            config = package_stage.prepare(config)
        self.config = config
        self.wake_latency: WakeLatencyRequest | None = None
        self.stage = Stage(config, max_message_bytes=config.max_message_bytes)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        credentials = Credentials.from_config(config)
        interceptors = [BearerTokenInterceptor(credentials.token)] if credentials.token else []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.grpc_workers), interceptors=interceptors,
                                  options=server_options(config.max_message_bytes))
        self.servicer = StageServicer(self.stage)
        add_to_server(self.servicer, self.server)  # undecodable requests: INVALID_ARGUMENT, naming the message
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self._set_health(False)
        if credentials.tls:
            self.port = self.server.add_secure_port(config.bind_addr, credentials.server_credentials())
        else:
            self.port = self.server.add_insecure_port(config.bind_addr)
        if self.port == 0:
            raise ConfigError(f"stage {config.stage_id}: cannot bind {config.bind_addr} (port in use or address unavailable)")
        # Frames (from the upstream) and direct returns (at the head) over TCP.
        self.frames: FrameListener | None = None
        if config.hop_transport == "tcp" and (config.upstream is not None or not config.include_embeddings
                                              or config.downstream is not None):
            host = config.bind_addr.rpartition(":")[0].strip("[]") or "0.0.0.0"
            self.frames = FrameListener(self.stage, host, config.frame_port or 0)
            self.stage.frame_port = self.frames.port
        self.http = None
        self._stop = threading.Event()
        self.monitor = DownstreamMonitor(self.stage, self._set_health)
        self._monitor = threading.Thread(target=self.monitor.run, args=(self._stop,), name="downstream-health",
                                         daemon=True)

    def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)
        alive = self.stage.state in (StageState.LOADING, StageState.SERVING)
        self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING if alive
                        else health_pb2.HealthCheckResponse.NOT_SERVING)

    def start(self) -> None:
        # First: a stage told to hold the host's CPUs quick to wake and unable to refuses to start.
        if self.config.cpu_wake_latency_us is not None:
            self.wake_latency = WakeLatencyRequest(self.config.cpu_wake_latency_us, stage_id=self.config.stage_id)
        self.server.start()
        if self.frames is not None:
            self.frames.start()
        self._monitor.start()
        # The HTTP listeners bind bind_addr's host, as the gRPC service does: a stage on loopback
        # shows its metrics and API to this host only.
        host = self.config.bind_addr.rpartition(":")[0].strip("[]") or "0.0.0.0"
        if self.config.metrics_port is not None:
            self.stage.metrics.serve_http(self.config.metrics_port, host)
        if self.config.http_port is not None:
            from skippy_stage.server.openai_api.http_server import OpenAIServer

            self.http = OpenAIServer(self.servicer, host=host, port=self.config.http_port)
            self.http.start()

    def load(self) -> None:
        self.stage.load()
        self.servicer.load_drafters()
        self._set_health(self.stage.ready)

    def drain(self, grace_s: float) -> None:
        """Stop taking new work (NOT_SERVING), let the work under way finish within grace_s, stop.

        The gRPC server and the frame listener stay up until then: the sessions under way keep
        their frames flowing, and an upstream with a stand-in for this stage takes them over
        (ExportSession) instead of waiting for them to end (``stage.handoff``)."""
        deadline = time.monotonic() + grace_s
        self.stage.transition(StageState.DRAINING)
        self._set_health(False)
        self._stop.set()
        if self.http is not None:
            self.http.stop(grace_s)
        closing = threading.Thread(target=self.servicer.close, name="drain-scheduler", daemon=True)
        closing.start()
        if grace_s > 0:
            self.stage.wait_drained(max(0.0, deadline - time.monotonic()))
        left = max(0.0, deadline - time.monotonic())
        stopped = self.server.stop(left)
        closing.join(left)
        stopped.wait()
        if self.frames is not None:
            self.frames.close()
        self.stage.close()
        if self.wake_latency is not None:
            self.wake_latency.close()


def serve(config: StageConfig, *, grace_s: float = 10.0, ready: Callable[[int], None] | None = None) -> int:
    """Run one stage until SIGTERM or SIGINT; returns the process exit code."""
    slog = log.bind(stage_id=config.stage_id, run_id=config.run_id)
    tracing.label(f"stage{config.stage_index}")
    server = StageServer(config)
    server.start()
    slog.info("stage listening", port=server.port, bind_addr=config.bind_addr, state="loading",
              cpu_wake_latency_us=config.cpu_wake_latency_us)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        slog.info("signal received; draining", signal=signal.Signals(signum).name, grace_s=grace_s)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.load()
    except BaseException:
        server.drain(0)
        raise
    slog.info("stage loaded", port=server.port, layers=f"{config.layer_start}:{config.layer_end}")
    # Everything loaded so far lives as long as the process: out of the collector's sight, a full
    # collection takes ~0.2 ms instead of 20-50 ms (measured in a SmolLM2 stage), which otherwise
    # landed in the middle of some token's path every few hundred tokens.
    gc.collect()
    gc.freeze()
    deadline = time.monotonic() + config.downstream_ready_timeout_s
    while not stop.is_set() and not server.stage.ready:
        if time.monotonic() > deadline:
            server.drain(0)
            detail = server.stage.downstream_health.detail
            raise DownstreamError(
                f"downstream {config.downstream.stage_id} at {config.downstream.endpoint} did not become ready within "
                f"downstream_ready_timeout_s={config.downstream_ready_timeout_s}s ({detail})",
                stage_id=config.downstream.stage_id,
            )
        stop.wait(0.1)
    if ready is not None:
        ready(server.port)
    # Waits in slices: Python runs a signal's handler on the main thread only, once that thread
    # runs; a SIGTERM the kernel hands to another thread (OpenMP's, gRPC's) would otherwise leave
    # it asleep here for good (seen: a bound co-located stage ignoring SIGTERM until killed).
    while not stop.wait(SIGNAL_POLL_S):
        pass
    server.drain(grace_s)
    slog.info("stage stopped")
    return 0
