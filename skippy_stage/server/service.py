"""The gRPC surface of a stage: a thin servicer (the process around it is ``server``).

Handlers convert (``stage.codec``), call the Stage (or the head's Generator) and convert
back; they never call llama.cpp. Every SkippyError becomes a status code in
``stage.status.status_for`` — the only place that knows the mapping — and a
DownstreamError also names the failed stage in the trailing metadata
``skippy-failed-stage`` so upstream stages relay it unchanged.
"""

from __future__ import annotations

import collections
import functools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import structlog

from skippy_stage.config import MAX_STREAM_INTERVAL_MS, MAX_VERIFY_WINDOW_DEPTH
from skippy_stage.errors import DownstreamError, InvalidRequestError, SessionStateError, SkippyError
from skippy_stage.head.drafting import Drafters, SpeculativeRequest
from skippy_stage.head.generator import MAX_STOP_LEN, MAX_STOP_STRINGS, Finish, GenerateSpec, Generator, load_drafters
from skippy_stage.model.logprobs import MAX_TOP_LOGPROBS
from skippy_stage.stage import codec
from skippy_stage.stage.downstream import FAILED_STAGE_KEY
from skippy_stage.stage.peers import STAGE_ID_METADATA
from skippy_stage.stage.stage import Stage
from skippy_stage.stage.status import status_for
from skippy_stage.stage.steps import PHASE_DECODE, Reply, Step, StepEntry, check_sampling
from skippy_stage.stage.upstream import error_reply
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

log = structlog.get_logger("skippy_stage.service")

SERVICE = pb.DESCRIPTOR.services_by_name["StageService"]


@dataclass(frozen=True)
class Undecodable:
    """Request bytes that do not parse as ``message``: what a request deserializer gives instead
    of raising (grpcio would answer INTERNAL "Exception deserializing request!" before any
    handler ran); the handler refuses it as INVALID_ARGUMENT, naming the message."""

    message: str
    reason: str

    def error(self) -> InvalidRequestError:
        return InvalidRequestError(f"undecodable {self.message}: {self.reason}")


def _lenient(message_type: type) -> Callable[[bytes], object]:
    """``message_type.FromString``, giving :class:`Undecodable` where it would raise."""
    name = message_type.DESCRIPTOR.name

    def parse(data: bytes) -> object:
        try:
            return message_type.FromString(data)
        except Exception as exc:  # noqa: BLE001 - whatever protobuf raises, the bytes are the client's
            return Undecodable(name, str(exc) or type(exc).__name__)
    return parse


