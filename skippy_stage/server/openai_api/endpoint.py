"""/v1/completions and /v1/chat/completions: a parsed request run as a generation, and its
events shaped into OpenAI's answer: one JSON body, or server-sent events as they come."""

from __future__ import annotations

import asyncio
import codecs
import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from skippy_stage.errors import DownstreamError, InvalidFieldError, SkippyError
from skippy_stage.head.generator import Finish, Generator, Piece
from skippy_stage.head.tasks import PromptLogprobs
from skippy_stage.model.logprobs import TokenLogprob
from skippy_stage.server.openai_api.generation import _Generation, _Live, begin, sse_response
from skippy_stage.server.openai_api.http_errors import CountedEndpoint, _error_body, http_error_for
from skippy_stage.server.openai_api.request import OpenAIRequest, _read_json, fetch_images, parse_request
from skippy_stage.server.openai_api.tools import ToolUse, parse_tools

log = structlog.get_logger("skippy_stage.openai_api")


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


def name_image_fields(exc: SkippyError, images: tuple) -> SkippyError:
    """A refusal of ``media[i]`` (the head's name for a request's i-th image) renamed for the message
    part that carried it (``messages[0].content[1].image_url.url``), as the client wrote it."""
    if not images or not isinstance(exc, InvalidFieldError) or not (exc.param or "").startswith("media"):
        return exc
    match = re.fullmatch(r"media\[(\d+)\]", exc.param)
    where = images[int(match[1])].where if match is not None and int(match[1]) < len(images) else images[0].where
    message = str(exc)
    return InvalidFieldError(where, message.replace(exc.param, where) if exc.param in message else f"{where}: {message}")


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


class _Endpoint(CountedEndpoint):
    """/v1/completions or /v1/chat/completions: parse, generate, shape the answer."""

    def __init__(self, servicer: Any, live: _Live, *, chat: bool) -> None:
        self.servicer = servicer
        self.live = live
        self.chat = chat
        self.name = "openai.chat.completions" if chat else "openai.completions"
        self.object = "chat.completion" if chat else "text_completion"

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
            tools = parse_tools(body, chat=self.chat)
            generator = await asyncio.to_thread(_ready_generator, self.servicer)
            media = await asyncio.to_thread(fetch_images, parsed.images,
                                            allow_urls=generator.stage.config.media_url_fetch) \
                if parsed.images else ()
            spec = parsed.spec(generator.max_context, generator.runtime.session_limit_hint, media)
            if tools is not None:
                spec = tools.render(spec, generator.runtime.tokenizer.metadata("tokenizer.chat_template"))
        except SkippyError as exc:
            return self._refuse(exc)
        head = {"id": ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                "model": _model_id(self.servicer)}
        try:
            generation, watcher, first = await begin(generator, spec, self.live, request, parsed.n)
        except SkippyError as exc:
            return self._refuse(name_image_fields(exc, parsed.images))
        if parsed.stream:
            stream = self._stream(head, parsed, generation, first, watcher, started, tools)
            return sse_response(stream)
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
            if tools is not None and tools.reads_calls:
                message, reason = tools.answer(text, done.reason)
                choices[-1].update(message=message, finish_reason=reason)
        return JSONResponse({**head, "object": self.object, "choices": choices, "usage": _usage(ends)})

    async def _stream(self, head: dict[str, Any], parsed: OpenAIRequest, generation: _Generation,
                      first: tuple[int, Piece | Finish] | None, watcher: asyncio.Task,
                      started: float, tools: ToolUse | None = None) -> AsyncIterator[bytes]:
        chunk = {**head, "object": self.object + ".chunk" if self.chat else self.object}
        # each choice's text read for tool calls, sent as OpenAI's tool_calls deltas
        readers = [tools.reader() for _ in range(parsed.n)] if tools is not None and tools.reads_calls else None
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
                        if readers is None:
                            deltas = [delta]
                        else:  # content and tool_calls deltas; the logprobs go with the first (or alone)
                            deltas = readers[index].feed(event.text) or ([{}] if logprobs else [])
                        for j, delta in enumerate(deltas):
                            yield _sse({**chunk, "choices": [self._choice(index, event.text, None, delta=delta,
                                                                          logprobs=logprobs if j == 0 else None)]})
                else:
                    finishes[index] = event
                    reason = event.reason
                    if readers is not None:
                        for delta in readers[index].end():
                            yield _sse({**chunk, "choices": [self._choice(index, None, None, delta=delta)]})
                        reason = readers[index].finish_reason(reason)
                    yield _sse({**chunk, "choices": [self._choice(index, "" if not self.chat else None, reason,
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
