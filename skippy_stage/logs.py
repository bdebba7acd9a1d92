"""Structured logging: JSON lines when stderr is not a terminal, readable text when it is.

Logs go to stderr so stdout stays for results (generated text, the head endpoint).
Every line from a stage carries its stage_id and run_id (bound by the components).
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info", *, json: bool | None = None, static: dict[str, str] | None = None) -> None:
    """Set up structlog for this process.

    ``static`` fields (a stage's stage_id and run_id) are added to every line, from every
    thread: gRPC handler threads do not inherit context variables.
    """
    use_json = (not sys.stderr.isatty()) if json is None else json
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    fixed = dict(static or {})

    def add_static(_logger: object, _method: str, event: dict) -> dict:
        for key, value in fixed.items():
            event.setdefault(key, value)
        return event

    structlog.configure(
        processors=[
            add_static,
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