def add_to_server(servicer: StageServicer, server: grpc.Server) -> None:
    """Register ``servicer`` as the generated ``add_StageServiceServicer_to_server`` does, with
    request deserializers that never raise: undecodable bytes reach the handler as
    :class:`Undecodable` and become INVALID_ARGUMENT there."""
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    handlers = {}
    for method in SERVICE.methods:
        request, response = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        make = kinds[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(getattr(servicer, method.name), request_deserializer=_lenient(request),
                                     response_serializer=response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


def _abort(context: grpc.ServicerContext, exc: SkippyError) -> None:
    code, message = status_for(exc)
    if isinstance(exc, DownstreamError):
        context.set_trailing_metadata(((FAILED_STAGE_KEY, exc.stage_id),))
    context.abort(code, message)


def _unary(handler: Callable) -> Callable:
    """Map domain errors to status codes and count every call by RPC and code."""
    rpc = handler.__name__

    @functools.wraps(handler)
    def wrapper(self: StageServicer, request, context):
        try:
            if isinstance(request, Undecodable):
                raise request.error()
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
        self._drafters: Drafters | None = None
        self._generator_lock = threading.Lock()
        self._return_streams: set[grpc.ServicerContext] = set()
        self._return_lock = threading.Lock()

    def head(self) -> Generator:
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
                self._generator = Generator(self.stage, self._drafters)
                self._drafters = None  # the generator owns them now
                self.stage.metrics.gauge_from("queue_depth", self._generator.scheduler.queue_depth)
                self.stage.metrics.gauge_from("batches_in_flight", self._generator.scheduler.batches)
            return self._generator

    def load_drafters(self) -> None:
        """The head's drafters, at start: a draft model that does not load or does not share the
        target's vocabulary fails the stage's start, naming it."""
        if self.stage.config.include_embeddings and self.stage.config.speculative.enabled:
            self._drafters = load_drafters(self.stage)

    def close(self) -> None:
        """Let admitted generations finish; refuse the ones still queued; then end the final
        stage's return stream, which would otherwise hold the server's drain for its grace."""
        with self._generator_lock:
            generator, self._generator = self._generator, None
            drafters, self._drafters = self._drafters, None
        if generator is not None:
            generator.close()
        if drafters is not None:
            drafters.close()
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
        had its reply, or its deadline passed.

        The stream is a peer (``stage.peers``): the sessions its frames opened are freed here and
        below once the caller stops sending (or goes away); the caller names itself in the
        ``skippy-stage-id-bin`` metadata."""
        replies: queue.SimpleQueue = queue.SimpleQueue()
        done = object()
        lock = threading.Lock()
        awaited: collections.Counter[int] = collections.Counter()
        last_deadline = [time.monotonic()]

        def sink(reply: Reply) -> None:
            message = codec.reply_to_pb(reply)  # outside the lock: it may carry logits
            with lock:  # queued before it stops being awaited: the stream never ends between the two
                replies.put(message)
                if awaited[reply.hop_id] > 0:
                    awaited[reply.hop_id] -= 1

        name = next((value for key, value in context.invocation_metadata() or () if key == STAGE_ID_METADATA), b"")
        peer = self.stage.peers.connect(name.decode(errors="replace") if isinstance(name, bytes) else str(name),
                                        context.peer() or "", sink)

        def read() -> None:
            try:
                for hop in request_iterator:
                    try:
                        if isinstance(hop, Undecodable):
                            raise hop.error()
                        drops = codec.released_from_pb(hop)
                    except InvalidRequestError as exc:
                        self.stage.metrics.requests(rpc="Frame", code="INVALID_ARGUMENT").inc()
                        peer(error_reply(exc, return_key="bad-frame", session_ids=[],
                                         hop_id=0 if isinstance(hop, Undecodable) else hop.hop_id,
                                         stage_id=self.stage.config.stage_id))
                        continue
                    if drops is not None:
                        self.stage.take_release(drops, peer)
                        continue
                    if hop.relay:
                        with lock:
                            awaited[hop.hop_id] += 1
                            wait = self.stage.timeouts.hop_s
                            if 0 < hop.timeout_s < wait:  # NaN and nonsense fall back to the cap
                                wait = hop.timeout_s
                            last_deadline[0] = max(last_deadline[0], time.monotonic() + wait)
                    self.stage.accept_frame(codec.frame_from_pb(hop), peer)
            except grpc.RpcError:
                pass  # the upstream went away
            finally:
                self.stage.peer_closed(peer)
                replies.put(done)

        self.stage.inbound.add(peer)
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
            self.stage.inbound.discard(peer)

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
                if isinstance(batch, Undecodable):
                    _abort(context, batch.error())
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
            draws_before=request.draws_before,
        )
        out = codec.outputs_to_pb(self.stage.process(Step(request_id="", entries=[entry]),
                                                     context.time_remaining())).outputs[0]
        return pb.DecodeResponse(token=out.token, logits=out.logits)

    @_unary
    def DropSession(self, request, context):  # noqa: N802
        return codec.drops_to_pb(self.stage.drop_session(request.session_id, context.time_remaining(),
                                                         keep_prefix=request.keep_prefix))

    @_unary
    def ExportSession(self, request, context):  # noqa: N802
        return codec.page_to_pb(self.stage.export_session(request.session_id, wait_for_tokens=request.wait_for_tokens,
                                                          wait_for_batches=request.wait_for_batches,
                                                          release=request.release,
                                                          remaining_s=context.time_remaining()))

    @_unary
    def ImportSession(self, request, context):  # noqa: N802
        tokens = self.stage.import_session(request.session_id, codec.page_from_pb(request.page),
                                           resident=request.resident)
        return pb.ImportSessionResponse(tokens=tokens)

    @_unary
    def TrimSession(self, request, context):  # noqa: N802
        return codec.trims_to_pb(self.stage.trim_session(request.session_id, request.tokens, context.time_remaining()))

    @_unary
    def GetStatus(self, request, context):  # noqa: N802
        return codec.report_to_pb(self.stage.status())

    def Generate(self, request, context):  # noqa: N802
        started = time.perf_counter()
        try:
            if isinstance(request, Undecodable):
                raise request.error()
            self._require_head("Generate")
            generator = self.head()
            spec = generate_spec_from_pb(request, max_tokens_limit=generator.max_context,
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
                                              completion_tokens=event.completion_tokens, session_id=event.session_id,
                                              cached_tokens=event.cached_tokens, schedule_json=event.schedule_json)
                else:
                    if first_token_s is None:
                        first_token_s = time.perf_counter() - started
                    message = pb.GenerateResponse(text=event.text, token_ids=event.token_ids)
                    codec.logprobs_to_pb(event.logprobs, message.logprobs)
                    yield message
        except SkippyError as exc:
            code, _ = status_for(exc)
            self.stage.metrics.requests(rpc="Generate", code=code.name).inc()
            log.info("generate refused", stage_id=self.stage.config.stage_id, code=code.name, error=str(exc))
            _abort(context, exc)


def generate_spec_from_pb(req: pb.GenerateRequest, *, max_tokens_limit: int, limit_hint: str = "") -> GenerateSpec:
    if bool(req.prompt) == bool(req.messages):
        raise InvalidRequestError("exactly one of prompt and messages must be set "
                                  f"(prompt has {len(req.prompt)} characters, messages has {len(req.messages)} items)")
    max_tokens = req.max_tokens or 128
    if max_tokens > max_tokens_limit:
        raise InvalidRequestError(f"max_tokens={max_tokens} exceeds this pipeline's limit {max_tokens_limit}"
                                  + (f" ({limit_hint})" if limit_hint else ""))
    if len(req.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop has {len(req.stop)} strings, at most {MAX_STOP_STRINGS} are allowed")
    for i, s in enumerate(req.stop):
        if not s or len(s) > MAX_STOP_LEN:
            raise InvalidRequestError(f"stop[{i}]={s!r} must be 1..{MAX_STOP_LEN} characters")
    for i, m in enumerate(req.messages):
        if m.role not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(f"messages[{i}].role={m.role!r} must be system, user, assistant or tool")
    if req.HasField("top_logprobs") and req.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs={req.top_logprobs} must be in [0, {MAX_TOP_LOGPROBS}]")
    if req.HasField("stream_interval_ms") and req.stream_interval_ms > MAX_STREAM_INTERVAL_MS:
        raise InvalidRequestError(f"stream_interval_ms={req.stream_interval_ms} must be in [0, {MAX_STREAM_INTERVAL_MS}]")
    sampling = codec.sampling_from_pb(req.sampling) if req.HasField("sampling") else None
    speculative = None
    if req.HasField("speculative"):
        s = req.speculative
        if s.HasField("window_depth") and not 1 <= s.window_depth <= MAX_VERIFY_WINDOW_DEPTH:
            raise InvalidRequestError(f"speculative.window_depth={s.window_depth} must be in [1, "
                                      f"{MAX_VERIFY_WINDOW_DEPTH}]")
        speculative = SpeculativeRequest(drafter=s.drafter or None, k=s.k or None, ngram=s.ngram or None,
                                         adaptive=s.adaptive if s.HasField("adaptive") else None,
                                         window_depth=s.window_depth if s.HasField("window_depth") else None)
    return GenerateSpec(
        prompt=req.prompt or None,
        messages=tuple((m.role, m.content) for m in req.messages),
        max_tokens=max_tokens,
        sampling=check_sampling(sampling, "sampling"),
        stop=tuple(req.stop),
        speculative=speculative,
        top_logprobs=req.top_logprobs if req.HasField("top_logprobs") else None,
        stream_interval_ms=req.stream_interval_ms if req.HasField("stream_interval_ms") else None,
        record_schedule=req.record_schedule,
        media=tuple(req.media),
    )
