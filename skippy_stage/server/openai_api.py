"""The OpenAI-compatible HTTP API at the head: /v1/models, /v1/completions, /v1/chat/completions.

It runs beside the gRPC server, in the same process: uvicorn serves a starlette app on its
own thread and event loop. Every generation takes the gRPC ``Generate`` path — the
servicer's Generator (``StageServicer.head``), whose blocking iterator is driven on a worker
thread of its own and handed to the event loop through a queue. A client that goes away
(disconnect, closed stream) cancels its generation, which frees the session on every stage.

A request body is checked field by field by :func:`parse_request`, which names the field
in its message and in the error's ``param``. Domain errors become HTTP statuses in one
place, :func:`http_error_for`, on top of the gRPC edge's own mapping (``stage.status.status_for``)::

    InvalidRequestError, bad JSON, wrong type       -> 400 invalid_request_error
    CapacityError (lanes and admission queue full)  -> 429 rate_limit_error (+ Retry-After)
    DownstreamError, StageUnavailableError           -> 503 server_error (+ Retry-After)
    anything else                                   -> 500 server_error

Where a request leaves a field out, OpenAI's default applies, not ``Generate``'s: sampling
at temperature 1, and 16 tokens for a completion (as many as the session holds for chat).
The listener uses the stage's own credentials (TLS files, bearer token). Stopping lets
generations in flight finish within a grace period and ends the rest with a 503.
"""

from __future__ import annotations

import asyncio
import codecs
import hmac
import json
import math
import re
import socket
import ssl
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import structlog
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from skippy_stage.config import MAX_STREAM_INTERVAL_MS
from skippy_stage.errors import (
    ConfigError,
    DownstreamError,
    InvalidFieldError,
    InvalidRequestError,
    RuntimeFailure,
    SkippyError,
)
from skippy_stage.head.drafting import SpeculativeRequest
from skippy_stage.head.generator import MAX_STOP_LEN, MAX_STOP_STRINGS, Finish, GenerateSpec, Generator, Piece
from skippy_stage.head.scheduler import PromptLogprobs, Task
from skippy_stage.model.runtime import MAX_TOP_LOGPROBS, TokenLogprob
from skippy_stage.model.sampling import RANDOM_SEED, SamplingParams, check_grammar_text
from skippy_stage.security import Credentials
from skippy_stage.stage.status import status_for

log = structlog.get_logger("skippy_stage.openai_api")

ROLES = ("system", "user", "assistant", "tool")
DEFAULT_TEMPERATURE = 1.0  # OpenAI's documented default
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's (and llama-cpp-python's) default for /v1/completions
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_CHOICES = 128  # n; the pipeline's lane_count bounds it further
# Fields this server does not implement, with the values that mean "not used": any other
# value is refused rather than silently ignored.
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
}


# -- the request ---------------------------------------------------------------------


