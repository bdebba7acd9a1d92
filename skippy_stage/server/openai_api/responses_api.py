"""/v1/responses, the OpenAI Responses API: a parsed request (``responses_request``) run as a chat
completion through the chat path (its rendering, tool calls and grammars, ``generation``), its
events shaped into a Response object, or its server-sent events as they come::

    response.created, response.in_progress,
      response.output_item.added (message), response.content_part.added,
        response.output_text.delta..., response.output_text.done,
      response.content_part.done, response.output_item.done,
      response.output_item.added (function_call), response.function_call_arguments.delta...,
        response.function_call_arguments.done, response.output_item.done, ...
    response.completed (or response.incomplete: max_output_tokens reached)

each ``event: <type>`` with ``data`` carrying ``type`` and ``sequence_number``. The generated text is
read by the chat path's ``CallReader`` (text, then calls) and turned into output items by
:class:`ResponseOutput`; a response that is not streamed is the same events' items, so a stream and
a whole answer agree by construction.

:class:`ResponseStore` is the head's memory of stored responses (``store``, the default): each
one's Response object and its whole conversation, so that ``previous_response_id`` continues it
(re-rendered, so the resident prefix of the last turn is reused: ``cached_tokens``) and
``GET``/``DELETE /v1/responses/{id}`` find it. It is bounded and forgets the oldest first.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from skippy_stage.errors import InvalidFieldError, SkippyError
from skippy_stage.head.generator import Finish, Piece
from skippy_stage.head.tasks import FINISH_LENGTH
from skippy_stage.server.openai_api.endpoint import _model_id, _ready_generator, name_image_fields
from skippy_stage.server.openai_api.generation import _Generation, _Live, begin, read_whole, sse_response
from skippy_stage.server.openai_api.http_errors import CountedEndpoint, _error_body, error_response, http_error_for
from skippy_stage.server.openai_api.request import _read_json, fetch_images
from skippy_stage.server.openai_api.responses_request import (
    ResponsesRequest,
    parse_responses_request,
    responses_names,
)
from skippy_stage.server.openai_api.tools import CallReader

log = structlog.get_logger("skippy_stage.openai_api")

PATH = "/v1/responses"
MAX_STORED_RESPONSES = 256
# The characters of the stored conversations, each counted whole (a chain of responses shares its
# items, so this bounds the memory from above): past it the oldest are forgotten.
MAX_STORED_CHARS = 64 * 2**20


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


# ---------------------------------------------------------------------------------------------
# The store

@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as answered
    conversation: tuple[dict[str, str], ...]  # its input items (after the one it continued), then its output's
    chars: int  # the conversation's text, for the store's budget


def conversation_chars(items: tuple[dict[str, Any], ...]) -> int:
    """What a conversation holds: its strings' characters (an image's URL counted whole)."""
    def chars(value: object) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, dict):
            return sum(chars(v) for v in value.values())
        if isinstance(value, list):
            return sum(chars(v) for v in value)
        return 0

    return sum(chars(item) for item in items)


class ResponseStore:
    """Stored responses by id, at most ``max_responses`` of them and ``max_chars`` of conversation
    text, the oldest forgotten first. Called from the event loop and from nowhere else, but state
    behind a lock all the same: nothing here waits while holding it."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS) -> None:
        self.max_responses = max_responses
        self.max_chars = max_chars
        self._lock = threading.Lock()
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keep ``stored``; False (not kept) if its conversation alone exceeds the budget."""
        if stored.chars > self.max_chars:
            return False
        with self._lock:
            self._drop(response_id)
            self._items[response_id] = stored
            self._chars += stored.chars
            while len(self._items) > self.max_responses or self._chars > self.max_chars:
                self._drop(next(iter(self._items)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def _drop(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is not None:
            self._chars -= stored.chars
        return stored is not None


# ---------------------------------------------------------------------------------------------
# Output items and their events

class ResponseOutput:
    """Generated text in, Responses output items and their stream events out.

    The text goes through the chat path's ``CallReader`` when the answer may hold calls (``reader``),
    whose deltas are content or a call's start and argument fragments: content opens a message item
    (if none is open), a call closes the open item and opens a function_call item. Items are
    opened as their first delta comes; an answer with nothing in it is one empty message. Events
    are dicts without ``sequence_number`` (the stream numbers them).
    """

    def __init__(self, reader: CallReader | None) -> None:
        self._reader = reader
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None

    def feed(self, text: str) -> list[dict[str, Any]]:
        deltas = self._reader.feed(text) if self._reader is not None else ([{"content": text}] if text else [])
        return [event for delta in deltas for event in self._delta(delta)]

    def end(self, finish: Finish) -> list[dict[str, Any]]:
        """The events left when the generation ends: held-back deltas, the last item's close (as
        incomplete if max_output_tokens cut it)."""
        events = [event for delta in (self._reader.end() if self._reader is not None else [])
                  for event in self._delta(delta)]
        if not self.items:
            events += self._open_message()
        events += self._close("incomplete" if finish.reason == FINISH_LENGTH else "completed")
        return events

    def _delta(self, delta: dict[str, Any]) -> Iterator[dict[str, Any]]:
        if delta.get("content"):
            if self._open is None or self._open["type"] != "message":
                yield from self._close("completed")
                yield from self._open_message()
            item = self._open
            item["content"][0]["text"] += delta["content"]
            yield {"type": "response.output_text.delta", "item_id": item["id"], "output_index": len(self.items) - 1,
                   "content_index": 0, "delta": delta["content"], "logprobs": []}
        for call in delta.get("tool_calls", []):
            function = call["function"]
            if "id" in call:  # a new call
                yield from self._close("completed")
                item = {"id": _id("fc_"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                        "name": function["name"], "arguments": ""}
                yield from self._add(item)
            item = self._open
            assert item is not None and item["type"] == "function_call"
            if function.get("arguments"):
                item["arguments"] += function["arguments"]
                yield {"type": "response.function_call_arguments.delta", "item_id": item["id"],
                       "output_index": len(self.items) - 1, "delta": function["arguments"]}

    def _add(self, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self.items.append(item)
        self._open = item
        yield {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)}

    def _open_message(self) -> Iterator[dict[str, Any]]:
        item = {"id": _id("msg_"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        yield from self._add(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        yield {"type": "response.content_part.added", "item_id": item["id"], "output_index": len(self.items) - 1,
               "content_index": 0, "part": _copy(part)}
        item["content"].append(part)

    def _close(self, status: str) -> Iterator[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return
        index = len(self.items) - 1
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            yield {"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                   "content_index": 0, "text": part["text"], "logprobs": []}
            yield {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                   "content_index": 0, "part": _copy(part)}
        else:
            yield {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                   "arguments": item["arguments"]}
        yield {"type": "response.output_item.done", "output_index": index, "item": _copy(item)}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))


def output_conversation(items: list[dict[str, Any]]) -> tuple[dict[str, str], ...]:
    """A response's output items in the conversation's normal form (``responses_request``)."""
    out = []
    for item in items:
        if item["type"] == "message":
            out.append({"type": "message", "role": "assistant",
                        "content": "".join(part["text"] for part in item["content"])})
        else:
            out.append({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                        "arguments": item["arguments"]})
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# The endpoint

def _usage(finish: Finish) -> dict[str, Any]:
    return {"input_tokens": finish.prompt_tokens,
            # resident prefixes are implicit: nothing is written to a cache on request
            "input_tokens_details": {"cached_tokens": finish.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": finish.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": finish.prompt_tokens + finish.completion_tokens}


class ResponsesEndpoint(CountedEndpoint):
    """POST /v1/responses, GET and DELETE /v1/responses/{id}: parse, generate, shape, store."""

    name = "openai.responses"

    def __init__(self, servicer: Any, live: _Live, store: ResponseStore | None = None) -> None:
        self.servicer = servicer
        self.live = live
        self.store = ResponseStore() if store is None else store

    def _not_found(self, response_id: str, param: str | None) -> Response:
        """404 in OpenAI's shape: the id was never stored here, or was forgotten, or deleted."""
        if param == "previous_response_id":
            message, code = f"Previous response with id '{response_id}' not found.", "previous_response_not_found"
        else:
            message, code = f"Response with id '{response_id}' not found.", None
        return JSONResponse(_error_body(message, "invalid_request_error", param, code), status_code=404)

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if request.query_params.get("stream") not in (None, "false"):
            return error_response(InvalidFieldError("stream", "stream=true (replaying a response's events) is not "
                                                              "supported by this server"))
        stored = self.store.get(response_id)
        if stored is None:
            return self._not_found(response_id, None)
        return JSONResponse(stored.response)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(response_id):
            return self._not_found(response_id, None)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def create(self, request: Request) -> Response:
        started = time.perf_counter()
        chat = None
        try:
            parsed = parse_responses_request(await _read_json(request))
            history: tuple[dict[str, str], ...] = ()
            if parsed.previous_response_id is not None:
                previous = self.store.get(parsed.previous_response_id)
                if previous is None:
                    self._count("NOT_FOUND")
                    return self._not_found(parsed.previous_response_id, "previous_response_id")
                history = previous.conversation
            conversation = history + parsed.items
            chat, tools = parsed.chat(conversation)
            generator = await asyncio.to_thread(_ready_generator, self.servicer)
            media = await asyncio.to_thread(fetch_images, chat.images, allow_urls=generator.stage.config.media_url_fetch) \
                if chat.images else ()
            with responses_names():
                spec = chat.spec(generator.max_context, generator.runtime.session_limit_hint, media)
                if tools is not None:
                    spec = tools.render(spec, generator.runtime.tokenizer.metadata("tokenizer.chat_template"))
        except SkippyError as exc:
            return self._refuse(name_image_fields(exc, chat.images) if chat is not None else exc)
        response = self._skeleton(parsed, tools.parallel if tools is not None else bool(parsed.parallel_tool_calls))
        reader = tools.reader() if tools is not None and tools.reads_calls else None
        try:
            generation, watcher, first = await begin(generator, spec, self.live, request)
        except SkippyError as exc:
            return self._refuse(name_image_fields(exc, chat.images))
        if parsed.stream:
            return sse_response(self._stream(response, parsed, conversation, ResponseOutput(reader), generation,
                                             first, watcher, started))
        output = ResponseOutput(reader)
        try:
            finish = await read_whole(generation, watcher, first, output.feed)
        except SkippyError as exc:
            return self._refuse(exc)
        if finish is None:  # the client went away
            return Response(status_code=499)
        output.end(finish)
        self._finish(response, parsed, conversation, output, finish, started)
        return JSONResponse(response)

    def _skeleton(self, parsed: ResponsesRequest, parallel: bool) -> dict[str, Any]:
        """The Response object before any output: what ``response.created`` carries."""
        body = parsed.body
        return {
            "id": _id("resp_"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": False, "error": None, "incomplete_details": None, "instructions": parsed.instructions,
            "max_output_tokens": parsed.max_output_tokens, "max_tool_calls": None, "model": _model_id(self.servicer),
            "output": [], "parallel_tool_calls": parallel,
            "previous_response_id": parsed.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "store": parsed.store, "temperature": parsed.temperature,
            "text": {"format": parsed.text_format}, "tool_choice": parsed.tool_choice, "tools": list(parsed.tools),
            "top_p": parsed.top_p, "truncation": "disabled", "usage": None, "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }

    def _finish(self, response: dict[str, Any], parsed: ResponsesRequest, conversation: tuple[dict[str, str], ...],
                output: ResponseOutput, finish: Finish, started: float) -> None:
        """Complete ``response`` with the output and usage, and store it if asked."""
        incomplete = finish.reason == FINISH_LENGTH
        response.update(status="incomplete" if incomplete else "completed", output=[_copy(item) for item in output.items],
                        incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                        usage=_usage(finish))
        if parsed.store:
            whole = conversation + output_conversation(output.items)
            self.store.put(response["id"], StoredResponse(response=response, conversation=whole,
                                                          chars=conversation_chars(whole)))
        self._count("OK")
        log.info("openai generate", endpoint=self.name, session_id=finish.session_id,
                 prompt_tokens=finish.prompt_tokens, cached_tokens=finish.cached_tokens,
                 completion_tokens=finish.completion_tokens, finish=finish.reason, items=len(output.items),
                 seconds=round(time.perf_counter() - started, 3))

    async def _stream(self, response: dict[str, Any], parsed: ResponsesRequest,
                      conversation: tuple[dict[str, str], ...], output: ResponseOutput, generation: _Generation,
                      first: tuple[int, object] | None, watcher: asyncio.Task, started: float) -> AsyncIterator[bytes]:
        sequence = 0

        def sse(event: dict[str, Any]) -> bytes:
            nonlocal sequence
            data = {"type": event["type"], "sequence_number": sequence, **event}
            sequence += 1
            return f"event: {event['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

        try:
            if first is None:  # the client went away before the first token
                return
            yield sse({"type": "response.created", "response": _copy(response)})
            yield sse({"type": "response.in_progress", "response": _copy(response)})
            item = first
            while item is not None:
                _, event = item
                if isinstance(event, Piece):
                    for out in output.feed(event.text):
                        yield sse(out)
                elif isinstance(event, Finish):
                    for out in output.end(event):
                        yield sse(out)
                    self._finish(response, parsed, conversation, output, event, started)
                    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
                    yield sse({"type": kind, "response": response})
                    return
                item = await generation.next()
        except SkippyError as exc:
            # Headers are sent: the error travels as events, as OpenAI's streams do.
            self._refuse(exc)
            error = http_error_for(exc)
            yield sse({"type": "error", "code": error.code or error.type, "message": str(exc),
                       "param": getattr(exc, "param", None)})
            response.update(status="failed", error={"code": "server_error", "message": str(exc)},
                            output=[_copy(item) for item in output.items])
            yield sse({"type": "response.failed", "response": response})
        finally:
            watcher.cancel()
            generation.cancel()
