"""Time to first token over a multi-turn chat, with resident prefixes and without: what the
prefix cache saves a conversation."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np

from skippy_stage.cli.bench.pipeline import _Pipeline
from skippy_stage.cli.bench.workload import DECODE_ROUNDS, QUICK, THREE
from skippy_stage.v1 import stage_pb2 as pb
from skippy_stage.v1 import stage_pb2_grpc as pb_grpc

# A 4-turn chat over a long system message: each turn's prompt holds every turn before it.
CHAT_SYSTEM = ("You are a careful assistant for a shipping company. " * (6 if QUICK else 40)).strip()
CHAT_TURNS = ["Where is my parcel?", "It was sent on Monday from Berlin.", "How long does it usually take?",
              "Thank you, and can I change the address?"]
CHAT_TOKENS = 8 if QUICK else 24


def _turns_ttft(pipeline: _Pipeline, turns: list[str], max_tokens: int) -> list[float]:
    """Seconds to the first piece of text of each turn of one conversation (gRPC Generate)."""
    messages: list[pb.ChatMessage] = [pb.ChatMessage(role="system", content=CHAT_SYSTEM)]
    ttft = []
    with grpc.insecure_channel(pipeline.endpoint) as channel:
        stub = pb_grpc.StageServiceStub(channel)
        for question in turns:
            messages.append(pb.ChatMessage(role="user", content=question))
            request = pb.GenerateRequest(max_tokens=max_tokens, messages=messages,
                                         sampling=pb.SamplingParams(temperature=0.0))
            started, first, reply = time.perf_counter(), None, []
            for msg in stub.Generate(request, timeout=300):
                if msg.text:
                    first = first or time.perf_counter() - started
                    reply.append(msg.text)
            ttft.append(first if first is not None else time.perf_counter() - started)
            messages.append(pb.ChatMessage(role="assistant", content="".join(reply)))
    return ttft


def _chat_ttft(model: Path, workdir: Path, cache_dir: str) -> dict[str, list[float]]:
    """The same 4-turn chat on 3 stages with resident prefixes and without: time to first token
    per turn (median of the rounds)."""
    out: dict[str, list[list[float]]] = {"with_prefix_cache": [], "without_prefix_cache": []}
    for name, enabled in (("with_prefix_cache", True), ("without_prefix_cache", False)):
        (workdir / f"chat-{name}").mkdir()
        pipeline = _Pipeline(model, THREE, workdir / f"chat-{name}", cache_dir,
                             prefix_cache=enabled, kv_unified=False)
        try:
            _turns_ttft(pipeline, ["Hello."], 1)  # warm
            for _ in range(DECODE_ROUNDS):
                out[name].append(_turns_ttft(pipeline, CHAT_TURNS, CHAT_TOKENS))
        finally:
            pipeline.stop()
    return {name: [float(np.median(turn)) for turn in zip(*runs)] for name, runs in out.items()}
