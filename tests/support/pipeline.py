"""Helpers for tests that talk to real stage processes over gRPC (``start_pipeline``)."""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import grpc

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


def grpc_generate(endpoint: str, prompt: str, max_tokens: int, timeout: float = 120) -> tuple[str, pb.GenerateResponse]:
    with grpc.insecure_channel(endpoint) as channel:
        stub = pb_grpc.StageServiceStub(channel)
        text, last = [], None
        for msg in stub.Generate(pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens), timeout=timeout):
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
    """A Generate streaming in a thread; ``started`` is set after ``after_pieces`` pieces."""

    def __init__(self, endpoint: str, prompt: str, max_tokens: int, after_pieces: int = 8) -> None:
        self.pieces: list[str] = []
        self.started = threading.Event()
        self.outcome: dict[str, object] = {}

        def run() -> None:
            with grpc.insecure_channel(endpoint) as channel:
                try:
                    for msg in pb_grpc.StageServiceStub(channel).Generate(
                            pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens), timeout=120):
                        self.pieces.append(msg.text)
                        if len(self.pieces) >= after_pieces:
                            self.started.set()
                        if msg.done:
                            self.outcome["done"] = msg
                except grpc.RpcError as err:
                    self.outcome["error"] = err
                self.started.set()

        self.worker = threading.Thread(target=run)
        self.worker.start()
