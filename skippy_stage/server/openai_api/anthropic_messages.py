"""/v1/messages, the Anthropic Messages API: a parsed request (``anthropic_request``) run as a
generation through the same path as chat completions (``generation``), its events shaped into
Anthropic's answer: one message, or its server-sent events as they come::

    message_start, content_block_start, ping, content_block_delta (text_delta)...,
    content_block_stop, message_delta (stop_reason, usage), message_stop

and errors in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, mapped from
the HTTP edge's own mapping (``http_errors.http_error_for``)::

    400 invalid_request_error    401 authentication_error    404 not_found_error
    529 overloaded_error (lanes and admission queue full, + Retry-After)
    503 api_error (a stage down or draining, + Retry-After)    504 timeout_error    500 api_error

/v1/messages/count_tokens answers how many tokens the rendered conversation takes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from skippy_stage.errors import SkippyError
from skippy_stage.head.generator import Finish, GenerateSpec, Piece
from skippy_stage.head.tasks import FINISH_LENGTH
from skippy_stage.model.sampling import SamplingParams
from skippy_stage.server.openai_api.anthropic_request import (
    MessagesRequest,
    parse_conversation,
    parse_messages_request,
)
from skippy_stage.server.openai_api.endpoint import _model_id, _ready_generator, name_image_fields
from skippy_stage.server.openai_api.generation import _Generation, _Live, begin, read_whole, sse_response
from skippy_stage.server.openai_api.http_errors import CountedEndpoint, _retry_after_s, http_error_for
from skippy_stage.server.openai_api.request import ImagePart, _read_json, fetch_images

log = structlog.get_logger("skippy_stage.openai_api")

PATH = "/v1/messages"
_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 504: "timeout_error"}


def anthropic_error_body(message: str, error_type: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type, "message": message}}


def _status_and_type(exc: SkippyError) -> tuple[int, str]:
    status = http_error_for(exc).status
    if status == 429:  # every lane and the admission queue are full: Anthropic's "overloaded"
        return 529, "overloaded_error"
    return status, _TYPE_BY_STATUS.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_response(exc: SkippyError) -> JSONResponse:
    status, error_type = _status_and_type(exc)
    headers = {"Retry-After": str(_retry_after_s(exc))} if status in (503, 529) else None
    return JSONResponse(anthropic_error_body(str(exc), error_type), status_code=status, headers=headers)


async def anthropic_http_exception(_request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route under /v1/messages, a wrong method) in Anthropic's shape."""
    assert isinstance(exc, HTTPException)
    error_type = _TYPE_BY_STATUS.get(exc.status_code, "invalid_request_error")
    return JSONResponse(anthropic_error_body(str(exc.detail), error_type), status_code=exc.status_code,
                        headers=exc.headers)


def anthropic_unexpected(exc: Exception) -> Response:
    return JSONResponse(anthropic_error_body(f"internal error: {type(exc).__name__}", "api_error"), status_code=500)


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


def _stop(finish: Finish) -> dict[str, str | None]:
    """Anthropic's stop_reason (and stop_sequence) of a finished generation."""
    if finish.stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": finish.stop_sequence}
    return {"stop_reason": "max_tokens" if finish.reason == FINISH_LENGTH else "end_turn", "stop_sequence": None}


def _tool_use_id(call_id: str) -> str:
    """Anthropic's id for a call the reader named ``call_<hex>``."""
    return "toolu_" + call_id.removeprefix("call_")


def _content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message (``CallReader.message``) as Anthropic's content blocks: its text, then a
    ``tool_use`` block per call (its arguments parsed: the grammar, or the reader, made them JSON)."""
    blocks = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    for call in message.get("tool_calls", ()):
        fn = call["function"]
        try:
            arguments = json.loads(fn["arguments"] or "{}")
        except ValueError:
            arguments = {}
        blocks.append({"type": "tool_use", "id": _tool_use_id(call["id"]), "name": fn["name"], "input": arguments})
    return blocks


class _BlockStream:
    """A tool-reading answer's stream: the reader's chat deltas as Anthropic's content blocks, each
    started when its first delta comes and stopped when the next begins (text, then tool_use blocks
    whose ``input`` arrives as ``input_json_delta`` fragments)."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self.stop()
        self.index += 1
        self.kind = block["type"]
        return [*out, _event("content_block_start", {"index": self.index, "content_block": block})]

    def stop(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def events(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        out: list[bytes] = []
        for delta in deltas:
            if delta.get("content"):
                if self.kind != "text":
                    out += self._start({"type": "text", "text": ""})
                out.append(_event("content_block_delta", {"index": self.index,
                                                          "delta": {"type": "text_delta", "text": delta["content"]}}))
            for call in delta.get("tool_calls", ()):
                fn = call.get("function", {})
                if "id" in call:
                    out += self._start({"type": "tool_use", "id": _tool_use_id(call["id"]), "name": fn["name"],
                                        "input": {}})
                if fn.get("arguments"):
                    out.append(_event("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": fn["arguments"]}}))
        return out


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic counts the prompt tokens read from a cache apart from the others, as llama-server does."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_read_input_tokens": cached_tokens,
            "output_tokens": output_tokens}


