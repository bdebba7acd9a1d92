"""OpenAI-compatible HTTP API at the head (placeholder: being written)."""

from __future__ import annotations


class OpenAIServer:
    def __init__(self, servicer, *, host: str, port: int) -> None:  # noqa: ANN001
        raise NotImplementedError("the OpenAI-compatible API is not built yet")
