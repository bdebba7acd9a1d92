"""The starlette app of the head's HTTP API: its routes (/health, /metrics, /v1/models, the
OpenAI generation endpoints and /v1/responses, Anthropic's /v1/messages, llama-server's /tokenize,
/detokenize and /props), the token check and the error handlers (in Anthropic's shape under
/v1/messages)."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from skippy_stage.server.openai_api import anthropic_messages, responses_api
from skippy_stage.server.openai_api.anthropic_messages import MessagesEndpoint, anthropic_error_body
from skippy_stage.server.openai_api.endpoint import _Endpoint, _model_id
from skippy_stage.server.openai_api.generation import _Live
from skippy_stage.server.openai_api.http_errors import _error_body, _http_exception, _unexpected
from skippy_stage.server.openai_api.llama_server import LlamaServerEndpoints
from skippy_stage.server.openai_api.responses_api import ResponsesEndpoint


def _anthropic(request: Request) -> bool:
    """Whether a request is one of Anthropic's API, whose errors take its shape."""
    return request.url.path.startswith(anthropic_messages.PATH)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    if _anthropic(request):
        return await anthropic_messages.anthropic_http_exception(request, exc)
    return await _http_exception(request, exc)


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    response = await _unexpected(request, exc)  # logs it
    return anthropic_messages.anthropic_unexpected(exc) if _anthropic(request) else response


class _BearerToken:
    """Refuses every request without the token (the stage's auth_token_path), given as
    ``Authorization: Bearer <token>`` (the openai client's ``api_key``) or ``x-api-key: <token>``
    (Anthropic's header; its clients send one or the other).
    """

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._bearer = f"Bearer {token}".encode()
        self._key = token.encode()

    def _carries_token(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])  # names come lower-cased
        # both compared whatever is given, so the time taken does not tell which header was close
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), self._bearer)
        key = hmac.compare_digest(headers.get(b"x-api-key", b""), self._key)
        return bearer or key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # /health answers without it, as the gRPC health service does: probes carry no token.
        if scope["type"] == "http" and scope.get("path") != "/health" and not self._carries_token(scope):
            message = "missing or wrong token: give it as Authorization: Bearer <token> or x-api-key: <token>"
            if scope.get("path", "").startswith(anthropic_messages.PATH):
                body = anthropic_error_body(message, "authentication_error")
            else:
                body = _error_body(message, "invalid_request_error", code="invalid_api_key")
            await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


def build_app(servicer: Any, live: _Live | None = None, *, token: str | None = None) -> Starlette:
    """The ASGI app over a head's StageServicer; with ``token``, every request must carry it."""
    live = _Live() if live is None else live

    async def models(_request: Request) -> Response:
        model = {"id": _model_id(servicer), "object": "model", "created": 0, "owned_by": "skippy-stage",
                 # what the head takes besides text (llama.cpp's server lists "multimodal" the same way)
                 "capabilities": ["completion", *(["multimodal"] if servicer.stage.config.projector_path else [])]}
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

    messages = MessagesEndpoint(servicer, live)
    llama_server = LlamaServerEndpoints(servicer)
    responses = ResponsesEndpoint(servicer, live)
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", _Endpoint(servicer, live, chat=False).handle, methods=["POST"]),
        Route("/v1/chat/completions", _Endpoint(servicer, live, chat=True).handle, methods=["POST"]),
        Route(responses_api.PATH, responses.create, methods=["POST"]),
        Route(f"{responses_api.PATH}/{{response_id}}", responses.retrieve, methods=["GET"]),
        Route(f"{responses_api.PATH}/{{response_id}}", responses.delete, methods=["DELETE"]),
        Route(anthropic_messages.PATH, messages.handle, methods=["POST"]),
        Route(f"{anthropic_messages.PATH}/count_tokens", messages.count_tokens, methods=["POST"]),
        Route("/tokenize", llama_server.tokenize, methods=["POST"]),
        Route("/detokenize", llama_server.detokenize, methods=["POST"]),
        Route("/props", llama_server.props, methods=["GET"]),
    ]
    middleware = [Middleware(_BearerToken, token=token)] if token else []
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={HTTPException: _on_http_exception, Exception: _on_unexpected})
