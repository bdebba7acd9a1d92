"""The gRPC surface of a stage: a thin servicer, the one error-to-status map, the server.

Handlers parse, call the Stage (or the head's Generator) and serialise; they never call
llama.cpp. Every SkippyError becomes a status code in ``status.status_for`` — the only
place that knows the mapping — and a DownstreamError also names the failed stage in the
trailing metadata ``skippy-failed-stage`` so upstream stages relay it unchanged.
"""

from __future__ import annotations

import collections
import functools
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from skippy_stage import codec
from skippy_stage.config import StageConfig
from skippy_stage.downstream import FAILED_STAGE_KEY, HealthProbe
from skippy_stage.errors import ConfigError, DownstreamError, InvalidRequestError, SessionStateError, SkippyError
from skippy_stage.head import Finish, Generator
from skippy_stage.listener import FrameListener
from skippy_stage.security import BearerTokenInterceptor, Credentials
from skippy_stage.stage import Stage, StageState, Timeouts
from skippy_stage.status import status_for
from skippy_stage.steps import PHASE_DECODE, Reply, Step, StepEntry
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

log = structlog.get_logger("skippy_stage.service")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["StageService"].full_name
# A health service name that answers SERVING while the process is up and not draining:
# for liveness probes, which must not restart a stage merely because its downstream is down.
LIVENESS_SERVICE = "liveness"
def _abort(context: grpc.ServicerContext, exc: SkippyError) -> None:
    code, message = status_for(exc)
    if isinstance(exc, DownstreamError):
        context.set_trailing_metadata(((FAILED_STAGE_KEY, exc.stage_id),))
    context.abort(code, message)


def _unary(handler: Callable) -> Callable:
    """Map domain errors to status codes and count every call by RPC and code."""
    rpc = handler.__name__

    @functools.wraps(handler)
    def wrapper(self: StageServicer, request, context):  # noqa: ANN001
        try:
            response = handler(self, request, context)
        except SkippyError as exc:
            code, _ = status_for(exc)
            self.stage.metrics.requests(rpc=rpc, code=code.name).inc()
            log.debug("rpc refused", stage_id=self.stage.config.stage_id, rpc=rpc, code=code.name, error=str(exc))
            _abort(context, exc)
        self.stage.metrics.requests(rpc=rpc, code="OK").inc()
        return response
    return wrapper


