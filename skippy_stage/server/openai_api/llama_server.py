"""llama-server's own endpoints, in its shapes, over the head's tokenizer:

* ``POST /tokenize``: ``{"content", "add_special": false, "parse_special": true, "with_pieces": false}``
  -> ``{"tokens": [ids]}``, or with pieces ``{"tokens": [{"id", "piece"}]}`` (a piece that is not
  whole UTF-8 comes as its bytes, a list of ints);
* ``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"content"}``; an id outside the vocabulary is
  refused naming it (llama.cpp would abort the process on it);
* ``GET /props``: the model, the context one session holds, the chat template, and what this
  server answers.

Pieces and detokenized text render control tokens as their text (``<|im_end|>``), as llama-server
does, so that tokenize -> detokenize gives the text back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from skippy_stage import __version__
from skippy_stage.errors import InvalidFieldError, SkippyError
from skippy_stage.model.tokenizer import Tokenizer
from skippy_stage.server.openai_api.endpoint import _model_id
from skippy_stage.server.openai_api.http_errors import error_response
from skippy_stage.server.openai_api.request import _json_kind, _read_json, _show


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise InvalidFieldError(name, f"{name} must be a boolean, got {_json_kind(value)} ({_show(value)})")
    return value


def _object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidFieldError(None, f"the request body must be a JSON object, got {_json_kind(body)}")
    return body


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def _token_ids(value: object, n_vocab: int) -> list[int]:
    if not isinstance(value, list):
        raise InvalidFieldError("tokens", f"tokens must be an array of token ids, got {_json_kind(value)}")
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int):
            raise InvalidFieldError("tokens", f"tokens[{i}]={_show(token)} must be a token id (an integer)")
        if not 0 <= token < n_vocab:
            raise InvalidFieldError("tokens", f"tokens[{i}]={token} is outside this model's vocabulary [0, {n_vocab})")
    return value


def _tokenize(tokenizer: Tokenizer, body: dict[str, Any]) -> list[int] | list[dict[str, Any]]:
    content = body.get("content")
    if not isinstance(content, str):
        raise InvalidFieldError("content", f"content must be a string, got {_json_kind(content)}")
    tokens = tokenizer.tokenize(content, add_special=_flag(body, "add_special", False),
                                parse_special=_flag(body, "parse_special", True))
    if not _flag(body, "with_pieces", False):
        return tokens
    return [{"id": t, "piece": _piece(tokenizer.token_bytes(t, special=True))} for t in tokens]


def _detokenize(tokenizer: Tokenizer, body: dict[str, Any]) -> str:
    tokens = _token_ids(body.get("tokens", []), tokenizer.n_vocab)
    return b"".join(tokenizer.token_bytes(t, special=True) for t in tokens).decode("utf-8", errors="replace")


class LlamaServerEndpoints:
    """/tokenize, /detokenize and /props over the head's runtime."""

    def __init__(self, servicer: Any) -> None:
        self.servicer = servicer

    async def tokenize(self, request: Request) -> Response:
        try:
            body = _object(await _read_json(request))
            tokenizer = self.servicer.stage.require_runtime().tokenizer
            tokens = await asyncio.to_thread(_tokenize, tokenizer, body)
        except SkippyError as exc:
            return error_response(exc)
        return JSONResponse({"tokens": tokens})

    async def detokenize(self, request: Request) -> Response:
        try:
            body = _object(await _read_json(request))
            tokenizer = self.servicer.stage.require_runtime().tokenizer
            content = await asyncio.to_thread(_detokenize, tokenizer, body)
        except SkippyError as exc:
            return error_response(exc)
        return JSONResponse({"content": content})

    async def props(self, request: Request) -> Response:
        """What a client may ask of this head: llama-server's fields that hold here, and nothing it
        would have to guess (no sampling defaults: each API applies its own)."""
        try:
            runtime = self.servicer.stage.require_runtime()
        except SkippyError as exc:
            return error_response(exc)
        config = self.servicer.stage.config
        tokenizer = runtime.tokenizer
        arch = tokenizer.metadata("general.architecture")
        trained = tokenizer.metadata(f"{arch}.context_length") if arch else None

        def text(token: int) -> str | None:
            return tokenizer.token_text(token) if token >= 0 else None

        endpoints = [f"{method} {route.path}" for route in request.app.routes if isinstance(route, Route)
                     for method in sorted(route.methods or ()) if method != "HEAD"]
        return JSONResponse({
            "model": _model_id(self.servicer),
            "model_path": config.model_path,
            "model_file": Path(config.model_path).name,
            # one session's KV cells: the most a prompt and its answer together may take
            "n_ctx": runtime.cells_per_lane,
            "n_ctx_train": int(trained) if trained and trained.isdigit() else None,
            "n_vocab": tokenizer.n_vocab,
            "total_slots": config.lane_count,
            "default_generation_settings": {"n_ctx": runtime.cells_per_lane},
            "chat_template": tokenizer.metadata("tokenizer.chat_template") or "",
            "bos_token": text(tokenizer.bos_token),
            "eos_token": text(tokenizer.eos_token),
            "modalities": {"vision": False, "audio": False},
            "endpoints": endpoints,
            "build_info": f"skippy-stage {__version__}",
        })