class MessagesEndpoint(CountedEndpoint):
    """POST /v1/messages and /v1/messages/count_tokens: parse, generate (or count), shape the answer."""

    name = "anthropic.messages"

    def __init__(self, servicer: Any, live: _Live) -> None:
        self.servicer = servicer
        self.live = live

    def error_response(self, exc: SkippyError) -> Response:
        return anthropic_error_response(exc)

    async def count_tokens(self, request: Request) -> Response:
        try:
            images: list[ImagePart] = []
            messages, tools = parse_conversation(await _read_json(request), counting=True, images=images)
            generator = await asyncio.to_thread(self.servicer.head)
            media = await asyncio.to_thread(fetch_images, tuple(images),
                                            allow_urls=generator.stage.config.media_url_fetch) if images else ()
            spec = GenerateSpec(prompt=None, messages=tuple(messages), max_tokens=1, sampling=SamplingParams(), stop=(),
                                media=media)
            if tools is not None:
                spec = tools.render(spec, generator.runtime.tokenizer.metadata("tokenizer.chat_template"))
            tokens = await asyncio.to_thread(generator.prompt_tokens, spec)
        except SkippyError as exc:
            return self._refuse(name_image_fields(exc, tuple(images)))
        return JSONResponse({"input_tokens": len(tokens)})

    async def handle(self, request: Request) -> Response:
        started = time.perf_counter()
        try:
            parsed = parse_messages_request(await _read_json(request))
            generator = await asyncio.to_thread(_ready_generator, self.servicer)
            media = await asyncio.to_thread(fetch_images, parsed.images,
                                            allow_urls=generator.stage.config.media_url_fetch) \
                if parsed.images else ()
            spec = parsed.spec(generator.max_context, generator.runtime.session_limit_hint, media)
            if parsed.tools is not None:
                spec = parsed.tools.render(spec, generator.runtime.tokenizer.metadata("tokenizer.chat_template"))
        except SkippyError as exc:
            return self._refuse(exc)
        message = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
                   "model": _model_id(self.servicer)}
        try:
            generation, watcher, first = await begin(generator, spec, self.live, request)
        except SkippyError as exc:
            return self._refuse(name_image_fields(exc, parsed.images))
        if parsed.stream:
            return sse_response(self._stream(message, parsed, generation, first, watcher, started))
        text: list[str] = []
        try:
            finish = await read_whole(generation, watcher, first, text.append)
        except SkippyError as exc:
            return self._refuse(exc)
        if finish is None:  # the client went away
            return Response(status_code=499)
        self._done(finish, started)
        content = [{"type": "text", "text": "".join(text)}]
        stop = _stop(finish)
        if parsed.tools is not None and parsed.tools.reads_calls:
            answer, reason = parsed.tools.answer("".join(text), finish.reason)
            content = _content_blocks(answer)
            if reason == "tool_calls":
                stop = {"stop_reason": "tool_use", "stop_sequence": None}
        return JSONResponse({**message, "content": content, **stop,
                             "usage": _usage(finish.prompt_tokens, finish.cached_tokens, finish.completion_tokens)})

    async def _stream(self, message: dict[str, Any], parsed: MessagesRequest, generation: _Generation,
                      first: tuple[int, object] | None, watcher: asyncio.Task, started: float) -> AsyncIterator[bytes]:
        try:
            if first is None:  # the client went away before the first token
                return
            prompt_tokens, cached_tokens = generation.prompt_tokens()
            yield _event("message_start", {"message": {**message, "content": [], "stop_reason": None,
                                                       "stop_sequence": None,
                                                       "usage": _usage(prompt_tokens, cached_tokens, 0)}})
            reader = parsed.tools.reader() if parsed.tools is not None and parsed.tools.reads_calls else None
            blocks = _BlockStream()
            if reader is None:
                yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
            yield _event("ping", {})
            item = first
            while item is not None:
                _, event = item
                if isinstance(event, Piece) and event.text:
                    if reader is not None:
                        for chunk in blocks.events(reader.feed(event.text)):
                            yield chunk
                    else:
                        yield _event("content_block_delta", {"index": 0,
                                                             "delta": {"type": "text_delta", "text": event.text}})
                elif isinstance(event, Finish):
                    stop = _stop(event)
                    if reader is not None:
                        for chunk in [*blocks.events(reader.end()), *blocks.stop()]:
                            yield chunk
                        if reader.finish_reason(event.reason) == "tool_calls":
                            stop = {"stop_reason": "tool_use", "stop_sequence": None}
                    else:
                        yield _event("content_block_stop", {"index": 0})
                    yield _event("message_delta", {"delta": stop, "usage": _usage(
                        event.prompt_tokens, event.cached_tokens, event.completion_tokens)})
                    yield _event("message_stop", {})
                    self._done(event, started)
                    return
                item = await generation.next()
        except SkippyError as exc:
            # Headers are sent: the error travels as an event, as Anthropic's streams do.
            self._refuse(exc)
            yield _event("error", {"error": {"type": _status_and_type(exc)[1], "message": str(exc)}})
        finally:
            watcher.cancel()
            generation.cancel()

    def _done(self, finish: Finish, started: float) -> None:
        self._count("OK")
        log.info("anthropic generate", endpoint=self.name, session_id=finish.session_id,
                 prompt_tokens=finish.prompt_tokens, completion_tokens=finish.completion_tokens, finish=finish.reason,
                 seconds=round(time.perf_counter() - started, 3))
