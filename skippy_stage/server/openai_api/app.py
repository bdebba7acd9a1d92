"""The starlette app of the OpenAI API: its routes (/health, /metrics, /v1/models and the two
generation endpoints), the bearer-token check and the error handlers."""

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

from skippy_stage.server.openai_api.endpoint import _Endpoint, _model_id
from skippy_stage.server.openai_api.generation import _Live
from skippy_stage.server.openai_api.http_errors import _error_body, _http_exception, _unexpected


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
