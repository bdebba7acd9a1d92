"""The one mapping from domain errors to gRPC status codes (the gRPC edge, the TCP frame
listener and the back channel's HopReplies all use it)."""

from __future__ import annotations

import grpc

from skippy_stage.errors import (
    CapacityError,
    ConfigError,
    DownstreamError,
    InvalidRequestError,
    RuntimeFailure,
    SessionStateError,
    SkippyError,
    StageUnavailableError,
    UnknownSessionError,
    UnsupportedModelError,
)

_CODES: tuple[tuple[type[SkippyError], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (SessionStateError, grpc.StatusCode.FAILED_PRECONDITION),
    (UnsupportedModelError, grpc.StatusCode.FAILED_PRECONDITION),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
    (UnknownSessionError, grpc.StatusCode.NOT_FOUND),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StageUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (RuntimeFailure, grpc.StatusCode.INTERNAL),
)

# gRPC carries the status message percent-encoded in metadata (up to 12 bytes per character)
# and starts dropping metadata past 8 KiB: a message repeating a huge client value would turn
# into RESOURCE_EXHAUSTED on the way and hide the real code. 512 characters stay under 6 KiB.
MAX_STATUS_MESSAGE = 512


def status_for(exc: SkippyError) -> tuple[grpc.StatusCode, str]:
    """The status code of a domain error, and its message (capped at MAX_STATUS_MESSAGE)."""
    message = str(exc)
    if len(message) > MAX_STATUS_MESSAGE:
        message = message[: MAX_STATUS_MESSAGE - 20] + " ...(truncated)"
    if isinstance(exc, DownstreamError):
        return getattr(grpc.StatusCode, exc.code_name, grpc.StatusCode.UNAVAILABLE), message
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, message
    return grpc.StatusCode.INTERNAL, message
