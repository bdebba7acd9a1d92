"""Domain errors as HTTP statuses, in one place: :func:`http_error_for`, on top of the gRPC
edge's own mapping (``stage.status.status_for``)::

    InvalidRequestError, bad JSON, wrong type       -> 400 invalid_request_error
    CapacityError (lanes and admission queue full)  -> 429 rate_limit_error (+ Retry-After)
    DownstreamError, StageUnavailableError           -> 503 server_error (+ Retry-After)
    anything else                                   -> 500 server_error
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from skippy_stage.errors import DownstreamError, SkippyError
from skippy_stage.stage.status import status_for

log = structlog.get_logger("skippy_stage.openai_api")


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


class CountedEndpoint:
    """An HTTP endpoint of the head: every answer counted by its name and status code in the stage's
    request metrics, a refusal logged and answered in the API's error shape (``error_response``:
    OpenAI's; an API with its own shape overrides it)."""

    name = "http"
    servicer: Any

    def error_response(self, exc: SkippyError) -> Response:
        return error_response(exc)

    def _count(self, code: str) -> None:
        self.servicer.stage.metrics.requests(rpc=self.name, code=code).inc()

    def _refuse(self, exc: SkippyError) -> Response:
        self._count(status_for(exc)[0].name)
        log.info("http request refused", endpoint=self.name, error=str(exc))
        return self.error_response(exc)