@dataclass(frozen=True)
class OpenAIRequest:
    """A validated completion or chat completion request."""

    prompt: str | None
    messages: tuple[tuple[str, str], ...]
    max_tokens: int | None  # None: as many as one session's context holds
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    speculative: SpeculativeRequest | None = None
    top_logprobs: int | None = None  # logprobs asked: each token's, and this many alternatives
    echo: bool = False  # completions: the prompt comes back before the completion
    n: int = 1  # independent choices of the same prompt

    def spec(self, max_tokens_limit: int, limit_hint: str = "") -> GenerateSpec:
        """The Generate spec, with max_tokens checked against the pipeline's session size."""
        max_tokens = max_tokens_limit if self.max_tokens is None else self.max_tokens
        if max_tokens > max_tokens_limit:
            raise InvalidFieldError("max_tokens", f"max_tokens={max_tokens} exceeds this pipeline's limit "
                                                  f"{max_tokens_limit} ({limit_hint})")
        return GenerateSpec(prompt=self.prompt, messages=self.messages, max_tokens=max_tokens,
                            sampling=self.sampling, stop=self.stop, speculative=self.speculative,
                            top_logprobs=self.top_logprobs, prompt_logprobs=self.top_logprobs if self.echo else None,
                            max_tokens_fit=self.max_tokens is None, stream_interval_ms=self.hold_ms)

    @property
    def hold_ms(self) -> float | None:
        """How long the head may hold tokens back: a response that is not streamed is read whole at
        the end, so the handler need not wake for every token (about once a second instead). Stop
        strings are seen only as tokens arrive, so a request with them takes the head's default."""
        return None if self.stream or self.stop else float(MAX_STREAM_INTERVAL_MS)


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _show(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _int_field(body: dict[str, Any], name: str, *, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidFieldError(name, f"{name} must be an integer, got {_json_kind(value)} ({_show(value)})")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidFieldError(name, f"{name}={value} must be {bound}")
    return value


def _float_field(body: dict[str, Any], name: str, default: float, ok: Callable[[float], bool], why: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidFieldError(name, f"{name} must be a number, got {_json_kind(value)} ({_show(value)})")
    value = float(value)
    if not math.isfinite(value) or not ok(value):
        raise InvalidFieldError(name, f"{name}={value!r} must be {why}")
    return value


def _bool_field(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidFieldError(name, f"{name} must be a boolean, got {_json_kind(value)} ({_show(value)})")
    return value


def _content(value: object, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidFieldError(f"{where}.content[{j}]", f"{where}.content[{j}]={_show(part)} must be a "
                                        'text part {"type": "text", "text": "..."}')
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidFieldError(f"{where}.content", f"{where}.content must be a string or an array of text parts, "
                            f"got {_json_kind(value)}")


def _messages(value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        got = "an empty array" if isinstance(value, list) else _json_kind(value)
        raise InvalidFieldError("messages", f"messages must be a non-empty array of {{role, content}} objects, got {got}")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidFieldError(where, f"{where} must be a {{role, content}} object, got {_json_kind(message)}")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidFieldError(f"{where}.role", f"{where}.role={_show(role)} must be one of {', '.join(ROLES)}")
        out.append((role, _content(message.get("content"), where)))
    return tuple(out)


def _prompt(value: object) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]  # a batch of one prompt
    if not isinstance(value, str):
        raise InvalidFieldError("prompt", f"prompt must be a string (batches of prompts and token ids are not "
                                f"supported), got {_json_kind(value)}")
    if not value:
        raise InvalidFieldError("prompt", "prompt is empty")
    return value


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise InvalidFieldError("stop", f"stop must be a string or an array of strings, got {_json_kind(value)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidFieldError("stop", f"stop has {len(stops)} strings, at most {MAX_STOP_STRINGS} are allowed")
    for i, s in enumerate(stops):
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_LEN:
            raise InvalidFieldError("stop", f"stop[{i}]={_show(s)} must be a string of 1..{MAX_STOP_LEN} characters")
    return tuple(stops)


def _speculative(value: object) -> SpeculativeRequest | None:
    """This server's extension: ``speculative: {drafter, k, ngram, adaptive}`` (the head's settings
    for whatever is left out); checked against them when the generation starts. ``k`` a number is
    fixed drafting (llama-cpp-python's ``num_pred_tokens``), ``"auto"`` adaptive drafting."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidFieldError("speculative", f"speculative must be an object, got {_json_kind(value)}")
    unknown = sorted(set(value) - {"drafter", "k", "ngram", "adaptive"})
    if unknown:
        raise InvalidFieldError("speculative", f"speculative has unknown key(s) {', '.join(unknown)}")
    drafter = value.get("drafter")
    if drafter is not None and not isinstance(drafter, str):
        raise InvalidFieldError("speculative", f"speculative.drafter must be a string, got {_json_kind(drafter)}")
    adaptive = value.get("adaptive")
    if adaptive is not None and not isinstance(adaptive, bool):
        raise InvalidFieldError("speculative", f"speculative.adaptive must be a boolean, got {_json_kind(adaptive)}")
    k = value.get("k")
    try:
        if k != "auto":  # a number: fixed drafting
            k = _int_field(value, "k", low=1)
        ngram = _int_field(value, "ngram", low=1)
    except InvalidFieldError as exc:
        raise InvalidFieldError("speculative", f"speculative.{exc}") from None
    return SpeculativeRequest(drafter=drafter, k=k, ngram=ngram, adaptive=adaptive)


# llama-cpp-python's converter writes one grammar item (a nested group) per unit of these
MAX_SCHEMA_REPEAT = 256


def _check_schema_bounds(node: object, where: str) -> None:
    """Refuse, before converting, the bounds the converter would expand into a grammar as large as
    they are (minLength/maxLength/minItems/maxItems, a pattern's {n,m}), naming the field."""
    if isinstance(node, dict):
        for key in ("minLength", "maxLength", "minItems", "maxItems"):
            value = node.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_SCHEMA_REPEAT:
                raise InvalidFieldError("response_format", f"{where}.{key}={value} is more than this server's "
                                                           f"{MAX_SCHEMA_REPEAT}")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            for match in re.finditer(r"\{(\d+)(?:,(\d*))?\}", pattern):
                if any(int(n) > MAX_SCHEMA_REPEAT for n in match.groups() if n):
                    raise InvalidFieldError("response_format", f"{where}.pattern repeats {match.group(0)}: at most "
                                                               f"{MAX_SCHEMA_REPEAT}")
        for key, value in node.items():
            _check_schema_bounds(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_schema_bounds(value, f"{where}[{i}]")


def _response_format(value: object) -> str:
    """The GBNF grammar for ``response_format`` ("" for text): ``json_object`` is llama.cpp's JSON
    grammar, ``json_schema`` goes through llama-cpp-python's JSON-schema converter; a schema it
    cannot handle is refused by name, never ignored."""
    if value is None:
        return ""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidFieldError("response_format", f"response_format must be an object with a type, got {_show(value)}")
    kind = value["type"]
    if kind == "text":
        return ""
    from llama_cpp import llama_grammar

    if kind == "json_object":
        return llama_grammar.JSON_GBNF
    if kind != "json_schema":
        raise InvalidFieldError("response_format", f"response_format.type={kind!r} must be text, json_object or "
                                                   f"json_schema")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidFieldError("response_format", "response_format.json_schema.schema must be a JSON schema object")
    _check_schema_bounds(spec["schema"], "response_format.json_schema.schema")
    try:
        grammar = llama_grammar.json_schema_to_gbnf(json.dumps(spec["schema"]))
    except Exception as exc:  # noqa: BLE001 - the converter's own failures, whatever their type: a 400 naming it
        raise InvalidFieldError("response_format", f"response_format.json_schema.schema cannot be turned into a "
                                                   f"grammar: {type(exc).__name__}: {exc}") from None
    try:
        check_grammar_text(grammar)
    except InvalidRequestError as exc:
        raise InvalidFieldError("response_format", f"response_format.json_schema.schema gives a grammar this "
                                                   f"server refuses: {exc}") from None
    return grammar


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}``; the ids are checked against the vocabulary at the final stage."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise InvalidFieldError("logit_bias", f"logit_bias must be an object of token ids, got {_json_kind(value)}")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.lstrip("-").isdigit()) or abs(int(key)) >= 2**31:
            raise InvalidFieldError("logit_bias", f"logit_bias key {_show(key)} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise InvalidFieldError("logit_bias", f"logit_bias[{key}]={_show(bias)} must be a number in [-100, 100]")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def _echo(body: dict[str, Any], *, chat: bool) -> bool:
    echo = _bool_field(body, "echo")
    if echo and chat:
        raise InvalidFieldError("echo", "echo is a completions option; chat completions do not take it")
    return echo


def parse_request(body: object, *, chat: bool) -> OpenAIRequest:
    """Validate a /v1/completions (``chat=False``) or /v1/chat/completions body, field by field."""
    if not isinstance(body, dict):
        raise InvalidFieldError(None, f"the request body must be a JSON object, got {_json_kind(body)}")
    for name, neutral in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(value == v and isinstance(value, bool) == isinstance(v, bool)
                                         for v in neutral):
            raise InvalidFieldError(name, f"{name}={_show(value)} is not supported by this server")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise InvalidFieldError("model", f"model must be a string, got {_json_kind(body['model'])}")
    if chat:
        if "messages" not in body:
            raise InvalidFieldError("messages", "messages is required")
        prompt, messages = None, _messages(body["messages"])
        max_tokens = _int_field(body, "max_tokens", low=1)
        if max_tokens is None:
            max_tokens = _int_field(body, "max_completion_tokens", low=1)
    else:
        if "prompt" not in body:
            raise InvalidFieldError("prompt", "prompt is required")
        prompt, messages = _prompt(body["prompt"]), ()
        max_tokens = _int_field(body, "max_tokens", low=1)
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    temperature = _float_field(body, "temperature", DEFAULT_TEMPERATURE, lambda t: t >= 0, ">= 0")
    top_p = _float_field(body, "top_p", 1.0, lambda p: 0 < p <= 1, "in (0, 1]")
    seed = _int_field(body, "seed", low=0, high=RANDOM_SEED)
    stream = _bool_field(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidFieldError("stream_options", f"stream_options must be an object, got {_json_kind(options)}")
    include_usage = _bool_field(options or {}, "include_usage")
    if chat:
        wants = _bool_field(body, "logprobs")
        top = _int_field(body, "top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
        if top and not wants:
            raise InvalidFieldError("top_logprobs", "top_logprobs needs logprobs: true")
        top_logprobs = (top or 0) if wants else None
    else:
        value = body.get("logprobs")
        top_logprobs = None if value is None or value is False else _int_field(body, "logprobs", low=0,
                                                                                 high=MAX_TOP_LOGPROBS)
    in_range = lambda v: -2.0 <= v <= 2.0  # noqa: E731
    sampling = SamplingParams(temperature=temperature, top_p=top_p, seed=RANDOM_SEED if seed is None else seed,
                              grammar=_response_format(body.get("response_format")),
                              frequency_penalty=_float_field(body, "frequency_penalty", 0.0, in_range, "in [-2, 2]"),
                              presence_penalty=_float_field(body, "presence_penalty", 0.0, in_range, "in [-2, 2]"),
                              logit_bias=_logit_bias(body.get("logit_bias")))
    return OpenAIRequest(prompt=prompt, messages=messages, max_tokens=max_tokens, sampling=sampling.validate(),
                         stop=_stop(body.get("stop")), stream=stream, include_usage=include_usage,
                         speculative=_speculative(body.get("speculative")), top_logprobs=top_logprobs,
                         echo=_echo(body, chat=chat),
                         n=_int_field(body, "n", low=1, high=MAX_CHOICES) or 1)


# -- errors --------------------------------------------------------------------------


@dataclass(frozen=True)
class HTTPError:
    status: int
    type: str
    code: str | None


_BY_GRPC_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPError(400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: HTTPError(400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: HTTPError(404, "not_found_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPError(429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: HTTPError(503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: HTTPError(504, "server_error", "timeout"),
}
_INTERNAL = HTTPError(500, "server_error", "internal_error")


def http_error_for(exc: SkippyError) -> HTTPError:
    """The HTTP edge's one mapping, on top of the gRPC edge's (``stage.status.status_for``).

    A failed chain is the server's trouble whatever code the failed stage gave, so a
    DownstreamError is 503 unless it is a timeout or a full stage (retry later).
    """
    code, _ = status_for(exc)
    error = _BY_GRPC_CODE.get(code, _INTERNAL)
    if isinstance(exc, DownstreamError) and error.status < 500 and error.status != 429:
        return _BY_GRPC_CODE[grpc.StatusCode.UNAVAILABLE]
    return error


def _retry_after_s(exc: SkippyError) -> int:
    """Whole seconds for Retry-After: the refusing side's hint, or 1."""
    hint = getattr(exc, "retry_after_s", None)
    return max(1, math.ceil(hint)) if hint else 1


def _error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: SkippyError) -> JSONResponse:
    error = http_error_for(exc)
    headers = {"Retry-After": str(_retry_after_s(exc))} if error.status in (429, 503) else None
    body = _error_body(str(exc), error.type, getattr(exc, "param", None), error.code)
    return JSONResponse(body, status_code=error.status, headers=headers)


async def _http_exception(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error_type = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    return JSONResponse(_error_body(str(exc.detail), error_type), status_code=exc.status_code, headers=exc.headers)


async def _unexpected(_request: Request, exc: Exception) -> Response:
    log.exception("openai api: unexpected error", error=repr(exc))
    return JSONResponse(_error_body(f"internal error: {type(exc).__name__}", _INTERNAL.type, code=_INTERNAL.code),
                        status_code=500)


# -- one generation --------------------------------------------------------------------

_END = object()


class _Live:
    """The generations in flight, so that stopping the server can drain and then end them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: set[_Generation] = set()

    def add(self, generation: _Generation) -> None:
        with self._lock:
            self._items.add(generation)

    def discard(self, generation: _Generation) -> None:
        with self._lock:
            self._items.discard(generation)

    def snapshot(self) -> list[_Generation]:
        with self._lock:
            return list(self._items)


class _Generation:
    """A request's choices, each read on a thread of its own (``Generator.pieces``); their events
    reach the event loop as ``(choice index, event)`` on one queue.

    Threads (not a shared pool) because a generation may wait in the admission queue for a long
    time and must not hold back others.
    """

    def __init__(self, generator: Generator, spec: GenerateSpec, live: _Live, n: int = 1) -> None:
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._gone = threading.Event()
        self._live = live
        self.n = n
        self._ended = 0
        self._lock = threading.Lock()
        self._running = n
        self._tasks: list[Task] = []
        live.add(self)
        threading.Thread(target=self._start, args=(generator, spec), name="openai-generate", daemon=True).start()

    def _start(self, generator: Generator, spec: GenerateSpec) -> None:
        try:
            tasks = generator.start(spec, self.n)
        except Exception as exc:  # noqa: BLE001 -- handed to the request's coroutine, which reports it
            self._live.discard(self)
            self._post((0, exc))
            return
        with self._lock:
            self._tasks = tasks
        if self._gone.is_set():
            self.cancel()
        try:
            for index, task in enumerate(tasks[1:], 1):
                threading.Thread(target=self._drive, args=(generator, spec, index, task), name="openai-generate",
                                 daemon=True).start()
        except RuntimeError as exc:  # no thread to be had: end the whole request, free every choice
            self.cancel()
            self._live.discard(self)
            self._post((0, RuntimeFailure(f"the head could not start a thread per choice: {exc}")))
            return
        self._drive(generator, spec, 0, tasks[0])

    def _drive(self, generator: Generator, spec: GenerateSpec, index: int, task: Task) -> None:
        try:
            events = generator.pieces(task, spec, remaining_s=lambda: None, is_active=lambda: not self._gone.is_set())
            try:
                for event in events:
                    if self._gone.is_set():
                        break
                    self._post((index, event))
            finally:
                events.close()
                task.cancel()  # the scheduler frees the session on every stage
        except Exception as exc:  # noqa: BLE001 -- handed to the request's coroutine, which reports it
            self._post((index, exc))
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                self._live.discard(self)
            self._post((index, _END))

    def _post(self, item: tuple[int, object]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the event loop is closed (server stopped): nobody is listening
            self._gone.set()

    def cancel(self) -> None:
        """Stop generating: the client is gone or has what it needs."""
        self._gone.set()
        with self._lock:
            tasks = list(self._tasks)
        for task in tasks:
            task.cancel()

    def abort(self, exc: SkippyError) -> None:
        """End the generation with ``exc`` for its client (from any thread)."""
        self._gone.set()
        self._post((0, exc))

    async def next(self) -> tuple[int, Piece | Finish] | None:
        """The next event of some choice; None once every choice has ended (or was cancelled)."""
        while True:
            index, item = await self._events.get()
            if item is _END:
                self._ended += 1
                if self._ended >= self.n:
                    return None
                continue
            if isinstance(item, BaseException):
                raise item
            return index, item  # type: ignore[return-value]

    async def watch(self, request: Request) -> None:
        """Cancel the generation when the client disconnects."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.cancel()
                return


# -- the app ---------------------------------------------------------------------------


def _ready_generator(servicer: Any) -> Generator:
    """The head's Generator; refused (503) while the head knows its chain is down.

    ``head()`` checks only this stage's own state. A new request is refused at once rather
    than left to wait out the scheduler's recovery window: its client may retry elsewhere.
    """
    generator = servicer.head()
    stage = servicer.stage
    if not stage.ready:
        below = stage.config.downstream.stage_id if stage.config.downstream else stage.config.stage_id
        raise DownstreamError(f"the chain below stage {stage.config.stage_id} is not ready: "
                              f"{stage.downstream_health.detail or 'not serving'}", stage_id=below)
    return generator


def _model_id(servicer: Any) -> str:
    config = servicer.stage.config
    return config.model_id or Path(config.model_path).name


def _usage(finishes: list[Finish]) -> dict[str, object]:
    """OpenAI's usage of n choices: the prompt counted once, every choice's completion tokens."""
    prompt, completion = finishes[0].prompt_tokens, sum(f.completion_tokens for f in finishes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": finishes[0].cached_tokens}}


def _sse(data: object) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


class _TextOffsets:
    """Where each generated token's text starts in the completion (after ``start`` prompt
    characters): the length of the text decoded so far, as llama-cpp-python counts it; a token
    holding part of a character adds nothing until the character is whole."""

    def __init__(self, start: int) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self._length = start

    def next(self, token_bytes: bytes) -> int:
        at = self._length
        self._length += len(self._decoder.decode(token_bytes))
        return at


class _Endpoint:
    """/v1/completions or /v1/chat/completions: parse, generate, shape the answer."""

    def __init__(self, servicer: Any, live: _Live, *, chat: bool) -> None:
        self.servicer = servicer
        self.live = live
        self.chat = chat
        self.name = "openai.chat.completions" if chat else "openai.completions"
        self.object = "chat.completion" if chat else "text_completion"

    def _count(self, code: str) -> None:
        self.servicer.stage.metrics.requests(rpc=self.name, code=code).inc()

    def _refuse(self, exc: SkippyError) -> Response:
        self._count(status_for(exc)[0].name)
        log.info("openai request refused", endpoint=self.name, error=str(exc))
        return error_response(exc)

    def _choice(self, index: int, text: str | None, finish_reason: str | None, *, delta: dict | None = None,
                logprobs: dict | None = None) -> dict[str, Any]:
        if self.chat:
            body = {"delta": delta} if delta is not None else {"message": {"role": "assistant", "content": text}}
            return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _logprobs(self, pieces: list[Piece], offsets: _TextOffsets) -> dict | None:
        """OpenAI's logprobs of ``pieces``' tokens: chat's ``content`` list (token, logprob, bytes,
        top_logprobs), or completions' parallel lists (llama-cpp-python's shape; ``offsets``: where
        each token's text starts, carried across a stream's chunks). A non-finite value is null."""
        lps = [lp for piece in pieces for lp in piece.logprobs]
        if not lps:
            return None
        return self._logprob_lists(lps, offsets)

    def _logprob_lists(self, lps: list[TokenLogprob | None], offsets: _TextOffsets,
                       tokens_of: list[int] | None = None) -> dict:
        """The logprobs of ``lps`` (``tokens_of``: the token of each, for a None entry: the first of a
        prompt, which nothing precedes)."""
        token_bytes = self.servicer.stage.runtime.tokenizer.token_bytes

        def text(token: int) -> str:
            return token_bytes(token).decode("utf-8", errors="ignore")

        def num(value: float) -> float | None:
            return value if math.isfinite(value) else None

        if self.chat:
            return {"content": [{"token": text(lp.token), "logprob": num(lp.logprob),
                                 "bytes": list(token_bytes(lp.token)),
                                 "top_logprobs": [{"token": text(t), "logprob": num(v), "bytes": list(token_bytes(t))}
                                                  for t, v in lp.top]} for lp in lps]}
        tokens, values, starts, top = [], [], [], []
        for i, lp in enumerate(lps):
            token = lp.token if lp is not None else tokens_of[i]
            starts.append(offsets.next(token_bytes(token)))
            tokens.append(text(token))
            values.append(None if lp is None else num(lp.logprob))
            if lp is None:
                top.append(None)
                continue
            alternatives = {text(t): num(v) for t, v in lp.top}
            alternatives[tokens[-1]] = num(lp.logprob)
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top, "text_offset": starts}

    def _prompt_logprobs(self, prompt: PromptLogprobs, offsets: _TextOffsets) -> dict:
        """The echoed prompt's logprobs, as llama-cpp-python lists them: without BOS tokens, the first
        token's null (OpenAI's convention)."""
        bos = self.servicer.stage.runtime.tokenizer.bos_token
        kept = [(t, lp) for t, lp in zip(prompt.tokens, prompt.logprobs) if t != bos]
        lps = [None, *(lp for _, lp in kept[1:])] if kept else []
        return self._logprob_lists(lps, offsets, [t for t, _ in kept])

    @staticmethod
    def _joined(first: dict | None, then: dict | None) -> dict | None:
        if first is None or then is None:
            return first or then
        return {key: first[key] + then[key] for key in first}

    async def handle(self, request: Request) -> Response:
        started = time.perf_counter()
        try:
            body = await _read_json(request)
            parsed = parse_request(body, chat=self.chat)
            generator = await asyncio.to_thread(_ready_generator, self.servicer)
            spec = parsed.spec(generator.max_context, generator.runtime.session_limit_hint)
        except SkippyError as exc:
            return self._refuse(exc)
        generation = _Generation(generator, spec, self.live, parsed.n)
        watcher = asyncio.create_task(generation.watch(request))
        head = {"id": ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": _model_id(self.servicer)}
        try:
            # The first event comes before any byte is sent, so refusals (a full queue, a
            # down chain, a prompt too long) get their own HTTP status, streaming or not.
            first = await generation.next()
        except SkippyError as exc:
            watcher.cancel()
            generation.cancel()
            return self._refuse(exc)
        except BaseException:
            watcher.cancel()
            generation.cancel()
            raise
        if parsed.stream:
            stream = self._stream(head, parsed, generation, first, watcher, started)
            return StreamingResponse(stream, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        pieces: list[list[Piece]] = [[] for _ in range(parsed.n)]
        finishes: dict[int, Finish] = {}
        prompt_lps: PromptLogprobs | None = None
        try:
            item = first
            while item is not None:
                index, event = item
                if isinstance(event, Piece):
                    pieces[index].append(event)
                elif isinstance(event, PromptLogprobs):
                    prompt_lps = event
                else:
                    finishes[index] = event
                    if len(finishes) == parsed.n:
                        break
                item = await generation.next()
        except SkippyError as exc:
            return self._refuse(exc)
        finally:
            watcher.cancel()
            generation.cancel()
        if len(finishes) < parsed.n:  # the client went away
            return Response(status_code=499)
        ends = [finishes[i] for i in range(parsed.n)]
        self._done(ends, started)
        prompt = parsed.prompt or ""
        choices = []
        for index, (done, got) in enumerate(zip(ends, pieces)):
            logprobs = None
            if parsed.top_logprobs is not None:
                offsets = _TextOffsets(0 if parsed.echo else len(prompt))
                echoed = self._prompt_logprobs(prompt_lps, offsets) if parsed.echo and prompt_lps else None
                logprobs = self._joined(echoed, self._logprobs(got, offsets))
            text = "".join(piece.text for piece in got)
            choices.append(self._choice(index, prompt + text if parsed.echo else text, done.reason,
                                        logprobs=logprobs))
        return JSONResponse({**head, "object": self.object, "choices": choices, "usage": _usage(ends)})

    async def _stream(self, head: dict[str, Any], parsed: OpenAIRequest, generation: _Generation,
                      first: tuple[int, Piece | Finish] | None, watcher: asyncio.Task,
                      started: float) -> AsyncIterator[bytes]:
        chunk = {**head, "object": self.object + ".chunk" if self.chat else self.object}
        if parsed.include_usage:
            chunk["usage"] = None
        try:
            echo_lps = parsed.echo and parsed.top_logprobs is not None
            # The echoed prompt's logprobs come with its first choice's events (the others' may come first)
            early: list[tuple[int, Piece | Finish | PromptLogprobs]] = []
            item = first
            while echo_lps and item is not None and not isinstance(item[1], PromptLogprobs):
                early.append(item)
                item = await generation.next()
            prompt_lps = item[1] if echo_lps and item is not None else None
            if echo_lps and item is not None:
                item = early.pop(0) if early else await generation.next()
            offsets = [_TextOffsets(0 if parsed.echo else len(parsed.prompt or "")) for _ in range(parsed.n)]
            if first is not None:
                for index in range(parsed.n):
                    if self.chat:
                        yield _sse({**chunk, "choices": [self._choice(index, None, None,
                                                                      delta={"role": "assistant", "content": ""})]})
                    if parsed.echo and parsed.prompt:
                        logprobs = self._prompt_logprobs(prompt_lps, offsets[index]) if prompt_lps else None
                        yield _sse({**chunk, "choices": [self._choice(index, parsed.prompt, None, logprobs=logprobs)]})
            finishes: dict[int, Finish] = {}
            while item is not None:
                index, event = item
                if isinstance(event, PromptLogprobs):
                    pass
                elif isinstance(event, Piece):
                    if event.text or event.logprobs:
                        delta = {"content": event.text} if self.chat else None
                        logprobs = (self._logprobs([event], offsets[index]) if parsed.top_logprobs is not None
                                    else None)
                        yield _sse({**chunk, "choices": [self._choice(index, event.text, None, delta=delta,
                                                                      logprobs=logprobs)]})
                else:
                    finishes[index] = event
                    yield _sse({**chunk, "choices": [self._choice(index, "" if not self.chat else None, event.reason,
                                                                  delta={} if self.chat else None)]})
                    if len(finishes) == parsed.n:
                        break
                item = early.pop(0) if early else await generation.next()
            if len(finishes) == parsed.n:
                ends = [finishes[i] for i in range(parsed.n)]
                self._done(ends, started)
                if parsed.include_usage:
                    yield _sse({**chunk, "choices": [], "usage": _usage(ends)})
                yield b"data: [DONE]\n\n"
        except SkippyError as exc:
            # Headers are sent: the error travels as an event, as OpenAI's streams do.
            self._refuse(exc)
            error = http_error_for(exc)
            yield _sse(_error_body(str(exc), error.type, getattr(exc, "param", None), error.code))
        finally:
            watcher.cancel()
            generation.cancel()

    def _done(self, finishes: list[Finish], started: float) -> None:
        self._count("OK")
        log.info("openai generate", endpoint=self.name, session_id=finishes[0].session_id, choices=len(finishes),
                 prompt_tokens=finishes[0].prompt_tokens,
                 completion_tokens=sum(f.completion_tokens for f in finishes),
                 finish=[f.reason for f in finishes], seconds=round(time.perf_counter() - started, 3))


async def _read_json(request: Request) -> object:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise InvalidFieldError(None, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise InvalidFieldError(None, f"the request body is not valid JSON: {exc}") from None


class _BearerToken:
    """Refuses every request without ``Authorization: Bearer <token>`` (the stage's auth_token_path).

    The openai client sends its ``api_key`` this way.
    """

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # /health answers without it, as the gRPC health service does: probes carry no token.
        if scope["type"] == "http" and scope.get("path") != "/health":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self._expected):
                body = _error_body("missing or wrong bearer token in the Authorization header",
                                   "invalid_request_error", code="invalid_api_key")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(servicer: Any, live: _Live | None = None, *, token: str | None = None) -> Starlette:
    """The ASGI app over a head's StageServicer; with ``token``, every request must carry it."""
    live = _Live() if live is None else live

    async def models(_request: Request) -> Response:
        model = {"id": _model_id(servicer), "object": "model", "created": 0, "owned_by": "skippy-stage"}
        return JSONResponse({"object": "list", "data": [model]})

    async def health(_request: Request) -> Response:
        """200 only while this stage serves and the whole chain below answers: the gRPC health
        service's truth; 503 with the reason otherwise."""
        stage = servicer.stage
        if stage.ready:
            return JSONResponse({"status": "ok", "stage_id": stage.config.stage_id})
        reason = (f"stage {stage.config.stage_id} is {stage.state.value}" if stage.state.value != "serving"
                  else f"the chain below {stage.config.stage_id} is not ready: {stage.downstream_health.detail}")
        if stage.credentials.token:  # the probe carries no token: no endpoints or errors for it
            reason = f"stage {stage.config.stage_id} or the chain below it is not ready"
        return JSONResponse({"status": "unavailable", "stage_id": stage.config.stage_id, "reason": reason},
                            status_code=503)

    async def metrics(_request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(servicer.stage.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", _Endpoint(servicer, live, chat=False).handle, methods=["POST"]),
        Route("/v1/chat/completions", _Endpoint(servicer, live, chat=True).handle, methods=["POST"]),
    ]
    middleware = [Middleware(_BearerToken, token=token)] if token else []
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: _http_exception, Exception: _unexpected})


# -- the server ------------------------------------------------------------------------


class OpenAIServer:
    """uvicorn on a background thread of the stage process, serving :func:`build_app`."""

    def __init__(self, servicer: Any, *, host: str, port: int, grace_s: float = 5.0) -> None:
        self.servicer = servicer
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self.grace_s = grace_s
        self._live = _Live()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        """Bind, start serving, and return once the socket listens (port 0: see ``port``)."""
        cfg = self.servicer.stage.config
        # The same credentials as the gRPC listener: its TLS certificate (and client CA), its token.
        credentials = Credentials.from_config(cfg)
        tls: dict[str, Any] = {}
        if cfg.tls_cert_path is not None:
            tls = {"ssl_certfile": cfg.tls_cert_path, "ssl_keyfile": cfg.tls_key_path}
            if cfg.tls_ca_path is not None:
                tls.update(ssl_ca_certs=cfg.tls_ca_path, ssl_cert_reqs=ssl.CERT_REQUIRED)
        app = build_app(self.servicer, self._live, token=credentials.token)
        config = uvicorn.Config(app, loop="asyncio", http="h11", ws="none", lifespan="off", log_config=None,
                                access_log=False, timeout_graceful_shutdown=5, **tls)
        try:
            config.load()  # here, so that a bad certificate fails the start with its reason
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"stage {cfg.stage_id}: the OpenAI API cannot load its TLS files: {exc}") from None
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.requested_port))
            sock.listen(2048)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"stage {cfg.stage_id}: http_port={self.requested_port} cannot be bound on "
                              f"{self.host}: {exc.strerror or exc}") from None
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="openai-http",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop(0)
                sock.close()
                raise ConfigError(f"stage {cfg.stage_id}: the OpenAI API did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        log.info("openai api listening", stage_id=cfg.stage_id, host=self.host, port=self.port,
                 tls=bool(tls), token=credentials.token is not None)

    def stop(self, grace_s: float | None = None) -> None:
        """Let generations in flight finish within ``grace_s``, end the rest with a 503, stop.

        New requests meanwhile get 503 from the draining stage (``_head`` refuses them).
        """
        if self._server is None or self._thread is None:
            return
        deadline = time.monotonic() + (self.grace_s if grace_s is None else grace_s)
        while self._live.snapshot() and time.monotonic() < deadline:
            time.sleep(0.05)
        config = self.servicer.stage.config
        left = self._live.snapshot()
        for generation in left:
            generation.abort(DownstreamError(f"stage {config.stage_id} is shutting down; retry on another replica",
                                             stage_id=config.stage_id))
        if left:
            log.warning("openai api: generations cut by shutdown", stage_id=config.stage_id, count=len(left))
        self._server.should_exit = True
        self._thread.join(10)
        self._server = None
        self._thread = None
