"""The pipelines the bench measures: ``serve`` processes on loopback, all started alike, and
kept out of each other's way while one of them is measured (``_awake``)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from skippy_stage.cli.bench.workload import PROMPT
from skippy_stage.cli.client import generate
from skippy_stage.cli.local import LocalPipeline, free_ports, pipeline_configs, relay_links
from skippy_stage.cli.settings import apply_settings
from skippy_stage.errors import SkippyError
from skippy_stage.server import wake_latency

if TYPE_CHECKING:
    from skippy_stage.ops.link import ChainRelays, Link

# ``bench --set``: applied to the stages of every pipeline a phase starts (see run).
SETTINGS: list[str] = []

T = TypeVar("T")


def wake_latency_setting() -> int | None:
    """The ``cpu_wake_latency_us`` every bench stage holds: 0 (idle CPUs poll) where this process
    may ask the kernel, the host's own idle policy otherwise. The request is host-wide, so the
    single process, measured while pipelines are up, runs under it too.
    SKIPPY_BENCH_WAKE_LATENCY_US overrides: a number, or "host" to leave the host's policy."""
    override = os.environ.get("SKIPPY_BENCH_WAKE_LATENCY_US")
    if override:
        return None if override == "host" else int(override)
    return 0 if wake_latency.may_request() else None


def stage_threads(n_stages: int) -> int:
    """llama.cpp threads per local stage, as `up` gives them (all cores: only a busy stage
    spins); SKIPPY_BENCH_STAGE_THREADS overrides, e.g. 1 for cores/stages on 2 cores."""
    override = os.environ.get("SKIPPY_BENCH_STAGE_THREADS")
    return int(override) if override else (os.cpu_count() or 1)


class _Pipeline:
    """One pipeline of local ``serve`` processes, each stage with a metrics port the bench scrapes."""

    def __init__(self, model: Path, ranges: list[tuple[int, int]], workdir: Path, cache_dir: str,
                 transport: str | None = None, return_path: str = "direct", prefix_cache: bool = False,
                 kv_unified: bool | None = None, native_frames: bool = True, extra: dict | None = None,
                 link: Link | None = None, per_stage: list[dict] | None = None) -> None:
        """``prefix_cache`` off by default: the decode and prefill figures send the same prompt
        again and again, which resident prefixes would answer without a prefill. ``link``: every
        edge of the chain through the link emulator (``relays``), in this process. ``per_stage``:
        settings of one stage each, in order from the head (fewer than the stages: the rest take
        none), over ``extra`` and ``bench --set``'s: a projector at the head, MTP at the final stage."""
        threads = self.threads = stage_threads(len(ranges))
        ports = free_ports("127.0.0.1", 2 * len(ranges))
        ports, self.metrics_ports = ports[: len(ranges)], ports[len(ranges) :]
        configs = pipeline_configs(str(model), ranges, host="127.0.0.1", ports=ports, extra={
            "n_threads": threads, "lane_count": 8, "ctx_size": 8 * 2048, "cache_dir": cache_dir,
            **({"hop_transport": transport} if transport else {}),
            **({} if prefix_cache else {"cache_idle_slots": 0}),
            **({} if kv_unified is None else {"kv_unified": kv_unified}),
            "cpu_wake_latency_us": wake_latency_setting(), "native_frames": native_frames, **(extra or {}),
        }, return_path=return_path)
        configs = apply_settings(configs, SETTINGS)
        for cfg, own in zip(configs, per_stage or []):
            cfg.update(own)
        for cfg, port in zip(configs, self.metrics_ports):
            cfg["metrics_port"] = port
        self.relays: ChainRelays | None = relay_links(configs, link) if link is not None else None
        try:
            # The report, not every request's log line of every stage (warnings still show).
            self.local = LocalPipeline(configs, workdir, links=self.relays, log_level="warning")
        except BaseException:
            if self.relays is not None:
                self.relays.close()
            raise
        try:
            self.local.wait_serving(300)
        except BaseException:
            self.local.stop()
            raise
        self.endpoint = self.local.head_endpoint

    def generate(self, prompt: str, max_tokens: int) -> dict[str, float]:
        return generate(self.endpoint, prompt, max_tokens=max_tokens, temperature=0.0, seed=None, chat=False,
                         out=io.StringIO())

    def stop(self) -> None:
        self.local.stop()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until a one-token generation goes through: a pipeline just resumed (``_awake``) has
        stages whose health probes of their neighbours lapsed while it was stopped."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.generate(PROMPT, 1)
                return
            except SkippyError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


@contextlib.contextmanager
def _awake(pipelines, measured: _Pipeline | None):
    """Only ``measured``'s stages run (None: no pipeline's): the others are stopped (SIGSTOP)
    until the block ends. An idle stage process still wakes ~100 times a second (gRPC's thread
    pool, health probes), on the cores the measured decode uses; a host serving one pipeline has
    no idle ones beside it. Once woken, a pipeline serves a token before it is measured."""
    frozen = [proc for pipeline in pipelines if pipeline is not measured for proc in pipeline.local.procs
              if proc.poll() is None]
    for proc in frozen:
        proc.send_signal(signal.SIGSTOP)
    try:
        if measured is not None:
            measured.wait_ready()
        yield
    finally:
        for proc in frozen:
            proc.send_signal(signal.SIGCONT)


def after_freeze(measure: Callable[[], T], attempts: int = 3) -> T:
    """``measure()``, again (after a pause) when it failed because a stage was not ready. A stage
    frozen by ``_awake`` mid health probe finds the probe lapsed once it runs again and reports
    NOT_SERVING until its next probe (then the stage above it does the same for one round): a
    generation a moment after the resume can hit that, even after ``wait_ready`` saw one succeed."""
    for _ in range(attempts - 1):
        try:
            return measure()
        except (RuntimeError, SkippyError) as exc:
            if "is not ready" not in str(exc):
                raise
            time.sleep(1.5)  # past the lapsed probe's round and the next one above it
    return measure()
