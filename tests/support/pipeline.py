"""Helpers for tests that talk to real stage processes over gRPC (``start_pipeline``)."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from skippy_stage.model.loader import reference_llama
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def add(a, b):",
]


def reference_texts(model, prompts, max_tokens):
    llm = reference_llama(model, n_ctx=2048, verbose=False)
    try:
        return [llm.create_completion(p, max_tokens=max_tokens, temperature=0)["choices"][0]["text"] for p in prompts]
    finally:
        llm.close()


def grpc_generate(endpoint: str, prompt: str, max_tokens: int, timeout: float = 120,
                  sampling: pb.SamplingParams | None = None) -> tuple[str, pb.GenerateResponse]:
    with grpc.insecure_channel(endpoint) as channel:
        stub = pb_grpc.StageServiceStub(channel)
        text, last = [], None
        request = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, sampling=sampling)
        for msg in stub.Generate(request, timeout=timeout):
            text.append(msg.text)
            last = msg
        return "".join(text), last


def status(endpoint: str) -> pb.StageStatus:
    with grpc.insecure_channel(endpoint) as channel:
        return pb_grpc.StageServiceStub(channel).GetStatus(pb.GetStatusRequest(), timeout=5)


def endpoints_of(configs) -> list[str]:
    """The gRPC endpoints of a pipeline's stages (its config dicts, or endpoints already)."""
    return [c if isinstance(c, str) else str(c["bind_addr"]) for c in configs]


def wait_no_active_sessions(configs, within_s: float = 5.0) -> list[int]:
    """Each stage's active sessions once none is left, or after ``within_s``: finished and
    cancelled sessions are freed by the head's scheduler a moment after their last token."""
    endpoints = endpoints_of(configs)
    deadline = time.monotonic() + within_s
    while True:
        active = [status(e).active_sessions for e in endpoints]
        if not any(active) or time.monotonic() > deadline:
            return active
        time.sleep(0.05)


def assert_no_active_sessions(configs, within_s: float = 5.0) -> None:
    assert wait_no_active_sessions(configs, within_s) == [0] * len(configs)


def scrape(port: int) -> str:
    """A stage's Prometheus metrics, as text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """The sample ``name`` whose labels include ``labels`` (Prometheus text format)."""
    for line in text.splitlines():
        match = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(match.group(3))
    raise AssertionError(f"{name} {labels} not in metrics:\n{text}")


class StreamingRun:
    """A Generate streaming on its own thread (the one helper for it).

    ``pieces`` so far; ``streaming`` is set at the first text, ``started`` after
    ``after_pieces`` pieces (both also when the call ends); ``outcome`` holds the final
    message (``"done"``) or the error (``"error"``); ``began``/``ended`` are monotonic times,
    ``arrived`` each piece's.
    """

    def __init__(self, endpoint: str, prompt: str, max_tokens: int, after_pieces: int = 8,
                 timeout: float = 120, sampling: pb.SamplingParams | None = None) -> None:
        self.pieces: list[str] = []
        self.arrived: list[float] = []
        self.streaming = threading.Event()
        self.started = threading.Event()
        self.outcome: dict[str, object] = {}
        self.began = time.monotonic()
        self.ended: float | None = None
        self._channel = grpc.insecure_channel(endpoint)
        self.call = pb_grpc.StageServiceStub(self._channel).Generate(
            pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, sampling=sampling), timeout=timeout)
        self._after = after_pieces
        self.worker = threading.Thread(target=self._consume, daemon=True)
        self.worker.start()

    def _consume(self) -> None:
        try:
            for msg in self.call:
                if msg.text:
                    self.arrived.append(time.monotonic())
                    self.pieces.append(msg.text)
                    self.streaming.set()
                if len(self.pieces) >= self._after:
                    self.started.set()
                if msg.done:
                    self.outcome["done"] = msg
        except grpc.RpcError as err:
            self.outcome["error"] = err
        finally:
            self.ended = time.monotonic()
            self.streaming.set()
            self.started.set()
            self._channel.close()

    @property
    def error(self) -> grpc.RpcError | None:
        return self.outcome.get("error")  # type: ignore[return-value]

    def cancel(self) -> None:
        self.call.cancel()

    def join(self, timeout: float) -> None:
        self.worker.join(timeout)
        assert not self.worker.is_alive(), "Generate neither streamed to the end nor failed"


@dataclass
class StageHandle:
    """One stage of a running pipeline, with its own channel and stubs (``handles``)."""

    index: int
    config: dict[str, object]
    channel: grpc.Channel
    stub: pb_grpc.StageServiceStub
    health: health_pb2_grpc.HealthStub
    timeout_s: float = 30.0

    @property
    def stage_id(self) -> str:
        return str(self.config["stage_id"])

    def status(self) -> pb.StageStatus:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=self.timeout_s)

    def health_status(self, service: str = "") -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.timeout_s).status


def handles(configs, timeout_s: float = 30.0) -> list[StageHandle]:
    """A handle on every stage of a pipeline (close their channels when done)."""
    out = []
    for index, cfg in enumerate(configs):
        channel = grpc.insecure_channel(str(cfg["bind_addr"]))
        out.append(StageHandle(index, cfg, channel, pb_grpc.StageServiceStub(channel),
                               health_pb2_grpc.HealthStub(channel), timeout_s))
    return out
