"""The exception tree of skippy-stage, and nothing else.

Errors are raised where they are detected, as one of these types; the gRPC edge maps
them to status codes in exactly one place (``stage.status.status_for``; the HTTP edge maps
those to HTTP in ``server.openai_api.http_errors.http_error_for``), so a newcomer can read
here what a client may see::

    SkippyError
    ├── ConfigError               bad stage config               -> (start-up failure)
    │   └── ModelFileError        the GGUF is unusable: names the file, the key, the fault
    ├── PlanError                 ``plan``'s input is wrong       -> (``plan`` fails)
    │   └── DoesNotFitError       the nodes cannot hold the model: says by how much
    ├── UnsupportedModelError     architecture not proven        -> FAILED_PRECONDITION
    ├── SliceError                a GGUF could not be sliced     -> (start-up failure)
    ├── InvalidRequestError       a client field is wrong        -> INVALID_ARGUMENT
    │   └── InvalidFieldError     ... naming it for OpenAI's ``param``
    ├── SessionStateError         request out of session order   -> FAILED_PRECONDITION
    │   └── PrefixMissError       the named resident prefix is gone (the head re-prefills)
    ├── UnknownSessionError       session not on this stage      -> NOT_FOUND
    ├── CapacityError             no lane or KV cells left       -> RESOURCE_EXHAUSTED
    ├── StageUnavailableError     this stage is loading/draining -> UNAVAILABLE
    ├── DownstreamError           the next stage failed          -> UNAVAILABLE (names it)
    └── RuntimeFailure            llama.cpp refused a valid call -> INTERNAL

Every message names the field (or resource) and the offending value, because the
person reading it is usually an operator with only the log line in front of them.
"""

from __future__ import annotations


class SkippyError(Exception):
    """Root of every error this package raises on purpose."""


class ConfigError(SkippyError):
    """A stage config is malformed; the message names stage_id, field and value."""


class ModelFileError(ConfigError):
    """A GGUF cannot serve as a model: not GGUF, or a key llama.cpp or the slicer needs is missing
    or malformed. The message names the file, the key and what is wrong, because the person who
    reads it must fix (or replace) the file, not the config."""


class PlanError(SkippyError):
    """A plan cannot be made as asked: a bad node list, model file or setting."""


class DoesNotFitError(PlanError):
    """The nodes cannot hold the model as asked; the message says by how much, and ``brief`` says
    it in a few words (a candidate's row in ``plan``'s table)."""

    def __init__(self, message: str, *, brief: str) -> None:
        super().__init__(message)
        self.brief = brief


class UnsupportedModelError(SkippyError):
    """The model's architecture (or shape) has no equivalence proof, so it is refused."""


class SliceError(SkippyError):
    """A stage file could not be written or read back."""


class InvalidRequestError(SkippyError):
    """A client-supplied field is invalid; nothing reached llama.cpp."""


class InvalidFieldError(InvalidRequestError):
    """A request field is invalid; ``param`` names it for OpenAI's error shape."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class SessionStateError(SkippyError):
    """A request is well-formed but does not fit the session's current state."""


class PrefixMissError(SessionStateError):
    """A new session named a resident prefix this stage no longer holds (evicted, restarted).

    Its messages start with ``PREFIX_MISS`` so the head recognises one from any stage below,
    where it arrives as a FAILED_PRECONDITION status: a miss costs a full prefill, never text.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message if message.startswith(PREFIX_MISS) else f"{PREFIX_MISS} {message}")


PREFIX_MISS = "prefix miss:"


def is_prefix_miss(exc: BaseException) -> bool:
    """A prefix miss raised here, or relayed from a stage below."""
    if isinstance(exc, PrefixMissError):
        return True
    return isinstance(exc, DownstreamError) and exc.code_name == "FAILED_PRECONDITION" and PREFIX_MISS in str(exc)


class UnknownSessionError(SkippyError):
    """The session id is not bound to a lane on this stage."""


class CapacityError(SkippyError):
    """No lane or KV cells are left for the request; retrying later may succeed.

    ``retry_after_s``, when set, is how long the refusing side suggests waiting (the HTTP
    edge sends it as Retry-After)."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StageUnavailableError(SkippyError):
    """This stage cannot take work now: still loading, draining or stopped."""


class DownstreamError(SkippyError):
    """The downstream stage failed or could not be reached.

    ``stage_id`` names the stage that failed so the head can report which hop broke.
    """

    def __init__(self, message: str, stage_id: str, code_name: str = "UNAVAILABLE") -> None:
        super().__init__(message)
        self.stage_id = stage_id
        self.code_name = code_name


class RuntimeFailure(SkippyError):
    """llama.cpp rejected a call that passed validation; the stage keeps serving."""