class StageServicer(pb_grpc.StageServiceServicer):
    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self._generator: Generator | None = None
        self._generator_lock = threading.Lock()
        self._return_streams: set[grpc.ServicerContext] = set()
        self._return_lock = threading.Lock()

    def _head(self) -> Generator:
        """The head's generator; new generations are refused unless the stage is SERVING."""
        self.stage.require_runtime(draining_ok=False)
        if not self.stage.ready:
            # New sessions fail fast; admitted ones wait for a recovery (recovery_wait_s).
            below = self.stage.config.downstream
            raise DownstreamError(f"the chain below {self.stage.config.stage_id} is not ready: "
                                  f"{self.stage.downstream_health.detail}",
                                  stage_id=below.stage_id if below else self.stage.config.stage_id)
        with self._generator_lock:
            if self._generator is None:
                self._generator = Generator(self.stage)
                self.stage.metrics.gauge_from("queue_depth", self._generator.scheduler.queue_depth)
            return self._generator

    def close(self) -> None:
        """Let admitted generations finish; refuse the ones still queued; then end the final
        stage's return stream, which would otherwise hold the server's drain for its grace."""
        with self._generator_lock:
            generator, self._generator = self._generator, None
        if generator is not None:
            generator.close()
        with self._return_lock:
            streams = list(self._return_streams)
        for context in streams:
            context.cancel()

    def _require_head(self, rpc: str) -> None:
        if not self.stage.config.include_embeddings:
            raise SessionStateError(f"{rpc} is served by the head stage only; {self.stage.config.stage_id} has "
                                    f"layer_start={self.stage.config.layer_start}")

    @_unary
    def IterationBatch(self, request, context):  # noqa: N802
        return codec.outputs_to_pb(self.stage.process(codec.step_from_pb(request), context.time_remaining()))

    @_unary
    def ActivationFrame(self, request, context):  # noqa: N802
        """One frame, answered with the step's outputs: they are relayed back up to this stage."""
        if not request.HasField("frame"):
            raise InvalidRequestError("frame is required in ActivationFrame")
        outputs = self.stage.process(codec.step_from_pb(request), context.time_remaining(), relay=True)
        return codec.outputs_to_pb(outputs)

    def ActivationStream(self, request_iterator, context):  # noqa: N802
        """Frames from the upstream neighbour (hop_transport "stream"), each run on the thread
        that reads them; the response stream is this edge's back channel (errors, relayed
        outputs), fed from whichever thread has one to send. Once the caller stops sending,
        the stream stays open until every frame that asked for its outputs (``relay``) has
        had its reply, or its deadline passed."""
        replies: queue.SimpleQueue = queue.SimpleQueue()
        done = object()
        lock = threading.Lock()
        awaited: collections.Counter[int] = collections.Counter()
        last_deadline = [time.monotonic()]

        def sink(reply: Reply) -> None:
            with lock:  # queued before it stops being awaited: the stream never ends between the two
                replies.put(codec.reply_to_pb(reply))
                if awaited[reply.hop_id] > 0:
                    awaited[reply.hop_id] -= 1

        def read() -> None:
            try:
                for hop in request_iterator:
                    if hop.relay:
                        with lock:
                            awaited[hop.hop_id] += 1
                            wait = self.stage.timeouts.hop_s
                            if 0 < hop.timeout_s < wait:  # NaN and nonsense fall back to the cap
                                wait = hop.timeout_s
                            last_deadline[0] = max(last_deadline[0], time.monotonic() + wait)
                    self.stage.accept_frame(codec.frame_from_pb(hop), sink)
            except grpc.RpcError:
                pass  # the upstream went away
            finally:
                replies.put(done)

        self.stage.inbound.add(sink)
        threading.Thread(target=read, name="activation-stream", daemon=True).start()
        reading = True
        try:
            while True:
                if not reading:
                    with lock:
                        outstanding = sum(awaited.values())
                    remaining = last_deadline[0] - time.monotonic()
                    if outstanding == 0 or remaining <= 0 or not context.is_active():
                        while True:  # what the sink put in before the count reached zero
                            try:
                                yield replies.get_nowait()
                            except queue.Empty:
                                return
                try:
                    reply = replies.get(timeout=None if reading else min(remaining, 0.1))
                except queue.Empty:
                    continue
                if reply is done:
                    reading = False
                    continue
                yield reply
        finally:
            self.stage.inbound.discard(sink)

    def ReturnResults(self, request_iterator, context):  # noqa: N802
        """The final stage's direct returns: each settles the head's step waiting on its key."""
        try:
            self._require_head("ReturnResults")
        except SkippyError as exc:
            _abort(context, exc)
        accepted = 0
        with self._return_lock:
            self._return_streams.add(context)
        try:
            for batch in request_iterator:
                accepted += self.stage.deliver_return(batch.return_key, codec.outputs_from_pb(batch.response))
        except grpc.RpcError:
            pass  # the final stage went away, or the head is draining; its next return opens a new stream
        finally:
            with self._return_lock:
                self._return_streams.discard(context)
        return pb.ReturnAck(accepted=accepted)

    @_unary
    def Decode(self, request, context):  # noqa: N802
        self._require_head("Decode")
        entry = StepEntry(
            session_id=request.session_id, phase=PHASE_DECODE, positions=[request.position],
            token_ids=[request.token_id], sample_last=True, want_logits=request.want_logits,
            sampling=codec.sampling_from_pb(request.sampling) if request.HasField("sampling") else None,
        )
        out = self.stage.process(Step(request_id="", entries=[entry]), context.time_remaining()).outputs[0]
        return pb.DecodeResponse(token=out.token or 0, logits=[] if out.logits is None else out.logits.tolist())

    @_unary
    def DropSession(self, request, context):  # noqa: N802
        return codec.drops_to_pb(self.stage.drop_session(request.session_id, context.time_remaining()))

    @_unary
    def GetStatus(self, request, context):  # noqa: N802
        return codec.report_to_pb(self.stage.status())

    def Generate(self, request, context):  # noqa: N802
        started = time.perf_counter()
        try:
            self._require_head("Generate")
            generator = self._head()
            spec = codec.generate_spec_from_pb(request, max_tokens_limit=generator.max_context,
                                         limit_hint=generator.runtime.session_limit_hint)
            first_token_s = None
            for event in generator.generate(spec, remaining_s=context.time_remaining, is_active=context.is_active):
                if isinstance(event, Finish):
                    reason = pb.FINISH_REASON_STOP if event.reason == "stop" else pb.FINISH_REASON_LENGTH
                    elapsed = time.perf_counter() - started
                    log.info("generate", stage_id=self.stage.config.stage_id, session_id=event.session_id,
                             prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                             finish=event.reason, seconds=round(elapsed, 3),
                             first_token_s=round(first_token_s or elapsed, 3))
                    self.stage.metrics.requests(rpc="Generate", code="OK").inc()
                    yield pb.GenerateResponse(done=True, finish_reason=reason, prompt_tokens=event.prompt_tokens,
                                              completion_tokens=event.completion_tokens, session_id=event.session_id)
                else:
                    if first_token_s is None:
                        first_token_s = time.perf_counter() - started
                    yield pb.GenerateResponse(text=event.text, token_ids=event.token_ids)
        except SkippyError as exc:
            code, _ = status_for(exc)
            self.stage.metrics.requests(rpc="Generate", code=code.name).inc()
            log.info("generate refused", stage_id=self.stage.config.stage_id, code=code.name, error=str(exc))
            _abort(context, exc)


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

    def __init__(self, config: StageConfig, *, timeouts: Timeouts = Timeouts(), max_workers: int = 64) -> None:
        self.config = config
        self.stage = Stage(config, max_message_bytes=config.max_message_bytes, timeouts=timeouts)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        credentials = Credentials.from_config(config)
        interceptors = [BearerTokenInterceptor(credentials.token)] if credentials.token else []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), interceptors=interceptors,
                                  options=server_options(config.max_message_bytes))
        self.servicer = StageServicer(self.stage)
        pb_grpc.add_StageServiceServicer_to_server(self.servicer, self.server)
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
        self._monitor = threading.Thread(target=self._watch_downstream, name="downstream-health", daemon=True)

    def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)
        alive = self.stage.state in (StageState.LOADING, StageState.SERVING)
        self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING if alive
                        else health_pb2.HealthCheckResponse.NOT_SERVING)

    def _check_edge(self) -> HealthProbe:
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

    def _try_alternates(self) -> bool:
        """Switch to the first configured stand-in that answers SERVING; True if switched."""
        current = self.stage.downstream.peer
        for peer in (self.config.downstream, *self.config.downstream_alternates):
            if peer == current:
                continue
            candidate = self.stage.client_for(peer)
            if candidate.probe_health(self.stage.timeouts.health_probe_s).ok:
                self.stage.switch_downstream(candidate)
                return True
            candidate.close()
        return False

    def _watch_downstream(self) -> None:
        timeouts = self.stage.timeouts
        edge_ok = False
        while not self._stop.is_set():
            if self.stage.downstream is not None:
                probe = self.stage.downstream.probe_health(timeouts.health_probe_s)
                if not probe.ok and self._try_alternates():
                    probe = self.stage.downstream.probe_health(timeouts.health_probe_s)
                if not probe.ok:
                    edge_ok = False
                elif not edge_ok and self.stage.runtime is not None:
                    probe = self._check_edge()
                    edge_ok = probe.ok
                if probe.ok != self.stage.downstream_health.ok:
                    log.info("downstream health", stage_id=self.config.stage_id, ok=probe.ok, detail=probe.detail)
                self.stage.downstream_health = probe
            self._set_health(self.stage.ready)
            if self.stage.downstream_health.ok:
                self.stage.retry_pending_drops()
            self.stage.expire_idle_sessions()
            self._stop.wait(timeouts.health_interval_s)

    def start(self) -> None:
        self.server.start()
        if self.frames is not None:
            self.frames.start()
        self._monitor.start()
        if self.config.metrics_port is not None:
            self.stage.metrics.serve_http(self.config.metrics_port)
        if self.config.http_port is not None:
            from skippy_stage.openai_api import OpenAIServer

            host = self.config.bind_addr.rpartition(":")[0].strip("[]") or "0.0.0.0"
            self.http = OpenAIServer(self.servicer, host=host, port=self.config.http_port)
            self.http.start()

    def load(self) -> None:
        self.stage.load()
        self._set_health(self.stage.ready)

    def drain(self, grace_s: float) -> None:
        """Stop taking work (NOT_SERVING), let in-flight calls finish within grace_s, stop."""
        self.stage.transition(StageState.DRAINING)
        self._set_health(False)
        self._stop.set()
        if self.http is not None:
            self.http.stop(grace_s)
        closing = threading.Thread(target=self.servicer.close, name="drain-scheduler", daemon=True)
        closing.start()
        stopped = self.server.stop(grace_s)
        closing.join(grace_s)
        stopped.wait()
        if self.frames is not None:
            self.frames.close()
        self.stage.close()


def serve(config: StageConfig, *, grace_s: float = 10.0, ready: Callable[[int], None] | None = None) -> int:
    """Run one stage until SIGTERM or SIGINT; returns the process exit code."""
    slog = log.bind(stage_id=config.stage_id, run_id=config.run_id)
    server = StageServer(config)
    server.start()
    slog.info("stage listening", port=server.port, bind_addr=config.bind_addr, state="loading")
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
    stop.wait()
    server.drain(grace_s)
    slog.info("stage stopped")
    return 0
